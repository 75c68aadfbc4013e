"""A tenant's search time per second: the share of the servers one tenant's searches may take.

Concurrency slots (``ZEROMEM_TENANT_MAX_CONCURRENT``) bound how many expensive requests a
tenant runs at once, not how much of the machine they take: four searches back to back keep
two cores busy, and every other tenant's request then waits for the CPU and for the GIL of
the web process it lands in. So searches and recalls also spend a budget: at most
``ZEROMEM_TENANT_SEARCH_MS_PER_SECOND`` milliseconds of search (wall-clock time inside the
search service, its SQL and ranking included) per one-second window, counted across every
process (audit/limits.py: one Redis key or one counter row per tenant and second).

A search is admitted while the tenant's window is not spent (it is charged its time when it
ends, so a window can be overdrawn by the searches already running: at most
``ZEROMEM_TENANT_MAX_CONCURRENT`` of them); past it the search is refused at once, before
any work, with 429 ``search_budget`` and Retry-After (the rest of the window, at least 1 s),
and audited like any refusal. Other tenants' windows are their own. ``0`` turns it off.

Cost: two counter round trips per search (check, then charge); a refused search costs one.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings

from audit import limits
from zeromem.kernel.errors import TenantBusy

logger = logging.getLogger("zeromem.search")

WINDOW_SECONDS = 1
BUCKET = "searchms:"


class SearchBudgetSpent(TenantBusy):
    def __init__(self, retry_after: int):
        super().__init__(
            "this tenant has used its search time for this second; retry after Retry-After",
            code="search_budget",
            retry_after=retry_after,
        )


def budget_ms() -> int:
    """Milliseconds of search a tenant may use per window (0: no budget)."""
    return int(settings.ZEROMEM_TENANT_SEARCH_MS_PER_SECOND * WINDOW_SECONDS)


@contextmanager
def search_budget(tenant_id: int) -> Iterator[None]:
    """Admit one search of ``tenant_id`` (or raise :class:`SearchBudgetSpent`), then charge
    it the milliseconds it took, whatever its outcome (a search that timed out cost time too)."""
    budget = budget_ms()
    if budget <= 0:
        yield
        return
    bucket = f"{BUCKET}{tenant_id}"
    spent = limits.hit(bucket, window=WINDOW_SECONDS, cost=0)
    if spent.count >= budget:
        raise SearchBudgetSpent(retry_after=max(1, math.ceil(spent.retry_after)))
    started = time.perf_counter()
    try:
        yield
    finally:
        _charge(bucket, math.ceil((time.perf_counter() - started) * 1000))


def _charge(bucket: str, ms: int) -> None:
    # The search has run: failing to count it must not fail its answer.
    try:
        limits.hit(bucket, window=WINDOW_SECONDS, cost=ms)
    except Exception as exc:  # noqa: BLE001 - the database's or Redis' error, logged
        logger.warning("search time not counted (%s ms): %s: %s", ms, type(exc).__name__, exc)
