"""Builders of test data: tenants, API keys and the clients that send them, memories, staff
users and their memberships. Test modules import these; the fixtures in conftest.py (and the
plugin tests/admin_fixtures.py) call them, and are never imported.

Plain functions over the real services rather than model factories (factory_boy and the
like): every row a test starts from is made the way production makes it — a tenant through
``tenant_create``, a key through ``api_key_create`` (hashed secret, scopes checked), a memory
through ``memory_write`` (a version row, an audit event) — so no test starts from a state the
product could not reach.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from memories import services
from memories.models import ApiKey, Membership, Memory, Tenant
from memories.services.access import access_counts_fold
from zeromem.kernel.actors import Actor
from zeromem.kernel.scopes import ALL_SCOPES

SYSTEM = Actor.system(job="tests")

# --- tenants, keys and API clients ------------------------------------------------------


def make_tenant(slug: str) -> Tenant:
    return services.tenant_create(actor=SYSTEM, slug=slug, name=slug.title())


def make_key(tenant, *, scopes=None, allow=None, expires_in_days=None, name="test key"):
    """A new API key of ``tenant``: (the ApiKey row, the raw key to send). Every scope unless
    ``scopes`` says otherwise; ``allow`` is the key's list of allowed key prefixes."""
    key, raw = services.api_key_create(
        tenant=tenant,
        actor=SYSTEM,
        name=name,
        scopes=list(ALL_SCOPES) if scopes is None else scopes,
        allowed_prefixes=allow or [],
        expires_in_days=expires_in_days,
    )
    return key, raw


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
        """POST /api/v1/tools/call; returns (status code, parsed body). After a
        ``memory_read`` the access-count job runs, as the schedule would a minute later, so
        a test sees the read counted (memories/services/access.py)."""
        r = self.post("/api/v1/tools/call", {"name": name, "arguments": arguments}, headers=headers)
        if name == "memory_read":
            access_counts_fold()
        return r.status_code, r.json()


def make_keyed_client(tenant, *, scopes=None, allow=None, expires_in_days=None) -> tuple[KeyedClient, ApiKey]:
    """A client for a new key of ``tenant`` (options as :func:`make_key`): (client, ApiKey row)."""
    key, raw = make_key(tenant, scopes=scopes, allow=allow, expires_in_days=expires_in_days)
    return KeyedClient(raw, tenant, Client()), key


def anonymous_client() -> KeyedClient:
    """A client that sends no API key."""
    return KeyedClient(None, None, Client())


# --- memories -----------------------------------------------------------------------------


def write(tenant, key, value, **kwargs) -> Memory:
    """Write ``key`` through the real service (a version and an audit event); the memory."""
    return services.memory_write(tenant=tenant, actor=SYSTEM, key=key, value=value, **kwargs).memory


def seed_user(tenant, user="u1", n=3, versions=2):
    """``n`` memories of subject ``user`` under ``user:<user>:``, each with ``versions``
    versions; one more trashed and one expired (same data until purged)."""
    for i in range(n):
        for v in range(versions):
            write(tenant, f"user:{user}:k{i}", f"{user} value {i}.{v}")
    write(tenant, f"user:{user}:gone", "trashed value")
    services.memory_delete(tenant=tenant, actor=SYSTEM, key=f"user:{user}:gone")
    write(tenant, f"user:{user}:old", "expired value")
    Memory.objects.filter(tenant=tenant, key=f"user:{user}:old").update(expires_at=timezone.now() - timedelta(hours=1))


def summarize(tenant, prefix, capture):
    """Run the real summarizer (deterministic digest) into summary:<prefix>, with lineage.
    ``capture`` is pytest-django's ``django_capture_on_commit_callbacks``."""
    with capture(execute=False):  # not a queue turn, which a pending forget request would take
        job = services.summarize_start(tenant=tenant, actor=SYSTEM, prefix=prefix)
    services.summarize_run(job_id=job.pk)
    summary = Memory.objects.get(tenant=tenant, key="summary:" + prefix.rstrip(":"), deleted_at__isnull=True)
    assert summary.category == "summary" and summary.sources, summary.sources
    return summary


# --- staff users (the admin console) ------------------------------------------------------

ROLES = tuple(Membership.Role.values)
PASSWORD = "correct horse battery staple"


def make_staff(tenant, role: str, username: str | None = None):
    """A user holding a ``role`` membership in ``tenant`` (no usable password: log in with
    :func:`logged_in`)."""
    user = get_user_model().objects.create_user(username=username or f"{role}-{tenant.slug}", password=None)
    services.membership_set(tenant=tenant, actor=SYSTEM, username=user.username, role=role)
    user.refresh_from_db()
    return user


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client
