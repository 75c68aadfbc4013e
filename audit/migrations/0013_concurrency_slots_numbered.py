"""Concurrency slots are numbered per holder, one row per number (audit/limits.py
``slot_acquire``): taking a slot is one INSERT … ON CONFLICT on (holder, slot) instead of a
count, an INSERT, a second count and a clean-up — one round trip instead of three or four
per search, recall, export and batch. The unique constraint keeps the limit exact.

Slots in flight are dropped first (a slot is seconds of bookkeeping in an UNLOGGED table,
migration 0012): requests holding one while this runs finish without it."""

from django.db import migrations, models


def _drop_slots(apps, schema_editor):
    apps.get_model("audit", "ConcurrencySlot").objects.all().delete()


class Migration(migrations.Migration):
    dependencies = [("audit", "0012_concurrency_slots_unlogged")]

    operations = [
        migrations.RunPython(_drop_slots, migrations.RunPython.noop),
        migrations.RemoveIndex(model_name="concurrencyslot", name="slot_holder_started"),
        migrations.AddField(
            model_name="concurrencyslot",
            name="slot",
            field=models.PositiveSmallIntegerField(default=0),
            preserve_default=False,
        ),
        migrations.AddConstraint(
            model_name="concurrencyslot",
            constraint=models.UniqueConstraint(fields=("holder", "slot"), name="slot_holder_number"),
        ),
    ]
