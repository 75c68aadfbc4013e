"""Writing audit events. Called by services inside the transaction of the operation."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from audit.models import AuditEvent

if TYPE_CHECKING:
    from memories.models import Tenant
    from memories.permissions import Actor


def _storable(value):
    """Refused input is recorded as sent (a key, an argument name), but PostgreSQL text and
    jsonb cannot hold NUL: it is replaced, so recording the refusal cannot fail."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_storable(k): _storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_storable(v) for v in value]
    return value


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
        actor_label=_storable(actor.label),
        surface=actor.surface,
        action=action,
        target=_storable(target[:512]),
        subject=_storable(subject[:255]),
        outcome=outcome,
        request_id=actor.request_id,
        client_ip=actor.client_ip,
        count=count,
        version=version,
        detail=_storable(detail or {}),
    )


def audit_redact_subject(*, tenant: Tenant, subject: str = "", keys: Iterable[str] = (), prefix: str = "") -> int:
    """Hook for forget requests: blank the identifying fields (``target``, ``subject``) of
    old audit events about a forgotten subject, key prefix or list of keys. Returns how many
    events it redacted.

    A documented no-op returning 0 for now: redaction must keep the hash chain verifiable,
    and both arrive with the audit issue (hash-chained, redactable events), which replaces
    this body. Audit rows hold identifiers only — keys, prefixes, subjects — never memory
    values, so until then a forget request leaves no erased content in the audit log.
    ``memories.services.forget.forget_request_execute`` calls it once per request, after the
    last batch, and calls it again on a retry: an implementation must be idempotent.
    """
    return 0
