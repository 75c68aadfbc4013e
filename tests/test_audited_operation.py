"""The audited-operation helper: one event per operation, refusals rolled back and recorded
once (by the innermost operation), not-found and conflict recorded as answers."""

import pytest

from audit.models import AuditEvent
from audit.services import audit_refusal, audited_operation
from memories.models import Memory
from tests.factories import SYSTEM
from zeromem.kernel.errors import Conflict, InvalidInput, NotFound


def _events():
    rows = AuditEvent.objects.filter(action__startswith="test.").order_by("pk")
    return [(e.action, e.outcome, e.target, e.detail) for e in rows]


def _memory(tenant, key):
    return Memory.objects.create(tenant=tenant, key=key, namespace=key.split(":")[0], value="v")


def test_an_operation_records_its_event_in_its_transaction(tenant_a):
    with audited_operation(tenant=tenant_a, actor=SYSTEM, action="test.op", target="user:u1:k") as op:
        _memory(tenant_a, "user:u1:k")
        op.record(count=1)
    assert _events() == [("test.op", "ok", "user:u1:k", {})]
    assert AuditEvent.objects.get(action="test.op").count == 1


def test_an_operation_without_record_writes_no_event(tenant_a):
    with audited_operation(tenant=tenant_a, actor=SYSTEM, action="test.check"):
        pass
    assert _events() == []


def test_a_refusal_is_rolled_back_and_recorded_once_by_the_innermost_operation(tenant_a):
    with audited_operation(tenant=tenant_a, actor=SYSTEM, action="test.outer") as outer:
        with pytest.raises(InvalidInput) as refused:
            with audited_operation(tenant=tenant_a, actor=SYSTEM, action="test.inner", target="k") as op:
                _memory(tenant_a, "user:u1:k")
                op.record()
                raise InvalidInput("no", field="key")
        outer.record()
    audit_refusal(tenant=tenant_a, actor=SYSTEM, action="test.surface", error=refused.value)
    assert not Memory.objects.exists()
    assert _events() == [
        ("test.inner", "invalid", "k", {"code": "invalid", "field": "key"}),
        ("test.outer", "ok", "", {}),
    ]


def test_not_found_is_recorded_as_an_answer_with_the_fields_the_service_gave(tenant_a):
    with pytest.raises(NotFound):
        with audited_operation(tenant=tenant_a, actor=SYSTEM, action="test.read", target="k") as op:
            op.record(outcome="not_found", detail={"by": "keys"})
            raise NotFound("no such thing", field="key")
    with pytest.raises(Conflict):
        with audited_operation(tenant=tenant_a, actor=SYSTEM, action="test.update", target="k"):
            raise Conflict("moved", field="expected_version", current_version=2)
    assert _events() == [("test.read", "not_found", "k", {"by": "keys"}), ("test.update", "conflict", "k", {})]


def test_a_surface_refusal_is_not_recorded_again(tenant_a):
    error = InvalidInput("no", field="key")
    with pytest.raises(InvalidInput):
        with audited_operation(tenant=tenant_a, actor=SYSTEM, action="test.op"):
            raise error
    audit_refusal(tenant=tenant_a, actor=SYSTEM, action="test.surface", error=error)
    audit_refusal(tenant=tenant_a, actor=SYSTEM, action="test.surface", error=ValueError("not JSON"))
    assert [(a, o) for a, o, _, _ in _events()] == [("test.op", "invalid"), ("test.surface", "invalid")]
