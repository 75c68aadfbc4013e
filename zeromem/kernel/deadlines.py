"""A page query under a deadline: for pages whose filters no index serves, which read rows
until the page is full — all of them when few match."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.db import OperationalError, connections, transaction
from django.db.models import QuerySet


def first_rows(
    qs: QuerySet, size: int, *, timeout_ms: int, timed_out: Callable[[], Exception], bitmap_only: bool = False
) -> list:
    """The first ``size`` rows of ``qs``; on PostgreSQL its statement stops after
    ``timeout_ms`` and ``timed_out()`` is raised. The deadline is the query's own: set in a
    transaction (or savepoint) of its own and the session's value set back after it, so the
    request's later statements (its audit INSERT) run as before. ``bitmap_only``: no
    sequential or plain index scan either (``enable_seqscan``, ``enable_indexscan`` off the
    same way), for a query written so that one index alone should serve it, whatever the
    table's statistics say. Cost: the query and two ``set_config``. Elsewhere (SQLite) the
    query as it is."""
    alias = qs.db
    db = connections[alias]
    if db.vendor != "postgresql":
        return list(qs[:size])
    scans = "off" if bitmap_only else None
    try:
        with transaction.atomic(using=alias):
            with db.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('statement_timeout'), current_setting('enable_seqscan'),"
                    " current_setting('enable_indexscan'), set_config('statement_timeout', %s, true),"
                    " set_config('enable_seqscan', coalesce(%s, current_setting('enable_seqscan')), true),"
                    " set_config('enable_indexscan', coalesce(%s, current_setting('enable_indexscan')), true)",
                    [str(timeout_ms), scans, scans],
                )
                previous = cursor.fetchone()[:3]
            rows = list(qs[:size])
            with db.cursor() as cursor:
                cursor.execute(
                    "SELECT set_config('statement_timeout', %s, true), set_config('enable_seqscan', %s, true),"
                    " set_config('enable_indexscan', %s, true)",
                    list(previous),
                )
            return rows
    except OperationalError as exc:
        from psycopg import errors

        if isinstance(exc.__cause__, errors.QueryCanceled):
            raise timed_out() from None
        raise


@contextmanager
def statement_deadline(
    *, timeout_ms: int, timed_out: Callable[[], Exception], using: str = "default"
) -> Iterator[None]:
    """Each statement run inside stops after ``timeout_ms`` (PostgreSQL's statement_timeout),
    and the block raises ``timed_out()`` instead of the database's error. As :func:`first_rows`:
    its own transaction (or savepoint), the session's value set back on the way out, so the
    request's later statements run as before. Elsewhere (SQLite) the block as it is."""
    db = connections[using]
    if db.vendor != "postgresql":
        yield
        return
    try:
        with transaction.atomic(using=using):
            with db.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('statement_timeout'), set_config('statement_timeout', %s, true)",
                    [str(timeout_ms)],
                )
                previous = cursor.fetchone()[0]
            yield
            with db.cursor() as cursor:
                cursor.execute("SELECT set_config('statement_timeout', %s, true)", [previous])
    except OperationalError as exc:
        from psycopg import errors

        if isinstance(exc.__cause__, errors.QueryCanceled):
            raise timed_out() from None
        raise
