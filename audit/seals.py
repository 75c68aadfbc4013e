"""Which events a seal holds: the queries every reader of seals shares (sealing, verifying,
purging, the daily and access-count folds, the review list and exports).

A *range seal* (``AuditSeal.by_range``, every seal since audit migration 0011) holds its
tenant's events with ids ``first_event_id..last_event_id`` whose ``seal`` column is null;
nothing is written to them (the sealing job only seals ids below a settled horizon, so no
event commits into a range after it was sealed: ``audit.services._settled_horizon``). An
older seal holds the events whose ``seal`` column is its number. Range seals come after all
older seals of a tenant, in increasing, disjoint id ranges.
"""

from __future__ import annotations

import bisect

from django.db.models import Q

from audit.models import AuditSeal


def tenant_q(tenant_id: int | None) -> Q:
    return Q(tenant__isnull=True) if tenant_id is None else Q(tenant_id=tenant_id)


def head_seal(tenant_id: int | None) -> AuditSeal | None:
    return AuditSeal.objects.filter(tenant_q(tenant_id)).order_by("-seq").first()


def range_head(tenant_id: int | None, head: AuditSeal | None = None) -> int:
    """The last event id the tenant's range seals cover (0: none yet). Range seals come after
    every older seal, so the head seal tells."""
    head = head if head is not None else head_seal(tenant_id)
    return head.last_event_id if head is not None and head.by_range else 0


def unsealed_q(tenant_id: int | None, head: AuditSeal | None = None) -> Q:
    """The tenant's events no seal holds yet (with its tenant filter)."""
    return tenant_q(tenant_id) & Q(seal__isnull=True, pk__gt=range_head(tenant_id, head))


def seal_events_q(seal: AuditSeal) -> Q:
    """The events of one seal (without the tenant filter)."""
    bounds = Q(pk__gte=seal.first_event_id, pk__lte=seal.last_event_id)
    return bounds & (Q(seal__isnull=True) if seal.by_range else Q(seal=seal.seq))


def seals_events_q(seals: list[AuditSeal]) -> Q:
    """The events of several seals of one tenant (without the tenant filter): every seal
    between the first and the last of them by seq must be in the list or purged (a purged
    seal's events are gone), since range seals are matched by their overall id span."""
    q = Q(pk__in=[])
    legacy = [s for s in seals if not s.by_range]
    ranged = [s for s in seals if s.by_range]
    if legacy:
        q |= Q(
            seal__gte=min(s.seq for s in legacy),
            seal__lte=max(s.seq for s in legacy),
            pk__gte=min(s.first_event_id for s in legacy),
            pk__lte=max(s.last_event_id for s in legacy),
        )
    if ranged:
        q |= Q(
            seal__isnull=True,
            pk__gte=min(s.first_event_id for s in ranged),
            pk__lte=max(s.last_event_id for s in ranged),
        )
    return q


def seal_numbers(tenant_id: int | None, ids: list[int]) -> dict[int, int]:
    """{event id: seal number} for events a range seal holds, among ``ids`` (events of the
    tenant whose ``seal`` column is null): what the review list and exports show. One query
    over the seals spanning the ids."""
    if not ids:
        return {}
    low, high = min(ids), max(ids)
    seals = list(
        AuditSeal.objects.filter(tenant_q(tenant_id), by_range=True, last_event_id__gte=low, first_event_id__lte=high)
        .order_by("last_event_id")
        .values_list("first_event_id", "last_event_id", "seq")
    )
    out = {}
    lasts = [last for _f, last, _s in seals]
    for event_id in ids:
        i = bisect.bisect_left(lasts, event_id)
        if i < len(seals) and seals[i][0] <= event_id:
            out[event_id] = seals[i][2]
    return out
