"""'Select all N' hands an action every row the list matches: each action works on a bounded
batch per run (the memory actions had a bound; revoking API keys and removing memberships had
none — one request made a service call per row, however many)."""

from __future__ import annotations

import html
import re

from django.db import connection
from django.test.utils import CaptureQueriesContext

from memories.models import ApiKey, Membership, Memory
from tests.factories import make_key, make_staff, write
from zeromem.kit import admin as kit_admin

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role


def _select_all(client, url, action, **extra):
    data = {"action": action, "select_across": "1", "index": "0", "_selected_action": ["1"], **extra}
    response = client.post(url, data, follow=True)
    assert response.status_code == 200
    return response.content.decode()


def test_revoking_every_api_key_of_a_searched_list_works_through_a_bounded_batch(tenant_a, staff_clients, monkeypatch):
    monkeypatch.setattr(kit_admin, "ACTION_MAX", 2)
    for n in range(3):
        make_key(tenant_a, name=f"bot {n}")
    make_key(tenant_a, name="kept")
    _user, client = staff_clients["admin"]
    body = _select_all(client, "/admin/memories/apikey/?q=bot", "revoke")
    assert (
        "2 keys revoked" in body
        and "Of the selection, still to revoke: 1 (this action revokes at most 2 per run)" in body
    )
    assert ApiKey.objects.filter(tenant=tenant_a, revoked_at__isnull=False).count() == 2
    body = _select_all(client, "/admin/memories/apikey/?q=bot", "revoke")
    assert "at most 2 per run" not in body and "1 key revoked" in body
    assert list(ApiKey.objects.filter(tenant=tenant_a, revoked_at__isnull=True).values_list("name", flat=True)) == [
        "kept"
    ]


def test_removing_every_membership_of_a_searched_list_works_through_a_bounded_batch(
    tenant_a, staff_clients, monkeypatch
):
    monkeypatch.setattr(kit_admin, "ACTION_MAX", 2)
    for n in range(3):
        make_staff(tenant_a, "viewer", username=f"temp-{n}")
    _user, client = staff_clients["admin"]
    body = _select_all(client, "/admin/memories/membership/?q=temp-", "delete_selected", post="yes")
    assert "at most 2 per run" in body
    assert Membership.objects.filter(tenant=tenant_a, user__username__startswith="temp-").count() == 1
    assert Membership.objects.filter(tenant=tenant_a).count() == len(staff_clients) + 1


def test_removing_every_membership_says_what_this_run_removes_and_that_more_remain(
    tenant_a, staff_clients, monkeypatch
):
    # Django's confirmation listed and counted the whole selection, and its "Successfully
    # deleted 3 memberships." counted it too, while the action removed at most ACTION_MAX.
    monkeypatch.setattr(kit_admin, "ACTION_MAX", 2)
    for n in range(3):
        make_staff(tenant_a, "viewer", username=f"temp-{n}")
    _user, client = staff_clients["admin"]
    url = "/admin/memories/membership/?q=temp-"
    page = html.unescape(_select_all(client, url, "delete_selected"))
    assert "Memberships: 2" in page and "Memberships: 3" not in page
    assert "removes 2 of the 3 memberships selected" in page
    listed = re.findall(r'name="_selected_action" value="(\d+)"', page)
    assert len(listed) == 2  # what "Yes, I'm sure" posts is the batch the page names
    assert Membership.objects.filter(user__username__startswith="temp-").count() == 3  # nothing removed yet
    # Confirmed: the count removed, and that more remain.
    data = {"action": "delete_selected", "post": "yes", "_selected_action": listed}
    for name, value in re.findall(r'<input type="hidden" name="(more_remain)" value="(\d+)"', page):
        data[name] = value
    body = html.unescape(client.post(url, data, follow=True).content.decode())
    assert "2 memberships removed" in body and "Successfully deleted" not in body
    assert "still to remove: 1" in body and "run it again" in body
    assert Membership.objects.filter(user__username__startswith="temp-").count() == 1
    # The last one: no "more remain".
    page = html.unescape(_select_all(client, url, "delete_selected"))
    assert "Memberships: 1" in page and "memberships selected" not in page
    listed = re.findall(r'name="_selected_action" value="(\d+)"', page)
    data = {"action": "delete_selected", "post": "yes", "_selected_action": listed}
    body = html.unescape(client.post(url, data, follow=True).content.decode())
    assert "1 membership removed" in body and "still to remove" not in body
    assert not Membership.objects.filter(user__username__startswith="temp-").exists()


def _counts(queries) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]


def test_the_memory_actions_say_how_many_they_did_and_how_many_of_the_selection_remain(
    tenant_a, staff_clients, monkeypatch
):
    # They said only "This action works on at most N per run: run it again for the rest.",
    # not how many of the selection were left.
    monkeypatch.setattr(kit_admin, "ACTION_MAX", 2)
    for i in range(5):
        write(tenant_a, f"user:u1:k{i}", f"value {i}", ttl_seconds=60)
    _user, client = staff_clients["support"]
    url = "/admin/memories/memory/"
    body = html.unescape(_select_all(client, url, "extend_ttl", ttl_days="10"))
    assert "2 memories now expire in 10 days" in body
    assert "Of the selection, still to extend: 3 (this action works on at most 2 per run)" in body
    body = html.unescape(_select_all(client, url, "move_to_trash"))
    assert "2 memories moved to the trash" in body and "still to move to the trash: 3" in body
    body = html.unescape(_select_all(client, url, "move_to_trash"))
    assert "2 memories moved to the trash" in body and "still to move to the trash: 1" in body
    body = html.unescape(_select_all(client, url, "move_to_trash"))
    assert "1 memories moved to the trash" in body and "still to" not in body
    body = html.unescape(_select_all(client, url + "?state=trash", "restore_from_trash"))
    assert "2 memories restored from the trash" in body and "still to restore: 3" in body
    body = html.unescape(_select_all(client, url, "forget_selected", reason="asked"))
    assert "filed for 2 keys" in body and "still to forget: 0" not in body and "still to forget" not in body
    assert Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True).count() == 2


def test_what_remains_is_a_capped_count_that_says_its_cap(tenant_a, staff_clients, monkeypatch):
    monkeypatch.setattr(kit_admin, "ACTION_MAX", 2)
    monkeypatch.setattr(kit_admin, "ACTION_REMAINING_COUNT_CAP", 2)
    for i in range(6):
        write(tenant_a, f"user:u1:k{i}", f"value {i}")
        make_key(tenant_a, name=f"bot {i}")
    _user, client = staff_clients["admin"]
    with CaptureQueriesContext(connection) as queries:
        body = html.unescape(_select_all(client, "/admin/memories/memory/", "move_to_trash"))
    assert "2 memories moved to the trash" in body and "still to move to the trash: more than 2 " in body
    # The action's count: the rows past the batch, up to the cap + 1.
    (count,) = [sql for sql in _counts(queries) if "memories_memory" in sql and "OFFSET 2" in sql]
    assert "LIMIT 3" in count, count
    with CaptureQueriesContext(connection) as queries:
        body = html.unescape(_select_all(client, "/admin/memories/apikey/", "revoke"))
    assert "2 keys revoked" in body and "still to revoke: more than 2 " in body
    (count,) = [sql for sql in _counts(queries) if "memories_apikey" in sql and "OFFSET 2" in sql]
    assert "LIMIT 3" in count, count
    # Fewer than a batch: no count at all.
    monkeypatch.setattr(kit_admin, "ACTION_MAX", 100)
    with CaptureQueriesContext(connection) as queries:
        body = html.unescape(_select_all(client, "/admin/memories/apikey/", "revoke"))
    assert "4 keys revoked" in body and "still to" not in body
    assert not [sql for sql in _counts(queries) if "memories_apikey" in sql and "OFFSET" in sql]


def test_removing_memberships_counts_what_remains_up_to_the_cap(tenant_a, staff_clients, monkeypatch):
    # Its "still to remove" was the selection's whole COUNT(*), run on every confirmation.
    monkeypatch.setattr(kit_admin, "ACTION_MAX", 2)
    monkeypatch.setattr(kit_admin, "ACTION_REMAINING_COUNT_CAP", 2)
    for n in range(6):
        make_staff(tenant_a, "viewer", username=f"temp-{n}")
    _user, client = staff_clients["admin"]
    url = "/admin/memories/membership/?q=temp-"
    with CaptureQueriesContext(connection) as queries:
        page = html.unescape(_select_all(client, url, "delete_selected"))
    assert "removes 2 of the more than 4 memberships selected" in page
    # The selection (the search) counted past the batch, up to the cap + 1; never whole.
    searched = [sql for sql in _counts(queries) if "temp-" in sql]
    assert searched and all("LIMIT" in sql for sql in searched), searched
    assert any("LIMIT 3 OFFSET 2" in sql for sql in searched), searched
    listed = re.findall(r'name="_selected_action" value="(\d+)"', page)
    (more,) = re.findall(r'name="more_remain" value="(\d+)"', page)
    data = {"action": "delete_selected", "post": "yes", "_selected_action": listed, "more_remain": more}
    body = html.unescape(client.post(url, data, follow=True).content.decode())
    assert "2 memberships removed" in body and "still to remove: more than 2 " in body
    # A posted more_remain is a number for the message only, and capped like the count.
    page = html.unescape(_select_all(client, url, "delete_selected"))
    data["_selected_action"] = re.findall(r'name="_selected_action" value="(\d+)"', page)
    data["more_remain"] = "99999999"
    body = html.unescape(client.post(url, data, follow=True).content.decode())
    assert "still to remove: more than 2 " in body
