"""client/zeromem_client/langgraph.py, the LangGraph ``BaseStore`` on ZeroMem, against a live
ZeroMem (``live_server``): the same operations give the same results as LangGraph's own
``InMemoryStore``, and a real compiled ``StateGraph`` reads and writes through it.

Compared: values, keys, namespaces, search-with-filter results and their order, pagination,
namespace listings. Not compared: timestamps (each store stamps its own clock) and scores.
Items are put in (namespace, key) order, so InMemoryStore's insertion order and ZeroMem's key
order coincide; the known differences are asserted as such at the end."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TypedDict

import pytest
from django.test import override_settings
from langgraph.graph import END, START, StateGraph
from langgraph.store.base import BaseStore, GetOp, InvalidNamespaceError, PutOp
from langgraph.store.memory import InMemoryStore

from memories.models import Memory
from tests.factories import make_key, make_tenant, write

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "client"))
from zeromem_client.langgraph import ZeroMemStore, ZeroMemStoreError  # noqa: E402

ITEMS = [
    (("docs",), "d1", {"title": "a", "n": 1}),
    (("users", "u1"), "diet", {"food": "pasta", "n": 7}),
    (("users", "u1"), "prefs", {"lang": "fr", "n": 3, "tags": ["x", "y"], "meta": {"tier": "gold"}}),
    (("users", "u2"), "prefs", {"lang": "de", "n": 5, "meta": {"tier": "free"}}),
    (("users", "u2", "sub"), "k:1/x", {"n": 9, "lang": "fr"}),
]
SEARCHES = [
    (("users",), dict()),
    ((), dict()),
    (("users",), dict(filter={"lang": "fr"})),
    (("users",), dict(filter={"n": {"$gt": 4}})),
    (("users",), dict(filter={"n": {"$gte": 3, "$lt": 9}})),
    (("users",), dict(filter={"n": {"$ne": 3}})),
    (("users",), dict(filter={"meta": {"tier": "gold"}})),
    (("users",), dict(filter={"tags": ["x", "y"]})),
    (("users",), dict(filter={"lang": "es"})),
    (("users", "u2"), dict()),
    ((), dict(limit=2, offset=1)),
    ((), dict(filter={"n": {"$lte": 7}}, limit=2, offset=1)),
]
LISTINGS = [
    dict(),
    dict(prefix=("users",)),
    dict(suffix=("sub",)),
    dict(max_depth=1),
    dict(max_depth=2),
    dict(prefix=("*", "u2")),
    dict(limit=2, offset=1),
]


def _item(item):
    return None if item is None else (item.namespace, item.key, item.value)


def _run(store: BaseStore) -> list:
    """The scenario; what each step returned, without timestamps and scores."""
    out = []
    for namespace, key, value in ITEMS:
        store.put(namespace, key, value)
    out.append([_item(store.get(ns, k)) for ns, k, _ in ITEMS])
    out.append(_item(store.get(("users", "u1"), "missing")))
    out.extend([_item(i) for i in store.search(prefix, **kw)] for prefix, kw in SEARCHES)
    out.extend(store.list_namespaces(**listing) for listing in LISTINGS)
    store.put(("users", "u1"), "prefs", {"lang": "it", "n": 4})
    out.append(_item(store.get(("users", "u1"), "prefs")))
    out.append([_item(i) for i in store.search(("users",), filter={"lang": "it"})])
    store.delete(("users", "u1"), "diet")
    store.delete(("users", "u1"), "diet")  # a second delete is no error
    out.append(_item(store.get(("users", "u1"), "diet")))
    out.append([_item(i) for i in store.search(("users", "u1"))])
    # One batch: its reads see the state before its puts; the last put of a key wins.
    out.append(
        [
            _item(r) if not isinstance(r, list) else r
            for r in store.batch(
                [
                    PutOp(("users", "u3"), "new", {"v": 1}),
                    GetOp(("users", "u3"), "new"),
                    PutOp(("users", "u3"), "new", {"v": 2}),
                ]
            )
        ]
    )
    out.append(_item(store.get(("users", "u3"), "new")))
    # Last: InMemoryStore's get of an unknown namespace adds it to its namespace listing.
    out.append(_item(store.get(("nobody",), "prefs")))
    return out


def test_zeromem_store(transactional_db, live_server):
    """One live server and one database flush for the three checks (each flush costs seconds)."""
    tenant = make_tenant("lgstore")
    _, raw = make_key(tenant)
    store = ZeroMemStore(live_server.url, api_key=raw)
    try:
        same_results_as_langgraphs_in_memory_store(store, tenant)
        a_compiled_state_graph_reads_and_writes_the_store(store, tenant)
        async_batch_and_ttl_and_refusals(store, tenant)
        a_batch_with_a_get_or_put_the_server_refuses_sends_nothing(store, tenant)
        limits_past_a_pages_size_are_read_in_pages(store, tenant)
    finally:
        store.close()


def same_results_as_langgraphs_in_memory_store(store, tenant):
    expected = _run(InMemoryStore())
    assert _run(store) == expected
    assert Memory.objects.live().get(tenant=tenant, key="lg:users:u2:sub:k~3A1~2Fx").value == {"n": 9, "lang": "fr"}

    # The known differences. A namespace whose items are all deleted is no namespace in
    # ZeroMem (it lists memories); InMemoryStore keeps listing it.
    for s in (store, mem := InMemoryStore()):
        s.put(("gone",), "k", {"v": 1})
        s.delete(("gone",), "k")
    assert ("gone",) in mem.list_namespaces() and ("gone",) not in store.list_namespaces()
    # With a query, ZeroMem ranks by its search and keeps only matches, with a score.
    ranked = store.search(("users",), query="pasta")
    assert [] == ranked or all(i.score is not None for i in ranked)
    store.put(("users", "u1"), "diet", {"food": "vegetarian pasta"})
    ranked = store.search(("users",), query="vegetarian pasta")
    assert [(i.namespace, i.key) for i in ranked] == [(("users", "u1"), "diet")] and ranked[0].score > 0


def async_batch_and_ttl_and_refusals(store, tenant):

    async def scenario():
        await store.aput(("s", "1"), "k", {"v": 1}, ttl=1.5)
        got = await store.aget(("s", "1"), "k")
        found = await store.asearch(("s",), filter={"v": 1})
        namespaces = await store.alist_namespaces(prefix=("s",))
        await store.adelete(("s", "1"), "k")
        gone = await store.aget(("s", "1"), "k")
        await store.aclose()
        return got, found, namespaces, gone

    got, found, namespaces, gone = asyncio.run(scenario())
    assert (got.namespace, got.key, got.value) == (("s", "1"), "k", {"v": 1})
    assert [i.key for i in found] == ["k"] and namespaces == [("s", "1")] and gone is None
    memory = Memory.objects.get(tenant=tenant, key="lg:s:1:k")
    assert memory.tags == ["ttl_minutes=2"]  # 1.5 minutes, rounded up to whole minutes

    _, reader = make_key(tenant, scopes=["memory:read"])
    with pytest.raises(ZeroMemStoreError) as refused:
        ZeroMemStore(store._client_args["base_url"].removesuffix("/api/v1/langgraph"), api_key=reader).put(
            ("s",), "k", {"v": 1}
        )
    assert (refused.value.status, refused.value.code) == (403, "missing_scope")
    # A namespace whose labels fill the key's 512 characters is LangGraph's InvalidNamespaceError
    # (it was a ZeroMemStoreError naming the key).
    with pytest.raises(InvalidNamespaceError):
        store.put(("n" * 300, "m" * 300), "k", {"v": 1})


def a_batch_with_a_get_or_put_the_server_refuses_sends_nothing(store, tenant):
    store.put(("x", "y"), "k", {"v": "xy"})
    # A get's namespace travels as its labels joined by ".": ("x.y",) read the item of ("x", "y").
    assert InMemoryStore().batch([GetOp(("x.y",), "k")]) == [None]
    with pytest.raises(InvalidNamespaceError):
        store.batch([GetOp(("x.y",), "k")])
    # A put the server refuses came after the batch's earlier puts were written: half done.
    before = set(Memory.objects.values_list("pk", "version"))
    for bad, refused in (
        (PutOp(("x", "bad.label"), "k", {"v": 2}), InvalidNamespaceError),
        (PutOp(("x", ""), "k", {"v": 2}), InvalidNamespaceError),
        (PutOp(("x",), "", {"v": 2}), ZeroMemStoreError),
        (PutOp(("x",), "k", ["not", "an", "object"]), ZeroMemStoreError),
    ):
        with pytest.raises(refused) as raised:
            store.batch([PutOp(("x",), "first", {"v": 1}), GetOp(("x", "y"), "k"), bad])
        if refused is ZeroMemStoreError:
            assert (raised.value.status, raised.value.field) == (400, "value" if bad.key else "key")
    assert set(Memory.objects.values_list("pk", "version")) == before


def limits_past_a_pages_size_are_read_in_pages(store, tenant):
    # LangGraph takes any limit and max_depth; the routes take a page (search 200, namespaces
    # 1,000, depth 512): a search with limit=300 was a ZeroMemStoreError (400 naming limit).
    for i in range(250):
        write(tenant, f"lg:many:{i:03d}", {"i": i, "text": "a bean"})
    mem = InMemoryStore()
    for i in range(250):
        mem.put(("many",), f"{i:03d}", {"i": i, "text": "a bean"})
    for limit, offset in ((300, 0), (250, 0), (201, 40), (1000, 199)):
        got = store.search(("many",), limit=limit, offset=offset, refresh_ttl=False)
        assert [i.key for i in got] == [i.key for i in mem.search(("many",), limit=limit, offset=offset)]
    assert len(store.search(("many",), filter={"text": "a bean"}, limit=10_000, refresh_ttl=False)) == 250
    ranked = store.search(("many",), query="bean", limit=500, refresh_ttl=False)  # ranks at most 200
    assert 0 < len(ranked) <= 200 and store.search(("many",), query="bean", offset=200, limit=50) == []
    everything = store.list_namespaces(limit=5000, max_depth=1000)
    assert everything == store.list_namespaces() and ("many",) in everything
    # A page the server cut at its byte budget (ZEROMEM_PAGE_VALUES_MAX_BYTES) is not the end:
    # the client reads on after it (it took a short page for the last one: 50 asked, 4 given).
    with override_settings(ZEROMEM_PAGE_VALUES_MAX_BYTES=100):
        for limit, offset in ((50, 0), (10, 237), (300, 0)):
            got = store.search(("many",), limit=limit, offset=offset, refresh_ttl=False)
            assert [i.key for i in got] == [i.key for i in mem.search(("many",), limit=limit, offset=offset)]


class State(TypedDict):
    user: str
    message: str
    reply: str


def a_compiled_state_graph_reads_and_writes_the_store(store, tenant):

    def remember(state: State, *, store: BaseStore) -> dict:
        namespace = ("users", state["user"])
        seen = store.get(namespace, "profile")
        count = (seen.value["count"] if seen else 0) + 1
        store.put(namespace, "profile", {"count": count, "last": state["message"]})
        return {"reply": f"message {count} from {state['user']}"}

    builder = StateGraph(State)
    builder.add_node("remember", remember)
    builder.add_edge(START, "remember")
    builder.add_edge("remember", END)
    graph = builder.compile(store=store)

    assert graph.invoke({"user": "u7", "message": "hi"})["reply"] == "message 1 from u7"
    assert graph.invoke({"user": "u7", "message": "again"})["reply"] == "message 2 from u7"
    assert Memory.objects.get(tenant=tenant, key="lg:users:u7:profile").value == {"count": 2, "last": "again"}
