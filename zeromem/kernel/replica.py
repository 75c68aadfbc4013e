"""Read scaling: the reads that may go to a PostgreSQL replica, and the rule that keeps a read
that must see a write on the primary (README "Running as a fleet").

With ``DATABASE_REPLICA_URL`` set, settings.py adds the database alias ``replica`` and this
router. A read goes to the replica only when **both** hold:

* it runs inside :func:`replica_reads` — entered only by code whose reads are allowed to be a
  little behind (replication lag, usually well under a second): the audit log's review page
  and API list, its exports, the tenant dashboard;
* nothing has been written through the ORM since that context was entered (the read-after-
  write rule): the first write inside it pins the rest of the context to the primary, so a
  read never misses the request's own write. Code that must read what it has just written
  simply does not enter the context; every other read (tool calls, REST, search, the
  services' own checks, anything inside a transaction that writes) goes to the primary.

Without a replica every read goes to ``default`` and :func:`replica_reads` changes nothing.
Writes and migrations always go to ``default``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.db import connections

REPLICA = "replica"
PRIMARY = "default"


@dataclass
class _Reads:
    wrote: bool = False


_reads: contextvars.ContextVar[_Reads | None] = contextvars.ContextVar("zeromem_replica_reads", default=None)


def replica_configured() -> bool:
    return REPLICA in connections.settings


@contextmanager
def replica_reads() -> Iterator[None]:
    """Reads inside may be served by the replica (until the first write inside)."""
    token = _reads.set(_Reads())
    try:
        yield
    finally:
        _reads.reset(token)


def reads_go_to() -> str:
    """The alias an ORM read made here would use."""
    state = _reads.get()
    if state is None or state.wrote or not replica_configured():
        return PRIMARY
    return REPLICA


class ReplicaRouter:
    """``DATABASE_ROUTERS`` entry (settings.py)."""

    def db_for_read(self, model, **hints):
        return reads_go_to()

    def db_for_write(self, model, **hints):
        state = _reads.get()
        if state is not None:
            state.wrote = True
        return PRIMARY

    def allow_relation(self, obj1, obj2, **hints):
        return True  # the replica holds the same rows as the primary

    def allow_migrate(self, db, app_label, model_name=None, **hints):
        return db == PRIMARY
