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

import contextlib
import functools
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, DataError, OperationalError, connections
from django.db.models import signals
from django.db.models.sql import InsertQuery
from psycopg import errors as pg_errors
from psycopg import generators, pq
from psycopg._preparing import Prepare
from psycopg._queries import PostgresQuery
from psycopg.adapt import Transformer

from zeromem import dbpool
from zeromem.kernel import tracing


def fetchone(sql: str, params: Sequence, db=None) -> tuple | None:
    """Run one statement on the default connection (``db``: its wrapper, when the caller has
    it already) and return its first row (or None). Statements held by :func:`holding` go with
    it, in the same statement, when it is a plain ``INSERT … VALUES … RETURNING`` (the audit
    event), else in one of their own just before it."""
    if db is None:
        db = connections[DEFAULT_DB_ALIAS]
    event = getattr(db, _EVENT, None)
    if event is not None:
        setattr(db, _EVENT, None)  # one chance: the next statement, whatever it is
        if _rideable(sql) and not getattr(db, _HELD, None):
            rider = getattr(db, _RIDER, None)
            if _pipelines(db) and (rider is None or rider.limit is not None):
                setattr(db, _RIDER, None)
                return _send_piped(event, rider, sql, params, db)
            if rider is None:
                return _send_with_event(event, sql, params, db)
    rider = getattr(db, _RIDER, None)
    held = getattr(db, _HELD, None)
    if rider is not None:
        if _rideable(sql) and not held:
            setattr(db, _RIDER, None)
            return _send_riding(rider, sql, params, db)
        if held and _carries(sql) and _guarded(held) and write_may_pipe(db):
            setattr(db, _RIDER, None)
            return _send_write_piped(rider, held, (sql, params), db)
        _release_rider(db)
    if held:
        return _send_held(held, (sql, params) if _carries(sql) else None)
    return _send(sql, params, _first, db, reads=_rideable(sql))


def fetchall(sql: str, params: Sequence, db=None) -> list[tuple]:
    """Run one statement on the default connection and return all its rows."""
    return _run(sql, params, _all, db)


def _first(cursor):
    return cursor.fetchone()


def _all(cursor):
    return cursor.fetchall()


def _run(sql: str, params: Sequence, fetch, db=None):
    if db is None:
        db = connections[DEFAULT_DB_ALIAS]
    if getattr(db, _RIDER, None) is not None:
        _release_rider(db)
    held = getattr(db, _HELD, None)
    if held:
        _send_held(held, None)  # the statements held before this one, first
    return _send(sql, params, fetch, db)


def _send(sql: str, params: Sequence, fetch, db=None, *, reads: bool = False, again=None):
    # What connection.cursor() checks, on the driver's own cursor (Django's whenever
    # statements are being watched); ``fetch(cursor)`` is the answer. ``reads``: the statement
    # only reads (the rate counter riding it aside), so it may be the check of the connection
    # it is the first statement on (zeromem/dbpool.py). ``again``: (sql, params, fetch) sent
    # instead when it goes again on a checked connection (a read's event riding it stays out).
    if db is None:
        db = connections[DEFAULT_DB_ALIAS]
    if getattr(db, _LATER, None):
        _read_later(db)  # the statement answered later, first
    if db.queries_logged or db.execute_wrappers:
        with db.cursor() as cursor:
            cursor.execute(sql, params)
            return fetch(cursor)
    db.close_if_health_check_failed()
    if reads and db.connection is None and dbpool.read_checks(db):
        try:
            if _checked_out_unchecked(db):
                return _execute(sql, params, fetch, db)
        except DatabaseError:
            # No connection to be had (the pool has waited its timeout already), or an error
            # of a live connection: raised. A dead connection: the read again, below.
            if db.connection is None or not dbpool.broken(db):
                raise
            _dead_dropped(db)
        # The read again on a connection the pool checks.
        if again is not None:
            sql, params, fetch = again
    db.ensure_connection()
    return _execute(sql, params, fetch, db)


def _checked_out_unchecked(db) -> bool:
    """Check a connection out for a statement that is its own check, without the pool's round
    trip. False when it turns out dead before the statement is sent — its backend has said
    goodbye (``dbpool.unread_input``), or a ``connection_created`` receiver's statement found
    it broken: then it is dropped (:func:`_dead_dropped`), and the caller checks one out with
    the pool's check."""
    try:
        with dbpool.check_skipped():
            db.ensure_connection()
        dead = dbpool.unread_input(db)
    except DatabaseError:
        if db.connection is None or not dbpool.broken(db):
            raise
        dead = True
    if dead:
        _dead_dropped(db)
    return not dead


def _dead_dropped(db) -> None:
    """The dead connection of ``db`` back to its pool, which drops it; the pool's idle
    connections replaced (``dbpool.restart_suspected``: a restart ends them all)."""
    pool = None
    if db.connection is not None:
        pool = getattr(db.connection, "_pool", None)  # psycopg_pool's, while checked out
        db.connection.close()
    db.close()
    dbpool.restart_suspected(pool)


def _execute(sql: str, params: Sequence, fetch, db):
    db.validate_thread_sharing()
    db.validate_no_broken_transaction()
    with db.wrap_database_errors:
        # Prepared once per connection (server-side binding) unless the connection has no
        # prepare threshold (SQLite; PgBouncer: DB_PREPARED_STATEMENTS off) or the process
        # traces: OpenTelemetry's psycopg instrumentation wraps the connection's own cursor
        # class, not this one.
        conn = db.connection
        prepared = getattr(conn, "prepare_threshold", None) is not None and not tracing.on()
        if prepared and not db.allow_thread_sharing:
            cursor = _kept_cursor(conn, sql)
            try:
                cursor.execute(sql, params, prepare=True)
                return fetch(cursor)
            except BaseException:
                _drop_kept_cursor(conn, sql)
                raise
        # Threads that share this connection get a cursor each (a kept one's result would be
        # theirs to overwrite).
        cursor = _server_bound(conn) if prepared else db.create_cursor()
        try:
            cursor.execute(sql, params, **({"prepare": True} if prepared else {}))
            return fetch(cursor)
        finally:
            cursor.close()


# A server-bound cursor is kept per database connection (psycopg's, which the pool hands from
# thread to thread; a connection is used by one thread at a time) and statement: psycopg builds
# a new adaptation context for each cursor, and for each statement a cursor runs that is not the
# one it ran before (the dumpers of every parameter looked up again); a statement run again on
# its own cursor skips both — about 40 µs of CPU per statement, a tenth of a read. (Kept per
# connection wrapper, as until session 26, they were made again at nearly every statement: the
# pool hands its idle connections out in turn, so a thread's wrapper rarely had the same
# connection twice running.) The cursor holds its last result until the statement runs again.
# A cursor whose statement failed is dropped; a connection closed takes its cursors with it.
_KEPT = "_zeromem_hotsql_cursors"
_KEPT_MAX = 64


def _kept_cursor(conn, sql: str):
    kept = conn.__dict__.get(_KEPT)
    if kept is None:
        kept = conn.__dict__[_KEPT] = {}
    cursor = kept.get(sql)
    if cursor is not None and not cursor.closed:
        return cursor
    if cursor is not None or len(kept) >= _KEPT_MAX:
        for old in [sql] if cursor is not None else list(kept):
            _close_quietly(kept.pop(old))
    cursor = kept[sql] = _server_bound(conn)
    return cursor


def kept_cursors(conn) -> dict:
    """{statement: cursor} kept on the psycopg connection ``conn`` (read-only use: tests)."""
    return conn.__dict__.get(_KEPT, {})


def drop_kept_cursors() -> None:
    """Close the cursors kept on this thread's default connection (if it has one checked
    out), and drop its piped statements' adaptation context. A cursor copies its connection's
    adapters when it is made: a loader or dumper registered on the connection later (nothing
    in ZeroMem does; a test counting what psycopg loads does) reaches the hot statements once
    their kept cursors are gone."""
    conn = connections[DEFAULT_DB_ALIAS].connection
    if conn is not None:
        for cursor in conn.__dict__.pop(_KEPT, {}).values():
            _close_quietly(cursor)
        conn.__dict__.pop(_PIPED, None)  # the piped statements' adaptation context, likewise


def _drop_kept_cursor(conn, sql: str) -> None:
    cursor = conn.__dict__.get(_KEPT, {}).pop(sql, None)
    if cursor is not None:
        _close_quietly(cursor)


def _close_quietly(cursor) -> None:
    try:
        cursor.close()
    except Exception:  # noqa: BLE001, S110 - a cursor of a connection already gone
        pass


@functools.cache
def _server_binding_cursor():
    # Django's server-side binding cursor (psycopg's Cursor): the statement is parsed and
    # planned by PostgreSQL once per connection and its parameters sent apart from it.
    from django.db.backends.postgresql.base import ServerBindingCursor

    return ServerBindingCursor


def _server_bound(conn):
    return _server_binding_cursor()(conn)


def execute(sql: str, params: Sequence, db=None) -> int:
    """Run one statement that returns no rows; its row count."""
    return _run(sql, params, _rowcount, db)


def _rowcount(cursor):
    return cursor.rowcount


# --- Model.save() of the hot rows, its SQL built once ----------------------------------------
#
# ``Model.save()`` builds and compiles its INSERT or UPDATE on every call (a few tenths of a
# millisecond: the write's version row and its UPDATE were a fifth of its CPU). These send the
# same statement, built once per process, with each value prepared by its field exactly as
# ``save()`` does (``pre_save``, then ``get_db_prep_save``: a sensitive value is sealed).
# A model with ``pre_save``/``post_save`` receivers, or one with parent models, goes through
# ``save()`` itself: these send no signals.


def _expression(value) -> bool:
    # An F() or other expression, or a model instance: the ORM compiles those per call.
    return hasattr(value, "resolve_expression") or hasattr(value, "prepare_database_save")


def _plain(model) -> bool:
    return not (signals.pre_save.has_listeners(model) or signals.post_save.has_listeners(model) or model._meta.parents)


def insert(obj) -> None:
    """``obj.save()`` of a new instance: one ``INSERT … RETURNING`` its primary key (and, as
    ``save()``, the fields that have a database default)."""
    model = type(obj)
    db = connections[DEFAULT_DB_ALIAS]
    if not (_plain(model) and db.features.can_return_columns_from_insert):
        _save(obj, force_insert=True)
        return
    sql, fields = _insert_plan(model, db.vendor)
    values = [f.pre_save(obj, True) for f in fields]
    if any(_expression(v) for v in values):
        _save(obj, force_insert=True)
        return
    params = [f.get_db_prep_save(v, db) for f, v in zip(fields, values, strict=True)]
    returning = model._meta.db_returning_fields

    def inserted(row):
        # What save() reads back: the primary key and the fields with a database default.
        for field, value in zip(returning, row, strict=True):
            setattr(obj, field.attname, value)
        obj._state.adding = False
        obj._state.db = DEFAULT_DB_ALIAS

    held = getattr(db, _HELD, None)
    if held is not None:
        held.append((sql, params, [db.ops.quote_name(f.column) for f in returning], inserted))
        return
    inserted(fetchone(sql, params))


def update(obj, names: Sequence[str], *, as_read: Sequence[tuple[str, object]] = ()) -> None:
    """``obj.save(update_fields=names)``: one ``UPDATE … WHERE pk``. As ``save()``, a row
    that is gone raises ``DatabaseError``.

    ``as_read`` — (attribute, value as read) pairs — updates the row only while it still holds
    those values (a write over a row read without a lock): held, inside :func:`holding` in a
    transaction of its own only (:func:`alone_in_one_statement`); a row that no longer
    matches makes the whole statement fail, nothing written, and raises :class:`RowChanged`
    where it is sent."""
    model = type(obj)
    db = connections[DEFAULT_DB_ALIAS]
    held = getattr(db, _HELD, None)
    plan = _update_plan(model, tuple(names), db.vendor) if _plain(model) else None
    values = [f.pre_save(obj, False) for f in plan[1]] if plan is not None else []
    if as_read and (plan is None or held is None or any(_expression(v) for v in values)):
        raise RuntimeError("an UPDATE of a row as read is sent held, in one statement")
    if plan is None or any(_expression(v) for v in values):
        _save(obj, update_fields=names)
        return
    sql, fields = plan
    params = [f.get_db_prep_save(v, db) for f, v in zip(fields, values, strict=True)]
    params.append(model._meta.pk.get_db_prep_value(obj.pk, db))
    if as_read:
        q = db.ops.quote_name
        table = q(model._meta.db_table)
        for name, value in as_read:
            field = model._meta.get_field(name)
            # Column names from the model; the values are parameters.
            sql += f" AND {table}.{q(field.column)} IS NOT DISTINCT FROM %s"  # nosec B608
            params.append(field.get_db_prep_value(value, db))
    if held is not None:
        matched = _ONE_MATCHED if as_read else "count(*)"
        held.append((sql + _RETURNING_ONE, params, [matched], lambda row: _updated(obj, row[0])))
        return
    _updated(obj, execute(sql, params))


# A held UPDATE of a row as read answers this: 1 when it matched its row; when it matched none,
# a division by zero, which fails the one statement (nothing of it is written).
_ONE_MATCHED = "1 / count(*)"
_RETURNING_ONE = " RETURNING 1"
_DIVISION_BY_ZERO = "22012"


class RowChanged(Exception):  # noqa: N818 - what happened: the row changed since it was read
    """A held UPDATE of a row as read (:func:`update` ``as_read``) found it changed: nothing
    of its statement was written."""


def alone_in_one_statement(*models) -> bool:
    """Whether statements held now (:func:`holding`) go as one statement that is a
    transaction of its own: PostgreSQL, unwatched, ``ZEROMEM_WRITE_ONE_STATEMENT`` on, outside
    any transaction and any other holding block — what :func:`update` ``as_read`` needs; and
    that the rows of ``models`` (those the caller will hold) are not saved through ``save()``
    (receivers: see above), which would send the held statements first, each on its own."""
    db = connections[DEFAULT_DB_ALIAS]
    return (
        all(_plain(model) for model in models)
        and settings.ZEROMEM_WRITE_ONE_STATEMENT
        and getattr(db, _HELD, None) is None
        and _unwatched_postgres(db)
        and own_transaction(db)
    )


def _save(obj, **kwargs) -> None:
    # Model.save() through Django's cursor: the statements held before it go first.
    held = getattr(connections[DEFAULT_DB_ALIAS], _HELD, None)
    if held:
        _send_held(held, None)
    obj.save(**kwargs)


def _updated(obj, rows: int) -> None:
    if rows == 0:
        raise DatabaseError("Save with update_fields did not affect any rows.")
    obj._state.db = DEFAULT_DB_ALIAS


@functools.cache
def _insert_plan(model, vendor: str) -> tuple[str, tuple]:
    meta = model._meta
    fields = tuple(f for f in meta.local_concrete_fields if f is not meta.auto_field and not f.generated)
    if any(hasattr(f, "get_placeholder") for f in fields):
        raise ValueError(f"{model.__name__}: a field with its own placeholder")
    db = connections[DEFAULT_DB_ALIAS]
    query = InsertQuery(model)
    query.insert_values(fields, [model()], raw=False)
    compiler = query.get_compiler(connection=db)
    compiler.returning_fields = list(meta.db_returning_fields)  # as save() asks for them
    ((sql, _params),) = compiler.as_sql()
    return sql, fields


@functools.cache
def _update_plan(model, names: tuple[str, ...], vendor: str) -> tuple[str, tuple] | None:
    """The UPDATE that ``save(update_fields=names)`` sends (SQLUpdateCompiler's shape:
    ``UPDATE t SET "a" = %s, … WHERE "t"."id" = %s``); None when a field is not a plain
    column with a plain placeholder (``save()`` then does it)."""
    meta = model._meta
    # In the model's order, as save() sends them.
    fields = tuple(f for f in meta.local_concrete_fields if f.name in names or f.attname in names)
    if len(fields) != len(set(names)) or any(
        not f.concrete or f.primary_key or f.generated or hasattr(f, "get_placeholder") for f in fields
    ):
        return None
    q = connections[DEFAULT_DB_ALIAS].ops.quote_name
    table = q(meta.db_table)
    sets = ", ".join(f"{q(f.column)} = %s" for f in fields)
    return f"UPDATE {table} SET {sets} WHERE {table}.{q(meta.pk.column)} = %s", fields  # nosec B608


# --- A write's statements in one ---------------------------------------------------------
#
# A write over an existing memory sent its UPDATE, its version INSERT and its audit INSERT one
# after the other, a round trip each. None of their results is needed before the next is
# sent: inside :func:`holding` (PostgreSQL, statements unwatched) :func:`update` and
# :func:`insert` hold theirs, and the next :func:`fetchone` of a plain ``INSERT … VALUES …
# RETURNING`` (the audit event) sends them with it as one statement, each a data-modifying
# ``WITH`` of it: ``WITH h0 AS (UPDATE … RETURNING 1), h1 AS (INSERT … RETURNING "id")
# INSERT … RETURNING "id", (SELECT count(*) FROM h0), (SELECT "id" FROM h1)``. One statement:
# all or nothing, its error the one the failing part raised (a constraint, a serialization
# failure), raised where the audit INSERT is sent, inside the same transaction, which then
# rolls back as before. psycopg's pipeline mode would also send them in one round trip, but
# its machinery cost more CPU than the round trips it saves here (``manage.py bench_write``).

_HELD = "_zeromem_held_statements"


@contextlib.contextmanager
def holding(*, piped: bool = False) -> Iterator[None]:
    """Hold :func:`update`'s and :func:`insert`'s statements until the next :func:`fetchone`
    (see above); any other statement of this module sends them first, and at the end of the
    block anything still held is sent (an exception drops it: the transaction rolls back).
    Only this module's statements may run after the first held one (Django's cursor would
    overtake them). A no-op on SQLite, with ``ZEROMEM_WRITE_ONE_STATEMENT`` off, or whenever
    statements are watched (``DEBUG``, ``CaptureQueriesContext``, execute wrappers, tracing):
    then each is sent at once, as before.

    A rate counter held (:func:`riding`) is sent first, alone — or, with ``piped`` and
    :func:`write_may_pipe`, kept to go with the statement in one round trip ("A write and the
    rate counter in one round trip", below)."""
    db = connections[DEFAULT_DB_ALIAS]
    if getattr(db, _RIDER, None) is not None and not (piped and write_may_pipe(db)):
        _release_rider(db)
    if not settings.ZEROMEM_WRITE_ONE_STATEMENT or getattr(db, _HELD, None) is not None or not _unwatched_postgres(db):
        yield
        return
    held: list = []
    setattr(db, _HELD, held)
    try:
        yield
        if held:
            _send_held(held, None)
    finally:
        setattr(db, _HELD, None)
        held.clear()


def holds_statements(db) -> bool:
    """Whether statements are held on ``db`` to go with the next one (:func:`holding`): a
    write's, which that statement then commits with. No query."""
    return bool(getattr(db, _HELD, None))


def _unwatched_postgres(db) -> bool:
    return db.vendor == "postgresql" and not db.queries_logged and not db.execute_wrappers and not tracing.on()


def _carries(sql: str) -> bool:
    # The statement the held ones may ride with: an INSERT of given values that reads nothing
    # (the held statements' changes are invisible to the other parts of one statement).
    return sql.startswith("INSERT INTO ") and " VALUES " in sql and " RETURNING " in sql and "SELECT" not in sql


def _send_held(held: list, last: tuple[str, Sequence] | None):
    db = connections[DEFAULT_DB_ALIAS]
    if getattr(db, _RIDER, None) is not None:
        _release_rider(db)  # the rate counter kept for a piped write (holding): first, alone
    items = list(held)
    held.clear()
    sql, params, width = _held_statement(items, last)
    try:
        row = _send(sql, params, _first, db)
    except DataError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == _DIVISION_BY_ZERO and _guarded(items):
            raise RowChanged() from exc
        raise
    return _held_answer(items, row, width, last)


def _held_statement(items: list, last: tuple[str, Sequence] | None, token: str | None = None):
    """The held statements and ``last`` as one: its SQL, its parameters and how many columns
    the held ones add to ``last``'s. With ``token``, an UPDATE of a row as read matches it only
    while the session's ``zm.read`` is ``token`` (a piped write, below)."""
    parts, params, extra = [], [], []
    for i, (sql, item_params, columns, _done) in enumerate(items):
        if token is not None and _ONE_MATCHED in columns:
            sql = f"{sql.removesuffix(_RETURNING_ONE)} AND current_setting('{_MARK}', true) = %s{_RETURNING_ONE}"
            item_params = [*item_params, token]
        parts.append(f"h{i} AS ({sql})")
        params.extend(item_params)
        # Column names this module quoted from the models (or count(*)): no input reaches them.
        extra.extend(f"(SELECT {c} FROM h{i})" for c in columns)  # nosec B608
    if last is None:
        main = "SELECT " + ", ".join(extra)
    else:
        main = f"{last[0]}, {', '.join(extra)}"
        params.extend(last[1])
    return f"WITH {', '.join(parts)} {main}", params, len(extra)


def _held_answer(items: list, row: tuple, width: int, last):
    # Each held statement's columns to its ``done``; ``last``'s own row returned.
    n = len(row) - width
    rest = row[n:]
    for _sql, _params, columns, done in items:
        done(rest[: len(columns)])
        rest = rest[len(columns) :]
    return row[:n] if last is not None else None


def _guarded(items: list) -> bool:
    # An UPDATE of a row as read among them: it fails the statement when it matches no row.
    return any(_ONE_MATCHED in columns for _sql, _params, columns, _done in items)


# --- A statement answered later -----------------------------------------------------------
#
# A read's audit INSERT is a transaction of its own, and its commit waits for the WAL flush
# (0.15–0.4 ms here), the longest wait of a read. Nothing the caller does next needs its
# answer (the event's id): building the tool's result, its JSON and the response. Inside
# :func:`answered_later` (the tool-call lane, memories/api/lane.py) :func:`fetchone_later`
# sends such a statement and returns; its answer is read when the block ends — so that work
# runs while PostgreSQL commits — or before any other statement of this module. The response
# is not sent before then: a statement that failed raises where the block ends, and the
# caller answers its error instead, as it would have had it raised at once. As for
# :func:`holding`, only this module's statements may run while one is pending (Django's cursor
# would find the connection busy).

_LATER = "_zeromem_answered_later"


@contextlib.contextmanager
def answered_later() -> Iterator[None]:
    """Let :func:`fetchone_later` send a statement whose answer is read when the block ends
    (see above; raised there if it failed). A no-op on SQLite, whenever statements are watched
    (``DEBUG``, ``CaptureQueriesContext``, execute wrappers, tracing), or nested."""
    db = connections[DEFAULT_DB_ALIAS]
    if getattr(db, _LATER, None) is not None or not _unwatched_postgres(db):
        yield
        return
    pending: list = []
    setattr(db, _LATER, pending)
    try:
        yield
    except BaseException as exc:
        # The statement's answer is read all the same (the connection must be free again). Had
        # it failed where it was sent, nothing after it would have run: its error is raised,
        # unless the block's is an interrupt (KeyboardInterrupt, SystemExit), which goes on.
        try:
            _read_later(db)
        except Exception as failed:
            if isinstance(exc, Exception):
                raise failed from exc
        raise
    else:
        _read_later(db)
    finally:
        setattr(db, _LATER, None)


def fetchone_later(sql: str, params: Sequence, db=None, *, done: Callable[[], None] | None = None) -> bool:
    """Inside :func:`answered_later`, send ``sql`` — a statement that is a transaction of its
    own (autocommit, no transaction, nothing held or riding), whose answer the caller does not
    need — and return True: its answer is read later, and ``done()`` called once it has
    succeeded. Otherwise send nothing and return False (the caller sends it as usual)."""
    if db is None:
        db = connections[DEFAULT_DB_ALIAS]
    pending = getattr(db, _LATER, None)
    conn = db.connection
    if (
        pending is None
        or pending
        or conn is None
        or getattr(db, _HELD, None)
        or getattr(db, _RIDER, None) is not None
        or not _unwatched_postgres(db)
        or db.allow_thread_sharing
        or getattr(conn, "prepare_threshold", None) is None
        or not own_transaction(db)
    ):
        return False
    db.validate_thread_sharing()
    db.validate_no_broken_transaction()
    cursor = _kept_cursor(conn, sql)
    # What cursor.execute() runs, driven only until it first waits: the statement is sent
    # (prepared, as _execute sends it), its answer not yet read (psycopg's generator, resumed
    # by _read_later where it stopped).
    gen = cursor._execute_gen(sql, params, prepare=True)
    try:
        with db.wrap_database_errors, conn.lock:
            state = next(gen)
    except StopIteration:
        state = None  # answered already
    except BaseException:
        _drop_kept_cursor(conn, sql)
        raise
    if state is None:
        if done is not None:
            done()
        return True
    pending.append(_Later(conn, gen, state, sql, done))
    return True


class _Later(NamedTuple):
    conn: object
    gen: object
    state: object
    sql: str
    done: Callable[[], None] | None

    def finish(self, db) -> None:
        try:
            with db.wrap_database_errors, self.conn.lock:
                self.conn.wait(_resumed(self.gen, self.state))
        except BaseException:
            _drop_kept_cursor(self.conn, self.sql)
            raise
        if self.done is not None:
            self.done()


def read_pending(db=None) -> None:
    """Read now the answer of any statement answered later (:func:`answered_later`, a piped
    read's event): raised here if it failed."""
    _read_later(connections[DEFAULT_DB_ALIAS] if db is None else db)


def _read_later(db) -> None:
    pending = getattr(db, _LATER, None)
    while pending:  # one finishing may send another (an event written after all): read too
        pending.pop().finish(db)


def _resumed(gen, state):
    # The generator as psycopg's wait() drives it, from the wait it stopped at.
    while True:
        ready = yield state
        try:
            state = gen.send(ready)
        except StopIteration as stop:
            return stop.value


# --- A statement that rides with the next read -----------------------------------------------
#
# A tool read sent the rate limit's counter (audit/limits.py, an UPSERT) and then its SELECT,
# a round trip each, though neither needs the other's answer to be sent. Inside
# :func:`riding` (PostgreSQL, statements unwatched) the counter is held, and the next
# :func:`fetchone` of a plain ``SELECT`` carries it as one statement: ``WITH zm_rider AS
# (INSERT … RETURNING count) SELECT zm_rider.*, zm_read.* FROM zm_rider LEFT JOIN LATERAL
# (SELECT 1, s.* FROM (SELECT …) s) zm_read ON true`` — the counter's row always, the read's
# when there is one. The rider's answer is handed to its ``done`` before the read's is
# returned; ``done`` may raise (the counter past its limit), and nothing else has been sent
# by then: no write, no audit event. Any other statement of this module (an audit event of a
# refused call, a write) sends the rider alone first, as before; so does the end of the block
# if nothing was sent. As for :func:`holding`, only this module's statements may run while a
# rider is held (Django's cursor would overtake it).

_RIDER = "_zeromem_rider"
_riding_sql: dict[tuple[str, str], str] = {}
_RIDING_SQL_MAX = 64


class Rider(NamedTuple):
    sql: Callable[[bool], str]  # the statement, as a transaction of its own (True) or inside one
    params: Sequence
    done: Callable[[tuple], None]  # given its row (RETURNING); may raise
    width: int = 1  # the columns it returns
    # The highest ``count`` (a column it returns) its ``done`` lets pass, when it says one: a
    # read's event may then go with the read (:func:`_send_piped`).
    limit: int | None = None


@contextlib.contextmanager
def riding(rider: Rider) -> Iterator[None]:
    """Hold ``rider`` until the next :func:`fetchone` of a plain ``SELECT`` (see above), sent
    with it as one statement; any other statement of this module, or the end of the block
    (an exception too), sends it alone first. Sent at once (before the block) on SQLite,
    whenever statements are watched (``DEBUG``, ``CaptureQueriesContext``, execute wrappers,
    tracing), or inside :func:`holding`."""
    db = connections[DEFAULT_DB_ALIAS]
    if getattr(db, _RIDER, None) is not None or getattr(db, _HELD, None) is not None or not _unwatched_postgres(db):
        _send_rider(rider, db)
        yield
        return
    setattr(db, _RIDER, rider)
    try:
        yield
    finally:
        if getattr(db, _RIDER, None) is rider:
            _release_rider(db)


def send_rider() -> None:
    """Send the statement held by :func:`riding`, if any, now (alone): before a transaction
    begins, which would otherwise take it in (and hold its row's lock to the end)."""
    db = connections[DEFAULT_DB_ALIAS]
    if getattr(db, _RIDER, None) is not None:
        _release_rider(db)


def _release_rider(db) -> None:
    rider = getattr(db, _RIDER)
    setattr(db, _RIDER, None)
    _send_rider(rider, db)


def own_transaction(db) -> bool:
    """Whether a statement sent now on ``db`` is a transaction of its own (autocommit, no
    atomic block), without checking a connection out when none is."""
    if db.connection is None:
        # Not checked out yet (get_autocommit() would check it out now, and the pool check it):
        # it will be in autocommit as configured, outside any atomic block (which connects).
        return bool(db.settings_dict["AUTOCOMMIT"]) and not db.in_atomic_block
    return db.get_autocommit() and not db.in_atomic_block


def _send_rider(rider: Rider, db) -> None:
    rider.done(_send(rider.sql(own_transaction(db)), rider.params, _first, db))


def _rideable(sql: str) -> bool:
    # A plain read: its rows are the statement's (no lock taken, nothing written).
    return sql.startswith("SELECT ") and " FOR " not in sql


def _send_riding(rider: Rider, sql: str, params: Sequence, db):
    own = rider.sql(own_transaction(db))
    combined = _riding_sql.get((own, sql))
    if combined is None:
        if len(_riding_sql) >= _RIDING_SQL_MAX:
            _riding_sql.clear()
        # Both parts are this module's callers' compiled statements: no input reaches them.
        combined = _riding_sql[(own, sql)] = (
            f"WITH zm_rider AS ({own}) SELECT zm_rider.*, zm_read.* FROM zm_rider LEFT JOIN LATERAL "  # nosec B608
            f"(SELECT 1 AS zm_found, zm_select.* FROM ({sql}) AS zm_select) AS zm_read ON true"
        )
    try:
        row = _send(combined, [*rider.params, *params], _first, db, reads=True)
    except DatabaseError:
        _count_alone(rider, db)
        raise
    rider.done(row[: rider.width])
    return None if row[rider.width] is None else row[rider.width + 1 :]


def _count_alone(rider: Rider, db) -> None:
    # The counter went down with the read's statement (cancelled, timed out): taken alone now,
    # as it would have been had it been sent first, if the connection still takes statements
    # (past the limit ``done`` raises: the caller's 429); else the read's error is raised — at
    # once: with no connection to be had, the pool has waited its timeout already.
    counted = None
    if db.connection is not None and not dbpool.broken(db):
        try:
            counted = _send(rider.sql(own_transaction(db)), rider.params, _first, db)
        except DatabaseError:
            counted = None
    if counted is not None:
        rider.done(counted)


# --- An event that rides the read it records ----------------------------------------------
#
# A read's audit event is an INSERT of its own after the read's SELECT: two round trips, the
# second one waiting for the WAL flush. The event holds what the read found (its version, its
# subject), so it cannot be sent before the SELECT is answered — unless the caller can tell
# what the row will hold: a read of a key this process read or wrote lately, whose row has not
# changed since. Inside :func:`event_riding` the event — its digest computed over the values
# expected — is held, and the next :func:`fetchone` of a plain ``SELECT`` carries it as one
# statement::
#
#     WITH zm_read AS (SELECT 1 AS zm_found, zm_select.* FROM (SELECT …) AS zm_select),
#          zm_event AS (INSERT INTO audit (…) SELECT %s, … FROM zm_read
#                       WHERE zm_read.version IS NOT DISTINCT FROM %s AND … RETURNING id)
#     SELECT (SELECT id FROM zm_event), zm_read.* FROM (SELECT 1) AS zm_one LEFT JOIN zm_read ON true
#
# The event is inserted only when the row read holds every value expected: then it is exactly
# the event the read would have written after it, in the same transaction as the read, and its
# ``done`` is given its id. Otherwise nothing of it is written (no row, another version) and the
# caller records the event of what it found, one round trip later, as before.
#
# Not with the rate counter riding the same read (:func:`riding`, a tool call without Redis):
# the counter's row lock would then be held until the event's commit — through its WAL flush —
# and every other request of the same key would queue behind it (measured: reads at 16 clients
# of one key fell from 0.53× to 0.32× /healthz's throughput). The counter rides the SELECT and
# the event follows, as before.
#
# A point read whose connection turns out dead once it was sent goes again on a checked one
# (``_send``'s ``reads``): this statement goes again as the SELECT alone, and the caller writes
# the event of what it finds. Had the first statement committed before its answer was lost (its
# backend ended in the microseconds between), the read has two events, each with its own uid,
# under one request id — recorded twice, never unrecorded, and the log still verifies (the same
# statement sent twice would have written one event twice, uid included: a copy the verifier
# reports as tampering). A backend that ended while idle in the pool is caught before anything
# is sent (``dbpool.unread_input``).

_EVENT = "_zeromem_riding_event"
_event_sql: dict[tuple, str] = {}
_VALUES = re.compile(r" VALUES \(((?:%s, )*%s)\) RETURNING ")


class Event(NamedTuple):
    sql: str  # INSERT INTO … (…) VALUES (%s, …) RETURNING its id
    # Its parameters, built when it is sent (piped: while the read's statement runs).
    params: Callable[[], Sequence]
    expect: Sequence[tuple[str, object]]  # (column of the row read, value it must hold)
    # Given the event's id once it is inserted; piped (:func:`_send_piped`), given None first,
    # as the read's row says the event is being written (its id follows, when it is read).
    done: Callable[[object], None]
    # Piped: called when the event the read's row announced was not written after all (the
    # read's transaction failed to commit once its row was sent): the caller writes it now.
    lost: Callable[[], None] | None = None


def event_may_ride(db=None) -> bool:
    """Whether an event held now (:func:`event_riding`) could ride the next read: PostgreSQL,
    unwatched (no ``DEBUG``, ``CaptureQueriesContext``, execute wrappers, tracing), outside any
    transaction, nothing held, no rate counter riding, no event held already. No query."""
    if db is None:
        db = connections[DEFAULT_DB_ALIAS]
    rider = getattr(db, _RIDER, None)
    return (
        getattr(db, _EVENT, None) is None
        and getattr(db, _HELD, None) is None
        and _unwatched_postgres(db)
        and own_transaction(db)
        and (rider is None or (rider.limit is not None and _pipelines(db)))
    )


@contextlib.contextmanager
def event_riding(event: Event) -> Iterator[bool]:
    """Hold ``event`` for the next :func:`fetchone` of this block (see above): sent with it
    when it is a plain ``SELECT``, else dropped, never sent alone. Yields whether it is held
    (:func:`event_may_ride`; a caller asks that first, before building the event)."""
    db = connections[DEFAULT_DB_ALIAS]
    if not event_may_ride(db) or _VALUES.search(event.sql) is None:
        yield False
        return
    setattr(db, _EVENT, event)
    try:
        yield True
    finally:
        setattr(db, _EVENT, None)


def _send_with_event(event: Event, sql: str, params: Sequence, db):
    columns = tuple(column for column, _value in event.expect)
    shape = (event.sql, sql, columns)
    combined = _event_sql.get(shape)
    if combined is None:
        if len(_event_sql) >= _RIDING_SQL_MAX:
            _event_sql.clear()
        combined = _event_sql[shape] = _with_event(*shape)
    values = [*params, *event.params(), *(value for _column, value in event.expect)]
    # Sent again on a checked connection (its own died under it): the SELECT alone — the
    # event, had it been written before the answer was lost, is not written a second time
    # with the same uid; the caller writes the event of what it finds, as with no event riding.
    event_id, found, *row = _send(combined, values, _first, db, reads=True, again=(sql, params, _alone))
    if event_id is not None:
        event.done(event_id)
    return None if found is None else tuple(row)


def _alone(cursor) -> tuple:
    # The answer of the read sent without its event, in the shape of the statement with it.
    row = cursor.fetchone()
    return (None, None) if row is None else (None, 1, *row)


def _with_event(insert: str, sql: str, columns: tuple) -> str:
    # Every part is a compiled statement of this module's callers (the read's, the event's
    # INSERT) or a column name the caller took from its model: no input reaches it.
    values = _VALUES.search(insert)
    where = " AND ".join(f"zm_read.{column} IS NOT DISTINCT FROM %s" for column in columns) or "true"
    event = (
        f"{insert[: values.start()]} SELECT {values.group(1)} FROM zm_read WHERE {where}"  # nosec B608
        f" RETURNING {insert[values.end() :]}"
    )
    return (
        f"WITH zm_read AS (SELECT 1 AS zm_found, zm_select.* FROM ({sql}) AS zm_select), "  # nosec B608
        f"zm_event AS ({event}) SELECT (SELECT zm_event.id FROM zm_event), zm_read.* "
        "FROM (SELECT 1) AS zm_one LEFT JOIN zm_read ON true"
    )


# --- A read and its event in one round trip: two transactions, pipelined -------------------
#
# With the event inside the read's statement (above) the read's row comes back only once the
# event has committed, through its WAL flush: nothing else can happen meanwhile. And with the
# rate counter in that statement its row lock would be held through the flush. Inside
# :func:`answered_later` (the tool-call lane) the read and its event go instead as two
# statements of libpq's pipeline mode, sent together (one round trip), each a transaction of
# its own (a Sync after each):
#
#   T1  the read (with the counter riding it, when it does), which also sets a setting of the
#       session, ``zm.read``, to a token drawn for this read — only when its row holds every
#       value expected and the counter is within its limit: ``set_config('zm.read', CASE WHEN …
#       THEN %s ELSE '' END, false)``, a column of its answer;
#   T2  the event's INSERT … SELECT …, of one row only ``WHERE current_setting('zm.read') =``
#       that token.
#
# T2 runs once T1 has committed (the counter's lock is gone, its commit does not wait for the
# flush) and writes the event only when T1 did commit with the row as expected: then it is
# exactly the event the read would have written after it, and the caller knows it from T1's
# answer (the token came back) — its own ``done(None)`` — without waiting for T2. A failed T1
# rolls its setting back, so T2 writes nothing; a setting left from an earlier read holds
# another token. T2's answer (the event's id) is read when the block ends, while the caller
# has built the read's answer meanwhile: the event's commit and flush overlap the work after
# the read, instead of following it. Otherwise (no token) nothing of the event is written and
# the caller records what it found, as without this.
#
# The statements are prepared once per connection, named and remembered by psycopg's own
# bookkeeping as its cursors' are (psycopg deallocates them all when a transaction on the
# connection rolls back), and sent with the connection's own adaptation (psycopg's
# Transformer: the dumpers and loaders a cursor would use). A connection checked out for this
# read without the pool's check that turns out dead is caught before anything is sent
# (``dbpool.unread_input``); one that dies once they are sent sends the read again on a
# checked connection, alone: the caller writes the event of what it finds (had T2 committed
# before the answer was lost, the read has two events, each with its own uid: recorded twice,
# never unrecorded). Only this module's statements may run while T2's answer is pending
# (Django's cursor would find the connection in pipeline mode): as for :func:`answered_later`.

_MARK = "zm.read"
_PIPED = "_zeromem_hotsql_piped"  # on the psycopg connection: _Piped
_piped_sql: dict[tuple, tuple[str, str]] = {}


def _pipelines(db) -> bool:
    """Whether a read and its event may go pipelined now (see above): PostgreSQL, unwatched,
    inside :func:`answered_later` with nothing pending, prepared statements on (not through
    PgBouncer), a connection of this thread's own, outside any transaction."""
    pending = getattr(db, _LATER, None)
    if pending is None or pending or db.allow_thread_sharing or not _unwatched_postgres(db):
        return False
    if settings.ZEROMEM_PGBOUNCER:  # in transaction mode T1 and T2 may reach two server sessions
        return False
    conn = db.connection
    if conn is not None:
        prepares = getattr(conn, "prepare_threshold", None) is not None
    else:
        prepares = db.settings_dict.get("OPTIONS", {}).get("prepare_threshold", 5) is not None
    return prepares and own_transaction(db)


class _Piped:
    """What one psycopg connection keeps for piped statements: the adaptation context and each
    statement's converted query (its parameters dumped again for each call)."""

    def __init__(self, conn):
        self.tx = Transformer(conn)
        self.queries: dict[str, object] = {}

    def query(self, sql: str, params: Sequence):
        q = self.queries.get(sql)
        if q is None:
            if len(self.queries) >= _KEPT_MAX:
                self.queries.clear()
            q = self.queries[sql] = PostgresQuery(self.tx)
            q.convert(sql, params)
        else:
            q.dump(params)
        return q


def _send_prepared(conn, q) -> tuple:
    """Queue ``q`` in the pipeline, prepared, and a Sync after it (its own transaction). The
    statement's name comes from psycopg's own bookkeeping (``conn._prepared``, as its cursors'
    ``prepare=True``): psycopg deallocates every prepared statement of a connection when a
    transaction on it rolls back (``DEALLOCATE ALL``), and forgets them then — ours with them."""
    pgconn = conn.pgconn
    prep, name = conn._prepared.get(q, True)
    if prep is Prepare.SHOULD:
        pgconn.send_prepare(name, q.query, param_types=q.types)
    pgconn.send_query_prepared(name, q.params, param_formats=q.formats)
    pgconn.pipeline_sync()
    return conn._prepared.maybe_add_to_cache(q, prep, name), prep, name


def _piped_statements(event: Event, rider: Rider | None, sql: str, own: str | None) -> tuple[str, str]:
    columns = tuple(column for column, _value in event.expect)
    shape = (event.sql, sql, columns, own)
    found = _piped_sql.get(shape)
    if found is not None:
        return found
    if len(_piped_sql) >= _RIDING_SQL_MAX:
        _piped_sql.clear()
    # Every part is a compiled statement of this module's callers, a column name the caller took
    # from its model, or this module's own: no input reaches them.
    if rider is None:
        where = " AND ".join(f"zm_select.{c} IS NOT DISTINCT FROM %s" for c in columns) or "true"
        read = (
            f"SELECT zm_select.*, set_config('{_MARK}', CASE WHEN {where} THEN %s ELSE '' END, false) "  # nosec B608
            f"FROM ({sql}) AS zm_select"
        )
    else:
        where = " AND ".join(
            ["zm_read.zm_found IS NOT NULL", "zm_rider.count <= %s"]
            + [f"zm_read.{c} IS NOT DISTINCT FROM %s" for c in columns]
        )
        read = (
            f"WITH zm_rider AS ({own}) SELECT zm_rider.*, zm_read.*, "  # nosec B608
            f"set_config('{_MARK}', CASE WHEN {where} THEN %s ELSE '' END, false) FROM zm_rider LEFT JOIN LATERAL "
            f"(SELECT 1 AS zm_found, zm_select.* FROM ({sql}) AS zm_select) AS zm_read ON true"
        )
    values = _VALUES.search(event.sql)
    insert = (
        f"{event.sql[: values.start()]} SELECT {values.group(1)} "  # nosec B608
        f"WHERE current_setting('{_MARK}', true) = %s RETURNING {event.sql[values.end() :]}"
    )
    found = _piped_sql[shape] = (read, insert)
    return found


def _send_piped(event: Event, rider: Rider | None, sql: str, params: Sequence, db):
    own = rider.sql(own_transaction(db)) if rider is not None else None
    read, insert = _piped_statements(event, rider, sql, own)
    token = uuid.uuid4().hex
    expected = [value for _column, value in event.expect]
    if rider is None:
        read_params = [*expected, token, *params]
    else:
        read_params = [*rider.params, rider.limit, *expected, token, *params]
    db.close_if_health_check_failed()
    # The read as its connection's check (``_send``'s ``reads``): checked out without the pool's
    # empty query when it is the request's first statement.
    unchecked = db.connection is None and dbpool.read_checks(db)
    try:
        if unchecked:
            dead = not _checked_out_unchecked(db)  # a dead one dropped, nothing sent
        else:
            db.ensure_connection()
            dead = False
        if not dead:
            row = _piped(event, rider, (read, read_params), insert, token, db)
    except DatabaseError:
        if not (unchecked and db.connection is not None and dbpool.broken(db)):
            if rider is not None:  # as _send_riding: the counter taken alone if it went down
                _count_alone(rider, db)
            raise
        _dead_dropped(db)  # it died under the read
        dead = True
    else:
        if not dead:
            # The read committed: its row handed on outside the ``except`` above (a counter's
            # ``done`` that fails must not count the call again, as in _send_riding).
            return _piped_answer(event, rider, row, token, db)
    # A dead connection (dropped): the read again, alone, on a connection the pool checks;
    # the caller writes the event of what it finds.
    db.ensure_connection()
    if rider is not None:
        return _send_riding(rider, sql, params, db)
    return _send(sql, params, _first, db)


def _pipe_of(db) -> tuple:
    """The connection of ``db``, checked as for any statement of this module, and what it keeps
    for piped statements (:class:`_Piped`)."""
    db.validate_thread_sharing()
    db.validate_no_broken_transaction()
    conn = db.connection
    kept = conn.__dict__.get(_PIPED)
    if kept is None:
        kept = conn.__dict__[_PIPED] = _Piped(conn)
    return conn, kept


def _piped(event: Event, rider: Rider | None, read: tuple, insert: str, token: str, db):
    conn, kept = _pipe_of(db)
    pgconn = conn.pgconn
    with db.wrap_database_errors:
        with conn.lock:
            pgconn.enter_pipeline_mode()
            try:
                # The read goes at once (a Sync flushes what is queued); the event is built
                # while it runs, and follows it.
                sent1 = _send_prepared(conn, kept.query(*read))
                sent2 = _send_prepared(conn, kept.query(insert, [*event.params(), token]))
                conn.wait(generators.send(pgconn))
                results = conn.wait(_segment(pgconn))
            except BaseException:
                _abandon(conn)
                raise
    pending = _PipedEvent(conn, sent2, event)
    try:
        with db.wrap_database_errors:
            answer = _answer_of(results, kept, conn, sent1)
    except BaseException:
        pending.finish(db)  # a row that fails to load: T2's answer read, out of pipeline mode
        raise
    if not isinstance(answer, tuple):
        # T1 failed: T2 wrote nothing (the token was not set). Its answer is read now, the
        # connection left as it was, and the read's error raised.
        pending.finish(db)
        with db.wrap_database_errors:
            raise answer
    (row,) = answer
    pending.marked = row is not None and row[-1] == token
    if pending.marked:
        getattr(db, _LATER).append(pending)  # the event's commit overlaps the answer's building
    else:
        # No event written: T2's answer read now, so whatever the caller does with a row not
        # as expected (a sealed value opened: the key store's ORM query; its own event) finds
        # the connection out of pipeline mode.
        pending.finish(db)
    return row


def _piped_answer(event: Event, rider: Rider | None, row, token: str, db):
    width = rider.width if rider is not None else 0
    if rider is not None:
        rider.done(row[:width])  # may raise (past the limit): T2 writes nothing then
        if row[width] is None:
            return None
    elif row is None:
        return None
    if row[-1] == token:
        event.done(None)
    return row[width + 1 : -1] if rider is not None else row[:-1]


def _segment(pgconn):
    # The results of the pipeline up to its next Sync (psycopg's generators: the GIL released
    # while waiting).
    results, empty = [], 0
    while True:
        got = yield from generators.fetch_many(pgconn)
        if not got:
            empty += 1  # a query's end read; twice in a row: nothing is coming
            if empty > 1:
                raise pg_errors.InternalError("the pipeline's Sync never came")
            continue
        empty = 0
        if got[0].status == pq.ExecStatus.PIPELINE_SYNC:
            return results
        results.extend(got)


def _outcome(results, conn, sent: tuple):
    """A piped statement's rows (its PGresult) or None, and its error or None; psycopg's
    bookkeeping told how it ran. A statement prepared now is the server's once its Parse
    succeeded, however its run went: psycopg is told so (told of the run's failure, it forgets
    the name while the server keeps the statement, and prepares it again under a new one — one
    more on the server at every failing run: a write refused past the limit, every time)."""
    key, prep, name = sent
    rows, error = None, None
    told = key is None
    for result in results:
        status = result.status
        if not told and status in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.FATAL_ERROR, pq.ExecStatus.TUPLES_OK):
            conn._prepared.validate(key, prep, name, [result])  # the Parse's (prepared now), or the run's
            told = True
        if status == pq.ExecStatus.TUPLES_OK:
            rows = result
        elif error is None and status == pq.ExecStatus.FATAL_ERROR:
            error = pg_errors.error_from_result(result, encoding=conn.pgconn._encoding)
    return rows, error


def _answer_of(results, kept: _Piped, conn, sent: tuple):
    """A piped statement's answer (T1's): (its first row or None,), or the error to raise."""
    rows, error = _outcome(results, conn, sent)
    if error is not None:
        return error
    if rows is None:
        return pg_errors.InternalError("a piped statement gave no answer")
    if rows.ntuples == 0:
        return (None,)
    kept.tx.set_pgresult(rows)
    return (kept.tx.load_row(0, tuple),)


def _abandon(conn) -> None:
    # A pipeline whose sending or reading failed (the network, an interrupt): left if it can
    # be; with answers still outstanding the connection is closed (the pool drops it), never
    # handed on mid-pipeline.
    try:
        conn.pgconn.exit_pipeline_mode()
    except Exception:  # noqa: BLE001 - answers outstanding, or a connection gone
        conn.close()


class _PipedEvent:
    """T2, whose answer is read when the caller's :func:`answered_later` block ends (or before
    the next statement of this module)."""

    def __init__(self, conn, sent: tuple, event: Event):
        self.conn = conn
        self.sent = sent
        self.event = event
        self.marked = False  # T1's row came back with the token: T2 is writing the event

    def finish(self, db) -> None:
        conn = self.conn
        with db.wrap_database_errors, conn.lock:
            try:
                results = conn.wait(_segment(conn.pgconn))
            except BaseException:
                _abandon(conn)
                raise
            try:
                conn.pgconn.exit_pipeline_mode()
            except BaseException:
                _abandon(conn)  # something else queued meanwhile: never handed on mid-pipeline
                raise
            rows, error = _outcome(results, conn, self.sent)
            event_id = int(rows.get_value(0, 0)) if rows is not None and rows.ntuples else None
            if error is not None and self.marked:
                raise error
        if event_id is not None:
            self.event.done(event_id)
        elif self.marked and self.event.lost is not None:
            self.event.lost()


# --- A write and the rate counter in one round trip: two transactions, pipelined -------------
#
# A write over a live memory outside any transaction is the rate counter riding the memory's
# SELECT, then its UPDATE — only while the row is as read — with its version row and event as
# one statement: two round trips. When the caller knows the row without reading it — as this
# process last saw it (memories/services/last_seen.py), which the UPDATE's own conditions check
# — the SELECT is not needed, and inside :func:`answered_later` (the tool-call lane) the counter
# and the statement go as two statements of libpq's pipeline mode, sent together, each a
# transaction of its own, as a read and its event do (above):
#
#   T1  the counter (:func:`riding`), which also sets ``zm.read`` to a token drawn for this
#       write — only when the count is within its limit;
#   T2  the write's statement (:func:`holding`), its UPDATE matching its row only while
#       ``current_setting('zm.read')`` is that token: else it matches none, and the statement
#       fails as a row changed since it was read fails it (nothing of it written).
#
# T2 runs once T1 has committed (the counter's lock is gone; its commit does not wait for the
# flush). Both answers are read at once: past the limit the counter's ``done`` raises (T2 wrote
# nothing); a row not as the caller expected raises :class:`RowChanged` — the call counted, T2
# nothing written — and the caller reads the row and writes over it as before (the counter is
# not sent again). A connection checked out for the write without the pool's check is checked
# as a read's is, before anything is sent (``dbpool.unread_input``); one that dies once they are
# sent raises (the write unacknowledged, as any write whose connection dies).


def write_may_pipe(db=None) -> bool:
    """Whether a write's statements held now (:func:`holding` ``piped``) would go pipelined
    with the rate counter held (see above): a counter with a limit held, PostgreSQL,
    unwatched, inside :func:`answered_later` with nothing pending, prepared statements on,
    outside any transaction, ``ZEROMEM_WRITE_ONE_STATEMENT`` and ``ZEROMEM_WRITE_PIPED`` on.
    No query."""
    if db is None:
        db = connections[DEFAULT_DB_ALIAS]
    rider = getattr(db, _RIDER, None)
    return (
        rider is not None
        and rider.limit is not None
        and settings.ZEROMEM_WRITE_PIPED
        and settings.ZEROMEM_WRITE_ONE_STATEMENT
        and _pipelines(db)
    )


_counter_sql: dict[str, str] = {}


def _counter_statement(own: str) -> str:
    found = _counter_sql.get(own)
    if found is None:
        if len(_counter_sql) >= _RIDING_SQL_MAX:
            _counter_sql.clear()
        # The counter's statement is this module's caller's compiled one: no input reaches it.
        found = _counter_sql[own] = (
            f"WITH zm_rider AS ({own}) SELECT zm_rider.*, "  # nosec B608
            f"set_config('{_MARK}', CASE WHEN zm_rider.count <= %s THEN %s ELSE '' END, false) FROM zm_rider"
        )
    return found


def _send_write_piped(rider: Rider, held: list, last: tuple[str, Sequence], db):
    items = list(held)
    held.clear()
    token = uuid.uuid4().hex
    counter = (_counter_statement(rider.sql(True)), [*rider.params, rider.limit, token])
    written = _held_statement(items, last, token)
    db.close_if_health_check_failed()
    try:
        if db.connection is None and dbpool.read_checks(db):
            # As a read's: checked out without the pool's round trip, if it is not dead (it is
            # dropped then, nothing sent, and one the pool checks comes).
            _checked_out_unchecked(db)
        db.ensure_connection()
        counted, row = _pipe_two(counter, written[:2], db)
    except DatabaseError as exc:
        if dbpool.broken(db):
            # Whatever the driver made of it (a pipeline cut short): the connection is gone, the
            # write unacknowledged — answered as any lost connection is (503).
            if isinstance(exc, OperationalError):
                raise
            raise OperationalError("the connection to the database was lost during the write") from exc
        _count_alone(rider, db)
        raise
    if not isinstance(counted, tuple):
        # T1 failed (T2 wrote nothing: the token was not set): counted alone, if it can be.
        _count_alone(rider, db)
        with db.wrap_database_errors:
            raise counted
    rider.done(counted[: rider.width])  # past the limit: raises (T2 wrote nothing)
    if not isinstance(row, tuple):
        if getattr(row, "sqlstate", None) == _DIVISION_BY_ZERO and _guarded(items):
            raise RowChanged() from row
        with db.wrap_database_errors:
            raise row
    return _held_answer(items, row, written[2], last)


def _pipe_two(first: tuple[str, Sequence], second: tuple[str, Sequence], db) -> tuple:
    """``first`` and ``second``, each a transaction of its own, sent together in pipeline
    mode: the first row of each, or its error (psycopg's; a statement that returned no row
    fails as one)."""
    conn, kept = _pipe_of(db)
    pgconn = conn.pgconn
    with db.wrap_database_errors, conn.lock:
        pgconn.enter_pipeline_mode()
        try:
            sent = [_send_prepared(conn, kept.query(*first)), _send_prepared(conn, kept.query(*second))]
            conn.wait(generators.send(pgconn))
            results = [conn.wait(_segment(pgconn)), conn.wait(_segment(pgconn))]
            pgconn.exit_pipeline_mode()
        except BaseException:
            _abandon(conn)
            raise
    answers = []
    for got, one in zip(results, sent, strict=True):
        with db.wrap_database_errors:
            answer = _answer_of(got, kept, conn, one)
        if isinstance(answer, tuple):  # both statements return a row: none is a failure
            (answer,) = answer
            answer = pg_errors.InternalError("a piped statement returned no row") if answer is None else answer
        answers.append(answer)
    return tuple(answers)


# --- Instances without Model.__init__ ---------------------------------------------------------
#
# Building a hot row's instance through ``Model.__init__`` loops over every field (most of the
# cost of a memory read from its row, or of a write's version row). Where ``__init__`` would only
# set attributes, a caller may set them itself (``object.__new__`` and the ``__dict__``): the
# memory read (memories/selectors), the version row (memories/services/memories.py).


def built_without_init(model) -> bool:
    """Whether an instance of ``model`` may be built by setting its attributes: Model's own
    ``__init__``, no ``__new__``, no field attribute with a setter of its own (a foreign key's
    id aside: its setter only drops a cached object a new instance does not have), and no
    ``pre_init``/``post_init`` receiver now."""
    return (
        _plain_init(model) and not signals.pre_init.has_listeners(model) and not signals.post_init.has_listeners(model)
    )


@functools.cache
def _plain_init(model) -> bool:
    from django.db.models import Model
    from django.db.models.fields.related_descriptors import ForeignKeyDeferredAttribute

    if model.__init__ is not Model.__init__ or "__new__" in vars(model):
        return False
    for field in model._meta.concrete_fields:
        descriptor = getattr(model, field.attname, None)
        if hasattr(type(descriptor), "__set__") and not isinstance(descriptor, ForeignKeyDeferredAttribute):
            return False
    return True
