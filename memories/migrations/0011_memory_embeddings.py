"""Memory embeddings (semantic search) and the index the embedding job reads memories by.

On PostgreSQL the foreign key from an embedding to its memory also cascades in the database
(``ON DELETE CASCADE``). Django deletes a memory's embedding before the memory (forget) or
the purge's statement deletes it explicitly, but an embedding the job commits in between
would otherwise fail the eraser's deferred foreign-key check; with the database cascade it
is erased with the memory instead. The index the job reads memories by is built
CONCURRENTLY on PostgreSQL. On SQLite writers are serialized, so the race cannot
happen and nothing is changed here.
"""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


def _updated_index(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(
        f"CREATE INDEX {concurrently}IF NOT EXISTS memory_updated ON memories_memory (updated_at)"
    )


def _updated_index_drop(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS memory_updated")


def _cascade_in_database(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            """SELECT conname FROM pg_constraint
               WHERE conrelid = 'memories_memoryembedding'::regclass AND contype = 'f'
                 AND confrelid = 'memories_memory'::regclass"""
        )
        (name,) = cursor.fetchone()
    schema_editor.execute(f'ALTER TABLE memories_memoryembedding DROP CONSTRAINT "{name}"')
    schema_editor.execute(
        'ALTER TABLE memories_memoryembedding ADD CONSTRAINT "memoryembedding_memory_cascade" '
        "FOREIGN KEY (memory_id) REFERENCES memories_memory (id) ON DELETE CASCADE "
        "DEFERRABLE INITIALLY DEFERRED"
    )


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ('memories', '0010_memory_search_tsv_term_stats_salience'),
    ]

    operations = [
        migrations.CreateModel(
            name='MemoryEmbedding',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('model', models.CharField(max_length=64)),
                ('dim', models.PositiveSmallIntegerField()),
                ('vector', models.BinaryField()),
                ('text_hash', models.CharField(max_length=16)),
                ('memory_version', models.PositiveIntegerField()),
                ('memory_updated_at', models.DateTimeField()),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
            ],
        ),
        # Built CONCURRENTLY on PostgreSQL (this migration is not atomic): writes go on meanwhile.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name='memory',
                    index=models.Index(fields=['updated_at'], name='memory_updated'),
                ),
            ],
            database_operations=[migrations.RunPython(_updated_index, _updated_index_drop)],
        ),
        migrations.AddField(
            model_name='memoryembedding',
            name='memory',
            field=models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='embedding', to='memories.memory'),
        ),
        migrations.AddField(
            model_name='memoryembedding',
            name='tenant',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, to='memories.tenant'),
        ),
        migrations.AddIndex(
            model_name='memoryembedding',
            index=models.Index(fields=['tenant', 'id'], name='memoryembedding_tenant_id'),
        ),
        migrations.AddIndex(
            model_name='memoryembedding',
            index=models.Index(fields=['memory_updated_at'], name='memoryembedding_updated'),
        ),
        migrations.RunPython(_cascade_in_database, migrations.RunPython.noop, elidable=False),
    ]
