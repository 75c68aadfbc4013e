"""Compliance review over REST: filters, pagination, exports, checkpoints — scoped to the
key's tenant (and allowlist), never a memory value, and every read of the log audited."""

import csv
import io
import json
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.core.signals import request_finished
from django.db import close_old_connections
from django.utils import timezone

from audit import selectors
from audit.exports import audit_export_response
from audit.models import AuditEvent, AuditSeal
from audit.seals import unsealed_q
from audit.selectors import AuditFilters
from audit.services import audit_record, audit_seal
from tests.factories import SYSTEM
from tests.helpers import rest_error
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor

CANARY = "CANARY-audit-api-9d2e"
EVENTS = "/api/v1/audit-events"
EXPORT = "/api/v1/audit-events/export"


@pytest.fixture
def log(api, api_b, tenant_a, make_client):
    """Tenant A: writes and reads of two users' memories, a denial; tenant B: its own."""
    for user in ("u1", "u2"):
        for name in ("lang", "tz", "plan"):
            api.call("memory_write", key=f"user:{user}:{name}", value=f"{CANARY} {name}")
    api.call("memory_read", key="user:u1:lang")
    api.call("memory_read", key="user:u1:missing")
    ro, _ = make_client(tenant_a, scopes=["memory:read"])
    ro.call("memory_write", key="user:u1:lang", value=CANARY)  # denied
    api_b.call("memory_write", key="user:u1:lang", value=f"{CANARY} b")
    auditor, auditor_key = make_client(tenant_a, scopes=["audit:read"])
    return auditor


def row_id(uid) -> int:
    """The row id of the event shown as ``uid`` (the list and exports show the uid, never the
    row id: tests/test_opaque_ids.py), for oracles that order by row id."""
    return AuditEvent.objects.values_list("id", flat=True).get(uid=uid)


def with_row_ids(shown: list[dict]) -> list[dict]:
    for event in shown:
        event["id"] = row_id(event["id"])
    return shown


def jsonl(text: str) -> list[dict]:
    return with_row_ids([json.loads(line) for line in text.splitlines()])


def events(client, **params):
    r = client.get(EVENTS, params)
    assert r.status_code == 200, r.content
    body = r.json()
    with_row_ids(body["results"])
    return body


def stream(response) -> str:
    return b"".join(response.streaming_content).decode()


def test_lists_only_the_tenants_events_newest_first_without_values(log, tenant_b):
    body = events(log, limit=200)
    ids = [e["id"] for e in body["results"]]
    assert ids == sorted(ids, reverse=True)
    assert not AuditEvent.objects.filter(pk__in=ids, tenant=tenant_b).exists()
    assert CANARY not in json.dumps(body)


@pytest.mark.parametrize(
    "params,expected",
    [
        ({"key_prefix": "user:u1:"}, lambda e: e["target"].startswith("user:u1:")),
        ({"subject": "u2"}, lambda e: e["subject"] == "u2"),
        ({"action": "memory.read"}, lambda e: e["action"] == "memory.read"),
        ({"action": "memory."}, lambda e: e["action"].startswith("memory.")),
        ({"outcome": "denied"}, lambda e: e["outcome"] == "denied"),
        ({"actor_kind": "system"}, lambda e: e["actor_kind"] == "system"),
    ],
)
def test_filters_return_exactly_the_matching_events(log, tenant_a, params, expected):
    got = events(log, limit=200, **params)["results"]
    # The oracle reads the table itself (tenant A's rows, in Python), not the server's own list.
    rows = AuditEvent.objects.filter(tenant=tenant_a).exclude(action="audit.list").order_by("-id")
    everything = list(rows.values("id", "target", "subject", "action", "outcome", "actor_kind"))
    want = [e["id"] for e in everything if expected(e)]
    assert want, "the filter must match something for the test to mean anything"
    assert [e["id"] for e in got if e["action"] != "audit.list"] == want


def test_actor_filter_matches_a_keys_public_prefix(log, api):
    label = AuditEvent.objects.filter(action="memory.write", tenant=api.tenant).first().actor_label
    got = events(log, actor=label, limit=200)["results"]
    assert got and {e["actor_label"] for e in got} == {label}


def test_a_bare_numeric_actor_is_ambiguous_and_a_qualified_one_matches_one_kind(log, tenant_a, api):
    """API keys and staff users are both numbered from 1: ``actor=7`` matched API key 7's
    events and staff user 7's together, and a reviewer took one's for the other's. A bare
    number is now 400 naming ``actor`` unless ``actor_kind`` says whose; ``api_key:7`` and
    ``staff:7`` name one."""
    key_id = AuditEvent.objects.filter(tenant=tenant_a, actor_kind="api_key", action="memory.write").first().actor_id
    staff = Actor(kind="staff", id=key_id, label="sam-support", surface="admin")  # staff user with the same id
    audit_record(tenant=tenant_a, actor=staff, action="memory.view", outcome="ok", target="user:u1:lang")
    r = log.get(EVENTS, {"actor": key_id})
    assert r.status_code == 400, r.content
    assert rest_error(r)["field"] == "actor" and f"api_key:{key_id}" in rest_error(r)["message"]
    r = log.get(EXPORT, {"actor": key_id})
    assert r.status_code == 400 and rest_error(r)["field"] == "actor"

    from zeromem.kernel.opaque import shown_actor_id

    def kinds(**params):
        got = [e for e in events(log, limit=200, **params)["results"] if e["action"] != "audit.list"]
        # Both kinds' id shown as its kind's token (tests/test_opaque_ids.py), of the same stored id.
        assert got and all(e["actor_id"] == shown_actor_id(e["actor_kind"], key_id) for e in got)
        return {e["actor_kind"] for e in got}

    assert kinds(actor=f"api_key:{key_id}") == {"api_key"}
    assert kinds(actor=f"staff:{key_id}") == {"staff"}
    assert kinds(actor=f"staff:{shown_actor_id('staff', key_id)}") == {"staff"}  # the token the review shows
    assert kinds(actor=shown_actor_id("api_key", key_id)) == {"api_key"}  # a token says its kind itself
    assert kinds(actor=key_id, actor_kind="staff") == {"staff"}
    assert kinds(actor="staff:sam-support") == {"staff"}  # a username, qualified
    assert kinds(actor="sam-support") == {"staff"}  # a label needs no kind
    r = log.get(EVENTS, {"actor": f"api_key:{key_id}", "actor_kind": "staff"})
    assert r.status_code == 400 and rest_error(r)["field"] == "actor_kind"
    r = log.get(EVENTS, {"actor": "api_key:"})
    assert r.status_code == 400 and rest_error(r)["field"] == "actor"


def test_time_range_filter(log, tenant_a):
    middle = AuditEvent.objects.filter(tenant=tenant_a).order_by("id")[4].occurred_at
    before = events(log, until=middle.isoformat(), limit=200)["results"]
    after = events(log, since=middle.isoformat(), limit=200)["results"]
    assert before and after
    assert all(e["occurred_at"] < middle.isoformat().replace("+00:00", "Z") for e in before)
    assert not {e["id"] for e in before} & {e["id"] for e in after}


def test_cursor_pagination_walks_every_event_once(log, tenant_a):
    seen, cursor = [], None
    while True:
        page = events(log, limit=3, key_prefix="user:", **({"cursor": cursor} if cursor else {}))
        seen += [e["id"] for e in page["results"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    expected = AuditEvent.objects.filter(tenant=tenant_a, target__startswith="user:").order_by("-id")
    # (each page's own audit.list event is newer than the first page: not part of the walk)
    assert seen == list(expected.exclude(action="audit.list").values_list("id", flat=True))


def test_a_key_limited_to_a_prefix_reads_only_events_under_it(log, tenant_a, make_client):
    limited, _ = make_client(tenant_a, scopes=["audit:read"], allow=["user:u2:"])
    got = events(limited, limit=200)["results"]
    assert got and all(e["target"].startswith("user:u2:") for e in got)


@pytest.mark.parametrize(
    "params,field",
    [
        ({"since": "yesterday"}, "since"),
        ({"until": "2026-13-01T00:00:00Z"}, "until"),
        ({"since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, "until"),
        ({"outcome": "maybe"}, "outcome"),
        ({"actor_kind": "robot"}, "actor_kind"),
        ({"limit": "0"}, "limit"),
        ({"cursor": "!!"}, "cursor"),
        ({"key_prefix": "x" * 513}, "key_prefix"),
    ],
)
def test_bad_filters_are_400_naming_the_field(log, params, field):
    r = log.get(EVENTS, params)
    assert r.status_code == 400
    assert rest_error(r)["field"] == field


@pytest.mark.parametrize(
    "params",
    [
        {"until": "9999-12-31T23:59:59Z"},
        {"since": "0001-01-01T00:00:00Z"},
        {"since": "0001-01-01T00:00:00Z", "until": "9999-12-31T23:59:59.999999Z"},
        {"since": "0001-01-01T00:00:00Z", "action": "memory.read"},
    ],
)
def test_dates_at_the_calendars_ends_read_the_whole_log_not_a_500(log, tenant_a, params):
    # The window's id bounds look a day past until and a day before since (ID_CLOCK_MARGIN):
    # at 9999-12-31 or 0001-01-01 that sum overflowed (OverflowError: a 500 for the list, a cut
    # export after its audit.export event). No event lies beyond the calendar: no bound there.
    want = set(
        AuditEvent.objects.filter(tenant=tenant_a)
        .exclude(action__startswith="audit.")
        .filter(**({"action": params["action"]} if "action" in params else {}))
        .values_list("id", flat=True)
    )
    assert want
    listed = {e["id"] for e in events(log, limit=200, **params)["results"]}
    assert want <= listed
    exported = log.get(EXPORT, {**params, "format": "jsonl"})
    assert exported.status_code == 200
    assert want <= {e["id"] for e in jsonl(stream(exported))}


def test_a_key_prefix_holding_the_exact_key_marker_is_400_not_an_exact_key_filter(log, tenant_a, make_client):
    # A filter ending in "$" names one key exactly inside the services (keyprefix.exact);
    # typed by a reviewer, "user:u1:lang$" answered the events of user:u1:lang (and no
    # target starts with it): "$" is in no key nor prefix, and refused here as everywhere.
    limited, _ = make_client(tenant_a, scopes=["audit:read"], allow=["user:u1"])
    for client in (log, limited):
        for prefix in ("user:u1:lang$", "user:u1$", "user:$", "user:u1:$x"):
            r = client.get(EVENTS, {"key_prefix": prefix})
            assert r.status_code == 400, (prefix, r.content)
            assert rest_error(r)["field"] == "key_prefix"
            assert client.get(EXPORT, {"key_prefix": prefix}).status_code == 400


def test_reading_the_log_needs_the_audit_scope(api, make_client, tenant_a):
    reader, _ = make_client(tenant_a, scopes=["memory:read"])
    for path in (EVENTS, EXPORT):
        r = reader.get(path)
        assert r.status_code == 403 and rest_error(r)["code"] == "missing_scope"


def test_every_read_of_the_log_is_itself_an_event(log, tenant_a):
    events(log, key_prefix="user:u1:", subject="u1", action="memory.")
    listed = AuditEvent.objects.filter(tenant=tenant_a, action="audit.list").latest("pk")
    assert (listed.target, listed.subject, listed.detail) == ("user:u1:", "u1", {"action": "memory."})
    r = log.get(EXPORT, {"format": "jsonl", "outcome": "denied"})
    stream(r)
    exported = AuditEvent.objects.filter(tenant=tenant_a, action="audit.export").latest("pk")
    assert exported.detail == {"format": "jsonl", "outcome": "denied"} and exported.outcome == "ok"


# --- exports --------------------------------------------------------------------------------


def test_csv_export_streams_the_filtered_events_with_a_header(log, tenant_a):
    r = log.get(EXPORT, {"key_prefix": "user:u1:"})
    assert r.status_code == 200 and r.streaming
    assert r["Content-Type"].startswith("text/csv")
    assert "attachment" in r["Content-Disposition"] and r["Cache-Control"] == "no-store"
    rows = list(csv.DictReader(io.StringIO(stream(r))))
    expected = AuditEvent.objects.filter(tenant=tenant_a, target__startswith="user:u1:").order_by("-id")
    assert [row_id(row["id"]) for row in rows] == list(expected.values_list("id", flat=True))
    assert rows[0]["digest"] and CANARY not in json.dumps(rows)


def test_jsonl_export_is_one_object_per_line(log, tenant_a):
    r = log.get(EXPORT, {"format": "jsonl", "subject": "u2"})
    assert r["Content-Type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in stream(r).splitlines()]
    assert lines and all(e["subject"] == "u2" for e in lines)
    assert len(lines) == AuditEvent.objects.filter(tenant=tenant_a, subject="u2").count()


def test_an_export_holds_the_lists_events_field_for_field(log, tenant_a):
    # A reviewer checks an export against the API (or one export against another): the same
    # event read "2026-12-05T17:02:46.779938Z" in the list and "…+00:00" in both exports.
    listed = events(log, subject="u1", limit=200)["results"]
    exported = jsonl(stream(log.get(EXPORT, {"format": "jsonl", "subject": "u1"})))
    by_id = {e["id"]: e for e in exported}
    shown = [e for e in listed if e["id"] in by_id]
    assert len(shown) >= 4
    assert all({k: v for k, v in by_id[e["id"]].items() if k != "digest"} == e for e in shown)
    rows = list(csv.DictReader(io.StringIO(stream(log.get(EXPORT, {"subject": "u1"})))))
    in_csv = {row_id(r["id"]): r["occurred_at"] for r in rows}
    assert {e["id"]: e["occurred_at"] for e in shown}.items() <= in_csv.items()


def test_csv_export_defuses_cells_a_spreadsheet_would_run(log, api, tenant_a):
    api.call("memory_read", key="=cmd:x:y")  # a valid key that starts like a formula
    rows = list(csv.DictReader(io.StringIO(stream(log.get(EXPORT, {"action": "memory.read"})))))
    assert "'=cmd:x:y" in [row["target"] for row in rows]
    lines = stream(log.get(EXPORT, {"format": "jsonl", "action": "memory.read"}))
    assert '"target":"=cmd:x:y"' in lines  # JSON Lines keep the text as it is


def test_csv_export_defuses_formulas_for_a_spreadsheet_that_splits_on_semicolons(log, api, tenant_a):
    # Locales with a decimal comma split CSV on ";": a cell after a ";" inside a field must
    # not start like a formula either (the field is unquoted, or its quoting lapses there).
    subject = 'u3;=HYPERLINK("http://x");+1;-2;@SUM(A1);"=4'
    api.call("memory_write", key="user:u3:x", value="v", subject=subject)
    text = stream(log.get(EXPORT, {"action": "memory.write"}))
    cells = [cell for row in csv.reader(io.StringIO(text), delimiter=";") for cell in row]
    assert len(cells) > 2  # split at the subject's semicolons
    assert [cell for cell in cells if cell.startswith(("=", "+", "-", "@", "\t", "\r"))] == []
    subjects = [row["subject"] for row in csv.DictReader(io.StringIO(text))]
    assert "u3;'=HYPERLINK(\"http://x\");'+1;'-2;'@SUM(A1);'\"=4" in subjects  # still readable


FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _formula_cells(text: str, delimiter: str) -> list[str]:
    """The cells of ``text`` read with ``delimiter`` that a spreadsheet would run: starting
    with a formula character, also past leading spaces (spreadsheets may trim them)."""
    cells = [cell for row in csv.reader(io.StringIO(text, newline=""), delimiter=delimiter) for cell in row]
    return [cell for cell in cells if cell.lstrip(" ").startswith(FORMULA_START)]


def test_csv_export_defuses_a_formula_after_a_semicolon_and_spaces(log, api, tenant_a):
    # "; =1+1": the cell a ";" reader starts there is " =1+1", run once its spaces are trimmed.
    subject = 'u4; =1+1;  +2;   -3; @SUM(A1); "=4'
    assert api.call("memory_write", key="user:u4:x", value="v", subject=subject)[0] == 200
    text = stream(log.get(EXPORT, {"action": "memory.write"}))
    assert len([c for row in csv.reader(io.StringIO(text), delimiter=";") for c in row]) > 5
    assert _formula_cells(text, ";") == []
    assert _formula_cells(text, ",") == []
    subjects = [row["subject"] for row in csv.DictReader(io.StringIO(text))]
    assert "u4;' =1+1;'  +2;'   -3;' @SUM(A1);' \"=4" in subjects  # the text is all still there


def test_csv_export_defuses_leading_spaces_and_line_breaks_before_a_formula(log, api, tenant_a):
    # A refused call is recorded with its input as sent: a key that starts with spaces before
    # "=", and keys with a CR or LF followed by a formula, inside one field.
    sent = ["  =1+1", " \t@SUM(A1)", "a\n=HYPERLINK(1)", "b\r\n+2", "c\r-3", "d\n  =4", "e\n\r=5", 'f\n"=6']
    for key in sent:
        status, _body = api.call("memory_read", key=key)
        assert status == 400, key
    text = stream(log.get(EXPORT, {"action": "memory.read", "outcome": "invalid"}))
    for delimiter in (",", ";"):
        assert _formula_cells(text, delimiter) == [], delimiter
    # A reader that splits lines on every line break, quotes or not, starts no cell with one either.
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    assert [line for line in lines if line.lstrip(' "').startswith(FORMULA_START)] == []
    targets = {row["target"] for row in csv.DictReader(io.StringIO(text, newline=""))}
    expected = ["'  =1+1", "' \t@SUM(A1)", "a\n'=HYPERLINK(1)", "b\r\n'+2", "c\r'-3", "d\n'  =4", "e\n'\r'=5"]
    expected.append("f\n'\"=6")
    assert set(expected) <= targets, targets


def test_export_under_asgi_streams_an_async_iterator(log, tenant_a):
    actor = Actor(kind="api_key", id="1", label="zm_t", scopes=frozenset(["audit:read"]), surface="rest")
    response = audit_export_response(
        tenant=tenant_a, actor=actor, filters=AuditFilters(key_prefix="user:"), fmt="jsonl", asynchronous=True
    )
    assert response.is_async

    async def collect():
        return [chunk async for chunk in response.streaming_content]

    chunks = async_to_sync(collect)()
    lines = b"".join(chunks).decode().splitlines()
    assert len(lines) == AuditEvent.objects.filter(tenant=tenant_a, target__startswith="user:").count()


def _export_end(tenant):
    return AuditEvent.objects.filter(tenant=tenant, action="audit.export_end").order_by("-id").first()


def test_an_export_records_how_many_rows_it_delivered_once_it_ends(log, tenant_a, monkeypatch):
    """``audit.export`` is written before the first row (an export abandoned halfway was still
    an export), so it could not say how many rows went out: a reviewer of the reviewers saw
    that an export happened, not whether it was 3 rows or the whole log. Its end now adds an
    ``audit.export_end`` event: the rows delivered, whether it ran to its end, and which
    export it ends; written after the last page, on a connection taken back at once."""
    from audit import exports

    monkeypatch.setattr(exports, "CHUNK_ROWS", 2)
    response = log.get(EXPORT, {"format": "jsonl", "key_prefix": "user:"})
    lines = stream(response).splitlines()
    assert len(lines) > 4  # several chunks
    end = _export_end(tenant_a)
    start = AuditEvent.objects.filter(tenant=tenant_a, action="audit.export").order_by("-id").first()
    assert end is not None and end.count == len(lines)
    assert end.detail == {"export": str(start.uid), "complete": True}
    assert (end.actor_kind, end.actor_id, end.outcome) == (start.actor_kind, start.actor_id, "ok")
    assert (end.subject, end.target, end.actor_filter) == ("", "", "")  # nothing a forget must redact
    assert AuditEvent.objects.filter(tenant=tenant_a, action="audit.export_end").count() == 1  # once

    # Abandoned after its second chunk: the rows the server took before coming back for more.
    actor = _reader(tenant_a)
    response = audit_export_response(
        tenant=tenant_a, actor=actor, filters=AuditFilters(key_prefix="user:"), fmt="jsonl"
    )
    body = response.streaming_content
    next(body), next(body)
    # The server closes the body of a client gone away (here without Django's request_finished
    # closing the test's connection: the test runs in a transaction).
    request_finished.disconnect(close_old_connections)
    try:
        response.close()
    finally:
        request_finished.connect(close_old_connections)
    end = _export_end(tenant_a)
    assert end.count == 2 and end.detail["complete"] is False
    assert AuditEvent.objects.filter(tenant=tenant_a, action="audit.export_end").count() == 2

    # Under ASGI (an async iterator) alike.
    response = audit_export_response(
        tenant=tenant_a, actor=actor, filters=AuditFilters(key_prefix="user:"), fmt="csv", asynchronous=True
    )

    async def collect():
        return [chunk async for chunk in response.streaming_content]

    rows = list(csv.DictReader(io.StringIO(b"".join(async_to_sync(collect)()).decode(), newline="")))
    end = _export_end(tenant_a)
    assert end.count == len(rows) > 4 and end.detail["complete"] is True


@pytest.mark.parametrize("withdrawn", ["revoked", "expired"])
def test_an_export_stream_stops_at_its_next_page_once_its_key_is_revoked_or_expired(
    tenant_a, make_client, monkeypatch, withdrawn
):
    # A streamed export read its whole log for a key revoked after it began: at 2,000 rows a
    # page, a client reading slowly kept receiving the tenant's audit log for as long as it
    # liked. Now the stream ends at its next page, cut short (no clean end of the body).
    from memories import services as key_services
    from memories.models import ApiKey
    from zeromem.kernel.errors import Unauthenticated

    monkeypatch.setattr("audit.exports.CHUNK_ROWS", 2)
    auditor, key = make_client(tenant_a, scopes=["audit:read", "memory:write"])
    for n in range(8):
        auditor.call("memory_write", key=f"user:u1:k{n}", value=n)
    response = auditor.get(EXPORT, {"format": "jsonl"})
    assert response.status_code == 200
    chunks = iter(response.streaming_content)
    first = next(chunks)
    if withdrawn == "revoked":
        key_services.api_key_revoke(tenant=tenant_a, actor=SYSTEM, key_id=key.pk)
    else:
        ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(Unauthenticated) as stopped:
        for _chunk in chunks:
            pass
    assert stopped.value.code == f"key_{withdrawn}"
    assert len(first.decode().splitlines()) == 2


def test_export_of_an_empty_range_is_just_the_header(log):
    future = (timezone.now() + timedelta(days=1)).isoformat()
    assert stream(log.get(EXPORT, {"since": future})).splitlines() == [
        "id,occurred_at,actor_kind,actor_id,actor_label,surface,action,target,subject,actor_filter,outcome,request_id,"
        "client_ip,count,version,detail,seal,digest"
    ]


# --- checkpoints ---------------------------------------------------------------------------


def test_checkpoint_endpoint_seals_and_returns_the_head(log, tenant_a):
    r = log.post("/api/v1/audit-checkpoints")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["tenant"] == tenant_a.slug and body["seal"] >= 1
    assert body["events"] == AuditEvent.objects.filter(tenant=tenant_a).exclude(unsealed_q(tenant_a.pk)).count()
    assert not AuditEvent.objects.filter(unsealed_q(tenant_a.pk)).exclude(action="audit.checkpoint").exists()


def test_the_list_and_exports_show_each_events_seal_number(log, tenant_a):
    # Range seals write nothing to the events: the number shown comes from the seals' ranges.
    audit_seal(tenant_id=tenant_a.pk, batch_size=5)
    seals = list(AuditSeal.objects.filter(tenant=tenant_a).order_by("seq"))
    assert len(seals) >= 2 and all(s.by_range for s in seals)
    unsealed = audit_record(tenant=tenant_a, actor=Actor.system(job="t"), action="memory.read", outcome="ok")

    def expected(event_id):
        return next((s.seq for s in seals if s.first_event_id <= event_id <= s.last_event_id), None)

    listed = events(log, limit=200)["results"]
    assert {e["id"]: e["seal"] for e in listed} == {e["id"]: expected(e["id"]) for e in listed}
    assert {e["seal"] for e in listed} >= {1, 2, None} and expected(unsealed) is None
    lines = jsonl(stream(log.get(EXPORT, {"format": "jsonl"})))
    assert {e["id"]: e["seal"] for e in lines} == {e["id"]: expected(e["id"]) for e in lines}


def test_jsonl_export_keeps_one_event_per_line_with_unicode_line_separators_in_a_field(log, api, tenant_a):
    # A write refuses such a subject now (tests/test_write_review.py); one read or forgotten
    # by it still names it in its event, as do events written before that.
    subject = "u4\u2028next\u2029para\x85nel"
    audit_record(
        tenant=tenant_a, actor=SYSTEM, action="memory.read", outcome="ok", target="user:u4:lang", subject=subject
    )
    body = stream(log.get(EXPORT, {"format": "jsonl", "key_prefix": "user:u4:"}))
    lines = [json.loads(line) for line in body.splitlines()]  # str.splitlines breaks at U+2028 too
    assert [line["subject"] for line in lines if line["action"] == "memory.read"] == [subject]


# --- bounded pages ------------------------------------------------------------------------------


def _walk(client, **params) -> tuple[list[int], int]:
    """Every event id the list answers following next_cursor, and how many pages it took."""
    seen, cursor, pages = [], None, 0
    while True:
        page = events(client, **params, **({"cursor": cursor} if cursor else {}))
        pages += 1
        seen += [e["id"] for e in page["results"] if e["action"] != "audit.list"]
        cursor = page["next_cursor"]
        if not cursor:
            return seen, pages


def test_a_page_reads_a_bounded_window_of_the_log_and_its_cursor_goes_on(log, tenant_a, monkeypatch):
    # A filter no index serves (an outcome, an action, an actor) read the tenant's whole log
    # for one page: 0.5-0.8 s a page at 4 M events, growing with the log, for every page and
    # every reader at once (the list takes no tenant slot). A page now reads at most
    # LIST_SCAN_MAX events: fewer matches than the limit, none even, come with a next_cursor
    # while older events remain, and the walk still finds each match once.
    monkeypatch.setattr(selectors, "LIST_SCAN_MAX", 4)
    for _ in range(10):  # newer than the denial
        audit_record(tenant=tenant_a, actor=Actor.system(job="t"), action="memory.read", outcome="ok")
    denied = AuditEvent.objects.filter(tenant=tenant_a, outcome="denied").order_by("-id")
    want = list(denied.values_list("id", flat=True))
    assert want
    first = events(log, outcome="denied")
    assert first["results"] == [] and first["next_cursor"]
    seen, pages = _walk(log, outcome="denied")
    assert seen == want and pages > 3
    everything = AuditEvent.objects.filter(tenant=tenant_a).exclude(action="audit.list").order_by("-id")
    assert _walk(log, limit=3)[0] == list(everything.values_list("id", flat=True))


def test_events_sealed_before_range_seals_are_listed_whole(log, tenant_a, monkeypatch):
    # Events an older seal numbered are outside the window's index (seal IS NULL), and events
    # that committed late below such a seal's last id are inside it: a window reaching down
    # there would skip the numbered ones between them, so the page reads on to the end.
    from tests.test_audit_chain import _seal_the_old_way

    monkeypatch.setattr(selectors, "LIST_SCAN_MAX", 4)
    oldest = list(AuditEvent.objects.filter(tenant=tenant_a).order_by("id")[:12])
    assert len(oldest) == 12
    _seal_the_old_way(tenant_a, [e for i, e in enumerate(oldest[:10]) if i not in (1, 2, 3)])  # 1-3: late
    audit_seal(tenant_id=tenant_a.pk)
    below = [e.pk for e in reversed(oldest[:11])]
    # Below the 12th: 10 (new), 9..4 (numbered), 3..1 (new, committed late), 0 (numbered).
    page = events(log, limit=50, cursor=validation.encode_id_cursor(oldest[11].pk))
    assert [e["id"] for e in page["results"]] == below and page["next_cursor"] is None
    want = AuditEvent.objects.filter(tenant=tenant_a).exclude(action="audit.list").order_by("-id")
    assert _walk(log, limit=2)[0] == list(want.values_list("id", flat=True))


@pytest.fixture
def dated(db, monkeypatch):
    """A tenant's log over ten days, its clock moved: 7 events ten days ago (the tenant's
    creation and 6 reads), 3 five days ago, then 20 now."""
    from types import SimpleNamespace

    from audit import services as audit_services
    from tests.factories import make_tenant

    now = timezone.now()
    clock = SimpleNamespace(now=lambda: now - timedelta(days=10))
    monkeypatch.setattr(audit_services, "timezone", clock)
    tenant = make_tenant("dated")
    system = Actor.system(job="t")
    for i in range(6):
        audit_record(tenant=tenant, actor=system, action="memory.read", outcome="ok", target=f"old:{i}")
    clock.now = lambda: now - timedelta(days=5)
    for i in range(3):
        audit_record(tenant=tenant, actor=system, action="memory.read", outcome="ok", target=f"mid:{i}")
    monkeypatch.undo()
    for i in range(20):
        audit_record(tenant=tenant, actor=system, action="memory.read", outcome="ok", target=f"new:{i}")
    return tenant, now


def _service_walk(tenant, **filters) -> tuple[list[str], list[int]]:
    """The targets a walk of the list answers, and each page's number of rows."""
    from audit.selectors import audit_filters
    from audit.services import audit_event_list

    targets, sizes, cursor = [], [], None
    while True:
        rows, cursor = audit_event_list(
            tenant=tenant, actor=Actor.system(job="t"), filters=audit_filters(filters), limit=50, cursor=cursor
        )
        targets += [r.target for r in rows if r.action != "audit.list"]
        sizes.append(len(rows))
        if not cursor:
            return targets, sizes


def test_a_time_range_starts_the_window_at_until_and_ends_the_walk_at_since(dated, monkeypatch):
    # With bounded windows, until = 9 days ago read the 20 newest events' windows first (empty
    # pages), and since = an hour ago went on reading windows down to the first event. The
    # bounds come from events a day (ID_CLOCK_MARGIN) past until and before since.
    tenant, now = dated
    monkeypatch.setattr(selectors, "LIST_SCAN_MAX", 4)
    old, sizes = _service_walk(tenant, until=(now - timedelta(days=9)).isoformat())
    assert old == [f"old:{i}" for i in reversed(range(6))] + ["dated"]  # and the tenant's creation
    assert sizes[0] == 4  # the first page is the first window at until: full
    new, sizes = _service_walk(tenant, since=(now - timedelta(hours=1)).isoformat())  # mid: 5 days back
    assert new == [f"new:{i}" for i in reversed(range(20))]
    assert len(sizes) <= 6  # 20 events of 4-event windows; none of the 10 older read
    mid, _ = _service_walk(
        tenant, since=(now - timedelta(days=6)).isoformat(), until=(now - timedelta(days=4)).isoformat()
    )
    assert mid == ["mid:2", "mid:1", "mid:0"]


def test_a_subject_or_key_prefix_naming_few_events_reads_them_by_its_index_in_one_page(dated, monkeypatch):
    # The bounded windows gave a subject's 3 events in pages of at most one, across the log;
    # a filter whose index names at most LIST_SCAN_MAX events reads them at once.
    tenant, _ = dated
    monkeypatch.setattr(selectors, "LIST_SCAN_MAX", 4)
    assert _service_walk(tenant, key_prefix="mid:") == (["mid:2", "mid:1", "mid:0"], [3])
    old, sizes = _service_walk(tenant, key_prefix="old:", outcome="ok")  # 6: past the cap, windows
    assert old == [f"old:{i}" for i in reversed(range(6))] and len(sizes) > 1


def _event_rows_scanned(sql: str) -> int:
    """Rows of the event table's partitions that ``sql`` reads (every loop of each scan node,
    those its filter removed included), from its EXPLAIN ANALYZE, index access preferred."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny table is no measure of a big one
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
        plan = cursor.fetchone()[0]
        cursor.execute("SET LOCAL enable_seqscan = on")
    plan = json.loads(plan) if isinstance(plan, str) else plan
    total, stack = 0, [plan[0]["Plan"]]
    while stack:
        node = stack.pop()
        if node.get("Relation Name", "").startswith("audit_auditevent"):
            rows = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
            total += rows * node.get("Actual Loops", 1)
        stack.extend(node.get("Plans", []))
    return total


@pytest.mark.postgres
def test_every_page_of_a_walk_reads_a_bounded_window_the_last_one_too(dated, monkeypatch):
    # The last page (fewer than LIST_SCAN_MAX events left below its cursor) read the rest
    # without saying "seal IS NULL", so not on the (tenant, id) index: by another, over the
    # tenant's whole log again. With no event of an older seal left, it says so now.
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    tenant, _ = dated
    monkeypatch.setattr(selectors, "LIST_SCAN_MAX", 4)
    with CaptureQueriesContext(connection) as queries:
        targets, _ = _service_walk(tenant, action="memory.read")
    assert len(targets) == 29
    pages = [q["sql"] for q in queries if q["sql"].startswith("SELECT") and '"digest"' in q["sql"]]
    scanned = [_event_rows_scanned(sql) for sql in pages]  # measured after the walk: the first
    # page's window (no upper bound) holds the walk's own audit.list events besides its 4
    assert len(pages) > 5 and scanned[0] <= 4 + len(pages) and max(scanned[1:]) <= 4 + 1, scanned


# --- bounded exports ----------------------------------------------------------------------------


def _reader(tenant) -> Actor:
    """An API key's actor with audit:read, its key a row of ``tenant`` (an export asks again
    before each page whether it still holds) — stored directly: no event in the log."""
    from memories.models import ApiKey
    from memories.services.api_keys import key_actor

    _raw, lookup, key_hash = ApiKey.generate()
    key = ApiKey.objects.create(tenant=tenant, name="reader", lookup=lookup, key_hash=key_hash, scopes=["audit:read"])
    return key_actor(key, surface="rest")


EXPORT_EVENTS = ("audit.export", "audit.export_end")  # the exports' own, not what they export


def _export_ids(tenant, **filters) -> list[int]:
    from audit.selectors import audit_filters

    response = audit_export_response(tenant=tenant, actor=_reader(tenant), filters=audit_filters(filters), fmt="jsonl")
    return [e["id"] for e in jsonl(stream(response)) if e["action"] not in EXPORT_EVENTS]


def _oracle(tenant, **conditions) -> list[int]:
    rows = AuditEvent.objects.filter(tenant=tenant, **conditions).exclude(action__in=EXPORT_EVENTS).order_by("-id")
    return list(rows.values_list("id", flat=True))


@pytest.mark.postgres
def test_an_export_with_a_rare_filter_reads_the_log_in_bounded_windows(dated, monkeypatch):
    # An export filtered by something few events have (an action, an outcome, an actor) read
    # the tenant's whole log in its first query to find them, holding a pooled connection
    # throughout: 0.5 s at 1.5M events. Each query now reads one window of at most
    # EXPORT_SCAN_MAX events, the connection handed back between windows, and the export is
    # still complete and in order.
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from audit import exports

    tenant, _ = dated
    monkeypatch.setattr(selectors, "EXPORT_SCAN_MAX", 4)
    monkeypatch.setattr(exports, "CHUNK_ROWS", 3)
    audit_record(tenant=tenant, actor=Actor.system(job="t"), action="memory.write", outcome="ok", target="rare")
    for i in range(5):
        audit_record(tenant=tenant, actor=Actor.system(job="t"), action="memory.read", outcome="ok", target=f"z:{i}")
    with CaptureQueriesContext(connection) as queries:
        got = _export_ids(tenant, action="memory.write")
    assert got == _oracle(tenant, action="memory.write") and len(got) == 1
    pages = [q["sql"] for q in queries if q["sql"].startswith("SELECT") and '"digest"' in q["sql"]]
    scanned = [_event_rows_scanned(sql) for sql in pages]
    assert len(pages) > 5 and max(scanned) <= 4 + 1, scanned


@pytest.mark.parametrize(
    "filters,conditions",
    [
        ({}, {}),
        ({"action": "memory.read"}, {"action": "memory.read"}),
        ({"key_prefix": "new:"}, {"target__startswith": "new:"}),  # past the cap: windows
        ({"key_prefix": "mid:"}, {"target__startswith": "mid:"}),  # few: by its index
    ],
)
def test_a_windowed_export_is_complete_and_in_order_across_windows_and_chunks(dated, monkeypatch, filters, conditions):
    from audit import exports

    tenant, _ = dated
    monkeypatch.setattr(selectors, "LIST_SCAN_MAX", 4)  # a subject or key prefix naming more: windows
    want = _oracle(tenant, **conditions)
    for window, chunk in ((4, 3), (4, 4), (5, 2), (1, 1), (10_000, 2000)):
        monkeypatch.setattr(selectors, "EXPORT_SCAN_MAX", window)
        monkeypatch.setattr(exports, "CHUNK_ROWS", chunk)
        assert _export_ids(tenant, **filters) == want, (window, chunk)


def test_a_windowed_export_keeps_to_the_time_range_and_the_tenant(dated, log, tenant_a, monkeypatch):
    from audit import exports

    tenant, now = dated
    monkeypatch.setattr(selectors, "EXPORT_SCAN_MAX", 4)
    monkeypatch.setattr(exports, "CHUNK_ROWS", 2)
    since, until = now - timedelta(days=6), now - timedelta(days=4)
    got = _export_ids(tenant, since=since.isoformat(), until=until.isoformat())
    assert got == _oracle(tenant, occurred_at__gte=since, occurred_at__lt=until) and len(got) == 3
    assert _export_ids(tenant, outcome="denied") == []  # tenant A's denial is not tenant "dated"'s
    assert _export_ids(tenant_a, outcome="denied") == _oracle(tenant_a, outcome="denied") != []
    assert not set(_export_ids(tenant_a)) & set(_oracle(tenant))


def test_a_windowed_export_keeps_events_sealed_before_range_seals(log, tenant_a, monkeypatch):
    from audit import exports
    from tests.test_audit_chain import _seal_the_old_way

    monkeypatch.setattr(selectors, "EXPORT_SCAN_MAX", 4)
    monkeypatch.setattr(exports, "CHUNK_ROWS", 2)
    oldest = list(AuditEvent.objects.filter(tenant=tenant_a).order_by("id")[:12])
    _seal_the_old_way(tenant_a, [e for i, e in enumerate(oldest[:10]) if i not in (1, 2, 3)])  # 1-3: late
    audit_seal(tenant_id=tenant_a.pk)
    assert _export_ids(tenant_a) == _oracle(tenant_a)


@pytest.mark.parametrize("withdrawn", ["membership_removed", "account_disabled"])
def test_an_admin_export_stream_stops_once_its_staff_user_loses_the_role_or_account(
    tenant_a, make_client, monkeypatch, withdrawn
):
    # The API key's export stops at its next page once the key is revoked; a staff user's
    # admin export kept streaming the tenant's whole log after their compliance membership
    # was removed or their account disabled (nothing was asked again for staff).
    from memories import services as staff_services
    from memories.models import Membership
    from tests.factories import logged_in, make_staff
    from zeromem.kernel.errors import Unauthenticated

    monkeypatch.setattr("audit.exports.CHUNK_ROWS", 2)
    writer, _key = make_client(tenant_a, scopes=["memory:write"])
    for n in range(8):
        writer.call("memory_write", key=f"user:u1:k{n}", value=n)
    user = make_staff(tenant_a, "compliance")
    response = logged_in(user).get(f"/admin/audit/auditevent/export/?fmt=jsonl&tenant={tenant_a.pk}")
    assert response.status_code == 200
    chunks = iter(response.streaming_content)
    first = next(chunks)
    if withdrawn == "membership_removed":
        membership = Membership.objects.get(tenant=tenant_a, user=user)
        staff_services.membership_remove(tenant=tenant_a, actor=SYSTEM, membership_id=membership.pk)
    else:
        type(user).objects.filter(pk=user.pk).update(is_active=False)
    with pytest.raises(Unauthenticated) as stopped:
        for _chunk in chunks:
            pass
    assert stopped.value.code == withdrawn
    assert len(first.decode().splitlines()) == 2
