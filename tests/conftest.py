"""Shared fixtures: three tenants, keys with different powers, and an API client.

Tests run against the real database (PostgreSQL in CI, SQLite on a bare machine); only the
outside world (an LLM endpoint, the clock) is ever faked.
"""

import json
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from memories import services
from memories.models import Tenant
from zeromem.kernel.actors import Actor
from zeromem.kernel.scopes import ALL_SCOPES


@pytest.fixture(autouse=True)
def _isolated_cache(settings):
    # Rate-limit counters live in the cache; each test gets its own, never the dev server's.
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "tests"}}
    from django.core.cache import cache

    cache.clear()


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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("postgres") and connection.vendor != "postgresql":
            item.add_marker(pytest.mark.skip(reason="needs PostgreSQL (run with DATABASE_URL set, as CI does)"))


@dataclass
class KeyedClient:
    """A test client that sends one API key and speaks JSON."""

    raw_key: str | None
    tenant: Tenant | None
    client: Client

    def _headers(self, extra):
        headers = {} if self.raw_key is None else {"Authorization": f"Bearer {self.raw_key}"}
        headers.update(extra or {})
        return headers

    def get(self, path, params=None, headers=None):
        return self.client.get(path, params or {}, headers=self._headers(headers))

    def post(self, path, body=None, headers=None, raw=None):
        data = raw if raw is not None else json.dumps(body if body is not None else {})
        return self.client.post(path, data, content_type="application/json", headers=self._headers(headers))

    def put(self, path, body=None, headers=None):
        return self.client.put(path, json.dumps(body), content_type="application/json", headers=self._headers(headers))

    def patch(self, path, body=None, headers=None):
        return self.client.patch(
            path, json.dumps(body), content_type="application/json", headers=self._headers(headers)
        )

    def delete(self, path, headers=None):
        return self.client.delete(path, headers=self._headers(headers))

    def call(self, name, headers=None, **arguments):
        """POST /api/v1/tools/call; returns (status code, parsed body)."""
        r = self.post("/api/v1/tools/call", {"name": name, "arguments": arguments}, headers=headers)
        return r.status_code, r.json()


SYSTEM = Actor.system(job="tests")


def make_tenant(slug: str) -> Tenant:
    return services.tenant_create(actor=SYSTEM, slug=slug, name=slug.title())


def make_key(tenant, *, scopes=None, allow=None, expires_in_days=None, name="test key"):
    key, raw = services.api_key_create(
        tenant=tenant,
        actor=SYSTEM,
        name=name,
        scopes=list(ALL_SCOPES) if scopes is None else scopes,
        allowed_prefixes=allow or [],
        expires_in_days=expires_in_days,
    )
    return key, raw


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
    _key, raw = make_key(tenant_a)
    return KeyedClient(raw, tenant_a, Client())


@pytest.fixture
def api_b(tenant_b):
    _key, raw = make_key(tenant_b)
    return KeyedClient(raw, tenant_b, Client())


@pytest.fixture
def make_client(db):
    """Factory: a client for a new key of ``tenant`` with the given scopes/allowlist."""

    def make(tenant, *, scopes=None, allow=None, expires_in_days=None):
        key, raw = make_key(tenant, scopes=scopes, allow=allow, expires_in_days=expires_in_days)
        return KeyedClient(raw, tenant, Client()), key

    return make


@pytest.fixture
def anonymous(db):
    return KeyedClient(None, None, Client())


@pytest.fixture
def expired_client(tenant_a):
    key, raw = make_key(tenant_a)
    key.expires_at = timezone.now() - timedelta(seconds=1)
    key.save(update_fields=["expires_at"])
    return KeyedClient(raw, tenant_a, Client())


@pytest.fixture
def revoked_client(tenant_a):
    key, raw = make_key(tenant_a)
    services.api_key_revoke(tenant=tenant_a, actor=SYSTEM, key_id=key.pk)
    return KeyedClient(raw, tenant_a, Client())
