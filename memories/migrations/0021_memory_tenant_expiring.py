"""``memory_tenant_expiring`` (tenant, expires_at) WHERE expires_at IS NOT NULL: the admin
dashboard's "expiring within 24 h" of one tenant, which read the tenant-less
``memory_expiring`` past every other tenant's short-lived memories (first 10) or every
memory of the tenant (count). ``memory_expiring`` stays: the TTL purge's range is over all
tenants and could only scan the new index whole.

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel.pgindexes import drop_if_invalid

CREATE = (
    "CREATE INDEX {concurrently} IF NOT EXISTS memory_tenant_expiring ON memories_memory "
    "(tenant_id, expires_at) WHERE expires_at IS NOT NULL"
)


def forward(apps, schema_editor):
    postgresql = schema_editor.connection.vendor == "postgresql"
    if postgresql:  # a run interrupted mid-build left the index invalid: built again
        with schema_editor.connection.cursor() as cursor:
            drop_if_invalid(cursor, "memory_tenant_expiring")
    schema_editor.execute(CREATE.format(concurrently="CONCURRENTLY" if postgresql else ""))


def backward(apps, schema_editor):
    postgresql = schema_editor.connection.vendor == "postgresql"
    schema_editor.execute(f"DROP INDEX {'CONCURRENTLY ' if postgresql else ''}IF EXISTS memory_tenant_expiring")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0020_job_api_key_and_cancelled")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="memory",
                    index=models.Index(
                        condition=models.Q(("expires_at__isnull", False)),
                        fields=["tenant", "expires_at"],
                        name="memory_tenant_expiring",
                    ),
                )
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
