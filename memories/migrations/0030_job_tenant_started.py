"""``job_tenant_started`` (tenant, kind, started_at): whose turn it is in the job queue
(services.jobs.job_claim_next) is decided by each waiting tenant's latest attempt start, one
probe of this index per waiting job instead of a read of every job the tenant kept for
``ZEROMEM_JOB_RETENTION_DAYS``.

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel.pgindexes import drop_if_invalid

CREATE = (
    "CREATE INDEX {concurrently} IF NOT EXISTS job_tenant_started ON memories_job (tenant_id, kind, started_at)"
)


def forward(apps, schema_editor):
    postgresql = schema_editor.connection.vendor == "postgresql"
    if postgresql:  # a run interrupted mid-build left the index invalid: built again
        with schema_editor.connection.cursor() as cursor:
            drop_if_invalid(cursor, "job_tenant_started")
    schema_editor.execute(CREATE.format(concurrently="CONCURRENTLY" if postgresql else ""))


def backward(apps, schema_editor):
    postgresql = schema_editor.connection.vendor == "postgresql"
    schema_editor.execute(f"DROP INDEX {'CONCURRENTLY ' if postgresql else ''}IF EXISTS job_tenant_started")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0029_memory_tenant_updated_expires")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="job",
                    index=models.Index(fields=["tenant", "kind", "started_at"], name="job_tenant_started"),
                )
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
