"""``MemoryVersion.subject``: the end user a version was about when it was written, so a
forget request also erases that user's values in the history of a key since rewritten for
someone else. On PostgreSQL adding a column with a constant default rewrites nothing; kept as
the database default, so the code of the release before, still writing during a rolling
deploy, can insert versions without naming it. Versions written before it have none (empty)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("memories", "0022_idempotency_keep_answer"),
    ]

    operations = [
        migrations.AddField(
            model_name="memoryversion",
            name="subject",
            field=models.CharField(blank=True, db_default="", default="", max_length=255),
        ),
    ]
