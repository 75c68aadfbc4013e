"""Migrations on PostgreSQL ask for their table locks with ``ZEROMEM_MIGRATION_LOCK_TIMEOUT``
(``manage.py migrate``, memories/management/commands/migrate.py): an ALTER TABLE behind a long
transaction fails fast, rolled back and re-runnable, instead of queueing every request behind
its ACCESS EXCLUSIVE lock. ``CREATE INDEX CONCURRENTLY`` keeps waiting (it blocks no request;
failing it would leave an INVALID index).

Each test moves the memories app back a few migrations and forward again through the real
command, with a second connection holding a lock in an open transaction.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.db.migrations.recorder import MigrationRecorder

from tests.helpers import start_thread, wait_for_a_lock_waiter

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _columns(table: str) -> set[str]:
    with connection.cursor() as cursor:
        return {c.name for c in connection.introspection.get_table_description(cursor, table)}


def _applied(name: str) -> bool:
    return MigrationRecorder(connection).migration_qs.filter(app="memories", name=name).exists()


def _lock_timeout() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        return cursor.fetchone()[0]


class _Holder:
    """A second connection that runs ``statements`` in a transaction and keeps it open until released."""

    def __init__(self, *statements: str):
        self.holding, self.release, self.failures = threading.Event(), threading.Event(), []

        def hold():
            with transaction.atomic(), connection.cursor() as cursor:
                for sql in statements:
                    cursor.execute(sql)
                self.holding.set()
                self.release.wait(60)

        self.thread = start_thread(hold, self.failures, done=self.holding)
        assert self.holding.wait(20) and not self.failures, self.failures

    def end(self):
        self.release.set()
        self.thread.join(30)
        assert not self.failures, self.failures


@pytest.fixture
def at_latest_afterwards():
    """The schema is migrated forward to the latest again whatever the test did."""
    yield
    call_command("migrate", verbosity=0)


def test_a_column_migration_behind_a_long_transaction_fails_fast_and_runs_again(settings, at_latest_afterwards):
    settings.ZEROMEM_MIGRATION_LOCK_TIMEOUT = 1
    call_command("migrate", "memories", "0021", verbosity=0)
    assert "keep_answer" not in _columns("memories_idempotencyrecord")
    holder = _Holder("LOCK TABLE memories_idempotencyrecord IN ROW EXCLUSIVE MODE")  # as any write does
    outcome: dict = {}

    def migrate():
        try:
            call_command("migrate", "memories", "0022", verbosity=0)
        except CommandError as exc:
            outcome["error"] = str(exc)
        outcome["lock_timeout"] = _lock_timeout()  # the command's session afterwards

    started = time.monotonic()
    job = start_thread(migrate, failures := [])
    job.join(8)
    waited, stuck = time.monotonic() - started, job.is_alive()
    holder.end()
    job.join(30)
    assert not failures, failures
    assert not stuck, "the migration waited behind the open transaction (no lock_timeout)"
    assert waited < 5, waited
    error = outcome.get("error", "")
    assert "memories.0022_idempotency_keep_answer" in error and "lock" in error, outcome
    assert "ZEROMEM_MIGRATION_LOCK_TIMEOUT" in error and "rolled back" in error and "Run migrate again" in error
    assert outcome["lock_timeout"] == "0"  # the session's own value again, not the migration's
    # Rolled back: no column, not recorded as applied.
    assert "keep_answer" not in _columns("memories_idempotencyrecord")
    assert not _applied("0022_idempotency_keep_answer")

    # Run again once the transaction has ended: applied.
    call_command("migrate", "memories", "0022", verbosity=0)
    assert "keep_answer" in _columns("memories_idempotencyrecord")
    assert _applied("0022_idempotency_keep_answer")
    assert _lock_timeout() == "0"


def test_a_concurrent_index_build_still_waits_for_older_transactions(settings, at_latest_afterwards):
    """CREATE INDEX CONCURRENTLY waits for every transaction older than it (a lock wait, which
    a lock_timeout would cancel, leaving an INVALID index); it blocks no request, so it waits."""
    settings.ZEROMEM_MIGRATION_LOCK_TIMEOUT = 1
    call_command("migrate", "memories", "0020", verbosity=0)
    # A long report: its snapshot is older than the build's, on another table.
    holder = _Holder("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", "SELECT count(*) FROM memories_tenant")
    job = start_thread(lambda: call_command("migrate", "memories", "0021", verbosity=0), failures := [])
    try:
        wait_for_a_lock_waiter("the index build", alive=job.is_alive)
        time.sleep(2)  # twice the lock_timeout
        assert job.is_alive() and not failures, failures  # still waiting, not failed
    finally:
        holder.end()
        job.join(60)
    assert not failures, failures
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = %s",
            ["memory_tenant_expiring"],
        )
        assert cursor.fetchone() == (True,)
    assert _applied("0021_memory_tenant_expiring")


def test_the_setting_off_waits_as_before(settings, at_latest_afterwards):
    """``ZEROMEM_MIGRATION_LOCK_TIMEOUT=0``: no limit, the migration waits for its lock."""
    settings.ZEROMEM_MIGRATION_LOCK_TIMEOUT = 0
    call_command("migrate", "memories", "0021", verbosity=0)
    holder = _Holder("LOCK TABLE memories_idempotencyrecord IN ROW EXCLUSIVE MODE")
    job = start_thread(lambda: call_command("migrate", "memories", "0022", verbosity=0), failures := [])
    try:
        wait_for_a_lock_waiter("the migration", alive=job.is_alive)
        time.sleep(1.5)
        assert job.is_alive() and not failures, failures
    finally:
        holder.end()
        job.join(30)
    assert not failures, failures
    assert _applied("0022_idempotency_keep_answer")
