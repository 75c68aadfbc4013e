"""The three entry points — ``manage.py``, ``zeromem/asgi.py`` (what ``python3 -m zeromem
serve`` serves) and ``zeromem/wsgi.py`` — and which mode they start in (security issue,
finding 7: fail closed).

- A bare checkout (no ``.env``, no ``ZEROMEM_ENV``, ``SECRET_KEY`` or ``DATABASE_URL``) is a
  developer's: ``manage.py`` runs there in development mode, on SQLite.
- ``ZEROMEM_ENV=development`` runs every entry point in development mode, on SQLite when
  there is no ``DATABASE_URL``.
- Anything else is production, which needs ``SECRET_KEY``: a production-looking environment
  (a ``DATABASE_URL``) without it is refused, naming the setting, by all three — never a
  silent fallback to development's public key (from which the audit key is derived).
  The ASGI and WSGI entry points never fall back, not even on a bare checkout.

Each runs in a subprocess with an environment built from scratch (settings are read once per
process); ``/healthz`` answers through the entry point's own ``application`` object and names
the database vendor it reached.
"""

import os
import subprocess
import sys

import pytest
from django.conf import settings

pytestmark = pytest.mark.skipif(
    (settings.BASE_DIR / ".env").exists(), reason="a .env (from `up`) sets the mode of this checkout"
)

PRODUCTION_DATABASE = "postgres://zeromem:secret@db.example.com:5432/zeromem"

# GET /healthz through zeromem.wsgi.application or zeromem.asgi.application; prints
# "<status> <body>".
PROBE = """
import asyncio, sys
from wsgiref.util import setup_testing_defaults

if sys.argv[1] == "wsgi":
    from zeromem.wsgi import application

    environ = {"PATH_INFO": "/healthz"}
    setup_testing_defaults(environ)
    environ["HTTP_HOST"] = "localhost"
    started = []
    body = b"".join(application(environ, lambda status, headers, exc_info=None: started.append(status)))
    print(started[0].split()[0], body.decode())
else:
    from zeromem.asgi import application

    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": "/healthz", "raw_path": b"/healthz", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"localhost")], "server": ("localhost", 80), "client": ("127.0.0.1", 50000),
    }
    asyncio.run(application(scope, receive, send))
    print(sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]).decode())
"""


def _run(argv: list[str], tmp_path, **environment) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "ZEROMEM_VAR_DIR": str(tmp_path / "var"),  # the SQLite file, if any, lands here
        "ZEROMEM_EMBEDDINGS": "off",  # no model load in a process that answers one request
        **environment,
    }
    return subprocess.run(
        [sys.executable, *argv], cwd=settings.BASE_DIR, env=env, capture_output=True, text=True, timeout=120
    )


def _serve(entry: str, tmp_path, **environment) -> subprocess.CompletedProcess:
    return _run(["-c", PROBE, entry], tmp_path, PYTHONPATH=str(settings.BASE_DIR), **environment)


MODE = "from django.conf import settings as s; print(s.DEVELOPMENT, s.DATABASES['default']['ENGINE'], s.SECRET_KEY[:3])"


def test_manage_py_on_a_bare_checkout_runs_in_development_mode_on_sqlite(tmp_path):
    done = _run(["manage.py", "shell", "--no-imports", "-c", MODE], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "django.db.backends.sqlite3", "dev"]
    assert (tmp_path / "var").is_dir()


@pytest.mark.parametrize("entry", ["wsgi", "asgi"])
def test_asgi_and_wsgi_serve_in_development_mode_on_sqlite(entry, tmp_path):
    done = _serve(entry, tmp_path, ZEROMEM_ENV="development")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == '200 {"status": "ok", "database": "sqlite"}'


@pytest.mark.parametrize(
    "environment",
    [
        pytest.param({}, id="bare checkout"),
        pytest.param({"DATABASE_URL": PRODUCTION_DATABASE}, id="production database"),
        pytest.param({"DATABASE_URL": PRODUCTION_DATABASE, "ZEROMEM_ENV": "production"}, id="production named"),
    ],
)
@pytest.mark.parametrize("entry", ["wsgi", "asgi"])
def test_asgi_and_wsgi_never_fall_back_to_development(entry, environment, tmp_path):
    # No SECRET_KEY and no ZEROMEM_MASTER_KEYS: production refuses at settings, before any
    # database connection or request.
    done = _serve(entry, tmp_path, **environment)
    assert done.returncode != 0 and done.stdout == ""
    assert "ImproperlyConfigured: Set the SECRET_KEY environment variable" in done.stderr


def test_manage_py_with_a_production_database_and_no_secret_key_refuses_naming_it(tmp_path):
    done = _run(["manage.py", "shell", "--no-imports", "-c", MODE], tmp_path, DATABASE_URL=PRODUCTION_DATABASE)
    assert done.returncode == 2 and done.stdout == ""
    assert "DATABASE_URL is set but SECRET_KEY is not. Set SECRET_KEY" in done.stderr


def test_manage_py_in_production_mode_without_a_secret_key_refuses_naming_it(tmp_path):
    done = _run(["manage.py", "shell", "--no-imports", "-c", MODE], tmp_path, ZEROMEM_ENV="production")
    assert done.returncode != 0 and done.stdout == ""
    assert "ImproperlyConfigured: Set the SECRET_KEY environment variable" in done.stderr
