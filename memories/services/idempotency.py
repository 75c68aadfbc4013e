"""Safe retries: the ``Idempotency-Key`` header on writes (tool calls, batches, REST writes).

A write sent with a key claims it (one INSERT, its own transaction, unique per tenant, API
key and idempotency key) before the work starts, and stores its answer — status, body and the
headers that matter (``Content-Type``, ``ETag``, ``Location``) — when done. A retry within
``ZEROMEM_IDEMPOTENCY_SECONDS`` (24 h) gets that answer without the work being done again; a
duplicate arriving while the first still runs waits for it (up to
``ZEROMEM_IDEMPOTENCY_WAIT_SECONDS``, then 409 ``idempotency_in_progress`` with Retry-After);
the same key with a different request (method, path and query, If-Match, body) is 422
``idempotency_key_reused``. Answers that say "not done, retry" (429, 5xx) are not kept, so
the retry does the work. A claim left unfinished by a process that died is given up after
``ZEROMEM_IDEMPOTENCY_LEASE_SECONDS``. A forget request drops the tenant's stored answers and
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
import re
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.utils import timezone

from memories import keyring
from memories.models import ApiKey, IdempotencyRecord, Tenant
from zeromem.kernel import crypto
from zeromem.kernel.errors import Conflict, InvalidInput, Unprocessable

HEADER = "Idempotency-Key"
KEY_RE = re.compile(r"[\x21-\x7e]{1,255}")  # printable ASCII, no blanks (as Stripe's and the IETF draft's)
REPLAYED_HEADERS = ("Content-Type", "ETag", "Location")
PURGE_BATCH = 5000


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
    request is still running after the wait."""
    deadline = time.monotonic() + settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS
    while True:
        now = timezone.now()
        claimed = _insert(tenant_id=tenant.pk, api_key_id=api_key.pk, key=key, fingerprint=fingerprint, now=now)
        if claimed is not None:
            keyring.opened_watch()  # the answer is kept sealed under the data keys the work opens
            return claimed
        record = IdempotencyRecord.objects.filter(tenant=tenant, api_key=api_key, key=key).first()
        if record is None:
            continue  # purged or released meanwhile: claim it
        expired = record.created_at < now - timedelta(seconds=settings.ZEROMEM_IDEMPOTENCY_SECONDS)
        abandoned = record.status is None and record.created_at < now - timedelta(
            seconds=settings.ZEROMEM_IDEMPOTENCY_LEASE_SECONDS
        )
        if expired or abandoned:
            IdempotencyRecord.objects.filter(pk=record.pk, created_at=record.created_at).delete()
            continue
        if record.fingerprint != fingerprint and not (legacy and record.fingerprint == legacy):
            raise Unprocessable(
                f"this {HEADER} was already used for a different request (method, path or body); "
                "use a new key for a new request",
                code="idempotency_key_reused",
                field=HEADER,
            )
        if record.status is not None:
            body = _open(bytes(record.body))
            if body is None:  # sealed under a destroyed key (its subject forgotten): run again
                IdempotencyRecord.objects.filter(pk=record.pk).delete()
                continue
            record.body = body
            return record
        if time.monotonic() >= deadline:
            raise Conflict(
                f"a request with this {HEADER} is still running; retry to get its answer",
                code="idempotency_in_progress",
                field=HEADER,
                retry_after=1,
            )
        time.sleep(0.05)


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


def complete(claim_id: int, *, status: int, body: bytes, headers: dict) -> None:
    """Keep the answer — unless it says the work was not done (429, 5xx): then the claim
    goes, and a retry does the work. An answer whose work opened sensitive values may hold
    them: it is kept sealed under each data key opened (README "Encryption at rest": no
    sensitive value in plaintext at rest, and a forget's shredding reaches this copy too)."""
    opened = keyring.opened_take()
    if status == 429 or status >= 500:
        release(claim_id)
        return
    if opened:
        body = _seal(body, opened)
        if body is None:  # a key destroyed meanwhile: nothing could open the answer
            release(claim_id)
            return
    kept = IdempotencyRecord.objects.filter(pk=claim_id, status__isnull=True, keep_answer=True).update(
        status=status, body=body, headers=headers, completed_at=timezone.now()
    )
    if not kept:
        # A forget request completed while the work ran (tenant_forget): the answer may hold
        # what it erased. The claim goes; a retry runs afresh.
        release(claim_id)


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


def _open(body: bytes) -> bytes | None:
    """The stored answer opened; None when a key it is sealed under is destroyed."""
    while body.startswith(_SEALED):
        envelope = json.loads(body[len(_SEALED) :])
        key = keyring.data_key(int(envelope["k"]))
        if key is None:
            return None
        body = base64.b64decode(crypto.open_envelope(key, envelope))
    return body


def release(claim_id: int) -> None:
    keyring.opened_take()
    IdempotencyRecord.objects.filter(pk=claim_id, status__isnull=True).delete()


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
