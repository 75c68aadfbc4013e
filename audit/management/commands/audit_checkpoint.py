"""``python manage.py audit_checkpoint [--tenant SLUG] [--out FILE]``

Seals the tail and prints (or writes) each tenant's chain head — seal number, hash, event
count, time — as JSON. Keep it outside the database: ``audit_verify --checkpoint FILE``
then detects a chain whose tail was cut off. Each checkpoint is itself an audit event.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from audit.services import audit_checkpoint_create
from zeromem.kernel.actors import Actor

from ._tenants import NO_TENANT, chains


class Command(BaseCommand):
    help = "Print each tenant's audit chain head (a checkpoint to keep outside the database)."

    def add_arguments(self, parser):
        parser.add_argument("--tenant")
        parser.add_argument("--out", help="write the JSON here instead of stdout")

    def handle(self, *args, tenant=None, out=None, **options):
        # Refused before a checkpoint is made (each is an audit event): the tenant-less chain has
        # none (an IndexError), and a file that cannot be written lost the head just recorded.
        if tenant == NO_TENANT:
            raise CommandError(f"--tenant {NO_TENANT}: the events that matched no tenant have no checkpoint")
        if out:
            folder = Path(out).parent
            if not folder.is_dir() or not os.access(folder, os.W_OK) or Path(out).is_dir():
                raise CommandError(f"--out {out}: not a file that can be written")
        actor = Actor.system(job="audit_checkpoint")
        items = [audit_checkpoint_create(tenant=t, actor=actor).as_dict() for _, t in chains(tenant) if t is not None]
        text = json.dumps(items[0] if tenant else items, indent=2)
        if out:
            Path(out).write_text(text + "\n")
            self.stderr.write(f"wrote {len(items)} checkpoint(s) to {out}")
        else:
            self.stdout.write(text)
