"""'Select all N' hands an action every row the list matches: each action works on a bounded
batch per run (the memory actions had a bound; revoking API keys and removing memberships had
none — one request made a service call per row, however many)."""

from __future__ import annotations

import html
import re

from memories.models import ApiKey, Membership
from tests.factories import make_key, make_staff

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role


def _select_all(client, url, action, **extra):
    data = {"action": action, "select_across": "1", "index": "0", "_selected_action": ["1"], **extra}
    response = client.post(url, data, follow=True)
    assert response.status_code == 200
    return response.content.decode()


def test_revoking_every_api_key_of_a_searched_list_works_through_a_bounded_batch(tenant_a, staff_clients, monkeypatch):
    from memories.admin import api_keys

    monkeypatch.setattr(api_keys, "ACTION_MAX", 2)
    for n in range(3):
        make_key(tenant_a, name=f"bot {n}")
    make_key(tenant_a, name="kept")
    _user, client = staff_clients["admin"]
    body = _select_all(client, "/admin/memories/apikey/?q=bot", "revoke")
    assert "at most 2 per run" in body and "2 keys revoked" in body
    assert ApiKey.objects.filter(tenant=tenant_a, revoked_at__isnull=False).count() == 2
    body = _select_all(client, "/admin/memories/apikey/?q=bot", "revoke")
    assert "at most 2 per run" not in body and "1 keys revoked" in body
    assert list(ApiKey.objects.filter(tenant=tenant_a, revoked_at__isnull=True).values_list("name", flat=True)) == [
        "kept"
    ]


def test_removing_every_membership_of_a_searched_list_works_through_a_bounded_batch(
    tenant_a, staff_clients, monkeypatch
):
    from memories.admin import memberships

    monkeypatch.setattr(memberships, "ACTION_MAX", 2)
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
    from memories.admin import memberships

    monkeypatch.setattr(memberships, "ACTION_MAX", 2)
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
