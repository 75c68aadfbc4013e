"""The audited read's own Python (README "The hot path", `manage.py bench_read_cpu`): the
memory it builds from its row is the one the ORM builds, and the cursors hotsql keeps per
connection and statement are dropped when their connection or statement fails."""

import threading

import pytest
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections, transaction
from django.db.models.signals import post_init

from audit.models import AuditEvent
from audit.services import _ip
from memories import selectors, services
from memories.models import Memory
from tests.factories import SYSTEM, write
from zeromem.kernel import hotsql

KEY = "user:u1:pref_lang"


def _state(m: Memory) -> dict:
    fields = {k: v for k, v in m.__dict__.items() if k != "_state"}
    return {"fields": fields, "adding": m._state.adding, "db": m._state.db, "type": type(m)}


@pytest.mark.parametrize("sensitive", [False, True])
def test_the_read_builds_the_memory_the_orm_builds(tenant_a, sensitive, monkeypatch):
    write(tenant_a, KEY, {"lang": "zh-CN", "note": "简体"}, sensitive=sensitive, tags=["a"], subject="u1")
    read = selectors.memory_get_live(tenant=tenant_a, key=KEY)
    orm = Memory.objects.live().get(tenant=tenant_a, key=KEY)
    assert _state(read) == _state(orm)
    assert read.value == {"lang": "zh-CN", "note": "简体"}  # a sealed one opened
    # And the same as Memory.from_db builds from the same row.
    monkeypatch.setattr(selectors, "_built_directly", lambda: False)
    assert _state(selectors.memory_get_live(tenant=tenant_a, key=KEY)) == _state(read)
    # The row a write locks goes the same way.
    with transaction.atomic():
        locked = selectors.memory_lock_current(tenant=tenant_a, key=KEY)
    assert _state(locked) == _state(read)


def test_a_memory_read_while_an_init_receiver_listens_comes_through_from_db(tenant_a):
    write(tenant_a, KEY, "zh-CN")
    seen = []

    def receiver(sender, instance, **kwargs):
        seen.append(instance)

    post_init.connect(receiver, sender=Memory)
    try:
        read = selectors.memory_get_live(tenant=tenant_a, key=KEY)
    finally:
        post_init.disconnect(receiver, sender=Memory)
    assert seen == [read] and read.value == "zh-CN"


def _kept() -> dict:
    return hotsql.kept_cursors(connections[DEFAULT_DB_ALIAS].connection)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="cursors are kept only for prepared statements")
@pytest.mark.django_db(transaction=True)  # the connection is closed and opened again
def test_a_statement_runs_again_on_its_kept_cursor_until_its_connection_or_statement_fails(tenant_a, settings):
    # Reads of two statements each (a read of a key seen lately is one: test_read_one_statement.py).
    settings.ZEROMEM_READ_ONE_STATEMENT = False
    write(tenant_a, KEY, "zh-CN")
    services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    kept = dict(_kept())
    assert len(kept) >= 2  # the SELECT and the audit INSERT
    services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    again = _kept()
    assert all(again[sql] is cursor for sql, cursor in kept.items())

    # A statement that fails drops its cursor; the next one works on a new cursor.
    bad = "SELECT 1 / %s"
    with pytest.raises(DatabaseError):
        hotsql.fetchone(bad, [0])
    assert bad not in _kept()
    assert hotsql.fetchone(bad, [1]) == (1,)

    # A new connection: new cursors, the same answers. Closing only Django's side hands the
    # connection back to the pool, which may hand the same server connection out again (its
    # kept cursors are still good there), so the server connection ends first.
    connection.connection.close()
    connection.close()
    read = services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    assert read.memory.value == "zh-CN"
    fresh = [c for c in _kept().values() if c.connection is connection.connection]
    assert len(fresh) >= 2 and not any(c is old for c in fresh for old in kept.values())
    assert AuditEvent.objects.filter(tenant=tenant_a, action="memory.read").count() == 3


def test_a_client_address_is_stored_as_parsed_each_time():
    assert _ip("2001:0db8:0000:0000:0000:0000:0000:0001") == "2001:db8::1"
    assert _ip("2001:0db8:0000:0000:0000:0000:0000:0001") == "2001:db8::1"  # from the cache
    assert _ip("203.0.113.7") == "203.0.113.7"
    assert _ip("not an address") is None and _ip("not an address") is None
    assert _ip("") is None and _ip(None) is None


@pytest.mark.skipif(connection.vendor != "postgresql", reason="cursors are kept only for prepared statements")
@pytest.mark.django_db(transaction=True)  # each read checks a connection out of the pool
def test_each_pooled_connection_keeps_its_cursors_from_one_checkout_to_the_next(tenant_a, monkeypatch):
    """The pool hands its idle connections out in turn, so a request rarely gets the one it
    had last: the cursors are kept on the connection, not the thread's wrapper, and a read
    makes none once every pooled connection has run its statements (until session 26 each
    read made two)."""
    write(tenant_a, KEY, "zh-CN")
    rounds = 2 * connection.pool.max_size
    for _ in range(rounds):  # every pooled connection runs the read's statements once
        connection.close()
        services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    made = []
    server_bound = hotsql._server_bound
    me = threading.get_ident()  # (another thread may run statements meanwhile: the slots' renewal)
    monkeypatch.setattr(
        hotsql, "_server_bound", lambda conn: (threading.get_ident() == me and made.append(conn)) or server_bound(conn)
    )
    seen = set()
    for _ in range(rounds):
        connection.close()
        assert services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY).memory.value == "zh-CN"
        seen.add(id(connection.connection))
    assert len(seen) > 1  # the reads went to several connections
    assert made == []
