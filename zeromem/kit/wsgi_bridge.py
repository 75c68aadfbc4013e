"""Django's WSGI app served to the ASGI router (zeromem/asgi.py) with as few thread hops as a
request allows.

a2wsgi's responder (``a2wsgi.WSGIMiddleware``) runs the WSGI app in a thread and crosses to the
event loop and back — the thread waiting each time — for every message: the request body's
``receive()``, ``start_response``, each body chunk and the closing empty chunk, four blocking
hops for a small JSON call beside the executor's own. Each is a wake-up of the loop and of the
thread, under the GIL the process's other request threads hold (README "Serving": a2wsgi cost
+0.3–0.5 ms of server CPU a request over granian's own WSGI interface). Here:

- a body read before the request takes its thread (:meth:`WsgiBridge.respond`'s ``body``: the
  router reads every body up to the cap, zeromem/kit/read_ahead.py; called alone, the bridge
  reads one of a declared ``Content-Length`` up to :data:`PREREAD_BYTES`) is an in-memory
  ``wsgi.input``; any other streams through a2wsgi's ``Body``, one hop per message, so the body
  cap of zeromem/middleware.py still refuses it from the header or while it streams;
- a response that is not streaming (Django's ``HttpResponse``) is handed to the loop whole,
  without the thread waiting for it, and the thread goes on with the response's ``close()`` (the
  request's deferred work, the connection's return to the pool) while the loop sends it;
- a streaming response (exports, files) crosses per chunk and waits for each to be sent, as
  a2wsgi does: a slow reader slows its own thread, a gone one stops it (the send raises there).

The environ is a2wsgi's (``build_environ``), so what Django sees does not change.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import logging
from concurrent.futures import ThreadPoolExecutor

from a2wsgi.wsgi import Body, build_environ

from zeromem.kit.read_ahead import NO_BODY_METHODS, framing

logger = logging.getLogger(__name__)

# A body up to this size (declared in Content-Length) is read before the request takes a thread.
# Tool calls and REST writes are a few hundred bytes to a few KB; a larger body (an import, a
# 1 MB value) streams as before.
PREREAD_BYTES = 64 * 1024


class WsgiBridge:
    """An ASGI app running the WSGI ``app`` in a pool of ``workers`` threads (``executor``: the
    router shares it with the MCP endpoint). HTTP; a WebSocket is closed; the router owns the
    lifespan."""

    def __init__(self, app, workers: int, *, preread_bytes: int = PREREAD_BYTES):
        self.app = app
        self.preread_bytes = preread_bytes
        self.executor = ThreadPoolExecutor(thread_name_prefix="WSGI", max_workers=workers)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":  # WSGI has none: closed, as a2wsgi does
            await send({"type": "websocket.close", "code": 1000})
            return
        await self.respond(scope, receive, send, await self.preread(scope, receive))

    async def respond(self, scope, receive, send, body: bytes | None) -> None:
        """Run the app on ``body`` (:meth:`preread`'s), or on the body still to be received."""
        loop = asyncio.get_running_loop()
        if body is None:

            async def coroutine_receive():  # a2wsgi's Body takes a coroutine, granian's receive is not one
                return await receive()

            wsgi_input = Body(loop, coroutine_receive)
        else:
            wsgi_input = io.BytesIO(body)
        environ = build_environ(scope, wsgi_input)
        response = _Response(loop, send)
        context = contextvars.copy_context()
        done = loop.run_in_executor(self.executor, context.run, response.run, self.app, environ)
        # The whole response (not streaming) arrives here before the thread is done: the thread
        # closes it meanwhile. A streaming one is sent by the thread itself.
        try:
            await asyncio.wait({response.whole, done}, return_when=asyncio.FIRST_COMPLETED)
            if response.whole.done() and not response.whole.cancelled():
                start, chunk = response.whole.result()
                await send(start)
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
        finally:
            # Even when the client is gone: the request holds its turn at a thread (the router's)
            # until its thread has closed the response.
            await asyncio.wait({done})
        await done

    async def preread(self, scope, receive) -> bytes | None:
        """The request body when it declares a length up to ``preread_bytes`` (or has none to
        declare); None when it is to stream to the app as it arrives. The router calls it before
        the request waits for a thread: a client sending its body slowly holds no thread."""
        return await preread(scope, receive, self.preread_bytes)


async def preread(scope, receive, limit: int) -> bytes | None:
    """An HTTP request's body when it declares a length up to ``limit`` (or has none to declare:
    a GET's empty body); None when it is to stream to the app as it arrives. What came before
    the client went away, if it did."""
    framed = framing(scope)
    if framed is None or framed[1]:  # unreadable, or chunked: streamed
        return None
    declared = framed[0]
    if declared is None:
        return b"" if scope.get("method") in NO_BODY_METHODS else None
    if declared > limit:
        return None
    chunks, received = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: what came is the body
            break
        chunk = message.get("body", b"")
        chunks.append(chunk)
        received += len(chunk)
        if not message.get("more_body", False) or received >= declared:
            break
    return b"".join(chunks)


def replayed(body: bytes, receive, *, more: bool = False):
    """``receive`` for an app whose request body :func:`preread` (or the router's read-ahead)
    has read already: that body as one message, then what the client sends next (its
    disconnect; with ``more``, the rest of a body read only in part)."""
    pending = [{"type": "http.request", "body": body, "more_body": more}]

    async def receive_replayed():
        if pending:
            return pending.pop()
        return await receive()

    return receive_replayed


class _Response:
    """One request's WSGI side, run in a request thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, send):
        self.loop = loop
        self.send = send
        self.whole: asyncio.Future = loop.create_future()
        self.start: dict | None = None
        self.started = False  # the start message went to the client (streaming only)
        self.written: list[bytes] = []  # WSGI's legacy write() before the iterable

    def start_response(self, status: str, headers, exc_info=None):
        if exc_info is not None and self.started:
            raise exc_info[1].with_traceback(exc_info[2])
        code, _, _ = status.partition(" ")
        self.start = {
            "type": "http.response.start",
            "status": int(code),
            "headers": [
                (name.strip().encode("latin1").lower(), value.strip().encode("latin1")) for name, value in headers
            ],
        }
        return self.written.append

    def run(self, app, environ) -> None:
        iterable = app(environ, self.start_response)
        try:
            if getattr(iterable, "streaming", None) is False or isinstance(iterable, (list, tuple)):
                chunk = b"".join([*self.written, *iterable])
                self.loop.call_soon_threadsafe(_settle, self.whole, (self.start, chunk))
            else:
                self._stream(iterable)
        finally:
            close = getattr(iterable, "close", None)
            if close is not None:
                close()
            self.loop.call_soon_threadsafe(_settle, self.whole, None)

    def _stream(self, iterable) -> None:
        for chunk in self.written:
            self._send_now({"type": "http.response.body", "body": chunk, "more_body": True})
        for chunk in iterable:
            if chunk:
                self._send_now({"type": "http.response.body", "body": chunk, "more_body": True})
        self._send_now({"type": "http.response.body", "body": b"", "more_body": False})

    def _send_now(self, message: dict) -> None:
        """Send from the thread and wait until the server took the message (backpressure)."""
        if not self.started:
            self.started = True
            asyncio.run_coroutine_threadsafe(_sent(self.send, self.start), self.loop).result()
        asyncio.run_coroutine_threadsafe(_sent(self.send, message), self.loop).result()


async def _sent(send, message: dict) -> None:
    await send(message)  # run_coroutine_threadsafe takes a coroutine; granian's send is not one


def _settle(future: asyncio.Future, value) -> None:
    if value is None:
        if not future.done():
            future.cancel()
    elif not future.done():
        future.set_result(value)
