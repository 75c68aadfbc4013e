"""``python manage.py bench_serve``: the production serving model under load, in one run.

The server is ``python3 -m zeromem serve``'s (zeromem/serving.py: granian WSGI, ``--processes``
× ``--threads``, the pool sized per thread), started on loopback against ``DATABASE_URL``. For
each of

- ``GET /healthz`` (the framework's floor: middleware, a view, ``SELECT 1``),
- tool read (``POST /api/v1/tools/call`` ``memory_read``),
- tool write (``memory_write``, an update of one of the client's own keys),
- REST GET (``GET /api/v1/memories/<key>``)
- MCP read (``POST /mcp``, JSON-RPC ``tools/call`` ``memory_read``; not with ``granian-wsgi``)

it runs ``--seconds`` of back-to-back requests at 1 and at ``--clients`` keep-alive
connections (p50/p99, requests/s, server CPU per request), once idle and once while ``--slow``
requests of ``--slow-seconds`` each are in flight. Then it prints the ratios DESIGN.md's
quality bars and issue 11 ask for, and the new PostgreSQL connections per request.

The p50 ratios at one connection (read, write, REST GET, MCP read against ``/healthz``) are
taken **side by side**: first, for as long as the one-connection cells take together, one
connection sends every op in turn, in a fresh random order each round, so the machine's
noise hits each alike. The cells run one op after another, seconds apart, and on this shared
2-core host their p50s drift with its load (``/healthz`` 1.25–1.54 ms, a read 2.5–3.1 ms in
three runs of one hour); their ratios are printed too (``…_cells``).

A slow request is a real one, with no endpoint of its own: a ``memory_write`` of a key whose
row this command holds locked (``SELECT … FOR UPDATE`` on its own connection) and releases
``--slow-seconds`` later. While it waits, the request holds what any slow request holds — a
request thread and a pooled connection — and PostgreSQL shows it waiting on the lock, which
is how this command checks the slow requests are in flight before measuring.

The bench tenant (``bench-serve-<random>``) and its rows stay (audit rows are append-only);
its API key is revoked at the end. Every phase is bounded in time and in requests.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import secrets
import threading
import time
from collections.abc import Callable

import psycopg
from django.core.management.base import CommandError
from django.db import connection

from memories import services
from zeromem.bench.harness import (
    HttpClient,
    Samples,
    client_loop,
    interleaved_samples,
    loadavg,
    proc_cpu_seconds,
    ratio,
    round_robin,
    sigterm_unwinds,
)
from zeromem.bench.options import BenchCommand
from zeromem.bench.pgwatch import ConnWatch, settings_conninfo, warm_until_pools_settle
from zeromem.bench.server import running_server, tail
from zeromem.kernel.actors import Actor

TOOL_CALL = "/api/v1/tools/call"
OPS = {
    "healthz": "GET /healthz",
    "read": "POST /api/v1/tools/call memory_read",
    "write": "POST /api/v1/tools/call memory_write (update)",
    "rest_get": "GET /api/v1/memories/<key>",
    "mcp_read": "POST /mcp tools/call memory_read (MCP, stateless, JSON response)",
}
# Issue 11 "Done when" and DESIGN.md "Quality bars".
TARGETS = {
    "read_p50_vs_healthz_p50": ("≤", 1.5),
    "write_p50_vs_healthz_p50": ("≤", 2.0),
    "read_throughput_vs_healthz_throughput": ("≥", 0.5),
    "read_p99_with_slow_vs_idle": ("≤", 3.0),
}
SYSTEM = Actor.system(job="bench_serve")
# How Django is served (README "Serving"): granian's interface and zeromem/asgi.py's
# ZEROMEM_ASGI_DJANGO. `serve` runs the first; the others are there to compare against it.
DJANGO_MODES = {
    "bridge": ("asgi", "wsgi"),  # the ASGI router; Django's WSGI app through zeromem/kit/wsgi_bridge.py (production)
    # the same with every tool call through Django (ZEROMEM_TOOL_LANE=false: memories/api/lane.py)
    "bridge-nolane": ("asgi", "wsgi"),
    # the same with every write under the row lock (ZEROMEM_WRITE_WITHOUT_LOCK=false: session 22's write)
    "bridge-locked": ("asgi", "wsgi"),
    # the same on asyncio's event loop instead of uvloop's (GRANIAN_LOOP=asyncio: zeromem/serving.py event_loop)
    "bridge-asyncio": ("asgi", "wsgi"),
    "a2wsgi": ("asgi", "a2wsgi"),  # the ASGI router; Django's WSGI app through a2wsgi's responder
    "asgi": ("asgi", "asgi"),  # the ASGI router; Django's ASGIHandler
    "granian-wsgi": ("wsgi", None),  # Django alone, granian WSGI (no /mcp): the floor
}


def server_env(mode: str, django_mode: str | None) -> dict | None:
    env = {"ZEROMEM_ASGI_DJANGO": django_mode} if django_mode else {}
    if mode == "bridge-nolane":
        env["ZEROMEM_TOOL_LANE"] = "false"
    if mode == "bridge-locked":
        env["ZEROMEM_WRITE_WITHOUT_LOCK"] = "false"
    if mode == "bridge-asyncio":
        env["GRANIAN_LOOP"] = "asyncio"
    return env or None


class SlowRequests:
    """``n`` requests of ``seconds`` each, kept in flight: each slot locks its own key's row
    on its own connection, sends a ``memory_write`` of that key (which waits on the lock,
    holding a request thread and a pooled connection) and commits ``seconds`` later."""

    def __init__(
        self,
        *,
        lockers: list[psycopg.Connection],
        port: int,
        api_key: str,
        tenant_id: int,
        keys: list[str],
        seconds: float,
    ):
        self.port, self.api_key = port, api_key
        self.tenant_id, self.keys, self.seconds = tenant_id, keys, seconds
        self.stop_evt = threading.Event()
        self.durations: list[float] = []
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._slot, args=(key, conn), daemon=True)
            for key, conn in zip(keys, lockers, strict=True)
        ]

    def __enter__(self):
        for th in self.threads:
            th.start()
        return self

    def __exit__(self, *exc):
        self.stop_evt.set()
        for th in self.threads:
            th.join(timeout=self.seconds + 35)

    def _slot(self, key: str, conn: psycopg.Connection):
        body = json.dumps({"name": "memory_write", "arguments": {"key": key, "value": {"slow": True}}}).encode()
        client = HttpClient(self.port, self.api_key, timeout=self.seconds + 30)
        try:
            while not self.stop_evt.is_set():
                conn.execute(
                    "SELECT id FROM memories_memory WHERE tenant_id = %s AND key = %s AND deleted_at IS NULL "
                    "FOR UPDATE",
                    (self.tenant_id, key),
                )
                release = threading.Timer(self.seconds, conn.commit)
                release.start()
                try:
                    elapsed, status, data = client.request("POST", TOOL_CALL, body)
                finally:
                    release.join()
                with self.lock:
                    if status == 200:
                        self.durations.append(elapsed / 1e9)
                    else:
                        self.failures.append(f"{status} {data[:120]!r}")
        except (OSError, http.client.HTTPException, psycopg.Error) as exc:
            with self.lock:
                self.failures.append(repr(exc))
        finally:
            client.close()

    def wait_in_flight(self, watch: ConnWatch, timeout: float = 10.0) -> int:
        """How many backends wait on a row lock once all ``n`` do (or ``timeout`` passes)."""
        deadline = time.monotonic() + timeout
        waiting = 0
        while time.monotonic() < deadline:
            waiting = watch._one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )[0][0]
            if waiting >= len(self.keys):
                break
            time.sleep(0.05)
        return waiting


def wait_until_idle(pids: list[int], *, timeout: float = 90.0, cpu_per_second: float = 0.05) -> str:
    """Wait until the server's processes use less than ``cpu_per_second`` of CPU in a second
    with no requests (or ``timeout`` passes)."""
    deadline = time.monotonic() + timeout
    while True:
        before = sum(proc_cpu_seconds(p) or 0 for p in pids)
        time.sleep(1.0)
        used = sum(proc_cpu_seconds(p) or 0 for p in pids) - before
        if used < cpu_per_second:
            return f"{used:.3f} s of CPU in a quiet second"
        if time.monotonic() >= deadline:
            return f"still {used:.3f} s of CPU per quiet second after {timeout:.0f} s (measuring anyway)"


def commit_floor(conninfo: str, n: int = 200) -> dict:
    """What one synchronous commit costs on this database, beside a round trip: p50 of a
    one-row INSERT in autocommit (it waits for the WAL flush, as every audited call's commit
    does) and of ``SELECT 1`` (what ``/healthz`` sends), on one connection, no server."""
    table = "zeromem_bench_commit_probe"
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY, at timestamptz)")
        try:
            out = {}
            insert = f"INSERT INTO {table} (at) VALUES (now())"  # nosec B608
            for name, sql in (("select_1", "SELECT 1"), ("insert_commit", insert)):
                samples = []
                for _ in range(n):
                    t0 = time.perf_counter_ns()
                    conn.execute(sql)
                    samples.append(time.perf_counter_ns() - t0)
                samples.sort()
                out[f"{name}_p50_ms"] = round(samples[len(samples) // 2] / 1e6, 3)
            out["synchronous_commit"] = conn.execute("SHOW synchronous_commit").fetchone()[0]
            return out
        finally:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


class Command(BenchCommand):
    help = (
        "The production serving model (python3 -m zeromem serve) under load: /healthz, tool read, tool write "
        "and REST GET at 1 and N connections, idle and with slow requests in flight; issue 11's ratios and new "
        "DB connections per request. Needs DATABASE_URL=postgres://..."
    )

    shared_options = ("clients", "processes", "threads", "keys", "json", "seed")
    postgresql_needed = (
        "bench_serve measures the production serving model and needs PostgreSQL: set "
        "DATABASE_URL=postgres://user@127.0.0.1:5432/dbname (SQLite is not supported)."
    )

    def add_bench_arguments(self, parser):
        parser.add_argument("--seconds", type=float, default=5.0, help="length of each measured cell (5 s)")
        parser.add_argument("--slow", type=int, default=4, help="slow requests in flight in the slow phase (4)")
        parser.add_argument("--slow-seconds", type=float, default=2.0, help="length of each slow request (2 s)")
        parser.add_argument("--max-requests", type=int, default=200_000, help="request cap of each cell")
        parser.add_argument(
            "--django-modes",
            default="bridge",
            help=f"comma-separated, run one after the other and compared: {', '.join(DJANGO_MODES)} (bridge)",
        )

    def handle(self, *args, **opts):
        if not os.environ.get("DATABASE_URL"):
            raise CommandError(self.postgresql_needed)
        self.require_postgresql()
        if not 1 <= opts["clients"] <= 256 or not 1 <= opts["processes"] <= 32 or not 1 <= opts["threads"] <= 256:
            raise CommandError("--clients must be 1-256, --processes 1-32 and --threads 1-256")
        if not 0 < opts["seconds"] <= 120 or not 0 <= opts["slow"] <= 64 or not 0 < opts["slow_seconds"] <= 30:
            raise CommandError("keep 0 < --seconds ≤ 120, 0 ≤ --slow ≤ 64 and 0 < --slow-seconds ≤ 30")
        if opts["keys"] < opts["clients"]:
            raise CommandError("--keys must be at least --clients (each client writes keys of its own)")
        self.opts = opts
        self.conninfo = settings_conninfo()
        self.loadavg0 = loadavg()
        modes = [m.strip() for m in opts["django_modes"].split(",") if m.strip()]
        unknown = [m for m in modes if m not in DJANGO_MODES]
        if not modes or unknown:
            raise CommandError(f"--django-modes: each of {', '.join(DJANGO_MODES)}, not {unknown or modes}")
        self.setup_tenant()
        results = {}
        try:
            for mode in modes:
                results[mode] = self.run_mode(mode)
        finally:
            services.api_key_revoke(tenant=self.tenant, actor=SYSTEM, key_id=self.api_key.pk)
        if len(results) == 1:
            self.emit(results[modes[0]])
        else:
            self.emit({"modes": results})

    def run_mode(self, mode: str) -> dict:
        opts = self.opts
        interface, django_mode = DJANGO_MODES[mode]
        self.ops = [op for op in OPS if op != "mcp_read" or interface == "asgi"]
        connection.close()
        with (
            sigterm_unwinds(),
            running_server(
                stderr=self.stderr,
                database_url=os.environ["DATABASE_URL"],
                processes=opts["processes"],
                threads=opts["threads"],
                log=self.log,
                interface=interface,
                extra_env=server_env(mode, django_mode),
            ) as server,
            contextlib.closing(ConnWatch(self.conninfo, set())) as watch,
        ):
            try:
                result = self.run_all(server, watch)
            except (OSError, http.client.HTTPException) as exc:
                raise CommandError(
                    f"the benchmark failed talking to the server ({exc!r}); its log:\n{tail(server['log'])}"
                ) from exc
        result["config"]["django_mode"] = mode
        return result

    def setup_tenant(self):
        slug = f"bench-serve-{secrets.token_hex(4)}"
        self.tenant = services.tenant_create(actor=SYSTEM, slug=slug, name="bench_serve (throw-away)")
        self.api_key, self.raw_key = services.api_key_create(tenant=self.tenant, actor=SYSTEM, name="bench_serve")
        k = self.opts["keys"]
        self.read_keys = [f"fact:bench:r{i:05d}" for i in range(k)]
        self.write_keys = [f"fact:bench:w{i:05d}" for i in range(k)]
        self.slow_keys = [f"fact:bench:slow{i:02d}" for i in range(self.opts["slow"])]
        value = {"text": "prefers concise answers in English; timezone Europe/Berlin", "n": 0}
        for key in self.read_keys + self.write_keys + self.slow_keys:
            services.memory_write(tenant=self.tenant, actor=SYSTEM, key=key, value=value)
        self.log(f"tenant {slug}: {2 * k + len(self.slow_keys)} memories seeded")

    # ------------------------------------------------------------------ requests

    def step_for(self, op: str, client: HttpClient, t: int, clients: int) -> Callable[[], tuple[int, int, bytes]]:
        """Client ``t``'s next request of ``op`` (its own share of the keys)."""
        if op == "healthz":
            return lambda: client.request("GET", "/healthz")
        if op == "read":
            bodies = round_robin(
                [json.dumps({"name": "memory_read", "arguments": {"key": k}}).encode() for k in self.read_keys],
                t,
                clients,
            )
            return lambda: client.request("POST", TOOL_CALL, next(bodies))
        if op == "mcp_read":
            bodies = round_robin(
                [
                    json.dumps(
                        {
                            "jsonrpc": "2.0",
                            "id": i,
                            "method": "tools/call",
                            "params": {"name": "memory_read", "arguments": {"key": k}},
                        }
                    ).encode()
                    for i, k in enumerate(self.read_keys)
                ],
                t,
                clients,
            )
            return lambda: client.request("POST", "/mcp", next(bodies))
        if op == "rest_get":
            paths = round_robin([f"/api/v1/memories/{k}" for k in self.read_keys], t, clients)
            return lambda: client.request("GET", next(paths))
        keys, seq = round_robin(self.write_keys, t, clients), iter(range(10**9))

        def write():
            body = {"name": "memory_write", "arguments": {"key": next(keys), "value": {"n": next(seq), "c": t}}}
            return client.request("POST", TOOL_CALL, json.dumps(body).encode())

        return write

    def run_cell(self, op: str, clients: list[HttpClient], server: dict, seconds: float) -> dict:
        """``op`` from every client in ``clients`` for ``seconds``: latencies, throughput, CPU."""
        n = len(clients)
        samples = [Samples(op, OPS[op]) for _ in range(n)]

        def make_step(t: int):
            request, smp = self.step_for(op, clients[t], t, n), samples[t]

            def step():
                try:
                    elapsed, status, _ = request()
                except (OSError, http.client.HTTPException):
                    smp.errors += 1
                    return
                if status == 200:
                    smp.ns.append(elapsed)
                else:
                    smp.errors += 1

            return step

        pids = server["workers"]
        cpu0 = [proc_cpu_seconds(p) for p in pids]
        times = client_loop(
            clients=n,
            seconds=seconds,
            max_requests=self.opts["max_requests"],
            make_step=make_step,
            join_timeout=seconds + 60,
        )
        cpu1 = [proc_cpu_seconds(p) for p in pids]
        merged = Samples(op, OPS[op], [x for s in samples for x in s.ns], sum(s.errors for s in samples))
        summary = merged.summary()
        wall = times.last_end - times.started
        cpu = sum((b or 0) - (a or 0) for a, b in zip(cpu0, cpu1, strict=True))
        return {
            "n": summary["n"],
            "errors": summary["errors"],
            "p50_ms": summary["p50_ms"],
            "p99_ms": summary["p99_ms"],
            "requests_per_s": round(summary["n"] / wall, 1) if wall > 0 else 0.0,
            "server_cpu_ms_per_request": round(cpu * 1000 / summary["n"], 2) if summary["n"] else None,
        }

    def side_by_side(self, client: HttpClient, seconds: float) -> dict:
        """Every op on one connection, each in turn in a fresh random order per round, for
        ``seconds``: their p50s are taken over the same stretch of time."""

        def measured(step):
            def op(_i):
                try:
                    elapsed, status, _ = step()
                except (OSError, http.client.HTTPException):
                    return False, 0
                return status == 200, elapsed

            return op

        ops = {op: (OPS[op], measured(self.step_for(op, client, 0, 1))) for op in self.ops}
        samples = interleaved_samples(
            ops,
            iterations=max(1, self.opts["max_requests"] // len(ops)),
            warmup=20,
            max_seconds=seconds,
            rng=random.Random(self.opts["seed"]),
            log=self.log,
        )
        return {op: s.summary() for op, s in samples.items()}

    # ------------------------------------------------------------------ phases

    def run_all(self, server: dict, watch: ConnWatch) -> dict:
        opts = self.opts
        port, conc = server["port"], opts["clients"]
        clients = [HttpClient(port, self.raw_key) for _ in range(conc)]
        # The slow requests' lock holders: opened before the watch starts, and not counted.
        lockers = [psycopg.connect(self.conninfo, autocommit=False) for _ in self.slow_keys]
        watch.exclude |= {conn.info.backend_pid for conn in lockers}
        try:
            for c in clients:
                c.request("GET", "/healthz")
            # Until the processes' pools stop growing (they start with a connection per thread);
            # every op, so no first cell pays for a first call (or the embedding model's load).
            warm = warm_until_pools_settle(
                watch, lambda i: [self.run_cell(op, clients, server, 1.0) for op in self.ops]
            )
            self.log(f"warm-up rounds opened {warm} connections")
            # Each server process loads the embedding model in the background at start (a few
            # seconds of CPU, longer on a busy machine): measuring before it is done put that
            # CPU into the first cells (/healthz at 1 connection: p50 ×20 in some runs).
            idle = wait_until_idle(server["workers"])
            self.log(f"server idle: {idle}")
            watch.start()
            cells: dict = {"idle": {}, "slow": {}}
            self.log(f"  every op at 1 connection side by side, {opts['seconds'] * len(self.ops):.0f} s")
            cells["side_by_side"] = self.side_by_side(clients[0], opts["seconds"] * len(self.ops))
            requests = sum(x["n"] + x["errors"] for x in cells["side_by_side"].values())
            slow_stats = {"in_flight_seen": [], "durations_s": [], "failures": []}
            for n in (1, conc):
                for op in self.ops:
                    self.log(f"  {op} at {n} connection(s): idle, then {opts['slow']} slow requests in flight")
                    cells["idle"][f"{op}@{n}"] = cell = self.run_cell(op, clients[:n], server, opts["seconds"])
                    requests += cell["n"] + cell["errors"]
                    with SlowRequests(
                        lockers=lockers,
                        port=port,
                        api_key=self.raw_key,
                        tenant_id=self.tenant.pk,
                        keys=self.slow_keys,
                        seconds=opts["slow_seconds"],
                    ) as slow:
                        slow_stats["in_flight_seen"].append(slow.wait_in_flight(watch))
                        cells["slow"][f"{op}@{n}"] = cell = self.run_cell(op, clients[:n], server, opts["seconds"])
                        requests += cell["n"] + cell["errors"]
                    slow_stats["durations_s"] += slow.durations
                    slow_stats["failures"] += slow.failures
            conns = watch.stop()
        finally:
            for c in clients:
                c.close()
            for conn in lockers:
                conn.close()
        return self.result(server, cells, conns, requests, warm, slow_stats)

    def result(self, server, cells, conns, requests, warm, slow_stats) -> dict:
        conc = self.opts["clients"]
        idle, slow, sbs = cells["idle"], cells["slow"], cells["side_by_side"]
        new = max(conns["new_sessions_pg_stat_database"], conns["new_backends_seen_pg_stat_activity"])

        def p50s(op: str, over: str = "healthz") -> dict:
            # Side by side (the ratio the bars read), and from the cells, one after the other.
            return {
                f"{op}_p50_vs_{over}_p50": ratio(sbs[op]["p50_ms"], sbs[over]["p50_ms"]),
                f"{op}_p50_vs_{over}_p50_cells": ratio(idle[f"{op}@1"]["p50_ms"], idle[f"{over}@1"]["p50_ms"]),
            }

        ratios = {
            **p50s("read"),
            **p50s("write"),
            **p50s("rest_get"),
            "read_throughput_vs_healthz_throughput": ratio(
                idle[f"read@{conc}"]["requests_per_s"], idle[f"healthz@{conc}"]["requests_per_s"]
            ),
            "read_p99_with_slow_vs_idle": ratio(slow[f"read@{conc}"]["p99_ms"], idle[f"read@{conc}"]["p99_ms"]),
            "read_p99_with_slow_vs_idle_1_connection": ratio(slow["read@1"]["p99_ms"], idle["read@1"]["p99_ms"]),
        }
        if "mcp_read@1" in idle:
            ratios |= p50s("mcp_read") | p50s("mcp_read", over="read")
        targets = {}
        for name, (sense, bound) in TARGETS.items():
            value = ratios[name]
            ok = value is not None and (value <= bound if sense == "≤" else value >= bound)
            targets[name] = {"target": f"{sense} {bound}", "value": value, "ok": ok}
        targets["new_db_connections_per_request"] = {
            "target": "0",
            "value": round(new / requests, 4) if requests else None,
            "ok": new == 0,
        }
        durations = sorted(slow_stats["durations_s"])
        with psycopg.connect(self.conninfo) as conn:
            pg_version = conn.execute("SHOW server_version").fetchone()[0]
        floor = commit_floor(self.conninfo)
        return {
            "config": {
                "server": " ".join(server["cmd"][2:]),
                "db_pool_per_process": server["pool"],
                "postgresql": pg_version,
                "clients": conc,
                "seconds_per_cell": self.opts["seconds"],
                "slow": self.opts["slow"],
                "slow_seconds": self.opts["slow_seconds"],
                "cpus": os.cpu_count(),
                "loadavg_at_start": self.loadavg0,
                "loadavg_at_end": loadavg(),
                "tenant": self.tenant.slug,
            },
            "cells": cells,
            "slow_requests": {
                "in_flight_before_each_slow_cell": slow_stats["in_flight_seen"],
                "completed": len(durations),
                "seconds_min_max": [round(durations[0], 2), round(durations[-1], 2)] if durations else None,
                "failures": slow_stats["failures"][:10],
            },
            "ratios": ratios,
            "targets": targets,
            "commit_floor": floor,
            "connections": {**conns, "requests": requests, "warmup_new_sessions_per_round": warm},
        }

    # ------------------------------------------------------------------ output

    def print_table(self, r: dict):
        if "modes" in r:
            for one in r["modes"].values():
                self.print_table(one)
            self.print_modes(r["modes"])
            return
        w = self.stdout.write
        c = r["config"]
        w("")
        w(f"ZeroMem bench_serve — one run on PostgreSQL {c['postgresql']}, Django served as {c['django_mode']}")
        w(f"  server   {c['server']}")
        w(f"  db pool  {c['db_pool_per_process']} per process")
        w(
            f"  machine  {c['cpus']} CPUs, load average {c['loadavg_at_start'][0]} at start, "
            f"{c['loadavg_at_end'][0]} at end (other work on the machine skews absolute figures; ratios hold better)"
        )
        w(
            f"  cells    {c['seconds_per_cell']} s each; slow phase: {c['slow']} requests of {c['slow_seconds']} s "
            "in flight (memory_write waiting on a row lock: a thread and a pooled connection each)"
        )
        w("")
        head = f"{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}{'cpu ms':>8}{'err':>5}"
        w(f"  {'':<18}{'idle':^40}|{'with slow requests in flight':^40}")
        w(f"  {'op @ connections':<18}{head}   |{head}")
        for name in r["cells"]["idle"]:
            line = f"  {name:<18}"
            for phase in ("idle", "slow"):
                x = r["cells"][phase][name]
                cpu = "-" if x["server_cpu_ms_per_request"] is None else f"{x['server_cpu_ms_per_request']:.2f}"
                line += f"{x['p50_ms']:>9.2f}{x['p99_ms']:>9.2f}{x['requests_per_s']:>9.1f}{cpu:>8}{x['errors']:>5}"
                line += "   |" if phase == "idle" else ""
            w(line)
        s = r["slow_requests"]
        w(
            f"  slow requests: {s['completed']} completed, {s['seconds_min_max']} s; waiting on the lock before each "
            f"slow cell: {s['in_flight_before_each_slow_cell']}; failures {len(s['failures'])}"
        )
        cn = r["connections"]
        w(
            f"  new DB connections while measuring: {cn['new_sessions_pg_stat_database']} sessions, "
            f"{cn['new_backends_seen_pg_stat_activity']} backends seen, for {cn['requests']} requests "
            f"(warm-up rounds opened {cn['warmup_new_sessions_per_round']})"
        )
        sbs = r["cells"]["side_by_side"]
        w("")
        w(
            f"  side by side at 1 connection (every op in turn, random order, {max(x['n'] for x in sbs.values())} "
            "rounds; the p50 ratios below are these)"
        )
        for name, x in sbs.items():
            w(f"  {name:<18}{x['p50_ms']:>9.2f}{x['p99_ms']:>9.2f}{'':>9}{'':>8}{x['errors']:>5}")
        w("")
        w("  ratios (issue 11 'Done when', DESIGN.md 'Quality bars')")
        for name, x in r["targets"].items():
            w(f"    {name:<42}{str(x['value']):>8}   {x['target']:<6} {'PASS' if x['ok'] else 'MISS'}")
        extra = {k: v for k, v in r["ratios"].items() if k not in r["targets"]}
        w(f"    also: {extra}")
        f = r["commit_floor"]
        h50 = r["cells"]["side_by_side"]["healthz"]["p50_ms"]
        w(
            f"  the floor of an audited call: one synchronous commit (a one-row INSERT in autocommit, psycopg, "
            f"no server) p50 {f['insert_commit_p50_ms']} ms vs SELECT 1 p50 {f['select_1_p50_ms']} ms on this "
            f"database; with /healthz's p50 that alone makes a read ≥ "
            f"{ratio(h50 + f['insert_commit_p50_ms'], h50)}"
            "× /healthz"
        )
        w(f"  tenant {c['tenant']} and its rows stay in the database; its API key is revoked.")

    def print_modes(self, modes: dict):
        """The ways of serving Django side by side (README "Serving"): p50 at one connection,
        server CPU per request and requests/s at ``--clients`` connections (idle phase)."""
        w = self.stdout.write
        conc = self.opts["clients"]
        ops = ("healthz", "read", "write", "mcp_read")
        w("")
        w("  Django served as … (same run, same tenant, one after the other; idle phase)")
        w(
            f"  {'mode':<14}"
            + "".join(f"{f'{op} p50@1':>15}" for op in ops)
            + f"{'read/healthz':>13}"
            + f"{'write/healthz':>14}"
            + "".join(f"{f'{op} cpu@{conc}':>16}" for op in ops)
            + "".join(f"{f'{op} r/s@{conc}':>16}" for op in ops)
        )

        def cell(idle: dict, op: str, n: int, field: str) -> str:
            x = idle.get(f"{op}@{n}")
            return "-" if x is None or x[field] is None else f"{x[field]:.2f}"

        for mode, r in modes.items():
            idle = r["cells"]["idle"]
            w(
                f"  {mode:<14}"
                + "".join(f"{cell(idle, op, 1, 'p50_ms'):>15}" for op in ops)
                + f"{str(r['ratios']['read_p50_vs_healthz_p50']):>13}"
                + f"{str(r['ratios']['write_p50_vs_healthz_p50']):>14}"
                + "".join(f"{cell(idle, op, conc, 'server_cpu_ms_per_request'):>16}" for op in ops)
                + "".join(f"{cell(idle, op, conc, 'requests_per_s'):>16}" for op in ops)
            )
