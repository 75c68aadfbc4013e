"""Running as a fleet (README "Running as a fleet"): several web instances on one database,
PgBouncer in transaction mode, reads sent to a replica, and the metrics that watch it all.

The servers are real ``python3 -m zeromem serve`` processes (tests/test_serve.py's ``Served``)
on the pytest database; PgBouncer is Debian's, started here on a free port.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.db import connection, connections
from django.test import Client
from django.test.utils import CaptureQueriesContext

from audit.models import AuditEvent
from audit.seals import unsealed_q
from memories import keyring, services
from memories.models import ApiKey, DataKey, Tenant
from tests.factories import SYSTEM, make_key, make_keyed_client, make_tenant, write
from tests.helpers import PgBouncer, free_port
from tests.test_serve import ROOT, Served, _database_url, _request
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import InvalidInput
from zeromem.kernel.outcomes import ActorKind
from zeromem.kernel.replica import REPLICA, reads_go_to, replica_reads
from zeromem.kernel.scopes import ALL_SCOPES, TENANT_SCOPES

LIST = {"name": "memory_list", "arguments": {}}


def _operator_key(tenant) -> str:
    _key, raw = services.api_key_create(tenant=tenant, actor=SYSTEM, name="prometheus", scopes=["metrics:read"])
    return raw


def _serve(tmp_path: Path, name: str, *args: str, _started: list, **env: str) -> Served:
    # Words-only search: the embedding model's load (seconds of CPU) is not what is tested here.
    server = Served(tmp_path / name, args=list(args), env={"ZEROMEM_EMBEDDINGS": "off", **env})
    server.port = free_port()  # in ZEROMEM_TEST_PORTS when given
    server.env["PORT"] = str(server.port)
    _started.append(server)  # stopped by the fixture even if it never answers
    return server.start()


@pytest.fixture
def fleet(tmp_path):
    """Start servers: ``fleet(name, *args, **env)`` one, ``fleet.together(n, *args, **env)``
    ``n`` alike at once (their start-ups overlap)."""
    started: list = []

    def start(name: str, *args: str, **env: str) -> Served:
        server = _serve(tmp_path, name, *args, **env, _started=started)
        return server

    def together(n: int, *args: str, **env: str) -> list[Served]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda i: start(f"s{i}", *args, **env), range(n)))

    start.together = together
    yield start
    for server in reversed(started):
        server.stop()


def _spread(ports: list[int], key: str, n: int, body: dict = LIST) -> list[int]:
    """``n`` tool calls released at once from ``n`` threads, spread over ``ports`` in turn."""
    gate = threading.Barrier(n)
    statuses: list[int] = []

    def one(port: int):
        gate.wait()
        statuses.append(_request(port, "POST", "/api/v1/tools/call", key=key, body=body, timeout=60)[0])

    threads = [threading.Thread(target=one, args=(ports[i % len(ports)],)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    return sorted(statuses)


# --- 1. two instances on one database ------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_instances_share_the_rate_limit_exactly_and_a_revocation_within_the_key_cache_bound(fleet):
    """The limits counted in PostgreSQL (no REDIS_URL); Redis counts them exactly across
    processes in tests/test_serve.py (test_80_parallel_requests_…[redis]), the same code
    whether the processes belong to one server or two."""
    redis_url = ""
    tenant = make_tenant("fleet-two")
    key, raw = make_key(tenant)
    ttl = 1.0
    env = {
        "DATABASE_URL": _database_url(),
        "REDIS_URL": redis_url,
        "ZEROMEM_RATE_LIMIT_PER_MINUTE": "20",
        "ZEROMEM_API_KEY_CACHE_SECONDS": str(ttl),
    }
    a, b = fleet.together(2, "--processes", "1", "--threads", "4", **env)  # two instances, one database

    # A revoked key stops working on both within the key cache's TTL: each instance has it
    # cached (a request each), the revocation is made by a third process (this one).
    other, other_raw = make_key(tenant, name="revoked")
    for server in (a, b):
        assert _request(server.port, "POST", "/api/v1/tools/call", key=other_raw, body=LIST)[0] == 200
    assert services.api_key_revoke(tenant=tenant, actor=SYSTEM, key_id=other.pk)
    time.sleep(ttl + 0.1)
    for server in (a, b):
        status, body = _request(server.port, "POST", "/api/v1/tools/call", key=other_raw, body=LIST)
        assert status == 401, (server.port, body)

    # The limit of 20 a minute holds exactly over a stream spread across both instances.
    while time.time() % 60 > 50:  # all 60 in one window
        time.sleep(0.5)
    statuses = _spread([a.port, b.port], raw, 60)
    assert statuses.count(200) == 20 and statuses.count(429) == 40, statuses
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None


# --- 4. metrics ------------------------------------------------------------------------------


def _samples(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if not m:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.mark.django_db
def test_metrics_answer_only_to_a_key_with_the_metrics_scope_and_carry_no_tenant_data():
    tenant = make_tenant("fleet-metrics-secret")
    agent, _key = make_keyed_client(tenant, scopes=TENANT_SCOPES)
    answers = [
        agent.post("/api/v1/tools/call", {"name": "memory_write", "arguments": {"key": "user:u1:x", "value": 1}}),
        agent.post("/api/v1/tools/call", {"name": "no_such_tool", "arguments": {}}),
    ]
    sizes = [int(a["ZeroMem-Result-Bytes"]) for a in answers]
    tokens = [int(a["ZeroMem-Result-Tokens"]) for a in answers]

    assert Client().get("/metrics").status_code == 401
    denied = agent.get("/metrics")
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "missing_scope"

    scraper = Client(HTTP_AUTHORIZATION=f"Bearer {_operator_key(tenant)}")
    response = scraper.get("/metrics")
    assert response.status_code == 200, response.content
    text = response.content.decode()
    assert _samples(text, "zeromem_tool_calls_total", tool="memory_write", outcome="ok") >= 1
    assert _samples(text, "zeromem_tool_calls_total", tool="unknown", outcome="error") >= 1
    assert _samples(text, "zeromem_http_requests_total", route="api/v1/tools/call", status="200") >= 1
    assert _samples(text, "zeromem_http_requests_total", route="api/v1/tools/call", status="400") >= 1
    assert _samples(text, "zeromem_http_requests_total", route="metrics", status="403") >= 1
    assert _samples(text, "zeromem_audit_unsealed_events") >= 1  # the write's event
    # What the results cost the models, as the responses said (ZeroMem-Result-Tokens).
    assert _samples(text, "zeromem_tool_results_total", surface="rest") >= 2
    assert _samples(text, "zeromem_tool_result_tokens_total", surface="rest") >= sum(tokens)
    assert _samples(text, "zeromem_tool_result_bytes_total", surface="rest") >= sum(sizes)
    for gauge in ("zeromem_jobs_oldest_queued_age_seconds", "zeromem_forget_requests_overdue"):
        assert re.search(rf"^{gauge} ", text, re.M), gauge
    # No tenant, key or memory key in any label.
    assert "fleet-metrics-secret" not in text and "user:u1" not in text and "zm_" not in text


@pytest.mark.django_db
def test_metrics_count_the_data_keys_by_state_and_the_erasures():
    tenant = make_tenant("fleet-metrics-keys")
    scraper = Client(HTTP_AUTHORIZATION=f"Bearer {_operator_key(tenant)}")

    def data_keys() -> dict[str, float]:
        text = scraper.get("/metrics").content.decode()
        states = ("current", "retired", "destroyed")
        return {state: _samples(text, "zeromem_data_keys", state=state) for state in states}

    before = data_keys()
    for user in ("u1", "u2", "u3"):
        write(tenant, f"user:{user}:phone", f"+49 {user}", sensitive=True)  # a data key each
    keyring.shred(tenant_id=tenant.pk, subject="u1")  # a completed forget's erasure
    after = data_keys()
    assert after["current"] - before["current"] == 2
    assert after["destroyed"] - before["destroyed"] == 1
    assert sum(after.values()) == DataKey.objects.count()


@pytest.mark.django_db
def test_only_the_command_line_grants_the_operator_scope():
    tenant = make_tenant("fleet-scope")
    staff = Actor(kind=ActorKind.STAFF, id="1", label="admin", scopes=frozenset(ALL_SCOPES), surface="admin")
    with pytest.raises(InvalidInput) as refused:
        services.api_key_create(tenant=tenant, actor=staff, name="x", scopes=["metrics:read"])
    assert refused.value.field == "scopes" and "operator scope" in refused.value.message
    assert not ApiKey.objects.filter(tenant=tenant).exists()
    from memories.admin.api_keys import ApiKeyForm

    offered = {value for value, _label in ApiKeyForm.base_fields["scopes"].choices}
    assert "metrics:read" not in offered and "audit:read" in offered


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_metrics_are_added_up_across_the_processes_of_a_server(fleet):
    tenant = make_tenant("fleet-agg")
    scrape = _operator_key(tenant)
    server = fleet("agg", "--processes", "2", "--threads", "2", DATABASE_URL=_database_url(), ZEROMEM_LOG_FORMAT="json")
    deadline = time.monotonic() + 30
    while len(server.worker_pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = set(server.worker_pids())
    assert len(workers) == 2

    def healthz_answered() -> float:
        status, body = _request(server.port, "GET", "/metrics", key=scrape)
        assert status == 200, body
        return _samples(body.decode(), "zeromem_http_requests_total", route="healthz", status="200")

    before = healthz_answered()  # serve's own start-up probes
    # A new connection each, 8 at a time, until both processes have answered some: which
    # process accepts a connection is the kernel's choice (one sequential client was seen to
    # land on one process 60 times out of 60 on a busy machine).
    files = Path(server.env["ZEROMEM_VAR_DIR"]) / f"metrics-{server.port}"
    n = 0
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(max_workers=8) as pool:
        while True:
            statuses = list(pool.map(lambda _: _request(server.port, "GET", "/healthz")[0], range(24)))
            assert statuses == [200] * 24
            n += 24
            writers = {int(p.stem.rsplit("_", 1)[1]) for p in files.glob("counter_*.db")}
            if writers == workers or time.monotonic() > deadline:
                break
    # Each process wrote its own file, and /metrics added them up: every request counted once.
    assert writers == workers, (writers, workers)
    assert healthz_answered() - before == n

    # ZEROMEM_LOG_FORMAT=json: a request's log line is a JSON object naming its request id.
    client = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    client.request("GET", "/api/v1/no-such-endpoint", headers={"Authorization": f"Bearer {scrape}"})
    answer = client.getresponse()
    answer.read()
    client.close()
    assert answer.status == 404
    request_id = answer.headers["X-Request-ID"]
    deadline = time.monotonic() + 10
    lines: list[dict] = []
    while time.monotonic() < deadline and not lines:
        lines = [
            json.loads(line)
            for line in server.log_path.read_text(errors="replace").splitlines()
            if line.startswith("{") and request_id in line
        ]
        time.sleep(0.1)
    assert lines and lines[0]["request_id"] == request_id and lines[0]["level"] == "WARNING", lines
    assert {"time", "logger", "message"} <= set(lines[0])


# --- 2. PgBouncer in transaction mode --------------------------------------------------------


@pytest.fixture
def pgbouncer():
    db = connection.settings_dict
    bouncer = PgBouncer(host=db["HOST"], port=db["PORT"], user=db["USER"], password=db["PASSWORD"] or "").start()
    yield bouncer
    bouncer.stop()


def _call(port: int, api_key: str, name: str, **arguments):
    body = {"name": name, "arguments": arguments}
    status, body = _request(port, "POST", "/api/v1/tools/call", key=api_key, body=body)
    return status, json.loads(body)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_api_works_through_pgbouncer_in_transaction_mode(fleet, pgbouncer, tmp_path):
    tenant = make_tenant("fleet-pgb")
    _key, raw = make_key(tenant, scopes=TENANT_SCOPES)
    url = pgbouncer.url(connection.settings_dict["NAME"], connection.settings_dict["USER"])

    # Without the setting, serve sees the pooler (its port is not PostgreSQL's) and refuses.
    refused = Served(tmp_path / "refused", args=["--processes", "1"], env={"DATABASE_URL": url}).run()
    assert refused.returncode == 3 and "ZEROMEM_PGBOUNCER" in refused.stderr, refused.stderr

    env = {"DATABASE_URL": url, "ZEROMEM_PGBOUNCER": "true", "REDIS_URL": ""}
    server = fleet("pgb", "--processes", "1", "--threads", "4", **env)
    port = server.port
    # Tool calls
    assert _call(port, raw, "memory_write", key="user:u1:pref", value={"lang": "fr"}, subject="u1")[1]["status"] == "ok"
    assert _call(port, raw, "memory_read", key="user:u1:pref")[1]["value"] == {"lang": "fr"}
    assert _call(port, raw, "memory_update", key="user:u1:pref", value={"lang": "de"})[1]["status"] == "ok"
    assert _call(port, raw, "memory_search", query="lang")[0] == 200
    assert _call(port, raw, "memory_recall", query="lang")[1]["status"] == "ok"
    assert _call(port, raw, "memory_list", prefix="user:u1:")[1]["keys"]
    batch = {"calls": [{"name": "memory_write", "arguments": {"key": f"fact:b{i}", "value": i}} for i in range(5)]}
    status, body = _request(port, "POST", "/api/v1/tools/batch", key=raw, body=batch)
    assert status == 200 and [r["status"] for r in json.loads(body)["results"]] == ["ok"] * 5
    # REST CRUD
    assert _request(port, "PUT", "/api/v1/memories/fact:rest", key=raw, body={"value": {"a": 1}})[0] in (200, 201)
    assert _request(port, "GET", "/api/v1/memories/fact:rest", key=raw)[0] == 200
    assert _request(port, "GET", "/api/v1/memories/fact:rest/history", key=raw)[0] == 200
    assert _request(port, "GET", "/api/v1/memories?prefix=fact:", key=raw)[0] == 200
    assert _request(port, "DELETE", "/api/v1/memories/fact:rest", key=raw)[0] in (200, 204)
    # Audit review, paged, and an export of more rows than one page of its keyset reads.
    from audit import exports

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO audit_auditevent (uid, tenant_id, occurred_at, actor_kind, actor_id, actor_label, surface,"
            " action, target, subject, outcome, request_id, detail, digest, chain, redacted)"
            " SELECT gen_random_uuid(), %s, now(), 'system', '', 'system', 'job', 'memory.write',"
            " 'fact:x' || g, '', 'ok', '', '{}'::jsonb, repeat('0', 64), '', '{}'::jsonb"
            " FROM generate_series(1, %s) g",
            [tenant.pk, exports.CHUNK_ROWS * 2 + 10],
        )
    status, body = _request(port, "GET", "/api/v1/audit-events?limit=5", key=raw)
    page = json.loads(body)
    assert status == 200 and len(page["results"]) == 5 and page["next_cursor"]
    assert _request(port, "GET", f"/api/v1/audit-events?limit=5&cursor={page['next_cursor']}", key=raw)[0] == 200
    status, body = _request(port, "GET", "/api/v1/audit-events/export?format=jsonl", key=raw)
    assert status == 200 and len(body.splitlines()) > exports.CHUNK_ROWS * 2 + 10
    # A forget request, carried out by a django-q2 cluster that also goes through PgBouncer.
    status, body = _request(port, "POST", "/api/v1/forget-requests", key=raw, body={"subject": "u1"})
    assert status in (201, 202), body
    request_id = json.loads(body)["id"]
    cluster = subprocess.Popen(
        [sys.executable, "manage.py", "qcluster"],
        cwd=ROOT,
        env={**server.env, "Q_WORKERS": "1", "DB_POOL_MIN_SIZE": "1"},
        stdout=open(tmp_path / "qcluster.log", "wb"),  # noqa: SIM115  closed with the process
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        state = None
        while time.monotonic() < deadline:
            state = json.loads(_request(port, "GET", f"/api/v1/forget-requests/{request_id}", key=raw)[1])
            if state.get("status") in ("completed", "failed"):
                break
            time.sleep(0.3)
        assert state and state["status"] == "completed", (state, (tmp_path / "qcluster.log").read_text()[-3000:])
    finally:
        from tests.helpers import stop_process_group

        stop_process_group(cluster, grace=10)
    assert _call(port, raw, "memory_read", key="user:u1:pref")[1]["status"] == "not_found"
    # audit_verify reads with QuerySet.iterator() (server-side cursors, but for the setting):
    # a tenant whose events were all written through PgBouncer verifies.
    other = make_tenant("fleet-pgb-verify")
    _k, other_raw = make_key(other, scopes=TENANT_SCOPES)
    for i in range(3):
        assert _call(port, other_raw, "memory_write", key=f"fact:v{i}", value=i)[1]["status"] == "ok"
    verify = subprocess.run(
        [sys.executable, "manage.py", "audit_verify", "--tenant", other.slug],
        cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert verify.returncode == 0 and f"{other.slug}: ok" in verify.stdout, verify.stdout + verify.stderr
    # And it all went through PgBouncer: it logged the clients' logins to the test database.
    assert f"db={connection.settings_dict['NAME']}" in pgbouncer.log() or "login attempt" in pgbouncer.log()


@pytest.mark.postgres
@pytest.mark.django_db
def test_the_deploy_check_reports_a_pooler_without_the_setting_and_the_setting_without_its_parts(monkeypatch, settings):
    from zeromem.kernel.checks import pgbouncer_settings

    connection.ensure_connection()
    assert pgbouncer_settings(None, databases=["default"]) == []  # straight to PostgreSQL
    # Connected through a port that is not the server's own: a pooler in between.
    monkeypatch.setitem(connection.settings_dict, "PORT", "6432")
    [error] = pgbouncer_settings(None, databases=["default"])
    assert error.id == "zeromem.E001" and "ZEROMEM_PGBOUNCER=true" in error.msg
    monkeypatch.setenv("ZEROMEM_PGBOUNCER", "false")  # the operator says: no pooler (a port mapping)
    assert pgbouncer_settings(None, databases=["default"]) == []
    # The setting on, but server-side cursors left on by hand: refused.
    settings.ZEROMEM_PGBOUNCER = True
    monkeypatch.setitem(connection.settings_dict, "DISABLE_SERVER_SIDE_CURSORS", False)
    [error] = pgbouncer_settings(None, databases=["default"])
    assert "server-side cursors" in error.msg
    monkeypatch.setitem(connection.settings_dict, "DISABLE_SERVER_SIDE_CURSORS", True)
    assert pgbouncer_settings(None, databases=["default"]) == []


# --- 3. read scaling -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def replica_alias(django_db_setup):
    """A second alias, ``replica``, on the same server and test database (as settings.py
    builds it from DATABASE_REPLICA_URL): what goes to it is what the router sends there.
    Module-scoped: it must exist before a test declares it in its ``databases``."""
    primary = connections["default"].settings_dict  # the test database, created by now
    assert primary["NAME"].startswith("test_")
    pool = {"min_size": 1, "max_size": 4}
    connections.settings[REPLICA] = {**primary, "OPTIONS": {**primary["OPTIONS"], "pool": pool}}
    yield
    connections[REPLICA].close()
    pool = getattr(connections[REPLICA], "close_pool", None)
    if pool:
        pool()
    del connections[REPLICA]
    del connections.settings[REPLICA]


def _tables(queries: list[dict]) -> list[str]:
    """``SELECT audit_auditevent``: each query's verb and first table."""
    tables = [re.findall(r'(?:FROM|INTO|UPDATE) "(\w+)"', q["sql"]) or ["?"] for q in queries]
    return [f"{q['sql'].split()[0]} {found[0]}" for q, found in zip(queries, tables, strict=True)]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True, databases=["default", REPLICA])
def test_audit_review_export_and_dashboard_read_from_the_replica_and_nothing_else_does(replica_alias, admin_client):
    tenant = make_tenant("fleet-replica")
    client, _key = make_keyed_client(tenant, scopes=TENANT_SCOPES)
    with CaptureQueriesContext(connections[REPLICA]) as on_replica:
        assert client.call("memory_write", key="fact:r", value=1)[0] == 200
        assert client.call("memory_read", key="fact:r")[1]["value"] == 1
        assert client.call("memory_search", query="fact")[0] == 200
    assert on_replica.captured_queries == []  # tool calls: the primary only

    with CaptureQueriesContext(connections[REPLICA]) as on_replica, CaptureQueriesContext(connection) as on_primary:
        listed = client.get("/api/v1/audit-events?limit=5")
    assert listed.status_code == 200 and listed.json()["results"]
    # the page's window and events, the seals (older ones, and the range seals spanning the
    # events: each event's seal number) — all of it on the replica, reads only
    assert set(_tables(on_replica.captured_queries)) == {"SELECT audit_auditevent", "SELECT audit_auditseal"}
    assert any(t == "INSERT audit_auditevent" for t in _tables(on_primary.captured_queries))  # its audit.list event

    with CaptureQueriesContext(connections[REPLICA]) as on_replica:
        exported = client.get("/api/v1/audit-events/export?format=jsonl")
        rows = b"".join(exported.streaming_content).splitlines()
    assert exported.status_code == 200 and rows
    assert set(_tables(on_replica.captured_queries)) == {"SELECT audit_auditevent", "SELECT audit_auditseal"}

    with CaptureQueriesContext(connections[REPLICA]) as on_replica:
        page = admin_client.get(f"/admin/memories/tenant/{tenant.pk}/dashboard/")
    assert page.status_code == 200
    assert "SELECT memories_memory" in _tables(on_replica.captured_queries)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True, databases=["default", REPLICA])
def test_a_read_after_a_write_inside_replica_reads_goes_to_the_primary(replica_alias):
    tenant = make_tenant("fleet-raw")
    with replica_reads():
        assert reads_go_to() == REPLICA
        services.api_key_create(tenant=tenant, actor=SYSTEM, name="k")  # a write
        assert reads_go_to() == "default"
        with CaptureQueriesContext(connections[REPLICA]) as on_replica:
            assert ApiKey.objects.filter(tenant=tenant).count() == 1
        assert on_replica.captured_queries == []
    assert reads_go_to() == "default"  # outside the context


@pytest.mark.django_db
def test_metrics_method_label_takes_no_method_name_a_client_makes_up():
    # The method is the client's to choose (any token): as a label, each new one was a new
    # counter and histogram series in every process's file, for anyone without a key.
    tenant = make_tenant("fleet-metrics-methods")
    made_up = [f"ZMPROBE{i}" for i in range(20)]
    for method in made_up:
        assert Client().generic(method, "/healthz").status_code in (400, 401, 405)
        Client().generic(method, "/api/v1/memories/user:u1:x")
    Client().get("/healthz")

    text = Client(HTTP_AUTHORIZATION=f"Bearer {_operator_key(tenant)}").get("/metrics").content.decode()
    methods = set(re.findall(r'^zeromem_http_request\w*\{[^}]*method="([^"]*)"', text, re.M))
    assert "GET" in methods
    assert not methods & set(made_up)
    assert methods <= {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT", "other"}
    assert _samples(text, "zeromem_http_requests_total", method="other") >= 2 * len(made_up)


@pytest.mark.postgres
def test_the_overdue_forget_gauge_reads_the_open_requests_not_every_request_kept(db):
    """Requests are kept with their receipts: every scrape of /metrics counted the overdue
    ones by reading all of them (1M: 51-62 ms a scrape). It reads the open and failed ones."""
    from django.utils import timezone

    from zeromem.kit.metrics import overdue_forget_requests

    tenant = make_tenant("gauge")
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO memories_forgetrequest (status, subject, prefix, keys, reason, requested_by_kind,
                   requested_by, created_at, due_at, completed_at, attempts, receipt, error, tenant_id,
                   progress_at, reach)
               SELECT CASE WHEN g <= 3 THEN 'received' WHEN g <= 5 THEN 'failed' ELSE 'completed' END,
                   'u' || g, '', '[]', 'r', 'end_user', 'u', now() - interval '60 days',
                   now() - interval '30 days', now() - interval '59 days', 1, '{}', '', %s,
                   now() - interval '59 days', '{}'
               FROM generate_series(1, 5000) g""",
            [tenant.pk],
        )
        cursor.execute("ANALYZE memories_forgetrequest")
    gauge = overdue_forget_requests(timezone.now())
    plan = json.loads(gauge.explain(format="json", analyze=True))[0]["Plan"]

    def rows_read(node):
        here = 0
        if node.get("Relation Name") == "memories_forgetrequest":
            here = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * node.get("Actual Loops", 1)
        return here + sum(rows_read(child) for child in node.get("Plans", []))

    assert gauge.count() == 5
    assert rows_read(plan) <= 5, plan


@pytest.mark.django_db
def test_a_scrape_costs_the_same_queries_whatever_the_number_of_tenants():
    # The unsealed-events gauge was two queries per tenant (its head seal, its tail's count):
    # 2,001 round trips a scrape at 1,000 tenants, every 15 s per instance.
    from audit import services as audit_services
    from zeromem.kit.metrics import DatabaseCollector

    def scrape() -> tuple[int, float]:
        with CaptureQueriesContext(connection) as queries:
            families = {family.name: family for family in DatabaseCollector().collect()}
        return len(queries), families["zeromem_audit_unsealed_events"].samples[0].value

    first = make_tenant("fleet-scrape-0")
    write(first, "user:u1:a", 1)
    audit_services.audit_seal_all()
    write(first, "user:u1:b", 2)  # one unsealed event after a range seal
    few, _ = scrape()
    for n in range(1, 21):
        write(make_tenant(f"fleet-scrape-{n}"), "user:u1:a", n)
    many, unsealed = scrape()
    assert many == few
    assert unsealed == sum(
        AuditEvent.objects.filter(unsealed_q(tenant_id)).count()
        for tenant_id in [None, *Tenant.objects.values_list("pk", flat=True)]
    )


@pytest.mark.django_db
def test_a_dead_processs_pool_gauges_leave_the_sum_its_counters_stay(tmp_path, monkeypatch):
    # granian respawns a worker that died; its pool gauges ("livesum") stayed in the files and
    # in every later scrape's sum (a crashed worker's 8 connections counted forever).
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from zeromem.kit import metrics

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def write_file(kind: str, pid: int, name: str, value: float, labels: dict | None = None) -> None:
        store = MmapedDict(str(tmp_path / f"{kind}_{pid}.db"))
        labels = labels or {}
        key = mmap_key(
            name, name if kind.startswith("gauge") else f"{name}_total", list(labels), list(labels.values()), "h"
        )
        store.write_value(key, value, 0.0)
        store.close()

    for pid, connections_open in ((os.getpid(), 3), (dead.pid, 8)):
        write_file("gauge_livesum", pid, "zeromem_db_pool_connections", connections_open)
        write_file("counter", pid, "zeromem_http_requests", 5, {"route": "r", "method": "GET", "status": "200"})
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(metrics, "MULTIPROCESS", True)
    text = metrics.exposition()[0].decode()
    assert _samples(text, "zeromem_db_pool_connections") == 3
    assert _samples(text, "zeromem_http_requests_total") == 10  # what the dead one answered still counts
    assert not (tmp_path / f"gauge_livesum_{dead.pid}.db").exists()


@pytest.mark.django_db
def test_the_search_tier_rankings_are_on_the_page_of_a_single_process_too():
    # Without PROMETHEUS_MULTIPROC_DIR (runserver, a server not started by serve) the page
    # listed its own collectors by hand and left this one out (README lists it).
    from memories.search.tier import RANKINGS
    from zeromem.kit import metrics

    assert not metrics.MULTIPROCESS
    RANKINGS.labels("fallback").inc()
    assert _samples(metrics.exposition()[0].decode(), "zeromem_search_tier_rankings_total", outcome="fallback") >= 1


def _datakey_rows_read() -> int:
    """Rows of the key store's data key table read so far in this transaction (its table and
    index scans): what a scrape costs as the table grows."""
    with connections[DataKey.objects.db].cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables"
            " WHERE relname = %s",
            [DataKey._meta.db_table],
        )
        row = cursor.fetchone()
    return row[0] if row else 0


@pytest.mark.django_db
def test_the_data_keys_gauge_follows_create_rotate_and_forget():
    from zeromem.kit.metrics import DatabaseCollector

    def gauge() -> dict[str, float]:
        (family,) = [f for f in DatabaseCollector().collect() if f.name == "zeromem_data_keys"]
        return {sample.labels["state"]: sample.value for sample in family.samples}

    def truth() -> dict[str, int]:
        return {
            "current": DataKey.objects.filter(retired_at__isnull=True, destroyed_at__isnull=True).count(),
            "retired": DataKey.objects.filter(retired_at__isnull=False, destroyed_at__isnull=True).count(),
            "destroyed": DataKey.objects.filter(destroyed_at__isnull=False).count(),
        }

    tenant = make_tenant("fleet-keys-gauge")
    assert gauge() == truth()
    for user in ("u1", "u2", "u3", "u4"):
        write(tenant, f"user:{user}:phone", f"+49 {user}", sensitive=True)  # a data key each
    assert gauge() == truth() and truth()["current"] >= 4
    from memories.services.encryption import retire_data_keys

    assert retire_data_keys(tenant_id=tenant.pk) == 4  # a rotation: 4 retired
    write(tenant, "user:u1:phone", "+49 new", sensitive=True)  # u1's new current key
    assert gauge() == truth()
    request = services.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u2")
    services.forget_request_execute(request_id=request.pk)  # u2's retired key destroyed
    keyring.shred(tenant_id=tenant.pk, subject="u1")  # u1's current and retired keys
    after = gauge()
    assert after == truth()
    assert after["destroyed"] >= 3
    DataKey.objects.filter(tenant_id=tenant.pk, destroyed_at__isnull=False).delete()  # rows removed
    assert gauge() == truth()


@pytest.mark.postgres  # the key store's row reads, from pg_stat_xact_user_tables
@pytest.mark.django_db
def test_a_scrape_reads_no_more_of_the_key_store_with_more_data_keys():
    # The gauge counted every data key on each scrape: 56 ms at 500k keys, growing with them.
    from zeromem.kit.metrics import DatabaseCollector

    def scrape() -> tuple[int, int]:
        read = _datakey_rows_read()
        with CaptureQueriesContext(connections[DataKey.objects.db]) as queries:
            list(DatabaseCollector().collect())
        return len(queries), _datakey_rows_read() - read

    tenant = make_tenant("fleet-keys-scrape")
    write(tenant, "user:u0:phone", "+49 0", sensitive=True)
    few_queries, few_rows = scrape()
    DataKey.objects.bulk_create(
        DataKey(tenant_id=tenant.pk, subject=f"bulk{n}", master_key_id="k", wrapped=b"x") for n in range(2000)
    )
    many_queries, many_rows = scrape()
    assert many_queries == few_queries
    assert many_rows == few_rows and many_rows < 100, (few_rows, many_rows)


@pytest.mark.postgres  # the counts kept by triggers (SQLite counts the keys; one writer at a time)
@pytest.mark.django_db(transaction=True)
def test_the_data_keys_gauge_stays_exact_under_concurrent_writes_rotations_and_forgets():
    from memories.services.encryption import retire_data_keys
    from zeromem.kit.metrics import data_key_counts

    tenant = make_tenant("fleet-keys-race")

    def work(n: int) -> None:
        try:
            for i in range(6):
                user = f"r{n}x{i}"
                write(tenant, f"user:{user}:phone", f"+49 {n} {i}", sensitive=True)
                if i % 3 == 2:
                    retire_data_keys(tenant_id=tenant.pk)
                if i % 2:
                    keyring.shred(tenant_id=tenant.pk, subject=user)
        finally:
            connection.close()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    truth = {
        "current": DataKey.objects.filter(retired_at__isnull=True, destroyed_at__isnull=True).count(),
        "retired": DataKey.objects.filter(retired_at__isnull=False, destroyed_at__isnull=True).count(),
        "destroyed": DataKey.objects.filter(destroyed_at__isnull=False).count(),
    }
    assert truth["destroyed"] == 24 and sum(truth.values()) == 48
    counts = data_key_counts()
    assert {state: counts.get(state, 0) for state in truth} == truth
    DataKey.objects.all().delete()
    assert not any(data_key_counts().values())
