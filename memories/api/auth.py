"""API key authentication, the "has a key" permission and the per-key rate limit.

The key resolves to its tenant here, once per request — from the process's cache of keys it
verified lately, else in one indexed query (``ApiKey.lookup`` joined to its tenant); views
never look the tenant up themselves.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.throttling import BaseThrottle

from audit import limits
from audit.services import AuthThrottled, audit_auth_failure
from memories.models import API_KEY_PREFIX, ApiKey, Tenant, hash_api_key
from memories.services import key_cache
from zeromem.kernel.actors import Actor
from zeromem.kernel.outcomes import ActorKind
from zeromem.kit.http import client_ip

# last_used_at is refreshed at most this often, so a busy key costs no write per request.
LAST_USED_RESOLUTION = timedelta(seconds=60)


@dataclass
class KeyPrincipal:
    """``request.user`` for API calls: the key, its tenant, and the actor built from them."""

    api_key: ApiKey

    is_authenticated = True

    @property
    def tenant(self) -> Tenant:
        return self.api_key.tenant

    def actor_for(self, request, surface: str) -> Actor:
        key = self.api_key
        return Actor(
            kind=ActorKind.API_KEY,
            id=str(key.pk),
            label=key.display_prefix,
            scopes=frozenset(key.scopes),
            allowed_prefixes=tuple(key.allowed_prefixes),
            surface=surface,
            request_id=getattr(request, "request_id", ""),
            client_ip=client_ip(request),
        )


class AuthFailed(exceptions.AuthenticationFailed):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.zeromem_code = code


# Only these failures prove the caller holds the key's secret; any other claim of a key
# (its public zm_<lookup> prefix) is unverified and never lands in that tenant's log.
_VERIFIED_FAILURES = frozenset({"key_revoked", "key_expired"})


def _audit_failure(request, *, code: str, tenant: Tenant | None, label: str) -> None:
    actor = Actor(
        kind=ActorKind.ANONYMOUS,
        label=label,
        surface="api",
        request_id=getattr(request, "request_id", ""),
        client_ip=client_ip(request),
    )
    match = getattr(request, "resolver_match", None)
    # The route pattern, not the path: the client chooses the path.
    route = f"/{match.route}" if match is not None and match.route else "(unrouted)"
    try:
        audit_auth_failure(tenant=tenant if code in _VERIFIED_FAILURES else None, actor=actor, target=route, code=code)
    except AuthThrottled as exc:
        raise exceptions.Throttled(wait=exc.retry_after, detail="too many failed authentications") from None


class ApiKeyAuthentication(BaseAuthentication):
    """``Authorization: Bearer zm_<lookup>_<secret>``. Failures are 401 and audited with
    only the public part of the key (never the secret)."""

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None  # → 401 missing_credentials from the permission check
        scheme, _, raw = header.partition(" ")
        raw = raw.strip()
        if scheme.lower() != "bearer" or not raw.startswith(API_KEY_PREFIX) or raw.count("_") < 2:
            _audit_failure(request, code="malformed_credentials", tenant=None, label="")
            raise AuthFailed("malformed_credentials", "expected 'Authorization: Bearer zm_...'")
        lookup = raw[len(API_KEY_PREFIX) :].split("_", 1)[0]
        label = f"{API_KEY_PREFIX}{lookup}"[:24]
        key_hash = hash_api_key(raw)
        # A key this process verified lately costs no query (memories/services/key_cache.py:
        # same hash required; revocations reach other processes within its TTL).
        key = key_cache.get(lookup, key_hash)
        cached = key is not None
        if not cached:
            key = ApiKey.objects.select_related("tenant").filter(lookup=lookup).first()
        if key is None or not hmac.compare_digest(key.key_hash, key_hash):
            _audit_failure(request, code="invalid_key", tenant=key.tenant if key else None, label=label)
            raise AuthFailed("invalid_key", "this API key is not valid")
        now = timezone.now()
        if key.revoked_at is not None:
            _audit_failure(request, code="key_revoked", tenant=key.tenant, label=label)
            raise AuthFailed("key_revoked", "this API key has been revoked")
        if key.expires_at is not None and key.expires_at <= now:
            _audit_failure(request, code="key_expired", tenant=key.tenant, label=label)
            raise AuthFailed("key_expired", "this API key has expired")
        if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
            ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
            key.last_used_at = now
        if not cached:
            key_cache.put(key)
        return KeyPrincipal(api_key=key), key

    def authenticate_header(self, request):
        return 'Bearer realm="zeromem"'


class HasApiKey(BasePermission):
    def has_permission(self, request, view):
        if isinstance(request.user, KeyPrincipal):
            return True
        # No Authorization header at all: audited like every other failed authentication.
        _audit_failure(request, code="missing_credentials", tenant=None, label="")
        raise exceptions.NotAuthenticated("send 'Authorization: Bearer zm_...'")


class ApiKeyRateThrottle(BaseThrottle):
    """Fixed one-minute window per API key, exact across processes (audit/limits.py: Redis
    when configured, else one UPSERT). A view may charge more than one unit per request
    (``rate_cost``: a batch costs one per call). 429 + Retry-After."""

    def allow_request(self, request, view):
        principal = request.user
        if not isinstance(principal, KeyPrincipal):
            return True
        cost = view.rate_cost(request) if hasattr(view, "rate_cost") else 1
        hit = limits.hit(f"key:{principal.api_key.pk}", cost=cost, now=time.time())
        self._wait = hit.retry_after
        return hit.count <= settings.ZEROMEM_RATE_LIMIT_PER_MINUTE

    def wait(self):
        return max(1.0, self._wait)


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """Tells the OpenAPI schema (and schemathesis, Swagger UI) how to authenticate."""

    target_class = "memories.api.auth.ApiKeyAuthentication"
    name = "ApiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "zm_<lookup>_<secret>"}
