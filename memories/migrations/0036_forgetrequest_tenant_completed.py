"""``forget_tenant_completed`` (tenant, completed_at) WHERE completed_at IS NOT NULL: the
``search-stats`` schedule (memories/search/index.py ``stale_tenant_ids``, every 10 minutes,
over every tenant) asks whether a forget request of the tenant completed since its term count.
Requests are kept with their receipts, so without it each run read every request a tenant ever
had completed (2,000 tenants, one with 200k completed requests: 44 s a run).

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel import pgindexes

CREATE = (
    "CREATE INDEX {concurrently} IF NOT EXISTS forget_tenant_completed "
    "ON memories_forgetrequest (tenant_id, completed_at) WHERE completed_at IS NOT NULL"
)


def forward(apps, schema_editor):
    pgindexes.create(schema_editor, "forget_tenant_completed", CREATE)


def backward(apps, schema_editor):
    pgindexes.drop(schema_editor, "forget_tenant_completed")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0035_sqlite_fts_marks")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="forgetrequest",
                    index=models.Index(
                        condition=models.Q(("completed_at__isnull", False)),
                        fields=["tenant", "completed_at"],
                        name="forget_tenant_completed",
                    ),
                )
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
