"""Time the admin console's busiest pages on a large tenant (PostgreSQL).

Run it against a throw-away database, e.g.::

    createdb zm_adminbench
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/zm_adminbench python manage.py migrate
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/zm_adminbench python manage.py bench_admin

A new tenant (``adminbench-<random>``) gets ``--events`` audit events, ``--memories``
memories and ``--trashed`` memories in the trash, bulk-inserted with ``generate_series``
(audit events are append-only, so they stay);
a staff user with the ``admin`` role then opens each page ``--repeat`` times through Django's
test client (no network), and the command prints the median and the fastest time per page.
The figures show what the capped count (no full ``COUNT(*)``) and the tenant-leading indexes
buy on a table of millions of rows.
"""

from __future__ import annotations

import secrets
import statistics
import time

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client

from memories import services
from memories.models import Tenant
from zeromem.bench.options import BenchCommand
from zeromem.kernel.actors import Actor

PAGES = (
    "/admin/audit/auditevent/",
    "/admin/audit/auditevent/?p=50",
    "/admin/audit/auditevent/?since={today}",
    "/admin/audit/auditevent/?key_prefix=user:u123:",
    # One of 199 actors (fixed-width labels: no label is a prefix of another) and one action:
    # 1 row in 995 matches, not every row.
    "/admin/audit/auditevent/?actor=zm_b007&action=memory.write",
    # No event matches: the windows' cost (each page reads 10,000 events, see audit.selectors).
    "/admin/audit/auditevent/?outcome=denied",
    "/admin/memories/memory/",
    "/admin/memories/memory/?prefix=user:",
    "/admin/memories/memory/?q=u4242",
    "/admin/memories/memory/?state=trash",
    "/admin/memories/forgetrequest/",
    "/admin/memories/tenant/{tenant}/dashboard/",
)


class Command(BenchCommand):
    help = "Time admin pages on a tenant with many audit events and memories (PostgreSQL, throw-away DB)."

    postgresql_needed = "bench_admin needs PostgreSQL (set DATABASE_URL to a throw-away database)"

    def add_bench_arguments(self, parser):
        parser.add_argument("--events", type=int, default=1_000_000)
        parser.add_argument("--memories", type=int, default=200_000)
        parser.add_argument("--trashed", type=int, default=200_000)
        parser.add_argument("--repeat", type=int, default=5)

    def handle(self, *args, events: int, memories: int, trashed: int, repeat: int, **options):
        self.require_postgresql()
        slug = f"adminbench-{secrets.token_hex(3)}"
        tenant = Tenant.objects.create(slug=slug, name=slug)
        started = time.perf_counter()
        with connection.cursor() as cursor:
            # Spread over the last 12 days, 50,000 subjects and 199 keys (actors; 199 is prime to
            # the 5 of the write rate), as an agent fleet would write them.
            cursor.execute(
                """INSERT INTO audit_auditevent (uid, tenant_id, occurred_at, actor_kind, actor_id, actor_label,
                       surface, action, target, subject, outcome, request_id, detail, digest, chain, redacted)
                   SELECT md5(%s || g::text)::uuid, %s, now() - (g * 1.0 || ' seconds')::interval, 'api_key',
                       (g %% 199)::text, 'zm_b' || lpad((g %% 199)::text, 3, '0'), 'tool',
                       CASE WHEN g %% 5 = 0 THEN 'memory.write' ELSE 'memory.read' END,
                       'user:u' || (g %% 50000) || ':k', 'u' || (g %% 50000), 'ok', '', '{}',
                       md5(g::text) || md5(g::text), '', '{}'
                   FROM generate_series(1, %s) g""",
                [slug, tenant.pk, events],
            )
            cursor.execute(
                """INSERT INTO memories_memory (tenant_id, key, namespace, value, search_text, category, subject,
                       tags, importance, source, version, created_at, updated_at, access_count, sources, sensitive)
                   SELECT %s, 'user:u' || g || ':pref', 'user:u' || g, '"a value"', 'user u' || g || ' pref a value',
                       'user', 'u' || g, '[]', 5, '', 1, now(), now(), 0, '[]', false
                   FROM generate_series(1, %s) g""",
                [tenant.pk, memories],
            )
            cursor.execute(
                """INSERT INTO memories_memory (tenant_id, key, namespace, value, search_text, category, subject,
                       tags, importance, source, version, created_at, updated_at, access_count, sources, sensitive,
                       deleted_at)
                   SELECT %s, 'trash:t' || g || ':old', 'trash:t' || g, '"a value"', 'trash t' || g || ' old',
                       'user', 'u' || g, '[]', 5, '', 1, now(), now(), 0, '[]', false,
                       now() - (g %% 1000) * interval '1 minute'
                   FROM generate_series(1, %s) g""",
                [tenant.pk, trashed],
            )
            cursor.execute("ANALYZE audit_auditevent")
            cursor.execute("ANALYZE memories_memory")
        self.stdout.write(
            f"tenant {slug}: {events:,} audit events, {memories:,} memories, {trashed:,} in the trash inserted in "
            f"{time.perf_counter() - started:.1f} s"
        )
        user = get_user_model().objects.create_user(username=f"{slug}-admin", password=None)
        services.membership_set(
            tenant=tenant, actor=Actor.system(job="bench_admin"), username=user.username, role="admin"
        )
        settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
        client = Client()
        client.force_login(user)
        today = time.strftime("%Y-%m-%d")
        self.stdout.write(f"{'page':60s} {'median':>10s} {'fastest':>10s}")
        for template in PAGES:
            path = template.format(today=today, tenant=tenant.pk)
            times = []
            for _ in range(max(1, repeat)):
                t0 = time.perf_counter()
                response = client.get(path)
                times.append((time.perf_counter() - t0) * 1000)
                if response.status_code != 200:
                    raise CommandError(f"{path} answered {response.status_code}")
            self.stdout.write(f"{path:60s} {statistics.median(times):8.1f} ms {min(times):8.1f} ms")
