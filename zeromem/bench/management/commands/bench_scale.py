"""``python manage.py bench_scale``: does the web tier scale out? One run, side by side.

The same load — ``--clients`` keep-alive connections sending back-to-back ``GET /healthz``,
tool reads and tool writes for ``--seconds`` each (bench_serve's requests) — against, on the
same database:

- ``1 process``: one ``python3 -m zeromem serve --processes 1`` server;
- ``2 processes``: one server with ``--processes 2``;
- ``2 instances``: two servers of one process each, started separately (the fleet's shape:
  no state shared but through PostgreSQL / Redis), the clients split between them.

It prints requests/s, p50/p99 and the server CPU per request of each, and the scaling ratios
(2 processes ÷ 1, 2 instances ÷ 1). Set ``REDIS_URL`` to count rate limits in Redis, or
point ``DATABASE_URL`` at PgBouncer with ``ZEROMEM_PGBOUNCER=true`` to measure through it: the
servers get the same environment. On a machine with few cores the load generator (and any
other work) competes with the servers for CPU: the ratios then say little, the server CPU per
request (the same for 1 and 2 processes when nothing is contended) still does.
"""

from __future__ import annotations

import http.client
import os

from django.core.management.base import CommandError
from django.db import connection

from memories import services
from zeromem.bench.harness import HttpClient, loadavg, ratio, sigterm_unwinds
from zeromem.bench.management.commands import bench_serve
from zeromem.bench.server import start_server, stop_server, tail

OPS = ("healthz", "read", "write")
SHAPES = {"1 process": (1, 1), "2 processes": (1, 2), "2 instances": (2, 1)}  # (servers, processes each)


class Command(bench_serve.Command):
    help = (
        "Throughput of 1 web process vs 2 (one server with 2 processes, and 2 separate servers of 1) on the "
        "same database: requests/s, p50/p99, CPU per request and the scaling ratios. Needs DATABASE_URL=postgres://..."
    )
    shared_options = ("clients", "threads", "keys", "json", "seed")
    postgresql_needed = (
        "bench_scale measures the production serving model and needs PostgreSQL: set "
        "DATABASE_URL=postgres://user@127.0.0.1:5432/dbname (SQLite is not supported)."
    )

    def add_bench_arguments(self, parser):
        parser.add_argument("--seconds", type=float, default=5.0, help="length of each measured cell (5 s)")
        parser.add_argument("--max-requests", type=int, default=200_000, help="request cap of each cell")

    def handle(self, *args, **opts):
        if not os.environ.get("DATABASE_URL"):
            raise CommandError(self.postgresql_needed)
        self.require_postgresql()
        if not 2 <= opts["clients"] <= 256 or not 1 <= opts["threads"] <= 256 or not 0 < opts["seconds"] <= 120:
            raise CommandError("--clients must be 2-256, --threads 1-256 and 0 < --seconds ≤ 120")
        if opts["keys"] < opts["clients"]:
            raise CommandError("--keys must be at least --clients (each client writes keys of its own)")
        self.opts = {**opts, "slow": 0}
        self.loadavg0 = loadavg()
        self.setup_tenant()
        results = {}
        try:
            connection.close()
            with sigterm_unwinds():
                for shape, (servers, processes) in SHAPES.items():
                    self.log(f"{shape}: {servers} server(s) × {processes} process(es) × {opts['threads']} threads")
                    results[shape] = self.run_shape(servers, processes)
        finally:
            services.api_key_revoke(tenant=self.tenant, actor=bench_serve.SYSTEM, key_id=self.api_key.pk)
        self.emit(self.result(results))

    def run_shape(self, servers: int, processes: int) -> dict:
        started = []
        try:
            for _ in range(servers):
                started.append(
                    start_server(
                        database_url=os.environ["DATABASE_URL"],
                        processes=processes,
                        threads=self.opts["threads"],
                        log=self.log,
                    )
                )
            ports = [s["port"] for s in started]
            merged = {"workers": [pid for s in started for pid in s["workers"]]}
            clients = [HttpClient(ports[i % len(ports)], self.raw_key) for i in range(self.opts["clients"])]
            try:
                for c in clients:
                    c.request("GET", "/healthz")
                for op in ("read", "write"):  # warm: pools filled, code paths loaded
                    self.run_cell(op, clients, merged, 1.0)
                return {op: self.run_cell(op, clients, merged, self.opts["seconds"]) for op in OPS}
            except (OSError, http.client.HTTPException) as exc:
                raise CommandError(f"the benchmark failed ({exc!r}); a server log:\n{tail(started[0]['log'])}") from exc
            finally:
                for c in clients:
                    c.close()
        finally:
            for server in started:
                stop_server(server)
                if os.path.exists(server["log"]):
                    os.unlink(server["log"])

    def result(self, results: dict) -> dict:
        one = results["1 process"]
        scaling = {
            f"{op} {shape} ÷ 1 process": ratio(results[shape][op]["requests_per_s"], one[op]["requests_per_s"])
            for shape in ("2 processes", "2 instances")
            for op in OPS
        }
        return {
            "config": {
                "clients": self.opts["clients"],
                "threads_per_process": self.opts["threads"],
                "seconds_per_cell": self.opts["seconds"],
                "cpus": os.cpu_count(),
                "loadavg_at_start": self.loadavg0,
                "loadavg_at_end": loadavg(),
                "redis": bool(os.environ.get("REDIS_URL")),
                "pgbouncer": os.environ.get("ZEROMEM_PGBOUNCER", "") in ("1", "true", "True", "yes"),
                "tenant": self.tenant.slug,
            },
            "cells": results,
            "scaling": scaling,
        }

    def print_table(self, r: dict):
        w = self.stdout.write
        c = r["config"]
        w("")
        w(
            f"ZeroMem bench_scale — {c['clients']} keep-alive clients, {c['threads_per_process']} threads per process, "
            f"{c['seconds_per_cell']} s per cell; redis={c['redis']} pgbouncer={c['pgbouncer']}"
        )
        w(
            f"  machine  {c['cpus']} CPUs, load average {c['loadavg_at_start'][0]} at start, {c['loadavg_at_end'][0]} "
            "at end (the load generator and any other work share the machine: on a busy one compare the CPU "
            "per request, not the ratios)"
        )
        w("")
        w(f"  {'shape':<14}{'op':<9}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'cpu ms':>8}{'err':>5}")
        for shape, cells in r["cells"].items():
            for op, x in cells.items():
                cpu = "-" if x["server_cpu_ms_per_request"] is None else f"{x['server_cpu_ms_per_request']:.2f}"
                w(
                    f"  {shape:<14}{op:<9}{x['requests_per_s']:>9.1f}{x['p50_ms']:>9.2f}{x['p99_ms']:>9.2f}"
                    f"{cpu:>8}{x['errors']:>5}"
                )
        w("")
        w("  scaling (requests/s ratio)")
        for name, value in r["scaling"].items():
            w(f"    {name:<36}{value}")
        w(f"  tenant {c['tenant']} and its rows stay in the database; its API key is revoked.")
