"""OpenTelemetry traces, off unless ``ZEROMEM_TRACING`` is true (README "Traces").

Off, nothing of OpenTelemetry's SDK or instrumentations is imported and the request path
gains one check of a module global per span site (:func:`span` hands back :data:`NO_SPAN`).
On, :func:`setup` gives the process a tracer provider of its own (the standard ``OTEL_*``
settings, read by settings.py) exporting over OTLP/HTTP in batches, and instruments Django
(a span per request, named by its route template), psycopg (a span per SQL statement: its
text, never its parameters) and, through :func:`wrap_asgi`, the ``/mcp`` endpoint.
ZeroMem's own spans are the tool calls (memories/tools.py), the audited service operations
(audit/services.py) and django-q2 tasks, with the tool or action, the outcome and the
tenant's slug only.

Who calls :func:`setup`: each web process when it imports zeromem.wsgi or zeromem.asgi
(granian imports the app in each worker it starts, so every worker sets up its own), each
django-q2 worker when it starts (``post_spawn``, :func:`connect_tasks`). A process forked
after setup exports through a processor and HTTP session of its own (:class:`_Export`).

What never leaves: span attributes that carry the request's path or query (a memory key is
in the path: ``/api/v1/memories/user:u10086:...``), SQL parameters (never captured), and the
messages of exceptions and error statuses (a database error's detail can quote a row's
values): an exception event keeps its type only (:func:`_scrubbed`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

# The SDK tracer for ZeroMem's own spans once :func:`setup` has run in this process; None
# while tracing is off.
_tracer: Any = None
_provider: Any = None
_instrumentors: list = []
_lock = threading.Lock()

PREFIX = "zeromem."
# Attributes the standard instrumentations set that hold the request's raw path or query,
# hence memory keys and prefixes; the route template (``http.route``) and the span's name
# say which endpoint it was.
DROPPED_ATTRIBUTES = frozenset(
    {
        "http.url",
        "http.target",
        "url.full",
        "url.path",
        "url.query",
        "db.statement.parameters",
        "db.query.parameter",
    }
)
KEPT_EXCEPTION_ATTRIBUTES = ("exception.type", "exception.escaped")


class _NoSpan:
    """What :func:`span` hands back while tracing is off: a context manager that does nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def set(self, name: str, value) -> None:
        pass

    def rename(self, name: str, **attributes) -> None:
        pass


NO_SPAN = _NoSpan()


class _Span:
    """A ZeroMem span in progress: current while open (SQL spans inside are its children),
    its attributes named ``zeromem.<name>``. An exception that ends it before an outcome was
    set is an ``error`` outcome with an error status (the exception's type, not its message)."""

    __slots__ = ("_context", "_span", "_outcome")

    def __init__(self, name: str, attributes: dict):
        self._context = _tracer.start_as_current_span(
            name,
            attributes={PREFIX + k: v for k, v in attributes.items() if v is not None},
            record_exception=False,
            set_status_on_exception=False,
        )
        self._span = None
        self._outcome = None

    def __enter__(self):
        self._span = self._context.__enter__()
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None and self._outcome is None:
            self._span.set_attribute("error.type", kind.__qualname__)
            self.set("outcome", "error")
        return self._context.__exit__(kind, exc, tb)

    def set(self, name: str, value) -> None:
        if value is None:
            return
        self._span.set_attribute(PREFIX + name, value)
        if name == "outcome":
            self._outcome = value
            if value == "error":
                from opentelemetry.trace import StatusCode

                self._span.set_status(StatusCode.ERROR)

    def rename(self, name: str, **attributes) -> None:
        """A name known only once the span runs (the tool, after the call is parsed)."""
        self._span.update_name(name)
        for key, value in attributes.items():
            self.set(key, value)


def span(name: str, **attributes):
    """``with tracing.span("tool memory_read", tool="memory_read", tenant=slug) as s:
    ... s.set("outcome", "ok")``. Attributes must never hold a memory key or value."""
    if _tracer is None:
        return NO_SPAN
    return _Span(name, attributes)


def on() -> bool:
    """Whether this process traces (after :func:`setup`)."""
    return _tracer is not None


def trace_id() -> str:
    """The current trace's id (32 hex digits) for log lines; empty when off or outside a span."""
    if _tracer is None:
        return ""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""


def annotate(**attributes) -> None:
    """Set ``zeromem.<name>`` attributes on the current span (the request's), if tracing."""
    if _tracer is None:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    for name, value in attributes.items():
        if value:
            current.set_attribute(PREFIX + name, value)


# --- set-up ---------------------------------------------------------------------------


def setup() -> bool:
    """Set up tracing in this process if ``ZEROMEM_TRACING`` is on; idempotent. Must run
    before Django builds its middleware chain (the request span is a middleware) and before
    the process opens its database connections (psycopg's are traced from their ``connect``)."""
    global _tracer, _provider
    from django.conf import settings

    if not settings.ZEROMEM_TRACING or _tracer is not None:
        return _tracer is not None
    with _lock:
        if _tracer is not None:
            return True
        from opentelemetry import trace
        from opentelemetry.instrumentation.django import DjangoInstrumentor
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider

        provider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: settings.OTEL_SERVICE_NAME, "process.pid": os.getpid()}),
            sampler=_sampler(settings.OTEL_TRACES_SAMPLER, settings.OTEL_TRACES_SAMPLER_ARG),
        )
        provider.add_span_processor(_Export())
        # The global provider is also the MCP SDK's (its "tools/call <tool>" spans).
        trace.set_tracer_provider(provider)
        django = DjangoInstrumentor()
        django.instrument(tracer_provider=provider, response_hook=_response_hook)
        _instrumentors.append(django)
        if settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
            from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor

            psycopg = PsycopgInstrumentor()
            psycopg.instrument(tracer_provider=provider)
            _instrumentors.append(psycopg)
        _provider = provider
        _tracer = provider.get_tracer("zeromem")
    return True


def flush(timeout_millis: int = 5000) -> bool:
    """Export the spans ended so far now (tests; a process about to exit)."""
    return _provider.force_flush(timeout_millis) if _provider is not None else True


def shutdown() -> None:
    """Stop tracing in this process: undo the instrumentations, export what is pending, and
    leave :func:`span` a no-op again (tests; the global provider cannot be unset, but it is
    left with no processor that exports)."""
    global _tracer, _provider
    with _lock:
        for instrumentor in _instrumentors:
            instrumentor.uninstrument()
        _instrumentors.clear()
        if _provider is not None:
            _provider.shutdown()
        _tracer = _provider = None


def _sampler(name: str, argument: str):
    from opentelemetry.sdk.trace import sampling

    ratio = float(argument) if argument else 1.0
    samplers = {
        "always_on": lambda: sampling.ALWAYS_ON,
        "always_off": lambda: sampling.ALWAYS_OFF,
        "traceidratio": lambda: sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": lambda: sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": lambda: sampling.ParentBased(sampling.TraceIdRatioBased(ratio)),
    }
    return samplers[name]()


SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)


def _response_hook(span, request, response) -> None:
    """The request id (``X-Request-ID``, the JSON logs' ``request_id``) on the request span."""
    request_id = getattr(request, "request_id", "")
    if request_id and span.is_recording():
        span.set_attribute(PREFIX + "request_id", request_id)


def wrap_asgi(app):
    """``app`` (an ASGI app) with a server span per HTTP request when tracing is on, else
    ``app`` itself. For ``/mcp``, whose path is fixed: the MCP SDK's ``tools/call`` span and
    ZeroMem's tool span are its children."""
    if _tracer is None:
        return app
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    # No child spans for each ASGI message sent or received: a request's span is enough.
    return OpenTelemetryMiddleware(app, tracer_provider=_provider, exclude_spans=["receive", "send"])


# --- export: one batch processor per process, never a key in what leaves -----------------


class _Export:
    """The span processor: scrubs each ended span (:func:`_scrubbed`) and hands it to an
    OTLP/HTTP batch processor of this process. A process forked after set-up builds its own
    on its first span (a new exporter thread and HTTP session: the parent's keep-alive
    connection to the collector is not shared)."""

    def __init__(self):
        self._pid = 0
        self._batch = None
        self._lock = threading.Lock()
        # A fork while another thread held the lock would leave the child's copy held for ever.
        os.register_at_fork(after_in_child=self._new_lock)

    def _new_lock(self) -> None:
        self._lock = threading.Lock()

    def _processor(self):
        if self._pid == os.getpid():
            return self._batch
        with self._lock:  # the first spans of a process may end in several threads at once
            if self._pid == os.getpid():
                return self._batch
            from django.conf import settings
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

            if settings.OTEL_TRACES_EXPORTER == "console":
                exporter = ConsoleSpanExporter(service_name=settings.OTEL_SERVICE_NAME)
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                exporter = OTLPSpanExporter(endpoint=traces_endpoint(settings))
            # Schedule, batch and queue sizes: the SDK's OTEL_BSP_* settings.
            self._batch, self._pid = BatchSpanProcessor(exporter), os.getpid()
        return self._batch

    def on_start(self, span, parent_context=None) -> None:
        pass

    def _on_ending(self, span) -> None:
        pass

    def on_end(self, span) -> None:
        self._processor().on_end(_scrubbed(span))

    def shutdown(self) -> None:
        if self._batch is not None and self._pid == os.getpid():
            self._batch.shutdown()
        self._batch, self._pid = None, 0

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if self._batch is None or self._pid != os.getpid():
            return True
        return self._batch.force_flush(timeout_millis)


def traces_endpoint(settings) -> str:
    """Where spans are posted: the traces endpoint as given, else the generic endpoint plus
    ``/v1/traces`` (the OTLP/HTTP rule), else a collector on this machine."""
    if settings.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:
        return settings.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    base = settings.OTEL_EXPORTER_OTLP_ENDPOINT or "http://localhost:4318"
    return base.rstrip("/") + "/v1/traces"


def _scrubbed(span):
    """``span`` without the attributes that hold a path or query, and without the messages of
    its exceptions and error status (the type of an exception is kept)."""
    attributes = span.attributes
    events = span.events
    status = span.status
    if not (DROPPED_ATTRIBUTES.intersection(attributes) or events or status.description):
        return span
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import Status

    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes={k: v for k, v in attributes.items() if k not in DROPPED_ATTRIBUTES},
        events=[
            Event(
                event.name,
                {k: event.attributes[k] for k in KEPT_EXCEPTION_ATTRIBUTES if k in (event.attributes or {})},
                event.timestamp,
            )
            for event in events
        ],
        links=span.links,
        kind=span.kind,
        status=Status(status.status_code) if status.description else status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


# --- django-q2 tasks: one span per task, in the worker that runs it ----------------------

_task = threading.local()


def connect_tasks() -> None:
    """When tracing is on, each django-q2 worker sets up tracing when it starts and runs each
    task in a span named by its function (``memories.tasks.summarize_run``), with the task's
    name and whether it succeeded; never its arguments. Called once by the memories app."""
    from django.conf import settings

    if not settings.ZEROMEM_TRACING:
        return
    from django_q.signals import post_execute_in_worker, post_spawn, pre_execute

    post_spawn.connect(_worker_started, dispatch_uid="zeromem.tracing.post_spawn")
    pre_execute.connect(_task_started, dispatch_uid="zeromem.tracing.pre_execute")
    post_execute_in_worker.connect(_task_ended, dispatch_uid="zeromem.tracing.post_execute")


def _worker_started(**kwargs) -> None:
    setup()


def _task_started(sender, func, task, **kwargs) -> None:
    if _tracer is None:
        return
    from django_q.utils import get_func_repr
    from opentelemetry import context, trace

    name = get_func_repr(func) if func is not None else str(task.get("func", "task"))
    started = _tracer.start_span(
        name,
        kind=trace.SpanKind.CONSUMER,
        attributes={PREFIX + "task": name, PREFIX + "task_name": str(task.get("name", ""))},
    )
    _task.span = started
    _task.token = context.attach(trace.set_span_in_context(started))


def _task_ended(sender, func, task, **kwargs) -> None:
    started = getattr(_task, "span", None)
    if started is None:
        return
    from opentelemetry import context
    from opentelemetry.trace import StatusCode

    _task.span = None
    success = bool(task.get("success"))
    started.set_attribute(PREFIX + "outcome", "ok" if success else "error")
    if not success:
        started.set_status(StatusCode.ERROR)
    started.end()
    context.detach(_task.token)
