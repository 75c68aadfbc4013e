"""Who may use the admin for a tenant, and in which role (tenant admins only)."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.http import Http404

from memories import services
from memories.models import Membership
from zeromem.kernel.errors import NotFound, ServiceError
from zeromem.kernel.scopes import Capability
from zeromem.kit.admin import (
    READ_METHODS,
    AuditedListAdmin,
    AuditedOpeningAdmin,
    TenantScopedAdmin,
    actor_for,
    may,
    tenant_ids_with,
)

# Removing selected memberships works on at most this many per run (one service call each).
ACTION_MAX = 1000


class MembershipForm(forms.ModelForm):
    username = forms.CharField(
        max_length=150, help_text="An existing admin account's username (a superuser creates accounts)."
    )
    request = None  # set by MembershipAdmin.get_form

    class Meta:
        model = Membership
        fields = ("tenant", "role")

    def clean_username(self):
        # The service's own rule and message: the same answer for a name that does not exist
        # and one this admin may not add (it never says which).
        username = self.cleaned_data["username"]
        tenant = self.cleaned_data.get("tenant")
        actor = actor_for(self.request, tenant.pk if tenant else 0)
        try:
            services.addable_user(actor=actor, username=username)
        except ServiceError as exc:
            raise forms.ValidationError(exc.message) from None
        return username

    def _post_clean(self):
        pass  # membership_set validates and stores it


class MembershipAdmin(AuditedListAdmin, AuditedOpeningAdmin, TenantScopedAdmin):
    view_capability = Capability.MEMBERS_MANAGE
    add_capability = Capability.MEMBERS_MANAGE
    change_capability = Capability.MEMBERS_MANAGE
    delete_capability = Capability.MEMBERS_MANAGE
    list_display = ("user", "tenant", "role", "created_at")
    list_filter = ("tenant", "role")
    search_fields = ("user__username",)
    list_select_related = ("user", "tenant")

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = type("MembershipFormFor", (MembershipForm,), {"request": request})
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request, obj=None):
        return ("tenant", "username", "role") if obj is None else ("tenant", "user", "role", "created_at")

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else ("tenant", "user", "created_at")

    # --- reading them is audited: membership.list per tenant a page shows, membership.view per page

    def _list_viewed(self, **event) -> None:
        services.memberships_listed(**event)

    def _audit_opening(self, request, object_id) -> None:
        if request.method not in READ_METHODS:
            return  # a POST saves the role (membership.set), and shows nothing more
        obj = self.get_object(request, unquote(object_id))  # another tenant's: a 404
        if not self.has_view_permission(request, obj):
            raise PermissionDenied
        try:
            services.membership_view(tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), membership_id=obj.pk)
        except NotFound:
            raise Http404("no such object") from None
        except ServiceError:
            raise PermissionDenied from None

    def save_model(self, request, obj, form, change):
        tenant = obj.tenant if change else form.cleaned_data["tenant"]
        if not may(request, Capability.MEMBERS_MANAGE, tenant.pk):
            raise PermissionDenied
        username = obj.user.get_username() if change else form.cleaned_data["username"]
        membership = services.membership_set(
            tenant=tenant, actor=actor_for(request, tenant.pk), username=username, role=form.cleaned_data["role"]
        )
        obj.pk, obj.user, obj.tenant, obj.created_at = membership.pk, membership.user, tenant, membership.created_at

    def delete_model(self, request, obj):
        services.membership_remove(tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), membership_id=obj.pk)

    def delete_queryset(self, request, queryset):
        allowed = queryset.filter(tenant_id__in=tenant_ids_with(request, Capability.MEMBERS_MANAGE))
        memberships = list(allowed.select_related("tenant", "user").order_by("pk")[: ACTION_MAX + 1])
        if len(memberships) > ACTION_MAX:
            self.message_user(
                request,
                f"This action works on at most {ACTION_MAX} per run: run it again for the rest.",
                messages.WARNING,
            )
        for membership in memberships[:ACTION_MAX]:
            self.delete_model(request, membership)


admin.site.register(Membership, MembershipAdmin)
