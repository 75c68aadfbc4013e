"""What a LangGraph store call costs: the values it reads (a ranked search loaded its 200
ranked values, a key scan 200 a chunk, before the page budget cut the page to a few), the
writes a TTL refresh makes (it was a whole write: a version and a ``memory.update`` event per
item, on every read), and what a search's audit event counts."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from audit.models import AuditEvent
from memories.models import Memory, MemoryVersion
from memories.services import langgraph as lg
from tests.factories import SYSTEM, make_keyed_client, write
from zeromem.kernel import hotsql

SEARCH = "/api/v1/langgraph/store/items/search"
ITEMS = "/api/v1/langgraph/store/items"


@pytest.fixture
def loaded():
    """The keys of the test's values (``_fill``) that left the database, built into a row or
    not (an iterator fetches its rows a chunk at a time): counted as psycopg loads them."""
    from django.db import connection
    from psycopg.types.string import TextLoader

    keys: list[str] = []

    class Counting(TextLoader):
        def load(self, data):
            text = super().load(data)
            if '"pasta ' in text:
                keys.append(f"lg:docs:k{json.loads(text)['i']:02d}")
            return text

    if connection.vendor != "postgresql":
        pytest.skip("counts what psycopg loads: needs PostgreSQL (run with DATABASE_URL set, as CI does)")
    connection.ensure_connection()
    connection.connection.adapters.register_loader("jsonb", Counting)
    hotsql.drop_kept_cursors()  # each copied the adapters it was made with
    yield keys
    connection.connection.adapters.register_loader("jsonb", TextLoader)
    hotsql.drop_kept_cursors()


def _fill(tenant, n=30, size=3000, **kwargs):
    for i in range(n):
        value = {"text": "pasta " + "x" * size, "kind": "even" if i % 2 == 0 else "odd", "i": i}
        write(tenant, f"lg:docs:k{i:02d}", value, **kwargs)


def _keys(r):
    assert r.status_code == 200, r.content
    return [f"lg:docs:{i['key']}" for i in r.json()["items"]]


@pytest.mark.django_db
@pytest.mark.parametrize("flt", [None, {"kind": "even"}], ids=["all", "filter"])
def test_a_ranked_search_reads_only_the_values_it_returns(tenant_a, settings, loaded, flt):
    # 30 values of 3 KB ranked, a budget of 10 KB: the page holds 3; all 30 were read.
    _fill(tenant_a)
    client, _ = make_keyed_client(tenant_a)
    settings.ZEROMEM_PAGE_VALUES_MAX_BYTES = 10_000
    body = {"namespace_prefix": ["docs"], "query": "pasta", "limit": 200, **({"filter": flt} if flt else {})}
    loaded.clear()
    r = client.post(SEARCH, body)
    returned = _keys(r)
    assert len(returned) == 3 and r.json()["cut"] is True
    # With a filter, the one item past the budget is judged too (it says whether more follow).
    assert set(loaded) >= set(returned) and len(loaded) == len(returned) + (1 if flt else 0)


@pytest.mark.django_db
@pytest.mark.parametrize("offset", [0, 10])
@pytest.mark.parametrize("flt", [None, {"text": {"$ne": "no"}}], ids=["all", "filter"])
def test_a_key_scan_reads_only_the_values_it_returns(tenant_a, settings, loaded, offset, flt):
    # A scan read its rows 200 a chunk, values included: 30 values for a page of 5.
    _fill(tenant_a)
    client, _ = make_keyed_client(tenant_a)
    body = {"namespace_prefix": ["docs"], "limit": 5, "offset": offset, **({"filter": flt} if flt else {})}
    loaded.clear()
    returned = _keys(client.post(SEARCH, body))
    assert returned == [f"lg:docs:k{i:02d}" for i in range(offset, offset + 5)]
    # A filter is judged on the values: those skipped by the offset are read too, no more.
    assert sorted(loaded) == sorted(returned if flt is None else [f"lg:docs:k{i:02d}" for i in range(offset + 5)])


@pytest.mark.django_db
def test_a_key_scan_stops_reading_at_the_byte_budget(tenant_a, settings, loaded):
    _fill(tenant_a)
    client, _ = make_keyed_client(tenant_a)
    settings.ZEROMEM_PAGE_VALUES_MAX_BYTES = 10_000
    loaded.clear()
    r = client.post(SEARCH, {"namespace_prefix": ["docs"], "limit": 200})
    assert _keys(r) == ["lg:docs:k00", "lg:docs:k01", "lg:docs:k02"] and r.json()["cut"] is True
    assert sorted(loaded) == _keys(r)


def _ttl_items(tenant, n=3):
    for i in range(n):
        write(tenant, f"lg:n:k{i}", {"drink": "coffee"}, ttl_seconds=60, tags=["ttl_minutes=10"])


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["get", "scan", "ranked"])
def test_a_ttl_refresh_moves_only_the_expiry_and_is_told_by_the_reads_own_event(tenant_a, how):
    # A refresh was memory_update: a new version (the value copied again), a memory.update
    # event per item, on every read (ZeroMemStore refreshes by default).
    _ttl_items(tenant_a)
    client, _ = make_keyed_client(tenant_a)
    before = {m.key: m for m in Memory.objects.filter(tenant=tenant_a)}
    versions = MemoryVersion.objects.filter(tenant=tenant_a).count()
    last_event = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first()
    if how == "get":
        r = client.get(ITEMS, {"namespace": "n", "key": "k1", "refresh_ttl": "true"})
        assert r.status_code == 200, r.content
        refreshed, action = ["lg:n:k1"], "memory.read"
    else:
        body = {"namespace_prefix": ["n"], "refresh_ttl": True, **({"query": "coffee"} if how == "ranked" else {})}
        r = client.post(SEARCH, body)
        assert r.status_code == 200 and len(r.json()["items"]) == 3, r.content
        refreshed, action = sorted(before), "memory.search" if how == "ranked" else "memory.list"
    now = timezone.now()
    for memory in Memory.objects.filter(tenant=tenant_a):
        old = before[memory.key]
        assert (memory.version, memory.value, memory.updated_at) == (old.version, old.value, old.updated_at)
        if memory.key in refreshed:
            assert timedelta(minutes=10) - timedelta(seconds=30) < memory.expires_at - now <= timedelta(minutes=10)
        else:
            assert memory.expires_at == old.expires_at
    assert MemoryVersion.objects.filter(tenant=tenant_a).count() == versions
    (event,) = AuditEvent.objects.filter(tenant=tenant_a, id__gt=last_event)
    assert (event.action, event.outcome) == (action, "ok")
    assert event.detail.get("ttl_refreshed") == len(refreshed)


@pytest.mark.django_db
@pytest.mark.parametrize("query", [None, "coffee"], ids=["scan", "ranked"])
@pytest.mark.parametrize("gone", ["expired", "deleted", "rewritten"])
def test_a_refresh_never_brings_back_an_item_gone_since_the_search_read_it(tenant_a, monkeypatch, query, gone):
    from memories import services

    _ttl_items(tenant_a)
    client, _ = make_keyed_client(tenant_a)
    charge = lg._charge_refreshes

    def meanwhile(actor, items):
        if gone == "expired":
            Memory.objects.filter(key="lg:n:k1").update(expires_at=timezone.now() - timedelta(seconds=1))
        elif gone == "deleted":
            services.memory_delete(tenant=tenant_a, actor=SYSTEM, key="lg:n:k1")
        else:  # a put with another TTL: its expiry is the put's, not the refresh's
            write(tenant_a, "lg:n:k1", {"drink": "tea"}, ttl_seconds=120, tags=["ttl_minutes=2"])
        return charge(actor, items)

    monkeypatch.setattr(lg, "_charge_refreshes", meanwhile)
    before = Memory.objects.get(key="lg:n:k1", deleted_at__isnull=True)
    r = client.post(SEARCH, {"namespace_prefix": ["n"], "refresh_ttl": True, **({"query": query} if query else {})})
    assert r.status_code == 200, r.content
    keys = sorted(i["key"] for i in r.json()["items"])
    assert keys == (["k0", "k1", "k2"] if gone == "rewritten" else ["k0", "k2"])
    k1 = Memory.objects.filter(key="lg:n:k1").order_by("-id").first()
    if gone == "expired":
        assert k1.expires_at < timezone.now()
    elif gone == "deleted":
        assert k1.deleted_at is not None and k1.expires_at == before.expires_at
    else:
        assert k1.expires_at - timezone.now() <= timedelta(minutes=2)
    event = AuditEvent.objects.filter(tenant=tenant_a, action="memory.search" if query else "memory.list").last()
    assert event.count == len(keys)
    assert event.detail["ttl_refreshed"] == 2


@pytest.mark.django_db
def test_a_refresh_by_a_read_only_key_is_refused_and_changes_nothing(tenant_a):
    _ttl_items(tenant_a, 1)
    client, _ = make_keyed_client(tenant_a, scopes=["memory:read"])
    expires = Memory.objects.get(key="lg:n:k0").expires_at
    r = client.get(ITEMS, {"namespace": "n", "key": "k0", "refresh_ttl": "true"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "missing_scope", r.content
    assert Memory.objects.get(key="lg:n:k0").expires_at == expires
    assert client.get(ITEMS, {"namespace": "n", "key": "k0"}).status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize("budget", [None, 10_000])
def test_a_ranked_searchs_event_counts_the_items_returned(tenant_a, settings, budget):
    # It counted the 30 memories ranked, whatever the page returned.
    _fill(tenant_a)
    client, _ = make_keyed_client(tenant_a)
    if budget:
        settings.ZEROMEM_PAGE_VALUES_MAX_BYTES = budget
    r = client.post(SEARCH, {"namespace_prefix": ["docs"], "query": "pasta", "limit": 4, "offset": 2})
    returned = _keys(r)
    assert len(returned) == (3 if budget else 4)
    event = AuditEvent.objects.filter(tenant=tenant_a, action="memory.search").last()
    assert (event.outcome, event.count) == ("ok", len(returned))


@pytest.mark.django_db
def test_page_sizes_are_the_values_json_text(tenant_a, settings):
    # The budget counts each value's JSON text as the database spells it (", " and ": "), as
    # every page of values does (README "Pages of values").
    write(tenant_a, "lg:docs:a", {"t": "x" * 90})  # {"t": "xxx…"}: 99 bytes
    write(tenant_a, "lg:docs:b", {"t": "y"})  # 10 bytes
    client, _ = make_keyed_client(tenant_a)
    assert len(json.dumps({"t": "x" * 90})) == 99
    for budget, keys in ((109, ["a", "b"]), (108, ["a"])):
        settings.ZEROMEM_PAGE_VALUES_MAX_BYTES = budget
        r = client.post(SEARCH, {"namespace_prefix": ["docs"]})
        assert [i["key"] for i in r.json()["items"]] == keys
