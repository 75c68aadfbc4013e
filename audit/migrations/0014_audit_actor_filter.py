"""The actor a reading of the log filtered by moves from ``detail`` to its own committed
column ``actor_filter``, so a forget of that subject redacts it (audit/chain.py: events
written before, with the column empty, keep their digests). The partial index serves the
redaction's lookup; only readings with an actor filter enter it. On PostgreSQL the column
is added to the partitioned parent (a metadata change, no rewrite) and reaches every
partition.

The index is built without holding up the log's INSERTs (every audited request): a plain
CREATE INDEX on the parent takes SHARE on every partition, queued behind any transaction
that wrote the log and then held for the whole build, a scan of every event. So (this
migration is not atomic): the parent's index ``ON ONLY`` (no rows to read; its brief SHARE
lock asked with a short ``lock_timeout`` and asked again, as ``audit.partitions`` does), each
partition's ``CONCURRENTLY``, then attached (the parent's turns valid with the last one).
A partition created meanwhile gets its own from the parent's, as later ones do.
"""

import time

from django.db import OperationalError, connection, migrations, models, transaction

from audit import partitions
from zeromem.kernel.pgindexes import drop_if_invalid

NAME = "audit_tenant_actor_filter"
COLUMNS = "(tenant_id, actor_filter) WHERE NOT (actor_filter = '')"
INDEX = models.Index(condition=~models.Q(actor_filter=""), fields=["tenant", "actor_filter"], name=NAME)
ATTEMPTS = 60  # of partitions.CREATE_LOCK_TIMEOUT each, a pause between


def _briefly_locking(sql: str) -> None:
    """``sql``, a statement that needs a brief lock on the event table, waiting for it at most
    ``lock_timeout`` at a time: waiting longer (behind a long transaction that wrote the log)
    would queue every audit INSERT behind it."""
    for attempt in range(ATTEMPTS):
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT set_config('lock_timeout', %s, true)", [partitions.CREATE_LOCK_TIMEOUT])
                cursor.execute(sql)
            return
        except OperationalError as exc:
            if getattr(exc.__cause__, "sqlstate", None) != partitions.LOCK_NOT_AVAILABLE or attempt == ATTEMPTS - 1:
                raise
            time.sleep(0.5)


def _indexed_partitions(cursor) -> set[str]:
    """The partitions whose index is attached to the parent's already (a run before, or a
    partition created after the parent's index, which made its own)."""
    cursor.execute(
        "SELECT ix.indrelid::regclass::text FROM pg_inherits x JOIN pg_index ix ON ix.indexrelid = x.inhrelid "
        "WHERE x.inhparent = %s::regclass",
        [NAME],
    )
    return {name for (name,) in cursor.fetchall()}


def forward(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.add_index(apps.get_model("audit", "AuditEvent"), INDEX)
        return
    _briefly_locking(f"CREATE INDEX IF NOT EXISTS {NAME} ON ONLY {partitions.TABLE} {COLUMNS}")
    with connection.cursor() as cursor:
        done = _indexed_partitions(cursor)
        for partition in partitions.partitions():
            if partition.name in done:
                continue
            child = f"{partition.name}_actor_filter"
            drop_if_invalid(cursor, child)  # left by an interrupted run
            cursor.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {child} ON {partition.name} {COLUMNS}")
            _briefly_locking(f"ALTER INDEX {NAME} ATTACH PARTITION {child}")


def backward(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.remove_index(apps.get_model("audit", "AuditEvent"), INDEX)
        return
    schema_editor.execute(f"DROP INDEX IF EXISTS {NAME}")  # and its partitions' indexes


class Migration(migrations.Migration):
    atomic = False

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
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name='auditevent', index=INDEX)],
            database_operations=[migrations.RunPython(forward, backward)],
        ),
    ]
