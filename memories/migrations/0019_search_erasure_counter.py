"""A per-tenant counter of TTL purge batches (``SearchErasure``) and, on ``SearchCorpus``,
the counter a tenant's last term count began from (``erasures_counted``): a purge batch
moves the counter, so the tenant's term statistics are counted again and the erased
memories' words leave ``SearchTerm`` (memories/search/index.py stale_tenant_ids).

Until now a purge left them there until the tenant's next write. Every tenant already
counted is marked once, so the next ``search-stats`` run recounts it and words of memories
purged before this migration go too (one recount per counted tenant, on the schedule)."""

import django.db.models.deletion
from django.db import migrations, models

MARK_COUNTED_TENANTS = """
INSERT INTO memories_searcherasure (tenant_id, batches)
SELECT tenant_id, 1 FROM memories_searchcorpus
"""


class Migration(migrations.Migration):

    dependencies = [
        ('memories', '0018_memoryembedding_no_db_foreign_key'),
    ]

    operations = [
        migrations.CreateModel(
            name='SearchErasure',
            fields=[
                ('tenant', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='+', serialize=False, to='memories.tenant')),
                ('batches', models.PositiveBigIntegerField(default=0)),
            ],
        ),
        migrations.AddField(
            model_name='searchcorpus',
            name='erasures_counted',
            field=models.PositiveBigIntegerField(default=0),
        ),
        migrations.RunSQL(MARK_COUNTED_TENANTS, migrations.RunSQL.noop),
    ]
