"""Statements of the hot path (a read's SELECT and audit INSERT, the rate-limit counter, a
write's row lock) on the database driver's cursor, without Django's cursor wrapper.

Django wraps every cursor (``CursorWrapper``: its execute wrappers, the thread and async
checks, error translation per call) and, through the ORM, compiles every query. The hot
statements are compiled once per process by their callers (``_plan`` in memories/selectors,
``_insert_sql`` in audit/services.py); what is left per call is the wrapper, about 0.05 ms of
CPU per statement — a few percent of a read. :func:`fetchone` keeps what matters of it: the
connection is opened and health-checked as ``connection.cursor()`` does, a broken transaction
is refused, driver errors become Django's (``OperationalError`` → 503 upstream), and
parameters are bound exactly as before (the connection's own cursor class).

Whenever something watches the statements — ``DEBUG``, ``CaptureQueriesContext``
(``force_debug_cursor``), an execute wrapper (instrumentation, tests) — the statement goes
through Django's cursor as any other, so it is logged and counted the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from django.db import DEFAULT_DB_ALIAS, connections


def fetchone(sql: str, params: Sequence) -> tuple | None:
    """Run one statement on the default connection and return its first row (or None)."""
    db = connections[DEFAULT_DB_ALIAS]
    if db.queries_logged or db.execute_wrappers:
        with db.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone()
    db.close_if_health_check_failed()
    db.ensure_connection()
    db.validate_thread_sharing()
    db.validate_no_broken_transaction()
    with db.wrap_database_errors:
        cursor = db.create_cursor()
        try:
            cursor.execute(sql, params)
            return cursor.fetchone()
        finally:
            cursor.close()
