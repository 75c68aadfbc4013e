"""ZEROMEM_AUDIT_READ_EVENTS_ASYNC: the event of an operation that changed nothing (its own
transaction) may commit without waiting for the WAL flush; an event written with a change never."""

import pytest
from django.db import connection, transaction

from audit import services as audit_services
from audit.models import AuditEvent
from memories import services
from tests.factories import SYSTEM, make_keyed_client, make_tenant

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

KEY = "user:u1:lang"
WAIVER = "set_config('synchronous_commit', 'off', true)"


class Statements:
    """The audit INSERTs run while it is installed (Django's execute wrapper: hotsql then runs
    its statements through Django's cursor too)."""

    def __init__(self):
        self.inserts: list[str] = []

    def __call__(self, execute, sql, params, many, context):
        if sql.startswith('INSERT INTO "audit_auditevent"'):
            self.inserts.append(sql)
        return execute(sql, params, many, context)


def _events(run) -> list[str]:
    watch = Statements()
    with connection.execute_wrapper(watch):
        run()
    return watch.inserts


@pytest.fixture
def tenant():
    tenant = make_tenant("flush")
    services.memory_write(tenant=tenant, actor=SYSTEM, key=KEY, value="zh")
    return tenant


def test_off_by_default_every_event_waits_for_the_flush(tenant):
    inserts = _events(lambda: services.memory_read(tenant=tenant, actor=SYSTEM, key=KEY))
    assert len(inserts) == 1 and WAIVER not in inserts[0]


def test_on_a_read_over_the_api_commits_its_event_unflushed_and_a_write_flushed(tenant, settings):
    settings.ZEROMEM_AUDIT_READ_EVENTS_ASYNC = True
    client, _key = make_keyed_client(tenant)
    read = _events(lambda: client.post("/api/v1/tools/call", {"name": "memory_read", "arguments": {"key": KEY}}))
    assert len(read) == 1 and WAIVER in read[0]
    written = _events(
        lambda: client.post("/api/v1/tools/call", {"name": "memory_write", "arguments": {"key": KEY, "value": "en"}})
    )
    assert len(written) == 1 and WAIVER not in written[0]
    # A refusal changes nothing either: its event is a transaction of its own.
    bad = {"name": "memory_read", "arguments": {"key": "bad key"}}
    refused = _events(lambda: client.post("/api/v1/tools/call", bad))
    assert len(refused) == 1 and WAIVER in refused[0]
    assert list(AuditEvent.objects.filter(tenant=tenant, action="memory.read").values_list("outcome", flat=True)) == [
        "ok",
        "invalid",
    ]


def test_on_a_read_inside_a_transaction_with_a_write_is_flushed_with_it(tenant, settings):
    settings.ZEROMEM_AUDIT_READ_EVENTS_ASYNC = True

    def read_and_write():
        with transaction.atomic():
            services.memory_read(tenant=tenant, actor=SYSTEM, key=KEY)
            services.memory_write(tenant=tenant, actor=SYSTEM, key=KEY, value="en")

    inserts = _events(read_and_write)
    assert len(inserts) == 2 and not any(WAIVER in sql for sql in inserts)


def test_the_waiver_holds_for_the_events_own_transaction_only(tenant, settings):
    """synchronous_commit is off when the event's transaction commits (RETURNING runs before
    the commit) and on again for whatever the connection (pooled: the next request's) runs next."""
    settings.ZEROMEM_AUDIT_READ_EVENTS_ASYNC = True
    sql, _columns = audit_services._insert_sql("postgresql", True)
    assert sql.endswith('RETURNING "audit_auditevent"."id", ' + WAIVER)
    audit_services.audit_record(tenant=tenant, actor=SYSTEM, action="memory.read", outcome="ok", target=KEY)
    event = AuditEvent.objects.filter(tenant=tenant, action="memory.read").latest("id")
    assert event.target == KEY and event.digest  # stored like any other event
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"
        cursor.execute("CREATE TEMP TABLE flush_probe (id int)")
        cursor.execute("INSERT INTO flush_probe VALUES (1) RETURNING id, " + WAIVER)
        assert cursor.fetchone()[1] == "off"  # in force when that statement's transaction committed
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"
        cursor.execute("DROP TABLE flush_probe")


def test_on_a_write_over_a_live_memory_outside_a_transaction_is_flushed(tenant, settings, monkeypatch):
    """Unwatched, outside any transaction, the write's UPDATE and version row go with its event
    as one statement, a transaction of its own (memories.services.memories._write_over_as_read):
    that event carries a change, so its commit waits for the flush."""
    from zeromem.kernel import hotsql

    settings.ZEROMEM_AUDIT_READ_EVENTS_ASYNC = True
    sent: list[str] = []
    send = hotsql._send
    monkeypatch.setattr(hotsql, "_send", lambda sql, *args, **kwargs: sent.append(sql) or send(sql, *args, **kwargs))
    services.memory_write(tenant=tenant, actor=SYSTEM, key=KEY, value="en")
    (carried,) = [sql for sql in sent if 'INSERT INTO "audit_auditevent"' in sql]
    assert 'UPDATE "memories_memory"' in carried  # the one statement (not the locked path)
    assert WAIVER not in carried
