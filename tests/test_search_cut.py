"""A memory_search tool call pours no more than max_chars (default 2,000) characters of each
result's value into the model's context, cut as memory_read cuts a value; the rest is read on
with memory_read(key, offset=next_offset). The REST LangGraph search keeps whole values."""

from __future__ import annotations

import json
from unittest import mock

import pytest

from audit.models import AuditEvent
from memories import keyring, tools
from memories.services import memories as memories_service
from memories.services.memories import _cluster_start
from tests.factories import write
from tests.helpers import tool_error
from zeromem.kernel import validation
from zeromem.kernel.tokens import estimate_tokens

LONG = "".join(f"line {i:04d} of the roadmap\n" for i in range(300))  # 7,500 characters


def _search(api, **arguments):
    r = api.post("/api/v1/tools/call", {"name": "memory_search", "arguments": arguments})
    return r, r.json()


def _by_key(body: dict) -> dict:
    return {result["key"]: result for result in body["results"]}


def test_a_long_result_is_cut_at_2000_characters_and_memory_read_reads_on_to_the_rest(api):
    api.call("memory_write", key="note:n1:roadmap", value=LONG)
    _, body = _search(api, query="roadmap")
    assert body["status"] == "ok"
    cut = _by_key(body)["note:n1:roadmap"]
    assert set(cut) == {"key", "value", "score", "truncated", "chars", "next_offset"}
    assert cut["value"] == LONG[:2000]
    assert (cut["truncated"], cut["chars"], cut["next_offset"]) == (True, len(LONG), 2000)
    _, rest = api.call("memory_read", key="note:n1:roadmap", offset=cut["next_offset"], max_chars=cut["chars"])
    assert cut["value"] + rest["value"] == LONG and rest["truncated"] is False


def test_a_result_within_max_chars_is_answered_as_before_with_no_new_fields(api):
    api.call("memory_write", key="user:u1:prefs", value={"lang": "zh-CN", "roadmap": "yes"})
    api.call("memory_write", key="note:n1:roadmap", value=LONG)
    _, body = _search(api, query="roadmap", max_chars=100)
    results = _by_key(body)
    assert set(results["user:u1:prefs"]) == {"key", "value", "score"}
    assert results["user:u1:prefs"]["value"] == {"lang": "zh-CN", "roadmap": "yes"}  # its JSON as it is
    assert results["note:n1:roadmap"]["value"] == LONG[:100] and results["note:n1:roadmap"]["truncated"] is True
    _, whole = _search(api, query="roadmap", max_chars=validation.READ_MAX_CHARS)
    assert _by_key(whole)["note:n1:roadmap"] == {
        "key": "note:n1:roadmap",
        "value": LONG,
        "score": _by_key(whole)["note:n1:roadmap"]["score"],
    }


def test_a_structured_result_is_cut_as_its_compact_json_text(api):
    value = {"roadmap": [{"n": i, "what": "步骤"} for i in range(200)]}
    api.call("memory_write", key="task:t1:roadmap", value=value)
    _, body = _search(api, query="roadmap", max_chars=1000)
    cut = _by_key(body)["task:t1:roadmap"]
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    assert cut["value"] == text[:1000] and cut["chars"] == len(text) and cut["next_offset"] == 1000
    _, rest = api.call("memory_read", key="task:t1:roadmap", offset=1000, max_chars=len(text))
    assert json.loads(cut["value"] + rest["value"]) == value


def test_a_result_cut_never_splits_what_reads_as_one_character(api):
    text = "roadmap " + "a" * 1991 + "\U0001f1e9\U0001f1ea" + "b" * 50  # the flag at 1999-2000
    api.call("memory_write", key="note:n1:flag", value=text)
    _, body = _search(api, query="roadmap")
    cut = _by_key(body)["note:n1:flag"]
    assert cut["value"] == text[:1999] and cut["next_offset"] == 1999


def test_a_cut_inside_an_overlong_run_of_combining_marks_looks_back_a_bounded_way(api):
    """A run of combining marks reads as one character however long it is: the cut walked
    back over all of it, a step per mark (200 results of 8,150 marks took a search from 46 to
    609 ms of CPU), to answer the few characters before the run. Past 32 characters back
    (Unicode's stream-safe text allows 30 marks in a row) such a cluster is cut where the
    slice ends, as one longer than the whole slice already was."""
    text = "roadmap " + "\u0301" * 2400
    api.call("memory_write", key="note:n1:marks", value=text)
    _, body = _search(api, query="roadmap")
    cut = _by_key(body)["note:n1:marks"]
    assert cut["value"] == text[:2000] and cut["next_offset"] == 2000
    with mock.patch("memories.services.memories._joined", wraps=memories_service._joined) as joined:
        assert _cluster_start(text, 2000, low=0) == 2000
    assert joined.call_count <= 33
    short = "roadmap " + "a" * 1990 + "e" + "\u0301" * 5 + "b" * 50  # a real cluster across the cut
    assert _cluster_start(short, 2000, low=0) == 8 + 1990


def test_an_erased_result_is_answered_as_erased_not_cut(api, tenant_a):
    write(tenant_a, "user:u5:phone", "+86 138 0000 0000", sensitive=True)
    keyring.shred(tenant_id=tenant_a.pk, subject="u5")
    _, body = _search(api, query="phone", max_chars=3)
    assert _by_key(body)["user:u5:phone"]["value"] == {"erased": True}
    assert "truncated" not in _by_key(body)["user:u5:phone"]


def test_a_cut_search_is_one_memory_search_event_as_before(api):
    api.call("memory_write", key="note:n1:roadmap", value=LONG)
    before = AuditEvent.objects.filter(tenant=api.tenant).count()
    _search(api, query="roadmap", prefix="note:")
    events = list(AuditEvent.objects.filter(tenant=api.tenant).order_by("id")[before:])
    assert [(e.action, e.outcome, e.target, e.count) for e in events] == [("memory.search", "ok", "note:", 1)]


def test_the_result_cost_headers_count_the_cut_results(api):
    for i in range(5):
        api.call("memory_write", key=f"note:n{i}:roadmap", value=f"{i} {LONG}")
    whole, _ = _search(api, query="roadmap", max_chars=validation.READ_MAX_CHARS)
    cut, body = _search(api, query="roadmap")
    assert len(body["results"]) == 5 and all(r["truncated"] for r in body["results"])
    for r in (whole, cut):
        assert int(r["ZeroMem-Result-Bytes"]) == len(r.content)
        assert int(r["ZeroMem-Result-Tokens"]) == estimate_tokens(r.content.decode())
    assert int(cut["ZeroMem-Result-Bytes"]) < 5 * 2000 + 1000 < int(whole["ZeroMem-Result-Bytes"])


@pytest.mark.parametrize(
    ("max_chars", "action"),
    [
        (0, "memory.search"),
        (validation.READ_MAX_CHARS + 1, "memory.search"),
        # Not an integer, as the tool's schema requires: the call itself is malformed.
        ("lots", "tool.call"),
        (2.5, "tool.call"),
    ],
)
def test_a_bad_max_chars_is_400_naming_it_and_audited_as_invalid(api, max_chars, action):
    api.call("memory_write", key="note:n1:roadmap", value=LONG)
    r, body = _search(api, query="roadmap", max_chars=max_chars)
    assert r.status_code == 400 and tool_error(body)["field"] == "max_chars"
    events = AuditEvent.objects.filter(tenant=api.tenant, action__in=["memory.search", "tool.call"])
    assert list(events.values_list("action", "outcome")) == [(action, "invalid")]


def test_each_search_of_a_batch_is_cut_by_its_own_max_chars(api):
    api.call("memory_write", key="note:n1:roadmap", value=LONG)
    calls = [
        {"name": "memory_search", "arguments": {"query": "roadmap"}},
        {"name": "memory_search", "arguments": {"query": "roadmap", "max_chars": 300}},
        {"name": "memory_search", "arguments": {"query": "roadmap", "max_chars": 0}},
    ]
    first, second, refused = api.post("/api/v1/tools/batch", {"calls": calls}).json()["results"]
    assert len(first["results"][0]["value"]) == 2000 and len(second["results"][0]["value"]) == 300
    assert tool_error(refused)["field"] == "max_chars"


def test_the_rest_langgraph_search_answers_whole_values(api):
    value = {"text": LONG}
    r = api.put("/api/v1/langgraph/store/items", {"namespace": ["docs"], "key": "roadmap", "value": value})
    assert r.status_code == 204, r.content
    r = api.post("/api/v1/langgraph/store/items/search", {"namespace_prefix": ["docs"], "query": "roadmap"})
    assert r.status_code == 200 and [item["value"] for item in r.json()["items"]] == [value]


def test_search_states_max_chars_with_memory_reads_bounds_in_every_schema():
    def bounds(schema: dict) -> dict:
        return {k: v for k, v in schema.items() if k != "description"}

    search, read = tools.TOOLS["memory_search"], tools.TOOLS["memory_read"]
    stated = bounds(search.input_schema()["properties"]["max_chars"])
    assert stated == bounds(read.input_schema()["properties"]["max_chars"])
    assert stated == {"type": "integer", "minimum": 1, "maximum": validation.READ_MAX_CHARS}
    strict = [t.openai(strict=True)["function"]["parameters"] for t in (search, read)]
    assert bounds(strict[0]["properties"]["max_chars"]) == bounds(strict[1]["properties"]["max_chars"])
    assert strict[0]["properties"]["max_chars"]["type"] == ["integer", "null"]  # optional: null is absent
    assert "max_chars" in strict[0]["required"]


# --- the grapheme rule, over long runs of flags ---------------------------------------------

_REGIONAL = "".join(chr(c) for c in range(0x1F1E6, 0x1F200))


def _joined_by_copy(text: str, i: int) -> bool:
    """The rule for regional indicators as it was first written (a copy of text[:i])."""
    head = text[:i]
    return (len(head) - len(head.rstrip(_REGIONAL))) % 2 == 1


def _cluster_start_by_copy(text: str, end: int) -> int:
    i = end
    while 0 < i < len(text) and text[i - 1] in _REGIONAL and text[i] in _REGIONAL and _joined_by_copy(text, i):
        i -= 1
    return i if i > 0 else end


@pytest.mark.parametrize("lead", ["", "a", "\U0001f1e9"])
def test_a_cut_inside_a_long_run_of_flags_ends_where_the_copying_rule_ended_it(lead):
    """Regional indicators pair up from the start of their run, however long: a cut at every
    point of a 2,000-letter run ends between two flags, as the rule that copied text[:i] did."""
    text = lead + "\U0001f1e9\U0001f1ea\U0001f1eb\U0001f1f7" * 500 + "z"
    ends = [_cluster_start(text, end, low=0) for end in range(1, len(text))]
    assert ends == [_cluster_start_by_copy(text, end) for end in range(1, len(text))]
    run_start = 1 if lead == "a" else 0
    assert all((end - run_start) % 2 == 0 for end in ends if end > run_start + 1 and end < len(text) - 1)


# --- what a cut search loads ------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_cut_search_of_long_values_loads_their_first_characters_not_the_whole_values(api):
    # A tool search cut each result to max_chars, but loaded every ranked memory whole (the
    # limit and 10 spares): with a tenant's cap of 256 KB, a search of limit 200 and
    # max_chars 50 answered 30 KB and moved 54 MB out of PostgreSQL into the web process —
    # 104 MB at its peak, 400 ms. A plain string value longer than max_chars now leaves the
    # database as its first max_chars + 1 characters and its length; the answer is the same.
    import time
    import tracemalloc

    from django.db import connection

    from memories.models import Memory
    from tests.factories import SYSTEM

    api.tenant.value_max_bytes = 256 * 1024
    api.tenant.save()
    big = "needle " + "lorem ipsum dolor sit amet " * 9_000  # 243,007 characters
    template = api.call("memory_write", key="doc:template", value=big)[1]
    columns = [f.column for f in Memory._meta.local_concrete_fields if f.column not in ("id", "key")]
    listed = ", ".join(columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {Memory._meta.db_table} (key, {listed}) "  # noqa: S608 (names from the model)
            f"SELECT 'doc:d' || lpad(g::text, 3, '0'), {listed} FROM {Memory._meta.db_table},"
            " generate_series(1, 80) g WHERE tenant_id = %s AND key = 'doc:template'",
            [api.tenant.pk],
        )
    assert template["status"] == "ok"
    # Beside them: a combining mark at the cut, a structured value, a sealed one, a short one.
    api.call("memory_write", key="doc:accent", value="needle " + "e\u0301" * 40)
    api.call("memory_write", key="doc:json", value={"needle": "x" * 300})
    api.call("memory_write", key="doc:needle:secret", value="needle " + "s" * 300, sensitive=True)
    api.call("memory_write", key="doc:short", value="needle")

    call = {"name": "memory_search", "arguments": {"query": "needle", "limit": 200, "max_chars": 50}}
    tracemalloc.start()
    started = time.perf_counter()
    answer = tools.tool_call(tenant=api.tenant, actor=SYSTEM, call=call).result
    took = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    assert answer["status"] == "ok" and len(answer["results"]) == 85, len(answer["results"])
    assert peak < 8 * 1024 * 1024, f"{peak / 2**20:.1f} MB at the peak ({took * 1000:.0f} ms)"
    by_key = _by_key(answer)
    for key, result in by_key.items():
        read = api.call("memory_read", key=key, max_chars=50)[1]
        expected = {k: read[k] for k in ("value", "truncated", "chars", "next_offset") if k in read}
        if not read.get("truncated"):
            expected = {"value": read["value"]}
        assert {k: result[k] for k in expected} == expected, key
        assert result.get("truncated", False) is read.get("truncated", False), key
    assert by_key["doc:d001"]["chars"] == len(big) and by_key["doc:d001"]["value"] == big[:50]
    assert by_key["doc:accent"]["value"].endswith("e\u0301") and by_key["doc:accent"]["next_offset"] == 49
    assert by_key["doc:json"]["value"] == json.dumps({"needle": "x" * 300}, separators=(",", ":"))[:50]
    assert by_key["doc:needle:secret"]["value"] == ("needle " + "s" * 300)[:50]
    assert by_key["doc:short"] == {"key": "doc:short", "value": "needle", "score": by_key["doc:short"]["score"]}
