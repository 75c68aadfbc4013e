"""What every ZeroMem API endpoint shares: the tenant-scoped base view, the error shape,
(the compact JSON renderer is in zeromem/renderers.py).

Error shape, on every surface and status: ``{"error": {"code", "message", "field"}}``.
"""

import functools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import TooManyFieldsSent
from django.db import DatabaseError, InterfaceError, OperationalError
from django.http import Http404, HttpResponse
from drf_spectacular.utils import OpenApiResponse
from rest_framework import exceptions, serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from audit import limits
from audit.services import audit_record, audit_refusal
from memories.models import ApiKey, IdempotencyRecord, Tenant
from memories.services import api_keys, idempotency, usage
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import InvalidInput, ServiceError, TenantBusy
from zeromem.kernel.outcomes import Outcome
from zeromem.kernel.tokens import cost_of
from zeromem.kit import metrics

logger = logging.getLogger(__name__)

_DRF_CODES = {
    exceptions.NotAuthenticated: "missing_credentials",
    exceptions.AuthenticationFailed: "invalid_credentials",
    exceptions.PermissionDenied: "forbidden",
    exceptions.NotFound: "not_found",
    exceptions.MethodNotAllowed: "method_not_allowed",
    exceptions.NotAcceptable: "not_acceptable",
    exceptions.UnsupportedMediaType: "unsupported_media_type",
    exceptions.Throttled: "rate_limited",
    exceptions.ParseError: "malformed_json",
}


def first_error(detail, path=""):
    """(field, message, code) of the first error in a DRF ValidationError detail."""
    if isinstance(detail, dict):
        for name, sub in detail.items():
            field = name if name != "non_field_errors" else path
            return first_error(sub, f"{path}.{field}" if path and field != path else field)
    if isinstance(detail, list) and detail:
        return first_error(detail[0], path)
    return path or None, str(detail), getattr(detail, "code", "invalid")


def error_body(code: str, message: str, field: str | None = None, **extra) -> dict:
    """The error envelope, the one place it is built (the middleware's and the URL conf's
    plain responses use it too)."""
    return {"error": {"code": code, "message": message, "field": field, **extra}}


def retry_after(error: dict | None) -> dict:
    """The Retry-After header of an error that says when to retry (503 search_timeout)."""
    seconds = (error or {}).get("retry_after")
    return {"Retry-After": str(seconds)} if seconds else {}


def too_many_fields() -> InvalidInput:
    """Django's TooManyFieldsSent (a query string of more parameters than it parses) as the
    refusal it is."""
    limit = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
    return InvalidInput(f"more than {limit} query parameters", field="query", code="too_many_fields")


def repeated_parameter(request) -> InvalidInput | None:
    """The refusal of a query string that names a parameter twice (``?limit=1&limit=1000``,
    ``?prefix=user:u1:&prefix=user:u2:``), or None. Django's ``QueryDict.get`` read the last
    value while a proxy, WAF or log may read the first, and no parameter of this API takes a
    list: refused, as a JSON body naming a member twice is (``duplicate_key``), so no two
    readers act on different requests. Cost without a query string: one dict lookup."""
    if not request.META.get("QUERY_STRING"):
        return None
    for name, values in request.query_params.lists():
        if len(values) > 1:
            return InvalidInput(
                f"is given {len(values)} times in the query string; give it once",
                field=name[:200],
                code="duplicate_parameter",
            )
    return None


def refusal_code_and_field(exc) -> tuple[str, str | None]:
    """The ``code`` and ``field`` an error's answer names (the audit of a refusal records the
    same two)."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.field
    if isinstance(exc, exceptions.ValidationError):
        field, _message, code = first_error(exc.detail)
        return code, field
    code = getattr(exc, "zeromem_code", None) or _DRF_CODES.get(type(exc), exc.default_code)
    field = getattr(exc, "zeromem_field", None)
    if isinstance(exc, (exceptions.NotAuthenticated, exceptions.AuthenticationFailed)):
        field = field or "Authorization"
    elif isinstance(exc, exceptions.ParseError):
        field = field or "body"
    elif isinstance(exc, exceptions.UnsupportedMediaType):
        field = field or "Content-Type"  # the header at fault (a body only JSON parsers read)
    elif isinstance(exc, exceptions.NotAcceptable):
        field = field or "Accept"
    return code, field


def exception_handler(exc, context):
    if isinstance(exc, TooManyFieldsSent):
        exc = too_many_fields()
    if isinstance(exc, ServiceError):
        # Refusals, and the services' NotFound (404) and Conflict (409, current_version).
        retry_after = exc.extra.get("retry_after")
        headers = {"Retry-After": str(retry_after)} if retry_after else None
        return Response(error_body(**exc.as_dict()), status=exc.http_status, headers=headers)
    if isinstance(exc, (OperationalError, InterfaceError)):
        # The database is unreachable (restart, failover, pool exhausted): tell the client
        # to retry rather than answering 500 or hanging.
        return Response(
            error_body("database_unavailable", "the database is unavailable; retry shortly"),
            status=status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": "2"},
        )
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        field, message, code = first_error(exc.detail)
        response.data = error_body(code, message, field)
        return response
    code, field = refusal_code_and_field(exc)
    message = str(exc.detail) if not isinstance(exc.detail, (dict, list)) else exc.default_detail
    extra = {"retry_after": int(exc.wait or 1)} if isinstance(exc, exceptions.Throttled) else {}
    response.data = error_body(code, message, field, **extra)
    return response


# Request bodies whose unknown fields are refused (400 unknown_field: memories.api.views._validated,
# memories.tools.tool_batch).
CLOSED_REQUEST_COMPONENTS = (
    "MemoryPutRequest",
    "PatchedMemoryPatchRequest",
    "SummaryStartRequest",
    "ForgetRequestCreateRequest",
    "ToolBatchRequest",
)


def schema_closed_request_bodies(result, generator, request, public):
    """drf-spectacular postprocessing hook: mark the bodies that refuse unknown fields with
    ``additionalProperties: false``, so the schema says what the server does."""
    schemas = result.get("components", {}).get("schemas", {})
    for name in CLOSED_REQUEST_COMPONENTS:
        if name in schemas:
            schemas[name]["additionalProperties"] = False
    return result


IDEMPOTENCY_PARAMETER = {
    "in": "header",
    "name": "Idempotency-Key",
    "required": False,
    "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[\\x21-\\x7e]{1,255}$"},
    "description": "a fresh id per logical request: a retry with the same key within 24 h gets the first answer "
    "(Idempotent-Replayed: true) and the work is not done again",
}


def schema_idempotency_header(result, generator, request, public):
    """drf-spectacular postprocessing hook: every authenticated write (POST, PUT, PATCH,
    DELETE; all are AuditedAPIView) takes ``Idempotency-Key`` and may answer 409 (the first
    request with that key still runs) and 422 (the key was used for another request)."""
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for operations in result.get("paths", {}).values():
        for method, operation in operations.items():
            if method not in ("post", "put", "patch", "delete") or not operation.get("security"):
                continue
            operation.setdefault("parameters", []).append(dict(IDEMPOTENCY_PARAMETER))
            responses = operation.setdefault("responses", {})
            responses.setdefault(
                "409", {"description": "idempotency_in_progress: a request with this Idempotency-Key still runs"}
            )
            responses["409"].setdefault("content", error)
            responses.setdefault(
                "422", {"description": "idempotency_key_reused: this Idempotency-Key was used for another request"}
            )
            responses["422"].setdefault("content", error)
    return result


class TenantAPIView(APIView):
    """Base of every tenant endpoint: the tenant and actor come from the API key, resolved
    once by authentication; nothing in the payload can name another tenant."""

    surface = "rest"

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        # After authentication (401 first), before any work; an audited view records it.
        repeated = repeated_parameter(request)
        if repeated is not None:
            raise repeated

    @property
    def tenant(self) -> Tenant:
        return self.request.user.tenant

    @property
    def actor(self) -> Actor:
        return self.request.user.actor_for(self.request, self.surface)

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        # Answers carry memory values, audit events and receipts: no browser or proxy cache
        # may keep them (a shared machine, a caching proxy in front of the API).
        if not response.has_header("Cache-Control"):
            response["Cache-Control"] = "no-store"
        return response


class RidingRateLimit:
    """A view whose methods in ``riding_methods`` each begin their database work with a
    ``SELECT`` (a memory's ``GET``/``HEAD``, and its ``PUT``/``PATCH``, whose write reads the
    memory first: ``memories.services.memory_write``/``memory_update`` without a lock): the unit
    of the key's rate limit is not taken by :class:`memories.api.auth.ApiKeyRateThrottle` before
    the view, but goes to the database with that SELECT as one statement
    (:func:`memories.services.api_keys.rate_limit_riding`, as the tool-call lane's
    ``memory_read``/``memory_write``/``memory_update`` do): a REST read, write or update is two
    round trips, not three. Nothing else runs between the throttle and the handler (DRF's
    ``initial`` ends with the throttles; a repeated query parameter, refused after them, and a
    write's ``Idempotency-Key`` claim, made after them, are charged at once as before). A
    write's body is parsed and checked inside the handler's block: a bad one is charged (the
    counter sent alone as the block ends) and refused as before. Past the limit the request is
    refused as the throttle refuses it — 429 ``rate_limited`` with Retry-After, counted in the
    tenant's log by ``handle_exception`` — before it is answered, written or audited. The
    handler runs all its work inside :meth:`rate_limit_riding`."""

    riding_methods = frozenset({"GET", "HEAD"})
    # A body is parsed before its write's SELECT: past the limit, a large one would be parsed
    # for nothing (the throttle refuses before any parsing). Larger or undeclared: charged first.
    riding_body_max = 64 * 1024
    _riding_key: ApiKey | None = None

    def rate_limit_rides(self, request, api_key: ApiKey) -> bool:
        if request.method not in self.riding_methods:
            return False
        if request.META.get(_IDEMPOTENCY_META) is not None and request.method in IDEMPOTENT_METHODS:
            return False  # its claim (a write) is made before the handler: charged first
        if request.method not in ("GET", "HEAD") and not _declared_within(request, self.riding_body_max):
            return False
        try:
            if repeated_parameter(request) is not None:
                return False
        except TooManyFieldsSent:  # refused after the throttle (TenantAPIView.initial): charged at once
            return False
        self._riding_key = api_key
        return True

    @contextmanager
    def rate_limit_riding(self) -> Iterator[None]:
        api_key, self._riding_key = self._riding_key, None
        if api_key is None:  # charged by the throttle (another method, no key)
            yield
            return
        try:
            with api_keys.rate_limit_riding(api_key):
                yield
        except limits.OverLimit as over:
            raise exceptions.Throttled(wait=max(1.0, over.hit.retry_after)) from None


def _declared_within(request, limit: int) -> bool:
    """The request's body is at most ``limit`` bytes by its Content-Length (a chunked one's
    is set once zeromem.middleware has read it)."""
    length = validation.ascii_int(request.META.get("CONTENT_LENGTH") or "")
    return length is not None and length <= limit


NO_CONTROL_CHARS = r"^[^\x00-\x1f\x7f]*$"


class ErrorDetailSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    field = serializers.CharField(allow_null=True)


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


# Every status a view can answer is declared (schemathesis checks it: tests/test_schema_fuzz.py).
ERRORS = {
    400: OpenApiResponse(ErrorSerializer, description="bad input; `field` names what is wrong"),
    401: OpenApiResponse(ErrorSerializer, description="missing, malformed, revoked or expired key"),
    403: OpenApiResponse(ErrorSerializer, description="scope missing or key outside the allowlist"),
    413: OpenApiResponse(ErrorSerializer, description="body or value too large"),
    429: OpenApiResponse(ErrorSerializer, description="rate limited, or tenant_busy; see Retry-After"),
    503: OpenApiResponse(
        ErrorSerializer, description="the database is unavailable, or a search ran out of time; retry after Retry-After"
    ),
}


class TenantSlotMixin:
    """Expensive work (search, recall, export, batch) takes one of the tenant's
    ``ZEROMEM_TENANT_MAX_CONCURRENT`` slots for as long as it runs — a streamed response
    until its last byte is sent — so one tenant cannot take every thread and pooled
    connection. A tenant with all slots taken waits up to ``ZEROMEM_TENANT_BUSY_WAIT_SECONDS``
    for one, then gets 429 ``tenant_busy`` with Retry-After. Slots are counted across
    processes (audit/limits.py: Redis, or the database)."""

    def needs_tenant_slot(self, request) -> bool:
        return True

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        if self.needs_tenant_slot(request):
            holder = f"tenant:{self.tenant.pk}"
            token = slot_wait(holder)
            if token is None:
                raise TenantBusy("this tenant already runs its limit of expensive requests; retry", retry_after=1)
            self._tenant_slot = (holder, token)

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        slot = getattr(self, "_tenant_slot", None)
        if slot is not None:
            self._tenant_slot = None
            # Given back by the server's close(), once the last byte is sent: a streamed
            # response holds its slot for as long as it streams, and no response waits for
            # the release's round trip before it leaves (a slot whose close() never comes
            # lapses: audit/limits.py, ZEROMEM_TENANT_SLOT_MAX_HOLD_SECONDS).
            response._resource_closers.append(functools.partial(limits.slot_release, *slot))
        return response


def slot_wait(holder: str) -> str | None:
    """A slot of ``holder`` (``tenant:<id>``): its token, or None after the busy wait."""
    deadline = time.monotonic() + settings.ZEROMEM_TENANT_BUSY_WAIT_SECONDS
    lease = settings.ZEROMEM_TENANT_SLOT_LEASE_SECONDS
    while True:
        token = limits.slot_acquire(holder, limit=settings.ZEROMEM_TENANT_MAX_CONCURRENT, lease=lease)
        if token is not None or time.monotonic() >= deadline:
            return token
        time.sleep(0.05)


class _Replay(Exception):
    """Raised from ``initial`` to answer with a stored first answer (Idempotency-Key)."""

    def __init__(self, response):
        super().__init__("idempotent replay")
        self.response = response


IDEMPOTENT_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Idempotency-Key as WSGI/ASGI put it in request.META (request.headers would copy them all).
_IDEMPOTENCY_META = "HTTP_" + idempotency.HEADER.upper().replace("-", "_")


class AuditedAPIView(TenantAPIView):
    # Refused requests that no service saw (malformed JSON, wrong types) are audited too;
    # audit_refusal skips an error a service has recorded already.
    #
    # Writes (POST, PUT, PATCH, DELETE) honour an Idempotency-Key header
    # (memories/services/idempotency.py): once the key is authenticated and within its rate
    # limit, the request claims the key or gets the first answer again (``Idempotent-Replayed:
    # true``); the answer is stored as it leaves.

    audit_actions: dict[str, str] = {}

    def audit_action(self, method: str) -> str:
        """The action a refusal of this view's ``method`` is recorded as: a ``HEAD`` as its
        ``GET`` (Django answers HEAD with the GET handler, whose service records that action)."""
        if method == "HEAD" and "HEAD" not in self.audit_actions:
            method = "GET"
        return self.audit_actions.get(method, "api.request")

    _idempotency_claim: int | None = None
    # Set by a view whose answer is made of parts, some of which met a transient failure (a
    # batch's calls): kept to be resumed by a retry, or not kept at all if none got through.
    idempotency_partial: idempotency.Partial | None = None

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        raw = request.META.get(_IDEMPOTENCY_META)
        api_key = getattr(request.user, "api_key", None)
        if raw is None or request.method not in IDEMPOTENT_METHODS or api_key is None:
            return
        key = idempotency.key(raw)
        fingerprint, legacy = idempotency.fingerprints(
            method=request.method,
            path=request.get_full_path(),
            if_match=_conditions(request),
            data=request.data,
        )
        outcome = idempotency.claim(
            tenant=self.tenant, api_key=api_key, key=key, fingerprint=fingerprint, legacy=legacy
        )
        if isinstance(outcome, IdempotencyRecord):
            # The first answer leaves again (a read's values too), without the work: recorded
            # as a replay of its own, by this request (the work's event stays the first one).
            target = self.kwargs.get("key")
            audit_record(
                tenant=self.tenant,
                actor=self.actor,
                action="request.replay",
                outcome=Outcome.OK,
                target=target if isinstance(target, str) else "",
                detail={
                    "action": self.audit_action(request.method),
                    "status": outcome.status,
                    "claimed_at": outcome.created_at.isoformat(),
                },
            )
            raise _Replay(_replayed(outcome))
        self._idempotency_claim = outcome

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        claim, self._idempotency_claim = self._idempotency_claim, None
        if claim is not None:
            if response.streaming:
                idempotency.release(claim)
            else:
                try:
                    if not getattr(response, "is_rendered", True):
                        response.render()
                    headers = {h: response[h] for h in idempotency.REPLAYED_HEADERS if response.has_header(h)}
                    idempotency.complete(
                        claim,
                        status=response.status_code,
                        body=response.content,
                        headers=headers,
                        partial=self.idempotency_partial,
                    )
                except Exception as exc:
                    # The work has committed (a batch's calls, a write): its answer is the answer,
                    # not a 500. Not kept for retries — as when the process dies here (README
                    # "Safe retries"): the claim lapses after its lease, or goes now if it can.
                    # Any failure, not only the database's (a bug; a master key missing from the
                    # settings while sealing): the claim must leave this process's running
                    # claims, which its heartbeat renews — every retry got 409, forever.
                    log = logger.warning if isinstance(exc, DatabaseError) else logger.error
                    log("idempotency: answer not kept", exc_info=True)
                    _release_quietly(claim)
        return response

    def dispatch(self, request, *args, **kwargs):
        try:
            return super().dispatch(request, *args, **kwargs)
        finally:
            # An exception no handler turned into an answer: the work did not finish.
            claim, self._idempotency_claim = self._idempotency_claim, None
            if claim is not None:
                idempotency.release(claim)

    def handle_exception(self, exc):
        if isinstance(exc, _Replay):
            return exc.response
        if isinstance(exc, TooManyFieldsSent):  # refused like any bad input, and audited
            exc = too_many_fields()
        # A key over its rate limit is a refusal too, counted per minute (audit_refusal); so is a
        # body in a media type no parser reads (415) and a method the route has not (405).
        refusals = (
            exceptions.ValidationError,
            exceptions.ParseError,
            ServiceError,
            exceptions.Throttled,
            exceptions.UnsupportedMediaType,
            exceptions.MethodNotAllowed,
        )
        refused = isinstance(exc, refusals)
        principal = getattr(self.request, "_user", None)
        if refused and principal is not None and hasattr(principal, "tenant"):
            if isinstance(exc, exceptions.Throttled) and not getattr(exc, "zeromem_code", None):
                exc.zeromem_code = "rate_limited"
            key = self.kwargs.get("key")
            code, field = refusal_code_and_field(exc)
            audit_refusal(
                tenant=self.tenant,
                actor=self.actor,
                action=self.audit_action(self.request.method),
                target=key if isinstance(key, str) else "",
                error=exc,
                code=code,
                field=field,
            )
        return super().handle_exception(exc)


def _conditions(request) -> str | None:
    """The preconditions a write's fingerprint covers: If-Match as it was, and If-None-Match
    after it when sent (a request without it fingerprints as before)."""
    if_match = request.headers.get("If-Match")
    if_none_match = request.headers.get("If-None-Match")
    if if_none_match is None:
        return if_match
    return f"{if_match or ''}\nIf-None-Match: {if_none_match}"


def _release_quietly(claim: int) -> None:
    try:
        idempotency.release(claim)
    except DatabaseError:
        pass  # the database is gone: the claim lapses after its lease


RESULT_BYTES_HEADER = "ZeroMem-Result-Bytes"
RESULT_TOKENS_HEADER = "ZeroMem-Result-Tokens"


class ResultCostMixin:
    # Tool responses say what they cost the model: ``ZeroMem-Result-Bytes`` (the body's
    # size) and ``ZeroMem-Result-Tokens`` (its estimate, zeromem/kernel/tokens.py), on every
    # answer with a body — results and errors alike, since the model reads both — and add them
    # to the tenant's tokens returned per day (memories/services/usage.py, no query per request).
    # The body is rendered here, once (Django's later render is then a no-op). (A comment, not
    # a docstring: the OpenAPI description of the views would inherit it.)

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        if isinstance(response, Response) and response.data is not None and not response.streaming:
            response.render()
            size, tokens = cost_of(response.content)
            response[RESULT_BYTES_HEADER] = str(size)
            response[RESULT_TOKENS_HEADER] = str(tokens)
            metrics.results_returned("rest", size=size, tokens=tokens)
            principal = getattr(request, "_user", None)
            tenant = getattr(principal, "tenant", None)
            if tenant is not None:
                usage.result_returned(tenant_id=tenant.pk, size=size, tokens=tokens)
        return response


def _replayed(record: IdempotencyRecord) -> HttpResponse:
    response = HttpResponse(bytes(record.body), status=record.status)
    if "Content-Type" not in record.headers:
        del response["Content-Type"]
    for name, value in record.headers.items():
        response[name] = value
    response["Idempotent-Replayed"] = "true"
    return response
