"""Search and recall: ranked OR-style matching in Chinese and English."""

import pytest


@pytest.fixture
def seeded(api):
    for key, value in [
        ("task:t1:weekly_report", "周报发送时间改为每周五下午五点"),
        ("user:u10086:pref_lang", "zh-CN"),
        ("user:u10086:pref_format", "以后生成周报时都用表格格式"),
        ("fact:office:wifi", "The office wifi password is on the fridge"),
        ("user:u10086:diet", "vegetarian, no mushrooms"),
    ]:
        status, body = api.call("memory_write", key=key, value=value)
        assert status == 200, body
    return api


def test_chinese_question_finds_the_memory_that_answers_it(seeded):
    status, body = seeded.call("memory_search", query="周报什么时候发送？")
    assert status == 200
    assert body["results"][0]["key"] == "task:t1:weekly_report"


def test_chinese_substring_is_found(seeded):
    _, body = seeded.call("memory_search", query="周报")
    keys = [r["key"] for r in body["results"]]
    assert "task:t1:weekly_report" in keys and "user:u10086:pref_format" in keys


def test_english_question_matches_key_words(seeded):
    _, body = seeded.call("memory_search", query="which language does the user prefer?")
    assert body["results"][0]["key"] == "user:u10086:pref_lang"


def test_partial_word_overlap_still_ranks(seeded):
    # Only "wifi" of the three content words appears in the memory: OR-style, not AND.
    _, body = seeded.call("memory_search", query="wifi router admin")
    assert [r["key"] for r in body["results"]][:1] == ["fact:office:wifi"]


def test_recall_packs_best_matches_under_budget(seeded):
    _, body = seeded.call("memory_recall", query="周报什么时候发送？", max_chars=60)
    assert body["status"] == "ok"
    assert len(body["text"]) <= 60
    assert body["text"].startswith("task:t1:weekly_report: 周报发送时间")


def test_search_is_scoped_to_prefix(seeded):
    _, body = seeded.call("memory_search", query="周报", prefix="user:")
    assert [r["key"] for r in body["results"]] == ["user:u10086:pref_format"]


def test_word_forms_match_but_words_merely_sharing_four_letters_do_not(api):
    for key, value in [
        ("fact:apt", "Install the package with apt"),
        ("fact:web", "Use the web app instead"),
    ]:
        api.call("memory_write", key=key, value=value)
    _, body = api.call("memory_search", query="installing packages")
    assert [r["key"] for r in body["results"]] == ["fact:apt"]


def test_repeating_a_word_does_not_outrank_matching_more_words(api):
    api.call("memory_write", key="note:log", value="deploy " * 40)
    api.call("memory_write", key="note:billing", value="We deploy the billing service on Fridays")
    _, body = api.call("memory_search", query="when do we deploy the billing service?")
    assert body["results"][0]["key"] == "note:billing"


def test_a_stem_cuts_the_longest_suffix_that_leaves_four_letters():
    # stem() looks only at the suffixes a word's last letter allows; the rule is unchanged.
    import itertools

    from memories.search import text

    def reference(term: str) -> str:
        cuts = [s for s in text._SUFFIXES if term.endswith(s) and len(term) - len(s) >= 4]
        return term[: -len(max(cuts, key=len))] if cuts else term

    stems = ["", "a", "abc", "abcd", "pack", "distribut", "compat", "xe"]
    words = {stem + suffix for stem, suffix in itertools.product(stems, ["", *text._SUFFIXES])}
    words |= {w + s for w in ("ag", "nation", "nes", "ties") for s in text._SUFFIXES}
    assert {w: text.stem(w) for w in words} == {w: reference(w) for w in words}
    assert [text.stem(w) for w in ("packages", "installed", "distributions", "compatible", "安装")] == [
        "packag",
        "install",
        "distribut",
        "compat",
        "安装",
    ]


def test_query_terms_drop_filler_words_and_count_a_stem_once():
    from memories import search

    assert search.query_words("Could you tell me whether the packages or the package are just installed?") == [
        "packag",
        "install",
    ]
    assert search.query_words("我应该如何安装这个软件包？") == ["安装", "软件", "件包"]
