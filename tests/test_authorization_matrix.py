"""Authorization matrix: every API route × every HTTP method × every identity.

The routes are not listed by hand: they are read from the URL resolver
(``get_resolver().url_patterns``, walked recursively), and ``ROUTES`` below only says what
each one is. A route the table does not classify fails ``test_every_route_is_classified``
(and a table row whose route is gone fails it too), so a new endpoint cannot ship without
its row. Admin routes (``/admin/...``) are the admin matrix's, with staff users of each
role and of another tenant (tests/test_authorization_matrix_admin.py); an admin route that
matrix does not classify fails the same test.

Identities (built once for the module by the ``identities`` fixture, inside a transaction
rolled back at the end; each cell runs in its own nested, rolled-back transaction):

* ``owner``        – tenant A's key with every scope;
* ``wrong_scope``  – tenant A's key holding every scope *except* the one the cell needs
                     (no scope at all where a route needs none);
* ``not_allowed``  – tenant A's key, every scope, allowlist ``["agent:"]``, which excludes
                     the target key ``user:u10086:pref_lang``;
* ``other_tenant`` – tenant B's key with every scope;
* ``revoked``, ``expired`` – tenant A keys with every scope, revoked / past expiry;
* ``no_key``       – no Authorization header;
* ``malformed``    – ``Authorization: Bearer <not a zm_ key>``.

Methods: GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS on every route. POST on
``tools/call`` and ``tools/batch`` is split into one row per tool (memory_write, _read,
_update, _delete, _list, _search, _recall), each run with sensible arguments.

Matrix size when written: 10 routes × 7 methods × 8 identities = 560 combinations; with
the 2 tool-endpoint POSTs split into 7 tools each, 82 rows × 8 identities = **656 cells**
(``test_matrix[<route>-<METHOD>[-<tool>]-<identity>]``).
``test_matrix_size`` prints the current numbers (``pytest -s``).

The end-user portal's pages (``portal/...``, HTML) have their own identities — valid link,
another tenant's link, expired, altered, replayed, none — and their own table
(``PORTAL_ROUTES``, ``test_portal_matrix``, at the end of this file).

Every cell checks, besides its expected status (and error code / tool result):

* no 5xx;
* another tenant's object answers exactly as a key that exists nowhere (404 / ``not_found``
  / a fresh create in the caller's own tenant), never 403 or 200 with the owner's data;
* no canary value of data the identity may not see appears in the response body
  (tenant A's target, tenant A's ``agent:`` memory, tenant B's memory);
* tenant A's memories are unchanged after a non-owner's request (key, value, version,
  deleted_at, and the target's access count); refused requests change no row anywhere;
* another tenant's request writes no audit event into tenant A's log;
* a refused request carries no ETag (it names a row id and version);
* list / search / recall return exactly the rows the identity may see (and the owner's
  canary for the owner: a positive control that the search would find it).
"""

from __future__ import annotations

import csv
import io
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from unittest import mock
from urllib.parse import urlencode

import pytest
from django.conf import settings
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone

from audit.models import AuditEvent
from memories import services, tools
from memories.models import Memory, MemoryVersion
from tests.factories import SYSTEM, KeyedClient, make_key, make_tenant
from tests.helpers import rolled_back_module_data
from zeromem.kernel.scopes import ALL_SCOPES, Scope

# --- the data every cell starts from --------------------------------------------------------

CANARY_A = "CANARY-acme-7f3a91c2"  # in tenant A's target memory: only the owner may see it
CANARY_AGENT = "CANARY-agent-51be0d47"  # in tenant A's agent: memory (inside not_allowed's allowlist)
CANARY_B = "CANARY-globex-c09e6a18"  # in tenant B's memory: only other_tenant may see it
# Forget requests' reasons: tenant A's (made by SYSTEM: only the owner's full key lists it)
# and tenant B's (only tenant B's key).
CANARY_FR_A = "CANARY-forget-acme-4d2e90"
CANARY_FR_B = "CANARY-forget-globex-8a1b37"
ALL_CANARIES = (CANARY_A, CANARY_AGENT, CANARY_B, CANARY_FR_A, CANARY_FR_B)

TARGET = "user:u10086:pref_lang"  # tenant A's memory every keyed cell aims at
AGENT_KEY = "agent:a1:pref_lang"  # tenant A, inside the not_allowed key's allowlist
B_KEY = "user:u20002:pref_lang"  # tenant B's own memory
GHOST = "user:u99999:pref_lang"  # exists in no tenant: what "not found" looks like
ATTACK = "written-by-the-caller"  # the value write/update cells send (never a canary)
ATTACK_OBJECT = {"v": ATTACK}  # what a LangGraph put sends (its values are JSON objects)
QUERY = "which language does the user prefer?"

SEED = {
    "owner": {
        TARGET: f"{CANARY_A} the user prefer language Klingon",
        AGENT_KEY: f"{CANARY_AGENT} agent prefer language Python",
    },
    "other": {B_KEY: f"{CANARY_B} the user prefer language Esperanto"},
}

# What each identity may see: the keys a list returns, and the canaries it may read.
VISIBLE_KEYS = {"owner": [AGENT_KEY, TARGET], "not_allowed": [AGENT_KEY], "other_tenant": [B_KEY]}
VISIBLE_CANARIES = {
    "owner": {CANARY_A, CANARY_AGENT, CANARY_FR_A},
    "not_allowed": {CANARY_AGENT},
    "other_tenant": {CANARY_B, CANARY_FR_B},
}
# The forget requests each identity lists (names of Identities attributes, ids set when built).
VISIBLE_REQUESTS = {"owner": ["request_a"], "not_allowed": [], "other_tenant": ["request_b"]}

IDENTITIES = ("owner", "wrong_scope", "not_allowed", "other_tenant", "revoked", "expired", "no_key", "malformed")
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

# --- expected outcomes ---------------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    status: int
    code: str | None = None  # error.code of a refused request
    result: str | None = None  # tool-level "status" of a tool call that ran ("ok", "not_found")
    check: str | None = None  # extra body check, see _check_body
    # What the request may change: None = nothing anywhere; "update"/"delete" = the owner's
    # target; "create_own" = the caller's own tenant gains the key (tenant A unchanged).
    writes: str | None = None


BAD_CREDENTIALS = {
    "revoked": Expect(401, "key_revoked"),
    "expired": Expect(401, "key_expired"),
    "no_key": Expect(401, "missing_credentials"),
    "malformed": Expect(401, "malformed_credentials"),
}


def _keyed(owner: Expect, wrong_scope: Expect, not_allowed: Expect, other_tenant: Expect) -> dict[str, Expect]:
    return {
        "owner": owner,
        "wrong_scope": wrong_scope,
        "not_allowed": not_allowed,
        "other_tenant": other_tenant,
        **BAD_CREDENTIALS,
    }


def _every(expect: Expect) -> dict[str, Expect]:
    return dict.fromkeys(IDENTITIES, expect)


MISSING_SCOPE = Expect(403, "missing_scope")
NOT_ALLOWED = Expect(403, "key_not_allowed")
NOT_FOUND = Expect(404, "not_found")
METHOD_NOT_ALLOWED = Expect(405, "method_not_allowed")

# kind of operation → identity → expected outcome. Routes map their methods to these kinds.
OUTCOMES: dict[str, dict[str, Expect]] = {
    # public, read-only: health check, OpenAPI schema and docs hold no tenant data
    "public": _every(Expect(200)),
    "public_405": _every(METHOD_NOT_ALLOWED),
    # authenticated routes: bad credentials are 401 before anything else, even the method check
    "405": _keyed(METHOD_NOT_ALLOWED, METHOD_NOT_ALLOWED, METHOD_NOT_ALLOWED, METHOD_NOT_ALLOWED),
    "options": _keyed(Expect(200), Expect(200), Expect(200), Expect(200)),
    "tool_schemas": _keyed(Expect(200), Expect(200), Expect(200), Expect(200)),
    # REST resources
    "rest_read": _keyed(Expect(200, check="sees_target"), MISSING_SCOPE, NOT_ALLOWED, NOT_FOUND),
    "rest_put": _keyed(Expect(200, writes="update"), MISSING_SCOPE, NOT_ALLOWED, Expect(201, writes="create_own")),
    "rest_patch": _keyed(Expect(200, writes="update"), MISSING_SCOPE, NOT_ALLOWED, NOT_FOUND),
    "rest_delete": _keyed(Expect(204, writes="delete"), MISSING_SCOPE, NOT_ALLOWED, NOT_FOUND),
    "rest_list": _keyed(
        Expect(200, check="lists_visible"),
        MISSING_SCOPE,
        Expect(200, check="lists_visible"),
        Expect(200, check="lists_visible"),
    ),
    # tools (tools/call; tools/batch derives its outcomes from these, see _batch_expect)
    "tool_write": _keyed(
        Expect(200, result="ok", writes="update"),
        MISSING_SCOPE,
        NOT_ALLOWED,
        Expect(200, result="ok", writes="create_own"),
    ),
    "tool_read": _keyed(
        Expect(200, result="ok", check="sees_target"), MISSING_SCOPE, NOT_ALLOWED, Expect(200, result="not_found")
    ),
    "tool_update": _keyed(
        Expect(200, result="ok", writes="update"), MISSING_SCOPE, NOT_ALLOWED, Expect(200, result="not_found")
    ),
    "tool_delete": _keyed(
        Expect(200, result="ok", writes="delete"), MISSING_SCOPE, NOT_ALLOWED, Expect(200, result="not_found")
    ),
    "tool_list": _keyed(
        *(
            Expect(200, result="ok", check="lists_visible") if i != "wrong_scope" else MISSING_SCOPE
            for i in ("owner", "wrong_scope", "not_allowed", "other_tenant")
        )
    ),
    "tool_search": _keyed(
        *(
            Expect(200, result="ok", check="finds_visible") if i != "wrong_scope" else MISSING_SCOPE
            for i in ("owner", "wrong_scope", "not_allowed", "other_tenant")
        )
    ),
    "tool_recall": _keyed(
        *(
            Expect(200, result="ok", check="recalls_visible") if i != "wrong_scope" else MISSING_SCOPE
            for i in ("owner", "wrong_scope", "not_allowed", "other_tenant")
        )
    ),
}

# Summaries and jobs. A summarize call only queues a job (its work runs after commit, which
# these rolled-back cells never reach): another tenant's call queues a job in its own tenant.
OUTCOMES["rest_summarize"] = _keyed(Expect(202), MISSING_SCOPE, NOT_ALLOWED, Expect(202))
OUTCOMES["tool_summarize"] = _keyed(Expect(200, result="ok"), MISSING_SCOPE, NOT_ALLOWED, Expect(200, result="ok"))
# The owner's job summarizes user:u10086: (outside not_allowed's allowlist): not found for
# not_allowed and for another tenant, like a job that does not exist.
OUTCOMES["job_read"] = _keyed(Expect(200, check="sees_job"), MISSING_SCOPE, NOT_FOUND, NOT_FOUND)

# Forget requests. Creating one only stores and queues it (the job runs after commit, which
# these rolled-back cells never reach, so no memory changes); another tenant's request is
# stored in its own tenant. The owner's request (keys [TARGET]) was made by SYSTEM: a key
# limited to other prefixes sees only its own requests, another tenant none of A's.
OUTCOMES["forget_create"] = _keyed(Expect(202), MISSING_SCOPE, NOT_ALLOWED, Expect(202))
OUTCOMES["forget_list"] = _keyed(
    Expect(200, check="lists_requests"),
    MISSING_SCOPE,
    Expect(200, check="lists_requests"),
    Expect(200, check="lists_requests"),
)
OUTCOMES["forget_read"] = _keyed(Expect(200, check="sees_request"), MISSING_SCOPE, NOT_FOUND, NOT_FOUND)

# The audit log. A key limited to some prefixes reads only the events about keys under them;
# another tenant reads its own log. A checkpoint covers the whole log: refused to a limited key.
OUTCOMES["audit_list"] = _keyed(
    *(
        Expect(200, check="audit_visible") if i != "wrong_scope" else MISSING_SCOPE
        for i in ("owner", "wrong_scope", "not_allowed", "other_tenant")
    )
)
OUTCOMES["audit_export"] = _keyed(
    *(
        Expect(200, check="export_visible") if i != "wrong_scope" else MISSING_SCOPE
        for i in ("owner", "wrong_scope", "not_allowed", "other_tenant")
    )
)
OUTCOMES["audit_checkpoint"] = _keyed(Expect(201), MISSING_SCOPE, NOT_ALLOWED, Expect(201))
# Portal links. A link is issued for a subject of the key's own tenant: another tenant's key
# gets a link to its own u10086 (which sees none of tenant A: test_portal_matrix below); a
# key limited to some prefixes gets none (the portal shows the whole subject).
# Claude's memory tool: a view of /memories/pref_lang under the root user:u10086 is a read of
# the target (another tenant finds no such file: a tool error result, 200).
OUTCOMES["anthropic_memory"] = _keyed(Expect(200, check="sees_target"), MISSING_SCOPE, NOT_ALLOWED, Expect(200))
OUTCOMES["portal_link"] = _keyed(Expect(201, check="portal_link"), MISSING_SCOPE, NOT_ALLOWED, Expect(201))
# The deployment's metrics: the operator scope; nothing in them is a tenant's (the canary
# checks hold), so another tenant's key with the scope reads the same; a limited key none.
OUTCOMES["metrics"] = _keyed(Expect(200), MISSING_SCOPE, NOT_ALLOWED, Expect(200))

# LangGraph's store. A put is a write (another tenant creates its own item), a delete of an
# item that is not there is no error (204, nothing changes), a search or a namespace
# listing shows only what the identity may see.
OUTCOMES["lg_get"] = _keyed(Expect(200, check="sees_target"), MISSING_SCOPE, NOT_ALLOWED, NOT_FOUND)
OUTCOMES["lg_put"] = _keyed(Expect(204, writes="update"), MISSING_SCOPE, NOT_ALLOWED, Expect(204, writes="create_own"))
OUTCOMES["lg_delete"] = _keyed(Expect(204, writes="delete"), MISSING_SCOPE, NOT_ALLOWED, Expect(204))
OUTCOMES["lg_search"] = _keyed(
    *(Expect(200, check="lg_visible") if i != "wrong_scope" else MISSING_SCOPE for i in IDENTITIES[:4])
)
OUTCOMES["lg_namespaces"] = _keyed(
    *(Expect(200, check="lg_namespaces_visible") if i != "wrong_scope" else MISSING_SCOPE for i in IDENTITIES[:4])
)
# Withdrawing a subject's links: the same rights as issuing one; another tenant withdraws its own.
OUTCOMES["portal_revoke"] = _keyed(Expect(200), MISSING_SCOPE, NOT_ALLOWED, Expect(200))

# The scope a kind needs (what the wrong_scope key lacks); None: any key will do.
NEEDED_SCOPE = {
    "rest_read": Scope.MEMORY_READ,
    "rest_list": Scope.MEMORY_READ,
    "rest_put": Scope.MEMORY_WRITE,
    "rest_patch": Scope.MEMORY_WRITE,
    "rest_delete": Scope.MEMORY_DELETE,
    "tool_read": Scope.MEMORY_READ,
    "tool_list": Scope.MEMORY_READ,
    "tool_write": Scope.MEMORY_WRITE,
    "tool_update": Scope.MEMORY_WRITE,
    "tool_delete": Scope.MEMORY_DELETE,
    "tool_search": Scope.MEMORY_SEARCH,
    "tool_recall": Scope.MEMORY_SEARCH,
    "rest_summarize": Scope.MEMORY_WRITE,
    "tool_summarize": Scope.MEMORY_WRITE,
    "job_read": Scope.MEMORY_READ,
    "forget_create": Scope.FORGET_CREATE,
    "forget_list": Scope.FORGET_CREATE,
    "forget_read": Scope.FORGET_CREATE,
    "audit_list": Scope.AUDIT_READ,
    "audit_export": Scope.AUDIT_READ,
    "audit_checkpoint": Scope.AUDIT_READ,
    "portal_link": Scope.FORGET_CREATE,
    "metrics": Scope.METRICS_READ,
    "lg_get": Scope.MEMORY_READ,
    "lg_put": Scope.MEMORY_WRITE,
    "lg_delete": Scope.MEMORY_DELETE,
    "lg_search": Scope.MEMORY_READ,
    "lg_namespaces": Scope.MEMORY_READ,
    "anthropic_memory": Scope.MEMORY_READ,
    "portal_revoke": Scope.FORGET_CREATE,
}

# Kinds that address one key: another tenant must get what a key that exists nowhere gets.
KEYED_KINDS = {
    "rest_read",
    "rest_put",
    "rest_patch",
    "rest_delete",
    "tool_read",
    "tool_write",
    "tool_update",
    "tool_delete",
    "lg_get",
    "lg_put",
    "lg_delete",
}

# Every tool: its kind and the arguments its row sends.
TOOL_ROWS: dict[str, tuple[str, dict]] = {
    "memory_write": ("tool_write", {"key": TARGET, "value": ATTACK}),
    "memory_read": ("tool_read", {"key": TARGET}),
    "memory_update": ("tool_update", {"key": TARGET, "value": ATTACK}),
    "memory_delete": ("tool_delete", {"key": TARGET}),
    "memory_list": ("tool_list", {"prefix": "", "limit": 50}),
    "memory_search": ("tool_search", {"query": QUERY, "limit": 20}),
    "memory_recall": ("tool_recall", {"query": QUERY, "max_chars": 2000}),
    "memory_summarize": ("tool_summarize", {"prefix": "user:u10086:"}),
}
TOOLS_POST = "tools"  # marker: POST runs one row per tool


# --- the route table -----------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    public: bool  # answers without a key (and ignores one)
    ops: dict[str, str] = field(default_factory=dict)  # method → kind; others are 405

    def kind(self, method: str) -> str:
        return self.ops.get(method, "public_405" if self.public else "405")


_READ_ONLY_PUBLIC = {"GET": "public", "HEAD": "public"}

# Route pattern exactly as the resolver spells it → what it is.
ROUTES: dict[str, Route] = {
    "healthz": Route(public=True, ops={"GET": "public", "HEAD": "public"}),
    "metrics": Route(public=False, ops={"GET": "metrics", "HEAD": "metrics"}),
    "api/v1/schema": Route(public=True, ops=_READ_ONLY_PUBLIC),
    "api/v1/docs": Route(public=True, ops=_READ_ONLY_PUBLIC),
    "api/v1/redoc": Route(public=True, ops=_READ_ONLY_PUBLIC),
    "api/v1/tools": Route(public=False, ops={"GET": "tool_schemas", "HEAD": "tool_schemas", "OPTIONS": "options"}),
    "api/v1/tools/call": Route(public=False, ops={"POST": TOOLS_POST, "OPTIONS": "options"}),
    "api/v1/tools/batch": Route(public=False, ops={"POST": TOOLS_POST, "OPTIONS": "options"}),
    "api/v1/memories": Route(public=False, ops={"GET": "rest_list", "HEAD": "rest_list", "OPTIONS": "options"}),
    "api/v1/memories/<str:key>": Route(
        public=False,
        ops={
            "GET": "rest_read",
            "HEAD": "rest_read",
            "PUT": "rest_put",
            "PATCH": "rest_patch",
            "DELETE": "rest_delete",
            "OPTIONS": "options",
        },
    ),
    "api/v1/memories/<str:key>/history": Route(
        public=False, ops={"GET": "rest_read", "HEAD": "rest_read", "OPTIONS": "options"}
    ),
    "api/v1/summaries": Route(public=False, ops={"POST": "rest_summarize", "OPTIONS": "options"}),
    "api/v1/jobs/<str:job_id>": Route(public=False, ops={"GET": "job_read", "HEAD": "job_read", "OPTIONS": "options"}),
    "api/v1/forget-requests": Route(
        public=False,
        ops={"GET": "forget_list", "HEAD": "forget_list", "POST": "forget_create", "OPTIONS": "options"},
    ),
    "api/v1/forget-requests/<str:request_id>": Route(
        public=False, ops={"GET": "forget_read", "HEAD": "forget_read", "OPTIONS": "options"}
    ),
    "api/v1/audit-events": Route(public=False, ops={"GET": "audit_list", "HEAD": "audit_list", "OPTIONS": "options"}),
    "api/v1/audit-events/export": Route(
        public=False, ops={"GET": "audit_export", "HEAD": "audit_export", "OPTIONS": "options"}
    ),
    "api/v1/audit-checkpoints": Route(public=False, ops={"POST": "audit_checkpoint", "OPTIONS": "options"}),
    "api/v1/subjects/<str:subject>/portal-link": Route(
        public=False, ops={"POST": "portal_link", "DELETE": "portal_revoke", "OPTIONS": "options"}
    ),
    # LangGraph's store (the cells run with ZEROMEM_LANGGRAPH_PREFIX="user": namespace
    # ["u10086"] and key "pref_lang" is the target memory itself).
    "api/v1/langgraph/store/items": Route(
        public=False,
        ops={"GET": "lg_get", "HEAD": "lg_get", "PUT": "lg_put", "DELETE": "lg_delete", "OPTIONS": "options"},
    ),
    "api/v1/langgraph/store/items/search": Route(public=False, ops={"POST": "lg_search", "OPTIONS": "options"}),
    "api/v1/langgraph/store/namespaces": Route(public=False, ops={"POST": "lg_namespaces", "OPTIONS": "options"}),
    "api/v1/anthropic/memory": Route(public=False, ops={"POST": "anthropic_memory", "OPTIONS": "options"}),
}
LANGGRAPH_ROUTES = {r for r in ROUTES if r.startswith("api/v1/langgraph/")}

# The end-user portal's pages (HTML; the link or its session cookie is the identity): their
# own matrix, test_portal_matrix below. Method → kind; the other methods are 405.
PORTAL_ROUTES: dict[str, dict[str, str]] = {
    "portal/": {"GET": "portal_home", "HEAD": "portal_home"},
    "portal/open/<str:token>": {"GET": "portal_look", "HEAD": "portal_look", "POST": "portal_open"},
    "portal/forget": {"POST": "portal_forget"},
    "portal/requests/<str:request_id>": {"GET": "portal_request", "HEAD": "portal_request"},
    "portal/sign-out": {"POST": "portal_sign_out"},
}

# Values for URL parameters: every <key> names tenant A's target memory.
URL_PARAMETERS = {"key": TARGET, "job_id": 0}  # job_id: the owner's job, set by Identities
URL_PARAMETERS["request_id"] = 0  # the owner's forget request, set by Identities
URL_PARAMETERS["subject"] = "u10086"  # the target's subject

# Bodies of the POST routes that are not tool calls (others send {"value": ATTACK}).
ROUTE_BODIES = {"api/v1/summaries": {"prefix": "user:u10086:"}}
ROUTE_BODIES["api/v1/forget-requests"] = {"keys": [TARGET], "reason": "matrix"}
ROUTE_BODIES["api/v1/subjects/<str:subject>/portal-link"] = {}
ROUTE_BODIES["api/v1/anthropic/memory"] = {"command": "view", "path": "/memories/pref_lang"}
# Query strings of routes that take one (every method).
ROUTE_QUERIES = {"api/v1/anthropic/memory": "?root=user:u10086"}


@dataclass(frozen=True)
class ResolvedRoute:
    route: str  # "api/v1/memories/<str:key>"
    name: str | None  # "memories-detail" (namespaced when included with a namespace)
    converters: tuple[str, ...]


def walk(patterns, prefix: str = "", namespace: str = "") -> Iterator[ResolvedRoute]:
    for p in patterns:
        route = prefix + str(p.pattern)
        if isinstance(p, URLResolver):
            ns = f"{namespace}{p.namespace}:" if p.namespace else namespace
            yield from walk(p.url_patterns, route, ns)
        elif isinstance(p, URLPattern):
            converters = tuple(getattr(p.pattern, "converters", {}))
            yield ResolvedRoute(route, f"{namespace}{p.name}" if p.name else None, converters)
        else:  # pragma: no cover - a new kind of pattern must be understood first
            raise AssertionError(f"unknown URL pattern type {type(p)!r} at {route!r}")


def classify(r: ResolvedRoute) -> str | None:
    """'api' for a route of this matrix, 'admin' for an admin route that the admin matrix
    (tests/test_authorization_matrix_admin.py) classifies, None if unclassified."""
    if r.route in ROUTES:
        return "api"
    if r.route in PORTAL_ROUTES:
        return "portal"
    if r.route.startswith("admin/"):
        from tests.test_authorization_matrix_admin import admin_route_kind

        return "admin" if admin_route_kind(r) else None
    return None


ALL_ROUTES = list(walk(get_resolver().url_patterns))
API_ROUTES = [r for r in ALL_ROUTES if classify(r) == "api"]


def _route_id(r: ResolvedRoute) -> str:
    return (r.name or r.route).rsplit(":", 1)[-1]


@dataclass(frozen=True)
class Row:
    route: ResolvedRoute
    method: str
    kind: str
    tool: str | None = None

    @property
    def id(self) -> str:
        return f"{_route_id(self.route)}-{self.method}" + (f"-{self.tool}" if self.tool else "")


def _rows() -> list[Row]:
    rows = []
    for r in API_ROUTES:
        spec = ROUTES[r.route]
        for method in METHODS:
            kind = spec.kind(method)
            if kind == TOOLS_POST:
                rows.extend(Row(r, method, TOOL_ROWS[t][0], t) for t in TOOL_ROWS)
            else:
                rows.append(Row(r, method, kind))
    return rows


ROWS = _rows()
CELLS = [pytest.param(row, identity, id=f"{row.id}-{identity}") for row in ROWS for identity in IDENTITIES]


# --- the identities ------------------------------------------------------------------------

# One test client for every cell: a new Client builds a new handler, and with
# SERVESTATIC_USE_FINDERS (development) each new handler scans every static file (~40 ms).
SHARED_CLIENT = Client()


class Identities:
    """The two tenants with their seed memories, and a client for each identity."""

    def __init__(self):
        self.a = make_tenant("matrix-owner")
        self.b = make_tenant("matrix-other")
        for tenant, seed in ((self.a, SEED["owner"]), (self.b, SEED["other"])):
            for key, value in seed.items():
                services.memory_write(tenant=tenant, actor=SYSTEM, key=key, value=value)
        # The job every jobs/<job_id> cell asks for: tenant A's, about the target's namespace.
        # Jobs and forget requests are named by their uid (tests/test_opaque_ids.py).
        job = services.summarize_start(tenant=self.a, actor=SYSTEM, prefix="user:u10086:")
        URL_PARAMETERS["job_id"] = str(job.uid)
        # The forget request every forget-requests/<request_id> cell asks for: tenant A's.
        self.request_a = str(
            services.forget_request_create(tenant=self.a, actor=SYSTEM, keys=[TARGET], reason=CANARY_FR_A).uid
        )
        URL_PARAMETERS["request_id"] = self.request_a
        # Tenant B's: a leak marker for every forget-request cell of tenant A's identities.
        self.request_b = str(
            services.forget_request_create(tenant=self.b, actor=SYSTEM, keys=[B_KEY], reason=CANARY_FR_B).uid
        )
        self.job_a = URL_PARAMETERS["job_id"]
        self._clients = {
            "owner": self._keyed(self.a),
            "not_allowed": self._keyed(self.a, allow=["agent:"]),
            "other_tenant": self._keyed(self.b),
            "revoked": self._keyed(self.a, revoked=True),
            "expired": self._keyed(self.a, expires_at=timezone.now() - timedelta(seconds=1)),
            "no_key": KeyedClient(None, None, SHARED_CLIENT),
            "malformed": KeyedClient("definitely-not-a-zeromem-key", None, SHARED_CLIENT),
        }
        # Every scope but the one a cell needs; no scope at all where a route needs none.
        self._wrong_scope = {
            scope: self._keyed(self.a, scopes=[s for s in ALL_SCOPES if s != scope])
            for scope in set(NEEDED_SCOPE.values())
        }
        self._wrong_scope[None] = self._keyed(self.a, scopes=[])

    def _keyed(self, tenant, *, scopes=None, allow=None, revoked=False, expires_at=None) -> KeyedClient:
        key, raw = make_key(tenant, scopes=scopes, allow=allow)
        if revoked:
            services.api_key_revoke(tenant=tenant, actor=SYSTEM, key_id=key.pk)
        if expires_at is not None:
            key.expires_at = expires_at
            key.save(update_fields=["expires_at"])
        return KeyedClient(raw, tenant, SHARED_CLIENT)

    def client(self, identity: str, scope: str | None = None) -> KeyedClient:
        return self._wrong_scope[scope] if identity == "wrong_scope" else self._clients[identity]


@pytest.fixture(scope="module")
def identities(django_db_setup, django_db_blocker):
    """Built once for the module inside a transaction that is rolled back at its end; every
    cell runs in its own nested transaction (the ``db`` fixture), so what a cell writes is
    undone before the next one. (656 cells × tenants, keys and audited seed writes would
    otherwise dominate the run.)"""
    with rolled_back_module_data(django_db_blocker, Identities) as built:
        yield built


# --- requests ------------------------------------------------------------------------------


def _request_for(row: Row, key: str) -> tuple[str, str | None]:
    """(path, JSON body or None) of a row, aimed at ``key``."""
    unknown = set(row.route.converters) - set(URL_PARAMETERS)
    assert not unknown, f"{row.route.route}: no test value for URL parameter(s) {sorted(unknown)}"
    kwargs = {name: (key if name == "key" else URL_PARAMETERS[name]) for name in row.route.converters}
    assert row.route.name, f"{row.route.route} has no URL name; name it so the matrix can reverse it"
    path = reverse(row.route.name, kwargs=kwargs or None) + ROUTE_QUERIES.get(row.route.route, "")
    if row.tool:
        arguments = {k: (key if k == "key" else v) for k, v in TOOL_ROWS[row.tool][1].items()}
        call = {"id": "call_1", "name": row.tool, "arguments": arguments}
        body = {"calls": [call]} if row.route.route.endswith("/batch") else call
        return path, json.dumps(body)
    if row.route.route in LANGGRAPH_ROUTES:
        return _langgraph_request(row, path, key)
    if row.method in ("POST", "PUT", "PATCH"):
        return path, json.dumps(ROUTE_BODIES.get(row.route.route, {"value": ATTACK}))
    return path, None


def _langgraph_request(row: Row, path: str, key: str) -> tuple[str, str | None]:
    # With ZEROMEM_LANGGRAPH_PREFIX="user", "user:u10086:pref_lang" is namespace ["u10086"], key "pref_lang".
    _, *namespace, item = key.split(":")
    if row.kind == "lg_get" or row.method in ("GET", "HEAD"):
        return f"{path}?{urlencode({'namespace': '.'.join(namespace), 'key': item})}", None
    if row.kind == "lg_search":
        return path, json.dumps({"namespace_prefix": namespace})
    if row.kind == "lg_namespaces":
        return path, json.dumps({})
    if row.kind == "lg_delete":
        return path, json.dumps({"namespace": namespace, "key": item})
    return path, json.dumps({"namespace": namespace, "key": item, "value": ATTACK_OBJECT})


def _send(client: KeyedClient, method: str, path: str, body: str | None):
    headers = {} if client.raw_key is None else {"Authorization": f"Bearer {client.raw_key}"}
    if body is None:
        return client.client.generic(method, path, headers=headers)
    return client.client.generic(method, path, body, content_type="application/json", headers=headers)


def _content(response) -> bytes:
    # The audit export streams its body.
    if response.streaming:
        response._consumed = getattr(response, "_consumed", None) or b"".join(response.streaming_content)
        return response._consumed
    return response.content


def _json(response) -> dict:
    if not _content(response):
        return {}
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    return json.loads(_content(response))


def _tool_result(row: Row, body: dict) -> dict:
    if row.route.route.endswith("/batch"):
        assert len(body["results"]) == 1, body
        return body["results"][0]
    return body


def _batch_expect(expect: Expect) -> tuple[Expect, str | None]:
    """A batch answers 200 once authenticated; each call's outcome (and error code) is inside
    its result. Returns (expectation of the HTTP answer, error code of the one call)."""
    if expect.status == 401:
        return expect, None
    return Expect(200, result=expect.result, check=expect.check, writes=expect.writes), expect.code


# --- state ---------------------------------------------------------------------------------


def _state(tenant_a, tenant_b) -> dict:
    rows = Memory.objects.filter(tenant__in=[tenant_a, tenant_b]).order_by("pk")
    rows = list(rows.values_list("tenant_id", "key", "value", "version", "deleted_at", "access_count"))
    return {
        "a": [row[1:5] for row in rows if row[0] == tenant_a.pk],
        "b": [row[1:5] for row in rows if row[0] == tenant_b.pk],
        "target_access_count": next(row[5] for row in rows if row[0] == tenant_a.pk and row[1] == TARGET),
        "versions": MemoryVersion.objects.count(),
    }


def _sent(value):
    """The attack string a write cell sent, as a tool or REST value or in a LangGraph object."""
    return value["v"] if value == ATTACK_OBJECT else value


def _check_writes(expect: Expect, identity: str, before: dict, after: dict) -> None:
    if identity != "owner":
        assert after["a"] == before["a"], "a non-owner request changed tenant A's memories"
        assert after["target_access_count"] == before["target_access_count"], "a non-owner request read the target"
    if expect.writes is None:
        assert after == {**before, "target_access_count": after["target_access_count"]}, "a refused/read request wrote"
        return
    if expect.writes == "create_own":
        assert identity == "other_tenant"
        new = [m for m in after["b"] if m not in before["b"]]
        assert [(k, _sent(v), ver) for k, v, ver, _ in new] == [(TARGET, ATTACK, 1)], new
        return
    assert identity == "owner"
    assert after["b"] == before["b"], "the owner's request changed tenant B"
    live = [m for m in after["a"] if m[0] == TARGET and m[3] is None]
    if expect.writes == "update":
        assert [(k, _sent(v), ver) for k, v, ver, _ in live] == [(TARGET, ATTACK, 2)], after["a"]
    elif expect.writes == "delete":
        assert live == [], after["a"]
        assert [m for m in after["a"] if m[0] == TARGET][0][3] is not None
    else:  # pragma: no cover
        raise AssertionError(expect.writes)


# --- body checks ---------------------------------------------------------------------------


def _check_body(check: str | None, identity: str, result: dict, text: str, ids: Identities | None = None) -> None:
    if check is None:
        return
    visible = VISIBLE_KEYS[identity]
    if check == "lists_requests":
        # The oracle is the ids the fixture was given when it filed them, not a server list.
        expected = sorted(getattr(ids, name) for name in VISIBLE_REQUESTS[identity])
        listed = sorted(r["id"] for r in result["results"])
        assert listed == expected, (identity, listed, expected)
        assert {r["reason"] for r in result["results"]} <= VISIBLE_CANARIES[identity], result
    elif check == "sees_request":
        assert identity == "owner" and (result["id"], result["reason"]) == (ids.request_a, CANARY_FR_A), result
        assert result["target"] == {"keys": [TARGET]}, result
    elif check == "sees_job":
        assert identity == "owner" and result["id"] == ids.job_a, result
    elif check == "sees_target":
        assert identity == "owner" and CANARY_A in text, text
    elif check == "lists_visible":
        keys = result["keys"] if "keys" in result else [m["key"] for m in result["results"]]
        assert keys == visible, (identity, keys)
    elif check == "finds_visible":
        keys = [r["key"] for r in result["results"]]
        assert keys and set(keys) <= set(visible), (identity, keys)
        if identity == "owner":
            assert TARGET in keys, keys  # positive control: the search does find the canary
    elif check == "audit_visible":
        targets = [e["target"] for e in result["results"]]
        assert targets, result
        mentions_a = [t for t in targets if t in (TARGET, AGENT_KEY) or t.startswith("matrix-owner")]
        if identity == "owner":
            assert TARGET in targets and AGENT_KEY in targets, targets  # positive control
        elif identity == "not_allowed":
            assert AGENT_KEY in targets and all(t.startswith("agent:") for t in targets), targets
        else:
            assert not mentions_a, (identity, mentions_a)
    elif check == "lg_visible":
        keys = [f"user:{':'.join(i['namespace'])}:{i['key']}" for i in result["items"]]
        assert keys == [k for k in visible if k.startswith("user:u10086:")], (identity, keys)
    elif check == "lg_namespaces_visible":
        namespaces = [":".join(["user", *ns]) for ns in result["namespaces"]]
        assert namespaces == sorted({k.rpartition(":")[0] for k in visible if k.startswith("user:")}), namespaces
    elif check == "portal_link":
        assert result["url"].startswith("http://testserver/portal/open/") and result["expires_at"], result
    elif check == "recalls_visible":
        lines = result["text"].splitlines()
        assert lines and result["count"] == len(lines), result
        assert {line.split(": ", 1)[0] for line in lines} <= set(visible), (identity, lines)
        if identity == "owner":
            assert CANARY_A in result["text"], result
    else:  # pragma: no cover
        raise AssertionError(check)


def _signature(row: Row, response) -> tuple:
    """What distinguishes two answers apart from the key they name and the times."""
    if row.method == "HEAD" or not _content(response):
        return (response.status_code,)
    body = _json(response)
    if row.kind == "options":
        return response.status_code, body
    result = _tool_result(row, body) if row.tool else body
    error = result.get("error") or {}
    return (
        response.status_code,
        error.get("code"),
        error.get("message"),
        error.get("field"),
        result.get("status"),
        result.get("created"),
        result.get("version"),
        result.get("value"),
    )


# --- the matrix ----------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "identity"), CELLS)
def test_matrix(row: Row, identity: str, identities, db, settings):
    settings.ZEROMEM_LANGGRAPH_PREFIX = "user"
    tenant_a, tenant_b = identities.a, identities.b
    route = ROUTES[row.route.route]
    expect = OUTCOMES[row.kind][identity]
    inner_code = None
    if row.tool and row.route.route.endswith("/batch"):
        expect, inner_code = _batch_expect(expect)
    client = identities.client(identity, NEEDED_SCOPE.get(row.kind))
    path, body = _request_for(row, TARGET)

    before = _state(tenant_a, tenant_b)
    if identity == "other_tenant":
        audit_mark = AuditEvent.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
    response = _send(client, row.method, path, body)
    text = _content(response).decode("utf-8", errors="replace")

    assert response.status_code < 500, f"server error {response.status_code}: {text[:500]}"
    assert response.status_code == expect.status, f"expected {expect.status}, got {response.status_code}: {text[:500]}"

    # Nothing the identity may not see, whatever the status.
    for canary in ALL_CANARIES:
        if canary not in VISIBLE_CANARIES.get(identity, set()):
            assert canary not in text, f"{identity} saw {canary}: {text[:500]}"

    if row.method == "HEAD":
        assert _content(response) == b""
    elif expect.code is not None and not (route.public and not response["Content-Type"].startswith("application/json")):
        # (the schema and docs pages answer errors in their own format: YAML, HTML)
        assert _json(response)["error"]["code"] == expect.code, text
    if expect.status == 401:
        assert response.has_header("WWW-Authenticate"), "401 without WWW-Authenticate"
    if response.status_code >= 400:
        assert not response.has_header("ETag"), "a refused request carries an ETag (row id and version)"
    if expect.status == 405:
        assert set(re.split(r",\s*", response["Allow"])) >= set(route.ops) - {"HEAD"}, response["Allow"]
        assert row.method not in re.split(r",\s*", response["Allow"]), response["Allow"]

    if row.tool and row.method != "HEAD" and expect.status != 401:
        result = _tool_result(row, _json(response))
        assert result.get("tool_call_id") == "call_1", result
        if inner_code is not None or (expect.code is not None):
            assert result["status"] == "error" and result["error"]["code"] == (inner_code or expect.code), result
        else:
            assert result["status"] == expect.result, result
        _check_body(expect.check, identity, result, text, identities)
    elif row.method != "HEAD" and expect.check == "export_visible":
        rows = list(csv.DictReader(io.StringIO(text)))
        _check_body("audit_visible", identity, {"results": rows}, text, identities)
    elif row.method != "HEAD" and expect.check:
        _check_body(expect.check, identity, _json(response), text, identities)

    after = _state(tenant_a, tenant_b)
    writes = expect.writes if (inner_code is None and expect.code is None) else None
    _check_writes(Expect(expect.status, writes=writes), identity, before, after)

    if identity == "other_tenant":
        leaked = AuditEvent.objects.filter(pk__gt=audit_mark, tenant=tenant_a).count()
        assert leaked == 0, "another tenant's request was audited in tenant A's log"
        if row.kind in KEYED_KINDS or (row.kind == "options" and "key" in row.route.converters):
            # Indistinguishable from a key that exists nowhere.
            ghost_path, ghost_body = _request_for(row, GHOST)
            ghost = _send(client, row.method, ghost_path, ghost_body)
            assert ghost.status_code < 500
            assert _signature(row, response) == _signature(row, ghost), (text, ghost.content)


# --- the matrix covers everything ----------------------------------------------------------


def test_every_route_is_classified():
    unclassified = [r.route for r in ALL_ROUTES if classify(r) is None]
    assert not unclassified, (
        "routes the authorization matrix does not know; add them to ROUTES in "
        f"tests/test_authorization_matrix.py (or to the out-of-scope admin): {unclassified}"
    )
    stale = (set(ROUTES) | set(PORTAL_ROUTES)) - {r.route for r in ALL_ROUTES}
    assert not stale, f"ROUTES lists routes that no longer exist: {sorted(stale)}"
    for spec in ROUTES.values():
        assert set(spec.ops) <= set(METHODS)
        assert all(kind == TOOLS_POST or kind in OUTCOMES for kind in spec.ops.values())
    assert all(set(table) == set(IDENTITIES) for table in OUTCOMES.values())


def test_every_tool_has_a_row():
    assert set(TOOL_ROWS) == set(tools.TOOLS), "add a matrix row (kind, arguments) for each new tool"


def test_matrix_size():
    tool_rows = sum(1 for row in ROWS if row.tool)
    summary = (
        f"authorization matrix: {len(API_ROUTES)} routes × {len(METHODS)} methods × {len(IDENTITIES)} identities "
        f"= {len(API_ROUTES) * len(METHODS) * len(IDENTITIES)} combinations; POST on the tool endpoints split "
        f"into {len(TOOL_ROWS)} tools → {len(ROWS)} rows ({tool_rows} tool rows) × {len(IDENTITIES)} identities "
        f"= {len(CELLS)} cells"
    )
    print(summary)
    assert len(CELLS) == len(ROWS) * len(IDENTITIES)
    assert len(API_ROUTES) == len(ROUTES)


# --- the end-user portal ---------------------------------------------------------------------
#
# Identities are portal links (for the open route) and the portal sessions they lead to (for
# the other pages), of tenant A's end user u10086 unless said otherwise:
#
# * ``valid_link``        – a fresh link; a session opened from another fresh link;
# * ``other_tenant_link`` – the same for tenant B's end user u10086 (same subject name);
# * ``expired_link``      – a link past its expiry; a session cookie past its lifetime;
# * ``altered_link``      – a link with one character changed; a session cookie renamed to
#                           tenant B's session, keeping tenant A's signature;
# * ``replayed_link``     – a link opened once already; its replayer holds no session;
# * ``no_link``           – no link (a made-up token); no session cookie;
# * ``revoked_link``      – a link the tenant withdrew; a session whose link was withdrawn.
#
# 5 routes × 7 methods × 7 identities = 245 cells (``test_portal_matrix[<route>-<METHOD>-<identity>]``).
# Each checks: the status; no 5xx and no stack trace; only the identity's own canary (tenant A's
# u10086 for valid_link, tenant B's for other_tenant_link); tenant A's memories unchanged; a forget
# request filed only by the valid link's forget; tenant A's objects answer another tenant's
# session exactly like missing ones.

PORTAL_IDENTITIES = (
    "valid_link",
    "other_tenant_link",
    "expired_link",
    "altered_link",
    "replayed_link",
    "no_link",
    "revoked_link",
)
PORTAL_SUBJECT = "u10086"
PORTAL_CANARY_A = "CANARY-portal-acme-61f0d2"
PORTAL_CANARY_A_OTHER_SUBJECT = "CANARY-portal-acme-u10087-0b44"
PORTAL_CANARY_B = "CANARY-portal-globex-9e37aa"
PORTAL_CANARIES = (PORTAL_CANARY_A, PORTAL_CANARY_A_OTHER_SUBJECT, PORTAL_CANARY_B)
PORTAL_VISIBLE = {"valid_link": {PORTAL_CANARY_A}, "other_tenant_link": {PORTAL_CANARY_B}}

NO_SESSION = Expect(403)
LINK_REFUSED = {
    "expired_link": Expect(410),
    "altered_link": Expect(400),
    "replayed_link": Expect(410),
    "no_link": Expect(400),
    "revoked_link": Expect(410),
}


def _portal(valid: Expect, other: Expect, refused: Expect | dict) -> dict[str, Expect]:
    refused = refused if isinstance(refused, dict) else dict.fromkeys(PORTAL_IDENTITIES[2:], refused)
    return {"valid_link": valid, "other_tenant_link": other, **refused}


PORTAL_OUTCOMES: dict[str, dict[str, Expect]] = {
    "portal_405": dict.fromkeys(PORTAL_IDENTITIES, Expect(405)),
    "portal_home": _portal(Expect(200, check="sees_own"), Expect(200, check="sees_own"), NO_SESSION),
    # Looking at a link (GET) never uses it up; opening it (POST) starts a session.
    "portal_look": _portal(Expect(200), Expect(200), LINK_REFUSED),
    "portal_open": _portal(Expect(302, check="session_started"), Expect(302, check="session_started"), LINK_REFUSED),
    # Forgetting tenant A's memory of u10086: filed for the valid link; another tenant's user
    # asking for it gets what a missing key gets.
    "portal_forget": _portal(Expect(302, writes="forget_request"), Expect(404), NO_SESSION),
    "portal_request": _portal(Expect(200), Expect(404), NO_SESSION),
    # Closing the page answers the same to everyone (there may be nothing to close).
    "portal_sign_out": _portal(Expect(200), Expect(200), Expect(200)),
}

PORTAL_CLIENT = Client()
PORTAL_PARAMETERS = {"request_id": 0, "token": ""}  # set per identity / by PortalIdentities


class PortalIdentities:
    def __init__(self):
        from django.http import HttpResponse

        from memories.portal.models import PortalLink
        from memories.portal.services import portal_link_create, portal_link_open, token_hash
        from memories.portal.views import COOKIE, COOKIE_SALT, SESSION_PURPOSE
        from zeromem.kernel import opaque

        self.a = make_tenant("portal-owner")
        self.b = make_tenant("portal-other")
        services.memory_write(tenant=self.a, actor=SYSTEM, key=TARGET, value=PORTAL_CANARY_A)
        services.memory_write(
            tenant=self.a, actor=SYSTEM, key="user:u10087:pref_lang", value=PORTAL_CANARY_A_OTHER_SUBJECT
        )
        # Tenant B's u10086 (same subject name) has memories, but not at tenant A's key.
        services.memory_write(tenant=self.b, actor=SYSTEM, key="user:u10086:nickname", value=PORTAL_CANARY_B)
        # The request every portal/requests/<id> cell asks for: tenant A's, about u10086.
        PORTAL_PARAMETERS["request_id"] = str(
            services.forget_request_create(tenant=self.a, actor=SYSTEM, subject=PORTAL_SUBJECT).uid
        )

        def token(tenant) -> str:
            return portal_link_create(tenant=tenant, actor=SYSTEM, subject=PORTAL_SUBJECT)[1]

        def session(tenant, *, age: int = 0) -> str:
            link = portal_link_open(token=token(tenant), actor_for=lambda _link: SYSTEM, use=True)
            response = HttpResponse()
            with mock.patch("time.time", return_value=time.time() - age):
                response.set_signed_cookie(COOKIE, opaque.seal_id(link.pk, purpose=SESSION_PURPOSE), salt=COOKIE_SALT)
            return response.cookies[COOKIE].value

        valid = token(self.a)
        expired = token(self.a)
        PortalLink.objects.filter(token_hash=token_hash(expired)).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
        replayed = token(self.a)
        portal_link_open(token=replayed, actor_for=lambda _link: SYSTEM, use=True)
        a_session, b_session = session(self.a), session(self.b)
        # Withdrawn: an unopened link, and the link of an open session.
        revoked, revoked_session = token(self.a), session(self.a)
        PortalLink.objects.filter(tenant=self.a, opened_at__isnull=True, token_hash=token_hash(revoked)).update(
            revoked_at=timezone.now()
        )
        revoked_pk = opaque.open_id(revoked_session.split(":", 1)[0], purpose=SESSION_PURPOSE)
        PortalLink.objects.filter(pk=revoked_pk).update(revoked_at=timezone.now())
        b_link_id = b_session.split(":", 1)[0]
        self.cookie = COOKIE
        self.tokens = {
            "valid_link": valid,
            "other_tenant_link": token(self.b),
            "expired_link": expired,
            "altered_link": valid[:-1] + ("A" if valid[-1] != "A" else "B"),
            "replayed_link": replayed,
            "no_link": "none",
            "revoked_link": revoked,
        }
        self.sessions = {
            "valid_link": a_session,
            "other_tenant_link": b_session,
            "expired_link": session(self.a, age=settings.ZEROMEM_PORTAL_SESSION_SECONDS + 1),
            "altered_link": b_link_id + a_session[a_session.index(":") :],
            "replayed_link": None,
            "no_link": None,
            "revoked_link": revoked_session,
        }


@pytest.fixture(scope="module")
def portal_identities(django_db_setup, django_db_blocker):
    """Like ``identities``: built once, in a transaction rolled back at the module's end."""
    with rolled_back_module_data(django_db_blocker, PortalIdentities) as built:
        yield built


PORTAL_ROUTES_RESOLVED = [r for r in ALL_ROUTES if classify(r) == "portal"]
PORTAL_CELLS = [
    pytest.param(r, method, identity, id=f"{_route_id(r)}-{method}-{identity}")
    for r in PORTAL_ROUTES_RESOLVED
    for method in METHODS
    for identity in PORTAL_IDENTITIES
]


def _portal_request(r: ResolvedRoute, method: str, identity: str, ids: PortalIdentities, *, ghost: bool = False):
    kwargs = {}
    if "token" in r.converters:
        kwargs["token"] = ids.tokens[identity]
    if "request_id" in r.converters:
        kwargs["request_id"] = str(uuid.uuid4()) if ghost else PORTAL_PARAMETERS["request_id"]
    path = reverse(r.name, kwargs=kwargs or None)
    PORTAL_CLIENT.cookies.clear()
    if ids.sessions[identity] and "token" not in r.converters:
        PORTAL_CLIENT.cookies[ids.cookie] = ids.sessions[identity]
    body = None
    if method in ("POST", "PUT", "PATCH"):
        body = {"what": "one", "key": GHOST if ghost else TARGET}
    if body is None:
        return PORTAL_CLIENT.generic(method, path)
    from urllib.parse import urlencode

    return PORTAL_CLIENT.generic(method, path, urlencode(body), content_type="application/x-www-form-urlencoded")


@pytest.mark.parametrize(("route", "method", "identity"), PORTAL_CELLS)
def test_portal_matrix(route: ResolvedRoute, method: str, identity: str, portal_identities, db):
    from memories.models import ForgetRequest

    ids = portal_identities
    kind = PORTAL_ROUTES[route.route].get(method, "portal_405")
    expect = PORTAL_OUTCOMES[kind][identity]
    memories_before = list(Memory.objects.filter(tenant__in=[ids.a, ids.b]).order_by("pk").values_list())
    requests_before = ForgetRequest.objects.filter(tenant__in=[ids.a, ids.b]).count()

    response = _portal_request(route, method, identity, ids)
    text = response.content.decode("utf-8", errors="replace")

    assert response.status_code < 500, f"server error {response.status_code}: {text[:500]}"
    assert response.status_code == expect.status, f"expected {expect.status}, got {response.status_code}: {text[:500]}"
    assert "Traceback" not in text
    for canary in PORTAL_CANARIES:
        if canary not in PORTAL_VISIBLE.get(identity, set()):
            assert canary not in text, f"{identity} saw {canary}"
    if expect.check == "sees_own" and method == "GET":
        assert PORTAL_VISIBLE[identity] <= {c for c in PORTAL_CANARIES if c in text}, text[:500]
    if expect.check == "session_started":
        assert response["Location"] == "/portal/" and ids.cookie in response.cookies
    elif method in ("GET", "HEAD") or response.status_code >= 400:
        assert ids.cookie not in response.cookies or not response.cookies[ids.cookie].value
    if response.status_code >= 400 and response.status_code != 405 and method != "HEAD":
        assert response["Content-Type"].startswith("text/html"), "a portal error is a page"

    # The portal changes memories only through forget requests, which run later (never in
    # these rolled-back cells); only the valid link's forget files one, in tenant A.
    assert list(Memory.objects.filter(tenant__in=[ids.a, ids.b]).order_by("pk").values_list()) == memories_before
    requests_after = ForgetRequest.objects.filter(tenant__in=[ids.a, ids.b]).count()
    if expect.writes == "forget_request":
        filed = ForgetRequest.objects.filter(tenant__in=[ids.a, ids.b]).order_by("-pk").first()
        assert requests_after == requests_before + 1 and filed.tenant == ids.a and filed.keys == [TARGET]
    else:
        assert requests_after == requests_before, "a refused portal request filed a forget request"

    if identity == "other_tenant_link" and expect.status == 404:
        # Tenant A's memory or request answers tenant B's user exactly like a missing one.
        ghost = _portal_request(route, method, identity, ids, ghost=True)
        assert (ghost.status_code, ghost.content) == (response.status_code, response.content)


def test_portal_matrix_covers_every_portal_route():
    assert {r.route for r in PORTAL_ROUTES_RESOLVED} == set(PORTAL_ROUTES)
    assert all(set(t) == set(PORTAL_IDENTITIES) for t in PORTAL_OUTCOMES.values())
    assert all(k in PORTAL_OUTCOMES for ops in PORTAL_ROUTES.values() for k in ops.values())
    print(
        f"portal matrix: {len(PORTAL_ROUTES)} routes × {len(METHODS)} methods × {len(PORTAL_IDENTITIES)} identities "
        f"= {len(PORTAL_CELLS)} cells"
    )
