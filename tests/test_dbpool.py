"""The opt-in check of a pooled connection (zeromem/dbpool.py, DB_POOL_CHECK_FRESH_SECONDS):
no round trip for a connection checked out a moment ago whose socket has nothing to read,
the empty query for any other, a connection whose backend has exited refused — and by
default Django's own check (the empty query at every checkout) left in place."""

import tempfile

import psycopg
import pytest
from django.db import connection
from psycopg import pq
from psycopg_pool import ConnectionPool

from zeromem import dbpool
from zeromem.dbpool import FreshCheck, fresh_check_installed

pytestmark = [pytest.mark.postgres, pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's pool")]


def _own_connection() -> psycopg.Connection:
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**params, autocommit=True)


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
    assert connection.pool._check is ConnectionPool.check_connection

    def installed(check):
        pool = ConnectionPool("", open=False, check=check)
        fresh_check_installed(sender=None, connection=type("Wrapper", (), {"pool": pool})())
        return pool._check

    assert installed(ConnectionPool.check_connection) is ConnectionPool.check_connection
    settings.ZEROMEM_DB_POOL_CHECK_FRESH_SECONDS = 1.5
    check = installed(ConnectionPool.check_connection)
    assert isinstance(check, FreshCheck) and check.fresh_seconds == 1.5
    assert installed(None) is None
