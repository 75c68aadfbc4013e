"""A ``lock_timeout`` for migrations on PostgreSQL (``manage.py migrate``, see
memories/management/commands/migrate.py).

An ALTER TABLE (``AddField``, ``AddConstraint``, …) takes ACCESS EXCLUSIVE on its table. Behind
one long transaction that touched the table it waits — and every request that reads or writes
the table then queues behind the waiting ALTER, until that transaction ends. With a
``lock_timeout`` the ALTER gives up instead: its migration fails (an atomic one rolls back
whole; re-run it once the transaction has ended), and traffic goes on.

``CREATE INDEX CONCURRENTLY`` (and the other ``… CONCURRENTLY`` statements) are let wait as
long as it takes: they block no reads or writes, and they wait, as lock waits, for every
transaction older than them, so a lock_timeout would cancel a build behind any long
transaction and leave an INVALID index (zeromem/kernel/pgindexes.py). Statements a
migration runs with its own transaction-local ``lock_timeout`` (``set_config(…, true)``, as
audit/0014 and ``audit.partitions`` do) keep theirs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError

# The SQLSTATE of a lock not granted within lock_timeout (psycopg: LockNotAvailable).
LOCK_NOT_AVAILABLE = "55P03"

_CONCURRENTLY = re.compile(r"\bCONCURRENTLY\b", re.IGNORECASE)


def lock_not_available(exc: BaseException) -> bool:
    """``exc`` (a Django database error) is PostgreSQL's "canceling statement due to lock timeout"."""
    return getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE


@contextmanager
def migration_lock_timeout(connection, seconds: float) -> Iterator[bool]:
    """On ``connection`` (PostgreSQL, ``seconds`` > 0): ``lock_timeout`` set for the session
    while the block runs, but for ``… CONCURRENTLY`` statements (no limit around each); the
    session's own value is back afterwards, so a pooled connection is returned as it was.
    Yields whether a limit is in force. Elsewhere (SQLite, ``seconds`` 0) changes nothing."""
    if connection.vendor != "postgresql" or not seconds or seconds <= 0:
        yield False
        return
    limit = f"{max(1, round(seconds * 1000))}ms"
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('lock_timeout'), set_config('lock_timeout', %s, false)", [limit])
        before = cursor.fetchone()[0]

    def unlimited_while_concurrently(execute, sql, params, many, context):
        if not (isinstance(sql, str) and _CONCURRENTLY.search(sql)):
            return execute(sql, params, many, context)
        # Never inside a transaction block (PostgreSQL refuses one there): session-level.
        execute("SELECT set_config('lock_timeout', '0', false)", None, False, context)
        try:
            return execute(sql, params, many, context)
        finally:
            execute("SELECT set_config('lock_timeout', %s, false)", [limit], False, context)

    try:
        with connection.execute_wrapper(unlimited_while_concurrently):
            yield True
    finally:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT set_config('lock_timeout', %s, false)", [before])
        except DatabaseError:
            # An aborted enclosing transaction rolls the session's setting back itself; a broken
            # connection is closed, never handed back to a pool with the migration's limit.
            if not connection.in_atomic_block:
                connection.close()
