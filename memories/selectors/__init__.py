"""Read-only queries over memories. No permissions, no audit: services wrap these.

The admin dashboard's figures are in :mod:`memories.selectors.dashboard`.
"""

import functools
import json
import unicodedata
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.db.models import BooleanField, Model, Q, QuerySet
from django.db.models.base import ModelState
from django.db.models.expressions import RawSQL
from django.utils import timezone

from memories import keyring
from memories.models import Memory, MemoryVersion, OpensSealedValues, Tenant
from zeromem.kernel import hotsql
from zeromem.kernel.crypto import Unopened
from zeromem.kernel.deadlines import first_rows
from zeromem.kernel.errors import Unavailable
from zeromem.kernel.keyprefix import EXACT, startswith_q

# recall with only a prefix looks at no more than this many rows per index walk.
SALIENT_SCAN = 1000


def _prefix_q(prefixes: list[str]) -> Q:
    # Each prefix is a LIKE 'p%' range scan on the (tenant, key) index; the key column uses
    # the "C" collation on PostgreSQL so that such scans can use a plain btree (on SQLite,
    # whose LIKE ignores case, with an exact comparison besides: zeromem/kernel/keyprefix.py).
    q = Q()
    for p in prefixes:
        q |= startswith_q("key", p) if p else Q()
    return q


def memories_live(*, tenant: Tenant, prefixes: list[str] | None = None) -> QuerySet[Memory]:
    qs = Memory.objects.for_tenant(tenant).live()
    if prefixes is not None:
        if not prefixes:  # an allowlist that shares nothing with the requested prefix
            return qs.none()
        qs = qs.filter(_prefix_q(prefixes))
    return qs


def memory_get_live(*, tenant: Tenant, key: str) -> Memory | None:
    """One index lookup on (tenant, key) among live rows (unique, so no ORDER BY).

    The hot read: the ORM compiles its SQL, and works out the columns and their converters,
    once per process (:func:`_plan`); each call runs it on a plain cursor and builds the
    instance as the ORM's iterator does (``Model.from_db``). Compiling it was about a tenth
    of a read's CPU, and going through ``raw()`` (column names from the cursor, converters
    looked up per call) another quarter."""
    db = connections[DEFAULT_DB_ALIAS]  # the wrapper, once: each proxied attribute is a lookup
    now = _EXPIRES_AT.get_db_prep_value(timezone.now(), db)
    return _fetch_one(_plan("live_by_key", db.vendor), {"tenant": tenant.pk, "key": key, "now": now}, db)


def memory_lock_current(*, tenant: Tenant, key: str) -> Memory | None:
    """The memory at ``key`` that is not in the trash (expired or not), locked ``FOR
    UPDATE`` until the transaction ends: what a write replaces. Compiled once, as
    :func:`memory_get_live`."""
    db = connections[DEFAULT_DB_ALIAS]
    return _fetch_one(_plan("current_for_update", db.vendor), {"tenant": tenant.pk, "key": key}, db)


_EXPIRES_AT = Memory._meta.get_field("expires_at")
_SENTINELS = {
    "tenant": -7_919_101,
    "key": "\x01zeromem-sentinel-key",
    "now": datetime(2001, 2, 3, 4, 5, 6, 789_000, tzinfo=UTC),
    "ids": -7_919_102,
}
# The querysets compiled once, built with the sentinels in place of their values.
_PLANNED = {
    "live_by_key": lambda s: Memory.objects.filter(tenant_id=s["tenant"]).live(now=s["now"]).filter(key=s["key"])[:1],
    "current_for_update": lambda s: (
        Memory.objects.filter(tenant_id=s["tenant"], key=s["key"], deleted_at__isnull=True)
        .select_for_update()
        .order_by("pk")[:1]
    ),
    # PostgreSQL only: the IN list becomes one array parameter (``= ANY(%s)``), so that one
    # SQL text serves any number of ids.
    "live_by_ids": lambda s: Memory.objects.filter(tenant_id=s["tenant"]).live(now=s["now"]).filter(pk__in=[s["ids"]]),
}


@dataclass(frozen=True)
class _Plan:
    name: str
    sql: str
    order: tuple[str, ...]  # which value each parameter is
    query: Any  # the compiled Query, for the converters
    columns: tuple  # the selected column expressions, in order
    attnames: tuple[str, ...]  # the model attribute each column fills


@functools.cache
def _plan(name: str, vendor: str) -> _Plan:
    """A queryset of :data:`_PLANNED` as the ORM compiles it for this database: its SQL,
    which value each parameter is (found by compiling it with sentinels), and the columns it
    selects (the manager's deferrals included)."""
    s = _SENTINELS
    qs = _PLANNED[name](s)
    compiler = qs.query.get_compiler(connection=connection)
    with transaction.atomic(savepoint=False):  # FOR UPDATE compiles only inside one (sends nothing)
        sql, params = compiler.as_sql()
    by_value = {
        s["tenant"]: "tenant",
        s["key"]: "key",
        _EXPIRES_AT.get_db_prep_value(s["now"], connection): "now",
        s["ids"]: "ids",
    }
    order = tuple(by_value[p] for p in params)  # a KeyError here: the query changed shape
    if "ids" in order:
        pk = connection.ops.quote_name(Memory._meta.db_table) + "." + connection.ops.quote_name("id")
        if vendor != "postgresql" or sql.count(f"{pk} IN (%s)") != 1:
            raise RuntimeError(f"{name}: expected one IN list of ids, on PostgreSQL")
        sql = sql.replace(f"{pk} IN (%s)", f"{pk} = ANY(%s)")
        # The tenant's own indexes are kept out of this plan (``tenant_id + 0`` matches no
        # index): a handful of ids is always a primary-key lookup, but the planner took the
        # (tenant, key) index and filtered the whole tenant by id whenever its row estimate
        # for the tenant was low — a tenant that grew since the table was last analyzed (in a
        # big shared table that can be long): 166 ms at 100k memories, for every search.
        tenant = connection.ops.quote_name(Memory._meta.db_table) + "." + connection.ops.quote_name("tenant_id")
        if sql.count(f"{tenant} = %s") != 1:
            raise RuntimeError(f"{name}: expected one tenant condition")
        sql = sql.replace(f"{tenant} = %s", f"({tenant} + 0) = %s")
    info = compiler.klass_info
    if compiler.annotation_col_map or info.get("related_klass_infos"):
        raise RuntimeError(f"{name}: expected the plain model's columns")
    if info["select_fields"] != list(range(len(compiler.select))):
        raise RuntimeError(f"{name}: expected the model's columns only")
    columns = tuple(col for col, _sql, _alias in compiler.select)
    attnames = tuple(col.target.attname for col in columns)
    return _Plan(name=name, sql=sql, order=order, query=qs.query, columns=columns, attnames=attnames)


def _fetch_one(plan: _Plan, values: dict, db=None) -> Memory | None:
    if db is None:
        db = connections[DEFAULT_DB_ALIAS]
    row = hotsql.fetchone(plan.sql, [values[name] for name in plan.order], db)
    return None if row is None else _instance(plan, row, db)


def _instance(plan: _Plan, row: tuple, db=None) -> Memory:
    """The row as the ORM's iterator would build it: each column through its converters,
    then ``Memory.from_db`` — or, while that is ``Model.from_db`` plus the opening of a sealed
    value (:class:`memories.models.OpensSealedValues`) and nothing watches instances being
    made (:func:`_built_directly`), the same instance without ``Model.__init__``'s loop over
    the fields (a third of building it): the selected columns as its attributes, its state
    loaded from ``db``, a sealed value opened under the row's tenant."""
    if db is None:
        db = connections[DEFAULT_DB_ALIAS]
    values = _converted(plan, row, db)
    if not _built_directly():
        return Memory.from_db(db.alias, plan.attnames, values)
    new = _new_memory(Memory)
    state = new._state = ModelState()
    state.adding = False
    state.db = db.alias
    new.__dict__.update(zip(plan.attnames, values, strict=True))
    value = new.__dict__.get("value")
    if isinstance(value, Unopened):
        new.value = keyring.open_loaded(value, tenant_id=new.tenant_id)
    return new


_new_memory = object.__new__


def memory_loaded(attnames: tuple[str, ...], values: tuple) -> Memory:
    """A memory loaded with only ``attnames`` (a plain value among them, never a sealed one):
    as :func:`_instance` builds one from its row, the other fields deferred (read from the
    database if asked for)."""
    if not _built_directly():
        # Model.from_db takes the values in the model's field order, not attnames'.
        given = dict(zip(attnames, values, strict=True))
        names = tuple(f.attname for f in Memory._meta.concrete_fields if f.attname in given)
        return Memory.from_db(DEFAULT_DB_ALIAS, names, tuple(given[name] for name in names))
    new = _new_memory(Memory)
    state = new._state = ModelState()
    state.adding = False
    state.db = DEFAULT_DB_ALIAS
    new.__dict__.update(zip(attnames, values, strict=True))
    return new


def _built_directly() -> bool:
    """Whether building a Memory from its row needs nothing but its attributes: its
    ``from_db`` is ``OpensSealedValues.from_db`` over ``Model.from_db``, and its ``__init__``
    only sets them (:func:`zeromem.kernel.hotsql.built_without_init`)."""
    return _plain_from_db() and hotsql.built_without_init(Memory)


@functools.cache
def _plain_from_db() -> bool:
    if Memory.from_db.__func__ is not OpensSealedValues.from_db.__func__:
        return False
    after = Memory.__mro__[Memory.__mro__.index(OpensSealedValues) + 1 :]
    return next(c for c in after if "from_db" in vars(c)) is Model


def _converted(plan: _Plan, row: tuple, db=None) -> tuple | list:
    if db is None:
        db = connections[DEFAULT_DB_ALIAS]
    cached = db.__dict__.get("_zeromem_plan_converters")
    if cached is None:
        cached = db.__dict__["_zeromem_plan_converters"] = {}
    converters = cached.get(plan.name)
    if converters is None:
        # Per connection wrapper (one per thread): a converter may be bound to its ops.
        compiler = plan.query.get_compiler(connection=db)
        converters = cached[plan.name] = list(compiler.get_converters(plan.columns).items())
    if converters:
        row = list(row)
        for pos, (funcs, expression) in converters:
            value = row[pos]
            for func in funcs:
                value = func(value, expression, db)
            row[pos] = value
    return row


# A page of whole values (GET /memories, a memory's history) is loaded in two steps, so that
# no value it will not return leaves the database: the rows with each value's size (its JSON
# text, measured by the database) and only the values of at most ``max_bytes / (limit + 1)``
# bytes (every one of a page under the budget, which is one statement), then — for the rows
# kept whose value was larger — those rows again by primary key (:func:`budgeted`).
# The size is the value's JSON text; for a string, its UTF-8 bytes and two quotes (escapes
# not counted): rendering a string as JSON text took PostgreSQL 161 ms for a page of 201
# values of 256 KB, reading it 19 ms. On PostgreSQL the stored size (no value read: a TOAST
# pointer's) rules out first a value too large to come with the page, whose text is then
# measured once, not twice.
_VALUE_BYTES_SQL = {
    "postgresql": (
        "(CASE WHEN jsonb_typeof({table}.value) = 'string' THEN octet_length({table}.value #>> '{{}}') + 2"
        " ELSE octet_length({table}.value::text) END)"
    ),
    "sqlite": "length(CAST({table}.value AS BLOB))",
}
_SMALL_VALUE_SQL = {
    "postgresql": "CASE WHEN pg_column_size({table}.value) > %s THEN NULL WHEN {size} <= %s THEN {table}.value END",
    "sqlite": "CASE WHEN {size} <= %s THEN {table}.value END",
}


def value_bytes_sql(model) -> str:
    """SQL of the bytes of ``model``'s value as JSON text (see ``_VALUE_BYTES_SQL``)."""
    vendor = "postgresql" if connection.vendor == "postgresql" else "sqlite"
    return _VALUE_BYTES_SQL[vendor].format(table=connection.ops.quote_name(model._meta.db_table))


def sized(qs: QuerySet, *, limit: int, max_bytes: int) -> QuerySet:
    """``qs`` (of Memory or MemoryVersion) with its value deferred, ``value_bytes`` (the
    bytes of the value's JSON text; an envelope's for a sealed one) and ``small_value``
    (the value when it is at most ``max_bytes // (limit + 1)`` bytes, else NULL)."""
    model = qs.model
    table = connection.ops.quote_name(model._meta.db_table)
    vendor = "postgresql" if connection.vendor == "postgresql" else "sqlite"
    size = _VALUE_BYTES_SQL[vendor].format(table=table)
    small = max(1, max_bytes // (limit + 1))
    inline = _SMALL_VALUE_SQL[vendor].format(table=table, size=size)
    field = model._meta.get_field("value")
    # bandit B611 (marked): the SQL is constants of this module; the threshold is a parameter.
    return qs.defer("value").annotate(
        value_bytes=RawSQL(size, []),  # nosec B611
        small_value=RawSQL(inline, [small] * inline.count("%s"), output_field=field),  # nosec B611
    )


def value_sizes(*, tenant: Tenant, ids: list[int]) -> dict[int, int]:
    """``{id: bytes of the value's JSON text}`` (:func:`sized`'s measure: an envelope's for a
    sealed value) of the tenant's memories ``ids``, measured by the database: no value is
    sent. One primary-key lookup."""
    if not ids:
        return {}
    table = connection.ops.quote_name(Memory._meta.db_table)
    size = _VALUE_BYTES_SQL["postgresql" if connection.vendor == "postgresql" else "sqlite"].format(table=table)
    # bandit B611 (marked): the SQL is a constant of this module; it takes no value.
    rows = Memory.objects.filter(tenant_id=tenant.pk, pk__in=ids).annotate(value_bytes=RawSQL(size, []))  # nosec B611
    return dict(rows.values_list("pk", "value_bytes"))


def budgeted(rows: list, *, tenant_id: int, max_bytes: int) -> tuple[list, bool]:
    """The first rows of ``rows`` (from :func:`sized`) whose values hold at most ``max_bytes``
    (always the first row, whatever its size), each with its value; and whether rows were
    left out. A kept row whose value was too large to come with the page is read again by
    primary key (the whole row: value and version of one moment); one gone since (trashed,
    purged) is left out, as if the page had been read a moment later."""
    total, kept = 0, []
    for row in rows:
        total += row.value_bytes or 0
        if kept and total > max_bytes:
            break
        kept.append(row)
    cut = len(kept) < len(rows)
    large = [row.pk for row in kept if row.small_value is None and row.value_bytes is not None]
    again = {}
    if large:
        model = type(kept[0])
        qs = model.objects.filter(tenant_id=tenant_id, pk__in=large)
        if model is Memory:
            qs = qs.filter(deleted_at__isnull=True)
        again = {row.pk: row for row in qs}
    out = []
    for row in kept:
        if row.pk in again:
            out.append(again[row.pk])
            continue
        if row.pk in large:
            continue
        value = row.small_value
        row.value = keyring.open_loaded(value, tenant_id=tenant_id) if isinstance(value, Unopened) else value
        out.append(row)
    return out, cut


def memory_keys_page(
    *,
    tenant: Tenant,
    prefixes: list[str],
    limit: int,
    after: str | None,
    category: str | None = None,
    subject: str | None = None,
    tag: str | None = None,
    keys_only: bool = True,
    sizes: bool = False,
    descending: bool = False,
    max_bytes: int | None = None,
) -> tuple[list, str | None]:
    """Keyset page ordered by key (``descending``: from the last key back, ``after`` then
    being the key the previous page ended on): ``limit + 1`` rows fetched to know if there is more.
    ``max_bytes`` (Memory rows): the page stops before its values pass that many bytes
    (:func:`budgeted`; at least one row), and the next one starts after its last key.

    Returns (keys or Memory rows — with ``sizes``, (key, bytes of the value's text) pairs
    (:func:`keys_and_text_sizes`) — the last key of the page when another page follows)."""
    page = {
        "tenant": tenant,
        "prefixes": prefixes,
        "limit": limit,
        "after": after,
        "category": category,
        "subject": subject,
        "tag": tag,
        "descending": descending,
    }
    if max_bytes is None or keys_only or sizes:
        return _memory_keys_page(**page, keys_only=keys_only, sizes=sizes)
    rows, last = _memory_keys_page(**page, keys_only=False, sizes=False, sized_to=max_bytes)
    rows, cut = budgeted(rows, tenant_id=tenant.pk, max_bytes=max_bytes)
    if cut and rows:
        last = rows[-1].key  # where this page stopped, not where the rows read for it did
    return rows, last


def _memory_keys_page(
    *,
    tenant: Tenant,
    prefixes: list[str],
    limit: int,
    after: str | None,
    category: str | None,
    subject: str | None,
    tag: str | None,
    keys_only: bool,
    sizes: bool,
    descending: bool,
    sized_to: int | None = None,
) -> tuple[list, str | None]:
    def page_of(qs):
        return sized(qs, limit=limit, max_bytes=sized_to) if sized_to is not None else qs

    # A tag few memories carry: those memories through the search index (a page of sizes,
    # which no caller filters by tag, walks the keys).
    indexed = _tag_words_filter(tenant.pk, tag) if tag and not sizes else None
    ranges = _disjoint(prefixes) if prefixes else prefixes
    if indexed is None and not sizes and ranges and len(ranges) > 1 and connection.vendor == "postgresql":
        # Several prefixes (an API key's allowlist): one OR of LIKEs made PostgreSQL read every
        # memory under them and sort them for one page (50 prefixes of 250 memories: 12,500
        # rows, 20 ms for 201 keys). Each prefix's range in key order instead, at most a page
        # of it, merged in order (a Merge Append): about a page of rows, plus one per prefix.
        base = _narrowed(memories_live(tenant=tenant), after, category, subject, tag, descending)
        qs = in_key_order(
            base.values_list("key", flat=True) if keys_only else page_of(base), ranges, limit + 1, descending
        )
        if tag:
            timeout = settings.ZEROMEM_MEMORY_LIST_TIMEOUT_MS
            rows = first_rows(qs, limit + 1, timeout_ms=timeout, timed_out=MemoryListTimeout)
        else:
            rows = list(qs[: limit + 1])
        return _page(rows, limit, keys_only=keys_only, sizes=False)
    if indexed is None:
        qs = memories_live(tenant=tenant, prefixes=prefixes)
    else:
        # The tenant and "live" in the index condition's words (memories/search/lexical.py):
        # no btree on (tenant, ...) nor one partial on live rows serves them, so none joins
        # the tag words' GIN bitmap (a BitmapAnd with the tenant's every row), nor replaces it
        # when the table's statistics are stale (a fresh tenant: its every key was read).
        now = timezone.now()
        qs = Memory.objects.filter(indexed).filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        if prefixes is not None:
            qs = qs.filter(_prefix_q(prefixes)) if prefixes else qs.none()
    qs = _narrowed(qs, after, category, subject, tag, descending).order_by("-key" if descending else "key")
    if not keys_only:
        qs = page_of(qs)
    if sizes:
        rows = keys_and_text_sizes(tenant, qs[: limit + 1])
    elif tag:
        # Under a deadline: a tag's words common, and the tag itself rare, leave the walk over
        # the keys reading the tenant's every memory to fill the page (0.45 s at 1M).
        page = qs.values_list("key", flat=True) if keys_only else qs
        timeout = settings.ZEROMEM_MEMORY_LIST_TIMEOUT_MS
        rows = first_rows(
            page, limit + 1, timeout_ms=timeout, timed_out=MemoryListTimeout, bitmap_only=indexed is not None
        )
    else:
        rows = list(qs.values_list("key", flat=True)[: limit + 1] if keys_only else qs[: limit + 1])
    return _page(rows, limit, keys_only=keys_only, sizes=sizes)


def _narrowed(qs, after, category, subject, tag, descending: bool) -> QuerySet[Memory]:
    if after:
        qs = qs.filter(key__lt=after) if descending else qs.filter(key__gt=after)
    if category:
        qs = qs.filter(category=category)
    if subject:
        qs = qs.filter(subject=subject)
    if tag:
        qs = memories_with_tag(qs, tag)
    return qs


def _page(rows: list, limit: int, *, keys_only: bool, sizes: bool) -> tuple[list, str | None]:
    more = len(rows) > limit
    rows = rows[:limit]
    if not (rows and more):
        return rows, None
    last = rows[-1]
    return rows, (last[0] if sizes else last if keys_only else last.key)


def in_key_order(qs: QuerySet, prefixes: list[str], size: int, descending: bool = False) -> QuerySet:
    """The rows of ``qs`` under ``prefixes`` (not empty, no ``""``) in key order, of which the
    caller reads at most the first ``size``. Several prefixes on PostgreSQL: each one's key
    range in order, ``size`` rows at most, merged (``UNION ALL`` of ordered index ranges, a
    Merge Append), not one OR of LIKEs, which read every row under them and sorted them."""
    order = "-key" if descending else "key"
    ranges = _disjoint(prefixes)
    if len(ranges) < 2 or connection.vendor != "postgresql":
        return qs.filter(_prefix_q(ranges)).order_by(order)
    parts = [qs.filter(_prefix_q([prefix])).order_by(order)[:size] for prefix in ranges]
    return parts[0].union(*parts[1:], all=True).order_by(order)


def _disjoint(prefixes: list[str]) -> list[str]:
    """The filters, sorted, without those another one covers (``user:u1:`` under ``user:``,
    the key ``user:u1`` exactly under ``user:``): their key ranges do not overlap."""
    ranges = [p for p in prefixes if not p.endswith(EXACT)]
    kept = []
    for p in sorted(set(prefixes)):
        key = p[:-1] if p.endswith(EXACT) else p
        if not any(q != p and key.startswith(q) for q in ranges):
            kept.append(p)
    return kept


# The UTF-8 bytes of a value's text as the Claude memory tool shows it: a string as it is,
# other JSON as its JSON text (PostgreSQL's spelling, which is Python's json.dumps but for
# numbers in exponent form).
_TEXT_BYTES_SQL = (
    "octet_length(CASE WHEN jsonb_typeof(memories_memory.value) = 'string' "
    "THEN memories_memory.value #>> '{}' ELSE memories_memory.value::text END)"
)


def text_bytes(value: Any) -> int:
    return len((value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)).encode("utf-8"))


def keys_and_text_sizes(tenant: Tenant, qs: QuerySet[Memory]) -> list[tuple[str, int]]:
    """(key, bytes of the value's text) for the memories of ``qs``, in its order. On
    PostgreSQL the database measures a plaintext value (none is loaded: a listing of 5,000
    values of 256 KB read 1.25 GB to show sizes); a sensitive one is sealed there, so those
    are loaded and opened (one more query, by key). SQLite: every value is loaded."""
    if connection.vendor != "postgresql":
        return [(m.key, text_bytes(m.value)) for m in qs]
    # bandit B611 (marked): _TEXT_BYTES_SQL is a constant of this module; it takes no value.
    measured = qs.annotate(text_bytes=RawSQL(_TEXT_BYTES_SQL, []))  # nosec B611
    rows = list(measured.values_list("key", "text_bytes", "sensitive"))
    sealed = [key for key, _, sensitive in rows if sensitive]
    opened = {}
    if sealed:
        values = memories_live(tenant=tenant).filter(key__in=sealed).values_list("key", "value")
        opened = {key: text_bytes(keyring.open_loaded(value, tenant_id=tenant.pk)) for key, value in values}
    return [(key, opened.get(key, size) if sensitive else size) for key, size, sensitive in rows]


# One step of the walk over the namespaces of a key range: the next namespace holding a live
# memory, read on the (tenant, namespace, key) index (a "loose index scan"). Each step bounds
# (tenant_id, namespace) as one row range rather than "tenant_id = %s AND namespace > ...":
# only an index starting with both columns can serve it, whatever the statistics. With the
# equality, statistics taken before a tenant's bulk import (no rows of it, as far as the
# planner knew) made any index on tenant_id look as cheap, and each step read and sorted the
# whole tenant there (100,000 memories in 20 namespaces: 1.1 s, 0.01 s once analyzed).
_NAMESPACE_WALK_SQL = """
WITH RECURSIVE walk(namespace, n) AS (
    SELECT (SELECT m.namespace FROM memories_memory m
            WHERE (m.tenant_id, m.namespace) >= (%(tenant)s, %(low)s)
              AND (m.tenant_id, m.namespace) < (%(tenant)s, %(high)s) AND {live}
            ORDER BY m.tenant_id, m.namespace LIMIT 1), 1
  UNION ALL
    SELECT (SELECT m.namespace FROM memories_memory m
            WHERE (m.tenant_id, m.namespace) > (%(tenant)s, w.namespace)
              AND (m.tenant_id, m.namespace) < (%(tenant)s, %(high)s) AND {live}
            ORDER BY m.tenant_id, m.namespace LIMIT 1), w.n + 1
    FROM walk w WHERE w.namespace IS NOT NULL AND w.n < %(limit)s
)
SELECT namespace FROM walk WHERE namespace IS NOT NULL
"""
# Whether namespace ``own`` holds a live memory whose key starts with ``low`` (``own`` + ":"),
# as one (tenant_id, namespace, key) row range, for the same reason.
_OWN_NAMESPACE_SQL = """
SELECT 1 FROM memories_memory m
WHERE (m.tenant_id, m.namespace, m.key) >= (%(tenant)s, %(own)s, %(low)s)
  AND (m.tenant_id, m.namespace, m.key) < (%(tenant)s, %(own)s, %(high)s) AND {live}
LIMIT 1
"""
_LIVE_SQL = "m.deleted_at IS NULL AND (m.expires_at IS NULL OR m.expires_at > %(now)s)"


def namespaces_live(*, tenant: Tenant, prefixes: list[str], limit: int) -> list[str]:
    """The distinct namespaces, sorted, of the live memories under ``prefixes`` (filters as
    ``Actor.prefix_filters`` gives them: each ends with ``:`` or names one key exactly), at
    most ``limit``.

    A DISTINCT read every memory under them. On PostgreSQL each filter ``p:`` is a walk
    instead: the keys under ``p:`` are those of namespace ``p`` and of the namespaces from
    ``p:`` up to ``p;``, so each step reads the first live row of the next namespace on the
    (tenant, namespace, key) index — the namespaces' count of steps, each past the dead rows
    (trashed, expired) at the start of its namespace."""
    if connection.vendor != "postgresql" or any(not p.endswith((":", EXACT)) for p in prefixes):
        qs = memories_live(tenant=tenant, prefixes=prefixes).order_by("namespace")
        return list(qs.values_list("namespace", flat=True).distinct()[:limit])
    found: set[str] = set()
    now = timezone.now()
    for p in prefixes:
        if p.endswith(EXACT):
            found.update(memories_live(tenant=tenant, prefixes=[p]).values_list("namespace", flat=True))
            continue
        params = {"tenant": tenant.pk, "own": p[:-1], "low": p, "high": p[:-1] + ";", "limit": limit, "now": now}
        with connection.cursor() as cursor:
            cursor.execute(_OWN_NAMESPACE_SQL.format(live=_LIVE_SQL), params)
            if cursor.fetchone():
                found.add(p[:-1])
            cursor.execute(_NAMESPACE_WALK_SQL.format(live=_LIVE_SQL), params)
            found.update(namespace for (namespace,) in cursor.fetchall())
    return sorted(found)[:limit]


class MemoryListTimeout(Unavailable):
    def __init__(self):
        super().__init__(
            "finding this page took too long and was stopped: few memories carry this tag, so the "
            "page reads the memories in key order until it fills; narrow it with a prefix",
            code="list_timeout",
            field="tag",
            retry_after=1,
        )


# A tag's words are in the search index with the memories that carry it (tenant-prefixed
# terms: memories/search/text.py). A page of the memories with a tag few of them carry reads
# them through that index — at most this many, by the tenant's term statistics — and sorts
# them by key; a commoner tag's page walks the tenant's keys in order (its first rows come
# soon), under the list deadline. Before, every tag walked the keys: a tag no memory carries
# read the whole tenant (70 ms at 50k memories, 0.45 s at 1M).
TAG_INDEX_MAX_DOCS = 5000


def _tag_words_filter(tenant_id: int, tag: str) -> RawSQL | None:
    """The tenant's live memories whose ``search_tsv`` holds every word of ``tag`` (a
    condition each memory carrying it meets), when the tenant's statistics say the rarest
    of them is in at most ``TAG_INDEX_MAX_DOCS`` memories, or one is in none counted (a word
    new since the count: few memories). None — walk the keys — for a commoner tag, a tenant
    never counted, SQLite, a tag with no word (``+++``), or a tag of letters other than
    ASCII and CJK, or with a combining mark: the terms of those changed with the tokenizer
    (combining marks, folded marks), and a memory written before still holds the old ones
    until ``manage.py search_reindex``."""
    from memories.search.text import index_document, is_cjk

    if connection.vendor != "postgresql" or not all(
        c.isascii() or (is_cjk(c) and not unicodedata.category(c).startswith("M")) for c in tag
    ):
        return None
    terms = sorted(set(index_document(key="", value=None, tags=[tag]).tags))
    if not terms:
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT (SELECT documents FROM memories_searchcorpus WHERE tenant_id = %s),
                      (SELECT min(ndoc) FROM memories_searchterm WHERE tenant_id = %s AND term = ANY(%s)),
                      (SELECT count(*) FROM memories_searchterm WHERE tenant_id = %s AND term = ANY(%s))""",
            [tenant_id, tenant_id, terms, tenant_id, terms],
        )
        documents, rarest, known = cursor.fetchone()
    if documents is None or (known == len(terms) and rarest > TAG_INDEX_MAX_DOCS):
        return None
    query = " & ".join(f"'{tenant_id}:{term}'" for term in terms)  # terms are word characters
    return RawSQL(
        "memories_memory.tenant_id + 0 = %s AND coalesce(memories_memory.deleted_at, 'infinity') = 'infinity'"
        " AND memories_memory.search_tsv @@ %s::tsquery",
        [tenant_id, query],
        output_field=BooleanField(),
    )


def memories_with_tag(qs: QuerySet[Memory], tag: str) -> QuerySet[Memory]:
    if connection.vendor == "postgresql":
        return qs.filter(tags__contains=[tag])
    # SQLite has no JSON containment; the JSON text of a list of strings holds the tag as
    # json.dumps spells it (Django stores JSON ASCII-escaped: 中文 is "\u4e2d\u6587").
    return qs.filter(tags__icontains=json.dumps(tag))


def memory_history(*, memory: Memory) -> QuerySet[MemoryVersion]:
    return MemoryVersion.objects.filter(tenant_id=memory.tenant_id, memory=memory).order_by("-version")


# A search that answers at most ``head_chars`` characters of each value (the tools' max_chars):
# the live_by_ids statement with a plain string value longer than that cut by the database to
# its first head_chars + 1 characters (the cut looks at the character after it: see
# memories.services.memories._value_slice), and its whole length as one more column (NULL for
# a value that comes whole: a shorter string, other JSON, a sealed one). The value's text is
# extracted once (the lateral subquery), not once per use.
_HEAD_SQL = """SELECT {columns}, CASE WHEN h.n > %s THEN h.n END
FROM ({planned}) r CROSS JOIN LATERAL (
    SELECT t, length(t) AS n FROM (
        SELECT CASE WHEN NOT r.sensitive AND jsonb_typeof(r.value) = 'string' THEN r.value #>> '{{}}' END AS t
        OFFSET 0
    ) s OFFSET 0
) h"""


@functools.cache
def _head_sql(vendor: str) -> str:
    plan = _plan("live_by_ids", vendor)
    quote = connection.ops.quote_name
    columns = ", ".join(
        "CASE WHEN h.n > %s THEN to_jsonb(left(h.t, %s)) ELSE r.value END"
        if attname == "value"
        else f"r.{quote(column.target.column)}"
        for column, attname in zip(plan.columns, plan.attnames, strict=True)
    )
    return _HEAD_SQL.format(columns=columns, planned=plan.sql)


def memories_by_ids(*, tenant: Tenant, ids: list[int], head_chars: int | None = None) -> dict[int, Memory]:
    """Live memories by primary key (one IN lookup), as {id: memory}.

    Every search loads its ranked memories here: on PostgreSQL the statement is compiled
    once per process (:func:`_plan`, the ids one array parameter) and the rows built as the
    ORM builds them — compiling the queryset was about a third of this call's CPU.

    ``head_chars`` (PostgreSQL; a search cut to that many characters a value): a plain string
    value longer than that comes as its first ``head_chars + 1`` characters only, and the
    memory's ``value_text_chars`` is its whole length (None on every other memory: its value
    is whole). A search of 200 values of 256 KB moved 54 MB into the process for 30 KB of
    answer."""
    if not ids:
        return {}
    if connection.vendor == "postgresql" and head_chars is not None:
        plan = _plan("live_by_ids", connection.vendor)
        values = {"tenant": tenant.pk, "now": timezone.now(), "ids": list(ids)}
        params = [head_chars, head_chars + 1, head_chars, *(values[name] for name in plan.order)]
        loaded = hotsql.fetchall(_head_sql(connection.vendor), params)
        rows = [_converted(plan, row[:-1]) for row in loaded]
        at = plan.attnames.index("value")
        keyring.preload(int(row[at]["k"]) for row in rows if isinstance(row[at], Unopened))
        found = {}
        for row, extra in zip(rows, loaded, strict=True):
            memory = Memory.from_db(connection.alias, plan.attnames, row)
            memory.value_text_chars = extra[-1]
            found[memory.pk] = memory
        return found
    if connection.vendor != "postgresql":
        live = memories_live(tenant=tenant).filter(pk__in=ids)
        # The same one query for the data keys as below: their ids first (the envelope's "k",
        # no value read twice), then the rows, each opening its value with a cached key.
        keyring.preload(k for k in live.filter(sensitive=True).values_list("value__k", flat=True) if k is not None)
        return {m.pk: m for m in live}
    plan = _plan("live_by_ids", connection.vendor)
    values = {"tenant": tenant.pk, "now": timezone.now(), "ids": list(ids)}
    rows = [_converted(plan, row) for row in hotsql.fetchall(plan.sql, [values[name] for name in plan.order])]
    # A search's sealed results are often of as many end users, each with a data key: fetched
    # in one query, not one each (200 results of 200 users, keys not cached: 161 -> 25 ms).
    at = plan.attnames.index("value")
    keyring.preload(int(row[at]["k"]) for row in rows if isinstance(row[at], Unopened))
    return {m.pk: m for m in (Memory.from_db(connection.alias, plan.attnames, row) for row in rows)}


def memories_salient_rows(*, tenant: Tenant, prefixes: list[str] | None) -> list[tuple]:
    """Candidates for recall without a question: ``(id, key, importance, updated_at)`` of the
    most important and most recent live memories under ``prefixes``; the caller ranks them.

    Bounded: at most ``SALIENT_SCAN`` rows from the (tenant, importance desc, updated_at
    desc) index — the tenant's most important, newest first, kept when under a prefix —
    plus, for a prefix, at most ``SALIENT_SCAN`` rows of its key range (the whole subtree
    when it is that small)."""
    if prefixes is not None and not prefixes:
        return []
    fields = ("pk", "key", "importance", "updated_at")
    whole = prefixes is None or "" in prefixes
    rows = list(memories_live(tenant=tenant).order_by("-importance", "-updated_at").values_list(*fields)[:SALIENT_SCAN])
    if not whole:
        # One C call a row, not one per prefix (50 allowed prefixes: 50,000 calls).
        starts = tuple(p for p in prefixes if not p.endswith(EXACT))
        keys = {p[:-1] for p in prefixes if p.endswith(EXACT)}
        rows = [r for r in rows if r[1] in keys or r[1].startswith(starts)]
        under = in_key_order(memories_live(tenant=tenant).values_list(*fields), prefixes, SALIENT_SCAN)
        rows += list(under[:SALIENT_SCAN])
    return list({r[0]: r for r in rows}.values())
