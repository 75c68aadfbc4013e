"""The dashboard's daily counts (audit/daily.py): folded in by the sealing job exactly once,
per tenant and UTC day, and always current (the tail not folded yet is counted live)."""

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from audit import daily
from audit.models import AuditDailyCount, AuditDailyFold, AuditEvent
from audit.services import audit_purge, audit_record, audit_seal
from memories.selectors.dashboard import operations_per_day, tenant_dashboard
from tests.factories import make_tenant
from zeromem.kernel.actors import Actor

AGENT = Actor(kind="api_key", id="7", label="zm_agent", scopes=frozenset(["memory:read"]), surface="tool")
ADMIN = Actor(kind="user", id="3", label="ann", surface="admin")


def at(monkeypatch, when: datetime) -> None:
    monkeypatch.setattr(timezone, "now", lambda: when)


def record(tenant, action, outcome="ok", actor=AGENT, n=1, **kw):
    for _ in range(n):
        audit_record(tenant=tenant, actor=actor, action=action, outcome=outcome, **kw)


def stored(tenant) -> dict:
    return {
        (d.isoformat(), m): v
        for d, m, v in AuditDailyCount.objects.filter(tenant=tenant).values_list("day", "metric", "value")
    }


@pytest.fixture
def two_days(db, monkeypatch):
    """Tenant A's events on both sides of a UTC midnight, tenant B's on the second day."""
    a, b = make_tenant("daily-a"), make_tenant("daily-b")
    at(monkeypatch, datetime(2026, 11, 30, 23, 59, 58, tzinfo=UTC))
    record(a, "memory.read", n=3)
    record(a, "memory.read", actor=ADMIN)  # a read, not an agent's
    record(a, "memory.write", n=2)
    at(monkeypatch, datetime(2026, 12, 1, 0, 0, 1, tzinfo=UTC))
    record(a, "memory.search")
    record(a, "memory.read", outcome="not_found", n=2)
    record(a, "memory.write", outcome="denied")
    record(a, "audit.list")  # not a memory operation: in no series
    record(b, "memory.read", n=5)
    return a, b


EXPECTED_A = {
    ("2026-11-30", "reads"): 4,
    ("2026-11-30", "agent_reads"): 3,
    ("2026-11-30", "writes"): 2,
    ("2026-12-01", "reads"): 1,
    ("2026-12-01", "agent_reads"): 1,
    ("2026-12-01", "misses"): 2,
    ("2026-12-01", "denials"): 1,
}


def as_pairs(per_metric: dict) -> dict:
    return {(d.isoformat(), m): v for m, days in per_metric.items() for d, v in days.items() if v}


def test_sealing_folds_each_event_once_per_tenant_and_utc_day(two_days):
    a, b = two_days
    since = datetime(2026, 11, 20).date()
    # Before sealing nothing is stored, yet the figures are already right (the tail, live).
    assert stored(a) == {} and as_pairs(daily.counts(a.pk, since=since)) == EXPECTED_A

    audit_seal(tenant_id=a.pk, batch_size=4)
    audit_seal(tenant_id=b.pk)
    assert stored(a) == EXPECTED_A
    assert stored(b) == {("2026-12-01", "reads"): 5, ("2026-12-01", "agent_reads"): 5}
    assert as_pairs(daily.counts(a.pk, since=since)) == EXPECTED_A

    # Sealing again (nothing new) and folding again change nothing: each seal is folded once.
    audit_seal(tenant_id=a.pk)
    daily.fold(a.pk)
    assert stored(a) == EXPECTED_A
    # New events: in the figures at once, stored once sealed.
    record(a, "memory.update", n=2)
    writes = daily.counts(a.pk, since=since)["writes"]
    assert writes == {datetime(2026, 11, 30).date(): 2, datetime(2026, 12, 1).date(): 2}
    audit_seal(tenant_id=a.pk)
    assert stored(a)[("2026-12-01", "writes")] == 2 and stored(a)[("2026-11-30", "writes")] == 2


def test_dashboard_series_and_token_estimate_read_the_counts(two_days, monkeypatch):
    a, _b = two_days
    audit_seal(tenant_id=a.pk)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    days, series = operations_per_day(tenant=a, now=now)
    assert days[-2:] == [datetime(2026, 11, 30).date(), datetime(2026, 12, 1).date()] and len(days) == 14
    assert series["reads"][-2:] == [4, 1] and series["writes"][-2:] == [2, 0]
    assert series["misses"][-2:] == [0, 2] and series["denials"][-2:] == [0, 1]
    assert sum(sum(v) for v in series.values()) == 10
    at(monkeypatch, now)
    assert tenant_dashboard(tenant=a, now=now).tokens["reads"] == 4  # agent reads, both days
    # Fifteen days later both days have left the 14-day window.
    _days, later = operations_per_day(tenant=a, now=now + timedelta(days=15))
    assert all(v == 0 for values in later.values() for v in values)


def test_a_sealed_history_older_than_the_counts_is_folded_on_the_next_seal(two_days):
    """Deploying the counts on a database with sealed events: no watermark yet, the next
    sealing run folds every kept seal (a seal purged before that is skipped)."""
    a, _b = two_days
    audit_seal(tenant_id=a.pk, batch_size=5)
    AuditDailyCount.objects.filter(tenant=a).delete()
    AuditDailyFold.objects.filter(tenant=a).delete()
    assert daily.fold(a.pk) == AuditEvent.objects.filter(tenant=a).count()
    assert stored(a) == EXPECTED_A


def test_purged_seals_keep_their_counts(two_days):
    a, _b = two_days
    audit_seal(tenant_id=a.pk, batch_size=5)
    events = AuditEvent.objects.filter(tenant=a).count()
    assert audit_purge(tenant=a, now=datetime(2030, 1, 1, tzinfo=UTC))["events"] == events
    assert stored(a) == EXPECTED_A  # the dashboard's history outlives the events' retention


def test_tail_counting_sees_only_its_tenant(two_days):
    a, b = two_days
    since = datetime(2026, 11, 20).date()
    assert sum(daily.counts(b.pk, since=since)["reads"].values()) == 5
    assert sum(daily.counts(a.pk, since=since)["reads"].values()) == 5
    audit_seal(tenant_id=a.pk)
    assert sum(daily.counts(b.pk, since=since)["reads"].values()) == 5


def test_the_database_counts_the_tail_and_a_fold_as_event_by_event_counting_would(two_days, monkeypatch):
    """The live tail and a fold are one GROUP BY in the database (counting 1M unsealed events
    one by one in Python, as a stalled sealing job leaves them, took 15.6 s); a metric that
    reads an event's count or detail (per_event) is still counted event by event."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    a, _b = two_days
    since = datetime(2026, 11, 20).date()
    with CaptureQueriesContext(connection) as ctx:
        grouped = as_pairs(daily.counts(a.pk, since=since))
    assert grouped == EXPECTED_A
    (tail,) = [q["sql"] for q in ctx.captured_queries if "audit_auditevent" in q["sql"]]
    assert "GROUP BY" in tail and "COUNT(" in tail.upper()

    # A metric of the event's count: every metric then counted in Python, the same figures.
    counted = daily.DailyMetric("counted", lambda e: e.count or 0, per_event=True)
    monkeypatch.setattr(daily, "METRICS", (*daily.METRICS, counted))
    monkeypatch.setattr(daily, "METRIC_NAMES", (*daily.METRIC_NAMES, "counted"))
    record(a, "memory.list", count=7)
    one_by_one = as_pairs(daily.counts(a.pk, since=since))
    today = timezone.now().date().isoformat()
    assert one_by_one == {**EXPECTED_A, (today, "reads"): EXPECTED_A[(today, "reads")] + 1, (today, "counted"): 7}
    audit_seal(tenant_id=a.pk, batch_size=5)  # folded the same way
    assert as_pairs(daily.counts(a.pk, since=since)) == one_by_one
