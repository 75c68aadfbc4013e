"""Failed authentication under abuse: throttled per client address and per key prefix
before anything is written, aggregated into one tenant-less event per source and minute,
never in the tenant's log whose public key prefix an attacker sends."""

from unittest import mock

import pytest
from django.test import Client

from audit.models import AuditEvent
from audit.services import audit_auth_failures_flush
from tests.factories import KeyedClient, make_key

CALL = "/api/v1/tools/call"
BODY = {"name": "memory_read", "arguments": {"key": "user:u1:lang"}}


MINUTE = 28_333_333 * 60


@pytest.fixture(autouse=True)
def _frozen_clock():
    # All of a test's failures fall in one minute, however slow the machine.
    with mock.patch("audit.limits.time.time", return_value=MINUTE + 1.0):
        yield


def _public(raw):
    return raw[: len("zm_") + 12]


@pytest.fixture
def victim(tenant_a):
    _key, raw = make_key(tenant_a)
    return raw


def test_a_flood_of_1000_bad_keys_writes_a_handful_of_rows_and_none_for_the_tenant(victim, tenant_a, settings):
    """Before: 1,000 rows, 1,000 of them in the victim tenant's log with a chosen path."""
    settings.ZEROMEM_AUTH_FAILURES_PER_MINUTE = 30
    before = AuditEvent.objects.count()
    statuses = []
    client = Client()
    for i in range(1000):
        # Half use the victim's public prefix and attacker-chosen paths, half random keys.
        raw = f"{_public(victim)}_guess{i}" if i % 2 else f"zm_{i:012x}_guess"
        r = KeyedClient(raw, None, client).post(f"{CALL}?x=/etc/passwd{i}", BODY)
        statuses.append(r.status_code)
    assert statuses[:30] == [401] * 30
    assert set(statuses[30:]) == {429}
    throttled = KeyedClient(victim[:-1] + "x", None, Client()).post(CALL, BODY)
    assert throttled.status_code == 429 and int(throttled.headers["Retry-After"]) >= 1
    assert throttled.json()["error"]["code"] == "rate_limited"

    assert AuditEvent.objects.count() == before  # nothing written during the minute
    written = audit_auth_failures_flush(now=MINUTE + 60)
    events = list(AuditEvent.objects.filter(action="auth.failed"))
    assert written == len(events) == 1
    assert events[0].tenant_id is None and events[0].count == 30
    assert events[0].target == CALL  # the route, not the path the attacker chose
    assert not AuditEvent.objects.filter(tenant=tenant_a, action="auth.failed").exists()
    assert audit_auth_failures_flush(now=MINUTE + 60) == 0  # each minute once


def test_one_key_prefix_is_throttled_across_addresses(victim, settings):
    settings.ZEROMEM_AUTH_FAILURES_PER_MINUTE = 5
    codes = []
    for i in range(8):
        client = KeyedClient(f"{_public(victim)}_guess{i}", None, Client(REMOTE_ADDR=f"10.0.0.{i + 1}"))
        codes.append(client.post(CALL, BODY).status_code)
    assert codes == [401] * 5 + [429] * 3


def test_the_throttle_leaves_a_valid_key_from_another_address_alone(victim, api, settings):
    settings.ZEROMEM_AUTH_FAILURES_PER_MINUTE = 3
    for i in range(5):
        KeyedClient(f"zm_{i:012x}_guess", None, Client(REMOTE_ADDR="10.9.9.9")).post(CALL, BODY)
    assert KeyedClient(victim, None, Client()).post(CALL, BODY).status_code == 200


def test_a_revoked_key_is_recorded_in_its_tenant_log_until_throttled(tenant_a, revoked_client, settings):
    settings.ZEROMEM_AUTH_FAILURES_PER_MINUTE = 3
    codes = [revoked_client.post(CALL, BODY).status_code for _ in range(5)]
    assert codes == [401, 401, 401, 429, 429]
    assert AuditEvent.objects.filter(tenant=tenant_a, action="auth.failed").count() == 3
