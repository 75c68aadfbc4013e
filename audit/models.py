"""The audit log: one append-only row per operation, on every surface.

Rows hold who, what, when, from where, the outcome, counts and versions — never a memory
value and never a key secret. They are written by ``audit.services.audit_record`` in the
same transaction as the operation they describe.

Tamper evidence (see ``audit/chain.py``) comes in two steps, so that no API request waits
on a lock shared with other requests:

1. On insert each event gets a keyed ``digest`` over its fields — the identifying fields
   enter through a per-field commitment, so they can later be redacted without changing
   the digest. Inserting is a plain INSERT, concurrent with every other one.
2. A sealing job (every minute, and before a verification or purge) takes a tenant's
   unsealed events in id order up to a settled horizon, links each to the previous one
   (chain value = HMAC of the previous one and this event's id and digest) and closes the
   batch with an :class:`AuditSeal` naming its id range, linked to the tenant's previous
   seal. Nothing is written to the events. Only sealers of the same tenant wait for each other.

On PostgreSQL a trigger (migration 0003) refuses UPDATE and DELETE of events and seals
except the three maintenance paths, each of which leaves a record: sealing (seals made
before migration 0011 set ``seal``/``chain`` once), redaction (replaces identifying fields, keeps their commitments)
and the retention purge (deletes whole sealed batches after writing a checkpoint).
"""

import uuid

from django.db import models
from django.db.models import Q
from django.utils import timezone

from zeromem.kernel.outcomes import ActorKind, Outcome

# What a reviewer sees of an event (REST list, exports, admin), in this order.
REVIEW_FIELDS = (
    "id",
    "occurred_at",
    "actor_kind",
    "actor_id",
    "actor_label",
    "surface",
    "action",
    "target",
    "subject",
    "actor_filter",
    "outcome",
    "request_id",
    "client_ip",
    "count",
    "version",
    "detail",
)


class AppendOnlyQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise TypeError("audit records are append-only")

    def delete(self):
        raise TypeError("audit records are append-only")


class AuditEventQuerySet(AppendOnlyQuerySet):
    def for_tenant(self, tenant):
        return self.filter(tenant=tenant)


class AuditEvent(models.Model):
    ActorKind = ActorKind
    Outcome = Outcome

    # Null only for failed authentication with a key that matches no tenant. No foreign key in
    # the database (migration 0017): its check took a FOR KEY SHARE lock on the tenant's row
    # with every event — 0.05–0.09 ms of each audited call, and every concurrent call of one
    # tenant locking the same row. An event's tenant is the one its operation resolved (never
    # input), and the ORM still refuses to delete a tenant with events (PROTECT).
    tenant = models.ForeignKey(
        "memories.Tenant", null=True, on_delete=models.PROTECT, related_name="+", db_index=False, db_constraint=False
    )
    # Random, so that a copied row (same fields, new id) cannot reuse a valid digest.
    uid = models.UUIDField(default=uuid.uuid4, editable=False)
    occurred_at = models.DateTimeField(default=timezone.now)
    actor_kind = models.CharField(max_length=16, choices=ActorKind.choices)
    actor_id = models.CharField(max_length=64, blank=True, default="")
    # Human-readable actor: the key's public prefix (zm_xxxx), a username, "system".
    actor_label = models.CharField(max_length=150, blank=True, default="")
    surface = models.CharField(max_length=16, blank=True, default="")  # tool, rest, admin, portal, job
    action = models.CharField(max_length=40)  # memory.read, memory.write, auth.failed, ...
    target = models.CharField(max_length=512, blank=True, default="")  # key or prefix
    subject = models.CharField(max_length=255, blank=True, default="")
    # A reading of the log (audit.list, audit.export): the actor it filtered by (an end
    # user's id, say) — here, not in detail, so a forget of that subject redacts it.
    actor_filter = models.CharField(max_length=512, blank=True, default="", db_default="")
    outcome = models.CharField(max_length=24, choices=Outcome.choices)
    request_id = models.CharField(max_length=64, blank=True, default="")
    client_ip = models.GenericIPAddressField(null=True, blank=True)
    count = models.IntegerField(null=True, blank=True)
    version = models.IntegerField(null=True, blank=True)
    # Small structured extras (error code, missing scope, field). Never values.
    detail = models.JSONField(default=dict, blank=True)

    # Tamper evidence (audit/chain.py). digest: keyed hash over the fields, set on insert.
    digest = models.CharField(max_length=64, editable=False)
    # Set by the sealing job before audit migration 0011 (the seal number and the chain value,
    # one UPDATE per event). Since then seals are range seals (AuditSeal.by_range): nothing is
    # written to the event, so both stay null/empty and audit_verify recomputes the chain.
    seal = models.PositiveIntegerField(null=True, blank=True, editable=False)
    chain = models.CharField(max_length=64, blank=True, default="", editable=False)
    # Redacted fields' commitments ({field: hex}); the field itself then holds a pseudonym.
    redacted = models.JSONField(default=dict, blank=True, editable=False)

    objects = AuditEventQuerySet.as_manager()

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "occurred_at"], name="audit_tenant_time"),
            models.Index(fields=["tenant", "target"], name="audit_tenant_target"),
            models.Index(fields=["tenant", "actor_kind", "actor_id"], name="audit_tenant_actor"),
            models.Index(fields=["tenant", "subject"], name="audit_tenant_subject", condition=~Q(subject="")),
            # The redaction of a forgotten subject finds the readings that filtered by them.
            models.Index(
                fields=["tenant", "actor_filter"], name="audit_tenant_actor_filter", condition=~Q(actor_filter="")
            ),
            # Every event since range seals (seal stays null): the sealing job finds the unsealed
            # tail (id > the tenant's last range seal) and a range seal's events by id range here.
            models.Index(fields=["tenant", "id"], name="audit_unsealed", condition=Q(seal__isnull=True)),
        ]

    def __str__(self) -> str:
        return f"{self.occurred_at:%Y-%m-%d %H:%M:%S} {self.actor_label} {self.action} {self.target} {self.outcome}"

    def save(self, *args, **kwargs):
        if self.pk is not None and not self._state.adding:
            raise TypeError("audit events are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise TypeError("audit events are append-only")


class AuditSeal(models.Model):
    """A sealed batch of one tenant's events: links to the tenant's previous seal, so the
    seals form one chain per tenant (tenant null: the chain of failed authentications that
    matched no tenant). Kept forever — counts and hashes only — even after the retention
    purge has removed the batch's events."""

    tenant = models.ForeignKey("memories.Tenant", null=True, on_delete=models.PROTECT, related_name="+", db_index=False)
    seq = models.PositiveIntegerField()  # 1, 2, 3, ... per tenant
    first_event_id = models.BigIntegerField()
    last_event_id = models.BigIntegerField()
    count = models.PositiveIntegerField()
    # Events in this seal and all earlier ones: a checkpoint's count.
    total = models.BigIntegerField()
    prev_hash = models.CharField(max_length=64)
    # HMAC over the previous seal's hash, this seal's numbers and its last event's chain value.
    hash = models.CharField(max_length=64)
    sealed_at = models.DateTimeField(default=timezone.now)
    # Set by the retention purge when this batch's events were deleted on purpose.
    purged_at = models.DateTimeField(null=True, blank=True)
    # A range seal (every seal since audit migration 0011): its events are the tenant's events
    # with ids first_event_id..last_event_id whose ``seal`` column is null — none written to.
    # Otherwise (older seals) its events are those whose ``seal`` column holds ``seq``.
    by_range = models.BooleanField(default=False, editable=False)

    objects = AppendOnlyQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "seq"], name="auditseal_one_per_seq"),
            # The NULL-tenant chain needs its own uniqueness (NULLs are distinct in a unique index).
            models.UniqueConstraint(fields=["seq"], condition=Q(tenant__isnull=True), name="auditseal_untenanted_seq"),
        ]
        # The range seal holding an event id: the first one ending at or after it.
        indexes = [
            models.Index(fields=["tenant", "last_event_id"], name="auditseal_range_last", condition=Q(by_range=True))
        ]

    def __str__(self) -> str:
        return f"seal {self.seq} ({self.count} events)"

    def save(self, *args, **kwargs):
        if self.pk is not None and not self._state.adding:
            raise TypeError("audit seals are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise TypeError("audit seals are append-only")


class AuditCheckpoint(models.Model):
    """The head of a tenant's chain at a moment: its seal, hash and event count. Written
    by ``audit_checkpoint`` (to be exported and kept outside the database) and by the
    retention purge before it deletes anything. Comparing a kept checkpoint with the chain
    detects a cut-off tail."""

    class Reason(models.TextChoices):
        EXPORT = "export"
        PURGE = "purge"

    tenant = models.ForeignKey("memories.Tenant", null=True, on_delete=models.PROTECT, related_name="+", db_index=False)
    seal_seq = models.PositiveIntegerField()
    head_hash = models.CharField(max_length=64)
    total = models.BigIntegerField()
    created_at = models.DateTimeField(default=timezone.now)
    reason = models.CharField(max_length=16, choices=Reason.choices)
    # For a purge: events with seal <= purged_through were deleted on purpose.
    purged_through = models.PositiveIntegerField(null=True, blank=True)
    # Keyed hash over the fields above, so a forged checkpoint (say, one that claims a
    # purge to excuse deleted events) does not verify.
    mac = models.CharField(max_length=64)

    objects = AppendOnlyQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["tenant", "created_at"], name="auditcheckpoint_tenant")]

    def __str__(self) -> str:
        return f"checkpoint seal {self.seal_seq} ({self.reason})"

    def as_dict(self) -> dict:
        return {
            "tenant": self.tenant.slug if self.tenant_id else None,
            "seal": self.seal_seq,
            "head_hash": self.head_hash,
            "events": self.total,
            "at": self.created_at.isoformat(),
        }


class RateCounter(models.Model):
    """One fixed window of one rate-limit bucket (``key:<id>``, ``authfail:ip:<addr>``),
    counted with an atomic UPSERT when no Redis is configured (audit/limits.py). It lives
    beside the audit log because both apps count here and audit sits below memories."""

    bucket = models.CharField(max_length=200)
    window_start = models.BigIntegerField()  # Unix seconds at the window's start
    count = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["bucket", "window_start"], name="ratecounter_one_per_window")]
        # Old windows are deleted by age.
        indexes = [models.Index(fields=["window_start"], name="ratecounter_window")]

    def __str__(self) -> str:
        return f"{self.bucket} @{self.window_start}: {self.count}"


class ConcurrencySlot(models.Model):
    """One piece of expensive work in progress (a search, an export) of one holder, e.g.
    ``tenant:7``, when no Redis is configured (audit/limits.py). A holder's slots are
    numbered 0 … limit − 1, one row each at most (the unique constraint is what makes the
    limit exact); ``started_at`` is when the slot was taken or last renewed by its process's
    heartbeat; a row not renewed for its lease is stale (its process died mid-request), no
    longer counts, and is taken over by the next taker of its number."""

    holder = models.CharField(max_length=100)
    slot = models.PositiveSmallIntegerField()
    token = models.CharField(max_length=32, unique=True)
    started_at = models.FloatField()  # Unix seconds: taken, or last renewed

    class Meta:
        constraints = [models.UniqueConstraint(fields=["holder", "slot"], name="slot_holder_number")]

    def __str__(self) -> str:
        return f"{self.holder} {self.token}"


class AuditDailyCount(models.Model):
    """One figure of one tenant's day (UTC): how many of its events counted towards
    ``metric`` (``audit/daily.py``: reads, writes, misses, ...). Derived data, folded in from
    sealed events by the sealing job; the admin dashboard reads these rows instead of
    aggregating the log. Not part of the tamper evidence (it can be rebuilt from the log)."""

    tenant = models.ForeignKey("memories.Tenant", on_delete=models.CASCADE, related_name="+", db_index=False)
    day = models.DateField()
    metric = models.CharField(max_length=40)
    value = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "day", "metric"], name="auditdailycount_one_per_day"),
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.metric}: {self.value}"


class AuditDailyFold(models.Model):
    """How far a tenant's sealed events are folded into :class:`AuditDailyCount`: every seal
    up to ``through_seq`` is counted, none after it."""

    tenant = models.OneToOneField("memories.Tenant", on_delete=models.CASCADE, related_name="+")
    through_seq = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"folded through seal {self.through_seq}"
