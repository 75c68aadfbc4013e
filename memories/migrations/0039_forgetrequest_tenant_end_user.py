"""``forget_tenant_end_user`` (tenant, requested_by) WHERE requested_by_kind = 'end_user': an
end user's portal page lists the requests about them — filed for their subject (by anyone,
``forget_tenant_subject``) or filed by them — on every load and every reload of a pending
one. With no index on the second half, that OR was a scan of every forget request of every
tenant (kept with their receipts): 600k requests, 80 ms a page, growing with the history;
now a BitmapOr of the two indexes. Only end users' requests are entered.

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel import pgindexes

CREATE = (
    "CREATE INDEX {concurrently} IF NOT EXISTS forget_tenant_end_user "
    "ON memories_forgetrequest (tenant_id, requested_by) WHERE requested_by_kind = 'end_user'"
)


def forward(apps, schema_editor):
    pgindexes.create(schema_editor, "forget_tenant_end_user", CREATE)


def backward(apps, schema_editor):
    pgindexes.drop(schema_editor, "forget_tenant_end_user")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0038_job_retry_at")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="forgetrequest",
                    index=models.Index(
                        condition=models.Q(("requested_by_kind", "end_user")),
                        fields=["tenant", "requested_by"],
                        name="forget_tenant_end_user",
                    ),
                )
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
