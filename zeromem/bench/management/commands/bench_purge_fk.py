"""``python manage.py bench_purge_fk``: what the foreign keys from version and embedding rows
to memories cost the TTL purge, one variant after another in ONE run (PostgreSQL,
throw-away database — the command ALTERs the two constraints and leaves them as the
migrations made them: none, memories 0015 and 0018)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/zm_purgebench ZEROMEM_ENV=development \\
        python manage.py bench_purge_fk

Variants (``memories_memoryversion.memory_id`` and ``memories_memoryembedding.memory_id``):

* ``deferred``: NO ACTION, DEFERRABLE INITIALLY DEFERRED for versions (Django's default) and
  ON DELETE CASCADE for embeddings; the purge deletes versions, embeddings and memories
  itself (one statement), and the commit checks each erased memory has no version left;
* ``immediate``: the same deletes, the check not deferred (end of the statement);
* ``cascade``: ON DELETE CASCADE for both; the purge deletes only the memories and the
  database deletes their versions and embeddings, row by row, through its RI triggers;
* ``versions-none``: no foreign key from versions (Django-side ``on_delete`` still cascades
  ORM deletes), the embeddings' database cascade kept; the purge's own deletes;
* ``none``: no foreign key from versions or embeddings; the purge's own deletes are all
  there is.

Each round seeds ``--rows`` expired memories with one version each (``generate_series``),
runs VACUUM ANALYZE and CHECKPOINT, then ``memories.services.purge_expired`` (for
``cascade`` with the memories-only statement). Rounds are interleaved across variants and
the median rate per variant is printed, with the CPU time per erased memory (the database
backend's and this process's, from /proc: steadier than wall time on a shared machine) and
the WAL each wrote.
"""

from __future__ import annotations

import secrets
import statistics
import time
from unittest import mock

from django.core.management.base import CommandError
from django.db import connection

from memories.models import Tenant
from memories.services import retention
from zeromem.bench.harness import proc_cpu_seconds
from zeromem.bench.options import BenchCommand

VERSIONS_FK = "memoryversion_memory_fk_bench"
EMBEDDINGS_FK = "memoryembedding_memory_cascade"
CASCADE_ERASE_SQL = """
WITH picked(id) AS MATERIALIZED ({picked}),
erased AS (
    DELETE FROM {memories} WHERE id = ANY(ARRAY(SELECT id FROM picked)) RETURNING tenant_id, id
)
SELECT 'memories', tenant_id, count(*) FROM erased GROUP BY tenant_id
"""
VARIANTS = {
    "deferred": ("DEFERRABLE INITIALLY DEFERRED", "ON DELETE CASCADE DEFERRABLE INITIALLY DEFERRED"),
    "immediate": ("", "ON DELETE CASCADE"),
    "cascade": ("ON DELETE CASCADE", "ON DELETE CASCADE"),
    "versions-none": (None, "ON DELETE CASCADE DEFERRABLE INITIALLY DEFERRED"),
    "none": (None, None),
}
# What the migrations leave (memories 0015 and 0018: neither has a database foreign key), put
# back after the run.
AS_MIGRATED = "none"


def _fk_names(cursor, table: str) -> list[str]:
    cursor.execute(
        "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'f' "
        "AND confrelid = 'memories_memory'::regclass",
        [table],
    )
    return [name for (name,) in cursor.fetchall()]


def set_variant(name: str) -> None:
    versions, embeddings = VARIANTS[name]
    with connection.cursor() as cursor:
        for table, spec in (("memories_memoryversion", versions), ("memories_memoryembedding", embeddings)):
            for fk in _fk_names(cursor, table):
                cursor.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{fk}"')  # nosec B608
            if spec is not None:
                fk = VERSIONS_FK if table == "memories_memoryversion" else EMBEDDINGS_FK
                cursor.execute(
                    f'ALTER TABLE {table} ADD CONSTRAINT "{fk}" FOREIGN KEY (memory_id) '
                    f"REFERENCES memories_memory (id) {spec}"
                )


class Command(BenchCommand):
    help = "The TTL purge's rate under each foreign-key variant of versions/embeddings → memories (PostgreSQL)."

    postgresql_needed = "bench_purge_fk needs PostgreSQL (set DATABASE_URL to a throw-away database)"

    def add_bench_arguments(self, parser):
        parser.add_argument("--rows", type=int, default=100_000, help="expired memories per round")
        parser.add_argument("--rounds", type=int, default=2, help="rounds per variant")
        parser.add_argument("--batch-size", type=int, default=retention.DEFAULT_BATCH_SIZE)
        parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))

    def handle(self, *args, rows, rounds, batch_size, variants, **options):
        self.require_postgresql()
        names = [v.strip() for v in variants.split(",") if v.strip()]
        if not names or any(v not in VARIANTS for v in names) or min(rows, rounds, batch_size) < 1:
            raise CommandError(f"--variants among {', '.join(VARIANTS)}; --rows, --rounds, --batch-size ≥ 1")
        tenant = Tenant.objects.create(slug=f"purgefk-{secrets.token_hex(4)}", name="purge fk bench")
        results: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
        try:
            for r in range(rounds):
                for name in names:
                    set_variant(name)
                    rate, wal, cpu = self._round(tenant, rows, batch_size, name, r)
                    results[name].append((rate, wal, cpu))
                    self.stdout.write(
                        f"round {r + 1} {name:10s} {rate:10,.0f} memories/s  {cpu:6.1f} µs CPU/memory  "
                        f"WAL {wal:6.1f} MiB"
                    )
        finally:
            set_variant(AS_MIGRATED)
        self.stdout.write("")
        self.stdout.write(
            f"{'variant':12s} {'median memories/s':>18s} {'CPU µs/memory':>14s} {'→ memories/s/core':>18s} "
            f"{'WAL MiB/round':>14s}"
        )
        for name, rs in results.items():
            rate = statistics.median(r for r, _, _ in rs)
            wal = statistics.median(w for _, w, _ in rs)
            cpu = statistics.median(c for _, _, c in rs)
            self.stdout.write(f"{name:12s} {rate:18,.0f} {cpu:14.1f} {1e6 / cpu:18,.0f} {wal:14.1f}")

    def _round(self, tenant, rows: int, batch_size: int, variant: str, r: int) -> tuple[float, float]:
        tag = f"fk{r}{variant}"
        with connection.cursor() as cursor:
            cursor.execute(
                """INSERT INTO memories_memory (tenant_id, key, namespace, value, search_text, category, subject,
                       tags, importance, source, version, created_at, updated_at, access_count, sources, expires_at,
                       sensitive)
                   SELECT %s, 'session:' || %s || ':k' || g, 'session:' || %s, '{"n": 1}', 'bench value',
                       'task', '', '[]', 5, '', 1, now(), now(), 0, '[]', now() - interval '1 hour', false
                   FROM generate_series(1, %s) g""",
                [tenant.pk, tag, tag, rows],
            )
            cursor.execute(
                """INSERT INTO memories_memoryversion (tenant_id, memory_id, version, value, op, actor_kind, actor_id,
                       created_at, sensitive, subject)
                   SELECT tenant_id, id, 1, value, 'write', 'system', '', now(), false, subject FROM memories_memory
                   WHERE tenant_id = %s AND namespace = %s""",
                [tenant.pk, f"session:{tag}"],
            )
            cursor.execute("VACUUM ANALYZE memories_memory")
            cursor.execute("VACUUM ANALYZE memories_memoryversion")
            cursor.execute("CHECKPOINT")
            cursor.execute("SELECT pg_current_wal_lsn() - '0/0'")
            wal_before = int(cursor.fetchone()[0])
            cursor.execute("SELECT pg_backend_pid()")
            (backend,) = cursor.fetchone()
        cpu_before = (proc_cpu_seconds(backend) or 0.0) + time.process_time()
        patch = mock.patch.object(retention, "_ERASE_SQL", CASCADE_ERASE_SQL) if variant == "cascade" else None
        started = time.perf_counter()
        if patch:
            with patch:
                result = retention.purge_expired(batch_size=batch_size)
        else:
            result = retention.purge_expired(batch_size=batch_size)
        seconds = time.perf_counter() - started
        cpu = (proc_cpu_seconds(backend) or 0.0) + time.process_time() - cpu_before
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_lsn() - '0/0'")
            wal = (int(cursor.fetchone()[0]) - wal_before) / 2**20
            cursor.execute("SELECT count(*) FROM memories_memoryversion WHERE tenant_id = %s", [tenant.pk])
            (left,) = cursor.fetchone()
        if left:
            raise CommandError(f"{variant}: {left} version rows left behind")
        erased = result["expired"] + result["trash"]
        if erased < rows:
            raise CommandError(f"{variant}: erased {erased} of {rows}")
        return erased / seconds, wal, cpu / erased * 1e6
