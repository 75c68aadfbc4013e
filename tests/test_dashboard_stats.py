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


def test_a_completed_forget_request_drops_the_stored_figures_that_may_name_the_subject(
    db, django_capture_on_commit_callbacks
):
    tenant = make_tenant("stats-forget")
    write(tenant, "user:u7:lang", "en", subject="u7")
    write(tenant, "user:u8:lang", "fr", subject="u8")
    dashboard_stats.dashboard_stats_refresh(tenant=tenant)
    assert ["user:u7", 1] in TenantDashboardStats.objects.get(tenant=tenant).figures["by_namespace"]
    with django_capture_on_commit_callbacks(execute=True):  # the job runs (tasks run inline)
        request = services.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u7", reason="erasure")
    request.refresh_from_db()
    assert request.status == "completed"
    assert not TenantDashboardStats.objects.filter(tenant=tenant).exists()
    assert tenant_dashboard(tenant=tenant).by_namespace == [("user:u8", 1)]


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
