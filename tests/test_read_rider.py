"""A tool read's rate counter rides with its SELECT (issue 11: at most two database round trips
for an authenticated, audited read). Without Redis the counter is an UPSERT in PostgreSQL
(audit/limits.py); on the lane (memories/api/lane.py) a ``memory_read`` holds it and sends it
with the read's SELECT as one statement (zeromem/kernel/hotsql.py ``riding``), so the read is
the SELECT and its audit INSERT. What the caller, the tenant's log and the limiter see is what
they saw with the counter sent first: the same count, the same 429 before anything is written
or audited, the same refusal of bad input."""

import pytest
from django.db import OperationalError, connection
from django.test.utils import CaptureQueriesContext

from audit import limits
from audit.models import AuditEvent, RateCounter
from audit.services import audit_refusals_flush
from memories import tools
from memories.api import lane
from memories.mcp import server as mcp_server
from memories.models import IdempotencyRecord, Memory
from memories.services import api_keys, usage
from tests.factories import make_key, write
from tests.helpers import RoundTrips
from tests.test_tool_lane import DJANGO, LANE, call
from zeromem.kernel import hotsql
from zeromem.kit.api import RidingRateLimit

on_postgres = pytest.mark.skipif(connection.vendor != "postgresql", reason="the rider is PostgreSQL's")
READ = {"name": "memory_read", "arguments": {"key": "user:u1:lang"}}


@pytest.fixture(autouse=True)
def _lane_settings(settings, limiter_minute):
    # limiter_minute: a test's calls all count in one minute (a minute's first hit also drops
    # the closed windows: one more statement, which round-trip counts would see).
    settings.ZEROMEM_API_KEY_CACHE_SECONDS = 10  # the lane takes only keys this process verified
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 10_000
    settings.ZEROMEM_TOOL_LANE = True
    settings.ZEROMEM_REDIS_URL = ""


def _count(key) -> int:
    return sum(RateCounter.objects.filter(bucket=f"key:{key.pk}").values_list("count", flat=True))


def _reads(tenant, outcome="ok") -> int:
    return AuditEvent.objects.filter(tenant=tenant, action="memory.read", outcome=outcome).count()


@on_postgres
@pytest.mark.parametrize("riding, trips, missing_trips", [(True, 1, 2), (False, 2, 3)])
def test_a_laned_read_is_one_or_two_round_trips(
    transactional_db, tenant_a, riding, trips, missing_trips, monkeypatch, settings
):
    """Outside any transaction, as a server runs it: the counter with the SELECT, and the
    audit INSERT sent with them (the key was read lately: tests/test_read_piped.py), one round
    trip; for a key with no memory the INSERT follows, two. With the counter sent first, as
    every other tool call sends it: the counter, then the SELECT and its event, or three for a
    key with no memory."""
    settings.ZEROMEM_USAGE_FLUSH_SECONDS = 3600  # as served: tokens-returned totals written now and then
    if not riding:
        monkeypatch.setattr(lane, "RIDING_TOOLS", frozenset())
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    assert call(LANE, raw, READ)[0] == "200 OK"  # Django's: the key is verified, then cached
    for key_read in ("user:u1:lang", "user:u1:none"):  # the lane's: its statements prepared
        call(LANE, raw, {"name": "memory_read", "arguments": {"key": key_read}})
    counted = _count(key)
    with RoundTrips() as sent:
        status, _headers, content = call(LANE, raw, READ)
    assert status == "200 OK" and b'"value":"zh-CN"' in content
    assert sent.count == trips, [" ".join(p[2:])[:100] for p in sent.sent]
    assert _count(key) == counted + 1
    assert _reads(tenant_a) == 3
    # Nothing there: the counter still rides, the read answers not_found and is audited so.
    with RoundTrips() as sent:
        status, _headers, content = call(LANE, raw, {"name": "memory_read", "arguments": {"key": "user:u1:none"}})
    assert status == "200 OK" and b'"status":"not_found"' in content
    assert sent.count == missing_trips
    assert _count(key) == counted + 2 and _reads(tenant_a, "not_found") == 2
    usage.flush()  # the totals held back, while the tenant is there


@on_postgres
def test_over_the_limit_a_read_is_refused_before_it_is_answered_or_audited(
    transactional_db, tenant_a, settings, limiter_minute
):
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 3
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    statuses = [call(LANE, raw, READ)[0] for _ in range(5)]
    assert statuses == ["200 OK"] * 3 + ["429 Too Many Requests"] * 2
    status, headers, content = call(LANE, raw, READ)
    assert status == "429 Too Many Requests" and b"zh-CN" not in content
    assert int(dict(headers)["Retry-After"]) >= 1
    assert _reads(tenant_a) == 3  # the refused reads left no read event
    assert _count(key) == 6  # each refused call counted, as with the counter sent first
    audit_refusals_flush(now=limiter_minute + 120)
    refusals = AuditEvent.objects.filter(tenant=tenant_a, action="tool.call", outcome="invalid")
    assert [(e.count, e.detail["code"]) for e in refusals] == [(3, "rate_limited")]


@on_postgres
def test_a_laned_update_is_two_round_trips_and_refused_over_the_limit_before_it_writes(
    transactional_db, tenant_a, settings, limiter_minute
):
    """memory_update (expected_version): the counter rides with the memory's read, then the
    UPDATE, its version row and its event as one statement; past the limit, nothing written."""
    settings.ZEROMEM_USAGE_FLUSH_SECONDS = 3600
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")

    def update(version, value):
        return call(
            LANE,
            raw,
            {
                "name": "memory_update",
                "arguments": {"key": "user:u1:lang", "value": value, "expected_version": version},
            },
        )

    assert update(1, "en")[0] == "200 OK"  # Django's: the key verified, then cached
    assert update(2, "de")[0] == "200 OK"  # the lane's: its statements prepared
    with RoundTrips() as sent:
        status, _headers, content = update(3, "fr")
    assert status == "200 OK" and b'"version":4' in content
    assert sent.count == 2, [" ".join(p[2:])[:100] for p in sent.sent]
    status, _headers, content = update(3, "it")
    assert status == "200 OK" and b'"status":"conflict"' in content and b'"current_version":4' in content
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = _count(key)
    assert update(4, "es")[0] == "429 Too Many Requests"
    assert Memory.objects.get(tenant=tenant_a, key="user:u1:lang").version == 4
    updates = AuditEvent.objects.filter(tenant=tenant_a, action="memory.update").values_list("outcome", flat=True)
    assert sorted(updates) == ["conflict", "ok", "ok", "ok"]
    usage.flush()


@on_postgres
def test_bad_input_is_counted_and_refused_as_before(transactional_db, tenant_a, settings, limiter_minute):
    """A read refused before it selects anything (a bad key) sends the counter alone, first:
    counted, and past the limit a 429 with no event of the bad input."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 2
    key, raw = make_key(tenant_a)
    bad = {"name": "memory_read", "arguments": {"key": ""}}
    assert call(LANE, raw, READ)[0] == "200 OK"
    status, _headers, content = call(LANE, raw, bad)
    assert status == "400 Bad Request" and b'"field":"key"' in content
    assert AuditEvent.objects.filter(tenant=tenant_a, action="memory.read", outcome="invalid").count() == 1
    assert call(LANE, raw, bad)[0] == "429 Too Many Requests"
    assert AuditEvent.objects.filter(tenant=tenant_a, action="memory.read", outcome="invalid").count() == 1
    assert _count(key) == 3


@on_postgres
@pytest.mark.parametrize("app", ["lane", "django"])
def test_a_call_naming_a_cheap_tool_but_running_an_expensive_one_takes_a_tenant_slot(
    transactional_db, tenant_a, settings, app
):
    """The tool a call runs is the one its slot and its rider are decided by: with both a
    ``name`` and a ``function``, the ``function``'s (found by review: a search ran slot-free)."""
    settings.ZEROMEM_TENANT_MAX_CONCURRENT = 0  # every slot taken
    settings.ZEROMEM_TENANT_BUSY_WAIT_SECONDS = 0
    _key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    target = LANE if app == "lane" else DJANGO
    call(DJANGO, raw, READ)  # the key verified, then cached
    assert call(target, raw, {"name": "memory_search", "arguments": {"query": "lang"}})[0] == "429 Too Many Requests"
    disguised = {"name": "memory_read", "function": {"name": "memory_search", "arguments": {"query": "lang"}}}
    status, _headers, content = call(target, raw, disguised)
    assert status == "429 Too Many Requests" and b'"code":"tenant_busy"' in content, (status, content)


@on_postgres
def test_a_tool_that_does_not_ride_sends_a_held_counter_before_it_runs(
    transactional_db, tenant_a, settings, limiter_minute
):
    """Whoever holds the counter for a call, a tool outside RIDING_TOOLS (a delete, which
    locks its row in a transaction) takes it alone before its first statement: past the
    limit it stops there, deleting nothing, and the refusal is counted."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 1
    key, _raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    actor = api_keys.key_actor(key, surface="tool", request_id="rider", client_ip="127.0.0.1")
    delete = {"name": "memory_delete", "arguments": {"key": "user:u1:lang"}}
    assert api_keys.rate_limit_take(key) is None  # the one unit of the minute, spent
    with api_keys.rate_limit_riding(key):
        with pytest.raises(limits.OverLimit):
            tools.tool_call(tenant=tenant_a, actor=actor, call=delete)
    assert Memory.objects.filter(tenant=tenant_a, key="user:u1:lang", deleted_at__isnull=True).exists()
    assert _count(key) == 2


@on_postgres
def test_a_call_naming_a_read_but_running_a_delete_is_charged_before_it_and_writes_nothing_past_the_limit(
    transactional_db, tenant_a, settings, limiter_minute
):
    """Found by review: the delete ran with the counter held for a read, inside its
    transaction — past the limit its refusal rolled the counter back with it (not counted)."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 2
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    assert [call(LANE, raw, READ)[0] for _ in range(2)] == ["200 OK"] * 2
    disguised = {"name": "memory_read", "function": {"name": "memory_delete", "arguments": {"key": "user:u1:lang"}}}
    status, _headers, content = call(LANE, raw, disguised)
    assert status == "429 Too Many Requests", content
    assert Memory.objects.filter(tenant=tenant_a, key="user:u1:lang", deleted_at__isnull=True).exists()
    assert _count(key) == 3
    # Under the limit it runs as the delete it is, charged once.
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 10
    status, _headers, content = call(LANE, raw, disguised)
    assert status == "200 OK" and b'"status":"ok"' in content
    assert not Memory.objects.filter(tenant=tenant_a, key="user:u1:lang", deleted_at__isnull=True).exists()
    assert _count(key) == 4


# --- REST: GET /api/v1/memories/<key> (memories.api.auth.RidingRateLimit) ----------------

MEMORY = "/api/v1/memories/user:u1:lang"


def rest(raw, *, method="GET", query="", path=MEMORY):
    return call(DJANGO, raw, b"", method=method, query=query, path=path)


@on_postgres
@pytest.mark.parametrize("riding, trips, missing_trips", [(True, 2, 2), (False, 2, 3)])
def test_a_rest_read_is_two_round_trips(
    transactional_db, tenant_a, riding, trips, missing_trips, monkeypatch, settings
):
    """Django's whole request, as served (no statement watched): the counter with the
    memory's SELECT, then the audit INSERT. With the throttle taking the counter first: the
    counter, then the SELECT with its event — three for a key with no memory."""
    settings.ZEROMEM_USAGE_FLUSH_SECONDS = 3600
    if not riding:
        monkeypatch.setattr(RidingRateLimit, "rate_limit_rides", lambda self, request, api_key: False)
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    for path in (MEMORY, MEMORY, "/api/v1/memories/user:u1:none"):  # the key verified, statements prepared
        rest(raw, path=path)
    counted = _count(key)
    with RoundTrips() as sent:
        status, headers, content = rest(raw)
    assert status == "200 OK" and b'"value":"zh-CN"' in content and dict(headers)["ETag"]
    assert sent.count == trips, [" ".join(p[2:])[:100] for p in sent.sent]
    assert _count(key) == counted + 1 and _reads(tenant_a) == 3
    with RoundTrips() as sent:
        status, _headers, content = rest(raw, path="/api/v1/memories/user:u1:none")
    assert status == "404 Not Found" and b'"code":"not_found"' in content
    assert sent.count == missing_trips
    assert _count(key) == counted + 2 and _reads(tenant_a, "not_found") == 2
    usage.flush()


@on_postgres
@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("riding", [True, False])
def test_over_the_limit_a_rest_read_is_refused_as_the_throttle_refuses_it(
    transactional_db, tenant_a, settings, limiter_minute, method, riding, monkeypatch
):
    """The same answers, counts and tallied refusal whether the counter rides or the
    throttle takes it first."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 3
    if not riding:
        monkeypatch.setattr(RidingRateLimit, "rate_limit_rides", lambda self, request, api_key: False)
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    statuses = [rest(raw, method=method)[0] for _ in range(5)]
    assert statuses == ["200 OK"] * 3 + ["429 Too Many Requests"] * 2
    status, headers, content = rest(raw)
    assert status == "429 Too Many Requests" and b"zh-CN" not in content
    assert b'"code":"rate_limited"' in content and int(dict(headers)["Retry-After"]) >= 1
    assert _reads(tenant_a) == 3  # the refused reads left no read event
    assert _count(key) == 6
    audit_refusals_flush(now=limiter_minute + 120)
    refusals = AuditEvent.objects.filter(tenant=tenant_a, outcome="invalid")
    # A refused HEAD is recorded as its GET, memory.read (it was "api.request"; a HEAD that is
    # answered was memory.read already: the GET handler's service records it).
    assert [(e.action, e.count, e.detail["code"]) for e in refusals] == [("memory.read", 3, "rate_limited")]


@on_postgres
def test_a_rest_read_refused_before_its_select_is_counted_as_before(
    transactional_db, tenant_a, settings, limiter_minute
):
    """A bad key (refused before any SELECT) sends the counter alone; a repeated query
    parameter is refused after the throttle, which takes it at once. Past the limit both are
    429s, and neither leaves an event of its bad input."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 3
    key, raw = make_key(tenant_a)
    bad = "/api/v1/memories/user::lang"
    assert rest(raw, path=bad)[0] == "400 Bad Request"
    assert rest(raw, query="a=1&a=2")[0] == "400 Bad Request"
    assert _count(key) == 2
    invalid = AuditEvent.objects.filter(tenant=tenant_a, action="memory.read", outcome="invalid")
    assert invalid.count() == 2
    assert rest(raw)[0] == "404 Not Found"
    assert [rest(raw, path=bad)[0], rest(raw, query="a=1&a=2")[0]] == ["429 Too Many Requests"] * 2
    assert invalid.count() == 2 and _count(key) == 5


@on_postgres
@pytest.mark.parametrize("riding", [True, False])
def test_too_many_query_parameters_on_a_rest_read_is_charged_as_before(
    transactional_db, tenant_a, settings, limiter_minute, riding, monkeypatch
):
    """A GET with more query parameters than Django parses (400 too_many_fields, raised as the
    throttle asks whether the counter may ride) is charged by the throttle at once, as before:
    past the limit a 429, not a 400 and an audit event each (found by review)."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 2
    if not riding:
        monkeypatch.setattr(RidingRateLimit, "rate_limit_rides", lambda self, request, api_key: False)
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    many = "&".join(f"p{i}=1" for i in range(settings.DATA_UPLOAD_MAX_NUMBER_FIELDS + 1))
    statuses = [rest(raw, query=many)[0] for _ in range(5)]
    invalid = AuditEvent.objects.filter(tenant=tenant_a, outcome="invalid", detail__code="too_many_fields").count()
    assert (statuses, _count(key), invalid) == (["400 Bad Request"] * 2 + ["429 Too Many Requests"] * 3, 5, 2)


# --- REST: PUT / PATCH /api/v1/memories/<key> (the write reads the memory first) -----------


def rest_write(raw, body, *, method="PUT", path=MEMORY, headers=None):
    return call(DJANGO, raw, body, method=method, path=path, headers=headers)


def _not_riding(monkeypatch):
    monkeypatch.setattr(RidingRateLimit, "rate_limit_rides", lambda self, request, api_key: False)


def _etag(raw) -> str:
    return dict(rest(raw)[1])["ETag"]


@on_postgres
@pytest.mark.parametrize("riding, trips", [(True, 2), (False, 3)])
def test_a_rest_write_or_update_is_two_round_trips(transactional_db, tenant_a, riding, trips, monkeypatch, settings):
    """A PUT over a live memory, a PATCH and a PUT with If-Match: the counter with the
    memory's SELECT, then the UPDATE, its version row and its event as one statement —
    three with the throttle taking the counter first."""
    settings.ZEROMEM_USAGE_FLUSH_SECONDS = 3600
    if not riding:
        _not_riding(monkeypatch)
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    for value in ("en", "de"):  # the key verified, the statements prepared
        assert rest_write(raw, {"value": value})[0] == "200 OK"
        assert rest_write(raw, {"tags": [value]}, method="PATCH")[0] == "200 OK"
    asked = [
        ({"value": "fr"}, "PUT", None, 6),
        ({"value": "it", "expected_version": 6}, "PATCH", None, 7),
        ({"tags": ["x"]}, "PATCH", None, 8),
        ({"value": "es"}, "PUT", "etag", 9),
    ]
    for body, method, if_match, version in asked:
        headers = {"HTTP_IF_MATCH": _etag(raw)} if if_match else None
        counted = _count(key)
        with RoundTrips() as sent:
            status, headers, content = rest_write(raw, body, method=method, headers=headers)
        assert status == "200 OK" and f'"version":{version}'.encode() in content, content
        assert sent.count == trips, (method, [" ".join(p[2:])[:100] for p in sent.sent])
        assert _count(key) == counted + 1
    # A new memory is written in a transaction, after the SELECT that found none took the counter.
    counted = _count(key)
    assert rest_write(raw, {"value": "nl"}, path="/api/v1/memories/user:u1:new")[0] == "201 Created"
    assert _count(key) == counted + 1
    memory = Memory.objects.get(tenant=tenant_a, key="user:u1:lang")
    assert (memory.version, memory.value, memory.tags) == (9, "es", ["x"])
    assert AuditEvent.objects.filter(tenant=tenant_a, action__in=["memory.write", "memory.update"]).count() == 10
    usage.flush()


@on_postgres
@pytest.mark.parametrize("method, action", [("PUT", "memory.write"), ("PATCH", "memory.update")])
@pytest.mark.parametrize("riding", [True, False])
def test_over_the_limit_a_rest_write_is_refused_before_it_writes_as_the_throttle_refuses_it(
    transactional_db, tenant_a, settings, limiter_minute, method, action, riding, monkeypatch
):
    """The same answers, counts and tallied refusal whether the counter rides or the
    throttle takes it first, and nothing written past the limit: over a live memory, on a new
    key (the locked path) and with a bad body (refused inside the handler's block)."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 3
    if not riding:
        _not_riding(monkeypatch)
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    statuses = [rest_write(raw, {"value": f"v{i}"}, method=method)[0] for i in range(5)]
    assert statuses == ["200 OK"] * 3 + ["429 Too Many Requests"] * 2
    status, headers, content = rest_write(raw, {"value": "late"}, method=method)
    assert status == "429 Too Many Requests" and b'"code":"rate_limited"' in content
    assert int(dict(headers)["Retry-After"]) >= 1
    assert rest_write(raw, {"value": "new"}, method=method, path="/api/v1/memories/user:u1:new")[0] == (
        "429 Too Many Requests"
    )
    assert rest_write(raw, b"{not json", method=method)[0] == "429 Too Many Requests"
    assert rest_write(raw, {"value": "x", "nope": 1}, method=method)[0] == "429 Too Many Requests"
    memory = Memory.objects.get(tenant=tenant_a, key="user:u1:lang")
    assert (memory.version, memory.value) == (4, "v2")
    assert not Memory.objects.filter(tenant=tenant_a, key="user:u1:new").exists()
    assert AuditEvent.objects.filter(tenant=tenant_a, action=action, outcome="ok", actor_kind="api_key").count() == 3
    assert _count(key) == 9
    audit_refusals_flush(now=limiter_minute + 120)
    refusals = AuditEvent.objects.filter(tenant=tenant_a, outcome="invalid")
    assert [(e.action, e.count, e.detail["code"]) for e in refusals] == [(action, 6, "rate_limited")]


@on_postgres
@pytest.mark.parametrize("method", ["PUT", "PATCH"])
def test_a_rest_write_with_a_bad_body_is_charged_and_refused_as_before(
    transactional_db, tenant_a, settings, limiter_minute, method
):
    """A body refused before the write reads anything (malformed JSON, an unknown field, a
    bad precondition) sends the counter alone as the handler's block ends: counted, refused
    with its 400 or 412 and audited, and past the limit a 429 with no event of it."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 4
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    status, _headers, content = rest_write(raw, b"{not json", method=method)
    assert status == "400 Bad Request"
    status, _headers, content = rest_write(raw, {"value": "x", "nope": 1}, method=method)
    assert status == "400 Bad Request" and b'"field":"nope"' in content
    status, _headers, content = rest_write(raw, {"value": "x"}, method=method, headers={"HTTP_IF_MATCH": '"bad"'})
    assert status == "412 Precondition Failed"
    assert _count(key) == 3
    refused = AuditEvent.objects.filter(tenant=tenant_a).exclude(outcome="ok")
    assert refused.count() == 3
    assert rest_write(raw, {"value": "en"}, method=method)[0] == "200 OK"
    assert rest_write(raw, {"value": "x", "nope": 1}, method=method)[0] == "429 Too Many Requests"
    assert refused.count() == 3 and _count(key) == 5
    assert Memory.objects.get(tenant=tenant_a, key="user:u1:lang").value == "en"


@on_postgres
def test_a_rest_write_with_an_idempotency_key_is_charged_before_its_claim(
    transactional_db, tenant_a, settings, limiter_minute
):
    """An Idempotency-Key's claim is a write made before the handler: such a request is charged
    by the throttle first, as before, and past the limit claims nothing."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 2
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    once = {"HTTP_IDEMPOTENCY_KEY": "k-1"}
    assert rest_write(raw, {"value": "en"}, headers=once)[0] == "200 OK"
    replay = rest_write(raw, {"value": "en"}, headers=once)
    assert replay[0] == "200 OK" and dict(replay[1])["Idempotent-Replayed"] == "true"
    assert rest_write(raw, {"value": "de"}, headers={"HTTP_IDEMPOTENCY_KEY": "k-2"})[0] == "429 Too Many Requests"
    assert not IdempotencyRecord.objects.filter(tenant=tenant_a, key="k-2").exists()
    assert Memory.objects.get(tenant=tenant_a, key="user:u1:lang").value == "en"
    assert _count(key) == 3


@on_postgres
@pytest.mark.parametrize("method", ["PUT", "PATCH"])
@pytest.mark.parametrize("riding", [True, False])
def test_a_rest_write_whose_select_fails_is_charged_as_before(
    transactional_db, tenant_a, settings, limiter_minute, monkeypatch, method, riding
):
    """The memory's SELECT fails (cancelled by statement_timeout, say): the counter's UPSERT
    went down with it, and is taken alone then — the 503 charged as with the throttle first
    (found by review: riding, it was not charged)."""
    if not riding:
        _not_riding(monkeypatch)
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    assert rest_write(raw, {"value": "en"}, method=method)[0] == "200 OK"
    counted = _count(key)
    send = hotsql._send

    def failing(sql, params, fetch, db=None, **kwargs):
        if '"memories_memory"' in sql and sql.startswith(("SELECT ", "WITH zm_rider ")):
            raise OperationalError("canceling statement due to statement timeout")
        return send(sql, params, fetch, db, **kwargs)

    monkeypatch.setattr(hotsql, "_send", failing)
    status = rest_write(raw, {"value": "de"}, method=method)[0]
    monkeypatch.setattr(hotsql, "_send", send)
    assert status == "503 Service Unavailable"
    assert _count(key) == counted + 1
    assert Memory.objects.get(tenant=tenant_a, key="user:u1:lang").value == "en"


@on_postgres
def test_a_large_rest_write_is_charged_before_its_body_is_parsed(transactional_db, tenant_a, settings, limiter_minute):
    """Past the limit a body is not parsed for nothing: one over ``riding_body_max`` is charged
    by the throttle first (refused before parsing), a small one rides."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 1
    key, raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    large = {"value": "x" * (RidingRateLimit.riding_body_max + 1)}
    parsed = []
    real = RidingRateLimit.rate_limit_riding

    def watched(self):
        parsed.append(self._riding_key is not None)
        return real(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RidingRateLimit, "rate_limit_riding", watched)
        assert rest_write(raw, {"value": "en"})[0] == "200 OK"
        assert rest_write(raw, large)[0] == "429 Too Many Requests"
        assert rest_write(raw, {"value": "de"})[0] == "429 Too Many Requests"
    assert parsed == [True, True]  # the large one never reached its handler
    assert _count(key) == 3 and Memory.objects.get(tenant=tenant_a, key="user:u1:lang").value == "en"


# --- MCP: tools/call memory_read / memory_write (memories.mcp.server.run_call) ------------


def _mcp_actor(key):
    return api_keys.key_actor(key, surface="mcp", request_id="rider", client_ip="127.0.0.1")


@on_postgres
@pytest.mark.parametrize("riding, trips, write_trips", [(True, 2, 2), (False, 2, 3)])
def test_an_mcp_read_is_two_round_trips(transactional_db, tenant_a, riding, trips, write_trips, monkeypatch):
    """What MCP's tools/call runs in its thread (``run_call``): the counter with the SELECT,
    then the audit INSERT. With the counter taken first, as MCP took it before: the counter,
    then the SELECT with its event (the key was written lately); a write, three."""
    if not riding:
        monkeypatch.setattr(tools, "RIDING_TOOLS", frozenset())
    key, _raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    actor = _mcp_actor(key)
    for name in ("user:u1:lang", "user:u1:none"):  # statements prepared
        mcp_server.run_call(key, actor, "memory_read", {"key": name})
    mcp_server.run_call(key, actor, "memory_write", {"key": "user:u1:lang", "value": "de"})
    counted = _count(key)
    with RoundTrips() as sent:
        result = mcp_server.run_call(key, actor, "memory_read", {"key": "user:u1:lang"})
    assert result["status"] == "ok" and result["value"] == "de"
    assert sent.count == trips, [" ".join(p[2:])[:100] for p in sent.sent]
    with RoundTrips() as sent:
        result = mcp_server.run_call(key, actor, "memory_write", {"key": "user:u1:lang", "value": "fr"})
    assert result["status"] == "ok" and result["version"] == 3
    assert sent.count == write_trips
    assert _count(key) == counted + 2
    events = AuditEvent.objects.filter(tenant=tenant_a, surface="mcp").values_list("action", "outcome")
    expected = [("memory.read", "ok")] * 2 + [("memory.read", "not_found")] + [("memory.write", "ok")] * 2
    assert sorted(events) == sorted(expected)


@on_postgres
def test_over_the_limit_an_mcp_read_or_write_is_refused_before_anything_is_written(
    transactional_db, tenant_a, settings, limiter_minute
):
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 2
    key, _raw = make_key(tenant_a)
    write(tenant_a, "user:u1:lang", "zh-CN")
    actor = _mcp_actor(key)
    results = [mcp_server.run_call(key, actor, "memory_read", {"key": "user:u1:lang"}) for _ in range(3)]
    assert [r["status"] for r in results] == ["ok", "ok", "error"]
    assert results[2]["error"]["code"] == "rate_limited" and results[2]["error"]["retry_after"] >= 1
    refused = mcp_server.run_call(key, actor, "memory_write", {"key": "user:u1:lang", "value": "fr"})
    assert refused["error"]["code"] == "rate_limited"
    # A refused argument (NaN) is counted too, and past the limit refused with no event of its own.
    nan = mcp_server.run_call(key, actor, "memory_write", {"key": "user:u1:lang", "value": float("nan")})
    assert nan["error"]["code"] == "rate_limited"
    assert Memory.objects.get(tenant=tenant_a, key="user:u1:lang").version == 1  # nothing written
    assert _reads(tenant_a) == 2 and _count(key) == 5
    assert not AuditEvent.objects.filter(tenant=tenant_a, surface="mcp", action="memory.write").exists()
    assert not AuditEvent.objects.filter(tenant=tenant_a, detail__code="malformed_json").exists()
    audit_refusals_flush(now=limiter_minute + 120)
    refusals = AuditEvent.objects.filter(tenant=tenant_a, action="tool.call", outcome="invalid")
    assert [(e.count, e.detail["code"], e.surface) for e in refusals] == [(3, "rate_limited", "mcp")]


# --- hotsql.riding itself -----------------------------------------------------------------


class _Taken:
    def __init__(self, fail_over: int | None = None):
        self.rows, self.fail_over = [], fail_over

    def __call__(self, row):
        self.rows.append(row)
        if self.fail_over is not None and row[0] > self.fail_over:
            raise limits.OverLimit(limits.Hit(count=row[0], retry_after=1.0))


def _rider(taken, bucket="test:rider"):
    sql = RateCounter._meta.db_table
    return hotsql.Rider(
        lambda own: (
            f'INSERT INTO "{sql}" (bucket, window_start, count) VALUES (%s, %s, %s) '  # noqa: S608 - a test's own statement
            f'ON CONFLICT (bucket, window_start) DO UPDATE SET count = "{sql}".count + 1 RETURNING count'
        ),
        [bucket, 0, 1],
        taken,
    )


SELECT = "SELECT %s::int AS a, %s::text AS b WHERE %s"


def _prepared(taken):
    # Each statement's first run on a connection prepares it (a round trip of its own).
    with hotsql.riding(_rider(taken)):
        hotsql.fetchone(SELECT, [0, "", True])
    with hotsql.riding(_rider(taken)):
        hotsql.fetchall(SELECT, [0, "", True])
    taken.rows.clear()
    RateCounter.objects.filter(bucket="test:rider").delete()


@on_postgres
def test_the_rider_goes_with_the_next_select(db):
    taken = _Taken()
    _prepared(taken)
    with RoundTrips() as sent, hotsql.riding(_rider(taken)):
        assert taken.rows == []  # held
        assert hotsql.fetchone(SELECT, [7, "x", True]) == (7, "x")
        assert taken.rows == [(1,)]
        assert hotsql.fetchone(SELECT, [8, "y", True]) == (8, "y")  # alone: the rider went
    assert sent.count == 2 and taken.rows == [(1,)]
    with RoundTrips() as sent, hotsql.riding(_rider(taken)):
        assert hotsql.fetchone(SELECT, [7, "x", False]) is None  # no row: the rider's still counted
    assert sent.count == 1 and taken.rows == [(1,), (2,)]


@on_postgres
def test_the_rider_goes_alone_before_anything_else(db):
    taken = _Taken()
    _prepared(taken)
    with RoundTrips() as sent, hotsql.riding(_rider(taken)):
        assert hotsql.fetchall(SELECT, [1, "a", True]) == [(1, "a")]
    assert sent.count == 2 and taken.rows == [(1,)]
    with hotsql.riding(_rider(taken)):
        assert hotsql.fetchone(SELECT + " FOR UPDATE", [1, "a", True]) == (1, "a")
        assert taken.rows == [(1,), (2,)]
    with RoundTrips() as sent, hotsql.riding(_rider(taken)):
        pass  # nothing sent in the block: the rider goes at its end
    assert sent.count == 1 and taken.rows[-1] == (3,)
    with pytest.raises(ZeroDivisionError), hotsql.riding(_rider(taken)):
        1 / 0  # noqa: B018 - an error before any statement: the rider is still sent
    assert taken.rows[-1] == (4,)


@on_postgres
def test_a_rider_refusing_stops_the_read(db):
    taken = _Taken(fail_over=1)
    with hotsql.riding(_rider(taken)):
        assert hotsql.fetchone(SELECT, [1, "a", True]) == (1, "a")
    seen = []
    with pytest.raises(limits.OverLimit), hotsql.riding(_rider(taken)):
        seen.append(hotsql.fetchone(SELECT, [2, "b", True]))
    assert seen == [] and taken.rows == [(1,), (2,)]


def test_watched_or_on_sqlite_the_rider_goes_at_once(db):
    """With statements watched (DEBUG, CaptureQueriesContext) or on SQLite, as before: the
    counter first, on its own."""
    taken = _Taken()
    with CaptureQueriesContext(connection) as queries, hotsql.riding(_rider(taken)):
        assert taken.rows == [(1,)]
        assert hotsql.fetchone(SELECT.replace("::int", "").replace("::text", ""), [7, "x", True]) == (7, "x")
    assert len(queries) == 2 and queries[0]["sql"].startswith("INSERT")
