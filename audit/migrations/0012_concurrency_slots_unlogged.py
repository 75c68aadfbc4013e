"""PostgreSQL: the concurrency slots' table is UNLOGGED (audit/limits.py ``slot_acquire``).

A slot is a few seconds of bookkeeping, not a record: its INSERT and DELETE wrote WAL and
each commit waited for the WAL flush — two synchronous commits per search, more while a busy
tenant's requests waited for a slot — and every other tenant's audited request queued behind
them for the same flush. An unlogged table writes no WAL, so a transaction that only touches
it does not wait for a flush. After a crash of PostgreSQL it is empty (the requests holding
slots died with the connections); it is not replicated (slots are only taken on the primary).
"""

from django.db import migrations

TABLE = "audit_concurrencyslot"


def _run(schema_editor, sql: str) -> None:
    if schema_editor.connection.vendor == "postgresql":
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(sql)


def forward(apps, schema_editor):
    _run(schema_editor, f"ALTER TABLE {TABLE} SET UNLOGGED")


def reverse(apps, schema_editor):
    _run(schema_editor, f"ALTER TABLE {TABLE} SET LOGGED")


class Migration(migrations.Migration):
    dependencies = [("audit", "0011_audit_range_seals")]

    operations = [migrations.RunPython(forward, reverse)]
