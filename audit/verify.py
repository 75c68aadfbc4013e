"""Verifying the audit chain (``manage.py audit_verify``). Read-only.

For one tenant's chain: every seal links to the previous one and its hash is right; every
event of an unpurged seal matches its digest (else it was edited), the chain recomputed over
the seal's events in id order gives the seal's hash (else an event was removed, inserted or
reordered — seals made before audit migration 0011 also stored each event's chain value, so
there the break is named at its event), and each seal holds exactly the events it says;
events in no seal's range, events claiming a seal that does not exist, events inserted into a
purged seal's range after the purge, copied events (a uid twice) and forged purge records are
found too. Unsealed events (the last
minute or so) are checked against their digests. A checkpoint kept outside the database
catches a cut-off tail: its seal must still be in the chain with the same hash.

Cost: one pass over the tenant's events in id order (server-side cursor, constant memory),
seven HMACs per event.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from django.db.models import Count, Q

from audit import chain
from audit.models import AuditCheckpoint, AuditEvent, AuditSeal
from audit.services import event_fields, seal_events_q

_COLUMNS = ("id", "digest", "chain", "seal", "redacted", *chain.DIGEST_FIELDS)


@dataclass
class Problem:
    message: str
    event_id: int | None = None
    seal: int | None = None

    def __str__(self) -> str:
        where = f"event {self.event_id}" if self.event_id is not None else f"seal {self.seal}"
        return f"{where}: {self.message}"


@dataclass
class VerifyResult:
    tenant_id: int | None
    events: int = 0
    seals: int = 0
    unsealed: int = 0
    purged_seals: int = 0
    head: AuditSeal | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def first_problem(self) -> Problem | None:
        return self.problems[0] if self.problems else None


def _tenant_q(tenant_id: int | None) -> Q:
    return Q(tenant__isnull=True) if tenant_id is None else Q(tenant_id=tenant_id)


def _check_event(row: dict) -> str | None:
    redacted = row["redacted"] or {}
    bound = redacted.get(chain.BOUND) or {}
    for name in chain.COMMITTED_FIELDS:
        if name not in redacted:
            continue
        if not chain.holds_redaction(name, row[name]):
            return f"its redacted field {name} holds no pseudonym: the event was edited after its redaction"
        if bound.get(name) != chain.binding(row["uid"], name, redacted[name], row[name]):
            return f"its redacted field {name} holds another pseudonym than its redaction wrote: the event was edited"
    expected = chain.digest(event_fields(row), commitments=row["redacted"] or None)
    if expected != row["digest"]:
        return "its fields do not match its digest: the event was edited or forged"
    return None


def _purge_allowance(tenant_id: int | None, result: VerifyResult) -> int:
    """The highest seal a genuine purge checkpoint says was purged on purpose."""
    through = 0
    for cp in AuditCheckpoint.objects.filter(_tenant_q(tenant_id), reason=AuditCheckpoint.Reason.PURGE):
        mac = chain.checkpoint_mac(
            tenant_id=tenant_id,
            seal_seq=cp.seal_seq,
            head_hash=cp.head_hash,
            total=cp.total,
            reason=cp.reason,
            purged=cp.purged_through,
        )
        if mac != cp.mac:
            result.problems.append(Problem(f"purge checkpoint {cp.pk} is forged (its MAC does not verify)"))
            continue
        through = max(through, cp.purged_through or 0)
    return through


def audit_verify(*, tenant_id: int | None, checkpoint: dict | None = None, stop_at_first: bool = False) -> VerifyResult:
    result = VerifyResult(tenant_id=tenant_id)
    purged_allowed = _purge_allowance(tenant_id, result)
    prev_hash = chain.genesis(tenant_id)
    expected_seq = 1
    seals = AuditSeal.objects.filter(_tenant_q(tenant_id)).order_by("seq")
    by_seq: dict[int, str] = {}
    ranged = RangedEvents(tenant_id)

    def problem(p: Problem) -> bool:
        result.problems.append(p)
        return stop_at_first

    for seal in seals.iterator(chunk_size=1000):
        result.seals += 1
        result.head = seal
        by_seq[seal.seq] = seal.hash
        if seal.seq != expected_seq:
            if problem(Problem(f"seal {expected_seq} is missing (next is {seal.seq})", seal=expected_seq)):
                return result
        expected_seq = seal.seq + 1
        if seal.prev_hash != prev_hash:
            if problem(Problem("does not link to the previous seal", seal=seal.seq)):
                return result
        prev_hash = seal.hash
        if seal.by_range:
            # Events with no seal number below this range lie in no seal: inserted.
            for row in ranged.before(seal.first_event_id):
                if problem(Problem("lies outside every seal's range", event_id=row["id"])):
                    return result
        if seal.purged_at is not None:
            result.purged_seals += 1
            if seal.by_range:
                # A purge deletes every event of the seal's range: one there now was inserted since.
                for row in ranged.through(seal.last_event_id):
                    if problem(Problem("lies in a purged seal's range: inserted after the purge", row["id"], seal.seq)):
                        return result
            if seal.seq > purged_allowed:
                if problem(Problem("is marked purged but no purge checkpoint covers it", seal=seal.seq)):
                    return result
            continue
        if seal.by_range:
            events = ranged.through(seal.last_event_id)
        else:
            events = (
                AuditEvent.objects.filter(_tenant_q(tenant_id), seal_events_q(seal))
                .order_by("id")
                .values(*_COLUMNS)
                .iterator(chunk_size=5000)
            )
        value = seal.prev_hash
        count = 0
        last_id = None
        for row in events:
            result.events += 1
            count += 1
            edited = _check_event(row)
            if edited and problem(Problem(edited, event_id=row["id"], seal=seal.seq)):
                return result
            value = chain.link(value, row["id"], row["digest"])
            # Older seals stored each event's chain value: a break is named at its event.
            if not seal.by_range and value != row["chain"]:
                message = "its chain value is wrong: an event before it was removed, inserted or reordered"
                if problem(Problem(message, event_id=row["id"], seal=seal.seq)):
                    return result
                value = row["chain"]  # resynchronise, so one break is reported once
            last_id = row["id"]
        if count != seal.count or last_id != seal.last_event_id:
            message = f"holds {count} events, the seal says {seal.count} (last {seal.last_event_id})"
            if problem(Problem(message, event_id=seal.last_event_id, seal=seal.seq)):
                return result
        expected = chain.seal_hash(
            prev_hash=seal.prev_hash,
            tenant_id=tenant_id,
            seq=seal.seq,
            first=seal.first_event_id,
            last=seal.last_event_id,
            count=seal.count,
            total=seal.total,
            last_chain=value,
        )
        if expected != seal.hash:
            message = "its hash does not match its events: one was removed, inserted, reordered or its id changed"
            if problem(Problem(message, seal=seal.seq)):
                return result

    # Events claiming a seal number no older seal has (range seals number no event), or
    # outside their (older) seal's range.
    older_head = seals.filter(by_range=False).order_by("-seq").values_list("seq", flat=True).first() or 0
    stray = AuditEvent.objects.filter(_tenant_q(tenant_id), seal__gt=older_head).order_by("id").first()
    if stray is not None and problem(Problem(f"claims seal {stray.seal}, which does not exist", event_id=stray.id)):
        return result
    # An older seal's events are deleted with it: one claiming a purged seal was inserted since.
    purged = seals.filter(purged_at__isnull=False, by_range=False).values("seq")
    leftover = AuditEvent.objects.filter(_tenant_q(tenant_id), seal__in=purged).order_by("id").first()
    if leftover is not None:
        message = f"claims seal {leftover.seal}, which was purged: inserted after the purge"
        if problem(Problem(message, event_id=leftover.id, seal=leftover.seal)):
            return result
    older = seals.filter(purged_at__isnull=True, by_range=False).only("seq", "first_event_id", "last_event_id")
    for seal in older:
        outside = (
            AuditEvent.objects.filter(_tenant_q(tenant_id), seal=seal.seq)
            .filter(Q(id__lt=seal.first_event_id) | Q(id__gt=seal.last_event_id))
            .order_by("id")
            .first()
        )
        if outside is not None and problem(Problem("lies outside its seal's range", event_id=outside.id)):
            return result

    duplicates = list(
        AuditEvent.objects.filter(_tenant_q(tenant_id))
        .values("uid")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .order_by("uid")[:1]
    )
    if duplicates:
        first_copy = AuditEvent.objects.filter(uid=duplicates[0]["uid"]).order_by("-id").first()
        if problem(Problem("is a copy of another event (same uid)", event_id=first_copy.id if first_copy else None)):
            return result

    # The unsealed tail: above the last range seal, no seal number.
    for row in ranged.rest():
        result.unsealed += 1
        edited = _check_event(row)
        if edited and problem(Problem(edited, event_id=row["id"])):
            return result

    if checkpoint is not None:
        _check_checkpoint(checkpoint, by_seq, result)
    return result


class RangedEvents:
    """The tenant's events with no seal number (range seals' and the unsealed tail), in id
    order, read in keyset pages of PAGE rows (constant memory, no cursor held open, also
    through PgBouncer): range seals hold consecutive id ranges of them, so the walk takes
    each seal's share in turn."""

    PAGE = 5000

    def __init__(self, tenant_id: int | None):
        self._query = AuditEvent.objects.filter(_tenant_q(tenant_id), seal__isnull=True).order_by("id")
        self._page: list[dict] = []
        self._at = 0
        self._after: int | None = None  # no lower bound: a forged negative id is read too
        self._done = False

    def _peek(self) -> dict | None:
        if self._at == len(self._page) and not self._done:
            page = self._query if self._after is None else self._query.filter(pk__gt=self._after)
            self._page = list(page.values(*_COLUMNS)[: self.PAGE])
            self._at = 0
            self._done = len(self._page) < self.PAGE
            if self._page:
                self._after = self._page[-1]["id"]
        return self._page[self._at] if self._at < len(self._page) else None

    def _take_while(self, keep) -> Iterator[dict]:
        while (row := self._peek()) is not None and keep(row["id"]):
            self._at += 1
            yield row

    def before(self, event_id: int) -> Iterator[dict]:
        return self._take_while(lambda i: i < event_id)

    def through(self, event_id: int) -> Iterator[dict]:
        return self._take_while(lambda i: i <= event_id)

    def rest(self) -> Iterator[dict]:
        return self._take_while(lambda i: True)


def _check_checkpoint(checkpoint: dict, by_seq: dict[int, str], result: VerifyResult) -> None:
    seq = int(checkpoint.get("seal") or 0)
    if seq == 0:
        return
    if seq not in by_seq:
        head = result.head.seq if result.head else 0
        result.problems.append(
            Problem(
                f"the checkpoint names seal {seq} but the chain ends at seal {head}: its tail was cut off", seal=seq
            )
        )
    elif by_seq[seq] != checkpoint.get("head_hash"):
        result.problems.append(Problem("differs from the kept checkpoint (hash mismatch)", seal=seq))
    elif result.head is not None and result.head.total < int(checkpoint.get("events") or 0):
        result.problems.append(Problem("the chain holds fewer events than the checkpoint", seal=seq))
