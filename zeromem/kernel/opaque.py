"""Opaque stand-ins for row ids a tenant is shown (README "REST API", "Opaque ids").

Row ids come from sequences shared by every tenant: a tenant that saw them (in an ETag, a
cursor) could watch the sequence grow and gauge the others' activity. What a tenant sees
instead is the id enciphered under a key derived from ``SECRET_KEY`` — one AES block, the
id and eight zero bytes, as 22 URL-safe base64 characters: the same row always gives the
same token, tokens of consecutive ids share nothing, and a token we did not issue opens to
None (the zero bytes do not come back), not to some other row.

``purpose`` keeps the uses apart: a memory's ETag token does not open as a cursor.
Rotating ``SECRET_KEY`` makes earlier tokens unknown (an ETag then fails its If-Match with
412, a cursor is ``invalid_cursor``): read again.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import re

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from django.conf import settings

TOKEN_LEN = 22
TOKEN_PATTERN = r"[A-Za-z0-9_-]{22}"
_TOKEN_RE = re.compile(rf"^{TOKEN_PATTERN}$")
_ZERO = bytes(8)


@functools.lru_cache(maxsize=16)
def _cipher(secret: str, purpose: str) -> Cipher:
    key = hmac.new(secret.encode(), f"zeromem-opaque-id:{purpose}".encode(), hashlib.sha256).digest()[:16]
    return Cipher(algorithms.AES(key), modes.ECB())  # nosec B305: one block, a keyed permutation of the id


def seal_id(pk: int, *, purpose: str) -> str:
    """The token shown for the row id ``pk`` (0 ≤ pk < 2**64)."""
    encryptor = _cipher(settings.SECRET_KEY, purpose).encryptor()
    block = encryptor.update(int(pk).to_bytes(8, "big") + _ZERO) + encryptor.finalize()
    return base64.urlsafe_b64encode(block).decode().rstrip("=")


def open_id(token, *, purpose: str) -> int | None:
    """The row id a token from :func:`seal_id` stands for; None for anything else."""
    if not isinstance(token, str) or not _TOKEN_RE.match(token):
        return None
    try:
        block = base64.urlsafe_b64decode(token + "==")
    except (binascii.Error, ValueError):
        return None
    decryptor = _cipher(settings.SECRET_KEY, purpose).decryptor()
    plain = decryptor.update(block) + decryptor.finalize()
    if plain[8:] != _ZERO:
        return None
    return int.from_bytes(plain[:8], "big")
