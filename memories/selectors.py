"""Read-only queries over memories. No permissions, no audit: services wrap these."""

from django.conf import settings
from django.db import connection
from django.db.models import BooleanField, Q, QuerySet
from django.db.models.expressions import RawSQL

from memories import embeddings, search, semantic
from memories.models import Memory, MemoryVersion, Tenant

SQLITE_SEARCH_CANDIDATES = 1000


def _prefix_q(prefixes: list[str]) -> Q:
    # Each prefix is a LIKE 'p%' range scan on the (tenant, key) index; the key column uses
    # the "C" collation on PostgreSQL so that such scans can use a plain btree.
    q = Q()
    for p in prefixes:
        q |= Q(key__startswith=p) if p else Q()
    return q


def memories_live(*, tenant: Tenant, prefixes: list[str] | None = None) -> QuerySet[Memory]:
    qs = Memory.objects.for_tenant(tenant).live()
    if prefixes is not None:
        if not prefixes:  # an allowlist that shares nothing with the requested prefix
            return qs.none()
        qs = qs.filter(_prefix_q(prefixes))
    return qs


def memory_get_live(*, tenant: Tenant, key: str) -> Memory | None:
    """One index lookup on (tenant, key) among live rows (unique, so no ORDER BY)."""
    rows = list(Memory.objects.for_tenant(tenant).live().filter(key=key)[:1])
    return rows[0] if rows else None


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
) -> tuple[list, str | None]:
    """Keyset page ordered by key: ``limit + 1`` rows fetched to know if there is more.

    Returns (keys or Memory rows, the last key of the page when another page follows)."""
    qs = memories_live(tenant=tenant, prefixes=prefixes)
    if after:
        qs = qs.filter(key__gt=after)
    if category:
        qs = qs.filter(category=category)
    if subject:
        qs = qs.filter(subject=subject)
    if tag:
        qs = memories_with_tag(qs, tag)
    qs = qs.order_by("key")
    rows = list(qs.values_list("key", flat=True)[: limit + 1] if keys_only else qs[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    last = (rows[-1] if keys_only else rows[-1].key) if rows and more else None
    return rows, last


def memories_with_tag(qs: QuerySet[Memory], tag: str) -> QuerySet[Memory]:
    if connection.vendor == "postgresql":
        return qs.filter(tags__contains=[tag])
    # SQLite has no JSON containment; the JSON text of a list of strings holds "tag" exactly.
    return qs.filter(tags__icontains=f'"{tag}"')


def memory_search(*, tenant: Tenant, prefixes: list[str], query: str, limit: int) -> list[tuple[Memory, float]]:
    """Words and meaning: the word ranking (``memory_search_lexical``) fused with semantic
    similarity (memories/semantic.py). When the question cannot be embedded (model not
    loadable, still loading, switched off) the word ranking alone, as it was.

    Cost on top of the word search: embedding the question (about 2 ms), one index probe,
    the similarity over at most ZEROMEM_SEMANTIC_CANDIDATES cached vectors (2–4 ms at 20k),
    and one SELECT of the semantic-only winners by primary key."""
    lexical = memory_search_lexical(
        tenant=tenant, prefixes=prefixes, query=query, limit=max(limit, semantic.LEXICAL_DEPTH)
    )
    query_vector = embeddings.query_vector(query) if prefixes else None
    if query_vector is None:
        return lexical[:limit]
    sims = semantic.similarities(
        tenant_id=tenant.pk,
        prefixes=None if "" in prefixes else prefixes,
        query_vector=query_vector,
        also=[m.pk for m, _ in lexical],
    )
    if not sims:  # nothing embedded yet, or nothing near: the word ranking as it was
        return lexical[:limit]
    fused = semantic.fuse([(m.pk, s) for m, s in lexical], sims, weight=settings.ZEROMEM_SEMANTIC_WEIGHT)
    # A few spare: a cached vector may belong to a memory trashed or erased since.
    wanted = [memory_id for memory_id, _ in fused[: limit + 10]]
    rows = {m.pk: m for m, _ in lexical}
    missing = [memory_id for memory_id in wanted if memory_id not in rows]
    if missing:
        rows.update(memories_live(tenant=tenant, prefixes=prefixes).in_bulk(missing))
    score = dict(fused)
    return [(rows[memory_id], score[memory_id]) for memory_id in wanted if memory_id in rows][:limit]


def memory_search_lexical(*, tenant: Tenant, prefixes: list[str], query: str, limit: int) -> list[tuple[Memory, float]]:
    """Ranked OR-style match of the query's terms (see memories/search.py).

    PostgreSQL: GIN full-text index on to_tsvector('simple', search_text) plus a pg_trgm
    GIN index for the verbatim-substring match; cost grows with matching rows in the
    tenant's prefix, not with the tenant's size.
    """
    terms = search.query_terms(query)
    qs = memories_live(tenant=tenant, prefixes=prefixes)
    raw = query.strip()
    like = "%" + raw.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    if connection.vendor == "postgresql":
        tsq = search.tsquery(terms)
        table = Memory._meta.db_table
        if tsq:
            # bandit B611 (marked): only the model's own table name is formatted in;
            # the query's text goes in as %s parameters.
            cond = RawSQL(  # nosec B611
                f"""(to_tsvector('simple', "{table}"."search_text") @@ to_tsquery('simple', %s)
                     OR "{table}"."search_text" ILIKE %s)""",
                (tsq, like),
                output_field=BooleanField(),
            )
            rank = RawSQL(  # nosec B611
                f"""ts_rank_cd(to_tsvector('simple', "{table}"."search_text"), to_tsquery('simple', %s), 1)
                    + CASE WHEN "{table}"."search_text" ILIKE %s THEN 1 ELSE 0 END""",
                (tsq, like),
            )
        else:
            cond = RawSQL(f'"{table}"."search_text" ILIKE %s', (like,), output_field=BooleanField())  # nosec B611
            rank = RawSQL("1.0", ())
        rows = qs.filter(cond).annotate(score=rank).order_by("-score", "-importance", "-updated_at")[:limit]
        return [(m, float(m.score)) for m in rows]

    patterns = search.like_patterns(terms)
    q = Q(search_text__icontains=raw)
    for p in patterns:
        q |= Q(search_text__icontains=p)
    candidates = qs.filter(q).order_by("-updated_at")[:SQLITE_SEARCH_CANDIDATES]
    scored = [(m, search.score(m.search_text, terms, raw)) for m in candidates]
    scored = [(m, s) for m, s in scored if s > 0]
    scored.sort(key=lambda ms: (ms[1], ms[0].importance, ms[0].updated_at), reverse=True)
    return scored[:limit]


def memory_history(*, memory: Memory) -> QuerySet[MemoryVersion]:
    return MemoryVersion.objects.filter(tenant_id=memory.tenant_id, memory=memory).order_by("-version")
