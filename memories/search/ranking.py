"""The one place search and recall results are assembled.

``search_ranked`` gathers candidate lists — the lexical one and the semantic one
(memories/search/semantic.py), each ``(memory id, score)`` best first — fuses them into one
order (:func:`fuse`), and loads the memories. ``recall_pack`` turns a ranking (or, with no
question, the most important and most recent memories under a prefix) into one text block.
"""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.utils import timezone

from memories import selectors
from memories.models import Memory, Tenant
from memories.search import semantic, tier
from memories.search.lexical import lexical_hits
from memories.search.text import compact, index_document, value_text

# Extra fused results loaded, so that one dropped on load (trashed since) leaves no gap.
SPARE = 10
# How many ranked memories recall considers before dropping near-duplicates and packing.
RECALL_POOL = 30
# Two memories whose value terms overlap this much (Jaccard) say the same thing: recall
# keeps the most recently updated one.
NEAR_DUPLICATE = 0.8
# A line that does not fit is cut (with "…") when at least this much room is left.
CUT_MIN_CHARS = 40


def _candidate_lists(*, tenant_id: int, prefixes: list[str] | None, query: str, limit: int) -> dict:
    """Each ranker's best matches, ``{name: [(memory id, score), ...]}`` best first: the
    words (read ``semantic.LEXICAL_DEPTH`` deep, for fusion) and, when the question can be
    embedded and something is near it, the meaning (memories/search/semantic.py)."""
    # The semantic half (the question's embedding, its scoring against the cached matrix)
    # runs in the encoder's pool while the word ranking's queries run here: both wait mostly
    # with the GIL released, so a search costs the slower of the two, not their sum.
    meaning = semantic.start(tenant_id=tenant_id, prefixes=prefixes, query=query)
    try:
        # The word matches' stored vectors come with them (one round trip less).
        hits = lexical_hits(
            tenant_id=tenant_id,
            prefixes=prefixes,
            query=query,
            limit=max(limit, semantic.LEXICAL_DEPTH),
            vectors=meaning.vector_kind,
        )
    except BaseException:
        meaning.discard()  # waited for: its CPU is counted to the search
        raise
    lists = {"lexical": hits.ranked}
    similar = meaning.candidates([memory_id for memory_id, _ in hits.ranked], hits.vectors)
    if similar:
        lists["semantic"] = similar
    return lists


def fuse(lists: dict[str, list[tuple[int, float]]], limit: int) -> list[tuple[int, float]]:
    """One order from the candidate lists. With a single list, that list. Words and meaning:
    weighted score fusion (``semantic.fuse``), or reciprocal rank fusion when
    ``ZEROMEM_SEMANTIC_FUSION = "rrf"`` — measured worse at hit@1 (README "Semantic search")."""
    if len(lists) == 1:
        return next(iter(lists.values()))[:limit]
    if settings.ZEROMEM_SEMANTIC_FUSION != "rrf":
        weight = settings.ZEROMEM_SEMANTIC_WEIGHT
        return semantic.fuse(lists["lexical"], dict(lists["semantic"]), weight=weight)[:limit]
    # Reciprocal rank fusion (k = 60), the usual default when scores are not comparable.
    fused: dict[int, float] = {}
    for ranked in lists.values():
        for rank, (memory_id, _score) in enumerate(ranked, start=1):
            fused[memory_id] = fused.get(memory_id, 0.0) + 1.0 / (60 + rank)
    return sorted(fused.items(), key=lambda item: (-item[1], -item[0]))[:limit]


def _load(tenant: Tenant, ranked: list[tuple[int, float]], head_chars: int | None = None) -> list[tuple[Memory, float]]:
    rows = selectors.memories_by_ids(tenant=tenant, ids=[memory_id for memory_id, _ in ranked], head_chars=head_chars)
    return [(rows[memory_id], score) for memory_id, score in ranked if memory_id in rows]


def ranked_ids(*, tenant_id: int, prefixes: list[str] | None, query: str, limit: int) -> list[tuple[int, float]]:
    """The ids of the tenant's memories under ``prefixes`` that answer ``query``, best first,
    with their fused scores: the ranking, computed in this process (what the search tier's
    processes run, memories/search/tier.py)."""
    return fuse(_candidate_lists(tenant_id=tenant_id, prefixes=prefixes, query=query, limit=limit), limit)


def search_ranked(
    *, tenant: Tenant, prefixes: list[str] | None, query: str, limit: int, head_chars: int | None = None
) -> list[tuple[Memory, float]]:
    """The tenant's live memories under ``prefixes`` that answer ``query``, best first.
    Ranked by the search tier when there is one (memories/search/tier.py), else here.
    ``head_chars``: a long string value is loaded as its first characters only
    (``selectors.memories_by_ids``). Cost: each ranker's (bounded: memories/search/lexical.py)
    plus one primary-key fetch."""
    ranked = search_ranked_ids(tenant=tenant, prefixes=prefixes, query=query, limit=limit)
    return _load(tenant, ranked, head_chars)[:limit]


def search_ranked_ids(*, tenant: Tenant, prefixes: list[str] | None, query: str, limit: int) -> list[tuple[int, float]]:
    """:func:`search_ranked`'s order as ``(memory id, score)``, no row loaded: ``limit`` and
    ``SPARE`` more, some of which may be trashed or expired since (the caller keeps the live
    ones, the first ``limit``)."""
    # A few spare: a vector cached for semantic search may belong to a memory trashed since.
    want = limit + SPARE
    ranked = tier.ranked(tenant_id=tenant.pk, prefixes=prefixes, query=query, limit=want)
    if ranked is None:
        ranked = ranked_ids(tenant_id=tenant.pk, prefixes=prefixes, query=query, limit=want)
    return ranked


def _salience(importance: int, updated_at: datetime, now: datetime) -> float:
    # Importance (0-10) and recency weigh about the same: a memory of importance 10 from a
    # month ago ties with one of importance 5 from today.
    age_days = max((now - updated_at).total_seconds(), 0) / 86400
    return importance / 10 + 0.5 / (1 + age_days / 7)


def salient(*, tenant: Tenant, prefixes: list[str] | None, limit: int, head_chars: int | None = None) -> list[Memory]:
    """The most important and most recent live memories under ``prefixes`` (bounded scans:
    ``selectors.memories_salient_rows``), best first. ``head_chars``: as :func:`search_ranked`'s."""
    now = timezone.now()
    rows = selectors.memories_salient_rows(tenant=tenant, prefixes=prefixes)
    rows.sort(key=lambda r: (-_salience(r[2], r[3], now), -r[0]))
    return [m for m, _ in _load(tenant, [(r[0], 0.0) for r in rows[:limit]], head_chars)]


def _terms(memory: Memory, chars: int | None) -> frozenset[str]:
    text = value_text(memory.value)
    return frozenset(index_document(key="", value=text if chars is None else text[:chars]).body)


def drop_near_duplicates(memories: list[Memory], *, chars: int | None = None) -> list[Memory]:
    """Keep the most recently updated of memories whose values say the same thing (value
    terms overlapping ≥ ``NEAR_DUPLICATE``), in the order given. ``chars``: only the first
    that many characters of each value's text are compared — what a recall of that size can
    show of it. (Whole values, 30 of them of 16 KB, the default cap: 154 ms of CPU for one
    recall of 500 characters, 30 times a search; a tenant's cap of 256 KB, seconds.)"""
    terms = {m.pk: _terms(m, chars) for m in memories}
    dropped: set[int] = set()
    for i, a in enumerate(memories):
        for b in memories[i + 1 :]:
            if a.pk in dropped or b.pk in dropped:
                continue
            ta, tb = terms[a.pk], terms[b.pk]
            if not ta or not tb or min(len(ta), len(tb)) < NEAR_DUPLICATE * max(len(ta), len(tb)):
                continue  # (sizes this far apart cannot overlap that much)
            shared = len(ta & tb)
            if shared / (len(ta) + len(tb) - shared) >= NEAR_DUPLICATE:
                dropped.add(b.pk if a.updated_at >= b.updated_at else a.pk)
    return [m for m in memories if m.pk not in dropped]


def recall_pack(*, tenant: Tenant, prefixes: list[str] | None, query: str | None, max_chars: int) -> dict:
    """One text block of at most ``max_chars`` characters, one ``key: value`` line per
    memory: the best matches of ``query``, or with no query the most important and most
    recent memories under the prefix. Near-duplicates are dropped (the newest kept); a line
    that does not fit is cut when at least ``CUT_MIN_CHARS`` remain, else skipped so that a
    shorter one after it can still fill the budget.

    Nothing past a value's first ``max_chars`` characters can show, nor is compared: a long
    string value is loaded as its first ``max_chars`` + 1 only (``selectors.memories_by_ids``;
    40 values of 243 KB were 18 MB of Python memory for a block of 500 characters)."""
    if query:
        memories = [
            m
            for m, _ in search_ranked(
                tenant=tenant, prefixes=prefixes, query=query, limit=RECALL_POOL, head_chars=max_chars
            )
        ]
    else:
        memories = salient(tenant=tenant, prefixes=prefixes, limit=RECALL_POOL, head_chars=max_chars)
    lines: list[str] = []
    keys: list[str] = []
    used = 0
    for memory in drop_near_duplicates(memories, chars=max_chars):
        line = f"{memory.key}: {compact(memory.value)}"
        room = max_chars - used - (1 if lines else 0)
        if room <= 0:
            break
        if len(line) > room:
            if room < CUT_MIN_CHARS:
                continue
            line = line[: room - 1] + "…"
        lines.append(line)
        keys.append(memory.key)
        used += len(line) + (1 if len(lines) > 1 else 0)
    return {"text": "\n".join(lines), "keys": keys}
