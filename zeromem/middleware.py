"""Request context: an id for every request (echoed as X-Request-ID and kept in the audit
log) and the transport body cap (413 before any parsing)."""

import json
import re
import uuid

from django.conf import settings
from django.http import HttpResponse

_INCOMING_ID = re.compile(r"[A-Za-z0-9._-]{8,64}")


def error_response(status: int, code: str, message: str, field: str | None = None, **extra) -> HttpResponse:
    body = {"error": {"code": code, "message": message, "field": field, **extra}}
    return HttpResponse(json.dumps(body, separators=(",", ":")), status=status, content_type="application/json")


class RequestIdMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        incoming = request.headers.get("X-Request-ID", "")
        request.request_id = incoming if _INCOMING_ID.fullmatch(incoming) else uuid.uuid4().hex
        length = request.META.get("CONTENT_LENGTH") or "0"
        if length.isdigit() and int(length) > settings.ZEROMEM_MAX_BODY_BYTES:
            response = error_response(
                413, "too_large", f"request body is over {settings.ZEROMEM_MAX_BODY_BYTES} bytes", field="body"
            )
        else:
            response = self.get_response(request)
        response["X-Request-ID"] = request.request_id
        return response
