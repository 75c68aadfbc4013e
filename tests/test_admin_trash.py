"""The admin's trash lists what a restore brings back. It listed every trashed memory, and the
restore action was offered for all of them, while ``memory_restore`` refuses (NotFound) the
ones the purge will erase: past their trash retention (the tenant's, or a prefix rule's) and
expired before they went to the trash. The action then said "0 memories restored" and
nothing else."""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from memories import services
from memories.models import Memory, Tenant
from memories.services.retention import restorable_trash
from tests.factories import SYSTEM, make_tenant, write
from zeromem.kernel.errors import NotFound

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role


def _trashed(tenant, key, *, days_ago: float = 0, expired_before: bool = False) -> Memory:
    memory = write(tenant, key, "v", ttl_seconds=3600 if expired_before else None)
    services.memory_delete(tenant=tenant, actor=SYSTEM, key=key)
    deleted_at = timezone.now() - timedelta(days=days_ago)
    update = {"deleted_at": deleted_at}
    if expired_before:
        update["expires_at"] = deleted_at - timedelta(seconds=1)
    Memory.objects.filter(pk=memory.pk).update(**update)
    memory.refresh_from_db()
    return memory


@pytest.fixture
def trash(tenant_a):
    Tenant.objects.filter(pk=tenant_a.pk).update(trash_retention_days=7)
    tenant_a.refresh_from_db()
    services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:", trash_retention_days=1)
    return {
        "fresh": _trashed(tenant_a, "user:u1:fresh"),
        "two_days": _trashed(tenant_a, "user:u1:two_days", days_ago=2),  # within the tenant's 7 days
        "old": _trashed(tenant_a, "user:u1:old", days_ago=8),  # past the tenant's 7 days
        "session": _trashed(tenant_a, "session:s1:turn", days_ago=2),  # past its rule's 1 day
        "expired": _trashed(tenant_a, "user:u1:expired", expired_before=True),
    }


RESTORABLE = ("fresh", "two_days")
NOT_RESTORABLE = ("old", "session", "expired")


def _page(client, query: str) -> str:
    response = client.get(f"/admin/memories/memory/?{query}")
    assert response.status_code == 200
    return html.unescape(response.content.decode())


def test_the_restore_service_refuses_what_the_trash_no_longer_lists(tenant_a, trash):
    for name in NOT_RESTORABLE:
        with pytest.raises(NotFound):
            services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=trash[name].pk)


def test_the_trash_lists_only_restorable_memories(tenant_a, trash, staff_clients):
    _user, client = staff_clients["support"]
    body = _page(client, "state=trash")
    for name in RESTORABLE:
        assert trash[name].key in body, name
    for name in NOT_RESTORABLE:
        assert trash[name].key not in body, name
    assert 'value="restore_from_trash"' in body


def test_the_others_are_listed_apart_marked_and_offered_no_restore(tenant_a, trash, staff_clients):
    _user, client = staff_clients["support"]
    body = _page(client, "state=unrestorable")
    for name in NOT_RESTORABLE:
        assert trash[name].key in body, name
    for name in RESTORABLE:
        assert trash[name].key not in body, name
    assert "not restorable: past its trash retention" in body
    assert "not restorable: expired before it went to the trash" in body
    assert 'value="restore_from_trash"' not in body
    # Every state at once: each trashed row says whether it can come back.
    body = _page(client, "state=everything")
    assert body.count("not restorable:") == len(NOT_RESTORABLE)


def test_restoring_every_trashed_memory_restores_the_restorable_and_names_the_others(tenant_a, trash, staff_clients):
    _user, client = staff_clients["support"]
    data = {"action": "restore_from_trash", "select_across": "1", "index": "0", "_selected_action": ["1"]}
    response = client.post("/admin/memories/memory/?state=everything", data, follow=True)
    body = html.unescape(response.content.decode())
    assert "2 memories restored from the trash" in body
    assert "Not restorable (the purge erases them)" in body and trash["old"].key in body
    live = set(Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True).values_list("key", flat=True))
    assert live == {trash[name].key for name in RESTORABLE}


def test_a_memorys_own_page_says_whether_a_restore_brings_it_back(tenant_a, trash, staff_clients):
    # The list said "trash (not restorable: …)", the memory's own page only "trash" — and
    # offered to save it (which the service refuses: it is in the trash).
    _user, client = staff_clients["support"]
    for name, note in (
        ("old", "past its trash retention"),
        ("session", "past its trash retention"),
        ("expired", "expired before it went to the trash"),
    ):
        response = client.get(f"/admin/memories/memory/{trash[name].pk}/change/")
        assert response.status_code == 200
        body = html.unescape(response.content.decode())
        assert f"state trash (not restorable: {note})" in body, name
        assert 'name="_save"' not in body and "restore" not in body.lower().split('id="content"')[1], name
    for name in RESTORABLE:
        body = html.unescape(client.get(f"/admin/memories/memory/{trash[name].pk}/change/").content.decode())
        assert "state trash ·" in body and "not restorable" not in body, name


def test_a_superusers_trash_over_many_tenants_is_one_short_case(tenant_a, superuser_client):
    """A superuser's trash covers every tenant: the cutoff's CASE had one WHEN per rule and
    per tenant setting (2,000 tenants with a setting and a rule: the page 4.1 s against 0.6 s
    for "everything", and quadratic in the tenants). Tenants sharing a setting or a rule now
    share a WHEN; each still gets its own rule (the longest prefix first), then its own
    setting, then the server's default."""
    _root, client = superuser_client
    expected = {}
    for i in range(12):
        tenant = make_tenant(f"trash-many-{i}")
        if i % 3 == 0:  # a rule: session: 1 day, the tenant's own 7 days
            Tenant.objects.filter(pk=tenant.pk).update(trash_retention_days=7)
            services.retention_rule_set(tenant=tenant, actor=SYSTEM, prefix="session:", trash_retention_days=1)
            expected[_trashed(tenant, "session:s1:turn", days_ago=2).key + f"@{i}"] = False
            expected[_trashed(tenant, "user:u1:a", days_ago=2).key + f"@{i}"] = True
        elif i % 3 == 1:  # its own 1 day, no rule
            Tenant.objects.filter(pk=tenant.pk).update(trash_retention_days=1)
            expected[_trashed(tenant, "session:s1:turn", days_ago=2).key + f"@{i}"] = False
            expected[_trashed(tenant, "user:u1:a", days_ago=2).key + f"@{i}"] = False
        else:  # the server's default (30 days)
            expected[_trashed(tenant, "session:s1:turn", days_ago=2).key + f"@{i}"] = True
            expected[_trashed(tenant, "user:u1:a", days_ago=2).key + f"@{i}"] = True
    with CaptureQueriesContext(connection) as queries:
        response = client.get("/admin/memories/memory/?state=trash")
    assert response.status_code == 200
    whens = max(q["sql"].count("WHEN") for q in queries.captured_queries)
    assert whens <= 3, whens  # one rule (session:, 1 day), two settings (7 days, 1 day)
    listed = {
        f"{key}@{slug.removeprefix('trash-many-')}"
        for key, slug in restorable_trash(
            Memory.objects.filter(tenant__slug__startswith="trash-many-"),
            tenant_ids=Tenant.objects.values_list("pk", flat=True),
            now=timezone.now(),
        ).values_list("key", "tenant__slug")
    }
    assert listed == {name for name, restorable in expected.items() if restorable}


def test_a_restorable_trashed_memorys_own_page_restores_it(tenant_a, trash, staff_clients):
    # Its page said "trash" and offered nothing: support staff went back to the trash list,
    # found it again and ran the list's action on it.
    from audit.models import AuditEvent

    memory = trash["fresh"]
    user, _client = staff_clients["support"]
    client = Client(enforce_csrf_checks=True)  # as a browser: the CSRF check runs
    client.force_login(user)
    page = html.unescape(client.get(f"/admin/memories/memory/{memory.pk}/change/").content.decode())
    restore_url = f"/admin/memories/memory/{memory.pk}/restore/"
    assert 'id="restore-memory"' in page and f'formaction="{restore_url}"' in page
    # The button posts the change form, its CSRF token with it.
    token = re.findall(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)[0]
    assert client.get(restore_url).status_code == 405  # a POST only
    assert client.post(restore_url).status_code == 403  # no token: refused, nothing restored
    assert Memory.objects.get(pk=memory.pk).deleted_at is not None
    response = client.post(restore_url, {"csrfmiddlewaretoken": token}, follow=True)
    body = html.unescape(response.content.decode())
    assert response.redirect_chain[-1][0] == f"/admin/memories/memory/{memory.pk}/change/"
    assert f"Restored {memory.key} from the trash as version" in body
    memory.refresh_from_db()
    assert memory.deleted_at is None
    (event,) = AuditEvent.objects.filter(tenant=tenant_a, action="memory.restore")
    assert (event.actor_kind, event.surface, event.target, event.outcome) == ("staff", "admin", memory.key, "ok")
    assert 'id="restore-memory"' not in body  # live again: nothing to restore
    # Again (restored meanwhile, e.g. from another tab): refused, named, nothing changes.
    body = html.unescape(client.post(restore_url, {"csrfmiddlewaretoken": token}, follow=True).content.decode())
    assert f"Not restored: {memory.key}: no such memory in the trash" in body


def test_the_restore_button_only_for_roles_that_restore_and_memories_a_restore_brings_back(
    tenant_a, tenant_b, trash, staff_clients
):
    memory = trash["two_days"]
    restore_url = f"/admin/memories/memory/{memory.pk}/restore/"
    _user, viewer = staff_clients["viewer"]
    page = viewer.get(f"/admin/memories/memory/{memory.pk}/change/").content.decode()
    assert page and 'id="restore-memory"' not in page
    assert viewer.post(restore_url).status_code == 403
    _user, compliance = staff_clients["compliance"]
    assert compliance.post(restore_url).status_code == 404  # no memory page at all
    _user, support = staff_clients["support"]
    for name in NOT_RESTORABLE:  # the page says why; the button is not there, a POST is refused
        page = support.get(f"/admin/memories/memory/{trash[name].pk}/change/").content.decode()
        assert 'id="restore-memory"' not in page, name
        response = support.post(f"/admin/memories/memory/{trash[name].pk}/restore/", follow=True)
        assert f"Not restored: {trash[name].key}: this memory" in html.unescape(response.content.decode()), name
    assert Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=False).count() == len(trash)
    # Another tenant's trashed memory: a 404, like a missing one.
    other = _trashed(tenant_b, "user:u9:theirs")
    assert support.post(f"/admin/memories/memory/{other.pk}/restore/").status_code == 404
    assert Memory.objects.get(pk=other.pk).deleted_at is not None
    assert viewer.post(restore_url).status_code == 403 and Memory.objects.get(pk=memory.pk).deleted_at is not None
