"""Input and output shapes of the REST resources. They describe the API (OpenAPI) and
check types; the services check the rules (key grammar, sizes, scopes) once for every
surface."""

from rest_framework import serializers

from memories import validation
from memories.models import Memory, MemoryVersion


class ErrorDetailSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    field = serializers.CharField(allow_null=True)


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


class MemoryOutSerializer(serializers.ModelSerializer):
    class Meta:
        model = Memory
        fields = [
            "key",
            "namespace",
            "value",
            "category",
            "subject",
            "tags",
            "importance",
            "source",
            "version",
            "expires_at",
            "created_at",
            "updated_at",
            "last_accessed_at",
            "access_count",
        ]


class MemoryListSerializer(serializers.Serializer):
    results = MemoryOutSerializer(many=True)
    next_cursor = serializers.CharField(allow_null=True)


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer, not a numeric string: the schema says integer, and the tool
    endpoint (no serializer) refuses "60" too."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class _MemoryFieldsIn(serializers.Serializer):
    ttl_seconds = StrictIntegerField(
        required=False, allow_null=True, min_value=1, max_value=validation.TTL_MAX_SECONDS
    )
    tags = serializers.ListField(
        child=serializers.RegexField(validation.TAG_RE.pattern, max_length=64),
        required=False,
        allow_null=True,
        max_length=validation.TAGS_MAX,
    )
    category = serializers.RegexField(validation.CATEGORY_RE.pattern, required=False, allow_null=True)
    importance = StrictIntegerField(required=False, allow_null=True, min_value=0, max_value=10)
    source = serializers.CharField(required=False, allow_null=True, max_length=validation.SOURCE_MAX_LEN)


class MemoryPutSerializer(_MemoryFieldsIn):
    value = serializers.JSONField(help_text="any JSON value but null (16 KiB serialized by default)")
    subject = serializers.CharField(required=False, allow_null=True, max_length=validation.SUBJECT_MAX_LEN)


class MemoryPatchSerializer(_MemoryFieldsIn):
    value = serializers.JSONField(required=False)
    expected_version = StrictIntegerField(required=False, allow_null=True, min_value=1)


class MemoryVersionSerializer(serializers.ModelSerializer):
    class Meta:
        model = MemoryVersion
        fields = ["version", "op", "value", "actor_kind", "actor_id", "created_at"]


class HistorySerializer(serializers.Serializer):
    key = serializers.CharField()
    results = MemoryVersionSerializer(many=True)


class ToolCallSerializer(serializers.Serializer):
    """Either {name, arguments} or an OpenAI tool call {id, type, function: {name, arguments}}."""

    id = serializers.CharField(required=False, help_text="echoed back as tool_call_id")
    name = serializers.CharField(required=False)
    arguments = serializers.JSONField(required=False, help_text="object, or the object as a JSON string")
    type = serializers.ChoiceField(choices=["function"], required=False)
    function = serializers.DictField(required=False)


class ToolBatchSerializer(serializers.Serializer):
    calls = ToolCallSerializer(many=True, max_length=50)


class ToolResultSerializer(serializers.Serializer):
    status = serializers.CharField()
    tool_call_id = serializers.CharField(required=False)


class ToolBatchResultSerializer(serializers.Serializer):
    results = ToolResultSerializer(many=True)
