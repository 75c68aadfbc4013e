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

from django.db import transaction
from django.db.models import Count, F, Max, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from audit.models import AuditEvent, AuditSeal
from audit.seals import seals_events_q
from audit.services import audit_seal_all
from memories.models import AccessCountFold, Memory

READ_ACTION = "memory.read"


def access_counts_fold(*, seal: bool = True) -> int:
    """Seal the audit tails (unless ``seal=False``), then add every tenant's newly sealed
    reads to its memories' counts. Returns how many reads it counted.

    Cost per tenant with new seals: the seal range (one indexed aggregate), one grouped
    SELECT of the read events by primary-key range, one SELECT of the memories read and one
    UPDATE per memory read, the watermark UPDATE — one transaction."""
    if seal:
        audit_seal_all()
    heads = AuditSeal.objects.filter(tenant__isnull=False).values("tenant_id").annotate(head=Max("seq")).order_by()
    folded = dict(AccessCountFold.objects.values_list("tenant_id", "seal"))
    counted = 0
    for row in heads:
        if row["head"] > folded.get(row["tenant_id"], 0):
            counted += _fold_tenant(row["tenant_id"])
    return counted


def _fold_tenant(tenant_id: int) -> int:
    with transaction.atomic():
        AccessCountFold.objects.get_or_create(tenant_id=tenant_id)
        # The lock orders concurrent runs: the second sees the first one's watermark.
        mark = AccessCountFold.objects.select_for_update().get(tenant_id=tenant_id)
        seals = list(
            AuditSeal.objects.filter(tenant_id=tenant_id, seq__gt=mark.seal).only(
                "seq", "first_event_id", "last_event_id", "by_range"
            )
        )
        if not seals:
            return 0
        head = max(s.seq for s in seals)
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
        counted = 0
        for memory_id, n, last in _credited(tenant_id, by_key):
            Memory.objects.filter(pk=memory_id).update(
                access_count=F("access_count") + n,
                last_accessed_at=Greatest(Coalesce("last_accessed_at", Value(last)), Value(last)),
            )
            counted += n
        mark.seal = head
        mark.folded_at = timezone.now()
        mark.save(update_fields=["seal", "folded_at"])
        return counted


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
