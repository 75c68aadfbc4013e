"""The tag filter matches whole tags, non-ASCII ones included, on PostgreSQL (JSON
containment) and SQLite (the JSON text as Django stores it: ASCII-escaped)."""

from tests.factories import write


def test_the_tag_filter_matches_non_ascii_tags_exactly(api, tenant_a):
    write(tenant_a, "user:u1:a", "x", tags=["中文", "café"])
    write(tenant_a, "user:u1:b", "x", tags=["中", "cafe"])
    write(tenant_a, "user:u1:c", "x", tags=["文"])

    def keys(tag):
        r = api.get("/api/v1/memories", {"tag": tag})
        assert r.status_code == 200, r.content
        return [m["key"] for m in r.json()["results"]]

    assert keys("中文") == ["user:u1:a"]
    assert keys("café") == ["user:u1:a"]
    assert keys("中") == ["user:u1:b"]
    assert keys("cafe") == ["user:u1:b"]
    assert keys("文") == ["user:u1:c"]
