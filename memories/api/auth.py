"""API key authentication, the "has a key" permission and the per-key rate limit.

The key resolves to its tenant here, once per request, in one indexed query
(``ApiKey.lookup`` joined to its tenant); views never look the tenant up themselves.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.throttling import BaseThrottle

from audit.services import audit_auth_failure
from memories.models import API_KEY_PREFIX, ApiKey, Tenant, hash_api_key
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


def _audit_failure(request, *, code: str, tenant: Tenant | None, label: str) -> None:
    actor = Actor(
        kind=ActorKind.ANONYMOUS,
        label=label,
        surface="api",
        request_id=getattr(request, "request_id", ""),
        client_ip=client_ip(request),
    )
    audit_auth_failure(tenant=tenant, actor=actor, target=request.path, code=code)


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
        key = ApiKey.objects.select_related("tenant").filter(lookup=lookup).first()
        if key is None or not hmac.compare_digest(key.key_hash, hash_api_key(raw)):
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
    """Fixed one-minute window per API key, counted in the shared cache (Redis in
    production), so every worker process enforces the same budget. 429 + Retry-After."""

    def allow_request(self, request, view):
        principal = request.user
        if not isinstance(principal, KeyPrincipal):
            return True
        limit = settings.ZEROMEM_RATE_LIMIT_PER_MINUTE
        now = time.time()
        window = int(now // 60)
        bucket = f"zm:rl:{principal.api_key.pk}:{window}"
        # One round trip in the steady state: incr, and only on a window's first request
        # (the key is missing) an add; if another worker added it first, incr again.
        try:
            count = cache.incr(bucket)
        except ValueError:
            count = 1 if cache.add(bucket, 1, timeout=120) else cache.incr(bucket)
        self._wait = (window + 1) * 60 - now
        return count <= limit

    def wait(self):
        return max(1.0, self._wait)


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """Tells the OpenAPI schema (and schemathesis, Swagger UI) how to authenticate."""

    target_class = "memories.api.auth.ApiKeyAuthentication"
    name = "ApiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "zm_<lookup>_<secret>"}
