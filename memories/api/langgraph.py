"""LangGraph's store routes under ``/api/v1/langgraph``, in the request and response shapes
``langgraph_sdk``'s ``client.store`` sends and expects (public shapes; no server code).
What they mean — the namespace → key mapping, TTL, filters — is memories/services/langgraph.py.

Authentication: ``Authorization: Bearer zm_...`` like every route, or ``X-Api-Key: zm_...``
(what ``get_client(url=..., api_key=...)`` sends). Audited with surface ``langgraph``.
"""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from memories.api.auth import ApiKeyAuthentication
from memories.services import langgraph as lg
from zeromem.kernel import validation
from zeromem.kernel.errors import InvalidInput
from zeromem.kit.api import ERRORS, AuditedAPIView, ErrorSerializer, TenantSlotMixin


class ApiKeyOrXApiKeyAuthentication(ApiKeyAuthentication):
    """The bearer key, or the same key in ``X-Api-Key`` (LangGraph's SDK header)."""

    def authenticate(self, request):
        meta = request.META
        if not meta.get("HTTP_AUTHORIZATION") and meta.get("HTTP_X_API_KEY"):
            meta["HTTP_AUTHORIZATION"] = f"Bearer {meta['HTTP_X_API_KEY'].strip()}"
        return super().authenticate(request)


class ApiKeyOrXApiKeyScheme(OpenApiAuthenticationExtension):
    """The bearer key (the same key is also taken from ``X-Api-Key``, LangGraph's header)."""

    target_class = "memories.api.langgraph.ApiKeyOrXApiKeyAuthentication"
    name = "ApiKeyOrXApiKey"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "zm_<lookup>_<secret>",
            "description": "or the same key in the X-Api-Key header",
        }


def LABEL():  # noqa: N802 — a fresh field each time (DRF binds a child field to its parent)
    return serializers.CharField(max_length=validation.KEY_MAX_LEN)


class ItemPutSerializer(serializers.Serializer):
    namespace = serializers.ListField(child=LABEL(), min_length=1)
    key = serializers.CharField(max_length=validation.KEY_MAX_LEN)
    value = serializers.DictField(help_text="a JSON object")
    index = serializers.JSONField(required=False, allow_null=True, help_text="false or field paths; ignored")
    ttl = serializers.IntegerField(required=False, allow_null=True, min_value=1, help_text="minutes")


class ItemDeleteSerializer(serializers.Serializer):
    namespace = serializers.ListField(child=LABEL())
    key = serializers.CharField(max_length=validation.KEY_MAX_LEN)


class ItemSerializer(serializers.Serializer):
    namespace = serializers.ListField(child=serializers.CharField())
    key = serializers.CharField()
    value = serializers.DictField()
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class SearchItemSerializer(ItemSerializer):
    score = serializers.FloatField(required=False, allow_null=True)


class SearchRequestSerializer(serializers.Serializer):
    namespace_prefix = serializers.ListField(child=LABEL(), required=False)
    filter = serializers.DictField(required=False, allow_null=True)
    limit = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=validation.LIMIT_MAX)
    offset = serializers.IntegerField(required=False, allow_null=True, min_value=0)
    query = serializers.CharField(
        required=False, allow_null=True, allow_blank=True, max_length=validation.QUERY_MAX_LEN
    )
    refresh_ttl = serializers.BooleanField(required=False, allow_null=True)


class SearchResponseSerializer(serializers.Serializer):
    items = SearchItemSerializer(many=True)
    cut = serializers.BooleanField(
        help_text="the page stopped at ZEROMEM_PAGE_VALUES_MAX_BYTES: more items follow at offset + len(items)"
    )


class NamespacesRequestSerializer(serializers.Serializer):
    prefix = serializers.ListField(child=LABEL(), required=False, allow_null=True)
    suffix = serializers.ListField(child=LABEL(), required=False, allow_null=True)
    max_depth = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    limit = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=1000)
    offset = serializers.IntegerField(required=False, allow_null=True, min_value=0)


class NamespacesResponseSerializer(serializers.Serializer):
    namespaces = serializers.ListField(child=serializers.ListField(child=serializers.CharField()))


def _body(request) -> dict:
    if not isinstance(request.data, dict):
        raise InvalidInput("the body must be a JSON object", field="body")
    return request.data


def _known(data: dict, serializer_class) -> dict:
    unknown = set(data) - set(serializer_class().fields)
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidInput(f"unknown field '{name}'", field=name, code="unknown_field")
    return data


class LangGraphView(AuditedAPIView):
    surface = "langgraph"
    authentication_classes = [ApiKeyOrXApiKeyAuthentication]


class StoreItemsView(LangGraphView):
    audit_actions = {"GET": "memory.read", "PUT": "memory.write", "DELETE": "memory.delete"}

    @extend_schema(
        operation_id="langgraph_store_get",
        summary="LangGraph: one item",
        parameters=[
            OpenApiParameter("key", {"type": "string", "minLength": 1}, required=True),
            OpenApiParameter("namespace", str, description="labels joined by '.'", required=True),
            OpenApiParameter("refresh_ttl", bool, description="start the item's TTL again"),
        ],
        responses={200: ItemSerializer, 404: OpenApiResponse(ErrorSerializer, description="no such item"), **ERRORS},
    )
    def get(self, request):
        q = request.query_params
        if "namespace" not in q:
            raise InvalidInput("is required", field="namespace", code="required")
        dotted = q.get("namespace")
        item = lg.lg_get(
            tenant=self.tenant,
            actor=self.actor,
            namespace=dotted.split(".") if dotted else [],
            key=q.get("key"),
            refresh_ttl=q.get("refresh_ttl"),
        )
        return Response(item)

    @extend_schema(
        operation_id="langgraph_store_put",
        summary="LangGraph: create or replace an item (ttl in minutes)",
        request=ItemPutSerializer,
        responses={204: None, **ERRORS},
    )
    def put(self, request):
        data = _known(_body(request), ItemPutSerializer)
        lg.lg_put(
            tenant=self.tenant,
            actor=self.actor,
            namespace=data.get("namespace"),
            key=data.get("key"),
            value=data.get("value"),
            ttl=data.get("ttl"),
            index=data.get("index"),
        )
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        operation_id="langgraph_store_delete",
        summary="LangGraph: delete an item (no error if there is none)",
        request=ItemDeleteSerializer,
        responses={204: None, **ERRORS},
    )
    def delete(self, request):
        data = _known(_body(request), ItemDeleteSerializer)
        lg.lg_delete(tenant=self.tenant, actor=self.actor, namespace=data.get("namespace"), key=data.get("key"))
        return Response(status=status.HTTP_204_NO_CONTENT)


class StoreSearchView(TenantSlotMixin, LangGraphView):
    audit_actions = {"POST": "memory.list"}

    @extend_schema(
        operation_id="langgraph_store_search",
        summary="LangGraph: items under a namespace prefix, filtered; ranked when there is a query",
        request=SearchRequestSerializer,
        responses={200: SearchResponseSerializer, **ERRORS},
    )
    def post(self, request):
        data = _known(_body(request), SearchRequestSerializer)
        items = lg.lg_search(
            tenant=self.tenant,
            actor=self.actor,
            namespace_prefix_=data.get("namespace_prefix", []),
            filter_=data.get("filter"),
            limit=data.get("limit"),
            offset=data.get("offset"),
            query=data.get("query"),
            refresh_ttl=data.get("refresh_ttl"),
        )
        return Response({"items": items, "cut": items.cut})


class StoreNamespacesView(TenantSlotMixin, LangGraphView):
    audit_actions = {"POST": "memory.list"}

    @extend_schema(
        operation_id="langgraph_store_namespaces",
        summary="LangGraph: namespaces holding items, by prefix/suffix ('*' any label), max_depth",
        request=NamespacesRequestSerializer,
        responses={200: NamespacesResponseSerializer, **ERRORS},
    )
    def post(self, request):
        data = _known(_body(request), NamespacesRequestSerializer)
        namespaces = lg.lg_list_namespaces(
            tenant=self.tenant,
            actor=self.actor,
            prefix=data.get("prefix"),
            suffix=data.get("suffix"),
            max_depth=data.get("max_depth"),
            limit=data.get("limit"),
            offset=data.get("offset"),
        )
        return Response({"namespaces": namespaces})
