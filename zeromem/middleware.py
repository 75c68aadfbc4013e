"""Request context: an id for every request (echoed as X-Request-ID and kept in the audit
log) and the transport body cap (413 before any parsing)."""

import io
import json
import re
import uuid

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core.handlers.wsgi import LimitedStream
from django.http import HttpResponse

from zeromem.kernel import validation
from zeromem.kit.api import error_body

_INCOMING_ID = re.compile(r"[A-Za-z0-9._-]{8,64}")
_READ_SIZE = 64 * 1024


def error_response(status: int, code: str, message: str, field: str | None = None, **extra) -> HttpResponse:
    """The error envelope as a plain response, for answers given outside DRF."""
    body = error_body(code, message, field, **extra)
    return HttpResponse(json.dumps(body, separators=(",", ":")), status=status, content_type="application/json")


def _too_large(cap: int) -> HttpResponse:
    return error_response(413, "too_large", f"request body is over {cap} bytes", field="body")


def _read_chunked(request, cap: int) -> HttpResponse | None:
    """A chunked body under WSGI has no Content-Length, so Django reads it as empty (its
    stream is limited to Content-Length, 0). The server (granian) streams the decoded
    chunks through wsgi.input as they arrive: read at most cap + 1 bytes of them, refuse
    past the cap, and hand Django the body with its length."""
    stream = request.META["wsgi.input"]
    body = bytearray()
    while len(body) <= cap:
        chunk = stream.read(min(_READ_SIZE, cap + 1 - len(body)))
        if not chunk:
            break
        body += chunk
    if len(body) > cap:
        return _too_large(cap)
    request.META["CONTENT_LENGTH"] = str(len(body))
    request._stream = LimitedStream(io.BytesIO(body), len(body))  # what WSGIRequest builds
    return None


class RequestIdMiddleware:
    """Sync and async: under ASGI the whole middleware chain then stays on the event loop
    and only the view runs in a worker thread (a sync-only middleware here made Django
    hop between threads ~16 times per request)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def _before(self, request):
        incoming = request.headers.get("X-Request-ID", "")
        request.request_id = incoming if _INCOMING_ID.fullmatch(incoming) else uuid.uuid4().hex
        cap = settings.ZEROMEM_MAX_BODY_BYTES
        length = validation.ascii_int(request.META.get("CONTENT_LENGTH") or "0")
        if length is not None and length > cap:
            # From the header alone: not one byte of the body has been read.
            return _too_large(cap)
        if "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower() and "wsgi.input" in request.META:
            return _read_chunked(request, cap)
        return None

    def __call__(self, request):
        if self.is_async:
            return self.__acall__(request)
        response = self._before(request) or self.get_response(request)
        response["X-Request-ID"] = request.request_id
        return response

    async def __acall__(self, request):
        response = self._before(request) or await self.get_response(request)
        response["X-Request-ID"] = request.request_id
        return response
