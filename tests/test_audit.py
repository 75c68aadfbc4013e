"""One audit event per operation, on every tool and REST verb, whatever the outcome; and
never a memory value in the audit log."""
# ruff: noqa: E501  (the scenario table reads best at one case per line)

import json
import re
import time
from types import SimpleNamespace
from unittest import mock

import pytest
from django.test import Client

from audit import services as audit_services
from audit.models import AuditEvent
from audit.verify import audit_verify
from memories import services
from memories.models import ApiKey
from tests.factories import SYSTEM, KeyedClient, make_key
from zeromem.kernel.errors import NotFound

CANARY = "CANARY-5f3a"
KEY = "user:u1:lang"
CALL = "/api/v1/tools/call"


@pytest.fixture
def w(api, tenant_a, make_client):
    """Tenant A with one memory, a full key, a read-only key and a key allowed only user:u1:."""
    status, _ = api.call("memory_write", key=KEY, value=f"{CANARY} english")
    assert status == 200
    ro, ro_key = make_client(tenant_a, scopes=["memory:read"])
    u2, u2_key = make_client(tenant_a, allow=["user:u2:"])
    return SimpleNamespace(
        api=api,
        api_key=ApiKey.objects.get(tenant=tenant_a, name="test key", pk__lt=ro_key.pk),
        ro=ro,
        ro_key=ro_key,
        u2=u2,
        u2_key=u2_key,
        etag=api.get(f"/api/v1/memories/{KEY}").headers["ETag"],
    )


def tool(client_attr, name, **arguments):
    def send(w):
        return getattr(w, client_attr).post(CALL, {"name": name, "arguments": arguments})

    send.who = client_attr
    return send


def tool_raw_arguments(name, arguments: str):
    def send(w):
        return w.api.post(CALL, {"name": name, "arguments": arguments})

    send.who = "api"
    return send


def post(path, body):
    def send(w):
        return w.api.post(path, body)

    send.who = "api"
    return send


def rest(client_attr, method, path, body=None, headers=None, params=None):
    def send(w):
        client = getattr(w, client_attr)
        hdrs = {k: (v.format(etag=w.etag) if isinstance(v, str) else v) for k, v in (headers or {}).items()}
        if method == "get":
            return client.get(path, params, headers=hdrs)
        if method == "delete":
            return client.delete(path, headers=hdrs)
        return getattr(client, method)(path, body, headers=hdrs)

    send.who = client_attr
    return send


def raw_post(path, raw):
    def send(w):
        return w.api.post(path, raw=raw)

    send.who = "api"
    return send


STALE = '"1-999"'
NEW, NONE, U = "user:u1:new", "user:u1:none", f"/api/v1/memories/{KEY}"
BIG = CANARY * 3000


NO_JOB = "00000000-0000-4000-8000-000000000000"  # a job uid no job has


def case(id_, http, action_outcome, target, send):
    """One request, the status it gets and the single audit event it must leave."""
    action, outcome = action_outcome.split()
    return pytest.param(send, http, action, outcome, target, send.who, id=id_)


SCENARIOS = [
    # memory_write
    case("write-created", 200, "memory.write ok", NEW, tool("api", "memory_write", key=NEW, value=CANARY)),
    case("write-replaced", 200, "memory.write ok", KEY, tool("api", "memory_write", key=KEY, value=CANARY)),
    case("write-bad-key", 400, "memory.write invalid", "a::b", tool("api", "memory_write", key="a::b", value=CANARY)),
    case("write-too-large", 413, "memory.write invalid", KEY, tool("api", "memory_write", key=KEY, value=BIG)),
    case("write-nul", 400, "memory.write invalid", KEY, tool("api", "memory_write", key=KEY, value=CANARY + "\x00")),
    case("write-bad-ttl", 400, "memory.write invalid", KEY, tool("api", "memory_write", key=KEY, value=1, ttl_seconds=0)),
    case("write-no-scope", 403, "memory.write denied", KEY, tool("ro", "memory_write", key=KEY, value=CANARY)),
    case("write-not-allowed", 403, "memory.write denied", KEY, tool("u2", "memory_write", key=KEY, value=CANARY)),
    # memory_read
    case("read-ok", 200, "memory.read ok", KEY, tool("api", "memory_read", key=KEY)),
    case("read-miss", 200, "memory.read not_found", NONE, tool("api", "memory_read", key=NONE, default=CANARY)),
    case("read-not-allowed", 403, "memory.read denied", KEY, tool("u2", "memory_read", key=KEY)),
    case("read-bad-key", 400, "memory.read invalid", "a b", tool("api", "memory_read", key="a b")),
    # memory_update
    case("update-ok", 200, "memory.update ok", KEY, tool("api", "memory_update", key=KEY, value=CANARY, expected_version=1)),
    case("update-miss", 200, "memory.update not_found", NONE, tool("api", "memory_update", key=NONE, value=CANARY)),
    case("update-conflict", 200, "memory.update conflict", KEY, tool("api", "memory_update", key=KEY, value=1, expected_version=7)),
    case("update-no-scope", 403, "memory.update denied", KEY, tool("ro", "memory_update", key=KEY, value=CANARY)),
    case("update-too-large", 413, "memory.update invalid", KEY, tool("api", "memory_update", key=KEY, value=BIG)),
    # memory_delete
    case("delete-ok", 200, "memory.delete ok", KEY, tool("api", "memory_delete", key=KEY)),
    case("delete-miss", 200, "memory.delete not_found", NONE, tool("api", "memory_delete", key=NONE)),
    case("delete-no-scope", 403, "memory.delete denied", KEY, tool("ro", "memory_delete", key=KEY)),
    # memory_list / search / recall (the target is the prefix; the query is never recorded)
    case("list-ok", 200, "memory.list ok", "user:", tool("api", "memory_list", prefix="user:")),
    case("list-bad-limit", 400, "memory.list invalid", "user:", tool("api", "memory_list", prefix="user:", limit=0)),
    case("list-bad-cursor", 400, "memory.list invalid", "", tool("api", "memory_list", cursor="!!")),
    case("search-ok", 200, "memory.search ok", "user:", tool("api", "memory_search", query=CANARY, prefix="user:")),
    case("search-no-scope", 403, "memory.search denied", "", tool("ro", "memory_search", query=CANARY)),
    case("recall-ok", 200, "memory.recall ok", "", tool("api", "memory_recall", query=CANARY, max_chars=100)),
    case("recall-bad-max", 400, "memory.recall invalid", "", tool("api", "memory_recall", query=CANARY, max_chars=1)),
    # calls refused before any tool ran
    case("unknown-tool", 400, "tool.call invalid", "", tool("api", "memory_nuke", key=KEY)),
    case("unknown-argument", 400, "tool.call invalid", "", tool("api", "memory_write", key=KEY, value=1, x=CANARY)),
    case("missing-argument", 400, "tool.call invalid", "", tool("api", "memory_write", key=KEY)),
    case("malformed-arguments", 400, "tool.call invalid", "", tool_raw_arguments("memory_write", '{"value": "' + CANARY)),
    case("non-json-body", 400, "tool.call invalid", "", raw_post(CALL, '{"name": "memory_write", "value": "' + CANARY)),
    case("batch-empty", 400, "tool.batch invalid", "", post("/api/v1/tools/batch", {"calls": []})),
    case("batch-non-json", 400, "tool.batch invalid", "", raw_post("/api/v1/tools/batch", "[" + CANARY)),
    # REST
    case("rest-get-ok", 200, "memory.read ok", KEY, rest("api", "get", U)),
    case("rest-get-miss", 404, "memory.read not_found", NONE, rest("api", "get", f"/api/v1/memories/{NONE}")),
    case("rest-get-bad-key", 400, "memory.read invalid", "a::b", rest("api", "get", "/api/v1/memories/a::b")),
    case("rest-get-denied", 403, "memory.read denied", KEY, rest("u2", "get", U)),
    case("rest-put-create", 201, "memory.write ok", NEW, rest("api", "put", f"/api/v1/memories/{NEW}", {"value": CANARY})),
    case("rest-put-replace", 200, "memory.write ok", KEY, rest("api", "put", U, {"value": CANARY})),
    case("rest-put-if-match", 200, "memory.update ok", KEY, rest("api", "put", U, {"value": CANARY}, {"If-Match": "{etag}"})),
    case("rest-put-stale", 412, "memory.update precondition_failed", KEY, rest("api", "put", U, {"value": 1}, {"If-Match": STALE})),
    case("rest-put-bad-field", 400, "memory.write invalid", KEY, rest("api", "put", U, {"value": CANARY, "ttl_seconds": "x"})),
    case("rest-put-unknown-field", 400, "memory.write invalid", KEY, rest("api", "put", U, {"value": CANARY, "x": 1})),
    case("rest-put-too-large", 413, "memory.write invalid", KEY, rest("api", "put", U, {"value": BIG})),
    case("rest-put-no-scope", 403, "memory.write denied", KEY, rest("ro", "put", U, {"value": CANARY})),
    case("rest-patch-ok", 200, "memory.update ok", KEY, rest("api", "patch", U, {"value": CANARY})),
    case("rest-patch-miss", 404, "memory.update not_found", NONE, rest("api", "patch", f"/api/v1/memories/{NONE}", {"value": 1})),
    case("rest-patch-conflict", 409, "memory.update conflict", KEY, rest("api", "patch", U, {"value": 1, "expected_version": 5})),
    case("rest-patch-stale", 412, "memory.update precondition_failed", KEY, rest("api", "patch", U, {"value": 1}, {"If-Match": STALE})),
    case("rest-delete-ok", 204, "memory.delete ok", KEY, rest("api", "delete", U)),
    case("rest-delete-miss", 404, "memory.delete not_found", NONE, rest("api", "delete", f"/api/v1/memories/{NONE}")),
    case("rest-delete-stale", 412, "memory.delete precondition_failed", KEY, rest("api", "delete", U, headers={"If-Match": STALE})),
    case("rest-history-ok", 200, "memory.history ok", KEY, rest("api", "get", f"{U}/history")),
    case("rest-history-miss", 404, "memory.history not_found", NONE, rest("api", "get", f"/api/v1/memories/{NONE}/history")),
    case("rest-history-denied", 403, "memory.history denied", KEY, rest("u2", "get", f"{U}/history")),
    case("rest-list-ok", 200, "memory.list ok", "user:", rest("api", "get", "/api/v1/memories", params={"prefix": "user:"})),
    case("rest-list-bad", 400, "memory.list invalid", "", rest("api", "get", "/api/v1/memories", params={"limit": "0"})),
    # summaries, jobs, forget requests
    case("summarize-tool", 200, "memory.summarize ok", "user:u1:", tool("api", "memory_summarize", prefix="user:u1:")),
    case("summarize-rest", 202, "memory.summarize ok", "user:u1:", post("/api/v1/summaries", {"prefix": "user:u1:"})),
    case("summarize-denied", 403, "memory.summarize denied", "user:u1:", tool("ro", "memory_summarize", prefix="user:u1:")),
    case("job-miss", 404, "job.read not_found", NO_JOB, rest("api", "get", f"/api/v1/jobs/{NO_JOB}")),
    case("job-miss-numeric", 404, "job.read not_found", "", rest("api", "get", "/api/v1/jobs/999999")),
    case("forget-create", 202, "forget.create ok", "", post("/api/v1/forget-requests", {"subject": "u9"})),
    case("forget-create-bad", 400, "forget.create invalid", "", post("/api/v1/forget-requests", {"subject": "u9", "prefix": "user:"})),
    case("forget-create-denied", 403, "forget.create denied", "", rest("ro", "post", "/api/v1/forget-requests", {"subject": "u9"})),
    case("forget-list", 200, "forget.list ok", "", rest("api", "get", "/api/v1/forget-requests")),
    case("forget-read-miss", 404, "forget.read not_found", "", rest("api", "get", "/api/v1/forget-requests/999999")),
    # the audit log itself: reading it is an event too
    case("audit-list", 200, "audit.list ok", "user:", rest("api", "get", "/api/v1/audit-events", params={"key_prefix": "user:"})),
    case("audit-list-bad", 400, "audit.list invalid", "", rest("api", "get", "/api/v1/audit-events", params={"since": "x"})),
    case("audit-list-denied", 403, "audit.list denied", "", rest("ro", "get", "/api/v1/audit-events")),
    case("audit-export", 200, "audit.export ok", "", rest("api", "get", "/api/v1/audit-events/export", params={"format": "jsonl"})),
    case("audit-export-bad", 400, "audit.export invalid", "", rest("api", "get", "/api/v1/audit-events/export", params={"format": "xml"})),
    case("audit-checkpoint", 201, "audit.checkpoint ok", "", rest("api", "post", "/api/v1/audit-checkpoints")),
    case("audit-checkpoint-denied", 403, "audit.checkpoint denied", "", rest("u2", "post", "/api/v1/audit-checkpoints")),
]  # fmt: skip


@pytest.mark.parametrize("send,http,action,outcome,target,who", SCENARIOS)
def test_every_operation_writes_exactly_one_audit_event(w, send, http, action, outcome, target, who):
    before = set(AuditEvent.objects.values_list("pk", flat=True))
    response = send(w)
    assert response.status_code == http, response.content
    events = list(AuditEvent.objects.exclude(pk__in=before))
    assert len(events) == 1, [(e.action, e.outcome) for e in events]
    event = events[0]
    key = {"api": w.api_key, "ro": w.ro_key, "u2": w.u2_key}[who]
    assert event.tenant_id == w.api.tenant.pk
    assert event.actor_kind == "api_key"
    assert event.actor_id == str(key.pk)
    assert event.actor_label == key.display_prefix and event.actor_label.startswith("zm_")
    assert (event.action, event.outcome, event.target) == (action, outcome, target)
    assert event.surface == (
        "tool" if action.startswith("tool.") or "/tools/" in response.request["PATH_INFO"] else "rest"
    )
    assert event.request_id and event.request_id == response.headers["X-Request-ID"]
    assert event.client_ip == "127.0.0.1"
    assert CANARY not in json.dumps(AuditEvent.objects.filter(pk=event.pk).values().get(), default=str)


def test_audit_event_counts_and_versions(w):
    w.api.call("memory_write", key="user:u1:a", value=1)
    w.api.call("memory_write", key="user:u1:a", value=2)
    writes = AuditEvent.objects.filter(action="memory.write", target="user:u1:a").order_by("pk")
    assert [(e.version, e.detail) for e in writes] == [(1, {"created": True}), (2, {"created": False})]
    assert writes[0].subject == "u1"
    w.api.call("memory_list", prefix="user:u1:")
    assert AuditEvent.objects.filter(action="memory.list").latest("pk").count == 2
    w.api.call("memory_update", key="user:u1:a", value=3, expected_version=1)
    conflict = AuditEvent.objects.filter(action="memory.update").latest("pk")
    assert (conflict.outcome, conflict.version, conflict.detail) == ("conflict", 2, {"expected_version": 1})
    w.ro.call("memory_write", key="user:u1:a", value=3)
    denied = AuditEvent.objects.latest("pk")
    assert denied.detail == {"code": "missing_scope", "field": None}


def test_incoming_request_id_is_kept_in_the_audit_event_after_ours(w):
    ids = []
    for _ in range(2):  # the same client id twice: two requests, two ids
        r = w.api.post(
            CALL, {"name": "memory_read", "arguments": {"key": KEY}}, headers={"X-Request-ID": "trace-0123456789"}
        )
        ours, theirs = r.headers["X-Request-ID"].split(".", 1)
        assert re.fullmatch(r"[0-9a-f]{16}", ours) and theirs == "trace-0123456789"
        assert AuditEvent.objects.latest("pk").request_id == r.headers["X-Request-ID"]
        ids.append(r.headers["X-Request-ID"])
    assert ids[0] != ids[1]


def test_forwarded_client_ip_is_used_only_behind_configured_proxies(w, settings):
    w.api.post(CALL, {"name": "memory_read", "arguments": {"key": KEY}}, headers={"X-Forwarded-For": "203.0.113.9"})
    assert AuditEvent.objects.latest("pk").client_ip == "127.0.0.1"
    settings.ZEROMEM_NUM_PROXIES = 1
    w.api.post(CALL, {"name": "memory_read", "arguments": {"key": KEY}}, headers={"X-Forwarded-For": "203.0.113.9"})
    assert AuditEvent.objects.latest("pk").client_ip == "203.0.113.9"


def test_batch_writes_one_event_per_call_with_the_batch_request_id(w):
    before = AuditEvent.objects.count()
    r = w.api.post(
        "/api/v1/tools/batch",
        {
            "calls": [
                {"name": "memory_write", "arguments": {"key": "user:u1:a", "value": CANARY}},
                {"name": "memory_read", "arguments": {"key": "user:u1:none"}},
                {"name": "memory_write", "arguments": {"key": "a::b", "value": CANARY}},
                {"name": "nope", "arguments": {}},
            ]
        },
    )
    assert r.status_code == 200
    events = list(AuditEvent.objects.order_by("pk")[before:])
    assert [(e.action, e.outcome) for e in events] == [
        ("memory.write", "ok"),
        ("memory.read", "not_found"),
        ("memory.write", "invalid"),
        ("tool.call", "invalid"),
    ]
    assert {e.request_id for e in events} == {r.headers["X-Request-ID"]}


# --- failed authentication ----------------------------------------------------------------


def _public(raw):
    return raw[: len("zm_") + 12]


@pytest.mark.parametrize(
    "path,route", [(CALL, "/api/v1/tools/call"), ("/api/v1/memories/user:u1:lang", "/api/v1/memories/<str:key>")]
)
def test_failed_authentication_is_audited_by_verified_claim_and_route(
    w, tenant_a, tenant_b, expired_client, revoked_client, path, route
):
    """A revoked or expired key (its secret matched) is one event in its tenant's log at
    once; a claim nobody verified (no key, a malformed one, a wrong secret — even with a
    real key's public prefix) is never in a tenant's log: it is counted per source and
    minute, then written once, tenant-less, with the count and the route pattern."""
    _, b_raw = make_key(tenant_b)
    verified = [
        (expired_client, "key_expired", _public(expired_client.raw_key)),
        (revoked_client, "key_revoked", _public(revoked_client.raw_key)),
    ]
    unverified = [
        (KeyedClient(None, None, Client()), "missing_credentials"),
        (KeyedClient("sk-not-ours", None, Client()), "malformed_credentials"),
        (KeyedClient(_public(w.api.raw_key) + "_wrong", None, Client()), "invalid_key"),
        (KeyedClient(_public(b_raw) + "_wrong", None, Client()), "invalid_key"),
        (KeyedClient("zm_ffffffffffff_nosuchkey", None, Client()), "invalid_key"),
    ]

    def send(client):
        return (
            client.post(path, {"name": "memory_read", "arguments": {"key": KEY}}) if path == CALL else client.get(path)
        )

    for client, code, label in verified:
        before = set(AuditEvent.objects.values_list("pk", flat=True))
        r = send(client)
        assert (r.status_code, r.json()["error"]["code"]) == (401, code)
        event = AuditEvent.objects.exclude(pk__in=before).get()
        assert (event.action, event.outcome, event.actor_kind) == ("auth.failed", "unauthenticated", "anonymous")
        assert (event.tenant_id, event.actor_label, event.detail) == (tenant_a.pk, label, {"code": code})
        assert event.target == route
        assert event.request_id == r.headers["X-Request-ID"]
        assert event.client_ip == "127.0.0.1"

    before = set(AuditEvent.objects.values_list("pk", flat=True))
    minute = time.time() // 60 * 60
    with mock.patch("audit.limits.time.time", return_value=minute + 1):  # one minute, however slow
        for client, code in unverified:
            r = send(client)
            assert (r.status_code, r.json()["error"]["code"]) == (401, code)
    assert not AuditEvent.objects.exclude(pk__in=before).exists()
    assert audit_services.audit_auth_failures_flush(now=minute + 60) == 3
    events = AuditEvent.objects.exclude(pk__in=before)
    assert {(e.detail["code"], e.count) for e in events} == {
        ("missing_credentials", 1),
        ("malformed_credentials", 1),
        ("invalid_key", 3),
    }
    for event in events:
        assert (event.action, event.outcome, event.actor_kind) == ("auth.failed", "unauthenticated", "anonymous")
        assert (event.tenant_id, event.actor_label, event.target, event.client_ip) == (None, "", route, "127.0.0.1")


def test_key_secret_never_reaches_the_audit_log(w, expired_client):
    secret = w.api.raw_key[len("zm_") + 13 :]
    KeyedClient(_public(w.api.raw_key) + "_" + secret[::-1], None, Client()).call("memory_read", key=KEY)
    expired_client.call("memory_read", key=KEY)
    w.api.call("memory_read", key=KEY)
    dump = json.dumps(list(AuditEvent.objects.values()), default=str)
    assert secret not in dump and secret[::-1] not in dump
    assert expired_client.raw_key[len("zm_") + 13 :] not in dump


# --- values never reach the audit log -----------------------------------------------------


def test_memory_values_never_appear_in_any_audit_row(w):
    for scenario in SCENARIOS:
        scenario.values[0](w)
    w.api.post(
        "/api/v1/tools/batch", {"calls": [{"name": "memory_write", "arguments": {"key": "user:u1:b", "value": CANARY}}]}
    )
    w.api.call("memory_write", key="user:u1:obj", value={"note": CANARY, "list": [CANARY]}, tags=["t"])
    w.api.call("memory_read", key="user:u1:obj")
    w.api.call("memory_recall", query=f"what is {CANARY}?")
    w.api.get("/api/v1/memories/user:u1:obj/history")
    w.api.get("/api/v1/memories", {"prefix": "user:u1:"})
    rows = list(AuditEvent.objects.values())
    assert len(rows) > len(SCENARIOS)
    dump = json.dumps(rows, default=str, ensure_ascii=False)
    assert CANARY not in dump
    assert CANARY.lower() not in dump.lower()


# --- services without an HTTP surface (commands, jobs, admin) -------------------------------


def _not_found(service, **kwargs):
    with pytest.raises(NotFound):
        service(**kwargs)


def _svc(id_, action_outcome, run):
    action, outcome = action_outcome.split()
    return pytest.param(run, action, outcome, id=id_)


SERVICE_SCENARIOS = [
    _svc("tenant-create", "tenant.create ok", lambda w, t: services.tenant_create(actor=SYSTEM, slug="initech")),
    _svc("key-create", "api_key.create ok", lambda w, t: services.api_key_create(tenant=t, actor=SYSTEM, name="k")),
    _svc("key-revoke", "api_key.revoke ok", lambda w, t: services.api_key_revoke(tenant=t, actor=SYSTEM, key_id=w.ro_key.pk)),
    _svc("retention-rule", "retention_rule.set ok",
         lambda w, t: services.retention_rule_set(tenant=t, actor=SYSTEM, prefix="session:", default_ttl_seconds=60)),
    _svc("restore-miss", "memory.restore not_found", lambda w, t: _not_found(services.memory_restore, tenant=t, actor=SYSTEM, memory_id=999999)),
    _svc("audit-checkpoint", "audit.checkpoint ok", lambda w, t: audit_services.audit_checkpoint_create(tenant=t, actor=SYSTEM)),
]  # fmt: skip


@pytest.mark.parametrize("run,action,outcome", SERVICE_SCENARIOS)
def test_every_service_without_http_writes_exactly_one_event(w, tenant_a, run, action, outcome):
    before = set(AuditEvent.objects.values_list("pk", flat=True))
    run(w, tenant_a)
    events = list(AuditEvent.objects.exclude(pk__in=before))
    assert [(e.action, e.outcome) for e in events] == [(action, outcome)]
    event = events[0]
    assert event.tenant_id is not None and event.occurred_at is not None
    assert (event.actor_kind, event.actor_id, event.surface) == ("system", "tests", "job")
    assert len(event.digest) == 64 and event.seal is None


def test_every_recorded_event_verifies_once_sealed(w, tenant_a):
    for scenario in SCENARIOS:
        scenario.values[0](w)
    audit_services.audit_seal(tenant_id=tenant_a.pk)
    result = audit_verify(tenant_id=tenant_a.pk)
    assert result.ok, result.problems
    assert result.events >= len(SCENARIOS)
