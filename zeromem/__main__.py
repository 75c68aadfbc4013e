"""The README's commands, runnable with nothing but Python 3.11+:

    python3 -m zeromem up     # venv, install, migrate, demo tenant + admin + key, web + workers
    python3 -m zeromem test   # venv, install, run the whole test suite
    python3 -m zeromem serve  # venv, install, the production web tier only (no migrate, no demo)
                              #   [--processes N] [--threads N] [--host H] [--port P]
    python3 -m zeromem mcp --url https://host/mcp --key zm_...
                              # MCP over stdio, forwarded to a ZeroMem server's /mcp (no database)

Standard library only: this runs before any dependency is installed.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import venv
from pathlib import Path

from zeromem import serving

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("ZEROMEM_VENV", ROOT / ".venv"))
PY = VENV / "bin" / "python"
REQUIREMENTS = ROOT / "requirements.txt"
# The browser tests (tests/browser.py) drive Debian's Chromium: Playwright cannot download
# its own browser builds here, so the test command installs the distribution's package.
CHROMIUM = Path(os.environ.get("ZEROMEM_CHROMIUM", "/usr/bin/chromium"))


def say(msg: str) -> None:
    print(f"[zeromem] {msg}", flush=True)


def ensure_venv() -> None:
    """Create .venv and install requirements.txt, skipping the install when unchanged."""
    if not PY.exists():
        say(f"creating virtualenv in {VENV}")
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp = VENV / ".requirements.sha256"
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if not stamp.exists() or stamp.read_text() != digest:
        say("installing requirements.txt")
        subprocess.run([PY, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        subprocess.run([PY, "-m", "pip", "install", "-q", "-r", REQUIREMENTS], check=True)
        stamp.write_text(digest)


def ensure_debian_package(binary: Path, packages: list[str], purpose: str) -> None:
    """Install Debian ``packages`` with apt-get when ``binary`` is missing (non-interactive;
    sudo -n when not root). When it cannot be installed the tests still run: those that need
    it then fail with a message naming the missing binary, they never skip silently."""
    if binary.exists():
        return
    apt_get = shutil.which("apt-get")
    if apt_get is None:
        say(f"{binary} is missing and there is no apt-get to install it: the {purpose} will fail")
        return
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
    say(f"{binary} is missing: installing Debian's {packages[0]} package with apt-get (for the {purpose})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Wait for another apt/dpkg run to finish rather than failing on its lock.
    apt = [*prefix, apt_get, "-q", "-y", "-o", "DPkg::Lock::Timeout=600"]
    for step in (["update"], ["install", "--no-install-recommends", *packages]):
        result = subprocess.run([*apt, *step], env=env, capture_output=True, text=True)
        if result.returncode != 0:
            say(f"apt-get {step[0]} failed: the {purpose} will fail\n{result.stderr.strip()[-600:]}")
            return
    if not binary.exists():
        say(f"apt-get installed {packages[0]} but {binary} is still missing: the {purpose} will fail")
        return
    say(f"installed {binary}")


# The PgBouncer tests (tests/test_fleet.py) start Debian's pgbouncer in transaction mode (the
# package's own service is not started: the tests start theirs).
PGBOUNCER = Path(os.environ.get("ZEROMEM_PGBOUNCER_BIN", "/usr/sbin/pgbouncer"))


def write_dev_env() -> None:
    """A git-ignored .env so plain `python manage.py ...` uses the same dev settings."""
    env_file = ROOT / ".env"
    if not env_file.exists():
        env_file.write_text(f"ZEROMEM_ENV=development\nSECRET_KEY={secrets.token_urlsafe(48)}\n")
        say("wrote .env (development settings, git-ignored)")


def manage(*args: str, env: dict | None = None) -> None:
    subprocess.run([PY, "manage.py", *args], cwd=ROOT, check=True, env=env)


def web_tier(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]] | None:
    """The web server's command line and environment (zeromem/serving.py), once the database
    connections it may open fit (None, after saying why, when they do not)."""
    model = serving.parse(argv, env)
    problem = serving.address_problem(model.host, model.port)
    if problem:
        print(f"[zeromem] refusing to start: {problem}", file=sys.stderr, flush=True)
        return None
    web_env = model.environment(env)
    serving.reset_metrics_dir(web_env["PROMETHEUS_MULTIPROC_DIR"])
    if subprocess.run([PY, "-m", "zeromem.serving", "check"], cwd=ROOT, env=web_env).returncode != 0:
        return None
    say(
        f"web server: granian ASGI (/mcp + Django), {model.processes} processes × {model.threads} threads, "
        f"{model.search_processes} search process(es), http://{model.host}:{model.port}/"
    )
    return model.run_command(str(PY)), web_env


def serve(argv: list[str]) -> int:
    """The production web tier from the environment's settings; migrates nothing."""
    ensure_venv()
    web = web_tier(argv, dict(os.environ))
    if web is None:
        return 3
    cmd, env = web
    os.chdir(ROOT)
    os.execve(cmd[0], cmd, env)  # the tier's supervisor replaces this process: signals reach it directly


def up(argv: list[str]) -> int:
    ensure_venv()
    write_dev_env()
    env = {**os.environ, "ZEROMEM_ENV": os.environ.get("ZEROMEM_ENV", "development")}
    manage("migrate", "--noinput", env=env)
    manage("zeromem_schedules", env=env)
    model = serving.parse(argv, env)  # the links demo_setup prints name the address served
    manage("demo_setup", env={**env, "HOST": model.host, "PORT": str(model.port)})
    web = web_tier(argv, env)
    if web is None:
        return 3
    web_cmd, web_env = web
    procs = [
        subprocess.Popen(web_cmd, cwd=ROOT, env=web_env),
        subprocess.Popen([PY, "manage.py", "qcluster"], cwd=ROOT, env=env),
    ]
    say("web server and django-q2 workers running; Ctrl-C stops both")

    def stop(*_):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    stop()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
    return max((p.returncode or 0) for p in procs)


def test(argv: list[str]) -> int:
    ensure_venv()
    ensure_debian_package(CHROMIUM, ["chromium", "fonts-liberation"], "browser tests")
    ensure_debian_package(PGBOUNCER, ["pgbouncer"], "PgBouncer tests")
    env = {**os.environ, "ZEROMEM_ENV": "development"}
    db = env.get("DATABASE_URL", "")
    if db:
        # When a database is named, its server must answer: CI fails here rather than skipping.
        # (The server, not the database: pytest-django creates test_<name> from the
        # maintenance database, so <name> itself need not exist.)
        probe = (
            "import os, psycopg; from psycopg.conninfo import make_conninfo; "
            "psycopg.connect(make_conninfo(os.environ['DATABASE_URL'], dbname='postgres'), connect_timeout=5).close()"
        )
        check = subprocess.run(
            [PY, "-c", probe],
            env=env,
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            say(f"DATABASE_URL is set but the database is unreachable:\n{check.stderr.strip()[-600:]}")
            return 2
        say(f"database: PostgreSQL ({db.rsplit('@', 1)[-1]})")
    else:
        say("database: SQLite (set DATABASE_URL=postgres://... to test on PostgreSQL; CI does)")
    return subprocess.run([PY, "-m", "pytest", *argv], cwd=ROOT, env=env).returncode


def mcp(argv: list[str]) -> int:
    """The stdio bridge (memories/mcp/bridge.py). Its stdout is the MCP wire: while the venv
    is checked (and installed, the first time) anything printed goes to stderr instead."""
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        ensure_venv()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    cmd = [str(PY), "-m", "memories.mcp.bridge", *argv]
    os.chdir(ROOT)
    os.execv(cmd[0], cmd)


COMMANDS = {"up": up, "test": test, "serve": serve, "mcp": mcp}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__)
        return 64
    return COMMANDS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
