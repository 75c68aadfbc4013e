"""PostgreSQL: the audit event table becomes a table partitioned by month on ``occurred_at``
(native declarative partitioning), without copying a row. SQLite keeps one table.

Conversion (non-atomic migration; the steps that scan the table run before the short
conversion transaction and do not block inserts):

1. ``CREATE UNIQUE INDEX CONCURRENTLY`` on ``(id, occurred_at)`` — a partitioned table's
   unique index must contain the partition key, so the id alone cannot stay unique on the
   parent; ids still come from one sequence, and seals hold plain ids (no FK refers to them).
2. ``CHECK (occurred_at < <boundary>) NOT VALID``, then ``VALIDATE`` (one scan, inserts
   continue). ``<boundary>`` is the start of next month (of the month after if less than two
   days remain; the month after the newest stored event if that is later), so no insert
   meets the check before the conversion commits.
3. In one transaction: the table is renamed ``audit_auditevent_legacy``; a partitioned
   ``audit_auditevent`` is created with the same columns; the old table is attached as the
   partition ``FROM (MINVALUE) TO (<boundary>)`` — the validated CHECK spares the scan, the
   index of step 1 becomes the partition's part of the parent's unique index, and the other
   indexes are attached by name instead of being rebuilt. The id sequence continues after
   the highest id. A fresh (empty) table is simply dropped instead of attached.
4. Monthly partitions from ``<boundary>`` (fresh install: from this month) for two months
   ahead, and a DEFAULT partition as a safety net (``audit/partitions.py``); the schedule
   ``zeromem:audit-partitions`` keeps three months ahead.

The append-only guards of 0003/0007 move to the parent: the row trigger is cloned by
PostgreSQL to every partition (present and future); the TRUNCATE trigger is not, so each
partition gets its own (``audit.partitions.create_partition`` does it for new ones).

Reverse: not supported on PostgreSQL (copying the log back into one table is an operator's
decision; see README "Audit log").
"""

from datetime import UTC, datetime, timedelta

from django.db import migrations

from audit import partitions
from zeromem.kernel.pgindexes import drop_if_invalid

TABLE = "audit_auditevent"
LEGACY = "audit_auditevent_legacy"
# The indexes of the model at 0009 (audit/models.py Meta.indexes), re-created on the parent
# with their Django names: each finds the legacy table's identical index and attaches it.
INDEXES = {
    "audit_tenant_actor": "(tenant_id, actor_kind, actor_id)",
    "audit_tenant_subject": "(tenant_id, subject) WHERE NOT subject::text = ''::text",
    "audit_tenant_target": "(tenant_id, target varchar_pattern_ops)",
    "audit_tenant_time": "(tenant_id, occurred_at)",
    "audit_unsealed": "(tenant_id, id) WHERE seal IS NULL",
}
ID_KEY = "audit_auditevent_id_time_key"


def _boundary(now: datetime) -> datetime:
    month = partitions.month_start(now)
    following = partitions.add_months(month, 1)
    return partitions.add_months(month, 2) if following - now < timedelta(days=2) else following


def _fk_name(cursor) -> str:
    cursor.execute(
        "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'f'",
        [TABLE],
    )
    (name,) = cursor.fetchone()
    return name


def forward(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = %s::regclass", [TABLE])
        if cursor.fetchone()[0] == "p":
            return  # converted already (a rerun after a failure further on)
        cursor.execute("SELECT EXISTS (SELECT 1 FROM audit_auditevent)")
        (has_rows,) = cursor.fetchone()
        now = datetime.now(UTC)
        boundary = partitions.month_start(now)
        if has_rows:
            # Past every stored event, even one a clock far ahead dated in the future.
            cursor.execute(f"SELECT max(occurred_at) FROM {TABLE}")  # nosec B608
            (newest,) = cursor.fetchone()
            boundary = max(_boundary(now), partitions.add_months(partitions.month_start(newest), 1))
        # 1 and 2: outside any transaction, inserts continue. An index left invalid by an
        # interrupted earlier run is built again.
        drop_if_invalid(cursor, ID_KEY)
        cursor.execute(f"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {ID_KEY} ON {TABLE} (id, occurred_at)")
        cursor.execute(f"ALTER TABLE {TABLE} DROP CONSTRAINT IF EXISTS audit_auditevent_legacy_bound")
        cursor.execute(
            f"ALTER TABLE {TABLE} ADD CONSTRAINT audit_auditevent_legacy_bound "
            "CHECK (occurred_at < %s) NOT VALID",
            [boundary],
        )
        cursor.execute(f"ALTER TABLE {TABLE} VALIDATE CONSTRAINT audit_auditevent_legacy_bound")
        fk = _fk_name(cursor)
        # 3: the conversion, one short transaction.
        cursor.execute("BEGIN")
        try:
            cursor.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
            cursor.execute(f"SELECT coalesce(max(id), 0) FROM {TABLE}")  # nosec B608
            (max_id,) = cursor.fetchone()
            cursor.execute(f"SELECT last_value FROM {TABLE}_id_seq")  # nosec B608
            (last_value,) = cursor.fetchone()
            cursor.execute(f"DROP TRIGGER audit_event_append_only ON {TABLE}")
            cursor.execute(f"DROP TRIGGER audit_auditevent_no_truncate ON {TABLE}")
            cursor.execute(f"ALTER TABLE {TABLE} RENAME TO {LEGACY}")
            cursor.execute(f"ALTER TABLE {LEGACY} ALTER COLUMN id DROP IDENTITY")
            cursor.execute(f"ALTER TABLE {LEGACY} RENAME CONSTRAINT audit_auditevent_pkey TO {LEGACY}_pkey")
            cursor.execute(f"ALTER TABLE {LEGACY} RENAME CONSTRAINT {fk} TO {LEGACY}_tenant_fk")
            cursor.execute(f"ALTER INDEX {ID_KEY} RENAME TO {LEGACY}_id_time_key")
            # A constraint's index on the parent attaches only a constraint's index on the partition.
            cursor.execute(
                f"ALTER TABLE {LEGACY} ADD CONSTRAINT {LEGACY}_id_time_key UNIQUE USING INDEX {LEGACY}_id_time_key"
            )
            for name in INDEXES:
                cursor.execute(f"ALTER INDEX {name} RENAME TO {LEGACY}_{name.removeprefix('audit_')}")
            cursor.execute(
                f"CREATE TABLE {TABLE} (LIKE {LEGACY} INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
                "INCLUDING STORAGE INCLUDING COMPRESSION) PARTITION BY RANGE (occurred_at)"
            )
            cursor.execute(f"ALTER TABLE {TABLE} DROP CONSTRAINT audit_auditevent_legacy_bound")
            start = max(max_id, last_value) + 1
            cursor.execute(
                f"ALTER TABLE {TABLE} ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY (START WITH {int(start)})"
            )
            cursor.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT {ID_KEY} UNIQUE (id, occurred_at)")
            if has_rows:
                cursor.execute(
                    f"ALTER TABLE {TABLE} ATTACH PARTITION {LEGACY} FOR VALUES FROM (MINVALUE) TO (%s)", [boundary]
                )
                cursor.execute(
                    f"CREATE TRIGGER {LEGACY}_no_truncate BEFORE TRUNCATE ON {LEGACY} "
                    "FOR EACH STATEMENT EXECUTE FUNCTION zeromem_audit_refuse_truncate()"
                )
            else:
                cursor.execute(f"DROP TABLE {LEGACY}")
            for name, definition in INDEXES.items():
                using, _, where = definition.partition(" WHERE ")
                cursor.execute(f"CREATE INDEX {name} ON {TABLE} {using}" + (f" WHERE {where}" if where else ""))
            # Same name as Django gave it, so later migrations find it.
            cursor.execute(
                f"ALTER TABLE {TABLE} ADD CONSTRAINT {fk} FOREIGN KEY (tenant_id) REFERENCES memories_tenant (id) "
                "DEFERRABLE INITIALLY DEFERRED"
            )
            cursor.execute(
                f"CREATE TRIGGER audit_event_append_only BEFORE UPDATE OR DELETE ON {TABLE} "
                "FOR EACH ROW EXECUTE FUNCTION zeromem_audit_event_guard()"
            )
            cursor.execute(
                f"CREATE TRIGGER {TABLE}_no_truncate BEFORE TRUNCATE ON {TABLE} "
                "FOR EACH STATEMENT EXECUTE FUNCTION zeromem_audit_refuse_truncate()"
            )
            partitions.create_default_partition(cursor)
            month = boundary
            while month <= partitions.add_months(partitions.month_start(now), partitions.MONTHS_AHEAD):
                partitions.create_partition(cursor, month)
                month = partitions.add_months(month, 1)
            cursor.execute("COMMIT")
        except BaseException:
            cursor.execute("ROLLBACK")
            raise


def reverse(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        raise RuntimeError("the partitioned audit log cannot be turned back into one table by a migration")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("audit", "0009_audit_daily_counts")]

    operations = [migrations.RunPython(forward, reverse)]
