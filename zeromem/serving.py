"""The production web tier's serving model: ``python3 -m zeromem serve`` (README "Serving").

granian serving the ASGI router ``zeromem.asgi:application`` (``/mcp`` → the MCP SDK, the rest
→ Django's WSGI app through zeromem/kit/wsgi_bridge.py), ``processes`` worker processes ×
``threads`` request threads each (the router's thread pool, shared by Django's requests and
MCP's calls).
Measured on this project (README "Serving"): granian had the least server CPU per request of
uvicorn ASGI, gunicorn sync/gthread and granian ASGI/WSGI; behind the router, Django's WSGI app
through a2wsgi cost +0.3-0.5 ms a request over granian WSGI (the bridge that replaced a2wsgi's
responder saved 0.2-0.3 ms of it, 0.7-0.8 ms on a tool read) where Django's ASGIHandler cost +1.5-3 ms (its ~16
sync/async thread hops per request); a request that is slow holds one
thread of its process and nothing else, where a single-threaded worker stalls every request
queued behind it.

One module builds the command line for ``serve``, ``up`` and the benchmarks
(zeromem/bench/server.py), and states the pool sizing rule settings.py applies, so what is
measured is what is deployed. Standard library only: ``python3 -m zeromem`` imports it before
any dependency is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
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
# The search tier (memories/search/tier.py): processes that rank searches for the web
# processes, so that one tenant's searches do not share a process (and its GIL) with other
# tenants' reads (README "Search tier"). Each runs at most this many rankings at once, with a
# pool of that many connections plus the headroom, at this CPU priority below the web's.
DEFAULT_SEARCH_TIER_CONCURRENCY = 4
DEFAULT_SEARCH_TIER_NICE = 10
QCLUSTER_PROCESSES_BESIDE_WORKERS = 3
QCLUSTER_CONNECTIONS_PER_PROCESS = 2


def default_processes() -> int:
    """One process per core: one Python process runs one thread at a time."""
    return os.cpu_count() or 1


def default_search_processes() -> int:
    """One search process per four cores, at least one."""
    return max(1, (os.cpu_count() or 1) // 4)


def search_tier_concurrency(environ: Mapping[str, str]) -> int:
    value = environ.get("ZEROMEM_SEARCH_TIER_CONCURRENCY") or DEFAULT_SEARCH_TIER_CONCURRENCY
    return _positive(value, "ZEROMEM_SEARCH_TIER_CONCURRENCY")


def search_tier_nice(environ: Mapping[str, str]) -> int:
    """How far below the web processes' CPU priority the search processes run (0-19)."""
    nice = environ.get("ZEROMEM_SEARCH_TIER_NICE")
    value = _count(DEFAULT_SEARCH_TIER_NICE if nice in (None, "") else nice, "ZEROMEM_SEARCH_TIER_NICE")
    if value > 19:
        raise ValueError(f"ZEROMEM_SEARCH_TIER_NICE must be at most 19, not {value}")
    return value


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


def event_loop() -> str:
    """The event loop of the ASGI router (granian's ``--loop``): uvloop (requirements.txt, on
    Linux and macOS) — less server CPU per ``/healthz`` and tool read than asyncio's, and a
    4–6 % lower p50 on every route, measured in README "Serving" — or asyncio where uvloop is
    not installed. ``GRANIAN_LOOP`` chooses another. Named on the command line, so the loop
    measured is the loop deployed whatever granian's ``auto`` would pick."""
    chosen = os.environ.get("GRANIAN_LOOP")
    if chosen:
        return chosen
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


@dataclass(frozen=True)
class ServingModel:
    host: str
    port: int
    processes: int
    threads: int
    interface: str = "asgi"
    search_processes: int = 0  # 0: each web process ranks its own searches

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
            "--loop",
            event_loop(),
            "--no-ws",
            "--respawn-failed-workers",
            "--log-level",
            log_level,
            "--access-log" if access_log else "--no-access-log",
            APPS[self.interface],
        ]

    def run_command(self, python: str, *, access_log: bool = False, log_level: str = "info") -> list[str]:
        """The command that runs the whole tier (:func:`run`): the search processes, then the
        web server, supervised by one process that stops them all on SIGTERM or SIGINT."""
        cmd = [python, "-m", "zeromem.serving", "run", "--host", self.host, "--port", str(self.port)]
        cmd += ["--processes", str(self.processes), "--threads", str(self.threads)]
        cmd += ["--search-processes", str(self.search_processes), "--interface", self.interface]
        cmd += ["--log-level", log_level] + (["--access-log"] if access_log else [])
        return cmd

    def search_tier_command(self, python: str, socket_path: str, environ: Mapping[str, str]) -> list[str]:
        nice_value = search_tier_nice(environ)
        manage_py = str(Path(__file__).resolve().parent.parent / "manage.py")
        return [python, manage_py, "search_tier", "--socket", socket_path, "--nice", str(nice_value)]

    def search_tier_environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """A search process's environment: the web's, with a pool sized to its concurrency."""
        env = dict(environ)
        concurrency = search_tier_concurrency(environ)
        env["DB_POOL_MAX_SIZE"] = str(pool_max_size(concurrency))
        env["DB_POOL_MIN_SIZE"] = str(min(concurrency, 4))
        return env

    def environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """``environ`` plus what each web process reads to size itself (settings.py): its
        threads, and a pool that keeps one open connection per thread (DB_POOL_MIN_SIZE), so
        that no request opens one. Values the operator set are kept."""
        env = dict(environ)
        env["ZEROMEM_WEB_PROCESSES"] = str(self.processes)
        env["ZEROMEM_WEB_THREADS"] = str(self.threads)
        env["ZEROMEM_SEARCH_PROCESSES"] = str(self.search_processes)
        env.setdefault("DB_POOL_MIN_SIZE", str(self.threads))
        env.setdefault("PROMETHEUS_MULTIPROC_DIR", str(self.metrics_dir(environ)))
        return env

    def metrics_dir(self, environ: Mapping[str, str]) -> Path:
        """Where the processes of this server write their Prometheus metrics, so that
        ``GET /metrics`` in any of them adds up all (zeromem/kit/metrics.py): one directory per
        server (its port), under the var directory."""
        var = Path(environ.get("ZEROMEM_VAR_DIR") or Path(__file__).resolve().parent.parent / "var")
        return var / f"metrics-{self.port}"


def address_problem(host: str, port: int) -> str | None:
    """Why the web server could not listen on ``host:port`` (a name that does not resolve, an
    address not of this machine, a port in use), or None. Asked before anything starts: the
    server's own failure is a 140-line backtrace, after the search processes were started."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        return f"HOST {host!r} is not an address to listen on: {exc}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        try:
            probe.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port} (HOST, PORT): {exc.strerror or exc}"
    return None


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
    parser.add_argument(
        "--search-processes",
        type=int,
        help="search tier processes (env ZEROMEM_SEARCH_PROCESSES; default: one per 4 cores, at least 1; "
        "0: the web processes rank searches themselves)",
    )
    args = parser.parse_args(argv)

    def given(flag: str, name: str) -> tuple[object, str] | None:
        # A flag given as 0 is the flag's value (refused below, naming the flag), not "unset".
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            return value, flag
        return (environ[name], name) if environ.get(name) else None

    try:
        threads_per_caller(environ)  # read by each server process (zeromem/asgi.py): refused here first
        search_tier_nice(environ)  # read by `run` when it starts a search process
        port, port_name = given("--port", "PORT") or (DEFAULT_PORT, "PORT")
        port = _positive(port, port_name)
        if port > 65535:
            raise ValueError(f"{port_name} must be at most 65535, not {port}")
        host = args.host if args.host is not None else environ.get("HOST") or DEFAULT_HOST
        if not host.strip():
            raise ValueError("--host must not be empty")
        processes = given("--processes", "ZEROMEM_WEB_PROCESSES") or (default_processes(), "ZEROMEM_WEB_PROCESSES")
        threads = given("--threads", "ZEROMEM_WEB_THREADS") or (DEFAULT_THREADS, "ZEROMEM_WEB_THREADS")
        return ServingModel(
            host=host,
            port=port,
            processes=_positive(*processes),
            threads=_positive(*threads),
            search_processes=_count(
                *(given("--search-processes", "ZEROMEM_SEARCH_PROCESSES") or (default_search_processes(), ""))
            ),
        )
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _count(value: object, name: str) -> int:
    """A whole number ≥ 0."""
    return _whole(value, name, least=0)


def _positive(value: object, name: str) -> int:
    return _whole(value, name, least=1)


def _whole(value: object, name: str, *, least: int) -> int:
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a whole number, not {value!r}") from None
    if number < least:
        raise ValueError(f"{name} must be at least {least}, not {number}")
    return number


# --- the tier's processes (run in the venv: python -m zeromem.serving run) -------------------


def _say(message: str) -> None:
    print(f"[zeromem] {message}", file=sys.stderr, flush=True)


SOCKET_DIR_PREFIX = "zeromem-search-"


def _sweep_socket_dirs(min_age: float = 60.0) -> None:
    """Remove this user's empty socket directories left by a supervisor that was killed (its
    search processes removed their sockets, nobody removed the directory). A directory that
    still holds anything, or is younger than ``min_age`` seconds (a supervisor starting), is
    left alone."""
    root = Path(tempfile.gettempdir())
    for path in root.glob(f"{SOCKET_DIR_PREFIX}*"):
        try:
            info = path.lstat()
            if (
                path.is_dir()
                and not path.is_symlink()
                and info.st_uid == os.getuid()
                and time.time() - info.st_mtime > min_age
                and not any(path.iterdir())
            ):
                path.rmdir()
        except OSError:
            continue  # gone meanwhile, or not ours to touch


def run(model: ServingModel, environ: Mapping[str, str], *, access_log: bool = False, log_level: str = "info") -> int:
    """Run the web tier until SIGTERM or SIGINT: ``model.search_processes`` search processes
    (each on a Unix socket in a directory of this run's own, 0700; restarted when one
    exits), then granian with ``ZEROMEM_SEARCH_TIER`` naming their sockets. Returns granian's
    exit status; stops everything it started on the way out."""
    python = sys.executable
    env = dict(environ)
    _sweep_socket_dirs()
    socket_dir = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)
    sockets = [os.path.join(socket_dir, f"{index}.sock") for index in range(model.search_processes)]
    if sockets:
        env["ZEROMEM_SEARCH_TIER"] = ",".join(sockets)
    tier_env = model.search_tier_environment(env)
    root = str(Path(__file__).resolve().parent.parent)

    def start_tier(path: str) -> subprocess.Popen:
        return subprocess.Popen(model.search_tier_command(python, path, env), cwd=root, env=tier_env)

    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    tiers = {path: start_tier(path) for path in sockets}
    web: subprocess.Popen | None = None
    try:
        # The web processes rank searches themselves until a socket exists: wait a little.
        deadline = time.monotonic() + 30
        while not stopping and time.monotonic() < deadline and not all(os.path.exists(p) for p in sockets):
            if any(proc.poll() is not None for proc in tiers.values()):
                break
            time.sleep(0.05)
        if sockets:
            _say(f"search tier: {len(sockets)} process(es) on {socket_dir}")
        if stopping:
            return 0
        web = subprocess.Popen(model.command(python, access_log=access_log, log_level=log_level), cwd=root, env=env)
        restarted: dict[str, float] = {}
        while not stopping and web.poll() is None:
            time.sleep(0.2)
            for path, proc in list(tiers.items()):
                if proc.poll() is not None and not stopping and time.monotonic() - restarted.get(path, 0) > 1.0:
                    _say(f"search process on {path} exited with {proc.returncode}: restarting it")
                    restarted[path] = time.monotonic()
                    tiers[path] = start_tier(path)
        return web.poll() or 0
    finally:
        for proc in ([web] if web is not None else []) + list(tiers.values()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in ([web] if web is not None else []) + list(tiers.values()):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(socket_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_main(argv: list[str]) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--interface", choices=sorted(APPS), default="asgi")
    extra.add_argument("--log-level", default="info")
    extra.add_argument("--access-log", action="store_true")
    options, rest = extra.parse_known_args(argv)
    model = parse(rest, os.environ, prog="python -m zeromem.serving run")
    if options.interface != model.interface:
        model = ServingModel(
            host=model.host,
            port=model.port,
            processes=model.processes,
            threads=model.threads,
            interface=options.interface,
            search_processes=model.search_processes,
        )
    return run(model, os.environ, access_log=options.access_log, log_level=options.log_level)


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
    searchers = int(os.environ.get("ZEROMEM_SEARCH_PROCESSES") or 0)
    search_pool = pool_max_size(search_tier_concurrency(os.environ))
    q = qcluster_connections(settings.Q_CLUSTER["workers"])
    needed = web + searchers * search_pool + q
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
        f"{searchers} search processes × {search_pool} + django-q2 up to {q} = {needed} of {available} ({source})"
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
    if sys.argv[1:2] == ["run"]:
        sys.exit(run_main(sys.argv[2:]))
    if sys.argv[1:] != ["check"]:
        sys.exit("usage: python -m zeromem.serving check | run [serve's flags]")
    sys.exit(check_main())
