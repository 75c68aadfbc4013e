"""API keys, memberships, the forget-request queue, the dashboard and the audit log in the
admin; and compliance reviewers never receive a memory value from any admin page."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse
from django.utils import timezone

from audit.admin import AuditEventAdmin
from audit.models import AuditEvent
from memories import services
from memories.admin.memories import MemoryAdmin
from memories.api.auth import LAST_USED_RESOLUTION  # noqa: F401 (documents where last_used_at comes from)
from memories.models import ApiKey, ForgetRequest, Membership, Memory, Tenant, TokenUsageDay, hash_api_key
from tests.factories import ROLES, SYSTEM, logged_in, make_key, make_staff, make_tenant, write
from zeromem.kernel.errors import NotFound

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role

CANARY = "CANARY-value-compliance-5b1e"


# --- API keys -------------------------------------------------------------------------------


def test_admin_creates_a_key_shown_once_with_a_copy_button(tenant_a, staff_clients, client):
    user, admin_client = staff_clients["admin"]
    response = admin_client.post(
        "/admin/memories/apikey/add/",
        {
            "tenant": tenant_a.pk,
            "name": "support-bot",
            "scopes": ["memory:read", "memory:search"],
            "allowed_prefixes": "user:u10086:\n",
            "expires_in_days": "30",
        },
    )
    assert response.status_code == 200, response.content.decode()[:2000]
    body = response.content.decode()
    raw = re.search(r'id="new-api-key"[^>]*value="(zm_[^"]+)"', body).group(1)
    assert 'id="copy-api-key"' in body and "no-store" in response["Cache-Control"]
    key = ApiKey.objects.get(tenant=tenant_a, name="support-bot")
    assert key.key_hash == hash_api_key(raw) and raw.startswith(key.display_prefix + "_")
    assert (key.scopes, key.allowed_prefixes, key.created_by) == (
        ["memory:read", "memory:search"],
        ["user:u10086:"],
        user,
    )
    assert key.expires_at > timezone.now() + timedelta(days=29)
    # shown once: the key's page and the list show only the public prefix
    for url in (f"/admin/memories/apikey/{key.pk}/change/", "/admin/memories/apikey/"):
        page = admin_client.get(url).content.decode()
        assert key.display_prefix in page and raw not in page
    (event,) = AuditEvent.objects.filter(tenant=tenant_a, action="api_key.create", actor_kind="staff")
    assert event.target == key.display_prefix and raw not in str(event.detail)
    # and it works
    used = client.get("/api/v1/memories", headers={"Authorization": f"Bearer {raw}"})
    assert used.status_code == 200


def test_key_form_rejects_a_bad_prefix_with_a_clear_error(tenant_a, staff_clients):
    _user, client = staff_clients["admin"]
    response = client.post(
        "/admin/memories/apikey/add/",
        {"tenant": tenant_a.pk, "name": "x", "scopes": ["memory:read"], "allowed_prefixes": "bad prefix"},
    )
    assert response.status_code == 200
    assert "allowed_prefixes" in response.context["adminform"].form.errors
    assert not ApiKey.objects.filter(tenant=tenant_a).exists()


def test_key_form_refuses_a_name_the_service_refuses_as_a_form_error(tenant_a, staff_clients):
    _user, client = staff_clients["admin"]
    response = client.post(
        "/admin/memories/apikey/add/", {"tenant": tenant_a.pk, "name": "bot\x01", "scopes": ["memory:read"]}
    )
    assert response.status_code == 200
    assert "control characters" in str(response.context["adminform"].form.errors["name"])
    assert not ApiKey.objects.filter(tenant=tenant_a).exists()


def test_key_form_normalises_entries_and_says_what_each_covers(tenant_a, staff_clients):
    _user, client = staff_clients["admin"]
    response = client.post(
        "/admin/memories/apikey/add/",
        {
            "tenant": tenant_a.pk,
            "name": "x",
            "scopes": ["memory:read"],
            "allowed_prefixes": " user:u1 \ntask:\ntask:\n",
        },
    )
    assert response.status_code == 200
    assert ApiKey.objects.get(tenant=tenant_a).allowed_prefixes == ["user:u1", "task:"]
    shown = [str(m) for m in response.wsgi_request._messages]
    assert "Allowlist: 'user:u1' covers the key user:u1 and the keys under user:u1: (not user:u10:…)." in shown


def test_admin_revokes_a_key_and_sees_last_used(tenant_a, staff_clients, client):
    key, raw = make_key(tenant_a, name="old-bot")
    client.get("/api/v1/memories", headers={"Authorization": f"Bearer {raw}"})
    _user, admin_client = staff_clients["admin"]
    listing = admin_client.get("/admin/memories/apikey/")
    key.refresh_from_db()
    assert key.last_used_at is not None
    assert "active" in listing.content.decode()
    admin_client.post("/admin/memories/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert client.get("/api/v1/memories", headers={"Authorization": f"Bearer {raw}"}).status_code == 401
    assert AuditEvent.objects.filter(tenant=tenant_a, action="api_key.revoke", actor_kind="staff").count() == 1


@pytest.mark.parametrize("role", ["viewer", "support", "compliance"])
def test_the_key_services_refuse_staff_below_the_admin_role_and_audit_it(tenant_a, role):
    # The admin pages check keys.manage; the services did not: any staff actor (any surface
    # that calls them) created and revoked keys, with any scope.
    from zeromem.kernel.actors import staff_actor
    from zeromem.kernel.errors import Forbidden

    key, raw = make_key(tenant_a, name="bot")
    actor = staff_actor(user=make_staff(tenant_a, role, f"{role}-x"), role=role)
    with pytest.raises(Forbidden):
        services.api_key_create(tenant=tenant_a, actor=actor, name="mine", scopes=["memory:read", "audit:read"])
    with pytest.raises(Forbidden):
        services.api_key_revoke(tenant=tenant_a, actor=actor, key_id=key.pk)
    assert list(ApiKey.objects.filter(tenant=tenant_a)) == [key]
    key.refresh_from_db()
    assert key.revoked_at is None
    denied = AuditEvent.objects.filter(tenant=tenant_a, outcome="denied", actor_kind="staff").order_by("pk")
    assert [(e.action, e.detail.get("code")) for e in denied] == [
        ("api_key.create", "admin_role_required"),
        ("api_key.revoke", "admin_role_required"),
    ]


def test_a_tenant_admin_grants_a_key_no_scope_the_role_does_not_hold(tenant_a, monkeypatch):
    from zeromem.kernel import actors
    from zeromem.kernel.errors import InvalidInput

    admin_user = make_staff(tenant_a, "admin", "ada")
    actor = actors.staff_actor(user=admin_user, role="admin")
    key, _raw = services.api_key_create(tenant=tenant_a, actor=actor, name="ok", scopes=["audit:read"])
    assert key.scopes == ["audit:read"]
    # A role that holds every admin scope but not one a key asks for (a scope added later).
    monkeypatch.setitem(actors.ROLE_SCOPES, "admin", actor.scopes - {"audit:read"} | {"x"})
    narrower = actors.staff_actor(user=admin_user, role="admin")
    monkeypatch.setattr("memories.services.tenants.TENANT_ADMIN_SCOPES", narrower.scopes)
    with pytest.raises(InvalidInput) as refused:
        services.api_key_create(tenant=tenant_a, actor=narrower, name="more", scopes=["audit:read"])
    assert (refused.value.field, refused.value.code) == ("scopes", "scope_not_held")
    assert ApiKey.objects.filter(tenant=tenant_a).count() == 1


def test_only_a_superuser_or_the_system_creates_tenants_and_changes_their_settings(tenant_a):
    # The Tenant page is the superuser's (the admin checks it); the services checked nothing:
    # a tenant admin's actor changed its tenant's limits and sensitivity rules, and created tenants.
    from zeromem.kernel.actors import staff_actor
    from zeromem.kernel.errors import Forbidden

    tenant_admin = staff_actor(user=make_staff(tenant_a, "admin", "tina"), role="admin")
    with pytest.raises(Forbidden):
        services.tenant_settings_update(
            tenant=tenant_a, actor=tenant_admin, name="Renamed", value_max_bytes=1, trash_retention_days=None
        )
    with pytest.raises(Forbidden):
        services.tenant_create(actor=tenant_admin, slug="mine")
    tenant_a.refresh_from_db()
    assert tenant_a.value_max_bytes is None and tenant_a.name != "Renamed"
    assert not Tenant.objects.filter(slug="mine").exists()
    denied = AuditEvent.objects.filter(tenant=tenant_a, action="tenant.update", outcome="denied")
    assert denied.count() == 1
    boss = get_user_model().objects.create_superuser("boss", password=None)
    as_superuser = staff_actor(user=boss, role="admin")
    services.tenant_settings_update(
        tenant=tenant_a, actor=as_superuser, name="Renamed", value_max_bytes=None, trash_retention_days=None
    )
    assert services.tenant_create(actor=as_superuser, slug="theirs").slug == "theirs"
    tenant_a.refresh_from_db()
    assert tenant_a.name == "Renamed"


# --- memberships -----------------------------------------------------------------------------


def test_admin_adds_changes_and_removes_members_through_the_service(tenant_a, staff_clients):
    _user, client = staff_clients["admin"]
    newcomer = get_user_model().objects.create_user(username="newcomer", password="x", is_staff=True)
    response = client.post(
        "/admin/memories/membership/add/", {"tenant": tenant_a.pk, "username": "newcomer", "role": "viewer"}
    )
    assert response.status_code == 302, response.content.decode()[:1500]
    membership = Membership.objects.get(tenant=tenant_a, user=newcomer)
    newcomer.refresh_from_db()
    assert membership.role == "viewer" and newcomer.is_staff
    client.post(f"/admin/memories/membership/{membership.pk}/change/", {"role": "support"})
    membership.refresh_from_db()
    assert membership.role == "support"
    client.post(f"/admin/memories/membership/{membership.pk}/delete/", {"post": "yes"})
    assert not Membership.objects.filter(pk=membership.pk).exists()
    events = AuditEvent.objects.filter(tenant=tenant_a, actor_kind="staff", action__startswith="membership.")
    assert [(e.action, e.target, e.detail.get("role")) for e in events.order_by("pk")] == [
        ("membership.set", "newcomer", "viewer"),
        ("membership.set", "newcomer", "support"),
        ("membership.remove", "newcomer", "support"),
    ]


def test_the_membership_form_does_not_tell_whether_a_username_exists(tenant_a, staff_clients):
    """A tenant admin gets one answer for a name that does not exist, an inactive account and
    an account that is not staff: a whole-page comparison, names aside. None becomes staff."""
    _user, client = staff_clients["admin"]
    User = get_user_model()
    User.objects.create_user(username="customer", password="x")  # e.g. a user of another app
    User.objects.create_user(username="gone", password="x", is_staff=True, is_active=False)
    pages = {}
    for name in ("nobody", "customer", "gone"):
        response = client.post(
            "/admin/memories/membership/add/", {"tenant": tenant_a.pk, "username": name, "role": "viewer"}
        )
        assert response.status_code == 200
        assert response.context["adminform"].form.errors["username"] == [services.memberships.NOT_ADDABLE]
        text = response.content.decode()
        pages[name] = re.sub(r'name="csrfmiddlewaretoken" value="[^"]*"', "", text).replace(name, "<name>")
    assert pages["nobody"] == pages["customer"] == pages["gone"]
    assert not Membership.objects.filter(user__username__in=["nobody", "customer", "gone"]).exists()
    assert not User.objects.get(username="customer").is_staff
    # The form refused before any service call wrote anything.
    assert not AuditEvent.objects.filter(action="membership.set", actor_kind="staff").exists()


def test_only_a_superuser_makes_an_account_staff_by_adding_it(tenant_a, superuser_client):
    _root, client = superuser_client
    customer = get_user_model().objects.create_user(username="customer", password="x")
    response = client.post(
        "/admin/memories/membership/add/", {"tenant": tenant_a.pk, "username": "customer", "role": "viewer"}
    )
    assert response.status_code == 302, response.content.decode()[:1000]
    customer.refresh_from_db()
    assert customer.is_staff and Membership.objects.filter(tenant=tenant_a, user=customer).exists()


def test_the_service_refuses_a_tenant_admin_adding_a_non_staff_account(tenant_a, staff_clients):
    from zeromem.kernel.actors import staff_actor
    from zeromem.kernel.errors import InvalidInput

    admin_user, _client = staff_clients["admin"]
    get_user_model().objects.create_user(username="customer", password="x")
    actor = staff_actor(user=admin_user, role="admin")
    with pytest.raises(InvalidInput) as refused:
        services.membership_set(tenant=tenant_a, actor=actor, username="customer", role="viewer")
    assert (refused.value.field, refused.value.message) == ("username", services.memberships.NOT_ADDABLE)
    assert not get_user_model().objects.get(username="customer").is_staff


def test_an_admin_cannot_add_members_to_a_tenant_they_do_not_administer(tenant_a, tenant_b, staff_clients):
    _user, client = staff_clients["admin"]
    get_user_model().objects.create_user(username="spy", password="x")
    response = client.post(
        "/admin/memories/membership/add/", {"tenant": tenant_b.pk, "username": "spy", "role": "admin"}
    )
    assert response.status_code == 200  # the tenant is not a valid choice
    assert "tenant" in response.context["adminform"].form.errors
    assert not Membership.objects.filter(tenant=tenant_b).exists()


# --- forget requests -------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["support", "compliance", "admin"])
def test_staff_files_a_forget_request_for_a_subject_and_sees_the_receipt(
    role, tenant_a, staff_clients, django_capture_on_commit_callbacks
):
    write(tenant_a, "user:u10086:pref_lang", CANARY)
    write(tenant_a, "user:u10086:diet", "vegan")
    write(tenant_a, "user:u2:pref_lang", "en")
    user, client = staff_clients[role]
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            "/admin/memories/forgetrequest/add/",
            {"tenant": tenant_a.pk, "subject": "u10086", "reason": "GDPR art. 17 request by email", "due_in_days": 7},
        )
    request = ForgetRequest.objects.get(tenant=tenant_a)
    assert response.status_code == 302 and response["Location"] == reverse(
        "admin:memories_forgetrequest_change", args=[request.pk]
    )
    assert (request.subject, request.reason, request.requested_by_kind, request.requested_by) == (
        "u10086",
        "GDPR art. 17 request by email",
        "staff",
        str(user.pk),
    )
    page = client.get(response["Location"]).content.decode()
    assert "completed" in page and "&quot;memories&quot;: 2" in page and user.username in page
    assert CANARY not in page


def test_viewer_cannot_file_a_forget_request(tenant_a, staff_clients):
    _user, client = staff_clients["viewer"]
    response = client.post(
        "/admin/memories/forgetrequest/add/", {"tenant": tenant_a.pk, "subject": "u1", "reason": "x", "due_in_days": 7}
    )
    assert response.status_code == 403 and not ForgetRequest.objects.exists()


def test_forget_request_form_errors_name_the_field(tenant_a, staff_clients):
    _user, client = staff_clients["support"]
    response = client.post(
        "/admin/memories/forgetrequest/add/",
        {"tenant": tenant_a.pk, "subject": "", "reason": "x", "due_in_days": 45},
    )
    errors = response.context["adminform"].form.errors
    assert set(errors) == {"subject", "due_in_days"} and not ForgetRequest.objects.exists()


def test_forget_queue_lists_overdue_first_then_by_due_date(tenant_a, staff_clients):
    now = timezone.now()
    made = {}
    for name, days, status in (
        ("done", -5, "completed"),
        ("later", 20, "received"),
        ("late", -1, "received"),
        ("soon", 2, "running"),
    ):
        fr = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject=name, reason=name)
        ForgetRequest.objects.filter(pk=fr.pk).update(due_at=now + timedelta(days=days), status=status)
        made[name] = fr.pk
    _user, client = staff_clients["compliance"]
    rows = client.get("/admin/memories/forgetrequest/").context["cl"].result_list
    assert [r.subject for r in rows] == ["late", "soon", "later", "done"]
    overdue = client.get("/admin/memories/forgetrequest/?overdue=yes").context["cl"].result_list
    assert [r.subject for r in overdue] == ["late"]


def _plans(queries, table: str) -> list[str]:
    """EXPLAIN ANALYZE of each captured SELECT that reads ``table`` (PostgreSQL)."""
    from django.db import connection, transaction

    plans = []
    for sql in [q["sql"] for q in queries if q["sql"].startswith("SELECT") and f'FROM "{table}"' in q["sql"]]:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL max_parallel_workers_per_gather = 0")
            cursor.execute("EXPLAIN (ANALYZE, COSTS) " + sql)
            plans.append("\n".join(line for (line,) in cursor.fetchall()))
    return plans


def _many_done_requests(tenant, count: int) -> None:
    """``count`` completed forget requests of ``tenant`` in one INSERT … SELECT (PostgreSQL)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO memories_forgetrequest (status, subject, prefix, keys, reason, requested_by_kind,"
            " requested_by, created_at, due_at, started_at, completed_at, attempts, receipt, error, tenant_id,"
            " progress_at, reach, stalled_attempts)"
            " SELECT 'completed', 'u' || g, '', '[]', 'erasure', 'system', 'test', now() - g * interval '1 hour',"
            " now() - g * interval '1 hour' + interval '30 days', now(), now(), 1, '{}', '', %s, now(),"
            " '{}', 0 FROM generate_series(1, %s) g",
            [tenant.pk, count],
        )


@pytest.mark.postgres
@pytest.mark.parametrize(
    "query", ["", "?overdue=yes", "?overdue=open", "?status__exact=completed", "?p=3", "?q=u4242", "?o=7"]
)
def test_the_forget_queue_reads_an_index_of_its_tenant_not_every_request_it_kept(
    transactional_db, tenant_a, tenant_b, staff_clients, query
):
    # Requests are kept with their receipts: the queue's order (a CASE over status and due
    # date), a column sort or a substring search sorted or scanned every request the tenant
    # ever filed — 0.8-1.7 s a page at 1M requests. (transactional_db: the rows are truncated
    # afterwards, not left as dead rows that would tilt later tests' plans.)
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1", reason="erasure")
    _many_done_requests(tenant_a, 5000)
    _many_done_requests(tenant_b, 30000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE memories_forgetrequest")
    _user, client = staff_clients["compliance"]
    with CaptureQueriesContext(connection) as queries:
        response = client.get(f"/admin/memories/forgetrequest/{query}")
    assert response.status_code == 200
    plans = _plans(queries, "memories_forgetrequest")
    assert plans
    for plan in plans:
        assert "Seq Scan" not in plan, plan
        discarded = [int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan)]
        assert all(n < 100 for n in discarded), plan  # no walk over the tenant's done requests
        if plan.startswith("Aggregate"):
            continue  # the capped count: at most 10,000 rows, in the list's order, by design
        sorted_rows = [int(n) for n in re.findall(r"(?m)^\s*(?:->\s*)?Sort\s+\(cost=\S+ rows=(\d+)", plan)]
        assert all(n < 100 for n in sorted_rows), plan  # a sort of the few open requests at most
    if query.startswith("?q="):
        assert any("forget_tenant_subject" in plan for plan in plans), plans


def test_the_forget_queue_finds_a_subject_by_its_whole_id(tenant_a, staff_clients):
    for subject in ("u42", "u4242", "U42"):
        services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject=subject, reason="erasure")
    _user, client = staff_clients["compliance"]
    rows = client.get("/admin/memories/forgetrequest/?q=u42").context["cl"].result_list
    assert [r.subject for r in rows] == ["u42"]


def test_reading_the_forget_queue_in_the_admin_is_audited_as_the_rest_api_is(tenant_a, tenant_b, staff_clients):
    # GET /api/v1/forget-requests[/<id>] record forget.list / forget.read; the admin's queue,
    # its search by an end user's whole subject and a request's page (subject, reason,
    # receipt) recorded nothing.
    mine = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u42", reason="erasure")
    services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u7", reason="erasure")
    theirs = services.forget_request_create(tenant=tenant_b, actor=SYSTEM, subject="u42", reason="erasure")
    user, client = staff_clients["viewer"]
    readings = AuditEvent.objects.filter(tenant=tenant_a, action__in=["forget.list", "forget.read"]).order_by("pk")

    assert client.get("/admin/memories/forgetrequest/?q=u42").status_code == 200
    assert client.get("/admin/memories/forgetrequest/").status_code == 200
    for page in ("change", "history"):
        assert client.get(f"/admin/memories/forgetrequest/{mine.pk}/{page}/").status_code == 200
    assert client.get(f"/admin/memories/forgetrequest/{theirs.pk}/change/").status_code == 404
    got = [(e.action, e.actor_id, e.subject, e.count, e.detail) for e in readings]
    assert got == [
        ("forget.list", str(user.pk), "u42", 1, {}),
        ("forget.list", str(user.pk), "", 2, {}),
        # The request named by its uid (the tenant reads its log: README "Opaque ids").
        ("forget.read", str(user.pk), "", None, {"forget_request": str(mine.uid)}),
        ("forget.read", str(user.pk), "", None, {"forget_request": str(mine.uid)}),
    ]
    assert not AuditEvent.objects.filter(tenant=tenant_b, action__in=["forget.list", "forget.read"]).exists()


# --- dashboard -------------------------------------------------------------------------------


def test_dashboard_charts_and_figures_per_tenant(tenant_a, tenant_b, staff_clients, api):
    write(tenant_a, "user:u1:pref_lang", "en")
    write(tenant_a, "user:u1:diet", "vegan and no nuts at all, please")
    write(tenant_a, "task:t1:status", "done", ttl_seconds=3600)
    write(tenant_b, "user:u9:pref_lang", "fr")
    for _ in range(3):
        api.call("memory_read", key="user:u1:pref_lang")
    api.call("memory_read", key="user:u1:missing")
    late = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u5", reason="x")
    ForgetRequest.objects.filter(pk=late.pk).update(due_at=timezone.now() - timedelta(days=1))
    _user, client = staff_clients["compliance"]
    response = client.get(f"/admin/memories/tenant/{tenant_a.pk}/dashboard/")
    assert response.status_code == 200
    body = response.content.decode()
    assert body.count("<svg") >= 3 and "http://" not in body.split("<svg", 1)[1].split("</svg>")[0]
    assert 'aria-label="memories by category"' in body and "<title>user: 2</title>" in body
    assert "<title>user:u1: 2</title>" in body and "<title>task:t1: 1</title>" in body
    assert re.search(r'class="ops-reads">3<', body) and re.search(r'class="ops-misses">1<', body)
    assert re.search(r'class="zm-figure forget-open">1<', body)
    assert re.search(r'class="zm-figure forget-overdue"[^>]*>1<', body)
    assert "user:u9" not in body  # tenant B's data stays out
    tokens = response.context["tokens"]
    assert tokens["reads"] == 3 and tokens["saved"] == 3 * tokens["per_read"]
    # next to it, the tokens the 4 tool results cost (their ZeroMem-Result-Tokens, summed)
    returned = TokenUsageDay.objects.get(tenant=tenant_a)
    assert returned.results == 4 and tokens["returned"] == returned.tokens > 0
    assert re.search(rf'class="tokens-returned-total">{returned.tokens}<', body)
    # compliance sees figures, never the expiring keys' links into memories
    assert response.context["expiring_count"] == 1 and "task:t1:status</a>" not in body


def test_dashboard_uses_no_external_assets(tenant_a, staff_clients):
    _user, client = staff_clients["viewer"]
    body = client.get(f"/admin/memories/tenant/{tenant_a.pk}/dashboard/").content.decode()
    assert not re.search(r'(src|href)="(https?:)?//', body)


# --- audit log -------------------------------------------------------------------------------


def test_audit_log_filters(tenant_a, staff_clients):
    user, support = staff_clients["support"]
    memory = write(tenant_a, "user:u10086:pref_lang", "en")
    support.get(f"/admin/memories/memory/{memory.pk}/change/")
    with pytest.raises(NotFound):
        services.memory_read(tenant=tenant_a, actor=SYSTEM, key="user:u404:x")
    _user, client = staff_clients["compliance"]

    def actions(query):
        response = client.get(f"/admin/audit/auditevent/?{query}")
        assert response.status_code == 200, query
        return [e.action for e in response.context["cl"].result_list]

    assert actions(f"actor={user.username}") == ["memory.view"]
    assert actions(f"actor=staff:{user.pk}") == ["memory.view"]
    assert actions(f"actor=api_key:{user.pk}") == []
    # A bare id is ambiguous (API keys and staff users are both numbered): refused, saying how.
    response = client.get(f"/admin/audit/auditevent/?actor={user.pk}", follow=True)
    assert not response.context["cl"].result_list
    assert f"staff:{user.pk}" in " ".join(str(m) for m in response.context["messages"])
    assert actions("action=memory.write") == ["memory.write"]
    assert actions("key_prefix=user:u10086:") == ["memory.view", "memory.write"]
    assert actions("subject=u10086") == ["memory.view", "memory.write"]
    assert actions("outcome=not_found") == ["memory.read"]
    # The day of the event itself, not of the clock now (a test run across midnight UTC).
    day = timezone.localtime(AuditEvent.objects.get(action="memory.view").occurred_at).date().isoformat()
    assert "memory.view" in actions(f"since={day}&until={day}")
    assert actions("since=2000-01-01&until=2000-01-02") == []
    assert actions("since=yesterday-ish") == []  # a bad date selects nothing, with a message


@pytest.mark.parametrize(
    "moment", ["until=9999-12-31", "since=9999-12-31T23:59:59-23:59", "since=0001-01-01T00:00+14:00"]
)
def test_audit_dates_past_the_calendars_end_are_a_message_naming_the_field(tenant_a, staff_clients, moment):
    write(tenant_a, "user:u1:k", "v")
    _user, client = staff_clients["compliance"]
    field = moment.split("=")[0]
    listed = client.get(f"/admin/audit/auditevent/?{moment}", follow=True)
    assert listed.status_code == 200
    assert f"{field.capitalize()}: not a date or time" in listed.content.decode()
    assert list(listed.context["cl"].result_list) == []
    exported = client.get(f"/admin/audit/auditevent/export/?fmt=csv&{moment}", follow=True)
    assert exported.status_code == 200
    assert f"{field.capitalize()}: not a date or time" in exported.content.decode()
    assert not AuditEvent.objects.filter(tenant=tenant_a, action="audit.export").exists()


@pytest.mark.parametrize("moment", ["until=9999-12-30", "until=9999-12-31T12:00", "since=0001-01-01"])
def test_audit_dates_at_the_calendars_ends_list_and_export_every_event(tenant_a, staff_clients, moment):
    # With a windowed filter (action) the list bounds its window a day past until / before
    # since: at the calendar's ends that overflowed, a 500 (the export: a cut body).
    write(tenant_a, "user:u1:k", "v")
    _user, client = staff_clients["compliance"]
    query = f"tenant={tenant_a.pk}&action=memory.write&{moment}"
    listed = client.get(f"/admin/audit/auditevent/?{query}")
    assert listed.status_code == 200
    assert [e.action for e in listed.context["cl"].result_list] == ["memory.write"]
    exported = client.get(f"/admin/audit/auditevent/export/?fmt=csv&{query}")
    assert exported.status_code == 200
    assert "memory.write" in b"".join(exported.streaming_content).decode()


@pytest.mark.parametrize(
    "url",
    [
        "/admin/memories/memory/?category=%00",
        "/admin/memories/memory/?subject=u1%00",
        "/admin/memories/memory/?tag=%00",
        "/admin/memories/memory/?prefix=user:%00",
        "/admin/memories/forgetrequest/?status=%00",
        "/admin/memories/membership/?role=%00",
        "/admin/audit/auditevent/?actor=%00",
        "/admin/audit/auditevent/?action=memory.%00",
        "/admin/audit/auditevent/?key_prefix=%00",
        "/admin/audit/auditevent/?subject=%00",
        "/admin/audit/auditevent/?outcome=%00",
        "/admin/audit/auditevent/export/?actor=%00",
        "/admin/autocomplete/?app_label=memories&model_name=forgetrequest&field_name=tenant&term=%00",
    ],
)
def test_a_nul_in_an_admin_query_parameter_is_a_400_naming_it(tenant_a, staff_clients, url):
    write(tenant_a, "user:u1:k", "v", subject="u1")
    _user, client = staff_clients["admin"]
    before = AuditEvent.objects.filter(tenant=tenant_a).count()
    response = client.get(url)
    name = url.split("?")[1].rsplit("&", 1)[-1].split("=")[0]
    assert response.status_code == 400, (url, response.status_code)
    assert f"{name}: must not contain a NUL character" in response.content.decode()
    assert AuditEvent.objects.filter(tenant=tenant_a).count() == before  # nothing browsed, listed or exported


@pytest.mark.parametrize(
    ("model", "action"),
    [
        ("memories/memory", "move_to_trash"),
        ("portal/portallink", "withdraw"),
        ("memories/apikey", "revoke"),
        ("memories/membership", "delete_selected"),
    ],
)
def test_an_action_on_ids_that_are_no_numbers_is_a_400_naming_them(tenant_a, staff_clients, model, action):
    memory = write(tenant_a, "user:u1:k", "v")
    _user, client = staff_clients["admin"]
    for selected in (["abc"], [str(memory.pk), "1\x00"]):
        response = client.post(f"/admin/{model}/", {"action": action, "_selected_action": selected, "post": "yes"})
        assert response.status_code == 400, (selected, response.status_code)
        assert "_selected_action: must be ids (whole numbers)" in response.content.decode()
    assert Memory.objects.get(pk=memory.pk).deleted_at is None


@pytest.mark.parametrize(
    "model", ["memories/memory", "memories/forgetrequest", "portal/portallink", "audit/auditevent"]
)
def test_a_tenant_filter_that_is_no_number_is_a_400_naming_it(tenant_a, staff_clients, model):
    _user, client = staff_clients["admin"]
    response = client.get(f"/admin/{model}/?tenant=acme")
    assert response.status_code == 400, response.status_code
    assert "tenant: must be a tenant id (a number)" in response.content.decode()


@pytest.mark.parametrize(
    "url",
    [
        # A search of values that is no memory.browse (unaudited) and obeys no word or length cap.
        "/admin/memories/memory/?value__icontains=secretword",
        "/admin/memories/memory/?search_text__contains=secretword",
        "/admin/memories/memory/?key__iregex=(u.*)*1",
        "/admin/memories/memory/?tenant__id__exact=1",
        # Unindexed scans of every event or row of the tenant.
        "/admin/audit/auditevent/?detail__icontains=x",
        "/admin/audit/auditevent/?actor_label__regex=.*",
        "/admin/memories/forgetrequest/?reason__icontains=x",
        "/admin/memories/forgetrequest/?status__exact=received&error__icontains=x",
        "/admin/memories/apikey/?lookup__startswith=zm",
        "/admin/memories/membership/?role__exact=viewer&user__username__startswith=a",
        "/admin/portal/portallink/?token_hash__startswith=a",
        "/admin/memories/tenant/?name__icontains=a",
    ],
)
def test_a_list_filters_only_through_its_own_filters(tenant_a, staff_clients, url):
    # Django's admin turns any other query parameter naming a column of the model into a
    # filter on it: every lookup (icontains, regex…) on every column, indexed or not.
    write(tenant_a, "user:u1:k", "secretword", subject="u1")
    _user, client = staff_clients["admin"]
    before = AuditEvent.objects.filter(tenant=tenant_a).count()
    response = client.get(url)
    name = url.split("?")[1].rsplit("&", 1)[-1].split("=")[0]
    assert response.status_code == 400, (url, response.status_code)
    assert f"{name}: is not a filter of this list" in response.content.decode()
    assert AuditEvent.objects.filter(tenant=tenant_a).count() == before  # nothing listed or browsed


@pytest.mark.parametrize(
    "url",
    [
        "/admin/memories/memory/?tenant={tenant}&state=everything&expiry=never&category=note&prefix=user:&subject=u1&tag=t",
        "/admin/memories/memory/?q=secretword&o=-1&p=1&all=&_popup=1",
        "/admin/memories/forgetrequest/?tenant={tenant}&overdue=open&status__exact=received&q=u1&o=2",
        "/admin/memories/membership/?tenant={tenant}&role__exact=admin&q=admin",
        "/admin/audit/auditevent/?tenant={tenant}&since=2026-01-01&until=2099-01-01&actor=system&action=memory."
        "&key_prefix=user:&subject=u1&outcome=ok",
        "/admin/portal/portallink/?tenant={tenant}&q=u1",
        "/admin/memories/apikey/?tenant={tenant}&q=k",
    ],
)
def test_every_filter_search_sort_and_page_parameter_of_a_list_is_taken(tenant_a, staff_clients, url):
    write(tenant_a, "user:u1:k", "secretword", subject="u1")
    _user, client = staff_clients["admin"]
    response = client.get(url.format(tenant=tenant_a.pk))
    assert response.status_code == 200, (url, response.status_code, response.content[:300])


@pytest.mark.parametrize("form", ["memory", "forgetrequest"])
def test_a_tenant_that_is_no_number_in_an_add_form_is_a_form_error(tenant_a, staff_clients, form):
    # The tenant field's autocomplete widget looked the posted value up to show it again: a
    # value that is no id was a 500 (ValueError) instead of the form's own error.
    _user, client = staff_clients["admin"]
    data = {"tenant": "acme", "key": "user:u1:k", "value": '"v"', "subject": "u1", "reason": "r", "due_in_days": 3}
    response = client.post(f"/admin/memories/{form}/add/", data)
    assert response.status_code == 200, response.status_code
    assert "tenant" in response.context["adminform"].form.errors
    assert not Memory.objects.filter(tenant=tenant_a).exists()
    assert not ForgetRequest.objects.filter(tenant=tenant_a).exists()
    # The add page takes its initial values from the URL: the same lookup, on a GET.
    for tenant in ("acme", "%00"):
        assert client.get(f"/admin/memories/{form}/add/?tenant={tenant}").status_code == 200


def test_the_lists_sort_only_by_their_indexed_columns(tenant_a, staff_clients):
    # Any other column (o=<its index>, a header click or a hand-made URL) sorted every event or
    # memory in scope: 160-400 ms on 1M events instead of under 1 ms, growing with the table.
    write(tenant_a, "user:u1:b", "v", category="task")
    write(tenant_a, "user:u1:a", "v", category="user")
    services.memory_read(tenant=tenant_a, actor=SYSTEM, key="user:u1:a")
    _user, client = staff_clients["admin"]

    def rows(url):
        response = client.get(url)
        assert response.status_code == 200
        return list(response.context["cl"].result_list)

    memory_events = "/admin/audit/auditevent/?action=memory."  # (reading the list adds audit.list events)
    newest_first = [e.pk for e in rows(memory_events)]
    assert len(newest_first) == 3 and newest_first == sorted(newest_first, reverse=True)
    action = AuditEventAdmin.list_display.index("action")
    assert [e.pk for e in rows(f"{memory_events}&o={action}")] == newest_first
    assert [e.pk for e in rows(f"{memory_events}&o=-{action}.1")] == newest_first
    category = 1 + MemoryAdmin.list_display.index("category")  # (column 0: the actions' checkbox)
    assert [m.key for m in rows(f"/admin/memories/memory/?o={category}")] == ["user:u1:a", "user:u1:b"]
    assert [m.key for m in rows("/admin/memories/memory/?o=-1")] == ["user:u1:b", "user:u1:a"]  # by key: indexed
    header = client.get("/admin/audit/auditevent/").content.decode()
    assert f"?o={action}" not in header and "?o=0" in header  # only sortable columns link a sort


@pytest.mark.postgres
def test_the_audit_list_of_a_reviewer_of_two_tenants_reads_a_page_of_the_index(
    transactional_db, tenant_a, tenant_b, staff_clients
):
    """Sorted by time alone, a reviewer of several tenants had every event of theirs sorted on
    each page (348 ms at 1M events); led by the tenant, the page is a merge of index ranges
    (1.4 ms). (transactional_db: the rows are truncated afterwards.)"""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    with connection.cursor() as cursor:
        for tenant in (tenant_a, tenant_b):
            cursor.execute(
                "INSERT INTO audit_auditevent (uid, tenant_id, occurred_at, actor_kind, actor_id, actor_label,"
                " surface, action, target, subject, outcome, request_id, detail, digest, chain, redacted)"
                " SELECT md5(%s || g::text)::uuid, %s, now() - g * interval '1 second', 'api_key', '1', 'zm_b',"
                " 'tool', 'memory.read', 'user:u' || g || ':k', 'u' || g, 'ok', '', '{}',"
                " md5(g::text) || md5(g::text), '', '{}' FROM generate_series(1, 20000) g",
                [tenant.slug, tenant.pk],
            )
        cursor.execute("ANALYZE audit_auditevent")
    user, client = staff_clients["compliance"]
    services.membership_set(tenant=tenant_b, actor=SYSTEM, username=user.username, role="compliance")
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/admin/audit/auditevent/").status_code == 200
    (page,) = [q["sql"] for q in queries if q["sql"].startswith('SELECT "audit_auditevent"."id"')]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL max_parallel_workers_per_gather = 0")
        cursor.execute("EXPLAIN (ANALYZE, COSTS) " + page)
        plan = "\n".join(line for (line,) in cursor.fetchall())
    assert "Seq Scan" not in plan and not re.search(r"(?m)^\s*(->\s*)?Sort\s+\(cost", plan), plan


def test_audit_changelist_does_not_count_the_whole_table(tenant_a, staff_clients, django_assert_max_num_queries):
    for i in range(5):
        write(tenant_a, f"user:u{i}:k", "v")
    _user, client = staff_clients["compliance"]
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        assert client.get("/admin/audit/auditevent/").status_code == 200
    counts = [
        q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper() and "audit_auditevent" in q["sql"]
    ]
    assert counts and all("LIMIT" in sql.upper() for sql in counts), counts


# --- compliance never receives a value ---------------------------------------------------------


def test_compliance_never_receives_a_memory_value_from_any_admin_page(
    tenant_a, staff_clients, django_capture_on_commit_callbacks
):
    memory = write(tenant_a, "user:u10086:pref_lang", f"{CANARY} v1", tags=["lang"])
    services.memory_update(tenant=tenant_a, actor=SYSTEM, key=memory.key, value=f"{CANARY} v2")
    trashed = write(tenant_a, "user:u10086:old", f"{CANARY} trashed")
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=trashed.key)
    _s, support = staff_clients["support"]
    support.get(f"/admin/memories/memory/{memory.pk}/change/")
    support.get(f"/admin/memories/memory/{memory.pk}/history/")
    with django_capture_on_commit_callbacks(execute=True):
        fr = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, keys=[trashed.key], reason="x")
    _c, client = staff_clients["compliance"]
    event_ids = list(AuditEvent.objects.filter(tenant=tenant_a).values_list("pk", flat=True))
    urls = [
        "/admin/",
        "/admin/memories/",
        "/admin/audit/",
        f"/admin/memories/tenant/{tenant_a.pk}/dashboard/",
        "/admin/memories/tenant/",
        f"/admin/memories/tenant/{tenant_a.pk}/change/",
        "/admin/audit/auditevent/",
        "/admin/audit/auditevent/?q=CANARY",
        "/admin/memories/forgetrequest/",
        f"/admin/memories/forgetrequest/{fr.pk}/change/",
        "/admin/memories/forgetrequest/add/",
        "/admin/memories/memory/",
        "/admin/memories/memory/?q=CANARY",
        "/admin/memories/memory/?state=trash",
        f"/admin/memories/memory/{memory.pk}/change/",
        f"/admin/memories/memory/{memory.pk}/history/",
        f"/admin/memories/memory/{trashed.pk}/change/",
        "/admin/autocomplete/?app_label=memories&model_name=memory&field_name=tenant&term=",
        "/admin/jsi18n/",
        *[f"/admin/audit/auditevent/{pk}/change/" for pk in event_ids],
    ]
    seen_ok = 0
    for url in urls:
        response = client.get(url)
        body = b"".join(response.streaming_content) if response.streaming else response.content
        assert CANARY.encode() not in body, url
        seen_ok += response.status_code == 200
    assert seen_ok >= 10 + len(event_ids)  # the audit trail itself is open to compliance
    # the audit trail names the steps (and the staff user) without any value
    trail = client.get("/admin/audit/auditevent/?key_prefix=user:u10086:pref_lang").context["cl"].result_list
    assert {e.action for e in trail} >= {"memory.write", "memory.update", "memory.view", "memory.history"}


@pytest.mark.parametrize("role", ROLES)
def test_every_role_gets_an_index_and_a_dashboard_of_its_tenant(role, tenant_a, staff_clients):
    _user, client = staff_clients[role]
    index = client.get("/admin/").content.decode()
    assert reverse("admin:memories_tenant_dashboard", args=[tenant_a.pk]) in index
    assert client.get(f"/admin/memories/tenant/{tenant_a.pk}/dashboard/").status_code == 200


def test_a_member_of_two_tenants_acts_with_each_tenants_role(tenant_a, tenant_b):
    user = make_staff(tenant_a, "support", "two-hats")
    Membership.objects.create(tenant=tenant_b, user=user, role="compliance")
    mine = write(tenant_a, "user:u1:k", "a-value")
    theirs = write(tenant_b, "user:u2:k", f"{CANARY} b-value")
    client = logged_in(user)
    assert client.get(f"/admin/memories/memory/{mine.pk}/change/").status_code == 200
    response = client.get(f"/admin/memories/memory/{theirs.pk}/change/")
    assert response.status_code == 404 and CANARY.encode() not in response.content
    assert client.get(f"/admin/audit/auditevent/?tenant={tenant_b.pk}").status_code == 200


def test_superuser_changes_tenant_settings_through_an_audited_service(tenant_a, superuser_client, staff_clients):
    user, client = superuser_client
    response = client.post(
        f"/admin/memories/tenant/{tenant_a.pk}/change/",
        {"slug": "renamed", "name": "Acme Corporation", "value_max_bytes": "4096", "trash_retention_days": ""},
    )
    assert response.status_code == 302, response.content.decode()[:1500]
    tenant_a.refresh_from_db()
    assert (tenant_a.slug, tenant_a.name, tenant_a.value_max_bytes) == ("acme", "Acme Corporation", 4096)
    (event,) = AuditEvent.objects.filter(tenant=tenant_a, action="tenant.update")
    assert (event.actor_id, event.detail) == (str(user.pk), {"changed": ["name", "value_max_bytes"]})
    # a tenant admin may not change them
    _admin, admin_client = staff_clients["admin"]
    response = admin_client.post(f"/admin/memories/tenant/{tenant_a.pk}/change/", {"name": "Hijacked"})
    assert response.status_code == 403
    tenant_a.refresh_from_db()
    assert tenant_a.name == "Acme Corporation"


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param("[" + "9" * 5000 + "]", id="integer-past-4300-digits"),  # ValueError: was a 500
        pytest.param("[" * 100_000 + "]" * 100_000, id="nested-past-the-recursion-limit"),  # was a 500
        pytest.param('["user:*:\\ud800"]', id="lone-surrogate"),  # PostgreSQL refused it: was a 500
        pytest.param('["user:*:\\u0000"]', id="nul"),  # jsonb cannot hold NUL: was a 500
        pytest.param('["user:*:\\u0007"]', id="control-character"),
    ],
)
@pytest.mark.parametrize("field", ["sensitive_keys", "sensitive_fields"])
def test_tenant_sensitivity_rules_that_cannot_be_stored_are_refused_naming_the_field(
    tenant_a, superuser_client, field, raw
):
    _user, client = superuser_client
    data = {"name": "Acme", "value_max_bytes": "", "trash_retention_days": "", "sensitive_keys": "[]"}
    data |= {"sensitive_fields": "[]", field: raw}
    before = AuditEvent.objects.filter(action="tenant.update").count()
    response = client.post(f"/admin/memories/tenant/{tenant_a.pk}/change/", data, follow=True)
    assert response.status_code == 200
    page = response.content.decode()
    reasons = ("Enter a valid JSON", "control characters", "lone surrogate")
    assert field in page and any(reason in page for reason in reasons), page[:3000]
    tenant_a.refresh_from_db()
    assert (tenant_a.sensitive_keys, tenant_a.sensitive_fields) == ([], [])
    assert AuditEvent.objects.filter(action="tenant.update", outcome="ok").count() == before


def test_compliance_exports_the_filtered_audit_log_of_one_tenant(tenant_a, tenant_b, staff_clients):
    import csv
    import io
    import json as jsonlib

    write(tenant_a, "user:u10086:pref_lang", CANARY)
    write(tenant_a, "user:u2:pref_lang", "x")
    write(tenant_b, "user:u10086:pref_lang", "globex's")
    user, client = staff_clients["compliance"]
    page = client.get("/admin/audit/auditevent/?key_prefix=user:u10086:").content.decode()
    assert 'id="audit-export-csv"' in page
    response = client.get("/admin/audit/auditevent/export/?fmt=csv&key_prefix=user:u10086:")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    body = b"".join(response.streaming_content).decode()
    rows = list(csv.DictReader(io.StringIO(body)))
    memory_rows = [(r["action"], r["target"]) for r in rows if r["action"].startswith("memory.")]
    assert memory_rows == [("memory.write", "user:u10086:pref_lang")]
    assert {r["action"] for r in rows} == {"memory.write", "audit.list", "audit.export"}  # reading is recorded
    assert CANARY not in body and "globex" not in body
    (event,) = AuditEvent.objects.filter(tenant=tenant_a, action="audit.export")
    assert (event.actor_kind, event.actor_id, event.target, event.detail["format"]) == (
        "staff",
        str(user.pk),
        "user:u10086:",
        "csv",
    )
    jsonl = client.get("/admin/audit/auditevent/export/?fmt=jsonl&action=memory.write")
    lines = [jsonlib.loads(line) for line in b"".join(jsonl.streaming_content).decode().splitlines()]
    assert sorted(line["target"] for line in lines) == ["user:u10086:pref_lang", "user:u2:pref_lang"]
    bad = client.get("/admin/audit/auditevent/export/?fmt=csv&since=soon", follow=True)
    assert "Since: not a date or time" in bad.content.decode()


@pytest.mark.parametrize(
    "param,value", [("key_prefix", "a" * 513), ("subject", "u1\x01"), ("actor", "x" * 513), ("outcome", "bogus")]
)
def test_admin_export_refuses_a_filter_the_api_refuses_naming_it_and_exports_nothing(
    tenant_a, staff_clients, param, value
):
    write(tenant_a, "user:u1:k", "v")
    _user, client = staff_clients["compliance"]
    response = client.get("/admin/audit/auditevent/export/", {"fmt": "csv", param: value}, follow=True)
    assert not response.streaming and f"{param}: must be" in response.content.decode().lower()
    assert not AuditEvent.objects.filter(tenant=tenant_a, action="audit.export").exists()


def test_an_admin_export_takes_one_of_the_tenants_slots_as_the_rest_export_does(
    tenant_a, staff_clients, counter_store, settings
):
    # GET /api/v1/audit-events/export holds one of the tenant's ZEROMEM_TENANT_MAX_CONCURRENT
    # slots while it streams; the admin's export held none: a reviewer's tabs (or a script
    # with their session) could stream any number of whole-log exports at once, each a thread.
    from audit import limits

    settings.ZEROMEM_TENANT_MAX_CONCURRENT = 1
    settings.ZEROMEM_TENANT_BUSY_WAIT_SECONDS = 0.1
    write(tenant_a, "user:u1:k", "v")
    _user, client = staff_clients["compliance"]
    url = f"/admin/audit/auditevent/export/?fmt=csv&tenant={tenant_a.pk}"
    first = client.get(url)
    assert first.status_code == 200 and first.streaming
    exports = AuditEvent.objects.filter(tenant=tenant_a, action="audit.export")
    assert exports.count() == 1
    busy = client.get(url, follow=True)  # the first still streams: refused, with a message
    assert not busy.streaming and "exports" in busy.content.decode()
    assert exports.count() == 1  # a refused export is no export
    b"".join(first.streaming_content)  # the test client closes it after the last byte: the slot is back
    second = client.get(url)
    assert second.streaming
    assert limits.slot_acquire(f"tenant:{tenant_a.pk}", limit=1, lease=60) is None  # held while it streams
    b"".join(second.streaming_content)


def test_reading_the_audit_log_in_the_admin_is_itself_audited(tenant_a, staff_clients):
    write(tenant_a, "user:u1:k", "v")
    user, client = staff_clients["compliance"]
    client.get("/admin/audit/auditevent/?key_prefix=user:u1:&outcome=ok")
    (event,) = AuditEvent.objects.filter(tenant=tenant_a, action="audit.list")
    assert (event.actor_id, event.target, event.count, event.detail) == (str(user.pk), "user:u1:", 1, {"outcome": "ok"})


def test_opening_one_audit_event_in_the_admin_is_itself_audited(tenant_a, tenant_b, staff_clients):
    # The list and the exports recorded their reading (audit.list, audit.export); the page of
    # one event (its target, subject, actor, client address and detail) and its history page
    # recorded nothing: a reviewer could read the log event by event unseen.
    write(tenant_a, "user:u1:k", "v")
    write(tenant_b, "user:u2:k", "v")
    user, client = staff_clients["compliance"]
    seen = AuditEvent.objects.get(tenant=tenant_a, action="memory.write")
    for page in ("change", "history"):
        assert client.get(f"/admin/audit/auditevent/{seen.pk}/{page}/").status_code == 200
    views = AuditEvent.objects.filter(tenant=tenant_a, action="audit.view").order_by("pk")
    assert [(e.actor_id, e.target, e.subject, e.count, e.detail) for e in views] == [
        (str(user.pk), "user:u1:k", "u1", 1, {"event": str(seen.uid)})
    ] * 2
    theirs = AuditEvent.objects.get(tenant=tenant_b, action="memory.write")
    assert client.get(f"/admin/audit/auditevent/{theirs.pk}/change/").status_code == 404
    assert not AuditEvent.objects.filter(tenant=tenant_b, action="audit.view").exists()
    assert views.count() == 2


def test_the_services_refuse_staff_whose_role_lacks_the_power_and_audit_it(tenant_a):
    from memories import services as staff_services
    from zeromem.kernel.actors import staff_actor
    from zeromem.kernel.errors import Forbidden

    memory = write(tenant_a, "user:u1:k", CANARY)
    reviewer = make_staff(tenant_a, "compliance", "rita")
    helper = make_staff(tenant_a, "support", "sue")
    as_compliance = staff_actor(user=reviewer, role="compliance")
    as_support = staff_actor(user=helper, role="support")
    for call in (
        lambda: staff_services.memory_view(tenant=tenant_a, actor=as_compliance, memory_id=memory.pk),
        lambda: staff_services.memory_versions_view(tenant=tenant_a, actor=as_compliance, memory_id=memory.pk),
        lambda: staff_services.memory_restore_version(
            tenant=tenant_a, actor=as_compliance, memory_id=memory.pk, version=1
        ),
        lambda: staff_services.membership_set(tenant=tenant_a, actor=as_support, username="rita", role="admin"),
    ):
        with pytest.raises(Forbidden):
            call()
    denied = AuditEvent.objects.filter(tenant=tenant_a, outcome="denied").order_by("pk")
    assert [e.action for e in denied] == ["memory.view", "memory.history", "memory.restore_version", "membership.set"]
    assert Membership.objects.get(tenant=tenant_a, user=reviewer).role == "compliance"


# --- browsing is audited -------------------------------------------------------------------


def test_searches_key_tree_walks_and_dashboards_are_audited_without_the_search_words(tenant_a, staff_clients):
    write(tenant_a, "user:u1:pref_lang", "Klingon spoken at home")
    user, client = staff_clients["viewer"]
    assert client.get("/admin/memories/memory/", {"q": "Klingon"}).status_code == 200
    assert client.get("/admin/memories/memory/", {"prefix": "user:u1:"}).status_code == 200
    assert client.get("/admin/memories/memory/").status_code == 200  # a plain list: not a search
    assert client.get(f"/admin/memories/tenant/{tenant_a.pk}/dashboard/").status_code == 200
    events = AuditEvent.objects.filter(tenant=tenant_a, actor_kind="staff", actor_id=str(user.pk))
    browse = list(events.filter(action="memory.browse").order_by("pk").values_list("target", "detail"))
    assert browse == [("", {"search_chars": 7}), ("user:u1:", {})], browse
    assert events.filter(action="tenant.dashboard", target=tenant_a.slug, outcome="ok").count() == 1
    assert not any("Klingon" in str(e.__dict__) for e in AuditEvent.objects.all())


def test_filtering_the_memory_list_by_an_end_user_or_a_tag_is_audited_as_a_search(tenant_a, tenant_b, staff_clients):
    # ?subject=u1 lists every memory of one end user (keys, categories, when written), ?tag= the
    # memories a tag marks: both read without an event while a search or key-tree walk is one.
    write(tenant_a, "user:u1:pref_lang", "Klingon spoken at home")
    user, client = staff_clients["viewer"]
    response = client.get("/admin/memories/memory/", {"subject": "u1"})
    assert [m.key for m in response.context["cl"].result_list] == ["user:u1:pref_lang"]
    assert client.get("/admin/memories/memory/", {"tag": "vip", "tenant": tenant_a.pk}).status_code == 200
    browse = AuditEvent.objects.filter(action="memory.browse").order_by("pk")
    got = [(e.tenant_id, e.actor_kind, e.actor_id, e.surface, e.target, e.subject, e.detail) for e in browse]
    assert got == [
        (tenant_a.pk, "staff", str(user.pk), "admin", "", "u1", {}),
        (tenant_a.pk, "staff", str(user.pk), "admin", "", "", {"tag_chars": 3}),
    ]


@pytest.mark.parametrize("query", [{"q": "Klingon"}, {"prefix": "user:u1:"}])
def test_a_search_over_more_tenants_than_it_may_cover_asks_for_a_tenant_and_records_nothing(
    transactional_db, tenant_a, superuser_client, query
):
    """Each tenant's own log (its chain, its retention, its reviewers' export) must show a
    search or key-tree walk of its memories: one event per tenant covered. A superuser's
    search over every tenant wrote one per tenant, thousands per page: past KeyTreeFilter's
    TENANTS_MAX the list asks for a tenant, shows nothing and records nothing. (transactional_db:
    the rows are truncated afterwards; rolled back, they tilted a later test's expiry plan.)"""
    tenants = [tenant_a, *(make_tenant(f"t{n:02d}") for n in range(MemoryAdmin.BROWSE_TENANTS_MAX))]
    for tenant in tenants:
        write(tenant, "user:u1:pref_lang", "Klingon spoken at home")
    user, client = superuser_client
    browsed = AuditEvent.objects.filter(action="memory.browse")

    response = client.get("/admin/memories/memory/", query)
    assert response.status_code == 200
    assert list(response.context["cl"].result_list) == []
    assert "Choose a tenant" in response.content.decode()
    assert not browsed.exists()

    response = client.get("/admin/memories/memory/", {**query, "tenant": tenants[3].pk})
    assert [m.tenant_id for m in response.context["cl"].result_list] == [tenants[3].pk]
    assert list(browsed.values_list("tenant_id", "actor_id")) == [(tenants[3].pk, str(user.pk))]


def test_a_search_over_a_few_tenants_is_recorded_in_each_of_them(tenant_a, tenant_b, superuser_client):
    write(tenant_a, "user:u1:pref_lang", "Klingon spoken at home")
    _user, client = superuser_client
    response = client.get("/admin/memories/memory/", {"q": "Klingon"})
    assert [m.tenant_id for m in response.context["cl"].result_list] == [tenant_a.pk]
    browsed = AuditEvent.objects.filter(action="memory.browse").order_by("tenant_id")
    assert list(browsed.values_list("tenant_id", flat=True)) == [tenant_a.pk, tenant_b.pk]


@pytest.mark.parametrize("source", ["memoryversion", "memoryembedding"])
def test_the_autocomplete_is_no_unaudited_search_of_memory_values(tenant_a, staff_clients, source):
    # Any model with a foreign key to Memory names it as the autocomplete's target; no admin
    # form picks a memory from a list, so the search of value words stays the memory list's,
    # where it is audited (memory.browse).
    write(tenant_a, "user:u1:pref_lang", "Klingon spoken at home")
    user, client = staff_clients["admin"]
    url = f"/admin/autocomplete/?app_label=memories&model_name={source}&field_name=memory&term=Klingon"
    response = client.get(url)
    assert response.status_code == 403, response.status_code
    assert b"user:u1:pref_lang" not in response.content
    assert not AuditEvent.objects.filter(tenant=tenant_a, action="memory.browse").exists()


def test_a_memory_search_of_too_many_words_is_a_400_naming_q_and_runs_nothing(tenant_a, staff_clients):
    # Each word is an ILIKE over every key and value of the tenant: 300 words that match took
    # 15 s on 200k memories, one DB connection and core held by one viewer's page.
    write(tenant_a, "user:u1:pref_lang", "Klingon spoken at home")
    _user, client = staff_clients["viewer"]
    assert client.get("/admin/memories/memory/", {"q": " ".join(["a"] * 9 + ["Klingon"])}).status_code == 200
    for search in (" ".join(["a"] * 11), "K" * 201):
        response = client.get("/admin/memories/memory/", {"q": search})
        assert response.status_code == 400
        assert "q: a search takes at most 10 words and 200 characters" in response.content.decode()
    assert AuditEvent.objects.filter(tenant=tenant_a, action="memory.browse").count() == 1  # the first search


def test_another_tenants_dashboard_writes_no_event_in_it(tenant_a, tenant_b, staff_clients):
    _user, client = staff_clients["admin"]
    assert client.get(f"/admin/memories/tenant/{tenant_b.pk}/dashboard/").status_code == 404
    assert not AuditEvent.objects.filter(tenant=tenant_b, action="tenant.dashboard").exists()


# --- the audit list's filters no index serves read bounded windows --------------------------


def test_an_audit_list_filter_no_index_serves_reads_windows_with_older_links(tenant_a, staff_clients, monkeypatch):
    """An actor, action or outcome filter read the tenant's whole log for each page (and its
    capped count): 85-230 ms at 1M events, growing with the log. As the REST review list does,
    a page reads the matches among the tenant's newest LIST_SCAN_MAX events below its cursor
    (``before``), and links the older ones."""
    monkeypatch.setattr("audit.selectors.LIST_SCAN_MAX", 10)
    user, client = staff_clients["compliance"]
    with pytest.raises(NotFound):
        services.memory_read(tenant=tenant_a, actor=SYSTEM, key="user:u1:missing")  # the oldest: not_found
    for n in range(25):
        write(tenant_a, f"user:u1:k{n}", "v")
    found, pages, url = [], 0, "/admin/audit/auditevent/?outcome=not_found"
    while url:
        response = client.get(url)
        assert response.status_code == 200
        found += [e.action for e in response.context["cl"].result_list]
        older = re.search(r'href="(\?[^"]*before=\d+[^"]*)" id="audit-older"', response.content.decode())
        url = older and "/admin/audit/auditevent/" + older.group(1).replace("&amp;", "&")
        pages += 1
    assert found == ["memory.read"] and pages >= 3  # empty windows first, then the match
    readings = AuditEvent.objects.filter(tenant=tenant_a, action="audit.list", actor_id=str(user.pk)).order_by("pk")
    assert len(readings) == pages and "before" in readings.last().detail  # each window read is recorded
    # Without such a filter the list reads its index a page at a time: no window, no link.
    assert 'id="audit-older"' not in client.get("/admin/audit/auditevent/").content.decode()
    assert client.get("/admin/audit/auditevent/?before=x").status_code == 400


def test_a_windowed_audit_filter_over_several_tenants_asks_for_one(tenant_a, tenant_b, superuser_client):
    # The windows are the tenant's own events: a filter no index serves lists one tenant.
    write(tenant_a, "user:u1:k", "v")
    _user, client = superuser_client
    response = client.get("/admin/audit/auditevent/?action=memory.write")
    assert response.status_code == 200 and list(response.context["cl"].result_list) == []
    assert "Choose a tenant" in response.content.decode()
    response = client.get(f"/admin/audit/auditevent/?action=memory.write&tenant={tenant_a.pk}")
    assert [e.action for e in response.context["cl"].result_list] == ["memory.write"]


@pytest.mark.postgres
@pytest.mark.parametrize("query", ["outcome=denied", "action=tool.", "actor=nobody", "actor=zm_b&action=memory.read"])
def test_an_audit_list_filter_no_index_serves_reads_at_most_a_window(transactional_db, tenant_a, staff_clients, query):
    """A rare (or absent) match read every event of the tenant, for the page and for its capped
    count; now at most LIST_SCAN_MAX entries of audit_unsealed (tenant, id) per query.
    (transactional_db: the rows are truncated afterwards.)"""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from audit.selectors import LIST_SCAN_MAX

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO audit_auditevent (uid, tenant_id, occurred_at, actor_kind, actor_id, actor_label,"
            " surface, action, target, subject, outcome, request_id, detail, digest, chain, redacted)"
            " SELECT md5(%s || g::text)::uuid, %s, now() - g * interval '1 second', 'api_key', '1', 'zm_b',"
            " 'tool', 'memory.read', 'user:u' || g || ':k', 'u' || g, 'ok', '', '{}',"
            " md5(g::text) || md5(g::text), '', '{}' FROM generate_series(1, 30000) g",
            [tenant_a.slug, tenant_a.pk],
        )
        cursor.execute("ANALYZE audit_auditevent")
    _user, client = staff_clients["compliance"]
    with CaptureQueriesContext(connection) as queries:
        response = client.get(f"/admin/audit/auditevent/?{query}")
    assert response.status_code == 200
    reads = [q["sql"] for q in queries if "audit_auditevent" in q["sql"] and "ORDER BY" in q["sql"]]
    assert reads
    for sql in reads:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL max_parallel_workers_per_gather = 0")
            cursor.execute("EXPLAIN (ANALYZE, COSTS) " + sql)
            plan = "\n".join(line for (line,) in cursor.fetchall())
        # (the planner reads the empty partitions ahead with a Seq Scan: no rows)
        read = [int(n) for n in re.findall(r"(?m)Scan.*actual time=\S+ rows=(\d+)", plan)]
        read += [int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan)]
        assert read and max(read) <= LIST_SCAN_MAX + 1, plan


def test_a_refused_audit_filter_records_no_reading(tenant_a, staff_clients):
    write(tenant_a, "user:u1:k", "v")
    _user, client = staff_clients["compliance"]
    for query in ("since=yesterday", "outcome=ok&since=yesterday", "actor=" + "a" * 600):
        response = client.get(f"/admin/audit/auditevent/?{query}")
        assert response.status_code == 200 and list(response.context["cl"].result_list) == [], query
    assert not AuditEvent.objects.filter(action="audit.list").exists()
    assert client.get("/admin/audit/auditevent/?outcome=denied").status_code == 200  # valid, nothing found
    assert AuditEvent.objects.filter(tenant=tenant_a, action="audit.list", count=0).count() == 1
