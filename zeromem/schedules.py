"""Recurring jobs, declared in code and applied with ``python manage.py zeromem_schedules``
(``update_or_create`` by name, so re-running changes nothing). ``python3 -m zeromem up``
applies them before starting the workers.

Each entry: django-q2 schedule name → (task dotted path, schedule type, minutes).
"""

from django_q.models import Schedule

SCHEDULE_PREFIX = "zeromem:"

SCHEDULES = {
    # Expired memories are invisible at once; this erases them (and old trash) in batches.
    "zeromem:purge-expired": ("memories.tasks.purge_expired_task", Schedule.MINUTES, 5),
    # Portal links past their expiry and any session they could have started are deleted.
    "zeromem:portal-links-purge": ("memories.portal.tasks.portal_links_purge_task", Schedule.HOURLY, None),
    # Forget requests whose worker died (or whose queue entry was lost, as with the Redis
    # broker) are picked up again; each request's own attempt counter bounds the retries.
    "zeromem:forget-requests-resume": ("memories.tasks.forget_requests_resume_task", Schedule.MINUTES, 10),
    # Sessions idle longer than ZEROMEM_SUMMARIZE_IDLE_MINUTES are compacted into summaries.
    "zeromem:summarize-idle-sessions": ("memories.tasks.summarize_idle_sessions_task", Schedule.MINUTES, 15),
    # Summarize jobs whose queue entry was lost, or that django-q2 stopped retrying, are
    # enqueued again; each job's own attempt counter bounds the retries.
    "zeromem:summarize-jobs-resume": ("memories.tasks.summarize_jobs_resume_task", Schedule.MINUTES, 10),
    # Search term frequencies (idf) of tenants whose memories changed are recounted from the
    # index; searches meanwhile use the last count (memories/search/index.py).
    "zeromem:search-stats": ("memories.tasks.search_stats_refresh_task", Schedule.MINUTES, 10),
    # The admin dashboard's aggregates over live memories, per tenant with activity since
    # their last count (memories/services/dashboard_stats.py).
    "zeromem:dashboard-stats": ("memories.tasks.dashboard_stats_refresh_task", Schedule.MINUTES, 5),
    # Memories written since the last run get their embeddings (semantic search); until then
    # they are found by words only. Each run stops after ~50 s, so runs do not pile up.
    "zeromem:embed-memories": ("memories.tasks.embed_memories_task", Schedule.MINUTES, 1),
    # Audit events are chained into seals (tamper evidence) a minute or so after they happen;
    # requests never wait for this (see audit/models.py).
    "zeromem:audit-seal": ("audit.tasks.audit_seal_task", Schedule.MINUTES, 1),
    # Reads are counted into access_count/last_accessed_at from their (sealed) audit events,
    # so a read writes nothing but its event (memories/services/access.py).
    "zeromem:access-counts": ("memories.tasks.access_counts_fold_task", Schedule.MINUTES, 1),
    # Unverified failed authentications are counted per source and minute; each closed
    # minute becomes one tenant-less auth.failed event with its count. Refusals over a
    # tenant's limits (429 tenant_busy, search_budget) likewise, as one event with its count
    # in the tenant's own log.
    "zeromem:auth-failures-flush": ("audit.tasks.audit_auth_failures_flush_task", Schedule.MINUTES, 1),
    # Stored first answers of Idempotency-Key requests past ZEROMEM_IDEMPOTENCY_SECONDS (24 h).
    "zeromem:idempotency-purge": ("memories.tasks.idempotency_purge_task", Schedule.HOURLY, None),
    # Finished jobs older than ZEROMEM_JOB_RETENTION_DAYS are deleted (their params and
    # results name key prefixes).
    "zeromem:jobs-purge": ("memories.tasks.jobs_purge_task", Schedule.DAILY, None),
    # Audit events past each tenant's retention are deleted: whole monthly partitions when every
    # tenant's retention allows (PostgreSQL), else whole seals at a time.
    "zeromem:audit-purge": ("audit.tasks.audit_purge_task", Schedule.DAILY, None),
    # PostgreSQL: the audit log's monthly partitions for this month and the next two exist
    # (audit/partitions.py); an event of a month without one lands in the default partition.
    "zeromem:audit-partitions": ("audit.tasks.audit_partitions_task", Schedule.DAILY, None),
}


def apply_schedules() -> dict[str, str]:
    """Create or update every declared schedule and delete stale ``zeromem:`` ones.
    Returns {name: "created" | "updated" | "unchanged" | "deleted"}."""
    outcome: dict[str, str] = {}
    for name, (func, schedule_type, minutes) in SCHEDULES.items():
        wanted = {"func": func, "schedule_type": schedule_type, "minutes": minutes, "repeats": -1}
        current = Schedule.objects.filter(name=name).first()
        if current is None:
            Schedule.objects.create(name=name, **wanted)
            outcome[name] = "created"
        elif any(getattr(current, k) != v for k, v in wanted.items()):
            for k, v in wanted.items():
                setattr(current, k, v)
            current.save()
            outcome[name] = "updated"
        else:
            outcome[name] = "unchanged"
    for stale in Schedule.objects.filter(name__startswith=SCHEDULE_PREFIX).exclude(name__in=SCHEDULES):
        outcome[stale.name] = "deleted"
        stale.delete()
    return outcome
