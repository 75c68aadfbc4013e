"""Tenants (created, their name and limits changed) and API keys (created, revoked), audited in
the same transaction."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import validate_slug
from django.db import transaction
from django.utils import timezone

from audit.services import audited_operation
from memories.models import ApiKey, Tenant
from memories.portal.models import PortalLink
from memories.services import key_cache, sensitivity
from memories.services.jobs import jobs_cancel_for_key
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import Forbidden, InvalidInput, NotFound
from zeromem.kernel.outcomes import ActorKind, Outcome
from zeromem.kernel.scopes import ALL_SCOPES, DEFAULT_AGENT_SCOPES, OPERATOR_SCOPES, TENANT_ADMIN_SCOPES

API_KEY_MAX_DAYS = 3650  # an API key's longest lifetime (the admin form offers the same)
API_KEY_NAME_MAX = 100  # ApiKey.name's column
TENANT_SLUG_MAX = 63  # Tenant.slug's column
TENANT_NAME_MAX = 200  # Tenant.name's column


def tenant_name(name: Any) -> str:
    """A tenant's name as stored: 1-200 characters, not only blanks, no control characters
    (:class:`InvalidInput` naming ``name``)."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidInput(f"must be 1-{TENANT_NAME_MAX} characters", field="name")
    validation.short_text(name, field="name", max_len=TENANT_NAME_MAX)
    return name


def _require_key_manager(*, tenant: Tenant, actor: Actor, action: str) -> None:
    """Only the system (the commands) and a tenant admin (the role whose scopes include every
    other's: the admin's keys.manage capability) create or revoke a tenant's keys; anyone else
    is refused here, whatever surface called, audited as ``denied``."""
    if actor.kind == ActorKind.SYSTEM or (actor.kind == ActorKind.STAFF and TENANT_ADMIN_SCOPES <= actor.scopes):
        return
    with audited_operation(tenant=tenant, actor=actor, action=action):
        raise Forbidden(code="admin_role_required", message="only a tenant admin manages API keys", field=None)


def _is_operator(actor: Actor) -> bool:
    """The system (a command, a job) or an active superuser: who creates tenants and changes
    their settings (the admin's Tenant page is theirs alone). Cost: one primary-key SELECT
    for a staff actor."""
    if actor.kind == ActorKind.SYSTEM:
        return True
    if actor.kind != ActorKind.STAFF or not actor.id.isdigit():
        return False
    return get_user_model().objects.filter(pk=int(actor.id), is_superuser=True, is_active=True).exists()


def tenant_create(*, actor: Actor, slug: Any, name: str | None = None) -> Tenant:
    """A new tenant, audited in its own log as ``tenant.create``; only the system or a
    superuser (``Forbidden``). The checks come first, and a refusal is not audited (there is
    no tenant whose log could hold it)."""
    if not _is_operator(actor):
        raise Forbidden(code="superuser_required", message="only a superuser creates tenants", field=None)
    try:
        if not isinstance(slug, str):
            raise DjangoValidationError("not a string")
        validate_slug(slug)
    except DjangoValidationError:
        raise InvalidInput("must be letters, digits, hyphens or underscores", field="slug") from None
    if len(slug) > TENANT_SLUG_MAX:  # a DataError (a traceback) past the column
        raise InvalidInput(f"must be at most {TENANT_SLUG_MAX} characters", field="slug", code="too_long")
    name = slug if name is None else tenant_name(name)
    if Tenant.objects.filter(slug=slug).exists():
        raise InvalidInput(f"tenant '{slug}' already exists", field="slug", code="exists")
    with audited_operation(tenant=None, actor=actor, action="tenant.create", target=slug) as op:
        op.tenant = Tenant.objects.create(slug=slug, name=name)
        op.record()
    return op.tenant


def api_key_name(name: Any) -> str:
    """A key's name as stored: 1-100 characters, not only blanks, no control characters
    (:class:`InvalidInput` naming ``name``). The admin's form asks it too."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidInput("must be a non-empty name", field="name")
    validation.short_text(name, field="name", max_len=API_KEY_NAME_MAX)
    return name


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
    """Create a key and return it with its secret, the only time the secret exists. Only the
    system or a tenant admin may (refused: ``Forbidden``, audited as denied); a key gets no
    scope its creator lacks. Bad input raises before anything is written, and is not
    audited."""
    _require_key_manager(tenant=tenant, actor=actor, action="api_key.create")
    name = api_key_name(name)
    # Each scope once, in the order given (a duplicate was stored and shown twice).
    scopes = list(dict.fromkeys(str(s) for s in (scopes if scopes is not None else DEFAULT_AGENT_SCOPES)))
    unknown = sorted(set(scopes) - set(ALL_SCOPES))
    if unknown:
        raise InvalidInput(f"unknown scope {unknown[0]!r}; known: {', '.join(ALL_SCOPES)}", field="scopes")
    operator = sorted(set(scopes) & OPERATOR_SCOPES)
    if operator and actor.kind != ActorKind.SYSTEM:
        # The fleet's metrics are the operator's, not a tenant's: only the command line grants them.
        raise InvalidInput(
            f"{operator[0]!r} is an operator scope: create the key with manage.py create_api_key", field="scopes"
        )
    beyond = sorted(set(scopes) - actor.scopes) if actor.kind != ActorKind.SYSTEM else []
    if beyond:
        raise InvalidInput(f"{beyond[0]!r} is a scope your role does not hold", field="scopes", code="scope_not_held")
    prefixes = validation.allowlist(allowed_prefixes)
    if expires_in_days is not None:
        # The admin form's bound: a date past year 9999 was an OverflowError (a traceback).
        expires_in_days = validation.bounded_int(
            expires_in_days, field="expires_in_days", default=0, low=1, high=API_KEY_MAX_DAYS
        )
    raw, lookup, key_hash = ApiKey.generate()
    with audited_operation(tenant=tenant, actor=actor, action="api_key.create") as op:
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
        op.record(target=key.display_prefix, detail={"scopes": scopes, "allowed_prefixes": prefixes})
    return key, raw


def api_key_revoke(*, tenant: Tenant, actor: Actor, key_id: int) -> bool:
    """Revoke the tenant's key ``key_id``; False (audited as not found) when there is no such
    key or it was revoked already. The portal links the key issued are withdrawn with it
    (unopened ones stop opening, open portal sessions end): one more UPDATE of the tenant's
    links (no index on the issuer: links are short-lived and purged, the table stays small).
    The key's jobs still queued are cancelled in the same transaction, with their own audit
    event (:func:`~memories.services.jobs.jobs_cancel_for_key`; a running one stops at its
    own check of the key). Only the system or a tenant admin may (refused: ``Forbidden``,
    audited as denied)."""
    _require_key_manager(tenant=tenant, actor=actor, action="api_key.revoke")
    with audited_operation(tenant=tenant, actor=actor, action="api_key.revoke") as op:
        now = timezone.now()
        updated = ApiKey.objects.filter(tenant=tenant, pk=key_id, revoked_at__isnull=True).update(revoked_at=now)
        key = ApiKey.objects.filter(tenant=tenant, pk=key_id).first()
        links = 0
        if key is not None:
            _forget_cached(key.lookup)
            links = PortalLink.objects.filter(
                tenant=tenant, created_by_kind=ActorKind.API_KEY, created_by=str(key.pk), revoked_at__isnull=True
            ).update(revoked_at=now)
        if updated:
            jobs_cancel_for_key(tenant=tenant, actor=actor, key=key, reason="revoked")
        op.record(
            target=key.display_prefix if key else "",
            outcome=Outcome.OK if updated else Outcome.NOT_FOUND,
            detail={"portal_links_revoked": links} if links else None,
        )
    return bool(updated)


def _forget_cached(lookup: str | None) -> None:
    # This process stops using the cached key (or tenant) at once, and again after the
    # commit (a request in between could have cached the old row); other processes within
    # their cache's TTL (memories/services/key_cache.py).
    key_cache.forget(lookup)
    transaction.on_commit(lambda: key_cache.forget(lookup))


# --- reading them in the admin (audited, as the memory pages' memory.list / memory.view) ----

# A list's search as an event keeps it: a key's name or public prefix, a staff username (no
# end user's data), cut to this many characters.
LIST_SEARCH_KEPT = 100


def tenant_settings_view(*, tenant: Tenant, actor: Actor) -> None:
    """Record a staff member opening ``tenant``'s settings page (its limits and sensitivity
    rules), as ``tenant.view`` (target: the slug). Any member may (the admin shows it to every
    role, read-only but to a superuser). Cost: the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="tenant.view", target=tenant.slug, atomic=False) as op:
        op.record()


def tenants_listed(*, tenant: Tenant, actor: Actor, search: str = "", count: int) -> None:
    """Record a page of the admin's tenant list showing ``tenant`` (its slug, name and the
    reader's role in it), as ``tenant.list`` (target: the slug); a search in ``detail.search``.
    One event in each tenant a page shows, as the other lists are recorded: which staff looked
    at the tenants, in each tenant's own log. Any member may. Cost: the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="tenant.list", target=tenant.slug, atomic=False) as op:
        op.record(count=count, detail=_search_detail(search))


def api_keys_listed(*, tenant: Tenant, actor: Actor, search: str = "", count: int) -> None:
    """Record a page of the admin's API key list showing ``count`` of ``tenant``'s keys (names,
    public prefixes, scopes, allowlists, last use), as ``api_key.list``; a search in
    ``detail.search``. Only a tenant admin reads them (``Forbidden``, audited as denied).
    Never a secret or a hash: the list holds neither. Cost: the audit INSERT."""
    _require_key_manager(tenant=tenant, actor=actor, action="api_key.list")
    with audited_operation(tenant=tenant, actor=actor, action="api_key.list", atomic=False) as op:
        op.record(count=count, detail=_search_detail(search))


def api_key_view(*, tenant: Tenant, actor: Actor, key_id: Any) -> ApiKey:
    """The tenant's key ``key_id`` opened in the admin, recorded as ``api_key.view`` with its
    public prefix as the target (never its secret, which is not stored, nor its hash);
    :class:`NotFound` (recorded) for another tenant's or none. Only a tenant admin
    (``Forbidden``, audited as denied). Cost: one primary-key SELECT and the audit INSERT."""
    _require_key_manager(tenant=tenant, actor=actor, action="api_key.view")
    with audited_operation(tenant=tenant, actor=actor, action="api_key.view", atomic=False) as op:
        pk = validation.ascii_int(key_id) if isinstance(key_id, str) else key_id
        valid = isinstance(pk, int) and not isinstance(pk, bool) and pk > 0
        key = ApiKey.objects.filter(tenant=tenant, pk=pk).first() if valid else None
        if key is None:
            raise NotFound("no such API key", field="key_id")
        op.record(target=key.display_prefix)
        return key


# A whole key pasted into the search (``zm_<lookup>_<secret>``: an admin looking up a key a
# secret scanner found): its secret is withheld from the event, its public prefix kept.
_PASTED_KEY = re.compile(r"(zm_[0-9A-Za-z]+_)\S+")


def _search_detail(search: Any) -> dict | None:
    if not isinstance(search, str) or not search:
        return None
    return {"search": _PASTED_KEY.sub(r"\1…", search)[:LIST_SEARCH_KEPT]}


def tenant_settings_update(
    *,
    tenant: Tenant,
    actor: Actor,
    name: Any,
    value_max_bytes: Any,
    trash_retention_days: Any,
    sensitive_keys: Any = None,
    sensitive_fields: Any = None,
):
    """Change a tenant's name, limits and sensitivity rules (the admin's Tenant page;
    superusers only, checked here). Audited as ``tenant.update`` with the fields
    that changed. New rules apply to writes from now on; ``manage.py crypto_reencrypt``
    seals the memories they match that were written before. Anyone but the system or a
    superuser (a tenant admin included): ``Forbidden``, audited as denied."""
    with audited_operation(tenant=tenant, actor=actor, action="tenant.update", target=tenant.slug) as op:
        if not _is_operator(actor):
            raise Forbidden(code="superuser_required", message="only a superuser changes tenant settings", field=None)
        tenant_name(name)
        for field, raw in (("value_max_bytes", value_max_bytes), ("trash_retention_days", trash_retention_days)):
            if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int) or raw < 1):
                raise InvalidInput("must be a positive whole number or empty", field=field)
        keys = sensitivity.rules(sensitive_keys, field="sensitive_keys")
        fields = sensitivity.rules(sensitive_fields, field="sensitive_fields")
        changes = {
            field: new
            for field, new in (
                ("name", name),
                ("value_max_bytes", value_max_bytes),
                ("trash_retention_days", trash_retention_days),
                ("sensitive_keys", tenant.sensitive_keys if keys is None else keys),
                ("sensitive_fields", tenant.sensitive_fields if fields is None else fields),
            )
            if getattr(tenant, field) != new
        }
        if changes:
            Tenant.objects.filter(pk=tenant.pk).update(**changes)
            _forget_cached(None)
            for field, new in changes.items():
                setattr(tenant, field, new)
        op.record(detail={"changed": sorted(changes)})
        return tenant
