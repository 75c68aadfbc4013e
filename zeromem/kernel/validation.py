"""Input rules shared by every surface. Each failure names the field at fault.

Key grammar (see README "Keys"): segments joined by ``:``; each segment is one or more
Unicode letters or digits, or ``_ - . @ + = ~``, each of them optionally followed by combining
marks (a segment never starts with a mark), with a zero-width non-joiner or joiner (U+200C,
U+200D) allowed between two letters or marks (Persian می‌خواهم, Devanagari half forms); no empty
segment, no whitespace, control or other format characters (bidi controls), no ``/``; at
most 512 characters. Recommended shape, as the seeds advise:
``{namespace}:{user or session id}:{name}``, e.g. ``user:u10086:pref_lang``.
"""

import base64
import json
import re
import unicodedata
import uuid
from datetime import timedelta
from decimal import Decimal

from zeromem.kernel import opaque
from zeromem.kernel.errors import InvalidInput, PayloadTooLarge

KEY_MAX_LEN = 512
# A segment's characters: Unicode letters and digits (Python's \w: categories L and N, and _)
# and these, "-" last (a class's end in Python and ECMA-262 alike).
_PUNCTUATION = ".@+=~-"
_SEGMENT = rf"[\w{_PUNCTUATION}]+"
# Each character may be followed by combining marks (categories Mn, Mc, Me: Devanagari's and
# Thai's vowel signs, Arabic harakat, Hebrew niqqud, an accent spelt apart). `re` has no \p{M}
# (a class of all 2,500 marks would cost 0.2 s at import to build), so KEY_RE, PREFIX_RE and
# TAG_RE are the rules without marks and a string holding any is checked in two passes: each
# mark must follow a segment's character (never a ":", never the start), then the string
# without its marks must match (without_marks). A string without marks — every key before
# marks were allowed — is one fullmatch, as before.
KEY_RE = re.compile(rf"{_SEGMENT}(?::{_SEGMENT})*")
# A prefix is a key, optionally ending in ":" (a whole subtree) or cut mid-segment. Written
# so that each character has one way to match: "(?:SEG:?)+" read the same strings, but split
# a run of letters into segments every possible way before refusing a string that fails at
# its end ("a" * 24 + "!": 0.9 s of CPU, doubling with each letter; 40 letters: hours), and
# `re` holds the GIL meanwhile, so one request stalled every thread of its process.
PREFIX_RE = re.compile(rf"{_SEGMENT}(?::{_SEGMENT})*:?")
_OUTSIDE = re.compile(rf"[^\w:{_PUNCTUATION}]")
_STARTS_OUTSIDE = re.compile(rf"(?:^|:)[^\w:{_PUNCTUATION}]")
# ZERO WIDTH NON-JOINER and JOINER: format characters (Cf), but Persian spells everyday words
# with the first (می‌خواهم, کتاب‌ها) and Indic scripts use both inside words (Devanagari half
# forms, Sinhala conjuncts, Malayalam chillu in the older spelling). Each is taken between two
# letters or marks: never first or last in a segment, next to ":", nor doubled. Every other
# format character stays refused — bidi controls (U+202A-202E, U+2066-2069) above all, which
# make a key display as another key.
JOINERS = frozenset("\u200c\u200d")
_BEFORE_JOINER = re.compile("(?s).(?=[\u200c\u200d])")
_AFTER_JOINER = re.compile("(?s)(?<=[\u200c\u200d]).")


def _joiners_placed(text: str, *, open_end: bool) -> bool:
    """Whether each joiner of ``text`` lies between two letters or marks (``open_end``: or
    ends the text after one: a prefix may be cut after it). The caller has refused a joiner
    that starts the text or a segment. Two passes; each distinct neighbour looked up once."""
    if not open_end and text[-1] in JOINERS:
        return False
    neighbours = set(_BEFORE_JOINER.findall(text)) | set(_AFTER_JOINER.findall(text))
    return all(unicodedata.category(ch)[0] in "LM" for ch in neighbours)


def without_marks(text: str, *, open_end: bool = False) -> str | None:
    """``text`` without its combining marks and joiners, when each mark follows a character
    of a segment (a letter, a digit, ``_ . @ + = ~ -``, another mark or a joiner: not ``:``
    nor the start) and each joiner lies between letters or marks (:func:`_joiners_placed`);
    None when a character is neither a mark, a joiner nor in the key alphabet, or one is out
    of place. A few passes over the string, none backtracking; each distinct character
    looked up once."""
    outside = set(_OUTSIDE.findall(text))
    if not outside:
        return text
    joined = "\u200c" in outside or "\u200d" in outside
    others = outside - JOINERS if joined else outside
    if any(unicodedata.category(ch)[0] != "M" for ch in others) or _STARTS_OUTSIDE.search(text):
        return None
    if joined and not _joiners_placed(text, open_end=open_end):
        return None
    return _OUTSIDE.sub("", text)


def _with_marks(rule: re.Pattern, text: str, *, open_end: bool = False) -> bool:
    """Whether ``text``, refused by ``rule`` as it is, holds marks or joiners and matches
    without them."""
    if text.isascii():
        return False
    bare = without_marks(text, open_end=open_end)
    return bare is not None and bare != text and rule.fullmatch(bare) is not None


# Every bound below is also stated by the schemas of the surfaces (the tool schemas of
# memories/tools.py, the OpenAPI description of memories/api), which are built from these names.
TTL_MAX_SECONDS = 10 * 365 * 24 * 3600
TAG_MAX_LEN = 64
TAG_RE = re.compile(rf"[\w:{_PUNCTUATION}]{{1,{TAG_MAX_LEN}}}")  # marks as in keys, after any but ":"
TAGS_MAX = 20
SUBJECT_MAX_LEN = 255
SOURCE_MAX_LEN = 255
CATEGORY_MAX_LEN = 32
CATEGORY_RE = re.compile(rf"[a-z][a-z0-9_]{{0,{CATEGORY_MAX_LEN - 1}}}")
LIMIT_MAX = 200
QUERY_MAX_LEN = 500
VERSION_MAX = 2**31 - 1  # the version column's range
# Arrays/objects inside a memory value, at most this deep ({"a": {"b": 1}} is 2).
VALUE_MAX_DEPTH = 32
# A memory_read tool call answers at most max_chars characters of a value's text (a string as
# it is, other JSON as its compact JSON text), from offset: the model's context is not the place
# for a 1 MB value. The maximum is the default value cap, so such a value reads whole in one call.
READ_DEFAULT_CHARS = 2000
READ_MAX_CHARS = 16 * 1024
READ_OFFSET_MAX = 2**31 - 1
RECALL_MIN_CHARS = 50
RECALL_DEFAULT_CHARS = 500
RECALL_MAX_CHARS = 8000


def ecma_pattern(python_pattern: str) -> str:
    """A rule above as a JSON Schema ``pattern`` (OpenAPI, tool schemas): anchored (a pattern
    matches anywhere otherwise) and in ECMA-262 syntax, where ``\\w`` is ASCII-only while
    Python's is Unicode (keys such as ``user:张三:偏好`` are valid). The services still check
    every value."""
    return "^" + python_pattern.replace(r"\w", r"\p{L}\p{N}_") + "$"


CATEGORY_PATTERN = ecma_pattern(CATEGORY_RE.pattern)  # ASCII: the same in Python and ECMA-262

# The key rules with their marks and joiners, as JSON Schema patterns (the OpenAPI
# description): \p{M} in ECMA-262's u-flag syntax, as \p{L} and \p{N} already were; each
# character is matched one way (a mark only after a character, a joiner only after a letter or
# mark and before one, ":" only between segments), so a client's validator cannot backtrack.
# A segment is a letter or one of the others (digit, _-.@+=~), then any of those or marks,
# each letter or mark followed by any number of (joiner, letter or mark). A prefix's joiner
# may also end the string ("$" inside the group: no lookaround needed). tests/test_key_marks.py
# checks them against the service on every kind of string.
_ECMA_OTHER = rf"[\p{{N}}_{_PUNCTUATION}]"
_ECMA_LM = r"[\p{L}\p{M}]"
_ECMA_JOINER = r"[\u200C\u200D]"


def _ecma_segment(after_joiner: str) -> str:
    return (
        rf"(?:{_ECMA_OTHER}|\p{{L}}(?:{_ECMA_JOINER}{after_joiner})*)"
        rf"(?:{_ECMA_OTHER}|{_ECMA_LM}(?:{_ECMA_JOINER}{after_joiner})*)*"
    )


_ECMA_SEGMENT = _ecma_segment(_ECMA_LM)
_ECMA_PREFIX_SEGMENT = _ecma_segment(rf"(?:{_ECMA_LM}|$)")
KEY_PATTERN = rf"^{_ECMA_SEGMENT}(?::{_ECMA_SEGMENT})*$"
PREFIX_PATTERN = rf"^(?:{_ECMA_PREFIX_SEGMENT}(?::{_ECMA_PREFIX_SEGMENT})*:?)?$"  # "" too: no prefix
# A tag: segments as a key's, with any number of ":" before, between and after them.
TAG_PATTERN = rf"^(?::+|:*{_ECMA_SEGMENT}(?::+{_ECMA_SEGMENT})*:*)$"  # with the schemas' maxLength

# An API key's allowlist entries: each is one more OR'ed range in every search, list and
# recall the key makes (and one more check per key it touches).
ALLOWLIST_MAX_ENTRIES = 50

# Numbers are ASCII digits only. Python is generous: str.isdigit() is true for "²" and "①",
# which int() then refuses (a 500), and int() reads "１２" (full-width) as 12. Every parse
# of a number from outside (query strings, cursors, headers, form fields) goes through
# ascii_int(); dates through ascii_text() before Django's parsers, whose \d is Unicode too.
_ASCII_INT_RE = re.compile(r"-?[0-9]{1,19}")


def ascii_int(raw) -> int | None:
    """The integer an ASCII decimal string spells (surrounding blanks allowed), or None."""
    if not isinstance(raw, str):
        return None
    text = raw.strip(" \t")
    return int(text) if _ASCII_INT_RE.fullmatch(text) else None


def ascii_text(raw) -> str | None:
    """``raw`` if it is a string of printable ASCII (what dates and ids are made of), else None."""
    return raw if isinstance(raw, str) and raw.isascii() and raw.isprintable() else None


# JSON can spell half of a UTF-16 pair alone ("\ud800"). Python's json reads it into a str
# that no UTF-8 encoder takes — PostgreSQL's text, the audit chain's hash, the answer's body —
# so it failed wherever it landed first (a 500). Only a \u escape spells one (UTF-8 bytes
# cannot), so JSON text without a \ud800-\udfff escape needs no walk; a pair (an emoji as
# Python's json.dumps writes it) costs one walk over the strings.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_PATH_MAX_LEN = 200


def lone_surrogate_field(text: str, data) -> str | None:
    """Where ``data``, parsed from the JSON ``text``, holds a lone surrogate — in a string or
    an object's key: the dotted path of that string ("arguments.value", "calls.1.key"; a key
    names the object holding it; "body" for the top), at most 200 characters; else None.
    Walks ``data`` (without recursion) only when ``text`` spells a surrogate; memory linear in
    its containers (:func:`dotted_path`)."""
    if not _SURROGATE_ESCAPE.search(text) and (text.isascii() or not _SURROGATE.search(text)):
        return None  # (a body in a charset such as UTF-7 can hold one unescaped)
    return lone_surrogate_path(data)


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def lone_surrogate_path(data) -> str | None:
    """:func:`lone_surrogate_field` for ``data`` already parsed, whatever text it came from
    (the MCP SDK hands over a call's arguments parsed): walks every string, an ASCII one at no
    cost."""
    if isinstance(data, str):
        return "body" if _has_surrogate(data) else None
    stack: list[tuple[object, tuple | None]] = [(data, None)]
    while stack:
        item, trail = stack.pop()
        if isinstance(item, dict):
            children = item.items()
        elif isinstance(item, list):
            children = enumerate(item)
        else:
            continue
        for name, child in children:
            if isinstance(name, str) and _has_surrogate(name):
                return dotted_path(trail) or "body"
            if isinstance(child, str):
                if _has_surrogate(child):
                    return dotted_path((name, trail))
            elif isinstance(child, dict | list):
                stack.append((child, (name, trail)))
    return None


class DuplicateKey(ValueError):
    """A JSON object names a member twice: ``{"name": "memory_read", "name": "memory_delete"}``.
    Python's json keeps the last value, a proxy, WAF or audit of the raw body may keep the
    first: refused everywhere ZeroMem parses JSON, so no two readers act on different bodies."""

    def __init__(self, name: str):
        super().__init__(f"repeats the member {name[:64]!r}")
        self.name = name


def _unique(pairs: list) -> dict:
    # object_pairs_hook: one call per object, which the scanner hands its members as a list.
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for name, _value in pairs:
            if name in seen:
                raise DuplicateKey(name)
            seen.add(name)
    return obj


def loads_unique(text, **kwargs):
    """``json.loads(text, **kwargs)``, but an object that repeats a member name raises
    :class:`DuplicateKey` (a ``ValueError``). A body without repeats costs ~1.2-1.5× json's own
    parse (README "Keys, values and results")."""
    return json.loads(text, object_pairs_hook=_unique, **kwargs)


class _Repeating(dict):
    __slots__ = ("repeated",)


def _marked(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    obj = _Repeating(obj)
    seen = set()
    for name, _value in pairs:
        if name in seen:
            obj.repeated = name
            break
        seen.add(name)
    return obj


def duplicate_key_field(text, prefix: str = "") -> str | None:
    """The dotted path of a member named twice in the JSON ``text`` ("arguments.key",
    "calls.1.arguments.value"; under ``prefix`` if given) — the outermost such object's, then
    in document order — at most 200 characters; None if no object repeats a name or ``text``
    does not parse. For a refusal's field: parses ``text`` again, marking such objects."""
    try:
        data = json.loads(text, object_pairs_hook=_marked)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[object, tuple | None]] = [(data, (prefix, None) if prefix else None)]
    while stack:
        item, trail = stack.pop()
        if isinstance(item, _Repeating):
            return dotted_path((item.repeated, trail))
        if isinstance(item, dict):
            children = list(item.items())
        elif isinstance(item, list):
            children = list(enumerate(item))
        else:
            continue
        for name, child in reversed(children):
            if isinstance(child, dict | list):
                stack.append((child, (name, trail)))
    return None


def dotted_path(trail: tuple | None, max_len: int = _PATH_MAX_LEN) -> str:
    """The dotted path ("calls.1.key") of a walk's trail — ``(name, parent's trail)`` pairs,
    None at the top — at most ``max_len`` characters. A walk keeps trails, not paths: a path
    built for every container copied its parents' names into each (a 500,000-character name
    over 40,000 empty lists, in a 1 MiB body, was ~20 GB); a trail is one pair per container,
    and only the path of what the walk found is spelt, once."""
    names = []
    while trail is not None:
        name, trail = trail
        names.append(name)
    path = ""
    for name in reversed(names):
        path = f"{path}.{str(name)[:max_len]}" if path else str(name)[:max_len]
        if len(path) >= max_len:
            break
    return path[:max_len]


def key(value, field: str = "key") -> str:
    if not isinstance(value, str):
        raise InvalidInput("must be a string", field=field)
    if not value:
        raise InvalidInput("must not be empty", field=field)
    if len(value) > KEY_MAX_LEN:
        raise InvalidInput(f"must be at most {KEY_MAX_LEN} characters", field=field, code="too_long")
    if not KEY_RE.fullmatch(value) and not _with_marks(KEY_RE, value):
        raise InvalidInput(
            "must be ':'-separated segments of letters (with any combining marks), digits or _-.@+=~ "
            "with no empty segment (a zero-width non-joiner or joiner only between letters), "
            "e.g. 'user:u10086:pref_lang'",
            field=field,
            code="invalid_key",
        )
    return value


def prefix(value, field: str = "prefix") -> str:
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise InvalidInput("must be a string", field=field)
    if len(value) > KEY_MAX_LEN:
        raise InvalidInput(f"must be at most {KEY_MAX_LEN} characters", field=field, code="too_long")
    if not PREFIX_RE.fullmatch(value) and not _with_marks(PREFIX_RE, value, open_end=True):
        raise InvalidInput("must be the start of a key, e.g. 'user:u10086:'", field=field, code="invalid_prefix")
    return value


def allowlist(entries, field: str = "allowed_prefixes") -> list[str]:
    """An API key's allowlist, normalised (whitespace around an entry dropped, duplicates
    removed, order kept) and validated (each a key or a key prefix; none empty): the one
    place every way of creating a key goes through. An empty list means the whole tenant.

    Entries match on segment boundaries (:func:`zeromem.kernel.actors.allowlist_entry_covers`):
    ``user:u1:`` covers the keys under ``user:u1:``; a bare ``user:u1`` covers that one key
    and the keys under ``user:u1:`` (say a summary key, ``summary:session:s1``) — neither
    ever ``user:u10:secret``."""
    if entries is None:
        return []
    if not isinstance(entries, list | tuple):
        raise InvalidInput("must be a list of key prefixes", field=field)
    if len(entries) > ALLOWLIST_MAX_ENTRIES:
        raise InvalidInput(f"must have at most {ALLOWLIST_MAX_ENTRIES} entries", field=field, code="too_long")
    normalised: list[str] = []
    for raw in entries:
        entry = raw.strip() if isinstance(raw, str) else raw
        if entry == "":
            raise InvalidInput("an entry must not be empty (no entries at all: the whole tenant)", field=field)
        entry = prefix(entry, field=field)
        if entry not in normalised:
            normalised.append(entry)
    return normalised


def allowlist_entry_meaning(entry: str) -> str:
    """What an allowlist entry covers, in words (the command and the admin form say it)."""
    if entry.endswith(":"):
        return f"'{entry}' covers the keys under {entry} (not {entry[:-1]}0:…)"
    return f"'{entry}' covers the key {entry} and the keys under {entry}: (not {entry}0:…)"


def namespace_of(key_: str) -> str:
    return key_.rpartition(":")[0]


def value(raw, *, max_bytes: int, max_containers: int | None = None, field: str = "value") -> None:
    """Any JSON value but null, up to ``max_bytes`` serialized (compact, UTF-8), nested at
    most ``VALUE_MAX_DEPTH`` deep, holding at most ``max_containers`` arrays and objects
    (``ZEROMEM_VALUE_MAX_CONTAINERS``; None: no such cap).

    Null is refused: the value column cannot hold SQL NULL, and "nothing to remember" is a
    delete."""
    if raw is None:
        raise InvalidInput("must not be null (delete the memory instead)", field=field)
    depth_within(raw, field=field, max_containers=max_containers)
    try:
        text = json.dumps(raw, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"must be JSON-serializable ({exc})", field=field) from None
    if "\\u0000" in text:  # PostgreSQL's jsonb cannot hold NUL in text
        raise InvalidInput("must not contain NUL characters", field=field)
    try:
        size = len(text.encode())
    except UnicodeEncodeError:
        # A value handed over as Python (the admin's form, in-process adapters); the JSON
        # parsers refuse one first, naming where it is (lone_surrogate_field).
        raise InvalidInput(
            "must be valid Unicode: a lone surrogate (half of a UTF-16 pair) cannot be stored",
            field=field,
            code="invalid_characters",
        ) from None
    written_out = _written_out_extra(raw) if _EXPONENT.search(text) else 0
    if size + written_out > max_bytes:
        how = " (numbers in exponent notation counted written out, as PostgreSQL stores them)" if written_out else ""
        raise PayloadTooLarge(
            f"serialized value is {size + written_out} bytes{how}; the limit is {max_bytes}", field=field
        )


# A number with an exponent, as Python's json writes a float (1e+308, 5e-324, 1.5e-07); a
# string holding one only costs the walk below.
_EXPONENT = re.compile(r"[0-9][eE]")


def _written_out_extra(raw) -> int:
    """The bytes ``raw``'s compact JSON text grows by as PostgreSQL hands it back: jsonb keeps
    a number as numeric and writes it out in full — 1e308 (6 bytes) as 309 digits, 5e-324 as
    326 characters — so 14 KB of ``[1e308,…]`` read back as 725 KB. One walk over the
    containers (no recursion); floats with an exponent only."""
    extra = 0
    stack = [raw]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, float):
            text = repr(item)
            if "e" in text:
                extra += len(format(Decimal(text), "f")) - len(text)
    return extra


def depth_within(raw, *, field: str, max_depth: int | None = None, max_containers: int | None = None) -> None:
    """Refuse JSON nested deeper than ``VALUE_MAX_DEPTH`` arrays/objects, or holding more
    than ``max_containers`` of them (when given), in one walk without recursion (a hostile
    value cannot exhaust the stack).

    The container count bounds what PostgreSQL spends parsing the value into jsonb: measured
    through memory_write on a fresh backend, 256 KiB of ``[{},{},…]`` (87,380 objects) grew it
    by 57 MB, 256 KiB of scalars ``[0,0,…]`` by 15 MB, 10,000 ``{}`` among scalars by 19 MB,
    one string by 1.4 MB (README "Keys, values and results")."""
    limit = VALUE_MAX_DEPTH if max_depth is None else max_depth
    containers = 0
    stack = [(raw, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            raise InvalidInput(f"must not nest arrays or objects more than {limit} deep", field=field, code="too_deep")
        containers += 1
        if max_containers is not None and containers > max_containers:
            raise InvalidInput(
                f"must hold at most {max_containers:,} arrays and objects (at any depth, this one included)",
                field=field,
                code="too_many_containers",
            )
        stack.extend((child, depth + 1) for child in children)


def ttl_seconds(raw, field: str = "ttl_seconds") -> timedelta | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise InvalidInput("must be an integer number of seconds", field=field)
    if raw < 1 or raw > TTL_MAX_SECONDS:
        raise InvalidInput(f"must be between 1 and {TTL_MAX_SECONDS}", field=field, code="out_of_range")
    return timedelta(seconds=raw)


def tags(raw, field: str = "tags") -> list[str] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise InvalidInput("must be a list of strings", field=field)
    if len(raw) > TAGS_MAX:
        raise InvalidInput(f"at most {TAGS_MAX} tags", field=field, code="out_of_range")
    for t in raw:
        if len(t) > TAG_MAX_LEN or not (TAG_RE.fullmatch(t) or _with_marks(TAG_RE, t)):
            raise InvalidInput(
                f"each tag is 1-{TAG_MAX_LEN} letters (with any combining marks), digits or _-.@+=~: "
                "(a zero-width non-joiner or joiner only between letters)",
                field=field,
            )
    return list(dict.fromkeys(raw))


def short_text(raw, *, field: str, max_len: int) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise InvalidInput("must be a string", field=field)
    if len(raw) > max_len:
        raise InvalidInput(f"must be at most {max_len} characters", field=field, code="too_long")
    if any(ord(c) < 32 or ord(c) == 127 for c in raw):
        raise InvalidInput("must not contain control characters", field=field)
    return raw


def subject(raw, field: str = "subject") -> str | None:
    """A subject as a write stores it: :func:`short_text`, and not only whitespace (Unicode's
    too: an ideographic space), which names no end user — a forget by the subject meant would
    miss it; nor with characters that make it display as another subject (:func:`_visible`:
    "u1" + U+200B shows as "u1", and a forget of "u1" misses it). "" (no subject) is allowed.
    Reads and forget requests take any :func:`short_text`, so a subject written before these
    rules is still found and forgotten."""
    raw = short_text(raw, field=field, max_len=SUBJECT_MAX_LEN)
    if raw and raw.isspace():
        raise InvalidInput('must not be only whitespace (leave it out, or "" for none)', field=field, code="blank")
    if raw and not raw.isascii() and not _visible(raw):
        raise InvalidInput(
            "must not contain invisible or direction-changing characters (bidi controls, zero-width "
            "spaces, line separators, C1 controls; a zero-width non-joiner or joiner only between letters)",
            field=field,
            code="invalid_characters",
        )
    return raw


# Characters that show as nothing, or change how the text around them shows: controls (C1
# too), format characters (bidi controls, zero-width space, BOM), line and paragraph
# separators, private-use, surrogates and unassigned code points.
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cs", "Cn"})


def _visible(text: str) -> bool:
    """Whether ``text`` displays as itself: none of :data:`_INVISIBLE_CATEGORIES`, but for a
    zero-width non-joiner or joiner between letters or marks (as in keys: Persian, Indic
    names). Each distinct character looked up once."""
    odd = {ch for ch in set(text) if unicodedata.category(ch) in _INVISIBLE_CATEGORIES}
    if not odd:
        return True
    if odd - JOINERS or text[0] in JOINERS:
        return False
    return _joiners_placed(text, open_end=False)


def category(raw, field: str = "category") -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not CATEGORY_RE.fullmatch(raw):
        raise InvalidInput("must be a lowercase word such as user, task, decision, fact", field=field)
    return raw


def importance(raw, field: str = "importance") -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= 10:
        raise InvalidInput("must be an integer from 0 to 10", field=field, code="out_of_range")
    return raw


def bounded_int(raw, *, field: str, default: int, low: int, high: int) -> int:
    if raw is None:
        return default
    if isinstance(raw, str):
        parsed = ascii_int(raw)
        if parsed is None:
            raise InvalidInput("must be an integer (ASCII digits)", field=field)
        raw = parsed
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise InvalidInput("must be an integer", field=field)
    if not low <= raw <= high:
        raise InvalidInput(f"must be between {low} and {high}", field=field, code="out_of_range")
    return raw


def limit(raw, *, default: int, field: str = "limit") -> int:
    return bounded_int(raw, field=field, default=default, low=1, high=LIMIT_MAX)


def read_max_chars(raw) -> int:
    """A tool read's or search's ``max_chars``: characters of a value answered (per result)."""
    return bounded_int(raw, field="max_chars", default=READ_DEFAULT_CHARS, low=1, high=READ_MAX_CHARS)


def version(raw, field: str = "expected_version") -> int | None:
    if raw is None:
        return None
    return bounded_int(raw, field=field, default=0, low=1, high=VERSION_MAX)


def query(raw, field: str = "query", *, required: bool = True) -> str:
    """A search question: 1-``QUERY_MAX_LEN`` characters, no NUL. ``required=False``: None or
    blank is allowed and returned as ""."""
    if not required and (raw is None or (isinstance(raw, str) and not raw.strip())):
        return ""
    if not isinstance(raw, str) or not raw.strip():
        raise InvalidInput("must be a non-empty string", field=field)
    if len(raw) > QUERY_MAX_LEN:
        raise InvalidInput(f"must be at most {QUERY_MAX_LEN} characters", field=field, code="too_long")
    if "\x00" in raw:
        raise InvalidInput("must not contain NUL characters", field=field, code="invalid_characters")
    if _has_surrogate(raw):  # handed over as Python: no parser refused it
        raise InvalidInput(
            "must be valid Unicode: a lone surrogate (half of a UTF-16 pair) cannot be stored",
            field=field,
            code="invalid_characters",
        )
    return raw


# Cursors are opaque to callers: base64 of the last key seen (keyset pagination on key), at
# most that of the longest key's UTF-8 (4 bytes a character), unpadded.
CURSOR_MAX_LEN = -(-KEY_MAX_LEN * 4 * 4 // 3)


def encode_cursor(last_key: str) -> str:
    return base64.urlsafe_b64encode(last_key.encode()).decode().rstrip("=")


def decode_cursor(raw, field: str = "cursor") -> str | None:
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str) or len(raw) > CURSOR_MAX_LEN:
        raise InvalidInput("is not a cursor this API returned", field=field, code="invalid_cursor")
    try:
        decoded = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode()
        return key(decoded, field=field)
    except (ValueError, InvalidInput):
        raise InvalidInput("is not a cursor this API returned", field=field, code="invalid_cursor") from None


def decode_version_cursor(raw, *, field: str = "cursor") -> int | None:
    """A cursor over one memory's versions (its own count, shown anyway): the version, or None."""
    text = decode_cursor(raw, field=field)
    if text is None:
        return None
    number = ascii_int(text)
    if number is None or not 1 <= number <= 2**63 - 1 or text != str(number):
        raise InvalidInput("is not a cursor this API returned", field=field, code="invalid_cursor")
    return number


def public_uid(raw) -> uuid.UUID | None:
    """The uid a job or forget request is shown by (``job_id``, ``/forget-requests/{id}``), or
    None for anything else — an old numeric id among them: the caller answers not found."""
    if isinstance(raw, uuid.UUID):
        return raw
    if not isinstance(raw, str) or len(raw) != 36:
        return None
    try:
        return uuid.UUID(raw)
    except ValueError:
        return None


def encode_id_cursor(pk: int) -> str:
    """A cursor over row ids, opaque (:mod:`zeromem.kernel.opaque`): the ids come from
    sequences shared by every tenant, so the id itself is never shown."""
    return opaque.seal_id(pk, purpose="cursor")


def decode_id_cursor(raw, *, field: str = "cursor", high: int = 2**63 - 1) -> int | None:
    """A cursor over row ids (audit events, forget requests, history): the id, or None for none."""
    if raw is None or raw == "":
        return None
    pk = opaque.open_id(raw, purpose="cursor")
    if pk is None or not 1 <= pk <= high:
        raise InvalidInput("is not a cursor this API returned", field=field, code="invalid_cursor")
    return pk
