"""Which end user (*subject*) a memory key names by convention, and the key prefixes that
name one: what a write infers a new memory's subject from, what a subject's forget takes as
their own namespace, which end users a limited API key may name, and which audit events a
forget redacts — one rule for all of them.

* ``user:<id>:…`` and ``usr:<id>:…`` (at least one segment after the id): ``<id>``, as given;
* a LangGraph store item whose namespace starts ``("users", <id>, …)`` — or ``("user", …)``,
  ``("usr", …)`` — the memory ``<ZEROMEM_LANGGRAPH_PREFIX>:users:<id, escaped>:…:<key>``
  (memories/services/langgraph.py): ``<id>`` unescaped, when it is a subject a write may
  store (:func:`zeromem.kernel.validation.subject`). Before, such items carried no subject,
  and a subject's forget — and the end user's portal — missed them.

The LangGraph mapping's escaping lives here (:func:`encode_segment`, :func:`decode_segment`)
so that both sides spell a label the same way.
"""

from __future__ import annotations

import re

from django.conf import settings

from zeromem.kernel import validation
from zeromem.kernel.errors import InvalidInput

KEY_WORDS = ("user", "usr")
LANGGRAPH_WORDS = ("users", "user", "usr")
_KEEP = re.compile(r"[\w.@+=-]")
_ESCAPED = re.compile(r"(?:~[0-9A-F]{2})+")


def encode_segment(text: str) -> str:
    """A LangGraph label or key as one key segment: letters, digits and ``_ . @ + = -`` kept,
    every other character ``~HH`` per UTF-8 byte (``a:b`` → ``a~3Ab``)."""
    return "".join(ch if _KEEP.fullmatch(ch) else "".join(f"~{b:02X}" for b in ch.encode()) for ch in text)


def decode_segment(segment: str) -> str:
    return _ESCAPED.sub(lambda m: bytes.fromhex(m.group(0).replace("~", "")).decode("utf-8", "replace"), segment)


def _langgraph_root() -> str:
    return settings.ZEROMEM_LANGGRAPH_PREFIX + ":"


def subject_of_key(key: str) -> str:
    """The end user ``key`` names by convention, or "" for none."""
    parts = key.split(":")
    if len(parts) >= 3 and parts[0] in KEY_WORDS:
        return parts[1]
    root = _langgraph_root()
    if not key.startswith(root):
        return ""
    labels = key[len(root) :].split(":")
    if len(labels) < 3 or labels[0] not in LANGGRAPH_WORDS:
        return ""
    label = decode_segment(labels[1])
    if encode_segment(label) != labels[1] or "." in label:
        return ""  # no item's key (langgraph.parse_key): the mapping never writes it
    try:
        return validation.subject(label) or ""
    except InvalidInput:
        return ""  # a label no write could store as a subject (a control character, ...)


def subject_namespaces(subject: str) -> tuple[str, ...]:
    """The key prefixes that name ``subject`` (:func:`subject_of_key`): ``user:<id>:``,
    ``usr:<id>:`` and the LangGraph namespaces ``lg:users:<id>:``, ``lg:user:<id>:``,
    ``lg:usr:<id>:`` (the prefix ``ZEROMEM_LANGGRAPH_PREFIX``, the id escaped). A subject
    with ``:`` has no ``user:``/``usr:`` namespace: ``user:a:b:note`` is user ``a``'s key, and
    taking ``user:a:b:`` as ``a:b``'s let a forget of ``a:b`` erase ``a``'s memories there that
    named no one and pseudonymise ``a``'s audit events."""
    label = encode_segment(subject)
    root = _langgraph_root()
    plain = () if ":" in subject else tuple(f"{word}:{subject}:" for word in KEY_WORDS)
    return (*plain, *(f"{root}{word}:{label}:" for word in LANGGRAPH_WORDS))
