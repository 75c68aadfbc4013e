"""Tool schemas ready to paste into OpenAI / Anthropic / MCP, the OpenAPI document, the
offline API docs and the health check."""

import re

import pytest
import yaml
from django.db import connection

from tests.helpers import rest_error

TOOL_NAMES = {
    "memory_write",
    "memory_read",
    "memory_update",
    "memory_delete",
    "memory_list",
    "memory_search",
    "memory_recall",
    "memory_summarize",
}
REQUIRED = {
    "memory_write": {"key", "value"},
    "memory_read": {"key"},
    "memory_update": {"key", "value"},
    "memory_delete": {"key"},
    "memory_list": set(),
    "memory_search": {"query"},
    "memory_recall": set(),  # a prefix alone recalls the most important and recent memories
    "memory_summarize": {"prefix"},
}


def _accepts_null(schema: dict) -> bool:
    types = schema.get("type")
    if types == "null" or (isinstance(types, list) and "null" in types):
        return True
    return any(_accepts_null(s) for s in schema.get("anyOf", []))


def _tools(api, **params):
    r = api.get("/api/v1/tools", params)
    assert r.status_code == 200, r.content
    return r.json()


def test_openai_schema_is_strict_mode_compatible(api):
    body = _tools(api, format="openai")
    assert body["format"] == "openai"
    tools = body["tools"]
    assert {t["function"]["name"] for t in tools} == TOOL_NAMES
    for tool in tools:
        fn = tool["function"]
        name = fn["name"]
        assert tool["type"] == "function"
        assert fn["strict"] is True
        assert fn["description"]
        params = fn["parameters"]
        assert params["type"] == "object"
        assert params["additionalProperties"] is False
        assert set(params["required"]) == set(params["properties"]), name
        for prop, schema in params["properties"].items():
            assert "type" in schema or "anyOf" in schema, (name, prop)
            assert schema.get("description"), (name, prop)
            if prop in REQUIRED[name]:
                assert not _accepts_null(schema), (name, prop)
            else:
                assert _accepts_null(schema), (name, prop)


def _keywords(schema: dict) -> set[str]:
    found = set(schema)
    for part in [*([schema["items"]] if "items" in schema else []), *schema.get("anyOf", [])]:
        found |= _keywords(part)
    return found


def test_openai_strict_schema_states_string_lengths_in_words_not_keywords(api):
    # Strict mode takes a subset of JSON Schema in which OpenAI may refuse minLength/maxLength
    # (the whole tool list is then a 400): the bound is said in the description instead.
    strict = {t["function"]["name"]: t["function"]["parameters"] for t in _tools(api, format="openai")["tools"]}
    for name, parameters in strict.items():
        for prop, schema in parameters["properties"].items():
            assert not _keywords(schema) & {"minLength", "maxLength"}, (name, prop)
    write = strict["memory_write"]["properties"]
    assert "1-512 characters" in strict["memory_read"]["properties"]["key"]["description"]
    assert "at most 255 characters" in write["subject"]["description"]
    assert "each 1-64 characters" in write["tags"]["description"]
    assert write["tags"]["maxItems"] == 20 and write["ttl_seconds"]["maximum"] == 315360000
    loose = _tools(api, format="openai", strict="false")["tools"][0]["function"]["parameters"]
    assert loose["properties"]["key"]["maxLength"] == 512


def test_openai_is_the_default_format(api):
    assert _tools(api) == _tools(api, format="openai")


def test_openai_non_strict_lists_only_required_arguments(api):
    tools = _tools(api, format="openai", strict="false")["tools"]
    for tool in tools:
        fn = tool["function"]
        assert fn["strict"] is False
        assert set(fn["parameters"]["required"]) == REQUIRED[fn["name"]]
        assert fn["parameters"]["additionalProperties"] is False


def test_anthropic_schema_has_name_description_input_schema(api):
    tools = _tools(api, format="anthropic")["tools"]
    assert {t["name"] for t in tools} == TOOL_NAMES
    for tool in tools:
        assert set(tool) == {"name", "description", "input_schema"}
        schema = tool["input_schema"]
        assert schema["type"] == "object"
        assert schema["additionalProperties"] is False
        assert set(schema["required"]) == REQUIRED[tool["name"]]
        assert set(schema["required"]) <= set(schema["properties"])


def test_mcp_schema_has_input_schema(api):
    tools = _tools(api, format="mcp")["tools"]
    assert {t["name"] for t in tools} == TOOL_NAMES
    anthropic = {t["name"]: t["input_schema"] for t in _tools(api, format="anthropic")["tools"]}
    for tool in tools:
        assert set(tool) == {"name", "description", "inputSchema"}
        assert tool["inputSchema"] == anthropic[tool["name"]]


def test_every_schema_argument_is_accepted_by_the_call_endpoint(api):
    # The schema and the dispatcher agree: no advertised argument is "unknown".
    for tool in _tools(api, format="anthropic")["tools"]:
        args = {p: None for p in tool["input_schema"]["properties"]}
        r = api.post("/api/v1/tools/call", {"name": tool["name"], "arguments": args})
        assert not (r.status_code == 400 and r.json()["error"]["code"] == "unknown_argument"), tool["name"]


@pytest.mark.parametrize("fmt", ["gemini", "OPENAI", "json", ""])
def test_unknown_format_is_400_naming_format(api, fmt):
    r = api.get("/api/v1/tools", {"format": fmt})
    assert r.status_code == 400
    assert rest_error(r)["field"] == "format"


# --- OpenAPI and docs -------------------------------------------------------------------


def test_openapi_schema_lists_the_tool_and_memory_paths(anonymous):
    r = anonymous.get("/api/v1/schema")
    assert r.status_code == 200
    doc = yaml.safe_load(r.content)
    assert doc["openapi"].startswith("3.")
    assert doc["info"]["title"] == "ZeroMem API"
    paths = doc["paths"]
    for path in [
        "/api/v1/tools/call",
        "/api/v1/tools/batch",
        "/api/v1/memories",
        "/api/v1/memories/{key}",
        "/api/v1/memories/{key}/history",
    ]:
        assert path in paths, path
    assert set(paths["/api/v1/memories/{key}"]) >= {"get", "put", "patch", "delete"}
    assert "post" in paths["/api/v1/tools/call"]
    assert doc["components"]["securitySchemes"]["ApiKey"]["scheme"] == "bearer"


def test_openapi_schema_gives_a_batch_answer_its_pending_calls(anonymous):
    """The batch's 200 holds ``results`` and ``pending`` (the indexes of the calls a retry with
    the same Idempotency-Key runs again), both always there."""
    doc = yaml.safe_load(anonymous.get("/api/v1/schema").content)
    ok = doc["paths"]["/api/v1/tools/batch"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    schema = doc["components"]["schemas"][ok["$ref"].rsplit("/", 1)[1]]
    assert set(schema["required"]) >= {"results", "pending"}
    assert schema["properties"]["pending"]["type"] == "array"
    assert schema["properties"]["pending"]["items"] == {"type": "integer", "minimum": 0}


def test_api_docs_page_uses_only_local_assets(anonymous):
    r = anonymous.get("/api/v1/docs")
    assert r.status_code == 200
    assert r["Content-Type"].startswith("text/html")
    html = r.content.decode()
    assets = re.findall(r"""<(?:script|link)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", html, flags=re.I)
    assert assets, "the docs page loads no scripts or styles at all?"
    external = [a for a in assets if re.match(r"(?:https?:)?//", a, flags=re.I)]
    assert external == []
    assert not re.search(r"""["'](?:https?:)?//[^"']*\.(?:js|css)\b""", html, flags=re.I)
    # The referenced assets are really served by the app itself.
    for asset in assets:
        if asset.endswith((".js", ".css")):
            assert anonymous.get(asset).status_code == 200, asset


def test_healthz_reports_the_database_vendor(anonymous):
    r = anonymous.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "database": connection.vendor}
