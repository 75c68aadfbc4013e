"""Keeping the search index: what a write stores, the backfill, the term statistics.

* Every write stores ``search_text`` (both backends; SQLite's FTS5 table follows it through
  triggers) and, on PostgreSQL, ``search_tsv`` (the weighted tsvector under the GIN index):
  :func:`index_fields`.
* :func:`reindex` rewrites both for existing rows in batches of ``batch`` rows, each batch
  its own short transaction (keyset by id, row locks on that batch only): the backfill of
  migration 0010 and ``manage.py search_reindex``.
* :func:`stats_refresh` recounts a tenant's term document frequencies (PostgreSQL
  ``ts_stat`` over the tenant's live rows, about 15 s per million memories of bench_stats'
  text on this project's 2-core test machine) into ``SearchTerm``/``SearchCorpus``, writing
  only the rows that changed; the ``search-stats`` schedule runs it for tenants whose
  memories were trashed or erased (a forget, a TTL purge batch: ``SearchErasure``) since
  their last refresh, or written, as many as 1% of them or an hour after the count.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import connection, transaction
from django.utils import timezone

from memories.search.text import index_document
from zeromem.kernel.pglocks import int4_key

REINDEX_BATCH = 1000


def index_fields(*, tenant_id: int, key: str, value, tags: list[str] | None) -> dict:
    """The search columns of a memory, ready for ``create``/``update``."""
    doc = index_document(key=key, value=value, tags=tags)
    fields = {"search_text": doc.search_text(tenant_id)}
    if connection.vendor == "postgresql":
        fields["search_tsv"] = doc.tsvector(tenant_id)
    return fields


def reindex(*, memory_model, tenant_id: int | None = None, batch: int = REINDEX_BATCH, after_id: int = 0) -> int:
    """Recompute the search columns of every memory (of one tenant, or all), trashed ones
    too, ``batch`` rows per transaction. Returns the number of rows rewritten. Takes the
    model as an argument so a migration can pass its historical one."""
    done = 0
    while True:
        qs = memory_model.objects.filter(pk__gt=after_id).order_by("pk")
        if tenant_id is not None:
            qs = qs.filter(tenant_id=tenant_id)
        # A sensitive value is not indexed (README "Encryption at rest"); migration 0010's
        # historical model has no such field.
        has_sensitive = any(f.name == "sensitive" for f in memory_model._meta.get_fields())
        secret = "sensitive" if has_sensitive else "pk"
        rows = list(qs.values_list("pk", "tenant_id", "key", "value", "tags", secret)[:batch])
        if not rows:
            return done
        with transaction.atomic():
            for pk, tid, key, value, tags, sensitive in rows:
                if has_sensitive and sensitive:
                    value = None
                memory_model.objects.filter(pk=pk).update(
                    **index_fields(tenant_id=tid, key=key, value=value, tags=tags if isinstance(tags, list) else [])
                )
        done += len(rows)
        after_id = rows[-1][0]


# A tenant whose only change since its count is writes (no erasure, no trash) is recounted once
# they reach this share of its counted memories, or once its count is this old: idf moves
# little with a few writes, and a word missing from the count already counts as rare.
STATS_CHANGE_SHARE = 100  # 1 in 100
STATS_MAX_AGE = timedelta(hours=1)
# pg_advisory_xact_lock namespace (with the tenant id): one tenant's counts take turns.
_STATS_LOCK_NAMESPACE = 0x5A53  # "ZS"


def stats_refresh(*, tenant_id: int) -> int:
    """Recount one tenant's term document frequencies from its live indexed rows (PostgreSQL;
    a no-op on SQLite, whose FTS5 index counts them itself). One transaction: searches keep
    the old counts until it commits. Only what changed is written: a term whose count moved
    is updated, a new one inserted, one no live memory holds any more deleted (before: every
    row deleted and inserted again, 200k rows and 43 MB of WAL at 100k memories for one
    write). Returns the number of distinct terms."""
    from memories.models import SearchCorpus

    if connection.vendor != "postgresql":
        return 0
    prefix = f"{int(tenant_id)}:"
    inner = f"SELECT search_tsv FROM memories_memory WHERE tenant_id = {int(tenant_id)} AND deleted_at IS NULL"  # nosec B608
    with transaction.atomic(), connection.cursor() as cursor:
        # The refresh of a big tenant runs for minutes; the request-path timeout must not apply.
        cursor.execute("SET LOCAL statement_timeout = 0")
        # Two counts of one tenant (the schedule, search_reindex) would insert the same new terms.
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [_STATS_LOCK_NAMESPACE, int4_key(tenant_id)])
        # Stamped with when the count began, not when it ended: a write or a completed forget
        # committed while it ran is not in its snapshot and must leave the tenant due for the
        # next count (stale_tenant_ids), or an erased memory's words stay here for good.
        started = timezone.now()
        # Read before the count's snapshot (each statement here takes its own): a purge batch
        # that commits after this read, seen by the count or not, leaves the counter past it.
        cursor.execute("SELECT batches FROM memories_searcherasure WHERE tenant_id = %s", [tenant_id])
        row = cursor.fetchone()
        erasures = row[0] if row else 0
        # One statement, one snapshot: the sub-statements touch disjoint rows (a counted term
        # is updated or inserted, an uncounted one deleted), and the INSERT's NOT EXISTS sees
        # the rows as they were before it.
        cursor.execute(
            """WITH counted AS MATERIALIZED (
                   SELECT substr(word, %(from)s) AS term, ndoc FROM ts_stat(%(inner)s)
                   WHERE left(word, %(plen)s) = %(prefix)s AND length(word) - %(plen)s <= 255),
               gone AS (
                   DELETE FROM memories_searchterm s WHERE s.tenant_id = %(tenant)s
                   AND NOT EXISTS (SELECT 1 FROM counted n WHERE n.term = s.term) RETURNING 1),
               moved AS (
                   UPDATE memories_searchterm s SET ndoc = n.ndoc FROM counted n
                   WHERE s.tenant_id = %(tenant)s AND s.term = n.term AND s.ndoc <> n.ndoc RETURNING 1),
               added AS (
                   INSERT INTO memories_searchterm (tenant_id, term, ndoc)
                   SELECT %(tenant)s, n.term, n.ndoc FROM counted n
                   WHERE NOT EXISTS (SELECT 1 FROM memories_searchterm s
                                     WHERE s.tenant_id = %(tenant)s AND s.term = n.term) RETURNING 1)
               SELECT (SELECT count(*) FROM counted), (SELECT count(*) FROM gone),
                      (SELECT count(*) FROM moved), (SELECT count(*) FROM added)""",
            {"from": len(prefix) + 1, "inner": inner, "plen": len(prefix), "prefix": prefix, "tenant": tenant_id},
        )
        terms = cursor.fetchone()[0]
        cursor.execute("SELECT count(*) FROM memories_memory WHERE tenant_id = %s AND deleted_at IS NULL", [tenant_id])
        documents = cursor.fetchone()[0]
        SearchCorpus.objects.update_or_create(
            tenant_id=tenant_id,
            defaults={"documents": documents, "refreshed_at": started, "erasures_counted": erasures},
        )
    return terms


def stale_tenant_ids() -> list[int]:
    """Tenants due for a count: with live memories and never counted; or, once counted, with
    memories erased or trashed since — a forget request carried out, a TTL purge batch
    (``SearchErasure``), a memory trashed: the erased memories' terms must leave
    ``SearchTerm`` too, not only their counts, and a trashed memory no longer counts — or with
    memories written since, as many as one in ``STATS_CHANGE_SHARE`` of those counted, or any
    once the count is ``STATS_MAX_AGE`` old. It runs over every tenant every 10 minutes, so
    it reads no tenant's history: the writes are counted up to that share on
    memory_tenant_updated (tenant, updated_at, id); the latest trashed memory and the latest
    completed forget request are one entry each of the partial indexes memory_trash (tenant,
    deleted_at) and forget_tenant_completed (tenant, completed_at) — as max(), which PostgreSQL
    reads from the end of an index, not as EXISTS, for which it may scan the table expecting
    an early match (2,000 tenants, one with 200k completed requests: 32 s a run)."""
    if connection.vendor != "postgresql":
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT t.id FROM memories_tenant t
               LEFT JOIN memories_searchcorpus c ON c.tenant_id = t.id
               LEFT JOIN memories_searcherasure e ON e.tenant_id = t.id
               WHERE (c.refreshed_at IS NULL
                      AND EXISTS (SELECT 1 FROM memories_memory m WHERE m.tenant_id = t.id AND m.deleted_at IS NULL))
                  OR (c.refreshed_at IS NOT NULL AND (
                        e.batches > c.erasures_counted
                        OR (SELECT max(m.deleted_at) FROM memories_memory m WHERE m.tenant_id = t.id)
                           > c.refreshed_at
                        OR (SELECT max(f.completed_at) FROM memories_forgetrequest f WHERE f.tenant_id = t.id)
                           > c.refreshed_at
                        OR (c.refreshed_at < %(old)s
                            AND EXISTS (SELECT 1 FROM memories_memory m
                                        WHERE m.tenant_id = t.id AND m.deleted_at IS NULL
                                          AND m.updated_at > c.refreshed_at))
                        OR (SELECT count(*) FROM (
                                SELECT 1 FROM memories_memory m
                                WHERE m.tenant_id = t.id AND m.deleted_at IS NULL AND m.updated_at > c.refreshed_at
                                LIMIT greatest(c.documents / %(share)s, 1)) w)
                           >= greatest(c.documents / %(share)s, 1)))""",
            {"old": timezone.now() - STATS_MAX_AGE, "share": STATS_CHANGE_SHARE},
        )
        return [row[0] for row in cursor.fetchall()]


def stats_refresh_stale() -> dict[int, int]:
    """The ``search-stats`` schedule: recount every tenant due (:func:`stale_tenant_ids`).
    Returns {tenant id: distinct terms}."""
    return {tenant_id: stats_refresh(tenant_id=tenant_id) for tenant_id in stale_tenant_ids()}
