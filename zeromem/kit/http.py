"""Facts about an HTTP request that every surface reads the same way."""

from __future__ import annotations

from django.conf import settings


def client_ip(request) -> str | None:
    proxies = settings.ZEROMEM_NUM_PROXIES
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR")
    if proxies and forwarded:
        hops = [h.strip() for h in forwarded.split(",")]
        return hops[-min(proxies, len(hops))] or None
    return request.META.get("REMOTE_ADDR") or None
