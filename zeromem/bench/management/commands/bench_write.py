"""``python manage.py bench_write``: what a write over an existing memory costs, on PostgreSQL
(``DATABASE_URL``), three ways:

- ``as_read`` (the default, as served: outside a transaction): the memory read without a lock,
  then its UPDATE (while the row is as read), version INSERT and audit INSERT as one statement;
- ``locked`` (``ZEROMEM_WRITE_WITHOUT_LOCK`` off, session 22's write): BEGIN, the row lock, the
  three as one statement, COMMIT;
- ``one_by_one`` (``ZEROMEM_WRITE_ONE_STATEMENT`` off): under the row lock, each statement sent
  on its own.

Each way also times ``memory_update`` with ``expected_version`` (the tool ``memory_update``,
REST ``PATCH``): ``as_read`` updates the memory as read (two statements), the others in the
transaction of before (the locked path).

In this process, ``DEBUG`` off (statements unwatched, as in production), on a throw-away
tenant: the ways alternate in turns (``--rounds`` × ``--calls`` writes each, the order rotated
every round), so a machine whose load drifts weighs on all alike. Per way:

- the ``memory_write`` service over an existing key: wall p50/p95 and CPU per call;
- the ``memory_write`` tool call through Django's test client (middleware, view, service: no
  socket) and ``/healthz`` the same way: wall p50, and their ratio (issue 11's bar);
- round trips per service write, from libpq's protocol trace (every simple ``Query`` —
  BEGIN, COMMIT — and every ``Sync`` is one wait for the server).

``--driver`` also times the same shape of transaction on the bare driver (temporary tables,
no Django): the statements one by one, in psycopg's pipeline mode, and as one statement —
why a write does not use pipeline mode (its machinery costs more than the round trips it
saves on a loopback connection).
"""

from __future__ import annotations

import json
import secrets
import statistics
import tempfile
import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from django.test import Client

from zeromem.bench.harness import loadavg

KEY = "user:u1:pref_lang"
# Per way: ZEROMEM_WRITE_ONE_STATEMENT and ZEROMEM_WRITE_WITHOUT_LOCK.
WAYS = {"as_read": (True, True), "locked": (True, False), "one_by_one": (False, False)}


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s)) - 1))]


def _round_trips(call) -> int:
    from psycopg import pq

    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryFile(mode="w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            call()
        finally:
            pgconn.untrace()
        trace.seek(0)
        lines = [line.split("\t") for line in trace.read().splitlines() if line.startswith("F\t")]
    return sum(1 for parts in lines if parts[2].startswith(("Query", "Sync")))


class Command(BaseCommand):
    help = "A write and an update of an existing memory: as read, locked, one by one (wall, CPU, round trips)."

    def add_arguments(self, parser):
        parser.add_argument("--rounds", type=int, default=3, help="turns of each way (%(default)s)")
        parser.add_argument("--calls", type=int, default=500, help="writes per turn (%(default)s)")
        parser.add_argument("--driver", action="store_true", help="also time the bare driver's variants")

    def handle(self, *args, rounds: int, calls: int, driver: bool, **options):
        if connection.vendor != "postgresql":
            raise CommandError("bench_write measures PostgreSQL (DATABASE_URL)")
        if settings.DEBUG:
            raise CommandError("run with DEBUG off: DEBUG logs every statement (and sends them one by one)")
        from memories import services
        from zeromem.kernel.actors import Actor

        system = Actor.system(job="bench_write")
        tenant = services.tenant_create(
            actor=system, slug=f"bench-write-{secrets.token_hex(3)}", name="bench_write (throw-away)"
        )
        key, raw = services.api_key_create(tenant=tenant, actor=system, name="bench_write")
        client = Client(headers={"Authorization": f"Bearer {raw}"})
        body = {"name": "memory_write", "arguments": {"key": KEY, "value": ""}}
        n = [0]

        def service():
            n[0] += 1
            services.memory_write(tenant=tenant, actor=system, key=KEY, value=f"value {n[0]} in a few words")

        def tool():
            n[0] += 1
            body["arguments"]["value"] = f"value {n[0]} in a few words"
            r = client.post("/api/v1/tools/call", body, content_type="application/json")
            assert r.status_code == 200, r.content

        def healthz():
            assert client.get("/healthz").status_code == 200

        version = [0]

        def update():
            n[0] += 1
            r = services.memory_update(
                tenant=tenant, actor=system, key=KEY, value=f"update {n[0]} in a few words", expected_version=version[0]
            )
            version[0] = r.memory.version

        def current_version():
            version[0] = services.memory_read(tenant=tenant, actor=system, key=KEY).memory.version

        samples = {
            way: {
                "service": [],
                "cpu": [],
                "tool": [],
                "healthz": [],
                "trips": [],
                "update": [],
                "update_cpu": [],
                "update_trips": [],
            }
            for way in WAYS
        }
        load_before = loadavg()
        original = settings.ZEROMEM_WRITE_ONE_STATEMENT, settings.ZEROMEM_WRITE_WITHOUT_LOCK
        try:
            service()
            for ways in WAYS.values():  # warm-up: statements prepared, key cached
                settings.ZEROMEM_WRITE_ONE_STATEMENT, settings.ZEROMEM_WRITE_WITHOUT_LOCK = ways
                for _ in range(50):
                    service(), tool(), healthz()
                current_version()
                for _ in range(50):
                    update()
            ways = list(WAYS)
            for r in range(rounds):
                for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
                    settings.ZEROMEM_WRITE_ONE_STATEMENT, settings.ZEROMEM_WRITE_WITHOUT_LOCK = WAYS[way]
                    s = samples[way]
                    s["trips"].append(_round_trips(service))
                    cpu = time.process_time()
                    for _ in range(calls):
                        t = time.perf_counter_ns()
                        service()
                        s["service"].append((time.perf_counter_ns() - t) / 1e6)
                    s["cpu"].append((time.process_time() - cpu) / calls * 1e3)
                    for _ in range(calls // 2):
                        t = time.perf_counter_ns()
                        tool()
                        s["tool"].append((time.perf_counter_ns() - t) / 1e6)
                        t = time.perf_counter_ns()
                        healthz()
                        s["healthz"].append((time.perf_counter_ns() - t) / 1e6)
                    current_version()
                    s["update_trips"].append(_round_trips(update))
                    cpu = time.process_time()
                    for _ in range(calls):
                        t = time.perf_counter_ns()
                        update()
                        s["update"].append((time.perf_counter_ns() - t) / 1e6)
                    s["update_cpu"].append((time.process_time() - cpu) / calls * 1e3)
        finally:
            settings.ZEROMEM_WRITE_ONE_STATEMENT, settings.ZEROMEM_WRITE_WITHOUT_LOCK = original
            services.api_key_revoke(tenant=tenant, actor=system, key_id=key.pk)
        report = {"rounds": rounds, "calls_per_round": calls, "loadavg_before": load_before}
        for way, s in samples.items():
            report[way] = {
                "round_trips_per_write": sorted(set(s["trips"])),
                "service_wall_p50_ms": round(_p(s["service"], 0.5), 3),
                "service_wall_p95_ms": round(_p(s["service"], 0.95), 3),
                "service_cpu_ms_per_call": round(statistics.median(s["cpu"]), 3),
                "service_cpu_ms_per_round": [round(x, 3) for x in s["cpu"]],
                "tool_write_p50_ms": round(_p(s["tool"], 0.5), 3),
                "healthz_p50_ms": round(_p(s["healthz"], 0.5), 3),
                "tool_write_over_healthz": round(_p(s["tool"], 0.5) / _p(s["healthz"], 0.5), 2),
                "round_trips_per_update": sorted(set(s["update_trips"])),
                "update_wall_p50_ms": round(_p(s["update"], 0.5), 3),
                "update_wall_p95_ms": round(_p(s["update"], 0.95), 3),
                "update_cpu_ms_per_call": round(statistics.median(s["update_cpu"]), 3),
            }
        if driver:
            report["driver_ms_p50_and_cpu"] = _driver(rounds, calls)
        report["loadavg_after"] = loadavg()
        self.stdout.write(json.dumps(report, indent=2))


def _driver(rounds: int, calls: int) -> dict:
    """The transaction's shape on the bare driver: BEGIN, a row lock, an UPDATE, two INSERTs
    RETURNING their ids, COMMIT — one by one, in pipeline mode, as one statement."""
    import psycopg

    conn = psycopg.connect(connection.connection.info.dsn, autocommit=False)
    cur, cur2 = conn.cursor(), conn.cursor()
    cur.execute("CREATE TEMP TABLE m (id int PRIMARY KEY, v text, n int)")
    cur.execute("INSERT INTO m VALUES (1, 'a', 0)")
    cur.execute("CREATE TEMP TABLE ver (id serial PRIMARY KEY, mid int, v text)")
    cur.execute("CREATE TEMP TABLE au (id serial PRIMARY KEY, x text, d text)")
    conn.commit()
    update, version, audit = (
        "UPDATE m SET v = %s, n = %s WHERE id = %s",
        "INSERT INTO ver (mid, v) VALUES (%s, %s) RETURNING id",
        "INSERT INTO au (x, d) VALUES (%s, %s) RETURNING id",
    )
    one = (
        "WITH h0 AS (UPDATE m SET v = %s, n = %s WHERE id = %s RETURNING 1), "
        "h1 AS (INSERT INTO ver (mid, v) VALUES (%s, %s) RETURNING id) "
        "INSERT INTO au (x, d) VALUES (%s, %s) RETURNING id, (SELECT count(*) FROM h0), (SELECT id FROM h1)"
    )

    def lock():
        cur.execute("SELECT id, v, n FROM m WHERE id = %s FOR UPDATE", (1,), prepare=True)
        cur.fetchone()

    def one_by_one():
        lock()
        cur.execute(update, ("b", 1, 1), prepare=True)
        cur.execute(version, (1, "b"), prepare=True)
        cur.fetchone()
        cur.execute(audit, ("x", "d"), prepare=True)
        cur.fetchone()
        conn.commit()

    def pipeline():
        lock()
        with conn.pipeline():
            cur.execute(update, ("b", 1, 1), prepare=True)
            cur2.execute(version, (1, "b"), prepare=True)
            cur.execute(audit, ("x", "d"), prepare=True)
            conn.commit()
        cur.fetchone(), cur2.fetchone()

    def one_statement():
        lock()
        cur.execute(one, ("b", 1, 1, 1, "b", "x", "d"), prepare=True)
        cur.fetchone()
        conn.commit()

    variants = {"one_by_one": one_by_one, "pipeline": pipeline, "one_statement": one_statement}
    walls = {name: [] for name in variants}
    cpus = {name: [] for name in variants}
    names = list(variants)
    try:
        for f in variants.values():
            for _ in range(50):
                f()
        for r in range(rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                cpu = time.process_time()
                for _ in range(calls):
                    t = time.perf_counter_ns()
                    variants[name]()
                    walls[name].append((time.perf_counter_ns() - t) / 1e6)
                cpus[name].append((time.process_time() - cpu) / calls * 1e3)
    finally:
        conn.close()
    return {
        name: {"wall_p50": round(_p(walls[name], 0.5), 3), "cpu": round(statistics.median(cpus[name]), 3)}
        for name in variants
    }
