"""The admin console: tenants (with their dashboards), memories, forget requests, API keys and
memberships. Scoping and roles come from :class:`zeromem.kit.admin.TenantScopedAdmin`;
every change goes through the service layer, which writes the version and the audit event.
"""

from __future__ import annotations

import json
from datetime import timedelta

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.db.models import Case, IntegerField, OuterRef, Q, Subquery, Value, When
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.views.decorators.http import require_POST

from memories import dashboard, services
from memories.models import ApiKey, ForgetRequest, Membership, Memory, Tenant
from memories.selectors import memories_with_tag
from memories.services import staff
from zeromem.kernel import validation
from zeromem.kernel.errors import Conflict, NotFound, ServiceError
from zeromem.kernel.scopes import ALL_SCOPES
from zeromem.kit.admin import InputFilter, TenantScopedAdmin, actor_for, may, staff_roles, tenant_ids_with

admin.site.site_header = "ZeroMem admin"
admin.site.site_title = "ZeroMem admin"
admin.site.index_title = "Tenants, memories and the audit log"
admin.site.index_template = "zeromem_admin/index.html"

EXPIRING_SOON = timedelta(hours=24)


def _when(moment, empty: str = "-") -> str:
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S %Z") if moment else empty


def _service_error_text(exc: ServiceError) -> str:
    return f"{exc.field}: {exc.message}" if exc.field else exc.message


# --- tenants and their dashboards ------------------------------------------------------------


@admin.register(Tenant)
class TenantAdmin(TenantScopedAdmin):
    tenant_field = "pk"
    view_capability = "tenant.view"
    list_display = ("slug", "name", "your_role", "dashboard_link", "created_at")
    search_fields = ("slug", "name")
    ordering = ("slug",)
    fields = ("slug", "name", "value_max_bytes", "trash_retention_days", "created_at")

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

    def save_model(self, request, obj, form, change):
        if change:
            original = Tenant.objects.get(pk=obj.pk)  # form.save() already set the new values on obj
            staff.tenant_settings_update(
                tenant=original,
                actor=actor_for(request, obj.pk),
                name=form.cleaned_data["name"],
                value_max_bytes=form.cleaned_data.get("value_max_bytes"),
                trash_retention_days=form.cleaned_data.get("trash_retention_days"),
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
        if not may(request, "dashboard.view", tenant_id):
            raise Http404("no such tenant")
        tenant = get_object_or_404(Tenant, pk=tenant_id)
        role = staff_roles(request).get(tenant.pk)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Dashboard: {tenant.name}",
            "tenant": tenant,
            "role": role,
            "opts": self.opts,
            "show_keys": may(request, "memory.view", tenant.pk),
            **dashboard.tenant_dashboard(tenant=tenant),
        }
        return TemplateResponse(request, "zeromem_admin/dashboard.html", context)


def _autocomplete_source_admin(site, request):
    from django.apps import apps

    try:
        model = apps.get_model(request.GET["app_label"], request.GET["model_name"])
        return site.get_model_admin(model)
    except Exception:  # unknown model or not registered: AutocompleteJsonView refuses it anyway
        return None


# --- memories -------------------------------------------------------------------------------


class StateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return (("trash", "In the trash"), ("everything", "Everything"))

    def choices(self, changelist):
        for choice in super().choices(changelist):
            if choice["display"] == "All":
                choice["display"] = "Not in the trash"
            yield choice

    def queryset(self, request, queryset):
        if self.value() == "trash":
            return queryset.filter(deleted_at__isnull=False)
        if self.value() == "everything":
            return queryset
        return queryset.filter(deleted_at__isnull=True)


class ExpiryFilter(admin.SimpleListFilter):
    title = "expiry"
    parameter_name = "expiry"

    def lookups(self, request, model_admin):
        return (("expired", "Expired"), ("soon", "Expiring within 24 h"), ("never", "Never expires"))

    def queryset(self, request, queryset):
        now = timezone.now()
        if self.value() == "expired":
            return queryset.filter(expires_at__lte=now)
        if self.value() == "soon":
            return queryset.filter(expires_at__gt=now, expires_at__lte=now + EXPIRING_SOON)
        if self.value() == "never":
            return queryset.filter(expires_at__isnull=True)
        return queryset


class CategoryFilter(admin.SimpleListFilter):
    title = "category"
    parameter_name = "category"

    def lookups(self, request, model_admin):
        return [(c.value, c.label) for c in Memory.Category]

    def queryset(self, request, queryset):
        return queryset.filter(category=self.value()) if self.value() else queryset


class KeyTreeFilter(admin.SimpleListFilter):
    """Drill down the key tree: the namespaces one segment below the chosen prefix."""

    title = "key tree"
    parameter_name = "prefix"
    CHILDREN_MAX = 50
    SCAN_MAX = 5000

    def lookups(self, request, model_admin):
        prefix = self.value() or ""
        qs = model_admin.get_queryset(request)
        if prefix:
            qs = qs.filter(key__startswith=prefix)
        # Distinct namespaces under the prefix (bounded: a tenant may hold a namespace per user).
        names = qs.exclude(namespace="").values_list("namespace", flat=True).distinct().order_by("namespace")
        children: list[str] = []
        for name in names[: self.SCAN_MAX]:
            rest = (name + ":")[len(prefix) :]
            if not rest or not (name + ":").startswith(prefix):
                continue
            child = prefix + rest.split(":", 1)[0] + ":"
            if child != prefix and (not children or children[-1] != child):
                children.append(child)
            if len(children) >= self.CHILDREN_MAX:
                break
        lookups = []
        if prefix:
            parent = prefix[:-1].rpartition(":")[0]
            lookups.append((parent + ":" if parent else "", f"↑ {parent + ':' if parent else 'top'}"))
            lookups.append((prefix, f"● {prefix}"))
        lookups.extend((child, child) for child in children)
        return [(value, label) for value, label in lookups if value != ""]

    def queryset(self, request, queryset):
        return queryset.filter(key__startswith=self.value()) if self.value() else queryset


class SubjectFilter(InputFilter):
    title = "subject (end user)"
    parameter_name = "subject"

    def queryset(self, request, queryset):
        return queryset.filter(subject=self.value()) if self.value() else queryset


class TagFilter(InputFilter):
    title = "tag"
    parameter_name = "tag"

    def queryset(self, request, queryset):
        return memories_with_tag(queryset, self.value()) if self.value() else queryset


class MemoryActionForm(helpers.ActionForm):
    ttl_days = forms.IntegerField(
        required=False, min_value=1, max_value=3650, initial=7, label="days (extend TTL)", widget=forms.NumberInput
    )
    reason = forms.CharField(required=False, max_length=200, label="reason (forget)")


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
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(
                f"Not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}). "
                'Text needs double quotes, e.g. "zh-CN".'
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
        return self._service_check(
            validation.short_text, self.cleaned_data.get("subject") or "", field="subject", max_len=255
        )

    def clean(self):
        data = super().clean()
        if self.instance.pk and data.get("version") and data["version"] != self.instance.version:
            raise forms.ValidationError(
                f"Someone changed this memory while you edited it (now version {self.instance.version}, "
                f"you opened version {data['version']}). Reload the page and apply your change again."
            )
        return data

    def _validate_unique(self):
        pass  # the service decides what an existing key means (an upsert)

    def validate_unique(self):
        pass

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


class MemoryAdmin(TenantScopedAdmin):
    form = MemoryForm
    action_form = MemoryActionForm
    view_capability = "memory.view"
    add_capability = "memory.edit"
    change_capability = "memory.edit"
    delete_capability = None  # a delete moves to the trash or forgets: both are actions
    list_display = ("key", "tenant", "category", "subject", "version", "updated_at", "expires_at", "state")
    list_select_related = ("tenant",)
    list_filter = ("tenant", StateFilter, KeyTreeFilter, CategoryFilter, SubjectFilter, TagFilter, ExpiryFilter)
    search_fields = ("key", "search_text")
    search_help_text = "Search keys and the words of values."
    ordering = ("key",)
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts are a COUNT per filter choice
    list_per_page = 50
    actions = ("forget_selected", "extend_ttl", "move_to_trash", "restore_from_trash")
    autocomplete_fields = ("tenant",)
    object_history_template = "zeromem_admin/memory_history.html"

    def get_fields(self, request, obj=None):
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
        if not self.has_change_permission(request, obj):
            return ("key_display", "value_display", "category", "subject", "tags", "importance", "facts")
        return ("key_display", "subject", "facts")

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
            _when(obj.created_at),
            _when(obj.updated_at),
            _when(obj.expires_at, "never"),
            obj.access_count,
            _when(obj.last_accessed_at, "never"),
            obj.source or "-",
        )

    @admin.display(description="state")
    def state(self, obj):
        if obj.deleted_at is not None:
            return "trash"
        if obj.expires_at is not None and obj.expires_at <= timezone.now():
            return "expired"
        return "live"

    # --- opening a memory is an audited read ---------------------------------------------

    def change_view(self, request, object_id, form_url="", extra_context=None):
        obj = self.get_object(request, unquote(object_id))
        if request.method == "GET":
            try:
                staff.memory_view(tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), memory_id=obj.pk)
            except NotFound:
                raise Http404("no such memory") from None
            except ServiceError:
                raise PermissionDenied from None
        extra_context = {**(extra_context or {}), "show_history_link": True}
        return super().change_view(request, object_id, form_url, extra_context)

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        tenant = obj.tenant if change else data["tenant"]
        if not may(request, "memory.edit", tenant.pk):
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

    def history_view(self, request, object_id, extra_context=None):
        obj = self.get_object(request, unquote(object_id))
        if not self.has_view_permission(request, obj):
            raise PermissionDenied
        try:
            versions = staff.memory_versions_view(
                tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), memory_id=obj.pk
            )
        except NotFound:
            raise Http404("no such memory") from None
        except ServiceError:
            raise PermissionDenied from None
        live = obj.deleted_at is None and (obj.expires_at is None or obj.expires_at > timezone.now())
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
                    "actor": _actor_label(v.actor_kind, v.actor_id),
                    "created_at": v.created_at,
                    "value": json.dumps(v.value, ensure_ascii=False, indent=2),
                    "current": v.version == obj.version,
                }
                for v in versions
            ],
            "can_restore": live and self.has_change_permission(request, obj),
            "preserved_filters": self.get_preserved_filters(request),
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.object_history_template, context)

    def get_urls(self):
        return [
            path(
                "<path:object_id>/history/<int:version>/restore/",
                self.admin_site.admin_view(self.restore_version_view),
                name="memories_memory_restore_version",
            ),
            *super().get_urls(),
        ]

    def restore_version_view(self, request, object_id, version: int):
        return require_POST(self._restore_version)(request, object_id, version)

    def _restore_version(self, request, object_id, version):
        obj = self.get_object(request, unquote(object_id))
        if not self.has_change_permission(request, obj):
            raise PermissionDenied
        try:
            result = staff.memory_restore_version(
                tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), memory_id=obj.pk, version=version
            )
        except NotFound:
            self.message_user(request, f"{obj.key} has no version {version}.", messages.ERROR)
        except ServiceError as exc:
            self.message_user(request, _service_error_text(exc), messages.ERROR)
        else:
            self.message_user(request, f"Restored version {version} of {obj.key} as version {result.memory.version}.")
        return HttpResponseRedirect(reverse("admin:memories_memory_history", args=[obj.pk]))

    # --- actions --------------------------------------------------------------------------

    def has_edit_permission(self, request):
        return may(request, "memory.edit")

    def _editable(self, request, queryset):
        return queryset.filter(tenant_id__in=tenant_ids_with(request, "memory.edit")).select_related("tenant")

    @admin.action(permissions=["edit"], description="Forget selected memories (a forget request)")
    def forget_selected(self, request, queryset):
        reason = request.POST.get("reason", "") or "forgotten in the admin"
        by_tenant: dict[Tenant, list[str]] = {}
        for memory in self._editable(request, queryset).order_by("key")[:1000]:
            by_tenant.setdefault(memory.tenant, []).append(memory.key)
        for tenant, keys in by_tenant.items():
            try:
                fr = services.forget_request_create(
                    tenant=tenant, actor=actor_for(request, tenant.pk), keys=sorted(set(keys)), reason=reason
                )
            except ServiceError as exc:
                self.message_user(request, _service_error_text(exc), messages.ERROR)
                continue
            link = reverse("admin:memories_forgetrequest_change", args=[fr.pk])
            self.message_user(
                request,
                format_html(
                    'Forget request <a href="{}">#{}</a> filed for {} key{}.',
                    link,
                    fr.pk,
                    len(keys),
                    "" if len(keys) == 1 else "s",
                ),
                messages.SUCCESS,
            )

    @admin.action(permissions=["edit"], description="Extend TTL (expire that many days from now)")
    def extend_ttl(self, request, queryset):
        try:
            days = int(request.POST.get("ttl_days") or 7)
        except ValueError:
            days = 0
        if not 1 <= days <= 3650:
            self.message_user(request, "days (extend TTL): give a whole number from 1 to 3650.", messages.ERROR)
            return
        done = 0
        for memory in self._editable(request, queryset).filter(deleted_at__isnull=True):
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

    @admin.action(permissions=["edit"], description="Move selected memories to the trash")
    def move_to_trash(self, request, queryset):
        done = 0
        for memory in self._editable(request, queryset).filter(deleted_at__isnull=True):
            try:
                services.memory_delete(tenant=memory.tenant, actor=actor_for(request, memory.tenant_id), key=memory.key)
            except NotFound:
                continue  # expired or trashed meanwhile
            done += 1
        self.message_user(request, f"{done} memories moved to the trash.")

    @admin.action(permissions=["edit"], description="Restore selected memories from the trash")
    def restore_from_trash(self, request, queryset):
        done, conflicts = 0, []
        for memory in self._editable(request, queryset).filter(deleted_at__isnull=False):
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


admin.site.register(Memory, MemoryAdmin)


def _actor_label(kind: str, actor_id: str) -> str:
    if kind == "staff" and actor_id.isdigit():
        from django.contrib.auth import get_user_model

        user = get_user_model().objects.filter(pk=int(actor_id)).only("username").first()
        return f"staff {user.get_username()}" if user else f"staff #{actor_id}"
    if kind == "api_key" and actor_id.isdigit():
        key = ApiKey.objects.filter(pk=int(actor_id)).only("lookup").first()
        return f"key {key.display_prefix}" if key else f"key #{actor_id}"
    return f"{kind} {actor_id}".strip()


# --- forget requests ------------------------------------------------------------------------


class OverdueFilter(admin.SimpleListFilter):
    title = "overdue"
    parameter_name = "overdue"

    def lookups(self, request, model_admin):
        return (("yes", "Overdue"), ("open", "Open (not finished)"))

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(~Q(status=ForgetRequest.Status.COMPLETED), due_at__lte=timezone.now())
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


class ForgetRequestAdmin(TenantScopedAdmin):
    view_capability = "forget.view"
    add_capability = "forget.create"
    list_display = ("id", "tenant", "status", "target", "due_at", "overdue", "created_at", "completed_at")
    list_select_related = ("tenant",)
    list_filter = ("tenant", OverdueFilter, "status")
    search_fields = ("subject", "prefix")
    show_full_result_count = False
    autocomplete_fields = ("tenant",)

    def get_queryset(self, request):
        now = timezone.now()
        late = ~Q(status=ForgetRequest.Status.COMPLETED) & Q(due_at__lte=now)
        rank = Case(
            When(late, then=Value(0)),
            When(status=ForgetRequest.Status.COMPLETED, then=Value(2)),
            default=Value(1),
            output_field=IntegerField(),
        )
        return super().get_queryset(request).annotate(queue_rank=rank).order_by("queue_rank", "due_at", "pk")

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
        return _actor_label(obj.requested_by_kind, obj.requested_by)

    @admin.display(description="receipt")
    def receipt_display(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(obj.receipt, indent=2, ensure_ascii=False))

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        tenant = data["tenant"]
        if change or not may(request, "forget.create", tenant.pk):
            raise PermissionDenied
        created = services.forget_request_create(
            tenant=tenant,
            actor=actor_for(request, tenant.pk),
            subject=data["subject"],
            reason=data["reason"],
            due_in_days=data["due_in_days"],
        )
        obj.pk = created.pk

    def log_addition(self, request, obj, message):
        return None  # audited by forget_request_create

    def response_add(self, request, obj, post_url_continue=None):
        # Straight to the request's page: its status, due date and (once done) receipt.
        self.message_user(request, f"Forget request #{obj.pk} filed. Its receipt appears here once it is carried out.")
        return HttpResponseRedirect(reverse("admin:memories_forgetrequest_change", args=[obj.pk]))


admin.site.register(ForgetRequest, ForgetRequestAdmin)


# --- API keys --------------------------------------------------------------------------------


class ApiKeyForm(forms.ModelForm):
    scopes = forms.MultipleChoiceField(
        choices=[(s, s) for s in ALL_SCOPES], widget=forms.CheckboxSelectMultiple, initial=list(ALL_SCOPES[:4])
    )
    allowed_prefixes = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text="One key prefix per line (e.g. user:u10086:); empty: the whole tenant.",
    )
    expires_in_days = forms.IntegerField(required=False, min_value=1, max_value=3650)

    class Meta:
        model = ApiKey
        fields = ("tenant", "name")

    def clean_allowed_prefixes(self):
        prefixes = [p.strip() for p in (self.cleaned_data.get("allowed_prefixes") or "").splitlines() if p.strip()]
        for p in prefixes:
            try:
                validation.prefix(p, field="allowed_prefixes")
            except ServiceError as exc:
                raise forms.ValidationError(f"{p}: {exc.message}") from None
        return prefixes

    def _post_clean(self):
        pass  # api_key_create validates and stores the key


class ApiKeyAdmin(TenantScopedAdmin):
    view_capability = "keys.manage"
    add_capability = "keys.manage"
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

    def has_revoke_permission(self, request):
        return may(request, "keys.manage")

    @admin.action(permissions=["revoke"], description="Revoke selected keys")
    def revoke(self, request, queryset):
        done = 0
        for key in queryset.filter(tenant_id__in=tenant_ids_with(request, "keys.manage"), revoked_at__isnull=True):
            done += services.api_key_revoke(tenant=key.tenant, actor=actor_for(request, key.tenant_id), key_id=key.pk)
        self.message_user(request, f"{done} keys revoked.")

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        tenant = data["tenant"]
        if change or not may(request, "keys.manage", tenant.pk):
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


# --- memberships -----------------------------------------------------------------------------


class MembershipForm(forms.ModelForm):
    username = forms.CharField(max_length=150, help_text="An existing user's username.")

    class Meta:
        model = Membership
        fields = ("tenant", "role")

    def clean_username(self):
        username = self.cleaned_data["username"]
        if not get_user_model().objects.filter(username=username).exists():
            raise forms.ValidationError(f"No user named {username!r}: create the user first.")
        return username

    def _post_clean(self):
        pass  # membership_set validates and stores it


class MembershipAdmin(TenantScopedAdmin):
    view_capability = "members.manage"
    add_capability = "members.manage"
    change_capability = "members.manage"
    delete_capability = "members.manage"
    list_display = ("user", "tenant", "role", "created_at")
    list_filter = ("tenant", "role")
    search_fields = ("user__username",)
    list_select_related = ("user", "tenant")

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = MembershipForm
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request, obj=None):
        return ("tenant", "username", "role") if obj is None else ("tenant", "user", "role", "created_at")

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else ("tenant", "user", "created_at")

    def save_model(self, request, obj, form, change):
        tenant = obj.tenant if change else form.cleaned_data["tenant"]
        if not may(request, "members.manage", tenant.pk):
            raise PermissionDenied
        username = obj.user.get_username() if change else form.cleaned_data["username"]
        membership = staff.membership_set(
            tenant=tenant, actor=actor_for(request, tenant.pk), username=username, role=form.cleaned_data["role"]
        )
        obj.pk, obj.user, obj.tenant, obj.created_at = membership.pk, membership.user, tenant, membership.created_at

    def delete_model(self, request, obj):
        staff.membership_remove(tenant=obj.tenant, actor=actor_for(request, obj.tenant_id), membership_id=obj.pk)

    def delete_queryset(self, request, queryset):
        for membership in queryset.filter(tenant_id__in=tenant_ids_with(request, "members.manage")):
            self.delete_model(request, membership)


admin.site.register(Membership, MembershipAdmin)
