"""Background jobs as callers see them (``GET /api/v1/jobs/{id}``), and whose turn it is at the workers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import DateTimeField, OuterRef, Q, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from audit.services import audited_operation
from memories.models import ApiKey, ForgetRequest, Job, Tenant
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor, require_scope
from zeromem.kernel.errors import NotFound, TenantBusy
from zeromem.kernel.outcomes import ActorKind, Outcome
from zeromem.kernel.pglocks import int4_key
from zeromem.kernel.scopes import Scope

# Forget requests waiting for a worker or on one (ForgetRequest.Status; forget.PENDING).
FORGET_PENDING = (ForgetRequest.Status.RECEIVED, ForgetRequest.Status.RUNNING)
# A tenant's last turn when it never had one: before any other.
NEVER = Value(datetime(1970, 1, 1, tzinfo=UTC), output_field=DateTimeField())
# At most this many job ids are named in a cancellation's audit event (its count has them all).
CANCEL_EVENT_MAX_IDS = 100

# pg_advisory_xact_lock namespaces (with the tenant id): one tenant's starts of one kind take
# turns for the few milliseconds of their count and INSERT, so the cap is exact.
_PENDING_LOCK_NAMESPACES = {"summarize": 0x5A4A, "forget": 0x5A46}  # "ZJ", "ZF"
# What a refused caller is told to wait: jobs take from milliseconds to minutes, so this is a
# polling interval, not a promise.
PENDING_RETRY_AFTER_SECONDS = 10
# Who is capped: the callers a program drives at API rate. Staff (a console, by hand) and the
# schedules (bounded by their own batches; the idle-sessions schedule keeps to the cap itself)
# are not, so support can still file a forget request for a tenant at its cap.
CAPPED_ACTORS = (ActorKind.API_KEY, ActorKind.END_USER)


class TooManyJobs(TenantBusy):
    """The tenant already has as many jobs of this kind pending as it may (429)."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message, code="too_many_jobs", field=field, retry_after=PENDING_RETRY_AFTER_SECONDS)


def lock_pending(*, tenant: Tenant, kind: str) -> None:
    """Until the transaction ends, hold the (kind, tenant) lock that the writers of pending
    ``kind`` rows of ``tenant`` take before counting or looking for them
    (:func:`require_pending_room`): on PostgreSQL a transaction-level advisory lock, taken
    again at no cost by the same transaction; other tenants never wait on it."""
    if connection.vendor == "postgresql":  # SQLite: one writing transaction at a time anyway
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_xact_lock(%s, %s)", [_PENDING_LOCK_NAMESPACES[kind], int4_key(tenant.pk)]
            )


def require_pending_room(
    *, tenant: Tenant, actor: Actor, kind: str, pending: QuerySet, limit: int, setting: str, field: str | None = None
) -> None:
    """Refuse (:class:`TooManyJobs`) a new job of ``kind`` when the tenant already has
    ``limit`` of them ``pending`` (queued or running). Must run inside the transaction that
    then inserts the job: on PostgreSQL it takes a transaction-level advisory lock on (kind,
    tenant), so concurrent starts of one tenant count each other's rows; other tenants never
    wait on it. The queue every tenant shares is one FIFO line, so this cap is what bounds
    how many of one tenant's jobs another tenant's job can find ahead of it.

    Cost: the lock and one COUNT on a pending-rows index; nothing for staff or the schedules."""
    if actor.kind not in CAPPED_ACTORS:
        return
    lock_pending(tenant=tenant, kind=kind)
    if pending.count() >= limit:
        what = "summarize jobs" if kind == "summarize" else "forget requests"
        raise TooManyJobs(
            f"this tenant already has {limit} {what} queued or running ({setting}); "
            "retry once one of them has finished",
            field=field,
        )


def cancelled_error(reason: str) -> str:
    """A job's ``error`` once the API key that asked for it has lost its power (``revoked``,
    ``expired``, ``deleted``): the same words whether the revoke or the worker ended it."""
    return f"cancelled: the API key that asked for it has been {reason}"


def job_get(*, tenant: Tenant, actor: Actor, job_id: Any) -> Job:
    """One of the tenant's jobs; :class:`NotFound` when there is no such job *for this caller*:
    another tenant's job, and a job about keys outside the caller's allowlist (or about the
    whole tenant, for a key with an allowlist), look exactly like a job that does not exist.

    Needs ``memory:read`` (a job's params and result name keys and prefixes). Cost: one
    SELECT by the unique ``job_uid`` index and the audit INSERT.
    """
    with audited_operation(tenant=tenant, actor=actor, action="job.read") as op:
        require_scope(actor, Scope.MEMORY_READ)
        # The job's uid (the row id is never shown: it comes from a sequence every tenant
        # shares); an old numeric id, or anything else, is not found.
        uid = validation.public_uid(job_id)
        op.target = str(uid) if uid is not None else ""
        job = Job.objects.filter(tenant=tenant, uid=uid).first() if uid is not None else None
        if job is None or not _visible(actor, job):
            raise NotFound("no such job", field="job_id")
        op.record()
        return job


def _visible(actor: Actor, job: Job) -> bool:
    if not actor.allowed_prefixes:
        return True
    prefix = job.params.get("prefix") if isinstance(job.params, dict) else None
    return isinstance(prefix, str) and bool(prefix) and actor.may_touch_prefix(prefix)


def jobs_cancel_for_key(*, tenant: Tenant, actor: Actor, key: ApiKey, reason: str = "revoked") -> int:
    """End as ``cancelled`` (nothing run, ``finished_at`` now) the jobs ``key`` asked for that
    are still ``queued``; returns how many. Called by the key's revoke, in its transaction, so
    ``GET /api/v1/jobs/{id}`` says so at once instead of when a worker picks the job up. One
    ``memory.summarize.cancel`` event (``denied``, as a job the worker cancels) counts them,
    with ``detail.reason`` (``api_key_revoked``) and the first ``CANCEL_EVENT_MAX_IDS`` job ids;
    none when there were none. A job already ``running`` is left to its own checks (the
    worker's, before the work and in the write's transaction): its attempt holds the row.

    Races: a worker's attempt that marks the job running locks the row first; this UPDATE
    waits for it and then skips the row (no longer queued), or, committing first, leaves the
    attempt a finished job it does nothing with. Cost: a locking SELECT and an UPDATE over the
    tenant's pending jobs (the ``job_tenant_pending`` partial index: a few rows, however many
    finished jobs the tenant keeps; no index on the key is needed) and, when any, the audit INSERT.
    """
    with audited_operation(
        tenant=tenant, actor=actor, action="memory.summarize.cancel", target=key.display_prefix
    ) as op:
        rows = sorted(
            Job.objects.filter(tenant=tenant, api_key_id=key.pk, status=Job.Status.QUEUED)
            .select_for_update()
            .values_list("pk", "uid")
        )
        ids = [pk for pk, _ in rows]
        if not ids:
            return 0
        # Locked above; the status is checked again in case an attempt began in between.
        count = Job.objects.filter(pk__in=ids, status=Job.Status.QUEUED).update(
            status=Job.Status.CANCELLED, error=cancelled_error(reason), finished_at=timezone.now()
        )
        if count:
            op.record(
                outcome=Outcome.DENIED,
                count=count,
                detail={"reason": f"api_key_{reason}", "job_ids": [str(uid) for _, uid in rows[:CANCEL_EVENT_MAX_IDS]]},
            )
        return count


def turn_claim_next(*, now=None) -> Job | ForgetRequest | None:
    """Lock and return the summarize job or forget request whose turn it is, or None; the
    caller is in a transaction and begins its attempt (or step) in it.

    django-q2's queue is one first-come line for every tenant and both kinds of work: one
    tenant's 20 queued summarize jobs put another's job or forget request behind all of them
    (with an LLM summarizer, 20 × the LLM's answer time ÷ ``Q_WORKERS``). A delivery of either
    task is therefore a turn, not an order: it runs what waits of the tenant *served longest
    ago* — the latest of its summarize attempts' starts and its forget requests' turns (a step's
    start and its end); a tenant never served first — and of that tenant its forget request due
    first, else its oldest job. Every job and every step was enqueued once, so each still has a
    turn coming (see services.turns.delivery_run).

    A job waits when ``queued`` for a first attempt, or when its latest attempt began more than
    ``Q_TIMEOUT`` ago — then that attempt is over (django-q2 kills a task at ``Q_TIMEOUT``):
    ``queued`` after a failure (its retry not taken sooner than django-q2 itself would take
    it, ``Q_RETRY`` > ``Q_TIMEOUT``), or ``running`` with its worker gone. A forget request
    waits when received or running with no step holding a worker (``stepping``: a step that
    handed its worker back after ``FORGET_SLICE_SECONDS``), or with a step that began more than
    ``Q_TIMEOUT`` ago. ``SKIP LOCKED``: two workers never claim one, and neither waits on the
    other (the kind not chosen stays locked to the caller's commit, milliseconds).

    Cost: two statements, one over the waiting jobs (the ``job_tenant_pending`` index; at most
    ``ZEROMEM_TENANT_MAX_PENDING_JOBS`` per tenant for API keys) and one over the pending forget
    requests (``forget_pending``), each with two index probes per row for its tenant's latest
    turn (``job_tenant_started``, ``forget_tenant_turn``).
    """
    now = now or timezone.now()
    over = now - timedelta(seconds=settings.Q_CLUSTER.get("timeout", 300))
    job_waits = Q(status=Job.Status.QUEUED, attempts=0) | Q(status__in=Job.PENDING, attempts__gt=0, started_at__lt=over)
    # A job whose LLM endpoint asked for time (Retry-After, Job.retry_at) does not wait yet.
    job_waits &= Q(retry_at__isnull=True) | Q(retry_at__lte=now)
    job = (
        Job.objects.filter(job_waits, kind=Job.Kind.SUMMARIZE)
        .annotate(served=_served())
        .order_by("served", "created_at", "pk")
        .select_for_update(skip_locked=True)
        .first()
    )
    forget_waits = Q(stepping=False) | Q(turn_at__lt=over)
    request = (
        ForgetRequest.objects.filter(forget_waits, status__in=FORGET_PENDING)
        .annotate(served=_served())
        .order_by("served", "due_at", "created_at", "pk")
        .select_for_update(skip_locked=True)
        .first()
    )
    if request is not None and (job is None or request.served <= job.served):
        return request
    return job


def _served():
    """When the row's tenant last had a turn (``NEVER`` if it never had one): the latest start
    of an attempt of its summarize jobs and the latest turn of its forget requests."""
    job = (
        Job.objects.filter(tenant_id=OuterRef("tenant_id"), kind=Job.Kind.SUMMARIZE, started_at__isnull=False)
        .order_by("-started_at")
        .values("started_at")[:1]
    )
    forget = (
        ForgetRequest.objects.filter(tenant_id=OuterRef("tenant_id"), turn_at__isnull=False)
        .order_by("-turn_at")
        .values("turn_at")[:1]
    )
    # Coalesced: GREATEST of a NULL is NULL on SQLite (PostgreSQL skips it).
    return Greatest(Coalesce(Subquery(job), NEVER), Coalesce(Subquery(forget), NEVER))


def jobs_purge() -> int:
    """Delete finished jobs (succeeded, failed or cancelled) that finished more than
    ``ZEROMEM_JOB_RETENTION_DAYS`` ago: their params and results name key prefixes, so they
    are not kept longer than a caller could want to read them. Age counts from
    ``finished_at`` (a job retried for days, or queued behind a backlog, is kept the whole
    period after it ended; a job row from before ``finished_at`` was set counts from its
    ``created_at``); a queued or running job is never deleted. Returns how many; one
    ``job.purge`` audit event per tenant.
    Cost: one DELETE per tenant with such jobs; the filter on ``finished_at`` has no index
    (a daily job over a table this purge keeps to ~30 days of jobs)."""
    cutoff = timezone.now() - timedelta(days=settings.ZEROMEM_JOB_RETENTION_DAYS)
    actor = Actor.system(job="jobs-purge")
    done = 0
    old = Job.objects.filter(status__in=Job.FINISHED).alias(ended=Coalesce("finished_at", "created_at"))
    old = old.filter(ended__lt=cutoff)
    for tenant_id in sorted(set(old.values_list("tenant_id", flat=True).distinct())):
        with audited_operation(tenant=Tenant(pk=tenant_id), actor=actor, action="job.purge") as op:
            count, _ = old.filter(tenant_id=tenant_id).delete()
            if count:
                op.record(count=count)
            done += count
    return done
