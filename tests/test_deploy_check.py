"""``manage.py check --deploy`` with the production values the README names reports nothing.

Run as a separate process: settings are read once per process, and these are not the test
run's (development) settings. The environment is built from scratch, so nothing of the
shell's (DEBUG, ZEROMEM_ENV ...) leaks in.
"""

import os
import secrets
import subprocess
import sys

from django.conf import settings

PRODUCTION = {
    "ZEROMEM_ENV": "production",  # the default; explicit so a developer's .env cannot change it
    "SECRET_KEY": secrets.token_urlsafe(50),
    "ALLOWED_HOSTS": "zeromem.example.com",
    "DATABASE_URL": "postgres://zeromem:secret@db.example.com:5432/zeromem",
}


def _check_deploy(**overrides) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", **PRODUCTION, **overrides}
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
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
