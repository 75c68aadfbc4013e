"""Django's PostgreSQL backend (``ENGINE = "zeromem.postgresql"``, set by settings.py), with
one change: the check the connection pool runs on a connection before handing it out.

psycopg_pool's own check (``ConnectionPool.check_connection``, which Django installs when
``CONN_HEALTH_CHECKS`` is on) sends an empty query: one round trip to PostgreSQL on every
request. A connection the server has ended (a restart, ``pg_terminate_backend``, an idle
timeout) has something to read on its socket by then — the server's last message or the end
of the stream — while a healthy idle connection has nothing. So the socket is polled first,
without waiting, and only a connection with something pending gets the round trip: dead ones
are still found and replaced before a request uses them (tests/test_database_outage.py),
healthy ones cost nothing.
"""

import select

from django.db.backends.postgresql import base
from psycopg_pool import ConnectionPool


def check_connection(conn) -> None:
    """Raise when ``conn`` is not usable; return at once, with no round trip, when its socket
    has nothing pending."""
    if conn.closed or conn.broken:
        raise ConnectionError("the connection is closed")
    try:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN | select.POLLPRI)
        pending = bool(poller.poll(0))
    except (OSError, ValueError):
        pending = True
    if pending:
        # Something arrived while it sat idle: the end of the session, or a notice. Ask.
        ConnectionPool.check_connection(conn)


class DatabaseWrapper(base.DatabaseWrapper):
    @property
    def pool(self):
        pool = super().pool
        # Django builds the pool with psycopg_pool's check (CONN_HEALTH_CHECKS) and offers no
        # way to pass another; this one replaces it once, when the pool is first used.
        if pool is not None and pool._check is ConnectionPool.check_connection:
            pool._check = check_connection
        return pool
