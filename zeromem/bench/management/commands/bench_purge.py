"""``python manage.py bench_purge``: TTL purge throughput, and what it does to reads.

PostgreSQL only (row locks, SKIP LOCKED and the cost of deleting are what is measured);
run it against a throw-away database, e.g.::

    createdb -h 127.0.0.1 -U postgres zeromem_purgebench
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/zeromem_purgebench \\
        ZEROMEM_ENV=development python manage.py migrate
    DATABASE_URL=... ZEROMEM_ENV=development python manage.py bench_purge

In ONE run, a new tenant (``purgebench-<random>``) gets ``--live`` live memories, and a
reader thread calls ``memories.services.memory_read`` (an audited read: SELECT,
access-counter UPDATE, audit INSERT, commit) on random live keys, one call after another.
Then, ``--rounds`` times:

1. ``--rows`` expired memories, each with one version row, are inserted (``generate_series``), then
   VACUUM ANALYZE and CHECKPOINT, so each round's purge meets the same settled table
   (and pays the full-page writes a purge after a checkpoint pays in production);
2. the reader's latencies are recorded for ``--baseline-seconds`` with no purge running;
3. ``memories.services.purge_expired`` runs (``--batch-size``; each ``--pause-ratios`` value in
   turn, default the ``ZEROMEM_PURGE_PAUSE_RATIO`` setting) while the reader keeps reading:
   its memories/s (pauses included), and the reads' latencies during it;
4. the reads again with no purge running, for ``--baseline-seconds`` (to show drift).

Each purge lasts only seconds, so a single round gives a few hundred reads "during": the
rounds pool them, for a p99 worth the name. Printed: throughput per round and, per pause
ratio, its median, read p50/p95/p99 with and without a purge side by side, and the DESIGN.md targets
(≥ 50,000 rows/s; read p99 rise ≤ 25%). Every phase is bounded in time. The purge also
erases any other expired rows in the database (that is its job), so use a database of its
own. The bench tenant's live memories and audit events stay.
"""

from __future__ import annotations

import math
import random
import secrets
import statistics
import threading
import time

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection
from django.utils import timezone

from memories import services
from memories.models import Memory, MemoryVersion
from memories.services import retention
from zeromem.bench.harness import nearest_rank
from zeromem.bench.options import BenchCommand
from zeromem.kernel.actors import Actor

TARGET_ROWS_PER_S = 50_000
TARGET_P99_RISE = 0.25
ACTOR = Actor.system(job="bench_purge")


def percentile(sorted_s: list[float], q: float) -> float:
    """Nearest-rank percentile of samples in seconds, in milliseconds."""
    return nearest_rank(sorted_s, q) * 1000


class Reader(threading.Thread):
    """Audited reads of random live keys, one after another, while a phase is set.

    ``record(phase)`` starts keeping latencies under that name; ``record(None)`` pauses the
    reads (while the next round is seeded). A read that straddles two phases is dropped."""

    def __init__(self, *, tenant, keys: list[str]):
        super().__init__(daemon=True)
        self.tenant = tenant
        self.keys = keys
        self.actor = ACTOR.with_surface("tool")
        self.samples: dict[str, list[float]] = {}
        self.phase: str | None = None
        self.errors = 0
        self.done = threading.Event()
        self.rng = random.Random(7)

    def record(self, phase: str | None) -> None:
        if phase is not None:
            self.samples.setdefault(phase, [])
        self.phase = phase

    def run(self) -> None:
        try:
            while not self.done.is_set():
                phase = self.phase
                if phase is None:
                    time.sleep(0.01)
                    continue
                key = self.rng.choice(self.keys)
                t0 = time.perf_counter()
                try:
                    ok = services.memory_read(tenant=self.tenant, actor=self.actor, key=key).status == "ok"
                except Exception:
                    ok = False
                elapsed = time.perf_counter() - t0
                if not ok:
                    self.errors += 1
                elif phase == self.phase:
                    self.samples[phase].append(elapsed)
        finally:
            connection.close()


class Command(BenchCommand):
    help = "Benchmark the TTL purge (rows/s) and concurrent read latency (PostgreSQL only)."

    shared_options = ("max_seconds",)
    option_defaults = {"max_seconds": 120.0}
    postgresql_needed = "bench_purge needs PostgreSQL (set DATABASE_URL to a throw-away database)"

    def add_bench_arguments(self, parser):
        parser.add_argument("--rows", type=int, default=100_000, help="expired memories per round (default 100000)")
        parser.add_argument("--live", type=int, default=5_000, help="live memories the reader reads (default 5000)")
        parser.add_argument("--rounds", type=int, default=3, help="seed + purge rounds (default 3)")
        parser.add_argument("--batch-size", type=int, default=retention.DEFAULT_BATCH_SIZE)
        parser.add_argument("--baseline-seconds", type=float, default=3.0, help="each no-purge read phase")
        parser.add_argument(
            "--pause-ratios",
            default=None,
            help="comma-separated purge pause ratios to compare in one run, each every round "
            "(default: the ZEROMEM_PURGE_PAUSE_RATIO setting alone)",
        )

    def handle(self, *args, rows, live, rounds, batch_size, baseline_seconds, max_seconds, pause_ratios, **options):
        self.require_postgresql()
        try:
            ratios = [float(r) for r in (pause_ratios or str(settings.ZEROMEM_PURGE_PAUSE_RATIO)).split(",")]
        except ValueError:
            raise CommandError("--pause-ratios: comma-separated numbers, e.g. 0,0.5,1") from None
        if any(r < 0 for r in ratios):
            raise CommandError("--pause-ratios must be at least 0")
        if min(rows, live, rounds, batch_size) < 1 or rounds > 20:
            raise CommandError("--rows, --live, --batch-size must be at least 1; --rounds 1 to 20")
        if not 0 < baseline_seconds <= 60:
            raise CommandError("--baseline-seconds must be in (0, 60]")

        pending = retention.purge_pending()
        if pending["expired"] or pending["trash"]:
            self.stderr.write(f"note: {pending} rows were already due; purging them first")
            retention.purge_expired()

        tenant = services.tenant_create(actor=ACTOR, slug=f"purgebench-{secrets.token_hex(4)}")
        live_keys = [f"user:u{i // 10}:k{i}" for i in range(live)]
        self._insert(tenant, live_keys, expires_at=None)
        self.stdout.write(f"tenant {tenant.slug}: {live:,} live memories; {rounds} rounds of {rows:,} expired")

        reader = Reader(tenant=tenant, keys=live_keys)
        reader.start()
        purges = []
        try:
            reader.record("warmup")
            time.sleep(1.0)
            for n in range(1, rounds + 1):
                for ratio in ratios:
                    reader.record(None)
                    purges.append(
                        self._round(n, tenant, reader, rows, batch_size, baseline_seconds, max_seconds, ratio)
                    )
        finally:
            reader.done.set()
            reader.join(timeout=30)
        left = Memory.objects.filter(tenant=tenant, expires_at__lte=timezone.now()).count()
        self._report(batch_size=batch_size, purges=purges, reader=reader, left=left)

    def _round(self, n, tenant, reader, rows, batch_size, baseline_seconds, max_seconds, ratio) -> dict:
        t0 = time.perf_counter()
        self._seed_expired(tenant, f"r{n}p{ratio}", rows)
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE memories_memory")
            cursor.execute("VACUUM ANALYZE memories_memoryversion")
            cursor.execute("CHECKPOINT")
        seeded = time.perf_counter() - t0

        reader.record("before")
        time.sleep(baseline_seconds)
        reader.record(f"during@{ratio}")
        deadline = time.monotonic() + max_seconds

        def stop_when_late(_done: int) -> None:
            if time.monotonic() > deadline:
                raise CommandError(f"a purge took longer than --max-seconds={max_seconds}")

        wal_before = self._wal_lsn()
        started = time.perf_counter()
        result = retention.purge_expired(
            batch_size=batch_size,
            max_batches=math.ceil(rows / batch_size) + 10,
            progress=stop_when_late,
            pause_ratio=ratio,
        )
        seconds = time.perf_counter() - started
        reader.record("after")
        wal = self._wal_lsn() - wal_before
        time.sleep(baseline_seconds)
        erased = result["expired"] + result["trash"]
        self.stdout.write(
            f"round {n}, pause ratio {ratio:g}: seeded in {seeded:.1f} s; purged {erased:,} memories + "
            f"{result['versions']:,} versions in {result['batches']} batches, {seconds:.2f} s = "
            f"{erased / seconds:,.0f} memories/s; WAL {wal / 2**20:.1f} MiB"
        )
        return {"erased": erased, "versions": result["versions"], "seconds": seconds, "ratio": ratio}

    @staticmethod
    def _seed_expired(tenant, tag: str, rows: int) -> None:
        """``rows`` expired memories (an hour ago), one version each, in two statements."""
        with connection.cursor() as cursor:
            cursor.execute(
                """INSERT INTO memories_memory (tenant_id, key, namespace, value, search_text, category, subject,
                       tags, importance, source, version, created_at, updated_at, access_count, sources, expires_at,
                       sensitive)
                   SELECT %s, 'session:' || %s || 's' || (g / 20) || ':k' || g, 'session:' || %s || 's' || (g / 20),
                       jsonb_build_object('n', g, 'note', 'bench value ' || g), 'bench value session ' || g,
                       'task', '', '[]', 5, '', 1, now(), now(), 0, '[]', now() - interval '1 hour', false
                   FROM generate_series(1, %s) g""",
                [tenant.pk, tag, tag, rows],
            )
            cursor.execute(
                """INSERT INTO memories_memoryversion (tenant_id, memory_id, version, value, op, actor_kind, actor_id,
                       created_at, sensitive)
                   SELECT tenant_id, id, 1, value, 'write', 'system', '', now(), false FROM memories_memory
                   WHERE tenant_id = %s AND key LIKE %s""",
                [tenant.pk, f"session:{tag}s%"],
            )

    @staticmethod
    def _insert(tenant, keys: list[str], *, expires_at) -> None:
        now = timezone.now()
        rng = random.Random(len(keys))
        memories = Memory.objects.bulk_create(
            Memory(
                tenant=tenant,
                key=key,
                namespace=key.rsplit(":", 1)[0],
                value={"n": rng.randrange(10**6), "note": f"bench value {key}"},
                search_text=f"bench value {key.replace(':', ' ')}",
                category="task",
                expires_at=expires_at,
                created_at=now,
                updated_at=now,
            )
            for key in keys
        )
        MemoryVersion.objects.bulk_create(
            MemoryVersion(tenant=tenant, memory=m, version=1, value=m.value, op="write", actor_kind="system")
            for m in memories
        )

    @staticmethod
    def _wal_lsn() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_lsn() - '0/0'")
            return int(cursor.fetchone()[0])

    def _report(self, *, batch_size, purges, reader, left) -> None:
        out = self.stdout.write
        samples = {name: sorted(s) for name, s in reader.samples.items()}
        baseline = sorted(samples.get("before", []) + samples.get("after", []))
        ratios = sorted({p["ratio"] for p in purges})
        out("")
        out(f"purge batch size {batch_size}; {left} expired rows of the bench tenant left")
        out(f"{'memory_read latency':26} {'n':>7} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8}")
        rows = [
            ("no purge (before)", samples.get("before", [])),
            ("no purge (after)", samples.get("after", [])),
            ("no purge (all)", baseline),
        ]
        rows += [(f"while purging, pause {r:g}", samples.get(f"during@{r}", [])) for r in ratios]
        for name, s in rows:
            out(
                f"{name:26} {len(s):>7} {percentile(s, 0.50):>8.3f} {percentile(s, 0.95):>8.3f}"
                f" {percentile(s, 0.99):>8.3f} {percentile(s, 1.0):>8.3f}"
            )
        if reader.errors:
            out(f"read errors: {reader.errors}")
        out("")
        p99_base = percentile(baseline, 0.99)
        out(
            f"{'pause ratio':>11} {'memories/s (median)':>20} {'rows/s':>10} {'read p99 ms':>12} {'rise':>7}  "
            f"targets ≥ {TARGET_ROWS_PER_S:,}/s and ≤ +{TARGET_P99_RISE:.0%}"
        )
        for r in ratios:
            mine = [p for p in purges if p["ratio"] == r]
            rate = statistics.median(p["erased"] / p["seconds"] for p in mine)
            row_rate = statistics.median((p["erased"] + p["versions"]) / p["seconds"] for p in mine)
            during = samples.get(f"during@{r}", [])
            p99 = percentile(during, 0.99)
            rise = p99 / p99_base - 1 if baseline and during else float("nan")
            met = "met" if rate >= TARGET_ROWS_PER_S and rise <= TARGET_P99_RISE else "MISSED"
            out(f"{r:>11g} {rate:>20,.0f} {row_rate:>10,.0f} {p99:>12.3f} {rise:>+7.0%}  {met}")
            if len(during) < 500:
                out(f"{'':11} note: only {len(during)} reads during these purges; raise --rounds for a steadier p99")
