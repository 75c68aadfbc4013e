"""An audited call does not lock its tenant's row (audit migration 0017, memories migration
0045): the audit event and the memory version keep their tenant without a foreign key in the
database, whose check took ``FOR KEY SHARE`` on the tenant's row with every event — every
concurrent call of one tenant locking the same row. The ORM still refuses to delete a tenant
that has events (``on_delete=PROTECT``)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.models import ProtectedError

from audit.models import AuditEvent
from memories import services
from memories.models import Memory, MemoryVersion, Tenant
from tests.factories import SYSTEM, make_tenant, write
from tests.helpers import other_session


def _holding_the_tenant_row(tenant):
    """Another session that holds the tenant's row ``FOR UPDATE`` (which a foreign key check's
    ``FOR KEY SHARE`` waits for)."""
    other = other_session()
    other.execute("SELECT 1 FROM memories_tenant WHERE id = %s FOR UPDATE", [tenant.pk])
    return other


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_write_and_a_read_go_on_while_another_session_holds_the_tenant_row():
    """(A new memory's row still has its foreign key to the tenant: a create is not this.)"""
    tenant = make_tenant("locked-row")
    write(tenant, "user:u1:lang", "zh-CN")
    other = _holding_the_tenant_row(tenant)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")  # a wait fails the call instead of hanging
        try:
            written = services.memory_write(tenant=tenant, actor=SYSTEM, key="user:u1:lang", value="en")
            read = services.memory_read(tenant=tenant, actor=SYSTEM, key="user:u1:lang")
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
    finally:
        other.close()
    assert (written.memory.version, read.memory.value) == (2, "en")
    assert MemoryVersion.objects.filter(tenant=tenant).count() == 2
    assert list(
        AuditEvent.objects.filter(tenant=tenant, outcome="ok", action__startswith="memory.")
        .order_by("id")
        .values_list("action", flat=True)
    ) == ["memory.write", "memory.write", "memory.read"]


@pytest.mark.django_db
def test_a_tenant_with_events_is_still_not_deleted():
    tenant = make_tenant("kept")
    write(tenant, "user:u1:lang", "zh-CN")
    Memory.objects.filter(tenant=tenant).delete()
    MemoryVersion.objects.filter(tenant=tenant).delete()
    assert AuditEvent.objects.filter(tenant=tenant).exists()
    with pytest.raises(ProtectedError):
        tenant.delete()
    assert Tenant.objects.filter(pk=tenant.pk).exists()
