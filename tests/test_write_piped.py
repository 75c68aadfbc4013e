"""A tool write over a key this process read or wrote lately sends the rate counter and its
statement together, two transactions in one round trip, without reading the row first
(zeromem/kernel/hotsql.py "A write and the rate counter in one round trip"): the statement —
the UPDATE, the version row, the event — writes only while the row is as this process last
saw it (memories/services/last_seen.py) and the counter within its limit. Everything else — a
row changed elsewhere, a row expired since, a value turning sensitive, a write past the limit
— ends as a write did before: the history exact, one event, the call counted once.

Transactional tests: the write is a transaction of its own, as served."""

import json

import pytest
from django.db import connection

from audit.models import AuditEvent, RateCounter
from audit.services import audit_seal
from audit.verify import audit_verify
from memories import services
from memories.models import Memory, MemoryVersion
from memories.services import last_seen
from tests.factories import SYSTEM, make_key, write
from tests.helpers import RoundTrips, other_session
from tests.test_read_piped import _rider, _usage_held  # noqa: F401 - _usage_held: autouse
from tests.test_read_rider import _lane_settings  # noqa: F401 - the lane's settings (autouse)
from tests.test_tool_lane import LANE, call
from zeromem.kernel import hotsql

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="libpq's pipeline mode: PostgreSQL only"),
    pytest.mark.django_db(transaction=True),
]

KEY = "user:u1:lang"


def _write_call(value, **arguments):
    return {"name": "memory_write", "arguments": {"key": KEY, "value": value, **arguments}}


@pytest.fixture
def raw(tenant_a, settings):
    """A key the lane takes, KEY written (tagged, for a subject) and seen by this process, the
    lane's statements prepared on the connection (a write's, and a piped write's)."""
    _key, raw = make_key(tenant_a)
    write(tenant_a, KEY, "zh-CN", subject="u1", tags=["lang"])
    for i in range(3):  # Django's (the key verified, then cached), then the lane's
        settings.ZEROMEM_WRITE_PIPED = i < 2
        status, _headers, content = call(LANE, raw, _write_call(f"v{i}"))
        assert status == "200 OK", content
    settings.ZEROMEM_WRITE_PIPED = True
    assert last_seen.as_seen(tenant_a.pk, KEY) is not None
    return raw


def _history(tenant) -> list[tuple[int, object]]:
    return list(MemoryVersion.objects.filter(tenant=tenant).order_by("version").values_list("version", "value"))


def _writes(tenant) -> list[tuple]:
    return list(
        AuditEvent.objects.filter(tenant=tenant, action="memory.write")
        .order_by("id")
        .values_list("outcome", "version", "subject", "detail")
    )


def _counted() -> int:
    return sum(RateCounter.objects.filter(bucket__startswith="key:").values_list("count", flat=True))


def _stored(tenant) -> Memory:
    return Memory.objects.get(tenant=tenant, key=KEY, deleted_at__isnull=True)


def test_a_laned_write_of_a_key_seen_is_one_round_trip_of_two_transactions(tenant_a, raw):
    counted, events = _counted(), len(_writes(tenant_a))
    with RoundTrips() as sent:
        status, _headers, content = call(LANE, raw, _write_call("en"))
    assert status == "200 OK", content
    assert json.loads(content) == {"status": "ok", "key": KEY, "version": 5, "created": False}
    assert (sent.count, sent.syncs) == (1, 2)  # no SELECT; the counter and the write, together
    assert _counted() == counted + 1
    assert _history(tenant_a)[-2:] == [(4, "v2"), (5, "en")]
    assert _writes(tenant_a)[events:] == [("ok", 5, "u1", {"created": False})]
    stored = _stored(tenant_a)
    # The row as a write with its SELECT leaves it: tags kept, indexed by them, subject kept.
    assert (stored.value, stored.version, stored.tags, stored.subject) == ("en", 5, ["lang"], "u1")
    assert "lang" in stored.search_text and "en" in stored.search_text
    assert MemoryVersion.objects.get(memory=stored, version=5).subject == "u1"
    audit_seal(tenant_id=tenant_a.pk)
    assert audit_verify(tenant_id=tenant_a.pk).ok


def test_with_the_setting_off_a_write_reads_the_row_first(tenant_a, raw, settings):
    settings.ZEROMEM_WRITE_PIPED = False
    with RoundTrips() as sent:
        status, _headers, content = call(LANE, raw, _write_call("en"))
    assert status == "200 OK", content
    assert (sent.count, sent.syncs) == (2, 2), sent.statements
    assert _history(tenant_a)[-1] == (5, "en")


def test_the_memory_returned_reads_its_other_fields_from_the_database(tenant_a, raw):
    Memory.objects.filter(tenant=tenant_a, key=KEY).update(category="preference", importance=7)
    with hotsql.answered_later(), hotsql.riding(_rider()):
        result = services.memory_write(tenant=tenant_a, actor=SYSTEM, key=KEY, value="en")
    memory = result.memory
    assert (memory.version, memory.value, memory.tags, memory.subject) == (5, "en", ["lang"], "u1")
    assert (memory.category, memory.importance) == ("preference", 7)  # deferred: read when asked
    assert memory.created_at == _stored(tenant_a).created_at


def test_a_row_written_elsewhere_is_written_over_as_it_is_and_the_key_turns_cold(tenant_a, raw):
    seen = last_seen._seen[(tenant_a.pk, KEY)]
    write(tenant_a, KEY, "elsewhere", tags=["other"])  # another process's write (version 5)
    last_seen._seen[(tenant_a.pk, KEY)] = seen  # this one never saw it
    counted = _counted()
    with RoundTrips() as sent:
        status, _headers, content = call(LANE, raw, _write_call("en"))
    assert status == "200 OK", content
    assert json.loads(content)["version"] == 6
    # The piped attempt (wrote nothing), then the SELECT and the write over what it found.
    assert sent.count == 3
    assert _counted() == counted + 1  # counted once
    assert _history(tenant_a)[-2:] == [(5, "elsewhere"), (6, "en")]
    assert _stored(tenant_a).tags == ["other"]  # the tags the row held, not those seen here
    assert [e[:2] for e in _writes(tenant_a)[-2:]] == [("ok", 5), ("ok", 6)]
    # Cold: the next write reads the row first; it finds the row as this process left it, so
    # the one after goes piped again.
    with RoundTrips() as sent:
        assert call(LANE, raw, _write_call("de"))[0] == "200 OK"
    assert sent.count == 2, sent.statements
    with RoundTrips() as sent:
        assert call(LANE, raw, _write_call("fr"))[0] == "200 OK"
    assert (sent.count, sent.syncs) == (1, 2)
    assert _history(tenant_a)[-3:] == [(6, "en"), (7, "de"), (8, "fr")]


def test_two_processes_writing_one_key_in_turn_pay_the_stale_round_trip_once(tenant_a, raw):
    trips = []
    for value in ("a", "b", "c", "d"):
        seen = last_seen._seen[(tenant_a.pk, KEY)]
        write(tenant_a, KEY, f"elsewhere-{value}")  # the other process, between each of ours
        last_seen._seen[(tenant_a.pk, KEY)] = seen
        with RoundTrips() as sent:
            assert call(LANE, raw, _write_call(value))[0] == "200 OK"
        trips.append(sent.count)
    assert trips == [3, 2, 2, 2]
    assert [v for _version, v in _history(tenant_a)[-2:]] == ["elsewhere-d", "d"]


@pytest.mark.parametrize("column, value", [("tags", "'[\"other\"]'"), ("subject", "'u2'"), ("sensitive", "false")])
def test_a_row_changed_without_a_new_version_is_not_written_over_as_seen(tenant_a, raw, column, value):
    """Each column the statement is built from is checked, not the version alone (a job that
    changes a row without a new version, say)."""
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE memories_memory SET {column} = {value} WHERE key = %s", [KEY])  # noqa: S608
    status, _headers, content = call(LANE, raw, _write_call("en"))
    assert status == "200 OK", content
    stored = _stored(tenant_a)
    version = MemoryVersion.objects.get(memory=stored, version=5)
    assert (stored.version, version.value) == (5, "en")
    assert (stored.tags, stored.subject) == ((["other"], "u1") if column == "tags" else (["lang"], stored.subject))
    assert version.subject == stored.subject
    if column == "subject":
        assert stored.subject == "u2" and _writes(tenant_a)[-1][2] == "u2"


def test_a_memory_expired_since_it_was_seen_is_not_revived(tenant_a, raw):
    with connection.cursor() as cursor:
        cursor.execute("UPDATE memories_memory SET expires_at = now() - interval '1 second' WHERE key = %s", [KEY])
    seen = _stored(tenant_a)
    last_seen.saw(tenant_a.pk, KEY, seen)  # seen here with that expiry
    status, _headers, content = call(LANE, raw, _write_call("en"))
    assert status == "200 OK", content
    assert json.loads(content) == {"status": "ok", "key": KEY, "version": 1, "created": True}
    assert Memory.objects.get(pk=seen.pk).deleted_at is not None  # trashed, as a write over it does
    assert _stored(tenant_a).pk != seen.pk


def test_a_value_turning_sensitive_is_sealed_under_the_lock(tenant_a, raw):
    status, _headers, content = call(LANE, raw, _write_call("4111 1111", sensitive=True))
    assert status == "200 OK", content
    stored = _stored(tenant_a)
    assert stored.sensitive and stored.version == 5
    with connection.cursor() as cursor:
        cursor.execute("SELECT value FROM memories_memory WHERE id = %s", [stored.pk])
        (raw_value,) = cursor.fetchone()
    assert "zmenc" in json.loads(raw_value) if isinstance(raw_value, str) else "zmenc" in raw_value
    assert last_seen.as_seen(tenant_a.pk, KEY) is None  # a sensitive memory is not kept


def test_past_the_limit_nothing_is_written_and_the_call_is_counted_once(
    tenant_a, raw, settings, limiter_minute, monkeypatch
):
    key_counted = _counted()
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 1  # this minute's window has its calls already
    history, events = _history(tenant_a), _writes(tenant_a)
    piped = []
    send = hotsql._send_write_piped
    monkeypatch.setattr(hotsql, "_send_write_piped", lambda *args: piped.append(1) or send(*args))
    status, headers, _content = call(LANE, raw, _write_call("en"))
    assert piped == [1]  # the statement went, with the counter: it wrote nothing
    assert status == "429 Too Many Requests"
    assert int(dict(headers)["Retry-After"]) >= 1
    assert (_history(tenant_a), _writes(tenant_a)) == (history, events)
    assert _counted() == key_counted + 1
    assert last_seen.as_seen(tenant_a.pk, KEY) is not None  # the row is as seen: still warm


def test_through_pgbouncer_a_write_reads_the_row_first(tenant_a, raw, settings):
    """In transaction mode the two transactions could reach two server sessions."""
    settings.ZEROMEM_PGBOUNCER = True
    with RoundTrips() as sent:
        assert call(LANE, raw, _write_call("en"))[0] == "200 OK"
    assert sent.count == 2


def test_a_piped_write_while_an_init_receiver_listens(tenant_a, raw):
    """With a pre_init/post_init receiver on Memory the memory as seen is built through
    Memory.from_db, which takes its values in the model's field order (found by review: each
    value in another field's place, every such write a 500)."""
    from django.db.models.signals import post_init

    def receiver(sender, instance, **kwargs):
        pass

    post_init.connect(receiver, sender=Memory)
    try:
        seen = last_seen.as_seen(tenant_a.pk, KEY)
        assert (seen.version, seen.tags, seen.sensitive, seen.expires_at) == (4, ["lang"], False, None)
        status, _headers, content = call(LANE, raw, _write_call("en"))
    finally:
        post_init.disconnect(receiver, sender=Memory)
    assert status == "200 OK", content
    assert json.loads(content)["version"] == 5
    stored = _stored(tenant_a)
    assert (stored.value, stored.version, stored.tags) == ("en", 5, ["lang"])


def test_writes_refused_again_and_again_do_not_pile_up_prepared_statements(tenant_a, raw, settings, limiter_minute):
    """A piped statement whose first run on a connection fails (past the limit, every time)
    keeps its name: psycopg forgot a statement whose first run failed, while the server kept it
    prepared — one more per refused write, for as long as the connection lived (found by
    review)."""
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 1  # this minute's window has its calls already
    before = _prepared_writes()
    # Each with a TTL: a statement of its own (a parameter of another type), never run before.
    statuses = [call(LANE, raw, _write_call(f"x{i}", ttl_seconds=600))[0] for i in range(6)]
    assert statuses == ["429 Too Many Requests"] * 6
    assert len(_prepared_writes()) <= len(before) + 1


def _prepared_writes() -> list:
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements WHERE statement LIKE 'WITH h0 AS (UPDATE%%'")
        return cursor.fetchall()


def test_a_write_timed_out_behind_a_row_lock_leaves_everything_as_it_was(tenant_a, raw):
    other = other_session()
    other.execute("BEGIN")
    other.execute("SELECT 1 FROM memories_memory WHERE tenant_id = %s AND key = %s FOR UPDATE", [tenant_a.pk, KEY])
    counted, history, events = _counted(), _history(tenant_a), _writes(tenant_a)
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = '300ms'")
    try:
        status, _headers, content = call(LANE, raw, _write_call("en"))
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET statement_timeout")
        other.rollback()
        other.close()
    assert status == "503 Service Unavailable", content
    assert (_counted(), _history(tenant_a), _writes(tenant_a)) == (counted + 1, history, events)
    assert connection.connection.pgconn.pipeline_status == 0
    status, _headers, content = call(LANE, raw, _write_call("de"))
    assert status == "200 OK", content
    assert _history(tenant_a)[-1] == (5, "de")
    assert _counted() == counted + 2


def test_three_threads_writing_one_key_lose_and_double_nothing(tenant_a, raw):
    import threading

    from django.db import connections

    errors, statuses = [], []
    counted = _counted()

    def run(n):
        try:
            for i in range(15):
                status, _h, content = call(LANE, raw, _write_call(f"t{n}-{i}"))
                statuses.append(status)
                if status != "200 OK":
                    errors.append(content)
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    history = _history(tenant_a)
    assert [v for v, _ in history] == list(range(1, 5 + 45))
    stored = _stored(tenant_a)
    assert stored.version == 4 + 45 and stored.value == history[-1][1]
    oks = [e for e in _writes(tenant_a) if e[0] == "ok"]
    assert sorted(e[1] for e in oks) == list(range(1, 5 + 45))
    assert _counted() == counted + 45


def test_a_connection_lost_once_the_write_is_sent_is_a_503_and_the_write_lands_at_most_once(tenant_a, raw, monkeypatch):
    """Unacknowledged: PostgreSQL may have run what it had read before it saw the client gone."""
    history, events = _history(tenant_a), _writes(tenant_a)
    segment = hotsql._segment

    def cut(pgconn):
        pgconn.finish()  # sent, and the connection gone before its answers are read
        return segment(pgconn)

    monkeypatch.setattr(hotsql, "_segment", cut)
    status, _headers, content = call(LANE, raw, _write_call("en"))
    monkeypatch.undo()
    connection.close()  # (a server's request ends so; this test goes on on a new one)
    assert status == "503 Service Unavailable", content
    after, written = _history(tenant_a), _writes(tenant_a)
    assert (after, written) in [
        (history, events),
        (history + [(5, "en")], events + [("ok", 5, "u1", {"created": False})]),
    ]


def test_after_an_update_a_write_goes_piped_and_after_a_delete_it_reads_first(tenant_a, raw):
    update = {"name": "memory_update", "arguments": {"key": KEY, "value": "de"}}
    assert call(LANE, raw, update)[0] == "200 OK"
    with RoundTrips() as sent:
        assert call(LANE, raw, _write_call("en"))[0] == "200 OK"
    assert (sent.count, sent.syncs) == (1, 2)  # the update left the row as this process saw it
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=KEY)
    assert last_seen.as_seen(tenant_a.pk, KEY) is None
    status, _headers, content = call(LANE, raw, _write_call("fr"))
    assert status == "200 OK" and json.loads(content)["created"] is True
    old = MemoryVersion.objects.filter(tenant=tenant_a).exclude(memory=_stored(tenant_a)).order_by("version")
    assert [(v.version, v.op, v.value) for v in old][-3:] == [
        (5, "update", "de"),
        (6, "write", "en"),
        (7, "delete", "en"),
    ]
    assert (_stored(tenant_a).value, _stored(tenant_a).version) == ("fr", 1)


def test_a_write_that_fails_while_its_statement_is_built_is_counted_and_writes_nothing(tenant_a, raw, monkeypatch):
    """An error while the statement is built (the counter kept to go with it): the counter goes
    alone (the call counted once), nothing is written, the connection is out of pipeline mode."""
    from audit import services as audit_services

    counted, history, events = _counted(), _history(tenant_a), _writes(tenant_a)
    monkeypatch.setattr(audit_services, "_event_statement", lambda *a, **k: 1 / 0)
    status, _headers, _content = call(LANE, raw, _write_call("en"))
    monkeypatch.undo()
    assert status == "500 Internal Server Error"
    assert connection.connection.pgconn.pipeline_status == 0
    assert (_counted(), _history(tenant_a), _writes(tenant_a)) == (counted + 1, history, events)
    assert call(LANE, raw, _write_call("de"))[0] == "200 OK"
    assert _history(tenant_a)[-1] == (5, "de")
