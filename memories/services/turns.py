"""Deliveries of the shared queue are turns: tenants take turns at the workers, with summarize
jobs and forget requests alike.

django-q2's queue is one first-come line for every tenant and both kinds of work. A delivery of
``memories.tasks.summarize_task`` or ``memories.tasks.forget_request_task`` therefore runs what
waits of the tenant served longest ago (services.jobs.turn_claim_next) — a summarize attempt or
a forget request's step — not the job or request it was enqueued for: that one runs on a later
delivery. Every job and every forget step (the request's first, and each after a step handed
its worker back) was enqueued once, so each still has a turn coming; a delivery that finds
nothing waiting runs nothing and says what became of its own.
"""

from __future__ import annotations

from django.db import transaction

from memories.models import ForgetRequest, Job
from memories.services import forget, summaries
from memories.services.jobs import turn_claim_next

# At most this many summarize jobs a delivery puts off (their LLM endpoint backing off) before
# it gives up its turn: each costs the claim's two statements and an UPDATE, in one transaction.
DEFERRED_MAX = 20


def delivery_run(*, summarize_job: int | None = None, forget_request: int | None = None) -> dict:
    """One delivery, enqueued for ``summarize_job`` or ``forget_request``: claims the turn's
    job or request and begins its attempt or step in one transaction (its audit event
    included), then runs it. A failed summarize attempt or forget step re-raises, so django-q2
    delivers again after ``Q_RETRY``, and that delivery takes a turn again. With nothing
    waiting: the state of the job or request it was enqueued for. A job put off because its LLM
    endpoint backs off (summaries.llm_backoff_until) passes the turn to the next in line, up to
    ``DEFERRED_MAX`` of them. Cost: :func:`turn_claim_next`'s two statements (again per job put
    off), then the attempt's or the step's own."""
    with transaction.atomic():
        for _ in range(DEFERRED_MAX + 1):
            claimed = turn_claim_next()
            if isinstance(claimed, ForgetRequest):
                claimed = forget.forget_step_begin(claimed.pk)
            elif isinstance(claimed, Job):
                claimed = summaries.summarize_attempt_begin(claimed.pk)
                if claimed is not None and claimed.status == Job.Status.QUEUED:
                    # Put off (its LLM endpoint backs off, Job.retry_at): the turn goes on to
                    # the next in line, as this one no longer waits.
                    continue
            break
    if isinstance(claimed, ForgetRequest):
        return forget.forget_step_run(claimed)
    if isinstance(claimed, Job):
        return summaries.summarize_attempt_run(claimed)
    if forget_request is not None:
        return forget.forget_request_state(forget_request)
    return summaries.summarize_job_state(summarize_job)
