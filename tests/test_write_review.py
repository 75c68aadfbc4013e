"""An outside review of the write path (memory_write, PUT/PATCH with If-Match, batches): each
test here failed on the code before its fix."""

import json

import pytest

from audit.models import AuditEvent
from memories import services
from memories.models import Memory
from tests.factories import SYSTEM
from tests.helpers import audit_count, rest_error, row_counts, tool_error
from zeromem.kernel import validation
from zeromem.kernel.errors import InvalidInput, PayloadTooLarge

BATCH = "/api/v1/tools/batch"


def _empty_objects(total_bytes: int) -> list:
    """``[{},{},…]`` as long as fits in ``total_bytes`` serialized: the most JSON containers a
    value of that size holds (87,380 in 256 KiB: ~57 MB of one PostgreSQL backend to parse)."""
    return [{}] * ((total_bytes - 1) // 3)


# --- JSON containers per value ---------------------------------------------------------------


def test_a_hard_cap_value_of_empty_objects_is_refused_naming_value_and_changes_nothing(api, tenant_a, settings):
    tenant_a.value_max_bytes = 256 * 1024
    tenant_a.save()
    value = _empty_objects(256 * 1024)
    assert len(json.dumps(value, separators=(",", ":"))) <= 256 * 1024
    rows, events = row_counts(), audit_count()
    status, body = api.call("memory_write", key="user:u1:many", value=value)
    assert status == 400
    error = tool_error(body)
    assert (error["code"], error["field"]) == ("too_many_containers", "value")
    assert f"{settings.ZEROMEM_VALUE_MAX_CONTAINERS:,}" in error["message"]
    assert row_counts() == rows
    assert audit_count() == events + 1
    event = AuditEvent.objects.latest("pk")
    assert (event.action, event.outcome) == ("memory.write", "invalid")


def test_rest_put_and_patch_refuse_too_many_containers_naming_value(api, tenant_a, settings):
    settings.ZEROMEM_VALUE_MAX_CONTAINERS = 10
    api.put("/api/v1/memories/user:u1:k", {"value": {"a": [1]}})
    rows = row_counts()
    for method in (api.put, api.patch):
        response = method("/api/v1/memories/user:u1:k", {"value": [[]] * 10})  # 11 containers
        assert response.status_code == 400, response.content
        error = rest_error(response)
        assert (error["code"], error["field"]) == ("too_many_containers", "value")
    assert row_counts() == rows
    assert Memory.objects.get(key="user:u1:k").value == {"a": [1]}


def test_the_container_cap_counts_every_array_and_object_at_any_depth(settings):
    settings.ZEROMEM_VALUE_MAX_CONTAINERS = 5
    validation.value({"a": [{"b": []}], "c": {}}, max_bytes=1000, max_containers=5)  # 5 exactly
    for too_many in ([[], [], [], [], []], {"a": {"b": {"c": {"d": {"e": {}}}}}}, [{"x": [1, 2, [3]]}] * 2):
        with pytest.raises(InvalidInput) as refused:
            validation.value(too_many, max_bytes=1000, max_containers=5)
        assert (refused.value.code, refused.value.field) == ("too_many_containers", "value")
    validation.value("a string is no container", max_bytes=1000, max_containers=0)


def test_no_value_under_the_default_value_cap_can_reach_the_default_container_cap(tenant_a, settings):
    # The most containers 16 KiB holds ([{},{},…]: 5,461) is about half the default cap: a
    # tenant on the default value cap never meets it.
    assert settings.ZEROMEM_VALUE_MAX_CONTAINERS == 10_000
    value = _empty_objects(16 * 1024)
    assert len(value) == 5461 and tenant_a.effective_value_max_bytes == 16 * 1024
    result = services.memory_write(tenant=tenant_a, actor=SYSTEM, key="user:u1:dense", value=value)
    assert result.memory.value == value
    # At the hard cap, 26 bytes a container: 9,999 objects of 25 bytes in a list, 10,000 in all.
    tenant_a.value_max_bytes = 256 * 1024
    tenant_a.save()
    records = [{"n": f"{i:017d}"} for i in range(9999)]
    assert len(json.dumps(records, separators=(",", ":"))) <= 256 * 1024
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key="user:u1:records", value=records)


def test_a_tool_reads_default_is_held_to_the_container_cap_too(api, settings):
    settings.ZEROMEM_VALUE_MAX_CONTAINERS = 3
    status, body = api.call("memory_read", key="user:u1:none", default=[[], [], []])
    assert status == 400
    error = tool_error(body)
    assert (error["code"], error["field"]) == ("too_many_containers", "default")


# --- PUT with If-Match and a subject --------------------------------------------------------
# A PUT with If-Match went to memory_update with its subject dropped unread: 200, the memory
# still under its old subject (a forget of the subject named missed it, its portal page did
# not show it), and a subject every other PUT refuses (blank, out of a limited key's reach)
# was acknowledged.


def _put_if_match(api, key, body):
    current = api.get(f"/api/v1/memories/{key}")
    return api.put(f"/api/v1/memories/{key}", body, headers={"If-Match": current["ETag"]})


def test_a_put_with_if_match_stores_the_subject_it_names(api, tenant_a):
    api.put("/api/v1/memories/note:n1", {"value": "about someone", "subject": "u1"})
    response = _put_if_match(api, "note:n1", {"value": "about someone else", "subject": "u2"})
    assert response.status_code == 200, response.content
    assert response.json()["subject"] == "u2"
    memory = Memory.objects.get(tenant=tenant_a, key="note:n1")
    assert (memory.subject, memory.value) == ("u2", "about someone else")
    assert memory.versions.order_by("-version").first().subject == "u2"
    # Left out, the subject stays as it was (as every other field a PUT leaves out).
    assert _put_if_match(api, "note:n1", {"value": "again"}).json()["subject"] == "u2"


def test_a_put_with_if_match_seals_a_sensitive_value_under_the_subject_it_names(api, tenant_a):
    from memories.models import DataKey
    from tests.test_crypto import raw_memory

    api.put("/api/v1/memories/note:n1", {"value": "plain", "subject": "u1"})
    response = _put_if_match(api, "note:n1", {"value": "phone 555", "subject": "u2", "sensitive": True})
    assert response.status_code == 200, response.content
    memory = Memory.objects.get(tenant=tenant_a, key="note:n1")
    assert DataKey.objects.get(pk=raw_memory(memory)["k"]).subject == "u2"


@pytest.mark.parametrize(("subject", "code"), [("   ", "blank"), ("\u3000", "blank")])
def test_a_put_with_if_match_refuses_a_blank_subject_as_a_put_without(api, tenant_a, subject, code):
    api.put("/api/v1/memories/note:n1", {"value": "v", "subject": "u1"})
    rows, events = row_counts(), audit_count()
    response = _put_if_match(api, "note:n1", {"value": "changed", "subject": subject})
    assert response.status_code == 400, response.content
    error = rest_error(response)
    assert (error["code"], error["field"]) == (code, "subject")
    assert row_counts() == rows and audit_count() == events + 2  # the GET's event and the refusal's
    assert Memory.objects.get(tenant=tenant_a, key="note:n1").value == "v"


def test_a_limited_key_may_not_name_a_subject_out_of_reach_with_if_match_either(api, tenant_a, make_client):
    limited, _key = make_client(tenant_a, allow=["agent:bot1:"])
    limited.put("/api/v1/memories/agent:bot1:k", {"value": "v"})
    assert limited.put("/api/v1/memories/agent:bot1:k", {"value": "x", "subject": "victim"}).status_code == 403
    response = _put_if_match(limited, "agent:bot1:k", {"value": "x", "subject": "victim"})
    assert response.status_code == 403, response.content
    assert rest_error(response)["field"] == "subject"
    assert Memory.objects.get(tenant=tenant_a, key="agent:bot1:k").subject == ""


# --- numbers written with an exponent ----------------------------------------------------------
# jsonb keeps a number as numeric, which PostgreSQL writes out in full: 1e308 (6 bytes as
# sent) comes back as 309 digits. The value cap measured the text as sent, so 14 KB of
# [1e308,1e308,…] passed a 16 KiB cap and every read answered 725 KB (51 times the cap; at the
# hard cap 11.6 MB a GET), and its own version could not be restored (413 on what it stored).


def _exponents(unit: str, total_bytes: int) -> list:
    sent = json.dumps(json.loads(unit))
    return json.loads("[" + ",".join([unit] * ((total_bytes - 2) // (len(sent) + 1))) + "]")


@pytest.mark.parametrize("unit", ["1e308", "1.5e300", "-1e200", "5e-324"])
def test_a_value_whose_numbers_postgresql_writes_out_past_the_cap_is_413_naming_value(api, unit):
    value = _exponents(unit, 16 * 1024)
    assert len(json.dumps(value, separators=(",", ":"))) <= 16 * 1024
    rows = row_counts()
    status, body = api.call("memory_write", key="user:u1:big", value=value)
    assert status == 413, body
    error = tool_error(body)
    assert (error["code"], error["field"]) == ("too_large", "value")
    assert "written out" in error["message"]
    response = api.put("/api/v1/memories/user:u1:big", {"value": value})
    assert response.status_code == 413
    assert rest_error(response)["field"] == "value"
    assert row_counts() == rows


@pytest.mark.postgres  # PostgreSQL's numeric writes 1e300 out in full; SQLite keeps the text
def test_what_a_value_reads_back_as_is_within_the_cap_it_was_written_under(api, tenant_a):
    # The most exponent numbers the cap allows: stored, read back, restored from its version.
    value = [1e300] * ((16 * 1024 - 2) // 302)
    status, body = api.call("memory_write", key="user:u1:ok", value=value)
    assert status == 200, body
    response = api.get("/api/v1/memories/user:u1:ok")
    assert len(json.dumps(response.json()["value"], separators=(",", ":"))) <= 16 * 1024
    first = Memory.objects.get(tenant=tenant_a, key="user:u1:ok")
    api.call("memory_write", key="user:u1:ok", value="replaced")
    services.memory_restore_version(tenant=tenant_a, actor=SYSTEM, memory_id=first.pk, version=first.version)
    assert Memory.objects.get(tenant=tenant_a, key="user:u1:ok").value == [10**300] * len(value)


def test_everyday_numbers_and_strings_that_look_like_exponents_cost_what_they_did():
    validation.value([1.5e-7, 6.02e23, 0.1, 10**30, "1e308", {"x1e9": 2.5}], max_bytes=200)
    with pytest.raises(PayloadTooLarge) as refused:
        validation.value([1e100, 1e100], max_bytes=200)  # 2 x 101 digits
    assert refused.value.field == "value"


# --- a subject that displays as another ------------------------------------------------------
# Keys and tags refuse bidi controls and zero-width characters (they make one display as
# another); a subject took them: "u1" + U+200B shows as "u1" in the admin and the portal, but a
# forget of "u1" — the request staff file for what they see — never matches it.

SPOOFING_SUBJECTS = ["u1\u200b", "u1\u202e", "\u2066u1\u2069", "u1\u0085", "u1\u2028", "u1\ufeff", "u\u200c1"]


@pytest.mark.parametrize("subject", SPOOFING_SUBJECTS)
def test_a_subject_with_invisible_or_direction_characters_is_refused_naming_subject(api, subject):
    rows, events = row_counts(), audit_count()
    status, body = api.call("memory_write", key="note:n1", value="v", subject=subject)
    assert status == 400, body
    error = tool_error(body)
    assert (error["code"], error["field"]) == ("invalid_characters", "subject")
    response = api.put("/api/v1/memories/note:n1", {"value": "v", "subject": subject})
    assert response.status_code == 400, response.content
    assert rest_error(response)["field"] == "subject"
    assert row_counts() == rows and audit_count() == events + 2


@pytest.mark.parametrize("subject", ["u1", "张三", "می\u200cخواهم", "José García", "user@example.com", ""])
def test_everyday_subjects_are_still_taken(api, subject):
    status, body = api.call("memory_write", key="note:n1", value="v", subject=subject)
    assert status == 200, body
    assert Memory.objects.get(key="note:n1").subject == subject
