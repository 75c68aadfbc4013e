"""django-q2 tasks: dotted-path functions that take ids and call a service.

Payloads carry only ids, never memory values, so the queue tables hold nothing that a
forget request would have to erase. Every task is idempotent: django-q2 may deliver one
twice (a retry after a killed worker), and each service bounds its own attempts because
django-q2 does not count a killed worker's attempt (django-q2 issue #327).

Results carry ids, statuses and counts only, and a failure reaches django-q2 as its class
name: django-q2 keeps what a task returned, and a failed task's exception text with its
traceback, in its own Task table (failures are never pruned), which no forget request erases —
a summary's key named the end user it was about, and a database error quotes the row it failed
on. The exception itself goes to the server log (zeromem/kernel/tasks.py, which wraps the
audit's and the portal's tasks too).

The schedules' tasks run one at a time (``one_at_a_time``): a copy that finds another running
returns at once.
"""

import functools

from memories.search import embeddings
from memories.search import index as search_index
from memories.services import access, dashboard_stats, forget, idempotency, jobs, retention, summaries, turns
from zeromem.kernel.tasks import TaskFailed, kept, one_at_a_time

__all__ = ["TaskFailed"]  # what a failed task raises (zeromem/kernel/tasks.py)


def _counts_only(result):
    """A summarize result without its summary's key; a forget receipt with the number of
    summaries it rebuilt, not their keys."""
    if not isinstance(result, dict):
        return result
    result = {k: v for k, v in result.items() if k != "key"}
    receipt = result.get("receipt")
    if isinstance(receipt, dict) and isinstance(receipt.get("summaries_rebuilt"), list):
        result["receipt"] = {**receipt, "summaries_rebuilt": len(receipt["summaries_rebuilt"])}
    return result


_kept = functools.partial(kept, shape=_counts_only)


@_kept
@one_at_a_time
def jobs_purge_task() -> int:
    return jobs.jobs_purge()


@_kept
@one_at_a_time
def purge_expired_task() -> dict:
    return retention.purge_expired()


@_kept
def forget_request_task(request_id: int, continues: int | None = None) -> dict:
    # A turn (services.turns): a step of whichever request or job waits longest by tenant.
    # ``continues``: carried by continuations queued before turns; unused.
    return turns.delivery_run(forget_request=request_id)


@_kept
@one_at_a_time
def forget_requests_resume_task() -> int:
    return forget.forget_requests_resume()


@_kept
def summarize_task(job_id: int) -> dict:
    return turns.delivery_run(summarize_job=job_id)


@_kept
@one_at_a_time
def summarize_idle_sessions_task() -> int:
    return summaries.summarize_idle_sessions()


@_kept
@one_at_a_time
def summarize_jobs_resume_task() -> int:
    return summaries.summarize_jobs_resume()


@_kept
@one_at_a_time
def access_counts_fold_task() -> int:
    return access.access_counts_fold()


@_kept
@one_at_a_time
def embed_memories_task() -> dict:
    return embeddings.embeddings_refresh()


@_kept
@one_at_a_time
def search_stats_refresh_task() -> dict:
    return search_index.stats_refresh_stale()


@_kept
@one_at_a_time
def dashboard_stats_refresh_task() -> dict:
    return dashboard_stats.dashboard_stats_refresh_stale()


@_kept
@one_at_a_time
def idempotency_purge_task() -> int:
    return idempotency.idempotency_purge()
