"""The figures of a tenant's admin dashboard (the admin draws them: ``memories.admin.charts``).

Read-only, like every selector: no permission check (the admin page checks the role) and
no audit. Nothing on the page scans the tenant's history or all its memories, so it costs
the same at 1M audit events as at 1,000:

* operations per day and agent reads come from the tenant's daily counts (``audit.daily``:
  folded in by the sealing job, plus the tail not folded yet, counted live). Days are UTC
  days; the window is the last ``DAYS`` days including today;
* the aggregates over live memories (count, by category, largest namespaces, sizes) come
  from ``TenantDashboardStats``, recomputed by the ``dashboard-stats`` schedule for tenants
  with activity (memories/services/dashboard_stats.py), computed on the spot for a tenant
  that has none yet;
* trash, expiring-soon and forget-request counts are live index lookups (expiring soon:
  :func:`expiring_soon`).

**Estimated prompt tokens saved** (documented in the README, "Admin console"): for every
successful agent read in the window (``memory.read``, ``memory.search``, ``memory.recall``
by an API key: the ``agent_reads`` daily count), the agent fetched memory on demand instead
of carrying the whole namespace it reads from in its prompt. Without ZeroMem that turn's
prompt would hold the average namespace's memories — ``total JSON characters of live
memories ÷ distinct namespaces ÷ 4`` tokens (≈ 4 characters per token) — and with ZeroMem it
pays the call and its result: ``CALL_TOKENS`` plus one average memory. So::

    saved ≈ reads × max(0, namespace_tokens − CALL_TOKENS − memory_tokens)

An estimate, not a measurement: it assumes one read per turn and that the alternative is
the namespace in the prompt, and it ignores prompt caching.

**Tokens returned** sits next to it: the estimated tokens of every tool result the tenant's
agents were sent (``ZeroMem-Result-Tokens``, zeromem/kernel/tokens.py), per day, from the
per-tenant daily counters (``TokenUsageDay``, at most ``DAYS`` rows read through the unique
(tenant, day) index). Counters lag by up to ``ZEROMEM_USAGE_FLUSH_SECONDS`` per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta

from django.db import connections, transaction
from django.db.models import Count, Q, Sum, TextField
from django.db.models.functions import Cast, Length
from django.utils import timezone

from audit import daily
from memories.models import ForgetRequest, Memory, Tenant, TenantDashboardStats, TokenUsageDay
from zeromem.kernel.replica import reads_go_to

DAYS = 14
CHARS_PER_TOKEN = 4
CALL_TOKENS = 40  # a memory_read call and the JSON around its result, as the model sees them
SERIES = ("reads", "writes", "misses", "denials")


@dataclass(frozen=True)
class TenantFigures:
    memory_count: int
    trash_count: int
    by_category: list[tuple[str, int]]  # (category, live memories), largest first, at most 12
    by_namespace: list[tuple[str, int]]  # (namespace, live memories), largest first, at most 10
    expiring_count: int  # live memories expiring within 24 hours
    expiring: list[tuple[int, str, datetime]]  # (pk, key, expires_at) of the first 10 of them
    forget: dict[str, int]  # forget requests: open, overdue, failed, completed
    days: list[date]  # the last DAYS days, oldest first
    operations: dict[str, list[int]]  # one count per day for each of SERIES
    tokens: dict  # the estimate of prompt tokens saved, with its inputs
    tokens_returned: list[int]  # estimated tokens of tool results sent, one figure per day of ``days``
    # When the memory figures (count, by category/namespace) were computed; None: now.
    memory_figures_at: datetime | None = None
    # When the JSON size of live memories (the token estimate's input) was summed: on a large
    # tenant less often than the counts (memories/services/dashboard_stats.py); None: now.
    chars_at: datetime | None = None


def memory_figures(*, tenant: Tenant, now, chars: bool = True) -> dict:
    """The aggregates over every live memory of the tenant (JSON-ready): the part of the page
    that grows with the tenant's memories. Served from ``TenantDashboardStats`` (the
    ``dashboard-stats`` schedule) when there is one; computed here otherwise.

    The counts are exact. On PostgreSQL they come from one statement that reads no row of
    the live memories (:data:`_COUNTS_SQL`). ``chars`` (the JSON size of the live memories,
    for the token estimate) does read every live row: with ``chars=False`` it is left out,
    and the caller keeps an earlier one (``chars_at``, ``chars_memories``: when, and over how
    many memories, it was summed)."""
    db = connections[reads_go_to()]  # the replica, under replica_reads() (the admin page)
    if db.vendor == "postgresql":
        figures = _counts_postgresql(db, tenant=tenant, now=now)
    else:
        figures = _counts_orm(tenant=tenant, now=now)
    if chars:
        figures.update(memory_chars(tenant=tenant, now=now))
    return figures


def memory_chars(*, tenant: Tenant, now) -> dict:
    """The JSON characters of the tenant's live memories and how many they are, summed in one
    read of every live row (the value is in the heap, no index holds it)."""
    sizes = (
        Memory.objects.using(reads_go_to())
        .for_tenant(tenant)
        .live(now)
        .aggregate(chars=Sum(Length(Cast("value", output_field=TextField()))), memories=Count("pk"))
    )
    return {"chars": sizes["chars"] or 0, "chars_memories": sizes["memories"], "chars_at": now.isoformat()}


def _counts_orm(*, tenant: Tenant, now) -> dict:
    """The counts as the ORM writes them (SQLite, the embedded default): a scan of the live rows."""
    live = Memory.objects.using(reads_go_to()).for_tenant(tenant).live(now)
    by_category = live.values_list("category").annotate(n=Count("pk")).order_by("-n", "category")[:12]
    by_namespace = live.values_list("namespace").annotate(n=Count("pk")).order_by("-n", "namespace")[:10]
    sizes = live.aggregate(memories=Count("pk"), namespaces=Count("namespace", distinct=True))
    return {
        "memory_count": sizes["memories"] or 0,
        "by_category": [list(row) for row in by_category],
        "by_namespace": [list(row) for row in by_namespace],
        "namespaces": sizes["namespaces"] or 0,
    }


# The live counts as every memory of the tenant minus the ones that are not live, so that
# the tenant's rows are read from indexes alone (index-only scans, no heap: neither index
# holds deleted_at or expires_at, so a filter on them would read every row of the tenant):
# - every memory by category: memory_tenant_category (tenant_id, category);
# - every memory by namespace: memory_tenant_namespace (tenant_id, namespace, key);
# - minus the trashed ones: memory_trash_figures (tenant_id, namespace, category) WHERE
#   deleted_at IS NOT NULL (migration 0037), index-only too;
# - and minus the expired ones not trashed yet: a range of (tenant_id, expires_at) up to now
#   (memory_tenant_expires), the only rows read from the heap, for their namespace and
#   category; the TTL purge keeps them few.
# A category or namespace none of whose memories is live is left out.
# Constant SQL (nosec B608): the values are parameters.
_COUNTS_SQL = """
WITH dead AS MATERIALIZED (
    SELECT namespace, category FROM memories_memory WHERE tenant_id = %(tenant)s AND deleted_at IS NOT NULL
    UNION ALL
    SELECT namespace, category FROM memories_memory
    WHERE tenant_id = %(tenant)s AND expires_at IS NOT NULL AND expires_at <= %(now)s AND deleted_at IS NULL
), by_namespace AS MATERIALIZED (
    SELECT t.namespace, t.n - coalesce(d.n, 0) AS n
    FROM (SELECT namespace, count(*) AS n FROM memories_memory WHERE tenant_id = %(tenant)s GROUP BY namespace) t
    LEFT JOIN (SELECT namespace, count(*) AS n FROM dead GROUP BY namespace) d USING (namespace)
), by_category AS (
    SELECT t.category, t.n - coalesce(d.n, 0) AS n
    FROM (SELECT category, count(*) AS n FROM memories_memory WHERE tenant_id = %(tenant)s GROUP BY category) t
    LEFT JOIN (SELECT category, count(*) AS n FROM dead GROUP BY category) d USING (category)
)
(SELECT 'category', category, n FROM by_category WHERE n > 0 ORDER BY n DESC, category LIMIT 12)
UNION ALL
(SELECT 'namespace', namespace, n FROM by_namespace WHERE n > 0 ORDER BY n DESC, namespace LIMIT 10)
UNION ALL
(SELECT 'totals', NULL, count(*) FROM by_namespace WHERE n > 0)
UNION ALL
(SELECT 'totals', 'memories', coalesce(sum(n), 0) FROM by_namespace WHERE n > 0)
"""


def _counts_postgresql(db, *, tenant: Tenant, now) -> dict:
    figures = {"memory_count": 0, "by_category": [], "by_namespace": [], "namespaces": 0}
    with db.cursor() as cursor:
        cursor.execute(_COUNTS_SQL, {"tenant": tenant.pk, "now": now})
        for kind, name, n in cursor.fetchall():
            if kind == "totals":
                figures["memory_count" if name == "memories" else "namespaces"] = int(n)
            else:
                figures[f"by_{kind}"].append([name, int(n)])
    return figures


def tenant_dashboard(*, tenant: Tenant, now=None) -> TenantFigures:
    now = now or timezone.now()
    stats = TenantDashboardStats.objects.filter(tenant=tenant).first()
    memory = stats.figures if stats is not None else memory_figures(tenant=tenant, now=now)
    expiring_count, expiring = expiring_soon(tenant=tenant, now=now)
    forget = ForgetRequest.objects.filter(tenant=tenant)
    late = ~Q(status=ForgetRequest.Status.COMPLETED) & Q(due_at__lte=now)
    forget_counts = forget.aggregate(
        open=Count("pk", filter=Q(status__in=[ForgetRequest.Status.RECEIVED, ForgetRequest.Status.RUNNING])),
        overdue=Count("pk", filter=late),
        failed=Count("pk", filter=Q(status=ForgetRequest.Status.FAILED)),
        completed=Count("pk", filter=Q(status=ForgetRequest.Status.COMPLETED)),
    )
    days, per_day = _daily(tenant=tenant, now=now)  # one read of the daily counts for every series
    series = {name: [per_day[name].get(d, 0) for d in days] for name in SERIES}
    tokens = tokens_saved(memory=memory, per_day=per_day)
    returned = tokens_returned(tenant=tenant, days=days)
    tokens["returned"] = sum(returned)
    return TenantFigures(
        memory_count=memory["memory_count"],
        trash_count=Memory.objects.for_tenant(tenant).trashed().count(),
        by_category=[tuple(row) for row in memory["by_category"]],
        by_namespace=[tuple(row) for row in memory["by_namespace"]],
        expiring_count=expiring_count,
        expiring=expiring,
        forget=forget_counts,
        days=days,
        operations=series,
        tokens=tokens,
        tokens_returned=returned,
        memory_figures_at=stats.computed_at if stats is not None else None,
        chars_at=_chars_at(stats),
    )


def _chars_at(stats: TenantDashboardStats | None) -> datetime | None:
    if stats is None:
        return None
    at = stats.figures.get("chars_at")  # figures stored before it was kept: summed with the counts
    return datetime.fromisoformat(at) if at else stats.computed_at


# The tenant's live memories expiring in (now, now + 24 h]. A row comparison on (tenant_id,
# expires_at) is one range of memory_tenant_expiring, and no other index can serve it: the
# planner, which cannot know that a tenant's 200k memories hold a few hundred with a TTL nor
# that another tenant's many short-lived ones are not this tenant's, otherwise estimated tens
# of thousands of rows and scanned the tenant's rows or the tenant-less memory_expiring.
_EXPIRING_SQL = (
    "FROM memories_memory WHERE (tenant_id, expires_at) > (%s, %s) AND (tenant_id, expires_at) <= (%s, %s)"
    " AND expires_at IS NOT NULL AND deleted_at IS NULL"
)


def expiring_soon(*, tenant: Tenant, now) -> tuple[int, list[tuple[int, str, datetime]]]:
    """How many of the tenant's live memories expire within 24 hours, and (pk, key,
    expires_at) of the first 10 of them. On PostgreSQL one range of memory_tenant_expiring
    each, without parallel workers (their start-up, ~5 ms, is most of a count of a few
    hundred index entries; the planner's overestimate asked for them)."""
    until = now + timedelta(hours=24)
    db = connections[reads_go_to()]  # the replica, under replica_reads() (the admin page)
    if db.vendor != "postgresql":
        soon = Memory.objects.for_tenant(tenant).live(now).filter(expires_at__isnull=False, expires_at__lte=until)
        return soon.count(), list(soon.order_by("expires_at").values_list("pk", "key", "expires_at")[:10])
    params = [tenant.pk, now, tenant.pk, until]
    with transaction.atomic(using=db.alias), db.cursor() as cursor:
        cursor.execute("SELECT set_config('max_parallel_workers_per_gather', '0', true)")
        cursor.execute(f"SELECT COUNT(*) {_EXPIRING_SQL}", params)  # nosec B608: constant SQL
        count = cursor.fetchone()[0]
        cursor.execute(
            f'SELECT id, "key", expires_at {_EXPIRING_SQL} ORDER BY tenant_id, expires_at LIMIT 10',  # nosec B608
            params,
        )
        return count, [tuple(row) for row in cursor.fetchall()]


def operations_per_day(*, tenant: Tenant, now) -> tuple[list[date], dict[str, list[int]]]:
    """Reads, writes, misses (not found) and denials per (UTC) day over the last ``DAYS``
    days, from the tenant's daily counts (``audit.daily``: folded in by the sealing job, plus
    the tail not folded yet)."""
    days, per_day = _daily(tenant=tenant, now=now)
    return days, {name: [per_day[name].get(d, 0) for d in days] for name in SERIES}


def _daily(*, tenant: Tenant, now) -> tuple[list[date], dict[str, dict[date, int]]]:
    start_day = (now - timedelta(days=DAYS - 1)).date()
    days = [start_day + timedelta(days=i) for i in range(DAYS)]
    return days, daily.counts(tenant.pk, since=start_day)


def tokens_saved(*, memory: dict, per_day: dict[str, dict[date, int]]) -> dict:
    """The estimate described in the module docstring, with its inputs (shown on the page):
    ``memory`` is :func:`memory_figures`, ``per_day`` the daily counts of the window."""
    reads = sum(per_day["agent_reads"].values())
    memories = memory["memory_count"]
    namespaces = max(memory["namespaces"], 1 if memories else 0)
    # The average memory's characters, from the last sum of them (over ``chars_memories``
    # memories, on a large tenant up to ZEROMEM_DASHBOARD_CHARS_HOURS ago), times today's
    # memories per namespace: the same as chars ÷ namespaces when the sum is today's.
    summed_over = memory.get("chars_memories", memories)
    average_chars = memory["chars"] / summed_over if summed_over else 0
    namespace_tokens = average_chars * memories / namespaces / CHARS_PER_TOKEN if namespaces else 0
    memory_tokens = average_chars / CHARS_PER_TOKEN if memories else 0
    per_read = max(0.0, namespace_tokens - CALL_TOKENS - memory_tokens)
    return {
        "reads": reads,
        "namespace_tokens": round(namespace_tokens),
        "memory_tokens": round(memory_tokens),
        "call_tokens": CALL_TOKENS,
        "per_read": round(per_read),
        "saved": round(reads * per_read),
    }


def tokens_returned(*, tenant: Tenant, days: list[date]) -> list[int]:
    """Estimated tokens of the tool results sent to the tenant's agents, one figure per day."""
    by_day = dict(
        TokenUsageDay.objects.filter(tenant=tenant, day__gte=days[0], day__lte=days[-1]).values_list("day", "tokens")
    )
    return [by_day.get(d, 0) for d in days]
