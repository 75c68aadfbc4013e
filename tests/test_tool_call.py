"""POST /api/v1/tools/call and /api/v1/tools/batch: every tool's outcomes and both call shapes."""

import json

import pytest

from audit.models import AuditEvent
from memories import tools
from memories.models import Memory, MemoryVersion
from tests.helpers import row_counts, tool_error

CALL = "/api/v1/tools/call"
BATCH = "/api/v1/tools/batch"


# --- memory_write -----------------------------------------------------------------------


def test_write_of_new_key_is_created_at_version_1(api):
    status, body = api.call("memory_write", key="user:u1:pref_lang", value="zh-CN")
    assert status == 200
    assert body == {"status": "ok", "key": "user:u1:pref_lang", "version": 1, "created": True}
    assert Memory.objects.get(tenant=api.tenant, key="user:u1:pref_lang").value == "zh-CN"


def test_write_of_existing_key_replaces_value_and_increments_version(api):
    api.call("memory_write", key="user:u1:pref_lang", value="zh-CN")
    status, body = api.call("memory_write", key="user:u1:pref_lang", value="en")
    assert status == 200
    assert body == {"status": "ok", "key": "user:u1:pref_lang", "version": 2, "created": False}
    _, body = api.call("memory_write", key="user:u1:pref_lang", value={"lang": "fr"})
    assert body["version"] == 3
    memory = Memory.objects.get(tenant=api.tenant, key="user:u1:pref_lang")
    assert memory.value == {"lang": "fr"}
    assert list(memory.versions.order_by("version").values_list("version", "value")) == [
        (1, "zh-CN"),
        (2, "en"),
        (3, {"lang": "fr"}),
    ]


def test_write_keeps_fields_it_omits(api):
    api.call(
        "memory_write",
        key="task:t1:status",
        value="running",
        tags=["urgent", "q3"],
        subject="u42",
        category="decision",
        ttl_seconds=3600,
    )
    first = Memory.objects.get(tenant=api.tenant, key="task:t1:status")
    status, body = api.call("memory_write", key="task:t1:status", value="done")
    assert status == 200 and body["version"] == 2
    memory = Memory.objects.get(tenant=api.tenant, key="task:t1:status")
    assert memory.value == "done"
    assert memory.tags == ["urgent", "q3"]
    assert memory.subject == "u42"
    assert memory.category == "decision"
    assert memory.expires_at == first.expires_at


def test_write_accepts_any_json_value(api):
    value = {"a": [1, 2.5, True, None], "b": {"c": "周报"}}
    api.call("memory_write", key="fact:x:y", value=value)
    _, body = api.call("memory_read", key="fact:x:y")
    assert body["value"] == value


# --- memory_read ------------------------------------------------------------------------


def test_read_returns_value_version_and_updated_at(api):
    api.call("memory_write", key="user:u1:pref_lang", value="zh-CN")
    status, body = api.call("memory_read", key="user:u1:pref_lang")
    assert status == 200
    assert body["status"] == "ok"
    assert body["key"] == "user:u1:pref_lang"
    assert body["value"] == "zh-CN"
    assert body["version"] == 1
    assert body["updated_at"].endswith("Z")
    assert Memory.objects.get(key="user:u1:pref_lang").access_count == 1


def test_read_of_missing_key_is_not_found(api):
    status, body = api.call("memory_read", key="user:u1:nothing")
    assert status == 200
    assert body == {"status": "not_found", "key": "user:u1:nothing"}


def test_read_of_missing_key_returns_the_default(api):
    status, body = api.call("memory_read", key="user:u1:pref_lang", default="en")
    assert status == 200
    assert body == {"status": "not_found", "key": "user:u1:pref_lang", "value": "en"}


def test_read_of_present_key_ignores_the_default(api):
    api.call("memory_write", key="user:u1:pref_lang", value="zh-CN")
    _, body = api.call("memory_read", key="user:u1:pref_lang", default="en")
    assert body["status"] == "ok" and body["value"] == "zh-CN"


@pytest.mark.parametrize(
    ("default", "status", "code"),
    [
        ("x" * 20000, 413, "too_large"),  # past the tenant's value cap (16,384 bytes), as a write
        ({"a": "b\u0000c"}, 400, "invalid"),  # PostgreSQL's jsonb cannot hold NUL: a write refuses it
        (json.loads("[" * 33 + "]" * 33), 400, "too_deep"),  # past 32 arrays deep
    ],
)
def test_a_default_a_write_would_refuse_is_refused_naming_default_and_changes_nothing(api, default, status, code):
    """The default is echoed to the model as the value: the value rules of a write apply to
    it (it was echoed whatever its size), whether the key is there or not."""
    api.call("memory_write", key="user:u1:there", value="v")
    before = row_counts()
    for key in ("user:u1:missing", "user:u1:there"):
        got, body = api.call("memory_read", key=key, default=default)
        error = tool_error(body)
        assert (got, error["field"], error["code"]) == (status, "default", code), body
    assert row_counts() == before
    events = AuditEvent.objects.filter(tenant=api.tenant, action="memory.read").order_by("-id")[:2]
    assert [e.outcome for e in events] == ["invalid", "invalid"]


def test_a_default_at_the_value_cap_is_echoed(api):
    default = "x" * (16 * 1024 - 2)  # 16,384 bytes as JSON, quotes included
    _, body = api.call("memory_read", key="user:u1:missing", default=default)
    assert body == {"status": "not_found", "key": "user:u1:missing", "value": default}


def test_a_batch_answers_a_refused_default_as_that_calls_error_and_runs_the_others(api):
    r = api.post(
        BATCH,
        {
            "calls": [
                {"id": "c1", "name": "memory_read", "arguments": {"key": "user:u1:a", "default": "x" * 20000}},
                {"id": "c2", "name": "memory_write", "arguments": {"key": "user:u1:b", "value": 1}},
            ]
        },
    )
    assert r.status_code == 200
    first, second = r.json()["results"]
    assert first["tool_call_id"] == "c1" and tool_error(first)["field"] == "default"
    assert first["error"]["code"] == "too_large" and "x" * 100 not in json.dumps(first)
    assert second["status"] == "ok"


# A read pours no more than max_chars (default 2,000) characters of a value into the model's
# context; the rest comes with offset.


def test_read_of_a_long_value_is_cut_at_2000_characters_and_says_how_to_get_the_rest(api):
    text = "".join(f"line {i:04d} of the plan\n" for i in range(300))  # 6,900 characters
    api.call("memory_write", key="task:t1:plan", value=text)
    status, first = api.call("memory_read", key="task:t1:plan")
    assert status == 200
    assert first["value"] == text[:2000]
    assert (first["truncated"], first["chars"], first["next_offset"]) == (True, len(text), 2000)
    assert first["version"] == 1 and first["status"] == "ok"
    pages, offset = [first["value"]], first["next_offset"]
    while offset is not None:
        _, page = api.call("memory_read", key="task:t1:plan", offset=offset)
        assert page["chars"] == len(text)
        pages.append(page["value"])
        offset = page.get("next_offset")
    assert page["truncated"] is False and "next_offset" not in page
    assert "".join(pages) == text and len(pages) == 4
    _, whole = api.call("memory_read", key="task:t1:plan", max_chars=8000)
    assert whole["value"] == text and "truncated" not in whole


def test_read_of_a_long_structured_value_is_cut_as_its_json_text(api):
    value = {"steps": [{"n": i, "what": "步骤"} for i in range(200)]}
    api.call("memory_write", key="task:t1:steps", value=value)
    _, first = api.call("memory_read", key="task:t1:steps", max_chars=1000)
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    assert first["value"] == text[:1000] and first["chars"] == len(text) and first["truncated"] is True
    _, rest = api.call("memory_read", key="task:t1:steps", max_chars=len(text), offset=1000)
    assert json.loads(first["value"] + rest["value"]) == value and rest["truncated"] is False


@pytest.mark.parametrize(
    "cluster",
    [
        "e\u0301",  # e + combining acute: é
        "\U0001f1e9\U0001f1ea",  # regional indicators D E: the German flag
        "\U0001f468\u200d\U0001f469\u200d\U0001f467",  # a family, joined by ZWJ
        "\U0001f44d\U0001f3fd",  # thumbs up, medium skin tone
        "\u2764\ufe0f",  # heart + emoji variation selector
        "\r\n",
    ],
)
def test_a_cut_never_splits_what_reads_as_one_character(api, cluster):
    """A slice that would end inside a grapheme cluster ends before it: the model never reads
    "Jose" for "José" or half a flag, and the slices still join to the value exactly."""
    text = "a" * 1999 + cluster + "b" * 50
    api.call("memory_write", key="note:n1:text", value=text)
    _, first = api.call("memory_read", key="note:n1:text")
    assert first["value"] == "a" * 1999 and first["next_offset"] == 1999
    _, rest = api.call("memory_read", key="note:n1:text", offset=first["next_offset"])
    assert first["value"] + rest["value"] == text and rest["truncated"] is False


def test_a_cut_inside_one_long_cluster_still_moves_forward(api):
    api.call("memory_write", key="note:n1:text", value="e" + "\u0301" * 10)
    _, first = api.call("memory_read", key="note:n1:text", max_chars=3)
    assert first["value"] == "e\u0301\u0301" and first["next_offset"] == 3


def test_a_value_within_max_chars_is_read_whole_as_before(api):
    value = {"lang": "zh-CN", "tz": "Asia/Shanghai"}
    api.call("memory_write", key="user:u1:prefs", value=value)
    _, body = api.call("memory_read", key="user:u1:prefs", max_chars=40)
    assert set(body) == {"status", "key", "value", "version", "updated_at"} and body["value"] == value


@pytest.mark.parametrize(("arguments", "field"), [({"max_chars": 0}, "max_chars"), ({"offset": -1}, "offset")])
def test_read_with_max_chars_or_offset_out_of_range_is_400_naming_it_and_audited(api, arguments, field):
    api.call("memory_write", key="user:u1:pref_lang", value="zh-CN")
    status, body = api.call("memory_read", key="user:u1:pref_lang", **arguments)
    assert status == 400 and tool_error(body)["field"] == field
    event = AuditEvent.objects.filter(tenant=api.tenant, action="memory.read").latest("id")
    assert event.outcome == "invalid"


def test_rest_read_still_returns_the_whole_value(api):
    text = "x" * 5000
    api.call("memory_write", key="task:t1:blob", value=text)
    r = api.get("/api/v1/memories/task:t1:blob")
    assert r.status_code == 200 and r.json()["value"] == text


# --- memory_update ----------------------------------------------------------------------


def test_update_changes_value_and_increments_version(api):
    api.call("memory_write", key="task:t1:status", value="running", tags=["a"])
    status, body = api.call("memory_update", key="task:t1:status", value="done")
    assert status == 200
    assert body == {"status": "ok", "key": "task:t1:status", "version": 2, "created": False}
    memory = Memory.objects.get(key="task:t1:status")
    assert (memory.value, memory.version, memory.tags) == ("done", 2, ["a"])
    assert MemoryVersion.objects.filter(memory=memory, version=2, op="update", value="done").exists()


def test_update_with_matching_expected_version_succeeds(api):
    api.call("memory_write", key="task:t1:status", value="running")
    _, body = api.call("memory_update", key="task:t1:status", value="done", expected_version=1)
    assert body["status"] == "ok" and body["version"] == 2


def test_update_of_missing_key_is_not_found_and_creates_nothing(api):
    before = row_counts()
    status, body = api.call("memory_update", key="task:t1:status", value="done")
    assert status == 200
    assert body == {"status": "not_found", "key": "task:t1:status"}
    assert row_counts() == before


def test_update_with_stale_expected_version_is_conflict_with_current_version(api):
    api.call("memory_write", key="task:t1:status", value="v1")
    api.call("memory_write", key="task:t1:status", value="v2")
    status, body = api.call("memory_update", key="task:t1:status", value="v3", expected_version=1)
    assert status == 200
    assert body == {"status": "conflict", "key": "task:t1:status", "current_version": 2}
    memory = Memory.objects.get(key="task:t1:status")
    assert (memory.value, memory.version) == ("v2", 2)


# --- memory_delete ----------------------------------------------------------------------


def test_delete_then_read_is_not_found_and_trash_keeps_the_row(api):
    api.call("memory_write", key="task:t1:status", value="running")
    status, body = api.call("memory_delete", key="task:t1:status")
    assert status == 200
    assert body == {"status": "ok"}
    _, body = api.call("memory_read", key="task:t1:status")
    assert body == {"status": "not_found", "key": "task:t1:status"}
    trashed = Memory.objects.trashed().get(tenant=api.tenant, key="task:t1:status")
    assert trashed.value == "running"
    assert trashed.versions.filter(op="delete").count() == 1


def test_delete_of_missing_key_is_not_found(api):
    status, body = api.call("memory_delete", key="task:t1:status")
    assert status == 200
    assert body == {"status": "not_found", "key": "task:t1:status"}


def test_delete_twice_is_not_found_the_second_time(api):
    api.call("memory_write", key="task:t1:status", value="x")
    api.call("memory_delete", key="task:t1:status")
    _, body = api.call("memory_delete", key="task:t1:status")
    assert body["status"] == "not_found"


def test_write_after_delete_creates_a_fresh_memory(api):
    api.call("memory_write", key="task:t1:status", value="old")
    api.call("memory_delete", key="task:t1:status")
    _, body = api.call("memory_write", key="task:t1:status", value="new")
    assert body == {"status": "ok", "key": "task:t1:status", "version": 1, "created": True}
    assert Memory.objects.filter(key="task:t1:status").count() == 2  # one live, one in the trash


# --- memory_list ------------------------------------------------------------------------


@pytest.fixture
def listed(api):
    for key in ["user:u1:a", "user:u1:b", "user:u1:c", "user:u10:a", "user:u2:a", "task:t1:a"]:
        api.call("memory_write", key=key, value=key)
    return api


def test_list_returns_sorted_keys_under_prefix(listed):
    status, body = listed.call("memory_list", prefix="user:u1:")
    assert status == 200
    assert body == {"status": "ok", "keys": ["user:u1:a", "user:u1:b", "user:u1:c"], "next_cursor": None}


def test_list_prefix_cut_mid_segment_matches_by_string_prefix(listed):
    _, body = listed.call("memory_list", prefix="user:u1")
    # Ordered by the key string: "0" sorts before ":".
    assert body["keys"] == ["user:u10:a", "user:u1:a", "user:u1:b", "user:u1:c"]


def test_list_without_prefix_returns_every_key(listed):
    _, body = listed.call("memory_list")
    assert len(body["keys"]) == 6


def test_list_limit_caps_the_page_and_gives_a_cursor(listed):
    _, body = listed.call("memory_list", prefix="user:u1:", limit=2)
    assert body["keys"] == ["user:u1:a", "user:u1:b"]
    assert isinstance(body["next_cursor"], str) and body["next_cursor"]


def test_list_cursor_pagination_walks_every_key_exactly_once(api):
    keys = sorted(f"task:t{i:02d}:status" for i in range(23))
    for key in keys:
        api.call("memory_write", key=key, value="x")
    api.call("memory_write", key="user:u1:other", value="x")
    seen, cursor, pages = [], None, 0
    while True:
        _, body = api.call("memory_list", prefix="task:", limit=5, cursor=cursor)
        assert body["status"] == "ok"
        seen.extend(body["keys"])
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
        assert pages < 10
    assert seen == keys
    assert pages == 5


def test_list_hides_deleted_keys(listed):
    listed.call("memory_delete", key="user:u1:b")
    _, body = listed.call("memory_list", prefix="user:u1:")
    assert body["keys"] == ["user:u1:a", "user:u1:c"]


# --- memory_search and memory_recall ----------------------------------------------------


def test_search_returns_ranked_results_with_key_value_and_score(api):
    api.call("memory_write", key="fact:office:wifi", value="The office wifi password is on the fridge")
    api.call("memory_write", key="fact:office:parking", value="Parking is in the basement")
    status, body = api.call("memory_search", query="wifi password")
    assert status == 200
    assert body["status"] == "ok"
    assert body["results"][0]["key"] == "fact:office:wifi"
    assert body["results"][0]["value"] == "The office wifi password is on the fridge"
    assert isinstance(body["results"][0]["score"], float | int) and body["results"][0]["score"] > 0
    assert "fact:office:parking" not in [r["key"] for r in body["results"]]


def test_search_limit_caps_results(api):
    for i in range(8):
        api.call("memory_write", key=f"fact:f{i}:note", value=f"report number {i}")
    _, body = api.call("memory_search", query="report")
    assert len(body["results"]) == 5  # the default
    _, body = api.call("memory_search", query="report", limit=3)
    assert len(body["results"]) == 3


def test_search_with_no_match_returns_empty_results(api):
    api.call("memory_write", key="fact:a:b", value="hello world")
    _, body = api.call("memory_search", query="zebra")
    assert body == {"status": "ok", "results": []}


def test_recall_respects_max_chars(api):
    for i in range(10):
        api.call("memory_write", key=f"fact:f{i}:report", value=f"the weekly report {i} " + "x" * 40)
    for max_chars in (50, 120, 300):
        status, body = api.call("memory_recall", query="weekly report", max_chars=max_chars)
        assert status == 200 and body["status"] == "ok"
        assert 0 < len(body["text"]) <= max_chars
        assert body["count"] >= 1
    _, body = api.call("memory_recall", query="weekly report", max_chars=8000)
    assert body["count"] == 10
    assert len(body["text"].splitlines()) == 10


def test_recall_text_has_key_value_lines(api):
    api.call("memory_write", key="user:u1:pref_lang", value="zh-CN")
    _, body = api.call("memory_recall", query="language preference")
    assert body == {"status": "ok", "text": "user:u1:pref_lang: zh-CN", "count": 1}


# --- call shapes ------------------------------------------------------------------------


def test_arguments_may_be_a_json_string(api):
    args = json.dumps({"key": "user:u1:pref_lang", "value": "zh-CN"})
    r = api.post(CALL, {"name": "memory_write", "arguments": args})
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "key": "user:u1:pref_lang", "version": 1, "created": True}


def test_openai_tool_call_shape_echoes_tool_call_id(api):
    call = {
        "id": "call_abc123",
        "type": "function",
        "function": {"name": "memory_write", "arguments": json.dumps({"key": "user:u1:x", "value": 1})},
    }
    r = api.post(CALL, call)
    assert r.status_code == 200
    assert r.json() == {
        "status": "ok",
        "key": "user:u1:x",
        "version": 1,
        "created": True,
        "tool_call_id": "call_abc123",
    }
    call = {"id": "call_2", "type": "function", "function": {"name": "memory_read", "arguments": {"key": "user:u1:x"}}}
    body = api.post(CALL, call).json()
    assert body["value"] == 1 and body["tool_call_id"] == "call_2"


def test_openai_shape_error_keeps_tool_call_id(api):
    call = {"id": "call_bad", "type": "function", "function": {"name": "memory_read", "arguments": "{}"}}
    r = api.post(CALL, call)
    assert r.status_code == 400
    body = r.json()
    assert body["tool_call_id"] == "call_bad"
    assert tool_error(body)["field"] == "key"


def test_strict_mode_nulls_for_optional_arguments_are_accepted(api):
    status, body = api.call(
        "memory_write", key="user:u1:x", value="v", ttl_seconds=None, tags=None, subject=None, category=None
    )
    assert status == 200 and body["created"] is True


def test_unknown_tool_is_400_naming_the_field(api):
    before = row_counts()
    status, body = api.call("memory_explode", key="user:u1:x")
    assert status == 400
    error = tool_error(body)
    assert error["code"] == "unknown_tool" and error["field"] == "name"
    assert row_counts() == before


def test_unknown_argument_is_400_naming_it(api):
    before = row_counts()
    status, body = api.call("memory_write", key="user:u1:x", value="v", colour="red")
    assert status == 400
    error = tool_error(body)
    assert error["code"] == "unknown_argument" and error["field"] == "colour"
    assert row_counts() == before


def test_an_unknown_argument_with_a_huge_name_is_named_by_its_first_64_characters(api):
    # The name goes into the answer (twice) and the audit event: a 900 KB name must not.
    name = "colour" + "x" * 900_000
    status, body = api.call("memory_read", key="user:u1:x", **{name: 1})
    assert status == 400
    error = tool_error(body)
    assert (error["code"], error["field"]) == ("unknown_argument", name[:64])
    assert len(json.dumps(body)) < 1000
    event = AuditEvent.objects.filter(action="tool.call").latest("id")
    assert event.outcome == "invalid" and event.detail["field"] == name[:64]


@pytest.mark.parametrize(
    "name,arguments,field",
    [
        ("memory_write", {"key": "user:u1:x"}, "value"),
        ("memory_write", {"value": "v"}, "key"),
        ("memory_read", {}, "key"),
        ("memory_update", {"key": "user:u1:x"}, "value"),
        ("memory_delete", {}, "key"),
        ("memory_search", {}, "query"),
    ],
)
def test_missing_required_argument_is_400_naming_it(api, name, arguments, field):
    before = row_counts()
    r = api.post(CALL, {"name": name, "arguments": arguments})
    assert r.status_code == 400
    error = tool_error(r.json())
    assert error["code"] == "required" and error["field"] == field
    assert row_counts() == before


REQUIRED = {
    "memory_write": {"key": "user:u1:k", "value": "v"},
    "memory_read": {"key": "user:u1:k"},
    "memory_update": {"key": "user:u1:k", "value": "new"},
    "memory_search": {"query": "v"},
    "memory_summarize": {"prefix": "user:u1:"},
}
INTEGER_ARGUMENTS = [
    (tool.name, p.name, p.schema["minimum"])
    for tool in tools.TOOLS.values()
    for p in tool.params
    if p.schema.get("type") == "integer"
]


def test_every_integer_argument_is_covered():
    assert {(t, a) for t, a, _ in INTEGER_ARGUMENTS} == {
        ("memory_write", "ttl_seconds"),
        ("memory_read", "max_chars"),
        ("memory_read", "offset"),
        ("memory_update", "expected_version"),
        ("memory_list", "limit"),
        ("memory_search", "limit"),
        ("memory_search", "max_chars"),
        ("memory_recall", "max_chars"),
    }


@pytest.mark.parametrize(("tool", "argument", "low"), INTEGER_ARGUMENTS)
@pytest.mark.parametrize("spelt", [str, float], ids=["string", "float"])
def test_an_integer_argument_is_a_json_integer_not_a_numeric_string(api, tool, argument, low, spelt):
    """The schema says "integer" and REST bodies refuse "10" (StrictIntegerField): a tool call
    took "10" for limit, max_chars, offset and expected_version (ttl_seconds refused it)."""
    api.call("memory_write", key="user:u1:k", value="v")
    before = row_counts()
    status, body = api.call(tool, **{**REQUIRED.get(tool, {}), argument: spelt(max(low, 1))})
    error = tool_error(body)
    assert (status, error["field"]) == (400, argument), body
    assert "integer" in error["message"]
    assert row_counts() == before
    assert Memory.objects.get(tenant=api.tenant, key="user:u1:k").value == "v"
    status, body = api.call(tool, **{**REQUIRED.get(tool, {}), argument: max(low, 1)})
    assert status == 200 and body["status"] == "ok", body


def test_malformed_arguments_json_is_400(api):
    r = api.post(CALL, {"name": "memory_write", "arguments": '{"key": "user:u1:x", "value": '})
    assert r.status_code == 400
    error = tool_error(r.json())
    assert error["code"] == "malformed_json" and error["field"] == "arguments"


def test_malformed_arguments_json_in_openai_shape_names_function_arguments(api):
    r = api.post(CALL, {"id": "c1", "type": "function", "function": {"name": "memory_read", "arguments": "{key"}})
    assert r.status_code == 400
    body = r.json()
    assert tool_error(body)["field"] == "function.arguments"
    assert body["tool_call_id"] == "c1"


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("[" * 100_000 + "]" * 100_000, id="nested-past-the-recursion-limit"),
        pytest.param("1" * 5000, id="integer-of-5000-digits"),
    ],
)
def test_arguments_json_string_the_parser_cannot_read_is_400_naming_arguments(api, value):
    before = row_counts()
    r = api.post(CALL, {"name": "memory_write", "arguments": '{"key": "user:u1:x", "value": ' + value + "}"})
    assert r.status_code == 400, r.content[:300]
    error = tool_error(r.json())
    assert error["code"] == "malformed_json" and error["field"] == "arguments", error
    assert row_counts() == before


def test_batch_call_with_arguments_json_nested_past_the_recursion_limit_fails_alone_as_malformed(api):
    deep = '{"key": "user:u1:y", "value": ' + "[" * 100_000 + "]" * 100_000 + "}"
    calls = [
        {"name": "memory_write", "arguments": {"key": "user:u1:x", "value": 1}},
        {"name": "memory_write", "arguments": deep},
    ]
    r = api.post(BATCH, {"calls": calls})
    assert r.status_code == 200
    ok, refused = r.json()["results"]
    assert ok["status"] == "ok"
    assert tool_error(refused)["code"] == "malformed_json" and refused["error"]["field"] == "arguments"
    assert not Memory.objects.filter(key="user:u1:y").exists()


def test_arguments_that_are_not_an_object_are_400(api):
    r = api.post(CALL, {"name": "memory_read", "arguments": '["user:u1:x"]'})
    assert r.status_code == 400
    assert tool_error(r.json())["field"] == "arguments"


def test_missing_tool_name_is_400(api):
    r = api.post(CALL, {"arguments": {"key": "user:u1:x"}})
    assert r.status_code == 400
    error = tool_error(r.json())
    assert error["code"] == "required" and error["field"] == "name"


def test_body_that_is_not_an_object_is_400(api):
    r = api.post(CALL, ["memory_read"])
    assert r.status_code == 400
    assert tool_error(r.json())["field"] == "body"


# --- batch ------------------------------------------------------------------------------


def test_batch_runs_several_calls_in_order(api):
    r = api.post(
        BATCH,
        {
            "calls": [
                {"name": "memory_write", "arguments": {"key": "user:u1:a", "value": 1}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "memory_write", "arguments": '{"key": "user:u1:b", "value": 2}'},
                },
                {"name": "memory_read", "arguments": {"key": "user:u1:a"}},
                {"name": "memory_list", "arguments": {"prefix": "user:u1:"}},
            ]
        },
    )
    assert r.status_code == 200
    results = r.json()["results"]
    assert len(results) == 4
    assert results[0] == {"status": "ok", "key": "user:u1:a", "version": 1, "created": True}
    assert results[1]["tool_call_id"] == "c2" and results[1]["created"] is True
    assert results[2]["value"] == 1
    assert results[3]["keys"] == ["user:u1:a", "user:u1:b"]


def test_batch_bad_call_does_not_undo_the_others(api):
    r = api.post(
        BATCH,
        {
            "calls": [
                {"name": "memory_write", "arguments": {"key": "user:u1:a", "value": 1}},
                {"name": "memory_write", "arguments": {"key": "bad::key", "value": 2}},
                {"name": "no_such_tool", "arguments": {}},
                {"name": "memory_write", "arguments": {"key": "user:u1:c", "value": "x" * 20000}},
                {"name": "memory_write", "arguments": {"key": "user:u1:d", "value": 4}},
            ]
        },
    )
    assert r.status_code == 200
    results = r.json()["results"]
    assert [res["status"] for res in results] == ["ok", "error", "error", "error", "ok"]
    assert results[1]["error"]["field"] == "key"
    assert results[2]["error"]["code"] == "unknown_tool"
    assert results[3]["error"]["code"] == "too_large"
    assert sorted(Memory.objects.filter(tenant=api.tenant).values_list("key", flat=True)) == ["user:u1:a", "user:u1:d"]


def test_batch_of_more_than_50_calls_is_400_and_runs_none(api):
    calls = [{"name": "memory_write", "arguments": {"key": f"user:u1:k{i}", "value": i}} for i in range(51)]
    before = row_counts()
    r = api.post(BATCH, {"calls": calls})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["field"] == "calls" and error["code"] == "too_many"
    assert row_counts() == before


def test_batch_of_exactly_50_calls_runs_them_all(api):
    calls = [{"name": "memory_write", "arguments": {"key": f"user:u1:k{i:02d}", "value": i}} for i in range(50)]
    r = api.post(BATCH, {"calls": calls})
    assert r.status_code == 200
    assert all(res["status"] == "ok" for res in r.json()["results"])
    assert Memory.objects.filter(tenant=api.tenant).count() == 50


@pytest.mark.parametrize("body", [{"calls": []}, {}, {"calls": "memory_read"}])
def test_empty_or_missing_batch_is_400(api, body):
    r = api.post(BATCH, body)
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "calls"


def test_batch_with_an_unknown_top_level_field_is_400_naming_it_and_runs_none(api):
    # As every other closed body (PUT /memories, POST /summaries...): a misspelt option is
    # refused, not silently ignored while the calls run.
    before = row_counts()
    r = api.post(
        BATCH, {"calls": [{"name": "memory_write", "arguments": {"key": "user:u1:a", "value": 1}}], "atomic": True}
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["field"] == "atomic" and error["code"] == "unknown_field"
    assert row_counts() == before
