"""The admin's pages do not print row ids to a tenant's staff: they come from sequences every
tenant shares, so watching them grow (a forget request "#5041" today, "#5230" tomorrow) gauges
the other tenants' activity. The REST API shows opaque ids (zeromem/kernel/opaque.py); the
admin showed forget requests as "forget #<id>" (title, list column, messages), portal links in
an "id" column, and the audit event page the raw actor id (a staff user's or API key's row id).
The admin's URLs still carry row ids (README "Admin", what remains)."""

from __future__ import annotations

import html
import re

from django.contrib.auth import get_user_model

from audit.models import AuditEvent
from memories import services
from memories.admin.display import actor_label
from memories.portal.services import link_ref, portal_link_create
from tests.factories import SYSTEM, write
from zeromem.kernel import opaque

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role


def _text(response) -> str:
    assert response.status_code == 200, response.status_code
    return html.unescape(response.content.decode())


def test_forget_requests_are_named_by_their_uid_not_their_row_id(tenant_a, staff_clients):
    fr = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u10086", reason="asked")
    _user, client = staff_clients["admin"]
    listed = _text(client.get("/admin/memories/forgetrequest/"))
    assert str(fr.uid) in listed and 'class="field-id"' not in listed
    page = _text(client.get(f"/admin/memories/forgetrequest/{fr.pk}/change/"))
    assert str(fr.uid) in page and f"#{fr.pk}" not in page
    # Filed from the memory list: the message names the new request by its uid.
    write(tenant_a, "user:u1:a", "x")
    data = {"action": "forget_selected", "select_across": "1", "index": "0", "_selected_action": ["1"]}
    body = _text(client.post("/admin/memories/memory/", data, follow=True))
    filed = re.search(r"Forget request <a [^>]*>([^<]*)</a> filed", body)
    newest = type(fr).objects.filter(tenant=tenant_a).order_by("-pk").first()
    assert filed and filed.group(1) == str(newest.uid), body[:0]
    # Filed from its own form: the same.
    body = _text(
        client.post(
            "/admin/memories/forgetrequest/add/",
            {"tenant": tenant_a.pk, "subject": "u2", "reason": "asked", "due_in_days": "30"},
            follow=True,
        )
    )
    newest = type(fr).objects.filter(tenant=tenant_a).order_by("-pk").first()
    assert f"Forget request {newest.uid} filed" in body and f"#{newest.pk}" not in body


def test_portal_links_are_listed_by_the_reference_their_audit_events_name(tenant_a, staff_clients):
    link, _token = portal_link_create(tenant=tenant_a, actor=SYSTEM, subject="u10086")
    _user, client = staff_clients["admin"]
    listed = _text(client.get("/admin/portal/portallink/"))
    assert link_ref(link) in listed and 'class="field-id"' not in listed
    created = AuditEvent.objects.get(tenant=tenant_a, action="portal.link_create")
    assert created.detail["portal_link"] == link_ref(link)


def test_an_audit_events_page_shows_a_staff_or_key_actor_as_the_review_api_does(tenant_a, staff_clients):
    admin, client = staff_clients["admin"]
    client.get("/admin/memories/tenant/")  # tenant.list, by this staff user
    event = AuditEvent.objects.filter(tenant=tenant_a, action="tenant.list").get()
    page = _text(client.get(f"/admin/audit/auditevent/{event.pk}/change/"))
    token = opaque.shown_actor_id("staff", str(admin.pk))
    assert token in page
    assert not re.search(rf'<div class="readonly">{admin.pk}</div>', page)
    # Its reading (audit.view) names the event as the review API does: by its uid.
    viewed = AuditEvent.objects.get(tenant=tenant_a, action="audit.view")
    assert viewed.detail == {"event": str(event.uid)}


def test_a_gone_actor_is_named_by_its_token(db):
    user = get_user_model().objects.create_user(username="gone")
    pk = user.pk
    user.delete()
    assert actor_label("staff", str(pk)) == f"staff {opaque.shown_actor_id('staff', str(pk))}"
    assert actor_label("api_key", "987654") == f"key {opaque.shown_actor_id('api_key', '987654')}"
