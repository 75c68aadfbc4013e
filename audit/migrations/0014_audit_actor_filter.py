"""The actor a reading of the log filtered by moves from ``detail`` to its own committed
column ``actor_filter``, so a forget of that subject redacts it (audit/chain.py: events
written before, with the column empty, keep their digests). The partial index serves the
redaction's lookup; only readings with an actor filter enter it. On PostgreSQL the column
is added to the partitioned parent (a metadata change, no rewrite) and reaches every
partition; the index is created on the parent and each partition."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('audit', '0013_concurrency_slots_numbered'),
        ('memories', '0019_search_erasure_counter'),
    ]

    operations = [
        migrations.AddField(
            model_name='auditevent',
            name='actor_filter',
            field=models.CharField(blank=True, db_default='', default='', max_length=512),
        ),
        migrations.AddIndex(
            model_name='auditevent',
            index=models.Index(condition=models.Q(('actor_filter', ''), _negated=True), fields=['tenant', 'actor_filter'], name='audit_tenant_actor_filter'),
        ),
    ]
