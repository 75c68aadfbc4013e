"""Database connections across ``fork()``.

django-q2's cluster forks its workers, monitor and pusher from the sentinel process, which
has used the database by then. With a psycopg_pool pool (PostgreSQL, settings.py) every
child inherited the pool *with its open sockets*: all processes of a cluster talked over
the same few connections at once, and a process read another's replies (seen as
"ProgrammingError: the last operation didn't produce records (command status: BEGIN)" in
the pusher, tests/test_qcluster.py). psycopg_pool has no fork detection, so a child must
drop what it inherited and open its own pool on first use.
"""

import os

# Inherited pools and connections stay referenced in the child, never used, closed (that
# would end the parent's sessions) or garbage-collected there. Only the child's copies of
# their socket descriptors are closed, which leaves the parent's sessions as they are.
_inherited: list = []


def forget_inherited_connections() -> None:
    """``os.register_at_fork(after_in_child=...)`` hook (registered by settings.py)."""
    from django.db import connections
    from django.db.backends.postgresql.base import DatabaseWrapper

    pools = list(DatabaseWrapper._connection_pools.values())
    DatabaseWrapper._connection_pools.clear()  # the next connect() opens a pool of this process
    _inherited.extend(pools)
    inherited = [conn for pool in pools for conn in getattr(pool, "_pool", ())]  # the idle ones
    for wrapper in connections.all(initialized_only=True):
        if wrapper.connection is not None:
            inherited.append(wrapper.connection)
            wrapper.connection = None
    _inherited.extend(inherited)
    for conn in inherited:
        try:
            os.close(conn.pgconn.socket)
        except Exception:  # a broken or already closed connection: nothing to close
            pass
