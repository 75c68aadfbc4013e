"""The search tier (memories/search/tier.py): searches ranked in processes of their own.

The tier here runs in a thread of the test process, on a Unix socket under tmp_path — the same
code a search process runs (``manage.py search_tier``); tests/test_serve.py starts the real
processes through ``python3 -m zeromem serve``. Committed rows (transaction=True): the tier
reads on its own database connection, as a separate process does."""

from __future__ import annotations

import json
import logging
import threading
import time
from multiprocessing.connection import Client

import pytest
from django.db import connection, transaction

from audit.models import AuditEvent
from memories.search import embeddings, ranking, semantic, tier
from tests.factories import make_keyed_client
from zeromem.kernel import cpu

pytestmark = pytest.mark.django_db(transaction=True)

MEMORIES = [
    ("task:t1:weekly_report", "周报发送时间改为每周五下午五点"),
    ("user:u10086:pref_lang", "zh-CN"),
    ("user:u10086:pref_format", "以后生成周报时都用表格格式"),
    ("fact:office:wifi", "The office wifi password is on the fridge"),
    ("user:u10086:diet", "vegetarian, no mushrooms"),
]
QUESTIONS = [
    "周报什么时候发送？",
    "which language does the user prefer?",
    "wifi router admin",
    "用户的语言偏好",
    "diet",
]


class Tier:
    """A search process's serving loop in a thread, on ``path``; counts the rankings it ran."""

    def __init__(self, path: str):
        self.path = path
        self.ranked = 0
        self.stop = threading.Event()
        ready = threading.Event()
        self.thread = threading.Thread(target=tier.serve, args=(path,), kwargs={"ready": ready, "stop": self.stop})
        self.thread.start()
        assert ready.wait(10)

    def close(self) -> None:
        self.stop.set()
        try:  # wake the accept() so that the loop sees the event
            Client(self.path, family="AF_UNIX", authkey=tier.authkey()).close()
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.thread.join(10)


@pytest.fixture
def search_tier(settings, tmp_path, monkeypatch):
    """A running tier, named in ZEROMEM_SEARCH_TIER; ``.ranked`` counts what it ranked."""
    path = str(tmp_path / "search.sock")
    running = Tier(path)
    real = tier.rank_request

    def counted(raw: bytes, gate=None) -> bytes:
        running.ranked += 1
        return real(raw, gate)

    monkeypatch.setattr(tier, "rank_request", counted)
    settings.ZEROMEM_SEARCH_TIER = [path]
    semantic.cache_clear()
    yield running
    tier.close_connections()
    running.close()
    semantic.cache_clear()


def _seed(api) -> None:
    for key, value in MEMORIES:
        status, body = api.call("memory_write", key=key, value=value)
        assert status == 200, body


def _keys(api, tool: str = "memory_search", **arguments) -> list[str]:
    status, body = api.call(tool, **arguments)
    assert status == 200, body
    return [r["key"] for r in body["results"]] if tool == "memory_search" else body["text"].splitlines()


def test_the_tier_ranks_exactly_what_the_web_process_would(api, search_tier, settings):
    settings.ZEROMEM_EMBEDDINGS = "on"  # the meaning too: the paraphrase below has no word in common
    settings.ZEROMEM_EMBEDDINGS_LOAD_WAIT = True
    settings.ZEROMEM_SEMANTIC_PROBE_SECONDS = 0
    _seed(api)
    embeddings.embeddings_refresh()
    through_tier = {q: _keys(api, query=q, limit=5) for q in QUESTIONS}
    recalled = _keys(api, "memory_recall", query="周报", max_chars=200)
    assert search_tier.ranked == len(QUESTIONS) + 1
    settings.ZEROMEM_SEARCH_TIER = []
    assert {q: _keys(api, query=q, limit=5) for q in QUESTIONS} == through_tier
    assert _keys(api, "memory_recall", query="周报", max_chars=200) == recalled
    assert search_tier.ranked == len(QUESTIONS) + 1  # the last ones ranked here
    assert through_tier["用户的语言偏好"][0] == "user:u10086:pref_lang"
    assert through_tier["周报什么时候发送？"][0] == "task:t1:weekly_report"
    # Audited by the web process's service layer, as any search.
    assert AuditEvent.objects.filter(action="memory.search", outcome="ok").count() == 2 * len(QUESTIONS)


def test_the_tier_sees_one_tenants_memories_only_and_the_keys_prefixes(api, tenant_a, tenant_b, search_tier):
    _seed(api)
    other, _ = make_keyed_client(tenant_b)
    assert _keys(other, query="周报什么时候发送？") == []
    assert _keys(other, query="wifi") == []
    narrow, _ = make_keyed_client(tenant_a, allow=["user:"])
    assert set(_keys(narrow, query="周报 wifi diet", limit=10)) == {"user:u10086:pref_format", "user:u10086:diet"}
    assert search_tier.ranked == 3


def _rankings(outcome: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("zeromem_search_tier_rankings_total", {"outcome": outcome}) or 0.0


def test_where_searches_were_ranked_is_counted_for_the_metrics(api, search_tier, settings, tmp_path):
    _seed(api)
    before = {outcome: _rankings(outcome) for outcome in ("tier", "fallback")}
    _keys(api, query="wifi")
    settings.ZEROMEM_SEARCH_TIER = [str(tmp_path / "nobody-listens.sock")]
    _keys(api, query="wifi")
    assert _rankings("tier") - before["tier"] == 1 and _rankings("fallback") - before["fallback"] == 1


def test_without_a_running_tier_the_web_process_ranks_and_warns(api, settings, tmp_path, caplog, monkeypatch):
    _seed(api)
    monkeypatch.setattr(tier, "_last_warning", 0.0)
    settings.ZEROMEM_SEARCH_TIER = [str(tmp_path / "nobody-listens.sock")]
    with caplog.at_level(logging.WARNING, logger="zeromem.search"):
        assert _keys(api, query="wifi")[:1] == ["fact:office:wifi"]
        assert _keys(api, query="diet")[:1] == ["user:u10086:diet"]
    warnings = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1 and "nobody-listens.sock" in warnings[0]  # once a minute, not per search


def test_a_search_inside_an_open_transaction_is_ranked_where_its_writes_are_visible(tenant_a, search_tier):
    with transaction.atomic():
        assert tier.ranked(tenant_id=tenant_a.pk, prefixes=None, query="wifi", limit=5) is None
    assert tier.ranked(tenant_id=tenant_a.pk, prefixes=None, query="wifi", limit=5) == []
    assert search_tier.ranked == 1


def test_a_caller_without_the_deployments_key_is_refused_before_anything_is_read(tenant_a, search_tier, settings):
    settings.SECRET_KEY = "another deployment's secret key, long enough to be a real one"
    assert tier.ranked(tenant_id=tenant_a.pk, prefixes=None, query="wifi", limit=5) is None  # ranks itself
    assert search_tier.ranked == 0


def test_a_peer_that_never_answers_the_challenge_holds_up_no_other_connection(tenant_a, search_tier):
    import socket

    stalled = socket.socket(socket.AF_UNIX)
    stalled.connect(search_tier.path)  # and never says a word
    try:
        assert tier.ranked(tenant_id=tenant_a.pk, prefixes=None, query="wifi", limit=5) == []
        assert search_tier.ranked == 1
    finally:
        stalled.close()


def test_a_tier_slower_than_the_wait_is_a_503_search_timeout_and_the_next_search_is_not_confused(
    api, search_tier, settings, monkeypatch
):
    _seed(api)
    settings.ZEROMEM_SEARCH_TIER_WAIT_MS = 300
    real = ranking.ranked_ids
    slow = {"wifi": 1.0}

    def sometimes_slow(**kw):
        time.sleep(slow.get(kw["query"], 0))
        return real(**kw)

    monkeypatch.setattr(ranking, "ranked_ids", sometimes_slow)
    status, body = api.call("memory_search", query="wifi")
    assert status == 503 and body["error"]["code"] == "search_timeout"
    event = AuditEvent.objects.filter(action="memory.search").latest("id")
    assert (event.outcome, event.detail["code"]) == (AuditEvent.Outcome.UNAVAILABLE, "search_timeout")
    # The late answer (for "wifi") must not be taken for the next question's — which waits for
    # the tenant's turn (one at a time: ZEROMEM_SEARCH_TIER_TENANT_CONCURRENCY) until it is sent.
    settings.ZEROMEM_SEARCH_TIER_WAIT_MS = 3000
    assert _keys(api, query="diet")[:1] == ["user:u10086:diet"]


def test_the_tiers_statement_timeout_is_a_503_search_timeout(api, search_tier, monkeypatch):
    _seed(api)

    def times_out(**kw):
        raise tier.SearchTimeout()

    monkeypatch.setattr(ranking, "ranked_ids", times_out)
    status, body = api.call("memory_search", query="wifi")
    assert status == 503 and body["error"]["code"] == "search_timeout"


def test_the_tiers_cpu_time_is_charged_to_the_search(tenant_a, search_tier, monkeypatch):
    def busy(**kw):
        until = time.thread_time() + 0.05
        while time.thread_time() < until:
            pass
        return [(1, 1.0)]

    monkeypatch.setattr(ranking, "ranked_ids", busy)
    with cpu.metered() as meter:
        assert tier.ranked(tenant_id=tenant_a.pk, prefixes=None, query="x", limit=5) == [(1, 1.0)]
    assert meter.seconds() >= 0.05  # this thread only waited: the tier's 50 ms were credited


def test_a_malformed_request_gets_an_error_and_the_tier_keeps_serving(tenant_a, search_tier):
    conn = Client(search_tier.path, family="AF_UNIX", authkey=tier.authkey())
    for bad in (b"not json", b'{"tenant": "x"}', json.dumps({"tenant": 1, "query": "q"}).encode()):
        conn.send_bytes(bad)
        assert "error" in json.loads(conn.recv_bytes())
    conn.close()
    assert tier.ranked(tenant_id=tenant_a.pk, prefixes=None, query="wifi", limit=5) == []


@pytest.mark.postgres
def test_the_tier_returns_its_database_connection_between_searches(api, search_tier):
    _seed(api)
    for _ in range(5):
        _keys(api, query="wifi")
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'active'")
        assert cursor.fetchone()[0] == 1  # this query's own: nothing left running


def test_the_gate_admits_at_most_its_total_and_half_of_it_to_one_tenant():
    gate = tier.Gate(4, per_tenant=2)
    assert gate.enter(1, 0) and gate.enter(1, 0)
    assert not gate.enter(1, 0.05)  # tenant 1 has its half
    assert gate.enter(2, 0) and gate.enter(2, 0)
    assert not gate.enter(3, 0.05)  # all four taken
    gate.leave(1)
    assert not gate.enter(2, 0.05) and gate.enter(3, 0)  # the freed turn is not tenant 2's to take
    released = threading.Timer(0.1, gate.leave, args=(2,))
    released.start()
    assert gate.enter(1, 2)  # waits for a turn, then gets it
    released.join()


def test_one_tenants_slow_searches_leave_the_tier_to_another_and_expired_waits_are_not_ranked(
    tenant_a, tenant_b, search_tier, settings, monkeypatch
):
    # Four rankings at once, one of them for one tenant.
    assert (settings.ZEROMEM_SEARCH_TIER_CONCURRENCY, settings.ZEROMEM_SEARCH_TIER_TENANT_CONCURRENCY) == (4, 1)
    real = ranking.ranked_ids
    release = threading.Event()
    ranked_for_a = []

    def slow_for_a(**kw):
        if kw["tenant_id"] == tenant_a.pk:
            ranked_for_a.append(kw["query"])
            release.wait(10)
        return real(**kw)

    monkeypatch.setattr(ranking, "ranked_ids", slow_for_a)
    settings.ZEROMEM_SEARCH_TIER_WAIT_MS = 1500
    outcomes: dict[int, object] = {}

    def search_as_a(n: int) -> None:
        try:
            outcomes[n] = tier.ranked(tenant_id=tenant_a.pk, prefixes=None, query="wifi", limit=5)
        except tier.SearchTimeout:
            outcomes[n] = "search_timeout"
        finally:
            tier.close_connections()
            connection.close()

    a_searches = [threading.Thread(target=search_as_a, args=(n,)) for n in range(3)]
    for t in a_searches:
        t.start()
    time.sleep(0.3)  # one of A's ranks (and hangs); the other two wait for A's turn
    started = time.monotonic()
    assert tier.ranked(tenant_id=tenant_b.pk, prefixes=None, query="wifi", limit=5) == []
    assert time.monotonic() - started < 1.0  # B was not queued behind A
    time.sleep(1.5)  # A's waiting searches are past their wait: answered search_timeout, never ranked
    ranked_before_release = search_tier.ranked
    release.set()
    for t in a_searches:
        t.join(10)
    assert sorted(map(str, outcomes.values())) == ["search_timeout", "search_timeout", "search_timeout"]
    assert search_tier.ranked == ranked_before_release == 4  # 3 of A's requests arrived, and B's
    assert len(ranked_for_a) == 1  # the other two were dropped unranked when their wait ran out


def test_a_search_process_gives_one_tenant_one_turn_unless_configured(settings):
    assert (tier.new_gate().total, tier.new_gate().per_tenant) == (4, 1)
    settings.ZEROMEM_SEARCH_TIER_TENANT_CONCURRENCY = 2
    assert tier.new_gate().per_tenant == 2
    settings.ZEROMEM_SEARCH_TIER_TENANT_CONCURRENCY = 9
    assert tier.new_gate().per_tenant == 4  # never more than the process's own turns


def test_the_database_unreachable_from_the_tier_is_a_503_database_unavailable_as_in_the_web_process(
    api, search_tier, settings, monkeypatch
):
    from django.db import OperationalError

    _seed(api)

    def unreachable(**kw):
        raise OperationalError("connection failed: server closed the connection unexpectedly")

    monkeypatch.setattr(ranking, "ranked_ids", unreachable)
    through_tier = api.call("memory_search", query="wifi")
    settings.ZEROMEM_SEARCH_TIER = []
    in_the_web_process = api.call("memory_search", query="wifi")
    assert through_tier == in_the_web_process
    status, body = through_tier
    assert status == 503 and body["error"]["code"] == "database_unavailable"
    assert search_tier.ranked == 1


def test_a_search_process_that_never_answers_a_new_connection_holds_a_search_no_longer_than_the_wait(
    api, settings, tmp_path, monkeypatch
):
    # A hung search process (stopped, deadlocked, swapped out) still has its socket: the kernel
    # accepts connections into its backlog, and a web thread opening one waited for ever for the
    # challenge — every search of every tenant ranked there took a thread and never gave it back.
    import socket

    _seed(api)
    path = str(tmp_path / "hung.sock")
    hung = socket.socket(socket.AF_UNIX)
    hung.bind(path)
    hung.listen(16)  # and never accepts
    settings.ZEROMEM_SEARCH_TIER = [path]
    settings.ZEROMEM_SEARCH_TIER_WAIT_MS = 300
    monkeypatch.setattr(tier, "_last_warning", 0.0)
    answers: list = []

    def search() -> None:
        try:
            answers.append(tier.ranked(tenant_id=api.tenant.pk, prefixes=None, query="wifi", limit=5))
        except Exception as exc:  # noqa: BLE001 - the test reports it
            answers.append(exc)
        finally:
            tier.close_connections()

    try:
        started = time.monotonic()
        searching = threading.Thread(target=search)
        searching.start()
        searching.join(5)
        assert not searching.is_alive() and answers == [None]  # not reachable in time: ranked here
        assert time.monotonic() - started < 2
        # And through the API: answered, ranked in the web process, within the wait.
        started = time.monotonic()
        assert _keys(api, query="wifi")[:1] == ["fact:office:wifi"]
        assert time.monotonic() - started < 2
    finally:
        hung.close()  # frees a thread still waiting (before the fix), so that the test ends
