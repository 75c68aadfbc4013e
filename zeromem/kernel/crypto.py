"""Envelope encryption primitives (AES-256-GCM from ``cryptography``); no database here.

* **Master keys** come from ``settings.ZEROMEM_MASTER_KEYS`` (a list of base64 32-byte keys,
  never stored in the database): the first one wraps new data keys, every one listed can
  unwrap. A master key is named by its id, the first 16 hex digits of a hash of it.
* **Data keys** (random 32 bytes, one per tenant and one per subject) encrypt values; they
  are stored only wrapped (encrypted) under a master key, with the master key's id
  (``memories.models.DataKey``).
* A sealed value is stored as the JSON **envelope** ``{"zmenc": 1, "k": <data key id>,
  "c": "<base64 of nonce + ciphertext + tag>"}``; the data key's id is the additional
  authenticated data, so a ciphertext moved under another key's id fails to open.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from zeromem.kernel.errors import Unavailable

SETTING = "ZEROMEM_MASTER_KEYS"
ENVELOPE_MARK = "zmenc"
KEY_BYTES = 32
NONCE_BYTES = 12


class MasterKeyError(Unavailable):
    """A master key is missing, malformed or wrong; the message names the setting. Surfaces
    answer 503 ``encryption_unavailable`` (a deployment fault, not the caller's), audited as
    ``unavailable``; start-up checks refuse to start on it (``zeromem.E010``-``E012``)."""

    default_code = "encryption_unavailable"


def parse_master_keys(raw: list[str]) -> dict[str, bytes]:
    """{key id: key} in the order given (the first encrypts). Raises :class:`MasterKeyError`."""
    keys: dict[str, bytes] = {}
    for n, item in enumerate(raw):
        text = item.strip()
        try:
            key = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            key = b""
        if len(key) != KEY_BYTES:
            raise MasterKeyError(
                f"{SETTING}[{n}] is not a base64-encoded 32-byte key (make one with: python -c "
                "'import secrets,base64;print(base64.urlsafe_b64encode(secrets.token_bytes(32)).decode())')"
            )
        keys[master_key_id(key)] = key
    return keys


def master_key_id(key: bytes) -> str:
    return hashlib.sha256(b"zeromem-master-key-id\x00" + key).hexdigest()[:16]


def dev_master_key(secret_key: str) -> str:
    """The development-mode master key, derived from SECRET_KEY (refused in production)."""
    key = hashlib.sha256(b"zeromem-dev-master-key\x00" + secret_key.encode()).digest()
    return base64.urlsafe_b64encode(key).decode()


def new_data_key() -> bytes:
    return AESGCM.generate_key(bit_length=256)


def _aad_wrap(tenant_id: int, subject: str) -> bytes:
    return f"zeromem-data-key\x00{tenant_id}\x00{subject}".encode()


def wrap(master: bytes, data_key: bytes, *, tenant_id: int, subject: str) -> bytes:
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(master).encrypt(nonce, data_key, _aad_wrap(tenant_id, subject))


def unwrap(master: bytes, wrapped: bytes, *, tenant_id: int, subject: str) -> bytes:
    try:
        return AESGCM(master).decrypt(wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], _aad_wrap(tenant_id, subject))
    except InvalidTag as exc:
        raise MasterKeyError(f"a data key does not open with its master key: {SETTING} holds a wrong key") from exc


def _aad_value(data_key_id: int) -> bytes:
    return f"zeromem-value\x00{data_key_id}".encode()


def seal(data_key: bytes, data_key_id: int, value: Any) -> dict:
    """The envelope of a JSON value under a data key."""
    nonce = os.urandom(NONCE_BYTES)
    plain = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    sealed = nonce + AESGCM(data_key).encrypt(nonce, plain, _aad_value(data_key_id))
    return {ENVELOPE_MARK: 1, "k": data_key_id, "c": base64.b64encode(sealed).decode()}


def open_envelope(data_key: bytes, envelope: dict) -> Any:
    raw = base64.b64decode(envelope["c"])
    plain = AESGCM(data_key).decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], _aad_value(int(envelope["k"])))
    return json.loads(plain)


def is_envelope(value: Any) -> bool:
    return isinstance(value, dict) and value.get(ENVELOPE_MARK) == 1 and "k" in value and "c" in value


class ErasedValue(dict):
    """What a sealed value reads as once its data key is destroyed (crypto-shredded):
    ``{"erased": true}`` to anything that serializes it, never the ciphertext. Keeps the
    envelope so that saving the row again stores it unchanged."""

    def __init__(self, envelope: dict):
        super().__init__(erased=True)
        self.envelope = envelope


class Unopened(dict):
    """A sealed value as loaded, before its row's tenant is known (``SealedJSONField``):
    the row opens it with the tenant bound (``memories.keyring.open_value``). It holds the
    envelope itself, so anything that leaks it leaks ciphertext, never plaintext."""
