"""The table of the shared cache a PostgreSQL deployment without Redis uses (settings.py
CACHES: django-q2's cluster statistics), so every instance of a fleet sees the same ones.
Django's own ``createcachetable``: it creates the table only for a configured database cache
and does nothing when it exists or the cache is Redis or a file."""

from django.core.management import call_command
from django.db import migrations


def create_cache_table(apps, schema_editor):
    call_command("createcachetable", database=schema_editor.connection.alias, verbosity=0)


class Migration(migrations.Migration):
    dependencies = [("memories", "0011_memory_embeddings")]

    operations = [migrations.RunPython(create_cache_table, migrations.RunPython.noop, elidable=True)]
