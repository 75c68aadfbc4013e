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
    """Whether ``text`` shows ``number``: in decimal, or base64 of its decimal (the old cursors)."""
    b64 = base64.urlsafe_b64encode(str(number).encode()).decode().rstrip("=")
    return re.search(rf"(?<![0-9]){number}(?![0-9])", text) is not None or b64 in text


def test_an_etag_shows_no_row_id_that_another_tenants_writes_move(api, api_b):
    api.put("/api/v1/memories/a:first", {"value": "1"})
    first = Memory.objects.get(key="a:first")
    _b_acts(api_b)
    r = api.put("/api/v1/memories/a:second", {"value": "2"})
    second = Memory.objects.get(key="a:second")
    assert second.pk - first.pk == 6  # B's five writes moved the shared sequence
    etag = r["ETag"]
    assert re.fullmatch(r'"[A-Za-z0-9_-]{22}-1"', etag), etag
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
    assert opaque.open_id(token[:-1] + ("A" if token[-1] != "A" else "B"), purpose="p") is None
    assert opaque.open_id("12345", purpose="p") is None
    assert opaque.seal_id(12346, purpose="p")[:8] != token[:8]
    with pytest.raises(InvalidInput):
        validation.decode_id_cursor(validation.encode_cursor("12345"))
