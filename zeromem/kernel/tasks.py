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
import secrets
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.cache import cache
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


SKIPPED = {"skipped": "another run of this task is in progress"}
# A run's lease outlives the longest a worker may run a task (django-q2 stops it at Q_TIMEOUT).
LEASE_MARGIN_SECONDS = 60


def one_at_a_time(task: Callable) -> Callable:
    """``task``, run by one worker at a time across the cluster (and a fleet's clusters): a
    copy that finds another one running returns :data:`SKIPPED` at once. For the schedules'
    tasks: django-q2's scheduler enqueues a schedule whenever it is due, whether its last copy
    has run or not, so a queue backlogged past a schedule's period holds several copies, and
    free workers take them together — two runs of the idle-sessions schedule started two jobs
    for each idle session (two LLM calls, two versions of its summary), two embedding runs
    encoded the same memories on two workers for 50 s.

    On PostgreSQL a lease in the shared cache (Redis when configured, else the database's cache
    table): ``add`` — set only if absent, atomic in both — with a random token, for longer than
    django-q2 lets a task run (``Q_TIMEOUT`` + a minute); given back when the task ends. A
    lease of a killed worker lapses on its own, so that schedule waits at most that long. Not a
    session-level advisory lock: behind PgBouncer in transaction mode it stays on whichever
    server connection took it and its unlock may reach another (the task then skipped until
    that connection closed), and a task that returns its connection to the pool mid-run hands
    the lock to the next borrower. SQLite (one embedded process): as it is."""
    name = f"zeromem:run:{task.__module__}.{task.__qualname__}"

    @functools.wraps(task)
    def run(*args, **kwargs):
        if connection.vendor != "postgresql":
            return task(*args, **kwargs)
        token = secrets.token_hex(8)
        if not cache.add(name, token, timeout=settings.Q_CLUSTER["timeout"] + LEASE_MARGIN_SECONDS):
            logger.info("task %s skipped: another run of it is in progress", task.__name__)
            return dict(SKIPPED)
        try:
            return task(*args, **kwargs)
        finally:
            try:
                if cache.get(name) == token:  # not a lease that lapsed and another run took
                    cache.delete(name)
            except Exception:  # the cache is unreachable: the lease lapses on its own
                logger.warning("task %s: could not give back its run lease", task.__name__, exc_info=True)

    return run
