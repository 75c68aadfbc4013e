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
