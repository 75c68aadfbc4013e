"""Tenant scoping and roles in the admin: each role, against another tenant's objects and
against objects its role may not open, by URL directly."""

from __future__ import annotations

import json

import pytest

from audit.models import AuditEvent
from memories import services
from memories.models import ApiKey, ForgetRequest, Membership, Memory, MemoryVersion
from tests.factories import ROLES, SYSTEM, logged_in, make_key, make_staff, write

CANARY_A = "CANARY-admin-acme-41d2"
CANARY_B = "CANARY-admin-globex-9e7c"

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role


@pytest.fixture
def other_tenant_objects(tenant_b):
    """Tenant B's memory (with two versions), forget request, key, membership and audit event."""
    memory = write(tenant_b, "user:u20002:pref_lang", f"{CANARY_B} v1")
    services.memory_update(tenant=tenant_b, actor=SYSTEM, key=memory.key, value=f"{CANARY_B} v2")
    key, _raw = make_key(tenant_b, name="globex-bot")
    forget = services.forget_request_create(tenant=tenant_b, actor=SYSTEM, subject="u20002", reason="globex")
    membership = Membership.objects.get(user=make_staff(tenant_b, "admin", "globex-admin"))
    event = AuditEvent.objects.filter(tenant=tenant_b).order_by("-pk").first()
    return {
        "memory": memory,
        "key": key,
        "forget": forget,
        "membership": membership,
        "event": event,
        "tenant": tenant_b,
    }


def _object_urls(objs) -> list[tuple[str, str]]:
    m, k, f, ms, e = objs["memory"], objs["key"], objs["forget"], objs["membership"], objs["event"]
    return [
        ("GET", f"/admin/memories/memory/{m.pk}/change/"),
        ("POST", f"/admin/memories/memory/{m.pk}/change/"),
        ("GET", f"/admin/memories/memory/{m.pk}/history/"),
        ("GET", f"/admin/memories/memory/{m.pk}/delete/"),
        ("POST", f"/admin/memories/memory/{m.pk}/history/1/restore/"),
        ("GET", f"/admin/memories/forgetrequest/{f.pk}/change/"),
        ("GET", f"/admin/memories/forgetrequest/{f.pk}/history/"),
        ("GET", f"/admin/memories/apikey/{k.pk}/change/"),
        ("GET", f"/admin/memories/membership/{ms.pk}/change/"),
        ("POST", f"/admin/memories/membership/{ms.pk}/delete/"),
        ("GET", f"/admin/audit/auditevent/{e.pk}/change/"),
        ("GET", f"/admin/memories/tenant/{objs['tenant'].pk}/change/"),
        ("GET", f"/admin/memories/tenant/{objs['tenant'].pk}/dashboard/"),
    ]


def _state(tenant):
    return (
        list(Memory.objects.filter(tenant=tenant).values_list("key", "value", "version", "deleted_at")),
        MemoryVersion.objects.filter(tenant=tenant).count(),
        list(ApiKey.objects.filter(tenant=tenant).values_list("pk", "revoked_at")),
        list(Membership.objects.filter(tenant=tenant).values_list("pk", "role")),
        ForgetRequest.objects.filter(tenant=tenant).count(),
    )


@pytest.mark.parametrize("role", ROLES)
def test_another_tenants_objects_answer_404_like_missing_ones(role, tenant_a, staff_clients, other_tenant_objects):
    _user, client = staff_clients[role]
    tenant_b = other_tenant_objects["tenant"]
    before = _state(tenant_b)
    for method, url in _object_urls(other_tenant_objects):
        data = {"value": json.dumps("hijacked"), "role": "admin", "post": "yes"} if method == "POST" else None
        response = client.post(url, data) if method == "POST" else client.get(url)
        assert response.status_code == 404, (role, method, url, response.status_code)
        assert CANARY_B.encode() not in response.content
        # and exactly like an id that exists nowhere
        ghost = url.replace(f"/{_pk_in(url)}/", "/999999/")
        ghost_response = client.post(ghost, data) if method == "POST" else client.get(ghost)
        assert ghost_response.status_code == 404, (role, ghost)
    assert _state(tenant_b) == before, "a request against another tenant changed its data"


def _pk_in(url: str) -> str:
    return next(part for part in url.split("/") if part.isdigit())


@pytest.mark.parametrize("role", ROLES)
def test_lists_searches_filters_and_autocomplete_hold_no_other_tenants_rows(
    role, tenant_a, staff_clients, other_tenant_objects
):
    write(tenant_a, "user:u10086:pref_lang", f"{CANARY_A} mine")
    _user, client = staff_clients[role]
    tenant_b = other_tenant_objects["tenant"]
    urls = [
        "/admin/",
        "/admin/memories/memory/",
        "/admin/memories/memory/?q=CANARY",
        f"/admin/memories/memory/?tenant={tenant_b.pk}",
        "/admin/memories/memory/?prefix=user:",
        "/admin/memories/memory/?state=everything&subject=u20002",
        "/admin/memories/forgetrequest/",
        "/admin/memories/forgetrequest/?q=u20002",
        "/admin/memories/apikey/",
        "/admin/memories/membership/",
        "/admin/memories/tenant/",
        "/admin/audit/auditevent/",
        f"/admin/audit/auditevent/?tenant={tenant_b.pk}",
        "/admin/audit/auditevent/?key_prefix=user:u20002",
        "/admin/autocomplete/?app_label=memories&model_name=memory&field_name=tenant&term=",
        "/admin/autocomplete/?app_label=memories&model_name=forgetrequest&field_name=tenant&term=glo",
    ]
    for url in urls:
        response = client.get(url)
        assert response.status_code in (200, 403), (role, url, response.status_code)
        body = response.content.decode()
        for foreign in (CANARY_B, "user:u20002:pref_lang", "subject u20002", "globex-bot", "globex-admin", "globex"):
            assert foreign not in body, (role, url, foreign)


def test_autocomplete_offers_only_tenants_where_the_role_may_act(tenant_a, tenant_b, staff_clients):
    user, client = staff_clients["support"]
    Membership.objects.create(tenant=tenant_b, user=user, role="viewer")
    url = "/admin/autocomplete/?app_label=memories&model_name=memory&field_name=tenant&term="
    results = client.get(url).json()["results"]
    assert [r["text"] for r in results] == [tenant_a.slug]  # a viewer in globex may not write there


def test_staff_without_membership_sees_no_tenant(db, tenant_a):
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.create_user(username="loner", password="x", is_staff=True)
    memory = write(tenant_a, "user:u1:k", CANARY_A)
    client = logged_in(user)
    assert client.get("/admin/memories/memory/").status_code == 403
    assert client.get(f"/admin/memories/memory/{memory.pk}/change/").status_code == 404
    assert client.get(f"/admin/memories/tenant/{tenant_a.pk}/dashboard/").status_code == 404
    assert CANARY_A.encode() not in client.get("/admin/").content


def test_superuser_sees_every_tenant(tenant_a, tenant_b, superuser_client):
    _user, client = superuser_client
    write(tenant_a, "user:u1:k", CANARY_A)
    write(tenant_b, "user:u2:k", CANARY_B)
    body = client.get("/admin/memories/memory/").content.decode()
    assert "user:u1:k" in body and "user:u2:k" in body


# --- forbidden objects of one's own tenant ------------------------------------------------------

EDIT_URLS = ("change_post", "restore", "action_forget", "action_trash", "action_extend", "add")


@pytest.mark.parametrize("role", ["viewer", "compliance"])
def test_roles_that_may_not_edit_cannot_change_memories_by_any_url(role, tenant_a, staff_clients):
    memory = write(tenant_a, "user:u10086:pref_lang", f"{CANARY_A} v1")
    services.memory_update(tenant=tenant_a, actor=SYSTEM, key=memory.key, value=f"{CANARY_A} v2")
    _user, client = staff_clients[role]
    before = _state(tenant_a)
    expected = 403 if role == "viewer" else 404  # compliance cannot even open the memory
    response = client.post(f"/admin/memories/memory/{memory.pk}/change/", {"value": '"x"', "importance": 5})
    assert response.status_code == expected
    response = client.post(f"/admin/memories/memory/{memory.pk}/history/1/restore/")
    assert response.status_code == expected
    response = client.post(f"/admin/memories/memory/{memory.pk}/delete/", {"post": "yes"})
    assert response.status_code in (403, 404)
    for action in ("forget_selected", "move_to_trash", "extend_ttl", "restore_from_trash", "delete_selected"):
        response = client.post(
            "/admin/memories/memory/", {"action": action, "_selected_action": [memory.pk], "ttl_days": 3}
        )
        # 400: the viewer's list has no action at all (a POST running none is refused)
        assert response.status_code in (200, 302, 400, 403), (action, response.status_code)
    add = client.post(
        "/admin/memories/memory/add/", {"tenant": tenant_a.pk, "key": "user:u1:new", "value": '"x"', "importance": 5}
    )
    assert add.status_code == 403
    assert _state(tenant_a) == before


@pytest.mark.parametrize("role", ["viewer", "support", "compliance"])
def test_only_the_admin_role_manages_keys_and_members(role, tenant_a, staff_clients):
    key, _raw = make_key(tenant_a, name="acme-bot")
    _user, client = staff_clients[role]
    membership = Membership.objects.filter(tenant=tenant_a).first()
    before = _state(tenant_a)
    for url in ("/admin/memories/apikey/", "/admin/memories/apikey/add/", "/admin/memories/membership/"):
        assert client.get(url).status_code == 403, url
    assert client.get(f"/admin/memories/apikey/{key.pk}/change/").status_code == 404
    assert client.post("/admin/memories/apikey/", {"action": "revoke", "_selected_action": [key.pk]}).status_code == 403
    response = client.post(
        "/admin/memories/apikey/add/", {"tenant": tenant_a.pk, "name": "x", "scopes": ["memory:read"]}
    )
    assert response.status_code == 403
    response = client.post(
        "/admin/memories/membership/add/", {"tenant": tenant_a.pk, "username": "viewer-acme", "role": "admin"}
    )
    assert response.status_code == 403
    assert client.post(f"/admin/memories/membership/{membership.pk}/delete/", {"post": "yes"}).status_code == 404
    assert _state(tenant_a) == before


@pytest.mark.parametrize("role", ["viewer", "support"])
def test_audit_log_is_for_compliance_and_admin_only(role, tenant_a, staff_clients):
    write(tenant_a, "user:u1:k", "v")
    event = AuditEvent.objects.filter(tenant=tenant_a).first()
    _user, client = staff_clients[role]
    assert client.get("/admin/audit/auditevent/").status_code == 403
    assert client.get(f"/admin/audit/auditevent/{event.pk}/change/").status_code == 404
    assert client.get("/admin/audit/auditevent/export/?fmt=csv").status_code in (403, 404)


@pytest.mark.parametrize("role", ["compliance", "admin"])
def test_audit_events_cannot_be_added_changed_or_deleted(role, tenant_a, staff_clients):
    write(tenant_a, "user:u1:k", "v")
    event = AuditEvent.objects.get(tenant=tenant_a, action="memory.write")
    _user, client = staff_clients[role]
    count = AuditEvent.objects.count()
    assert client.get("/admin/audit/auditevent/add/").status_code == 403
    assert client.post(f"/admin/audit/auditevent/{event.pk}/change/", {"action": "x"}).status_code == 403
    assert client.post(f"/admin/audit/auditevent/{event.pk}/delete/", {"post": "yes"}).status_code == 403
    page = client.get(f"/admin/audit/auditevent/{event.pk}/change/")
    assert page.status_code == 200 and b"memory.write" in page.content
    assert AuditEvent.objects.filter(pk=event.pk, action="memory.write").exists()
    # Nothing written but the record of the one reading (audit.view of the page shown).
    assert AuditEvent.objects.count() == count + 1
    assert AuditEvent.objects.filter(action="audit.view", detail={"event": str(event.uid)}).count() == 1
