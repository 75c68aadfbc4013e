"""A tool read's audit event commits while its answer is built (zeromem/kernel/hotsql.py, "A
statement answered later"; the tool-call lane): its INSERT is sent, the result, its JSON and
the response are built meanwhile, and its answer is read before anything is counted or sent.
An event that fails to commit is answered exactly as the Django view answers it (which waits
for it), and nothing of the memory leaves.

Transactional tests: the lane sends an event later only when it is a transaction of its own
(a test inside a transaction never does)."""

import json

import pytest
from django.db import DataError, connection
from django.db.backends.base.base import BaseDatabaseWrapper

from audit.models import AuditEvent
from audit.services import events_written
from memories.api import lane
from tests.factories import make_key, write
from tests.helpers import other_session
from tests.test_tool_lane import DJANGO, LANE, call, seen_by_client
from zeromem.kernel import hotsql

pytestmark = [
    pytest.mark.usefixtures("limiter_minute"),  # no minute's first hit (its DELETE reads the event early)
    pytest.mark.postgres,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="statements are sent later on PostgreSQL only"),
    pytest.mark.django_db(transaction=True),
]

KEY = "user:u1:lang"


def _read(key: str = KEY) -> dict:
    return {"name": "memory_read", "arguments": {"key": key}}


def _events(tenant, action: str) -> list[tuple]:
    return list(
        AuditEvent.objects.filter(tenant=tenant, action=action)
        .order_by("id")
        .values_list("outcome", "target", "subject", "version", "surface", "actor_kind")
    )


@pytest.fixture
def pending_seen(monkeypatch):
    """Whether a statement was waiting for its answer each time the lane rendered one."""
    seen = []
    compact_json = lane.compact_json

    def rendering(data):
        seen.append(bool(getattr(connection, hotsql._LATER, None)))
        return compact_json(data)

    monkeypatch.setattr(lane, "compact_json", rendering)
    return seen


def test_a_reads_event_is_committed_while_its_answer_is_rendered(tenant_a, pending_seen):
    write(tenant_a, KEY, "zh-CN")
    _key, raw = make_key(tenant_a)
    assert call(DJANGO, raw, _read())[0] == "200 OK"  # the process verifies the key once
    pending_seen.clear()
    for n in range(3):
        status, _headers, content = call(LANE, raw, _read())
        assert (status, json.loads(content)["value"]) == ("200 OK", "zh-CN")
        assert len(_events(tenant_a, "memory.read")) == n + 2
    assert pending_seen == [True, True, True]
    assert not getattr(connection, hotsql._LATER, None)  # nothing left waiting on the connection
    # A read of a key with no memory: its event (not_found) too.
    status, _headers, content = call(LANE, raw, _read("user:u1:none"))
    assert (status, json.loads(content)["status"]) == ("200 OK", "not_found")
    assert pending_seen[-1] is True
    assert _events(tenant_a, "memory.read")[-1][:2] == ("not_found", "user:u1:none")


def test_a_refused_calls_event_is_committed_while_its_refusal_is_rendered(tenant_a, pending_seen):
    """A call refused while it is parsed (an unknown argument) records a ``tool.call`` event:
    sent later too when it is the call's last statement (a tool that does not ride the rate
    counter, which is taken before). A riding tool's refusal waits for the counter still held,
    which goes first, alone: its event is sent at once."""
    _key, raw = make_key(tenant_a)
    assert call(DJANGO, raw, _read())[0] == "200 OK"
    before = len(_events(tenant_a, "tool.call"))
    pending_seen.clear()
    for name, arguments in (("memory_list", {"prefix": "user:"}), ("memory_read", {"key": KEY})):
        status, _headers, content = call(LANE, raw, {"name": name, "arguments": {**arguments, "nope": 1}})
        assert status == "400 Bad Request" and json.loads(content)["error"]["field"] == "nope"
    assert pending_seen == [True, False]
    assert len(_events(tenant_a, "tool.call")) == before + 2
    assert not getattr(connection, hotsql._LATER, None)


def test_a_statement_is_counted_done_only_once_its_answer_is_read():
    connection.ensure_connection()
    done = []
    with hotsql.answered_later():
        assert hotsql.fetchone_later("SELECT 1", [], done=lambda: done.append(1))
        assert done == []
    assert done == [1]


def test_a_statement_that_fails_later_is_the_error_raised_whatever_came_after_it():
    """Had it failed where it was sent, nothing after it would have run: its error is the one
    raised (the block's chained to it), and the connection is free again."""
    connection.ensure_connection()
    with pytest.raises(DataError) as raised:
        with hotsql.answered_later():
            assert hotsql.fetchone_later("SELECT 1 / %s", [0])
            raise ValueError("what came after")
    assert isinstance(raised.value.__cause__, ValueError)
    assert hotsql.fetchone("SELECT 2", []) == (2,)


@pytest.fixture
def events_refused():
    """A trigger that cancels the INSERT of a read's event of the key ``fact:refused`` (as a
    statement timeout would): the read's event fails after its SELECT answered."""
    table = connection.ops.quote_name(AuditEvent._meta.db_table)
    with other_session(autocommit=True) as admin:
        admin.execute(
            "CREATE FUNCTION zm_test_refuse_event() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'refused by the test' USING ERRCODE = 'query_canceled'; END $$"
        )
        admin.execute(
            f"CREATE TRIGGER zm_test_refuse_event BEFORE INSERT ON {table} FOR EACH ROW "
            "WHEN (NEW.target = 'fact:refused' AND NEW.action = 'memory.read') EXECUTE FUNCTION zm_test_refuse_event()"
        )
        try:
            yield
        finally:
            connection.close()
            admin.execute(f"DROP TRIGGER zm_test_refuse_event ON {table}")
            admin.execute("DROP FUNCTION zm_test_refuse_event()")


def test_a_read_whose_event_fails_is_answered_as_the_django_view_answers_it(
    tenant_a, tenant_b, pending_seen, events_refused
):
    """The Django view waits for the event and answers its failure (503, retry); the lane,
    which rendered the value meanwhile, answers the same and sends none of it."""
    for tenant in (tenant_a, tenant_b):
        write(tenant, "fact:refused", "the secret value")
    _key_a, raw_a = make_key(tenant_a)
    _key_b, raw_b = make_key(tenant_b)
    for raw in (raw_a, raw_b):
        assert call(DJANGO, raw, _read())[0] == "200 OK"
    pending_seen.clear()

    django_answer = seen_by_client(*call(DJANGO, raw_a, _read("fact:refused")))
    lane_answer = seen_by_client(*call(LANE, raw_b, _read("fact:refused")))

    assert lane_answer[:3] == django_answer[:3]
    assert lane_answer[0] == "503 Service Unavailable" and lane_answer[1]["Retry-After"] == "2"
    assert "the secret value" not in lane_answer[2]
    # The value was rendered while the event was pending, then the error answer in its place.
    assert pending_seen == [True, False]
    assert _events(tenant_b, "memory.read")[-1][1] != "fact:refused"  # no event: nothing committed
    # The connection is fine for the next request.
    status, _headers, content = call(LANE, raw_b, _read())
    assert status == "200 OK"


def test_an_event_that_failed_is_not_counted_as_written(tenant_a, events_refused):
    """events_written() (a surface running several operations compares it) counts an event
    sent later once it has committed (found by review: it was counted when sent)."""
    write(tenant_a, "fact:refused", "v")
    _key, raw = make_key(tenant_a)
    assert call(DJANGO, raw, _read())[0] == "200 OK"
    rows, before = AuditEvent.objects.count(), events_written()
    assert call(LANE, raw, _read("fact:refused"))[0] == "503 Service Unavailable"
    assert (AuditEvent.objects.count(), events_written()) == (rows, before)
    assert call(LANE, raw, _read())[0] == "200 OK"
    assert (AuditEvent.objects.count(), events_written()) == (rows + 1, before + 1)


@pytest.fixture
def django_cursor_while_pending(monkeypatch):
    """Every Django cursor made, or autocommit changed, while a statement is pending (it would
    find the connection busy)."""
    seen = []
    cursor, set_autocommit = BaseDatabaseWrapper._cursor, BaseDatabaseWrapper.set_autocommit

    def watched(name, method):
        def call_(self, *args, **kwargs):
            if getattr(self, hotsql._LATER, None):
                seen.append(name)
            return method(self, *args, **kwargs)

        return call_

    monkeypatch.setattr(BaseDatabaseWrapper, "_cursor", watched("cursor", cursor))
    monkeypatch.setattr(BaseDatabaseWrapper, "set_autocommit", watched("autocommit", set_autocommit))
    return seen


# Every cheap tool's answers: success, not found, conflict, refusals (from the review).
CALLS = [
    _read(),
    _read("user:u1:none"),
    {"name": "memory_read", "arguments": {"key": KEY, "max_chars": 2}},
    {"name": "memory_read", "arguments": {"key": "  "}},
    {"name": "memory_read", "arguments": {"key": KEY, "nope": 1}},
    {"name": "memory_list", "arguments": {"prefix": "user:"}},
    {"name": "memory_list", "arguments": {"prefix": "user:", "limit": 0}},
    {"name": "memory_delete", "arguments": {"key": "user:u1:none"}},
    {"name": "memory_delete", "arguments": {"key": "user:u1:del"}},
    {"name": "memory_write", "arguments": {"key": "user:u1:w", "value": "x"}},
    {"name": "memory_write", "arguments": {"key": "user:u1:w", "value": "y"}},
    {"name": "memory_write", "arguments": {"key": "", "value": "y"}},
    {"name": "memory_update", "arguments": {"key": "user:u1:w", "value": "z", "expected_version": 1}},
    {"name": "memory_update", "arguments": {"key": "user:u1:w", "value": "z"}},
    {"name": "memory_update", "arguments": {"key": "user:u1:none", "value": "z"}},
    {"name": "memory_summarize", "arguments": {"prefix": ""}},
    {"name": "memory_summarize", "arguments": {"prefix": "user:u1:"}},
    {"name": "nope", "arguments": {}},
    {"name": ["x"]},
    {"type": "function", "function": {"name": "memory_list", "arguments": "{}"}},
]


def test_nothing_but_hotsql_touches_the_connection_while_a_statement_is_pending(tenant_a, django_cursor_while_pending):
    write(tenant_a, KEY, "zh-CN")
    write(tenant_a, "user:u1:del", "x")
    _key, raw = make_key(tenant_a)
    assert call(DJANGO, raw, _read())[0] == "200 OK"
    statuses = [call(LANE, raw, body)[0] for body in CALLS]
    assert django_cursor_while_pending == []
    assert statuses.count("200 OK") >= 10 and any(s.startswith("400") for s in statuses)
