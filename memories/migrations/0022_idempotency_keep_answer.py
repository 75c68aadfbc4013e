"""``IdempotencyRecord.keep_answer``: off for a claim that was still running when a forget
request of its tenant completed (memories/services/idempotency.py ``tenant_forget``). With a
database default (true), so the claim's raw INSERT needs no change; on PostgreSQL adding
it rewrites nothing."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('memories', '0021_memory_tenant_expiring'),
    ]

    operations = [
        migrations.AddField(
            model_name='idempotencyrecord',
            name='keep_answer',
            field=models.BooleanField(db_default=True, default=True),
        ),
    ]
