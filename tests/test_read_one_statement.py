"""A read of a key this process read or wrote lately sends its audit event with its SELECT, as
one statement (zeromem/kernel/hotsql.py "An event that rides the read it records";
memories/services/last_seen.py): the event is written only if the row still holds the version
and subject last seen, and is then the event the read would have written after it. A row that
changed, went or turned sensitive is read as it is, and its event (what the read found) follows
as before. The memory read always comes from the database.

Transactional tests: the event rides only a read that is a transaction of its own."""

import contextlib

import pytest
from django.db import OperationalError, connection, transaction

from audit import chain
from audit.models import AuditEvent
from audit.services import audit_seal, event_fields, events_written
from audit.verify import audit_verify
from memories import services
from memories.models import Memory
from memories.services import last_seen, usage
from tests.factories import SYSTEM, write
from tests.helpers import RoundTrips
from zeromem.kernel import hotsql
from zeromem.kernel.errors import NotFound

pytestmark = [
    pytest.mark.usefixtures("limiter_minute"),  # one minute: no closed windows dropped midway
    pytest.mark.postgres,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="one statement on PostgreSQL only"),
    pytest.mark.django_db(transaction=True),
]

KEY = "user:u1:lang"
FIELDS = ("outcome", "target", "subject", "version", "surface", "actor_kind", "actor_id", "count", "detail")


def _read(tenant, key: str = KEY):
    """The service's read, as a served request runs it (no transaction), and what it sent."""
    with RoundTrips() as sent:
        try:
            result = services.memory_read(tenant=tenant, actor=SYSTEM, key=key)
        except NotFound:
            result = None
    return result, sent


@pytest.fixture(autouse=True)
def _prepared(tenant_a):
    """Each statement of a read prepared on the connection (its first run is two round trips):
    the one with the event, the SELECT alone, the event alone."""
    write(tenant_a, "warm:up", 1)
    for key in ("warm:up", "warm:up", "warm:none"):
        with contextlib.suppress(NotFound):
            services.memory_read(tenant=tenant_a, actor=SYSTEM, key=key)
    last_seen.clear()
    services.memory_read(tenant=tenant_a, actor=SYSTEM, key="warm:up")


def _reads(tenant) -> list[dict]:
    events = AuditEvent.objects.filter(tenant=tenant, action="memory.read").exclude(target__startswith="warm:")
    return list(events.order_by("id").values())


def _change_elsewhere(memory: Memory, **columns) -> None:
    """What another process's write does to the row (this process never sees it)."""
    sets = ", ".join(f"{name} = %s" for name in columns)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE memories_memory SET {sets} WHERE id = %s", [*columns.values(), memory.pk])  # noqa: S608


def test_a_read_of_a_key_written_here_is_one_round_trip_with_its_event(tenant_a, settings):
    m = write(tenant_a, KEY, "zh-CN", subject="u1")
    written = events_written()
    result, sent = _read(tenant_a)
    assert result.memory.value == "zh-CN" and result.memory.version == m.version
    assert sent.count == 1
    assert events_written() == written + 1
    (event,) = _reads(tenant_a)
    assert (event["outcome"], event["target"], event["subject"], event["version"]) == ("ok", KEY, "u1", m.version)
    # The same event, field for field, as a read that sends it after its SELECT.
    settings.ZEROMEM_READ_ONE_STATEMENT = False
    _again, sent_after = _read(tenant_a)
    assert sent_after.count == 2
    first, second = _reads(tenant_a)
    assert {f: first[f] for f in FIELDS} == {f: second[f] for f in FIELDS}
    # Its digest covers what it holds, and the log verifies once sealed.
    assert first["digest"] == chain.digest(event_fields(first))
    audit_seal(tenant_id=tenant_a.pk)
    assert audit_verify(tenant_id=tenant_a.pk).ok


def test_reads_again_are_one_round_trip_each(tenant_a):
    write(tenant_a, KEY, "zh-CN")
    last_seen.clear()  # as in another process: first read, then seen
    _result, first = _read(tenant_a)
    assert first.count == 2
    for _ in range(3):
        result, sent = _read(tenant_a)
        assert result.memory.value == "zh-CN" and sent.count == 1
    assert len(_reads(tenant_a)) == 4


def test_a_row_changed_elsewhere_is_read_as_it_is_and_its_event_says_what_was_read(tenant_a):
    m = write(tenant_a, KEY, "zh-CN", subject="u1")
    _change_elsewhere(m, value='"de-DE"', version=m.version + 1)
    result, sent = _read(tenant_a)
    assert result.memory.value == "de-DE" and result.memory.version == m.version + 1
    assert sent.count == 2  # the event with the SELECT was not written; the read's own followed
    (event,) = _reads(tenant_a)
    assert (event["outcome"], event["version"]) == ("ok", m.version + 1)
    # Seen now: the next read is one statement again.
    result, sent = _read(tenant_a)
    assert sent.count == 1 and result.memory.version == m.version + 1
    assert [e["version"] for e in _reads(tenant_a)] == [m.version + 1] * 2


def test_a_subject_changed_elsewhere_is_in_the_event(tenant_a):
    m = write(tenant_a, KEY, "zh-CN", subject="u1")
    _change_elsewhere(m, subject="u2")  # same version
    result, sent = _read(tenant_a)
    assert result.memory.subject == "u2" and sent.count == 2
    (event,) = _reads(tenant_a)
    assert (event["subject"], event["version"]) == ("u2", m.version)


def test_a_memory_gone_elsewhere_is_not_found_and_audited_so(tenant_a):
    m = write(tenant_a, KEY, "zh-CN")
    _change_elsewhere(m, deleted_at=m.updated_at)
    result, sent = _read(tenant_a)
    assert result is None and sent.count == 2
    assert [(e["outcome"], e["version"]) for e in _reads(tenant_a)] == [("not_found", None)]
    assert last_seen.expected(tenant_a.pk, KEY) is None


def test_an_expired_memory_is_not_found(tenant_a):
    m = write(tenant_a, KEY, "zh-CN", ttl_seconds=3600)
    _change_elsewhere(m, expires_at=m.updated_at)  # expired since (no new version)
    result, sent = _read(tenant_a)
    assert result is None and [e["outcome"] for e in _reads(tenant_a)] == ["not_found"]


def test_a_sensitive_memory_sends_its_event_after_the_read(tenant_a):
    write(tenant_a, KEY, "zh-CN", sensitive=True)
    assert last_seen.expected(tenant_a.pk, KEY) is None
    for _ in range(2):
        result, sent = _read(tenant_a)
        assert result.memory.value == "zh-CN" and sent.count == 2
    assert last_seen.expected(tenant_a.pk, KEY) is None
    assert [e["outcome"] for e in _reads(tenant_a)] == ["ok", "ok"]


def test_each_tenant_reads_its_own_row_and_writes_its_own_event(tenant_a, tenant_b):
    a = write(tenant_a, KEY, "zh-CN", subject="alice")
    b = write(tenant_b, KEY, "fr-FR", subject="bob")
    write(tenant_b, KEY, "fr-CA", subject="bob")  # B's row is at another version
    result, sent = _read(tenant_b)
    assert result.memory.value == "fr-CA" and result.memory.tenant_id == tenant_b.pk and sent.count == 1
    result, sent = _read(tenant_a)
    assert result.memory.value == "zh-CN" and sent.count == 1
    assert [(e["subject"], e["version"]) for e in _reads(tenant_a)] == [("alice", a.version)]
    assert [(e["subject"], e["version"]) for e in _reads(tenant_b)] == [("bob", b.version + 1)]


def test_inside_a_transaction_the_event_follows_the_read(tenant_a):
    write(tenant_a, KEY, "zh-CN")
    with RoundTrips() as sent, transaction.atomic():
        result = services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    assert result.memory.value == "zh-CN" and sent.count == 4  # BEGIN, the SELECT, the event, COMMIT
    assert len(_reads(tenant_a)) == 1


def test_off_every_read_sends_its_event_after_its_select(tenant_a, settings):
    settings.ZEROMEM_READ_ONE_STATEMENT = False
    write(tenant_a, KEY, "zh-CN")
    for _ in range(2):
        _result, sent = _read(tenant_a)
        assert sent.count == 2


def test_with_the_rate_counter_riding_the_event_is_made_once_and_piped(tenant_a, settings, monkeypatch):
    """A tool read without Redis: the counter rides the SELECT, so the event cannot go in the
    same statement (its row lock would be held through the event's flush): it goes in the same
    round trip, as a transaction of its own (zeromem/kernel/hotsql.py "A read and its event in
    one round trip"). The event is made once — not made for the SELECT, dropped and made
    again."""
    from audit import services as audit_services
    from tests.factories import make_key
    from tests.test_tool_lane import LANE, call

    settings.ZEROMEM_API_KEY_CACHE_SECONDS = 10
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 10_000
    settings.ZEROMEM_TOOL_LANE = True
    settings.ZEROMEM_USAGE_FLUSH_SECONDS = 3600  # as served: tokens-returned totals written now and then
    _key, raw = make_key(tenant_a)
    write(tenant_a, KEY, "zh-CN")
    read = {"name": "memory_read", "arguments": {"key": KEY}}
    for _ in range(2):  # the key verified by Django, then the lane's statements prepared
        assert call(LANE, raw, read)[0] == "200 OK"
    assert last_seen.expected(tenant_a.pk, KEY) is not None
    made = []
    statement = audit_services._event_statement
    monkeypatch.setattr(audit_services, "_event_statement", lambda *a, **k: made.append(1) or statement(*a, **k))
    with RoundTrips() as sent:
        status, _headers, content = call(LANE, raw, read)
    assert status == "200 OK" and b'"value":"zh-CN"' in content
    # The counter with the SELECT, and the event, sent together: two transactions, one round trip.
    assert made == [1] and (sent.count, sent.syncs) == (1, 2)
    assert len(_reads(tenant_a)) == 3
    usage.flush()  # the totals held back, while the tenant is there


@pytest.fixture
def pool_checks(settings):
    """The pool's own checks (its empty query) run for this thread's checkouts."""
    from tests.test_dbpool import _Checks

    settings.ZEROMEM_USAGE_FLUSH_SECONDS = 3600
    usage.flush()
    connection.ensure_connection()
    counted = _Checks()
    yield counted
    counted.restore()


@pytest.mark.parametrize("one_statement", [False, True])
def test_with_read_events_async_the_read_is_still_its_connections_check(tenant_a, settings, pool_checks, one_statement):
    """ZEROMEM_AUDIT_READ_EVENTS_ASYNC: the event, built before the read, asked the connection
    whether it was in autocommit — checking one out, with the pool's check, before the read
    that would have been the check (found by review). Its flush-waived INSERT rides too."""
    settings.ZEROMEM_AUDIT_READ_EVENTS_ASYNC = True
    settings.ZEROMEM_READ_ONE_STATEMENT = one_statement
    write(tenant_a, KEY, "zh-CN", subject="u1")
    services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)  # statements prepared
    before = pool_checks.count
    connection.close()  # as a served request: the connection back in the pool
    result = services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    assert result.memory.value == "zh-CN" and len(_reads(tenant_a)) == 2
    assert pool_checks.count == before


def test_a_plain_row_sealed_and_shredded_elsewhere_is_one_not_found_event(tenant_a):
    """Sealed elsewhere without a new version (the re-encryption job), then its subject
    forgotten: the riding event expects the row plain, so it is not written, and the read is
    one not_found event (without that condition: an ok event and a not_found one)."""
    m = write(tenant_a, KEY, "zh-CN", subject="u1")
    assert last_seen.expected(tenant_a.pk, KEY) == (m.version, "u1")
    envelope = '{"zmenc": 1, "k": 987654321, "c": "AAAA"}'  # its data key is gone: erased
    with connection.cursor() as cursor:
        cursor.execute("UPDATE memories_memory SET sensitive = true, value = %s::jsonb WHERE id = %s", [envelope, m.pk])
    with contextlib.suppress(NotFound):
        services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    assert [e["outcome"] for e in _reads(tenant_a)] == ["not_found"]


@pytest.mark.parametrize("committed", [False, True])
def test_a_read_whose_connection_dies_goes_again_without_its_event(tenant_a, monkeypatch, settings, committed):
    """The read's statement is its connection's check; a dead connection sends the read again
    on a checked one — the SELECT alone, its event following. Had the statement run (committed)
    before its answer was lost, the read has two events with their own uids, and the log still
    verifies; never one event copied (same uid: a copy the verifier reports as tampering)."""
    settings.DB_POOL_READ_CHECKS = True
    write(tenant_a, KEY, "zh-CN", subject="u1")
    services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    before = len(_reads(tenant_a))
    real = hotsql._execute
    sent = []

    def execute(sql, params, fetch, db):
        sent.append(sql)
        if len(sent) == 1:
            if committed:
                real(sql, params, fetch, db)  # it runs and commits; its answer is lost below
            db.connection.close()  # the connection dead: before it ran, or with its answer lost
            raise OperationalError("server closed the connection unexpectedly")
        return real(sql, params, fetch, db)

    monkeypatch.setattr(hotsql, "_execute", execute)
    connection.close()  # the read is the first statement on its connection
    result = services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    monkeypatch.undo()
    assert result.memory.value == "zh-CN"
    assert "zm_event" in sent[0] and "zm_event" not in sent[1]  # the SELECT alone, then its event
    events = _reads(tenant_a)[before:]
    assert len(events) == (2 if committed else 1)
    assert len({e["uid"] for e in events}) == len(events)
    audit_seal(tenant_id=tenant_a.pk)
    assert audit_verify(tenant_id=tenant_a.pk).ok
