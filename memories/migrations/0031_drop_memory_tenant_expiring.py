"""Drop ``memory_tenant_expiring`` (tenant, expires_at) WHERE expires_at IS NOT NULL: since
0029, ``memory_tenant_expires`` (tenant, expires_at, id) serves the dashboard's "expiring
within 24 h" of one tenant as well (the same range: a row comparison on its first two columns
never matches a NULL expiry), and every write of a memory with a TTL maintained both.

Dropped ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic): no lock that would
stop writes; migrating back builds it again, ``CONCURRENTLY``.
"""

from django.db import migrations, models

from zeromem.kernel import pgindexes

CREATE = (
    "CREATE INDEX {concurrently} IF NOT EXISTS memory_tenant_expiring ON memories_memory "
    "(tenant_id, expires_at) WHERE expires_at IS NOT NULL"
)


def forward(apps, schema_editor):
    pgindexes.drop(schema_editor, "memory_tenant_expiring")


def backward(apps, schema_editor):
    pgindexes.create(schema_editor, "memory_tenant_expiring", CREATE)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0030_job_tenant_started")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.RemoveIndex(model_name="memory", name="memory_tenant_expiring")],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
