"""A real ``python manage.py qcluster`` process runs forget requests from the ORM broker.

Every other test runs tasks inline (django-q2 "sync" mode, tests/conftest.py); these undo
that, enqueue for real, and start the cluster as a separate process on the pytest test
database — so they need committed rows (``transaction=True``) and PostgreSQL.

What really happens when a worker is killed (django-q2 1.11, ORM broker), as these tests
observe it:

* The broker "locks" a queue row for ``Q_RETRY`` seconds when it hands it to a worker, and
  deletes it only when the monitor acknowledges a result. A worker killed with ``kill -9``
  never reports one: the guard forks a new worker within ~0.5 s, and the row is handed out
  again once its lock expires — about ``Q_RETRY`` seconds after the killed start.
* django-q2 counts nothing for the killed run: no Task row is written for it, and the one
  written when a later delivery succeeds has ``attempt_count == 1``. ``Q_MAX_ATTEMPTS``
  therefore never stops a task that kills its worker every time: it would be redelivered
  every ``Q_RETRY`` seconds for ever (django-q2 issue #327).
* The request's own counter (``ForgetRequest.attempts``, bounded by
  ``ZEROMEM_JOB_MAX_ATTEMPTS``) does count killed runs: the delivery after the last allowed
  attempt marks the request failed and *returns*, so django-q2 records a success and deletes
  the queue row — the redelivery loop ends there.
"""

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone
from django_q.conf import Conf
from django_q.models import OrmQ, Task
from django_q.signing import SignedPackage
from django_q.tasks import async_task

from audit.models import AuditEvent
from memories import services
from memories.models import ForgetRequest, Job, Memory, MemoryVersion
from memories.services import forget, retention
from tests import qtasks
from tests.factories import SYSTEM, make_tenant, seed_user, summarize
from tests.helpers import memory_rows, stop_process_group

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

REPO_ROOT = Path(settings.BASE_DIR)
Q_TIMEOUT = 8
Q_RETRY = 10  # must exceed Q_TIMEOUT
JOB_MAX_ATTEMPTS = 2
DEADLINE = 60  # seconds any one wait may take before the test fails
RECEIPT_COUNTS = ("memories", "versions", "summaries", "admin_log_entries", "batches", "audit_events_redacted")


def _database_url() -> str:
    db = connection.settings_dict  # inside a test: NAME is the test database
    user = quote(db["USER"] or "", safe="")
    password = f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else ""
    host = db["HOST"] or "localhost"
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgres://{user}{password}@{host}{port}/{quote(db['NAME'], safe='')}"


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (the cluster forks a sentinel, which forks the workers,
    the monitor and the pusher), read from /proc; psutil is not a dependency."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in children.read_text().split()]
            except OSError:  # the thread or process went away meanwhile
                continue
            for kid in kids:
                if kid not in found:
                    found.add(kid)
                    todo.append(kid)
    return found


def _database_sockets(pids: set[int]) -> dict[int, set[int]]:
    """{socket inode: the pids holding it} for the TCP connections of ``pids`` to the
    database port, read from /proc (one connection = one inode)."""
    port = int(connection.settings_dict["PORT"] or 5432)
    to_database = set()
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        for fields in (line.split() for line in lines):
            if int(fields[2].rsplit(":", 1)[1], 16) == port:  # rem_address
                to_database.add(int(fields[9]))
    holders: dict[int, set[int]] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in to_database:
                holders.setdefault(int(target[8:-1]), set()).add(pid)
    return holders


class Cluster:
    def __init__(self, tmp_path: Path):
        self.pids_dir = tmp_path / "pids"
        self.pids_dir.mkdir()
        self.log_path = tmp_path / "qcluster.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "DATABASE_URL": _database_url(),
            "ZEROMEM_ENV": "development",
            "REDIS_URL": "",  # the ORM broker, whatever the shell says
            "ZEROMEM_VAR_DIR": str(self.log_path.parent / "var"),
            "Q_WORKERS": "1",
            "Q_TIMEOUT": str(Q_TIMEOUT),
            "Q_RETRY": str(Q_RETRY),
            "ZEROMEM_LLM_TIMEOUT_SECONDS": "3",  # at most half of Q_TIMEOUT
            "Q_MAX_ATTEMPTS": "5",
            "ZEROMEM_JOB_MAX_ATTEMPTS": str(JOB_MAX_ATTEMPTS),
            "ZEROMEM_QTASKS_DIR": str(self.pids_dir),
            "DB_POOL_MIN_SIZE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "manage.py", "qcluster"],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as a whole
            )

    def stop(self) -> None:
        if self.process is None:
            return
        # Workers still held by tests/qtasks.py (the test ended before killing them) go on.
        for name in (qtasks.RELEASE, qtasks.REDELIVERED):
            (self.pids_dir / name).write_text("")
        # SIGTERM to the main process tells the sentinel to stop its workers, pusher and monitor.
        stop_process_group(self.process, grace=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self, worker: int) -> None:
        """kill -9 of a worker held by tests/qtasks.py (it waits for this, with django-q2's
        timeouts stopped, however long the test took to get here; checked with a 14-s delay
        before the kill, where a sleeping worker was ended by the 8-s ``Q_TIMEOUT`` alarm).
        One bound is left, django-q2's: with the worker held past ``2 × Q_RETRY`` the
        pusher would queue a third copy of the row."""
        os.kill(worker, signal.SIGKILL)

    def let_redelivery_run(self) -> None:
        """The delivery after a kill waits for this (tests/qtasks.py): what the test checks
        in between cannot race with it, however long the checks take."""
        (self.pids_dir / qtasks.REDELIVERED).write_text("")

    def worker_pids(self, request_id: int) -> list[int]:
        """Pids of the workers that started ``request_id``, in order (tests/qtasks.py)."""
        files = sorted(self.pids_dir.glob(f"{request_id}.*.pid"), key=lambda p: int(p.name.split(".")[1]))
        return [int(p.read_text()) for p in files]

    def wait_for(self, what: str, check, timeout: float = DEADLINE):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = check()
            if result:
                return result
            assert self.process.poll() is None, f"qcluster exited ({self.process.returncode}):\n{self.log()}"
            time.sleep(0.1)
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; qcluster log:\n{self.log()}")


@pytest.fixture
def cluster(transactional_db, tmp_path):
    """A ``qcluster`` to start once the queue is set up; stopped — its whole process
    group — before the test database is flushed."""
    running = Cluster(tmp_path)
    yield running
    running.stop()


def _request(pk: int) -> ForgetRequest:
    return ForgetRequest.objects.get(pk=pk)


def _starts(pk: int) -> list[AuditEvent]:
    uid = str(ForgetRequest.objects.get(pk=pk).uid)  # events name a request by its uid (opaque ids)
    return list(AuditEvent.objects.filter(action="forget.start", detail__forget_request=uid).order_by("occurred_at"))


def _queued_request_ids() -> list[int]:
    return sorted(SignedPackage.loads(q.payload)["args"][0] for q in OrmQ.objects.all())


def test_a_real_cluster_takes_a_request_from_the_orm_queue_and_completes_it(
    cluster, monkeypatch, django_capture_on_commit_callbacks
):
    tenant = make_tenant("qc-plain")
    seed_user(tenant, "u1", n=3, versions=2)
    summarize(tenant, "user:u1:", django_capture_on_commit_callbacks)  # still inline (sync mode)
    seed_user(tenant, "u2", n=1, versions=1)
    others = memory_rows(tenant, subject="u2")

    monkeypatch.setattr(Conf, "SYNC", False)  # from here on, enqueue for real

    request = services.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u1")
    # Committed and in django-q2's ORM queue — the id is the whole payload — and not run.
    assert _queued_request_ids() == [request.pk]
    assert SignedPackage.loads(OrmQ.objects.get().payload)["func"] == forget.TASK
    assert _request(request.pk).status == "received"

    cluster.start()
    cluster.wait_for("the request to complete", lambda: _request(request.pk).status == "completed")

    done = _request(request.pk)
    assert (done.status, done.attempts, done.error) == ("completed", 1, "")
    assert {k: done.receipt[k] for k in RECEIPT_COUNTS} == {
        "memories": 5,  # 3 live, 1 trashed, 1 expired
        "versions": 3 * 2 + 2 + 1 + 1,  # the trashed one has 2 (write, delete); + the summary's
        "summaries": 1,
        "admin_log_entries": 0,
        "batches": 1,
        "audit_events_redacted": done.receipt["audit_events_redacted"],
    }
    assert done.receipt["audit_events_redacted"] > 0  # the seeding writes named subject u1
    assert done.receipt["received_at"] <= done.receipt["started_at"] <= done.receipt["completed_at"]
    assert Memory.objects.filter(tenant=tenant, subject="u1").count() == 0
    assert memory_rows(tenant, subject="u2") == others
    # Acknowledged: the queue row is gone once the monitor has saved the result.
    cluster.wait_for("the queue row to be acknowledged", lambda: OrmQ.objects.count() == 0)
    task = Task.objects.get(name=f"forget-request-{request.pk}")
    assert task.success and task.attempt_count == 1
    # (the receipt as django-q2 keeps it: the summaries rebuilt counted, not named)
    kept = {**done.receipt, "summaries_rebuilt": len(done.receipt["summaries_rebuilt"])}
    assert task.result == {"forget_request": request.pk, "status": "completed", "receipt": kept}

    # Each process of the cluster (sentinel, worker, monitor, pusher) talks to the database
    # over connections of its own: forked children do not reuse the sentinel's pooled
    # sockets (zeromem/forking.py; before it, all of them shared the same few connections).
    if (connection.settings_dict["HOST"] or "/").startswith("/"):
        pytest.skip("the socket check reads TCP connections; this database is on a Unix socket")
    processes = {cluster.process.pid} | _descendants(cluster.process.pid)
    sockets = _database_sockets(processes)
    assert len({pid for pids in sockets.values() for pid in pids}) >= 3, sockets  # sentinel, worker, monitor...
    assert {inode: pids for inode, pids in sockets.items() if len(pids) > 1} == {}


def test_a_real_cluster_gives_another_tenants_summarize_job_the_next_turn(cluster, monkeypatch):
    """One worker, tenant A's six jobs queued before tenant B's one: B's runs second (it ran
    seventh when a delivery ran the job it was enqueued for; tests/test_job_turns.py)."""
    monkeypatch.setattr(Conf, "SYNC", False)
    a, b = make_tenant("qc-turn-a"), make_tenant("qc-turn-b")
    for i in range(6):
        services.summarize_start(tenant=a, actor=SYSTEM, prefix=f"session:a{i}:")
    b_job = services.summarize_start(tenant=b, actor=SYSTEM, prefix="session:b0:").pk
    assert OrmQ.objects.count() == 7

    cluster.start()
    cluster.wait_for("every job to succeed", lambda: Job.objects.filter(status="succeeded").count() == 7)
    order = list(Job.objects.order_by("started_at").values_list("pk", flat=True))
    assert order.index(b_job) == 1, order
    assert set(Job.objects.values_list("attempts", flat=True)) == {1}
    cluster.wait_for("every queue row to be acknowledged", lambda: OrmQ.objects.count() == 0)


def test_a_real_cluster_gives_another_tenants_forget_request_the_next_turn(cluster, monkeypatch):
    """One worker, tenant A's six summarize jobs queued before tenant B's forget request: B's
    forget runs first (neither tenant served yet; at equal turns a forget goes before a job),
    on the turn of A's first delivery (it ran seventh, behind all of A's, when forget requests
    kept their own first-come deliveries)."""
    monkeypatch.setattr(Conf, "SYNC", False)
    a, b = make_tenant("qc-fturn-a"), make_tenant("qc-fturn-b")
    seed_user(b, "u1", n=2, versions=1)
    for i in range(6):
        services.summarize_start(tenant=a, actor=SYSTEM, prefix=f"session:a{i}:")
    request = services.forget_request_create(tenant=b, actor=SYSTEM, subject="u1")
    assert OrmQ.objects.count() == 7

    cluster.start()
    cluster.wait_for("the forget request to complete", lambda: _request(request.pk).status == "completed")
    cluster.wait_for("every job to succeed", lambda: Job.objects.filter(status="succeeded").count() == 6)
    forget_started = _request(request.pk).started_at
    before = Job.objects.filter(started_at__lt=forget_started).count()
    assert before == 0, list(Job.objects.order_by("started_at").values_list("started_at", flat=True))
    assert _request(request.pk).attempts == 1
    assert set(Job.objects.values_list("attempts", flat=True)) == {1}
    cluster.wait_for("every queue row to be acknowledged", lambda: OrmQ.objects.count() == 0)


def _seed_twin(slug: str, capture):
    tenant = make_tenant(slug)
    for i in range(12):
        for v in range(2):
            services.memory_write(tenant=tenant, actor=SYSTEM, key=f"user:u7:k{i:02}", value=f"value {i}.{v}")
    summarize(tenant, "user:u7:", capture)
    services.memory_write(tenant=tenant, actor=SYSTEM, key="user:u8:k", value="someone else")
    return tenant


def test_a_worker_killed_mid_job_is_redelivered_after_q_retry_and_completes_the_same(
    cluster, monkeypatch, django_capture_on_commit_callbacks
):
    """kill -9 of the worker after the first batch of the first attempt committed.

    Observed: the guard replaces the worker at once, the queue row is handed out again
    ~Q_RETRY s after the killed start (its broker lock expires), the second attempt carries
    on from the committed batches and ends with the same receipt counts and the same rows
    left as an uninterrupted run; request attempts == 2 while django-q2's Task row says
    attempt_count == 1 (the killed run is not counted by django-q2, issue #327)."""
    killed_tenant = _seed_twin("qc-killed", django_capture_on_commit_callbacks)
    straight_tenant = _seed_twin("qc-straight", django_capture_on_commit_callbacks)
    monkeypatch.setattr(Conf, "SYNC", False)  # from here on, enqueue for real

    # The real create → on-commit enqueue path, with the task swapped for a test wrapper of
    # the real job (tests/qtasks.py).
    monkeypatch.setattr(forget, "TASK", "tests.qtasks.forget_pausing_after_first_batch_of_first_attempt")
    killed = services.forget_request_create(tenant=killed_tenant, actor=SYSTEM, subject="u7")
    monkeypatch.setattr(forget, "TASK", "tests.qtasks.forget_in_batches")
    straight = services.forget_request_create(tenant=straight_tenant, actor=SYSTEM, subject="u7")
    assert _queued_request_ids() == sorted([killed.pk, straight.pk])

    cluster.start()

    def paused_after_first_batch():
        r = _request(killed.pk)
        return r.status == "running" and r.attempts == 1 and r.receipt.get("batches") == 1 and r

    cluster.wait_for("the first batch of the first attempt", paused_after_first_batch)
    (worker,) = cluster.worker_pids(killed.pk)
    assert worker in _descendants(cluster.process.pid)
    cluster.kill(worker)
    killed_at = time.monotonic()
    halfway = _request(killed.pk)
    assert (halfway.status, halfway.attempts, halfway.receipt["batches"], halfway.receipt["memories"]) == (
        "running",
        1,
        1,
        qtasks.BATCH_SIZE,
    )
    cluster.wait_for("the worker to be gone", lambda: worker not in _descendants(cluster.process.pid))
    # The killed run's queue row stays, locked until its retry time: nothing acknowledged it.
    assert killed.pk in _queued_request_ids()
    cluster.let_redelivery_run()

    cluster.wait_for(
        "both requests to complete",
        lambda: {r.status for r in ForgetRequest.objects.filter(pk__in=[killed.pk, straight.pk])} == {"completed"},
        timeout=Q_RETRY + DEADLINE,
    )
    redelivered_after = time.monotonic() - killed_at
    first, second = _starts(killed.pk)
    gap = (second.occurred_at - first.occurred_at).total_seconds()
    # The broker lock is set when the pusher takes the row, a moment before the start: the
    # row is not handed out again before it expires. (No upper bound: how much later a busy
    # machine gets to it is not what this test is about.)
    assert gap >= Q_RETRY - 1, gap
    assert (first.detail["attempt"], second.detail["attempt"]) == (1, 2)
    print(f"killed start → redelivered start: {gap:.1f} s; kill → completed: {redelivered_after:.1f} s")
    first_worker, second_worker = cluster.worker_pids(killed.pk)
    assert first_worker == worker and second_worker != worker  # a new worker took it again

    a, b = _request(killed.pk), _request(straight.pk)
    assert (a.attempts, b.attempts) == (2, 1)
    assert a.error == b.error == ""
    assert {k: a.receipt[k] for k in RECEIPT_COUNTS} == {k: b.receipt[k] for k in RECEIPT_COUNTS}
    assert (a.receipt["memories"], a.receipt["versions"], a.receipt["summaries"], a.receipt["batches"]) == (
        12,
        12 * 2 + 1,
        1,
        3,
    )
    for tenant in (killed_tenant, straight_tenant):
        assert memory_rows(tenant) == [("user:u8:k", 1, None)]
        assert MemoryVersion.objects.filter(tenant=tenant).count() == 1

    cluster.wait_for("both queue rows to be acknowledged", lambda: OrmQ.objects.count() == 0)
    task = Task.objects.get(name=f"forget-request-{killed.pk}")
    assert task.success and task.attempt_count == 1  # django-q2 never saw the killed run
    assert task.result["status"] == "completed"
    audit_erases = AuditEvent.objects.filter(action="forget.erase", detail__forget_request=str(killed.uid)).count()
    assert audit_erases == 3  # 1 batch before the kill + 2 after: nothing erased twice
    # The killed attempt could not say so; the next one's begin did. Its batch was progress.
    stopped = AuditEvent.objects.filter(action="forget.attempt_fail", detail__forget_request=str(killed.uid))
    assert [(e.detail["attempt"], e.detail["error"], e.detail["gave_up"]) for e in stopped] == [
        (1, "worker_stopped", False)
    ]


def test_a_task_that_kills_its_worker_every_time_is_not_retried_for_ever(cluster, monkeypatch):
    """The worker dies (SIGKILL) on every start, after the attempt is counted.

    Observed: django-q2 redelivers the row every ~Q_RETRY s and counts none of the killed
    runs (no Task row until the end; Q_MAX_ATTEMPTS=5 never triggers). Our guard does:
    starts 1 and 2 are counted by the request (ZEROMEM_JOB_MAX_ATTEMPTS=2), delivery 3 marks
    it failed and returns normally, so django-q2 saves a successful Task
    (attempt_count 1) and deletes the queue row — no fourth delivery. Nothing is erased."""
    tenant = make_tenant("qc-doomed")
    services.memory_write(tenant=tenant, actor=SYSTEM, key="user:u1:k", value="value")
    monkeypatch.setattr(Conf, "SYNC", False)  # enqueue for real
    monkeypatch.setattr(forget, "TASK", "tests.qtasks.forget_killed_every_time")
    request = services.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u1")
    assert _queued_request_ids() == [request.pk]

    cluster.start()
    started = time.monotonic()
    cluster.wait_for(
        "the request to fail",
        lambda: _request(request.pk).status == "failed",
        timeout=JOB_MAX_ATTEMPTS * Q_RETRY + DEADLINE,
    )
    failed_after = time.monotonic() - started

    failed = _request(request.pk)
    assert failed.attempts == JOB_MAX_ATTEMPTS + 1  # the last delivery counted, then gave up
    assert failed.error == f"gave up after {JOB_MAX_ATTEMPTS} attempts"  # a kill leaves no error to quote
    assert failed.completed_at is None and "failed_at" in failed.receipt
    assert Memory.objects.filter(tenant=tenant, key="user:u1:k").exists()

    starts = _starts(request.pk)
    assert [e.detail["attempt"] for e in starts] == list(range(1, JOB_MAX_ATTEMPTS + 1))
    fail_event = AuditEvent.objects.get(action="forget.fail", detail__forget_request=str(request.uid))
    # Each killed attempt is audited when the next delivery begins; the last one gave up.
    stopped = AuditEvent.objects.filter(action="forget.attempt_fail", detail__forget_request=str(request.uid))
    assert [(e.detail["attempt"], e.detail["error"], e.detail["gave_up"]) for e in stopped.order_by("pk")] == [
        (n, "worker_stopped", n == JOB_MAX_ATTEMPTS) for n in range(1, JOB_MAX_ATTEMPTS + 1)
    ]
    times = [e.occurred_at for e in starts] + [fail_event.occurred_at]
    gaps = [(later - earlier).total_seconds() for earlier, later in zip(times, times[1:], strict=False)]
    assert all(gap >= Q_RETRY - 1 for gap in gaps), gaps  # each redelivery waited for the broker lock
    print(f"gaps between deliveries: {[round(g, 1) for g in gaps]} s; failed after {failed_after:.1f} s")
    # Three deliveries, three workers: the first two killed, the third one survived.
    pids = cluster.worker_pids(request.pk)
    assert len(pids) == JOB_MAX_ATTEMPTS + 1 and len(set(pids)) == len(pids)

    # The giving-up delivery returned normally: acknowledged, so the loop ends.
    cluster.wait_for("the queue row to be acknowledged", lambda: OrmQ.objects.count() == 0)
    task = Task.objects.get(name=f"forget-request-{request.pk}")
    assert task.success and task.attempt_count == 1  # the only run django-q2 ever counted
    assert task.result["status"] == "failed"


# --- the purge job ---------------------------------------------------------------------------

PURGE_BATCH = 5
PURGE_EXPIRED, PURGE_OLD_TRASH = 18, 4  # → batches of 5, 5, 5, 3 expired and 4 trash


def _seed_purge_twin(slug: str):
    """Memories the purge erases (18 expired, 4 trashed past retention, 2 versions each)
    beside memories it keeps (3 live, 1 recently trashed)."""
    tenant = make_tenant(slug)
    for i in range(PURGE_EXPIRED + PURGE_OLD_TRASH + 4):
        key = f"session:s{i:02}:step"
        services.memory_write(tenant=tenant, actor=SYSTEM, key=key, value=f"value {i}.0")
        if i < PURGE_EXPIRED:
            services.memory_write(tenant=tenant, actor=SYSTEM, key=key, value=f"value {i}.1")
        elif i < PURGE_EXPIRED + PURGE_OLD_TRASH + 1:
            services.memory_delete(tenant=tenant, actor=SYSTEM, key=key)
    now = timezone.now()
    keys = [f"session:s{i:02}:step" for i in range(PURGE_EXPIRED + PURGE_OLD_TRASH)]
    Memory.objects.filter(tenant=tenant, key__in=keys[:PURGE_EXPIRED]).update(expires_at=now - timedelta(minutes=1))
    Memory.objects.filter(tenant=tenant, key__in=keys[PURGE_EXPIRED:]).update(
        deleted_at=now - timedelta(days=settings.ZEROMEM_TRASH_RETENTION_DAYS + 1)
    )
    return tenant


def _purge_state(tenant) -> dict:
    """What a purge leaves of a tenant, and what it recorded: rows kept (key, version,
    trashed?), their version rows, and the purge audit events (reason, count, versions)."""
    return {
        "memories": sorted(
            (key, version, deleted_at is not None)
            for key, version, deleted_at in Memory.objects.filter(tenant=tenant).values_list(
                "key", "version", "deleted_at"
            )
        ),
        "versions": sorted(MemoryVersion.objects.filter(tenant=tenant).values_list("memory__key", "version", "op")),
        "purge_events": sorted(
            (e.detail["reason"], e.count, e.detail["versions"])
            for e in AuditEvent.objects.filter(tenant=tenant, action="memory.purge")
        ),
    }


def test_a_worker_killed_inside_a_purge_batch_is_redelivered_and_ends_as_an_uninterrupted_purge(
    cluster, monkeypatch, tmp_path
):
    """kill -9 of the worker while the purge's second batch is open (DELETEs run, nothing
    committed), after the first batch committed.

    Observed: PostgreSQL rolls the open batch back when the worker's connection drops; the
    queue row is handed out again ~Q_RETRY s after the killed start; the new delivery erases
    what is left. Final state — rows gone, rows kept, versions, the purge audit events with
    their counts — equals an uninterrupted purge of an identical tenant."""
    straight_tenant = _seed_purge_twin("purge-straight")
    straight = retention.purge_expired(batch_size=PURGE_BATCH)  # the uninterrupted run, same code
    assert (straight["expired"], straight["trash"], straight["batches"]) == (PURGE_EXPIRED, PURGE_OLD_TRASH, 5)
    expected = _purge_state(straight_tenant)
    assert len(expected["memories"]) == 4 and len(expected["purge_events"]) == 5

    tenant = _seed_purge_twin("purge-killed")
    doomed = PURGE_EXPIRED + PURGE_OLD_TRASH
    assert Memory.objects.filter(tenant=tenant).count() == doomed + 4
    monkeypatch.setattr(Conf, "SYNC", False)  # enqueue for real
    async_task("tests.qtasks.purge_pausing_inside_second_batch_of_first_delivery", PURGE_BATCH, task_name="purge")
    assert OrmQ.objects.count() == 1

    cluster.start()
    paused = cluster.pids_dir / "purge.paused"
    cluster.wait_for("the purge to stop inside its second batch", paused.exists)
    worker = int(paused.read_text())
    assert cluster.worker_pids("purge") == [worker]
    # Batch 1 committed; batch 2's DELETEs are not visible from outside its transaction.
    assert Memory.objects.filter(tenant=tenant).count() == doomed + 4 - PURGE_BATCH
    assert AuditEvent.objects.filter(tenant=tenant, action="memory.purge").count() == 1
    cluster.kill(worker)
    killed_at = time.monotonic()
    cluster.wait_for("the worker to be gone", lambda: worker not in _descendants(cluster.process.pid))
    # Its open batch was rolled back with the connection: the same rows are still there.
    assert Memory.objects.filter(tenant=tenant).count() == doomed + 4 - PURGE_BATCH
    assert OrmQ.objects.count() == 1  # not acknowledged
    cluster.let_redelivery_run()

    cluster.wait_for(
        "the redelivered purge to finish",
        lambda: Task.objects.filter(name="purge").exists(),
        timeout=Q_RETRY + DEADLINE,
    )
    redelivered_after = time.monotonic() - killed_at
    first, second = cluster.worker_pids("purge")
    assert second != worker
    print(f"purge: kill → redelivered run finished {redelivered_after:.1f} s")
    first_start, second_start = (
        p.stat().st_mtime for p in sorted(cluster.pids_dir.glob("purge.*.pid"), key=lambda p: p.name)
    )
    assert second_start - first_start >= Q_RETRY - 1  # not handed out again before the broker lock expired

    task = Task.objects.get(name="purge")
    assert task.success and task.attempt_count == 1  # django-q2 never counted the killed run
    assert (task.result["expired"], task.result["trash"]) == (PURGE_EXPIRED - PURGE_BATCH, PURGE_OLD_TRASH)
    assert _purge_state(tenant) == expected
    cluster.wait_for("the queue row to be acknowledged", lambda: OrmQ.objects.count() == 0)
