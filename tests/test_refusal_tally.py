"""Refusals over a tenant's limits (429 ``search_budget``, ``tenant_busy``) are counted per
source and minute and written later as ONE event with the count, in the tenant's own log
(audit/services.py ``_tally_refusal``, ``audit_refusals_flush``): a flood of refused searches
is no longer a flood of synchronous audit commits that every other tenant's audited request
queues behind for the WAL flush. The refusal itself answers as before (429, the code,
Retry-After). The slots and the search budget's counter write without waiting for the flush
either (audit migration 0012: the slots' table is UNLOGGED on PostgreSQL)."""

from unittest import mock

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from audit import limits, tasks
from audit.models import AuditEvent, ConcurrencySlot
from audit.services import audit_refusals_flush
from memories.models import ApiKey
from memories.services import search_budget

CALL = "/api/v1/tools/call"
SEARCH = {"name": "memory_search", "arguments": {"query": "zebra"}}
MINUTE = 28_333_334 * 60


@pytest.fixture
def store(counter_store):
    return counter_store


@pytest.fixture
def clock():
    """The wall clock, set by the test (all of a minute's refusals fall in it, however slow
    the machine): ``clock[0]`` is the time."""
    now = [MINUTE + 1.0]
    with mock.patch("audit.limits.time.time", side_effect=lambda: now[0]):
        yield now


@pytest.fixture
def over_budget(settings, clock):
    """Tenant A's search budget is spent: 5 s of backlog at 100 ms/s, no burst."""
    settings.ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND = 100
    settings.ZEROMEM_TENANT_SEARCH_CPU_BURST_MS = 0

    def spend(tenant, seconds=5):
        limits.backlog(f"{search_budget.BUCKET}{tenant.pk}", add_ms=seconds * 1000)

    return spend


def _refusals(tenant):
    return AuditEvent.objects.filter(tenant=tenant, outcome=AuditEvent.Outcome.INVALID).order_by("id")


def test_30_refused_searches_in_a_minute_are_one_event_with_count_30_in_the_tenants_log(
    api, api_b, tenant_a, tenant_b, store, over_budget, clock
):
    api.call("memory_write", key="fact:z", value="zebra crossing")
    over_budget(tenant_a)
    before = AuditEvent.objects.count()
    for _ in range(30):
        r = api.post(CALL, SEARCH)
        # The refusal answers as before: 429, its code, when to retry.
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "search_budget"
        assert r.headers["Retry-After"] == "5"
    # Nothing written during the minute: each refusal was one counter increment.
    assert AuditEvent.objects.count() == before
    # Another tenant is served meanwhile, and its answered search is recorded at once.
    assert api_b.call("memory_search", query="zebra")[0] == 200
    assert AuditEvent.objects.filter(tenant=tenant_b, action="memory.search", outcome="ok").count() == 1

    assert audit_refusals_flush(now=MINUTE + 60) == 1
    (event,) = _refusals(tenant_a)
    assert (event.action, event.count, event.detail) == (
        "memory.search",
        30,
        {"code": "search_budget", "minute": "2023-11-14T22:14:00+00:00"},
    )
    assert event.actor_kind == AuditEvent.ActorKind.API_KEY
    key = ApiKey.objects.get(tenant=tenant_a)
    assert (event.actor_label, event.actor_id) == (key.display_prefix, str(key.pk))
    assert event.surface == "tool"  # POST /api/v1/tools/call
    assert not _refusals(tenant_b).exists()
    assert audit_refusals_flush(now=MINUTE + 60) == 0  # each minute once
    # A compliance reviewer finds it through the review API like any other event.
    r = api.get("/api/v1/audit-events?action=memory.search&outcome=invalid")
    assert r.status_code == 200
    assert [(e["count"], e["detail"]["code"]) for e in r.json()["results"]] == [(30, "search_budget")]


def test_the_first_refusal_of_a_later_minute_writes_the_closed_minute(api, tenant_a, store, over_budget, clock):
    over_budget(tenant_a, seconds=300)
    for _ in range(3):
        assert api.call("memory_recall", query="zebra")[0] == 429
    assert not _refusals(tenant_a).exists()
    clock[0] = MINUTE + 61.0
    status, body = api.call("memory_recall", query="zebra")
    assert (status, body["error"]["code"]) == (429, "search_budget")
    (closed,) = _refusals(tenant_a)
    assert (closed.action, closed.count, closed.detail["minute"]) == ("memory.recall", 3, "2023-11-14T22:14:00+00:00")
    # The new minute's refusal is counted, and written by the every-minute schedule.
    clock[0] = MINUTE + 121.0
    assert tasks.audit_auth_failures_flush_task() == 1
    assert [(e.count, e.detail["minute"]) for e in _refusals(tenant_a)] == [
        (3, "2023-11-14T22:14:00+00:00"),
        (1, "2023-11-14T22:15:00+00:00"),
    ]


def test_tenant_busy_refusals_are_counted_per_action_and_surface(api, tenant_a, store, settings, clock):
    settings.ZEROMEM_TENANT_MAX_CONCURRENT = 1
    settings.ZEROMEM_TENANT_BUSY_WAIT_SECONDS = 0
    holder = f"tenant:{tenant_a.pk}"
    held = limits.slot_acquire(holder, limit=1, lease=60)
    for _ in range(4):
        r = api.post(CALL, SEARCH)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "tenant_busy"
    for _ in range(2):
        assert api.get("/api/v1/audit-events/export").status_code == 429
    limits.slot_release(holder, held)
    assert api.post(CALL, SEARCH).status_code == 200
    assert audit_refusals_flush(now=MINUTE + 60) == 2
    assert sorted((e.action, e.count, e.detail["code"]) for e in _refusals(tenant_a)) == [
        ("audit.export", 2, "tenant_busy"),
        ("tool.call", 4, "tenant_busy"),
    ]


def test_calls_over_the_keys_rate_limit_are_counted_on_rest_and_mcp(api, tenant_a, store, settings, clock):
    """Before: a key over its rate limit was not audited at all (one row per refusal would
    have made a flood an audit-write flood); now each minute's refusals are one event."""
    from memories.mcp.server import run_call
    from zeromem.kernel.actors import Actor

    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 2
    assert [api.call("memory_list")[0] for _ in range(5)] == [200, 200, 429, 429, 429]
    r = api.post("/api/v1/tools/batch", {"calls": [{"name": "memory_list", "arguments": {}}]})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited" and int(r.headers["Retry-After"]) >= 1
    key = ApiKey.objects.get(tenant=tenant_a)
    actor = Actor(kind="api_key", id=str(key.pk), label=key.display_prefix, scopes=frozenset(key.scopes), surface="mcp")
    result = run_call(key, actor, "memory_list", {})
    assert (result["status"], result["error"]["code"]) == ("error", "rate_limited")
    assert not _refusals(tenant_a).exists()
    assert audit_refusals_flush(now=MINUTE + 60) == 3
    assert sorted((e.action, e.surface, e.count, e.detail["code"]) for e in _refusals(tenant_a)) == [
        ("tool.batch", "tool", 1, "rate_limited"),
        ("tool.call", "mcp", 1, "rate_limited"),
        ("tool.call", "tool", 3, "rate_limited"),
    ]


def test_the_flush_takes_the_minute_from_the_limiters_clock(api, tenant_a, store, settings, monkeypatch):
    """The limiter's clock (audit.limits.clock) alone set back a minute and more, the wall
    clock left as it is: the refusals still make one event. Before, the flush that a
    minute's first refusal runs took the wall clock's minute, found the limiter's minute closed
    and drained each refusal as it came (a CI run wrote six events of count 1 for one of 6)."""
    from types import SimpleNamespace

    monkeypatch.setattr(limits, "time", SimpleNamespace(time=lambda: MINUTE + 1.0))
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 2
    assert [api.call("memory_list")[0] for _ in range(5)] == [200, 200, 429, 429, 429]
    assert not _refusals(tenant_a).exists()
    assert audit_refusals_flush() == 0  # the limiter's minute is still open
    assert audit_refusals_flush(now=MINUTE + 60) == 1
    assert [(e.action, e.count) for e in _refusals(tenant_a)] == [("tool.call", 3)]


def test_a_refused_call_in_a_batch_is_counted_and_the_batch_answers(api, tenant_a, over_budget, settings, clock):
    settings.ZEROMEM_REDIS_URL = ""
    over_budget(tenant_a)
    calls = [SEARCH, {"name": "memory_write", "arguments": {"key": "fact:y", "value": "yak"}}, SEARCH]
    r = api.post("/api/v1/tools/batch", {"calls": calls})
    assert r.status_code == 200
    codes = [c.get("error", {}).get("code") for c in r.json()["results"]]
    assert codes == ["search_budget", None, "search_budget"]
    assert audit_refusals_flush(now=MINUTE + 60) == 1
    (event,) = _refusals(tenant_a)
    assert (event.action, event.count) == ("memory.search", 2)


# --- the slots and the budget's counter: no synchronous commit --------------------------------


def test_a_full_holder_is_refused_without_a_write(db, settings):
    settings.ZEROMEM_REDIS_URL = ""
    tokens = [limits.slot_acquire("tenant:9", limit=2, lease=60) for _ in range(2)]
    assert all(tokens)
    held = set(ConcurrencySlot.objects.values_list("holder", "slot", "token", "started_at"))
    with CaptureQueriesContext(connection) as queries:
        for _ in range(5):  # a waiter polling for a slot: one statement each, inserting nothing
            assert limits.slot_acquire("tenant:9", limit=2, lease=60) is None
    assert len(queries.captured_queries) == 5
    assert set(ConcurrencySlot.objects.values_list("holder", "slot", "token", "started_at")) == held
    limits.slot_release("tenant:9", tokens[0])
    assert limits.slot_acquire("tenant:9", limit=2, lease=60)


@pytest.mark.postgres
def test_the_slots_table_is_unlogged_on_postgresql(db):
    with connection.cursor() as cursor:
        cursor.execute("SELECT relpersistence FROM pg_class WHERE relname = 'audit_concurrencyslot'")
        assert cursor.fetchone()[0] == "u"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_budgets_charge_skips_the_flush_for_its_own_transaction_only(settings):
    settings.ZEROMEM_REDIS_URL = ""
    now = 3_000_000.0
    with CaptureQueriesContext(connection) as own:
        assert limits.backlog("b:sync", add_ms=1000, now=now) == 1.0
    assert "set_config('synchronous_commit', 'off', true)" in own.captured_queries[-1]["sql"]
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        assert limits.backlog("b:sync", add_ms=1000, now=now) == 2.0
    assert "synchronous_commit" not in queries.captured_queries[0]["sql"]
