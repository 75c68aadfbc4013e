"""The filters of the memory list: state, expiry, category, the key tree, subject and tag."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import admin
from django.utils import timezone

from memories.models import Memory
from memories.selectors import memories_with_tag
from zeromem.kit.admin import InputFilter

EXPIRING_SOON = timedelta(hours=24)


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
