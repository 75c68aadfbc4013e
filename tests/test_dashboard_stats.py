"""The dashboard's memory figures (memories/services/dashboard_stats.py): stored per tenant by
the dashboard-stats schedule, recomputed only for tenants with activity since, and shown
with their time."""

import importlib
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from memories import services
from memories.models import TenantDashboardStats
from memories.selectors import dashboard as dashboard_selectors
from memories.selectors.dashboard import tenant_dashboard
from memories.services import dashboard_stats
from tests.factories import SYSTEM, logged_in, make_staff, make_tenant, write
from tests.helpers import copy_memory


def test_page_uses_stored_figures_and_the_schedule_recounts_active_tenants_only(db, settings):
    settings.ZEROMEM_DASHBOARD_STATS_MINUTES = 10
    a, b, idle = make_tenant("stats-a"), make_tenant("stats-b"), make_tenant("stats-idle")
    write(a, "user:u1:lang", "en")
    write(a, "user:u2:lang", "fr")
    write(b, "task:t1:x", "b's")
    t0 = timezone.now()
    # Never counted: every tenant with memories is due; the one without none.
    assert dashboard_stats.dashboard_stats_refresh_stale(now=t0) == {"stats-a": 2, "stats-b": 1}
    assert not TenantDashboardStats.objects.filter(tenant=idle).exists()

    write(a, "user:u3:lang", "de")
    figures = tenant_dashboard(tenant=a)
    assert figures.memory_count == 2 and figures.memory_figures_at == t0  # as of the last count
    assert figures.by_namespace == [("user:u1", 1), ("user:u2", 1)]
    assert tenant_dashboard(tenant=b).by_category == [("task", 1)]  # its own figures only

    # Within the interval nothing is recounted; after it, only the tenant with activity.
    assert dashboard_stats.dashboard_stats_refresh_stale(now=t0 + timedelta(minutes=5)) == {}
    later = timezone.now() + timedelta(minutes=11)
    assert dashboard_stats.dashboard_stats_refresh_stale(now=later) == {"stats-a": 3}
    assert tenant_dashboard(tenant=a).memory_count == 3

    client = logged_in(make_staff(a, "viewer"))
    body = client.get(f"/admin/memories/tenant/{a.pk}/dashboard/").content.decode()
    assert f"as of {later:%Y-%m-%d %H:%M} UTC" in body and "(3 live," in body


def test_a_tenant_without_stored_figures_is_counted_on_the_spot(db):
    tenant = make_tenant("stats-new")
    write(tenant, "user:u1:lang", "en")
    figures = tenant_dashboard(tenant=tenant)
    assert figures.memory_count == 1 and figures.memory_figures_at is None


def test_a_completed_forget_request_recounts_the_stored_figures_that_may_name_the_subject(
    db, settings, django_capture_on_commit_callbacks
):
    settings.ZEROMEM_DASHBOARD_CHARS_EXACT_MEMORIES = 50000  # a small tenant: its sizes summed again too
    tenant = make_tenant("stats-forget")
    write(tenant, "user:u7:lang", "en", subject="u7")
    write(tenant, "user:u8:lang", "fr", subject="u8")
    dashboard_stats.dashboard_stats_refresh(tenant=tenant)
    assert ["user:u7", 1] in TenantDashboardStats.objects.get(tenant=tenant).figures["by_namespace"]
    with django_capture_on_commit_callbacks(execute=True):  # the job runs (tasks run inline)
        request = services.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u7", reason="erasure")
    request.refresh_from_db()
    assert request.status == "completed"
    stats = TenantDashboardStats.objects.get(tenant=tenant)  # recounted at once, sizes summed too
    assert stats.figures["by_namespace"] == [["user:u8", 1]]
    assert stats.figures == _fresh_recount(tenant, stats.computed_at)
    assert tenant_dashboard(tenant=tenant).by_namespace == [("user:u8", 1)]


def test_after_a_forget_the_page_reads_recounted_figures_and_keeps_a_large_tenants_sizes_as_of_before(
    db, settings, django_capture_on_commit_callbacks
):
    """Completing a forget request used to drop the stored figures, so the next page view
    recounted everything on the spot, the sum of every live value's size included (a read of
    every live row: 2.3 s at 1M memories for the staff member opening the page). The counts,
    which may name the subject's namespaces, are recounted at once (index-only); a large
    tenant's sizes are kept as of their last sum and summed again at the next recount."""
    settings.ZEROMEM_DASHBOARD_STATS_MINUTES = 10
    settings.ZEROMEM_DASHBOARD_CHARS_HOURS = 6
    settings.ZEROMEM_DASHBOARD_CHARS_EXACT_MEMORIES = 2  # "large": more than 2 live memories
    tenant = make_tenant("forget-big")
    for user in ("u1", "u2", "u42"):
        write(tenant, f"user:{user}:bio", "x" * 98, subject=user)  # 100 JSON characters each
    write(tenant, "user:u1:tz", "y" * 98, subject="u1")
    t0 = timezone.now() - timedelta(hours=1)
    dashboard_stats.dashboard_stats_refresh(tenant=tenant, now=t0)
    with django_capture_on_commit_callbacks(execute=True):  # the forget job runs inline
        request = services.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u42", reason="erasure")
    request.refresh_from_db()
    assert request.status == "completed"

    with CaptureQueriesContext(connection) as queries:
        figures = tenant_dashboard(tenant=tenant)
    assert [q["sql"] for q in queries if "LENGTH(" in q["sql"].upper()] == []  # no read of every live row
    assert figures.by_namespace == [("user:u1", 2), ("user:u2", 1)]  # user:u42 gone at once
    assert figures.memory_count == 3 and figures.memory_figures_at > t0
    assert figures.chars_at == t0  # the sizes: as of their last sum, before the forget
    client = logged_in(make_staff(tenant, "viewer"))
    body = client.get(f"/admin/memories/tenant/{tenant.pk}/dashboard/").content.decode()
    assert "Memory sizes (JSON characters) as of" in body and "user:u42" not in body

    # The next recount sums the sizes again, though the last sum is younger than 6 hours.
    later = timezone.now() + timedelta(minutes=11)
    assert dashboard_stats.dashboard_stats_refresh_stale(now=later) == {"forget-big": 3}
    stored = TenantDashboardStats.objects.get(tenant=tenant).figures
    assert stored == _fresh_recount(tenant, later)
    assert stored["chars"] == 300 and stored["chars_memories"] == 3


@pytest.mark.postgres
def test_expiring_soon_reads_the_tenants_own_range_of_expiring_memories(transactional_db):
    """Another tenant's many short-lived memories (expiring before this tenant's) must not be
    walked past for this tenant's first 10, nor the whole tenant scanned for the count — even
    when the tenant has many memories without a TTL, which made the planner overestimate the
    count and scan all the tenant's rows (a parallel bitmap scan) or the tenant-less
    memory_expiring. (transactional_db: the rows are truncated afterwards, not left as dead
    rows that would tilt later tests' query plans, as a rollback would.)"""
    a, b = make_tenant("exp-a"), make_tenant("exp-b")
    for i in range(12):
        write(a, f"user:u{i}:lang", "en", ttl_seconds=20 * 3600 + i)
    write(a, "user:u1:forever", "x")
    write(a, "user:u1:later", "x", ttl_seconds=25 * 3600)  # not within 24 h
    write(a, "user:u1:binned", "x", ttl_seconds=3600)
    services.memory_delete(tenant=a, actor=SYSTEM, key="user:u1:binned")  # in the trash: not live
    copy_memory(write(a, "fact:f:x", "a's"), 30000)  # no TTL
    copy_memory(write(b, "cache:c:x", "b's", ttl_seconds=60), 60000, expires_step="1 second")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE memories_memory")

    with CaptureQueriesContext(connection) as queries:
        figures = tenant_dashboard(tenant=a)

    assert figures.expiring_count == 12
    assert [key for _, key, _ in figures.expiring] == [f"user:u{i}:lang" for i in range(10)]
    assert tenant_dashboard(tenant=b).expiring_count == 60001
    expiring = [q["sql"] for q in queries if "(tenant_id, expires_at) <=" in q["sql"]]
    assert len(expiring) == 2  # the count and the first 10
    for sql in expiring:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL max_parallel_workers_per_gather = 0")  # as the selector
            cursor.execute("EXPLAIN " + sql)
            explained = "\n".join(line for (line,) in cursor.fetchall())
        assert "memory_tenant_expiring" in explained, explained
        assert "memory_tenant_category" not in explained and "Seq Scan" not in explained, explained


def test_expiring_soon_on_sqlite_counts_the_same(db):
    """SQLite (the embedded default) keeps the ORM's query; the same figures."""
    a, b = make_tenant("exp-sa"), make_tenant("exp-sb")
    for i in range(3):
        write(a, f"user:u{i}:lang", "en", ttl_seconds=3600 + i)
    write(a, "user:u1:later", "x", ttl_seconds=25 * 3600)
    write(b, "user:u1:lang", "en", ttl_seconds=60)
    figures = tenant_dashboard(tenant=a)
    assert figures.expiring_count == 3
    assert [key for _, key, _ in figures.expiring] == ["user:u0:lang", "user:u1:lang", "user:u2:lang"]


def _index_valid(name):
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = %s", [name]
        )
        row = cursor.fetchone()
    return row[0] if row else None


@pytest.mark.postgres
def test_rerunning_the_tenant_expiring_migration_rebuilds_an_index_an_interrupted_run_left_invalid(
    transactional_db,
):
    """CREATE INDEX CONCURRENTLY interrupted (a lock or statement timeout, a killed deploy)
    leaves the index INVALID: the planner never uses it, every write still maintains it. The
    migration run again must build it, not skip it as existing (IF NOT EXISTS)."""
    migration = importlib.import_module("memories.migrations.0021_memory_tenant_expiring")
    with connection.cursor() as cursor:  # as an interrupted build leaves it
        cursor.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'memory_tenant_expiring'::regclass")
    assert _index_valid("memory_tenant_expiring") is False
    try:
        with connection.schema_editor(atomic=False) as editor:
            migration.forward(None, editor)
        assert _index_valid("memory_tenant_expiring") is True
    finally:
        with connection.cursor() as cursor:
            cursor.execute("REINDEX INDEX memory_tenant_expiring")  # valid again for the next tests


def _fresh_recount(tenant, now):
    """What the page showed before the stored figures: every live row read (the ORM's scan)."""
    figures = dashboard_selectors._counts_orm(tenant=tenant, now=now)
    figures.update(dashboard_selectors.memory_chars(tenant=tenant, now=now))
    return figures


def test_stored_figures_equal_a_fresh_full_recount_after_writes_deletes_expiry_and_forget(
    db, settings, django_capture_on_commit_callbacks
):
    settings.ZEROMEM_DASHBOARD_STATS_MINUTES = 10
    tenant, other = make_tenant("recount-a"), make_tenant("recount-b")
    for user in range(4):
        for field in ("lang", "tz", "name"):
            write(tenant, f"user:u{user}:{field}", f"{field} of u{user}", subject=f"u{user}", category="user")
    write(tenant, "task:t1:a", {"steps": [1, 2, 3]}, category="task")
    write(tenant, "task:t1:b", "soon gone", category="task", ttl_seconds=600)
    write(tenant, "fact:f:only", "binned", category="fact")
    write(other, "user:u0:lang", "another tenant's")
    services.memory_delete(tenant=tenant, actor=SYSTEM, key="fact:f:only")  # its namespace and category go
    services.memory_delete(tenant=tenant, actor=SYSTEM, key="user:u3:tz")
    t0 = timezone.now()
    dashboard_stats.dashboard_stats_refresh_stale(now=t0)
    assert TenantDashboardStats.objects.get(tenant=tenant).figures == _fresh_recount(tenant, t0)

    later = t0 + timedelta(minutes=11)  # task:t1:b has expired, nothing else happened
    assert dashboard_stats.dashboard_stats_refresh_stale(now=later) == {"recount-a": 12}
    stored = TenantDashboardStats.objects.get(tenant=tenant).figures
    assert stored == _fresh_recount(tenant, later)
    assert stored["by_category"] == [["user", 11], ["task", 1]]  # no "fact": its only memory is in the trash

    write(tenant, "user:u1:tz", "changed")  # an update: counted once
    write(tenant, "note:n:x", "new namespace", category="note")
    with django_capture_on_commit_callbacks(execute=True):  # the forget job runs inline
        services.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u2", reason="erasure")
    recounted = TenantDashboardStats.objects.get(tenant=tenant).computed_at  # at once: no longer names u2
    assert tenant_dashboard(tenant=tenant, now=later).by_namespace == [
        (ns, n) for ns, n in _fresh_recount(tenant, recounted)["by_namespace"]
    ]
    dashboard_stats.dashboard_stats_refresh_stale(now=later + timedelta(minutes=11))
    stored = TenantDashboardStats.objects.get(tenant=tenant).figures
    assert stored == _fresh_recount(tenant, later + timedelta(minutes=11))
    assert "user:u2" not in [ns for ns, _ in stored["by_namespace"]] and stored["namespaces"] == 5
    assert TenantDashboardStats.objects.get(tenant=other).figures["memory_count"] == 1


def test_a_tenant_whose_memories_expired_since_its_count_is_recounted_without_other_activity(db, settings):
    """A TTL ending writes no audit event: the schedule must still see the tenant as stale."""
    settings.ZEROMEM_DASHBOARD_STATS_MINUTES = 10
    tenant = make_tenant("recount-ttl")
    write(tenant, "cache:c:x", "short-lived", ttl_seconds=1200)
    write(tenant, "user:u1:lang", "en")
    t0 = timezone.now()
    assert dashboard_stats.dashboard_stats_refresh_stale(now=t0) == {"recount-ttl": 2}
    assert dashboard_stats.dashboard_stats_refresh_stale(now=t0 + timedelta(minutes=15)) == {}  # not expired yet
    later = t0 + timedelta(minutes=25)
    assert dashboard_stats.dashboard_stats_refresh_stale(now=later) == {"recount-ttl": 1}
    assert tenant_dashboard(tenant=tenant, now=later).by_namespace == [("user:u1", 1)]


def test_a_large_tenants_sizes_are_summed_every_few_hours_and_the_page_says_as_of_when(db, settings):
    settings.ZEROMEM_DASHBOARD_STATS_MINUTES = 10
    settings.ZEROMEM_DASHBOARD_CHARS_HOURS = 6
    settings.ZEROMEM_DASHBOARD_CHARS_EXACT_MEMORIES = 2  # "large": more than 2 live memories
    tenant = make_tenant("recount-big")
    for i in range(3):
        write(tenant, f"user:u{i}:bio", "x" * 98)  # 100 JSON characters each
    t0 = timezone.now()

    def refresh(now):
        with CaptureQueriesContext(connection) as queries:
            dashboard_stats.dashboard_stats_refresh(tenant=tenant, now=now)
        return [q["sql"] for q in queries if "LENGTH(" in q["sql"].upper()]

    assert len(refresh(t0)) == 1  # the first count sums the sizes
    write(tenant, "user:u9:bio", "y" * 398)
    t1 = t0 + timedelta(hours=1)
    assert refresh(t1) == []  # counts only: no statement reads the values
    figures = tenant_dashboard(tenant=tenant, now=t1)
    assert figures.memory_count == 4 and figures.memory_figures_at == t1 and figures.chars_at == t0
    # The token estimate applies the average memory of the last sum (100 characters) to today's count.
    assert figures.tokens["memory_tokens"] == 25 and figures.tokens["namespace_tokens"] == 25
    client = logged_in(make_staff(tenant, "viewer"))
    body = client.get(f"/admin/memories/tenant/{tenant.pk}/dashboard/").content.decode()
    assert "Memory sizes (JSON characters) as of" in body  # counted at now, summed at t0
    assert len(refresh(t0 + timedelta(hours=6))) == 1  # due again
    stored = TenantDashboardStats.objects.get(tenant=tenant).figures
    assert stored["chars"] == 700 and stored["chars_memories"] == 4

    settings.ZEROMEM_DASHBOARD_CHARS_EXACT_MEMORIES = 50000  # a small tenant: summed with every count
    assert len(refresh(t0 + timedelta(hours=7))) == 1
    body = client.get(f"/admin/memories/tenant/{tenant.pk}/dashboard/").content.decode()
    assert "Memory sizes (JSON characters) as of" not in body


def _plan_nodes(node):
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


@pytest.mark.postgres
def test_the_count_reads_the_tenants_memories_from_indexes_and_only_the_expired_ones_from_the_heap(transactional_db):
    """The recount must not read every live row of the tenant (the heap: the page's old
    aggregates, a sequential or bitmap heap scan, 2.6 s at 200k memories): every row comes
    from an index-only scan (the trashed ones too, memory_trash_figures), but the expired
    ones not purged yet, read for their namespace and category. (transactional_db: VACUUM,
    which sets the visibility map an index-only scan needs, cannot run in a transaction;
    autovacuum does it in production.)"""
    tenant, other = make_tenant("plan-a"), make_tenant("plan-b")
    copy_memory(write(tenant, "user:u1:lang", "en", category="user"), 20000)
    copy_memory(write(tenant, "task:t1:x", "x", category="task"), 10000)
    copy_memory(write(other, "user:u1:lang", "other's"), 20000)
    for i in range(30):
        write(tenant, f"fact:f{i}:x", "binned", category="fact")
        services.memory_delete(tenant=tenant, actor=SYSTEM, key=f"fact:f{i}:x")
    for i in range(20):
        write(tenant, f"cache:c{i}:x", "short", category="note", ttl_seconds=60)
    now = timezone.now() + timedelta(minutes=5)  # the 20 have expired
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE memories_memory")
        cursor.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + dashboard_selectors._COUNTS_SQL, {"tenant": tenant.pk, "now": now}
        )
        plan = cursor.fetchone()[0][0]["Plan"]

    scans = [n for n in _plan_nodes(plan) if n.get("Relation Name") == "memories_memory"]
    from_heap = [n for n in scans if n["Node Type"] != "Index Only Scan"]
    assert {n.get("Index Name") for n in from_heap} <= {"memory_tenant_expires", "memory_tenant_expiring"}, from_heap
    assert sum(n["Actual Rows"] * n["Actual Loops"] for n in from_heap) == 20  # the expired rows alone
    index_only = {n["Index Name"]: n for n in scans if n["Node Type"] == "Index Only Scan"}
    assert set(index_only) == {"memory_tenant_category", "memory_tenant_namespace", "memory_trash_figures"}
    expected = {"memory_tenant_category": 30052, "memory_tenant_namespace": 30052, "memory_trash_figures": 30}
    for name, scan in index_only.items():  # at most the latest writes' pages from the heap
        rows = scan["Actual Rows"] * scan["Actual Loops"]  # per loop, rounded, in a parallel plan
        assert abs(rows - expected[name]) <= scan["Actual Loops"] and scan["Heap Fetches"] <= 100, scan

    figures = dashboard_selectors.memory_figures(tenant=tenant, now=now)
    assert figures == _fresh_recount(tenant, now)
    assert figures["memory_count"] == 30002 and figures["by_category"] == [["user", 20001], ["task", 10001]]
