"""Writing audit events. Called by services inside the transaction of the operation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from audit.models import AuditEvent

if TYPE_CHECKING:
    from memories.models import Tenant
    from memories.permissions import Actor


def audit_record(
    *,
    tenant: Tenant | None,
    actor: Actor,
    action: str,
    outcome: str,
    target: str = "",
    subject: str = "",
    count: int | None = None,
    version: int | None = None,
    detail: dict | None = None,
) -> AuditEvent:
    """Append one event (one INSERT). Never pass a memory value or a key secret here."""
    return AuditEvent.objects.create(
        tenant=tenant,
        actor_kind=actor.kind,
        actor_id=actor.id,
        actor_label=actor.label,
        surface=actor.surface,
        action=action,
        target=target[:512],
        subject=subject[:255],
        outcome=outcome,
        request_id=actor.request_id,
        client_ip=actor.client_ip,
        count=count,
        version=version,
        detail=detail or {},
    )
