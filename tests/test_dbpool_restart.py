"""A hot-path statement that finds its pooled connection dead has the pool's idle connections
replaced (zeromem/dbpool.py ``restart_suspected``, psycopg_pool's ``drain()``) — found by review
of a first version that ran psycopg_pool's ``check()`` in the request's thread: a closed pool, a
silent network and the pool's size. The restart itself: tests/test_dbpool.py."""

import socket
import struct
import threading
import time

import pytest
from django.db import OperationalError, connection
from django.db.backends.signals import connection_created

from tests.helpers import audit_tables_may_be_flushed
from tests.test_dbpool import _own_connection, _pooled_backends_ended
from zeromem.kernel import hotsql

pytestmark = [pytest.mark.postgres, pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's pool")]


@pytest.fixture
def quiet():
    """As in production: nothing runs at checkout (no connection_created statement)."""
    connection_created.disconnect(audit_tables_may_be_flushed)
    yield
    connection_created.connect(audit_tables_may_be_flushed)


# --- 1. close_pool() between a checkout and the drop: check() on Django's new, unopened pool ---


@pytest.mark.django_db(transaction=True)
def test_a_dead_connection_of_a_pool_closed_meanwhile_reads_on_the_new_pool(quiet):
    """Another thread (or Django's ensure_timezone, or bench) closes the pool while this
    thread's unchecked read holds a connection, whose backend then ends: the read goes again on
    the new pool Django opens, and nothing is done to the closed one. (Run on Django's ``pool``
    property — a new pool, not opened yet — psycopg_pool's ``check()`` raised AttributeError, a
    500, and left that pool ``_growing`` for its life: it never grew again.)"""
    connection.close()
    done = []

    def pool_closed_and_backend_ended(sender, connection, **kwargs):
        if done:
            return
        done.append(1)
        pid = connection.connection.info.backend_pid
        connection.close_pool()  # as another thread would; the checked-out connection stays open
        with _own_connection() as admin:
            assert admin.execute("SELECT pg_terminate_backend(%s, 5000)", [pid]).fetchone() == (True,)

    connection_created.connect(pool_closed_and_backend_ended)
    try:
        assert hotsql.fetchone("SELECT 1", []) == (1,)
    finally:
        connection_created.disconnect(pool_closed_and_backend_ended)
        connection.close()
    pool = connection.pool
    for _ in range(300):  # the new pool's first connections made
        if not pool._growing and pool._nconns == len(pool._pool):
            break
        time.sleep(0.01)
    assert not pool._growing  # else _maybe_grow_pool() is a no-op for the life of the pool
    assert pool._nconns == len(pool._pool)  # every connection counted exists (none out)
    _pooled_backends_ended()


# --- 2. The database unreachable without a word: check() is N stalls in the request ------------


class _Proxy:
    """A TCP proxy to the test database. ``stall(seconds)``: from now on what a client sends
    is lost (a failover, a host gone, a NAT reset: nothing comes back), and the client's
    connection is reset ``seconds`` later (its TCP retransmissions given up: 15 min by
    default on Linux); a new connection is refused at once."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.stalled = None
        self.stalled_ports = {}  # a client's port: its stall alone
        self.sockets = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self, seconds):
        self.stalled = seconds

    def close(self):
        self.stalled = None
        self.listener.close()
        for s in self.sockets:
            _closed(s)

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.stalled is not None:
                _reset(client)
                continue
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src, dst, from_client):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                stalled = self.stalled if self.stalled is not None else self.stalled_ports.get(src.getpeername()[1])
                if from_client and stalled is not None:
                    time.sleep(stalled)
                    _reset(src)
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _closed(s)


def _closed(sock):
    # shutdown() first: a socket closed while the other pump is blocked reading it stays open
    # (the read holds it) and its backend with it — past the test, the test database's drop.
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _reset(sock):
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


STALL = 1.0
POOL_WAIT = 1.0
IDLE = 6


@pytest.fixture
def proxied(monkeypatch):
    host, port = connection.settings_dict["HOST"] or "127.0.0.1", int(connection.settings_dict["PORT"] or 5432)
    proxy = _Proxy((host, port))
    connection.close()
    connection.close_pool()
    monkeypatch.setitem(connection.settings_dict, "HOST", "127.0.0.1")
    monkeypatch.setitem(connection.settings_dict, "PORT", str(proxy.port))
    options = dict(connection.settings_dict["OPTIONS"])
    options["pool"] = {**options["pool"], "timeout": POOL_WAIT, "max_size": IDLE + 2}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    yield proxy
    proxy.close()
    connection.close()
    connection.close_pool()


@pytest.mark.django_db(transaction=True)
def test_a_read_on_a_silent_network_waits_no_more_than_before(proxied, quiet):
    """The database gone without a word with IDLE connections idle in the pool. The read is
    sent on a dead connection and waits out the stall; then the checkout waits at most the
    pool's timeout. (``check()`` on every idle connection in turn, in the request's thread, had
    it wait IDLE stalls — 15 min each on a real network — with those connections out of the
    pool for every other thread meanwhile.)"""
    connection.ensure_connection()  # the pool opened
    connection.close()
    pool = connection.pool
    taken = [pool.getconn() for _ in range(IDLE)]
    for conn in taken:
        pool.putconn(conn)
    connection.close()
    proxied.stall(STALL)
    started = time.monotonic()
    with pytest.raises(OperationalError):
        hotsql.fetchone("SELECT 1", [])
    elapsed = time.monotonic() - started
    assert elapsed < 2 * STALL + POOL_WAIT + 0.5, elapsed


# --- 3. the pool no bigger -------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_replacing_the_idle_connections_opens_no_more_than_it_closed():
    """(psycopg_pool's check() grows the pool by one whatever it holds: every dead connection a
    read found opened one more, up to max_size, kept until max_idle — right after a restart,
    when every process reconnects at once.)"""
    from psycopg_pool import ConnectionPool

    from zeromem import dbpool

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    pool = ConnectionPool(kwargs={**params, "autocommit": True}, min_size=2, max_size=6, open=True)
    try:
        pool.wait()
        for _ in range(3):
            dbpool.restart_suspected(pool)
        for _ in range(200):  # the workers' new connections
            if len(pool._pool) == 2:
                break
            time.sleep(0.01)
        assert (pool._nconns, len(pool._pool)) == (2, 2)
    finally:
        pool.close()
