"""What django-q2 may keep of a task.

django-q2 stores what a task returned, and a failed task's exception text with its
traceback, in its own Task table (failures are never pruned), which no forget request erases:
a database error quotes the row it failed on (a key, a value). Every task is therefore wrapped
by :func:`kept`: a failure reaches django-q2 as :class:`TaskFailed` naming only the exception's
class, the exception itself goes to the server log, and the result passes through ``shape``
(each app's tasks say what of their results may be kept).
"""

from __future__ import annotations

import functools
import logging
import zlib
from collections.abc import Callable
from typing import Any

from django.db import connection

logger = logging.getLogger("zeromem.tasks")


class TaskFailed(Exception):
    """A task's failure as django-q2 records it: the class name of what was raised."""


def _as_is(result: Any) -> Any:
    return result


def kept(task: Callable, shape: Callable[[Any], Any] = _as_is) -> Callable:
    """``task``, returning ``shape(result)`` and raising only :class:`TaskFailed`. A
    ``SystemExit`` (django-q2's timeout) passes as it is: the worker acts on it."""

    @functools.wraps(task)
    def run(*args, **kwargs):
        try:
            return shape(task(*args, **kwargs))
        except Exception as exc:
            logger.exception("task %s%r failed", task.__name__, args)
            raise TaskFailed(f"{type(exc).__module__}.{type(exc).__name__} (details in the server log)") from None

    return run


# pg_try_advisory_lock namespace of the schedules' tasks (with a key derived from the task's name).
_RUN_LOCK_NAMESPACE = 0x5A52  # "ZR"
SKIPPED = {"skipped": "another run of this task is in progress"}


def one_at_a_time(task: Callable) -> Callable:
    """``task``, run by one worker at a time across the cluster (and a fleet's clusters): a
    copy that finds another one running returns :data:`SKIPPED` at once. For the schedules'
    tasks: django-q2's scheduler enqueues a schedule whenever it is due, whether its last copy
    has run or not, so a queue backlogged past a schedule's period holds several copies, and
    free workers take them together — two runs of the idle-sessions schedule started two jobs
    for each idle session (two LLM calls, two versions of its summary), two embedding runs
    encoded the same memories on two workers for 50 s.

    On PostgreSQL a session-level ``pg_try_advisory_lock`` on the worker's connection, released
    when the task ends (or with the connection, when its worker is killed); the next copy then
    runs. SQLite (one embedded process): as it is. Cost: two statements a run."""
    key = zlib.crc32(f"{task.__module__}.{task.__qualname__}".encode()) & 0x7FFFFFFF

    @functools.wraps(task)
    def run(*args, **kwargs):
        if connection.vendor != "postgresql":
            return task(*args, **kwargs)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", [_RUN_LOCK_NAMESPACE, key])
            if not cursor.fetchone()[0]:
                logger.info("task %s skipped: another run of it is in progress", task.__name__)
                return dict(SKIPPED)
        try:
            return task(*args, **kwargs)
        finally:
            try:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_advisory_unlock(%s, %s)", [_RUN_LOCK_NAMESPACE, key])
            except Exception:  # the connection broke: the lock went with it
                logger.warning("task %s: could not release its run lock", task.__name__, exc_info=True)
                connection.close()

    return run
