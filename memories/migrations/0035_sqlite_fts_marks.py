"""SQLite: the FTS5 table ``memories_memory_fts`` takes combining marks (Unicode ``M*``) as
parts of a term, as the tokenizer now writes them (memories/search/text.py: "हिंदी" is one
term, not ह and द). FTS5's ``unicode61`` splits at marks unless ``categories`` names them, so
a term with marks was two tokens to it, found in no document-frequency count. The table is
built again, with its ``fts5vocab`` view, and filled from every row's ``search_text`` (a
virtual table's tokenizer cannot be changed in place); its triggers are unchanged.

PostgreSQL stores the terms as they are (``search_tsv`` is built by the tokenizer): nothing
to do. On either database, a memory indexed before this tokenizer keeps its old terms until
``manage.py search_reindex`` rewrites them (README "Keys, values and results").
"""

from django.db import migrations

_SEP = "' | '"
# The three columns of search_text ("key terms | tag terms | value terms"), as migration
# 0010's triggers split them.
_K = f"substr(search_text, 1, max(instr(search_text, {_SEP}) - 1, 0))"
_REST = (
    f"substr(search_text, instr(search_text, {_SEP}) + (CASE WHEN instr(search_text, {_SEP}) > 0 THEN 3 ELSE 1 END))"
)
_T = f"substr({_REST}, 1, max(instr({_REST}, {_SEP}) - 1, 0))"
_B = f"substr({_REST}, instr({_REST}, {_SEP}) + (CASE WHEN instr({_REST}, {_SEP}) > 0 THEN 3 ELSE 1 END))"


def _rebuild(categories: str) -> list[str]:
    return [
        "DROP TABLE IF EXISTS memories_memory_fts_vocab",
        "DROP TABLE IF EXISTS memories_memory_fts",
        # Terms are "<tenant>:<term>" separated by spaces: ':' is part of a token.
        "CREATE VIRTUAL TABLE memories_memory_fts USING fts5(k, t, b, tokenize = "
        f"\"unicode61 remove_diacritics 0 categories '{categories}' tokenchars ':'\")",
        "CREATE VIRTUAL TABLE memories_memory_fts_vocab USING fts5vocab(memories_memory_fts, 'row')",
        f"INSERT INTO memories_memory_fts (rowid, k, t, b) SELECT id, {_K}, {_T}, {_B} FROM memories_memory",  # nosec B608
    ]


def _sqlite(statements):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "sqlite":
            for sql in statements:
                schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    dependencies = [("memories", "0034_forgetrequest_open_due")]

    operations = [
        migrations.RunPython(_sqlite(_rebuild("L* N* Co M*")), _sqlite(_rebuild("L* N* Co"))),
    ]
