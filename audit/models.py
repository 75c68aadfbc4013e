"""The audit log: one append-only row per operation, on every surface.

Rows hold who, what, when, from where, the outcome, counts and versions — never a memory
value and never a key secret. They are written by ``audit.services.audit_record`` in the
same transaction as the operation they describe.
"""

from django.db import models
from django.utils import timezone


class AuditEventQuerySet(models.QuerySet):
    def for_tenant(self, tenant):
        return self.filter(tenant=tenant)

    def update(self, **kwargs):
        raise TypeError("audit events are append-only")

    def delete(self):
        raise TypeError("audit events are append-only")


class AuditEvent(models.Model):
    class ActorKind(models.TextChoices):
        API_KEY = "api_key"
        STAFF = "staff"
        END_USER = "end_user"
        SYSTEM = "system"
        ANONYMOUS = "anonymous"

    class Outcome(models.TextChoices):
        OK = "ok"
        NOT_FOUND = "not_found"
        CONFLICT = "conflict"
        DENIED = "denied"
        INVALID = "invalid"
        UNAUTHENTICATED = "unauthenticated"
        PRECONDITION_FAILED = "precondition_failed"

    # Null only for failed authentication with a key that matches no tenant.
    tenant = models.ForeignKey("memories.Tenant", null=True, on_delete=models.PROTECT, related_name="+", db_index=False)
    occurred_at = models.DateTimeField(default=timezone.now)
    actor_kind = models.CharField(max_length=16, choices=ActorKind.choices)
    actor_id = models.CharField(max_length=64, blank=True, default="")
    # Human-readable actor: the key's public prefix (zm_xxxx), a username, "system".
    actor_label = models.CharField(max_length=150, blank=True, default="")
    surface = models.CharField(max_length=16, blank=True, default="")  # tool, rest, admin, portal, job
    action = models.CharField(max_length=40)  # memory.read, memory.write, auth.failed, ...
    target = models.CharField(max_length=512, blank=True, default="")  # key or prefix
    subject = models.CharField(max_length=255, blank=True, default="")
    outcome = models.CharField(max_length=24, choices=Outcome.choices)
    request_id = models.CharField(max_length=64, blank=True, default="")
    client_ip = models.GenericIPAddressField(null=True, blank=True)
    count = models.IntegerField(null=True, blank=True)
    version = models.IntegerField(null=True, blank=True)
    # Small structured extras (error code, missing scope, field). Never values.
    detail = models.JSONField(default=dict, blank=True)

    objects = AuditEventQuerySet.as_manager()

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "occurred_at"], name="audit_tenant_time"),
            models.Index(fields=["tenant", "target"], name="audit_tenant_target"),
            models.Index(fields=["tenant", "actor_kind", "actor_id"], name="audit_tenant_actor"),
        ]

    def __str__(self) -> str:
        return f"{self.occurred_at:%Y-%m-%d %H:%M:%S} {self.actor_label} {self.action} {self.target} {self.outcome}"

    def save(self, *args, **kwargs):
        if self.pk is not None and not self._state.adding:
            raise TypeError("audit events are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise TypeError("audit events are append-only")
