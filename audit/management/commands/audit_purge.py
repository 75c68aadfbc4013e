"""``python manage.py audit_purge [--tenant SLUG]``: the retention purge, by hand.

Deletes audit events older than each tenant's retention (whole sealed batches, after a
purge checkpoint) and records an ``audit.purge`` event; the remaining chain still verifies.
Without ``--tenant``, on PostgreSQL, it first drops the whole months past every chain's
retention, as the scheduled purge does (``audit_partitions_drop``).
"""

from django.core.management.base import BaseCommand

from audit.services import audit_partitions_drop, audit_purge

from ._tenants import chains


class Command(BaseCommand):
    help = "Purge audit events older than each tenant's audit retention."

    def add_arguments(self, parser):
        parser.add_argument("--tenant")

    def handle(self, *args, tenant=None, **options):
        if tenant is None:
            for name in audit_partitions_drop():
                self.stdout.write(f"dropped {name}")
        for label, t in chains(tenant):  # (t is None: the tenant-less events)
            result = audit_purge(tenant=t)
            self.stdout.write(f"{label}: {result['events']} events in {result['seals']} seals purged")
