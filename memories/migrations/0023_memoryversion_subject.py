"""``MemoryVersion.subject``: the end user a version was about when it was written, so a
forget request also erases that user's values in the history of a key since rewritten for
someone else. On PostgreSQL adding a column with a constant default rewrites nothing; versions
written before it have none (empty)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("memories", "0022_idempotency_keep_answer"),
    ]

    operations = [
        migrations.AddField(
            model_name="memoryversion",
            name="subject",
            field=models.CharField(blank=True, default="", max_length=255),
        ),
    ]
