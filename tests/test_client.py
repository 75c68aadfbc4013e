"""The Python client (client/zeromem_client) against a live ZeroMem on the test database:
tool calls, REST with ETags, batches, retries on ZeroMem's own 429s, sync and async, and
that it installs with pip and imports without Django."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zeromem_client
from zeromem_client import AsyncZeroMem, NotFound, PreconditionFailed, RateLimited, ZeroMem, ZeroMemError

from audit import limits
from audit.models import AuditEvent
from memories.models import Memory
from tests.factories import make_key, make_tenant

CLIENT_DIR = Path(__file__).resolve().parent.parent / "client"


@pytest.fixture
def zm_key(transactional_db):
    tenant = make_tenant("acme")
    _, raw = make_key(tenant)
    return tenant, raw


@pytest.fixture
def zm(live_server, zm_key):
    sleeps: list[float] = []
    with ZeroMem(live_server.url, zm_key[1], sleep=sleeps.append) as client:
        client.sleeps = sleeps
        yield client


def test_importable_without_django():
    code = "import sys, zeromem_client; assert 'django' not in sys.modules, 'django imported'; print('ok')"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(CLIENT_DIR)}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_installs_with_pip(tmp_path):
    # From a copy: setuptools leaves build/ and *.egg-info beside the sources it builds.
    source = shutil.copytree(CLIENT_DIR, tmp_path / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"] + ["--target", str(target), str(source)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    dist = [p.name for p in target.iterdir() if p.name.endswith(".dist-info")]
    assert dist == ["zeromem_client-0.1.0.dist-info"]
    requires = (target / dist[0] / "METADATA").read_text()
    assert "Requires-Dist: httpx" in requires
    code = "import zeromem_client; print(zeromem_client.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True
    )
    assert out.stdout.startswith(str(target)), out.stderr


def test_tool_calls_round_trip(zm, zm_key):
    tenant, _ = zm_key
    assert zm.memory_write(key="user:u1:pref_lang", value="zh-CN", tags=["lang"]) == {
        "status": "ok",
        "key": "user:u1:pref_lang",
        "version": 1,
        "created": True,
    }
    read = zm.memory_read(key="user:u1:pref_lang")
    assert (read["status"], read["value"], read["version"]) == ("ok", "zh-CN", 1)
    assert zm.memory_read(key="user:u1:nothing", default="en") == {
        "status": "not_found",
        "key": "user:u1:nothing",
        "value": "en",
    }
    assert zm.memory_update(key="user:u1:pref_lang", value="en", expected_version=5)["status"] == "conflict"
    assert zm.memory_update(key="user:u1:pref_lang", value="en", expected_version=1)["version"] == 2
    assert zm.memory_list(prefix="user:u1:")["keys"] == ["user:u1:pref_lang"]
    assert zm.memory_search(query="pref_lang")["results"][0]["key"] == "user:u1:pref_lang"
    assert "user:u1:pref_lang: en" in zm.memory_recall(prefix="user:u1:")["text"]
    assert {t["function"]["name"] for t in zm.tools()} == set(zeromem_client.TOOL_NAMES)
    with pytest.raises(ZeroMemError) as exc:
        zm.memory_write(key="bad key", value=1)
    assert (exc.value.status, exc.value.code, exc.value.field) == (400, "invalid_key", "key")
    assert zm.memory_delete(key="user:u1:pref_lang") == {"status": "ok"}
    assert not Memory.objects.filter(tenant=tenant, key="user:u1:pref_lang", deleted_at__isnull=True).exists()


def test_memory_read_answers_a_long_value_cut_as_the_model_would_and_get_reads_it_whole(zm):
    value = {"plan": [f"step {i:03d}: do the next thing" for i in range(100)]}
    zm.memory_write(key="task:t1:plan", value=value)
    first = zm.memory_read(key="task:t1:plan")
    assert isinstance(first["value"], str) and len(first["value"]) == 2000
    assert (first["truncated"], first["next_offset"]) == (True, 2000)
    rest = zm.memory_read(key="task:t1:plan", offset=first["next_offset"], max_chars=first["chars"])
    assert json.loads(first["value"] + rest["value"]) == value
    assert zm.get("task:t1:plan")["value"] == value
    found = zm.memory_search(query="next thing")["results"][0]  # a search, too, as the model reads it
    assert (found["value"], found["truncated"], found["next_offset"]) == (first["value"], True, 2000)
    assert zm.memory_search(query="next thing", max_chars=first["chars"])["results"][0]["value"] == value


def test_rest_resources_with_etags(zm, zm_key):
    tenant, _ = zm_key
    created = zm.put("task:t1:status", "open", tags=["t"])
    assert (created["value"], created["version"]) == ("open", 1)
    etag = zm.get("task:t1:status")["etag"]
    assert etag == created["etag"]
    moved = zm.put("task:t1:status", "doing", if_match=etag)
    assert moved["version"] == 2 and moved["etag"] != etag
    with pytest.raises(PreconditionFailed) as exc:
        zm.put("task:t1:status", "lost update", if_match=etag)  # the version it read is gone
    assert exc.value.status == 412
    with pytest.raises(PreconditionFailed):
        zm.delete("task:t1:status", if_match=etag)
    assert Memory.objects.get(tenant=tenant, key="task:t1:status").value == "doing"
    assert zm.patch("task:t1:status", importance=7, if_match=moved["etag"])["importance"] == 7
    assert [v["version"] for v in zm.history("task:t1:status")] == [3, 2, 1]
    assert [v["version"] for v in zm.history("task:t1:status", limit=2)] == [3, 2]
    for i in range(5):
        zm.put(f"task:t1:step{i}", i)
    assert zm.list("task:t1:", limit=2)["next_cursor"]
    assert [m["key"] for m in zm.iter("task:t1:step", page_size=2)] == [f"task:t1:step{i}" for i in range(5)]
    zm.delete("task:t1:status")
    with pytest.raises(NotFound):
        zm.get("task:t1:status")


def test_keys_that_are_dot_segments_reach_their_memory(zm, zm_key):
    # "." and ".." are valid keys, but a URL path segment "." or ".." is removed by httpx's
    # normalisation: get("..") asked GET /api/v1, get(".") the list route.
    tenant, _ = zm_key
    for key in (".", "..", "..."):
        assert zm.put(key, f"value of {key}")["key"] == key
        assert zm.get(key)["value"] == f"value of {key}"
        assert [v["version"] for v in zm.history(key)] == [1]
        zm.delete(key)
        with pytest.raises(NotFound):
            zm.get(key)
    assert not Memory.objects.live().filter(tenant=tenant).exists()


def test_keys_with_combining_marks_round_trip_over_the_tools_and_rest(zm, zm_key):
    tenant, _ = zm_key
    for key in ("user:u1:हिंदी", "user:u1:cafe\u0301", "user:u1:ที่อยู่"):
        assert zm.memory_write(key=key, value="v")["key"] == key
        assert zm.memory_read(key=key)["value"] == "v"
        assert zm.put(key, "w")["key"] == key
        assert zm.get(key)["value"] == "w"
    assert zm.memory_list(prefix="user:u1:हि")["keys"] == ["user:u1:हिंदी"]
    assert sorted(Memory.objects.live().filter(tenant=tenant).values_list("key", flat=True)) == sorted(
        ["user:u1:हिंदी", "user:u1:cafe\u0301", "user:u1:ที่อยู่"]
    )


def test_batch(zm):
    results = zm.batch(
        [
            {"name": "memory_write", "arguments": {"key": "fact:f1", "value": 1}},
            {"name": "memory_write", "arguments": {"key": "bad key", "value": 2}},
            {"name": "memory_read", "arguments": {"key": "fact:f1"}},
        ]
    )
    assert [r["status"] for r in results] == ["ok", "error", "ok"]
    assert results[1]["error"]["field"] == "key"
    assert results[2]["value"] == 1


def test_async_client(live_server, zm_key, settings):
    settings.ZEROMEM_PAGE_VALUES_MAX_BYTES = 5  # "Bo" and "Ann" (4 + 5 bytes): a page each

    async def main():
        async with AsyncZeroMem(live_server.url, zm_key[1]) as zm:
            assert (await zm.memory_write(key="user:u2:name", value="Ann"))["created"] is True
            assert (await zm.memory_read(key="user:u2:name"))["value"] == "Ann"
            m = await zm.get("user:u2:name")
            await zm.put("user:u2:name", "Bo", if_match=m["etag"])
            with pytest.raises(PreconditionFailed):
                await zm.put("user:u2:name", "Cy", if_match=m["etag"])
            assert [r["status"] for r in await zm.batch([{"name": "memory_list", "arguments": {}}])] == ["ok"]
            assert [x["key"] async for x in zm.iter("user:u2:")] == ["user:u2:name"]
            assert [v["value"] for v in await zm.history("user:u2:name")] == ["Bo", "Ann"]
            assert [v["value"] for v in await zm.history("user:u2:name", limit=1)] == ["Bo"]
            return (await zm.get("user:u2:name"))["value"]

    assert asyncio.run(main()) == "Bo"


def test_rate_limited_is_retried_honouring_retry_after_then_raised(live_server, zm_key, settings, limiter_minute):
    """A real 429 from ZeroMem's limiter: the client waits each answer's Retry-After between
    its bounded attempts (the clock is faked through ``sleep``), then raises."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 2
    told = []

    def record(response):
        if response.status_code == 429:
            told.append(int(response.headers["Retry-After"]))

    sleeps = []
    http = httpx.Client(event_hooks={"response": [record]})
    # The limiter counts per calendar minute (audit/limits.py): the 6 requests must fall in
    # one, so they start early in a minute (a CI run crossed the boundary at the 5th).
    if time.time() % 60 > 40:
        time.sleep(61 - time.time() % 60)
    with ZeroMem(live_server.url, zm_key[1], http=http, sleep=sleeps.append) as zm:
        zm.memory_list()
        zm.memory_list()
        with pytest.raises(RateLimited) as exc:
            zm.memory_list()
    assert exc.value.code == "rate_limited"
    assert len(told) == zm.max_attempts == 4 and len(sleeps) == 3  # 4 attempts, 3 waits
    assert all(after <= s <= after + 0.1 for s, after in zip(sleeps, told, strict=False)), (sleeps, told)


def test_tenant_busy_is_retried_until_it_passes(live_server, zm_key, settings):
    """All of the tenant's slots are taken: a search gets a real 429 tenant_busy
    (Retry-After: 1); a slot frees while the client waits, and the retry answers 200."""
    tenant, raw = zm_key
    settings.ZEROMEM_TENANT_BUSY_WAIT_SECONDS = 0
    holder = f"tenant:{tenant.pk}"
    tokens = [limits.slot_acquire(holder, limit=settings.ZEROMEM_TENANT_MAX_CONCURRENT, lease=60) for _ in range(4)]
    assert all(tokens)
    waits = []

    def sleep(seconds):
        waits.append(seconds)
        limits.slot_release(holder, tokens.pop())

    with ZeroMem(live_server.url, raw, sleep=sleep) as zm:
        assert zm.memory_search(query="anything")["status"] == "ok"
    assert len(waits) == 1 and 1 <= waits[0] <= 1.1
    refused = AuditEvent.objects.filter(tenant=tenant, action="memory.search").count()
    assert refused == 1  # the search ran once: the refused attempt never reached the service


def test_connection_errors_are_retried_a_bounded_number_of_times():
    waits = []
    with ZeroMem("http://127.0.0.1:18299", "zm_x_y", sleep=waits.append, max_attempts=3, backoff=0.2) as zm:
        with pytest.raises(httpx.ConnectError):
            zm.memory_read(key="a:b")
    assert len(waits) == 2
    assert 0 <= waits[0] <= 0.2 and 0 <= waits[1] <= 0.4  # full jitter under a doubling ceiling


def test_writes_carry_one_idempotency_key_across_their_retries(live_server, zm_key, settings, limiter_minute):
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 1
    seen = []

    def record(request):
        seen.append((request.method, request.headers.get("Idempotency-Key")))

    http = httpx.Client(event_hooks={"request": [record]})
    with ZeroMem(live_server.url, zm_key[1], http=http, sleep=lambda s: None, max_attempts=3) as zm:
        with pytest.raises(NotFound):
            zm.get("a:b")  # a read: no key
        with pytest.raises(RateLimited):
            zm.memory_write(key="a:b", value=1)
    assert seen[0] == ("GET", None)
    keys = {k for m, k in seen[1:]}
    assert [m for m, _ in seen[1:]] == ["POST"] * 3 and len(keys) == 1 and None not in keys


class _LoseFirstAnswer(httpx.HTTPTransport):
    """The network drops the first answer after the server has done the work."""

    def __init__(self):
        super().__init__()
        self.lost = 0

    def handle_request(self, request):
        response = super().handle_request(request)
        if self.lost == 0:
            self.lost += 1
            response.read()
            response.close()
            raise httpx.ReadError("connection reset", request=request)
        return response


def test_a_write_whose_answer_was_lost_is_retried_without_being_done_twice(live_server, zm_key):
    tenant, raw = zm_key
    transport = _LoseFirstAnswer()
    with ZeroMem(live_server.url, raw, http=httpx.Client(transport=transport), sleep=lambda s: None) as zm:
        zm.put("task:t1:count", 0)  # the answer is lost; the retry gets the stored one
        assert transport.lost == 1
        first = zm.get("task:t1:count")
        moved = zm.memory_update(key="task:t1:count", value=1, expected_version=1)
    assert first["version"] == 1 and moved["version"] == 2
    assert Memory.objects.get(tenant=tenant, key="task:t1:count").version == 2
    assert AuditEvent.objects.filter(tenant=tenant, action="memory.write").count() == 1


def test_a_retry_that_finds_its_first_attempt_still_running_waits_for_its_answer(live_server, zm_key, settings):
    """The first attempt of a write timed out on the client but still runs on the server (its
    Idempotency-Key claimed, no answer yet): the retry gets a real 409
    idempotency_in_progress with Retry-After, waits it, and then gets the first attempt's
    answer — not a Conflict, and the write is not done a second time."""
    from memories.models import ApiKey, IdempotencyRecord
    from memories.services import idempotency

    tenant, raw = zm_key
    settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS = 0.1
    api_key = ApiKey.objects.get(tenant=tenant)
    body = {"name": "memory_write", "arguments": {"key": "task:t1:step", "value": 2}}
    fingerprint = idempotency.fingerprint(method="POST", path="/api/v1/tools/call", if_match=None, data=body)
    running = IdempotencyRecord.objects.create(tenant=tenant, api_key=api_key, key="step-2", fingerprint=fingerprint)
    first_answer = b'{"status":"ok","key":"task:t1:step","version":1,"created":true}'
    waits = []

    def sleep(seconds):
        waits.append(seconds)
        # Meanwhile the first attempt finishes and its answer is stored.
        idempotency.complete(running.pk, status=200, body=first_answer, headers={"Content-Type": "application/json"})

    with ZeroMem(live_server.url, raw, sleep=sleep) as zm:
        result = zm.memory_write(key="task:t1:step", value=2, idempotency_key="step-2")
    assert result == {"status": "ok", "key": "task:t1:step", "version": 1, "created": True}
    assert len(waits) == 1 and 1 <= waits[0] <= 1.1  # the 409's Retry-After
    assert not AuditEvent.objects.filter(tenant=tenant, action="memory.write").exists()  # not done again


def test_an_error_answer_that_is_not_json_raises_zeromem_error():
    """A proxy in front of ZeroMem answers 502 with an HTML page: a tool call raises
    ZeroMemError with the status, as REST calls do, not a JSON decoding error."""

    def proxy(request):
        return httpx.Response(
            502, text="<html><body>502 Bad Gateway</body></html>", headers={"Content-Type": "text/html"}
        )

    http = httpx.Client(transport=httpx.MockTransport(proxy))
    with ZeroMem("http://zeromem.invalid", "zm_x_y", http=http, sleep=lambda s: None) as zm:
        with pytest.raises(ZeroMemError) as exc:
            zm.memory_read(key="a:b")
        assert (exc.value.status, exc.value.code) == (502, "http_502")
        with pytest.raises(ZeroMemError) as exc:
            zm.batch([{"name": "memory_read", "arguments": {"key": "a:b"}}])
        assert exc.value.status == 502


def test_without_idempotency_keys_a_write_whose_answer_was_lost_is_not_sent_again(live_server, zm_key):
    """``idempotency=False``: the server cannot recognise a resent write, so a write whose
    answer was lost after it reached the server is raised, not done twice; a read is still
    retried, and so is a write that never reached the server."""
    tenant, raw = zm_key
    transport = _LoseFirstAnswer()
    options = {"sleep": lambda s: None, "idempotency": False}
    with ZeroMem(live_server.url, raw, http=httpx.Client(transport=transport), **options) as zm:
        with pytest.raises(httpx.ReadError):
            zm.memory_update(key="task:t1:count", value=1)  # not_found, answer lost
        zm.put("task:t1:count", 0)
        transport.lost = 0
        with pytest.raises(httpx.ReadError):
            zm.put("task:t1:count", 1)  # done, answer lost
        transport.lost = 0
        assert zm.get("task:t1:count")["version"] == 2  # a read: retried
    assert Memory.objects.get(tenant=tenant, key="task:t1:count").version == 2
    assert AuditEvent.objects.filter(tenant=tenant, action="memory.write").count() == 2
    waits = []
    with ZeroMem("http://127.0.0.1:18299", raw, sleep=waits.append, idempotency=False, max_attempts=2) as zm:
        with pytest.raises(httpx.ConnectError):
            zm.put("task:t1:count", 2)
    assert len(waits) == 1  # never reached a server: sent again


def test_history_follows_pages_the_byte_budget_cut_short(zm, settings):
    settings.ZEROMEM_PAGE_VALUES_MAX_BYTES = 1000
    for i in range(6):
        zm.put("task:t9:log", chr(ord("a") + i) * 600)  # each version a page of its own
    assert [(v["version"], v["value"][0]) for v in zm.history("task:t9:log", limit=4)] == [
        (6, "f"),
        (5, "e"),
        (4, "d"),
        (3, "c"),
    ]
    assert [v["version"] for v in zm.history("task:t9:log")] == [6, 5, 4, 3, 2, 1]


# --- batches resumed: a call that met a transient failure, retried with the batch's key ---


@pytest.fixture
def failing_writes(monkeypatch):
    """``failing_writes(key, exc, times=1)``: the next ``times`` memory_writes of ``key`` raise
    ``exc`` (the outside world failing), the following ones run for real — in the live
    server's thread too, which shares this process. Returns the writes seen per key."""
    from memories import services

    real = services.memory_write
    seen: dict[str, int] = {}
    failing: dict[str, list] = {}

    def write(**kwargs):
        seen[kwargs["key"]] = seen.get(kwargs["key"], 0) + 1
        left = failing.get(kwargs["key"])
        if left:
            raise left.pop()
        return real(**kwargs)

    monkeypatch.setattr(services, "memory_write", write)

    def arm(key, exc, times=1):
        failing[key] = [exc] * times
        return seen

    return arm


def _batch_of_three():
    return [{"name": "memory_write", "arguments": {"key": f"fact:{k}", "value": i}} for i, k in enumerate("abc")]


def _requests_seen():
    seen = []
    return seen, httpx.Client(event_hooks={"request": [lambda r: seen.append(r.headers.get("Idempotency-Key"))]})


def test_a_batch_call_that_failed_transiently_is_resumed_with_the_batch_key(live_server, zm_key, failing_writes):
    """Call 2 of 3 meets a real tenant_busy inside the batch (the 200 holds it, with its
    retry_after): the client waits that long and sends the batch again with the same
    Idempotency-Key; the server runs call 2 alone, and the client returns three ok results —
    calls 1 and 3 written once. The same with a key the caller chose."""
    from zeromem.kernel.errors import TenantBusy

    tenant, raw = zm_key
    for chosen in (None, "batch-7"):
        prefix = f"{chosen}:" if chosen else ""
        calls = [
            {**c, "arguments": {**c["arguments"], "key": prefix + c["arguments"]["key"]}} for c in _batch_of_three()
        ]
        writes = failing_writes(prefix + "fact:b", TenantBusy("busy", retry_after=1))
        keys, http = _requests_seen()
        waits = []
        with ZeroMem(live_server.url, raw, http=http, sleep=waits.append) as zm:
            results = zm.batch(calls, idempotency_key=chosen)
        assert [r["status"] for r in results] == ["ok", "ok", "ok"]
        assert [r["version"] for r in results] == [1, 1, 1]
        assert {k: writes[prefix + k] for k in ("fact:a", "fact:b", "fact:c")} == {
            "fact:a": 1,
            "fact:b": 2,
            "fact:c": 1,
        }
        assert len(keys) == 2 and len(set(keys)) == 1 and keys[0] == (chosen or keys[0]) and keys[0]
        assert len(waits) == 1 and 1 <= waits[0] <= 1.1  # the call's retry_after
    assert AuditEvent.objects.filter(tenant=tenant, action="memory.write", outcome="ok").count() == 6


def test_a_batch_resumed_until_its_attempts_run_out_returns_the_last_results(live_server, zm_key, failing_writes):
    """Call 2 fails on every attempt (database unavailable): the client sends the batch
    ``max_attempts`` times, backing off, and then returns the last results as they stand —
    call 2's error, call 1 and 3 done once — rather than raising."""
    from django.db import OperationalError

    tenant, raw = zm_key
    writes = failing_writes("fact:b", OperationalError("gone"), times=10)
    keys, http = _requests_seen()
    waits = []
    with ZeroMem(live_server.url, raw, http=http, sleep=waits.append, max_attempts=3, backoff=0.2) as zm:
        results = zm.batch(_batch_of_three())
    assert [r["status"] for r in results] == ["ok", "error", "ok"]
    assert results[1]["error"]["code"] == "database_unavailable"
    assert writes == {"fact:a": 1, "fact:b": 3, "fact:c": 1}
    assert len(keys) == 3 and len(set(keys)) == 1
    assert len(waits) == 2 and 0 <= waits[0] <= 0.2 and 0 <= waits[1] <= 0.4  # backoff: no retry_after
    assert AuditEvent.objects.filter(tenant=tenant, action="memory.write", outcome="ok").count() == 2


def test_a_batch_without_an_idempotency_key_is_not_resumed(live_server, zm_key, failing_writes):
    """``idempotency=False``: sending the batch again would write calls 1 and 3 a second
    time, so its transient error is returned as it is, after one request."""
    from django.db import OperationalError

    writes = failing_writes("fact:b", OperationalError("gone"))
    keys, http = _requests_seen()
    waits = []
    with ZeroMem(live_server.url, zm_key[1], http=http, sleep=waits.append, idempotency=False) as zm:
        results = zm.batch(_batch_of_three())
    assert [r["status"] for r in results] == ["ok", "error", "ok"]
    assert writes == {"fact:a": 1, "fact:b": 1, "fact:c": 1} and keys == [None] and waits == []
    # A key the caller chose is still sent, and with it the batch is resumed.
    failing_writes("fact:b", OperationalError("gone"))
    keys, http = _requests_seen()
    with ZeroMem(live_server.url, zm_key[1], http=http, sleep=waits.append, idempotency=False) as zm:
        calls = [{**c, "arguments": {**c["arguments"], "value": 9}} for c in _batch_of_three()]
        results = zm.batch(calls, idempotency_key="chosen-1")
    assert [r["version"] for r in results] == [2, 1, 2]  # fact:b's first write
    assert writes == {"fact:a": 2, "fact:b": 3, "fact:c": 2} and keys == ["chosen-1", "chosen-1"]


def test_a_resumption_refused_as_a_whole_returns_the_partial_results(live_server, zm_key, settings, failing_writes):
    """The batch's partial 200 is sent again, but the tenant is now busy: a real 429
    tenant_busy until the attempts run out. The client returns the partial results (calls 1
    and 3 committed, call 2's error) rather than raising RateLimited as though none ran."""
    from django.db import OperationalError

    tenant, raw = zm_key
    settings.ZEROMEM_TENANT_BUSY_WAIT_SECONDS = 0
    writes = failing_writes("fact:b", OperationalError("gone"))
    holder = f"tenant:{tenant.pk}"
    tokens = []

    def sleep(seconds):  # meanwhile, other work takes all of the tenant's slots
        deadline = time.monotonic() + 10
        # The first attempt's slot may be released just after its answer was read: wait for it.
        while len(tokens) < settings.ZEROMEM_TENANT_MAX_CONCURRENT and time.monotonic() < deadline:
            token = limits.slot_acquire(holder, limit=settings.ZEROMEM_TENANT_MAX_CONCURRENT, lease=60)
            if token:
                tokens.append(token)
            else:
                time.sleep(0.01)

    statuses, http = [], httpx.Client(event_hooks={"response": [lambda r: statuses.append(r.status_code)]})
    try:
        with ZeroMem(live_server.url, raw, http=http, sleep=sleep, max_attempts=3) as zm:
            results = zm.batch(_batch_of_three())
    finally:
        for token in tokens:
            limits.slot_release(holder, token)
    assert statuses == [200, 429, 429]
    assert [r["status"] for r in results] == ["ok", "error", "ok"]
    assert results[1]["error"]["code"] == "database_unavailable" and writes == {"fact:a": 1, "fact:b": 1, "fact:c": 1}


def test_an_error_that_is_final_is_not_resumed(live_server, zm_key):
    """A call's own error (a bad key) is its answer: one request, no wait."""
    keys, http = _requests_seen()
    waits = []
    with ZeroMem(live_server.url, zm_key[1], http=http, sleep=waits.append) as zm:
        results = zm.batch([{"name": "memory_write", "arguments": {"key": "bad key", "value": 1}}])
    assert results[0]["error"]["code"] == "invalid_key" and len(keys) == 1 and waits == []


def test_the_client_resumes_the_calls_the_server_says_are_pending(live_server, zm_key, failing_writes):
    """Call 2 meets a transient failure whose code no client list holds (a 503
    ``embedding_unavailable``): the answer's ``pending`` names it, so the client resumes it
    with the batch's key — it once returned that error, having guessed from the codes."""
    from zeromem.kernel.errors import Unavailable

    assert "embedding_unavailable" not in zeromem_client.TRANSIENT_CALL_CODES
    writes = failing_writes("fact:b", Unavailable("later", code="embedding_unavailable", retry_after=1))
    keys, http = _requests_seen()
    waits = []
    with ZeroMem(live_server.url, zm_key[1], http=http, sleep=waits.append) as zm:
        results = zm.batch(_batch_of_three())
    assert [r["status"] for r in results] == ["ok", "ok", "ok"]
    assert writes == {"fact:a": 1, "fact:b": 2, "fact:c": 1}
    assert len(keys) == 2 and len(set(keys)) == 1
    assert len(waits) == 1 and 1 <= waits[0] <= 1.1  # the pending call's retry_after


def _fake_server(answers):
    """An httpx transport answering the batches sent to it with ``answers`` in turn (a server
    of another version than this one); the bodies it got go in its ``sent``."""
    sent = []

    def handle(request):
        sent.append(request)
        return httpx.Response(200, json=answers[len(sent) - 1])

    transport = httpx.MockTransport(handle)
    transport.sent = sent
    return transport


def test_the_client_falls_back_to_the_codes_for_a_server_that_lists_no_pending_calls():
    """An older server answers ``{"results": [...]}`` alone: a call whose code is transient
    (``database_unavailable``) is resumed, as before."""
    busy = {"status": "error", "error": {"code": "database_unavailable", "message": "retry", "field": None}}
    ok = {"status": "ok", "key": "fact:a", "version": 1, "created": True}
    transport = _fake_server([{"results": [ok, busy]}, {"results": [ok, ok]}])
    with ZeroMem("http://old", "zm_x", http=httpx.Client(transport=transport), sleep=lambda s: None) as zm:
        results = zm.batch(_batch_of_three()[:2])
    assert [r["status"] for r in results] == ["ok", "ok"] and len(transport.sent) == 2
    assert len({r.headers["Idempotency-Key"] for r in transport.sent}) == 1


def test_the_servers_pending_list_wins_over_the_codes():
    """The server says no call is pending: an error whose code the client's list holds is the
    call's final answer (one request); and a pending list naming a call is followed even when
    its code is unknown."""
    stale = {"status": "error", "error": {"code": "unavailable", "message": "final here", "field": None}}
    transport = _fake_server([{"results": [stale], "pending": []}])
    with ZeroMem("http://new", "zm_x", http=httpx.Client(transport=transport), sleep=lambda s: None) as zm:
        assert zm.batch(_batch_of_three()[:1]) == [stale] and len(transport.sent) == 1
    odd = {"status": "error", "error": {"code": "something_new", "message": "retry", "field": None}}
    ok = {"status": "ok", "key": "fact:a", "version": 1, "created": True}
    transport = _fake_server([{"results": [odd], "pending": [0]}, {"results": [ok], "pending": []}])
    with ZeroMem("http://new", "zm_x", http=httpx.Client(transport=transport), sleep=lambda s: None) as zm:
        assert zm.batch(_batch_of_three()[:1]) == [ok] and len(transport.sent) == 2


def test_the_async_client_resumes_a_batch_too(live_server, zm_key, failing_writes):
    from zeromem.kernel.errors import Unavailable

    writes = failing_writes("fact:b", Unavailable("ran out of time", code="search_timeout", retry_after=2))
    keys = []
    waits = []

    async def record(request):
        keys.append(request.headers.get("Idempotency-Key"))

    async def sleep(seconds):
        waits.append(seconds)

    async def main():
        http = httpx.AsyncClient(event_hooks={"request": [record]})
        async with AsyncZeroMem(live_server.url, zm_key[1], http=http, sleep=sleep) as zm:
            return await zm.batch(_batch_of_three(), idempotency_key="async-batch-1")

    results = asyncio.run(main())
    assert [r["status"] for r in results] == ["ok", "ok", "ok"]
    assert writes == {"fact:a": 1, "fact:b": 2, "fact:c": 1}
    assert keys == ["async-batch-1", "async-batch-1"]
    assert len(waits) == 1 and 2 <= waits[0] <= 2.1
