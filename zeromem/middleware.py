"""Request context: an id for every request (echoed as X-Request-ID and kept in the audit
log) and the transport body cap (413 before any parsing); static files, sessions, CSRF, the
staff user and messages only where browsers need them, so API requests do not pay for them."""

import functools
import io
import json

from asgiref.sync import async_to_sync, iscoroutinefunction, markcoroutinefunction, sync_to_async
from csp.middleware import CSPMiddleware
from django.conf import settings
from django.contrib.auth.middleware import AuthenticationMiddleware
from django.contrib.messages.middleware import MessageMiddleware
from django.contrib.sessions.middleware import SessionMiddleware
from django.core.handlers.wsgi import LimitedStream
from django.http import HttpResponse
from servestatic.middleware import ServeStaticMiddleware

from zeromem.kernel import deferred, validation
from zeromem.kit.api import error_body
from zeromem.kit.http import request_id_for

_READ_SIZE = 64 * 1024


def error_response(status: int, code: str, message: str, field: str | None = None, **extra) -> HttpResponse:
    """The error envelope as a plain response, for answers given outside DRF."""
    body = error_body(code, message, field, **extra)
    return HttpResponse(json.dumps(body, separators=(",", ":")), status=status, content_type="application/json")


def _too_large(cap: int) -> HttpResponse:
    return error_response(413, "too_large", f"request body is over {cap} bytes", field="body")


def _too_many_digits(declared: str) -> bool:
    """A Content-Length of more digits than ascii_int reads (a server passes any it can hold:
    granian, up to 2**64 - 1), so larger than any cap."""
    text = declared.strip(" \t")
    return text.isascii() and text.isdigit() and len(text.lstrip("0")) > 19


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
        # request.META, not request.headers: that one copies every header into a new mapping.
        request.request_id = request_id_for(request.META.get("HTTP_X_REQUEST_ID", ""))
        cap = settings.ZEROMEM_MAX_BODY_BYTES
        declared = request.META.get("CONTENT_LENGTH") or "0"
        length = validation.ascii_int(declared)
        if (length is not None and length > cap) or _too_many_digits(declared):
            # From the header alone: not one byte of the body has been read.
            return _too_large(cap)
        if "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower() and "wsgi.input" in request.META:
            return _read_chunked(request, cap)
        return None

    def __call__(self, request):
        if self.is_async:
            return self.__acall__(request)
        with deferred.collecting() as tasks:
            response = self._before(request) or self.get_response(request)
        response["X-Request-ID"] = request.request_id
        return with_deferred(response, tasks)

    async def __acall__(self, request):
        with deferred.collecting() as tasks:
            response = self._before(request) or await self.get_response(request)
        response["X-Request-ID"] = request.request_id
        return with_deferred(response, tasks)


def with_deferred(response, tasks: list):
    """What the request deferred (zeromem/kernel/deferred.py) runs when the server closes
    the response, after its last byte."""
    if tasks:
        response._resource_closers.append(functools.partial(deferred.run, tasks))
    return response


class StaticFilesMiddleware:
    """ServeStatic, for the static files' prefix only.

    ServeStatic's middleware is async-only. In the WSGI server (``python3 -m zeromem serve``)
    Django adapts it for every request — an event loop and thread hops around the rest of
    the chain, ~a third of ``/healthz``'s CPU — although only ``/static/`` paths can ever be
    its files. Here a WSGI request goes through ServeStatic only on that prefix; under ASGI
    it is ServeStatic itself, as before."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            self.static = ServeStaticMiddleware(get_response)
            markcoroutinefunction(self)
        else:
            static = ServeStaticMiddleware(sync_to_async(get_response))
            self.prefix = static.static_prefix
            self.static = async_to_sync(static)

    def __call__(self, request):
        if self.is_async or request.path_info.startswith(self.prefix):
            return self.static(request)
        return self.get_response(request)


# Paths for programs, not browsers: an API key or nothing authenticates them, never a cookie.
# Session, the staff user and messages are skipped there (the admin and the portal keep
# them); DRF's views set their own ``request.user``. Django's own CSRF middleware stays in
# place (``check --deploy`` looks for it by name); DRF's views are CSRF-exempt, so on API
# paths it only reads no cookie and returns.
API_PATHS = ("/api/", "/healthz", "/metrics")


class _BrowserOnly:
    def __call__(self, request):
        if request.path_info.startswith(API_PATHS):
            return self.get_response(request)
        return super().__call__(request)


class BrowserSessionMiddleware(_BrowserOnly, SessionMiddleware):
    pass


class BrowserAuthenticationMiddleware(_BrowserOnly, AuthenticationMiddleware):
    pass


class BrowserMessageMiddleware(_BrowserOnly, MessageMiddleware):
    pass


class BrowserCSPMiddleware(CSPMiddleware):
    """django-csp's middleware, not run on the paths its policy excludes
    (``CONTENT_SECURITY_POLICY["EXCLUDE_URL_PREFIXES"]``: the API, ``/healthz``, static
    files). There it would build the policy twice per response (about 0.1 ms of CPU) only to
    leave the header out. With a report-only policy configured it runs everywhere, as is."""

    def __init__(self, get_response):
        super().__init__(get_response)
        policy = getattr(settings, "CONTENT_SECURITY_POLICY", None) or {}
        report_only = getattr(settings, "CONTENT_SECURITY_POLICY_REPORT_ONLY", None)
        self.skipped = () if report_only else tuple(policy.get("EXCLUDE_URL_PREFIXES") or ())

    def __call__(self, request):
        if self.skipped and request.path_info.startswith(self.skipped):
            return self.get_response(request)
        return super().__call__(request)
