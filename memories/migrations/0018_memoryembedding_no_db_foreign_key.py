"""Embeddings keep no foreign key to their memory in the database, as versions since 0015
(the TTL purge's choice, measured by ``manage.py bench_purge_fk``: the cascade's trigger
cost 15.3 µs of CPU per erased memory, none 9.7 — the purge's own statement deletes the
embeddings already). Django still cascades ORM deletes; see MemoryEmbedding.memory for why
no path leaves an orphan. Reversing puts back migration 0011's ON DELETE CASCADE."""

import importlib

import django.db.models.deletion
from django.db import migrations, models

_0011 = importlib.import_module("memories.migrations.0011_memory_embeddings")


class Migration(migrations.Migration):

    dependencies = [
        ('memories', '0017_idempotency_records'),
    ]

    operations = [
        # Listed first so that, reversed, it runs after the foreign key is back and turns it
        # into 0011's cascade.
        migrations.RunPython(migrations.RunPython.noop, _0011._cascade_in_database),
        migrations.AlterField(
            model_name='memoryembedding',
            name='memory',
            field=models.OneToOneField(db_constraint=False, on_delete=django.db.models.deletion.CASCADE, related_name='embedding', to='memories.memory'),
        ),
    ]
