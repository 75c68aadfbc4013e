"""``python manage.py bench_fold``: what counting reads into memories costs the database —
the ``zeromem:access-counts`` job (memories/services/access.py), one UPDATE of
``access_count``/``last_accessed_at`` per memory read since its last run — on pages filled to
100% and to ``memories_memory``'s fillfactor (80, memories migration 0031), side by side in
one run (PostgreSQL)::

    DATABASE_URL=postgres://... ZEROMEM_ENV=development python manage.py bench_fold

Two throw-away tenants get ``--memories`` memories each, values of ``--words`` words (their
``search_tsv`` as many lexemes, as a write makes them): tenant "full" while the table's
fillfactor is set to 100 for the run, tenant "spaced" at the fillfactor the table is left with.
Each round, ``--reads`` of each tenant's memories, picked at random, are read once (their
``memory.read`` audit events inserted in bulk and sealed, as the sealing job does), then each
tenant's reads are folded in by the job's own code, timed apart. An UPDATE that changes no
indexed column and finds room on the row's page is HOT: PostgreSQL writes no index entry —
otherwise every index of the table gets one, the GIN of ``search_tsv`` one per lexeme.

Printed per tenant and round: fold time per memory, HOT updates (of the fold's, from
``pg_stat_xact_user_tables``) and the WAL the fold wrote to ``memories_memory`` and its
indexes after a ``CHECKPOINT`` (every page it touched then written whole once, as after any
checkpoint: the figure counts pages touched), with ``pg_walinspect`` (created when the role
may); else the cluster's WAL, every session's — run it on a quiet machine then. The tenants'
rows stay in the table (the purge erases them: they expire in a day).
"""

from __future__ import annotations

import random
import secrets
import statistics
import time

from django.db import connection, transaction

from audit.services import audit_seal
from memories import services
from memories.models import Memory
from memories.services import access
from zeromem.bench.options import BenchCommand
from zeromem.bench.pgwatch import table_wal_bytes, walinspect_available
from zeromem.kernel.actors import Actor

SYSTEM = Actor.system(job="bench_fold")


class Command(BenchCommand):
    help = "Cost of folding reads into access counts, pages filled to 100% vs the table's fillfactor (PostgreSQL)."
    shared_options = ("json", "seed")
    postgresql_needed = "bench_fold measures PostgreSQL's HOT updates: set DATABASE_URL to a PostgreSQL database."

    def add_bench_arguments(self, parser):
        parser.add_argument("--memories", type=int, default=10000, help="memories per tenant (%(default)s)")
        parser.add_argument("--words", type=int, default=40, help="words per value (%(default)s)")
        parser.add_argument("--reads", type=int, default=2000, help="memories read per tenant and round (%(default)s)")
        parser.add_argument("--rounds", type=int, default=3, help="rounds of reads and folds (%(default)s)")

    def handle(self, *args, **options):
        self.require_postgresql()
        rnd = random.Random(options["seed"])
        self.walinspect = walinspect_available()
        table = Memory._meta.db_table
        fillfactor = self._fillfactor(table)
        suffix = secrets.token_hex(4)
        tenants = {}
        try:
            for label, ff in (("full", 100), ("spaced", fillfactor)):
                with connection.cursor() as cursor:
                    cursor.execute(f"ALTER TABLE {table} SET (fillfactor = {ff})")  # nosec B608: integers
                tenant = services.tenant_create(actor=SYSTEM, slug=f"fold-{label}-{suffix}", name="bench_fold")
                self.log(f"seeding {options['memories']} memories of tenant {tenant.slug} (fillfactor {ff})")
                self._seed(tenant.pk, options["memories"], options["words"], rnd)
                tenants[label] = (tenant, ff)
        finally:
            with connection.cursor() as cursor:  # the migration's setting again
                cursor.execute(f"ALTER TABLE {table} SET (fillfactor = {fillfactor})")  # nosec B608: an integer
        rows = []
        for round_no in range(1, options["rounds"] + 1):
            for label, (tenant, ff) in tenants.items():
                self._read(tenant, options["memories"], options["reads"], rnd)
                rows.append({"round": round_no, "pages": label, "fillfactor": ff, **self._fold(tenant.pk)})
        summary = {}
        for label, (_, ff) in tenants.items():
            mine = [r for r in rows if r["pages"] == label]
            summary[label] = {
                "fillfactor": ff,
                "fold_ms_per_memory_median": round(statistics.median(r["ms_per_memory"] for r in mine), 3),
                "hot_share_median": round(statistics.median(r["hot"] / max(r["updates"], 1) for r in mine), 3),
                "wal_bytes_per_memory_median": round(statistics.median(r["wal_bytes_per_memory"] for r in mine)),
            }
        self.emit(
            {
                "wal_of": "memories_memory and its indexes" if self.walinspect else "the cluster (every session)",
                "options": {k: options[k] for k in ("memories", "words", "reads", "rounds")},
                "rounds": rows,
                "summary": summary,
            }
        )

    @staticmethod
    def _fillfactor(table: str) -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT reloptions FROM pg_class WHERE relname = %s", [table])
            options = cursor.fetchone()[0] or []
        for option in options:
            if option.startswith("fillfactor="):
                return int(option.split("=", 1)[1])
        return 100

    @staticmethod
    def _seed(tenant_id: int, n: int, words: int, rnd: random.Random) -> None:
        """``n`` memories, each a value of ``words`` random words and the matching tsvector
        (tenant-prefixed lexemes, as memories/search/lexical.py writes them); a TTL of a day."""
        vocabulary = [f"w{i}" for i in range(20000)]
        with connection.cursor() as cursor:
            for start in range(0, n, 1000):
                texts = [" ".join(rnd.choice(vocabulary) for _ in range(words)) for _ in range(min(1000, n - start))]
                cursor.execute(
                    """INSERT INTO memories_memory (tenant_id, key, namespace, value, search_text, search_tsv,
                           category, subject, tags, importance, source, version, created_at, updated_at,
                           expires_at, access_count, sources, sensitive)
                       SELECT %s, 'fact:f' || (%s + i) || ':note', 'fact:f' || (%s + i), to_jsonb(t),
                           t, to_tsvector('simple', regexp_replace(t, '(\\S+)', %s || ':\\1', 'g')),
                           'fact', '', '[]', 5, '', 1, now(), now(), now() + interval '1 day', 0, '[]', false
                       FROM unnest(%s::text[]) WITH ORDINALITY AS u(t, i)""",
                    [tenant_id, start, start, str(tenant_id), texts],
                )
            cursor.execute("ANALYZE memories_memory")

    @staticmethod
    def _read(tenant, n: int, reads: int, rnd: random.Random) -> None:
        """``reads`` distinct memories read once each: their audit events, sealed."""
        picked = rnd.sample(range(1, n + 1), min(reads, n))
        with connection.cursor() as cursor:
            cursor.execute(
                """INSERT INTO audit_auditevent (uid, tenant_id, occurred_at, actor_kind, actor_id, actor_label,
                       surface, action, target, subject, outcome, request_id, detail, digest, chain, redacted)
                   SELECT gen_random_uuid(), %s, now(), 'api_key', '1', 'zm_bench', 'tool', 'memory.read',
                       'fact:f' || i || ':note', '', 'ok', '', '{}', md5(i::text) || md5(i::text), '', '{}'
                   FROM unnest(%s::int[]) AS u(i)""",
                [tenant.pk, picked],
            )
        audit_seal(tenant_id=tenant.pk)

    def _fold(self, tenant_id: int) -> dict:
        with connection.cursor() as cursor:
            if self.walinspect:
                # Each fold then writes every page it touches in full once, as the first
                # change after a checkpoint does: the WAL compares the pages touched.
                cursor.execute("CHECKPOINT")
            cursor.execute("SELECT pg_current_wal_flush_lsn()")
            before = cursor.fetchone()[0]
        # pg_stat_xact_user_tables: this transaction's counts, plus those of the backend's
        # earlier transactions not yet flushed to the shared statistics — hence before/after.
        stats_sql = "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = %s"
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(stats_sql, [Memory._meta.db_table])
                updates_before, hot_before = cursor.fetchone()
            start = time.perf_counter()
            counted = access._fold_tenant(tenant_id)
            seconds = time.perf_counter() - start
            with connection.cursor() as cursor:
                cursor.execute(stats_sql, [Memory._meta.db_table])
                updates, hot = cursor.fetchone()
            updates, hot = updates - updates_before, hot - hot_before
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_flush_lsn()")
            after = cursor.fetchone()[0]
        return {
            "memories": counted,
            "ms_per_memory": round(seconds * 1000 / max(counted, 1), 3),
            "updates": updates,
            "hot": hot,
            "wal_bytes_per_memory": round(
                table_wal_bytes(before, after, Memory._meta.db_table, walinspect=self.walinspect)[0] / max(counted, 1)
            ),
        }

    def print_table(self, result: dict) -> None:
        o = result["options"]
        self.stdout.write(
            f"\nZeroMem bench_fold — {o['memories']} memories per tenant, {o['words']} words a value, "
            f"{o['reads']} read per round, {o['rounds']} rounds\n"
        )
        self.stdout.write(f"  {'round':>5}  {'pages':<7} {'ff':>4} {'ms/memory':>10} {'HOT':>11} {'WAL B/memory':>13}")
        for r in result["rounds"]:
            self.stdout.write(
                f"  {r['round']:>5}  {r['pages']:<7} {r['fillfactor']:>4} {r['ms_per_memory']:>10.3f} "
                f"{r['hot']:>5}/{r['updates']:<5} {r['wal_bytes_per_memory']:>13}"
            )
        self.stdout.write(
            "  medians: "
            + "; ".join(
                f"{label} (ff {s['fillfactor']}): {s['fold_ms_per_memory_median']} ms/memory, "
                f"HOT {s['hot_share_median']:.0%}, {s['wal_bytes_per_memory_median']} B of WAL/memory"
                for label, s in result["summary"].items()
            )
        )
        self.stdout.write(f"  (WAL of {result['wal_of']}, written during each fold)")
