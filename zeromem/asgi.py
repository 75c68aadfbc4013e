"""ASGI entry point (uvicorn). An MCP endpoint can be mounted beside Django here later.

Django's ASGI handler reads the whole request body (into a spooled file) before any
middleware runs, so the body cap is enforced here, around it: from ``content-length``
before a byte is received, and while a chunked body's messages arrive."""

import json
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "zeromem.settings")


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


django_application = get_asgi_application()

from django.conf import settings  # noqa: E402  (configured by get_asgi_application)

application = body_capped(django_application, settings.ZEROMEM_MAX_BODY_BYTES)

# The server's access log writes a portal link's path without its token.
from zeromem.kit.logs import install_on_access_logs  # noqa: E402

install_on_access_logs()

# Each server process starts loading the embedding model now, in a background thread
# (about 3 s): searches meanwhile run on words alone instead of waiting for it.
from memories.search.embeddings import warm_up  # noqa: E402

warm_up()
