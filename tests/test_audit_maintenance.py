"""The audit log's maintenance as the schedules and commands run it: audit_seal_all and
audit_purge_all over every tenant and the tenant-less events, and the audit_verify --seal,
audit_purge and demo_setup commands. The clock is passed in (``now``), not waited for."""

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from audit import services as audit_services
from audit.models import AuditEvent
from audit.seals import unsealed_q
from memories.models import ApiKey, Membership, Tenant
from tests.factories import write


@pytest.fixture
def events(api, tenant_a, tenant_b):
    """Events in tenant A, tenant B and none (a failed authentication, aggregated)."""
    write(tenant_a, "user:u1:a", "x")
    write(tenant_b, "user:u1:a", "x")
    with audit_services.audited_operation(
        tenant=None, actor=audit_services.Actor.system(job="t"), action="auth.failed"
    ) as op:
        op.record(outcome="denied", count=3)
    return tenant_a, tenant_b


def verify(*args) -> list[dict]:
    out = StringIO()
    call_command("audit_verify", "--json", *args, stdout=out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_seal_all_seals_every_tenant_and_the_tenant_less_events(events):
    assert AuditEvent.objects.filter(unsealed_q(None)).exists()
    assert audit_services.audit_unsealed_count() == AuditEvent.objects.count()
    sealed = audit_services.audit_seal_all()
    assert set(sealed) >= {events[0].pk, events[1].pk, None} and all(n > 0 for n in sealed.values())
    assert audit_services.audit_unsealed_count() == 0
    assert all(chain["ok"] and chain["unsealed"] == 0 for chain in verify())


def test_purge_all_deletes_old_events_of_every_tenant_and_the_tenant_less_ones(events, settings):
    settings.ZEROMEM_AUDIT_RETENTION_DAYS = 30
    later = timezone.now() + timedelta(days=31)
    done = audit_services.audit_purge_all(now=later)
    assert done[events[0].slug] > 0 and done[events[1].slug] > 0 and done[""] == 1
    # What is left: the purge's own events and the checkpoints; every chain still verifies.
    assert set(AuditEvent.objects.values_list("action", flat=True)) == {"audit.purge"}
    assert all(chain["ok"] for chain in verify("--seal"))


def test_verify_seal_seals_the_tail_first(events):
    before = verify()
    assert any(chain["unsealed"] > 0 for chain in before)
    after = verify("--seal")
    assert all(chain["ok"] and chain["unsealed"] == 0 for chain in after)
    assert {c["chain"] for c in after} == {c["chain"] for c in before}


def test_audit_purge_command_covers_the_tenant_less_chain(events, settings, monkeypatch):
    settings.ZEROMEM_AUDIT_RETENTION_DAYS = 30
    later = timezone.now() + timedelta(days=31)
    monkeypatch.setattr(timezone, "now", lambda: later)
    out = StringIO()
    call_command("audit_purge", stdout=out)
    lines = out.getvalue().splitlines()
    assert "(no tenant): 1 events in 1 seals purged" in lines, lines
    assert not AuditEvent.objects.filter(tenant__isnull=True).exclude(action="audit.purge").exists()


def test_demo_setup_creates_the_tenant_admin_and_a_key_and_is_idempotent(db):
    out = StringIO()
    call_command("demo_setup", "--tenant", "demo", "--username", "demo-admin", stdout=out)
    first = out.getvalue()
    tenant = Tenant.objects.get(slug="demo")
    assert Membership.objects.get(tenant=tenant).role == "admin"
    assert "API key:  zm_" in first and "demo-admin / " in first
    call_command("demo_setup", "--tenant", "demo", "--username", "demo-admin", stdout=StringIO())
    assert Tenant.objects.filter(slug="demo").count() == 1
    assert ApiKey.objects.filter(tenant=tenant).count() == 2  # a fresh key each run
    assert Membership.objects.filter(tenant=tenant).count() == 1
