"""Two agents racing on one key, on real PostgreSQL connections (one per thread).

Row locks and READ COMMITTED re-checks are PostgreSQL behaviour; SQLite serializes writers,
so these run only against PostgreSQL.
"""

import threading

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from audit.models import AuditEvent
from memories import services
from memories.models import Memory, MemoryVersion
from tests.factories import SYSTEM, KeyedClient, make_tenant, write
from tests.helpers import start_thread, wait_for_a_lock_waiter
from zeromem.kernel.errors import Conflict, NotFound

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


def test_concurrent_create_only_puts_of_a_new_key_exactly_one_creates(api, agents):
    """If-None-Match: * — the loser of the insert race is 412, its value never stored."""
    for n in range(ROUNDS):
        url = f"/api/v1/memories/user:u{n}:first"
        results = run_together(
            [
                lambda c=c, v=v, url=url: c.put(url, {"value": v}, headers={"If-None-Match": "*"})
                for c, v in zip(agents, ["a", "b"], strict=True)
            ]
        )
        assert sorted(r.status_code for r in results) == [201, 412]
        memory = Memory.objects.get(tenant=api.tenant, key=f"user:u{n}:first")
        assert (memory.version, memory.value) == (1, next(r.json()["value"] for r in results if r.status_code == 201))
        assert MemoryVersion.objects.filter(memory=memory).count() == 1


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


# --- restoring from the trash while something else moves the memory ----------------------


def _restore_racing(monkeypatch, meanwhile):
    """``memory_restore`` of this thread with ``meanwhile()`` started on another connection
    right after the restore has checked that no live memory holds the key; the restore goes
    on once ``meanwhile`` has finished or waits on a lock the restore holds."""
    from memories.services import memories as memory_services

    check = memory_services.selectors.memory_lock_current
    failures, done, me = [], threading.Event(), threading.get_ident()
    racer = []

    def check_then_race(**kwargs):
        found = check(**kwargs)
        if threading.get_ident() == me and not racer:
            racer.append(start_thread(meanwhile, failures, done=done))
            wait_for_a_lock_waiter("the racer", alive=lambda: not done.is_set())
        return found

    monkeypatch.setattr(memory_services.selectors, "memory_lock_current", check_then_race)

    def join():
        racer[0].join(20)
        assert not racer[0].is_alive(), "the racer hung"
        return failures

    return join


def _trashed(tenant, key):
    memory = write(tenant, key, "v1")
    services.memory_delete(tenant=tenant, actor=SYSTEM, key=key)
    return memory


def _outcome(call):
    try:
        return call().status
    except (NotFound, Conflict) as exc:
        return type(exc).__name__


def test_a_restore_racing_a_write_of_its_key_is_a_conflict_not_an_integrity_error(monkeypatch):
    tenant = make_tenant("restore-vs-write")
    memory = _trashed(tenant, "task:t1:plan")
    join = _restore_racing(monkeypatch, lambda: write(tenant, "task:t1:plan", "new"))
    with pytest.raises(Conflict):
        services.memory_restore(tenant=tenant, actor=SYSTEM, memory_id=memory.pk)
    assert join() == []
    memory.refresh_from_db()
    assert memory.deleted_at is not None and memory.version == 2  # still in the trash, untouched
    assert Memory.objects.get(tenant=tenant, key="task:t1:plan", deleted_at__isnull=True).value == "new"
    assert AuditEvent.objects.get(tenant=tenant, action="memory.restore").outcome == "conflict"


def test_two_restores_of_one_memory_at_once_restore_it_once(monkeypatch):
    tenant = make_tenant("restore-twice")
    memory = _trashed(tenant, "task:t1:plan")
    other = []
    restore = lambda: services.memory_restore(tenant=tenant, actor=SYSTEM, memory_id=memory.pk)  # noqa: E731
    join = _restore_racing(monkeypatch, lambda: other.append(_outcome(restore)))
    mine = _outcome(restore)
    assert join() == []
    assert sorted([mine, *other]) == ["NotFound", "ok"]
    memory.refresh_from_db()
    assert memory.deleted_at is None and memory.version == 3
    assert MemoryVersion.objects.filter(memory=memory, op="restore").count() == 1
    outcomes = AuditEvent.objects.filter(tenant=tenant, action="memory.restore").values_list("outcome", flat=True)
    assert sorted(outcomes) == ["not_found", "ok"]


def test_a_restore_racing_the_purge_of_its_memory_restores_it_or_is_not_found(monkeypatch):
    """A memory that expired in the trash (restorable, with its TTL again) raced by the purge,
    which erases it. (One past its trash retention is not restorable at all, purged or not:
    tests/test_ttl.py.)"""
    from memories.services import retention

    tenant = make_tenant("restore-purged")
    memory = _trashed(tenant, "task:t1:plan")
    Memory.objects.filter(pk=memory.pk).update(expires_at=timezone.now())  # after its deletion
    join = _restore_racing(monkeypatch, lambda: retention.purge_expired(memories_per_second=0))
    mine = _outcome(lambda: services.memory_restore(tenant=tenant, actor=SYSTEM, memory_id=memory.pk))
    assert join() == []
    if mine == "ok":  # the purge skipped the memory the restore held
        assert Memory.objects.get(pk=memory.pk).deleted_at is None
    else:
        assert mine == "NotFound" and not Memory.objects.filter(pk=memory.pk).exists()
        assert AuditEvent.objects.get(tenant=tenant, action="memory.restore").outcome == "not_found"


# --- an update racing a write that marks the memory sensitive ----------------------------


def test_an_update_racing_a_sensitive_write_never_stores_the_value_in_plaintext(monkeypatch):
    """``memory_update`` decides whether to seal its value from the row's ``sensitive`` and
    ``subject``; a write that marks the memory sensitive (or moves its subject) between that
    read and the UPDATE must not be undone by it: a memory once sensitive stays so."""
    import json

    from memories.services import memories as memory_services

    tenant = make_tenant("update-vs-sensitive")
    memory = write(tenant, "task:t1:card", "plain")
    decide, me, failures, racer = memory_services.sensitivity.decide, threading.get_ident(), [], []

    def decide_then_race(*args, **kwargs):
        secret = decide(*args, **kwargs)
        if threading.get_ident() == me and not racer:
            done = threading.Event()
            racer.append(
                start_thread(
                    lambda: write(tenant, "task:t1:card", "4111-1111 from the write", sensitive=True),
                    failures,
                    done=done,
                )
            )
            wait_for_a_lock_waiter("the sensitive write", alive=lambda: not done.is_set())
        return secret

    monkeypatch.setattr(memory_services.sensitivity, "decide", decide_then_race)
    services.memory_update(tenant=tenant, actor=SYSTEM, key="task:t1:card", value="4111-1111 from the update")
    racer[0].join(20)
    assert not failures, failures
    memory.refresh_from_db()
    assert memory.sensitive and memory.version == 3
    with connection.cursor() as cursor:
        cursor.execute("SELECT value, search_text FROM memories_memory WHERE id = %s", [memory.pk])
        stored, search_text = cursor.fetchone()
    stored = stored if isinstance(stored, str) else json.dumps(stored)
    assert "4111" not in stored and '"zmenc"' in stored.replace(" ", "")
    assert "4111" not in (search_text or "")
    assert MemoryVersion.objects.get(memory=memory, version=3).sensitive
