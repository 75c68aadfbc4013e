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
3. ``memories.services.purge_expired`` runs while the reader keeps reading, once per variant:
   every combination of ``--batch-size``, ``--pause-ratios``, ``--rates`` (memories/s,
   0 unpaced) and ``--wal-compressions`` (each a comma-separated list, default the settings),
   in turn, so the variants share the round's time window; its memories/s (pauses included),
   its WAL (bytes and full-page images, from ``pg_stat_wal``: the whole server's, so other
   databases' writes count too) and the reads' latencies during it;
4. the reads again with no purge running, for ``--baseline-seconds`` (to show drift);
5. the controls (``--controls``, default both), each as long as that round's purge took and
   with the reader still reading: ``cpu``, a subprocess spinning on one core that has nothing
   to do with ZeroMem or the database; ``wal``, another session inserting and deleting rows
   of a scratch table (``bench_purge_scratch``, dropped at the end) in transactions of the
   purge's WAL per batch, paced to the purge's WAL bytes per second. What the reader's p99
   does under each separates "the purge takes one of the cores" from "the read's commit
   waits behind the purge's WAL flush".

Each purge lasts only seconds, so a single round gives a few hundred reads "during": the
rounds pool them, for a p99 worth the name. Printed: throughput per round and, per pause
variant, its median, read p50/p95/p99 with and without a purge side by side, and the DESIGN.md targets
(≥ 50,000 rows/s; read p99 rise ≤ 25%). Every phase is bounded in time. The purge also
erases any other expired rows in the database (that is its job), so use a database of its
own. The bench tenant's live memories and audit events stay.
"""

from __future__ import annotations

import math
import random
import secrets
import statistics
import subprocess
import sys
import threading
import time
from itertools import product

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection, connections, transaction
from django.test import override_settings
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
CONTROLS = ("cpu", "wal")
SCRATCH = "bench_purge_scratch"


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
        parser.add_argument(
            "--batch-size",
            default=str(retention.DEFAULT_BATCH_SIZE),
            help=f"comma-separated batch sizes to compare (default {retention.DEFAULT_BATCH_SIZE})",
        )
        parser.add_argument(
            "--rates",
            default=None,
            help="comma-separated purge rates in memories/s to compare, 0 unpaced "
            "(default: the ZEROMEM_PURGE_MEMORIES_PER_SECOND setting)",
        )
        parser.add_argument(
            "--wal-compressions",
            default=None,
            help="comma-separated ZEROMEM_PURGE_WAL_COMPRESSION values to compare: off, auto, zstd, lz4, pglz "
            "(default: the setting)",
        )
        parser.add_argument("--baseline-seconds", type=float, default=3.0, help="each no-purge read phase")
        parser.add_argument(
            "--pause-ratios",
            default=None,
            help="comma-separated purge pause ratios to compare in one run, each every round "
            "(default: the ZEROMEM_PURGE_PAUSE_RATIO setting alone)",
        )
        parser.add_argument(
            "--controls",
            default=",".join(CONTROLS),
            help="control phases after each round's purge, as long as it: cpu (a process spinning on one core), "
            "wal (a session writing the purge's WAL rate to a scratch table); 'none' for neither (default cpu,wal)",
        )

    def handle(
        self,
        *args,
        rows,
        live,
        rounds,
        batch_size,
        baseline_seconds,
        max_seconds,
        pause_ratios,
        rates,
        wal_compressions,
        controls,
        **options,
    ):
        self.require_postgresql()
        controls = [] if controls == "none" else [c.strip() for c in controls.split(",") if c.strip()]
        if any(c not in CONTROLS for c in controls):
            raise CommandError("--controls: a comma-separated subset of cpu,wal, or none")
        try:
            ratios = [float(r) for r in (pause_ratios or str(settings.ZEROMEM_PURGE_PAUSE_RATIO)).split(",")]
        except ValueError:
            raise CommandError("--pause-ratios: comma-separated numbers, e.g. 0,0.5,1") from None
        if any(r < 0 for r in ratios):
            raise CommandError("--pause-ratios must be at least 0")
        try:
            batch_sizes = [int(b) for b in batch_size.split(",")]
            paces = [float(r) for r in (rates or str(settings.ZEROMEM_PURGE_MEMORIES_PER_SECOND)).split(",")]
        except ValueError:
            raise CommandError("--batch-size and --rates: comma-separated numbers, e.g. 1000,5000") from None
        if any(r < 0 for r in paces):
            raise CommandError("--rates must be at least 0 (0: unpaced)")
        compressions = [c.strip() for c in (wal_compressions or settings.ZEROMEM_PURGE_WAL_COMPRESSION).split(",")]
        if any(c not in ("off", "auto", *retention.WAL_COMPRESSION_PREFERENCE) for c in compressions):
            raise CommandError("--wal-compressions: a comma-separated subset of off,auto,zstd,lz4,pglz")
        variants = [
            Variant(batch_size=b, ratio=r, rate=p, compression=c)
            for b, r, p, c in product(batch_sizes, ratios, paces, compressions)
        ]
        if min(rows, live, rounds, *batch_sizes) < 1 or rounds > 20:
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
                for variant in variants:
                    reader.record(None)
                    purge = self._round(n, tenant, reader, rows, baseline_seconds, max_seconds, variant)
                    purges.append(purge)
                    for control in controls:
                        self._control(control, purge, reader)
        finally:
            reader.done.set()
            reader.join(timeout=30)
            if "wal" in controls:
                with connection.cursor() as cursor:
                    # bandit B608 (marked): SCRATCH is a constant of this module.
                    cursor.execute(f"DROP TABLE IF EXISTS {SCRATCH}")  # nosec B608
        left = Memory.objects.filter(tenant=tenant, expires_at__lte=timezone.now()).count()
        self._report(purges=purges, reader=reader, left=left, controls=controls)

    def _control(self, control: str, purge: dict, reader: Reader) -> None:
        """The reader's latencies while something other than the purge loads the machine for
        as long as the purge took: one core spinning, or the purge's WAL written by a plain session."""
        seconds = max(purge["seconds"], 0.5)
        load_before = _loadavg()
        if control == "cpu":
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                time.sleep(0.05)  # the interpreter's start-up is not part of the phase
                reader.record("control:cpu")
                time.sleep(seconds)
                reader.record(None)
            finally:
                spinner.kill()
                spinner.wait()
            self.stdout.write(f"  control cpu: one core spun for {seconds:.2f} s (load {load_before})")
            return
        wal_rate = purge["wal"] / purge["seconds"]
        per_commit = purge["wal"] / max(purge["batches"], 1)
        writer = WalWriter(bytes_per_s=wal_rate, bytes_per_commit=per_commit)
        writer.start()
        try:
            writer.ready.wait(timeout=30)
            reader.record("control:wal")
            time.sleep(seconds)
            reader.record(None)
        finally:
            writer.done.set()
            writer.join(timeout=60)
        achieved = writer.written / writer.seconds if writer.seconds else 0.0
        self.stdout.write(
            f"  control wal: target {wal_rate / 2**20:.1f} MiB/s in {per_commit / 2**20:.2f} MiB commits; "
            f"wrote {writer.written / 2**20:.1f} MiB in {writer.commits} commits, {achieved / 2**20:.1f} MiB/s "
            f"(load {load_before})"
        )

    def _round(self, n, tenant, reader, rows, baseline_seconds, max_seconds, variant: Variant) -> dict:
        label = variant.label
        t0 = time.perf_counter()
        self._seed_expired(tenant, f"r{n}v{secrets.token_hex(3)}", rows)
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE memories_memory")
            cursor.execute("VACUUM ANALYZE memories_memoryversion")
            cursor.execute("CHECKPOINT")
        seeded = time.perf_counter() - t0

        reader.record("before")
        time.sleep(baseline_seconds)
        reader.record(f"during@{label}")
        deadline = time.monotonic() + max_seconds

        def stop_when_late(_done: int) -> None:
            if time.monotonic() > deadline:
                raise CommandError(f"a purge took longer than --max-seconds={max_seconds}")

        wal_before = self._wal_lsn()
        fpi_before = self._wal_fpi()
        started = time.perf_counter()
        with override_settings(ZEROMEM_PURGE_WAL_COMPRESSION=variant.compression):
            result = retention.purge_expired(
                batch_size=variant.batch_size,
                max_batches=math.ceil(rows / variant.batch_size) + 10,
                progress=stop_when_late,
                pause_ratio=variant.ratio,
                memories_per_second=variant.rate,
            )
        seconds = time.perf_counter() - started
        reader.record("after")
        wal = self._wal_lsn() - wal_before
        fpi = self._wal_fpi() - fpi_before
        time.sleep(baseline_seconds)
        erased = result["expired"] + result["trash"]
        self.stdout.write(
            f"round {n}, {label}: seeded in {seeded:.1f} s; purged {erased:,} memories + "
            f"{result['versions']:,} versions in {result['batches']} batches, {seconds:.2f} s = "
            f"{erased / seconds:,.0f} memories/s; WAL {wal / 2**20:.1f} MiB "
            f"({wal / max(erased, 1):,.0f} B/memory, {fpi:,} full-page images; load {_loadavg()})"
        )
        return {
            "erased": erased,
            "versions": result["versions"],
            "seconds": seconds,
            "variant": label,
            "wal": wal,
            "fpi": fpi,
            "batches": result["batches"],
        }

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
                       created_at, sensitive, subject)
                   SELECT tenant_id, id, 1, value, 'write', 'system', '', now(), false, subject FROM memories_memory
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
    def _wal_fpi() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT wal_fpi FROM pg_stat_wal")
            return int(cursor.fetchone()[0])

    @staticmethod
    def _wal_lsn() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_lsn() - '0/0'")
            return int(cursor.fetchone()[0])

    def _report(self, *, purges, reader, left, controls) -> None:
        out = self.stdout.write
        samples = {name: sorted(s) for name, s in reader.samples.items()}
        baseline = sorted(samples.get("before", []) + samples.get("after", []))
        labels = list(dict.fromkeys(p["variant"] for p in purges))
        width = max([26, *(len(v) + 6 for v in labels)])
        out("")
        out(f"{left} expired rows of the bench tenant left")
        out(f"{'memory_read latency':{width}} {'n':>7} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8}")
        rows = [
            ("no purge (before)", samples.get("before", [])),
            ("no purge (after)", samples.get("after", [])),
            ("no purge (all)", baseline),
        ]
        rows += [(f"while {r}", samples.get(f"during@{r}", [])) for r in labels]
        rows += [(f"control: {c}", samples.get(f"control:{c}", [])) for c in controls]
        for name, s in rows:
            out(
                f"{name:{width}} {len(s):>7} {percentile(s, 0.50):>8.3f} {percentile(s, 0.95):>8.3f}"
                f" {percentile(s, 0.99):>8.3f} {percentile(s, 1.0):>8.3f}"
            )
        if reader.errors:
            out(f"read errors: {reader.errors}")
        out("")
        p99_base = percentile(baseline, 0.99)
        out(
            f"{'variant':>{width}} {'memories/s (median)':>20} {'rows/s':>10} {'WAL B/mem':>10} {'FPI/round':>10} "
            f"{'read p99 ms':>12} {'rise':>7}  targets ≥ {TARGET_ROWS_PER_S:,}/s and ≤ +{TARGET_P99_RISE:.0%}"
        )
        for r in labels:
            mine = [p for p in purges if p["variant"] == r]
            rate = statistics.median(p["erased"] / p["seconds"] for p in mine)
            row_rate = statistics.median((p["erased"] + p["versions"]) / p["seconds"] for p in mine)
            during = samples.get(f"during@{r}", [])
            p99 = percentile(during, 0.99)
            rise = p99 / p99_base - 1 if baseline and during else float("nan")
            wal = statistics.median(p["wal"] / max(p["erased"], 1) for p in mine)
            fpi = statistics.median(p["fpi"] for p in mine)
            met = "met" if rate >= TARGET_ROWS_PER_S and rise <= TARGET_P99_RISE else "MISSED"
            out(
                f"{r:>{width}} {rate:>20,.0f} {row_rate:>10,.0f} {wal:>10,.0f} {fpi:>10,.0f} "
                f"{p99:>12.3f} {rise:>+7.0%}  {met}"
            )
            if len(during) < 500:
                note = f"note: only {len(during)} reads during these purges; raise --rounds for a steadier p99"
                out(f"{'':{width}} {note}")
        for c in controls:
            during = samples.get(f"control:{c}", [])
            p99 = percentile(during, 0.99)
            rise = p99 / p99_base - 1 if baseline and during else float("nan")
            what = "one core spinning" if c == "cpu" else "the purge's WAL, plain rows"
            out(f"{'control ' + c:>{width}} {what:>53} {p99:>12.3f} {rise:>+7.0%}")
        out(f"load average at the end: {_loadavg()}")


class Variant:
    """One way of running the purge that a round compares."""

    def __init__(self, *, batch_size: int, ratio: float, rate: float, compression: str):
        self.batch_size, self.ratio, self.rate, self.compression = batch_size, ratio, rate, compression

    @property
    def label(self) -> str:
        rate = f"{self.rate / 1000:g}k/s" if self.rate else "unpaced"
        return f"batch {self.batch_size}, pause {self.ratio:g}, {rate}, wal {self.compression}"


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


class WalWriter(threading.Thread):
    """A session that writes WAL and nothing else ZeroMem does: rows inserted into and
    deleted from a scratch table, in transactions of ``bytes_per_commit`` of WAL, paced to
    ``bytes_per_s`` (each commit is followed by a sleep until the rate is back on target)."""

    def __init__(self, *, bytes_per_s: float, bytes_per_commit: float):
        super().__init__(daemon=True)
        self.rate = bytes_per_s
        self.per_commit = bytes_per_commit
        self.ready = threading.Event()
        self.done = threading.Event()
        self.written = 0
        self.commits = 0
        self.seconds = 0.0

    def run(self) -> None:
        conn = connections["default"]
        try:
            with conn.cursor() as cursor:
                cursor.execute(f"CREATE TABLE IF NOT EXISTS {SCRATCH} (id bigint, pad text)")  # nosec B608
                rows = 1000

                def commit_one() -> int:
                    nonlocal rows
                    lsn = _lsn(cursor)
                    with transaction.atomic():
                        cursor.execute(
                            f"INSERT INTO {SCRATCH} SELECT g, repeat(md5(g::text), 6) "  # nosec B608
                            "FROM generate_series(1, %s) g",
                            [rows],
                        )
                        cursor.execute(f"DELETE FROM {SCRATCH}")  # nosec B608
                    wrote = _lsn(cursor) - lsn
                    rows = max(10, min(200_000, int(rows * self.per_commit / max(wrote, 1))))
                    return wrote

                for _ in range(3):  # size the transactions before the phase starts
                    commit_one()
                self.ready.set()
                started = time.perf_counter()
                while not self.done.is_set():
                    self.written += commit_one()
                    self.commits += 1
                    ahead = self.written / self.rate - (time.perf_counter() - started)
                    if ahead > 0:
                        self.done.wait(ahead)
                self.seconds = time.perf_counter() - started
        finally:
            self.ready.set()
            conn.close()


def _lsn(cursor) -> int:
    cursor.execute("SELECT pg_current_wal_lsn() - '0/0'")
    return int(cursor.fetchone()[0])
