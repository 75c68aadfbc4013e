"""Worst cases of the background work, found by an outside review (rv4): what a tenant's data
or an LLM endpoint's answer can make a worker hold, and what overlapping schedule runs do.

Against the real database; only the outside world (the LLM endpoint) is faked.
"""

from __future__ import annotations

import json
import threading
import tracemalloc
from datetime import timedelta

import pytest
from django.utils import timezone

from memories import services
from memories.models import Job, Memory
from memories.services import summaries
from tests.factories import SYSTEM, make_tenant


def _bulk(tenant, prefix: str, n: int, value) -> None:
    # One row per INSERT: PostgreSQL parses each jsonb value in the statement's memory.
    Memory.objects.bulk_create(
        [
            Memory(tenant=tenant, key=f"{prefix}k{i:04d}", namespace=prefix.rstrip(":"), value=value, version=1)
            for i in range(n)
        ],
        batch_size=1,
    )


@pytest.mark.django_db
def test_a_digest_reads_only_the_values_it_needs_not_a_page_of_401_whole_values(settings):
    """The digest keeps ZEROMEM_SUMMARY_MAX_CHARS (2000) characters, but read the first
    max_chars // 5 + 1 = 401 memories under the prefix whole, values and all, before looking
    at one: 401 values of 16 KiB (the default value limit) of "[{},{},...]" held 168 MB of
    Python objects in the worker (2.3 s) for a digest of one line; at the hard cap (256 KiB,
    a tenant's limit raised) ~2.7 GB, every attempt, on every worker taking such a job."""
    tenant = make_tenant("digest-mem")
    value = [{}] * ((settings.ZEROMEM_VALUE_MAX_BYTES - 10) // 3)  # "[{},{},...]" under 16 KiB
    assert len(json.dumps(value, separators=(",", ":"))) <= settings.ZEROMEM_VALUE_MAX_BYTES
    _bulk(tenant, "session:s1:", 401, value)

    tracemalloc.start()
    try:
        digest = summaries._digest(tenant=tenant, prefix="session:s1:", max_chars=settings.ZEROMEM_SUMMARY_MAX_CHARS)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert len(digest.sources) == 1 and digest.left_out == 400
    assert len(digest.text) <= settings.ZEROMEM_SUMMARY_MAX_CHARS
    print(f"digest peak {peak / 1e6:.1f} MB")
    assert peak < 12 * 1024 * 1024, f"{peak / 1e6:.1f} MB"


@pytest.mark.django_db
def test_a_digest_of_many_small_values_still_reads_every_line_it_keeps(settings):
    """Reading in small groups changes nothing of what the digest holds: 500 short values,
    as many lines as fit, the rest counted."""
    tenant = make_tenant("digest-small")
    _bulk(tenant, "session:s2:", 500, "v")
    digest = summaries._digest(tenant=tenant, prefix="session:s2:", max_chars=2000)
    lines = digest.text.split("\n")
    assert lines[-1] == f"(+{digest.left_out} more not shown)"
    assert len(lines) - 1 == len(digest.sources) > 100
    assert len(digest.sources) + digest.left_out == 500
    assert [m.key for m in digest.sources] == sorted(m.key for m in digest.sources)[::-1]  # newest (last id) first


# --- overlapping runs of a schedule ------------------------------------------------------------


def _overlapping(task_path: str, monkeypatch, pause_in: tuple[object, str]) -> list:
    """Run ``task_path`` twice at once, in two threads with their own connections, each
    pausing (up to 3 s) in ``pause_in`` until the other gets there too: two copies of a
    schedule's task that a backlogged queue hands to two workers at the same moment (django-q2's
    scheduler enqueues a schedule when it is due, whether its last copy has run or not)."""
    from django.db import connection
    from django.utils.module_loading import import_string

    owner, name = pause_in
    real = getattr(owner, name)
    both_there = threading.Barrier(2, timeout=3)

    def paused(*args, **kwargs):
        result = real(*args, **kwargs)
        try:
            both_there.wait()
        except threading.BrokenBarrierError:
            pass  # the other copy never got here
        return result

    monkeypatch.setattr(owner, name, paused)
    task = import_string(task_path)
    results: list = [None, None]

    def run(i):
        try:
            results[i] = task()
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_overlapping_runs_of_the_idle_sessions_schedule_start_one_job_per_session(monkeypatch):
    """Two copies of ``summarize_idle_sessions_task`` running at once both found the session
    idle with no job pending and both started one (the schedule's starts are not capped, so
    no lock ordered them): two jobs, two LLM calls paid, two versions of the summary. One
    copy runs; the other returns at once."""
    tenant = make_tenant("idle-twice")
    old = timezone.now() - timedelta(hours=3)
    for key in ("session:s1:a", "session:s1:b"):
        services.memory_write(tenant=tenant, actor=SYSTEM, key=key, value="v")
    Memory.objects.filter(tenant=tenant).update(updated_at=old, created_at=old)

    results = _overlapping("memories.tasks.summarize_idle_sessions_task", monkeypatch, (summaries, "_idle_due_sql"))

    jobs = list(Job.objects.filter(tenant=tenant).values_list("params__prefix", flat=True))
    assert jobs == ["session:s1:"], results
    assert sorted(results, key=str) == [1, {"skipped": "another run of this task is in progress"}]


def _probe(result):
    """A schedule-like task that returns its connection to the pool halfway (as a task that
    waits on something else would), then queries again."""
    from django.db import connection

    from zeromem.kernel.tasks import one_at_a_time

    @one_at_a_time
    def probe():
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        connection.close()  # with the pool: back to it, still open
        with connection.cursor() as cursor:
            cursor.execute("SELECT %s", [result])
            return cursor.fetchone()[0]

    return probe


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_run_that_hands_its_connection_back_midway_leaves_no_hold_on_the_next_runs():
    """A session-level advisory lock went back to the pool with the connection the task gave
    up halfway; its unlock, on the next connection the pool handed out, released nothing, and
    a later run on that other connection found the lock held: the schedule was skipped until
    the pooled connection closed. The lease is the cache's, not a connection's."""
    probe = _probe(7)
    assert [probe() for _ in range(4)] == [7, 7, 7, 7]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_lease_of_a_killed_run_lapses_and_the_next_run_goes_ahead():
    """A worker killed mid-run gives nothing back: its lease lapses after Q_TIMEOUT plus a
    minute (here set to lapse in a second), and until then the copies are skipped."""
    import time

    from django.core.cache import cache

    probe = _probe(8)
    name = f"zeromem:run:{probe.__wrapped__.__module__}.{probe.__wrapped__.__qualname__}"
    assert cache.add(name, "a killed worker's", timeout=1)
    assert probe() == {"skipped": "another run of this task is in progress"}
    time.sleep(1.2)
    assert probe() == 8
    assert cache.get(name) is None  # given back
