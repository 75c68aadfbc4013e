"""Numbers, cursors and dates are ASCII. Python's str.isdigit() is true for "²" and "①"
(which int() then refuses) and int() reads full-width "１２" as 12: each of these used to
be a 500 (unaudited) or a silently accepted value. Every parse answers 400 naming the field."""

import pytest

from audit.models import AuditEvent
from memories.models import Memory
from tests.helpers import rest_error, tool_error
from zeromem.kernel import validation

# "²" superscript, "①" circled, "１２" full-width, "٣" Arabic-Indic, "߁" NKo.
NON_ASCII_NUMBERS = ["²", "①", "１２", "٣", "1߁"]
# Cursors whose decoded text is "²" ("wrI") or a full-width "１２" (an id cursor).
NON_ASCII_CURSORS = ["wrI", validation.encode_cursor("１２")]


@pytest.mark.parametrize("raw", NON_ASCII_NUMBERS)
def test_ascii_int_refuses_non_ascii_digits(raw):
    assert validation.ascii_int(raw) is None
    assert validation.ascii_int(" 12 ") == 12
    assert validation.ascii_int("-3") == -3


LISTS = ["/api/v1/memories", "/api/v1/memories/user:u1:a/history", "/api/v1/audit-events", "/api/v1/forget-requests"]


@pytest.mark.parametrize("raw", NON_ASCII_NUMBERS)
@pytest.mark.parametrize("path", LISTS)
def test_non_ascii_limit_over_rest_is_400_naming_limit(api, path, raw):
    api.call("memory_write", key="user:u1:a", value="v")
    r = api.get(path, {"limit": raw})
    assert r.status_code == 400, r.content
    assert rest_error(r)["field"] == "limit"


@pytest.mark.parametrize("raw", NON_ASCII_NUMBERS)
@pytest.mark.parametrize(
    "tool,arguments,field",
    [
        ("memory_list", {}, "limit"),
        ("memory_search", {"query": "x"}, "limit"),
        ("memory_recall", {"query": "x"}, "max_chars"),
    ],
)
def test_non_ascii_number_in_a_tool_call_is_400_naming_it(api, tool, arguments, field, raw):
    status, body = api.call(tool, **{**arguments, field: raw})
    assert status == 400, body
    assert tool_error(body)["field"] == field


@pytest.mark.parametrize("cursor", NON_ASCII_CURSORS)
@pytest.mark.parametrize("path", ["/api/v1/audit-events", "/api/v1/forget-requests"])
def test_non_ascii_id_cursor_is_400_naming_cursor(api, path, cursor):
    r = api.get(path, {"cursor": cursor})
    assert r.status_code == 400, r.content
    assert rest_error(r) | {"message": ""} == {"code": "invalid_cursor", "field": "cursor", "message": ""}


@pytest.mark.parametrize("raw", ["２０２６-01-01T00:00:00Z", "2026-0²-01T00:00:00Z", "2026-01-01T00:00:00+0①:00"])
def test_non_ascii_date_in_audit_filters_is_400_naming_it(api, raw):
    r = api.get("/api/v1/audit-events", {"since": raw})
    assert r.status_code == 400, r.content
    assert rest_error(r)["field"] == "since"


@pytest.mark.parametrize("raw", ['"１-１"', '"²-1"'])
def test_non_ascii_etag_never_matches(api, raw):
    api.call("memory_write", key="user:u1:a", value="v")
    r = api.put("/api/v1/memories/user:u1:a", {"value": "w"}, headers={"If-Match": raw})
    assert r.status_code == 412, r.content


def test_non_ascii_content_length_is_not_a_500(api):
    r = api.client.post("/api/v1/tools/call", "{}", content_type="application/json", CONTENT_LENGTH="²")
    assert r.status_code < 500


def test_a_batch_call_that_fails_unexpectedly_is_its_own_result(api, monkeypatch):
    """The first write commits; the second call blows up inside the service: the batch still
    answers 200 with the first result and an error for the second, never a 500."""
    from memories import services

    real = services.memory_write

    def flaky(*args, **kwargs):
        if kwargs.get("key") == "user:u1:boom":
            raise RuntimeError("a bug")
        return real(*args, **kwargs)

    monkeypatch.setattr(services, "memory_write", flaky)
    calls = [
        {"name": "memory_write", "arguments": {"key": "user:u1:ok", "value": 1}},
        {"id": "call_2", "name": "memory_write", "arguments": {"key": "user:u1:boom", "value": 2}},
        {"name": "memory_write", "arguments": {"key": "user:u1:after", "value": 3}},
    ]
    r = api.post("/api/v1/tools/batch", {"calls": calls})
    assert r.status_code == 200, r.content
    results = r.json()["results"]
    assert [x["status"] for x in results] == ["ok", "error", "ok"]
    assert results[1]["error"]["code"] == "internal_error" and results[1]["tool_call_id"] == "call_2"
    assert set(Memory.objects.values_list("key", flat=True)) == {"user:u1:ok", "user:u1:after"}
    assert AuditEvent.objects.filter(action="memory.write").count() == 2
