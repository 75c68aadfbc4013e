"""The tool-call lane: ``POST /api/v1/tools/call`` answered without Django's request
handling and DRF's view machinery, when nothing about the request needs them.

A tool call of an agent — a cheap tool (not a search or recall), a JSON body, a key this
process verified lately (its API key cache), no ``Idempotency-Key``, no query string — spent
~1.5 ms of a ~4.5 ms read (in process, this machine) in Django's handler, its middleware chain,
URL resolution and DRF's dispatch, none of which decides anything for it. The lane runs the
same steps itself, through the same code: the request signals (the pooled connection is
checked out and returned as for any request), the request id, the key's verification
(:func:`memories.services.api_keys.verify_api_key`), the rate limit
(:func:`~memories.services.api_keys.rate_limit_take`, refused with the same audited 429), the
tool call (:func:`memories.tools.tool_call`: the service layer, which checks permissions and
writes the audit row), the metrics and the tokens-returned usage, and the answer's headers
from the same middleware (security, framing, length) and the same renderer. What it answers
— status, body, headers, audit rows, counters — is what the Django view answers
(``tests/test_tool_lane.py`` compares both over many calls).

Anything else goes to Django untouched, decided before the lane has done anything a fallback
would do again: a body that does not parse, a key the process has not verified (or revoked,
or expired: Django audits those 401s), an expensive tool (it takes a tenant slot), a request
with a query string, an ``Idempotency-Key``, a chunked body, an ``Accept`` other than JSON, a
CSRF cookie (Django's CSRF middleware may replace it), tracing on; and whatever Django's chain
answers before it routes a request — a ``Host`` not in ``ALLOWED_HOSTS`` (400), a refused
``User-Agent`` (403), the HTTPS redirect, ``PREPEND_WWW`` — asked of the same middleware's
request halves, which only read the request. ``ZEROMEM_TOOL_LANE=false`` sends every request
to Django.
"""

from __future__ import annotations

import io
import time
from typing import NamedTuple

from django.conf import settings
from django.core import signals
from django.core.handlers.exception import response_for_exception
from django.core.handlers.wsgi import WSGIHandler, WSGIRequest, get_script_name
from django.core.signals import setting_changed
from django.http import HttpResponse
from django.http.request import HttpHeaders
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.common import CommonMiddleware
from django.middleware.security import SecurityMiddleware
from django.urls import get_script_prefix, resolve, reverse, set_script_prefix
from django.utils.log import log_response
from rest_framework import exceptions

from audit import limits
from audit.services import AuthThrottled, audit_refusal
from memories import tools
from memories.api.auth import AUTHENTICATE, AuthFailed, throttled
from memories.models import API_KEY_PREFIX, hash_api_key
from memories.services import api_keys, key_cache, usage
from zeromem.kernel import deferred, hotsql
from zeromem.kernel.errors import Unauthenticated
from zeromem.kernel.tokens import compact_json, cost_of
from zeromem.kit import logs, metrics
from zeromem.kit.api import RESULT_BYTES_HEADER, RESULT_TOKENS_HEADER, exception_handler, retry_after
from zeromem.kit.http import client_ip, request_id_for
from zeromem.kit.negotiation import ContentNegotiation
from zeromem.kit.parsers import JSONParser
from zeromem.middleware import with_deferred
from zeromem.renderers import CompactJSONRenderer

# The route's answers carry this (DRF's default response headers for a view allowing POST).
ALLOW = "POST, OPTIONS"
ACTION = "tool.call"
# The tools whose first statement is a read the rate counter can ride with.
RIDING_TOOLS = tools.RIDING_TOOLS
_JSON = "application/json"
_ACCEPTED = (None, "*/*", _JSON)
# Other Accept headers, as DRF's content negotiation answered them (bounded: clients send few).
_negotiated: dict[str, bool] = {}
_NEGOTIATED_MAX = 256


class _Negotiating:
    """What DRF's content negotiation reads of a request (no query string: the lane has none)."""

    query_params: dict = {}

    def __init__(self, accept: str):
        self.META = {"HTTP_ACCEPT": accept}
        self.headers = HttpHeaders(self.META)


def json_negotiated(accept: str | None) -> bool:
    """Whether the API's content negotiation (settings ``DEFAULT_CONTENT_NEGOTIATION_CLASS``,
    one renderer) answers a request with this ``Accept`` in plain ``application/json`` — as
    it does ``*/*``, ``application/json`` and an MCP client's ``application/json,
    text/event-stream``. Anything else (406, a media type with parameters) is Django's."""
    if accept in _ACCEPTED:
        return True
    known = _negotiated.get(accept)
    if known is None:
        try:
            _renderer, media_type = ContentNegotiation().select_renderer(_Negotiating(accept), [CompactJSONRenderer()])
            known = media_type == _JSON
        except exceptions.NotAcceptable:
            known = False
        if len(_negotiated) >= _NEGOTIATED_MAX:
            _negotiated.clear()
        _negotiated[accept] = known
    return known


# The middleware (settings.MIDDLEWARE) whose effect on this route the lane reproduces; with any
# other list (a deployment that adds its own) the lane stands aside.
MIRRORED = (
    "zeromem.middleware.RequestIdMiddleware",
    "zeromem.kit.metrics.MetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "zeromem.middleware.StaticFilesMiddleware",
    "zeromem.middleware.BrowserSessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "zeromem.middleware.BrowserAuthenticationMiddleware",
    "zeromem.middleware.BrowserMessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "zeromem.middleware.BrowserCSPMiddleware",
)


def mirrors_settings(path: str) -> bool:
    """Whether the lane answers ``path`` as Django's chain would with these settings: the
    middleware above, no report-only Content-Security-Policy (which runs on API paths too),
    a policy that excludes the path (else django-csp adds its header), CSRF tokens in a cookie."""
    policy = getattr(settings, "CONTENT_SECURITY_POLICY", None) or {}
    return (
        tuple(settings.MIDDLEWARE) == MIRRORED
        and not getattr(settings, "CONTENT_SECURITY_POLICY_REPORT_ONLY", None)
        and not settings.CSRF_USE_SESSIONS  # CsrfViewMiddleware then reads a session API paths lack
        and path.startswith(tuple(policy.get("EXCLUDE_URL_PREFIXES") or ()))
    )


class _Read(NamedTuple):
    """The settings the lane's decision reads, read once (each read of ``settings`` costs ~1 µs)."""

    on: bool  # ZEROMEM_TOOL_LANE, tracing off, and Django's chain as mirrored
    body_cap: int
    csrf_cookie: str


# path → its _Read, until a setting changes (setting_changed: override_settings, the tests).
_read: dict[str, _Read] = {}


def _read_settings(path: str) -> _Read:
    read = _Read(
        on=bool(settings.ZEROMEM_TOOL_LANE and not settings.ZEROMEM_TRACING and mirrors_settings(path)),
        body_cap=settings.ZEROMEM_MAX_BODY_BYTES,
        csrf_cookie=settings.CSRF_COOKIE_NAME,
    )
    _read[path] = read
    return read


def _settings_changed(**kwargs) -> None:
    _read.clear()


setting_changed.connect(_settings_changed, dispatch_uid="memories.api.lane.settings_changed")


def _rate_limited(key, actor, wait: float) -> exceptions.Throttled:
    """The refusal of a key over its rate limit, as ApiKeyRateThrottle and
    AuditedAPIView.handle_exception make it: counted in the tenant's log (tallied), answered
    429 with Retry-After."""
    refusal = exceptions.Throttled(wait=max(1.0, wait))
    refusal.zeromem_code = "rate_limited"
    audit_refusal(tenant=key.tenant, actor=actor, action=ACTION, error=refusal, code="rate_limited")
    return refusal


def _nothing(request):  # the middleware below is called by its halves, never as a chain
    raise AssertionError("not called")


class ToolLane:
    """A WSGI application in front of Django's: the lane's requests are answered here, the
    others by ``django``."""

    def __init__(self, django):
        self.django = django
        # The route's PATH_INFO: without the script prefix (FORCE_SCRIPT_NAME), which reverse() adds.
        self.path = "/" + reverse("tools-call").removeprefix(get_script_prefix())
        self.match = resolve(self.path)
        # The middleware Django would run (settings.MIDDLEWARE) whose halves matter here: the
        # request halves of the security and common middleware decide whether Django answers
        # before the route (the lane then stands aside); the response halves add the security
        # headers, the framing header, Content-Length. The others do nothing on an API path.
        self.security = SecurityMiddleware(_nothing)
        self.framing = XFrameOptionsMiddleware(_nothing)
        self.common = CommonMiddleware(_nothing)
        self.parser = JSONParser()

    def __call__(self, environ, start_response):
        if not self._may_take(environ):
            return self.django(environ, start_response)
        request = WSGIRequest(environ)  # no side effect: Django's own is built from environ again
        if self._answered_before_the_route(request):
            return self.django(environ, start_response)
        body = environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"]))
        taken = self._taken(environ, body)
        if taken is None:
            environ["wsgi.input"] = io.BytesIO(body)  # Django reads it again, from the start
            return self.django(environ, start_response)
        data, raw = taken
        # As WSGIHandler.__call__, from here: the request has begun.
        set_script_prefix(get_script_name(environ))
        signals.request_started.send(sender=WSGIHandler, environ=environ)
        response = self._respond(request, data, raw)
        response._handler_class = WSGIHandler
        start_response(f"{response.status_code} {response.reason_phrase}", list(response.items()))
        return response

    def _may_take(self, environ) -> bool:
        """What the request line and headers say (no body read, nothing done)."""
        read = _read.get(self.path) or _read_settings(self.path)
        length = environ.get("CONTENT_LENGTH") or ""
        return (
            read.on
            and environ.get("REQUEST_METHOD") == "POST"
            and environ.get("PATH_INFO") == self.path
            and not environ.get("SCRIPT_NAME")
            and not environ.get("QUERY_STRING")
            and environ.get("CONTENT_TYPE") == _JSON
            and json_negotiated(environ.get("HTTP_ACCEPT"))
            and "HTTP_IDEMPOTENCY_KEY" not in environ
            and "HTTP_TRANSFER_ENCODING" not in environ
            # CsrfViewMiddleware replaces a malformed CSRF cookie (Set-Cookie, Vary: Cookie)
            and read.csrf_cookie not in environ.get("HTTP_COOKIE", "")
            and length.isascii()
            and length.isdigit()
            and 0 < int(length) <= read.body_cap
            and environ.get("HTTP_AUTHORIZATION", "")[:7].lower() == "bearer "
        )

    def _answered_before_the_route(self, request) -> bool:
        """Whether Django's chain answers before it routes the request — the HTTPS redirect
        (SecurityMiddleware), a Host not in ALLOWED_HOSTS (400), a refused User-Agent (403),
        PREPEND_WWW's redirect (CommonMiddleware) — with their answers' own headers and the
        metrics' ``unmatched`` route: those are Django's to give. The same request halves
        Django runs first, which only read the request."""
        try:
            return (
                self.security.process_request(request) is not None or self.common.process_request(request) is not None
            )
        except Exception:  # noqa: BLE001 - DisallowedHost, PermissionDenied: Django answers them
            return True

    def _taken(self, environ, body: bytes) -> tuple[dict, str] | None:
        """The call and the raw key when the lane answers it: a body the project's parser
        reads as an object naming a cheap tool, sent with a key this process verified lately
        that has not since expired or been revoked. Else None (Django answers), with nothing
        done."""
        raw = environ["HTTP_AUTHORIZATION"][7:].strip()
        if not raw.startswith(API_KEY_PREFIX) or raw.count("_") < 2 or not raw.isprintable():
            return None
        key = key_cache.get(raw[len(API_KEY_PREFIX) :].split("_", 1)[0], hash_api_key(raw))
        if key is None or key.revoked_at is not None:
            return None
        if key.expires_at is not None and key.expires_at.timestamp() <= time.time() + 1:
            return None
        try:
            data = self.parser.parse(io.BytesIO(body), _JSON, {"encoding": settings.DEFAULT_CHARSET})
        except exceptions.ParseError:
            return None
        if not isinstance(data, dict):
            return None
        name = tools.called_tool(data)
        if isinstance(name, str) and name in tools.EXPENSIVE_TOOLS:  # it takes a tenant slot
            return None
        return data, raw

    def _respond(self, request, data: dict, raw: str) -> HttpResponse:
        # zeromem.middleware.RequestIdMiddleware and zeromem.kit.metrics.MetricsMiddleware.
        started = time.perf_counter()
        request.request_id = request_id_for(request.META.get("HTTP_X_REQUEST_ID", ""))
        request.resolver_match = self.match
        logs.request_id.set(request.request_id)
        with deferred.collecting() as tasks:
            try:
                response = self._answer(request, data, raw)
            except Exception as exc:  # noqa: BLE001 - answered as Django answers it
                response = response_for_exception(request, exc)
            response = self.common.process_response(request, response)
            response = self.framing.process_response(request, response)
            response = self.security.process_response(request, response)
        response["X-Request-ID"] = request.request_id
        response = with_deferred(response, tasks)
        metrics.record_request(request, response, started)
        if response.status_code >= 400:
            log_response("%s: %s", response.reason_phrase, request.path, response=response, request=request)
        return response

    def _answer(self, request, data: dict, raw: str) -> HttpResponse:
        """memories.api.views.ToolCallView, as DRF runs it: authentication, the rate limit,
        the call; an error no service turned into a result (the database gone) answered by
        the project's exception handler, as DRF's dispatch does."""
        tenant_id = None
        try:
            ip = client_ip(request)
            try:
                key = api_keys.verify_api_key(
                    raw, route=f"/{self.match.route}", surface="api", client_ip=ip, request_id=request.request_id
                )
            except Unauthenticated as exc:  # revoked or expired since _taken looked: audited
                refused = AuthFailed(exc.code, exc.message)
                refused.auth_header = AUTHENTICATE
                raise refused from None
            except AuthThrottled as exc:
                raise throttled(exc) from None
            tenant_id = key.tenant.pk
            actor = api_keys.key_actor(key, surface="tool", request_id=request.request_id, client_ip=ip)
            try:
                # A read's audit event commits while its answer is built: its INSERT is sent,
                # and its answer read as the block ends, before anything is counted or sent
                # (zeromem/kernel/hotsql.py "A statement answered later"; failed: answered
                # below as if the call had raised it).
                with hotsql.answered_later():
                    # A name that is not a string (a list: unhashable) is the call's to refuse (400).
                    if isinstance(name := tools.called_tool(data), str) and name in RIDING_TOOLS:
                        # The rate counter goes to the database with the read's SELECT (one
                        # round trip); past the limit, refused before the read is answered or
                        # audited.
                        with api_keys.rate_limit_riding(key):
                            answer = tools.tool_call(tenant=key.tenant, actor=actor, call=data)
                    else:
                        wait = api_keys.rate_limit_take(key)
                        if wait is not None:
                            raise _rate_limited(key, actor, wait)
                        answer = tools.tool_call(tenant=key.tenant, actor=actor, call=data)
                    rendered = self._rendered(
                        answer.result, answer.http_status, retry_after(answer.result.get("error"))
                    )
            except limits.OverLimit as over:
                raise _rate_limited(key, actor, over.hit.retry_after) from None
        except Exception as exc:
            handled = exception_handler(exc, {})
            if handled is None:
                raise
            headers = {name: value for name, value in handled.items() if name != "Content-Type"}
            return self._counted(*self._rendered(handled.data, handled.status_code, headers), tenant_id=tenant_id)
        metrics.tool_calls([(tools.called_tool(data), answer.result.get("status"))])
        return self._counted(*rendered, tenant_id=tenant_id)

    def _rendered(self, data: dict, status: int, headers: dict) -> tuple[HttpResponse, int, int]:
        """DRF's finalize_response and renderer, TenantAPIView's Cache-Control and
        ResultCostMixin's cost headers, in their order: (response, its size, its tokens)."""
        content = compact_json(data)
        response = HttpResponse(content, status=status, content_type=_JSON, headers=headers)
        response["Allow"] = ALLOW
        response["Cache-Control"] = "no-store"
        size, tokens = cost_of(content)
        response[RESULT_BYTES_HEADER] = str(size)
        response[RESULT_TOKENS_HEADER] = str(tokens)
        return response, size, tokens

    def _counted(self, response: HttpResponse, size: int, tokens: int, *, tenant_id: int | None) -> HttpResponse:
        """ResultCostMixin's counters of the answer sent."""
        metrics.results_returned("rest", size=size, tokens=tokens)
        if tenant_id is not None:
            usage.result_returned(tenant_id=tenant_id, size=size, tokens=tokens)
        return response
