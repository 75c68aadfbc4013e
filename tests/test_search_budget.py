"""A tenant's search time budget (memories/services/search_budget.py): searches and recalls
spend their thread's CPU milliseconds against a rate and a burst, counted across processes
(audit/limits.py ``backlog``, in the database or Redis); past it a search is refused at once
with 429 search_budget and Retry-After, audited (counted per minute), and no other tenant is touched."""

import threading
import time

import pytest
from django.db import connection
from django.http.response import HttpResponseBase

from audit import limits
from audit.models import AuditEvent
from audit.services import audit_refusals_flush
from memories.services import search_budget
from tests.helpers import REDIS_TEST_URL, redis_or_fail

SEARCH = {"name": "memory_search", "arguments": {"query": "zebra"}}


@pytest.fixture
def store(counter_store):
    return counter_store


@pytest.fixture
def budget(settings):
    """A rate of 100 CPU ms of search per second and no burst, unless a test says otherwise."""
    settings.ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND = 100
    settings.ZEROMEM_TENANT_SEARCH_CPU_BURST_MS = 0
    return settings


def _bucket(tenant) -> str:
    return f"{search_budget.BUCKET}{tenant.pk}"


# --- the counter: a backlog that drains at one second per second --------------------------


def test_a_backlog_adds_up_drains_with_time_and_never_goes_below_zero(db, store):
    now = 1_000_000.0
    assert limits.backlog("b:1", now=now) == 0
    assert limits.backlog("b:1", add_ms=1500, now=now) == 1.5
    assert limits.backlog("b:1", add_ms=500, now=now) == 2.0
    assert limits.backlog("b:1", now=now + 0.5) == 1.5  # drained half a second
    assert limits.backlog("b:2", now=now) == 0  # another bucket is its own
    assert limits.backlog("b:1", now=now + 10) == 0
    # Past its end a backlog starts again from now, not from its old end.
    assert limits.backlog("b:1", add_ms=1000, now=now + 10) == 1.0


def test_old_windows_pruned_by_the_rate_limit_never_take_a_backlog(db):
    now = 1_000_000.0
    limits.backlog("b:1", add_ms=5000, now=now)
    limits.hit("key:1", now=now + 2 * limits.KEEP_SECONDS)  # a first hit prunes old windows
    assert limits.backlog("b:1", now=now) == 5.0


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("where", ["database", "redis"])
def test_concurrent_charges_from_many_connections_are_all_counted(where, settings):
    settings.ZEROMEM_REDIS_URL = "" if where == "database" else REDIS_TEST_URL
    if where == "redis":
        redis_or_fail()
    now = 2_000_000.0
    barrier = threading.Barrier(8)

    def charge():
        barrier.wait(timeout=10)
        try:
            for _ in range(10):
                limits.backlog("b:concurrent", add_ms=7, now=now)
        finally:
            connection.close()

    threads = [threading.Thread(target=charge) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert limits.backlog("b:concurrent", now=now) == 8 * 10 * 7 / 1000


# --- the budget on the API ------------------------------------------------------------------


def test_a_tenant_past_its_budget_gets_429_with_retry_after_audited_and_another_tenant_is_served(
    api, api_b, store, budget
):
    api.call("memory_write", key="fact:z", value="zebra crossing")
    api_b.call("memory_write", key="fact:z", value="zebra crossing")
    # 5 s of backlog: 500 CPU ms of search at 100 ms/s.
    limits.backlog(_bucket(api.tenant), add_ms=5000)
    r = api.post("/api/v1/tools/call", SEARCH)
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "search_budget"
    assert r.headers["Retry-After"] == "5"
    # Audited as one counted event per source and minute (tests/test_refusal_tally.py).
    audit_refusals_flush(now=time.time() + 60)
    event = AuditEvent.objects.filter(tenant=api.tenant, action="memory.search").latest("id")
    assert (event.outcome, event.detail["code"], event.count) == (AuditEvent.Outcome.INVALID, "search_budget", 1)
    # Recall spends the same budget.
    status, body = api.call("memory_recall", query="zebra")
    assert (status, body["error"]["code"]) == (429, "search_budget")
    # The other tenant searches, and its own backlog is charged, not the first tenant's.
    status, body = api_b.call("memory_search", query="zebra")
    assert status == 200 and [m["key"] for m in body["results"]] == ["fact:z"]
    assert limits.backlog(_bucket(api_b.tenant)) > 0
    assert limits.backlog(_bucket(api.tenant)) <= 5  # refusals cost nothing; b's search not charged to a
    # Cheap work is never refused.
    assert api.call("memory_read", key="fact:z")[0] == 200


def test_each_search_is_charged_its_time_and_admitted_until_the_burst_is_spent(api, store, budget):
    api.call("memory_write", key="fact:z", value="zebra crossing")
    budget.ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND = 1  # 1 CPU ms per second: any search spends seconds
    assert api.call("memory_search", query="zebra")[0] == 200
    held = limits.backlog(_bucket(api.tenant))
    assert held >= 1  # at least 1 ms of search, at 1 ms/s
    status, body = api.call("memory_search", query="zebra")
    assert (status, body["error"]["code"]) == (429, "search_budget")
    # A burst allowance above the backlog admits it again.
    budget.ZEROMEM_TENANT_SEARCH_CPU_BURST_MS = int(held * 1000) + 1000
    assert api.call("memory_search", query="zebra")[0] == 200


def test_a_search_is_charged_after_its_answer_and_a_batch_call_by_call(api, api_b, store, budget, monkeypatch):
    """The charge is one round trip the client need not wait for: it is made when the server
    closes the response (zeromem/kernel/deferred.py). Within one batch, each search's charge
    is made before the next search is admitted, so a batch cannot search past the budget."""
    api.call("memory_write", key="fact:z", value="zebra crossing")
    budget.ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND = 1  # any search spends seconds of backlog
    seen_at_close = []
    real_close = HttpResponseBase.close

    def close(response):
        seen_at_close.append(limits.backlog(_bucket(api.tenant)))  # before the closers run
        real_close(response)

    monkeypatch.setattr(HttpResponseBase, "close", close)
    assert api.call("memory_search", query="zebra")[0] == 200
    assert seen_at_close[-1] == 0  # answered before it was charged ...
    assert limits.backlog(_bucket(api.tenant)) >= 1  # ... and charged once closed
    # Another tenant (a budget of its own, untouched), no burst: one search, then refusals.
    api_b.call("memory_write", key="fact:z", value="zebra crossing")
    budget.ZEROMEM_TENANT_SEARCH_CPU_BURST_MS = 0
    search = {"name": "memory_search", "arguments": {"query": "zebra"}}
    response = api_b.post("/api/v1/tools/batch", {"calls": [search, search, search]})
    results = response.json()["results"]
    assert [r["status"] for r in results] == ["ok", "error", "error"], results
    assert {r["error"]["code"] for r in results[1:]} == {"search_budget"}


def test_a_refused_input_spends_nothing_and_a_rate_of_zero_turns_the_budget_off(api, store, budget):
    assert api.call("memory_search", query="a\x00b")[0] == 400
    assert limits.backlog(_bucket(api.tenant)) == 0
    budget.ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND = 0
    limits.backlog(_bucket(api.tenant), add_ms=60_000)
    assert api.call("memory_search", query="zebra")[0] == 200


def test_a_search_is_answered_even_when_its_time_cannot_be_counted(api, budget, monkeypatch, caplog):
    api.call("memory_write", key="fact:z", value="zebra crossing")
    real = limits.backlog

    def counter_down(bucket, *, add_ms=0, now=None):
        if add_ms:
            raise ConnectionError("the counter store is down")
        return real(bucket, add_ms=add_ms, now=now)

    monkeypatch.setattr(limits, "backlog", counter_down)
    status, body = api.call("memory_search", query="zebra")
    assert status == 200 and [m["key"] for m in body["results"]] == ["fact:z"]
    assert "search time not counted" in caplog.text


def test_the_question_embedded_in_the_encoder_pool_is_charged_to_the_search(api, budget, settings, monkeypatch):
    # The question is embedded in another thread while the word ranking's queries run
    # (memories/search/ranking.py); its CPU time still counts (zeromem/kernel/cpu.py). The
    # embedding here is made to cost 300 ms of CPU in the thread that computes it: charged to
    # the request's thread alone, the search would cost a few ms.
    settings.ZEROMEM_EMBEDDINGS = "on"
    settings.ZEROMEM_EMBEDDINGS_LOAD_WAIT = True
    from memories.search import embeddings

    api.call("memory_write", key="fact:z", value="zebra crossing")
    real = embeddings.query_vector
    seen = []

    def costly(query):
        vector = real(query)
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        seen.append(threading.current_thread().name)
        return vector

    monkeypatch.setattr(embeddings, "query_vector", costly)
    budget.ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND = 1  # 1 CPU ms per second: 300 ms → 300 s of backlog
    status, body = api.call("memory_search", query="zebra")
    assert status == 200 and [m["key"] for m in body["results"]] == ["fact:z"]
    assert len(seen) == 1 and seen[0].startswith("zeromem-embed-question")
    assert limits.backlog(_bucket(api.tenant)) >= 290
