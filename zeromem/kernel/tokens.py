"""What a tool result costs the model: its size in bytes and an estimate of its tokens.

The estimator (README "Tool calls", "Token cost"): ASCII text ≈ 4 characters per token
(English prose and JSON punctuation in GPT/Claude tokenizers run 3.5-4.5), and every
non-ASCII character counts as one token (CJK characters are about one token each; accented
Latin letters are usually part of a longer token, so the estimate leans high there)::

    tokens = ceil(ascii characters / 4) + non-ASCII characters

No tokenizer is loaded: the figure is computed in C-speed string operations (a few
microseconds for a typical result) and is the same whichever model reads the result.
"""

from __future__ import annotations

import json

ASCII_CHARS_PER_TOKEN = 4


def compact_json(data) -> bytes:
    """A result as the model receives it (zeromem/renderers.py): no spaces, UTF-8 text rather
    than \\u escapes, ``str()`` of what JSON lacks. ``allow_nan=False``: NaN or Infinity would
    make the answer invalid JSON; the inputs refuse them, and anything that slips through is
    an error, not a broken body."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str, allow_nan=False).encode()


def estimate_tokens(text: str) -> int:
    if not text:
        return 0
    if text.isascii():
        return -(-len(text) // ASCII_CHARS_PER_TOKEN)
    ascii_chars = len(text.encode("ascii", "ignore"))
    return -(-ascii_chars // ASCII_CHARS_PER_TOKEN) + (len(text) - ascii_chars)


def cost_of(body: bytes) -> tuple[int, int]:
    """(bytes, estimated tokens) of a UTF-8 result body."""
    return len(body), estimate_tokens(body.decode("utf-8", "replace"))
