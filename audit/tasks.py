"""django-q2 tasks of the audit log: dotted-path functions that call a service."""

from audit import partitions, services
from zeromem.kernel.tasks import kept, one_at_a_time


@kept
@one_at_a_time
def audit_seal_task() -> dict:
    return {str(k): v for k, v in services.audit_seal_all().items()}


@kept
@one_at_a_time
def audit_purge_task() -> dict:
    return services.audit_purge_all()


@kept
@one_at_a_time
def audit_auth_failures_flush_task() -> int:
    """Every minute: the closed minutes' counted failed authentications and refusals over a
    tenant's limits, each source's minute as one event. Returns the events written."""
    return services.audit_auth_failures_flush() + services.audit_refusals_flush()


@kept
@one_at_a_time
def audit_partitions_task() -> dict:
    return partitions.ensure_partitions()
