"""Log records that carry the request they belong to (README "Running as a fleet").

``ZEROMEM_LOG_FORMAT=json`` writes one JSON object per line (python-json-logger) with the
time, level, logger, message and ``request_id`` — the id the client got in ``X-Request-ID``
and the audit log keeps — so a fleet's log collector can join a request's lines across
instances; with tracing on (ZEROMEM_TRACING) each line also carries the ``trace_id`` of the
span it was written in, to find the request's trace. The id is set for the request's thread
by zeromem.kit.metrics.MetricsMiddleware, cleared when the request is finished, and empty
outside a request (jobs, commands).

Log filters. ``RedactPortalTokens`` keeps portal link tokens out of every log line: the
access log (granian's ``granian.access``: the path is an argument), Django's 4xx/5xx lines
(``django.request``: "Bad Request: /portal/open/<token>"), its CSRF refusals
(``django.security.csrf``: "Forbidden (CSRF cookie not set.): /portal/open/<token>") and the
development server's (``django.server``). Installed on those loggers by settings.LOGGING: a
logger's filter changes the record before any handler sees it (Django's DEBUG console handler
on ``django`` comes before the console handler at the root, which redacts too)."""

from __future__ import annotations

import contextvars
import logging
import re

from django.core.signals import request_finished

from zeromem.kernel import tracing

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("zeromem_request_id", default="")


class RequestIdFilter(logging.Filter):
    """The request id, and the trace id when tracing (ZEROMEM_TRACING; empty otherwise)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        record.trace_id = tracing.trace_id()
        return True


def _request_finished(**kwargs) -> None:
    request_id.set("")


request_finished.connect(_request_finished, dispatch_uid="zeromem.kit.logs.request_finished")


PORTAL_TOKEN = re.compile(r"(/portal/open/)[^\s\"'?#/]+")
REDACTED = r"\1…"


def redact(text: str) -> str:
    return PORTAL_TOKEN.sub(REDACTED, text)


def _clean(value):
    return redact(value) if isinstance(value, str) else value


class RedactPortalTokens(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, dict):
            record.args = {k: _clean(v) for k, v in record.args.items()}
        elif isinstance(record.args, tuple):
            record.args = tuple(_clean(v) for v in record.args)
        return True


ACCESS_LOGGERS = ("granian.access", "uvicorn.access")


def install_on_access_logs() -> None:
    """Put the filter on the web servers' access loggers (called by zeromem.wsgi and
    zeromem.asgi: the servers configure those loggers themselves, outside settings.LOGGING).
    Idempotent."""
    for name in ACCESS_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactPortalTokens) for f in logger.filters):
            logger.addFilter(RedactPortalTokens())
