"""What an actor may do: API-key scopes, staff roles, and the one table that joins them.

An API key carries scopes. A staff user holds a :class:`Role` in a tenant; the role's scopes
(``ROLE_SCOPES``) are what the services check for them, exactly as for a key, and the
admin's page-level capabilities (``CAPABILITIES``) say which pages a role may open.
"""

from __future__ import annotations

from django.db import models


class Scope(models.TextChoices):
    MEMORY_READ = "memory:read"
    MEMORY_WRITE = "memory:write"
    MEMORY_DELETE = "memory:delete"
    MEMORY_SEARCH = "memory:search"
    FORGET_CREATE = "forget:create"
    AUDIT_READ = "audit:read"


ALL_SCOPES = [s.value for s in Scope]
DEFAULT_AGENT_SCOPES = [Scope.MEMORY_READ, Scope.MEMORY_WRITE, Scope.MEMORY_DELETE, Scope.MEMORY_SEARCH]


class Role(models.TextChoices):
    """A staff user's role in one tenant (a superuser acts as ``admin`` everywhere)."""

    VIEWER = "viewer"
    SUPPORT = "support"
    ADMIN = "admin"
    COMPLIANCE = "compliance"


# What each role may do, as the scopes its Actor carries. Compliance reviewers hold no
# memory:read: the services refuse them every value, whatever page asks.
ROLE_SCOPES: dict[str, frozenset[str]] = {
    Role.VIEWER: frozenset({Scope.MEMORY_READ, Scope.MEMORY_SEARCH}),
    Role.SUPPORT: frozenset(
        {Scope.MEMORY_READ, Scope.MEMORY_WRITE, Scope.MEMORY_DELETE, Scope.MEMORY_SEARCH, Scope.FORGET_CREATE}
    ),
    Role.COMPLIANCE: frozenset({Scope.AUDIT_READ, Scope.FORGET_CREATE}),
    Role.ADMIN: frozenset(
        {
            Scope.MEMORY_READ,
            Scope.MEMORY_WRITE,
            Scope.MEMORY_DELETE,
            Scope.MEMORY_SEARCH,
            Scope.FORGET_CREATE,
            Scope.AUDIT_READ,
        }
    ),
}
