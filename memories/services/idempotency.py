"""Safe retries: the ``Idempotency-Key`` header on writes (tool calls, batches, REST writes).

A write sent with a key claims it (one INSERT, its own transaction, unique per tenant, API
key and idempotency key) before the work starts, and stores its answer — status, body and the
headers that matter (``Content-Type``, ``ETag``, ``Location``) — when done. A retry within
``ZEROMEM_IDEMPOTENCY_SECONDS`` (24 h) gets that answer without the work being done again; a
duplicate arriving while the first still runs waits for it (up to
``ZEROMEM_IDEMPOTENCY_WAIT_SECONDS``, then 409 ``idempotency_in_progress`` with Retry-After);
the same key with a different request (method, path and query, If-Match, body) is 422
``idempotency_key_reused``. Answers that say "not done, retry" (:func:`not_done`: 429, 5xx)
are not kept, so the retry does the work. A batch answers 200 whatever its calls met: one
some of whose calls met such a failure is kept as a :class:`Partial` answer, which a retry
resumes (those calls run again, alone; the others' results stand: a call that committed is
never run twice, and the retry never replays "try again"); one none of whose calls got
through is not kept at all. A running claim is renewed by its process (a heartbeat thread,
every third of ``ZEROMEM_IDEMPOTENCY_LEASE_SECONDS``), so a request slower than the lease is
not run a second time alongside itself; a claim left unfinished by a process that died is
given up one lease after its last renewal. A forget request drops the tenant's stored answers and
lets the claims still running finish without storing theirs (:func:`tenant_forget`), but for
those of requests whose answer holds no memory value (:func:`holds_no_values`: the POST that
filed a forget request, which the forget may finish before that POST stores its answer).

Caveat: the answer is stored right after the work's own transaction commits, not inside it;
a process killed between the two leaves the claim unfinished, and a retry after the lease
runs the work again.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

from django.conf import settings
from django.db import DatabaseError, connection, connections
from django.utils import timezone

from memories import keyring
from memories.models import ApiKey, IdempotencyRecord, Tenant
from zeromem.kernel import crypto
from zeromem.kernel.errors import Conflict, InvalidInput, Unprocessable

HEADER = "Idempotency-Key"
KEY_RE = re.compile(r"[\x21-\x7e]{1,255}")  # printable ASCII, no blanks (as Stripe's and the IETF draft's)
REPLAYED_HEADERS = ("Content-Type", "ETag", "Location")
PURGE_BATCH = 5000
logger = logging.getLogger(__name__)


def not_done(status: int) -> bool:
    """An answer that says "not done, retry" (429: rate limited, tenant busy, search budget,
    too many jobs; 5xx: database unavailable, a search or list past its time limit, a bug): it is
    never kept as a key's answer, and a batch call that got one is run again by the retry."""
    return status == 429 or status >= 500


class Partial(NamedTuple):
    """An answer made of ``parts`` parts (a batch's calls), of which those at ``pending`` met
    a transient failure (:func:`not_done`)."""

    pending: list[int]
    parts: int


def key(raw: Any) -> str:
    if not isinstance(raw, str) or not KEY_RE.fullmatch(raw):
        raise InvalidInput("must be 1-255 printable ASCII characters without spaces", field=HEADER)
    return raw


def fingerprints(*, method: str, path: str, if_match: str | None, data: Any) -> tuple[str, str]:
    """(fingerprint, legacy fingerprint) of a request, from one serialization of its body.

    The fingerprint identifies the request a key was first used for: HMAC-SHA256 of its
    method, path, If-Match and body, under a key derived from ``SECRET_KEY``. Keyed, because
    the body may hold a short sensitive value (a phone number) that a plain hash, kept for
    ``ZEROMEM_IDEMPOTENCY_SECONDS``, would give away to anyone holding a dump and a list of
    guesses. The legacy one is the plain SHA-256 that records made before it hold: still
    accepted by :func:`claim` so that a retry spanning the upgrade is replayed, not refused
    (such records expire within ``ZEROMEM_IDEMPOTENCY_SECONDS``)."""
    text = _request_text(method, path, if_match, data)
    return hmac.new(_fingerprint_key(), text, hashlib.sha256).hexdigest(), hashlib.sha256(text).hexdigest()


def fingerprint(*, method: str, path: str, if_match: str | None, data: Any) -> str:
    """The request's fingerprint (see :func:`fingerprints`)."""
    return fingerprints(method=method, path=path, if_match=if_match, data=data)[0]


def legacy_fingerprint(*, method: str, path: str, if_match: str | None, data: Any) -> str:
    """The plain SHA-256 older records hold (see :func:`fingerprints`)."""
    return fingerprints(method=method, path=path, if_match=if_match, data=data)[1]


def _request_text(method: str, path: str, if_match: str | None, data: Any) -> bytes:
    body = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return "\n".join([method, path, if_match or "", body]).encode("utf-8", "surrogatepass")


def _fingerprint_key() -> bytes:
    return hashlib.sha256(b"zeromem-idempotency-fingerprint\x00" + settings.SECRET_KEY.encode()).digest()


def claim(*, tenant: Tenant, api_key: ApiKey, key: str, fingerprint: str, legacy: str = "") -> int | IdempotencyRecord:
    """The new claim's id (do the work, then :func:`complete`), or the finished record whose
    answer to replay. Raises 422 for another request under this key, 409 if the first
    request is still running after the wait.

    A claim is running while its process renews it (:func:`renew_every`); one neither made
    nor renewed within ``ZEROMEM_IDEMPOTENCY_LEASE_SECONDS`` was left by a process that died,
    and is given up. A kept partial answer (:class:`Partial`: a batch some of whose calls met
    a transient failure) is not replayed but resumed: the claim is taken over and its
    :func:`resumption` says which calls to run again."""
    deadline = time.monotonic() + settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS
    while True:
        now = timezone.now()
        claimed = _insert(tenant_id=tenant.pk, api_key_id=api_key.pk, key=key, fingerprint=fingerprint, now=now)
        if claimed is not None:
            _hold(claimed, _Run())
            keyring.opened_watch()  # the answer is kept sealed under the data keys the work opens
            return claimed
        record = IdempotencyRecord.objects.filter(tenant=tenant, api_key=api_key, key=key).first()
        if record is None:
            continue  # purged or released meanwhile: claim it
        expired = record.created_at < now - timedelta(seconds=settings.ZEROMEM_IDEMPOTENCY_SECONDS)
        if expired:
            IdempotencyRecord.objects.filter(pk=record.pk, created_at=record.created_at).delete()
            continue
        lapsed = record.status is None and (record.renewed_at or record.created_at) < now - timedelta(
            seconds=settings.ZEROMEM_IDEMPOTENCY_LEASE_SECONDS
        )
        if lapsed and (record.pending is None or not record.keep_answer):
            # Only as it was read: a renewal meanwhile (its process lives) keeps it. A lapsed
            # resumption a forget marked (tenant_forget) goes too: the partial answer still in
            # its row may hold what the forget erased (it was resumed, answering it again).
            _as_read(record).delete()
            continue
        if record.fingerprint != fingerprint and not (legacy and record.fingerprint == legacy):
            raise Unprocessable(
                f"this {HEADER} was already used for a different request (method, path or body); "
                "use a new key for a new request",
                code="idempotency_key_reused",
                field=HEADER,
            )
        if record.status is not None or lapsed:
            body, sealed = _open(bytes(record.body))
            if body is None:  # sealed under a destroyed key (its subject forgotten): run again
                IdempotencyRecord.objects.filter(pk=record.pk).delete()
                continue
            if record.pending is None:
                record.body = body
                return record
            # A partial answer (or the claim of its resumption, whose process died): resume it.
            if not _as_read(record).update(status=None, renewed_at=now, completed_at=None):
                continue  # another retry took it first
            _hold(
                record.pk, _Run(previous=body, pending=list(record.pending), status=record.status or 200, sealed=sealed)
            )
            keyring.opened_watch()
            return record.pk
        if time.monotonic() >= deadline:
            raise Conflict(
                f"a request with this {HEADER} is still running; retry to get its answer",
                code="idempotency_in_progress",
                field=HEADER,
                retry_after=1,
            )
        time.sleep(0.05)


def _as_read(record: IdempotencyRecord):
    """The record, only if it is still as ``record`` read it (not finished, renewed or taken
    over since)."""
    return IdempotencyRecord.objects.filter(
        pk=record.pk, status=record.status, renewed_at=record.renewed_at, completed_at=record.completed_at
    )


def resumption(claim_id: int | None) -> tuple[bytes, list[int]] | None:
    """For a claim that resumes a partial answer: (that answer, the indexes of its parts to
    run again); None for a fresh claim."""
    run = _running.get(claim_id) if claim_id is not None else None
    if run is None or run.previous is None:
        return None
    return run.previous, run.pending


_TABLE = IdempotencyRecord._meta.db_table
# One statement, autocommitted: no transaction round trips, no exception on a taken key.
_INSERT = (
    f"INSERT INTO {_TABLE} (tenant_id, api_key_id, key, fingerprint, status, body, headers, created_at) "  # nosec B608
    "VALUES (%s, %s, %s, %s, NULL, %s, %s, %s) ON CONFLICT (tenant_id, api_key_id, key) DO NOTHING RETURNING id"
)


def _insert(*, tenant_id: int, api_key_id: int, key: str, fingerprint: str, now) -> int | None:
    with connection.cursor() as cursor:
        ops = connection.ops
        params = [tenant_id, api_key_id, key, fingerprint, b"", ops.adapt_json_value({}, None)]
        cursor.execute(_INSERT, [*params, ops.adapt_datetimefield_value(now)])
        row = cursor.fetchone()
    return row[0] if row else None


def complete(claim_id: int, *, status: int, body: bytes, headers: dict, partial: Partial | None = None) -> None:
    """Keep the answer — unless it says the work was not done (:func:`not_done`; a partial
    answer none of whose parts got through): then the claim goes (or, resuming a partial
    answer, that answer is back), and a retry does the work. A partial answer with some parts
    done is kept to be resumed, not replayed. An answer whose work opened sensitive values may
    hold them: it is kept sealed under each data key opened (README "Encryption at rest": no
    sensitive value in plaintext at rest, and a forget's shredding reaches this copy too)."""
    opened = keyring.opened_take()
    # Dropped once done, not before: if this fails (the database gone), the release that
    # follows gives back what this claim resumed.
    run = _running.get(claim_id) or _Run()
    if run.sealed:
        opened |= run.sealed  # a resumed answer carries the parts the earlier attempt opened
    if not_done(status) or (partial is not None and len(partial.pending) >= partial.parts):
        _give_back(claim_id, run)
        _drop(claim_id)
        return
    if opened:
        body = _seal(body, opened)
        if body is None:  # a key destroyed meanwhile: nothing could open the answer
            IdempotencyRecord.objects.filter(pk=claim_id, status__isnull=True).delete()
            _drop(claim_id)
            return
    pending = partial.pending if partial is not None and partial.pending else None
    kept = IdempotencyRecord.objects.filter(pk=claim_id, status__isnull=True, keep_answer=True).update(
        status=status, body=body, headers=headers, completed_at=timezone.now(), pending=pending
    )
    if not kept:
        # A forget request completed while the work ran (tenant_forget): the answer may hold
        # what it erased. The claim goes; a retry runs afresh.
        IdempotencyRecord.objects.filter(pk=claim_id, status__isnull=True).delete()
    _drop(claim_id)


# A sealed answer: this mark, then the envelope (JSON) of the base64 of the answer it seals
# (sealed again under each further key). No HTTP answer body begins with a NUL.
_SEALED = b"\x00zmenc\x00"


def _seal(body: bytes, key_ids: set[int]) -> bytes | None:
    for key_id in sorted(key_ids):
        key = keyring.data_key(key_id)
        if key is None:
            return None
        envelope = crypto.seal(key, key_id, base64.b64encode(body).decode("ascii"))
        body = _SEALED + json.dumps(envelope, separators=(",", ":")).encode("ascii")
    return body


def _open(body: bytes) -> tuple[bytes | None, set[int]]:
    """(the stored answer opened, the data keys it was sealed under); None when a key it is
    sealed under is destroyed."""
    sealed: set[int] = set()
    while body.startswith(_SEALED):
        envelope = json.loads(body[len(_SEALED) :])
        key_id = int(envelope["k"])
        key = keyring.data_key(key_id)
        if key is None:
            return None, sealed
        sealed.add(key_id)
        body = base64.b64decode(crypto.open_envelope(key, envelope))
    return body, sealed


def release(claim_id: int) -> None:
    """The work did not finish: the key is as it was before this claim — free, or holding
    the partial answer this claim was resuming."""
    keyring.opened_take()
    _give_back(claim_id, _drop(claim_id))


def _give_back(claim_id: int, run: _Run) -> None:
    claimed = IdempotencyRecord.objects.filter(pk=claim_id, status__isnull=True)
    if run.previous is not None:
        # The partial answer is still in the row (sealed as it was): it stands again — unless
        # a forget completed meanwhile (it may hold what the forget erased).
        claimed.filter(keep_answer=False).delete()
        claimed.update(status=run.status, completed_at=timezone.now())
        return
    claimed.delete()


# --- the heartbeat: a running claim is renewed by its process ------------------------------
# A request may run longer than the lease (a batch of slow calls, a wait for a lock): a retry
# must not take its claim over while it runs. A row lock or a session advisory lock held for
# the request would need one connection (and, behind PgBouncer in transaction mode, one
# transaction) for the whole request, which a batch's per-call transactions cannot give: so
# each process renews the claims it runs, every third of the lease, from a daemon thread of
# its own: one primary-key UPDATE per running claim (none when it runs none; between rounds
# the thread wakes once a second, without a query). A killed process renews nothing, and its
# claims lapse one lease after their last renewal.


# How long a process renews one claim at most. A request that never finishes nor gives its
# claim up (a bug; a request hung for good) would otherwise hold its key — every retry 409 —
# for as long as the process lives; past this its claim lapses one lease later, as a killed
# process's does. No request runs this long (a batch is 50 calls, each with its deadlines).
MAX_HOLD_SECONDS = 3600


@dataclass
class _Run:
    previous: bytes | None = None  # the partial answer a resumed claim carries on
    pending: list[int] = field(default_factory=list)
    status: int = 200  # the partial answer's status, back on a release
    sealed: set[int] = field(default_factory=set)  # the data keys the partial answer was sealed under
    since: float = field(default_factory=time.monotonic)  # when this process took the claim


_running: dict[int, _Run] = {}
_running_lock = threading.Lock()
_heartbeat_pid: int | None = None


def renew_every() -> float:
    """Seconds between a process's renewals of its running claims: a third of the lease, so
    that two renewals may fail (a database blip) before a claim lapses."""
    return settings.ZEROMEM_IDEMPOTENCY_LEASE_SECONDS / 3


def _hold(claim_id: int, run: _Run) -> None:
    global _heartbeat_pid
    with _running_lock:
        if _heartbeat_pid != os.getpid():  # none yet in this process (or a fork's parent's)
            _running.clear()  # a forked child runs none of its parent's claims
            _heartbeat_pid = os.getpid()
            threading.Thread(target=_heartbeat, name="zeromem-idempotency-heartbeat", daemon=True).start()
        _running[claim_id] = run


def _drop(claim_id: int) -> _Run:
    with _running_lock:
        return _running.pop(claim_id, None) or _Run()


def _heartbeat() -> None:
    last = time.monotonic()
    while True:
        time.sleep(min(renew_every(), 1.0))
        if time.monotonic() - last < renew_every():
            continue
        last = time.monotonic()
        try:
            renew_round(now=last)
        finally:
            connections.close_all()  # this thread's: back to the pool between rounds


def renew_round(*, now: float) -> int:
    """One round of the heartbeat: renew this process's running claims, but for those it has
    held longer than :data:`MAX_HOLD_SECONDS`, which it lets go (they lapse one lease later).
    Never raises: the thread must live on. The claims renewed."""
    with _running_lock:
        over = [claim_id for claim_id, run in _running.items() if now - run.since > MAX_HOLD_SECONDS]
        for claim_id in over:
            del _running[claim_id]
        ids = list(_running)
    if over:
        logger.warning("idempotency: %d claims held over %d s are no longer renewed", len(over), MAX_HOLD_SECONDS)
    if not ids:
        return 0
    try:
        return renew(ids)
    except DatabaseError:
        logger.warning("idempotency: running claims not renewed", exc_info=True)
    except Exception:  # a claim it stops renewing lapses
        logger.exception("idempotency: running claims not renewed")
    return 0


def _after_fork_in_child() -> None:
    # A fork copies the lock as it was: held by a thread of the parent (which the child does
    # not have) it would never be released, and the child's first claim would wait forever.
    global _running_lock, _heartbeat_pid
    _running_lock = threading.Lock()
    _running.clear()  # a forked child runs none of its parent's claims
    _heartbeat_pid = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def renew(claim_ids: list[int]) -> int:
    """Say that the claims ``claim_ids`` still run: one primary-key UPDATE each, so that the
    heartbeat never holds one claim's row lock while it waits for another's (a forget's
    transaction marks its tenant's running claims): no deadlock with anyone."""
    now = timezone.now()
    return sum(
        IdempotencyRecord.objects.filter(pk=claim_id, status__isnull=True).update(renewed_at=now)
        for claim_id in claim_ids
    )


def idempotency_purge(*, now=None) -> int:
    """Delete records past their window, in batches (the schedule ``zeromem:idempotency-purge``)."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.ZEROMEM_IDEMPOTENCY_SECONDS)
    deleted = 0
    while True:
        ids = list(IdempotencyRecord.objects.filter(created_at__lt=cutoff).values_list("pk", flat=True)[:PURGE_BATCH])
        if not ids:
            return deleted
        deleted += IdempotencyRecord.objects.filter(pk__in=ids).delete()[0]


def holds_no_values(claim_id: int | None, *, tenant: Tenant) -> None:
    """Mark the running claim ``claim_id`` as one whose answer holds no memory value, so that
    :func:`tenant_forget` leaves it (and its answer, once stored) alone. Called in the work's
    transaction (a forget request's filing): the mark commits with the work, before any
    worker can see the forget it filed. ``keep_answer`` is put back on too: another forget of
    the tenant may have completed between the claim and this work, and turned it off — an
    answer that holds no memory value is kept all the same (a retry must get this request
    again, not file a second one). Cost: one primary-key UPDATE, none without a claim."""
    if claim_id is not None:
        IdempotencyRecord.objects.filter(pk=claim_id, tenant=tenant, status__isnull=True).update(
            holds_no_values=True, keep_answer=True
        )


def tenant_forget(*, tenant: Tenant) -> int:
    """A forget request drops its tenant's stored answers: they may hold the erased values
    (a retry after it simply runs again). Called as a forget request completes.

    A claim still running stays claimed — a retry waits for it or gets 409
    ``idempotency_in_progress``, instead of doing the work a second time alongside it — but
    with ``keep_answer`` off: its work may have read what was erased, so :func:`complete`
    drops its answer and the claim, and a retry after that runs afresh. Marked before the
    stored answers are deleted, so an answer stored in between is deleted too.

    Records marked :func:`holds_no_values` are left as they are: the POST that filed this
    very forget request is typically still running when a small forget completes, and a
    retry must get that request again, not file a second one."""
    records = IdempotencyRecord.objects.filter(tenant=tenant, holds_no_values=False)
    records.filter(status__isnull=True).update(keep_answer=False)
    return records.filter(status__isnull=False).delete()[0]
