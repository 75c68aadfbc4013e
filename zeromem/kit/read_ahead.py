"""Request bodies read by the event loop before the request waits for a request thread, within
a per-process memory budget (the ASGI router, zeromem/asgi.py; README "Serving").

A request thread is what a web process has least of (``ZEROMEM_WEB_THREADS``, 8): a request
that took one before its body was in held it for as long as the client took to send it. The
router read a body of a declared ``Content-Length`` up to 64 KiB first; a larger one (up to the
cap, ``ZEROMEM_MAX_BODY_BYTES``) or a chunked one streamed to the app from the thread, so a few
keys sending big bodies slowly held every thread of a process and every other tenant waited.
Now every body up to the cap is read here first:

* up to :data:`SMALL_BYTES` declared: read as before, outside the budget — the hot path (a tool
  call, a REST write) costs what it did, and big bodies cannot make small ones wait;
* larger, up to the cap: its declared length is taken from the process's budget
  (``ZEROMEM_BODY_READ_AHEAD_BYTES``) before a byte is read, and given back when the request
  ends (the body lives until then: the budget bounds every body the process holds beyond the
  small ones);
* chunked (no length to declare): charged what has arrived, each message as it comes (it took
  the whole cap while it arrived, so a few small chunked bodies filled the budget);
* one caller (``caller_of``: the client's address and the key's public lookup once verified, as the request
  threads are shared) holds at most ``ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES`` of the budget
  (a quarter): a few callers trickling big bodies took all of it, and every other caller's big
  body was refused while theirs went on;
* over the budget or the caller's share: ``503 body_budget`` with ``Retry-After: 1`` at once,
  before a byte is read (a chunked body: once the message that would pass it arrives) — not a
  wait: the budget is held by bodies still arriving, whose senders decide how long that takes,
  so a waiting request could wait as long; a retry may reach a process, or an instance, that
  has room, and the client knows at once;
* a sender silent for ``ZEROMEM_BODY_READ_TIMEOUT_SECONDS`` (30) mid-body, or whose body is not
  in after that long plus a second per ``ZEROMEM_BODY_READ_MIN_BYTES_PER_SECOND`` (8 KiB) bytes
  received, is answered ``408 body_timeout`` and dropped (a timeout per message alone let a
  sender of a byte every 29 s hold its budget for ever; a 1 MiB body still goes in on any link
  of 8 KiB/s, 66 kbit/s, or more: it has up to 158 s), and a client gone mid-body is dropped,
  nothing run: its budget is back either way (granian has a timeout for headers only, none for
  a body);
* a declared length over the cap is not read: the app refuses it from the header (413), as
  before; a chunked body past the cap is handed to the app as what was read and "more to come",
  and the app refuses it (413) as it did while it streamed.

Everything runs on the process's event loop, one coroutine at a time: no lock is needed.
"""

from __future__ import annotations

import asyncio
import json

from zeromem.kit.fair_threads import caller_of

# A body declared up to this size is read outside the budget (tool calls and REST writes are a
# few hundred bytes to a few KB; a larger body is an import, a batch, a 1 MB value).
SMALL_BYTES = 64 * 1024

NO_BODY_METHODS = ("GET", "HEAD", "DELETE", "OPTIONS")


def framing(scope) -> tuple[int | None, bool] | None:
    """(the declared ``Content-Length`` or None, whether the body is chunked) of an HTTP
    request; None when its length cannot be read (not ASCII digits, or declared twice): the app
    refuses such a request itself."""
    declared, chunked = None, False
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            if declared is not None or not value.isdigit():  # bytes.isdigit(): ASCII digits only
                return None
            declared = int(value)
        elif name == b"transfer-encoding":
            chunked = True
    return declared, chunked


class Held:
    """A body read (or refused) outside the small path: ``body`` (what came), ``charged`` (bytes
    of the budget it holds until the request ends), ``caller`` (whose share they count in),
    ``more`` (the cap was passed: more was to come, the app refuses it), ``status`` (0: run the
    app; 503 or 408: answered here; -1: the client is gone, nothing to answer)."""

    __slots__ = ("body", "caller", "charged", "more", "status")

    def __init__(self, body: bytes = b"", charged: int = 0, more: bool = False, status: int = 0, caller: str = ""):
        self.body = body
        self.charged = charged
        self.more = more
        self.status = status
        self.caller = caller


GONE = Held(status=-1)


class ReadAhead:
    """Reads request bodies up to ``cap`` bytes, those over ``small`` within ``budget`` bytes at
    once and ``per_caller`` bytes of one caller; a sender silent for ``timeout`` seconds
    mid-body, or slower than ``min_rate`` bytes a second past the first ``timeout`` seconds, is
    dropped (see the module)."""

    def __init__(
        self,
        cap: int,
        budget: int,
        timeout: float,
        small: int = SMALL_BYTES,
        per_caller: int | None = None,
        min_rate: float = 8 * 1024,
    ) -> None:
        self.cap = cap
        self.small = min(small, cap)
        self.budget = budget
        self.per_caller = budget if per_caller is None else min(per_caller, budget)
        self.timeout = timeout
        self.min_rate = min_rate
        self.used = 0  # bytes of the budget held now
        self.holding: dict[str, int] = {}  # of them, by caller (callers holding none: absent)

    async def read(self, scope, receive) -> bytes | Held | None:
        """The request's body: ``bytes`` (all of it, nothing charged), a :class:`Held`, or None
        when the app is to receive it itself (a declared length over the cap, which it refuses
        from the header; a POST with no body framing at all)."""
        framed = framing(scope)
        if framed is None:
            return None
        declared, chunked = framed
        if chunked:
            return None if declared is not None else await self._read_held(scope, receive, None)
        if declared is None:
            return b"" if scope.get("method") in NO_BODY_METHODS else None
        if declared <= self.small:
            # The hot path: almost always one message, taken without a timer.
            message = await receive()
            if message["type"] != "http.request":
                return GONE if declared else b""
            body = message.get("body", b"")
            if not message.get("more_body", False) or len(body) >= declared:
                return body
            held = await self._rest(receive, [body], len(body), declared, None)
            return held.body if held.status == 0 else held
        if declared > self.cap:
            return None
        return await self._read_held(scope, receive, declared)

    def _fits(self, caller: str, size: int) -> bool:
        return self.used + size <= self.budget and self.holding.get(caller, 0) + size <= self.per_caller

    def _take(self, held: Held, size: int) -> None:
        self.used += size
        self.holding[held.caller] = self.holding.get(held.caller, 0) + size
        held.charged += size

    async def _read_held(self, scope, receive, declared: int | None) -> Held:
        # A declared body takes its length before a byte is read; a chunked one needs room for
        # a byte, and takes what arrives as it arrives (_rest).
        held = Held(caller=caller_of(scope))
        if not self._fits(held.caller, 1 if declared is None else declared):
            held.status = 503
            return held
        if declared is not None:
            self._take(held, declared)
        try:
            await self._rest(receive, [], 0, declared, held)
        except BaseException:
            self.give_back(held)
            raise
        if held.status != 0:
            self.give_back(held)
        return held

    async def _rest(self, receive, chunks: list[bytes], received: int, declared: int | None, held: Held | None) -> Held:
        """The rest of a body into ``held`` (a new :class:`Held` when None: a small body, outside
        the budget; a chunked ``held`` is charged each message as it arrives). Each message is
        awaited at most ``timeout`` seconds, and the whole body at most ``timeout`` seconds plus
        one per ``min_rate`` bytes received."""
        if held is None:
            held = Held()
        grows = declared is None
        limit = self.cap if grows else declared
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout_at(started + self.timeout) as deadline:
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        held.status = -1
                        return held
                    chunk = message.get("body", b"")
                    if grows and chunk:
                        if not self._fits(held.caller, len(chunk)):
                            held.status = 503  # the budget, or the caller's share, ran out
                            return held
                        self._take(held, len(chunk))
                    chunks.append(chunk)
                    received += len(chunk)
                    if grows and received > limit:  # chunked, past the cap
                        held.body, held.more = b"".join(chunks), True
                        return held
                    if not message.get("more_body", False) or (not grows and received >= limit):
                        held.body = b"".join(chunks)
                        return held
                    now = loop.time()
                    deadline.reschedule(min(now, started + received / self.min_rate) + self.timeout)
        except TimeoutError:
            held.status = 408
            return held

    def give_back(self, held: Held) -> None:
        """What ``held`` was charged, back to the budget and its caller's share."""
        if not held.charged:
            return
        self.used -= held.charged
        left = self.holding[held.caller] - held.charged
        if left:
            self.holding[held.caller] = left
        else:
            del self.holding[held.caller]
        held.charged = 0


_REFUSALS = {
    503: ("body_budget", "the server is reading too many request bodies at once: retry", b"1"),
    408: ("body_timeout", "the request body stopped arriving", None),
}


async def refuse(send, status: int) -> None:
    """Answer a :class:`Held` refused here (503 with Retry-After, 408), naming the body; the
    connection is closed (its body was not read)."""
    code, message, retry_after = _REFUSALS[status]
    body = json.dumps({"error": {"code": code, "message": message, "field": "body"}}, separators=(",", ":")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", retry_after))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
