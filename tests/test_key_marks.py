"""Keys in scripts written with combining marks (Unicode categories Mn, Mc, Me): Devanagari,
Bengali, Tamil, Thai, Arabic with harakat, Hebrew with niqqud, Latin decomposed. A key
segment is letters, digits or ``_ - . @ + = ~``, each optionally followed by marks; a segment
never starts with a mark. The rule is the same on every surface and in the OpenAPI patterns.
Keys are taken as given, code point for code point (no normalisation): ``café`` composed and
decomposed are two keys (README "Keys, values and results"). A zero-width non-joiner or joiner
(U+200C, U+200D) is taken between two letters or marks: Persian writes everyday words with the
first, Indic scripts use both inside words; every other format character stays refused."""

import itertools
import time

import jsonschema_rs
import pytest
import yaml

from memories.api import serializers
from memories.mcp import server as mcp_server
from memories.models import Memory
from memories.search.text import tokenize
from tests.factories import make_key, make_keyed_client
from tests.helpers import rest_error, row_counts, tool_error
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import InvalidInput
from zeromem.kernel.outcomes import ActorKind

HINDI = "user:u1:हिंदी"  # ि U+093F and ी U+0940 are Mc, ं U+0902 Mn
MARKED_KEYS = [
    pytest.param(HINDI, id="devanagari"),
    pytest.param("user:u1:ที่อยู่", id="thai"),
    pytest.param("user:u1:বাংলা", id="bengali"),
    pytest.param("user:u1:தமிழ்", id="tamil"),
    pytest.param("user:u1:عَرَبِيّ", id="arabic-harakat"),
    pytest.param("user:u1:עִבְרִית", id="hebrew-niqqud"),
    pytest.param("user:u1:cafe\u0301", id="latin-decomposed"),
    pytest.param("user:हिंदी:नाम", id="marks-in-every-segment"),
    pytest.param("user:u1:1\u20e3", id="enclosing-mark"),  # keycap: Me
    pytest.param("user:u1:a" + "\u0301" * 200, id="many-marks-on-one-letter"),
]
# Zero-width non-joiner (U+200C) and joiner (U+200D) inside words, as people write them.
JOINED_KEYS = [
    pytest.param("user:u1:می\u200cخواهم", id="persian-zwnj-verb"),  # "I want"
    pytest.param("user:u1:کتاب\u200cها", id="persian-zwnj-plural"),  # "books"
    pytest.param("lang:fa:نیم\u200cفاصله:u1", id="persian-zwnj-mid-key"),  # "half-space"
    pytest.param("user:u1:क्\u200dष", id="devanagari-half-form"),  # virama, ZWJ: the half form of क
    pytest.param("user:u1:क\u200dष", id="devanagari-zwj-between-letters"),
    pytest.param("user:u1:ශ්\u200dරී", id="sinhala-conjunct"),  # ශ්‍රී (Sri), rakaaraansaya
    pytest.param("user:u1:എന്\u200dറെ", id="malayalam-chillu-zwj"),  # എന്‍റെ, chillu in the older spelling
    pytest.param("user:u1:ক্\u200cষ", id="bengali-zwnj"),
]
MARKED_KEYS += JOINED_KEYS
BAD_MARKED_KEYS = [
    pytest.param("\u093fabc", id="key-starts-with-a-mark"),
    pytest.param("user:u1:\u093fabc", id="segment-starts-with-a-mark"),
    pytest.param("user:\u0301:x", id="segment-only-a-mark"),
    pytest.param("user:u1:\u0301", id="last-segment-only-a-mark"),
    pytest.param("user:u1:\u200dक", id="joiner-leading"),
    pytest.param("\u200cمی", id="joiner-leading-the-key"),
    pytest.param("user:u1:می\u200c:x", id="joiner-before-a-colon"),
    pytest.param("user:u1:می\u200c\u200cخواهم", id="joiner-doubled"),
    pytest.param("user:u1:می\u200c\u200dخواهم", id="joiners-mixed"),
    pytest.param("user:u1:1\u200cx", id="joiner-after-a-digit"),
    pytest.param("user:u1:x\u200c1", id="joiner-before-a-digit"),
    pytest.param("user:u1:x\u200c_y", id="joiner-before-punctuation"),
    pytest.param("user:u1:x\u200c y", id="joiner-before-a-space"),
    pytest.param("user:u1:ab\u202ecd", id="bidi-override"),  # RIGHT-TO-LEFT OVERRIDE
    pytest.param("user:u1:ab\u2066cd", id="bidi-isolate"),  # LEFT-TO-RIGHT ISOLATE
    pytest.param("user:u1:ab\u200fcd", id="bidi-mark"),  # RIGHT-TO-LEFT MARK
    pytest.param("user:u1:a\u200bb", id="zero-width-space"),
    pytest.param("user:u1:a\u2060b", id="word-joiner"),
    pytest.param("user:u1:a\ufeffb", id="byte-order-mark"),
    pytest.param("user:u1:\U0001f468\u200d\U0001f469", id="emoji-zwj-sequence"),
    pytest.param("user:u1:क \u093f", id="mark-after-a-space"),
    pytest.param("user:u1:क\x01\u093f", id="mark-after-a-control-char"),
    pytest.param("user:u1:a/\u0301", id="mark-after-a-slash"),
    pytest.param("user:u1:क\ud800", id="lone-surrogate"),
    pytest.param("user:u1:ह::ि", id="empty-segment"),
]


def _refused(call, value):
    with pytest.raises(InvalidInput) as refused:
        call(value)
    return refused.value


# --- the rule --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", MARKED_KEYS)
def test_a_key_with_combining_marks_after_letters_is_valid(key):
    assert validation.key(key) == key
    # Every start of a valid key is a valid prefix: one cut between a letter and its mark too.
    for end in range(1, len(key) + 1):
        assert validation.prefix(key[:end]) == key[:end]


@pytest.mark.parametrize("key", BAD_MARKED_KEYS)
def test_a_mark_that_starts_a_segment_and_other_characters_are_still_refused(key):
    error = _refused(validation.key, key)
    assert (error.field, error.code) == ("key", "invalid_key")
    error = _refused(validation.prefix, key)
    assert (error.field, error.code) == ("prefix", "invalid_prefix")


def test_a_joiner_may_end_a_prefix_but_not_a_key():
    """A prefix is a key cut anywhere: after a joiner too (every start of می‌خواهم lists it)."""
    assert validation.prefix("user:u1:می\u200c") == "user:u1:می\u200c"
    assert validation.prefix("user:u1:क्\u200d") == "user:u1:क्\u200d"
    assert _refused(validation.key, "user:u1:می\u200c").code == "invalid_key"
    for bad in ["user:u1:1\u200c", "user:u1:\u200c", "\u200c", "user:u1:می\u200c\u200c", "user:u1:می\u200c:"]:
        assert _refused(validation.prefix, bad).field == "prefix", bad


def test_a_prefix_may_end_with_a_colon_but_not_continue_with_a_mark():
    assert validation.prefix("user:हि:") == "user:हि:"
    for bad in ["user:\u093f", "\u093f", ":\u093f", "user::ह"]:
        assert _refused(validation.prefix, bad).field == "prefix"


def test_tags_take_marks_after_a_letter_too():
    assert validation.tags(["हिंदी", "lang:हिंदी", "تَرْجَمَة"]) == ["हिंदी", "lang:हिंदी", "تَرْجَمَة"]
    for bad in ["\u093fx", "lang:\u093f", "a b"]:
        assert _refused(validation.tags, [bad]).field == "tags"
    assert _refused(validation.tags, ["क" + "\u093f" * validation.TAG_MAX_LEN]).field == "tags"  # 65 characters


def test_tags_take_joiners_between_letters_as_keys_do():
    joined = ["کتاب\u200cها", "lang:می\u200cخواهم", "क्\u200dष", "x\u200dy"]
    assert validation.tags(joined) == joined
    for bad in ["x\u200c", "\u200cx", "a:\u200cb", "a\u200c:b", "a\u200c\u200cb", "1\u200cx", "a\u202eb", "a\u2067b"]:
        assert _refused(validation.tags, [bad]).field == "tags", bad


def test_a_refused_marked_key_or_prefix_costs_no_more_than_a_plain_one():
    # Every check is one pass over the string: a run of marks that fails at its end is no
    # worse than the run of letters tests/test_worst_inputs.py tries.
    worst = [
        "क" + "\u093f" * 510 + "!",
        ("क\u093f" * 50 + ":") * 5 + "!",
        "क\u093f:" * 170 + "\u093f",
        "ک\u200c" * 255 + "!",
        "ک\u200c" * 255 + "\u200c",
    ]
    started = time.process_time()
    for text in worst * 20:
        _refused(validation.prefix, text)
        _refused(validation.key, text)
    assert time.process_time() - started < 0.5


# --- the OpenAPI patterns say the same ---------------------------------------------------------


SAMPLES = [
    *(p.values[0] for p in MARKED_KEYS),
    *(p.values[0] for p in BAD_MARKED_KEYS if "\ud800" not in p.values[0]),
    "user:u1:pref_lang",
    "user:张三:偏好",
    "a.b@c+d=e~f-g:h_i",
    "user:u1:",
    "user:हि:",
    "user:u1:ह",
    "a::b",
    ":a",
    "",
    "a b",
    "lang:हिंदी",
    "\u0301",
    "x\u0301:\u0301",
    "user:u1:می\u200c",
    "user:u1:a\u0301\u200c",
    "user:u1:a\u200c\u0301b",
    "user:u1:1\u0301\u200cx",
    ":a\u200cb:",
    "a\u200c",
]


@pytest.mark.parametrize(
    ("pattern", "check"),
    [
        (serializers.KEY_PATTERN, validation.key),
        (serializers.PREFIX_PATTERN, validation.prefix),
        (serializers.TAG_PATTERN, lambda t: validation.tags([t])),
    ],
    ids=["key", "prefix", "tag"],
)
def test_the_openapi_pattern_takes_what_the_service_takes(pattern, check):
    """jsonschema-rs reads patterns as ECMA-262 with the u flag (\\p{M} included), as a
    JavaScript validator (Ajv with unicodeRegExp, the default) does; a tag's schema also
    states its maxLength, as the OpenAPI description does."""
    bound = {"maxLength": validation.TAG_MAX_LEN} if pattern == serializers.TAG_PATTERN else {}
    schema = jsonschema_rs.validator_for({"type": "string", "pattern": pattern, **bound})
    for text in SAMPLES:
        try:
            check(text)
            taken = text != "" or check is validation.prefix
        except InvalidInput:
            taken = False
        assert schema.is_valid(text) == taken, (pattern, text)


@pytest.mark.parametrize(
    ("pattern", "check"),
    [
        (serializers.KEY_PATTERN, validation.key),
        (serializers.PREFIX_PATTERN, validation.prefix),
        (serializers.TAG_PATTERN, lambda t: validation.tags([t])),
    ],
    ids=["key", "prefix", "tag"],
)
def test_the_openapi_pattern_and_the_service_agree_on_every_short_string(pattern, check):
    """Every string of up to 4 characters over letters, a mark, both joiners, a digit, ":",
    "_" and a bidi override: the pattern and the service take the same ones."""
    schema = jsonschema_rs.validator_for({"type": "string", "pattern": pattern})
    alphabet = ["a", "\u093f", "\u200c", "\u200d", "1", ":", "_", "\u202e"]
    for n in range(1, 5):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            try:
                check(text)
                taken = True
            except InvalidInput:
                taken = False
            assert schema.is_valid(text) == taken, (pattern, text)


def test_the_served_openapi_schema_states_the_marked_patterns(anonymous):
    doc = yaml.safe_load(anonymous.get("/api/v1/schema").content)
    patterns, stack = set(), [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            patterns.update(v for k, v in item.items() if k == "pattern" and isinstance(v, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    assert {serializers.KEY_PATTERN, serializers.PREFIX_PATTERN, serializers.TAG_PATTERN} <= patterns
    assert all(r"\p{M}" in p for p in (serializers.KEY_PATTERN, serializers.PREFIX_PATTERN, serializers.TAG_PATTERN))


# --- every surface -----------------------------------------------------------------------------


@pytest.mark.parametrize("key", MARKED_KEYS)
def test_a_marked_key_is_written_read_listed_and_deleted_by_tool_calls(api, key):
    status, body = api.call("memory_write", key=key, value="v1")
    assert status == 200 and body["key"] == key, body
    status, body = api.call("memory_update", key=key, value="v2")
    assert status == 200 and body["version"] == 2, body
    _, body = api.call("memory_read", key=key)
    assert body["status"] == "ok" and body["key"] == key and body["value"] == "v2"
    _, body = api.call("memory_list", prefix=key[:-1])
    assert body["keys"] == [key]
    _, body = api.call("memory_delete", key=key)
    assert body["status"] == "ok"
    _, body = api.call("memory_read", key=key)
    assert body["status"] == "not_found"


def test_a_prefix_cut_inside_a_grapheme_lists_by_code_points(api):
    """A prefix is a string of code points, not of graphemes: "हि" lists हिंदी (it starts with
    those code points); "ह" (the letter without its vowel sign) lists it and हा too."""
    for key in [HINDI, "user:u1:हाथ", "user:u1:हिमालय"]:
        assert api.call("memory_write", key=key, value="v")[0] == 200
    assert api.call("memory_list", prefix="user:u1:हिं")[1]["keys"] == [HINDI]
    assert api.call("memory_list", prefix="user:u1:हि")[1]["keys"] == sorted([HINDI, "user:u1:हिमालय"])
    assert len(api.call("memory_list", prefix="user:u1:ह")[1]["keys"]) == 3


def test_composed_and_decomposed_spellings_are_two_keys(api):
    """Keys are taken as given: no normalisation, so a key stored in any spelling before this
    rule (Hangul jamo, a CJK compatibility ideograph) is still found under that spelling."""
    composed, decomposed = "user:u1:caf\u00e9", "user:u1:cafe\u0301"
    assert api.call("memory_write", key=composed, value="composed")[0] == 200
    assert api.call("memory_write", key=decomposed, value="decomposed")[0] == 200
    assert api.call("memory_read", key=composed)[1]["value"] == "composed"
    assert api.call("memory_read", key=decomposed)[1]["value"] == "decomposed"
    assert sorted(Memory.objects.values_list("key", flat=True)) == sorted([composed, decomposed])


@pytest.mark.parametrize("key", [p for p in BAD_MARKED_KEYS if p.id != "lone-surrogate"])  # test_validation.py
def test_a_bad_marked_key_is_400_naming_key_and_writes_nothing(api, key):
    before = row_counts()
    status, body = api.call("memory_write", key=key, value="v")
    assert status == 400 and tool_error(body)["field"] == "key", body
    status, body = api.call("memory_list", prefix=key)
    assert status == 400 and tool_error(body)["field"] == "prefix", body
    assert row_counts() == before


def test_a_marked_key_over_rest(api):
    path = "/api/v1/memories/user:u1:%E0%A4%B9%E0%A4%BF%E0%A4%82%E0%A4%A6%E0%A5%80"  # हिंदी
    r = api.put(path, {"value": "नमस्ते", "tags": ["भाषा"]})
    assert r.status_code == 201, r.content
    r = api.get(path)
    assert r.status_code == 200 and r.json()["key"] == HINDI and r.json()["tags"] == ["भाषा"]
    r = api.get("/api/v1/memories", {"prefix": "user:u1:हि", "tag": "भाषा"})
    assert [m["key"] for m in r.json()["results"]] == [HINDI]
    r = api.put("/api/v1/memories/user:u1:%E0%A4%BF", {"value": "v"})  # a segment that is a lone mark
    assert r.status_code == 400 and rest_error(r)["field"] == "key"


def test_a_marked_key_in_a_batch_and_over_mcp(api, tenant_a):
    r = api.post("/api/v1/tools/batch", {"calls": [{"name": "memory_write", "arguments": {"key": HINDI, "value": 1}}]})
    assert r.status_code == 200 and r.json()["results"][0]["key"] == HINDI, r.content
    key, _raw = make_key(tenant_a)
    actor = Actor(kind=ActorKind.API_KEY, id=str(key.pk), label=key.display_prefix, scopes=frozenset(key.scopes))
    result = mcp_server.answer(key, actor.with_surface("mcp"), "memory_read", {"key": HINDI})[0]
    assert result["status"] == "ok" and result["value"] == 1, result


def test_an_allowlist_entry_with_marks_covers_its_keys_and_no_others(tenant_a):
    client, _ = make_keyed_client(tenant_a, allow=["user:हिंदी:"])
    assert client.call("memory_write", key="user:हिंदी:नाम", value="v")[0] == 200
    status, body = client.call("memory_write", key="user:हिंदीx:नाम", value="v")
    assert status == 403 and tool_error(body)["code"] == "key_not_allowed"
    status, body = client.call("memory_write", key="user:हिंद:नाम", value="v")
    assert status == 403
    with pytest.raises(InvalidInput):
        make_key(tenant_a, allow=["user:\u093f"])


def test_the_claude_memory_tool_stores_a_name_whose_marks_have_no_composed_form(api, tenant_a):
    r = api.post("/api/v1/anthropic/memory", {"command": "create", "path": "/memories/हिंदी.md", "file_text": "x\n"})
    assert r.json() == {"content": "File created successfully at: /memories/हिंदी.md", "is_error": False}
    assert Memory.objects.get(tenant=tenant_a).key == "claude:memories:हिंदी.md"
    r = api.post("/api/v1/anthropic/memory", {"command": "view", "path": "/memories"})
    assert "/memories/हिंदी.md" in r.json()["content"]
    r = api.post("/api/v1/anthropic/memory", {"command": "create", "path": "/memories/\u093f.md", "file_text": "x"})
    assert r.json()["is_error"] is True and "cannot be stored" in r.json()["content"]


def test_a_search_finds_a_memory_by_the_words_of_its_marked_key(api):
    """A word keeps its marks (it was cut at each mark into single letters no query looks
    for); on SQLite, FTS5 takes marks as parts of a term too (migration 0035)."""
    assert tokenize("user u1 हिंदी, नमस्ते ที่อยู่ café") == ["user", "u1", "हिंदी", "नमस्ते", "ที่อยู่", "café"]
    assert api.call("memory_write", key=HINDI, value="नमस्ते")[0] == 200
    assert api.call("memory_write", key="user:u1:english", value="hello")[0] == 200
    _, body = api.call("memory_search", query="हिंदी")
    assert [r["key"] for r in body["results"]] == [HINDI], body
    _, body = api.call("memory_search", query="नमस्ते", prefix="user:u1:हि")
    assert [r["key"] for r in body["results"]] == [HINDI], body


def test_the_claude_memory_tool_lists_no_name_it_cannot_open(api, tenant_a):
    """Another surface takes a key as given, so REST can write a decomposed name under the
    tool's root; the tool reads paths in NFC, so no path reaches it: it is not listed (it was,
    and a view of the listed path answered that it does not exist)."""
    assert api.put("/api/v1/memories/claude:memories:cafe%CC%81.md", {"value": "x"}).status_code == 201
    assert api.put("/api/v1/memories/claude:memories:cafe%CC%81:a.md", {"value": "y"}).status_code == 201
    assert api.put("/api/v1/memories/claude:memories:%E0%A4%B9%E0%A4%BF.md", {"value": "z"}).status_code == 201
    r = api.post("/api/v1/anthropic/memory", {"command": "view", "path": "/memories"})
    assert r.json()["content"].split("\n")[1:] == ["1B\t/memories", "1B\t/memories/हि.md"], r.json()


# --- joiners on every surface ------------------------------------------------------------------


PERSIAN = "user:u1:می\u200cخواهم"  # "I want", with its zero-width non-joiner


def test_a_prefix_cut_at_a_joiner_lists_by_code_points(api):
    for key in [PERSIAN, "user:u1:میز", "user:u1:کتاب\u200cها"]:
        assert api.call("memory_write", key=key, value="v")[0] == 200
    assert api.call("memory_list", prefix="user:u1:می\u200c")[1]["keys"] == [PERSIAN]
    assert api.call("memory_list", prefix="user:u1:می")[1]["keys"] == sorted([PERSIAN, "user:u1:میز"])
    r = api.get("/api/v1/memories", {"prefix": "user:u1:کتاب\u200c"})
    assert r.status_code == 200 and [m["key"] for m in r.json()["results"]] == ["user:u1:کتاب\u200cها"]
    status, body = api.call("memory_list", prefix="user:u1:می\u200c\u200c")
    assert status == 400 and tool_error(body)["field"] == "prefix"


def test_a_tag_with_a_joiner_is_stored_and_filters(api):
    r = api.put("/api/v1/memories/user:u1:x", {"value": "v", "tags": ["کتاب\u200cها"]})
    assert r.status_code == 201, r.content
    r = api.get("/api/v1/memories", {"tag": "کتاب\u200cها"})
    assert [m["key"] for m in r.json()["results"]] == ["user:u1:x"]
    before = row_counts()
    r = api.put("/api/v1/memories/user:u1:y", {"value": "v", "tags": ["کتاب\u200c"]})
    assert r.status_code == 400 and rest_error(r)["field"] == "tags"
    r = api.put("/api/v1/memories/user:u1:y", {"value": "v", "tags": ["a\u202eb"]})
    assert r.status_code == 400 and rest_error(r)["field"] == "tags"
    assert row_counts() == before


def test_the_claude_memory_tool_stores_a_persian_name_with_its_non_joiner(api, tenant_a):
    path = "/memories/کتاب\u200cها/می\u200cخواهم.md"
    r = api.post("/api/v1/anthropic/memory", {"command": "create", "path": path, "file_text": "x\n"})
    assert r.json() == {"content": f"File created successfully at: {path}", "is_error": False}
    assert Memory.objects.get(tenant=tenant_a).key == "claude:memories:کتاب\u200cها:می\u200cخواهم.md"
    r = api.post("/api/v1/anthropic/memory", {"command": "view", "path": "/memories"})
    assert path in r.json()["content"]
    r = api.post("/api/v1/anthropic/memory", {"command": "view", "path": path})
    assert r.json()["is_error"] is False and "x" in r.json()["content"]
    r = api.post("/api/v1/anthropic/memory", {"command": "create", "path": "/memories/a\u202eb.md", "file_text": "x"})
    assert r.json()["is_error"] is True and "cannot be stored" in r.json()["content"]
    assert Memory.objects.filter(tenant=tenant_a).count() == 1


def test_a_langgraph_namespace_and_key_with_joiners_round_trip(api, tenant_a):
    namespace, key = ["کتاب\u200cها", "क्\u200dष"], "می\u200cخواهم"
    r = api.put("/api/v1/langgraph/store/items", {"namespace": namespace, "key": key, "value": {"n": 1}})
    assert r.status_code == 204, r.content
    r = api.get("/api/v1/langgraph/store/items", {"namespace": ".".join(namespace), "key": key})
    assert r.status_code == 200 and r.json()["namespace"] == namespace and r.json()["key"] == key, r.content
    r = api.post("/api/v1/langgraph/store/items/search", {"namespace_prefix": namespace[:1]})
    assert [(i["namespace"], i["key"]) for i in r.json()["items"]] == [(namespace, key)]
    r = api.post("/api/v1/langgraph/store/namespaces", {})
    assert r.json()["namespaces"] == [namespace]


def test_a_search_finds_a_memory_by_the_words_of_its_joined_key(api):
    """The key's words are searchable with or without the joiner (on SQLite through FTS5,
    whose tokenizer would cut a term at a format character: the terms hold none)."""
    assert api.call("memory_write", key=PERSIAN, value="چای")[0] == 200
    assert api.call("memory_write", key="user:u1:क्\u200dष", value="x")[0] == 200
    assert api.call("memory_write", key="user:u1:english", value="hello")[0] == 200
    for query in ["می\u200cخواهم", "میخواهم", "خواهم"]:
        _, body = api.call("memory_search", query=query)
        assert [r["key"] for r in body["results"]] == [PERSIAN], (query, body)
    for query in ["क्\u200dष", "क्ष"]:
        _, body = api.call("memory_search", query=query)
        assert [r["key"] for r in body["results"]] == ["user:u1:क्\u200dष"], (query, body)
