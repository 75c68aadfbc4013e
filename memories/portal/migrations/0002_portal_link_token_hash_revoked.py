"""Portal links become opaque: the row keeps the SHA-256 of a random token (the old column
held the nonce of a signed payload; links issued before this migration no longer open, the
sessions they opened keep working), and ``revoked_at`` withdraws a link and its session."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("portal", "0001_portal_links")]

    operations = [
        migrations.RenameField(model_name="portallink", old_name="nonce", new_name="token_hash"),
        migrations.AlterField(
            model_name="portallink", name="token_hash", field=models.CharField(max_length=64, unique=True)
        ),
        migrations.AddField(
            model_name="portallink", name="revoked_at", field=models.DateTimeField(blank=True, null=True)
        ),
    ]
