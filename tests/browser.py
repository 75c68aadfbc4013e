"""Browser-test fixtures: Playwright's sync API driving Debian's Chromium against ``live_server``.

Loaded as a pytest plugin (``-p tests.browser`` in pyproject.toml), so every test module can ask
for ``browser_page``; a test that does is marked ``browser`` automatically (``-m "not browser"``
leaves them out). Playwright cannot download its own browser builds here, so it launches
``/usr/bin/chromium`` (``ZEROMEM_CHROMIUM`` overrides; ``python3 -m zeromem test`` installs
Debian's package when it is missing). A missing browser fails the test, it never skips: CI
must not go green without having run them.

Screenshots go to ``test-artifacts/<test name>/`` (git-ignored): the ``screenshot`` fixture
takes named ones, and every browser test leaves a ``final.png`` of the page as it ended,
pass or fail.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("ZEROMEM_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
# Headless, and quiet: no first-run UI, no background fetches or update checks (there is no
# network to reach), no GPU in a container, no sandbox (we run as root).
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DEFAULT_TIMEOUT_MS = 15_000


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "browser_page" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)


def _artifact_dir(request) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid.split("::", 1)[-1])
    folder = ARTIFACTS / f"{request.node.module.__name__.rsplit('.', 1)[-1]}" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def browser_artifacts(request) -> Path:
    """This test's folder under test-artifacts/ (emptied of older screenshots first)."""
    folder = _artifact_dir(request)
    for old in folder.glob("*.png"):
        old.unlink()
    return folder


@pytest.fixture
def browser_page(request, transactional_db, live_server, monkeypatch, tmp_path, browser_artifacts):
    """A Playwright ``Page`` in a fresh headless Chromium profile; ``live_server.url`` serves the app.

    ``transactional_db``: the live server answers from another thread on its own connection,
    so the test's data must be committed (not held in the test's rolled-back transaction);
    tables are flushed after the test. Works on PostgreSQL and SQLite (pytest-django shares
    the in-memory SQLite connection with the server thread).
    """
    if not CHROMIUM.exists():
        pytest.fail(
            f"browser tests need Chromium at {CHROMIUM}: run them with `python3 -m zeromem test`, which "
            "installs Debian's chromium package, or `apt-get install chromium` (or set ZEROMEM_CHROMIUM)",
            pytrace=False,
        )
    from django.db import connections
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an asyncio event loop in this thread (switching to it with
    # greenlets), and that loop stays registered as "running" between calls. Django's
    # async-unsafe guard sees it and refuses every ORM call the test body makes while the
    # browser is open (SynchronousOnlyOperation), although the code really runs synchronously
    # in this thread and no coroutine touches the connection. So the guard is lifted here,
    # for this fixture's lifetime only; the live server thread is unaffected (no loop there).
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            user_data_dir=str(tmp_path / "chromium-profile"),  # fresh per test
            executable_path=str(CHROMIUM),
            headless=True,
            args=LAUNCH_ARGS,
            viewport={"width": 1280, "height": 800},
        )
        page = context.pages[0] if context.pages else context.new_page()
        page.set_default_timeout(DEFAULT_TIMEOUT_MS)
        # Whatever the Content-Security-Policy blocked (an inline script or style, a foreign
        # asset) is reported on the console: a page that needs it is broken under the policy.
        blocked: list[str] = []
        page.on("console", lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None)
        try:
            yield page
            assert not blocked, f"the Content-Security-Policy blocked: {blocked}"
        finally:
            _save(page, browser_artifacts / "final.png")
            context.close()
            # While that loop is registered, asgiref's Local (Django's connection handler)
            # also keeps a separate, context-local set of connections: the ones the test body
            # opened are invisible to Django's own teardown and would stay open (on
            # PostgreSQL, DROP DATABASE then fails: "being accessed by other users"). Close
            # them here, in the same context, before the loop goes away.
            connections.close_all()


def _save(page, path: Path) -> None:
    try:
        page.screenshot(path=str(path), full_page=True)
    except Exception:  # a crashed page must not hide the test's own failure
        pass


@pytest.fixture
def screenshot(browser_page, browser_artifacts):
    """``screenshot("after-login")`` saves ``test-artifacts/<module>/<test>/NN-after-login.png``."""
    taken = []

    def take(name: str) -> Path:
        taken.append(name)
        path = browser_artifacts / f"{len(taken):02d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.png"
        browser_page.screenshot(path=str(path), full_page=True)
        return path

    return take
