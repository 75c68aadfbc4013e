"""The checks of a pooled connection (zeromem/dbpool.py). A read first in a request is its
connection's check (DB_POOL_READ_CHECKS): no empty query before it, and on a dead connection it
runs again on a checked one. The opt-in DB_POOL_CHECK_FRESH_SECONDS: no round trip for a
connection checked out a moment ago whose socket has nothing to read, the empty query for any
other, a connection whose backend has exited refused — and by default Django's own check (the
empty query at every checkout) left in place for everything but such a read."""

import json
import socket
import tempfile
import threading
import time

import psycopg
import pytest
from django.db import DataError, OperationalError, connection
from django.db.backends.signals import connection_created
from django.test import Client
from psycopg import pq
from psycopg_pool import ConnectionPool

from audit import limits
from audit.models import AuditEvent
from memories.models import Memory
from tests.factories import make_key
from tests.helpers import audit_tables_may_be_flushed, other_session
from tests.test_tool_lane import LANE, call
from zeromem import dbpool
from zeromem.dbpool import FreshCheck, SkippableCheck, fresh_check_installed
from zeromem.kernel import hotsql

pytestmark = [pytest.mark.postgres, pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's pool")]


def _own_connection() -> psycopg.Connection:
    return other_session(autocommit=True)


class _Sent:
    """The messages ``conn`` sends in the block (libpq's protocol trace)."""

    def __init__(self, conn):
        self.conn = conn

    def __enter__(self):
        self._file = tempfile.TemporaryFile(mode="w+")
        self.conn.pgconn.trace(self._file.fileno())
        self.conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        return self

    def __exit__(self, *exc):
        self.conn.pgconn.untrace()
        self._file.seek(0)
        self.messages = [line for line in self._file.read().splitlines() if line.startswith("F\t")]
        self._file.close()


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(dbpool, "time", clock)
    return clock


def test_a_connection_checked_out_a_moment_ago_is_handed_out_without_a_round_trip(db, clock):
    check = FreshCheck(1.0)
    with _own_connection() as conn:
        with _Sent(conn) as first:
            check(conn)  # never checked out by it before: the empty query
        assert [m.split("\t")[2] for m in first.messages] == ["Query"]
        clock.now += 0.5
        with _Sent(conn) as again:
            check(conn)
        assert again.messages == []
        clock.now += 1.0  # not checked out for a second: the empty query again
        with _Sent(conn) as later:
            check(conn)
        assert len(later.messages) == 1
        assert conn.execute("SELECT 1").fetchone() == (1,)  # and it works


def test_a_connection_whose_backend_ended_is_never_handed_out(db, clock):
    """A backend ended (as a restart ends them all) a moment after its connection was last
    checked out: its last words and its end are on the socket, so the check sends the empty
    query, which fails, and the pool discards the connection."""
    check = FreshCheck(1.0)
    with _own_connection() as conn, _own_connection() as admin:
        check(conn)
        pid = conn.info.backend_pid
        # With a timeout, pg_terminate_backend returns once the backend has ended.
        assert admin.execute("SELECT pg_terminate_backend(%s, 5000)", [pid]).fetchone() == (True,)
        clock.now += 0.1
        with pytest.raises(psycopg.OperationalError):
            check(conn)


def test_with_no_fresh_time_every_checkout_sends_the_empty_query(db, clock):
    check = FreshCheck(0)
    with _own_connection() as conn:
        for _ in range(3):
            with _Sent(conn) as sent:
                check(conn)
            assert len(sent.messages) == 1


def test_by_default_the_pool_keeps_djangos_check_and_with_a_fresh_time_takes_this_one(db, settings):
    """Off by default (a silent failover or a backend just terminated would cost requests
    503s: zeromem/dbpool.py); DB_CONN_HEALTH_CHECKS=false (no check) is left alone."""
    connection.ensure_connection()
    assert settings.ZEROMEM_DB_POOL_CHECK_FRESH_SECONDS == 0
    check = connection.pool._check  # a read may have put SkippableCheck around it
    assert (check.check if isinstance(check, SkippableCheck) else check) is ConnectionPool.check_connection

    def installed(check):
        pool = ConnectionPool("", open=False, check=check)
        fresh_check_installed(sender=None, connection=type("Wrapper", (), {"pool": pool})())
        return pool._check

    assert installed(ConnectionPool.check_connection) is ConnectionPool.check_connection
    settings.ZEROMEM_DB_POOL_CHECK_FRESH_SECONDS = 1.5
    check = installed(ConnectionPool.check_connection)
    assert isinstance(check, FreshCheck) and check.fresh_seconds == 1.5
    assert installed(None) is None
    skippable = installed(SkippableCheck(ConnectionPool.check_connection))  # a read went first
    assert isinstance(skippable, SkippableCheck) and isinstance(skippable.check, FreshCheck)


# --- A read as its connection's check (DB_POOL_READ_CHECKS, on by default) -------------------


class _Checks:
    """Counts the pool's own checks (the empty query) that run, under SkippableCheck, for this
    thread's checkouts (another thread, renewing this process's tenant slots, may check one
    out meanwhile)."""

    def __init__(self):
        assert dbpool.read_checks(connection)  # puts SkippableCheck around the pool's check
        self.wrapper = connection.pool._check
        self.inner = self.wrapper.check
        self.count = 0
        me = threading.get_ident()

        def counted(conn):
            if threading.get_ident() == me:
                self.count += 1
            return self.inner(conn)

        self.wrapper.check = counted

    def restore(self):
        self.wrapper.check = self.inner


@pytest.fixture
def checks(settings):
    from memories.services import usage

    settings.ZEROMEM_USAGE_FLUSH_SECONDS = 3600  # as in production: no UPSERT after each answer
    usage.flush()
    connection.ensure_connection()
    counted = _Checks()
    yield counted
    counted.restore()


@pytest.fixture
def lane_key(tenant_a, settings):
    """A raw key of tenant A that this process has verified (the lane takes only those)."""
    settings.ZEROMEM_API_KEY_CACHE_SECONDS = 10
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 10_000
    settings.ZEROMEM_TOOL_LANE = True
    _key, raw = make_key(tenant_a)
    written = call(LANE, raw, {"name": "memory_write", "arguments": {"key": "fact:a", "value": "kept"}})
    assert written[0] == "200 OK"
    return raw


def _read(raw: str, key: str = "fact:a"):
    """A tool read as served (the lane, memories/api/lane.py), on a connection it checks out."""
    connection.close()  # the test's requests keep it between them; a served request checks one out
    status, _headers, content = call(LANE, raw, {"name": "memory_read", "arguments": {"key": key}})
    return status, json.loads(content)


def _terminate_pooled_backends() -> int:
    """End every other session of the test database, without waiting for them to exit (the
    signal sent, as ``pg_terminate_backend`` returns): a pooled connection may be handed out
    before its backend has written a word."""
    with _own_connection() as admin:
        return len(
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            ).fetchall()
        )


IDLE = 6  # dead idle connections met one by one: psycopg_pool's back-off, 1 + 2 + 4 s > its timeout


def _pool_holding(idle: int) -> None:
    """The pool holds at least ``idle`` idle connections (as after a busy minute)."""
    pool = connection.pool
    taken = [pool.getconn() for _ in range(idle)]
    for conn in taken:
        pool.putconn(conn)


def _pooled_backends_ended() -> None:
    """End the pooled connections of a test that opened some without the tests'
    connection_created receiver, and wait until the pool holds live ones again: the test's
    flush checks a connection out (with psycopg_pool's 1, 2, 4 … s back-off between dead
    ones, it once waited past the pool's timeout)."""
    _terminate_pooled_backends()
    _until_backends_gone()
    connection.pool.check()


def _until_backends_gone() -> None:
    """Wait (at most 5 s) until the test database's other sessions have exited."""
    with _own_connection() as admin:
        for _ in range(500):
            others = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            ).fetchone()[0]
            if not others:
                return
            time.sleep(0.01)


@pytest.mark.django_db(transaction=True)
def test_a_read_first_in_a_request_is_its_connections_check_and_anything_else_is_checked(lane_key, checks, settings):
    """As served, a tool read checks its connection out without the empty query (two round
    trips in all: its SELECT, with the rate counter riding it, and its audit INSERT); /healthz
    (Django's cursor) and a read with DB_POOL_READ_CHECKS off get the pool's check."""
    for _ in range(3):
        status, body = _read(lane_key)
        assert (status, body["status"], body["value"]) == ("200 OK", "ok", "kept")
    assert checks.count == 0

    connection.close()
    assert Client().get("/healthz").status_code == 200
    assert checks.count == 1

    settings.ZEROMEM_DB_POOL_READ_CHECKS = False
    assert _read(lane_key)[0] == "200 OK"
    assert checks.count == 2


@pytest.mark.django_db(transaction=True)
def test_a_read_on_a_connection_that_died_in_the_pool_runs_again_on_a_checked_one(lane_key, checks, tenant_a):
    """Every pooled connection ended a moment before the read (a restart): each read finds
    its connection dead with its own statement, goes again on a checked connection, and
    answers as ever — one audit event each, nothing refused."""
    for round_ in range(6):
        before = AuditEvent.objects.filter(tenant=tenant_a, action="memory.read").count()
        connection.close()  # back to the pool, idle, with the others
        _pool_holding(IDLE)
        assert _terminate_pooled_backends() >= IDLE
        checked = checks.count
        # Half the rounds as in production, where nothing runs at checkout: the read is the
        # first statement the dead connection gets. (The tests' connection_created receiver
        # sends one of its own, which then finds it dead.)
        quiet = round_ % 2 == 0
        if quiet:
            connection_created.disconnect(audit_tables_may_be_flushed)
        try:
            status, body = _read(lane_key)
        finally:
            if quiet:
                connection_created.connect(audit_tables_may_be_flushed)
        assert (status, body["status"], body["value"]) == ("200 OK", "ok", "kept"), (round_, body)
        assert AuditEvent.objects.filter(tenant=tenant_a, action="memory.read").count() == before + 1
        assert checks.count > checked  # the read went again on a connection the pool checked
    # The connections opened without the receiver go: the test's flush needs its setting.
    connection.close()
    _pooled_backends_ended()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("receiver", [True, False], ids=["receiver", "quiet"])
def test_a_write_on_a_connection_that_died_in_the_pool_is_written_once_on_a_checked_one(
    lane_key, checks, tenant_a, receiver
):
    """A restart with several idle connections in the pool: the tool write (piped, as
    served) finds its connection's backend gone before sending anything, and is written on a
    live connection — not after meeting each dead one in turn (503 past the pool's timeout)."""
    assert _read(lane_key)[0] == "200 OK"  # the key seen: the next write is piped
    connection.close()
    _pool_holding(IDLE)
    _terminate_pooled_backends()
    _until_backends_gone()  # their last words sent: the write finds its connection dead
    if not receiver:
        connection_created.disconnect(audit_tables_may_be_flushed)
    try:
        connection.close()
        status, _headers, content = call(
            LANE, lane_key, {"name": "memory_write", "arguments": {"key": "fact:a", "value": "again"}}
        )
    finally:
        if not receiver:
            connection_created.connect(audit_tables_may_be_flushed)
    assert status == "200 OK", content
    memory = Memory.objects.get(tenant=tenant_a, key="fact:a")
    assert (memory.value, memory.version) == ("again", 2)
    assert AuditEvent.objects.filter(tenant=tenant_a, action="memory.write", outcome="ok").count() == 2
    connection.close()
    _pooled_backends_ended()


@pytest.mark.django_db(transaction=True)
def test_a_read_that_fails_on_a_live_connection_is_not_sent_again(checks):
    """Only a dead connection sends a read again: one that fails on a live connection (here a
    division by zero; a timeout, a cancel) raises as before, having run once."""
    with _own_connection() as admin:
        admin.execute("CREATE SEQUENCE zm_test_read_once")
        try:
            connection.close()
            with pytest.raises(DataError):
                hotsql.fetchone("SELECT nextval('zm_test_read_once') / 0", [])
            assert checks.count == 0  # it was the connection's check
            assert admin.execute("SELECT last_value, is_called FROM zm_test_read_once").fetchone() == (1, True)
        finally:
            connection.close()
            admin.execute("DROP SEQUENCE zm_test_read_once")


@pytest.mark.django_db(transaction=True)
def test_a_statement_that_locks_or_writes_first_gets_the_pools_check(checks):
    connection.close()
    assert hotsql.fetchone("SELECT 1 FOR UPDATE", []) == (1,)
    assert checks.count == 1
    connection.close()
    assert hotsql.execute("UPDATE memories_tenant SET name = name WHERE false", []) == 0
    assert checks.count == 2


@pytest.mark.django_db(transaction=True)
def test_a_connection_whose_backend_has_ended_gets_nothing_sent(checks, monkeypatch):
    """A backend that ended while its connection sat in the pool has said so on the socket:
    the read sees it (poll, no round trip), sends nothing on it and goes on a checked one."""
    sent = []
    execute = hotsql._execute
    monkeypatch.setattr(hotsql, "_execute", lambda sql, *args: sent.append(sql) or execute(sql, *args))
    connection.close()
    with _own_connection() as admin:  # every other backend ended, and waited for
        admin.execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
    connection_created.disconnect(audit_tables_may_be_flushed)  # as in production: nothing at checkout
    try:
        assert hotsql.fetchone("SELECT 1", []) == (1,)
    finally:
        connection_created.connect(audit_tables_may_be_flushed)
    assert sent == ["SELECT 1"]  # once, on the checked connection
    assert checks.count >= 1
    connection.close()
    _pooled_backends_ended()  # the connection opened without the receiver goes


@pytest.mark.django_db(transaction=True)
def test_a_list_or_search_read_ended_while_it_runs_is_not_run_again(checks):
    """hotsql.fetchall (a page of a list, a search's rows: they may run long) is checked out
    with the pool's check and never sent again: an operator's pg_terminate_backend of a
    running one ends it (found by review: it ran a second time)."""
    with _own_connection() as admin:
        admin.execute("CREATE SEQUENCE zm_test_ended_once")
        try:
            connection.close()

            def end_it_when_running():
                for _ in range(250):
                    pids = admin.execute(
                        "SELECT pid FROM pg_stat_activity WHERE state = 'active' "
                        "AND query LIKE '%zm_test_ended_once%' AND pid <> pg_backend_pid()"
                    ).fetchall()
                    if pids:
                        admin.execute("SELECT pg_terminate_backend(%s)", [pids[0][0]])
                        return
                    time.sleep(0.02)

            killer = threading.Thread(target=end_it_when_running)
            killer.start()
            with pytest.raises(OperationalError):
                hotsql.fetchall("SELECT nextval('zm_test_ended_once'), pg_sleep(2)", [])
            killer.join()
            assert admin.execute("SELECT last_value FROM zm_test_ended_once").fetchone() == (1,)
            assert checks.count == 1  # checked out with the pool's check
        finally:
            connection.close()
            admin.execute("DROP SEQUENCE zm_test_ended_once")


# When no connection can be had, a read waits the pool's timeout once (found by review: the
# retry, and the rate counter's fallback, asked the pool again — 3 waits before the 503).
POOL_WAIT = 0.5


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


@pytest.fixture
def database_unreachable(monkeypatch):
    connection.close()
    connection.close_pool()
    monkeypatch.setitem(connection.settings_dict, "HOST", "127.0.0.1")
    monkeypatch.setitem(connection.settings_dict, "PORT", str(_closed_port()))
    options = dict(connection.settings_dict["OPTIONS"])
    options["pool"] = {**options["pool"], "timeout": POOL_WAIT}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    yield
    connection.close()
    connection.close_pool()


def _pool_asked(monkeypatch, read) -> int:
    """How many times ``read`` asks the pool for a connection (each a wait of its timeout when
    none can be had) before it raises — in this thread (another, renewing this process's
    tenant slots, may ask meanwhile)."""
    pool = connection.pool
    asked = []
    getconn = pool.getconn
    me = threading.get_ident()

    def counted(*args, **kwargs):
        if threading.get_ident() == me:
            asked.append(1)
        return getconn(*args, **kwargs)

    monkeypatch.setattr(pool, "getconn", counted)
    with pytest.raises(OperationalError):
        read()
    monkeypatch.setattr(pool, "getconn", getconn)
    return len(asked)


def _read_riding():
    with limits.hit_riding("key:no-connection", limit=1000):  # a tool read's rate counter
        hotsql.fetchone("SELECT 1", [])


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("read_checks", [True, False])
@pytest.mark.parametrize("read", [lambda: hotsql.fetchone("SELECT 1", []), _read_riding], ids=["plain", "riding"])
def test_a_read_with_the_database_unreachable_asks_the_pool_once(
    database_unreachable, settings, monkeypatch, read, read_checks
):
    settings.ZEROMEM_DB_POOL_READ_CHECKS = read_checks
    with pytest.raises(OperationalError):
        read()  # the pool opens; its first connection attempts fail
    connection.close()
    assert _pool_asked(monkeypatch, read) == 1


@pytest.mark.django_db(transaction=True)
def test_a_read_with_every_connection_held_by_others_asks_the_pool_once(monkeypatch):
    """One tenant's slow requests holding every pooled connection: another's read gets its
    503 after one DB_POOL_TIMEOUT, not several."""
    connection.close()
    pool = connection.pool
    monkeypatch.setattr(pool, "timeout", POOL_WAIT)
    held = [pool.getconn() for _ in range(pool.max_size)]
    try:
        assert _pool_asked(monkeypatch, _read_riding) == 1
    finally:
        for conn in held:
            pool.putconn(conn)
