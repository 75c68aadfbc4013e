"""No tenant is shown a number from a sequence every tenant shares (README "Opaque ids"):
row ids are global, so a tenant that saw them could count the others' activity between two
of its own requests. Each test lets tenant B act between two of tenant A's requests and
checks that what A is shown carries no row id."""

import base64
import csv
import io
import re
import uuid

import pytest

from audit.models import AuditEvent
from memories.models import Memory
from zeromem.kernel import opaque, validation
from zeromem.kernel.errors import InvalidInput

EVENTS = "/api/v1/audit-events"


def _b_acts(api_b, n=5):
    for i in range(n):
        api_b.call("memory_write", key=f"b:k{i}", value="x")


def _carries(text: str, number: int) -> bool:
    """Whether ``text`` shows ``number``: as one of its words (split at anything but letters
    and digits), or base64 of its decimal (the old cursors)."""
    b64 = base64.urlsafe_b64encode(str(number).encode()).decode().rstrip("=")
    return str(number) in re.split(r"[^0-9A-Za-z]+", text) or b64 in text


def test_an_etag_shows_no_row_id_that_another_tenants_writes_move(api, api_b):
    api.put("/api/v1/memories/a:first", {"value": "1"})
    first = Memory.objects.get(key="a:first")
    _b_acts(api_b)
    r = api.put("/api/v1/memories/a:second", {"value": "2"})
    second = Memory.objects.get(key="a:second")
    assert second.pk - first.pk == 6  # B's five writes moved the shared sequence
    etag = r["ETag"]
    assert re.fullmatch(r'"[0-9a-f]{32}-1"', etag), etag
    assert not _carries(etag.rsplit("-", 1)[0], second.pk)
    # The token still does its job: the current ETag matches, the first memory's does not.
    assert api.put("/api/v1/memories/a:second", {"value": "3"}, headers={"If-Match": etag}).status_code == 200
    other = api.get("/api/v1/memories/a:first")["ETag"].replace("-1", "-2")
    assert api.put("/api/v1/memories/a:second", {"value": "4"}, headers={"If-Match": other}).status_code == 412


def test_an_old_numeric_etag_no_longer_matches(api):
    api.put("/api/v1/memories/a:k", {"value": "1"})
    memory = Memory.objects.get(key="a:k")
    r = api.put("/api/v1/memories/a:k", {"value": "2"}, headers={"If-Match": f'"{memory.pk}-1"'})
    assert r.status_code == 412
    assert Memory.objects.get(key="a:k").value == "1"


def test_audit_event_ids_and_cursors_show_no_row_id(api, api_b, tenant_a, make_client):
    auditor, _ = make_client(tenant_a, scopes=["audit:read"])
    api.call("memory_write", key="a:one", value="1")
    _b_acts(api_b)
    api.call("memory_write", key="a:two", value="2")
    body = auditor.get(EVENTS, {"limit": 1, "action": "memory.write"}).json()
    (shown,) = body["results"]
    row = AuditEvent.objects.get(uid=shown["id"])  # the id shown is the event's uid
    assert row.tenant_id == tenant_a.pk and row.target == "a:two"
    assert not _carries(str(shown["id"]), row.pk)
    assert body["next_cursor"] and not _carries(body["next_cursor"], row.pk)
    older = auditor.get(EVENTS, {"limit": 1, "action": "memory.write", "cursor": body["next_cursor"]}).json()
    assert [AuditEvent.objects.get(uid=e["id"]).target for e in older["results"]] == ["a:one"]


def test_an_old_numeric_audit_cursor_is_refused(api, tenant_a, make_client):
    auditor, _ = make_client(tenant_a, scopes=["audit:read"])
    api.call("memory_write", key="a:one", value="1")
    last = AuditEvent.objects.filter(tenant=tenant_a).order_by("-id").first()
    r = auditor.get(EVENTS, {"cursor": validation.encode_cursor(str(last.pk))})
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "cursor"


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_audit_export_ids_are_the_events_uids(api, api_b, tenant_a, make_client, fmt):
    auditor, _ = make_client(tenant_a, scopes=["audit:read"])
    api.call("memory_write", key="a:one", value="1")
    _b_acts(api_b)
    r = auditor.get("/api/v1/audit-events/export", {"format": fmt, "action": "memory.write"})
    text = b"".join(r.streaming_content).decode()
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(text)))
    else:
        import json

        rows = [json.loads(line) for line in text.splitlines()]
    (row,) = rows
    event = AuditEvent.objects.get(uid=uuid.UUID(row["id"]))
    assert event.tenant_id == tenant_a.pk and event.target == "a:one"


def test_opaque_tokens_open_only_for_their_purpose_and_refuse_forgeries():
    token = opaque.seal_id(12345, purpose="p")
    assert len(token) == opaque.TOKEN_LEN and "12345" not in token
    assert opaque.open_id(token, purpose="p") == 12345
    assert opaque.open_id(token, purpose="q") is None
    assert opaque.open_id(token[:-1] + ("a" if token[-1] != "a" else "b"), purpose="p") is None
    assert opaque.open_id(token.upper(), purpose="p") is None
    assert opaque.open_id("12345", purpose="p") is None
    assert opaque.seal_id(12346, purpose="p")[:8] != token[:8]
    with pytest.raises(InvalidInput):
        validation.decode_id_cursor(validation.encode_cursor("12345"))


# --- jobs and forget requests ------------------------------------------------------------------


def _forget(client, key):
    r = client.post("/api/v1/forget-requests", {"keys": [key]})
    assert r.status_code == 202, r.content
    return r


def test_a_summary_job_is_shown_by_its_uid_everywhere_a_tenant_sees_it(api, api_b, tenant_a, make_client):
    from memories.models import Job

    api.call("memory_write", key="session:s1:a", value="one")
    _status, first = api.call("memory_summarize", prefix="session:s1:")
    api_b.call("memory_write", key="session:b:a", value="b")
    for _ in range(3):
        api_b.call("memory_summarize", prefix="session:b:")
    r = api.post("/api/v1/summaries", {"prefix": "session:s1:"})
    assert r.status_code == 202, r.content
    job = Job.objects.get(uid=r.json()["job_id"])  # the id shown is the job's uid
    assert job.tenant_id == tenant_a.pk and job.pk - Job.objects.get(uid=first["job_id"]).pk == 4
    assert r["Location"] == f"/api/v1/jobs/{job.uid}" and not _carries(r["Location"], job.pk)
    shown = api.get(r["Location"])
    assert shown.status_code == 200 and shown.json()["id"] == str(job.uid)
    # The job's id in the tenant's own audit log is the uid too.
    auditor, _ = make_client(tenant_a, scopes=["audit:read"])
    started = auditor.get(EVENTS, {"action": "memory.summarize", "limit": 1}).json()["results"][0]
    assert started["detail"]["job_id"] == str(job.uid)
    # The old numeric URL answers 404, for the owner too; so does another tenant's uid.
    assert api.get(f"/api/v1/jobs/{job.pk}").status_code == 404
    assert api_b.get(f"/api/v1/jobs/{job.uid}").status_code == 404


def test_a_forget_request_is_shown_by_its_uid_and_its_old_numeric_url_is_404(api, api_b, tenant_a):
    from memories.models import ForgetRequest

    api.call("memory_write", key="a:one", value="1")
    api.call("memory_write", key="a:two", value="2")
    first = _forget(api, "a:one").json()
    for i in range(3):
        api_b.call("memory_write", key=f"b:{i}", value="x")
        _forget(api_b, f"b:{i}")
    r = _forget(api, "a:two")
    request = ForgetRequest.objects.get(uid=r.json()["id"])
    assert request.tenant_id == tenant_a.pk
    assert request.pk - ForgetRequest.objects.get(uid=first["id"]).pk == 4  # B's three moved the sequence
    assert r["Location"] == f"/api/v1/forget-requests/{request.uid}"
    assert api.get(r["Location"]).json()["id"] == str(request.uid)
    assert api.get(f"/api/v1/forget-requests/{request.pk}").status_code == 404
    assert api_b.get(r["Location"]).status_code == 404
    listed = api.get("/api/v1/forget-requests", {"limit": 1}).json()
    assert [e["id"] for e in listed["results"]] == [str(request.uid)]
    assert listed["next_cursor"] and not _carries(listed["next_cursor"], request.pk)
    older = api.get("/api/v1/forget-requests", {"limit": 1, "cursor": listed["next_cursor"]}).json()
    assert [e["id"] for e in older["results"]] == [first["id"]]


def test_the_portal_shows_an_end_user_no_row_id(api, api_b, tenant_a, django_capture_on_commit_callbacks):
    from django.test import Client

    from memories.models import ForgetRequest
    from memories.portal.models import PortalLink
    from tests.test_portal import csrf, issue, open_portal

    api.call("memory_write", key="user:u1:lang", value="fr")
    client = open_portal(issue(api)["url"], Client(enforce_csrf_checks=True))
    link = PortalLink.objects.filter(tenant=tenant_a).latest("pk")
    assert not _carries(client.cookies["zm_portal"].value.split(":")[0], link.pk)
    with django_capture_on_commit_callbacks(execute=True):
        r = client.post("/portal/forget", {"csrfmiddlewaretoken": csrf(client), "what": "one", "key": "user:u1:lang"})
    request = ForgetRequest.objects.filter(tenant=tenant_a).latest("pk")
    assert r.status_code == 302 and r["Location"] == f"/portal/requests/{request.uid}"
    page = client.get(r["Location"]).content.decode()
    # (a uid may begin with the row id's digits: the row id alone is what must not be there)
    assert f"Request reference {request.uid}" in page and not re.search(rf"Request reference {request.pk}\b", page)
    home = client.get("/portal/").content.decode()
    assert f"/portal/requests/{request.uid}" in home and not re.search(rf"/portal/requests/{request.pk}\b", home)
    assert client.get(f"/portal/requests/{request.pk}").status_code == 404


@pytest.mark.django_db(transaction=True)
def test_the_migration_gives_every_existing_job_and_forget_request_its_own_uid(monkeypatch):
    """Migration 0040 on rows written before it (in batches smaller than the rows here): each
    gets a uid of its own, the unique indexes are built, and the app finds them by it."""
    import importlib

    from django.core.management import call_command
    from django.db import connection

    from memories.models import ForgetRequest, Job
    from tests.factories import SYSTEM, make_tenant

    migration = importlib.import_module("memories.migrations.0042_job_forgetrequest_uid")
    monkeypatch.setattr(migration, "BATCH", 3)
    tenant = make_tenant("before-uids")
    from memories import services

    jobs = [services.summarize_start(tenant=tenant, actor=SYSTEM, prefix=f"session:s{i}:").pk for i in range(7)]
    requests = [services.forget_request_create(tenant=tenant, actor=SYSTEM, subject=f"u{i}").pk for i in range(4)]
    try:
        call_command("migrate", "memories", "0041", verbosity=0)
        with connection.cursor() as cursor:
            columns = {c.name for c in connection.introspection.get_table_description(cursor, "memories_job")}
        assert "uid" not in columns
        call_command("migrate", "memories", "0042", verbosity=0)
    finally:
        call_command("migrate", verbosity=0)
    job_uids = list(Job.objects.filter(pk__in=jobs).values_list("uid", flat=True))
    request_uids = list(ForgetRequest.objects.filter(pk__in=requests).values_list("uid", flat=True))
    assert None not in job_uids and len(set(job_uids)) == 7
    assert None not in request_uids and len(set(request_uids)) == 4
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, "memories_job")
    assert constraints["job_uid"]["unique"] and constraints["job_uid"]["columns"] == ["uid"]
    # A row the code before the migration would write (no uid given) gets one from the column
    # default on PostgreSQL, meanwhile.
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO memories_job (tenant_id, kind, status, params, result, error, attempts, requested_by,"
                " created_at) VALUES (%s, 'summarize', 'succeeded', '{}', '{}', '', 0, '', now()) RETURNING id, uid",
                [tenant.pk],
            )
            _pk, uid = cursor.fetchone()
        assert uid is not None


def test_an_api_keys_actor_id_is_shown_as_a_token_and_filters_as_one(api, api_b, tenant_a, tenant_b, make_client):
    from memories.models import ApiKey

    auditor, _ = make_client(tenant_a, scopes=["audit:read"])
    for _ in range(3):  # tenant B makes keys: the shared sequence of key ids moves
        make_client(tenant_b)
    writer, key = make_client(tenant_a)
    assert key.pk - ApiKey.objects.filter(tenant=tenant_a).exclude(pk=key.pk).order_by("-pk")[0].pk == 4
    writer.put("/api/v1/memories/a:k", {"value": "1"})
    (version,) = api.get("/api/v1/memories/a:k/history").json()["results"]
    assert version["actor_kind"] == "api_key" and not _carries(version["actor_id"], key.pk)
    shown = auditor.get(EVENTS, {"action": "memory.write", "limit": 1}).json()["results"][0]
    assert shown["actor_id"] == version["actor_id"] and shown["actor_label"] == key.display_prefix
    # The review's actor filter takes the id it showed (and the key's zm_ prefix, as before).
    by_id = auditor.get(EVENTS, {"actor": shown["actor_id"], "action": "memory.write"}).json()["results"]
    by_label = auditor.get(EVENTS, {"actor": key.display_prefix, "action": "memory.write"}).json()["results"]
    assert [e["id"] for e in by_id] == [e["id"] for e in by_label] == [shown["id"]]
    text = b"".join(auditor.get("/api/v1/audit-events/export", {"action": "memory.write"}).streaming_content)
    row = next(csv.DictReader(io.StringIO(text.decode())))
    assert row["actor_id"] == shown["actor_id"]


def test_a_staff_users_actor_id_is_shown_as_a_token(api, tenant_a, make_client):
    from django.contrib.auth import get_user_model

    from audit.services import audit_record
    from zeromem.kernel.actors import Actor

    auditor, _ = make_client(tenant_a, scopes=["audit:read"])
    user = get_user_model().objects.create_user("staff-ids", password="x")
    staff = Actor(kind="staff", id=str(user.pk), label=user.username, scopes=frozenset(), surface="admin")
    audit_record(tenant=tenant_a, actor=staff, action="memory.read", outcome="ok", target="a:k")
    (shown,) = auditor.get(EVENTS, {"actor_kind": "staff"}).json()["results"]
    assert shown["actor_label"] == "staff-ids" and not _carries(shown["actor_id"], user.pk)
    assert [e["id"] for e in auditor.get(EVENTS, {"actor": shown["actor_id"]}).json()["results"]] == [shown["id"]]
