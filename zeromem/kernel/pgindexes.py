"""PostgreSQL indexes built ``CONCURRENTLY`` by migrations that are not atomic."""

from __future__ import annotations


def drop_if_invalid(cursor, name: str) -> None:
    """Drop the index ``name`` when an interrupted ``CREATE INDEX CONCURRENTLY`` (a lock or
    statement timeout, a killed deploy) left it INVALID: the planner never uses such an index,
    every write still maintains it, and ``CREATE INDEX … IF NOT EXISTS`` would keep it. The
    migration run again then builds it."""
    cursor.execute(
        "SELECT NOT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = %s",
        [name],
    )
    row = cursor.fetchone()
    if row and row[0]:
        cursor.execute(f"DROP INDEX CONCURRENTLY {name}")


def create(schema_editor, name: str, sql: str) -> None:
    """Build the index ``name`` with ``sql`` (a ``CREATE INDEX {concurrently} IF NOT EXISTS …``):
    ``CONCURRENTLY`` on PostgreSQL — writes go on; the migration must not be atomic — after
    dropping what an interrupted earlier run left invalid; plainly on SQLite."""
    postgresql = schema_editor.connection.vendor == "postgresql"
    if postgresql:
        with schema_editor.connection.cursor() as cursor:
            drop_if_invalid(cursor, name)
    schema_editor.execute(sql.format(concurrently="CONCURRENTLY" if postgresql else ""))


def drop(schema_editor, name: str) -> None:
    """Drop the index ``name`` if it exists (``CONCURRENTLY`` on PostgreSQL)."""
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS {name}")
