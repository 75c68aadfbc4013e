"""Each bound a tool schema states (tools/list over MCP, GET /api/v1/tools) is the service's:
an agent that follows the schema is never refused for it. For every bound of every tool's
input schema, found by walking the schemas (a bound added later is tested too), a value at
the bound passes both the schema and the service; one past it fails both — the service with
an error naming the argument, and nothing written. The calls run as MCP's ``tools/call`` runs
them (memories.mcp.server.answer)."""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator

from memories import tools
from memories.mcp import server as mcp_server
from memories.models import Memory
from tests.factories import make_key, write
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor
from zeromem.kernel.outcomes import ActorKind

# A call of each tool that the service takes, and the key memory_update and memory_read find.
KEY = "user:u1:pref"
BASE = {
    "memory_write": {"key": KEY, "value": "v"},
    "memory_read": {"key": KEY},
    "memory_update": {"key": KEY, "value": "v2"},
    "memory_delete": {"key": KEY},
    "memory_list": {},
    "memory_search": {"query": "coffee"},
    "memory_recall": {},
    "memory_summarize": {"prefix": "session:s1:"},
}
BOUNDS = ("minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "pattern")


def _bounds() -> list[tuple[str, str, str, object]]:
    """(tool, argument, keyword — "items.maxLength" for an array's items —, bound) of every tool."""
    found = []
    for name, tool in tools.TOOLS.items():
        for arg, schema in tool.input_schema()["properties"].items():
            for where, part in (("", schema), ("items.", schema.get("items", {}))):
                found += [(name, arg, where + kw, part[kw]) for kw in BOUNDS if kw in part]
    return found


def _string(arg: str, n: int) -> str:
    """A value of ``arg`` of n characters that the service takes but for its length."""
    fill = {"key": "k", "prefix": "p", "query": "q", "subject": "s", "category": "c"}[arg]
    return fill * n


def _at_and_past(arg: str, keyword: str, bound) -> tuple[object, object]:
    if keyword == "minimum":
        return bound, bound - 1
    if keyword == "maximum":
        return bound, bound + 1
    if keyword == "pattern":
        assert arg == "category", arg
        return "decision", "Decision"
    if arg == "cursor":
        assert keyword == "maxLength"
        # The longest cursor a listing returns: after a 512-character key of 4-byte characters.
        return validation.encode_cursor("𠀀" * validation.KEY_MAX_LEN), "A" * (bound + 1)
    if arg == "tags":
        if keyword == "maxItems":
            return [f"t{i}" for i in range(bound)], [f"t{i}" for i in range(bound + 1)]
        if keyword == "items.maxLength":
            return ["t" * bound], ["t" * (bound + 1)]
        if keyword == "items.minLength":
            return ["t" * bound], ["t" * (bound - 1)]
    if keyword == "maxLength":
        return _string(arg, bound), _string(arg, bound + 1)
    if keyword == "minLength":
        return _string(arg, bound), _string(arg, bound - 1)
    raise AssertionError(f"no test values for {arg} {keyword}: add them here")


def test_every_tool_states_the_bounds_of_its_arguments():
    stated = {(name, arg, keyword) for name, arg, keyword, _ in _bounds()}
    for name, arg, keyword in [
        ("memory_write", "key", "maxLength"),
        ("memory_write", "ttl_seconds", "maximum"),
        ("memory_write", "tags", "maxItems"),
        ("memory_write", "tags", "items.maxLength"),
        ("memory_write", "subject", "maxLength"),
        ("memory_write", "category", "pattern"),
        ("memory_update", "expected_version", "maximum"),
        ("memory_list", "cursor", "maxLength"),
        ("memory_search", "query", "maxLength"),
        ("memory_search", "max_chars", "maximum"),
        ("memory_recall", "max_chars", "minimum"),
        ("memory_summarize", "prefix", "maxLength"),
    ]:
        assert (name, arg, keyword) in stated


def _rows(tenant) -> list[tuple]:
    return list(Memory.objects.filter(tenant=tenant).order_by("id").values_list("key", "version", "deleted_at"))


@pytest.fixture
def caller(tenant_a):
    key, _raw = make_key(tenant_a)
    actor = Actor(kind=ActorKind.API_KEY, id=str(key.pk), label=key.display_prefix, scopes=frozenset(key.scopes))
    write(tenant_a, KEY, "v")
    return key, actor.with_surface("mcp")


@pytest.mark.parametrize(("name", "arg", "keyword", "bound"), _bounds())
def test_a_value_at_a_schemas_bound_is_taken_and_one_past_it_refused_by_schema_and_service(
    caller, tenant_a, name, arg, keyword, bound
):
    key, actor = caller
    schema = Draft202012Validator(tools.TOOLS[name].mcp()["inputSchema"])
    at, past = _at_and_past(arg, keyword, bound)

    arguments = {**BASE[name], arg: at}
    assert schema.is_valid(arguments)
    result = mcp_server.answer(key, actor, name, arguments)[0]
    assert result["status"] != "error", result

    arguments = {**BASE[name], arg: past}
    assert not schema.is_valid(arguments)
    before = _rows(tenant_a)
    result = mcp_server.answer(key, actor, name, arguments)[0]
    assert result["status"] == "error" and result["error"]["field"] == arg, result
    assert _rows(tenant_a) == before
