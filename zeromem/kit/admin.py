"""Tenant scoping and roles for every ZeroMem page of the admin, in one base class.

A staff user sees only the tenants they hold a :class:`memories.models.Membership` in
(superusers see every tenant, acting as ``admin``), and each role may do only what
``zeromem.kernel.scopes.CAPABILITIES`` lets it (derived from the role's scopes).
:class:`TenantScopedAdmin` applies both to everything a ModelAdmin serves: change lists,
searches, filters, change/history/delete pages, actions, foreign-key choices and
autocomplete. Another tenant's object — or one the role may not open — answers 404, exactly
like a missing one.
"""

from __future__ import annotations

import functools

from django.contrib import admin, messages
from django.contrib.admin import helpers, widgets
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ERROR_FLAG, IGNORED_PARAMS, ORDER_VAR, PAGE_VAR, SEARCH_VAR, ChangeList
from django.core.exceptions import FieldDoesNotExist, PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db.models import F
from django.http import Http404, HttpResponse, HttpResponseBadRequest, HttpResponseRedirect
from django.utils.functional import cached_property
from django.views.decorators.http import require_http_methods

from memories.models import Membership, Tenant
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor, staff_actor
from zeromem.kernel.errors import NotFound, ServiceError
from zeromem.kernel.scopes import CAPABILITIES, Capability, Role
from zeromem.kit.http import client_ip


def staff_roles(request) -> dict[int, str]:
    """{tenant id: role} of the request's user; one query per request (cached on it)."""
    roles = getattr(request, "_zeromem_roles", None)
    if roles is None:
        user = request.user
        if not user.is_authenticated or not user.is_active:
            roles = {}
        elif user.is_superuser:
            roles = {pk: Role.ADMIN for pk in Tenant.objects.values_list("pk", flat=True)}
        else:
            roles = dict(Membership.objects.filter(user=user).values_list("tenant_id", "role"))
        request._zeromem_roles = roles
    return roles


def tenant_ids_with(request, capability: str) -> set[int]:
    allowed = CAPABILITIES[capability]
    return {tenant_id for tenant_id, role in staff_roles(request).items() if role in allowed}


def may(request, capability: str, tenant_id: int | None = None) -> bool:
    """May the user do ``capability`` in ``tenant_id`` (or in any tenant, when None)?"""
    ids = tenant_ids_with(request, capability)
    return bool(ids) if tenant_id is None else tenant_id in ids


def actor_for(request, tenant: Tenant | int) -> Actor:
    """The staff Actor of the request's user in ``tenant`` (its scopes follow the role)."""
    tenant_id = tenant if isinstance(tenant, int) else tenant.pk
    return staff_actor(
        user=request.user,
        role=staff_roles(request).get(tenant_id, ""),
        request_id=getattr(request, "request_id", ""),
        client_ip=client_ip(request),
    )


def service_error_text(exc: ServiceError) -> str:
    """A service's refusal as an admin message: the field it names, then why."""
    return f"{exc.field}: {exc.message}" if exc.field else exc.message


def _bad_parameter(name: str, message: str) -> HttpResponse:
    return HttpResponseBadRequest(f"{name.replace(chr(0), '')}: {message}", content_type="text/plain; charset=utf-8")


def nul_parameter_refused(request) -> HttpResponse | None:
    """A 400 naming the first query parameter that holds a NUL character, else None. The
    filters hand their values to PostgreSQL, whose text cannot hold one (a 500 otherwise)."""
    for name, values in request.GET.lists():
        if any("\x00" in value for value in values):
            return _bad_parameter(name, "must not contain a NUL character")
    return None


def refusing_nul_parameters(view):
    """``view``, answering a query parameter with a NUL character with a 400 naming it."""

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        return nul_parameter_refused(request) or view(request, *args, **kwargs)

    return wrapper


# The methods an admin page answers: Django's admin renders a change form for any method but
# POST (OPTIONS, PUT, PATCH, DELETE, TRACE…), and its pages audit their reads on GET and HEAD:
# another method showed a memory's value, the forget queue or the audit log with no record.
ADMIN_METHODS = ("GET", "HEAD", "POST")
READ_METHODS = ("GET", "HEAD")


def methods_limited(admin_view):
    """``AdminSite.admin_view``, whose views answer a method outside ``ADMIN_METHODS`` with a
    405 before anything is read (installed on the site in memories/admin/__init__.py)."""

    @functools.wraps(admin_view)
    def wrapper(view, cacheable=False):
        return require_http_methods(ADMIN_METHODS)(admin_view(view, cacheable))

    return wrapper


def posted_without_action(request, model_admin: admin.ModelAdmin) -> bool:
    """Whether ``request`` is a POST to ``model_admin``'s change list that runs none of its
    actions. Django then shows the list (searched and filtered as the URL says), as a GET
    would, but the lists audit their reads on GET and HEAD only; no list here is editable."""
    if request.method != "POST":
        return False
    if "_save" in request.POST or not model_admin.get_actions(request):
        return True
    return "index" not in request.POST and helpers.ACTION_CHECKBOX_NAME not in request.POST


# Each word of a list's search is an ILIKE over every searched column of the rows in scope
# (the memory list: every key and value of the tenant): 300 matching words took 15 s on 200k
# memories. A person's search needs a few words.
SEARCH_WORDS_MAX = 10
SEARCH_CHARS_MAX = 200


# An action works on at most this many rows per run, the first of the selection in its order
# ("select all" may hand it millions: each row is one service call, inside one request). The
# one bound of every action of the console (memories, API keys, memberships, portal links).
ACTION_MAX = 1000
# How many of a larger selection a run leaves is counted up to this many rows past its batch
# (a LIMITed count, run only when the batch is full): "select all" over millions of rows was an
# unbounded COUNT(*) per run for a number in a message; past the cap it says "more than".
ACTION_REMAINING_COUNT_CAP = 10_000


def action_remaining(queryset) -> int:
    """How many rows of ``queryset`` (ordered as the action picks its batch) lie past the first
    ``ACTION_MAX``: counted up to ``ACTION_REMAINING_COUNT_CAP`` + 1 (one LIMITed count)."""
    return queryset[ACTION_MAX : ACTION_MAX + ACTION_REMAINING_COUNT_CAP + 1].count()


def action_remaining_text(remaining: int | None, still: str, does: str = "works on", unit: str = "") -> str:
    """The warning after a run that left part of the selection: how many (``remaining`` from
    :func:`action_remaining`; None: not counted), the bound, and to run it again."""
    if remaining is None:
        counted = "more (not counted)"
    elif remaining > ACTION_REMAINING_COUNT_CAP:
        counted = f"more than {ACTION_REMAINING_COUNT_CAP:,}{unit}"
    else:
        counted = f"{remaining:,}{unit}"
    bound = f"this action {does} at most {ACTION_MAX:,}{unit} per run"
    return f"Of the selection, still to {still}: {counted} ({bound}): run it again for the rest."


# What a change list takes besides its filters' parameters: search, sort, page, show all,
# popup, the error flag Django's own redirect adds.
LIST_PARAMETERS = frozenset({*IGNORED_PARAMS, PAGE_VAR, ERROR_FLAG})


def list_parameters_refused(request, model_admin: TenantScopedAdmin) -> HttpResponse | None:
    """A 400 naming a change list's query parameter no filter can take (one that is none of
    ``model_admin``'s filters, a NUL, a tenant that is no number, a search over
    ``SEARCH_WORDS_MAX`` words or ``SEARCH_CHARS_MAX`` characters), else None. Called before
    anything is listed or audited. A POST that runs no action is refused as well (a 400 naming
    ``action``): the list is read with a GET, which is audited."""
    refused = nul_parameter_refused(request)
    # (after the permission check: one who may not see the list gets Django's 403)
    if (
        refused is None
        and model_admin.has_view_or_change_permission(request)
        and posted_without_action(request, model_admin)
    ):
        refused = _bad_parameter("action", "a list takes a POST only to run one of its actions")
    taken = LIST_PARAMETERS | model_admin.filter_parameters(request)
    unknown = next((name for name in request.GET if name not in taken), None)
    if refused is None and unknown is not None:
        refused = _bad_parameter(unknown, "is not a filter of this list")
    tenant = request.GET.get(TenantFilter.parameter_name)
    search = request.GET.get(SEARCH_VAR, "")
    if refused is None and tenant and validation.ascii_int(tenant) is None:
        refused = _bad_parameter(TenantFilter.parameter_name, "must be a tenant id (a number)")
    if refused is None and (len(search) > SEARCH_CHARS_MAX or len(search.split()) > SEARCH_WORDS_MAX):
        message = f"a search takes at most {SEARCH_WORDS_MAX} words and {SEARCH_CHARS_MAX} characters"
        refused = _bad_parameter(SEARCH_VAR, message)
    return refused


class TenantFilter(admin.SimpleListFilter):
    """The tenant filter, listing only the user's tenants (the stock RelatedFieldListFilter
    would list every tenant's name)."""

    title = "tenant"
    parameter_name = "tenant"

    def lookups(self, request, model_admin):
        ids = tenant_ids_with(request, model_admin.view_capability)
        return [(str(t.pk), t.slug) for t in Tenant.objects.filter(pk__in=ids).order_by("slug")]

    def queryset(self, request, queryset):
        if self.value():
            return queryset.filter(**{model_admin_tenant_field(queryset): self.value()})
        return queryset


def model_admin_tenant_field(queryset) -> str:
    return "pk" if queryset.model is Tenant else "tenant_id"


class InputFilter(admin.SimpleListFilter):
    """A free-text filter (subject, tag, actor…): a small form instead of a list of every
    value, which would be both long and a scan of the table."""

    template = "admin/zeromem_input_filter.html"

    def lookups(self, request, model_admin):
        return ((),)  # a non-empty lookups() makes the admin render the filter

    def choices(self, changelist):
        # The other filters' parameters, kept as hidden inputs of the filter's form.
        others = {k: v for k, v in changelist.get_filters_params().items() if k != self.parameter_name}
        yield {"value": self.value() or "", "others": [(k, v) for k, vs in others.items() for v in _listify(vs)]}


def _listify(value):
    return value if isinstance(value, list) else [value]


class CheapPaginator(Paginator):
    """Counts at most ``COUNT_CAP`` rows (a LIMITed subquery) instead of a full COUNT(*),
    which on a table of millions of rows costs seconds; past the cap the admin shows
    ``COUNT_CAP`` rows worth of pages, and filters narrow the rest."""

    COUNT_CAP = 10_000

    @cached_property
    def count(self):
        # Counted in the list's own order (a range of a tenant-led index, SortableByChangeList),
        # not unordered: for a filter the planner misjudges (a key prefix other tenants hold
        # plenty of), "the first 10,000 rows in any order" was a scan of the whole table,
        # every tenant's rows, that found none (83-158 ms at 500k memories).
        return self.object_list[: self.COUNT_CAP].count()


class SortableByChangeList(ChangeList):
    """Sorts only by the columns of the admin's ``sortable_by`` (when it names them). Django
    leaves them out of the headers only: ``o=<column>`` in the URL still sorted by any
    column, every row in scope, when only some are served by an index.

    Every order is led by the tenant, in the direction of the first sort column, and ends
    with the id in that direction too: (tenant, column, id) is how the lists' indexes hold
    rows, so a page is a range of one (a staff member of several tenants included: an index
    scan over ``tenant_id IN (…)`` comes out in tenant order). Django's order (the column,
    then ``-pk`` whatever the column's direction) sorted every row in scope for several
    tenants, and for one tenant every run of equal values (all the memories that never
    expire) on each page."""

    def get_ordering(self, request, queryset):
        ordering = super().get_ordering(request, queryset)
        if ORDER_VAR in self.params:
            # The order asked for alone: Django follows it with the list's default order (the
            # memory list's key), a sort of every run of equal values the index cannot do.
            asked = super().get_ordering(request, queryset.order_by())
            if any(not (isinstance(o, str) and o.lstrip("-") == "pk") for o in asked):
                ordering = asked
        tenant = self.model_admin.tenant_ordering_field
        if tenant is None or not ordering:
            return ordering
        first = ordering[0]
        descending = first.startswith("-") if isinstance(first, str) else bool(getattr(first, "descending", False))
        sign = "-" if descending else ""
        columns = [o for o in ordering if not (isinstance(o, str) and o.lstrip("-") in ("pk", "id", tenant))]
        return [sign + tenant, *map(self._nulls_as_postgresql, columns), sign + "pk"]

    def _nulls_as_postgresql(self, column):
        """A nullable column sorts its NULLs as PostgreSQL does by default (and as its indexes
        hold them: last going up, first going down), said outright so that SQLite, which puts
        them first going up, shows the same order (memories that never expire last)."""
        if not isinstance(column, str):
            return column
        try:
            nullable = self.model._meta.get_field(column.lstrip("-")).null
        except FieldDoesNotExist:
            return column
        if not nullable:
            return column
        if column.startswith("-"):
            return F(column[1:]).desc(nulls_first=True)
        return F(column).asc(nulls_last=True)

    def get_ordering_field(self, field_name):
        if self.sortable_by is not None and field_name not in self.sortable_by:
            return None
        return super().get_ordering_field(field_name)


class AutocompleteSelect(widgets.AutocompleteSelect):
    """Django's autocomplete widget, which looks the posted value up to show it again when
    the form comes back with errors: a value that is no id of the target (``tenant=acme``)
    raised ValueError there, a 500 in place of the form's own "select a valid choice"."""

    def optgroups(self, name, value, attr=None):
        target = self.field.target_field
        return super().optgroups(name, [v for v in value if _is_value_of(target, v)], attr)


def _is_value_of(field, raw) -> bool:
    try:
        field.to_python(raw)
    except ValidationError:
        return False
    return True


class AuditedOpeningAdmin:
    """Mixin: opening one object's page or its history (GET, HEAD) is a reading the subclass
    audits in ``_opened(request, obj)`` (through its service) before the page is shown: the
    object is this staff user's to view (another tenant's: a 404), and a refusal of the
    service is a 404 (``NotFound``) or a 403. A POST changes (audited by the service that
    changes) and shows nothing more."""

    def change_view(self, request, object_id, form_url="", extra_context=None):
        self._audit_opening(request, object_id)
        return super().change_view(request, object_id, form_url, extra_context)

    def history_view(self, request, object_id, extra_context=None):
        self._audit_opening(request, object_id)
        return super().history_view(request, object_id, extra_context)

    def _audit_opening(self, request, object_id) -> None:
        if request.method not in READ_METHODS:
            return
        obj = self.get_object(request, unquote(object_id))  # another tenant's: a 404
        if not self.has_view_permission(request, obj):
            raise PermissionDenied
        try:
            self._opened(request, obj)
        except NotFound:
            raise Http404("no such object") from None
        except ServiceError:
            raise PermissionDenied from None

    def _opened(self, request, obj) -> None:
        raise NotImplementedError


class AuditedListAdmin:
    """Mixin: reading the change list is audited in each tenant whose rows the page showed
    (with a search, in the one tenant it covers even when it found nothing) — the subclass's
    ``_list_viewed(tenant=, actor=, search=, count=)`` writes the event through its service,
    with the searched subject and how many of that tenant's rows the page showed."""

    def changelist_view(self, request, extra_context=None):
        response = super().changelist_view(request, extra_context)
        changelist = (getattr(response, "context_data", None) or {}).get("cl")
        if request.method in READ_METHODS and changelist is not None:
            self._audit_list(request, changelist.result_list)
        return response

    def _audit_list(self, request, rows) -> None:
        shown: dict[int, int] = {}
        for row in rows:
            tenant_id = self.tenant_id_of(row)
            shown[tenant_id] = shown.get(tenant_id, 0) + 1
        search = request.GET.get("q", "")
        ids = tenant_ids_with(request, self.view_capability)
        chosen = validation.ascii_int(request.GET.get("tenant") or "")
        covered = [chosen] if chosen in ids else sorted(ids)
        if not shown and search and len(covered) == 1:
            shown[covered[0]] = 0
        for tenant in Tenant.objects.filter(pk__in=shown).order_by("pk"):
            self._list_viewed(tenant=tenant, actor=actor_for(request, tenant.pk), search=search, count=shown[tenant.pk])

    def _list_viewed(self, *, tenant: Tenant, actor: Actor, search: str, count: int) -> None:
        raise NotImplementedError


class TenantScopedAdmin(admin.ModelAdmin):
    """Base of every ZeroMem ModelAdmin. Subclasses name their capabilities; the tenant is
    reached through ``tenant_field`` (``"pk"`` for the Tenant admin itself)."""

    tenant_field = "tenant"
    view_capability: str = Capability.TENANT_VIEW
    add_capability: str | None = None
    change_capability: str | None = None
    delete_capability: str | None = None

    # --- querysets ----------------------------------------------------------------------

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        return qs.filter(**{f"{self._tenant_lookup}__in": tenant_ids_with(request, self.view_capability)})

    @property
    def _tenant_lookup(self) -> str:
        return "pk" if self.tenant_field == "pk" else f"{self.tenant_field}_id"

    @property
    def tenant_ordering_field(self) -> str | None:
        """The column every order of the list starts with (SortableByChangeList); none for
        the tenants' own list."""
        return None if self.tenant_field == "pk" else f"{self.tenant_field}_id"

    def tenant_id_of(self, obj) -> int:
        return obj.pk if self.tenant_field == "pk" else getattr(obj, f"{self.tenant_field}_id")

    def get_object(self, request, object_id, from_field=None):
        obj = super().get_object(request, object_id, from_field)
        if obj is None:
            # Another tenant's object (filtered out by get_queryset) and a missing one look
            # the same: a 404, not the admin's "does not exist" redirect.
            raise Http404("no such object")
        return obj

    def changelist_view(self, request, extra_context=None):
        return list_parameters_refused(request, self) or super().changelist_view(request, extra_context)

    def filter_parameters(self, request) -> set[str]:
        """The query parameters the list's filters take: a filter class's ``parameter_name``;
        for a field named in ``list_filter``, the choices its stock filter links to."""
        names = set()
        for item in self.get_list_filter(request):
            if isinstance(item, type) and issubclass(item, admin.SimpleListFilter):
                names.add(item.parameter_name)
            elif isinstance(item, str):
                names.update({f"{item}__exact", f"{item}__isnull"})
        return names

    def lookup_allowed(self, lookup, value, request=None):
        # Django's own rule lets any parameter naming a column of the model filter on it, with
        # any lookup (?value__icontains=…, ?detail__regex=…): a search of every row in scope on
        # an unindexed column, outside the list's audited search and its caps. Only the list's
        # filters take parameters (list_parameters_refused names any other with a 400 first).
        return request is not None and lookup in self.filter_parameters(request)

    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except ServiceError as exc:
            # A refusal the form could not foresee (e.g. a concurrent write). The admin's
            # transaction was rolled back, so nothing was saved; say why and start over.
            self.message_user(request, service_error_text(exc), messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if "widget" not in kwargs and db_field.name in self.get_autocomplete_fields(request):
            kwargs["widget"] = AutocompleteSelect(db_field, self.admin_site, using=kwargs.get("using"))
        if db_field.related_model is Tenant:
            capability = self.add_capability or self.change_capability or self.view_capability
            kwargs["queryset"] = Tenant.objects.filter(pk__in=tenant_ids_with(request, capability)).order_by("slug")
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_list_filter(self, request):
        return [TenantFilter if f == "tenant" else f for f in super().get_list_filter(request)]

    def response_action(self, request, queryset):
        # The ids of the ticked rows go straight into a filter: one that is no number was a 500.
        selected = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)
        if any(validation.ascii_int(pk) is None for pk in selected):
            return _bad_parameter(helpers.ACTION_CHECKBOX_NAME, "must be ids (whole numbers)")
        return super().response_action(request, queryset)

    def get_changelist(self, request, **kwargs):
        return SortableByChangeList

    def get_paginator(self, request, queryset, per_page, orphans=0, allow_empty_first_page=True):
        return CheapPaginator(queryset, per_page, orphans, allow_empty_first_page)

    # --- permissions --------------------------------------------------------------------

    def _may(self, request, capability: str | None, obj=None) -> bool:
        if capability is None:
            return False
        return may(request, capability, None if obj is None else self.tenant_id_of(obj))

    def has_module_permission(self, request):
        return self.has_view_permission(request)

    def has_view_permission(self, request, obj=None):
        return self._may(request, self.view_capability, obj)

    def has_add_permission(self, request):
        return self._may(request, self.add_capability)

    def has_change_permission(self, request, obj=None):
        return self._may(request, self.change_capability, obj)

    def has_delete_permission(self, request, obj=None):
        return self._may(request, self.delete_capability, obj)
