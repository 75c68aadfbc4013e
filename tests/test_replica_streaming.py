"""Read scaling against a REAL streaming replica (README "Running as a fleet", "Read scaling").

tests/test_fleet.py checks the router with a second alias on the same database; here the
replica is PostgreSQL's own streaming replication. The shared test server (127.0.0.1:5432)
refuses replication connections (its pg_hba.conf has no ``replication`` line, and changing
it is a reload the tests must not make), so this test starts a pair of its own with the
Debian binaries, as the ``postgres`` OS user when run as root: ``initdb`` a small primary
(its default pg_hba allows replication from loopback; ``wal_level=replica`` is the default),
migrate it (about 4 s), ``pg_basebackup -R --checkpoint=fast`` it into a replica (about 1 s)
and start both on free loopback ports (``ZEROMEM_TEST_PORTS`` when set), then ``serve`` on
the primary with ``DATABASE_REPLICA_URL`` on the replica: about 12 s in all.

With the replica's replay paused, a write is on the primary only: the read after it (a tool
call) sees it, while the audit review, its export and the tenant dashboard — the reads sent to
the replica — do not, until replay resumes and the replica catches up. Skipped, saying why,
where PostgreSQL's server binaries are not installed.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2
import psycopg
import pytest
from django.conf import settings

from tests.helpers import free_port
from zeromem.bench.server import start_server, stop_server

ROOT = Path(settings.BASE_DIR)
SETUP = """
from memories import services
from memories.models import Tenant
from zeromem.kernel.actors import Actor
from zeromem.kernel.scopes import TENANT_SCOPES
from django.contrib.auth import get_user_model
actor = Actor.system(job="tests")
tenant = services.tenant_create(actor=actor, slug="replica", name="Replica")
_key, raw = services.api_key_create(tenant=tenant, actor=actor, name="agent", scopes=list(TENANT_SCOPES))
get_user_model().objects.create_superuser("root", "root@example.com", "replica-pass-1")
print(tenant.pk, raw)
"""


def _bindir() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return str(Path(found[-1]).parent) if found and os.path.exists(Path(found[-1]).parent / "pg_basebackup") else None


class Pair:
    """A primary and its streaming replica, in a directory of their own."""

    def __init__(self, bindir: str):
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="zmrep-"))  # short: it holds the sockets
        self.primary_port = free_port()
        self.replica_port = free_port()
        while self.replica_port == self.primary_port:  # neither is bound until its server starts
            self.replica_port = free_port()
        self.started: list[Path] = []
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            shutil.chown(self.dir, "postgres")

    def run(self, *args: str, check: bool = True) -> None:
        command = [f"{self.bindir}/{args[0]}", *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 or not check, f"{' '.join(command)}:\n{done.stdout}\n{done.stderr}"

    def start(self, name: str, port: int) -> None:
        options = f"-p {port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        data = self.dir / name
        self.run("pg_ctl", "-D", str(data), "-o", options, "-l", str(self.dir / f"{name}.log"), "-w", "start")
        self.started.append(data)

    def url(self, port: int, db: str = "zm_replica") -> str:
        return f"postgres://postgres@127.0.0.1:{port}/{db}"

    def down(self) -> None:
        for data in reversed(self.started):
            self.run("pg_ctl", "-D", str(data), "-m", "immediate", "stop", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def pair():
    bindir = _bindir()
    if bindir is None:
        pytest.skip("PostgreSQL's server binaries (initdb, pg_basebackup) are not installed")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        pytest.skip("run as root without runuser: cannot start PostgreSQL as the postgres user")
    made = Pair(bindir)
    try:
        made.run("initdb", "-D", str(made.dir / "primary"), "-A", "trust", "-U", "postgres", "--no-sync")
        made.start("primary", made.primary_port)
        with psycopg.connect(made.url(made.primary_port, "postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE zm_replica")
        env = {**os.environ, "ZEROMEM_ENV": "development", "DATABASE_URL": made.url(made.primary_port)}
        env.pop("DATABASE_REPLICA_URL", None)
        for args in (["migrate", "-v0"], ["shell", "-c", SETUP]):
            done = subprocess.run(
                [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, done.stderr
        made.tenant_id, made.key = done.stdout.split()[-2:]
        made.run(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(made.primary_port), "-U", "postgres",
            "-D", str(made.dir / "replica"), "-R", "--no-sync", "--checkpoint=fast",
        )  # fmt: skip
        made.start("replica", made.replica_port)
        yield made
    finally:
        made.down()


def _replica(pair: Pair) -> psycopg.Connection:
    return psycopg.connect(pair.url(pair.replica_port), autocommit=True)


def _caught_up(pair: Pair, timeout: float = 20) -> None:
    with psycopg.connect(pair.url(pair.primary_port), autocommit=True) as primary, _replica(pair) as replica:
        target = primary.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if replica.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", [target]).fetchone()[0]:
                return
            time.sleep(0.1)
    raise AssertionError("the replica did not catch up")


@pytest.mark.postgres
def test_audit_review_export_and_dashboard_read_the_streaming_replica_and_a_read_after_write_does_not(pair):
    with _replica(pair) as replica:
        assert replica.execute("SELECT pg_is_in_recovery()").fetchone()[0]  # a standby, streaming
    with psycopg.connect(pair.url(pair.primary_port), autocommit=True) as primary:
        assert primary.execute("SELECT state FROM pg_stat_replication").fetchone()[0] == "streaming"
    server = start_server(
        database_url=pair.url(pair.primary_port),
        processes=1,
        threads=2,
        log=lambda _line: None,
        extra_env={"DATABASE_REPLICA_URL": pair.url(pair.replica_port), "REDIS_URL": "", "ZEROMEM_EMBEDDINGS": "off"},
    )
    base = f"http://127.0.0.1:{server['port']}"
    agent = httpx2.Client(base_url=base, headers={"Authorization": f"Bearer {pair.key}"}, timeout=30)
    staff = httpx2.Client(base_url=base, timeout=30, follow_redirects=False)
    try:
        login = staff.get("/admin/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.text).group(1)
        form = {"username": "root", "password": "replica-pass-1", "csrfmiddlewaretoken": token, "next": "/admin/"}
        assert staff.post("/admin/login/", data=form).status_code == 302

        def call(name: str, **arguments) -> dict:
            answer = agent.post("/api/v1/tools/call", json={"name": name, "arguments": arguments})
            assert answer.status_code == 200, answer.text
            return answer.json()

        def views() -> tuple[set, set, str]:
            listed = agent.get("/api/v1/audit-events", params={"limit": 200})
            exported = agent.get("/api/v1/audit-events/export", params={"format": "jsonl"})
            dashboard = staff.get(f"/admin/memories/tenant/{pair.tenant_id}/dashboard/")
            assert (listed.status_code, exported.status_code, dashboard.status_code) == (200, 200, 200)
            in_list = {e["target"] for e in listed.json()["results"] if e["action"] == "memory.write"}
            rows = [json.loads(line) for line in exported.text.splitlines()]
            in_export = {e["target"] for e in rows if e.get("action") == "memory.write"}
            return in_list, in_export, dashboard.text

        call("memory_write", key="fact:before", value="seen everywhere", ttl_seconds=3600)
        _caught_up(pair)
        with _replica(pair) as replica:
            replica.execute("SELECT pg_wal_replay_pause()")
            # The write below reaches the primary only.
            assert call("memory_write", key="fact:lagging", value="on the primary", ttl_seconds=3600)["created"]
            # A read after the write goes to the primary: it sees it at once.
            assert call("memory_read", key="fact:lagging")["value"] == "on the primary"
            in_list, in_export, dashboard = views()
            assert "fact:before" in in_list and "fact:before" in in_export and "fact:before" in dashboard
            # The audit review, its export and the dashboard read the paused replica: not there yet.
            assert "fact:lagging" not in in_list and "fact:lagging" not in in_export and "fact:lagging" not in dashboard
            replica.execute("SELECT pg_wal_replay_resume()")
        _caught_up(pair)
        in_list, in_export, dashboard = views()
        assert "fact:lagging" in in_list and "fact:lagging" in in_export and "fact:lagging" in dashboard
    finally:
        agent.close()
        staff.close()
        stop_server(server)
