"""LangGraph store items stored before their subject was inferred get it: a memory
``lg:users:<id>:…`` (also ``lg:user:``, ``lg:usr:``; the prefix ``ZEROMEM_LANGGRAPH_PREFIX``)
with subject "", live or trashed, gets the subject ``<id>`` names — the rule a write uses,
:func:`zeromem.kernel.subjectkeys.subject_of_key` (imported: it reads settings at call time
and no model). Forgets and the portal reached these items by namespace already; ``?subject=``
lists, the admin's subject filter and everything else keyed on ``subject`` missed them.

Built for big tables (this migration is not atomic): per tenant and LangGraph word, the
namespace range ``lg:users:`` ≤ namespace < ``lg:users;`` (";" follows ":" in byte order:
``namespace`` is ``COLLATE "C"`` on PostgreSQL, migration 0002, and BINARY on SQLite) is
walked on the ``memory_tenant_namespace`` index — live and trashed rows, which the key
indexes hold apart — ``BATCH`` rows at a time in (namespace, key, id) order from a keyset
cursor, each batch one transaction: no batch reads a row before the cursor, and a key that
names no subject (an escape no write makes) is passed once, not read again by every batch.

Only the subject changes: no version, ``updated_at`` and ETags kept, no audit event (nothing
was written by anyone). An UPDATE sets it only where the row still has that key and no
subject (a write meanwhile keeps its own). Versions keep "": every reader already takes a
version naming no one under a subject's namespace as theirs (the forget's
``_versions_left`` and ``_made_from_their_values``) or falls back to the memory's subject
(``encryption.version_subject``). A sensitive item stays sealed under the tenant's data key
until ``manage.py crypto_reencrypt`` moves it to its subject's (README "Encryption at rest").
"""

from django.conf import settings
from django.db import migrations, transaction

from zeromem.kernel.subjectkeys import LANGGRAPH_WORDS, subject_of_key

BATCH = 2000


def forward(apps, schema_editor):
    connection = schema_editor.connection
    Tenant = apps.get_model("memories", "Tenant")
    root = settings.ZEROMEM_LANGGRAPH_PREFIX + ":"
    for tenant_id in Tenant.objects.order_by("pk").values_list("pk", flat=True).iterator():
        for word in LANGGRAPH_WORDS:
            low, high = f"{root}{word}:", f"{root}{word};"
            after = None
            while True:
                with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
                    rows = _batch(cursor, tenant_id, low, high, after)
                    updates = [
                        (subject, pk, key)
                        for pk, _namespace, key, current in rows
                        if not current and (subject := subject_of_key(key))
                    ]
                    if updates:
                        cursor.executemany(
                            "UPDATE memories_memory SET subject = %s WHERE id = %s AND key = %s AND subject = ''",
                            updates,
                        )
                if len(rows) < BATCH:
                    break
                after = rows[-1][:3]


def _batch(cursor, tenant_id, low, high, after):
    """The next ``BATCH`` rows (id, namespace, key, subject) of the tenant's namespace range
    after the cursor (namespace, key, id): one range of memory_tenant_namespace."""
    sql = (
        "SELECT id, namespace, key, subject FROM memories_memory"
        " WHERE tenant_id = %s AND namespace >= %s AND namespace < %s"
    )
    params = [tenant_id, low, high]
    if after is not None:
        pk, namespace, key = after
        sql += " AND (namespace, key, id) > (%s, %s, %s)"
        params += [namespace, key, pk]
    cursor.execute(sql + " ORDER BY namespace, key, id LIMIT %s", [*params, BATCH])
    return cursor.fetchall()


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("memories", "0043_idempotency_renewed_at_pending")]

    operations = [migrations.RunPython(forward, migrations.RunPython.noop, elidable=True)]
