"""OpenTelemetry traces (README "Traces", zeromem/kernel/tracing.py): the real SDK, the real
OTLP/HTTP exporter and instrumentations, exporting to a fake collector on a loopback port
(tests/helpers.py ``FakeOtlpCollector``, which decodes each export with opentelemetry-proto).

In this process, tracing is set up once for the module (the global tracer provider can be set
once per process) and shut down after it; the setting off, and ``serve``'s own processes, are
checked in child processes.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from django.conf import settings
from django.db import connection, connections
from django.test import override_settings

from memories import services
from tests.factories import SYSTEM, make_key, make_keyed_client, make_tenant, write
from tests.helpers import FakeOtlpCollector, free_port, stop_process_group
from tests.test_serve import Served, _database_url
from zeromem.kernel import tracing

KEY = "user:u10086:pref_lang"
VALUE = "zh-CN-canary-4471"
SECRETS = (b"u10086", b"pref_lang", b"canary-4471")
SERVER, CLIENT = 2, 3  # the protobuf's SpanKind values
STATUS_ERROR = 2


def _close_connections() -> None:
    # psycopg connections are traced from their connect(): drop the ones opened before (and,
    # after the module, the traced ones), pools included.
    for conn in connections.all(initialized_only=True):
        conn.close()
        if getattr(conn, "pool", None) is not None and conn.vendor == "postgresql":
            conn.close_pool()


@pytest.fixture(scope="module")
def collector():
    fake = FakeOtlpCollector()
    overrides = override_settings(
        ZEROMEM_TRACING=True,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=fake.endpoint,
        OTEL_SERVICE_NAME="zeromem-test",
        OTEL_TRACES_SAMPLER="always_on",
    )
    overrides.enable()
    try:
        assert tracing.setup()
        tracing.connect_tasks()
        _close_connections()
        yield fake
    finally:
        tracing.shutdown()
        overrides.disable()
        _close_connections()
        fake.close()


@pytest.fixture
def spans(collector):
    """The spans exported by the test so far (flushed first)."""
    assert tracing.flush()  # what earlier tests and fixtures ended is not this test's
    collector.clear()

    def exported() -> list[dict]:
        assert tracing.flush()
        return collector.spans

    return exported


def _one(spans: list[dict], name: str) -> dict:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, (name, [s["name"] for s in spans])
    return found[0]


def _children(spans: list[dict], parent: dict) -> list[dict]:
    return [s for s in spans if s["parent_id"] == parent["span_id"]]


def _assert_nothing_personal(collector: FakeOtlpCollector) -> None:
    payload = collector.payload()
    assert payload, "nothing was exported"
    for secret in SECRETS:
        assert secret not in payload, secret


@pytest.mark.django_db
def test_a_tool_call_is_one_trace_request_tool_service_and_sql(spans, collector):
    tenant = make_tenant("trace-acme")
    write(tenant, KEY, VALUE)
    client, _ = make_keyed_client(tenant)
    response = client.post(
        "/api/v1/tools/call",
        {"name": "memory_read", "arguments": {"key": KEY}},
        headers={"X-Request-ID": "req-trace-1"},
    )
    assert response.status_code == 200 and response.json()["value"] == VALUE
    exported = spans()

    request = _one(exported, "POST api/v1/tools/call")
    assert request["kind"] == SERVER and request["parent_id"] == ""
    assert request["attributes"]["http.route"] == "api/v1/tools/call"
    # The id the client got back (its own id, prefixed by the server's: zeromem/kit/http.py).
    assert request["attributes"]["zeromem.request_id"] == response["X-Request-ID"]
    assert response["X-Request-ID"].endswith("req-trace-1")
    assert 200 in (
        request["attributes"].get("http.status_code"),
        request["attributes"].get("http.response.status_code"),
    )
    assert request["resource"]["service.name"] == "zeromem-test"

    tool = _one(exported, "tool memory_read")
    assert tool["parent_id"] == request["span_id"] and tool["trace_id"] == request["trace_id"]
    assert tool["attributes"] == {
        "zeromem.tool": "memory_read",
        "zeromem.outcome": "ok",
        "zeromem.tenant": "trace-acme",
    }

    read = _one([s for s in exported if s["trace_id"] == request["trace_id"]], "memory.read")
    assert read["parent_id"] == tool["span_id"]
    assert read["attributes"] == {
        "zeromem.action": "memory.read",
        "zeromem.outcome": "ok",
        "zeromem.tenant": "trace-acme",
    }

    if connection.vendor == "postgresql":
        sql = [s for s in exported if s["trace_id"] == request["trace_id"] and s["kind"] == CLIENT]
        assert sql, "no SQL span in the request's trace"
        under_read = _children(exported, read)
        assert under_read and all(s["attributes"]["db.system"] == "postgresql" for s in under_read)
        statements = [s["attributes"].get("db.statement") or s["attributes"].get("db.query.text") for s in under_read]
        assert any("memories_memory" in text for text in statements), statements
        assert not any(key.startswith("db.statement.param") for s in sql for key in s["attributes"])
    _assert_nothing_personal(collector)


@pytest.mark.django_db
def test_a_read_by_key_is_named_by_its_route_and_its_path_never_leaves(spans, collector):
    tenant = make_tenant("trace-rest")
    write(tenant, KEY, VALUE)
    client, _ = make_keyed_client(tenant)
    assert client.get(f"/api/v1/memories/{KEY}?fields=value").status_code == 200
    assert client.get("/api/v1/memories", params={"prefix": "user:u10086:"}).status_code == 200
    exported = spans()

    route = "api/v1/memories/<str:key>"
    request = _one(exported, f"GET {route}")
    assert request["attributes"]["http.route"] == route
    for dropped in tracing.DROPPED_ATTRIBUTES:
        assert dropped not in request["attributes"]
    read = _one(exported, "memory.read")
    assert read["trace_id"] == request["trace_id"]
    _assert_nothing_personal(collector)


@pytest.mark.django_db
def test_outcomes_not_found_and_a_refused_call_without_the_callers_words(spans, collector):
    tenant = make_tenant("trace-miss")
    client, _ = make_keyed_client(tenant)
    assert client.call("memory_read", key=KEY)[1]["status"] == "not_found"
    status, body = client.call("memory_pilfer", key=KEY)
    assert status == 400 and body["error"]["code"] == "unknown_tool"
    exported = spans()

    missing = _one(exported, "tool memory_read")
    assert missing["attributes"]["zeromem.outcome"] == "not_found" and missing["status"] != STATUS_ERROR
    assert _one(exported, "memory.read")["attributes"]["zeromem.outcome"] == "not_found"
    refused = _one(exported, "tool")  # no registry tool named: the span keeps its bare name
    assert refused["attributes"] == {"zeromem.outcome": "error", "zeromem.tenant": "trace-miss"}
    assert refused["status"] == STATUS_ERROR
    assert b"memory_pilfer" not in collector.payload()
    _assert_nothing_personal(collector)


@pytest.mark.django_db
def test_a_job_runs_in_a_task_span_named_by_its_function(spans, collector, django_capture_on_commit_callbacks):
    tenant = make_tenant("trace-jobs")
    for i in range(3):
        write(tenant, f"session:s1:note{i}", f"{VALUE} {i}")
    client, _ = make_keyed_client(tenant)
    with django_capture_on_commit_callbacks(execute=True):  # the job is queued once committed
        status, body = client.call("memory_summarize", prefix="session:s1:")
    assert status == 200 and body["status"] == "ok", body
    exported = spans()

    tasks = [s for s in exported if "zeromem.task" in s["attributes"]]
    assert tasks, [s["name"] for s in exported]
    task = tasks[0]
    assert task["name"] == task["attributes"]["zeromem.task"] and task["name"].startswith("memories.")
    assert task["attributes"]["zeromem.outcome"] == "ok"
    assert task["attributes"]["zeromem.task_name"]  # django-q2's name of this run
    # The job's own work is inside its span (tasks run inline in tests: under the tool call).
    assert any(s["parent_id"] == task["span_id"] for s in exported)
    _assert_nothing_personal(collector)


def test_log_lines_carry_the_trace_id_of_their_span(spans):
    from zeromem.kit.logs import RequestIdFilter

    record = logging.LogRecord("zeromem", logging.INFO, __file__, 1, "inside", None, None)
    with tracing.span("probe"):
        RequestIdFilter().filter(record)
    assert record.trace_id == _one(spans(), "probe")["trace_id"]
    outside = logging.LogRecord("zeromem", logging.INFO, __file__, 1, "outside", None, None)
    RequestIdFilter().filter(outside)
    assert outside.trace_id == ""


JSON_LOG_PROBE = textwrap.dedent(
    """
    import logging
    import django
    django.setup()
    from zeromem.kernel import tracing
    assert tracing.setup()
    with tracing.span("probe"):
        logging.getLogger("zeromem.probe").warning("inside a span")
    logging.getLogger("zeromem.probe").warning("outside")
    assert tracing.flush()
    """
)


def test_json_log_lines_carry_the_trace_id_when_tracing(tmp_path):
    fake = FakeOtlpCollector()
    try:
        done = _probe(
            JSON_LOG_PROBE,
            tmp_path,
            DJANGO_SETTINGS_MODULE="zeromem.settings",
            ZEROMEM_TRACING="true",
            ZEROMEM_LOG_FORMAT="json",
            OTEL_EXPORTER_OTLP_ENDPOINT=fake.endpoint,
        )
        lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
        inside = next(line for line in lines if line["message"] == "inside a span")
        outside = next(line for line in lines if line["message"] == "outside")
        assert inside["trace_id"] == _one(fake.spans, "probe")["trace_id"]
        assert outside["trace_id"] == "" and inside["request_id"] == ""
    finally:
        fake.close()


def _probe(code: str, tmp_path, *, drop=("OTEL_",), **variables) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python process on SQLite in ``tmp_path``, with this process's
    environment less the variables starting with ``drop``, plus ``variables``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(drop)}
    env.update(ZEROMEM_ENV="development", ZEROMEM_VAR_DIR=str(tmp_path), PYTHONPATH=str(settings.BASE_DIR), **variables)
    env.pop("DATABASE_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=settings.BASE_DIR, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done


# --- the setting off: nothing of OpenTelemetry's SDK runs or is imported -----------------

OFF_PROBE = textwrap.dedent(
    """
    import json, sys
    import zeromem.wsgi  # builds Django's middleware chain, as a server process does
    from django.test import Client
    from zeromem.kernel import tracing
    from memories import tools

    client = Client()
    statuses = [
        client.get("/healthz").status_code,
        client.post("/api/v1/tools/call", {"name": "memory_read", "arguments": {"key": "k"}},
                    content_type="application/json").status_code,
    ]
    with tracing.span("probe", tenant="t") as span:
        span.set("outcome", "ok")
    loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.instrumentation",
                                                            "opentelemetry.exporter")))
    print(json.dumps({"on": tracing.on(), "span": type(span).__name__, "loaded": loaded, "statuses": statuses}))
    """
)


def test_with_tracing_off_nothing_of_the_sdk_is_imported_or_exported(tmp_path):
    fake = FakeOtlpCollector()
    try:
        done = _probe(
            OFF_PROBE,
            tmp_path,
            drop=("OTEL_", "ZEROMEM_TRACING"),
            ZEROMEM_EMBEDDINGS="off",
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=fake.endpoint,
            OTEL_BSP_SCHEDULE_DELAY="50",
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["statuses"][0] in (200, 503) and result["statuses"][1] in (401, 503), result
        assert result == {**result, "on": False, "span": "_NoSpan", "loaded": []}
        assert fake.bodies == []
    finally:
        fake.close()


def test_the_settings_refuse_what_is_not_installed_and_the_standard_off_switches_win(tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    base.update(ZEROMEM_ENV="development", ZEROMEM_VAR_DIR=str(tmp_path), ZEROMEM_TRACING="true")
    base.pop("DATABASE_URL", None)
    probe = "from django.conf import settings; print(settings.ZEROMEM_TRACING)"
    for extra, named in (
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG"),
    ):
        done = subprocess.run(
            [sys.executable, "manage.py", "shell", "--no-imports", "-c", probe],
            cwd=settings.BASE_DIR,
            env={**base, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0 and named in done.stderr, (extra, done.stderr[-500:])
    for off in ({"OTEL_TRACES_EXPORTER": "none"}, {"OTEL_SDK_DISABLED": "true"}):
        done = subprocess.run(
            [sys.executable, "manage.py", "shell", "--no-imports", "-c", probe],
            cwd=settings.BASE_DIR,
            env={**base, **off},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (done.returncode, done.stdout.strip()) == (0, "False"), (off, done.stderr[-500:])


# --- serve: each granian worker process traces, the MCP endpoint included ------------------


def _post(port: int, path: str, body: dict, headers: dict) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read() or b"{}")
    finally:
        conn.close()


def _ancestors(spans: list[dict], span: dict) -> list[dict]:
    by_id = {s["span_id"]: s for s in spans}
    chain = []
    while span["parent_id"] in by_id:
        span = by_id[span["parent_id"]]
        chain.append(span)
    return chain


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_serve_traces_rest_and_mcp_tool_calls_from_each_worker_process(tmp_path):
    tenant = make_tenant("trace-serve")
    _key, raw = make_key(tenant)
    write(tenant, KEY, VALUE)
    fake = FakeOtlpCollector()
    server = Served(
        tmp_path,
        args=["--processes", "2", "--threads", "2"],
        env={
            "DATABASE_URL": _database_url(),
            "ZEROMEM_EMBEDDINGS": "off",
            "ZEROMEM_TRACING": "true",
            "OTEL_EXPORTER_OTLP_ENDPOINT": fake.endpoint,
            "OTEL_SERVICE_NAME": "zeromem-serve-test",
            "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: the batch leaves at once, not after 5 s
        },
    )
    server.port = free_port()
    server.env["PORT"] = str(server.port)
    try:
        server.start()
        auth = {"Authorization": f"Bearer {raw}"}
        rest = _post(server.port, "/api/v1/tools/call", {"name": "memory_read", "arguments": {"key": KEY}}, auth)
        assert rest[0] == 200 and rest[2]["value"] == VALUE
        call = {
            "jsonrpc": "2.0",
            "id": 7,
            "method": "tools/call",
            "params": {"name": "memory_read", "arguments": {"key": KEY}},
        }
        mcp = _post(server.port, "/mcp", call, {**auth, "Accept": "application/json, text/event-stream"})
        assert mcp[0] == 200 and VALUE in json.dumps(mcp[2]), mcp
        for _ in range(6):  # more requests, for both workers to answer some
            _post(server.port, "/api/v1/tools/call", {"name": "memory_list", "arguments": {}}, auth)

        def complete(spans: list[dict]) -> bool:
            tools = [s for s in spans if s["name"] == "tool memory_read"]
            return len(tools) == 2 and all(len(_ancestors(spans, t)) >= 1 for t in tools)

        spans = fake.wait_for(complete)
        assert complete(spans), [s["name"] for s in spans]
        by_request = {
            s["attributes"].get("zeromem.request_id"): s for s in spans if s["kind"] == SERVER and s["parent_id"] == ""
        }
        rest_span, mcp_span = by_request[rest[1]["x-request-id"]], by_request[mcp[1]["x-request-id"]]
        assert rest_span["name"] == "POST api/v1/tools/call"
        for top in (rest_span, mcp_span):
            tool = next(s for s in spans if s["name"] == "tool memory_read" and _ancestors(spans, s)[-1] is top)
            assert tool["attributes"]["zeromem.outcome"] == "ok"
            assert tool["attributes"]["zeromem.tenant"] == "trace-serve"
            read = next(s for s in spans if s["name"] == "memory.read" and s["parent_id"] == tool["span_id"])
            assert any(s["kind"] == CLIENT for s in _children(spans, read))  # its SQL
        # /mcp: the router's server span, the MCP SDK's span of the call, then ZeroMem's.
        mcp_tool = next(s for s in spans if s["name"] == "tool memory_read" and s["trace_id"] == mcp_span["trace_id"])
        assert [s["name"] for s in _ancestors(spans, mcp_tool)][-1] == mcp_span["name"]
        assert any(s["scope"] == "mcp-python-sdk" for s in _ancestors(spans, mcp_tool))
        # Each worker process exports its own spans (its own provider), never the server's parent.
        workers = set(server.worker_pids())
        exporters = {s["resource"]["process.pid"] for s in spans}
        assert exporters <= workers and server.process.pid not in exporters, (exporters, workers)
        assert {s["resource"]["service.name"] for s in spans} == {"zeromem-serve-test"}
        _assert_nothing_personal(fake)
    finally:
        server.stop()
        fake.close()


# --- django-q2: each worker process sets up its own provider; a task is one span ----------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_qcluster_worker_traces_each_task_in_a_span_of_its_own_process(tmp_path, monkeypatch):
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", False)  # enqueued for the real cluster below
    tenant = make_tenant("trace-cluster")
    for i in range(3):
        write(tenant, f"session:s9:note{i}", f"{VALUE} {i}")
    fake = FakeOtlpCollector()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        DATABASE_URL=_database_url(),
        ZEROMEM_ENV="development",
        REDIS_URL="",  # the ORM broker
        ZEROMEM_VAR_DIR=str(tmp_path / "var"),
        ZEROMEM_EMBEDDINGS="off",
        Q_WORKERS="1",
        DB_POOL_MIN_SIZE="1",
        ZEROMEM_TRACING="true",
        OTEL_EXPORTER_OTLP_ENDPOINT=fake.endpoint,
        OTEL_SERVICE_NAME="zeromem-worker-test",
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    log = tmp_path / "qcluster.log"
    with open(log, "wb") as out:
        cluster = subprocess.Popen(
            [sys.executable, "manage.py", "qcluster"],
            cwd=settings.BASE_DIR,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        services.summarize_start(tenant=tenant, actor=SYSTEM, prefix="session:s9:")  # queued once committed

        def task_done(spans: list[dict]) -> bool:
            return any(s["attributes"].get("zeromem.task") for s in spans)

        spans = fake.wait_for(task_done, timeout=60)
        assert task_done(spans), log.read_text(errors="replace")[-3000:]
        task = next(s for s in spans if s["attributes"].get("zeromem.task"))
        assert task["name"] == "memories.tasks.summarize_task" and task["parent_id"] == ""
        assert task["attributes"]["zeromem.outcome"] == "ok"
        inside = [s for s in spans if s["trace_id"] == task["trace_id"] and s is not task]
        assert any(s["name"] == "summary.write" or s["kind"] == CLIENT for s in inside), [s["name"] for s in inside]
        # Exported by the worker itself (forked by the sentinel, set up by post_spawn).
        assert task["resource"]["process.pid"] not in (cluster.pid, os.getpid())
        assert task["resource"]["service.name"] == "zeromem-worker-test"
        payload = fake.payload()
        assert b"canary-4471" not in payload and b"session:s9" not in payload
    finally:
        stop_process_group(cluster, grace=10)
        fake.close()
