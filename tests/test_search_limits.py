"""Search that stays bounded and cannot be turned against other tenants (issue 12):
tenant-prefixed terms, caps on query length and terms, refused inputs, the timeout, the
ranking's signals, and recall with only a prefix."""

import json
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from audit.models import AuditEvent
from memories.models import Memory
from memories.search import lexical, ranking, text
from tests.factories import write
from zeromem.kernel import validation


def _write(api, key, value, importance):
    # The memory_write tool takes no importance (it is an admin/REST field): the service does.
    write(api.tenant, key, value, importance=importance)


def _nested(depth: int):
    value = "leaf"
    for _ in range(depth):
        value = {"a": value}
    return value


# --- tenant isolation ---------------------------------------------------------------------


def test_indexed_terms_carry_the_tenant_so_another_tenants_query_matches_nothing(api, api_b):
    api.call("memory_write", key="fact:secret", value="zebra orchid launch code", tags=["classified"])
    memory = Memory.objects.get(key="fact:secret")
    terms = memory.search_text.replace(" | ", " ").split()
    assert terms and all(t.startswith(f"{api.tenant.pk}:") for t in terms)
    if connection.vendor == "postgresql":
        lexemes = Memory.objects.filter(pk=memory.pk).values_list("search_tsv", flat=True).get()
        assert f"'{api.tenant.pk}:zebra':" in lexemes and f"'{api_b.tenant.pk}:" not in lexemes
    # Even asked with the other tenant's id and no prefix filter, the lexical layer finds nothing.
    found = lexical.lexical_candidates(tenant_id=api_b.tenant.pk, prefixes=None, query="zebra orchid", limit=10)
    assert found == []
    _, body = api_b.call("memory_search", query="zebra orchid classified")
    assert body["results"] == []
    _, body = api.call("memory_search", query="zebra orchid classified")
    assert [r["key"] for r in body["results"]] == ["fact:secret"]


def test_allowlist_prefixes_still_restrict_search_results(api, make_client, tenant_a):
    api.call("memory_write", key="user:u1:note", value="zebra one")
    api.call("memory_write", key="user:u2:note", value="zebra two")
    u1, _key = make_client(tenant_a, allow=["user:u1:"])
    _, body = u1.call("memory_search", query="zebra", limit=10)
    assert [r["key"] for r in body["results"]] == ["user:u1:note"]


# --- refused input --------------------------------------------------------------------------


def test_nul_in_a_query_is_400_naming_query(api):
    status, body = api.call("memory_search", query="zebra\x00code")
    assert status == 400 and body["error"]["field"] == "query"
    assert body["error"]["code"] == "invalid_characters"


def test_value_nested_deeper_than_the_documented_depth_is_400_naming_value(api):
    status, body = api.call("memory_write", key="fact:deep", value=_nested(validation.VALUE_MAX_DEPTH))
    assert status == 200, body
    status, body = api.call("memory_write", key="fact:deeper", value=_nested(validation.VALUE_MAX_DEPTH + 1))
    assert status == 400 and body["error"] == {
        "code": "too_deep",
        "message": f"must not nest arrays or objects more than {validation.VALUE_MAX_DEPTH} deep",
        "field": "value",
    }
    assert not Memory.objects.filter(key="fact:deeper").exists()


def test_a_value_thousands_of_levels_deep_is_a_4xx_not_a_500(api):
    # Deep enough that the JSON parser itself, or any recursion over it, would blow the stack.
    deep = "[" * 100_000 + "]" * 100_000
    r = api.post(
        "/api/v1/tools/call", raw='{"name": "memory_write", "arguments": {"key": "fact:x", "value": ' + deep + "}}"
    )
    assert 400 <= r.status_code < 500


def test_query_longer_than_the_cap_is_400(api):
    status, body = api.call("memory_search", query="word " * 101)
    assert status == 400 and body["error"]["code"] == "too_long"


# --- caps: what a search may cost -------------------------------------------------------------


@pytest.mark.parametrize(
    "query", ["😀🎉🚀🔥", "what is the of and to in it that this", "a b c d"], ids=["emoji", "stop words", "letters"]
)
def test_queries_with_no_usable_term_answer_empty_without_touching_memories(api, query, django_assert_max_num_queries):
    api.call("memory_write", key="fact:ab", value="ab cd ef gh")
    # The key lookup, the tenant, the audit INSERT and the transaction: no scan of memories.
    with django_assert_max_num_queries(12) as ctx:
        status, body = api.call("memory_search", query=query)
    assert status == 200 and body["results"] == []
    assert not any("memories_memory " in q["sql"] and "search" in q["sql"] for q in ctx.captured_queries)


def test_a_query_looks_at_no_more_than_the_capped_number_of_words_and_terms():
    words = [f"word{i:03d}x" for i in range(100)]
    terms = text.query_terms(" ".join(words), max_words=lexical.MAX_QUERY_WORDS)
    assert len({t.term for t in terms if t.boost == 1}) == lexical.MAX_QUERY_WORDS
    plan = lexical.plan(terms, {t.term: i + 1 for i, t in enumerate(terms)}, documents=10_000)
    assert len(plan.scoring_terms) == lexical.MAX_TERMS
    assert sum(t.df for t in plan.candidate_terms[1:]) <= lexical.CANDIDATES


def test_candidates_come_from_the_rarest_terms_within_the_budget():
    terms = [text.QueryTerm("common"), text.QueryTerm("rare"), text.QueryTerm("middling")]
    plan = lexical.plan(terms, {"common": 90_000, "rare": 3, "middling": 400}, documents=100_000)
    assert [t.term for t in plan.candidate_terms] == ["rare", "middling"]
    assert [t.term for t in plan.scoring_terms] == ["rare", "middling", "common"]
    assert plan.scoring_terms[0].idf > plan.scoring_terms[1].idf > plan.scoring_terms[2].idf


def test_a_word_in_more_memories_than_the_sample_picks_a_sample_and_a_rarer_word_turns_it_off(tenant_a, monkeypatch):
    # GIN_SAMPLE bounds what one common word costs (PostgreSQL's gin_fuzzy_search_limit, for
    # the search's statements only); a rarer word in the same question reads everything.
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's GIN sampling")
    for i in range(60):
        write(tenant_a, f"note:bird{i}", f"a pelican was seen near pier {i}")
    rare = write(tenant_a, "note:zanzibar", "a pelican from zanzibar")
    monkeypatch.setattr(lexical, "GIN_SAMPLE", 10)

    common = lexical.lexical_candidates(tenant_id=tenant_a.pk, prefixes=None, query="pelican", limit=500)
    assert 0 < len(common) < 61  # a sample of the 61, ranked

    both = lexical.lexical_candidates(tenant_id=tenant_a.pk, prefixes=None, query="pelican zanzibar", limit=500)
    assert len(both) == 61 and both[0][0] == rare.pk
    with connection.cursor() as cursor:
        cursor.execute("SHOW gin_fuzzy_search_limit")
        assert cursor.fetchone()[0] == "0"  # the session's own setting, untouched


def test_the_gin_sample_is_larger_than_the_candidates_so_an_ored_rarer_word_is_never_sampled():
    # plan() adds terms after the first only while their postings total at most CANDIDATES.
    assert lexical.GIN_SAMPLE > lexical.CANDIDATES


def test_160_two_letter_words_answer(api):
    status, body = api.call("memory_search", query=" ".join(["ab", "cd", "ef", "gh", "ij"] * 32)[:499])
    assert status == 200 and body["results"] == []


def test_short_latin_words_pick_candidates_only_when_rare():
    terms = [text.QueryTerm("zh", weak=True)]
    assert lexical.plan(terms, {"zh": 5_000}, documents=10_000) is None
    assert [t.term for t in lexical.plan(terms, {"zh": 3}, documents=10_000).candidate_terms] == ["zh"]


def test_a_search_past_its_time_limit_is_503_search_timeout_audited(api, settings, monkeypatch):
    # Inside the test's transaction: the search's savepoint, its settings made once.
    _search_past_its_time_limit(api, settings, monkeypatch)


@pytest.mark.django_db(transaction=True)
def test_a_search_of_its_own_past_its_time_limit_is_503_search_timeout_audited(api, settings, monkeypatch):
    # As a request runs it: no transaction, the settings sent with each statement.
    _search_past_its_time_limit(api, settings, monkeypatch)


def _search_past_its_time_limit(api, settings, monkeypatch):
    api.call("memory_write", key="fact:slow", value="zebra orchid")
    settings.ZEROMEM_SEARCH_TIMEOUT_MS = 50
    real = lexical._frequencies

    def slow(tenant_id, terms, dl):  # noqa: ANN001
        # One more statement of the search's, as slow as a search can be.
        found = real(tenant_id, terms, dl)
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                dl.execute(cursor, "SELECT pg_sleep(2)", [])
            else:
                cursor.execute("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c")
        return found

    monkeypatch.setattr(lexical, "_frequencies", slow)
    started = time.monotonic()
    r = api.post("/api/v1/tools/call", {"name": "memory_search", "arguments": {"query": "zebra"}})
    assert r.status_code == 503 and time.monotonic() - started < 1.5
    assert r.json()["error"]["code"] == "search_timeout" and r.json()["error"]["field"] == "query"
    assert r.headers["Retry-After"] == "1"
    event = AuditEvent.objects.filter(action="memory.search").latest("id")
    assert event.outcome == AuditEvent.Outcome.UNAVAILABLE
    assert event.detail["code"] == "search_timeout"
    # The connection is usable afterwards: the next search answers.
    monkeypatch.setattr(lexical, "_frequencies", real)
    status, body = api.call("memory_search", query="zebra")
    assert status == 200 and [r["key"] for r in body["results"]] == ["fact:slow"]


SETTINGS_SQL = (
    "SELECT current_setting('statement_timeout'), current_setting('enable_seqscan'),"
    " current_setting('enable_indexscan'), current_setting('max_parallel_workers_per_gather'),"
    " current_setting('jit'), current_setting('gin_fuzzy_search_limit')"
)


@pytest.mark.django_db(transaction=True)
def test_the_search_settings_end_with_the_search_whether_its_transaction_is_its_own_or_a_callers(monkeypatch):
    # The timeout and the planner switches are set for the search only: in a transaction of
    # its own they end with its COMMIT, inside a caller's they are restored before it goes on.
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's planner settings")
    from tests.factories import make_tenant

    tenant = make_tenant("settings-end")
    write(tenant, "fact:z", "zebra crossing")

    def session_settings():
        with connection.cursor() as cursor:
            cursor.execute(SETTINGS_SQL)
            return cursor.fetchone()

    with connection.cursor() as cursor:
        cursor.execute("SET jit = on")  # the server's default; the search must leave it so
    try:
        _search_settings_end(tenant, session_settings, monkeypatch)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET jit")  # a session SET outlives the test in a pooled connection


def _search_settings_end(tenant, session_settings, monkeypatch):
    from django.db import transaction

    before = session_settings()
    assert before[1:3] == ("on", "on") and before[4] == "on"
    during = []
    real = lexical._pg_candidates

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003
        # What a statement of the search's sees (sent as the search sends its own: args[-1]
        # is its Deadline); and what one sent plainly sees meanwhile.
        with connection.cursor() as cursor:
            args[-1].execute(cursor, SETTINGS_SQL, [])
            during.append(cursor.fetchone())
        plainly.append(session_settings())
        return real(*args, **kwargs)

    plainly = []

    monkeypatch.setattr(lexical, "_pg_candidates", spy)
    assert lexical.lexical_candidates(tenant_id=tenant.pk, prefixes=None, query="zebra", limit=5)
    assert session_settings() == before
    with transaction.atomic():
        assert lexical.lexical_candidates(tenant_id=tenant.pk, prefixes=None, query="zebra", limit=5)
        assert session_settings() == before
    # While the search runs: its timeout, bitmap scans only, no parallel workers, no JIT, a
    # common word's postings sampled.
    sample = str(lexical.GIN_SAMPLE)
    assert len(during) == 2 and all(d[1:] == ("off", "off", "0", "off", sample) and d[0] != before[0] for d in during)
    # Of its own (the first search), nothing else in the session ever has them: they ride on
    # each of its statements. Inside a caller's transaction (the second) they are made once.
    assert plainly[0] == before and plainly[1] == during[1]


# --- ranking --------------------------------------------------------------------------------


def test_a_word_in_the_key_or_tags_outranks_the_same_word_in_the_text(api):
    api.call("memory_write", key="note:misc", value="the invoice arrived and was filed")
    api.call("memory_write", key="finance:invoice", value="sent every month")
    api.call("memory_write", key="note:other", value="sent every month", tags=["invoice"])
    _, body = api.call("memory_search", query="invoice", limit=3)
    keys = [r["key"] for r in body["results"]]
    assert keys[0] == "finance:invoice" and keys[1] == "note:other" and keys[2] == "note:misc"


def test_rare_words_count_more_than_common_ones(api):
    for i in range(30):
        api.call("memory_write", key=f"note:n{i}", value=f"project status update number {i}")
    api.call("memory_write", key="note:pelican", value="pelican migration report")
    api.call("memory_write", key="note:status", value="project status")
    _, body = api.call("memory_search", query="pelican project status")
    assert body["results"][0]["key"] == "note:pelican"


def test_importance_and_recency_break_ties_but_never_beat_a_better_match(api):
    _write(api, "note:a", "quarterly billing review", 0)
    _write(api, "note:b", "billing", 10)
    _write(api, "note:c", "billing", 2)
    _, body = api.call("memory_search", query="quarterly billing review", limit=3)
    assert [r["key"] for r in body["results"]][0] == "note:a"
    _, body = api.call("memory_search", query="billing", limit=3)
    ranked = [r["key"] for r in body["results"]]
    assert ranked.index("note:b") < ranked.index("note:c")


# --- recall -----------------------------------------------------------------------------------


def test_recall_with_only_a_prefix_returns_the_most_important_and_recent_memories(api):
    old = timezone.now() - timedelta(days=90)
    _write(api, "user:u1:name", "Ada", 9)
    _write(api, "user:u1:mood", "tired", 3)
    _write(api, "user:u1:old_note", "liked jazz in 2019", 3)
    Memory.objects.filter(key="user:u1:old_note").update(updated_at=old)
    _write(api, "user:u2:name", "Bob", 10)
    status, body = api.call("memory_recall", prefix="user:u1:", max_chars=500)
    assert status == 200, body
    assert body["text"].splitlines() == [
        "user:u1:name: Ada",
        "user:u1:mood: tired",
        "user:u1:old_note: liked jazz in 2019",
    ]


def test_recall_drops_near_duplicates_keeping_the_most_recent(api):
    api.call("memory_write", key="user:u1:lang_old", value="the user prefers answers in Chinese")
    Memory.objects.filter(key="user:u1:lang_old").update(updated_at=timezone.now() - timedelta(days=3))
    api.call("memory_write", key="user:u1:lang", value="The user prefers answers in Chinese.")
    api.call("memory_write", key="user:u1:tz", value="Asia/Shanghai")
    _, body = api.call("memory_recall", query="which language does the user prefer answers in", prefix="user:u1:")
    assert "user:u1:lang: " in body["text"] and "lang_old" not in body["text"]
    _, body = api.call("memory_recall", prefix="user:u1:")
    assert "lang_old" not in body["text"] and body["count"] == 2


def test_recall_judges_near_duplicates_on_what_it_can_show_not_on_whole_values(api, monkeypatch):
    # Recall compared its 30 candidates' whole values: 30 values of 16 KB (the default cap)
    # took 154 ms of CPU to tokenize and intersect for a block of 500 characters (a search: 5).
    _write(api, "log:copy", "zebra entry0 " + " ".join(f"w0x{j}" for j in range(1500)) + " older", 4)
    Memory.objects.filter(key="log:copy").update(updated_at=timezone.now() - timedelta(days=1))
    for i in range(3):
        _write(api, f"log:{i}", f"zebra entry{i} " + " ".join(f"w{i}x{j}" for j in range(1500)), 5)
    tokenized = []
    real = text.tokenize
    monkeypatch.setattr(text, "tokenize", lambda s: tokenized.append(len(s)) or real(s))
    for args in ({"query": "zebra"}, {"prefix": "log:"}):
        tokenized.clear()
        status, body = api.call("memory_recall", max_chars=600, **args)
        assert status == 200, body
        assert tokenized and max(tokenized) <= 600, tokenized
        assert len(body["text"]) == 600 and not body["text"].startswith("log:copy")
    # Judged on those characters, distinct values are kept and the copy of log:0 (older) dropped.
    memories = list(Memory.objects.filter(key__startswith="log:").order_by("key"))
    kept = ranking.drop_near_duplicates(memories, chars=600)
    assert [m.key for m in kept] == ["log:0", "log:1", "log:2"]


def test_recall_cuts_a_line_that_does_not_fit_or_skips_it_for_a_shorter_one(api):
    _write(api, "note:mid", "budget " + "y" * 60, 10)
    _write(api, "note:long", "budget " + "x" * 300, 9)
    _write(api, "note:short", "budget ok", 1)
    mid = "note:mid: budget " + "y" * 60
    # 30 characters left after the first line: too few to cut the long one, enough for the short one.
    _, body = api.call("memory_recall", prefix="note:", max_chars=len(mid) + 1 + 30)
    assert body["text"].splitlines() == [mid, "note:short: budget ok"]
    # 100 characters left: the long line is cut to fill them.
    _, body = api.call("memory_recall", prefix="note:", max_chars=len(mid) + 1 + 100)
    lines = body["text"].splitlines()
    assert len(body["text"]) == len(mid) + 1 + 100
    assert lines[1].startswith("note:long: budget xx") and lines[1].endswith("…") and len(lines) == 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_recall_of_long_values_loads_what_its_block_can_show_not_the_whole_values(api):
    # Recall packs at most max_chars (≤ 8,000) characters, but loaded its 30 candidates (and 10
    # spares) whole: at a tenant cap of 256 KB, 40 values of 243 KB were 19 MB of Python
    # memory at the peak for a block of 500 characters. A long string value now leaves the
    # database as its first max_chars + 1 characters, as a cut search's do; the block is the same.
    import tracemalloc

    from memories import services
    from tests.factories import SYSTEM
    from tests.helpers import copy_memory

    api.tenant.value_max_bytes = 256 * 1024
    api.tenant.save()
    big = "needle " + "lorem ipsum dolor sit amet " * 9_000
    copy_memory(write(api.tenant, "doc:template", big, importance=1), 40)
    _write(api, "doc:top", "needle first, " + "e\u0301" * 30 + " and a long tail " + "z" * 200, 10)
    _write(api, "doc:json", {"needle": "y" * 100}, 9)

    for arguments in ({"query": "needle"}, {"prefix": "doc:"}):
        tracemalloc.start()
        packed = services.memory_recall(tenant=api.tenant, actor=SYSTEM, max_chars=500, **arguments)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 4 * 1024 * 1024, f"{peak / 2**20:.1f} MB at the peak"
        lines = packed["text"].split("\n")
        assert len(packed["text"]) == 500 and len(lines) >= 2
        # Each line as it reads whole, cut to what is left (the last one with "…").
        whole = {m.key: f"{m.key}: {text.compact(m.value)}" for m in Memory.objects.filter(key__in=packed["keys"])}
        for key, line in zip(packed["keys"], lines, strict=True):
            assert line == whole[key] or (line.endswith("…") and whole[key].startswith(line[:-1])), key


def test_recall_schema_makes_query_optional():
    from memories.tools import TOOLS

    schema = (
        TOOLS["memory_recall"].parameters_schema() if hasattr(TOOLS["memory_recall"], "parameters_schema") else None
    )
    tool = TOOLS["memory_recall"]
    assert "query" not in [p.name for p in tool.params if p.required]
    assert schema is None or "query" not in schema.get("required", [])


def test_chinese_paraphrase_bigrams_and_key_words_find_their_memory(api):
    api.call("memory_write", key="task:t1:weekly_report", value="周报发送时间改为每周五下午五点")
    api.call("memory_write", key="fact:office:wifi", value="The office wifi password is on the fridge")
    _, body = api.call("memory_search", query="周报什么时候发送？")
    assert body["results"][0]["key"] == "task:t1:weekly_report"
    assert json.dumps(body, ensure_ascii=False).count("fact:office:wifi") == 0


# --- term statistics (PostgreSQL) -------------------------------------------------------------


@pytest.mark.postgres
def test_term_statistics_are_counted_and_a_memory_written_since_is_still_found(api):
    from django.core.management import call_command

    from memories.models import SearchCorpus, SearchTerm
    from memories.tasks import search_stats_refresh_task

    api.call("memory_write", key="note:a", value="pelican report")
    api.call("memory_write", key="note:b", value="pelican status")
    assert api.tenant.pk in search_stats_refresh_task()
    assert SearchTerm.objects.get(tenant=api.tenant, term="pelican").ndoc == 2
    assert SearchCorpus.objects.get(tenant=api.tenant).documents == 2
    assert search_stats_refresh_task() == {}  # nothing changed since
    api.call("memory_write", key="note:c", value="flamingo sighting")
    _, body = api.call("memory_search", query="flamingo")
    assert [r["key"] for r in body["results"]] == ["note:c"]
    call_command("search_reindex", tenant=api.tenant.slug, stdout=__import__("io").StringIO())
    assert SearchTerm.objects.get(tenant=api.tenant, term="flamingo").ndoc == 1


def test_a_single_chinese_character_finds_the_words_it_starts(api):
    api.call("memory_write", key="fact:wallet", value="钱包在桌子上")
    api.call("memory_write", key="fact:gun", value="水枪")
    _, body = api.call("memory_search", query="钱")
    assert [r["key"] for r in body["results"]] == ["fact:wallet"]
    _, body = api.call("memory_search", query="枪")  # a lone character
    assert body["results"] == [] or [r["key"] for r in body["results"]] == ["fact:gun"]


@pytest.mark.postgres
def test_a_lone_characters_frequency_reads_at_most_the_capped_rows_of_the_term_table(tenant_a):
    # A lone character's frequency is the sum over the tenant's terms it starts: a tenant that
    # wrote text with tens of thousands of distinct bigrams after each of 32 characters made
    # every search of those characters sum ~2M rows (300 ms of PostgreSQL, outside the timeout).
    from memories.models import SearchCorpus, SearchTerm

    SearchCorpus.objects.create(tenant=tenant_a, documents=10_000)
    rare, common = "钱", "枪"
    SearchTerm.objects.bulk_create(
        [SearchTerm(tenant=tenant_a, term=rare + chr(0x4E00 + i), ndoc=2) for i in range(10)]
        + [SearchTerm(tenant=tenant_a, term=common + chr(0x4E00 + i), ndoc=1) for i in range(lexical.COUNT_CAP + 200)]
    )
    terms = [t.term for t in text.query_terms(f"{rare} {common}", max_words=lexical.MAX_QUERY_WORDS)]
    with lexical.deadline() as dl:
        df, documents, _exact = lexical._frequencies(tenant_a.pk, terms, dl)
    assert documents == 10_000
    assert df[rare + text.PREFIX_MARK] == 20  # exact under the cap: it may pick candidates
    assert df[common + text.PREFIX_MARK] == lexical.COUNT_CAP  # read no further: common either way
    assert lexical.COUNT_CAP > lexical.CANDIDATES


def test_a_value_of_one_huge_word_is_stored_and_the_word_not_indexed(api):
    # PostgreSQL refuses a lexeme over 2 KiB; a 16 KiB run of one letter is no search term.
    status, body = api.call("memory_write", key="fact:blob", value="x" * (16 * 1024 - 2) + "")
    assert status == 200, body
    status, body = api.call("memory_write", key="fact:mixed", value="pelican " + "y" * 5000)
    assert status == 200, body
    _, body = api.call("memory_search", query="pelican")
    assert [r["key"] for r in body["results"]] == ["fact:mixed"]


def test_a_value_of_many_distinct_chinese_bigrams_is_stored(api, tenant_a):
    # ~87k distinct bigrams would pass PostgreSQL's 1 MB tsvector limit; the index keeps the first 20k.
    tenant_a.value_max_bytes = 256 * 1024
    tenant_a.save()
    text_ = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(80000))
    status, body = api.call("memory_write", key="fact:long_zh", value=text_)
    assert status == 200, body


@pytest.mark.postgres
def test_a_forgotten_memorys_words_leave_the_term_statistics(api):
    from memories.models import Memory as M
    from memories.models import SearchTerm
    from memories.services import forget_request_create, forget_request_execute
    from memories.tasks import search_stats_refresh_task
    from tests.factories import SYSTEM

    api.call("memory_write", key="user:u7:note", value="pelican zanzibar")
    api.call("memory_write", key="user:u8:note", value="pelican")
    search_stats_refresh_task()
    assert SearchTerm.objects.filter(tenant=api.tenant, term="zanzibar").exists()
    request = forget_request_create(tenant=api.tenant, actor=SYSTEM, subject="u7")
    forget_request_execute(request_id=request.pk)
    assert not M.objects.filter(key="user:u7:note").exists()
    assert api.tenant.pk in search_stats_refresh_task()
    assert not SearchTerm.objects.filter(tenant=api.tenant, term="zanzibar").exists()
    assert SearchTerm.objects.get(tenant=api.tenant, term="pelican").ndoc == 1


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_forget_completed_while_the_term_statistics_are_counted_is_counted_again(monkeypatch):
    """The count of a big tenant runs for minutes, from one snapshot. A forget that completes
    meanwhile is not in that count, so the tenant must stay due for another: stamped with the
    count's end, the tenant looked fresh and the erased words stayed in SearchTerm for good."""
    import threading

    from memories.models import SearchTerm
    from memories.search import index
    from memories.services import forget
    from tests.factories import SYSTEM, make_tenant

    monkeypatch.setattr(forget, "async_task", lambda *args, **kwargs: None)
    tenant = make_tenant("stats-race")
    write(tenant, "user:u7:note", "pelican zanzibar")
    write(tenant, "user:u8:note", "pelican")
    request = forget.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u7")

    def forget_after_the_terms_are_counted(execute, sql, params, many, context):
        if sql.startswith("SELECT count(*) FROM memories_memory"):  # the terms are counted; then:
            worker = threading.Thread(target=_forget_in_a_worker, args=(forget, request.pk))
            worker.start()
            worker.join(30)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(forget_after_the_terms_are_counted):
        index.stats_refresh(tenant_id=tenant.pk)
    assert not Memory.objects.filter(key="user:u7:note").exists()
    assert SearchTerm.objects.filter(tenant=tenant, term="zanzibar").exists()  # counted before the forget
    assert tenant.pk in index.stale_tenant_ids()
    index.stats_refresh_stale()
    assert not SearchTerm.objects.filter(tenant=tenant, term="zanzibar").exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_counts_of_one_tenant_at_once_take_turns():
    """The schedule and ``search_reindex --stats-only`` may count one tenant at once: the
    second inserted the new terms the first had inserted and not yet committed, and failed on
    the primary key once it had. Now they take turns (an advisory lock on the tenant)."""
    import threading

    from memories.models import SearchTerm
    from memories.search import index
    from tests.factories import make_tenant

    tenant = make_tenant("stats-twice")
    write(tenant, "note:a", "pelican zanzibar")
    counted, go, errors = threading.Event(), threading.Event(), []

    def hold_the_count_open(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if sql.lstrip().startswith("WITH counted"):
            counted.set()
            go.wait(30)
        return result

    def first():
        try:
            with connection.execute_wrapper(hold_the_count_open):
                index.stats_refresh(tenant_id=tenant.pk)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            counted.set()
            connection.close()

    def second():
        try:
            index.stats_refresh(tenant_id=tenant.pk)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            connection.close()

    one = threading.Thread(target=first)
    one.start()
    assert counted.wait(30)
    two = threading.Thread(target=second)
    two.start()
    time.sleep(0.5)  # the second reaches its lock (or, without one, its INSERT)
    go.set()
    one.join(30)
    two.join(30)
    assert errors == []
    assert SearchTerm.objects.get(tenant=tenant, term="zanzibar").ndoc == 1


def _forget_in_a_worker(forget, request_id):
    try:
        forget.forget_request_execute(request_id=request_id)
    finally:
        connection.close()


@pytest.mark.postgres
def test_an_expired_memorys_words_leave_the_term_statistics_once_purged(api):
    """The TTL purge erases for good; the erased words must leave SearchTerm with it. The
    staleness check saw only live rows changed since the count and completed forgets, so
    after a purge the tenant looked fresh and ('zanzibar', 1) stayed until another write."""
    from memories import services
    from memories.models import SearchTerm
    from memories.search import index

    api.call("memory_write", key="session:s1:a", value="pelican zanzibar", ttl_seconds=60)
    api.call("memory_write", key="note:b", value="pelican")
    index.stats_refresh_stale()
    assert SearchTerm.objects.get(tenant=api.tenant, term="zanzibar").ndoc == 1
    assert api.tenant.pk not in index.stale_tenant_ids()
    result = services.purge_expired(now=timezone.now() + timedelta(minutes=5))
    assert result["expired"] == 1 and not Memory.objects.filter(key="session:s1:a").exists()
    assert api.tenant.pk in index.stale_tenant_ids()
    index.stats_refresh_stale()
    assert not SearchTerm.objects.filter(tenant=api.tenant, term="zanzibar").exists()
    assert SearchTerm.objects.get(tenant=api.tenant, term="pelican").ndoc == 1
    assert api.tenant.pk not in index.stale_tenant_ids()  # counted once, not at every run


@pytest.mark.postgres
def test_a_trashed_memorys_words_leave_the_term_statistics(api):
    """The count is over live memories; a memory trashed since was still counted, and the
    staleness check looked at live rows only."""
    from memories.models import SearchTerm
    from memories.search import index

    api.call("memory_write", key="note:a", value="pelican zanzibar")
    api.call("memory_write", key="note:b", value="pelican")
    index.stats_refresh_stale()
    api.call("memory_delete", key="note:a")
    assert api.tenant.pk in index.stale_tenant_ids()
    index.stats_refresh_stale()
    assert not SearchTerm.objects.filter(tenant=api.tenant, term="zanzibar").exists()
    assert api.tenant.pk not in index.stale_tenant_ids()


@pytest.mark.postgres
def test_a_recount_rewrites_only_the_terms_whose_counts_changed(api):
    """A recount deleted every term row of the tenant and inserted them all again: at 100k
    memories 200k rows and 43 MB of WAL for a tenant that wrote one memory. Now a term whose
    count is unchanged keeps its row (same xmin); changed counts, new and vanished terms are
    written."""
    from memories.models import SearchTerm
    from memories.search import index

    def xmin(term):
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT xmin::text FROM memories_searchterm WHERE tenant_id = %s AND term = %s", [api.tenant.pk, term]
            )
            return cursor.fetchone()[0]

    api.call("memory_write", key="note:a", value="pelican report")
    api.call("memory_write", key="note:b", value="pelican status")
    index.stats_refresh(tenant_id=api.tenant.pk)
    kept = xmin("pelican")
    api.call("memory_write", key="note:b", value="pelican heron")  # status vanishes, heron is new
    api.call("memory_write", key="note:c", value="report")  # report: 1 -> 2
    index.stats_refresh(tenant_id=api.tenant.pk)
    words = ["pelican", "report", "heron", "status"]
    counts = dict(SearchTerm.objects.filter(tenant=api.tenant, term__in=words).values_list("term", "ndoc"))
    assert counts == {"pelican": 2, "report": 2, "heron": 1}
    assert xmin("pelican") == kept
    assert xmin("report") != kept


@pytest.mark.postgres
def test_a_big_tenant_with_few_new_writes_is_recounted_later_but_an_erasure_at_once(api):
    """Writes under 1% of a tenant's counted memories wait for the next schedule run after its
    count is an hour old (their new words already count as rare); a memory trashed, forgotten
    or purged is recounted at the next run whatever its size, so its words leave SearchTerm."""
    from memories.models import SearchCorpus, SearchTerm
    from memories.search import index

    api.call("memory_write", key="note:a", value="pelican zanzibar")
    api.call("memory_write", key="note:b", value="pelican")
    index.stats_refresh(tenant_id=api.tenant.pk)
    assert api.tenant.pk not in index.stale_tenant_ids()
    SearchCorpus.objects.filter(tenant=api.tenant).update(documents=10_000)  # as if it held 10k
    api.call("memory_write", key="note:c", value="flamingo")  # 1 of 10k: not yet
    assert api.tenant.pk not in index.stale_tenant_ids()
    SearchCorpus.objects.filter(tenant=api.tenant).update(documents=300)  # 1 of 300: not yet either
    assert api.tenant.pk not in index.stale_tenant_ids()
    api.call("memory_write", key="note:d", value="flamingo")
    api.call("memory_write", key="note:e", value="flamingo")  # 3 of 300: 1%, due
    assert api.tenant.pk in index.stale_tenant_ids()
    SearchCorpus.objects.filter(tenant=api.tenant).update(documents=10_000)
    assert api.tenant.pk not in index.stale_tenant_ids()
    # The count an hour old: due (the writes since are newer than it).
    SearchCorpus.objects.filter(tenant=api.tenant).update(
        refreshed_at=timezone.now() - index.STATS_MAX_AGE - timedelta(seconds=1)
    )
    assert api.tenant.pk in index.stale_tenant_ids()
    index.stats_refresh_stale()
    assert SearchTerm.objects.get(tenant=api.tenant, term="flamingo").ndoc == 3
    # A trashed memory, in a big tenant, a minute after its count: due at once.
    SearchCorpus.objects.filter(tenant=api.tenant).update(documents=10_000)
    api.call("memory_delete", key="note:a")
    assert api.tenant.pk in index.stale_tenant_ids()
    index.stats_refresh_stale()
    assert not SearchTerm.objects.filter(tenant=api.tenant, term="zanzibar").exists()


@pytest.mark.postgres
def test_a_forget_or_purge_in_a_big_tenant_is_recounted_at_once(api):
    from memories import services
    from memories.models import SearchCorpus, SearchTerm
    from memories.search import index
    from memories.services import forget_request_create, forget_request_execute
    from tests.factories import SYSTEM

    api.call("memory_write", key="user:u7:note", value="pelican zanzibar")
    api.call("memory_write", key="session:s1:a", value="pelican mombasa", ttl_seconds=60)
    api.call("memory_write", key="note:b", value="pelican")
    index.stats_refresh(tenant_id=api.tenant.pk)
    SearchCorpus.objects.filter(tenant=api.tenant).update(documents=10_000)
    forget_request_execute(request_id=forget_request_create(tenant=api.tenant, actor=SYSTEM, subject="u7").pk)
    assert api.tenant.pk in index.stale_tenant_ids()
    index.stats_refresh_stale()
    assert not SearchTerm.objects.filter(tenant=api.tenant, term="zanzibar").exists()
    SearchCorpus.objects.filter(tenant=api.tenant).update(documents=10_000)
    assert api.tenant.pk not in index.stale_tenant_ids()
    services.purge_expired(now=timezone.now() + timedelta(minutes=5))
    assert api.tenant.pk in index.stale_tenant_ids()
    index.stats_refresh_stale()
    assert not SearchTerm.objects.filter(tenant=api.tenant, term="mombasa").exists()


def _rows_scanned(sql: str, tables: tuple[str, ...]) -> int:
    """Rows of these tables that ``sql`` reads (every loop of each scan node, those its filter
    removed included), from its EXPLAIN ANALYZE, index access preferred."""
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")  # a tiny table is no measure of a big one
        try:
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
            plan = cursor.fetchone()[0]
        finally:
            cursor.execute("SET enable_seqscan = on")
    plan = json.loads(plan) if isinstance(plan, str) else plan
    total, stack = 0, [plan[0]["Plan"]]
    while stack:
        node = stack.pop()
        if node.get("Relation Name") in tables:
            total += (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * node.get("Actual Loops", 1)
        stack.extend(node.get("Plans", []))
    return total


@pytest.mark.postgres
def test_the_staleness_check_reads_no_history_of_a_tenant_counted_since(api):
    """stale_tenant_ids() runs every 10 minutes over every tenant. It read every memory of
    each counted tenant (``updated_at > refreshed_at`` under an OR, not on the index), every
    forget request ever completed for it (kept with their receipts) and its trash: 2,000
    tenants, one with 200k completed requests, 44 s. It now reads index entries past the
    count, and one entry for the latest trashed memory and completed request."""
    from django.test.utils import CaptureQueriesContext

    from memories.models import ForgetRequest
    from memories.search import index

    for i in range(20):
        write(api.tenant, f"note:{i}", f"pelican {i}")
        write(api.tenant, f"old:{i}", f"heron {i}")
        api.call("memory_delete", key=f"old:{i}")
    done = timezone.now() - timedelta(days=1)
    ForgetRequest.objects.bulk_create(
        ForgetRequest(
            tenant=api.tenant,
            subject=f"u{i}",
            status="completed",
            requested_by_kind="api_key",
            due_at=done,
            completed_at=done,
        )
        for i in range(20)
    )
    index.stats_refresh(tenant_id=api.tenant.pk)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE memories_memory")
        cursor.execute("ANALYZE memories_forgetrequest")
    with CaptureQueriesContext(connection) as queries:
        assert api.tenant.pk not in index.stale_tenant_ids()
    (sql,) = [q["sql"] for q in queries if "memories_searchcorpus" in q["sql"]]
    assert _rows_scanned(sql, ("memories_memory", "memories_forgetrequest")) <= 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("counted_before", [True, False], ids=["recount", "first-count"])
def test_a_purge_batch_committed_after_the_count_began_leaves_the_tenant_due(counted_before):
    """A purge batch marks the tenant inside its transaction, before it commits. A count
    that begins between the mark and the commit does not see the erasure, so the mark must
    not look older than the count (a timestamp taken in the batch would), and it must not
    be lost when the tenant has never been counted (no SearchCorpus row to mark yet)."""
    import threading

    from memories import services
    from memories.models import SearchTerm
    from memories.search import index
    from tests.factories import make_tenant

    tenant = make_tenant("purge-race")
    write(tenant, "session:s1:a", "pelican zanzibar", ttl_seconds=60)
    write(tenant, "note:b", "pelican")
    if counted_before:
        index.stats_refresh(tenant_id=tenant.pk)
    marked, go = threading.Event(), threading.Event()

    def hold_the_batch_open_once_marked(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if "memories_searcherasure" in sql:
            marked.set()
            go.wait(30)
        return result

    def purge():
        try:
            with connection.execute_wrapper(hold_the_batch_open_once_marked):
                services.purge_expired(now=timezone.now() + timedelta(minutes=5))
        finally:
            go.set()
            connection.close()

    worker = threading.Thread(target=purge)
    worker.start()
    try:
        assert marked.wait(30), "the purge batch never marked the tenant's erasure"
        index.stats_refresh(tenant_id=tenant.pk)  # its snapshot still holds the expired memory
    finally:
        go.set()
        worker.join(30)
    assert not Memory.objects.filter(key="session:s1:a").exists()
    assert SearchTerm.objects.filter(tenant=tenant, term="zanzibar").exists()  # counted before the commit
    assert tenant.pk in index.stale_tenant_ids()
    index.stats_refresh_stale()
    assert not SearchTerm.objects.filter(tenant=tenant, term="zanzibar").exists()
