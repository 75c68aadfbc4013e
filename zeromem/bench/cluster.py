"""A PostgreSQL cluster a benchmark may stop hard (``manage.py bench_load``'s fault phase):
created here with ``initdb`` in a temporary directory and deleted at the end, or an existing
one the operator names. Never the shared server."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg
from django.core.management.base import CommandError

from zeromem.bench.harness import LOOPBACK
from zeromem.bench.server import free_port

LOAD_DB = "zeromem_load"


class PrivateCluster:
    """A PostgreSQL cluster on 127.0.0.1:``port``: created here (initdb into a temp dir,
    deleted at the end) or an existing ``datadir`` given by the operator (left in place)."""

    def __init__(self, *, bindir: str, log, datadir: str | None = None, port: int | None = None):
        self.bindir = Path(bindir)
        self.log = log
        self.own = datadir is None
        self.port = port or free_port()
        self.tmp = Path(tempfile.mkdtemp(prefix="zeromem-load-pg-")) if self.own else None
        self.datadir = self.tmp / "data" if self.own else Path(datadir)
        self.logfile = (self.tmp or Path(tempfile.gettempdir())) / f"zeromem-load-pg-{self.port}.log"
        self.socket_dir = self.tmp or Path(tempfile.gettempdir())
        # PostgreSQL refuses to run as root: as root, every pg_ctl/initdb runs as "postgres".
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @property
    def url(self) -> str:
        return f"postgres://postgres@{LOOPBACK}:{self.port}/{LOAD_DB}"

    def conninfo(self, dbname: str = LOAD_DB) -> str:
        return f"host={LOOPBACK} port={self.port} user=postgres dbname={dbname} connect_timeout=3"

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        cmd = [*self.as_user, str(self.bindir / tool), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise CommandError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")

    def create(self) -> None:
        if not self.own:
            return
        if self.as_user:
            shutil.chown(self.tmp, user="postgres", group="postgres")
        self._run("initdb", "-D", str(self.datadir), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses={LOOPBACK} -k {self.socket_dir}"
        self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.logfile), "-o", options, "-w", "-t", "60", "start")

    def stop_immediate(self) -> None:
        self._run("pg_ctl", "-D", str(self.datadir), "-m", "immediate", "-w", "-t", "60", "stop")

    def destroy(self) -> None:
        if self.own:
            try:
                self._run("pg_ctl", "-D", str(self.datadir), "-m", "fast", "-w", "-t", "60", "stop")
            except (CommandError, subprocess.TimeoutExpired):
                pass  # not running
            shutil.rmtree(self.tmp, ignore_errors=True)

    def create_database(self) -> None:
        with psycopg.connect(self.conninfo("postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{LOAD_DB}"')
            conn.execute(f'CREATE DATABASE "{LOAD_DB}"')


def find_bindir() -> str:
    """Where PostgreSQL's server binaries are: beside ``pg_ctl`` on PATH, or Debian's newest."""
    pg_ctl = shutil.which("pg_ctl")
    if pg_ctl:
        return str(Path(os.path.realpath(pg_ctl)).parent)
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if found:
        return str(found[-1].parent)
    raise CommandError("pg_ctl not found: install PostgreSQL's server package or pass --pg-bindir")
