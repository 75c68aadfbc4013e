"""A web process's request threads, shared fairly between callers before a request takes one.

A web process has ``ZEROMEM_WEB_THREADS`` request threads (zeromem/serving.py), which Django's
requests and MCP's calls share (zeromem/asgi.py). A request holds one from the moment its
work starts until its response is sent: a search, an export streaming to a slow reader, a
wait for a tenant slot, a write waiting on a row lock. Requests beyond the threads used to
wait first come, first served, so one caller with many requests in flight made every other
caller of that process wait behind them. Measured during ``bench_search``'s fairness phase
(20 clients of one tenant searching back to back, one client of another tenant reading; 1M
memories): the reader's slowest reads waited **50–250 ms for a thread** of its process and
1–35 ms in Django, the reads' p99 7× their idle p99.

So the router admits each request to the threads here (:class:`FairThreads`):

* a **caller** is the client's address and the API key's public lookup (``zm_<lookup>``, the
  part before the secret) — when this process has verified that very key lately (its API key
  cache, memories/services/key_cache.py: the hash of the whole key sent matches). A request
  with a key the process does not know (made up, wrong secret, not yet verified here) is the
  address's one **unverified** caller (``"<address> ?"``), and one without a key the address's
  keyless caller (``"<address> "``): a client sending a new made-up lookup with each request
  used to be a new caller each time, with a share of its own each time — now all of them wait
  their turn as one. A key's first request in a process (or the first after the cache's TTL)
  takes its turn as unverified; with the cache off (``ZEROMEM_API_KEY_CACHE_SECONDS=0``) the
  lookup is taken as claimed, as before;
* a caller holds at most ``per_caller`` threads at once (``ZEROMEM_WEB_THREADS_PER_CALLER``,
  default the threads less two, with 4 or more threads): the others are always left to
  other callers;
* a freed thread goes to the waiting caller that holds the fewest (the longest waiting among
  equals), so a caller with one request in flight goes before one with twenty;
* a request waiting here holds no thread and no database connection: only its connection.

Everything runs on the process's event loop, one coroutine at a time: no lock is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter, deque
from collections.abc import AsyncIterator

from memories.models import hash_api_key
from memories.services import key_cache
from zeromem.kit.http import client_ip_of

BEARER = b"bearer "
KEY_PREFIX = b"zm_"
# The caller's second part for a request whose key this process has not verified lately.
UNVERIFIED = "?"


def default_per_caller(threads: int) -> int:
    """Two threads of each process left to other callers; none reserved below 4 threads (a
    caller would then be held to one or two of its own requests at a time)."""
    return threads - 2 if threads >= 4 else threads


def caller_of(scope: dict) -> str:
    """``"<client address> <zm_lookup>"`` of an HTTP request's scope: the lookup empty when no
    API key is sent, ``?`` for a key this process has not verified lately. Cheap: one pass over
    the headers, nothing decoded but the two, a SHA-256 of a key sent."""
    authorization = forwarded = b""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            authorization = value
        elif name == b"x-forwarded-for":
            forwarded = value
    lookup = ""
    if authorization[: len(BEARER)].lower() == BEARER:
        token = authorization[len(BEARER) :].strip()
        if token.startswith(KEY_PREFIX):
            lookup = token.split(b"_", 2)[1][:32].decode("ascii", "replace")
            if not _verified(lookup, token):
                lookup = UNVERIFIED
    client = scope.get("client")
    address = client_ip_of(client[0] if client else None, forwarded.decode("latin-1") if forwarded else None)
    return f"{address or '-'} {lookup}"


def _verified(lookup: str, token: bytes) -> bool:
    """Whether this process verified the key ``token`` lately (a cache hit costs a SHA-256 of
    the key, ~1 µs); always True with the key cache off (the lookup taken as claimed)."""
    if key_cache.ttl_seconds() <= 0:
        return True
    return key_cache.get(lookup, hash_api_key(token.decode("latin-1"))) is not None


class FairThreads:
    """``threads`` request threads, at most ``per_caller`` of them held by one caller, handed
    to the waiting caller that holds the fewest whenever one frees (see the module)."""

    def __init__(self, threads: int, per_caller: int | None = None) -> None:
        self.threads = threads
        self.per_caller = max(1, min(per_caller if per_caller else default_per_caller(threads), threads))
        self.free = threads
        self.holding: Counter[str] = Counter()
        self.waiting: dict[str, deque[tuple[int, asyncio.Future]]] = {}
        self._tickets = itertools.count()

    @contextlib.asynccontextmanager
    async def thread(self, caller: str) -> AsyncIterator[None]:
        """Wait for this caller's turn at a thread; hold it for the block."""
        # After every change _dispatch leaves no waiter that could go: with a thread free,
        # whoever waits is at its own limit, so a caller under its limit may go at once.
        if self.free > 0 and self.holding[caller] < self.per_caller:
            self._take(caller)
        else:
            turn = asyncio.get_running_loop().create_future()
            self.waiting.setdefault(caller, deque()).append((next(self._tickets), turn))
            try:
                await turn
            except BaseException:
                if turn.done() and not turn.cancelled():
                    self._give_back(caller)  # granted, then cancelled before it ran
                else:
                    self._forget(caller, turn)
                raise
        try:
            yield
        finally:
            self._give_back(caller)

    def _take(self, caller: str) -> None:
        self.free -= 1
        self.holding[caller] += 1

    def _give_back(self, caller: str) -> None:
        self.free += 1
        self.holding[caller] -= 1
        if self.holding[caller] <= 0:
            del self.holding[caller]
        self._dispatch()

    def _forget(self, caller: str, turn: asyncio.Future) -> None:
        queue = self.waiting.get(caller)
        if queue is None:
            return
        for item in queue:
            if item[1] is turn:
                queue.remove(item)
                break
        if not queue:
            del self.waiting[caller]

    def _dispatch(self) -> None:
        while self.free > 0 and self.waiting:
            eligible = [
                (self.holding[caller], queue[0][0], caller)
                for caller, queue in self.waiting.items()
                if self.holding[caller] < self.per_caller
            ]
            if not eligible:
                return
            _held, _ticket, caller = min(eligible)
            queue = self.waiting[caller]
            _ticket, turn = queue.popleft()
            if not queue:
                del self.waiting[caller]
            if turn.done():  # cancelled while waiting: nobody to hand it to
                continue
            self._take(caller)
            turn.set_result(None)
