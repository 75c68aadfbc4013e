"""REST and tool-call endpoints. One view per operation; each calls one service."""

import json
import re

from django.conf import settings
from django.urls import reverse
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.response import Response

from memories import services, tools
from memories.api import serializers as s
from memories.models import ETAG_PURPOSE
from memories.portal.services import portal_link_create, portal_links_revoke
from memories.services import idempotency
from memories.services.claude_memory import MemoryToolError, memory_tool_run
from zeromem.kernel import opaque, validation
from zeromem.kernel.errors import InvalidInput
from zeromem.kit import metrics
from zeromem.kit.api import (
    ERRORS,
    AuditedAPIView,
    ErrorSerializer,
    ResultCostMixin,
    RidingRateLimit,
    TenantAPIView,
    TenantSlotMixin,
    retry_after,
)

NOT_FOUND = OpenApiResponse(ErrorSerializer, description="no memory at this key")
PRECONDITION_FAILED = OpenApiResponse(
    ErrorSerializer, description="If-Match does not match the current version (or there is no memory)"
)

# Path and query parameters, with the rules the services enforce (memories/validation.py).
KEY_PARAM = OpenApiParameter(
    "key",
    {"type": "string", "minLength": 1, "maxLength": validation.KEY_MAX_LEN, "pattern": s.KEY_PATTERN},
    OpenApiParameter.PATH,
    required=True,
    description="':'-separated segments, e.g. user:u10086:pref_lang",
)
LIMIT_PARAM = OpenApiParameter(
    "limit",
    {"type": "integer", "minimum": 1, "maximum": validation.LIMIT_MAX},
    description=f"1-{validation.LIMIT_MAX}, default 50",
)


# --- tools ------------------------------------------------------------------------------


class ToolListView(TenantAPIView):
    @extend_schema(
        operation_id="tools_list",
        summary="Tool schemas, ready to paste into an OpenAI, Anthropic or MCP tool list",
        parameters=[
            OpenApiParameter("format", str, enum=["openai", "anthropic", "mcp"], description="default openai"),
            OpenApiParameter("strict", bool, description="OpenAI strict mode: true (default) or false"),
        ],
        responses={200: s.ToolListSerializer, **ERRORS},
    )
    def get(self, request):
        fmt = request.query_params.get("format", "openai")
        strict = request.query_params.get("strict", "true").lower()
        if strict not in ("true", "false"):
            raise InvalidInput("must be true or false", field="strict")
        return Response({"format": fmt, "tools": tools.tool_schemas(fmt, strict=strict == "true")})


# What a tool response costs the model (zeromem/kernel/tokens.py, README "Token cost").
RESULT_COST_HEADERS = [
    OpenApiParameter(
        "ZeroMem-Result-Bytes", int, OpenApiParameter.HEADER, response=True, description="size of the body in bytes"
    ),
    OpenApiParameter(
        "ZeroMem-Result-Tokens",
        int,
        OpenApiParameter.HEADER,
        response=True,
        description="estimated tokens of the body: ceil(ASCII characters / 4) + non-ASCII characters",
    ),
]


class ToolCallView(ResultCostMixin, TenantSlotMixin, AuditedAPIView):
    surface = "tool"
    # A body that is not JSON never reaches the registry; it is audited as a refused call.
    audit_actions = {"POST": "tool.call"}

    def needs_tenant_slot(self, request) -> bool:
        name = tools.called_tool(request.data)
        return isinstance(name, str) and name in tools.EXPENSIVE_TOOLS

    @extend_schema(
        operation_id="tools_call",
        summary="Run one tool call as the model emitted it",
        parameters=RESULT_COST_HEADERS,
        request=s.ToolCallSerializer,
        responses={200: s.ToolResultSerializer, **ERRORS},
    )
    def post(self, request):
        answer = tools.tool_call(tenant=self.tenant, actor=self.actor, call=request.data)
        metrics.tool_calls([(tools.called_tool(request.data), answer.result.get("status"))])
        return Response(answer.result, status=answer.http_status, headers=retry_after(answer.result.get("error")))


class ToolBatchView(ResultCostMixin, TenantSlotMixin, AuditedAPIView):
    surface = "tool"
    # Each call is audited by itself; a batch refused as a whole is one "tool.batch" event.
    audit_actions = {"POST": "tool.batch"}

    def rate_cost(self, request) -> int:
        """Each call counts against the rate limit (a malformed batch costs one)."""
        calls = request.data.get("calls") if isinstance(request.data, dict) else None
        return min(len(calls), tools.BATCH_MAX_CALLS) if isinstance(calls, list) and calls else 1

    @extend_schema(
        operation_id="tools_batch",
        summary="Run up to 50 tool calls in one round trip; each result stands alone",
        parameters=RESULT_COST_HEADERS,
        request=s.ToolBatchSerializer,
        responses={200: s.ToolBatchResultSerializer, **ERRORS},
    )
    def post(self, request):
        resume = _batch_resumption(self._idempotency_claim)
        answer = tools.tool_batch(tenant=self.tenant, actor=self.actor, body=request.data, resume=resume)
        calls = request.data["calls"]  # tool_batch has checked its shape
        ran = set(resume.pending) if resume is not None else set(range(len(calls)))
        metrics.tool_calls(
            (tools.called_tool(call), result.get("status"))
            for i, (call, result) in enumerate(zip(calls, answer.results, strict=False))
            if i in ran
        )
        if answer.pending:
            # Calls that met a transient failure: the answer is kept to be resumed, not replayed.
            self.idempotency_partial = idempotency.Partial(answer.pending, len(answer.results))
        # "pending" says which calls a retry with the same Idempotency-Key would run again, so
        # that no client keeps its own list of transient codes in step with the server's (the
        # stored answer carries it too: a replay says [], a resumption its own list).
        return Response({"results": answer.results, "pending": answer.pending})


def _batch_resumption(claim: int | None) -> tools.BatchAnswer | None:
    """The earlier answer this batch's Idempotency-Key resumes, if any."""
    resumed = idempotency.resumption(claim)
    if resumed is None:
        return None
    body, pending = resumed
    return tools.BatchAnswer(json.loads(body)["results"], pending)


# --- memories as resources ------------------------------------------------------------

_ETAG_RE = re.compile(rf'^(?:W/)?"({opaque.TOKEN_PATTERN})-([0-9]{{1,10}})"$')
# An If-Match list longer than this is refused (each ETag is one more OR'ed condition).
IF_MATCH_MAX_ETAGS = 20


def _if_match(request) -> tuple[int, int] | frozenset | str | None:
    """(memory id, version) from an ETag we issued (``"<row token>-<version>"``, the row's id
    opened from its token); "*" (any current version) as is; a list (``"t-3", "t-4"``, RFC
    9110: the current ETag is any of them) as a frozenset of pairs."""
    header = request.headers.get("If-Match")
    if header is None:
        return None
    if header.strip() == "*":
        return "*"
    members = [m.strip() for m in header.split(",")] if "," in header else [header.strip()]
    if len(members) > IF_MATCH_MAX_ETAGS:
        raise InvalidInput(f"must name at most {IF_MATCH_MAX_ETAGS} ETags", field="If-Match", code="too_long")
    pairs = set()
    for member in members:
        match = _ETAG_RE.match(member)
        pk = opaque.open_id(match.group(1), purpose=ETAG_PURPOSE) if match else None
        if pk is not None:  # an ETag we never issued cannot match the current one
            pairs.add((pk, int(match.group(2))))
    if len(pairs) > 1:
        return frozenset(pairs)
    return pairs.pop() if pairs else (0, 0)


def _if_none_match(request, *, on_put: bool) -> bool:
    """Whether a PUT is to create only (``If-None-Match: *``). Any other If-None-Match on a
    write is refused rather than ignored: a client that sent it expects it to guard the write."""
    header = request.headers.get("If-None-Match")
    if header is None:
        return False
    if on_put and header.strip() == "*":
        if request.headers.get("If-Match") is not None:
            raise InvalidInput("If-Match and If-None-Match: * cannot both hold", field="If-None-Match")
        return True
    raise InvalidInput(
        'only "*" on PUT (create only if no memory exists at the key); guard a version with If-Match',
        field="If-None-Match",
    )


def _memory_response(memory, code=status.HTTP_200_OK) -> Response:
    return Response(s.memory_out(memory), status=code, headers={"ETag": memory.etag})


class MemoryListView(AuditedAPIView):
    audit_actions = {"GET": "memory.list"}

    @extend_schema(
        operation_id="memories_list",
        summary="Memories under a prefix, ordered by key, cursor-paginated",
        parameters=[
            OpenApiParameter(
                "prefix",
                {"type": "string", "maxLength": validation.KEY_MAX_LEN, "pattern": s.PREFIX_PATTERN},
                description="key prefix, e.g. user:u10086:",
            ),
            OpenApiParameter(
                "category", {"type": "string", "maxLength": validation.CATEGORY_MAX_LEN, "pattern": s.CATEGORY_PATTERN}
            ),
            OpenApiParameter(
                "subject",
                {"type": "string", "maxLength": validation.SUBJECT_MAX_LEN, "pattern": s.NO_CONTROL_CHARS},
            ),
            OpenApiParameter("tag", {"type": "string", "maxLength": validation.TAG_MAX_LEN, "pattern": s.TAG_PATTERN}),
            OpenApiParameter(
                "order", str, enum=["asc", "desc"], description="by key: asc (default) or desc, the last keys first"
            ),
            LIMIT_PARAM,
            OpenApiParameter(
                "cursor",
                {"type": "string", "maxLength": validation.CURSOR_MAX_LEN},
                description="next_cursor of the previous page (of the same order)",
            ),
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
            order=q.get("order"),
        )
        return Response({"results": [s.memory_out(m) for m in r.keys], "next_cursor": r.next_cursor})


class MemoryDetailView(RidingRateLimit, AuditedAPIView):
    audit_actions = {"GET": "memory.read", "PUT": "memory.write", "PATCH": "memory.update", "DELETE": "memory.delete"}
    # DELETE locks the row first (a transaction): its counter is taken before, by the throttle.
    riding_methods = frozenset({"GET", "HEAD", "PUT", "PATCH"})

    @extend_schema(
        operation_id="memories_read",
        summary="Read one memory (ETag header for If-Match)",
        parameters=[KEY_PARAM],
        responses={200: s.MemoryOutSerializer, 404: NOT_FOUND, **ERRORS},
    )
    def get(self, request, key):
        with self.rate_limit_riding():  # the rate counter goes with the memory's SELECT
            r = services.memory_read(tenant=self.tenant, actor=self.actor, key=key)
        return _memory_response(r.memory)

    @extend_schema(
        operation_id="memories_put",
        summary="Create or replace a memory; with If-Match, only that version; with If-None-Match: *, only if absent",
        parameters=[KEY_PARAM],
        request=s.MemoryPutSerializer,
        responses={
            200: s.MemoryOutSerializer,
            201: s.MemoryOutSerializer,
            404: OpenApiResponse(ErrorSerializer, description="no such endpoint (the key is not a key)"),
            412: OpenApiResponse(
                ErrorSerializer,
                description="If-Match does not match the current version (or there is no memory); "
                "If-None-Match: * and a memory exists",
            ),
            **ERRORS,
        },
    )
    def put(self, request, key):
        with self.rate_limit_riding():  # the rate counter goes with the write's first SELECT
            data = _validated(s.MemoryPutSerializer, request.data)
            create_only = _if_none_match(request, on_put=True)
            if_match = _if_match(request)
            if if_match is not None:
                r = services.memory_update(tenant=self.tenant, actor=self.actor, key=key, if_match=if_match, **data)
                return _memory_response(r.memory)
            r = services.memory_write(tenant=self.tenant, actor=self.actor, key=key, create_only=create_only, **data)
        return _memory_response(r.memory, status.HTTP_201_CREATED if r.created else status.HTTP_200_OK)

    @extend_schema(
        operation_id="memories_patch",
        summary="Change fields of an existing memory (If-Match or expected_version guard it)",
        parameters=[KEY_PARAM],
        request=s.MemoryPatchSerializer,
        responses={
            200: s.MemoryOutSerializer,
            404: NOT_FOUND,
            409: OpenApiResponse(ErrorSerializer, description="expected_version is not the current version"),
            412: PRECONDITION_FAILED,
            **ERRORS,
        },
    )
    def patch(self, request, key):
        with self.rate_limit_riding():  # the rate counter goes with the update's first SELECT
            data = _validated(s.MemoryPatchSerializer, request.data)
            _if_none_match(request, on_put=False)
            if "value" not in data:
                data["value"] = services._UNSET
            if_match = _if_match(request)
            r = services.memory_update(tenant=self.tenant, actor=self.actor, key=key, if_match=if_match, **data)
        return _memory_response(r.memory)

    @extend_schema(
        operation_id="memories_delete",
        summary="Move a memory to the trash (If-Match guards it)",
        parameters=[KEY_PARAM],
        responses={204: None, 404: NOT_FOUND, 412: PRECONDITION_FAILED, **ERRORS},
    )
    def delete(self, request, key):
        _if_none_match(request, on_put=False)
        services.memory_delete(tenant=self.tenant, actor=self.actor, key=key, if_match=_if_match(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class MemoryHistoryView(AuditedAPIView):
    audit_actions = {"GET": "memory.history"}

    @extend_schema(
        operation_id="memories_history",
        summary="Versions of a memory, newest first, with who and which operation",
        parameters=[
            KEY_PARAM,
            LIMIT_PARAM,
            OpenApiParameter(
                "cursor",
                {"type": "string", "maxLength": validation.CURSOR_MAX_LEN},
                description="next_cursor of the previous page: the versions older than its last",
            ),
        ],
        responses={200: s.HistorySerializer, 404: NOT_FOUND, **ERRORS},
    )
    def get(self, request, key):
        q = request.query_params
        page = services.memory_history(
            tenant=self.tenant, actor=self.actor, key=key, limit=q.get("limit"), cursor=q.get("cursor")
        )
        return Response(
            {
                "key": key,
                "results": s.MemoryVersionSerializer(page.versions, many=True).data,
                "next_cursor": page.next_cursor,
            }
        )


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


# --- summaries and jobs ---------------------------------------------------------------

JOB_ID_PARAM = OpenApiParameter(
    "job_id",
    {"type": "string", "format": "uuid"},
    OpenApiParameter.PATH,
    required=True,
    description="the job_id a start endpoint returned",
)


class SummaryStartView(AuditedAPIView):
    """Queue a job that compacts the live memories under ``prefix`` into one memory at
    ``summary:<prefix without its trailing ':'>`` (category ``summary``, with its sources);
    ``archive`` moves the summarized memories to the trash. Needs memory:read and
    memory:write (and memory:delete to archive); follow the job at ``Location``."""

    audit_actions = {"POST": "memory.summarize"}

    @extend_schema(
        operation_id="summaries_create",
        summary="Start summarizing a namespace into summary:<prefix>; returns the job at once",
        request=s.SummaryStartSerializer,
        responses={202: s.JobStartedSerializer, **ERRORS},
    )
    def post(self, request):
        data = _validated(s.SummaryStartSerializer, request.data)
        job = services.summarize_start(
            tenant=self.tenant, actor=self.actor, prefix=data["prefix"], archive=data.get("archive", False)
        )
        return Response(
            {"job_id": str(job.uid), "status": job.status},
            status=status.HTTP_202_ACCEPTED,
            headers={"Location": reverse("jobs-detail", kwargs={"job_id": job.uid})},
        )


class JobDetailView(AuditedAPIView):
    """A job of this tenant: ``queued`` → ``running`` → ``succeeded``, ``failed`` or
    ``cancelled`` (the API key that asked was revoked or expired before it wrote); a failed
    attempt that will be retried is ``queued`` again, its error shown. Needs memory:read;
    a job about keys outside the key's allowlist is not found."""

    audit_actions = {"GET": "job.read"}

    @extend_schema(
        operation_id="jobs_read",
        summary="A background job's status, params, result and error",
        parameters=[JOB_ID_PARAM],
        responses={
            200: s.JobSerializer,
            404: OpenApiResponse(ErrorSerializer, description="no such job for this key"),
            **ERRORS,
        },
    )
    def get(self, request, job_id):
        job = services.job_get(tenant=self.tenant, actor=self.actor, job_id=job_id)
        return Response(s.JobSerializer(job).data)


# --- forget requests ----------------------------------------------------------------------

FORGET_REQUEST_ID_PARAM = OpenApiParameter(
    "request_id",
    {"type": "string", "format": "uuid"},
    OpenApiParameter.PATH,
    required=True,
    description="the id POST /api/v1/forget-requests returned",
)
FORGET_REQUEST_LOCATION = OpenApiParameter(
    "Location",
    str,
    OpenApiParameter.HEADER,
    response=[202],
    description="where to follow the request: /api/v1/forget-requests/{id}",
)


class ForgetRequestListView(AuditedAPIView):
    """Forget requests of this tenant (scope forget:create). A key limited to some prefixes
    sees only the requests it made, and may forget only keys and prefixes inside them."""

    audit_actions = {"GET": "forget.list", "POST": "forget.create"}

    @extend_schema(
        operation_id="forget_requests_create",
        summary="Ask to forget a subject, a key prefix or a list of keys; runs in the background",
        description=(
            "Exactly one of `subject`, `prefix` or `keys` (at most 1000). The request is stored "
            "before the 202 answer and erases live, trashed and expired memories, their history "
            "and the summaries derived from them. Due in `due_in_days` (1-30, default 30) days."
        ),
        request=s.ForgetRequestCreateSerializer,
        parameters=[FORGET_REQUEST_LOCATION],
        responses={202: s.ForgetRequestOutSerializer, **ERRORS},
    )
    def post(self, request):
        data = _validated(s.ForgetRequestCreateSerializer, request.data)
        forget_request = services.forget_request_create(
            tenant=self.tenant, actor=self.actor, idempotency_claim=self._idempotency_claim, **data
        )
        return Response(
            s.ForgetRequestOutSerializer(forget_request, context={"actor": self.actor}).data,
            status=status.HTTP_202_ACCEPTED,
            headers={"Location": reverse("forget-requests-detail", kwargs={"request_id": forget_request.uid})},
        )

    @extend_schema(
        operation_id="forget_requests_list",
        summary="Forget requests, newest first; filter by status or find the overdue ones",
        parameters=[
            OpenApiParameter("status", str, enum=[c.value for c in services.forget.Status]),
            OpenApiParameter(
                "overdue", bool, description="true: not completed and past due (failed ones too); false: the others"
            ),
            LIMIT_PARAM,
            OpenApiParameter(
                "cursor",
                {"type": "string", "maxLength": validation.CURSOR_MAX_LEN},
                description="next_cursor of the previous page",
            ),
        ],
        responses={200: s.ForgetRequestListSerializer, **ERRORS},
    )
    def get(self, request):
        q = request.query_params
        rows, next_cursor = services.forget_request_list(
            tenant=self.tenant,
            actor=self.actor,
            status=q.get("status"),
            overdue=q.get("overdue"),
            limit=q.get("limit"),
            cursor=q.get("cursor"),
        )
        return Response(
            {
                "results": s.ForgetRequestOutSerializer(rows, many=True, context={"actor": self.actor}).data,
                "next_cursor": next_cursor,
            }
        )


class ForgetRequestDetailView(AuditedAPIView):
    audit_actions = {"GET": "forget.read"}

    @extend_schema(
        operation_id="forget_requests_read",
        summary="A forget request's status, deadline and, once completed, its receipt",
        parameters=[FORGET_REQUEST_ID_PARAM],
        responses={
            200: s.ForgetRequestOutSerializer,
            404: OpenApiResponse(ErrorSerializer, description="no such forget request for this key"),
            **ERRORS,
        },
    )
    def get(self, request, request_id):
        forget_request = services.forget_request_get(tenant=self.tenant, actor=self.actor, request_id=request_id)
        return Response(s.ForgetRequestOutSerializer(forget_request, context={"actor": self.actor}).data)


# --- end-user portal ----------------------------------------------------------------------

SUBJECT_PARAM = OpenApiParameter(
    "subject",
    {"type": "string", "minLength": 1, "maxLength": validation.SUBJECT_MAX_LEN, "pattern": s.NO_CONTROL_CHARS},
    OpenApiParameter.PATH,
    required=True,
    description="the end user, as memories name them in `subject` (e.g. u10086)",
)


class PortalLinkCreateView(AuditedAPIView):
    """An opaque, one-time link to the end-user portal for one subject of this tenant
    (scope forget:create; not for keys limited to some prefixes); DELETE withdraws them all."""

    audit_actions = {"POST": "portal.link_create", "DELETE": "portal.revoke"}

    @extend_schema(
        operation_id="subjects_portal_link",
        summary="A link for an end user's page: what is remembered about them, and forgetting it",
        description=(
            "Hand `url` to the end user. It opens once (then a short portal session takes over) "
            "and not after `expires_at` (ZEROMEM_PORTAL_LINK_SECONDS after issue). No request body."
        ),
        request=None,
        parameters=[SUBJECT_PARAM],
        responses={201: s.PortalLinkSerializer, **ERRORS},
    )
    def post(self, request, subject):
        link, token = portal_link_create(tenant=self.tenant, actor=self.actor, subject=subject)
        path = reverse("portal-open", kwargs={"token": token})
        base = settings.ZEROMEM_PUBLIC_URL
        url = f"{base}{path}" if base else request.build_absolute_uri(path)
        body = s.PortalLinkSerializer({"url": url, "expires_at": link.expires_at}).data
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="subjects_portal_links_revoke",
        summary="Withdraw an end user's portal links and end their open portal sessions",
        description=(
            "Every link issued for the subject stops opening, opened or not, and a portal session "
            "opened from one ends at its next page. `revoked` counts the links withdrawn now."
        ),
        request=None,
        parameters=[SUBJECT_PARAM],
        responses={200: s.PortalLinksRevokedSerializer, **ERRORS},
    )
    def delete(self, request, subject):
        count = portal_links_revoke(tenant=self.tenant, actor=self.actor, subject=subject)
        return Response(s.PortalLinksRevokedSerializer({"revoked": count}).data)


# --- Claude's memory tool -----------------------------------------------------------------


class AnthropicMemoryView(TenantSlotMixin, AuditedAPIView):
    """Claude's memory tool (``memory_20250818``): the six commands on ``/memories/...``,
    each file a memory under ``root`` (default ``claude:memories``; ``/memories/notes/a.md`` is
    ``claude:memories:notes:a.md``). Post the tool_use ``input`` as is; the answer's
    ``content`` and ``is_error`` go back to Claude as the tool_result. Scopes as the memory
    operations need them (view: memory:read; create, str_replace, insert, rename:
    memory:write; delete and rename: memory:delete); the key's allowlist must cover the root."""

    surface = "anthropic_memory"
    audit_actions = {"POST": "anthropic.memory"}

    def needs_tenant_slot(self, request) -> bool:
        # A command on a path that may be a directory reads (view) or changes (delete,
        # rename: one transaction) up to 5000 memories: a tenant slot, as search takes.
        command = request.data.get("command") if isinstance(request.data, dict) else None
        return command in ("view", "delete", "rename")

    @extend_schema(
        operation_id="anthropic_memory",
        summary="Run one command of Claude's memory tool (memory_20250818) on ZeroMem memories",
        parameters=[
            OpenApiParameter(
                "root",
                {"type": "string", "maxLength": 400, "pattern": s.KEY_PATTERN},
                description="the key /memories maps to (default claude:memories), e.g. user:u10086:memories",
            )
        ],
        request=s.AnthropicMemoryCommandSerializer,
        responses={200: s.AnthropicMemoryResultSerializer, **ERRORS},
    )
    def post(self, request):
        try:
            content = memory_tool_run(
                tenant=self.tenant, actor=self.actor, command=request.data, root=request.query_params.get("root")
            )
        except MemoryToolError as exc:
            return Response({"content": str(exc), "is_error": True})
        return Response({"content": content, "is_error": False})
