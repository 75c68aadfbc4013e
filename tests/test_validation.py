"""Bad input: a clear 4xx naming the field at fault, and nothing written."""

import json

import pytest

from memories.models import Memory
from tests.helpers import audit_count, rest_error, row_counts, tool_error
from zeromem.kernel import validation
from zeromem.kernel.errors import InvalidInput

CALL = "/api/v1/tools/call"
BAD_KEYS = [
    pytest.param("a::b", id="empty-segment"),
    pytest.param(":a:b", id="leading-colon"),
    pytest.param("a:b:", id="trailing-colon"),
    pytest.param(":", id="only-colon"),
    pytest.param("", id="empty"),
    pytest.param("user:u1:\x01x", id="control-char"),
    pytest.param("user:u1:a\nb", id="newline"),
    pytest.param("user:u1:a\x00b", id="nul"),
    pytest.param("user:u1:a\x7fb", id="del"),
    pytest.param("user:u1:pref lang", id="space"),
    pytest.param("user:u1:\tx", id="tab"),
    pytest.param(" user:u1:x", id="leading-space"),
    pytest.param("user:u1:x\u3000", id="ideographic-space"),
    pytest.param("user/u1/x", id="slash"),
    pytest.param("user:u1:" + "k" * 505, id="513-chars"),
    pytest.param(42, id="not-a-string"),
    pytest.param(None, id="null"),
]


@pytest.fixture
def existing(api):
    """One memory already there, so 'nothing written' also covers its row and versions."""
    api.call("memory_write", key="user:u1:existing", value="keep me", tags=["t"])
    return api


def assert_refused(status, body, *, field, http=400, code=None):
    assert status == http, body
    error = tool_error(body)
    assert error["field"] == field, error
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error


# --- keys -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", BAD_KEYS)
def test_write_with_bad_key_is_400_naming_key_and_writes_nothing(existing, key):
    before = row_counts()
    status, body = existing.call("memory_write", key=key, value="v")
    assert_refused(status, body, field="key")
    assert row_counts() == before


@pytest.mark.parametrize("key", BAD_KEYS)
def test_read_update_delete_with_bad_key_are_400_naming_key(existing, key):
    before = row_counts()
    for tool, args in [("memory_read", {}), ("memory_update", {"value": "v"}), ("memory_delete", {})]:
        status, body = existing.call(tool, key=key, **args)
        assert status == 400, (tool, body)
        assert tool_error(body)["field"] == "key", tool
    assert row_counts() == before


def test_unknown_argument_with_nul_in_its_name_is_400(existing):
    before = row_counts()
    status, body = existing.call("memory_write", key="user:u1:x", value="v", **{"a\x00b": 1})
    assert_refused(status, body, field="a\x00b", code="unknown_argument")
    assert row_counts() == before


def test_key_of_exactly_512_chars_is_allowed(api):
    key = "user:u1:" + "k" * 504
    assert len(key) == validation.KEY_MAX_LEN
    status, body = api.call("memory_write", key=key, value="v")
    assert status == 200 and body["created"] is True


@pytest.mark.parametrize("key", ["user:张三:偏好", "user:ユーザー:言語", "task:t-1.2@x+y=z~w:status", "single"])
def test_unicode_and_punctuated_keys_are_allowed(api, key):
    status, body = api.call("memory_write", key=key, value="v")
    assert status == 200 and body["key"] == key
    _, body = api.call("memory_read", key=key)
    assert body["status"] == "ok" and body["value"] == "v"


def test_unicode_key_works_over_rest(api):
    r = api.put("/api/v1/memories/user:张三:偏好", {"value": "茶"})
    assert r.status_code == 201
    r = api.get("/api/v1/memories/user:%E5%BC%A0%E4%B8%89:%E5%81%8F%E5%A5%BD")
    assert r.status_code == 200 and r.json()["value"] == "茶"


@pytest.mark.parametrize("path_key", ["a::b", ":a", "a:", "user:u1:a%20b", "user:u1:a%01b", "user:u1:a%00b"])
def test_rest_put_with_bad_key_is_400_naming_key(existing, path_key):
    before = row_counts()
    r = existing.put(f"/api/v1/memories/{path_key}", {"value": "v"})
    assert r.status_code == 400
    assert rest_error(r)["field"] == "key"
    assert row_counts() == before


# --- values -----------------------------------------------------------------------------


def test_value_at_the_size_limit_is_accepted(api):
    value = "x" * (16 * 1024 - 2)  # + 2 quotes = 16 KiB serialized
    status, body = api.call("memory_write", key="user:u1:big", value=value)
    assert status == 200 and body["created"] is True


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("x" * (16 * 1024 - 1), id="one-byte-over"),
        pytest.param("周" * 6000, id="multibyte-utf8-over"),
        pytest.param({"items": ["y" * 1000] * 20}, id="object-over"),
    ],
)
def test_value_over_16_kib_is_413_naming_value_and_writes_nothing(existing, value):
    before = row_counts()
    status, body = existing.call("memory_write", key="user:u1:existing", value=value)
    assert_refused(status, body, field="value", http=413, code="too_large")
    status, body = existing.call("memory_update", key="user:u1:existing", value=value)
    assert_refused(status, body, field="value", http=413, code="too_large")
    assert row_counts() == before
    assert Memory.objects.get(key="user:u1:existing").value == "keep me"


def test_value_over_16_kib_over_rest_is_413(existing):
    before = row_counts()
    r = existing.put("/api/v1/memories/user:u1:existing", {"value": "x" * 17000})
    assert r.status_code == 413
    assert rest_error(r)["field"] == "value"
    r = existing.patch("/api/v1/memories/user:u1:existing", {"value": "x" * 17000})
    assert r.status_code == 413
    assert row_counts() == before


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("a\x00b", id="in-string"),
        pytest.param({"k": ["ok", "b\x00"]}, id="nested"),
        pytest.param({"k\x00": 1}, id="in-object-key"),
    ],
)
def test_nul_in_value_is_400_naming_value_and_writes_nothing(existing, value):
    before = row_counts()
    status, body = existing.call("memory_write", key="user:u1:new", value=value)
    assert_refused(status, body, field="value")
    status, body = existing.call("memory_update", key="user:u1:existing", value=value)
    assert_refused(status, body, field="value")
    assert row_counts() == before


@pytest.mark.parametrize("value", ["\ud800", {"k": ["ok", "b\udfff"]}, {"k\udc00": 1}], ids=["str", "nested", "key"])
def test_a_lone_surrogate_in_a_value_is_refused_naming_value(value):
    # Every surface but the JSON parsers (which refuse it first) hands the services Python
    # values: the admin's form, in-process adapters. Serialising one to UTF-8 was a 500.
    with pytest.raises(InvalidInput) as refused:
        validation.value(value, max_bytes=16384)
    assert refused.value.field == "value" and refused.value.code == "invalid_characters"
    assert "lone surrogate" in refused.value.message


def test_null_value_is_400_naming_value_and_writes_nothing(existing):
    before = row_counts()
    status, body = existing.call("memory_write", key="user:u1:new", value=None)
    assert_refused(status, body, field="value")
    status, body = existing.call("memory_update", key="user:u1:existing", value=None)
    assert_refused(status, body, field="value")
    for r in [
        existing.put("/api/v1/memories/user:u1:new", {"value": None}),
        existing.put("/api/v1/memories/user:u1:existing", {"value": None}),
        existing.patch("/api/v1/memories/user:u1:existing", {"value": None}),
    ]:
        assert r.status_code == 400
        assert rest_error(r)["field"] == "value"
    assert row_counts() == before
    assert Memory.objects.get(key="user:u1:existing").value == "keep me"


def test_null_inside_a_structured_value_is_fine(api):
    status, body = api.call("memory_write", key="user:u1:x", value={"a": None, "b": [None]})
    assert status == 200
    assert api.call("memory_read", key="user:u1:x")[1]["value"] == {"a": None, "b": [None]}


# --- other arguments --------------------------------------------------------------------


@pytest.mark.parametrize(
    "ttl",
    [0, -1, -3600, "60", "soon", 1.5, True, validation.TTL_MAX_SECONDS + 1, 10**30, [60]],
    ids=lambda v: repr(v)[:20],
)
def test_bad_ttl_seconds_is_400_naming_it(existing, ttl):
    before = row_counts()
    status, body = existing.call("memory_write", key="user:u1:existing", value="v", ttl_seconds=ttl)
    assert_refused(status, body, field="ttl_seconds")
    assert row_counts() == before


@pytest.mark.parametrize("ttl", [0, -5, "soon", 1.5, validation.TTL_MAX_SECONDS + 1])
def test_bad_ttl_seconds_over_rest_is_400_naming_it(existing, ttl):
    before = row_counts()
    r = existing.put("/api/v1/memories/user:u1:existing", {"value": "v", "ttl_seconds": ttl})
    assert r.status_code == 400
    assert rest_error(r)["field"] == "ttl_seconds"
    assert row_counts() == before


@pytest.mark.parametrize(
    "tags",
    [
        pytest.param("urgent", id="string"),
        pytest.param({"a": 1}, id="object"),
        pytest.param([1, 2], id="not-strings"),
        pytest.param([f"t{i}" for i in range(21)], id="too-many"),
        pytest.param(["has space"], id="space"),
        pytest.param(["semi;colon"], id="bad-char"),
        pytest.param([""], id="empty-tag"),
        pytest.param(["x" * 65], id="too-long"),
        pytest.param(["ok", "new\nline"], id="control"),
    ],
)
def test_bad_tags_are_400_naming_tags(existing, tags):
    before = row_counts()
    status, body = existing.call("memory_write", key="user:u1:existing", value="v", tags=tags)
    assert_refused(status, body, field="tags")
    assert row_counts() == before
    assert Memory.objects.get(key="user:u1:existing").tags == ["t"]


def test_twenty_tags_are_allowed(api):
    status, body = api.call("memory_write", key="user:u1:x", value="v", tags=[f"t{i}" for i in range(20)])
    assert status == 200


@pytest.mark.parametrize(
    "args,field",
    [
        ({"subject": "a\nb"}, "subject"),
        ({"subject": "s" * 256}, "subject"),
        ({"subject": 5}, "subject"),
        ({"category": "Not Lower"}, "category"),
        ({"category": 3}, "category"),
    ],
)
def test_bad_subject_or_category_is_400_naming_it(existing, args, field):
    before = row_counts()
    status, body = existing.call("memory_write", key="user:u1:existing", value="v", **args)
    assert_refused(status, body, field=field)
    assert row_counts() == before


BLANK_SUBJECTS = [" ", "   ", "\u3000", "\u00a0\u2003"]  # ASCII, ideographic, no-break, em spaces


@pytest.mark.parametrize("subject", BLANK_SUBJECTS)
def test_a_whitespace_only_subject_is_refused_on_a_write_naming_subject(existing, subject):
    """A subject names the end user a forget request finds by it: one of only whitespace named
    nobody, and a forget by the subject the client meant found nothing."""
    before = row_counts()
    status, body = existing.call("memory_write", key="user:u1:existing", value="v", subject=subject)
    assert_refused(status, body, field="subject")
    r = existing.put("/api/v1/memories/note:n1:x", {"value": "v", "subject": subject})
    assert r.status_code == 400 and rest_error(r)["field"] == "subject", r.content
    assert row_counts() == before
    assert Memory.objects.get(key="user:u1:existing").subject == "u1"


def test_a_subject_with_inner_spaces_and_an_empty_one_are_still_written(existing):
    status, _ = existing.call("memory_write", key="note:n1:x", value="v", subject="Jane Doe")
    assert status == 200 and Memory.objects.get(key="note:n1:x").subject == "Jane Doe"
    status, _ = existing.call("memory_write", key="note:n1:x", value="v", subject="")
    assert status == 200 and Memory.objects.get(key="note:n1:x").subject == ""


@pytest.mark.parametrize("expected", [0, -1, "one"])
def test_bad_expected_version_is_400(existing, expected):
    before = row_counts()
    status, body = existing.call("memory_update", key="user:u1:existing", value="v", expected_version=expected)
    assert_refused(status, body, field="expected_version")
    assert row_counts() == before


@pytest.mark.parametrize("limit", [0, 201, -1, "many", 2.5])
@pytest.mark.parametrize("tool,extra", [("memory_list", {}), ("memory_search", {"query": "x"})])
def test_bad_limit_is_400_naming_limit(existing, tool, extra, limit):
    status, body = existing.call(tool, limit=limit, **extra)
    assert_refused(status, body, field="limit")


@pytest.mark.parametrize("limit", ["0", "201", "abc"])
def test_bad_limit_over_rest_is_400_naming_limit(existing, limit):
    r = existing.get("/api/v1/memories", {"limit": limit})
    assert r.status_code == 400
    assert rest_error(r)["field"] == "limit"


@pytest.mark.parametrize("max_chars", [0, 49, 8001, "lots"])
def test_bad_max_chars_is_400(existing, max_chars):
    status, body = existing.call("memory_recall", query="x", max_chars=max_chars)
    assert_refused(status, body, field="max_chars")


@pytest.mark.parametrize("query", ["", "   ", 7, "q" * 501])
def test_bad_query_is_400_naming_query(existing, query):
    status, body = existing.call("memory_search", query=query)
    assert_refused(status, body, field="query")


@pytest.mark.parametrize("prefix", ["a::", "user u1", "user/", 5])
def test_bad_prefix_is_400_naming_prefix(existing, prefix):
    status, body = existing.call("memory_list", prefix=prefix)
    assert_refused(status, body, field="prefix")


@pytest.mark.parametrize(
    "cursor",
    [
        pytest.param("!!!not base64!!!", id="garbage"),
        pytest.param("YTo6Yg", id="base64-of-a-bad-key"),  # "a::b"
        pytest.param("//8", id="not-utf8"),
        pytest.param("c" * 2000, id="too-long"),
        pytest.param(12, id="number"),
    ],
)
def test_bad_cursor_is_400_naming_cursor(existing, cursor):
    status, body = existing.call("memory_list", cursor=cursor)
    assert_refused(status, body, field="cursor", code="invalid_cursor")
    r = existing.get("/api/v1/memories", {"cursor": str(cursor)})
    assert r.status_code == 400
    assert rest_error(r)["field"] == "cursor"


# --- bodies -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CALL, "/api/v1/tools/batch"])
@pytest.mark.parametrize("raw", ['{"name": "memory_write", "arguments": {', "not json at all", "\x00"])
def test_non_json_body_is_400_naming_body(existing, path, raw):
    before = row_counts()
    r = existing.post(path, raw=raw)
    assert r.status_code == 400
    error = rest_error(r)
    assert error["code"] == "malformed_json"
    assert error["field"] == "body"
    assert row_counts() == before


def test_non_json_body_on_rest_put_is_400_naming_body(existing):
    before = row_counts()
    r = existing.client.put(
        "/api/v1/memories/user:u1:existing",
        "{value",
        content_type="application/json",
        headers={"Authorization": f"Bearer {existing.raw_key}"},
    )
    assert r.status_code == 400
    assert rest_error(r)["field"] == "body"
    assert row_counts() == before


def test_rest_put_with_unknown_field_is_400_naming_it(existing):
    before = row_counts()
    r = existing.put("/api/v1/memories/user:u1:existing", {"value": "v", "colour": "red"})
    assert r.status_code == 400
    assert rest_error(r)["field"] == "colour"
    assert row_counts() == before


def test_rest_put_without_value_is_400_naming_value(existing):
    r = existing.put("/api/v1/memories/user:u1:existing", {"tags": ["x"]})
    assert r.status_code == 400
    assert rest_error(r)["field"] == "value"


def test_body_over_max_body_bytes_is_413(existing, settings):
    settings.ZEROMEM_MAX_BODY_BYTES = 2000
    before = row_counts()
    raw = json.dumps({"name": "memory_write", "arguments": {"key": "user:u1:big", "value": "x" * 3000}})
    r = existing.post(CALL, raw=raw)
    assert r.status_code == 413
    error = rest_error(r)
    assert error["code"] == "too_large" and error["field"] == "body"
    assert r.headers["X-Request-ID"]
    assert row_counts() == before
    # A body under the cap still goes through.
    status, _ = existing.call("memory_write", key="user:u1:small", value="x")
    assert status == 200


def test_body_over_default_cap_is_413(existing, settings):
    raw = json.dumps({"name": "memory_write", "arguments": {"key": "user:u1:big", "value": "x" * 100}})
    raw = raw + " " * (settings.ZEROMEM_MAX_BODY_BYTES + 1 - len(raw))
    before = row_counts()
    r = existing.post(CALL, raw=raw)
    assert r.status_code == 413
    assert row_counts() == before


def test_batch_body_over_cap_is_413(existing, settings):
    settings.ZEROMEM_MAX_BODY_BYTES = 5000
    calls = [{"name": "memory_write", "arguments": {"key": f"user:u1:k{i}", "value": "y" * 500}} for i in range(20)]
    before = row_counts()
    r = existing.post("/api/v1/tools/batch", {"calls": calls})
    assert r.status_code == 413
    assert row_counts() == before


def _strict_json(content: bytes):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(content, parse_constant=refuse)


@pytest.mark.parametrize(
    ("arguments", "name"),
    [
        ('{"key": "a:b", "value": NaN}', "NaN"),
        ('{"key": "a:b", "value": {"x": [-Infinity]}}', "-Infinity"),
        ('{"key": "a:b", "value": "v", "ttl_seconds": Infinity}', "Infinity"),
        ('{"key": "a:b", "value": 1e999}', "1e999"),
    ],
)
def test_nan_or_infinity_in_string_arguments_is_400_naming_arguments(existing, arguments, name):
    before = row_counts()
    r = existing.post("/api/v1/tools/call", {"name": "memory_write", "arguments": arguments})
    assert r.status_code == 400
    body = _strict_json(r.content)  # the answer itself stays valid JSON
    assert (body["error"]["code"], body["error"]["field"]) == ("malformed_json", "arguments")
    assert name in body["error"]["message"]
    assert row_counts() == before


@pytest.mark.parametrize("body", ['{"value": NaN}', '{"value": 1e999}', '{"value": "v", "importance": Infinity}'])
def test_nan_or_infinity_over_rest_is_400_and_valid_json(existing, body):
    r = existing.client.put(
        "/api/v1/memories/a:b", body, content_type="application/json", headers=existing._headers(None)
    )
    assert r.status_code == 400
    assert _strict_json(r.content)["error"]["field"] in ("body", "value", "importance")


def test_the_renderer_never_writes_nan_into_an_answer():
    from zeromem.renderers import CompactJSONRenderer

    with pytest.raises(ValueError):
        CompactJSONRenderer().render({"score": float("nan")})


# --- lone surrogates ----------------------------------------------------------------------
# JSON can spell half of a UTF-16 pair alone ("\ud800"); no UTF-8 text (PostgreSQL, the audit
# chain, the answer) can hold it. The raw bodies below spell it as a client would send it.

LONE = "\\ud800"


@pytest.mark.parametrize(
    "arguments, field",
    [
        ('{"key": "user:u1:x", "value": "a' + LONE + 'b"}', "arguments.value"),
        ('{"key": "user:u1:x", "value": {"k": ["ok", "' + LONE + '"]}}', "arguments.value.k.1"),
        ('{"key": "user:u1:x", "value": {"' + LONE + '": 1}}', "arguments.value"),
        ('{"key": "user:u1:' + LONE + '", "value": "v"}', "arguments.key"),
        ('{"key": "user:u1:x", "value": "v", "subject": "\\udc00"}', "arguments.subject"),
        ('{"key": "user:u1:x", "value": "v", "tags": ["' + LONE + '"]}', "arguments.tags.0"),
        ('{"key": "user:u1:x", "value": "v", "' + LONE + '": 1}', "arguments"),
    ],
    ids=["value", "nested-value", "key-in-value", "key", "subject", "tag", "argument-name"],
)
def test_lone_surrogate_in_a_tool_call_is_400_naming_where_and_writes_nothing(existing, arguments, field):
    before, events = row_counts(), audit_count()
    r = existing.post(CALL, raw='{"name": "memory_write", "arguments": ' + arguments + "}")
    assert r.status_code == 400, r.content
    error = rest_error(r)
    assert (error["code"], error["field"]) == ("invalid_characters", field), error
    assert row_counts() == before
    assert audit_count() == events + 1  # the refusal, recorded once


@pytest.mark.parametrize("tool", ["memory_read", "memory_list", "memory_search", "memory_summarize"])
def test_lone_surrogate_in_a_read_or_prefix_argument_is_400(existing, tool):
    arguments = {
        "memory_read": '{"key": "user:u1:existing", "default": "' + LONE + '"}',
        "memory_list": '{"prefix": "user:' + LONE + '"}',
        "memory_search": '{"query": "hello ' + LONE + '"}',
        "memory_summarize": '{"prefix": "user:' + LONE + '"}',
    }[tool]
    r = existing.post(CALL, raw='{"name": "' + tool + '", "arguments": ' + arguments + "}")
    assert r.status_code == 400, r.content
    assert rest_error(r)["code"] == "invalid_characters"


def test_lone_surrogate_in_arguments_sent_as_a_json_string_is_400_naming_where(existing):
    before = row_counts()
    arguments = '{"key": "user:u1:x", "value": "' + LONE + '"}'
    r = existing.post(
        CALL, {"id": "c1", "type": "function", "function": {"name": "memory_write", "arguments": arguments}}
    )
    assert r.status_code == 400, r.content
    body = r.json()
    error = tool_error(body)
    assert (error["code"], error["field"]) == ("invalid_characters", "function.arguments.value"), error
    assert body["tool_call_id"] == "c1"
    assert row_counts() == before


def test_lone_surrogate_in_one_call_of_a_batch_refuses_the_batch_and_runs_none(existing):
    before = row_counts()
    calls = (
        '[{"name": "memory_write", "arguments": {"key": "user:u1:a", "value": 1}},'
        ' {"name": "memory_write", "arguments": {"key": "user:u1:b", "value": "' + LONE + '"}}]'
    )
    r = existing.post("/api/v1/tools/batch", raw='{"calls": ' + calls + "}")
    assert r.status_code == 400, r.content
    assert rest_error(r)["field"] == "calls.1.arguments.value"
    assert row_counts() == before


@pytest.mark.parametrize(
    "path, raw, field",
    [
        ("/api/v1/memories/user:u1:x", '{"value": "' + LONE + '"}', "value"),
        ("/api/v1/memories/user:u1:x", '{"value": "v", "subject": "' + LONE + '"}', "subject"),
        ("/api/v1/memories/user:u1:x", '"' + LONE + '"', "body"),
    ],
)
def test_lone_surrogate_over_rest_is_400_naming_the_field(existing, path, raw, field):
    before = row_counts()
    r = existing.client.put(path, raw, content_type="application/json", headers=existing._headers(None))
    assert r.status_code == 400, r.content
    assert (rest_error(r)["code"], rest_error(r)["field"]) == ("invalid_characters", field)
    assert row_counts() == before


def test_lone_surrogate_in_a_utf7_body_is_400(existing):
    # UTF-7 spells U+D800 without a JSON escape: "+2AA-".
    before = row_counts()
    r = existing.client.put(
        "/api/v1/memories/user:u1:x",
        b'{"value": "+2AA-"}',
        content_type="application/json; charset=utf-7",
        headers=existing._headers(None),
    )
    assert r.status_code == 400, r.content
    assert rest_error(r)["field"] == "value"
    assert row_counts() == before


def test_a_surrogate_pair_escape_is_the_character_it_spells(api):
    # "\ud83d\ude00" is 😀 as Python's json.dumps writes it: fine, and read back as the character.
    r = api.post(CALL, raw='{"name": "memory_write", "arguments": {"key": "user:u1:x", "value": "\\ud83d\\ude00"}}')
    assert r.status_code == 200, r.content
    status, body = api.call("memory_read", key="user:u1:x")
    assert body["value"] == "😀"


# --- numbers past a double --------------------------------------------------------------------


@pytest.mark.parametrize(
    "number", ["1e400", "-1e400", "1E+0309", "9" * 210 + "e99", "1" + "0" * 309 + ".5"], ids=lambda n: n[:12]
)
def test_a_number_past_a_doubles_range_is_400_malformed_json(existing, number):
    # memory_read echoes its default: inf could not be rendered (a 500).
    raw = '{"name": "memory_read", "arguments": {"key": "user:u1:nope", "default": ' + number + "}}"
    r = existing.post(CALL, raw=raw)
    assert r.status_code == 400, r.content[:300]
    assert (rest_error(r)["code"], rest_error(r)["field"]) == ("malformed_json", "body")
    assert number[:12] in rest_error(r)["message"]


def test_a_batch_with_a_number_past_a_doubles_range_runs_none_of_its_calls(existing):
    before = row_counts()
    raw = (
        '{"calls": [{"name": "memory_write", "arguments": {"key": "user:u1:a", "value": 1}},'
        ' {"name": "memory_read", "arguments": {"key": "user:u1:nope", "default": 1e400}}]}'
    )
    r = existing.post("/api/v1/tools/batch", raw=raw)
    assert r.status_code == 400, r.content[:300]
    assert row_counts() == before


def test_large_finite_numbers_are_kept(api):
    raw = (
        '{"name": "memory_write", "arguments": {"key": "user:u1:x", "value": [1e308, -1.5e-400, ' + "9" * 209 + "e99]}}"
    )
    r = api.post(CALL, raw=raw)
    assert r.status_code == 200, r.content
    assert [float(n) for n in api.call("memory_read", key="user:u1:x")[1]["value"]] == [1e308, 0.0, 1e308]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("tool", "arguments", "field"),
    [
        ("memory_write", {"key": "user:u1:\ud800", "value": "v"}, "key"),
        ("memory_read", {"key": "user:\udfff"}, "key"),
        ("memory_delete", {"key": "user:\udfff"}, "key"),
        ("memory_list", {"prefix": "user:\ud800"}, "prefix"),
        ("memory_search", {"query": "hello \ud800"}, "query"),
    ],
    ids=["write-key", "read-key", "delete-key", "list-prefix", "search-query"],
)
def test_a_lone_surrogate_handed_to_a_service_is_refused_naming_the_field_and_recorded(tool, arguments, field):
    # The services are handed Python values by surfaces whose JSON parser reads "\ud800" (the
    # MCP SDK's 2026-07-28 path, in-process adapters): recording the refused key in the audit
    # log failed to encode it (UnicodeEncodeError: an MCP "internal_error" with a traceback in
    # the log; a 500 elsewhere), and a search ran with it (its semantic half skipped).
    from audit.models import AuditEvent
    from memories import tools
    from tests.factories import SYSTEM, make_tenant

    tenant = make_tenant("surrogate-service")
    events = AuditEvent.objects.filter(tenant=tenant).count()
    answer = tools.tool_call(tenant=tenant, actor=SYSTEM, call={"name": tool, "arguments": arguments})
    assert answer.http_status == 400 and answer.result["error"]["field"] == field, answer.result
    assert not Memory.objects.filter(tenant=tenant).exists()
    if tool != "memory_search":  # a refused write, read, list or delete is in the log
        assert AuditEvent.objects.filter(tenant=tenant).count() == events + 1
