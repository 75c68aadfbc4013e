"""Keys for PostgreSQL's two-int advisory locks (``pg_advisory_xact_lock(int, int)``)."""

from __future__ import annotations

INT4_MAX = 2**31 - 1


def int4_key(n: int) -> int:
    """``n`` as the second int of a two-int advisory lock: itself when it fits (ids as they
    are: 0 … 2³¹−1), else a value derived from it in −2³¹ … −2, clear of the ids and of −1
    (audit/partitions.py's lock). Row ids are 64-bit (BigAutoField): passed as they are, an id
    past 2³¹−1 failed the statement (there is no ``pg_advisory_xact_lock(integer, bigint)``),
    i.e. every lock taken for that tenant. Two large ids sharing a value only make one wait for the other's lock."""
    if 0 <= n <= INT4_MAX:
        return n
    return -2 - (n % (2**31 - 1))
