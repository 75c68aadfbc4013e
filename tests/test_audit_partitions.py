"""The audit log partitioned by month (PostgreSQL, audit/partitions.py and migration 0010):
events land in their month's partition (or the default one when it has none), whole months
are dropped by the retention purge after a checkpoint and the chain still verifies, and every
partition refuses UPDATE, DELETE and TRUNCATE."""

import threading
import time
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction
from django.db.migrations.loader import MigrationLoader
from django.utils import timezone

from audit import partitions
from audit.models import AuditCheckpoint, AuditEvent, AuditSeal
from audit.services import audit_partitions_drop, audit_purge_all, audit_record, audit_seal
from audit.verify import audit_verify
from tests.factories import make_tenant
from tests.helpers import start_thread, wait_for_a_lock_waiter
from zeromem.kernel.actors import Actor

pytestmark = pytest.mark.postgres

AGENT = Actor(kind="api_key", id="7", label="zm_agent", scopes=frozenset(["memory:read"]), surface="tool")
SOURCE = Actor(kind="anonymous", surface="rest", client_ip="203.0.113.9")
JAN = datetime(2031, 1, 1, tzinfo=UTC)


def at(monkeypatch, when: datetime) -> None:
    monkeypatch.setattr(timezone, "now", lambda: when)


def record(monkeypatch, tenant, when: datetime, n: int = 1, actor=AGENT) -> list[int]:
    at(monkeypatch, when)
    return [audit_record(tenant=tenant, actor=actor, action="memory.read", outcome="ok") for _ in range(n)]


def homes(ids) -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT DISTINCT tableoid::regclass::text FROM audit_auditevent WHERE id = ANY(%s)", [ids])
        return {name for (name,) in cursor.fetchall()}


def exists(table: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [table])
        return cursor.fetchone()[0]


def test_the_migration_partitions_the_event_table_with_months_ahead_and_a_default(db):
    names = [p.name for p in partitions.partitions()]
    month = partitions.month_start(datetime.now(UTC))
    turned = datetime.now(UTC) - month < timedelta(hours=3)  # maybe since the test database was made
    if turned and partitions.partition_name(partitions.add_months(month, partitions.MONTHS_AHEAD)) not in names:
        month = partitions.add_months(month, -1)
    for n in range(partitions.MONTHS_AHEAD + 1):
        assert partitions.partition_name(partitions.add_months(month, n)) in names
    assert names[-1] == partitions.DEFAULT
    # Nothing to do on a second run (in the month the migration ran in).
    assert partitions.ensure_partitions(now=month) == {"created": [], "blocked": [], "busy": []}


def test_appends_across_a_month_boundary_land_in_two_partitions_and_verify(db, monkeypatch):
    tenant = make_tenant("part-boundary")
    audit_seal(tenant_id=tenant.pk)  # its creation event: seal 1
    created = partitions.ensure_partitions(now=JAN)["created"]
    assert created == ["audit_auditevent_p2031_01", "audit_auditevent_p2031_02", "audit_auditevent_p2031_03"]
    before = record(monkeypatch, tenant, datetime(2031, 1, 31, 23, 59, 59, 900000, tzinfo=UTC), n=3)
    after = record(monkeypatch, tenant, datetime(2031, 2, 1, 0, 0, 0, 100000, tzinfo=UTC), n=2)
    assert homes(before) == {"audit_auditevent_p2031_01"}
    assert homes(after) == {"audit_auditevent_p2031_02"}
    assert audit_seal(tenant_id=tenant.pk) == 5  # one seal across the boundary
    seal = AuditSeal.objects.get(tenant=tenant, seq=2)
    assert (seal.first_event_id, seal.last_event_id) == (before[0], after[-1])
    result = audit_verify(tenant_id=tenant.pk)
    assert result.ok, result.problems
    assert result.events == 6


def test_an_event_of_a_month_without_partition_lands_in_the_default_one(db, monkeypatch):
    tenant = make_tenant("part-default")
    june = datetime(2035, 6, 10, tzinfo=UTC)
    early = record(monkeypatch, tenant, june)
    assert homes(early) == {partitions.DEFAULT}
    # That month can no longer get its own partition; the following ones do.
    outcome = partitions.ensure_partitions(now=june)
    assert outcome == {
        "created": ["audit_auditevent_p2035_07", "audit_auditevent_p2035_08"],
        "blocked": ["audit_auditevent_p2035_06"],
        "busy": [],
    }
    later = record(monkeypatch, tenant, june + timedelta(days=1))
    later += record(monkeypatch, tenant, june + timedelta(days=25))
    assert homes(later) == {partitions.DEFAULT, "audit_auditevent_p2035_07"}
    audit_seal(tenant_id=tenant.pk)
    assert audit_verify(tenant_id=tenant.pk).ok


@pytest.fixture
def months(db, monkeypatch, settings):
    """January to March 2031: tenant A (30 days' retention) with a seal crossing from January
    into February, tenant B (60 days) in January and February, failed authentications that
    matched no tenant (the default retention, 30 days here) in January."""
    settings.ZEROMEM_AUDIT_RETENTION_DAYS = 30
    partitions.ensure_partitions(now=JAN)
    at(monkeypatch, JAN + timedelta(days=1))  # the tenants' own creation events in January too
    a, b = make_tenant("part-a"), make_tenant("part-b")
    a.audit_retention_days, b.audit_retention_days = 30, 60
    a.save(update_fields=["audit_retention_days"])
    b.save(update_fields=["audit_retention_days"])
    ids = {"a_jan": record(monkeypatch, a, datetime(2031, 1, 10, tzinfo=UTC), n=4)}
    audit_seal(tenant_id=a.pk)
    ids["a_jan"] += record(monkeypatch, a, datetime(2031, 1, 31, 23, 59, tzinfo=UTC), n=2)
    ids["a_cross"] = record(monkeypatch, a, datetime(2031, 2, 1, 0, 1, tzinfo=UTC), n=2)
    audit_seal(tenant_id=a.pk)  # seal 2 holds 2 January and 2 February events
    ids["a_mar"] = record(monkeypatch, a, datetime(2031, 3, 20, tzinfo=UTC), n=3)
    ids["b_jan"] = record(monkeypatch, b, datetime(2031, 1, 20, tzinfo=UTC), n=3)
    audit_seal(tenant_id=b.pk)
    ids["b_feb"] = record(monkeypatch, b, datetime(2031, 2, 20, tzinfo=UTC), n=2)
    ids["anon_jan"] = record(monkeypatch, None, datetime(2031, 1, 5, tzinfo=UTC), actor=SOURCE)
    for tenant_id in (a.pk, b.pk, None):
        audit_seal(tenant_id=tenant_id)
    return a, b, ids


def test_a_month_is_dropped_only_when_every_chain_in_it_is_past_retention(months, monkeypatch):
    a, b, ids = months
    # 1 March: B's 60 days still cover January, so the month stays; A's first seal (10 January,
    # past A's 30 days) goes by the row purge instead.
    at(monkeypatch, datetime(2031, 3, 1, tzinfo=UTC))
    audit_purge_all(now=datetime(2031, 3, 1, tzinfo=UTC))
    assert exists("audit_auditevent_p2031_01")
    assert AuditEvent.objects.filter(pk__in=ids["b_jan"]).count() == 3
    assert AuditEvent.objects.filter(pk__in=ids["a_jan"]).count() == 2  # the 31 January ones: seal 2
    assert AuditSeal.objects.get(tenant=a, seq=1).purged_at is not None
    assert audit_verify(tenant_id=a.pk).ok

    # 5 April: January is past every chain's retention (A's crossing seal included); February
    # is not (B keeps 60 days).
    now = datetime(2031, 4, 5, tzinfo=UTC)
    at(monkeypatch, now)
    dropped = audit_partitions_drop(now=now)
    assert "audit_auditevent_p2031_01" in dropped
    assert "audit_auditevent_p2031_02" not in dropped
    assert not exists("audit_auditevent_p2031_01")
    assert exists("audit_auditevent_p2031_02")
    gone = ids["a_jan"] + ids["a_cross"] + ids["b_jan"] + ids["anon_jan"]
    assert not AuditEvent.objects.filter(pk__in=gone).exists()
    # A's February events of the crossing seal went with it; the rest stays.
    assert AuditEvent.objects.filter(pk__in=ids["b_feb"] + ids["a_mar"]).count() == 5

    for tenant_id, through in ((a.pk, 2), (b.pk, 1), (None, 1)):
        checkpoint = AuditCheckpoint.objects.filter(tenant_id=tenant_id, reason="purge").latest("id")
        assert checkpoint.purged_through == through
        result = audit_verify(tenant_id=tenant_id)
        assert result.ok, result.problems
        assert result.purged_seals == through
    purge = AuditEvent.objects.filter(tenant=a, action="audit.purge", detail__has_key="partition").get()
    assert purge.count == AuditSeal.objects.get(tenant=a, seq=2).count == 4
    assert purge.detail == {"through_seal": 2, "partition": "audit_auditevent_p2031_01"}

    # The scheduled purge: nothing more to drop today; B's February stays (60 days), A's March too.
    audit_purge_all(now=now)
    assert AuditEvent.objects.filter(pk__in=ids["b_feb"] + ids["a_mar"]).count() == 5
    for tenant_id in (a.pk, b.pk, None):
        assert audit_verify(tenant_id=tenant_id).ok


def test_a_tampered_chain_is_still_found_after_a_drop(months, monkeypatch):
    a, _b, ids = months
    now = datetime(2031, 4, 5, tzinfo=UTC)
    audit_partitions_drop(now=now)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('zeromem.audit_mode', 'purge', true)")
        cursor.execute("DELETE FROM audit_auditevent_p2031_03 WHERE id = %s", [ids["a_mar"][1]])
    result = audit_verify(tenant_id=a.pk)
    assert not result.ok
    assert "holds 2 events, the seal says 3" in str(result.first_problem)


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE {table} SET target = 'x' WHERE tenant_id = %s",
        "UPDATE {table} SET seal = NULL, chain = '' WHERE tenant_id = %s",
        "DELETE FROM {table} WHERE tenant_id = %s",
        "TRUNCATE {table}",
    ],
)
def test_every_partition_refuses_update_delete_and_truncate(db, monkeypatch, sql):
    tenant = make_tenant("part-guard")
    partitions.ensure_partitions(now=JAN)  # a partition made by the job, not the migration
    ids = record(monkeypatch, tenant, JAN + timedelta(days=3))
    ids += record(monkeypatch, tenant, datetime(2036, 1, 1, tzinfo=UTC))  # the default partition
    audit_seal(tenant_id=tenant.pk)
    tables = ["audit_auditevent_p2031_01", partitions.DEFAULT]
    if sql.startswith("TRUNCATE"):
        tables.append("audit_auditevent_p2031_02")  # empty: no row trigger would fire
    for table in tables:
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL zeromem.audit_mode = ''")  # the suite's own flush sets 'flush'
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # no pending FK checks from the inserts
            cursor.execute(sql.format(table=table), [] if "TRUNCATE" in sql else [tenant.pk])
    assert AuditEvent.objects.filter(pk__in=ids).count() == 2
    assert audit_verify(tenant_id=tenant.pk).ok


def test_the_audit_purge_command_drops_months_past_retention(db, monkeypatch, settings):
    settings.ZEROMEM_AUDIT_RETENTION_DAYS = 30
    old = datetime(2020, 1, 1, tzinfo=UTC)
    partitions.ensure_partitions(now=old)
    at(monkeypatch, old + timedelta(days=2))
    tenant = make_tenant("part-command")
    ids = record(monkeypatch, tenant, old + timedelta(days=3), n=2)
    monkeypatch.undo()  # the real clock again
    out = StringIO()
    call_command("audit_purge", stdout=out)
    assert "dropped audit_auditevent_p2020_01" in out.getvalue()
    assert not AuditEvent.objects.filter(pk__in=ids).exists()
    assert audit_verify(tenant_id=tenant.pk).ok


@pytest.mark.django_db(transaction=True)
def test_creating_partitions_behind_a_long_transaction_never_queues_every_tenants_events():
    """CREATE TABLE … PARTITION OF takes ACCESS EXCLUSIVE on the event table. Waiting for it
    behind one long transaction that touched the log (a tenant's forget batch, an access-count
    fold), it would queue every other tenant's audit INSERT — every request — until that
    transaction ends. It gives up after a short lock_timeout instead; the next run creates it."""
    a, b = make_tenant("part-long"), make_tenant("part-other")
    future = datetime(2041, 1, 1, tzinfo=UTC)
    names = [partitions.partition_name(partitions.add_months(future, n)) for n in range(partitions.MONTHS_AHEAD + 1)]
    holding, release, outcome, failures = threading.Event(), threading.Event(), {}, []

    def long_transaction():
        with transaction.atomic():
            audit_record(tenant=a, actor=AGENT, action="memory.read", outcome="ok")
            holding.set()
            release.wait(30)

    holder = start_thread(long_transaction, failures, done=holding)
    try:
        assert holding.wait(20)
        job = start_thread(lambda: outcome.update(partitions.ensure_partitions(now=future)), failures)
        wait_for_a_lock_waiter("the partition job", alive=job.is_alive)  # it waits for the event table now
        started = time.monotonic()
        audit_record(tenant=b, actor=AGENT, action="memory.read", outcome="ok")  # another tenant's request
        waited = time.monotonic() - started
        job.join(30)
        assert not failures, failures
        assert waited < 3, f"another tenant's audit INSERT waited {waited:.1f} s behind the partition job"
        assert outcome == {"created": [], "blocked": [], "busy": names}
        assert not any(exists(name) for name in names)
    finally:
        release.set()
        holder.join(30)
        with connection.cursor() as cursor:
            for name in names:
                cursor.execute(f"DROP TABLE IF EXISTS {name}")
    assert partitions.ensure_partitions(now=future)["created"] == names  # the next run, nothing in the way
    with connection.cursor() as cursor:
        for name in names:
            cursor.execute(f"DROP TABLE {name}")


@pytest.mark.django_db(transaction=True)
def test_dropping_a_month_behind_a_long_reader_neither_queues_other_readers_nor_stops_the_purge(settings):
    """The drop locks the month's partition ACCESS EXCLUSIVE: behind a long transaction that
    read the log (a backup, a slow review), waiting without limit, every other query of the
    log (any tenant's review, the sealing job) would queue behind it until that transaction
    ends. It waits at most its lock_timeout, and then the purge goes on without the drop."""
    settings.ZEROMEM_AUDIT_RETENTION_DAYS = 30
    a, b = make_tenant("drop-long"), make_tenant("drop-other")
    reading, release, outcome, failures = threading.Event(), threading.Event(), {}, []
    later = timezone.now() + timedelta(days=400)  # this month is past everyone's retention then

    def long_reader():
        with transaction.atomic():
            AuditEvent.objects.filter(tenant=a).count()  # holds every partition (ACCESS SHARE)
            reading.set()
            release.wait(30)

    reader = start_thread(long_reader, failures, done=reading)
    try:
        assert reading.wait(20)
        job = start_thread(lambda: outcome.update(audit_purge_all(now=later)), failures)
        wait_for_a_lock_waiter("the drop", alive=job.is_alive)  # it waits for the month now
        started = time.monotonic()
        AuditEvent.objects.filter(tenant=b).exists()  # another tenant's review of its log
        waited = time.monotonic() - started
        job.join(30)
        assert not failures, failures
        assert waited < 8, f"another tenant's read of its log waited {waited:.1f} s behind the drop"
        assert set(outcome) == {a.slug, b.slug, ""}  # the row purge still ran for every chain
    finally:
        release.set()
        reader.join(30)
        partitions.ensure_partitions()  # had the drop gone through: the months the suite uses


def test_a_retention_longer_than_dates_reach_keeps_that_chain_and_purges_the_others(months, monkeypatch):
    """A tenant's retention beyond what dates reach (the column takes any positive number)
    made the daily purge raise OverflowError — before any other tenant's events were purged."""
    a, b, ids = months
    a.audit_retention_days = 10**9
    a.save(update_fields=["audit_retention_days"])
    now = datetime(2031, 4, 5, tzinfo=UTC)
    at(monkeypatch, now)
    done = audit_purge_all(now=now)
    assert done["part-a"] == 0 and AuditEvent.objects.filter(pk__in=ids["a_jan"]).count() == len(ids["a_jan"])
    assert exists("audit_auditevent_p2031_01")  # A's January is kept, so the month stays
    assert done["part-b"] >= 3 and not AuditEvent.objects.filter(pk__in=ids["b_jan"]).exists()
    assert audit_verify(tenant_id=a.pk).ok and audit_verify(tenant_id=b.pk).ok


def _actor_filter_indexes() -> tuple[bool | None, set[str]]:
    """(whether the parent's index is valid — None: no such index, the tables whose
    partition index is attached to it)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass('audit_tenant_actor_filter')")
        row = cursor.fetchone()
        cursor.execute(
            "SELECT ix.indrelid::regclass::text FROM pg_inherits x JOIN pg_index ix ON ix.indexrelid = x.inhrelid "
            "WHERE x.inhparent = to_regclass('audit_tenant_actor_filter')"
        )
        return (row[0] if row else None), {name for (name,) in cursor.fetchall()}


@pytest.mark.django_db(transaction=True)
def test_building_the_actor_filter_index_behind_a_long_transaction_never_queues_every_tenants_events():
    """audit/0014's index (tenant, actor_filter). A plain CREATE INDEX on the parent takes
    SHARE on every partition: waiting behind one long transaction that wrote the log, it
    would queue every other tenant's audit INSERT — every request — until that transaction
    ends, then hold them for the build. Built ON ONLY the parent (its lock asked with a short
    lock_timeout), each partition's CONCURRENTLY and attached, inserts go on; in the end the
    index is valid on every partition."""
    loader = MigrationLoader(connection)
    node = ("audit", "0014_audit_actor_filter")
    add_column, build = loader.get_migration(*node).operations
    before = loader.project_state(node, at_end=False)
    with_column = before.clone()
    add_column.state_forwards("audit", with_column)
    after = with_column.clone()
    build.state_forwards("audit", after)
    a, b = make_tenant("index-long"), make_tenant("index-other")
    with connection.cursor() as cursor:
        cursor.execute("DROP INDEX audit_tenant_actor_filter")  # as before the migration
    holding, release, failures = threading.Event(), threading.Event(), []

    def long_transaction():
        with transaction.atomic():
            audit_record(tenant=a, actor=AGENT, action="memory.read", outcome="ok")
            holding.set()
            release.wait(30)

    def migrate():
        with connection.schema_editor(atomic=False) as editor:
            build.database_forwards("audit", editor, with_column, after)

    holder = start_thread(long_transaction, failures, done=holding)
    try:
        assert holding.wait(20)
        job = start_thread(migrate, failures)
        wait_for_a_lock_waiter("the index build", alive=job.is_alive)  # it waits behind the transaction now
        started = time.monotonic()
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '5s'")  # the test never hangs
                audit_record(tenant=b, actor=AGENT, action="memory.read", outcome="ok")  # another tenant's request
        except DatabaseError:
            pass
        waited = time.monotonic() - started
        assert waited < 3, f"another tenant's audit INSERT waited {waited:.1f} s behind the index build"
    finally:
        release.set()
        holder.join(30)
    job.join(60)
    assert not failures, failures
    valid, indexed = _actor_filter_indexes()
    assert valid is True
    assert indexed == {p.name for p in partitions.partitions()}
