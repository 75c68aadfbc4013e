"""Keeping the search index: what a write stores, the backfill, the term statistics.

* Every write stores ``search_text`` (both backends; SQLite's FTS5 table follows it through
  triggers) and, on PostgreSQL, ``search_tsv`` (the weighted tsvector under the GIN index):
  :func:`index_fields`.
* :func:`reindex` rewrites both for existing rows in batches of ``batch`` rows, each batch
  its own short transaction (keyset by id, row locks on that batch only): the backfill of
  migration 0010 and ``manage.py search_reindex``.
* :func:`stats_refresh` recounts a tenant's term document frequencies (PostgreSQL
  ``ts_stat`` over the tenant's live rows, about 2 minutes per million memories on this
  project's 2-core test machine) into ``SearchTerm``/``SearchCorpus``; the ``search-stats``
  schedule runs it for tenants whose memories changed, were trashed or were erased (a
  forget, a TTL purge batch: ``SearchErasure``) since their last refresh.
"""

from __future__ import annotations

from django.db import connection, transaction
from django.utils import timezone

from memories.search.text import index_document

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


def stats_refresh(*, tenant_id: int) -> int:
    """Recount one tenant's term document frequencies from its live indexed rows (PostgreSQL;
    a no-op on SQLite, whose FTS5 index counts them itself). One transaction: searches keep
    the old counts until it commits. Returns the number of distinct terms."""
    from memories.models import SearchCorpus, SearchTerm

    if connection.vendor != "postgresql":
        return 0
    prefix = f"{int(tenant_id)}:"
    inner = f"SELECT search_tsv FROM memories_memory WHERE tenant_id = {int(tenant_id)} AND deleted_at IS NULL"  # nosec B608
    with transaction.atomic(), connection.cursor() as cursor:
        # The refresh of a big tenant runs for minutes; the request-path timeout must not apply.
        cursor.execute("SET LOCAL statement_timeout = 0")
        # Stamped with when the count began, not when it ended: a write or a completed forget
        # committed while it ran is not in its snapshot and must leave the tenant due for the
        # next count (stale_tenant_ids), or an erased memory's words stay here for good.
        started = timezone.now()
        # Read before the count's snapshot (each statement here takes its own): a purge batch
        # that commits after this read, seen by the count or not, leaves the counter past it.
        cursor.execute("SELECT batches FROM memories_searcherasure WHERE tenant_id = %s", [tenant_id])
        row = cursor.fetchone()
        erasures = row[0] if row else 0
        SearchTerm.objects.filter(tenant_id=tenant_id).delete()
        cursor.execute(
            """INSERT INTO memories_searchterm (tenant_id, term, ndoc)
               SELECT %s, substr(word, %s), ndoc FROM ts_stat(%s)
               WHERE left(word, %s) = %s AND length(word) - %s <= 255""",
            [tenant_id, len(prefix) + 1, inner, len(prefix), prefix, len(prefix)],
        )
        terms = cursor.rowcount
        cursor.execute("SELECT count(*) FROM memories_memory WHERE tenant_id = %s AND deleted_at IS NULL", [tenant_id])
        documents = cursor.fetchone()[0]
        SearchCorpus.objects.update_or_create(
            tenant_id=tenant_id,
            defaults={"documents": documents, "refreshed_at": started, "erasures_counted": erasures},
        )
    return terms


def stale_tenant_ids() -> list[int]:
    """Tenants with memories changed since their statistics were last refreshed (or never),
    or, once counted, with memories erased or trashed since: a forget request carried out,
    a TTL purge batch (``SearchErasure``), a memory trashed. The erased memories' terms must
    leave ``SearchTerm`` too, not only their counts, and a trashed memory no longer counts.
    The trash is found on the partial index memory_trash (tenant, deleted_at)."""
    if connection.vendor != "postgresql":
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT t.id FROM memories_tenant t
               LEFT JOIN memories_searchcorpus c ON c.tenant_id = t.id
               LEFT JOIN memories_searcherasure e ON e.tenant_id = t.id
               WHERE EXISTS (SELECT 1 FROM memories_memory m
                             WHERE m.tenant_id = t.id AND m.deleted_at IS NULL
                               AND (c.refreshed_at IS NULL OR m.updated_at > c.refreshed_at))
                  OR (c.refreshed_at IS NOT NULL AND (
                        e.batches > c.erasures_counted
                        OR EXISTS (SELECT 1 FROM memories_memory m
                                   WHERE m.tenant_id = t.id AND m.deleted_at > c.refreshed_at)
                        OR EXISTS (SELECT 1 FROM memories_forgetrequest f
                                   WHERE f.tenant_id = t.id AND f.completed_at > c.refreshed_at)))"""
        )
        return [row[0] for row in cursor.fetchall()]


def stats_refresh_stale() -> dict[int, int]:
    """The ``search-stats`` schedule: recount every tenant whose memories changed since its
    last count. Returns {tenant id: distinct terms}."""
    return {tenant_id: stats_refresh(tenant_id=tenant_id) for tenant_id in stale_tenant_ids()}
