"""The search tier: searches ranked in processes of their own (README "Search tier").

A search's ranking — the question's embedding, its similarity to the tenant's vectors, the
word ranking's statements and the fusion (memories/search/ranking.py ``ranked_ids``) — is the
expensive, CPU-bound part of a search. Run in a web process it competes for that process's
GIL with every other request the process serves: 20 searches of one tenant made another
tenant's reads on the same process 3.5-6× slower at p99, where the same searches sent to a
*separate* server process left them within 1.7-2.4× (README "Benchmark", session 9). So
``python3 -m zeromem serve`` starts one or more **search processes** beside the web
processes (zeromem/serving.py), and the web processes hand them the ranking:

* The web process still does everything else, as before, in its service layer
  (memories/services/memories.py): validates the request, checks the key's scopes, works out
  the prefixes the key may see, admits the search (tenant slots, search CPU budget), loads
  the ranked memories, writes the audit event. The tier gets ``(tenant id, prefixes,
  question, limit)`` and answers ``[(memory id, score)]`` best first, plus the CPU seconds
  it spent, which are charged to the tenant's search budget like its own.
* Transport: a Unix socket per search process (``ZEROMEM_SEARCH_TIER``), in a directory
  only the server's user can open, and the standard library's
  ``multiprocessing.connection`` with an authentication key derived from ``SECRET_KEY``
  (HMAC challenge before anything is read); JSON messages, never pickles. Each web thread
  keeps one connection per search process; a tenant's searches go to one process
  (``tenant id mod processes``), which keeps its vectors cached there.
* A search process runs at most ``ZEROMEM_SEARCH_TIER_CONCURRENCY`` rankings at once, and
  at most ``ZEROMEM_SEARCH_TIER_TENANT_CONCURRENCY`` (1) for one tenant (:class:`Gate`); the
  rest wait, holding no database connection, until their turn or until the web process
  stops waiting for them (then they are dropped unranked). Its own connection pool.
* A web process waits at most ``ZEROMEM_SEARCH_TIER_WAIT_MS`` for an answer: past it the
  search answers 503 ``search_timeout`` (Retry-After). A search process that is not running
  (not started, restarting), or takes no new connection within that wait (hung), is not an
  outage: the web process ranks the search itself and logs a warning (once a minute). So does
  a search inside an open transaction, whose uncommitted writes another process could not see.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, connections
from prometheus_client import Counter

from memories.search.lexical import SearchTimeout
from zeromem.kernel import cpu

logger = logging.getLogger("zeromem.search")

# A request is the question (capped at validation.QUERY_MAX_CHARS) and the key's prefixes
# (its allowlist entries: 50 at most since session 11, but a key made before may hold more,
# so room for many); an answer at most
# limit + SPARE pairs. Anything larger is not ours.
MAX_REQUEST_BYTES = 8 * 1024 * 1024
MAX_ANSWER_BYTES = 1024 * 1024
WARN_EVERY_SECONDS = 60.0
# The error a ranking that could not reach the database is answered with.
DATABASE_UNAVAILABLE = "database_unavailable"

# Where each search of a web process was ranked (GET /metrics, added up across processes,
# zeromem/kit/metrics.py): ``tier``; ``fallback`` (the tier unreachable or failed mid-request:
# ranked in the web process); ``timeout`` (no answer within ZEROMEM_SEARCH_TIER_WAIT_MS, or
# the tier's statements ran out of time: 503); ``error`` (the tier failed to rank: a 503 when
# it could not reach the database, as in a web process, else a 500). Searches with no tier
# configured, or inside a transaction, are not counted here.
RANKINGS = Counter("zeromem_search_tier_rankings", "Searches handed to the search tier, by outcome", ["outcome"])


def authkey() -> bytes:
    """The key both ends prove they hold (multiprocessing's HMAC challenge): derived from
    SECRET_KEY, which every process of one deployment shares."""
    return hmac.new(settings.SECRET_KEY.encode(), b"zeromem search tier v1", hashlib.sha256).digest()


# --- the web process's side -------------------------------------------------------------------


class _Connections(threading.local):
    def __init__(self) -> None:
        self.by_path: dict[str, Connection] = {}


_mine = _Connections()
_last_warning = 0.0


def _warn(message: str, *args: object) -> None:
    global _last_warning
    now = time.monotonic()
    if now - _last_warning >= WARN_EVERY_SECONDS:
        _last_warning = now
        logger.warning(message, *args)


def _drop(path: str) -> None:
    conn = _mine.by_path.pop(path, None)
    if conn is not None:
        try:
            conn.close()
        except OSError:
            pass


def _connection(path: str, timeout: float) -> Connection:
    conn = _mine.by_path.get(path)
    if conn is None:
        conn = _connect(path, timeout)
        _mine.by_path[path] = conn
    return conn


def _connect(path: str, timeout: float) -> Connection:
    """``Client(path, family="AF_UNIX", authkey=authkey())``, with no step waiting longer than
    ``timeout``: a hung search process (stopped, deadlocked) still has its socket, whose
    backlog takes the connection, and the challenge then never came — the web thread waited
    for ever. A read or write past it raises an OSError (SO_RCVTIMEO, SO_SNDTIMEO: the
    descriptor stays blocking, as Connection needs; poll() is not affected)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.settimeout(None)
        limit = struct.pack("ll", int(timeout), int(timeout % 1 * 1_000_000))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
        conn = Connection(sock.detach())
    finally:
        sock.close()  # detached: a no-op
    try:
        answer_challenge(conn, authkey())
        deliver_challenge(conn, authkey())
    except BaseException:
        conn.close()
        raise
    return conn


def ranked(*, tenant_id: int, prefixes: list[str] | None, query: str, limit: int) -> list[tuple[int, float]] | None:
    """The search tier's ranking of ``query`` for the tenant, ``[(memory id, score)]`` best
    first; None when this process should rank it itself (no tier configured, an open
    transaction, the tier not running). Raises :class:`SearchTimeout` when the tier does not
    answer in time or its statements ran out of time."""
    paths = settings.ZEROMEM_SEARCH_TIER
    if not paths or connection.in_atomic_block:
        return None
    path = paths[tenant_id % len(paths)]
    wait = settings.ZEROMEM_SEARCH_TIER_WAIT_MS / 1000
    request = json.dumps(
        {"tenant": tenant_id, "prefixes": prefixes, "query": query, "limit": limit, "expires": time.time() + wait}
    ).encode()
    for attempt in (1, 2):
        try:
            conn = _connection(path, wait)
        except (OSError, EOFError, AuthenticationError) as exc:  # not running (yet), restarting, hung, misconfigured
            _warn("search tier %s unreachable (%s): ranking in the web process", path, exc)
            RANKINGS.labels("fallback").inc()
            return None
        try:
            conn.send_bytes(request)
            if not conn.poll(wait):
                _drop(path)  # its late answer must not be read as the next search's
                RANKINGS.labels("timeout").inc()
                raise SearchTimeout()
            answer = json.loads(conn.recv_bytes(MAX_ANSWER_BYTES))
            break
        except (OSError, EOFError):
            # A connection kept from before the tier process restarted: once more, anew.
            _drop(path)
            if attempt == 2:
                _warn("search tier %s failed mid-request: ranking in the web process", path)
                RANKINGS.labels("fallback").inc()
                return None
    cpu.credit(float(answer.get("cpu", 0.0)))
    error = answer.get("error")
    if error == "search_timeout":
        RANKINGS.labels("timeout").inc()
        raise SearchTimeout()
    RANKINGS.labels("error" if error else "tier").inc()
    if error == DATABASE_UNAVAILABLE:
        # What the web process's own ranking raises then: 503 database_unavailable, not a 500.
        raise OperationalError("the search tier could not reach the database")
    if error:
        raise RuntimeError(f"the search tier failed to rank: {error}")
    return [(int(memory_id), float(score)) for memory_id, score in answer["ranked"]]


def close_connections() -> None:
    """This thread's connections to the tier (tests; a web process needs no cleanup)."""
    for path in list(_mine.by_path):
        _drop(path)


# --- the search process's side ----------------------------------------------------------------


class Gate:
    """At most ``total`` rankings at once in a search process, and at most ``per_tenant`` of
    one tenant's: a tenant searching with all its slots leaves room for the others' searches
    (the rest of its own wait here, holding no database connection)."""

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total = max(1, total)
        self.per_tenant = max(1, min(per_tenant, self.total))
        self._cond = threading.Condition()
        self._running = 0
        self._by_tenant: dict[int, int] = {}

    def enter(self, tenant_id: int, timeout: float) -> bool:
        """Wait for a turn (True), or give up after ``timeout`` seconds (False)."""
        with self._cond:
            admitted = self._cond.wait_for(
                lambda: self._running < self.total and self._by_tenant.get(tenant_id, 0) < self.per_tenant,
                timeout=max(timeout, 0.0),
            )
            if admitted:
                self._running += 1
                self._by_tenant[tenant_id] = self._by_tenant.get(tenant_id, 0) + 1
            return admitted

    def leave(self, tenant_id: int) -> None:
        with self._cond:
            self._running -= 1
            left = self._by_tenant.pop(tenant_id) - 1
            if left:
                self._by_tenant[tenant_id] = left
            self._cond.notify_all()


def new_gate() -> Gate:
    return Gate(settings.ZEROMEM_SEARCH_TIER_CONCURRENCY, per_tenant=settings.ZEROMEM_SEARCH_TIER_TENANT_CONCURRENCY)


def rank_request(raw: bytes, gate: Gate | None = None) -> bytes:
    """One request's answer: the ranking (memories/search/ranking.py ``ranked_ids``, exactly
    what a web process would compute), or the error, and the CPU seconds spent. A request
    still waiting for its turn at ``gate`` when the web process stops waiting for it
    (``expires``) is answered ``search_timeout`` without being ranked."""
    from memories.search.ranking import ranked_ids

    with cpu.metered() as meter:
        admitted = None
        try:
            request = json.loads(raw)
            tenant_id = int(request["tenant"])
            prefixes = request["prefixes"]
            if gate is not None:
                if not gate.enter(tenant_id, float(request.get("expires", 0)) - time.time()):
                    raise SearchTimeout()
                admitted = tenant_id
            answer: dict = {
                "ranked": ranked_ids(
                    tenant_id=tenant_id,
                    prefixes=None if prefixes is None else [str(p) for p in prefixes],
                    query=str(request["query"]),
                    limit=int(request["limit"]),
                )
            }
        except SearchTimeout:
            answer = {"error": "search_timeout"}
        except (OperationalError, InterfaceError) as exc:  # the database unreachable: 503 upstream
            logger.warning("search tier: the database is unavailable: %s: %s", type(exc).__name__, exc)
            answer = {"error": DATABASE_UNAVAILABLE}
        except Exception as exc:  # noqa: BLE001 - reported to the web process, which answers 500
            logger.exception("search tier: ranking failed")
            answer = {"error": type(exc).__name__}
        finally:
            if admitted is not None:
                gate.leave(admitted)
            # The pooled connection goes back to this process's pool between requests.
            connections.close_all()
        answer["cpu"] = meter.seconds()
    return json.dumps(answer).encode()


def _answer(conn: Connection, gate: Gate, key: bytes) -> None:
    try:
        # The challenge both ways (what Listener.accept does with an authkey), here in the
        # connection's own thread: a peer that never answers holds this thread, not accept().
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
    except (OSError, EOFError, AuthenticationError) as exc:
        logger.warning("search tier: refused a connection: %s", exc)
        conn.close()
        return
    try:
        while True:
            try:
                request = conn.recv_bytes(MAX_REQUEST_BYTES)
            except (EOFError, OSError):
                return  # the web thread went away
            reply = rank_request(request, gate)
            try:
                conn.send_bytes(reply)
            except OSError:
                return  # it stopped waiting (ZEROMEM_SEARCH_TIER_WAIT_MS)
    finally:
        conn.close()


def serve(path: str, *, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    """Answer the web processes on the Unix socket ``path`` until ``stop`` is set (or for
    ever): one thread per connection, rankings admitted by a :class:`Gate`."""
    if os.path.exists(path):
        os.unlink(path)  # left by a process that was killed
    old_umask = os.umask(0o177)  # the socket is the server user's alone (0600)
    try:
        listener = Listener(path, family="AF_UNIX")  # authenticated per connection: _answer
    finally:
        os.umask(old_umask)
    gate, key = new_gate(), authkey()
    if ready is not None:
        ready.set()
    try:
        while stop is None or not stop.is_set():
            try:
                conn = listener.accept()
            except OSError as exc:
                if stop is not None and stop.is_set():
                    return
                logger.warning("search tier: accept failed: %s", exc)
                continue
            if stop is not None and stop.is_set():
                conn.close()
                return
            threading.Thread(target=_answer, args=(conn, gate, key), daemon=True, name="search-tier").start()
    finally:
        listener.close()
