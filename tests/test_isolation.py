"""Tenant isolation on every endpoint: another tenant's memory is indistinguishable from a
missing one, and nothing one tenant does touches another's rows."""

import pytest

from audit.models import AuditEvent
from memories.models import Memory, MemoryVersion

SECRET_KEY = "user:u1:secret"
MISSING_KEY = "user:u1:nowhere"


def _row(tenant, key=SECRET_KEY):
    m = Memory.objects.get(tenant=tenant, key=key, deleted_at__isnull=True)
    return (m.pk, m.value, m.version, m.tags, m.deleted_at, m.expires_at, m.updated_at, m.access_count)


def _without_key(body, key):
    """The body with every mention of the key removed (it differs by construction)."""
    if isinstance(body, dict):
        return {k: _without_key(v, key) for k, v in body.items() if k != "key"}
    if isinstance(body, list):
        return [_without_key(v, key) for v in body]
    return body.replace(key, "<key>") if isinstance(body, str) else body


@pytest.fixture
def a_has_secret(api):
    status, _ = api.call("memory_write", key=SECRET_KEY, value="zebra-orchid A-only", tags=["private"])
    assert status == 200
    api.call("memory_write", key="user:u1:other", value="zebra second A row")
    api.call("memory_write", key="task:t1:status", value="A task zebra")
    return api


@pytest.mark.parametrize(
    "tool,args",
    [
        ("memory_read", {}),
        ("memory_read", {"default": "fallback"}),
        ("memory_update", {"value": "B was here"}),
        ("memory_update", {"value": "B was here", "expected_version": 1}),
        ("memory_delete", {}),
    ],
)
def test_other_tenants_key_answers_exactly_like_a_missing_one(a_has_secret, api_b, tool, args):
    a_before = _row(a_has_secret.tenant)
    status_other, body_other = api_b.call(tool, key=SECRET_KEY, **args)
    status_missing, body_missing = api_b.call(tool, key=MISSING_KEY, **args)
    assert status_other == status_missing == 200
    assert body_other["status"] == "not_found"
    assert body_other["key"] == SECRET_KEY
    assert _without_key(body_other, SECRET_KEY) == _without_key(body_missing, MISSING_KEY)
    assert _row(a_has_secret.tenant) == a_before


def test_read_of_other_tenants_key_is_not_found(a_has_secret, api_b):
    _, body = api_b.call("memory_read", key=SECRET_KEY)
    assert body == {"status": "not_found", "key": SECRET_KEY}


def test_update_and_delete_by_other_tenant_leave_the_row_unchanged(a_has_secret, api_b):
    before = _row(a_has_secret.tenant)
    versions = MemoryVersion.objects.filter(tenant=a_has_secret.tenant).count()
    api_b.call("memory_update", key=SECRET_KEY, value="overwritten")
    api_b.call("memory_delete", key=SECRET_KEY)
    assert _row(a_has_secret.tenant) == before
    assert MemoryVersion.objects.filter(tenant=a_has_secret.tenant).count() == versions
    _, body = a_has_secret.call("memory_read", key=SECRET_KEY)
    assert body["value"] == "zebra-orchid A-only"


@pytest.mark.parametrize("prefix", [None, "", "user:", "user:u1:", "user:u1:secret"])
def test_list_from_other_tenant_returns_none_of_its_rows(a_has_secret, api_b, tenant_c, make_client, prefix):
    api_b.call("memory_write", key="user:u9:mine", value="B's own")
    args = {} if prefix is None else {"prefix": prefix}
    _, body = api_b.call("memory_list", **args)
    assert SECRET_KEY not in body["keys"] and "user:u1:other" not in body["keys"]
    assert set(body["keys"]) <= {"user:u9:mine"}
    client_c, _ = make_client(tenant_c)
    _, body = client_c.call("memory_list", **args)
    assert body["keys"] == []


@pytest.mark.parametrize("prefix", [None, "user:", "user:u1:"])
def test_search_and_recall_from_other_tenant_return_none_of_its_rows(a_has_secret, api_b, prefix):
    args = {} if prefix is None else {"prefix": prefix}
    _, body = a_has_secret.call("memory_search", query="zebra", **args)
    assert body["results"]  # the query does match A's rows, for A
    _, body = api_b.call("memory_search", query="zebra", **args)
    assert body == {"status": "ok", "results": []}
    _, body = api_b.call("memory_search", query="zebra-orchid A-only", **args)
    assert body["results"] == []
    _, body = api_b.call("memory_recall", query="zebra orchid", **args)
    assert body == {"status": "ok", "text": "", "count": 0}


def test_same_key_in_two_tenants_holds_independent_values(api, api_b):
    _, a = api.call("memory_write", key="user:u1:pref_lang", value="zh-CN")
    _, b = api_b.call("memory_write", key="user:u1:pref_lang", value="en")
    assert a["created"] is True and b["created"] is True
    api.call("memory_write", key="user:u1:pref_lang", value="fr")
    _, b_read = api_b.call("memory_read", key="user:u1:pref_lang")
    _, a_read = api.call("memory_read", key="user:u1:pref_lang")
    assert (a_read["value"], a_read["version"]) == ("fr", 2)
    assert (b_read["value"], b_read["version"]) == ("en", 1)
    api_b.call("memory_delete", key="user:u1:pref_lang")
    _, a_read = api.call("memory_read", key="user:u1:pref_lang")
    assert a_read["status"] == "ok" and a_read["value"] == "fr"
    _, conflict = api_b.call("memory_update", key="user:u1:pref_lang", value="x", expected_version=2)
    assert conflict["status"] == "not_found"


# --- REST -------------------------------------------------------------------------------


def _rest_pair(client, method, key, **kwargs):
    path = f"/api/v1/memories/{key}"
    if method == "history":
        return client.get(path + "/history")
    return getattr(client, method)(path, **kwargs)


@pytest.mark.parametrize(
    "method,kwargs",
    [
        ("get", {}),
        ("history", {}),
        ("patch", {"body": {"value": "B"}}),
        ("patch", {"body": {"value": "B", "expected_version": 1}}),
        ("delete", {}),
    ],
)
def test_rest_access_to_other_tenants_key_is_404_like_a_missing_one(a_has_secret, api_b, method, kwargs):
    before = _row(a_has_secret.tenant)
    other = _rest_pair(api_b, method, SECRET_KEY, **kwargs)
    missing = _rest_pair(api_b, method, MISSING_KEY, **kwargs)
    assert other.status_code == missing.status_code == 404
    assert _without_key(other.json(), SECRET_KEY) == _without_key(missing.json(), MISSING_KEY)
    assert other.json()["error"]["code"] == "not_found"
    assert _row(a_has_secret.tenant) == before


@pytest.mark.parametrize("method", ["put", "patch", "delete"])
def test_rest_write_with_other_tenants_etag_is_refused_like_a_missing_one(a_has_secret, api_b, method):
    etag = a_has_secret.get(f"/api/v1/memories/{SECRET_KEY}").headers["ETag"]
    before = _row(a_has_secret.tenant)
    kwargs = {"headers": {"If-Match": etag}}
    if method != "delete":
        kwargs["body"] = {"value": "B"}
    other = _rest_pair(api_b, method, SECRET_KEY, **kwargs)
    missing = _rest_pair(api_b, method, MISSING_KEY, **kwargs)
    assert other.status_code == missing.status_code == 412
    assert other.json() == missing.json()
    assert _row(a_has_secret.tenant) == before
    assert not Memory.objects.filter(tenant=api_b.tenant).exists()


def test_rest_put_of_same_key_by_other_tenant_creates_its_own_memory(a_has_secret, api_b):
    before = _row(a_has_secret.tenant)
    r = api_b.put(f"/api/v1/memories/{SECRET_KEY}", {"value": "B's value"})
    assert r.status_code == 201  # created in B's tenant, not "replaced"
    assert r.json()["version"] == 1
    assert _row(a_has_secret.tenant) == before
    assert _row(api_b.tenant)[1] == "B's value"


def test_rest_list_from_other_tenant_returns_none_of_its_rows(a_has_secret, api_b):
    for params in ({}, {"prefix": "user:"}, {"tag": "private"}, {"subject": "u1"}, {"category": "user"}):
        r = api_b.get("/api/v1/memories", params)
        assert r.status_code == 200
        assert r.json() == {"results": [], "next_cursor": None}
    r = a_has_secret.get("/api/v1/memories", {"tag": "private"})
    assert [m["key"] for m in r.json()["results"]] == [SECRET_KEY]


def test_other_tenants_attempts_are_audited_in_its_own_tenant_only(a_has_secret, api_b):
    a_events = AuditEvent.objects.filter(tenant=a_has_secret.tenant).count()
    api_b.call("memory_read", key=SECRET_KEY)
    api_b.get(f"/api/v1/memories/{SECRET_KEY}")
    api_b.call("memory_list", prefix="")
    assert AuditEvent.objects.filter(tenant=a_has_secret.tenant).count() == a_events
    assert AuditEvent.objects.filter(tenant=api_b.tenant, target=SECRET_KEY, outcome="not_found").count() == 2
