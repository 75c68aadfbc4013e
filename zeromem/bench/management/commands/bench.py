"""``python manage.py bench``: ZeroMem over HTTP beside the same statements run raw.

From ONE run on PostgreSQL it prints, side by side:

a) ``memory_read`` through ``POST /api/v1/tools/call`` vs the same audited read as raw
   psycopg statements (SELECT the live row by (tenant, key), the access-counter UPDATE,
   INSERT into audit_auditevent, COMMIT): p50/p95/p99 and HTTP/raw ratios;
b) ``memory_write`` through HTTP vs its raw statements (SELECT ... FOR UPDATE, UPDATE
   memories_memory, INSERT memories_memoryversion, INSERT audit_auditevent, one COMMIT);
c) the audit insert's cost: raw SELECT+COMMIT vs SELECT+audit INSERT+COMMIT (and the full
   read with and without the audit INSERT), with a raw primary-key SELECT for scale;
d) audited HTTP reads/s from ``--concurrency`` keep-alive clients, and how many PostgreSQL
   connections were opened while that ran (the goal: none per request).

The server is started here, as in production: ``python3 -m zeromem serve``'s server
(zeromem/serving.py: granian WSGI, ``--processes`` × ``--threads``) on 127.0.0.1, with
``ZEROMEM_ENV=development DEBUG=false``, the same ``DATABASE_URL`` (so the same psycopg pool
settings) and a rate limit high enough not to interfere. It is always stopped at the end.
Latency samples are taken by one client, HTTP and raw operations shuffled within every
iteration so that machine noise hits both alike; every loop is bounded in count and in time.

The bench tenant (``bench-<random>``), its memories and their audit events stay in the
database (audit rows are append-only); its API key is revoked at the end.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import secrets
import time
import uuid

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection

from memories import search, services
from memories.models import Memory
from zeromem.bench.harness import (
    CLK_TCK,
    HttpClient,
    Samples,
    client_loop,
    cpu_busy_pct,
    interleaved_samples,
    loadavg,
    machine_cpu,
    percentiles,
    proc_cpu_seconds,
    ratio,
    round_robin,
    sigterm_unwinds,
)
from zeromem.bench.options import BenchCommand
from zeromem.bench.pgwatch import ConnWatch, connections_text, settings_conninfo, warm_until_pools_settle
from zeromem.bench.raw_sql import RawSQL
from zeromem.bench.server import running_server, tail
from zeromem.kernel.actors import Actor

# Design targets (DESIGN.md, "Quality bars").
TARGET_READ_P50 = 2.5
TARGET_READ_P99 = 4.0
TARGET_WRITE_P50 = 2.5
TARGET_AUDIT = 1.3
TARGET_RPS = 1500


# --- the command ------------------------------------------------------------------------


class Command(BenchCommand):
    help = (
        "Benchmark memory_read/memory_write over HTTP (the production server, started here) against the same "
        "statements run raw with psycopg, the audit insert's cost, and concurrent throughput. "
        "Needs DATABASE_URL=postgres://..."
    )

    shared_options = ("n", "concurrency", "json", "processes", "threads", "keys", "max_seconds", "seed")
    postgresql_needed = (
        "bench measures the production shape and needs PostgreSQL: set "
        "DATABASE_URL=postgres://user@127.0.0.1:5432/dbname (SQLite is not supported)."
    )

    def add_bench_arguments(self, parser):
        parser.add_argument("--port", type=int, default=0, help="server port on 127.0.0.1 (default: a free one)")
        parser.add_argument("--warmup", type=int, default=300, help="warm-up iterations before measuring (300)")
        parser.add_argument("--tput-seconds", type=float, default=10.0, help="throughput phase length cap (10 s)")
        parser.add_argument("--tput-requests", type=int, default=50000, help="throughput phase request cap (50000)")
        parser.add_argument(
            "--raw-binding",
            choices=["server", "client"],
            default="server",
            help="raw psycopg parameter binding: server (default; prepared after 5 runs) or client "
            "(literals inlined, as Django's default cursor does)",
        )
        parser.add_argument("--access-log", action="store_true", help="turn the server's access log on")

    # ------------------------------------------------------------------ entry point

    def handle(self, *args, **opts):
        if not os.environ.get("DATABASE_URL"):
            raise CommandError(self.postgresql_needed)
        self.require_postgresql()
        for name in ("n", "concurrency", "processes", "threads", "keys"):
            if opts[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be at least 1")
        if opts["n"] > 1_000_000 or opts["concurrency"] > 256 or opts["tput_seconds"] > 600:
            raise CommandError("keep --n ≤ 1e6, --concurrency ≤ 256 and --tput-seconds ≤ 600")
        self.opts = opts
        self.rng = random.Random(opts["seed"])

        db = settings.DATABASES["default"]
        self.conninfo = settings_conninfo()
        host = db.get("HOST") or ""
        if host and host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("/"):
            self.log(f"note: the database host is {host}, not loopback; figures include that network.")

        self.loadavg0 = loadavg()
        self.setup_tenant()
        try:
            with (
                sigterm_unwinds(),
                contextlib.closing(
                    RawSQL(
                        self.conninfo,
                        client_binding=opts["raw_binding"] == "client",
                        tenant_id=self.tenant.pk,
                        key_id=self.api_key.pk,
                        key_label=self.api_key.display_prefix,
                    )
                ) as raw,
            ):
                self.release_django_connections()
                with (
                    running_server(
                        stderr=self.stderr,
                        database_url=os.environ["DATABASE_URL"],
                        processes=opts["processes"],
                        threads=opts["threads"],
                        port=opts["port"],
                        access_log=opts["access_log"],
                        log=self.log,
                    ) as server,
                    contextlib.closing(ConnWatch(self.conninfo, raw.backend_pids())) as watch,
                ):
                    try:
                        result = self.run_all(raw, watch, server)
                    except (OSError, http.client.HTTPException) as exc:
                        raise CommandError(
                            f"the benchmark failed talking to the server ({exc!r}); its log:\n{tail(server['log'])}"
                        ) from exc
        finally:
            self.revoke_key()
        self.emit(result)

    # ------------------------------------------------------------------ setup

    def setup_tenant(self):
        actor = Actor.system(job="bench")
        slug = f"bench-{secrets.token_hex(4)}"
        self.tenant = services.tenant_create(actor=actor, slug=slug, name="bench (throw-away)")
        self.api_key, self.raw_key = services.api_key_create(tenant=self.tenant, actor=actor, name="bench")
        k = self.opts["keys"]
        self.read_keys = [f"fact:bench:r{i:05d}" for i in range(k)]
        self.write_keys = [f"fact:bench:w{i:05d}" for i in range(k)]
        base = {"text": "prefers concise answers in English; timezone Europe/Berlin", "n": 0}
        for key in self.read_keys + self.write_keys:
            services.memory_write(tenant=self.tenant, actor=actor, key=key, value=base)
        self.read_ids = dict(Memory.objects.filter(tenant=self.tenant, key__in=self.read_keys).values_list("key", "id"))
        self.read_bodies = {
            key: json.dumps({"name": "memory_read", "arguments": {"key": key}}).encode() for key in self.read_keys
        }
        # Write payloads, and what the service stores beside them (computed outside the timers).
        self.write_values = [{"text": "prefers concise answers; updated", "n": i} for i in range(64)]
        self.write_search = [
            {key: search.index_fields(tenant_id=self.tenant.pk, key=key, value=v, tags=[]) for key in self.write_keys}
            for v in self.write_values
        ]
        self.log(f"tenant {slug}: {2 * k} memories seeded")

    def release_django_connections(self):
        # This process keeps no server-side session open beyond the raw/watch connections.
        connection.close()
        close_pool = getattr(connection, "close_pool", None)
        if close_pool is not None:
            close_pool()

    def revoke_key(self):
        try:
            services.api_key_revoke(tenant=self.tenant, actor=Actor.system(job="bench"), key_id=self.api_key.pk)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            self.stderr.write(f"could not revoke the bench key: {exc}")

    # ------------------------------------------------------------------ phases

    def run_all(self, raw: RawSQL, watch: ConnWatch, server: dict) -> dict:
        opts = self.opts
        pg_version = raw.ac.execute("SHOW server_version").fetchone()[0]

        self.log(f"phase 1/3: reads, {opts['n']} iterations (+{opts['warmup']} warm-up)")
        reads = self.phase_reads(raw, server["port"], on_measure=watch.start)
        read_conns = watch.stop()
        self.log("phase 2/3: writes")
        writes = self.phase_writes(raw, server["port"])
        self.log(f"phase 3/3: throughput, {opts['concurrency']} clients")
        tput = self.phase_throughput(watch, server)

        s = {name: smp.summary() for name, smp in {**reads, **writes}.items()}

        def p(name, q):
            return s[name][f"p{q}_ms"]

        ratios = {
            "read_http_vs_raw_p50": ratio(p("http_read", 50), p("raw_read", 50)),
            "read_http_vs_raw_p95": ratio(p("http_read", 95), p("raw_read", 95)),
            "read_http_vs_raw_p99": ratio(p("http_read", 99), p("raw_read", 99)),
            "write_http_vs_raw_p50": ratio(p("http_write", 50), p("raw_write", 50)),
            "write_http_vs_raw_p95": ratio(p("http_write", 95), p("raw_write", 95)),
            "write_http_vs_raw_p99": ratio(p("http_write", 99), p("raw_write", 99)),
            "write_idempotency_key_vs_plain_p50": ratio(p("http_write_idem", 50), p("http_write", 50)),
            "write_replay_vs_plain_p50": ratio(p("http_write_replay", 50), p("http_write", 50)),
            "audit_select_audit_commit_vs_select_commit_p50": ratio(
                p("raw_select_audit_commit", 50), p("raw_select_commit", 50)
            ),
            "audit_raw_read_vs_raw_read_without_audit_p50": ratio(p("raw_read", 50), p("raw_read_no_audit", 50)),
            "counter_raw_read_vs_raw_read_without_counter_p50": ratio(p("raw_read", 50), p("raw_read_no_counter", 50)),
            "read_http_vs_healthz_p50": ratio(p("http_read", 50), p("http_healthz", 50)),
        }
        targets = {
            "read_p50": _at_most(ratios["read_http_vs_raw_p50"], TARGET_READ_P50),
            "read_p99": _at_most(ratios["read_http_vs_raw_p99"], TARGET_READ_P99),
            "write_p50": _at_most(ratios["write_http_vs_raw_p50"], TARGET_WRITE_P50),
            "audit_raw_p50": _at_most(
                ratios["audit_raw_read_vs_raw_read_without_audit_p50"], TARGET_AUDIT, " (raw SQL proxy)"
            ),
            "throughput": {
                "target": f"≥ {TARGET_RPS}/s at 16 clients, 0 new DB connections",
                "value": tput["requests_per_s"],
                "ok": tput["requests_per_s"] >= TARGET_RPS
                and tput["connections"]["new_sessions_pg_stat_database"] == 0
                and tput["connections"]["new_backends_seen_pg_stat_activity"] == 0,
            },
        }
        return {
            "config": {
                "n": opts["n"],
                "warmup": opts["warmup"],
                "keys": opts["keys"],
                "concurrency": opts["concurrency"],
                "processes": opts["processes"],
                "threads": opts["threads"],
                "port": server["port"],
                "server": " ".join(server["cmd"][2:]),
                "cache": settings.CACHES["default"]["BACKEND"].rsplit(".", 1)[-1]
                + (" (REDIS_URL)" if os.environ.get("REDIS_URL") else ""),
                "db_pool": server["pool"],
                "postgresql": pg_version,
                "raw_binding": opts["raw_binding"],
                "cpus": os.cpu_count(),
                "tenant": self.tenant.slug,
                "loadavg_at_start": self.loadavg0,
                "loadavg_at_end": loadavg(),
            },
            "latency": s,
            "ratios": ratios,
            "targets": targets,
            "throughput": tput,
            "connections_during_latency_phase_1": read_conns,
            "http_reconnects": self.reconnects,
            "warnings": self._warnings(s),
            "note": f"tenant {self.tenant.slug} and its rows (memories, versions, append-only audit events) "
            "are left in the database; its API key is revoked.",
        }

    def _warnings(self, latency: dict) -> list[str]:
        out = []
        if _nagle_suspected(latency):
            out.append(
                "GET /healthz takes ≥ 30 ms: the ~40 ms delayed-ACK stall of a server that does not set "
                "TCP_NODELAY on accepted connections (the response's header and body segments wait for the "
                "client's delayed ACK; see zeromem/server.py)."
            )
        return out

    def _run_interleaved(self, ops: dict, on_measure=None) -> dict[str, Samples]:
        opts = self.opts
        return interleaved_samples(
            ops,
            iterations=opts["n"],
            warmup=opts["warmup"],
            max_seconds=opts["max_seconds"],
            rng=self.rng,
            log=self.log,
            on_measure=on_measure,
        )

    def phase_reads(self, raw: RawSQL, port: int, on_measure=None) -> dict[str, Samples]:
        client = HttpClient(port, self.raw_key)
        keys = self.read_keys
        nk = len(keys)

        def http_read(i):
            key = keys[i % nk]
            elapsed, status, body = client.request("POST", "/api/v1/tools/call", self.read_bodies[key])
            return status == 200 and json.loads(body).get("status") == "ok", elapsed

        def http_healthz(i):
            elapsed, status, _ = client.request("GET", "/healthz")
            return status == 200, elapsed

        ops = {
            "http_read": ("POST /api/v1/tools/call memory_read", http_read),
            "raw_read": ("SELECT + counter UPDATE + audit INSERT + COMMIT", lambda i: (True, raw.read(keys[i % nk]))),
            "raw_read_no_audit": (
                "SELECT + counter UPDATE + COMMIT",
                lambda i: (True, raw.read(keys[i % nk], audit=False)),
            ),
            "raw_read_no_counter": (
                "SELECT + audit INSERT + COMMIT",
                lambda i: (True, raw.read(keys[i % nk], counter=False)),
            ),
            "raw_select_commit": (
                "SELECT + COMMIT",
                lambda i: (True, raw.read(keys[i % nk], counter=False, audit=False)),
            ),
            "raw_pk_select": (
                "SELECT by primary key (autocommit)",
                lambda i: (True, raw.pk_select(self.read_ids[keys[i % nk]])),
            ),
            "http_healthz": ("GET /healthz (Django view, SELECT 1)", http_healthz),
        }
        try:
            out = self._run_interleaved(ops, on_measure)
        finally:
            self.reconnects = client.reconnects
            client.close()
        # The same measurement under the name the audit comparison uses.
        out["raw_select_audit_commit"] = Samples(
            "raw_select_audit_commit",
            "SELECT + audit INSERT + COMMIT",
            out["raw_read_no_counter"].ns,
            out["raw_read_no_counter"].errors,
        )
        return out

    def phase_writes(self, raw: RawSQL, port: int) -> dict[str, Samples]:
        client = HttpClient(port, self.raw_key)
        keys = self.write_keys
        nk, nv = len(keys), len(self.write_values)

        def http_write(i):
            key, value = keys[i % nk], self.write_values[i % nv]
            body = json.dumps({"name": "memory_write", "arguments": {"key": key, "value": value}}).encode()
            elapsed, status, data = client.request("POST", "/api/v1/tools/call", body)
            return status == 200 and json.loads(data).get("status") == "ok", elapsed

        def raw_write(i):
            key, j = keys[(i + nk // 2) % nk], i % nv
            return True, raw.write(key, self.write_values[j], self.write_search[j][key])

        run = uuid.uuid4().hex[:8]

        def http_write_idempotent(i):
            # A fresh Idempotency-Key: claimed (INSERT) before the write, answer stored (UPDATE) after.
            key, value = keys[(i + nk // 3) % nk], self.write_values[i % nv]
            body = json.dumps({"name": "memory_write", "arguments": {"key": key, "value": value}}).encode()
            headers = {"Idempotency-Key": f"bench-{run}-{i}"}
            elapsed, status, data = client.request("POST", "/api/v1/tools/call", body, headers)
            return status == 200 and json.loads(data).get("status") == "ok", elapsed

        def http_write_replayed(i):
            # 20 keys, each written once in the warm-up: every measured call is a replay.
            n = i % 20
            body = json.dumps({"name": "memory_write", "arguments": {"key": keys[n], "value": n}}).encode()
            headers = {"Idempotency-Key": f"bench-{run}-replay-{n}"}
            elapsed, status, data = client.request("POST", "/api/v1/tools/call", body, headers)
            return status == 200 and json.loads(data).get("status") == "ok", elapsed

        ops = {
            "http_write": ("POST /api/v1/tools/call memory_write (update)", http_write),
            "http_write_idem": ("the same with a fresh Idempotency-Key", http_write_idempotent),
            "http_write_replay": ("a retry: the same call and Idempotency-Key, replayed", http_write_replayed),
            "raw_write": ("SELECT FOR UPDATE + UPDATE + version INSERT + audit INSERT + COMMIT", raw_write),
        }
        try:
            return self._run_interleaved(ops)
        finally:
            self.reconnects += client.reconnects
            client.close()

    def phase_throughput(self, watch: ConnWatch, server: dict) -> dict:
        opts = self.opts
        conc, port = opts["concurrency"], server["port"]

        # The same keep-alive connections for the warm-up and the measured run: a worker's
        # share of the clients (hence the size its pool settles at) is fixed when they connect.
        clients = [HttpClient(port, self.raw_key) for _ in range(conc)]
        for client in clients:
            client.request("GET", "/healthz")

        def run(seconds: float, max_requests: int) -> dict:
            lat: list[list[int]] = [[] for _ in range(conc)]
            errs = [0] * conc

            def make_step(t: int):
                client, keys = clients[t], round_robin(self.read_keys, t, conc)

                def step():
                    try:
                        elapsed, status, body = client.request(
                            "POST", "/api/v1/tools/call", self.read_bodies[next(keys)]
                        )
                    except (OSError, http.client.HTTPException):
                        errs[t] += 1
                        return
                    if status == 200:
                        lat[t].append(elapsed)
                    else:
                        errs[t] += 1

                return step

            times = client_loop(
                clients=conc, seconds=seconds, max_requests=max_requests, make_step=make_step, join_timeout=seconds + 60
            )
            allns = sorted(x for sub in lat for x in sub)
            return {"ok": len(allns), "errors": sum(errs), "wall_s": times.last_end - times.started, "lat": allns}

        try:
            return self._throughput_rounds(run, watch, server, clients)
        finally:
            self.reconnects += sum(c.reconnects for c in clients)
            for client in clients:
                client.close()

    def _throughput_rounds(self, run, watch: ConnWatch, server: dict, clients: list) -> dict:
        opts = self.opts
        conc = opts["concurrency"]
        # Warm-up at full concurrency until the workers' pools stop growing (psycopg_pool adds
        # a connection only when a request has to wait for one): rounds of 2 s, at most 6.
        warm_rounds = warm_until_pools_settle(watch, lambda _round: run(2.0, conc * 2000))

        server_pids = server["workers"]
        watch.start()
        pg_pids = watch.server_backend_pids()
        cpu0 = {
            "server": {p: proc_cpu_seconds(p) for p in server_pids},
            "pg": {p: proc_cpu_seconds(p) for p in pg_pids},
            "client": time.process_time(),
        }
        m0 = machine_cpu()
        res = run(opts["tput_seconds"], opts["tput_requests"])
        m1 = machine_cpu()
        cpu1 = {
            "server": {p: proc_cpu_seconds(p) for p in server_pids},
            "pg": {p: proc_cpu_seconds(p) for p in pg_pids},
            "client": time.process_time(),
        }
        conns = watch.stop()

        def delta(kind):
            return sum(
                (cpu1[kind][p] or 0) - (cpu0[kind][p] or 0)
                for p in cpu0[kind]
                if cpu0[kind][p] is not None and cpu1[kind].get(p) is not None
            )

        ok = res["ok"]
        per_req = (lambda sec: round(sec * 1000 / ok, 3)) if ok else (lambda sec: None)
        server_cpu = {p: round((cpu1["server"][p] or 0) - (cpu0["server"][p] or 0), 2) for p in server_pids}
        rps = round(ok / res["wall_s"], 1) if res["wall_s"] > 0 else 0.0
        machine = None
        if m0 and m1 and m1[1] > m0[1]:
            busy_s = (m1[0] - m0[0]) / CLK_TCK
            ours = delta("server") + delta("pg") + (cpu1["client"] - cpu0["client"])
            machine = {
                "cpu_busy_pct": cpu_busy_pct(m0, m1),
                "cpu_s_ours": round(ours, 2),
                "cpu_s_other_processes": round(max(0.0, busy_s - ours), 2),
            }
        return {
            "warmup_new_sessions_per_2s_round": warm_rounds,
            "clients": conc,
            "requests_ok": ok,
            "errors": res["errors"],
            "wall_s": round(res["wall_s"], 2),
            "requests_per_s": rps,
            "latency_ms": percentiles(res["lat"], digits=3, suffix=""),
            "cpu_ms_per_request": {
                "server_workers": per_req(delta("server")),
                "postgres_backends": per_req(delta("pg")),
                "bench_client": per_req(cpu1["client"] - cpu0["client"]),
            },
            "server_worker_cpu_s": server_cpu,
            "machine": machine,
            "connections": conns,
        }

    # ------------------------------------------------------------------ output

    def print_table(self, r: dict):
        w = self.stdout.write
        c = r["config"]
        w("")
        w("ZeroMem bench — one run on PostgreSQL " + c["postgresql"])
        w(f"  server   {c['server']}; cache {c['cache']}; db pool {c['db_pool']}")
        w(
            f"  machine  {c['cpus']} CPUs, load average {c['loadavg_at_start'][0]} at start, "
            f"{c['loadavg_at_end'][0]} at end"
        )
        w(
            f"  client   1 keep-alive connection for latency (ops shuffled per iteration), n={c['n']} "
            f"(+{c['warmup']} warm-up), {c['keys']} keys; raw = psycopg, {c['raw_binding']}-side binding"
        )
        w("")
        w(f"  {'operation':<26}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'n':>7}{'err':>5}  what")
        order = [
            ("a) read", ["http_read", "raw_read"]),
            ("b) write", ["http_write", "http_write_idem", "http_write_replay", "raw_write"]),
            ("c) audit", ["raw_select_commit", "raw_select_audit_commit", "raw_read_no_audit", "raw_pk_select"]),
            ("   floor", ["http_healthz"]),
        ]
        L = r["latency"]
        for title, names in order:
            w(f"  {title}")
            for name in names:
                x = L[name]
                w(
                    f"    {name:<24}{x['p50_ms']:>9.3f}{x['p95_ms']:>9.3f}{x['p99_ms']:>9.3f}"
                    f"{x['n']:>7}{x['errors']:>5}  {x['what']}"
                )
        R = r["ratios"]
        w("")
        w("  ratios")
        w(
            f"    read  HTTP/raw   p50 {R['read_http_vs_raw_p50']}×   p95 {R['read_http_vs_raw_p95']}×   "
            f"p99 {R['read_http_vs_raw_p99']}×"
        )
        w(
            f"    write HTTP/raw   p50 {R['write_http_vs_raw_p50']}×   p95 {R['write_http_vs_raw_p95']}×   "
            f"p99 {R['write_http_vs_raw_p99']}×"
        )
        w(
            f"    audit INSERT     SELECT+audit+COMMIT / SELECT+COMMIT p50 "
            f"{R['audit_select_audit_commit_vs_select_commit_p50']}×;  full raw read / same without audit p50 "
            f"{R['audit_raw_read_vs_raw_read_without_audit_p50']}×"
        )
        w(
            f"    counter UPDATE   full raw read / same without counter UPDATE p50 "
            f"{R['counter_raw_read_vs_raw_read_without_counter_p50']}×"
        )
        w(
            f"    Idempotency-Key  write with a fresh key / plain write p50 {R['write_idempotency_key_vs_plain_p50']}×;"
            f"  replayed retry / plain write p50 {R['write_replay_vs_plain_p50']}×"
        )
        w(f"    HTTP read / GET /healthz p50 {R['read_http_vs_healthz_p50']}×")
        t = r["throughput"]
        w("")
        w(f"  d) throughput: {t['clients']} clients (threads, keep-alive), audited memory_read")
        w(
            f"    {t['requests_per_s']} req/s   ({t['requests_ok']} ok, {t['errors']} errors in {t['wall_s']} s)   "
            f"latency p50 {t['latency_ms']['p50']} / p95 {t['latency_ms']['p95']} / p99 {t['latency_ms']['p99']} ms"
        )
        cp = t["cpu_ms_per_request"]
        w(
            f"    CPU per request: server workers {cp['server_workers']} ms, PostgreSQL backends "
            f"{cp['postgres_backends']} ms, bench client {cp['bench_client']} ms   "
            f"(worker split {t['server_worker_cpu_s']} s)"
        )
        if t["machine"]:
            m = t["machine"]
            w(
                f"    machine: CPUs {m['cpu_busy_pct']}% busy; {m['cpu_s_ours']} CPU-s this bench (server, its "
                f"PostgreSQL backends, client), {m['cpu_s_other_processes']} CPU-s other processes"
            )
        cn = t["connections"]
        w(f"    new DB connections during the measured run: {connections_text(cn)}")
        lc = r["connections_during_latency_phase_1"]
        w(
            f"    (warm-up rounds of 2 s opened {t['warmup_new_sessions_per_2s_round']} connections; the read latency "
            f"phase opened {lc['new_sessions_pg_stat_database']})"
        )
        w("")
        w("  design targets")
        for name, x in r["targets"].items():
            w(f"    {name:<14} {str(x['value']):>8}   {x['target']:<40} {'PASS' if x['ok'] else 'MISS'}")
        w("")
        w(f"  {r['note']}")
        for warning in r["warnings"]:
            w(f"  WARNING: {warning}")
        if r["http_reconnects"]:
            w(f"  ({r['http_reconnects']} keep-alive reconnects, outside the timers)")


def _nagle_suspected(latency: dict) -> bool:
    # A trivial view answering in ≥ 30 ms with a ~1 ms floor elsewhere is the 40 ms delayed-ACK
    # stall of a response written in two segments without TCP_NODELAY.
    return latency["http_healthz"]["p50_ms"] >= 30 and latency["raw_select_commit"]["p50_ms"] < 10


def _at_most(value: float | None, bound: float, note: str = "") -> dict:
    """A design target on a ratio: met when it is known and at most ``bound``."""
    return {"target": f"≤ {bound}×{note}", "value": value, "ok": value is not None and value <= bound}
