"""What ZeroMem keeps about one end user (a *subject*), as that user may see and forget it.

The end-user portal (``portal/``) calls these with an ``end_user`` actor built from a signed
link; an API key or staff actor may call them too. An end-user actor may only ever name
its own subject (:func:`end_user_actor_id`), checked here, so no surface can widen it:

* :func:`subject_memories` — the subject's live memories (scope ``memory:read``);
* :func:`subject_forget` — forget one of them, or all of them (scope ``forget:create``),
  through :func:`memories.services.forget.forget_request_create`;
* :func:`subject_forget_requests` / :func:`subject_forget_request_get` — the requests about
  the subject (filed for the subject, or filed by the end user), with progress and receipt.
"""

from __future__ import annotations

import json
from typing import Any

from django.db.models import Q

from audit.services import audited_operation
from memories import selectors
from memories.models import ForgetRequest, Memory, Tenant
from memories.services.forget import forget_request_create, is_about, subject_q
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor, end_user_actor_id, require_scope
from zeromem.kernel.errors import Forbidden, InvalidInput, NotFound
from zeromem.kernel.outcomes import ActorKind, Outcome
from zeromem.kernel.scopes import Scope

END_USER = ActorKind.END_USER
# A subject's page lists at most this many memories, and stops before the values it shows
# pass SUBJECT_PAGE_CHARS (serialized; at least one memory a page, a value being at most the
# tenant's value cap): the next page starts where it stopped (``start``), so every memory
# can be seen. One page of 500 values of 250 KB was 125 MB of HTML, rendered in 8.3 s.
SUBJECT_MEMORIES_PAGE = 50
SUBJECT_PAGE_CHARS = 1_000_000
SUBJECT_START_MAX = 2**31 - 1
SUBJECT_REQUESTS_MAX = 20
PORTAL_REASON = "asked by the end user in the portal"


def _validated_subject(raw: Any) -> str:
    subject = validation.short_text(raw, field="subject", max_len=validation.SUBJECT_MAX_LEN)
    if not subject:
        raise InvalidInput("must not be empty", field="subject")
    return subject


def _require_own_subject(actor: Actor, subject: str) -> None:
    if actor.kind == END_USER and actor.id != end_user_actor_id(subject):
        raise Forbidden(code="not_your_subject", message="an end user sees only their own memories", field="subject")


def subject_memories(*, tenant: Tenant, actor: Actor, subject: Any, start: Any = None) -> tuple[list[Memory], int]:
    """The subject's live memories (not trashed, not expired), by key, from the ``start``-th
    (0-based; an ASCII decimal string too, else :class:`InvalidInput` naming ``start``): at
    most ``SUBJECT_MEMORIES_PAGE`` of them, cut short before their values pass
    ``SUBJECT_PAGE_CHARS`` (never below one); returns (memories, how many there are). The
    next page starts at ``start + len(memories)``. Restricted to the actor's key allowlist.
    Cost: one COUNT and one SELECT (OFFSET ``start``) on the (tenant, subject) index, and the
    audit INSERT (``subject.memories``, the subject, the count and the page; no values)."""
    with audited_operation(tenant=tenant, actor=actor, action="subject.memories") as op:
        require_scope(actor, Scope.MEMORY_READ)
        subject = _validated_subject(subject)
        start = validation.bounded_int(start, field="start", default=0, low=0, high=SUBJECT_START_MAX)
        _require_own_subject(actor, subject)
        qs = selectors.memories_live(
            tenant=tenant, prefixes=actor.prefix_filters("") if actor.allowed_prefixes else None
        ).filter(subject_q(subject))  # theirs, and their namespace's that name no one (forget.subject_q)
        total = qs.count()
        rows = list(qs.order_by("key")[start : start + SUBJECT_MEMORIES_PAGE]) if start < total else []
        chars = 0
        for shown, memory in enumerate(rows):
            chars += _value_chars(memory.value)
            if shown and chars > SUBJECT_PAGE_CHARS:
                del rows[shown:]
                break
        op.record(subject=subject, count=total, detail={"start": start, "shown": len(rows)})
        return rows, total


def _value_chars(value: Any) -> int:
    # What a value weighs on a page: its JSON's length (an erased one's text).
    return len(json.dumps(value, ensure_ascii=False, default=str))


def subject_forget(*, tenant: Tenant, actor: Actor, subject: Any, key: Any = None) -> ForgetRequest:
    """Forget the live memory ``key`` of the subject, or (``key`` None) everything kept about
    the subject: files a forget request (which runs in the background). Raises
    :class:`NotFound` when ``key`` is no live memory of this subject in this tenant — another
    subject's or another tenant's key answers exactly like a missing one.

    While a request of this actor for the same thing is pending (received or running), that
    request is the answer and nothing new is filed: a replayed portal session cannot flood
    the tenant's forget queue and the workers every tenant shares (``forget.create``, detail
    ``pending``). Looked for by :func:`forget_request_create` under its lock, so a double
    submit files one request.

    Cost: one index lookup for ``key``, then :func:`forget_request_create` (with one lookup
    of the tenant's pending requests)."""
    # The checks run (and a refusal is audited) here; forget_request_create runs after them,
    # in its own operation and transaction, and records the request it files.
    with audited_operation(tenant=tenant, actor=actor, action="forget.create") as op:
        require_scope(actor, Scope.FORGET_CREATE)
        subject = _validated_subject(subject)
        _require_own_subject(actor, subject)
        if key is not None:
            key = validation.key(key)
            memory = selectors.memory_get_live(tenant=tenant, key=key)
            mine = memory is not None and is_about(key=key, memory_subject=memory.subject, subject=subject)
            if not mine or not actor.may_touch(key):
                op.record(outcome=Outcome.NOT_FOUND, subject=subject, detail={"by": "keys"})
                raise NotFound("no such memory of this subject", field="key")
    mine = subject if actor.kind == END_USER else ""
    target = {"subject": subject} if key is None else {"keys": [key]}
    return forget_request_create(
        tenant=tenant, actor=actor, reason=PORTAL_REASON, end_user_subject=mine, reuse_pending=True, **target
    )


def _about_subject(*, tenant: Tenant, actor: Actor, subject: str):
    mine = Q(subject=subject) | Q(requested_by_kind=END_USER, requested_by=end_user_actor_id(subject))
    return ForgetRequest.objects.filter(tenant=tenant).filter(mine)


def subject_forget_requests(*, tenant: Tenant, actor: Actor, subject: Any) -> list[ForgetRequest]:
    """The newest ``SUBJECT_REQUESTS_MAX`` forget requests about the subject: filed for the
    whole subject (by anyone), or filed by this end user (e.g. for one memory). Cost: one
    SELECT of the tenant's requests and the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="forget.list") as op:
        require_scope(actor, Scope.FORGET_CREATE)
        subject = _validated_subject(subject)
        _require_own_subject(actor, subject)
        rows = list(_about_subject(tenant=tenant, actor=actor, subject=subject).order_by("-pk")[:SUBJECT_REQUESTS_MAX])
        op.record(subject=subject, count=len(rows))
        return rows


def subject_forget_request_get(*, tenant: Tenant, actor: Actor, subject: Any, request_id: Any) -> ForgetRequest:
    """One request about the subject (as :func:`subject_forget_requests` sees them);
    :class:`NotFound` otherwise — also for another subject's or tenant's request, and for an
    old numeric id (``request_id`` is the request's uid). Cost: one SELECT by the unique
    ``forget_uid`` index and the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="forget.read") as op:
        require_scope(actor, Scope.FORGET_CREATE)
        subject = _validated_subject(subject)
        _require_own_subject(actor, subject)
        uid = validation.public_uid(request_id)
        request = (
            _about_subject(tenant=tenant, actor=actor, subject=subject).filter(uid=uid).first()
            if uid is not None
            else None
        )
        detail = {"forget_request": str(uid) if uid is not None else None}
        if request is None:
            op.record(outcome=Outcome.NOT_FOUND, subject=subject, detail=detail)
            raise NotFound("no such forget request", field="request_id")
        op.record(subject=subject, detail=detail)
        return request
