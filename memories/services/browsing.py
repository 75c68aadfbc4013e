"""Staff browsing the admin: what they looked through is audited like a read, though no one
memory is opened. A search over value words, the key tree and a tenant's dashboard each show
data (keys, words of values, counts) without a per-memory read event; these record who
looked, in which tenant, at which prefix. The search words themselves are not kept (they may
name an end user: only their length), so a forget has nothing to erase in them."""

from __future__ import annotations

from typing import Any

from audit.services import audited_operation
from memories.models import Tenant
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor, require_scope
from zeromem.kernel.errors import InvalidInput
from zeromem.kernel.scopes import Scope


def memories_browse(
    *, tenant: Tenant, actor: Actor, search: Any = "", prefix: Any = "", subject: Any = "", tag: Any = ""
) -> None:
    """Audit a staff member's search over keys and value words (``search``), walk of the key
    tree (``prefix``), or filter by an end user (``subject``) or a tag (``tag``) in
    ``tenant``'s memory list, as ``memory.browse`` (target: the prefix; subject: the end user
    filtered on, in the event's own redactable field; detail: the search's and the tag's
    lengths, never their words). Needs ``memory:read``. Cost: the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="memory.browse") as op:
        require_scope(actor, Scope.MEMORY_READ)
        for name, value in (("search", search), ("prefix", prefix), ("subject", subject), ("tag", tag)):
            if not isinstance(value, str):
                raise InvalidInput("must be text", field=name)
        detail = {f"{name}_chars": len(value) for name, value in (("search", search), ("tag", tag)) if value}
        # The prefix as asked (a made-up one matches nothing), cut to a key's length.
        op.record(
            target=prefix[: validation.KEY_MAX_LEN],
            subject=subject[: validation.SUBJECT_MAX_LEN],
            detail=detail or None,
        )


# The filters of a plain page of the memory list the event keeps (their choices are fixed words).
LISTED_FILTERS = ("state", "category", "expiry")


def memories_listed(*, tenant: Tenant, actor: Actor, count: int, filters: Any = None) -> None:
    """Audit a page of the admin memory list with no search, key-tree walk, end user or tag
    (those are ``memory.browse``) that showed ``count`` of ``tenant``'s memories (their keys,
    subjects, categories, versions and dates), as ``memory.list`` — what the REST list of the
    same rows records; ``filters``: the page's state, category and expiry filters, kept in
    ``detail`` (each cut to 32 characters). Needs ``memory:read``. Cost: the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="memory.list") as op:
        require_scope(actor, Scope.MEMORY_READ)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InvalidInput("must be a whole number of at least 0", field="count")
        given = filters if isinstance(filters, dict) else {}
        detail = {name: given[name][:32] for name in LISTED_FILTERS if isinstance(given.get(name), str) and given[name]}
        op.record(count=count, detail=detail or None)


def dashboard_view(*, tenant: Tenant, actor: Actor) -> None:
    """Audit a staff member opening ``tenant``'s dashboard (counts, top namespaces and
    keys), as ``tenant.dashboard``. Cost: the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="tenant.dashboard", target=tenant.slug) as op:
        op.record()
