"""PostgreSQL: the append-only guard's ``seal`` mode (the per-event seals made before audit
0011) lets an UPDATE write an event's seal number and chain value and nothing else. Its list
of frozen fields predates ``actor_filter`` (audit 0014): that column could be set or cleared
alongside a seal. Now frozen there too; the ``redact`` mode still replaces it with a
pseudonym, as the other identifying fields."""

import importlib

from django.db import migrations

_RANGE_SEALS = importlib.import_module("audit.migrations.0011_audit_range_seals")
EVENT_GUARD = _RANGE_SEALS.EVENT_GUARD
for _side in ("NEW", "OLD"):
    EVENT_GUARD = EVENT_GUARD.replace(
        f"{_side}.digest, {_side}.redacted)", f"{_side}.digest, {_side}.redacted, {_side}.actor_filter)"
    )
assert EVENT_GUARD.count(".actor_filter") == 2, "the seal mode's field list of audit 0011 changed"


def forward(apps, schema_editor):
    _RANGE_SEALS._run(schema_editor, EVENT_GUARD)


def reverse(apps, schema_editor):
    _RANGE_SEALS._run(schema_editor, _RANGE_SEALS.EVENT_GUARD)


class Migration(migrations.Migration):
    dependencies = [("audit", "0014_audit_actor_filter")]

    operations = [migrations.RunPython(forward, reverse)]
