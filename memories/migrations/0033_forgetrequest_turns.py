"""Forget requests take turns with summarize jobs (services.jobs.turn_claim_next):
``ForgetRequest.turn_at`` (when it last held a worker) and ``stepping`` (a step holds one now),
and ``forget_tenant_turn`` (tenant, turn_at), so each waiting tenant's latest turn is one index
probe instead of a read of every request the tenant kept with its receipt.

A nullable column and a constant database default: PostgreSQL adds both without rewriting the
table, and the release before, still running during a rolling deploy, inserts requests without
naming them. The index is built ``CONCURRENTLY`` (this migration is not atomic), so writes go
on; an index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel import pgindexes

CREATE = "CREATE INDEX {concurrently} IF NOT EXISTS forget_tenant_turn ON memories_forgetrequest (tenant_id, turn_at)"


def forward(apps, schema_editor):
    pgindexes.create(schema_editor, "forget_tenant_turn", CREATE)


def backward(apps, schema_editor):
    pgindexes.drop(schema_editor, "forget_tenant_turn")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0032_memory_trash_orders")]

    operations = [
        migrations.AddField(
            model_name="forgetrequest",
            name="turn_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="forgetrequest",
            name="stepping",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="forgetrequest",
                    index=models.Index(fields=["tenant", "turn_at"], name="forget_tenant_turn"),
                )
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        ),
    ]
