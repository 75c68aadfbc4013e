"""Tenants in the admin, and each tenant's dashboard page."""

from __future__ import annotations

import functools

from django import forms
from django.apps import apps
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.db.models import OuterRef, Subquery
from django.http import Http404
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from memories import services
from memories.admin.charts import dashboard_context
from memories.models import Membership, Tenant
from memories.selectors.dashboard import tenant_dashboard
from zeromem.kernel.replica import replica_reads
from zeromem.kernel.scopes import Capability
from zeromem.kit.admin import (
    READ_METHODS,
    AuditedListAdmin,
    AuditedOpeningAdmin,
    TenantScopedAdmin,
    actor_for,
    may,
    staff_roles,
    tenant_ids_with,
)


class RulesJSONField(forms.JSONField):
    """Django's JSON form field, but JSON that Python's json cannot read as data — an integer
    past 4300 digits (ValueError), nesting past the recursion limit — is "Enter a valid JSON."
    like any other bad JSON, not a 500 (Django catches only JSONDecodeError)."""

    def to_python(self, value):
        try:
            return super().to_python(value)
        except (ValueError, RecursionError):
            raise ValidationError(self.error_messages["invalid"], code="invalid", params={"value": value}) from None

    def bound_data(self, data, initial):
        try:
            return super().bound_data(data, initial)
        except (ValueError, RecursionError):
            return forms.fields.InvalidJSONInput(data)  # shown back as typed, as Django does bad JSON


class TenantForm(forms.ModelForm):
    sensitive_keys = RulesJSONField(required=False)
    sensitive_fields = RulesJSONField(required=False)

    class Meta:
        model = Tenant
        fields = ("slug", "name", "value_max_bytes", "trash_retention_days", "sensitive_keys", "sensitive_fields")


@admin.register(Tenant)
class TenantAdmin(AuditedListAdmin, AuditedOpeningAdmin, TenantScopedAdmin):
    tenant_field = "pk"
    form = TenantForm
    view_capability = Capability.TENANT_VIEW
    list_display = ("slug", "name", "your_role", "dashboard_link", "created_at")
    search_fields = ("slug", "name")
    ordering = ("slug",)
    fields = (
        "slug",
        "name",
        "value_max_bytes",
        "trash_retention_days",
        "sensitive_keys",
        "sensitive_fields",
        "created_at",
    )

    def get_readonly_fields(self, request, obj=None):
        return ("slug", "created_at") if obj else ("created_at",)

    def has_add_permission(self, request):
        return request.user.is_active and request.user.is_superuser

    def has_change_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_superuser

    @admin.display(description="your role")
    def your_role(self, obj):
        return getattr(obj, "member_role", None) or "superuser"

    @admin.display(description="dashboard")
    def dashboard_link(self, obj):
        return format_html('<a href="{}">Dashboard</a>', reverse("admin:memories_tenant_dashboard", args=[obj.pk]))

    def get_queryset(self, request):
        # The user's role per row (list_display callables get only the row, and a ModelAdmin
        # is shared by every request, so nothing request-specific may live on it).
        role = Membership.objects.filter(tenant=OuterRef("pk"), user_id=request.user.pk).values("role")[:1]
        return super().get_queryset(request).annotate(member_role=Subquery(role))

    def get_search_results(self, request, queryset, search_term):
        # Autocomplete of a tenant field offers only the tenants where the user may do what
        # the source form does (e.g. file a forget request), not every tenant they can see.
        if request.path.endswith("/autocomplete/"):
            source = _autocomplete_source_admin(self.admin_site, request)
            capability = source and (source.add_capability or source.change_capability or source.view_capability)
            queryset = queryset.filter(pk__in=tenant_ids_with(request, capability)) if capability else queryset.none()
        return super().get_search_results(request, queryset, search_term)

    def _list_viewed(self, **event) -> None:
        """A page of the list is ``tenant.list`` in each tenant it shows (AuditedListAdmin)."""
        services.tenants_listed(**event)

    def _opened(self, request, obj) -> None:
        """The settings page (limits, sensitivity rules) is a read: ``tenant.view``."""
        services.tenant_settings_view(tenant=obj, actor=actor_for(request, obj.pk))

    def save_model(self, request, obj, form, change):
        if change:
            original = Tenant.objects.get(pk=obj.pk)  # form.save() already set the new values on obj
            services.tenant_settings_update(
                tenant=original,
                actor=actor_for(request, obj.pk),
                name=form.cleaned_data["name"],
                value_max_bytes=form.cleaned_data.get("value_max_bytes"),
                trash_retention_days=form.cleaned_data.get("trash_retention_days"),
                sensitive_keys=form.cleaned_data.get("sensitive_keys"),
                sensitive_fields=form.cleaned_data.get("sensitive_fields"),
            )
            return
        created = services.tenant_create(actor=actor_for(request, 0), slug=obj.slug, name=obj.name)
        obj.pk = created.pk
        obj.created_at = created.created_at

    def get_urls(self):
        return [
            path(
                "<int:tenant_id>/dashboard/",
                self.admin_site.admin_view(self.dashboard_view),
                name="memories_tenant_dashboard",
            ),
            *super().get_urls(),
        ]

    def dashboard_view(self, request, tenant_id: int):
        if not may(request, Capability.DASHBOARD_VIEW, tenant_id):
            raise Http404("no such tenant")
        tenant = get_object_or_404(Tenant, pk=tenant_id)
        services.dashboard_view(tenant=tenant, actor=actor_for(request, tenant.pk))
        role = staff_roles(request).get(tenant.pk)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Dashboard: {tenant.name}",
            "tenant": tenant,
            "role": role,
            "opts": self.opts,
            "show_keys": may(request, Capability.MEMORY_VIEW, tenant.pk),
        }
        with replica_reads():  # aggregates that may lag by the replica's delay
            context.update(dashboard_context(tenant_dashboard(tenant=tenant)))
        return TemplateResponse(request, "zeromem_admin/dashboard.html", context)


def _autocomplete_source_admin(site, request):
    try:
        model = apps.get_model(request.GET["app_label"], request.GET["model_name"])
        return site.get_model_admin(model)
    except Exception:  # unknown model or not registered: AutocompleteJsonView refuses it anyway
        return None


# The admin index links the dashboards of at most this many of the user's tenants (by slug).
INDEX_TENANTS_MAX = 100


def audited_index(index):
    """``AdminSite.index`` (installed in memories/admin/__init__.py), whose *Dashboards* box
    lists the user's tenants (name and role, at most ``INDEX_TENANTS_MAX``): the tenant list's
    columns, read with no record while a page of the list writes ``tenant.list``. Recorded the
    same way: ``tenant.list`` in each tenant it shows (count 1), on GET and HEAD."""

    @functools.wraps(index)
    def view(request, extra_context=None):
        roles = staff_roles(request)
        tenants = list(Tenant.objects.filter(pk__in=roles).order_by("slug")[:INDEX_TENANTS_MAX])
        context = {**(extra_context or {}), "zeromem_tenants": [(tenant, roles[tenant.pk]) for tenant in tenants]}
        response = index(request, extra_context=context)
        if request.method in READ_METHODS and response.status_code == 200:
            for tenant in tenants:
                services.tenants_listed(tenant=tenant, actor=actor_for(request, tenant.pk), count=1)
        return response

    return view
