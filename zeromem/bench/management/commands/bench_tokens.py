"""``python manage.py bench_tokens``: what "cost you can see" costs, side by side in one run.

In-process (no server), against the configured database; a new tenant (``tokenbench-<random>``)
gets ``--memories`` memories, ``--reads`` audited agent reads and 14 days of token counters.
Then, interleaved in a fresh random order each iteration (harness.interleaved_samples):

* ``estimate_small`` / ``estimate_cjk``: ``cost_of`` on a typical memory_read result (~150
  bytes, ASCII) and on a 4 KB result of CJK text — what each tool response adds for its
  ``ZeroMem-Result-Tokens`` header;
* ``record``: ``usage.result_returned`` without a flush — what each response adds for the
  daily sum (a dict update under a lock; no query);
* ``flush``: ``usage.flush`` of one pending (tenant, day) — the one UPSERT a process sends
  per ``ZEROMEM_USAGE_FLUSH_SECONDS``;
* ``tool_read``: a whole audited ``memory_read`` tool call through the test client (API key,
  service, audit INSERT, rendering, the cost headers), for scale;
* ``dash_returned`` / ``dash_saved``: the dashboard's read of tokens returned per day (one
  indexed query on the daily counters) beside its existing estimate of tokens saved.
"""

from __future__ import annotations

import json
import random
import secrets
import time
from datetime import timedelta

from django.conf import settings
from django.test import Client
from django.utils import timezone

from memories import services
from memories.models import TokenUsageDay
from memories.selectors import dashboard
from memories.services import usage
from zeromem.bench.harness import interleaved_samples, loadavg
from zeromem.bench.options import BenchCommand
from zeromem.kernel.actors import Actor
from zeromem.kernel.scopes import DEFAULT_AGENT_SCOPES
from zeromem.kernel.tokens import cost_of

ACTOR = Actor.system(job="bench_tokens")


class Command(BenchCommand):
    help = "Cost of the result-token headers, the daily counters and the dashboard's read of them, side by side."
    shared_options = ("json", "seed", "n")
    option_defaults = {"n": 500}

    def add_bench_arguments(self, parser):
        parser.add_argument("--memories", type=int, default=200, help="memories of the bench tenant (%(default)s)")
        parser.add_argument("--reads", type=int, default=2000, help="audited agent reads seeded (%(default)s)")

    def handle(self, *args, **o):
        rng = random.Random(o["seed"])
        tenant = services.tenant_create(actor=ACTOR, slug=f"tokenbench-{secrets.token_hex(4)}", name="token bench")
        _, raw = services.api_key_create(
            tenant=tenant, actor=ACTOR, name="bench", scopes=[str(s) for s in DEFAULT_AGENT_SCOPES]
        )
        self.log(f"seeding {o['memories']} memories, {o['reads']} reads, 14 days of counters ...")
        for i in range(o["memories"]):
            services.memory_write(tenant=tenant, actor=ACTOR, key=f"user:u{i % 20}:k{i}", value=f"value {i} " * 8)
        agent = Actor(kind="api_key", id="bench", label="bench", scopes=frozenset(DEFAULT_AGENT_SCOPES))
        for i in range(o["reads"]):
            services.memory_read(tenant=tenant, actor=agent, key=f"user:u{i % 20}:k{i % o['memories']}")
        today = timezone.now().date()
        TokenUsageDay.objects.bulk_create(
            TokenUsageDay(tenant=tenant, day=today - timedelta(days=d), results=100, bytes=40_000, tokens=10_000)
            for d in range(1, 14)
        )
        small = json.dumps({"status": "ok", "key": "user:u1:k1", "value": "value 1 " * 8, "version": 1}).encode()
        cjk = json.dumps({"status": "ok", "key": "user:u1:k1", "value": "记忆" * 680}, ensure_ascii=False).encode()
        days = [today - timedelta(days=d) for d in range(13, -1, -1)]
        client = Client()
        headers = {"Authorization": f"Bearer {raw}"}
        call = json.dumps({"name": "memory_read", "arguments": {"key": "user:u1:k1"}})
        saved_interval = settings.ZEROMEM_USAGE_FLUSH_SECONDS
        settings.ZEROMEM_USAGE_FLUSH_SECONDS = 3600  # the tool calls record; the flush op writes

        def timed(fn):
            def op(_i):
                start = time.perf_counter_ns()
                fn()
                return True, time.perf_counter_ns() - start

            return op

        def tool_read():
            r = client.post("/api/v1/tools/call", call, content_type="application/json", headers=headers)
            assert r.status_code == 200 and "ZeroMem-Result-Tokens" in r, r.content

        def flush():
            usage.result_returned(tenant_id=tenant.pk, size=150, tokens=40)
            usage.flush()

        ops = {
            "estimate_small": (f"cost_of, {len(small)} B ASCII result", timed(lambda: cost_of(small))),
            "estimate_cjk": (f"cost_of, {len(cjk)} B CJK result", timed(lambda: cost_of(cjk))),
            "record": (
                "usage.result_returned (no flush)",
                timed(lambda: usage.result_returned(tenant_id=tenant.pk, size=150, tokens=40)),
            ),
            "flush": ("usage.flush: one UPSERT", timed(flush)),
            "tool_read": ("memory_read tool call, whole request", timed(tool_read)),
            "dash_returned": (
                "dashboard: tokens returned, 14 days",
                timed(lambda: dashboard.tokens_returned(tenant=tenant, days=days)),
            ),
            "dash_saved": (
                "dashboard: tokens saved (existing)",
                timed(lambda: dashboard.tokens_saved(tenant=tenant, now=timezone.now())),
            ),
        }
        try:
            samples = interleaved_samples(ops, iterations=o["n"], warmup=20, max_seconds=300, rng=rng, log=self.log)
        finally:
            usage.flush()
            settings.ZEROMEM_USAGE_FLUSH_SECONDS = saved_interval
        self.emit(
            {
                "database": str(settings.DATABASES["default"]["ENGINE"]).rsplit(".", 1)[-1],
                "loadavg": loadavg(),
                "results": {name: s.summary() for name, s in samples.items()},
            }
        )

    def print_table(self, result: dict) -> None:
        self.stdout.write(f"bench_tokens on {result['database']}, load average {result['loadavg']}")
        self.stdout.write(f"{'operation':<16}{'what':<40}{'n':>6}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}")
        for name, s in result["results"].items():
            self.stdout.write(
                f"{name:<16}{s['what']:<40}{s['n']:>6}{s['p50_ms']:>10.4f}{s['p95_ms']:>10.4f}{s['p99_ms']:>10.4f}"
            )
