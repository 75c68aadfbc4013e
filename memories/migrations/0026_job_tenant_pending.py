"""``job_tenant_pending`` (tenant, kind) WHERE status IN ('queued', 'running'): the per-tenant
cap on pending jobs (services.jobs.require_pending_room) counts one tenant's pending summarize
jobs on every start; through ``job_tenant_created`` that COUNT read every job the tenant kept
for ``ZEROMEM_JOB_RETENTION_DAYS``.

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel.pgindexes import drop_if_invalid

CREATE = (
    "CREATE INDEX {concurrently} IF NOT EXISTS job_tenant_pending ON memories_job "
    "(tenant_id, kind) WHERE status IN ('queued', 'running')"
)


def forward(apps, schema_editor):
    postgresql = schema_editor.connection.vendor == "postgresql"
    if postgresql:  # a run interrupted mid-build left the index invalid: built again
        with schema_editor.connection.cursor() as cursor:
            drop_if_invalid(cursor, "job_tenant_pending")
    schema_editor.execute(CREATE.format(concurrently="CONCURRENTLY" if postgresql else ""))


def backward(apps, schema_editor):
    postgresql = schema_editor.connection.vendor == "postgresql"
    schema_editor.execute(f"DROP INDEX {'CONCURRENTLY ' if postgresql else ''}IF EXISTS job_tenant_pending")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0025_idempotency_holds_no_values")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="job",
                    index=models.Index(
                        condition=models.Q(("status__in", ["queued", "running"])),
                        fields=["tenant", "kind"],
                        name="job_tenant_pending",
                    ),
                )
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
