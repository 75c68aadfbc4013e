"""The per-key rate limit: each call of a batch counts, and the count is exact across
processes — one Redis script when REDIS_URL is set, one UPSERT in the database otherwise
(audit/limits.py). The real-server race (80 parallel requests, limit 20) is in test_serve.py.

Redis tests use ZEROMEM_TEST_REDIS_URL (default db 7 on the loopback) and fail, not skip,
when no Redis answers there: a skipped test would hide that the Redis path went unchecked."""

import pytest

from audit import limits
from tests.helpers import REDIS_TEST_URL, redis_or_fail

BATCH = "/api/v1/tools/batch"


@pytest.fixture(params=["database", "redis"])
def counter_store(request, settings):
    settings.ZEROMEM_REDIS_URL = "" if request.param == "database" else REDIS_TEST_URL
    if request.param == "redis":
        redis_or_fail()
    return request.param


def _batch(n):
    return {"calls": [{"name": "memory_list", "arguments": {}} for _ in range(n)]}


def test_each_call_of_a_batch_counts_against_the_limit(api, settings, counter_store, limiter_minute):
    """Before: a batch of 50 calls cost one unit."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 10
    assert api.post(BATCH, _batch(6)).status_code == 200
    assert api.post(BATCH, _batch(4)).status_code == 200  # exactly 10
    r = api.post(BATCH, _batch(1))
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    assert int(r.headers["Retry-After"]) >= 1
    assert api.call("memory_list")[0] == 429


def test_a_batch_that_would_pass_the_limit_is_refused_whole(api, settings, counter_store, limiter_minute):
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 10
    r = api.post(
        BATCH, {"calls": [{"name": "memory_write", "arguments": {"key": f"k:{i}", "value": i}} for i in range(11)]}
    )
    assert r.status_code == 429
    assert api.call("memory_list", prefix="k:")[0] == 429


def test_counts_are_per_window_and_per_bucket(db, counter_store):
    minute = 28_333_333 * 60
    assert [limits.hit("t:a", cost=2, now=minute + 1).count for _ in range(3)] == [2, 4, 6]
    assert limits.hit("t:b", now=minute + 2).count == 1
    hit = limits.hit("t:a", now=minute + 60.5)
    assert (hit.count, hit.retry_after) == (1, 59.5)


def test_tallied_windows_are_handed_out_once_when_closed(db, counter_store):
    minute = 28_333_333 * 60
    for _ in range(3):
        limits.hit("tally:x", tally="tally:", now=minute + 1)
    limits.hit("tally:y", tally="tally:", now=minute + 61)
    assert limits.drain_tallies("tally:", before=minute + 60) == [("tally:x", minute, 3)]
    assert limits.drain_tallies("tally:", before=minute + 60) == []


# --- the counter's own round trip (issue 11: a cheap hot path) ----------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_counters_commit_skips_the_flush_for_its_own_transaction_only(settings):
    """In autocommit the UPSERT turns synchronous_commit off for its own transaction (a
    counter is not a record); the setting does not outlive it, and inside an enclosing
    transaction (which may hold audit events) it is never touched."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    settings.ZEROMEM_REDIS_URL = ""
    minute = 28_333_333 * 60
    with CaptureQueriesContext(connection) as own:
        assert [limits.hit("t:sync", now=minute + 1).count for _ in range(2)] == [1, 2]
    assert "set_config('synchronous_commit', 'off', true)" in own.captured_queries[-1]["sql"]
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        assert limits.hit("t:sync", now=minute + 2).count == 3
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone()[0] == "on"
    assert "synchronous_commit" not in queries.captured_queries[0]["sql"]


def test_the_redis_counter_survives_a_lost_connection_and_flushed_scripts(db, settings):
    """The counter keeps one connection per thread: a connection the server closed, or
    scripts the server forgot, cost a retry through the client and no count."""
    settings.ZEROMEM_REDIS_URL = REDIS_TEST_URL
    client = redis_or_fail()
    minute = 28_333_333 * 60
    assert [limits.hit("t:r", now=minute + 1).count for _ in range(2)] == [1, 2]
    client.client_kill_filter(_type="normal", skipme=True)  # the server drops every other client
    assert limits.hit("t:r", now=minute + 1).count == 3
    client.script_flush()
    assert [limits.hit("t:r", now=minute + 1).count for _ in range(2)] == [4, 5]


def test_a_thread_per_request_leaves_no_redis_connection_behind(db, settings):
    """Under Django's ASGI handler every request runs in a new thread: the counter's
    connection of each thread goes with it."""
    import gc
    import threading

    settings.ZEROMEM_REDIS_URL = REDIS_TEST_URL
    client = redis_or_fail()
    minute = 28_333_333 * 60
    limits.hit("t:threads", now=minute + 1)  # this thread's own connection

    def baseline() -> int:
        gc.collect()
        return client.info("clients")["connected_clients"]

    before = baseline()
    for _ in range(20):
        thread = threading.Thread(target=lambda: limits.hit("t:threads", now=minute + 1))
        thread.start()
        thread.join()
    assert baseline() <= before
    assert limits.hit("t:threads", now=minute + 1).count == 22
