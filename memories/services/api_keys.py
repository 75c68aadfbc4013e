"""API key verification: one path for every surface that takes ``Bearer zm_…`` (the REST
and tool endpoints through DRF, the MCP endpoint through the SDK's token verifier).

A key resolves to itself and its tenant from the process's cache of keys verified lately
(:mod:`memories.services.key_cache`), else in one indexed query. Every failure is audited
with only the public part of the key (never the secret) and throttled per client address
and key prefix first (:func:`audit.services.audit_auth_failure`, which raises
:class:`audit.services.AuthThrottled` past the limit and then writes nothing).
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS
from django.utils import timezone

from audit import limits
from audit.services import audit_auth_failure
from memories.models import API_KEY_PREFIX, ApiKey, Tenant, hash_api_key
from memories.services import key_cache
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import TenantBusy, Unauthenticated
from zeromem.kernel.outcomes import ActorKind

# last_used_at is refreshed at most this often, so a busy key costs no write per request.
LAST_USED_RESOLUTION = timedelta(seconds=60)

# Only these failures prove the caller holds the key's secret; any other claim of a key
# (its public zm_<lookup> prefix) is unverified and never lands in that tenant's log.
_VERIFIED_FAILURES = frozenset({"key_revoked", "key_expired"})


def key_actor(key: ApiKey, *, surface: str, request_id: str = "", client_ip: str | None = None) -> Actor:
    """The actor of a verified API key (REST and tool calls, MCP): its scopes and allowlist."""
    return Actor(
        kind=ActorKind.API_KEY,
        id=str(key.pk),
        label=key.display_prefix,
        scopes=frozenset(key.scopes),
        allowed_prefixes=tuple(key.allowed_prefixes),
        surface=surface,
        request_id=request_id,
        client_ip=client_ip,
    )


def auth_failure(
    *,
    code: str,
    tenant: Tenant | None = None,
    label: str = "",
    route: str,
    surface: str,
    client_ip: str | None,
    request_id: str = "",
) -> None:
    """Record (throttled first) a failed authentication on ``route`` (the route pattern,
    not the path the client chose). Raises ``AuthThrottled`` past the per-minute limit."""
    actor = Actor(kind=ActorKind.ANONYMOUS, label=label, surface=surface, request_id=request_id, client_ip=client_ip)
    audit_auth_failure(tenant=tenant if code in _VERIFIED_FAILURES else None, actor=actor, target=route, code=code)


def verify_api_key(raw: str, *, route: str, surface: str, client_ip: str | None, request_id: str = "") -> ApiKey:
    """The live key ``raw`` (``zm_<lookup>_<secret>``) names, its tenant loaded; else
    :class:`Unauthenticated` (``malformed_credentials``, ``invalid_key``, ``key_revoked``,
    ``key_expired``), audited. Cost: none on a cache hit (one UPDATE of ``last_used_at`` a
    minute), else one indexed SELECT."""
    context = {"route": route, "surface": surface, "client_ip": client_ip, "request_id": request_id}
    raw = raw.strip()
    # A control character is in no key, and a NUL cannot reach PostgreSQL (the lookup, the counter).
    if not raw.startswith(API_KEY_PREFIX) or raw.count("_") < 2 or not raw.isprintable():
        auth_failure(code="malformed_credentials", **context)
        raise Unauthenticated("expected 'Authorization: Bearer zm_...'", code="malformed_credentials")
    lookup = raw[len(API_KEY_PREFIX) :].split("_", 1)[0]
    label = f"{API_KEY_PREFIX}{lookup}"[:24]
    key_hash = hash_api_key(raw)
    # A key this process verified lately costs no query (memories/services/key_cache.py:
    # same hash required; revocations reach other processes within its TTL).
    key = key_cache.get(lookup, key_hash)
    cached = key is not None
    if not cached:
        seen = key_cache.generation()
        key = ApiKey.objects.select_related("tenant").filter(lookup=lookup).first()
    if key is None or not hmac.compare_digest(key.key_hash, key_hash):
        auth_failure(code="invalid_key", tenant=key.tenant if key else None, label=label, **context)
        raise Unauthenticated("this API key is not valid", code="invalid_key")
    now = timezone.now()
    if key.revoked_at is not None:
        auth_failure(code="key_revoked", tenant=key.tenant, label=label, **context)
        raise Unauthenticated("this API key has been revoked", code="key_revoked")
    if key.expires_at is not None and key.expires_at <= now:
        auth_failure(code="key_expired", tenant=key.tenant, label=label, **context)
        raise Unauthenticated("this API key has expired", code="key_expired")
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    if not cached:
        key_cache.put(key, seen=seen)
    return key


def rate_limit_take(key: ApiKey, *, cost: int = 1) -> float | None:
    """Take ``cost`` units of ``key``'s rate limit (``ZEROMEM_RATE_LIMIT_PER_MINUTE`` per
    calendar minute, exact across processes: audit/limits.py, Redis when configured, else one
    UPSERT). None within the limit; past it, the seconds until the minute ends. Every surface
    charges through here: REST (``ApiKeyRateThrottle``, a batch one unit per call) and MCP
    (``memories.mcp.server.charge``)."""
    return rate_limit_take_id(key.pk, cost=cost)


@contextmanager
def rate_limit_riding(key: ApiKey) -> Iterator[None]:
    """:func:`rate_limit_take` of one unit for a call whose first statement reads (a tool
    read): the counter goes to the database with that read (``audit.limits.hit_riding``).
    Past the limit, :class:`audit.limits.OverLimit` (its ``hit.retry_after``: the seconds
    until the minute ends) before the call has written anything."""
    with limits.hit_riding(f"key:{key.pk}", limit=settings.ZEROMEM_RATE_LIMIT_PER_MINUTE):
        yield


def rate_limit_take_id(key_id: int, *, cost: int = 1) -> float | None:
    """:func:`rate_limit_take` by the key's id (an API-key actor's ``id``): what a service
    charges for work it finds only as it runs (the Claude memory tool's directory commands)."""
    hit = limits.hit(f"key:{key_id}", cost=cost)
    return None if hit.count <= settings.ZEROMEM_RATE_LIMIT_PER_MINUTE else hit.retry_after


def rate_limit_charge_items(actor: Actor, items: int, *, field: str, message: str) -> None:
    """Work a service finds only as it runs, ``items`` writes for one request (a Claude memory
    tool directory command's files, a LangGraph search's refreshed items): an API key pays one
    unit of its rate limit per item (the request paid the first), as a batch pays per call,
    before any is written. Past the limit: :class:`TenantBusy` ``rate_limited`` naming
    ``field`` with ``message`` (the units stay taken, as a refused request's do). Staff and end
    users are not rate limited. Cost: one counter round trip."""
    if items <= 1 or actor.kind != ActorKind.API_KEY:
        return
    wait = rate_limit_take_id(int(actor.id), cost=items - 1)
    if wait is not None:
        raise TenantBusy(message, code="rate_limited", field=field, retry_after=max(1, math.ceil(wait)))


def key_withdrawn(actor: Actor, tenant_id: int | None = None) -> str | None:
    """Why the API key of ``actor`` no longer holds (``key_revoked``, ``key_expired``; a key
    that is gone: ``invalid_key``), else None — read from the primary, not the cache: what a
    long answer (an export stream) asks before each further page
    (:func:`zeromem.kernel.actors.require_still_held`). Cost: one primary-key SELECT."""
    key = ApiKey.objects.using(DEFAULT_DB_ALIAS).filter(pk=actor.id).values("revoked_at", "expires_at").first()
    if key is None:
        return "invalid_key"
    if key["revoked_at"] is not None:
        return "key_revoked"
    if key["expires_at"] is not None and key["expires_at"] <= timezone.now():
        return "key_expired"
    return None
