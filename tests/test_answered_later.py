"""A tool read's audit event commits while its answer is built (zeromem/kernel/hotsql.py, "A
statement answered later"; the tool-call lane): its INSERT is sent, the result, its JSON and
the response are built meanwhile, and its answer is read before anything is counted or sent.
An event that fails to commit is answered exactly as the Django view answers it (which waits
for it), and nothing of the memory leaves.

Transactional tests: the lane sends an event later only when it is a transaction of its own
(a test inside a transaction never does)."""

import json

import psycopg
import pytest
from django.db import connection

from audit.models import AuditEvent
from memories.api import lane
from tests.factories import make_key, write
from tests.test_tool_lane import DJANGO, LANE, call, seen_by_client
from zeromem.kernel import hotsql

pytestmark = [
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


def test_a_refused_calls_event_then_the_rate_counter_alone_go_in_order(tenant_a, pending_seen):
    """A call refused while it is parsed (an unknown argument) records its event before any
    read: sent later, then read first when the rate counter, held for a read that never came,
    goes alone as the riding block ends."""
    _key, raw = make_key(tenant_a)
    assert call(DJANGO, raw, _read())[0] == "200 OK"
    before = len(_events(tenant_a, "tool.call"))
    status, _headers, content = call(LANE, raw, {"name": "memory_read", "arguments": {"key": KEY, "nope": 1}})
    assert status == "400 Bad Request" and json.loads(content)["error"]["field"] == "nope"
    assert len(_events(tenant_a, "tool.call")) == before + 1
    assert not getattr(connection, hotsql._LATER, None)


@pytest.fixture
def events_refused():
    """A trigger that cancels the INSERT of a read's event of the key ``fact:refused`` (as a
    statement timeout would): the read's event fails after its SELECT answered."""
    table = connection.ops.quote_name(AuditEvent._meta.db_table)
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params, autocommit=True) as admin:
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
