"""API key authentication, the "has a key" permission and the per-key rate limit.

The key resolves to its tenant here, once per request — from the process's cache of keys it
verified lately, else in one indexed query (``ApiKey.lookup`` joined to its tenant); views
never look the tenant up themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.throttling import BaseThrottle

from audit.services import AuthThrottled
from memories.models import ApiKey, Tenant
from memories.services import api_keys
from memories.services.api_keys import LAST_USED_RESOLUTION  # noqa: F401 (where last_used_at is refreshed)
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import Unauthenticated
from zeromem.kit.http import client_ip

# The WWW-Authenticate challenge of a 401.
AUTHENTICATE = 'Bearer realm="zeromem"'


@dataclass
class KeyPrincipal:
    """``request.user`` for API calls: the key, its tenant, and the actor built from them."""

    api_key: ApiKey

    is_authenticated = True

    @property
    def tenant(self) -> Tenant:
        return self.api_key.tenant

    def actor_for(self, request, surface: str) -> Actor:
        return api_keys.key_actor(
            self.api_key, surface=surface, request_id=getattr(request, "request_id", ""), client_ip=client_ip(request)
        )


class AuthFailed(exceptions.AuthenticationFailed):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.zeromem_code = code


def _context(request) -> dict:
    match = getattr(request, "resolver_match", None)
    # The route pattern, not the path: the client chooses the path.
    route = f"/{match.route}" if match is not None and match.route else "(unrouted)"
    return {
        "route": route,
        "surface": "api",
        "client_ip": client_ip(request),
        "request_id": getattr(request, "request_id", ""),
    }


def throttled(exc: AuthThrottled) -> exceptions.Throttled:
    return exceptions.Throttled(wait=exc.retry_after, detail="too many failed authentications")


class ApiKeyAuthentication(BaseAuthentication):
    """``Authorization: Bearer zm_<lookup>_<secret>``, verified by the one key service
    (memories/services/api_keys.py). Failures are 401 and audited with only the public part
    of the key (never the secret)."""

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None  # → 401 missing_credentials from the permission check
        scheme, _, raw = header.partition(" ")
        try:
            key = api_keys.verify_api_key(raw if scheme.lower() == "bearer" else "", **_context(request))
        except Unauthenticated as exc:
            raise AuthFailed(exc.code, exc.message) from None
        except AuthThrottled as exc:
            raise throttled(exc) from None
        return KeyPrincipal(api_key=key), key

    def authenticate_header(self, request):
        return AUTHENTICATE


class HasApiKey(BasePermission):
    def has_permission(self, request, view):
        if isinstance(request.user, KeyPrincipal):
            return True
        # No Authorization header at all: audited like every other failed authentication.
        try:
            api_keys.auth_failure(code="missing_credentials", **_context(request))
        except AuthThrottled as exc:
            raise throttled(exc) from None
        raise exceptions.NotAuthenticated("send 'Authorization: Bearer zm_...'")


class ApiKeyRateThrottle(BaseThrottle):
    """Fixed one-minute window per API key, exact across processes (audit/limits.py: Redis
    when configured, else one UPSERT). A view may charge more than one unit per request
    (``rate_cost``: a batch costs one per call). 429 + Retry-After."""

    def allow_request(self, request, view):
        principal = request.user
        if not isinstance(principal, KeyPrincipal):
            return True
        rides = getattr(view, "rate_limit_rides", None)
        if rides is not None and rides(request, principal.api_key):
            return True  # charged by the view's read, with its SELECT (zeromem.kit.api.RidingRateLimit)
        cost = view.rate_cost(request) if hasattr(view, "rate_cost") else 1
        wait = api_keys.rate_limit_take(principal.api_key, cost=cost)
        self._wait = wait or 0.0
        return wait is None

    def wait(self):
        return max(1.0, self._wait)


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """Tells the OpenAPI schema (and schemathesis, Swagger UI) how to authenticate."""

    target_class = "memories.api.auth.ApiKeyAuthentication"
    name = "ApiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "zm_<lookup>_<secret>"}
