"""Access counts, off the request path: ``Memory.access_count`` and ``last_accessed_at`` are
folded from the audit log instead of being updated by every read.

Every successful read already writes its audit event (``memory.read``, outcome ``ok``, the
key as target) — durably, in the request. The sealing job (audit/services.py) puts each
event into exactly one seal of its tenant, and only once every event with a lower id that
will ever commit has committed (its settled horizon), so a seal number is a watermark that a
late-committing event cannot slip under (an id or a timestamp alone could). The fold
counts the reads in the seals after the tenant's watermark and moves the watermark in the
same transaction: a crash or a concurrent run counts nothing twice and loses nothing. The
counts lag the reads by up to the schedule's period (a minute) plus a run.

A read's event names the key, not the row. The row credited is the tenant's memory at that
key created last at or before the last read counted; a read racing a delete and a rewrite
of the same key can land on the new memory — never on another key, never lost.
"""

from __future__ import annotations

from django.db import connection, transaction
from django.db.models import Count, F, Max, OuterRef, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce, Greatest, Least
from django.utils import timezone

from audit.models import AuditEvent, AuditSeal
from audit.seals import seals_events_q
from audit.services import audit_seal_all
from memories.models import AccessCountFold, Memory, Tenant

READ_ACTION = "memory.read"


def access_counts_fold(*, seal: bool = True) -> int:
    """Seal the audit tails (unless ``seal=False``), then add every tenant's newly sealed
    reads to its memories' counts. Returns how many reads it counted.

    Cost: one probe of the seals' (tenant, seq) index per tenant; then, per tenant with new
    seals and per group of them (``FOLD_EVENTS``), in one transaction: the seals (one indexed
    range), one grouped SELECT of the read events by primary-key range, one SELECT of the
    memories read, on PostgreSQL one locking SELECT and one UPDATE of them all (SQLite: one
    UPDATE per memory read), the watermark UPDATE."""
    if seal:
        audit_seal_all()
    return sum(_fold_tenant(tenant_id) for tenant_id in _due_tenants())


def _due_tenants() -> QuerySet:
    """Ids of the tenants with a seal past their watermark: per tenant, its last seal by one
    probe of the (tenant, seq) index (a subquery with a LIMIT, which the planner runs per
    tenant rather than joining every seal), not a grouped MAX over every seal ever made (0.2 s
    at 2M seals, every minute, growing with the log's whole history)."""
    watermark = AccessCountFold.objects.filter(tenant=OuterRef("pk")).values("seal")[:1]
    head = AuditSeal.objects.filter(tenant=OuterRef("pk")).order_by("-seq").values("seq")[:1]
    return (
        Tenant.objects.annotate(head=Subquery(head), watermark=Coalesce(Subquery(watermark), Value(0)))
        .filter(head__gt=F("watermark"))
        .order_by("pk")
        .values_list("pk", flat=True)
    )


# A run folds a tenant's seals in groups of about this many events, each group one
# transaction that moves the watermark past it: a backlog (the job stopped for a day) is
# read a group at a time, not all at once into memory and into one statement.
FOLD_EVENTS = 50_000
FOLD_SEALS = 1_000  # and at most this many seals (a quiet tenant's seals hold a few events each)
# access_count is a 32-bit integer column: a count that would pass it stays at its top.
COUNT_MAX = 2**31 - 1


def _fold_tenant(tenant_id: int) -> int:
    counted = 0
    while True:
        n, more = _fold_group(tenant_id)
        counted += n
        if not more:
            return counted


def _fold_group(tenant_id: int) -> tuple[int, bool]:
    """Fold the tenant's next seals (up to ``FOLD_EVENTS`` events and ``FOLD_SEALS`` seals; one
    seal at least) in one transaction. Returns (reads counted, whether seals are left after them)."""
    with transaction.atomic():
        AccessCountFold.objects.get_or_create(tenant_id=tenant_id)
        # The lock orders concurrent runs: the second sees the first one's watermark.
        mark = AccessCountFold.objects.select_for_update().get(tenant_id=tenant_id)
        pending = list(
            AuditSeal.objects.filter(tenant_id=tenant_id, seq__gt=mark.seal)
            .order_by("seq")
            .only("seq", "first_event_id", "last_event_id", "by_range", "count")[:FOLD_SEALS]
        )
        seals, events = [], 0
        for seal in pending:  # consecutive by seq, as seals_events_q needs
            if seals and events + seal.count > FOLD_EVENTS:
                break
            seals.append(seal)
            events += seal.count
        if not seals:
            return 0, False
        # Every event of a seal has an id within its seal's first..last (a seal takes its
        # events in id order), so the primary-key range bounds the scan.
        reads = (
            AuditEvent.objects.filter(
                seals_events_q(seals),
                tenant_id=tenant_id,
                action=READ_ACTION,
                outcome=AuditEvent.Outcome.OK,
            )
            .values("target")
            .annotate(n=Count("pk"), last=Max("occurred_at"))
            .order_by()
        )
        by_key = {r["target"]: (r["n"], r["last"]) for r in reads}
        credited = _credited(tenant_id, by_key)
        _add_counts(credited)
        mark.seal = seals[-1].seq
        mark.folded_at = timezone.now()
        mark.save(update_fields=["seal", "folded_at"])
        return sum(n for _, n, _ in credited), len(seals) < len(pending) or len(pending) == FOLD_SEALS


# PostgreSQL: the memories read are locked in id order (as a forget request's batch locks
# its memories, so the two never wait on each other in a cycle), then updated by ONE
# statement — not one UPDATE per memory, a round trip and the ORM's query building each.
_LOCK_SQL = "SELECT id FROM memories_memory WHERE id = ANY(%s) ORDER BY id FOR UPDATE"
_ADD_SQL = """
UPDATE memories_memory m
SET access_count = LEAST(m.access_count::bigint + v.n, %s),
    last_accessed_at = GREATEST(COALESCE(m.last_accessed_at, v.last), v.last)
FROM unnest(%s::bigint[], %s::bigint[], %s::timestamptz[]) AS v(id, n, last)
WHERE m.id = v.id"""


def _add_counts(credited: list[tuple[int, int, object]]) -> None:
    """Add each memory's reads to its count and move its last read forward."""
    if not credited:
        return
    if connection.vendor == "postgresql":
        ids, counts, lasts = (list(column) for column in zip(*credited, strict=True))
        with connection.cursor() as cursor:
            cursor.execute(_LOCK_SQL, [sorted(ids)])
            cursor.execute(_ADD_SQL, [COUNT_MAX, ids, counts, lasts])
        return
    for memory_id, n, last in sorted(credited, key=lambda row: row[0]):
        Memory.objects.filter(pk=memory_id).update(
            access_count=Least(F("access_count") + n, Value(COUNT_MAX)),
            last_accessed_at=Greatest(Coalesce("last_accessed_at", Value(last)), Value(last)),
        )


def _credited(tenant_id: int, by_key: dict) -> list[tuple[int, int, object]]:
    """(memory id, reads, last read) for each key read: the memory at that key created last
    at or before its last read."""
    if not by_key:
        return []
    rows = (
        Memory.objects.filter(tenant_id=tenant_id, key__in=list(by_key))
        .order_by("key", "created_at", "pk")
        .values_list("pk", "key", "created_at")
    )
    chosen: dict[str, int] = {}
    for pk, key, created_at in rows:
        if created_at <= by_key[key][1] or key not in chosen:
            chosen[key] = pk
    return [(pk, *by_key[key]) for key, pk in chosen.items()]
