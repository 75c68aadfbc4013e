"""Who may use the admin for a tenant, and in which role (tenant admins only)."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import actions as admin_actions
from django.core.exceptions import PermissionDenied

from memories import services
from memories.models import Membership
from zeromem.kernel import validation
from zeromem.kernel.errors import ServiceError
from zeromem.kernel.scopes import Capability
from zeromem.kit import admin as kit_admin
from zeromem.kit.admin import (
    AuditedListAdmin,
    AuditedOpeningAdmin,
    TenantScopedAdmin,
    action_remaining_text,
    actor_for,
    may,
    tenant_ids_with,
)


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
    actions = ("delete_selected",)  # the method below, in place of Django's
    delete_selected_confirmation_template = "zeromem_admin/membership_delete_selected_confirmation.html"

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

    def _opened(self, request, obj) -> None:
        services.membership_view(tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), membership_id=obj.pk)

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
        # Only through delete_selected below, which hands it one run's batch.
        for membership in queryset.select_related("tenant", "user").order_by("pk")[: kit_admin.ACTION_MAX]:
            self.delete_model(request, membership)

    @admin.action(permissions=["delete"], description="Remove selected memberships")
    def delete_selected(self, request, queryset):
        """Django's delete action on one run's batch: the first ``ACTION_MAX`` of the selection
        by id. Its confirmation page lists, counts and posts that batch, and names how many of
        the selection it leaves; the message counts the memberships removed and says how many
        remain. (Django's own listed, counted and posted "select all"'s whole selection — 3 of
        them, with a bound of 2, said "Successfully deleted 3 memberships." and removed 2.)"""
        allowed = queryset.filter(tenant_id__in=tenant_ids_with(request, Capability.MEMBERS_MANAGE)).order_by("pk")
        action_max = kit_admin.ACTION_MAX
        ids = list(allowed.values_list("pk", flat=True)[: action_max + 1])
        batch = allowed.filter(pk__in=ids[:action_max])
        # The confirmation posts the batch's ids only; how many the selection held beyond them
        # (a count capped at ACTION_REMAINING_COUNT_CAP + 1, not the selection's whole COUNT(*))
        # comes along in more_remain (a count for the message, nothing is selected by it).
        beyond = kit_admin.action_remaining(allowed) if len(ids) > action_max else 0
        posted = validation.ascii_int(request.POST.get("more_remain") or "") or 0
        beyond = beyond or min(posted, kit_admin.ACTION_REMAINING_COUNT_CAP + 1)
        if not request.POST.get("post"):
            response = admin_actions.delete_selected(self, request, batch)
            if response is not None and response.context_data is not None:
                size = len(ids[:action_max])
                capped = beyond > kit_admin.ACTION_REMAINING_COUNT_CAP
                selected = f"more than {size + kit_admin.ACTION_REMAINING_COUNT_CAP:,}" if capped else size + beyond
                response.context_data.update(
                    batch_size=size, selected=selected, more_remain=beyond, action_max=action_max
                )
            return response
        memberships = list(batch.select_related("tenant", "user").order_by("pk"))
        if not memberships:
            return None
        self.log_deletions(request, memberships)
        removed = 0
        for membership in memberships:
            removed += services.membership_remove(
                tenant=membership.tenant, actor=actor_for(request, membership.tenant_id), membership_id=membership.pk
            )
        self.message_user(request, f"{removed} membership{'' if removed == 1 else 's'} removed.", messages.SUCCESS)
        if beyond:
            self.message_user(request, action_remaining_text(beyond, "remove", "removes"), messages.WARNING)
        return None


admin.site.register(Membership, MembershipAdmin)
