"""``python manage.py search_reindex [--tenant SLUG] [--stats-only] [--batch N]``

Rewrites the search columns (``search_text``, and ``search_tsv`` on PostgreSQL) of every
memory — or one tenant's — in batches of ``--batch`` rows, each its own short transaction
(no table lock), then recounts the term statistics. Idempotent: run it after an upgrade
whose tokenizer changed, or to redo a tenant's backfill. ``--stats-only``
recounts the statistics alone (what the ``search-stats`` schedule does for changed tenants).
"""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand, CommandError

from memories.models import Memory, Tenant
from memories.search import index


class Command(BaseCommand):
    help = "Rewrite the search index columns in batches and recount term statistics."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", help="only this tenant (slug)")
        parser.add_argument("--stats-only", action="store_true", help="recount term statistics only")
        parser.add_argument("--batch", type=int, default=index.REINDEX_BATCH, help="rows per transaction")

    def handle(self, *args, tenant, stats_only, batch, **options):
        if batch < 1:
            raise CommandError(f"--batch must be at least 1, not {batch}")
        tenants = Tenant.objects.all()
        if tenant:
            tenants = tenants.filter(slug=tenant)
            if not tenants.exists():
                raise CommandError(f"no tenant {tenant!r}")
        for t in tenants.order_by("pk"):
            started = time.monotonic()
            rows = 0 if stats_only else index.reindex(memory_model=Memory, tenant_id=t.pk, batch=batch)
            terms = index.stats_refresh(tenant_id=t.pk)
            self.stdout.write(
                f"{t.slug}: {rows} memories reindexed, {terms} terms counted ({time.monotonic() - started:.1f} s)"
            )
