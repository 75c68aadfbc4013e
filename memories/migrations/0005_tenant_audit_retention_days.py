from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("memories", "0004_forget_request_progress_at"),
    ]

    operations = [
        migrations.AddField(
            model_name="tenant",
            name="audit_retention_days",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
    ]
