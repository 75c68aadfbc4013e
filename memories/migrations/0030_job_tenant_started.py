"""``job_tenant_started`` (tenant, kind, started_at): whose turn it is in the job queue
(services.jobs.job_claim_next) is decided by each waiting tenant's latest attempt start, one
probe of this index per waiting job instead of a read of every job the tenant kept for
``ZEROMEM_JOB_RETENTION_DAYS``.

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel import pgindexes

CREATE = (
    "CREATE INDEX {concurrently} IF NOT EXISTS job_tenant_started ON memories_job (tenant_id, kind, started_at)"
)


def forward(apps, schema_editor):
    pgindexes.create(schema_editor, "job_tenant_started", CREATE)


def backward(apps, schema_editor):
    pgindexes.drop(schema_editor, "job_tenant_started")


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
