"""The tool registry: each tool's name, description, parameters and the service it calls,
side by side. The OpenAI, Anthropic and MCP schemas are all generated from it.

:func:`tool_call` takes a call as the model emitted it, checks its shape once, runs the
tool's service and answers with a compact dict that goes straight back to the model:
``ok``, ``not_found`` and ``conflict`` are results (a service's :class:`NotFound` and
:class:`Conflict` become them); a wrong call is an ``error`` result with the error's HTTP
status, recorded as ``tool.call`` when it is the call itself that is malformed.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from django.db import DatabaseError

from audit.services import audited_operation
from memories import services
from memories.models import Memory, Tenant
from memories.services import idempotency, summaries
from zeromem.kernel import hotsql, tracing, validation
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import Conflict, Erased, InvalidInput, NotFound, ServiceError
from zeromem.kernel.outcomes import Outcome
from zeromem.kernel.tokens import compact_json

# A memory value is any JSON. OpenAI's strict mode cannot express a free-form object, so
# the strict schema offers scalars (a structured value can be sent as a JSON string);
# `?strict=false` and the Anthropic/MCP schemas accept any JSON.
ANY_JSON: dict = {"description": "any JSON value"}
STRICT_SCALAR: list[dict] = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]


@dataclass(frozen=True)
class Param:
    name: str
    schema: dict  # JSON Schema of a present value
    description: str
    required: bool = False


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: tuple[Param, ...]
    run: Callable[[Tenant, Actor, dict], dict]

    def input_schema(self) -> dict:
        """Plain JSON Schema (Anthropic ``input_schema``, MCP ``inputSchema``)."""
        return {
            "type": "object",
            "properties": {p.name: {**p.schema, "description": p.description} for p in self.params},
            "required": [p.name for p in self.params if p.required],
            "additionalProperties": False,
        }

    def openai(self, *, strict: bool = True) -> dict:
        if not strict:
            parameters = self.input_schema()
        else:
            # Strict mode: every property listed in `required`; optional ones accept null.
            props = {}
            for p in self.params:
                schema, bounds = _strict(p.schema)
                if not p.required:
                    schema = _nullable(schema)
                props[p.name] = {**schema, "description": f"{p.description} ({bounds})" if bounds else p.description}
            parameters = {
                "type": "object",
                "properties": props,
                "required": [p.name for p in self.params],
                "additionalProperties": False,
            }
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": parameters,
                "strict": strict,
            },
        }

    def anthropic(self) -> dict:
        return {"name": self.name, "description": self.description, "input_schema": self.input_schema()}

    def mcp(self) -> dict:
        return {"name": self.name, "description": self.description, "inputSchema": self.input_schema()}


# OpenAI's strict mode takes a subset of JSON Schema that may refuse string lengths (its SDK's
# docs: "minLength and maxLength can be rejected by the API"), and a refused schema fails the
# whole request: the strict schema says them in its description instead.
_LENGTHS = ("minLength", "maxLength")


def _strict(schema: dict) -> tuple[dict, str]:
    """``schema`` in OpenAI's strict subset, and the bounds it had to leave out, in words."""
    if schema is ANY_JSON:
        return {"anyOf": STRICT_SCALAR}, ""
    strict = {k: v for k, v in schema.items() if k not in _LENGTHS}
    bounds = _length_words(schema)
    if "items" in schema:
        strict["items"], each = _strict(schema["items"])
        bounds = bounds or (f"each {each}" if each else "")
    return strict, bounds


def _length_words(schema: dict) -> str:
    low, high = schema.get("minLength"), schema.get("maxLength")
    if high is None:
        return f"at least {low} characters" if low else ""
    return f"{low}-{high} characters" if low else f"at most {high} characters"


def _nullable(schema: dict) -> dict:
    if "anyOf" in schema:
        return {"anyOf": [*schema["anyOf"], {"type": "null"}]}
    return {**schema, "type": [schema["type"], "null"]}


def _updated_at(memory: Memory) -> str:
    return memory.updated_at.isoformat(timespec="seconds").replace("+00:00", "Z")


# --- the tools --------------------------------------------------------------------------


def _write(tenant: Tenant, actor: Actor, a: dict) -> dict:
    r = services.memory_write(
        tenant=tenant,
        actor=actor,
        key=a["key"],
        value=a["value"],
        ttl_seconds=a.get("ttl_seconds"),
        tags=a.get("tags"),
        subject=a.get("subject"),
        category=a.get("category"),
        sensitive=a.get("sensitive"),
    )
    return {"status": "ok", "key": r.key, "version": r.memory.version, "created": r.created}


def _read(tenant: Tenant, actor: Actor, a: dict) -> dict:
    try:
        # Never more than max_chars of the value into the model's context (README "Token cost").
        max_chars = a.get("max_chars", validation.READ_DEFAULT_CHARS)
        r = services.memory_read(
            tenant=tenant,
            actor=actor,
            key=a["key"],
            max_chars=max_chars,
            offset=a.get("offset"),
            default=a.get("default"),
        )
    except Erased:
        # Crypto-shredded (its subject was forgotten): an answer, not an error.
        return {"status": "erased", "key": a["key"]}
    except NotFound:
        out = {"status": "not_found", "key": a["key"]}
        if a.get("default") is not None:
            # The caller's fallback, as the seeds' degradation advice asks; the service checked it
            # as a written value (the tenant's value cap): it goes into the model's context.
            out["value"] = a["default"]
        return out
    m = r.memory
    out = {"status": "ok", "key": r.key, "value": m.value, "version": m.version, "updated_at": _updated_at(m)}
    if r.cut is not None:
        out.update(value=r.cut.text, truncated=r.cut.next_offset is not None, chars=r.cut.chars)
        if r.cut.next_offset is not None:
            out["next_offset"] = r.cut.next_offset
    return out


def _update(tenant: Tenant, actor: Actor, a: dict) -> dict:
    r = services.memory_update(
        tenant=tenant, actor=actor, key=a["key"], value=a["value"], expected_version=a.get("expected_version")
    )
    return {"status": "ok", "key": r.key, "version": r.memory.version, "created": False}


def _delete(tenant: Tenant, actor: Actor, a: dict) -> dict:
    services.memory_delete(tenant=tenant, actor=actor, key=a["key"])
    return {"status": "ok"}


def _list(tenant: Tenant, actor: Actor, a: dict) -> dict:
    r = services.memory_list(
        tenant=tenant, actor=actor, prefix=a.get("prefix") or "", limit=a.get("limit"), cursor=a.get("cursor")
    )
    return {"status": "ok", "keys": r.keys, "next_cursor": r.next_cursor}


def _search(tenant: Tenant, actor: Actor, a: dict) -> dict:
    # Never more than max_chars of each value into the model's context, as a read (README "Token cost").
    hits = services.memory_search(
        tenant=tenant,
        actor=actor,
        query=a["query"],
        prefix=a.get("prefix") or "",
        limit=a.get("limit"),
        max_chars=a.get("max_chars", validation.READ_DEFAULT_CHARS),
    )
    return {"status": "ok", "results": [_search_result(hit) for hit in hits]}


def _search_result(hit: services.SearchHit) -> dict:
    out = {"key": hit.memory.key, "value": hit.memory.value, "score": round(hit.score, 3)}
    if hit.cut is not None:
        # A first slice always has a rest: memory_read(key, offset=next_offset) reads on.
        out.update(value=hit.cut.text, truncated=True, chars=hit.cut.chars, next_offset=hit.cut.next_offset)
    return out


def _recall(tenant: Tenant, actor: Actor, a: dict) -> dict:
    r = services.memory_recall(
        tenant=tenant, actor=actor, query=a.get("query"), prefix=a.get("prefix") or "", max_chars=a.get("max_chars")
    )
    return {"status": "ok", "text": r["text"], "count": len(r["keys"])}


def _summarize(tenant: Tenant, actor: Actor, a: dict) -> dict:
    # Returns at once; the summary lands at summary:<prefix> (memories/services/summaries.py).
    job = services.summarize_start(tenant=tenant, actor=actor, prefix=a["prefix"])
    return {"status": "ok", "job_id": str(job.uid)}


# Each bound of a schema is the service's own (zeromem/kernel/validation.py): a value a schema
# allows passes the service's checks of that argument, and one past a bound fails both.
KEY = Param(
    "key", {"type": "string", "minLength": 1, "maxLength": validation.KEY_MAX_LEN}, "e.g. user:u10086:pref_lang", True
)
PREFIX = Param("prefix", {"type": "string", "maxLength": validation.KEY_MAX_LEN}, "key prefix, e.g. user:u10086:")
QUERY = Param(
    "query", {"type": "string", "minLength": 1, "maxLength": validation.QUERY_MAX_LEN}, "question or keywords", True
)
LIMIT = {"type": "integer", "minimum": 1, "maximum": validation.LIMIT_MAX}
MAX_CHARS = Param(
    "max_chars",
    {"type": "integer", "minimum": 1, "maximum": validation.READ_MAX_CHARS},
    f"default {validation.READ_DEFAULT_CHARS}",
)
RECALL_QUERY = Param(
    "query",
    {"type": "string", "maxLength": validation.QUERY_MAX_LEN},
    "question or keywords; leave out for the most important and recent memories under prefix",
)

TOOLS: dict[str, Tool] = {
    t.name: t
    for t in (
        Tool(
            "memory_write",
            "Save a memory under a key (creates or replaces).",
            (
                KEY,
                Param("value", ANY_JSON, "what to remember", True),
                Param(
                    "ttl_seconds",
                    {"type": "integer", "minimum": 1, "maximum": validation.TTL_MAX_SECONDS},
                    "expire after this many seconds",
                ),
                Param(
                    "tags",
                    {
                        "type": "array",
                        "items": {"type": "string", "minLength": 1, "maxLength": validation.TAG_MAX_LEN},
                        "maxItems": validation.TAGS_MAX,
                    },
                    "labels: letters, digits or _-.@+=~:",
                ),
                Param("subject", {"type": "string", "maxLength": validation.SUBJECT_MAX_LEN}, "end user this is about"),
                Param(
                    "category",
                    {
                        "type": "string",
                        "maxLength": validation.CATEGORY_MAX_LEN,
                        "pattern": validation.CATEGORY_PATTERN,
                    },
                    "user, task, decision, fact",
                ),
                Param("sensitive", {"type": "boolean"}, "personal data: store it encrypted"),
            ),
            _write,
        ),
        Tool(
            "memory_read",
            "Read the memory at a key. A value longer than max_chars comes back cut, as text, with "
            "truncated, chars (its whole length) and next_offset (pass it as offset for the rest).",
            (
                KEY,
                Param("default", ANY_JSON, "returned as value if the key is missing"),
                MAX_CHARS,
                Param(
                    "offset",
                    {"type": "integer", "minimum": 0, "maximum": validation.READ_OFFSET_MAX},
                    "next_offset of a cut read",
                ),
            ),
            _read,
        ),
        Tool(
            "memory_update",
            "Change an existing memory; pass expected_version to avoid overwriting a newer one.",
            (
                KEY,
                Param("value", ANY_JSON, "new value", True),
                Param(
                    "expected_version",
                    {"type": "integer", "minimum": 1, "maximum": validation.VERSION_MAX},
                    "version you read",
                ),
            ),
            _update,
        ),
        Tool("memory_delete", "Delete the memory at a key.", (KEY,), _delete),
        Tool(
            "memory_list",
            "List keys under a prefix.",
            (
                PREFIX,
                Param("limit", LIMIT, "max keys"),
                Param(
                    "cursor",
                    {"type": "string", "maxLength": validation.CURSOR_MAX_LEN},
                    "next_cursor of the previous page",
                ),
            ),
            _list,
        ),
        Tool(
            "memory_search",
            "Find memories relevant to a question or keywords, best first. A value longer than "
            "max_chars comes back cut as memory_read cuts it (truncated, chars, next_offset).",
            (
                QUERY,
                PREFIX,
                Param("limit", LIMIT, "default 5"),
                Param(MAX_CHARS.name, MAX_CHARS.schema, f"per result; {MAX_CHARS.description}"),
            ),
            _search,
        ),
        Tool(
            "memory_recall",
            "Get the memories relevant to a question (or, with only a prefix, the most important and "
            "recent ones) as one short text block.",
            (
                RECALL_QUERY,
                PREFIX,
                Param(
                    "max_chars",
                    {"type": "integer", "minimum": validation.RECALL_MIN_CHARS, "maximum": validation.RECALL_MAX_CHARS},
                    f"default {validation.RECALL_DEFAULT_CHARS}",
                ),
            ),
            _recall,
        ),
        Tool(
            "memory_summarize",
            "Compact the memories under a prefix into one summary memory (a background job).",
            (
                Param(
                    "prefix",
                    {"type": "string", "minLength": 1, "maxLength": summaries.PREFIX_MAX_LEN},
                    "e.g. session:s1:",
                    True,
                ),
            ),
            _summarize,
        ),
    )
}


# Tools whose cost grows with the tenant's data: each call takes a tenant slot (every surface
# that runs tool calls: the tool endpoint, MCP).
EXPENSIVE_TOOLS = frozenset({"memory_search", "memory_recall"})
# Tools whose first statement is a read the key's rate counter can ride with, sent as one
# statement (audit.limits.hit_riding; memories.services: memory_read's SELECT, the read of the
# memory memory_write writes over and memory_update updates): the tool endpoint's lane and MCP
# charge them so.
RIDING_TOOLS = frozenset({"memory_read", "memory_write", "memory_update"})


def tool_schemas(fmt: str, *, strict: bool = True) -> list[dict]:
    if fmt == "openai":
        return [t.openai(strict=strict) for t in TOOLS.values()]
    if fmt == "anthropic":
        return [t.anthropic() for t in TOOLS.values()]
    if fmt == "mcp":
        return [t.mcp() for t in TOOLS.values()]
    raise InvalidInput("must be openai, anthropic or mcp", field="format")


def call_id_of(body: Any) -> str | None:
    """The id a model gave its call (OpenAI ``id``, or ``tool_call_id``), if any; read
    before anything else so that even a call too broken to parse is answered with it."""
    if not isinstance(body, dict):
        return None
    call_id = body.get("id") if isinstance(body.get("id"), str) else body.get("tool_call_id")
    return call_id if isinstance(call_id, str) else None


# --- a call's shape -----------------------------------------------------------------------
# The rules (and the messages) of the OpenAPI description, memories.api.serializers
# .ToolCallSerializer: ``id`` a string or null, ``name`` a string, ``arguments`` an object or
# that object as a JSON string, ``type`` "function", ``function`` an object with a ``name``
# and optional ``arguments``. The first broken field, in that order, is the one named.


def _string_field(body: dict, name: str, field: str, *, required: bool = False, nullable: bool = False) -> None:
    if name not in body:
        if required:
            raise InvalidInput("This field is required.", field=field, code="required")
        return
    value = body[name]
    if value is None and nullable:
        return
    if value == "" or str(value).strip() == "":
        raise InvalidInput("This field may not be blank.", field=field, code="blank")
    if value is None:
        raise InvalidInput("This field may not be null.", field=field, code="null")
    if not isinstance(value, str):
        raise InvalidInput("Not a valid string.", field=field)


def _arguments_field(body: dict, field: str) -> None:
    if "arguments" not in body:
        return
    value = body["arguments"]
    if value is None:
        raise InvalidInput("This field may not be null.", field=field, code="null")
    if not isinstance(value, (dict, str)):
        raise InvalidInput("must be an object, or the object as a JSON string", field=field)


def _check_shape(body: Any, prefix: str) -> None:
    if not isinstance(body, dict):
        raise InvalidInput("a tool call must be a JSON object", field=prefix.rstrip(".") or "body")
    _string_field(body, "id", f"{prefix}id", nullable=True)
    _string_field(body, "name", f"{prefix}name")
    _arguments_field(body, f"{prefix}arguments")
    if "type" in body:
        kind = body["type"]
        if kind is None:
            raise InvalidInput("This field may not be null.", field=f"{prefix}type", code="null")
        if str(kind) != "function":
            raise InvalidInput(f'"{kind}" is not a valid choice.', field=f"{prefix}type", code="invalid_choice")
    if "function" in body:
        function = body["function"]
        field = f"{prefix}function"
        if function is None:
            raise InvalidInput("This field may not be null.", field=field, code="null")
        if not isinstance(function, dict):
            raise InvalidInput(f"Invalid data. Expected a dictionary, but got {type(function).__name__}.", field=field)
        _string_field(function, "name", f"{field}.name", required=True)
        _arguments_field(function, f"{field}.arguments")


def _parse(body: Any) -> tuple[str, dict]:
    """(tool name, arguments) of a call as models emit it: ``{"name", "arguments"}`` or an
    OpenAI tool call ``{"id", "type": "function", "function": {"name", "arguments"}}``;
    arguments may be an object or a JSON string."""
    _check_shape(body, "")
    prefix = ""
    if "function" in body:
        body, prefix = body["function"], "function."
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput("the tool name is required", field=f"{prefix}name", code="required")
    arguments = body.get("arguments", {})
    if isinstance(arguments, str):
        text, reason = arguments, None
        try:
            arguments = (
                validation.loads_unique(text, parse_constant=_no_constant, parse_float=_finite) if text.strip() else {}
            )
        except validation.DuplicateKey as exc:  # as zeromem.kit.parsers refuses one in a body
            where = validation.duplicate_key_field(text, prefix=f"{prefix}arguments") or f"{prefix}arguments"
            raise InvalidInput(
                f"is not valid JSON here: the object {exc}, each name may appear once",
                field=where,
                code="duplicate_key",
            ) from None
        except RecursionError:  # nested past the interpreter's recursion limit
            reason = "nested too deeply"
        except ValueError as exc:  # a syntax error, or an integer past Python's 4300 digits
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        if reason is not None:
            raise InvalidInput(f"is not valid JSON ({reason})", field=f"{prefix}arguments", code="malformed_json")
        where = validation.lone_surrogate_field(text, arguments)
        if where is not None:  # as zeromem.kit.parsers refuses one in a body
            field = f"{prefix}arguments" + ("" if where == "body" else f".{where}")
            raise InvalidInput(
                "must be valid Unicode: a lone surrogate (half of a UTF-16 pair) cannot be stored",
                field=field,
                code="invalid_characters",
            )
    if not isinstance(arguments, dict):
        raise InvalidInput("must be a JSON object", field=f"{prefix}arguments")
    return name, arguments


def _no_constant(name: str):
    # Python's json reads NaN and Infinity, which no JSON answer could carry back.
    raise json.JSONDecodeError(f"{name} is not a JSON number", name, 0)


def _finite(text: str) -> float:
    number = float(text)
    if math.isinf(number):  # 1e999
        raise json.JSONDecodeError(f"{text} is out of range", text, 0)
    return number


def _resolve(name: str, arguments: dict) -> tuple[Tool, dict]:
    """The tool and its arguments, once the call names a tool and gives what it takes."""
    tool = TOOLS.get(name)
    if tool is None:
        raise InvalidInput(f"unknown tool; available: {', '.join(TOOLS)}", field="name", code="unknown_tool")
    known = {p.name for p in tool.params}
    for arg in arguments:
        if arg not in known:
            # Named by at most its first 64 characters: the name goes into the answer twice and
            # into the audit event's detail, which a name of the body's size would fill.
            shown = arg[:64]
            raise InvalidInput(f"{name} takes no argument '{shown}'", field=shown, code="unknown_argument")
    # Strict-mode models send null for optional arguments they leave out; a required one
    # sent as null is as missing as one left out. A null ``value`` goes on to the service,
    # which refuses it with its reason.
    arguments = {k: v for k, v in arguments.items() if v is not None or k == "value"}
    for p in tool.params:
        if p.required and p.name not in arguments:
            raise InvalidInput("is required", field=p.name, code="required")
        if p.schema.get("type") == "integer" and p.name in arguments:
            # As the schema says and REST bodies hold (StrictIntegerField): a JSON integer. The
            # services parse ASCII digits too (REST query strings), which took "10" here.
            given = arguments[p.name]
            if isinstance(given, bool) or not isinstance(given, int):
                raise InvalidInput('must be an integer (a JSON number such as 10, not "10")', field=p.name)
    return tool, arguments


# --- running calls ------------------------------------------------------------------------


def called_tool(call):
    """The tool a call names, unchecked: the one :func:`tool_call` runs — OpenAI's
    ``function.name`` when the call has a ``function``, else its plain ``name``. (A call with
    both, naming a cheap tool in ``name`` and a search in ``function``, took no tenant slot
    and let any tool run with the rate counter held for a read: found by review.)"""
    data = call if isinstance(call, dict) else {}
    if "function" in data:
        function = data["function"]
        return function.get("name") if isinstance(function, dict) else None
    return data.get("name")


class ToolAnswer(NamedTuple):
    result: dict  # what goes back to the model
    http_status: int  # 200, or the error's status for an ``error`` result


def tool_call(*, tenant: Tenant, actor: Actor, call: Any) -> ToolAnswer:
    """Run one call as the model emitted it. A call that is malformed, names no tool or
    gives wrong arguments is refused and recorded as ``tool.call``; a call that reaches its
    service is recorded by the service (``memory.write``, ...), whatever the outcome. Every
    answer, an error too, carries the call's ``tool_call_id`` when it had one.

    Cost: the service's, plus nothing for the parsing (no query).

    Traced (ZEROMEM_TRACING) as a span ``tool <name>`` with the tool's name (a registry name,
    never what the client sent), the outcome (the result's status) and the tenant's slug;
    never a key, prefix, query or value."""
    call_id = call_id_of(call)
    with tracing.span("tool", tenant=tenant.slug) as traced:
        try:
            # Parsing reads and writes nothing (a refusal's event is written after): no transaction.
            with audited_operation(tenant=tenant, actor=actor, action="tool.call", atomic=False, traced=False):
                tool, arguments = _resolve(*_parse(call))
            if tool.name not in RIDING_TOOLS:
                # The caller held the rate counter for a read this tool may not begin with: it
                # goes now, alone, before the tool's statements (past the limit: OverLimit).
                hotsql.send_rider()
            traced.rename(f"tool {tool.name}", tool=tool.name)
            answer = ToolAnswer(_run(tool, tenant, actor, arguments), 200)
        except ServiceError as exc:
            answer = ToolAnswer({"status": "error", "error": exc.as_dict()}, exc.http_status)
        traced.set("outcome", answer.result.get("status"))
    if call_id is not None:
        answer.result["tool_call_id"] = call_id
    return answer


def _run(tool: Tool, tenant: Tenant, actor: Actor, arguments: dict) -> dict:
    try:
        return tool.run(tenant, actor, arguments)
    except NotFound:
        return {"status": "not_found", "key": arguments["key"]}
    except Conflict as exc:
        return {"status": "conflict", "key": arguments["key"], "current_version": exc.extra.get("current_version")}


BATCH_MAX_CALLS = 50
# A batch stops running calls once its results hold this many bytes (as the answer renders
# them). One call answers at most ~3-6 MB (a search of 200 results of 16,384 characters), but
# 50 of them made one request of 5 KB build a 160 MB answer: 8 s and ~400 MB of one web
# process's memory, as many times at once as the tenant has slots.
BATCH_ANSWER_MAX_BYTES = 4 * 1024 * 1024
ANSWER_TOO_LARGE = "answer_too_large"
logger = logging.getLogger(__name__)


class BatchAnswer(NamedTuple):
    results: list[dict]  # one per call, in order
    pending: list[int]  # the calls that met a transient failure (idempotency.not_done): a retry runs them again


def tool_batch(*, tenant: Tenant, actor: Actor, body: Any, resume: BatchAnswer | None = None) -> BatchAnswer:
    """Run ``body["calls"]`` (1-50 calls; no other field) in order, each in its own transaction: one failing
    call does not undo the others, and each result stands alone. A batch with a call that is
    not shaped like a tool call is malformed: refused whole (InvalidInput), nothing runs;
    well-shaped calls that fail (unknown tool, bad key) fail alone.

    Once the results so far hold ``BATCH_ANSWER_MAX_BYTES``, the calls left are not run: each
    answers an ``answer_too_large`` error naming it (send it again), and the batch records one
    ``tool.batch`` event (``invalid``, ``count``: the calls not run).

    ``resume``: an earlier answer to this very batch (its Idempotency-Key's) whose ``pending``
    calls met a transient failure: those alone run again, the others keep their results — the
    calls that committed are not done twice, and the retry gets what the first attempt did not.

    Cost: the calls', plus one serialization of each result to count its bytes."""
    calls = body.get("calls") if isinstance(body, dict) else None
    if not isinstance(calls, list) or not calls:
        raise InvalidInput("must be a non-empty list of tool calls", field="calls")
    unknown = sorted(set(body) - {"calls"})
    if unknown:  # as every closed body of the API: a misspelt option is refused, not ignored
        raise InvalidInput(f"unknown field '{unknown[0]}'", field=unknown[0], code="unknown_field")
    if len(calls) > BATCH_MAX_CALLS:
        raise InvalidInput(f"at most {BATCH_MAX_CALLS} calls per batch", field="calls", code="too_many")
    for i, call in enumerate(calls):
        _check_shape(call, f"calls.{i}.")
    if resume is not None and len(resume.results) != len(calls):
        resume = None  # not this batch's answer (the fingerprint says it is): run it whole
    results: list[dict] = []
    pending: list[int] = []
    size, cut, not_run = 0, None, 0
    for i, call in enumerate(calls):
        if resume is not None and i not in resume.pending:
            result = resume.results[i]
        elif cut is not None or size >= BATCH_ANSWER_MAX_BYTES:
            cut = (i, size) if cut is None else cut
            result = _not_run(call, i)
            not_run += 1
        else:
            result, transient = _batch_call(tenant, actor, call)
            if transient:
                pending.append(i)
        size += _answer_bytes(result)
        results.append(result)
    if cut is not None:
        with audited_operation(tenant=tenant, actor=actor, action="tool.batch", atomic=False) as op:
            detail = {"code": ANSWER_TOO_LARGE, "field": f"calls.{cut[0]}", "answer_bytes": cut[1]}
            op.record(outcome=Outcome.INVALID, count=not_run, detail=detail)
    return BatchAnswer(results, pending)


def _answer_bytes(result: dict) -> int:
    return len(compact_json(result))  # as the answer renders it


def _not_run(call: Any, index: int) -> dict:
    message = (
        f"not run: the batch's answer reached {BATCH_ANSWER_MAX_BYTES} bytes before this call; "
        "send it again (alone, or in a later batch)"
    )
    result = {"status": "error", "error": {"code": ANSWER_TOO_LARGE, "message": message, "field": f"calls.{index}"}}
    call_id = call_id_of(call)
    if call_id is not None:
        result["tool_call_id"] = call_id
    return result


def _batch_call(tenant: Tenant, actor: Actor, call: Any) -> tuple[dict, bool]:
    """(the call's result, whether it met a transient failure: 429, 5xx)."""
    # Earlier calls have committed by the time a later one runs, so an unexpected failure
    # (a bug, the database going away) must be that call's result, not a 500 for the batch
    # that would hide what was already written.
    try:
        answer = tool_call(tenant=tenant, actor=actor, call=call)
        return answer.result, idempotency.not_done(answer.http_status)
    except DatabaseError:
        logger.warning("tool batch: call failed on the database", exc_info=True)
        error = {"code": "database_unavailable", "message": "the database is unavailable; retry", "field": None}
    except Exception:
        logger.exception("tool batch: call failed")
        error = {"code": "internal_error", "message": "this call failed on the server", "field": None}
    result = {"status": "error", "error": error}
    call_id = call_id_of(call)
    if call_id is not None:
        result["tool_call_id"] = call_id
    return result, True
