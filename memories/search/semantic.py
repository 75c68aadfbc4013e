"""Semantic candidates with a bounded cost, and their fusion with the word ranking.

There is no vector index here (pgvector cannot be installed on the target machines), so
similarity is exact, over a bounded set per query:

* the tenant's **newest** ``ZEROMEM_SEMANTIC_CANDIDATES`` embeddings (default 20,000), held
  in this process as one float32 matrix per tenant (40 MB at 20k × 512, plus 1.3 MB of sign
  bits) and scored with one matrix-vector product — past ``2 × PREFILTER_ROWS`` rows, over
  the ``PREFILTER_ROWS`` rows whose sign bits are nearest the question's (about 1.3 ms at
  20k on one core, where the whole product took 3.3–4 ms: it is bound by memory bandwidth). The cache is refreshed
  incrementally: a query asks for the tenant's highest embedding id (one probe of the
  (tenant, id) index; at most once per ``ZEROMEM_SEMANTIC_PROBE_SECONDS``) and loads only
  newer rows; it is rebuilt from scratch after
  ``ZEROMEM_SEMANTIC_CACHE_SECONDS``, which also drops vectors of memories erased since.
  A vector still cached for an erased or trashed memory is never returned: results are read
  back from the tenant's live memories (and only rows under the caller's prefixes are scored);
* plus the word ranking's candidates (the memories that matched a word, wherever they sit in
  the tenant's history), whose vectors, when not cached, come with the word ranking's own
  statement on PostgreSQL (memories/search/lexical.py ``lexical_hits``), else are read by
  memory id.

So a tenant larger than the cap is searched semantically among its newest memories and the
word matches; older memories that share no word with the question are out of reach. The cost
never grows beyond the cap. A tenant's query only ever reads its own rows and its own matrix.

Fusion (measured with ``search_eval``, README "Semantic search"): weighted score fusion,
``(1 - w) * word score / best word score + w * similarity rescaled to [0, 1] between the
SEMANTIC_DEPTH-th best and the best``, with ``w = ZEROMEM_SEMANTIC_WEIGHT`` (0.4). It beat
reciprocal rank fusion at hit@1 on every set and matched it at hit@5.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
from django.conf import settings
from django.db import connection

from memories.models import MemoryEmbedding
from memories.search import embeddings
from zeromem.kernel import cpu, hotsql
from zeromem.kernel.keyprefix import EXACT

logger = logging.getLogger("zeromem.search")

# How many of the best semantic matches enter the fusion, and the rank whose similarity is
# the fusion's zero point.
SEMANTIC_DEPTH = 50
# How deep the word ranking is read for fusion.
LEXICAL_DEPTH = 50
# Below this cosine similarity a memory is no semantic match (USE v3: unrelated short texts
# score about 0.0–0.15; on the evaluation sets the answer's median is 0.25–0.5). Without a
# floor every question would bring back the nearest memories, however unrelated.
MIN_SIMILARITY = 0.15
# A matrix of more rows than twice this is not scored whole: the rows whose vectors' signs
# agree most with the question's (Hamming distance over one bit per dimension, 64 bytes a
# row, so 1.3 MB at 20k where the vectors take 40 MB) are, this many of them, and the best
# SEMANTIC_DEPTH taken among those by exact similarity. The product over every row is bound
# by memory bandwidth (40 MB read per question: 3.3–4 ms on one core here), the prefilter by
# the bits (1.2–1.6 ms in all). Measured at 20k real vectors (bench_search's tenant, 150
# questions): the exact top 50 kept 96% (min 78%) at 1000 rows, 99% at 2000, 90% at 500.
PREFILTER_ROWS = 1000


@dataclass(frozen=True)
class _Matrix:
    memory_ids: np.ndarray  # int64 (n,)
    keys: list[str]
    # Rows in key order, and the keys so ordered: a prefix is one bisect range, not a scan.
    key_order: np.ndarray  # int64 (n,)
    sorted_keys: list[str]
    vectors: np.ndarray  # float32 (n, DIM)
    signs: np.ndarray  # uint64 (n, DIM / 64): the vectors' sign bits, for the prefilter
    embedding_ids: np.ndarray  # int64 (n,), ascending
    max_id: int
    built_at: float

    @property
    def nbytes(self) -> int:
        return self.vectors.nbytes + self.signs.nbytes + self.memory_ids.nbytes * 3 + 2 * 64 * len(self.keys)

    def under(self, prefixes: Sequence[str]) -> np.ndarray:
        """Boolean mask of the rows whose key starts with one of ``prefixes`` (or is the
        key an :func:`~zeromem.kernel.keyprefix.exact` filter names)."""
        mask = np.zeros(len(self.keys), dtype=bool)
        for prefix in prefixes:
            if prefix.endswith(EXACT):
                lo = bisect.bisect_left(self.sorted_keys, prefix[:-1])
                hi = bisect.bisect_right(self.sorted_keys, prefix[:-1])
            else:
                lo = bisect.bisect_left(self.sorted_keys, prefix)
                hi = bisect.bisect_left(self.sorted_keys, prefix + "\U0010ffff")
            mask[self.key_order[lo:hi]] = True
        return mask


def _matrix(memory_ids, keys, vectors, embedding_ids, max_id, built_at) -> _Matrix:
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return _Matrix(
        memory_ids=memory_ids,
        keys=keys,
        key_order=np.asarray(order, dtype=np.int64),
        sorted_keys=[keys[i] for i in order],
        vectors=vectors,
        signs=_signs(vectors),
        embedding_ids=embedding_ids,
        max_id=max_id,
        built_at=built_at,
    )


def _signs(vectors: np.ndarray) -> np.ndarray:
    """One bit per dimension (set: positive), packed into uint64 words per row."""
    packed = np.packbits(vectors > 0, axis=-1)
    return np.ascontiguousarray(packed).view(np.uint64)


class _MatrixCache:
    """Per-process, per-tenant matrices of the newest embeddings, least recently used first
    out when their total passes ``ZEROMEM_SEMANTIC_CACHE_MB``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tenants: OrderedDict[int, _Matrix] = OrderedDict()
        self._building: set[int] = set()
        self._probed: dict[int, float] = {}  # tenant → when its newest embedding id was last read

    def clear(self) -> None:
        with self._lock:
            self._tenants.clear()
            self._probed.clear()

    def matrix(self, tenant_id: int) -> _Matrix | None:
        """The tenant's matrix, with every embedding up to the newest id included.

        A tenant not cached yet, or cached longer than ``ZEROMEM_SEMANTIC_CACHE_SECONDS``, is
        (re)built from the newest ``cap`` rows — 20 MB read and converted at 20k, 0.4–2 s on
        a busy two-core machine — in a background thread: meanwhile the request uses the
        old matrix, or none (words only). ``ZEROMEM_EMBEDDINGS_LOAD_WAIT`` builds it in the
        request instead (tests, evaluation). Newer rows than a cached matrix holds are
        added in the request (a few rows: one index range scan)."""
        cap = settings.ZEROMEM_SEMANTIC_CANDIDATES
        now = time.monotonic()
        with self._lock:
            cached = self._tenants.get(tenant_id)
            recent = now - self._probed.get(tenant_id, -1e9) < settings.ZEROMEM_SEMANTIC_PROBE_SECONDS
        if cached is not None and recent and now - cached.built_at < settings.ZEROMEM_SEMANTIC_CACHE_SECONDS:
            # Probed a moment ago: embeddings arrive by the minute, a round trip per search buys nothing.
            return cached
        newest = (
            MemoryEmbedding.objects.filter(tenant_id=tenant_id).order_by("-id").values_list("id", flat=True).first()
        )
        if newest is None or cap <= 0:
            return None
        with self._lock:
            self._probed[tenant_id] = now
            cached = self._tenants.get(tenant_id)
            if cached is not None:
                self._tenants.move_to_end(tenant_id)
        expired = cached is None or time.monotonic() - cached.built_at >= settings.ZEROMEM_SEMANTIC_CACHE_SECONDS
        if expired:
            if settings.ZEROMEM_EMBEDDINGS_LOAD_WAIT:
                return self._store(tenant_id, self._load(tenant_id, cap, after=0, built_at=time.monotonic()))
            self._build_in_background(tenant_id, cap)
            if cached is None:
                return None
        if cached.max_id >= newest:
            return cached
        return self._store(tenant_id, self._extend(tenant_id, cached, cap))

    def _store(self, tenant_id: int, built: _Matrix) -> _Matrix:
        with self._lock:
            current = self._tenants.get(tenant_id)
            if current is not None and current.built_at > built.built_at and current.max_id >= built.max_id:
                return current  # a newer build landed meanwhile
            self._tenants[tenant_id] = built
            self._tenants.move_to_end(tenant_id)
            budget = settings.ZEROMEM_SEMANTIC_CACHE_MB * 1024 * 1024
            while len(self._tenants) > 1 and sum(m.nbytes for m in self._tenants.values()) > budget:
                self._tenants.popitem(last=False)
        return built

    def _build_in_background(self, tenant_id: int, cap: int) -> None:
        with self._lock:
            if tenant_id in self._building:
                return
            self._building.add(tenant_id)

        def build() -> None:
            try:
                self._store(tenant_id, self._load(tenant_id, cap, after=0, built_at=time.monotonic()))
            except Exception as exc:  # the next request tries again
                logger.warning("semantic cache of tenant %s not built: %s: %s", tenant_id, type(exc).__name__, exc)
            finally:
                with self._lock:
                    self._building.discard(tenant_id)
                connection.close()  # this thread's own connection (back to the pool)

        threading.Thread(target=build, name=f"zeromem-semantic-{tenant_id}", daemon=True).start()

    @staticmethod
    def _rows(tenant_id: int, cap: int, after: int) -> list[tuple]:
        # Newest first through the (tenant, id) index; the key comes by the memory's primary key.
        return list(
            MemoryEmbedding.objects.filter(tenant_id=tenant_id, id__gt=after, model=embeddings.MODEL_NAME)
            .order_by("-id")
            .values_list("id", "memory_id", "memory__key", "vector", "dim")[:cap]
        )[::-1]

    def _load(self, tenant_id: int, cap: int, *, after: int, built_at: float) -> _Matrix:
        rows = [r for r in self._rows(tenant_id, cap, after) if r[4] == embeddings.DIM]
        vectors = embeddings.from_bytes_many([r[3] for r in rows])
        return _matrix(
            memory_ids=np.fromiter((r[1] for r in rows), dtype=np.int64, count=len(rows)),
            keys=[r[2] for r in rows],
            vectors=vectors,
            embedding_ids=np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows)),
            max_id=max((r[0] for r in rows), default=after),
            built_at=built_at,
        )

    def _extend(self, tenant_id: int, old: _Matrix, cap: int) -> _Matrix:
        new = self._load(tenant_id, cap, after=old.max_id, built_at=old.built_at)
        # A memory embedded again has a new row: its old vector goes.
        keep = ~np.isin(old.memory_ids, new.memory_ids)
        keep[: max(0, int(keep.sum()) + len(new.keys) - cap)] = False  # oldest out past the cap
        kept = np.flatnonzero(keep)
        return _matrix(
            memory_ids=np.concatenate([old.memory_ids[kept], new.memory_ids]),
            keys=[old.keys[i] for i in kept] + new.keys,
            vectors=np.concatenate([old.vectors[kept], new.vectors]),
            embedding_ids=np.concatenate([old.embedding_ids[kept], new.embedding_ids]),
            max_id=max(old.max_id, new.max_id),
            built_at=old.built_at,
        )


_cache = _MatrixCache()


@dataclass
class _Scored:
    """The question scored against a cached matrix (no database work: it may run in the
    encoder's pool): its vector, the matrix, and the best rows' similarities."""

    vector: np.ndarray
    matrix: _Matrix | None
    best: dict[int, float]


def _score_matrix(matrix: _Matrix | None, prefixes: Sequence[str] | None, vector: np.ndarray) -> _Scored:
    best: dict[int, float] = {}
    if matrix is None or not len(matrix.keys):
        return _Scored(vector, None, best)
    under = matrix.under(tuple(prefixes)) if prefixes is not None and "" not in prefixes else None
    rows = None  # every row
    if len(matrix.keys) > 2 * PREFILTER_ROWS:
        distance = np.bitwise_count(matrix.signs ^ _signs(vector)).sum(axis=1, dtype=np.int32)
        if under is not None:
            distance[~under] = embeddings.DIM + 1
        rows = np.argpartition(distance, PREFILTER_ROWS - 1)[:PREFILTER_ROWS]
        sims = matrix.vectors[rows] @ vector
        if under is not None:
            sims = np.where(under[rows], sims, -1.0)
    else:
        sims = matrix.vectors @ vector
        if under is not None:
            sims = np.where(under, sims, -1.0)
    k = min(SEMANTIC_DEPTH, len(sims))
    for i in np.argpartition(-sims, k - 1)[:k]:
        if sims[i] >= MIN_SIMILARITY:
            best[int(matrix.memory_ids[i if rows is None else rows[i]])] = float(sims[i])
    return _Scored(vector, matrix, best)


def _with_also(
    tenant_id: int, scored: _Scored, also: Sequence[int], stored: dict[int, bytes] | None = None
) -> dict[int, float]:
    """The best rows' similarities plus those of the memories ``also`` (the word ranking's
    candidates) wherever they are: from the matrix when cached, else their stored vectors —
    ``stored`` when the word ranking read them already (memories/search/lexical.py
    ``lexical_hits``: a memory of ``also`` missing there has none), else one SELECT, in the
    caller's thread and connection."""
    out = dict(scored.best)
    cached: set[int] = set()
    matrix = scored.matrix
    if len(also) and matrix is not None:
        # Vectorised: a Python loop over the 20k cached ids held the GIL for ~2 ms.
        rows = np.flatnonzero(np.isin(matrix.memory_ids, np.asarray(also, dtype=np.int64)))
        for i, sim in zip(rows.tolist(), (matrix.vectors[rows] @ scored.vector).tolist(), strict=True):
            memory_id = int(matrix.memory_ids[i])
            cached.add(memory_id)
            if sim >= MIN_SIMILARITY:
                out[memory_id] = sim
    missing = [m for m in also if m not in cached]
    if missing:
        if stored is None:
            found = _stored_vectors(tenant_id, missing)
        else:
            found = [(m, stored[m]) for m in missing if m in stored]
        if found:
            ids, blobs = zip(*found, strict=True)
            # One conversion and one product for all of them (per row: ~10x the CPU).
            for memory_id, sim in zip(ids, (embeddings.from_bytes_many(blobs) @ scored.vector).tolist(), strict=True):
                if sim >= MIN_SIMILARITY:
                    out[memory_id] = sim
    return out


# The word matches' stored vectors, by the unique memory_id index alone: a tenant_id condition
# the planner could use let it AND in the tenant's whole (tenant, id) index (measured: 2.7 ms
# at 50k, growing with the tenant, when the statistics were stale), so it is written
# ``tenant_id + 0``, which no index serves, and checked on the rows found. The ids are one
# array parameter, so the text is one statement whatever their number; run on the driver's
# cursor (zeromem/kernel/hotsql.py). The ORM's IN list with per-row converters took 1.8 ms
# p50 (3.9 ms p95) for 50 vectors at 1M, this 0.6 ms (0.8 ms).
_STORED_VECTORS_SQL = (
    f"SELECT memory_id, vector FROM {MemoryEmbedding._meta.db_table}"  # nosec B608: a table name
    " WHERE memory_id = ANY(%s) AND tenant_id + 0 = %s AND model = %s AND dim = %s"
)


def _stored_vectors(tenant_id: int, memory_ids: Sequence[int]) -> list[tuple[int, bytes]]:
    """[(memory id, stored vector bytes)] of the tenant's memories among ``memory_ids`` that
    have an embedding of this model and size."""
    if connection.vendor == "postgresql":
        return hotsql.fetchall(
            _STORED_VECTORS_SQL, [list(memory_ids), tenant_id, embeddings.MODEL_NAME, embeddings.DIM]
        )
    # Elsewhere by the ORM, the tenant, model and size checked here, as above.
    rows = MemoryEmbedding.objects.filter(memory_id__in=memory_ids).values_list(
        "memory_id", "tenant_id", "model", "vector", "dim"
    )
    return [
        (memory_id, vector)
        for memory_id, owner, model, vector, dim in rows
        if owner == tenant_id and model == embeddings.MODEL_NAME and dim == embeddings.DIM
    ]


def similarities(
    *, tenant_id: int, prefixes: Sequence[str] | None, query_vector: np.ndarray, also: Sequence[int] = ()
) -> dict[int, float]:
    """Cosine similarity of the question to the tenant's best ``SEMANTIC_DEPTH`` cached
    memories under ``prefixes`` (None: the whole tenant; an empty list: nothing), and to the
    memories ``also`` (the word ranking's candidates) wherever they are. {memory id:
    similarity}, each ≥ MIN_SIMILARITY.

    Cost: one index probe, the matrix-vector product over at most the cap, and one SELECT
    of at most len(also) vectors by memory id for those not cached."""
    if prefixes is not None and not prefixes:
        return {}
    return _with_also(tenant_id, _score_matrix(_cache.matrix(tenant_id), prefixes, query_vector), also)


class Pending:
    """Semantic candidates being computed in the encoder's pool (:func:`start`)."""

    def __init__(self, tenant_id: int, future: Future | None) -> None:
        self._tenant_id = tenant_id
        self._future = future

    def _scored(self) -> _Scored | None:
        if self._future is None:
            return None
        try:
            return self._future.result()
        except Exception as exc:  # never a 500 for the semantic half: words alone
            logger.warning("semantic search skipped for one query: %s: %s", type(exc).__name__, exc)
            return None

    @property
    def vector_kind(self) -> tuple[str, int] | None:
        """(model, dimension) of the stored vectors :meth:`candidates` will want for the word
        matches, so that the word ranking can read them with its own; None: it wants none."""
        return None if self._future is None else (embeddings.MODEL_NAME, embeddings.DIM)

    def candidates(self, also: Sequence[int] = (), stored: dict[int, bytes] | None = None) -> list[tuple[int, float]]:
        """[(memory id, similarity)] best first (see :func:`similarities`; ``stored``: the
        vectors of ``also`` read already, see there), or [] when the question could not be
        embedded: the search then runs on words alone."""
        scored = self._scored()
        if scored is None:
            return []
        sims = _with_also(self._tenant_id, scored, also, stored)
        return sorted(sims.items(), key=lambda kv: -kv[1])

    def discard(self) -> None:
        """Wait for the background work and drop it (the search failed): its CPU is counted."""
        self._scored()


def _embed_and_score(query: str, matrix: _Matrix | None, prefixes: Sequence[str] | None) -> _Scored | None:
    vector = embeddings.query_vector(query)
    if vector is None:
        return None
    return _score_matrix(matrix, prefixes, vector)


def start(*, tenant_id: int, prefixes: Sequence[str] | None, query: str) -> Pending:
    """Begin the semantic half of a search: the tenant's matrix is looked up here (its probe
    is a query, so it runs in the caller's thread and connection), then the question's
    embedding and its scoring against the matrix run in the encoder's pool
    (``embeddings.question_pool``; its CPU counted to the caller's meter, zeromem/kernel/cpu.py)
    while the caller runs the word ranking's queries. :meth:`Pending.candidates` adds the
    word matches' similarities and returns the list; :meth:`Pending.discard` if the search
    fails meanwhile."""
    if (prefixes is not None and not prefixes) or not embeddings.enabled():
        return Pending(tenant_id, None)
    scope = None if prefixes is None or "" in prefixes else list(prefixes)
    matrix = _cache.matrix(tenant_id)
    return Pending(tenant_id, cpu.offload(embeddings.question_pool(), _embed_and_score, query, matrix, scope))


def fuse(lexical: Sequence[tuple[int, float]], semantic: dict[int, float], *, weight: float) -> list[tuple[int, float]]:
    """Weighted score fusion of a word ranking [(id, score)] (best first) and semantic
    similarities {id: cosine}: each side rescaled to [0, 1] (words by the best word score;
    similarity between the SEMANTIC_DEPTH-th best, or MIN_SIMILARITY, and the best), then
    ``(1 - weight) * words + weight * meaning``. Ties keep the word ranking's order. A pure
    function: [(id, fused score)], best first."""
    scores: dict[int, float] = {}
    order: dict[int, int] = {}
    best_lex = max((s for _, s in lexical), default=0.0)
    for rank, (memory_id, score) in enumerate(lexical):
        order.setdefault(memory_id, rank)
        if best_lex > 0:
            scores[memory_id] = (1 - weight) * max(score, 0.0) / best_lex
        else:
            scores.setdefault(memory_id, 0.0)
    if semantic:
        ranked = sorted(semantic.values(), reverse=True)
        top = ranked[0]
        floor = ranked[SEMANTIC_DEPTH - 1] if len(ranked) >= SEMANTIC_DEPTH else MIN_SIMILARITY
        span = top - floor if top > floor else 1.0
        for memory_id, sim in semantic.items():
            scores[memory_id] = scores.get(memory_id, 0.0) + weight * max(0.0, sim - floor) / span
            order.setdefault(memory_id, len(lexical) + 1)
    return sorted(scores.items(), key=lambda kv: (-kv[1], order[kv[0]]))


def cache_clear() -> None:
    """Drop every cached matrix (tests; a process that must release the memory)."""
    _cache.clear()
