"""The ASGI entry point ``python3 -m zeromem serve`` serves (granian, README "Serving"): one
small router in front of two apps.

- ``/mcp`` → the MCP endpoint (memories/mcp/server.py: the official SDK's streamable HTTP app,
  stateless). The router owns the ASGI lifespan and runs the SDK's session manager in it.
- everything else → Django. How is a setting, ``ZEROMEM_ASGI_DJANGO``, chosen by measurement
  (README "Serving", ``manage.py bench_serve --django-modes``):

  * ``wsgi`` (default): Django's WSGI app through zeromem/kit/wsgi_bridge.py, in a pool of
    ``ZEROMEM_WEB_THREADS`` threads. A request runs start to end in one thread, as under a
    WSGI server; the router reads its body (up to the cap; over 64 KiB or chunked within the
    process's budget, zeromem/kit/read_ahead.py) before it takes a thread, and the cap's 413
    is the middleware's.
  * ``a2wsgi``: the same through a2wsgi's own responder (a thread hop per message), for
    comparison (``bench_serve --django-modes bridge,a2wsgi``).
  * ``asgi``: Django's own ASGIHandler. It reads the whole request body (into a spooled
    file) before any middleware runs, so the body cap is enforced here, around it: from
    ``content-length`` before a byte is received, and while a chunked body's messages arrive.
"""

import contextlib
import json
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "zeromem.settings")

import django  # noqa: E402

django.setup(set_prefix=False)

# Traces (ZEROMEM_TRACING): each server process (granian imports this module in every worker it
# starts) sets up its own tracer provider before Django's middleware chain is built.
from zeromem.kernel import tracing  # noqa: E402

tracing.setup()

from django.conf import settings  # noqa: E402

from zeromem.kit.fair_threads import FairThreads, caller_of  # noqa: E402
from zeromem.kit.read_ahead import Held, ReadAhead, refuse  # noqa: E402
from zeromem.kit.wsgi_bridge import PREREAD_BYTES, WsgiBridge, replayed  # noqa: E402
from zeromem.serving import threads_per_caller, web_threads  # noqa: E402


class _BodyTooLarge(Exception):
    pass


def body_capped(app, cap: int):
    async def capped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > cap:  # bytes.isdigit() is ASCII only
            return await _refuse(send, cap)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    raise _BodyTooLarge
            return message

        try:
            await app(scope, counted, send)
        except _BodyTooLarge:  # raised while Django reads the body: nothing was sent yet
            await _refuse(send, cap)

    return capped


async def _refuse(send, cap: int) -> None:
    error = {"code": "too_large", "message": f"request body is over {cap} bytes", "field": "body"}
    body = json.dumps({"error": error}, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def django_app(mode: str):
    """Django as an ASGI app: ``wsgi`` (its WSGI app through the bridge), ``a2wsgi`` (through
    a2wsgi's responder) or ``asgi`` (ASGIHandler)."""
    if mode == "wsgi":
        from zeromem.wsgi import application as wsgi_application

        preread = min(PREREAD_BYTES, settings.ZEROMEM_MAX_BODY_BYTES)
        return WsgiBridge(wsgi_application, web_threads(os.environ), preread_bytes=preread)
    if mode == "a2wsgi":
        from a2wsgi import WSGIMiddleware

        from zeromem.wsgi import application as wsgi_application

        return _CoroutineReceive(WSGIMiddleware(wsgi_application, workers=web_threads(os.environ)))
    if mode == "asgi":
        from django.core.handlers.asgi import ASGIHandler

        return body_capped(ASGIHandler(), settings.ZEROMEM_MAX_BODY_BYTES)
    raise django.core.exceptions.ImproperlyConfigured(f"ZEROMEM_ASGI_DJANGO must be wsgi, a2wsgi or asgi, not {mode!r}")


class _CoroutineReceive:
    """a2wsgi hands ``receive()`` to ``asyncio.run_coroutine_threadsafe``, which takes only a
    coroutine; granian's ``receive`` returns another awaitable. Keeps a2wsgi's ``executor``."""

    def __init__(self, app):
        self.app = app
        self.executor = app.executor

    async def __call__(self, scope, receive, send):
        async def coroutine_receive():
            return await receive()

        return await self.app(scope, coroutine_receive, send)


class Router:
    """``/mcp`` (and below it) to the MCP endpoint, the rest to Django; the lifespan runs the
    MCP SDK's session manager for as long as the server process serves."""

    def __init__(self, django_application, mcp_endpoint, threads: FairThreads | None = None):
        self.django = django_application
        self.mcp = mcp_endpoint
        # Each HTTP request waits here for its caller's turn at a request thread (Django's and
        # MCP's share them): one caller's requests cannot make another's wait behind them.
        self.threads = threads
        # With tracing on, a server span around each /mcp request (the SDK's own span and the
        # tool's are its children); the endpoint itself when off.
        self.mcp_app = tracing.wrap_asgi(mcp_endpoint)
        self.prefix = mcp_endpoint_path()
        # Every body up to the cap is read before the request waits for its turn at a thread,
        # those over 64 KiB within the process's budget (zeromem/kit/read_ahead.py).
        # One caller's within its share of the budget; a body that trickles is dropped (408).
        self.read_ahead = ReadAhead(
            settings.ZEROMEM_MAX_BODY_BYTES,
            settings.ZEROMEM_BODY_READ_AHEAD_BYTES,
            settings.ZEROMEM_BODY_READ_TIMEOUT_SECONDS,
            per_caller=settings.ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES,
            min_rate=settings.ZEROMEM_BODY_READ_MIN_BYTES_PER_SECOND,
        )

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind == "lifespan":
            return await self.lifespan(receive, send)
        path = scope.get("path", "")
        app = (
            self.mcp_app
            if kind == "http" and (path == self.prefix or path.startswith(self.prefix + "/"))
            else self.django
        )
        if kind != "http" or self.threads is None:
            return await app(scope, receive, send)
        if isinstance(app, WsgiBridge):
            # The body is read before the request waits for its turn at a thread: a client
            # sending it slowly holds no thread.
            body = await self.read_ahead.read(scope, receive)
            if body.__class__ is Held:
                return await self.held(app, body, scope, receive, send)
            async with self.threads.thread(caller_of(scope)):
                return await app.respond(scope, receive, send, body)
        if app is self.mcp_app:
            # So is an /mcp request's: the SDK reads it on this event loop, after the request
            # took its turn, so four requests whose body trickled in held every thread of the
            # process and other callers waited for as long as those bodies took.
            body = await self.read_ahead.read(scope, receive)
            if body.__class__ is Held:
                return await self.held(app, body, scope, receive, send)
            if body is not None:
                receive = replayed(body, receive)
        async with self.threads.thread(caller_of(scope)):
            return await app(scope, receive, send)

    async def held(self, app, held: Held, scope, receive, send):
        """A request whose body was read (or refused) outside the small path; its budget is
        given back when it ends."""
        try:
            if held.status > 0:
                return await refuse(send, held.status)
            if held.status < 0:  # the client went away mid-body: nobody to answer
                return None
            body = held.body
            if held.more:  # a chunked body past the cap: the app refuses it as it arrives
                receive, body = replayed(body, receive, more=True), None
            async with self.threads.thread(held.caller):
                if isinstance(app, WsgiBridge):
                    return await app.respond(scope, receive, send, body)
                return await app(scope, receive if body is None else replayed(body, receive), send)
        finally:
            self.read_ahead.give_back(held)

    async def lifespan(self, receive, send):
        message = await receive()
        assert message["type"] == "lifespan.startup"
        stack = contextlib.AsyncExitStack()
        try:
            await stack.enter_async_context(self.mcp.session_manager.run())
        except Exception as exc:  # noqa: BLE001 - reported to the server, which stops
            await send({"type": "lifespan.startup.failed", "message": repr(exc)})
            return
        await send({"type": "lifespan.startup.complete"})
        message = await receive()  # lifespan.shutdown
        try:
            await stack.aclose()
        finally:
            await send({"type": "lifespan.shutdown.complete"})


def mcp_endpoint_path() -> str:
    from memories.mcp.server import PATH

    return PATH


def build(mode: str | None = None) -> Router:
    from memories.mcp.server import McpEndpoint

    django_application = django_app(mode or os.environ.get("ZEROMEM_ASGI_DJANGO") or "wsgi")
    # One thread pool for Django's requests and MCP's calls (a2wsgi's), when there is one.
    threads = web_threads(os.environ)
    return Router(
        django_application,
        McpEndpoint(executor=getattr(django_application, "executor", None)),
        FairThreads(threads, threads_per_caller(os.environ)),
    )


application = build()

# The server's access log writes a portal link's path without its token.
from zeromem.kit.logs import install_on_access_logs  # noqa: E402

install_on_access_logs()

# Each server process starts loading the embedding model now, in a background thread
# (about 3 s): searches meanwhile run on words alone instead of waiting for it. Not where a
# search tier ranks the searches (memories/search/tier.py): its processes hold the model.
from memories.search.embeddings import warm_up  # noqa: E402

if not settings.ZEROMEM_SEARCH_TIER:
    warm_up()

# Imports done: what they left lives as long as the process (zeromem/kernel/heap.py).
from zeromem.kernel.heap import freeze_long_lived  # noqa: E402

freeze_long_lived()
