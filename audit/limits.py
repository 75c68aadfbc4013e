"""Exact fixed-window counters shared by every process: the per-key rate limit, the
failed-authentication throttle and its per-minute tallies.

With ``REDIS_URL`` configured a window is one Redis key, incremented and given its expiry
in one Lua script (atomic, one round trip). Otherwise it is one :class:`RateCounter` row,
incremented with ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING`` (PostgreSQL, and
SQLite >= 3.35): one statement, atomic under concurrency, so N processes never let more
than the limit through. Django's file cache is not used: its incr is a read and a write,
and parallel requests raced past the limit (29-41 of 80 passed a limit of 20).

A *tallied* bucket is also remembered as pending, so that :func:`drain_tallies` can hand
each closed window's count out exactly once (the failed-authentication aggregation).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from time import monotonic as _monotonic  # its own name: tests fake this module's time.time()

from django.conf import settings
from django.db import DatabaseError, connection

from audit.models import ConcurrencySlot, RateCounter
from zeromem.kernel import hotsql

logger = logging.getLogger(__name__)

# A closed window stays countable this long, for drain_tallies to pick up.
KEEP_SECONDS = 3600

_INCR = """
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
if n == tonumber(ARGV[1]) then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  if ARGV[3] ~= '' then redis.call('SADD', KEYS[2], ARGV[3]) end
end
return n
"""
_TAKE = """
if redis.call('SREM', KEYS[1], ARGV[1]) == 1 then return redis.call('GET', KEYS[2]) end
return false
"""
_PENDING = "zm:rl:pending:"


@dataclass(frozen=True)
class Hit:
    count: int  # this window's count, this hit included
    retry_after: float  # seconds until the window ends


def clock() -> float:
    """The limiter's clock (seconds since the epoch): what windows are counted in, and what
    a tally's flush takes as the current minute, so that both agree (a flush on another
    clock once took a window that was still counting for closed)."""
    return time.time()


def hit(bucket: str, *, window: int = 60, cost: int = 1, tally: str = "", now: float | None = None) -> Hit:
    """Count ``cost`` against ``bucket``'s current window. ``tally``: a prefix of ``bucket``
    under which the window is remembered for :func:`drain_tallies`. One round trip."""
    now = time.time() if now is None else now
    start = int(now // window) * window
    url = settings.ZEROMEM_REDIS_URL
    count = _redis_hit(url, bucket, start, window, cost, tally) if url else _db_hit(bucket, start, cost)
    return Hit(count=count, retry_after=start + window - now)


class OverLimit(Exception):  # noqa: N818 - what it says: the counter went past its limit
    """A counter taken with :func:`hit_riding` went past its limit."""

    def __init__(self, hit: Hit):
        super().__init__(f"over the limit: {hit.count}")
        self.hit = hit


@contextmanager
def hit_riding(bucket: str, *, limit: int, window: int = 60, cost: int = 1) -> Iterator[None]:
    """:func:`hit` for the block's operation, whose first statement is a read (a tool read):
    without Redis the counter's UPSERT goes to the database with that read, as one statement
    (zeromem/kernel/hotsql.py ``riding``: a tool read is two round trips, not three), or alone
    before any other statement the block sends, or at its end. Past ``limit`` it raises
    :class:`OverLimit` as the count comes back — before the operation has written anything,
    its audit event included (the read's rows are dropped). With Redis, taken at once."""
    now = time.time()
    start = int(now // window) * window
    if settings.ZEROMEM_REDIS_URL:
        taken = hit(bucket, window=window, cost=cost, now=now)
        if taken.count > limit:
            raise OverLimit(taken)
        yield
        return

    def counted(row: tuple) -> None:
        (count,) = row
        if count == cost:
            _drop_closed_windows(start)
        if count > limit:
            raise OverLimit(Hit(count=count, retry_after=start + window - now))

    sql = functools.partial(_upsert_sql, connection.vendor)
    with hotsql.riding(hotsql.Rider(sql, [bucket[:200], start, cost], counted, limit=limit)):
        yield


def drain_tallies(tally: str, *, before: float) -> list[tuple[str, int, int]]:
    """(bucket, window start, count) of every tallied window of ``tally`` that started
    before ``before``, each handed out once across all callers and processes."""
    url = settings.ZEROMEM_REDIS_URL
    if url:
        return _redis_drain(url, tally, before)
    table = connection.ops.quote_name(RateCounter._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {table} WHERE bucket LIKE %s AND window_start < %s RETURNING bucket, window_start, count",  # nosec B608
            [f"{tally}%", int(before)],
        )
        return [(bucket, start, count) for bucket, start, count in cursor.fetchall()]


def _db_hit(bucket: str, start: int, cost: int) -> int:
    own_transaction = connection.get_autocommit() and not connection.in_atomic_block
    (count,) = hotsql.fetchone(_upsert_sql(connection.vendor, own_transaction), [bucket[:200], start, cost])
    if count == cost:
        _drop_closed_windows(start)
    return count


def _drop_closed_windows(start: int) -> None:
    # A bucket's first hit in a window: old windows go (index ratecounter_window).
    # Through hotsql: a read's event may be pending on the connection (answered later).
    table = connection.ops.quote_name(RateCounter._meta.db_table)
    sql, params = f"DELETE FROM {table} WHERE window_start < %s", [start - KEEP_SECONDS]  # nosec B608
    if not hotsql.own_transaction(connection):
        hotsql.execute(sql, params)  # inside a transaction: its error is the transaction's
        return
    # Housekeeping, a transaction of its own: it never fails the call whose counter it follows
    # (a piped read's event may be written already). A pending event's answer is read first:
    # its error is the call's.
    hotsql.read_pending()
    try:
        hotsql.execute(sql, params)
    except DatabaseError:
        logger.warning("rate counters: closed windows not dropped now (the next first hit drops them)", exc_info=True)


@cache
def _upsert_sql(vendor: str, own_transaction: bool) -> str:
    """The counter's one statement. On PostgreSQL, when it is a transaction of its own, its
    commit does not wait for the WAL flush (``synchronous_commit`` off for that transaction
    only): a counter is not a record, and a crash of PostgreSQL could lose at most the last
    fraction of a second of counts (``wal_writer_delay`` × 3), letting a client that many
    more requests through in that minute. Everything else keeps waiting for the flush — the
    audit INSERT right after it included, whose flush then carries the counter's WAL too: one
    flush per read instead of two. Inside an enclosing transaction (whose other writes may be
    audit events) the setting is never touched."""
    table = connection.ops.quote_name(RateCounter._meta.db_table)
    return _counter_upsert(vendor, own_transaction, f"{table}.count + EXCLUDED.count")


def _counter_upsert(vendor: str, own_transaction: bool, new_count: str) -> str:
    """A counter row's INSERT … ON CONFLICT DO UPDATE SET count = ``new_count`` RETURNING
    count; when it is a transaction of its own on PostgreSQL, committed without waiting for
    the WAL flush (``synchronous_commit`` off for that transaction only)."""
    table = connection.ops.quote_name(RateCounter._meta.db_table)
    values = "VALUES (%s, %s, %s)"
    if vendor == "postgresql" and own_transaction:
        values = "SELECT %s, %s, %s WHERE set_config('synchronous_commit', 'off', true) = 'off'"
    return (
        f"INSERT INTO {table} (bucket, window_start, count) {values} "  # nosec B608
        f"ON CONFLICT (bucket, window_start) DO UPDATE SET count = {new_count} RETURNING count"
    )


@cache
def _redis(url: str):
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    return client, client.register_script(_INCR), client.register_script(_TAKE)


def _redis_hit(url: str, bucket: str, start: int, window: int, cost: int, tally: str) -> int:
    client, incr, _take = _redis(url)
    keys = [f"zm:rl:{bucket}:{start}", _PENDING + tally]
    args = [cost, window + KEEP_SECONDS, f"{start}|{bucket}" if tally else ""]
    # redis is imported only where REDIS_URL is set (importing it loads its OpenTelemetry
    # observability module whenever the SDK is installed, tracing on or off).
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import NoScriptError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    conn = _thread_connection(client, url)
    try:
        conn.send_command("EVALSHA", incr.sha, 2, *keys, *args)
        return int(conn.read_response())
    except NoScriptError:
        pass  # the server lost its scripts (restart, SCRIPT FLUSH): the Script object loads it
    except (RedisConnectionError, RedisTimeoutError):
        conn.disconnect()  # a fresh socket next time; this hit goes through the client's retries
    return int(incr(keys=keys, args=args))


_local = threading.local()


def _thread_connection(client, url: str):
    """This thread's own connection to ``url`` (the client pool's settings, outside the pool),
    kept for the thread's life: the counter is the one Redis call of every request, and the
    client's per-command machinery (pool checkout and return, retry wrapper, command parsing)
    cost more CPU than the round trip. It goes with its thread (a thread per request under
    Django's ASGI handler: the socket is closed when the thread's storage is collected, and
    the pool never counted it); a forked child (django-q2's workers) makes a fresh one."""
    held = getattr(_local, "redis", None)
    pid = os.getpid()
    if held is None or held[0] != url or held[1] != pid:
        pool = client.connection_pool
        held = _local.redis = (url, pid, pool.connection_class(**pool.connection_kwargs))
    return held[2]


def _redis_drain(url: str, tally: str, before: float) -> list[tuple[str, int, int]]:
    client, _incr, take = _redis(url)
    out = []
    for raw in client.smembers(_PENDING + tally):
        member = raw.decode()
        start_text, _, bucket = member.partition("|")
        if int(start_text) >= before:
            continue
        count = take(keys=[_PENDING + tally, f"zm:rl:{bucket}:{start_text}"], args=[member])
        if count is not None:
            out.append((bucket, int(start_text), int(count)))
    return out


# --- backlogs: work charged after the fact, drained at one second per second ---------------

# A backlog is one RateCounter row whose count is the time (Unix milliseconds) its backlog
# runs out ("theoretical arrival time" of the generic cell rate algorithm). Its window_start is
# this constant, above any real window: the pruning of old windows never takes it.
BACKLOG_ROW = 2**62
_BACKLOG = """
local t = tonumber(redis.call('GET', KEYS[1]) or '0')
local now = tonumber(ARGV[1])
if t < now then t = now end
t = t + tonumber(ARGV[2])
redis.call('SET', KEYS[1], t, 'PX', math.floor(t - now) + 60000)
return t
"""


def backlog(bucket: str, *, add_ms: int = 0, now: float | None = None) -> float:
    """Seconds of backlog ``bucket`` holds now, after adding ``add_ms`` milliseconds to it
    (0: only read it). A backlog drains at one second per second and never goes below zero;
    adds from every process are exact (Redis: one script; database: one UPSERT, a plain
    SELECT when only reading)."""
    now_ms = int((time.time() if now is None else now) * 1000)
    url = settings.ZEROMEM_REDIS_URL
    if url:
        client, *_ = _redis(url)
        key = f"zm:bl:{bucket}"
        if add_ms <= 0:
            raw = client.get(key)
            until = int(float(raw)) if raw is not None else 0
        else:
            until = int(_backlog_script(url)(keys=[key], args=[now_ms, int(add_ms)]))
    else:
        table = connection.ops.quote_name(RateCounter._meta.db_table)
        with connection.cursor() as cursor:
            if add_ms <= 0:
                cursor.execute(
                    f"SELECT count FROM {table} WHERE bucket = %s AND window_start = %s",  # nosec B608
                    [bucket[:200], BACKLOG_ROW],
                )
            else:
                own_transaction = connection.get_autocommit() and not connection.in_atomic_block
                cursor.execute(
                    _backlog_sql(connection.vendor, own_transaction),
                    [bucket[:200], BACKLOG_ROW, now_ms + int(add_ms), now_ms, now_ms, int(add_ms)],
                )
            row = cursor.fetchone()
        until = row[0] if row else 0
    return max(0, until - now_ms) / 1000


@cache
def _backlog_sql(vendor: str, own_transaction: bool) -> str:
    """The backlog's UPSERT; like the rate counter's (:func:`_upsert_sql`), a transaction of
    its own does not wait for the WAL flush on PostgreSQL: a backlog is a counter, not a
    record (a crash of PostgreSQL could forget the last fraction of a second of charges)."""
    table = connection.ops.quote_name(RateCounter._meta.db_table)
    return _counter_upsert(vendor, own_transaction, f"CASE WHEN {table}.count > %s THEN {table}.count ELSE %s END + %s")


@cache
def _backlog_script(url: str):
    client, *_ = _redis(url)
    return client.register_script(_BACKLOG)


# --- concurrency slots: at most N pieces of expensive work per holder at once -------------

_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  return 1
end
return 0
"""


def slot_acquire(holder: str, *, limit: int, lease: int) -> str | None:
    """Take one of ``holder``'s ``limit`` slots: a token for :func:`slot_release`, or None
    when all are taken. A slot lapses when it has not been renewed for ``lease`` seconds:
    while the process that took it lives, its heartbeat (:func:`slots_renew`, every
    ``ZEROMEM_TENANT_SLOT_LEASE_SECONDS / 3`` seconds) renews every slot it holds, however long the work (an export to a
    slow client); a process killed mid-request stops renewing, and its slots free themselves
    within ``lease`` seconds. Redis: one script (prune, count, add). Database: one statement
    (:func:`_slot_sql`) claims a free slot number, or takes over a lapsed one; the unique
    (holder, slot) constraint makes the limit exact however many processes take slots at
    once. All taken: None, nothing written (a busy tenant's waiters poll cheaply). A taker
    that lost a number to a concurrent one (the conflict names a live slot) tries again at
    once, with a snapshot that sees it. On PostgreSQL the slots' table is UNLOGGED (audit
    migration 0012): a slot is no record, its writes go to no WAL and their commits wait for
    no flush; a crash of PostgreSQL empties the table, which frees the slots of the requests
    it broke anyway."""
    token = uuid.uuid4().hex
    now = time.time()
    url = settings.ZEROMEM_REDIS_URL
    if url:
        script = _slot_script(url)
        taken = script(keys=[f"zm:slot:{holder}"], args=[now - lease, limit, now, token, lease])
        return _hold(holder, token, lease) if taken else None
    if limit < 1:
        return None
    lapsed = now - lease
    for _attempt in range(limit):
        row = hotsql.fetchone(_slot_sql(connection.vendor), [limit, holder, token, now, holder, lapsed, lapsed, lapsed])
        if row is None:
            return None  # every number is held by a live slot
        if row[0] == token:
            return _hold(holder, token, lease)
    return None


# The slots this process holds, {token: (holder, taken at, monotonic)}, and the thread that
# renews them.
_held: dict[str, tuple[str, float]] = {}
_held_lock = threading.Lock()
_heartbeat: dict[int, threading.Thread] = {}  # by process id: a forked child starts its own
_wake = threading.Event()  # a slot taken: the heartbeat rereads its interval


def _hold(holder: str, token: str, lease: int) -> str:
    with _held_lock:
        _held[token] = (holder, _monotonic())
        pid = os.getpid()
        if pid not in _heartbeat:
            beat = threading.Thread(target=_beat, daemon=True, name="zeromem-slot-heartbeat")
            _heartbeat[pid] = beat
            beat.start()
    _wake.set()
    return token


def _beat() -> None:
    """Every ZEROMEM_TENANT_SLOT_LEASE_SECONDS / 3, renew what this process holds."""
    from django.db import connections

    renewed = _monotonic()
    while True:
        interval = max(settings.ZEROMEM_TENANT_SLOT_LEASE_SECONDS / 3, 0.1)
        if not _held:  # nothing to renew: sleep until a slot is taken (or a while)
            _wake.wait(interval)
            _wake.clear()
            renewed = _monotonic()  # a slot just taken needs its first renewal a beat later
            continue
        _wake.wait(max(interval - (_monotonic() - renewed), 0.0))
        _wake.clear()
        if _monotonic() - renewed < interval:
            continue
        renewed = _monotonic()
        try:
            slots_renew()
        except Exception:  # noqa: BLE001 - the next beat tries again; a lapse only frees the slot early
            import logging

            logging.getLogger("zeromem.limits").warning("renewing this process's tenant slots failed", exc_info=True)
        finally:
            connections.close_all()  # this thread's connection back to the pool between beats


def slots_renew(now: float | None = None) -> int:
    """Renew every slot this process holds (their lease starts again now); how many. A slot
    held longer than ``ZEROMEM_TENANT_SLOT_MAX_HOLD_SECONDS`` is no longer renewed (it lapses
    a lease later): a request that never released its slot — a bug, or a server that never
    closed a streamed response — cannot keep it for as long as the process lives."""
    oldest = _monotonic() - settings.ZEROMEM_TENANT_SLOT_MAX_HOLD_SECONDS
    with _held_lock:
        for token in [t for t, (_h, taken) in _held.items() if taken < oldest]:
            del _held[token]
        held = {token: holder for token, (holder, _taken) in _held.items()}
    if not held:
        return 0
    now = time.time() if now is None else now
    url = settings.ZEROMEM_REDIS_URL
    if url:
        client, *_ = _redis(url)
        pipe = client.pipeline(transaction=False)
        lease = max(int(settings.ZEROMEM_TENANT_SLOT_LEASE_SECONDS), 1)
        for token, holder in held.items():
            pipe.zadd(f"zm:slot:{holder}", {token: now}, xx=True)  # only if still there
            pipe.expire(f"zm:slot:{holder}", lease)  # the set itself outlives its newest lease
        pipe.execute()
    else:
        table = connection.ops.quote_name(ConcurrencySlot._meta.db_table)
        marks = ", ".join(["%s"] * len(held))
        with connection.cursor() as cursor:
            # nosec B608: the model's table; the tokens are parameters.
            cursor.execute(f"UPDATE {table} SET started_at = %s WHERE token IN ({marks})", [now, *held])  # nosec B608
    return len(held)


@cache
def _slot_sql(vendor: str) -> str:
    """Claim the first free slot number below the limit, as one statement: the numbers no
    live slot holds, the first of them inserted; a number whose row lapsed is taken over
    (ON CONFLICT … DO UPDATE, only when stale). A conflict on a live row (a concurrent taker
    got that number first) leaves it as it is and returns its token, not ours."""
    table = connection.ops.quote_name(ConcurrencySlot._meta.db_table)
    # bandit B608 (marked): the table name is the model's; every value is a %s parameter.
    return (
        "WITH RECURSIVE numbers(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM numbers WHERE n + 1 < %s) "
        f"INSERT INTO {table} (holder, slot, token, started_at) "  # nosec B608
        "SELECT %s, numbers.n, %s, %s FROM numbers WHERE NOT EXISTS ("
        f"SELECT 1 FROM {table} s WHERE s.holder = %s AND s.slot = numbers.n AND s.started_at > %s"
        ") ORDER BY numbers.n LIMIT 1 "
        "ON CONFLICT (holder, slot) DO UPDATE SET "
        f"token = CASE WHEN {table}.started_at <= %s THEN EXCLUDED.token ELSE {table}.token END, "
        f"started_at = CASE WHEN {table}.started_at <= %s THEN EXCLUDED.started_at ELSE {table}.started_at END "
        "RETURNING token"
    )


def slot_release(holder: str, token: str) -> None:
    with _held_lock:
        _held.pop(token, None)
    url = settings.ZEROMEM_REDIS_URL
    if url:
        client, *_ = _redis(url)
        client.zrem(f"zm:slot:{holder}", token)
    else:
        # One DELETE on the token's unique index, compiled once (as the taking statement).
        hotsql.execute(_slot_release_sql(connection.vendor), [token])


@cache
def _slot_release_sql(vendor: str) -> str:
    table = connection.ops.quote_name(ConcurrencySlot._meta.db_table)
    return f"DELETE FROM {table} WHERE token = %s"  # nosec B608 (the model's table; the token a parameter)


@cache
def _slot_script(url: str):
    client, *_ = _redis(url)
    return client.register_script(_ACQUIRE)
