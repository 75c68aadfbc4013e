"""An opt-in cheaper check of a pooled connection before it is handed out
(``DB_POOL_CHECK_FRESH_SECONDS``, off by default).

Django's ``CONN_HEALTH_CHECKS`` gives the pool psycopg_pool's own check, an empty query at
every checkout. A request checks a connection out and returns it, so every request pays a
round trip for it before its own: through the server an audited read is three round trips
(the check, the read with the rate counter, the audit INSERT) and ``/healthz`` two; the check
costs 0.07–0.11 ms of wall time and 0.06–0.08 ms of CPU a request here, more where the
database is across a network. It is what catches a connection that died while idle in the
pool, so that no request gets it.

With ``DB_POOL_CHECK_FRESH_SECONDS`` > 0, :class:`FreshCheck` hands out without that round
trip a connection checked out within that many seconds whose socket has nothing to read
(a backend that exited has sent its last words and closed the socket); any other gets the
empty query. That is no check at all for two kinds of dead connection, found by review, each
then costing the request that gets it a 503 (one per pooled connection):

- a server gone without a word — a failover moving the address, a host crash, a network or
  NAT reset: nothing ever reaches the socket, and only a round trip finds out;
- a backend terminated a moment ago (``pg_terminate_backend`` returns when the signal is
  sent, before the backend has written anything): 23 of 30 such connections were handed out
  dead in the review's test, none with the empty query.

So it stays off unless an operator prefers the round trip saved to those 503s (a database
on the same host, no failover). Django 5.2 passes the pool its ``check`` itself
(``OPTIONS["pool"]`` may not carry one): :func:`fresh_check_installed` puts this one in place
of Django's on each pool when a connection of it is made (``connection_created``).
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
