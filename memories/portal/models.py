"""Portal links: the opaque, expiring, one-time links a tenant's application hands its end
users (``POST /api/v1/subjects/{subject}/portal-link``).

The link carries a random token and nothing else; this row holds what it stands for (tenant,
subject, expiry) under the token's SHA-256, never the token. The first open sets
``opened_at`` with a conditional UPDATE, so every later open of the same link is refused;
``revoked_at`` withdraws the link and the portal session it opened.
"""

from django.db import models
from django.utils import timezone

from zeromem.kernel import opaque


class PortalLink(models.Model):
    tenant = models.ForeignKey("memories.Tenant", on_delete=models.CASCADE, related_name="+", db_index=False)
    subject = models.CharField(max_length=255)
    token_hash = models.CharField(max_length=64, unique=True)  # SHA-256 hex of the link's token
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    # Set once, by the first open (the link is exchanged for a portal session cookie).
    opened_at = models.DateTimeField(null=True, blank=True)
    # Set when the end user signs out: the portal session cookie of this link stops working.
    closed_at = models.DateTimeField(null=True, blank=True)
    # Set when the tenant withdraws the link (or revokes the key that issued it): it no longer
    # opens, and the portal session it opened ends.
    revoked_at = models.DateTimeField(null=True, blank=True)
    created_by_kind = models.CharField(max_length=16)
    created_by = models.CharField(max_length=150, blank=True, default="")

    class Meta:
        indexes = [models.Index(fields=["tenant", "subject"], name="portallink_tenant_subject")]

    def __str__(self) -> str:
        # As its audit events name it (services.link_ref): the row id comes from a sequence
        # every tenant's links share.
        return f"portal link {opaque.seal_id(self.pk, purpose='portal-link')}" if self.pk else "portal link"
