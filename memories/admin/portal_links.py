"""Portal links in the admin: a list of the links issued to a tenant's end users (never their
tokens: only the tokens' hashes are stored) and one action, withdrawing them, which goes
through ``portal_links_revoke`` (audited as ``portal.revoke``, one event per end user).

Withdrawing works per end user, as in the API (``DELETE /api/v1/subjects/{subject}/portal-link``):
every link of the selected links' subjects stops opening, and the portal sessions they opened
end at their next page. The list is the only page: links are issued by the tenant's
application, and nothing of a link can be edited.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.urls import path
from django.utils import timezone

from memories.models import Tenant
from memories.portal.models import PortalLink
from memories.portal.services import link_ref, portal_links_revoke, portal_links_viewed
from zeromem.kernel.errors import ServiceError
from zeromem.kernel.scopes import Capability
from zeromem.kit import admin as kit_admin
from zeromem.kit.admin import (
    AuditedListAdmin,
    TenantScopedAdmin,
    action_remaining_text,
    actor_for,
    may,
    service_error_text,
    tenant_ids_with,
)


class PortalLinkAdmin(AuditedListAdmin, TenantScopedAdmin):
    view_capability = Capability.FORGET_VIEW  # whoever sees the forget requests (and their subjects)
    # "link": the reference its audit events name (link_ref), not the row id, which comes from
    # a sequence every tenant's links share.
    list_display = ("link", "tenant", "subject", "status", "created_at", "expires_at", "opened_at", "created_by_kind")
    list_display_links = None  # no page per link
    list_select_related = ("tenant",)
    list_filter = ("tenant",)
    # The whole subject, as stored: an index lookup (portallink_tenant_subject), not a scan
    # ("=subject" would be iexact, UPPER(subject) = UPPER(…), which no index serves).
    search_fields = ("subject__exact",)
    ordering = ("-created_at", "-pk")
    show_full_result_count = False
    actions = ("withdraw",)

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        return [path("", self.admin_site.admin_view(self.changelist_view), name=f"{info[0]}_{info[1]}_changelist")]

    @admin.display(description="link")
    def link(self, obj):
        return link_ref(obj)

    @admin.display(description="status")
    def status(self, obj):
        if obj.revoked_at:
            return "withdrawn"
        if obj.closed_at:
            return "signed out"
        if obj.opened_at:
            return "opened"
        return "expired" if obj.expires_at <= timezone.now() else "not opened"

    # --- reading the list is audited (AuditedListAdmin), as the forget queue's pages are ----

    def _list_viewed(self, **event) -> None:
        portal_links_viewed(**event)

    def has_withdraw_permission(self, request):
        return may(request, Capability.FORGET_CREATE)

    @admin.action(
        permissions=["withdraw"],
        description="Withdraw every portal link of the selected links' end users (ends their portal sessions)",
    )
    def withdraw(self, request, queryset):
        allowed = tenant_ids_with(request, Capability.FORGET_CREATE)
        # End users with a link still standing (the others have nothing left to withdraw),
        # at most ACTION_MAX per run: each is an audited service call, and "select all" may
        # hand it every link in scope (they live ZEROMEM_PORTAL_LINK_SECONDS).
        standing = (
            queryset.filter(tenant_id__in=allowed, revoked_at__isnull=True)
            .order_by("tenant_id", "subject")
            .values_list("tenant_id", "subject")
            .distinct()
        )
        targets = list(standing[: kit_admin.ACTION_MAX + 1])
        remaining = kit_admin.action_remaining(standing) if len(targets) > kit_admin.ACTION_MAX else 0
        targets = targets[: kit_admin.ACTION_MAX]
        tenants = Tenant.objects.in_bulk({tenant_id for tenant_id, _ in targets})
        done = 0
        for tenant_id, subject in targets:
            try:
                done += portal_links_revoke(
                    tenant=tenants[tenant_id], actor=actor_for(request, tenant_id), subject=subject
                )
            except ServiceError as exc:
                self.message_user(request, service_error_text(exc), messages.ERROR)
        self.message_user(request, f"{done} portal links withdrawn for {len(targets)} end users.")
        if remaining:
            text = action_remaining_text(remaining, "withdraw", "withdraws the links of", unit=" end users")
            self.message_user(request, text, messages.WARNING)


admin.site.register(PortalLink, PortalLinkAdmin)
