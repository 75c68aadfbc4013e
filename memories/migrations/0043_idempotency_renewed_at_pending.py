"""``IdempotencyRecord.renewed_at`` (a running claim's heartbeat: a request slower than the lease
is not taken over while its process lives) and ``pending`` (a batch answer to resume: the calls
that met a transient failure). Both nullable, so the claim's raw INSERT needs no change; on
PostgreSQL adding them rewrites nothing (memories/services/idempotency.py)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('memories', '0042_job_forgetrequest_uid'),
    ]

    operations = [
        migrations.AddField(
            model_name='idempotencyrecord',
            name='renewed_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='idempotencyrecord',
            name='pending',
            field=models.JSONField(blank=True, null=True),
        ),
    ]
