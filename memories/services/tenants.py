"""Tenants (created, their name and limits changed) and API keys (created, revoked), audited in
the same transaction."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import validate_slug
from django.db import transaction
from django.utils import timezone

from audit.models import AuditEvent
from audit.services import audit_record
from audit.services import audited_operation as _operation
from memories.models import ApiKey, Tenant
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import InvalidInput
from zeromem.kernel.scopes import ALL_SCOPES, DEFAULT_AGENT_SCOPES

Outcome = AuditEvent.Outcome


def tenant_create(*, actor: Actor, slug: Any, name: str | None = None) -> Tenant:
    try:
        validate_slug(slug)
    except DjangoValidationError:
        raise InvalidInput("must be letters, digits, hyphens or underscores", field="slug") from None
    with transaction.atomic():
        if Tenant.objects.filter(slug=slug).exists():
            raise InvalidInput(f"tenant '{slug}' already exists", field="slug", code="exists")
        tenant = Tenant.objects.create(slug=slug, name=name or slug)
        audit_record(tenant=tenant, actor=actor, action="tenant.create", target=slug, outcome=Outcome.OK)
    return tenant


def api_key_create(
    *,
    tenant: Tenant,
    actor: Actor,
    name: str,
    scopes: list[str] | None = None,
    allowed_prefixes: list[str] | None = None,
    expires_in_days: int | None = None,
    created_by=None,
) -> tuple[ApiKey, str]:
    """Create a key and return it with its secret, the only time the secret exists."""
    scopes = [str(s) for s in (scopes if scopes is not None else DEFAULT_AGENT_SCOPES)]
    unknown = sorted(set(scopes) - set(ALL_SCOPES))
    if unknown:
        raise InvalidInput(f"unknown scope {unknown[0]!r}; known: {', '.join(ALL_SCOPES)}", field="scopes")
    prefixes = [validation.prefix(p, field="allowed_prefixes") for p in (allowed_prefixes or [])]
    if expires_in_days is not None and expires_in_days < 1:
        raise InvalidInput("must be at least 1", field="expires_in_days")
    raw, lookup, key_hash = ApiKey.generate()
    with transaction.atomic():
        key = ApiKey.objects.create(
            tenant=tenant,
            name=name,
            lookup=lookup,
            key_hash=key_hash,
            scopes=scopes,
            allowed_prefixes=prefixes,
            expires_at=timezone.now() + timedelta(days=expires_in_days) if expires_in_days else None,
            created_by=created_by,
        )
        audit_record(
            tenant=tenant,
            actor=actor,
            action="api_key.create",
            target=key.display_prefix,
            outcome=Outcome.OK,
            detail={"scopes": scopes, "allowed_prefixes": prefixes},
        )
    return key, raw


def api_key_revoke(*, tenant: Tenant, actor: Actor, key_id: int) -> bool:
    with transaction.atomic():
        updated = ApiKey.objects.filter(tenant=tenant, pk=key_id, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        key = ApiKey.objects.filter(tenant=tenant, pk=key_id).first()
        audit_record(
            tenant=tenant,
            actor=actor,
            action="api_key.revoke",
            target=key.display_prefix if key else "",
            outcome=Outcome.OK if updated else Outcome.NOT_FOUND,
        )
    return bool(updated)


def tenant_settings_update(*, tenant: Tenant, actor: Actor, name: Any, value_max_bytes: Any, trash_retention_days: Any):
    """Change a tenant's name and limits (the admin's Tenant page; superusers only, which the
    admin checks). Audited as ``tenant.update`` with the fields that changed."""
    with _operation(tenant=tenant, actor=actor, action="tenant.update", target=tenant.slug):
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise InvalidInput("must be 1-200 characters", field="name")
        for field, raw in (("value_max_bytes", value_max_bytes), ("trash_retention_days", trash_retention_days)):
            if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int) or raw < 1):
                raise InvalidInput("must be a positive whole number or empty", field=field)
        changes = {
            field: new
            for field, new in (
                ("name", name),
                ("value_max_bytes", value_max_bytes),
                ("trash_retention_days", trash_retention_days),
            )
            if getattr(tenant, field) != new
        }
        if changes:
            Tenant.objects.filter(pk=tenant.pk).update(**changes)
            for field, new in changes.items():
                setattr(tenant, field, new)
        audit_record(
            tenant=tenant,
            actor=actor,
            action="tenant.update",
            target=tenant.slug,
            outcome=Outcome.OK,
            detail={"changed": sorted(changes)},
        )
        return tenant
