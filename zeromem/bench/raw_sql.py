"""The statements Django sends for a tool read and write, run raw with psycopg: the floor
``manage.py bench`` compares the HTTP API with."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import psycopg
from psycopg.types.json import Jsonb

from audit import chain
from audit.models import AuditEvent
from memories.models import Memory
from zeromem.bench.harness import LOOPBACK


class RawSQL:
    """The statements Django sends for a tool read / write, run with psycopg directly on the
    same tables. Column lists come from the models so they match the ORM's."""

    def __init__(self, conninfo: str, *, client_binding: bool, tenant_id: int, key_id: int, key_label: str):
        factory = {"cursor_factory": psycopg.ClientCursor} if client_binding else {}
        # A transaction per operation (BEGIN is implicit, as under Django's atomic()).
        self.conn = psycopg.connect(conninfo, autocommit=False, **factory)
        # Autocommit connection for the bare primary-key SELECT.
        self.ac = psycopg.connect(conninfo, autocommit=True, **factory)
        self.cur = self.conn.cursor()
        self.accur = self.ac.cursor()
        self.tenant_id, self.key_id, self.key_label = tenant_id, str(key_id), key_label

        # bandit B608 (marked below): only the models' own table and column names are formatted into
        # these statements; every value is a %s parameter.
        mt = Memory._meta.db_table
        cols = [f.column for f in Memory._meta.concrete_fields]
        self.col = {c: i for i, c in enumerate(cols)}
        select_list = ", ".join(f'"{mt}"."{c}"' for c in cols)
        self.sql_select_live = (
            f'SELECT {select_list} FROM "{mt}" WHERE ("{mt}"."tenant_id" = %s AND "{mt}"."deleted_at" IS NULL '  # nosec B608
            f'AND ("{mt}"."expires_at" IS NULL OR "{mt}"."expires_at" > %s) AND "{mt}"."key" = %s) '
            f'ORDER BY "{mt}"."id" ASC LIMIT 1'
        )
        self.sql_select_for_update = (
            f'SELECT {select_list} FROM "{mt}" WHERE ("{mt}"."tenant_id" = %s AND "{mt}"."key" = %s '  # nosec B608
            f'AND "{mt}"."deleted_at" IS NULL) ORDER BY "{mt}"."id" ASC LIMIT 1 FOR UPDATE'
        )
        self.sql_select_pk = f'SELECT {select_list} FROM "{mt}" WHERE "{mt}"."id" = %s LIMIT 21'  # nosec B608
        self.sql_counter = (
            f'UPDATE "{mt}" SET "access_count" = ("{mt}"."access_count" + 1), "last_accessed_at" = %s '  # nosec B608
            f'WHERE "{mt}"."id" = %s'
        )
        self.sql_write = (
            f'UPDATE "{mt}" SET "value" = %s, "search_text" = %s, "search_tsv" = %s::tsvector, '  # nosec B608
            f'"version" = %s, "updated_at" = %s '  # nosec B608
            f'WHERE "{mt}"."id" = %s'
        )
        self.sql_version = (
            'INSERT INTO "memories_memoryversion" ("tenant_id", "memory_id", "version", "value", "op", '
            '"actor_kind", "actor_id", "created_at") VALUES (%s, %s, %s, %s, %s, %s, %s, %s) '
            'RETURNING "memories_memoryversion"."id"'
        )
        at = AuditEvent._meta.db_table
        acols = [f.column for f in AuditEvent._meta.concrete_fields if not f.primary_key]
        self.audit_cols = acols
        self.sql_audit = (
            f'INSERT INTO "{at}" ({", ".join(f"{chr(34)}{c}{chr(34)}" for c in acols)}) '  # nosec B608
            f'VALUES ({", ".join(["%s"] * len(acols))}) RETURNING "{at}"."id"'
        )

    def close(self):
        for c in (self.conn, self.ac):
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing on the way out
                pass

    def backend_pids(self) -> set[int]:
        return {self.conn.info.backend_pid, self.ac.info.backend_pid}

    def _insert_audit(self, *, action: str, key: str, memory: tuple, version: int, detail: dict, now) -> None:
        """The audit row audit_record writes for ``memory`` (a selected row), in the open transaction."""
        row = {
            "uid": uuid.uuid4(),
            "tenant_id": self.tenant_id,
            "occurred_at": now,
            "actor_kind": "api_key",
            "actor_id": self.key_id,
            "actor_label": self.key_label,
            "surface": "tool",
            "action": action,
            "target": key,
            "subject": memory[self.col["subject"]],
            "outcome": "ok",
            "request_id": uuid.uuid4().hex,
            "client_ip": LOOPBACK,
            "count": None,
            "version": version,
            "detail": detail,
        }
        # The same keyed digest audit_record computes (tamper evidence costs the raw side too).
        row.update(digest=chain.digest(row), seal=None, chain="", redacted=Jsonb({}))
        row["detail"] = Jsonb(detail)
        self.cur.execute(self.sql_audit, tuple(row[c] for c in self.audit_cols))
        self.cur.fetchone()

    # Each method returns the elapsed nanoseconds of its statements (commit included).

    def read(self, key: str, *, counter: bool = True, audit: bool = True) -> int:
        cur, col = self.cur, self.col
        t0 = time.perf_counter_ns()
        now = datetime.now(UTC)
        cur.execute(self.sql_select_live, (self.tenant_id, now, key))
        row = cur.fetchone()
        if counter:
            cur.execute(self.sql_counter, (now, row[col["id"]]))
        if audit:
            self._insert_audit(
                action="memory.read", key=key, memory=row, version=row[col["version"]], detail={}, now=now
            )
        self.conn.commit()
        return time.perf_counter_ns() - t0

    def write(self, key: str, value, search: dict) -> int:
        """``search``: the search columns the service stores (memories.search.index_fields)."""
        cur, col = self.cur, self.col
        t0 = time.perf_counter_ns()
        now = datetime.now(UTC)
        cur.execute(self.sql_select_for_update, (self.tenant_id, key))
        row = cur.fetchone()
        mid, version = row[col["id"]], row[col["version"]] + 1
        cur.execute(self.sql_write, (Jsonb(value), search["search_text"], search.get("search_tsv"), version, now, mid))
        cur.execute(
            self.sql_version, (self.tenant_id, mid, version, Jsonb(value), "write", "api_key", self.key_id, now)
        )
        cur.fetchone()
        self._insert_audit(
            action="memory.write", key=key, memory=row, version=version, detail={"created": False}, now=now
        )
        self.conn.commit()
        return time.perf_counter_ns() - t0

    def pk_select(self, memory_id: int) -> int:
        t0 = time.perf_counter_ns()
        self.accur.execute(self.sql_select_pk, (memory_id,))
        self.accur.fetchone()
        return time.perf_counter_ns() - t0
