"""What this process last saw of a memory, by tenant and key: its version and subject, and
what a write over it needs of its row (its id, expiry and tags).

A read of a key seen lately sends its audit event with its SELECT, as one statement — the
event says what the read will find, and is written only if the row still holds that version
and subject (zeromem/kernel/hotsql.py "An event that rides the read it records"). A tool write
over a key seen lately sends its statement without reading the row first, with the rate
counter (hotsql "A write and the rate counter in one round trip"): its UPDATE writes only while
the row holds the version, expiry, subject and tags seen here, not trashed, not sensitive.
Nothing is answered from here: the value, and whether there is a memory at all, come from the
database. A stale entry costs what a read or a write cost before, plus, for a write, the round
trip that found it stale; it is then replaced by what the read or write found.

A write that found its entry stale leaves the key *cold*: its next writes read the row first,
as before, until one of them (or a read) finds the row as this process left it — so a key that
two processes write in turn does not pay the stale round trip at every write.

Only plain memories are kept (a sensitive one's read may open to an erased value, whose event
is another outcome; a write over one may seal). An entry is a version, a subject, an id, an
expiry and tags, never a value; each process keeps its own, at most :data:`MAX_ENTRIES` (the
lot dropped when full: the next reads and writes of each key go as before once).
"""

from __future__ import annotations

from typing import NamedTuple

from django.conf import settings

from memories.models import Memory
from memories.selectors import memory_loaded

MAX_ENTRIES = 10_000

# What a write over the row needs of it (the UPDATE checks each: memories.services.memories).
_ROW = ("id", "tenant_id", "key", "version", "subject", "expires_at", "tags", "sensitive", "deleted_at")


class _Entry(NamedTuple):
    version: int
    subject: str
    # (id, expires_at, tags) of the row; None for a cold key (above).
    row: tuple | None


_seen: dict[tuple[int, str], _Entry] = {}


def expected(tenant_id: int, key: str) -> tuple[int, str] | None:
    """(version, subject) of the live memory at ``key`` when this process last saw it, if it
    did and that memory was plain; None with ``ZEROMEM_READ_ONE_STATEMENT`` off."""
    if not settings.ZEROMEM_READ_ONE_STATEMENT:
        return None
    entry = _seen.get((tenant_id, key))
    return None if entry is None else (entry.version, entry.subject)


def as_seen(tenant_id: int, key: str) -> Memory | None:
    """The live memory at ``key`` as this process last saw it, loaded with what a write over it
    needs (its other fields deferred), if it did, it was plain and the key is not cold; None
    with ``ZEROMEM_WRITE_PIPED`` off."""
    if not settings.ZEROMEM_WRITE_PIPED:
        return None
    entry = _seen.get((tenant_id, key))
    if entry is None or entry.row is None:
        return None
    pk, expires_at, tags = entry.row
    return memory_loaded(_ROW, (pk, tenant_id, key, entry.version, entry.subject, expires_at, list(tags), False, None))


def saw(tenant_id: int, key: str, memory, *, found: int | None = None) -> None:
    """Remember ``memory`` — the live memory at ``key``, as read or written — or, for a
    sensitive one or none (``memory`` None), forget the key. ``found``: the version a write
    found the row at before writing over it (a read found ``memory``'s own): a cold key stays
    cold unless it is the version this process had seen."""
    if memory is None or memory.sensitive:
        _seen.pop((tenant_id, key), None)
        return
    if len(_seen) >= MAX_ENTRIES:
        _seen.clear()
    before = _seen.get((tenant_id, key))
    warm = before is None or before.row is not None or before.version == (memory.version if found is None else found)
    loaded = memory.__dict__
    row = None
    if warm and "id" in loaded and "expires_at" in loaded and isinstance(loaded.get("tags"), list):
        row = (memory.pk, memory.expires_at, tuple(memory.tags))
    _seen[(tenant_id, key)] = _Entry(memory.version, memory.subject, row)


def missed(tenant_id: int, key: str) -> None:
    """A write found the row at ``key`` not as this process last saw it: the key turns cold."""
    entry = _seen.get((tenant_id, key))
    if entry is not None:
        _seen[(tenant_id, key)] = entry._replace(row=None)


def clear() -> None:
    """Forget everything (tests)."""
    _seen.clear()
