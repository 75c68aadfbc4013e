"""Summarization: compact a namespace (e.g. a finished session) into one summary memory.

``summarize_start`` checks the caller and queues a :class:`~memories.models.Job`;
``summarize_run`` does the work, on a delivery of the django-q2 task
``memories.tasks.summarize_task`` (``services.turns.delivery_run``: tenants take turns).

The summary lands at a documented key: ``summary:<prefix without its trailing ':'>``, so
``session:s1:`` is summarized into ``summary:session:s1`` and ``user:u10086:`` into
``summary:user:u10086``. It is a normal memory (versioned, audited, readable with
``memory_read``) with category ``summary``, the sources' subject when they all share one,
and ``sources``: the keys it was derived from (its lineage, which forget requests follow).

Summarizers:

* ``digest`` (default, no LLM, zero tokens): one ``key = value`` line per memory, the key
  relative to the prefix, most important first, then most recent, within
  ``settings.ZEROMEM_SUMMARY_MAX_CHARS``; a last line says how many were left out.
* ``llm`` (when ``settings.ZEROMEM_LLM_BASE_URL`` is set): the digest is sent to an
  OpenAI-compatible ``{base}/chat/completions`` endpoint and its answer is the summary.

The summary expires when the last of its sources does (never if one of them never does), set
on every run (:func:`summary_expiry`). A job asked by an API key is cancelled, nothing
written, once that key is revoked or expired (:func:`_requester_refusal`); the revoke
itself cancels the key's jobs still queued (:func:`memories.services.jobs.jobs_cancel_for_key`).

Lineage lists the memories the summary really covers: those whose lines are in the digest.
With ``archive=True`` exactly those are moved to the trash; memories left out of the digest
stay live, so archiving never loses anything the summary does not hold.
"""

from __future__ import annotations

import email.utils
import hashlib
import http.client
import json
import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import connection, transaction
from django.db.models import Count, Max, Q
from django.utils import timezone

from audit.services import AuditedOperation, audited_operation
from memories.models import ApiKey, Job, Memory, Tenant
from memories.services import retention, sensitivity
from memories.services.jobs import cancelled_error, require_pending_room
from memories.services.memories import memory_delete, memory_write
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor, require_scope
from zeromem.kernel.errors import Forbidden, InvalidInput, ServiceError
from zeromem.kernel.outcomes import ActorKind, Outcome
from zeromem.kernel.scopes import Scope

logger = logging.getLogger(__name__)

SUMMARY_KEY_PREFIX = "summary:"
# The summary key must fit the key grammar's 512 characters.
PREFIX_MAX_LEN = validation.KEY_MAX_LEN - len(SUMMARY_KEY_PREFIX)
# A digest line is cut (not dropped) when at least this much room is left for it.
MIN_CUT_LINE = 40
# At most this many jobs per run of the idle-sessions schedule (the next run takes the rest).
IDLE_BATCH = 200
# A session whose summarize job failed (its attempts spent) with no memory written since is
# not started again by the idle schedule for this long.
IDLE_FAILED_BACKOFF = timedelta(hours=6)
# A chat completion larger than this is refused rather than read into memory.
LLM_MAX_ANSWER_BYTES = 1024 * 1024
# The longest wait an LLM endpoint's Retry-After may ask of a job's next attempt (a daily quota
# says "tomorrow"); a job still has ZEROMEM_JOB_MAX_ATTEMPTS attempts in all.
LLM_RETRY_AFTER_MAX = 6 * 3600

LLM_INSTRUCTIONS = (
    "You compact an AI agent's memory. Below are memories as 'key = value' lines, most "
    "important first. Write a short summary that keeps every fact, preference, decision "
    "and open task an agent would need later. Plain text, no preamble."
)


class SummarizerError(RuntimeError):
    """The summarizer could not produce a summary (the LLM endpoint failed). The job's
    attempt fails and django-q2 retries it; nothing has been written. ``code`` names the
    kind of failure in the attempt's audit event (``memory.summarize.fail``)."""

    def __init__(self, message: str, *, code: str = "llm_error"):
        super().__init__(message)
        self.code = code


class SummarizerBusy(SummarizerError):
    """The LLM endpoint said "not now" (HTTP 429 or 503) and when to come back (its
    ``Retry-After``): no job calls that endpoint again before then (:func:`llm_backoff_until`),
    up to :data:`LLM_RETRY_AFTER_MAX`, instead of coming back after ``Q_RETRY`` and spending
    attempts on answers the endpoint already said it would refuse."""

    def __init__(self, message: str, *, retry_after: float):
        super().__init__(message, code="llm_busy")
        self.retry_after = retry_after


class SourcesErased(SummarizerError):
    """A source was erased (a forget request, the purge) after the job read it: the text
    holds what was erased, so it is not written. The retry summarizes what is left."""


def summary_key(prefix: str) -> str:
    """``session:s1:`` → ``summary:session:s1`` (see the module docstring)."""
    return SUMMARY_KEY_PREFIX + prefix.rstrip(":")


def _max_attempts() -> int:
    return getattr(settings, "ZEROMEM_JOB_MAX_ATTEMPTS", 5)


# --- start -------------------------------------------------------------------------------


def summarize_start(*, tenant: Tenant, actor: Actor, prefix: Any, archive: Any = False) -> Job:
    """Queue a summarization of the live memories under ``prefix``; returns the job at once.

    Needs ``memory:read`` and ``memory:write`` (and ``memory:delete`` with ``archive``), and
    an allowlist that covers both the prefix and the summary key: the job writes (and may
    archive) on the caller's behalf. The job row holds the prefix and the flag, no values.
    An API key's start past the tenant's ``ZEROMEM_TENANT_MAX_PENDING_JOBS`` pending summarize
    jobs is refused (429 ``too_many_jobs``, :func:`~memories.services.jobs.require_pending_room`).
    Cost: the cap's lock and COUNT, the job INSERT and the audit INSERT; the work is enqueued
    after commit.
    """
    with audited_operation(tenant=tenant, actor=actor, action="memory.summarize", target=prefix) as op:
        prefix = validation.prefix(prefix)
        if not prefix:
            raise InvalidInput(
                "must not be empty: name the namespace to summarize, e.g. 'session:s1:'",
                field="prefix",
                code="required",
            )
        if len(prefix) > PREFIX_MAX_LEN:
            raise InvalidInput(
                f"must be at most {PREFIX_MAX_LEN} characters (the summary key is '{SUMMARY_KEY_PREFIX}' + prefix)",
                field="prefix",
                code="too_long",
            )
        if not isinstance(archive, bool):
            raise InvalidInput("must be true or false", field="archive")
        require_scope(actor, Scope.MEMORY_READ)
        require_scope(actor, Scope.MEMORY_WRITE)
        if archive:
            require_scope(actor, Scope.MEMORY_DELETE)
        if not _allowlist_covers(actor, prefix) or not actor.may_touch(summary_key(prefix)):
            raise Forbidden(
                code="key_not_allowed",
                message="this API key may not touch keys outside its allowed prefixes "
                f"(the prefix and its summary key '{summary_key(prefix)}')",
                field="prefix",
            )
        require_pending_room(
            tenant=tenant,
            actor=actor,
            kind="summarize",
            pending=Job.objects.filter(tenant=tenant, kind=Job.Kind.SUMMARIZE, status__in=Job.PENDING),
            limit=settings.ZEROMEM_TENANT_MAX_PENDING_JOBS,
            setting="ZEROMEM_TENANT_MAX_PENDING_JOBS",
        )
        job = Job.objects.create(
            tenant=tenant,
            kind=Job.Kind.SUMMARIZE,
            params={"prefix": prefix, "archive": archive},
            requested_by=actor.label[:150],
            api_key_id=int(actor.id) if actor.kind == ActorKind.API_KEY else None,
        )
        op.record(target=prefix, detail={"job_id": str(job.uid), "archive": archive})
        # robust: a broker that refuses the task must not turn the accepted job into a 500.
        transaction.on_commit(lambda: _enqueue(job.pk), robust=True)
        return job


def _allowlist_covers(actor: Actor, prefix: str) -> bool:
    """Every key under ``prefix`` is inside the actor's allowlist."""
    return actor.may_touch_prefix(prefix)


def _enqueue(job_id: int) -> None:
    from django_q.tasks import async_task

    async_task("memories.tasks.summarize_task", job_id)


def summarize_enqueue(job_id: int) -> None:
    """Enqueue a delivery (a turn) for the job again: services.turns.delivery_run, whose turn
    another's failed attempt took."""
    _enqueue(job_id)


# --- run ---------------------------------------------------------------------------------


def summarize_run(*, job_id: int) -> dict:
    """Run one attempt of this summarize job now, whoever's turn it is (a delivery of the django-q2
    task takes turns: services.turns.delivery_run). Idempotent.

    * A finished job (succeeded, failed or cancelled) is left alone: a duplicate delivery does nothing.
    * The attempt is counted first, in its own transaction, so an attempt whose worker is
      killed still counts (django-q2 does not count those: its issue #327); past
      ``ZEROMEM_JOB_MAX_ATTEMPTS`` the job is marked failed and not run again.
    * The summary write, its lineage, the archiving and the job's success commit together:
      a failure at any point leaves nothing half-written. A failed attempt records its error
      on the job (``queued`` again while attempts remain, ``failed`` after the last) and
      re-raises, so django-q2 retries it.

    Cost: one query for the sources (ordered by importance and recency, read until the
    budget is full) and a count; then per write the usual memory_write/memory_delete cost.
    """
    return _attempt_run(summarize_attempt_begin(job_id), job_id)


def summarize_attempt_run(job: Job) -> dict:
    """Run the attempt :func:`summarize_attempt_begin` began, on a delivery's turn
    (services.turns.delivery_run): see :func:`summarize_run`."""
    return _attempt_run(job, job.pk)


def summarize_job_state(job_id: int) -> dict:
    """What a job is now, for a delivery enqueued for it that found nothing waiting: its
    result once it succeeded, else its status (it began on another delivery's turn, and a live
    attempt is not started twice). Cost: one primary-key SELECT."""
    own = Job.objects.filter(pk=job_id).values("status", "result").first()
    if own is None:
        return {"status": "missing", "job_id": job_id}
    if own["status"] == Job.Status.SUCCEEDED:
        return own["result"]
    return {"status": own["status"], "job_id": job_id}


def _attempt_run(job: Job | None, job_id: int) -> dict:
    """The attempt :func:`summarize_attempt_begin` began (see :func:`summarize_run`)."""
    if job is not None and job.status == Job.Status.SUCCEEDED:
        return job.result
    if job is None or job.status != Job.Status.RUNNING:
        return {"status": job.status if job else "missing", "job_id": job_id}
    tenant = job.tenant
    prefix, archive = job.params["prefix"], bool(job.params.get("archive"))
    try:
        # A key revoked before the work starts costs no LLM call (checked again below).
        refusal = _requester_refusal(job)
        if refusal is None:
            digest = _digest(tenant=tenant, prefix=prefix, max_chars=settings.ZEROMEM_SUMMARY_MAX_CHARS)
            text, summarizer, tokens = digest.text, "digest", 0
            # A sensitive value never leaves the server: such a namespace keeps the digest.
            if digest.sources and settings.ZEROMEM_LLM_BASE_URL and not _any_sensitive(tenant, digest.sources):
                # Outside any transaction: no lock is held while the LLM thinks.
                text, tokens = _llm_summarize(digest.text)
                summarizer = "llm"
        with audited_operation(
            tenant=tenant, actor=_job_actor(job), action="memory.summarize.run", target=prefix
        ) as op:
            current = _attempt_current(job)
            if current is not None:
                return current
            # In the write's transaction: a key revoked while the LLM thought stops the write.
            refusal = refusal or _requester_refusal(job)
            if refusal is not None:
                return _attempt_cancelled(job, op, refusal)
            result = _write_summary(job=job, digest=digest, text=text, archive=archive)
            result.update(summarizer=summarizer, tokens=tokens)
            Job.objects.filter(pk=job.pk).update(
                status=Job.Status.SUCCEEDED, result=result, error="", finished_at=timezone.now()
            )
            op.record(
                count=result["sources"],
                detail={
                    "job_id": str(job.uid),
                    "summarizer": summarizer,
                    "tokens": tokens,
                    "archived": result["archived"],
                },
            )
        return result
    except Exception as exc:
        _attempt_failed(job, exc)
        raise


def summarize_attempt_begin(job_id: int) -> Job | None:
    """Count the attempt and mark the job running (its own transaction, or the caller's: a
    delivery claims the job and begins its attempt in one, services.turns.delivery_run).
    Returns the job; its status is ``running`` only if this attempt should do the work."""
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).select_related("tenant").filter(pk=job_id).first()
        if job is None or job.status in Job.FINISHED:
            return job
        now = timezone.now()
        if job.retry_at is not None and job.retry_at > now:
            # The LLM endpoint asked for time (Retry-After): this delivery counts no attempt and
            # runs nothing; summarize_jobs_resume enqueues the job once the time has come.
            return job
        # A latest attempt still "running" is over when it began more than Q_TIMEOUT ago
        # (django-q2 kills a task then) or never said when: its worker stopped.
        stopped = job.status == Job.Status.RUNNING and (
            job.started_at is None or job.started_at < now - timedelta(seconds=settings.Q_CLUSTER.get("timeout", 300))
        )
        if stopped and job.attempts:
            # The stopped attempt could not say so itself: its event is written now.
            with audited_operation(
                tenant=job.tenant, actor=_job_actor(job), action="memory.summarize.fail", target=job.params["prefix"]
            ) as op:
                _record_failed_attempt(op, job, code="worker_stopped", gave_up=job.attempts >= _max_attempts())
        if job.status == Job.Status.QUEUED or stopped:
            paused = llm_backoff_until(now)
            if paused is not None:
                # The LLM endpoint asked another job for time (Retry-After): this one waits
                # too, with no attempt counted and no call made, as if it had asked itself.
                # (A job that would not call it — a digest — waits as well: which one needs
                # the endpoint is known only once its sources are read.)
                job.status, job.retry_at = Job.Status.QUEUED, paused
                job.save(update_fields=["status", "retry_at"])
                return job
        job.attempts += 1
        if job.attempts > _max_attempts():
            job.status = Job.Status.FAILED
            job.error = (
                f"gave up after {_max_attempts()} attempts"
                + (f"; last error: {job.error}" if job.error else " (the worker stopped)")
            )[:2000]
            job.finished_at = now
        else:
            # started_at is when the latest attempt began: summarize_jobs_resume() reads it.
            job.status = Job.Status.RUNNING
            job.started_at = now
        job.retry_at = None
        job.save(update_fields=["attempts", "status", "error", "started_at", "finished_at", "retry_at"])
        return job


def _attempt_current(job: Job) -> dict | None:
    """None if this attempt is still the job's latest (it then holds the job row locked to
    its commit); else what the job is now, and this attempt writes nothing. Two deliveries
    of one job can run at once (the resume schedule enqueues a job again while its first
    delivery still waits in a backlogged queue): only the attempt that began last writes,
    so the summary is written and its sources archived once."""
    latest = Job.objects.select_for_update().filter(pk=job.pk).values("status", "attempts", "result").first()
    if latest is not None and (latest["status"], latest["attempts"]) == (Job.Status.RUNNING, job.attempts):
        return None
    if latest is not None and latest["status"] == Job.Status.SUCCEEDED:
        return latest["result"]
    return {"status": latest["status"] if latest else "missing", "job_id": job.pk}


def _requester_refusal(job: Job) -> str | None:
    """Why the API key that asked for ``job`` may no longer have it written (``revoked``,
    ``expired``, ``deleted``), or None: the key is live, or no key asked (staff, a schedule).
    The job writes on the key's behalf: once the key has lost its power, so has its queued
    work. Not locked: a revoke that commits while the write's own transaction runs
    (milliseconds) does not stop it, as for a request already past authentication; a lock
    would make every request of the key wait, to update ``last_used_at``, on the summary.
    Cost: one primary-key SELECT, none for a job no key asked for."""
    if job.api_key_id is None:
        return None
    key = ApiKey.objects.filter(pk=job.api_key_id, tenant_id=job.tenant_id).values("revoked_at", "expires_at").first()
    if key is None:
        return "deleted"
    if key["revoked_at"] is not None:
        return "revoked"
    if key["expires_at"] is not None and key["expires_at"] <= timezone.now():
        return "expired"
    return None


def _attempt_cancelled(job: Job, op: AuditedOperation, refusal: str) -> dict:
    """End ``job`` as cancelled, nothing written, in the attempt's transaction (which holds
    the job row, see :func:`_attempt_current`), audited ``denied`` with the reason."""
    Job.objects.filter(pk=job.pk).update(
        status=Job.Status.CANCELLED,
        error=cancelled_error(refusal),
        finished_at=timezone.now(),
    )
    op.record(outcome=Outcome.DENIED, detail={"job_id": str(job.uid), "reason": f"api_key_{refusal}"})
    return {"status": Job.Status.CANCELLED.value, "job_id": job.pk}


def _attempt_failed(job: Job, exc: Exception) -> None:
    # The job's error is shown to every memory:read key of the tenant (GET /api/v1/jobs/<id>):
    # only our own SummarizerError messages (the endpoint's status, the kind of bad answer)
    # are kept; any other exception's text can quote keys or values (a database error
    # names the row it failed on), so it keeps its class name and goes to the log.
    if isinstance(exc, SummarizerError):
        error = f"{type(exc).__name__}: {exc}"[:2000]
    else:
        error = f"{type(exc).__name__} (details in the server log)"
        logger.warning("summarize job %s attempt %s failed", job.pk, job.attempts, exc_info=exc)
    last = job.attempts >= _max_attempts()
    now = timezone.now()
    retry_at = None
    if isinstance(exc, SummarizerBusy):
        # The endpoint's Retry-After holds for every job that would call it (llm_backoff_until);
        # this one's own next attempt is not before then either (turn_claim_next,
        # summarize_attempt_begin and summarize_jobs_resume read Job.retry_at).
        endpoint_at = llm_backoff(now + timedelta(seconds=exc.retry_after))
        retry_at = None if last else endpoint_at
    if retry_at is not None:
        error += f"; next attempt not before {_iso(retry_at)}"
    with audited_operation(
        tenant=job.tenant, actor=_job_actor(job), action="memory.summarize.fail", target=job.params["prefix"]
    ) as op:
        # Only the latest attempt speaks for the job: an older one overlapped by it (see
        # _attempt_current) must not set a job that is running again back to queued.
        if Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING, attempts=job.attempts).update(
            status=Job.Status.FAILED if last else Job.Status.QUEUED,
            error=f"attempt {job.attempts} of {_max_attempts()} failed: {error}",
            finished_at=now if last else None,
            retry_at=retry_at,
        ):
            _record_failed_attempt(op, job, code=_error_code(exc), gave_up=last, retry_at=retry_at)


def _error_code(exc: Exception) -> str:
    """What kind of failure ``exc`` is, as the attempt's audit event names it: never its text
    (an exception's message can quote a key or a value)."""
    if isinstance(exc, SummarizerError | ServiceError):
        return exc.code
    return "internal_error"


def _record_failed_attempt(
    op: AuditedOperation, job: Job, *, code: str, gave_up: bool, retry_at: datetime | None = None
) -> None:
    """The ``memory.summarize.fail`` event of one failed attempt of ``job`` (``unavailable``):
    which job (its uid), which attempt of how many, the kind of error, whether the job gave up
    with it, and when the next attempt may come if the LLM endpoint said so. One per failed
    attempt, the last one's included; no memory value, no LLM text."""
    detail = {
        "job_id": str(job.uid),
        "attempt": job.attempts,
        "max_attempts": _max_attempts(),
        "error": code,
        "gave_up": gave_up,
    }
    if retry_at is not None:
        detail["next_attempt_at"] = _iso(retry_at)
    op.record(outcome=Outcome.UNAVAILABLE, target=job.params.get("prefix", ""), detail=detail)


def _iso(when: datetime) -> str:
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


def summarize_jobs_resume(*, now: datetime | None = None) -> int:
    """Enqueue again the summarize jobs that are pending (queued or running) but have not
    started an attempt for twice ``Q_CLUSTER["retry"]`` seconds (django-q2's own redelivery
    comes first): their queue entry was lost (a refused enqueue, a broker without
    redelivery) or django-q2 stopped retrying them before their own attempts ran out.
    Returns how many. The job's attempt counter still bounds how
    often it runs, and a duplicate delivery of a finished job does nothing.

    Cost: one query over the pending jobs (at most ``IDLE_BATCH``), one enqueue each.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=2 * settings.Q_CLUSTER.get("retry", 360))
    stale = list(
        Job.objects.filter(kind=Job.Kind.SUMMARIZE, status__in=[Job.Status.QUEUED, Job.Status.RUNNING])
        .filter(
            Q(started_at__lt=cutoff)
            | Q(started_at__isnull=True, created_at__lt=cutoff)
            # Its Retry-After has passed: the delivery django-q2 retried found it still waiting.
            | Q(status=Job.Status.QUEUED, retry_at__lte=now)
        )
        .exclude(retry_at__gt=now)
        .order_by("created_at")
        .values_list("pk", flat=True)[:IDLE_BATCH]
    )
    for job_id in stale:
        _enqueue(job_id)
    return len(stale)


def _job_actor(job: Job) -> Actor:
    # The caller's permissions were checked when the job was accepted; the work is done
    # (and audited) as this job — named by its uid (the tenant reads its audit log; the row id
    # comes from a sequence every tenant shares).
    return Actor.system(job=f"summarize#{job.uid}")


@dataclass
class Digest:
    text: str
    sources: list[Memory] = field(default_factory=list)
    left_out: int = 0


def _digest(*, tenant: Tenant, prefix: str, max_chars: int) -> Digest:
    """The deterministic, LLM-free summary of the live memories under ``prefix``."""
    base = prefix[: prefix.rfind(":") + 1]  # keys are shown relative to this
    candidates = (
        Memory.objects.for_tenant(tenant)
        .live()
        .under_prefix(prefix)
        .exclude(category=Memory.Category.SUMMARY)
        .order_by("-importance", "-updated_at", "key")
    )
    total = candidates.count()
    # No line is shorter than "k = " plus its newline: more rows than this can never fit.
    # Their ids first, their values a few at a time as the digest takes them: it stops at its
    # budget, and 401 whole values read at once (16 KiB of "[{},{},...]" each) held 168 MB in
    # the worker for a digest of one line.
    rows = _Rows(list(candidates.values_list("pk", flat=True)[: max_chars // 5 + 1]), candidates)
    # The summary is a memory of the tenant: it must fit the tenant's value limit, in bytes
    # (2000 characters of Chinese are ~6000), or every attempt's write is refused. Fewer
    # characters until it fits, so the lineage still lists exactly the lines it holds.
    max_bytes = tenant.effective_value_max_bytes
    while True:
        digest = _digest_of(rows, total=total, base=base, max_chars=max_chars)
        size = _stored_size(digest.text)
        if size <= max_bytes or max_chars <= 0:
            return digest
        max_chars = min(max_chars - 1, max_chars * max_bytes // size)


class _Rows:
    """The memories of ``ids`` (in that order) for :func:`_digest_of`, read from ``live`` by
    groups of :data:`DIGEST_READ_GROUP` as it goes and kept for its next pass; one deleted
    since its id was read is skipped (it is no source). Cost: one primary-key SELECT per group
    the digest reaches (one for a namespace of large values, at most 26 for 401 small ones)."""

    def __init__(self, ids: list[int], live):
        self._ids, self._live, self._read, self._rows = ids, live, 0, []

    def __iter__(self):
        i = 0
        while True:
            while i >= len(self._rows) and self._read < len(self._ids):
                group = self._ids[self._read : self._read + DIGEST_READ_GROUP]
                self._read += len(group)
                found = self._live.order_by().in_bulk(group)
                self._rows += [found[pk] for pk in group if pk in found]
            if i >= len(self._rows):
                return
            yield self._rows[i]
            i += 1


# How many memories a digest reads at a time (see _Rows).
DIGEST_READ_GROUP = 16


def _stored_size(text: str) -> int:
    """Bytes ``text`` takes as a memory value (what the tenant's value limit counts)."""
    return len(json.dumps(text, ensure_ascii=False, separators=(",", ":")).encode())


def _fit_value_limit(text: str, max_bytes: int) -> str:
    """``text`` cut to fit a value limit of ``max_bytes`` (an LLM's summary)."""
    while text and (size := _stored_size(text)) > max_bytes:
        text = text[: min(len(text) - 1, len(text) * max_bytes // size)]
    return text


def summary_without(
    *, summary: Memory, forgotten: set[str], rewritten: dict[str, Any], remaining: list[Memory]
) -> str | None:
    """The text of ``summary`` without what its sources ``forgotten`` contributed: what a
    forget request writes into a summary it may not erase. None when nothing else is left.

    A digest (every line is ``<key relative to the prefix> = value`` of one of its sources,
    or the "more not shown" line) loses exactly the forgotten sources' lines, and the lines
    of sources ``rewritten`` (summaries rebuilt the same way: key -> new text) are made
    again; lines of sources archived and purged since stay. Any other text (an LLM's) is
    rebuilt as the digest of ``remaining``: the summary's other sources that still exist.
    No query.
    """
    prefix = summary.key[len(SUMMARY_KEY_PREFIX) :] + ":"
    base = prefix[: prefix.rfind(":") + 1]

    def relative(key: str) -> str:
        return (key[len(base) :] if key.startswith(base) else "") or key

    if isinstance(summary.value, str):
        heads = {relative(k) + " = ": k for k in summary.sources if isinstance(k, str)}
        owners = []
        for line in summary.value.split("\n"):
            owner = next((k for head, k in heads.items() if line.startswith(head)), None)
            if owner is None and not _FOOTER.fullmatch(line):
                break  # not a digest
            owners.append((line, owner))
        else:
            kept = [
                _digest_line(relative(owner), rewritten[owner]) if owner in rewritten else line
                for line, owner in owners
                if owner not in forgotten
            ]
            if not any(owner and owner not in forgotten for _line, owner in owners):
                return None
            return "\n".join(kept)
    if not remaining:
        return None
    ordered = sorted(remaining, key=lambda m: (-m.importance, -m.updated_at.timestamp(), m.key))
    max_chars = settings.ZEROMEM_SUMMARY_MAX_CHARS
    return _digest_of(ordered[: max_chars // 5 + 1], total=len(ordered), base=base, max_chars=max_chars).text


_FOOTER = re.compile(r"\(\+\d+ more not shown\)")


def _digest_of(candidates, *, total: int, base: str, max_chars: int) -> Digest:
    """Digest lines of ``candidates`` (in the order given) within ``max_chars``."""
    lines: list[str] = []
    sources: list[Memory] = []
    used = 0
    # Room kept for the "left out" line; it is at most this long.
    footer_room = len(f"(+{total} more not shown)") + 1
    for memory in candidates:
        rest = total - len(sources) - 1  # memories after this one
        room = max_chars - used - (1 if lines else 0) - (footer_room if rest else 0)
        line = _digest_line(memory.key[len(base) :] or memory.key, memory.value)
        if len(line) > room:
            if room >= MIN_CUT_LINE:
                lines.append(line[: room - 1] + "…")
                sources.append(memory)
            break
        lines.append(line)
        sources.append(memory)
        used += len(line) + (1 if len(lines) > 1 else 0)
    left_out = total - len(sources)
    if left_out:
        lines.append(f"(+{left_out} more not shown)")
    return Digest(text="\n".join(lines), sources=sources, left_out=left_out)


def _digest_line(relative_key: str, value: Any) -> str:
    # Sorted keys: PostgreSQL's jsonb does not keep the order an object was written in, and
    # the same memories must give the same digest on every database.
    text = (
        value
        if isinstance(value, str)
        else json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    )
    return f"{relative_key} = {' '.join(text.splitlines())}"


def _write_summary(*, job: Job, digest: Digest, text: str, archive: bool) -> dict:
    """Write the summary memory with its lineage and archive its sources (caller's transaction)."""
    tenant, prefix = job.tenant, job.params["prefix"]
    key = summary_key(prefix)
    result = {"key": key, "sources": len(digest.sources), "left_out": digest.left_out, "chars": 0, "archived": 0}
    if not digest.sources:
        return result  # nothing to summarize: no empty summary is written
    # The sources were read outside any transaction, maybe seconds ago (an LLM thought about
    # them meanwhile). A forget that erased one since has finished with it: a summary written
    # now would keep its value for good. So they are locked (in id order, as a forget batch
    # locks its memories) and must all still exist; a forget that comes after this finds
    # them locked, waits for this commit, and then finds the summary by its lineage.
    ids = sorted(m.pk for m in digest.sources)
    locked = Memory.objects.filter(tenant=tenant, pk__in=ids).order_by("pk").select_for_update()
    # Their expiry as it is now (a TTL refreshed while the LLM thought counts), locked too.
    expiries = list(locked.values_list("expires_at", flat=True))
    if len(expiries) < len(ids):
        raise SourcesErased(
            "a source was erased while the summary was being made; the retry summarizes the rest",
            code="sources_erased",
        )
    actor = _job_actor(job)
    subjects = {m.subject for m in digest.sources}
    subject = subjects.pop() if len(subjects) == 1 else ""
    text = _fit_value_limit(text[: settings.ZEROMEM_SUMMARY_MAX_CHARS], tenant.effective_value_max_bytes)
    written = memory_write(
        tenant=tenant,
        actor=actor,
        key=key,
        value=text,
        subject=subject,
        category=Memory.Category.SUMMARY,
        source=f"job:summarize#{job.uid}",
        # Made from a sensitive memory, it is as sensitive (sealed, not indexed by its text) —
        # one the tenant's rules match too, though written before the rule and not re-sealed yet.
        sensitive=True if _any_sensitive(tenant, digest.sources) else None,
    )
    # Lineage: memory_write keeps no sources, so they are set here, in the same transaction,
    # with the expiry the sources give it (see summary_expiry).
    written.memory.expires_at = summary_expiry(
        tenant=tenant, key=key, sources=expiries, written_at=written.memory.updated_at
    )
    Memory.objects.filter(pk=written.memory.pk).update(
        sources=[m.key for m in digest.sources], expires_at=written.memory.expires_at
    )
    if archive:
        for memory in digest.sources:
            # If-Match on the version summarized: a memory changed since it was read makes
            # the whole attempt fail (and retry) instead of archiving what the summary lacks.
            memory_delete(tenant=tenant, actor=actor, key=memory.key, if_match=(memory.pk, memory.version))
        result["archived"] = len(digest.sources)
    result["chars"] = len(text)
    return result


def _any_sensitive(tenant: Tenant, sources: list[Memory]) -> bool:
    """Whether one of ``sources`` is sensitive: marked, or matched by the tenant's rules
    though written before the rule and not re-sealed yet. No query."""
    return any(m.sensitive or sensitivity.matches_rules(tenant, key=m.key, value=m.value) for m in sources)


def summary_expiry(
    *, tenant: Tenant, key: str, sources: list[datetime | None], written_at: datetime
) -> datetime | None:
    """When a summary of memories expiring at ``sources`` expires: when the last of them
    does (it holds their text, which must not outlive them), never if one of them never
    expires — or sooner, by the tenant's retention rule for the summary's key, from
    ``written_at``.

    Set on every summarize run (and by a forget request's rebuild of the summary), not kept
    in step with the sources in between: a source's
    TTL extended later moves the summary's expiry at the next run (the idle-sessions
    schedule makes one, the source's update being newer than the summary); until then the
    summary may go first, never last. Following every TTL change at once would cost each
    write that sets a TTL a lookup of the summaries naming its key. Cost: one query (the rule).
    """
    ends = [] if None in sources else [max(sources)]
    rule = retention.default_expiry_for(tenant=tenant, key=key, now=written_at)
    return min([*ends, *([rule] if rule is not None else [])], default=None)


# --- the optional LLM summarizer ---------------------------------------------------------


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Refuse every redirect: urllib would follow it with the Authorization header (the LLM
    API key) to wherever the Location points. The 3xx surfaces as an HTTPError."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class _Deadline:
    """A wall-clock deadline for one request: when it passes (a timer thread), every socket
    the request opened is shut down, so whatever read is waiting — the status line, a header,
    the TLS handshake, the body — ends at once. The socket's own timeout bounds each wait for
    the next bytes, not the answer: an endpoint sending a header line now and then held the
    worker for up to 100 lines of 64 KiB."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self.expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def connection(self, http_class):
        """``http_class`` (an http.client connection) whose sockets this deadline watches."""

        def make(host, **kwargs):
            conn = http_class(host, **kwargs)
            create = conn._create_connection

            def create_watched(*args, **kw):
                sock = create(*args, **kw)
                with self._lock:
                    self._sockets.append(sock)
                    expired = self.expired
                if expired:  # (it passed while connecting)
                    _shut(sock)
                return sock

            conn._create_connection = create_watched
            return conn

        return make


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self._deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        return super().do_open(self._deadline.connection(http_class), req, **kwargs)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self._deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        return super().do_open(self._deadline.connection(http_class), req, **kwargs)


def _post(request: urllib.request.Request, timeout: float) -> bytes:
    """The body of the answer to ``request`` (at most ``LLM_MAX_ANSWER_BYTES`` + 1 bytes), all
    of it — connection, headers and body — within ``timeout`` seconds, else TimeoutError.
    Redirects are not followed (an HTTPError, as for any status >= 300)."""
    with _Deadline(timeout) as deadline:
        opener = urllib.request.build_opener(
            _NoRedirects, _DeadlineHTTPHandler(deadline), _DeadlineHTTPSHandler(deadline)
        )
        try:
            with opener.open(request, timeout=timeout) as response:  # nosec B310
                raw = _read_by(response, deadline=deadline.at, limit=LLM_MAX_ANSWER_BYTES + 1)
            if deadline.expired:  # the body was cut short by the shutdown: not the answer
                raise TimeoutError
            return raw
        except urllib.error.HTTPError as exc:
            exc.close()  # its connection
            if deadline.expired:
                raise TimeoutError from None
            raise
        except (OSError, http.client.HTTPException):
            if deadline.expired:  # the socket was shut down under the read
                raise TimeoutError from None
            raise


# What an LLM's text may not hold: control characters but tab and newline (NUL cannot be
# stored in PostgreSQL's jsonb; the others are no summary), and lone surrogates (not Unicode:
# json.loads joins every valid pair, so any surrogate left is half of one).
_LLM_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _llm_text(text: str) -> str:
    """The model's ``text`` as it can be stored: control characters but tab and newline
    dropped (CRLF becomes LF), a lone surrogate replaced by U+FFFD. Stored raw, a NUL or a lone
    surrogate failed every attempt on the write, each after paying for the answer again."""
    return _LONE_SURROGATE.sub("\ufffd", _LLM_CONTROL.sub("", text)).strip()


_DELAY_SECONDS = re.compile(r"[0-9]{1,12}")  # ASCII digits only (str.isdigit takes "²")


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (RFC 9110: delay-seconds or an HTTP-date),
    at most :data:`LLM_RETRY_AFTER_MAX`; None when absent or unreadable (the job then comes
    back after ``Q_RETRY`` as for any failure)."""
    value = (value or "").strip()
    if _DELAY_SECONDS.fullmatch(value):
        return float(min(int(value), LLM_RETRY_AFTER_MAX))
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return min(max((when - timezone.now()).total_seconds(), 0.0), float(LLM_RETRY_AFTER_MAX))


# The LLM endpoint's "not before" (its Retry-After), in the shared cache: Redis when
# configured, else the database's cache table (PostgreSQL) or the file cache (SQLite), so every
# worker of every machine honours it.
_BACKOFF_KEY = "zeromem:llm-backoff:"


def _backoff_key() -> str:
    # By endpoint: a changed ZEROMEM_LLM_BASE_URL is another endpoint, with no back-off.
    url = settings.ZEROMEM_LLM_BASE_URL.rstrip("/").encode()
    return _BACKOFF_KEY + hashlib.sha256(url).hexdigest()[:32]


def llm_backoff_until(now: datetime | None = None) -> datetime | None:
    """Until when the configured LLM endpoint asked not to be called (HTTP 429/503 with
    ``Retry-After``, to any job of any worker), or None: no endpoint, no back-off, or past it.
    A job whose turn comes before then waits until then, with no attempt counted
    (:func:`summarize_attempt_begin`). An unreachable cache is no back-off (logged).
    Cost: one cache GET (a primary-key SELECT of the cache table without Redis)."""
    if not settings.ZEROMEM_LLM_BASE_URL:
        return None
    try:
        value = cache.get(_backoff_key())
    except Exception:
        logger.warning("could not read the LLM endpoint's back-off from the cache", exc_info=True)
        return None
    try:
        until = datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return until if until is not None and until > (now or timezone.now()) else None


def llm_backoff(until: datetime) -> datetime:
    """Record that the LLM endpoint may not be called before ``until`` (at most
    :data:`LLM_RETRY_AFTER_MAX` from now); a later back-off already recorded stays. Returns
    the back-off in force. Two workers told at once may keep the earlier of their two times
    (last write wins): each is one the endpoint asked for."""
    now = timezone.now()
    until = min(until, now + timedelta(seconds=LLM_RETRY_AFTER_MAX))
    current = llm_backoff_until(now)
    if current is not None and current >= until:
        return current
    try:
        # Kept a minute past its time; read against the clock (llm_backoff_until), not expiry.
        cache.set(_backoff_key(), until.isoformat(), timeout=int((until - now).total_seconds()) + 60)
    except Exception:
        logger.warning("could not record the LLM endpoint's back-off in the cache", exc_info=True)
    return until


def _llm_summarize(digest_text: str) -> tuple[str, int]:
    """POST the digest to ``{ZEROMEM_LLM_BASE_URL}/chat/completions`` (OpenAI-compatible).
    Returns (summary text, total tokens). Any failure raises :class:`SummarizerError`."""
    url = settings.ZEROMEM_LLM_BASE_URL.rstrip("/") + "/chat/completions"
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        # urlopen would also read file:// and ftp:// URLs (bandit B310, marked below).
        raise SummarizerError("ZEROMEM_LLM_BASE_URL must be an http:// or https:// URL", code="llm_misconfigured")
    body = {
        "model": settings.ZEROMEM_LLM_MODEL,
        "messages": [
            {"role": "system", "content": LLM_INSTRUCTIONS},
            {"role": "user", "content": digest_text},
        ],
        "temperature": 0,
    }
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if settings.ZEROMEM_LLM_API_KEY:
        headers["Authorization"] = f"Bearer {settings.ZEROMEM_LLM_API_KEY}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    timeout = settings.ZEROMEM_LLM_TIMEOUT_SECONDS
    try:
        raw = _post(request, timeout)
    except urllib.error.HTTPError as exc:
        # The body is not kept: an endpoint may echo the prompt, i.e. memory values.
        if 300 <= exc.code < 400:
            raise SummarizerError(
                f"the LLM endpoint answered HTTP {exc.code}, a redirect, which is not followed "
                "(it would carry the API key elsewhere): set ZEROMEM_LLM_BASE_URL to the final URL",
                code="llm_redirect",
            ) from None
        wait = _retry_after(exc.headers.get("Retry-After")) if exc.code in (429, 503) and exc.headers else None
        if wait is not None:
            raise SummarizerBusy(
                f"the LLM endpoint answered HTTP {exc.code} (Retry-After: {wait:.0f} s)", retry_after=wait
            ) from None
        raise SummarizerError(f"the LLM endpoint answered HTTP {exc.code}", code="llm_http_error") from None
    except TimeoutError:
        raise SummarizerError(f"the LLM endpoint did not answer within {timeout} s", code="llm_timeout") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise SummarizerError(f"the LLM endpoint did not answer within {timeout} s", code="llm_timeout") from None
        raise SummarizerError(
            f"the LLM endpoint is unreachable ({type(exc.reason).__name__})", code="llm_unreachable"
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        raise SummarizerError(
            f"the LLM endpoint connection failed ({type(exc).__name__})", code="llm_unreachable"
        ) from None
    if len(raw) > LLM_MAX_ANSWER_BYTES:
        raise SummarizerError(
            f"the LLM endpoint's answer is larger than {LLM_MAX_ANSWER_BYTES} bytes", code="llm_invalid_answer"
        )
    try:
        answer = json.loads(raw)
        text = answer["choices"][0]["message"]["content"]
        usage = answer.get("usage") or {}
        tokens = usage.get("total_tokens", 0)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError):
        # RecursionError: JSON nested deeper than Python's parser goes ("[" × 100,000 fits the MiB).
        raise SummarizerError("the LLM endpoint's answer is not a chat completion", code="llm_invalid_answer") from None
    if not isinstance(text, str) or not (text := _llm_text(text)):
        raise SummarizerError("the LLM endpoint answered an empty summary", code="llm_empty_answer")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise SummarizerError("the LLM endpoint's usage.total_tokens is not a count", code="llm_invalid_answer")
    return text, tokens


def _read_by(response, *, deadline: float, limit: int) -> bytes:
    """Up to ``limit`` bytes of the answer's body, all of it by ``deadline`` (else
    TimeoutError). The socket's timeout bounds each wait for the next bytes, not the answer:
    an endpoint sending a byte now and then would hold the worker, and every job queued
    behind it, for as long as it liked. A read waiting at the deadline is ended by
    :class:`_Deadline` shutting the socket down."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        if time.monotonic() >= deadline:
            raise TimeoutError
        chunk = response.read1(min(64 * 1024, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


# --- idle sessions -----------------------------------------------------------------------


def summarize_idle_sessions(*, idle_minutes: int | None = None, now: datetime | None = None) -> int:
    """Start a summarize job for each idle session: a namespace directly under one of
    ``settings.ZEROMEM_SUMMARIZE_IDLE_PREFIXES`` (``session:s1:`` under ``session:``) whose
    newest live memory is older than ``idle_minutes`` (default
    ``ZEROMEM_SUMMARIZE_IDLE_MINUTES``), with no summary written since and no summarize job
    pending for it. Returns the number of jobs started (at most ``IDLE_BATCH`` per run, and no
    tenant past ``ZEROMEM_TENANT_MAX_PENDING_JOBS`` pending summarize jobs).

    Cost on PostgreSQL: one statement per root, which scans the memories under it and returns
    only the sessions to start (``_IDLE_SQL``), and one count of the pending jobs of their
    tenants; then one job and audit INSERT per session started. (SQLite: three aggregate
    queries, the sessions compared in Python.)
    """
    now = now or timezone.now()
    idle = timedelta(minutes=settings.ZEROMEM_SUMMARIZE_IDLE_MINUTES if idle_minutes is None else idle_minutes)
    roots = [p for p in settings.ZEROMEM_SUMMARIZE_IDLE_PREFIXES if p]
    if not roots:
        return 0
    if connection.vendor == "postgresql":
        due = _idle_due_sql(roots, now=now, idle=idle)
    else:
        due = _idle_due_python(roots, now=now, idle=idle)
    tenants = Tenant.objects.in_bulk({tenant_id for _t, (tenant_id, _p) in due})
    actor = Actor.system(job="summarize_idle")
    for _t, (tenant_id, prefix) in due:
        summarize_start(tenant=tenants[tenant_id], actor=actor, prefix=prefix)
    return len(due)


def _idle_due_python(roots: list[str], *, now: datetime, idle: timedelta) -> list[tuple[datetime, tuple[int, str]]]:
    """SQLite (the embedded default): the sessions to start, found in Python."""
    under_roots = Q()
    for root in roots:
        under_roots |= Q(key__startswith=root)
    per_namespace = (
        Memory.objects.live(now=now)
        .filter(under_roots)
        .exclude(category=Memory.Category.SUMMARY)
        .values("tenant_id", "namespace")
        .annotate(newest=Max("updated_at"))
    )
    # Roll nested namespaces up into their session: session:s1:sub → session:s1:.
    newest: dict[tuple[int, str], datetime] = {}
    for row in per_namespace:
        session = _session_prefix(row["namespace"] + ":", roots)
        if session is None or len(session) > PREFIX_MAX_LEN:
            # (too long: its summary key would pass the key limit; summarize_start refuses it,
            # and raised here it stopped every other tenant's sessions on every run)
            continue
        slot = (row["tenant_id"], session)
        if slot not in newest or row["newest"] > newest[slot]:
            newest[slot] = row["newest"]
    idle_sessions = {slot: t for slot, t in newest.items() if t <= now - idle}
    if not idle_sessions:
        return []

    summarized = {
        (tenant_id, key): updated
        for tenant_id, key, updated in Memory.objects.live(now=now)
        .filter(tenant_id__in={t for t, _p in idle_sessions}, key__in={summary_key(p) for _t, p in idle_sessions})
        .values_list("tenant_id", "key", "updated_at")
    }
    pending: set[tuple[int, str]] = set()
    room = {t: settings.ZEROMEM_TENANT_MAX_PENDING_JOBS for t, _p in idle_sessions}  # per tenant
    failed: dict[tuple[int, str], datetime] = {}  # the latest failure within IDLE_FAILED_BACKOFF
    for tenant_id, prefix, status, finished_at in Job.objects.filter(
        Q(status__in=[Job.Status.QUEUED, Job.Status.RUNNING])
        | Q(status=Job.Status.FAILED, finished_at__gte=now - IDLE_FAILED_BACKOFF),
        kind=Job.Kind.SUMMARIZE,
        tenant_id__in={t for t, _p in idle_sessions},
    ).values_list("tenant_id", "params__prefix", "status", "finished_at"):
        if status == Job.Status.FAILED:
            failed[(tenant_id, prefix)] = max(finished_at, failed.get((tenant_id, prefix), finished_at))
        else:
            pending.add((tenant_id, prefix))
            room[tenant_id] -= 1

    def needs_summary(slot, newest_at) -> bool:
        summary_at = summarized.get((slot[0], summary_key(slot[1])))
        # A session whose job failed since its last memory waits out the backoff: started again
        # every run, the sessions that always fail (idle longest, so first in line) held the
        # whole batch, and retried their attempts every 15 minutes.
        failed_at = failed.get(slot)
        return (
            slot not in pending
            and (summary_at is None or summary_at < newest_at)
            and (failed_at is None or failed_at < newest_at)
        )

    return _within_room(sorted((t, slot) for slot, t in idle_sessions.items() if needs_summary(slot, t)), room)


def _within_room(candidates, room: dict[int, int]) -> list[tuple[datetime, tuple[int, str]]]:
    """Longest idle first, so a backlog larger than one batch drains in order; but no tenant
    past ZEROMEM_TENANT_MAX_PENDING_JOBS pending (``room``: what each has left), counting the
    jobs started here: one tenant's thousands of old sessions took the whole batch on every
    run, and the others' waited. At most ``IDLE_BATCH``."""
    due = []
    for newest, slot in candidates:
        if len(due) == IDLE_BATCH:
            break
        if room[slot[0]] > 0:
            room[slot[0]] -= 1
            due.append((newest, slot))
    return due


# PostgreSQL: the sessions to start, found by one statement per root — every session's newest
# memory (nested namespaces rolled up: session:s1:sub counts for session:s1:), those idle
# with no summary written since, no summarize job pending and none failed since within
# IDLE_FAILED_BACKOFF, at most ZEROMEM_TENANT_MAX_PENDING_JOBS per tenant, longest idle first.
# Only those leave the server: the Python version read every session ever kept into memory
# and sent each summary key back in a list (100k sessions, all summarized: 17 s and 112 MB
# every run to start nothing).
_IDLE_SQL = """
WITH sessions AS (
    SELECT tenant_id, split_part(substr(namespace, %(from)s), ':', 1) AS sid, max(updated_at) AS newest
    FROM memories_memory
    WHERE left(key, %(root_len)s) = %(root)s AND deleted_at IS NULL AND category <> %(summary)s
      AND (expires_at IS NULL OR expires_at > %(now)s)
    GROUP BY 1, 2
    HAVING max(updated_at) <= %(idle_before)s
), due AS (
    SELECT s.tenant_id, s.sid, s.newest,
           row_number() OVER (PARTITION BY s.tenant_id ORDER BY s.newest, s.sid) AS place
    FROM sessions s
    WHERE s.sid <> '' AND length(s.sid) <= %(sid_max)s
      AND NOT EXISTS (
          SELECT 1 FROM memories_memory m
          WHERE m.tenant_id = s.tenant_id AND m.key = %(summary_root)s || s.sid AND m.deleted_at IS NULL
            AND (m.expires_at IS NULL OR m.expires_at > %(now)s) AND m.updated_at >= s.newest)
      AND NOT EXISTS (
          SELECT 1 FROM memories_job j
          WHERE j.tenant_id = s.tenant_id AND j.kind = %(kind)s AND j.params ->> 'prefix' = %(root)s || s.sid || ':'
            AND (j.status IN (%(queued)s, %(running)s)
                 OR (j.status = %(failed)s AND j.finished_at >= %(failed_since)s AND j.finished_at >= s.newest)))
)
SELECT newest, tenant_id, %(root)s || sid || ':' FROM due WHERE place <= %(per_tenant)s
"""


def _idle_due_sql(roots: list[str], *, now: datetime, idle: timedelta) -> list[tuple[datetime, tuple[int, str]]]:
    candidates = []
    with connection.cursor() as cursor:
        for root in roots:
            if not root.endswith(":"):
                continue  # roots name whole segments, e.g. "session:"
            cursor.execute(
                _IDLE_SQL,
                {
                    "from": len(root) + 1,
                    "root_len": len(root),
                    "root": root,
                    "summary": Memory.Category.SUMMARY,
                    "now": now,
                    "idle_before": now - idle,
                    "sid_max": PREFIX_MAX_LEN - len(root) - 1,
                    "summary_root": summary_key(root + "x:")[:-1],
                    "kind": Job.Kind.SUMMARIZE,
                    "queued": Job.Status.QUEUED,
                    "running": Job.Status.RUNNING,
                    "failed": Job.Status.FAILED,
                    "failed_since": now - IDLE_FAILED_BACKOFF,
                    "per_tenant": settings.ZEROMEM_TENANT_MAX_PENDING_JOBS,
                },
            )
            candidates += [(newest, (tenant_id, prefix)) for newest, tenant_id, prefix in cursor.fetchall()]
    candidates = sorted(set(candidates))  # (roots that overlap name a session twice)
    if not candidates:
        return []
    room = {t: settings.ZEROMEM_TENANT_MAX_PENDING_JOBS for _n, (t, _p) in candidates}
    for tenant_id, pending in (
        Job.objects.filter(
            kind=Job.Kind.SUMMARIZE,
            status__in=[Job.Status.QUEUED, Job.Status.RUNNING],
            tenant_id__in=room,
        )
        .values_list("tenant_id")
        .annotate(n=Count("pk"))
        .order_by()
    ):
        room[tenant_id] -= pending
    return _within_room(candidates, room)


def _session_prefix(namespace_prefix: str, roots: list[str]) -> str | None:
    """``session:s1:sub:`` under root ``session:`` → ``session:s1:``; None if not under a root."""
    for root in roots:
        if namespace_prefix.startswith(root) and len(namespace_prefix) > len(root):
            rest = namespace_prefix[len(root) :]
            if not root.endswith(":"):
                continue  # roots name whole segments, e.g. "session:"
            return root + rest.split(":", 1)[0] + ":"
    return None
