"""A page of ``GET /api/v1/memories?category=…`` or ``?subject=…`` (and the tool's list, the
admin's) is one index range in key order:

* ``memory_live_category_key`` (tenant, category, key) WHERE deleted_at IS NULL;
* ``memory_tenant_subject_key`` (tenant, subject, key) WHERE subject <> '', which replaces
  ``memory_tenant_subject`` (tenant, subject): what the forget requests found by subject
  through that one (trashed memories too), they find through its first two columns.

A category follows the key's first segment and a subject the end user of ``user:<id>:…``, so
one that is a small share of a tenant sits in one stretch of the key order. Without these the
planner walked the (tenant, key) index filtering each row, and read every memory before that
stretch: 99,052 rows for a page of 50 at 100k memories (``tests/test_worst_inputs.py``).

Built ``CONCURRENTLY`` on PostgreSQL (this migration is not atomic), so writes go on; an
index a run interrupted mid-build left invalid is dropped and built again. The old subject
index is dropped only once its replacement is built.
"""

from django.db import migrations, models

from zeromem.kernel import pgindexes

CATEGORY = (
    "CREATE INDEX {concurrently} IF NOT EXISTS memory_live_category_key "
    "ON memories_memory (tenant_id, category, key) WHERE deleted_at IS NULL"
)
SUBJECT = (
    "CREATE INDEX {concurrently} IF NOT EXISTS memory_tenant_subject_key "
    "ON memories_memory (tenant_id, subject, key) WHERE NOT (subject = '')"
)
OLD_SUBJECT = (
    "CREATE INDEX {concurrently} IF NOT EXISTS memory_tenant_subject "
    "ON memories_memory (tenant_id, subject) WHERE NOT (subject = '')"
)


def forward(apps, schema_editor):
    pgindexes.create(schema_editor, "memory_live_category_key", CATEGORY)
    pgindexes.create(schema_editor, "memory_tenant_subject_key", SUBJECT)
    pgindexes.drop(schema_editor, "memory_tenant_subject")


def backward(apps, schema_editor):
    pgindexes.create(schema_editor, "memory_tenant_subject", OLD_SUBJECT)
    pgindexes.drop(schema_editor, "memory_tenant_subject_key")
    pgindexes.drop(schema_editor, "memory_live_category_key")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0040_datakey_counts_kept_by_triggers")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="memory",
                    index=models.Index(
                        condition=models.Q(("deleted_at__isnull", True)),
                        fields=["tenant", "category", "key"],
                        name="memory_live_category_key",
                    ),
                ),
                migrations.AddIndex(
                    model_name="memory",
                    index=models.Index(
                        condition=models.Q(("subject", ""), _negated=True),
                        fields=["tenant", "subject", "key"],
                        name="memory_tenant_subject_key",
                    ),
                ),
                migrations.RemoveIndex(model_name="memory", name="memory_tenant_subject"),
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        )
    ]
