"""Task functions for tests/test_qcluster.py, run by a real ``manage.py qcluster`` process
(importable as ``tests.qtasks.<name>`` from the repository root, where the cluster runs).

Each one carries a forget request out through the real
:func:`memories.services.forget.forget_request_execute` — its attempt counting, batches and
receipt — and only changes *when the worker dies*: the patches below live in the worker
process for the duration of one task, production code has no test hooks.

Every start writes the worker's pid to ``$ZEROMEM_QTASKS_DIR/<request id>.<n>.pid`` so the
test can find the worker to ``kill -9`` (and check it is a descendant of the cluster).
"""

import os
import signal
import time
from pathlib import Path
from unittest import mock

from memories.models import ForgetRequest
from memories.services import forget

BATCH_SIZE = 5
# Long enough for the test to see the pause and kill the worker, shorter than Q_TIMEOUT
# would matter: the test kills within a fraction of a second.
PAUSE_SECONDS = 60


def _note_pid(request_id: int) -> None:
    folder = os.environ.get("ZEROMEM_QTASKS_DIR")
    if not folder:
        return
    n = 1
    while (Path(folder) / f"{request_id}.{n}.pid").exists():
        n += 1
    (Path(folder) / f"{request_id}.{n}.pid").write_text(str(os.getpid()))


def forget_in_batches(request_id: int) -> dict:
    """The plain job, in batches of ``BATCH_SIZE`` (the uninterrupted run to compare with)."""
    _note_pid(request_id)
    return forget.forget_request_execute(request_id=request_id, batch_size=BATCH_SIZE)


def forget_pausing_after_first_batch_of_first_attempt(request_id: int) -> dict:
    """On the request's first attempt, sleep after the first batch has committed (the test
    kills the worker there, mid-job); later attempts run straight through."""
    _note_pid(request_id)
    real = forget._erase_batch

    def erase_batch(rid, *, batch_size):
        more = real(rid, batch_size=batch_size)
        if more and ForgetRequest.objects.get(pk=rid).attempts == 1:
            time.sleep(PAUSE_SECONDS)
        return more

    with mock.patch.object(forget, "_erase_batch", erase_batch):
        return forget.forget_request_execute(request_id=request_id, batch_size=BATCH_SIZE)


def forget_killed_every_time(request_id: int) -> dict:
    """The worker dies (SIGKILL, as the OOM killer would) on every start, after the attempt
    has been counted and before anything is erased."""
    _note_pid(request_id)

    def erase_batch(rid, *, batch_size):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(PAUSE_SECONDS)  # not reached

    with mock.patch.object(forget, "_erase_batch", erase_batch):
        return forget.forget_request_execute(request_id=request_id, batch_size=BATCH_SIZE)
