"""Each redacted field of an event gets a binding (audit/chain.py ``binding``): an HMAC tying
what the field holds — its pseudonym, or nothing for the client address — to the field's
kept commitment, stored in the event's ``redacted`` map under ``bound``. Before, verification
checked only that a redacted field held *a* well-formed pseudonym, so another one written in
its place (moving an event from one forgotten user to another) still verified.

Redactions made before this migration are bound to the pseudonyms they hold now: the
migration vouches for the log as it finds it, as sealing does for events not sealed yet.
In batches of its own transactions (in the ``redact`` mode of the append-only guard, which
lets ``redacted`` change and nothing else of a row but its identifying fields), walking the
events by id once; new redactions already write their bindings.
"""

import json

from django.db import connection, migrations, transaction

from audit import chain

BATCH = 2000


def _bindings(row: dict) -> dict | None:
    redacted = dict(row["redacted"] or {})
    bound = dict(redacted.get(chain.BOUND) or {})
    missing = [name for name in chain.COMMITTED_FIELDS if name in redacted and name not in bound]
    if not missing:
        return None
    for name in missing:
        bound[name] = chain.binding(row["uid"], name, redacted[name], row[name])
    redacted[chain.BOUND] = bound
    return redacted


def forward(apps, schema_editor):
    AuditEvent = apps.get_model("audit", "AuditEvent")
    table = AuditEvent._meta.db_table
    columns = ["id", "uid", "redacted", *chain.COMMITTED_FIELDS]
    after = 0
    while True:
        with transaction.atomic():
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute("SELECT set_config('zeromem.audit_mode', 'redact', true)")
            rows = list(
                AuditEvent.objects.filter(pk__gt=after).exclude(redacted={}).order_by("id").values(*columns)[:BATCH]
            )
            if not rows:
                return
            after = rows[-1]["id"]
            with connection.cursor() as cursor:
                for row in rows:
                    redacted = _bindings(row)
                    if redacted is not None:
                        # bandit B608 (marked): the table name is the model's, values are parameters.
                        cursor.execute(
                            f"UPDATE {table} SET redacted = %s WHERE id = %s",  # nosec B608
                            [json.dumps(redacted, sort_keys=True), row["id"]],
                        )


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("audit", "0015_audit_seal_mode_freezes_actor_filter")]

    operations = [migrations.RunPython(forward, migrations.RunPython.noop)]
