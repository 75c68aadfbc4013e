"""``ForgetRequest.stalled_attempts``: attempts in a row that erased nothing, reset by every
erased batch. ``ZEROMEM_JOB_MAX_ATTEMPTS`` bounds it instead of ``attempts``, so a target too
large for one attempt (killed by ``Q_TIMEOUT`` after erasing batches) is never marked failed
while it shrinks. A constant database default: PostgreSQL adds the column without rewriting
the table, and the code of the release before, still running during a rolling deploy, can
insert requests without naming it.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("memories", "0026_job_tenant_pending")]

    operations = [
        migrations.AddField(
            model_name="forgetrequest",
            name="stalled_attempts",
            field=models.PositiveSmallIntegerField(db_default=0, default=0),
        ),
    ]
