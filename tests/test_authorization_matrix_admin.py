"""Authorization matrix of the admin: every admin route × GET and POST × every staff identity.

The routes come from the URL resolver, like the API matrix in tests/test_authorization_matrix.py
(whose ``test_every_route_is_classified`` sends every ``admin/`` route here): a new admin page
fails ``test_every_admin_route_is_classified`` until ``ADMIN_ROUTES`` says what it is. Object
URLs name tenant A's objects (and for Django's and django-q2's own models, an existing row).

Identities: a member of tenant A with each role (``viewer``, ``support``, ``compliance``,
``admin``); ``other_tenant`` — the *admin* of tenant B; ``no_membership`` — a staff user who
belongs to no tenant; ``anonymous``. The expected status of each cell comes from ``ALLOWED``,
written out by hand from the roles table in the README (not computed from the code it checks).

Every POST sends the form a real user would (``_form``: a valid add/change form aimed at
tenant A, ``post=yes`` for a delete, a list action with tenant A's row selected), so a refused
write is refused for its permission, not for an empty form.

Every cell checks, besides its status: no 5xx; tenant A's memory value appears only for the
roles that may read values (never for compliance, never for another tenant's admin) and tenant
B's never; no leak marker of tenant A (its memory key, API key name, forget request's subject,
member usernames, slug, portal link's subject) reaches an identity outside it, and none of tenant B reaches anyone but
B's admin; every list a role may open shows that role's own marker (a positive control that
the page does list rows); tenant A's data is unchanged unless the cell is an allowed write, and
an allowed write does change it; another tenant's request writes no audit event into tenant A's
log; and an object URL of tenant A answers another tenant's admin exactly like a missing object
(the whole page compared, the object id aside).
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
from memories.portal.models import PortalLink
from memories.portal.services import portal_link_create
from tests.factories import SYSTEM, make_key, make_tenant
from tests.helpers import rolled_back_module_data

CANARY_A = "CANARY-admin-matrix-acme-3c1f"
CANARY_B = "CANARY-admin-matrix-globex-77d0"
# Leak markers: text that names a row of one tenant and nothing else.
SUBJECT_A, SUBJECT_B = "admsubjacme5e1f", "admsubjglobex2b7c"  # forget requests' subjects
PORTAL_A, PORTAL_B = "admportalacme4d2a", "admportalglobex81c3"  # portal links' subjects
MARKERS_A = {
    "memory": "user:u10086:pref_lang",
    "forgetrequest": SUBJECT_A,
    "apikey": "adm-matrix-key-acme",
    "membership": "adm-viewer",
    "tenant": "adm-matrix-owner",
    "auditevent": "user:u10086:pref_lang",
    "portallink": PORTAL_A,
}
MARKERS_B = {
    "memory": "user:u20002:pref_lang",
    "forgetrequest": SUBJECT_B,
    "apikey": "adm-matrix-key-globex",
    "membership": "adm-other",
    "tenant": "adm-matrix-other",
    "auditevent": "user:u20002:pref_lang",
    "portallink": PORTAL_B,
}
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
    # a list only; "c": withdrawing links (forget:create, like issuing them)
    "portallink": {"viewer": "v", "support": "vc", "compliance": "vc", "admin": "vc"},
}
# Lists are tenant-scoped, so another tenant's admin may open the lists its own role allows
# (and sees none of tenant A's rows in them).
LIST_ALLOWED_OTHER = {"tenant", "memory", "forgetrequest", "apikey", "membership", "auditevent", "portallink"}


def _perms(model: str, identity: str) -> str:
    return ALLOWED[model].get(identity, "")


# --- the route table -----------------------------------------------------------------------


@dataclass(frozen=True)
class AdminRoute:
    kind: str  # see expected()
    model: str = ""


OUR_MODELS = {"memories": ("tenant", "memory", "forgetrequest", "apikey", "membership"), "audit": ("auditevent",)}
LIST_ONLY = {"portal": ("portallink",)}  # models whose admin is a list (and its actions) only
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
        "admin/^(?P<app_label>auth|django_q|memories|portal|audit)/$": AdminRoute("app_list"),
        "admin/(?P<url>.*)$": AdminRoute("catch_all"),
        "admin/memories/tenant/<int:tenant_id>/dashboard/": AdminRoute("dashboard", "tenant"),
        "admin/memories/memory/<path:object_id>/history/<int:version>/restore/": AdminRoute("restore", "memory"),
        "admin/memories/memory/<path:object_id>/reveal/": AdminRoute("reveal", "memory"),
        # Restoring a trashed memory from its own page (the matrix's memory is live: the service
        # refuses it, named in a message, and nothing changes).
        "admin/memories/memory/<path:object_id>/restore/": AdminRoute("trash_restore", "memory"),
        # One version's whole value: a page of the memory's history (an audited read).
        "admin/memories/memory/<path:object_id>/history/<int:version>/": AdminRoute("history", "memory"),
        "admin/audit/auditevent/export/": AdminRoute("export", "auditevent"),
        "admin/auth/user/<id>/password/": AdminRoute("their_model", "user"),
    }
    for app, models in OUR_MODELS.items():
        for model in models:
            for suffix, view in MODEL_VIEWS.items():
                table[f"admin/{app}/{model}/{suffix}"] = AdminRoute(view, model)
    for app, models in LIST_ONLY.items():
        for model in models:
            table[f"admin/{app}/{model}/"] = AdminRoute("changelist", model)
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
        variants = ("memories", "portal", "audit", "auth") if ADMIN_ROUTES[r.route].kind == "app_list" else ("",)
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
        if row.variant in ("memories", "portal"):
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
    if kind in ("restore", "trash_restore"):
        if method == "GET":
            return 405
        if "v" not in perms:
            return 404
        return 302 if "c" in perms else 403
    if kind == "changelist":
        allowed = "v" in perms or (identity == "other_tenant" and model in LIST_ALLOWED_OTHER)
        if not allowed:
            return 403
        # A list action (with tenant A's row selected) redirects back to the list when the
        # identity has the action at all (another tenant's admin: its own rows only, none picked).
        # Without the action (a list with no action for the identity), a 400 naming `action`:
        # Django showed the list to such a POST, searched and unaudited.
        if method == "POST" and model in LIST_ACTIONS:
            need = LIST_ACTIONS[model][1]
            return 302 if need in perms or identity == "other_tenant" else 400
        if method == "POST":  # delete_selected, the members list's only action: its confirmation page
            return 200 if model == "membership" and ("d" in perms or identity == "other_tenant") else 400
        return 200
    if kind == "add":
        allowed = "a" in perms or (
            identity == "other_tenant" and model in ("memory", "forgetrequest", "apikey", "membership")
        )
        if model == "tenant" or model == "auditevent":
            allowed = False  # superusers only / never
        if not allowed:
            return 403
        # A valid form saved: on to the list (a new API key: a page showing it once). Another
        # tenant's admin naming tenant A: a form error.
        return 302 if method == "POST" and "a" in perms and model != "apikey" else 200
    # object views of tenant A's object
    if "v" not in perms:
        return 404  # another tenant's (or a forbidden) object: exactly like a missing one
    if kind in ("change", "history"):
        if kind == "change" and method == "POST":
            return 302 if "c" in perms else 403
        return 200
    if kind == "delete":
        if "d" not in perms:
            return 403
        return 302 if method == "POST" else 200
    if kind == "redirect":
        return 302
    raise AssertionError(kind)  # pragma: no cover


# The permission letter a POST of each view needs to change tenant A's data.
WRITE_NEEDS = {"add": "a", "change": "c", "delete": "d", "restore": "c"}
# A list action's permission: the memory actions need change (edit), revoking keys add (admin).
LIST_ACTIONS = {"memory": ("move_to_trash", "c"), "apikey": ("revoke", "a"), "portallink": ("withdraw", "c")}


def writes(row: Row, identity: str) -> bool:
    """Whether a POST of this cell may (and must) change tenant A's data."""
    kind, model = row.spec.kind, row.spec.model
    if row.method != "POST" or identity not in ROLES:
        return False
    if kind == "changelist" and model in LIST_ACTIONS:
        return LIST_ACTIONS[model][1] in _perms(model, identity)
    need = WRITE_NEEDS.get(kind)
    if need is None or model in ("tenant", "auditevent") or (kind == "change" and model != "memory"):
        return False  # tenants: superusers; audit events: never; only a memory's fields can change
    if kind == "delete" and model == "memory":
        return False  # a memory is deleted by an action (trash or forget), not the delete page
    return need in _perms(model, identity)


def _form(row: Row, s: Staff) -> dict:
    """The form a real user would send to this page (aimed at tenant A)."""
    kind, model = row.spec.kind, row.spec.model
    a = str(s.a.pk)
    if kind == "delete":
        return {"post": "yes"}
    if kind == "changelist":
        action = LIST_ACTIONS.get(model, ("delete_selected", ""))[0]
        return {"action": action, "_selected_action": [str(s.objects.get(model, 0))], "index": "0"}
    if kind == "login":
        return {"username": "somebody", "password": "not-the-password"}
    if kind == "password_change":
        return {"old_password": "wrong", "new_password1": "Zq8!long-enough-pw", "new_password2": "Zq8!long-enough-pw"}
    if kind not in ("add", "change"):
        return {}
    forms = {
        "memory": {
            "tenant": a,
            "key": "user:u10086:pref_lang" if kind == "change" else "user:u10087:written",
            "value": '"written-in-the-admin"',
            "category": "note",
            "subject": "",
            "tags": "",
            "importance": "5",
            "version": "2",
        },
        "forgetrequest": {"tenant": a, "subject": "u10086", "reason": "admin matrix", "due_in_days": "30"},
        "apikey": {"tenant": a, "name": "adm-new-key", "scopes": ["memory:read"], "allowed_prefixes": ""},
        "membership": {"tenant": a, "username": "adm-newcomer", "role": "viewer"},
        "tenant": {"slug": "adm-new-tenant", "name": "new", "value_max_bytes": "", "trash_retention_days": "30"},
    }
    return forms.get(model, {})


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
        key, _raw = make_key(self.a, name=MARKERS_A["apikey"])
        make_key(self.b, name=MARKERS_B["apikey"])
        fr = services.forget_request_create(tenant=self.a, actor=SYSTEM, subject=SUBJECT_A, reason="matrix")
        services.forget_request_create(tenant=self.b, actor=SYSTEM, subject=SUBJECT_B, reason="matrix")
        link, _token = portal_link_create(tenant=self.a, actor=SYSTEM, subject=PORTAL_A)
        portal_link_create(tenant=self.b, actor=SYSTEM, subject=PORTAL_B)
        User.objects.create_user(username="adm-newcomer", password=None, is_staff=True)  # whom the forms add
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
            "portallink": link.pk,
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
    # Ordered: a save that writes the same values moves its row, and an unordered read then
    # lists the same rows in another order.
    return (
        list(Memory.objects.filter(tenant=s.a).order_by("pk").values_list("key", "value", "version", "deleted_at")),
        MemoryVersion.objects.filter(tenant=s.a).count(),
        list(ApiKey.objects.filter(tenant=s.a).order_by("pk").values_list("pk", "revoked_at")),
        list(Membership.objects.filter(tenant=s.a).order_by("pk").values_list("pk", "role")),
        list(ForgetRequest.objects.filter(tenant=s.a).order_by("pk").values_list("pk", "status")),
        list(PortalLink.objects.filter(tenant=s.a).order_by("pk").values_list("pk", "revoked_at")),
    )


def _body(response) -> str:
    raw = b"".join(response.streaming_content) if response.streaming else response.content
    return raw.decode("utf-8", errors="replace")


def _comparable(body: str, object_id) -> str:
    """A page with the object id it was asked for (and the per-request CSRF token) blanked."""
    body = re.sub(r'name="csrfmiddlewaretoken" value="[^"]*"', "", body)
    return re.sub(rf"(?<!\w){object_id}(?!\w)", "<id>", body)


# --- the matrix ----------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "identity"), CELLS)
def test_admin_matrix(row: Row, identity: str, staff_identities, db):
    s = staff_identities
    want = expected(row, identity)
    client = s.client(identity, fresh=row.spec.kind == "logout")
    path = _path(row, s)
    before = _state(s)
    audit_mark = AuditEvent.objects.order_by("-pk").values_list("pk", flat=True).first() or 0

    response = client.get(path) if row.method == "GET" else client.post(path, _form(row, s))
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
    outsider = identity in ("other_tenant", "no_membership", "anonymous")
    markers = (
        *(set(MARKERS_A.values()) if outsider else ()),
        *(() if identity == "other_tenant" else MARKERS_B.values()),
    )
    for marker in markers:
        if marker == "adm-other" and identity == "other_tenant":
            continue  # its own username
        at = body.find(marker)
        assert at < 0, f"{identity} saw {marker!r}: …{body[max(0, at - 300) : at + 100]}…"
    if row.spec.kind == "changelist" and row.method == "GET" and response.status_code == 200:
        # Positive control: the list does show the identity's own tenant's row.
        own = MARKERS_B if identity == "other_tenant" else MARKERS_A
        assert own[row.spec.model] in body, f"{identity}'s {row.spec.model} list misses its own row"

    after = _state(s)
    if writes(row, identity):
        assert after != before, f"{row.id} as {identity}: the allowed write changed nothing"
    else:
        assert after == before, f"{row.id} as {identity} changed tenant A's data"

    if identity in ("other_tenant", "no_membership", "anonymous"):
        leaked = AuditEvent.objects.filter(pk__gt=audit_mark, tenant=s.a).count()
        assert leaked == 0, "a request from outside tenant A was audited in tenant A's log"
    if identity == "other_tenant" and want == 404 and {"object_id", "tenant_id"} & set(row.route.converters):
        ghost_id = 987654321
        ghost_path = _path(row, s, object_id=ghost_id)
        ghost = client.get(ghost_path) if row.method == "GET" else client.post(ghost_path, _form(row, s))
        own_id = str(s.objects.get(row.spec.model, 0) if "object_id" in row.route.converters else s.a.pk)
        same = (ghost.status_code, _comparable(_body(ghost), ghost_id))
        assert same == (response.status_code, _comparable(body, own_id)), "a missing object answers differently"


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
