"""``memory_tenant_updated`` (tenant, updated_at, id) and ``memory_tenant_expires`` (tenant,
expires_at, id): the admin's memory list sorted by last update or by expiry, either way, reads
a page of one of them (the list orders by tenant, column, id, all in one direction). Without
them each page sorted every memory of the tenant; the partial ``memory_tenant_expiring``
leaves out the memories that never expire, which an expiry sort lists too.

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel import pgindexes

CREATE = {
    "memory_tenant_updated": (
        "CREATE INDEX {concurrently} IF NOT EXISTS memory_tenant_updated ON memories_memory (tenant_id, updated_at, id)"
    ),
    "memory_tenant_expires": (
        "CREATE INDEX {concurrently} IF NOT EXISTS memory_tenant_expires ON memories_memory (tenant_id, expires_at, id)"
    ),
}


def forward(apps, schema_editor):
    for name, sql in CREATE.items():
        pgindexes.create(schema_editor, name, sql)


def backward(apps, schema_editor):
    for name in CREATE:
        pgindexes.drop(schema_editor, name)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0028_forgetrequest_queue_subject_indexes")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="memory",
                    index=models.Index(fields=["tenant", "updated_at", "id"], name="memory_tenant_updated"),
                ),
                migrations.AddIndex(
                    model_name="memory",
                    index=models.Index(fields=["tenant", "expires_at", "id"], name="memory_tenant_expires"),
                ),
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
