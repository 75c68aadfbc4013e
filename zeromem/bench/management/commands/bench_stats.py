"""What the ``search-stats`` schedule costs: one tenant's term recount, and the staleness check.

    python manage.py bench_stats [--size 100000] [--writes 0,100,1000,10000] [--tenants 10000]
                                 [--forget-history 200000] [--before] [--json]

A tenant ``bench-search-<size>`` holds ``--size`` memories of bench_search's synthetic text
(built as that command builds it, reused when it is there). For each figure of ``--writes``,
that many of its memories get new text (the search columns as a write makes them, a newer
``updated_at``), then the tenant is recounted (``stats_refresh``): its time, the rows of
``SearchTerm`` inserted, updated and deleted, and the WAL written — with ``pg_walinspect``
(created when the role may), the records of ``memories_searchterm`` and its index in this
database; else the cluster's WAL, every session's. Then whether the schedule would pick the
tenant after that many writes (``stale_tenant_ids``).

``--tenants``: that many more small tenants (one memory each, counted) are made, one of them
with ``--forget-history`` completed forget requests (kept with their receipts), and
``stale_tenant_ids()`` — run every 10 minutes over every tenant — is timed with none due and
with one in a hundred due. ``--before``: the recount and the staleness check as they were
(every term row deleted and inserted again; every memory and completed forget request of each
tenant read), to compare in one sitting (run ``migrate memories 0035`` first for the forget
requests as they were read). Use a database of its own: the tenants stay there.
"""

from __future__ import annotations

import random
import statistics
import time

from django.db import connection, transaction

from memories.models import Memory, SearchTerm, Tenant
from memories.search import index as search_index
from zeromem.bench.management.commands import bench_search
from zeromem.bench.options import BenchCommand
from zeromem.bench.pgwatch import table_wal_bytes, walinspect_available


class Command(BenchCommand):
    help = "Cost of the search-stats schedule: one tenant's term recount (time, rows, WAL), the staleness check."
    shared_options = ("json", "seed")
    postgresql_needed = "bench_stats measures PostgreSQL: run it with DATABASE_URL set to a database of its own"

    def add_bench_arguments(self, parser):
        parser.add_argument("--size", type=int, default=100_000, help="memories of the recounted tenant (%(default)s)")
        parser.add_argument("--writes", default="0,100,1000,10000", help="memories rewritten before each recount")
        parser.add_argument("--repeat", type=int, default=1, help="recounts per --writes figure (%(default)s)")
        parser.add_argument("--tenants", type=int, default=0, help="small tenants for the staleness check (0: none)")
        parser.add_argument(
            "--forget-history",
            type=int,
            default=0,
            help="completed forget requests kept by one of the small tenants (%(default)s)",
        )
        parser.add_argument(
            "--before",
            action="store_true",
            help="the code as it was, to compare: the recount deleting and inserting every term row of the "
            "tenant, the staleness check reading every memory and completed forget request of each tenant",
        )

    def handle(self, *args, size, writes, repeat, tenants, forget_history, before, seed, **options):
        self.require_postgresql()
        self.before = before
        rng = random.Random(seed)
        self.walinspect = walinspect_available()
        loader = bench_search.Command(stdout=self.stderr if self.json_output else self.stdout)
        loader.json_output = self.json_output
        loader.real_vectors = None
        loader.vocab = bench_search._vocabulary(rng)
        tenant, _key = loader._tenant(f"bench-search-{size}", size, False, rng)
        with connection.cursor() as c:
            c.execute("ANALYZE memories_memory")
        search_index.stats_refresh(tenant_id=tenant.pk)
        ids = list(Memory.objects.filter(tenant=tenant, deleted_at__isnull=True).values_list("pk", flat=True))
        words = loader.vocab[0]
        result = {"size": size, "before": before, "walinspect": self.walinspect}
        result.update(recounts=[], staleness=None)
        for k in [int(w) for w in writes.split(",") if w.strip()]:
            for _ in range(repeat):
                self._rewrite(tenant.pk, rng.sample(ids, min(k, len(ids))), words, rng)
                # As it was, any write made the tenant due.
                due = k > 0 if self.before else tenant.pk in search_index.stale_tenant_ids()
                row = {"writes": k, "due": due, **self._recount(tenant.pk)}
                self.log(f"  {k} writes: {row}")
                result["recounts"].append(row)
        if tenants:
            result["staleness"] = self._staleness(tenants, forget_history)
        self.emit(result)

    def _rewrite(self, tenant_id: int, pks: list[int], words: list[str], rng: random.Random) -> None:
        """New text for these memories, as a write stores it (search columns, updated_at)."""
        with transaction.atomic():
            for pk in pks:
                value = " ".join(rng.choices(words[:5000], k=rng.randint(5, 40)))
                fields = search_index.index_fields(tenant_id=tenant_id, key=f"note:{pk}", value=value, tags=[])
                Memory.objects.filter(pk=pk).update(value=value, updated_at=search_index.timezone.now(), **fields)

    def _recount(self, tenant_id: int) -> dict:
        before_rows = self._tuples()
        with connection.cursor() as c:
            c.execute("SELECT pg_current_wal_lsn()")
            before = c.fetchone()[0]
        started = time.perf_counter()
        terms = (_full_rewrite if self.before else search_index.stats_refresh)(tenant_id=tenant_id)
        seconds = time.perf_counter() - started
        with connection.cursor() as c:
            c.execute("SELECT pg_current_wal_flush_lsn()")  # pg_walinspect reads up to there
            after = c.fetchone()[0]
        rows = {k: v - before_rows[k] for k, v in self._tuples().items()}
        wal, own = table_wal_bytes(before, after, SearchTerm._meta.db_table, walinspect=self.walinspect)
        return {"seconds": round(seconds, 2), "terms": terms, **rows, "wal_mb": round(wal / 1e6, 2), "wal_own": own}

    def _tuples(self) -> dict:
        """SearchTerm rows inserted, updated and deleted so far (this backend's counts flushed)."""
        with connection.cursor() as c:
            c.execute("SELECT pg_stat_force_next_flush()")
        with connection.cursor() as c:
            c.execute("SELECT pg_stat_clear_snapshot()")
            c.execute(
                "SELECT n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables WHERE relname = %s",
                [SearchTerm._meta.db_table],
            )
            ins, upd, dele = c.fetchone()
        return {"inserted": ins, "updated": upd, "deleted": dele}

    def _staleness(self, n: int, history: int) -> dict:
        have = Tenant.objects.filter(slug__startswith="bench-stats-small-").count()
        if have < n:
            self.log(f"making {n - have} small tenants")
            with connection.cursor() as c:
                c.execute(
                    """INSERT INTO memories_tenant (slug, name, created_at, sensitive_keys, sensitive_fields)
                       SELECT 'bench-stats-small-' || g, 'bench_stats', now(), '[]', '[]'
                       FROM generate_series(%s, %s) g""",
                    [have, n - 1],
                )
                c.execute(
                    """INSERT INTO memories_memory (tenant_id, key, namespace, value, search_text, category, subject,
                         tags, importance, source, version, created_at, updated_at, access_count, sources, sensitive)
                       SELECT t.id, 'note:a', 'note', '"pelican"', '', 'note', '', '[]', 0, 'bench', 1,
                              now(), now(), 0, '[]', false
                       FROM memories_tenant t WHERE t.slug LIKE 'bench-stats-small-%%'
                         AND NOT EXISTS (SELECT 1 FROM memories_memory m WHERE m.tenant_id = t.id)"""
                )
        with connection.cursor() as c:
            c.execute(
                """SELECT count(*) FROM memories_forgetrequest f JOIN memories_tenant t ON t.id = f.tenant_id
                   WHERE t.slug = 'bench-stats-small-0'"""
            )
            kept = c.fetchone()[0]
            if kept < history:
                self.log(f"filing {history - kept} completed forget requests of bench-stats-small-0")
                c.execute(
                    """INSERT INTO memories_forgetrequest (status, subject, prefix, keys, reason, requested_by_kind,
                         requested_by, created_at, due_at, completed_at, attempts, receipt, error, tenant_id,
                         progress_at, reach, stalled_attempts, stepping)
                       SELECT 'completed', 'u' || g, '', '[]', '', 'api_key', '', now() - interval '2 days',
                              now() - interval '1 day', now() - interval '1 day' + g * interval '1 ms', 1, '{}', '',
                              t.id, now(), '{}', 0, false
                       FROM memories_tenant t, generate_series(1, %s) g WHERE t.slug = 'bench-stats-small-0'""",
                    [history - kept],
                )
            c.execute("ANALYZE")
        search_index.stats_refresh_stale()
        timings = {}
        for label in ("none due", "1% due"):
            if label == "1% due":
                with connection.cursor() as c:
                    c.execute(
                        """UPDATE memories_memory SET updated_at = now() WHERE tenant_id IN (
                             SELECT id FROM memories_tenant WHERE slug LIKE 'bench-stats-small-%%'
                             ORDER BY id LIMIT %s)""",
                        [max(1, n // 100)],
                    )
            samples = []
            check = _stale_tenant_ids_before if self.before else search_index.stale_tenant_ids
            while len(samples) < 5 and sum(samples) < 10_000:
                started = time.perf_counter()
                due = check()
                samples.append((time.perf_counter() - started) * 1000)
            timings[label] = {"due": len(due), "ms_median": round(statistics.median(samples), 1)}
        search_index.stats_refresh_stale()
        with connection.cursor() as c:
            c.execute("SELECT max(n) FROM (SELECT count(*) AS n FROM memories_forgetrequest GROUP BY tenant_id) f")
            most = c.fetchone()[0] or 0
        return {"tenants": Tenant.objects.count(), "most_forget_requests": most, **timings}

    def print_table(self, result: dict) -> None:
        wal = "SearchTerm's WAL" if result["walinspect"] else "cluster WAL"
        how = "the code as it was (--before)" if result["before"] else "the code as it is"
        self.stdout.write(f"\nZeroMem bench_stats — one tenant of {result['size']} memories, recounted: {how}\n")
        self.stdout.write(
            f"  {'writes':>7} {'due':>4} {'s':>7} {'terms':>8} {'inserted':>9} {'updated':>8} {'deleted':>8} {wal:>17}"
        )
        for r in result["recounts"]:
            self.stdout.write(
                f"  {r['writes']:>7} {'yes' if r['due'] else 'no':>4} {r['seconds']:>7} {r['terms']:>8}"
                f" {r['inserted']:>9} {r['updated']:>8} {r['deleted']:>8} {r['wal_mb']:>14} MB"
                + ("" if r["wal_own"] else " (cluster's)")
            )
        s = result["staleness"]
        if s:
            self.stdout.write(
                f"\n  stale_tenant_ids() over {s['tenants']} tenants"
                f" (at most {s['most_forget_requests']} forget requests in one):"
            )
            for label in ("none due", "1% due"):
                self.stdout.write(f"    {label:<9} {s[label]['ms_median']:>8} ms ({s[label]['due']} due)")


def _full_rewrite(*, tenant_id: int) -> int:
    """The recount as it was before it wrote only what changed: every term row of the tenant
    deleted, then all inserted from the count (the corpus row as stats_refresh leaves it)."""
    from memories.models import SearchCorpus

    prefix = f"{int(tenant_id)}:"
    inner = f"SELECT search_tsv FROM memories_memory WHERE tenant_id = {int(tenant_id)} AND deleted_at IS NULL"  # nosec B608
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL statement_timeout = 0")
        started = search_index.timezone.now()
        SearchTerm.objects.filter(tenant_id=tenant_id).delete()
        cursor.execute(
            """INSERT INTO memories_searchterm (tenant_id, term, ndoc)
               SELECT %s, substr(word, %s), ndoc FROM ts_stat(%s)
               WHERE left(word, %s) = %s AND length(word) - %s <= 255""",
            [tenant_id, len(prefix) + 1, inner, len(prefix), prefix, len(prefix)],
        )
        terms = cursor.rowcount
        cursor.execute("SELECT count(*) FROM memories_memory WHERE tenant_id = %s AND deleted_at IS NULL", [tenant_id])
        SearchCorpus.objects.filter(tenant_id=tenant_id).update(documents=cursor.fetchone()[0], refreshed_at=started)
    return terms


def _stale_tenant_ids_before() -> list[int]:
    """The staleness check as it was: "written since" under an OR with "never counted", off the
    (tenant, updated_at) index, so every memory of every counted tenant was read."""
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
