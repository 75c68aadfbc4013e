"""``python manage.py audit_checkpoint [--tenant SLUG] [--out FILE]``

Seals the tail and prints (or writes) each tenant's chain head — seal number, hash, event
count, time — as JSON. Keep it outside the database: ``audit_verify --checkpoint FILE``
then detects a chain whose tail was cut off. Each checkpoint is itself an audit event.
"""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand

from audit.services import audit_checkpoint_create
from zeromem.kernel.actors import Actor

from ._tenants import chains


class Command(BaseCommand):
    help = "Print each tenant's audit chain head (a checkpoint to keep outside the database)."

    def add_arguments(self, parser):
        parser.add_argument("--tenant")
        parser.add_argument("--out", help="write the JSON here instead of stdout")

    def handle(self, *args, tenant=None, out=None, **options):
        actor = Actor.system(job="audit_checkpoint")
        items = [audit_checkpoint_create(tenant=t, actor=actor).as_dict() for _, t in chains(tenant) if t is not None]
        text = json.dumps(items[0] if tenant else items, indent=2)
        if out:
            Path(out).write_text(text + "\n")
            self.stderr.write(f"wrote {len(items)} checkpoint(s) to {out}")
        else:
            self.stdout.write(text)
