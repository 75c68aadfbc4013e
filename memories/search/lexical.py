"""Lexical search: a question's terms → at most ``CANDIDATES`` memories from the index →
ranked by BM25-style weights. The cost of one search is bounded by the caps below, never by
the tenant's size.

The plan (both backends):

1. The question's first ``MAX_QUERY_WORDS`` distinct words (stop words dropped, stems,
   CJK bigrams; memories/search/text.py), each with its four-letter abbreviation.
2. Each term's document frequency in the tenant (PostgreSQL: ``SearchTerm``, refreshed by a
   job, a term missing there counting as rare; SQLite: the FTS5 vocabulary). Latin terms of
   one or two letters are *weak*: they pick candidates only when they are rare (df ≤
   ``CANDIDATES``), else they only add to the score of memories other terms found.
3. The ``MAX_TERMS`` rarest terms are kept. No usable term (``ab``, stop words only, emoji)
   → no results, and no SQL.
4. Candidates: memories matching any of the rarest terms whose document frequencies add up
   to at most ``CANDIDATES`` (the rarest always), at most ``CANDIDATES`` of them, from the
   GIN index over tenant-prefixed terms (PostgreSQL) or FTS5 (SQLite, newest first).
5. Score: PostgreSQL Σ idf(t) · boost(t) · ts_rank(field weights, tsv, t, length-normalised),
   idf = ln(1 + (N − df + 0.5)/(df + 0.5)) as in BM25 (on SQLite the same sum, computed in
   Python over the candidates' FTS5 columns). Then importance, recency and access multiply the score by at most
   ``1 + TIE_BREAK_MAX``: they order near-ties, they never lift a weaker match over a clearly
   better one.
6. The statements over memories run under ``ZEROMEM_SEARCH_TIMEOUT_MS`` (PostgreSQL
   ``statement_timeout``, sent with each of them: :class:`Deadline`; SQLite a progress
   handler, over everything); past it the search raises :class:`SearchTimeout` (503
   ``search_timeout`` with Retry-After), never a 500. (On PostgreSQL the frequencies' lookup,
   at most 64 primary-key probes of the term table — a lone CJK character's, one range of at
   most ``COUNT_CAP`` of its rows — runs before the settings and needs none.)

Measured at 1M memories in one tenant: README "Search".
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple

from django.conf import settings
from django.db import OperationalError, connection, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from memories.models import MemoryEmbedding
from memories.search.text import PREFIX_MARK, QueryTerm, query_terms
from zeromem.kernel.errors import Unavailable
from zeromem.kernel.keyprefix import startswith_sql

MAX_QUERY_WORDS = 32  # distinct words of a question that are looked at; the rest are ignored
MAX_TERMS = 12  # the rarest terms kept for candidates and scoring
CANDIDATES = 500  # memories ranked per search, at most
# Field weights: value text, (unused), tags, key segments — PostgreSQL's {D, C, B, A}.
FIELD_WEIGHTS = (0.4, 0.5, 0.7, 1.0)
TIE_BREAK_MAX = 0.03
# A term in more memories than this is read from the GIN index as a random sample of about
# this many (PostgreSQL's gin_fuzzy_search_limit, set for the search's statements only). A
# bitmap index scan reads a term's whole posting list before the heap scan's LIMIT applies:
# at 1M memories a query whose rarest word is in 85k of them spent 11 ms building that
# bitmap, 23 ms in all; sampled, 7 ms. PostgreSQL samples only when every term of the scan
# is that common, and plan() ORs a second term in only while the candidates' postings total
# at most CANDIDATES (< GIN_SAMPLE): so a question with a rarer word reads all its matches,
# and one whose rarest word is common ranks CANDIDATES memories drawn at random from that
# word's (before: the oldest ones, the bitmap's block order) — a bounded cost either way.
GIN_SAMPLE = 5000
_EMBEDDING_TABLE = MemoryEmbedding._meta.db_table


class SearchTimeout(Unavailable):
    def __init__(self):
        super().__init__(
            "the search took too long and was stopped; retry shortly or ask with fewer, rarer words",
            code="search_timeout",
            field="query",
            retry_after=1,
        )


@dataclass(frozen=True)
class ScoredTerm:
    term: str
    df: int
    idf: float
    boost: float


@dataclass(frozen=True)
class Plan:
    candidate_terms: list[ScoredTerm]  # ORed to pick candidates
    scoring_terms: list[ScoredTerm]  # every kept term, for the score


def _idf(df: int, n: int) -> float:
    return math.log(1 + (n - df + 0.5) / (df + 0.5))


def plan(terms: list[QueryTerm], df: dict[str, int], documents: int, *, exact: bool = False) -> Plan | None:
    """Which terms pick candidates and which only score (see the module docstring).

    ``exact``: ``df`` counts every term now (a term missing from it matches nothing, and is
    dropped); else it is the last refresh of the statistics, and a term missing from it may
    be new: it is kept, after the known ones, so that a memory written since is found."""
    n = max(documents, max(df.values(), default=0), 1)
    usable: list[tuple[bool, bool, int, QueryTerm]] = []
    for t in terms:
        known = t.term in df
        if not known and (exact or (t.boost < 1 and documents)):
            continue  # no memory holds it (an abbreviation: as of the last statistics)
        d = df.get(t.term, 0)
        eligible = not t.weak or (known and d <= CANDIDATES)
        usable.append((eligible, known, d, t))
    # Candidate-picking terms first, known ones rarest first, then unknown ones; weak common terms last.
    usable.sort(key=lambda u: (not u[0], not u[1], u[2]))
    usable = [(eligible, d, t) for eligible, _known, d, t in usable]
    kept = usable[:MAX_TERMS]
    if not any(eligible for eligible, _, _ in kept):
        return None
    scoring = [ScoredTerm(t.term, d, _idf(d, n), t.boost) for _, d, t in kept]
    candidate_terms: list[ScoredTerm] = []
    total = 0
    for (eligible, d, _t), scored in zip(kept, scoring, strict=True):
        if not eligible or (candidate_terms and total + d > CANDIDATES):
            break
        candidate_terms.append(scored)
        total += d
    return Plan(candidate_terms=candidate_terms, scoring_terms=scoring)


def _prefix_sql(prefixes: list[str] | None, column: str) -> tuple[str, list]:
    if prefixes is None or "" in prefixes:
        return "", []
    # Case-sensitive on SQLite too (zeromem/kernel/keyprefix.py).
    conditions = [startswith_sql(column, p) for p in prefixes]
    return f" AND ({' OR '.join(sql for sql, _ in conditions)})", [arg for _, args in conditions for arg in args]


def _tie_break(importance: int, updated_at: datetime, access_count: int, now: datetime) -> float:
    """1 to 1 + TIE_BREAK_MAX: importance (0-10), recency (halves over 30 days), use
    (SQLite; PostgreSQL computes the same in SQL, ``_TIE_BREAK_SQL``)."""
    age_days = max((now - updated_at).total_seconds(), 0) / 86400
    return 1 + TIE_BREAK_MAX * (
        0.4 * importance / 10 + 0.4 / (1 + age_days / 30) + 0.2 * min(1.0, math.log1p(access_count) / math.log(101))
    )


# The search's settings (see deadline()), as set_config() calls: a select list.
_SETTINGS_SQL = (
    "set_config('statement_timeout', %s, true), set_config('enable_seqscan', 'off', true),"
    " set_config('enable_indexscan', 'off', true),"
    " set_config('max_parallel_workers_per_gather', '0', true), set_config('jit', 'off', true),"
    " set_config('gin_fuzzy_search_limit', %s, true)"
)


@dataclass(frozen=True)
class Deadline:
    """How the search's statements run under its settings (see :func:`deadline`).

    ``prefix`` (PostgreSQL, outside any transaction): each statement is sent behind the
    settings in one message — ``SELECT set_config(...); <statement>`` — which PostgreSQL runs
    as one implicit transaction: the settings apply to that statement (its planning and its
    timeout) and end with it. No BEGIN, no COMMIT, no round trip for the settings alone.
    None: the settings are in force already (a caller's transaction), or SQLite."""

    prefix: tuple[str, list] | None = None

    def execute(self, cursor, sql: str, params: list) -> None:
        """Run ``sql`` under the search's settings; the cursor holds its rows."""
        if self.prefix is None:
            cursor.execute(sql, params)
            return
        head, head_params = self.prefix
        cursor.execute(f"{head}; {sql}", [*head_params, *params])
        cursor.nextset()  # past the settings' row, to the statement's


@contextmanager
def deadline() -> Iterator[Deadline]:
    """Run the search's statements (those sent with :meth:`Deadline.execute`) under the search
    timeout and planner settings, and raise :class:`SearchTimeout` when the time runs out.

    PostgreSQL, no transaction open: the settings ride on each such statement (see
    :class:`Deadline`) — several statements in one message need client-side binding, Django's
    default and what PgBouncer needs. Inside a caller's transaction (or with
    ``server_side_binding`` on): a savepoint (or a transaction), the settings read and made
    once, and restored before the caller goes on (a cancelled query leaves the caller's
    transaction usable: its audit event is still written)."""
    ms = int(settings.ZEROMEM_SEARCH_TIMEOUT_MS)
    params = [f"{ms}ms", str(GIN_SAMPLE)]
    try:
        if connection.vendor == "postgresql":
            # Bitmap scans only: with the tenant filter written so that no btree can serve
            # it, the GIN index over tenant-prefixed terms is the one way in, whatever the
            # table's statistics say (a fresh or unanalyzed tenant made the planner walk a
            # btree over all the tenant's rows).
            # No parallel workers: a search's bounded statements gain nothing from them but
            # their start-up, and with them one tenant's search takes several cores (seen
            # during bench_search's fairness phase as MessageQueueReceive waits).
            # No JIT: the candidates' estimated cost passes jit_above_cost whenever a term is
            # common (the estimate counts every posting, not the LIMIT), and compiling took
            # 7.5 of a 22-ms query at 1M (bench_search, 'zpt' in 62k memories) — for a
            # statement that runs a few milliseconds once.
            # A common term's postings sampled (gin_fuzzy_search_limit, GIN_SAMPLE): see there.
            server_binding = connection.settings_dict["OPTIONS"].get("server_side_binding") is True
            if not connection.in_atomic_block and not server_binding:
                yield Deadline(prefix=(f"SELECT {_SETTINGS_SQL}", params))
                return
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('statement_timeout'), current_setting('max_parallel_workers_per_gather'),"
                    f" current_setting('jit'), current_setting('gin_fuzzy_search_limit'), {_SETTINGS_SQL}",
                    params,
                )
                previous = cursor.fetchone()[:4]
                yield Deadline()
                cursor.execute(
                    "SELECT set_config('statement_timeout', %s, true), set_config('enable_seqscan', 'on', true),"
                    " set_config('enable_indexscan', 'on', true),"
                    " set_config('max_parallel_workers_per_gather', %s, true), set_config('jit', %s, true),"
                    " set_config('gin_fuzzy_search_limit', %s, true)",
                    list(previous),
                )
        else:
            # No transaction: settings.py makes SQLite's IMMEDIATE, which would hold the
            # database-wide write lock for the whole search; a failed SELECT leaves nothing
            # to roll back.
            connection.ensure_connection()
            raw: sqlite3.Connection = connection.connection
            stop_at = time.monotonic() + ms / 1000
            raw.set_progress_handler(lambda: int(time.monotonic() > stop_at), 2000)
            try:
                yield Deadline()
            finally:
                raw.set_progress_handler(None, 0)
    except OperationalError as exc:
        if _is_timeout(exc):
            raise SearchTimeout() from None
        raise


def _is_timeout(exc: OperationalError) -> bool:
    cause = exc.__cause__
    if connection.vendor == "postgresql":
        from psycopg import errors

        return isinstance(cause, errors.QueryCanceled)
    return "interrupted" in str(exc)


# --- document frequencies -----------------------------------------------------------------


def _frequencies(tenant_id: int, terms: list[str], dl: Deadline) -> tuple[dict[str, int], int, bool]:
    """(df of each known term, the tenant's document count N, whether df is exact) — one
    indexed lookup by primary key (plus one range sum per prefix term), which needs none of
    the search's settings; counting a tenant's terms on the spot does (``dl``)."""
    exact_terms = [t for t in terms if not t.endswith(PREFIX_MARK)]
    prefix_terms = [t for t in terms if t.endswith(PREFIX_MARK)]
    prefixed = {f"{tenant_id}:{t}": t for t in exact_terms}
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # One row at least (a one-row subquery joined to the known terms' rows; the term
            # NULL when none is known), each with the tenant's document count (None: never
            # counted).
            cursor.execute(
                """SELECT t.term, t.ndoc, (SELECT documents FROM memories_searchcorpus WHERE tenant_id = %s)
                   FROM (SELECT 1) s LEFT JOIN memories_searchterm t
                     ON t.tenant_id = %s AND t.term = ANY(%s)""",
                [tenant_id, tenant_id, exact_terms],
            )
            rows = cursor.fetchall()
            df = {term: ndoc for term, ndoc, _ in rows if term is not None}
            documents = rows[0][2]
            if documents is None:
                return _counted_frequencies(cursor, dl, tenant_id, terms)
            for t in prefix_terms:
                start = t[: -len(PREFIX_MARK)]
                # At most COUNT_CAP of the terms it starts (an index range scan that stops
                # there): exact while the prefix is rare enough to pick candidates, "common"
                # past it. Uncapped, a tenant's text with tens of thousands of distinct bigrams
                # after each of a question's 32 lone characters made every such search sum ~2M
                # rows: 300 ms of PostgreSQL, outside the search's timeout and budget.
                cursor.execute(
                    "SELECT sum(ndoc) FROM (SELECT ndoc FROM memories_searchterm"
                    f" WHERE tenant_id = %s AND term >= %s AND term < %s LIMIT {COUNT_CAP}) s",  # nosec B608
                    [tenant_id, start, start + "\U0010ffff"],
                )
                n = cursor.fetchone()[0]
                if n:
                    df[t] = int(n)
            return df, documents, False
        df = {}
        if prefixed:
            marks = ", ".join("%s" for _ in prefixed)
            cursor.execute(f"SELECT term, doc FROM memories_memory_fts_vocab WHERE term IN ({marks})", list(prefixed))  # nosec B608
            df = {prefixed[term]: doc for term, doc in cursor.fetchall()}
        for t in prefix_terms:
            start = f"{tenant_id}:{t[: -len(PREFIX_MARK)]}"
            cursor.execute(
                "SELECT sum(doc) FROM (SELECT doc FROM memories_memory_fts_vocab"
                f" WHERE term >= %s AND term < %s LIMIT {COUNT_CAP})",  # nosec B608: as above
                [start, start + "\U0010ffff"],
            )
            n = cursor.fetchone()[0]
            if n:
                df[t] = int(n)
        cursor.execute(
            "SELECT count(*) FROM (SELECT 1 FROM memories_memory WHERE tenant_id = %s LIMIT 100000)", [tenant_id]
        )
        # Exact counts: a term missing here matches nothing.
        return df, cursor.fetchone()[0], True


def _lexeme(tenant_id: int, term: str) -> str:
    """One term as a tsquery operand: ``'17:term'``, or ``'17:钱':*`` for a prefix term."""
    if term.endswith(PREFIX_MARK):
        return f"'{tenant_id}:{term[: -len(PREFIX_MARK)]}':*"
    return f"'{tenant_id}:{term}'"


# A tenant whose statistics were never counted (new, or just imported) has its terms counted
# on the spot, each up to this many memories: exact for small tenants, "common" for the rest.
COUNT_CAP = CANDIDATES + 1
# ... while it holds at most this many memories. A bigger one's terms are taken as unknown
# until its count (the search-stats job), as a word new since a count is: none rarer than
# another, candidates from all of them (bounded as ever). Counted on the spot, each of 32
# common words read up to COUNT_CAP memories: at 50k memories one common word took 50-60 ms,
# 32 of them a 503 search_timeout (83 ms), 22,048 rows read; every search of a tenant just
# imported, until the job had run.
SPOT_COUNT_MAX_DOCS = 5000


def _counted_frequencies(cursor, dl: Deadline, tenant_id: int, terms: list[str]) -> tuple[dict[str, int], int, bool]:
    dl.execute(
        cursor,
        f"SELECT count(*) FROM (SELECT 1 FROM memories_memory WHERE tenant_id = %s LIMIT {SPOT_COUNT_MAX_DOCS + 1}) s",  # nosec B608
        [tenant_id],
    )
    documents = cursor.fetchone()[0]
    if documents > SPOT_COUNT_MAX_DOCS:
        return {}, documents, False
    dl.execute(
        cursor,
        f"""SELECT t, (SELECT count(*) FROM (SELECT 1 FROM memories_memory
                        WHERE tenant_id + 0 = %s AND search_tsv @@ q::tsquery
                        LIMIT {COUNT_CAP}) s)
            FROM unnest(%s::text[], %s::text[]) AS u(t, q)""",  # nosec B608
        [tenant_id, list(terms), [_lexeme(tenant_id, t) for t in terms]],
    )
    df = {t: n for t, n in cursor.fetchall() if n}
    return df, documents, True


# --- candidates ---------------------------------------------------------------------------


class Hits(NamedTuple):
    """A word ranking: ``ranked`` [(memory id, score)] best first, and — when asked for, on
    PostgreSQL — ``vectors`` {memory id: stored embedding bytes} of those ranked that have
    one of the asked model and size (None: not fetched)."""

    ranked: list[tuple[int, float]]
    vectors: dict[int, bytes] | None = None


def lexical_candidates(
    *, tenant_id: int, prefixes: list[str] | None, query: str, limit: int, now: datetime | None = None
) -> list[tuple[int, float]]:
    """The tenant's live memories that match ``query`` lexically, best first, as
    ``(memory id, score)``, at most ``limit`` (≤ ``CANDIDATES``). ``prefixes``: keys must
    start with one of these (None or "" in it: the whole tenant; []: nothing).

    Cost: one primary-key lookup per known term (document frequencies), then one query over
    at most ``CANDIDATES`` index hits, that one under the search timeout (:class:`Deadline`)."""
    return lexical_hits(tenant_id=tenant_id, prefixes=prefixes, query=query, limit=limit, now=now).ranked


def lexical_hits(
    *,
    tenant_id: int,
    prefixes: list[str] | None,
    query: str,
    limit: int,
    now: datetime | None = None,
    vectors: tuple[str, int] | None = None,
) -> Hits:
    """:func:`lexical_candidates`, and with ``vectors`` = (model, dimension) the ranked
    memories' stored embeddings of that model, read by the same statement on PostgreSQL (the
    semantic half needs them: memories/search/semantic.py), not by a round trip of its own."""
    if prefixes is not None and not prefixes:
        return Hits([])
    terms = query_terms(query, max_words=MAX_QUERY_WORDS)
    if not terms:
        return Hits([])
    now = now or timezone.now()
    limit = min(limit, CANDIDATES)
    with deadline() as dl:
        df, documents, exact = _frequencies(tenant_id, [t.term for t in terms], dl)
        p = plan(terms, df, documents, exact=exact)
        if p is None:
            return Hits([])
        if connection.vendor == "postgresql":
            return _pg_candidates(tenant_id, prefixes, p, limit, now, vectors, dl)
        return Hits(_sqlite_candidates(tenant_id, prefixes, p, limit, now))


def _tsquery(tenant_id: int, terms: list[ScoredTerm]) -> str:
    return " | ".join(_lexeme(tenant_id, t.term) for t in terms)


def _pg_candidates(tenant_id, prefixes, p: Plan, limit, now, vectors: tuple[str, int] | None, dl: Deadline) -> Hits:
    prefix_sql, prefix_params = _prefix_sql(prefixes, "key")
    weights = "{" + ",".join(str(w) for w in FIELD_WEIGHTS) + "}"
    rank_terms = " + ".join("%s * ts_rank(%s, c.search_tsv, %s::tsquery, 1)" for _ in p.scoring_terms)
    rank_params: list = []
    for t in p.scoring_terms:
        rank_params += [t.idf * t.boost, weights, _lexeme(tenant_id, t.term)]
    # "tenant_id + 0" and the coalesce() (the same as "deleted_at IS NULL") keep the btrees
    # on (tenant, ...) and those partial on live rows out of the plan: a BitmapAnd with the
    # tenant's million rows would cost more than the search itself. The inner LIMIT stops
    # the bitmap heap scan after CANDIDATES rows; the GIN index holds only this tenant's
    # postings for these terms (tenant-prefixed lexemes), and tenant_id is filtered as well.
    # Ranking re-reads each candidate's tsvector: cost ≈ candidates × terms.
    sql = f"""
        SELECT id, round((rank * {_TIE_BREAK_SQL})::numeric, 6)::float8 AS score
        FROM (SELECT c.id, ({rank_terms}) AS rank, c.importance, c.updated_at, c.access_count
              FROM (SELECT id, search_tsv, importance, updated_at, access_count FROM memories_memory
                    WHERE tenant_id + 0 = %s AND search_tsv @@ %s::tsquery
                      AND coalesce(deleted_at, 'infinity') = 'infinity'
                      AND (expires_at IS NULL OR expires_at > %s){prefix_sql}
                    LIMIT {CANDIDATES}) c) r
        WHERE rank > 0
        ORDER BY score DESC, id DESC LIMIT %s"""  # nosec B608
    params = [now, *rank_params, tenant_id, _tsquery(tenant_id, p.candidate_terms), now, *prefix_params, limit]
    if vectors is None:
        with connection.cursor() as cursor:
            dl.execute(cursor, sql, params)
            return Hits([(memory_id, score) for memory_id, score in cursor.fetchall()])
    # The ranked rows' stored vectors, each by the unique memory_id index (tenant_id + 0 and
    # checked on the row: see semantic._STORED_VECTORS_SQL), ``limit`` lookups at most.
    sql = f"""
        SELECT h.id, h.score, e.vector FROM ({sql}) h
        LEFT JOIN {_EMBEDDING_TABLE} e
          ON e.memory_id = h.id AND e.tenant_id + 0 = %s AND e.model = %s AND e.dim = %s
        ORDER BY h.score DESC, h.id DESC"""  # nosec B608: fixed SQL
    with connection.cursor() as cursor:
        dl.execute(cursor, sql, [*params, tenant_id, *vectors])
        rows = cursor.fetchall()
    return Hits(
        [(memory_id, score) for memory_id, score, _ in rows],
        {memory_id: bytes(vector) for memory_id, _, vector in rows if vector is not None},
    )


# _tie_break() in SQL (the first parameter is now), so that only ``limit`` rows leave the server.
_TIE_BREAK_SQL = f"""(1 + {TIE_BREAK_MAX} * (0.4 * importance / 10.0
    + 0.4 / (1 + greatest(extract(epoch FROM (%s - updated_at)), 0) / 86400.0 / 30)
    + 0.2 * least(1.0, ln(1 + access_count) / ln(101))))"""


def _sqlite_candidates(tenant_id, prefixes, p: Plan, limit, now) -> list[tuple[int, float]]:
    prefix_sql, prefix_params = _prefix_sql(prefixes, "m.key")
    # FTS5 walks the ORed doclists lazily, newest row first, and stops at CANDIDATES: every
    # kept term can take part in matching at no extra cost. The score is computed here, as
    # PostgreSQL's is, from the candidates' three term columns (FTS5's bm25() clamps the idf
    # of any term in half the rows or more to ~0, which ranks nothing in a small tenant).
    match = " OR ".join(
        f'"{tenant_id}:{t.term[:-1]}"*' if t.term.endswith(PREFIX_MARK) else f'"{tenant_id}:{t.term}"'
        for t in p.scoring_terms
    )
    sql = f"""
        SELECT m.id, f.k, f.t, f.b, m.importance, m.updated_at, m.access_count
        FROM memories_memory_fts f JOIN memories_memory m ON m.id = f.rowid
        WHERE memories_memory_fts MATCH %s AND m.tenant_id = %s AND m.deleted_at IS NULL
          AND (m.expires_at IS NULL OR m.expires_at > %s){prefix_sql}
        ORDER BY f.rowid DESC LIMIT {CANDIDATES}"""  # nosec B608
    with connection.cursor() as cursor:
        cursor.execute(sql, [match, tenant_id, connection.ops.adapt_datetimefield_value(now), *prefix_params])
        found = cursor.fetchall()
    wanted = {f"{tenant_id}:{t.term}": t.idf * t.boost for t in p.scoring_terms if not t.term.endswith(PREFIX_MARK)}
    starts = [(f"{tenant_id}:{t.term[:-1]}", t.idf * t.boost) for t in p.scoring_terms if t.term.endswith(PREFIX_MARK)]
    d, _c, b, a = FIELD_WEIGHTS
    rows = []
    for memory_id, key_terms, tag_terms, body_terms, importance, updated_at, access_count in found:
        rank = 0.0
        length = 0
        for column, weight in ((key_terms, a), (tag_terms, b), (body_terms, d)):
            words = column.split()
            length += len(words)
            for word in words:
                if word in wanted:
                    rank += weight * wanted[word]
                for start, w in starts:
                    if word.startswith(start):
                        rank += weight * w
        # Like ts_rank's normalization 1: divided by 1 + log(document length).
        rows.append(
            (memory_id, rank / (1 + math.log(max(length, 1))), importance, _sqlite_datetime(updated_at), access_count)
        )
    return _final(rows, limit, now)


def _sqlite_datetime(value) -> datetime:
    # A raw SQLite cursor returns the stored text (naive UTC, as Django writes it).
    if isinstance(value, str):
        value = parse_datetime(value)
    return value if timezone.is_aware(value) else value.replace(tzinfo=UTC)


def _final(rows, limit: int, now: datetime) -> list[tuple[int, float]]:
    scored = [
        (memory_id, float(rank) * _tie_break(importance, updated_at, access_count, now))
        for memory_id, rank, importance, updated_at, access_count in rows
        if rank and rank > 0
    ]
    scored.sort(key=lambda s: (-s[1], -s[0]))
    return [(memory_id, round(score, 6)) for memory_id, score in scored[:limit]]
