"""Memories in the admin: opening a value is audited, edits go through the services (new
version + audit event), bad values are clear form errors, versions can be restored, and the
list's filters and actions do what they say."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.db.models import F
from django.utils import timezone

from audit.models import AuditEvent
from memories import services
from memories.models import ForgetRequest, Memory, MemoryVersion
from tests.factories import SYSTEM, write

KEY = "user:u10086:pref_lang"
TOO_MANY_DIGITS = "Not valid JSON: a number has more than 4300 digits"

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role


def _change_data(memory, **overrides):
    data = {
        "value": json.dumps(memory.value),
        "category": memory.category,
        "tags": ", ".join(memory.tags),
        "importance": memory.importance,
        "ttl_seconds": "",
        "version": memory.version,
    }
    data.update(overrides)
    return data


def _events(tenant, action):
    return list(AuditEvent.objects.filter(tenant=tenant, action=action).order_by("pk"))


def test_opening_a_memory_writes_a_view_audit_event(tenant_a, staff_clients):
    memory = write(tenant_a, KEY, "zh-CN")
    user, client = staff_clients["viewer"]
    response = client.get(f"/admin/memories/memory/{memory.pk}/change/")
    assert response.status_code == 200 and b"zh-CN" in response.content
    (event,) = _events(tenant_a, "memory.view")
    assert (event.actor_kind, event.actor_id, event.actor_label, event.surface) == (
        "staff",
        str(user.pk),
        user.username,
        "admin",
    )
    assert (event.target, event.subject, event.outcome, event.version) == (KEY, "u10086", "ok", 1)
    assert event.request_id and "zh-CN" not in json.dumps(event.detail)


def test_history_shows_each_version_with_who_when_and_op_and_is_audited(tenant_a, staff_clients):
    memory = write(tenant_a, KEY, "en")
    services.memory_update(tenant=tenant_a, actor=SYSTEM, key=KEY, value="zh-CN")
    _user, client = staff_clients["viewer"]
    body = client.get(f"/admin/memories/memory/{memory.pk}/history/").content.decode()
    assert body.index('data-version="2"') < body.index('data-version="1"')  # newest first
    assert "&quot;en&quot;" in body and "&quot;zh-CN&quot;" in body and "update" in body and "system" in body
    assert "Restore this version" not in body  # a viewer cannot restore
    (event,) = _events(tenant_a, "memory.history")
    assert (event.target, event.count, event.outcome) == (KEY, 2, "ok")


def test_support_edit_goes_through_the_service_new_version_and_audit(tenant_a, staff_clients):
    memory = write(tenant_a, KEY, "en", tags=["lang"])
    user, client = staff_clients["support"]
    response = client.post(
        f"/admin/memories/memory/{memory.pk}/change/",
        _change_data(memory, value='{"lang": "zh-CN", "since": 2024}', tags="lang, pref", importance=8),
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    memory.refresh_from_db()
    assert memory.value == {"lang": "zh-CN", "since": 2024}
    assert (memory.version, memory.tags, memory.importance) == (2, ["lang", "pref"], 8)
    latest = MemoryVersion.objects.get(memory=memory, version=2)
    assert (latest.op, latest.actor_kind, latest.actor_id, latest.value) == (
        "update",
        "staff",
        str(user.pk),
        memory.value,
    )
    (event,) = _events(tenant_a, "memory.update")
    assert (event.actor_label, event.surface, event.version, event.outcome) == (user.username, "admin", 2, "ok")
    assert "zh-CN" not in json.dumps(event.detail)


def test_support_adds_a_memory_through_memory_write(tenant_a, staff_clients):
    _user, client = staff_clients["support"]
    response = client.post(
        "/admin/memories/memory/add/",
        {"tenant": tenant_a.pk, "key": "user:u7:diet", "value": '"vegetarian"', "importance": 5, "tags": ""},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    memory = Memory.objects.get(tenant=tenant_a, key="user:u7:diet")
    assert (memory.value, memory.subject, memory.category, memory.version) == ("vegetarian", "u7", "user", 1)
    assert [e.outcome for e in _events(tenant_a, "memory.write")] == ["ok"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"lang": zh}', "Not valid JSON: Expecting value (line 1, column 10)"),
        ("'single quotes'", "Not valid JSON"),
        ("null", "must not be null"),
        (json.dumps("x" * 20000), "serialized value is 20002 bytes; the limit is 16384"),
        (json.dumps("a\u0000b"), "must not contain NUL characters"),
        # A lone surrogate (half of a UTF-16 pair) parses but no UTF-8 can hold it: was a 500.
        ('"\\ud800"', "a lone surrogate (half of a UTF-16 pair) cannot be stored"),
        ('{"\\udfff": 1}', "a lone surrogate (half of a UTF-16 pair) cannot be stored"),
        # Nested past the interpreter's recursion limit, json.loads raised RecursionError: a 500.
        pytest.param("[" * 100_000 + "]" * 100_000, "must not nest arrays or objects more than 32 deep", id="deep"),
        # An integer past Python's 4300 digits: json.loads raised a plain ValueError, a 500.
        pytest.param("9" * 5000, TOO_MANY_DIGITS, id="long-integer"),
        pytest.param('{"n": [1, ' + "9" * 4301 + "]}", TOO_MANY_DIGITS, id="long-integer-nested"),
        # A member named twice: json.loads kept the last, the other was dropped unsaid.
        pytest.param('{"a": {"city": "Lyon", "city": "Paris"}}', "names 'city' twice (a.city)", id="repeated-member"),
    ],
)
def test_invalid_value_is_a_clear_form_error_and_changes_nothing(tenant_a, staff_clients, value, message):
    memory = write(tenant_a, KEY, "en")
    _user, client = staff_clients["support"]
    audit_mark = AuditEvent.objects.order_by("-pk").values_list("pk", flat=True).first()
    response = client.post(f"/admin/memories/memory/{memory.pk}/change/", _change_data(memory, value=value))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert "value" in errors and message in errors["value"][0], errors
    memory.refresh_from_db()
    assert (memory.value, memory.version) == ("en", 1)
    assert MemoryVersion.objects.filter(memory=memory).count() == 1
    assert not AuditEvent.objects.filter(pk__gt=audit_mark).exclude(action="memory.view").exists()


def test_invalid_tags_and_key_are_form_errors_naming_the_field(tenant_a, staff_clients):
    _user, client = staff_clients["support"]
    response = client.post(
        "/admin/memories/memory/add/",
        {"tenant": tenant_a.pk, "key": "bad key with spaces", "value": '"x"', "importance": 5, "tags": "ok, not ok!"},
    )
    errors = response.context["adminform"].form.errors
    assert set(errors) >= {"key", "tags"}, errors
    assert not Memory.objects.filter(tenant=tenant_a).exists()


def test_an_edit_over_a_newer_version_is_refused_not_lost(tenant_a, staff_clients):
    memory = write(tenant_a, KEY, "en")
    _user, client = staff_clients["support"]
    opened = _change_data(memory, value='"fr"')
    services.memory_update(tenant=tenant_a, actor=SYSTEM, key=KEY, value="de")  # someone else, meanwhile
    response = client.post(f"/admin/memories/memory/{memory.pk}/change/", opened)
    assert response.status_code == 200
    assert "Someone changed this memory" in str(response.context["adminform"].form.non_field_errors())
    memory.refresh_from_db()
    assert (memory.value, memory.version) == ("de", 2)


def test_restore_version_creates_a_new_version_and_an_audit_event(tenant_a, staff_clients):
    memory = write(tenant_a, KEY, "en")
    services.memory_update(tenant=tenant_a, actor=SYSTEM, key=KEY, value="garbage written by a bad agent")
    user, client = staff_clients["support"]
    history = client.get(f"/admin/memories/memory/{memory.pk}/history/").content.decode()
    assert "Restore this version" in history
    response = client.post(f"/admin/memories/memory/{memory.pk}/history/1/restore/")
    assert response.status_code == 302
    memory.refresh_from_db()
    assert (memory.value, memory.version) == ("en", 3)
    versions = list(
        MemoryVersion.objects.filter(memory=memory).order_by("version").values_list("version", "op", "value")
    )
    assert versions == [(1, "write", "en"), (2, "update", "garbage written by a bad agent"), (3, "restore", "en")]
    (event,) = _events(tenant_a, "memory.restore_version")
    assert (event.actor_id, event.version, event.detail, event.outcome) == (str(user.pk), 3, {"from_version": 1}, "ok")
    # the search index follows the restored value
    assert "garbage" not in Memory.objects.get(pk=memory.pk).search_text


def test_restore_version_needs_post_and_an_existing_version(tenant_a, staff_clients):
    memory = write(tenant_a, KEY, "en")
    _user, client = staff_clients["support"]
    assert client.get(f"/admin/memories/memory/{memory.pk}/history/1/restore/").status_code == 405
    client.post(f"/admin/memories/memory/{memory.pk}/history/7/restore/")
    memory.refresh_from_db()
    assert memory.version == 1
    assert [e.outcome for e in _events(tenant_a, "memory.restore_version")] == ["not_found"]


def test_forget_selected_files_a_forget_request_that_erases_the_memories(
    tenant_a, staff_clients, django_capture_on_commit_callbacks
):
    kept = write(tenant_a, "user:u2:pref_lang", "keep me")
    gone = [write(tenant_a, f"user:u1:k{i}", f"value {i}") for i in range(3)]
    _user, client = staff_clients["support"]
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            "/admin/memories/memory/",
            {"action": "forget_selected", "_selected_action": [m.pk for m in gone], "reason": "customer asked"},
        )
    assert response.status_code == 302
    request = ForgetRequest.objects.get(tenant=tenant_a)
    assert (sorted(request.keys), request.reason, request.requested_by_kind) == (
        sorted(m.key for m in gone),
        "customer asked",
        "staff",
    )
    request.refresh_from_db()
    assert request.status == "completed" and request.receipt["memories"] == 3  # tasks run inline in tests
    assert list(Memory.objects.filter(tenant=tenant_a).values_list("key", flat=True)) == [kept.key]


def test_extend_ttl_and_trash_and_restore_actions(tenant_a, staff_clients):
    memory = write(tenant_a, KEY, "en", ttl_seconds=60)
    _user, client = staff_clients["support"]
    client.post("/admin/memories/memory/", {"action": "extend_ttl", "_selected_action": [memory.pk], "ttl_days": 10})
    memory.refresh_from_db()
    assert timezone.now() + timedelta(days=9, hours=23) < memory.expires_at <= timezone.now() + timedelta(days=10)
    client.post("/admin/memories/memory/", {"action": "move_to_trash", "_selected_action": [memory.pk]})
    memory.refresh_from_db()
    assert memory.deleted_at is not None
    trash = client.get("/admin/memories/memory/?state=trash").content.decode()
    assert KEY in trash and KEY not in client.get("/admin/memories/memory/").content.decode()
    client.post(
        "/admin/memories/memory/?state=trash", {"action": "restore_from_trash", "_selected_action": [memory.pk]}
    )
    memory.refresh_from_db()
    assert memory.deleted_at is None
    ops = list(MemoryVersion.objects.filter(memory=memory).order_by("version").values_list("op", flat=True))
    assert ops == ["write", "update", "delete", "restore"]
    actions = [e.action for e in AuditEvent.objects.filter(tenant=tenant_a, actor_kind="staff").order_by("pk")]
    # (the two pages of the list read in between are recorded as memory.list)
    assert actions == ["memory.update", "memory.delete", "memory.list", "memory.list", "memory.restore"]


@pytest.mark.parametrize(
    ("action", "data", "message"),
    [
        ("extend_ttl", {"ttl_days": "5000"}, "days (extend TTL): give a whole number from 1 to 3650."),
        ("extend_ttl", {"ttl_days": "seven"}, "days (extend TTL): give a whole number from 1 to 3650."),
        ("forget_selected", {"reason": "r" * 1001}, "reason: must be at most 1000 characters"),
    ],
)
def test_an_action_given_a_bad_value_says_which_and_changes_nothing(tenant_a, staff_clients, action, data, message):
    # The action form checked these fields first and, refusing one, said only "No action
    # selected." — naming nothing.
    memory = write(tenant_a, KEY, "en", ttl_seconds=60)
    _user, client = staff_clients["support"]
    response = client.post(
        "/admin/memories/memory/", {"action": action, "_selected_action": [memory.pk], **data}, follow=True
    )
    shown = [str(m) for m in response.context["messages"]]
    assert message in shown, shown
    assert Memory.objects.get(pk=memory.pk).expires_at == memory.expires_at
    assert not ForgetRequest.objects.filter(tenant=tenant_a).exists()


def test_restore_action_gives_a_memory_whose_ttl_ran_out_in_the_trash_its_ttl_again(tenant_a, staff_clients):
    memory = write(tenant_a, KEY, "en", ttl_seconds=3600)
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=KEY)
    # Two hours in the trash: it expired an hour ago and the purge has not run yet.
    Memory.objects.filter(pk=memory.pk).update(
        created_at=memory.created_at - timedelta(hours=2),
        expires_at=memory.expires_at - timedelta(hours=2),
        deleted_at=F("deleted_at") - timedelta(hours=2),
    )
    MemoryVersion.objects.filter(memory_id=memory.pk).update(created_at=F("created_at") - timedelta(hours=2))
    _user, client = staff_clients["support"]
    before = timezone.now()
    client.post(
        "/admin/memories/memory/?state=trash", {"action": "restore_from_trash", "_selected_action": [memory.pk]}
    )
    memory.refresh_from_db()
    assert memory.deleted_at is None
    assert before + timedelta(hours=1) <= memory.expires_at <= timezone.now() + timedelta(hours=1)
    assert services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY).memory.value == "en"


def test_an_action_on_every_memory_of_a_huge_list_works_through_a_bounded_batch_per_run(
    tenant_a, staff_clients, monkeypatch
):
    # "Select all N" hands the action the whole filtered list: a million memories would be
    # loaded with their values and updated one service call at a time in one request.
    from zeromem.kit import admin as kit_admin

    monkeypatch.setattr(kit_admin, "ACTION_MAX", 3)
    for i in range(5):
        write(tenant_a, f"user:u1:k{i}", f"value {i}", ttl_seconds=60)
    _user, client = staff_clients["support"]

    def run(action, query="", **extra):
        data = {"action": action, "select_across": "1", "index": "0", "_selected_action": ["1"], **extra}
        response = client.post(f"/admin/memories/memory/{query}", data, follow=True)
        assert response.status_code == 200
        return response.content.decode()

    later = timezone.now() + timedelta(days=9)
    assert "at most 3 per run" in run("extend_ttl", ttl_days=10)
    assert Memory.objects.filter(tenant=tenant_a, expires_at__gt=later).count() == 3
    assert "at most 3 per run" in run("move_to_trash")
    assert Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=False).count() == 3
    assert "at most 3 per run" not in run("move_to_trash")  # the other two
    assert Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=False).count() == 5
    assert "at most 3 per run" in run("restore_from_trash", "?state=trash")
    assert Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True).count() == 3


def test_list_filters_drill_down_the_key_tree_and_find_by_subject_tag_expiry_and_text(tenant_a, staff_clients):
    write(tenant_a, "user:u1:pref_lang", "en", tags=["lang"])
    write(tenant_a, "user:u2:pref_lang", "fr")
    write(tenant_a, "task:t1:status", "the weekly report goes out on friday", ttl_seconds=3600)
    expired = write(tenant_a, "task:t2:status", "old", ttl_seconds=1)
    Memory.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=5))
    _user, client = staff_clients["viewer"]

    def keys(query):
        response = client.get(f"/admin/memories/memory/?{query}")
        assert response.status_code == 200, query
        return sorted(m.key for m in response.context["cl"].result_list)

    top = client.get("/admin/memories/memory/").content.decode()
    assert "?prefix=user%3A" in top and "?prefix=task%3A" in top
    assert keys("prefix=user:") == ["user:u1:pref_lang", "user:u2:pref_lang"]
    assert "prefix=user%3Au1%3A" in client.get("/admin/memories/memory/?prefix=user:").content.decode()
    assert keys("prefix=user:u1:") == ["user:u1:pref_lang"]
    assert keys("subject=u2") == ["user:u2:pref_lang"]
    assert keys("tag=lang") == ["user:u1:pref_lang"]
    assert keys("category=task") == ["task:t1:status", "task:t2:status"]
    assert keys("expiry=soon") == ["task:t1:status"]
    assert keys("expiry=expired") == ["task:t2:status"]
    assert keys("q=weekly") == ["task:t1:status"]
    assert keys("q=u2") == ["user:u2:pref_lang"]


class _FetchedBytes:
    """The bytes of the rows the database sends this process (every fetch of a cursor) while
    it is open: what a page loads, whatever it renders."""

    def __init__(self):
        self.total = 0

    def __enter__(self):
        from django.db import connection

        connection.ensure_connection()
        with connection.cursor() as probe:
            self._cls = type(probe.cursor)  # the backend's cursor class (psycopg's, subclassed)
        self._patched = []
        for name in ("fetchone", "fetchmany", "fetchall"):
            original = getattr(self._cls, name)

            def counting(cursor, *args, _original=original, **kwargs):
                rows = _original(cursor, *args, **kwargs)
                many = rows if isinstance(rows, list) else [rows] if rows is not None else []
                self.total += sum(len(str(row).encode()) for row in many)
                return rows

            self._patched.append((name, self._cls.__dict__.get(name)))
            setattr(self._cls, name, counting)
        return self

    def __exit__(self, *exc):
        for name, own in self._patched:
            if own is None:
                delattr(self._cls, name)
            else:
                setattr(self._cls, name, own)


def _long_history(tenant, n: int, size: int):
    """A memory of ``n`` versions, each a ``size``-byte string ending in its own marker."""
    tenant.value_max_bytes = 256 * 1024
    tenant.save(update_fields=["value_max_bytes"])
    memory = write(tenant, KEY, "x" * size + "END-OF-V1")
    for version in range(2, n + 1):
        services.memory_update(tenant=tenant, actor=SYSTEM, key=KEY, value="x" * size + f"END-OF-V{version}")
    return memory


def test_history_pages_versions_and_loads_only_previews(tenant_a, staff_clients):
    # The page loaded up to 200 whole versions (up to the value cap each: tens of MB a page).
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    memory = _long_history(tenant_a, 30, 100_000)
    _user, client = staff_clients["viewer"]
    url = f"/admin/memories/memory/{memory.pk}/history/"
    with _FetchedBytes() as fetched, CaptureQueriesContext(connection) as queries:
        response = client.get(url)
    body = response.content.decode()
    assert response.status_code == 200
    shown = [int(v) for v in re.findall(r'class="version-row" data-version="(\d+)"', body)]
    assert shown == list(range(30, 10, -1))  # the newest 20
    assert "END-OF-V" not in body  # previews, not whole values
    assert "97.7 KB" in body  # each value's size (100,011 bytes of JSON text)
    assert len(response.content) < 60_000 and fetched.total < 60_000, (len(response.content), fetched.total)
    first_queries = len(queries)
    older = re.search(r'href="\?before=(\d+)" id="older-versions"', body)
    assert older and older.group(1) == "11"
    with CaptureQueriesContext(connection) as queries:
        body = client.get(f"{url}?before=11").content.decode()
    assert [int(v) for v in re.findall(r'class="version-row" data-version="(\d+)"', body)] == list(range(10, 0, -1))
    assert 'id="older-versions"' not in body and 'id="newest-versions"' in body
    assert len(queries) == first_queries  # a page costs the same whatever the history holds
    events = _events(tenant_a, "memory.history")
    assert [(e.target, e.count, e.outcome) for e in events] == [(KEY, 20, "ok"), (KEY, 10, "ok")]


def test_opening_one_version_loads_its_whole_value_audited(tenant_a, staff_clients):
    memory = _long_history(tenant_a, 3, 50_000)
    _user, client = staff_clients["viewer"]
    history = client.get(f"/admin/memories/memory/{memory.pk}/history/").content.decode()
    link = f"/admin/memories/memory/{memory.pk}/history/2/"
    assert f'href="{link}"' in history
    with _FetchedBytes() as fetched:
        response = client.get(link)
    body = response.content.decode()
    assert response.status_code == 200 and "END-OF-V2" in body and "END-OF-V3" not in body
    assert fetched.total < 2 * 50_000 + 20_000  # that one value, not the others
    event = _events(tenant_a, "memory.history")[-1]
    assert (event.target, event.count, event.version, event.outcome) == (KEY, 1, 2, "ok")
    assert event.detail.get("opened_version") == 2
    missing = client.get(f"/admin/memories/memory/{memory.pk}/history/9/")
    assert missing.status_code == 404
    assert _events(tenant_a, "memory.history")[-1].outcome == "not_found"


def test_history_paging_refuses_a_bad_cursor_naming_the_field(tenant_a, staff_clients):
    memory = write(tenant_a, KEY, "en")
    _user, client = staff_clients["viewer"]
    before = AuditEvent.objects.count()
    response = client.get(f"/admin/memories/memory/{memory.pk}/history/?before=abc")
    assert response.status_code == 400 and b"before" in response.content
    assert AuditEvent.objects.filter(action="memory.history", outcome="ok").count() == 0
    assert AuditEvent.objects.count() <= before + 1  # at most the refusal itself


def test_another_tenants_staff_cannot_open_a_version(tenant_a, tenant_b, staff_clients, fast_password_hashing):
    from tests.factories import logged_in, make_staff

    memory = write(tenant_a, KEY, "secret of a")
    other = logged_in(make_staff(tenant_b, "admin", "other-admin"))
    for url in (f"/admin/memories/memory/{memory.pk}/history/1/", f"/admin/memories/memory/{memory.pk}/history/"):
        response = other.get(url)
        assert response.status_code in (403, 404) and b"secret of a" not in response.content


def test_a_sensitive_version_stays_masked_on_its_page_until_a_reveal(tenant_a, staff_clients):
    tenant_a.value_max_bytes = 64 * 1024
    tenant_a.save(update_fields=["value_max_bytes"])
    small = "CANARY-small-4e1d"
    memory = write(tenant_a, KEY, small, sensitive=True)
    services.memory_update(tenant=tenant_a, actor=SYSTEM, key=KEY, value="y" * 30_000 + "CANARY-large-77ab")
    _user, client = staff_clients["support"]
    history_url = f"/admin/memories/memory/{memory.pk}/history/"
    one = f"{history_url}1/"
    masked = client.get(one).content.decode()
    assert small not in masked and "Reveal values" in masked
    client.post(f"/admin/memories/memory/{memory.pk}/reveal/", {"next": "history"})
    assert small in client.get(one).content.decode()
    with _FetchedBytes() as fetched:
        history = client.get(history_url).content.decode()
    # The small sealed version comes opened with the page; the large one only on its own page.
    assert small in history and "CANARY-large" not in history and "open this version" in history
    assert fetched.total < 20_000, fetched.total
    assert "CANARY-large-77ab" in client.get(f"{history_url}2/").content.decode()
