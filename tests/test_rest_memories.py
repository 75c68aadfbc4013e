"""REST resources: /api/v1/memories (list), /{key} (GET/PUT/PATCH/DELETE with ETag and
If-Match) and /{key}/history."""

from datetime import timedelta

import pytest
from django.utils import timezone

from audit.models import AuditEvent
from memories.models import ApiKey, Memory
from tests.helpers import rest_error, row_counts
from zeromem.kernel import opaque, validation

KEY = "user:u1:pref_lang"
URL = f"/api/v1/memories/{KEY}"


def _state(key=KEY):
    m = Memory.objects.get(key=key, deleted_at__isnull=True)
    return (m.pk, m.value, m.version, m.tags, m.updated_at)


@pytest.fixture
def stored(api):
    r = api.put(URL, {"value": "zh-CN", "tags": ["lang"]})
    assert r.status_code == 201
    return api


# --- list -------------------------------------------------------------------------------


@pytest.fixture
def many(api):
    rows = [
        ("user:u1:lang", "zh", {"tags": ["pref", "lang"]}),
        ("user:u1:diet", "veg", {"tags": ["pref"]}),
        ("user:u2:lang", "en", {"tags": ["lang"]}),
        ("task:t1:status", "done", {}),
        ("task:t2:status", "open", {"category": "decision"}),
        ("fact:office:wifi", "fridge", {"subject": "u2"}),
    ]
    for key, value, extra in rows:
        assert api.put(f"/api/v1/memories/{key}", {"value": value, **extra}).status_code == 201
    return api


def _keys(response):
    assert response.status_code == 200, response.content
    return [m["key"] for m in response.json()["results"]]


def test_list_returns_full_memories_ordered_by_key(many):
    r = many.get("/api/v1/memories")
    assert _keys(r) == sorted(
        ["user:u1:lang", "user:u1:diet", "user:u2:lang", "task:t1:status", "task:t2:status", "fact:office:wifi"]
    )
    first = r.json()["results"][0]
    assert first["key"] == "fact:office:wifi" and first["value"] == "fridge"
    assert set(first) >= {"namespace", "category", "subject", "tags", "version", "created_at", "updated_at"}
    assert r.json()["next_cursor"] is None


@pytest.mark.parametrize(
    "params,expected",
    [
        ({"prefix": "user:u1:"}, ["user:u1:diet", "user:u1:lang"]),
        ({"prefix": "task:"}, ["task:t1:status", "task:t2:status"]),
        ({"category": "user"}, ["user:u1:diet", "user:u1:lang", "user:u2:lang"]),
        ({"category": "decision"}, ["task:t2:status"]),
        ({"category": "task"}, ["task:t1:status"]),
        ({"subject": "u2"}, ["fact:office:wifi", "user:u2:lang"]),
        ({"subject": "u1", "tag": "lang"}, ["user:u1:lang"]),
        ({"tag": "pref"}, ["user:u1:diet", "user:u1:lang"]),
        ({"tag": "lang", "prefix": "user:u2:"}, ["user:u2:lang"]),
        ({"tag": "nope"}, []),
        ({"prefix": "zzz:"}, []),
    ],
)
def test_list_filters(many, params, expected):
    assert _keys(many.get("/api/v1/memories", params)) == expected


def test_list_tag_filter_is_exact_not_substring(many):
    many.put("/api/v1/memories/user:u3:x", {"value": 1, "tags": ["preference"]})
    assert _keys(many.get("/api/v1/memories", {"tag": "pref"})) == ["user:u1:diet", "user:u1:lang"]


def test_list_cursor_pagination_walks_every_memory_once(api):
    keys = sorted(f"task:t{i:02d}:s" for i in range(11))
    for key in keys:
        api.put(f"/api/v1/memories/{key}", {"value": key})
    seen, cursor, pages = [], None, 0
    while True:
        params = {"prefix": "task:", "limit": "4"}
        if cursor:
            params["cursor"] = cursor
        r = api.get("/api/v1/memories", params)
        page = _keys(r)
        assert len(page) <= 4
        seen += page
        pages += 1
        cursor = r.json()["next_cursor"]
        if cursor is None:
            break
    assert seen == keys and pages == 3


def test_list_cursor_is_shared_with_the_tool(api):
    for i in range(5):
        api.put(f"/api/v1/memories/task:t{i}:s", {"value": i})
    _, body = api.call("memory_list", prefix="task:", limit=2)
    r = api.get("/api/v1/memories", {"prefix": "task:", "cursor": body["next_cursor"]})
    assert _keys(r) == ["task:t2:s", "task:t3:s", "task:t4:s"]


def test_the_longest_cursor_one_surface_emits_the_other_accepts(api):
    """A page ending on a 512-character key of 4-byte characters: its cursor (2,731 characters,
    validation.CURSOR_MAX_LEN) from the tool is taken by REST, and REST's by the tool."""
    keys = [ch * validation.KEY_MAX_LEN for ch in ("𠀀", "𠀁", "𠀂")]
    for key in keys:
        api.call("memory_write", key=key, value=1)
    _, body = api.call("memory_list", limit=1)
    assert body["keys"] == keys[:1] and len(body["next_cursor"]) == validation.CURSOR_MAX_LEN
    r = api.get("/api/v1/memories", {"limit": "1", "cursor": body["next_cursor"]})
    assert r.status_code == 200 and _keys(r) == keys[1:2]
    assert len(r.json()["next_cursor"]) == validation.CURSOR_MAX_LEN
    _, body = api.call("memory_list", cursor=r.json()["next_cursor"])
    assert body["keys"] == keys[2:] and body["next_cursor"] is None


# --- GET / PUT --------------------------------------------------------------------------


def test_get_returns_the_memory_with_an_etag(stored):
    r = stored.get(URL)
    assert r.status_code == 200
    body = r.json()
    assert (body["key"], body["value"], body["version"], body["tags"]) == (KEY, "zh-CN", 1, ["lang"])
    assert body["namespace"] == "user:u1" and body["subject"] == "u1" and body["category"] == "user"
    memory = Memory.objects.get(key=KEY)
    # The row's opaque token and the version; never the row id (tests/test_opaque_ids.py).
    token, version = r["ETag"].strip('"').rsplit("-", 1)
    assert r["ETag"] == memory.etag and version == "1" and len(token) == 32 and token != str(memory.pk)


def test_get_of_missing_key_is_404(api):
    r = api.get("/api/v1/memories/user:u1:none")
    assert r.status_code == 404
    assert rest_error(r) == {"code": "not_found", "message": "no memory at this key", "field": "key"}


def test_put_creates_201_then_replaces_200(api):
    r = api.put(URL, {"value": "zh-CN", "tags": ["a"], "importance": 8})
    assert r.status_code == 201
    assert r.json()["version"] == 1
    first_etag = r["ETag"]
    r = api.put(URL, {"value": "en"})
    assert r.status_code == 200
    body = r.json()
    assert (body["value"], body["version"], body["tags"], body["importance"]) == ("en", 2, ["a"], 8)
    assert r["ETag"] != first_etag and r["ETag"] == api.get(URL)["ETag"]


def test_put_with_stale_if_match_is_412_and_changes_nothing(stored):
    etag = stored.get(URL)["ETag"]
    stored.put(URL, {"value": "en"})  # moves to version 2
    before, counts = _state(), row_counts()
    r = stored.put(URL, {"value": "fr"}, headers={"If-Match": etag})
    assert r.status_code == 412
    error = rest_error(r)
    assert error["code"] == "precondition_failed" and error["field"] == "If-Match"
    assert _state() == before and row_counts() == counts


def test_put_with_current_etag_replaces(stored):
    etag = stored.get(URL)["ETag"]
    r = stored.put(URL, {"value": "fr"}, headers={"If-Match": etag})
    assert r.status_code == 200
    assert r.json()["value"] == "fr" and r.json()["version"] == 2
    assert _state()[1:3] == ("fr", 2)
    # The old ETag no longer matches.
    assert stored.put(URL, {"value": "de"}, headers={"If-Match": etag}).status_code == 412


def test_put_with_current_etag_and_sensitive_seals_the_new_value(stored):
    """A conditional replace takes the body's `sensitive` as an unconditional one does (it was
    a 500: the If-Match path did not pass it on)."""
    import json

    from django.db import connection

    etag = stored.get(URL)["ETag"]
    r = stored.put(URL, {"value": "+86 138 0000 0000", "sensitive": True}, headers={"If-Match": etag})
    assert r.status_code == 200, r.content
    assert r.json()["value"] == "+86 138 0000 0000" and r.json()["version"] == 2
    memory = Memory.objects.get(key=KEY)
    assert memory.sensitive
    with connection.cursor() as cursor:
        cursor.execute("SELECT value FROM memories_memory WHERE id = %s", [memory.pk])
        raw = cursor.fetchone()[0]
    assert "138 0000" not in (raw if isinstance(raw, str) else json.dumps(raw))
    bad = stored.put(URL, {"value": "x", "sensitive": "yes"}, headers={"If-Match": r["ETag"]})
    assert bad.status_code == 400 and rest_error(bad)["field"] == "sensitive"


def test_put_with_if_match_on_missing_key_is_412_and_creates_nothing(api):
    counts = row_counts()
    r = api.put(URL, {"value": "x"}, headers={"If-Match": '"1-1"'})
    assert r.status_code == 412
    assert row_counts() == counts


@pytest.mark.parametrize("bogus", ['"garbage"', "*x", '"12"', "W/"])
def test_unrecognised_if_match_is_412(stored, bogus):
    before = _state()
    assert stored.put(URL, {"value": "x"}, headers={"If-Match": bogus}).status_code == 412
    assert stored.patch(URL, {"value": "x"}, headers={"If-Match": bogus}).status_code == 412
    assert stored.delete(URL, headers={"If-Match": bogus}).status_code == 412
    assert _state() == before


def test_weak_form_of_current_etag_matches(stored):
    etag = stored.get(URL)["ETag"]
    assert stored.patch(URL, {"value": "x"}, headers={"If-Match": "W/" + etag}).status_code == 200


def test_etag_of_a_recreated_key_differs_from_the_deleted_one(stored):
    old = stored.get(URL)["ETag"]
    stored.delete(URL)
    stored.put(URL, {"value": "again"})
    new = stored.get(URL)["ETag"]
    assert new != old
    assert stored.put(URL, {"value": "x"}, headers={"If-Match": old}).status_code == 412


# --- PATCH ------------------------------------------------------------------------------


def test_patch_changes_only_given_fields(stored):
    r = stored.patch(URL, {"tags": ["x", "y"]})
    assert r.status_code == 200
    body = r.json()
    assert (body["value"], body["tags"], body["version"]) == ("zh-CN", ["x", "y"], 2)
    r = stored.patch(URL, {"value": {"lang": "en"}})
    assert (r.json()["value"], r.json()["tags"], r.json()["version"]) == ({"lang": "en"}, ["x", "y"], 3)
    assert r["ETag"] == stored.get(URL)["ETag"]


def test_patch_with_stale_if_match_is_412_and_changes_nothing(stored):
    etag = stored.get(URL)["ETag"]
    stored.patch(URL, {"value": "en"})
    before, counts = _state(), row_counts()
    r = stored.patch(URL, {"value": "fr"}, headers={"If-Match": etag})
    assert r.status_code == 412
    assert _state() == before and row_counts() == counts


def test_patch_with_current_etag_succeeds(stored):
    r = stored.patch(URL, {"value": "fr"}, headers={"If-Match": stored.get(URL)["ETag"]})
    assert r.status_code == 200 and r.json()["version"] == 2


def test_patch_with_stale_expected_version_is_409_with_current_version(stored):
    stored.patch(URL, {"value": "en"})
    before = _state()
    r = stored.patch(URL, {"value": "fr", "expected_version": 1})
    assert r.status_code == 409
    error = rest_error(r)
    assert error["code"] == "conflict" and error["current_version"] == 2
    assert _state() == before


def test_patch_of_missing_key_is_404_and_creates_nothing(api):
    counts = row_counts()
    r = api.patch("/api/v1/memories/user:u1:none", {"value": "x"})
    assert r.status_code == 404
    assert rest_error(r)["code"] == "not_found"
    assert row_counts() == counts


# --- DELETE -----------------------------------------------------------------------------


def test_delete_is_204_then_get_is_404(stored):
    r = stored.delete(URL)
    assert r.status_code == 204
    assert r.content == b""
    assert stored.get(URL).status_code == 404
    assert stored.delete(URL).status_code == 404
    assert Memory.objects.trashed().filter(key=KEY).count() == 1


def test_delete_with_stale_if_match_is_412_and_changes_nothing(stored):
    etag = stored.get(URL)["ETag"]
    stored.put(URL, {"value": "en"})
    before, counts = _state(), row_counts()
    r = stored.delete(URL, headers={"If-Match": etag})
    assert r.status_code == 412
    assert _state() == before and row_counts() == counts
    assert stored.get(URL).status_code == 200


def test_delete_with_current_etag_succeeds(stored):
    r = stored.delete(URL, headers={"If-Match": stored.get(URL)["ETag"]})
    assert r.status_code == 204
    assert stored.get(URL).status_code == 404


# --- history ----------------------------------------------------------------------------


def test_history_lists_versions_newest_first_with_op_and_actor(stored):
    stored.patch(URL, {"value": "en"})
    stored.put(URL, {"value": "fr"})
    stored.call("memory_update", key=KEY, value="de")
    r = stored.get(f"{URL}/history")
    assert r.status_code == 200
    body = r.json()
    assert body["key"] == KEY
    key = ApiKey.objects.get(tenant=stored.tenant)
    assert [(v["version"], v["op"], v["value"]) for v in body["results"]] == [
        (4, "update", "de"),
        (3, "write", "fr"),
        (2, "update", "en"),
        (1, "write", "zh-CN"),
    ]
    # The key's id as a token, not its row id (tests/test_opaque_ids.py).
    shown = opaque.shown_actor_id("api_key", str(key.pk))
    assert {(v["actor_kind"], v["actor_id"]) for v in body["results"]} == {("api_key", shown)}
    assert all(v["created_at"] for v in body["results"])


def test_history_limit(stored):
    for value in ["a", "b", "c"]:
        stored.put(URL, {"value": value})
    r = stored.get(f"{URL}/history", {"limit": "2"})
    assert [v["version"] for v in r.json()["results"]] == [4, 3]


def test_history_of_missing_or_deleted_key_is_404(stored):
    assert stored.get("/api/v1/memories/user:u1:none/history").status_code == 404
    stored.delete(URL)
    assert stored.get(f"{URL}/history").status_code == 404


def test_history_of_recreated_key_starts_over(stored):
    stored.delete(URL)
    stored.put(URL, {"value": "new"})
    r = stored.get(f"{URL}/history")
    assert [(v["version"], v["op"]) for v in r.json()["results"]] == [(1, "write")]


def test_if_match_star_matches_any_current_version_but_not_a_missing_memory(stored):
    assert stored.patch(URL, {"value": "x"}, headers={"If-Match": "*"}).status_code == 200
    assert stored.put(URL, {"value": "y"}, headers={"If-Match": "*"}).status_code == 200
    assert stored.get(URL).json()["value"] == "y"
    assert stored.delete(URL, headers={"If-Match": "*"}).status_code == 204
    counts = row_counts()
    assert stored.put(URL, {"value": "z"}, headers={"If-Match": "*"}).status_code == 412
    assert stored.delete(URL, headers={"If-Match": "*"}).status_code == 412
    assert row_counts() == counts


def _events(tenant, since: int) -> list[tuple]:
    rows = AuditEvent.objects.filter(tenant=tenant, id__gt=since).order_by("id")
    return [(e.action, e.outcome, e.detail.get("field")) for e in rows]


def _last_event_id() -> int:
    return AuditEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0


def test_put_with_if_none_match_star_creates_only_when_there_is_no_memory(api):
    """If-None-Match: * was ignored: a client asking "create only" overwrote the memory."""
    assert api.put(URL, {"value": "first"}, headers={"If-None-Match": "*"}).status_code == 201
    before, counts, since = _state(), row_counts(), _last_event_id()
    r = api.put(URL, {"value": "second"}, headers={"If-None-Match": "*"})
    assert r.status_code == 412
    assert (rest_error(r)["code"], rest_error(r)["field"]) == ("precondition_failed", "If-None-Match")
    assert _state() == before and row_counts() == counts
    assert _events(api.tenant, since) == [("memory.write", "precondition_failed", "If-None-Match")]
    # A memory in the trash, or expired, holds no key: create-only takes it.
    api.delete(URL)
    assert api.put(URL, {"value": "third"}, headers={"If-None-Match": " * "}).status_code == 201
    Memory.objects.filter(key=KEY, deleted_at__isnull=True).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert api.put(URL, {"value": "fourth"}, headers={"If-None-Match": "*"}).status_code == 201
    assert api.get(URL).json()["value"] == "fourth"


@pytest.mark.parametrize(
    ("method", "headers"),
    [
        ("put", {"If-None-Match": '"1-1"'}),
        ("put", {"If-None-Match": "garbage"}),
        ("put", {"If-None-Match": "*", "If-Match": "*"}),
        ("patch", {"If-None-Match": "*"}),
        ("delete", {"If-None-Match": '"1-1"'}),
    ],
)
def test_an_if_none_match_a_write_cannot_honour_is_a_400_naming_it(stored, method, headers):
    """Any If-None-Match but PUT's "*" was ignored: the write went through unguarded."""
    before, counts, since = _state(), row_counts(), _last_event_id()
    if method == "delete":
        r = stored.delete(URL, headers=headers)
    else:
        r = getattr(stored, method)(URL, {"value": "x"}, headers=headers)
    assert r.status_code == 400
    assert rest_error(r)["field"] == "If-None-Match"
    assert _state() == before and row_counts() == counts
    action = {"put": "memory.write", "patch": "memory.update", "delete": "memory.delete"}[method]
    assert _events(stored.tenant, since) == [(action, "invalid", "If-None-Match")]


def test_if_none_match_is_part_of_an_idempotent_requests_fingerprint(api):
    headers = {"Idempotency-Key": "create-once-1", "If-None-Match": "*"}
    assert api.put(URL, {"value": "first"}, headers=headers).status_code == 201
    assert api.put(URL, {"value": "first"}, headers=headers)["Idempotent-Replayed"] == "true"
    r = api.put(URL, {"value": "first"}, headers={"Idempotency-Key": "create-once-1"})
    assert (r.status_code, rest_error(r)["code"]) == (422, "idempotency_key_reused")


def test_if_match_with_a_list_of_etags_matches_when_the_current_one_is_in_it(stored):
    """A list (RFC 9110: any of them) was read as one unknown ETag: always 412."""
    old = stored.get(URL)["ETag"]
    current = stored.patch(URL, {"importance": 7})["ETag"]
    assert stored.patch(URL, {"value": "x"}, headers={"If-Match": f'"garbage", {current}'}).status_code == 200
    current = stored.get(URL)["ETag"]
    before, counts = _state(), row_counts()
    assert stored.put(URL, {"value": "y"}, headers={"If-Match": f"{old},W/{old}"}).status_code == 412
    assert stored.delete(URL, headers={"If-Match": f'{old}, "9-9"'}).status_code == 412
    assert _state() == before and row_counts() == counts
    assert stored.put(URL, {"value": "y"}, headers={"If-Match": f"{old}, {current}"}).status_code == 200
    assert stored.delete(URL, headers={"If-Match": f"{old},{stored.get(URL)['ETag']}"}).status_code == 204


def test_an_if_match_list_of_more_than_twenty_etags_is_a_400_naming_it(stored):
    before = _state()
    many = ", ".join(f'"1-{v}"' for v in range(21))
    r = stored.patch(URL, {"value": "x"}, headers={"If-Match": many})
    assert (r.status_code, rest_error(r)["field"]) == (400, "If-Match")
    assert _state() == before


@pytest.mark.parametrize("body", [{}, {"tags": None, "ttl_seconds": None}, {"expected_version": 1}])
def test_a_patch_that_changes_nothing_is_a_400_and_moves_no_version(stored, body):
    """It was 200 with a new version and history row: every other client's ETag went stale."""
    before, counts, since = _state(), row_counts(), _last_event_id()
    r = stored.patch(URL, body, headers={"If-Match": "*"})
    assert (r.status_code, rest_error(r)["code"], rest_error(r)["field"]) == (400, "nothing_to_change", "body")
    assert _state() == before and row_counts() == counts
    assert _events(stored.tenant, since) == [("memory.update", "invalid", "body")]


def test_an_empty_subject_means_none_on_rest_as_on_the_tool(api):
    """REST refused subject "" (400 blank) where the tool and the service take it as "no
    subject" — the very spelling the service's refusal of a blank subject advises."""
    status, _ = api.call("memory_write", key="user:u1:by_tool", value=1, subject="")
    assert status == 200
    r = api.put("/api/v1/memories/user:u1:by_rest", {"value": 1, "subject": ""})
    assert r.status_code == 201, r.content
    subjects = dict(Memory.objects.filter(key__startswith="user:u1:by_").values_list("key", "subject"))
    assert subjects == {"user:u1:by_tool": "", "user:u1:by_rest": ""}
    r = api.put("/api/v1/memories/user:u1:by_rest", {"value": 1, "subject": " "})
    assert (r.status_code, rest_error(r)["code"], rest_error(r)["field"]) == (400, "blank", "subject")


@pytest.mark.parametrize("field", ["ttl_seconds", "importance"])
def test_numeric_strings_are_not_integers(api, field):
    counts = row_counts()
    r = api.put(URL, {"value": "x", field: "5"})
    assert r.status_code == 400
    assert r.json()["error"]["field"] == field
    assert row_counts() == counts


def test_answers_carrying_values_are_not_stored_by_caches(api):
    assert api.put("/api/v1/memories/user:u1:lang", {"value": "zh-CN"})["Cache-Control"] == "no-store"
    for r in (
        api.get("/api/v1/memories/user:u1:lang"),
        api.get("/api/v1/memories", {"prefix": "user:"}),
        api.get("/api/v1/memories/user:u1:lang/history"),
        api.post("/api/v1/tools/call", {"name": "memory_read", "arguments": {"key": "user:u1:lang"}}),
        api.get("/api/v1/audit-events"),
        api.get("/api/v1/memories/user:u1:nothing"),  # errors too
    ):
        assert r.status_code in (200, 404), r.content
        assert r["Cache-Control"] == "no-store", r.request["PATH_INFO"]


def test_a_list_in_descending_order_pages_back_from_the_last_key(api):
    for i in range(5):
        assert api.put(f"/api/v1/memories/log:e{i}", {"value": i}).status_code in (200, 201)
    first = api.get("/api/v1/memories", {"prefix": "log:", "order": "desc", "limit": 2}).json()
    assert [m["key"] for m in first["results"]] == ["log:e4", "log:e3"]
    page = {"prefix": "log:", "order": "desc", "limit": 2, "cursor": first["next_cursor"]}
    second = api.get("/api/v1/memories", page)
    assert [m["key"] for m in second.json()["results"]] == ["log:e2", "log:e1"]
    ascending = api.get("/api/v1/memories", {"prefix": "log:", "limit": 2}).json()
    assert [m["key"] for m in ascending["results"]] == ["log:e0", "log:e1"]


def test_a_list_order_other_than_asc_or_desc_is_a_400_naming_order(api):
    r = api.get("/api/v1/memories", {"order": "newest"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "order"


# --- pages of whole values: a byte budget -------------------------------------------------

PAGE_BUDGET = 1000
# (key, length of the string value, tagged): the JSON text of a string of n ASCII letters is
# n + 2 bytes. Mixed sizes: some pages stop on the budget, one value is past it alone.
SIZED = [
    ("a:k01", 100, True),
    ("a:k02", 700, False),
    ("a:k03", 300, True),
    ("a:k04", 1500, True),
    ("a:k05", 10, False),
    ("b:k06", 400, True),
    ("b:k07", 400, True),
    ("c:k08", 198, True),
    ("c:k09", 2000, False),
    ("c:k10", 5, True),
    ("c:k11", 600, True),
    ("c:k12", 390, True),
]


@pytest.fixture
def sized_values(tenant_a, make_client, settings):
    settings.ZEROMEM_PAGE_VALUES_MAX_BYTES = PAGE_BUDGET
    client, _ = make_client(tenant_a)
    for i, (key, n, tagged) in enumerate(SIZED):
        body = {"value": chr(ord("a") + i) * n, "tags": ["t"] if tagged else []}
        assert client.put(f"/api/v1/memories/{key}", body).status_code == 201
    return client


def _expected_pages(rows, limit):
    """The pages by the rule: at most ``limit``, stopped before the values pass the budget
    (at least one a page)."""
    pages, page, total = [], [], 0
    for key, n in rows:
        if page and (len(page) == limit or total + n + 2 > PAGE_BUDGET):
            pages.append(page)
            page, total = [], 0
        page.append(key)
        total += n + 2
    return [*pages, page] if page else pages


def _walk(client, url, params, seen=None):
    pages, cursor = [], None
    while True:
        r = client.get(url, {**params, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.content
        body = r.json()
        pages.append([m.get("key", m.get("version")) for m in body["results"]])
        if seen is not None:
            seen.update((m["key"], m["value"]) for m in body["results"])
        cursor = body["next_cursor"]
        if cursor is None:
            return pages, body
        assert len(pages) < 50


@pytest.mark.parametrize("order", ["asc", "desc"])
@pytest.mark.parametrize("limit", [1, 2, 3, 50])
@pytest.mark.parametrize("view", ["all", "tag", "allowlist"])
def test_a_page_of_values_stops_at_the_byte_budget_and_the_next_goes_on_after_it(
    sized_values, tenant_a, make_client, order, limit, view
):
    client, params = sized_values, {"order": order, "limit": limit}
    rows = [(key, n) for key, n, tagged in SIZED]
    if view == "tag":
        params["tag"] = "t"
        rows = [(key, n) for key, n, tagged in SIZED if tagged]
    elif view == "allowlist":  # two prefixes: one merged walk of their ranges (PostgreSQL)
        client, _ = make_client(tenant_a, allow=["a:", "c:"])
        rows = [(key, n) for key, n in rows if not key.startswith("b:")]
    rows.sort(reverse=order == "desc")
    pages, _ = _walk(client, "/api/v1/memories", params, seen := {})
    assert pages == _expected_pages(rows, limit)
    # Each value whole (small ones came with the page, larger ones were read after it).
    written = {key: chr(ord("a") + i) * n for i, (key, n, _) in enumerate(SIZED)}
    assert seen == {key: written[key] for key, _ in rows}


def test_a_value_past_the_budget_alone_is_a_page_of_its_own(sized_values):
    r = sized_values.get("/api/v1/memories", {"prefix": "c:k09"})
    assert [m["value"] for m in r.json()["results"]] == ["i" * 2000]
    assert r.json()["next_cursor"] is None
    first = sized_values.get("/api/v1/memories", {"prefix": "c:", "limit": 10}).json()
    assert [m["key"] for m in first["results"]] == ["c:k08"]  # 200 + 2002 would pass 1000
    second = sized_values.get("/api/v1/memories", {"prefix": "c:", "cursor": first["next_cursor"]}).json()
    assert [(m["key"], m["version"], len(m["value"])) for m in second["results"]] == [("c:k09", 1, 2000)]


def test_a_sealed_value_in_a_budgeted_page_is_opened_small_or_large(api, settings):
    settings.ZEROMEM_PAGE_VALUES_MAX_BYTES = 50_000  # inline up to 980 bytes (a page of 50 + 1)
    big, small = "s" * 10_000, "secret"
    for key, value in (("p:big", big), ("p:small", small), ("p:plain", "x" * 12_000)):
        assert api.put(f"/api/v1/memories/{key}", {"value": value, "sensitive": True}).status_code == 201
    r = api.get("/api/v1/memories", {"prefix": "p:"})
    assert {m["key"]: m["value"] for m in r.json()["results"]} == {
        "p:big": big,
        "p:plain": "x" * 12_000,
        "p:small": small,
    }


def test_a_history_page_stops_at_the_byte_budget_and_its_cursor_goes_on(stored, settings):
    settings.ZEROMEM_PAGE_VALUES_MAX_BYTES = PAGE_BUDGET
    lengths = [100, 700, 300, 1500, 10, 400, 400]  # versions 2-8; version 1 is "zh-CN" (7 bytes)
    for i, n in enumerate(lengths):
        assert stored.put(URL, {"value": chr(ord("a") + i) * n}).status_code == 200
    rows = [(8 - i, n) for i, n in enumerate(reversed(lengths))] + [(1, 5)]
    for limit in (1, 2, 3, 50):
        pages, last = _walk(stored, f"{URL}/history", {"limit": limit})
        assert pages == _expected_pages(rows, limit), limit
        assert last["key"] == KEY
    r = stored.get(f"{URL}/history", {"limit": 50}).json()
    assert [(v["version"], v["value"]) for v in r["results"]] == [(8, "g" * 400), (7, "f" * 400), (6, "e" * 10)]
    r = stored.get(f"{URL}/history", {"cursor": r["next_cursor"]}).json()
    assert [(v["version"], v["value"]) for v in r["results"]] == [(5, "d" * 1500)]


def test_a_history_cursor_that_is_not_ours_is_a_400_naming_cursor(stored):
    for cursor in ("%%%", "eHl6", "MA"):  # not base64, "xyz", "0"
        r = stored.get(f"{URL}/history", {"cursor": cursor})
        assert r.status_code == 400 and rest_error(r)["field"] == "cursor", cursor


def test_a_page_under_the_budget_is_one_statement_and_a_large_value_is_read_only_when_kept(sized_values, tenant_a):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from memories import selectors

    def page(prefix, limit):
        with CaptureQueriesContext(connection) as queries:
            rows, _ = selectors.memory_keys_page(
                tenant=tenant_a, prefixes=[prefix], limit=limit, after=None, keys_only=False, max_bytes=PAGE_BUDGET
            )
        return [(m.key, len(m.value)) for m in rows], len(queries)

    # Budget 1000, limit 3: values of up to 250 bytes come with the page.
    assert page("c:k1", 3) == ([("c:k10", 5), ("c:k11", 600), ("c:k12", 390)][:2], 2)  # k11 read again
    assert page("a:k01", 3) == ([("a:k01", 100)], 1)
    # c:k09 (2,002 bytes) is never read: the page stops before it, at c:k08.
    with CaptureQueriesContext(connection) as queries:
        rows, last = selectors.memory_keys_page(
            tenant=tenant_a, prefixes=["c:"], limit=3, after=None, keys_only=False, max_bytes=PAGE_BUDGET
        )
    assert [m.key for m in rows] == ["c:k08"] and last == "c:k08" and len(queries) == 1
