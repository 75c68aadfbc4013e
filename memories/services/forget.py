"""Forget requests: erase what ZeroMem keeps about an end user (a subject), a key prefix or a
list of keys, for good.

* :func:`forget_request_create` accepts a request: validated, stored and audited in one
  transaction that commits before the caller answers (the request is durable the moment
  it is accepted), then enqueued after the commit. The queue payload is the request id and
  nothing else, so the queue tables never hold what is being forgotten.
* :func:`forget_request_execute` (the job: a step of it runs on a turn of the shared queue,
  ``memories.tasks.forget_request_task`` → ``services.turns.delivery_run``) erases
  the target's memories — live, trashed and expired alike — with every version and every
  summary derived from them, in batches of one short transaction each, and ends with a
  receipt of counts and times (never erased content).
* :func:`forget_requests_resume` (scheduled) enqueues again the requests whose worker died
  or whose queue entry was lost.

Status only moves forward — received → running → completed | failed — and every change of
it is a conditional UPDATE (:func:`_advance`), so a late or duplicate delivery of the job
cannot move a request back. The job is idempotent: each batch commits its deletions and the
receipt's running totals together, so a run killed halfway is continued by the next one and
ends with the same state and counts as an uninterrupted run. Attempts are counted by the
request itself (django-q2 does not count a killed worker's attempt, issue #327) and bounded
by ``settings.ZEROMEM_JOB_MAX_ATTEMPTS``.

Audit events of these operations name the request (``detail.forget_request``) and counts,
not the subject or keys: the request row is the one place that names the target.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.admin.models import LogEntry
from django.contrib.contenttypes.models import ContentType
from django.db import DatabaseError, connection, transaction
from django.db.models import BooleanField, OuterRef, Q, QuerySet, Subquery, Value
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce
from django.utils import timezone
from django_q.tasks import async_task

from audit.services import audit_record, audit_redact_subject, audited_operation
from memories import keyring, search
from memories.models import ForgetRequest, Job, Memory, MemoryVersion, Tenant
from memories.services.dashboard_stats import dashboard_stats_after_forget
from memories.services.idempotency import holds_no_values as idempotency_holds_no_values
from memories.services.idempotency import tenant_forget as idempotency_tenant_forget
from memories.services.jobs import CANCEL_EVENT_MAX_IDS, lock_pending, require_pending_room
from memories.services.retention import set_local_wal_compression, wal_compression_for_erasure
from memories.services.summaries import SUMMARY_KEY_PREFIX, summary_expiry, summary_key, summary_without
from zeromem.kernel import subjectkeys, validation
from zeromem.kernel.actors import Actor, allowlist_entry_covers, require_scope
from zeromem.kernel.errors import Forbidden, InvalidInput, NotFound, ServiceError
from zeromem.kernel.keyprefix import startswith_q
from zeromem.kernel.outcomes import ActorKind, Outcome
from zeromem.kernel.scopes import Scope

logger = logging.getLogger(__name__)

Status = ForgetRequest.Status

KEYS_MAX = 1000
REASON_MAX_LEN = 1000
# The law allows at most a month; a caller may set a shorter deadline, not a longer one.
DUE_IN_DAYS_DEFAULT = 30
DUE_IN_DAYS_MAX = 30
ERASE_BATCH_SIZE = 500
# Summaries of summaries are erased too; this bounds the walk down the lineage per batch.
LINEAGE_DEPTH_MAX = 10
RESUME_MAX = 1000
# A step erases batches for at most this long (and at most half of Q_TIMEOUT), then hands its
# worker back and the request waits for its tenant's next turn (services.jobs.turn_claim_next):
# a huge target no longer holds a worker until Q_TIMEOUT kills it, while other tenants wait.
FORGET_SLICE_SECONDS = 60
# Audit events redacted per transaction, and where the redaction has got to (receipt key,
# while the request runs).
REDACT_PAGE = 1000
REDACT_CURSOR = "audit_redacted_through"
# The attempts a pending request had when its last forget.resume was audited (receipt key,
# dropped at completion): forget_requests_resume audits a request again only once it moved on.
RESUMED_AFTER = "resumed_after_attempts"
# The latest attempt whose failure is audited (receipt key): a step that raised wrote its
# ``forget.attempt_fail`` event itself; one still ``stepping`` past Q_TIMEOUT without this mark
# had its worker killed, and the next step's begin writes the event for it.
FAILURE_AUDITED = "failure_audited_attempt"
PK_MAX = 2**63 - 1
FORGET_JOB = "forget"
TASK = "memories.tasks.forget_request_task"

PENDING = (Status.RECEIVED, Status.RUNNING)
FINISHED = (Status.COMPLETED, Status.FAILED)
# The statuses each status may be reached from: the only way a status changes.
_FORWARD = {
    Status.RUNNING: (Status.RECEIVED, Status.RUNNING),
    Status.COMPLETED: (Status.RUNNING,),
    Status.FAILED: (Status.RECEIVED, Status.RUNNING),
}
RECEIPT_COUNTS = ("memories", "versions", "summaries", "admin_log_entries", "batches")


# --- accepting a request ------------------------------------------------------------------


def forget_request_create(
    *,
    tenant: Tenant,
    actor: Actor,
    subject: Any = None,
    prefix: Any = None,
    keys: Any = None,
    reason: Any = "",
    due_in_days: Any = None,
    end_user_subject: str = "",
    idempotency_claim: int | None = None,
    reuse_pending: bool = False,
) -> ForgetRequest:
    """Accept a request to forget exactly one target: a ``subject``, a key ``prefix`` or a
    list of ``keys`` (at most 1000). Needs the ``forget:create`` scope; a key limited to some
    prefixes may forget only keys and prefixes inside them, and no whole subject (its
    memories may lie anywhere). Due ``due_in_days`` (1-30, default 30) days from now.

    The request keeps the actor's reach (:func:`_reach`; ``end_user_subject`` is the
    subject of an end-user actor): summaries derived from the target outside that reach
    are rebuilt without the forgotten sources when it runs, never erased whole.

    ``idempotency_claim``: the ``Idempotency-Key`` claim of the request filing it (REST), marked
    in the same transaction as holding no memory value (:func:`idempotency.holds_no_values`):
    the forget may complete before that request stores its answer, and must not drop it.

    An API key's or end user's request past the tenant's
    ``ZEROMEM_TENANT_MAX_PENDING_FORGETS`` pending (received or running) requests is refused
    (429 ``too_many_jobs``, nothing stored; :func:`~memories.services.jobs.require_pending_room`):
    the workers are shared by every tenant. Staff and the system are not capped.

    ``reuse_pending``: while a request of this actor for the same target is pending (received
    or running), that request is the answer and nothing new is filed (audited with detail
    ``pending``). Looked for under the cap's lock, so two submits at once file one request.

    Cost: the cap's lock and COUNT, one INSERT and the audit INSERT in one transaction (and the
    claim's UPDATE); after its commit, the queue INSERT (ORM broker). A failed enqueue is
    logged, not raised: the request is stored, and :func:`forget_requests_resume` enqueues it
    later.
    """
    with audited_operation(tenant=tenant, actor=actor, action="forget.create") as op:
        require_scope(actor, Scope.FORGET_CREATE)
        target = _validated_target(subject=subject, prefix=prefix, keys=keys)
        _require_target_allowed(actor, target)
        reason = _validated_reason(reason)
        days = validation.bounded_int(
            due_in_days, field="due_in_days", default=DUE_IN_DAYS_DEFAULT, low=1, high=DUE_IN_DAYS_MAX
        )
        pending = ForgetRequest.objects.filter(tenant=tenant, status__in=PENDING)  # forget_tenant_status_due
        if reuse_pending:
            lock_pending(tenant=tenant, kind="forget")  # the one the cap takes: filers of this tenant wait
            same = pending.filter(requested_by_kind=actor.kind, requested_by=actor.id, **target).order_by("pk").first()
            if same is not None:
                op.record(
                    subject=end_user_subject or target.get("subject", ""),
                    detail={"forget_request": str(same.uid), "by": _target_kind(same), "pending": True},
                )
                return same
        if actor.kind == ActorKind.END_USER:
            # One end user (a request per memory they own) must not fill the tenant's cap and
            # lock every other end user and the app's keys out of filing theirs.
            require_pending_room(
                tenant=tenant,
                actor=actor,
                kind="forget",
                pending=pending.filter(requested_by_kind=ActorKind.END_USER, requested_by=actor.id),
                limit=settings.ZEROMEM_END_USER_MAX_PENDING_FORGETS,
                setting="ZEROMEM_END_USER_MAX_PENDING_FORGETS",
            )
        require_pending_room(
            tenant=tenant,
            actor=actor,
            kind="forget",
            pending=pending,
            limit=settings.ZEROMEM_TENANT_MAX_PENDING_FORGETS,
            setting="ZEROMEM_TENANT_MAX_PENDING_FORGETS",
        )
        now = timezone.now()
        request = ForgetRequest.objects.create(
            tenant=tenant,
            **target,
            reason=reason,
            requested_by_kind=actor.kind,
            requested_by=actor.id,
            created_at=now,
            due_at=now + timedelta(days=days),
            progress_at=now,
            receipt={"received_at": _iso(now)},
            reach=_reach(actor, target, end_user_subject=end_user_subject),
        )
        op.record(
            count=len(target.get("keys", ())) or None,
            detail={"forget_request": str(request.uid), "by": _target_kind(request), "due_in_days": days},
        )
        idempotency_holds_no_values(idempotency_claim, tenant=tenant)
        # robust: the request is already committed; if the broker is down, the resume
        # schedule enqueues it later instead of the caller seeing an error.
        transaction.on_commit(partial(_enqueue, request.pk), robust=True)
    return request


def _validated_target(*, subject: Any, prefix: Any, keys: Any) -> dict:
    given = [name for name, raw in (("subject", subject), ("prefix", prefix), ("keys", keys)) if raw is not None]
    if not given:
        raise InvalidInput("give exactly one of subject, prefix or keys", field="subject", code="missing_target")
    if len(given) > 1:
        raise InvalidInput(
            f"give exactly one of subject, prefix or keys, not {' and '.join(given)}",
            field=given[1],
            code="conflicting_target",
        )
    if subject is not None:
        subject = validation.short_text(subject, field="subject", max_len=validation.SUBJECT_MAX_LEN)
        if not subject:
            raise InvalidInput("must not be empty", field="subject")
        return {"subject": subject}
    if prefix is not None:
        prefix = validation.prefix(prefix)
        if not prefix:
            raise InvalidInput("must not be empty (forget a whole tenant by deleting it)", field="prefix")
        return {"prefix": prefix}
    if not isinstance(keys, list):
        raise InvalidInput("must be a list of keys", field="keys")
    if not keys:
        raise InvalidInput("must not be empty", field="keys")
    if len(keys) > KEYS_MAX:
        raise InvalidInput(f"at most {KEYS_MAX} keys per request", field="keys", code="too_many")
    return {"keys": list(dict.fromkeys(validation.key(k, field=f"keys.{i}") for i, k in enumerate(keys)))}


def _require_target_allowed(actor: Actor, target: dict) -> None:
    if not actor.allowed_prefixes:
        return
    message = "this API key may not touch keys outside its allowed prefixes"
    if "subject" in target:
        raise Forbidden(
            code="key_not_allowed",
            message="an API key limited to some prefixes cannot forget a whole subject",
            field="subject",
        )
    if "prefix" in target:
        if not actor.may_touch_prefix(target["prefix"]):
            raise Forbidden(code="key_not_allowed", message=message, field="prefix")
        return
    for i, key in enumerate(target["keys"]):
        if not actor.may_touch(key):
            raise Forbidden(code="key_not_allowed", message=message, field=f"keys.{i}")


def _reach(actor: Actor, target: dict, *, end_user_subject: str) -> dict:
    """What the requester may touch (``ForgetRequest.reach``)."""
    if actor.allowed_prefixes:
        return {"prefixes": list(actor.allowed_prefixes)}
    if actor.kind == ActorKind.END_USER:
        # An end user reaches their own memories only; with no subject known, nothing else.
        return {"subject": end_user_subject or target.get("subject", "")}
    return {}


def _in_reach(reach: dict, *, key: str, subject: str) -> bool:
    if "prefixes" in reach:
        return any(allowlist_entry_covers(p, key) for p in reach["prefixes"])
    if "subject" in reach:
        return bool(reach["subject"]) and subject == reach["subject"]
    return True


def _validated_reason(raw: Any) -> str:
    if raw is None:
        return ""
    if not isinstance(raw, str):
        raise InvalidInput("must be a string", field="reason")
    if len(raw) > REASON_MAX_LEN:
        raise InvalidInput(f"must be at most {REASON_MAX_LEN} characters", field="reason", code="too_long")
    if any((ord(c) < 32 and c not in "\t\n\r") or ord(c) == 127 for c in raw):
        raise InvalidInput("must not contain control characters", field="reason")
    return raw


def _enqueue(request_id: int) -> None:
    # The payload is the id only: queue and task tables hold nothing a forget must erase. A
    # delivery is a turn (services.turns.delivery_run): it runs the step of whichever tenant's
    # turn it is, this request's in its tenant's turn.
    async_task(TASK, request_id, task_name=f"forget-request-{request_id}")


def forget_enqueue(request_id: int) -> None:
    """Enqueue a delivery (a turn) for the request again: services.turns.delivery_run, whose
    turn another's failed step took."""
    _enqueue(request_id)


# --- reading requests ------------------------------------------------------------------


def _visible(*, tenant: Tenant, actor: Actor) -> QuerySet[ForgetRequest]:
    qs = ForgetRequest.objects.filter(tenant=tenant)
    if actor.allowed_prefixes:
        # A key limited to some prefixes sees the requests it made, not the whole tenant's
        # (they name subjects and keys outside its allowance).
        qs = qs.filter(requested_by_kind=actor.kind, requested_by=actor.id)
    return qs


def forget_request_get(*, tenant: Tenant, actor: Actor, request_id: Any) -> ForgetRequest:
    """One request by its uid (the id the API shows; the row id comes from a sequence every
    tenant shares); :class:`NotFound` otherwise — also for another tenant's uid and for an old
    numeric id (indistinguishable from a missing one). Cost: one SELECT by the unique
    ``forget_uid`` index and the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="forget.read") as op:
        require_scope(actor, Scope.FORGET_CREATE)
        uid = validation.public_uid(request_id)
        request = _visible(tenant=tenant, actor=actor).filter(uid=uid).first() if uid is not None else None
        return _recorded(op, request, str(uid) if uid is not None else None)


def forget_request_view(*, tenant: Tenant, actor: Actor, request_id: Any) -> ForgetRequest:
    """One request opened by staff in the admin (its page or history; the admin lets any
    member of the tenant see its queue), recorded as ``forget.read`` as
    :func:`forget_request_get` records it; :class:`NotFound` for another tenant's or none."""
    with audited_operation(tenant=tenant, actor=actor, action="forget.read") as op:
        pk = validation.ascii_int(request_id) if isinstance(request_id, str) else request_id
        valid = isinstance(pk, int) and not isinstance(pk, bool) and 1 <= pk <= PK_MAX
        request = ForgetRequest.objects.filter(tenant=tenant, pk=pk).first() if valid else None
        return _recorded(op, request, str(request.uid) if request is not None else (pk if valid else None))


def _recorded(op, request: ForgetRequest | None, shown: str | None) -> ForgetRequest:
    """``request`` recorded on ``op`` (its uid in ``detail``: the audit log is shown to the
    tenant); NotFound (recorded) if none."""
    detail = {"forget_request": shown}
    if request is None:
        op.record(outcome=Outcome.NOT_FOUND, detail=detail)
        raise NotFound("no such forget request", field="request_id")
    op.record(detail=detail)
    return request


def forget_queue_viewed(*, tenant: Tenant, actor: Actor, search: str = "", count: int) -> None:
    """Record a page of the admin's forget queue showing ``count`` of ``tenant``'s requests,
    as ``forget.list`` (as ``GET /api/v1/forget-requests`` records it); a search by an end
    user's whole subject goes in the event's own (redactable) ``subject``."""
    with audited_operation(tenant=tenant, actor=actor, action="forget.list") as op:
        op.record(subject=search[: validation.SUBJECT_MAX_LEN] if isinstance(search, str) else "", count=count)


def forget_receipt(*, actor: Actor, request: ForgetRequest) -> dict | None:
    """The receipt of a completed request as ``actor`` may see it, else None. An agent never
    sees keys outside its key's allowlist (DESIGN): the summaries rebuilt outside it (shared
    summaries a limited key's forget reached into) are counted in
    ``summaries_rebuilt_outside_allowlist``, not named. No query."""
    if request.status != ForgetRequest.Status.COMPLETED:
        return None
    receipt = dict(request.receipt)
    rebuilt = receipt.get("summaries_rebuilt") or []
    shown = [key for key in rebuilt if actor.may_touch(key)]
    receipt["summaries_rebuilt"] = shown
    if len(shown) < len(rebuilt):
        receipt["summaries_rebuilt_outside_allowlist"] = len(rebuilt) - len(shown)
    return receipt


def forget_request_list(
    *,
    tenant: Tenant,
    actor: Actor,
    status: Any = None,
    overdue: Any = None,
    limit: Any = None,
    cursor: Any = None,
) -> tuple[list[ForgetRequest], str | None]:
    """Newest first, keyset-paginated on the id. ``status`` filters by status; ``overdue``
    true: not completed and past due (failed ones included), false: the others.

    Returns (requests, next cursor or None). Cost: one range scan of the tenant's requests
    ((tenant, status, due_at) index when filtered by status) and the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="forget.list") as op:
        require_scope(actor, Scope.FORGET_CREATE)
        if status is not None and status not in Status.values:
            raise InvalidInput(f"must be one of {', '.join(Status.values)}", field="status")
        overdue = _validated_bool(overdue, field="overdue")
        limit = validation.limit(limit, default=50)
        before = validation.decode_id_cursor(cursor, high=PK_MAX)

        qs = _visible(tenant=tenant, actor=actor).order_by("-pk")
        if before is not None:
            qs = qs.filter(pk__lt=before)
        if status is not None:
            qs = qs.filter(status=status)
        if overdue is not None:
            late = ~Q(status=Status.COMPLETED) & Q(due_at__lte=timezone.now())
            qs = qs.filter(late if overdue else ~late)
        rows = list(qs[: limit + 1])
        next_cursor = validation.encode_id_cursor(rows[limit - 1].pk) if len(rows) > limit else None
        rows = rows[:limit]
        op.record(count=len(rows))
        return rows, next_cursor


def _validated_bool(raw: Any, *, field: str) -> bool | None:
    if raw is None:
        return None
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    raise InvalidInput("must be true or false", field=field)


# --- carrying a request out -------------------------------------------------------------


def forget_request_execute(*, request_id: int, batch_size: int = ERASE_BATCH_SIZE) -> dict:
    """Carry out one request now, whoever's turn it is (a step: :func:`forget_step_begin`, then
    :func:`forget_step_run`); the queue's deliveries take turns instead
    (services.turns.delivery_run). Idempotent and safe to run again at any point, also
    concurrently with itself (each batch locks the request row)."""
    request = forget_step_begin(request_id)
    if request is None:
        return {"forget_request": request_id, "status": "missing"}
    return forget_step_run(request, batch_size=batch_size)


def forget_step_run(request: ForgetRequest, *, batch_size: int = ERASE_BATCH_SIZE) -> dict:
    """One step of a request that :func:`forget_step_begin` began (its attempt counted):

    1. (The attempt, counted by :func:`forget_step_begin`; past ``ZEROMEM_JOB_MAX_ATTEMPTS``
       attempts in a row that erased nothing the request is failed instead: bounds endless
       redelivery; an attempt that erased a batch made progress, and a large target may need
       many.)
    2. Erase in batches of up to ``batch_size`` memories; each batch is one transaction:
       the memories (live, trashed and expired), their versions, the summaries derived
       from them (lineage, transitively), their admin log entries, the receipt's running
       totals and one audit event. Cost per batch: a SELECT on the target's index, a
       lineage SELECT per level, the DELETEs, an UPDATE of the request and the audit
       INSERT (PostgreSQL: 10k memories with 2 versions each in ~2-3 s, bench_forget).
       After ``FORGET_SLICE_SECONDS`` of batches the step hands its worker back
       (``"continued": true``): the request waits for its tenant's next turn, and a delivery
       is enqueued for it (services.jobs.turn_claim_next).
    3. Destroy the subject's data keys (crypto-shredding, :func:`_shred`), after every write
       sealing under them has committed (keyring.shred waits for them); then erase again
       whatever such a write left.
    3b. Redact the identifying fields of the target's earlier audit events
       (``audit.services.audit_redact_subject``: keyed pseudonyms, the chain still verifies).
    4. Mark it completed, with the final receipt: counts and times only — unless the target
       is stored again (a write committed after the batches, :func:`_target_left`): then
       steps 2-3b again, for what was acknowledged before completion is forgotten too.

    Returns the request's status and receipt (what django-q2 stores as the task result:
    counts and times, no content). A step that raises leaves the request ``stepping``: it
    waits again ``Q_TIMEOUT`` after the step began, as a job's failed attempt does; its error
    and its ``forget.attempt_fail`` event are recorded in one transaction (:func:`_step_failed`).
    """
    request_id = request.pk
    if request.status != Status.RUNNING:
        return _result(request)
    try:
        wal_compression = wal_compression_for_erasure()
        deadline = time.monotonic() + min(FORGET_SLICE_SECONDS, settings.Q_CLUSTER["timeout"] / 2)
        while True:
            while _erase_batch(request_id, batch_size=batch_size, wal_compression=wal_compression):
                if time.monotonic() >= deadline:
                    # The rest in a later turn. A lost enqueue is picked up by
                    # forget_requests_resume once the request stops moving.
                    return _hand_back(request)
            if _shred(request_id):
                # The shred waited for writes sealing under the subject's keys (keyring.shred):
                # what they committed after the batches above is erased too, not left sealed
                # under a destroyed key.
                while _erase_batch(request_id, batch_size=batch_size, wal_compression=wal_compression):
                    pass
            # The audit redaction is sliced like the batches (a heavy user's years of audited
            # reads are millions of events, ~3k/s): each page commits and moves the request's
            # cursor, so a continuation or a retry goes on from there, and a page is progress
            # (stalled attempts reset).
            stopped = False

            def page(through: int, changed: int) -> bool:
                nonlocal stopped
                _redaction_progress(request_id, through=through, changed=changed)
                stopped = time.monotonic() >= deadline
                return not stopped

            summaries_of = _summary_targets(request)
            audit_redact_subject(
                tenant=request.tenant,
                subject=request.subject,
                keys=[*(request.keys or ()), *summaries_of["keys"]],
                prefix=request.prefix,
                prefixes=summaries_of["prefixes"],
                batch_size=REDACT_PAGE,
                after=int(request.receipt.get(REDACT_CURSOR, 0)),  # read at this pass's start
                on_page=page,
            )
            if stopped:
                return _hand_back(request)
            _redact_jobs(request)
            result = _complete(request_id)
            if result is not None:
                return result
            # A write for the target committed after the batches above (while the audit log
            # was redacted): acknowledged before completion, it is forgotten too — another
            # pass erases it, shreds the key it sealed under and redacts its audit events.
            request.refresh_from_db()
            if time.monotonic() >= deadline:
                return _hand_back(request)
    except Exception as exc:
        _step_failed(request, exc)
        raise


def _summary_targets(request: ForgetRequest) -> dict[str, list[str]]:
    """The keys of the summaries of what a subject's or a prefix's request forgets — of its
    namespace (``summary:user:u9`` for ``user:u9:``) and of those under it — for the audit
    redaction: they name whom the namespace was about, and do not start with its prefix. The
    summaries themselves go by lineage; their keys stayed in their write's and reads' events."""
    if request.prefix:
        roots = [request.prefix]
    elif request.subject:
        roots = list(subject_namespaces(request.subject))
    else:
        roots = []
    return {"keys": [summary_key(p) for p in roots], "prefixes": [SUMMARY_KEY_PREFIX + p for p in roots]}


def _hand_back(request: ForgetRequest) -> dict:
    """End the step with the request still running: its worker goes back to the shared queue
    and the request waits for its tenant's next turn, which counts from now (a step of
    ``FORGET_SLICE_SECONDS`` is not one short turn); a delivery is enqueued for it, after the
    request is marked waiting (a delivery run at once would find it still stepping)."""
    ForgetRequest.objects.filter(pk=request.pk, status=Status.RUNNING).update(stepping=False, turn_at=timezone.now())
    _enqueue(request.pk)
    request.refresh_from_db()
    return {**_result(request), "continued": True}


def forget_request_state(request_id: int) -> dict:
    """What a request is now (:func:`_result`), for a delivery enqueued for it that found
    nothing waiting. Cost: one primary-key SELECT."""
    request = ForgetRequest.objects.filter(pk=request_id).first()
    return _result(request) if request is not None else {"forget_request": request_id, "status": "missing"}


def _shred(request_id: int) -> int:
    """Crypto-shredding: a subject's data keys are destroyed once its memories are erased, so
    every copy of what they sealed — in backups and dumps of the main database too — stops
    opening (memories.keyring.shred). Idempotent: the count adds to the receipt only once the
    keys are gone; a rerun finds none left. Audited as ``datakey.destroy``: the first time,
    and again only when a rerun destroys keys (a write sealed since under a new one)."""
    with transaction.atomic():
        request = ForgetRequest.objects.select_for_update(of=("self",)).select_related("tenant").get(pk=request_id)
        if request.status != Status.RUNNING or not request.subject:
            return 0
        destroyed = keyring.shred(tenant_id=request.tenant_id, subject=request.subject)
        receipt = dict(request.receipt)
        first = "data_keys_destroyed" not in receipt
        receipt["data_keys_destroyed"] = receipt.get("data_keys_destroyed", 0) + destroyed
        ForgetRequest.objects.filter(pk=request_id).update(receipt=receipt, progress_at=timezone.now())
        if not (first or destroyed):
            # Every step of the request comes through here (a continuation after a slice of
            # the audit redaction, a retry): one event says the keys went, not one per step.
            return 0
        audit_record(
            tenant=request.tenant,
            actor=Actor.system(job=FORGET_JOB),
            action="datakey.destroy",
            outcome=Outcome.OK,
            count=destroyed,
            detail={"forget_request": str(request.uid), "data_keys_destroyed": destroyed},
        )
        return destroyed


def _redact_jobs(request: ForgetRequest) -> int:
    """Summarize jobs about the target name it (``params.prefix``, ``result.key``): their
    prefix and key are dropped, their counts stay. A job still pending (queued, or an attempt
    under way) for a namespace the request forgets whole (a subject's ``user:``/``usr:``/
    ``lg:users:`` namespace, or a prefix inside the forgotten one) was asked for before the request
    completed, so it is forgotten too: ``cancelled`` with nothing written (an attempt under
    way finds its job no longer its own and writes nothing, :func:`summaries._attempt_current`)
    and audited as one ``memory.summarize.cancel`` event (``denied``, ``detail.reason``
    ``forgotten``). Run after that, it found nothing and kept the prefix for good. A job for
    a namespace a request by keys only touches is left to run (its summary has the other
    keys). Idempotent. Cost: one scan of the tenant's summarize jobs, an UPDATE per job named."""
    if request.subject:
        names = subject_namespaces(request.subject)
        hit = lambda prefix: prefix.startswith(names)  # noqa: E731
    elif request.prefix:
        hit = lambda prefix: prefix.startswith(request.prefix)  # noqa: E731
    else:
        namespaces = {key.rpartition(":")[0] + ":" for key in request.keys}
        hit = lambda prefix: prefix in namespaces  # noqa: E731
    statuses = Job.FINISHED if request.keys else (*Job.FINISHED, *Job.PENDING)
    jobs = Job.objects.filter(tenant_id=request.tenant_id, kind=Job.Kind.SUMMARIZE, status__in=statuses).only(
        "pk", "uid", "params", "result", "status"
    )
    named = [job for job in jobs.iterator() if isinstance(job.params.get("prefix"), str) and hit(job.params["prefix"])]
    cancelled = []
    with transaction.atomic():  # the cancellations and their audit event together
        for job in named:
            params = {k: v for k, v in job.params.items() if k != "prefix"} | {"redacted": True}
            result = {k: v for k, v in (job.result or {}).items() if k != "key"}
            redacted = Job.objects.filter(pk=job.pk)
            # Conditional: an attempt that finished since the scan is only redacted.
            if job.status in Job.PENDING and redacted.filter(status__in=Job.PENDING).update(
                params=params,
                result=result,
                status=Job.Status.CANCELLED,
                error=f"cancelled: its namespace was forgotten (forget request {request.uid})",
                finished_at=timezone.now(),
            ):
                cancelled.append(str(job.uid))
            else:
                redacted.update(params=params, result=result)
        if cancelled:
            audit_record(
                tenant=request.tenant,
                actor=Actor.system(job=FORGET_JOB),
                action="memory.summarize.cancel",
                outcome=Outcome.DENIED,
                count=len(cancelled),
                detail={
                    "reason": "forgotten",
                    "forget_request": str(request.uid),
                    "job_ids": cancelled[:CANCEL_EVENT_MAX_IDS],
                },
            )
    return len(named)


def _advance(request_id: int, to: str, **fields) -> bool:
    """Move a request to status ``to`` if (and only if) that is a step forward."""
    return bool(ForgetRequest.objects.filter(pk=request_id, status__in=_FORWARD[to]).update(status=to, **fields))


def forget_step_begin(request_id: int) -> ForgetRequest | None:
    """Begin a step: count an attempt (or give up), mark the request ``stepping`` and take
    its turn (``turn_at``). Returns the request (None if there is none); its status is
    ``running`` only if the step is to erase. In its own transaction, or the caller's: a
    delivery claims the request and begins its step in one (services.turns.delivery_run).
    A previous step still ``stepping`` ``Q_TIMEOUT`` after it began, its failure unaudited,
    had its worker killed: its ``forget.attempt_fail`` event (``worker_stopped``) is written
    here."""
    with transaction.atomic():
        request = (
            ForgetRequest.objects.select_for_update(of=("self",)).select_related("tenant").filter(pk=request_id).first()
        )
        if request is None or request.status in FINISHED:
            return request
        now = timezone.now()
        attempts = request.attempts + 1
        stalled = request.stalled_attempts + 1  # reset by every batch erased (_erase_batch)
        actor = Actor.system(job=FORGET_JOB)
        limit = settings.ZEROMEM_JOB_MAX_ATTEMPTS
        # A step still "stepping" Q_TIMEOUT after it began (django-q2 kills a task then) whose
        # failure nobody audited: its worker stopped, and could not say so itself.
        over = now - timedelta(seconds=settings.Q_CLUSTER.get("timeout", 300))
        if (
            request.stepping
            and request.attempts
            and request.turn_at is not None
            and request.turn_at < over
            and request.receipt.get(FAILURE_AUDITED) != request.attempts
        ):
            _record_failed_attempt(
                request, attempt=request.attempts, code="worker_stopped", gave_up=request.stalled_attempts >= limit
            )
        if stalled > limit:
            error = (
                f"gave up after {limit} attempts"
                + (" in a row that erased nothing" if stalled != attempts else "")
                + (f"; last error: {request.error}" if request.error else "")
            )
            receipt = {**request.receipt, "failed_at": _iso(now)}
            _advance(
                request_id,
                Status.FAILED,
                attempts=attempts,
                stalled_attempts=stalled,
                error=error,
                receipt=receipt,
                progress_at=now,
                stepping=False,
                turn_at=now,
            )
            audit_record(
                tenant=request.tenant,
                actor=actor,
                action="forget.fail",
                outcome=Outcome.OK,
                detail={"forget_request": str(request.uid), "attempts": attempts - 1},
            )
        else:
            receipt = {**request.receipt, "started_at": request.receipt.get("started_at") or _iso(now)}
            _advance(
                request_id,
                Status.RUNNING,
                attempts=attempts,
                stalled_attempts=stalled,
                started_at=request.started_at or now,
                receipt=receipt,
                progress_at=now,
                stepping=True,
                turn_at=now,
            )
            audit_record(
                tenant=request.tenant,
                actor=actor,
                action="forget.start",
                outcome=Outcome.OK,
                detail={"forget_request": str(request.uid), "attempt": attempts},
            )
        request.refresh_from_db()
        return request


def subject_namespaces(subject: str) -> tuple[str, ...]:
    """The key prefixes that name ``subject`` by convention (``user:<id>:``, ``usr:<id>:``,
    the LangGraph namespace ``lg:users:<id>:``: what a write infers a memory's subject from,
    zeromem.kernel.subjectkeys)."""
    return subjectkeys.subject_namespaces(subject)


def subject_q(subject: str) -> Q:
    """A subject's memories: those about them (``subject``), and those of their own namespace
    that name no other end user (``subject`` "": written with ``subject: ""``, "no subject", or
    cleared to it by a later write). Before, the forget went by the column alone and left
    those — while redacting their keys' audit events and cancelling their namespace's
    summarize jobs as the subject's. A key of their namespace written for another end user
    (``subject`` set to them) is theirs, and stays."""
    own = Q()
    for prefix in subject_namespaces(subject):
        own |= _any_state(startswith_q("key", prefix))
    # memory_tenant_subject_key, OR the key ranges: one BitmapOr.
    return Q(subject=subject) | (Q(subject="") & own)


def _any_state(by_key: Q) -> Q:
    """``by_key`` over live and trashed memories alike, spelled so that PostgreSQL reads it on
    the two partial (tenant, key) indexes — memory_one_live_key_per_tenant (live) and
    memory_trash_key (trashed): no index holds every row by key, and without the split each
    batch of a forget by prefix or keys was a sequential scan of every tenant's memories
    (100k rows: 3,796 → 64 in the planner's cost, 20k tenants)."""
    return (by_key & Q(deleted_at__isnull=True)) | (by_key & Q(deleted_at__isnull=False))


def is_about(*, key: str, memory_subject: str, subject: str) -> bool:
    """:func:`subject_q` for one memory, in Python."""
    return memory_subject == subject or (memory_subject == "" and key.startswith(subject_namespaces(subject)))


def _target_memories(request: ForgetRequest) -> QuerySet[Memory]:
    # No live() filter: trashed and expired rows hold the same data until purged.
    qs = Memory.objects.filter(tenant_id=request.tenant_id)
    if request.subject:
        return qs.filter(subject_q(request.subject))
    if "subject" in request.reach:
        # An end user's request (the portal's "forget this one") reaches their own memories
        # only: a key the app wrote for someone else after the request was filed is theirs.
        mine = request.reach["subject"]
        qs = qs.filter(subject_q(mine)) if mine else qs.none()
    if request.prefix:
        return qs.filter(_any_state(startswith_q("key", request.prefix)))
    return qs.filter(_any_state(Q(key__in=request.keys)))


def _summaries_derived_from(tenant_id: int, keys: list[str]) -> QuerySet[Memory]:
    """Summaries whose ``sources`` (the keys they were made from) include any of ``keys``."""
    qs = Memory.objects.filter(tenant_id=tenant_id, category=Memory.Category.SUMMARY)
    if connection.vendor == "postgresql":
        return qs.filter(sources__has_any_keys=keys)  # jsonb ?| : any string element
    # SQLite has no array-contains operator for JSON: test the elements with json_each.
    placeholders = ", ".join(["%s"] * len(keys))
    table = Memory._meta.db_table
    # bandit B611/B608 (marked): the table name is the model's and the keys are %s parameters.
    hit = RawSQL(  # nosec B611
        f'EXISTS (SELECT 1 FROM json_each("{table}"."sources") AS src WHERE src.value IN ({placeholders}))',  # nosec B608
        keys,
        output_field=BooleanField(),
    )
    return qs.alias(_derived=hit).filter(_derived=True)


def _erase_batch(request_id: int, *, batch_size: int, wal_compression: str | None = None) -> bool:
    """Erase one batch; False when nothing was left (or the request is no longer running).
    ``wal_compression``: set locally for the batch (retention.wal_compression_for_erasure).

    First the target's memories, a batch at a time; once none is left, the subject's own
    earlier values in the history of keys since rewritten for someone else
    (:func:`_versions_left`), with the summaries made from them while they were current."""
    with transaction.atomic():
        set_local_wal_compression(wal_compression)
        request = ForgetRequest.objects.select_for_update(of=("self",)).select_related("tenant").get(pk=request_id)
        if request.status != Status.RUNNING:
            return False
        # Locked before the lineage is looked for: a summarize job holding these memories (it
        # locks its sources, summaries._write_summary) commits its summary first, and the
        # lineage query below, a fresh snapshot after that wait, finds it. Looked for before
        # the wait, that summary outlived its erased sources.
        targets = _target_memories(request).order_by("pk").select_for_update()
        rows = list(targets.values_list("pk", "key", "category")[:batch_size])
        version_ids: list[int] = []
        made_from_theirs = None
        if rows:
            ids = {pk for pk, _, _ in rows}
            summary_ids = {pk for pk, _, category in rows if category == Memory.Category.SUMMARY}
            erased_keys = {key for _, key, _ in rows}
        else:
            left = _versions_left(request)
            picked = list(left.order_by("pk").values_list("pk", "memory_id")[:batch_size]) if left is not None else []
            if not picked:
                return False
            # Their memories locked (in id order, as everywhere): a restore of one of these
            # versions holds its memory's lock while it copies the version, so it commits
            # first (its new version is someone else's then) or finds the version gone.
            held = dict(
                Memory.objects.filter(tenant_id=request.tenant_id, pk__in=sorted({m for _, m in picked}))
                .order_by("pk")
                .select_for_update()
                .values_list("key", "pk")
            )
            version_ids = [pk for pk, _ in picked]
            ids, summary_ids, erased_keys = set(), set(), set(held)
            made_from_theirs = partial(_made_from_their_values, subject=_own_subject(request), held=held)
        rebuilt: dict[str, Any] = {}  # key -> its new text, for summaries made from it
        _follow_lineage(
            request,
            ids=ids,
            summary_ids=summary_ids,
            erased_keys=erased_keys,
            rebuilt=rebuilt,
            first_level=made_from_theirs,
        )

        # Every memory erased here locked before its rows go (the targets already are; this
        # adds the derived summaries): a write or the embedding job holding one finishes
        # before this goes on, and one that comes later waits for this commit and finds the
        # memory gone. Versions and embeddings have no foreign key in the database
        # (migrations 0015, 0018), so the DELETEs below, each with a fresh snapshot, must see
        # every version and embedding committed before it.
        locked = Memory.objects.filter(tenant_id=request.tenant_id, pk__in=ids).order_by("pk").select_for_update()
        list(locked.values_list("pk", flat=True))
        _drop_their_terms(request.tenant_id, sorted(ids))
        # Versions and embeddings go with their memory (on_delete=CASCADE, a DELETE each).
        _total, per_model = Memory.objects.filter(tenant_id=request.tenant_id, pk__in=ids).only("pk").delete()
        versions_left, _ = (
            MemoryVersion.objects.filter(tenant_id=request.tenant_id, pk__in=version_ids).delete()
            if version_ids
            else (0, {})
        )
        # Admin history of these memories names them (object_repr is the key) and may
        # describe the change: it goes too.
        admin_log_entries, _ = LogEntry.objects.filter(
            content_type=ContentType.objects.get_for_model(Memory), object_id__in=[str(pk) for pk in ids]
        ).delete()
        counts = {
            "memories": len(ids) - len(summary_ids),
            "versions": per_model.get("memories.MemoryVersion", 0) + versions_left,
            "summaries": len(summary_ids),
            "admin_log_entries": admin_log_entries,
            "batches": 1,
        }
        receipt = dict(request.receipt)
        for name, n in counts.items():
            receipt[name] = receipt.get(name, 0) + n
        receipt["summaries_rebuilt"] = sorted(set(receipt.get("summaries_rebuilt", [])) | set(rebuilt))
        now = timezone.now()
        ForgetRequest.objects.filter(pk=request_id).update(receipt=receipt, progress_at=now, stalled_attempts=0)
        audit_record(
            tenant=request.tenant,
            actor=Actor.system(job=FORGET_JOB),
            action="forget.erase",
            outcome=Outcome.OK,
            count=len(ids) + versions_left,
            detail={"forget_request": str(request.uid), **counts, "summaries_rebuilt": len(rebuilt)},
        )
        return True


# The words of the memories a batch erases that, by the last count, no other memory held (no
# more counted holders than the batch has of them), out of the term statistics. ts_stat reads
# the batch's own index terms (its ids are integers, inlined).
_DROP_TERMS_SQL = """
WITH erased AS MATERIALIZED (
    SELECT substr(word, %(from)s) AS term, ndoc FROM ts_stat(%(inner)s)
    WHERE left(word, %(plen)s) = %(prefix)s)
DELETE FROM memories_searchterm s USING erased e
WHERE s.tenant_id = %(tenant)s AND s.term = e.term AND s.ndoc <= e.ndoc
"""


def _drop_their_terms(tenant_id: int, ids: list[int]) -> None:
    """Take the words of the memories ``ids`` (about to be erased) that no other memory held
    at the last count out of the tenant's term statistics (``SearchTerm``), in the batch's
    transaction: a completed forget leaves none of the subject's words there (a name, a
    diagnosis) for a backup to keep until the search-stats schedule's next recount. A word
    someone else wrote since that count loses its row too until the recount (which the
    completed forget makes due): it counts as rare meanwhile, as any word new since a count
    does. (Looking each such word up in the search index to keep it cost 0.1-0.3 s per batch
    of 500.) PostgreSQL only (SQLite's FTS5 index counts from the rows themselves). Cost:
    ts_stat over the batch's rows joined to the tenant's counted words, one DELETE."""
    if not ids or connection.vendor != "postgresql":
        return
    prefix = f"{int(tenant_id)}:"
    listed = ", ".join(str(int(i)) for i in ids)
    inner = f"SELECT search_tsv FROM memories_memory WHERE id IN ({listed})"  # nosec B608
    params = {"from": len(prefix) + 1, "inner": inner, "plen": len(prefix), "prefix": prefix, "tenant": tenant_id}
    with connection.cursor() as cursor:
        cursor.execute(_DROP_TERMS_SQL, params)


def _follow_lineage(
    request: ForgetRequest,
    *,
    ids: set[int],
    summary_ids: set[int],
    erased_keys: set[str],
    rebuilt: dict[str, Any],
    first_level=None,
) -> None:
    """Down the lineage of ``erased_keys``: each summary made from them is erased (added to
    ``ids``/``summary_ids``) when the requester may reach it or nothing else is left of it,
    else rebuilt without them (``rebuilt``); then the summaries made from those, and so on.
    ``first_level``, when given, picks which of the summaries made directly from
    ``erased_keys`` hold what is forgotten."""
    frontier = sorted(erased_keys)
    for level in range(LINEAGE_DEPTH_MAX):
        derived: list[Memory] = []
        for start in range(0, len(frontier), ERASE_BATCH_SIZE):
            chunk = frontier[start : start + ERASE_BATCH_SIZE]
            # Locked (in id order, after their sources, as a summarize job locks them): a
            # write to a summary committing meanwhile comes first, and the rebuild below
            # starts from its row and version — read unlocked, it wrote over that write
            # under the version the write was acknowledged with.
            derived += _summaries_derived_from(request.tenant_id, chunk).order_by("pk").select_for_update()
        # Once each (a summary may come from several chunks), and not one already done.
        derived = [m for m in {m.pk: m for m in derived}.values() if m.pk not in ids and m.key not in rebuilt]
        if level == 0 and first_level is not None:
            derived = [m for m in derived if first_level(m)]
        if not derived:
            break
        for summary in derived:
            if _in_reach(request.reach, key=summary.key, subject=summary.subject):
                ids.add(summary.pk)
                summary_ids.add(summary.pk)
                erased_keys.add(summary.key)
                continue
            # Outside the requester's reach (it holds other people's memories too):
            # rebuilt without the forgotten sources, never erased whole.
            text = _summary_rebuild(request, summary, erased=erased_keys, rebuilt=rebuilt, erasing=ids)
            if text is None:  # nothing but forgotten sources: nothing else is lost
                ids.add(summary.pk)
                summary_ids.add(summary.pk)
                erased_keys.add(summary.key)
            else:
                rebuilt[summary.key] = text
        frontier = sorted({m.key for m in derived})


def _versions_left(request: ForgetRequest) -> QuerySet[MemoryVersion] | None:
    """The requester's own earlier values under keys their request leaves: versions written
    while the memory was about the request's subject (``MemoryVersion.subject``), or named no
    one under the subject's own namespace (``subject`` "" under ``user:<subject>:``,
    ``lg:users:<subject>:``, ...: theirs by :func:`subject_q`'s rule), of memories since
    rewritten for another end user. Their memories stay (the current value is someone
    else's); these versions go. None when the request names no subject. Before, a version
    written with no subject under the namespace outlived the forget in the history of a key
    later handed to someone else.

    Cost: one read of the namespace's key ranges (what is left there once the request's
    memories are erased: keys handed to other end users), then the versions by the
    (tenant, subject) index OR'ed with those memories' (tenant, memory) one — that partial
    subject index holds no "" rows, so the namespace's memories are looked up first."""
    subject = _own_subject(request)
    if not subject:
        return None
    in_namespace = Q()
    for prefix in subject_namespaces(subject):
        in_namespace |= _any_state(startswith_q("key", prefix))
    handed = list(Memory.objects.filter(tenant_id=request.tenant_id).filter(in_namespace).values_list("pk", flat=True))
    theirs = Q(subject=subject)  # memoryversion_tenant_subject
    if handed:
        theirs |= Q(subject="", memory_id__in=handed)
    qs = MemoryVersion.objects.filter(tenant_id=request.tenant_id).filter(theirs)
    if not request.subject:
        # An end user's request for a prefix or keys: their versions under those keys only.
        keys = Memory.objects.filter(tenant_id=request.tenant_id)
        by_key = startswith_q("key", request.prefix) if request.prefix else Q(key__in=request.keys)
        keys = keys.filter(_any_state(by_key))
        qs = qs.filter(memory_id__in=keys.values("pk"))
    return qs


def _own_subject(request: ForgetRequest) -> str:
    """The end user whose values the request erases: its subject, or the end user who filed
    it for a prefix or keys (``reach``); empty for a request by keys or prefix alone."""
    return request.subject or request.reach.get("subject", "")


def _made_from_their_values(summary: Memory, *, subject: str, held: dict[str, int]) -> bool:
    """Whether ``summary`` holds, now or in its history, a value one of its sources in ``held``
    (key → memory id) had while it was ``subject``'s: at its last write or at any of its
    versions, the source's latest version written at or before then is theirs (or is gone:
    erased by an earlier batch). A summary made only after the key went to someone else holds
    their value, not the forgotten one's. Not its last write alone: a summary made from the
    forgotten value and since made again (its old version keeps that text), trashed or
    re-tagged (its value still is that text) was left holding it.
    Cost: per such source, two indexed SELECTs (the second over the summary's versions)."""
    for key in summary.sources:
        memory_id = held.get(key)
        if memory_id is None:
            continue
        versions = MemoryVersion.objects.filter(memory_id=memory_id).order_by("-version")
        # A version of their namespace that named no one was theirs too (subject_q).
        their_subjects = [subject, ""] if key.startswith(subject_namespaces(subject)) else [subject]
        then = versions.filter(created_at__lte=summary.updated_at).values_list("subject", flat=True).first()
        if then is None or then in their_subjects:
            return True
        at_each = Subquery(versions.filter(created_at__lte=OuterRef("created_at")).values("subject")[:1])
        # A version of the summary older than the source memory was made of something else.
        born = Memory.objects.filter(pk=memory_id).values("created_at")[:1]
        if (
            MemoryVersion.objects.filter(memory_id=summary.pk, created_at__gte=Subquery(born))
            .annotate(then=Coalesce(at_each, Value(subject)))
            .filter(then__in=their_subjects)
            .exists()
        ):
            return True
    return False


def _summary_rebuild(
    request: ForgetRequest, summary: Memory, *, erased: set[str], rebuilt: dict[str, Any], erasing: set[int]
) -> Any:
    """Rewrite ``summary`` without what its ``erased`` sources gave it (and with the new text
    of sources ``rebuilt`` before it), drop its history (every old version holds the
    forgotten text) and keep one version of the new text. Returns the new text, or None
    (nothing changed) when nothing but forgotten sources is left, for the caller to erase.
    Cost: a SELECT of its other sources, the summary retention rule's SELECT, an UPDATE, a
    DELETE of its versions, an INSERT."""
    forgotten = {k for k in summary.sources if k in erased}
    keep = [k for k in summary.sources if k not in forgotten]
    remaining = list(
        Memory.objects.filter(tenant_id=request.tenant_id, key__in=keep)
        .exclude(pk__in=erasing)
        .exclude(pk__in=_target_memories(request).values("pk"))
    )
    for memory in remaining:
        if memory.key in rebuilt:
            memory.value = rebuilt[memory.key]
    text = summary_without(summary=summary, forgotten=forgotten, rewritten=rebuilt, remaining=remaining)
    if text is None:
        return None
    now = timezone.now()
    version = summary.version + 1
    secret = summary.sensitive
    # What is left is its other sources' text: it expires when the last of them does (a
    # forgotten permanent source made it permanent) — never later than it would have.
    expires_at = summary.expires_at
    if remaining:
        ends = summary_expiry(
            tenant=Tenant(pk=request.tenant_id),
            key=summary.key,
            sources=[m.expires_at for m in remaining],
            written_at=now,
        )
        expires_at = ends if expires_at is None else min(ends or expires_at, expires_at)
    Memory.objects.filter(pk=summary.pk).update(
        value=keyring.seal_value(text, tenant_id=request.tenant_id, subject=summary.subject) if secret else text,
        sources=keep,
        expires_at=expires_at,
        # The rebuilt text replaces the index terms too: a forgotten word must not stay findable.
        **search.index_fields(
            tenant_id=request.tenant_id, key=summary.key, value=None if secret else text, tags=summary.tags
        ),
        version=version,
        updated_at=now,
    )
    MemoryVersion.objects.filter(memory_id=summary.pk).delete()
    actor = Actor.system(job=FORGET_JOB)
    MemoryVersion.objects.create(
        tenant_id=request.tenant_id,
        memory_id=summary.pk,
        version=version,
        value=text,
        sensitive=secret,
        op=MemoryVersion.Op.UPDATE,
        actor_kind=actor.kind,
        actor_id=actor.id,
        created_at=now,
        subject=summary.subject,
    )
    return text


def _redaction_progress(request_id: int, *, through: int, changed: int) -> None:
    """One committed page of the audit redaction: the receipt counts its events and the cursor
    (``REDACT_CURSOR``, an event id; dropped at completion) moves on; a page is progress."""
    with transaction.atomic():
        request = ForgetRequest.objects.select_for_update(of=("self",)).filter(pk=request_id).first()
        if request is None or request.status != Status.RUNNING:
            return
        receipt = dict(request.receipt)
        receipt["audit_events_redacted"] = receipt.get("audit_events_redacted", 0) + changed
        receipt[REDACT_CURSOR] = max(int(receipt.get(REDACT_CURSOR, 0)), through)
        ForgetRequest.objects.filter(pk=request_id).update(
            receipt=receipt, progress_at=timezone.now(), stalled_attempts=0
        )


def _target_left(request: ForgetRequest) -> bool:
    """Whether anything of the target is stored again: a write committed after the erasing
    batches. Cost: one or two indexed EXISTS (the target's index, the subject's versions)."""
    if _target_memories(request).exists():
        return True
    left = _versions_left(request)
    return left is not None and left.exists()


def _complete(request_id: int) -> dict | None:
    """Mark the request completed with its final receipt; None (nothing changed) when a write
    for its target committed since the erasing batches, for the caller to erase it first."""
    with transaction.atomic():
        request = ForgetRequest.objects.select_for_update(of=("self",)).select_related("tenant").get(pk=request_id)
        if request.status != Status.RUNNING:
            return _result(request)
        # Taken before the look below: a write it misses commits after this moment, so what
        # was acknowledged before ``completed_at`` is forgotten and what comes after stays.
        now = timezone.now()
        if _target_left(request):
            return None
        receipt = {name: request.receipt.get(name, 0) for name in RECEIPT_COUNTS}
        receipt.update(
            summaries_rebuilt=request.receipt.get("summaries_rebuilt", []),
            # Crypto-shredding (a subject's forget): its data keys are destroyed, so its sealed
            # values are unreadable in every copy, backups of the main database included.
            data_keys_destroyed=request.receipt.get("data_keys_destroyed", 0),
            crypto_shredded=bool(request.subject),
            audit_events_redacted=request.receipt.get("audit_events_redacted", 0),
            received_at=request.receipt.get("received_at") or _iso(request.created_at),
            started_at=request.receipt.get("started_at") or _iso(request.started_at or now),
            completed_at=_iso(now),
        )
        _advance(
            request_id,
            Status.COMPLETED,
            completed_at=now,
            receipt=receipt,
            progress_at=now,
            error="",
            stepping=False,
            turn_at=now,
        )
        # The dashboard's stored figures may name the subject's namespaces: recounted at once
        # (index-only); a large tenant's sizes are summed again at the next recount.
        dashboard_stats_after_forget(tenant=request.tenant, now=now)
        # Stored first answers of Idempotency-Key requests may hold the erased values.
        idempotency_tenant_forget(tenant=request.tenant)
        audit_record(
            tenant=request.tenant,
            actor=Actor.system(job=FORGET_JOB),
            action="forget.complete",
            outcome=Outcome.OK,
            count=receipt["memories"] + receipt["summaries"],
            detail={"forget_request": str(request.uid), **{name: receipt[name] for name in RECEIPT_COUNTS}},
        )
        request.refresh_from_db()
        return _result(request)


def _step_failed(request: ForgetRequest, exc: Exception) -> None:
    """Record a step's failure on its request — the error's class name only (a database
    error's message can quote the row it failed on) — and its ``forget.attempt_fail`` event,
    in one transaction. Only the request's latest attempt speaks for it: an older step
    overlapped by a newer one (``forget_request_execute`` runs whoever's turn it is) records
    nothing. Cost: a locking SELECT of the request, an UPDATE, the audit INSERT."""
    try:
        with transaction.atomic():
            row = (
                ForgetRequest.objects.select_for_update()
                .filter(pk=request.pk, status__in=PENDING, attempts=request.attempts)
                .values_list("stalled_attempts", "receipt")
                .first()
            )
            if row is None:
                return
            stalled, receipt = row
            ForgetRequest.objects.filter(pk=request.pk).update(
                error=f"{type(exc).__module__}.{type(exc).__name__}"[:200],
                receipt={**(receipt or {}), FAILURE_AUDITED: request.attempts},
            )
            # No attempt is left when this one was the last of ZEROMEM_JOB_MAX_ATTEMPTS in a
            # row that erased nothing (a batch it erased reset stalled_attempts to 0).
            _record_failed_attempt(
                request, attempt=request.attempts, code=_error_code(exc), gave_up=stalled >= _max_attempts()
            )
    except Exception:  # the database itself may be what failed; the re-raise reports it
        logger.exception("could not record the error of forget request %s", request.pk)


def _error_code(exc: Exception) -> str:
    """What kind of failure ``exc`` is, as the attempt's audit event names it: never its text
    (a database error's message can quote a key or a value)."""
    if isinstance(exc, ServiceError):
        return exc.code
    if isinstance(exc, DatabaseError):
        return "database_error"
    return "internal_error"


def _max_attempts() -> int:
    return settings.ZEROMEM_JOB_MAX_ATTEMPTS


def _record_failed_attempt(request: ForgetRequest, *, attempt: int, code: str, gave_up: bool) -> None:
    """The ``forget.attempt_fail`` event (``unavailable``) of one failed attempt (step) of
    ``request``: which request (its uid), which attempt of how many, the kind of error, and
    whether no attempt is left (the request's ``forget.fail`` follows when the next delivery
    begins). The request, never its subject or keys: forget events name the request only."""
    audit_record(
        tenant=request.tenant,
        actor=Actor.system(job=FORGET_JOB),
        action="forget.attempt_fail",
        outcome=Outcome.UNAVAILABLE,
        detail={
            "forget_request": str(request.uid),
            "attempt": attempt,
            "max_attempts": _max_attempts(),
            "error": code,
            "gave_up": gave_up,
        },
    )


def _result(request: ForgetRequest) -> dict:
    return {"forget_request": request.pk, "status": request.status, "receipt": request.receipt}


def _target_kind(request: ForgetRequest) -> str:
    return "subject" if request.subject else "prefix" if request.prefix else "keys"


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


# --- picking up lost requests -----------------------------------------------------------


def forget_requests_resume() -> int:
    """Enqueue again every pending request that has not moved for ``Q_CLUSTER["retry"]``
    seconds: its worker was killed (django-q2 redelivers those only with some brokers, and
    does not count the attempt) or its queue entry was lost. Returns how many.

    Each request's own attempt counter still bounds how often it runs. Requests locked by a
    running batch are skipped (they are moving). A request merely waiting its turn behind a
    long queue does not move either, and is enqueued again at every run of the schedule; its
    ``forget.resume`` event is written once per state of it — the first time, then again only
    after a step of it began (``attempts`` moved; ``RESUMED_AFTER``, in the receipt while it is
    pending, holds the count last audited) — not every 10 minutes of its wait.
    Cost: one scan of the pending-requests index, an UPDATE of them all, and per request
    whose state changed an UPDATE and an audit INSERT; one enqueue each after commit.
    """
    cutoff = timezone.now() - timedelta(seconds=settings.Q_CLUSTER["retry"])
    with transaction.atomic():
        stale = list(
            ForgetRequest.objects.filter(status__in=PENDING, progress_at__lt=cutoff)
            .select_for_update(skip_locked=True)
            .order_by("progress_at")
            .values_list("pk", "tenant_id", "uid", "attempts", "receipt")[:RESUME_MAX]
        )
        if not stale:
            return 0
        now = timezone.now()
        # Moving progress_at on means the next run of this schedule waits a full retry
        # interval before enqueueing the same request again.
        ForgetRequest.objects.filter(pk__in=[pk for pk, *_ in stale]).update(progress_at=now)
        actor = Actor.system(job=FORGET_JOB)
        for pk, tenant_id, uid, attempts, receipt in stale:
            transaction.on_commit(partial(_enqueue, pk), robust=True)
            if (receipt or {}).get(RESUMED_AFTER) == attempts:
                continue  # still waiting where the last resume found it: audited then
            ForgetRequest.objects.filter(pk=pk).update(receipt={**(receipt or {}), RESUMED_AFTER: attempts})
            audit_record(
                tenant=Tenant(pk=tenant_id),
                actor=actor,
                action="forget.resume",
                outcome=Outcome.OK,
                detail={"forget_request": str(uid), "attempts": attempts},
            )
    return len(stale)
