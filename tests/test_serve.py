"""``python3 -m zeromem serve``: the production web tier as a real process (zeromem/serving.py).

Each server runs on a free loopback port in its own process group, from a "venv" that is this
interpreter (ZEROMEM_VENV pointing at a wrapper, its requirements stamp current), so nothing is
installed. PostgreSQL tests point it at the pytest database (committed rows: transaction=True).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from tests.factories import make_key, make_tenant
from zeromem import serving

ROOT = Path(settings.BASE_DIR)
START_TIMEOUT = 60  # seconds for the server to answer /healthz on a loaded machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _database_url() -> str:
    db = connection.settings_dict  # inside a test: NAME is the test database
    user = quote(db["USER"] or "", safe="")
    password = f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else ""
    host = db["HOST"] or "localhost"
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgres://{user}{password}@{host}{port}/{quote(db['NAME'], safe='')}"


def _request(port: int, method: str, path: str, *, key: str = "", body: dict | None = None, timeout: float = 30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Served:
    """``python3 -m zeromem serve`` as a child process, stopped by its process group."""

    def __init__(self, tmp_path: Path, *, args: list[str], env: dict[str, str]):
        venv = tmp_path / "venv"
        (venv / "bin").mkdir(parents=True)
        python = venv / "bin" / "python"
        python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        python.chmod(0o755)
        digest = hashlib.sha256((ROOT / "requirements.txt").read_bytes()).hexdigest()
        (venv / ".requirements.sha256").write_text(digest)
        self.port = _free_port()
        self.log_path = tmp_path / "serve.log"
        self.env = {
            **os.environ,
            "ZEROMEM_VENV": str(venv),
            "ZEROMEM_ENV": "development",
            "ZEROMEM_VAR_DIR": str(tmp_path / "var"),
            "PORT": str(self.port),
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.args = args
        self.process: subprocess.Popen | None = None

    def run(self, timeout: float = START_TIMEOUT) -> subprocess.CompletedProcess:
        """Run to completion (for a refusal): its exit code and output."""
        return subprocess.run(
            [sys.executable, "-m", "zeromem", "serve", *self.args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self) -> Served:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "zeromem", "serve", *self.args],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"serve exited ({self.process.returncode}):\n{self.log()}"
            try:
                if _request(self.port, "GET", "/healthz", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"serve did not answer /healthz within {START_TIMEOUT} s:\n{self.log()}")

    def stop(self) -> None:
        if self.process is None:
            return
        try:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def worker_pids(self) -> list[int]:
        """The server's worker processes: ``serve`` exec()s the server, so they are its children."""
        pids = []
        for children in Path(f"/proc/{self.process.pid}/task").glob("*/children"):
            for pid in children.read_text().split():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"resource_tracker" not in cmdline:
                    pids.append(int(pid))
        return pids


@pytest.fixture
def served(tmp_path):
    started: list[Served] = []

    def start(*args: str, **env: str) -> Served:
        server = Served(tmp_path / f"s{len(started)}", args=list(args), env=env)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


# --- the serving model from flags and environment (no process) ---------------------------


def test_flags_override_the_environment_which_overrides_the_machine_defaults():
    env = {"HOST": "0.0.0.0", "PORT": "9000", "ZEROMEM_WEB_PROCESSES": "3", "ZEROMEM_WEB_THREADS": "5"}
    assert serving.parse([], env) == serving.ServingModel(host="0.0.0.0", port=9000, processes=3, threads=5)
    assert serving.parse(["--processes", "1", "--threads", "2", "--port", "9001"], env) == serving.ServingModel(
        host="0.0.0.0", port=9001, processes=1, threads=2
    )
    assert serving.parse([], {}) == serving.ServingModel(
        host="127.0.0.1", port=8000, processes=os.cpu_count() or 1, threads=serving.DEFAULT_THREADS
    )


@pytest.mark.parametrize("env", [{"ZEROMEM_WEB_THREADS": "0"}, {"ZEROMEM_WEB_PROCESSES": "many"}])
def test_a_bad_process_or_thread_count_is_refused_naming_the_setting(env, capsys):
    with pytest.raises(SystemExit):
        serving.parse([], env)
    assert next(iter(env)) in capsys.readouterr().err


def test_each_web_process_keeps_a_pooled_connection_per_thread_and_the_operators_own_sizes():
    model = serving.ServingModel(host="127.0.0.1", port=8000, processes=2, threads=6)
    env = model.environment({})
    assert (env["ZEROMEM_WEB_PROCESSES"], env["ZEROMEM_WEB_THREADS"], env["DB_POOL_MIN_SIZE"]) == ("2", "6", "6")
    assert serving.pool_max_size(6) >= 6
    assert model.environment({"DB_POOL_MIN_SIZE": "1"})["DB_POOL_MIN_SIZE"] == "1"
    cmd = model.command("python")
    assert cmd[cmd.index("--workers") + 1] == "2" and cmd[cmd.index("--blocking-threads") + 1] == "6"
    assert "--backpressure" not in cmd  # granian counts it in keep-alive connections: see serving.py


def test_the_entry_points_import_with_the_standard_library_alone():
    # `python3 -m zeromem` runs before any dependency is installed: -S leaves site-packages out.
    done = subprocess.run(
        [sys.executable, "-S", "-c", "import zeromem.__main__, zeromem.serving"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


# --- a real server -----------------------------------------------------------------------


def test_serve_starts_the_configured_processes_and_does_not_migrate(served):
    # A fresh SQLite file: serve answers /healthz from it and creates no table.
    server = served("--processes", "2", "--threads", "3", DATABASE_URL="")
    cmd = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().split(b"\0")
    assert cmd[cmd.index(b"--workers") + 1] == b"2" and cmd[cmd.index(b"--blocking-threads") + 1] == b"3"
    deadline = time.monotonic() + 30
    while len(server.worker_pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(server.worker_pids()) == 2
    status, body = _request(server.port, "GET", "/healthz")
    assert (status, json.loads(body)["database"]) == (200, "sqlite")
    database = Path(server.env["ZEROMEM_VAR_DIR"]) / "zeromem.sqlite3"
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall() == []


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_serve_answers_healthz_and_tool_calls_from_postgresql(served):
    tenant = make_tenant("serve-a")
    _key, raw = make_key(tenant)
    server = served("--processes", "1", "--threads", "2", DATABASE_URL=_database_url())
    status, body = _request(server.port, "GET", "/healthz")
    assert (status, json.loads(body)["database"]) == (200, "postgresql")
    write = {"name": "memory_write", "arguments": {"key": "fact:serve:1", "value": {"t": "hi"}}}
    status, body = _request(server.port, "POST", "/api/v1/tools/call", key=raw, body=write)
    assert status == 200 and json.loads(body)["status"] == "ok", body
    read = {"name": "memory_read", "arguments": {"key": "fact:serve:1"}}
    status, body = _request(server.port, "POST", "/api/v1/tools/call", key=raw, body=read)
    assert (status, json.loads(body)["value"]) == (200, {"t": "hi"})


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_slow_request_holds_one_thread_and_others_are_answered_meanwhile(served):
    tenant = make_tenant("serve-slow")
    _key, raw = make_key(tenant)
    server = served("--processes", "1", "--threads", "2", DATABASE_URL=_database_url())
    write = {"name": "memory_write", "arguments": {"key": "fact:serve:held", "value": {"n": 0}}}
    other = {"name": "memory_write", "arguments": {"key": "fact:serve:other", "value": {"n": 0}}}
    for body in (write, other):
        assert _request(server.port, "POST", "/api/v1/tools/call", key=raw, body=body)[0] == 200
    answers: list[int] = []
    with psycopg.connect(_database_url().replace("postgres://", "postgresql://", 1)) as locker:
        # The slow request: a write of a row this test holds locked, waiting in its thread
        # with a pooled connection for as long as the lock is held.
        locker.execute("SELECT id FROM memories_memory WHERE key = 'fact:serve:held' FOR UPDATE")
        held = threading.Thread(
            target=lambda: answers.append(
                _request(server.port, "POST", "/api/v1/tools/call", key=raw, body=write, timeout=60)[0]
            ),
            daemon=True,
        )
        held.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            waiting = locker.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            ).fetchone()[0]
            if waiting:
                break
            time.sleep(0.05)
        assert waiting == 1, "the held request never reached the lock"
        # Meanwhile the process's other thread answers, more than once and on new connections
        # (another key: a read of the held one would wait on the lock too, for its counter).
        read = {"name": "memory_read", "arguments": {"key": "fact:serve:other"}}
        for _ in range(3):
            assert _request(server.port, "POST", "/api/v1/tools/call", key=raw, body=read)[0] == 200
            assert _request(server.port, "GET", "/healthz")[0] == 200
        assert held.is_alive() and answers == []
        locker.commit()
    held.join(timeout=30)
    assert answers == [200]


def test_more_keep_alive_clients_than_threads_are_all_answered(served):
    server = served("--processes", "1", "--threads", "2", DATABASE_URL="")
    clients = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=10) for _ in range(5)]
    try:
        for client in clients:
            client.connect()  # all open (and idle) before the first request
        for client in clients:
            client.request("GET", "/healthz")
            assert client.getresponse().status == 200
    finally:
        for client in clients:
            client.close()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_serve_refuses_to_start_when_its_connections_exceed_the_budget(tmp_path):
    done = Served(
        tmp_path,
        args=["--processes", "2", "--threads", "8"],
        env={"DATABASE_URL": _database_url(), "ZEROMEM_DB_MAX_CONNECTIONS": "20"},
    ).run()
    assert done.returncode == 3, done.stdout + done.stderr
    assert "refusing to start" in done.stderr and "2 processes × pool max 10" in done.stderr
