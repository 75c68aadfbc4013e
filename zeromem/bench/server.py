"""The server under test, as a process: ``python3 -m zeromem serve``'s server on loopback.

The command line and environment come from :mod:`zeromem.serving`, as for ``serve`` and ``up``
(granian serving the ASGI router, processes × threads, the pool sized per thread), with ``ZEROMEM_ENV=development
DEBUG=false``, the given ``DATABASE_URL`` and a rate limit high enough not to interfere. It is
always stopped, with every worker, by its process group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings
from django.core.management.base import CommandError

from zeromem.bench.harness import LOOPBACK, child_pids, healthz
from zeromem.serving import ServingModel, default_search_processes, pool_max_size, reset_metrics_dir


def free_port() -> int:
    """A free loopback port, or ``ZEROMEM_BENCH_PORT`` when set (a machine whose users share
    out port ranges)."""
    if os.environ.get("ZEROMEM_BENCH_PORT"):
        return int(os.environ["ZEROMEM_BENCH_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def tail(path: str, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def worker_pids(master: int) -> list[int]:
    """The server's working processes: under the supervisor (zeromem/serving.py ``run``), the
    search processes and granian's workers (not granian's master, nor helpers)."""
    pids = []
    below = {child: child_pids(child) for child in child_pids(master)}
    # granian's master is the child with children of its own: its children, not it.
    for pid in [p for child, grandchildren in below.items() for p in (grandchildren or [child])]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            pids.append(pid)
    return pids or [master]


def start_server(
    *,
    database_url: str,
    processes: int,
    threads: int,
    log,
    port: int = 0,
    access_log: bool = False,
    extra_env: dict | None = None,
    interface: str = "asgi",
    search_processes: int | None = None,
) -> dict:
    """``python3 -m zeromem serve --processes P --threads T``'s server on 127.0.0.1, pooled
    connections from ``database_url``, a rate limit high enough not to interfere. Returns
    {"proc", "port", "log", "cmd", "model", "pool", "workers"} once /healthz answers 200 from
    PostgreSQL; raises CommandError otherwise."""
    if search_processes is None:  # as serve would: ZEROMEM_SEARCH_PROCESSES, else the machine's default
        search_processes = int(os.environ.get("ZEROMEM_SEARCH_PROCESSES") or default_search_processes())
    model = ServingModel(
        host=LOOPBACK,
        port=port or free_port(),
        processes=processes,
        threads=threads,
        interface=interface,
        search_processes=search_processes,
    )
    env = dict(os.environ)
    env.update(
        ZEROMEM_ENV="development",
        DEBUG="false",
        DATABASE_URL=database_url,
        ZEROMEM_RATE_LIMIT_PER_MINUTE=str(10**9),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra_env or {})
    # A metrics directory of this run's own, removed with the server (stop_server).
    env.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="zeromem-bench-metrics-"))
    env = model.environment(env)
    reset_metrics_dir(env["PROMETHEUS_MULTIPROC_DIR"])
    cmd = model.run_command(sys.executable, access_log=access_log, log_level="warning")
    logfile = tempfile.NamedTemporaryFile(prefix="zeromem-bench-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        cmd,
        cwd=str(settings.BASE_DIR),
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    pool = {
        "min_size": int(env["DB_POOL_MIN_SIZE"]),
        "max_size": int(env.get("DB_POOL_MAX_SIZE") or pool_max_size(threads)),
    }
    server = {
        "proc": proc,
        "port": model.port,
        "log": logfile.name,
        "cmd": cmd,
        "model": model,
        "pool": pool,
        "metrics_dir": env["PROMETHEUS_MULTIPROC_DIR"],
    }
    log(f"server: {' '.join(cmd[2:])} (pid {proc.pid}, log {logfile.name})")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop_server(server)
            raise CommandError(f"the server exited with {proc.returncode}:\n{tail(logfile.name)}")
        try:
            status, body = healthz(model.port, timeout=2)
            if status == 200 and b'"postgresql"' in body:
                break
        except OSError:
            pass
        time.sleep(0.2)
    else:
        stop_server(server)
        raise CommandError(f"the server did not answer /healthz within 60 s:\n{tail(logfile.name)}")
    time.sleep(1.0)  # let every worker finish importing before the first sample
    server["workers"] = worker_pids(proc.pid)
    return server


def stop_server(server: dict):
    proc: subprocess.Popen = server["proc"]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    # Whatever is left of the group we started (its workers), by its process group id.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    if "zeromem-bench-metrics-" in server.get("metrics_dir", ""):
        shutil.rmtree(server["metrics_dir"], ignore_errors=True)


@contextlib.contextmanager
def running_server(*, stderr, **start: object) -> Iterator[dict]:
    """:func:`start_server` for the ``with`` block, stopped at its end. Its log is deleted when
    the block succeeds and kept (its path written to ``stderr``) when it fails."""
    server = start_server(**start)
    ok = False
    try:
        yield server
        ok = True
    finally:
        stop_server(server)
        if ok:
            Path(server["log"]).unlink(missing_ok=True)
        else:
            stderr.write(f"server log kept: {server['log']}")
