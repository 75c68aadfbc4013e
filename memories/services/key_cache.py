"""The API keys this process has verified lately, so a request costs no key lookup.

An authenticated request used to start with ``SELECT api_key JOIN tenant`` — a fifth of a
read's CPU and one of its database round trips. A verified key (with its tenant) is kept
here for ``ZEROMEM_API_KEY_CACHE_SECONDS`` (10 s by default; 0 turns the cache off):

- An entry is found by the key's public ``lookup`` and used only when the hash of the whole
  key the request sent equals the stored hash (constant-time compare), so a wrong secret
  never gets a cached answer; it goes to the database and fails there, audited as before.
- Only keys that passed every check are stored; expiry is checked again on every use.
- Revocation and every other change of a key or its tenant (scopes, allowlist, settings)
  takes effect **at once in the process that made it** (:func:`forget`, called by the
  services and, for admin edits, by the models' ``post_save``/``post_delete``), and **within
  the TTL in every other process** of the same or another instance: an entry older than the
  TTL is never used.
- At most ``MAX_ENTRIES`` keys (only valid keys get in, so nobody can flood it without
  valid keys; when full it starts over).
"""

from __future__ import annotations

import hmac
import time
from threading import Lock

from django.conf import settings

from memories.models import ApiKey

MAX_ENTRIES = 10_000

# lookup → (monotonic time stored, ApiKey with its tenant loaded). A plain dict: reads and
# single assignments are atomic under the GIL; the lock only orders clear-and-store.
_entries: dict[str, tuple[float, ApiKey]] = {}
_lock = Lock()
# Moved by every forget: a key read from the database before a forget is not stored after it
# (a request that read it just before a revocation committed would cache the revoked key).
_generation = 0
# Tests move this clock to show the TTL bound without sleeping.
clock = time.monotonic


def ttl_seconds() -> float:
    return float(settings.ZEROMEM_API_KEY_CACHE_SECONDS)


def get(lookup: str, key_hash: str) -> ApiKey | None:
    """The verified key for ``lookup`` if it was stored less than the TTL ago and
    ``key_hash`` (the hash of the key as sent) is its hash; else None."""
    entry = _entries.get(lookup)
    if entry is None:
        return None
    stored_at, key = entry
    if clock() - stored_at >= ttl_seconds():
        _entries.pop(lookup, None)
        return None
    if not hmac.compare_digest(key.key_hash, key_hash):
        return None
    return key


def generation() -> int:
    """Take it before reading a key from the database, and hand it to :func:`put`."""
    return _generation


def put(key: ApiKey, *, seen: int | None = None) -> None:
    """Remember a key that passed every check (its tenant loaded) — unless something was
    forgotten since ``seen`` (:func:`generation` before the key was read)."""
    if ttl_seconds() <= 0:
        return
    with _lock:
        if seen is not None and seen != _generation:
            return
        if len(_entries) >= MAX_ENTRIES:
            _entries.clear()
        _entries[key.lookup] = (clock(), key)


def forget(lookup: str | None = None) -> None:
    """Drop one key (``lookup``), or every key (None: a tenant changed)."""
    global _generation
    with _lock:
        _generation += 1
        if lookup is None:
            _entries.clear()
        else:
            _entries.pop(lookup, None)


def forget_key(sender, instance: ApiKey, **kwargs) -> None:
    """``post_save``/``post_delete`` of an ApiKey (admin edits included)."""
    forget(instance.lookup)


def forget_all(sender, **kwargs) -> None:
    """``post_save``/``post_delete`` of a Tenant: its keys carry it."""
    forget()
