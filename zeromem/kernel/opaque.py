"""Opaque stand-ins for row ids a tenant is shown (README "REST API", "Opaque ids").

Row ids come from sequences shared by every tenant: a tenant that saw them (in an ETag, a
cursor) could watch the sequence grow and gauge the others' activity. What a tenant sees
instead is the id enciphered under a key derived from ``SECRET_KEY`` — one AES block, the
id and eight zero bytes, as 32 lowercase hex digits (no character a spreadsheet reads as a
formula's start, none a URL escapes): the same row always gives the
same token, tokens of consecutive ids share nothing, and a token we did not issue opens to
None (the zero bytes do not come back), not to some other row.

``purpose`` keeps the uses apart: a memory's ETag token does not open as a cursor.
Rotating ``SECRET_KEY`` makes earlier tokens unknown (an ETag then fails its If-Match with
412, a cursor is ``invalid_cursor``): read again.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from django.conf import settings

TOKEN_LEN = 32
TOKEN_PATTERN = r"[0-9a-f]{32}"
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
    return block.hex()


def open_id(token, *, purpose: str) -> int | None:
    """The row id a token from :func:`seal_id` stands for; None for anything else."""
    if not isinstance(token, str) or not _TOKEN_RE.match(token):
        return None
    block = bytes.fromhex(token)
    decryptor = _cipher(settings.SECRET_KEY, purpose).decryptor()
    plain = decryptor.update(block) + decryptor.finalize()
    if plain[8:] != _ZERO:
        return None
    return int.from_bytes(plain[:8], "big")


# Actors whose id is a row id (an API key's, a staff user's: sequences every tenant shares).
ACTOR_PURPOSES = {"api_key": "api-key", "staff": "staff-user"}


def shown_actor_id(kind: str, actor_id: str) -> str:
    """An actor's id as a tenant is shown it (audit review and exports, a memory's history):
    an API key's and a staff user's is a row id, from a sequence every tenant's keys (users)
    share, so it is shown as a token; any other actor's id (an end user's subject, a job) as
    it is."""
    purpose = ACTOR_PURPOSES.get(kind)
    if purpose is not None and actor_id.isascii() and actor_id.isdigit():
        return seal_id(int(actor_id), purpose=purpose)
    return actor_id


def stored_actor(shown: str) -> tuple[str, str] | None:
    """(actor kind, stored actor id) a shown token stands for (the audit ``actor`` filter takes
    what the review showed; a token says its kind), or None when ``shown`` is no such token."""
    for kind, purpose in ACTOR_PURPOSES.items():
        pk = open_id(shown, purpose=purpose)
        if pk is not None:
            return kind, str(pk)
    return None
