"""``IdempotencyRecord.holds_no_values``: on for the claim of the POST that files a forget
request (memories/services/idempotency.py ``holds_no_values``), which that forget must neither
mark nor drop. With a database default (false), so the claim's raw INSERT needs no change; on
PostgreSQL adding it rewrites nothing."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('memories', '0024_memoryversion_tenant_subject'),
    ]

    operations = [
        migrations.AddField(
            model_name='idempotencyrecord',
            name='holds_no_values',
            field=models.BooleanField(db_default=False, default=False),
        ),
    ]
