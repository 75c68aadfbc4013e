"""django-q2 tasks: dotted-path functions that take ids and call a service.

Payloads carry only ids, never memory values, so the queue tables hold nothing that a
forget request would have to erase. Every task is idempotent: django-q2 may deliver one
twice (a retry after a killed worker), and each service bounds its own attempts because
django-q2 does not count a killed worker's attempt (django-q2 issue #327).
"""

from memories.search import embeddings
from memories.search import index as search_index
from memories.services import access, dashboard_stats, forget, idempotency, jobs, retention, summaries, turns


def jobs_purge_task() -> int:
    return jobs.jobs_purge()


def purge_expired_task() -> dict:
    return retention.purge_expired()


def forget_request_task(request_id: int, continues: int | None = None) -> dict:
    # A turn (services.turns): a step of whichever request or job waits longest by tenant.
    # ``continues``: carried by continuations queued before turns; unused.
    return turns.delivery_run(forget_request=request_id)


def forget_requests_resume_task() -> int:
    return forget.forget_requests_resume()


def summarize_task(job_id: int) -> dict:
    return turns.delivery_run(summarize_job=job_id)


def summarize_idle_sessions_task() -> int:
    return summaries.summarize_idle_sessions()


def summarize_jobs_resume_task() -> int:
    return summaries.summarize_jobs_resume()


def access_counts_fold_task() -> int:
    return access.access_counts_fold()


def embed_memories_task() -> dict:
    return embeddings.embeddings_refresh()


def search_stats_refresh_task() -> dict:
    return search_index.stats_refresh_stale()


def dashboard_stats_refresh_task() -> dict:
    return dashboard_stats.dashboard_stats_refresh_stale()


def idempotency_purge_task() -> int:
    return idempotency.idempotency_purge()
