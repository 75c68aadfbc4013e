"""New PostgreSQL connections while a benchmark runs, the warm-up that waits for the server's
connection pools to stop growing (the goal under load: no connection per request), and the WAL
one table wrote between two positions (pg_walinspect)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime


def settings_conninfo() -> str:
    """A psycopg conninfo string for Django's default database (the bench database)."""
    from django.conf import settings
    from psycopg.conninfo import make_conninfo

    db = settings.DATABASES["default"]
    return make_conninfo(
        dbname=db["NAME"],
        user=db.get("USER") or None,
        password=db.get("PASSWORD") or None,
        host=db.get("HOST") or None,
        port=str(db["PORT"]) if db.get("PORT") else None,
    )


class ConnWatch:
    """New PostgreSQL connections to the bench database during a phase, two ways:
    the ``sessions`` counter of pg_stat_database (every session ever established), and
    backends seen in pg_stat_activity with ``backend_start`` after the phase began
    (polled, so even short-lived ones are caught when they live ≥ one poll interval)."""

    POLL_S = 0.1

    def __init__(self, conninfo: str, exclude_pids: set[int]):
        import psycopg

        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.exclude = set(exclude_pids) | {self.conn.info.backend_pid}
        self.lock = threading.Lock()

    def close(self):
        self.conn.close()

    def _one(self, sql, params=()):
        with self.lock:
            cur = self.conn.execute(sql, params)
            return cur.fetchall()

    def sessions(self) -> int:
        self._one("SELECT pg_stat_clear_snapshot()")
        return self._one("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")[0][0]

    def client_backends(self) -> dict[int, datetime]:
        rows = self._one(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend'"
        )
        return {pid: start for pid, start in rows if pid not in self.exclude}

    def start(self):
        self.since = self._one("SELECT now()")[0][0]
        self.sessions0 = self.sessions()
        self.backends0 = self.client_backends()
        self.new_pids: set[int] = set()
        self.stop_evt = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        deadline = time.monotonic() + 3600  # bounded even if stop() is never called
        while not self.stop_evt.is_set() and time.monotonic() < deadline:
            for pid, started in self.client_backends().items():
                if started >= self.since:
                    self.new_pids.add(pid)
            self.stop_evt.wait(self.POLL_S)

    def stop(self, settle_s: float = 1.2) -> dict:
        self.stop_evt.set()
        self.thread.join(timeout=5)
        backends1 = self.client_backends()
        for pid, started in backends1.items():
            if started >= self.since:
                self.new_pids.add(pid)
        # A new backend reports its session when it first goes idle; give it that moment.
        time.sleep(settle_s)
        sessions1 = self.sessions()
        return {
            "new_sessions_pg_stat_database": sessions1 - self.sessions0,
            "new_backends_seen_pg_stat_activity": len(self.new_pids),
            "client_backends_before": len(self.backends0),
            "client_backends_after": len(backends1),
        }

    def server_backend_pids(self) -> list[int]:
        return sorted(self.client_backends())


def warm_until_pools_settle(watch: ConnWatch, run_round: Callable[[int], object], *, rounds: int = 6) -> list[int]:
    """Run ``run_round(i)`` (load at full concurrency) until a round opens no new connection:
    psycopg_pool adds a connection only when a request has to wait for one, so the workers'
    pools grow during the first rounds. At most ``rounds``; returns the new sessions per round."""
    opened = []
    for i in range(rounds):
        before = watch.sessions()
        run_round(i)
        time.sleep(1.1)  # a new backend reports its session when it first goes idle
        opened.append(watch.sessions() - before)
        if opened[-1] == 0:
            break
    return opened


def connections_text(counted: dict) -> str:
    """What :meth:`ConnWatch.stop` counted, as the reports print it."""
    return (
        f"{counted['new_sessions_pg_stat_database']} (pg_stat_database.sessions), "
        f"{counted['new_backends_seen_pg_stat_activity']} (pg_stat_activity); "
        f"client backends {counted['client_backends_before']} → {counted['client_backends_after']}"
    )


def walinspect_available() -> bool:
    """Whether pg_walinspect can be used here (created if the role may: a superuser's database)."""
    from django.db import DatabaseError, connection, transaction

    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        return True
    except DatabaseError:
        return False


# The WAL records that touch one table or one of its indexes, in this database.
_TABLE_WAL_SQL = """
SELECT coalesce(sum(record_length + coalesce(fpi_length, 0)), 0)
FROM pg_get_wal_records_info(%s, %s)
WHERE block_ref ~ (
    SELECT 'rel \\d+/' || d.oid || '/(' || string_agg(pg_relation_filenode(c.oid)::text, '|') || ') '
    FROM pg_class c, pg_database d
    WHERE d.datname = current_database()
      AND (c.oid = %s::regclass OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = %s::regclass))
    GROUP BY d.oid)"""


def table_wal_bytes(before, after, table: str, *, walinspect: bool) -> tuple[float, bool]:
    """Bytes of WAL between two flushed positions and whether they are ``table``'s own: with
    pg_walinspect, the records that touch the table or one of its indexes; without it — or when
    a checkpoint has recycled the segments since — the cluster's, every session's."""
    from django.db import DatabaseError, connection, transaction

    if walinspect:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(_TABLE_WAL_SQL, [before, after, table, table])
                return float(cursor.fetchone()[0]), True
        except DatabaseError:
            pass
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_wal_lsn_diff(%s, %s)", [after, before])
        return float(cursor.fetchone()[0]), False
