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

The server is started here, as in production: ``uvicorn zeromem.asgi:application
--workers W --no-access-log`` on 127.0.0.1, with ``ZEROMEM_ENV=development DEBUG=false``,
the same ``DATABASE_URL`` (so the same psycopg pool settings) and a rate limit high enough
not to interfere. It is always stopped at the end. Latency samples are taken by one client,
HTTP and raw operations shuffled within every iteration so that machine noise hits both
alike; every loop is bounded in count and in time.

The bench tenant (``bench-<random>``), its memories and their audit events stay in the
database (audit rows are append-only); its API key is revoked at the end.
"""

from __future__ import annotations

import gc
import http.client
import json
import math
import os
import random
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

LOOPBACK = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Design targets (DESIGN.md, "Quality bars").
TARGET_READ_P50 = 2.5
TARGET_READ_P99 = 4.0
TARGET_WRITE_P50 = 2.5
TARGET_AUDIT = 1.3
TARGET_RPS = 1500


# --- small helpers ----------------------------------------------------------------------


def percentile(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile of nanosecond samples, in milliseconds."""
    if not sorted_ns:
        return float("nan")
    rank = max(1, math.ceil(q * len(sorted_ns)))
    return sorted_ns[min(rank, len(sorted_ns)) - 1] / 1e6


@dataclass
class Samples:
    name: str
    what: str
    ns: list[int] = field(default_factory=list)
    errors: int = 0

    def summary(self) -> dict:
        s = sorted(self.ns)
        return {
            "what": self.what,
            "n": len(s),
            "errors": self.errors,
            "p50_ms": round(percentile(s, 0.50), 4),
            "p95_ms": round(percentile(s, 0.95), 4),
            "p99_ms": round(percentile(s, 0.99), 4),
            "mean_ms": round(sum(s) / len(s) / 1e6, 4) if s else None,
            "max_ms": round(s[-1] / 1e6, 4) if s else None,
        }


def ratio(a: float | None, b: float | None) -> float | None:
    if not a or not b or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, 2)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process from /proc (None when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def machine_cpu() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v[:8]) - idle, sum(v[:8])


def child_pids(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


class HttpClient:
    """One keep-alive HTTP/1.1 connection to the bench server (loopback only)."""

    def __init__(self, port: int, api_key: str, timeout: float = 30.0):
        self.port = port
        self.timeout = timeout  # seconds for connect and for each socket read: no request hangs
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.conn: http.client.HTTPConnection | None = None
        self.reconnects = 0
        self.last_headers: http.client.HTTPMessage | None = None  # of the last response

    def _connect(self):
        self.conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=self.timeout)
        self.conn.connect()
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, int, bytes]:
        """(elapsed ns, status, body). A connection the server closed while idle
        (keep-alive timeout) is reopened once, outside the timed region."""
        for attempt in (0, 1):
            if self.conn is None:
                self._connect()
            try:
                t0 = time.perf_counter_ns()
                self.conn.request(method, path, body=body, headers=self.headers)
                resp = self.conn.getresponse()
                data = resp.read()
                elapsed = time.perf_counter_ns() - t0
                self.last_headers = resp.headers
                if resp.will_close:
                    self.close()
                return elapsed, resp.status, data
            except (http.client.RemoteDisconnected, ConnectionError, http.client.CannotSendRequest):
                self.close()
                self.reconnects += 1
                if attempt:
                    raise
        raise AssertionError("unreachable")


# --- the server, started as in production -----------------------------------------------


def tail(path: str, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def worker_pids(master: int, workers: int) -> list[int]:
    """The uvicorn worker processes under ``master`` (the master itself with one worker)."""
    if workers == 1:
        return [master]
    pids = []
    for pid in child_pids(master):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            pids.append(pid)
    return pids or [master]


def start_server(
    *,
    database_url: str,
    workers: int,
    log,
    port: int = 0,
    interface: str = "asgi",
    access_log: bool = False,
    uvicorn_args: str = "",
    extra_env: dict | None = None,
) -> dict:
    """``uvicorn zeromem.asgi:application --workers N`` on 127.0.0.1 as the README's production
    command (TCP_NODELAY protocol, pooled connections from ``database_url``), with a rate
    limit high enough not to interfere. Returns {"proc", "port", "log", "cmd", "workers"}
    once /healthz answers 200 from PostgreSQL; raises CommandError otherwise."""
    port = port or free_port()
    env = dict(os.environ)
    env.update(
        ZEROMEM_ENV="development",
        DEBUG="false",
        DATABASE_URL=database_url,
        ZEROMEM_RATE_LIMIT_PER_MINUTE=str(10**9),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra_env or {})
    app = "zeromem.asgi:application" if interface == "asgi" else "zeromem.wsgi:application"
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        app,
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--log-level",
        "warning",
        # As the README's production command: TCP_NODELAY (see zeromem/server.py).
        "--http",
        "zeromem.server:NoDelayH11Protocol",
    ]
    if interface == "wsgi":
        cmd += ["--interface", "wsgi"]
    if not access_log:
        cmd.append("--no-access-log")
    extra = shlex.split(uvicorn_args)
    if any(a in ("--host", "--uds", "--fd") or a.startswith(("--host=", "--uds=", "--fd=")) for a in extra):
        raise CommandError("--uvicorn-args may not move the server off 127.0.0.1")
    cmd += extra
    logfile = tempfile.NamedTemporaryFile(prefix="zeromem-bench-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        cmd,
        cwd=str(settings.BASE_DIR),
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    server = {"proc": proc, "port": port, "log": logfile.name, "cmd": cmd}
    log(f"server: {' '.join(cmd[2:])} (pid {proc.pid}, log {logfile.name})")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop_server(server)
            raise CommandError(f"the server exited with {proc.returncode}:\n{tail(logfile.name)}")
        try:
            c = http.client.HTTPConnection(LOOPBACK, port, timeout=2)
            c.request("GET", "/healthz")
            resp = c.getresponse()
            body = resp.read()
            c.close()
            if resp.status == 200 and b'"postgresql"' in body:
                break
        except OSError:
            pass
        time.sleep(0.2)
    else:
        stop_server(server)
        raise CommandError(f"the server did not answer /healthz within 60 s:\n{tail(logfile.name)}")
    time.sleep(1.0)  # let every worker finish importing before the first sample
    server["workers"] = worker_pids(proc.pid, workers)
    return server


def stop_server(server: dict):
    proc: subprocess.Popen = server["proc"]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    # Whatever is left of the group we started (its workers), by its process group id.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


# --- the raw statements -----------------------------------------------------------------


class RawSQL:
    """The statements Django sends for a tool read / write, run with psycopg directly on the
    same tables. Column lists come from the models so they match the ORM's."""

    def __init__(self, conninfo: str, *, client_binding: bool, tenant_id: int, key_id: int, key_label: str):
        import psycopg

        from audit.models import AuditEvent
        from memories.models import Memory

        factory = {"cursor_factory": psycopg.ClientCursor} if client_binding else {}
        # A transaction per operation (BEGIN is implicit, as under Django's atomic()).
        self.conn = psycopg.connect(conninfo, autocommit=False, **factory)
        # Autocommit connection for the bare primary-key SELECT.
        self.ac = psycopg.connect(conninfo, autocommit=True, **factory)
        self.cur = self.conn.cursor()
        self.accur = self.ac.cursor()
        self.tenant_id, self.key_id, self.key_label = tenant_id, str(key_id), key_label
        from psycopg.types.json import Jsonb

        self.Jsonb = Jsonb

        # bandit B608 (marked below): only the models' own table and column names are formatted into
        # these statements; every value is a %s parameter.
        mt = Memory._meta.db_table
        cols = [f.column for f in Memory._meta.concrete_fields]
        self.col = {c: i for i, c in enumerate(cols)}
        select_list = ", ".join(f'"{mt}"."{c}"' for c in cols)
        self.sql_select_live = (
            f'SELECT {select_list} FROM "{mt}" WHERE ("{mt}"."tenant_id" = %s AND "{mt}"."deleted_at" IS NULL '  # nosec B608
            f'AND ("{mt}"."expires_at" IS NULL OR "{mt}"."expires_at" > %s) AND "{mt}"."key" = %s) '
            f'ORDER BY "{mt}"."id" ASC LIMIT 1'
        )
        self.sql_select_for_update = (
            f'SELECT {select_list} FROM "{mt}" WHERE ("{mt}"."tenant_id" = %s AND "{mt}"."key" = %s '  # nosec B608
            f'AND "{mt}"."deleted_at" IS NULL) ORDER BY "{mt}"."id" ASC LIMIT 1 FOR UPDATE'
        )
        self.sql_select_pk = f'SELECT {select_list} FROM "{mt}" WHERE "{mt}"."id" = %s LIMIT 21'  # nosec B608
        self.sql_counter = (
            f'UPDATE "{mt}" SET "access_count" = ("{mt}"."access_count" + 1), "last_accessed_at" = %s '  # nosec B608
            f'WHERE "{mt}"."id" = %s'
        )
        self.sql_write = (
            f'UPDATE "{mt}" SET "value" = %s, "search_text" = %s, "version" = %s, "updated_at" = %s '  # nosec B608
            f'WHERE "{mt}"."id" = %s'
        )
        self.sql_version = (
            'INSERT INTO "memories_memoryversion" ("tenant_id", "memory_id", "version", "value", "op", '
            '"actor_kind", "actor_id", "created_at") VALUES (%s, %s, %s, %s, %s, %s, %s, %s) '
            'RETURNING "memories_memoryversion"."id"'
        )
        at = AuditEvent._meta.db_table
        acols = [f.column for f in AuditEvent._meta.concrete_fields if not f.primary_key]
        self.audit_cols = acols
        self.sql_audit = (
            f'INSERT INTO "{at}" ({", ".join(f"{chr(34)}{c}{chr(34)}" for c in acols)}) '  # nosec B608
            f'VALUES ({", ".join(["%s"] * len(acols))}) RETURNING "{at}"."id"'
        )

    def close(self):
        for c in (self.conn, self.ac):
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing on the way out
                pass

    def backend_pids(self) -> set[int]:
        return {self.conn.info.backend_pid, self.ac.info.backend_pid}

    def _audit_params(self, *, action: str, key: str, subject: str, version: int, detail: dict, now) -> tuple:
        from audit import chain

        row = {
            "uid": uuid.uuid4(),
            "tenant_id": self.tenant_id,
            "occurred_at": now,
            "actor_kind": "api_key",
            "actor_id": self.key_id,
            "actor_label": self.key_label,
            "surface": "tool",
            "action": action,
            "target": key,
            "subject": subject,
            "outcome": "ok",
            "request_id": uuid.uuid4().hex,
            "client_ip": LOOPBACK,
            "count": None,
            "version": version,
            "detail": detail,
        }
        # The same keyed digest audit_record computes (tamper evidence costs the raw side too).
        row.update(digest=chain.digest(row), seal=None, chain="", redacted=self.Jsonb({}))
        row["detail"] = self.Jsonb(detail)
        return tuple(row[c] for c in self.audit_cols)

    # Each method returns the elapsed nanoseconds of its statements (commit included).

    def read(self, key: str, *, counter: bool = True, audit: bool = True) -> int:
        cur, col = self.cur, self.col
        t0 = time.perf_counter_ns()
        now = datetime.now(UTC)
        cur.execute(self.sql_select_live, (self.tenant_id, now, key))
        row = cur.fetchone()
        if counter:
            cur.execute(self.sql_counter, (now, row[col["id"]]))
        if audit:
            cur.execute(
                self.sql_audit,
                self._audit_params(
                    action="memory.read",
                    key=key,
                    subject=row[col["subject"]],
                    version=row[col["version"]],
                    detail={},
                    now=now,
                ),
            )
            cur.fetchone()
        self.conn.commit()
        return time.perf_counter_ns() - t0

    def write(self, key: str, value, search_text: str) -> int:
        cur, col = self.cur, self.col
        t0 = time.perf_counter_ns()
        now = datetime.now(UTC)
        cur.execute(self.sql_select_for_update, (self.tenant_id, key))
        row = cur.fetchone()
        mid, version = row[col["id"]], row[col["version"]] + 1
        cur.execute(self.sql_write, (self.Jsonb(value), search_text, version, now, mid))
        cur.execute(
            self.sql_version, (self.tenant_id, mid, version, self.Jsonb(value), "write", "api_key", self.key_id, now)
        )
        cur.fetchone()
        cur.execute(
            self.sql_audit,
            self._audit_params(
                action="memory.write",
                key=key,
                subject=row[col["subject"]],
                version=version,
                detail={"created": False},
                now=now,
            ),
        )
        cur.fetchone()
        self.conn.commit()
        return time.perf_counter_ns() - t0

    def pk_select(self, memory_id: int) -> int:
        t0 = time.perf_counter_ns()
        self.accur.execute(self.sql_select_pk, (memory_id,))
        self.accur.fetchone()
        return time.perf_counter_ns() - t0


# --- connection watch -------------------------------------------------------------------


class ConnWatch:
    """New PostgreSQL connections to the bench database during a phase, two ways:
    the ``sessions`` counter of pg_stat_database (every session ever established), and
    backends seen in pg_stat_activity with ``backend_start`` after the phase began
    (polled, so even short-lived ones are caught when they live ≥ one poll interval)."""

    POLL_S = 0.1

    def __init__(self, conninfo: str, exclude_pids: set[int]):
        import psycopg

        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.exclude = set(exclude_pids) | {self.conn.info.backend_pid}
        self.lock = threading.Lock()

    def close(self):
        self.conn.close()

    def _one(self, sql, params=()):
        with self.lock:
            cur = self.conn.execute(sql, params)
            return cur.fetchall()

    def sessions(self) -> int:
        self._one("SELECT pg_stat_clear_snapshot()")
        return self._one("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")[0][0]

    def client_backends(self) -> dict[int, datetime]:
        rows = self._one(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend'"
        )
        return {pid: start for pid, start in rows if pid not in self.exclude}

    def start(self):
        self.since = self._one("SELECT now()")[0][0]
        self.sessions0 = self.sessions()
        self.backends0 = self.client_backends()
        self.new_pids: set[int] = set()
        self.stop_evt = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        deadline = time.monotonic() + 3600  # bounded even if stop() is never called
        while not self.stop_evt.is_set() and time.monotonic() < deadline:
            for pid, started in self.client_backends().items():
                if started >= self.since:
                    self.new_pids.add(pid)
            self.stop_evt.wait(self.POLL_S)

    def stop(self, settle_s: float = 1.2) -> dict:
        self.stop_evt.set()
        self.thread.join(timeout=5)
        backends1 = self.client_backends()
        for pid, started in backends1.items():
            if started >= self.since:
                self.new_pids.add(pid)
        # A new backend reports its session when it first goes idle; give it that moment.
        time.sleep(settle_s)
        sessions1 = self.sessions()
        return {
            "new_sessions_pg_stat_database": sessions1 - self.sessions0,
            "new_backends_seen_pg_stat_activity": len(self.new_pids),
            "client_backends_before": len(self.backends0),
            "client_backends_after": len(backends1),
        }

    def server_backend_pids(self) -> list[int]:
        return sorted(self.client_backends())


# --- the command ------------------------------------------------------------------------


class Command(BaseCommand):
    help = (
        "Benchmark memory_read/memory_write over HTTP (uvicorn, started here) against the same "
        "statements run raw with psycopg, the audit insert's cost, and concurrent throughput. "
        "Needs DATABASE_URL=postgres://..."
    )

    def add_arguments(self, parser):
        parser.add_argument("--n", type=int, default=2000, help="latency samples per operation (default 2000)")
        parser.add_argument("--concurrency", type=int, default=16, help="clients in the throughput phase (16)")
        parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
        parser.add_argument("--port", type=int, default=0, help="server port on 127.0.0.1 (default: a free one)")
        parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes (default 2)")
        parser.add_argument("--warmup", type=int, default=300, help="warm-up iterations before measuring (300)")
        parser.add_argument("--keys", type=int, default=100, help="seeded keys read and written in rotation (100)")
        parser.add_argument("--tput-seconds", type=float, default=10.0, help="throughput phase length cap (10 s)")
        parser.add_argument("--tput-requests", type=int, default=50000, help="throughput phase request cap (50000)")
        parser.add_argument(
            "--max-seconds", type=float, default=600.0, help="time cap of each latency phase, warm-up included (600 s)"
        )
        parser.add_argument(
            "--raw-binding",
            choices=["server", "client"],
            default="server",
            help="raw psycopg parameter binding: server (default; prepared after 5 runs) or client "
            "(literals inlined, as Django's default cursor does)",
        )
        parser.add_argument("--access-log", action="store_true", help="keep uvicorn's access log on")
        parser.add_argument(
            "--interface",
            choices=["asgi", "wsgi"],
            default="asgi",
            help="asgi (default, as deployed: zeromem.asgi:application) or wsgi (zeromem.wsgi:application "
            "under uvicorn --interface wsgi, for comparison)",
        )
        parser.add_argument(
            "--uvicorn-args",
            default="",
            help='extra uvicorn arguments, e.g. "--http mypkg.proto:NoDelayH11Protocol" (host stays 127.0.0.1)',
        )
        parser.add_argument("--seed", type=int, default=1, help="shuffle seed")

    # ------------------------------------------------------------------ entry point

    def handle(self, *args, **opts):
        if not os.environ.get("DATABASE_URL") or connection.vendor != "postgresql":
            raise CommandError(
                "bench measures the production shape and needs PostgreSQL: set "
                "DATABASE_URL=postgres://user@127.0.0.1:5432/dbname (SQLite is not supported)."
            )
        for name in ("n", "concurrency", "workers", "keys"):
            if opts[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be at least 1")
        if opts["n"] > 1_000_000 or opts["concurrency"] > 256 or opts["tput_seconds"] > 600:
            raise CommandError("keep --n ≤ 1e6, --concurrency ≤ 256 and --tput-seconds ≤ 600")
        self.opts = opts
        self.rng = random.Random(opts["seed"])
        self.log = (lambda msg: self.stderr.write(msg)) if opts["json"] else (lambda msg: self.stdout.write(msg))

        db = settings.DATABASES["default"]
        from psycopg.conninfo import make_conninfo

        self.conninfo = make_conninfo(
            dbname=db["NAME"],
            user=db.get("USER") or None,
            password=db.get("PASSWORD") or None,
            host=db.get("HOST") or None,
            port=str(db["PORT"]) if db.get("PORT") else None,
        )
        host = db.get("HOST") or ""
        if host and host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("/"):
            self.log(f"note: the database host is {host}, not loopback; figures include that network.")

        self.loadavg0 = [round(x, 2) for x in os.getloadavg()]
        self.setup_tenant()
        server = raw = watch = None
        # SIGTERM (e.g. a CI timeout) unwinds like Ctrl-C, so the server is always stopped.
        previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            raw = RawSQL(
                self.conninfo,
                client_binding=opts["raw_binding"] == "client",
                tenant_id=self.tenant.pk,
                key_id=self.api_key.pk,
                key_label=self.api_key.display_prefix,
            )
            self.release_django_connections()
            server = self.start_server()
            watch = ConnWatch(self.conninfo, raw.backend_pids())
            try:
                result = self.run_all(raw, watch, server)
                server["keep_log"] = False
            except (OSError, http.client.HTTPException) as exc:
                raise CommandError(
                    f"the benchmark failed talking to the server ({exc!r}); its log:\n{tail(server['log'])}"
                ) from exc
        finally:
            signal.signal(signal.SIGTERM, previous_sigterm)
            if watch is not None:
                watch.close()
            if raw is not None:
                raw.close()
            if server is not None:
                self.stop_server(server)
                if server.get("keep_log") is False:
                    Path(server["log"]).unlink(missing_ok=True)
                else:
                    self.stderr.write(f"server log kept: {server['log']}")
            self.revoke_key()
        if opts["json"]:
            self.stdout.write(json.dumps(result, indent=None, default=str))
        else:
            self.print_table(result)

    # ------------------------------------------------------------------ setup

    def setup_tenant(self):
        from memories import search, services
        from zeromem.kernel.actors import Actor

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
        from memories.models import Memory

        self.read_ids = dict(Memory.objects.filter(tenant=self.tenant, key__in=self.read_keys).values_list("key", "id"))
        self.read_bodies = {
            key: json.dumps({"name": "memory_read", "arguments": {"key": key}}).encode() for key in self.read_keys
        }
        # Write payloads, and what the service stores beside them (computed outside the timers).
        self.write_values = [{"text": "prefers concise answers; updated", "n": i} for i in range(64)]
        self.write_search = [
            {key: search.index_text(key=key, value=v) for key in self.write_keys} for v in self.write_values
        ]
        self.log(f"tenant {slug}: {2 * k} memories seeded")

    def release_django_connections(self):
        # This process keeps no server-side session open beyond the raw/watch connections.
        connection.close()
        close_pool = getattr(connection, "close_pool", None)
        if close_pool is not None:
            close_pool()

    def revoke_key(self):
        from memories import services
        from zeromem.kernel.actors import Actor

        try:
            services.api_key_revoke(tenant=self.tenant, actor=Actor.system(job="bench"), key_id=self.api_key.pk)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            self.stderr.write(f"could not revoke the bench key: {exc}")

    # ------------------------------------------------------------------ server

    def start_server(self) -> dict:
        return start_server(
            database_url=os.environ["DATABASE_URL"],
            workers=self.opts["workers"],
            port=self.opts["port"],
            interface=self.opts["interface"],
            access_log=self.opts["access_log"],
            uvicorn_args=self.opts["uvicorn_args"],
            log=self.log,
        )

    def stop_server(self, server: dict):
        stop_server(server)

    # ------------------------------------------------------------------ phases

    def run_all(self, raw: RawSQL, watch: ConnWatch, server: dict) -> dict:
        opts = self.opts
        import uvicorn

        try:
            import httptools  # noqa: F401

            http_impl = "httptools"
        except ImportError:
            http_impl = "h11"
        try:
            import uvloop  # noqa: F401

            loop_impl = "uvloop"
        except ImportError:
            loop_impl = "asyncio"

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
            "audit_select_audit_commit_vs_select_commit_p50": ratio(
                p("raw_select_audit_commit", 50), p("raw_select_commit", 50)
            ),
            "audit_raw_read_vs_raw_read_without_audit_p50": ratio(p("raw_read", 50), p("raw_read_no_audit", 50)),
            "counter_raw_read_vs_raw_read_without_counter_p50": ratio(p("raw_read", 50), p("raw_read_no_counter", 50)),
            "read_http_vs_healthz_p50": ratio(p("http_read", 50), p("http_healthz", 50)),
        }
        targets = {
            "read_p50": {
                "target": f"≤ {TARGET_READ_P50}×",
                "value": ratios["read_http_vs_raw_p50"],
                "ok": _le(ratios["read_http_vs_raw_p50"], TARGET_READ_P50),
            },
            "read_p99": {
                "target": f"≤ {TARGET_READ_P99}×",
                "value": ratios["read_http_vs_raw_p99"],
                "ok": _le(ratios["read_http_vs_raw_p99"], TARGET_READ_P99),
            },
            "write_p50": {
                "target": f"≤ {TARGET_WRITE_P50}×",
                "value": ratios["write_http_vs_raw_p50"],
                "ok": _le(ratios["write_http_vs_raw_p50"], TARGET_WRITE_P50),
            },
            "audit_raw_p50": {
                "target": f"≤ {TARGET_AUDIT}× (raw SQL proxy)",
                "value": ratios["audit_raw_read_vs_raw_read_without_audit_p50"],
                "ok": _le(ratios["audit_raw_read_vs_raw_read_without_audit_p50"], TARGET_AUDIT),
            },
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
                "workers": opts["workers"],
                "port": server["port"],
                "server": f"uvicorn {uvicorn.__version__} {opts['interface'].upper()} ({http_impl}, {loop_impl} "
                f"loop), --workers {opts['workers']}{'' if opts['access_log'] else ' --no-access-log'}"
                + (f" {opts['uvicorn_args']}" if opts["uvicorn_args"] else ""),
                "cache": settings.CACHES["default"]["BACKEND"].rsplit(".", 1)[-1]
                + (" (REDIS_URL)" if os.environ.get("REDIS_URL") else ""),
                "db_pool": settings.DATABASES["default"].get("OPTIONS", {}).get("pool"),
                "postgresql": pg_version,
                "raw_binding": opts["raw_binding"],
                "cpus": os.cpu_count(),
                "tenant": self.tenant.slug,
                "loadavg_at_start": self.loadavg0,
                "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
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
                "GET /healthz takes ≥ 30 ms: the ~40 ms delayed-ACK stall. uvicorn --workers N (N>1) binds its "
                "socket with proto=0, so asyncio does not set TCP_NODELAY on accepted connections and the "
                "response's header and body segments wait for the client's delayed ACK."
            )
        return out

    def _run_interleaved(self, ops: dict, iterations: int, warmup: int, on_measure=None) -> dict[str, Samples]:
        """Run every op once per iteration, in a fresh random order each time."""
        names = list(ops)
        samples = {name: Samples(name, ops[name][0]) for name in names}
        deadline = time.monotonic() + self.opts["max_seconds"]
        gc.collect()
        gc.disable()  # the client's GC pauses are not what we measure
        try:
            for i in range(-warmup, iterations):
                if i == 0 and on_measure is not None:
                    on_measure()
                if time.monotonic() > deadline:
                    self.log(f"  time cap reached after {i} iterations")
                    break
                order = names[:]
                self.rng.shuffle(order)
                for name in order:
                    ok, elapsed = ops[name][1](i)
                    if i >= 0:
                        if ok:
                            samples[name].ns.append(elapsed)
                        else:
                            samples[name].errors += 1
                if i % 512 == 0:
                    gc.collect()  # outside any timer
        finally:
            gc.enable()
        return samples

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
            out = self._run_interleaved(ops, self.opts["n"], self.opts["warmup"], on_measure)
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

        ops = {
            "http_write": ("POST /api/v1/tools/call memory_write (update)", http_write),
            "raw_write": ("SELECT FOR UPDATE + UPDATE + version INSERT + audit INSERT + COMMIT", raw_write),
        }
        try:
            return self._run_interleaved(ops, self.opts["n"], self.opts["warmup"])
        finally:
            self.reconnects += client.reconnects
            client.close()

    def phase_throughput(self, watch: ConnWatch, server: dict) -> dict:
        opts = self.opts
        conc, port = opts["concurrency"], server["port"]
        keys, nk = self.read_keys, len(self.read_keys)

        # The same keep-alive connections for the warm-up and the measured run: a worker's
        # share of the clients (hence the size its pool settles at) is fixed when they connect.
        clients = [HttpClient(port, self.raw_key) for _ in range(conc)]
        for client in clients:
            client.request("GET", "/healthz")

        def run(seconds: float, max_requests: int) -> dict:
            counter = iter(range(max_requests))
            lock = threading.Lock()
            start = threading.Barrier(conc + 1)
            lat: list[list[int]] = [[] for _ in range(conc)]
            errs = [0] * conc
            ends = [0] * conc

            def worker(t: int):
                client = clients[t]
                start.wait(timeout=30)
                stop_at = time.monotonic() + seconds
                j = t
                try:
                    while time.monotonic() < stop_at:
                        with lock:
                            if next(counter, None) is None:
                                break
                        key = keys[j % nk]
                        j += conc
                        try:
                            elapsed, status, body = client.request("POST", "/api/v1/tools/call", self.read_bodies[key])
                        except (OSError, http.client.HTTPException):
                            errs[t] += 1
                            continue
                        if status == 200:
                            lat[t].append(elapsed)
                        else:
                            errs[t] += 1
                finally:
                    ends[t] = time.perf_counter_ns()

            threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(conc)]
            for th in threads:
                th.start()
            start.wait(timeout=30)
            t0 = time.perf_counter_ns()
            for th in threads:
                th.join(timeout=seconds + 60)
            wall = (max(ends) - t0) / 1e9
            allns = sorted(x for sub in lat for x in sub)
            return {"ok": len(allns), "errors": sum(errs), "wall_s": wall, "lat": allns}

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
        warm_rounds = []
        for _ in range(6):
            before = watch.sessions()
            run(2.0, conc * 2000)
            time.sleep(1.1)  # a new backend reports its session when it first goes idle
            warm_rounds.append(watch.sessions() - before)
            if warm_rounds[-1] == 0:
                break

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
                "cpu_busy_pct": round(100 * (m1[0] - m0[0]) / (m1[1] - m0[1]), 1),
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
            "latency_ms": {
                "p50": round(percentile(res["lat"], 0.5), 3),
                "p95": round(percentile(res["lat"], 0.95), 3),
                "p99": round(percentile(res["lat"], 0.99), 3),
            },
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
            ("b) write", ["http_write", "raw_write"]),
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
        w(
            f"    new DB connections during the measured run: {cn['new_sessions_pg_stat_database']} "
            f"(pg_stat_database.sessions), {cn['new_backends_seen_pg_stat_activity']} (pg_stat_activity); "
            f"client backends {cn['client_backends_before']} → {cn['client_backends_after']}"
        )
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


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def _nagle_suspected(latency: dict) -> bool:
    # A trivial view answering in ≥ 30 ms with a ~1 ms floor elsewhere is the 40 ms delayed-ACK
    # stall of a response written in two segments without TCP_NODELAY.
    return latency["http_healthz"]["p50_ms"] >= 30 and latency["raw_select_commit"]["p50_ms"] < 10


def _le(value, bound) -> bool:
    return value is not None and value <= bound
