"""The audit log in the admin: read-only, tenant-scoped, for the compliance and admin roles.

Rows hold no memory values, so compliance reviewers may read all of them. The list never
counts the whole table (a capped count, see ``CheapPaginator``) and every filter is a
condition on an indexed column of the tenant's rows. The export button streams the rows
the current filters select, through ``audit.exports.audit_export_response`` (which also
audits the export).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, time, timedelta

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from django.utils.html import format_html

from audit.exports import audit_export_response
from audit.models import REVIEW_FIELDS, AuditEvent
from audit.selectors import AuditFilters, audit_events_matching, audit_filters
from audit.services import audit_list_record
from zeromem.kernel import validation
from zeromem.kernel.errors import InvalidInput, ServiceError
from zeromem.kernel.scopes import Capability
from zeromem.kernel.tenancy import get_tenant_model
from zeromem.kit.admin import (
    InputFilter,
    TenantScopedAdmin,
    actor_for,
    nul_parameter_refused,
    service_error_text,
    tenant_ids_with,
)

FILTER_PARAMS = ("since", "until", "actor", "action", "key_prefix", "subject", "outcome")


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
    title = "actor (username, key prefix or id)"
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


@admin.register(AuditEvent)
class AuditEventAdmin(TenantScopedAdmin):
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
    )
    list_select_related = ("tenant",)
    ordering = ("-occurred_at", "-pk")
    sortable_by = ("occurred_at",)  # (tenant, occurred_at) is indexed; any other sorted every event
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts are a COUNT per filter choice
    list_per_page = 100
    actions = None
    fields = ("occurred_at", "tenant", *REVIEW_FIELDS[2:-1], "detail_display")
    readonly_fields = fields
    change_list_template = "zeromem_admin/auditevent_change_list.html"

    @admin.display(description="actor")
    def actor(self, obj):
        return f"{obj.actor_kind} {obj.actor_label or obj.actor_id}".strip()

    @admin.display(description="detail")
    def detail_display(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(obj.detail, indent=2, ensure_ascii=False))

    def changelist_view(self, request, extra_context=None):
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
        record of this reading is not among them."""
        shown: dict = {}
        for event in rows:
            shown.setdefault(event.tenant, 0)
            shown[event.tenant] += 1
        params = {k: request.GET[k] for k in FILTER_PARAMS if request.GET.get(k)}
        for tenant, count in shown.items():
            audit_list_record(
                tenant=tenant,
                actor=actor_for(request, tenant),
                filters=params,
                count=count,
            )

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
            return audit_export_response(
                tenant=tenant,
                actor=actor_for(request, tenant),
                filters=filters,
                fmt=fmt,
                asynchronous=isinstance(request, ASGIRequest),
            )
        except ServiceError as exc:
            messages.error(request, service_error_text(exc))
            return HttpResponseRedirect(reverse("admin:audit_auditevent_changelist"))


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
