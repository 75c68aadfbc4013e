"""A write over an existing memory in fewer round trips (issue 11): on PostgreSQL, unwatched,
its UPDATE, version INSERT and audit INSERT go as one statement (zeromem/kernel/hotsql.py
``holding``) — same rows, same errors, same row lock; ``ZEROMEM_WRITE_ONE_STATEMENT=false``
sends them one by one as before."""

import threading

import pytest
from django.db import IntegrityError, connection, transaction

from audit.models import AuditEvent
from memories import services
from memories.models import Memory, MemoryVersion
from tests.factories import SYSTEM, make_tenant, write
from tests.helpers import RoundTrips, start_thread, wait_for_a_lock_waiter
from zeromem.kernel import hotsql
from zeromem.kernel.errors import PreconditionFailed

KEY = "user:u1:pref_lang"
on_postgres = pytest.mark.skipif(connection.vendor != "postgresql", reason="one statement on PostgreSQL only")


def _write(tenant, value, **kwargs):
    return services.memory_write(tenant=tenant, actor=SYSTEM, key=KEY, value=value, **kwargs)


def _history(tenant):
    memory = Memory.objects.get(tenant=tenant, key=KEY, deleted_at__isnull=True)
    return memory.version, list(memory.versions.order_by("version").values_list("version", "value"))


@on_postgres
@pytest.mark.parametrize("one_statement, trips", [(True, 4), (False, 6)])
def test_a_write_over_an_existing_memory_is_four_round_trips(tenant_a, settings, one_statement, trips):
    """BEGIN (here a SAVEPOINT: the test runs in a transaction), the row lock, the UPDATE with
    its version and audit INSERTs, COMMIT (RELEASE): 4 round trips, 6 with the setting off."""
    settings.ZEROMEM_WRITE_ONE_STATEMENT = one_statement
    write(tenant_a, KEY, "zh-CN")
    _write(tenant_a, "en")  # warm-up: the statements are prepared on this connection
    with RoundTrips() as sent:
        result = _write(tenant_a, "de")
    assert sent.count == trips, sent.sent
    assert result.memory.version == 3 and not result.created
    assert _history(tenant_a) == (3, [(1, "zh-CN"), (2, "en"), (3, "de")])
    event = AuditEvent.objects.filter(tenant=tenant_a, action="memory.write").latest("id")
    assert (event.version, event.outcome, event.detail) == (3, "ok", {"created": False})


@on_postgres
def test_a_new_memory_sends_its_version_with_its_audit_event(tenant_a, settings):
    trips = {}
    for n, one_statement in enumerate([False, True, False, True]):
        settings.ZEROMEM_WRITE_ONE_STATEMENT = one_statement
        key = f"user:u{n}:pref_lang"
        with RoundTrips() as sent:
            result = services.memory_write(tenant=tenant_a, actor=SYSTEM, key=key, value="zh-CN")
        assert result.created and result.memory.versions.get().version == 1
        trips[one_statement] = sent.count  # the second of each: its statements prepared
    assert trips[True] == trips[False] - 1, trips


@on_postgres
def test_a_sensitive_write_is_sealed_in_the_one_statement(tenant_a):
    write(tenant_a, KEY, "plain")
    _write(tenant_a, "secret value", sensitive=True)
    memory = Memory.objects.get(tenant=tenant_a, key=KEY, deleted_at__isnull=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT value::text FROM memories_memory WHERE id = %s", [memory.pk])
        stored = cursor.fetchone()[0]
        cursor.execute("SELECT value::text FROM memories_memoryversion WHERE memory_id = %s", [memory.pk])
        versions = [row[0] for row in cursor.fetchall()]
    assert memory.value == "secret value" and memory.sensitive
    assert "secret value" not in stored and all("secret value" not in v and "plain" not in v for v in versions)


@on_postgres
@pytest.mark.parametrize("one_statement", [True, False])
def test_a_failure_in_the_statement_leaves_nothing_and_raises_as_before(tenant_a, settings, one_statement):
    """The version row the write would add exists already (forced): the unique constraint fails
    inside the one statement; the UPDATE and the audit event go with it, the error is the same
    IntegrityError as when the statements were sent one by one."""
    settings.ZEROMEM_WRITE_ONE_STATEMENT = one_statement
    memory = write(tenant_a, KEY, "zh-CN")
    MemoryVersion.objects.create(
        tenant_id=tenant_a.pk, memory=memory, version=2, value="squatter", op="write", actor_kind="system"
    )
    events = AuditEvent.objects.filter(tenant=tenant_a).count()
    with pytest.raises(IntegrityError, match="memoryversion_one_per_version"):
        with transaction.atomic():  # the request's transaction (ATOMIC_REQUESTS-like), rolled back
            _write(tenant_a, "en")
    memory.refresh_from_db()
    assert (memory.version, memory.value) == (1, "zh-CN")
    assert AuditEvent.objects.filter(tenant=tenant_a).count() == events
    assert MemoryVersion.objects.filter(memory=memory).count() == 2  # its own and the squatter
    MemoryVersion.objects.filter(memory=memory, value="squatter").delete()
    _write(tenant_a, "fr", ttl_seconds=60)  # the connection is usable: nothing left held
    assert Memory.objects.get(pk=memory.pk).version == 2


def test_create_only_over_an_existing_memory_writes_nothing(tenant_a):
    write(tenant_a, KEY, "zh-CN")
    events = AuditEvent.objects.filter(tenant=tenant_a, outcome="ok").count()
    with pytest.raises(PreconditionFailed):
        _write(tenant_a, "en", create_only=True)
    assert _history(tenant_a) == (1, [(1, "zh-CN")])
    assert AuditEvent.objects.filter(tenant=tenant_a, outcome="ok").count() == events


def test_nothing_is_held_on_sqlite_or_when_watched(tenant_a):
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection), hotsql.holding():
        assert getattr(connection, hotsql._HELD, None) is None


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_concurrent_writer_waits_for_the_row_lock():
    """The row lock is still taken first: a second write of the key waits for the first
    transaction, then writes the next version over it (no lost update, history exact)."""
    tenant = make_tenant("race")
    write(tenant, KEY, "v1")
    failures, done = [], threading.Event()
    with transaction.atomic():
        _write(tenant, "v2")  # holds the row lock until this block commits
        start_thread(lambda: _write(tenant, "v3"), failures, done=done)
        wait_for_a_lock_waiter("the second writer")
        assert not done.is_set()
    assert done.wait(20) and not failures, failures
    assert _history(tenant) == (3, [(1, "v1"), (2, "v2"), (3, "v3")])
    assert AuditEvent.objects.filter(tenant=tenant, action="memory.write", outcome="ok").count() == 3


# --- A write over a live memory, outside any transaction: two statements, no row lock -------
#
# As a server runs a tool or REST write (autocommit): the memory read, then its UPDATE — while
# the row is still as read — with its version row and audit event as one statement
# (memories.services.memories._write_over_as_read). Anything else is done under the row lock.


def _events(tenant, outcome="ok"):
    return list(
        AuditEvent.objects.filter(tenant=tenant, action="memory.write", outcome=outcome)
        .order_by("id")
        .values_list("version", "detail")
    )


@on_postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("one_statement, without_lock, trips", [(True, True, 2), (True, False, 4), (False, True, 6)])
def test_outside_a_transaction_a_write_over_a_live_memory_is_two_round_trips(
    settings, one_statement, without_lock, trips
):
    """Two round trips; with ZEROMEM_WRITE_WITHOUT_LOCK off, BEGIN, the row lock, one statement,
    COMMIT; with ZEROMEM_WRITE_ONE_STATEMENT off, each statement on its own under the lock."""
    settings.ZEROMEM_WRITE_ONE_STATEMENT = one_statement
    settings.ZEROMEM_WRITE_WITHOUT_LOCK = without_lock
    tenant = make_tenant("plain")
    write(tenant, KEY, "zh-CN", ttl_seconds=600)  # the parameters' types as in the writes after
    _write(tenant, "en", tags=["t"], ttl_seconds=600)  # warm-up: its statements prepared on this connection
    with RoundTrips() as sent:
        result = _write(tenant, "de", tags=["t"], ttl_seconds=600)
    assert sent.count == trips, [" ".join(p[2:])[:80] for p in sent.sent]
    assert (result.memory.version, result.created, result.memory.value) == (3, False, "de")
    assert _history(tenant) == (3, [(1, "zh-CN"), (2, "en"), (3, "de")])
    stored = Memory.objects.get(tenant=tenant, key=KEY, deleted_at__isnull=True)
    assert (stored.tags, stored.value, stored.version) == (["t"], "de", 3)
    assert stored.expires_at is not None and stored.updated_at == result.memory.updated_at
    assert _events(tenant) == [(1, {"created": True}), (2, {"created": False}), (3, {"created": False})]


@on_postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["written", "expired", "trashed"])
def test_a_row_changed_between_the_read_and_the_update_is_written_under_the_lock(monkeypatch, change):
    """Another writer got in between the read and the UPDATE: the one statement writes nothing
    (no version row, no event), and the write is done again under the row lock — over what is
    there now — with one event, as if it had waited for the lock."""
    from datetime import timedelta

    from django.utils import timezone

    from memories import selectors
    from memories.services import memories as memory_service

    tenant = make_tenant("raced")
    write(tenant, KEY, "v1", ttl_seconds=600)
    read = selectors.memory_get_live
    cut_in = []

    def read_then_cut_in(**kwargs):
        current = read(**kwargs)
        if not cut_in:
            cut_in.append(current.version)
            if change == "written":
                failures: list = []
                start_thread(lambda: _write(tenant, "theirs"), failures).join(20)
                assert not failures, failures
            elif change == "expired":
                Memory.objects.filter(pk=current.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
            else:
                Memory.objects.filter(pk=current.pk).update(deleted_at=timezone.now())
        return current

    monkeypatch.setattr(memory_service.selectors, "memory_get_live", read_then_cut_in)
    locked, upsert = [], memory_service._upsert
    monkeypatch.setattr(memory_service, "_upsert", lambda **kw: locked.append(1) or upsert(**kw))
    gone_before = Memory.objects.filter(tenant=tenant, deleted_at__isnull=False).count()
    result = _write(tenant, "mine")
    assert cut_in == [1] and locked == [1]  # done again, under the lock
    if change == "written":
        assert _history(tenant) == (3, [(1, "v1"), (2, "theirs"), (3, "mine")])
        assert [v for v, _d in _events(tenant)] == [1, 2, 3]
    else:  # expired or trashed meanwhile: the write makes a new memory at the key
        assert result.created and result.memory.version == 1
        assert Memory.objects.filter(tenant=tenant, deleted_at__isnull=False).count() == gone_before + 1
        assert _events(tenant) == [(1, {"created": True}), (1, {"created": True})]
    assert AuditEvent.objects.filter(tenant=tenant, outcome__in=["invalid", "conflict"]).count() == 0


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_a_value_turning_sensitive_is_written_under_the_lock_with_its_history_sealed():
    tenant = make_tenant("turning")
    write(tenant, KEY, "plain one")
    _write(tenant, "plain two")
    _write(tenant, "now secret", sensitive=True)
    memory = Memory.objects.get(tenant=tenant, key=KEY, deleted_at__isnull=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT value::text FROM memories_memoryversion WHERE memory_id = %s", [memory.pk])
        stored = [row[0] for row in cursor.fetchall()]
    assert len(stored) == 3 and not any("plain" in v or "secret" in v for v in stored)
    assert memory.value == "now secret" and memory.version == 3


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_writers_of_one_key_lose_nothing():
    """Four threads write one key 25 times each, outside any transaction: every write lands
    as its own version (1-101, none twice, none lost), each with one event."""
    tenant = make_tenant("crowd")
    write(tenant, KEY, "start")
    failures: list = []
    threads = [start_thread(lambda n=n: [_write(tenant, f"w{n}-{i}") for i in range(25)], failures) for n in range(4)]
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    version, history = _history(tenant)
    assert version == 101 and [v for v, _value in history] == list(range(1, 102))
    assert sorted(value for _v, value in history[1:]) == sorted(f"w{n}-{i}" for n in range(4) for i in range(25))
    assert sorted(v for v, _d in _events(tenant)) == list(range(1, 102))
    assert Memory.objects.get(tenant=tenant, key=KEY, deleted_at__isnull=True).value == history[-1][1]


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_a_memory_sealed_between_the_read_and_the_update_stays_sealed(monkeypatch):
    """The re-encryption job seals a memory a tenant rule matches (its sensitive flag, not its
    version): a write read before it and sent after it must not store its value in plaintext —
    under the row lock it would have seen the memory sensitive and kept it so."""
    from memories import selectors
    from memories.services import memories as memory_service
    from memories.services.encryption import reencrypt

    tenant = make_tenant("sealed")
    write(tenant, KEY, {"ssn": "078-05-1120"})  # before the rule: plain
    tenant.sensitive_fields = ["ssn"]
    tenant.save()
    read = selectors.memory_get_live

    def read_then_sealed(**kwargs):
        current = read(**kwargs)
        if current is not None and not current.sensitive:
            reencrypt(tenant_id=tenant.pk)  # commits: the row is sealed, its version as it was
        return current

    monkeypatch.setattr(memory_service.selectors, "memory_get_live", read_then_sealed)
    _write(tenant, {"note": "mine"})
    memory = Memory.objects.get(tenant=tenant, key=KEY, deleted_at__isnull=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT value::text FROM memories_memory WHERE id = %s", [memory.pk])
        (stored,) = cursor.fetchone()
    assert memory.sensitive and memory.value == {"note": "mine"}
    assert "mine" not in stored


@on_postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("model", [Memory, MemoryVersion])
def test_a_write_over_a_live_memory_with_a_save_receiver_goes_through_save(model, monkeypatch):
    """A model with a ``post_save`` receiver is saved through ``save()`` (hotsql sends no
    signals), which would send the held statements first, each on its own (the memory's
    UPDATE committed without its version row and event): a write over a live memory outside a
    transaction is then done under the row lock, in one transaction, as before — not refused."""
    from django.db.models.signals import post_save

    from memories.services import memories as memory_service

    tenant = make_tenant("signalled")
    write(tenant, KEY, "v1")
    saved, locked, upsert = [], [], memory_service._upsert
    monkeypatch.setattr(memory_service, "_upsert", lambda **kw: locked.append(1) or upsert(**kw))

    def receiver(sender, instance, **kwargs):
        saved.append(instance.version)

    post_save.connect(receiver, sender=model, weak=False)
    try:
        result = _write(tenant, "v2")
    finally:
        post_save.disconnect(receiver, sender=model)
    assert (result.memory.version, result.memory.value, saved, locked) == (2, "v2", [2], [1])
    assert _history(tenant) == (2, [(1, "v1"), (2, "v2")])
