"""``memoryversion_tenant_subject`` (tenant, subject) WHERE subject <> '': a forget request
finds its subject's versions under keys now about another end user without scanning the
tenant's history.

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel.pgindexes import drop_if_invalid

CREATE = (
    "CREATE INDEX {concurrently} IF NOT EXISTS memoryversion_tenant_subject ON memories_memoryversion "
    "(tenant_id, subject) WHERE NOT (subject = '')"
)


def forward(apps, schema_editor):
    postgresql = schema_editor.connection.vendor == "postgresql"
    if postgresql:  # a run interrupted mid-build left the index invalid: built again
        with schema_editor.connection.cursor() as cursor:
            drop_if_invalid(cursor, "memoryversion_tenant_subject")
    schema_editor.execute(CREATE.format(concurrently="CONCURRENTLY" if postgresql else ""))


def backward(apps, schema_editor):
    postgresql = schema_editor.connection.vendor == "postgresql"
    schema_editor.execute(f"DROP INDEX {'CONCURRENTLY ' if postgresql else ''}IF EXISTS memoryversion_tenant_subject")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0023_memoryversion_subject")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="memoryversion",
                    index=models.Index(
                        condition=models.Q(("subject", ""), _negated=True),
                        fields=["tenant", "subject"],
                        name="memoryversion_tenant_subject",
                    ),
                )
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
