"""Who may use the admin console for a tenant: a user's membership and its role, set and
ended here, audited in the same transaction. Only a tenant admin manages members."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db import DEFAULT_DB_ALIAS

from audit.services import audited_operation
from memories.models import Membership, Tenant
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import Forbidden, InvalidInput, NotFound
from zeromem.kernel.outcomes import ActorKind, Outcome
from zeromem.kernel.scopes import ROLE_SCOPES, TENANT_ADMIN_SCOPES


def membership_set(*, tenant: Tenant, actor: Actor, username: Any, role: Any) -> Membership:
    """Give an existing user ``role`` in ``tenant`` (creating or changing the membership).
    Needs the admin role (the only role whose actor holds every scope). A tenant admin may
    add only active staff accounts (:func:`addable_user`); a superuser (or the system) may add
    any active user, who is then marked staff so they can sign in. Audited as ``membership.set``."""
    with audited_operation(tenant=tenant, actor=actor, action="membership.set") as op:
        _require_admin(actor)
        if role not in Membership.Role.values:
            raise InvalidInput(f"must be one of {', '.join(Membership.Role.values)}", field="role")
        user = addable_user(actor=actor, username=username)
        membership, created = Membership.objects.update_or_create(tenant=tenant, user=user, defaults={"role": role})
        if not user.is_staff:  # (only a superuser's or the system's call gets here)
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


def memberships_listed(*, tenant: Tenant, actor: Actor, search: str = "", count: int) -> None:
    """Record a page of the admin's membership list showing ``count`` of ``tenant``'s members
    (who holds which role), as ``membership.list``; a search (a username) in ``detail.search``.
    Only a tenant admin reads them. Cost: the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="membership.list", atomic=False) as op:
        _require_admin(actor)
        op.record(count=count, detail={"search": search[:150]} if isinstance(search, str) and search else None)


def membership_view(*, tenant: Tenant, actor: Actor, membership_id: Any) -> Membership:
    """The tenant's membership ``membership_id`` opened in the admin, recorded as
    ``membership.view`` (target: the username; ``detail.role``); :class:`NotFound` (recorded)
    for another tenant's or none. Only a tenant admin. Cost: one SELECT and the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="membership.view", atomic=False) as op:
        _require_admin(actor)
        pk = validation.ascii_int(membership_id) if isinstance(membership_id, str) else membership_id
        valid = isinstance(pk, int) and not isinstance(pk, bool) and pk > 0
        membership = Membership.objects.filter(tenant=tenant, pk=pk).select_related("user").first() if valid else None
        if membership is None:
            raise NotFound("no such membership", field="membership_id")
        op.record(target=membership.user.get_username(), detail={"role": membership.role})
        return membership


NOT_ADDABLE = "no account by that name can be added here: a superuser creates admin accounts first"


def addable_user(*, actor: Actor, username: Any):
    """The user ``username`` if ``actor`` may make them a member; else :class:`InvalidInput`
    with one message whether the name is unknown, inactive or not a staff account, so a
    tenant admin learns nothing about the accounts they may not add. Only a superuser (or
    the system) may add a user who is not staff yet. Cost: one or two unique-index SELECTs."""
    if not isinstance(username, str) or not username or len(username) > 150:
        raise InvalidInput("must be a username", field="username")
    User = get_user_model()
    user = User.objects.filter(username=username, is_active=True).first()
    privileged = actor.kind == ActorKind.SYSTEM or (
        actor.kind == ActorKind.STAFF and User.objects.filter(pk=actor.id, is_superuser=True, is_active=True).exists()
    )
    if user is None or not (user.is_staff or privileged):
        raise InvalidInput(NOT_ADDABLE, field="username", code="unknown_user")
    return user


def _require_admin(actor: Actor) -> None:
    # The admin role is the only one whose actor holds all of the admin role's scopes.
    if actor.kind != ActorKind.SYSTEM and not TENANT_ADMIN_SCOPES <= actor.scopes:
        raise Forbidden(code="admin_role_required", message="only a tenant admin manages members", field=None)


def staff_withdrawn(actor: Actor, tenant_id: int | None) -> str | None:
    """Why a staff actor no longer holds in ``tenant_id`` (``account_disabled``: the user is
    gone or inactive; ``membership_removed``: no role there, or one without every scope the
    actor was given), else None — read from the primary: what a long answer (the admin's
    audit export) asks before each further page (:func:`zeromem.kernel.actors.require_still_held`).
    A superuser acts in every tenant. Cost: two primary-key/unique SELECTs."""
    user = get_user_model().objects.using(DEFAULT_DB_ALIAS).filter(pk=actor.id).values("is_active", "is_superuser")
    user = user.first()
    if user is None or not user["is_active"]:
        return "account_disabled"
    if user["is_superuser"] or tenant_id is None:
        return None
    role = (
        Membership.objects.using(DEFAULT_DB_ALIAS)
        .filter(tenant_id=tenant_id, user_id=actor.id)
        .values_list("role", flat=True)
        .first()
    )
    if role is None or not actor.scopes <= ROLE_SCOPES.get(role, frozenset()):
        return "membership_removed"
    return None
