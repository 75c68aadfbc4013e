"""The audit log in the admin: read-only, tenant-scoped, for the compliance and admin roles.

Rows hold no memory values, so compliance reviewers may read all of them. The list never
counts the whole table (a capped count, see ``CheapPaginator``) and every filter is a
condition on an indexed column of the tenant's rows. The export button streams the rows
the current filters select, through ``audit.exports.audit_export_response`` (which also
audits the export).
"""

from __future__ import annotations

import json
from datetime import datetime, time

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.urls import path, reverse
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from django.utils.html import format_html

from audit.models import AuditEvent
from zeromem.admin_scoping import InputFilter, TenantScopedAdmin, actor_for, tenant_ids_with

FILTER_PARAMS = ("since", "until", "actor", "action", "key_prefix", "subject", "outcome")


def parse_moment(raw: str, *, end_of_day: bool = False) -> datetime | None:
    """``2026-12-01`` or ``2026-12-01T10:00[:00][+00:00]``; a date alone means its start (or,
    for ``until``, its end). Naive times are in the server's time zone."""
    raw = (raw or "").strip()
    if not raw:
        return None
    try:
        day = parse_date(raw)  # (parse_datetime would read a bare date as its midnight)
        moment = None if day else parse_datetime(raw.replace(" ", "T"))
    except ValueError:
        raise ValueError(raw) from None
    if day is not None:
        moment = datetime.combine(day, time.max if end_of_day else time.min)
    elif moment is None:
        raise ValueError(raw)
    if timezone.is_naive(moment):
        moment = timezone.make_aware(moment)
    return moment


class _MomentFilter(InputFilter):
    end_of_day = False
    lookup = ""

    def queryset(self, request, queryset):
        try:
            moment = parse_moment(self.value(), end_of_day=self.end_of_day)
        except ValueError:
            messages.error(request, f"{self.parameter_name}: not a date or time (use 2026-12-01 or 2026-12-01T10:00)")
            return queryset.none()
        return queryset.filter(**{self.lookup: moment}) if moment else queryset


class SinceFilter(_MomentFilter):
    title = "since (date or time)"
    parameter_name = "since"
    lookup = "occurred_at__gte"


class UntilFilter(_MomentFilter):
    title = "until (date or time)"
    parameter_name = "until"
    lookup = "occurred_at__lte"
    end_of_day = True


class ActorFilter(InputFilter):
    title = "actor (username, key prefix or id)"
    parameter_name = "actor"

    def queryset(self, request, queryset):
        value = self.value()
        return queryset.filter(**actor_lookup(value)) if value else queryset


def actor_lookup(value: str) -> dict:
    # zm_xxxx and usernames are labels; a bare number is the actor id (key or user pk).
    return {"actor_id": value} if value.isdigit() else {"actor_label": value}


class ActionFilter(InputFilter):
    title = "action (e.g. memory.update)"
    parameter_name = "action"

    def queryset(self, request, queryset):
        return queryset.filter(action=self.value()) if self.value() else queryset


class KeyPrefixFilter(InputFilter):
    title = "key or key prefix"
    parameter_name = "key_prefix"

    def queryset(self, request, queryset):
        return queryset.filter(target__startswith=self.value()) if self.value() else queryset


class SubjectFilter(InputFilter):
    title = "subject (end user)"
    parameter_name = "subject"

    def queryset(self, request, queryset):
        return queryset.filter(subject=self.value()) if self.value() else queryset


class OutcomeFilter(admin.SimpleListFilter):
    title = "outcome"
    parameter_name = "outcome"

    def lookups(self, request, model_admin):
        return AuditEvent.Outcome.choices

    def queryset(self, request, queryset):
        return queryset.filter(outcome=self.value()) if self.value() else queryset


@admin.register(AuditEvent)
class AuditEventAdmin(TenantScopedAdmin):
    view_capability = "audit.view"
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
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts are a COUNT per filter choice
    list_per_page = 100
    actions = None
    fields = (
        "occurred_at",
        "tenant",
        "actor_kind",
        "actor_id",
        "actor_label",
        "surface",
        "action",
        "target",
        "subject",
        "outcome",
        "count",
        "version",
        "request_id",
        "client_ip",
        "detail_display",
    )
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
            "export_available": _export_response() is not None,
            "export_url": reverse("admin:audit_auditevent_export"),
        }
        return super().changelist_view(request, extra_context)

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
        export = _export_response()
        if export is None:
            raise Http404("audit export is not available")
        ids = tenant_ids_with(request, self.view_capability)
        tenant_id = request.GET.get("tenant") or (str(next(iter(ids))) if len(ids) == 1 else "")
        if not tenant_id.isdigit() or int(tenant_id) not in ids:
            messages.error(request, "Choose one tenant (the tenant filter) before exporting.")
            from django.http import HttpResponseRedirect

            return HttpResponseRedirect(reverse("admin:audit_auditevent_changelist"))
        from memories.models import Tenant

        tenant = Tenant.objects.get(pk=int(tenant_id))
        fmt = request.GET.get("fmt", "csv")
        if fmt not in ("csv", "jsonl"):
            fmt = "csv"
        filters = audit_filters_from(request.GET)
        return export(tenant=tenant, actor=actor_for(request, tenant), filters=filters, fmt=fmt)


def audit_filters_from(params):
    """The list's filter parameters as an ``audit.selectors.AuditFilters``."""
    from audit.selectors import AuditFilters

    values = {name: (params.get(name) or "").strip() or None for name in FILTER_PARAMS}
    try:
        values["since"] = parse_moment(values["since"] or "")
        values["until"] = parse_moment(values["until"] or "", end_of_day=True)
    except ValueError:
        values["since"] = values["until"] = None
    return AuditFilters(**values)


def _export_response():
    """``audit.exports.audit_export_response`` once it exists (the audit work adds it)."""
    try:
        from audit.exports import audit_export_response
        from audit.selectors import AuditFilters  # noqa: F401
    except ImportError:
        return None
    return audit_export_response
