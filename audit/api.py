"""Compliance review over REST (scope ``audit:read``): the audit log filtered and paginated,
streamed exports, and checkpoints to keep outside the database. Every one of these reads
is itself an audit event."""

from django.core.handlers.asgi import ASGIRequest
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from audit import services
from audit.exports import CONTENT_TYPES, audit_export_response
from audit.models import REVIEW_FIELDS, AuditCheckpoint, AuditEvent
from audit.selectors import TEXT_MAX_LEN, audit_filters
from zeromem.kernel import opaque, validation
from zeromem.kit.api import ERRORS, NO_CONTROL_CHARS, AuditedAPIView, TenantSlotMixin

TEXT = {"type": "string", "maxLength": TEXT_MAX_LEN, "pattern": NO_CONTROL_CHARS}
FILTER_PARAMS = [
    OpenApiParameter("since", {"type": "string", "format": "date-time"}, description="occurred at or after (ISO 8601)"),
    OpenApiParameter("until", {"type": "string", "format": "date-time"}, description="occurred before (ISO 8601)"),
    OpenApiParameter(
        "actor",
        TEXT,
        description=(
            "an actor's label (a key's zm_ prefix, a username) or id; an id qualified by its kind, "
            "api_key:7 or staff:7 (a bare number needs actor_kind: keys and staff users are both numbered)"
        ),
    ),
    OpenApiParameter("actor_kind", str, enum=AuditEvent.ActorKind.values),
    OpenApiParameter("action", TEXT, description="exact (memory.read), or a family ending in '.' (memory.)"),
    OpenApiParameter("key_prefix", TEXT, description="the target key starts with this, e.g. user:u10086:"),
    OpenApiParameter("subject", TEXT, description="the end user the event is about"),
    OpenApiParameter("outcome", str, enum=AuditEvent.Outcome.values),
]


class AuditEventSerializer(serializers.ModelSerializer):
    # The event's uid: its row id comes from a sequence every tenant shares (README "Audit").
    id = serializers.UUIDField(source="uid", read_only=True)
    actor_id = serializers.SerializerMethodField()

    class Meta:
        model = AuditEvent
        fields = [*REVIEW_FIELDS, "seal"]

    def get_actor_id(self, obj) -> str:
        return opaque.shown_actor_id(obj.actor_kind, obj.actor_id)


class AuditEventListSerializer(serializers.Serializer):
    results = AuditEventSerializer(many=True)
    next_cursor = serializers.CharField(
        allow_null=True,
        help_text="null at the end; a page reads a bounded window of the log, so it may hold fewer rows than "
        "limit (even none) with a next_cursor",
    )


class AuditCheckpointSerializer(serializers.Serializer):
    tenant = serializers.CharField()
    seal = serializers.IntegerField(help_text="the chain's head seal (0: nothing sealed yet)")
    head_hash = serializers.CharField()
    events = serializers.IntegerField(help_text="events sealed up to and including that seal")
    at = serializers.DateTimeField()


class AuditEventListView(AuditedAPIView):
    audit_actions = {"GET": "audit.list"}

    @extend_schema(
        operation_id="audit_events_list",
        summary="The tenant's audit events, newest first, filtered; never memory values",
        parameters=[
            *FILTER_PARAMS,
            OpenApiParameter(
                "limit",
                {"type": "integer", "minimum": 1, "maximum": validation.LIMIT_MAX},
                description=f"1-{validation.LIMIT_MAX}, default 50",
            ),
            OpenApiParameter(
                "cursor", {"type": "string", "maxLength": 1024}, description="next_cursor of the previous page"
            ),
        ],
        responses={200: AuditEventListSerializer, **ERRORS},
    )
    def get(self, request):
        q = request.query_params
        rows, next_cursor = services.audit_event_list(
            tenant=self.tenant, actor=self.actor, filters=audit_filters(q), limit=q.get("limit"), cursor=q.get("cursor")
        )
        return Response({"results": AuditEventSerializer(rows, many=True).data, "next_cursor": next_cursor})


class AuditExportView(TenantSlotMixin, AuditedAPIView):
    audit_actions = {"GET": "audit.export"}

    def perform_content_negotiation(self, request, force=False):
        # The body is CSV or JSON Lines whatever the Accept header says; errors are JSON.
        return super().perform_content_negotiation(request, force=True)

    @extend_schema(
        operation_id="audit_events_export",
        summary="Export the filtered audit events as CSV or JSON Lines, streamed (newest first)",
        parameters=[
            *FILTER_PARAMS,
            OpenApiParameter("format", str, enum=list(CONTENT_TYPES), description="csv (default) or jsonl"),
        ],
        responses={
            (200, "text/csv"): OpenApiResponse(str, description="a header row, then one row per event"),
            (200, "application/x-ndjson"): OpenApiResponse(str, description="one JSON object per line"),
            **ERRORS,
        },
    )
    def get(self, request):
        q = request.query_params
        return audit_export_response(
            tenant=self.tenant,
            actor=self.actor,
            filters=audit_filters(q),
            fmt=q.get("format", "csv"),
            asynchronous=isinstance(request._request, ASGIRequest),
        )


class AuditCheckpointView(AuditedAPIView):
    audit_actions = {"POST": "audit.checkpoint"}

    @extend_schema(
        operation_id="audit_checkpoints_create",
        summary="Seal the log and return its head: keep it outside ZeroMem to detect a cut-off tail",
        request=None,
        responses={201: AuditCheckpointSerializer, **ERRORS},
    )
    def post(self, request):
        checkpoint: AuditCheckpoint = services.audit_checkpoint_create(tenant=self.tenant, actor=self.actor)
        return Response(AuditCheckpointSerializer(checkpoint.as_dict()).data, status=status.HTTP_201_CREATED)
