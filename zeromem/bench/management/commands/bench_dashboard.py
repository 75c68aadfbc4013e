"""``python manage.py bench_dashboard``: the admin dashboard at 1M audit events, before and
after the daily counts (audit/daily.py), in one run (PostgreSQL, throw-away database)::

    createdb -h 127.0.0.1 -U postgres zm_dashbench
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/zm_dashbench ZEROMEM_ENV=development python manage.py migrate
    DATABASE_URL=... ZEROMEM_ENV=development python manage.py bench_dashboard

A new tenant (``dashbench-<random>``) gets ``--events`` audit events spread over the last 12
days (reads, writes, misses, denials, as an agent fleet makes them; bulk-inserted with
``generate_series``) and ``--memories`` memories. The events are sealed — timed apart from
the fold into the daily counts, which the sealing job now does as it seals. Then the
dashboard page is opened ``--repeat`` times through Django's test client, alternately:

* **before**: its per-day series and agent-read count computed from the audit log, and the
  memory aggregates from every live memory, as every page view did before;
* **after**: from the daily counts (``audit.daily.counts``) and the stored memory figures
  (``TenantDashboardStats``, recounted once here as the ``dashboard-stats`` schedule does).

With ``--figures``, no audit events: only the recount of the memory figures (the
``dashboard-stats`` schedule's work per active tenant) on ``--memories`` memories spread as a
fleet writes them (a namespace per 10 memories, 6 categories, values of 40–400 characters, 5%
with a TTL of which 1% expired, 5% in the trash), after VACUUM ANALYZE, ``--repeat`` times
alternately: the old aggregates (every live row read), the counts (index-only:
``memory_figures(chars=False)``) and the sum of sizes alone (``memory_chars``); then where the
counts' rows come from (EXPLAIN (ANALYZE, BUFFERS)).

Also printed: the hot-path alternative that was not chosen — an UPSERT of the day's counter
row in the audited request's own transaction — as the cost per ``audit_record`` with and
without it, one thread and ``--threads`` threads on one tenant (the row lock each
transaction holds to its commit).
"""

from __future__ import annotations

import re
import secrets
import statistics
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from unittest import mock

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.db.models import Count
from django.db.models.functions import TruncDate
from django.test import Client
from django.utils import timezone

from audit import daily
from audit.models import AuditDailyCount, AuditEvent
from audit.services import audit_record, audit_seal
from memories import services
from memories.models import Tenant
from memories.selectors import dashboard
from memories.services import dashboard_stats
from zeromem.bench.options import BenchCommand
from zeromem.kernel.actors import Actor

TARGET_MS = 200
AGENT = Actor(kind="api_key", id="1", label="zm_bench", scopes=frozenset(["memory:read"]), surface="tool")


def legacy_memory_figures(*, tenant: Tenant, now) -> dict:
    """The memory figures as computed before the index-only counts (the code removed from
    memories/selectors/dashboard.py): three aggregates over every live row of the tenant."""
    from django.db.models import Sum, TextField
    from django.db.models.functions import Cast, Length

    from memories.models import Memory

    live = Memory.objects.for_tenant(tenant).live(now)
    by_category = live.values_list("category").annotate(n=Count("pk")).order_by("-n", "category")[:12]
    by_namespace = live.values_list("namespace").annotate(n=Count("pk")).order_by("-n", "namespace")[:10]
    sizes = live.aggregate(
        chars=Sum(Length(Cast("value", output_field=TextField()))),
        memories=Count("pk"),
        namespaces=Count("namespace", distinct=True),
    )
    return {
        "memory_count": sizes["memories"] or 0,
        "by_category": [list(row) for row in by_category],
        "by_namespace": [list(row) for row in by_namespace],
        "chars": sizes["chars"] or 0,
        "namespaces": sizes["namespaces"] or 0,
    }


def legacy_daily(*, tenant: Tenant, now):
    """The dashboard's per-day figures as computed before the daily counts: aggregates over
    the audit log's last 14 days (the code removed from memories/selectors/dashboard.py)."""
    start_day = (now - timedelta(days=dashboard.DAYS - 1)).date()
    days = [start_day + timedelta(days=i) for i in range(dashboard.DAYS)]
    per_day = {name: {} for name in daily.METRIC_NAMES}
    rows = (
        AuditEvent.objects.for_tenant(tenant)
        .filter(occurred_at__gte=now - timedelta(days=dashboard.DAYS), action__startswith="memory.")
        .annotate(day=TruncDate("occurred_at"))
        .values_list("day", "action", "outcome")
        .annotate(n=Count("pk"))
    )
    for day, action, outcome, n in rows:
        name = None
        if outcome == AuditEvent.Outcome.DENIED:
            name = "denials"
        elif outcome == AuditEvent.Outcome.NOT_FOUND:
            name = "misses"
        elif outcome == AuditEvent.Outcome.OK and action in daily.READ_ACTIONS:
            name = "reads"
        elif outcome == AuditEvent.Outcome.OK and action in daily.WRITE_ACTIONS:
            name = "writes"
        if name:
            per_day[name][day] = per_day[name].get(day, 0) + n
    reads = (
        AuditEvent.objects.for_tenant(tenant)
        .filter(
            occurred_at__gte=now - timedelta(days=dashboard.DAYS),
            action__in=daily.AGENT_READ_ACTIONS,
            outcome=AuditEvent.Outcome.OK,
            actor_kind=AuditEvent.ActorKind.API_KEY,
        )
        .count()
    )
    per_day["agent_reads"] = {days[-1]: reads}
    return days, per_day


class Command(BenchCommand):
    help = "Time the admin dashboard at 1M audit events, from the log vs from the daily counts (PostgreSQL)."

    postgresql_needed = "bench_dashboard needs PostgreSQL (set DATABASE_URL to a throw-away database)"

    def add_bench_arguments(self, parser):
        parser.add_argument("--events", type=int, default=1_000_000)
        parser.add_argument("--memories", type=int, default=200_000)
        parser.add_argument("--repeat", type=int, default=5)
        parser.add_argument("--inserts", type=int, default=2000, help="audit_record calls per hot-path variant")
        parser.add_argument("--threads", type=int, default=4, help="threads of the contended hot-path variant")
        parser.add_argument(
            "--figures", action="store_true", help="only the memory figures' recount: old aggregates vs counts + sizes"
        )

    def handle(self, *args, events, memories, repeat, inserts, threads, figures, **options):
        self.require_postgresql()
        if min(events, repeat, inserts, threads) < 1:
            raise CommandError("--events, --repeat, --inserts and --threads must be at least 1")
        if figures:
            return self._figures(memories, repeat)
        out = self.stdout.write
        slug = f"dashbench-{secrets.token_hex(3)}"
        tenant = Tenant.objects.create(slug=slug, name=slug)
        t0 = time.perf_counter()
        self._seed(tenant, events, memories)
        seeded = time.perf_counter() - t0
        out(f"tenant {slug}: {events:,} audit events, {memories:,} memories inserted in {seeded:.1f} s")

        t0 = time.perf_counter()
        with mock.patch.object(daily, "fold", lambda tenant_id, **kw: 0):
            audit_seal(tenant_id=tenant.pk)
        sealed = time.perf_counter() - t0
        t0 = time.perf_counter()
        folded = daily.fold(tenant.pk)
        fold_s = time.perf_counter() - t0
        rows = AuditDailyCount.objects.filter(tenant=tenant).count()
        out(
            f"sealing {events:,} events: {sealed:.1f} s; folding them into the daily counts: {fold_s:.1f} s "
            f"({folded / fold_s:,.0f} events/s, +{fold_s / sealed:.0%} of sealing) → {rows} count rows"
        )
        with connection.cursor() as cursor:
            # What autovacuum does after the seeding (sealing writes no event row since audit 0011).
            cursor.execute("VACUUM ANALYZE audit_auditevent")
        t0 = time.perf_counter()
        dashboard_stats.dashboard_stats_refresh(tenant=tenant)
        out(
            f"memory figures recounted (the dashboard-stats schedule, per active tenant): "
            f"{time.perf_counter() - t0:.2f} s"
        )

        client = self._admin_client(tenant)
        path = f"/admin/memories/tenant/{tenant.pk}/dashboard/"
        timings = {"before (from the audit log)": [], "after (from the daily counts)": []}
        bodies = {}
        for _ in range(repeat):
            for name in timings:
                with self._variant(name):
                    start = time.perf_counter()
                    response = client.get(path)
                    timings[name].append((time.perf_counter() - start) * 1000)
                if response.status_code != 200:
                    raise CommandError(f"{path} answered {response.status_code}")
                body = response.content.decode()
                bodies[name] = {s: re.search(rf'class="ops-{s}">(\d+)<', body).group(1) for s in dashboard.SERIES}
        before, after = bodies.values()
        if before != after:
            raise CommandError(f"the two dashboards disagree: {before} vs {after}")
        out("")
        out(f"dashboard page at {events:,} events ({repeat} views each, alternating)   median    fastest")
        for name, samples in timings.items():
            out(f"  {name:60s} {statistics.median(samples):7.1f} ms {min(samples):7.1f} ms")
        median_after = statistics.median(timings["after (from the daily counts)"])
        verdict = "met" if median_after <= TARGET_MS else "MISSED"
        out(f"  target ≤ {TARGET_MS} ms at 1M events: {verdict}; series totals {after}")

        out("")
        out("hot-path alternative (not chosen): UPSERT the day's counter in the request's transaction")
        out(f"  {'variant':52s} {'1 thread µs/event':>18s} {f'{threads} threads µs/event':>20s}")
        for name, upsert in (("audit_record only (now)", False), ("audit_record + counter UPSERT", True)):
            one = self._inserts(tenant, inserts, 1, upsert)
            many = self._inserts(tenant, inserts, threads, upsert)
            out(f"  {name:52s} {one:18.0f} {many:20.0f}")

    def _figures(self, memories: int, repeat: int) -> None:
        out = self.stdout.write
        slug = f"figbench-{secrets.token_hex(3)}"
        tenant = Tenant.objects.create(slug=slug, name=slug)
        t0 = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.execute(
                """INSERT INTO memories_memory (tenant_id, key, namespace, value, search_text, category, subject,
                       tags, importance, source, version, created_at, updated_at, access_count, sources, sensitive,
                       expires_at, deleted_at)
                   SELECT %s, 'user:u' || (g %% %s) || ':k' || g, 'user:u' || (g %% %s),
                       to_jsonb(repeat('x', 40 + ((g::bigint * 7919) %% 360)::int)), 'user u' || g || ' a value',
                       (ARRAY['user','task','decision','fact','summary','note'])[1 + g %% 6], 'u' || (g %% %s),
                       '[]', 5, '', 1, now(), now(), 0, '[]', false,
                       CASE WHEN g %% 100 = 1 THEN now() - interval '1 hour'
                            WHEN g %% 20 = 2 THEN now() + interval '30 days' END,
                       CASE WHEN g %% 20 = 3 THEN now() - interval '1 day' END
                   FROM generate_series(1, %s) g""",
                [tenant.pk, *([max(1, memories // 10)] * 3), memories],
            )
            cursor.execute("VACUUM ANALYZE memories_memory")  # what autovacuum does after the seeding
        out(f"tenant {slug}: {memories:,} memories inserted and vacuumed in {time.perf_counter() - t0:.1f} s")

        now = timezone.now()
        variants = {
            "old: aggregates over every live row": lambda: legacy_memory_figures(tenant=tenant, now=now),
            "new: counts (index-only)": lambda: dashboard.memory_figures(tenant=tenant, now=now, chars=False),
            "new: sum of sizes alone (every few hours)": lambda: dashboard.memory_chars(tenant=tenant, now=now),
        }
        timings = {name: [] for name in variants}
        results = {}
        for _ in range(repeat):
            for name, run in variants.items():
                start = time.perf_counter()
                results[name] = run()
                timings[name].append((time.perf_counter() - start) * 1000)
        old, counts, sizes = results.values()
        new = {**counts, "chars": sizes["chars"]}
        if {k: old[k] for k in new} != new:
            raise CommandError(f"the old and new figures disagree: {old} vs {new}")
        out(f"\nmemory figures at {memories:,} memories ({repeat} runs each, alternating)   median  [range] ms")
        for name, samples in timings.items():
            out(f"  {name:52s} {statistics.median(samples):8.0f}  [{min(samples):.0f}–{max(samples):.0f}]")
        with connection.cursor() as cursor:
            cursor.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + dashboard._COUNTS_SQL, {"tenant": tenant.pk, "now": now}
            )
            plan = cursor.fetchone()[0][0]["Plan"]
        out("where the counts' rows come from (EXPLAIN ANALYZE):")
        for node in _nodes(plan):
            if node.get("Relation Name") == "memories_memory":
                out(
                    f"  {node['Node Type']:18s} {node.get('Index Name', ''):26s} "
                    f"rows {node['Actual Rows'] * node['Actual Loops']:>9,}  "
                    f"heap fetches {node.get('Heap Fetches', '-')}"
                    f"  buffers hit {node['Shared Hit Blocks']:,} read {node['Shared Read Blocks']:,}"
                )

    @contextmanager
    def _variant(self, name: str):
        if name.startswith("before"):
            no_stats = mock.Mock()
            no_stats.objects.filter.return_value.first.return_value = None
            with (
                mock.patch.object(dashboard, "_daily", legacy_daily),
                mock.patch.object(dashboard, "TenantDashboardStats", no_stats),
            ):
                yield
        else:
            yield

    @staticmethod
    def _seed(tenant, events: int, memories: int) -> None:
        with connection.cursor() as cursor:
            # Spread over the last 12 days: 70% reads, 15% writes, 10% misses, 5% denials.
            cursor.execute(
                """INSERT INTO audit_auditevent (uid, tenant_id, occurred_at, actor_kind, actor_id, actor_label,
                       surface, action, target, subject, outcome, request_id, detail, digest, chain, redacted)
                   SELECT md5(%s || g::text)::uuid, %s,
                       now() - (12 * 86400.0 * (%s - g) / %s || ' seconds')::interval, 'api_key', '1',
                       'zm_bench', 'tool',
                       CASE WHEN g %% 20 < 14 THEN 'memory.read' WHEN g %% 20 < 17 THEN 'memory.write'
                            WHEN g %% 20 < 19 THEN 'memory.read' ELSE 'memory.write' END,
                       'user:u' || (g %% 50000) || ':k', 'u' || (g %% 50000),
                       CASE WHEN g %% 20 < 17 THEN 'ok' WHEN g %% 20 < 19 THEN 'not_found' ELSE 'denied' END,
                       '', '{}', md5(g::text) || md5(g::text), '', '{}'
                   FROM generate_series(1, %s) g""",
                [tenant.slug, tenant.pk, events, events, events],
            )
            cursor.execute(
                """INSERT INTO memories_memory (tenant_id, key, namespace, value, search_text, category, subject,
                       tags, importance, source, version, created_at, updated_at, access_count, sources, sensitive)
                   SELECT %s, 'user:u' || g || ':pref', 'user:u' || g, '"a value"', 'user u' || g || ' pref a value',
                       'user', 'u' || g, '[]', 5, '', 1, now(), now(), 0, '[]', false
                   FROM generate_series(1, %s) g""",
                [tenant.pk, memories],
            )
            cursor.execute("ANALYZE audit_auditevent")
            cursor.execute("ANALYZE memories_memory")

    @staticmethod
    def _admin_client(tenant) -> Client:
        user = get_user_model().objects.create_user(username=f"{tenant.slug}-admin", password=None)
        services.membership_set(
            tenant=tenant, actor=Actor.system(job="bench_dashboard"), username=user.username, role="admin"
        )
        settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
        client = Client()
        client.force_login(user)
        return client

    @staticmethod
    def _inserts(tenant, n: int, threads: int, upsert: bool) -> float:
        """Wall time per audited insert (each its own transaction), µs."""
        table = AuditDailyCount._meta.db_table
        sql = (
            f"INSERT INTO {table} (tenant_id, day, metric, value) VALUES (%s, %s, 'bench', 1) "  # nosec B608
            f"ON CONFLICT (tenant_id, day, metric) DO UPDATE SET value = {table}.value + 1"  # nosec B608
        )

        def work(count: int) -> None:
            try:
                for _ in range(count):
                    with transaction.atomic():
                        audit_record(tenant=tenant, actor=AGENT, action="memory.read", outcome="ok")
                        if upsert:
                            with connection.cursor() as cursor:
                                cursor.execute(sql, [tenant.pk, timezone.now().date()])
            finally:
                connection.close()

        per = max(1, n // threads)
        workers = [threading.Thread(target=work, args=(per,)) for _ in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return (time.perf_counter() - start) / (per * threads) * 1e6


def _nodes(node):
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)
