"""Starts with this key prefix", case-sensitively on every database.

Keys are case-sensitive (``user:u1:x`` and ``USER:U1:x`` are two memories), and an API key's
allowlist is checked in Python on the exact string. ``field__startswith`` is a ``LIKE``: on
PostgreSQL case-sensitive (and, with the key column's "C" collation, a btree range), but on
SQLite it ignores the case of ASCII letters, so there a key limited to ``user:u1:`` listed,
searched and reviewed the audit events of ``USER:U1:…`` as well, and a forget of a prefix
erased its case variants. On SQLite the ``LIKE`` (still served by the index) is joined by an
exact comparison of the first characters.

A filter may also name one key exactly: :func:`exact` (the key and ``$``, which no key or
prefix holds), what a bare allowlist entry ``user:u1`` adds for the key ``user:u1`` itself
(:meth:`zeromem.kernel.actors.Actor.prefix_filters`). It is a string like the prefixes, so it
travels wherever they do (the search tier's JSON); every filter below understands it.
"""

from __future__ import annotations

from django.db import connection
from django.db.models import CharField, Q, Value
from django.db.models.functions import Substr
from django.db.models.lookups import Exact

EXACT = "$"  # not in validation.KEY_RE nor PREFIX_RE


def exact(key: str) -> str:
    """The filter naming exactly ``key`` (not the keys under it, nor ``key`` + more letters)."""
    return key + EXACT


def matches(key: str, prefix: str) -> bool:
    """Whether ``key`` passes the filter ``prefix`` (a prefix, or :func:`exact`), in Python."""
    return key == prefix[:-1] if prefix.endswith(EXACT) else key.startswith(prefix)


def _exact_like() -> bool:
    return connection.vendor == "postgresql"


def startswith_q(field: str, prefix: str) -> Q:
    """Rows whose ``field`` starts with ``prefix`` (not ``""``), case-sensitively; or for
    an :func:`exact` filter, is that key (``=``, case-sensitive on both databases)."""
    if prefix.endswith(EXACT):
        return Q(**{field: prefix[:-1]})
    q = Q(**{f"{field}__startswith": prefix})
    if not _exact_like():
        q &= Q(Exact(Substr(field, 1, len(prefix)), Value(prefix, output_field=CharField())))
    return q


def startswith_sql(column: str, prefix: str) -> tuple[str, list]:
    """The same as SQL on ``column``: (a condition, its parameters)."""
    if prefix.endswith(EXACT):
        return f"{column} = %s", [prefix[:-1]]
    like = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    if _exact_like():
        return f"{column} LIKE %s ESCAPE '\\'", [like]
    return f"({column} LIKE %s ESCAPE '\\' AND substr({column}, 1, %s) = %s)", [like, len(prefix), prefix]
