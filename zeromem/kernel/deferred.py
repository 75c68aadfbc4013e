"""Work a request does after its response has left: ``defer(fn)``.

Some bookkeeping need not hold up the answer it follows — a search's CPU charge to its
tenant's budget (memories/services/search_budget.py) is one round trip to the database or
Redis that the client would otherwise wait for. Inside a request (the outermost middleware,
zeromem/middleware.py, opens :func:`collecting`), ``defer(fn)`` queues ``fn`` and the server
runs it when it closes the response, after the last byte; anywhere else (jobs, commands, the
MCP endpoint's tool calls) ``fn`` runs at once. A task that fails is logged, never raised:
the answer has been given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

logger = logging.getLogger("zeromem")

_queue: ContextVar[list[Callable[[], object]] | None] = ContextVar("zeromem_deferred", default=None)


@contextmanager
def collecting() -> Iterator[list[Callable[[], object]]]:
    """Queue what is deferred inside the block; run the list with :func:`run` later."""
    tasks: list[Callable[[], object]] = []
    token = _queue.set(tasks)
    try:
        yield tasks
    finally:
        _queue.reset(token)


def defer(fn: Callable[[], object]) -> None:
    tasks = _queue.get()
    if tasks is None:
        fn()
    else:
        tasks.append(fn)


def run(tasks: list[Callable[[], object]]) -> None:
    while tasks:
        fn = tasks.pop(0)
        try:
            fn()
        except Exception:  # noqa: BLE001 - after the answer: logged, not raised
            logger.warning("deferred work failed after a response", exc_info=True)
