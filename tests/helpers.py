"""Small helpers shared by the test modules: reading state and checking answers (data is
built by tests/factories.py; fixtures live in conftest.py)."""

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from django.db import transaction

from audit.models import AuditEvent
from memories.models import Memory, MemoryVersion


def row_counts() -> tuple[int, int]:
    """(Memory rows, MemoryVersion rows): compare before/after to prove nothing was written."""
    return Memory.objects.count(), MemoryVersion.objects.count()


def memory_rows(tenant, **filters) -> list[tuple]:
    """(key, version, deleted_at) of every Memory row of ``tenant`` matching ``filters``, sorted."""
    return sorted(Memory.objects.filter(tenant=tenant, **filters).values_list("key", "version", "deleted_at"))


def audit_count() -> int:
    return AuditEvent.objects.count()


def tool_error(body: dict) -> dict:
    """The error object of a refused tool call, after checking the envelope."""
    assert body["status"] == "error", body
    assert set(body["error"]) >= {"code", "message", "field"}, body
    return body["error"]


def rest_error(response) -> dict:
    body = response.json()
    assert set(body["error"]) >= {"code", "message", "field"}, body
    return body["error"]


@contextmanager
def rolled_back_module_data(django_db_blocker, build: Callable) -> Iterator:
    """What ``build()`` makes, for a module-scoped fixture: built once inside a transaction
    that is rolled back when the module is done (each test's own ``db`` transaction nests
    inside it, so a test's writes are undone before the next)."""
    with django_db_blocker.unblock():
        outer = transaction.atomic()
        outer.__enter__()
        try:
            built = build()
        except BaseException:
            transaction.set_rollback(True)
            outer.__exit__(None, None, None)
            raise
    try:
        yield built
    finally:
        with django_db_blocker.unblock():
            transaction.set_rollback(True)
            outer.__exit__(None, None, None)


# Redis tests use this database and fail, not skip, when no Redis answers there.
REDIS_TEST_URL = os.environ.get("ZEROMEM_TEST_REDIS_URL") or "redis://127.0.0.1:6379/7"


def redis_or_fail(url: str = REDIS_TEST_URL):
    """A client of the test Redis database, emptied; the test fails if Redis is missing."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.flushdb()
    except redis.RedisError as exc:
        pytest.fail(f"this test needs Redis at {url} (set ZEROMEM_TEST_REDIS_URL): {exc}")
    return client


def stop_process_group(process, *, grace: float) -> None:
    """Stop a server started with ``start_new_session=True``: SIGTERM to its main process (the
    graceful stop), ``grace`` seconds for it, then SIGKILL to whatever is left of its process
    group (a worker stuck in a task, a stray child)."""
    try:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)
