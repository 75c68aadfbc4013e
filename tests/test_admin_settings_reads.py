"""Reading a tenant's settings, its API keys and its memberships in the admin is audited.

Compliance reviewers must see who looked at what: the memory pages were audited (memory.list,
memory.view), the forget queue and portal links too, but a tenant's settings page (its
sensitivity rules), the API key pages (names, scopes, allowlists, last use) and the membership
pages (who holds which role) were read with no record."""

from __future__ import annotations

from audit.models import AuditEvent
from memories.models import Membership
from tests.factories import logged_in, make_key, make_staff

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role


def _events(tenant, action: str):
    return list(AuditEvent.objects.filter(tenant=tenant, action=action).order_by("pk"))


def test_a_tenants_settings_page_is_an_audited_read(tenant_a, tenant_b, staff_clients, superuser_client):
    root, client = superuser_client
    assert client.get(f"/admin/memories/tenant/{tenant_a.pk}/change/").status_code == 200
    (event,) = _events(tenant_a, "tenant.view")
    assert (event.actor_kind, event.actor_id, event.surface, event.target, event.outcome) == (
        "staff",
        str(root.pk),
        "admin",
        tenant_a.slug,
        "ok",
    )
    # A member's read-only view of it too, in that tenant's log only.
    viewer, client = staff_clients["viewer"]
    assert client.get(f"/admin/memories/tenant/{tenant_a.pk}/change/").status_code == 200
    assert [e.actor_id for e in _events(tenant_a, "tenant.view")] == [str(root.pk), str(viewer.pk)]
    assert client.get(f"/admin/memories/tenant/{tenant_b.pk}/change/").status_code == 404  # not theirs
    assert not _events(tenant_b, "tenant.view")
    # A save is a tenant.update (audited by the service), not a read as well.
    _root, client = superuser_client
    response = client.post(
        f"/admin/memories/tenant/{tenant_a.pk}/change/",
        {
            "name": "Acme Two",
            "value_max_bytes": "",
            "trash_retention_days": "",
            "sensitive_keys": "",
            "sensitive_fields": "",
        },
    )
    assert response.status_code == 302, response.content[:2000]
    assert len(_events(tenant_a, "tenant.view")) == 2
    assert len(_events(tenant_a, "tenant.update")) == 1


def test_api_key_pages_are_audited_reads_that_never_hold_the_secret(tenant_a, tenant_b, staff_clients):
    key, raw = make_key(tenant_a, name="billing bot")
    make_key(tenant_b, name="other tenant's key")
    admin, client = staff_clients["admin"]
    body = client.get("/admin/memories/apikey/").content.decode()
    assert "billing bot" in body and "other tenant" not in body
    (listed,) = _events(tenant_a, "api_key.list")
    assert (listed.actor_id, listed.surface, listed.count, listed.outcome) == (str(admin.pk), "admin", 1, "ok")
    assert client.get(f"/admin/memories/apikey/{key.pk}/change/").status_code == 200
    (opened,) = _events(tenant_a, "api_key.view")
    assert (opened.actor_id, opened.target, opened.outcome) == (str(admin.pk), key.display_prefix, "ok")
    secret = raw.rsplit("_", 1)[1]
    for event in (listed, opened):
        text = repr((event.target, event.subject, event.detail))
        assert secret not in text and key.key_hash not in text
    assert not _events(tenant_b, "api_key.list") and not _events(tenant_b, "api_key.view")
    # A search names what was looked for (a key's name or public prefix).
    client.get("/admin/memories/apikey/", {"q": "billing"})
    assert _events(tenant_a, "api_key.list")[-1].detail == {"search": "billing"}


def test_membership_pages_are_audited_reads(tenant_a, tenant_b, staff_clients):
    make_staff(tenant_b, "viewer", username="someone-else")
    admin, client = staff_clients["admin"]
    body = client.get("/admin/memories/membership/").content.decode()
    assert "viewer-acme" in body and "someone-else" not in body
    (listed,) = _events(tenant_a, "membership.list")
    assert (listed.actor_id, listed.surface, listed.count) == (str(admin.pk), "admin", len(staff_clients))
    viewer, _client = staff_clients["viewer"]
    membership = Membership.objects.get(tenant=tenant_a, user=viewer)
    assert client.get(f"/admin/memories/membership/{membership.pk}/change/").status_code == 200
    (opened,) = _events(tenant_a, "membership.view")
    assert (opened.actor_id, opened.target, opened.detail) == (str(admin.pk), "viewer-acme", {"role": "viewer"})
    assert not _events(tenant_b, "membership.list") and not _events(tenant_b, "membership.view")


def test_a_role_without_the_pages_reads_nothing_and_records_no_read(tenant_a, staff_clients):
    key, _raw = make_key(tenant_a)
    _user, client = staff_clients["support"]
    assert client.get("/admin/memories/apikey/").status_code == 403
    assert client.get(f"/admin/memories/apikey/{key.pk}/change/").status_code in (403, 404)
    assert client.get("/admin/memories/membership/").status_code == 403
    assert not _events(tenant_a, "api_key.list") and not _events(tenant_a, "api_key.view")
    assert not _events(tenant_a, "membership.list")


def test_the_tenant_list_is_an_audited_read(tenant_a, tenant_b, staff_clients, superuser_client):
    # Its settings page was audited (tenant.view), its list — which tenants exist, their names,
    # the reader's role in each — was not: tenant.list in each tenant a page shows.
    viewer, client = staff_clients["viewer"]
    body = client.get("/admin/memories/tenant/").content.decode()
    assert tenant_a.slug in body and tenant_b.slug not in body
    (listed,) = _events(tenant_a, "tenant.list")
    assert (listed.actor_kind, listed.actor_id, listed.surface, listed.target, listed.count, listed.outcome) == (
        "staff",
        str(viewer.pk),
        "admin",
        tenant_a.slug,
        1,
        "ok",
    )
    assert not _events(tenant_b, "tenant.list")  # not shown to them: not in that tenant's log
    # A superuser's page shows both: one event in each tenant's own log; a search names its words.
    root, client = superuser_client
    client.get("/admin/memories/tenant/", {"q": tenant_b.slug})
    assert not [e for e in _events(tenant_a, "tenant.list") if e.actor_id == str(root.pk)]
    (searched,) = _events(tenant_b, "tenant.list")
    assert (searched.actor_id, searched.detail) == (str(root.pk), {"search": tenant_b.slug})
    client.get("/admin/memories/tenant/")
    assert [e.actor_id for e in _events(tenant_a, "tenant.list")] == [str(viewer.pk), str(root.pk)]
    assert [e.actor_id for e in _events(tenant_b, "tenant.list")] == [str(root.pk), str(root.pk)]


def test_a_key_pasted_into_the_key_search_leaves_no_secret_in_the_log(tenant_a, staff_clients):
    """An admin who finds a key (a secret scanner's alert, a log line) pastes it whole into the
    API key list's search: ``api_key.list`` kept the search as typed — the live key's secret
    written into the tenant's audit log, which the list's own audit promised never to hold.
    The search is kept with a key's secret withheld (its public prefix stays: what was sought)."""
    key, raw = make_key(tenant_a, name="leaked bot")
    admin, client = staff_clients["admin"]
    assert client.get("/admin/memories/apikey/", {"q": f"leaked {raw}"}).status_code == 200
    event = _events(tenant_a, "api_key.list")[-1]
    secret = raw.rsplit("_", 1)[1]
    assert secret not in repr(event.detail), event.detail
    assert event.detail["search"].startswith(f"leaked zm_{key.lookup}_")


def test_the_admin_index_listing_the_users_tenants_is_an_audited_read(
    tenant_a, tenant_b, staff_clients, superuser_client
):
    # The index's Dashboards box shows the tenant list's columns (each tenant's name and the
    # reader's role in it) to every staff member who signs in: it was read with no record,
    # while a page of the tenant list writes tenant.list in each tenant it shows.
    viewer, client = staff_clients["viewer"]
    body = client.get("/admin/").content.decode()
    assert tenant_a.name in body and tenant_b.name not in body
    (listed,) = _events(tenant_a, "tenant.list")
    assert (listed.actor_kind, listed.actor_id, listed.surface, listed.target, listed.count, listed.outcome) == (
        "staff",
        str(viewer.pk),
        "admin",
        tenant_a.slug,
        1,
        "ok",
    )
    assert not _events(tenant_b, "tenant.list")
    assert client.head("/admin/").status_code == 200  # a HEAD is audited as the GET it mirrors
    assert len(_events(tenant_a, "tenant.list")) == 2
    # A superuser's index shows both tenants: one event in each one's own log.
    root, client = superuser_client
    assert client.get("/admin/").status_code == 200
    assert [e.actor_id for e in _events(tenant_b, "tenant.list")] == [str(root.pk)]
    assert _events(tenant_a, "tenant.list")[-1].actor_id == str(root.pk)
    # A member of no tenant sees none, and nothing is recorded.
    loner = make_staff(tenant_a, "viewer", username="loner")
    Membership.objects.filter(user=loner).delete()
    before = AuditEvent.objects.filter(action="tenant.list").count()
    body = logged_in(loner).get("/admin/").content.decode()
    assert "not a member of any tenant yet" in body
    assert AuditEvent.objects.filter(action="tenant.list").count() == before
