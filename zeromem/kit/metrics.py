"""Prometheus metrics (prometheus_client), aggregated across every process of the web tier.

``python3 -m zeromem serve`` gives its processes one ``PROMETHEUS_MULTIPROC_DIR`` (emptied at
start, zeromem/serving.py): each process writes its counters and histograms to its own
memory-mapped file there, and ``GET /metrics`` — answered by whichever process the request
lands on — adds up every process's files (prometheus_client's multiprocess mode). Without that
directory (tests, ``manage.py runserver``) the metrics are the one process's own.

What is recorded where:

* requests by route (the URL pattern, never the path: no key or tenant in it), method (the
  standard ones; any other is ``other``), status and latency — :class:`MetricsMiddleware`;
* tool calls by tool and outcome (``ok``, ``not_found``, ``conflict``, ``error``) —
  :func:`tool_calls` from the tool endpoints;
* tool results returned to the models, their bytes and estimated tokens, by surface
  (``rest``, ``mcp``) — :func:`results_returned`, where the responses are costed;
* searches handed to the search tier, by outcome (``tier``, ``fallback``, ``timeout``,
  ``error``) — ``zeromem_search_tier_rankings``, counted where they are handed over
  (memories/search/tier.py);
* the database pool of each process (connections open, idle, requests waiting), sampled at
  the end of a request at most once a second; a process that is gone leaves the sum at the
  next scrape (:func:`forget_dead_processes`);
* at scrape time, from the database (one short query each, :class:`DatabaseCollector`): the
  job queue's depth and its oldest queued job's age, the open forget requests past their due
  date, the audit events not yet sealed, the data keys by state (``current``, ``retired``,
  ``destroyed``: the crypto erasures) from the counts the key store's triggers keep
  (:func:`data_key_counts`).

No label holds tenant data: no tenant, key, memory key or path. ``GET /metrics`` answers only
to an API key with the operator scope ``metrics:read`` (memories/api/auth.py).
"""

from __future__ import annotations

import os
import time

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.db import DatabaseError, connections
from django.utils import timezone
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily

from zeromem.kit import logs

MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
if MULTIPROCESS:  # serve empties it at start; whoever else set it may not have created it
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
# Latency buckets (seconds) around the API's figures: reads ~1-3 ms, writes ~5-15 ms, searches
# up to the 80-ms timeout, exports and batches longer.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

REQUESTS = Counter(
    "zeromem_http_requests", "HTTP requests answered, by route, method and status", ["route", "method", "status"]
)
LATENCY = Histogram(
    "zeromem_http_request_duration_seconds",
    "Time to the response (a streamed body's transfer not included), by route and method",
    ["route", "method"],
    buckets=BUCKETS,
)
TOOL_CALLS = Counter("zeromem_tool_calls", "Tool calls run, by tool and outcome", ["tool", "outcome"])
RESULTS = Counter("zeromem_tool_results", "Tool results returned to the models, by surface", ["surface"])
RESULT_BYTES = Counter("zeromem_tool_result_bytes", "Bytes of the tool results returned, by surface", ["surface"])
RESULT_TOKENS = Counter(
    "zeromem_tool_result_tokens", "Estimated tokens of the tool results returned, by surface", ["surface"]
)
# Gauges of a process's own pool, summed over the live processes.
POOL_OPEN = Gauge("zeromem_db_pool_connections", "Pooled database connections open", multiprocess_mode="livesum")
POOL_IDLE = Gauge("zeromem_db_pool_idle_connections", "Pooled connections idle", multiprocess_mode="livesum")
POOL_WAITING = Gauge(
    "zeromem_db_pool_requests_waiting", "Requests waiting for a pooled connection", multiprocess_mode="livesum"
)


# The labelled children a request counts into, by metric and label values: ``labels()``
# validates its arguments and takes the metric's lock on every call (~3.5 µs, six or seven a
# tool call). The values are few (routes, methods, statuses, tools, outcomes, surfaces: every
# one of them bounded above), and a child is the metric's own, kept by it for its life.
_children: dict[tuple, object] = {}


def _child(metric, *values: str):
    child = _children.get((metric, values))
    if child is None:
        child = _children[(metric, values)] = metric.labels(*values)
    return child


def route_of(request) -> str:
    """The URL pattern that answered (``api/v1/memories/<path:key>``), never the path itself."""
    match = getattr(request, "resolver_match", None)
    if match is None:
        return "unmatched"
    return match.route or match.view_name or "unmatched"


def tool_calls(names_and_outcomes) -> None:
    """Count tool calls: ``(tool name, outcome)`` pairs; an unknown name counts as ``unknown``
    (the label's values stay the registry's tools, whatever a client sends)."""
    from memories.tools import TOOLS

    for name, outcome in names_and_outcomes:
        tool = name if isinstance(name, str) and name in TOOLS else "unknown"
        _child(TOOL_CALLS, tool, outcome if outcome in OUTCOMES else "error").inc()


OUTCOMES = frozenset({"ok", "not_found", "conflict", "error"})


def results_returned(surface: str, *, size: int, tokens: int) -> None:
    """Count one tool result of ``size`` bytes and ``tokens`` estimated tokens (fleet-wide
    figures; per tenant and day they are in the tokens-returned usage)."""
    _child(RESULTS, surface).inc()
    _child(RESULT_BYTES, surface).inc(size)
    _child(RESULT_TOKENS, surface).inc(tokens)


POOL_SAMPLE_SECONDS = 1.0
_next_pool_sample = 0.0


def _sample_pool() -> None:
    """At most once a second per process (reading the pool's stats takes its lock: ~40 µs)."""
    global _next_pool_sample
    now = time.monotonic()
    if now < _next_pool_sample:
        return
    _next_pool_sample = now + POOL_SAMPLE_SECONDS
    default = connections["default"]
    # Only a pool that exists: the ``pool`` property would open one (with the settings of the
    # moment, e.g. before a test database replaces the configured one).
    pools = getattr(default, "_connection_pools", {}) if default.vendor == "postgresql" else {}
    pool = pools.get(default.alias)
    if pool is None:
        return
    stats = pool.get_stats()
    POOL_OPEN.set(stats.get("pool_size", 0))
    POOL_IDLE.set(stats.get("pool_available", 0))
    POOL_WAITING.set(stats.get("requests_waiting", 0))


class MetricsMiddleware:
    """Counts and times every request, and names the request in its log records
    (zeromem/kit/logs.py). Sync and async, like RequestIdMiddleware: under ASGI it adds no
    thread hop."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        started = time.perf_counter()
        # Kept until the request is finished (request_finished, below): Django logs a 4xx/5xx
        # answer after the middleware has returned it.
        logs.request_id.set(getattr(request, "request_id", ""))
        response = self.get_response(request)
        record_request(request, response, started)
        return response

    async def _acall(self, request):
        started = time.perf_counter()
        logs.request_id.set(getattr(request, "request_id", ""))
        response = await self.get_response(request)
        record_request(request, response, started)
        return response


# The method is the client's to choose (any token the server parses): as a label, each made-up
# one was a new series of the counter and of the histogram in every process's file. Others count
# as ``other``.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"})


def record_request(request, response, started: float) -> None:
    """Count and time one answered request (MetricsMiddleware; the tool-call lane,
    memories/api/lane.py, which answers without the middleware)."""
    route = route_of(request)
    method = request.method if request.method in METHODS else "other"
    _child(LATENCY, route, method).observe(time.perf_counter() - started)
    _child(REQUESTS, route, method, str(response.status_code)).inc()
    try:
        _sample_pool()
    except Exception:  # a metric never fails a request  # nosec B110
        pass


def overdue_forget_requests(now):
    """Forget requests not completed past their due date, every tenant's: a range of the
    partial index ``forget_open_due`` (memories 0034), not a read of every request kept."""
    from memories.models import ForgetRequest

    return ForgetRequest.objects.exclude(status=ForgetRequest.Status.COMPLETED).filter(due_at__lte=now)


class DatabaseCollector:
    """Gauges read from the database at scrape time (fleet-wide: the same whichever process
    answers)."""

    def collect(self):
        from django_q.brokers import get_broker

        from audit.services import audit_unsealed_count
        from memories.models import Job

        now = timezone.now()
        queued = GaugeMetricFamily("zeromem_jobs", "Jobs queued or running, by status", labels=["status"])
        oldest = GaugeMetricFamily("zeromem_jobs_oldest_queued_age_seconds", "Age of the oldest job still queued")
        broker = GaugeMetricFamily("zeromem_task_queue_depth", "Tasks waiting in django-q2's broker")
        overdue = GaugeMetricFamily("zeromem_forget_requests_overdue", "Forget requests not completed past due")
        unsealed = GaugeMetricFamily("zeromem_audit_unsealed_events", "Audit events not yet sealed")
        try:
            for status in (Job.Status.QUEUED, Job.Status.RUNNING):
                queued.add_metric([status.value], Job.objects.filter(status=status).count())
            first = Job.objects.filter(status=Job.Status.QUEUED).order_by("created_at").values_list("created_at")[:1]
            first = list(first)
            oldest.add_metric([], (now - first[0][0]).total_seconds() if first else 0.0)
            broker.add_metric([], get_broker().queue_size() or 0)
            overdue.add_metric([], overdue_forget_requests(now).count())
            unsealed.add_metric([], audit_unsealed_count())
        except DatabaseError:
            return  # the database is down: /healthz says so; these gauges are left out
        yield from (queued, oldest, broker, overdue, unsealed)
        yield from self._data_keys()

    def _data_keys(self):
        keys = GaugeMetricFamily("zeromem_data_keys", "Data keys in the key store, by state", labels=["state"])
        try:
            counts = data_key_counts()
        except DatabaseError:
            return
        for state in ("current", "retired", "destroyed"):
            keys.add_metric([state], counts.get(state, 0))
        yield keys


def data_key_counts() -> dict[str, int]:
    """The data keys by state. On PostgreSQL the counts the key store's triggers keep in the
    transaction of each change (memories migration 0040): one query adding up at most 48
    rows, whatever the number of keys (counting them took 56 ms a scrape at 500k keys).
    Elsewhere (SQLite, development) one aggregate over the keys."""
    from django.db.models import Count, Q

    from memories.models import DataKey

    db = DataKey.objects.db  # the key store (memories/routers.py)
    connection = connections[db]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT state, sum(n) FROM memories_datakey_count GROUP BY state")
            return {state: int(n) for state, n in cursor.fetchall()}
    return DataKey.objects.using(db).aggregate(
        current=Count("pk", filter=Q(retired_at__isnull=True, destroyed_at__isnull=True)),
        retired=Count("pk", filter=Q(retired_at__isnull=False, destroyed_at__isnull=True)),
        destroyed=Count("pk", filter=Q(destroyed_at__isnull=False)),
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def forget_dead_processes(path: str) -> None:
    """Drop the "live" gauges (the pool's) of the processes that are gone: granian respawns a
    worker that died, and its last pool figures stayed in every later sum. Their counters
    and histograms stay (what they answered still happened). Cost: one listing of the
    directory and a signal-0 probe per process file."""
    try:
        names = os.listdir(path)
    except OSError:  # the directory is gone: nothing to forget (the collector finds no file)
        return
    for name in names:
        if name.startswith("gauge_live") and name.endswith(".db"):
            pid = name[: -len(".db")].rpartition("_")[2]
            if pid.isdigit() and not _pid_alive(int(pid)):
                multiprocess.mark_process_dead(int(pid), path)


def exposition() -> tuple[bytes, str]:
    """The metrics page: every web process's metrics (multiprocess mode) plus the database's."""
    registry = CollectorRegistry()
    if MULTIPROCESS:
        forget_dead_processes(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        multiprocess.MultiProcessCollector(registry)
    else:
        from memories.search.tier import RANKINGS  # counted where searches are handed over

        for collector in (
            RANKINGS,
            REQUESTS,
            LATENCY,
            TOOL_CALLS,
            RESULTS,
            RESULT_BYTES,
            RESULT_TOKENS,
            POOL_OPEN,
            POOL_IDLE,
            POOL_WAITING,
        ):
            registry.register(collector)
    registry.register(DatabaseCollector())
    return generate_latest(registry), CONTENT_TYPE_LATEST
