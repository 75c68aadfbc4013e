"""The memory list's key tree (memories/admin/memory_filters.py, KeyTreeFilter): the namespaces
one segment below the chosen prefix, found by a few index probes per tenant, not by reading
every memory in scope on each page of the list."""

from __future__ import annotations

import re

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from memories import services
from tests.factories import SYSTEM, write
from tests.helpers import copy_memory

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role


def _children(client, query: str = "") -> list[str]:
    response = client.get(f"/admin/memories/memory/?{query}")
    assert response.status_code == 200, (query, response.status_code)
    (spec,) = [s for s in response.context["cl"].filter_specs if getattr(s, "parameter_name", "") == "prefix"]
    return [value for value, label in spec.lookup_choices if not label.startswith("↑")]  # not the way up


def test_the_key_tree_lists_each_namespace_one_segment_down_once(tenant_a, tenant_b, staff_clients):
    for key in ("log:l0:a", "log:l05:b", "log:l0:x:y", "log:l1:c", "user:u1:p", "top"):
        write(tenant_a, key, "v")
    write(tenant_b, "globex:g1:k", "v")
    user, client = staff_clients["viewer"]
    assert _children(client) == ["log:", "user:"]
    assert _children(client, "prefix=log:") == [
        "log:",
        "log:l0:",
        "log:l05:",
        "log:l1:",
    ]  # ● the prefix, then its children
    assert _children(client, "prefix=log:l0:") == ["log:l0:", "log:l0:x:"]
    services.membership_set(tenant=tenant_b, actor=SYSTEM, username=user.username, role="viewer")
    assert _children(client) == ["globex:", "log:", "user:"]  # both tenants' namespaces
    assert _children(client, f"tenant={tenant_b.pk}") == ["globex:"]  # the chosen tenant's only


@pytest.mark.postgres
@pytest.mark.parametrize("query", ["", "prefix=log:", "prefix=log:l1:"])
def test_the_key_tree_reads_a_few_index_entries_per_namespace_not_every_memory(
    transactional_db, tenant_a, staff_clients, query
):
    """A tenant's memories in a few large namespaces (a log, a session's steps): the DISTINCT
    over the namespaces read every memory in scope on each page of the list (85-110 ms at
    300k memories in 3 namespaces, linear in the memories). (transactional_db: the rows are
    truncated afterwards, not left as dead rows that would tilt later tests' plans.)"""
    for n in range(3):
        copy_memory(write(tenant_a, f"log:l{n}:e", "x"), 6000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE memories_memory")
    _user, client = staff_clients["support"]
    with CaptureQueriesContext(connection) as queries:
        assert client.get(f"/admin/memories/memory/?{query}").status_code == 200
    tree = [q["sql"] for q in queries if '"memories_memory"."namespace"' in q["sql"] and "ORDER BY" in q["sql"]]
    tree = [sql for sql in tree if 'SELECT "memories_memory"."id"' not in sql]  # not the page itself
    assert tree
    for sql in tree:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL max_parallel_workers_per_gather = 0")
            cursor.execute("EXPLAIN (ANALYZE, COSTS) " + sql)
            plan = "\n".join(line for (line,) in cursor.fetchall())
        read = [int(n) for n in re.findall(r"(?m)(?:Scan|Unique).*actual time=\S+ rows=(\d+)", plan)]
        assert "Seq Scan" not in plan and read and max(read) <= 5, plan
