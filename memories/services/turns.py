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

import logging

from django.db import transaction

from memories.models import ForgetRequest, Job
from memories.services import forget, summaries
from memories.services.jobs import turn_claim_next

logger = logging.getLogger(__name__)

# At most this many summarize jobs a delivery puts off (their LLM endpoint backing off) before
# it gives up its turn: each costs the claim's two statements and an UPDATE, in one transaction.
DEFERRED_MAX = 20


def delivery_run(*, summarize_job: int | None = None, forget_request: int | None = None) -> dict:
    """One delivery, enqueued for ``summarize_job`` or ``forget_request``: claims the turn's
    job or request and begins its attempt or step in one transaction (its audit event
    included), then runs it. A failed summarize attempt or forget step of its own job or request
    re-raises, so django-q2 delivers again after ``Q_RETRY``, and that delivery takes a turn
    again; another's that failed on its turn enqueues this delivery again and returns. With nothing
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
    try:
        if isinstance(claimed, ForgetRequest):
            return forget.forget_step_run(claimed)
        if isinstance(claimed, Job):
            return summaries.summarize_attempt_run(claimed)
    except Exception:
        own = forget_request if isinstance(claimed, ForgetRequest) else summarize_job
        if claimed.pk == own:
            raise  # its own attempt or step: django-q2 delivers it again after Q_RETRY
        # Another's attempt failed on this delivery's turn (recorded on it, with its event). Not
        # raised: django-q2 counts an entry's failed deliveries and drops it at Q_MAX_ATTEMPTS,
        # so the failures of a job that outlived its own entry (ZEROMEM_JOB_MAX_ATTEMPTS above
        # Q_MAX_ATTEMPTS, or several failing jobs) dropped an innocent job's only entry, never
        # run. Its turn is enqueued again instead (a new entry, counted from zero); the failed
        # one is taken again by its own entry's redelivery, else by summarize-jobs-resume.
        logger.warning(
            "a delivery for job %s / forget request %s ran another's turn, which failed; enqueued again",
            summarize_job,
            forget_request,
        )
        if forget_request is not None:
            forget.forget_enqueue(forget_request)
            return {"status": "enqueued_again", "forget_request": forget_request}
        summaries.summarize_enqueue(summarize_job)
        return {"status": "enqueued_again", "job_id": summarize_job}
    if forget_request is not None:
        return forget.forget_request_state(forget_request)
    return summaries.summarize_job_state(summarize_job)
