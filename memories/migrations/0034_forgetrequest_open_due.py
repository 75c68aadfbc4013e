"""``forget_open_due`` (due_at) WHERE status <> 'completed': the ``zeromem_forget_requests_overdue``
gauge, read on every scrape of ``/metrics``, counts the requests not completed past their due
date over every tenant. Requests are kept with their receipts, so without it each scrape read
every request ever filed (1M requests: 51–62 ms a scrape, growing with the history); the open
and failed ones are few.

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel import pgindexes

CREATE = (
    "CREATE INDEX {concurrently} IF NOT EXISTS forget_open_due ON memories_forgetrequest (due_at) "
    "WHERE NOT (status = 'completed')"
)


def forward(apps, schema_editor):
    pgindexes.create(schema_editor, "forget_open_due", CREATE)


def backward(apps, schema_editor):
    pgindexes.drop(schema_editor, "forget_open_due")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0033_forgetrequest_turns")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="forgetrequest",
                    index=models.Index(
                        condition=models.Q(("status", "completed"), _negated=True),
                        fields=["due_at"],
                        name="forget_open_due",
                    ),
                )
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
