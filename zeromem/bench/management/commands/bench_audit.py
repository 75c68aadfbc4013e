"""``python manage.py bench_audit``: what the audit log costs, measured in one run.

1. **Audit on vs off** — ``memory_read`` through the whole in-process stack (middleware,
   DRF, the service) with ``audit_record`` as shipped vs replaced by a no-op, interleaved
   call by call so noise hits both alike: p50/p99 and the ratio.
2. **Seal and verify rates** — ``--events`` events with real digests are inserted for a
   throw-away tenant, sealed (events/s) and verified (events/s); with the WAL the sealing
   wrote per event and what it added to the event table (heap + indexes, each measured after
   a VACUUM of the event partitions): range seals write no event row, so both are ~0.
3. **Streamed export** — ``--export-events`` events (default 1,000,000) exported as CSV
   through the production server (`serve`: granian WSGI) while the worker's resident memory is
   sampled: RSS before, peak and after, rows/s. Flat memory means the export streams.

Bench tenants (``bench-audit-…``) and their events stay (audit rows are append-only): run
it against a benchmark database. PostgreSQL only.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import secrets
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from unittest import mock

from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.utils import timezone

from audit import chain
from audit.models import AuditEvent
from audit.services import audit_seal
from audit.verify import audit_verify
from memories import services
from zeromem.bench.harness import LOOPBACK, Samples, loadavg, ratio
from zeromem.bench.options import BenchCommand
from zeromem.bench.server import start_server, stop_server
from zeromem.kernel.actors import Actor
from zeromem.serving import DEFAULT_THREADS

SYSTEM = Actor.system(job="bench_audit")


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Command(BenchCommand):
    help = "Audit cost (on vs off), seal/verify rates and a streamed 1M-event export's memory. PostgreSQL."

    shared_options = ("n", "json")
    postgresql_needed = "bench_audit measures PostgreSQL: set DATABASE_URL=postgres://..."

    def add_bench_arguments(self, parser):
        parser.add_argument("--events", type=int, default=200_000, help="events sealed and verified (200k)")
        parser.add_argument("--export-events", type=int, default=1_000_000, help="events exported (1M)")
        parser.add_argument("--skip", default="", help="comma-separated phases to skip: onoff,verify,export")

    def handle(self, *args, **opts):
        self.require_postgresql()
        skip = set(filter(None, opts["skip"].split(",")))
        result = {"loadavg": loadavg()}
        if "onoff" not in skip:
            result["audit_on_off"] = self.phase_on_off(opts["n"])
        if "verify" not in skip:
            result["seal_verify"] = self.phase_seal_verify(opts["events"])
        if "export" not in skip:
            result["export"] = self.phase_export(opts["export_events"])
        self.emit(result)

    def _tenant(self, what: str):
        return services.tenant_create(actor=SYSTEM, slug=f"bench-audit-{what}-{secrets.token_hex(3)}")

    # ------------------------------------------------------------------ 1. on vs off

    def phase_on_off(self, n: int) -> dict:
        tenant = self._tenant("onoff")
        key, raw = services.api_key_create(tenant=tenant, actor=SYSTEM, name="bench")
        keys = [f"fact:bench:k{i:03d}" for i in range(50)]
        for k in keys:
            services.memory_write(tenant=tenant, actor=SYSTEM, key=k, value={"text": "prefers concise answers"})
        client = Client(HTTP_AUTHORIZATION=f"Bearer {raw}")
        bodies = [json.dumps({"name": "memory_read", "arguments": {"key": k}}) for k in keys]
        sides = {"on": Samples("on", "memory_read, audited"), "off": Samples("off", "memory_read, audit a no-op")}

        def call(i: int) -> int:
            t0 = time.perf_counter_ns()
            r = client.post("/api/v1/tools/call", bodies[i % len(bodies)], content_type="application/json")
            elapsed = time.perf_counter_ns() - t0
            if r.status_code != 200:
                raise CommandError(f"read failed: {r.status_code} {r.content[:200]!r}")
            return elapsed

        noop = mock.patch("audit.services.audit_record", lambda **kw: None)
        rng = random.Random(1)
        for i in range(200):  # warm-up, both sides
            call(i)
            with noop:
                call(i)
        for i in range(n):
            order = ["on", "off"]
            rng.shuffle(order)
            for side in order:
                if side == "off":
                    with noop:
                        sides[side].ns.append(call(i))
                else:
                    sides[side].ns.append(call(i))
        on, off = sides["on"].summary(), sides["off"].summary()
        services.api_key_revoke(tenant=tenant, actor=SYSTEM, key_id=key.pk)
        return {
            "on": on,
            "off": off,
            "ratio_p50": ratio(on["p50_ms"], off["p50_ms"]),
            "ratio_p99": ratio(on["p99_ms"], off["p99_ms"]),
        }

    # ------------------------------------------------------------------ 2. seal and verify

    def _insert_events(self, tenant, count: int, *, batch: int = 5000) -> float:
        """Insert ``count`` events with valid digests (bulk INSERTs). Returns seconds."""
        started = time.perf_counter()
        base = timezone.now() - timedelta(days=1)
        made = 0
        while made < count:
            rows = []
            for i in range(made, min(count, made + batch)):
                fields = {
                    "uid": uuid.uuid4(),
                    "tenant_id": tenant.pk,
                    "occurred_at": base + timedelta(microseconds=i),
                    "actor_kind": "api_key",
                    "actor_id": str(i % 7),
                    "actor_label": f"zm_bench{i % 7:04d}",
                    "surface": "tool",
                    "action": ("memory.read", "memory.write", "memory.search")[i % 3],
                    "target": f"user:u{i % 5000}:pref_{i % 11}",
                    "subject": f"u{i % 5000}",
                    "outcome": "ok" if i % 17 else "not_found",
                    "request_id": uuid.uuid4().hex,
                    "client_ip": "10.0.0.7",
                    "count": None,
                    "version": i % 9 + 1,
                    "detail": {},
                }
                fields["digest"] = chain.digest(fields)
                fields["tenant"] = tenant
                del fields["tenant_id"]
                rows.append(AuditEvent(**fields))
            AuditEvent.objects.bulk_create(rows, batch_size=batch)
            made += len(rows)
        return time.perf_counter() - started

    def phase_seal_verify(self, count: int) -> dict:
        tenant = self._tenant("verify")
        insert_s = self._insert_events(tenant, count)
        self.log(f"inserted {count:,} events in {insert_s:.1f} s")
        before = self._event_table_size()
        wal = self._wal_lsn()
        t0 = time.perf_counter()
        sealed = audit_seal(tenant_id=tenant.pk)
        seal_s = time.perf_counter() - t0
        wal = self._wal_lsn() - wal
        after = self._event_table_size()
        t0 = time.perf_counter()
        result = audit_verify(tenant_id=tenant.pk)
        verify_s = time.perf_counter() - t0
        if not result.ok:
            raise CommandError(f"verification failed: {result.first_problem}")
        return {
            "events": count,
            "sealed": sealed,
            "seal_seconds": round(seal_s, 2),
            "seal_events_per_s": round(sealed / seal_s),
            "verify_seconds": round(verify_s, 2),
            "verify_events_per_s": round(result.events / verify_s),
            "seal_wal_bytes_per_event": round(wal / max(sealed, 1), 1),
            "table_bytes_before_seal": before,
            "table_bytes_after_seal": after,
        }

    @staticmethod
    def _event_table_size() -> int:
        """Heap + indexes of every event partition, after a VACUUM (dead rows' space counted)."""
        table = AuditEvent._meta.db_table
        with connection.cursor() as cursor:
            # bandit B608 (marked): the model's own table name.
            cursor.execute(f"VACUUM {table}")  # nosec B608
            cursor.execute(
                "SELECT coalesce(sum(pg_total_relation_size(inhrelid)), pg_total_relation_size(%s::regclass)) "
                "FROM pg_inherits WHERE inhparent = %s::regclass",
                [table, table],
            )
            return int(cursor.fetchone()[0])

    @staticmethod
    def _wal_lsn() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_lsn() - '0/0'")
            return int(cursor.fetchone()[0])

    # ------------------------------------------------------------------ 3. export

    def phase_export(self, count: int) -> dict:
        tenant = self._tenant("export")
        insert_s = self._insert_events(tenant, count, batch=10000)
        self.log(f"inserted {count:,} events for the export in {insert_s:.1f} s")
        key, raw = services.api_key_create(tenant=tenant, actor=SYSTEM, name="bench", scopes=["audit:read"])
        connection.close()
        server = start_server(
            database_url=os.environ["DATABASE_URL"], processes=1, threads=DEFAULT_THREADS, log=self.log
        )
        pid = server["workers"][0]
        samples: list[int] = []
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                rss = _rss_kib(pid)
                if rss:
                    samples.append(rss)
                time.sleep(0.1)

        try:
            rss_before = _rss_kib(pid)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            conn = http.client.HTTPConnection(LOOPBACK, server["port"], timeout=120)
            t0 = time.perf_counter()
            conn.request("GET", "/api/v1/audit-events/export?format=csv", headers={"Authorization": f"Bearer {raw}"})
            response = conn.getresponse()
            if response.status != 200:
                raise CommandError(f"export answered {response.status}: {response.read(300)!r}")
            size = lines = 0
            first_byte = None
            while chunk := response.read(1 << 16):
                if first_byte is None:
                    first_byte = time.perf_counter() - t0
                size += len(chunk)
                lines += chunk.count(b"\n")
            seconds = time.perf_counter() - t0
            conn.close()
            stop.set()
            sampler.join(2)
            rss_after = _rss_kib(pid)
        finally:
            stop.set()
            stop_server(server)
            services.api_key_revoke(tenant=tenant, actor=SYSTEM, key_id=key.pk)
        rows = lines - 1
        if rows < count:
            raise CommandError(f"the export returned {rows} rows, expected at least {count}")
        return {
            "rows": rows,
            "bytes": size,
            "seconds": round(seconds, 1),
            "rows_per_s": round(rows / seconds),
            "first_byte_ms": round((first_byte or 0) * 1000, 1),
            "rss_before_mib": round((rss_before or 0) / 1024, 1),
            "rss_peak_mib": round(max(samples, default=0) / 1024, 1),
            "rss_after_mib": round((rss_after or 0) / 1024, 1),
            "rss_samples": len(samples),
            "at": datetime.now(UTC).isoformat(),
        }

    # ------------------------------------------------------------------ output

    def print_table(self, r: dict) -> None:
        w = self.stdout.write
        w(f"load average at start: {r['loadavg']}")
        if "audit_on_off" in r:
            a = r["audit_on_off"]
            w("\n1. memory_read through the in-process stack, audit on vs off (interleaved)")
            w(f"   {'':28}{'n':>7}{'p50 ms':>10}{'p99 ms':>10}")
            for side in ("on", "off"):
                s = a[side]
                w(f"   {s['what']:28}{s['n']:>7}{s['p50_ms']:>10.3f}{s['p99_ms']:>10.3f}")
            w(f"   ratio on/off: p50 {a['ratio_p50']}×, p99 {a['ratio_p99']}× (target ≤ 1.3×)")
        if "seal_verify" in r:
            s = r["seal_verify"]
            w(f"\n2. seal and verify {s['events']:,} events")
            w(f"   seal   {s['seal_seconds']:>8.2f} s  {s['seal_events_per_s']:>10,} events/s")
            w(f"   verify {s['verify_seconds']:>8.2f} s  {s['verify_events_per_s']:>10,} events/s")
            grown = s["table_bytes_after_seal"] - s["table_bytes_before_seal"]
            w(
                f"   sealing wrote {s['seal_wal_bytes_per_event']:,} B of WAL per event and grew the event table "
                f"(heap + indexes, after VACUUM) by {grown / 2**20:,.1f} MiB "
                f"({s['table_bytes_before_seal'] / 2**20:,.1f} → {s['table_bytes_after_seal'] / 2**20:,.1f} MiB)"
            )
        if "export" in r:
            e = r["export"]
            w(f"\n3. CSV export of {e['rows']:,} events through uvicorn (ASGI, 1 worker)")
            w(
                f"   {e['bytes'] / 2**20:,.0f} MiB in {e['seconds']} s ({e['rows_per_s']:,} rows/s), first byte after "
                f"{e['first_byte_ms']} ms"
            )
            w(
                f"   worker RSS: before {e['rss_before_mib']} MiB, peak {e['rss_peak_mib']} MiB, after "
                f"{e['rss_after_mib']} MiB ({e['rss_samples']} samples)"
            )
