"""The check of a pooled connection before it is handed out: a read's first statement as the
check (``DB_POOL_READ_CHECKS``, on by default), and an opt-in cheaper check for everything
else (``DB_POOL_CHECK_FRESH_SECONDS``, off by default).

**A read is its connection's check.** Django's ``CONN_HEALTH_CHECKS`` has the pool send an
empty query at every checkout, so a read served was three round trips: the check, the read
(with the rate counter riding it) and the audit INSERT. When a request's first statement is
a point read of the hot path (``zeromem.kernel.hotsql.fetchone`` of a ``SELECT`` that locks
nothing, with or without the rate counter's UPSERT riding it: a tool, REST or MCP read, a
write's read of its row), the connection is checked out without the check
(:func:`check_skipped`):

- a connection whose socket has something to read (:func:`unread_input`, a ``poll()``: a
  backend that ended while idle — a restart, ``pg_terminate_backend``, ``idle_session_timeout``
  — has sent its last words) is closed, nothing sent, and the read goes on a checked one;
- else the read is sent at once: a round trip to the server as the empty query is, it finds
  out what the check would have. If it fails because the connection is dead (:func:`broken`:
  a backend ended a moment ago, a server gone, a network reset), the connection goes back to
  the pool, which drops it, and the read is sent again on a connection the pool checks.

What the retry can repeat: a backend ended *while running* the read (an operator's
``pg_terminate_backend`` of a read waiting on a lock; a point read takes a tenth of a
millisecond otherwise) rolled it back, counter and all, and it runs once more; a backend that
committed the statement and died before its answer arrived (the same microseconds any request
can lose its answer in) has its rate counter counted once more. Nothing else it does outlives
a rollback. A statement that fails on a live connection (a timeout, a cancel) is not sent
again, and when no connection can be had the pool's wait is not repeated. Anything else first
— Django's own cursor (``/healthz``, the ORM, a transaction), a list or search page's reads
(``hotsql.fetchall``: those may run long, and an operator who ends one means it), a lock, a
write — is checked out with the check, as before.

**The opt-in check for the rest.** The empty query costs 0.07–0.11 ms of wall time and
0.06–0.08 ms of CPU a request here, more where the database is across a network; it is what
catches a connection that died while idle in the pool, so that no request gets it. With
``DB_POOL_CHECK_FRESH_SECONDS`` > 0, :class:`FreshCheck` hands out without that round
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

import contextlib
import select
import threading
import time
from collections.abc import Iterator

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
    current = getattr(pool, "_check", None)
    skippable = isinstance(current, SkippableCheck)
    check = current.check if skippable else current
    if pool is None or seconds <= 0 or check is not ConnectionPool.check_connection:
        return  # no pool, the empty query kept, no check at all (DB_CONN_HEALTH_CHECKS=false), or done
    if skippable:
        current.check = FreshCheck(seconds)
    else:
        pool._check = FreshCheck(seconds)  # psycopg_pool's constructor argument, kept as it is


# --- A read as its connection's check ----------------------------------------------------------

_skipping = threading.local()


class SkippableCheck:
    """A pool's ``check`` (``check``: Django's empty query, or :class:`FreshCheck`) that the
    thread checking a connection out may skip (:func:`check_skipped`). The pool calls its
    check in the thread that calls ``getconn()``."""

    def __init__(self, check):
        self.check = check

    def __call__(self, conn: Connection) -> None:
        if not getattr(_skipping, "on", False):
            self.check(conn)

    def __repr__(self) -> str:
        return f"SkippableCheck({self.check!r})"


def read_checks(db) -> bool:
    """Whether a read may be the check of the connection ``db`` checks out for it: pooled,
    with a check to skip, and ``DB_POOL_READ_CHECKS`` on. Puts :class:`SkippableCheck` around
    the pool's check the first time (Django 5.2 passes the pool its check itself; psycopg_pool
    keeps it as ``_check``, 3.3 pinned: tests/test_dbpool.py fails if it moves)."""
    if not settings.ZEROMEM_DB_POOL_READ_CHECKS:
        return False
    pool = getattr(db, "pool", None)  # PostgreSQL's wrapper only
    if pool is None:
        return False
    check = pool._check
    if check is None:
        return False  # DB_CONN_HEALTH_CHECKS=false: no check to spare
    if type(check) is not SkippableCheck:
        pool._check = SkippableCheck(check)
    return True


@contextlib.contextmanager
def check_skipped() -> Iterator[None]:
    """Connections this thread checks out in the block are handed out without the check."""
    _skipping.on = True
    try:
        yield
    finally:
        _skipping.on = False


def broken(db) -> bool:
    """Whether the connection of ``db`` is dead (its server gone, its backend ended), as
    opposed to alive with a statement that failed (or not checked out at all)."""
    conn = db.connection
    return conn is not None and (conn.closed or conn.broken)


def unread_input(db) -> bool:
    """Whether the idle connection of ``db`` has something to read — a backend that ended has
    sent its last words (and closed the socket): a non-blocking ``poll()``, no round trip."""
    return _readable(db.connection)


def restart_suspected(pool) -> None:
    """A connection of ``pool`` turned out dead under a hot-path statement: replace the pool's
    idle connections (psycopg_pool's ``drain()``: closed, and as many new ones opened by its
    workers; those checked out now are closed when they come back), before the statement goes
    again on a checked connection. A restart ends them all, and psycopg_pool's ``getconn``
    meets dead ones one at a time with a back-off of 1, 2, 4 … s between: with four idle
    connections dead the read waited 7 s, past the pool's 5 s timeout, and answered 503. Now
    the checkout waits for a new connection instead, within the pool's timeout. No round trip
    in this thread (a dead network's stalls stay the pool's workers'); the pool does not grow.
    One idle connection ended alone (an operator's ``pg_terminate_backend``) costs the others
    a reconnect too: a few milliseconds of the workers' time, once. ``pool``: the dead
    connection's own (None, or closed since: nothing to do)."""
    if pool is not None and not pool.closed:
        pool.drain()
