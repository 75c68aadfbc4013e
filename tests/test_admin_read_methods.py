"""Every admin page that shows data writes its audit row, whatever the HTTP method asking.

Django's admin renders a change form for any method but POST (OPTIONS, PUT, PATCH, DELETE…)
and a change list for a POST that carries no action; the reads were audited only on GET,
so a staff member (holding the CSRF token, or none needed for OPTIONS) read a memory's
value, searched the values of a tenant or read the forget queue and the audit log with no
record of it."""

from __future__ import annotations

import pytest

from audit.models import AuditEvent
from memories import services
from memories.portal.services import portal_link_create
from tests.factories import SYSTEM, write

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role

CANARY = "CANARY-read-methods-5c1e"
KEY = "user:u10086:pref_lang"
OTHER_METHODS = ("OPTIONS", "PUT", "PATCH", "DELETE", "TRACE")


def _count(tenant, action: str) -> int:
    return AuditEvent.objects.filter(tenant=tenant, action=action).count()


def _shown_only_with_its_audit_row(response, tenant, action: str, before: int, marker: str) -> None:
    """Either the page was refused (nothing shown) or it was shown and audited."""
    shown = marker.encode() in response.content
    assert not shown or _count(tenant, action) > before, (response.request["REQUEST_METHOD"], response.status_code)


@pytest.mark.parametrize("method", OTHER_METHODS)
def test_a_memory_page_asked_with_another_method_is_refused_or_audited(method, tenant_a, staff_clients):
    memory = write(tenant_a, KEY, CANARY)
    _user, client = staff_clients["viewer"]
    for url in (f"/admin/memories/memory/{memory.pk}/change/", f"/admin/memories/memory/{memory.pk}/history/"):
        before = _count(tenant_a, "memory.view") + _count(tenant_a, "memory.history")
        response = client.generic(method, url)
        after = _count(tenant_a, "memory.view") + _count(tenant_a, "memory.history")
        assert CANARY.encode() not in response.content or after > before, (method, url, response.status_code)
        assert response.status_code == 405, (method, url, response.status_code)


@pytest.mark.parametrize("method", OTHER_METHODS)
def test_forget_requests_and_audit_events_asked_with_another_method_are_refused(method, tenant_a, staff_clients):
    forget = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject=CANARY, reason="asked")
    event = AuditEvent.objects.filter(tenant=tenant_a).order_by("-pk").first()
    _user, client = staff_clients["admin"]
    pages = [
        (f"/admin/memories/forgetrequest/{forget.pk}/change/", "forget.read"),
        (f"/admin/memories/forgetrequest/{forget.pk}/history/", "forget.read"),
        (f"/admin/audit/auditevent/{event.pk}/change/", "audit.view"),
        (f"/admin/audit/auditevent/{event.pk}/history/", "audit.view"),
        ("/admin/memories/forgetrequest/", "forget.list"),
        ("/admin/audit/auditevent/", "audit.list"),
        ("/admin/memories/memory/?q=" + CANARY, "memory.browse"),
    ]
    for url, action in pages:
        before = _count(tenant_a, action)
        response = client.generic(method, url)
        _shown_only_with_its_audit_row(response, tenant_a, action, before, CANARY)
        assert response.status_code == 405, (method, url, response.status_code)


def test_a_list_posted_without_an_action_is_no_unaudited_search(tenant_a, staff_clients):
    """A POST to a change list with no action in it fell through to the list, searched and
    shown, and the read audits ran on GET only."""
    write(tenant_a, KEY, CANARY)
    services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject=CANARY, reason="asked")
    portal_link_create(tenant=tenant_a, actor=SYSTEM, subject=CANARY)
    _user, client = staff_clients["admin"]
    for url, action in (
        (f"/admin/memories/memory/?q={CANARY}", "memory.browse"),
        ("/admin/memories/memory/?subject=u10086", "memory.browse"),
        (f"/admin/memories/forgetrequest/?q={CANARY}", "forget.list"),
        ("/admin/portal/portallink/", "portal.list"),
        ("/admin/audit/auditevent/", "audit.list"),
    ):
        before = _count(tenant_a, action)
        response = client.post(url, {})
        _shown_only_with_its_audit_row(response, tenant_a, action, before, CANARY)
        assert response.status_code == 400, (url, response.status_code)
        assert b"action" in response.content


def test_get_and_head_of_a_memory_stay_audited(tenant_a, staff_clients):
    memory = write(tenant_a, KEY, CANARY)
    _user, client = staff_clients["viewer"]
    assert client.get(f"/admin/memories/memory/{memory.pk}/change/").status_code == 200
    assert _count(tenant_a, "memory.view") == 1
    assert client.head(f"/admin/memories/memory/{memory.pk}/change/").status_code == 200
    assert _count(tenant_a, "memory.view") == 2  # a HEAD renders the page too: audited as a read


def test_a_plain_page_of_the_memory_list_is_recorded_as_the_rest_list_is(tenant_a, tenant_b, staff_clients):
    """The list shows every memory's key, subject, category, version and dates, page after page;
    a search, key-tree walk or subject filter of it was audited (memory.browse), the REST list
    of the same rows is (memory.list), a plain page was not."""
    for n in range(3):
        write(tenant_a, f"user:u{n}:pref_lang", "en")
    write(tenant_b, "user:u9:pref_lang", "en")
    user, client = staff_clients["viewer"]
    assert client.get("/admin/memories/memory/").status_code == 200
    assert client.get("/admin/memories/memory/", {"state": "trash", "category": "user"}).status_code == 200
    events = AuditEvent.objects.filter(action="memory.list").order_by("pk")
    got = [(e.tenant_id, e.actor_kind, e.actor_id, e.surface, e.count, e.detail) for e in events]
    assert got == [
        (tenant_a.pk, "staff", str(user.pk), "admin", 3, {}),
        (tenant_a.pk, "staff", str(user.pk), "admin", 0, {"state": "trash", "category": "user"}),
    ], got
    assert not AuditEvent.objects.filter(tenant=tenant_b, action="memory.list").exists()
    # A search is recorded once, as memory.browse (not as a listing as well).
    client.get("/admin/memories/memory/", {"q": "pref"})
    assert AuditEvent.objects.filter(action="memory.list").count() == 2
