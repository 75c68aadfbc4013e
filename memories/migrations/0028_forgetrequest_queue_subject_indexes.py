"""The forget-request queue of the admin, read a page at a time from an index of the tenant's
requests: ``forget_tenant_queue`` (tenant, status = 'completed', due_at, id) holds them in the
queue's order (open ones by due date, so the overdue first, then the done ones), and
``forget_tenant_subject`` (tenant, subject) WHERE subject <> '' finds an end user's requests.
Requests are kept with their receipts: the queue's CASE order sorted every request the tenant
ever filed on each page (0.8 s at 1M requests; a later page or a status filter 1.7 s).

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel import pgindexes

CREATE = {
    "forget_tenant_queue": (
        "CREATE INDEX {concurrently} IF NOT EXISTS forget_tenant_queue ON memories_forgetrequest "
        "(tenant_id, (status = 'completed'), due_at, id)"
    ),
    "forget_tenant_subject": (
        "CREATE INDEX {concurrently} IF NOT EXISTS forget_tenant_subject ON memories_forgetrequest "
        "(tenant_id, subject) WHERE NOT (subject = '')"
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

    dependencies = [("memories", "0027_forgetrequest_stalled_attempts")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="forgetrequest",
                    index=models.Index(
                        models.F("tenant"),
                        models.ExpressionWrapper(models.Q(("status", "completed")), output_field=models.BooleanField()),
                        models.F("due_at"),
                        models.F("id"),
                        name="forget_tenant_queue",
                    ),
                ),
                migrations.AddIndex(
                    model_name="forgetrequest",
                    index=models.Index(
                        condition=models.Q(("subject", ""), _negated=True),
                        fields=["tenant", "subject"],
                        name="forget_tenant_subject",
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
