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
from collections.abc import Callable
from typing import Any

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
