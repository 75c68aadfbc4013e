"""Turning memories and agents' questions into search terms.

One tokenizer serves both sides, so a question finds what a write indexed:

* Latin-script words are lowercased and cut to a light English stem at index time and at
  query time alike ("packages", "packaging" → ``packag``; "installed" → ``install``); the
  key's segments are split on ``_ - . :`` too (``pref_lang`` → ``pref``, ``lang``), so the
  key's name is searchable.
* CJK text has no spaces, so it is indexed as overlapping character bigrams — the usual
  approach for Chinese full-text search. "周报发送时间" → 周报 报发 发送 送时 时间; the
  question "周报什么时候发送？" shares 周报 and 发送 with it. A CJK run of one character is
  indexed as that character.
* A word keeps its combining marks: "हिंदी" and "ที่อยู่" are one term each (the scripts whose
  vowel signs are marks were cut at each mark into single letters that no query looks for).
* Arabic harakat and Quranic marks, tatweel (U+0640) and Hebrew niqqud and cantillation are
  folded out of the terms (``fold``): "كِتَابٌ", "كـتـاب" and "كتاب" are the term كتاب, "עִבְרִית"
  is עברית; the value and key keep them as written.
* A zero-width non-joiner or joiner inside a word is dropped from its term ("می‌خواهم" →
  میخواهم, Devanagari "क्‍ष" → क्ष); a word of Arabic script with a non-joiner (Persian's
  morpheme boundary: "کتاب‌ها", books) is also indexed by its parts (کتاب, ها), so کتاب
  finds it, as a Persian writer who types a space or nothing there does.
* Question words and stop words ("which", "does", "什么", "怎么") are dropped from queries.
* A Latin query word also matches, at a lower weight, the word that is its first four
  letters, for key abbreviations ("language" → lang, "preference" → pref). It does not match
  every word sharing four letters ("install" does not find "instead").

A memory's terms come from three fields, each with its weight in the ranking (see
``memories.search.lexical``): key segments (PostgreSQL weight A), tags (B), the value's text
(D). Each distinct term is indexed at most ``TERM_CAP`` times: how often a word is repeated
says little once it is there (BM25's term-frequency saturation, done at write time).

Every indexed term carries its tenant's id (``"17:packag"``), so a term's posting list in
the index holds only that tenant's memories: another tenant's data can neither match nor
slow a query down.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from dataclasses import dataclass

_WORD_RE = re.compile(r"[^\W_]+", re.UNICODE)
# Characters that are neither word characters nor blanks: punctuation, symbols, and the
# combining marks (Mn, Mc, Me) that Devanagari, Thai or Bengali words are spelt with, which a
# word keeps (below).
_NOT_WORD_RE = re.compile(r"[^\w\s]")


@functools.lru_cache(maxsize=256)
def _marked_word_re(marks: str) -> re.Pattern:
    """Words of letters and digits, each letter or digit followed by any of ``marks``."""
    return re.compile(rf"[^\W_](?:[^\W_]|[{re.escape(marks)}])*")


# ZERO WIDTH NON-JOINER and JOINER: kept inside a word by _words (as its marks are), then
# dropped from its term (_unjoined).
_ZWNJ, _ZWJ = "\u200c", "\u200d"
_JOINERS = _ZWNJ + _ZWJ


def _is_arabic_letter(ch: str) -> bool:
    cp = ord(ch)
    return 0x0620 <= cp <= 0x06FF or 0x0750 <= cp <= 0x077F or 0x08A0 <= cp <= 0x08FF


def _words(text: str) -> list[str]:
    """Runs of letters and digits, the marks that follow a letter kept in its word: "हिंदी"
    (ह, a vowel sign, a nasal sign, द, a vowel sign) is one word, not ह and द; and the
    joiners inside one. `re` has no class of all marks, so the text's own marks make the
    pattern (cached by them)."""
    if text.isascii():
        return _WORD_RE.findall(text)
    marks = "".join(
        sorted(c for c in set(_NOT_WORD_RE.findall(text)) if c in _JOINERS or unicodedata.category(c)[0] == "M")
    )
    if not marks:
        return _WORD_RE.findall(text)
    words = _marked_word_re(marks).findall(text)
    return _unjoined(words) if _ZWNJ in marks or _ZWJ in marks else words


def _unjoined(words: list[str]) -> list[str]:
    """Each word without its joiners; a word of Arabic script cut by a non-joiner, its parts
    after it (a Persian suffix or prefix: کتاب‌ها → کتابها, کتاب, ها)."""
    out: list[str] = []
    for word in words:
        if _ZWNJ not in word and _ZWJ not in word:
            out.append(word)
            continue
        out.append(word.replace(_ZWNJ, "").replace(_ZWJ, ""))
        if _ZWNJ in word:
            parts = word.split(_ZWNJ)
            if any(part and _is_arabic_letter(part[-1]) for part in parts[:-1]):
                out.extend(part.replace(_ZWJ, "") for part in parts if part.strip(_ZWJ))
    return out


# Folded out of every term: Arabic harakat (fatha, kasra, damma, tanween, shadda, sukun...),
# Quranic annotation marks and the superscript alef, the tatweel (U+0640, a stretch of the
# line between letters: كـتـاب is كتاب), and Hebrew niqqud and cantillation marks. Writers
# leave them out or put them in as they please; a question must find the word either way.
# The combining marks (Mn) of those ranges only: Hebrew maqaf, paseq and sof pasuq, the
# Arabic end-of-ayah sign and the small waw and yeh (letters) are not marks and stay.
_FOLDED = "\u0640" + "".join(
    chr(cp)
    for first, last in (
        (0x0591, 0x05C7),
        (0x0610, 0x061A),
        (0x064B, 0x065F),
        (0x0670, 0x0670),
        (0x06D6, 0x06ED),
        (0x08D3, 0x08FF),
    )
    for cp in range(first, last + 1)
    if unicodedata.category(chr(cp)) == "Mn"
)
_FOLDED_RE = re.compile(f"[{re.escape(_FOLDED)}]+")


def fold(text: str) -> str:
    """``text`` without the marks that the terms fold out (:data:`_FOLDED`)."""
    return _FOLDED_RE.sub("", text)


# Each distinct term is indexed at most this many times (see the module docstring).
TERM_CAP = 2
# Longer "words" (hashes, base64, a 16 KiB run of one letter) are not indexed: nobody asks
# for them, and PostgreSQL refuses a lexeme over 2 KiB.
TERM_MAX_LEN = 64
# Distinct terms indexed per memory, the first ones: PostgreSQL caps a tsvector at 1 MB,
# which a 256 KiB value of Chinese text (~87k distinct bigrams) would pass.
DOC_MAX_TERMS = 20000
# PostgreSQL keeps positions up to 16383; later ones are clamped there.
_MAX_POSITION = 16383
# Field markers in ``Memory.search_text`` (key terms | tag terms | value terms); SQLite's
# FTS5 table splits on them (migration 0010).
FIELD_SEPARATOR = " | "
# How deep ``value_text`` descends into a JSON value; validation refuses deeper values
# (zeromem.kernel.validation.VALUE_MAX_DEPTH), this only guards rows written before that.
_FLATTEN_MAX_DEPTH = 64


def is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x3040 <= cp <= 0x30FF  # kana
        or 0xAC00 <= cp <= 0xD7AF  # hangul
        or 0xF900 <= cp <= 0xFAFF
        or 0x20000 <= cp <= 0x2FFFF
    )


# The characters is_cjk takes, as a class.
_CJK_RE = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0002ffff]")


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
    """Words of a text, in order, duplicates kept: Latin words lowercased (not stemmed),
    CJK runs as bigrams."""
    text = unicodedata.normalize("NFKC", text).lower()
    if not text.isascii():
        text = fold(text)
    if text.isascii() or not _CJK_RE.search(text):
        # No CJK run to cut into bigrams: the words are the terms (one pass, not one per letter).
        return [word for word in _words(text) if len(word) <= TERM_MAX_LEN]
    terms: list[str] = []
    for word in _words(text):
        if len(word) > TERM_MAX_LEN and not any(is_cjk(ch) for ch in word[:TERM_MAX_LEN]):
            continue
        run: list[str] = []
        latin: list[str] = []
        for ch in word:
            if is_cjk(ch):
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
    return [t for t in terms if len(t) <= TERM_MAX_LEN]


# Longest first: the first that leaves a stem of at least 4 letters is cut.
_SUFFIXES = sorted(
    """ations ation ions ion ings ing ments ment ness ities ity ies ied ible able ences ence ances ance
    edly ed es s ly ers er e""".split(),
    key=len,
    reverse=True,
)


# The suffixes by their last letter, longest first: a word is compared with the few that can
# end it (a write stems every word of its value: 1.7 µs a word against all 27 suffixes).
_SUFFIXES_BY_LAST: dict[str, tuple[str, ...]] = {}
for _suffix in _SUFFIXES:
    _SUFFIXES_BY_LAST[_suffix[-1]] = (*_SUFFIXES_BY_LAST.get(_suffix[-1], ()), _suffix)


def stem(term: str) -> str:
    """A light English stem: "packages" → "packag", "installed" → "install",
    "distributions" → "distribut", "compatible" → "compat". CJK terms are left alone."""
    if not term or is_cjk(term[0]):
        return term
    for suffix in _SUFFIXES_BY_LAST.get(term[-1], ()):
        if term.endswith(suffix) and len(term) - len(suffix) >= 4:
            return term[: -len(suffix)]
    return term


def value_text(value) -> str:
    """The human text of a JSON value: strings as they are, object keys and scalars too.
    Iterative, and no deeper than ``_FLATTEN_MAX_DEPTH`` levels."""
    out: list[str] = []
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= _FLATTEN_MAX_DEPTH:
                continue
            if isinstance(item, dict):
                children: list = []
                for k, v in item.items():
                    children.extend((str(k), v))
            else:
                children = list(item)
            stack.extend((child, depth + 1) for child in reversed(children))
        elif item is not None:
            out.append(str(item))
    return " ".join(out)


@dataclass(frozen=True)
class IndexDocument:
    """A memory's indexed terms (stemmed), per field: key segments, tags, value text."""

    key: list[str]
    tags: list[str]
    body: list[str]

    def search_text(self, tenant_id: int) -> str:
        """``Memory.search_text``: the tenant-prefixed terms, fields split by ``FIELD_SEPARATOR``."""
        prefix = f"{tenant_id}:"
        glue = " " + prefix
        return FIELD_SEPARATOR.join(prefix + glue.join(terms) if terms else "" for terms in self.fields)

    def tsvector(self, tenant_id: int) -> str:
        """A PostgreSQL ``tsvector`` literal: ``'17:task':1A '17:deadlin':2A '17:一万':9``
        (weight A for key terms, B for tags, D — the default, unwritten — for the value)."""
        # Built with the fewest calls (a write builds one): no min() per position, each lexeme
        # quoted only when it holds a quote or a backslash (never, for the tokenizer's terms).
        positions: dict[str, str] = {}
        pos = 0
        for terms, weight in ((self.key, "A"), (self.tags, "B"), (self.body, "")):
            for term in terms:
                if pos < _MAX_POSITION:
                    pos += 1
                at = positions.get(term)
                positions[term] = f"{pos}{weight}" if at is None else f"{at},{pos}{weight}"
        prefix = f"{tenant_id}:"
        if "'" in prefix or "\\" in prefix:
            return " ".join(f"'{_tsquote(prefix + term)}':{p}" for term, p in positions.items())
        return " ".join(
            [
                f"'{prefix}{term}':{p}" if "'" not in term and "\\" not in term else f"'{_tsquote(prefix + term)}':{p}"
                for term, p in positions.items()
            ]
        )

    @property
    def fields(self) -> tuple[list[str], list[str], list[str]]:
        return self.key, self.tags, self.body


def _tsquote(lexeme: str) -> str:
    # Terms are runs of word characters, so this never changes anything; it is here so
    # that the literal stays well-formed whatever a future tokenizer lets through.
    return lexeme.replace("\\", "\\\\").replace("'", "''")


def index_document(*, key: str, value, tags: list[str] | None = None) -> IndexDocument:
    """The terms a memory is found by: each distinct term at most ``TERM_CAP`` times over all
    fields, the key's occurrences counted first (so a word in the key keeps its weight)."""
    key_terms, tag_terms, counted = _head_terms(key, tuple(tags or ()))
    body_terms = _capped(tokenize(value_text(value)), dict(counted))
    return IndexDocument(key=list(key_terms), tags=list(tag_terms), body=body_terms)


@functools.lru_cache(maxsize=4096)
def _head_terms(key: str, tags: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, int]]:
    # A key's and its tags' terms, and their counts so far, are the same on every write of the
    # key: computed once (per process, for the last 4096 keys). The counts are copied by the
    # caller before the value's terms are added.
    seen: dict[str, int] = {}
    key_terms = _capped(tokenize(key.replace(":", " ")), seen)
    tag_terms = _capped(tokenize(" ".join(tags)), seen)
    return tuple(key_terms), tuple(tag_terms), seen


def _capped(words: list[str], seen: dict[str, int]) -> list[str]:
    kept = []
    for word in words:
        term = stem(word)
        n = seen.get(term, 0)
        if n == 0 and len(seen) >= DOC_MAX_TERMS:
            continue
        if n < TERM_CAP:
            seen[term] = n + 1
            kept.append(term)
    return kept


# --- queries ----------------------------------------------------------------------------


@dataclass(frozen=True)
class QueryTerm:
    """One index term a query looks for. ``weak`` terms (Latin words of one or two letters)
    may add to a match's score but are never enough on their own to pick candidates unless
    they are rare; ``boost`` scales their score (an abbreviation counts less than the word)."""

    term: str
    boost: float = 1.0
    weak: bool = False


def query_words(query: str) -> list[str]:
    """Distinct words of a question (stemmed), in order, stop words dropped."""
    query = _CJK_STOP_RE.sub(" ", unicodedata.normalize("NFKC", query))
    seen: dict[str, None] = {}
    for word in tokenize(query):
        if word in STOPWORDS or (len(word) == 1 and not is_cjk(word)):
            continue
        seen.setdefault(stem(word))
    return list(seen)


# A query term ending with this matches every indexed term that starts with the rest.
PREFIX_MARK = "*"
# A Latin query word also looks for its first four letters as a whole word, at this weight.
ABBREVIATION_BOOST = 0.6


def query_terms(query: str, *, max_words: int) -> list[QueryTerm]:
    """The index terms a question looks for: its first ``max_words`` distinct words, each
    with its abbreviation (see the module docstring)."""
    out: dict[str, QueryTerm] = {}
    for word in query_words(query)[:max_words]:
        if is_cjk(word[0]) and len(word) == 1:
            # A lone CJK character (钱, "money") is indexed only where it stands alone; it
            # also looks for the bigrams that start with it, as a prefix term ("钱*"), weak
            # like a short Latin word: it picks candidates only when that prefix is rare.
            out.setdefault(word + PREFIX_MARK, QueryTerm(word + PREFIX_MARK, 1.0, True))
            continue
        weak = not is_cjk(word[0]) and len(word) <= 2
        out.setdefault(word, QueryTerm(word, 1.0, weak))
        if not is_cjk(word[0]) and len(word) > 4:
            abbrev = word[:4]
            if abbrev not in out:
                out[abbrev] = QueryTerm(abbrev, ABBREVIATION_BOOST, False)
    return list(out.values())


def compact(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
