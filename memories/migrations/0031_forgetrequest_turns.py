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

from zeromem.kernel.pgindexes import drop_if_invalid

CREATE = "CREATE INDEX {concurrently} IF NOT EXISTS forget_tenant_turn ON memories_forgetrequest (tenant_id, turn_at)"


def forward(apps, schema_editor):
    postgresql = schema_editor.connection.vendor == "postgresql"
    if postgresql:  # a run interrupted mid-build left the index invalid: built again
        with schema_editor.connection.cursor() as cursor:
            drop_if_invalid(cursor, "forget_tenant_turn")
    schema_editor.execute(CREATE.format(concurrently="CONCURRENTLY" if postgresql else ""))


def backward(apps, schema_editor):
    postgresql = schema_editor.connection.vendor == "postgresql"
    schema_editor.execute(f"DROP INDEX {'CONCURRENTLY ' if postgresql else ''}IF EXISTS forget_tenant_turn")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0030_job_tenant_started")]

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
