"""``manage.py check --deploy`` with the production values the README names reports nothing.

Run as a separate process: settings are read once per process, and these are not the test
run's (development) settings. The environment is built from scratch, so nothing of the
shell's (DEBUG, ZEROMEM_ENV ...) leaks in.
"""

import base64
import os
import secrets
import subprocess
import sys

import pytest
from django.conf import settings

PRODUCTION = {
    "ZEROMEM_ENV": "production",  # the default; explicit so a developer's .env cannot change it
    "SECRET_KEY": secrets.token_urlsafe(50),
    "ALLOWED_HOSTS": "zeromem.example.com",
    "DATABASE_URL": "postgres://zeromem:secret@db.example.com:5432/zeromem",
    "ZEROMEM_AUDIT_KEY": secrets.token_urlsafe(50),
    "ZEROMEM_MASTER_KEYS": base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),
}


def _check_deploy(*args, without=(), **overrides) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", **PRODUCTION, **overrides}
    for name in without:
        env.pop(name)
    return subprocess.run(
        [sys.executable, "manage.py", *(args or ("check", "--deploy", "--fail-level", "WARNING"))],
        cwd=settings.BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy_with_production_values_reports_no_issues():
    done = _check_deploy()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues (0 silenced)." in done.stdout


def test_check_deploy_fails_when_a_production_setting_is_insecure():
    # The same check sees a bad value: DEBUG on in production is security.W018.
    done = _check_deploy(DEBUG="true")
    assert done.returncode != 0
    assert "security.W018" in done.stdout + done.stderr


def test_check_deploy_warns_when_the_audit_key_is_derived_from_the_secret_key():
    done = _check_deploy(without=["ZEROMEM_AUDIT_KEY"])
    assert done.returncode != 0
    assert "zeromem.W001" in done.stdout + done.stderr and "ZEROMEM_AUDIT_KEY is not set" in done.stderr


def test_check_deploy_warns_on_development_mode_with_a_production_database():
    done = _check_deploy(ZEROMEM_ENV="development")
    assert done.returncode != 0
    assert "zeromem.W002" in done.stdout + done.stderr


@pytest.mark.skipif((settings.BASE_DIR / ".env").exists(), reason="a .env (from `up`) sets the mode")
def test_manage_py_refuses_a_production_database_without_a_secret_key():
    # Once it fell back to development mode, with a public SECRET_KEY and audit key.
    done = _check_deploy("check", without=["ZEROMEM_ENV", "SECRET_KEY", "ZEROMEM_AUDIT_KEY"])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "DATABASE_URL is set but SECRET_KEY is not" in done.stderr
    assert "System check" not in done.stdout


@pytest.mark.skipif((settings.BASE_DIR / ".env").exists(), reason="a .env (from `up`) sets the mode")
def test_manage_py_on_a_bare_checkout_still_runs_in_development_mode():
    done = _check_deploy("check", without=["ZEROMEM_ENV", "SECRET_KEY", "ZEROMEM_AUDIT_KEY", "DATABASE_URL"])
    assert done.returncode == 0, done.stdout + done.stderr


def test_production_allowed_hosts_default_has_no_testserver():
    done = _check_deploy(
        "shell", "-c", "from django.conf import settings; print(settings.ALLOWED_HOSTS)", without=["ALLOWED_HOSTS"]
    )
    assert done.returncode == 0, done.stderr
    assert "testserver" not in done.stdout and "localhost" in done.stdout


def test_production_refuses_to_start_without_master_keys():
    done = _check_deploy("check", without=["ZEROMEM_MASTER_KEYS"])
    assert done.returncode != 0
    assert "zeromem.E010" in done.stderr and "ZEROMEM_MASTER_KEYS is not set" in done.stderr


def test_a_malformed_master_key_is_refused_naming_the_setting():
    done = _check_deploy("check", ZEROMEM_MASTER_KEYS="not-a-key")
    assert done.returncode != 0
    assert "zeromem.E011" in done.stderr and "ZEROMEM_MASTER_KEYS[0]" in done.stderr


@pytest.mark.postgres
@pytest.mark.django_db
def test_autovacuum_off_is_a_deploy_warning_naming_the_database():
    """W003 follows the server's own `autovacuum` setting (read here, apart from the check)."""
    from django.db import connection

    from zeromem.kernel.checks import autovacuum_on

    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        (setting,) = cursor.fetchone()
    found = autovacuum_on(None, databases=["default"])
    if setting == "on":
        assert found == []
    else:
        assert [(w.id, w.obj) for w in found] == [("zeromem.W003", "default")]
        assert "autovacuum is off" in found[0].msg
    assert autovacuum_on(None, databases=[]) == []  # no database named: nothing is asked


@pytest.mark.parametrize(
    "name, value, says",
    [
        # Once a ValueError naming neither the variable nor where it came from.
        ("ZEROMEM_RATE_LIMIT_PER_MINUTE", "6k", "ZEROMEM_RATE_LIMIT_PER_MINUTE cannot be read"),
        ("DATABASE_URL", "postgres://zeromem@db:54x2/zeromem", "DATABASE_URL is not a database URL"),
        # Once accepted: 0 days made the daily audit purge delete every sealed event.
        ("ZEROMEM_AUDIT_RETENTION_DAYS", "0", "ZEROMEM_AUDIT_RETENTION_DAYS must be a number of at least 1"),
        # Once accepted: 0 turned the searches' statement_timeout off; negative, every search a 500.
        ("ZEROMEM_SEARCH_TIMEOUT_MS", "0", "ZEROMEM_SEARCH_TIMEOUT_MS must be a number of at least 1"),
        ("ZEROMEM_MAX_BODY_BYTES", "-1", "ZEROMEM_MAX_BODY_BYTES must be a number of at least 1"),
        ("DB_POOL_TIMEOUT", "0", "DB_POOL_TIMEOUT must be a number of at least"),
        # A body at the cap would never fit the read-ahead budget: every one refused 503.
        ("ZEROMEM_BODY_READ_AHEAD_BYTES", "1000", "ZEROMEM_BODY_READ_AHEAD_BYTES (1000) must be at least"),
        ("ZEROMEM_BODY_READ_TIMEOUT_SECONDS", "0", "ZEROMEM_BODY_READ_TIMEOUT_SECONDS must be a number of at least"),
        # A caller's share under the cap: its every body at the cap refused 503; over the budget: no share.
        ("ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES", "1000", "ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES (1000) must be"),
        ("ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES", "99999999999", "(99999999999) must be from"),
        ("ZEROMEM_BODY_READ_MIN_BYTES_PER_SECOND", "0", "READ_MIN_BYTES_PER_SECOND must be a number of at least 1"),
        # Once unbounded: a day's cache kept a shredded data key (a forget) or a revoked API key
        # working in every other process for a day.
        ("ZEROMEM_DATA_KEY_CACHE_SECONDS", "86400", "ZEROMEM_DATA_KEY_CACHE_SECONDS must be at most 300"),
        ("ZEROMEM_API_KEY_CACHE_SECONDS", "301", "ZEROMEM_API_KEY_CACHE_SECONDS must be at most 300"),
        ("Q_RETRY", "300", "Q_RETRY (300) must exceed Q_TIMEOUT (300)"),
        # Once accepted: a slow LLM endpoint got the worker killed mid-attempt, again and again.
        ("ZEROMEM_LLM_TIMEOUT_SECONDS", "200", "ZEROMEM_LLM_TIMEOUT_SECONDS (200) must be at most half of Q_TIMEOUT"),
        ("DB_POOL_MAX_SIZE", "1", "DB_POOL_MAX_SIZE (1) is below DB_POOL_MIN_SIZE (2)"),
        # Once read as False: a typo switched HTTPS redirects off.
        ("SECURE_SSL_REDIRECT", "ture", "SECURE_SSL_REDIRECT cannot be read: 'ture' is not a yes/no value"),
        # Once read as the other choice: "of" left the model on, "wieghted" meant rrf.
        ("ZEROMEM_EMBEDDINGS", "of", "ZEROMEM_EMBEDDINGS must be one of on, off, not 'of'"),
        ("ZEROMEM_SEMANTIC_FUSION", "wieghted", "ZEROMEM_SEMANTIC_FUSION must be one of weighted, rrf"),
        ("ZEROMEM_LOG_FORMAT", "jsno", "ZEROMEM_LOG_FORMAT must be one of text, json"),
        ("ZEROMEM_PURGE_WAL_COMPRESSION", "zstandard", "ZEROMEM_PURGE_WAL_COMPRESSION must be one of auto, off"),
    ],
)
def test_a_setting_at_a_worst_value_stops_the_start_naming_the_variable(name, value, says):
    done = _check_deploy("check", **{name: value})
    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr and says in done.stderr, done.stderr[-800:]
