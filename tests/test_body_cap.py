"""The body cap (ZEROMEM_MAX_BODY_BYTES) against the WSGI application itself, with a body
stream that counts what is read from it: a declared 100 MiB body is refused from its
Content-Length with nothing read; a chunked one (no Content-Length; granian streams the
decoded chunks through wsgi.input) is refused after at most the cap plus one read, and a
small chunked body is a body, not an empty one. The same over a real socket is in
test_serve.py."""

import io
import json

import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections

from memories.models import Memory

MiB = 1024 * 1024
CALL = "/api/v1/tools/call"


class CountingBody(io.RawIOBase):
    """``size`` bytes of blanks, made as they are read; counts the bytes read."""

    def __init__(self, size: int):
        self.size, self.read_bytes = size, 0

    def read(self, n: int = -1) -> bytes:
        left = self.size - self.read_bytes
        n = left if n is None or n < 0 else min(n, left)
        self.read_bytes += n
        return b" " * n


def _call(body, *, key: str, content_length: int | None):
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": CALL,
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "REMOTE_ADDR": "127.0.0.1",
        "CONTENT_TYPE": "application/json",
        "HTTP_AUTHORIZATION": f"Bearer {key}",
        "wsgi.input": body,
        "wsgi.url_scheme": "http",
        "wsgi.errors": io.StringIO(),
    }
    if content_length is None:
        environ["HTTP_TRANSFER_ENCODING"] = "chunked"
    else:
        environ["CONTENT_LENGTH"] = str(content_length)
    answer = {}
    # As Django's test client does: the request signals must not close the test's connection.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        chunks = WSGIHandler()(environ, lambda status, headers, *_: answer.update(status=int(status.split()[0])))
        return answer["status"], b"".join(chunks)
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def raw_key(make_client, tenant_a):
    client, _key = make_client(tenant_a)
    return client.raw_key


def test_a_declared_100_mib_body_is_refused_before_a_byte_is_read(raw_key):
    body = CountingBody(100 * MiB)
    status, content = _call(body, key=raw_key, content_length=100 * MiB)
    assert status == 413 and json.loads(content)["error"]["code"] == "too_large"
    assert body.read_bytes == 0


def test_a_chunked_100_mib_body_is_refused_after_reading_at_most_the_cap(raw_key, settings):
    """Before: Django read a chunked body as empty (400 from the tool registry)."""
    body = CountingBody(100 * MiB)
    status, content = _call(body, key=raw_key, content_length=None)
    assert status == 413 and json.loads(content)["error"]["field"] == "body"
    assert body.read_bytes == settings.ZEROMEM_MAX_BODY_BYTES + 1


def test_a_small_chunked_body_is_read_as_the_body(raw_key, tenant_a):
    call = json.dumps({"name": "memory_write", "arguments": {"key": "user:u1:chunked", "value": "yes"}}).encode()
    status, content = _call(io.BytesIO(call), key=raw_key, content_length=None)
    assert status == 200, content
    assert Memory.objects.get(tenant=tenant_a, key="user:u1:chunked").value == "yes"


# --- under ASGI (zeromem/asgi.py): Django through a2wsgi (its middleware reads a chunked body
# from wsgi.input as it arrives), or Django's ASGIHandler, which would read the whole body
# before any middleware: the router's body cap stands in front of it.


@pytest.mark.parametrize("mode", ["wsgi", "asgi"])
@pytest.mark.parametrize("declared", [True, False])
def test_asgi_refuses_a_100_mib_body_reading_at_most_the_cap(declared, mode, settings):
    import asyncio

    from zeromem.asgi import django_app

    application = django_app(mode)
    piece, total = 64 * 1024, 100 * MiB
    received = {"bytes": 0}
    sent = []

    async def receive():
        received["bytes"] += piece
        return {"type": "http.request", "body": b" " * piece, "more_body": received["bytes"] < total}

    async def send(message):
        sent.append(message)

    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]
    if declared:
        headers.append((b"content-length", str(total).encode()))
    else:
        headers.append((b"transfer-encoding", b"chunked"))  # as the server passes a chunked request on
    scope = {"type": "http", "method": "POST", "path": CALL, "headers": headers, "query_string": b""}
    scope |= {"http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    asyncio.run(application(scope, receive, send))
    assert sent[0]["status"] == 413
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]["code"] == "too_large"
    assert received["bytes"] <= (0 if declared else settings.ZEROMEM_MAX_BODY_BYTES + piece)
