"""PostgreSQL-only: byte-order key collation, full-text and trigram indexes.

* ``key`` and ``namespace`` use the "C" collation, so ``key LIKE 'user:u1:%'`` and keyset
  pagination (``key > cursor ORDER BY key``) run on the plain btree indexes.
* A GIN index on ``to_tsvector('simple', search_text)`` serves ranked OR-style search
  (memories/search.py builds the terms, CJK as bigrams).
* A pg_trgm GIN index on ``search_text`` serves the verbatim substring match (ILIKE).

The query expressions in memories/selectors.py must match these index expressions.
On SQLite (embedded mode) nothing happens here.
"""

from django.db import migrations

FORWARD = [
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    'ALTER TABLE memories_memory ALTER COLUMN key TYPE varchar(512) COLLATE "C"',
    'ALTER TABLE memories_memory ALTER COLUMN namespace TYPE varchar(512) COLLATE "C"',
    "CREATE INDEX memory_search_fts ON memories_memory USING gin (to_tsvector('simple', search_text))",
    "CREATE INDEX memory_search_trgm ON memories_memory USING gin (search_text gin_trgm_ops)",
]
BACKWARD = [
    "DROP INDEX IF EXISTS memory_search_trgm",
    "DROP INDEX IF EXISTS memory_search_fts",
    'ALTER TABLE memories_memory ALTER COLUMN namespace TYPE varchar(512) COLLATE "default"',
    'ALTER TABLE memories_memory ALTER COLUMN key TYPE varchar(512) COLLATE "default"',
]


def _run(statements):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor != "postgresql":
            return
        for sql in statements:
            schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    dependencies = [("memories", "0001_initial")]

    operations = [migrations.RunPython(_run(FORWARD), _run(BACKWARD))]
