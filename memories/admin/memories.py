"""Memories in the admin: the list and its actions, the edit form (checked by the service
layer's validators), the audited view of a value, its history and restoring a version."""

from __future__ import annotations

import json
import sys

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import SEARCH_VAR
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpResponseBadRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.views.decorators.http import require_POST

from memories import services
from memories.admin.display import actor_label, when
from memories.admin.memory_filters import (
    CategoryFilter,
    ExpiryFilter,
    KeyTreeFilter,
    StateFilter,
    SubjectFilter,
    TagFilter,
)
from memories.models import Memory, Tenant
from memories.services.browsing import LISTED_FILTERS
from memories.services.memories import PREVIEW_CHARS
from memories.services.retention import trash_refusals
from zeromem.kernel import validation
from zeromem.kernel.crypto import ErasedValue
from zeromem.kernel.deadlines import statement_deadline
from zeromem.kernel.errors import Conflict, InvalidInput, NotFound, ServiceError
from zeromem.kernel.scopes import Capability
from zeromem.kit import admin as kit_admin
from zeromem.kit.admin import (
    READ_METHODS,
    CheapPaginator,
    SortableByChangeList,
    TenantScopedAdmin,
    action_remaining_text,
    actor_for,
    list_parameters_refused,
    may,
    service_error_text,
    tenant_ids_with,
)

REVEAL_SESSION_KEY = "zeromem_revealed_memories"
REVEAL_SECONDS = 300


class MemoryActionForm(helpers.ActionForm):
    # Taken as typed: the action that uses a field checks it and says what is wrong with it
    # (a refused field here made Django answer only "No action selected.").
    ttl_days = forms.CharField(
        required=False,
        initial=7,
        label="days (extend TTL)",
        widget=forms.NumberInput(attrs={"min": 1, "max": 3650}),
    )
    reason = forms.CharField(required=False, label="reason (forget)", widget=forms.TextInput(attrs={"maxlength": 1000}))


class MemoryForm(forms.ModelForm):
    """Edits the value as JSON text. Everything is checked with the service layer's own
    validators here, so a bad value is a form error naming the field, not a failed save."""

    value = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 12, "cols": 80, "class": "vLargeTextField", "spellcheck": "false"}),
        help_text='Any JSON: "text", 42, true, a list or an object.',
    )
    tags = forms.CharField(required=False, help_text="Comma-separated.")
    ttl_seconds = forms.IntegerField(
        required=False,
        min_value=1,
        label="Expire in (seconds)",
        help_text="Expire this many seconds from now (empty: keep the expiry).",
    )
    version = forms.IntegerField(widget=forms.HiddenInput, required=False)

    class Meta:
        model = Memory
        fields = ("tenant", "key", "value", "category", "subject", "tags", "importance")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk and not self.is_bound:
            self.initial["value"] = json.dumps(self.instance.value, ensure_ascii=False, indent=2)
            self.initial["tags"] = ", ".join(self.instance.tags or [])
            self.initial["version"] = self.instance.version
        if "category" in self.fields:
            self.fields["category"].required = False

    def clean_value(self):
        text = self.cleaned_data["value"]
        try:
            parsed = validation.loads_unique(text)
        except validation.DuplicateKey as exc:  # json.loads kept the last value, dropping the other
            where = validation.duplicate_key_field(text) or exc.name[:64]
            raise forms.ValidationError(
                f"Not valid JSON here: an object names {exc.name[:64]!r} twice ({where}); each name may appear once."
            ) from None
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(
                f"Not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}). "
                'Text needs double quotes, e.g. "zh-CN".'
            ) from None
        except ValueError:  # an integer past Python's int_max_str_digits (4300): was a 500
            raise forms.ValidationError(
                f"Not valid JSON: a number has more than {sys.get_int_max_str_digits()} digits"
            ) from None
        except RecursionError:  # nested past the interpreter's limit (thousands of levels)
            raise forms.ValidationError(
                f"must not nest arrays or objects more than {validation.VALUE_MAX_DEPTH} deep"
            ) from None
        tenant = self.instance.tenant if self.instance.pk else self.cleaned_data.get("tenant")
        max_bytes = tenant.effective_value_max_bytes if tenant else None
        self._service_check(validation.value, parsed, max_bytes=max_bytes or 16384)
        return parsed

    def clean_key(self):
        return self._service_check(validation.key, self.cleaned_data["key"])

    def clean_tags(self):
        raw = self.cleaned_data.get("tags") or ""
        tags = [t.strip() for t in raw.split(",") if t.strip()]
        return self._service_check(validation.tags, tags)

    def clean_category(self):
        return self._service_check(validation.category, self.cleaned_data.get("category") or None)

    def clean_importance(self):
        return self._service_check(validation.importance, self.cleaned_data.get("importance"))

    def clean_subject(self):
        return self._service_check(validation.subject, self.cleaned_data.get("subject") or "")

    def clean(self):
        data = super().clean()
        if self.instance.pk and data.get("version") and data["version"] != self.instance.version:
            raise forms.ValidationError(
                f"Someone changed this memory while you edited it (now version {self.instance.version}, "
                f"you opened version {data['version']}). Reload the page and apply your change again."
            )
        return data

    def _service_check(self, check, raw, **kwargs):
        try:
            result = check(raw, **kwargs)
        except ServiceError as exc:
            raise forms.ValidationError(exc.message) from None
        return raw if result is None else result

    def _post_clean(self):
        # Keep the model's own full_clean out: the value field holds parsed JSON already and
        # uniqueness is the service's business. Copy the cleaned data onto the instance.
        for name in ("key", "category", "subject", "importance", "tenant"):
            if name in self.cleaned_data and not self.instance.pk:
                setattr(self.instance, name, self.cleaned_data[name])


class SearchTooSlow(Exception):
    """A search of the memory list ran past ``ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS``."""


class SearchPaginator(CheapPaginator):
    """A search's pages count at most 1,000 matches (20 pages): its count reads each match's
    key and value, 10,000 of a common word ("tea", 100k memories of 1.7 KB) took 1.4 s."""

    COUNT_CAP = 1_000


class MemoryChangeList(SortableByChangeList):
    """With a search (``q``) or a tag filter, the list's statements — its capped count and its
    page — each stop after ``ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS``: every word of a search is an
    ILIKE over every key and value in scope, which no index serves, so a word no memory holds
    read the whole tenant twice (a viewer's one-word search over 100k memories of 1.7 KB took
    3.3 s, ten words 5.8 s, linear in the tenant's size and values and without any bound); a tag
    no memory carries walks every memory's tags in key order (the REST list's tag pages stop at
    their own deadline). Past the deadline the page lists nothing and says so, naming the
    parameter and what narrows it by an index (a tenant, the key tree, a subject)."""

    def get_results(self, request):
        self._get_results(request)
        # Each trashed row of the page says whether a restore brings it back (two queries).
        self.result_list = list(self.result_list)
        refusals = trash_refusals(self.result_list, now=timezone.now())
        for row in self.result_list:
            row.restore_refusal = refusals.get(row.pk)

    def _get_results(self, request):
        field = searched_by(request)
        if field is None:
            return super().get_results(request)
        try:
            with statement_deadline(timeout_ms=settings.ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS, timed_out=SearchTooSlow):
                super().get_results(request)
                self.result_list = list(self.result_list)  # the page's query, under the deadline
        except SearchTooSlow:
            messages.error(request, search_too_slow_text(field, "the search"))
            self.queryset = self.queryset.none()
            super().get_results(request)


def searched_by(request) -> str | None:
    """The parameter that makes the memory list a scan no index serves (``q``, else ``tag``),
    or None: its statements, the list's page and an action's pick alike, stop at
    ``ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS``."""
    if request.GET.get(SEARCH_VAR):
        return SEARCH_VAR
    return TagFilter.parameter_name if request.GET.get(TagFilter.parameter_name) else None


def search_too_slow_text(field: str, what: str, outcome: str = "") -> str:
    timeout = settings.ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS
    how = "each word is looked for in every key and value" if field == SEARCH_VAR else "the tag is looked for"
    return (
        f"{field}: {what} read past its {timeout} ms without finishing ({how} the list covers){outcome}. "
        "Narrow it first: a tenant, a key prefix (the key tree), a subject"
        + (" or a tag." if field == SEARCH_VAR else ".")
    )


class MemoryAdmin(TenantScopedAdmin):
    form = MemoryForm
    action_form = MemoryActionForm
    view_capability = Capability.MEMORY_VIEW
    add_capability = Capability.MEMORY_EDIT
    change_capability = Capability.MEMORY_EDIT
    delete_capability = None  # a delete moves to the trash or forgets: both are actions
    list_display = ("key", "tenant", "category", "subject", "sensitive", "version", "updated_at", "expires_at", "state")
    list_select_related = ("tenant",)
    list_filter = ("tenant", StateFilter, KeyTreeFilter, CategoryFilter, SubjectFilter, TagFilter, ExpiryFilter)
    # The value's text as stored (search_text holds stemmed, tenant-prefixed index terms).
    search_fields = ("key", "value")
    search_help_text = "Search keys and the text of values."
    ordering = ("key",)
    # Each a tenant-led index (tenant, key) / (tenant, updated_at, id) / (tenant, expires_at, id):
    # any other column sorted every memory in scope.
    sortable_by = ("key", "updated_at", "expires_at")
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts are a COUNT per filter choice
    list_per_page = 50
    actions = ("forget_selected", "extend_ttl", "move_to_trash", "restore_from_trash")
    autocomplete_fields = ("tenant",)
    object_history_template = "zeromem_admin/memory_history.html"
    # A search or key-tree walk covers at most this many tenants (the chosen one, else every
    # tenant in scope): each records it in its own audit log (memory.browse).
    BROWSE_TENANTS_MAX = KeyTreeFilter.TENANTS_MAX

    def get_changelist(self, request, **kwargs):
        return MemoryChangeList

    def get_paginator(self, request, queryset, per_page, orphans=0, allow_empty_first_page=True):
        if request.GET.get("q"):
            return SearchPaginator(queryset, per_page, orphans, allow_empty_first_page)
        return super().get_paginator(request, queryset, per_page, orphans, allow_empty_first_page)

    def get_search_results(self, request, queryset, search_term):
        if request.path.endswith("/autocomplete/"):
            # Any model with a foreign key to Memory (a version, an embedding) makes it an
            # autocomplete target, yet no admin form picks a memory from a list: refused, so
            # that a search of value words stays the list's, which audits it (memory.browse).
            raise PermissionDenied
        return super().get_search_results(request, queryset, search_term)

    # --- sensitive values: masked until an explicit, audited reveal --------------------------

    def _masked(self, request, obj) -> bool:
        """A sensitive memory's value stays hidden on every page until this staff member
        reveals it (``memory.reveal``, audited); the reveal lasts ``REVEAL_SECONDS``."""
        return obj is not None and obj.sensitive and not self._revealed(request, obj)

    def _revealed(self, request, obj) -> bool:
        shown = request.session.get(REVEAL_SESSION_KEY, {}).get(str(obj.pk))
        return bool(shown and shown > timezone.now().timestamp())

    def has_change_permission(self, request, obj=None):
        # A masked value cannot be edited: the form would show it. Reveal first. A trashed
        # memory's page is read-only: memory_update refuses it (only a restore brings it back:
        # the list's action, or the page's own button, which it shows only when one would).
        trashed = obj is not None and obj.deleted_at is not None
        return super().has_change_permission(request, obj) and not trashed and not self._masked(request, obj)

    @admin.display(description="value")
    def value_masked(self, obj):
        # Inside the change form (which carries the CSRF token): the button posts it to the reveal view.
        return format_html(
            "<p><strong>•••••• sensitive value, hidden.</strong> Revealing it is recorded in the audit log.</p>"
            '<input type="submit" formaction="{}" formmethod="post" value="Reveal value" id="reveal-value">',
            reverse("admin:memories_memory_reveal", args=[obj.pk]),
        )

    def _reveal(self, request, object_id):
        obj = self.get_object(request, unquote(object_id))
        if obj is None or not self.has_view_permission(request, obj):
            raise Http404("no such memory")  # another tenant's, or not viewable: like a missing one
        try:
            services.memory_reveal(tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), memory_id=obj.pk)
        except NotFound as exc:
            if exc.code == "erased":
                self.message_user(request, f"{obj.key}: the value was erased (its key is destroyed).", messages.ERROR)
                return HttpResponseRedirect(reverse("admin:memories_memory_change", args=[obj.pk]))
            raise Http404("no such memory") from None
        except ServiceError:
            raise PermissionDenied from None
        shown = dict(request.session.get(REVEAL_SESSION_KEY, {}))
        now = timezone.now().timestamp()
        shown = {pk: until for pk, until in shown.items() if until > now}
        shown[str(obj.pk)] = now + REVEAL_SECONDS
        request.session[REVEAL_SESSION_KEY] = shown
        page = "history" if request.POST.get("next") == "history" else "change"  # a page name, never a URL
        return HttpResponseRedirect(reverse(f"admin:memories_memory_{page}", args=[obj.pk]))

    def reveal_view(self, request, object_id):
        return require_POST(self._reveal)(request, object_id)

    def get_fields(self, request, obj=None):
        if obj is not None and self._masked(request, obj):
            return self.get_readonly_fields(request, obj)
        if obj is None:
            return ("tenant", "key", "value", "category", "subject", "tags", "importance", "ttl_seconds")
        if not self.has_change_permission(request, obj):
            return self.get_readonly_fields(request, obj)
        return (
            "key_display",
            "value",
            "category",
            "subject",
            "tags",
            "importance",
            "ttl_seconds",
            "version",
            "facts",
        )

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ()
        restore = ("restore_button",) if self._offers_restore(request, obj) else ()
        if self._masked(request, obj):
            return ("key_display", "value_masked", "category", "subject", "tags", "importance", "facts", *restore)
        if not self.has_change_permission(request, obj):
            return ("key_display", "value_display", "category", "subject", "tags", "importance", "facts", *restore)
        return ("key_display", "subject", "facts")

    def _offers_restore(self, request, obj) -> bool:
        """A trashed memory's page offers *Restore from the trash* to a role that may restore,
        when a restore brings it back (``trash_refusals``, the rule ``memory_restore`` applies:
        two queries, on a trashed memory's page only)."""
        if obj.deleted_at is None or not may(request, Capability.MEMORY_EDIT, obj.tenant_id):
            return False
        if not hasattr(obj, "restore_refusal"):
            obj.restore_refusal = trash_refusals([obj], now=timezone.now()).get(obj.pk)
        return obj.restore_refusal is None

    @admin.display(description="restore")
    def restore_button(self, obj):
        # Inside the change form (which carries the CSRF token), as the reveal button is.
        return format_html(
            '<input type="submit" formaction="{}" formmethod="post" value="Restore from the trash" id="restore-memory">'
            " Brings it back as a new version (audited as <code>memory.restore</code>).",
            reverse("admin:memories_memory_restore", args=[obj.pk]),
        )

    @admin.display(description="key")
    def key_display(self, obj):
        return format_html("<code>{}</code> (tenant {})", obj.key, obj.tenant.slug)

    @admin.display(description="value")
    def value_display(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(obj.value, ensure_ascii=False, indent=2))

    @admin.display(description="facts")
    def facts(self, obj):
        return format_html(
            "version {} · state {} · created {} · updated {} · expires {} · read {} times, last {} · source {}",
            obj.version,
            self.state(obj),
            when(obj.created_at),
            when(obj.updated_at),
            when(obj.expires_at, "never"),
            obj.access_count,
            when(obj.last_accessed_at, "never"),
            obj.source or "-",
        )

    @admin.display(description="state")
    def state(self, obj):
        """The list's column and the memory's own page alike: a trashed memory says whether a
        restore brings it back, by the rule ``memory_restore`` applies (``trash_refusals``: set
        on the list's rows for a whole page at once; two queries here for one memory)."""
        if obj.deleted_at is not None:
            if not hasattr(obj, "restore_refusal"):
                obj.restore_refusal = trash_refusals([obj], now=timezone.now()).get(obj.pk)
            refusal = obj.restore_refusal
            return f"trash (not restorable: {refusal})" if refusal else "trash"
        if obj.expires_at is not None and obj.expires_at <= timezone.now():
            return "expired"
        return "live"

    def changelist_view(self, request, extra_context=None):
        # A search over keys and value words, or a walk down the key tree, shows data of
        # every memory it matches: audited (memory.browse) in each tenant it covers.
        refused = list_parameters_refused(request, self)
        if refused is not None:
            return refused
        # Each tenant's own log must show it (a tenant's reviewers read and export only theirs,
        # under its own chain and retention): one event per tenant covered, so a search over
        # more than BROWSE_TENANTS_MAX (a superuser's, over every tenant) asks for a tenant
        # instead, and shows and records nothing.
        search = request.GET.get("q", "")
        prefix = request.GET.get(KeyTreeFilter.parameter_name, "")
        # A filter by an end user (every memory of theirs) or a tag narrows the list as a search does.
        subject = request.GET.get(SubjectFilter.parameter_name, "")
        tag = request.GET.get(TagFilter.parameter_name, "")
        if request.method in READ_METHODS and (search or prefix or subject or tag):
            ids = tenant_ids_with(request, Capability.MEMORY_VIEW)
            chosen = validation.ascii_int(request.GET.get("tenant") or "")
            covered = [chosen] if chosen in ids else sorted(ids)
            if len(covered) > self.BROWSE_TENANTS_MAX:
                request._zeromem_browse_refused = True
                self.message_user(
                    request,
                    f"Choose a tenant (the tenant filter) to search or walk the key tree: a search covers at most "
                    f"{self.BROWSE_TENANTS_MAX} tenants, and each records it in its audit log.",
                    messages.ERROR,
                )
            else:
                for tenant in Tenant.objects.filter(pk__in=covered).order_by("pk"):
                    services.memories_browse(
                        tenant=tenant,
                        actor=actor_for(request, tenant.pk),
                        search=search,
                        prefix=prefix,
                        subject=subject,
                        tag=tag,
                    )
        response = super().changelist_view(request, extra_context)
        changelist = (getattr(response, "context_data", None) or {}).get("cl")
        if request.method in READ_METHODS and not (search or prefix or subject or tag) and changelist is not None:
            self._audit_plain_list(request, changelist.result_list)
        return response

    def _audit_plain_list(self, request, rows) -> None:
        """A page of the list with no search: ``memory.list`` (as the REST list of the same rows)
        in each tenant whose memories it showed, with how many; in the one tenant it covers
        (chosen, or the only one in scope) even when it showed none. It showed keys, subjects
        and dates of a tenant's memories, page after page, and only a search left a record."""
        shown: dict[int, int] = {}
        for row in rows:
            shown[row.tenant_id] = shown.get(row.tenant_id, 0) + 1
        ids = tenant_ids_with(request, Capability.MEMORY_VIEW)
        chosen = validation.ascii_int(request.GET.get("tenant") or "")
        covered = [chosen] if chosen in ids else sorted(ids)
        if not shown and len(covered) == 1:
            shown[covered[0]] = 0
        filters = {name: request.GET.get(name, "") for name in LISTED_FILTERS}
        for tenant in Tenant.objects.filter(pk__in=shown).order_by("pk"):
            services.memories_listed(
                tenant=tenant, actor=actor_for(request, tenant.pk), count=shown[tenant.pk], filters=filters
            )

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        return qs.none() if getattr(request, "_zeromem_browse_refused", False) else qs

    # --- opening a memory is an audited read ---------------------------------------------

    def change_view(self, request, object_id, form_url="", extra_context=None):
        obj = self.get_object(request, unquote(object_id))
        if obj is not None and self._masked(request, obj):
            # Nothing is opened: the page shows the key and facts, and a Reveal button.
            if not self.has_view_permission(request, obj):
                raise PermissionDenied
            return super().change_view(request, object_id, form_url, extra_context)
        if request.method in READ_METHODS:  # (a POST saves, and shows no stored value)
            try:
                services.memory_view(tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), memory_id=obj.pk)
            except NotFound:
                raise Http404("no such memory") from None
            except ServiceError:
                raise PermissionDenied from None
        return super().change_view(request, object_id, form_url, extra_context)

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        tenant = obj.tenant if change else data["tenant"]
        if not may(request, Capability.MEMORY_EDIT, tenant.pk):
            raise PermissionDenied
        actor = actor_for(request, tenant.pk)
        if change:
            try:
                result = services.memory_update(
                    tenant=tenant,
                    actor=actor,
                    key=obj.key,
                    value=data["value"],
                    expected_version=data.get("version") or None,
                    ttl_seconds=data.get("ttl_seconds"),
                    tags=data["tags"],
                    category=data.get("category"),
                    importance=data.get("importance"),
                )
            except Conflict as exc:
                raise ServiceError(
                    f"the memory changed meanwhile (now version {exc.extra['current_version']}); reload and retry",
                    field="value",
                ) from None
            except NotFound:
                raise ServiceError("the memory is gone (expired or moved to the trash)", field="key") from None
        else:
            result = services.memory_write(
                tenant=tenant,
                actor=actor,
                key=data["key"],
                value=data["value"],
                ttl_seconds=data.get("ttl_seconds"),
                tags=data["tags"],
                subject=data.get("subject") or None,
                category=data.get("category"),
                importance=data.get("importance"),
            )
        obj.__dict__.update({k: v for k, v in result.memory.__dict__.items() if not k.startswith("_")})
        obj._state.adding = False

    def log_addition(self, request, obj, message):
        return None  # the audit event of memory_write records it (with the actor)

    def log_change(self, request, obj, message):
        return None  # the audit event of memory_update records it

    # --- history and restoring a version ---------------------------------------------------

    def _facts(self, request, object_id) -> Memory | None:
        """The memory as :meth:`get_object` finds it, without its value (up to the value cap:
        the history pages show versions, not the current value)."""
        try:
            return self.get_queryset(request).defer("value").get(pk=unquote(object_id))
        except (Memory.DoesNotExist, ValidationError, ValueError, TypeError):
            return None

    def history_view(self, request, object_id, extra_context=None):
        """A page of the versions (``HISTORY_PAGE_SIZE``, newest first; ``?before=`` the older
        ones): each with its size and a preview; a whole value only on its own page."""
        obj = self._facts(request, object_id)
        if obj is None or not self.has_view_permission(request, obj):
            raise Http404("no such memory")  # another tenant's, or not viewable: like a missing one
        # Version by version: a memory written plain again keeps the versions it wrote while
        # sensitive (sealed), and they stay hidden until a reveal as the memory itself would.
        revealed = self._revealed(request, obj)
        try:
            page = services.memory_versions_view(
                tenant=obj.tenant,
                actor=actor_for(request, obj.tenant_id),
                memory_id=obj.pk,
                before=request.GET.get("before"),
                open_sealed=revealed,
            )
        except InvalidInput as exc:
            return HttpResponseBadRequest(f"{exc.field}: {exc.message}", content_type="text/plain")
        except NotFound:
            raise Http404("no such memory") from None
        except ServiceError:
            raise PermissionDenied from None
        live = obj.deleted_at is None and (obj.expires_at is None or obj.expires_at > timezone.now())
        masked = [not revealed and (obj.sensitive or v.sensitive) for v in page.versions]
        context = {
            **self.admin_site.each_context(request),
            "title": f"History of {obj.key}",
            "subtitle": None,
            "object": obj,
            "opts": self.opts,
            "module_name": "Memories",
            "versions": [
                {
                    "version": v.version,
                    "op": v.op,
                    "actor": actor_label(v.actor_kind, v.actor_id),
                    "created_at": v.created_at,
                    "size": _size(v.value_bytes),
                    **_preview(v, hidden),
                    "current": v.version == obj.version,
                }
                for v, hidden in zip(page.versions, masked, strict=True)
            ],
            "older": page.older,
            "paged": request.GET.get("before") is not None,
            "can_reveal": any(masked),
            "can_restore": live and self.has_change_permission(request, obj),
            "preserved_filters": self.get_preserved_filters(request),
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.object_history_template, context)

    def version_view(self, request, object_id, version: int):
        """One version's whole value (an audited read; masked like the history until a reveal)."""
        obj = self._facts(request, object_id)
        if obj is None or not self.has_view_permission(request, obj):
            raise Http404("no such memory")
        try:
            row = services.memory_version_view(
                tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), memory_id=obj.pk, version=version
            )
        except NotFound:
            raise Http404("no such version") from None
        except ServiceError:
            raise PermissionDenied from None
        hidden = not self._revealed(request, obj) and (obj.sensitive or row.sensitive)
        if hidden:
            value = "•••••• sensitive value, hidden"
        elif isinstance(row.value, ErasedValue):
            value = "erased (its data key is destroyed)"
        else:
            value = json.dumps(row.value, ensure_ascii=False, indent=2)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Version {row.version} of {obj.key}",
            "subtitle": None,
            "object": obj,
            "opts": self.opts,
            "module_name": "Memories",
            "v": {
                "version": row.version,
                "op": row.op,
                "actor": actor_label(row.actor_kind, row.actor_id),
                "created_at": row.created_at,
                "value": value,
                "current": row.version == obj.version,
            },
            "can_reveal": hidden,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "zeromem_admin/memory_version.html", context)

    def get_urls(self):
        return [
            path(
                "<path:object_id>/reveal/",
                self.admin_site.admin_view(self.reveal_view),
                name="memories_memory_reveal",
            ),
            path(
                "<path:object_id>/history/<int:version>/",
                self.admin_site.admin_view(self.version_view),
                name="memories_memory_version",
            ),
            path(
                "<path:object_id>/history/<int:version>/restore/",
                self.admin_site.admin_view(self.restore_version_view),
                name="memories_memory_restore_version",
            ),
            # After the version's restore: "<path:…>" takes slashes, and "<id>/history/3/restore/" is its.
            path(
                "<path:object_id>/restore/",
                self.admin_site.admin_view(self.restore_view),
                name="memories_memory_restore",
            ),
            *super().get_urls(),
        ]

    def restore_view(self, request, object_id):
        return require_POST(self._restore)(request, object_id)

    def _restore(self, request, object_id):
        """*Restore from the trash* on a trashed memory's own page: ``memory_restore``, as the
        list's action calls it for each memory (audited ``memory.restore``); then its page again."""
        obj = self.get_object(request, unquote(object_id))  # another tenant's: a 404
        if not may(request, Capability.MEMORY_EDIT, obj.tenant_id):
            raise PermissionDenied
        try:
            result = services.memory_restore(
                tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), memory_id=obj.pk
            )
        except Conflict:
            self.message_user(request, f"Not restored: a live memory holds the key {obj.key}.", messages.ERROR)
        except ServiceError as exc:  # not in the trash (any more), or one the purge erases
            self.message_user(request, f"Not restored: {obj.key}: {exc.message}.", messages.ERROR)
        else:
            self.message_user(
                request, f"Restored {obj.key} from the trash as version {result.memory.version}.", messages.SUCCESS
            )
        return HttpResponseRedirect(reverse("admin:memories_memory_change", args=[obj.pk]))

    def restore_version_view(self, request, object_id, version: int):
        return require_POST(self._restore_version)(request, object_id, version)

    def _restore_version(self, request, object_id, version):
        obj = self.get_object(request, unquote(object_id))
        if not self.has_change_permission(request, obj):
            raise PermissionDenied
        try:
            result = services.memory_restore_version(
                tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), memory_id=obj.pk, version=version
            )
        except NotFound:
            self.message_user(request, f"{obj.key} has no version {version}.", messages.ERROR)
        except ServiceError as exc:
            self.message_user(request, service_error_text(exc), messages.ERROR)
        else:
            self.message_user(request, f"Restored version {version} of {obj.key} as version {result.memory.version}.")
        return HttpResponseRedirect(reverse("admin:memories_memory_history", args=[obj.pk]))

    # --- actions --------------------------------------------------------------------------

    def get_actions(self, request):
        actions = super().get_actions(request)
        if request.GET.get(StateFilter.parameter_name) == StateFilter.UNRESTORABLE:
            actions.pop("restore_from_trash", None)  # nothing listed there can be restored
        return actions

    def has_edit_permission(self, request):
        return may(request, Capability.MEMORY_EDIT)

    def _editable(self, request, queryset):
        return queryset.filter(tenant_id__in=tenant_ids_with(request, Capability.MEMORY_EDIT)).select_related("tenant")

    def response_action(self, request, queryset):
        try:
            return super().response_action(request, queryset)
        except SearchTooSlow:  # raised by _batch, before the action changed anything
            self.message_user(
                request,
                search_too_slow_text(searched_by(request), "the action's search", "; nothing was changed"),
                messages.ERROR,
            )
            return HttpResponseRedirect(request.get_full_path())

    def _batch(self, request, queryset) -> tuple[list[Memory], int | None]:
        """The first ``ACTION_MAX`` memories of ``queryset`` by key, and how many of it remain
        past them (:func:`~zeromem.kit.admin.action_remaining`, a capped count run only when
        the batch is full; None when a search's count ran past its deadline).

        On a searched or tag-filtered list its query stops at ``ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS``
        as the list's own page does (:class:`SearchTooSlow`, the action then changes nothing):
        "select all N" ran the search again here with no deadline — a word only the last
        memory by key holds, in a tenant of 10k memories of 1.8 KB, read 324 ms under a 1 ms
        deadline, linear in the tenant. The count of the rest gets its own deadline: past it
        the run goes ahead and says more remain, uncounted."""
        ordered = queryset.order_by("key")
        action_max = kit_admin.ACTION_MAX
        searched = searched_by(request) is not None
        if not searched:
            batch = list(ordered[: action_max + 1])
        else:
            with statement_deadline(timeout_ms=settings.ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS, timed_out=SearchTooSlow):
                batch = list(ordered[: action_max + 1])
        if len(batch) <= action_max:
            return batch, 0
        if not searched:
            return batch[:action_max], kit_admin.action_remaining(ordered)
        try:
            with statement_deadline(timeout_ms=settings.ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS, timed_out=SearchTooSlow):
                return batch[:action_max], kit_admin.action_remaining(ordered)
        except SearchTooSlow:
            return batch[:action_max], None

    def _say_remaining(self, request, remaining: int | None, still: str) -> None:
        if remaining != 0:
            self.message_user(request, action_remaining_text(remaining, still), messages.WARNING)

    @admin.action(permissions=["edit"], description="Forget selected memories (a forget request)")
    def forget_selected(self, request, queryset):
        reason = request.POST.get("reason", "") or "forgotten in the admin"
        by_tenant: dict[Tenant, list[str]] = {}
        batch, remaining = self._batch(request, self._editable(request, queryset))
        for memory in batch:
            by_tenant.setdefault(memory.tenant, []).append(memory.key)
        for tenant, keys in by_tenant.items():
            try:
                fr = services.forget_request_create(
                    tenant=tenant, actor=actor_for(request, tenant.pk), keys=sorted(set(keys)), reason=reason
                )
            except ServiceError as exc:
                self.message_user(request, service_error_text(exc), messages.ERROR)
                continue
            link = reverse("admin:memories_forgetrequest_change", args=[fr.pk])
            self.message_user(
                request,
                format_html(
                    'Forget request <a href="{}">{}</a> filed for {} key{}.',
                    link,
                    fr.uid,
                    len(keys),
                    "" if len(keys) == 1 else "s",
                ),
                messages.SUCCESS,
            )
        self._say_remaining(request, remaining, "forget")

    @admin.action(permissions=["edit"], description="Extend TTL (expire that many days from now)")
    def extend_ttl(self, request, queryset):
        days = validation.ascii_int(request.POST.get("ttl_days") or "7") or 0
        if not 1 <= days <= 3650:
            self.message_user(request, "days (extend TTL): give a whole number from 1 to 3650.", messages.ERROR)
            return
        done = 0
        batch, remaining = self._batch(request, self._editable(request, queryset).filter(deleted_at__isnull=True))
        for memory in batch:
            try:
                services.memory_update(
                    tenant=memory.tenant,
                    actor=actor_for(request, memory.tenant_id),
                    key=memory.key,
                    ttl_seconds=days * 86400,
                )
            except NotFound:
                continue  # expired meanwhile
            done += 1
        self.message_user(request, f"{done} memories now expire in {days} days (expired ones cannot be extended).")
        self._say_remaining(request, remaining, "extend")

    @admin.action(permissions=["edit"], description="Move selected memories to the trash")
    def move_to_trash(self, request, queryset):
        done = 0
        batch, remaining = self._batch(request, self._editable(request, queryset).filter(deleted_at__isnull=True))
        for memory in batch:
            try:
                services.memory_delete(tenant=memory.tenant, actor=actor_for(request, memory.tenant_id), key=memory.key)
            except NotFound:
                continue  # expired or trashed meanwhile
            done += 1
        self.message_user(request, f"{done} memories moved to the trash.")
        self._say_remaining(request, remaining, "move to the trash")

    @admin.action(permissions=["edit"], description="Restore selected memories from the trash")
    def restore_from_trash(self, request, queryset):
        done, conflicts, refused = 0, [], []
        batch, remaining = self._batch(request, self._editable(request, queryset).filter(deleted_at__isnull=False))
        refusals = trash_refusals(batch, now=timezone.now())
        for memory in batch:
            if memory.pk in refusals:
                refused.append(f"{memory.key} ({refusals[memory.pk]})")
                continue
            try:
                services.memory_restore(
                    tenant=memory.tenant, actor=actor_for(request, memory.tenant_id), memory_id=memory.pk
                )
            except Conflict:
                conflicts.append(memory.key)
                continue
            except NotFound:
                continue  # restored or purged meanwhile
            done += 1
        self.message_user(request, f"{done} memories restored from the trash.")
        if conflicts:
            self.message_user(
                request, f"Not restored, a live memory holds the key: {', '.join(conflicts[:20])}", messages.WARNING
            )
        if refused:
            more = f" and {len(refused) - 20} more" if len(refused) > 20 else ""
            self.message_user(
                request,
                f"Not restorable (the purge erases them): {', '.join(refused[:20])}{more}.",
                messages.WARNING,
            )
        self._say_remaining(request, remaining, "restore")


admin.site.register(Memory, MemoryAdmin)


def _size(n: int | None) -> str:
    """A value's size as the history shows it: bytes of its JSON text (an envelope's if sealed)."""
    n = n or 0
    if n < 1024:
        return f"{n} bytes"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KB"
    return f"{n / (1024 * 1024):.1f} MB"


def _preview(v, hidden: bool) -> dict:
    """What the history shows of one version's value (from ``memory_versions_view``): the
    whole value when it is short, else its first characters; ``truncated`` when there is more."""
    limit = PREVIEW_CHARS
    if hidden:
        return {"value": "•••••• sensitive value, hidden", "truncated": False}
    if v.sensitive:
        if v.sealed_value is None:
            return {"value": "(sealed value too large to show here: open this version)", "truncated": True}
        if isinstance(v.sealed_value, ErasedValue):
            return {"value": "erased (its data key is destroyed)", "truncated": False}
        text = json.dumps(v.sealed_value, ensure_ascii=False, indent=2)
    elif len(v.preview or "") > limit:
        return {"value": v.preview[:limit] + " …", "truncated": True}
    else:
        text = json.dumps(json.loads(v.preview), ensure_ascii=False, indent=2)
    return (
        {"value": text[:limit] + " …", "truncated": True} if len(text) > limit else {"value": text, "truncated": False}
    )
