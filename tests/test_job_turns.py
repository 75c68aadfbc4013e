"""Tenants take turns in the summarize queue.

django-q2's queue is one first-come line for every tenant: tenant A's 20 queued summarize jobs
(its cap) put tenant B's one behind all of them — with an LLM summarizer, minutes. A delivery
of ``memories.tasks.summarize_task`` is therefore a turn: it runs the waiting job of the tenant
served longest ago (services.jobs.job_claim_next), whichever job it was enqueued for.

These tests hand the deliveries to the task in queue order, as a single worker would;
tests/test_qcluster.py runs the same with a real cluster.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from memories import tasks
from memories.models import Job
from memories.services import summaries
from memories.services.jobs import job_claim_next
from tests.factories import SYSTEM, make_tenant, write


def _jobs(tenant, n, name="s"):
    return [summaries.summarize_start(tenant=tenant, actor=SYSTEM, prefix=f"session:{name}{i}:").pk for i in range(n)]


def _run_order(ids):
    jobs = Job.objects.filter(pk__in=ids).order_by("started_at", "pk")
    return [job.pk for job in jobs if job.started_at is not None]


def test_a_delivery_runs_the_waiting_job_of_the_tenant_served_longest_ago(tenant_a, tenant_b):
    write(tenant_a, "session:a0:k", "a fact")
    a = _jobs(tenant_a, 4, "a")
    b = _jobs(tenant_b, 1, "b")
    for job_id in a + b:  # the queue's order: A's four, then B's
        tasks.summarize_task(job_id)
    assert Job.objects.filter(pk__in=a + b, status="succeeded").count() == 5
    # First come on the first turn (neither served yet); then B, which A's turn left waiting.
    assert _run_order(a + b) == [a[0], b[0], a[1], a[2], a[3]]
    # A job run on another's turn is the job it is: its own summary, its own result.
    assert Job.objects.get(pk=a[0]).result["sources"] == 1
    assert Job.objects.get(pk=b[0]).result["sources"] == 0


def test_three_tenants_take_turns_whatever_order_their_jobs_were_queued_in(db):
    t1, t2, t3 = make_tenant("turn-1"), make_tenant("turn-2"), make_tenant("turn-3")
    one, two, three = _jobs(t1, 3), _jobs(t2, 3), _jobs(t3, 1)
    for job_id in one + two + three:
        tasks.summarize_task(job_id)
    tenant_of = dict(Job.objects.values_list("pk", "tenant__slug"))
    assert [tenant_of[pk] for pk in _run_order(one + two + three)] == [
        "turn-1",
        "turn-2",
        "turn-3",
        "turn-1",
        "turn-2",
        "turn-1",
        "turn-2",
    ]


def test_a_delivery_for_a_job_already_run_on_another_turn_runs_the_next_or_nothing(tenant_a, tenant_b):
    a = _jobs(tenant_a, 2, "a")
    b = _jobs(tenant_b, 1, "b")
    tasks.summarize_task(a[0])  # runs a0
    tasks.summarize_task(a[1])  # runs b0 (A was served)
    # b0's own delivery: a1 is all that waits.
    assert tasks.summarize_task(b[0])["sources"] == 0
    assert Job.objects.get(pk=a[1]).status == "succeeded"
    # Nothing waits: a duplicate delivery runs nothing and says what became of its job.
    attempts = dict(Job.objects.filter(pk__in=a + b).values_list("pk", "attempts"))
    assert tasks.summarize_task(b[0]) == Job.objects.get(pk=b[0]).result
    assert dict(Job.objects.filter(pk__in=a + b).values_list("pk", "attempts")) == attempts == dict.fromkeys(a + b, 1)


def test_a_live_attempt_is_not_started_twice_by_a_delivery(tenant_a):
    (job_id,) = _jobs(tenant_a, 1)
    assert summaries._attempt_begin(job_id).status == "running"  # a worker is on it
    assert tasks.summarize_task(job_id) == {"status": "running", "job_id": job_id}
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.attempts) == ("running", 1)


def test_an_attempt_older_than_q_timeout_is_taken_again_its_worker_is_gone(tenant_a, tenant_b, settings):
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "timeout": 300}
    (dead,) = _jobs(tenant_a, 1, "a")
    summaries._attempt_begin(dead)
    Job.objects.filter(pk=dead).update(started_at=timezone.now() - timedelta(seconds=301))
    (fresh,) = _jobs(tenant_b, 1, "b")
    # B was never served: its job goes first; then the dead attempt's job runs again.
    tasks.summarize_task(fresh)
    assert Job.objects.get(pk=fresh).status == "succeeded"
    tasks.summarize_task(dead)
    job = Job.objects.get(pk=dead)
    assert (job.status, job.attempts) == ("succeeded", 2)


def test_a_failed_attempt_is_retried_no_sooner_than_q_timeout_after_it_began(tenant_a, tenant_b, settings):
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "timeout": 300}
    (failed,) = _jobs(tenant_a, 1, "a")
    summaries._attempt_begin(failed)
    Job.objects.filter(pk=failed).update(status="queued", error="attempt 1 of 5 failed: SummarizerError: 502")
    (other,) = _jobs(tenant_b, 1, "b")
    tasks.summarize_task(other)
    tasks.summarize_task(other)  # a second delivery: the failed job's retry is not due yet
    assert Job.objects.get(pk=failed).attempts == 1
    Job.objects.filter(pk=failed).update(started_at=timezone.now() - timedelta(seconds=301))
    tasks.summarize_task(failed)  # django-q2's redelivery (after Q_RETRY > Q_TIMEOUT)
    job = Job.objects.get(pk=failed)
    assert (job.status, job.attempts) == ("succeeded", 2)


def test_cancelled_and_finished_jobs_are_never_claimed(tenant_a):
    ids = _jobs(tenant_a, 3)
    Job.objects.filter(pk=ids[0]).update(status="cancelled")
    Job.objects.filter(pk=ids[1]).update(status="failed", attempts=5)
    with transaction.atomic():
        assert job_claim_next(kind=Job.Kind.SUMMARIZE).pk == ids[2]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_workers_claiming_at_once_get_different_jobs_and_neither_waits(monkeypatch):
    monkeypatch.setattr(summaries, "_enqueue", lambda job_id: None)  # committed, not run inline
    tenant = make_tenant("turn-race")
    ids = set(_jobs(tenant, 2))
    claimed: list[int] = []
    both = threading.Barrier(2, timeout=10)
    errors: list[BaseException] = []

    def worker():
        try:
            with transaction.atomic():
                job = job_claim_next(kind=Job.Kind.SUMMARIZE)
                claimed.append(job.pk)
                both.wait()  # both hold their claim's lock here
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert errors == []
    assert sorted(claimed) == sorted(ids)


@pytest.mark.postgres
def test_the_claim_reads_the_pending_jobs_and_probes_each_tenants_latest_start(tenant_a, tenant_b):
    """A month of finished jobs (what ZEROMEM_JOB_RETENTION_DAYS keeps) is not read."""
    now = timezone.now()
    Job.objects.bulk_create(
        Job(
            tenant=tenant,
            kind=Job.Kind.SUMMARIZE,
            status=Job.Status.SUCCEEDED,
            attempts=1,
            created_at=now - timedelta(minutes=n + lag),
            started_at=now - timedelta(minutes=n + lag),
            finished_at=now - timedelta(minutes=n + lag),
        )
        for tenant, lag in ((tenant_a, 0), (tenant_b, 60))  # B was served an hour before A
        for n in range(5000)
    )
    _jobs(tenant_a, 2, "a")
    _jobs(tenant_b, 1, "b")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE memories_job")
    with CaptureQueriesContext(connection) as ctx, transaction.atomic():
        assert job_claim_next(kind=Job.Kind.SUMMARIZE).tenant == tenant_b
    (claim,) = [q["sql"] for q in ctx.captured_queries if "SKIP LOCKED" in q["sql"]]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + claim)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "job_tenant_pending" in plan and "job_tenant_started" in plan, plan
    assert "Seq Scan on memories_job" not in plan, plan
