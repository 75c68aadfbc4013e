"""Small helpers shared by the test modules: reading state and checking answers (data is
built by tests/factories.py; fixtures live in conftest.py)."""

import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from django.db import connection, transaction

from audit.models import AuditEvent
from memories.models import Memory, MemoryVersion


def audit_tables_may_be_flushed(sender, connection, **kwargs):
    """``connection_created`` receiver (tests/conftest.py connects it): transactional tests end
    with `flush`, a TRUNCATE of every table, which the audit tables' append-only trigger
    refuses unless the session says so (audit migration 0005). Only TRUNCATE reads this;
    UPDATE and DELETE stay refused."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET zeromem.audit_mode = 'flush'")


def start_thread(
    work: Callable[[], object], failures: list, *, done: threading.Event | None = None
) -> threading.Thread:
    """``work()`` started in a thread of its own (so on a database connection of its own,
    closed when it ends); what it raises goes to ``failures`` for the main thread to assert
    on, and ``done`` is set when it ends, however it ends."""

    def run():
        try:
            work()
        except BaseException as exc:  # surfaced in the main thread
            failures.append(exc)
        finally:
            if done is not None:
                done.set()
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def lock_waiters() -> int:
    """Sessions of this database waiting on a lock now (PostgreSQL)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return cursor.fetchone()[0]


def wait_for_a_lock_waiter(what: str, *, alive: Callable[[], bool] = lambda: True, timeout: float = 20) -> None:
    """Return once some session waits on a lock (or ``alive()`` turns false: the job ended
    first); fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while lock_waiters() == 0 and alive():
        assert time.monotonic() < deadline, f"{what} never waited"
        time.sleep(0.02)


def row_counts() -> tuple[int, int]:
    """(Memory rows, MemoryVersion rows): compare before/after to prove nothing was written."""
    return Memory.objects.count(), MemoryVersion.objects.count()


def memory_rows(tenant, **filters) -> list[tuple]:
    """(key, version, deleted_at) of every Memory row of ``tenant`` matching ``filters``, sorted."""
    return sorted(Memory.objects.filter(tenant=tenant, **filters).values_list("key", "version", "deleted_at"))


def audit_count() -> int:
    return AuditEvent.objects.count()


def tool_error(body: dict) -> dict:
    """The error object of a refused tool call, after checking the envelope."""
    assert body["status"] == "error", body
    assert set(body["error"]) >= {"code", "message", "field"}, body
    return body["error"]


def rest_error(response) -> dict:
    body = response.json()
    assert set(body["error"]) >= {"code", "message", "field"}, body
    return body["error"]


@contextmanager
def rolled_back_module_data(django_db_blocker, build: Callable) -> Iterator:
    """What ``build()`` makes, for a module-scoped fixture: built once inside a transaction
    that is rolled back when the module is done (each test's own ``db`` transaction nests
    inside it, so a test's writes are undone before the next)."""
    with django_db_blocker.unblock():
        outer = transaction.atomic()
        outer.__enter__()
        try:
            built = build()
        except BaseException:
            transaction.set_rollback(True)
            outer.__exit__(None, None, None)
            raise
    try:
        yield built
    finally:
        with django_db_blocker.unblock():
            transaction.set_rollback(True)
            outer.__exit__(None, None, None)


# Redis tests use this database and fail, not skip, when no Redis answers there.
REDIS_TEST_URL = os.environ.get("ZEROMEM_TEST_REDIS_URL") or "redis://127.0.0.1:6379/7"


def redis_or_fail(url: str = REDIS_TEST_URL):
    """A client of the test Redis database, emptied; the test fails if Redis is missing."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.flushdb()
    except redis.RedisError as exc:
        pytest.fail(f"this test needs Redis at {url} (set ZEROMEM_TEST_REDIS_URL): {exc}")
    return client


def stop_process_group(process, *, grace: float) -> None:
    """Stop a server started with ``start_new_session=True``: SIGTERM to its main process (the
    graceful stop), ``grace`` seconds for it, then SIGKILL to whatever is left of its process
    group (a worker stuck in a task, a stray child)."""
    try:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


def free_port() -> int:
    """A free loopback port: inside ``ZEROMEM_TEST_PORTS`` (``18500-18599``) when set, so that
    servers started by tests stay in a range given to them; else any the OS picks."""
    import random
    import socket

    span = os.environ.get("ZEROMEM_TEST_PORTS", "")
    candidates = [0]
    if span:
        low, high = (int(part) for part in span.split("-"))
        candidates = random.sample(range(low, high + 1), high - low + 1)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in ZEROMEM_TEST_PORTS={span}")


PGBOUNCER = os.environ.get("ZEROMEM_PGBOUNCER_BIN", "/usr/sbin/pgbouncer")


class PgBouncer:
    """Debian's PgBouncer in transaction mode in front of the test's PostgreSQL server, on a
    free port, with its own ini and userlist in a fresh directory (``auth_type = trust``: the
    password check is PostgreSQL's, behind it). ``python3 -m zeromem test`` installs the
    package when it is missing (zeromem/__main__.py); without it the test fails naming it."""

    def __init__(self, *, host: str, port: int, user: str, password: str = "", pool_size: int = 10):
        import tempfile
        from pathlib import Path

        if not os.path.exists(PGBOUNCER):
            pytest.fail(f"{PGBOUNCER} is missing: install Debian's pgbouncer package (python3 -m zeromem test does)")
        self.dir = Path(tempfile.mkdtemp(prefix="zeromem-pgbouncer-"))
        self.dir.chmod(0o755)  # readable by the user it runs as (below)
        self.port = free_port()
        (self.dir / "userlist.txt").write_text(f'"{user}" "{password}"\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={host or '127.0.0.1'} port={port or 5432}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.dir / 'userlist.txt'}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {pool_size}\nmax_client_conn = 500\n"
            # what Django/psycopg may send at connect that PgBouncer does not pass on itself
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        self.process: subprocess.Popen | None = None

    def start(self) -> "PgBouncer":
        import socket
        import time

        command = [PGBOUNCER, str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            import shutil

            shutil.chown(self.dir, "postgres")
            for path in self.dir.iterdir():
                shutil.chown(path, "postgres")
            command[1:1] = ["-u", "postgres"]
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"pgbouncer exited:\n{self.log()}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"pgbouncer did not listen within 15 s:\n{self.log()}")

    def url(self, database: str, user: str) -> str:
        return f"postgres://{user}@127.0.0.1:{self.port}/{database}"

    def log(self) -> str:
        path = self.dir / "pgbouncer.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        import shutil

        if self.process is not None:
            stop_process_group(self.process, grace=5)
        shutil.rmtree(self.dir, ignore_errors=True)


class FakeJSONEndpoint:
    """The outside world's HTTP API (an LLM vendor's), on a free loopback port: each POST's
    JSON body is kept in ``requests`` and answered with ``answer(body, n)`` (n counts from 1)
    as JSON. ``url`` is its base address; ``close()`` stops it."""

    def __init__(self, answer: Callable[[dict, int], dict], *, path: str = ""):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                fake.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                _reply(self, json.dumps(answer(fake.requests[-1], len(fake.requests))).encode(), "application/json")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _reply(handler, body: bytes, content_type: str) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class ForeignSite(FakeJSONEndpoint):
    """Another site's page (``html``, answered to every GET) on a free loopback port:
    ``url``; ``close()`` stops it."""

    def __init__(self, html: str):
        super().__init__(lambda body, n: {})
        page = html.encode()
        self.server.RequestHandlerClass.do_GET = lambda handler: _reply(handler, page, "text/html")


class FakeOtlpCollector:
    """An OpenTelemetry collector's OTLP/HTTP traces endpoint, on a free loopback port
    (:func:`free_port`): each POST to ``/v1/traces`` is kept as it arrived (``bodies``: the
    raw bytes, to search for what must never leave) and decoded with opentelemetry-proto
    (``spans``: one dict per span). ``endpoint`` is the base URL (OTEL_EXPORTER_OTLP_ENDPOINT)."""

    def __init__(self):
        import gzip
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.bodies: list[bytes] = []
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with fake.lock:
                    fake.bodies.append(body)
                    fake.spans.extend(_decoded_spans(request))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def payload(self) -> bytes:
        with self.lock:
            return b"".join(self.bodies)

    def wait_for(self, predicate: Callable[[list[dict]], bool], timeout: float = 20.0) -> list[dict]:
        """The spans once ``predicate(spans)`` holds (the exporter sends in batches)."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def clear(self) -> None:
        with self.lock:
            self.bodies.clear()
            self.spans.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _any_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def _decoded_spans(request) -> list[dict]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _any_value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    {
                        "name": span.name,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_id": span.parent_span_id.hex(),
                        "kind": span.kind,
                        "attributes": {kv.key: _any_value(kv.value) for kv in span.attributes},
                        "status": span.status.code,
                        "status_message": span.status.message,
                        "events": [
                            {"name": e.name, "attributes": {kv.key: _any_value(kv.value) for kv in e.attributes}}
                            for e in span.events
                        ],
                        "scope": scope_spans.scope.name,
                        "resource": resource,
                    }
                )
    return spans


def copy_memory(template: Memory, copies: int, expires_step: str = "") -> None:
    """PostgreSQL: ``copies`` rows of ``template`` in one INSERT … SELECT (a big tenant in a
    second, no versions, audit or search terms): keys ``<key>-<n>``; with ``expires_step``
    (an interval, "1 second") the n-th copy expires n steps after the template."""
    columns = [
        connection.ops.quote_name(f.column)
        for f in Memory._meta.concrete_fields
        if not f.primary_key and not getattr(f, "generated", False)
    ]
    copied = {'"key"': "key || '-' || g"}
    if expires_step:
        copied['"expires_at"'] = "expires_at + g * %s::interval"
    select = ", ".join(copied.get(c, c) for c in columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO memories_memory ({', '.join(columns)}) SELECT {select} "  # noqa: S608 (the model's columns)
            "FROM memories_memory, generate_series(1, %s) AS g WHERE id = %s",
            [*([expires_step] if expires_step else []), copies, template.pk],
        )


def fresh_memory_table() -> None:
    """Inside a test's transaction on PostgreSQL: memories_memory (and what references it)
    as a new, empty table with unbloated indexes, for a test about query plans. The sizes the
    planner reads (pg_class's pages and tuples) are not transactional: earlier tests' rolled
    back rows leave the table and its indexes larger than what they hold, and a plan test then
    measures that history. TRUNCATE is transactional: the test's end brings the old table back."""
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE memories_memory CASCADE")


def other_session(**kwargs):
    """A psycopg connection of its own to the test database (PostgreSQL), as another process
    would have: outside Django, in a transaction unless ``autocommit=True``."""
    import psycopg  # PostgreSQL's tests only

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**params, **kwargs)


class RoundTrips:
    """The messages a block sends to PostgreSQL, from libpq's protocol trace. ``count``: the
    round trips — the times the client sent something that asks for an answer (a simple
    ``Query``: BEGIN, COMMIT, SAVEPOINT; a ``Sync``: an extended-protocol statement) and then
    read the server's. Statements sent together (libpq's pipeline mode: several ``Sync`` before
    any answer is read) are one round trip; ``syncs`` counts each."""

    def __enter__(self):
        connection.ensure_connection()
        self._file = tempfile.TemporaryFile(mode="w+")
        pgconn = connection.connection.pgconn
        pgconn.trace(self._file.fileno())
        from psycopg import pq  # PostgreSQL's tests only

        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        return self

    def __exit__(self, *exc):
        connection.connection.pgconn.untrace()
        self._file.seek(0)
        lines = [line.split("\t") for line in self._file.read().splitlines() if line[:2] in ("F\t", "B\t")]
        self._file.close()
        self.sent = [parts for parts in lines if parts[0] == "F"]
        self.syncs = sum(1 for parts in self.sent if parts[2].startswith(("Query", "Sync")))
        self.count, asking = 0, False
        for parts in lines:
            if parts[0] == "F":
                asking = asking or parts[2].startswith(("Query", "Sync"))
            elif asking:  # the server's answer read: one round trip
                self.count, asking = self.count + 1, False
        self.count += asking  # sent, its answer not read in the block
        self.statements = [p[3] for p in self.sent if p[2].startswith("Query") or p[2].startswith("Parse")]
