"""``memories_memory`` pages are filled to 80% (``fillfactor``), leaving room beside a row for
its next version. The ``zeromem:access-counts`` job updates ``access_count`` and
``last_accessed_at`` — no indexed column — of every memory read: where the new version fits on
the row's page the update is HOT and writes no index entry; on a full page it is written
elsewhere and every index gets one, the GIN of ``search_tsv`` one per lexeme of the value
(``manage.py bench_fold`` measures both). Only pages filled from now on keep the room (rows
rewritten by writes and updates move to them); ``VACUUM FULL`` or pg_repack would apply it to
the whole table at once.

PostgreSQL only (SQLite has no such setting); ``SHARE UPDATE EXCLUSIVE``: reads and writes go on.
"""

from django.db import migrations

FILLFACTOR = 80


def forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE memories_memory SET (fillfactor = {FILLFACTOR})")


def backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE memories_memory RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [("memories", "0030_job_tenant_started")]

    operations = [migrations.RunPython(forward, backward)]
