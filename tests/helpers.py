"""Small helpers shared by the test modules (fixtures live in conftest.py)."""

from audit.models import AuditEvent
from memories.models import Memory, MemoryVersion


def row_counts() -> tuple[int, int]:
    """(Memory rows, MemoryVersion rows): compare before/after to prove nothing was written."""
    return Memory.objects.count(), MemoryVersion.objects.count()


def audit_count() -> int:
    return AuditEvent.objects.count()


def tool_error(body: dict) -> dict:
    """The error object of a refused tool call, after checking the envelope."""
    assert body["status"] == "error", body
    assert set(body["error"]) >= {"code", "message", "field"}, body
    return body["error"]


def rest_error(response) -> dict:
    body = response.json()
    assert set(body["error"]) >= {"code", "message", "field"}, body
    return body["error"]
