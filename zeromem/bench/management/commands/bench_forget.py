"""``python manage.py bench_forget``: how long a forget request takes, from its 202 to
completed, for a subject with 10k memories (DESIGN "Quality bars": ≤ 10 s). PostgreSQL only.

1. Seeds a throw-away tenant (``forgetbench-<random>``): ``--memories`` memories of one
   subject, each with ``--versions`` versions, a summary derived from some of them, and as
   many memories of other subjects (which must survive), by ``bulk_create``; and the
   subject's audit history as the services write it (``--events`` per memory: its write by
   the app's key and reads by the end user from their own address), which the forget must
   redact.
2. ``POST /api/v1/forget-requests {"subject": ...}`` through the whole Django/DRF stack
   (in-process test client, no socket): the request is stored, committed and enqueued on
   the ORM broker; the clock starts before the POST.
3. Picks the queue entry the POST left up from the ORM broker (dequeue, unsign), runs its
   task in this process as a django-q2 worker would, acknowledges it, and stops the clock
   when the request reads ``completed``.

Prints the seed, the 202 latency, the time to completed, the throughput and the receipt
(``--json``: one JSON object). The tenant and its audit events stay (audit rows are
append-only); the bench key is revoked. Use a throw-away database, e.g.::

    createdb -h 127.0.0.1 -U postgres zeromem_forgetbench
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/zeromem_forgetbench \\
        ZEROMEM_ENV=development python manage.py migrate
    DATABASE_URL=... ZEROMEM_ENV=development python manage.py bench_forget
"""

from __future__ import annotations

import json
import secrets
import time

from django.core.management.base import CommandError
from django.db import transaction
from django.test import Client
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.signing import SignedPackage

from audit.services import audit_record
from memories import search, services
from memories.models import ForgetRequest, Memory, MemoryVersion
from zeromem.bench.options import BenchCommand
from zeromem.kernel.actors import Actor
from zeromem.kernel.scopes import Scope

TARGET_SECONDS = 10.0
SEED_BATCH = 2000


class Command(BenchCommand):
    help = "Time a forget request of a subject with 10k memories, from its 202 to completed (PostgreSQL)."

    shared_options = ("json",)
    postgresql_needed = "bench_forget measures PostgreSQL: set DATABASE_URL=postgres://..."

    def add_bench_arguments(self, parser):
        parser.add_argument("--memories", type=int, default=10_000, help="memories of the subject (10000)")
        parser.add_argument("--versions", type=int, default=2, help="versions per memory (2)")
        parser.add_argument("--others", type=int, default=10_000, help="memories of other subjects (10000)")
        parser.add_argument("--batch-size", type=int, default=0, help="erase batch size (default: the job's)")
        parser.add_argument("--events", type=int, default=2, help="audit events of the subject per memory (2)")

    def handle(self, *args, **opts):
        self.require_postgresql()
        for name in ("memories", "versions"):
            if opts[name] < 1:
                raise CommandError(f"--{name} must be at least 1")
        system = Actor.system(job="bench_forget")
        tenant = services.tenant_create(actor=system, slug=f"forgetbench-{secrets.token_hex(4)}")
        subject = "bench-user"
        seeded = self._seed(tenant, subject, n=opts["memories"], versions=opts["versions"], others=opts["others"])
        seeded["audit_events"] = self._seed_history(tenant, subject, n=opts["memories"], per_memory=opts["events"])
        key, raw = services.api_key_create(
            tenant=tenant, actor=system, name="bench_forget", scopes=[Scope.FORGET_CREATE]
        )
        client = Client()
        batch_size = opts["batch_size"] or services.forget.ERASE_BATCH_SIZE
        try:
            started = time.perf_counter()
            response = client.post(
                "/api/v1/forget-requests",
                json.dumps({"subject": subject, "reason": "bench_forget"}),
                content_type="application/json",
                headers={"Authorization": f"Bearer {raw}"},
            )
            accepted = time.perf_counter()
            if response.status_code != 202:
                raise CommandError(f"POST answered {response.status_code}: {response.content[:300]!r}")
            # The API shows the request's uid; the queue and the service take its row id.
            request_id = ForgetRequest.objects.values_list("pk", flat=True).get(uid=response.json()["id"])
            result = self._work_the_queue(request_id, batch_size)
            finished = time.perf_counter()
        finally:
            services.api_key_revoke(tenant=tenant, actor=system, key_id=key.pk)

        if result["status"] != "completed":
            raise CommandError(
                f"the request ended {result['status']}: {ForgetRequest.objects.get(pk=request_id).error}"
            )
        left = Memory.objects.filter(tenant=tenant, subject=subject).count()
        survivors = Memory.objects.filter(tenant=tenant).exclude(subject=subject).count()
        receipt = result["receipt"]
        total = finished - started
        redacted = receipt.get("audit_events_redacted", 0)
        report = {
            "tenant": tenant.slug,
            "seeded": seeded,
            "batch_size": batch_size,
            "accepted_ms": round((accepted - started) * 1000, 1),
            "completed_s": round(total, 3),
            "memories_per_s": round((receipt["memories"] + receipt["summaries"]) / total),
            "target_s": TARGET_SECONDS,
            "meets_target": total <= TARGET_SECONDS and left == 0,
            "left_of_subject": left,
            "other_subjects_kept": survivors,
            "audit_events_redacted": redacted,
            "receipt": receipt,
        }
        self.subject, self.versions = subject, opts["versions"]
        self.emit(report)

    def print_table(self, report: dict) -> None:
        w = self.stdout.write
        seeded, receipt = report["seeded"], report["receipt"]
        w(
            f"seeded {seeded['memories']} memories of '{self.subject}' × {self.versions} versions "
            f"(+{seeded['summaries']} summary, {seeded['others']} of other subjects, "
            f"{seeded['audit_events']} audit events of the subject) in {report['tenant']}"
        )
        w(f"POST /api/v1/forget-requests → 202 in {report['accepted_ms']} ms")
        w(
            f"202 → completed: {report['completed_s']} s ({report['memories_per_s']} memories/s, "
            f"{receipt['batches']} batches of ≤{report['batch_size']}); target ≤ {TARGET_SECONDS:g} s: "
            f"{'met' if report['meets_target'] else 'MISSED'}"
        )
        w(
            f"receipt: {receipt['memories']} memories, {receipt['versions']} versions, "
            f"{receipt['summaries']} summaries, {report['audit_events_redacted']} audit events redacted; "
            f"{report['left_of_subject']} left of the subject, "
            f"{report['other_subjects_kept']} of others kept"
        )

    def _seed(self, tenant, subject: str, *, n: int, versions: int, others: int) -> dict:
        """Rows as the services write them (key, namespace, search text, versions), in bulk."""
        now = timezone.now()

        def rows(count: int, key_of, subject_of):
            for i in range(count):
                key = key_of(i)
                value = {"note": f"remembered fact number {i}", "n": i}
                yield Memory(
                    tenant=tenant,
                    key=key,
                    namespace=key.rpartition(":")[0],
                    value=value,
                    **search.index_fields(tenant_id=tenant.pk, key=key, value=value, tags=[]),
                    category=Memory.Category.USER,
                    subject=subject_of(i),
                    version=versions,
                    created_at=now,
                    updated_at=now,
                )

        def insert(memories) -> int:
            batch, count = [], 0
            for memory in memories:
                batch.append(memory)
                if len(batch) == SEED_BATCH:
                    count += self._insert(batch, versions, now)
                    batch = []
            if batch:
                count += self._insert(batch, versions, now)
            return count

        with transaction.atomic():
            mine = insert(rows(n, lambda i: f"user:{subject}:m{i:06}", lambda i: subject))
            theirs = insert(rows(others, lambda i: f"user:other{i % 100}:m{i:06}", lambda i: f"other{i % 100}"))
            summary = Memory.objects.create(
                tenant=tenant,
                key=f"summary:user:{subject}",
                namespace=f"summary:user:{subject}".rpartition(":")[0],
                value="digest of the first hundred",
                category=Memory.Category.SUMMARY,
                sources=[f"user:{subject}:m{i:06}" for i in range(100)],
            )
            MemoryVersion.objects.create(
                tenant=tenant, memory=summary, version=1, value=summary.value, op="write", actor_kind="system"
            )
        return {"memories": mine, "summaries": 1, "others": theirs}

    @staticmethod
    def _insert(batch: list[Memory], versions: int, now) -> int:
        Memory.objects.bulk_create(batch)
        MemoryVersion.objects.bulk_create(
            MemoryVersion(
                tenant_id=m.tenant_id,
                memory_id=m.pk,
                version=v,
                value=m.value,
                op=MemoryVersion.Op.WRITE if v == 1 else MemoryVersion.Op.UPDATE,
                actor_kind="system",
                actor_id="bench_forget",
                created_at=now,
                subject=m.subject,  # as the services record it (the forget's version pass finds none left)
            )
            for m in batch
            for v in range(1, versions + 1)
        )
        return len(batch)

    @staticmethod
    def _seed_history(tenant, subject: str, *, n: int, per_memory: int) -> int:
        """The subject's audit events, written one by one as the services write them: the
        app's write of each memory, then reads by the end user (actor id and address)."""
        app = Actor(kind="api_key", id="0", label="zm_benchapp", surface="api", client_ip="192.0.2.10")
        end_user = Actor(kind="end_user", id=subject, label="end user", surface="portal", client_ip="198.51.100.7")
        written = 0
        with transaction.atomic():
            for i in range(n):
                key = f"user:{subject}:m{i:06}"
                for e in range(per_memory):
                    actor, action = (app, "memory.write") if e == 0 else (end_user, "memory.read")
                    audit_record(
                        tenant=tenant, actor=actor, action=action, outcome="ok", target=key, subject=subject, version=1
                    )
                    written += 1
        return written

    @staticmethod
    def _work_the_queue(request_id: int, batch_size: int) -> dict:
        """What a django-q2 worker does with the entry the POST enqueued: take it from the
        broker, unsign it, run its function, acknowledge it — again for each continuation a
        run longer than ``forget.FORGET_SLICE_SECONDS`` enqueued. Returns the request's result."""
        name = f"forget-request-{request_id}"
        broker = get_broker()
        polls_without_it = 0
        while polls_without_it < 100:
            polls_without_it += 1
            for ack_id, payload in broker.dequeue() or []:
                task = SignedPackage.loads(payload)
                if task["name"] != name:
                    continue
                if task["func"] != services.forget.TASK or task["args"] != (request_id,):
                    raise CommandError(f"unexpected queue entry {task['func']}{task['args']}")
                polls_without_it = 0
                # The task runs a turn (services.turns), here always this request's step: this
                # call, with the bench's --batch-size passed on.
                services.forget_request_execute(request_id=request_id, batch_size=batch_size)
                broker.acknowledge(ack_id)
                request = ForgetRequest.objects.get(pk=request_id)
                if request.status == ForgetRequest.Status.RUNNING:
                    continue  # its slice ended: the continuation is in the queue
                return {"status": request.status, "receipt": request.receipt}
        raise CommandError(f"{name} never reached the queue")
