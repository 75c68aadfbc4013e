"""Retention: how long memories live, and the job that erases them once they are gone.

* **Default TTL by prefix.** A tenant's :class:`~memories.models.RetentionRule` rows give
  keys under a prefix a lifetime (``session:`` → 24 h). ``memory_write`` applies the
  longest matching prefix's ``default_ttl_seconds`` when it *creates* a memory without
  ``ttl_seconds`` (:func:`default_ttl_seconds_for`), and to a LangGraph put without
  ``ttl`` (create or replace: it is that store's default TTL); updates never change an
  expiry implicitly.
* **Purge.** Expired memories are invisible at once (every read filters on
  ``expires_at``); :func:`purge_expired` erases them for good, with their version history,
  and erases trashed memories once their trash retention has passed.

Each setting is looked up field by field: the longest matching prefix among the rules
that *set* it wins, so a rule that only sets a TTL does not reset the trash retention of
a broader rule. Trash retention then falls back to ``Tenant.trash_retention_days`` and
``settings.ZEROMEM_TRASH_RETENTION_DAYS``.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Case, CharField, DateTimeField, F, Q, QuerySet, Value, When
from django.db.models.functions import Length, Substr
from django.db.models.lookups import Exact
from django.utils import timezone

from audit.services import audit_record, audited_operation
from memories.models import Memory, MemoryEmbedding, MemoryVersion, RetentionRule, SearchErasure, Tenant
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor, require_key_allowed, require_scope
from zeromem.kernel.errors import InvalidInput
from zeromem.kernel.outcomes import Outcome
from zeromem.kernel.scopes import Scope

# 5000: the purge's rate doubled over 1000 (fewer commits and per-batch statements) with the
# concurrent read p99 unchanged (bench_purge, README "Running on PostgreSQL at scale").
# A writer re-creating a key whose expired row is in the batch waits for it (~0.1-0.25 s).
DEFAULT_BATCH_SIZE = 5000
TRASH_RETENTION_MAX_DAYS = 3650
PURGE_JOB = "purge_expired"
# What ZEROMEM_PURGE_WAL_COMPRESSION=auto picks, best first, among the methods this
# PostgreSQL was built with (zstd and lz4 are build options; pglz always exists).
WAL_COMPRESSION_PREFERENCE = ("zstd", "lz4", "pglz")


# --- default TTL (the write hot path) ----------------------------------------------------


def default_ttl_seconds_for(*, tenant: Tenant, key: str) -> int | None:
    """The ``default_ttl_seconds`` of the longest rule prefix that ``key`` starts with.

    Cost: one query, a range scan of the tenant's rules on the (tenant, prefix) unique
    index; the prefix match (``substr(key, 1, length(prefix)) = prefix``) is exact, with no
    LIKE wildcards to escape. Called only when a write creates a memory.
    """
    return _longest_rule(tenant, key, "default_ttl_seconds")


def _longest_rule(tenant: Tenant, key: str, field: str):
    """``field`` of the tenant's rule with the longest prefix of ``key`` among those that set
    it (or None). One query."""
    return (
        RetentionRule.objects.filter(tenant=tenant, **{f"{field}__isnull": False})
        .alias(head=Substr(Value(key, output_field=CharField()), 1, Length("prefix")))
        .filter(head=F("prefix"))
        .order_by(Length("prefix").desc())
        .values_list(field, flat=True)
        .first()
    )


def default_expiry_for(*, tenant: Tenant, key: str, now: datetime) -> datetime | None:
    """When a memory created at ``now`` under ``key`` expires by its tenant's rules (or None)."""
    ttl = default_ttl_seconds_for(tenant=tenant, key=key)
    return now + timedelta(seconds=ttl) if ttl is not None else None


def trash_cutoff_for(*, tenant: Tenant, key: str, now: datetime) -> datetime:
    """The moment before which a memory trashed under ``key`` is past its trash retention (the
    purge's, no longer restorable): the longest prefix among the tenant's rules that set
    ``trash_retention_days``, else the tenant's, else ``ZEROMEM_TRASH_RETENTION_DAYS`` —
    the cutoff :func:`_old_trash_by_tenant` gives the purge. Cost: one query (the rule)."""
    days = _longest_rule(tenant, key, "trash_retention_days")
    if days is None:
        days = (
            settings.ZEROMEM_TRASH_RETENTION_DAYS
            if tenant.trash_retention_days is None
            else tenant.trash_retention_days
        )
    return _trash_cutoff(now, days)


def retention_rule_set(
    *,
    tenant: Tenant,
    actor: Actor,
    prefix: Any,
    default_ttl_seconds: Any = None,
    trash_retention_days: Any = None,
) -> RetentionRule | None:
    """Create or change the tenant's rule for ``prefix``; with both settings None, remove it.

    Returns the rule (None when removed). A rule changes when memories under it expire and
    are erased, so the actor needs ``memory:write`` and ``memory:delete``, and a key limited
    to some prefixes may only set rules inside them. Cost: one upsert and the audit INSERT.
    """
    with audited_operation(tenant=tenant, actor=actor, action="retention_rule.set", target=prefix) as op:
        prefix = validation.prefix(prefix)
        require_scope(actor, Scope.MEMORY_WRITE)
        require_scope(actor, Scope.MEMORY_DELETE)
        require_key_allowed(actor, prefix)
        ttl = validation.ttl_seconds(default_ttl_seconds, field="default_ttl_seconds")
        if trash_retention_days is not None:
            trash_retention_days = validation.bounded_int(
                trash_retention_days,
                field="trash_retention_days",
                default=0,
                low=0,
                high=TRASH_RETENTION_MAX_DAYS,
            )
        ttl_seconds = int(ttl.total_seconds()) if ttl is not None else None
        if ttl_seconds is None and trash_retention_days is None:
            removed, _ = RetentionRule.objects.filter(tenant=tenant, prefix=prefix).delete()
            rule = None
        else:
            removed = 0
            rule, _ = RetentionRule.objects.update_or_create(
                tenant=tenant,
                prefix=prefix,
                defaults={"default_ttl_seconds": ttl_seconds, "trash_retention_days": trash_retention_days},
            )
        op.record(
            target=prefix,
            detail={
                "default_ttl_seconds": ttl_seconds,
                "trash_retention_days": trash_retention_days,
                "removed": bool(removed),
            },
        )
    return rule


# --- the purge job ------------------------------------------------------------------------


def _expired(now: datetime) -> QuerySet[Memory]:
    # Served by the partial index memory_expiring (expires_at) WHERE expires_at IS NOT NULL.
    return Memory.objects.filter(expires_at__lte=now)


def _starts_with(prefix: str) -> Exact:
    # Not key__startswith: that is a LIKE, case-insensitive on SQLite, and keys are not.
    return Exact(Substr("key", 1, len(prefix)), Value(prefix, output_field=CharField()))


def _trash_cutoff(now: datetime, days: int) -> datetime:
    # A tenant may keep its trash longer than dates reach (the admin takes any number of
    # days): nothing of it is old enough, and the loop goes on to the next tenant.
    try:
        return now - timedelta(days=days)
    except OverflowError:
        return datetime.min.replace(tzinfo=UTC)


# --- what a restore still brings back ---------------------------------------------------

EXPIRED_BEFORE_TRASH = "expired before it went to the trash"
PAST_TRASH_RETENTION = "past its trash retention"


def restore_refusal(memory: Memory, *, cutoff: datetime) -> str | None:
    """Why :func:`~memories.services.memories.memory_restore` refuses trashed ``memory``
    (``cutoff``: :func:`trash_cutoff_for` its key), else None: what the purge erases is not
    brought back by a restore that runs before it does. No query."""
    if _expired_before_trash(memory):
        return EXPIRED_BEFORE_TRASH
    if memory.deleted_at < cutoff:
        return PAST_TRASH_RETENTION
    return None


def restorable_trash(queryset: QuerySet[Memory], *, tenant_ids: Iterable[int], now: datetime) -> QuerySet[Memory]:
    """The trashed memories of ``queryset`` (of the tenants ``tenant_ids``) a restore brings
    back: :func:`restore_refusal`'s rule as a filter, each row's retention cutoff picked as
    :func:`_old_trash_by_tenant` picks the purge's (a CASE over the rules of those tenants
    and their own settings; the server's default for the rest). Cost: one query for the
    rules and tenants; the filter is evaluated on the trashed rows it reads."""
    return queryset.filter(_restorable_q(tenant_ids, now))


def unrestorable_trash(queryset: QuerySet[Memory], *, tenant_ids: Iterable[int], now: datetime) -> QuerySet[Memory]:
    """The trashed memories of ``queryset`` a restore refuses (the purge erases them)."""
    return queryset.filter(deleted_at__isnull=False).exclude(_restorable_q(tenant_ids, now))


def trash_refusals(memories: Iterable[Memory], *, now: datetime) -> dict[int, str]:
    """{id: why a restore refuses it} for the trashed ``memories`` (e.g. a page of a list) a
    restore would not bring back. Cost: two queries (rules, the restorable ids among them),
    none when no memory is trashed."""
    trashed = [m for m in memories if m.deleted_at is not None]
    if not trashed:
        return {}
    refusals = {m.pk: EXPIRED_BEFORE_TRASH for m in trashed if _expired_before_trash(m)}
    tenant_ids = {m.tenant_id for m in trashed}
    restorable = set(
        restorable_trash(
            Memory.objects.filter(pk__in=[m.pk for m in trashed]), tenant_ids=tenant_ids, now=now
        ).values_list("pk", flat=True)
    )
    for memory in trashed:
        if memory.pk not in restorable and memory.pk not in refusals:
            refusals[memory.pk] = PAST_TRASH_RETENTION
    return refusals


def _expired_before_trash(memory: Memory) -> bool:
    # Trashed by a write or restore that took its key after it had expired (see
    # memories._lock_current_unexpired): nobody deleted it, it expired while live.
    return memory.expires_at is not None and memory.expires_at <= memory.deleted_at


def _restorable_q(tenant_ids: Iterable[int], now: datetime) -> Q:
    # One WHEN per distinct (prefix, days) of the rules, then per distinct days of the
    # tenants' own settings, each naming its tenants (``tenant_id IN``: a hashed array on
    # PostgreSQL), not one per rule and per tenant: a superuser's trash covers every tenant,
    # and 2,000 tenants each with a setting and a rule made a CASE of 4,000 WHENs walked for
    # every trashed row (the page 4.1 s against 0.6 s for "everything", quadratic in the
    # tenants). Same rule: a tenant's rules longest prefix first (two prefixes of one length
    # never both start a key), then its own setting, then the server's.
    tenant_ids = set(tenant_ids)
    by_rule: dict[tuple[str, int], list[int]] = defaultdict(list)
    for prefix_tenant, prefix, days in (
        RetentionRule.objects.filter(tenant_id__in=tenant_ids, trash_retention_days__isnull=False)
        .order_by(Length("prefix").desc(), "prefix", "tenant_id")
        .values_list("tenant_id", "prefix", "trash_retention_days")
    ):
        by_rule[(prefix, days)].append(prefix_tenant)
    by_days: dict[int, list[int]] = defaultdict(list)
    for tenant_id, days in (
        Tenant.objects.filter(pk__in=tenant_ids, trash_retention_days__isnull=False)
        .order_by("pk")
        .values_list("pk", "trash_retention_days")
    ):
        by_days[days].append(tenant_id)
    whens = [
        When(Q(tenant_id__in=ids) & _starts_with(prefix), then=Value(_trash_cutoff(now, days)))
        for (prefix, days), ids in by_rule.items()
    ]
    whens += [When(tenant_id__in=ids, then=Value(_trash_cutoff(now, days))) for days, ids in by_days.items()]
    fallback = Value(_trash_cutoff(now, settings.ZEROMEM_TRASH_RETENTION_DAYS), output_field=DateTimeField())
    cutoff = Case(*whens, default=fallback, output_field=DateTimeField()) if whens else fallback
    return (
        Q(deleted_at__isnull=False)
        & (Q(expires_at__isnull=True) | Q(expires_at__gt=F("deleted_at")))
        & Q(deleted_at__gte=cutoff)
    )


def _old_trash_by_tenant(now: datetime) -> Iterable[tuple[int, QuerySet[Memory]]]:
    """Per tenant, the trashed memories whose retention has passed.

    One query loads every rule that sets a trash retention; then each tenant is one probe of
    the partial index memory_trash (tenant, deleted_at), bounded by its shortest retention.
    Within that range a CASE picks each row's cutoff by the longest matching prefix.
    """
    rules: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for tenant_id, prefix, days in (
        RetentionRule.objects.filter(trash_retention_days__isnull=False)
        .order_by("tenant_id", Length("prefix").desc(), "prefix")
        .values_list("tenant_id", "prefix", "trash_retention_days")
    ):
        rules[tenant_id].append((prefix, days))
    server_days = settings.ZEROMEM_TRASH_RETENTION_DAYS
    for tenant_id, tenant_days in Tenant.objects.order_by("pk").values_list("pk", "trash_retention_days"):
        fallback = _trash_cutoff(now, server_days if tenant_days is None else tenant_days)
        tenant_rules = [(prefix, _trash_cutoff(now, days)) for prefix, days in rules.get(tenant_id, [])]
        latest_cutoff = max([fallback, *(cutoff for _, cutoff in tenant_rules)])
        qs = Memory.objects.filter(tenant_id=tenant_id, deleted_at__isnull=False, deleted_at__lt=latest_cutoff)
        if tenant_rules:
            cutoff = Case(
                *(When(_starts_with(prefix), then=Value(c)) for prefix, c in tenant_rules),
                default=Value(fallback),
                output_field=DateTimeField(),
            )
            qs = qs.alias(cutoff=cutoff).filter(deleted_at__lt=F("cutoff"))
        yield tenant_id, qs


# PostgreSQL erases a batch in ONE statement: the ids never travel to Python and back
# (with Django's client-side parameter binding, quoting a 1000-element id array costs more
# CPU than the deletes themselves). ``picked`` is the candidates' SELECT ... LIMIT n FOR
# UPDATE SKIP LOCKED; ``= ANY(ARRAY(...))`` keeps both DELETEs on their id indexes.
_ERASE_SQL = """
WITH picked(id) AS MATERIALIZED ({picked}),
embeddings AS (
    DELETE FROM {embeddings} WHERE memory_id = ANY(ARRAY(SELECT id FROM picked))
),
versions AS (
    DELETE FROM {versions} WHERE memory_id = ANY(ARRAY(SELECT id FROM picked)) RETURNING tenant_id
),
erased AS (
    DELETE FROM {memories} WHERE id = ANY(ARRAY(SELECT id FROM picked)) RETURNING tenant_id
)
SELECT 'memories', tenant_id, count(*) FROM erased GROUP BY tenant_id
UNION ALL
SELECT 'versions', tenant_id, count(*) FROM versions GROUP BY tenant_id
"""


def wal_compression_for_erasure() -> str | None:
    """The ``wal_compression`` method an erasing transaction sets (``SET LOCAL``), or None to
    leave the server's setting alone.

    Erasing memories after a checkpoint writes a full-page image of every heap page it
    touches first; those images are ~70% of the purge's WAL, and compressing them (zstd) cuts
    its WAL per erased memory by ~60% (README, Running on PostgreSQL at scale). The setting
    needs a superuser or, from PostgreSQL 15, ``GRANT SET ON PARAMETER wal_compression``;
    without that privilege (or on SQLite, or with ``ZEROMEM_PURGE_WAL_COMPRESSION=off``) it
    is None and the erasure runs as before — never an error. ``auto`` (the default) takes the
    best method this server was built with; a named method the server lacks is None too.
    Cost: one catalog query per call (once per purge run or forget request).
    """
    wanted = (settings.ZEROMEM_PURGE_WAL_COMPRESSION or "off").lower()
    if connection.vendor != "postgresql" or wanted == "off":
        return None
    with connection.cursor() as cursor:
        if connection.pg_version >= 150000:
            cursor.execute("SELECT has_parameter_privilege('wal_compression', 'SET')")
        else:  # before 15, only a superuser may set it
            cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        row = cursor.fetchone()
        if not row or not row[0]:
            return None
        cursor.execute("SELECT setting, enumvals FROM pg_settings WHERE name = 'wal_compression'")
        current, methods = cursor.fetchone()
    candidates = WAL_COMPRESSION_PREFERENCE if wanted == "auto" else (wanted,)
    method = next((m for m in candidates if m in (methods or ())), None)
    return None if method is None or method == current else method


def set_local_wal_compression(method: str | None) -> None:
    """``SET LOCAL wal_compression`` in the current transaction (see
    :func:`wal_compression_for_erasure`); nothing when ``method`` is None."""
    if method is not None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('wal_compression', %s, true)", [method])


def _erase_postgresql(candidates: QuerySet[Memory], batch_size: int) -> tuple[Counter, Counter]:
    # Rows another purge worker (or a writer) holds are skipped, not waited for: that worker
    # erases them, or the next run does. Readers never wait on row locks.
    picked = candidates.order_by().select_for_update(skip_locked=True).values("pk")[:batch_size]
    picked_sql, params = picked.query.get_compiler(connection=connection).as_sql()
    sql = _ERASE_SQL.format(
        picked=picked_sql,
        versions=connection.ops.quote_name(MemoryVersion._meta.db_table),
        embeddings=connection.ops.quote_name(MemoryEmbedding._meta.db_table),
        memories=connection.ops.quote_name(Memory._meta.db_table),
    )
    erased: Counter = Counter()
    versions: Counter = Counter()
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for kind, tenant_id, count in cursor.fetchall():
            (erased if kind == "memories" else versions)[tenant_id] = count
    return erased, versions


def _erase_sqlite(candidates: QuerySet[Memory], batch_size: int) -> tuple[Counter, Counter]:
    # SQLite has no row locks (its IMMEDIATE transactions serialize writers) and no DELETE
    # in a CTE: pick the ids, then delete versions and memories by id list. The counts come
    # from RETURNING, i.e. what was erased, not what the SELECT saw.
    ids = list(candidates.order_by().values_list("pk", flat=True)[:batch_size])
    if not ids:
        return Counter(), Counter()
    marks = ", ".join(["%s"] * len(ids))
    counts = []
    with connection.cursor() as cursor:
        MemoryEmbedding.objects.filter(memory_id__in=ids).delete()
        for model, column in ((MemoryVersion, "memory_id"), (Memory, "id")):
            table = connection.ops.quote_name(model._meta.db_table)
            # bandit B608 (marked): table and column are the models' own; the ids are %s parameters.
            cursor.execute(f"DELETE FROM {table} WHERE {column} IN ({marks}) RETURNING tenant_id", ids)  # nosec B608
            counts.append(Counter(tenant_id for (tenant_id,) in cursor.fetchall()))
    versions, erased = counts
    return erased, versions


def _purge_batch(
    candidates: QuerySet[Memory], *, reason: str, batch_size: int, tenants: dict, wal_compression: str | None
) -> tuple[int, int]:
    """Erase up to ``batch_size`` candidates, with their versions, in one short transaction;
    returns (memories, versions) erased. Audited: one event per tenant in the batch."""
    erase = _erase_postgresql if connection.vendor == "postgresql" else _erase_sqlite
    with transaction.atomic():
        set_local_wal_compression(wal_compression)
        erased, versions = erase(candidates, batch_size)
        if not erased:
            return 0, 0
        missing = [t for t in erased if t not in tenants]
        if missing:
            tenants.update(Tenant.objects.in_bulk(missing))
        actor = Actor.system(job=PURGE_JOB)
        for tenant_id, count in sorted(erased.items()):
            audit_record(
                tenant=tenants[tenant_id],
                actor=actor,
                action="memory.purge",
                outcome=Outcome.OK,
                count=count,
                detail={"reason": reason, "versions": versions.get(tenant_id, 0)},
            )
        _mark_erasures(sorted(erased))
        return sum(erased.values()), sum(versions.values())


# One statement per batch, not per memory. Last in the batch's transaction: two workers
# erasing from one tenant wait for each other's row here only until the first commits; in
# tenant order (the caller sorts), so two workers never lock each other's rows crosswise.
_MARK_ERASURES_SQL = """
INSERT INTO {table} (tenant_id, batches) SELECT unnest(%s::bigint[]), 1
ON CONFLICT (tenant_id) DO UPDATE SET batches = {table}.batches + 1
"""


def _mark_erasures(tenant_ids: list[int]) -> None:
    """Make the term statistics of these tenants due for a recount (``SearchErasure``):
    the erased memories' words must leave ``SearchTerm`` too. In the batch's transaction,
    so a batch that commits has marked them. PostgreSQL only: SQLite keeps no statistics."""
    if connection.vendor != "postgresql":
        return
    table = connection.ops.quote_name(SearchErasure._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(_MARK_ERASURES_SQL.format(table=table), [tenant_ids])


def purge_expired(
    *,
    now: datetime | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_batches: int | None = None,
    progress: Callable[[int], None] | None = None,
    pause_ratio: float | None = None,
    memories_per_second: float | None = None,
) -> dict:
    """Erase (hard delete) expired memories — live or trashed — and trash older than its
    retention, each with its whole version history.

    Works in batches of ``batch_size`` memories, each its own short transaction: on
    PostgreSQL the batch is picked with ``FOR UPDATE SKIP LOCKED``, so several workers can
    run at once, each row is erased by exactly one of them, and nobody waits on anyone.
    Every batch writes one ``memory.purge`` audit event per tenant with the count (never a
    key or a value). Idempotent: a second run finds nothing. Rows that expire after ``now``
    (default: the start of the run) wait for the next run, so a run always ends.

    Cost per batch: one statement on PostgreSQL (an index range scan of memory_expiring or
    memory_trash, three DELETEs by id list), one audit INSERT per tenant, one upsert that
    makes the batch's tenants due for a term statistics recount (``SearchErasure``), a
    commit. Versions and embeddings have no foreign key in the database (memories migrations 0015 and 0018:
    the check, then the cascade's trigger, were the largest single parts of a batch; the
    embedding job writes only for live memories it holds locked, never for one the purge
    erases). ``progress(erased_so_far)`` is called after each batch. Returns {"expired",
    "trash", "versions", "batches", "seconds"}.

    **Pacing.** The purge erases at most ``memories_per_second`` (default
    ``settings.ZEROMEM_PURGE_MEMORIES_PER_SECOND``; 0: as fast as it can): after each batch
    it sleeps until the run's average is back at that rate, so its WAL reaches the disk in
    an even stream instead of bursts that a concurrent request's commit would queue behind.
    After each batch it also sleeps at least ``pause_ratio`` × the batch's own time
    (default ``settings.ZEROMEM_PURGE_PAUSE_RATIO``). ``bench_purge`` measures the read p99
    with and without either.

    **WAL.** Each batch sets ``wal_compression`` locally when the database role may
    (:func:`wal_compression_for_erasure`), which cuts the full-page images a purge after a
    checkpoint writes.
    """
    if batch_size < 1:
        raise InvalidInput("must be at least 1", field="batch_size")
    pause_ratio = settings.ZEROMEM_PURGE_PAUSE_RATIO if pause_ratio is None else pause_ratio
    if pause_ratio < 0:
        raise InvalidInput("must be at least 0", field="pause_ratio")
    rate = settings.ZEROMEM_PURGE_MEMORIES_PER_SECOND if memories_per_second is None else memories_per_second
    if rate < 0:
        raise InvalidInput("must be at least 0 (0: unpaced)", field="memories_per_second")
    started = time.monotonic()
    now = now or timezone.now()
    totals = {"expired": 0, "trash": 0, "versions": 0, "batches": 0}
    tenants: dict[int, Tenant] = {}
    wal_compression = wal_compression_for_erasure()

    def drain(reason: str, candidates: QuerySet[Memory]) -> bool:
        """Purge until the candidates run out; False once max_batches is reached."""
        while True:
            if max_batches is not None and totals["batches"] >= max_batches:
                return False
            batch_started = time.monotonic()
            memories, versions = _purge_batch(
                candidates, reason=reason, batch_size=batch_size, tenants=tenants, wal_compression=wal_compression
            )
            if not memories:
                return True
            totals["batches"] += 1
            totals[reason] += memories
            totals["versions"] += versions
            finished = time.monotonic()
            pause = (finished - batch_started) * pause_ratio
            if rate:
                # Back on the run's average rate: erased / rate seconds since the start.
                pause = max(pause, (totals["expired"] + totals["trash"]) / rate - (finished - started))
            if pause > 0:
                time.sleep(pause)
            if progress is not None:
                progress(totals["expired"] + totals["trash"])

    if drain("expired", _expired(now)):
        for _tenant_id, candidates in _old_trash_by_tenant(now):
            if not drain("trash", candidates):
                break
    return {**totals, "seconds": round(time.monotonic() - started, 3)}


def purge_pending(*, now: datetime | None = None) -> dict:
    """How many memories a purge at ``now`` would erase: {"expired": n, "trash": n}.
    Counts over the same indexes the purge uses (the command's progress bar needs a total)."""
    now = now or timezone.now()
    expired = _expired(now).count()
    not_expired = Q(expires_at__isnull=True) | Q(expires_at__gt=now)
    trash = sum(qs.filter(not_expired).count() for _, qs in _old_trash_by_tenant(now))
    return {"expired": expired, "trash": trash}
