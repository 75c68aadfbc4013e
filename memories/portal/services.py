"""Portal links: issued to a tenant's application for one of its end users, opened once by
that user. Audited like every other operation (audit.services.audited_operation, same
transaction).

A link is ``/portal/open/<token>``, the token an opaque random string (32 bytes from
``secrets``, URL-safe): it names nothing. The tenant and subject are looked up server-side
from the row whose ``token_hash`` is the token's SHA-256; the token itself is stored nowhere,
and the access logs write its path as ``/portal/open/…`` (zeromem.kit.logs). Opening it:

* a token no row has (altered, truncated, made up, or purged long after it expired) is
  refused as ``altered``;
* past its expiry, as ``expired``;
* withdrawn by the tenant (``portal_links_revoke``) or with the key that issued it
  (``api_key_revoke``), as ``revoked``;
* past the expiry of the API key that issued it, as ``expired``: a link expires at the
  earlier of its own expiry and its key's (set so when issued, and checked against the key
  when opened);
* opened once already, as ``replayed``: the first open exchanges it for a short portal
  session (a signed cookie naming the link, ``ZEROMEM_PORTAL_SESSION_SECONDS``), marked by a
  conditional UPDATE of ``PortalLink.opened_at``, so two concurrent opens cannot both win.

Refusals are throttled per client address (``ZEROMEM_AUTH_FAILURES_PER_MINUTE``, as failed
authentications): past it, :class:`audit.services.AuthThrottled` and nothing is written.

A revoked link's open session ends too: the session is only as good as its link's row; so
does the session of a link whose issuing key has expired since.

Looking at the link (GET) checks it without using it up, so a mail client or chat app that
fetches links for a preview cannot burn the user's link; the page's button (POST) opens it.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from audit import limits
from audit.services import AuthThrottled, audited_operation
from memories.models import ApiKey, Tenant
from memories.portal.models import PortalLink
from memories.services.subjects import _validated_subject
from zeromem.kernel import opaque, validation
from zeromem.kernel.actors import Actor, require_scope
from zeromem.kernel.errors import Forbidden
from zeromem.kernel.outcomes import ActorKind, Outcome
from zeromem.kernel.scopes import Scope

TOKEN_BYTES = 32  # secrets.token_urlsafe: 43 characters
TOKEN_MAX_LEN = 100  # anything longer is not ours (no hashing of megabyte paths)


def link_ref(link: PortalLink) -> str:
    """How an audit event names a link (the tenant reads its log): an opaque token, not the
    row id, which comes from a sequence every tenant's links share."""
    return opaque.seal_id(link.pk, purpose="portal-link")


def token_hash(token: str) -> str:
    """What the row keeps of a token: its SHA-256 (a 256-bit random token needs no salt or
    slow hash; a leaked table yields no working link)."""
    return hashlib.sha256(token.encode()).hexdigest()


class LinkRefused(Exception):
    """A portal link that cannot be opened; ``reason`` is altered, expired or replayed."""

    STATUS = {"altered": 400, "expired": 410, "replayed": 410, "revoked": 410}

    def __init__(self, reason: str, link: PortalLink | None = None):
        super().__init__(reason)
        self.reason = reason
        self.link = link
        self.http_status = self.STATUS[reason]


def portal_link_create(*, tenant: Tenant, actor: Actor, subject: Any) -> tuple[PortalLink, str]:
    """Issue a one-time link for the end user ``subject`` of ``tenant``, valid for
    ``ZEROMEM_PORTAL_LINK_SECONDS``. Needs ``forget:create`` (the portal lets the user file
    forget requests); a key limited to some prefixes may not (the portal shows the whole
    subject). An API key with an expiry issues links that expire no later than it does.
    Returns (the link's row, its token). Cost: one INSERT and the audit INSERT (and, for an
    API key, a primary-key SELECT of its expiry)."""
    with audited_operation(tenant=tenant, actor=actor, action="portal.link_create") as op:
        require_scope(actor, Scope.FORGET_CREATE)
        subject = _validated_subject(subject)
        if actor.allowed_prefixes:
            raise Forbidden(
                code="key_not_allowed",
                message="an API key limited to some prefixes cannot open a subject's whole portal",
                field="subject",
            )
        now = timezone.now()
        lifetime = settings.ZEROMEM_PORTAL_LINK_SECONDS
        expires_at = (now + timedelta(seconds=lifetime)).replace(microsecond=0)
        if actor.kind == ActorKind.API_KEY:
            key_expires_at = _key_expiry(tenant_id=tenant.pk, key_id=actor.id)
            if key_expires_at is not None and key_expires_at < expires_at:
                expires_at = key_expires_at
        token = secrets.token_urlsafe(TOKEN_BYTES)
        link = PortalLink.objects.create(
            tenant=tenant,
            subject=subject,
            token_hash=token_hash(token),
            created_at=now,
            expires_at=expires_at,
            created_by_kind=actor.kind,
            created_by=actor.id,
        )
        in_seconds = max(0, int((expires_at - now).total_seconds()))
        op.record(subject=subject, detail={"portal_link": link_ref(link), "expires_in_seconds": in_seconds})
    return link, token


def portal_link_open(*, token: str, actor_for: Callable[[PortalLink | None], Actor], use: bool) -> PortalLink:
    """Check the link ``token`` and, with ``use``, open it (mark it used; the caller then
    starts the portal session). Raises :class:`LinkRefused`, audited as ``portal.open``.

    ``actor_for(link)`` builds the actor: the end user once the link is known to be good,
    an anonymous one for a refused link (whoever holds it). Cost: a unique-index SELECT of
    the link (with its tenant), a primary-key SELECT of its issuing API key's expiry; with
    ``use`` a conditional UPDATE and the audit INSERT."""
    link = None
    if isinstance(token, str) and 0 < len(token) <= TOKEN_MAX_LEN:
        link = PortalLink.objects.select_related("tenant").filter(token_hash=token_hash(token)).first()
    if link is None:
        _refuse(None, actor_for(None), "altered")
    tenant, now = link.tenant, timezone.now()
    if link.revoked_at is not None:
        _refuse(tenant, actor_for(None), "revoked", subject=link.subject, link=link)
    if link.expires_at <= now or _issuer_expired(link, now):
        _refuse(tenant, actor_for(None), "expired", subject=link.subject, link=link)
    if link.opened_at is not None:
        _refuse(tenant, actor_for(None), "replayed", subject=link.subject, link=link)
    if not use:
        return link
    with audited_operation(tenant=tenant, actor=actor_for(link), action="portal.open") as op:
        won = PortalLink.objects.filter(
            pk=link.pk, opened_at__isnull=True, revoked_at__isnull=True, expires_at__gt=now
        ).update(opened_at=now)
        if won:
            link.opened_at = now
            op.record(subject=link.subject, detail={"portal_link": link_ref(link)})
    if not won:  # another request opened it between our SELECT and the UPDATE
        _refuse(tenant, actor_for(None), "replayed", subject=link.subject, link=link)
    return link


def portal_session_link(*, link_id: Any, count: bool = True) -> PortalLink | None:
    """The opened, not signed-out link a portal session cookie names (it was signed by us,
    so ``link_id`` is ours), with its tenant; None when it no longer holds: signed out,
    withdrawn, or its issuing API key expired since (a primary-key SELECT of the key's expiry).

    ``count``: the page counts against the session's ``ZEROMEM_PORTAL_PAGES_PER_MINUTE``
    (exact across processes, audit/limits.py); past it :class:`AuthThrottled` and nothing is
    written — each page is an audit row of the tenant's, and a session lasts half an hour."""
    if not isinstance(link_id, int) or link_id < 1:
        return None
    link = (
        PortalLink.objects.select_related("tenant")
        .filter(pk=link_id, opened_at__isnull=False, closed_at__isnull=True, revoked_at__isnull=True)
        .first()
    )
    if link is not None and _issuer_expired(link, timezone.now()):
        return None
    if link is not None and count:
        pages = limits.hit(f"portal:link:{link.pk}")
        if pages.count > settings.ZEROMEM_PORTAL_PAGES_PER_MINUTE:
            raise AuthThrottled(pages.retry_after)
    return link


def _key_expiry(*, tenant_id: int, key_id: Any):
    """The expiry of the tenant's API key ``key_id`` (None: none, or no such key)."""
    if not (isinstance(key_id, str) and key_id.isascii() and key_id.isdigit()):
        return None
    return ApiKey.objects.filter(tenant_id=tenant_id, pk=int(key_id)).values_list("expires_at", flat=True).first()


def _issuer_expired(link: PortalLink, now) -> bool:
    """Whether the API key that issued ``link`` has expired: its links and their sessions go
    with it, as with a revoked key (whose revocation marks them, api_key_revoke)."""
    if link.created_by_kind != ActorKind.API_KEY:
        return False
    key_expires_at = _key_expiry(tenant_id=link.tenant_id, key_id=link.created_by)
    return key_expires_at is not None and key_expires_at <= now


def portal_links_viewed(*, tenant: Tenant, actor: Actor, search: str = "", count: int) -> None:
    """Record a page of the admin's portal-link list showing ``count`` of ``tenant``'s links
    (which end users were sent a link, when, whether they opened it), as ``portal.list``; a
    search by an end user's whole subject goes in the event's own (redactable) ``subject``,
    as :func:`memories.services.forget.forget_queue_viewed` records the forget queue's."""
    with audited_operation(tenant=tenant, actor=actor, action="portal.list") as op:
        op.record(subject=search[: validation.SUBJECT_MAX_LEN] if isinstance(search, str) else "", count=count)


def portal_sign_out(*, link: PortalLink, actor: Actor) -> None:
    """End the portal session of ``link`` server-side (its cookie stops working)."""
    with audited_operation(tenant=link.tenant, actor=actor, action="portal.sign_out") as op:
        PortalLink.objects.filter(pk=link.pk, closed_at__isnull=True).update(closed_at=timezone.now())
        op.record(subject=link.subject, detail={"portal_link": link_ref(link)})


def _refuse(tenant: Tenant | None, actor: Actor, reason: str, *, subject: str = "", link=None) -> None:
    # Throttled first, per client address, as failed authentications are: anyone may try
    # tokens, and each refusal is an audit row nothing may delete. Past the limit the open is
    # answered 429 and nothing is written.
    tried = limits.hit(f"portalfail:ip:{actor.client_ip or 'unknown'}")
    if tried.count > settings.ZEROMEM_AUTH_FAILURES_PER_MINUTE:
        raise AuthThrottled(tried.retry_after)
    # Its own transaction: the open fails, the record of the attempt stays.
    with audited_operation(tenant=tenant, actor=actor, action="portal.open") as op:
        op.record(
            outcome=Outcome.INVALID if reason == "altered" else Outcome.DENIED,
            subject=subject,
            detail={"code": f"link_{reason}", "portal_link": link_ref(link) if link else None},
        )
    raise LinkRefused(reason, link)


def portal_links_revoke(*, tenant: Tenant, actor: Actor, subject: Any) -> int:
    """Withdraw every link of the end user ``subject``: the unopened ones stop opening
    (``revoked``) and the open portal sessions end at their next page. Needs
    ``forget:create`` and the whole tenant, like issuing one. Returns how many links it
    withdrew; audited as ``portal.revoke``. Cost: one UPDATE on the (tenant, subject) index."""
    with audited_operation(tenant=tenant, actor=actor, action="portal.revoke") as op:
        require_scope(actor, Scope.FORGET_CREATE)
        subject = _validated_subject(subject)
        if actor.allowed_prefixes:
            raise Forbidden(
                code="key_not_allowed",
                message="an API key limited to some prefixes cannot withdraw a subject's portal links",
                field="subject",
            )
        count = PortalLink.objects.filter(tenant=tenant, subject=subject, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        op.record(subject=subject, count=count)
    return count


def portal_links_purge() -> int:
    """Delete the links no one can use any more: past their expiry, and past the longest
    portal session one of them could have started (``ZEROMEM_PORTAL_SESSION_SECONDS``). Their
    rows name a subject, so they are not kept longer than they serve. Returns how many; one
    audit event per tenant. Cost: one DELETE per tenant with such links (few: links are
    short-lived), found by a scan of expires_at (no index: the table stays small)."""
    cutoff = timezone.now() - timedelta(seconds=settings.ZEROMEM_PORTAL_SESSION_SECONDS)
    done = 0
    actor = Actor.system(job="portal-links-purge")
    tenant_ids = PortalLink.objects.filter(expires_at__lt=cutoff).values_list("tenant_id", flat=True).distinct()
    for tenant_id in sorted(set(tenant_ids)):
        with audited_operation(tenant=Tenant(pk=tenant_id), actor=actor, action="portal.links_purge") as op:
            count, _ = PortalLink.objects.filter(tenant_id=tenant_id, expires_at__lt=cutoff).delete()
            if count:
                op.record(count=count)
            done += count
    return done
