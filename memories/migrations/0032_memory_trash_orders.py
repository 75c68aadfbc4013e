"""``memory_trash_key`` (tenant, key, id), ``memory_trash_updated`` (tenant, updated_at, id) and
``memory_trash_expires`` (tenant, expires_at, id), each WHERE deleted_at IS NOT NULL: the admin's
trash (state=trash) sorted by key, last update or expiry, either way, reads a page of one of
them. The key's own index (memory_one_live_key_per_tenant) holds only live memories, so every
page and its capped count sorted every trashed memory in scope (245 ms a page at 200k trashed
memories); the (tenant, updated_at / expires_at, id) indexes of migration 0029 walked past the
live memories to reach the trashed ones.

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel import pgindexes

COLUMNS = {"memory_trash_key": "key", "memory_trash_updated": "updated_at", "memory_trash_expires": "expires_at"}


def forward(apps, schema_editor):
    for name, column in COLUMNS.items():
        pgindexes.create(
            schema_editor,
            name,
            f"CREATE INDEX {{concurrently}} IF NOT EXISTS {name} ON memories_memory (tenant_id, {column}, id) "
            "WHERE deleted_at IS NOT NULL",
        )


def backward(apps, schema_editor):
    for name in COLUMNS:
        pgindexes.drop(schema_editor, name)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0031_memory_fillfactor")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="memory",
                    index=models.Index(
                        condition=models.Q(("deleted_at__isnull", False)),
                        fields=["tenant", column, "id"],
                        name=name,
                    ),
                )
                for name, column in COLUMNS.items()
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
