"""The audit event table's monthly partitions (PostgreSQL; SQLite keeps one table and every
function here does nothing there).

``audit_auditevent`` is partitioned by range on ``occurred_at`` (audit migration 0010):

* ``audit_auditevent_pYYYY_MM`` — one per UTC month, created ahead by
  :func:`ensure_partitions` (this month and the next ``MONTHS_AHEAD``; schedule
  ``zeromem:audit-partitions``, daily).
* ``audit_auditevent_legacy`` — an existing table converted in place: everything before the
  conversion's boundary (absent on a fresh install).
* ``audit_auditevent_default`` — the safety net: an event whose month has no partition yet
  (the schedule stopped for months, a clock far off) lands here instead of failing the
  request. It should stay empty. Its rows are sealed, verified and purged row by row like
  any other; it is never dropped. A month whose range already has rows in it cannot get its
  own partition (PostgreSQL refuses), so :func:`ensure_partitions` skips that month and
  reports it (``blocked``): its events keep going to the default partition.

Every partition carries the append-only guards: the row trigger refusing UPDATE and DELETE
is cloned by PostgreSQL from the parent; the statement-level TRUNCATE trigger is not, so
:func:`create_partition` adds it. Whole months are dropped by the retention purge
(``audit.services.audit_partitions_drop``), never here.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from django.db import OperationalError, connection, transaction
from django.utils import timezone

TABLE = "audit_auditevent"
DEFAULT = f"{TABLE}_default"
MONTHS_AHEAD = 2
_LOCK = (0x5A4D, -1)  # pg_advisory_xact_lock: the audit namespace, "partitions"
# How long creating a partition waits for the event table's lock; every audit INSERT waits
# behind it meanwhile.
CREATE_LOCK_TIMEOUT = "1s"
LOCK_NOT_AVAILABLE = "55P03"
_logger = logging.getLogger("zeromem.audit")
_BOUND = re.compile(r"FROM \((.+)\) TO \((.+)\)")


def month_start(when: datetime) -> datetime:
    when = when.astimezone(UTC)
    return datetime(when.year, when.month, 1, tzinfo=UTC)


def add_months(month: datetime, n: int) -> datetime:
    index = month.year * 12 + month.month - 1 + n
    return datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC)


def partition_name(month: datetime) -> str:
    return f"{TABLE}_p{month:%Y_%m}"


def is_partitioned() -> bool:
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = %s::regclass", [TABLE])
        row = cursor.fetchone()
    return bool(row) and row[0] == "p"


def _refuse_truncate(cursor, name: str) -> None:
    cursor.execute(
        f"CREATE TRIGGER {name}_no_truncate BEFORE TRUNCATE ON {name} "
        "FOR EACH STATEMENT EXECUTE FUNCTION zeromem_audit_refuse_truncate()"
    )


def create_partition(cursor, month: datetime) -> str:
    """The partition of ``month`` (its first instant, UTC), with its TRUNCATE guard."""
    name = partition_name(month)
    cursor.execute(
        f"CREATE TABLE {name} PARTITION OF {TABLE} FOR VALUES FROM (%s) TO (%s)",
        [month, add_months(month, 1)],
    )
    _refuse_truncate(cursor, name)
    return name


def create_default_partition(cursor) -> None:
    cursor.execute(f"CREATE TABLE {DEFAULT} PARTITION OF {TABLE} DEFAULT")
    _refuse_truncate(cursor, DEFAULT)


@dataclass(frozen=True)
class Partition:
    name: str
    lower: datetime | None  # None: MINVALUE (the legacy partition)
    upper: datetime | None  # None: the default partition

    @property
    def is_default(self) -> bool:
        return self.upper is None


def _bound(text: str) -> datetime | None:
    text = text.strip()
    if text == "MINVALUE":
        return None
    return datetime.fromisoformat(text.strip("'")).astimezone(UTC)


def partitions() -> list[Partition]:
    """The partitions of the event table, oldest first, the default partition last."""
    if not is_partitioned():
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass",
            [TABLE],
        )
        rows = cursor.fetchall()
    found = []
    for name, bound in rows:
        match = _BOUND.search(bound)
        if match is None:  # DEFAULT
            found.append(Partition(name, None, None))
        else:
            found.append(Partition(name, _bound(match.group(1)), _bound(match.group(2))))
    return sorted(found, key=lambda p: (p.is_default, p.upper or datetime.max.replace(tzinfo=UTC)))


def _default_has_rows(cursor, month: datetime) -> bool:
    # bandit B608 (marked): the table name is a constant; the bounds are parameters.
    cursor.execute(
        f"SELECT EXISTS (SELECT 1 FROM {DEFAULT} WHERE occurred_at >= %s AND occurred_at < %s)",  # nosec B608
        [month, add_months(month, 1)],
    )
    return cursor.fetchone()[0]


def ensure_partitions(*, now: datetime | None = None, ahead: int = MONTHS_AHEAD) -> dict:
    """Create the partitions of this month and the next ``ahead`` months that do not exist
    yet (the schedule ``zeromem:audit-partitions``). Returns {"created": [...], "blocked":
    [...], "busy": [...]}: a blocked month has events in the default partition already and
    keeps using it; busy ones were not created because the event table stayed locked past
    ``CREATE_LOCK_TIMEOUT`` (the next run creates them: they are made months ahead).
    Idempotent; concurrent runs take turns on an advisory lock."""
    if not is_partitioned():
        return {"created": [], "blocked": [], "busy": []}
    now = now or timezone.now()
    created, blocked, wanted = [], [], []
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", list(_LOCK))
            covered = [(p.lower, p.upper) for p in partitions() if not p.is_default]
            first = month_start(now)
            # CREATE TABLE … PARTITION OF takes ACCESS EXCLUSIVE on the event table: waiting for
            # it behind one long transaction that touched the log, it would queue every audit
            # INSERT (every request of every tenant) until that transaction ends.
            cursor.execute("SELECT set_config('lock_timeout', %s, true)", [CREATE_LOCK_TIMEOUT])
            for n in range(ahead + 1):
                month = add_months(first, n)
                end = add_months(month, 1)
                if any((lo is None or lo < end) and month < up for lo, up in covered):
                    continue  # covered (a monthly partition, or the legacy one)
                if _default_has_rows(cursor, month):
                    blocked.append(partition_name(month))
                    continue
                wanted.append(month)
            for month in wanted:
                created.append(create_partition(cursor, month))
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        busy = [partition_name(month) for month in wanted]
        _logger.warning("audit partitions %s not created: the event table is busy; the next run tries again", busy)
        return {"created": [], "blocked": blocked, "busy": busy}
    return {"created": created, "blocked": blocked, "busy": []}
