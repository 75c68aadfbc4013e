"""Sorting the admin's memory list: by key, last update and expiry, both ways — each a range of
a tenant-led index read a page at a time, for a staff member of one tenant or of several."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from memories import services
from memories.admin.memories import MemoryAdmin
from memories.models import Memory
from tests.factories import SYSTEM, write
from tests.helpers import copy_memory

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role

# Column numbers of the list's headers (column 0 is the actions' checkbox).
KEY, UPDATED, EXPIRES = (1 + MemoryAdmin.list_display.index(c) for c in ("key", "updated_at", "expires_at"))


def _keys(client, query: str) -> list[str]:
    response = client.get(f"/admin/memories/memory/?{query}")
    assert response.status_code == 200, (query, response.status_code)
    return [m.key for m in response.context["cl"].result_list]


def test_support_sorts_the_memory_list_by_last_update_and_by_expiry_both_ways(tenant_a, staff_clients):
    now = timezone.now()
    for key, updated_hours_ago, expires_in_hours in (
        ("user:u1:a", 3, 5),
        ("user:u1:b", 1, None),  # never expires
        ("user:u1:c", 2, 1),
    ):
        memory = write(tenant_a, key, "v")
        Memory.objects.filter(pk=memory.pk).update(
            updated_at=now - timedelta(hours=updated_hours_ago),
            expires_at=None if expires_in_hours is None else now + timedelta(hours=expires_in_hours),
        )
    _user, client = staff_clients["support"]
    assert _keys(client, f"o={UPDATED}") == ["user:u1:a", "user:u1:c", "user:u1:b"]
    assert _keys(client, f"o=-{UPDATED}") == ["user:u1:b", "user:u1:c", "user:u1:a"]
    # Soonest first, never-expiring last; the other way, never-expiring first.
    assert _keys(client, f"o={EXPIRES}") == ["user:u1:c", "user:u1:a", "user:u1:b"]
    assert _keys(client, f"o=-{EXPIRES}") == ["user:u1:b", "user:u1:a", "user:u1:c"]
    assert _keys(client, f"o=-{KEY}") == ["user:u1:c", "user:u1:b", "user:u1:a"]
    header = client.get("/admin/memories/memory/").content.decode()
    assert f"?o={UPDATED}" in header and f"?o={EXPIRES}" in header  # the headers link the sorts


def test_a_member_of_two_tenants_sees_each_tenants_rows_together_in_the_order_chosen(tenant_a, tenant_b, staff_clients):
    write(tenant_a, "user:u1:b", "v")
    write(tenant_b, "user:u1:a", "v")
    write(tenant_a, "user:u1:a", "v")
    user, client = staff_clients["support"]
    services.membership_set(tenant=tenant_b, actor=SYSTEM, username=user.username, role="support")
    rows = client.get("/admin/memories/memory/").context["cl"].result_list
    assert [(m.tenant_id, m.key) for m in rows] == [
        (tenant_a.pk, "user:u1:a"),
        (tenant_a.pk, "user:u1:b"),
        (tenant_b.pk, "user:u1:a"),
    ]


def _page_plans(queries) -> list[str]:
    """EXPLAIN ANALYZE of the list's page query (the one with ORDER BY and LIMIT)."""
    plans = []
    for sql in [q["sql"] for q in queries if 'FROM "memories_memory"' in q["sql"] and "ORDER BY" in q["sql"]]:
        if sql.startswith("SELECT COUNT(*)"):
            continue  # the capped count reads up to 10,000 rows by design
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL max_parallel_workers_per_gather = 0")
            cursor.execute("EXPLAIN (ANALYZE, COSTS) " + sql)
            plans.append("\n".join(line for (line,) in cursor.fetchall()))
    return plans


@pytest.mark.postgres
@pytest.mark.parametrize("scope", ["one tenant", "two tenants", "two tenants, one chosen"])
@pytest.mark.parametrize("order", [KEY, -KEY, UPDATED, -UPDATED, EXPIRES, -EXPIRES])
def test_every_sort_of_the_memory_list_reads_a_page_of_a_tenant_led_index(
    transactional_db, tenant_a, tenant_b, staff_clients, scope, order
):
    """Sorting any other way sorted every memory in scope on each page; and a member of several
    tenants (or a superuser) had every sort, the key's too, sort all their tenants' memories
    (73 ms at 200k memories, linear in them). Each sort reads at most about a page of rows.
    (transactional_db: the rows are truncated afterwards, not left as dead rows that would
    tilt later tests' plans.)"""
    copy_memory(write(tenant_a, "cache:c:x", "a's", ttl_seconds=60), 8000, expires_step="1 second")
    copy_memory(write(tenant_a, "fact:f:x", "a's"), 8000)  # never expire: one run of equal expiries
    copy_memory(write(tenant_b, "fact:f:x", "b's"), 8000)
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key="fact:f:x")  # one in the trash
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE memories_memory")
    user, client = staff_clients["support"]
    if scope != "one tenant":
        services.membership_set(tenant=tenant_b, actor=SYSTEM, username=user.username, role="support")
    chosen = f"&tenant={tenant_a.pk}" if scope.endswith("chosen") else ""

    with CaptureQueriesContext(connection) as queries:
        response = client.get(f"/admin/memories/memory/?o={order}{chosen}")
    assert response.status_code == 200
    assert len(response.context["cl"].result_list) == MemoryAdmin.list_per_page
    plans = _page_plans(queries)
    assert plans
    for plan in plans:
        assert "Seq Scan" not in plan and "Bitmap" not in plan, plan
        read = [int(n) for n in re.findall(r"(?m)Index (?:Only )?Scan.*actual time=\S+ rows=(\d+)", plan)]
        assert read and max(read) <= 2 * MemoryAdmin.list_per_page, plan


@pytest.mark.postgres
@pytest.mark.parametrize("query", ["prefix=log:", "prefix=user:u1", "prefix=log:&o=-7"])
def test_the_capped_count_of_a_filtered_list_reads_the_tenants_index_not_every_tenants_rows(
    transactional_db, tenant_a, tenant_b, staff_clients, query
):
    """The list counts at most 10,000 rows (CheapPaginator): a LIMIT the planner, misjudging
    how many of this tenant's rows match a prefix other tenants hold plenty of, answered with
    a scan of the whole table, every tenant's memories (83-158 ms at 500k memories) — the
    count with the list's order reads a range of the tenant's index instead. (transactional_db:
    the rows are truncated afterwards, not left as dead rows that would tilt later tests' plans.)"""
    copy_memory(write(tenant_a, "user:u1:k", "a's"), 60000)
    copy_memory(write(tenant_b, "log:l1:e", "b's"), 80000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE memories_memory")
    _user, client = staff_clients["support"]
    with CaptureQueriesContext(connection) as queries:
        assert client.get(f"/admin/memories/memory/?{query}").status_code == 200
    counts = [q["sql"] for q in queries if q["sql"].startswith("SELECT COUNT(*)") and "memories_memory" in q["sql"]]
    assert counts
    for sql in counts:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL max_parallel_workers_per_gather = 0")
            cursor.execute("EXPLAIN (ANALYZE, COSTS) " + sql)
            plan = "\n".join(line for (line,) in cursor.fetchall())
        assert "Seq Scan" not in plan, plan


@pytest.mark.postgres
@pytest.mark.parametrize("scope", ["one tenant", "two tenants"])
@pytest.mark.parametrize("order", [KEY, -KEY, UPDATED, -UPDATED, EXPIRES, -EXPIRES])
def test_every_sort_of_the_trash_reads_a_page_of_a_tenant_led_index_of_the_trash(
    transactional_db, tenant_a, tenant_b, staff_clients, scope, order
):
    """The trash (state=trash) sorted every trashed memory in scope on each page, and its
    capped count sorted up to 10,000 of them (245 ms a page at 200k trashed memories): the
    live memories' key index holds no trashed ones, and the (tenant, updated_at / expires_at,
    id) indexes walk past every live memory to reach them. Each sort reads about a page of a
    partial index of the trash. (transactional_db: see above.)"""
    copy_memory(write(tenant_a, "fact:f:x", "a's"), 8000)
    copy_memory(write(tenant_b, "fact:f:x", "b's"), 8000)
    for tenant in (tenant_a, tenant_b):
        trashed = write(tenant, "cache:c:x", "old", ttl_seconds=60)
        services.memory_delete(tenant=tenant, actor=SYSTEM, key="cache:c:x")
        copy_memory(Memory.objects.get(pk=trashed.pk), 3000, expires_step="1 second")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE memories_memory")
    user, client = staff_clients["support"]
    if scope != "one tenant":
        services.membership_set(tenant=tenant_b, actor=SYSTEM, username=user.username, role="support")

    with CaptureQueriesContext(connection) as queries:
        response = client.get(f"/admin/memories/memory/?state=trash&o={order}")
    assert response.status_code == 200
    rows = response.context["cl"].result_list
    assert len(rows) == MemoryAdmin.list_per_page and all(m.deleted_at is not None for m in rows)
    plans = _page_plans(queries)
    assert plans
    for plan in plans:
        assert "Seq Scan" not in plan and "Bitmap" not in plan and "Sort" not in plan, plan
        read = [int(n) for n in re.findall(r"(?m)Index (?:Only )?Scan.*actual time=\S+ rows=(\d+)", plan)]
        assert read and max(read) <= 2 * MemoryAdmin.list_per_page, plan
