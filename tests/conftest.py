"""Shared fixtures: three tenants, keys with different powers, and API clients.

The fixtures build their data with tests/factories.py; test modules import helpers from
there, never from this file. Tests run against the real database (PostgreSQL in CI, SQLite on
a bare machine); only the outside world (an LLM endpoint, the clock) is ever faked.
"""

from datetime import timedelta

import pytest
from django.db import connection
from django.db.backends.signals import connection_created
from django.utils import timezone

from memories import services
from tests.factories import SYSTEM, anonymous_client, make_keyed_client, make_tenant
from tests.helpers import audit_tables_may_be_flushed

# Transactional tests end with `flush`, which the audit tables refuse unless each session says
# so (tests/helpers.py audit_tables_may_be_flushed).
connection_created.connect(audit_tables_may_be_flushed)


@pytest.fixture(autouse=True)
def _isolated_cache(settings):
    # Each test gets its own cache, never the dev server's; rate-limit counters and tenant
    # slots live in the test database (rolled back with it) unless a test opts into Redis
    # (tests/helpers.py REDIS_TEST_URL), whatever REDIS_URL the shell has.
    settings.ZEROMEM_REDIS_URL = ""
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "tests"}}
    from django.core.cache import cache

    cache.clear()


@pytest.fixture(autouse=True)
def _no_search_budget(settings):
    # A tenant's search time budget (memories/services/search_budget.py) depends on how fast
    # this machine searches: off here, so that a test's searches in a row are never refused on
    # a slow machine. tests/test_search_budget.py turns it on; servers started as processes
    # (test_serve.py) run with the default.
    settings.ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND = 0


@pytest.fixture(autouse=True)
def _fresh_key_cache():
    # Each test starts with no API key verified by an earlier one (their rows are gone).
    # Nor with data keys unwrapped by an earlier one (SQLite reuses rolled-back row ids).
    from memories import keyring
    from memories.services import key_cache, last_seen

    key_cache.forget()
    keyring.forget_cache()
    last_seen.clear()  # nor with memories an earlier test read or wrote
    yield
    key_cache.forget()
    keyring.forget_cache()


@pytest.fixture(autouse=True)
def _token_usage_written_at_once(settings):
    # Tool responses write their tokens-returned totals at once (inside the test's
    # transaction), so none is left pending for a tenant an earlier test rolled back.
    from memories.services import usage

    settings.ZEROMEM_USAGE_FLUSH_SECONDS = 0
    usage.discard_pending()


@pytest.fixture(autouse=True)
def _lazy_static_files(settings):
    # Tests run with DEBUG off, so ServeStatic would scan every static file (through the
    # finders) each time a test Client builds its middleware: ~50 ms per client. Looking
    # files up on request instead keeps the suite fast and still serves them.
    settings.SERVESTATIC_AUTOREFRESH = True


@pytest.fixture(autouse=True)
def _tasks_run_inline(monkeypatch):
    """django-q2 runs tasks in the calling process ("sync" mode), so a test sees a job's
    effect at once; tests/test_qcluster.py runs a real cluster instead."""
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", True)


def pytest_configure(config):
    # The embedding model is loaded here, before collection, in this thread. Otherwise the
    # first import of zeromem.wsgi during collection (tests/test_schema_fuzz.py) starts the
    # server's background loader (warm_up), and a thread running while pytest parses the
    # next test modules for assertion rewriting sometimes trips CPython 3.11's AST
    # recursion-depth bug ("SystemError: AST constructor recursion depth mismatch",
    # python/cpython#106905): seen twice in one session, each time a whole run lost.
    from memories.search import embeddings

    if embeddings.enabled():
        try:
            embeddings.encode(["warm up"])
        except embeddings.EncoderUnavailable:
            pass  # searches then run on words alone, as the tests of that case expect


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("postgres") and connection.vendor != "postgresql":
            item.add_marker(pytest.mark.skip(reason="needs PostgreSQL (run with DATABASE_URL set, as CI does)"))


@pytest.fixture
def tenant_a(db):
    return make_tenant("acme")


@pytest.fixture
def tenant_b(db):
    return make_tenant("globex")


@pytest.fixture
def tenant_c(db):
    return make_tenant("initech")


@pytest.fixture
def api(tenant_a):
    """Tenant A's key with every scope."""
    client, _key = make_keyed_client(tenant_a)
    return client


@pytest.fixture
def api_b(tenant_b):
    client, _key = make_keyed_client(tenant_b)
    return client


@pytest.fixture
def make_client(db):
    """``make_client(tenant, scopes=..., allow=..., expires_in_days=...)``: (client, ApiKey row)
    for a new key of ``tenant`` (tests/factories.py :func:`make_keyed_client`)."""
    return make_keyed_client


@pytest.fixture
def anonymous(db):
    return anonymous_client()


@pytest.fixture
def expired_client(tenant_a):
    client, key = make_keyed_client(tenant_a)
    key.expires_at = timezone.now() - timedelta(seconds=1)
    key.save(update_fields=["expires_at"])
    return client


@pytest.fixture
def revoked_client(tenant_a):
    client, key = make_keyed_client(tenant_a)
    services.api_key_revoke(tenant=tenant_a, actor=SYSTEM, key_id=key.pk)
    return client


@pytest.fixture
def limiter_minute(monkeypatch):
    """The rate limiter's clock (audit/limits.py) held one second into the current minute, so
    that a test counting calls against a per-minute limit never sees the window change under
    it (a CI run once crossed a minute boundary between a test's second and third call)."""
    import time
    from types import SimpleNamespace

    from audit import limits

    at = (int(time.time()) // 60) * 60 + 1
    monkeypatch.setattr(limits, "time", SimpleNamespace(time=lambda: at))
    return at


@pytest.fixture(params=["database", "redis"])
def counter_store(request, settings):
    """Where rate limits, slots, search budgets and refusal tallies count (audit/limits.py):
    the database, or Redis (which must answer: the test fails rather than skips)."""
    from tests.helpers import REDIS_TEST_URL, redis_or_fail

    settings.ZEROMEM_REDIS_URL = "" if request.param == "database" else REDIS_TEST_URL
    if request.param == "redis":
        redis_or_fail()
    return request.param
