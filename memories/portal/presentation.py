"""Memories in plain words, for people who are not programmers: a key's last segment as a
short phrase (``user:u10086:pref_lang`` → "Preferred language") and a JSON value as text,
lists and labelled fields (never raw JSON, unless it nests deeper than a page can show)."""

from __future__ import annotations

import json
import re

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

# Abbreviations agents use in key names, spelled out.
WORDS = {
    "pref": "preferred",
    "prefs": "preferences",
    "lang": "language",
    "tz": "time zone",
    "addr": "address",
    "num": "number",
    "msg": "message",
    "msgs": "messages",
    "info": "information",
    "id": "ID",
    "dob": "date of birth",
    "qty": "quantity",
    "desc": "description",
    "cfg": "settings",
    "config": "settings",
    "loc": "location",
    "fav": "favourite",
    "tel": "phone",
    "email": "email",
    "ts": "time",
}
CATEGORY_WORDS = {
    "user": "About you",
    "task": "A task",
    "decision": "A decision",
    "fact": "A fact",
    "summary": "A summary",
    "note": "A note",
}
MAX_DEPTH = 4
_SPLIT = re.compile(r"[_\-.~+=@]+|(?<=[a-z])(?=[A-Z])")


def plain_words(name: str) -> str:
    """``pref_lang`` → "Preferred language"; ``lastOrderDate`` → "Last order date"."""
    words = [w for w in _SPLIT.split(name) if w]
    if not words:
        return name
    spelled = [WORDS.get(w.lower(), w.lower() if not w.isupper() else w) for w in words]
    text = " ".join(spelled)
    return text[:1].upper() + text[1:]


def key_label(key: str) -> str:
    return plain_words(key.rsplit(":", 1)[-1])


def category_label(category: str) -> str:
    return CATEGORY_WORDS.get(category, plain_words(category))


# A constant line break (no input in it): safe as it is.
LINE_BREAK = SafeString("<br>")


def readable_value(value, depth: int = 0) -> SafeString:
    """HTML (escaped) for a JSON value."""
    if value is None:
        return format_html('<span class="muted">{}</span>', "(nothing)")
    if isinstance(value, bool):
        return format_html("{}", "Yes" if value else "No")
    if isinstance(value, int | float):
        return format_html("{}", value)
    if isinstance(value, str):
        if not value:
            return format_html('<span class="muted">{}</span>', "(empty)")
        lines = value.splitlines() or [value]
        return format_html_join(LINE_BREAK, "{}", ((line,) for line in lines))
    if depth >= MAX_DEPTH:
        return format_html("<code>{}</code>", json.dumps(value, ensure_ascii=False))
    if isinstance(value, list):
        if not value:
            return format_html('<span class="muted">{}</span>', "(an empty list)")
        if all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in value):
            return format_html("{}", ", ".join(str(v) for v in value))
        items = format_html_join("", "<li>{}</li>", ((readable_value(v, depth + 1),) for v in value))
        return format_html("<ul>{}</ul>", items)
    if isinstance(value, dict):
        if not value:
            return format_html('<span class="muted">{}</span>', "(nothing)")
        rows = format_html_join(
            "",
            "<dt>{}</dt><dd>{}</dd>",
            ((plain_words(str(k)), readable_value(v, depth + 1)) for k, v in value.items()),
        )
        return format_html("<dl>{}</dl>", rows)
    return format_html("{}", str(value))  # pragma: no cover - JSON has no other types
