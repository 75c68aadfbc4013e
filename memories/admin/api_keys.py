"""API keys in the admin: created (the secret shown once) and revoked through the services."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.template.response import TemplateResponse
from django.utils import timezone

from memories import services
from memories.models import ApiKey
from zeromem.kernel import validation
from zeromem.kernel.errors import ServiceError
from zeromem.kernel.scopes import DEFAULT_AGENT_SCOPES, TENANT_SCOPES, Capability
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


class ApiKeyForm(forms.ModelForm):
    scopes = forms.MultipleChoiceField(
        choices=[(s, s) for s in TENANT_SCOPES], widget=forms.CheckboxSelectMultiple, initial=list(DEFAULT_AGENT_SCOPES)
    )
    allowed_prefixes = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text=(
            "One key prefix per line, matched on whole segments: user:u10086: covers the keys under it, "
            "never user:u100860:…; empty: the whole tenant."
        ),
    )
    expires_in_days = forms.IntegerField(required=False, min_value=1, max_value=3650)

    class Meta:
        model = ApiKey
        fields = ("tenant", "name")

    def clean_name(self):
        name = self.cleaned_data.get("name")
        try:
            return services.api_key_name(name)  # the rule api_key_create applies again
        except ServiceError as exc:
            raise forms.ValidationError(exc.message) from None

    def clean_allowed_prefixes(self):
        lines = [p for p in (self.cleaned_data.get("allowed_prefixes") or "").splitlines() if p.strip()]
        try:
            return validation.allowlist(lines)  # the rule api_key_create applies again
        except ServiceError as exc:
            raise forms.ValidationError(exc.message) from None

    def _post_clean(self):
        pass  # api_key_create validates and stores the key


class ApiKeyAdmin(AuditedListAdmin, AuditedOpeningAdmin, TenantScopedAdmin):
    view_capability = Capability.KEYS_MANAGE
    add_capability = Capability.KEYS_MANAGE
    list_display = ("display_prefix", "name", "tenant", "scopes", "allowed_prefixes", "status", "last_used_at")
    list_select_related = ("tenant",)
    list_filter = ("tenant",)
    search_fields = ("name", "lookup")
    readonly_fields = (
        "display_prefix",
        "name",
        "tenant",
        "scopes",
        "allowed_prefixes",
        "created_at",
        "created_by",
        "expires_at",
        "revoked_at",
        "last_used_at",
    )
    actions = ("revoke",)

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = ApiKeyForm
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request, obj=None):
        return (
            ("tenant", "name", "scopes", "allowed_prefixes", "expires_in_days") if obj is None else self.readonly_fields
        )

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else self.readonly_fields

    @admin.display(description="status")
    def status(self, obj):
        if obj.revoked_at:
            return "revoked"
        if obj.expires_at and obj.expires_at <= timezone.now():
            return "expired"
        return "active"

    # --- reading them is audited: api_key.list per tenant a page shows, api_key.view per key

    def _list_viewed(self, **event) -> None:
        services.api_keys_listed(**event)

    def _opened(self, request, obj) -> None:
        services.api_key_view(tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), key_id=obj.pk)

    def has_revoke_permission(self, request):
        return may(request, Capability.KEYS_MANAGE)

    @admin.action(permissions=["revoke"], description="Revoke selected keys")
    def revoke(self, request, queryset):
        """Revokes the first ``ACTION_MAX`` keys of the selection by id (each one service call,
        its portal links and queued jobs); says how many it revoked and how many of the
        selection remain (a capped count, only when the batch is full)."""
        unrevoked = queryset.filter(
            tenant_id__in=tenant_ids_with(request, Capability.KEYS_MANAGE), revoked_at__isnull=True
        ).order_by("pk")
        keys = list(unrevoked.select_related("tenant")[: kit_admin.ACTION_MAX + 1])
        remaining = kit_admin.action_remaining(unrevoked) if len(keys) > kit_admin.ACTION_MAX else 0
        done = 0
        for key in keys[: kit_admin.ACTION_MAX]:
            done += services.api_key_revoke(tenant=key.tenant, actor=actor_for(request, key.tenant_id), key_id=key.pk)
        self.message_user(request, f"{done} key{'' if done == 1 else 's'} revoked.", messages.SUCCESS)
        if remaining:
            self.message_user(request, action_remaining_text(remaining, "revoke", "revokes"), messages.WARNING)

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        tenant = data["tenant"]
        if change or not may(request, Capability.KEYS_MANAGE, tenant.pk):
            raise PermissionDenied
        key, raw = services.api_key_create(
            tenant=tenant,
            actor=actor_for(request, tenant.pk),
            name=data["name"],
            scopes=data["scopes"],
            allowed_prefixes=data["allowed_prefixes"],
            expires_in_days=data.get("expires_in_days"),
            created_by=request.user,
        )
        obj.pk = key.pk
        obj._raw_key = raw
        for entry in key.allowed_prefixes:
            self.message_user(request, f"Allowlist: {validation.allowlist_entry_meaning(entry)}.")

    def log_addition(self, request, obj, message):
        return None  # audited by api_key_create

    def response_add(self, request, obj, post_url_continue=None):
        # The one time the secret exists: shown in this response only, never stored,
        # never put in a message or the session. The page is not cached.
        key = ApiKey.objects.select_related("tenant").get(pk=obj.pk)
        context = {
            **self.admin_site.each_context(request),
            "title": "API key created",
            "opts": self.opts,
            "key": key,
            "raw_key": obj._raw_key,
        }
        response = TemplateResponse(request, "zeromem_admin/apikey_created.html", context)
        response["Cache-Control"] = "no-store"
        return response


admin.site.register(ApiKey, ApiKeyAdmin)
