"""Re-wrap every data key under the first of ``ZEROMEM_MASTER_KEYS`` (master key rotation).

Put the new master key first and keep the old one listed, run this, then drop the old key.
No value is touched: only the data key rows change (fast). Idempotent. Audited: one
``crypto.rewrap`` event per tenant and batch, with the count of its keys."""

from django.core.management.base import BaseCommand, CommandError

from memories import keyring
from memories.services.encryption import rewrap_data_keys


class Command(BaseCommand):
    help = "Re-wrap every data key under the first master key in ZEROMEM_MASTER_KEYS (no value touched)."

    def add_arguments(self, parser):
        parser.add_argument("--batch", type=int, default=500)

    def handle(self, *args, batch, **options):
        if batch < 1:
            # [:0] re-wrapped nothing and still said every key was under the new master key.
            raise CommandError(f"--batch must be at least 1, not {batch}")
        primary, _ = keyring.masters()
        done, total = rewrap_data_keys(batch=batch, progress=lambda n: self.stdout.write(f"re-wrapped {n}"))
        self.stdout.write(f"re-wrapped {done} data key(s); all {total} live data keys are under master key {primary}")
