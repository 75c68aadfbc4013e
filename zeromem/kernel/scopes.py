"""What an actor may do: API-key scopes, staff roles, and the one table that joins them.

An API key carries scopes. A staff user holds a :class:`Role` in a tenant; the role's scopes
(``ROLE_SCOPES``, the one table of what a role may do) are what the services check for them,
exactly as for a key. The admin's page-level capabilities follow from it: each
:class:`Capability` needs some scopes (``CAPABILITY_SCOPES``), and a role has it when its
scopes include them (``CAPABILITIES``, derived, never written by hand).
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
    # The operator's: read the fleet's Prometheus metrics (GET /metrics). Not a tenant's
    # power: only ``manage.py create_api_key`` grants it, never the admin or an API call.
    METRICS_READ = "metrics:read"


ALL_SCOPES = [s.value for s in Scope]
# Scopes that read about the whole deployment rather than one tenant's data.
OPERATOR_SCOPES = frozenset({Scope.METRICS_READ.value})
# What a tenant's admin may grant a key.
TENANT_SCOPES = [s for s in ALL_SCOPES if s not in OPERATOR_SCOPES]
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

# The tenant admin is the one role whose scopes include every other role's.
TENANT_ADMIN_SCOPES = ROLE_SCOPES[Role.ADMIN]


class Capability(models.TextChoices):
    """What a page of the admin lets its user do."""

    TENANT_VIEW = "tenant.view"
    DASHBOARD_VIEW = "dashboard.view"
    MEMORY_VIEW = "memory.view"
    MEMORY_EDIT = "memory.edit"
    FORGET_VIEW = "forget.view"
    FORGET_CREATE = "forget.create"
    AUDIT_VIEW = "audit.view"
    KEYS_MANAGE = "keys.manage"
    MEMBERS_MANAGE = "members.manage"


# The scopes each capability needs. Compliance reviewers, who hold no memory:read, never
# open a page that shows a memory value (list, detail, history, search); no scope at all
# means every member of the tenant.
CAPABILITY_SCOPES: dict[str, frozenset[str]] = {
    Capability.TENANT_VIEW: frozenset(),
    Capability.DASHBOARD_VIEW: frozenset(),
    Capability.MEMORY_VIEW: frozenset({Scope.MEMORY_READ}),
    Capability.MEMORY_EDIT: frozenset({Scope.MEMORY_WRITE}),
    Capability.FORGET_VIEW: frozenset(),
    Capability.FORGET_CREATE: frozenset({Scope.FORGET_CREATE}),
    Capability.AUDIT_VIEW: frozenset({Scope.AUDIT_READ}),
    Capability.KEYS_MANAGE: TENANT_ADMIN_SCOPES,
    Capability.MEMBERS_MANAGE: TENANT_ADMIN_SCOPES,
}

# The roles that have each capability, derived from the two tables above.
CAPABILITIES: dict[str, frozenset[str]] = {
    capability: frozenset(role for role, scopes in ROLE_SCOPES.items() if needed <= scopes)
    for capability, needed in CAPABILITY_SCOPES.items()
}
