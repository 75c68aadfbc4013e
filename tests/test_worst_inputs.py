"""The worst value of an input, on the machine-facing surfaces (REST, the tool endpoints):
what it costs (time, memory, rows) and that it is refused the way every bad input is — a
4xx naming the field, in the error envelope, nothing written beyond the refusal's event."""

import dataclasses
import time

import pytest

from audit.models import AuditEvent
from memories.models import ForgetRequest, Job, Memory
from tests.helpers import rest_error, row_counts, tool_error
from zeromem.kernel import validation
from zeromem.kernel.errors import InvalidInput

CALL = "/api/v1/tools/call"

# --- a prefix that fails at its end ------------------------------------------------------------

# Letters and then one character no prefix holds. The prefix rule read "(?:SEGMENT:?)+",
# which splits a run of letters into segments every possible way before it refuses: 24 letters
# took 0.9 s of CPU here, and each letter more doubled it (40: hours; a prefix may have 512).
# `re` holds the GIL while it runs, so such a request stalled every thread of its process.
# 26 letters (~3.5 s before) keep a failing run short; after, the refusal takes microseconds.
BACKTRACKING_PREFIX = "a" * 26 + "!"
WORST_PREFIXES = ["a" * 511 + "!", "a:" * 255 + "!", ("a" * 100 + ":") * 5 + "!", "a" * 511 + " "]
FAST = 0.5  # seconds of this process's CPU for a whole request (wall time swings with the machine's load)


def test_a_prefix_rule_check_takes_no_time_whatever_the_prefix():
    started = time.process_time()
    for prefix in [BACKTRACKING_PREFIX, *WORST_PREFIXES]:
        with pytest.raises(InvalidInput) as refused:
            validation.prefix(prefix)
        assert refused.value.field == "prefix"
    assert time.process_time() - started < FAST


def test_the_prefix_rule_still_takes_what_it_took():
    for good in ["user", "user:", "user:u1", "user:u1:", "user:u1:pref_l", "用户:张三:", "a.b@c+d=e~f-g:h_i"]:
        assert validation.prefix(good) == good
    for bad in [":", ":a", "a::", "a::b", "a:b::", "a b", "a/b", "a:\x00", "a\n"]:
        with pytest.raises(InvalidInput):
            validation.prefix(bad)


def _refused_fast(started: float, response_status: int) -> None:
    assert time.process_time() - started < FAST
    assert response_status == 400


@pytest.mark.parametrize("tool", ["memory_list", "memory_search", "memory_recall", "memory_summarize"])
def test_a_tool_calls_backtracking_prefix_is_refused_at_once_naming_prefix(api, tool):
    api.call("memory_write", key="user:u1:x", value="kept")
    rows = row_counts()
    arguments = {"prefix": BACKTRACKING_PREFIX}
    if tool == "memory_search":
        arguments["query"] = "anything"
    started = time.process_time()
    status, body = api.call(tool, **arguments)
    _refused_fast(started, status)
    assert tool_error(body)["field"] == "prefix"
    assert row_counts() == rows
    assert not Job.objects.exists()


def test_a_rest_list_with_a_backtracking_prefix_is_refused_at_once(api):
    started = time.process_time()
    response = api.get("/api/v1/memories", {"prefix": BACKTRACKING_PREFIX})
    _refused_fast(started, response.status_code)
    assert rest_error(response)["field"] == "prefix"


def test_a_forget_request_or_summary_with_a_backtracking_prefix_is_refused_and_stores_nothing(api):
    for path in ("/api/v1/forget-requests", "/api/v1/summaries"):
        started = time.process_time()
        response = api.post(path, {"prefix": BACKTRACKING_PREFIX})
        _refused_fast(started, response.status_code)
        assert rest_error(response)["field"] == "prefix"
    assert not ForgetRequest.objects.exists()
    assert not Job.objects.exists()
    refusals = AuditEvent.objects.filter(tenant=api.tenant).exclude(outcome=AuditEvent.Outcome.OK)
    assert {(e.action, e.detail.get("code")) for e in refusals} == {
        ("forget.create", "invalid_prefix"),
        ("memory.summarize", "invalid_prefix"),
    }


# --- a batch whose answer grows past what one request should build ----------------------------


def _seed_large(tenant, n: int, *, chars: int) -> None:
    from memories import services
    from tests.factories import SYSTEM

    # Quotes: the value's JSON is twice its length, as is a cut of it rendered in an answer.
    for i in range(n):
        services.memory_write(tenant=tenant, actor=SYSTEM, key=f"big:k{i:03}", value="zebra " + '"' * chars)


def test_a_batch_stops_running_calls_once_its_answer_holds_the_cap(api, monkeypatch):
    from memories import tools

    monkeypatch.setattr(tools, "BATCH_ANSWER_MAX_BYTES", 40_000, raising=False)
    _seed_large(api.tenant, 1, chars=4_990)  # a read answers ~10 KB
    read = {"name": "memory_read", "arguments": {"key": "big:k000", "max_chars": 16_384}}
    calls = [{**read, "id": f"c{i}"} for i in range(6)]
    calls.append({"name": "memory_write", "arguments": {"key": "big:late", "value": 1}, "id": "late"})
    events_before = AuditEvent.objects.filter(tenant=api.tenant).count()

    response = api.post("/api/v1/tools/batch", {"calls": calls})

    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["status"] for r in results] == ["ok"] * 4 + ["error"] * 3
    for i, result in enumerate(results[4:], start=4):
        assert result["error"]["code"] == "answer_too_large"
        assert result["error"]["field"] == f"calls.{i}"
        assert result["tool_call_id"] == calls[i]["id"]
    # The write after the cap was not run: no memory, no version, no memory.write event.
    assert not Memory.objects.filter(tenant=api.tenant, key="big:late").exists()
    events = AuditEvent.objects.filter(tenant=api.tenant).order_by("id")[events_before:]
    assert [(e.action, e.outcome) for e in events] == [("memory.read", "ok")] * 4 + [("tool.batch", "invalid")]
    assert events[4].count == 3
    assert events[4].detail["code"] == "answer_too_large"


def test_the_largest_batch_of_searches_builds_an_answer_of_the_cap_plus_one_call(api):
    from memories import tools

    # 200 memories of 16 KB each (the value cap); a search of them all, max_chars 16,384, is the
    # largest answer one call gives (~3.3 MB). 50 of them were 160 MB, built in 8 s.
    _seed_large(api.tenant, 200, chars=8_000)
    search = {"name": "memory_search", "arguments": {"query": "zebra", "limit": 200, "max_chars": 16_384}}

    started = time.process_time()
    response = api.post("/api/v1/tools/batch", {"calls": [search] * 50})
    elapsed = time.process_time() - started

    assert response.status_code == 200
    results = response.json()["results"]
    ran = [r for r in results if r["status"] == "ok"]
    assert len(ran) == 2 and all(len(r["results"]) == 200 for r in ran)
    assert {r["error"]["code"] for r in results[2:]} == {"answer_too_large"}
    assert len(response.content) < tools.BATCH_ANSWER_MAX_BYTES + 4 * 1024 * 1024
    assert elapsed < 5


# --- requests Django refuses before a view: still the error envelope on API paths ---------------


def _envelope(response, *, status: int, code: str, field: str | None) -> None:
    assert response.status_code == status
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"] == {"code": code, "message": response.json()["error"]["message"], "field": field}


def test_more_query_parameters_than_django_parses_is_a_400_naming_query_and_audited(api, settings):
    many = "&".join(f"p{i}=1" for i in range(settings.DATA_UPLOAD_MAX_NUMBER_FIELDS + 1))
    response = api.get(f"/api/v1/memories?{many}")
    _envelope(response, status=400, code="too_many_fields", field="query")
    assert "1000" in response.json()["error"]["message"]
    event = AuditEvent.objects.filter(tenant=api.tenant).latest("id")
    assert (event.action, event.outcome, event.detail["code"]) == ("memory.list", "invalid", "too_many_fields")
    # The same limit on an endpoint that audits nothing (the tool schemas).
    _envelope(api.get(f"/api/v1/tools?{many}"), status=400, code="too_many_fields", field="query")


# A parameter named twice: Django's QueryDict.get read the last value (?limit=1&limit=1000 was
# refused for 1000, ?prefix=user:u1:&prefix=user:u2: listed user:u2:) while a proxy, WAF or log
# reading the first saw another request. Refused on every route, naming the parameter.
REPEATED = [
    ("get", "/api/v1/memories?prefix=user:u1:&prefix=user:u2:", "prefix", "memory.list"),
    ("get", "/api/v1/memories?limit=1&limit=1000", "limit", "memory.list"),
    ("get", "/api/v1/memories/user:u1:k?x=1&x=2", "x", "memory.read"),
    ("get", "/api/v1/memories/user:u1:k/history?limit=1&limit=2", "limit", "memory.history"),
    ("put", "/api/v1/memories/user:u1:k?tag=a&tag=b", "tag", "memory.write"),
    ("patch", "/api/v1/memories/user:u1:k?x=&x=", "x", "memory.update"),
    ("delete", "/api/v1/memories/user:u1:k?x=1&x=1", "x", "memory.delete"),
    ("post", "/api/v1/tools/call?root=a&root=b", "root", "tool.call"),
    ("post", "/api/v1/anthropic/memory?root=user:u1&root=user:u2", "root", "anthropic.memory"),
    ("get", "/api/v1/forget-requests?status=failed&status=completed", "status", "forget.list"),
    ("get", "/api/v1/audit-events?since=2026-01-01T00:00:00Z&since=2000-01-01T00:00:00Z", "since", "audit.list"),
    ("get", "/api/v1/audit-events/export?format=csv&format=jsonl", "format", "audit.export"),
    ("get", "/api/v1/langgraph/store/items?namespace=a&namespace=b&key=k", "namespace", "memory.read"),
    ("get", "/api/v1/tools?strict=true&strict=false", "strict", None),
]


@pytest.mark.parametrize(("method", "path", "field", "action"), REPEATED)
def test_a_query_parameter_given_twice_is_a_400_naming_it_and_nothing_runs(api, method, path, field, action):
    api.put("/api/v1/memories/user:u1:k", {"value": "kept"})
    rows, events = row_counts(), AuditEvent.objects.count()
    body = {"value": "changed"} if method in ("put", "patch") else None
    if path.startswith("/api/v1/tools/call"):
        body = {"name": "memory_write", "arguments": {"key": "user:u1:k", "value": "changed"}}
    elif path.startswith("/api/v1/anthropic"):
        body = {"command": "create", "path": "/memories/a.md", "file_text": "changed"}
    headers = {"Idempotency-Key": "repeated-1"} if method != "get" else None
    if method == "get":
        response = api.get(path)
    elif method == "delete":
        response = api.delete(path, headers=headers)
    else:
        response = getattr(api, method)(path, body, headers=headers)
    assert response.status_code == 400, response.content
    error = rest_error(response)
    assert (error["code"], error["field"]) == ("duplicate_parameter", field)
    assert "2 times" in error["message"]
    assert row_counts() == rows
    assert Memory.objects.get(key="user:u1:k").value == "kept"
    new = list(AuditEvent.objects.filter(id__gt=0).order_by("id")[events:].values_list("action", "outcome", "detail"))
    if action is None:  # the tool schemas audit nothing
        assert new == []
    else:
        assert [(a, o, d["code"]) for a, o, d in new] == [(action, "invalid", "duplicate_parameter")]


# Each refusal no service saw, on a write: (method, path, body, content type) and the answer's
# (status, code, field), which its one audit event repeats. Before, the event held the DRF
# error's own code without the field ({"code": "parse_error"} for a 400 malformed_json naming
# body; {"code": "invalid"} for a 400 min_value naming ttl_seconds), and a 415 or 405 to a
# verified key was not audited at all.
MEMORY = "/api/v1/memories/user:u1:k"
SURFACE_REFUSALS = [
    ("put", MEMORY, "{", "application/json", (400, "malformed_json", "body"), "memory.write"),
    (
        "put",
        MEMORY,
        '{"value": 1, "ttl_seconds": 0}',
        "application/json",
        (400, "min_value", "ttl_seconds"),
        "memory.write",
    ),
    (
        "put",
        MEMORY,
        '{"value": 1, "ttl_seconds": "5"}',
        "application/json",
        (400, "invalid", "ttl_seconds"),
        "memory.write",
    ),
    ("put", MEMORY, "{}", "application/json", (400, "required", "value"), "memory.write"),
    ("patch", MEMORY, '{"zz": 1}', "application/json", (400, "unknown_field", "zz"), "memory.update"),
    (
        "put",
        MEMORY,
        "value=1",
        "application/x-www-form-urlencoded",
        (415, "unsupported_media_type", "Content-Type"),
        "memory.write",
    ),
    ("put", MEMORY, '{"value": 1}', "text/plain", (415, "unsupported_media_type", "Content-Type"), "memory.write"),
    ("post", MEMORY, '{"value": 1}', "application/json", (405, "method_not_allowed", None), "api.request"),
    (
        "post",
        CALL,
        '{"name": "memory_write", "name": "memory_delete"}',
        "application/json",
        (400, "duplicate_key", "name"),
        "tool.call",
    ),
    (
        "post",
        "/api/v1/forget-requests",
        '{"subject": 5}',
        "application/json",
        (400, "invalid", "subject"),
        "forget.create",
    ),
]


@pytest.mark.parametrize(("method", "path", "body", "content_type", "answer", "action"), SURFACE_REFUSALS)
def test_a_refused_write_is_audited_once_with_the_code_and_field_it_answered(
    api, method, path, body, content_type, answer, action
):
    api.put(MEMORY, {"value": "kept"})
    rows, since = row_counts(), AuditEvent.objects.order_by("-id").values_list("id", flat=True).first()
    response = api.client.generic(method.upper(), path, body, content_type=content_type, headers=api._headers({}))
    error = rest_error(response)
    assert (response.status_code, error["code"], error["field"]) == answer
    assert row_counts() == rows and Memory.objects.get(key="user:u1:k").value == "kept"
    events = AuditEvent.objects.filter(id__gt=since)
    assert [(e.action, e.outcome, e.detail) for e in events] == [
        (action, "invalid", {"code": answer[1], "field": answer[2]})
    ]


@pytest.mark.parametrize("content_type", ["", "text/plain", "multipart/form-data; boundary=x", "application/xml"])
def test_a_body_in_a_media_type_no_parser_reads_is_a_415_naming_content_type(api, content_type):
    rows = row_counts()
    response = api.client.post(CALL, b'{"name":"memory_write"}', content_type=content_type, headers=api._headers({}))
    _envelope(response, status=415, code="unsupported_media_type", field="Content-Type")
    assert row_counts() == rows


@pytest.mark.parametrize("accept", ["text/html", "application/xml", "text/csv"])
def test_an_accept_no_renderer_meets_is_a_406_naming_accept(api, accept):
    _envelope(
        api.get("/api/v1/memories", headers={"Accept": accept}), status=406, code="not_acceptable", field="Accept"
    )


def test_a_query_parameter_given_once_or_empty_is_read_as_before(api):
    api.put("/api/v1/memories/user:u1:k", {"value": "kept"})
    assert api.get("/api/v1/memories?prefix=user:u1:&limit=1").json()["results"][0]["key"] == "user:u1:k"
    assert api.get("/api/v1/memories?prefix=&cursor=").status_code == 200


@pytest.mark.parametrize("path", ["/api/v1/memories", "/healthz", "/api/v1/no-such-endpoint"])
def test_a_host_outside_allowed_hosts_on_an_api_path_is_a_400_in_the_error_envelope(api, path):
    response = api.get(path, headers={"Host": "attacker.example"})
    _envelope(response, status=400, code="bad_host", field="Host")


def test_a_bad_request_on_a_browser_path_is_still_djangos_page(db, client):
    response = client.get("/admin/login/", headers={"Host": "attacker.example"})
    assert response.status_code == 400
    assert response["Content-Type"].startswith("text/html")


@pytest.mark.parametrize("length", ["10000000000000000000", "18446744073709551615", "9" * 40])
def test_a_content_length_past_nineteen_digits_is_413_before_any_read(api, length):
    # A server passes any Content-Length it can hold (granian: up to 2**64 - 1); past 19 digits
    # the cap's check could not read it, and Django refused the body itself, with its HTML page.
    response = api.client.generic(
        "POST",
        CALL,
        b'{"name":"memory_list","arguments":{}}',
        content_type="application/json",
        headers={**api._headers(None), "Content-Length": length},
    )
    _envelope(response, status=413, code="too_large", field="body")


def test_a_content_length_of_leading_zeros_is_its_number(api):
    body = b'{"name":"memory_list","arguments":{}}'
    response = api.client.generic(
        "POST",
        CALL,
        body,
        content_type="application/json",
        headers={**api._headers(None), "Content-Length": "0" * 30 + str(len(body))},
    )
    assert response.status_code == 200, response.content


# --- walks over a body that name where they stopped -----------------------------------------------

# An object under a long name holding many small containers: each walk built, for every
# container, the dotted path to it at once — the long name copied once per container, all of
# them held on the walk's stack. A 1 MiB body (a 500,000-character name, 40,000 empty lists)
# asked for ~20 GB; these sizes ask for 100 MB, and a few MB once paths are built on a hit.
LONG_NAME = "n" * 20_000
SIBLINGS = 5_000
WALK_PEAK_BYTES = 16 * 1024 * 1024


def _wide_under_a_long_name(last) -> dict:
    return {LONG_NAME: {**{f"a{i}": [] for i in range(SIBLINGS)}, "z": [last]}}


def _peak(fn):
    import tracemalloc

    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_body_with_an_emoji_under_many_containers_is_walked_in_bounded_memory(api):
    import json

    # The emoji, as json.dumps writes it (a \ud83d\ude00 pair), makes the parser look for a
    # lone surrogate: a walk of every string and name.
    body = json.dumps({"name": "memory_list", "arguments": {"prefix": "x:"}, "extra": _wide_under_a_long_name("😀")})
    response, peak = _peak(lambda: api.post(CALL, raw=body))
    assert response.status_code == 200  # a call's fields beside its own are not looked at
    assert peak < WALK_PEAK_BYTES


def test_a_lone_surrogate_is_still_named_by_its_path_cut_at_200_characters():
    import json

    data = _wide_under_a_long_name("\ud800")
    text = json.dumps(data)
    assert validation.lone_surrogate_field(text, data) == f"{LONG_NAME}.z.0"[:200]
    nested = {"calls": [{"arguments": {"key": "ok", "value": ["a", "\udc00"]}}]}
    assert validation.lone_surrogate_field(json.dumps(nested), nested) == "calls.0.arguments.value.1"
    named = {"calls": [{"\ud800": 1}]}
    assert validation.lone_surrogate_field(json.dumps(named), named) == "calls.0"
    assert validation.lone_surrogate_field(json.dumps({"\ud800": 1}), {"\ud800": 1}) == "body"


def test_mcp_arguments_are_checked_for_non_finite_numbers_in_bounded_memory():
    from memories.mcp.server import non_finite_field

    where, peak = _peak(lambda: non_finite_field(_wide_under_a_long_name(float("nan"))))
    assert where == f"arguments.{LONG_NAME}.z.0"[:200]
    assert peak < WALK_PEAK_BYTES
    assert non_finite_field({"key": "a:b", "default": {"x": [1, 2.5, {"y": float("-inf")}]}}) == (
        "arguments.default.x.2.y"
    )
    assert non_finite_field({"key": "a:b", "value": [1, 2.5]}) is None


# --- the answer of work that committed is the answer, whatever happens after -------------------


def _kill_own_backend() -> None:
    import psycopg
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    db = connection.settings_dict
    with psycopg.connect(
        host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], password=db["PASSWORD"] or None, dbname=db["NAME"]
    ) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_batch_whose_answer_cannot_be_kept_for_retries_still_answers_what_it_did(monkeypatch):
    # The database goes away between the batch's last commit and the storing of its answer
    # for Idempotency-Key retries: that was a 500 — for writes that had committed.
    from django.db import connection

    from memories.services import idempotency
    from tests.factories import make_keyed_client, make_tenant

    api, _key = make_keyed_client(make_tenant("outage-after-work"))
    api.client.raise_request_exception = False
    complete = idempotency.complete

    def database_gone_then_complete(*args, **kwargs):
        _kill_own_backend()
        return complete(*args, **kwargs)

    monkeypatch.setattr(idempotency, "complete", database_gone_then_complete)
    calls = [{"name": "memory_write", "arguments": {"key": f"w:k{i}", "value": i}} for i in range(3)]
    response = api.post("/api/v1/tools/batch", {"calls": calls}, headers={"Idempotency-Key": "batch-1"})

    assert response.status_code == 200, response.content
    assert [r["status"] for r in response.json()["results"]] == ["ok"] * 3
    connection.close()  # the killed one: a server ends it with the request; the test client does not
    assert Memory.objects.filter(tenant=api.tenant, key__startswith="w:").count() == 3


# --- what anyone may ask without a key --------------------------------------------------------


@pytest.mark.parametrize(
    "accept", ["application/vnd.oai.openapi", "application/vnd.oai.openapi+json", "application/json"]
)
def test_the_openapi_schema_costs_an_anonymous_client_no_rebuild(anonymous, accept):
    # It was built and rendered for every request: ~65 ms of CPU each (/healthz: ~1 ms).
    first = anonymous.get("/api/v1/schema", headers={"Accept": accept})
    assert first.status_code == 200
    started = time.process_time()
    again = [
        anonymous.get("/api/v1/schema", params, headers={"Accept": accept})
        for params in ({}, {"lang": "de"}, {"version": "x" * 1000}, {"lang": "zz", "version": "2"}, {})
    ]
    per_request = (time.process_time() - started) / len(again)
    assert per_request < 0.015
    for response in again:
        assert (response.status_code, response.content) == (200, first.content)
        assert response["Content-Type"] == first["Content-Type"]
    assert b"x" * 1000 not in first.content


# --- a page of memories with a tag few of them carry ---------------------------------------------


def _memory_rows_read(tenant, actor=None, call="memory_list", **kwargs) -> int:
    """Rows of the memory table one listing (or another service ``call``) fetched
    (PostgreSQL's counters of the transaction)."""
    from django.db import connection, transaction

    from memories import services
    from tests.factories import SYSTEM

    def fetched() -> int:
        # Within one transaction these counters move as rows are read (they may also hold
        # earlier transactions' counts, not yet flushed: hence the difference).
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables"
                " WHERE relname = %s",
                [Memory._meta.db_table],
            )
            return cursor.fetchone()[0]

    with transaction.atomic():
        before = fetched()
        getattr(services, call)(tenant=tenant, actor=actor or SYSTEM, **kwargs)
        return fetched() - before


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_list_page_of_a_rare_tag_reads_its_memories_through_the_search_index(api, monkeypatch):
    # A tag's page walked the tenant's keys in order until it was full: a tag few memories
    # carry read the whole tenant (70 ms at 50k memories, 0.45 s at 1M). Its words are in
    # the search index: with the tenant's term statistics saying they are rare, the page
    # reads those memories only.
    from memories import selectors
    from memories.search.index import stats_refresh
    from tests.factories import write

    _seed_memories(api.tenant, 3000)
    for i in range(3):
        write(api.tenant, f"crm:c{i}", "a client", tags=["vip-client"])
    stats_refresh(tenant_id=api.tenant.pk)
    write(api.tenant, "crm:new", "written after the count", tags=["fresh-tag"])

    for tag, keys in (("vip-client", ["crm:c0", "crm:c1", "crm:c2"]), ("nowhere", []), ("fresh-tag", ["crm:new"])):
        response = api.get("/api/v1/memories", {"tag": tag})
        assert response.status_code == 200, response.content
        assert [m["key"] for m in response.json()["results"]] == keys
        assert _memory_rows_read(api.tenant, tag=tag) <= 5, tag
    # A tag more memories carry than the index path reads still walks the keys, and stops
    # once the page is full.
    monkeypatch.setattr(selectors, "TAG_INDEX_MAX_DOCS", 1000)
    assert _memory_rows_read(api.tenant, tag="common", limit=10) <= 20


@pytest.mark.postgres
def test_a_tag_page_through_the_search_index_lists_exactly_the_memories_with_the_tag(api, tenant_b):
    from datetime import timedelta

    from django.utils import timezone

    from memories import services
    from memories.search.index import stats_refresh
    from tests.factories import SYSTEM, write

    t = api.tenant
    for key in ("a:1", "a:2", "b:1", "vip:vip:client:client", "a:secret", "a:gone", "a:old"):
        write(t, key, "text", tags=["x", "vip-client"], sensitive=key == "a:secret")
    write(t, "a:vip:client", "vip client, no tag", tags=["vip", "client"])
    write(t, "a:other", "other", tags=["vip-client2"])
    write(t, "c:1", "周报", tags=["周报"])
    write(t, "c:2", "报周", tags=["报周"])
    services.memory_delete(tenant=t, actor=SYSTEM, key="a:gone")
    Memory.objects.filter(tenant=t, key="a:old").update(expires_at=timezone.now() - timedelta(hours=1))
    write(tenant_b, "a:1", "another tenant's", tags=["vip-client"])
    stats_refresh(tenant_id=t.pk)
    write(t, "a:3", "written after the count", tags=["vip-client"])

    def pages(**kwargs) -> list[str]:
        keys, cursor = [], None
        while True:
            page = services.memory_list(tenant=t, actor=SYSTEM, limit=2, cursor=cursor, **kwargs)
            keys += page.keys
            if not page.next_cursor:
                return keys
            cursor = page.next_cursor

    tagged = ["a:1", "a:2", "a:3", "a:secret", "b:1", "vip:vip:client:client"]
    assert pages(tag="vip-client") == tagged
    assert pages(tag="vip-client", order="desc") == tagged[::-1]
    assert pages(tag="vip-client", prefix="a:") == ["a:1", "a:2", "a:3", "a:secret"]
    assert pages(tag="周报") == ["c:1"]
    assert pages(tag="VIP-client") == []  # tags are case-sensitive, as before
    assert pages(tag="client") == ["a:vip:client"]


# --- a search of a big tenant whose term statistics were never counted ---------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_search_of_a_big_uncounted_tenant_does_not_count_each_word_on_the_spot():
    # A tenant never counted (new, or just imported: until the search-stats job has run)
    # had each of the question's words counted on the spot, up to 501 memories each: at 50k
    # memories one common word took 50-60 ms, 32 common words a 503 search_timeout (83 ms).
    # Past SPOT_COUNT_MAX_DOCS memories the words are taken as unknown (none rarer than
    # another) until the count, as a word new since a count is.
    from django.db import connection

    from memories import services
    from memories.models import SearchCorpus
    from memories.search import lexical, ranking
    from tests.factories import SYSTEM, make_tenant

    tenant = make_tenant("imported")
    words = " ".join(f"word{i}" for i in range(32))
    template = services.memory_write(tenant=tenant, actor=SYSTEM, key="bulk:template", value=words)
    columns = [f.column for f in Memory._meta.local_concrete_fields if f.column not in ("id", "key")]
    listed = ", ".join(columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {Memory._meta.db_table} (key, {listed}) "  # noqa: S608 (names from the model)
            f"SELECT 'bulk:k' || g, {listed} FROM {Memory._meta.db_table},"
            f" generate_series(1, {lexical.SPOT_COUNT_MAX_DOCS + 500}) g WHERE id = %s",
            [template.memory.pk],
        )
    assert not SearchCorpus.objects.filter(tenant=tenant).exists()

    hits = services.memory_search(tenant=tenant, actor=SYSTEM, query=words, limit=5)
    assert len(hits) == 5
    read = _memory_rows_read(tenant, call="memory_search", query=words, limit=5)
    # The tenant's size (counted up to the cap), the candidates, the results loaded (and spares).
    assert read <= lexical.SPOT_COUNT_MAX_DOCS + 1 + lexical.CANDIDATES + 5 + ranking.SPARE, read


# --- a page of memories under an allowlist of many prefixes --------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_list_page_under_many_allowed_prefixes_reads_about_a_page_not_every_memory_under_them():
    # An API key allowed 50 prefixes (of a tenant's 200 namespaces) listed with one OR of 50
    # LIKEs: PostgreSQL read every memory under them (a BitmapOr) and sorted them for one
    # page — 12,500 rows and 20 ms for 201 keys at 50 × 250 memories. Now one ordered index
    # range per prefix, merged (Merge Append): about a page of rows, plus one per prefix.
    from django.db import connection

    from memories import selectors, services
    from tests.factories import SYSTEM, make_tenant

    tenant = make_tenant("wide")
    template = services.memory_write(tenant=tenant, actor=SYSTEM, key="bulk:template", value="v")
    columns = [f.column for f in Memory._meta.local_concrete_fields if f.column not in ("id", "key", "namespace")]
    listed = ", ".join(columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {Memory._meta.db_table} (key, namespace, {listed}) "  # noqa: S608 (names from the model)
            f"SELECT 'user:u' || u || ':k' || lpad(k::text, 3, '0'), 'user:u' || u, {listed}"
            f" FROM {Memory._meta.db_table}, generate_series(0, 199) u, generate_series(1, 60) k WHERE id = %s",
            [template.memory.pk],
        )
        cursor.execute(f"ANALYZE {Memory._meta.db_table}")
    allowed = tuple(f"user:u{u}:" for u in range(150, 200))
    actor = dataclasses.replace(SYSTEM, allowed_prefixes=allowed)
    expected = sorted(f"user:u{u}:k{k:03d}" for u in range(150, 200) for k in range(1, 61))

    for order in ("asc", "desc"):
        keys, cursor_ = [], None
        for _ in range(3):
            page = services.memory_list(tenant=tenant, actor=actor, limit=25, cursor=cursor_, order=order)
            keys += page.keys
            cursor_ = page.next_cursor
        assert keys == (expected if order == "asc" else expected[::-1])[:75]
    rows = services.memory_list(tenant=tenant, actor=actor, limit=10, keys_only=False, prefix="user:u160:")
    assert [m.key for m in rows.keys] == [f"user:u160:k{k:03d}" for k in range(1, 11)]
    assert services.memory_list(tenant=tenant, actor=actor, prefix="user:u1:").keys == []
    rows = services.memory_list(tenant=tenant, actor=actor, limit=3, keys_only=False, order="desc")
    assert [m.key for m in rows.keys] == expected[::-1][:3] and rows.keys[0].value == "v"
    assert services.memory_list(tenant=tenant, actor=actor, tag="none", category="fact").keys == []
    assert _memory_rows_read(tenant, actor=actor, limit=25) <= 25 + 1 + 50
    assert _memory_rows_read(tenant, actor=actor, limit=25, keys_only=False) <= 25 + 1 + 50
    # Recall with no question: the tenant's 1,000 most salient, and 1,000 under the prefixes
    # (all 3,000 of those were read).
    packed = services.memory_recall(tenant=tenant, actor=actor, max_chars=2000)
    assert packed["keys"] and all(key.startswith(allowed) for key in packed["keys"])
    salient = selectors.memories_salient_rows(tenant=tenant, prefixes=actor.prefix_filters(""))
    assert sorted(r[1] for r in salient)[:1000] == expected[:1000]
    # (plus the 30 it packs, loaded by id: 4,030 before)
    assert _memory_rows_read(tenant, actor=actor, call="memory_recall") <= 1000 + 1000 + 50 + 30


# --- a page of the audit log that its filters leave empty -----------------------------------------


def _seed_memories(tenant, n: int) -> None:
    """``n`` more live memories of ``tenant`` under ``bulk:``, copies of one written by the
    service (one INSERT; only their keys differ)."""
    from django.db import connection

    from memories import services
    from tests.factories import SYSTEM

    template = services.memory_write(tenant=tenant, actor=SYSTEM, key="bulk:template", value="v", tags=["common"])
    columns = [f.column for f in Memory._meta.local_concrete_fields if f.column not in ("id", "key")]
    listed = ", ".join(columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {Memory._meta.db_table} (key, {listed}) "  # noqa: S608 (names from the model)
            f"SELECT 'bulk:k' || g, {listed} FROM {Memory._meta.db_table}, generate_series(1, %s) g WHERE id = %s",
            [n, template.memory.pk],
        )


@pytest.mark.postgres
# Committed, then emptied by TRUNCATE: rolled back, the seeded rows stayed as dead tuples
# that changed the planner's estimates for later tests (tests/test_hot_sql.py).
@pytest.mark.django_db(transaction=True)
def test_a_list_page_a_tag_leaves_empty_stops_at_the_deadline(api, settings):
    # No index serves the tag filter: a tag few memories carry read every memory of the
    # tenant in key order to fill a page (0.45 s at 1M memories). Now it stops at
    # ZEROMEM_MEMORY_LIST_TIMEOUT_MS.
    _seed_memories(api.tenant, 50_000)
    settings.ZEROMEM_MEMORY_LIST_TIMEOUT_MS = 1

    response = api.get("/api/v1/memories", {"tag": "rare"})

    assert response.status_code == 503, response.content
    error = rest_error(response)
    assert (error["code"], error["field"]) == ("list_timeout", "tag")
    assert "prefix" in error["message"]
    event = AuditEvent.objects.filter(tenant=api.tenant, action="memory.list").latest("id")
    assert (event.outcome, event.detail.get("code")) == ("unavailable", "list_timeout")

    settings.ZEROMEM_MEMORY_LIST_TIMEOUT_MS = 60_000
    response = api.get("/api/v1/memories", {"tag": "rare"})
    assert (response.status_code, response.json()["results"]) == (200, [])
    response = api.get("/api/v1/memories", {"tag": "common", "limit": "3"})
    assert [m["key"] for m in response.json()["results"]] == ["bulk:k1", "bulk:k10", "bulk:k100"]


# --- a page of one category or subject, whose memories sit at the end of the key order -------------


def _seed_rows(tenant, n: int, key_sql: str, namespace_sql: str, category: str, subject: str) -> None:
    """``n`` more live memories of ``tenant`` (one INSERT; ``g`` numbers them in the SQL)."""
    from django.db import connection

    from memories import services
    from tests.factories import SYSTEM

    template = services.memory_write(tenant=tenant, actor=SYSTEM, key="seed:template", value="v")
    skip = ("id", "key", "namespace", "category", "subject")
    listed = ", ".join(f.column for f in Memory._meta.local_concrete_fields if f.column not in skip)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {Memory._meta.db_table} (key, namespace, category, subject, {listed}) "  # noqa: S608 (names from the model)
            f"SELECT {key_sql}, {namespace_sql}, %s, %s, {listed}"
            f" FROM {Memory._meta.db_table}, generate_series(1, %s) g WHERE id = %s",
            [category, subject, n, template.memory.pk],
        )


@pytest.mark.postgres
# Committed, then emptied by TRUNCATE (see the tag test above: dead tuples move estimates).
@pytest.mark.django_db(transaction=True)
def test_a_page_of_one_category_or_subject_reads_about_a_page_wherever_its_keys_sit(api):
    # A category follows the key's first segment (user:… is "user"), a subject the end user
    # of user:<id>:…: one that is 1% of a tenant sits in one stretch of the key order. The
    # planner walked the (tenant, key) index filtering by category (or subject), expecting a
    # page every 100 rows, and read every memory before that stretch: 99,052 rows and 56 ms
    # for 50 keys at 100k memories, ~0.5 s at 1M, with no deadline and no tenant slot. Now
    # an index on (tenant, category, key) and one on (tenant, subject, key): a page is one
    # range of it in key order.
    from django.db import connection

    from memories import services
    from tests.factories import SYSTEM

    _seed_rows(api.tenant, 99_000, "'session:s' || lpad(g::text, 6, '0')", "'session'", "note", "")
    _seed_rows(api.tenant, 1_000, "'user:zz:k' || lpad(g::text, 4, '0')", "'user:zz'", "user", "zz")
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Memory._meta.db_table}")
    expected = [f"user:zz:k{g:04d}" for g in range(1, 1001)]

    for filters in ({"category": "user"}, {"subject": "zz"}, {"category": "user", "subject": "zz"}):
        first = services.memory_list(tenant=api.tenant, actor=SYSTEM, limit=50, **filters)
        second = services.memory_list(tenant=api.tenant, actor=SYSTEM, limit=50, cursor=first.next_cursor, **filters)
        assert first.keys + second.keys == expected[:100], filters
        last = services.memory_list(tenant=api.tenant, actor=SYSTEM, limit=3, order="desc", **filters)
        assert last.keys == expected[::-1][:3]
        under = services.memory_list(tenant=api.tenant, actor=SYSTEM, limit=2, prefix="user:zz:k05", **filters)
        assert under.keys == ["user:zz:k0500", "user:zz:k0501"]
        # Both: the planner may read the memories matching both and sort them (1,000 here, the
        # subject's), never the tenant's 100k.
        page = 50 + 1 if len(filters) == 1 else 1_000 + 50 + 1
        assert _memory_rows_read(api.tenant, limit=50, **filters) <= page, filters
        assert _memory_rows_read(api.tenant, limit=50, keys_only=False, **filters) <= 2 * page, filters
        assert _memory_rows_read(api.tenant, limit=50, order="desc", **filters) <= page, filters
    # Whole rows over REST: the same page.
    response = api.get("/api/v1/memories", {"category": "user", "limit": "2"})
    assert [m["key"] for m in response.json()["results"]] == expected[:2]
    assert services.memory_list(tenant=api.tenant, actor=SYSTEM, category="fact").keys == []
    assert services.memory_list(tenant=api.tenant, actor=SYSTEM, subject="zz", category="note").keys == []


# --- booleans where integers go (True == 1 in Python) -------------------------------------------

BOOLEAN_AS_INTEGER = [
    ("memory_list", {"limit": True}, "limit"),
    ("memory_search", {"query": "x", "limit": True}, "limit"),
    ("memory_search", {"query": "x", "max_chars": True}, "max_chars"),
    ("memory_recall", {"query": "x", "max_chars": True}, "max_chars"),
    ("memory_read", {"key": "user:u1:x", "max_chars": True}, "max_chars"),
    ("memory_read", {"key": "user:u1:x", "offset": False}, "offset"),
    ("memory_update", {"key": "user:u1:x", "value": 2, "expected_version": True}, "expected_version"),
    ("memory_write", {"key": "user:u1:y", "value": 2, "ttl_seconds": True}, "ttl_seconds"),
]


@pytest.mark.parametrize(("tool", "arguments", "field"), BOOLEAN_AS_INTEGER)
def test_a_boolean_where_a_tool_takes_an_integer_is_refused_naming_it(api, tool, arguments, field):
    api.call("memory_write", key="user:u1:x", value=1)
    rows = row_counts()
    status, body = api.call(tool, **arguments)
    assert (status, tool_error(body)["field"]) == (400, field)
    assert row_counts() == rows


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("put", "/api/v1/memories/user:u1:x", {"value": 1, "importance": True}, "importance"),
        ("put", "/api/v1/memories/user:u1:x", {"value": 1, "ttl_seconds": True}, "ttl_seconds"),
        ("patch", "/api/v1/memories/user:u1:x", {"expected_version": True}, "expected_version"),
        ("post", "/api/v1/forget-requests", {"keys": ["user:u1:x"], "due_in_days": True}, "due_in_days"),
        ("put", "/api/v1/langgraph/store/items", {"namespace": ["a"], "key": "k", "value": {}, "ttl": True}, "ttl"),
        ("post", "/api/v1/langgraph/store/items/search", {"limit": True}, "limit"),
        ("post", "/api/v1/langgraph/store/items/search", {"offset": False}, "offset"),
        ("post", "/api/v1/langgraph/store/namespaces", {"max_depth": True}, "max_depth"),
    ],
)
def test_a_boolean_where_rest_takes_an_integer_is_refused_naming_it(api, method, path, body, field):
    api.put("/api/v1/memories/user:u1:x", {"value": 0})
    rows = row_counts()
    response = getattr(api, method)(path, body)
    assert (response.status_code, rest_error(response)["field"]) == (400, field)
    assert row_counts() == rows
    assert not ForgetRequest.objects.exists()
