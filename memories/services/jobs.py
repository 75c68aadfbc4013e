"""Background jobs as callers see them (``GET /api/v1/jobs/{id}``)."""

from __future__ import annotations

from typing import Any

from audit.services import audit_record
from memories.models import Job, Tenant
from memories.services.memories import Outcome, _operation
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor, require_scope
from zeromem.kernel.scopes import Scope


def job_get(*, tenant: Tenant, actor: Actor, job_id: Any) -> Job | None:
    """One of the tenant's jobs, or None when there is no such job *for this caller*:
    another tenant's job, and a job about keys outside the caller's allowlist (or about the
    whole tenant, for a key with an allowlist), look exactly like a job that does not exist.

    Needs ``memory:read`` (a job's params and result name keys and prefixes). Cost: one
    primary-key SELECT and the audit INSERT.
    """
    with _operation(tenant=tenant, actor=actor, action="job.read"):
        require_scope(actor, Scope.MEMORY_READ)
        job_id = validation.bounded_int(job_id, field="job_id", default=0, low=1, high=2**63 - 1)
        job = Job.objects.filter(tenant=tenant, pk=job_id).first()
        if job is not None and not _visible(actor, job):
            job = None
        audit_record(
            tenant=tenant,
            actor=actor,
            action="job.read",
            target=str(job_id),
            outcome=Outcome.OK if job else Outcome.NOT_FOUND,
        )
        return job


def _visible(actor: Actor, job: Job) -> bool:
    if not actor.allowed_prefixes:
        return True
    prefix = job.params.get("prefix") if isinstance(job.params, dict) else None
    return isinstance(prefix, str) and bool(prefix) and any(prefix.startswith(p) for p in actor.allowed_prefixes)
