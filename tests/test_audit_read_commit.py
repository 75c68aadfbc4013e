"""ZEROMEM_AUDIT_READS_ASYNC_COMMIT: an agent's read commits its event without waiting for
PostgreSQL's WAL flush — the event still written, in the same one statement's message — and
nothing else does (writes, staff views, the setting off, SQLite)."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from audit.models import AuditEvent
from audit.services import ASYNC_COMMIT_ACTIONS

ASYNC = "SELECT set_config('synchronous_commit', 'off', true); INSERT INTO \"audit_auditevent\""


def _statements(call) -> list[str]:
    with CaptureQueriesContext(connection) as queries:
        call()
    return [q["sql"] for q in queries.captured_queries]


def _event_inserts(statements: list[str]) -> list[str]:
    return [sql for sql in statements if 'INSERT INTO "audit_auditevent"' in sql]


@pytest.mark.django_db(transaction=True)
def test_an_agents_reads_commit_their_events_asynchronously_and_nothing_else_does(api, settings):
    settings.ZEROMEM_AUDIT_READS_ASYNC_COMMIT = True
    postgres = connection.vendor == "postgresql"

    write = _event_inserts(_statements(lambda: api.call("memory_write", key="user:u1:pref_lang", value="zh-CN")))
    assert write and not [sql for sql in write if "synchronous_commit" in sql]

    for tool, arguments, outcome in [
        ("memory_read", {"key": "user:u1:pref_lang"}, "ok"),
        ("memory_read", {"key": "user:u1:missing"}, "not_found"),
        ("memory_search", {"query": "pref lang"}, "ok"),
        ("memory_list", {"prefix": "user:u1:"}, "ok"),
    ]:
        before = AuditEvent.objects.count()
        inserts = _event_inserts(_statements(lambda t=tool, a=arguments: api.call(t, **a)))
        assert len(inserts) == 1
        assert inserts[0].startswith(ASYNC) == postgres, (tool, inserts[0][:120])
        # The event is there all the same, and right.
        event = AuditEvent.objects.latest("id")
        assert AuditEvent.objects.count() == before + 1
        assert event.action in ASYNC_COMMIT_ACTIONS and event.outcome == outcome

    settings.ZEROMEM_AUDIT_READS_ASYNC_COMMIT = False
    (insert,) = _event_inserts(_statements(lambda: api.call("memory_read", key="user:u1:pref_lang")))
    assert "synchronous_commit" not in insert


def test_a_read_inside_a_transaction_is_part_of_it_and_durable_with_it(api, settings):
    # A test's own transaction (as a batch's): the event is one more statement of it, and
    # commits (or not) with it; no setting of its own.
    settings.ZEROMEM_AUDIT_READS_ASYNC_COMMIT = True
    api.call("memory_write", key="user:u1:pref_lang", value="zh-CN")
    (insert,) = _event_inserts(_statements(lambda: api.call("memory_read", key="user:u1:pref_lang")))
    assert "synchronous_commit" not in insert


def test_only_an_agents_reads_may_commit_asynchronously():
    # A staff member's view or reveal of a memory stays as durable as any write.
    assert ASYNC_COMMIT_ACTIONS == {"memory.read", "memory.list", "memory.search", "memory.recall", "memory.history"}
