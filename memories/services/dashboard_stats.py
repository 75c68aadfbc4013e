"""The ``dashboard-stats`` schedule: the admin dashboard's aggregates over live memories
(``memories.selectors.dashboard.memory_figures``), stored per tenant in
``TenantDashboardStats`` so a page view does not scan every memory of the tenant.

A tenant is recounted when its stored figures are older than
``ZEROMEM_DASHBOARD_STATS_MINUTES`` and it has audit events since (every change to a memory
— write, delete, purge, forget — writes one) or memories that expired since (a TTL writes
none), or when it has memories and no figures yet.

Cost per recounted tenant: the counts (memories, by category, by namespace, distinct
namespaces) read two indexes of the tenant, index-only, and the heap rows of its trashed
and expired memories alone (memories.selectors.dashboard._COUNTS_SQL). The JSON size of live
memories, which reads every live row, is summed with them for a tenant of at most
``ZEROMEM_DASHBOARD_CHARS_EXACT_MEMORIES`` live memories, and at most every
``ZEROMEM_DASHBOARD_CHARS_HOURS`` above that (the page says as of when). Per idle tenant: one
EXISTS on the audit log's (tenant, occurred_at) index and one on memory_tenant_expiring.
A completed forget request recounts its tenant's counts at once (they may name the subject's
namespaces) and keeps a large tenant's sizes, which include the erased values' sizes but
name nothing, as of their last sum ("as of" on the page) until the next recount sums them.
Derived data: not audited.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from audit.models import AuditEvent
from memories.models import Memory, Tenant, TenantDashboardStats
from memories.selectors.dashboard import memory_chars, memory_figures

CHARS_KEPT = ("chars", "chars_memories", "chars_at")
# Set on the sizes kept through a forget: they include the erased values' sizes, so the next
# recount sums them again, however young they are.
CHARS_STALE = "chars_stale"


def dashboard_stats_refresh(*, tenant: Tenant, now=None, after_forget: bool = False) -> TenantDashboardStats:
    """Recount the tenant's stored figures. ``after_forget`` (a completed forget request, in
    its transaction): the counts, which may name the subject's namespaces, are recounted at
    once; a large tenant's sizes (a read of every live row) are kept as of their last sum,
    marked to be summed again at the next recount."""
    now = now or timezone.now()
    figures = memory_figures(tenant=tenant, now=now, chars=False)
    previous = TenantDashboardStats.objects.filter(tenant=tenant).values_list("figures", flat=True).first()
    if _chars_kept(previous, figures, now, after_forget=after_forget):
        figures.update({name: previous[name] for name in CHARS_KEPT})
        if after_forget:
            figures[CHARS_STALE] = True
    else:
        figures.update(memory_chars(tenant=tenant, now=now))
    stats, _ = TenantDashboardStats.objects.update_or_create(
        tenant=tenant, defaults={"figures": figures, "computed_at": now}
    )
    return stats


def dashboard_stats_after_forget(*, tenant: Tenant, now=None) -> None:
    """A forget request completed: the stored figures may name the subject's namespaces
    (``user:u42``), so they are recounted at once, in the forget's transaction; a tenant
    without stored figures is counted on the spot by its next page view, as before."""
    if TenantDashboardStats.objects.filter(tenant=tenant).exists():
        dashboard_stats_refresh(tenant=tenant, now=now, after_forget=True)


def _chars_kept(previous: dict | None, figures: dict, now, *, after_forget: bool = False) -> bool:
    """Keep the last sum of JSON characters on a large tenant until it is
    ZEROMEM_DASHBOARD_CHARS_HOURS old, or has been through a forget (and then until the next
    recount); a small tenant's is summed with every count."""
    if figures["memory_count"] <= settings.ZEROMEM_DASHBOARD_CHARS_EXACT_MEMORIES:
        return False
    if not previous or not all(name in previous for name in CHARS_KEPT):
        return False
    if after_forget:
        return True
    if previous.get(CHARS_STALE):
        return False
    summed_at = datetime.fromisoformat(previous["chars_at"])
    return now - summed_at < timedelta(hours=settings.ZEROMEM_DASHBOARD_CHARS_HOURS)


def stale_tenants(now=None):
    now = now or timezone.now()
    due = now - timedelta(minutes=settings.ZEROMEM_DASHBOARD_STATS_MINUTES)
    stats = TenantDashboardStats.objects.filter(tenant=OuterRef("pk"))
    active_since = AuditEvent.objects.filter(tenant=OuterRef("tenant"), occurred_at__gt=OuterRef("computed_at"))
    # Counted live then, expired since: one range of memory_tenant_expiring.
    expired_since = Memory.objects.filter(
        tenant=OuterRef("tenant"), expires_at__gt=OuterRef("computed_at"), expires_at__lte=now
    )
    stale = TenantDashboardStats.objects.filter(computed_at__lte=due).filter(
        Exists(active_since) | Exists(expired_since)
    )
    never = ~Exists(stats) & Exists(Memory.objects.filter(tenant=OuterRef("pk")))
    return Tenant.objects.filter(Q(pk__in=stale.values("tenant")) | never).order_by("pk")


def dashboard_stats_refresh_stale(now=None) -> dict[str, int]:
    """Recount every stale tenant's figures. Returns {slug: live memories}."""
    now = now or timezone.now()
    return {
        tenant.slug: dashboard_stats_refresh(tenant=tenant, now=now).figures["memory_count"]
        for tenant in stale_tenants(now)
    }
