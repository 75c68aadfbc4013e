"""A tool read of a key this process read or wrote lately sends its SELECT (with the rate counter
riding it) and its audit event together, as two transactions in one round trip
(zeromem/kernel/hotsql.py "A read and its event in one round trip"): the event is written only
when the read's own transaction committed with the row as last seen and the counter within its
limit, and is then the event the read would have written after it. Its answer is read once the
call's answer is built. Everything else — a row changed elsewhere, a read past the limit, a
read whose statement failed, a connection that died — ends with the events it had before.

Transactional tests: the read is a transaction of its own, as served."""

import psycopg
import pytest
from django.db import OperationalError, connection

from audit.models import AuditEvent, RateCounter
from audit.services import audit_seal
from audit.verify import audit_verify
from memories import keyring, services
from memories.services import last_seen, usage
from tests.factories import SYSTEM, make_key, write
from tests.helpers import RoundTrips
from tests.test_read_rider import _lane_settings  # noqa: F401 - the lane's settings (autouse)
from tests.test_tool_lane import LANE, call
from zeromem.kernel import hotsql

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="libpq's pipeline mode: PostgreSQL only"),
    pytest.mark.django_db(transaction=True),
]

KEY = "user:u1:lang"
READ = {"name": "memory_read", "arguments": {"key": KEY}}
FIELDS = ("outcome", "target", "subject", "version", "surface", "actor_kind", "actor_id", "count", "detail")


@pytest.fixture(autouse=True)
def _usage_held(settings):
    """The lane's settings (tests/test_read_rider.py), and tokens-returned totals written now
    and then, as served."""
    settings.ZEROMEM_USAGE_FLUSH_SECONDS = 3600
    yield
    usage.flush()  # the totals held back, while the tenant is there


@pytest.fixture
def raw(tenant_a):
    """A key the lane takes, its statements prepared on the connection, and KEY written."""
    _key, raw = make_key(tenant_a)
    write(tenant_a, KEY, "zh-CN", subject="u1")
    for _ in range(3):  # Django's (the key verified, then cached), then the lane's
        assert call(LANE, raw, READ)[0] == "200 OK"
    assert last_seen.expected(tenant_a.pk, KEY) is not None
    return raw


def _reads(tenant) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(tenant=tenant, action="memory.read").order_by("id"))


def _counted(_tenant) -> int:
    return sum(RateCounter.objects.filter(bucket__startswith="key:").values_list("count", flat=True))


def test_a_laned_read_is_one_round_trip_of_two_transactions_and_writes_its_event(tenant_a, raw):
    before, counted = len(_reads(tenant_a)), _counted(tenant_a)
    with RoundTrips() as sent:
        status, _headers, content = call(LANE, raw, READ)
    assert status == "200 OK" and b'"value":"zh-CN"' in content
    assert (sent.count, sent.syncs) == (1, 2)  # sent together; each its own transaction
    assert _counted(tenant_a) == counted + 1
    events = _reads(tenant_a)[before:]
    assert len(events) == 1
    # The event a read sends after its SELECT, field for field (the lane's reads before it).
    piped, earlier = events[0], _reads(tenant_a)[before - 1]
    assert [getattr(piped, f) for f in FIELDS] == [getattr(earlier, f) for f in FIELDS]
    assert (piped.outcome, piped.target, piped.subject) == ("ok", KEY, "u1")
    audit_seal(tenant_id=tenant_a.pk)
    assert audit_verify(tenant_id=tenant_a.pk).ok


def test_the_events_answer_is_read_when_the_call_is_answered(tenant_a, raw):
    """The service returns with the event's answer still to be read: the block's end reads it
    (the call's answer is built meanwhile), and the connection takes statements again."""
    with hotsql.answered_later(), hotsql.riding(_rider()):
        result = services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
        pending = list(getattr(connection, hotsql._LATER))
    assert result.memory.value == "zh-CN"
    assert [type(p).__name__ for p in pending] == ["_PipedEvent"]
    assert not getattr(connection, hotsql._LATER, None)
    assert connection.connection.pgconn.pipeline_status == 0  # pipeline mode left
    assert _reads(tenant_a)[-1].outcome == "ok"
    with connection.cursor() as cursor:  # Django's cursor finds the connection free
        cursor.execute("SELECT 1")


def _rider(limit: int = 10_000):
    """The rate counter as the lane's read holds it (audit.limits.hit_riding), of a bucket of
    this module's own."""
    from audit import limits

    return hotsql.Rider(
        lambda own: limits._upsert_sql(connection.vendor, own), ["piped-test", 0, 1], lambda row: None, limit=limit
    )


def test_a_row_changed_elsewhere_is_read_as_it_is_and_its_event_says_so(tenant_a, raw):
    (m,) = [services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY).memory]
    with connection.cursor() as cursor:  # another process's write: this one never sees it
        cursor.execute("UPDATE memories_memory SET version = version + 1, subject = 'u2' WHERE id = %s", [m.pk])
    before = len(_reads(tenant_a))
    status, _headers, content = call(LANE, raw, READ)
    assert status == "200 OK" and b'"value":"zh-CN"' in content
    (event,) = _reads(tenant_a)[before:]
    assert (event.outcome, event.subject, event.version) == ("ok", "u2", m.version + 1)


def test_a_memory_gone_elsewhere_is_one_not_found_event(tenant_a, raw):
    with connection.cursor() as cursor:
        cursor.execute("UPDATE memories_memory SET deleted_at = now() WHERE key = %s", [KEY])
    before = len(_reads(tenant_a))
    status, _headers, content = call(LANE, raw, READ)
    assert status == "200 OK" and b'"status":"not_found"' in content
    assert [e.outcome for e in _reads(tenant_a)[before:]] == ["not_found"]


def test_past_the_limit_the_read_is_refused_and_its_event_not_written(tenant_a, raw, settings):
    before = len(_reads(tenant_a))
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = _counted(tenant_a)  # the next call is one too many
    with RoundTrips() as sent:
        status, _headers, content = call(LANE, raw, READ)
    assert status == "429 Too Many Requests" and b"zh-CN" not in content
    assert sent.syncs >= 2  # the event went with the read: it did not write itself
    assert len(_reads(tenant_a)) == before


def test_a_read_whose_statement_fails_writes_no_event_and_leaves_the_connection_usable(tenant_a, raw):
    """The read's transaction fails (its counter row locked elsewhere past lock_timeout): the
    event, sent with it, writes nothing; the call is answered 503; the next read is as ever."""
    from django.db import connections

    before = len(_reads(tenant_a))
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("SELECT 1 FROM audit_ratecounter WHERE bucket LIKE 'key:%%' FOR UPDATE")
            assert cursor.fetchall()
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '100ms'")
        status, _headers, content = call(LANE, raw, READ)
        assert status == "503 Service Unavailable" and b"zh-CN" not in content
        assert len(_reads(tenant_a)) == before
    finally:
        with other.cursor() as cursor:
            cursor.execute("ROLLBACK")
        other.close()
    assert connection.connection.pgconn.pipeline_status == 0
    with connection.cursor() as cursor:
        cursor.execute("RESET lock_timeout")
    status, _headers, content = call(LANE, raw, READ)
    assert status == "200 OK" and b'"value":"zh-CN"' in content
    assert [e.outcome for e in _reads(tenant_a)[before:]] == ["ok"]


def test_an_event_announced_and_not_written_is_written_after_it(tenant_a, raw, monkeypatch):
    """The read's row came back with its token, and the event's INSERT then wrote nothing (its
    transaction's commit failed after the row was sent): the event is written on its own
    before the call is answered — recorded once, never lost."""
    real = hotsql._piped_statements

    def statements(*args):
        read, insert = real(*args)
        return read, insert.replace("current_setting('zm.read', true) = %s", "%s::text IS NULL")

    monkeypatch.setattr(hotsql, "_piped_statements", statements)
    before = len(_reads(tenant_a))
    with RoundTrips() as sent:
        status, _headers, _content = call(LANE, raw, READ)
    assert status == "200 OK" and sent.count >= 2  # the read and its event (nothing), the event again
    events = _reads(tenant_a)[before:]
    assert [(e.outcome, e.subject) for e in events] == [("ok", "u1")]
    audit_seal(tenant_id=tenant_a.pk)
    assert audit_verify(tenant_id=tenant_a.pk).ok


def test_a_connection_dead_once_both_are_sent_sends_the_read_again_alone(tenant_a, raw, monkeypatch, settings):
    """The read is the first statement on its connection (no pool check); the connection dies
    once both statements are sent: the read goes again on a checked connection, without its
    event, and the call records the event of what it found. Had both run before the answers
    were lost, the read has two events, each with its own uid — recorded twice, never
    unrecorded — and the log verifies."""
    settings.ZEROMEM_DB_POOL_READ_CHECKS = True
    real = hotsql._segment
    lost = []

    def segment(pgconn):
        if not lost:
            lost.append(1)
            connection.connection.pgconn.finish()  # the socket gone, both statements sent
        return (yield from real(pgconn))

    monkeypatch.setattr(hotsql, "_segment", segment)
    before = len(_reads(tenant_a))
    connection.close()  # back in the pool, as between served requests
    with hotsql.answered_later(), hotsql.riding(_rider()):
        result = services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    assert result.memory.value == "zh-CN" and lost == [1]
    events = _reads(tenant_a)[before:]
    assert [e.outcome for e in events][-1:] == ["ok"] and 1 <= len(events) <= 2
    assert len({e.uid for e in events}) == len(events)
    audit_seal(tenant_id=tenant_a.pk)
    assert audit_verify(tenant_id=tenant_a.pk).ok


def test_without_prepared_statements_the_event_follows_the_read(tenant_a, raw):
    """PgBouncer in transaction mode (DB_PREPARED_STATEMENTS off): nothing is piped."""
    connection.ensure_connection()
    conn = connection.connection
    conn.prepare_threshold = None
    try:
        with RoundTrips() as sent:
            status, _headers, _content = call(LANE, raw, READ)
    finally:
        conn.prepare_threshold = 5
    assert status == "200 OK" and (sent.count, sent.syncs) == (2, 2)


def test_each_tenant_reads_its_own_row_and_writes_its_own_event(tenant_a, tenant_b, raw):
    write(tenant_b, KEY, "fr-FR", subject="bob")
    _key_b, raw_b = make_key(tenant_b)
    for _ in range(3):
        assert call(LANE, raw_b, READ)[0] == "200 OK"
    a_before, b_before = len(_reads(tenant_a)), len(_reads(tenant_b))
    assert b'"value":"zh-CN"' in call(LANE, raw, READ)[2]
    assert b'"value":"fr-FR"' in call(LANE, raw_b, READ)[2]
    assert [e.subject for e in _reads(tenant_a)[a_before:]] == ["u1"]
    assert [e.subject for e in _reads(tenant_b)[b_before:]] == ["bob"]


def test_a_psycopg_error_in_the_pipeline_is_djangos(tenant_a, raw, monkeypatch):
    """A driver error while the pipeline is sent is raised as Django's (503 upstream), and the
    connection is left out of pipeline mode."""

    def broken(pgconn):
        raise psycopg.OperationalError("network gone")
        yield  # pragma: no cover - a generator

    monkeypatch.setattr(hotsql, "_segment", broken)
    with pytest.raises(OperationalError), hotsql.answered_later(), hotsql.riding(_rider()):
        services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    conn = connection.connection
    assert conn.closed or conn.pgconn.pipeline_status == 0  # answers outstanding: closed
    connection.close()  # as a request's end does: the pool drops a closed connection


def test_a_row_made_sensitive_elsewhere_is_read_with_the_connection_out_of_pipeline_mode(tenant_a, raw):
    """Another process wrote KEY sensitive (this one's last_seen still says plain): T1's row
    does not match, so no event rides, and T2's answer is read at once — building the row's
    instance opens its sealed value, and a cold data-key cache loads the key with Django's
    ORM (found by review: while T2 was pending in pipeline mode, a 503)."""
    seen = last_seen._seen[(tenant_a.pk, KEY)]
    write(tenant_a, KEY, "4111 1111", subject="u1", sensitive=True)
    last_seen._seen[(tenant_a.pk, KEY)] = seen  # another process's write: this one never saw it
    keyring.forget_cache()  # the data key not cached here (another process sealed under it)
    before = len(_reads(tenant_a))
    status, _headers, content = call(LANE, raw, READ)
    assert status == "200 OK", (status, content)
    assert b"4111 1111" in content
    assert [e.outcome for e in _reads(tenant_a)[before:]] == ["ok"]
    connection.ensure_connection()
    assert connection.connection.pgconn.pipeline_status == 0
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)


def test_a_sensitive_row_made_elsewhere_stays_unreadable_through_the_lane(tenant_a, raw):
    """The same, three times (before the fix a failed read left last_seen as it was and the
    data key uncached: every later lane read of the key in this process failed)."""
    seen = last_seen._seen[(tenant_a.pk, KEY)]
    write(tenant_a, KEY, "4111 1111", subject="u1", sensitive=True)
    last_seen._seen[(tenant_a.pk, KEY)] = seen
    keyring.forget_cache()
    statuses = [call(LANE, raw, READ)[0] for _ in range(3)]
    assert statuses == ["200 OK"] * 3


def _first_hit_whose_closed_windows_cannot_be_dropped(tenant_a, raw):
    """A lane read that is its key's first hit of the minute, whose counter's ``done`` then
    deletes the closed windows (audit.limits._drop_closed_windows) and fails (lock_timeout on a
    closed window's row locked elsewhere) — after T1 committed the counter and T2 the event.
    (status, the key's counts, the read events written)."""
    from django.db import connections

    from audit import limits
    from audit.models import RateCounter
    from memories.models import ApiKey

    key = ApiKey.objects.get(tenant=tenant_a)
    bucket = f"key:{key.pk}"
    start = int(limits.clock() // 60) * 60  # the minute tests/conftest.py limiter_minute holds
    RateCounter.objects.filter(bucket=bucket).delete()  # the next call is the minute's first
    RateCounter.objects.create(bucket="review-old", window_start=start - 7200, count=1)
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("SELECT 1 FROM audit_ratecounter WHERE bucket = 'review-old' FOR UPDATE")
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '100ms'")
        before = len(_reads(tenant_a))
        status, _headers, _content = call(LANE, raw, READ)
        counts = list(RateCounter.objects.filter(bucket=bucket).values_list("count", flat=True))
        events = [e.outcome for e in _reads(tenant_a)[before:]]
    finally:
        with other.cursor() as cursor:
            cursor.execute("ROLLBACK")
        other.close()
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    return status, counts, events


def test_a_rider_done_that_fails_does_not_count_the_call_twice(tenant_a, raw):
    """An error raised by the counter's ``done`` after the read committed (its housekeeping) is
    not the read's: the call is not counted again (found by review: two units for one
    call)."""
    _status, counts, _events = _first_hit_whose_closed_windows_cannot_be_dropped(tenant_a, raw)
    assert counts == [1], counts


def test_a_read_answered_503_after_its_row_has_no_ok_event(tenant_a, raw):
    """The same call: its event was written as the read committed, and the housekeeping's
    failure is logged, not answered — never an ``ok`` event for a call answered 503 (found by
    review)."""
    status, _counts, events = _first_hit_whose_closed_windows_cannot_be_dropped(tenant_a, raw)
    # Answered: one ok event; not answered: none.
    assert (status, events) in (("200 OK", ["ok"]), ("503 Service Unavailable", [])), (status, events)


LIST = {"name": "memory_list", "arguments": {}}


def test_a_row_that_fails_to_load_leaves_the_connection_usable(tenant_a, raw):
    """T1's row comes back and fails to load (psycopg's loader: a timestamptz of 'infinity',
    which no datetime holds): the read fails, as it did before, and T2's answer is read all
    the same — the connection leaves pipeline mode, and the next call on it is answered
    (found by review: it stayed in pipeline mode, and the next call failed too)."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE memories_memory SET expires_at = 'infinity' WHERE key = %s", [KEY])
    try:
        status, _headers, _content = call(LANE, raw, READ)
        conn = connection.connection
        left = None if conn is None or conn.closed else conn.pgconn.pipeline_status
        following, _headers, _content = call(LANE, raw, LIST)
    finally:
        if connection.connection is not None and not connection.connection.closed:
            connection.connection.close()  # never hand a connection in pipeline mode on
        connection.close()
        with connection.cursor() as cursor:
            cursor.execute("UPDATE memories_memory SET expires_at = NULL WHERE key = %s", [KEY])
    assert status == "500 Internal Server Error"  # as before: the row does not load
    assert left in (None, 0), left
    assert following == "200 OK"
