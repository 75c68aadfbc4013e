"""Facts about an HTTP request that every surface reads the same way."""

from __future__ import annotations

import re
import uuid

from django.conf import settings

_INCOMING_ID = re.compile(r"[A-Za-z0-9._-]{8,64}")


def client_ip(request) -> str | None:
    return client_ip_of(request.META.get("REMOTE_ADDR"), request.META.get("HTTP_X_FORWARDED_FOR"))


def client_ip_of(remote_addr: str | None, forwarded_for: str | None) -> str | None:
    """The client's address: the peer's, or the ``ZEROMEM_NUM_PROXIES``-th from the right
    of ``X-Forwarded-For`` when that many proxies stand in front (an ASGI surface passes the
    scope's ``client`` and header)."""
    proxies = settings.ZEROMEM_NUM_PROXIES
    if proxies and forwarded_for:
        hops = [h.strip() for h in forwarded_for.split(",")]
        return hops[-min(proxies, len(hops))] or None
    return remote_addr or None


def request_id_for(incoming: str) -> str:
    """A request's id: ours (random), then the client's ``X-Request-ID`` when it is sane
    (8-64 of ``A-Za-z0-9._-``) — kept for their tracing, but it can never collide with (or
    pose as) another request's id in the audit log."""
    ours = uuid.uuid4().hex
    return f"{ours[:16]}.{incoming[:47]}" if _INCOMING_ID.fullmatch(incoming) else ours
