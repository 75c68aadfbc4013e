"""The audit log in the admin: read-only, tenant-scoped, for the compliance and admin roles.

Rows hold no memory values, so compliance reviewers may read all of them. The list never
counts the whole table (a capped count, see ``CheapPaginator``) and every filter is a
condition on an indexed column of the tenant's rows. The export button streams the rows
the current filters select, through ``audit.exports.audit_export_response`` (which also
audits the export).
"""

from __future__ import annotations

import functools
import json
from datetime import UTC, datetime, time, timedelta

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import PAGE_VAR
from django.core.exceptions import PermissionDenied
from django.core.handlers.asgi import ASGIRequest
from django.http import Http404, HttpResponseBadRequest, HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from django.utils.html import format_html

from audit import limits, selectors
from audit.exports import audit_export_response
from audit.models import REVIEW_FIELDS, AuditEvent
from audit.selectors import AuditFilters, audit_events_matching, audit_filters, few_by_index, list_page_bounds
from audit.services import audit_event_view, audit_list_record
from zeromem.kernel import opaque, validation
from zeromem.kernel.errors import InvalidInput, NotFound, ServiceError
from zeromem.kernel.scopes import Capability
from zeromem.kernel.tenancy import get_tenant_model
from zeromem.kit.admin import (
    AuditedOpeningAdmin,
    InputFilter,
    SortableByChangeList,
    TenantScopedAdmin,
    actor_for,
    nul_parameter_refused,
    service_error_text,
    tenant_ids_with,
)
from zeromem.kit.api import slot_wait

FILTER_PARAMS = ("since", "until", "actor", "action", "key_prefix", "subject", "outcome")
# Filters no index of the tenant's events serves in the list's order: with one of them a page
# reads the matches among a window of the tenant's events (AuditChangeList), as the REST list.
WINDOWED_PARAMS = ("actor", "action", "outcome")
BEFORE_VAR = "before"  # the window's cursor: events below this id
REFUSED = object()  # AuditChangeList: the filters were refused, nothing is listed


def parse_moment(raw: str, *, end_of_day: bool = False) -> datetime | None:
    """``2026-12-01`` or ``2026-12-01T10:00[:00][+00:00]``; a date alone means its start (or,
    for ``until``, which is exclusive like ``AuditFilters.until``, the next day's start).
    Naive times are in the server's time zone."""
    raw = (raw or "").strip()
    if not raw:
        return None
    if not validation.ascii_text(raw):
        raise ValueError(raw)
    try:
        day = parse_date(raw)  # (parse_datetime would read a bare date as its midnight)
        moment = None if day else parse_datetime(raw.replace(" ", "T"))
    except ValueError:
        raise ValueError(raw) from None
    try:
        if day is not None:
            moment = datetime.combine(day + timedelta(days=1) if end_of_day else day, time.min)
        elif moment is None:
            raise ValueError(raw)
        if timezone.is_naive(moment):
            moment = timezone.make_aware(moment)
        # In UTC, as the database compares it: 9999-12-31 (through that day) or an offset at
        # either end of the calendar falls outside it (an OverflowError, or PostgreSQL's error).
        moment.astimezone(UTC)
    except OverflowError:
        raise ValueError(raw) from None
    return moment


def _matching(queryset, field: str, value):
    # The condition audit.selectors applies for this field (REST, exports and admin alike).
    return audit_events_matching(queryset, AuditFilters(**{field: value})) if value else queryset


class _FieldFilter(InputFilter):
    def queryset(self, request, queryset):
        return _matching(queryset, self.parameter_name, self.value())


class _MomentFilter(InputFilter):
    end_of_day = False

    def queryset(self, request, queryset):
        try:
            moment = parse_moment(self.value(), end_of_day=self.end_of_day)
        except ValueError:
            messages.error(request, f"{self.parameter_name}: not a date or time (use 2026-12-01 or 2026-12-01T10:00)")
            return queryset.none()
        return _matching(queryset, self.parameter_name, moment)


class SinceFilter(_MomentFilter):
    title = "since (date or time)"
    parameter_name = "since"


class UntilFilter(_MomentFilter):
    title = "until (date: through that day)"
    parameter_name = "until"
    end_of_day = True


class ActorFilter(_FieldFilter):
    title = "actor (username, key prefix, or an id with its kind: api_key:7, staff:7)"
    parameter_name = "actor"


class ActionFilter(_FieldFilter):
    title = "action (memory.update, or memory. for all)"
    parameter_name = "action"


class KeyPrefixFilter(_FieldFilter):
    title = "key or key prefix"
    parameter_name = "key_prefix"


class SubjectFilter(_FieldFilter):
    title = "subject (end user)"
    parameter_name = "subject"


class OutcomeFilter(admin.SimpleListFilter):
    title = "outcome"
    parameter_name = "outcome"

    def lookups(self, request, model_admin):
        return AuditEvent.Outcome.choices

    def queryset(self, request, queryset):
        return _matching(queryset, "outcome", self.value())


class BeforeFilter(admin.SimpleListFilter):
    """Takes ``before`` (the window's cursor, an event id) off the list's lookups; nothing shown.
    AuditChangeList reads it."""

    title = "before"
    parameter_name = BEFORE_VAR

    def lookups(self, request, model_admin):
        return ()

    def queryset(self, request, queryset):
        return queryset


class AuditChangeList(SortableByChangeList):
    """With an actor, action or outcome filter — which no index serves in the list's order, so
    a rare match read the tenant's whole log for each page and its capped count (85-230 ms at
    1M events) — the list reads windows, as ``GET /api/v1/audit-events`` does
    (``audit.selectors.list_page_bounds``): the matches among the tenant's newest
    ``LIST_SCAN_MAX`` events below ``before``, newest first by id on ``audit_unsealed``
    (tenant, id), pages of them as usual, and ``older_query`` for the window below (None at the
    end of the log). A window is one tenant's events: over several tenants, choose one. A
    ``subject`` or ``key_prefix`` naming at most LIST_SCAN_MAX events reads its own index
    instead (``few_by_index``), in full. Cost: up to three index reads of at most
    LIST_SCAN_MAX entries (the probe, the floor, the page or its capped count each)."""

    older_query: str | None = None
    window_size = 0
    _bounds = None

    def get_queryset(self, request, exclude_parameters=None):
        self._bounds = self._window(request)
        qs = super().get_queryset(request, exclude_parameters)
        if self._bounds is REFUSED:
            return qs.none()
        if self._bounds is not None:
            qs = self._bounds.narrow(qs)
            if self._bounds.floor is not None:
                self.window_size = selectors.LIST_SCAN_MAX
                self.older_query = self.get_query_string({BEFORE_VAR: self._bounds.floor}, remove=[PAGE_VAR])
        return qs

    def get_ordering(self, request, queryset):
        ordering = super().get_ordering(request, queryset)
        if self._bounds is None or self._bounds is REFUSED or not ordering:
            return ordering
        # By id, as the window is cut (ids follow the INSERTs' time): a range of audit_unsealed.
        sign = "-" if str(ordering[0]).startswith("-") else ""
        return [sign + "tenant_id", sign + "pk"]

    def _window(self, request):
        before = validation.ascii_int(request.GET.get(BEFORE_VAR) or "")
        if not any(request.GET.get(name) for name in WINDOWED_PARAMS) and before is None:
            return None
        ids = tenant_ids_with(request, self.model_admin.view_capability)
        chosen = validation.ascii_int(request.GET.get("tenant") or "")
        tenants = [chosen] if chosen in ids else sorted(ids)
        if len(tenants) != 1:
            messages.error(
                request,
                "Choose a tenant (the tenant filter) to filter by actor, action or outcome: the list reads "
                "one tenant's events at a time for them.",
            )
            return REFUSED
        try:
            filters = audit_filters_from(request.GET)
        except InvalidInput as exc:
            messages.error(request, service_error_text(exc))
            return REFUSED
        tenant = get_tenant_model().objects.get(pk=tenants[0])
        if not any(request.GET.get(name) for name in WINDOWED_PARAMS):
            return list_page_bounds(tenant=tenant, filters=filters, before=before, few=True)  # before alone
        few = few_by_index(tenant=tenant, filters=filters)
        return list_page_bounds(tenant=tenant, filters=filters, before=before, few=few)


@admin.register(AuditEvent)
class AuditEventAdmin(AuditedOpeningAdmin, TenantScopedAdmin):
    view_capability = Capability.AUDIT_VIEW
    list_display = ("occurred_at", "tenant", "actor", "surface", "action", "target", "subject", "outcome", "version")
    list_filter = (
        "tenant",
        SinceFilter,
        UntilFilter,
        ActorFilter,
        ActionFilter,
        KeyPrefixFilter,
        SubjectFilter,
        OutcomeFilter,
        BeforeFilter,
    )
    list_select_related = ("tenant",)
    ordering = ("-occurred_at", "-pk")
    sortable_by = ("occurred_at",)  # (tenant, occurred_at) is indexed; any other sorted every event
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts are a COUNT per filter choice
    list_per_page = 100
    actions = None
    # An API key's or staff user's id as the review API and exports show it (a token): its row
    # id comes from a sequence every tenant's keys (users) share.
    fields = tuple(
        "actor_id_shown" if f == "actor_id" else f
        for f in ("occurred_at", "tenant", *REVIEW_FIELDS[2:-1], "detail_display")
    )
    readonly_fields = fields
    change_list_template = "zeromem_admin/auditevent_change_list.html"

    @admin.display(description="actor")
    def actor(self, obj):
        return f"{obj.actor_kind} {obj.actor_label or self.actor_id_shown(obj)}".strip()

    @admin.display(description="actor id")
    def actor_id_shown(self, obj):
        return opaque.shown_actor_id(obj.actor_kind, obj.actor_id)

    @admin.display(description="detail")
    def detail_display(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(obj.detail, indent=2, ensure_ascii=False))

    def get_changelist(self, request, **kwargs):
        return AuditChangeList

    def changelist_view(self, request, extra_context=None):
        before = request.GET.get(BEFORE_VAR)
        if before is not None and validation.ascii_int(before) is None:
            return HttpResponseBadRequest(
                f"{BEFORE_VAR}: must be an event id (a number)", content_type="text/plain; charset=utf-8"
            )
        extra_context = {
            **(extra_context or {}),
            "export_url": reverse("admin:audit_auditevent_export"),
        }
        response = super().changelist_view(request, extra_context)
        changelist = (getattr(response, "context_data", None) or {}).get("cl")
        if changelist is not None:
            self._audit_reading(request, changelist.result_list)
        return response

    def _audit_reading(self, request, rows) -> None:
        """Reading the log is itself recorded (``audit.list``, as the audit API does), in
        each tenant whose events the page showed — after the page's rows were read, so the
        record of this reading is not among them — and, when the list covers one tenant (chosen,
        or the only one in scope), in it even when the page is empty: a filter that found
        nothing (in a window, say) still read that tenant's log; a refused filter did not."""
        shown: dict = {}
        for event in rows:
            shown.setdefault(event.tenant, 0)
            shown[event.tenant] += 1
        ids = tenant_ids_with(request, self.view_capability)
        chosen = validation.ascii_int(request.GET.get("tenant") or "")
        covered = [chosen] if chosen in ids else sorted(ids)
        if not shown and len(covered) == 1 and _filters_taken(request.GET):
            shown[get_tenant_model().objects.get(pk=covered[0])] = 0
        params = {k: request.GET[k] for k in (*FILTER_PARAMS, BEFORE_VAR) if request.GET.get(k)}
        for tenant, count in shown.items():
            audit_list_record(
                tenant=tenant,
                actor=actor_for(request, tenant),
                filters=params,
                count=count,
            )

    # --- opening one event is a reading of the log, audited as the list is ------------------

    def _audit_opening(self, request, object_id) -> None:
        """``audit.view`` in the event's tenant (``audit.services.audit_event_view``) before
        its page is shown; another tenant's event is a 404 and records nothing. A POST is
        refused by the read-only admin (403) before anything is shown."""
        if request.method not in ("GET", "HEAD"):
            return
        obj = self.get_object(request, unquote(object_id))
        if not self.has_view_permission(request, obj):
            raise PermissionDenied
        try:
            audit_event_view(tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), event_id=obj.pk)
        except NotFound:
            raise Http404("no such object") from None
        except ServiceError:
            raise PermissionDenied from None

    def get_urls(self):
        return [
            path("export/", self.admin_site.admin_view(self.export_view), name="audit_auditevent_export"),
            *super().get_urls(),
        ]

    def export_view(self, request):
        """The rows the list's filters select, as CSV or JSON lines (one tenant at a time:
        the export is recorded in that tenant's audit log)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        refused = nul_parameter_refused(request)
        if refused is not None:
            return refused
        ids = tenant_ids_with(request, self.view_capability)
        tenant_id = request.GET.get("tenant") or (str(next(iter(ids))) if len(ids) == 1 else "")
        if validation.ascii_int(tenant_id) not in ids:
            messages.error(request, "Choose one tenant (the tenant filter) before exporting.")
            return HttpResponseRedirect(reverse("admin:audit_auditevent_changelist"))
        tenant = get_tenant_model().objects.get(pk=validation.ascii_int(tenant_id))
        fmt = request.GET.get("fmt", "csv")
        if fmt not in ("csv", "jsonl"):
            fmt = "csv"
        try:
            filters = audit_filters_from(request.GET)
        except ServiceError as exc:
            messages.error(request, service_error_text(exc))
            return HttpResponseRedirect(reverse("admin:audit_auditevent_changelist"))
        # One of the tenant's slots for as long as it streams, as the REST export takes
        # (zeromem.kit.api.TenantSlotMixin): past ZEROMEM_TENANT_MAX_CONCURRENT, refused.
        holder = f"tenant:{tenant.pk}"
        token = slot_wait(holder)
        if token is None:
            messages.error(
                request, "This tenant already runs its limit of exports and searches at once; try again shortly."
            )
            return HttpResponseRedirect(reverse("admin:audit_auditevent_changelist"))
        try:
            response = audit_export_response(
                tenant=tenant,
                actor=actor_for(request, tenant),
                filters=filters,
                fmt=fmt,
                asynchronous=isinstance(request, ASGIRequest),
            )
        except ServiceError as exc:
            limits.slot_release(holder, token)
            messages.error(request, service_error_text(exc))
            return HttpResponseRedirect(reverse("admin:audit_auditevent_changelist"))
        except BaseException:
            limits.slot_release(holder, token)
            raise
        # Given back by the server's close() once the last byte is sent (or the client left).
        response._resource_closers.append(functools.partial(limits.slot_release, holder, token))
        return response


def _filters_taken(params) -> bool:
    """Whether the list's filters are all valid (a refused one listed nothing: no reading)."""
    try:
        audit_filters_from(params)
    except InvalidInput:
        return False
    return True


def audit_filters_from(params) -> AuditFilters:
    """The list's filter parameters as an ``audit.selectors.AuditFilters``; a bad value names
    its field (InvalidInput): dates as the list reads them, the rest as the REST API does."""
    values = {name: (params.get(name) or "").strip() or None for name in FILTER_PARAMS}
    audit_filters({name: values[name] for name in FILTER_PARAMS if name not in ("since", "until")})
    for name, end_of_day in (("since", False), ("until", True)):
        try:
            values[name] = parse_moment(values[name] or "", end_of_day=end_of_day)
        except ValueError:
            raise InvalidInput("not a date or time (use 2026-12-01 or 2026-12-01T10:00)", field=name) from None
    return AuditFilters(**values)
