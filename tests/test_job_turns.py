"""Tenants take turns at the workers: summarize jobs and forget requests.

django-q2's queue is one first-come line for every tenant: tenant A's 20 queued summarize jobs
(its cap) put tenant B's job or forget request behind all of them — with an LLM summarizer,
minutes. A delivery of ``memories.tasks.summarize_task`` or ``forget_request_task`` is therefore
a turn: it runs what waits of the tenant served longest ago (services.jobs.turn_claim_next),
whichever job or request it was enqueued for.

These tests hand the deliveries to the task in queue order, as a single worker would;
tests/test_qcluster.py runs the same with a real cluster.
"""

from __future__ import annotations

import itertools
import threading
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_q.models import OrmQ
from django_q.signing import SignedPackage
from django_q.tasks import async_task

from memories import services, tasks
from memories.models import ForgetRequest, Job
from memories.services import forget, summaries
from memories.services.jobs import turn_claim_next
from tests.factories import SYSTEM, make_tenant, seed_user, write


def _jobs(tenant, n, name="s"):
    return [summaries.summarize_start(tenant=tenant, actor=SYSTEM, prefix=f"session:{name}{i}:").pk for i in range(n)]


def _claim_of(sql: str, table: str) -> bool:
    return "SKIP LOCKED" in sql and sql.startswith(f'SELECT "{table}".')


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
    # (what django-q2 keeps: the job's result without the summary's key)
    assert tasks.summarize_task(b[0]) == {k: v for k, v in Job.objects.get(pk=b[0]).result.items() if k != "key"}
    assert dict(Job.objects.filter(pk__in=a + b).values_list("pk", "attempts")) == attempts == dict.fromkeys(a + b, 1)


def test_a_live_attempt_is_not_started_twice_by_a_delivery(tenant_a):
    (job_id,) = _jobs(tenant_a, 1)
    assert summaries.summarize_attempt_begin(job_id).status == "running"  # a worker is on it
    assert tasks.summarize_task(job_id) == {"status": "running", "job_id": job_id}
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.attempts) == ("running", 1)


def test_an_attempt_older_than_q_timeout_is_taken_again_its_worker_is_gone(tenant_a, tenant_b, settings):
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "timeout": 300}
    (dead,) = _jobs(tenant_a, 1, "a")
    summaries.summarize_attempt_begin(dead)
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
    summaries.summarize_attempt_begin(failed)
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
        assert turn_claim_next().pk == ids[2]


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
                job = turn_claim_next()
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
        assert turn_claim_next().tenant == tenant_b
    (claim,) = [q["sql"] for q in ctx.captured_queries if _claim_of(q["sql"], "memories_job")]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + claim)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "job_tenant_pending" in plan and "job_tenant_started" in plan, plan
    assert "Seq Scan on memories_job" not in plan, plan


# --- forget requests take turns too ---------------------------------------------------------
#
# A forget request's deliveries (its first, and one each time a step hands its worker back)
# were first-come too: another tenant's forget found up to 20 of one tenant's summarize
# deliveries ahead of it (with an LLM summarizer, 20 × its answer time ÷ Q_WORKERS), and one
# tenant's pile of forgets put everyone's work behind them. A delivery of either task now runs
# what waits of the tenant served longest ago, a forget before a job of the same tenant.


@pytest.fixture
def turns(monkeypatch):
    """What each delivery ran, in order: ("forget", request id) per step, ("job", job id) per
    attempt."""
    ran: list[tuple[str, int]] = []
    step_run, attempt_run = forget.forget_step_run, summaries.summarize_attempt_run

    def forget_step(request, **kwargs):
        ran.append(("forget", request.pk))
        return step_run(request, **kwargs)

    def job_attempt(job):
        ran.append(("job", job.pk))
        return attempt_run(job)

    monkeypatch.setattr(forget, "forget_step_run", forget_step)
    monkeypatch.setattr(summaries, "summarize_attempt_run", job_attempt)
    return ran


def _forget(tenant, user="u1", n=2):
    seed_user(tenant, user, n=n, versions=1)
    return services.forget_request_create(tenant=tenant, actor=SYSTEM, subject=user).pk


def test_another_tenants_forget_request_takes_the_next_turn_whatever_queued_ahead_of_it(tenant_a, tenant_b, turns):
    write(tenant_a, "session:a0:k", "a fact")
    tasks.summarize_task(_jobs(tenant_a, 1, "x")[0])  # A has been served
    turns.clear()
    a = _jobs(tenant_a, 4, "a")
    Job.objects.filter(pk=a[1]).update(status="cancelled")  # its key was revoked: never run
    b = _forget(tenant_b)
    for job_id in a:  # the queue's order: A's four, then B's forget
        tasks.summarize_task(job_id)
    tasks.forget_request_task(b)
    assert turns == [("forget", b), ("job", a[0]), ("job", a[2]), ("job", a[3])]
    assert ForgetRequest.objects.get(pk=b).status == "completed"
    assert dict(Job.objects.filter(pk__in=a).values_list("pk", "status")) == {
        a[0]: "succeeded",
        a[1]: "cancelled",
        a[2]: "succeeded",
        a[3]: "succeeded",
    }
    # The delivery left over (one per job or step enqueued; the cancelled job's ran a turn)
    # runs nothing and says what became of its own.
    assert tasks.forget_request_task(b)["status"] == "completed"
    assert Job.objects.get(pk=a[1]).attempts == 0 and ForgetRequest.objects.get(pk=b).attempts == 1


def test_one_tenants_pile_of_forget_requests_takes_turns_with_the_others(tenant_a, tenant_b, tenant_c, turns):
    a = [_forget(tenant_a, f"u{i}") for i in range(3)]
    b = _forget(tenant_b)
    (c,) = _jobs(tenant_c, 1, "c")
    for request_id in a + [b]:
        tasks.forget_request_task(request_id)
    tasks.summarize_task(c)
    # No tenant served yet: a forget first; then B and C, never served; then A's others.
    assert turns == [("forget", a[0]), ("forget", b), ("job", c), ("forget", a[1]), ("forget", a[2])]
    assert set(ForgetRequest.objects.values_list("status", flat=True)) == {"completed"}


def test_a_sliced_forget_waits_for_its_tenants_next_turn_counted_from_the_end_of_its_step(
    tenant_a, tenant_b, turns, monkeypatch
):
    """A step hands its worker back after FORGET_SLICE_SECONDS (0 here: every batch or redaction
    page is a step) and enqueues a delivery; the request then waits for its tenant's turn, which
    counts from the step's end: a step of a minute is not one short turn."""
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", False)  # enqueued for real, run here by hand
    monkeypatch.setattr(forget, "FORGET_SLICE_SECONDS", 0)
    request = _forget(tenant_a, n=2)
    b = _jobs(tenant_b, 3, "b")
    OrmQ.objects.all().delete()  # (no commit in this test: nothing was enqueued on commit)
    for func, arg in [(tasks.forget_request_task, request)] + [(tasks.summarize_task, j) for j in b]:
        async_task(f"memories.tasks.{func.__name__}", arg)
    deliveries = 0
    while entries := list(OrmQ.objects.order_by("pk")):  # a single worker, first come
        entry = entries[0]
        entry.delete()
        task = SignedPackage.loads(entry.payload)
        getattr(tasks, task["func"].rsplit(".", 1)[1])(*task["args"], **task["kwargs"])
        deliveries += 1
    step = ("forget", request)
    assert turns[:6] == [step, ("job", b[0]), step, ("job", b[1]), step, ("job", b[2])]
    assert set(turns[6:]) <= {step}  # the rest of its steps (if any), B done
    assert ForgetRequest.objects.get(pk=request).status == "completed"
    # One delivery per job and per step, none left over: one line of steps, not two.
    assert deliveries == len(turns) == 3 + ForgetRequest.objects.get(pk=request).attempts


def test_a_forget_step_that_holds_a_worker_is_not_begun_again_until_q_timeout_after_it_began(
    tenant_a, settings, turns, monkeypatch
):
    """A second delivery of a request whose step is live (the resume schedule's, a redelivery)
    runs nothing; a step that failed, or whose worker died, is taken again Q_TIMEOUT after it
    began, as a job's attempt is — django-q2's redelivery (after Q_RETRY > Q_TIMEOUT) takes it."""
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "timeout": 300}
    request_id = _forget(tenant_a)
    assert forget.forget_step_begin(request_id).stepping  # a worker is on it
    assert tasks.forget_request_task(request_id)["status"] == "running"
    assert turns == [] and ForgetRequest.objects.get(pk=request_id).attempts == 1

    ForgetRequest.objects.filter(pk=request_id).update(turn_at=timezone.now() - timedelta(seconds=301))
    real = forget._erase_batch
    monkeypatch.setattr(forget, "_erase_batch", lambda *a, **k: (_ for _ in ()).throw(OperationalError("gone")))
    with pytest.raises(tasks.TaskFailed, match="OperationalError"):
        tasks.forget_request_task(request_id)  # taken again: attempt 2, which fails
    failed = ForgetRequest.objects.get(pk=request_id)
    assert (failed.status, failed.attempts, failed.stepping) == ("running", 2, True)
    monkeypatch.setattr(forget, "_erase_batch", real)
    assert tasks.forget_request_task(request_id)["status"] == "running"  # its retry is not due
    assert ForgetRequest.objects.get(pk=request_id).attempts == 2

    ForgetRequest.objects.filter(pk=request_id).update(turn_at=timezone.now() - timedelta(seconds=301))
    assert tasks.forget_request_task(request_id)["status"] == "completed"  # the redelivery
    done = ForgetRequest.objects.get(pk=request_id)
    assert (done.attempts, done.stepping, done.receipt["memories"]) == (3, False, 4)  # 2 live, trashed, expired


@pytest.mark.postgres
def test_the_claim_reads_the_pending_forget_requests_and_probes_each_tenants_latest_turn(tenant_a, tenant_b):
    """The receipts every tenant keeps (completed requests are never purged) are not read."""
    now = timezone.now()
    ForgetRequest.objects.bulk_create(
        ForgetRequest(
            tenant=tenant,
            status=ForgetRequest.Status.COMPLETED,
            subject=f"u{n}",
            requested_by_kind="system",
            created_at=now - timedelta(minutes=n + lag),
            due_at=now,
            turn_at=now - timedelta(minutes=n + lag),
        )
        for tenant, lag in ((tenant_a, 0), (tenant_b, 60))  # B was served an hour before A
        for n in range(5000)
    )
    _forget(tenant_a, "x1")
    _forget(tenant_a, "x2")
    b = _forget(tenant_b, "x3")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE memories_forgetrequest")
    with CaptureQueriesContext(connection) as ctx, transaction.atomic():
        assert turn_claim_next().pk == b
    (claim,) = [q["sql"] for q in ctx.captured_queries if _claim_of(q["sql"], "memories_forgetrequest")]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + claim)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    # The waiting requests from an index of the open ones (forget_pending, or forget_open_due:
    # the metrics gauge's, which holds them too), then one probe per tenant for its last turn.
    assert ("forget_pending" in plan or "forget_open_due" in plan) and "forget_tenant_turn" in plan, plan
    assert "Seq Scan on memories_forgetrequest" not in plan, plan


def test_a_forget_steps_turn_counts_from_when_it_handed_its_worker_back(tenant_a, tenant_b, monkeypatch):
    """B's job began while A's step held a worker (2 workers): B's next job goes before A's
    next step, whose turn counts from its end, not its start."""
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", False)  # the hand-back's delivery queued, not run here
    monkeypatch.setattr(forget, "FORGET_SLICE_SECONDS", 0)
    request_id = _forget(tenant_a)
    b = _jobs(tenant_b, 2, "b")
    step = forget.forget_step_begin(request_id)  # worker 1
    summaries.summarize_attempt_run(summaries.summarize_attempt_begin(b[0]))  # worker 2, meanwhile
    assert forget.forget_step_run(step)["continued"] is True  # worker 1 hands back
    with transaction.atomic():
        assert turn_claim_next().pk == b[1]


def test_another_jobs_failures_never_drop_an_innocent_jobs_only_queue_entry(tenant_a, settings, monkeypatch):
    # django-q2 counts a queue entry's failed deliveries (Task.attempt_count) and drops the
    # entry at Q_MAX_ATTEMPTS. A delivery is a turn: it failed when the attempt it ran failed,
    # whichever job's that was. With ZEROMEM_JOB_MAX_ATTEMPTS above Q_MAX_ATTEMPTS, a failing
    # job X outlived its own entry and went on failing on an innocent job Y's entry (X older
    # and waiting on each of Y's turns) until django-q2 dropped that one too: Y never ran, no
    # entry left, until the summarize-jobs-resume schedule took it (2 x Q_RETRY + up to 10 min).
    from tests.test_summaries import FakeLLM

    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    llm = FakeLLM()
    llm.mode = "error"
    try:
        settings.ZEROMEM_LLM_BASE_URL = llm.url
        settings.ZEROMEM_JOB_MAX_ATTEMPTS = 10
        q_max = settings.Q_CLUSTER["max_attempts"]
        assert q_max == 5
        write(tenant_a, "session:x0:k", "a fact")
        (x,) = _jobs(tenant_a, 1, "x")
        # django-q2's entries: [due, order, job id, failed deliveries]; a worker takes the
        # first due, a failed delivery comes back after Q_RETRY (> Q_TIMEOUT).
        queue, order = [], itertools.count()
        retry = timedelta(seconds=settings.Q_CLUSTER["retry"])
        now = [timezone.now()]
        monkeypatch.setattr(timezone, "now", lambda: now[0])

        def enqueue(job_id):
            queue.append([now[0], next(order), job_id, 0])

        monkeypatch.setattr(summaries, "summarize_enqueue", enqueue)

        def run_queue():
            while queue:
                entry = min(queue)
                now[0] = max(now[0], entry[0])
                try:
                    tasks.summarize_task(entry[2])
                except tasks.TaskFailed:
                    entry[3] += 1
                    entry[0] = now[0] + retry
                    if entry[3] >= q_max:
                        queue.remove(entry)  # django-q2 acknowledges it: gone
                else:
                    queue.remove(entry)
                now[0] += timedelta(seconds=1)

        enqueue(x)
        run_queue()
        assert Job.objects.get(pk=x).attempts == 5  # X's entry dropped; X has attempts left
        now[0] += retry
        (y,) = _jobs(tenant_a, 1, "y")  # an empty namespace: no LLM call, it cannot fail
        enqueue(y)
        run_queue()
        # Y ran on its own turn, enqueued again when X's failure took it.
        job_y = Job.objects.get(pk=y)
        assert (job_y.status, job_y.attempts) == ("succeeded", 1)
        assert Job.objects.get(pk=x).attempts == 6  # X waits for the resume schedule, bounded
        now[0] += 2 * retry + timedelta(seconds=1)
        monkeypatch.setattr(summaries, "summarize_enqueue", summaries._enqueue)
        with pytest.raises(tasks.TaskFailed):  # inline (django-q2 sync in tests): X's own entry
            summaries.summarize_jobs_resume()
        assert Job.objects.get(pk=x).attempts == 7
    finally:
        llm.close()


def test_a_forget_delivery_whose_turn_ran_a_failing_job_is_enqueued_again_not_failed(
    tenant_a, tenant_b, settings, monkeypatch
):
    from tests.test_summaries import FakeLLM

    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    llm = FakeLLM()
    llm.mode = "error"
    try:
        settings.ZEROMEM_LLM_BASE_URL = llm.url
        request = _forget(tenant_b)
        tasks.forget_request_task(request)  # its own turn: completed
        assert ForgetRequest.objects.get(pk=request).status == "completed"
        write(tenant_a, "session:x0:k", "a fact")
        (x,) = _jobs(tenant_a, 1, "x")
        again = []
        monkeypatch.setattr(forget, "forget_enqueue", again.append)
        # The request's redelivery (a lost acknowledgement) takes A's turn, whose attempt fails.
        assert tasks.forget_request_task(request) == {"status": "enqueued_again", "forget_request": request}
        assert again == [request]
        job = Job.objects.get(pk=x)
        assert (job.status, job.attempts) == ("queued", 1)
        # Its own delivery still raises for its own failure: django-q2 retries that one.
        Job.objects.filter(pk=x).update(started_at=timezone.now() - timedelta(hours=1))
        with pytest.raises(tasks.TaskFailed):
            tasks.summarize_task(x)
        assert Job.objects.get(pk=x).attempts == 2
    finally:
        llm.close()
