"""Request context: an id for every request (echoed as X-Request-ID and kept in the audit
log) and the transport body cap (413 before any parsing)."""

import json
import re
import uuid

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpResponse

from zeromem.kit.api import error_body

_INCOMING_ID = re.compile(r"[A-Za-z0-9._-]{8,64}")


def error_response(status: int, code: str, message: str, field: str | None = None, **extra) -> HttpResponse:
    """The error envelope as a plain response, for answers given outside DRF."""
    body = error_body(code, message, field, **extra)
    return HttpResponse(json.dumps(body, separators=(",", ":")), status=status, content_type="application/json")


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
        length = request.META.get("CONTENT_LENGTH") or "0"
        if length.isdigit() and int(length) > settings.ZEROMEM_MAX_BODY_BYTES:
            return error_response(
                413, "too_large", f"request body is over {settings.ZEROMEM_MAX_BODY_BYTES} bytes", field="body"
            )
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
