"""``python manage.py bench_read_cpu``: the Python CPU of one authenticated, audited read, layer
by layer, side by side in one run (GitHub-style issue 11, "a cheap hot path").

In process, no HTTP: the API key is verified once (``verify_api_key``, as a request's
authentication does) and its actor used for every call. Per call, the wall time
(``perf_counter_ns``) and the CPU time of this thread (``thread_time_ns``: Python and the
driver, not PostgreSQL's backend) of:

* ``tool_read``: ``memories.tools.tool_call`` of ``memory_read`` — the parsing, the service,
  the answer (what the fast lane for tool calls runs under it);
* ``service``: ``memories.services.memory_read`` alone (the SELECT, the audit INSERT);
* ``audit``: ``audit.services.audit_record`` alone (the digest, the INSERT);
* ``digest``: ``audit.chain.digest`` of one event's fields (no database);
* ``raw_select``: the same live-memory SELECT on one driver cursor kept for it, prepared,
  nothing built from its row — the floor.

``--rounds`` rounds (3); in each, every operation runs once per iteration in a fresh random
order (harness.interleaved_samples), so machine noise hits them alike. Each round's wall p50
and CPU per call (mean) are printed, then the median of the rounds.

``--tenant``/``--key``: an existing tenant and a raw key of it (``create_tenant``,
``create_api_key --json``); without them a tenant ``bench-rcpu-<hex>`` and a key are made.
The memory read is written once (``--key-name``). Audit rows stay (they are append-only):
run it against a benchmark database.
"""

from __future__ import annotations

import random
import secrets
import statistics
import time
import uuid

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection
from django.utils import timezone

from audit import chain
from audit.services import audit_record
from memories import services, tools
from memories.models import Tenant
from memories.selectors import _plan
from memories.services.api_keys import key_actor, verify_api_key
from zeromem.bench.harness import interleaved_samples, loadavg
from zeromem.bench.options import BenchCommand
from zeromem.kernel import hotsql
from zeromem.kernel.actors import Actor
from zeromem.kernel.scopes import DEFAULT_AGENT_SCOPES

SYSTEM = Actor.system(job="bench_read_cpu")
OPS = ("tool_read", "service", "audit", "digest", "raw_select")


class Command(BenchCommand):
    help = "Python CPU of an audited read, layer by layer (tool call, service, audit_record, digest, raw SELECT)."
    shared_options = ("json", "seed", "n")
    option_defaults = {"n": 2000}

    def add_bench_arguments(self, parser):
        parser.add_argument("--rounds", type=int, default=3, help="rounds, each of --n iterations (%(default)s)")
        parser.add_argument("--tenant", default="", help="slug of an existing tenant (with --key)")
        parser.add_argument("--key", default="", help="a raw API key of that tenant (create_api_key --json)")
        parser.add_argument("--key-name", default="user:u10086:pref_lang", help="the memory read (%(default)s)")
        parser.add_argument("--client-ip", default="203.0.113.7", help="the actor's client address (%(default)s)")

    def handle(self, *args, **o):
        rng = random.Random(o["seed"])
        if connection.queries_logged:
            raise CommandError("statements are being logged (DEBUG): run with DEBUG=false")
        if bool(o["tenant"]) != bool(o["key"]):
            raise CommandError("--tenant and --key go together")
        if o["tenant"]:
            tenant = Tenant.objects.get(slug=o["tenant"])
            raw = o["key"]
        else:
            tenant = services.tenant_create(actor=SYSTEM, slug=f"bench-rcpu-{secrets.token_hex(3)}")
            _, raw = services.api_key_create(
                tenant=tenant, actor=SYSTEM, name="bench", scopes=[str(s) for s in DEFAULT_AGENT_SCOPES]
            )
        api_key = verify_api_key(raw, route="bench", surface="tool", client_ip=o["client_ip"])
        if api_key.tenant_id != tenant.pk:
            raise CommandError("--key is not a key of --tenant")
        actor = key_actor(api_key, surface="tool", request_id=uuid.uuid4().hex, client_ip=o["client_ip"])
        key = o["key_name"]
        services.memory_write(tenant=tenant, actor=SYSTEM, key=key, value={"text": "prefers concise answers, in zh"})
        call = {"name": "memory_read", "arguments": {"key": key}}
        answer = tools.tool_call(tenant=tenant, actor=actor, call=call)
        if answer.result.get("status") != "ok":
            raise CommandError(f"memory_read answered {answer.result}")
        memory = services.memory_read(tenant=tenant, actor=actor, key=key).memory

        plan = _plan("live_by_key", connection.vendor)
        fields = {
            "uid": uuid.uuid4(),
            "tenant_id": tenant.pk,
            "occurred_at": timezone.now(),
            "actor_kind": actor.kind,
            "actor_id": actor.id,
            "actor_label": actor.label,
            "surface": actor.surface,
            "action": "memory.read",
            "target": key,
            "subject": memory.subject,
            "outcome": "ok",
            "request_id": actor.request_id,
            "client_ip": o["client_ip"],
            "count": None,
            "version": memory.version,
            "detail": {},
            "actor_filter": "",
        }

        floor_cursor: dict = {}

        def raw_select():
            # The statement memory_get_live runs, on one driver cursor kept for it (prepared on
            # PostgreSQL), the row fetched and nothing built from it: the least Python can do.
            values = {"tenant": tenant.pk, "key": key, "now": timezone.now()}
            connection.ensure_connection()
            conn = connection.connection
            prepared = getattr(conn, "prepare_threshold", None) is not None
            cur = floor_cursor.get("cursor")
            if cur is None or cur.connection is not conn:
                cur = floor_cursor["cursor"] = hotsql._server_bound(conn) if prepared else conn.cursor()
            cur.execute(plan.sql, [values[n] for n in plan.order], **({"prepare": True} if prepared else {}))
            if cur.fetchone() is None:
                raise CommandError("raw SELECT found no row")

        def tool_read():
            if tools.tool_call(tenant=tenant, actor=actor, call=call).result["status"] != "ok":
                raise CommandError("tool read failed")

        bodies = {
            "tool_read": ("tools.tool_call(memory_read)", tool_read),
            "service": ("services.memory_read", lambda: services.memory_read(tenant=tenant, actor=actor, key=key)),
            "audit": (
                "audit_record (digest + INSERT)",
                lambda: audit_record(
                    tenant=tenant,
                    actor=actor,
                    action="memory.read",
                    outcome="ok",
                    target=key,
                    subject=memory.subject,
                    version=memory.version,
                ),
            ),
            "digest": ("chain.digest (no database)", lambda: chain.digest(fields)),
            "raw_select": ("raw psycopg SELECT (floor)", raw_select),
        }
        cpu: dict[str, list[int]] = {name: [] for name in OPS}

        def measured(name, fn):
            def op(_i):
                c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                fn()
                t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
                cpu[name].append(c1 - c0)
                return True, t1 - t0

            return op

        rounds = []
        for r in range(o["rounds"]):
            for name in OPS:
                cpu[name] = []
            ops = {name: (bodies[name][0], measured(name, bodies[name][1])) for name in OPS}
            samples = interleaved_samples(ops, iterations=o["n"], warmup=100, max_seconds=600, rng=rng, log=self.log)
            row = {}
            for name in OPS:
                s = samples[name].summary()
                kept = cpu[name][-s["n"] :] if s["n"] else []
                row[name] = {
                    "wall_p50_ms": s["p50_ms"],
                    "cpu_ms": round(sum(kept) / len(kept) / 1e6, 4) if kept else None,
                    "cpu_p50_ms": round(statistics.median(kept) / 1e6, 4) if kept else None,
                }
            self.log(f"round {r + 1}: " + ", ".join(f"{n} {row[n]['wall_p50_ms']:.3f}" for n in OPS))
            rounds.append(row)
        median = {
            name: {
                m: round(statistics.median(row[name][m] for row in rounds), 4)
                for m in ("wall_p50_ms", "cpu_ms", "cpu_p50_ms")
            }
            for name in OPS
        }
        self.emit(
            {
                "database": connection.vendor,
                "prepared": getattr(connection.connection, "prepare_threshold", None) is not None,
                "async_read_events": settings.ZEROMEM_AUDIT_READ_EVENTS_ASYNC,
                "loadavg": loadavg(),
                "n": o["n"],
                "what": {name: bodies[name][0] for name in OPS},
                "rounds": rounds,
                "median": median,
            }
        )

    def print_table(self, result: dict) -> None:
        self.stdout.write(
            f"bench_read_cpu on {result['database']} (prepared: {result['prepared']}), n={result['n']} per round,"
            f" load average {result['loadavg']}"
        )
        head = "".join(f"{'r' + str(i + 1) + ' wall/cpu':>18}" for i in range(len(result["rounds"])))
        self.stdout.write(f"{'operation':<32}{head}{'median wall p50':>17}{'cpu/call':>10}{'x floor':>9}")
        floor = result["median"]["raw_select"]["cpu_ms"]
        for name in OPS:
            cells = "".join(f"{row[name]['wall_p50_ms']:>9.3f}/{row[name]['cpu_ms']:<8.3f}" for row in result["rounds"])
            m = result["median"][name]
            times = f"{m['cpu_ms'] / floor:>9.1f}" if floor else f"{'':>9}"
            self.stdout.write(f"{result['what'][name]:<32}{cells}{m['wall_p50_ms']:>17.3f}{m['cpu_ms']:>10.3f}{times}")
        self.stdout.write("ms; wall: p50 of the round's calls; cpu: this thread's CPU per call (mean); x floor: cpu")
