"""Per-tenant per-day event counts (``AuditDailyCount``), folded in from sealed events.

The admin dashboard's figures per day (reads, writes, misses, denials, agent reads) used to
be one aggregate over the last 14 days of the audit log on every page view: 1.5 s on a
tenant with 1M events. They are now counted once per event, by the sealing job, and the
dashboard reads at most ``days × metrics`` small rows plus the tail not folded yet.

Why at sealing and not on insert: an UPSERT of the day's counter row in the request's own
transaction would hold that row's lock until the request commits, so every audited request
of a tenant would queue behind the others on one row (``bench_dashboard`` measures the cost
per insert). The sealing job already reads each event once, in id order, under the tenant's
chain lock; folding its batch adds a GROUP BY (in the database: :func:`_count`) and a few
UPSERTs, off the hot path.

**Exactly once.** ``AuditDailyFold.through_seq`` is the last seal folded into the counts, per
tenant; :func:`fold` folds the seals after it and moves it, in one transaction, under the
chain lock. A seal purged before it was folded (only possible for history older than this
table) is skipped. Events not folded yet — the unsealed tail and any seal after the
watermark — are counted live by :func:`counts`, so the figures are always current.

**Adding a metric** is one entry in :data:`METRICS`: a name and what one event adds to it
(``0`` for most events; an event's ``count`` or a number from its ``detail`` for a sum —
then mark it ``per_event``, and events are counted one by one in Python).
No migration: counts are rows keyed by (tenant, day, metric). A new metric counts from the
next fold on; older days show 0 for it (``manage.py audit_fold_daily --rebuild`` would
refold kept history — not built; see the README).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, date

from django.db import connection, transaction
from django.db.models import Count, Q
from django.db.models.functions import TruncDate

from audit.models import AuditDailyCount, AuditDailyFold, AuditEvent, AuditSeal
from audit.seals import seals_events_q, unsealed_q
from zeromem.kernel.outcomes import ActorKind, Outcome

READ_ACTIONS = frozenset(
    ("memory.read", "memory.search", "memory.recall", "memory.list", "memory.history", "memory.view")
)
AGENT_READ_ACTIONS = frozenset(("memory.read", "memory.search", "memory.recall"))
WRITE_ACTIONS = frozenset(
    ("memory.write", "memory.update", "memory.delete", "memory.restore", "memory.restore_version")
)

# The columns of an event a metric may look at (besides occurred_at, which gives the day).
EVENT_COLUMNS = ("action", "outcome", "actor_kind", "count", "detail")


@dataclass(frozen=True)
class EventRow:
    action: str
    outcome: str
    actor_kind: str
    count: int | None
    detail: dict


@dataclass(frozen=True)
class DailyMetric:
    name: str
    value: Callable[[EventRow], int]  # what one event adds to the day's figure
    # True when ``value`` reads an event's ``count`` or ``detail``: then events are counted one
    # by one in Python. Else they are counted by the database, per (day, action, outcome,
    # actor kind), and ``value`` is asked once per group (:func:`tally_groups`).
    per_event: bool = False


def _memory(e: EventRow) -> bool:
    return e.action.startswith("memory.")


METRICS: tuple[DailyMetric, ...] = (
    DailyMetric("reads", lambda e: int(e.outcome == Outcome.OK and e.action in READ_ACTIONS)),
    DailyMetric("writes", lambda e: int(e.outcome == Outcome.OK and e.action in WRITE_ACTIONS)),
    DailyMetric("misses", lambda e: int(e.outcome == Outcome.NOT_FOUND and _memory(e))),
    DailyMetric("denials", lambda e: int(e.outcome == Outcome.DENIED and _memory(e))),
    # Successful reads by an agent's API key: the input of the dashboard's tokens-saved estimate.
    DailyMetric(
        "agent_reads",
        lambda e: int(e.outcome == Outcome.OK and e.action in AGENT_READ_ACTIONS and e.actor_kind == ActorKind.API_KEY),
    ),
)
METRIC_NAMES = tuple(m.name for m in METRICS)


def tally(rows: Iterable[tuple]) -> Counter:
    """{(day, metric): value} of ``(occurred_at, *EVENT_COLUMNS)`` rows (UTC days)."""
    out: Counter = Counter()
    for occurred_at, *rest in rows:
        event = EventRow(*rest[:4], rest[4] or {})
        day = occurred_at.date()
        for metric in METRICS:
            value = metric.value(event)
            if value:
                out[(day, metric.name)] += value
    return out


GROUP_COLUMNS = ("action", "outcome", "actor_kind")


def tally_groups(rows: Iterable[tuple]) -> Counter:
    """:func:`tally` of ``(day, action, outcome, actor_kind, events)`` groups: what the
    metrics that read only those columns (all but ``per_event`` ones) add up to."""
    out: Counter = Counter()
    for day, action, outcome, actor_kind, events in rows:
        event = EventRow(action, outcome, actor_kind, None, {})
        for metric in METRICS:
            value = metric.value(event)
            if value:
                out[(day, metric.name)] += value * events
    return out


def _count(tenant_id: int, q: Q) -> Counter:
    """The metrics of the tenant's events matching ``q``. With no ``per_event`` metric the
    database groups them (one aggregate: a few hundred rows whatever the events number) —
    counting 1M unsealed events one by one in Python, as a stalled sealing job leaves them for
    the dashboard, took 15.6 s. Cost: one read of the matching events either way."""
    if any(metric.per_event for metric in METRICS):
        return tally(_events(tenant_id, q))
    groups = (
        AuditEvent.objects.filter(q, tenant_id=tenant_id)
        .annotate(day=TruncDate("occurred_at", tzinfo=UTC))
        .order_by()
        .values("day", *GROUP_COLUMNS)
        .annotate(events=Count("id"))
        .values_list("day", *GROUP_COLUMNS, "events")
    )
    return tally_groups(groups)


def _add(tenant_id: int, counts: Counter) -> None:
    if not counts:
        return
    # bandit B608 (marked): the table name is the model's own; every value is a %s parameter.
    table = AuditDailyCount._meta.db_table
    with connection.cursor() as cursor:
        cursor.executemany(
            f"INSERT INTO {table} (tenant_id, day, metric, value) VALUES (%s, %s, %s, %s) "  # nosec B608
            f"ON CONFLICT (tenant_id, day, metric) DO UPDATE SET value = {table}.value + excluded.value",  # nosec B608
            [(tenant_id, day, metric, value) for (day, metric), value in sorted(counts.items())],
        )


def _events(tenant_id: int, q: Q):
    return (
        AuditEvent.objects.filter(q, tenant_id=tenant_id)
        .order_by()
        .values_list("occurred_at", *EVENT_COLUMNS)
        .iterator(chunk_size=5000)
    )


def fold(tenant_id: int, *, max_events: int = 50_000) -> int:
    """Fold the tenant's sealed, not yet folded seals into the counts, oldest first, about
    ``max_events`` events per transaction. The caller holds the tenant's chain lock (or
    accepts that a concurrent fold waits on the watermark row). Returns events folded."""
    folded = 0
    while True:
        with transaction.atomic():
            mark, _ = AuditDailyFold.objects.select_for_update().get_or_create(tenant_id=tenant_id)
            seals = []
            size = 0
            for seal in AuditSeal.objects.filter(tenant_id=tenant_id, seq__gt=mark.through_seq).order_by("seq"):
                if seals and size + seal.count > max_events:
                    break
                seals.append(seal)
                size += seal.count
            if not seals:
                return folded
            kept = [s for s in seals if s.purged_at is None]
            if kept:
                _add(tenant_id, _count(tenant_id, seals_events_q(kept)))
            AuditDailyFold.objects.filter(pk=mark.pk).update(through_seq=seals[-1].seq)
            folded += sum(s.count for s in kept)


def counts(tenant_id: int, *, since: date) -> dict[str, dict[date, int]]:
    """{metric: {day: value}} from ``since`` (a UTC day) to now: the folded counts plus the
    events not folded yet (unsealed, or sealed after the watermark), counted live."""
    out: dict[str, dict[date, int]] = {name: {} for name in METRIC_NAMES}
    for day, metric, value in AuditDailyCount.objects.filter(tenant_id=tenant_id, day__gte=since).values_list(
        "day", "metric", "value"
    ):
        if metric in out:
            out[metric][day] = value
    through = AuditDailyFold.objects.filter(tenant_id=tenant_id).values_list("through_seq", flat=True).first() or 0
    # The unsealed tail (above the last range seal, on the partial index audit_unsealed), then
    # seals after the watermark (none while the sealing job keeps up: it folds as it seals).
    tails = [unsealed_q(tenant_id)]
    unfolded = list(AuditSeal.objects.filter(tenant_id=tenant_id, seq__gt=through, purged_at__isnull=True))
    if unfolded:
        tails.append(seals_events_q(unfolded))
    live: Counter = Counter()
    for q in tails:
        live += _count(tenant_id, q)
    for (day, metric), value in live.items():
        if day >= since:
            out[metric][day] = out[metric].get(day, 0) + value
    return out
