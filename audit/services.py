"""Writing the audit log: recording events, sealing them into the chain, redacting a
forgotten subject's identifiers, checkpoints and the retention purge.

Services record their events through :func:`audited_operation` (one transaction, one
event, and the rule for refused calls); ``audit_record`` is the one INSERT underneath. The
maintenance paths (seal, redact, purge) are the only writers that change or delete rows;
on PostgreSQL each announces itself to the append-only trigger with a transaction-local
setting (``zeromem.audit_mode``), and each leaves a record: the seal itself, the
``redacted`` commitments, or a checkpoint plus an ``audit.purge`` event.
"""

from __future__ import annotations

import contextvars
import functools
import ipaddress
import json
import logging
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, OperationalError, connection, connections, models, transaction
from django.db.models import F, Min, Q
from django.db.models.functions import Coalesce
from django.db.models.sql import InsertQuery
from django.utils import timezone

from audit import chain, daily, limits, partitions
from audit.models import AuditCheckpoint, AuditEvent, AuditSeal
from audit.seals import head_seal, range_head, seal_events_q, seal_numbers, unsealed_q
from audit.seals import tenant_q as _tenant_q
from audit.selectors import (
    COLUMN_FILTERS,
    AuditFilters,
    _numbered_top,
    audit_events,
    few_by_index,
    list_page_bounds,
)
from zeromem.kernel import hotsql, tracing, validation
from zeromem.kernel.actors import Actor, end_user_actor_id, require_scope
from zeromem.kernel.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    PreconditionFailed,
    ServiceError,
    TenantBusy,
    Unavailable,
)
from zeromem.kernel.pglocks import int4_key
from zeromem.kernel.replica import replica_reads
from zeromem.kernel.scopes import Scope
from zeromem.kernel.subjectkeys import subject_namespaces
from zeromem.kernel.tenancy import Tenant, get_tenant_model
from zeromem.kernel.tracing import NO_SPAN

# Two ints for pg_advisory_xact_lock: this namespace, and the tenant id (0: no tenant).
_SEAL_LOCK_NAMESPACE = 0x5A4D  # "ZM"
SYSTEM_AUDIT_JOB = "audit"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _storable(value):
    """Refused input is recorded as sent (a key, an argument name), but PostgreSQL text and
    jsonb cannot hold NUL, nor UTF-8 a lone surrogate (which a surface's JSON parser may hand
    over: the MCP SDK's 2026-07-28 path, in-process adapters): each is replaced by U+FFFD, so
    recording the refusal cannot fail."""
    if isinstance(value, str):
        value = value.replace("\x00", "\ufffd")
        return value if value.isascii() else _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_storable(k): _storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_storable(v) for v in value]
    return value


def _ip(value: str | None) -> str | None:
    if not value:
        return None
    return _ip_text(value) if isinstance(value, str) else _ip_parsed(value)


@functools.lru_cache(maxsize=1024)
def _ip_text(value: str) -> str | None:
    # A client's address repeats from request to request: parsed once, not per event.
    return _ip_parsed(value)


def _ip_parsed(value) -> str | None:
    try:
        return ipaddress.ip_address(value).compressed
    except ValueError:
        return None


# The client address column's marker in _insert_sql's columns, and its prepared values.
_IP = "ip"
_IP_PREPARED: dict[tuple[str, str], Any] = {}
_IP_PREPARED_MAX = 1024
_MISSING: Any = object()


def _ip_prepared(field, value: str, db) -> Any:
    """``field.get_db_prep_save(value, db)`` of a client address (as :func:`_ip` wrote it): a
    client's address repeats from request to request, and on PostgreSQL its preparation parses
    it again (``ipaddress.ip_address``, an immutable object): once per address and database
    vendor, the last ``_IP_PREPARED_MAX`` of them kept."""
    key = (db.vendor, value)
    prepared = _IP_PREPARED.get(key, _MISSING)
    if prepared is _MISSING:
        if len(_IP_PREPARED) >= _IP_PREPARED_MAX:
            _IP_PREPARED.clear()
        prepared = _IP_PREPARED[key] = field.get_db_prep_save(value, db)
    return prepared


# Events this context (thread, or task) has appended: see :func:`events_written`.
_written: contextvars.ContextVar[int] = contextvars.ContextVar("zeromem_audit_events_written", default=0)


def events_written() -> int:
    """How many events this thread (or task) has appended so far: a surface that runs several
    operations for one request (Claude's memory tool) compares it before and after, to record
    a refusal that no operation recorded. No query."""
    return _written.get()


def audit_record(
    *,
    tenant: Tenant | None,
    actor: Actor,
    action: str,
    outcome: str,
    target: str = "",
    subject: str = "",
    count: int | None = None,
    version: int | None = None,
    detail: dict | None = None,
    actor_filter: str = "",
) -> int | None:
    """Append one event: one INSERT, no lock shared with other requests (the chain is
    built later by :func:`audit_seal`). Never pass a memory value or a key secret here.
    Returns the event's id — None inside ``hotsql.answered_later()`` when the INSERT is a
    transaction of its own (its answer read when that block ends)."""
    db = connections[DEFAULT_DB_ALIAS]  # the wrapper, once: each proxied attribute was a lookup
    sql, params = _event_statement(
        db,
        tenant=tenant,
        actor=actor,
        action=action,
        outcome=outcome,
        target=target,
        subject=subject,
        count=count,
        version=version,
        detail=detail,
        actor_filter=actor_filter,
    )
    if hotsql.fetchone_later(sql, params, db, done=_count_written):
        # Its commit's answer is read where the caller's hotsql.answered_later() block ends
        # (the tool-call lane, before it answers), and only then counted: no id meanwhile.
        return None
    event_id = hotsql.fetchone(sql, params, db)[0]
    _count_written()
    return event_id


def _event_statement(
    db,
    *,
    tenant: Tenant | None,
    actor: Actor,
    action: str,
    outcome: str,
    target: str,
    subject: str,
    count: int | None,
    version: int | None,
    detail: dict | None,
    actor_filter: str,
) -> tuple[str, list]:
    """The INSERT of one event and its parameters, its digest computed (audit_record's)."""
    fields = {
        "uid": uuid.uuid4(),
        "tenant_id": tenant.pk if tenant is not None else None,
        "occurred_at": timezone.now(),
        "actor_kind": actor.kind,
        "actor_id": _storable(actor.id)[:64],
        "actor_label": _storable(actor.label)[:150],
        "surface": actor.surface,
        "action": action,
        "target": _storable(target)[:512],
        "subject": _storable(subject)[:255],
        "outcome": outcome,
        "request_id": _storable(actor.request_id)[:64],
        "client_ip": _ip(actor.client_ip),
        "count": count,
        "version": version,
        "detail": _storable(detail or {}),
        "actor_filter": _storable(actor_filter)[:512],
    }
    fields["digest"] = chain.digest(fields)
    sql, columns = _insert_sql(db.vendor, _flush_waived(db))
    # What Model.save() would send (each field prepares its value; the others get their
    # defaults), without building the instance or compiling the INSERT on every request.
    params = [
        default
        if name is None
        else fields[name]
        if text is True and isinstance(fields[name], str)
        else _ip_prepared(f, fields[name], db)
        if text is _IP and isinstance(fields[name], str)
        else f.get_db_prep_save(fields[name], db)
        for f, name, text, default in columns
    ]
    return sql, params


def _count_written() -> None:
    _written.set(_written.get() + 1)


def _flush_waived(db=connection) -> bool:
    """Whether this event's commit may skip waiting for the WAL flush: only when
    ``ZEROMEM_AUDIT_READ_EVENTS_ASYNC`` is on, on PostgreSQL, and the event is a transaction of
    its own — the event of an operation that changed nothing (a read, a search, a refusal).
    An event written with anything else (a write's, a batch's) commits with it, flushed: a
    write outside any transaction holds its statements to go with its event (hotsql.holding)."""
    return (
        settings.ZEROMEM_AUDIT_READ_EVENTS_ASYNC
        and db.vendor == "postgresql"
        # Without checking a connection out when none is yet (the event built before the read
        # that checks one out: get_autocommit() would, with the pool's check).
        and hotsql.own_transaction(db)
        and not hotsql.holds_statements(db)
    )


@functools.cache
def _insert_sql(vendor: str, flush_waived: bool = False) -> tuple[str, tuple]:
    """The INSERT of one event as the ORM compiles it for this database (the columns
    Model.save() writes, RETURNING the id), once per process: compiling it was a few percent
    of every audited request's CPU.

    ``flush_waived`` (:func:`_flush_waived`): the statement also sets ``synchronous_commit``
    off for its own transaction (evaluated in RETURNING, before the commit that reads it), so
    the commit returns without waiting for the WAL flush — about 0.4 ms of a 1.5 ms read on a
    disk whose flush takes that long, and no wait behind a purge's WAL (README "Audit log")."""
    meta = AuditEvent._meta
    columns = tuple(f for f in meta.local_concrete_fields if f is not meta.auto_field and not f.generated)
    query = InsertQuery(AuditEvent)
    query.insert_values(columns, [AuditEvent()], raw=False)
    compiler = query.get_compiler(connection=connection)
    compiler.returning_fields = [meta.pk]
    ((sql, _params),) = compiler.as_sql()
    if not connection.features.can_return_columns_from_insert:
        raise RuntimeError("audit_record needs INSERT ... RETURNING (PostgreSQL, SQLite >= 3.35)")
    if flush_waived:
        sql += ", set_config('synchronous_commit', 'off', true)"
    given = {*chain.DIGEST_FIELDS, "digest"}
    # Per column: the field, the attribute audit_record sets (None: the field's default,
    # prepared here once), and whether it is a plain CharField, whose preparation of a str
    # is the str itself (the same value Model.save() sends, without the calls), or the
    # client's address (_IP: prepared once per address, _ip_prepared).
    return sql, tuple(
        (
            f,
            f.attname if f.attname in given else None,
            True if type(f) is models.CharField else _IP if type(f) is models.GenericIPAddressField else False,
            None if f.attname in given else f.get_db_prep_save(f.get_default(), connection),
        )
        for f in columns
    )


# A ServiceError an operation has recorded carries this attribute, so an enclosing operation
# or the surface (AuditedAPIView, through audit_refusal) does not record it again.
_RECORDED = "_zeromem_audit_recorded"


def _outcome_of(exc: ServiceError) -> str:
    if isinstance(exc, NotFound):
        return AuditEvent.Outcome.NOT_FOUND
    if isinstance(exc, Conflict):
        return AuditEvent.Outcome.CONFLICT
    if isinstance(exc, Forbidden):
        return AuditEvent.Outcome.DENIED
    if isinstance(exc, PreconditionFailed):
        return AuditEvent.Outcome.PRECONDITION_FAILED
    if isinstance(exc, Unavailable):
        return AuditEvent.Outcome.UNAVAILABLE
    return AuditEvent.Outcome.INVALID


def _mark_recorded(exc: Exception) -> bool:
    """True the first time ``exc`` is recorded; False when something already recorded it."""
    if getattr(exc, _RECORDED, False):
        return False
    setattr(exc, _RECORDED, True)
    return True


class AuditedOperation:
    """One service operation in progress: who acts, on which tenant, what (``action``) and on
    what (``target``); :meth:`record` says how it ended. Handed out by
    :func:`audited_operation`, which writes the one event."""

    def __init__(self, *, tenant: Tenant | None, actor: Actor, action: str, target: Any):
        self.tenant = tenant  # an operation that creates its tenant names it once it exists
        self.actor = actor
        self.action = action
        # As sent (refusals are recorded with it); a service sets the validated one if it differs.
        self.target = target if isinstance(target, str) else ""
        self._row: dict | None = None
        self._written = False
        self.event_id: int | None = None  # once written

    def record(self, **fields) -> None:
        """How the operation ended (once): :meth:`_row_of`'s fields. The event is written when
        the operation ends: in its transaction, or for a :class:`NotFound`/:class:`Conflict`
        raised after this call, right after the rollback, with these fields."""
        if self._row is not None:
            raise RuntimeError(f"{self.action}: one operation records one event")
        self._row = self._row_of(**fields)

    def _row_of(
        self,
        *,
        outcome: str = AuditEvent.Outcome.OK,
        target: str | None = None,
        subject: str = "",
        count: int | None = None,
        version: int | None = None,
        detail: dict | None = None,
        actor_filter: str = "",
    ) -> dict:
        return {
            "outcome": outcome,
            "target": self.target if target is None else target,
            "subject": subject,
            "count": count,
            "version": version,
            "detail": detail,
            "actor_filter": actor_filter,
        }

    def write_now(self) -> None:
        """Write the recorded event now, not when the operation ends: for an operation run
        outside a transaction (``atomic=False``: a search, whose ranking a transaction would
        keep from the search tier) that makes one write at its end, in a transaction it opens
        for that write and its event. The last thing the operation does."""
        if self._row is None or self._written:
            raise RuntimeError(f"{self.action}: write_now needs one recorded event, not yet written")
        self._write(self._row)
        self._written = True

    @property
    def recorded(self) -> bool:
        """Whether the operation has recorded its event (written or not yet)."""
        return self._row is not None

    @contextmanager
    def riding_read(self, *, expect: Sequence[tuple[str, object]], **row) -> Iterator[None]:
        """Record the event as ``row`` (:meth:`record`'s fields) for a read whose row is
        expected to hold ``expect`` — (column, value) pairs — and send it with the block's read
        (zeromem/kernel/hotsql.py "An event that rides the read it records"): written with it,
        in its transaction, only when the row holds them; else nothing is recorded and the
        caller records what it found, as without this. A no-op where the event cannot ride."""
        if self._row is not None:
            raise RuntimeError(f"{self.action}: one operation records one event")
        full = self._row_of(**row)
        db = connections[DEFAULT_DB_ALIAS]
        sql, _columns = _insert_sql(db.vendor, _flush_waived(db))

        def params() -> list:
            # Built when sent (its uid, time and digest then): piped, while the read runs.
            built, values = _event_statement(db, tenant=self.tenant, actor=self.actor, action=self.action, **full)
            if built != sql:
                raise RuntimeError(f"{self.action}: the event's statement changed while it was held")
            return values

        def written(event_id) -> None:
            # Piped (hotsql): None — the read's row says the event is being written — and its
            # id once read (in either order: the id may be read first, by a statement sent
            # before the row is handed on). Counted written (events_written) once committed.
            self._row = full
            self._written = True
            if event_id is not None and self.event_id is None:
                self.event_id = event_id
                _count_written()

        def lost() -> None:
            # The event the read's row announced was not written (its transaction failed to
            # commit after its row was sent): written now, as an event of its own.
            self._write(full)

        with hotsql.event_riding(hotsql.Event(sql, params, expect, written, lost)):
            yield

    def unrecord(self) -> None:
        """Take back the event recorded and not written: an attempt given up before anything
        of it was written (a write over a row that changed since it was read, done again
        under the row's lock), which records its own."""
        if self._written:
            raise RuntimeError(f"{self.action}: its event is written")
        self._row = None

    def _write(self, row: dict) -> None:
        self.event_id = audit_record(tenant=self.tenant, actor=self.actor, action=self.action, **row)

    def _row_for(self, exc: ServiceError) -> dict:
        outcome = _outcome_of(exc)
        if outcome in (AuditEvent.Outcome.NOT_FOUND, AuditEvent.Outcome.CONFLICT):
            # An answer, not a refusal: the fields the service recorded, if it did.
            if self._row is not None and self._row["outcome"] == outcome:
                return self._row
            return {"outcome": outcome, "target": self.target}
        return {"outcome": outcome, "target": self.target, "detail": {"code": exc.code, "field": exc.field}}


@contextmanager
def audited_operation(
    *, tenant: Tenant | None, actor: Actor, action: str, target: Any = "", atomic: bool = True, traced: bool = True
) -> Iterator[AuditedOperation]:
    """One transaction for a service operation and its one audit event::

        with audited_operation(tenant=tenant, actor=actor, action="memory.read", target=key) as op:
            ...
            op.record(subject=m.subject, version=m.version)  # outcome ok unless given

    A :class:`ServiceError` raised inside rolls the transaction back — the call changes
    nothing — and is then recorded on its own: a refusal (bad input, missing scope, forbidden
    key) as ``invalid``/``denied``/``precondition_failed`` with its code and field,
    :class:`NotFound`/:class:`Conflict` as ``not_found``/``conflict``. The innermost operation
    that sees an error records it; enclosing ones do not record it again (its event is written
    in the enclosing transaction, so an enclosing operation that fails too takes it along, as
    a summarize attempt's refused archive). An operation that ends without
    :meth:`~AuditedOperation.record` writes no event.

    ``atomic=False`` is for an operation whose only write is its event (a read): the event
    is one INSERT, a transaction of its own, so the operation saves the BEGIN and COMMIT
    round trips. Inside an enclosing transaction (a batch) it is part of that one as before.

    Traced (ZEROMEM_TRACING, ``traced``) as a span named by the action, with the outcome and
    the tenant's slug: never the target (a memory key) or the event's fields.
    """
    op = AuditedOperation(tenant=tenant, actor=actor, action=action, target=target)
    traced_as = tracing.span(action, action=action, tenant=tenant.slug if tenant else None) if traced else NO_SPAN
    with traced_as as span:
        try:
            with transaction.atomic() if atomic else nullcontext():
                yield op
                if op._row is not None and not op._written:
                    op._write(op._row)
        except ServiceError as exc:
            if _mark_recorded(exc):
                if isinstance(exc, TenantBusy):
                    _tally_refusal(tenant=op.tenant, actor=actor, action=action, target=op.target, error=exc)
                else:
                    op._write(op._row_for(exc))
            span.set("outcome", str(_outcome_of(exc)))
            raise
        span.set("outcome", str(op._row["outcome"]) if op._row is not None else "ok")


def audit_refusal(
    *,
    tenant: Tenant,
    actor: Actor,
    action: str,
    target: str = "",
    error: Exception,
    code: str | None = None,
    field: str | None = None,
) -> None:
    """A request refused on a surface before any service ran (a body that is not JSON, a
    field of the wrong type): one ``invalid`` (``denied`` for a 403) event with the error's
    code and field, ``{"code", "field"}`` as an operation records its refusal — ``code`` and
    ``field`` as the answer names them when the surface gives them (a DRF error's own code is
    not the answer's: ``parse_error`` for ``malformed_json``) — unless an operation already
    recorded this very error. A refusal of a request over its key's or tenant's limits (429:
    ``rate_limited``, and :class:`TenantBusy`: ``tenant_busy``, ``search_budget``) is counted
    instead (:func:`_tally_refusal`)."""
    if not _mark_recorded(error):
        return
    if isinstance(error, TenantBusy) or getattr(error, "status_code", None) == 429:
        _tally_refusal(tenant=tenant, actor=actor, action=action, target=target, error=error)
        return
    forbidden = getattr(error, "http_status", 400) == 403
    audit_record(
        tenant=tenant,
        actor=actor,
        action=action,
        target=target,
        outcome=AuditEvent.Outcome.DENIED if forbidden else AuditEvent.Outcome.INVALID,
        detail={
            "code": code or getattr(error, "code", None) or getattr(error, "default_code", "invalid"),
            "field": field if code else getattr(error, "field", None),
        },
    )


# --- refusals over a limit: counted per source and minute ----------------------------------

REFUSAL_TALLY = "refused:"
# The counter's bucket holds at most this many characters (RateCounter.bucket); a source that
# does not fit (a staff user's long name) is recorded one event per refusal, as before.
_BUCKET_MAX = 200


def _tally_refusal(*, tenant: Tenant | None, actor: Actor, action: str, target: str, error: ServiceError) -> None:
    """A request refused because its key or tenant is over a limit (``rate_limited``: the key's
    calls per minute; ``tenant_busy``: every slot taken; ``search_budget``: its search time
    spent) — the answer a flood of requests gets, once per request. Recording each as an event
    made the flood a flood of synchronous commits, which every other tenant's audited request
    then queued behind for the WAL flush. So, as failed authentications are: counted per
    source (tenant, actor, surface, client address, action, code) and minute, one counter
    increment that does not wait for the flush (audit/limits.py), and written later as
    **one** ``invalid`` event in the tenant's own log with ``count`` = the refusals and
    ``detail`` = {code, minute} (:func:`audit_refusals_flush`: by the source's first refusal
    of a later minute, and by the every-minute schedule). The key was verified: the tenant's
    log, not the tenant-less one. Not kept: each refusal's request id and target (the refusal
    was of the tenant's limit, not of a key)."""
    code = getattr(error, "zeromem_code", None) or getattr(error, "code", None) or "rate_limited"
    source = json.dumps(
        [tenant.pk if tenant else None, actor.kind, actor.id, actor.label, actor.surface, actor.client_ip]
        + [action, code],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    bucket = REFUSAL_TALLY + _storable(source)
    if tenant is None or len(bucket) > _BUCKET_MAX:
        audit_record(
            tenant=tenant,
            actor=actor,
            action=action,
            target=target,
            outcome=AuditEvent.Outcome.INVALID,
            detail={"code": code, "field": getattr(error, "field", None)},
        )
        return
    if limits.hit(bucket, tally=REFUSAL_TALLY).count == 1:
        # A source's first refusal in a minute flushes the minutes that have closed.
        audit_refusals_flush()


def audit_refusals_flush(*, now: float | None = None) -> int:
    """Write one ``invalid`` event (``count`` = the refusals, ``detail`` = code and minute) in
    its tenant's log per source and closed minute of refusals over a tenant's limits
    (:func:`_tally_refusal`); each minute once, whoever flushes. Returns the events written."""
    now = limits.clock() if now is None else now
    with transaction.atomic():
        tallies = limits.drain_tallies(REFUSAL_TALLY, before=int(now // 60) * 60)
        sources = [(json.loads(bucket[len(REFUSAL_TALLY) :]), start, count) for bucket, start, count in tallies]
        tenants = get_tenant_model().objects.in_bulk({src[0] for src, _s, _c in sources})
        written = 0
        for (tenant_id, kind, actor_id, label, surface, client_ip, action, code), start, count in sources:
            tenant = tenants.get(tenant_id)
            if tenant is None:
                _logger.warning("refusals of a deleted tenant not recorded: %s × %s %s", count, action, code)
                continue
            audit_record(
                tenant=tenant,
                actor=Actor(kind=kind, id=actor_id, label=label, surface=surface, client_ip=client_ip),
                action=action,
                outcome=AuditEvent.Outcome.INVALID,
                count=count,
                detail={"code": code, "minute": datetime.fromtimestamp(start, tz=UTC).isoformat()},
            )
            written += 1
    return written


AUTH_FAILURE_TALLY = "authfail:src:"


class AuthThrottled(Exception):
    """Too many failed authentications from this address or with this key prefix."""

    def __init__(self, retry_after: float):
        super().__init__("too many failed authentications")
        self.retry_after = retry_after


def audit_auth_failure(*, tenant: Tenant | None, actor: Actor, target: str, code: str) -> None:
    """A request whose credentials failed. ``tenant``: the tenant of a key whose secret
    matched (revoked, expired) — a verified claim, recorded in that tenant's log at once.
    Anything else (no key, a malformed one, a wrong secret) is an unverified claim: never
    a tenant's row, only counted, per source (address, failure code, route) and minute, and
    written later as one tenant-less ``auth.failed`` event with the count
    (:func:`audit_auth_failures_flush`). ``target`` is the route pattern, not the path the
    client chose. ``actor`` names only the public part of a key, never its secret.

    Throttled first: past ``ZEROMEM_AUTH_FAILURES_PER_MINUTE`` failures of the address, or
    of the key prefix, it raises :class:`AuthThrottled` and writes nothing. Cost: two or
    three counter increments (Redis or one UPSERT each); a verified failure adds one INSERT."""
    limit = settings.ZEROMEM_AUTH_FAILURES_PER_MINUTE
    address = actor.client_ip or "unknown"
    hits = [limits.hit(f"authfail:ip:{address}")]
    if actor.label:
        hits.append(limits.hit(f"authfail:key:{actor.label}"))
    over = [h for h in hits if h.count > limit]
    if over:
        raise AuthThrottled(max(h.retry_after for h in over))
    if tenant is None:
        source = json.dumps([address, code, target[:100], actor.surface], separators=(",", ":"))
        if limits.hit(AUTH_FAILURE_TALLY + source, tally=AUTH_FAILURE_TALLY).count == 1:
            # The first failure of a source in a minute flushes the minutes that have closed.
            audit_auth_failures_flush()
        return
    with transaction.atomic():
        audit_record(
            tenant=tenant,
            actor=actor,
            action="auth.failed",
            target=target,
            outcome=AuditEvent.Outcome.UNAUTHENTICATED,
            detail={"code": code},
        )


def audit_auth_failures_flush(*, now: float | None = None) -> int:
    """Write one tenant-less ``auth.failed`` event (``count`` = the failures) per source
    and closed minute of unverified failed authentications; each minute once, whoever
    flushes (the next failure, or the every-minute schedule). Returns the events written."""
    now = limits.clock() if now is None else now
    with transaction.atomic():
        tallies = limits.drain_tallies(AUTH_FAILURE_TALLY, before=int(now // 60) * 60)
        for bucket, start, count in tallies:
            address, code, route, surface = json.loads(bucket[len(AUTH_FAILURE_TALLY) :])
            address = None if address == "unknown" else address
            actor = Actor(kind=AuditEvent.ActorKind.ANONYMOUS, surface=surface, client_ip=address)
            minute = datetime.fromtimestamp(start, tz=UTC)
            audit_record(
                tenant=None,
                actor=actor,
                action="auth.failed",
                target=route,
                outcome=AuditEvent.Outcome.UNAUTHENTICATED,
                count=count,
                detail={"code": code, "minute": minute.isoformat()},
            )
    return len(tallies)


def event_fields(row: dict) -> dict:
    """The digest's fields of a stored event (a ``values()`` row)."""
    return {name: row[name] for name in chain.DIGEST_FIELDS}


@contextmanager
def _maintenance(mode: str):
    """One transaction in which the append-only trigger lets ``mode`` through."""
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT set_config('zeromem.audit_mode', %s, true)", [mode])
        yield


def _lock_chain(tenant_id: int | None) -> None:
    # Sealers and purgers of one tenant take turns; API requests never take this lock.
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [_SEAL_LOCK_NAMESPACE, int4_key(tenant_id or 0)])


# --- sealing ------------------------------------------------------------------------------
#
# A seal is a *range seal* (AuditSeal.by_range): its events are its tenant's events with ids
# first_event_id..last_event_id whose ``seal`` column is null, and nothing is written to them.
# That needs one guarantee: no event may commit into a range after it was sealed. Ids come
# from a sequence when a row is inserted, commits come later and in any order, so the job
# seals only up to a *settled horizon*: an id below which every transaction that could still
# commit an event has ended (:func:`_settled_horizon`). Seals made before audit migration
# 0011 name their events through the ``seal`` column (an UPDATE of each event, once).

_logger = logging.getLogger("zeromem.audit")

# Transactions of this database, other than ours, that may hold an audit event id they have
# not committed: any with a transaction id, or busy in a statement (an INSERT draws its id from
# the sequence before the transaction gets its id). A session idle in a transaction that has
# no transaction id has written nothing: it holds no event id. Processes with no user
# (autovacuum workers; usesysid is shown to every role) run no SQL of a user: never waited for.
# pg_locks lists every session's own virtual transaction lock whatever its role; the state of
# another role's session is hidden (NULL) unless this role has pg_read_all_stats, so such a
# session counts as busy: its transaction is waited for.
_STRAGGLERS_SQL = """
SELECT l.virtualxid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'virtualxid' AND l.mode = 'ExclusiveLock' AND l.granted
  AND a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND a.usesysid IS NOT NULL
  AND NOT (a.backend_xid IS NULL AND coalesce(a.state, '') LIKE 'idle%%')
  AND (%s::text[] IS NULL OR l.virtualxid = ANY(%s::text[]))
"""


@functools.cache
def _event_sequence() -> str:
    """The audit event id sequence; its cache must be 1 (the default): with a cache, a session
    could insert an event, later, with an id handed to it before the horizon was read."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT s.seqrelid::regclass::text, s.seqcache FROM pg_sequence s "
            "WHERE s.seqrelid = pg_get_serial_sequence(%s, 'id')::regclass",
            [AuditEvent._meta.db_table],
        )
        name, cache = cursor.fetchone()
    if cache != 1:
        raise RuntimeError(f"the audit event id sequence {name} must have CACHE 1 (it has {cache})")
    return name


def _settled_horizon(*, wait: float | None = None) -> int | None:
    """PostgreSQL: the highest audit event id such that every event with an id up to it that
    will ever commit has committed, or None when some transaction that may hold such an id
    is still open after ``wait`` seconds (default ``ZEROMEM_AUDIT_SEAL_WAIT``).

    Read the sequence's last value V first; every id up to V was drawn by then, by a
    transaction that has ended since or is open now. Then wait until each open one that may
    hold an id (see _STRAGGLERS_SQL) has ended, or is seen idle without a transaction id (its
    INSERT failed, or it inserted no event). A transaction that opens later draws ids above V.
    Prepared (two-phase) transactions hold ids too: the horizon waits until there are none.
    Cost: two catalog reads when nothing is open; requests last milliseconds, so the wait
    is that long."""
    wait = settings.ZEROMEM_AUDIT_SEAL_WAIT if wait is None else wait
    deadline = time.monotonic() + wait
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sequence_last_value(%s::regclass)", [_event_sequence()])
        (last,) = cursor.fetchone()
        if last is None:
            return 0  # no id drawn yet
        pending: list[str] | None = None
        pause = 0.002
        while True:
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # pg_stat_activity is cached per transaction
            cursor.execute(_STRAGGLERS_SQL, [pending, pending])
            pending = [vxid for (vxid,) in cursor.fetchall()]
            cursor.execute("SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()")
            prepared = cursor.fetchone()[0]
            if not pending and not prepared:
                return last
            if time.monotonic() >= deadline:
                _logger.warning(
                    "audit sealing: %d transaction(s) that may hold an event id up to %d still open after %.1f s "
                    "(%d prepared); sealing waits for the next run",
                    len(pending),
                    last,
                    wait,
                    prepared,
                )
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def sealing_horizon(*, wait: float | None = None) -> int | None:
    """The id up to which events may be sealed now: None on SQLite (no bound: one writer at a
    time, so an event that commits later always has a higher id than every event seen now),
    else :func:`_settled_horizon`; ``-1`` when it is not settled (seal nothing)."""
    if connection.vendor != "postgresql":
        return None
    horizon = _settled_horizon(wait=wait)
    return -1 if horizon is None else horizon


def audit_seal(*, tenant_id: int | None, batch_size: int | None = None, horizon: int | None = 0) -> int:
    """Seal the tenant's unsealed events in id order, ``batch_size`` per seal, each seal its
    own short transaction, up to the settled horizon (``horizon``: one the caller took with
    :func:`sealing_horizon`; by default this call takes it). Returns how many events it sealed.

    Cost per seal: one SELECT of ids and digests on the partial ``audit_unsealed`` index, the
    chain's HMACs and one seal INSERT — no event is written. Then the sealed events are
    folded into the tenant's daily counts (:func:`audit.daily.fold`: one read of the batch by
    id range, a few UPSERTs).
    """
    batch_size = batch_size or settings.ZEROMEM_AUDIT_SEAL_BATCH
    if horizon == 0:
        horizon = sealing_horizon()
    sealed = 0
    while horizon is None or horizon > 0:
        with transaction.atomic():
            _lock_chain(tenant_id)
            head = head_seal(tenant_id)
            pending = AuditEvent.objects.filter(unsealed_q(tenant_id, head))
            if horizon is not None:
                pending = pending.filter(pk__lte=horizon)
            rows = list(pending.order_by("id").values_list("id", "digest")[:batch_size])
            if not rows:
                break
            seq = head.seq + 1 if head else 1
            prev_hash = head.hash if head else chain.genesis(tenant_id)
            total = (head.total if head else 0) + len(rows)
            value = prev_hash
            for event_id, event_digest in rows:
                value = chain.link(value, event_id, event_digest)
            first, last = rows[0][0], rows[-1][0]
            AuditSeal.objects.create(
                tenant_id=tenant_id,
                seq=seq,
                first_event_id=first,
                last_event_id=last,
                count=len(rows),
                total=total,
                prev_hash=prev_hash,
                by_range=True,
                hash=chain.seal_hash(
                    prev_hash=prev_hash,
                    tenant_id=tenant_id,
                    seq=seq,
                    first=first,
                    last=last,
                    count=len(rows),
                    total=total,
                    last_chain=value,
                ),
            )
        sealed += len(rows)
    if tenant_id is not None:
        # The dashboard's daily counts (audit/daily.py): what was just sealed, off the hot path.
        daily.fold(tenant_id)
    return sealed


def _chain_ids() -> list[int | None]:
    return [None, *get_tenant_model().objects.order_by("pk").values_list("pk", flat=True)]


def audit_seal_all(*, batch_size: int | None = None) -> dict:
    """Seal every tenant's tail (the scheduled job), under one settled horizon. Returns
    {tenant id: events sealed} for the chains that had unsealed events. Cost: per chain, the
    head seal and one probe of ``audit_unsealed``."""
    horizon = sealing_horizon()
    done = {}
    for tenant_id in _chain_ids():
        if AuditEvent.objects.filter(unsealed_q(tenant_id)).exists():
            done[tenant_id] = audit_seal(tenant_id=tenant_id, batch_size=batch_size, horizon=horizon)
    return done


def audit_unsealed_count() -> int:
    """Events no seal holds yet, over every chain (the metrics gauge, read at every scrape):
    per chain one index range scan of its tail — the tenants' in one query (per tenant its
    head seal and the count of the tail after it: ``auditseal_one_per_seq``, ``audit_unsealed``),
    the tenant-less chain in two. Three round trips whatever the number of tenants (it was two
    per tenant)."""
    heads = AuditSeal.objects.filter(tenant=models.OuterRef("pk")).order_by("-seq")
    head_id = heads.annotate(
        covered=models.Case(models.When(by_range=True, then=F("last_event_id")), default=models.Value(0))
    ).values("covered")[:1]
    tails = (
        AuditEvent.objects.filter(tenant=models.OuterRef("pk"), seal__isnull=True, pk__gt=models.OuterRef("head"))
        .order_by()
        .values("tenant")
        .annotate(n=models.Count("pk"))
        .values("n")
    )
    tenants = (
        get_tenant_model()
        .objects.order_by()
        .annotate(head=Coalesce(models.Subquery(head_id), models.Value(0)))
        .annotate(n=Coalesce(models.Subquery(tails), models.Value(0)))
        .aggregate(total=models.Sum("n"))["total"]
    )
    return (tenants or 0) + AuditEvent.objects.filter(unsealed_q(None)).count()


# --- checkpoints ----------------------------------------------------------------------------


def _checkpoint(*, tenant_id: int | None, reason: str, purged_through: int | None = None) -> AuditCheckpoint:
    head = head_seal(tenant_id)
    seq, head_hash, total = (head.seq, head.hash, head.total) if head else (0, chain.genesis(tenant_id), 0)
    return AuditCheckpoint.objects.create(
        tenant_id=tenant_id,
        seal_seq=seq,
        head_hash=head_hash,
        total=total,
        reason=reason,
        purged_through=purged_through,
        mac=chain.checkpoint_mac(
            tenant_id=tenant_id, seal_seq=seq, head_hash=head_hash, total=total, reason=reason, purged=purged_through
        ),
    )


def audit_checkpoint_create(*, tenant: Tenant, actor: Actor) -> AuditCheckpoint:
    """Seal the tail, then record the chain head: the checkpoint to keep outside the
    database (``manage.py audit_checkpoint`` prints it). Scope ``audit:read``, and no key
    allowlist: the head covers the whole tenant's log. Audited."""
    with audited_operation(tenant=tenant, actor=actor, action="audit.checkpoint"):
        require_scope(actor, Scope.AUDIT_READ)
        if actor.allowed_prefixes:
            raise Forbidden(
                "a checkpoint covers the whole tenant; this key is limited to some prefixes", code="key_not_allowed"
            )
    audit_seal(tenant_id=tenant.pk)
    with audited_operation(tenant=tenant, actor=actor, action="audit.checkpoint") as op:
        checkpoint = _checkpoint(tenant_id=tenant.pk, reason=AuditCheckpoint.Reason.EXPORT)
        op.record(count=checkpoint.total, detail={"seal": checkpoint.seal_seq})
    return checkpoint


# --- redaction ------------------------------------------------------------------------------


# Actions whose target names no memory key, prefix or end user: an API key's public prefix
# (api_key.*), a staff username (membership.*), a tenant's slug (tenant.*), a route
# (auth.failed), a job's id (job.read). A forget matches events by their target's text, and
# a prefix such as "zm_" or a subject spelled like a staff username matched these too: the
# forget pseudonymized who was given which key or role — the access-control trail a review
# reads, which names no one the forget is about. Their subject, if any, is still redacted.
TARGET_NOT_A_KEY = (
    "api_key.create",
    "api_key.revoke",
    "api_key.view",
    "membership.set",
    "membership.remove",
    "membership.view",
    "tenant.create",
    "tenant.update",
    "tenant.dashboard",
    "tenant.view",
    "auth.failed",
    "job.read",
)


def _redaction_q(*, subject: str, keys: Iterable[str], prefix: str, prefixes: Iterable[str] = ()) -> Q:
    by_target = Q(pk__in=[])  # events whose target names the forgotten keys or end user
    q = Q(pk__in=[])
    for other in prefixes:
        if other:
            by_target |= Q(target__startswith=other)
    if subject:
        # The subject's own events, events an end user (the subject) made in the portal,
        # and events about keys that name the subject by convention (user:<id>:...).
        q |= Q(subject=subject)
        by_target |= Q(target=subject)
        q |= Q(actor_kind=AuditEvent.ActorKind.END_USER, actor_id__in={subject, end_user_actor_id(subject)})
        # Readings of the log that filtered by the subject as an actor (audit.list, audit.export).
        q |= ~Q(actor_filter="") & Q(actor_filter__in={subject, end_user_actor_id(subject)})
        for namespace in subject_namespaces(subject):  # user:<id>:, usr:<id>:, lg:users:<id>:, ...
            by_target |= Q(target__startswith=namespace)
    if prefix:
        by_target |= Q(target__startswith=prefix) | Q(target=prefix)
    keys = [k for k in keys if k]
    if keys:
        by_target |= Q(target__in=keys)
    return q | (by_target & ~Q(action__in=TARGET_NOT_A_KEY))


def _redacted_values(row: dict, pseudonyms: dict | None = None) -> tuple[dict, dict]:
    """(new field values, commitments to keep) for one event row. ``pseudonyms``: a cache of
    the run's pseudonyms by (tenant, value) — a forgotten subject's millions of events carry
    a few distinct values, and a pseudonym depends on nothing else (one HMAC each saved)."""
    tenant_id = row["tenant_id"]
    fields = ["target", "subject", "actor_filter"]
    if row["actor_kind"] == AuditEvent.ActorKind.END_USER:
        # The end user's own events: who (their id) and from where identify them. A label is
        # usually generic ("end user"); it is redacted only when it names them.
        fields += ["actor_id", "client_ip"]
        if row["actor_id"] and row["actor_id"] in (row["actor_label"] or ""):
            fields.append("actor_label")
    kept = dict(row["redacted"] or {})
    bound = dict(kept.get(chain.BOUND) or {})
    new = {}
    for name in fields:
        if name in kept or row[name] in ("", None):
            continue
        kept[name] = chain.commitment(row["uid"], name, row[name])
        if name == "client_ip":
            new[name] = None
        else:
            value = str(row[name])
            if pseudonyms is None:
                new[name] = chain.pseudonym(tenant_id, value)
            elif (pseudonym := pseudonyms.get((tenant_id, value))) is not None:
                new[name] = pseudonym
            else:
                new[name] = pseudonyms[tenant_id, value] = chain.pseudonym(tenant_id, value)
        bound[name] = chain.binding(row["uid"], name, kept[name], new[name])
    if bound:
        kept[chain.BOUND] = bound
    return new, kept


def audit_redact_subject(
    *,
    tenant: Tenant,
    subject: str = "",
    keys: Iterable[str] = (),
    prefix: str = "",
    prefixes: Iterable[str] = (),
    batch_size: int = 1000,
    after: int = 0,
    on_page=None,
) -> int:
    """Replace the identifying fields (key, subject, the actor a reading of the log filtered
    by; for the end user's own portal events also actor and client address) of a forgotten
    subject's, prefix's or keys' events with a keyed pseudonym, keeping each field's
    commitment so the chain still verifies. ``prefixes``: more targets to redact by how they
    start (a forget's derived keys: its summaries', ``summary:`` + the forgotten prefix).

    Called by ``forget_request_execute`` after the last erased batch, and again on a retry:
    idempotent (a field already redacted is left alone). Returns how many events changed.
    Pages of ``batch_size`` events in id order, each its own transaction, from the event after
    ``after``; ``on_page(last_id, changed)``, when given, is called after each page commits and
    ends the run early by returning False (a forget's slice, continued from ``last_id``).
    Cost per page: the tenant's events from ``after`` to the page's last match, read on
    ``audit_unsealed`` (tenant, id) — by the events' id alone, every tenant's events in that
    span were read (a subject whose first event was old read the whole table from there; 2.4M
    rows for the first page in a 2.9M-event database); one UPDATE per set of fields.
    """
    q = _redaction_q(subject=subject, keys=keys, prefix=prefix, prefixes=prefixes)
    # Above the last id an older seal (before audit/0011) numbered, no event has a seal
    # number: saying ``seal IS NULL`` there lets the pages read the tenant's own events on
    # audit_unsealed (tenant, id) instead of every tenant's by id.
    numbered_top = _numbered_top(tenant)
    if not after:
        # Start at the first match, not at the tenant's first event: a walk by id from 0 read
        # every event older than the subject's first one (1.3M of them for the first page in
        # bench). "id + 0" keeps the planner from finding the minimum by walking the id order,
        # which is that walk: it reads the matches on the subject/target/actor indexes instead.
        first = AuditEvent.objects.filter(q, tenant=tenant).aggregate(first=Min(F("id") + 0))["first"]
        if first is None:
            return 0
        after = first - 1
    columns = ["id", "uid", "tenant_id", "actor_kind", "redacted", *chain.COMMITTED_FIELDS]
    table = AuditEvent._meta.db_table
    changed = 0
    pseudonyms: dict = {}
    while True:
        with _maintenance("redact"):
            page = AuditEvent.objects.filter(q, tenant=tenant, pk__gt=after)
            if numbered_top is None or after >= numbered_top:
                page = page.filter(seal__isnull=True)
            rows = list(page.order_by("id").values(*columns)[:batch_size])
            if not rows:
                return changed
            after = rows[-1]["id"]
            updates = []
            for row in rows:
                new, kept = _redacted_values(row, pseudonyms)
                if new:
                    updates.append((row["id"], new, kept))
            _redact_rows(table, updates)
            changed += len(updates)
        if on_page is not None and not on_page(after, len(updates)):
            return changed


def _redact_rows(table: str, updates: list[tuple[int, dict, dict]]) -> None:
    """Write one page of redactions. PostgreSQL: one ``UPDATE … FROM unnest(arrays)`` per set
    of fields redacted (a page has one to three such sets), not one UPDATE per event: a forget
    of a subject with 10k memories redacts ~20k events, and their round trips were ~80% of
    its time (10.4 of 12.9 s, bench_forget). SQLite: one UPDATE per event."""
    with connection.cursor() as cursor:
        if connection.vendor != "postgresql":
            for event_id, new, kept in updates:
                # bandit B608 (marked): column names come from chain.COMMITTED_FIELDS, values are parameters.
                sets = ", ".join(f"{name} = %s" for name in new)
                cursor.execute(
                    f"UPDATE {table} SET {sets}, redacted = %s WHERE id = %s",  # nosec B608
                    [*new.values(), json.dumps(kept, sort_keys=True), event_id],
                )
            return
        shapes: dict[tuple[str, ...], list[tuple[int, dict, dict]]] = {}
        for update in updates:
            shapes.setdefault(tuple(update[1]), []).append(update)
        for names, group in shapes.items():
            # client_ip is always cleared (NULL), the other fields get their pseudonyms.
            carried = [name for name in names if name != "client_ip"]
            sets = [f"{name} = v.{name}" for name in carried] + ["client_ip = NULL"] * ("client_ip" in names)
            # One array per column, not one placeholder per value: psycopg's conversion of a
            # query of 6,000 placeholders took as long as the UPDATE itself.
            arrays = ["%s::bigint[]", *["%s::text[]"] * len(carried), "%s::jsonb[]"]
            params = [
                [event_id for event_id, _, _ in group],
                *([new[name] for _, new, _ in group] for name in carried),
                [json.dumps(kept, sort_keys=True) for _, _, kept in group],
            ]
            # bandit B608 (marked): column names come from chain.COMMITTED_FIELDS, values are parameters.
            cursor.execute(
                f"UPDATE {table} AS e SET {', '.join([*sets, 'redacted = v.redacted'])} "  # nosec B608
                f"FROM unnest({', '.join(arrays)}) AS v(id, {', '.join([*carried, 'redacted'])}) "
                "WHERE e.id = v.id",
                params,
            )


# --- retention purge ------------------------------------------------------------------------


def audit_retention_cutoff(tenant: Tenant | None, now=None):
    days = (tenant.audit_retention_days if tenant else None) or settings.ZEROMEM_AUDIT_RETENTION_DAYS
    try:
        return (now or timezone.now()) - timedelta(days=days)
    except OverflowError:
        # Kept longer than dates reach (the column takes any positive number): nothing of this
        # chain is old enough — and the daily purge goes on to the other tenants.
        return datetime.min.replace(tzinfo=UTC)


def audit_purge(*, tenant: Tenant | None, now=None) -> dict:
    """Delete the tenant's audit events older than its retention period (``tenant=None``: the
    tenant-less events, such as failed authentications, after ``ZEROMEM_AUDIT_RETENTION_DAYS``),
    in whole sealed batches (a seal whose newest event is still inside the period is kept entirely), so the
    remaining chain still verifies from the kept seal rows.

    Order: seal the tail; write a purge checkpoint naming the last seal to delete (the
    record that excuses the missing events, committed before anything is deleted); delete
    seal by seal, each in its own transaction that also marks the seal purged; finally one
    ``audit.purge`` event with the count. A purge killed halfway leaves a checkpoint and
    some purged seals; running it again finishes the job.
    """
    now = now or timezone.now()
    tenant_id = tenant.pk if tenant is not None else None
    cutoff = audit_retention_cutoff(tenant, now)
    audit_seal(tenant_id=tenant_id)
    through = 0
    for seal in AuditSeal.objects.filter(_tenant_q(tenant_id), purged_at__isnull=True).order_by("seq"):
        newest = (
            AuditEvent.objects.filter(_tenant_q(tenant_id), seal_events_q(seal))
            .order_by("-occurred_at")
            .values_list("occurred_at", flat=True)
            .first()
        )
        if newest is not None and newest >= cutoff:
            break
        through = seal.seq
    if not through:
        return {"events": 0, "seals": 0, "through": None}
    with transaction.atomic():
        _lock_chain(tenant_id)
        _checkpoint(tenant_id=tenant_id, reason=AuditCheckpoint.Reason.PURGE, purged_through=through)
    deleted = 0
    seals = 0
    events_table = AuditEvent._meta.db_table
    seals_table = AuditSeal._meta.db_table
    # (tenant-less events: "tenant_id IS NULL", since "= NULL" matches nothing)
    owner, owner_params = ("tenant_id IS NULL", []) if tenant_id is None else ("tenant_id = %s", [tenant_id])
    expired = AuditSeal.objects.filter(_tenant_q(tenant_id), purged_at__isnull=True, seq__lte=through)
    for seal in expired.order_by("seq"):
        # A range seal's events: its id range with no seal number; an older seal's: its number.
        member, member_params = ("seal IS NULL", []) if seal.by_range else ("seal = %s", [seal.seq])
        # bandit B608 (marked): the table names are the models' own; values are %s parameters.
        with _maintenance("purge"), connection.cursor() as cursor:
            cursor.execute(  # nosec B608
                f"DELETE FROM {events_table} WHERE {owner} AND {member} AND id BETWEEN %s AND %s",  # nosec B608
                [*owner_params, *member_params, seal.first_event_id, seal.last_event_id],
            )
            deleted += cursor.rowcount
            cursor.execute(f"UPDATE {seals_table} SET purged_at = %s WHERE id = %s", [now, seal.pk])  # nosec B608
        seals += 1
    with audited_operation(tenant=tenant, actor=Actor.system(job=SYSTEM_AUDIT_JOB), action="audit.purge") as op:
        op.record(count=deleted, detail={"through_seal": through, "seals": seals, "cutoff": cutoff.isoformat()})
    return {"events": deleted, "seals": seals, "through": through}


def audit_purge_all(*, now=None) -> dict:
    """The scheduled retention purge: first whole months whose every chain's retention has
    passed (PostgreSQL, :func:`audit_partitions_drop`), then every tenant's remaining expired
    seals row by row (tenants with a shorter retention than the longest one in a month), then
    the tenant-less events (failed authentications and the like). Returns {slug: events
    deleted by the row purge}, the tenant-less under ""."""
    audit_partitions_drop(now=now)
    done = {t.slug: audit_purge(tenant=t, now=now)["events"] for t in get_tenant_model().objects.order_by("pk")}
    done[""] = audit_purge(tenant=None, now=now)["events"]
    return done


def _retention_cutoff_of(tenant_id: int | None, tenants: dict, now):
    # tenant_id None: the chain of failed authentications that matched no tenant, whose
    # retention is the default.
    return audit_retention_cutoff(tenants[tenant_id] if tenant_id is not None else None, now)


def _partition_plan(part: partitions.Partition, now, tenants: dict) -> dict | None:
    """What dropping ``part`` purges, per chain: {tenant id: (first seq, last seq, first id,
    last id, events)}; None while some chain's retention still covers an event that would go."""
    # bandit B608 (marked): table names come from pg_class (audit/partitions.py); values are parameters.
    table = AuditEvent._meta.db_table
    present = []
    with connection.cursor() as cursor:
        for tenant_id in [None, *tenants]:
            where = "tenant_id IS NULL" if tenant_id is None else "tenant_id = %s"
            cursor.execute(
                f"SELECT EXISTS (SELECT 1 FROM {part.name} WHERE {where})",  # nosec B608
                [] if tenant_id is None else [tenant_id],
            )
            if cursor.fetchone()[0]:
                present.append(tenant_id)
    if any(part.upper > _retention_cutoff_of(t, tenants, now) for t in present):
        return None
    plan = {}
    horizon = sealing_horizon()
    for tenant_id in present:
        audit_seal(tenant_id=tenant_id, horizon=horizon)
        where = "tenant_id IS NULL" if tenant_id is None else "tenant_id = %s"
        args = [] if tenant_id is None else [tenant_id]
        covered = range_head(tenant_id)
        with connection.cursor() as cursor:
            # The month's unsealed events; the highest seal number (older seals) and the
            # highest id a range seal holds (whose seal is the last to go with the month).
            cursor.execute(
                f"SELECT count(*) FILTER (WHERE seal IS NULL AND id > %s), max(seal), "  # nosec B608
                f"max(id) FILTER (WHERE seal IS NULL) FROM {part.name} WHERE {where}",  # nosec B608
                [covered, *args],
            )
            unsealed, last_seq, last_ranged = cursor.fetchone()
        if unsealed:
            return None  # written after the sealing just now: next run
        if last_ranged is not None:
            holder = (
                AuditSeal.objects.filter(_tenant_q(tenant_id), by_range=True, last_event_id__gte=last_ranged)
                .order_by("last_event_id")
                .values_list("seq", flat=True)
                .first()
            )
            last_seq = max(last_seq or 0, holder or 0)
        seals = AuditSeal.objects.filter(_tenant_q(tenant_id), purged_at__isnull=True, seq__lte=last_seq or 0)
        bounds = seals.order_by("seq").values_list("seq", "first_event_id", "last_event_id", "count", "by_range")
        bounds = list(bounds)
        if not bounds:
            continue
        first_seq, first_id = bounds[0][0], min(b[1] for b in bounds)
        last_id = max(b[2] for b in bounds)
        ranged_last = max((b[2] for b in bounds if b[4]), default=0)
        # Those seals' events outside this month (a seal crossing into the next month) go too:
        # they must be past the chain's retention as well.
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT max(occurred_at) FROM {table} WHERE {where} AND {_PLAN_MEMBERS} "  # nosec B608
                "AND id BETWEEN %s AND %s AND occurred_at >= %s",
                [*args, first_seq, last_seq, ranged_last, first_id, last_id, part.upper],
            )
            (newest,) = cursor.fetchone()
        if newest is not None and newest >= _retention_cutoff_of(tenant_id, tenants, now):
            return None
        plan[tenant_id] = (first_seq, last_seq, first_id, last_id, ranged_last, sum(b[3] for b in bounds))
    return plan


# The events of a plan's seals first_seq..last_seq: older seals' by number, range seals' by id
# (no seal number, at most the last id a range seal of the plan holds: every range seal before
# the plan's is purged, so its events are gone).
_PLAN_MEMBERS = "(seal BETWEEN %s AND %s OR (seal IS NULL AND id <= %s))"


def _has_unsealed(partition: str) -> bool:
    """Whether the partition holds an event no seal holds: per chain, one probe of its tail on
    ``audit_unsealed`` (the partition is locked: nothing arrives meanwhile)."""
    with connection.cursor() as cursor:
        for tenant_id in _chain_ids():
            where = "tenant_id IS NULL" if tenant_id is None else "tenant_id = %s"
            cursor.execute(
                f"SELECT EXISTS (SELECT 1 FROM {partition} WHERE {where} AND seal IS NULL AND id > %s)",  # nosec B608
                [*([] if tenant_id is None else [tenant_id]), range_head(tenant_id)],
            )
            if cursor.fetchone()[0]:
                return True
    return False


def audit_partitions_drop(*, now=None) -> list[str]:
    """Retention by whole months (PostgreSQL, partitioned log): drop the oldest monthly
    partitions (and the legacy one) whose every event is past the retention of its tenant's
    chain. The default partition is never dropped (its rows go through the row purge).

    Per partition, oldest first, stopping at the first that must stay: seal every chain with
    events in it; then in one transaction, per chain, a purge checkpoint naming the last
    seal with events in the month, the DELETE of those seals' few events in other partitions
    (a seal crossing into the next month), the seals marked purged — then ``DROP TABLE`` of
    the partition (``lock_timeout`` 5 s, so a long reader never queues every insert behind
    it; a timeout rolls everything back for the next run). Then one ``audit.purge`` event per
    chain. ``audit_verify`` starts from the checkpoint, as after a row purge.
    Returns the names of the dropped partitions."""
    if not partitions.is_partitioned():
        return []
    now = now or timezone.now()
    tenants = {t.pk: t for t in get_tenant_model().objects.order_by("pk")}
    dropped = []
    for part in partitions.partitions():
        if part.is_default:
            break
        plan = _partition_plan(part, now, tenants)
        if plan is None:
            break
        try:
            if not _drop_partition(part, plan, now):
                break  # an event arrived with a past date since the plan: next run
        except OperationalError as exc:
            # A long reader held the month or the table past the lock_timeout, or a reader
            # that waited for the month held the table (a deadlock PostgreSQL broke): the
            # drop rolled back, and the next run tries again. The row purge still runs.
            if getattr(exc.__cause__, "sqlstate", None) not in _LOCK_FAILURES:
                raise
            _logger.warning("audit partition %s not dropped: %s; the next run tries again", part.name, exc.__cause__)
            break
        dropped.append(part.name)
        for tenant_id, (_f, last_seq, _fi, _li, _rl, events) in plan.items():
            tenant = tenants.get(tenant_id)
            with audited_operation(tenant=tenant, actor=Actor.system(job=SYSTEM_AUDIT_JOB), action="audit.purge") as op:
                op.record(count=events, detail={"through_seal": last_seq, "partition": part.name})
    return dropped


# lock_not_available (lock_timeout), deadlock_detected
_LOCK_FAILURES = ("55P03", "40P01")


def _drop_partition(part: partitions.Partition, plan: dict, now) -> bool:
    """One transaction: the plan's checkpoints, its events outside the month, its seals
    marked purged, and ``DROP TABLE``. False (nothing done) if the month got an unsealed event."""
    table = AuditEvent._meta.db_table
    seals_table = AuditSeal._meta.db_table
    with _maintenance("purge"), connection.cursor() as cursor:
        # Every lock here waits at most this long: while the month's lock (and then the
        # table's, for the DROP) is awaited, every query of the log (the table's, for every
        # insert) queues behind it, so a long reader must not hold the whole log up.
        cursor.execute("SET LOCAL lock_timeout = '5s'")
        for tenant_id in sorted(plan, key=lambda t: t or 0):
            _lock_chain(tenant_id)
        cursor.execute(f"LOCK TABLE {part.name} IN ACCESS EXCLUSIVE MODE")
        if _has_unsealed(part.name):
            return False
        for tenant_id, (first_seq, last_seq, first_id, last_id, ranged_last, _n) in plan.items():
            where = "tenant_id IS NULL" if tenant_id is None else "tenant_id = %s"
            args = [] if tenant_id is None else [tenant_id]
            _checkpoint(tenant_id=tenant_id, reason=AuditCheckpoint.Reason.PURGE, purged_through=last_seq)
            lower = part.lower or datetime.min.replace(tzinfo=UTC)
            cursor.execute(
                f"DELETE FROM {table} WHERE {where} AND {_PLAN_MEMBERS} "  # nosec B608
                "AND id BETWEEN %s AND %s AND (occurred_at < %s OR occurred_at >= %s)",
                [*args, first_seq, last_seq, ranged_last, first_id, last_id, lower, part.upper],
            )
            cursor.execute(
                f"UPDATE {seals_table} SET purged_at = %s WHERE {where} "  # nosec B608
                "AND purged_at IS NULL AND seq BETWEEN %s AND %s",
                [now, *args, first_seq, last_seq],
            )
        # Deferred FK checks queued on the partition (events inserted in an enclosing
        # transaction) must run first: PostgreSQL refuses to drop a table with pending ones.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cursor.execute(f"DROP TABLE {part.name}")
    return True


# --- reading the log (compliance review) ----------------------------------------------------


def _reader_prefixes(actor: Actor, key_prefix: str | None) -> list[str] | None:
    # A key limited to some prefixes sees only events about keys under them.
    return actor.prefix_filters(key_prefix or "") if actor.allowed_prefixes else None


def audit_event_list(
    *, tenant: Tenant, actor: Actor, filters: AuditFilters, limit=None, cursor=None
) -> tuple[list[AuditEvent], str | None]:
    """Newest first, keyset-paginated on the id. Scope ``audit:read``; the reading is itself
    an ``audit.list`` event. A page reads at most ``selectors.LIST_SCAN_MAX`` events of the
    tenant, whatever the filters (:func:`audit.selectors.list_window_floor`): fewer matches
    than ``limit`` — none even — come with a ``next_cursor`` while older events remain; the
    windows start at ``until`` and end at ``since`` (:func:`audit.selectors.list_id_bounds`).
    A subject or key prefix naming at most that many events is read by its index instead
    (:func:`audit.selectors.few_by_index`: one more index read of at most LIST_SCAN_MAX).
    Cost: up to three index reads of at most LIST_SCAN_MAX entries each (a subject or key
    prefix's probe, the window's floor, the page), two one-row index reads with a time range,
    one read of the tenant's older seals, limit + 1 rows, one INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="audit.list", target=filters.key_prefix or "") as op:
        require_scope(actor, Scope.AUDIT_READ)
        limit = validation.limit(limit, default=50)
        before = validation.decode_id_cursor(cursor)
        qs = audit_events(tenant=tenant, filters=filters, prefixes=_reader_prefixes(actor, filters.key_prefix))
        with replica_reads():  # the review of the log may lag it by the replica's delay
            few = few_by_index(tenant=tenant, filters=filters)
            bounds = list_page_bounds(tenant=tenant, filters=filters, before=before, few=few)
            rows = list(bounds.narrow(qs)[: limit + 1])
            numbers = seal_numbers(tenant.pk, [r.pk for r in rows if r.seal is None])
        for row in rows:
            if row.seal is None:
                row.seal = numbers.get(row.pk)  # shown, never saved (events are append-only)
        if len(rows) > limit:
            next_cursor = validation.encode_id_cursor(rows[limit - 1].pk)
        else:  # the window read, older events remain: the next page reads below it
            floor = bounds.floor
            next_cursor = validation.encode_id_cursor(floor) if floor is not None else None
        rows = rows[:limit]
        op.record(
            subject=filters.subject or "", actor_filter=filters.actor or "", count=len(rows), detail=filters.as_detail()
        )
        return rows, next_cursor


def audit_list_record(*, tenant: Tenant, actor: Actor, filters: dict[str, str], count: int) -> None:
    """Record a reading of the log that a page made itself (the admin's list: ``audit.list``
    with what the filters were as given and how many rows of this tenant it showed). As
    ``AuditFilters.as_detail``: key prefix, subject and actor in their redactable fields."""
    with audited_operation(tenant=tenant, actor=actor, action="audit.list", target=filters.get("key_prefix", "")) as op:
        op.record(
            subject=filters.get("subject", ""),
            actor_filter=filters.get("actor", ""),
            count=count,
            detail={k: v for k, v in filters.items() if k not in COLUMN_FILTERS},
        )


def audit_event_view(*, tenant: Tenant, actor: Actor, event_id: Any) -> AuditEvent:
    """One event of the tenant's log, opened by a reviewer (the admin's page of an event and
    its history): scope ``audit:read``, recorded as ``audit.view`` with the event's id in
    ``detail`` — its uid, the id the review API and exports show (its row id comes from a
    sequence every tenant's events share) — and its target and subject in the reading's own
    (redactable) fields, as the list records its filters. :class:`NotFound` for another
    tenant's event or none."""
    with audited_operation(tenant=tenant, actor=actor, action="audit.view") as op:
        require_scope(actor, Scope.AUDIT_READ)
        pk = validation.ascii_int(event_id) if isinstance(event_id, str) else event_id
        valid = isinstance(pk, int) and not isinstance(pk, bool) and 1 <= pk <= 2**63 - 1
        event = AuditEvent.objects.for_tenant(tenant).filter(pk=pk).first() if valid else None
        if event is None:
            op.record(outcome=AuditEvent.Outcome.NOT_FOUND, detail={"event": pk if valid else None})
            raise NotFound("no such audit event", field="event_id")
        op.record(target=event.target, subject=event.subject, count=1, detail={"event": str(event.uid)})
        return event


def audit_export_start(*, tenant: Tenant, actor: Actor, filters: AuditFilters, fmt: str):
    """Check the reader may export, record the ``audit.export`` event (committed before the
    first row is sent: an export the client abandons halfway was still an export) and
    return (the queryset to stream, that event's id for :func:`audit_export_end`). Scope
    ``audit:read``."""
    with audited_operation(tenant=tenant, actor=actor, action="audit.export", target=filters.key_prefix or "") as op:
        require_scope(actor, Scope.AUDIT_READ)
        if fmt not in EXPORT_FORMATS:
            raise InvalidInput(f"must be one of {', '.join(EXPORT_FORMATS)}", field="format")
        op.record(
            subject=filters.subject or "",
            actor_filter=filters.actor or "",
            detail={**filters.as_detail(), "format": fmt},
        )
    queryset = audit_events(tenant=tenant, filters=filters, prefixes=_reader_prefixes(actor, filters.key_prefix))
    return queryset, op.event_id


def audit_export_end(*, tenant: Tenant, actor: Actor, export: int | None, rows: int, complete: bool) -> int:
    """Record the end of the export whose ``audit.export`` event is ``export``: one
    ``audit.export_end`` event, ``count`` the rows it delivered, ``detail`` ``{"export",
    "complete"}`` (False: cut short — the client went away, or the reader's key was withdrawn).
    Events are append-only, so the start cannot be given its count; this one names no filter
    (the start holds them, where a forget redacts them). The start is named by its ``uid``, as
    the review shows events (an event's row id is a sequence every tenant moves). A SELECT of
    that uid and one INSERT."""
    started = None
    if export is not None:
        started = AuditEvent.objects.filter(tenant_id=tenant.pk, pk=export).values_list("uid", flat=True).first()
    return audit_record(
        tenant=tenant,
        actor=actor,
        action="audit.export_end",
        outcome=AuditEvent.Outcome.OK,
        count=rows,
        detail={"export": None if started is None else str(started), "complete": complete},
    )


EXPORT_FORMATS = ("csv", "jsonl")
