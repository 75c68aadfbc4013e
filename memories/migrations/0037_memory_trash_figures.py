"""``memory_trash_figures`` (tenant, namespace, category) WHERE deleted_at IS NOT NULL: the
dashboard's live counts (memories/selectors/dashboard.py ``_COUNTS_SQL``) are every memory of
the tenant, read index-only, minus its trashed ones by namespace and category. Without it
those came from the heap, one page per trashed memory (a tenant of 1M memories, 50k in the
trash: 47k pages read of every recount). Only trashed rows are entered (a move to the trash
rewrites every index entry of the row anyway).

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again.
"""

from django.db import migrations, models

from zeromem.kernel import pgindexes

CREATE = (
    "CREATE INDEX {concurrently} IF NOT EXISTS memory_trash_figures "
    "ON memories_memory (tenant_id, namespace, category) WHERE deleted_at IS NOT NULL"
)


def forward(apps, schema_editor):
    pgindexes.create(schema_editor, "memory_trash_figures", CREATE)


def backward(apps, schema_editor):
    pgindexes.drop(schema_editor, "memory_trash_figures")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0036_forgetrequest_tenant_completed")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="memory",
                    index=models.Index(
                        condition=models.Q(("deleted_at__isnull", False)),
                        fields=["tenant", "namespace", "category"],
                        name="memory_trash_figures",
                    ),
                )
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
