"""Search that stays bounded at a million memories (memories/search/).

* ``memory.search_tsv`` (PostgreSQL ``tsvector``; text, unused, on SQLite): the weighted,
  tenant-prefixed terms, under a plain GIN index ``memory_search_tsv`` (``fastupdate =
  off``: searches never scan a pending list). The column is added null, which PostgreSQL
  does without rewriting the table; the index is built ``CONCURRENTLY`` (this migration is
  not atomic), so writes go on meanwhile.
* The old ``to_tsvector(search_text)`` and trigram indexes are dropped (``CONCURRENTLY``).
* ``memory_tenant_salience`` (tenant, importance desc, updated_at desc), for
  recall with only a prefix; ``CONCURRENTLY`` on PostgreSQL.
* ``SearchTerm`` / ``SearchCorpus``: per-tenant document frequencies (PostgreSQL; the term
  in the "C" collation so that a term prefix is a range of the primary key).
* SQLite: an FTS5 table ``memories_memory_fts`` (key, tag and value terms as three columns,
  split from ``search_text`` by triggers that keep it in step with every insert, update
  and delete) and its ``fts5vocab`` view for the document frequencies.
* Backfill: every existing row's ``search_text`` and ``search_tsv`` are rewritten in
  batches of 1,000 rows, each its own short transaction (no table lock; row locks on one
  batch at a time); each tenant's term statistics are then counted by the ``search-stats``
  schedule. On a big table the same can be run beforehand or again with ``manage.py
  search_reindex`` (idempotent; it counts the statistics too).
"""

from django.db import migrations, models

import django.db.models.deletion
import django.utils.timezone
import memories.models

SALIENCE = (
    "CREATE INDEX {concurrently} IF NOT EXISTS memory_tenant_salience ON memories_memory "
    "(tenant_id, importance DESC, updated_at DESC)"
)

PG_FORWARD = [
    # Byte order, so that a range (term >= '钱' AND term < '钱\U0010ffff') is a prefix scan.
    'ALTER TABLE memories_searchterm ALTER COLUMN term TYPE varchar(255) COLLATE "C"',
    SALIENCE.format(concurrently="CONCURRENTLY"),
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS memory_search_tsv ON memories_memory "
    "USING gin (search_tsv) WITH (fastupdate = off)",
    "DROP INDEX CONCURRENTLY IF EXISTS memory_search_fts",
    "DROP INDEX CONCURRENTLY IF EXISTS memory_search_trgm",
]
PG_BACKWARD = [
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS memory_search_fts ON memories_memory "
    "USING gin (to_tsvector('simple', search_text))",
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS memory_search_trgm ON memories_memory USING gin (search_text gin_trgm_ops)",
    "DROP INDEX CONCURRENTLY IF EXISTS memory_search_tsv",
    "DROP INDEX CONCURRENTLY IF EXISTS memory_tenant_salience",
]

# search_text is "key terms | tag terms | value terms" (memories/search/text.py); a row
# written before this migration has no separator and lands whole in the value column
# until the backfill rewrites it.
_K = "substr(new.search_text, 1, max(instr(new.search_text, ' | ') - 1, 0))"
_REST = "substr(new.search_text, instr(new.search_text, ' | ') + (CASE WHEN instr(new.search_text, ' | ') > 0 THEN 3 ELSE 1 END))"
_T = f"substr({_REST}, 1, max(instr({_REST}, ' | ') - 1, 0))"
_B = f"substr({_REST}, instr({_REST}, ' | ') + (CASE WHEN instr({_REST}, ' | ') > 0 THEN 3 ELSE 1 END))"
_INSERT = f"INSERT INTO memories_memory_fts (rowid, k, t, b) VALUES (new.id, {_K}, {_T}, {_B});"  # nosec B608

SQLITE_FORWARD = [
    SALIENCE.format(concurrently=""),
    # Terms are "<tenant>:<term>" separated by spaces: ':' is part of a token.
    """CREATE VIRTUAL TABLE IF NOT EXISTS memories_memory_fts USING fts5(
        k, t, b, tokenize = "unicode61 remove_diacritics 0 tokenchars ':'")""",
    "CREATE VIRTUAL TABLE IF NOT EXISTS memories_memory_fts_vocab USING fts5vocab(memories_memory_fts, 'row')",
    f"CREATE TRIGGER memories_memory_fts_ai AFTER INSERT ON memories_memory BEGIN {_INSERT} END",
    "CREATE TRIGGER memories_memory_fts_ad AFTER DELETE ON memories_memory BEGIN "
    "DELETE FROM memories_memory_fts WHERE rowid = old.id; END",
    "CREATE TRIGGER memories_memory_fts_au AFTER UPDATE OF search_text ON memories_memory BEGIN "
    f"DELETE FROM memories_memory_fts WHERE rowid = old.id; {_INSERT} END",  # nosec B608
]
SQLITE_BACKWARD = [
    "DROP TRIGGER IF EXISTS memories_memory_fts_au",
    "DROP TRIGGER IF EXISTS memories_memory_fts_ad",
    "DROP TRIGGER IF EXISTS memories_memory_fts_ai",
    "DROP TABLE IF EXISTS memories_memory_fts_vocab",
    "DROP TABLE IF EXISTS memories_memory_fts",
    "DROP INDEX IF EXISTS memory_tenant_salience",
]


def _run(pg, sqlite):
    def run(apps, schema_editor):
        statements = pg if schema_editor.connection.vendor == "postgresql" else sqlite
        for sql in statements:
            schema_editor.execute(sql)

    return run


def backfill(apps, schema_editor):
    from memories.search import index

    Memory = apps.get_model("memories", "Memory")
    index.reindex(memory_model=Memory)
    # The term statistics are not counted here: stats_refresh is today's code and writes
    # columns and tables of later migrations (0019). The search-stats schedule counts every
    # tenant never counted, and until then a search counts its terms on the spot.


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0009_api_key_allowlist_entries_on_segments")]

    operations = [
        migrations.CreateModel(
            name="SearchCorpus",
            fields=[
                (
                    "tenant",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="+",
                        serialize=False,
                        to="memories.tenant",
                    ),
                ),
                ("documents", models.PositiveIntegerField(default=0)),
                ("refreshed_at", models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={"verbose_name_plural": "search corpora"},
        ),
        migrations.CreateModel(
            name="SearchTerm",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "tenant", "term", blank=True, editable=False, primary_key=True, serialize=False
                    ),
                ),
                (
                    "tenant",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="memories.tenant",
                    ),
                ),
                ("term", models.CharField(max_length=255)),
                ("ndoc", models.PositiveIntegerField()),
            ],
        ),
        migrations.AddField(
            model_name="memory",
            name="search_tsv",
            field=memories.models.TsVectorField(blank=True, editable=False, null=True),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="memory",
                    index=models.Index(fields=["tenant", "-importance", "-updated_at"], name="memory_tenant_salience"),
                )
            ],
            database_operations=[
                migrations.RunPython(_run(PG_FORWARD, SQLITE_FORWARD), _run(PG_BACKWARD, SQLITE_BACKWARD))
            ],
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
