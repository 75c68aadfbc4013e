"""Who is acting, and what they may touch.

An :class:`Actor` is built once per request (from the API key, the staff user, the portal
link or a job) and handed to every service; the services call the checks below before
touching data, and audit denials.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from django.conf import settings

from zeromem.kernel import subjectkeys
from zeromem.kernel.errors import Forbidden, Unauthenticated
from zeromem.kernel.keyprefix import exact
from zeromem.kernel.outcomes import ActorKind
from zeromem.kernel.scopes import ALL_SCOPES, ROLE_SCOPES


@dataclass(frozen=True)
class Actor:
    kind: str  # an ActorKind value
    id: str = ""
    label: str = ""
    scopes: frozenset[str] = field(default_factory=frozenset)
    # Key prefixes this actor may touch; empty means every key of the tenant.
    allowed_prefixes: tuple[str, ...] = ()
    surface: str = ""
    request_id: str = ""
    client_ip: str | None = None

    @classmethod
    def system(cls, *, job: str = "", scopes: Iterable[str] | None = None) -> Actor:
        return cls(kind=ActorKind.SYSTEM, id=job, label="system", scopes=frozenset(scopes or ALL_SCOPES), surface="job")

    def with_surface(self, surface: str) -> Actor:
        return Actor(**{**self.__dict__, "surface": surface})

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes

    def may_touch(self, key: str) -> bool:
        return not self.allowed_prefixes or any(allowlist_entry_covers(p, key) for p in self.allowed_prefixes)

    def may_touch_prefix(self, prefix: str) -> bool:
        """Every key under ``prefix`` is inside the allowlist."""
        return not self.allowed_prefixes or any(prefix.startswith(p) for p in self._entries())

    def _entries(self) -> list[str]:
        # As prefixes: an entry stored before entries had to end in ':' names its segment.
        return [p if p.endswith(":") else p + ":" for p in self.allowed_prefixes]

    def prefix_filters(self, prefix: str) -> list[str]:
        """The key prefixes a prefix query must be restricted to (one SQL OR each). A bare
        entry (``user:u1``) covers its own key too: that key, when the query reaches it, is
        one more filter naming it exactly (:func:`zeromem.kernel.keyprefix.exact`)."""
        if not self.allowed_prefixes:
            return [prefix]
        narrowed = [exact(p) for p in self.allowed_prefixes if not p.endswith(":") and p.startswith(prefix)]
        for allowed in self._entries():
            if allowed.startswith(prefix):
                narrowed.append(allowed)  # query is broader than the allowance
            elif prefix.startswith(allowed):
                narrowed.append(prefix)  # query lies inside the allowance
        return sorted(set(narrowed))


def allowlist_entry_covers(entry: str, key: str) -> bool:
    """Whether the allowlist ``entry`` covers ``key`` (or a prefix), on segment boundaries:
    ``user:u1:`` covers ``user:u1:pref`` and never ``user:u10:secret``. Entries are stored
    ending in ``:`` (:func:`zeromem.kernel.validation.allowlist`); one stored before that
    rule covers exactly its own segment path, never a neighbour sharing its first letters."""
    if entry.endswith(":"):
        return key.startswith(entry)
    return key == entry or key.startswith(entry + ":")


def require_scope(actor: Actor, scope: str) -> None:
    if not actor.has_scope(scope):
        raise Forbidden(
            code="missing_scope", message=f"this API key lacks the '{scope}' scope", field=None, scope=scope
        )


def require_key_allowed(actor: Actor, key: str) -> None:
    if not actor.may_touch(key):
        raise Forbidden(
            code="key_not_allowed",
            message="this API key may not touch keys outside its allowed prefixes",
            field="key",
        )


def require_subject_allowed(actor: Actor, *, key: str, subject: str | None) -> None:
    """A key limited to some prefixes may name as a memory's ``subject`` (whose portal page
    and forget requests then show it) only an end user inside its reach: the one its key
    names (``user:<id>:…``, ``lg:users:<id>:…``) or one whose namespace (``user:<subject>:``,
    ``lg:users:<subject>:``, …) its allowlist covers (zeromem.kernel.subjectkeys). Otherwise
    ``agent:bot1:`` could put text on anyone's portal page."""
    if not actor.allowed_prefixes or not subject:
        return
    if subjectkeys.subject_of_key(key) == subject:
        return
    if any(actor.may_touch_prefix(prefix) for prefix in subjectkeys.subject_namespaces(subject)):
        return
    raise Forbidden(
        code="subject_not_allowed",
        message="this API key may name as subject only end users inside its allowed prefixes",
        field="subject",
    )


# --- end users (the portal) -------------------------------------------------------------------

_END_USER_ID_MAX = 64  # AuditEvent.actor_id
_DIGEST = "hmac:"


def end_user_actor_id(subject: str) -> str:
    """The ``Actor.id`` of the end user ``subject``: the subject itself, or for a subject
    longer than the audit log's actor column, a keyed digest of it (HMAC with the audit
    key: an unkeyed hash could be recomputed by anyone who knows the subject). A subject
    spelled like a digest (``hmac:…``) is digested too, or it would be the same end user as
    the subject it spells. The audit redaction of a forgotten subject finds their events by
    this id too."""
    if len(subject) <= _END_USER_ID_MAX and not subject.startswith(_DIGEST):
        return subject
    digest = hmac.new(settings.ZEROMEM_AUDIT_KEY.encode(), b"end-user:" + subject.encode(), hashlib.sha256)
    return _DIGEST + digest.hexdigest()[: _END_USER_ID_MAX - len(_DIGEST)]


# --- staff (the admin console) ----------------------------------------------------------------


def staff_actor(*, user, role: str, request_id: str = "", client_ip: str | None = None) -> Actor:
    """The Actor of a staff user acting in one tenant with ``role`` (a Membership role; a
    superuser acts as ``admin``). The audit log names the user by pk and username."""
    return Actor(
        kind=ActorKind.STAFF,
        id=str(user.pk),
        label=user.get_username(),
        scopes=ROLE_SCOPES.get(role, frozenset()),
        surface="admin",
        request_id=request_id,
        client_ip=client_ip,
    )


# Why an actor's credential no longer holds in a tenant (an API key revoked or expired since
# its request began: "key_revoked", "key_expired"; a staff user's account disabled or their
# role there taken away: "account_disabled", "membership_removed"), else None — registered by
# the app that owns the credential (memories: API keys, memberships), asked by a long answer
# before each further part of it (an export stream's next page). A kind nobody registered
# always holds.
_withdrawn_checks: dict[str, Callable[[Actor, int | None], str | None]] = {}


def register_withdrawn_check(kind: str, check: Callable[[Actor, int | None], str | None]) -> None:
    _withdrawn_checks[kind] = check


def require_still_held(actor: Actor, tenant_id: int | None = None) -> None:
    """:class:`Unauthenticated` (its code the reason) when ``actor``'s credential was withdrawn
    since it authenticated (a staff user's: in ``tenant_id``). Cost: one primary-key SELECT
    for an API key, two small ones for a staff user, nothing otherwise."""
    check = _withdrawn_checks.get(actor.kind)
    code = check(actor, tenant_id) if check is not None else None
    if code is not None:
        raise Unauthenticated("this credential was withdrawn since the request began", code=code)
