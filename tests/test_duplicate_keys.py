"""A JSON object with a repeated member name is refused on every surface that parses JSON.

Python's json (and pydantic's) keep the last value of a repeated name; a proxy, a WAF or an
audit of the raw body may keep the first: ``{"name": "memory_read", "name": "memory_delete"}``
read as a read there was a delete here. Each body below is sent as a client could send it,
raw; each is a 400 naming the repeated member, and nothing is written.
"""

import pytest

from memories.models import Memory
from tests.helpers import rest_error, row_counts
from zeromem.kernel import validation

CALL = "/api/v1/tools/call"


@pytest.fixture
def existing(api):
    api.call("memory_write", key="user:u1:existing", value="keep me")
    return api


def _refused(r, field):
    assert r.status_code == 400, r.content
    error = rest_error(r)
    assert (error["code"], error["field"]) == ("duplicate_key", field), error
    assert repr(field.rsplit(".", 1)[-1]) in error["message"], error
    return error


def test_a_repeated_tool_name_is_400_and_deletes_nothing(existing):
    before = row_counts()
    raw = '{"name": "memory_read", "name": "memory_delete", "arguments": {"key": "user:u1:existing"}}'
    _refused(existing.post(CALL, raw=raw), "name")
    assert row_counts() == before
    assert Memory.objects.get(key="user:u1:existing").deleted_at is None


@pytest.mark.parametrize(
    "raw, field",
    [
        (
            '{"name": "memory_write", "arguments": {"key": "user:u1:a", "key": "user:u1:b", "value": 1}}',
            "arguments.key",
        ),
        ('{"name": "memory_write", "arguments": {"key": "user:u1:a", "value": {"x": 1, "x": 2}}}', "arguments.value.x"),
        (
            '{"name": "memory_write", "arguments": {"key": "user:u1:a", "value": [0, {"y": 1, "y": 1}]}}',
            "arguments.value.1.y",
        ),
    ],
    ids=["argument", "in-value", "in-list"],
)
def test_a_repeated_member_in_a_tool_calls_arguments_is_400_naming_its_path(existing, raw, field):
    before = row_counts()
    _refused(existing.post(CALL, raw=raw), field)
    assert row_counts() == before


def test_a_repeated_member_in_arguments_sent_as_a_json_string_is_400(existing):
    before = row_counts()
    arguments = '{"key": "user:u1:existing", "key": "user:u1:other"}'
    body = {"id": "c1", "type": "function", "function": {"name": "memory_delete", "arguments": arguments}}
    r = existing.post(CALL, body)
    _refused(r, "function.arguments.key")
    assert r.json()["tool_call_id"] == "c1"
    assert row_counts() == before
    assert Memory.objects.get(key="user:u1:existing").deleted_at is None


def test_a_repeated_member_in_one_call_of_a_batch_runs_none(existing):
    before = row_counts()
    raw = (
        '{"calls": [{"name": "memory_write", "arguments": {"key": "user:u1:a", "value": 1}},'
        ' {"name": "memory_write", "arguments": {"key": "user:u1:b", "value": 1, "value": 2}}]}'
    )
    _refused(existing.post("/api/v1/tools/batch", raw=raw), "calls.1.arguments.value")
    assert row_counts() == before


def test_a_repeated_member_over_rest_is_400(existing):
    before = row_counts()
    r = existing.client.put(
        "/api/v1/memories/user:u1:existing",
        '{"value": "a", "value": "b"}',
        content_type="application/json",
        headers=existing._headers(None),
    )
    _refused(r, "value")
    assert row_counts() == before
    assert Memory.objects.get(key="user:u1:existing").version == 1


def test_a_repeated_member_on_the_langgraph_store_is_400(existing):
    before = row_counts()
    raw = '{"namespace": ["a"], "key": "k", "key": "j", "value": {"v": 1}}'
    r = existing.client.put(
        "/api/v1/langgraph/store/items", raw, content_type="application/json", headers=existing._headers(None)
    )
    _refused(r, "key")
    _refused(existing.post("/api/v1/langgraph/store/items/search", raw='{"filter": {"a": 1, "a": 2}}'), "filter.a")
    assert row_counts() == before


def test_a_repeated_member_on_the_claude_memory_tool_is_400(existing):
    before = row_counts()
    raw = '{"command": "view", "command": "delete", "path": "/memories"}'
    _refused(existing.post("/api/v1/anthropic/memory", raw=raw), "command")
    assert row_counts() == before


def test_the_same_member_in_separate_objects_is_no_repeat(existing):
    raw = '{"calls": [{"name": "memory_list", "arguments": {}}, {"name": "memory_list", "arguments": {}}]}'
    assert existing.post("/api/v1/tools/batch", raw=raw).status_code == 200


def test_duplicate_key_field_names_the_outermost_repeat_first():
    assert validation.duplicate_key_field('{"a": {"b": 1, "b": 2}, "c": 1}') == "a.b"
    assert validation.duplicate_key_field('{"a": {"b": 1, "b": 2}, "c": 1, "c": 2}') == "c"  # the outermost
    assert validation.duplicate_key_field('{"a": 1}') is None
    assert validation.duplicate_key_field('[{"x": 1, "x": 1}]') == "0.x"
    assert validation.duplicate_key_field('{"x": 1, "x": 1}', prefix="arguments") == "arguments.x"
    assert validation.duplicate_key_field("{not json") is None  # the parser's own error, not this
