"""TTL: an expired memory is invisible on every read path at once, before any cleanup job,
and a new write on its key starts a fresh memory."""

from contextlib import contextmanager
from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from audit.models import AuditEvent
from memories import services
from memories.models import Memory
from tests.factories import SYSTEM
from zeromem.kernel.errors import NotFound

KEY = "user:u1:otp"
_real_now = timezone.now


@contextmanager
def clock_at(offset: timedelta):
    """Move the clock that services, selectors and querysets read (timezone.now)."""
    moment = _real_now() + offset
    with mock.patch("django.utils.timezone.now", return_value=moment):
        yield moment


@pytest.fixture
def expiring(api):
    api.call("memory_write", key=KEY, value="zebra code 4711", ttl_seconds=60)
    api.call("memory_write", key="user:u1:name", value="zebra Alice")  # never expires
    return api


def assert_invisible(client, key=KEY):
    _, body = client.call("memory_read", key=key)
    assert body == {"status": "not_found", "key": key}
    _, body = client.call("memory_read", key=key, default="gone")
    assert body["value"] == "gone"
    _, body = client.call("memory_list", prefix="user:u1:")
    assert key not in body["keys"]
    _, body = client.call("memory_search", query="zebra code 4711", limit=50)
    assert key not in [r["key"] for r in body["results"]]
    _, body = client.call("memory_recall", query="zebra code 4711", max_chars=8000)
    assert key not in body["text"]
    assert client.get(f"/api/v1/memories/{key}").status_code == 404
    assert client.get(f"/api/v1/memories/{key}/history").status_code == 404
    r = client.get("/api/v1/memories", {"prefix": "user:u1:"})
    assert key not in [m["key"] for m in r.json()["results"]]


def test_write_with_ttl_sets_expires_at(expiring):
    memory = Memory.objects.get(key=KEY)
    assert memory.expires_at is not None
    assert timedelta(seconds=55) < memory.expires_at - timezone.now() <= timedelta(seconds=60)
    assert Memory.objects.get(key="user:u1:name").expires_at is None


def test_memory_is_visible_before_it_expires(expiring):
    with clock_at(timedelta(seconds=50)):
        _, body = expiring.call("memory_read", key=KEY)
        assert body["status"] == "ok" and body["value"] == "zebra code 4711"
        _, body = expiring.call("memory_list", prefix="user:u1:")
        assert KEY in body["keys"]
        _, body = expiring.call("memory_search", query="zebra code 4711")
        assert KEY in [r["key"] for r in body["results"]]
        assert expiring.get(f"/api/v1/memories/{KEY}").status_code == 200


def test_expired_memory_is_invisible_everywhere_once_the_clock_passes(expiring):
    with clock_at(timedelta(seconds=61)):
        assert_invisible(expiring)
        # The memory that never expires is still there.
        _, body = expiring.call("memory_read", key="user:u1:name")
        assert body["status"] == "ok"
    # No cleanup job ran: the row is still in the table, only hidden.
    assert Memory.objects.filter(key=KEY, deleted_at__isnull=True).exists()


def test_expired_memory_set_in_the_past_in_the_db_is_invisible(expiring):
    Memory.objects.filter(key=KEY).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert_invisible(expiring)


def test_update_and_delete_of_expired_memory_are_not_found(expiring):
    with clock_at(timedelta(minutes=5)):
        _, body = expiring.call("memory_update", key=KEY, value="new", expected_version=1)
        assert body == {"status": "not_found", "key": KEY}
        _, body = expiring.call("memory_delete", key=KEY)
        assert body == {"status": "not_found", "key": KEY}
        assert expiring.patch(f"/api/v1/memories/{KEY}", {"value": "x"}).status_code == 404
        assert expiring.delete(f"/api/v1/memories/{KEY}").status_code == 404
    memory = Memory.objects.get(key=KEY)
    assert (memory.value, memory.version, memory.deleted_at) == ("zebra code 4711", 1, None)


def test_write_on_expired_key_creates_a_fresh_memory(expiring):
    old = Memory.objects.get(key=KEY)
    with clock_at(timedelta(seconds=61)):
        status, body = expiring.call("memory_write", key=KEY, value="fresh")
        assert status == 200
        assert body == {"status": "ok", "key": KEY, "version": 1, "created": True}
        _, body = expiring.call("memory_read", key=KEY)
        assert body["value"] == "fresh" and body["version"] == 1
        r = expiring.get(f"/api/v1/memories/{KEY}/history")
        assert [v["value"] for v in r.json()["results"]] == ["fresh"]
    live = Memory.objects.live().get(key=KEY)
    assert live.pk != old.pk and live.expires_at is None
    assert Memory.objects.filter(key=KEY).count() == 2


def test_rest_put_on_expired_key_is_201_created(expiring):
    with clock_at(timedelta(hours=1)):
        r = expiring.put(f"/api/v1/memories/{KEY}", {"value": "fresh"})
        assert r.status_code == 201
        assert r.json()["version"] == 1


def test_rewrite_with_new_ttl_extends_life(expiring):
    with clock_at(timedelta(seconds=30)):
        expiring.call("memory_write", key=KEY, value="zebra code 4711", ttl_seconds=3600)
    with clock_at(timedelta(seconds=120)):
        _, body = expiring.call("memory_read", key=KEY)
        assert body["status"] == "ok" and body["version"] == 2


def test_rewrite_without_ttl_keeps_the_expiry(expiring):
    expiring.call("memory_write", key=KEY, value="zebra code 4711 again")
    with clock_at(timedelta(seconds=61)):
        _, body = expiring.call("memory_read", key=KEY)
        assert body["status"] == "not_found"


def test_restore_over_an_expired_memory_holding_the_key_restores_and_trashes_the_expired_one(tenant_a):
    old = services.memory_write(tenant=tenant_a, actor=SYSTEM, key=KEY, value="kept").memory
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=KEY)
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key=KEY, value="short", ttl_seconds=60)
    with clock_at(timedelta(seconds=61)):
        # Nothing live holds the key: the restore is no conflict, whether or not the purge ran.
        result = services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=old.pk)
        assert (result.status, result.memory.pk, result.memory.value) == ("ok", old.pk, "kept")
        assert services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY).memory.value == "kept"
    expired = Memory.objects.get(key=KEY, value="short")
    assert expired.deleted_at is not None and expired.expires_at is not None


def test_a_memory_restored_after_its_ttl_ran_out_lives_its_ttl_again_from_the_restore(tenant_a):
    """Restoring from the trash never makes an expiring memory permanent: one that expired
    while in the trash (not purged yet) gets its lifespan again — creation to expiry, here its
    60 s TTL — counted from the restore, and then expires as before."""
    written = services.memory_write(tenant=tenant_a, actor=SYSTEM, key=KEY, value="zebra code 4711", ttl_seconds=60)
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=KEY)
    lifespan = written.memory.expires_at - written.memory.created_at
    assert lifespan == timedelta(seconds=60)
    with clock_at(timedelta(seconds=300)) as restored_at:
        result = services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=written.memory.pk)
        assert result.memory.expires_at == restored_at + lifespan
        assert services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY).memory.value == "zebra code 4711"
    stored = Memory.objects.get(pk=written.memory.pk)
    assert (stored.deleted_at, stored.expires_at) == (None, restored_at + lifespan)
    event = AuditEvent.objects.filter(tenant=tenant_a, action="memory.restore").get()
    assert event.detail == {"ttl_restarted_seconds": 60}
    with clock_at(timedelta(seconds=300 + 61)):
        with pytest.raises(NotFound):
            services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)


def test_a_restored_memory_whose_ttl_has_not_run_out_keeps_its_expiry(tenant_a):
    written = services.memory_write(tenant=tenant_a, actor=SYSTEM, key=KEY, value="kept", ttl_seconds=600)
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=KEY)
    with clock_at(timedelta(seconds=60)):
        result = services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=written.memory.pk)
    assert result.memory.expires_at == written.memory.expires_at
    assert AuditEvent.objects.filter(tenant=tenant_a, action="memory.restore").get().detail in (None, {})


@contextmanager
def frozen_at(start, offset: timedelta):
    """timezone.now() fixed at ``start + offset``: steps of one test measured from one start."""
    with mock.patch("django.utils.timezone.now", return_value=start + offset):
        yield start + offset


def test_a_restored_session_key_refreshed_for_days_lives_its_last_ttl_not_its_age(tenant_a):
    """A session key written 10 days ago and refreshed with a 1-day TTL every 12 hours has
    lived 10 days, but its writer asked for a day: restored after that day ran out in the
    trash, it gets a day again (expiry minus its last write), not 10 days and a half."""
    start = _real_now()
    for half_days in range(21):
        with frozen_at(start, timedelta(hours=12 * half_days)):
            written = services.memory_write(
                tenant=tenant_a, actor=SYSTEM, key=KEY, value=f"turn {half_days}", ttl_seconds=86400
            )
    assert written.memory.created_at == start  # one memory, refreshed
    with frozen_at(start, timedelta(days=10, minutes=1)):
        services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=KEY)
    with frozen_at(start, timedelta(days=11, hours=1)) as restored_at:
        result = services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=written.memory.pk)
        assert result.memory.expires_at == restored_at + timedelta(days=1)
        assert services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY).memory.value == "turn 20"
    event = AuditEvent.objects.filter(tenant=tenant_a, action="memory.restore").get()
    assert event.detail == {"ttl_restarted_seconds": 86400}
    with frozen_at(start, timedelta(days=12, hours=1, seconds=1)):
        with pytest.raises(NotFound):
            services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)


def test_a_restored_memory_edited_after_its_ttl_was_set_never_outlives_that_ttl(tenant_a):
    """Set to expire in 600 s, then edited (no TTL: the expiry stays) at 500 s: restored after
    it ran out, it gets what it had left at its last change (100 s), never more than asked."""
    start = _real_now()
    with frozen_at(start, timedelta(0)):
        written = services.memory_write(tenant=tenant_a, actor=SYSTEM, key=KEY, value="v1", ttl_seconds=600)
    with frozen_at(start, timedelta(seconds=500)):
        services.memory_update(tenant=tenant_a, actor=SYSTEM, key=KEY, value="v2")
    with frozen_at(start, timedelta(seconds=550)):
        services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=KEY)
    with frozen_at(start, timedelta(seconds=900)) as restored_at:
        result = services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=written.memory.pk)
    assert result.memory.expires_at == restored_at + timedelta(seconds=100)


def test_a_memory_that_expired_before_a_write_took_its_key_is_not_restorable(tenant_a):
    """An expired memory still holding its key's slot goes to the trash when a write takes
    the key (_lock_current_unexpired). It expired while live, nobody deleted it: a restore
    brought it back with its TTL again — an expired value returned to every reader."""
    old = services.memory_write(tenant=tenant_a, actor=SYSTEM, key=KEY, value="zebra code 4711", ttl_seconds=60).memory
    with clock_at(timedelta(seconds=120)):
        services.memory_write(tenant=tenant_a, actor=SYSTEM, key=KEY, value="fresh")
        services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=KEY)
        with pytest.raises(NotFound) as refused:
            services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=old.pk)
        assert refused.value.field == "memory_id" and "expired" in str(refused.value)
        with pytest.raises(NotFound):
            services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    stored = Memory.objects.get(pk=old.pk)
    assert stored.deleted_at is not None and stored.version == 1  # unchanged
    event = AuditEvent.objects.filter(tenant=tenant_a, action="memory.restore").get()
    assert event.outcome == "not_found"


def test_a_memory_past_its_trash_retention_is_not_restorable_before_the_purge_runs(tenant_a, settings):
    """Deleted memories stay restorable ``trash_retention_days``; past that they are the
    purge's, every 5 minutes. A restore in between brought one back — with a retention of
    0 days (deletes are final), any restore before the next purge run did."""
    from memories.services.retention import retention_rule_set

    settings.ZEROMEM_TRASH_RETENTION_DAYS = 30
    retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:", trash_retention_days=0)
    final = services.memory_write(tenant=tenant_a, actor=SYSTEM, key="session:s1:x", value="gone for good").memory
    kept = services.memory_write(tenant=tenant_a, actor=SYSTEM, key=KEY, value="kept").memory
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key="session:s1:x")
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=KEY)
    with clock_at(timedelta(seconds=1)):
        with pytest.raises(NotFound) as refused:
            services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=final.pk)
        assert refused.value.field == "memory_id" and "retention" in str(refused.value)
        # Within the tenant's 30 days: restorable, up to the last moment.
        assert services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=kept.pk).status == "ok"
    assert Memory.objects.get(pk=final.pk).deleted_at is not None
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=KEY)
    with clock_at(timedelta(days=30, seconds=1)):
        with pytest.raises(NotFound):
            services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=kept.pk)
    with clock_at(timedelta(days=29, hours=23)):
        assert services.memory_restore(tenant=tenant_a, actor=SYSTEM, memory_id=kept.pk).status == "ok"
