"""The tool-call lane (memories/api/lane.py) answers exactly as the Django view does.

Two tenants set up alike run the same calls, one through Django's WSGI application alone (the
lane off), the other through the lane; everything a client, a compliance reviewer or an
operator sees must be the same: status, body, headers (the request id apart), audit events,
metrics and tokens-returned usage. Each case also says which of the two answered it under the
lane, counted at the DRF view: the lane really answers what it should and stands aside for the
rest."""

from __future__ import annotations

import io
import json
import re
import time as _time
from datetime import date, timedelta
from types import SimpleNamespace

import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import OperationalError, close_old_connections
from django.urls import get_script_prefix, set_script_prefix
from django.utils import timezone

import zeromem.wsgi
from audit.models import AuditEvent
from audit.services import audit_refusals_flush
from memories import services, tools
from memories.api import lane
from memories.api.lane import ToolLane
from memories.api.views import ToolCallView
from memories.models import TokenUsageDay, hash_api_key
from memories.services import key_cache, usage
from tests.factories import SYSTEM, make_key, write
from zeromem.kit import metrics

CALL = "/api/v1/tools/call"
LANE = zeromem.wsgi.application
DJANGO = LANE.django
TIMESTAMP = re.compile(r'"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z)"')


@pytest.fixture(autouse=True)
def _lane_settings(settings, limiter_minute):
    # limiter_minute: a test's calls all count in one minute (a minute's first hit also drops
    # the closed windows: one more statement, which round-trip counts would see).
    settings.ZEROMEM_API_KEY_CACHE_SECONDS = 10  # the lane takes only keys this process verified
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 10_000
    settings.ZEROMEM_TOOL_LANE = True


@pytest.fixture
def views(monkeypatch):
    """How many requests the DRF view answered."""
    seen = []
    dispatch = ToolCallView.dispatch

    def counted(self, request, *args, **kwargs):
        seen.append(request.path)
        return dispatch(self, request, *args, **kwargs)

    monkeypatch.setattr(ToolCallView, "dispatch", counted)
    return seen


def call(app, raw_key, body, *, headers=None, query="", method="POST", content_type="application/json", path=CALL):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "QUERY_STRING": query,
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1",
        "CONTENT_TYPE": content_type,
        "CONTENT_LENGTH": str(len(data)),
        "HTTP_AUTHORIZATION": f"Bearer {raw_key}",
        "wsgi.input": io.BytesIO(data),
        "wsgi.url_scheme": "http",
        "wsgi.errors": io.StringIO(),
    }
    environ.update(headers or {})
    answer = {}
    # As Django's test client does: the request signals must not close the test's connection.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        response = app(environ, lambda status, h, *_: answer.update(status=status, headers=h))
        try:
            content = b"".join(response)
        finally:
            response.close()  # request_finished, and the request's deferred work
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)
    return answer["status"], answer["headers"], content


def seen_by_client(status, headers, content):
    """What a client can compare between two tenants: timestamps and the request id apart."""
    named = dict(headers)
    assert len(named) == len(headers), "a header sent twice"
    request_id = named.pop("X-Request-ID")
    assert re.fullmatch(r"[0-9a-f]{32}|[0-9a-f]{16}\.[A-Za-z0-9._-]+", request_id)
    body = TIMESTAMP.sub('"<time>"', content.decode())
    return status, named, body, request_id


def events(tenant):
    return [
        (
            e.action,
            e.outcome,
            e.target,
            e.subject,
            e.version,
            e.count,
            e.detail,
            e.surface,
            e.actor_kind,
            e.client_ip,
            e.request_id,
        )
        for e in AuditEvent.objects.filter(tenant=tenant, actor_kind="api_key").order_by("id")
    ]


def counters():
    found = {}
    for family in (metrics.REQUESTS, metrics.TOOL_CALLS, metrics.RESULTS, metrics.RESULT_BYTES, metrics.RESULT_TOKENS):
        for metric in family.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    for metric in metrics.LATENCY.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def delta(before, after):
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def usage_of(tenant):
    usage.flush()
    row = TokenUsageDay.objects.filter(tenant=tenant, day=date.today()).first()
    return (row.results, row.bytes, row.tokens) if row else None


# (body or raw bytes, extra environ, query, who answers under the lane: "lane" or "django")
READ = {"name": "memory_read", "arguments": {"key": "user:u1:lang"}}
CASES = [
    ({"name": "memory_write", "arguments": {"key": "user:u1:lang", "value": "zh-CN"}}, {}, "", "lane"),
    ({"name": "memory_read", "arguments": {"key": "user:u1:lang"}}, {}, "", "lane"),
    ({"name": "memory_read", "arguments": {"key": "user:u1:none"}}, {}, "", "lane"),
    ({"name": "memory_read", "arguments": {"key": "user:u1:lang", "max_chars": 2}}, {}, "", "lane"),
    (
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "memory_read", "arguments": json.dumps({"key": "user:u1:lang"})},
        },
        {},
        "",
        "lane",
    ),
    (
        {"name": "memory_write", "arguments": {"key": "user:u1:lang", "value": "x", "expected_version": 7}},
        {},
        "",
        "lane",
    ),
    ({"name": "memory_write", "arguments": {"key": "user:u1:lang", "value": "en", "ttl_seconds": 60}}, {}, "", "lane"),
    ({"name": "memory_update", "arguments": {"key": "user:u1:lang", "tags": ["pref"]}}, {}, "", "lane"),
    ({"name": "memory_list", "arguments": {"prefix": "user:u1:"}}, {}, "", "lane"),
    ({"name": "memory_read", "arguments": {"key": ""}}, {}, "", "lane"),
    ({"name": "memory_read", "arguments": {"key": "user:u1:lang", "limit": "²"}}, {}, "", "lane"),
    ({"name": "memory_fly", "arguments": {}}, {}, "", "lane"),
    ({"name": "memory_read", "arguments": "not an object"}, {}, "", "lane"),
    ({"arguments": {"key": "user:u1:lang"}}, {}, "", "lane"),
    (READ, {"HTTP_X_REQUEST_ID": "client-trace-0001"}, "", "lane"),
    # the audit's client address: X-Forwarded-For under ZEROMEM_NUM_PROXIES (1 in the test)
    (
        {"name": "memory_write", "arguments": {"key": "user:u1:ip", "value": "v"}},
        {"HTTP_X_FORWARDED_FOR": "203.0.113.9, 10.0.0.1"},
        "",
        "lane",
    ),
    # numbers at the edges, and arguments as a JSON string naming a member twice or holding a
    # lone surrogate (the tool's own parsing: the lane's to answer)
    (
        {"name": "memory_write", "arguments": {"key": "user:u1:n", "value": [10**30, 1e308, -0.0, 5e-324]}},
        {},
        "",
        "lane",
    ),
    ({"name": "memory_read", "arguments": '{"key": "user:u1:lang", "key": "user:u1:n"}'}, {}, "", "lane"),
    ({"name": "memory_read", "arguments": '{"key": "user:u1:\\ud800"}'}, {}, "", "lane"),
    ({"name": "memory_read", "arguments": '{"key": "user:u1:\ud800"}'}, {}, "", "django"),
    (b'{"name": "memory_read", "arguments": {"key": "user:u1:lang", "max_chars": 1e400}}', {}, "", "django"),
    (b"\xef\xbb\xbf" + json.dumps(READ).encode(), {}, "", "django"),
    ("é".encode("latin-1") + json.dumps(READ).encode(), {}, "", "django"),
    (READ, {"CONTENT_TYPE": "application/json; charset=utf-8"}, "", "django"),
    (json.dumps(READ).encode("utf-16"), {"CONTENT_TYPE": "application/json; charset=utf-16"}, "", "django"),
    ({"name": "memory_read", "arguments": {"key": "user:u1:lang"}}, {"HTTP_ACCEPT": "*/*"}, "", "lane"),
    (READ, {"HTTP_ACCEPT": "application/json, text/event-stream"}, "", "lane"),  # an MCP client's
    (READ, {"HTTP_ACCEPT": "text/html, application/*"}, "", "lane"),
    # Django's: not an object, not JSON, a name twice, an expensive tool, a query string, other Accept
    ([{"name": "memory_read"}], {}, "", "django"),
    (b'{"name": "memory_read", "arguments": {"key": ', {}, "", "django"),
    (b'{"name": "memory_read", "name": "memory_write", "arguments": {"key": "user:u1:lang"}}', {}, "", "django"),
    ({"name": "memory_search", "arguments": {"query": "language"}}, {}, "", "django"),
    ({"name": "memory_read", "arguments": {"key": "user:u1:lang"}}, {}, "x=1", "django"),
    ({"name": "memory_read", "arguments": {"key": "user:u1:lang"}}, {}, "x=1&x=2", "django"),
    ({"name": "memory_read", "arguments": {"key": "user:u1:lang"}}, {"HTTP_ACCEPT": "text/html"}, "", "django"),
    (READ, {"HTTP_ACCEPT": "application/json; indent=4"}, "", "django"),
    (READ, {"HTTP_ACCEPT": "text/html;q=0.9, application/*;q=0.8"}, "", "django"),  # DRF keeps the q
    (
        {"name": "memory_write", "arguments": {"key": "user:u1:k", "value": 1}},
        {"HTTP_IDEMPOTENCY_KEY": "k"},
        "",
        "django",
    ),
]


def run_cases(app, raw_key, views):
    answers, served = [], []
    for body, extra, query, _who in CASES:
        before = len(views)
        answers.append(seen_by_client(*call(app, raw_key, body, headers=extra, query=query)))
        served.append("django" if len(views) > before else "lane")
    return answers, served


def test_the_lane_answers_as_the_django_view_does(tenant_a, tenant_b, views, settings):
    settings.ZEROMEM_NUM_PROXIES = 1
    _key_a, raw_a = make_key(tenant_a)
    _key_b, raw_b = make_key(tenant_b)
    for tenant in (tenant_a, tenant_b):
        write(tenant, "user:u1:other", "seeded")
    # Each key's first request is Django's (the process has not verified the key yet).
    warm_a = seen_by_client(*call(DJANGO, raw_a, {"name": "memory_read", "arguments": {"key": "user:u1:other"}}))
    warm_b = seen_by_client(*call(LANE, raw_b, {"name": "memory_read", "arguments": {"key": "user:u1:other"}}))
    assert warm_a[:3] == warm_b[:3] and len(views) == 2
    usage.flush()
    usage_before = (usage_of(tenant_a), usage_of(tenant_b))

    before = counters()
    settings.ZEROMEM_TOOL_LANE = False
    django_answers, django_served = run_cases(LANE, raw_a, views)
    django_counters = delta(before, counters())
    settings.ZEROMEM_TOOL_LANE = True
    before = counters()
    lane_answers, lane_served = run_cases(LANE, raw_b, views)
    lane_counters = delta(before, counters())

    assert django_served == ["django"] * len(CASES)
    assert lane_served == [who for *_rest, who in CASES]
    for case, django_answer, lane_answer in zip(CASES, django_answers, lane_answers, strict=True):
        assert lane_answer[:3] == django_answer[:3], case
        # the client's X-Request-ID is kept as the id's tail, on both
        assert lane_answer[3].endswith(".client-trace-0001") == django_answer[3].endswith(".client-trace-0001")
    assert lane_counters == django_counters
    assert any(k[0] == "zeromem_tool_calls_total" for k in lane_counters)

    # The audit log: the same events, each carrying the request id its answer gave.
    events_a, events_b = events(tenant_a), events(tenant_b)
    assert [e[:-1] for e in events_b] == [e[:-1] for e in events_a]
    lane_ids = {answer[3] for answer in lane_answers}
    assert {e[-1] for e in events_b if e[-1] in lane_ids}, "lane events carry the answer's request id"
    # Tokens returned: the same results, bytes and tokens for each tenant.
    grew_a = [n - m for n, m in zip(usage_of(tenant_a), usage_before[0], strict=True)]
    grew_b = [n - m for n, m in zip(usage_of(tenant_b), usage_before[1], strict=True)]
    assert grew_a == grew_b and grew_a[0] >= sum(who == "lane" for *_rest, who in CASES)


def test_a_key_over_its_rate_limit_is_refused_alike(tenant_a, tenant_b, views, settings, limiter_minute):
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 3
    _key_a, raw_a = make_key(tenant_a)
    _key_b, raw_b = make_key(tenant_b)
    read = {"name": "memory_read", "arguments": {"key": "user:u1:lang"}}
    answers = {}
    for name, app, raw in (("django", DJANGO, raw_a), ("lane", LANE, raw_b)):
        answers[name] = [seen_by_client(*call(app, raw, read))[:3] for _ in range(5)]
    assert answers["lane"] == answers["django"]
    assert [a[0] for a in answers["lane"]] == ["200 OK"] * 3 + ["429 Too Many Requests"] * 2
    assert answers["lane"][-1][1]["Retry-After"] == answers["django"][-1][1]["Retry-After"]
    assert len(views) == 1 + 5  # the lane answered its key's calls after the first
    # The refusals are counted per source and minute, one event for each tenant when flushed.
    audit_refusals_flush(now=limiter_minute + 120)
    for tenant in (tenant_a, tenant_b):
        refusals = AuditEvent.objects.filter(tenant=tenant, action="tool.call", outcome="invalid")
        assert [(e.count, e.detail["code"]) for e in refusals] == [(2, "rate_limited")]


def test_a_revoked_key_is_refused_by_django_at_once(tenant_a, views):
    key, raw = make_key(tenant_a)
    read = {"name": "memory_read", "arguments": {"key": "user:u1:lang"}}
    assert call(LANE, raw, read)[0] == "200 OK"
    assert call(LANE, raw, read)[0] == "200 OK"
    assert len(views) == 1
    services.api_key_revoke(tenant=tenant_a, actor=SYSTEM, key_id=key.pk)
    status, headers, content = call(LANE, raw, read)
    assert status == "401 Unauthorized" and json.loads(content)["error"]["code"] == "key_revoked"
    assert dict(headers)["WWW-Authenticate"] == 'Bearer realm="zeromem"'
    assert len(views) == 2


def test_the_database_gone_is_a_503_alike(tenant_a, tenant_b, views, monkeypatch):
    _key_a, raw_a = make_key(tenant_a)
    _key_b, raw_b = make_key(tenant_b)
    read = {"name": "memory_read", "arguments": {"key": "user:u1:lang"}}
    call(DJANGO, raw_a, read)
    call(LANE, raw_b, read)

    def gone(**kwargs):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(tools, "tool_call", gone)
    django_answer = seen_by_client(*call(DJANGO, raw_a, read))
    lane_answer = seen_by_client(*call(LANE, raw_b, read))
    assert lane_answer[:3] == django_answer[:3]
    assert lane_answer[0] == "503 Service Unavailable" and lane_answer[1]["Retry-After"] == "2"
    assert len(views) == 3


def test_the_lane_stands_aside_when_off_or_when_the_middleware_differs(tenant_a, views, settings):
    _key, raw = make_key(tenant_a)
    read = {"name": "memory_read", "arguments": {"key": "user:u1:lang"}}
    call(LANE, raw, read)
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "django.middleware.gzip.GZipMiddleware"]
    call(LANE, raw, read)
    settings.MIDDLEWARE = settings.MIDDLEWARE[:-1]
    settings.ZEROMEM_TOOL_LANE = False
    call(LANE, raw, read)
    assert len(views) == 3
    settings.ZEROMEM_TOOL_LANE = True
    call(LANE, raw, read)
    assert len(views) == 3


# --- What Django's chain decides before the view: the lane must answer the same or stand aside.


@pytest.fixture
def warm_keys(tenant_a, tenant_b):
    """A key of each tenant, verified once by Django with the default settings (the lane
    takes only keys the process knows)."""
    raws = [make_key(tenant)[1] for tenant in (tenant_a, tenant_b)]
    for raw in raws:
        assert call(DJANGO, raw, READ)[0] == "200 OK"
    return raws


def side_by_side(settings, warm_keys, body, *, headers=None, app=LANE):
    """One request answered with the lane off (tenant a's key) and on (tenant b's): the two
    answers as the client sees them (a cookie by its name), the metrics each moved, and
    whether the lane answered the second."""
    answers, moved, answered = [], [], []
    respond = ToolLane._respond

    def counted(lane_app, *args):
        answered.append(True)
        return respond(lane_app, *args)

    for lane_on, raw in zip((False, True), warm_keys, strict=True):
        settings.ZEROMEM_TOOL_LANE = lane_on
        before = counters()
        ToolLane._respond = counted
        try:
            status, headers_sent, content = call(app, raw, body, headers=headers)
        finally:
            ToolLane._respond = respond
        moved.append(delta(before, counters()))
        named = [(name, value.split("=", 1)[0] if name == "Set-Cookie" else value) for name, value in headers_sent]
        answers.append(seen_by_client(status, named, content)[:3])
    return answers, moved, bool(answered)


def fresh_lane():
    """The WSGI application as a server process builds it with the settings of the moment
    (the middleware instances read some settings once, when built)."""
    return ToolLane(WSGIHandler())


@pytest.mark.parametrize(
    ("headers", "by"),
    [
        ({"HTTP_HOST": "evil.example"}, "django"),  # not in ALLOWED_HOSTS: DisallowedHost, 400
        ({"HTTP_HOST": "testserver", "HTTP_X_FORWARDED_HOST": "evil.example"}, "django"),  # USE_X_FORWARDED_HOST
        ({"HTTP_HOST": "testserver", "HTTP_X_FORWARDED_HOST": "localhost"}, "lane"),
        ({"HTTP_USER_AGENT": "evilbot/1.0"}, "django"),  # DISALLOWED_USER_AGENTS: 403
        ({"HTTP_USER_AGENT": "agent/1.0"}, "lane"),
        ({"HTTP_COOKIE": "csrftoken=bad"}, "django"),  # CsrfViewMiddleware replaces it: Set-Cookie, Vary
        ({"HTTP_COOKIE": "theme=dark"}, "lane"),
    ],
)
def test_what_the_middleware_refuses_or_adds_is_answered_alike(settings, warm_keys, headers, by):
    settings.USE_X_FORWARDED_HOST = True
    settings.DISALLOWED_USER_AGENTS = [re.compile("evilbot")]
    (django_answer, lane_answer), (django_moved, lane_moved), by_lane = side_by_side(
        settings, warm_keys, READ, headers=headers
    )
    assert lane_answer == django_answer
    assert lane_moved == django_moved
    assert by_lane == (by == "lane")


def test_prepend_www_is_answered_alike(settings, warm_keys):
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "api.example"]
    settings.PREPEND_WWW = True
    (django_answer, lane_answer), (django_moved, lane_moved), by_lane = side_by_side(
        settings, warm_keys, READ, headers={"HTTP_HOST": "api.example"}
    )
    assert django_answer[0] == "301 Moved Permanently"
    assert lane_answer == django_answer and lane_moved == django_moved and not by_lane


@pytest.mark.parametrize("host", ["testserver", "evil.example"])
def test_the_https_redirect_is_answered_alike(settings, warm_keys, host):
    settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_HSTS_SECONDS = 3600
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    app = fresh_lane()
    (django_answer, lane_answer), (django_moved, lane_moved), by_lane = side_by_side(
        settings, warm_keys, READ, headers={"HTTP_HOST": host}, app=app
    )
    assert django_answer[0] == ("301 Moved Permanently" if host == "testserver" else "400 Bad Request")
    assert lane_answer == django_answer
    assert lane_moved == django_moved  # the redirect is Django's before any route: "unmatched"
    assert not by_lane
    # Over HTTPS (the proxy says so) the call is answered, with HSTS, alike.
    (django_answer, lane_answer), (django_moved, lane_moved), by_lane = side_by_side(
        settings,
        warm_keys,
        READ,
        headers={"HTTP_HOST": "testserver", "HTTP_X_FORWARDED_PROTO": "https"},
        app=app,
    )
    assert django_answer[0] == "200 OK" and "Strict-Transport-Security" in django_answer[1]
    assert lane_answer == django_answer and lane_moved == django_moved and by_lane


def test_a_policy_that_covers_the_api_is_answered_alike(settings, warm_keys):
    settings.CONTENT_SECURITY_POLICY = {"DIRECTIVES": {"default-src": ["'self'"]}}
    (django_answer, lane_answer), _moved, by_lane = side_by_side(settings, warm_keys, READ, app=fresh_lane())
    assert "Content-Security-Policy" in django_answer[1]
    assert lane_answer == django_answer and not by_lane


def test_a_key_expiring_between_the_lanes_checks_is_refused_alike(tenant_a, tenant_b, views, settings, monkeypatch):
    """The lane looks at the cached key's expiry, then verify_api_key looks again: a key that
    expires in between is refused as Django refuses an expired key (401, audited once)."""
    keys = {}
    for tenant in (tenant_a, tenant_b):
        key, raw = make_key(tenant, expires_in_days=1)
        assert call(DJANGO, raw, READ)[0] == "200 OK"
        cached = key_cache.get(key.lookup, hash_api_key(raw))
        cached.expires_at = timezone.now() - timedelta(seconds=1)
        keys[tenant] = raw
    # The lane's own look, a moment earlier: the key still held then.
    real_time = _time.time
    monkeypatch.setattr(lane, "time", SimpleNamespace(time=lambda: real_time() - 60, perf_counter=_time.perf_counter))
    settings.ZEROMEM_TOOL_LANE = False
    django_answer = seen_by_client(*call(LANE, keys[tenant_a], READ))
    settings.ZEROMEM_TOOL_LANE = True
    lane_answer = seen_by_client(*call(LANE, keys[tenant_b], READ))
    assert django_answer[0] == "401 Unauthorized" and json.loads(django_answer[2])["error"]["code"] == "key_expired"
    assert lane_answer[:3] == django_answer[:3]
    assert len(views) == 3  # the two keys' first calls and Django's refusal: the lane answered its own
    failures = [
        [(e.action, e.outcome, e.detail) for e in AuditEvent.objects.filter(tenant=t, action__startswith="auth")]
        for t in (tenant_a, tenant_b)
    ]
    assert failures[0] == failures[1] and len(failures[0]) == 1


def test_an_error_no_handler_answers_is_a_500_alike(tenant_a, tenant_b, views, monkeypatch):
    _key_a, raw_a = make_key(tenant_a)
    _key_b, raw_b = make_key(tenant_b)
    call(DJANGO, raw_a, READ)
    call(LANE, raw_b, READ)

    def broken(**kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(tools, "tool_call", broken)
    before = counters()
    django_answer = seen_by_client(*call(DJANGO, raw_a, READ))
    django_moved = delta(before, counters())
    before = counters()
    lane_answer = seen_by_client(*call(LANE, raw_b, READ))
    assert lane_answer[:3] == django_answer[:3] and lane_answer[0] == "500 Internal Server Error"
    assert delta(before, counters()) == django_moved
    assert len(views) == 3


def test_csrf_tokens_kept_in_sessions_are_answered_alike(settings, warm_keys):
    """With CSRF_USE_SESSIONS CsrfViewMiddleware looks for a session, which API paths do not
    load: Django's answer (an error) is the answer."""
    settings.CSRF_USE_SESSIONS = True
    (django_answer, lane_answer), (django_moved, lane_moved), by_lane = side_by_side(settings, warm_keys, READ)
    assert django_answer[0] == "500 Internal Server Error"
    assert lane_answer == django_answer and lane_moved == django_moved and not by_lane


def test_a_forced_script_name_is_answered_alike(settings, warm_keys):
    """FORCE_SCRIPT_NAME: django.setup() makes it the script prefix, so reverse() names the
    route with it; the lane is still built (the server starts) and answers as Django does."""
    settings.FORCE_SCRIPT_NAME = "/zm"
    prefix = get_script_prefix()
    set_script_prefix("/zm/")
    try:
        app = fresh_lane()
        (django_answer, lane_answer), (django_moved, lane_moved), by_lane = side_by_side(
            settings, warm_keys, READ, app=app
        )
    finally:
        set_script_prefix(prefix)
    assert django_answer[0] == "200 OK"
    assert lane_answer == django_answer and lane_moved == django_moved and by_lane


def test_other_routes_and_methods_are_djangos(warm_keys, monkeypatch):
    """The batch endpoint, a trailing slash, HEAD and OPTIONS on the call's route: Django's."""
    answered = []
    respond = ToolLane._respond
    monkeypatch.setattr(ToolLane, "_respond", lambda lane_app, *args: answered.append(1) or respond(lane_app, *args))
    raw = warm_keys[1]
    batch = call(LANE, raw, {"calls": [READ]}, headers={"PATH_INFO": "/api/v1/tools/batch"})
    assert batch[0] == "200 OK" and json.loads(batch[2])["results"][0]["status"] in ("ok", "not_found")
    assert call(LANE, raw, READ, headers={"PATH_INFO": CALL + "/"})[0] == "404 Not Found"
    assert call(LANE, raw, READ, method="OPTIONS")[0] == "200 OK"
    assert call(LANE, raw, READ, method="HEAD")[0] == "405 Method Not Allowed"
    assert answered == []
    assert call(LANE, raw, READ)[0] == "200 OK" and answered == [1]


@pytest.mark.parametrize("name", [["memory_read"], {"memory_write": 1}])
def test_a_tool_name_that_is_not_a_string_is_refused_alike(tenant_a, tenant_b, views, name):
    """The lane picks the tools whose rate counter rides with their read by name: a name
    that is a list or an object (unhashable) is a malformed call, refused 400 as Django does."""
    _key_a, raw_a = make_key(tenant_a)
    _key_b, raw_b = make_key(tenant_b)
    body = {"name": name, "arguments": {"key": "user:u1:lang"}}
    call(DJANGO, raw_a, body)
    call(LANE, raw_b, body)  # each key's first request is Django's
    django_answer = seen_by_client(*call(DJANGO, raw_a, body))
    lane_answer = seen_by_client(*call(LANE, raw_b, body))
    assert lane_answer[:3] == django_answer[:3]
    assert lane_answer[0].startswith("400")
