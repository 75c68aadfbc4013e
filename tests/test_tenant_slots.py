"""Per-tenant limits on concurrent expensive work (search, recall, export, batch): past
ZEROMEM_TENANT_MAX_CONCURRENT a tenant's request waits briefly, then gets 429 tenant_busy
with Retry-After; other tenants are untouched. Slots are counted in the database or Redis
(audit/limits.py). The real-server case (20 slow export readers) is in test_serve.py."""

import threading

import pytest

from audit import limits

EXPORT = "/api/v1/audit-events/export"


@pytest.fixture
def store(counter_store, settings):
    settings.ZEROMEM_TENANT_MAX_CONCURRENT = 2
    settings.ZEROMEM_TENANT_BUSY_WAIT_SECONDS = 0.1
    return counter_store


def test_slots_are_limited_per_holder_and_come_back_when_released(db, store):
    first, second = (limits.slot_acquire("tenant:1", limit=2, lease=60) for _ in range(2))
    assert first and second
    assert limits.slot_acquire("tenant:1", limit=2, lease=60) is None
    assert limits.slot_acquire("tenant:2", limit=2, lease=60)
    limits.slot_release("tenant:1", first)
    assert limits.slot_acquire("tenant:1", limit=2, lease=60)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_parallel_takers_on_their_own_connections_get_exactly_the_limit(store):
    """Eight takers at once, each on a connection of its own, for three slots: exactly three
    get one (the database's unique slot numbers, or Redis's script), whoever loses a number
    to another tries the next one, and a released slot is taken again."""
    from django.db import connection

    barrier, tokens = threading.Barrier(8), []

    def take():
        try:
            barrier.wait(10)
            tokens.append(limits.slot_acquire("tenant:race", limit=3, lease=60))
        finally:
            connection.close()

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    won = [t for t in tokens if t]
    assert (len(tokens), len(won)) == (8, 3)
    limits.slot_release("tenant:race", won[0])
    assert limits.slot_acquire("tenant:race", limit=3, lease=60)
    assert limits.slot_acquire("tenant:race", limit=3, lease=60) is None


def test_one_statement_takes_a_slot_without_redis(db, settings):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    settings.ZEROMEM_REDIS_URL = ""
    with CaptureQueriesContext(connection) as queries:
        token = limits.slot_acquire("tenant:one", limit=4, lease=60)
    assert token and len(queries.captured_queries) == 1


def test_a_slot_past_its_lease_lapses(db, store):
    assert limits.slot_acquire("tenant:1", limit=1, lease=0)
    assert limits.slot_acquire("tenant:1", limit=1, lease=0)


def test_a_busy_tenant_gets_429_tenant_busy_and_another_tenant_is_served(api, api_b, tenant_a, store):
    held = [limits.slot_acquire(f"tenant:{tenant_a.pk}", limit=2, lease=60) for _ in range(2)]
    status, body = api.call("memory_search", query="anything")
    assert (status, body["error"]["code"]) == (429, "tenant_busy")
    r = api.get(EXPORT)
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert api.post("/api/v1/tools/batch", {"calls": [{"name": "memory_list", "arguments": {}}]}).status_code == 429
    assert api.call("memory_list")[0] == 200  # cheap work takes no slot
    assert api_b.call("memory_search", query="anything")[0] == 200
    limits.slot_release(f"tenant:{tenant_a.pk}", held[0])
    assert api.call("memory_search", query="anything")[0] == 200


def test_a_streamed_export_holds_its_slot_until_its_last_byte(api, tenant_a, store, settings):
    settings.ZEROMEM_TENANT_MAX_CONCURRENT = 1
    r = api.get(EXPORT)
    assert r.status_code == 200
    assert api.get(EXPORT).status_code == 429  # the first is still being streamed
    b"".join(r.streaming_content)  # the test client closes the response after the last chunk
    assert api.get(EXPORT).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_a_live_process_keeps_its_slot_past_the_lease_and_a_dead_ones_lapses(store, settings):
    """The heartbeat renews what this process holds (every lease / 3): a long export keeps its
    slot however long it runs. A slot no process renews any more (its process was killed:
    here, forgotten by this one) frees itself within the lease — not after ten minutes."""
    import time

    # 2 s: renewed every 0.67 s, so only a heartbeat stalled 1.3 s lets it lapse (with 1 s, a
    # 0.7 s stall on a loaded machine would).
    settings.ZEROMEM_TENANT_SLOT_LEASE_SECONDS = 2
    lease = settings.ZEROMEM_TENANT_SLOT_LEASE_SECONDS
    kept = limits.slot_acquire("tenant:beat", limit=1, lease=lease)
    assert kept
    time.sleep(2.5 * lease)  # 2.5 leases
    assert limits.slot_acquire("tenant:beat", limit=1, lease=lease) is None  # renewed: still held
    with limits._held_lock:
        limits._held.pop(kept)  # its process "dies": nobody renews it
    deadline = time.monotonic() + 3 * lease
    taken = None
    while taken is None and time.monotonic() < deadline:
        taken = limits.slot_acquire("tenant:beat", limit=1, lease=lease)
        time.sleep(0.1)
    assert taken and taken != kept
    limits.slot_release("tenant:beat", taken)


@pytest.mark.django_db(transaction=True)
def test_renewing_touches_only_this_processes_live_slots(store):
    mine = limits.slot_acquire("tenant:r", limit=3, lease=60)
    released = limits.slot_acquire("tenant:r", limit=3, lease=60)
    limits.slot_release("tenant:r", released)
    assert limits.slots_renew() >= 1
    assert mine in limits._held and released not in limits._held
    limits.slot_release("tenant:r", mine)
    assert mine not in limits._held


@pytest.mark.django_db(transaction=True)
def test_a_slot_never_released_is_renewed_only_up_to_the_longest_hold(store, settings):
    """A request that never gave its slot back (a bug, a server that never closed a streamed
    response) cannot keep it for the process's life: past ZEROMEM_TENANT_SLOT_MAX_HOLD_SECONDS
    the heartbeat stops renewing it, and it lapses a lease later."""
    import time

    settings.ZEROMEM_TENANT_SLOT_LEASE_SECONDS = 1
    settings.ZEROMEM_TENANT_SLOT_MAX_HOLD_SECONDS = 1
    leaked = limits.slot_acquire("tenant:leak", limit=1, lease=1)
    assert leaked
    deadline = time.monotonic() + 5
    taken = None
    while taken is None and time.monotonic() < deadline:
        taken = limits.slot_acquire("tenant:leak", limit=1, lease=1)
        time.sleep(0.1)
    assert taken and taken != leaked
    limits.slots_renew()
    assert leaked not in limits._held and taken in limits._held  # given up, not the new one
    limits.slot_release("tenant:leak", taken)


def test_claude_memory_commands_that_may_walk_a_directory_take_a_slot(api, tenant_a, store):
    # A directory delete or rename touches up to 5000 memories in one transaction (seconds):
    # without a slot, one tenant running many of them held every thread.
    memory_tool = "/api/v1/anthropic/memory"
    api.post(memory_tool, {"command": "create", "path": "/memories/d/a.md", "file_text": "x"})
    held = [limits.slot_acquire(f"tenant:{tenant_a.pk}", limit=2, lease=60) for _ in range(2)]
    for command in (
        {"command": "view", "path": "/memories"},
        {"command": "delete", "path": "/memories/d"},
        {"command": "rename", "old_path": "/memories/d", "new_path": "/memories/e"},
    ):
        r = api.post(memory_tool, command)
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_busy", command
    r = api.post(memory_tool, {"command": "create", "path": "/memories/d/b.md", "file_text": "y"})
    assert r.status_code == 200  # one file: no slot
    assert tenant_a.memories.filter(key="claude:memories:d:a.md", deleted_at__isnull=True).exists()
    limits.slot_release(f"tenant:{tenant_a.pk}", held[0])
    assert api.post(memory_tool, {"command": "delete", "path": "/memories/d"}).json()["is_error"] is False
