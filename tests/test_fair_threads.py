"""Request threads shared fairly between callers (zeromem/kit/fair_threads.py): what one
caller's requests may hold, whose turn comes next, and that nothing leaks when a waiting
client goes away. The live server's side is in tests/test_serve.py."""

import asyncio

import pytest

from zeromem.kit.fair_threads import FairThreads, caller_of, default_per_caller


async def _enter(threads: FairThreads, caller: str, entered: list, release: asyncio.Event) -> None:
    async with threads.thread(caller):
        entered.append(caller)
        await release.wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_caller_holds_at_most_its_share_and_another_caller_goes_at_once():
    async def scenario():
        threads = FairThreads(4, per_caller=2)
        entered: list[str] = []
        release = asyncio.Event()
        a = [asyncio.create_task(_enter(threads, "A", entered, release)) for _ in range(3)]
        await _settle()
        assert entered == ["A", "A"] and threads.holding["A"] == 2  # the third waits, holding nothing
        b = asyncio.create_task(_enter(threads, "B", entered, release))
        await _settle()
        assert entered == ["A", "A", "B"] and threads.free == 1
        release.set()
        await asyncio.gather(*a, b)
        assert entered.count("A") == 3 and threads.free == 4 and not threads.holding and not threads.waiting

    asyncio.run(scenario())


def test_a_freed_thread_goes_to_the_waiting_caller_that_holds_the_fewest():
    async def scenario():
        threads = FairThreads(2, per_caller=2)
        entered: list[str] = []
        gates = {name: asyncio.Event() for name in ("a1", "a2")}

        async def hold(caller, gate):
            async with threads.thread(caller):
                entered.append(caller)
                await gate.wait()

        first = [asyncio.create_task(hold("A", gates[n])) for n in ("a1", "a2")]
        await _settle()
        later_a = [asyncio.create_task(hold("A", asyncio.Event())) for _ in range(3)]  # queued first
        await _settle()
        b = asyncio.create_task(hold("B", asyncio.Event()))
        await _settle()
        assert entered == ["A", "A"]
        gates["a1"].set()  # one of A's two finishes: B (holding none) goes before A's queue
        await _settle()
        assert entered == ["A", "A", "B"]
        for task in [*first, *later_a, b]:
            task.cancel()
        await asyncio.gather(*first, *later_a, b, return_exceptions=True)
        assert threads.free == 2 and not threads.holding and not threads.waiting

    asyncio.run(scenario())


async def _one_holding_one_waiting():
    """One thread, held by A; B waiting for it: (threads, A's task, B's task, entered, release)."""
    threads = FairThreads(1)
    release = asyncio.Event()
    entered: list[str] = []
    holder = asyncio.create_task(_enter(threads, "A", entered, release))
    await _settle()
    waiter = asyncio.create_task(_enter(threads, "B", entered, release))
    await _settle()
    return threads, holder, waiter, entered, release


def test_a_waiting_request_whose_client_goes_away_takes_no_thread():
    async def scenario():
        threads, holder, gone, entered, release = await _one_holding_one_waiting()
        gone.cancel()  # the client disconnected while waiting
        await asyncio.gather(gone, return_exceptions=True)
        assert not threads.waiting
        release.set()
        await holder
        assert threads.free == 1 and entered == ["A"]

    asyncio.run(scenario())


def test_a_turn_granted_to_a_request_cancelled_before_it_ran_is_given_back():
    async def scenario():
        threads, holder, waiter, _entered, release = await _one_holding_one_waiting()
        release.set()
        await holder  # hands the thread to B's waiting turn ...
        waiter.cancel()  # ... which is cancelled before it resumes
        await asyncio.gather(waiter, return_exceptions=True)
        assert threads.free == 1 and not threads.holding
        after: list[str] = []
        await _enter(threads, "C", after, release)  # the thread is usable again
        assert after == ["C"]

    asyncio.run(scenario())


def test_two_threads_of_each_process_are_left_to_others_from_four_threads_up():
    assert [default_per_caller(n) for n in (1, 2, 3, 4, 8, 16)] == [1, 2, 3, 2, 6, 14]
    assert FairThreads(8).per_caller == 6 and FairThreads(8, per_caller=20).per_caller == 8


def _scope(client="10.0.0.7", **headers):
    return {
        "client": (client, 5555),
        "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
    }


def test_a_caller_is_the_clients_address_and_the_keys_public_lookup(settings):
    # With the API key cache off the lookup is taken as claimed (verified callers: below).
    settings.ZEROMEM_API_KEY_CACHE_SECONDS = 0
    settings.ZEROMEM_NUM_PROXIES = 0
    assert caller_of(_scope(authorization="Bearer zm_ab12cd_secretpart")) == "10.0.0.7 ab12cd"
    assert caller_of(_scope(authorization="bearer zm_ab12cd_other")) == "10.0.0.7 ab12cd"  # same caller
    assert caller_of(_scope(client="10.0.0.8", authorization="Bearer zm_ab12cd_x")) == "10.0.0.8 ab12cd"
    assert caller_of(_scope()) == "10.0.0.7 " and caller_of(_scope(authorization="Basic dXNlcg==")) == "10.0.0.7 "
    # A forwarded address counts only behind the configured proxies.
    forwarded = _scope(authorization="Bearer zm_ab12cd_x", x_forwarded_for="203.0.113.9, 10.0.0.7")
    assert caller_of(forwarded) == "10.0.0.7 ab12cd"
    settings.ZEROMEM_NUM_PROXIES = 1
    assert caller_of(forwarded) == "10.0.0.7 ab12cd"
    settings.ZEROMEM_NUM_PROXIES = 2
    assert caller_of(forwarded) == "203.0.113.9 ab12cd"


@pytest.mark.parametrize("value", ["0", "many"])
def test_a_bad_share_is_refused_naming_the_setting(value):
    from zeromem import serving

    with pytest.raises(ValueError, match="ZEROMEM_WEB_THREADS_PER_CALLER"):
        serving.threads_per_caller({"ZEROMEM_WEB_THREADS_PER_CALLER": value})
    assert serving.threads_per_caller({}) is None


@pytest.mark.django_db
def test_only_a_key_this_process_verified_is_a_caller_of_its_own(tenant_a, settings, monkeypatch):
    """Made-up lookups from one address are one caller, not one each: a client sending a new
    ``zm_<lookup>_x`` with every request had a thread share (and a read-ahead share) per request."""
    from memories.services import key_cache
    from tests.factories import make_keyed_client, write

    settings.ZEROMEM_NUM_PROXIES = 0
    settings.ZEROMEM_API_KEY_CACHE_SECONDS = 10
    now = [1000.0]
    monkeypatch.setattr(key_cache, "clock", lambda: now[0])
    made_up = {caller_of(_scope(authorization=f"Bearer zm_{i:012x}_secret")) for i in range(50)}
    assert made_up == {"10.0.0.7 ?"}  # one unverified caller, apart from the keyless one
    assert caller_of(_scope()) == "10.0.0.7 "

    write(tenant_a, "user:u1:pref_lang", "zh")
    client, key = make_keyed_client(tenant_a)
    real = f"Bearer {client.raw_key}"
    assert caller_of(_scope(authorization=real)) == "10.0.0.7 ?"  # not verified by this process yet
    r = client.post("/api/v1/tools/call", {"name": "memory_read", "arguments": {"key": "user:u1:pref_lang"}})
    assert r.status_code == 200
    assert caller_of(_scope(authorization=real)) == f"10.0.0.7 {key.lookup}"
    assert caller_of(_scope(client="10.0.0.8", authorization=real)) == f"10.0.0.8 {key.lookup}"
    # Its public lookup with another secret is not it.
    assert caller_of(_scope(authorization=f"Bearer zm_{key.lookup}_guessed")) == "10.0.0.7 ?"
    now[0] += 10  # the cache's TTL passed: verified again by its next request
    assert caller_of(_scope(authorization=real)) == "10.0.0.7 ?"
