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
