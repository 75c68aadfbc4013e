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
from tests.helpers import REDIS_TEST_URL, redis_or_fail, stop_process_group
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


def _keyed_tenants(*slugs: str) -> list[tuple]:
    """A new tenant per slug, each with a key of every scope: [(tenant, raw key), ...]."""
    return [(tenant, make_key(tenant)[1]) for tenant in map(make_tenant, slugs)]


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
        stop_process_group(self.process, grace=15)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def children(self, pid: int | None = None) -> dict[int, bytes]:
        """{pid: command line} of ``pid``'s children (default: serve's, which exec()s the
        tier's supervisor: the search processes and granian's master)."""
        found = {}
        for children in Path(f"/proc/{pid or self.process.pid}/task").glob("*/children"):
            for child in children.read_text().split():
                try:
                    found[int(child)] = Path(f"/proc/{child}/cmdline").read_bytes()
                except OSError:
                    continue  # exited meanwhile
        return found

    def granian_cmdline(self) -> list[bytes]:
        return next(cmd for cmd in self.children().values() if b"granian" in cmd).split(b"\0")

    def search_pids(self) -> list[int]:
        return [pid for pid, cmd in self.children().items() if b"search_tier" in cmd]

    def worker_pids(self) -> list[int]:
        """The web server's worker processes: the children of granian's master."""
        pids = []
        for master, cmd in self.children().items():
            if b"granian" in cmd:
                pids += [pid for pid, c in self.children(master).items() if b"resource_tracker" not in c]
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
    env["ZEROMEM_SEARCH_PROCESSES"] = "2"
    assert serving.parse([], env) == serving.ServingModel(
        host="0.0.0.0", port=9000, processes=3, threads=5, search_processes=2
    )
    flags = ["--processes", "1", "--threads", "2", "--port", "9001", "--search-processes", "0"]
    assert serving.parse(flags, env) == serving.ServingModel(
        host="0.0.0.0", port=9001, processes=1, threads=2, search_processes=0
    )
    assert serving.parse([], {}) == serving.ServingModel(
        host="127.0.0.1",
        port=8000,
        processes=os.cpu_count() or 1,
        threads=serving.DEFAULT_THREADS,
        search_processes=max(1, (os.cpu_count() or 1) // 4),
    )


@pytest.mark.parametrize(
    "env",
    [
        {"ZEROMEM_WEB_THREADS": "0"},
        {"ZEROMEM_WEB_PROCESSES": "many"},
        {"ZEROMEM_WEB_THREADS_PER_CALLER": "0"},
        {"ZEROMEM_SEARCH_PROCESSES": "-1"},
    ],
)
def test_a_bad_process_or_thread_count_is_refused_naming_the_setting(env, capsys):
    with pytest.raises(SystemExit):
        serving.parse([], env)
    assert next(iter(env)) in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, named",
    [
        # A flag of 0 was taken for "not given": the environment's or the machine's value served.
        (["--processes", "0"], "--processes must be at least 1"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--port", "0"], "--port must be at least 1"),
        (["--port", "70000"], "--port must be at most 65535"),
        (["--search-processes", "-1"], "--search-processes must be at least 0"),
        (["--host", ""], "--host must not be empty"),
    ],
)
def test_a_bad_flag_is_refused_naming_the_flag_even_when_the_environment_has_a_good_value(flags, named, capsys):
    env = {"PORT": "9000", "ZEROMEM_WEB_PROCESSES": "2", "ZEROMEM_WEB_THREADS": "4", "ZEROMEM_SEARCH_PROCESSES": "1"}
    with pytest.raises(SystemExit):
        serving.parse(flags, env)
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("env", [{"PORT": "70000"}, {"ZEROMEM_SEARCH_TIER_NICE": "low"}])
def test_a_bad_port_or_search_priority_in_the_environment_is_refused_before_anything_starts(env, capsys):
    # The nice value was read only when the first search process started: a ValueError there.
    with pytest.raises(SystemExit):
        serving.parse([], env)
    assert next(iter(env)) in capsys.readouterr().err


def test_serve_refuses_an_address_in_use_or_unresolvable_in_one_line_starting_nothing(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = Served(tmp_path / "a", args=["--port", str(port), "--processes", "1", "--threads", "1"], env={}).run()
    # Before: the search processes started, then granian died with a 140-line backtrace.
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"refusing to start: cannot listen on 127.0.0.1:{port} (HOST, PORT): Address already in use" in done.stderr
    assert "Traceback" not in done.stderr and "search tier" not in done.stderr
    done = Served(tmp_path / "b", args=["--processes", "1", "--threads", "1"], env={"HOST": "0.0.0.0:8000"}).run()
    assert done.returncode == 3 and "HOST '0.0.0.0:8000' is not an address to listen on" in done.stderr


def test_a_killed_supervisors_empty_socket_directory_is_swept_by_the_next_one(tmp_path, monkeypatch):
    # Only empty directories of ours older than a minute: a live or starting supervisor's
    # (sockets in it, or just made) and anything else in the temporary directory stay.
    monkeypatch.setattr(serving.tempfile, "gettempdir", lambda: str(tmp_path))
    old = time.time() - 3600
    stale = tmp_path / f"{serving.SOCKET_DIR_PREFIX}stale"
    live = tmp_path / f"{serving.SOCKET_DIR_PREFIX}live"
    starting = tmp_path / f"{serving.SOCKET_DIR_PREFIX}starting"
    other = tmp_path / "something-else"
    for path in (stale, live, starting, other):
        path.mkdir()
    (live / "0.sock").write_text("")
    for path in (stale, live, other):
        os.utime(path, (old, old))
    serving._sweep_socket_dirs()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, starting, other))


def test_each_web_process_keeps_a_pooled_connection_per_thread_and_the_operators_own_sizes():
    model = serving.ServingModel(host="127.0.0.1", port=8000, processes=2, threads=6)
    env = model.environment({})
    assert (env["ZEROMEM_WEB_PROCESSES"], env["ZEROMEM_WEB_THREADS"], env["DB_POOL_MIN_SIZE"]) == ("2", "6", "6")
    assert serving.pool_max_size(6) >= 6
    assert model.environment({"DB_POOL_MIN_SIZE": "1"})["DB_POOL_MIN_SIZE"] == "1"
    cmd = model.command("python")
    # The ASGI router (/mcp + Django): the 6 request threads are its pool (zeromem/asgi.py).
    assert cmd[cmd.index("--workers") + 1] == "2" and cmd[cmd.index("--interface") + 1] == "asgi"
    assert cmd[-1] == "zeromem.asgi:application" and cmd[cmd.index("--blocking-threads") + 1] == "1"
    assert "--backpressure" not in cmd  # granian counts it in keep-alive connections: see serving.py
    wsgi = serving.ServingModel(host="127.0.0.1", port=8000, processes=2, threads=6, interface="wsgi").command("py")
    assert wsgi[wsgi.index("--blocking-threads") + 1] == "6" and wsgi[-1] == "zeromem.wsgi:application"


def test_the_router_runs_on_uvloop_where_installed_and_granian_loop_chooses_another(monkeypatch):
    """requirements.txt installs uvloop (not on Windows); the served command names it, so the
    loop measured (bench_serve) is the loop deployed, whatever granian's "auto" would pick."""
    monkeypatch.delenv("GRANIAN_LOOP", raising=False)
    cmd = serving.ServingModel(host="127.0.0.1", port=8000, processes=1, threads=2).command("python")
    expected = "asyncio" if sys.platform == "win32" else "uvloop"
    assert cmd[cmd.index("--loop") + 1] == expected
    monkeypatch.setenv("GRANIAN_LOOP", "asyncio")
    cmd = serving.ServingModel(host="127.0.0.1", port=8000, processes=1, threads=2).command("python")
    assert cmd[cmd.index("--loop") + 1] == "asyncio"


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
    cmd = server.granian_cmdline()
    environ = Path(f"/proc/{server.process.pid}/environ").read_bytes().split(b"\0")
    assert cmd[cmd.index(b"--workers") + 1] == b"2" and b"ZEROMEM_WEB_THREADS=3" in environ
    assert b"zeromem.asgi:application" in cmd
    deadline = time.monotonic() + 30
    while len(server.worker_pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(server.worker_pids()) == 2
    assert len(server.search_pids()) == 1  # the search tier's default on this machine's cores
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
    # On uvloop's event loop (zeromem/serving.py event_loop): its extension is loaded in the worker.
    (worker,) = server.worker_pids()
    assert "uvloop/loop." in Path(f"/proc/{worker}/maps").read_text()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_searches_are_ranked_by_the_search_processes_which_are_restarted_when_they_exit(served):
    tenant = make_tenant("serve-search")
    _key, raw = make_key(tenant)
    server = served("--processes", "1", "--threads", "2", "--search-processes", "2", DATABASE_URL=_database_url())
    (searchers := server.search_pids()).sort()
    assert len(searchers) == 2
    environ = Path(f"/proc/{server.worker_pids()[0]}/environ").read_bytes().split(b"\0")
    (tier_setting,) = [v for v in environ if v.startswith(b"ZEROMEM_SEARCH_TIER=")]
    sockets = tier_setting.split(b"=", 1)[1].split(b",")
    assert len(sockets) == 2 and all(Path(p.decode()).exists() for p in sockets)
    assert oct(Path(sockets[0].decode()).parent.stat().st_mode & 0o777) == "0o700"
    write = {"name": "memory_write", "arguments": {"key": "fact:serve:zebra", "value": "a zebra named Zed"}}
    assert _request(server.port, "POST", "/api/v1/tools/call", key=raw, body=write)[0] == 200
    search = {"name": "memory_search", "arguments": {"query": "zebra"}}

    def found() -> list[str]:
        # On a loaded machine a search may run out of its time and answer 503 search_timeout
        # with a retry_after, which tells a client to retry: so does this test (a few times).
        for _attempt in range(5):
            status, body = _request(server.port, "POST", "/api/v1/tools/call", key=raw, body=search)
            error = json.loads(body).get("error") or {} if status == 503 else {}
            if error.get("code") != "search_timeout":
                break
            time.sleep(error.get("retry_after", 1))
        assert status == 200, body
        return [r["key"] for r in json.loads(body)["results"]]

    assert found() == ["fact:serve:zebra"]
    # Its search process killed: the web process ranks meanwhile, the supervisor restarts it.
    mine = sockets[tenant.pk % 2].decode()
    (victim,) = [pid for pid in searchers if mine.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]
    os.kill(victim, 9)
    assert found() == ["fact:serve:zebra"]
    deadline = time.monotonic() + 30
    while (len(server.search_pids()) < 2 or victim in server.search_pids()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(server.search_pids()) == 2 and victim not in server.search_pids()
    assert found() == ["fact:serve:zebra"]
    assert "exited with -9: restarting it" in server.log()
    server.stop()
    assert not any(Path(p.decode()).exists() for p in sockets)  # its socket directory removed


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


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_one_callers_slow_requests_hold_its_share_of_the_threads_and_another_caller_is_answered(served):
    # 4 threads: caller A may hold 2 (zeromem/kit/fair_threads.py). A sends 5 writes of a row
    # held locked: 2 wait on the lock in threads, 3 wait for A's turn holding nothing, and
    # tenant B's reads are answered meanwhile (first come, first served, A's 5 took every thread).
    (_a, a_raw), (_b, b_raw) = _keyed_tenants("fair-a", "fair-b")
    server = served("--processes", "1", "--threads", "4", DATABASE_URL=_database_url())
    write = {"name": "memory_write", "arguments": {"key": "fact:fair:held", "value": {"n": 0}}}
    read = {"name": "memory_read", "arguments": {"key": "fact:fair:b"}}
    assert _request(server.port, "POST", "/api/v1/tools/call", key=a_raw, body=write)[0] == 200
    b_write = {"name": "memory_write", "arguments": {"key": "fact:fair:b", "value": {"n": 1}}}
    assert _request(server.port, "POST", "/api/v1/tools/call", key=b_raw, body=b_write)[0] == 200
    answers: list[int] = []

    def slow_write():
        answers.append(_request(server.port, "POST", "/api/v1/tools/call", key=a_raw, body=write, timeout=90)[0])

    def lock_waiters(locker) -> int:
        return locker.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).fetchone()[0]

    with psycopg.connect(_database_url().replace("postgres://", "postgresql://", 1)) as locker:
        locker.execute("SELECT id FROM memories_memory WHERE key = 'fact:fair:held' FOR UPDATE")
        held = [threading.Thread(target=slow_write, daemon=True) for _ in range(5)]
        for thread in held:
            thread.start()
        deadline = time.monotonic() + 30
        while lock_waiters(locker) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # time for more of A's writes to reach the lock, were they let in
        assert lock_waiters(locker) == 2, "caller A holds more than its share of the threads"
        for _ in range(3):
            assert _request(server.port, "POST", "/api/v1/tools/call", key=b_raw, body=read, timeout=10)[0] == 200
        assert answers == []
        locker.commit()
    for thread in held:
        thread.join(timeout=60)
    assert answers == [200] * 5  # A's waiting requests were answered once their turn came


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


def _race(port: int, key: str, n: int) -> list[int]:
    """``n`` tool calls released at once from ``n`` threads: their statuses."""
    gate = threading.Barrier(n)
    statuses: list[int] = []

    def one():
        gate.wait()
        statuses.append(_request(port, "POST", "/api/v1/tools/call", key=key, body=LIST, timeout=60)[0])

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    return sorted(statuses)


LIST = {"name": "memory_list", "arguments": {}}


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("store", ["database", "redis"])
def test_80_parallel_requests_to_several_processes_pass_a_limit_of_20_exactly_20_times(served, store):
    """Before: the file cache's read-then-write incr let 29-41 of 80 through."""
    redis_url = ""
    if store == "redis":
        redis_or_fail()
        redis_url = REDIS_TEST_URL
    tenant = make_tenant("serve-limit")
    _key, raw = make_key(tenant)
    server = served(
        "--processes", "2", "--threads", "8",
        DATABASE_URL=_database_url(), REDIS_URL=redis_url, ZEROMEM_RATE_LIMIT_PER_MINUTE="20",
    )  # fmt: skip
    while time.time() % 60 > 45:  # all 80 in one window
        time.sleep(0.5)
    statuses = _race(server.port, raw, 80)
    assert statuses.count(200) == 20 and statuses.count(429) == 60, statuses


def _send_until_answered(port: int, head: bytes, body_chunks) -> tuple[bytes, int]:
    """Send ``head`` then the body until the server answers or stops reading: (the
    answer's first bytes, body bytes sent by then — an upper bound of what it read)."""
    import select

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        sock.sendall(head)
        sent = 0
        sock.settimeout(5)  # a server that no longer reads makes sendall time out
        for chunk in body_chunks:
            if select.select([sock], [], [], 0)[0]:
                break  # answered
            try:
                sock.sendall(chunk)  # whole chunks: a partial one would break the framing
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        sock.settimeout(10)
        return sock.recv(65536), sent


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_100_mib_body_is_refused_with_413_before_it_is_read(served, framing):
    server = served("--processes", "1", "--threads", "2", DATABASE_URL="")
    total, piece = 100 * 1024 * 1024, 64 * 1024
    request = b"POST /api/v1/tools/call HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if framing == "chunked":
        head = request + b"Transfer-Encoding: chunked\r\n\r\n"
        chunks = (b"%x\r\n" % piece + b" " * piece + b"\r\n" for _ in range(total // piece))
    else:
        head = request + b"Content-Length: %d\r\n\r\n" % total
        chunks = (b" " * piece for _ in range(total // piece))
    answer, sent = _send_until_answered(server.port, head, chunks)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    # The cap is 1 MiB; what the socket took beyond it sits in kernel buffers, unread.
    assert sent < 8 * 1024 * 1024, sent


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_client_that_stops_sending_mid_body_is_answered_408_and_dropped(served, framing):
    # granian times out a request's headers, never its body: a client that sent part of a
    # 500 KB body and stopped was waited for until it closed its connection (140 s measured
    # with 1 KB sent), the request thread that read its body held all along.
    ((_tenant, key),) = _keyed_tenants("serve-stalled")
    server = served(
        "--processes", "1", "--threads", "2", DATABASE_URL=_database_url(), ZEROMEM_BODY_READ_TIMEOUT_SECONDS="1"
    )
    request = (
        b"POST /api/v1/tools/call HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer %s\r\n" % key.encode()
    )
    piece = b" " * 100_000
    if framing == "chunked":
        head, piece = request + b"Transfer-Encoding: chunked\r\n\r\n", b"%x\r\n%s\r\n" % (len(piece), piece)
    else:
        head = request + b"Content-Length: 500000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(head + piece)
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            answer += chunk
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b'"code":"body_timeout"' in answer and 0.9 < waited < 5, waited


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_client_trickling_its_body_under_the_silence_timeout_is_answered_408(served, framing):
    # The timeout was per message: a client sending 100 bytes every 0.5 s (timeout 1 s) was
    # read for as long as it kept that up (500 KB: 40 min), holding its budget. Now a body has
    # the timeout plus a second per ZEROMEM_BODY_READ_MIN_BYTES_PER_SECOND bytes received.
    server = served(
        "--processes", "1", "--threads", "2", DATABASE_URL="",
        ZEROMEM_BODY_READ_TIMEOUT_SECONDS="1", ZEROMEM_BODY_READ_MIN_BYTES_PER_SECOND="1000",
    )  # fmt: skip
    import select

    request = b"POST /api/v1/tools/call HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    piece = b" " * 100
    if framing == "chunked":
        head, piece = request + b"Transfer-Encoding: chunked\r\n\r\n", b"%x\r\n%s\r\n" % (len(piece), piece)
    else:
        head = request + b"Content-Length: 500000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(head + piece)
        while time.monotonic() - started < 10 and not select.select([sock], [], [], 0.5)[0]:
            sock.sendall(piece)
        waited = time.monotonic() - started
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b'"code":"body_timeout"' in answer and 1 < waited < 4, waited


class SlowReader(threading.Thread):
    """GET ``path`` and read the answer a few bytes at a time until told to stop."""

    def __init__(self, port: int, path: str, key: str):
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
        self.status = 0
        self.stop = threading.Event()

    def run(self):
        self.sock.sendall(self.request)
        head = self.sock.recv(64)
        self.status = int(head.split()[1]) if head else -1
        while not self.stop.is_set() and self.sock.recv(64):
            time.sleep(0.1)
        self.sock.close()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_20_slow_export_readers_of_one_tenant_leave_another_tenants_reads_without_a_503(served):
    """Before: 21 slow export readers held all pooled connections and every tenant got 503."""
    (busy, busy_key), (_other, other_key) = _keyed_tenants("serve-busy", "serve-other")
    with connection.cursor() as cursor:  # an export of ~15 MB, far more than socket buffers
        cursor.execute(
            "INSERT INTO audit_auditevent (uid, tenant_id, occurred_at, actor_kind, actor_id, actor_label, surface,"
            " action, target, subject, outcome, request_id, detail, digest, chain, redacted)"
            " SELECT gen_random_uuid(), %s, now(), 'system', '', 'system', 'job', 'memory.write',"
            " 'user:u' || g || ':preference', '', 'ok', '', '{}'::jsonb, repeat('0', 64), '', '{}'::jsonb"
            " FROM generate_series(1, 60000) g",
            [busy.pk],
        )
    server = served("--processes", "1", "--threads", "8", DATABASE_URL=_database_url())
    write = {"name": "memory_write", "arguments": {"key": "fact:other:1", "value": 1}}
    assert _request(server.port, "POST", "/api/v1/tools/call", key=other_key, body=write)[0] == 200

    readers = [SlowReader(server.port, "/api/v1/audit-events/export", busy_key) for _ in range(20)]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 30
        while any(r.status == 0 for r in readers) and time.monotonic() < deadline:
            time.sleep(0.1)
        statuses = sorted(r.status for r in readers)
        assert statuses.count(200) == 4 and statuses.count(429) == 16, statuses  # ZEROMEM_TENANT_MAX_CONCURRENT
        read = {"name": "memory_read", "arguments": {"key": "fact:other:1"}}
        answers = []

        def reads():
            for _ in range(10):
                answers.append(_request(server.port, "POST", "/api/v1/tools/call", key=other_key, body=read)[0])
                answers.append(
                    _request(server.port, "POST", "/api/v1/tools/call", key=other_key, body=SEARCH, timeout=30)[0]
                )

        threads = [threading.Thread(target=reads) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert answers == [200] * 60, answers
        assert all(r.is_alive() for r in readers if r.status == 200)  # still reading, slowly
    finally:
        for reader in readers:
            reader.stop.set()


SEARCH = {"name": "memory_search", "arguments": {"query": "fact"}}
