"""CPU time of one piece of work, including what it hands to other threads.

A search's budget (memories/services/search_budget.py) is charged the CPU time the search
used. ``time.thread_time()`` of the request's thread misses work done for it in another
thread — the question's embedding, computed in the encoder's pool while the word ranking's
queries wait on PostgreSQL (memories/search/ranking.py). :func:`metered` measures the
current thread and collects what :func:`offload` ran elsewhere on its behalf::

    with cpu.metered() as meter:
        future = cpu.offload(pool, embed, question)
        ...
        future.result()
    meter.seconds()  # this thread's CPU + the embedding's

Work offloaded outside any meter runs the same, uncounted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any


class Meter:
    """CPU seconds of the thread that opened it, since then, plus offloaded work's."""

    __slots__ = ("_started", "_offloaded", "_lock")

    def __init__(self) -> None:
        self._started = time.thread_time()
        self._offloaded = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self._offloaded += seconds

    def seconds(self) -> float:
        """Call it in the thread that opened the meter, once the offloaded work is done."""
        with self._lock:
            return time.thread_time() - self._started + self._offloaded


_current: ContextVar[Meter | None] = ContextVar("zeromem_cpu_meter", default=None)


@contextmanager
def metered() -> Iterator[Meter]:
    meter = Meter()
    token = _current.set(meter)
    try:
        yield meter
    finally:
        _current.reset(token)


def offload(executor: Executor, fn: Callable[..., Any], *args: Any) -> Future:
    """``executor.submit(fn, *args)``, its thread's CPU time added to the caller's meter."""
    meter = _current.get()
    if meter is None:
        return executor.submit(fn, *args)

    def run() -> Any:
        started = time.thread_time()
        try:
            return fn(*args)
        finally:
            meter.add(time.thread_time() - started)

    return executor.submit(run)


def credit(seconds: float) -> None:
    """Add CPU time spent for the current work in another *process* (the search tier's
    ranking, memories/search/tier.py) to the open meter, if any."""
    meter = _current.get()
    if meter is not None and seconds > 0:
        meter.add(seconds)
