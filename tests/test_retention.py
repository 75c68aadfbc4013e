"""Retention: default TTLs by key prefix, and the purge of expired memories and old trash
(service, ``purge_expired`` command, concurrent workers on PostgreSQL), plus the schedule
that runs it."""

import json
import secrets
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from io import StringIO
from unittest import mock

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.utils import timezone
from django_q.models import Schedule

from audit.models import AuditEvent
from memories import services
from memories.models import Memory, MemoryVersion, RetentionRule
from tests.factories import SYSTEM, make_tenant
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import Forbidden, InvalidInput

_real_now = timezone.now
DAY = timedelta(days=1)


@contextmanager
def clock_at(offset: timedelta):
    """Move the clock services, selectors and the purge read (django.utils.timezone.now)."""
    moment = _real_now() + offset
    with mock.patch("django.utils.timezone.now", return_value=moment):
        yield moment


def write(tenant, key, value="v", **kwargs):
    result = services.memory_write(tenant=tenant, actor=SYSTEM, key=key, value=value, **kwargs)
    assert result.status == "ok"
    return result.memory


def expire(tenant, key):
    """Put a memory's expiry in the past, as time passing would."""
    Memory.objects.filter(tenant=tenant, key=key).update(expires_at=_real_now() - timedelta(seconds=1))


def expired_tasks(tenant, n):
    """``n`` memories task:t<i>:status whose TTL has passed."""
    for i in range(n):
        write(tenant, f"task:t{i}:status", "done", ttl_seconds=60)
        expire(tenant, f"task:t{i}:status")


def trash(tenant, key):
    assert services.memory_delete(tenant=tenant, actor=SYSTEM, key=key).status == "ok"


def keys(tenant):
    return set(Memory.objects.filter(tenant=tenant).values_list("key", flat=True))


def purge_events(tenant=None):
    qs = AuditEvent.objects.filter(action="memory.purge").order_by("pk")
    return list(qs.filter(tenant=tenant) if tenant is not None else qs)


def run(*args):
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


# --- the purge ----------------------------------------------------------------------------


@pytest.fixture
def expired_and_live(tenant_a, tenant_b):
    """Tenant A: two expired memories (one with three versions, one already in the trash)
    and two live ones; tenant B: one live memory under a key A also uses, one expired."""
    write(tenant_a, "session:s1:step", "one", ttl_seconds=60)
    write(tenant_a, "session:s1:step", "two")
    write(tenant_a, "session:s1:step", "three")
    write(tenant_a, "session:s1:otp", "4711", ttl_seconds=60)
    trash(tenant_a, "session:s1:otp")
    write(tenant_a, "user:u1:lang", "fr")
    write(tenant_a, "user:u1:name", "Alice", ttl_seconds=3600)  # expires, but not yet
    write(tenant_b, "session:s1:step", "b-live")
    write(tenant_b, "session:s9:tmp", "b-tmp", ttl_seconds=60)
    for key in ("session:s1:step", "session:s1:otp"):
        expire(tenant_a, key)
    expire(tenant_b, "session:s9:tmp")


# Erasure is the same with the WAL compressed and the purge paced as without either.
ERASURE_MODES = pytest.mark.parametrize("wal, rate", [("off", 0), ("auto", 60000), ("auto", 0)])


@ERASURE_MODES
def test_purge_erases_expired_memories_and_all_their_versions(
    tenant_a, tenant_b, expired_and_live, settings, wal, rate
):
    settings.ZEROMEM_PURGE_WAL_COMPRESSION, settings.ZEROMEM_PURGE_MEMORIES_PER_SECOND = wal, rate
    doomed = list(Memory.objects.filter(expires_at__lte=_real_now()).values_list("pk", flat=True))
    assert len(doomed) == 3
    assert MemoryVersion.objects.filter(memory_id__in=doomed).count() == 3 + 2 + 1

    result = services.purge_expired()

    assert (result["expired"], result["trash"], result["versions"], result["batches"]) == (3, 0, 6, 1)
    assert result["seconds"] >= 0
    assert not Memory.objects.filter(pk__in=doomed).exists()
    assert not MemoryVersion.objects.filter(memory_id__in=doomed).exists()
    assert keys(tenant_a) == {"user:u1:lang", "user:u1:name"}
    assert keys(tenant_b) == {"session:s1:step"}


@ERASURE_MODES
def test_purge_leaves_live_memories_and_their_history_untouched(
    tenant_a, tenant_b, expired_and_live, settings, wal, rate
):
    settings.ZEROMEM_PURGE_WAL_COMPRESSION, settings.ZEROMEM_PURGE_MEMORIES_PER_SECOND = wal, rate
    live = {m.pk: (m.value, m.version, m.expires_at) for m in Memory.objects.live()}
    history = sorted(MemoryVersion.objects.filter(memory_id__in=live).values_list("memory_id", "version", "value"))

    services.purge_expired()

    assert {m.pk: (m.value, m.version, m.expires_at) for m in Memory.objects.all()} == live
    assert sorted(MemoryVersion.objects.values_list("memory_id", "version", "value")) == history
    assert services.memory_read(tenant=tenant_b, actor=SYSTEM, key="session:s1:step").memory.value == "b-live"


@ERASURE_MODES
def test_each_tenant_gets_one_audit_event_per_batch_with_its_count(
    tenant_a, tenant_b, expired_and_live, settings, wal, rate
):
    settings.ZEROMEM_PURGE_WAL_COMPRESSION, settings.ZEROMEM_PURGE_MEMORIES_PER_SECOND = wal, rate
    services.purge_expired()

    (event_a,) = purge_events(tenant_a)
    (event_b,) = purge_events(tenant_b)
    assert (event_a.count, event_b.count) == (2, 1)
    for event, versions in ((event_a, 5), (event_b, 1)):
        assert (event.actor_kind, event.actor_id, event.surface) == ("system", "purge_expired", "job")
        assert event.outcome == "ok"
        assert event.detail == {"reason": "expired", "versions": versions}
        # Counts only: no key, no value of what was erased.
        assert event.target == "" and event.subject == ""
        assert "4711" not in json.dumps(event.detail) and "one" not in json.dumps(event.detail)


def test_small_batches_write_one_event_per_batch_summing_to_the_total(tenant_a):
    expired_tasks(tenant_a, 5)
    seen = []

    result = services.purge_expired(batch_size=2, progress=seen.append)

    assert (result["expired"], result["batches"]) == (5, 3)
    assert seen == [2, 4, 5]
    assert sorted(e.count for e in purge_events(tenant_a)) == [1, 2, 2]
    assert not Memory.objects.exists()


def test_pause_ratio_sleeps_that_share_of_each_batch_and_refuses_a_negative_one(tenant_a, settings):
    expired_tasks(tenant_a, 5)
    with pytest.raises(InvalidInput) as refused:
        services.purge_expired(pause_ratio=-1)
    assert refused.value.field == "pause_ratio" and Memory.objects.count() == 5
    settings.ZEROMEM_PURGE_PAUSE_RATIO = 2.0
    slept = []
    real_sleep, here = time.sleep, threading.get_ident()

    def sleep(seconds):
        # time.sleep is patched for every thread: only this one's sleeps are the purge's (a
        # background thread's, then not sleeping at all, once made 50,589 of them in CI).
        if threading.get_ident() == here:
            slept.append(seconds)
        else:
            real_sleep(seconds)

    with mock.patch("memories.services.retention.time.sleep", sleep):
        result = services.purge_expired(batch_size=2)
    assert (result["expired"], result["batches"]) == (5, 3)
    assert len(slept) == 3 and all(s > 0 for s in slept)  # after each batch that erased rows
    with mock.patch("memories.services.retention.time.sleep", sleep):
        services.purge_expired(batch_size=2, pause_ratio=0)
    assert len(slept) == 3


class FakeClock:
    """time.monotonic and time.sleep for the purge: the clock moves only when it sleeps
    (or by ``work`` seconds per reading, standing in for the batches' own time)."""

    def __init__(self, work=0.0):
        self.now, self.work, self.slept = 1000.0, work, []

    def monotonic(self):
        self.now += self.work
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_rate_paces_the_purge_to_n_over_r_seconds_and_refuses_a_negative_one(tenant_a, settings):
    expired_tasks(tenant_a, 5)
    with pytest.raises(InvalidInput) as refused:
        services.purge_expired(memories_per_second=-1)
    assert refused.value.field == "memories_per_second" and Memory.objects.count() == 5
    settings.ZEROMEM_PURGE_MEMORIES_PER_SECOND = 2.0
    clock = FakeClock()
    with mock.patch("memories.services.retention.time", clock):
        result = services.purge_expired(batch_size=2)
    # 5 memories at 2/s: after 2, 4 and 5 erased the run is back on 1.0, 2.0 and 2.5 s.
    assert (result["expired"], result["batches"]) == (5, 3)
    assert clock.slept == [1.0, 1.0, 0.5]
    assert result["seconds"] >= 5 / 2
    assert not Memory.objects.exists()


def test_rate_sleeps_only_what_the_batches_own_time_leaves_and_zero_is_unpaced(tenant_a, settings):
    for n in range(6):
        write(tenant_a, f"task:t{n}:status", "done", ttl_seconds=60)
        expire(tenant_a, f"task:t{n}:status")
    settings.ZEROMEM_PURGE_MEMORIES_PER_SECOND = 0
    clock = FakeClock(work=0.1)
    with mock.patch("memories.services.retention.time", clock):
        services.purge_expired(batch_size=2, memories_per_second=4.0)
    # Each batch of 2 is due 0.5 s after the previous one; its own time (0.1 s per reading)
    # is taken off the sleep, and the run still takes at least 6 / 4 s.
    assert len(clock.slept) == 3 and all(0 < s < 0.5 for s in clock.slept)
    assert clock.now - 1000.0 >= 6 / 4
    for n in range(3):
        write(tenant_a, f"task:u{n}:status", "done", ttl_seconds=60)
        expire(tenant_a, f"task:u{n}:status")
    clock = FakeClock()
    with mock.patch("memories.services.retention.time", clock):
        assert services.purge_expired(batch_size=2)["expired"] == 3
    assert clock.slept == []  # 0: unpaced


def best_wal_compression():
    with connection.cursor() as cursor:
        cursor.execute("SELECT enumvals FROM pg_settings WHERE name = 'wal_compression'")
        (methods,) = cursor.fetchone()
    return next(m for m in ("zstd", "lz4", "pglz") if m in methods)


def wal_compression_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('wal_compression')")
        return cursor.fetchone()[0]


@pytest.mark.postgres
def test_purge_compresses_its_wal_when_the_role_may_and_only_in_its_transaction(tenant_a, settings):
    """The test runs in one transaction, so the batches' SET LOCAL is still visible after
    the purge; outside tests it ends with each batch's commit."""
    seed_expired(tenant_a, 5)
    server = wal_compression_now()
    settings.ZEROMEM_PURGE_WAL_COMPRESSION = "off"
    assert services.purge_expired(batch_size=2)["expired"] == 5
    assert wal_compression_now() == server
    seed_expired(tenant_a, 5, prefix="again")
    settings.ZEROMEM_PURGE_WAL_COMPRESSION = "auto"
    seen = []
    assert services.purge_expired(batch_size=2, progress=lambda _n: seen.append(wal_compression_now()))["expired"] == 5
    assert seen == [best_wal_compression()] * 3
    settings.ZEROMEM_PURGE_WAL_COMPRESSION = "pglz"
    seed_expired(tenant_a, 1, prefix="pglz")
    assert services.purge_expired()["expired"] == 1
    assert wal_compression_now() == "pglz"


@pytest.mark.postgres
def test_purge_as_a_role_that_may_not_set_wal_compression_erases_all_the_same(
    tenant_a, tenant_b, expired_and_live, settings
):
    settings.ZEROMEM_PURGE_WAL_COMPRESSION = "auto"
    role = f"zm_purge_test_{secrets.token_hex(4)}"  # created and dropped in this test's transaction
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {role} NOSUPERUSER")
        cursor.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}")
        cursor.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
        cursor.execute(f"SET ROLE {role}")
        server = wal_compression_now()
        try:
            assert services.retention.wal_compression_for_erasure() is None
            result = services.purge_expired()
            assert wal_compression_now() == server
        finally:
            cursor.execute("RESET ROLE")
    assert (result["expired"], result["versions"]) == (3, 6)
    assert keys(tenant_a) == {"user:u1:lang", "user:u1:name"} and keys(tenant_b) == {"session:s1:step"}
    assert sorted(e.count for e in purge_events()) == [1, 2]


def test_versions_of_erased_memories_go_with_them_without_a_database_foreign_key(tenant_a):
    """Memories migration 0013 dropped the versions' foreign key: the purge's own statement
    (and Django's on_delete for ORM deletes) still leaves no version behind."""
    for n in range(3):
        write(tenant_a, f"task:t{n}:status", "v1", ttl_seconds=60)
        write(tenant_a, f"task:t{n}:status", "v2")
        expire(tenant_a, f"task:t{n}:status")
    keep = write(tenant_a, "user:u1:lang", "en")
    assert MemoryVersion.objects.count() == 7
    assert services.purge_expired()["versions"] == 6
    assert list(MemoryVersion.objects.values_list("memory_id", flat=True)) == [keep.pk]
    keep.delete()  # an ORM delete (tenant deletion's path) cascades in Django
    assert not MemoryVersion.objects.exists()


def test_max_batches_stops_early_and_the_next_run_finishes(tenant_a):
    expired_tasks(tenant_a, 5)

    first = services.purge_expired(batch_size=2, max_batches=1)
    assert (first["expired"], first["batches"]) == (2, 1)
    assert Memory.objects.count() == 3

    second = services.purge_expired(batch_size=2)
    assert (second["expired"], second["batches"]) == (3, 2)
    assert not Memory.objects.exists()


def test_purge_is_idempotent_a_second_run_erases_nothing(tenant_a, tenant_b, expired_and_live):
    services.purge_expired()
    events = len(purge_events())
    rows = (Memory.objects.count(), MemoryVersion.objects.count())

    again = services.purge_expired()

    assert (again["expired"], again["trash"], again["versions"], again["batches"]) == (0, 0, 0, 0)
    assert len(purge_events()) == events
    assert (Memory.objects.count(), MemoryVersion.objects.count()) == rows


def test_memory_that_has_not_expired_yet_waits_for_a_later_run(tenant_a):
    write(tenant_a, "session:s1:otp", "4711", ttl_seconds=60)
    with clock_at(timedelta(seconds=59)):
        assert services.purge_expired()["expired"] == 0
    assert keys(tenant_a) == {"session:s1:otp"}
    with clock_at(timedelta(seconds=61)):
        assert services.purge_expired()["expired"] == 1
    assert keys(tenant_a) == set()


def test_write_after_purge_starts_a_fresh_memory(tenant_a):
    write(tenant_a, "session:s1:otp", "4711", ttl_seconds=60)
    expire(tenant_a, "session:s1:otp")
    services.purge_expired()
    result = services.memory_write(tenant=tenant_a, actor=SYSTEM, key="session:s1:otp", value="new")
    assert (result.created, result.memory.version) == (True, 1)
    assert list(MemoryVersion.objects.values_list("value", flat=True)) == ["new"]


# --- old trash ----------------------------------------------------------------------------


@pytest.fixture
def trashed(tenant_a, tenant_b, settings):
    """Trash with different retentions: tenant A keeps trash 10 days, ``session:`` 1 day,
    ``session:keep:`` 20 days; a rule that sets only a TTL (``session:ttl:``) does not
    change the retention it inherits. Tenant B has the server default (30 days)."""
    settings.ZEROMEM_TRASH_RETENTION_DAYS = 30
    tenant_a.trash_retention_days = 10
    tenant_a.save(update_fields=["trash_retention_days"])
    services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:", trash_retention_days=1)
    services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:keep:", trash_retention_days=20)
    services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:ttl:", default_ttl_seconds=7200)
    for key in ("note:n1:a", "session:s1:x", "session:keep:x", "session:ttl:x", "user:u1:live"):
        write(tenant_a, key, ttl_seconds=10 * 365 * 24 * 3600)
    write(tenant_b, "note:n1:a")
    for key in ("note:n1:a", "session:s1:x", "session:keep:x", "session:ttl:x"):
        trash(tenant_a, key)
    trash(tenant_b, "note:n1:a")


def test_trash_is_erased_when_its_longest_prefix_retention_has_passed(tenant_a, tenant_b, trashed):
    all_a = {"note:n1:a", "session:s1:x", "session:keep:x", "session:ttl:x", "user:u1:live"}
    with clock_at(DAY / 2):
        assert services.purge_expired()["trash"] == 0
    assert keys(tenant_a) == all_a

    with clock_at(2 * DAY):
        result = services.purge_expired()
    assert (result["expired"], result["trash"]) == (0, 2)
    assert keys(tenant_a) == all_a - {"session:s1:x", "session:ttl:x"}

    with clock_at(11 * DAY):
        assert services.purge_expired()["trash"] == 1
    assert keys(tenant_a) == {"session:keep:x", "user:u1:live"}
    assert keys(tenant_b) == {"note:n1:a"}

    with clock_at(21 * DAY):
        assert services.purge_expired()["trash"] == 1
    assert keys(tenant_a) == {"user:u1:live"}
    assert keys(tenant_b) == {"note:n1:a"}

    with clock_at(31 * DAY):
        assert services.purge_expired()["trash"] == 1
    assert keys(tenant_b) == set()
    # The live memory and its history survive every run.
    assert services.memory_read(tenant=tenant_a, actor=SYSTEM, key="user:u1:live").status == "ok"
    assert MemoryVersion.objects.filter(memory__key="user:u1:live").count() == 1
    assert MemoryVersion.objects.count() == 1


def test_one_tenants_trash_kept_for_ages_does_not_stop_the_other_tenants_purge(tenant_a, tenant_b, settings):
    # The admin's Tenant page accepts any positive number of days: "keep the trash forever".
    # A cutoff before the year 1 is no date: the purge raised there, and the tenants after
    # this one kept their old trash on every run.
    settings.ZEROMEM_TRASH_RETENTION_DAYS = 30
    services.tenant_settings_update(
        tenant=tenant_a,
        actor=SYSTEM,
        name=tenant_a.name,
        value_max_bytes=None,
        trash_retention_days=10**6,
    )
    write(tenant_a, "note:n1:a")
    write(tenant_b, "note:n1:a")
    trash(tenant_a, "note:n1:a")
    trash(tenant_b, "note:n1:a")
    with clock_at(31 * DAY):
        assert services.purge_expired()["trash"] == 1
    assert keys(tenant_a) == {"note:n1:a"}
    assert keys(tenant_b) == set()


def test_trash_retention_prefixes_are_case_sensitive(tenant_a, settings):
    settings.ZEROMEM_TRASH_RETENTION_DAYS = 30
    services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:", trash_retention_days=1)
    for key in ("session:s1:x", "Session:s1:x", "sessionX:s1"):
        write(tenant_a, key)
        trash(tenant_a, key)
    with clock_at(2 * DAY):
        assert services.purge_expired()["trash"] == 1
    assert keys(tenant_a) == {"Session:s1:x", "sessionX:s1"}


def test_trash_purge_erases_versions_and_audits_per_tenant(tenant_a, tenant_b, trashed):
    with clock_at(40 * DAY):
        result = services.purge_expired()
    # 4 trashed memories of A (write + delete versions each) and 1 of B.
    assert (result["trash"], result["versions"]) == (5, 10)
    (event_a,) = purge_events(tenant_a)
    (event_b,) = purge_events(tenant_b)
    assert (event_a.count, event_a.detail) == (4, {"reason": "trash", "versions": 8})
    assert (event_b.count, event_b.detail) == (1, {"reason": "trash", "versions": 2})


def test_purge_pending_counts_what_a_purge_would_erase(tenant_a, tenant_b, trashed):
    write(tenant_a, "task:t1:tmp", ttl_seconds=60)
    expire(tenant_a, "task:t1:tmp")
    with clock_at(2 * DAY):
        assert services.purge_pending() == {"expired": 1, "trash": 2}
        result = services.purge_expired()
        assert (result["expired"], result["trash"]) == (1, 2)
        assert services.purge_pending() == {"expired": 0, "trash": 0}


# --- default TTL by prefix ------------------------------------------------------------------


@pytest.fixture
def ttl_rules(tenant_a):
    services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:", default_ttl_seconds=3600)
    services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:long:", default_ttl_seconds=86400)
    # A rule that only sets trash retention gives no TTL, and hides no broader rule's.
    services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:long:x", trash_retention_days=3)
    services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="a_b:", default_ttl_seconds=60)


def lifetime(memory) -> timedelta | None:
    return None if memory.expires_at is None else memory.expires_at - memory.created_at


def test_create_without_ttl_takes_the_longest_matching_prefix_default(tenant_a, ttl_rules):
    assert lifetime(write(tenant_a, "session:s1:step")) == timedelta(hours=1)
    assert lifetime(write(tenant_a, "session:long:s2")) == timedelta(days=1)
    assert lifetime(write(tenant_a, "session:long:x1")) == timedelta(days=1)
    assert lifetime(write(tenant_a, "user:u1:lang")) is None
    # Prefixes match exactly: no LIKE wildcards, no partial segments beyond the prefix.
    assert lifetime(write(tenant_a, "axb:k")) is None
    assert lifetime(write(tenant_a, "a_b:k")) == timedelta(seconds=60)
    assert lifetime(write(tenant_a, "sessions:s1")) is None
    assert lifetime(write(tenant_a, "Session:s1:step")) is None


def test_explicit_ttl_wins_over_the_default(tenant_a, ttl_rules):
    assert lifetime(write(tenant_a, "session:s1:step", ttl_seconds=30)) == timedelta(seconds=30)


def test_default_ttl_is_not_applied_when_updating_an_existing_memory(tenant_a):
    write(tenant_a, "session:s1:step", "one")
    services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:", default_ttl_seconds=3600)

    assert write(tenant_a, "session:s1:step", "two").expires_at is None
    updated = services.memory_update(tenant=tenant_a, actor=SYSTEM, key="session:s1:step", value="three")
    assert updated.memory.expires_at is None
    # A memory created now does get it.
    assert lifetime(write(tenant_a, "session:s2:step")) == timedelta(hours=1)


def test_rewrite_of_a_ttl_memory_keeps_its_expiry(tenant_a, ttl_rules):
    first = write(tenant_a, "session:s1:step", "one", ttl_seconds=30)
    assert write(tenant_a, "session:s1:step", "two").expires_at == first.expires_at


def test_write_over_an_expired_key_creates_with_the_default_ttl(tenant_a, ttl_rules):
    write(tenant_a, "session:s1:step", "one")
    expire(tenant_a, "session:s1:step")
    fresh = services.memory_write(tenant=tenant_a, actor=SYSTEM, key="session:s1:step", value="two")
    assert fresh.created and lifetime(fresh.memory) == timedelta(hours=1)


def test_other_tenants_rules_do_not_apply(tenant_a, tenant_b, ttl_rules):
    assert lifetime(write(tenant_b, "session:s1:step")) is None


def test_default_ttl_is_applied_through_the_tool_call(api, ttl_rules):
    status, body = api.call("memory_write", key="session:s1:step", value="x")
    assert status == 200 and body["created"] is True
    assert lifetime(Memory.objects.get(tenant=api.tenant, key="session:s1:step")) == timedelta(hours=1)


def test_langgraph_put_without_ttl_takes_the_rules_default_ttl_on_create_and_on_replace(api, ttl_rules):
    # The LangGraph key of namespace ("session", "s1"), item "step", is session:s1:step.
    item = {"namespace": ["session", "s1"], "key": "step", "value": {"v": 1}}
    assert api.put("/api/v1/langgraph/store/items", item).status_code == 204
    created = Memory.objects.get(tenant=api.tenant, key="lg:session:s1:step", deleted_at__isnull=True)
    assert lifetime(created) is None  # lg: is not session:
    services.retention_rule_set(tenant=api.tenant, actor=SYSTEM, prefix="lg:session:", default_ttl_seconds=3600)

    assert api.put("/api/v1/langgraph/store/items", {**item, "key": "new"}).status_code == 204
    fresh = Memory.objects.get(tenant=api.tenant, key="lg:session:s1:new")
    assert lifetime(fresh) == timedelta(hours=1)
    # A put replaces the item: with no ttl its expiry is the rule's default again, from now,
    # never "no expiry" that would outlive the tenant's rule.
    assert api.put("/api/v1/langgraph/store/items", {**item, "ttl": 1}).status_code == 204
    with clock_at(timedelta(seconds=30)) as later:
        assert api.put("/api/v1/langgraph/store/items", item).status_code == 204
    replaced = Memory.objects.get(pk=created.pk)
    assert replaced.expires_at == later + timedelta(hours=1)


# --- retention_rule_set ------------------------------------------------------------------


def test_rule_set_creates_changes_and_removes_with_an_audit_event_each(tenant_a):
    rule = services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:", default_ttl_seconds=60)
    assert (rule.prefix, rule.default_ttl_seconds, rule.trash_retention_days) == ("session:", 60, None)
    rule = services.retention_rule_set(
        tenant=tenant_a, actor=SYSTEM, prefix="session:", default_ttl_seconds=120, trash_retention_days=2
    )
    assert RetentionRule.objects.get(tenant=tenant_a).default_ttl_seconds == 120
    assert services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, prefix="session:") is None
    assert not RetentionRule.objects.exists()

    events = AuditEvent.objects.filter(tenant=tenant_a, action="retention_rule.set").order_by("pk")
    assert [(e.target, e.outcome, e.detail) for e in events] == [
        ("session:", "ok", {"default_ttl_seconds": 60, "trash_retention_days": None, "removed": False}),
        ("session:", "ok", {"default_ttl_seconds": 120, "trash_retention_days": 2, "removed": False}),
        ("session:", "ok", {"default_ttl_seconds": None, "trash_retention_days": None, "removed": True}),
    ]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prefix": "bad prefix", "default_ttl_seconds": 60}, "prefix"),
        ({"prefix": "session:", "default_ttl_seconds": 0}, "default_ttl_seconds"),
        ({"prefix": "session:", "default_ttl_seconds": "60"}, "default_ttl_seconds"),
        ({"prefix": "session:", "trash_retention_days": -1}, "trash_retention_days"),
    ],
)
def test_rule_set_refuses_bad_input_changes_nothing_and_audits_it(tenant_a, kwargs, field):
    with pytest.raises(InvalidInput) as exc:
        services.retention_rule_set(tenant=tenant_a, actor=SYSTEM, **kwargs)
    assert exc.value.field == field
    assert not RetentionRule.objects.exists()
    event = AuditEvent.objects.get(tenant=tenant_a, action="retention_rule.set")
    assert (event.outcome, event.detail["field"]) == ("invalid", field)


def test_rule_set_needs_write_and_delete_scopes_and_stays_inside_the_allowlist(tenant_a):
    reader = Actor(kind="api_key", id="1", scopes=frozenset({"memory:read", "memory:write"}))
    with pytest.raises(Forbidden):
        services.retention_rule_set(tenant=tenant_a, actor=reader, prefix="session:", default_ttl_seconds=60)
    limited = Actor(
        kind="api_key", id="2", scopes=frozenset({"memory:write", "memory:delete"}), allowed_prefixes=("user:u1:",)
    )
    with pytest.raises(Forbidden):
        services.retention_rule_set(tenant=tenant_a, actor=limited, prefix="user:", default_ttl_seconds=60)
    assert not RetentionRule.objects.exists()
    assert services.retention_rule_set(tenant=tenant_a, actor=limited, prefix="user:u1:tmp:", default_ttl_seconds=60)
    outcomes = list(
        AuditEvent.objects.filter(action="retention_rule.set").order_by("pk").values_list("outcome", flat=True)
    )
    assert outcomes == ["denied", "denied", "ok"]


# --- the command ---------------------------------------------------------------------------


def test_command_json_prints_one_object_with_the_counts(tenant_a, tenant_b, expired_and_live):
    out, err = run("purge_expired", "--json", "--batch-size", "2")
    result = json.loads(out)
    assert {k: result[k] for k in ("expired", "trash", "versions", "batches")} == {
        "expired": 3,
        "trash": 0,
        "versions": 6,
        "batches": 2,
    }
    assert isinstance(result["seconds"], float | int)
    assert "100%" in err and "3/3" in err  # the progress bar, on stderr only
    assert keys(tenant_a) == {"user:u1:lang", "user:u1:name"}

    out, _ = run("purge_expired", "--json")
    assert json.loads(out)["expired"] == 0


def test_command_prints_a_readable_summary(tenant_a, tenant_b, expired_and_live):
    out, err = run("purge_expired", "--no-progress")
    assert out.startswith("Purged 3 expired and 0 trashed memories (6 versions) in 1 batches")
    assert err == ""


def test_command_refuses_a_bad_batch_size(db):
    from django.core.management import CommandError

    with pytest.raises(CommandError, match="batch-size"):
        run("purge_expired", "--batch-size", "0")


# --- the schedule ---------------------------------------------------------------------------


def test_scheduled_task_purges_through_django_q(tenant_a, tenant_b, expired_and_live):
    from django_q.tasks import async_task, result

    # conftest runs django-q2 in sync mode: the task runs here, through the real dispatch.
    task_id = async_task("memories.tasks.purge_expired_task")
    assert result(task_id)["expired"] == 3
    assert keys(tenant_a) == {"user:u1:lang", "user:u1:name"}


def test_schedule_apply_is_idempotent(db):
    first, _ = run("zeromem_schedules")
    assert "zeromem:purge-expired" in first
    count = Schedule.objects.count()
    purge = Schedule.objects.get(name="zeromem:purge-expired")
    assert (purge.func, purge.schedule_type, purge.minutes) == ("memories.tasks.purge_expired_task", "I", 5)

    second, _ = run("zeromem_schedules")

    lines = second.strip().splitlines()
    assert lines and all(line.split()[0] == "unchanged" for line in lines), second
    assert Schedule.objects.count() == count


# --- several workers at once (PostgreSQL row locks) ----------------------------------------


def seed_expired(tenant, n, prefix="bulk"):
    """n expired memories with one version each, inserted in bulk."""
    past = _real_now() - timedelta(minutes=1)
    memories = Memory.objects.bulk_create(
        Memory(tenant=tenant, key=f"{prefix}:{i}:k", namespace=f"{prefix}:{i}", value=i, expires_at=past)
        for i in range(n)
    )
    MemoryVersion.objects.bulk_create(
        MemoryVersion(tenant=tenant, memory=m, version=1, value=m.value, op="write", actor_kind="system")
        for m in memories
    )


def in_threads(*calls, timeout=60):
    barrier = threading.Barrier(len(calls))
    results = [None] * len(calls)

    def worker(i, call):
        try:
            barrier.wait(timeout=10)
            results[i] = call()
        except BaseException as exc:  # re-raised in the test's thread below
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
        assert not t.is_alive(), "a purge worker hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_purges_erase_each_row_exactly_once():
    tenant_a, tenant_b = make_tenant("acme"), make_tenant("globex")
    seed_expired(tenant_a, 1500)
    seed_expired(tenant_b, 500)
    write(tenant_a, "user:u1:lang", "fr")

    results = in_threads(*(lambda: services.purge_expired(batch_size=25) for _ in range(2)))

    assert sum(r["expired"] for r in results) == 2000
    assert sum(r["versions"] for r in results) == 2000
    assert keys(tenant_a) == {"user:u1:lang"} and keys(tenant_b) == set()
    assert MemoryVersion.objects.count() == 1
    for tenant, n in ((tenant_a, 1500), (tenant_b, 500)):
        assert sum(e.count for e in purge_events(tenant)) == n
    # One event per tenant per batch: never more events than batches.
    assert len(purge_events()) <= sum(r["batches"] for r in results) * 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_purge_skips_a_row_a_writer_holds_instead_of_waiting():
    tenant = make_tenant("acme")
    seed_expired(tenant, 10)
    locked = Memory.objects.get(key="bulk:0:k")
    holding, release = threading.Event(), threading.Event()

    def writer():
        with transaction.atomic():
            Memory.objects.select_for_update().get(pk=locked.pk)
            holding.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=lambda: (writer(), connection.close()))
    thread.start()
    try:
        assert holding.wait(timeout=10)
        (result,) = in_threads(lambda: services.purge_expired(batch_size=3), timeout=20)
    finally:
        release.set()
        thread.join(timeout=30)
    assert result["expired"] == 9
    assert keys(tenant) == {"bulk:0:k"}
    assert services.purge_expired()["expired"] == 1
    assert keys(tenant) == set()


def test_set_retention_rule_command_sets_and_removes_a_rule(tenant_a):
    from memories.models import RetentionRule

    out = StringIO()
    call_command("set_retention_rule", tenant=tenant_a.slug, prefix="session:", default_ttl_seconds=86400, stdout=out)
    rule = RetentionRule.objects.get(tenant=tenant_a, prefix="session:")
    assert rule.default_ttl_seconds == 86400 and "86400" in out.getvalue()
    call_command("set_retention_rule", tenant=tenant_a.slug, prefix="session:", stdout=StringIO())
    assert not RetentionRule.objects.filter(tenant=tenant_a).exists()
    with pytest.raises(CommandError):
        call_command("set_retention_rule", tenant=tenant_a.slug, prefix="bad::p", default_ttl_seconds=5)


@pytest.mark.postgres
@pytest.mark.parametrize(
    "args, option",
    [
        (["--rates", "-1"], "--rates"),
        (["--rates", "fast"], "--rates"),
        (["--wal-compressions", "off,gzip"], "--wal-compressions"),
        (["--batch-size", "0"], "--batch-size"),
    ],
)
def test_bench_purge_refuses_bad_variants_before_it_writes_anything(db, args, option):
    with pytest.raises(CommandError, match=option):
        run("bench_purge", *args)
    assert not Memory.objects.exists() and not AuditEvent.objects.exists()
