"""Promises of the README that had no test: a 429 writes no audit row of its own (it is
counted per minute, tests/test_refusal_tally.py); a bad X-Request-ID is
replaced by ours; per-tenant value_max_bytes and the hard cap; the audit row and its
operation commit or roll back together."""

import re
from pathlib import Path

import pytest
from django.db import DatabaseError

from audit import services as audit_services
from audit.models import AuditEvent
from memories import services
from memories.models import Memory
from tests.factories import SYSTEM

CALL = "/api/v1/tools/call"


def test_a_request_refused_by_the_rate_limit_writes_no_audit_row_of_its_own(api, settings, limiter_minute):
    # Refusals over a limit are counted per source and minute and written later as one
    # event with the count (audit/services.py _tally_refusal): a flood costs no row each.
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 2
    assert api.call("memory_list")[0] == 200
    assert api.call("memory_list")[0] == 200
    events = AuditEvent.objects.count()
    status, body = api.call("memory_list")
    assert status == 429 and body["error"]["code"] == "rate_limited"
    assert AuditEvent.objects.count() == events


@pytest.mark.parametrize("incoming", ["short", "x" * 65, "has space in it", "semi;colon-123", "ünïcode-123"])
def test_a_bad_incoming_request_id_is_replaced_by_ours(api, incoming):
    r = api.post(CALL, {"name": "memory_list", "arguments": {}}, headers={"X-Request-ID": incoming})
    assert r.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["X-Request-ID"]), r.headers["X-Request-ID"]  # ours alone
    assert AuditEvent.objects.latest("pk").request_id == r.headers["X-Request-ID"]


def test_a_tenants_value_max_bytes_and_the_hard_cap(api, tenant_a, settings):
    settings.ZEROMEM_VALUE_HARD_CAP_BYTES = 1000
    tenant_a.value_max_bytes = 100
    tenant_a.save(update_fields=["value_max_bytes"])
    fits, over = "a" * 98, "a" * 99  # 100 and 101 bytes as JSON text (with the quotes)
    assert api.call("memory_write", key="user:u1:a", value=fits)[1]["status"] == "ok"
    status, body = api.call("memory_write", key="user:u1:b", value=over)
    assert body["status"] == "error" and body["error"]["field"] == "value", body
    assert "limit is 100" in body["error"]["message"]
    # A tenant's own limit above the hard cap is held to the cap.
    tenant_a.value_max_bytes = 10**6
    tenant_a.save(update_fields=["value_max_bytes"])
    assert api.call("memory_write", key="user:u1:c", value="a" * 998)[1]["status"] == "ok"
    status, body = api.call("memory_write", key="user:u1:d", value="a" * 999)
    assert "limit is 1000" in body["error"]["message"], body
    assert set(Memory.objects.filter(tenant=tenant_a).values_list("key", flat=True)) == {"user:u1:a", "user:u1:c"}


def test_the_audit_row_rolls_back_with_its_operation(tenant_a):
    with pytest.raises(RuntimeError):
        with audit_services.audited_operation(tenant=tenant_a, actor=SYSTEM, action="memory.write") as op:
            Memory.objects.create(tenant=tenant_a, key="user:u1:a", value="x")
            op.record()
            raise RuntimeError("the operation fails after its change")
    assert not Memory.objects.filter(tenant=tenant_a).exists()
    assert not AuditEvent.objects.filter(tenant=tenant_a, action="memory.write").exists()


def test_the_operation_rolls_back_when_its_audit_insert_fails(tenant_a, monkeypatch):
    def failing_insert(vendor, flush_waived=False):
        raise DatabaseError("the audit INSERT failed")

    monkeypatch.setattr(audit_services, "_insert_sql", failing_insert)
    with pytest.raises(DatabaseError):
        services.memory_write(tenant=tenant_a, actor=SYSTEM, key="user:u1:a", value="x")
    monkeypatch.undo()
    assert not Memory.objects.filter(tenant=tenant_a).exists()
    assert not AuditEvent.objects.filter(tenant=tenant_a, action="memory.write").exists()


def test_the_readmes_jobs_table_names_every_schedule_with_its_period():
    """Operators read the recurring jobs in the README's Jobs table: a schedule missing there
    (zeromem:portal-links-purge was) runs unseen."""
    from django_q.models import Schedule

    from zeromem.schedules import SCHEDULES

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(zeromem:[a-z-]+)` \| ([^|]+) \|", readme, re.MULTILINE))
    periods = {Schedule.HOURLY: "hourly", Schedule.DAILY: "daily"}
    expected = {
        name: f"{minutes} min" if kind == Schedule.MINUTES else periods[kind]
        for name, (_func, kind, minutes) in SCHEDULES.items()
    }
    assert {name: period.strip() for name, period in rows.items()} == expected
