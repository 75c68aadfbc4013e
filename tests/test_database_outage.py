"""When PostgreSQL is unreachable or its connections die, the API says so (503) or heals.

Real connections only: the "outage" is the default connection pointed at a loopback port
nothing listens on (as after a hard stop), and dead pooled connections are backends ended
by ``pg_terminate_backend`` (as after a restart). ``manage.py bench_load`` does the same
with a real ``pg_ctl -m immediate stop`` under load.
"""

import asyncio
import json
import socket

import pytest
from django.db import connection

from tests.factories import KeyedClient, make_key, make_tenant
from tests.helpers import other_session

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


def _fresh_pool():
    """Return the test's connection and drop the pool, so the next query opens a new pool
    from the current settings."""
    connection.close()
    connection.close_pool()


@pytest.fixture
def database_unreachable(monkeypatch):
    _fresh_pool()
    monkeypatch.setitem(connection.settings_dict, "HOST", "127.0.0.1")
    monkeypatch.setitem(connection.settings_dict, "PORT", str(_closed_port()))
    options = dict(connection.settings_dict["OPTIONS"])
    options["pool"] = {**options["pool"], "timeout": 0.5}  # the test need not wait DB_POOL_TIMEOUT
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    yield
    _fresh_pool()  # the undone settings (real port) apply from the next query on


def _assert_database_unavailable(response):
    assert response.status_code == 503, response.content
    assert response.json()["error"]["code"] == "database_unavailable"
    assert int(response["Retry-After"]) >= 1


def test_the_api_answers_503_with_retry_after_when_the_database_is_unreachable(api: KeyedClient, request):
    api.call("memory_write", key="fact:outage", value="kept")
    request.getfixturevalue("database_unreachable")

    _assert_database_unavailable(api.post("/api/v1/tools/call", {"name": "memory_read", "arguments": {"key": "x"}}))
    _assert_database_unavailable(
        api.post("/api/v1/tools/call", {"name": "memory_write", "arguments": {"key": "fact:new", "value": 1}})
    )
    _assert_database_unavailable(api.get("/api/v1/memories/fact:outage"))
    _assert_database_unavailable(api.get("/api/v1/memories", {"prefix": "fact:"}))
    health = api.get("/healthz")
    assert health.status_code == 503 and health.json()["error"]["code"] == "database_unavailable"


def test_the_api_serves_again_once_the_database_is_back(api: KeyedClient, request):
    api.call("memory_write", key="fact:outage", value="kept")
    request.getfixturevalue("database_unreachable")
    _assert_database_unavailable(api.get("/api/v1/memories/fact:outage"))
    request.getfixturevalue("monkeypatch").undo()  # the database is reachable again
    _fresh_pool()

    status, body = api.call("memory_read", key="fact:outage")
    assert (status, body["status"], body["value"]) == (200, "ok", "kept")


def _terminate_other_backends() -> int:
    """End every other session of the test database, from a connection of our own."""
    with other_session(autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ).fetchall()
    return len(rows)


def test_pooled_connections_killed_by_a_database_restart_cost_no_request_an_error(api: KeyedClient):
    """After a restart every idle pooled connection is dead; the pool checks a connection
    before handing it out (CONN_HEALTH_CHECKS), so no request gets a dead one (503)."""
    api.call("memory_write", key="fact:restart", value="kept")
    connection.close()  # our connection goes back to the pool, idle
    assert _terminate_other_backends() >= 1

    for _ in range(3):
        status, body = api.call("memory_read", key="fact:restart")
        assert (status, body["status"], body["value"]) == (200, "ok", "kept")
        connection.close()


async def _mcp_post(endpoint, raw_key: str, body: dict) -> tuple[int, dict, dict]:
    """One POST /mcp through the endpoint's ASGI app in this process (its session manager
    running, as under the router's lifespan): (status, headers, JSON body)."""
    payload = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/mcp",
        "raw_path": b"/mcp",
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"authorization", f"Bearer {raw_key}".encode()),
            (b"content-type", b"application/json"),
            (b"accept", b"application/json, text/event-stream"),
            (b"x-request-id", b"outage-mcp-1"),
            (b"content-length", str(len(payload)).encode()),
        ],
    }
    sent = []

    async def receive():
        return {"type": "http.request", "body": payload, "more_body": False}

    async def send(message):
        sent.append(message)

    async with endpoint.session_manager.run():
        await endpoint(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body_bytes = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, json.loads(body_bytes)


def test_the_mcp_endpoint_answers_503_with_retry_after_when_the_key_cannot_be_checked(request, settings):
    # The bearer key is real, but the database that would verify it (and charge its rate
    # limit) is unreachable: not the SDK's 401 "invalid token", ZeroMem's 503 to retry.
    from memories.mcp.server import McpEndpoint

    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    _key, raw = make_key(make_tenant("outage-mcp"))
    endpoint = McpEndpoint()
    request.getfixturevalue("database_unreachable")
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    status, headers, body = asyncio.run(_mcp_post(endpoint, raw, ping))
    assert status == 503, body
    assert body == {
        "error": {
            "field": None,
            "code": "database_unavailable",
            "message": "the database is unavailable; retry shortly",
        }
    }
    assert headers["retry-after"] == "2"
    assert headers["x-request-id"].endswith(".outage-mcp-1")  # the request id, echoed
    assert headers["content-type"] == "application/json"
    assert "www-authenticate" not in headers  # not the SDK's refusal of the key
