"""Tokens returned, per tenant and day: what the tool results cost the models that read them.

A tool response adds its bytes and estimated tokens to this process's running totals
(:func:`result_returned`: a dict update under a lock, no query). At most every
``ZEROMEM_USAGE_FLUSH_SECONDS`` (default 10) the request that finds the totals due writes
them — one UPSERT statement for every (tenant, day) pending — so the figures cost one round
trip per process per interval, not one per request. The process writes what is pending when
it exits; a crash loses at most one interval of one process's counts (an estimate, shown as
one). ``ZEROMEM_USAGE_FLUSH_SECONDS=0`` writes on every response.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from datetime import date

from django.conf import settings
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.utils import timezone

from memories.models import TokenUsageDay

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_pending: dict[tuple[int, date], list[int]] = {}  # (tenant id, day) → [results, bytes, tokens]
_last_flush = time.monotonic()


def result_returned(*, tenant_id: int, size: int, tokens: int, now=None) -> None:
    """Count one result of ``size`` bytes and ``tokens`` estimated tokens for the tenant."""
    global _last_flush
    day = (now or timezone.now()).date()
    with _lock:
        totals = _pending.setdefault((tenant_id, day), [0, 0, 0])
        totals[0] += 1
        totals[1] += size
        totals[2] += tokens
        due = time.monotonic() - _last_flush >= settings.ZEROMEM_USAGE_FLUSH_SECONDS
        if due:
            _last_flush = time.monotonic()
    if due:
        flush()


def flush() -> int:
    """Write the pending totals (one statement); returns how many (tenant, day) rows it touched.
    On a database error the totals stay pending for the next flush."""
    global _pending
    with _lock:
        taken, _pending = _pending, {}
    if not taken:
        return 0
    table = TokenUsageDay._meta.db_table
    rows = [(tenant_id, day, *totals) for (tenant_id, day), totals in sorted(taken.items())]
    values = ", ".join(["(%s, %s, %s, %s, %s)"] * len(rows))
    sql = (
        f"INSERT INTO {table} (tenant_id, day, results, bytes, tokens) VALUES {values} "  # nosec B608
        f"ON CONFLICT (tenant_id, day) DO UPDATE SET results = {table}.results + excluded.results, "
        f"bytes = {table}.bytes + excluded.bytes, tokens = {table}.tokens + excluded.tokens"
    )
    params = [value for row in rows for value in row]
    try:
        # A savepoint inside a caller's transaction: a refused write cannot break it.
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, params)
    except IntegrityError:  # a tenant deleted meanwhile: its counts go with it
        logger.warning("token usage: flush refused; dropped", exc_info=True)
        return 0
    except DatabaseError:
        logger.warning("token usage: flush failed; kept for the next one", exc_info=True)
        with _lock:
            for key, totals in taken.items():
                mine = _pending.setdefault(key, [0, 0, 0])
                for i in range(3):
                    mine[i] += totals[i]
        return 0
    return len(rows)


def discard_pending() -> None:
    """Forget the unwritten totals (tests start from none)."""
    with _lock:
        _pending.clear()


def _flush_at_exit() -> None:
    try:
        flush()
    except Exception:  # the interpreter is going away; the database may be too
        logger.warning("token usage: flush at exit failed", exc_info=True)


atexit.register(_flush_at_exit)
