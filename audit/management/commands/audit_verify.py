"""``python manage.py audit_verify [--tenant SLUG] [--checkpoint FILE] [--seal] [--json]``

Walks each tenant's audit chain and exits 1 naming the first bad event (edited, deleted,
inserted or reordered) or seal; with ``--checkpoint`` (a file written by
``audit_checkpoint``) also detects a cut-off tail. ``--seal`` seals the unsealed tail first
(the only write it makes). Prints the rate (events per second).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from audit.services import audit_seal
from audit.verify import audit_verify

from ._tenants import NO_TENANT, chains


class Command(BaseCommand):
    help = "Verify the audit log's hash chain; exit 1 naming the first bad event."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", help=f"tenant slug ('{NO_TENANT}': events that matched no tenant)")
        parser.add_argument("--checkpoint", help="a checkpoint file from audit_checkpoint (JSON, one or a list)")
        parser.add_argument("--seal", action="store_true", help="seal the unsealed tail before verifying")
        parser.add_argument("--json", action="store_true", help="one JSON object per chain on stdout")

    def handle(self, *args, tenant=None, checkpoint=None, seal=False, json=False, **options):
        kept = _load_checkpoints(checkpoint) if checkpoint else {}
        failed = False
        verified = set()
        for label, t in chains(tenant):
            tenant_id = t.pk if t else None
            verified.add(t.slug if t else None)
            if checkpoint and tenant and t is not None and t.slug not in kept:
                # Asked to check this chain against the file, which has no checkpoint of it.
                self.stderr.write(f"{label}: FAILED — the checkpoint file {checkpoint} holds no checkpoint of it")
                failed = True
            if seal:
                audit_seal(tenant_id=tenant_id)
            started = time.perf_counter()
            result = audit_verify(tenant_id=tenant_id, checkpoint=kept.get(t.slug if t else None))
            seconds = time.perf_counter() - started
            rate = (result.events + result.unsealed) / seconds if seconds > 0 else 0.0
            failed |= not result.ok
            if json:
                self.stdout.write(_as_json(label, result, rate))
                continue
            if result.ok:
                self.stdout.write(
                    f"{label}: ok — {result.events} sealed events in {result.seals} seals"
                    f" ({result.purged_seals} purged), {result.unsealed} unsealed; {rate:,.0f} events/s"
                )
            else:
                self.stderr.write(f"{label}: FAILED — {result.first_problem}")
                for extra in result.problems[1:5]:
                    self.stderr.write(f"    also: {extra}")
        if not tenant:
            # A kept checkpoint of a chain that is no longer there (the tenant deleted or its
            # slug changed): its whole chain is gone, which no chain's own walk can show.
            for slug in sorted(set(kept) - verified, key=str):
                self.stderr.write(f"'{slug}': FAILED — the checkpoint file names this tenant, which no chain has")
                failed = True
        if failed:
            raise CommandError("audit chain verification failed", returncode=1)


def _load_checkpoints(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read checkpoint file {path}: {exc}") from exc
    items = data if isinstance(data, list) else [data]
    for item in items:
        # What audit_checkpoint writes; anything else would be skipped or crash the comparison.
        if not isinstance(item, dict):
            raise CommandError(f"checkpoint file {path}: each checkpoint must be an object")
        for name, kind in (("tenant", str), ("seal", int), ("head_hash", str), ("events", int)):
            value = item.get(name)
            if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
                raise CommandError(f"checkpoint file {path}: {name} must be a {kind.__name__}")
    return {item["tenant"]: item for item in items}


def _as_json(label: str, result, rate: float) -> str:
    return json.dumps(
        {
            "chain": label,
            "ok": result.ok,
            "events": result.events,
            "seals": result.seals,
            "purged_seals": result.purged_seals,
            "unsealed": result.unsealed,
            "events_per_second": round(rate),
            "problems": [{"event": p.event_id, "seal": p.seal, "message": p.message} for p in result.problems],
        }
    )
