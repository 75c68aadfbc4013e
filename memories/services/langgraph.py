"""LangGraph's store on ZeroMem memories: what the ``/api/v1/langgraph/store/...`` routes
mean (memories/api/langgraph.py serves them in the shapes ``langgraph_sdk``'s
``client.store`` sends and expects; the shapes are public, no server code is taken).

**Mapping.** A LangGraph item ``(namespace, key)`` is the memory at::

    <ZEROMEM_LANGGRAPH_PREFIX>:<label 1>:...:<label n>:<key>

e.g. namespace ``("users", "u1")`` and key ``"prefs"`` → ``lg:users:u1:prefs``. Its value
(a JSON object) is the memory's value; a ``ttl`` in minutes is the memory's TTL (and the tag
``ttl_minutes=N``, so that a read with ``refresh_ttl`` can extend it by the same amount).
Labels and keys keep letters, digits and ``_ . @ + = -``; every other character (``:``,
``~``, ``/``, a space, ...) is written ``~HH`` per UTF-8 byte (``a:b`` → ``a~3Ab``), so the
mapping is one-to-one and a ``:`` always separates labels. Labels may not contain ``.``
(LangGraph's rule: the SDK joins them with dots in a GET) nor be empty. An item of a
namespace ``("users", <id>, ...)`` is about the end user ``<id>`` (the memory's ``subject``,
inferred from its key as ``user:<id>:...`` is: zeromem.kernel.subjectkeys), so their forget
request and portal reach it.

Every operation goes through the memory services' rules — scopes, the key's allowlist
(``lg:users:u1:`` limits a key to namespace ``("users", "u1", ...)``), audit — and the
listing ones read at most ``ZEROMEM_LANGGRAPH_SCAN_MAX`` memories under the prefix.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import operator
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import BooleanField, ExpressionWrapper, F, Func, Q

from audit.services import AuditedOperation, audited_operation
from memories import search, selectors
from memories.models import Memory, Tenant
from memories.services import memories as mem
from memories.services.api_keys import rate_limit_charge_items
from memories.services.search_budget import search_budget
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor, require_scope
from zeromem.kernel.errors import Forbidden, InvalidInput, NotFound
from zeromem.kernel.scopes import Scope
from zeromem.kernel.subjectkeys import decode_segment, encode_segment

TTL_TAG = "ttl_minutes="
TTL_MAX_MINUTES = validation.TTL_MAX_SECONDS // 60
_OPERATORS = frozenset({"$eq", "$ne", "$gt", "$gte", "$lt", "$lte"})
_RANGES = frozenset({"$gt", "$gte", "$lt", "$lte"})
# The matcher walks the filter for every item a search reads (up to ZEROMEM_LANGGRAPH_SCAN_MAX):
# 1,500 conditions that 16 KB values all met but the last took 6.8 s of one CPU per search.
FILTER_MAX_CONDITIONS = 100


def root() -> str:
    return validation.key(settings.ZEROMEM_LANGGRAPH_PREFIX, field="ZEROMEM_LANGGRAPH_PREFIX")


# --- the mapping -----------------------------------------------------------------------------


def namespace_labels(raw: Any, *, field: str = "namespace", allow_empty: bool = False) -> tuple[str, ...]:
    """A namespace as a tuple of labels (a GET's dotted string is split by the view)."""
    if not isinstance(raw, list | tuple):
        raise InvalidInput("must be a list of strings", field=field)
    if not raw and not allow_empty:
        raise InvalidInput("must not be empty", field=field)
    for label in raw:
        if not isinstance(label, str):
            raise InvalidInput("must be a list of strings", field=field)
        if not label:
            raise InvalidInput("labels must not be empty", field=field)
        if "." in label:
            raise InvalidInput("labels must not contain '.'", field=field)
        if len(label) > validation.KEY_MAX_LEN:
            raise InvalidInput(f"labels must be at most {validation.KEY_MAX_LEN} characters", field=field)
    return tuple(raw)


def item_key(raw: Any, field: str = "key") -> str:
    if not isinstance(raw, str):
        raise InvalidInput("must be a string", field=field)
    if not raw:
        raise InvalidInput("must not be empty", field=field)
    return raw


def memory_key(namespace: tuple[str, ...], key: str) -> str:
    """The ZeroMem key of a LangGraph item."""
    return ":".join((root(), *(encode_segment(label) for label in namespace), encode_segment(key)))


def item_memory_key(namespace: tuple[str, ...], key: str) -> str:
    """:func:`memory_key`, checked: a key past ``KEY_MAX_LEN`` is the namespace's fault when
    its labels, escaped, leave no room for a key (the client raises LangGraph's
    ``InvalidNamespaceError`` for a refusal naming ``namespace``), else the key's."""
    room = validation.KEY_MAX_LEN - len(namespace_prefix(namespace))
    if room < 1:
        raise InvalidInput(
            f"its labels, joined under {root()}: and escaped (~XX for each byte of a character other "
            f"than letters, digits or _ - . @ + =), take {validation.KEY_MAX_LEN - room} characters of a "
            f"key's {validation.KEY_MAX_LEN}, with none left for the item's key",
            field="namespace",
            code="too_long",
        )
    return validation.key(memory_key(namespace, key), field="key")


def namespace_prefix(namespace: tuple[str, ...]) -> str:
    """The ZeroMem key prefix holding a namespace and everything below it."""
    return ":".join((root(), *(encode_segment(label) for label in namespace))) + ":"


def parse_key(zeromem_key: str) -> tuple[tuple[str, ...], str] | None:
    """(namespace, key) of a memory under the prefix; None for a key that is no item: no
    namespace, or a key :func:`memory_key` never produces (other surfaces write any key under
    the prefix: ``a~zz``, ``a~7e``, a label with ``.``), whose (namespace, key) would lead a get
    or a delete to another memory."""
    rest = zeromem_key[len(root()) + 1 :]
    parts = rest.split(":")
    if len(parts) < 2:
        return None
    labels, key = tuple(decode_segment(p) for p in parts[:-1]), decode_segment(parts[-1])
    if any("." in label for label in labels) or any(
        encode_segment(text) != part for text, part in zip((*labels, key), parts, strict=True)
    ):
        return None
    return labels, key


def _iso(moment) -> str:
    return moment.isoformat()


def item_of(memory: Memory, score: float | None = None) -> dict | None:
    parsed = parse_key(memory.key)
    if parsed is None:
        return None
    out = {
        "namespace": list(parsed[0]),
        "key": parsed[1],
        "value": memory.value,
        "created_at": _iso(memory.created_at),
        "updated_at": _iso(memory.updated_at),
    }
    if score is not None:
        out["score"] = round(score, 4)
    return out


# --- filters (LangGraph's documented semantics: equality, nested objects, $eq $ne $gt $gte $lt $lte) ----


def check_filter(raw: Any, field: str = "filter") -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidInput("must be an object of field: value", field=field)
    validation.depth_within(raw, field=field)
    # No stored value holds NUL (validation.value), and PostgreSQL's jsonb cannot take one in
    # the containment the scan pushes down (a DataError, 500).
    if "\\u0000" in json.dumps(raw):
        raise InvalidInput("must not contain NUL characters", field=field, code="invalid_characters")
    try:
        json.dumps(raw, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # jsonb refuses a lone surrogate too (a DataError, 500)
        raise InvalidInput(
            "must be valid Unicode: a lone surrogate (half of a UTF-16 pair) matches no stored value",
            field=field,
            code="invalid_characters",
        ) from None
    stack: list = [raw]
    conditions = 0
    while stack:
        node = stack.pop()
        conditions += len(node)
        if conditions > FILTER_MAX_CONDITIONS:
            raise InvalidInput(
                f"must hold at most {FILTER_MAX_CONDITIONS} conditions (fields, operators and list items, "
                "at any depth)",
                field=field,
                code="too_many",
            )
        if isinstance(node, list):
            stack.extend(sub for sub in node if isinstance(sub, dict | list))
            continue
        operators = [name for name in node if name.startswith("$")]
        if operators and node is not raw and len(operators) < len(node):
            # The matcher reads an object with an operator as operators only (LangGraph's rule).
            raise InvalidInput(f"an object with an operator ('{operators[0]}') may hold only operators", field=field)
        for name, sub in node.items():
            if name.startswith("$") and name not in _OPERATORS:
                raise InvalidInput(f"unknown operator '{name}'; use {', '.join(sorted(_OPERATORS))}", field=field)
            if isinstance(sub, dict | list):
                stack.append(sub)
    return raw


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float | str):
        return None
    try:
        return float(x)
    except OverflowError:  # an int past the largest double: infinite, as float("1e400") is (was a 500)
        return math.inf if x > 0 else -math.inf
    except ValueError:
        return None


def _operator(value: Any, op: str, operand: Any) -> bool:
    if op == "$eq":
        return value == operand
    if op == "$ne":
        return value != operand
    a, b = _number(value), _number(operand)
    if a is None or b is None:
        return False
    return {"$gt": a > b, "$gte": a >= b, "$lt": a < b, "$lte": a <= b}[op]


def value_matches(value: Any, wanted: Any) -> bool:
    if isinstance(wanted, dict):
        if any(k.startswith("$") for k in wanted):
            return all(_operator(value, op, operand) for op, operand in wanted.items())
        return isinstance(value, dict) and all(value_matches(value.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return (
            isinstance(value, list)
            and len(value) == len(wanted)
            and all(value_matches(v, w) for v, w in zip(value, wanted, strict=True))
        )
    return value == wanted


def item_matches(value: Any, flt: dict) -> bool:
    if not flt:
        return True
    return isinstance(value, dict) and all(value_matches(value.get(k), v) for k, v in flt.items())


def _bounded(raw: Any, *, field: str, default: int, low: int, high: int) -> int:
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise InvalidInput("must be an integer", field=field)
    if not low <= raw <= high:
        raise InvalidInput(f"must be between {low} and {high}", field=field, code="out_of_range")
    return raw


def _flag(raw: Any, field: str) -> bool:
    if raw is None:
        return False
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    raise InvalidInput("must be true or false", field=field)


# --- operations -------------------------------------------------------------------------------


def lg_put(
    *, tenant: Tenant, actor: Actor, namespace: Any, key: Any, value: Any, ttl: Any = None, index: Any = None
) -> None:
    """Create or replace an item (``memory.write``). ``index`` is accepted and ignored: every
    value is indexed for search. A put without ``ttl`` gives the item the tenant's
    retention rule default TTL for its key, from now, or no expiry without a rule."""
    namespace = namespace_labels(namespace)
    key = item_key(key)
    if not isinstance(value, dict):
        raise InvalidInput("must be a JSON object", field="value")
    if (
        index is not None
        and index is not False
        and not (isinstance(index, list) and all(isinstance(i, str) for i in index))
    ):
        raise InvalidInput("must be false or a list of field paths", field="index")
    minutes = None
    if ttl is not None:
        if isinstance(ttl, float) and ttl.is_integer():
            ttl = int(ttl)
        minutes = _bounded(ttl, field="ttl", default=0, low=1, high=TTL_MAX_MINUTES)
    try:
        mem.memory_write(
            tenant=tenant,
            actor=actor,
            key=item_memory_key(namespace, key),
            value=value,
            ttl_seconds=minutes * 60 if minutes else None,
            tags=[f"{TTL_TAG}{minutes}"] if minutes else [],
            clear_ttl=True,
        )
    except Forbidden as exc:
        _blame(exc, actor, namespace)
        raise


def _blame(exc: Forbidden, actor: Actor, namespace: tuple[str, ...]) -> None:
    """A refusal for the key's allowlist names "key" (the memory's): name the item's field
    at fault — its ``key`` when an entry allows single keys of this namespace (a bare
    ``lg:users:u1:prefs``; ``lg:users:u1:sub:`` allows none), else its ``namespace``."""
    if exc.code != "key_not_allowed" or exc.field != "key":
        return
    prefix = namespace_prefix(namespace)
    bare_key_here = any(
        entry.startswith(prefix) and ":" not in entry[len(prefix) :] for entry in actor.allowed_prefixes or ()
    )
    exc.field = "key" if bare_key_here else "namespace"


def _ttl_minutes(memory: Memory) -> int | None:
    # Any surface may write tags: a ttl tag that no put could have written is not this
    # store's (its refresh would be a 400 naming ttl_seconds on a read).
    for tag in memory.tags or ():
        if tag.startswith(TTL_TAG):
            minutes = validation.ascii_int(tag[len(TTL_TAG) :])
            return minutes if minutes is not None and 1 <= minutes <= TTL_MAX_MINUTES else None
    return None


def _refreshes(memory: Memory) -> bool:
    return bool(_ttl_minutes(memory)) and memory.expires_at is not None


def _refresh_seconds(memory: Memory) -> int | None:
    return _ttl_minutes(memory) * 60 if _refreshes(memory) else None


def lg_get(*, tenant: Tenant, actor: Actor, namespace: Any, key: Any, refresh_ttl: Any = None) -> dict:
    """One item (``memory.read``); :class:`NotFound` when there is none. ``refresh_ttl``:
    the item's TTL starts again — its expiry moves, only that, told by the read's own event
    (``detail.ttl_refreshed``), scope ``memory:write``: ``memories.memory_read``."""
    namespace = namespace_labels(namespace)
    key = item_key(key)
    refresh = _flag(refresh_ttl, "refresh_ttl")
    try:
        memory = mem.memory_read(
            tenant=tenant,
            actor=actor,
            key=item_memory_key(namespace, key),
            refresh_ttl=_refresh_seconds if refresh else None,
        ).memory
    except Forbidden as exc:
        _blame(exc, actor, namespace)
        raise
    return item_of(memory)


def lg_delete(*, tenant: Tenant, actor: Actor, namespace: Any, key: Any) -> None:
    """Move the item to the trash (``memory.delete``); deleting a missing item is no error
    (LangGraph's delete is idempotent; the miss is audited as ``not_found``)."""
    namespace = namespace_labels(namespace)
    key = item_key(key)
    try:
        mem.memory_delete(tenant=tenant, actor=actor, key=item_memory_key(namespace, key))
    except NotFound:
        pass
    except Forbidden as exc:
        _blame(exc, actor, namespace)
        raise


def lg_search(
    *,
    tenant: Tenant,
    actor: Actor,
    namespace_prefix_: Any = (),
    filter_: Any = None,
    limit: Any = None,
    offset: Any = None,
    query: Any = None,
    refresh_ttl: Any = None,
) -> SearchPage:
    """Items under a namespace prefix that match ``filter``. With ``query``: ranked by
    ZeroMem's search (``memory.search``, scope memory:search), each with its ``score``;
    without: ordered by key (``memory.list``, scope memory:read). A page stops before its
    values pass ``ZEROMEM_PAGE_VALUES_MAX_BYTES`` (at least one item): the page's ``cut`` says
    so, and the next page is at ``offset`` + the items returned. Only the page's values are
    read (and, with a filter, those it judges: :func:`_fill`). The audit event counts the
    items returned; ``refresh_ttl`` moves their expiry in its transaction
    (:func:`_answer`)."""
    labels = namespace_labels(namespace_prefix_, field="namespace_prefix", allow_empty=True)
    flt = check_filter(filter_)
    limit = _bounded(limit, field="limit", default=10, low=1, high=validation.LIMIT_MAX)
    offset = _bounded(offset, field="offset", default=0, low=0, high=settings.ZEROMEM_LANGGRAPH_SCAN_MAX)
    refresh = _flag(refresh_ttl, "refresh_ttl")
    prefix = validation.prefix(namespace_prefix(labels), field="namespace_prefix")
    if query is not None and query != "":
        if offset + limit > validation.LIMIT_MAX:
            raise InvalidInput(f"offset + limit must be at most {validation.LIMIT_MAX} with a query", field="offset")
        return _ranked(
            tenant=tenant, actor=actor, prefix=prefix, query=query, flt=flt, offset=offset, limit=limit, refresh=refresh
        )
    return _scan(tenant=tenant, actor=actor, prefix=prefix, flt=flt, offset=offset, limit=limit, refresh=refresh)


class SearchPage(list):
    """A page of :func:`lg_search`'s items; ``cut``: it stopped at the byte budget, and more
    items follow at ``offset`` + its length (fewer items than ``limit`` is otherwise the end)."""

    def __init__(self, items=(), *, cut: bool = False):
        super().__init__(items)
        self.cut = cut


def _ranked(
    *, tenant: Tenant, actor: Actor, prefix: str, query: Any, flt: dict, offset: int, limit: int, refresh: bool
) -> SearchPage:
    """The ranked search: ids and scores from ZeroMem's search (no value), the live ones
    under it in one query of ids and keys (with a filter, whether the database's part of it
    may hold), then :func:`_fill`. Before, the 200 values ranked were loaded whatever the page
    kept: 51 MB for a page of 16 at a 256 KB value cap."""
    with audited_operation(tenant=tenant, actor=actor, action="memory.search", target=prefix, atomic=False) as op:
        query = validation.query(query)
        require_scope(actor, Scope.MEMORY_SEARCH)
        try:
            pushed = _pushdown(flt) if flt and connection.vendor == "postgresql" else None
        except _NoMatch:
            op.record(target=prefix, count=0)
            return SearchPage()
        with search_budget(tenant.pk):
            ranked = search.search_ranked_ids(
                tenant=tenant, prefixes=actor.prefix_filters(prefix), query=query, limit=validation.LIMIT_MAX
            )
        rows = Memory.objects.for_tenant(tenant).live().filter(pk__in=[pk for pk, _ in ranked])
        if pushed is not None:
            # A sealed value is an envelope to the database: the matcher judges it.
            may = ExpressionWrapper(pushed | Q(sensitive=True), output_field=BooleanField())
            found = {pk: (key, m) for pk, key, m in rows.annotate(may=may).values_list("pk", "key", "may")}
        else:
            found = {pk: (key, True) for pk, key in rows.values_list("pk", "key")}
        live = [(pk, score) for pk, score in ranked if pk in found][: validation.LIMIT_MAX]
        candidates = [(pk, score) for pk, score in live if found[pk][1] and parse_key(found[pk][0]) is not None]
        page, cut = _fill(tenant, candidates, flt, offset=offset, limit=limit)
        return _answer(op, tenant, actor, prefix, page, cut=cut, refresh=refresh)


def _scan(
    *, tenant: Tenant, actor: Actor, prefix: str, flt: dict, offset: int, limit: int, refresh: bool
) -> SearchPage:
    with audited_operation(tenant=tenant, actor=actor, action="memory.list", target=prefix, atomic=False) as op:
        require_scope(actor, Scope.MEMORY_READ)
        live = selectors.memories_live(tenant=tenant, prefixes=actor.prefix_filters(prefix)).order_by("key")
        cap = settings.ZEROMEM_LANGGRAPH_SCAN_MAX
        qs = live  # the window: the first `cap` items, whatever the filter (_in_key_order)
        if connection.vendor == "postgresql":
            # Equalities (jsonb @>) and ranges (jsonpath) narrow the window in the database, so
            # fewer values travel; the matcher checks again. Inside the window: the cap applied to the rows
            # that matched read every item under the prefix for a rare value. A sensitive item
            # is an envelope there (a tenant rule may encrypt any put): it passes to the
            # matcher, which sees its opened value.
            try:
                pushed = _pushdown(flt)
            except _NoMatch:
                # A range operand that is no number ("abc", null, true, NaN): the matcher
                # answers False for every value, so no row is read.
                op.record(target=prefix, count=0)
                return SearchPage()
            if pushed is not None:
                # The window as a key range: up to its last key (one short index scan), not
                # "id IN (the window)", whose semi-join the planner turned into a nested loop
                # re-running the window per row when a namespace's statistics were stale
                # (10,000 items loaded, not yet analyzed: 12-15 s for one search).
                last = live.values_list("key", flat=True)[cap - 1 : cap].first()
                bounded = live if last is None else live.filter(key__lte=last)
                qs = bounded.filter(pushed | Q(sensitive=True))
        keys = _in_key_order(qs, cap=cap, first=offset + limit + 1)
        candidates = ((pk, None) for pk, key in keys if parse_key(key) is not None)
        page, cut = _fill(tenant, candidates, flt, offset=offset, limit=limit)
        return _answer(op, tenant, actor, prefix, page, cut=cut, refresh=refresh)


def _in_key_order(qs, *, cap: int, first: int):
    """(id, key) of the first ``cap`` rows of ``qs`` (ordered by key), no value: read in
    keyset chunks of ``first`` rows (at least 100), then twice as many each time (at most
    2,000), only as far as the caller goes."""
    read, after, size = 0, None, max(first, 100)
    while read < cap:
        part = qs if after is None else qs.filter(key__gt=after)
        want = min(size, cap - read)
        rows = list(part.values_list("pk", "key")[:want])
        yield from rows
        if len(rows) < want:
            return
        read, after, size = read + len(rows), rows[-1][1], min(size * 2, 2000)


# How many candidates a filtered page measures at once (their sizes: no value is sent).
_JUDGED_CHUNK = 200


def _fill(tenant: Tenant, candidates, flt: dict, *, offset: int, limit: int) -> tuple[list[tuple[Memory, Any]], bool]:
    """The page of ``candidates`` — ``(memory id, score or None)`` in the search's order,
    items under the prefix, live when read — at ``offset``, at most ``limit`` items whose
    values hold at most ``ZEROMEM_PAGE_VALUES_MAX_BYTES`` (at least one: ``selectors.sized``'s
    measure, by the database); and whether the budget cut it. Without a filter only the
    page's values are read: the window's sizes (no value sent; 16, 64, 256 rows at a time, as
    far as the budget goes), then its values by id. With
    one, the values must be judged: those of the next candidates, in batches of as many rows
    as the page (and the offset) can still take and as many bytes as its budget has left (at
    least one row; twice as many each batch that leaves the page short, for a filter that
    matches few). An item gone since it was found is left out, as if read a moment later."""
    budget = settings.ZEROMEM_PAGE_VALUES_MAX_BYTES
    pending = iter(candidates)
    if not flt:
        window = list(itertools.islice(pending, offset, offset + limit))
        kept, total, cut = [], 0, False
        start, step = 0, 16
        # Measured 16, then 64, 256 rows at a time: the database renders each value's text to
        # measure it (200 values of 250 KB: 0.16 s), so a page the budget cuts early measures few.
        while start < len(window) and not cut:
            part = window[start : start + step]
            sizes = selectors.value_sizes(tenant=tenant, ids=[pk for pk, _ in part])
            for pk, extra in part:
                if pk not in sizes:
                    continue
                if kept and total + sizes[pk] > budget:
                    cut = True
                    break
                kept.append((pk, extra))
                total += sizes[pk]
            start, step = start + step, step * 4
        rows = selectors.memories_by_ids(tenant=tenant, ids=[pk for pk, _ in kept])
        return [(rows[pk], extra) for pk, extra in kept if pk in rows], cut
    out: list[tuple[Memory, Any]] = []
    total = skipped = 0
    grow = 1
    while chunk := list(itertools.islice(pending, _JUDGED_CHUNK)):
        sizes = selectors.value_sizes(tenant=tenant, ids=[pk for pk, _ in chunk])
        chunk = [(pk, extra) for pk, extra in chunk if pk in sizes]
        i = 0
        while i < len(chunk):
            rows_max = ((offset - skipped) + (limit - len(out))) * grow
            bytes_max = max(budget - total, budget * grow // 64)
            batch, weight = [], 0
            while i < len(chunk) and len(batch) < rows_max:
                size = sizes[chunk[i][0]]
                if batch and weight + size > bytes_max:
                    break
                batch.append(chunk[i])
                weight += size
                i += 1
            rows = selectors.memories_by_ids(tenant=tenant, ids=[pk for pk, _ in batch])
            for pk, extra in batch:
                memory = rows.get(pk)
                if memory is None or not item_matches(memory.value, flt):
                    continue
                if skipped < offset:
                    skipped += 1
                    continue
                if out and total + sizes[pk] > budget:
                    return out, True
                out.append((memory, extra))
                total += sizes[pk]
                if len(out) >= limit:
                    return out, False
            grow = min(grow * 2, 64)
    return out, False


def _answer(
    op: AuditedOperation,
    tenant: Tenant,
    actor: Actor,
    prefix: str,
    page: list[tuple[Memory, Any]],
    *,
    cut: bool,
    refresh: bool,
) -> SearchPage:
    """The search's answer and its event, which counts the items returned. ``refresh``:
    their expiry moves (``memories.expiry_refresh``: no version, no value written again) in
    one transaction with the event, whose ``detail.ttl_refreshed`` counts them; refused
    (``memory:write``) in the event before the key is charged (:func:`_charge_refreshes`). An
    item deleted or expired since the page was read is left out, never brought back."""
    due = [(memory, _ttl_minutes(memory) * 60) for memory, _ in page if _refreshes(memory)] if refresh else []
    if not due:
        op.record(target=prefix, count=len(page))
        return SearchPage((item_of(memory, score) for memory, score in page), cut=cut)
    require_scope(actor, Scope.MEMORY_WRITE)
    _charge_refreshes(actor, len(due))
    with transaction.atomic():
        refreshed = mem.expiry_refresh(tenant=tenant, actor=actor, due=due)
        missed = [memory.pk for memory, _ in due if memory.pk not in refreshed]
        if missed:
            # Not refreshed: gone (left out) or written since (listed as read; its writer's expiry).
            alive = set(selectors.memories_live(tenant=tenant).filter(pk__in=missed).values_list("pk", flat=True))
            page = [(memory, score) for memory, score in page if memory.pk not in set(missed) - alive]
        op.record(target=prefix, count=len(page), detail={"ttl_refreshed": len(refreshed)})
        op.write_now()
    return SearchPage((item_of(memory, score) for memory, score in page), cut=cut)


def _charge_refreshes(actor: Actor, items: int) -> None:
    """A search with ``refresh_ttl`` moves the expiry of each item it refreshes (one UPDATE of
    up to ``LIMIT_MAX`` rows): one unit of an API key's rate limit per item, before any is
    refreshed (past the limit the search is refused, 429 ``rate_limited``)."""
    rate_limit_charge_items(
        actor,
        items,
        field="refresh_ttl",
        message=f"refresh_ttl refreshes the TTL of the {items} items found, one unit of the API key's rate limit "
        "each, past what is left of it this minute; try again later, with a smaller limit, or without refresh_ttl",
    )


class _NoMatch(Exception):
    """A filter no value can match (:func:`_pushdown`)."""


class _PathExists(Func):
    """``jsonb_path_exists(value, path, vars, silent => true)``: a path's error (a missing
    field in strict mode) is no match rather than an error."""

    output_field = BooleanField()

    def __init__(self, path: str, variables: dict[str, float]):
        super().__init__(F("value"))
        self.path, self.variables = path, json.dumps(variables)

    def as_sql(self, compiler, connection, **extra):
        sql, params = compiler.compile(self.source_expressions[0])
        return f"jsonb_path_exists({sql}, %s::jsonpath, %s::jsonb, true)", (*params, self.path, self.variables)


def _pushdown(flt: dict) -> Q | None:
    """The part of ``flt`` the database checks, a superset of what :func:`item_matches`
    accepts (it judges every row the query returns); None when nothing is pushed. Raises
    :class:`_NoMatch` when no value can match."""
    pushed = [q for q in (_pushed((k,), v) for k, v in flt.items()) if q is not None]
    variables: dict[str, float] = {}
    ranges = _ranges(flt, (), variables)
    if ranges:
        pushed.append(Q(_PathExists("strict $ ? (" + " && ".join(ranges) + ")", variables)))
    return _all(pushed)


def _all(qs: list[Q | None]) -> Q | None:
    qs = [q for q in qs if q is not None]
    return functools.reduce(operator.and_, qs) if qs else None


def _nest(path: tuple[str, ...], leaf: Any) -> dict:
    for label in reversed(path):
        leaf = {label: leaf}
    return leaf


class _At(Func):
    """A test of the value at ``path`` (``#>``: NULL where a field is missing or an object is
    not one) against the JSON ``operand`` (jsonb equality: strings byte for byte, numbers by
    value, no number equals a boolean): ``"eq"`` equal, ``"ne"`` not equal (a missing field included),
    ``"present"`` present and not null, ``"null"`` missing or null."""

    output_field = BooleanField()
    _TESTS = {
        "eq": "({at}) = %s::jsonb",
        "ne": "({at}) IS DISTINCT FROM %s::jsonb",
        "present": "({at}) <> %s::jsonb",
        "null": "coalesce({at}, 'null'::jsonb) = %s::jsonb",
    }

    def __init__(self, path: tuple[str, ...], test: str, operand: Any = None):
        super().__init__(F("value"))
        self.path, self.test, self.operand = list(path), test, json.dumps(operand)

    def as_sql(self, compiler, connection, **extra):
        sql, params = compiler.compile(self.source_expressions[0])
        at = f"{sql} #> %s::text[]"
        return "(" + self._TESTS[self.test].format(at=at) + ")", (*params, self.path, self.operand)


def _pushed(path: tuple[str, ...], wanted: Any) -> Q | None:
    """The values ``{path: wanted}`` matches (:func:`value_matches`) as a condition on the
    item's value, a superset, or None when there is none to push. Fields and nested objects as
    jsonb containment (an object at each level, as the matcher wants); ``$eq`` as Python's
    ``==``; ``$ne`` keeps every row but those whose value jsonb proves equal (:func:`_unequal`);
    ranges are :func:`_ranges`' (no other operator passes check_filter)."""
    if isinstance(wanted, dict):
        if any(k.startswith("$") for k in wanted):  # operators only (check_filter)
            return _all(
                [
                    _equal(path, wanted["$eq"], literal=True) if "$eq" in wanted else None,
                    _unequal(path, wanted["$ne"]) if "$ne" in wanted else None,
                ]
            )
        return _all([Q(value__contains=_nest(path, {}))] + [_pushed((*path, k), v) for k, v in wanted.items()])
    return _equal(path, wanted, literal=False)


def _equal(path: tuple[str, ...], wanted: Any, *, literal: bool) -> Q | None:
    """``value_matches(value at path, wanted)`` (``literal``: ``value == wanted``, the ``$eq``
    operand, whose objects are values, not filters). A number or a boolean matches its equal of
    the other kind too (``1 == 1.0 == True``; jsonb compares numbers by value, not booleans with
    numbers). Null also matches a missing field. Lists and objects: containment of their parts
    :func:`_containable` keeps, in any order (the matcher checks the length and the order)."""
    if wanted is None:
        return Q(_At(path, "null"))
    if isinstance(wanted, str):
        return Q(value__contains=_nest(path, wanted))
    if isinstance(wanted, bool):
        return Q(value__contains=_nest(path, wanted)) | Q(value__contains=_nest(path, int(wanted)))
    if isinstance(wanted, int | float):
        if not math.isfinite(wanted):
            return None  # not JSON (inf never equals a stored value; nan nothing)
        q = Q(value__contains=_nest(path, wanted))
        if isinstance(wanted, float) and wanted.is_integer() and abs(wanted) >= 2**53:
            # Python compares an int with a float exactly; the float's JSON digits are its
            # shortest (1.2345678901234567e+19 is ...567000, the int it equals ...567168).
            q |= Q(value__contains=_nest(path, int(wanted)))
        return q | Q(value__contains=_nest(path, bool(wanted))) if wanted in (0, 1) else q
    if _plain(wanted, literal=literal):
        return Q(_At(path, "eq", wanted))
    part = _containable(wanted, literal=literal)
    return None if part is _SKIP else Q(value__contains=_nest(path, part))


def _plain(wanted: Any, *, literal: bool) -> bool:
    """Whether ``wanted`` (a list, or a ``$eq`` object) matches exactly the values jsonb finds
    equal to it: strings, null, numbers :func:`_exact` takes but 0 and 1 (``True`` equals
    those), lists of those, and in a ``$eq`` operand objects of those (in a filter an object
    matches any object holding its fields)."""
    if wanted is None or isinstance(wanted, str):
        return True
    if isinstance(wanted, bool):
        return False
    if isinstance(wanted, int | float):
        return _exact(wanted) and wanted not in (0, 1)
    if isinstance(wanted, list):
        return all(_plain(w, literal=literal) for w in wanted)
    if isinstance(wanted, dict):
        return literal and all(_plain(w, literal=literal) for w in wanted.values())
    return False


_SKIP = object()


def _containable(wanted: Any, *, literal: bool, in_list: bool = False) -> Any:
    """The part of ``wanted`` (an element of a list or object the matcher compares) that any
    value it matches contains in the jsonb sense, or ``_SKIP`` for none: strings, null (in a
    list, or a ``$eq`` object, where the field must be present), numbers that only a number
    of the same value equals (not 0 or 1, which ``True``/``False`` equal, nor a float past
    2^53, whose JSON digits are not its value), lists and objects of those; in a filter, an
    operator object contributes its ``$eq``."""
    if isinstance(wanted, str):
        return wanted
    if wanted is None:
        return None if (literal or in_list) else _SKIP
    if isinstance(wanted, bool):
        return _SKIP
    if isinstance(wanted, int | float):
        if not math.isfinite(wanted) or wanted in (0, 1) or (isinstance(wanted, float) and abs(wanted) >= 2**53):
            return _SKIP
        return wanted
    if isinstance(wanted, list):
        parts = [_containable(w, literal=literal, in_list=True) for w in wanted]
        return [p for p in parts if p is not _SKIP]
    if isinstance(wanted, dict):
        if not literal and any(k.startswith("$") for k in wanted):
            return _containable(wanted["$eq"], literal=True, in_list=in_list) if "$eq" in wanted else _SKIP
        parts = {k: _containable(v, literal=literal) for k, v in wanted.items()}
        return {k: p for k, p in parts.items() if p is not _SKIP}
    return _SKIP


def _exact(operand: Any) -> bool:
    """Whether jsonb's equality with ``operand`` implies Python's ``==`` on the value read back:
    strings, booleans, null, numbers below 2^53 (a stored decimal of the same value reads as
    that number), lists and objects of those."""
    if operand is None or isinstance(operand, str | bool):
        return True
    if isinstance(operand, int | float):
        return math.isfinite(operand) and abs(operand) < 2**53
    if isinstance(operand, list):
        return all(_exact(x) for x in operand)
    if isinstance(operand, dict):
        return all(_exact(x) for x in operand.values())
    return False


def _unequal(path: tuple[str, ...], operand: Any) -> Q | None:
    """``value != operand``: every row but those whose value at ``path`` jsonb proves equal
    to ``operand`` (a superset: ``1`` and ``true`` are unequal to jsonb, equal to Python, so
    such a row passes and the matcher drops it). ``$ne: null`` keeps the items whose field is
    present and not null (the matcher reads a missing field as None)."""
    if not _exact(operand):
        return None
    return Q(_At(path, "present" if operand is None else "ne", operand))


def _ranges(node: dict, path: tuple[str, ...], variables: dict[str, float]) -> list[str]:
    """jsonpath predicates (on the item's value, ``$``) for the ``$gt $gte $lt $lte`` of
    ``node``'s fields, nested objects included (not inside lists). :func:`_operator` compares
    ``float()``s, numeric strings included: a string passes (the matcher decides); a jsonb
    number passes when its exact value is past a bound no number it rounds to a double past
    the operand can miss (float() is monotonic and ``float(repr(b)) == b``):
    ``float(a) > b`` ⇒ ``a > b``; ``float(a) >= b`` ⇒ ``a > nextafter(b, -inf)``; likewise below.
    Booleans, null, lists, objects and a missing field fail the comparison (strict mode: a
    list is not unwrapped), as in the matcher."""
    out: list[str] = []
    for name, wanted in node.items():
        if not isinstance(wanted, dict):
            continue
        here = (*path, name)
        if not any(k.startswith("$") for k in wanted):  # fields (check_filter: not mixed)
            out.extend(_ranges(wanted, here, variables))
            continue
        if not _RANGES.intersection(wanted):
            continue
        tests: list[str] = []
        numbers = True  # whether a number can pass at all
        for op, operand in wanted.items():
            if op not in _RANGES:
                continue
            b = _number(operand)
            if b is None or math.isnan(b):
                raise _NoMatch  # _operator: False for every value
            if op == "$gt":
                sign, bound = ">", b
            elif op == "$gte":
                sign, bound = ">", math.nextafter(b, -math.inf)
            elif op == "$lt":
                sign, bound = "<", b
            else:
                sign, bound = "<", math.nextafter(b, math.inf)
            if math.isinf(bound):
                numbers &= (bound < 0) == (sign == ">")  # > -inf, < inf: any number; else none
                continue
            var = f"b{len(variables)}"
            variables[var] = bound
            tests.append(f"@ {sign} ${var}")
        if not numbers:
            test = '@.type() == "string"'
        else:
            test = '@.type() == "string" || (' + (" && ".join(tests) or '@.type() == "number"') + ")"
        field = "".join("." + json.dumps(label, ensure_ascii=False) for label in here)
        out.append(f"exists(@{field} ? ({test}))")
    return out


def _conditions(raw: Any, field: str) -> tuple[str, ...] | None:
    if raw is None:
        return None
    labels = raw if isinstance(raw, list | tuple) else None
    if labels is None or not all(
        isinstance(x, str) and x and "." not in x and len(x) <= validation.KEY_MAX_LEN for x in labels
    ):
        raise InvalidInput(
            f"must be a list of labels of 1-{validation.KEY_MAX_LEN} characters without '.' ('*' matches any label)",
            field=field,
        )
    return tuple(labels)


def _path_matches(namespace: tuple[str, ...], path: tuple[str, ...], *, suffix: bool) -> bool:
    if len(namespace) < len(path):
        return False
    pairs = zip(reversed(namespace), reversed(path), strict=False) if suffix else zip(namespace, path, strict=False)
    return all(p == "*" or n == p for n, p in pairs)


def lg_list_namespaces(
    *,
    tenant: Tenant,
    actor: Actor,
    prefix: Any = None,
    suffix: Any = None,
    max_depth: Any = None,
    limit: Any = None,
    offset: Any = None,
) -> list[list[str]]:
    """Distinct namespaces holding items, sorted; ``prefix``/``suffix`` label paths ("*" any
    label), ``max_depth`` truncates (then deduplicates). ``memory.list``, scope memory:read."""
    pre = _conditions(prefix, "prefix")
    suf = _conditions(suffix, "suffix")
    if max_depth is not None:
        max_depth = _bounded(max_depth, field="max_depth", default=0, low=1, high=validation.KEY_MAX_LEN)
    limit = _bounded(limit, field="limit", default=100, low=1, high=1000)
    offset = _bounded(offset, field="offset", default=0, low=0, high=settings.ZEROMEM_LANGGRAPH_SCAN_MAX)
    fixed = []
    for label in pre or ():
        if label == "*":
            break
        fixed.append(label)
    db_prefix = validation.prefix(namespace_prefix(tuple(fixed)), field="prefix")
    with audited_operation(tenant=tenant, actor=actor, action="memory.list", target=db_prefix, atomic=False) as op:
        require_scope(actor, Scope.MEMORY_READ)
        rows = selectors.namespaces_live(
            tenant=tenant, prefixes=actor.prefix_filters(db_prefix), limit=settings.ZEROMEM_LANGGRAPH_SCAN_MAX
        )
        found: set[tuple[str, ...]] = set()
        for ns in rows:
            parsed = parse_key(ns + ":_")
            if parsed is None or not parsed[0]:
                continue
            labels = parsed[0]
            if pre is not None and not _path_matches(labels, pre, suffix=False):
                continue
            if suf is not None and not _path_matches(labels, suf, suffix=True):
                continue
            found.add(labels[:max_depth] if max_depth else labels)
        page = sorted(found)[offset : offset + limit]
        op.record(target=db_prefix, count=len(page))
        return [list(ns) for ns in page]
