"""What the admin console does beyond the agents' operations: open a memory (an audited
read of its value), open its history, restore an old version, and manage memberships.

Each one checks the staff actor's scopes (see ``zeromem.kernel.actors.ROLE_SCOPES``) and
writes its audit event in the same transaction, like every other service.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import F
from django.utils import timezone

from audit.models import AuditEvent
from audit.services import audit_record
from memories import search
from memories.models import Membership, Memory, MemoryVersion, Tenant
from memories.services.memories import MemoryResult, _operation, _record_version
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor, require_key_allowed, require_scope
from zeromem.kernel.errors import Forbidden, InvalidInput
from zeromem.kernel.scopes import ROLE_SCOPES, Scope

Outcome = AuditEvent.Outcome


def memory_view(*, tenant: Tenant, actor: Actor, memory_id: Any) -> Memory | None:
    """Open one memory of ``tenant`` by id — live, expired or trashed — with its value.

    Opening a value is a read: it needs ``memory:read`` and is audited as ``memory.view``.
    Another tenant's id answers None, exactly like a missing one. Cost: one primary-key
    SELECT and the audit INSERT (no access-counter update: staff reading is not agent use).
    """
    with _operation(tenant=tenant, actor=actor, action="memory.view"):
        memory = _readable_memory(tenant=tenant, actor=actor, memory_id=memory_id, action="memory.view")
        if memory is None:
            return None
        audit_record(
            tenant=tenant,
            actor=actor,
            action="memory.view",
            target=memory.key,
            subject=memory.subject,
            outcome=Outcome.OK,
            version=memory.version,
        )
        return memory


def _readable_memory(*, tenant: Tenant, actor: Actor, memory_id: Any, action: str) -> Memory | None:
    """The tenant's memory (any state) the actor may read, or None after auditing the miss."""
    require_scope(actor, Scope.MEMORY_READ)
    memory = Memory.objects.for_tenant(tenant).filter(pk=_pk(memory_id)).first()
    if memory is None:
        audit_record(tenant=tenant, actor=actor, action=action, outcome=Outcome.NOT_FOUND)
        return None
    require_key_allowed(actor, memory.key)
    return memory


def memory_versions_view(*, tenant: Tenant, actor: Actor, memory_id: Any, limit: int = 200) -> list | None:
    """The versions of one memory (any state), newest first, values included: audited as
    ``memory.history``. None when the memory is not the tenant's."""
    with _operation(tenant=tenant, actor=actor, action="memory.history"):
        memory = _readable_memory(tenant=tenant, actor=actor, memory_id=memory_id, action="memory.history")
        if memory is None:
            return None
        versions = list(
            MemoryVersion.objects.filter(tenant=tenant, memory=memory).order_by("-version")[: max(1, limit)]
        )
        audit_record(
            tenant=tenant,
            actor=actor,
            action="memory.history",
            target=memory.key,
            subject=memory.subject,
            outcome=Outcome.OK,
            count=len(versions),
            version=memory.version,
        )
        return versions


def memory_restore_version(*, tenant: Tenant, actor: Actor, memory_id: Any, version: Any) -> MemoryResult:
    """Make an old version's value current again: a *new* version (op ``restore``) holding
    that value, so the history keeps the bad write too. Only live memories (restore a
    trashed one from the trash first). Audited as ``memory.restore_version`` with the
    version restored from in ``detail.from_version``.

    Cost: the version SELECT, one conditional UPDATE, the version INSERT, the audit INSERT.
    """
    with _operation(tenant=tenant, actor=actor, action="memory.restore_version"):
        require_scope(actor, Scope.MEMORY_WRITE)
        version = validation.version(version, field="version")
        if version is None:
            raise InvalidInput("must be a version number", field="version")
        memory = Memory.objects.for_tenant(tenant).live().filter(pk=_pk(memory_id)).select_for_update().first()
        old = (
            MemoryVersion.objects.filter(tenant=tenant, memory=memory, version=version).first()
            if memory is not None
            else None
        )
        if memory is None or old is None:
            audit_record(
                tenant=tenant,
                actor=actor,
                action="memory.restore_version",
                target=memory.key if memory else "",
                outcome=Outcome.NOT_FOUND,
                detail={"from_version": version},
            )
            return MemoryResult(status="not_found", key=memory.key if memory else "")
        require_key_allowed(actor, memory.key)
        validation.value(old.value, max_bytes=tenant.effective_value_max_bytes)
        now = timezone.now()
        Memory.objects.filter(pk=memory.pk).update(
            value=old.value,
            **search.index_fields(tenant_id=tenant.pk, key=memory.key, value=old.value, tags=memory.tags),
            version=F("version") + 1,
            updated_at=now,
        )
        memory.refresh_from_db()
        _record_version(memory, MemoryVersion.Op.RESTORE, actor, now)
        audit_record(
            tenant=tenant,
            actor=actor,
            action="memory.restore_version",
            target=memory.key,
            subject=memory.subject,
            outcome=Outcome.OK,
            version=memory.version,
            detail={"from_version": version},
        )
        return MemoryResult(status="ok", key=memory.key, memory=memory)


def membership_set(*, tenant: Tenant, actor: Actor, username: Any, role: Any) -> Membership:
    """Give an existing user ``role`` in ``tenant`` (creating or changing the membership).
    A member may log in to the admin, so the user is marked staff. Needs the admin role
    (the only role whose actor holds every scope). Audited as ``membership.set``."""
    with _operation(tenant=tenant, actor=actor, action="membership.set"):
        _require_admin(actor)
        if role not in Membership.Role.values:
            raise InvalidInput(f"must be one of {', '.join(Membership.Role.values)}", field="role")
        if not isinstance(username, str) or not username:
            raise InvalidInput("must be a username", field="username")
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise InvalidInput(f"no user named {username!r}", field="username", code="unknown_user")
        membership, created = Membership.objects.update_or_create(tenant=tenant, user=user, defaults={"role": role})
        if not user.is_staff:
            user.is_staff = True
            user.save(update_fields=["is_staff"])
        audit_record(
            tenant=tenant,
            actor=actor,
            action="membership.set",
            target=user.get_username(),
            outcome=Outcome.OK,
            detail={"role": role, "created": created},
        )
        return membership


def membership_remove(*, tenant: Tenant, actor: Actor, membership_id: int) -> bool:
    """End a membership of ``tenant``. Audited as ``membership.remove``."""
    with _operation(tenant=tenant, actor=actor, action="membership.remove"):
        _require_admin(actor)
        membership = Membership.objects.filter(tenant=tenant, pk=membership_id).select_related("user").first()
        if membership is None:
            audit_record(tenant=tenant, actor=actor, action="membership.remove", outcome=Outcome.NOT_FOUND)
            return False
        username = membership.user.get_username()
        role = membership.role
        membership.delete()
        audit_record(
            tenant=tenant,
            actor=actor,
            action="membership.remove",
            target=username,
            outcome=Outcome.OK,
            detail={"role": role},
        )
        return True


def _require_admin(actor: Actor) -> None:
    # The admin role is the only one whose actor holds all of the admin role's scopes.
    if actor.kind != "system" and not ROLE_SCOPES["admin"] <= actor.scopes:
        raise Forbidden(code="admin_role_required", message="only a tenant admin manages members", field=None)


def _pk(raw: Any) -> int:
    try:
        pk = int(raw)
    except (TypeError, ValueError):
        return 0
    return pk if 0 < pk < 2**63 else 0


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
