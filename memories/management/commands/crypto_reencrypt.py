"""Seal again the values that are not under their current data key (README "Encryption at rest").

``--new-data-keys`` first retires the current data keys (data key rotation): every sensitive
value is then moved to a fresh key. Batches of ``--batch`` memories, one transaction each,
with progress; killed at any point, run it again (without ``--new-data-keys``) to finish.
Audited per tenant: ``crypto.retire`` and, per batch, ``crypto.reencrypt`` with counts."""

import time

from django.core.management.base import BaseCommand, CommandError

from memories.models import Tenant
from memories.services.encryption import REENCRYPT_BATCH, reencrypt, retire_data_keys


class Command(BaseCommand):
    help = "Re-encrypt sensitive values under their current data keys, in resumable batches."

    def add_arguments(self, parser):
        parser.add_argument("--batch", type=int, default=REENCRYPT_BATCH)
        parser.add_argument("--tenant-id", type=int, default=None)
        parser.add_argument("--after-id", type=int, default=0, help="start after this memory id (resume)")
        parser.add_argument("--new-data-keys", action="store_true", help="retire the current data keys first")
        parser.add_argument("--pause", type=float, default=0.0, help="seconds to sleep between batches")

    def handle(self, *args, batch, tenant_id, after_id, new_data_keys, pause, **options):
        # Refused before anything changes: with --new-data-keys a bad --batch or --pause used to
        # retire every current data key first, then fail (or re-encrypt nothing) with no word.
        if batch < 1:
            raise CommandError(f"--batch must be at least 1, not {batch}")
        if after_id < 0:
            raise CommandError(f"--after-id must be at least 0, not {after_id}")
        if not 0 <= pause < float("inf"):
            raise CommandError(f"--pause must be a number of seconds of at least 0, not {pause}")
        if tenant_id is not None and not Tenant.objects.filter(pk=tenant_id).exists():
            raise CommandError(f"--tenant-id: no tenant {tenant_id}")
        if new_data_keys:
            n = retire_data_keys(tenant_id=tenant_id)
            self.stdout.write(f"retired {n} data key(s)")

        def report(p):
            self.stdout.write(
                f"batch {p.batches}: scanned {p.scanned}, re-encrypted {p.memories} memories and "
                f"{p.versions} versions, through memory id {p.last_id}"
            )
            self.stdout.flush()
            if pause:
                time.sleep(pause)

        done = reencrypt(tenant_id=tenant_id, batch=batch, after_id=after_id, progress=report)
        self.stdout.write(
            f"done: scanned {done.scanned}, re-encrypted {done.memories} memories and {done.versions} versions"
        )
