"""``uid`` on jobs and forget requests: the id the API, the tool results and the portal show
(README "Opaque ids"). Row ids come from sequences every tenant shares, so a tenant shown
them could count the other tenants' jobs and requests between two of its own.

Built for big tables, without a lock that stops writes for longer than a catalog change:

1. the column is added nullable with no default (no table rewrite);
2. on PostgreSQL the column gets ``DEFAULT gen_random_uuid()`` (a catalog change: rows the
   old code writes while this runs get a uid too; the new code gives its own);
3. existing rows are given a random uid 5,000 at a time, each batch its own transaction
   (this migration is not atomic);
4. the unique indexes ``job_uid`` and ``forget_uid`` are built ``CONCURRENTLY`` (the project's
   ``pgindexes`` helpers: an index an interrupted run left invalid is dropped and rebuilt).

The column stays nullable in the database (``SET NOT NULL`` would scan the table under an
exclusive lock); every row has a uid once step 3 is done, and every new row gets one.
"""

import uuid

from django.db import migrations, models

from zeromem.kernel import pgindexes

BATCH = 5000
TABLES = {"memories_job": "job_uid", "memories_forgetrequest": "forget_uid"}


def forward(apps, schema_editor):
    connection = schema_editor.connection
    postgresql = connection.vendor == "postgresql"
    for table, index in TABLES.items():
        if postgresql:
            schema_editor.execute(f"ALTER TABLE {table} ALTER COLUMN uid SET DEFAULT gen_random_uuid()")
        while True:
            with connection.cursor() as cursor:
                if postgresql:
                    cursor.execute(
                        f"UPDATE {table} SET uid = gen_random_uuid() WHERE id IN "  # nosec B608: fixed names
                        f"(SELECT id FROM {table} WHERE uid IS NULL ORDER BY id LIMIT %s)",
                        [BATCH],
                    )
                    if cursor.rowcount == 0:
                        break
                else:
                    cursor.execute(f"SELECT id FROM {table} WHERE uid IS NULL LIMIT %s", [BATCH])  # nosec B608
                    ids = [row[0] for row in cursor.fetchall()]
                    if not ids:
                        break
                    cursor.executemany(
                        f"UPDATE {table} SET uid = %s WHERE id = %s",  # nosec B608
                        [(uuid.uuid4().hex, pk) for pk in ids],
                    )
        pgindexes.create(
            schema_editor,
            index,
            f"CREATE UNIQUE INDEX {{concurrently}} IF NOT EXISTS {index} ON {table} (uid) WHERE uid IS NOT NULL",
        )


def backward(apps, schema_editor):
    for table, index in TABLES.items():
        pgindexes.drop(schema_editor, index)
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"ALTER TABLE {table} ALTER COLUMN uid DROP DEFAULT")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0041_memory_live_category_subject_key")]

    operations = [
        migrations.AddField(model_name="job", name="uid", field=models.UUIDField(editable=False, null=True)),
        migrations.AddField(model_name="forgetrequest", name="uid", field=models.UUIDField(editable=False, null=True)),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="job",
                    name="uid",
                    field=models.UUIDField(default=uuid.uuid4, editable=False, null=True),
                ),
                migrations.AlterField(
                    model_name="forgetrequest",
                    name="uid",
                    field=models.UUIDField(default=uuid.uuid4, editable=False, null=True),
                ),
                migrations.AddConstraint(
                    model_name="job",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(("uid__isnull", False)), fields=("uid",), name="job_uid"
                    ),
                ),
                migrations.AddConstraint(
                    model_name="forgetrequest",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(("uid__isnull", False)), fields=("uid",), name="forget_uid"
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        ),
    ]
