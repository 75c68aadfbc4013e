"""Who may use the admin console for a tenant: a user's membership and its role, set and
ended here, audited in the same transaction. Only a tenant admin manages members."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model

from audit.services import audited_operation
from memories.models import Membership, Tenant
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import Forbidden, InvalidInput
from zeromem.kernel.outcomes import ActorKind, Outcome
from zeromem.kernel.scopes import TENANT_ADMIN_SCOPES


def membership_set(*, tenant: Tenant, actor: Actor, username: Any, role: Any) -> Membership:
    """Give an existing user ``role`` in ``tenant`` (creating or changing the membership).
    A member may log in to the admin, so the user is marked staff. Needs the admin role
    (the only role whose actor holds every scope). Audited as ``membership.set``."""
    with audited_operation(tenant=tenant, actor=actor, action="membership.set") as op:
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
        op.record(target=user.get_username(), detail={"role": role, "created": created})
        return membership


def membership_remove(*, tenant: Tenant, actor: Actor, membership_id: int) -> bool:
    """End a membership of ``tenant``; False (audited as not found) when there is none.
    Audited as ``membership.remove``."""
    with audited_operation(tenant=tenant, actor=actor, action="membership.remove") as op:
        _require_admin(actor)
        membership = Membership.objects.filter(tenant=tenant, pk=membership_id).select_related("user").first()
        if membership is None:
            op.record(outcome=Outcome.NOT_FOUND)
            return False
        username = membership.user.get_username()
        role = membership.role
        membership.delete()
        op.record(target=username, detail={"role": role})
        return True


def _require_admin(actor: Actor) -> None:
    # The admin role is the only one whose actor holds all of the admin role's scopes.
    if actor.kind != ActorKind.SYSTEM and not TENANT_ADMIN_SCOPES <= actor.scopes:
        raise Forbidden(code="admin_role_required", message="only a tenant admin manages members", field=None)
