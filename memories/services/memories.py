"""Memory operations: the one place that decides what each of them means.

Every surface — tool calls, REST, admin, portal, jobs — calls these functions. Each one
validates its input, checks the actor's scope and key allowlist, does its work and writes
exactly one audit event, all in one transaction (``audit.services.audited_operation``). A
refused call (bad input, missing scope, forbidden key) changes nothing and is audited with
outcome ``invalid`` or ``denied``.

Nothing at the key raises :class:`NotFound`, a version that moved :class:`Conflict`: audited
as ``not_found``/``conflict``, answered by the tools as results the model reads.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, router, transaction
from django.db.models import F, Q
from django.db.models.base import ModelState
from django.db.models.expressions import RawSQL
from django.db.models.fields.related_descriptors import ForwardManyToOneDescriptor
from django.utils import timezone

from audit.services import AuditedOperation, audited_operation
from memories import keyring, search, selectors
from memories.models import Memory, MemoryVersion, Tenant
from memories.search import embeddings
from memories.services import last_seen, retention, sensitivity
from memories.services.search_budget import search_budget
from zeromem.kernel import hotsql, validation
from zeromem.kernel.actors import Actor, require_key_allowed, require_scope, require_subject_allowed
from zeromem.kernel.crypto import ErasedValue
from zeromem.kernel.errors import Conflict, Erased, InvalidInput, NotFound, PreconditionFailed
from zeromem.kernel.outcomes import Outcome
from zeromem.kernel.scopes import Scope
from zeromem.kernel.subjectkeys import subject_of_key

_UNSET: Any = object()

# Categories inferred from a key's first segment when the caller gives none.
_KNOWN_CATEGORIES = {c.value for c in Memory.Category}


@dataclass
class MemoryResult:
    status: str  # always "ok": a miss raises NotFound, a moved version Conflict
    key: str
    memory: Memory | None = None
    created: bool = False
    cut: ValueSlice | None = None  # a read with max_chars of a value longer than that


@dataclass(frozen=True)
class ValueSlice:
    """Characters ``[offset, offset + max_chars)`` of a value's text, for a value too long to
    answer whole."""

    text: str
    chars: int  # the whole text's length
    next_offset: int | None  # where the rest starts; None: the text ends here


@dataclass
class ListResult:
    keys: list = field(default_factory=list)
    next_cursor: str | None = None


def _infer_subject(key: str) -> str:
    # "user:u10086:pref_lang" (or the LangGraph item "lg:users:u10086:prefs") is about end
    # user u10086: forget requests find it by subject.
    return subject_of_key(key)


def _infer_category(key: str) -> str:
    first = key.split(":", 1)[0]
    return first if first in _KNOWN_CATEGORIES else Memory.Category.NOTE


def _record_version(memory: Memory, op: str, actor: Actor, now) -> None:
    # MemoryVersion(...).save(), its INSERT built once per process (zeromem/kernel/hotsql.py).
    hotsql.insert(
        _new_version(
            memory,
            tenant_id=memory.tenant_id,
            version=memory.version,
            value=memory.value,  # sealed by the field when sensitive, under the memory's subject's key
            sensitive=memory.sensitive,
            op=op,
            actor_kind=actor.kind,
            actor_id=actor.id,
            created_at=now,
            subject=memory.subject,
        )
    )


def _new_version(memory: Memory, **attrs) -> MemoryVersion:
    """``MemoryVersion(memory=memory, **attrs)`` given every field but its id — or, while
    that is only attributes set (:func:`_version_built_directly`), the same instance without
    ``Model.__init__``'s loop over the fields and the relation's router checks (nine tenths of
    building it): its id None, ``memory_id`` the memory's, the memory cached as its
    ``memory``, its state adding to the database the routers give (what ``__init__`` leaves:
    ``tests/test_write_cpu.py``)."""
    if memory._state.db is None or type(memory) is not Memory or not _version_built_directly():
        return MemoryVersion(memory=memory, **attrs)
    new = _new_object(MemoryVersion)
    state = new._state = ModelState()
    new.__dict__.update(id=None, tenant_id=attrs["tenant_id"])
    # What the relation's descriptor does when __init__ sets ``memory`` (the routers asked
    # as it asks them: the replica router notes a write).
    state.db = router.db_for_write(MemoryVersion, instance=memory)
    if not router.allow_relation(memory, new):
        return MemoryVersion(memory=memory, **attrs)  # raises as __init__ does
    new.__dict__.update(memory_id=memory.pk, **attrs)
    state.fields_cache["memory"] = memory
    return new


_new_object = object.__new__


def _version_built_directly() -> bool:
    # Its ``__init__`` only sets attributes, and ``memory`` is the stock foreign key descriptor.
    return _stock_memory_descriptor() and hotsql.built_without_init(MemoryVersion)


@functools.cache
def _stock_memory_descriptor() -> bool:
    return type(vars(MemoryVersion)["memory"]) is ForwardManyToOneDescriptor


def _seal_history(memory: Memory) -> None:
    # A memory turning sensitive: the versions written while it was plain hold its plain
    # values — sealed now, in the write's transaction, under the key its value goes under.
    # bulk_update bypasses the field's sealing (as QuerySet.update does): sealed here. Cost:
    # one SELECT of its plain versions, one seal each, one UPDATE per 500 of them.
    plain = list(
        MemoryVersion.objects.filter(memory_id=memory.pk, sensitive=False).only("pk", "tenant_id", "value", "subject")
    )
    for version in plain:
        # Under the key of the end user it was written for (encryption.version_subject).
        version.value = keyring.seal_value(
            version.value, tenant_id=memory.tenant_id, subject=version.subject or memory.subject
        )
        version.sensitive = True
    MemoryVersion.objects.bulk_update(plain, ["value", "sensitive"], batch_size=500)


def _turned_sensitive(memory: Memory) -> None:
    """A memory turning sensitive (a write saying so, a rule matching an update, a restored
    sealed version): its embedding was made from the plain value (it leaks its meaning) and
    goes now, not at the embedding job's next run; its plain versions are sealed."""
    embeddings.embeddings_delete(memory_ids=[memory.pk])
    _seal_history(memory)


def memory_write(
    *,
    tenant: Tenant,
    actor: Actor,
    key: Any,
    value: Any,
    ttl_seconds: Any = None,
    tags: Any = None,
    subject: Any = None,
    category: Any = None,
    importance: Any = None,
    source: Any = None,
    clear_ttl: bool = False,
    sensitive: Any = None,
    create_only: bool = False,
) -> MemoryResult:
    """Upsert. Fields left out keep their current value (or a default on create);
    ``create_only`` (REST ``If-None-Match: *``): only when no live memory holds ``key``, else
    :class:`PreconditionFailed` (412), checked under the row lock the upsert takes;
    ``clear_ttl`` with no ``ttl_seconds`` replaces the expiry with the tenant's default TTL
    for ``key`` from now, or none without a rule (a LangGraph put without ttl).
    ``sensitive`` (or a tenant sensitivity rule) stores the value encrypted (README
    "Encryption at rest").

    Cost: SELECT ... FOR UPDATE, one INSERT or UPDATE, a version INSERT, the audit INSERT, in
    one transaction; on PostgreSQL the last three (two for a new memory) are sent as one
    statement. Over a live memory, outside any transaction, on PostgreSQL: two statements,
    no transaction around them (:func:`_write_over_as_read`).
    """
    # Its own transaction, below: a write over a live memory needs none (one statement).
    with audited_operation(tenant=tenant, actor=actor, action="memory.write", target=key, atomic=False) as op:
        key = validation.key(key)
        require_scope(actor, Scope.MEMORY_WRITE)
        require_key_allowed(actor, key)
        validation.value(
            value, max_bytes=tenant.effective_value_max_bytes, max_containers=settings.ZEROMEM_VALUE_MAX_CONTAINERS
        )
        sensitivity.refuse_envelope(value)
        sensitive = sensitivity.flag(sensitive)
        ttl = validation.ttl_seconds(ttl_seconds)
        tags = validation.tags(tags)
        subject = validation.subject(subject)
        require_subject_allowed(actor, key=key, subject=subject)
        category = validation.category(category)
        importance = validation.importance(importance)
        source = validation.short_text(source, field="source", max_len=validation.SOURCE_MAX_LEN)

        now = timezone.now()
        fields = {
            "value": value,
            "updated_at": now,
        }
        for name, given in (
            ("tags", tags),
            ("subject", subject),
            ("category", category),
            ("importance", importance),
            ("source", source),
            ("expires_at", now + ttl if ttl is not None else None),
        ):
            if given is not None:
                fields[name] = given
        if clear_ttl and ttl is None:
            # Not simply None: the tenant's rule for the key is this store's default TTL, or a
            # put (create or replace) would leave the item outliving the rule. One query.
            fields["expires_at"] = retention.default_expiry_for(tenant=tenant, key=key, now=now)

        if (
            not create_only
            and settings.ZEROMEM_WRITE_WITHOUT_LOCK
            and hotsql.alone_in_one_statement(Memory, MemoryVersion)
        ):
            written = _write_over_as_read(
                tenant=tenant, actor=actor, op=op, key=key, fields=fields, now=now, sensitive=sensitive
            )
            if written is not None:
                return written
        hotsql.send_rider()  # the rate counter (a tool write), before the transaction
        # On PostgreSQL the UPDATE (or, for a new memory, the version INSERT) is held and sent
        # with the audit INSERT as one statement (hotsql.holding): one round trip, not three.
        with transaction.atomic(), hotsql.holding():
            memory, created = _upsert(
                tenant=tenant,
                key=key,
                fields=fields,
                now=now,
                source_default=actor.label,
                sensitive=sensitive,
                create_only=create_only,
            )
            _record_version(memory, MemoryVersion.Op.WRITE, actor, now)
            op.record(subject=memory.subject, version=memory.version, detail={"created": created})
            op.write_now()  # the audit INSERT, carrying the held statements
        last_seen.saw(tenant.pk, key, memory)
        return MemoryResult(status="ok", key=key, memory=memory, created=created)


def _write_over_as_read(
    *, tenant: Tenant, actor: Actor, op: AuditedOperation, key: str, fields: dict, now, sensitive: bool | None
) -> MemoryResult | None:
    """A write over a live memory without a transaction or a row lock: the memory read (the
    SELECT a tool read makes; the rate counter rides with it), then its UPDATE — only while
    the row is still as read: same version, same expiry, not trashed, as sealed — its version
    INSERT and its audit INSERT as one statement, all or nothing (zeromem/kernel/hotsql.py). Two round
    trips, not six (BEGIN, the locking SELECT, the statement, COMMIT). None, with nothing
    written, when the write needs :func:`_upsert` under the row lock: no live memory at the
    key (a new one, or an expired one to trash), a value turning sensitive (its history is
    sealed with it), a sensitive value moving to another subject (sealed under that subject's
    key: the subject's lock against a forget's shred, keyring._subject_lock, is held only in a
    transaction), or a row that changed between the read and the UPDATE.

    On the tool-call lane, a key this process saw lately is not read first: its UPDATE, while
    the row is as last seen, goes with the rate counter in one round trip
    (:func:`_write_over_as_seen`)."""
    if hotsql.write_may_pipe():
        seen = last_seen.as_seen(tenant.pk, key)
        if seen is not None:
            written = _write_over_as_seen(
                seen, tenant=tenant, actor=actor, op=op, key=key, fields=fields, now=now, sensitive=sensitive
            )
            if written is not None:
                return written
    current = selectors.memory_get_live(tenant=tenant, key=key)
    if current is None:
        return None
    as_read = _as_read(current)
    read_subject, read_version = current.subject, current.version
    written, turned = _replacing(current, tenant=tenant, key=key, fields=fields, sensitive=sensitive)
    if turned or (current.sensitive and current.subject != read_subject):
        # Sealed under another subject's key: only a transaction holds that subject's lock
        # (keyring._subject_lock) against a forget shredding the key before this lands.
        return None
    sent = _sent_as_read(
        current, written, as_read, op=op, actor=actor, now=now, kind=MemoryVersion.Op.WRITE, detail={"created": False}
    )
    if not sent:
        return None
    last_seen.saw(tenant.pk, key, current, found=read_version)
    return MemoryResult(status="ok", key=key, memory=current, created=False)


def _write_over_as_seen(
    seen: Memory,
    *,
    tenant: Tenant,
    actor: Actor,
    op: AuditedOperation,
    key: str,
    fields: dict,
    now,
    sensitive: bool | None,
) -> MemoryResult | None:
    """:func:`_write_over_as_read` over the row as this process last saw it (``seen``:
    memories.services.last_seen), not read first: its UPDATE, version row and event as one
    statement, sent with the rate counter (zeromem/kernel/hotsql.py "A write and the rate
    counter in one round trip"), writing only while the row holds the version, expiry, subject
    and tags seen, not trashed, plain. The memory returned holds what the write set and what
    the UPDATE checked; its other fields are read from the database if asked for. None, nothing
    written, when it had expired when last seen or its value turns sensitive (nothing sent: the
    caller reads the row), or when the row is not as seen (the call counted; the key turns
    cold)."""
    if seen.expires_at is not None and seen.expires_at <= now:
        return None  # not live: a write over it trashes it and makes a new memory (_upsert)
    as_seen = (*_as_read(seen), ("subject", seen.subject), ("tags", seen.tags))
    written, turned = _replacing(seen, tenant=tenant, key=key, fields=fields, sensitive=sensitive)
    if turned:
        return None
    found = seen.version - 1
    sent = _sent_as_read(
        seen,
        written,
        as_seen,
        op=op,
        actor=actor,
        now=now,
        kind=MemoryVersion.Op.WRITE,
        detail={"created": False},
        piped=True,
    )
    if not sent:
        last_seen.missed(tenant.pk, key)
        return None
    last_seen.saw(tenant.pk, key, seen, found=found)
    return MemoryResult(status="ok", key=key, memory=seen, created=False)


def _as_read(memory: Memory) -> tuple:
    """What a row read without a lock must still hold for an UPDATE over it (hotsql.update
    ``as_read``): its version, its expiry, not trashed, and its sensitive flag — the
    re-encryption job seals a row without a new version, and a write over it must see that, or
    it stores its value in plaintext (sensitivity.decide)."""
    return (
        ("version", memory.version),
        ("expires_at", memory.expires_at),
        ("deleted_at", None),
        ("sensitive", memory.sensitive),
    )


def _sent_as_read(
    memory: Memory,
    names,
    as_read: tuple,
    *,
    op,
    actor: Actor,
    now,
    kind: str,
    detail: dict | None = None,
    piped: bool = False,
) -> bool:
    """``memory``'s UPDATE of ``names`` (and its version) while the row is still ``as_read``,
    its version row and the operation's event, as one statement: True once written; False,
    nothing written and the event taken back, when the row changed since it was read.
    ``piped``: with the rate counter held, in one round trip (hotsql.holding)."""
    try:
        with hotsql.holding(piped=piped):
            hotsql.update(memory, [*names, "version"], as_read=as_read)
            _record_version(memory, kind, actor, now)
            op.record(subject=memory.subject, version=memory.version, detail=detail)
            op.write_now()  # the audit INSERT, carrying the UPDATE and the version row
    except hotsql.RowChanged:
        op.unrecord()
        return False
    return True


def _replacing(
    existing: Memory, *, tenant: Tenant, key: str, fields: dict, sensitive: bool | None
) -> tuple[dict, bool]:
    """``existing`` given ``fields`` as a write replaces them (its sensitivity decided, its
    search fields made, its version the next): the fields it writes, and whether its value
    turns sensitive."""
    tags = fields["tags"] if "tags" in fields else existing.tags
    secret = sensitivity.decide(tenant, key=key, value=fields["value"], given=sensitive, current=existing.sensitive)
    fields = {
        **fields,
        "sensitive": secret,
        # A sensitive value is not indexed: its key and tags are (README "Encryption at rest").
        **search.index_fields(tenant_id=tenant.pk, key=key, value=None if secret else fields["value"], tags=tags),
    }
    turned = secret and not existing.sensitive
    for name, val in fields.items():
        setattr(existing, name, val)
    existing.version += 1
    return fields, turned


def _lock_current_unexpired(*, tenant: Tenant, key: str, now) -> Memory | None:
    """The memory at ``key`` not in the trash, locked; an expired one (not yet purged) still
    holds the key's slot of the one-live-key index: it is trashed here (None returned), so a
    write or a restore over it behaves as over a free key."""
    existing = selectors.memory_lock_current(tenant=tenant, key=key)
    if existing is not None and existing.expires_at is not None and existing.expires_at <= now:
        existing.deleted_at = now
        existing.save(update_fields=["deleted_at"])
        embeddings.embeddings_delete(memory_ids=[existing.pk])
        existing = None
    return existing


def _upsert(
    *,
    tenant: Tenant,
    key: str,
    fields: dict,
    now,
    source_default: str,
    sensitive: bool | None = None,
    create_only: bool = False,
) -> tuple[Memory, bool]:
    # Expired-but-not-yet-purged rows still hold the (tenant, key) slot of the partial
    # unique index; a write over one trashes it first, so it behaves like a fresh key.
    for _ in range(3):
        existing = _lock_current_unexpired(tenant=tenant, key=key, now=now)
        if existing is not None and create_only:
            # (A concurrent create of the key lands here too, on the retry after its insert.)
            raise PreconditionFailed("a memory exists at this key (If-None-Match: *)", field="If-None-Match")
        if existing is not None:
            written, turned = _replacing(existing, tenant=tenant, key=key, fields=fields, sensitive=sensitive)
            if turned:
                _turned_sensitive(existing)  # under the subject its value goes under
            # existing.save(update_fields=...), its UPDATE built once per set of fields.
            hotsql.update(existing, [*written, "version"])
            return existing, False
        tags = fields.get("tags", [])
        secret = sensitivity.decide(tenant, key=key, value=fields["value"], given=sensitive, current=False)
        fields = {
            **fields,
            "sensitive": secret,
            # A sensitive value is not indexed: its key and tags are (README "Encryption at rest").
            **search.index_fields(tenant_id=tenant.pk, key=key, value=None if secret else fields["value"], tags=tags),
        }
        create = {
            "subject": _infer_subject(key),
            "category": _infer_category(key),
            "source": source_default,
            **fields,
        }
        if "expires_at" not in create:
            # No ttl_seconds given: a new memory takes its prefix's default TTL (one query, on create only).
            create["expires_at"] = retention.default_expiry_for(tenant=tenant, key=key, now=now)
        try:
            # A savepoint, so a concurrent insert of the same key only costs a retry.
            with transaction.atomic():
                memory = Memory.objects.create(
                    tenant=tenant, key=key, namespace=validation.namespace_of(key), created_at=now, **create
                )
            return memory, True
        except IntegrityError:
            # Only a concurrent insert of the same key is worth a retry; anything else is a bug.
            if not Memory.objects.for_tenant(tenant).filter(key=key, deleted_at__isnull=True).exists():
                raise
            continue
    raise RuntimeError(f"could not upsert {key!r} after concurrent inserts")


def _etag_pairs(if_match: tuple[int, int] | frozenset) -> frozenset:
    """The (memory id, version) pairs an If-Match names: one pair, or a set of them (a list
    of ETags matches when the current one is any of them)."""
    return if_match if isinstance(if_match, frozenset) else frozenset([tuple(if_match)])


def _etag_condition(if_match: tuple[int, int] | frozenset) -> Q:
    condition = Q(pk__in=[])  # matches nothing: an If-Match naming no ETag we issued
    for pk, version in _etag_pairs(if_match):
        condition |= Q(pk=pk, version=version)
    return condition


def _no_memory() -> NotFound:
    return NotFound("no memory at this key", field="key")


def memory_read(
    *,
    tenant: Tenant,
    actor: Actor,
    key: Any,
    max_chars: Any = None,
    offset: Any = None,
    default: Any = None,
    refresh_ttl: Callable[[Memory], int | None] | None = None,
) -> MemoryResult:
    """The live memory at ``key``; :class:`NotFound` when there is none for this caller.

    With ``max_chars`` or ``offset`` (tool calls), a value whose text (a string as it is, other
    JSON as compact JSON) is longer than ``max_chars`` (default ``READ_DEFAULT_CHARS``), or read
    from an ``offset``, comes back as that slice of its text in ``result.cut``; without them
    (REST, the adapters), whole. ``default`` (a tool read's fallback, echoed by the caller when
    there is no memory) is checked as a written value is (the tenant's value cap, no NUL, 32
    deep), whether or not there is one; the service does not use it.

    Cost: two statements, no transaction around them — one indexed SELECT and the audit
    INSERT (its own transaction). ``refresh_ttl`` (LangGraph's get): the seconds the TTL of
    the memory read starts again for, or None for none; the expiry moves then, and only it
    (:func:`expiry_refresh`: an UPDATE, in one transaction with the event, whose
    ``detail.ttl_refreshed`` says so). The read is counted through its audit event:
    ``access_count``/``last_accessed_at`` are folded in off the request path by
    :func:`memories.services.access.access_counts_fold` (every minute), so they lag the
    reads by up to a minute or so and lose none."""
    refreshing = refresh_ttl is not None
    with audited_operation(tenant=tenant, actor=actor, action="memory.read", target=key, atomic=refreshing) as op:
        key = validation.key(key)
        require_scope(actor, Scope.MEMORY_READ)
        require_key_allowed(actor, key)
        cut = max_chars is not None or offset is not None
        if cut:
            max_chars = validation.read_max_chars(max_chars)
            offset = validation.bounded_int(offset, field="offset", default=0, low=0, high=validation.READ_OFFSET_MAX)
        if default is not None:
            validation.value(
                default,
                max_bytes=tenant.effective_value_max_bytes,
                max_containers=settings.ZEROMEM_VALUE_MAX_CONTAINERS,
                field="default",
            )
        seen = None if refreshing else last_seen.expected(tenant.pk, key)
        if seen is None or not hotsql.event_may_ride():
            memory = selectors.memory_get_live(tenant=tenant, key=key)
        else:
            # Its event goes with the SELECT, written only if the row is as last seen here.
            version, subject = seen
            expect = (("version", version), ("subject", subject), ("sensitive", False))
            with op.riding_read(expect=expect, subject=subject, version=version):
                memory = selectors.memory_get_live(tenant=tenant, key=key)
        if not op.recorded:
            last_seen.saw(tenant.pk, key, memory)
        if memory is None:
            raise _no_memory()
        seconds = refresh_ttl(memory) if refreshing and not isinstance(memory.value, ErasedValue) else None
        refreshed = bool(seconds) and bool(expiry_refresh(tenant=tenant, actor=actor, due=[(memory, seconds)]))
        if not op.recorded:
            detail = {"ttl_refreshed": 1} if refreshed else None
            op.record(subject=memory.subject, version=memory.version, detail=detail)
        if isinstance(memory.value, ErasedValue):
            raise Erased()
        sliced = _value_slice(memory.value, max_chars=max_chars, offset=offset) if cut else None
        return MemoryResult(status="ok", key=key, memory=memory, cut=sliced)


def expiry_refresh(*, tenant: Tenant, actor: Actor, due: list[tuple[Memory, int]]) -> set[int]:
    """Start the TTL of each memory of ``due`` — ``(memory as read, seconds)`` — again: its
    expiry moves to now + seconds, and nothing else (no version, no value written again, not
    ``updated_at``, no event of its own: the read that refreshes says so in its event), as
    LangGraph's own PostgresStore refreshes. Needs ``memory:write`` and each key allowed. Only
    a memory still as it was read is refreshed: live (one deleted or expired since is never
    brought back) and at the version read (one written since keeps its writer's expiry).
    Returns the ids refreshed. Inside the caller's transaction (its rows are locked); cost:
    a locking SELECT and one UPDATE per distinct TTL among them (a LangGraph page: one)."""
    require_scope(actor, Scope.MEMORY_WRITE)
    for memory, _seconds in due:
        require_key_allowed(actor, memory.key)
    now = timezone.now()
    by_ttl: dict[int, list[Memory]] = {}
    for memory, seconds in due:
        by_ttl.setdefault(seconds, []).append(memory)
    refreshed: set[int] = set()
    for seconds, memories in by_ttl.items():
        as_read = Q(pk__in=[])
        for memory in memories:
            as_read |= Q(pk=memory.pk, version=memory.version)
        rows = Memory.objects.for_tenant(tenant).live(now=now).filter(as_read).exclude(expires_at=None)
        ids = list(rows.select_for_update().values_list("pk", flat=True))
        if ids:
            Memory.objects.filter(pk__in=ids).update(expires_at=now + timedelta(seconds=seconds))
        refreshed.update(ids)
    return refreshed


def _value_slice(value: Any, *, max_chars: int, offset: int) -> ValueSlice | None:
    # A string's length costs nothing; other JSON is serialized once (a few µs for a small object).
    text = search.compact(value)
    if offset == 0 and len(text) <= max_chars:
        return None
    end = _cluster_start(text, offset + max_chars, low=offset)
    return ValueSlice(text=text[offset:end], chars=len(text), next_offset=end if end < len(text) else None)


_ZWJ = "\u200d"


def _cluster_start(text: str, end: int, *, low: int) -> int:
    """``end`` moved back to the start of the grapheme cluster it falls inside (a slice ending
    there would show "e" for "é", half a flag, one person of a family emoji), unless that
    leaves nothing after ``low``: one cluster longer than a slice is cut. The common clusters
    (combining marks, variation selectors, ZWJ sequences, skin tones, flag pairs, CRLF), not
    all of UAX #29 (no Hangul jamo, no Indic conjuncts). A few characters looked at, on a cut
    read only: at most ``_CLUSTER_LOOKBACK`` back — a longer "cluster" (a run of thousands of
    combining marks) is cut too, instead of a step per mark on every cut (per result, in a
    search)."""
    floor = max(low, end - _CLUSTER_LOOKBACK)
    i = end
    while floor < i < len(text) and _joined(text, i):
        i -= 1
    return i if i > floor else end


# Unicode's stream-safe text (UAX #15) has at most 30 combining marks in a row; the longest
# emoji ZWJ sequences are about a dozen code points.
_CLUSTER_LOOKBACK = 32


def _joined(text: str, i: int) -> bool:
    """``text[i - 1]`` and ``text[i]`` belong to one grapheme cluster."""
    before, at = text[i - 1], text[i]
    if unicodedata.category(at) in ("Mn", "Mc", "Me") or _ZWJ in (before, at) or "\U0001f3fb" <= at <= "\U0001f3ff":
        return True
    if (before, at) == ("\r", "\n"):
        return True
    if before in _REGIONAL and at in _REGIONAL:
        return _regional_run_before(text, i) % 2 == 1
    return False


_REGIONAL = "".join(chr(c) for c in range(0x1F1E6, 0x1F200))  # the flag letters A-Z


def _regional_run_before(text: str, i: int) -> int:
    """How many regional indicators end at ``text[i - 1]`` (regional indicators pair up from
    the start of their run). Scans back over windows of doubling width, each stripped at C
    speed: O(run length), never a copy of the text before the run (``text[:i]`` cost 14 µs
    per cut at 16,000 characters, where a run is mostly one flag)."""
    start, width = i, 8
    while start > 0:
        window = text[max(0, start - width) : start]
        kept = len(window.rstrip(_REGIONAL))
        start -= len(window) - kept
        if kept:
            break
        width *= 2
    return i - start


def memory_update(
    *,
    tenant: Tenant,
    actor: Actor,
    key: Any,
    value: Any = _UNSET,
    expected_version: Any = None,
    ttl_seconds: Any = None,
    tags: Any = None,
    category: Any = None,
    importance: Any = None,
    source: Any = None,
    if_match: tuple[int, int] | frozenset | str | None = None,
    sensitive: Any = None,
    subject: Any = None,
) -> MemoryResult:
    """Change an existing memory. The version check lives in the UPDATE's WHERE clause, so
    two concurrent updates with the same ``expected_version`` cannot both win. No live
    memory at ``key`` raises :class:`NotFound`; another ``expected_version`` raises
    :class:`Conflict` with the ``current_version``.

    ``if_match=(memory id, version)`` (REST If-Match; a frozenset of such pairs for a list of
    ETags: any of them) is checked the same way, and a mismatch — or a missing memory — is
    HTTP 412 instead of a result; ``"*"`` matches any current version.

    ``sensitive`` and ``subject`` (REST PUT with If-Match) mark the new value and move the
    memory to that end user as :func:`memory_write` does (a sensitive value sealed under the
    subject's key); they come with a ``value``.

    Cost: outside any transaction, on PostgreSQL, two statements (:func:`_update_as_read`);
    else, or when what was read does not allow it, a transaction (:func:`_update_locked`).
    """
    # Its own transaction, below: an update of a live memory as read needs none (one statement).
    with audited_operation(tenant=tenant, actor=actor, action="memory.update", target=key, atomic=False) as op:
        key = validation.key(key)
        require_scope(actor, Scope.MEMORY_WRITE)
        require_key_allowed(actor, key)
        expected = validation.version(expected_version)
        sensitive = sensitivity.flag(sensitive)
        if sensitive is not None and value is _UNSET:
            raise InvalidInput("is set with a value", field="sensitive")
        subject = validation.subject(subject)
        if subject is not None and value is _UNSET:
            raise InvalidInput("is set with a value", field="subject")
        require_subject_allowed(actor, key=key, subject=subject)
        if value is not _UNSET:
            validation.value(
                value, max_bytes=tenant.effective_value_max_bytes, max_containers=settings.ZEROMEM_VALUE_MAX_CONTAINERS
            )
            sensitivity.refuse_envelope(value)
        ttl = validation.ttl_seconds(ttl_seconds)
        changes: dict[str, Any] = {}
        for name, given in (
            ("tags", validation.tags(tags)),
            ("category", validation.category(category)),
            ("importance", validation.importance(importance)),
            ("source", validation.short_text(source, field="source", max_len=validation.SOURCE_MAX_LEN)),
        ):
            if given is not None:
                changes[name] = given
        if value is _UNSET and ttl is None and not changes:
            # An update of nothing moved the version (every other holder's ETag went stale)
            # and wrote a history row of no change.
            raise InvalidInput(
                "changes nothing: give value, ttl_seconds, tags, category, importance or source",
                field="body",
                code="nothing_to_change",
            )

        now = timezone.now()
        asked = {
            "tenant": tenant,
            "actor": actor,
            "op": op,
            "key": key,
            "changes": changes,
            "value": value,
            "sensitive": sensitive,
            "subject": subject,
            "ttl": ttl,
            "expected": expected,
            "if_match": if_match,
            "now": now,
        }
        if settings.ZEROMEM_WRITE_WITHOUT_LOCK and hotsql.alone_in_one_statement(Memory, MemoryVersion):
            updated = _update_as_read(**asked)
            if updated is not None:
                return updated
        hotsql.send_rider()  # the rate counter (a tool call), before the transaction
        with transaction.atomic():
            return _update_locked(**asked)


def _update_locked(
    *, tenant, actor, op, key, changes: dict, value, sensitive, subject, ttl, expected, if_match, now
) -> MemoryResult:
    """:func:`memory_update` in a transaction: the row locked for a new value, the UPDATE
    conditioned on the version (and the ETag), the search fields and the version row."""
    live = selectors.memories_live(tenant=tenant).filter(key=key)
    if value is not _UNSET:
        # An UPDATE bypasses the field's sealing: seal here, under the row's subject's key.
        # Locked: a write that marks it sensitive or moves its subject meanwhile would
        # otherwise be undone by the UPDATE below (its value stored in plaintext).
        row = live.select_for_update().values_list("subject", "sensitive").first()
        secret = row is not None and sensitivity.decide(tenant, key=key, value=value, given=sensitive, current=row[1])
        owner = subject if subject is not None else row[0] if row is not None else ""
        changes["value"] = keyring.seal_value(value, tenant_id=tenant.pk, subject=owner) if secret else value
        changes["sensitive"] = secret
        if subject is not None:
            changes["subject"] = subject
    if ttl is not None:
        changes["expires_at"] = now + ttl
    target = live if expected is None else live.filter(version=expected)
    if if_match is not None and if_match != "*":
        target = target.filter(_etag_condition(if_match))
    updated = target.update(version=F("version") + 1, updated_at=now, **changes)
    if not updated:
        current = live.values_list("version", flat=True).first()
        if if_match is not None:
            raise PreconditionFailed("the memory changed since you read it (ETag mismatch)", field="If-Match")
        if current is None:
            raise _no_memory()
        op.record(outcome=Outcome.CONFLICT, version=current, detail={"expected_version": expected})
        raise Conflict("the version moved", field="expected_version", current_version=current)
    # Our UPDATE holds the row lock until commit, so this read sees our own version.
    memory = live.get()
    if "value" in changes or "tags" in changes:
        Memory.objects.filter(pk=memory.pk).update(
            **search.index_fields(
                tenant_id=tenant.pk, key=key, value=None if memory.sensitive else memory.value, tags=memory.tags
            )
        )
    if value is not _UNSET and memory.sensitive and not row[1]:
        _turned_sensitive(memory)
    _record_version(memory, MemoryVersion.Op.UPDATE, actor, now)
    op.record(subject=memory.subject, version=memory.version)
    op.write_now()  # in the update's transaction
    return MemoryResult(status="ok", key=key, memory=memory)


def _update_as_read(
    *, tenant, actor, op, key, changes: dict, value, sensitive, subject, ttl, expected, if_match, now
) -> MemoryResult | None:
    """:func:`memory_update` of a live memory without a transaction or a row lock, as
    :func:`_write_over_as_read` writes over one: the memory read (the rate counter rides with
    it); its version (``expected_version``) and ETag (``If-Match``) checked on what was read;
    then its UPDATE — only while the row is still as read — its version INSERT and its audit
    INSERT as one statement, all or nothing. Two round trips instead of a transaction of six
    or seven. None, with nothing written, when the update needs the locked path: no live
    memory at the key, a version or an ETag that does not match what was read (the locked path
    answers it, over the row as it is then), a value turning sensitive (its history is sealed
    with it) or sealed under another subject (see :func:`_write_over_as_read`), or a row that
    changed between the read and the UPDATE."""
    current = selectors.memory_get_live(tenant=tenant, key=key)
    if current is None or (expected is not None and current.version != expected):
        return None
    if if_match is not None and if_match != "*" and (current.pk, current.version) not in _etag_pairs(if_match):
        return None
    as_read = _as_read(current)
    fields = {**changes, "updated_at": now}
    if value is not _UNSET:
        secret = sensitivity.decide(tenant, key=key, value=value, given=sensitive, current=current.sensitive)
        if secret and (not current.sensitive or (subject is not None and subject != current.subject)):
            # Turning sensitive (its history is sealed with it), or sealed under another
            # subject's key, whose lock against a forget's shred only a transaction holds.
            return None
        # Plain on the instance: the field seals it on the way out when the row is sensitive,
        # under the key of the subject it goes under (SealedJSONField.pre_save).
        fields.update(value=value, sensitive=secret)
        if subject is not None:
            fields["subject"] = subject
    if ttl is not None:
        fields["expires_at"] = now + ttl
    if "value" in fields or "tags" in fields:
        secret = fields.get("sensitive", current.sensitive)
        plain = fields.get("value", current.value)
        tags = fields.get("tags", current.tags)
        fields.update(search.index_fields(tenant_id=tenant.pk, key=key, value=None if secret else plain, tags=tags))
    for name, given in fields.items():
        setattr(current, name, given)
    read_version = current.version
    current.version += 1
    if not _sent_as_read(current, fields, as_read, op=op, actor=actor, now=now, kind=MemoryVersion.Op.UPDATE):
        return None
    last_seen.saw(tenant.pk, key, current, found=read_version)  # a tool write of it next: no read first
    return MemoryResult(status="ok", key=key, memory=current)


def memory_delete(
    *, tenant: Tenant, actor: Actor, key: Any, if_match: tuple[int, int] | frozenset | str | None = None
) -> MemoryResult:
    """Soft delete: the memory moves to the trash (restorable until purged).
    ``if_match=(memory id, version)``: delete only that version, else HTTP 412 ("*": any).
    No live memory at ``key`` raises :class:`NotFound`."""
    with audited_operation(tenant=tenant, actor=actor, action="memory.delete", target=key) as op:
        key = validation.key(key)
        require_scope(actor, Scope.MEMORY_DELETE)
        require_key_allowed(actor, key)
        memory = selectors.memories_live(tenant=tenant).filter(key=key).select_for_update().first()
        if if_match is not None and (
            memory is None or (if_match != "*" and (memory.pk, memory.version) not in _etag_pairs(if_match))
        ):
            raise PreconditionFailed("the memory changed since you read it (ETag mismatch)", field="If-Match")
        if memory is None:
            raise _no_memory()
        now = timezone.now()
        memory.deleted_at = now
        memory.version += 1
        memory.updated_at = now
        memory.save(update_fields=["deleted_at", "version", "updated_at"])
        # Derived from the value: it goes with the memory (a restore is embedded again).
        embeddings.embeddings_delete(memory_ids=[memory.pk])
        _record_version(memory, MemoryVersion.Op.DELETE, actor, now)
        op.record(subject=memory.subject, version=memory.version)
        last_seen.saw(tenant.pk, key, None)
        return MemoryResult(status="ok", key=key, memory=memory)


def memory_restore(*, tenant: Tenant, actor: Actor, memory_id: int) -> MemoryResult:
    """Bring a trashed memory back. No such memory in the tenant's trash raises
    :class:`NotFound`; a live memory that has taken its key meanwhile, :class:`Conflict` (an
    expired one, not yet purged, goes to the trash instead: see :func:`_lock_current_unexpired`).
    A memory whose TTL ran out in the trash gets again the time it had left at its last change
    before the trash (``expires_at`` minus that change's time: never more than the TTL its
    writer last asked for), from the restore, audited as ``detail.ttl_restarted_seconds``;
    one whose TTL has not run out keeps its expiry. Cost: one more indexed SELECT then.

    What the purge erases is :class:`NotFound` (``memory_id``) even before the purge runs: a
    memory past its trash retention (:func:`retention.trash_cutoff_for`, one query: the
    rule), and one that expired before it went to the trash (a write or restore that took
    its expired key trashed it; nobody deleted it)."""
    memory = Memory.objects.for_tenant(tenant).trashed().filter(pk=memory_id).first()
    key = memory.key if memory else ""
    with audited_operation(tenant=tenant, actor=actor, action="memory.restore", target=key) as op:
        require_scope(actor, Scope.MEMORY_WRITE)
        if memory is None:
            raise NotFound("no such memory in the trash", field="memory_id")
        require_key_allowed(actor, key)
        # Locked, and still in the trash: another restore or the purge may have got there first.
        memory = Memory.objects.for_tenant(tenant).trashed().filter(pk=memory.pk).select_for_update().first()
        if memory is None:
            raise NotFound("no such memory in the trash", field="memory_id")
        now = timezone.now()
        # What the purge erases is not brought back by a restore that runs before it does (the
        # admin's trash lists by the same rule: retention.restorable_trash).
        refusal = retention.restore_refusal(memory, cutoff=retention.trash_cutoff_for(tenant=tenant, key=key, now=now))
        if refusal == retention.EXPIRED_BEFORE_TRASH:
            raise NotFound("this memory expired before it went to the trash", field="memory_id")
        if refusal is not None:
            raise NotFound("this memory is past its trash retention", field="memory_id")
        if _lock_current_unexpired(tenant=tenant, key=key, now=now) is not None:
            raise Conflict("a live memory holds this key", field="key")
        memory.deleted_at = None
        memory.version += 1
        memory.updated_at = now
        restarted = None
        if memory.expires_at is not None and memory.expires_at <= now:
            # Its TTL ran out in the trash (the purge has not erased it yet). Restored with
            # that expiry it would stay invisible; made permanent it would outlive what its
            # writer asked for. It gets again what it had left at its last change: exactly the
            # TTL when that change set it (a session key refreshed on every write), less when
            # an earlier write did — never more. Not its age (expires_at - created_at): a key
            # created months ago with a 1-hour TTL refreshed since would live months.
            restarted = memory.expires_at - _last_change_at(memory)
            memory.expires_at = now + restarted
        try:
            # A savepoint: a write that creates the key after the check above wins the
            # one-live-key index, and this restore is a conflict, not an error.
            with transaction.atomic():
                memory.save(update_fields=["deleted_at", "version", "updated_at", "expires_at"])
        except IntegrityError:
            raise Conflict("a live memory holds this key", field="key") from None
        _record_version(memory, MemoryVersion.Op.RESTORE, actor, now)
        detail = {"ttl_restarted_seconds": round(restarted.total_seconds())} if restarted is not None else None
        op.record(subject=memory.subject, version=memory.version, detail=detail)
        return MemoryResult(status="ok", key=key, memory=memory)


def _last_change_at(memory: Memory):
    """When ``memory`` last changed before it went to the trash (its latest version that is
    not a delete; its creation if it has none). One SELECT on the (memory, version) index."""
    changed = (
        MemoryVersion.objects.filter(tenant_id=memory.tenant_id, memory_id=memory.pk)
        .exclude(op=MemoryVersion.Op.DELETE)
        .order_by("-version")
        .values_list("created_at", flat=True)
        .first()
    )
    return changed or memory.created_at


def memory_list(
    *,
    tenant: Tenant,
    actor: Actor,
    prefix: Any = "",
    limit: Any = None,
    cursor: Any = None,
    category: Any = None,
    subject: Any = None,
    tag: Any = None,
    keys_only: bool = True,
    sizes: bool = False,
    order: Any = None,
    page_max: int = validation.LIMIT_MAX,
) -> ListResult:
    """Keys under a prefix, ordered, keyset-paginated; only keys the actor may touch. With
    ``sizes``: (key, bytes of the value's text) pairs, values measured by the database
    (``selectors.keys_and_text_sizes``: only sensitive ones are loaded). ``order``: ``asc``
    (default) or ``desc``, the last keys first — the newest items of a time-keyed log (an
    agent session's history) in one page instead of a walk over all of it. ``page_max``: a
    service reading a whole directory at once (the Claude memory tool's listing) takes more
    than ``LIMIT_MAX`` in one page, so one audit event. Cost: one range read of the
    (tenant, key) index either way, ``limit + 1`` rows, and the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="memory.list", target=prefix, atomic=False) as op:
        prefix = validation.prefix(prefix)
        require_scope(actor, Scope.MEMORY_READ)
        limit = validation.bounded_int(limit, field="limit", default=50, low=1, high=page_max)
        after = validation.decode_cursor(cursor)
        category = validation.category(category)
        subject = validation.short_text(subject, field="subject", max_len=validation.SUBJECT_MAX_LEN)
        if tag is not None:
            tag = validation.tags([tag], field="tag")[0]
        if order not in (None, "asc", "desc"):
            raise InvalidInput("must be asc or desc", field="order")
        rows, last = selectors.memory_keys_page(
            tenant=tenant,
            prefixes=actor.prefix_filters(prefix),
            limit=limit,
            after=after,
            category=category,
            subject=subject,
            tag=tag,
            keys_only=keys_only,
            sizes=sizes,
            descending=order == "desc",
            max_bytes=None if keys_only or sizes else settings.ZEROMEM_PAGE_VALUES_MAX_BYTES,
        )
        op.record(target=prefix, count=len(rows))
        return ListResult(keys=rows, next_cursor=validation.encode_cursor(last) if last else None)


@dataclass(frozen=True)
class SearchHit:
    """A ranked memory. With ``cut`` (a search with max_chars, of a value longer than that),
    ``memory.value`` may hold only the value's first characters (PostgreSQL loads a long
    string no further than the cut looks): answer ``cut``, never that value."""

    memory: Memory
    score: float
    cut: ValueSlice | None = None  # a search with max_chars, of a value longer than that


def memory_search(
    *, tenant: Tenant, actor: Actor, query: Any, prefix: Any = "", limit: Any = None, max_chars: Any = None
) -> list[SearchHit]:
    """Ranked matches of a natural-language question or keywords (memories/search/).
    Bounded cost; past ``ZEROMEM_SEARCH_TIMEOUT_MS`` it raises ``SearchTimeout`` (503).
    The audit event records the prefix and the count, not the query text (it may be personal).

    With ``max_chars`` (tool calls), each value whose text is longer than that comes back as
    its first slice in ``hit.cut``, by :func:`memory_read`'s rule (its ``offset`` reads on);
    without (REST, the adapters), whole. The cut costs no statement: each string's length, or
    one serialization of other JSON."""
    with audited_operation(tenant=tenant, actor=actor, action="memory.search", target=prefix, atomic=False) as op:
        query = validation.query(query)
        prefix = validation.prefix(prefix)
        require_scope(actor, Scope.MEMORY_SEARCH)
        limit = validation.limit(limit, default=5)
        if max_chars is not None:
            max_chars = validation.read_max_chars(max_chars)
        with search_budget(tenant.pk):
            # A long string value leaves the database as the characters the cut can show.
            results = search.search_ranked(
                tenant=tenant, prefixes=actor.prefix_filters(prefix), query=query, limit=limit, head_chars=max_chars
            )
        op.record(target=prefix, count=len(results))
        return [SearchHit(memory, score, _search_cut(memory, max_chars)) for memory, score in results]


def _search_cut(memory: Memory, max_chars: int | None) -> ValueSlice | None:
    # An erased value ({"erased": true}) says what happened to it: never cut into a fragment.
    if max_chars is None or isinstance(memory.value, ErasedValue):
        return None
    chars = getattr(memory, "value_text_chars", None)
    if chars is not None:
        # Only its first max_chars + 1 characters were loaded (chars > max_chars): cut as
        # _value_slice cuts the whole text, which looks no further than that.
        end = _cluster_start(memory.value, max_chars, low=0)
        return ValueSlice(text=memory.value[:end], chars=chars, next_offset=end)
    return _value_slice(memory.value, max_chars=max_chars, offset=0)


def memory_recall(*, tenant: Tenant, actor: Actor, query: Any = None, prefix: Any = "", max_chars: Any = None) -> dict:
    """The best matches of ``query`` — or, with no query, the most important and most recent
    memories under ``prefix`` — packed into one text block of at most ``max_chars``
    characters (memories.search.ranking.recall_pack)."""
    with audited_operation(tenant=tenant, actor=actor, action="memory.recall", target=prefix, atomic=False) as op:
        query = validation.query(query, required=False)
        prefix = validation.prefix(prefix)
        require_scope(actor, Scope.MEMORY_SEARCH)
        max_chars = validation.bounded_int(
            max_chars,
            field="max_chars",
            default=validation.RECALL_DEFAULT_CHARS,
            low=validation.RECALL_MIN_CHARS,
            high=validation.RECALL_MAX_CHARS,
        )
        with search_budget(tenant.pk):
            packed = search.recall_pack(
                tenant=tenant, prefixes=actor.prefix_filters(prefix), query=query, max_chars=max_chars
            )
        op.record(target=prefix, count=len(packed["keys"]))
        return packed


@dataclass(frozen=True)
class HistoryPage:
    versions: list[MemoryVersion]
    next_cursor: str | None  # the versions older than the page's last, when there are any


def memory_history(*, tenant: Tenant, actor: Actor, key: Any, limit: Any = None, cursor: Any = None) -> HistoryPage:
    """Versions of the live memory at ``key``, newest first (values included: a read), at
    most ``limit``, older than the version ``cursor`` names (the ``next_cursor`` of the
    page before). A page stops before its values pass ``ZEROMEM_PAGE_VALUES_MAX_BYTES``
    (at least one version; ``selectors.budgeted``). No live memory at ``key`` raises
    :class:`NotFound`. Cost: the memory's lookup, one range read of the (memory, version)
    index (values of at most the budget / (limit + 1) bytes with it; larger ones kept are
    read again by primary key), and the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="memory.history", target=key, atomic=False) as op:
        key = validation.key(key)
        require_scope(actor, Scope.MEMORY_READ)
        require_key_allowed(actor, key)
        limit = validation.limit(limit, default=50)
        before = validation.decode_version_cursor(cursor)
        memory = selectors.memory_get_live(tenant=tenant, key=key)
        if memory is None:
            raise _no_memory()
        qs = selectors.memory_history(memory=memory)
        if before is not None:
            qs = qs.filter(version__lt=before)
        budget = settings.ZEROMEM_PAGE_VALUES_MAX_BYTES
        rows = list(selectors.sized(qs, limit=limit, max_bytes=budget)[: limit + 1])
        more = len(rows) > limit
        versions, cut = selectors.budgeted(rows[:limit], tenant_id=tenant.pk, max_bytes=budget)
        op.record(subject=memory.subject, count=len(versions), version=memory.version)
        last = versions[-1].version if versions and (more or cut) else None
        return HistoryPage(versions=versions, next_cursor=validation.encode_cursor(str(last)) if last else None)


def memory_view(*, tenant: Tenant, actor: Actor, memory_id: Any) -> Memory:
    """Open one memory of ``tenant`` by id — live, expired or trashed — with its value.

    Opening a value is a read: it needs ``memory:read`` and is audited as ``memory.view``.
    Another tenant's id raises :class:`NotFound`, exactly like a missing one. Cost: one
    primary-key SELECT and the audit INSERT (no access-counter update: staff reading is not
    agent use).
    """
    with audited_operation(tenant=tenant, actor=actor, action="memory.view", atomic=False) as op:
        memory = _readable_memory(tenant=tenant, actor=actor, memory_id=memory_id, op=op)
        op.record(subject=memory.subject, version=memory.version)
        return memory


def memory_reveal(*, tenant: Tenant, actor: Actor, memory_id: Any) -> Memory:
    """Open a sensitive memory's value on a staff member's explicit request (the admin masks
    it until then): needs ``memory:read`` — the compliance role never holds it — and is
    audited as ``memory.reveal``. :class:`NotFound` for another tenant's id; a value whose
    key is destroyed raises :class:`Erased`."""
    with audited_operation(tenant=tenant, actor=actor, action="memory.reveal", atomic=False) as op:
        memory = _readable_memory(tenant=tenant, actor=actor, memory_id=memory_id, op=op)
        op.record(subject=memory.subject, version=memory.version, detail={"sensitive": memory.sensitive})
        if isinstance(memory.value, ErasedValue):
            raise Erased(field="memory_id")
        return memory


def _readable_memory(
    *, tenant: Tenant, actor: Actor, memory_id: Any, op: AuditedOperation, with_value: bool = True
) -> Memory:
    """The tenant's memory (any state) the actor may read; it becomes the operation's target.
    ``with_value=False``: its value is not loaded (a history page needs the facts only)."""
    require_scope(actor, Scope.MEMORY_READ)
    qs = Memory.objects.for_tenant(tenant)
    memory = (qs if with_value else qs.defer("value")).filter(pk=_pk(memory_id)).first()
    if memory is None:
        raise NotFound("no such memory", field="memory_id")
    require_key_allowed(actor, memory.key)
    op.target = memory.key
    return memory


HISTORY_PAGE_SIZE = 20  # versions a page of the admin's history shows
PREVIEW_CHARS = 400  # characters of a version's JSON text the page shows
SEALED_INLINE_BYTES = 8192  # a sealed version (envelope) up to this size comes with the page


@dataclass(frozen=True)
class VersionsPage:
    """A page of a memory's versions, newest first, without their whole values: each row has
    ``value_bytes`` (its JSON text's size; an envelope's for a sealed one), ``preview`` (the
    first :data:`PREVIEW_CHARS` characters of a plain value's JSON text, one more when it is
    longer; None for a sealed one) and ``sealed_value`` (a sealed version's value, opened,
    when asked for and its envelope is at most :data:`SEALED_INLINE_BYTES`; else None)."""

    memory: Memory
    versions: list[MemoryVersion]
    older: int | None  # the ``before`` of the next page, when older versions remain


_PREVIEW_SQL = {
    "postgresql": (
        "CASE WHEN {table}.sensitive THEN NULL"
        " WHEN jsonb_typeof({table}.value) = 'string' THEN to_jsonb(left({table}.value #>> '{{}}', %s))::text"
        " ELSE left({table}.value::text, %s) END"
    ),
    "sqlite": "CASE WHEN {table}.sensitive THEN NULL ELSE substr(CAST({table}.value AS TEXT), 1, %s) END",
}
_SEALED_INLINE_SQL = {
    "postgresql": "CASE WHEN {table}.sensitive AND pg_column_size({table}.value) <= %s THEN {table}.value END",
    "sqlite": "CASE WHEN {table}.sensitive AND length(CAST({table}.value AS BLOB)) <= %s THEN {table}.value END",
}


def memory_versions_view(
    *,
    tenant: Tenant,
    actor: Actor,
    memory_id: Any,
    before: Any = None,
    limit: int = HISTORY_PAGE_SIZE,
    open_sealed: bool = False,
) -> VersionsPage:
    """A page of the versions of one memory (any state), newest first, older than version
    ``before`` when given: previews and sizes, never whole values (:class:`VersionsPage`;
    :func:`memory_version_view` opens one). ``open_sealed``: small sealed versions come
    opened (the admin asks once the staff member revealed the memory). Audited as
    ``memory.history``. :class:`NotFound` when the memory is not the tenant's; a bad
    ``before`` is :class:`InvalidInput` naming it.

    Cost: the memory's lookup, one range read of the (memory, version) index of at most
    ``limit + 1`` rows whose values the database cuts to previews (each value is read there,
    not sent: a page is tens of KB whatever the values), the audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="memory.history", atomic=False) as op:
        before = validation.version(before, field="before")
        limit = max(1, min(int(limit), 200))
        memory = _readable_memory(tenant=tenant, actor=actor, memory_id=memory_id, op=op, with_value=False)
        qs = selectors.memory_history(memory=memory).defer("value")
        if before is not None:
            qs = qs.filter(version__lt=before)
        table = connection.ops.quote_name(MemoryVersion._meta.db_table)
        vendor = "postgresql" if connection.vendor == "postgresql" else "sqlite"
        preview = _PREVIEW_SQL[vendor].format(table=table)
        sealed = _SEALED_INLINE_SQL[vendor].format(table=table)
        field = MemoryVersion._meta.get_field("value")
        # bandit B611 (marked): the SQL is constants of this module; the sizes are parameters.
        qs = qs.annotate(
            value_bytes=RawSQL(selectors.value_bytes_sql(MemoryVersion), []),  # nosec B611
            preview=RawSQL(preview, [PREVIEW_CHARS + 1] * preview.count("%s")),  # nosec B611
            sealed_value=RawSQL(sealed, [SEALED_INLINE_BYTES if open_sealed else -1], output_field=field),  # nosec B611
        )
        rows = list(qs[: limit + 1])
        versions = rows[:limit]
        for row in versions:
            if row.sealed_value is not None:
                row.sealed_value = keyring.open_loaded(row.sealed_value, tenant_id=tenant.pk)
        op.record(
            subject=memory.subject,
            count=len(versions),
            version=memory.version,
            detail={"before": before} if before is not None else {},
        )
        older = versions[-1].version if len(rows) > limit else None
        return VersionsPage(memory=memory, versions=versions, older=older)


def memory_version_view(*, tenant: Tenant, actor: Actor, memory_id: Any, version: Any) -> MemoryVersion:
    """One version of one memory (any state) with its whole value (opened when sealed: the
    admin masks it until a reveal). Audited as ``memory.history`` with ``count`` 1 and
    ``detail.opened_version``. :class:`NotFound` when the memory is not the tenant's or has
    no such version. Cost: the memory's lookup, one row by the (memory, version) index, the
    audit INSERT."""
    with audited_operation(tenant=tenant, actor=actor, action="memory.history", atomic=False) as op:
        number = validation.version(version, field="version")
        if number is None:
            raise InvalidInput("must be a version number", field="version")
        memory = _readable_memory(tenant=tenant, actor=actor, memory_id=memory_id, op=op, with_value=False)
        row = selectors.memory_history(memory=memory).filter(version=number).first()
        if row is None:
            op.record(outcome=Outcome.NOT_FOUND, subject=memory.subject, detail={"opened_version": number})
            raise NotFound("no such version of this memory", field="version")
        op.record(subject=memory.subject, count=1, version=number, detail={"opened_version": number})
        return row


def memory_restore_version(*, tenant: Tenant, actor: Actor, memory_id: Any, version: Any) -> MemoryResult:
    """Make an old version's value current again: a *new* version (op ``restore``) holding
    that value, so the history keeps the bad write too. Only live memories (restore a
    trashed one from the trash first). Audited as ``memory.restore_version`` with the
    version restored from in ``detail.from_version``. No such live memory or version raises
    :class:`NotFound`.

    Cost: the version SELECT, one conditional UPDATE, the version INSERT, the audit INSERT.
    """
    with audited_operation(tenant=tenant, actor=actor, action="memory.restore_version") as op:
        require_scope(actor, Scope.MEMORY_WRITE)
        version = validation.version(version, field="version")
        if version is None:
            raise InvalidInput("must be a version number", field="version")
        memory = Memory.objects.for_tenant(tenant).live().filter(pk=_pk(memory_id)).select_for_update().first()
        old = (
            MemoryVersion.objects.filter(tenant=tenant, memory=memory, version=version).first()
            if memory is not None
            else None
        )
        if memory is None or old is None:
            op.record(outcome=Outcome.NOT_FOUND, target=memory.key if memory else "", detail={"from_version": version})
            raise NotFound("no such version of a live memory", field="version")
        require_key_allowed(actor, memory.key)
        if isinstance(old.value, ErasedValue):
            raise Erased(field="version")
        validation.value(
            old.value, max_bytes=tenant.effective_value_max_bytes, max_containers=settings.ZEROMEM_VALUE_MAX_CONTAINERS
        )
        now = timezone.now()
        secret = memory.sensitive or old.sensitive
        if secret and not memory.sensitive:  # turning sensitive again
            _turned_sensitive(memory)
        Memory.objects.filter(pk=memory.pk).update(
            value=keyring.seal_value(old.value, tenant_id=tenant.pk, subject=memory.subject) if secret else old.value,
            sensitive=secret,
            **search.index_fields(
                tenant_id=tenant.pk, key=memory.key, value=None if secret else old.value, tags=memory.tags
            ),
            version=F("version") + 1,
            updated_at=now,
        )
        memory.refresh_from_db()
        _record_version(memory, MemoryVersion.Op.RESTORE, actor, now)
        op.record(target=memory.key, subject=memory.subject, version=memory.version, detail={"from_version": version})
        return MemoryResult(status="ok", key=memory.key, memory=memory)


def _pk(raw: Any) -> int:
    pk = raw if isinstance(raw, int) and not isinstance(raw, bool) else validation.ascii_int(raw)
    return pk if pk is not None and 0 < pk < 2**63 else 0
