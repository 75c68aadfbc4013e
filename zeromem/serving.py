"""The production web tier's serving model: ``python3 -m zeromem serve`` (README "Serving").

granian serving the ASGI router ``zeromem.asgi:application`` (``/mcp`` → the MCP SDK, the rest
→ Django's WSGI app through a2wsgi), ``processes`` worker processes × ``threads`` request
threads each (the router's thread pool, shared by Django's requests and MCP's calls).
Measured on this project (README "Serving"): granian had the least server CPU per request of
uvicorn ASGI, gunicorn sync/gthread and granian ASGI/WSGI; behind the router, Django's WSGI app
through a2wsgi costs +0.3-0.5 ms a request over granian WSGI where Django's ASGIHandler cost
+1.5-3 ms (its ~16 sync/async thread hops per request); a request that is slow holds one
thread of its process and nothing else, where a single-threaded worker stalls every request
queued behind it.

One module builds the command line for ``serve``, ``up`` and the benchmarks
(zeromem/bench/server.py), and states the pool sizing rule settings.py applies, so what is
measured is what is deployed. Standard library only: ``python3 -m zeromem`` imports it before
any dependency is installed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# What granian serves: the ASGI router (/mcp → the MCP SDK, the rest → Django, zeromem/asgi.py),
# or, for comparison (``bench_serve --django-modes granian-wsgi``), Django alone over WSGI.
APPS = {"asgi": "zeromem.asgi:application", "wsgi": "zeromem.wsgi:application"}
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Request threads per process. A request spends most of its time waiting on PostgreSQL, so a
# process keeps its core busy with several in flight; 8 per process carried 16 clients on 2
# cores with reads unaffected by 4 two-second requests in flight (README "Serving").
DEFAULT_THREADS = 8
# Connections a web process may open beyond one per thread. Under WSGI a request thread holds
# at most one (checked out at its first query, returned when the request finishes), so these
# are never opened in normal operation: they keep a request from waiting for a connection if
# anything else in the process ever takes one.
POOL_HEADROOM = 2
# django-q2 opens a pool in each of its processes (sentinel, pusher, monitor and the workers,
# zeromem/forking.py), each keeping DB_POOL_MIN_SIZE (2) connections: measured 6 when idle
# with Q_WORKERS=2, up to (Q_WORKERS + 3) × 2 when every worker runs a task.
QCLUSTER_PROCESSES_BESIDE_WORKERS = 3
QCLUSTER_CONNECTIONS_PER_PROCESS = 2


def default_processes() -> int:
    """One process per core: one Python process runs one thread at a time."""
    return os.cpu_count() or 1


def web_threads(environ: Mapping[str, str]) -> int:
    """The request threads of a web process (``ZEROMEM_WEB_THREADS``, else the default)."""
    return _positive(environ.get("ZEROMEM_WEB_THREADS") or DEFAULT_THREADS, "ZEROMEM_WEB_THREADS")


def threads_per_caller(environ: Mapping[str, str]) -> int | None:
    """How many of a process's threads one caller may hold (``ZEROMEM_WEB_THREADS_PER_CALLER``;
    None: the default, zeromem/kit/fair_threads.py)."""
    value = environ.get("ZEROMEM_WEB_THREADS_PER_CALLER")
    return _positive(value, "ZEROMEM_WEB_THREADS_PER_CALLER") if value else None


def pool_max_size(threads: int) -> int:
    """The pool sizing rule: a connection per request thread plus a small headroom."""
    return threads + POOL_HEADROOM


def qcluster_connections(q_workers: int) -> int:
    return (q_workers + QCLUSTER_PROCESSES_BESIDE_WORKERS) * QCLUSTER_CONNECTIONS_PER_PROCESS


@dataclass(frozen=True)
class ServingModel:
    host: str
    port: int
    processes: int
    threads: int
    interface: str = "asgi"

    def command(self, python: str, *, access_log: bool = False, log_level: str = "info") -> list[str]:
        """The server's command line (granian: ASGI, or WSGI for comparison; processes ×
        threads). Under ASGI the threads are the router's (Django's and MCP's thread pools,
        zeromem/asgi.py); granian's own blocking thread runs the event loop's callbacks."""
        return [
            python,
            "-m",
            "granian",
            "--interface",
            self.interface,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--workers",
            str(self.processes),
            "--blocking-threads",
            str(self.threads if self.interface == "wsgi" else 1),
            # No --backpressure: granian counts it in *connections* (a keep-alive connection
            # holds its permit while idle), so backpressure = threads left every client past
            # the threads-th of a process waiting for ever (tests/test_serve.py). Requests
            # beyond the threads wait in granian's queue, holding no thread.
            "--no-ws",
            "--respawn-failed-workers",
            "--log-level",
            log_level,
            "--access-log" if access_log else "--no-access-log",
            APPS[self.interface],
        ]

    def environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """``environ`` plus what each web process reads to size itself (settings.py): its
        threads, and a pool that keeps one open connection per thread (DB_POOL_MIN_SIZE), so
        that no request opens one. Values the operator set are kept."""
        env = dict(environ)
        env["ZEROMEM_WEB_PROCESSES"] = str(self.processes)
        env["ZEROMEM_WEB_THREADS"] = str(self.threads)
        env.setdefault("DB_POOL_MIN_SIZE", str(self.threads))
        env.setdefault("PROMETHEUS_MULTIPROC_DIR", str(self.metrics_dir(environ)))
        return env

    def metrics_dir(self, environ: Mapping[str, str]) -> Path:
        """Where the processes of this server write their Prometheus metrics, so that
        ``GET /metrics`` in any of them adds up all (zeromem/kit/metrics.py): one directory per
        server (its port), under the var directory."""
        var = Path(environ.get("ZEROMEM_VAR_DIR") or Path(__file__).resolve().parent.parent / "var")
        return var / f"metrics-{self.port}"


def reset_metrics_dir(path: str | os.PathLike) -> None:
    """Empty (or create) the metrics directory before the server starts: files left by an
    earlier run's processes would be added to this one's figures."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()


def parse(argv: list[str], environ: Mapping[str, str], *, prog: str = "python3 -m zeromem serve") -> ServingModel:
    """The serving model from flags, then the environment, then the machine's defaults."""
    parser = argparse.ArgumentParser(prog=prog, description="Start the production web tier (README 'Serving').")
    parser.add_argument("--host", help=f"address to bind (env HOST; {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, help=f"port (env PORT; {DEFAULT_PORT})")
    parser.add_argument(
        "--processes", type=int, help="worker processes (env ZEROMEM_WEB_PROCESSES; default: the machine's cores)"
    )
    parser.add_argument(
        "--threads", type=int, help=f"request threads per process (env ZEROMEM_WEB_THREADS; {DEFAULT_THREADS})"
    )
    args = parser.parse_args(argv)
    try:
        threads_per_caller(environ)  # read by each server process (zeromem/asgi.py): refused here first
        return ServingModel(
            host=args.host or environ.get("HOST") or DEFAULT_HOST,
            port=_positive(args.port or environ.get("PORT") or DEFAULT_PORT, "PORT"),
            processes=_positive(
                args.processes or environ.get("ZEROMEM_WEB_PROCESSES") or default_processes(), "ZEROMEM_WEB_PROCESSES"
            ),
            threads=_positive(args.threads or web_threads(environ), "ZEROMEM_WEB_THREADS"),
        )
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _positive(value: object, name: str) -> int:
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a whole number, not {value!r}") from None
    if number < 1:
        raise ValueError(f"{name} must be at least 1, not {number}")
    return number


# --- the connection budget (run in the venv, with Django: python -m zeromem.serving check) ---


def connection_budget() -> tuple[bool, str]:
    """(fits, explanation): whether ``processes × pool max + django-q2`` stays within the
    connections PostgreSQL allows this deployment (``ZEROMEM_DB_MAX_CONNECTIONS``, else the
    server's ``max_connections`` less its reserved ones). Always fits on SQLite."""
    from django.conf import settings
    from django.db import connection

    if connection.vendor != "postgresql":
        return True, f"database: {connection.vendor} (no connection pool)"
    if settings.ZEROMEM_PGBOUNCER:
        processes = int(os.environ.get("ZEROMEM_WEB_PROCESSES") or default_processes())
        pool = settings.DATABASES["default"]["OPTIONS"]["pool"]
        return True, (
            f"database connections: through PgBouncer (transaction mode): {processes} processes × pool max "
            f"{pool['max_size']} client connections; PostgreSQL sees PgBouncer's default_pool_size per database"
        )
    processes = int(os.environ.get("ZEROMEM_WEB_PROCESSES") or default_processes())
    threads = web_threads(os.environ)
    pool = settings.DATABASES["default"]["OPTIONS"]["pool"]
    web = processes * pool["max_size"]
    q = qcluster_connections(settings.Q_CLUSTER["workers"])
    needed = web + q
    configured = os.environ.get("ZEROMEM_DB_MAX_CONNECTIONS")
    if configured:
        available, source = _positive(configured, "ZEROMEM_DB_MAX_CONNECTIONS"), "ZEROMEM_DB_MAX_CONNECTIONS"
    else:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('max_connections')::int,"
                " current_setting('superuser_reserved_connections')::int,"
                " coalesce(current_setting('reserved_connections', true), '0')::int"
            )
            total, superuser, reserved = cursor.fetchone()
        connection.close()
        available = total - superuser - reserved
        source = f"PostgreSQL max_connections {total} − {superuser + reserved} reserved"
    text = (
        f"database connections: {processes} processes × pool max {pool['max_size']} (min {pool['min_size']}) + "
        f"django-q2 up to {q} = {needed} of {available} ({source})"
    )
    if pool["max_size"] < threads:
        text += (
            f"\n  warning: DB_POOL_MAX_SIZE {pool['max_size']} < {threads} threads: "
            f"requests will wait up to DB_POOL_TIMEOUT ({pool['timeout']} s) for a connection"
        )
    return needed <= available, text


def master_keys_problem() -> str | None:
    """Whether ZEROMEM_MASTER_KEYS opens the stored data keys (README "Encryption at rest")."""
    from memories.keyring import master_keys_problem as problem

    return problem()


def check_main() -> int:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "zeromem.settings")
    django.setup()
    from django.db import connection

    from zeromem.kernel.checks import pooler_problem

    problem = pooler_problem(connection)
    connection.close()
    if problem:
        print(f"[zeromem] refusing to start: {problem}.", file=sys.stderr, flush=True)
        return 3
    problem = master_keys_problem()
    if problem:
        print(f"[zeromem] refusing to start: {problem}", file=sys.stderr, flush=True)
        return 3
    fits, text = connection_budget()
    if fits:
        print(f"[zeromem] {text}", flush=True)
        return 0
    print(
        f"[zeromem] refusing to start: {text}.\n"
        "  Lower --processes/--threads (or DB_POOL_MAX_SIZE), raise PostgreSQL's max_connections, put PgBouncer "
        "in front (ZEROMEM_PGBOUNCER=true), or set ZEROMEM_DB_MAX_CONNECTIONS to the connections this machine "
        "may use.",
        file=sys.stderr,
        flush=True,
    )
    return 3


if __name__ == "__main__":
    if sys.argv[1:] != ["check"]:
        sys.exit("usage: python -m zeromem.serving check")
    sys.exit(check_main())
