"""The forget-request queue in the admin: overdue first, then open, then done; filing a
request goes through ``forget_request_create``."""

from __future__ import annotations

import json

from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from memories import services
from memories.admin.display import actor_label
from memories.models import ForgetRequest
from zeromem.kernel.scopes import Capability
from zeromem.kit.admin import AuditedListAdmin, AuditedOpeningAdmin, TenantScopedAdmin, actor_for, may


class OverdueFilter(admin.SimpleListFilter):
    title = "overdue"
    parameter_name = "overdue"

    def lookups(self, request, model_admin):
        return (("yes", "Overdue"), ("open", "Open (not finished)"))

    def queryset(self, request, queryset):
        if self.value() == "yes":
            # The statuses not completed, named: a range of forget_tenant_status_due each, where
            # "status <> 'completed'" walked every done request past its due date.
            open_ = [s for s in ForgetRequest.Status.values if s != ForgetRequest.Status.COMPLETED]
            return queryset.filter(status__in=open_, due_at__lte=timezone.now())
        if self.value() == "open":
            return queryset.filter(status__in=[ForgetRequest.Status.RECEIVED, ForgetRequest.Status.RUNNING])
        return queryset


class ForgetRequestForm(forms.ModelForm):
    subject = forms.CharField(max_length=255, help_text="The end user whose memories are forgotten.")
    reason = forms.CharField(widget=forms.Textarea(attrs={"rows": 3}), max_length=1000)
    due_in_days = forms.IntegerField(min_value=1, max_value=30, initial=30)

    class Meta:
        model = ForgetRequest
        fields = ("tenant", "subject", "reason")

    def _post_clean(self):
        pass  # the service validates and stores the request


class ForgetRequestAdmin(AuditedListAdmin, AuditedOpeningAdmin, TenantScopedAdmin):
    view_capability = Capability.FORGET_VIEW
    add_capability = Capability.FORGET_CREATE
    # The request's uid (what the API calls its id), never its row id: that comes from a
    # sequence every tenant's requests share, and its growth gauges the others' activity.
    list_display = ("request_id", "tenant", "status", "target", "due_at", "overdue", "created_at", "completed_at")
    list_select_related = ("tenant",)
    list_filter = ("tenant", OverdueFilter, "status")
    # The whole subject: an index lookup (forget_tenant_subject), not a scan of every request kept.
    search_fields = ("subject__exact",)
    search_help_text = "Find an end user's requests by their whole subject id."
    sortable_by = ()  # the queue's own order only: any column sorted every request in scope
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    autocomplete_fields = ("tenant",)

    def get_queryset(self, request):
        # Open requests by due date (so the overdue ones first), then the done ones: the order
        # of the index forget_tenant_queue, read a page at a time.
        return super().get_queryset(request).annotate(done=ForgetRequest.done()).order_by("done", "due_at", "pk")

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = ForgetRequestForm
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ("tenant", "subject", "reason", "due_in_days")
        return (
            "tenant",
            "status",
            "target",
            "reason",
            "requested",
            "created_at",
            "due_at",
            "overdue",
            "started_at",
            "completed_at",
            "attempts",
            "receipt_display",
            "error",
        )

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else self.get_fields(request, obj)

    @admin.display(description="request")
    def request_id(self, obj):
        return str(obj.uid or "-")

    @admin.display(description="target")
    def target(self, obj):
        if obj.subject:
            return f"subject {obj.subject}"
        if obj.prefix:
            return f"prefix {obj.prefix}"
        return f"{len(obj.keys)} keys: {', '.join(obj.keys[:5])}" + (" …" if len(obj.keys) > 5 else "")

    @admin.display(boolean=True, description="overdue")
    def overdue(self, obj):
        return obj.is_overdue

    @admin.display(description="requested by")
    def requested(self, obj):
        return actor_label(obj.requested_by_kind, obj.requested_by)

    @admin.display(description="receipt")
    def receipt_display(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(obj.receipt, indent=2, ensure_ascii=False))

    # --- reading the queue is audited (AuditedListAdmin), as the REST API's forget.list / forget.read

    def _list_viewed(self, **event) -> None:
        services.forget_queue_viewed(**event)

    def _opened(self, request, obj) -> None:
        services.forget_request_view(tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), request_id=obj.pk)

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        tenant = data["tenant"]
        if change or not may(request, Capability.FORGET_CREATE, tenant.pk):
            raise PermissionDenied
        created = services.forget_request_create(
            tenant=tenant,
            actor=actor_for(request, tenant.pk),
            subject=data["subject"],
            reason=data["reason"],
            due_in_days=data["due_in_days"],
        )
        obj.pk, obj.uid = created.pk, created.uid

    def log_addition(self, request, obj, message):
        return None  # audited by forget_request_create

    def response_add(self, request, obj, post_url_continue=None):
        # Straight to the request's page: its status, due date and (once done) receipt.
        self.message_user(request, f"Forget request {obj.uid} filed. Its receipt appears here once it is carried out.")
        return HttpResponseRedirect(reverse("admin:memories_forgetrequest_change", args=[obj.pk]))


admin.site.register(ForgetRequest, ForgetRequestAdmin)
