"""Bringing stored values in line with the keys and rules (README "Encryption at rest").

:func:`reencrypt` walks every memory (of one tenant, or all) in batches of ``batch`` rows by
id, each batch one transaction with its rows locked, and seals again — under the current
data key of the memory's subject (else its tenant) — every value that should be sealed and is
not under that key: a memory marked sensitive whose key was retired (data key rotation,
``keyring.retire_current``), or one a sensitivity rule added since matches (it becomes
sensitive, and its value leaves the search index). Its versions go with it. Values whose
key is destroyed are left as they are (nothing can open them).

Idempotent and resumable: a row already under its current key is skipped, so a run killed
at any point is completed by running it again, and a second full run changes nothing.

Every rotation step is audited, by the system actor (``surface`` = ``job``), one event per
tenant it touched, with counts: ``crypto.reencrypt`` per batch (in the batch's transaction:
``count`` memories, ``detail.versions``), ``crypto.retire`` (:func:`retire_data_keys`) and
``crypto.rewrap`` per batch (:func:`rewrap_data_keys`; ``count`` data keys). A run that
changes nothing writes no event.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from django.db import transaction
from django.db.models import TextField
from django.db.models.functions import Cast

from audit.services import audited_operation
from memories import keyring, search
from memories.models import DataKey, Memory, MemoryVersion, Tenant
from memories.services import sensitivity
from zeromem.kernel import crypto
from zeromem.kernel.actors import Actor
from zeromem.kernel.crypto import ErasedValue

REENCRYPT_BATCH = 500
REENCRYPT_JOB = "crypto_reencrypt"
REWRAP_JOB = "crypto_rewrap"


def _audit_per_tenant(action: str, job: str, counts: dict[int, dict]) -> None:
    """One ``action`` event per tenant of ``counts`` ({tenant id: {"count": n, **detail}}), by
    the system actor. A tenant deleted meanwhile has no log to write to: skipped."""
    tenants = Tenant.objects.in_bulk(list(counts))
    actor = Actor.system(job=job)
    for tenant_id in sorted(counts):
        tenant = tenants.get(tenant_id)
        if tenant is None:
            continue
        detail = dict(counts[tenant_id])
        count = detail.pop("count")
        with audited_operation(tenant=tenant, actor=actor, action=action) as op:
            op.record(count=count, detail=detail)


def retire_data_keys(*, tenant_id: int | None = None) -> int:
    """Retire the current data keys (of one tenant, or all; data key rotation), auditing
    ``crypto.retire`` per tenant. Returns how many keys were retired."""
    counts = keyring.retire_current_by_tenant(tenant_id=tenant_id)
    _audit_per_tenant("crypto.retire", REENCRYPT_JOB, {t: {"count": n} for t, n in counts.items()})
    return sum(counts.values())


def rewrap_data_keys(*, batch: int = 500, progress=None) -> tuple[int, int]:
    """Re-wrap every live data key under the first master key (:func:`keyring.rewrap`),
    auditing ``crypto.rewrap`` per tenant in each batch's transaction. Returns (re-wrapped,
    live keys)."""

    def audit(rows: list[DataKey]) -> None:
        counts: dict[int, dict] = {}
        for row in rows:
            counts.setdefault(row.tenant_id, {"count": 0})["count"] += 1
        _audit_per_tenant("crypto.rewrap", REWRAP_JOB, counts)

    return keyring.rewrap(batch=batch, progress=progress, in_batch=audit)


@dataclass
class ReencryptProgress:
    batches: int = 0
    scanned: int = 0
    memories: int = 0
    versions: int = 0
    last_id: int = 0


def _stale(raw_text: str | None, current_id: int) -> bool:
    raw = json.loads(raw_text) if raw_text else None
    return not (crypto.is_envelope(raw) and int(raw["k"]) == current_id)


def reencrypt(
    *,
    tenant_id: int | None = None,
    batch: int = REENCRYPT_BATCH,
    after_id: int = 0,
    progress: Callable[[ReencryptProgress], None] | None = None,
) -> ReencryptProgress:
    done = ReencryptProgress(last_id=after_id)
    tenants: dict[int, Tenant] = {}
    while True:
        with transaction.atomic():
            qs = Memory.objects.filter(pk__gt=done.last_id).order_by("pk")
            if tenant_id is not None:
                qs = qs.filter(tenant_id=tenant_id)
            rows = list(qs.select_for_update().annotate(raw=Cast("value", TextField()))[:batch])
            if not rows:
                return done
            counts: dict[int, dict] = {}
            plain: list[Memory] = []
            for memory in rows:
                tenant = tenants.get(memory.tenant_id) or tenants.setdefault(
                    memory.tenant_id, Tenant.objects.get(pk=memory.tenant_id)
                )
                memories, versions = done.memories, done.versions
                if not _reencrypt_one(memory, tenant, done):
                    plain.append(memory)
                _count(counts, memory, done.memories - memories, done.versions - versions)
            _reencrypt_sealed_versions_of_plain(plain, done, counts)
            _audit_per_tenant("crypto.reencrypt", REENCRYPT_JOB, counts)
            done.batches += 1
            done.scanned += len(rows)
            done.last_id = rows[-1].pk
        if progress is not None:
            progress(done)


def _summary_of_sensitive(memory: Memory, tenant: Tenant) -> bool:
    """A summary made from a memory that is sensitive (or that the tenant's rules match) holds
    its text, so it is as sensitive — as summarize_run decides for a new summary. One query of
    its sources (summaries only)."""
    if memory.category != Memory.Category.SUMMARY or not memory.sources:
        return False
    sources = Memory.objects.filter(tenant_id=memory.tenant_id, key__in=memory.sources).only(
        "tenant_id", "key", "value", "sensitive"
    )
    return any(
        m.sensitive
        or (not isinstance(m.value, ErasedValue) and sensitivity.matches_rules(tenant, key=m.key, value=m.value))
        for m in sources
    )


def version_subject(version: MemoryVersion, memory: Memory) -> str:
    """The end user whose key seals ``version``: the one it was written for (a key rewritten
    for another end user keeps the first one's values in its history, and that user's forget
    must shred them in backups too), else — recorded before migration 0023 — the memory's."""
    return version.subject or memory.subject


def _count(counts: dict[int, dict], memory: Memory, memories: int, versions: int) -> None:
    if memories or versions:
        mine = counts.setdefault(memory.tenant_id, {"count": 0, "versions": 0})
        mine["count"] += memories
        mine["versions"] += versions


def _reencrypt_sealed_versions_of_plain(plain: list[Memory], done: ReencryptProgress, counts: dict) -> None:
    """A memory no longer sealed (its manual mark cleared) keeps the versions it wrote while
    sealed, sealed: they move to the current key too, or a retired key would hold them for
    good. One query for the batch's plain memories."""
    if not plain:
        return
    by_id = {m.pk: m for m in plain}
    versions = MemoryVersion.objects.filter(memory_id__in=list(by_id), sensitive=True).annotate(
        raw=Cast("value", TextField())
    )
    for version in versions:
        memory = by_id[version.memory_id]
        if isinstance(version.value, ErasedValue):
            continue
        subject = version_subject(version, memory)
        current_id, _ = keyring.current_key(tenant_id=memory.tenant_id, subject=subject)
        if not _stale(version.raw, current_id):
            continue
        MemoryVersion.objects.filter(pk=version.pk).update(
            value=keyring.seal_value(version.value, tenant_id=memory.tenant_id, subject=subject)
        )
        done.versions += 1
        _count(counts, memory, 0, 1)


def _reencrypt_one(memory: Memory, tenant: Tenant, done: ReencryptProgress) -> bool:
    """Seal ``memory`` and its versions under its current key when it should be sealed;
    False when it should not (its sealed versions are the caller's)."""
    if isinstance(memory.value, ErasedValue):
        return True  # its key is destroyed: nothing can open it, nothing to move
    want = (
        memory.sensitive
        or sensitivity.matches_rules(tenant, key=memory.key, value=memory.value)
        or _summary_of_sensitive(memory, tenant)
    )
    if not want:
        return False
    current_id, _ = keyring.current_key(tenant_id=memory.tenant_id, subject=memory.subject)
    if not memory.sensitive or _stale(memory.raw, current_id):
        Memory.objects.filter(pk=memory.pk).update(
            value=keyring.seal_value(memory.value, tenant_id=memory.tenant_id, subject=memory.subject),
            sensitive=True,
            **search.index_fields(tenant_id=memory.tenant_id, key=memory.key, value=None, tags=memory.tags),
        )
        done.memories += 1
    versions = MemoryVersion.objects.filter(memory_id=memory.pk).annotate(raw=Cast("value", TextField()))
    for version in versions:
        if isinstance(version.value, ErasedValue):
            continue
        subject = version_subject(version, memory)
        current_id, _ = keyring.current_key(tenant_id=memory.tenant_id, subject=subject)
        if version.sensitive and not _stale(version.raw, current_id):
            continue
        MemoryVersion.objects.filter(pk=version.pk).update(
            value=keyring.seal_value(version.value, tenant_id=memory.tenant_id, subject=subject),
            sensitive=True,
        )
        done.versions += 1
    return True
