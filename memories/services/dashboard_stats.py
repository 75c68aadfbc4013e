"""The ``dashboard-stats`` schedule: the admin dashboard's aggregates over live memories
(``memories.selectors.dashboard.memory_figures``), stored per tenant in
``TenantDashboardStats`` so a page view does not scan every memory of the tenant.

A tenant is recomputed when its stored figures are older than
``ZEROMEM_DASHBOARD_STATS_MINUTES`` and it has audit events since (every change to a memory
— write, delete, purge, forget — writes one), or when it has memories and no figures yet.
Cost per recomputed tenant: the aggregates the page used to run (a scan of the tenant's
live memories: about 0.5 s at 200k memories on 2 shared cores); per idle tenant, one EXISTS
on the audit log's (tenant, occurred_at) index. Derived data: not audited.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from audit.models import AuditEvent
from memories.models import Memory, Tenant, TenantDashboardStats
from memories.selectors.dashboard import memory_figures


def dashboard_stats_refresh(*, tenant: Tenant, now=None) -> TenantDashboardStats:
    now = now or timezone.now()
    figures = memory_figures(tenant=tenant, now=now)
    stats, _ = TenantDashboardStats.objects.update_or_create(
        tenant=tenant, defaults={"figures": figures, "computed_at": now}
    )
    return stats


def stale_tenants(now=None):
    now = now or timezone.now()
    due = now - timedelta(minutes=settings.ZEROMEM_DASHBOARD_STATS_MINUTES)
    stats = TenantDashboardStats.objects.filter(tenant=OuterRef("pk"))
    active_since = AuditEvent.objects.filter(tenant=OuterRef("tenant"), occurred_at__gt=OuterRef("computed_at"))
    stale = TenantDashboardStats.objects.filter(computed_at__lte=due).filter(Exists(active_since))
    never = ~Exists(stats) & Exists(Memory.objects.filter(tenant=OuterRef("pk")))
    return Tenant.objects.filter(Q(pk__in=stale.values("tenant")) | never).order_by("pk")


def dashboard_stats_refresh_stale(now=None) -> dict[str, int]:
    """Recompute every stale tenant's figures. Returns {slug: live memories}."""
    now = now or timezone.now()
    return {
        tenant.slug: dashboard_stats_refresh(tenant=tenant, now=now).figures["memory_count"]
        for tenant in stale_tenants(now)
    }
