"""Portal links: issued to a tenant's application for one of its end users, opened once by
that user. Audited like every other operation (audit.services.audited_operation, same
transaction).

A link is ``/portal/open/<token>``, the token being ``django.core.signing.dumps`` of
``{"t": tenant id, "s": subject, "n": nonce, "e": expiry (epoch seconds)}`` (salted, signed
with SECRET_KEY; readable, not secret: it names the subject, nothing more). Opening it:

* a token that does not verify (altered, truncated, made up) is refused as ``altered``;
* past its expiry, as ``expired``;
* opened once already, as ``replayed``: the first open exchanges it for a short portal
  session (a signed cookie naming the link, ``ZEROMEM_PORTAL_SESSION_SECONDS``), marked by a
  conditional UPDATE of ``PortalLink.opened_at``, so two concurrent opens cannot both win.

Looking at the link (GET) checks it without using it up, so a mail client or chat app that
fetches links for a preview cannot burn the user's link; the page's button (POST) opens it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core import signing
from django.utils import timezone

from audit.services import audited_operation
from memories.models import Tenant
from memories.portal.models import PortalLink
from memories.services.subjects import _validated_subject
from zeromem.kernel.actors import Actor, require_scope
from zeromem.kernel.errors import Forbidden
from zeromem.kernel.outcomes import Outcome
from zeromem.kernel.scopes import Scope

LINK_SALT = "zeromem.portal.link"


class LinkRefused(Exception):
    """A portal link that cannot be opened; ``reason`` is altered, expired or replayed."""

    STATUS = {"altered": 400, "expired": 410, "replayed": 410}

    def __init__(self, reason: str, link: PortalLink | None = None):
        super().__init__(reason)
        self.reason = reason
        self.link = link
        self.http_status = self.STATUS[reason]


def portal_link_create(*, tenant: Tenant, actor: Actor, subject: Any) -> tuple[PortalLink, str]:
    """Issue a one-time link for the end user ``subject`` of ``tenant``, valid for
    ``ZEROMEM_PORTAL_LINK_SECONDS``. Needs ``forget:create`` (the portal lets the user file
    forget requests); a key limited to some prefixes may not (the portal shows the whole
    subject). Returns (the link's row, its token). Cost: one INSERT and the audit INSERT."""
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
        # Whole seconds: the token carries the expiry as epoch seconds.
        expires_at = (now + timedelta(seconds=lifetime)).replace(microsecond=0)
        link = PortalLink.objects.create(
            tenant=tenant,
            subject=subject,
            nonce=secrets.token_urlsafe(16),
            created_at=now,
            expires_at=expires_at,
            created_by_kind=actor.kind,
            created_by=actor.id,
        )
        op.record(subject=subject, detail={"portal_link": link.pk, "expires_in_seconds": lifetime})
    token = signing.dumps(
        {"t": tenant.pk, "s": subject, "n": link.nonce, "e": int(expires_at.timestamp())}, salt=LINK_SALT, compress=True
    )
    return link, token


def portal_link_open(*, token: str, actor_for: Callable[[PortalLink | None], Actor], use: bool) -> PortalLink:
    """Check the link ``token`` and, with ``use``, open it (mark it used; the caller then
    starts the portal session). Raises :class:`LinkRefused`, audited as ``portal.open``.

    ``actor_for(link)`` builds the actor: the end user once the link is known to be good,
    an anonymous one for a refused link (whoever holds it). Cost: a primary-key SELECT of the
    tenant and a unique-index SELECT of the link; with ``use`` a conditional UPDATE and the
    audit INSERT."""
    claims = _claims(token)
    tenant = Tenant.objects.filter(pk=claims["t"]).first() if claims else None
    now = timezone.now()
    # The signed expiry first: a link's row is purged some time after it expired
    # (portal_links_purge), and the link must still read as expired, not as altered.
    if tenant is not None and claims["e"] <= now.timestamp():
        _refuse(tenant, actor_for(None), "expired", subject=claims["s"])
    link = None
    if tenant is not None:
        link = PortalLink.objects.filter(nonce=claims["n"], tenant=tenant, subject=claims["s"]).first()
    if link is None:
        _refuse(tenant, actor_for(None), "altered", subject=claims["s"] if tenant else "")
    if link.expires_at <= now:
        _refuse(tenant, actor_for(None), "expired", subject=link.subject, link=link)
    if link.opened_at is not None:
        _refuse(tenant, actor_for(None), "replayed", subject=link.subject, link=link)
    if not use:
        return link
    with audited_operation(tenant=tenant, actor=actor_for(link), action="portal.open") as op:
        won = PortalLink.objects.filter(pk=link.pk, opened_at__isnull=True).update(opened_at=now)
        if won:
            link.opened_at = now
            op.record(subject=link.subject, detail={"portal_link": link.pk})
    if not won:  # another request opened it between our SELECT and the UPDATE
        _refuse(tenant, actor_for(None), "replayed", subject=link.subject, link=link)
    return link


def portal_session_link(*, link_id: Any) -> PortalLink | None:
    """The opened, not signed-out link a portal session cookie names (it was signed by us,
    so ``link_id`` is ours), with its tenant; None when it no longer holds."""
    if not isinstance(link_id, int) or link_id < 1:
        return None
    return (
        PortalLink.objects.select_related("tenant")
        .filter(pk=link_id, opened_at__isnull=False, closed_at__isnull=True)
        .first()
    )


def portal_sign_out(*, link: PortalLink, actor: Actor) -> None:
    """End the portal session of ``link`` server-side (its cookie stops working)."""
    with audited_operation(tenant=link.tenant, actor=actor, action="portal.sign_out") as op:
        PortalLink.objects.filter(pk=link.pk, closed_at__isnull=True).update(closed_at=timezone.now())
        op.record(subject=link.subject, detail={"portal_link": link.pk})


def _claims(token: Any) -> dict | None:
    if not isinstance(token, str) or len(token) > 2000:
        return None
    try:
        claims = signing.loads(token, salt=LINK_SALT)
    except signing.BadSignature:
        return None
    shape = {"t": int, "s": str, "n": str, "e": int}
    if not isinstance(claims, dict) or set(claims) != set(shape):
        return None
    if not all(isinstance(claims[k], t) and not isinstance(claims[k], bool) for k, t in shape.items()):
        return None
    return claims


def _refuse(tenant: Tenant | None, actor: Actor, reason: str, *, subject: str = "", link=None) -> None:
    # Its own transaction: the open fails, the record of the attempt stays.
    with audited_operation(tenant=tenant, actor=actor, action="portal.open") as op:
        op.record(
            outcome=Outcome.INVALID if reason == "altered" else Outcome.DENIED,
            subject=subject,
            detail={"code": f"link_{reason}", "portal_link": link.pk if link else None},
        )
    raise LinkRefused(reason, link)


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
