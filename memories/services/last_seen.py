"""What this process last saw of a memory: its version and subject, by tenant and key.

A read of a key seen lately sends its audit event with its SELECT, as one statement — the
event says what the read will find, and is written only if the row still holds that version
and subject (zeromem/kernel/hotsql.py "An event that rides the read it records"). Nothing is
answered from here: the value, and whether there is a memory at all, come from the row read.
A stale entry costs what a read cost before (the event sent after the SELECT), and is then
replaced by what the read found.

Only plain memories are kept (a sensitive one's read may open to an erased value, whose event
is another outcome). An entry is a version number and a subject, never a value; each process
keeps its own, at most :data:`MAX_ENTRIES` (the lot dropped when full: the next reads of each
key send their event after the SELECT once, as before).
"""

from __future__ import annotations

from django.conf import settings

MAX_ENTRIES = 10_000

_seen: dict[tuple[int, str], tuple[int, str]] = {}


def expected(tenant_id: int, key: str) -> tuple[int, str] | None:
    """(version, subject) of the live memory at ``key`` when this process last saw it, if it
    did and that memory was plain; None with ``ZEROMEM_READ_ONE_STATEMENT`` off."""
    if not settings.ZEROMEM_READ_ONE_STATEMENT:
        return None
    return _seen.get((tenant_id, key))


def saw(tenant_id: int, key: str, memory) -> None:
    """Remember ``memory`` — the live memory at ``key``, as read or written — or, for a
    sensitive one or none (``memory`` None), forget the key."""
    if memory is None or memory.sensitive:
        _seen.pop((tenant_id, key), None)
        return
    if len(_seen) >= MAX_ENTRIES:
        _seen.clear()
    _seen[(tenant_id, key)] = (memory.version, memory.subject)


def clear() -> None:
    """Forget everything (tests)."""
    _seen.clear()
