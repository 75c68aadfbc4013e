"""REST and tool-call endpoints. One view per operation; each calls one service."""

import re

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions, status
from rest_framework.response import Response

from audit.models import AuditEvent
from audit.services import audit_record
from memories import services, tools, validation
from memories.api import serializers as s
from memories.errors import InvalidInput, ServiceError
from zeromem.api import TenantAPIView

ERRORS = {
    400: OpenApiResponse(s.ErrorSerializer, description="bad input; `field` names what is wrong"),
    401: OpenApiResponse(s.ErrorSerializer, description="missing, malformed, revoked or expired key"),
    403: OpenApiResponse(s.ErrorSerializer, description="scope missing or key outside the allowlist"),
    413: OpenApiResponse(s.ErrorSerializer, description="body or value too large"),
    429: OpenApiResponse(s.ErrorSerializer, description="rate limited; see Retry-After"),
}


class AuditedAPIView(TenantAPIView):
    # Refused requests that no service saw (malformed JSON, wrong types) are audited too.

    audit_actions: dict[str, str] = {}

    def handle_exception(self, exc):
        refused = isinstance(exc, (exceptions.ValidationError, exceptions.ParseError)) or (
            isinstance(exc, ServiceError) and not exc.audited
        )
        principal = getattr(self.request, "_user", None)
        if refused and principal is not None and hasattr(principal, "tenant"):
            outcome = AuditEvent.Outcome.DENIED if getattr(exc, "http_status", 400) == 403 else AuditEvent.Outcome.INVALID
            audit_record(
                tenant=self.tenant,
                actor=self.actor,
                action=self.audit_actions.get(self.request.method, "api.request"),
                target=self.kwargs.get("key", "")[:512] if isinstance(self.kwargs.get("key"), str) else "",
                outcome=outcome,
                detail={"code": getattr(exc, "code", None) or getattr(exc, "default_code", "invalid")},
            )
        return super().handle_exception(exc)


# --- tools ------------------------------------------------------------------------------


class ToolListView(TenantAPIView):
    @extend_schema(
        operation_id="tools_list",
        summary="Tool schemas, ready to paste into an OpenAI, Anthropic or MCP tool list",
        parameters=[
            OpenApiParameter("format", str, enum=["openai", "anthropic", "mcp"], description="default openai"),
            OpenApiParameter("strict", bool, description="OpenAI strict mode (default true)"),
        ],
        responses={200: OpenApiTypes.OBJECT, **ERRORS},
    )
    def get(self, request):
        fmt = request.query_params.get("format", "openai")
        strict = request.query_params.get("strict", "true").lower() not in ("false", "0", "no")
        return Response({"format": fmt, "tools": tools.tool_schemas(fmt, strict=strict)})


def _run_call(view, body) -> tuple[dict, int]:
    """One tool call → (body for the model, HTTP status). Errors keep the call id."""
    call_id = tools.call_id_of(body)
    try:
        call = tools.parse_call(body)
        result = tools.tool_call(tenant=view.tenant, actor=view.actor, name=call.name, arguments=call.arguments)
        code = status.HTTP_200_OK
    except ServiceError as exc:
        if not exc.audited:
            audit_record(
                tenant=view.tenant,
                actor=view.actor,
                action="tool.call",
                outcome=AuditEvent.Outcome.INVALID,
                detail={"code": exc.code, "field": exc.field},
            )
        result = {"status": "error", "error": exc.as_dict()}
        code = exc.http_status
    if call_id is not None:
        result["tool_call_id"] = call_id
    return result, code


class ToolCallView(AuditedAPIView):
    surface = "tool"
    # A body that is not JSON never reaches _run_call; it is audited as a refused call.
    audit_actions = {"POST": "tool.call"}

    @extend_schema(
        operation_id="tools_call",
        summary="Run one tool call as the model emitted it",
        request=s.ToolCallSerializer,
        responses={200: s.ToolResultSerializer, **ERRORS},
    )
    def post(self, request):
        result, code = _run_call(self, request.data)
        return Response(result, status=code)


class ToolBatchView(AuditedAPIView):
    surface = "tool"
    # Each call is audited by itself; a batch refused as a whole is one "tool.batch" event.
    audit_actions = {"POST": "tool.batch"}
    MAX_CALLS = 50

    @extend_schema(
        operation_id="tools_batch",
        summary="Run up to 50 tool calls in one round trip; each result stands alone",
        request=s.ToolBatchSerializer,
        responses={200: s.ToolBatchResultSerializer, **ERRORS},
    )
    def post(self, request):
        calls = request.data.get("calls") if isinstance(request.data, dict) else None
        if not isinstance(calls, list) or not calls:
            raise InvalidInput("must be a non-empty list of tool calls", field="calls")
        if len(calls) > self.MAX_CALLS:
            raise InvalidInput(f"at most {self.MAX_CALLS} calls per batch", field="calls", code="too_many")
        # Each call runs in its own transaction: one failing call does not undo the others.
        return Response({"results": [_run_call(self, body)[0] for body in calls]})


# --- memories as resources ------------------------------------------------------------

_ETAG_RE = re.compile(r'^(?:W/)?"(\d+)-(\d+)"$')


def _if_match(request) -> tuple[int, int] | str | None:
    """(memory id, version) from an ETag we issued; "*" (any current version) as is."""
    header = request.headers.get("If-Match")
    if header is None:
        return None
    if header.strip() == "*":
        return "*"
    match = _ETAG_RE.match(header.strip())
    if not match:
        # An ETag we never issued cannot match the current one.
        return (0, 0)
    return int(match.group(1)), int(match.group(2))


def _memory_response(memory, code=status.HTTP_200_OK) -> Response:
    return Response(s.MemoryOutSerializer(memory).data, status=code, headers={"ETag": memory.etag})


def _not_found(key: str) -> Response:
    return Response(
        {"error": {"code": "not_found", "message": "no memory at this key", "field": "key"}},
        status=status.HTTP_404_NOT_FOUND,
    )


class MemoryListView(AuditedAPIView):
    audit_actions = {"GET": "memory.list"}

    @extend_schema(
        operation_id="memories_list",
        summary="Memories under a prefix, ordered by key, cursor-paginated",
        parameters=[
            OpenApiParameter("prefix", str, description="key prefix, e.g. user:u10086:"),
            OpenApiParameter("category", str),
            OpenApiParameter("subject", str),
            OpenApiParameter("tag", str),
            OpenApiParameter("limit", int, description=f"1-{validation.LIMIT_MAX}, default 50"),
            OpenApiParameter("cursor", str, description="next_cursor of the previous page"),
        ],
        responses={200: s.MemoryListSerializer, **ERRORS},
    )
    def get(self, request):
        q = request.query_params
        r = services.memory_list(
            tenant=self.tenant,
            actor=self.actor,
            prefix=q.get("prefix", ""),
            limit=q.get("limit"),
            cursor=q.get("cursor"),
            category=q.get("category"),
            subject=q.get("subject"),
            tag=q.get("tag"),
            keys_only=False,
        )
        return Response(
            {"results": s.MemoryOutSerializer(r.keys, many=True).data, "next_cursor": r.next_cursor}
        )


class MemoryDetailView(AuditedAPIView):
    audit_actions = {"GET": "memory.read", "PUT": "memory.write", "PATCH": "memory.update", "DELETE": "memory.delete"}

    @extend_schema(
        operation_id="memories_read",
        summary="Read one memory (ETag header for If-Match)",
        responses={200: s.MemoryOutSerializer, 404: s.ErrorSerializer, **ERRORS},
    )
    def get(self, request, key):
        r = services.memory_read(tenant=self.tenant, actor=self.actor, key=key)
        return _memory_response(r.memory) if r.status == "ok" else _not_found(key)

    @extend_schema(
        operation_id="memories_put",
        summary="Create or replace a memory; with If-Match, only that version",
        request=s.MemoryPutSerializer,
        responses={200: s.MemoryOutSerializer, 201: s.MemoryOutSerializer, 412: s.ErrorSerializer, **ERRORS},
    )
    def put(self, request, key):
        data = _validated(s.MemoryPutSerializer, request.data)
        if_match = _if_match(request)
        if if_match is not None:
            data.pop("subject", None)
            r = services.memory_update(tenant=self.tenant, actor=self.actor, key=key, if_match=if_match, **data)
            return _memory_response(r.memory)
        r = services.memory_write(tenant=self.tenant, actor=self.actor, key=key, **data)
        return _memory_response(r.memory, status.HTTP_201_CREATED if r.created else status.HTTP_200_OK)

    @extend_schema(
        operation_id="memories_patch",
        summary="Change fields of an existing memory (If-Match or expected_version guard it)",
        request=s.MemoryPatchSerializer,
        responses={200: s.MemoryOutSerializer, 404: s.ErrorSerializer, 409: s.ErrorSerializer, 412: s.ErrorSerializer, **ERRORS},
    )
    def patch(self, request, key):
        data = _validated(s.MemoryPatchSerializer, request.data)
        if "value" not in data:
            data["value"] = services._UNSET
        r = services.memory_update(tenant=self.tenant, actor=self.actor, key=key, if_match=_if_match(request), **data)
        if r.status == "not_found":
            return _not_found(key)
        if r.status == "conflict":
            return Response(
                {"error": {"code": "conflict", "message": "the version moved", "field": "expected_version",
                           "current_version": r.current_version}},
                status=status.HTTP_409_CONFLICT,
            )
        return _memory_response(r.memory)

    @extend_schema(
        operation_id="memories_delete",
        summary="Move a memory to the trash (If-Match guards it)",
        responses={204: None, 404: s.ErrorSerializer, 412: s.ErrorSerializer, **ERRORS},
    )
    def delete(self, request, key):
        r = services.memory_delete(tenant=self.tenant, actor=self.actor, key=key, if_match=_if_match(request))
        if r.status == "not_found":
            return _not_found(key)
        return Response(status=status.HTTP_204_NO_CONTENT)


class MemoryHistoryView(AuditedAPIView):
    audit_actions = {"GET": "memory.history"}

    @extend_schema(
        operation_id="memories_history",
        summary="Versions of a memory, newest first, with who and which operation",
        parameters=[OpenApiParameter("limit", int, description=f"1-{validation.LIMIT_MAX}, default 50")],
        responses={200: s.HistorySerializer, 404: s.ErrorSerializer, **ERRORS},
    )
    def get(self, request, key):
        r = services.memory_history(tenant=self.tenant, actor=self.actor, key=key, limit=request.query_params.get("limit"))
        if isinstance(r, services.MemoryResult):
            return _not_found(key)
        return Response({"key": key, "results": s.MemoryVersionSerializer(r, many=True).data})


def _validated(serializer_class, data) -> dict:
    if not isinstance(data, dict):
        raise InvalidInput("the body must be a JSON object", field="body")
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    unknown = set(data) - set(serializer.fields)
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidInput(f"unknown field '{name}'", field=name, code="unknown_field")
    return {k: v for k, v in serializer.validated_data.items() if v is not None or k == "value"}
