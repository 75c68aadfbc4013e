"""Log records that carry the request they belong to (README "Running as a fleet").

``ZEROMEM_LOG_FORMAT=json`` writes one JSON object per line (python-json-logger) with the
time, level, logger, message and ``request_id`` — the id the client got in ``X-Request-ID``
and the audit log keeps — so a fleet's log collector can join a request's lines across
instances. The id is set for the request's thread by zeromem.kit.metrics.MetricsMiddleware,
cleared when the request is finished, and empty outside a request (jobs, commands)."""

from __future__ import annotations

import contextvars
import logging

from django.core.signals import request_finished

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("zeromem_request_id", default="")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


def _request_finished(**kwargs) -> None:
    request_id.set("")


request_finished.connect(_request_finished, dispatch_uid="zeromem.kit.logs.request_finished")
