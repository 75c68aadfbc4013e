"""The MCP endpoint: streamable HTTP at ``/mcp`` with the official ``mcp`` SDK (README "MCP").

- **Tools**: every ``memory_*`` tool of the one registry (:mod:`memories.tools`): ``tools/list``
  answers their MCP schemas (``Tool.mcp()``), ``tools/call`` runs
  :func:`memories.tools.tool_call` — the service call of ``POST /api/v1/tools/call`` — with an
  actor of ``surface="mcp"``: the same scopes, allowlist and audit rows, the same per-key rate
  limit (one unit a call) and tenant slots (search and recall). Every other message
  (``initialize``, ``tools/list``, ``ping``, notifications) costs a unit of that limit too
  (:class:`RateLimit`), refused over it with ``429 rate_limited``. A ZeroMem error is an MCP tool
  error (``isError``) whose text and ``structuredContent`` are ``{"status":"error","error":
  {"code","message","field"}}``; ``ok``, ``not_found`` and ``conflict`` are results. Every
  result's ``_meta`` carries its text's size and estimated tokens (``zeromem/resultBytes``,
  ``zeromem/resultTokens``), counted in the tenant's tokens returned per day.
- **Auth**: ``Authorization: Bearer zm_…`` through the SDK's token-verifier hook
  (``TokenVerifier`` + ``AuthSettings``), verified by ZeroMem's key service
  (:func:`memories.services.api_keys.verify_api_key`: the same key cache, failed-auth throttle
  and audit as the REST API; route ``/mcp``). A refused key is the SDK's 401; a throttled
  address or key prefix is 429 with ``Retry-After``, in ZeroMem's error shape.
- **Stateless** (``stateless_http``, JSON responses): no session lives in a process, so any
  number of server processes can answer any request. So no stream to open and no session to
  end: ``GET``, ``DELETE`` and any other method but ``POST`` are ``405`` (``Allow: POST``),
  as the transport lets a server without them answer, before any key lookup.
- **Transport security** from Django's ``ALLOWED_HOSTS`` (:func:`transport_security`).

Sync Django work (the key lookup, the tool's service) runs in worker threads, at most
``ZEROMEM_WEB_THREADS`` at once per process (the connection pool is sized for that many), and
hands its pooled connection back when it ends.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import os
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import anyio
import mcp_types as types
import pydantic_core
from django.conf import settings
from django.db import DatabaseError, close_old_connections
from django.http.request import split_domain_port, validate_host
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.lowlevel import Server
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR
from pydantic import ConfigDict, ValidationError

from audit import limits
from audit.services import AuthThrottled, audit_refusal
from memories import tools
from memories.mcp import INSTRUCTIONS, SERVER_NAME
from memories.models import ApiKey
from memories.services import api_keys, usage
from zeromem.kernel import tracing, validation
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import InvalidInput, TenantBusy, Unauthenticated
from zeromem.kernel.tokens import cost_of
from zeromem.kit import metrics
from zeromem.kit.api import slot_wait
from zeromem.kit.http import client_ip_of, request_id_for
from zeromem.serving import web_threads

logger = logging.getLogger(__name__)

PATH = "/mcp"
SURFACE = "mcp"
# The result's cost in the tool result's ``_meta`` (README "MCP"): the size in bytes and the
# estimated tokens of its text content, as ``ZeroMem-Result-Bytes``/``-Tokens`` on REST.
META_BYTES = "zeromem/resultBytes"
META_TOKENS = "zeromem/resultTokens"
# The JSON-RPC error of a message over the key's rate limit (implementation-defined server
# error range); the endpoint answers the HTTP request 429 instead (RateLimit).
RATE_LIMITED = -32029


# --- the request's context, as the router's wrapper saw it ------------------------------


@dataclass
class _Request:
    client_ip: str | None
    request_id: str
    throttled: float | None = None  # Retry-After, when a failed authentication was throttled
    unavailable: bool = False  # the database could not be asked about the key
    rate_limited: int | None = None  # Retry-After, when the key was over its rate limit
    key: ApiKey | None = None  # the verified key
    charged: bool = False  # a unit of the key's rate limit was taken for this HTTP request
    refused: BodyRefusal | None = None  # a body refused before the SDK parses it (_body_refusal)


_current: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("zeromem_mcp_request", default=None)
_limiter: anyio.CapacityLimiter | None = None
# The thread pool Django's requests run in (zeromem/asgi.py hands it over), so that MCP calls
# and Django requests share one pool of ZEROMEM_WEB_THREADS threads — and the database
# connection pool sized for them. Without one, anyio's threads, as many at once.
_executor: Executor | None = None


def _threads() -> anyio.CapacityLimiter:
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(web_threads(os.environ))
    return _limiter


async def _in_thread(fn, *args):
    """``fn(*args)`` in a worker thread; its database connection goes back to the pool after."""

    def run():
        try:
            return fn(*args)
        finally:
            close_old_connections()

    if _executor is not None:
        if tracing.on():  # the thread's spans (the tool's, SQL) belong to this request's trace
            return await asyncio.get_running_loop().run_in_executor(_executor, contextvars.copy_context().run, run)
        return await asyncio.get_running_loop().run_in_executor(_executor, run)
    return await anyio.to_thread.run_sync(run, limiter=_threads())


# --- the token verifier (the SDK's hook) ----------------------------------------------------


class KeyAccessToken(AccessToken):
    """The SDK's access token, carrying the verified key (and its tenant) to the handlers."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    api_key: Any = None


class ApiKeyVerifier:
    """``TokenVerifier``: a ZeroMem API key, verified by the key service."""

    async def verify_token(self, token: str) -> AccessToken | None:
        request = _current.get() or _Request(client_ip=None, request_id=request_id_for(""))
        try:
            key: ApiKey = await _in_thread(
                lambda: api_keys.verify_api_key(
                    token, route=PATH, surface=SURFACE, client_ip=request.client_ip, request_id=request.request_id
                )
            )
        except Unauthenticated:
            return None
        except AuthThrottled as exc:
            request.throttled = exc.retry_after
            return None
        except DatabaseError:
            request.unavailable = True  # the wrapper answers 503 instead of the SDK's 401
            return None
        request.key = key
        return KeyAccessToken(token=token, client_id=str(key.pk), scopes=list(key.scopes), api_key=key)


# --- the tools --------------------------------------------------------------------------------


def _tool_list() -> types.ListToolsResult:
    return types.ListToolsResult(tools=[types.Tool.model_validate(t.mcp()) for t in tools.TOOLS.values()])


_TOOL_LIST = None


async def list_tools(ctx, params) -> types.ListToolsResult:
    global _TOOL_LIST
    if _TOOL_LIST is None:
        _TOOL_LIST = _tool_list()
    return _TOOL_LIST


def _error(code: str, message: str, **extra) -> dict:
    return {"status": "error", "error": {"code": code, "message": message, "field": None, **extra}}


def _refused(key: ApiKey, actor: Actor, exc: InvalidInput) -> dict:
    """A call refused before any tool ran (its arguments no parser of REST's would take): its
    error result, audited as REST audits the 400 (``tool.call`` ``invalid``, code and field)."""
    audit_refusal(tenant=key.tenant, actor=actor, action="tool.call", target="", error=exc)
    return {"status": "error", "error": exc.as_dict()}


def run_call(key: ApiKey, actor: Actor, name: str, arguments: dict) -> dict:
    """One tool call as ``POST /api/v1/tools/call`` runs it: the key's rate limit (one unit),
    a tenant slot for the expensive tools, then the registry's service call. For a
    ``memory_read`` or ``memory_write`` (``tools.RIDING_TOOLS``) the unit goes to the database
    with the call's first read, as on the tool endpoint's lane: over the limit, refused the
    same way before anything is answered, written or audited."""
    try:
        if name in tools.RIDING_TOOLS:
            try:
                with api_keys.rate_limit_riding(key):
                    return _charged_call(key, actor, name, arguments)
            except limits.OverLimit as over:
                return _rate_limited_result(_refused_over(key, actor, over.hit.retry_after, action="tool.call"))
        retry_after = charge(key, actor, action="tool.call")
        if retry_after is not None:
            return _rate_limited_result(retry_after)
        return _charged_call(key, actor, name, arguments)
    except DatabaseError:
        return _error("database_unavailable", "the database is unavailable; retry shortly", retry_after=2)
    except Exception:
        # A bug: the SDK would answer str(exc) to the client on some protocol versions (what
        # REST keeps behind a generic 500). Logged here, and a generic tool error there.
        logger.exception("mcp: tool call %s failed", name)
        return _error("internal_error", "this call failed on the server")


def _rate_limited_result(retry_after: int) -> dict:
    return _error("rate_limited", "Request was throttled.", retry_after=retry_after)


def _charged_call(key: ApiKey, actor: Actor, name: str, arguments: dict) -> dict:
    """:func:`run_call` once its unit is taken (or riding): the arguments MCP's parser lets
    through and REST's does not, refused; the tenant slot of an expensive tool; the call."""
    if (where := non_finite_field(arguments)) is not None:  # refused, charged all the same
        message = "is not valid JSON (NaN, Infinity and numbers past a double's range such as 1e400)"
        return _refused(key, actor, InvalidInput(message, field=where, code="malformed_json"))
    if (where := validation.lone_surrogate_path({"arguments": arguments})) is not None:
        # The 2026-07-28 path parses with Python's json, which reads "\ud800" (the 2025
        # path's parser refuses it): refused as REST's parser refuses it, naming where.
        message = "must be valid Unicode: a lone surrogate (half of a UTF-16 pair) cannot be stored"
        return _refused(key, actor, InvalidInput(message, field=where, code="invalid_characters"))
    tenant = key.tenant
    if name not in tools.EXPENSIVE_TOOLS:
        return tools.tool_call(tenant=tenant, actor=actor, call={"name": name, "arguments": arguments}).result
    holder = f"tenant:{tenant.pk}"
    token = slot_wait(holder)
    if token is None:
        exc = TenantBusy("this tenant already runs its limit of expensive requests; retry", retry_after=1)
        audit_refusal(tenant=tenant, actor=actor, action="tool.call", target="", error=exc)
        return {"status": "error", "error": exc.as_dict()}
    try:
        return tools.tool_call(tenant=tenant, actor=actor, call={"name": name, "arguments": arguments}).result
    finally:
        limits.slot_release(holder, token)


def non_finite_field(arguments: dict) -> str | None:
    """Where ``arguments`` holds NaN or ±infinity — the dotted path ("arguments.default.a.1"),
    at most 200 characters — else None. The SDK's JSON parser reads ``1e400`` as infinity and
    takes the literals ``NaN`` and ``Infinity``, which REST's parser refuses (``malformed_json``)
    and which no JSON answer can carry (memory_read echoes its ``default``)."""
    # Trails, not paths, on the stack (validation.dotted_path: memory linear in the containers).
    stack: list[tuple[Any, tuple]] = [(arguments, ("arguments", None))]
    while stack:
        item, trail = stack.pop()
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for name, child in children:
            if isinstance(child, float) and not math.isfinite(child):
                return validation.dotted_path((name, trail))
            if isinstance(child, dict | list):
                stack.append((child, (name, trail)))
    return None


def answer(key: ApiKey | None, actor: Actor | None, name: str, arguments: dict) -> tuple[dict, str, int, int]:
    """The call's result, its text content, and that text's size and estimated tokens — counted
    in the key's tenant's tokens returned per day, as the REST tool responses are."""
    if key is None:
        result = _error("missing_credentials", "send 'Authorization: Bearer zm_...'")
    else:
        result = run_call(key, actor, name, arguments)
    text = json.dumps(result, ensure_ascii=False, separators=(",", ":"))
    size, tokens = cost_of(text.encode())
    metrics.results_returned(SURFACE, size=size, tokens=tokens)
    if key is not None:
        usage.result_returned(tenant_id=key.tenant_id, size=size, tokens=tokens)
    return result, text, size, tokens


def _caller(ctx) -> tuple[ApiKey, Actor] | tuple[None, None]:
    """The verified key of the message's HTTP request and its actor (None, None without one)."""
    request = ctx.request
    user = request.scope.get("user") if request is not None else None
    if not isinstance(user, AuthenticatedUser) or not isinstance(user.access_token, KeyAccessToken):
        return None, None
    key: ApiKey = user.access_token.api_key
    seen = request.scope.get("zeromem") or {}
    return key, api_keys.key_actor(
        key, surface=SURFACE, request_id=seen.get("request_id", ""), client_ip=seen.get("client_ip")
    )


def charge(key: ApiKey, actor: Actor, *, action: str, target: str = "") -> int | None:
    """One unit of the key's rate limit: for each tool call (:func:`run_call`, ``tool.call``)
    and each other message (:class:`RateLimit`, ``mcp.request``). Over the limit: the
    Retry-After in seconds, the refusal counted like every refusal over a limit (one event
    per source and minute); else None."""
    wait = api_keys.rate_limit_take(key)
    if wait is None:
        return None
    return _refused_over(key, actor, wait, action=action, target=target)


def _refused_over(key: ApiKey, actor: Actor, wait: float, *, action: str, target: str = "") -> int:
    """A refusal over the key's rate limit, counted (one event per source and minute): the
    Retry-After in whole seconds."""
    retry_after = max(1, int(wait + 0.999))
    limited = TenantBusy("Request was throttled.", code="rate_limited", retry_after=retry_after)
    audit_refusal(tenant=key.tenant, actor=actor, action=action, target=target, error=limited)
    return retry_after


# An unknown method is named in the SDK's METHOD_NOT_FOUND error (its ``data``) and in an
# audit event's target by at most this many characters: the SDK echoed the name whole (a
# request of 1 MB, an answer of 1 MB), as tool calls name an unknown argument (memories/tools.py).
METHOD_SHOWN_MAX = 64


def shown_method(method: str) -> str:
    """``method`` as an answer or an audit event names it: its first ``METHOD_SHOWN_MAX``
    characters, then "…" when it is longer."""
    return method if len(method) <= METHOD_SHOWN_MAX else method[:METHOD_SHOWN_MAX] + "…"


class ShortMethodNames:
    """Server middleware: the SDK's METHOD_NOT_FOUND (raised inside the middleware chain, by
    the lookup or the spec's method table) names the method by :func:`shown_method`."""

    async def __call__(self, ctx, call_next):
        try:
            return await call_next(ctx)
        except MCPError as exc:
            data = exc.error.data
            if exc.error.code != METHOD_NOT_FOUND or not isinstance(data, str) or len(data) <= METHOD_SHOWN_MAX:
                raise
            raise MCPError(code=METHOD_NOT_FOUND, message=exc.error.message, data=shown_method(data)) from None


# What a request's params that the SDK's models refuse are said to be, by pydantic's error
# type, in the words REST's refusals use; any other type: pydantic's own short message.
PARAMS_SAID = {
    "missing": "is required",
    "string_type": "must be a string",
    "dict_type": "must be a JSON object",
    "model_type": "must be a JSON object",
    "model_attributes_type": "must be a JSON object",
    "list_type": "must be a list",
    "int_type": "must be an integer",
    "bool_type": "must be true or false",
}


def params_refusal(exc: ValidationError) -> InvalidInput:
    """The refusal of a request whose params the SDK's models refuse (a ``tools/call`` with
    no ``name``, a ``name`` that is no string, ``arguments`` that are no object): its first
    error, naming the member from the message's root (``params.name``, as
    :func:`short_refusal` names ``params``), without pydantic's text or the input."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    first = errors[0] if errors else {"loc": ("params",), "type": "", "msg": "is invalid"}
    field = ".".join(str(part) for part in first["loc"])[:METHOD_SHOWN_MAX] or "params"
    said = PARAMS_SAID.get(first["type"]) or first["msg"][:1].lower() + first["msg"][1:]
    code = "required" if first["type"] == "missing" else "invalid"
    return InvalidInput(f"'{field}' {said}"[:120], field=field, code=code)


def params_error(refusal: InvalidInput) -> MCPError:
    """The JSON-RPC error of :func:`params_refusal`: the SDK's -32602, its message naming the
    member, and the member in ``data`` (``{"field": "params.name"}``, as :func:`short_refusal`'s)
    instead of the SDK's ``data: ""``."""
    return MCPError(
        code=INVALID_PARAMS, message=f"Invalid request parameters: {refusal.message}", data={"field": refusal.field}
    )


class RateLimit:
    """Server middleware (the SDK's hook around every inbound message, ``initialize``
    included): a request other than ``tools/call`` (which :func:`run_call` charges) costs a
    unit of the key's rate limit — ``initialize``, ``tools/list``, ``ping``, each a verified
    request a client could otherwise loop for free — and so does a ``tools/call`` the SDK
    refuses for its params before :func:`call_tool` runs. Over the limit it runs nothing and
    the endpoint answers it ``429 rate_limited`` with Retry-After, as REST does. A
    notification is charged by the endpoint (:meth:`McpEndpoint.charge_notification`): the
    stateless transport answers it ``202`` before the server sees it, and then ends, mostly
    before this runs.

    A request whose params the SDK refuses is answered -32602 naming the member
    (:func:`params_error`), not the SDK's bare "Invalid request parameters"; a refused
    ``tools/call`` is audited as REST audits its 400 (``tool.call`` ``invalid``, code and field)."""

    async def __call__(self, ctx, call_next):
        if ctx.request_id is None:
            return await call_next(ctx)
        if ctx.method != "tools/call":
            await self._charge(ctx)
            try:
                return await call_next(ctx)
            except ValidationError as exc:
                raise params_error(params_refusal(exc)) from None
        try:
            return await call_next(ctx)
        except ValidationError as exc:
            # No name, arguments not an object: refused before call_tool (and its charge).
            await self._charge(ctx)
            refusal = params_refusal(exc)
            key, actor = _caller(ctx)
            if key is not None:
                try:
                    await _in_thread(
                        lambda: audit_refusal(tenant=key.tenant, actor=actor, action="tool.call", error=refusal)
                    )
                except DatabaseError:
                    raise MCPError(code=INTERNAL_ERROR, message="the database is unavailable; retry shortly") from None
            raise params_error(refusal) from None

    @staticmethod
    async def _charge(ctx) -> None:
        key, actor = _caller(ctx)
        if key is None:
            return
        request = (ctx.request.scope.get("zeromem") or {}).get("request")
        if request is not None:
            request.charged = True
        try:
            target = shown_method(ctx.method)
            retry_after = await _in_thread(lambda: charge(key, actor, action="mcp.request", target=target))
        except DatabaseError:
            raise MCPError(code=INTERNAL_ERROR, message="the database is unavailable; retry shortly") from None
        if retry_after is None:
            return
        if request is not None:
            request.rate_limited = retry_after
        raise MCPError(code=RATE_LIMITED, message="Request was throttled.", data={"retry_after": retry_after})


async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
    key, actor = _caller(ctx)
    request = (ctx.request.scope.get("zeromem") or {}).get("request") if ctx.request is not None else None
    if request is not None and key is not None:
        request.charged = True  # by run_call: the endpoint charges no other unit, whatever its status
    if key is None:
        result, text, size, tokens = answer(None, None, params.name, {})
    else:
        result, text, size, tokens = await _in_thread(answer, key, actor, params.name, dict(params.arguments or {}))
    return types.CallToolResult(
        content=[types.TextContent(text=text)],
        structured_content=result,
        is_error=result.get("status") == "error",
        _meta={META_BYTES: size, META_TOKENS: tokens},
    )


# --- the app ----------------------------------------------------------------------------------


def transport_security(allowed_hosts: list[str]) -> tuple[TransportSecuritySettings, bool]:
    """The SDK's Host/Origin checks from Django's ``ALLOWED_HOSTS``: each name, with any port,
    over http or https. Django's patterns the SDK cannot express (``*``, ``.example.com``)
    switch the SDK's check off and leave it to Django's own ``validate_host`` in the wrapper:
    returns (settings, whether the wrapper checks the Host)."""
    if any(h == "*" or h.startswith(".") for h in allowed_hosts):
        return TransportSecuritySettings(enable_dns_rebinding_protection=False), True
    hosts, origins = [], []
    for host in allowed_hosts:
        hosts += [host, f"{host}:*"]
        origins += [f"{scheme}://{host}{port}" for scheme in ("http", "https") for port in ("", ":*")]
    return TransportSecuritySettings(allowed_hosts=hosts, allowed_origins=origins), False


def tool_input_schema(name: str) -> dict | None:
    """The SDK's ``get_tool_input_schema`` hook: the tool's MCP ``inputSchema`` (None for no
    such tool). Without it the SDK's 2026-07-28 path ran ``tools/list`` through the server's
    middleware before each ``tools/call`` with arguments (to check its ``Mcp-Param-*``
    headers), which charged the call a second unit of the key's rate limit."""
    tool = tools.TOOLS.get(name)
    return tool.mcp()["inputSchema"] if tool is not None else None


def build_server() -> Server:
    server = Server(
        SERVER_NAME,
        version="0.1.0",
        title="ZeroMem memory",
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        get_tool_input_schema=tool_input_schema,
    )
    server.middleware.append(ShortMethodNames())  # inside the SDK's tracing middleware
    server.middleware.append(RateLimit())
    return server


class McpEndpoint:
    """``/mcp``: the SDK's streamable HTTP app behind a thin wrapper that records who is
    asking (client address, request id) for the verifier and the audit rows, audits a request
    without a bearer key, answers a throttled failed authentication 429, and echoes
    ``X-Request-ID``. ``session_manager.run()`` must be running (the router's lifespan)."""

    def __init__(self, executor: Executor | None = None):
        global _executor
        _executor = executor
        security, self.check_host = transport_security(list(settings.ALLOWED_HOSTS))
        self.server = build_server()
        self.sdk_app = self.server.streamable_http_app(
            streamable_http_path=PATH,
            stateless_http=True,
            json_response=True,
            transport_security=security,
            max_request_body_size=settings.ZEROMEM_MAX_BODY_BYTES,
            # No OAuth server here: the issuer is this service; no protected-resource metadata.
            auth=AuthSettings(issuer_url=settings.ZEROMEM_PUBLIC_URL or "http://localhost", resource_server_url=None),
            token_verifier=ApiKeyVerifier(),
        )
        self.session_manager = self.server.session_manager

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.sdk_app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        if self.check_host:
            domain, _port = split_domain_port(headers.get("host", ""))
            if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
                return await _send_json(send, 400, {"code": "bad_host", "message": "Invalid Host header"})
        client = scope.get("client")
        request = _Request(
            client_ip=client_ip_of(client[0] if client else None, headers.get("x-forwarded-for")),
            request_id=request_id_for(headers.get("x-request-id", "")),
        )
        if scope.get("method") != "POST":
            # Stateless: no stream to open (the SDK's GET was an SSE stream that never carried
            # a message, held open uncharged) and no session to end (DELETE).
            error = {"code": "method_not_allowed", "message": "this endpoint takes POST only (stateless)"}
            return await _send_json(send, 405, error, [(b"allow", b"POST")], request.request_id)
        scope = {
            **scope,
            "zeromem": {"client_ip": request.client_ip, "request_id": request.request_id, "request": request},
        }
        tracing.annotate(request_id=request.request_id)  # on the request's span, when tracing
        authorization = headers.get("authorization", "")
        # Two Authorization headers: the SDK verifies the first, the router's fair share of
        # threads (caller_of) counts the last, so one key with a made-up second header each
        # time was as many callers as it liked. Refused here, as REST refuses it (no key).
        repeated = sum(1 for k, _v in scope.get("headers") or [] if k.lower() == b"authorization") > 1
        if repeated or not authorization.lower().startswith("bearer "):
            # The SDK answers 401 without asking the verifier: audited (and throttled) here.
            code = "missing_credentials" if not authorization else "malformed_credentials"
            try:
                await _in_thread(
                    lambda: api_keys.auth_failure(
                        code=code,
                        route=PATH,
                        surface=SURFACE,
                        client_ip=request.client_ip,
                        request_id=request.request_id,
                    )
                )
            except AuthThrottled as exc:
                request.throttled = exc.retry_after
            except DatabaseError:
                pass  # not recorded; the SDK answers 401 all the same
        if request.throttled is not None:
            return await _throttled(send, request)
        if repeated:
            error = {"code": "malformed_credentials", "message": "send one Authorization header"}
            error["field"] = "Authorization"
            challenge = [(b"www-authenticate", b'Bearer error="invalid_request"')]
            return await _send_json(send, 401, error, challenge, request.request_id)
        token = _current.set(request)
        request_id = request.request_id.encode()
        body: list[bytes] = []  # the request's body, kept to name the member of a refused message

        async def receive_kept():
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
                if not message.get("more_body"):
                    request.refused = await _body_refusal(b"".join(body))
                    if request.refused is not None:
                        # A body that does not parse (its last byte a NUL, its length kept for
                        # the SDK's body cap): the SDK answers its own 400 -32700 Parse error,
                        # charged as its other refusals, and runs nothing; that answer is
                        # rewritten below to say why and name the member.
                        last = message.get("body", b"")
                        message = {**message, "body": last[:-1] + b"\x00" if last else b"\x00"}
            return message

        replaced = False
        held = None  # a 400's start, held until its body is known (short_refusal)

        async def send_wrapped(message):
            nonlocal replaced, held
            if message["type"] == "http.response.start":
                if message["status"] == 401 and request.throttled is not None:
                    # The verifier's refusal was throttled: 429 instead of the SDK's 401.
                    replaced = True
                    return await _throttled(send, request)
                if request.rate_limited is not None:  # RateLimit refused the message
                    replaced = True
                    return await _rate_limited(send, request.rate_limited, request.request_id)
                if request.key is not None and not request.charged and message["status"] != 200:
                    # A notification (202), or a message the SDK refused itself before any
                    # handler (400 malformed JSON, JSON-RPC or Content-Type, 403 Origin, 404 a
                    # path below /mcp, 406 Accept, 413, 421 Host, a 500): a verified request
                    # like any other, charged here. A 200 was charged by RateLimit or run_call.
                    target = "notification" if message["status"] == 202 else "refused"
                    refused = await self.charge_notification(send, request, target=target)
                    if refused:
                        replaced = True
                        return None
                if message["status"] == 401 and request.unavailable:
                    replaced = True
                    return await _unavailable(send, request.request_id)
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
                if message["status"] == 400:
                    held = message
                    return None
            elif replaced:
                return None
            elif held is not None:
                start, held = held, None
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    if request.refused is not None:
                        start, message = body_refusal(start, message, request.refused)
                    else:
                        start, message = short_refusal(start, message, b"".join(body))
                await send(start)
            await send(message)

        try:
            await self.sdk_app(scope, receive_kept, send_wrapped)
        finally:
            _current.reset(token)

    @staticmethod
    async def charge_notification(send, request: _Request, *, target: str = "notification") -> bool:
        """A notification (or a client's response) the transport is about to accept ``202``,
        or a message it is about to refuse itself (``target`` "refused"): one unit of the
        key's rate limit (``mcp.request``), as every other message. Over the limit, or without
        a database to count it, the answer sent here instead (429 with Retry-After; 503), and
        True."""
        key = request.key
        request.charged = True
        actor = api_keys.key_actor(key, surface=SURFACE, request_id=request.request_id, client_ip=request.client_ip)
        try:
            retry_after = await _in_thread(lambda: charge(key, actor, action="mcp.request", target=target))
        except DatabaseError:
            await _unavailable(send, request.request_id)
            return True
        if retry_after is None:
            return False
        await _rate_limited(send, retry_after, request.request_id)
        return True


# The SDK's answer to a body that parses as JSON but is no JSON-RPC message (400, id null):
# "Validation error: " and pydantic's whole text — every member of each of the four kinds of
# message it could have been, the input echoed, and a documentation URL (up to 2 kB).
SDK_VALIDATION_ERROR = "Validation error: "


def short_refusal(start: dict, message: dict, request_body: bytes) -> tuple[dict, dict]:
    """The SDK's 400 for a body that is no JSON-RPC message (``start`` and ``message``, its
    answer) with a short message naming the offending member instead of pydantic's text, and
    that member in the error's ``data`` (``{"field": "method"}``; None: the body is no JSON
    object); the JSON-RPC error shape, code and id unchanged. Any other answer as it was."""
    try:
        answer = json.loads(message.get("body", b""))
        error = answer["error"]
        if not str(error.get("message", "")).startswith(SDK_VALIDATION_ERROR):
            return start, message
        types.jsonrpc_message_adapter.validate_python(pydantic_core.from_json(request_body), by_name=False)
        return start, message  # valid now: not the refusal this rewrites
    except ValidationError as exc:
        field, text = refusal_of(exc)
    except (ValueError, KeyError, TypeError, AttributeError):
        return start, message
    answer["error"] = {**error, "message": f"Invalid JSON-RPC message: {text}", "data": {"field": field}}
    body = json.dumps(answer, separators=(",", ":")).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return {**start, "headers": headers}, {**message, "body": body}


# A body past this is checked (a repeated member, the id) in a worker thread (a megabyte of
# small objects takes ~10 ms to parse), not on the event loop.
REPEAT_CHECK_INLINE_BYTES = 64 * 1024


@dataclass(frozen=True)
class BodyRefusal:
    """Why the endpoint refuses a body before the SDK parses it: the JSON-RPC error's code,
    message, and the member it names (its ``data.field``)."""

    code: int
    message: str
    field: str


# The longest string id, and integer ids as 64-bit integers: every answer echoes the id, so
# an unbounded one (a megabyte string, a 4,000-digit number) was sent back whole with it.
ID_MAX_CHARS = 256


def _bad_id(message: Any) -> bool:
    """Whether ``message`` is a request (it has a ``method``) whose ``id`` is there but is no
    string of at most ``ID_MAX_CHARS`` characters or 64-bit integer. The SDK's models read
    ``{"id": 1.5, "method": …}`` (or ``null``, ``true``, an object, a list) as a
    notification: accepted ``202``, nothing run, and the client waits for an answer that never
    comes. MCP's ids are strings or integers."""
    if not isinstance(message, dict) or "method" not in message or "id" not in message:
        return False
    value = message["id"]
    if isinstance(value, str):
        return len(value) > ID_MAX_CHARS
    return not isinstance(value, int) or isinstance(value, bool) or not -(2**63) <= value < 2**63


async def _body_refusal(request_body: bytes) -> BodyRefusal | None:
    """Why the body is refused before the SDK reads it, else None (a body that does not parse
    is the SDK's to refuse):

    - an object names a member twice (``params.name``): the SDK's parser (pydantic's) keeps
      the last value; a proxy, WAF or audit of the raw body may read the first. A Parse error.
    - a request whose ``id`` is no string or integer (:func:`_bad_id`): an Invalid Request
      naming ``id``."""

    def check():
        try:
            parsed = validation.loads_unique(request_body)
        except validation.DuplicateKey as exc:
            field = validation.duplicate_key_field(request_body) or exc.name[:64]
            said = f"Parse error: an object names {exc.name[:64]!r} twice ({field}); each name may appear once"
            return BodyRefusal(PARSE_ERROR, said[:160], field)
        except (ValueError, RecursionError):
            return None
        if _bad_id(parsed):
            return BodyRefusal(
                INVALID_REQUEST,
                f"Invalid Request: 'id' must be a string of at most {ID_MAX_CHARS} characters or a 64-bit integer",
                "id",
            )
        return None

    if len(request_body) <= REPEAT_CHECK_INLINE_BYTES:
        return check()
    return await _in_thread(check)


def body_refusal(start: dict, message: dict, refusal: BodyRefusal) -> tuple[dict, dict]:
    """The SDK's 400 Parse error (``-32700``, id null) for a body :func:`_body_refusal`
    refused, with its code and message instead and ``{"field": …}`` as its ``data`` (as
    :func:`short_refusal`'s). Any other answer as it was."""
    try:
        answer = json.loads(message.get("body", b""))
        error = answer["error"]
        if error.get("code") != PARSE_ERROR:
            return start, message
    except (ValueError, KeyError, TypeError, AttributeError):
        return start, message
    answer["error"] = {**error, "code": refusal.code, "message": refusal.message, "data": {"field": refusal.field}}
    answer["id"] = None
    body = json.dumps(answer, separators=(",", ":")).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return {**start, "headers": headers}, {**message, "body": body}


def refusal_of(exc: ValidationError) -> tuple[str | None, str]:
    """The offending member and a short sentence: of the kinds of message the body could
    have been (request, notification, response, error), the one it misses by fewest errors,
    and that kind's first error; pydantic's message without its input or URL."""
    by_kind: dict[str, list[dict]] = {}
    for error in exc.errors(include_url=False, include_input=False):
        loc = error["loc"]
        by_kind.setdefault(str(loc[0]) if loc else "", []).append(error)
    first = min(by_kind.values(), key=len)[0]  # ties: the first kind (a request before the rest)
    path = first["loc"][1:]
    if not path:
        return None, "the body must be a JSON object (jsonrpc, id, method, params)"
    field = ".".join(str(part) for part in path)[:METHOD_SHOWN_MAX]
    if first["type"] == "missing":
        return field, f"'{field}' is required"
    said = first["msg"]
    return field, f"'{field}': {said[:1].lower()}{said[1:]}"[:160]


async def _rate_limited(send, retry_after: int, request_id: str) -> None:
    error = {"code": "rate_limited", "message": "Request was throttled.", "retry_after": retry_after}
    await _send_json(send, 429, error, [(b"retry-after", str(retry_after).encode())], request_id)


async def _unavailable(send, request_id: str) -> None:
    error = {"code": "database_unavailable", "message": "the database is unavailable; retry shortly"}
    await _send_json(send, 503, error, [(b"retry-after", b"2")], request_id)


async def _throttled(send, request: _Request) -> None:
    retry = max(1, int(request.throttled + 0.999))
    error = {"code": "rate_limited", "message": "too many failed authentications", "retry_after": retry}
    error["field"] = "Authorization"
    await _send_json(send, 429, error, [(b"retry-after", str(retry).encode())], request.request_id)


async def _send_json(send, status: int, error: dict, headers=(), request_id: str = "") -> None:
    body = json.dumps({"error": {"field": None, **error}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    if request_id:
        head.append((b"x-request-id", request_id.encode()))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
