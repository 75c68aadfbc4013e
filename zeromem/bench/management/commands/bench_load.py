"""``python manage.py bench_load``: sustained load, then the same load while PostgreSQL dies.

Everything runs against a PostgreSQL cluster of this command's own — ``initdb`` into a
temporary directory (as the ``postgres`` OS user when run as root), on a free loopback port
— because the fault phase stops it hard; the shared server is never touched. (Or name a
cluster it may stop and start with ``--pg-datadir``/``--pg-port``.) The server is the
production web tier, ``python3 -m zeromem serve``'s (zeromem/serving.py: granian WSGI,
``--processes`` × ``--threads``), started by the same code as ``manage.py bench``, with a
psycopg pool per process (``DB_POOL_*``).

1. **Steady**: ``--clients`` keep-alive clients (threads), each sending tool calls back to
   back — ``--write-ratio`` (20%) ``memory_write`` of a new key, the rest ``memory_read`` of
   a seeded key — for ``--seconds``, after a warm-up that lasts until the workers' pools stop
   growing. Prints throughput, p50/p95/p99, 5xx and other errors, and the PostgreSQL
   connections opened during the measured run (pg_stat_database.sessions and
   pg_stat_activity, as ``bench``).
2. **Faults**: the same load for ``--fault-seconds``; at ``--outage-at`` s PostgreSQL is
   stopped with ``pg_ctl -m immediate`` (no checkpoint, crash recovery on restart) and
   started again ``--outage-seconds`` later. Every response is classified by when it was
   sent and answered: during the outage the API must answer 503 ``database_unavailable``
   with ``Retry-After`` (no other 5xx, no client timeout: every client read is bounded by
   ``--client-timeout``); outside it, no 5xx at all; the server recovers by itself (time
   from "PostgreSQL accepts connections" to the first 200, and to the last failure).
3. **Writes**: every write answered 200 ``status: ok`` (steady and faults) is read back
   through the API afterwards and compared with the value sent: acknowledged, verified,
   lost (must be 0). Writes that failed but committed anyway are counted too (allowed:
   the client was never told "ok").

Bounded everywhere: each phase by time and by ``--max-requests``, each request by the
client timeout, each PostgreSQL action by pg_ctl's own timeout. Exits non-zero when a
requirement fails. The private cluster is stopped and deleted at the end.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import psycopg
from django.conf import settings
from django.core.management.base import CommandError

from zeromem.bench.cluster import PrivateCluster, find_bindir
from zeromem.bench.harness import (
    HttpClient,
    client_loop,
    cpu_busy_pct,
    healthz,
    loadavg,
    machine_cpu,
    percentiles,
    sigterm_unwinds,
)
from zeromem.bench.options import BenchCommand
from zeromem.bench.pgwatch import ConnWatch, connections_text, warm_until_pools_settle
from zeromem.bench.server import running_server, tail

TOOL_CALL = "/api/v1/tools/call"


# --- the load -----------------------------------------------------------------------------


@dataclass
class Result:
    """One request: kind ("read"/"write"), monotonic send/answer times, HTTP status (0: no
    answer), code ("ok", an error code, "timeout", "connection", "not_ok") and whether a
    non-200 answer carried Retry-After."""

    kind: str
    sent: float
    done: float
    status: int
    code: str
    retry_after: bool


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    acked: list[tuple[str, dict]] = field(default_factory=list)  # (key, value) answered ok
    wall_s: float = 0.0


class Load:
    """``clients`` keep-alive connections sending tool calls back to back."""

    def __init__(self, *, port: int, api_key: str, clients: int, read_keys: list[str], opts: dict):
        self.port, self.api_key, self.n = port, api_key, clients
        self.read_keys = read_keys
        self.read_bodies = [
            json.dumps({"name": "memory_read", "arguments": {"key": key}}).encode() for key in read_keys
        ]
        self.write_ratio = opts["write_ratio"]
        self.timeout = opts["client_timeout"]
        self.seed = opts["seed"]
        self.clients = [HttpClient(port, api_key, timeout=self.timeout) for _ in range(clients)]

    def close(self):
        for c in self.clients:
            c.close()

    def run(self, tag: str, seconds: float, max_requests: int, during=None) -> Run:
        """Load for ``seconds`` (or ``max_requests``); ``during(t0)`` runs in this thread
        meanwhile (the fault timeline)."""
        per_client = [Run() for _ in range(self.n)]

        def make_step(t: int):
            rng = random.Random(f"{self.seed}:{tag}:{t}")
            client, out = self.clients[t], per_client[t]
            seqs = itertools.count(1)

            def step():
                if rng.random() < self.write_ratio:
                    seq = next(seqs)
                    kind, key = "write", f"fact:load:w:{tag}:c{t:02}:{seq:06}"
                    value = {"client": t, "seq": seq, "nonce": rng.getrandbits(48)}
                    body = json.dumps({"name": "memory_write", "arguments": {"key": key, "value": value}}).encode()
                else:
                    kind, key, value = "read", None, None
                    body = self.read_bodies[rng.randrange(len(self.read_bodies))]
                out.results.append(self._one(client, kind, body, value, out.acked, key))

            return step

        times = client_loop(
            clients=self.n,
            seconds=seconds,
            max_requests=max_requests,
            make_step=make_step,
            join_timeout=seconds + 2 * self.timeout + 30,
            during=during,
        )
        run = Run(wall_s=times.joined - times.started)
        for r in per_client:
            run.results += r.results
            run.acked += r.acked
        return run

    @staticmethod
    def _one(client: HttpClient, kind: str, body: bytes, value, acked: list, key: str | None) -> Result:
        sent = time.monotonic()
        try:
            _, status, data = client.request("POST", TOOL_CALL, body)
        except TimeoutError:
            client.close()
            return Result(kind, sent, time.monotonic(), 0, "timeout", False)
        except (OSError, http.client.HTTPException):
            client.close()
            time.sleep(0.05)  # the server is not listening: do not spin
            return Result(kind, sent, time.monotonic(), 0, "connection", False)
        done = time.monotonic()
        try:
            answer = json.loads(data)
        except ValueError:
            answer = {}
        if status == 200:
            ok = isinstance(answer, dict) and answer.get("status") == "ok"
            if ok and kind == "write":
                acked.append((key, value))
            return Result(kind, sent, done, status, "ok" if ok else "not_ok", False)
        error = answer.get("error") if isinstance(answer, dict) else None
        code = error.get("code", "?") if isinstance(error, dict) else "unparsable"
        headers = client.last_headers
        return Result(kind, sent, done, status, str(code), bool(headers and headers.get("Retry-After")))


def latency(results: list[Result]) -> dict:
    ns = sorted(int((r.done - r.sent) * 1e9) for r in results)
    return {"n": len(ns), **percentiles(ns, digits=2), "max_ms": round(ns[-1] / 1e6, 2) if ns else None}


def tally(results: list[Result]) -> dict:
    return {
        "requests": len(results),
        "ok": sum(r.code == "ok" for r in results),
        "5xx": sum(r.status >= 500 for r in results),
        "503": sum(r.status == 503 for r in results),
        "other_5xx": sum(r.status >= 500 and r.status != 503 for r in results),
        "4xx": sum(400 <= r.status < 500 for r in results),
        "timeouts": sum(r.code == "timeout" for r in results),
        "connection_errors": sum(r.code == "connection" for r in results),
        "not_ok_200": sum(r.status == 200 and r.code != "ok" for r in results),
    }


# --- the command ----------------------------------------------------------------------------


class Command(BenchCommand):
    help = (
        "Load (80% memory_read / 20% memory_write from 16 clients) against the production server "
        "set-up, then the same load while a private PostgreSQL is stopped hard and restarted: "
        "throughput, percentiles, 5xx, new connections, 503s during the outage, recovery, lost writes."
    )

    shared_options = ("clients", "processes", "threads", "keys", "json", "seed")
    option_defaults = {"keys": 200}

    def add_bench_arguments(self, parser):
        parser.add_argument("--seconds", type=float, default=180.0, help="steady phase length (180 s)")
        parser.add_argument("--fault-seconds", type=float, default=60.0, help="fault phase length (60 s)")
        parser.add_argument("--outage-at", type=float, default=15.0, help="stop PostgreSQL this far in (15 s)")
        parser.add_argument("--outage-seconds", type=float, default=10.0, help="how long it stays down (10 s)")
        parser.add_argument("--write-ratio", type=float, default=0.2, help="share of memory_write calls (0.2)")
        parser.add_argument("--max-requests", type=int, default=1_000_000, help="request cap per phase")
        parser.add_argument(
            "--client-timeout", type=float, default=15.0, help="bound of every client read, s (15; > DB_POOL_TIMEOUT)"
        )
        parser.add_argument(
            "--recovery-limit", type=float, default=30.0, help="seconds after restart the API must be healthy (30)"
        )
        parser.add_argument("--pg-bindir", default="", help="PostgreSQL binaries (default: where pg_ctl is found)")
        parser.add_argument(
            "--pg-datadir",
            default="",
            help="an existing cluster this command may stop and start (default: a fresh one in a temp dir)",
        )
        parser.add_argument("--pg-port", type=int, default=0, help="its port on 127.0.0.1 (with --pg-datadir)")
        parser.add_argument("--skip-steady", action="store_true", help="only the fault phase")

    def handle(self, *args, **opts):
        self._check_options(opts)
        self.opts = opts
        bindir = opts["pg_bindir"] or find_bindir()
        cluster = PrivateCluster(
            bindir=bindir, log=self.log, datadir=opts["pg_datadir"] or None, port=opts["pg_port"] or None
        )
        var_dir = tempfile.mkdtemp(prefix="zeromem-load-var-")  # the server's file cache
        with sigterm_unwinds():
            try:
                self.log(f"PostgreSQL: {'initdb in ' + str(cluster.datadir) if cluster.own else cluster.datadir}")
                cluster.create()
                cluster.start()
                cluster.create_database()
                self.env = {**os.environ, "DATABASE_URL": cluster.url, "ZEROMEM_ENV": "development"}
                self._manage("migrate", "--noinput", "-v", "0")
                api_key = self._tenant_and_key()
                pool = self._manage(
                    "shell",
                    "-v",
                    "0",
                    "-c",
                    "import json; from django.conf import settings as s; d = s.DATABASES['default']; "
                    "print(json.dumps({**d['OPTIONS']['pool'], 'health_checks': d['CONN_HEALTH_CHECKS']}))",
                )
                self.pool = json.loads(pool.strip().splitlines()[-1])
                with running_server(
                    stderr=self.stderr,
                    database_url=cluster.url,
                    processes=opts["processes"],
                    threads=opts["threads"],
                    log=self.log,
                    extra_env={"ZEROMEM_VAR_DIR": var_dir},
                ) as server:
                    self.pool.update(server["pool"])  # the web processes' own sizes (zeromem/serving.py)
                    result = self.run_all(cluster, server, api_key)
            finally:
                cluster.destroy()
                shutil.rmtree(var_dir, ignore_errors=True)
        self.emit(result)
        failed = [name for name, check in result["checks"].items() if not check["ok"]]
        if failed:
            raise CommandError(f"requirements not met: {', '.join(failed)}")

    @staticmethod
    def _check_options(opts):
        if not 1 <= opts["clients"] <= 256 or not 1 <= opts["processes"] <= 32 or not 1 <= opts["threads"] <= 256:
            raise CommandError("--clients must be 1-256, --processes 1-32 and --threads 1-256")
        if not 0 <= opts["write_ratio"] <= 1:
            raise CommandError("--write-ratio must be between 0 and 1")
        if not 0 < opts["seconds"] <= 3600 or not 0 < opts["fault_seconds"] <= 3600:
            raise CommandError("--seconds and --fault-seconds must be in (0, 3600]")
        if opts["outage_at"] + opts["outage_seconds"] >= opts["fault_seconds"]:
            raise CommandError("the outage must end before the fault phase does (--outage-at + --outage-seconds)")
        if opts["pg_datadir"] and not opts["pg_port"]:
            raise CommandError("--pg-datadir needs --pg-port")
        if opts["pg_port"] == 5432 or (opts["pg_port"] and not opts["pg_datadir"]):
            raise CommandError("name a cluster of your own with --pg-datadir and --pg-port (never the shared 5432)")

    def _manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=str(settings.BASE_DIR),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise CommandError(f"manage.py {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def _tenant_and_key(self) -> str:
        slug = f"load-{secrets.token_hex(4)}"
        self._manage("create_tenant", slug, "--name", "bench_load (throw-away)")
        out = self._manage(
            "create_api_key", "--tenant", slug, "--name", "load", "--scopes", "memory:read,memory:write", "--json"
        )
        self.slug = slug
        return json.loads(out)["key"]

    # ------------------------------------------------------------------ phases

    def run_all(self, cluster: PrivateCluster, server: dict, api_key: str) -> dict:
        opts = self.opts
        port = server["port"]
        read_keys = [f"fact:load:r:{i:05d}" for i in range(opts["keys"])]
        seeder = HttpClient(port, api_key, timeout=opts["client_timeout"])
        for i, key in enumerate(read_keys):
            value = {"text": "prefers concise answers in English; timezone Europe/Berlin", "n": i}
            _, status, body = seeder.request(
                "POST", TOOL_CALL, json.dumps({"name": "memory_write", "arguments": {"key": key, "value": value}})
            )
            if status != 200:
                raise CommandError(f"seeding failed: {status} {body[:200]!r}\n{tail(server['log'])}")
        seeder.close()
        self.log(f"tenant {self.slug}: {len(read_keys)} memories seeded")

        load = Load(port=port, api_key=api_key, clients=opts["clients"], read_keys=read_keys, opts=opts)
        loadavg0 = loadavg()
        try:
            steady = None if opts["skip_steady"] else self.phase_steady(load, cluster)
            self.log(
                f"faults: {opts['fault_seconds']:.0f} s; PostgreSQL stopped (immediate) at {opts['outage_at']:.0f} s "
                f"for {opts['outage_seconds']:.0f} s"
            )
            faults = self.phase_faults(load, cluster, port)
        finally:
            load.close()
        loadavg1 = loadavg()

        self.log("verifying acknowledged writes")
        acked = (steady["run"].acked if steady else []) + faults["run"].acked
        verify = self.verify_writes(port, api_key, acked)
        with psycopg.connect(cluster.conninfo()) as conn:
            stored = conn.execute(
                "SELECT count(*) FROM memories_memory m JOIN memories_tenant t ON t.id = m.tenant_id "
                "WHERE t.slug = %s AND (m.key LIKE 'fact:load:w:steady:%%' OR m.key LIKE 'fact:load:w:faults:%%') "
                "AND m.deleted_at IS NULL",
                (self.slug,),
            ).fetchone()[0]
            pg_version = conn.execute("SHOW server_version").fetchone()[0]
        verify["stored_write_keys"] = stored
        verify["committed_but_not_acknowledged"] = stored - verify["acknowledged"]

        checks = {}
        if steady:
            st = steady["tally"]
            checks["steady: no 5xx"] = {"ok": st["5xx"] == 0, "value": st["5xx"]}
            checks["steady: no other failures"] = {
                "ok": st["requests"] == st["ok"],
                "value": st["requests"] - st["ok"] - st["5xx"],
            }
            cn = steady["connections"]
            new = max(cn["new_sessions_pg_stat_database"], cn["new_backends_seen_pg_stat_activity"])
            checks["steady: no new DB connections"] = {"ok": new == 0, "value": new}
        f = faults
        out = f["windows"]["outage"]
        checks["outage: only 503 database_unavailable + Retry-After"] = {
            "ok": out["other_5xx"] == 0 and f["outage_503_clear"] == out["503"],
            "value": f"{out['other_5xx']} other 5xx, {out['503'] - f['outage_503_clear']} unclear 503",
        }
        checks["outage: no client timeout (no hang)"] = {
            "ok": sum(w["timeouts"] for w in f["windows"].values()) == 0,
            "value": sum(w["timeouts"] for w in f["windows"].values()),
        }
        outside = f["windows"]["before"]["5xx"] + f["windows"]["after"]["5xx"]
        checks["faults: no 5xx outside the outage"] = {"ok": outside == 0, "value": outside}
        rec = f["recovery"]
        checks["faults: recovered by itself (s to first 200)"] = {
            "ok": rec["first_ok_after_s"] is not None
            and rec["first_ok_after_s"] <= opts["recovery_limit"]
            and rec["failures_in_last_5_s"] == 0
            and rec["healthz_at_end"] == 200,
            "value": rec["first_ok_after_s"],
        }
        checks["writes: none lost"] = {"ok": verify["lost"] == 0 and verify["unverified"] == 0, "value": verify["lost"]}

        m0, m1 = steady["machine_cpu"] if steady else (None, None)
        return {
            "config": {
                "postgresql": pg_version,
                "cluster": "private (initdb here)" if cluster.own else str(cluster.datadir),
                "pg_port": cluster.port,
                "server": " ".join(server["cmd"][2:]),
                "db_pool": self.pool,
                "clients": opts["clients"],
                "write_ratio": opts["write_ratio"],
                "client_timeout_s": opts["client_timeout"],
                "cpus": os.cpu_count(),
                "loadavg_at_start": loadavg0,
                "loadavg_at_end": loadavg1,
                "steady_cpu_busy_pct": cpu_busy_pct(m0, m1),
                "tenant": self.slug,
            },
            "steady": {k: v for k, v in steady.items() if k not in ("run", "machine_cpu")} if steady else None,
            "faults": {k: v for k, v in faults.items() if k != "run"},
            "writes": verify,
            "checks": checks,
        }

    def phase_steady(self, load: Load, cluster: PrivateCluster) -> dict:
        opts = self.opts
        watch = ConnWatch(cluster.conninfo(), set())
        try:
            # Warm-up until the workers' pools stop growing (rounds of 3 s, at most 6).
            warm = warm_until_pools_settle(watch, lambda i: load.run(f"warm{i}", 3.0, opts["max_requests"]))
            self.log(f"steady: {opts['seconds']:.0f} s, {opts['clients']} clients (warm-up opened {warm} connections)")
            watch.start()
            m0 = machine_cpu()
            run = load.run("steady", opts["seconds"], opts["max_requests"])
            m1 = machine_cpu()
            conns = watch.stop()
        finally:
            watch.close()
        ok = [r for r in run.results if r.code == "ok"]
        return {
            "run": run,
            "machine_cpu": (m0, m1),
            "seconds": round(run.wall_s, 1),
            "warmup_new_connections": warm,
            "tally": tally(run.results),
            "requests_per_s": round(len(ok) / run.wall_s, 1) if run.wall_s else 0.0,
            "latency_ms": {
                "all": latency(ok),
                "memory_read": latency([r for r in ok if r.kind == "read"]),
                "memory_write": latency([r for r in ok if r.kind == "write"]),
            },
            "writes_acknowledged": len(run.acked),
            "connections": conns,
        }

    def phase_faults(self, load: Load, cluster: PrivateCluster, port: int) -> dict:
        opts = self.opts
        marks: dict[str, float] = {}

        def timeline(t0: float):
            time.sleep(max(0.0, t0 + opts["outage_at"] - time.monotonic()))
            marks["stop"] = time.monotonic()
            cluster.stop_immediate()
            marks["stopped"] = time.monotonic()
            time.sleep(max(0.0, marks["stop"] + opts["outage_seconds"] - time.monotonic()))
            marks["start"] = time.monotonic()
            cluster.start()  # -w: returns once PostgreSQL accepts connections (after crash recovery)
            marks["up"] = time.monotonic()
            marks["t0"] = t0

        run = load.run("faults", opts["fault_seconds"], opts["max_requests"], during=timeline)
        t0, stop, up = marks["t0"], marks["stop"], marks["up"]
        # A response belongs to the outage when its request was in flight at any moment
        # between "stop issued" and "PostgreSQL accepts connections again".
        windows = {"before": [], "outage": [], "after": []}
        for r in run.results:
            if r.done < stop:
                windows["before"].append(r)
            elif r.sent > up:
                windows["after"].append(r)
            else:
                windows["outage"].append(r)
        outage = windows["outage"]
        clear = sum(r.status == 503 and r.code == "database_unavailable" and r.retry_after for r in outage)
        bad_after_stop = [r.done for r in run.results if r.done >= stop and r.code != "ok"]
        first_ok = min((r.done for r in run.results if r.done >= up and r.code == "ok"), default=None)
        last_bad = max(bad_after_stop, default=None)
        end = max((r.done for r in run.results), default=up)
        late_failures = sum(r.code != "ok" for r in run.results if r.done > end - 5)
        codes = Counter(f"{r.status} {r.code}" for r in outage)
        return {
            "run": run,
            "seconds": round(run.wall_s, 1),
            "stop_at_s": round(stop - t0, 2),
            "pg_ctl_stop_s": round(marks["stopped"] - stop, 2),
            "pg_ctl_start_s": round(up - marks["start"], 2),
            "outage_s": round(up - stop, 2),
            "windows": {name: tally(rs) for name, rs in windows.items()},
            "outage_answers": dict(codes.most_common()),
            "outage_503_clear": clear,
            "outage_503_latency_ms": latency([r for r in outage if r.status == 503]),
            "after_latency_ms": latency([r for r in windows["after"] if r.code == "ok"]),
            "recovery": {
                "first_ok_after_s": round(first_ok - up, 2) if first_ok is not None else None,
                "last_failure_after_s": round(last_bad - up, 2) if last_bad is not None else None,
                "failures_in_last_5_s": late_failures,
                "healthz_at_end": self._healthz(port),
            },
            "writes_acknowledged": len(run.acked),
        }

    def _healthz(self, port: int) -> int:
        try:
            return healthz(port, timeout=self.opts["client_timeout"])[0]
        except OSError:
            return 0

    def verify_writes(self, port: int, api_key: str, acked: list[tuple[str, dict]]) -> dict:
        """Read every acknowledged write back through the API (memory_read); a read that
        does not answer 200 is retried (bounded), a wrong or missing value is a lost write."""
        n = self.opts["clients"]
        lost: list[str] = []
        unverified: list[str] = []
        verified = [0] * n
        lock = threading.Lock()

        def check(t: int):
            client = HttpClient(port, api_key, timeout=self.opts["client_timeout"])
            try:
                for key, value in acked[t::n]:
                    body = json.dumps({"name": "memory_read", "arguments": {"key": key}})
                    for attempt in range(5):
                        try:
                            _, status, data = client.request("POST", TOOL_CALL, body)
                        except (OSError, http.client.HTTPException):
                            client.close()
                            status, data = 0, b""
                        if status == 200:
                            break
                        time.sleep(0.5 * (attempt + 1))
                    if status != 200:
                        with lock:
                            unverified.append(key)
                        continue
                    answer = json.loads(data)
                    if answer.get("status") == "ok" and answer.get("value") == value:
                        verified[t] += 1
                    else:
                        with lock:
                            lost.append(key)
            finally:
                client.close()

        threads = [threading.Thread(target=check, args=(t,), daemon=True) for t in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=600)
        return {
            "acknowledged": len(acked),
            "verified": sum(verified),
            "lost": len(lost),
            "lost_keys": lost[:20],
            "unverified": len(unverified),
        }

    # ------------------------------------------------------------------ output

    def print_table(self, r: dict):
        w = self.stdout.write
        c = r["config"]
        w("")
        w(f"ZeroMem load and faults — PostgreSQL {c['postgresql']}, {c['cluster']}, 127.0.0.1:{c['pg_port']}")
        w(f"  server   {c['server']}")
        w(f"  db pool  {c['db_pool']} per worker")
        w(
            f"  clients  {c['clients']} keep-alive, {100 - round(100 * c['write_ratio'])}% memory_read / "
            f"{round(100 * c['write_ratio'])}% memory_write (new keys), client timeout {c['client_timeout_s']} s"
        )
        busy = f", CPUs {c['steady_cpu_busy_pct']}% busy during the steady run" if c["steady_cpu_busy_pct"] else ""
        w(f"  machine  {c['cpus']} CPUs, load average {c['loadavg_at_start'][0]} → {c['loadavg_at_end'][0]}{busy}")
        s = r["steady"]
        if s:
            t = s["tally"]
            w("")
            w(f"  steady ({s['seconds']} s)")
            w(
                f"    {s['requests_per_s']} req/s; {t['requests']} requests: {t['ok']} ok, 5xx {t['5xx']}, "
                f"4xx {t['4xx']}, timeouts {t['timeouts']}, connection errors {t['connection_errors']}"
            )
            w(f"    {'':<14}{'n':>8}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'max ms':>9}")
            for name, x in s["latency_ms"].items():
                w(f"    {name:<14}{x['n']:>8}{x['p50_ms']:>9}{x['p95_ms']:>9}{x['p99_ms']:>9}{x['max_ms']:>9}")
            cn = s["connections"]
            w(
                f"    new DB connections during the run: {connections_text(cn)} "
                f"(warm-up opened {s['warmup_new_connections']})"
            )
        f = r["faults"]
        rec = f["recovery"]
        w("")
        w(
            f"  faults ({f['seconds']} s): PostgreSQL stopped -m immediate at {f['stop_at_s']} s "
            f"(pg_ctl stop {f['pg_ctl_stop_s']} s, start {f['pg_ctl_start_s']} s)"
        )
        w(f"    outage (stop issued → accepting connections)  {f['outage_s']} s")
        w(
            f"    {'window':<10}{'requests':>9}{'ok':>7}{'503':>6}{'other 5xx':>10}{'4xx':>5}"
            f"{'timeouts':>9}{'conn err':>9}"
        )
        for name, x in f["windows"].items():
            w(
                f"    {name:<10}{x['requests']:>9}{x['ok']:>7}{x['503']:>6}{x['other_5xx']:>10}{x['4xx']:>5}"
                f"{x['timeouts']:>9}{x['connection_errors']:>9}"
            )
        lat = f["outage_503_latency_ms"]
        w(
            f"    during the outage: {f['outage_503_clear']} of {f['windows']['outage']['503']} 503s are "
            f"database_unavailable with Retry-After; 503 latency p50 {lat['p50_ms']} / max {lat['max_ms']} ms; "
            f"answers {f['outage_answers']}"
        )
        w(
            f"    recovery after PostgreSQL is up: first 200 after {rec['first_ok_after_s']} s, last failure "
            f"{rec['last_failure_after_s']} s; failures in the last 5 s {rec['failures_in_last_5_s']}; "
            f"/healthz at the end {rec['healthz_at_end']}"
        )
        al = f["after_latency_ms"]
        w(f"    after restart: p50 {al['p50_ms']} / p95 {al['p95_ms']} / p99 {al['p99_ms']} ms")
        v = r["writes"]
        w("")
        w(
            f"  writes answered ok: {v['acknowledged']} (steady {s['writes_acknowledged'] if s else 0}, faults "
            f"{f['writes_acknowledged']}); read back with their value {v['verified']}; lost {v['lost']}; "
            f"unverifiable {v['unverified']}"
        )
        w(
            f"    committed though not answered ok: {v['committed_but_not_acknowledged']} "
            f"({v['stored_write_keys']} write keys stored)"
        )
        w("")
        w("  requirements")
        for name, check in r["checks"].items():
            w(f"    {name:<54} {str(check['value']):>10}   {'PASS' if check['ok'] else 'FAIL'}")
        w(f"  tenant {c['tenant']} lived in the private cluster, which is deleted.")
