"""Turning memories and agents' questions into search terms, and scoring matches.

One tokenizer serves both sides, so a question finds what a write indexed:

* Latin-script words are lowercased; the key's segments are split on ``_ - . :`` too
  (``pref_lang`` → ``pref``, ``lang``), so the key's name is searchable.
* CJK text has no spaces, so it is indexed as overlapping character bigrams — the usual
  approach for Chinese full-text search. "周报发送时间" → 周报 报发 发送 送时 时间; the
  question "周报什么时候发送？" shares 周报 and 发送 with it and ranks it.
* Question words and stop words ("which", "does", "什么", "怎么") are dropped from queries.
* A Latin query word matches the words that start with its stem ("packages" → packag*:
  package, packaging) and, for key abbreviations, the word that is its first four letters
  ("language" → lang, "prefer" → pref). It does not match every word sharing four letters
  ("install" would otherwise match "instead", "compatible" "computer").

``Memory.search_text`` holds the terms only, each at most ``TERM_CAP`` times: how often a
word is repeated says little once it is there, and a long memory must not outrank a short
one by repetition alone (it is the term-frequency saturation of BM25, done at write time so
that PostgreSQL's ``ts_rank_cd`` gets it too). It no longer carries the raw text: parsed by
``to_tsvector`` that text added every word a second time, uncapped, and CJK clauses as
long junk lexemes, which halved the share of questions answered first. Rows written
before this keep their old ``search_text`` until they are rewritten.

On PostgreSQL ``search_text`` is matched with
``to_tsvector('simple', search_text) @@ to_tsquery('simple', 'a | b | c')`` over a GIN index
(OR-style: a memory matching some of the words still ranks), ranked by ``ts_rank_cd``
normalised by the log of the length, plus a pg_trgm ILIKE for the raw query as a substring
of the terms (so a verbatim phrase of Latin words still gets the bonus; a CJK phrase longer
than one bigram no longer does, its bigrams match instead).
On SQLite the terms are matched with LIKE and scored in Python by ``score`` (BM25 without
the corpus statistics: saturated term frequency, length normalisation).

Measured with ``python manage.py search_eval`` (questions and answers from packages that
this project did not write; see that command).
"""

import functools
import json
import re
import unicodedata

_WORD_RE = re.compile(r"[^\W_]+", re.UNICODE)

# Each distinct term is indexed at most this many times (see the module docstring).
TERM_CAP = 2


def _is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x3040 <= cp <= 0x30FF  # kana
        or 0xAC00 <= cp <= 0xD7AF  # hangul
        or 0xF900 <= cp <= 0xFAFF
        or 0x20000 <= cp <= 0x2FFFF
    )


STOPWORDS = frozenset(
    """a an and are as at be been but by can could did do does for from had has have how i if in
    into is it its me my of on or our please should so than that the their them then there these
    they this to was we were what when where which who whom why will with would you your about
    tell know remember remembers am being having doing other others another some any each every both
    all no not nor only own same such too very just also even still yet really now then again ever
    else here over under up down out off once more most much many few whether between during before
    after above below through until against while because he him his she her hers ours yours
    theirs myself yourself itself ourselves themselves ok okay""".split()
)
# Question words and particles cut out of a question before it is split into bigrams, so
# "周报什么时候发送" searches 周报 and 发送, not the junk bigrams 报什 and 候发.
CJK_STOP_PHRASES = sorted(
    "什么时候 为什么 是不是 怎么样 什么 怎么 怎样 如何 哪个 哪些 哪里 是否 请问 一下 可以 多少 几点 "
    "哪一个 一个 这个 那个 这些 那些 还是 或者 应该 怎么办 我们 你们 他们 您 是什么 有没有 能不能 "
    "吗 呢 吧 啊 呀 的 了 是 在 和 与 及 或 么 我 你 他 她 它 们 要 会 有".split(),
    key=len,
    reverse=True,
)
_CJK_STOP_RE = re.compile("|".join(map(re.escape, CJK_STOP_PHRASES)))


def _cjk_terms(run: str) -> list[str]:
    if len(run) == 1:
        return [run]
    return [run[i : i + 2] for i in range(len(run) - 1)]


def tokenize(text: str) -> list[str]:
    """Terms of a text, in order, duplicates kept (for indexing)."""
    text = unicodedata.normalize("NFKC", text).lower()
    terms: list[str] = []
    for word in _WORD_RE.findall(text):
        run: list[str] = []
        latin: list[str] = []
        for ch in word:
            if _is_cjk(ch):
                if latin:
                    terms.append("".join(latin))
                    latin = []
                run.append(ch)
            else:
                if run:
                    terms.extend(_cjk_terms("".join(run)))
                    run = []
                latin.append(ch)
        if latin:
            terms.append("".join(latin))
        if run:
            terms.extend(_cjk_terms("".join(run)))
    return terms


def _flatten(value) -> list[str]:
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            out.append(str(k))
            out.extend(_flatten(v))
        return out
    if isinstance(value, list):
        return [s for item in value for s in _flatten(item)]
    if value is None:
        return []
    return [str(value)]


def value_text(value) -> str:
    """The human text of a JSON value: strings as they are, object keys and scalars too."""
    return " ".join(_flatten(value))


def index_text(*, key: str, value) -> str:
    """What ``Memory.search_text`` holds: space-separated terms of key and value, CJK as
    bigrams, each distinct term at most ``TERM_CAP`` times (tags and category are filters,
    not search words)."""
    seen: dict[str, int] = {}
    kept: list[str] = []
    for term in tokenize(key.replace(":", " ") + " " + value_text(value)):
        n = seen.get(term, 0)
        if n < TERM_CAP:
            seen[term] = n + 1
            kept.append(term)
    return " ".join(kept)


# Longest first: the first that leaves a stem of at least 4 letters is cut.
_SUFFIXES = sorted(
    """ations ation ions ion ings ing ments ment ness ities ity ies ied ible able ences ence ances ance
    edly ed es s ly ers er e""".split(),
    key=len,
    reverse=True,
)


def _stem(term: str) -> str:
    """A light English stem used as a prefix: "packages" → "packag", "installed" →
    "install", "distributions" → "distribut", "compatible" → "compat"."""
    for suffix in _SUFFIXES:
        if term.endswith(suffix) and len(term) - len(suffix) >= 4:
            return term[: -len(suffix)]
    return term


def _stem_prefix(term: str) -> str:
    # Agents ask "which language does the user prefer?" of a memory keyed "pref_lang":
    # the word's first four letters, matched as a whole word, let prefer~pref and
    # language~lang meet.
    return term[:4] if len(term) > 4 else term


def query_terms(query: str) -> list[str]:
    """Distinct search terms of a question, stop words dropped."""
    query = _CJK_STOP_RE.sub(" ", unicodedata.normalize("NFKC", query))
    seen: dict[str, str] = {}  # one term per stem: "package" and "packages" count once
    for term in tokenize(query):
        if term in STOPWORDS or (len(term) == 1 and not _is_cjk(term)):
            continue
        seen.setdefault(term if _is_cjk(term[0]) else _stem(term), term)
    return list(seen.values())


def tsquery(terms: list[str]) -> str:
    """A ``to_tsquery('simple', ...)`` string: OR of the terms; a Latin word as its stem,
    prefix-matched, or its abbreviation (first four letters) as a whole word."""
    parts = []
    for term in terms:
        safe = re.sub(r"[^\w]", "", term)
        if not safe:
            continue
        if _is_cjk(safe[0]):
            parts.append(f"'{safe}'")
            continue
        parts.append(f"'{_stem(safe)}':*")
        abbrev = _stem_prefix(safe)
        if abbrev != safe and not abbrev.startswith(_stem(safe)):
            parts.append(f"'{abbrev}'")
    return " | ".join(parts)


def like_patterns(terms: list[str]) -> list[str]:
    """Substrings for the SQLite path (LIKE '%term%'): a superset of what ``score`` counts."""
    return [t if _is_cjk(t[0]) else _stem_prefix(t) for t in terms]


@functools.lru_cache(maxsize=4096)
def _term_re(term: str) -> re.Pattern:
    """The indexed words a query term matches (see ``tsquery``), as one regex over
    ``search_text``: a CJK term as a whole word; a Latin one as any word starting with its
    stem, or its abbreviation as a whole word."""
    if _is_cjk(term[0]):
        alternatives = re.escape(term)
    else:
        alternatives = re.escape(_stem(term)) + r"\S*"
        if len(term) > 4:
            alternatives += "|" + re.escape(term[:4])
    return re.compile(rf"(?<!\S)(?:{alternatives})(?!\S)")


# A search_text word that starts with a CJK character: a bigram (half a word, see ``score``).
_CJK_WORD_RE = re.compile(
    r"(?<!\S)[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0002ffff]"
)

# BM25's constants; the average memory length is unknown to a per-row score, so a typical
# one stands in for it (in words; a CJK bigram counts as half a word, a Chinese word being
# about two characters).
_K1 = 1.2
_B = 0.75
_AVG_TERMS = 80


def score(text: str, terms: list[str], raw_query: str) -> float:
    """Python scoring for the SQLite path: BM25 without the document frequencies (each
    query term weighs the same) over the indexed terms, plus a bonus when the whole query
    appears verbatim. Mirrors the PostgreSQL ranking closely enough for embedded use."""
    if not terms:
        return 0.0
    hay = text.lower()
    length = hay.count(" ") + 1 - 0.5 * len(_CJK_WORD_RE.findall(hay))
    length_norm = _K1 * (1 - _B + _B * length / _AVG_TERMS)
    total = 0.0
    for term in terms:
        if (term if _is_cjk(term[0]) else term[:4]) not in hay:
            continue
        tf = len(_term_re(term).findall(hay))
        if tf:
            total += tf * (_K1 + 1) / (tf + length_norm)
    bonus = 1.0 if raw_query.strip().lower() in hay else 0.0
    return total / len(terms) + bonus


def compact(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
