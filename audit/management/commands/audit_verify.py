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
        for label, t in chains(tenant):
            tenant_id = t.pk if t else None
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
        if failed:
            raise CommandError("audit chain verification failed", returncode=1)


def _load_checkpoints(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read checkpoint file {path}: {exc}") from exc
    items = data if isinstance(data, list) else [data]
    return {item.get("tenant"): item for item in items if isinstance(item, dict)}


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
