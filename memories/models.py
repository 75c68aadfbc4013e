"""Tenants, their members and API keys, and the memories agents keep.

Every data row carries its tenant and every index leads with it, so one tenant's rows sit
together and the data can later be distributed by tenant (e.g. Citus).
"""

import hashlib
import secrets
import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from zeromem.kernel import crypto, opaque
from zeromem.kernel.keyprefix import startswith_q
from zeromem.kernel.scopes import Role


class Tenant(models.Model):
    slug = models.SlugField(max_length=63, unique=True)
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(default=timezone.now)
    # Serialized-size cap of one memory value; null means the server default. Never above
    # settings.ZEROMEM_VALUE_HARD_CAP_BYTES (enforced by the service, not trusted from here).
    value_max_bytes = models.PositiveIntegerField(null=True, blank=True)
    trash_retention_days = models.PositiveIntegerField(null=True, blank=True)
    # Audit events older than this many days are purged; null means the server default
    # (settings.ZEROMEM_AUDIT_RETENTION_DAYS).
    audit_retention_days = models.PositiveIntegerField(null=True, blank=True)
    # Sensitivity rules (README "Encryption at rest"): a memory whose key matches one of these
    # patterns ("user:*:phone", * any characters) or whose JSON value holds a field named in
    # ``sensitive_fields`` (any depth, case-insensitive) is encrypted like ``sensitive: true``.
    sensitive_keys = models.JSONField(default=list, blank=True)
    sensitive_fields = models.JSONField(default=list, blank=True)

    def __str__(self) -> str:
        return self.slug

    @property
    def effective_value_max_bytes(self) -> int:
        cap = settings.ZEROMEM_VALUE_HARD_CAP_BYTES
        return min(self.value_max_bytes or settings.ZEROMEM_VALUE_MAX_BYTES, cap)


class Membership(models.Model):
    Role = Role

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "user"], name="membership_one_per_user_tenant")]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"


API_KEY_PREFIX = "zm_"


def hash_api_key(raw_key: str) -> str:
    # Keys carry 256 bits of randomness, so a fast hash is enough (no password stretching):
    # a leaked table still cannot be reversed, and auth stays one indexed lookup.
    return hashlib.sha256(raw_key.encode()).hexdigest()


class ApiKey(models.Model):
    """An agent's credential. The secret is shown once at creation; only its hash is kept.

    Format: ``zm_<lookup>_<secret>``. The ``zm_`` prefix lets secret scanners spot leaked keys;
    ``lookup`` (public, indexed) finds the row, the hash of the whole key proves it.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    lookup = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    scopes = models.JSONField(default=list)
    # Key prefixes this key may touch, e.g. ["user:u10086:"]; empty means the whole tenant.
    allowed_prefixes = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)

    class Meta:
        indexes = [models.Index(fields=["tenant", "created_at"], name="apikey_tenant_created")]

    def __str__(self) -> str:
        return f"{self.display_prefix} ({self.name})"

    @property
    def display_prefix(self) -> str:
        return f"{API_KEY_PREFIX}{self.lookup}"

    @staticmethod
    def generate() -> tuple[str, str, str]:
        """Return (raw key, lookup, hash). The raw key is never stored."""
        lookup = secrets.token_hex(6)
        raw = f"{API_KEY_PREFIX}{lookup}_{secrets.token_urlsafe(32)}"
        return raw, lookup, hash_api_key(raw)


class TsVectorField(models.TextField):
    """PostgreSQL ``tsvector``; plain text (left empty) on SQLite, where FTS5 indexes
    ``search_text`` instead (migration 0010)."""

    def db_type(self, connection):
        return "tsvector" if connection.vendor == "postgresql" else "text"


class SealedJSONField(models.JSONField):
    """A JSON value stored encrypted when its row says so (``seal_scope()``), opened on load.

    ``save()``/``create()`` seal through :meth:`pre_save`; a ``QuerySet.update()`` bypasses it,
    so services pass an already sealed envelope there (``memories.keyring.seal_value``), and a
    CHECK constraint refuses a sensitive row holding anything else. Loading marks an envelope
    :class:`~zeromem.kernel.crypto.Unopened`; the row opens it once its tenant is known
    (:class:`OpensSealedValues`, ``memories.keyring.open_value``), so a ciphertext of another
    tenant's key copied into this row never opens here. A value whose data key was destroyed
    (or belongs to another tenant) loads as :class:`~zeromem.kernel.crypto.ErasedValue`.
    ``values()``/``values_list()`` of the field give the ``Unopened`` envelope: open it with
    ``keyring.open_loaded(value, tenant_id=...)``."""

    def from_db_value(self, value, expression, connection):
        value = super().from_db_value(value, expression, connection)
        if crypto.is_envelope(value):
            return crypto.Unopened(value)
        return value

    def pre_save(self, model_instance, add):
        value = getattr(model_instance, self.attname)
        if isinstance(value, crypto.ErasedValue):
            return value.envelope
        scope = model_instance.seal_scope()
        if scope is not None and not crypto.is_envelope(value):
            from memories import keyring

            return keyring.seal_value(value, tenant_id=scope[0], subject=scope[1])
        return value


class OpensSealedValues:
    """Opens the row's sealed ``value`` on load under the row's own tenant: the data key
    must be this tenant's (its wrapping binds it to its tenant), else the value reads as
    erased — a ciphertext copied from another tenant's row never opens here."""

    @classmethod
    def from_db(cls, db, field_names, values):
        instance = super().from_db(db, field_names, values)
        value = instance.__dict__.get("value")
        if isinstance(value, crypto.Unopened):
            from memories import keyring

            instance.value = keyring.open_loaded(value, tenant_id=instance.tenant_id)
        return instance


class DataKey(models.Model):
    """A data key, stored only wrapped under a master key (``ZEROMEM_MASTER_KEYS``; README
    "Encryption at rest"). One current key per tenant (``subject`` empty) and per subject;
    a retired one still opens what it sealed. Destroying a subject's keys (a completed forget)
    empties ``wrapped``: nothing left in the row opens a value, in this database or a backup
    of it. Lives in the key store database when ``ZEROMEM_KEYSTORE_URL`` is set
    (memories/routers.py), so no foreign key to the tenant."""

    tenant_id = models.BigIntegerField()
    subject = models.CharField(max_length=255, blank=True, default="")
    master_key_id = models.CharField(max_length=16, blank=True, default="")
    wrapped = models.BinaryField(default=b"")
    created_at = models.DateTimeField(default=timezone.now)
    retired_at = models.DateTimeField(null=True, blank=True)
    destroyed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant_id", "subject"],
                condition=Q(retired_at__isnull=True, destroyed_at__isnull=True),
                name="datakey_one_current_per_subject",
            ),
            models.CheckConstraint(
                condition=Q(destroyed_at__isnull=True) | (Q(wrapped=b"") & Q(master_key_id="") & Q(subject="")),
                name="datakey_destroyed_holds_nothing",
            ),
        ]
        indexes = [models.Index(fields=["tenant_id", "subject"], name="datakey_tenant_subject")]

    def __str__(self) -> str:
        return f"data key {self.pk}"


class MemoryQuerySet(models.QuerySet):
    def for_tenant(self, tenant):
        return self.filter(tenant=tenant)

    def live(self, now=None):
        """Not trashed and not expired: what every read path sees, before any cleanup runs."""
        now = now or timezone.now()
        return self.filter(deleted_at__isnull=True).filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))

    def trashed(self):
        return self.filter(deleted_at__isnull=False)

    def under_prefix(self, prefix: str):
        return self.filter(startswith_q("key", prefix)) if prefix else self


class MemoryManager(models.Manager.from_queryset(MemoryQuerySet)):
    def get_queryset(self):
        return super().get_queryset().defer("search_tsv")


ETAG_PURPOSE = "memory-etag"


class Memory(OpensSealedValues, models.Model):
    class Category(models.TextChoices):
        USER = "user"
        TASK = "task"
        DECISION = "decision"
        FACT = "fact"
        SUMMARY = "summary"
        NOTE = "note"

    # No single-column index: every composite index below leads with the tenant.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memories", db_index=False)
    key = models.CharField(max_length=512)
    # Everything before the key's last segment ("user:u1" for "user:u1:pref_lang").
    namespace = models.CharField(max_length=512)
    value = SealedJSONField()
    # Stored encrypted under the subject's (else the tenant's) data key; not in the search
    # index or embeddings beyond its key and tags (README "Encryption at rest").
    sensitive = models.BooleanField(default=False)
    # Words of key and value as the search index wants them (see memories/search.py);
    # maintained by the service on every write, never shown.
    search_text = models.TextField(default="", blank=True)
    category = models.CharField(max_length=32, default=Category.NOTE)
    subject = models.CharField(max_length=255, blank=True, default="")
    tags = models.JSONField(default=list, blank=True)
    importance = models.PositiveSmallIntegerField(default=5)
    source = models.CharField(max_length=255, blank=True, default="")
    expires_at = models.DateTimeField(null=True, blank=True)
    version = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    last_accessed_at = models.DateTimeField(null=True, blank=True)
    access_count = models.PositiveIntegerField(default=0)
    deleted_at = models.DateTimeField(null=True, blank=True)
    # Keys a summary was derived from (its lineage): forgetting any of them, or the
    # summary's subject, forgets the summary too.
    sources = models.JSONField(default=list, blank=True)

    # The weighted, tenant-prefixed terms PostgreSQL searches (memories/search/text.py),
    # under a GIN index (migration 0010); null until written or backfilled. Deferred by
    # default: no read path needs it in Python.
    search_tsv = TsVectorField(null=True, blank=True, editable=False)

    objects = MemoryManager()

    class Meta:
        verbose_name_plural = "memories"
        constraints = [
            # One live memory per key; trashed copies may pile up beside it until purged.
            models.UniqueConstraint(
                fields=["tenant", "key"], condition=Q(deleted_at__isnull=True), name="memory_one_live_key_per_tenant"
            ),
            models.CheckConstraint(condition=Q(importance__lte=10), name="memory_importance_0_10"),
            models.CheckConstraint(
                condition=Q(sensitive=False) | Q(value__has_key=crypto.ENVELOPE_MARK), name="memory_sensitive_sealed"
            ),
        ]
        indexes = [
            # list/clear by prefix: key LIKE 'p%' needs text_pattern_ops on PostgreSQL
            # (see migration 0002); this one serves equality and ordering.
            models.Index(fields=["tenant", "namespace", "key"], name="memory_tenant_namespace"),
            # A page of one subject or category in key order is one range of these (a subject
            # or category sits in one stretch of the key order: walking the key index filtered
            # read every memory before it). The subject's serves the forget requests too
            # (trashed memories included); the plain category one, the dashboard's counts.
            # Built CONCURRENTLY on PostgreSQL, migration 0041.
            models.Index(
                fields=["tenant", "subject", "key"], name="memory_tenant_subject_key", condition=~Q(subject="")
            ),
            models.Index(fields=["tenant", "category"], name="memory_tenant_category"),
            models.Index(
                fields=["tenant", "category", "key"],
                name="memory_live_category_key",
                condition=Q(deleted_at__isnull=True),
            ),
            # The TTL purge's tenant-less range (expires_at <= now, every tenant at once).
            models.Index(fields=["expires_at"], name="memory_expiring", condition=Q(expires_at__isnull=False)),
            # One tenant's expiring memories (the dashboard's "expiring within 24 h"): a range of
            # this tenant's alone, however many short-lived memories other tenants hold (built
            # CONCURRENTLY on PostgreSQL, migration 0021). The purge cannot use it (its range is
            # on the second column), hence both.
            models.Index(
                fields=["tenant", "expires_at"], name="memory_tenant_expiring", condition=Q(expires_at__isnull=False)
            ),
            models.Index(fields=["tenant", "deleted_at"], name="memory_trash", condition=Q(deleted_at__isnull=False)),
            # recall with only a prefix: the tenant's most important, most recent memories
            # (built CONCURRENTLY on PostgreSQL, migration 0010).
            # Not partial: a partial index on "deleted_at IS NULL" would be ANDed into the
            # search's bitmap scan (memories/search/lexical.py).
            models.Index(fields=["tenant", "-importance", "-updated_at"], name="memory_tenant_salience"),
            # The embedding job finds memories written since its watermark (memories/search/embeddings.py).
            models.Index(fields=["updated_at"], name="memory_updated"),
            # The admin's memory list sorted by last update or by expiry, either way, a page at a
            # time: ordered by (tenant, column, id), as these hold it (the never-expiring ones,
            # NULL, too: the partial memory_tenant_expiring leaves them out). Built CONCURRENTLY
            # on PostgreSQL, migration 0029.
            models.Index(fields=["tenant", "updated_at", "id"], name="memory_tenant_updated"),
            models.Index(fields=["tenant", "expires_at", "id"], name="memory_tenant_expires"),
            # The same three orders of the trash (state=trash): the key index above holds only
            # live memories, and these two walked past every live one to reach the trashed.
            # Only trashed rows are entered (a move to the trash rewrites every index entry
            # anyway). Built CONCURRENTLY on PostgreSQL, migration 0032.
            models.Index(
                fields=["tenant", "key", "id"], name="memory_trash_key", condition=Q(deleted_at__isnull=False)
            ),
            models.Index(
                fields=["tenant", "updated_at", "id"],
                name="memory_trash_updated",
                condition=Q(deleted_at__isnull=False),
            ),
            models.Index(
                fields=["tenant", "expires_at", "id"],
                name="memory_trash_expires",
                condition=Q(deleted_at__isnull=False),
            ),
            # The dashboard's live counts subtract the trashed memories by namespace and category
            # from every memory's, read index-only (memories/selectors/dashboard.py): without
            # it, one heap page per trashed memory. Built CONCURRENTLY on PostgreSQL, migration 0037.
            models.Index(
                fields=["tenant", "namespace", "category"],
                name="memory_trash_figures",
                condition=Q(deleted_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return self.key

    def seal_scope(self) -> tuple[int, str] | None:
        return (self.tenant_id, self.subject) if self.sensitive else None

    @property
    def etag(self) -> str:
        # The row as well as the version (a key deleted and written again restarts at version
        # 1), the row as an opaque token: its id comes from a sequence every tenant shares.
        return f'"{opaque.seal_id(self.pk, purpose=ETAG_PURPOSE)}-{self.version}"'


class AccessCountFold(models.Model):
    """How far a tenant's reads are counted into ``Memory.access_count``: every
    ``memory.read`` event of the tenant's audit seals up to ``seal`` is counted, none twice
    (memories/services/access.py moves it in the same transaction as the counts)."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, primary_key=True, related_name="+")
    seal = models.PositiveIntegerField(default=0)
    folded_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"reads counted through seal {self.seal}"


class MemoryVersion(OpensSealedValues, models.Model):
    """One row per version of a memory, written with the change that made it.

    The latest row equals the memory's current value; earlier rows are its history, so a
    bad write can be seen and undone.
    """

    class Op(models.TextChoices):
        WRITE = "write"
        UPDATE = "update"
        DELETE = "delete"
        RESTORE = "restore"

    # No foreign key in the database (migration 0045): as the event's (audit migration 0017), its
    # check locked the tenant's row with every write. A version's tenant is its memory's.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, db_index=False, db_constraint=False)
    # No foreign key in the database (memories migration 0013): it cost the TTL purge a check
    # per erased memory (16.2 → 9.7 µs of CPU per memory, bench_purge_fk). Every version is
    # written under its memory's row lock (or with the new memory, in one transaction), the
    # purge skips locked rows and deletes versions with their memory in one statement, and
    # ORM deletes still cascade (on_delete): no path leaves a version without its memory.
    memory = models.ForeignKey(
        Memory, on_delete=models.CASCADE, related_name="versions", db_index=False, db_constraint=False
    )
    version = models.PositiveIntegerField()
    value = SealedJSONField()
    sensitive = models.BooleanField(default=False)
    op = models.CharField(max_length=16, choices=Op.choices)
    actor_kind = models.CharField(max_length=16)
    actor_id = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    # The end user the memory was about when this version was written (its ``subject`` then):
    # a key rewritten for another end user keeps the earlier one's values in its history, and
    # their forget request erases those versions too (memories/services/forget.py). Empty for
    # versions written before migration 0023 (their subject was not recorded).
    subject = models.CharField(max_length=255, blank=True, default="", db_default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["memory", "version"], name="memoryversion_one_per_version"),
            models.CheckConstraint(
                condition=Q(sensitive=False) | Q(value__has_key=crypto.ENVELOPE_MARK),
                name="memoryversion_sensitive_sealed",
            ),
        ]
        # The unique (memory, version) index serves history reads; tenant-wide erasure
        # (forget requests) uses this one.
        indexes = [
            models.Index(fields=["tenant", "memory"], name="memoryversion_tenant"),
            # A forget request's versions of its subject under keys now about someone else.
            models.Index(fields=["tenant", "subject"], name="memoryversion_tenant_subject", condition=~Q(subject="")),
        ]

    def __str__(self) -> str:
        return f"{self.memory_id} v{self.version} ({self.op})"

    def seal_scope(self) -> tuple[int, str] | None:
        # Sealed under the memory's key (its subject's), so forgetting the subject shreds it too.
        return (self.tenant_id, self.memory.subject) if self.sensitive else None


class RetentionRule(models.Model):
    """A tenant's lifetimes for keys under a prefix (the longest matching prefix wins).

    * ``default_ttl_seconds``: a write without ``ttl_seconds`` that creates a memory here
      expires after this long (e.g. ``session:`` → 24 h).
    * ``trash_retention_days``: deleted memories here stay restorable this long before the
      purge job erases them (else the tenant's, else the server's default).
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="retention_rules", db_index=False)
    prefix = models.CharField(max_length=512)
    default_ttl_seconds = models.PositiveIntegerField(null=True, blank=True)
    trash_retention_days = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "prefix"], name="retentionrule_one_per_prefix")]

    def __str__(self) -> str:
        return f"{self.prefix}*"


class Job(models.Model):
    """A background job an API caller can follow (``GET /api/v1/jobs/{id}``).

    ``params`` and ``result`` hold keys, prefixes and counts — never memory values — so
    queue and job tables keep nothing a forget request would have to erase.
    """

    class Kind(models.TextChoices):
        SUMMARIZE = "summarize"
        PURGE = "purge"

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        # Not run: the API key that asked for it was revoked or expired before it wrote.
        CANCELLED = "cancelled"

    # A job in one of these states is over: it never runs again (and may be purged).
    FINISHED = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)
    # Waiting for a worker or on one: what the per-tenant cap counts (job_tenant_pending).
    PENDING = (Status.QUEUED, Status.RUNNING)

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="jobs", db_index=False)
    # What the API shows as the job's id (job_id, /api/v1/jobs/{uid}): the row id comes from a
    # sequence every tenant shares. Null only on PostgreSQL rows the backfill of migration
    # 0040 has not reached (its column default fills any written meanwhile).
    uid = models.UUIDField(default=uuid.uuid4, editable=False, null=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    params = models.JSONField(default=dict, blank=True)
    result = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    attempts = models.PositiveSmallIntegerField(default=0)
    requested_by = models.CharField(max_length=150, blank=True, default="")
    # The API key that asked (None: staff, a schedule): the job writes on its behalf only while
    # it is live. No database constraint: a key row gone is a key that no longer speaks.
    api_key = models.ForeignKey(
        ApiKey,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="+",
    )
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # No attempt before this (a summarize job's LLM endpoint answered 429/503 with Retry-After).
    retry_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "created_at"], name="job_tenant_created"),
            # The per-tenant cap's COUNT (services.jobs.require_pending_room) and the schedules'
            # look for pending jobs: a few rows per tenant, whatever the finished ones number.
            models.Index(
                fields=["tenant", "kind"],
                condition=models.Q(status__in=["queued", "running"]),
                name="job_tenant_pending",
            ),
            # Whose turn it is (services.jobs.turn_claim_next): a tenant's latest attempt start.
            models.Index(fields=["tenant", "kind", "started_at"], name="job_tenant_started"),
        ]
        constraints = [
            # A unique index built CONCURRENTLY (migration 0040); null only before the backfill.
            models.UniqueConstraint(fields=["uid"], name="job_uid", condition=Q(uid__isnull=False)),
        ]

    def __str__(self) -> str:
        return f"{self.kind} #{self.pk} ({self.status})"


class ForgetRequest(models.Model):
    """An end user's or tenant's request to erase memories, durable from the moment it
    is accepted. Status only moves forward: received → running → completed | failed.

    The receipt holds counts and times, never erased content.
    """

    class Status(models.TextChoices):
        RECEIVED = "received"
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="forget_requests", db_index=False)
    # What the API and the portal show as the request's id (as Job.uid; migration 0040).
    uid = models.UUIDField(default=uuid.uuid4, editable=False, null=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RECEIVED)
    # Exactly one target: a subject, a key prefix, or a list of keys.
    subject = models.CharField(max_length=255, blank=True, default="")
    prefix = models.CharField(max_length=512, blank=True, default="")
    keys = models.JSONField(default=list, blank=True)
    reason = models.TextField(blank=True, default="")
    requested_by_kind = models.CharField(max_length=16)
    requested_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    due_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    # Attempts in a row that erased nothing (reset by each batch): what ZEROMEM_JOB_MAX_ATTEMPTS
    # bounds, so a target too large for one attempt is never given up while it shrinks.
    stalled_attempts = models.PositiveSmallIntegerField(default=0, db_default=0)
    # When the request last moved (accepted, attempt started, batch erased, re-enqueued): a
    # pending request that has not moved for Q_CLUSTER["retry"] seconds lost its worker or
    # its queue entry, and forget_requests_resume() enqueues it again.
    progress_at = models.DateTimeField(default=timezone.now)
    # Its turns at the workers every tenant shares (services.jobs.turn_claim_next): when it last
    # held one (a step began, or handed the worker back), and whether a step holds one now. A
    # step still "stepping" Q_TIMEOUT after it began is over (failed, or its worker died).
    turn_at = models.DateTimeField(null=True, blank=True)
    stepping = models.BooleanField(default=False, db_default=False)
    # Running totals, updated in the same transaction as each erased batch, so a retry
    # after a crash continues the count instead of starting it again.
    receipt = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    # What the requester may touch, fixed when the request is accepted: {} the whole tenant,
    # {"prefixes": [...]} an API key's allowlist, {"subject": s} an end user's own memories.
    # Summaries derived from the target but outside it are rebuilt without the forgotten
    # sources, never erased whole.
    reach = models.JSONField(default=dict, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "status", "due_at"], name="forget_tenant_status_due"),
            # forget_requests_resume() scans the pending requests of every tenant.
            models.Index(
                fields=["progress_at"], name="forget_pending", condition=Q(status__in=["received", "running"])
            ),
            # The admin's queue, a page at a time in its order, and its search by subject: the
            # requests are kept with their receipts (built CONCURRENTLY on PostgreSQL, migration 0028).
            models.Index(
                models.F("tenant"),
                models.ExpressionWrapper(Q(status="completed"), output_field=models.BooleanField()),
                models.F("due_at"),
                models.F("id"),
                name="forget_tenant_queue",
            ),
            models.Index(fields=["tenant", "subject"], name="forget_tenant_subject", condition=~Q(subject="")),
            # An end user's own requests, for their portal page (with forget_tenant_subject: a
            # BitmapOr, not a scan of every request of every tenant; migration 0038).
            models.Index(
                fields=["tenant", "requested_by"],
                name="forget_tenant_end_user",
                condition=Q(requested_by_kind="end_user"),
            ),
            # Whose turn it is (services.jobs.turn_claim_next): a tenant's latest turn at a worker.
            models.Index(fields=["tenant", "turn_at"], name="forget_tenant_turn"),
            # The fleet's "forget requests overdue" gauge (every scrape of /metrics): the open and
            # failed requests by due date, across tenants — not every request ever kept with its
            # receipt (built CONCURRENTLY on PostgreSQL, migration 0034).
            models.Index(fields=["due_at"], name="forget_open_due", condition=~Q(status="completed")),
            # The search-stats schedule's "a forget completed since the tenant's term count"
            # (memories/search/index.py stale_tenant_ids), every 10 minutes over every tenant:
            # a few entries past the count, not the tenant's whole history (migration 0036).
            models.Index(
                fields=["tenant", "completed_at"],
                name="forget_tenant_completed",
                condition=Q(completed_at__isnull=False),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=(
                    (~Q(subject="") & Q(prefix="") & Q(keys=[]))
                    | (Q(subject="") & ~Q(prefix="") & Q(keys=[]))
                    | (Q(subject="") & Q(prefix="") & ~Q(keys=[]))
                ),
                name="forget_exactly_one_target",
            ),
            models.UniqueConstraint(fields=["uid"], name="forget_uid", condition=Q(uid__isnull=False)),
        ]

    def __str__(self) -> str:
        # The uid, as the API shows it: the row id comes from a sequence every tenant shares.
        return f"forget {self.uid or '(no id)'} ({self.status})"

    @classmethod
    def done(cls) -> models.ExpressionWrapper:
        """``status = 'completed'``: the queue's order is (this, due_at, id) — the open requests
        by due date, so the overdue ones first, then the done ones — which the index
        ``forget_tenant_queue`` holds in that order, however many requests a tenant kept."""
        return models.ExpressionWrapper(Q(status=cls.Status.COMPLETED), output_field=models.BooleanField())

    @property
    def is_overdue(self) -> bool:
        return self.status not in (self.Status.COMPLETED,) and self.due_at <= timezone.now()


class SearchTerm(models.Model):
    """How many of a tenant's memories hold a term (its document frequency), for the
    ranking's idf and for picking a query's rarest terms. Refreshed from the index by
    ``search_stats_refresh`` (a scheduled job and a command), not on every write: a count a
    little stale only shifts weights slightly, and a term missing here counts as rare.
    PostgreSQL only; SQLite reads the counts from its FTS5 index."""

    pk = models.CompositePrimaryKey("tenant", "term")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, db_index=False, related_name="+")
    term = models.CharField(max_length=255)
    ndoc = models.PositiveIntegerField()

    def __str__(self) -> str:
        return f"{self.term} ({self.ndoc})"


class SearchCorpus(models.Model):
    """A tenant's count of indexed live memories (BM25's N) as of the last refresh of its
    ``SearchTerm`` rows."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, primary_key=True, related_name="+")
    documents = models.PositiveIntegerField(default=0)
    refreshed_at = models.DateTimeField(default=timezone.now)
    # The tenant's SearchErasure.batches when this count began: more since, and memories it
    # counted may have been erased (memories/search/index.py stale_tenant_ids).
    erasures_counted = models.PositiveBigIntegerField(default=0)

    class Meta:
        verbose_name_plural = "search corpora"

    def __str__(self) -> str:
        return f"{self.tenant_id}: {self.documents}"


class SearchErasure(models.Model):
    """How many TTL purge batches have erased memories of a tenant, so that the term
    statistics are counted again after one (the erased words must leave ``SearchTerm``).

    A counter, not a timestamp: a batch marks it inside its own transaction, before it
    commits, so a time it wrote could be older than a count that began before the commit and
    did not see the erasure; a count instead notes the counter it read before counting
    (``SearchCorpus.erasures_counted``), and any batch it did not see has moved it past
    that. A table of its own, not a ``SearchCorpus`` column: a tenant not yet counted has no
    corpus row to mark, and the count and the purge never wait for each other's row locks.
    PostgreSQL only (SQLite's FTS5 index counts exactly)."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, primary_key=True, related_name="+")
    batches = models.PositiveBigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.tenant_id}: {self.batches} purge batches"


class MemoryEmbedding(models.Model):
    """A memory's sentence embedding, for semantic search (memories/search/embeddings.py).

    Derived from the memory's key and value, so it lives and dies with the memory: trashing
    the memory deletes it, and erasing the memory (purge, forget, tenant deletion) takes it
    along, each by its own statement (no foreign key in the database: see ``memory``), so
    an embedding written by a job racing a forget cannot outlive its memory. Written only by
    the embedding job, off the write path.

    ``vector`` is ``dim`` little-endian float16 numbers, L2-normalised (a 512-dim vector is
    1 KB, stored inline in the row, not TOASTed). ``text_hash`` lets the job skip re-encoding
    a memory whose new version changed nothing it embeds (tags, TTL, importance).
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, db_index=False)
    # No foreign key in the database (memories migration 0018), as for versions: its cascade
    # trigger cost the TTL purge a lookup per erased memory (15.3 → 9.7 µs of CPU per memory,
    # bench_purge_fk), which the purge's own statement already does. No path leaves an
    # embedding without its memory: the job writes one only for a live memory it holds locked
    # (select_for_update), the purge erases only expired or old trashed memories (never
    # live, so never being embedded) and skips locked rows, a forget locks its memories
    # before erasing them with their embeddings, and ORM deletes cascade (on_delete).
    memory = models.OneToOneField(Memory, on_delete=models.CASCADE, related_name="embedding", db_constraint=False)
    model = models.CharField(max_length=64)
    dim = models.PositiveSmallIntegerField()
    vector = models.BinaryField()
    text_hash = models.CharField(max_length=16)
    # The memory's version and updated_at when embedded: a memory whose version moved on is
    # embedded again; the job resumes from the newest memory_updated_at it has seen.
    memory_version = models.PositiveIntegerField()
    memory_updated_at = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            # A tenant's newest embeddings first (the search cache loads the newest N, then
            # only rows with a higher id than it holds).
            models.Index(fields=["tenant", "id"], name="memoryembedding_tenant_id"),
            # The job's watermark: max(memory_updated_at).
            models.Index(fields=["memory_updated_at"], name="memoryembedding_updated"),
        ]

    def __str__(self) -> str:
        return f"{self.memory_id} ({self.model}, {self.dim}d)"


class TokenUsageDay(models.Model):
    """What a tenant's tool results cost the models that read them, per UTC day: how many
    results, their bytes and their estimated tokens (zeromem/kernel/tokens.py). Added to in
    batches by memories/services/usage.py — one UPSERT per tenant and day per flush, not a
    write per request — and read by the admin dashboard next to its estimate of tokens saved."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+", db_index=False)
    day = models.DateField()
    results = models.BigIntegerField(default=0)
    bytes = models.BigIntegerField(default=0)
    tokens = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "day"], name="token_usage_tenant_day")]

    def __str__(self) -> str:
        return f"{self.day}: {self.tokens} tokens in {self.results} results"


class TenantDashboardStats(models.Model):
    """The memory figures of a tenant's admin dashboard (live memories, by category, the
    largest namespaces, their JSON size) as of ``computed_at``: aggregates over every live
    memory, recomputed by the ``dashboard-stats`` schedule for tenants with activity since,
    so a page view does not scan the tenant's memories (memories/services/dashboard_stats.py)."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, primary_key=True, related_name="+")
    computed_at = models.DateTimeField(default=timezone.now)
    figures = models.JSONField(default=dict)

    class Meta:
        verbose_name_plural = "tenant dashboard stats"

    def __str__(self) -> str:
        return f"{self.tenant_id} @ {self.computed_at:%Y-%m-%d %H:%M}"


class IdempotencyRecord(models.Model):
    """The first answer to a write sent with an ``Idempotency-Key`` header, so that a retry
    of the same request (same tenant, API key and idempotency key, within
    ``ZEROMEM_IDEMPOTENCY_SECONDS``) gets it again instead of doing the work twice.

    Claimed (``status`` null) before the work starts; the answer is stored when it is done.
    ``fingerprint`` is the HMAC-SHA256 of the request (method, path and query, If-Match, the
    parsed body), keyed from SECRET_KEY: the same key with another request is refused. The stored body can hold
    memory values, so the purge schedule deletes records after their window and a forget
    request deletes its tenant's finished records; its claims still running stay claimed,
    with ``keep_answer`` off (their answer is dropped when they end) — except the records
    marked ``holds_no_values``."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, db_index=False)
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, db_index=False)
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64)
    status = models.PositiveSmallIntegerField(null=True, blank=True)  # null: the first request still runs
    body = models.BinaryField(default=b"")
    headers = models.JSONField(default=dict)
    created_at = models.DateTimeField(default=timezone.now)
    completed_at = models.DateTimeField(null=True, blank=True)
    # Off for a claim that was running when a forget request of its tenant completed: its
    # work may have read what the forget erased, so its answer is not stored.
    keep_answer = models.BooleanField(default=True, db_default=True)
    # On for the claim of a request whose answer holds no memory value (the POST that files a
    # forget request: its answer is the request, ids and the target): a forget request neither
    # marks it nor drops its stored answer, so a retry gets the first answer, not a second request.
    holds_no_values = models.BooleanField(default=False, db_default=False)
    # When the running request's process last said it still runs (memories/services/idempotency.py
    # heartbeat); null until its first renewal. A claim is given up once neither this nor
    # ``created_at`` is within ``ZEROMEM_IDEMPOTENCY_LEASE_SECONDS``.
    renewed_at = models.DateTimeField(null=True, blank=True)
    # A batch answer some of whose calls met a transient failure (429, 5xx): their indexes. Not
    # replayed but resumed: a retry runs those calls alone and keeps the others' results.
    pending = models.JSONField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "api_key", "key"], name="idempotency_unique_key"),
        ]
        indexes = [models.Index(fields=["created_at"], name="idempotency_created")]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.api_key_id}: {self.key}"
