"""The connection pool's check of a connection before it hands it out (settings.py ``pool``).

Django's ``CONN_HEALTH_CHECKS`` gives the pool psycopg_pool's own check, an empty query at
every checkout. A request checks a connection out and returns it, so every request paid a
round trip for it before its own: an audited read was three round trips, not two, and the
check cost 0.07–0.11 ms of wall time and 0.06–0.08 ms of CPU a request here, more where the
database is across a network. It is there for a connection that died while idle in the pool
(a database restart, a terminated backend): without a check, each cost one request a 503.

A connection whose server end has gone has something to read: PostgreSQL sends the
backend's last words (``FATAL: terminating connection ...``) and closes the socket as the
backend exits. So :class:`FreshCheck` hands out without a round trip a connection checked out
within the last ``DB_POOL_CHECK_FRESH_SECONDS`` (1 s) whose socket has nothing to read; any
other gets the empty query, as before (a dead one fails it, and the pool discards it). What
this gives up: a connection whose backend ended within that second and whose last words had
not arrived by the time it was checked out gets the request the error it would have got with
no check (503 with Retry-After). A database restart takes longer than their delivery.
``DB_POOL_CHECK_FRESH_SECONDS=0``: the empty query at every checkout, as Django's.

Django 5.2 gives the pool its ``check`` itself (``OPTIONS["pool"]`` may not carry one), so
:func:`fresh_check_installed` puts this one in place of Django's on the pool the first time a
connection of it is made (``connection_created``).
"""

from __future__ import annotations

import select
import time

from django.conf import settings
from psycopg import Connection
from psycopg_pool import ConnectionPool

_CHECKED_OUT = "_zeromem_checked_out_at"


class FreshCheck:
    """A pool's ``check``: the empty query only for a connection not checked out within the
    last ``fresh_seconds``, or whose socket has something to read."""

    def __init__(self, fresh_seconds: float):
        self.fresh_seconds = fresh_seconds

    def __call__(self, conn: Connection) -> None:
        now = time.monotonic()
        last = getattr(conn, _CHECKED_OUT, None)
        setattr(conn, _CHECKED_OUT, now)
        if last is not None and now - last < self.fresh_seconds and not conn.closed and not _readable(conn):
            return
        ConnectionPool.check_connection(conn)

    def __repr__(self) -> str:
        return f"FreshCheck(fresh_seconds={self.fresh_seconds})"


def _readable(conn: Connection) -> bool:
    """The server sent something, or closed its end, since the connection was last used (an
    idle connection's socket has nothing to read otherwise)."""
    try:
        fd = conn.fileno()
    except Exception:  # noqa: BLE001 - no socket: the empty query says what is wrong
        return True
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    readable, _, broken = select.select([fd], [], [fd], 0)  # Windows has no poll()
    return bool(readable or broken)


def fresh_check_installed(sender, connection, **kwargs) -> None:
    """``connection_created`` receiver: the pool of ``connection`` (PostgreSQL) checks with
    :class:`FreshCheck` instead of Django's empty query at every checkout."""
    pool = getattr(connection, "pool", None)
    seconds = settings.ZEROMEM_DB_POOL_CHECK_FRESH_SECONDS
    if pool is None or seconds <= 0 or pool._check is not ConnectionPool.check_connection:
        return  # no pool, the empty query kept, no check at all (DB_CONN_HEALTH_CHECKS=false), or done
    pool._check = FreshCheck(seconds)  # psycopg_pool's constructor argument, kept as it is
