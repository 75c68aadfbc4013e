"""Tamper evidence: per-event uid and digest, sealing columns, seals and checkpoints.

Events written before this migration get a uid and a digest here, so verification covers
them from now on (they were not tamper-evident before it)."""

import uuid

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


def backfill_uid_and_digest(apps, schema_editor):
    from audit import chain

    AuditEvent = apps.get_model("audit", "AuditEvent")
    # Fields added later (chain.LATER_FIELDS) are not columns yet; the digest leaves them out.
    fields = [f for f in chain.DIGEST_FIELDS if f != "uid" and f not in chain.LATER_FIELDS]
    rows = AuditEvent.objects.order_by("id").values("id", *fields)
    for row in rows.iterator(chunk_size=2000):
        row = dict(row)
        row["uid"] = uuid.uuid4()
        AuditEvent.objects.filter(pk=row["id"]).update(uid=row["uid"], digest=chain.digest(row))


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0001_initial"),
        ("memories", "0005_tenant_audit_retention_days"),
    ]

    operations = [
        migrations.AddField(
            model_name="auditevent",
            name="uid",
            field=models.UUIDField(editable=False, null=True),
        ),
        migrations.AddField(
            model_name="auditevent",
            name="digest",
            field=models.CharField(default="", editable=False, max_length=64),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="auditevent",
            name="seal",
            field=models.PositiveIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="auditevent",
            name="chain",
            field=models.CharField(blank=True, default="", editable=False, max_length=64),
        ),
        migrations.AddField(
            model_name="auditevent",
            name="redacted",
            field=models.JSONField(blank=True, default=dict, editable=False),
        ),
        migrations.RunPython(backfill_uid_and_digest, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="auditevent",
            name="uid",
            field=models.UUIDField(default=uuid.uuid4, editable=False),
        ),
        migrations.AddIndex(
            model_name="auditevent",
            index=models.Index(
                condition=models.Q(("subject", ""), _negated=True),
                fields=["tenant", "subject"],
                name="audit_tenant_subject",
            ),
        ),
        migrations.AddIndex(
            model_name="auditevent",
            index=models.Index(
                condition=models.Q(("seal__isnull", True)), fields=["tenant", "id"], name="audit_unsealed"
            ),
        ),
        migrations.CreateModel(
            name="AuditSeal",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("seq", models.PositiveIntegerField()),
                ("first_event_id", models.BigIntegerField()),
                ("last_event_id", models.BigIntegerField()),
                ("count", models.PositiveIntegerField()),
                ("total", models.BigIntegerField()),
                ("prev_hash", models.CharField(max_length=64)),
                ("hash", models.CharField(max_length=64)),
                ("sealed_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("purged_at", models.DateTimeField(blank=True, null=True)),
                (
                    "tenant",
                    models.ForeignKey(
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="+",
                        to="memories.tenant",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(fields=("tenant", "seq"), name="auditseal_one_per_seq"),
                    models.UniqueConstraint(
                        condition=models.Q(("tenant__isnull", True)), fields=("seq",), name="auditseal_untenanted_seq"
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="AuditCheckpoint",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("seal_seq", models.PositiveIntegerField()),
                ("head_hash", models.CharField(max_length=64)),
                ("total", models.BigIntegerField()),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("reason", models.CharField(choices=[("export", "Export"), ("purge", "Purge")], max_length=16)),
                ("purged_through", models.PositiveIntegerField(blank=True, null=True)),
                ("mac", models.CharField(max_length=64)),
                (
                    "tenant",
                    models.ForeignKey(
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="+",
                        to="memories.tenant",
                    ),
                ),
            ],
            options={
                "indexes": [models.Index(fields=["tenant", "created_at"], name="auditcheckpoint_tenant")],
            },
        ),
    ]
