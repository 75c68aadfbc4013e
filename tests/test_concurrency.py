"""Two agents racing on one key, on real PostgreSQL connections (one per thread).

Row locks and READ COMMITTED re-checks are PostgreSQL behaviour; SQLite serializes writers,
so these run only against PostgreSQL.
"""

import threading

import pytest
from django.db import connection
from django.test import Client

from memories.models import Memory, MemoryVersion
from tests.factories import KeyedClient

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROUNDS = 5


def run_together(calls):
    """Run each zero-argument callable in its own thread, released together by a barrier;
    return their results in order (re-raising any thread's exception)."""
    barrier = threading.Barrier(len(calls))
    results = [None] * len(calls)

    def worker(i, call):
        try:
            barrier.wait(timeout=10)
            results[i] = call()
        except BaseException as exc:  # surfaced in the main thread below
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a racing call hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.fixture
def agents(api):
    """Two independent clients (two agents) holding the same tenant key."""
    return [KeyedClient(api.raw_key, api.tenant, Client()) for _ in range(2)]


def test_concurrent_updates_with_same_expected_version_exactly_one_wins(api, agents):
    for n in range(ROUNDS):
        key = f"task:t{n}:status"
        api.call("memory_write", key=key, value="start")
        results = run_together(
            [
                lambda c=c, v=v, key=key: c.call("memory_update", key=key, value=v, expected_version=1)
                for c, v in zip(agents, ["from-agent-0", "from-agent-1"], strict=True)
            ]
        )
        assert [status for status, _ in results] == [200, 200]
        bodies = [body for _, body in results]
        assert sorted(b["status"] for b in bodies) == ["conflict", "ok"]
        winner = next(i for i, b in enumerate(bodies) if b["status"] == "ok")
        loser = bodies[1 - winner]
        assert bodies[winner]["version"] == 2
        assert loser == {"status": "conflict", "key": key, "current_version": 2}
        memory = Memory.objects.get(tenant=api.tenant, key=key)
        assert memory.version == 2
        assert memory.value == f"from-agent-{winner}"
        assert list(
            MemoryVersion.objects.filter(memory=memory).order_by("version").values_list("version", "value")
        ) == [
            (1, "start"),
            (2, f"from-agent-{winner}"),
        ]


def test_concurrent_writes_of_a_new_key_both_succeed_with_one_live_row(api, agents):
    for n in range(ROUNDS):
        key = f"user:u{n}:pref_lang"
        results = run_together(
            [
                lambda c=c, v=v, key=key: c.call("memory_write", key=key, value=v)
                for c, v in zip(agents, ["zh", "en"], strict=True)
            ]
        )
        assert [status for status, _ in results] == [200, 200]
        bodies = [body for _, body in results]
        assert all(b["status"] == "ok" for b in bodies)
        assert sorted(b["created"] for b in bodies) == [False, True]
        assert sorted(b["version"] for b in bodies) == [1, 2]
        last = next(i for i, b in enumerate(bodies) if b["version"] == 2)
        rows = Memory.objects.filter(tenant=api.tenant, key=key)
        assert rows.count() == 1  # no duplicate, nothing trashed
        memory = rows.get()
        assert memory.deleted_at is None and memory.version == 2
        assert memory.value == ["zh", "en"][last]
        assert MemoryVersion.objects.filter(memory=memory).count() == 2


def test_concurrent_rest_puts_with_the_same_etag_exactly_one_wins(api, agents):
    api.call("memory_write", key="task:t1:plan", value="draft")
    etag = api.get("/api/v1/memories/task:t1:plan").headers["ETag"]
    results = run_together(
        [
            lambda c=c, v=v: c.put("/api/v1/memories/task:t1:plan", {"value": v}, headers={"If-Match": etag})
            for c, v in zip(agents, ["plan-a", "plan-b"], strict=True)
        ]
    )
    assert sorted(r.status_code for r in results) == [200, 412]
    memory = Memory.objects.get(tenant=api.tenant, key="task:t1:plan")
    assert memory.version == 2
    assert memory.value == next(r.json()["value"] for r in results if r.status_code == 200)


def test_concurrent_delete_and_update_leave_a_consistent_history(api, agents):
    for n in range(ROUNDS):
        key = f"task:t{n}:x"
        api.call("memory_write", key=key, value="v1")
        (_, deleted), (_, updated) = run_together(
            [
                lambda key=key: agents[0].call("memory_delete", key=key),
                lambda key=key: agents[1].call("memory_update", key=key, value="v2", expected_version=1),
            ]
        )
        assert deleted["status"] == "ok"
        assert updated["status"] in ("ok", "not_found")
        memory = Memory.objects.get(tenant=api.tenant, key=key)
        assert memory.deleted_at is not None
        ops = list(MemoryVersion.objects.filter(memory=memory).order_by("version").values_list("version", "op"))
        if updated["status"] == "ok":
            assert ops == [(1, "write"), (2, "update"), (3, "delete")]
        else:
            assert ops == [(1, "write"), (2, "delete")]
