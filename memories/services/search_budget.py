"""A tenant's search time: the share of the web servers' CPU one tenant's searches may take.

Concurrency slots (``ZEROMEM_TENANT_MAX_CONCURRENT``) bound how many expensive requests a
tenant runs at once, not how much of the machine they take: four searches back to back keep
two cores busy, and every other tenant's request then waits for the CPU (and for the GIL of
the web process it lands in). So searches and recalls also spend a budget of **search CPU
time**: the CPU time of the request's thread inside the search service (similarity, ranking,
the ORM and driver work; not PostgreSQL's own, which the search's caps and statement timeout
bound) plus the question's embedding, computed for it in the encoder's pool
(zeromem/kernel/cpu.py), counted across every process (audit/limits.py ``backlog``: one
Redis key or one counter row per tenant). CPU time, not wall-clock time: on a busy machine a
search waits far longer than it computes (measured 20-95 ms wall for 9-13 ms of CPU), and a
wall-clock budget refused a legitimate tenant's three agents exactly when the machine was
busy (tests/test_serve.py).

* a tenant may use ``ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND`` milliseconds per second on
  average, and up to ``ZEROMEM_TENANT_SEARCH_CPU_BURST_MS`` at once above it (three agents of
  one tenant searching at the same moment are answered; twenty searching back to back are
  held to the rate);
* each search is charged its CPU time when it ends (a search that timed out cost time too),
  once its answer has been sent (zeromem/kernel/deferred.py; a search outside a request, at
  once):
  the tenant's backlog grows by that time ÷ the rate and drains at one second per second;
* a search arriving while the backlog is over the burst's worth is refused at once, before any
  work, with 429 ``search_budget`` and Retry-After (when the backlog will be back under it,
  at least 1 s), and audited like any refusal. The searches already admitted may overdraw it
  (at most ``ZEROMEM_TENANT_MAX_CONCURRENT`` of them run at once).

Other tenants' backlogs are their own. A rate of ``0`` turns the budget off.
Cost: one counter read before a search and one UPSERT (or Redis script) after it.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from django.conf import settings

from audit import limits
from zeromem.kernel import cpu, deferred
from zeromem.kernel.errors import TenantBusy

logger = logging.getLogger("zeromem.search")

BUCKET = "searchms:"


class SearchBudgetSpent(TenantBusy):
    def __init__(self, retry_after: int):
        super().__init__(
            "this tenant has used its search time for now; retry after Retry-After",
            code="search_budget",
            retry_after=retry_after,
        )


@contextmanager
def search_budget(tenant_id: int) -> Iterator[None]:
    """Admit one search of ``tenant_id`` (or raise :class:`SearchBudgetSpent`), then charge
    it the CPU milliseconds its thread used, whatever its outcome."""
    rate = settings.ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND
    if rate <= 0:
        yield
        return
    bucket = f"{BUCKET}{tenant_id}"
    allowed = max(settings.ZEROMEM_TENANT_SEARCH_CPU_BURST_MS, 0) / rate  # seconds of backlog
    _charge_pending()  # an earlier search of this request (a batch) is counted before this one
    held = limits.backlog(bucket)
    if held > allowed:
        raise SearchBudgetSpent(retry_after=max(1, math.ceil(held - allowed)))
    with cpu.metered() as meter:
        try:
            yield
        finally:
            # Charged once the answer has left (zeromem/kernel/deferred.py): the client does
            # not wait for the counter's round trip. A later search of the same request (a
            # batch) charges it first, so a batch cannot search past the budget unseen.
            pending = [functools.partial(_charge, bucket, meter.seconds() * 1000 * 1000 / rate)]
            _pending.set(pending)
            deferred.defer(functools.partial(_run_pending, pending))


# This request's search charge not yet made (a one-item list, emptied when it is made).
_pending: ContextVar[list | None] = ContextVar("zeromem_search_charge", default=None)


def _run_pending(pending: list) -> None:
    try:
        charge = pending.pop()  # made once, whoever gets here first
    except IndexError:
        return
    charge()


def _charge_pending() -> None:
    pending = _pending.get()
    if pending:
        _run_pending(pending)


def _charge(bucket: str, backlog_ms: float) -> None:
    # The search has run: failing to count it must not fail its answer.
    try:
        limits.backlog(bucket, add_ms=max(1, math.ceil(backlog_ms)))
    except Exception as exc:  # noqa: BLE001 - the database's or Redis' error, logged
        logger.warning("search time not counted: %s: %s", type(exc).__name__, exc)
