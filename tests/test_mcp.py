"""The MCP endpoint (memories/mcp/server.py) and the stdio bridge (memories/mcp/bridge.py),
driven by the official ``mcp`` SDK's client from PyPI.

Over streamable HTTP against ``serve``'s server as a real process (zeromem/bench/server.py:
granian serving zeromem/asgi.py, pointed at the pytest database, so rows are committed:
``transaction=True``; PostgreSQL only, as every live-server test here). Over stdio through
``python3 -m zeromem mcp``, started by the SDK's stdio client.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import httpx2
import mcp_types as types
import pytest
from django.conf import settings
from django.db import connection
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import JSONRPCError

from audit.models import AuditEvent
from audit.services import audit_auth_failures_flush, audit_refusals_flush
from memories import services, tools
from memories.mcp.server import META_BYTES, META_TOKENS, transport_security
from memories.models import Memory, TokenUsageDay
from tests.factories import SYSTEM, make_key, make_tenant
from zeromem.bench.server import free_port, start_server, stop_server
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor
from zeromem.kernel.outcomes import ActorKind
from zeromem.kernel.scopes import Scope
from zeromem.kernel.tokens import estimate_tokens

ROOT = Path(settings.BASE_DIR)


def _database_url() -> str:
    db = connection.settings_dict  # after django_db_setup: NAME is the test database
    user = quote(db["USER"] or "", safe="")
    password = f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else ""
    host = db["HOST"] or "localhost"
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgres://{user}{password}@{host}{port}/{quote(db['NAME'], safe='')}"


@pytest.fixture(scope="module")
def server(django_db_setup):
    if connection.vendor != "postgresql":
        pytest.skip("a live server needs the test database on PostgreSQL")
    # The production serving model: granian, the ASGI router, 1 process × 4 threads; the
    # rate limit as configured (not the benchmarks' "never"), and no Redis: the database counts.
    started = start_server(
        database_url=_database_url(),
        processes=1,
        threads=4,
        log=lambda _line: None,
        extra_env={
            "ZEROMEM_RATE_LIMIT_PER_MINUTE": "6000",
            "REDIS_URL": "",
            "ZEROMEM_TENANT_MAX_CONCURRENT": "4",
            # Tokens returned are written on every response, so a test reads them at once.
            "ZEROMEM_USAGE_FLUSH_SECONDS": "0",
        },
    )
    try:
        yield f"http://127.0.0.1:{started['port']}/mcp"
    finally:
        stop_server(started)


async def _session(url: str, key: str, fn, mode: str = "auto"):
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            return await fn(client)


def over_http(url: str, key: str, fn, *, mode: str = "auto"):
    """``fn(client)`` with an SDK client connected to ``url`` with ``key`` (``mode``: the SDK
    client's, "auto" its default: the 2026-07-28 protocol; "legacy": the initialize handshake)."""
    return anyio.run(_session, url, key, fn, mode)


def calls(url: str, key: str, *pairs: tuple[str, dict]) -> list[dict]:
    """Each (tool, arguments) in turn: [{"is_error", "result", "text"}]."""

    async def run(client):
        out = []
        for name, arguments in pairs:
            r = await client.call_tool(name, arguments)
            text = r.content[0].text
            out.append(
                {"is_error": r.is_error, "result": r.structured_content, "text": text, "size": len(text.encode())}
            )
        return out

    return over_http(url, key, run)


def mcp_events(tenant) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(tenant=tenant, surface="mcp").order_by("id"))


# --- over streamable HTTP ------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_tools_list_is_the_registry(server):
    tenant = make_tenant("mcp-list")
    _key, raw = make_key(tenant)
    listed = over_http(server, raw, lambda c: c.list_tools())
    assert [t.name for t in listed.tools] == list(tools.TOOLS)
    for tool in listed.tools:
        assert tool.input_schema == tools.TOOLS[tool.name].input_schema()
        assert tool.description == tools.TOOLS[tool.name].description


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_each_memory_tool_runs_and_is_audited_with_surface_mcp(server):
    tenant = make_tenant("mcp-each")
    _key, raw = make_key(tenant)
    answers = calls(
        server,
        raw,
        ("memory_write", {"key": "user:u1:lang", "value": "prefers German", "tags": ["pref"]}),
        ("memory_read", {"key": "user:u1:lang"}),
        ("memory_update", {"key": "user:u1:lang", "value": "prefers German, formal", "expected_version": 1}),
        ("memory_update", {"key": "user:u1:lang", "value": "stale", "expected_version": 1}),
        ("memory_list", {"prefix": "user:u1:"}),
        ("memory_search", {"query": "German"}),
        ("memory_recall", {"query": "which language", "prefix": "user:u1:"}),
        ("memory_summarize", {"prefix": "user:u1:"}),
        ("memory_delete", {"key": "user:u1:lang"}),
        ("memory_read", {"key": "user:u1:lang", "default": "en"}),
    )
    results = [a["result"] for a in answers]
    assert not any(a["is_error"] for a in answers), answers
    assert results[0] == {"status": "ok", "key": "user:u1:lang", "version": 1, "created": True}
    assert (results[1]["status"], results[1]["value"]) == ("ok", "prefers German")
    assert (results[2]["status"], results[2]["version"]) == ("ok", 2)
    assert results[3] == {"status": "conflict", "key": "user:u1:lang", "current_version": 2}
    assert results[4]["keys"] == ["user:u1:lang"]
    assert [r["key"] for r in results[5]["results"]] == ["user:u1:lang"]
    assert "prefers German, formal" in results[6]["text"] and results[6]["count"] == 1
    assert results[7]["status"] == "ok" and uuid.UUID(results[7]["job_id"])  # the job's uid, not a row id
    assert results[8] == {"status": "ok"}
    assert results[9] == {"status": "not_found", "key": "user:u1:lang", "value": "en"}
    # The text content is the same answer, as the REST tool endpoint's body.
    assert json.loads(answers[1]["text"]) == results[1]
    actions = [e.action for e in mcp_events(tenant)]
    for action in ("memory.write", "memory.read", "memory.update", "memory.list", "memory.search", "memory.delete"):
        assert action in actions, actions
    assert all(e.actor_kind == AuditEvent.ActorKind.API_KEY for e in mcp_events(tenant))
    assert all(e.request_id for e in mcp_events(tenant))


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_results_carry_their_cost_in_meta_and_count_in_the_tenants_daily_usage(server):
    tenant, other = make_tenant("mcp-cost"), make_tenant("mcp-cost-other")
    _key, raw = make_key(tenant)
    value = "Grüße aus Köln — 東京 " + "x" * 200

    async def run(client):
        return [
            await client.call_tool("memory_write", {"key": "user:u1:greeting", "value": value}),
            await client.call_tool("memory_read", {"key": "user:u1:greeting"}),
            await client.call_tool("memory_read", {"key": 5}),  # an error costs the model its text too
        ]

    results = over_http(server, raw, run)
    for result in results:
        text = result.content[0].text
        cost = {k: v for k, v in result.meta.items() if k.startswith("zeromem/")}  # the SDK adds its serverInfo
        assert cost == {META_BYTES: len(text.encode()), META_TOKENS: estimate_tokens(text)}
    _write, read, wrong = results
    assert read.structured_content["value"] == value and wrong.is_error
    assert read.meta[META_TOKENS] >= 50 + 10  # 200 ASCII letters; the non-ASCII characters one token each
    row = TokenUsageDay.objects.get(tenant=tenant)
    assert row.results == 3
    assert row.bytes == sum(r.meta[META_BYTES] for r in results)
    assert row.tokens == sum(r.meta[META_TOKENS] for r in results)
    # And in the fleet's metrics, under surface "mcp".
    _key, scrape = services.api_key_create(tenant=tenant, actor=SYSTEM, name="prometheus", scopes=["metrics:read"])
    metrics = httpx2.get(server.removesuffix("/mcp") + "/metrics", headers={"Authorization": f"Bearer {scrape}"})
    tokens = re.search(r'^zeromem_tool_result_tokens_total\{surface="mcp"\} (\S+)$', metrics.text, re.M)
    assert tokens and float(tokens.group(1)) >= row.tokens, metrics.text[:2000]
    assert not TokenUsageDay.objects.filter(tenant=other).exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_long_value_is_read_in_slices_of_max_chars_and_the_schema_bounds_are_the_services(server):
    tenant = make_tenant("mcp-slices")
    _key, raw = make_key(tenant)
    value = "周报每周五下午发送。" * 300  # 3,000 characters
    answers = calls(
        server,
        raw,
        ("memory_write", {"key": "task:t1:notes", "value": value}),
        ("memory_read", {"key": "task:t1:notes"}),
        ("memory_read", {"key": "task:t1:notes", "offset": 2000}),
        ("memory_write", {"key": "task:t1:x", "value": 1, "ttl_seconds": validation.TTL_MAX_SECONDS + 1}),
        ("memory_search", {"query": "周报", "max_chars": 500}),
    )
    first, rest, too_long, found = (a["result"] for a in answers[1:])
    assert (first["value"], first["truncated"], first["chars"], first["next_offset"]) == (
        value[:2000],
        True,
        3000,
        2000,
    )
    assert (rest["value"], rest["truncated"]) == (value[2000:], False)
    assert answers[1]["size"] < 2000 * 3 + 200  # the slice, not the value, reached the model
    assert too_long["error"]["field"] == "ttl_seconds" and answers[3]["is_error"]
    assert [(r["key"], r["value"], r["truncated"], r["next_offset"]) for r in found["results"]] == [
        ("task:t1:notes", value[:500], True, 500)
    ]
    assert answers[4]["size"] < 500 * 3 + 200  # a search, too, pours a slice per result
    listed = over_http(server, raw, lambda c: c.list_tools())
    ttl = next(t for t in listed.tools if t.name == "memory_write").input_schema["properties"]["ttl_seconds"]
    assert ttl["maximum"] == validation.TTL_MAX_SECONDS


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_wrong_call_is_a_tool_error_with_zeromems_code(server):
    tenant = make_tenant("mcp-errors")
    _key, raw = make_key(tenant)
    bad_key, unknown, extra = calls(
        server,
        raw,
        ("memory_read", {"key": "no spaces allowed"}),
        ("memory_forget_everything", {}),
        ("memory_read", {"key": "user:u1:x", "surprise": 1}),
    )
    assert bad_key["is_error"] and bad_key["result"]["error"]["code"] == "invalid_key"
    assert bad_key["result"]["error"]["field"] == "key"
    assert unknown["is_error"] and unknown["result"]["error"]["code"] == "unknown_tool"
    assert extra["is_error"] and extra["result"]["error"]["code"] == "unknown_argument"
    assert json.loads(bad_key["text"]) == bad_key["result"]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["legacy", "auto"], ids=["2025", "2026"])
def test_a_tools_call_with_bad_params_is_refused_naming_the_field(server, mode):
    # The SDK refused a tools/call whose params it could not read (no name, a name that is no
    # string, arguments that are no object) with -32602 "Invalid request parameters" and
    # ``data: ""``: nothing said what was wrong. It now names the member, as REST's tool call
    # does, in the message and in ``data.field``, and the refusal is audited as REST's is.
    tenant = make_tenant(f"mcp-badparams-{mode}")
    _key, raw = make_key(tenant)
    Params = types.Request[dict[str, Any], str]
    bad = [
        ({"arguments": {}}, "params.name", "'params.name' is required"),
        ({"name": "memory_list", "arguments": "x"}, "params.arguments", "'params.arguments' must be a JSON object"),
        ({"name": "memory_list", "arguments": [1]}, "params.arguments", "'params.arguments' must be a JSON object"),
    ]
    if mode == "legacy":  # (on the 2026 path the SDK first finds no Mcp-Name header matching it: -32020)
        bad.append(({"name": 5, "arguments": {}}, "params.name", "'params.name' must be a string"))

    async def run(client):
        errors = []
        for params, _field, _said in bad:
            with pytest.raises(MCPError) as refused:
                await client.session.send_request(Params(method="tools/call", params=params), types.CallToolResult)
            errors.append(refused.value.error)
        with pytest.raises(MCPError) as listing:  # any method's params alike
            await client.session.send_request(Params(method="tools/list", params={"cursor": 5}), types.ListToolsResult)
        errors.append(listing.value.error)
        ok = await client.call_tool("memory_list", {})
        return errors, ok

    errors, ok = over_http(server, raw, run, mode=mode)
    listing = errors.pop()
    assert (listing.code, listing.data) == (-32602, {"field": "params.cursor"}), listing
    assert "'params.cursor' must be a string" in listing.message
    for error, (_params, field, said) in zip(errors, bad, strict=True):
        assert error.code == -32602
        assert said in error.message and len(error.message) <= 160, error.message
        assert error.data == {"field": field}
    assert not ok.is_error  # the session goes on
    refused = [e for e in mcp_events(tenant) if e.action == "tool.call" and e.outcome == "invalid"]
    assert [(e.detail["code"], e.detail["field"]) for e in refused] == [
        ("required" if "required" in said else "invalid", field) for _p, field, said in bad
    ]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ('{"key": "user:u1:nope", "default": 1e400}', "arguments.default"),
        ('{"key": "user:u1:nope", "default": {"a": [1, -Infinity]}}', "arguments.default.a.1"),
        ('{"key": "user:u1:x", "value": NaN}', "arguments.value"),
    ],
    ids=["1e400", "nested-infinity", "nan"],
)
def test_a_number_past_a_doubles_range_is_a_malformed_json_tool_error(server, arguments, field):
    # The SDK's parser reads 1e400 as inf and takes NaN/Infinity: echoed by memory_read's
    # default they made a text content that is not JSON ("value":Infinity), unlike REST's 400.
    tenant = make_tenant(f"mcp-inf-{field.count('.')}-{len(arguments)}")
    _key, raw = make_key(tenant)
    name = "memory_write" if '"value"' in arguments else "memory_read"
    body = '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "%s", "arguments": %s}}'
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    response = httpx2.post(
        server, content=body % (name, arguments), headers={**headers, "Authorization": f"Bearer {raw}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    result = json.loads(response.text)["result"]
    assert result["isError"] is True, result
    text = json.loads(result["content"][0]["text"], parse_constant=lambda c: pytest.fail(f"{c} in the text"))
    assert text == result["structuredContent"]
    assert (text["error"]["code"], text["error"]["field"]) == ("malformed_json", field)
    # Refused as REST's parser refuses it, and audited as REST audits it (it wrote no event).
    events = [(e.action, e.outcome, e.detail, e.actor_kind) for e in mcp_events(tenant)]
    assert events == [("tool.call", "invalid", {"code": "malformed_json", "field": field}, "api_key")]
    assert not services.memory_list(tenant=tenant, actor=SYSTEM, prefix="").keys


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_an_unknown_method_is_named_by_its_first_64_characters_not_echoed_whole(server):
    """The SDK answers METHOD_NOT_FOUND with the method name as its ``data``, whole: a 1 MB
    name (one request's body) came back whole, as the SDK's client reads it, and went into
    the audit event of a refusal over the rate limit."""
    tenant = make_tenant("mcp-method")
    _key, raw = make_key(tenant)
    method = "x" * (1024 * 1024 - 100)  # the body within ZEROMEM_MAX_BODY_BYTES
    r = _rpc(server, raw, method)
    assert len(r.content) < 1000, len(r.content)
    error = r.json()["error"]
    assert error["code"] == -32601 and error["message"] == "Method not found"
    assert error["data"] == "x" * 64 + "…"
    short = _rpc(server, raw, "resources/nothing").json()["error"]
    assert (short["code"], short["data"]) == (-32601, "resources/nothing")  # a name within 64 as it is
    as_64 = _rpc(server, raw, "y" * 64).json()["error"]
    assert as_64["data"] == "y" * 64


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_refused_key_is_401_and_a_revoked_one_is_in_its_tenants_log(server):
    tenant = make_tenant("mcp-refused")
    key, raw = make_key(tenant)
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    for authorization in (None, "Bearer zm_nothere_" + "x" * 40, "Basic abc", f"Bearer {raw}x"):
        sent = {**headers, **({"Authorization": authorization} if authorization else {})}
        response = httpx2.post(server, json=body, headers=sent, timeout=30)
        assert response.status_code == 401, (authorization, response.text)
        assert response.headers["www-authenticate"].startswith("Bearer")
    with pytest.raises(Exception):  # noqa: B017 - the SDK client gives up on a 401 (an error group)
        over_http(server, raw + "x", lambda c: c.list_tools())
    services.api_key_revoke(tenant=tenant, actor=SYSTEM, key_id=key.pk)
    response = httpx2.post(server, json=body, headers={**headers, "Authorization": f"Bearer {raw}"}, timeout=30)
    assert response.status_code == 401
    failed = AuditEvent.objects.get(tenant=tenant, action="auth.failed")
    assert (failed.surface, failed.target, failed.detail["code"]) == ("mcp", "/mcp", "key_revoked")


@pytest.fixture
def server_limited(django_db_setup):
    """A server whose keys may make 4 requests a minute."""
    if connection.vendor != "postgresql":
        pytest.skip("a live server needs the test database on PostgreSQL")
    env = {"ZEROMEM_RATE_LIMIT_PER_MINUTE": "4", "REDIS_URL": ""}
    started = start_server(database_url=_database_url(), processes=1, threads=2, log=lambda _line: None, extra_env=env)
    try:
        yield f"http://127.0.0.1:{started['port']}/mcp"
    finally:
        stop_server(started)


def _rpc(url: str, key: str, method: str, params: dict | None = None, *, notify: bool = False) -> httpx2.Response:
    """One JSON-RPC request (a notification with ``notify``) POSTed with ``key``."""
    body = {"jsonrpc": "2.0", "method": method} if notify else {"jsonrpc": "2.0", "id": 1, "method": method}
    if params is not None or not notify:
        body["params"] = params or {}
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {key}"}
    return httpx2.post(url, json=body, headers=headers, timeout=30)


def _rate_limited(r: httpx2.Response) -> bool:
    """The endpoint's answer over the key's rate limit: 429, ZeroMem's error, Retry-After."""
    retry = int(r.headers.get("retry-after", 0))
    return r.status_code == 429 and r.json()["error"]["code"] == "rate_limited" and 1 <= retry <= 60


def _wait_for_a_minutes_start(latest: int = 40) -> None:
    """The rate limit counts per calendar minute: a test's requests fall in one if they start
    no later than ``latest`` seconds into it."""
    if time.time() % 60 > latest:
        time.sleep(61 - time.time() % 60)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_initialize_tools_list_and_ping_are_charged_to_the_keys_rate_limit(server_limited):
    # Before, only tools/call was: a client could loop the others for free, each one a key
    # verification (and its audit rows when refused).
    tenant = make_tenant("mcp-flood")
    _key, raw = make_key(tenant)
    _key, other = make_key(tenant)
    hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "flood", "version": "1"}}
    _wait_for_a_minutes_start()
    answered = [_rpc(server_limited, raw, "initialize", hello) for _ in range(4)]
    assert [r.status_code for r in answered] == [200] * 4 and "result" in answered[0].json()
    refused = [
        _rpc(server_limited, raw, m, hello if m == "initialize" else None) for m in ("initialize", "tools/list", "ping")
    ]
    for r in refused:
        assert _rate_limited(r) and r.headers["x-request-id"], r.text
    call = _rpc(server_limited, raw, "tools/call", {"name": "memory_list", "arguments": {}})
    assert call.status_code == 200 and call.json()["result"]["structuredContent"]["error"]["code"] == "rate_limited"
    assert _rpc(server_limited, other, "tools/list").status_code == 200  # per key
    # An SDK client's session: initialize and notifications/initialized, then its calls.
    _key, third = make_key(tenant)

    async def session(client):
        return [(await client.call_tool("memory_list", {})).structured_content["status"] for _ in range(3)]

    assert over_http(server_limited, third, session) == ["ok", "ok", "error"]
    # Counted like every refusal over a limit: one event per source and minute, later.
    assert audit_refusals_flush(now=time.time() + 120) >= 1
    refusals = AuditEvent.objects.filter(tenant=tenant, outcome=AuditEvent.Outcome.INVALID)
    counted = sorted((e.action, e.surface, e.count, e.detail["code"]) for e in refusals)
    assert counted == [  # one event per key
        ("mcp.request", "mcp", 3, "rate_limited"),
        ("tool.call", "mcp", 1, "rate_limited"),
        ("tool.call", "mcp", 1, "rate_limited"),
    ]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_reads_and_writes_whose_counter_rides_are_refused_over_the_limit_through_the_sdk(server_limited):
    """memory_read/memory_write send the key's counter with their first read (run_call): an SDK
    client's session (initialize + notifications/initialized: 2 of the 4 units) gets two
    answers, then the rate_limited tool error with nothing written, and the refusal counted."""
    tenant = make_tenant("mcp-riding")
    _key, raw = make_key(tenant)
    _wait_for_a_minutes_start()

    async def session(client):
        calls = [("memory_write", {"key": "fact:r:1", "value": "a"}), ("memory_read", {"key": "fact:r:1"})]
        calls += [("memory_write", {"key": "fact:r:1", "value": "b"}), ("memory_read", {"key": "fact:r:1"})]
        return [(await client.call_tool(name, arguments)).structured_content for name, arguments in calls]

    results = over_http(server_limited, raw, session)
    assert [r["status"] for r in results] == ["ok", "ok", "error", "error"]
    assert results[1]["value"] == "a"
    assert {r["error"]["code"] for r in results[2:]} == {"rate_limited"}
    assert Memory.objects.get(tenant=tenant, key="fact:r:1").version == 1  # the refused write wrote nothing
    reads = AuditEvent.objects.filter(tenant=tenant, surface="mcp", action__in=["memory.read", "memory.write"])
    assert sorted(reads.values_list("action", "outcome")) == [("memory.read", "ok"), ("memory.write", "ok")]
    assert audit_refusals_flush(now=time.time() + 120) >= 1
    refusals = AuditEvent.objects.filter(tenant=tenant, outcome=AuditEvent.Outcome.INVALID, action="tool.call")
    assert [(e.count, e.detail["code"]) for e in refusals] == [(2, "rate_limited")]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_notifications_are_charged_and_a_get_or_delete_is_405_not_a_free_open_stream(server_limited):
    # The stateless endpoint answers a notification 202 before the server sees it and then
    # ends: the server middleware never charged it, so notifications looped for free (each a
    # key verification). And a GET opened an SSE stream that never carries anything, held
    # open, uncharged, as many as a client liked.
    tenant = make_tenant("mcp-notify")
    _key, raw = make_key(tenant)
    _wait_for_a_minutes_start()
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {raw}"}
    for method in ("GET", "DELETE", "HEAD", "PUT"):
        with httpx2.stream(method, server_limited, headers=headers, timeout=10) as r:
            assert r.status_code == 405 and r.headers["allow"] == "POST", (method, r.status_code)
    accepted = [_rpc(server_limited, raw, "notifications/initialized", notify=True) for _ in range(4)]
    assert [r.status_code for r in accepted] == [202] * 4
    refused = _rpc(server_limited, raw, "notifications/cancelled", notify=True)
    assert _rate_limited(refused), refused.text
    assert _rate_limited(_rpc(server_limited, raw, "tools/list"))  # the 4 used the minute
    assert audit_refusals_flush(now=time.time() + 120) >= 1
    counted = [(e.action, e.count) for e in AuditEvent.objects.filter(tenant=tenant, outcome="invalid")]
    assert counted == [("mcp.request", 2)]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_tools_call_the_sdk_refuses_for_its_params_is_charged_once_too(server_limited):
    # The middleware left every tools/call to run_call's charge, which a call whose params
    # the SDK refuses (no name, arguments not an object) never reaches: those looped free.
    _key, raw = make_key(make_tenant("mcp-badcall"))
    _wait_for_a_minutes_start()
    bad = [{}, {"name": 5}, {"name": "memory_list", "arguments": "x"}]
    answered = [_rpc(server_limited, raw, "tools/call", params) for params in bad]
    assert [(r.status_code, r.json()["error"]["code"]) for r in answered] == [(200, -32602)] * 3
    call = _rpc(server_limited, raw, "tools/call", {"name": "memory_list", "arguments": {}})
    assert call.json()["result"]["structuredContent"]["status"] == "ok"  # the 4th unit, charged once
    refused = _rpc(server_limited, raw, "tools/call", {})
    assert _rate_limited(refused), refused.text
    assert _rate_limited(_rpc(server_limited, raw, "tools/list"))


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_requests_the_sdk_refuses_before_any_handler_are_charged_too(server_limited):
    # Malformed JSON, a body that is no JSON-RPC message, a wrong Accept or Content-Type: the
    # SDK answers them itself (400/406) after the key was verified, and they looped free.
    tenant = make_tenant("mcp-refused")
    _key, raw = make_key(tenant)
    auth = {"Authorization": f"Bearer {raw}"}
    both = "application/json, text/event-stream"
    _wait_for_a_minutes_start()
    refused = [
        httpx2.post(
            server_limited, content=b"{not json", headers={**auth, "Accept": both, "Content-Type": "application/json"}
        ),
        httpx2.post(server_limited, json={"hello": 1}, headers={**auth, "Accept": both}),
        httpx2.post(
            server_limited, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers={**auth, "Accept": "text/html"}
        ),
        httpx2.post(server_limited, content=b"x", headers={**auth, "Accept": both, "Content-Type": "text/plain"}),
    ]
    assert [r.status_code for r in refused] == [400, 400, 406, 400], [r.text for r in refused]
    assert all(r.headers.get("x-request-id") for r in refused)
    assert _rate_limited(_rpc(server_limited, raw, "tools/list"))  # the four used the minute
    again = httpx2.post(
        server_limited, content=b"{not json", headers={**auth, "Accept": both, "Content-Type": "application/json"}
    )
    assert _rate_limited(again), again.text
    # A charged request is charged once: a refused tools/call's params (-32602) is one unit.
    _key, other = make_key(tenant)
    for _ in range(3):
        assert _rpc(server_limited, other, "tools/call", {}).json()["error"]["code"] == -32602
    assert _rpc(server_limited, other, "ping").status_code == 200
    assert _rate_limited(_rpc(server_limited, other, "ping"))


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("body", "field", "said"),
    [
        ({"jsonrpc": "2.0", "id": 1}, "method", "'method' is required"),
        ({"jsonrpc": "1.0", "id": 1, "method": "ping"}, "jsonrpc", "'jsonrpc': input should be '2.0'"),
        ({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": "x"}, "params", "'params': input should be"),
        ({"jsonrpc": "2.0", "method": 5}, "method", "'method': input should be a valid string"),
        ([1, 2], None, "a JSON object"),
    ],
)
def test_a_body_that_is_no_json_rpc_message_is_refused_naming_the_member_without_pydantics_text(
    server, body, field, said
):
    # The SDK answered 400 with pydantic's whole validation text: every member of every kind
    # of JSON-RPC message (up to 2 kB) and "For further information visit
    # https://errors.pydantic.dev/...". ZeroMem's 4xx name the field, briefly.
    _key, raw = make_key(make_tenant("mcp-badbody"))
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {raw}"}
    r = httpx2.post(server, json=body, headers=headers, timeout=30)
    assert r.status_code == 400 and r.headers.get("x-request-id"), r.text
    error = JSONRPCError.model_validate(r.json()).error  # the JSON-RPC shape clients parse
    assert error.code == -32602 and r.json()["id"] is None
    assert said in error.message and len(error.message) <= 120, error.message
    assert "pydantic" not in r.text and "JSONRPCNotification" not in r.text, r.text
    assert error.data == {"field": field}
    assert int(r.headers["content-length"]) == len(r.content)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_other_refusals_of_a_verified_key_are_charged_too(server_limited):
    # The key is verified before the SDK checks Host and Origin (421, 403) and routes the path
    # (404 below /mcp), and before ZeroMem refuses a tools/call's NaN arguments: each looped free.
    tenant = make_tenant("mcp-refused-more")
    _key, raw = make_key(tenant)
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {raw}"}
    body = {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {}}
    nan_call = (
        b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call",'
        b' "params": {"name": "memory_read", "arguments": {"key": "user:u1:k", "default": NaN}}}'
    )
    _wait_for_a_minutes_start()
    refused = [
        httpx2.post(server_limited, json=body, headers={**headers, "Host": "evil.example"}, timeout=30),
        httpx2.post(server_limited, json=body, headers={**headers, "Origin": "http://evil.example"}, timeout=30),
        httpx2.post(f"{server_limited}/nothing", json=body, headers=headers, timeout=30),
        httpx2.post(server_limited, content=nan_call, headers={**headers, "Content-Type": "application/json"}),
    ]
    assert [r.status_code for r in refused] == [421, 403, 404, 200], [r.text for r in refused]
    assert refused[3].json()["result"]["structuredContent"]["error"]["code"] == "malformed_json"
    assert _rate_limited(_rpc(server_limited, raw, "ping"))  # the four used the minute
    again = httpx2.post(server_limited, json=body, headers={**headers, "Origin": "http://evil.example"}, timeout=30)
    assert _rate_limited(again), again.text


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_failed_authentications_past_the_limit_are_throttled_429(server):
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    headers = {"Accept": "application/json, text/event-stream", "Authorization": "Bearer zm_nothere_" + "y" * 40}
    # The throttle counts per calendar minute (audit/limits.py): the 32 requests must fall in
    # one, so they start early in a minute (a CI run once crossed the boundary at the 31st).
    if time.time() % 60 > 40:
        time.sleep(61 - time.time() % 60)
    statuses = [httpx2.post(server, json=body, headers=headers, timeout=30) for _ in range(32)]
    limit = settings.ZEROMEM_AUTH_FAILURES_PER_MINUTE  # the server's is the default too
    assert [r.status_code for r in statuses] == [401] * limit + [429] * (32 - limit)
    throttled = statuses[-1]
    assert throttled.json()["error"]["code"] == "rate_limited" and int(throttled.headers["retry-after"]) >= 1


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_missing_scope_and_a_key_outside_its_allowlist_are_refused_and_audited(server):
    tenant = make_tenant("mcp-scope")
    _key, reader = make_key(tenant, scopes=[Scope.MEMORY_READ])
    _key, agent_only = make_key(tenant, allow=["agent:"])
    (write,) = calls(server, reader, ("memory_write", {"key": "user:u1:x", "value": 1}))
    assert write["is_error"] and write["result"]["error"]["code"] == "missing_scope"
    (outside,) = calls(server, agent_only, ("memory_read", {"key": "user:u1:x"}))
    assert outside["is_error"] and outside["result"]["error"]["code"] == "key_not_allowed"
    denied = [(e.action, e.outcome) for e in mcp_events(tenant)]
    assert ("memory.write", AuditEvent.Outcome.DENIED) in denied
    assert ("memory.read", AuditEvent.Outcome.DENIED) in denied
    assert not services.memory_list(tenant=tenant, actor=SYSTEM, prefix="").keys


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_another_tenants_memories_are_invisible(server):
    mine, theirs = make_tenant("mcp-mine"), make_tenant("mcp-theirs")
    services.memory_write(tenant=theirs, actor=SYSTEM, key="user:u1:secret", value="CANARY-theirs-51d2")
    _key, raw = make_key(mine)
    answers = calls(
        server,
        raw,
        ("memory_read", {"key": "user:u1:secret"}),
        ("memory_list", {"prefix": "user:"}),
        ("memory_search", {"query": "CANARY-theirs-51d2"}),
        ("memory_recall", {"prefix": "user:u1:"}),
        ("memory_delete", {"key": "user:u1:secret"}),
    )
    assert [a["result"]["status"] for a in answers] == ["not_found", "ok", "ok", "ok", "not_found"]
    assert all("CANARY" not in a["text"] for a in answers)
    assert answers[1]["result"]["keys"] == [] and answers[2]["result"]["results"] == []
    assert services.memory_read(tenant=theirs, actor=SYSTEM, key="user:u1:secret").memory.value == "CANARY-theirs-51d2"
    assert not AuditEvent.objects.filter(tenant=theirs, surface="mcp").exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_host_outside_allowed_hosts_is_refused(server):
    tenant = make_tenant("mcp-host")
    _key, raw = make_key(tenant)
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {raw}"}
    response = httpx2.post(server, json=body, headers={**headers, "Host": "evil.example"}, timeout=30)
    assert response.status_code == 421  # the SDK's transport security, from ALLOWED_HOSTS
    assert httpx2.post(server, json=body, headers=headers, timeout=30).status_code == 200


# --- the stdio bridge ------------------------------------------------------------------------


def _fake_venv(tmp_path: Path) -> Path:
    """A "venv" that is this interpreter, its requirements stamp current: nothing installs."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    digest = hashlib.sha256((ROOT / "requirements.txt").read_bytes()).hexdigest()
    (venv / ".requirements.sha256").write_text(digest)
    return venv


def _bridge(url: str, key: str, tmp_path: Path) -> StdioServerParameters:
    """The stdio bridge to ``url`` as an MCP client starts it: no Django settings, no
    database, only the URL and the key (the key from the environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "DATABASE"))}
    env.update(ZEROMEM_VENV=str(_fake_venv(tmp_path)), ZEROMEM_API_KEY=key)
    return StdioServerParameters(
        command=sys.executable, args=["-m", "zeromem", "mcp", "--url", url], env=env, cwd=str(ROOT)
    )


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_stdio_bridge_lists_and_calls_the_tools(server, tmp_path):
    tenant = make_tenant("mcp-stdio")
    _key, raw = make_key(tenant)
    params = _bridge(server, raw, tmp_path)

    async def run():
        async with Client(params) as client:
            listed = await client.list_tools()
            wrote = await client.call_tool("memory_write", {"key": "user:u9:city", "value": "Graz"})
            read = await client.call_tool("memory_read", {"key": "user:u9:city"})
            refused = await client.call_tool("memory_read", {"key": "bad key"})
            return listed, wrote, read, refused

    listed, wrote, read, refused = anyio.run(run)
    assert [t.name for t in listed.tools] == list(tools.TOOLS)
    assert wrote.structured_content["status"] == "ok"
    assert read.structured_content["value"] == "Graz" and not read.is_error
    assert read.meta[META_TOKENS] == estimate_tokens(read.content[0].text)  # the cost passes through the bridge
    assert refused.is_error and refused.structured_content["error"]["code"] == "invalid_key"
    assert {e.action for e in mcp_events(tenant)} >= {"memory.write", "memory.read"}


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_bridge_answers_a_call_while_the_server_is_down_and_works_again_once_it_is_back(server, tmp_path):
    # The SDK's client lets a connection error out of its task group: one call while ZeroMem
    # restarted ended the bridge, and the MCP client waited for that call's answer forever.
    tenant = make_tenant("mcp-stdio-down")
    _key, raw = make_key(tenant)
    port = free_port()

    def start():
        return start_server(database_url=_database_url(), processes=1, threads=2, port=port, log=lambda _l: None)

    own = start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "DATABASE"))}
    env.update(ZEROMEM_VENV=str(_fake_venv(tmp_path)), ZEROMEM_API_KEY=raw)
    url = f"http://127.0.0.1:{port}/mcp"
    params = StdioServerParameters(command=sys.executable, args=["-m", "zeromem", "mcp", "--url", url], env=env)

    async def run():
        nonlocal own
        async with Client(params) as client:
            wrote = await client.call_tool("memory_write", {"key": "user:u9:city", "value": "Graz"})
            stop_server(own)
            with anyio.fail_after(60), pytest.raises(MCPError) as down:
                await client.call_tool("memory_read", {"key": "user:u9:city"})
            own = start()
            with anyio.fail_after(60):
                read = await client.call_tool("memory_read", {"key": "user:u9:city"})
            return wrote, down.value, read

    try:
        wrote, down, read = anyio.run(run)
    finally:
        stop_server(own)
    assert wrote.structured_content["status"] == "ok"
    assert "unreachable" in down.message and raw not in down.message
    assert read.structured_content["value"] == "Graz"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_bridge_over_the_keys_rate_limit_says_429_and_retry_after_and_stays_up(server_limited, tmp_path):
    # 4 units a minute. Over them the endpoint's 429 reaches the MCP client as that
    # request's error, saying so; a call over the limit is a tool error; the bridge, still
    # up, answers the next one.
    _key, raw = make_key(make_tenant("mcp-stdio-429"))
    params = _bridge(server_limited, raw, tmp_path)
    _wait_for_a_minutes_start(30)

    async def run():
        async with Client(params) as client:
            listed = await client.list_tools()
            first = await client.call_tool("memory_list", {})
            refused = None
            for _ in range(4):  # what is left of the minute's units (the bridge's own messages used some)
                try:
                    await client.list_tools()
                except MCPError as exc:
                    refused = exc
                    break
            over = await client.call_tool("memory_list", {})
            again = await client.call_tool("memory_list", {})
            return listed, first, refused, over, again

    listed, first, refused, over, again = anyio.run(run)
    assert listed.tools and first.structured_content["status"] == "ok"
    assert f"ZeroMem at {server_limited} answered 429 rate_limited" in str(refused), str(refused)
    assert "retry after" in str(refused)
    for result in (over, again):
        assert result.is_error and result.structured_content["error"]["code"] == "rate_limited"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_bridge_with_a_refused_key_exits_saying_the_server_answered_401(server, tmp_path):
    # Was "Server returned an error response", inside an ExceptionGroup's repr.
    refused = "zm_nothere_" + "k" * 40
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "DATABASE"))}
    env.update(ZEROMEM_VENV=str(_fake_venv(tmp_path)), ZEROMEM_API_KEY=refused)
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
    bridge = subprocess.run(
        [sys.executable, "-m", "zeromem", "mcp", "--url", server],
        input=json.dumps(initialize) + "\n",
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
        timeout=60,
    )
    assert bridge.returncode == 1
    assert f"ZeroMem at {server} answered 401" in bridge.stderr, bridge.stderr
    assert "ZEROMEM_API_KEY" in bridge.stderr and refused not in bridge.stderr
    assert "ExceptionGroup" not in bridge.stderr


def test_the_bridge_imports_no_django():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, memories.mcp.bridge; assert 'django' not in sys.modules, 'django'"],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("DJANGO")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


# --- ALLOWED_HOSTS → the SDK's transport security (no server) -------------------------------


@pytest.mark.django_db
def test_an_unexpected_failure_is_a_generic_tool_error_not_its_exception_text(monkeypatch):
    """On some protocol versions the SDK answers an exception escaping call_tool with str(exc):
    a bug's text (a query, a value) would reach the client, where REST answers a generic 500."""
    from memories.mcp import server as mcp_server

    tenant = make_tenant("mcp-bug")
    key, _raw = make_key(tenant)

    def broken(**kwargs):
        raise RuntimeError("SELECT secret_internal_detail FROM somewhere")

    monkeypatch.setattr(mcp_server.tools, "tool_call", broken)
    actor = Actor(kind=ActorKind.API_KEY, id=str(key.pk), label=key.display_prefix, scopes=frozenset(key.scopes))
    result, text, _size, _tokens = mcp_server.answer(key, actor, "memory_read", {"key": "user:u1:x"})
    assert result == {
        "status": "error",
        "error": {"code": "internal_error", "message": "this call failed on the server", "field": None},
    }
    assert "secret_internal_detail" not in text


def test_transport_security_follows_allowed_hosts():
    security, wrapper_checks = transport_security(["memory.example.com", "127.0.0.1"])
    assert not wrapper_checks and security.enable_dns_rebinding_protection
    assert {"memory.example.com", "memory.example.com:*", "127.0.0.1:*"} <= set(security.allowed_hosts)
    assert "https://memory.example.com" in security.allowed_origins
    # Patterns the SDK cannot express: Django's own validate_host checks them in the wrapper.
    for hosts in (["*"], [".example.com"]):
        security, wrapper_checks = transport_security(hosts)
        assert wrapper_checks and not security.enable_dns_rebinding_protection


# --- the authorization matrix of /mcp: every identity × every tool --------------------------
# (tests/test_authorization_matrix.py walks Django's URL resolver with Django's test client;
# /mcp is not a Django route, so its rows are here, over the live server and the SDK's client.)

TARGET = "user:u10086:pref_lang"
CANARY = "prefers Klingon canaryacme71"
MATRIX_CALLS = (
    ("memory_read", {"key": TARGET}),
    ("memory_write", {"key": TARGET, "value": "overwritten"}),
    ("memory_update", {"key": TARGET, "value": "overwritten", "expected_version": 1}),
    ("memory_delete", {"key": TARGET}),
    ("memory_list", {"prefix": "user:"}),
    ("memory_search", {"query": "Klingon canaryacme71"}),
    ("memory_recall", {"query": "Klingon canaryacme71", "prefix": "user:"}),
    ("memory_summarize", {"prefix": "user:u10086:"}),
)
REFUSED_AT_THE_DOOR = ("revoked", "expired", "no_key", "malformed")


def _identity(name: str, tenant_a, tenant_b) -> str | None:
    if name == "no_key":
        return None
    if name == "malformed":
        return "not-a-zeromem-key"
    if name == "other_tenant":
        return make_key(tenant_b)[1]
    if name == "no_scope":
        return make_key(tenant_a, scopes=[])[1]
    if name == "not_allowed":
        return make_key(tenant_a, allow=["agent:"])[1]
    key, raw = make_key(tenant_a)
    if name == "revoked":
        services.api_key_revoke(tenant=tenant_a, actor=SYSTEM, key_id=key.pk)
    elif name == "expired":
        type(key).objects.filter(pk=key.pk).update(expires_at=key.created_at)
    return raw


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "identity", ["owner", "no_scope", "not_allowed", "other_tenant", "revoked", "expired", "no_key", "malformed"]
)
def test_mcp_matrix(server, identity):
    tenant_a, tenant_b = make_tenant(f"mcp-ma-{identity}"), make_tenant(f"mcp-mb-{identity}")
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key=TARGET, value=CANARY)
    raw = _identity(identity, tenant_a, tenant_b)
    if identity in REFUSED_AT_THE_DOOR:
        headers = {"Accept": "application/json, text/event-stream"}
        if raw:
            headers["Authorization"] = f"Bearer {raw}"
        for name, arguments in MATRIX_CALLS:
            body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
            response = httpx2.post(server, json=body, headers=headers, timeout=30)
            assert response.status_code == 401 and "canaryacme71" not in response.text, (name, response.text)
        return
    answers = calls(server, raw, *MATRIX_CALLS)
    by_tool = {name: a for (name, _), a in zip(MATRIX_CALLS, answers, strict=True)}
    if identity == "owner":  # the positive control: the calls work and find the canary
        assert by_tool["memory_read"]["result"]["value"] == CANARY
        assert not any(a["is_error"] for a in answers), answers
        return
    for name, answer in by_tool.items():
        assert "canaryacme71" not in answer["text"], (identity, name, answer)
    if identity == "no_scope":
        assert all(a["is_error"] and a["result"]["error"]["code"] == "missing_scope" for a in answers), answers
    if identity == "not_allowed":
        for name in ("memory_read", "memory_write", "memory_update", "memory_delete"):
            assert by_tool[name]["result"]["error"]["code"] == "key_not_allowed", by_tool[name]
    if identity == "other_tenant":
        # Tenant A's memory is as missing to them as any other: the write creates their own.
        assert by_tool["memory_read"]["result"]["status"] == "not_found"
        assert by_tool["memory_write"]["result"] == {"status": "ok", "key": TARGET, "version": 1, "created": True}
        assert by_tool["memory_search"]["result"]["results"] == []
        assert not AuditEvent.objects.filter(tenant=tenant_a, surface="mcp").exists()
    # Tenant A's memory is as it was.
    memory = services.memory_read(tenant=tenant_a, actor=SYSTEM, key=TARGET).memory
    assert (memory.value, memory.version) == (CANARY, 1)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "memory_read",'
            ' "name": "memory_delete", "arguments": {"key": "user:u1:kept"}}}',
            "params.name",
        ),
        (
            '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "memory_delete",'
            ' "arguments": {"key": "user:u1:other", "key": "user:u1:kept"}}}',
            "params.arguments.key",
        ),
        ('{"jsonrpc": "2.0", "id": 1, "method": "ping", "method": "tools/list"}', "method"),
        (  # past 64 KiB: checked in a worker thread
            '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "memory_write",'
            ' "arguments": {"key": "user:u1:big", "value": "%s", "value": 1}}}' % ("x" * 100_000),
            "params.arguments.value",
        ),
    ],
    ids=["tool-name", "argument", "method", "100-kB"],
)
def test_a_repeated_member_is_a_parse_error_naming_it_and_runs_nothing(server, body, field):
    # The SDK's parser (pydantic's) kept the last value: a proxy or an audit of the raw body
    # that read the first saw a memory_read where ZeroMem ran a memory_delete.
    tenant = make_tenant(f"mcp-dup-{field.replace('.', '-')}")
    _key, raw = make_key(tenant)
    services.memory_write(tenant=tenant, actor=SYSTEM, key="user:u1:kept", value="keep me")
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {raw}",
    }
    r = httpx2.post(server, content=body, headers=headers, timeout=30)
    assert r.status_code == 400 and r.headers.get("x-request-id"), r.text
    error = JSONRPCError.model_validate(r.json()).error
    assert error.code == -32700 and r.json()["id"] is None, r.text
    assert repr(field.rsplit(".", 1)[-1]) in error.message and len(error.message) <= 160, error.message
    assert error.data == {"field": field}
    assert int(r.headers["content-length"]) == len(r.content)
    assert services.memory_list(tenant=tenant, actor=SYSTEM, prefix="").keys == ["user:u1:kept"]
    assert not [e for e in mcp_events(tenant) if e.action.startswith("memory.")]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_body_refused_for_a_repeated_member_is_charged_as_the_sdks_refusals(server_limited):
    _key, raw = make_key(make_tenant("mcp-dup-charged"))
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {raw}",
    }
    body = '{"jsonrpc": "2.0", "id": 1, "method": "ping", "method": "ping"}'
    _wait_for_a_minutes_start()
    refused = [httpx2.post(server_limited, content=body, headers=headers, timeout=30) for _ in range(4)]
    assert [r.status_code for r in refused] == [400] * 4, [r.text for r in refused]
    assert _rate_limited(_rpc(server_limited, raw, "ping"))  # the four used the minute


# --- the 2026-07-28 protocol (the SDK's single-exchange path) ---------------------------------

MODERN = "2026-07-28"
MODERN_META = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {}}


def _modern_call(url: str, key: str, name: str, arguments: dict) -> httpx2.Response:
    """A ``tools/call`` as a 2026-07-28 client sends it: no initialize, the envelope in
    ``params._meta`` and the routing headers, which send it down the SDK's modern path."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call"}
    body["params"] = {"_meta": MODERN_META, "name": name, "arguments": arguments}
    headers = {
        "Accept": "application/json, text/event-stream",
        "Authorization": f"Bearer {key}",
        "MCP-Protocol-Version": MODERN,
        "Mcp-Method": "tools/call",
        "Mcp-Name": name,
    }
    return httpx2.post(url, json=body, headers=headers, timeout=30)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_2026_protocol_tools_call_is_charged_one_unit_as_the_others(server_limited):
    # On the SDK's 2026-07-28 path a tools/call with arguments first ran the server's own
    # tools/list (to check Mcp-Param headers against the tool's schema) through the server's
    # middleware: each such call cost two units of the key's rate limit (10 calls: 20).
    tenant = make_tenant("mcp-modern-charge")
    _key, raw = make_key(tenant)
    services.memory_write(tenant=tenant, actor=SYSTEM, key="user:u1:k", value="v")
    _wait_for_a_minutes_start()
    # The SDK's own client (mode "auto", its default) probes server/discover and then speaks
    # 2026-07-28: its session is discover, a call, the tools/list it fetches after its first
    # call, a call — four units (six before: the second call was over the minute's four).
    _key, other = make_key(tenant)

    async def session(client):
        return [(await client.call_tool("memory_read", {"key": "user:u1:k"})).structured_content for _ in range(2)]

    assert [r.get("value") for r in over_http(server_limited, other, session)] == ["v", "v"]
    answered = [_modern_call(server_limited, raw, "memory_read", {"key": "user:u1:k"}) for _ in range(4)]
    assert [r.status_code for r in answered] == [200] * 4, [r.text for r in answered]
    assert [r.json()["result"]["structuredContent"]["value"] for r in answered] == ["v"] * 4
    fifth = _modern_call(server_limited, raw, "memory_read", {"key": "user:u1:k"})
    assert fifth.json()["result"]["structuredContent"]["error"]["code"] == "rate_limited", fifth.text


# --- the request's id ----------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "request_id",
    [1.5, True, None, {"a": 1}, [1], "i" * 257, 2**63, -(2**63) - 1],
    ids=["float", "bool", "null", "object", "list", "long-string", "past-64-bits", "below-64-bits"],
)
@pytest.mark.parametrize("modern", [False, True], ids=["2025", "2026"])
def test_a_request_whose_id_is_no_string_or_integer_is_refused_naming_id(server, request_id, modern):
    # The SDK read {"id": 1.5, "method": "tools/call", ...} as a notification (its model
    # ignores the id): 202 Accepted, nothing run, and the client waited for an answer that
    # never came. MCP's ids are strings or integers. And every answer echoes the id: a
    # megabyte string id, or a 4,000-digit number, came back whole (now at most 256
    # characters, 64 bits).
    tenant = make_tenant("mcp-bad-id")
    _key, raw = make_key(tenant)
    params = {"name": "memory_write", "arguments": {"key": "user:u1:k", "value": "v"}}
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {raw}"}
    if modern:
        params["_meta"] = MODERN_META
        headers.update({"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call", "Mcp-Name": "memory_write"})
    body = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}
    r = httpx2.post(server, json=body, headers=headers, timeout=30)
    assert r.status_code == 400 and r.headers.get("x-request-id"), (r.status_code, r.text)
    error = JSONRPCError.model_validate(r.json()).error
    assert (error.code, error.data, r.json()["id"]) == (-32600, {"field": "id"}, None), r.text
    assert "'id'" in error.message and len(error.message) <= 120, error.message
    assert int(r.headers["content-length"]) == len(r.content)
    assert not services.memory_list(tenant=tenant, actor=SYSTEM, prefix="").keys


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("request_id", ["i" * 256, 2**63 - 1, -(2**63)], ids=["256-chars", "max-int", "min-int"])
def test_a_request_id_at_its_bounds_is_answered_and_echoed(server, request_id):
    tenant = make_tenant("mcp-id-bounds")
    _key, raw = make_key(tenant)
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {raw}"}
    params = {"name": "memory_write", "arguments": {"key": "user:u1:k", "value": "v"}}
    body = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}
    r = httpx2.post(server, json=body, headers=headers, timeout=30)
    assert r.status_code == 200 and r.json()["id"] == request_id, r.text
    assert services.memory_list(tenant=tenant, actor=SYSTEM, prefix="").keys == ["user:u1:k"]


# --- one caller's slow requests ----------------------------------------------------------------


def _another_tenant_is_answered_within_5_s(server, other_raw):
    """Another tenant's MCP call and REST read, while slow requests are in flight: both within 5 s."""

    async def session(client):
        with anyio.fail_after(5):
            return (await client.call_tool("memory_list", {})).structured_content["status"]

    started = time.monotonic()
    assert over_http(server, other_raw, session) == "ok"
    rest = httpx2.get(
        server.replace("/mcp", "/api/v1/memories/user:u1:k"),
        headers={"Authorization": f"Bearer {other_raw}"},
        timeout=5,
    )
    assert rest.status_code == 404 and time.monotonic() - started < 5


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_requests_sending_their_body_slowly_make_no_other_tenant_wait(server):
    # The router gave an /mcp request its turn at a request thread before the endpoint read
    # the body: four requests whose body trickles in (two keys of one tenant, one address)
    # held all four threads of the process, and another tenant's MCP and REST requests
    # waited (> 8 s, for as long as the bodies took). REST's small bodies were read first.
    import socket

    slow_tenant, other = make_tenant("mcp-slow"), make_tenant("mcp-slow-other")
    keys = [make_key(slow_tenant)[1] for _ in range(2)]
    _key, other_raw = make_key(other)
    host, port = server.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "ping", "params": {}}).encode()
    slow = []
    try:
        for raw in keys * 2:
            s = socket.create_connection((host, int(port)), timeout=30)
            head = (
                f"POST /mcp HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {raw}\r\n"
                "Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            s.sendall(head.encode() + body[:5])
            slow.append(s)
        time.sleep(0.5)

        _another_tenant_is_answered_within_5_s(server, other_raw)
        for s in slow:  # the slow requests are answered once their bodies are in
            s.sendall(body[5:])
        for s in slow:
            answer = s.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200") and b'"id":7' in answer, answer
    finally:
        for s in slow:
            s.close()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_four_slow_500_kb_bodies_from_four_keys_make_no_other_tenant_wait(server, framing):
    # A body over 64 KiB (up to the 1 MiB cap) or a chunked one streamed to the app from a
    # request thread: four keys (one address) sending 500 KB slowly, two to REST and two to
    # /mcp, held all four threads of the process and another tenant's MCP call and REST read
    # waited for as long as those bodies took. Now the router reads them first.
    import socket

    slow_tenant, other = make_tenant("body-slow"), make_tenant("body-slow-other")
    keys = [make_key(slow_tenant)[1] for _ in range(4)]
    _key, other_raw = make_key(other)
    host, port = server.split("//")[1].split("/")[0].split(":")
    size = 500_000

    def padded(message: dict) -> bytes:  # JSON, then spaces up to 500 KB
        text = json.dumps(message).encode()
        return text + b" " * (size - len(text))

    requests = []
    for n, raw in enumerate(keys):
        if n % 2:
            path, body = "/mcp", padded({"jsonrpc": "2.0", "id": 7, "method": "ping", "params": {}})
        else:
            value = {"name": "memory_write", "arguments": {"key": f"user:u1:big{n}", "value": f"v{n}"}}
            path, body = "/api/v1/tools/call", padded(value)
        framed = f"Content-Length: {size}\r\n" if framing == "content-length" else "Transfer-Encoding: chunked\r\n"
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {raw}\r\n"
            f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n{framed}\r\n"
        ).encode()
        pieces = [body[i : i + 100_000] for i in range(0, size, 100_000)]
        if framing == "chunked":
            pieces = [b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces] + [b"0\r\n\r\n"]
        requests.append((head, pieces))
    slow = []
    try:
        for head, pieces in requests:
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(head + pieces[0])  # 100 KB of 500, the rest later
            slow.append(s)
        time.sleep(0.5)

        _another_tenant_is_answered_within_5_s(server, other_raw)
        for s, (_head, pieces) in zip(slow, requests, strict=True):
            s.sendall(b"".join(pieces[1:]))
        for n, s in enumerate(slow):
            answer = s.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            assert (b'"id":7' if n % 2 else b'"status":"ok"') in answer, answer
    finally:
        for s in slow:
            s.close()
    stored = services.memory_list(tenant=slow_tenant, actor=SYSTEM, prefix="").keys
    assert sorted(stored) == ["user:u1:big0", "user:u1:big2"]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_request_with_two_authorization_headers_is_refused_before_any_key_lookup(server):
    # The SDK verified the first Authorization header while the router's fair share of request
    # threads counted the request against the last one's key lookup: one key, sent with a
    # second made-up header each time, was as many callers as it liked and could hold every
    # thread of a process. REST refuses it (Django joins the two: no key) — and now so does /mcp.
    tenant = make_tenant("mcp-two-auth")
    _key, raw = make_key(tenant)
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call"}
    body["params"] = {"name": "memory_write", "arguments": {"key": "user:u1:k", "value": "v"}}
    headers = [
        ("Accept", "application/json, text/event-stream"),
        ("Content-Type", "application/json"),
        ("Authorization", f"Bearer {raw}"),
        ("Authorization", "Bearer zm_madeup1_x"),
    ]
    r = httpx2.post(server, content=json.dumps(body), headers=headers, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), (r.status_code, r.text)
    assert r.json()["error"]["code"] == "malformed_credentials" and r.json()["error"]["field"] == "Authorization"
    assert r.headers.get("x-request-id")
    assert not services.memory_list(tenant=tenant, actor=SYSTEM, prefix="").keys
    assert not mcp_events(tenant)  # an unverified claim: no row in their log
    assert audit_auth_failures_flush(now=time.time() + 120) == 1  # counted as failures without a key are
    failed = AuditEvent.objects.get(tenant=None, action="auth.failed", surface="mcp")
    assert (failed.count, failed.detail["code"]) == (1, "malformed_credentials")
    one = httpx2.post(server, content=json.dumps(body), headers=headers[:3], timeout=30)
    assert one.json()["result"]["structuredContent"]["status"] == "ok"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("name", "arguments", "field"),
    [
        ("memory_write", '{"key": "user:u1:k\\ud800", "value": "v"}', "arguments.key"),
        ("memory_write", '{"key": "user:u1:k", "value": {"a": ["ok", "\\udfff"]}}', "arguments.value.a.1"),
        ("memory_write", '{"key": "user:u1:k", "value": "v", "tags": ["\\ud800"]}', "arguments.tags.0"),
        ("memory_search", '{"query": "hello \\ud800"}', "arguments.query"),
        ("memory_list", '{"prefix": "user:\\ud800"}', "arguments.prefix"),
    ],
    ids=["key", "nested-value", "tag", "query", "prefix"],
)
def test_a_lone_surrogate_on_the_2026_path_is_refused_as_on_rest(server, name, arguments, field):
    # The 2025 path's parser (pydantic's) refuses "\ud800"; the 2026-07-28 path reads the body
    # with Python's json, which takes it: a key with one was an "internal_error" (recording
    # the refused key failed to encode it, a traceback in the log), a search ran with it.
    # REST answers invalid_characters naming where: so does MCP now.
    tenant = make_tenant("mcp-surrogate")
    _key, raw = make_key(tenant)
    meta = json.dumps(MODERN_META)
    params = f'{{"_meta": {meta}, "name": "{name}", "arguments": {arguments}}}'
    body = '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": ' + params + "}"
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {raw}",
        "MCP-Protocol-Version": MODERN,
        "Mcp-Method": "tools/call",
        "Mcp-Name": name,
    }
    r = httpx2.post(server, content=body, headers=headers, timeout=30)
    result = r.json()["result"]
    assert result["isError"] and result["structuredContent"]["error"]["code"] == "invalid_characters", r.text
    assert result["structuredContent"]["error"]["field"] == field
    events = [(e.action, e.outcome, e.detail, e.actor_kind) for e in mcp_events(tenant)]
    assert events == [("tool.call", "invalid", {"code": "invalid_characters", "field": field}, "api_key")]
    assert not services.memory_list(tenant=tenant, actor=SYSTEM, prefix="").keys
