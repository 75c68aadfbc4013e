"""Log records that carry the request they belong to (README "Running as a fleet").

``ZEROMEM_LOG_FORMAT=json`` writes one JSON object per line (python-json-logger) with the
time, level, logger, message and ``request_id`` — the id the client got in ``X-Request-ID``
and the audit log keeps — so a fleet's log collector can join a request's lines across
instances. The id is set for the request's thread by zeromem.kit.metrics.MetricsMiddleware
and is empty outside a request (jobs, commands)."""

from __future__ import annotations

import contextvars
import logging

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("zeromem_request_id", default="")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True
