"""Input and output shapes of the REST resources. They describe the API (OpenAPI) and
check types; the services check the rules (key grammar, sizes, scopes) once for every
surface."""

import functools

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from memories.models import ForgetRequest, Job, Memory, MemoryVersion
from memories.services import forget as forget_rules
from zeromem.kernel import opaque, validation
from zeromem.kit.api import NO_CONTROL_CHARS, ErrorDetailSerializer

# The rules of zeromem/kernel/validation.py as OpenAPI patterns (ECMA-262, with \p{L}, \p{N}, \p{M}).
KEY_PATTERN = validation.KEY_PATTERN
PREFIX_PATTERN = validation.PREFIX_PATTERN  # empty (no prefix) too
TAG_PATTERN = validation.TAG_PATTERN
CATEGORY_PATTERN = validation.CATEGORY_PATTERN


class StringListField(serializers.ListField):
    child = serializers.CharField()


class MemoryOutSerializer(serializers.ModelSerializer):
    class Meta:
        model = Memory
        fields = [
            "key",
            "namespace",
            "value",
            "sensitive",
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
        # Every field is in every response (OpenAPI: required).
        extra_kwargs = {name: {"required": True} for name in fields}

    tags = StringListField(required=True)


@functools.cache
def _memory_out() -> MemoryOutSerializer:
    return MemoryOutSerializer()


def memory_out(memory) -> dict:
    """``MemoryOutSerializer(memory).data``, from one serializer per process: a
    ModelSerializer builds its fields from the model on every instantiation (0.36 of the
    0.38 ms it took per memory, about a fifth of a REST GET's CPU); the built fields hold no
    per-request state (no context is used), so one instance serves every request."""
    return _memory_out().to_representation(memory)


class _OnlyStrings:
    """Only JSON strings: DRF's CharField turns 5 into "5"; the tool endpoint refuses it."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise serializers.ValidationError("Not a valid string.", code="invalid")
        return super().to_internal_value(data)


class StrictCharField(_OnlyStrings, serializers.CharField):
    pass


class StrictRegexField(_OnlyStrings, serializers.RegexField):
    pass


@extend_schema_field({"type": "string", "minLength": 1, "maxLength": validation.TAG_MAX_LEN, "pattern": TAG_PATTERN})
class TagField(StrictCharField):
    """A tag; its grammar (TAG_PATTERN) is checked by the service."""

    def __init__(self, **kwargs):
        super().__init__(max_length=validation.TAG_MAX_LEN, trim_whitespace=False, **kwargs)


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


@extend_schema_field(
    {
        "anyOf": [
            {"type": "object", "additionalProperties": True},
            {"type": "array", "items": {}},
            {"type": "string"},
            {"type": "number"},
            {"type": "boolean"},
        ]
    }
)
class MemoryValueField(serializers.JSONField):
    """A memory's value: any JSON but null (JSONField refuses null unless allow_null)."""


class StrictBooleanField(serializers.BooleanField):
    """A JSON boolean only: DRF's BooleanField also takes "true", 1 and "yes"."""

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class _MemoryFieldsIn(serializers.Serializer):
    ttl_seconds = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=validation.TTL_MAX_SECONDS)
    tags = serializers.ListField(
        child=TagField(),
        required=False,
        allow_null=True,
        max_length=validation.TAGS_MAX,
    )
    category = StrictRegexField(
        CATEGORY_PATTERN, required=False, allow_null=True, max_length=validation.CATEGORY_MAX_LEN, trim_whitespace=False
    )
    importance = StrictIntegerField(required=False, allow_null=True, min_value=0, max_value=10)
    source = StrictRegexField(
        NO_CONTROL_CHARS, required=False, allow_null=True, max_length=validation.SOURCE_MAX_LEN, trim_whitespace=False
    )


class MemoryPutSerializer(_MemoryFieldsIn):
    value = MemoryValueField(help_text="any JSON value but null (16 KiB serialized by default)")
    sensitive = StrictBooleanField(
        required=False, allow_null=True, help_text="store the value encrypted (README 'Encryption at rest')"
    )
    # "" is no subject, as the service and the tool take it (a blank one is refused there).
    subject = StrictRegexField(
        NO_CONTROL_CHARS,
        required=False,
        allow_null=True,
        allow_blank=True,
        max_length=validation.SUBJECT_MAX_LEN,
        trim_whitespace=False,
    )


class MemoryPatchSerializer(_MemoryFieldsIn):
    value = MemoryValueField(required=False, help_text="any JSON value but null")
    expected_version = StrictIntegerField(
        required=False, allow_null=True, min_value=1, max_value=validation.VERSION_MAX
    )


class MemoryVersionSerializer(serializers.ModelSerializer):
    # An API key's id as a token, not its row id (zeromem/kernel/opaque.py).
    actor_id = serializers.SerializerMethodField()

    class Meta:
        model = MemoryVersion
        fields = ["version", "op", "value", "actor_kind", "actor_id", "created_at"]

    def get_actor_id(self, obj) -> str:
        return opaque.shown_actor_id(obj.actor_kind, obj.actor_id)


class HistorySerializer(serializers.Serializer):
    key = serializers.CharField()
    results = MemoryVersionSerializer(many=True)
    next_cursor = serializers.CharField(allow_null=True)


@extend_schema_field(
    {
        "oneOf": [{"type": "object", "additionalProperties": True}, {"type": "string"}],
        "description": "object, or the object as a JSON string",
    }
)
class ToolArgumentsField(serializers.JSONField):
    """A tool call's arguments: an object, or that object as a JSON string (how OpenAI sends
    them). Whether the string parses, and what the arguments say, is the tool's business."""

    default_error_messages = {"invalid": "must be an object, or the object as a JSON string"}

    def to_internal_value(self, data):
        if not isinstance(data, (dict, str)):
            self.fail("invalid")
        return data


class ToolFunctionSerializer(serializers.Serializer):
    name = StrictCharField()
    arguments = ToolArgumentsField(required=False)


class ToolCallSerializer(serializers.Serializer):
    """Either {name, arguments} or an OpenAI tool call {id, type, function: {name, arguments}}.

    The OpenAPI description of the body: the registry (``memories.tools.tool_call``) checks
    a call's shape by these same rules, once, and then the call itself (name, arguments)."""

    id = StrictCharField(required=False, allow_null=True, help_text="echoed back as tool_call_id")
    name = StrictCharField(required=False)
    arguments = ToolArgumentsField(required=False)
    type = serializers.ChoiceField(choices=["function"], required=False)
    function = ToolFunctionSerializer(required=False)


class ToolBatchSerializer(serializers.Serializer):
    calls = serializers.ListField(child=ToolCallSerializer(), min_length=1, max_length=50)


class ToolSearchHitSerializer(serializers.Serializer):
    key = serializers.CharField()
    value = serializers.JSONField()
    score = serializers.FloatField()


class ToolResultSerializer(serializers.Serializer):
    """What goes back to the model. ``status`` says which of the other fields are there:
    ``ok`` (the tool's fields), ``not_found`` (key), ``conflict`` (key, current_version),
    ``error`` (error)."""

    status = serializers.ChoiceField(choices=["ok", "not_found", "conflict", "error"])
    tool_call_id = serializers.CharField(required=False)
    key = serializers.CharField(required=False)
    value = serializers.JSONField(required=False)
    version = serializers.IntegerField(required=False)
    created = serializers.BooleanField(required=False)
    updated_at = serializers.DateTimeField(required=False)
    current_version = serializers.IntegerField(required=False)
    keys = StringListField(required=False)
    next_cursor = serializers.CharField(required=False, allow_null=True)
    results = ToolSearchHitSerializer(many=True, required=False)
    text = serializers.CharField(required=False)
    count = serializers.IntegerField(required=False)
    job_id = serializers.UUIDField(required=False)
    error = ErrorDetailSerializer(required=False)


class ToolBatchResultSerializer(serializers.Serializer):
    """One result per call, in order; ``pending``: the indexes (from 0, ascending) of the calls
    that met a transient failure (429, 5xx, ``internal_error``) — those a retry with the same
    ``Idempotency-Key`` runs again, the others' results standing. Sent without a key, the same
    list: retrying those calls then needs a key (or the whole batch runs again)."""

    results = ToolResultSerializer(many=True)
    pending = serializers.ListField(child=serializers.IntegerField(min_value=0))


class ToolListSerializer(serializers.Serializer):
    format = serializers.ChoiceField(choices=["openai", "anthropic", "mcp"])
    tools = serializers.ListField(child=serializers.DictField())


# --- summaries and jobs ------------------------------------------------------------------


def _summary_prefix_max_len() -> int:
    from memories.services.summaries import PREFIX_MAX_LEN

    return PREFIX_MAX_LEN


@extend_schema_field(
    {"type": "string", "minLength": 1, "maxLength": _summary_prefix_max_len(), "pattern": PREFIX_PATTERN}
)
class SummaryPrefixField(StrictCharField):
    """The namespace to summarize; its grammar (PREFIX_PATTERN) is checked by the service."""

    def __init__(self, **kwargs):
        super().__init__(max_length=_summary_prefix_max_len(), trim_whitespace=False, **kwargs)


class SummaryStartSerializer(serializers.Serializer):
    prefix = SummaryPrefixField(help_text="the namespace to compact, e.g. session:s1:")
    archive = StrictBooleanField(required=False, help_text="move the summarized memories to the trash (default false)")


class JobStartedSerializer(serializers.Serializer):
    job_id = serializers.UUIDField(help_text="follow it at /api/v1/jobs/{job_id}")
    status = serializers.ChoiceField(choices=Job.Status.choices)


class JobSerializer(serializers.ModelSerializer):
    """A background job: what it was asked (params), how it went (status, attempts, error)
    and what it did (result). Keys, prefixes and counts only, never memory values.
    ``started_at`` is when the latest attempt began; ``retry_at``, of a queued job, the
    earliest its next attempt starts (the LLM endpoint asked for time: ``Retry-After``,
    this job's or another job's of the same endpoint), null when it may start at once."""

    # The job's uid: its row id comes from a sequence every tenant shares.
    id = serializers.UUIDField(source="uid", read_only=True)
    params = serializers.DictField()
    result = serializers.DictField()

    class Meta:
        model = Job
        fields = [
            "id",
            "kind",
            "status",
            "params",
            "result",
            "error",
            "attempts",
            "created_at",
            "started_at",
            "finished_at",
            "retry_at",
        ]
        extra_kwargs = {name: {"required": True} for name in fields}


# --- forget requests ---------------------------------------------------------------------


@extend_schema_field({"type": "string", "minLength": 1, "maxLength": validation.KEY_MAX_LEN, "pattern": KEY_PATTERN})
class ForgetKeyField(StrictCharField):
    """A key to forget; its grammar (KEY_PATTERN) is checked by the service."""

    def __init__(self, **kwargs):
        super().__init__(max_length=validation.KEY_MAX_LEN, trim_whitespace=False, **kwargs)


@extend_schema_field({"type": "string", "minLength": 1, "maxLength": validation.KEY_MAX_LEN, "pattern": PREFIX_PATTERN})
class ForgetPrefixField(StrictCharField):
    """A key prefix to forget; its grammar (PREFIX_PATTERN) is checked by the service."""

    def __init__(self, **kwargs):
        super().__init__(max_length=validation.KEY_MAX_LEN, trim_whitespace=False, **kwargs)


class ForgetRequestCreateSerializer(serializers.Serializer):
    """Exactly one of ``subject``, ``prefix`` or ``keys`` (the service names the field at
    fault when there are none or several)."""

    subject = StrictRegexField(
        NO_CONTROL_CHARS,
        required=False,
        min_length=1,
        max_length=validation.SUBJECT_MAX_LEN,
        trim_whitespace=False,
        help_text="the end user whose memories to forget (their summaries too)",
    )
    prefix = ForgetPrefixField(required=False, help_text="forget every key under this prefix, e.g. user:u10086:")
    keys = serializers.ListField(child=ForgetKeyField(), required=False, min_length=1, max_length=forget_rules.KEYS_MAX)
    reason = StrictCharField(
        required=False, allow_blank=True, max_length=forget_rules.REASON_MAX_LEN, trim_whitespace=False
    )
    due_in_days = StrictIntegerField(
        required=False,
        min_value=1,
        max_value=forget_rules.DUE_IN_DAYS_MAX,
        help_text=f"deadline in days (default {forget_rules.DUE_IN_DAYS_DEFAULT})",
    )


class ForgetTargetSerializer(serializers.Serializer):
    """What the request forgets: exactly one of the three fields is present."""

    subject = serializers.CharField(required=False)
    prefix = serializers.CharField(required=False)
    keys = StringListField(required=False)


class ForgetReceiptSerializer(serializers.Serializer):
    """What a completed request erased: counts and times, never erased content."""

    memories = serializers.IntegerField()
    versions = serializers.IntegerField()
    summaries = serializers.IntegerField()
    admin_log_entries = serializers.IntegerField()
    batches = serializers.IntegerField()
    audit_events_redacted = serializers.IntegerField()
    # Summaries outside the requester's reach, rebuilt without the forgotten memories: named
    # when the reader's allowlist covers them, else counted (services.forget_receipt).
    summaries_rebuilt = serializers.ListField(child=serializers.CharField(), required=False)
    summaries_rebuilt_outside_allowlist = serializers.IntegerField(required=False)
    # Crypto-shredding (a subject's forget): its data keys destroyed, so its encrypted values
    # are unreadable in every copy — backups of the main database too (README "Encryption at rest").
    data_keys_destroyed = serializers.IntegerField(required=False)
    crypto_shredded = serializers.BooleanField(required=False)
    received_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField()
    completed_at = serializers.DateTimeField()


class ForgetRequestOutSerializer(serializers.Serializer):
    # The request's uid: its row id comes from a sequence every tenant shares.
    id = serializers.UUIDField(source="uid")
    status = serializers.ChoiceField(choices=ForgetRequest.Status.choices)
    target = serializers.SerializerMethodField()
    reason = serializers.CharField()
    created_at = serializers.DateTimeField()
    due_at = serializers.DateTimeField()
    overdue = serializers.BooleanField(source="is_overdue", help_text="past due and not completed")
    started_at = serializers.DateTimeField(allow_null=True)
    completed_at = serializers.DateTimeField(allow_null=True)
    attempts = serializers.IntegerField()
    receipt = serializers.SerializerMethodField()
    error = serializers.SerializerMethodField()

    @extend_schema_field(ForgetTargetSerializer)
    def get_target(self, obj) -> dict:
        if obj.subject:
            return {"subject": obj.subject}
        if obj.prefix:
            return {"prefix": obj.prefix}
        return {"keys": list(obj.keys)}

    @extend_schema_field(ForgetReceiptSerializer(allow_null=True, help_text="when completed; else null"))
    def get_receipt(self, obj) -> dict | None:
        # The view passes its actor: what the receipt may name depends on who reads it.
        receipt = forget_rules.forget_receipt(actor=self.context["actor"], request=obj)
        return None if receipt is None else ForgetReceiptSerializer(receipt).data

    @extend_schema_field({"type": "string", "nullable": True, "description": "why it failed; else null"})
    def get_error(self, obj) -> str | None:
        return obj.error or None if obj.status == ForgetRequest.Status.FAILED else None


class ForgetRequestListSerializer(serializers.Serializer):
    results = ForgetRequestOutSerializer(many=True)
    next_cursor = serializers.CharField(allow_null=True)


# --- end-user portal ---------------------------------------------------------------------


class PortalLinkSerializer(serializers.Serializer):
    url = serializers.URLField(help_text="the one-time link to hand to the end user")
    expires_at = serializers.DateTimeField(help_text="the link does not open after this")


# --- Claude's memory tool ------------------------------------------------------------------


class AnthropicMemoryCommandSerializer(serializers.Serializer):
    """A ``memory_20250818`` tool_use ``input``, as Claude sends it. Which fields a command
    takes: view (path, view_range), create (path, file_text), str_replace (path, old_str,
    new_str), insert (path, insert_line, insert_text), delete (path), rename (old_path,
    new_path); any other field is refused (unknown_field)."""

    command = serializers.ChoiceField(choices=["view", "create", "str_replace", "insert", "delete", "rename"])
    path = StrictCharField(required=False, help_text="/memories/...")
    view_range = serializers.ListField(
        child=serializers.IntegerField(),
        min_length=2,
        max_length=3,
        required=False,
        help_text="[start, end]; end -1: to the end; a file's [start, end, character]: line start read on "
        "from that character (1 or more), as a cut line's last line says",
    )
    file_text = StrictCharField(required=False, allow_blank=True, trim_whitespace=False)
    old_str = StrictCharField(required=False, allow_blank=True, trim_whitespace=False)
    new_str = StrictCharField(required=False, allow_blank=True, trim_whitespace=False)
    insert_line = serializers.IntegerField(required=False)
    insert_text = StrictCharField(required=False, allow_blank=True, trim_whitespace=False)
    old_path = StrictCharField(required=False)
    new_path = StrictCharField(required=False)


class AnthropicMemoryResultSerializer(serializers.Serializer):
    content = serializers.CharField(help_text="the tool_result content to hand back to Claude")
    is_error = serializers.BooleanField(help_text="true: send it back as an error tool_result (is_error)")


class PortalLinksRevokedSerializer(serializers.Serializer):
    revoked = serializers.IntegerField(help_text="how many links (and their sessions) were withdrawn")
