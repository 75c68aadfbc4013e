"""Turning memories and agents' questions into search terms, and scoring matches.

One tokenizer serves both sides, so a question finds what a write indexed:

* Latin-script words are lowercased; the key's segments are split on ``_ - . :`` too
  (``pref_lang`` → ``pref``, ``lang``), so the key's name is searchable.
* CJK text has no spaces, so it is indexed as overlapping character bigrams — the usual
  approach for Chinese full-text search. "周报发送时间" → 周报 报发 发送 送时 时间; the
  question "周报什么时候发送？" shares 周报, 发送 and 时候→(no) with it and ranks it.
* Question words and stop words ("which", "does", "什么", "怎么") are dropped from queries.

On PostgreSQL the indexed text (``Memory.search_text``) is matched with
``to_tsvector('simple', search_text) @@ to_tsquery('simple', 'a | b | c')`` over a GIN index
(OR-style: a memory matching some of the words still ranks), ranked by ``ts_rank_cd``,
plus a trigram (pg_trgm) ILIKE for the raw query as a substring. On SQLite the same terms
are matched with LIKE and scored in Python (embedded mode, small data).
"""

import json
import re
import unicodedata

_WORD_RE = re.compile(r"[^\W_]+", re.UNICODE)


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
    tell know remember remembers""".split()
)
# Question words and particles cut out of a question before it is split into bigrams, so
# "周报什么时候发送" searches 周报 and 发送, not the junk bigrams 报什 and 候发.
CJK_STOP_PHRASES = sorted(
    "什么时候 为什么 是不是 怎么样 什么 怎么 怎样 如何 哪个 哪些 哪里 是否 请问 一下 可以 多少 几点 "
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
    bigrams (tags and category are filters, not search words)."""
    terms = tokenize(key.replace(":", " ") + " " + value_text(value))
    # Keep the raw text as well, so the trigram/substring match sees the original phrasing.
    return " ".join(terms) + "\n" + value_text(value)[:4000]


def _stem_prefix(term: str) -> str:
    # Agents ask "which language does the user prefer?" of a memory keyed "pref_lang":
    # matching on a 4-letter prefix lets prefer~pref and language~lang meet.
    return term[:4] if len(term) > 4 else term


def query_terms(query: str) -> list[str]:
    """Distinct search terms of a question, stop words dropped."""
    query = _CJK_STOP_RE.sub(" ", unicodedata.normalize("NFKC", query))
    seen: dict[str, None] = {}
    for term in tokenize(query):
        if term in STOPWORDS or (len(term) == 1 and not _is_cjk(term)):
            continue
        seen.setdefault(term)
    return list(seen)


def tsquery(terms: list[str]) -> str:
    """A ``to_tsquery('simple', ...)`` string: OR of the terms, Latin ones prefix-matched."""
    parts = []
    for term in terms:
        safe = re.sub(r"[^\w]", "", term)
        if not safe:
            continue
        if _is_cjk(safe[0]):
            parts.append(f"'{safe}'")
        else:
            parts.append(f"'{_stem_prefix(safe)}':*")
    return " | ".join(parts)


def like_patterns(terms: list[str]) -> list[str]:
    """Substrings for the SQLite path (LIKE '%term%')."""
    return [t if _is_cjk(t[0]) else _stem_prefix(t) for t in terms]


def score(text: str, terms: list[str], raw_query: str) -> float:
    """Python scoring for the SQLite path: share of query terms present, plus a bonus when
    the whole query appears verbatim. Mirrors the PostgreSQL ranking closely enough for
    embedded use."""
    if not terms:
        return 0.0
    hay = text.lower()
    hits = sum(1 for p in like_patterns(terms) if p in hay)
    bonus = 1.0 if raw_query.strip().lower() in hay else 0.0
    return hits / len(terms) + bonus


def compact(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
