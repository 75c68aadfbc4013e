"""Authorization matrix of the admin: every admin route × GET and POST × every staff identity.

The routes come from the URL resolver, like the API matrix in tests/test_authorization_matrix.py
(whose ``test_every_route_is_classified`` sends every ``admin/`` route here): a new admin page
fails ``test_every_admin_route_is_classified`` until ``ADMIN_ROUTES`` says what it is. Object
URLs name tenant A's objects (and for Django's and django-q2's own models, an existing row).

Identities: a member of tenant A with each role (``viewer``, ``support``, ``compliance``,
``admin``); ``other_tenant`` — the *admin* of tenant B; ``no_membership`` — a staff user who
belongs to no tenant; ``anonymous``. The expected status of each cell comes from ``ALLOWED``,
written out by hand from the roles table in the README (not computed from the code it checks).

Every cell checks, besides its status: no 5xx; tenant A's memory value appears only for the
roles that may read values (never for compliance, never for another tenant's admin) and tenant
B's never; tenant A's data is unchanged unless the cell is an allowed write; another tenant's
request writes no audit event into tenant A's log; and an object URL of tenant A answers
another tenant's admin exactly like a missing object (404).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.contrib.contenttypes.models import ContentType
from django.test import Client
from django.utils import timezone
from django_q.models import OrmQ, Schedule, Task

from audit.models import AuditEvent
from memories import services
from memories.models import ApiKey, ForgetRequest, Membership, Memory, MemoryVersion
from tests.factories import SYSTEM, make_key, make_tenant
from tests.helpers import rolled_back_module_data

CANARY_A = "CANARY-admin-matrix-acme-3c1f"
CANARY_B = "CANARY-admin-matrix-globex-77d0"
ROLES = ("viewer", "support", "compliance", "admin")
IDENTITIES = (*ROLES, "other_tenant", "no_membership", "anonymous")
METHODS = ("GET", "POST")
VALUE_READERS = {"viewer", "support", "admin"}  # may see tenant A's memory values

# model → role → what the role may do with tenant A's rows: v(iew) a(dd) c(hange) d(elete).
# other_tenant (tenant B's admin) may do nothing with tenant A's rows; no_membership nothing.
ALLOWED: dict[str, dict[str, str]] = {
    "tenant": {"viewer": "v", "support": "v", "compliance": "v", "admin": "v"},
    "memory": {"viewer": "v", "support": "vac", "compliance": "", "admin": "vac"},
    "forgetrequest": {"viewer": "v", "support": "va", "compliance": "va", "admin": "va"},
    "apikey": {"viewer": "", "support": "", "compliance": "", "admin": "va"},
    "membership": {"viewer": "", "support": "", "compliance": "", "admin": "vacd"},
    "auditevent": {"viewer": "", "support": "", "compliance": "v", "admin": "v"},
}
# Lists are tenant-scoped, so another tenant's admin may open the lists its own role allows
# (and sees none of tenant A's rows in them).
LIST_ALLOWED_OTHER = {"tenant", "memory", "forgetrequest", "apikey", "membership", "auditevent"}


def _perms(model: str, identity: str) -> str:
    return ALLOWED[model].get(identity, "")


# --- the route table -----------------------------------------------------------------------


@dataclass(frozen=True)
class AdminRoute:
    kind: str  # see expected()
    model: str = ""


OUR_MODELS = {"memories": ("tenant", "memory", "forgetrequest", "apikey", "membership"), "audit": ("auditevent",)}
THEIR_MODELS = {"auth": ("group", "user"), "django_q": ("schedule", "success", "failure", "ormq")}
MODEL_VIEWS = {
    "": "changelist",
    "add/": "add",
    "<path:object_id>/history/": "history",
    "<path:object_id>/delete/": "delete",
    "<path:object_id>/change/": "change",
    "<path:object_id>/": "redirect",
}


def _table() -> dict[str, AdminRoute]:
    table = {
        "admin/": AdminRoute("index"),
        "admin/login/": AdminRoute("login"),
        "admin/logout/": AdminRoute("logout"),
        "admin/password_change/": AdminRoute("password_change"),
        "admin/password_change/done/": AdminRoute("password_change"),
        "admin/autocomplete/": AdminRoute("autocomplete"),
        "admin/jsi18n/": AdminRoute("jsi18n"),
        "admin/r/<path:content_type_id>/<path:object_id>/": AdminRoute("view_on_site", "memory"),
        "admin/^(?P<app_label>auth|django_q|memories|audit)/$": AdminRoute("app_list"),
        "admin/(?P<url>.*)$": AdminRoute("catch_all"),
        "admin/memories/tenant/<int:tenant_id>/dashboard/": AdminRoute("dashboard", "tenant"),
        "admin/memories/memory/<path:object_id>/history/<int:version>/restore/": AdminRoute("restore", "memory"),
        "admin/memories/memory/<path:object_id>/reveal/": AdminRoute("reveal", "memory"),
        "admin/audit/auditevent/export/": AdminRoute("export", "auditevent"),
        "admin/auth/user/<id>/password/": AdminRoute("their_model", "user"),
    }
    for app, models in OUR_MODELS.items():
        for model in models:
            for suffix, view in MODEL_VIEWS.items():
                table[f"admin/{app}/{model}/{suffix}"] = AdminRoute(view, model)
    for app, models in THEIR_MODELS.items():
        for model in models:
            for suffix, view in MODEL_VIEWS.items():
                table[f"admin/{app}/{model}/{suffix}"] = AdminRoute(
                    "their_redirect" if view == "redirect" else "their_model", model
                )
    return table


ADMIN_ROUTES = _table()


def admin_route_kind(r) -> str | None:
    """What an ``admin/`` route is, or None when this matrix does not know it."""
    spec = ADMIN_ROUTES.get(r.route)
    return spec.kind if spec else None


# Imported here, after admin_route_kind exists: the API matrix's module calls it while it is
# being imported itself (to classify the admin routes).
from tests.test_authorization_matrix import ALL_ROUTES, ResolvedRoute  # noqa: E402

MATRIX_ROUTES = [r for r in ALL_ROUTES if r.route.startswith("admin/")]


@dataclass(frozen=True)
class Row:
    route: ResolvedRoute
    method: str
    variant: str = ""  # app_list: which app

    @property
    def spec(self) -> AdminRoute:
        return ADMIN_ROUTES[self.route.route]

    @property
    def id(self) -> str:
        path = self.route.route.removeprefix("admin/") or "index"
        path = re.sub(r"[^A-Za-z0-9_]+", "_", path).strip("_")
        return f"{path}{'-' + self.variant if self.variant else ''}-{self.method}"


def _rows() -> list[Row]:
    rows = []
    for r in MATRIX_ROUTES:
        if r.route not in ADMIN_ROUTES:
            continue
        variants = ("memories", "audit", "auth") if ADMIN_ROUTES[r.route].kind == "app_list" else ("",)
        rows.extend(Row(r, m, v) for m in METHODS for v in variants)
    return rows


ROWS = _rows()
CELLS = [pytest.param(row, identity, id=f"{row.id}-{identity}") for row in ROWS for identity in IDENTITIES]


# --- expected outcomes ---------------------------------------------------------------------

LOGIN_REDIRECT = "login"  # a 302 to the login page


def expected(row: Row, identity: str) -> int | str:
    kind, model, method = row.spec.kind, row.spec.model, row.method
    if identity == "anonymous":
        if kind == "login":
            return 200
        if kind == "logout":
            return 302  # nobody to sign out: on to the login page
        return LOGIN_REDIRECT
    member = identity in ROLES
    if kind == "login":
        return 302 if method == "GET" else 200  # signed in: on to the index; a POST is a new login form
    if kind == "logout":
        return 405 if method == "GET" else 200
    if kind == "password_change" and row.route.route.endswith("done/"):
        return 200 if method == "GET" else 405
    if kind == "jsi18n":
        return 200 if method == "GET" else 405
    if kind in ("index", "password_change"):
        return 200
    if kind == "autocomplete":
        if method != "GET":
            return 405
        return 200 if member or identity == "other_tenant" else 403
    if kind == "view_on_site":
        return 404  # no model of ours has a public page
    if kind == "catch_all":
        return 404
    if kind == "app_list":
        if row.variant == "memories":
            return 200 if member or identity == "other_tenant" else 404
        if row.variant == "audit":
            return 200 if identity in ("compliance", "admin", "other_tenant") else 404
        return 404  # auth: only superusers
    if kind in ("their_model",):
        return 403
    if kind in ("their_redirect", "redirect"):
        return 302  # to the change page, which decides
    if kind == "dashboard":
        return 200 if member else 404
    if kind == "export":
        if "v" not in _perms(model, identity) and identity != "other_tenant":
            return 403
        return 200  # a stream of the user's (one) tenant's events
    perms = _perms(model, identity)
    if kind == "reveal":  # an audited read of a (sensitive) value, then back to its page
        if method == "GET":
            return 405
        return 302 if "v" in perms else 404
    if kind == "restore":
        if method == "GET":
            return 405
        if "v" not in perms:
            return 404
        return 302 if "c" in perms else 403
    if kind == "changelist":
        allowed = "v" in perms or (identity == "other_tenant" and model in LIST_ALLOWED_OTHER)
        return 200 if allowed else 403
    if kind == "add":
        allowed = "a" in perms or (
            identity == "other_tenant" and model in ("memory", "forgetrequest", "apikey", "membership")
        )
        if model == "tenant" or model == "auditevent":
            allowed = False  # superusers only / never
        return 200 if allowed else 403
    # object views of tenant A's object
    if "v" not in perms:
        return 404  # another tenant's (or a forbidden) object: exactly like a missing one
    if kind in ("change", "history"):
        if kind == "change" and method == "POST" and "c" not in perms:
            return 403
        return 200
    if kind == "delete":
        return 200 if "d" in perms else 403
    if kind == "redirect":
        return 302
    raise AssertionError(kind)  # pragma: no cover


WRITES = {("restore", "POST")}  # cells that change tenant A's data when allowed


# --- the identities ------------------------------------------------------------------------


class Staff:
    def __init__(self):
        User = get_user_model()
        self.a = make_tenant("adm-matrix-owner")
        self.b = make_tenant("adm-matrix-other")
        memory = services.memory_write(tenant=self.a, actor=SYSTEM, key="user:u10086:pref_lang", value="v1").memory
        services.memory_update(tenant=self.a, actor=SYSTEM, key=memory.key, value=f"{CANARY_A} v2")
        services.memory_write(tenant=self.b, actor=SYSTEM, key="user:u20002:pref_lang", value=CANARY_B)
        self.users = {}
        for role in ROLES:
            self.users[role] = User.objects.create_user(username=f"adm-{role}", password=None)
            services.membership_set(tenant=self.a, actor=SYSTEM, username=f"adm-{role}", role=role)
        self.users["other_tenant"] = User.objects.create_user(username="adm-other", password=None)
        services.membership_set(tenant=self.b, actor=SYSTEM, username="adm-other", role="admin")
        self.users["no_membership"] = User.objects.create_user(username="adm-none", password=None, is_staff=True)
        key, _raw = make_key(self.a, name="adm-matrix-key")
        fr = services.forget_request_create(tenant=self.a, actor=SYSTEM, subject="u10086", reason="matrix")
        tasks = {
            ok: Task.objects.create(
                id=f"adm-matrix-task-{ok}",
                name=f"t{ok}",
                func="math.floor",
                started=timezone.now(),
                stopped=timezone.now(),
                success=ok,
            )
            for ok in (True, False)
        }
        self.objects = {
            "tenant": self.a.pk,
            "memory": memory.pk,
            "forgetrequest": fr.pk,
            "apikey": key.pk,
            "membership": Membership.objects.get(tenant=self.a, user=self.users["viewer"]).pk,
            "auditevent": AuditEvent.objects.filter(tenant=self.a, action="memory.update").first().pk,
            "user": self.users["viewer"].pk,
            "group": Group.objects.create(name="adm-matrix").pk,
            "schedule": Schedule.objects.create(func="math.floor", name="adm-matrix").pk,
            "success": tasks[True].pk,
            "failure": tasks[False].pk,
            "ormq": OrmQ.objects.create(key="adm", payload="x", lock=timezone.now()).pk,
        }
        self.memory_ct = ContentType.objects.get_for_model(Memory).pk

        # One signed-in client per identity (a cell's writes, sessions included, are rolled
        # back with it); the logout rows get a fresh one, as signing out drops the cookie.
        self._clients = {identity: self._signed_in(identity) for identity in IDENTITIES}

    def _signed_in(self, identity: str) -> Client:
        client = Client()
        if identity != "anonymous":
            client.force_login(self.users[identity])
        return client

    def client(self, identity: str, fresh: bool = False) -> Client:
        return self._signed_in(identity) if fresh else self._clients[identity]


@pytest.fixture(scope="module")
def staff_identities(django_db_setup, django_db_blocker):
    """Built once, inside a transaction rolled back at the module's end; each cell runs in a
    nested transaction of its own (the ``db`` fixture)."""
    with rolled_back_module_data(django_db_blocker, Staff) as built:
        yield built


def _path(row: Row, s: Staff, object_id=None) -> str:
    route = row.route.route.removeprefix("admin/")
    kind, model = row.spec.kind, row.spec.model
    if kind == "app_list":
        return f"/admin/{row.variant}/"
    if kind == "catch_all":
        return "/admin/no/such/page/"
    if kind == "autocomplete":
        return "/admin/autocomplete/?app_label=memories&model_name=memory&field_name=tenant&term="
    if kind == "view_on_site":
        return f"/admin/r/{s.memory_ct}/{s.objects['memory']}/"
    values = {
        "object_id": object_id if object_id is not None else s.objects.get(model, 0),
        "tenant_id": object_id if object_id is not None else s.a.pk,
        "version": 1,
        "id": s.objects.get(model, 0),
    }
    path = re.sub(r"<(?:\w+:)?(\w+)>", lambda m: str(values[m.group(1)]), route)
    return "/admin/" + path


def _state(s: Staff) -> tuple:
    return (
        list(Memory.objects.filter(tenant=s.a).values_list("key", "value", "version", "deleted_at")),
        MemoryVersion.objects.filter(tenant=s.a).count(),
        list(ApiKey.objects.filter(tenant=s.a).values_list("pk", "revoked_at")),
        list(Membership.objects.filter(tenant=s.a).values_list("pk", "role")),
        list(ForgetRequest.objects.filter(tenant=s.a).values_list("pk", "status")),
    )


def _body(response) -> str:
    raw = b"".join(response.streaming_content) if response.streaming else response.content
    return raw.decode("utf-8", errors="replace")


# --- the matrix ----------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "identity"), CELLS)
def test_admin_matrix(row: Row, identity: str, staff_identities, db):
    s = staff_identities
    want = expected(row, identity)
    client = s.client(identity, fresh=row.spec.kind == "logout")
    path = _path(row, s)
    before = _state(s)
    audit_mark = AuditEvent.objects.order_by("-pk").values_list("pk", flat=True).first() or 0

    response = client.get(path) if row.method == "GET" else client.post(path, {})
    body = _body(response)

    assert response.status_code < 500, f"server error {response.status_code}: {body[:500]}"
    if want == LOGIN_REDIRECT:
        assert response.status_code == 302 and "/admin/login/" in response["Location"], response.status_code
    else:
        assert response.status_code == want, (
            f"{row.id} as {identity}: expected {want}, got {response.status_code} {body[:300]}"
        )

    if identity not in VALUE_READERS:
        assert CANARY_A not in body, f"{identity} received tenant A's memory value"
    assert CANARY_B not in body, f"{identity} received tenant B's memory value"
    if identity in ("other_tenant", "no_membership", "anonymous"):
        for marker in ("adm-matrix-key", "user:u10086:pref_lang"):
            at = body.find(marker)
            assert at < 0, f"tenant A's rows leaked: …{body[max(0, at - 300) : at + 100]}…"

    writes = (row.spec.kind, row.method) in WRITES and response.status_code in (200, 302)
    after = _state(s)
    if writes and identity in ("support", "admin"):
        assert after[0][0][2] == before[0][0][2] + 1, "the allowed restore did not write a version"
    else:
        assert after == before, f"{row.id} as {identity} changed tenant A's data"

    if identity in ("other_tenant", "no_membership", "anonymous"):
        leaked = AuditEvent.objects.filter(pk__gt=audit_mark, tenant=s.a).count()
        assert leaked == 0, "a request from outside tenant A was audited in tenant A's log"
    if identity == "other_tenant" and want == 404 and "object_id" in row.route.converters:
        ghost = client.get(_path(row, s, object_id=987654321)) if row.method == "GET" else None
        if ghost is not None:
            assert ghost.status_code == 404, "a missing object answers differently from another tenant's"


# --- the matrix covers everything ----------------------------------------------------------


def test_every_admin_route_is_classified():
    unknown = [r.route for r in MATRIX_ROUTES if r.route not in ADMIN_ROUTES]
    assert not unknown, f"admin routes the admin matrix does not know; add them to ADMIN_ROUTES: {unknown}"
    stale = set(ADMIN_ROUTES) - {r.route for r in MATRIX_ROUTES}
    assert not stale, f"ADMIN_ROUTES lists routes that no longer exist: {sorted(stale)}"


def test_admin_matrix_size():
    print(
        f"admin authorization matrix: {len(MATRIX_ROUTES)} routes ({len(ROWS) // len(METHODS)} rows with the app "
        f"list split per app) × {len(METHODS)} methods × {len(IDENTITIES)} identities = {len(CELLS)} cells"
    )
    assert len(CELLS) == len(ROWS) * len(IDENTITIES)
