"""Portal links: the signed, expiring, one-time links a tenant's application hands its end
users (``POST /api/v1/subjects/{subject}/portal-link``).

The link itself carries its tenant, subject, nonce and expiry, signed with SECRET_KEY
(django.core.signing); this row is what makes it one-time: the first open sets
``opened_at`` with a conditional UPDATE, and every later open of the same link is refused.
"""

from django.db import models
from django.utils import timezone


class PortalLink(models.Model):
    tenant = models.ForeignKey("memories.Tenant", on_delete=models.CASCADE, related_name="+", db_index=False)
    subject = models.CharField(max_length=255)
    nonce = models.CharField(max_length=32, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    # Set once, by the first open (the link is exchanged for a portal session cookie).
    opened_at = models.DateTimeField(null=True, blank=True)
    # Set when the end user signs out: the portal session cookie of this link stops working.
    closed_at = models.DateTimeField(null=True, blank=True)
    created_by_kind = models.CharField(max_length=16)
    created_by = models.CharField(max_length=150, blank=True, default="")

    class Meta:
        indexes = [models.Index(fields=["tenant", "subject"], name="portallink_tenant_subject")]

    def __str__(self) -> str:
        return f"portal link #{self.pk}"
