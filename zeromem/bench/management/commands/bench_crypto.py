"""``python manage.py bench_crypto``: what encryption at rest costs, measured in one run.

Four operations through the whole in-process stack (middleware, DRF, the tool endpoint, the
service, the audit event), interleaved call by call in a fresh random order so that machine
noise hits all of them alike:

* ``write_plain`` / ``write_sensitive`` — ``memory_write`` of the same 200-byte JSON value,
  plain vs ``sensitive: true`` (sealed: AES-256-GCM under the subject's data key, value and
  version, search index without the value);
* ``read_plain`` / ``read_sensitive`` — ``memory_read`` of such memories (opened on load).

Prints p50/p99 of each and the sensitive/plain ratios (target ≤ 1.2×), and the cost of the
primitives alone (seal and open of one value, µs). Unwrapped data keys are cached per process
(``ZEROMEM_DATA_KEY_CACHE_SECONDS``), as in production. The bench tenant stays: run it
against a benchmark database. Both databases; the README's figures are PostgreSQL's.
"""

from __future__ import annotations

import json
import random
import secrets
import time

from django.core.management.base import CommandError
from django.test import Client

from memories import keyring, services
from zeromem.bench.harness import interleaved_samples, loadavg, ratio
from zeromem.bench.options import BenchCommand
from zeromem.kernel import crypto
from zeromem.kernel.actors import Actor

SYSTEM = Actor.system(job="bench_crypto")
VALUE = {
    "email": "li.lei@example.com",
    "phone": "+86 138 0013 8000",
    "address": "No. 1 Zhongguancun Street, Haidian District, Beijing",
    "note": "prefers calls after 6pm",
}


class Command(BenchCommand):
    help = "Read/write cost of a sensitive (encrypted) memory vs a plain one, in one run."

    shared_options = ("n", "seed", "json", "max_seconds")
    option_defaults = {"n": 1000, "max_seconds": 300.0}

    def add_bench_arguments(self, parser):
        parser.add_argument("--keys", type=int, default=50, help="memories per kind the calls go to (%(default)s)")

    def handle(self, *args, **opts):
        n, keys = opts["n"], opts["keys"]
        tenant = services.tenant_create(actor=SYSTEM, slug=f"bench-crypto-{secrets.token_hex(3)}")
        _key, raw = services.api_key_create(tenant=tenant, actor=SYSTEM, name="bench")
        client = Client(HTTP_AUTHORIZATION=f"Bearer {raw}")
        subjects = [f"b{i:03d}" for i in range(keys)]

        def body(name: str, **arguments) -> str:
            return json.dumps({"name": name, "arguments": arguments})

        writes = {
            kind: [
                body("memory_write", key=f"user:{s}:{kind}", value=VALUE, sensitive=kind == "sensitive")
                for s in subjects
            ]
            for kind in ("plain", "sensitive")
        }
        reads = {
            kind: [body("memory_read", key=f"user:{s}:{kind}") for s in subjects] for kind in ("plain", "sensitive")
        }
        for kind in writes:
            for b in writes[kind]:
                self._call(client, b)

        def op(bodies):
            def run(i: int) -> tuple[bool, int]:
                t0 = time.perf_counter_ns()
                ok = self._call(client, bodies[i % len(bodies)])
                return ok, time.perf_counter_ns() - t0

            return run

        ops = {
            "write_plain": ("memory_write, plain", op(writes["plain"])),
            "write_sensitive": ("memory_write, sensitive: sealed", op(writes["sensitive"])),
            "read_plain": ("memory_read, plain", op(reads["plain"])),
            "read_sensitive": ("memory_read, sensitive: opened", op(reads["sensitive"])),
        }
        samples = interleaved_samples(
            ops,
            iterations=n,
            warmup=min(100, n),
            max_seconds=opts["max_seconds"],
            rng=random.Random(opts["seed"]),
            log=self.log,
        )
        s = {name: sample.summary() for name, sample in samples.items()}
        result = {
            "database": self.database_vendor(),
            "loadavg": loadavg(),
            **s,
            "ratio_write_p50": ratio(s["write_sensitive"]["p50_ms"], s["write_plain"]["p50_ms"]),
            "ratio_write_p99": ratio(s["write_sensitive"]["p99_ms"], s["write_plain"]["p99_ms"]),
            "ratio_read_p50": ratio(s["read_sensitive"]["p50_ms"], s["read_plain"]["p50_ms"]),
            "ratio_read_p99": ratio(s["read_sensitive"]["p99_ms"], s["read_plain"]["p99_ms"]),
            "primitives_us": self._primitives(tenant.pk),
        }
        self.emit(result)

    def _call(self, client: Client, body: str) -> bool:
        r = client.post("/api/v1/tools/call", body, content_type="application/json")
        if r.status_code != 200 or r.json().get("status") != "ok":
            raise CommandError(f"call failed: {r.status_code} {r.content[:200]!r}")
        return True

    def _primitives(self, tenant_id: int, rounds: int = 2000) -> dict:
        key_id, key = keyring.current_key(tenant_id=tenant_id, subject="b000")
        t0 = time.perf_counter_ns()
        for _ in range(rounds):
            envelope = crypto.seal(key, key_id, VALUE)
        t1 = time.perf_counter_ns()
        for _ in range(rounds):
            crypto.open_envelope(key, envelope)
        t2 = time.perf_counter_ns()
        return {"seal": round((t1 - t0) / rounds / 1000, 1), "open": round((t2 - t1) / rounds / 1000, 1)}

    def database_vendor(self) -> str:
        from django.db import connection

        return connection.vendor

    def print_table(self, result: dict) -> None:
        self.stdout.write(self._table(result))

    def _table(self, result: dict) -> str:
        lines = [f"database: {result['database']}   loadavg: {result['loadavg']}", ""]
        lines.append(f"{'operation':<18}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}  what")
        for name in ("write_plain", "write_sensitive", "read_plain", "read_sensitive"):
            s = result[name]
            lines.append(f"{name:<18}{s['n']:>6}{s['p50_ms']:>10}{s['p99_ms']:>10}  {s['what']}")
        lines.append("")
        lines.append(
            f"sensitive / plain: write p50 {result['ratio_write_p50']}x p99 {result['ratio_write_p99']}x; "
            f"read p50 {result['ratio_read_p50']}x p99 {result['ratio_read_p99']}x (target <= 1.2x)"
        )
        p = result["primitives_us"]
        lines.append(f"primitives alone: seal {p['seal']} us, open {p['open']} us per 200-byte value")
        return "\n".join(lines)
