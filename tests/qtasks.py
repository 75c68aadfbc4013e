"""Task functions for tests/test_qcluster.py, run by a real ``manage.py qcluster`` process
(importable as ``tests.qtasks.<name>`` from the repository root, where the cluster runs).

Each one carries a forget request out through the real
:func:`memories.services.forget.forget_request_execute` — its attempt counting, batches and
receipt — or the purge through the real :func:`memories.services.retention.purge_expired`,
and only changes *when the worker dies*: the patches below live in the worker
process for the duration of one task, production code has no test hooks.

Every start writes the worker's pid to ``$ZEROMEM_QTASKS_DIR/<request id>.<n>.pid`` so the
test can find the worker to ``kill -9`` (and check it is a descendant of the cluster).
"""

import os
import signal
import sys
import time
from pathlib import Path
from unittest import mock

from memories.models import ForgetRequest
from memories.services import forget, retention

BATCH_SIZE = 5
# Files, beside the pid files, that the test writes to let a held worker go on: RELEASE a
# worker held to be killed (when a test ends early), REDELIVERED the delivery after the kill,
# once the test has looked at what the killed one left.
RELEASE = "release"
REDELIVERED = "redelivered"


def _hold(until: str = RELEASE) -> None:
    """Keep this worker here until the test kills it or writes ``$ZEROMEM_QTASKS_DIR/<until>``,
    however long the test takes to get there. django-q2 (1.11) bounds a task twice, and both
    are stopped for the hold, so a slow machine cannot turn the test's kill into something
    else: the worker's ``Q_TIMEOUT`` alarm (SIGALRM: the task would end as a failed task that
    django-q2 counts, and the worker would exit before the test's kill) and the guard's timer
    (``Q_TIMEOUT`` + 3 s of guard cycles, then it terminates the worker itself). The timer is
    the ``multiprocessing.Value`` django-q2 hands its ``worker()`` function; -1 reads "idle"."""
    signal.alarm(0)
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "worker" and "timer" in frame.f_locals):
        frame = frame.f_back
    assert frame is not None, "django-q2's worker() frame not found: update tests/qtasks.py for this django-q2"
    timer = frame.f_locals["timer"]
    with timer.get_lock():
        timer.value = -1
    release = Path(os.environ["ZEROMEM_QTASKS_DIR"]) / until
    while not release.exists():
        time.sleep(0.05)


def _note_pid(request_id: int | str) -> int:
    """Record this start's worker pid; returns which start of ``request_id`` this is (1, 2 ...)."""
    folder = os.environ.get("ZEROMEM_QTASKS_DIR")
    if not folder:
        return 1
    n = 1
    while (Path(folder) / f"{request_id}.{n}.pid").exists():
        n += 1
    (Path(folder) / f"{request_id}.{n}.pid").write_text(str(os.getpid()))
    return n


def forget_in_batches(request_id: int) -> dict:
    """The plain job, in batches of ``BATCH_SIZE`` (the uninterrupted run to compare with)."""
    _note_pid(request_id)
    return forget.forget_request_execute(request_id=request_id, batch_size=BATCH_SIZE)


def forget_pausing_after_first_batch_of_first_attempt(request_id: int) -> dict:
    """On the request's first attempt, hold the worker after the first batch has committed
    (the test kills it there, mid-job); a later delivery waits until the test lets it run
    (its broker lock may have expired while the test was slow, so it may be waiting already),
    then runs straight through."""
    if _note_pid(request_id) > 1:
        _hold(REDELIVERED)
    real = forget._erase_batch

    def erase_batch(rid, *, batch_size, **kwargs):
        more = real(rid, batch_size=batch_size, **kwargs)
        if more and ForgetRequest.objects.get(pk=rid).attempts == 1:
            _hold()
        return more

    with mock.patch.object(forget, "_erase_batch", erase_batch):
        return forget.forget_request_execute(request_id=request_id, batch_size=BATCH_SIZE)


def forget_killed_every_time(request_id: int) -> dict:
    """The worker dies (SIGKILL, as the OOM killer would) on every start, after the attempt
    has been counted and before anything is erased."""
    _note_pid(request_id)

    def erase_batch(rid, *, batch_size, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
        _hold()  # not reached

    with mock.patch.object(forget, "_erase_batch", erase_batch):
        return forget.forget_request_execute(request_id=request_id, batch_size=BATCH_SIZE)


def purge_pausing_inside_second_batch_of_first_delivery(batch_size: int) -> dict:
    """The real purge job (memories.tasks.purge_expired_task) in batches of ``batch_size``.
    On its first delivery the worker stops inside the second batch's transaction — its
    DELETEs done, its audit event not yet written, nothing committed — and writes
    ``purge.paused`` beside the pid files; the test kills it there. A later delivery waits
    until the test lets it run, then runs straight through."""
    start = _note_pid("purge")
    if start > 1:
        _hold(REDELIVERED)  # until the test has seen what the killed delivery left
        return retention.purge_expired(batch_size=batch_size)
    real = retention.audit_record
    calls = []

    def audit_record(**kwargs):
        calls.append(kwargs.get("action"))
        if len(calls) == 2:  # the second batch's event: inside its open transaction
            (Path(os.environ["ZEROMEM_QTASKS_DIR"]) / "purge.paused").write_text(str(os.getpid()))
            _hold()
        return real(**kwargs)

    with mock.patch.object(retention, "audit_record", audit_record):
        return retention.purge_expired(batch_size=batch_size)
