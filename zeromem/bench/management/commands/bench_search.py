"""Search at scale, over HTTP, on PostgreSQL: one tenant at 10k, 100k and 1M memories.

    python manage.py bench_search [--sizes 10000,100000,1000000] [--others 100000] [--n 200]
                                  [--worst-n 10] [--parallel 20] [--seconds 10] [--rebuild]
                                  [--real-vectors 20000] [--attack-modes processes,threads] [--json]

For each size, a tenant ``bench-search-<size>`` holds that many synthetic memories (Zipfian
English words — the standard library's vocabulary — and, in one row of five, Chinese
two-character words; keys like
``task:u4711:deadline``; 0-3 tags), and a tenant ``bench-search-other`` holds ``--others``
more. Rows are written with COPY, their search columns made by the same code a write uses
(memories.search.index_fields), then the term statistics are refreshed; a tenant that
already has its rows is reused (``--rebuild`` builds it again). The GIN index is dropped
during a first big load and built again after it (a bench database only: it is a few
minutes faster than maintaining it row by row). Each searched tenant's memories get
embeddings as the embedding job would leave them: the newest ``--real-vectors`` (20k, the
search cache's size) from the model, the older ones random stand-in vectors (same size and
storage; encoding 1M texts would take hours), so that a search pays the semantic part.

Then, against the README's production server (``python3 -m zeromem serve``, with the
environment's settings: the search CPU budget among them), after a warm-up (each server
process loads the model and builds the tenant's vector cache in the background):

* realistic: ``--n`` questions made from 3-6 words of a random memory of the tenant (its key
  name and value words, with question words around them), p50/p95/p99 over HTTP; a 429
  ``search_budget`` is waited out (Retry-After) and counted, only the answered attempt timed;
* worst cases, each ``--worst-n`` times: ``ab``, 160 two-letter words, a 500-character
  paragraph, one CJK character, emoji only, stop words only — p50/max and the statuses
  (200, or 503 ``search_timeout``; never a 500);
* another tenant's key reading one memory in a loop for ``--seconds`` per phase: idle; beside
  a CPU hog (a process spinning on one core, nothing to do with ZeroMem: the machine's floor);
  and while ``--parallel`` clients send worst cases (and a few realistic questions) back to
  back — waiting a 429's or 503's Retry-After as a well-behaved client does, unless
  ``--ignore-retry-after``. The reader and the searchers are client processes of their own
  (``processes``), and once more all threads of this process (``threads``: the old
  measurement, where the reader also waited for this process's own GIL). Printed: the
  reader's p50/p99, its p99 against the idle one, its errors (a 503 counts), the server's CPU,
  the load average, and what the searchers got.

Use a database of its own (e.g. ``DATABASE_URL=postgres://…/zm_bench_search``): at 1M the
data takes ~2.5 GB and about 15 minutes to build on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import random
import time
from itertools import accumulate

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection
from django.utils import timezone

from memories import services
from memories.models import ApiKey, Memory, MemoryEmbedding, Tenant
from memories.search import index as search_index
from memories.search.text import STOPWORDS, stem
from zeromem.bench import contention
from zeromem.bench.harness import HttpClient, Samples, loadavg, proc_cpu_seconds, ratio
from zeromem.bench.options import BenchCommand
from zeromem.bench.server import running_server
from zeromem.kernel.actors import Actor

TOOL_CALL = "/api/v1/tools/call"
NAMESPACES = ["user", "task", "fact", "agent", "session", "project"]
EMOJI = "😀🎉🚀🔥👍🙏💡📌"
PARAGRAPH = (
    "Yesterday the team reviewed the quarterly planning document and agreed that the billing "
    "service migration should happen before the holidays, provided that the monitoring dashboards "
    "are ready, the on-call rotation is staffed, and the customers who depend on invoices at month "
    "end are told in advance; the database upgrade, the new search index and the archive cleanup "
    "will follow in January, after the freeze, when the load is lower and people are back from leave"
)[:500]


def _vocabulary(rng: random.Random) -> tuple[list[str], list[str], list[str]]:
    """(English terms, key names, Chinese two-character words). The English words are those
    of the standard library's source (comments, docstrings, names), as stems: tens of
    thousands of them, so that a rare word is as rare as in real text."""
    import os
    import re

    word_re = re.compile(r"[a-z]{3,14}")
    seen: set[str] = set()
    root = os.path.dirname(os.__file__)
    for folder, _dirs, files in os.walk(root):
        if "site-packages" in folder or "test" in folder:
            continue
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8", errors="ignore") as f:
                    seen.update(word_re.findall(f.read().lower()))
    words = sorted({stem(w) for w in seen if w not in STOPWORDS})
    words = [w for w in words if len(w) >= 3]
    rng.shuffle(words)
    names = [f"{a}_{b}" for a, b in zip(words[:300], words[300:600], strict=True)]
    common = [chr(c) for c in range(0x4E00, 0x4E00 + 2500)]
    cjk = sorted({rng.choice(common) + rng.choice(common) for _ in range(20000)})
    return words, names, cjk


class Command(BenchCommand):
    help = "Search latency over HTTP at 10k/100k/1M memories in one tenant: realistic and worst cases."
    shared_options = ("json", "seed", "processes", "threads")
    postgresql_needed = "bench_search measures PostgreSQL: run it with DATABASE_URL set to a database of its own"

    def add_bench_arguments(self, parser):
        parser.add_argument("--sizes", default="10000,100000,1000000", help="tenant sizes (%(default)s)")
        parser.add_argument("--others", type=int, default=100000, help="memories of another tenant (%(default)s)")
        parser.add_argument("--n", type=int, default=200, help="realistic questions per size (%(default)s)")
        parser.add_argument("--worst-n", type=int, default=10, help="runs of each worst case (%(default)s)")
        parser.add_argument("--parallel", type=int, default=20, help="parallel worst-case clients (%(default)s)")
        parser.add_argument("--seconds", type=float, default=10.0, help="length of the parallel phase (%(default)s)")
        parser.add_argument("--rebuild", action="store_true", help="rebuild the tenants' data")
        parser.add_argument(
            "--real-vectors",
            type=int,
            default=20000,
            help="embeddings from the model for each searched tenant's newest memories, random stand-ins for "
            "the older ones (%(default)s: the search cache's size); -1: no embeddings at all (words only)",
        )
        parser.add_argument("--build-only", action="store_true", help="build the tenants' data, measure nothing")
        parser.add_argument(
            "--fairness-only",
            action="store_true",
            help="after the warm-up, only the phases of another tenant's reads (idle, CPU hog, attack)",
        )
        parser.add_argument(
            "--attack-modes",
            default="processes,threads",
            help="how the parallel phase's clients run: processes (the reader and the searchers each a "
            "process of their own, as different clients are), threads (all in this process, the "
            "old measurement, which adds this process's own GIL waits to the reader's latency) and/or "
            "split (as processes, but the searchers sent to a second server instance on the same "
            "database: what is left when no server process serves both tenants) (%(default)s)",
        )
        parser.add_argument(
            "--ignore-retry-after",
            action="store_true",
            help="parallel clients retry a 503 at once instead of waiting its Retry-After",
        )

    def handle(
        self,
        *args,
        sizes,
        others,
        n,
        worst_n,
        parallel,
        seconds,
        rebuild,
        build_only,
        fairness_only,
        ignore_retry_after,
        attack_modes,
        real_vectors,
        seed,
        processes,
        threads,
        **options,
    ):
        self.require_postgresql()
        self.ignore_retry_after = ignore_retry_after
        self.fairness_only = fairness_only
        self.attack_modes = [m.strip() for m in attack_modes.split(",") if m.strip()]
        if not set(self.attack_modes) <= {"processes", "threads", "split"}:
            raise CommandError("--attack-modes: processes, threads and/or split")
        rng = random.Random(seed)
        self.real_vectors = None
        self.vocab = _vocabulary(rng)
        sizes = [int(s) for s in sizes.split(",") if s.strip()]
        other, other_key = self._tenant("bench-search-other", others, rebuild, rng)
        report = {
            "sizes": {},
            "processes": processes,
            "threads": threads,
            "others": others,
            # What the server runs with (it reads the same environment).
            "search_cpu_ms_per_second": settings.ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND,
            "search_cpu_burst_ms": settings.ZEROMEM_TENANT_SEARCH_CPU_BURST_MS,
            "tenant_slots": settings.ZEROMEM_TENANT_MAX_CONCURRENT,
            "real_vectors": real_vectors,
            "load_at_start": loadavg(),
        }
        self.real_vectors = real_vectors if real_vectors >= 0 else None
        tenants = {size: self._tenant(f"bench-search-{size}", size, rebuild, rng) for size in sizes}
        if build_only:
            return
        reader_key = other_key
        read_key = Memory.objects.filter(tenant=other).values_list("key", flat=True).first()
        url = _database_url()
        # Fresh planner statistics first: a table whose statistics predate its rows (a server
        # with autovacuum off, a bulk load) makes PostgreSQL hydrate the ranked ids by scanning
        # the tenant (measured: 53 ms instead of 0.1 ms at 50k) — a figure of the database's
        # upkeep, not of search. `check --deploy --database default` warns when autovacuum is off.
        self.log("ANALYZE memories_memory, memories_memoryembedding")
        with connection.cursor() as c:
            c.execute("ANALYZE memories_memory")
            c.execute("ANALYZE memories_memoryembedding")
        start = functools.partial(
            running_server, stderr=self.stderr, database_url=url, processes=processes, threads=threads, log=self.log
        )
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(start())
            port = server["port"]
            self.server_workers = server["workers"]
            self.split_port = None
            if "split" in self.attack_modes:  # a second instance, same settings and database
                second = stack.enter_context(start())
                self.split_port = second["port"]
                self.server_workers = self.server_workers + second["workers"]
            for size, (tenant, raw_key) in tenants.items():
                self.log(f"size {size}: measuring")
                report["sizes"][size] = self._measure(
                    port, tenant, raw_key, reader_key, read_key, rng, n, worst_n, parallel, seconds
                )
        report["load_at_end"] = loadavg()
        self.emit(report)

    # --- data -----------------------------------------------------------------------------

    def _tenant(self, slug: str, size: int, rebuild: bool, rng: random.Random) -> tuple[Tenant, str]:
        actor = Actor.system(job="bench_search")
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            tenant = services.tenant_create(actor=actor, slug=slug, name=slug)
        have = Memory.objects.filter(tenant=tenant).count()
        if rebuild or have != size:
            with connection.cursor() as c:
                c.execute("DELETE FROM memories_memory WHERE tenant_id = %s", [tenant.pk])
            self._load(tenant, size, rng)
            self.log(f"{slug}: refreshing term statistics")
            search_index.stats_refresh(tenant_id=tenant.pk)
        embedded = MemoryEmbedding.objects.filter(tenant=tenant)
        if self.real_vectors is not None and embedded.count() != size:
            self._seed_embeddings(tenant, size)
        elif self.real_vectors is None and slug != "bench-search-other":
            embedded.delete()  # --real-vectors -1: words only
        ApiKey.objects.filter(tenant=tenant, name="bench_search").delete()
        _key, raw = services.api_key_create(tenant=tenant, actor=actor, name="bench_search")
        return tenant, raw

    def _load(self, tenant: Tenant, size: int, rng: random.Random) -> None:
        words, names, cjk = self.vocab
        cum_w = list(accumulate(1 / (i + 1) for i in range(len(words))))
        cum_c = list(accumulate(1 / (i + 1) for i in range(len(cjk))))
        big = size >= 200_000
        started = time.monotonic()
        with connection.cursor() as c:
            if big:
                c.execute("DROP INDEX IF EXISTS memory_search_tsv")
        batch = 20_000
        for start in range(0, size, batch):
            buf = io.StringIO()
            for i in range(start, min(start + batch, size)):
                key = f"{rng.choice(NAMESPACES)}:u{rng.randrange(100000)}:{rng.choice(names)}:{i}"
                if rng.random() < 0.2:
                    value = " ".join(rng.choices(cjk, cum_weights=cum_c, k=rng.randint(4, 20)))
                else:
                    value = " ".join(rng.choices(words, cum_weights=cum_w, k=rng.randint(5, 40)))
                tags = rng.sample(words[:200], rng.randint(0, 3))
                f = search_index.index_fields(tenant_id=tenant.pk, key=key, value=value, tags=tags)
                row = [
                    str(tenant.pk),
                    key,
                    key.rpartition(":")[0],
                    json.dumps(value, ensure_ascii=False),
                    f["search_text"],
                    "note",
                    "",
                    json.dumps(tags),
                    str(rng.randint(0, 10)),
                    "bench",
                    "1",
                    "2026-01-01 00:00:00+00",
                    f"2026-{rng.randint(1, 11):02d}-{rng.randint(1, 28):02d} 00:00:00+00",
                    "0",
                    "[]",
                    f["search_tsv"],
                    "f",
                ]
                buf.write("\t".join(_copy_escape(v) for v in row) + "\n")
            with (
                connection.cursor() as c,
                c.copy(
                    "COPY memories_memory (tenant_id, key, namespace, value, search_text, category, subject,"
                    " tags, importance, source, version, created_at, updated_at, access_count, sources,"
                    " search_tsv, sensitive) FROM STDIN"
                ) as copy,
            ):
                copy.write(buf.getvalue())
            self.log(f"  {tenant.slug}: {min(start + batch, size)}/{size} rows ({time.monotonic() - started:.0f} s)")
        if big:
            self.log("  building the GIN index")
            with connection.cursor() as c:
                c.execute("SET maintenance_work_mem = '256MB'")
                c.execute(
                    "CREATE INDEX IF NOT EXISTS memory_search_tsv ON memories_memory "
                    "USING gin (search_tsv) WITH (fastupdate = off)"
                )
                c.execute("ANALYZE memories_memory")

    def _seed_embeddings(self, tenant: Tenant, size: int) -> None:
        """Every memory of the tenant gets an embedding row, as the embedding job would leave
        it: the newest ``--real-vectors`` (by id, the order the search cache reads them in)
        encoded by the model itself, so that a search pays the semantic part as in production
        (the question's embedding, the similarity over the cached newest vectors, the vectors of
        older word matches read by id); the older ones a **stand-in**: a random unit vector
        (same size and storage, no meaning — it never passes the similarity floor), because
        encoding a million texts here would take hours."""
        import numpy as np

        from memories.search import embeddings

        real = min(self.real_vectors, size)
        with connection.cursor() as c:
            c.execute("DELETE FROM memories_memoryembedding WHERE tenant_id = %s", [tenant.pk])
        rows = (
            Memory.objects.filter(tenant=tenant)
            .order_by("id")
            .values_list("id", "key", "value", "version", "updated_at")
        )
        ids = list(Memory.objects.filter(tenant=tenant).order_by("id").values_list("id", flat=True))
        cut = ids[len(ids) - real] if real else None
        rng = np.random.default_rng(7)
        started = time.monotonic()
        self.log(f"  {tenant.slug}: embeddings, {len(ids) - real} stand-ins then the newest {real} from the model")
        sql = (
            "COPY memories_memoryembedding (tenant_id, memory_id, model, dim, vector, text_hash, memory_version,"
            " memory_updated_at, created_at) FROM STDIN"
        )
        batch: list[tuple] = []
        done = 0

        def flush():
            nonlocal batch, done
            if not batch:
                return
            if cut is not None and batch[-1][0] >= cut:
                vectors = embeddings.encode([embeddings.memory_text(key=k, value=v) for _i, k, v, _n, _u in batch])
            else:
                vectors = rng.standard_normal((len(batch), embeddings.DIM), dtype=np.float32)
                vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            now = timezone.now()
            with connection.cursor() as c, c.copy(sql) as copy:
                for (memory_id, _k, _v, version, updated_at), vector in zip(batch, vectors, strict=True):
                    copy.write_row(
                        (
                            tenant.pk,
                            memory_id,
                            embeddings.MODEL_NAME,
                            embeddings.DIM,
                            embeddings.to_bytes(vector),
                            "bench",
                            version,
                            updated_at,
                            now,
                        )
                    )
            done += len(batch)
            if done % 20_000 < len(batch):
                self.log(f"    {done}/{len(ids)} ({time.monotonic() - started:.0f} s)")
            batch = []

        for row in rows.iterator(chunk_size=2000):
            # Stand-ins and model vectors never share a batch: the model's are encoded 32 at a time.
            real_row = cut is not None and row[0] >= cut
            if batch and (real_row != (cut is not None and batch[-1][0] >= cut)):
                flush()
            batch.append(row)
            if len(batch) >= (embeddings.BATCH_SIZE if real_row else 5000):
                flush()
        flush()
        self.log(f"    done in {time.monotonic() - started:.0f} s")

    # --- measuring --------------------------------------------------------------------------

    def _questions(self, tenant: Tenant, rng: random.Random, n: int) -> list[str]:
        ids = list(Memory.objects.filter(tenant=tenant).order_by("?").values_list("key", "value")[: max(n, 1)])
        out = []
        for key, value in ids:
            name_words = key.split(":")[2].split("_")
            value_words = str(value).split()
            if value_words and "\u4e00" <= value_words[0][0] <= "\u9fff":
                picked = rng.sample(value_words, min(len(value_words), rng.randint(2, 3)))
                out.append("".join(picked) + rng.choice(["是什么？", "在哪里", "怎么样"]))
            else:
                picked = rng.sample(value_words, min(len(value_words), rng.randint(1, 4)))
                out.append(f"what is the {rng.choice(name_words)} about {' '.join(picked)}?")
        return out

    def _measure(self, port, tenant, raw_key, reader_key, read_key, rng, n, worst_n, parallel, seconds) -> dict:
        client = HttpClient(port, raw_key, timeout=30)
        # Warm up: each server process loads the model in the background at start (~3 s) and
        # builds a tenant's matrix of cached vectors in the background at its first search.
        warm = self._questions(tenant, rng, 10)
        warm_clients = [client]
        if self.split_port:
            warm_clients.append(HttpClient(self.split_port, raw_key, timeout=30))
        until = time.monotonic() + 6
        while time.monotonic() < until:
            for q in warm:
                for c in warm_clients:
                    c.request("POST", TOOL_CALL, _search(q))
            time.sleep(0.5)
        for c in warm_clients[1:]:
            c.close()
        if self.fairness_only:
            client.close()
            mixed = [PARAGRAPH, "ab", "一", EMOJI, "what is the of and to in it that this"]
            mixed += [" ".join(rng.choice(["ab", "cd", "ef", "gh"]) for _ in range(160))[:500]]
            mixed += warm[:5]
            return {"parallel": self._parallel(port, raw_key, reader_key, read_key, mixed, parallel, seconds)}
        realistic = Samples("realistic", "memory_search, 3-6 words of a memory")
        # The same answers split by what came before them: a Retry-After pause (a 429
        # search_budget waited out), or the previous answer. After a pause this host answers
        # 2-3x slower (README, Benchmark "Session 10"): both halves are printed.
        after_pause = Samples("after a budget pause", "the answer that followed a Retry-After wait")
        back_to_back = Samples("back to back", "the answer that followed the previous one")
        self.budget_waits = 0
        for q in self._questions(tenant, rng, n):
            waits = self.budget_waits
            ns, status = self._answered(client, q)
            realistic.ns.append(ns)
            realistic.errors += status != 200
            (after_pause if self.budget_waits > waits else back_to_back).ns.append(ns)
        worst_queries = {
            "ab": "ab",
            "160 two-letter words": " ".join(
                rng.choice(["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]) for _ in range(160)
            )[:500],
            "500-char paragraph": PARAGRAPH,
            "one CJK character": "一",
            "emoji only": EMOJI,
            "stop words only": "what is the of and to in it that this",
        }
        worst = {}
        for name, q in worst_queries.items():
            s = Samples(name, q[:40])
            statuses: dict[int, int] = {}
            for _ in range(worst_n):
                ns, status = self._answered(client, q)
                s.ns.append(ns)
                statuses[status] = statuses.get(status, 0) + 1
            summary = s.summary()
            summary["max_ms"] = round(max(s.ns) / 1e6, 2)
            summary["statuses"] = statuses
            worst[name] = summary
        client.close()
        budget_waits = self.budget_waits
        mixed = list(worst_queries.values()) + self._questions(tenant, rng, 5)
        return {
            "realistic": realistic.summary(),
            "realistic_back_to_back": back_to_back.summary(),
            "realistic_after_pause": after_pause.summary(),
            "worst": worst,
            "budget_waits": budget_waits,
            "parallel": self._parallel(port, raw_key, reader_key, read_key, mixed, parallel, seconds),
        }

    def _answered(self, client: HttpClient, q: str) -> tuple[int, int]:
        """(ns, status) of one search, sent again after its Retry-After while the tenant's
        search time budget refuses it (429 search_budget): one client searching back to back
        spends more than the default budget's rate. Only the answered attempt is timed."""
        for _ in range(30):
            ns, status, body = client.request("POST", TOOL_CALL, _search(q))
            if status != 429 or b"search_budget" not in body:
                return ns, status
            self.budget_waits += 1
            time.sleep(float(client.last_headers.get("Retry-After") or 1))
        return ns, status

    def _parallel(self, port, raw_key, reader_key, read_key, queries, parallel, seconds) -> dict:
        """Another tenant's reads: idle, beside a CPU hog (the floor), and while ``parallel``
        clients send worst cases — each side a client process of its own, and once the old
        way (every client a thread of this process) to show what that measured."""
        read_body = json.dumps({"name": "memory_read", "arguments": {"key": read_key}}).encode()
        attack = contention.Attack(
            api_key=raw_key,
            bodies=[_search(q) for q in queries],
            clients=parallel,
            seconds=seconds,
            honour_retry_after=not self.ignore_retry_after,
        )
        phases = {"idle": {}, "cpu_hog": {"hog": True}}
        for mode in self.attack_modes:
            if mode == "split":
                phases["attack_split"] = {"attack": attack, "mode": "processes", "attack_port": self.split_port}
            else:
                phases[f"attack_{mode}"] = {"attack": attack, "mode": mode}
        out = {"clients": parallel, "retry_after_honoured": attack.honour_retry_after, "seconds": seconds}
        for name, kwargs in phases.items():
            self.log(f"  parallel phase: {name} ({seconds:.0f} s), load {loadavg()}")
            cpu = {pid: proc_cpu_seconds(pid) for pid in self.server_workers}
            pg = PgCounters()
            try:
                outcome = contention.phase(port, reader_key=reader_key, read_body=read_body, seconds=seconds, **kwargs)
            except BaseException:
                pg.stop(0)
                raise
            used = sum((proc_cpu_seconds(pid) or 0) - (before or 0) for pid, before in cpu.items())
            out[name] = {**outcome.summary(), "server_cpu_s": round(used, 2), "load": loadavg(), "pg": pg.stop(seconds)}
        idle_p99 = out["idle"]["reads"]["p99_ms"]
        for name in phases:
            if name != "idle":
                out[name]["p99_ratio"] = ratio(out[name]["reads"]["p99_ms"], idle_p99)
        return out

    def print_table(self, report: dict) -> None:
        w = self.stdout.write
        vectors = report["real_vectors"]
        w(
            f"\nserver: {report['processes']} processes × {report['threads']} threads; tenant slots "
            f"{report['tenant_slots']}; search CPU budget {report['search_cpu_ms_per_second']} ms/s, burst "
            f"{report['search_cpu_burst_ms']} ms (0: off); embeddings: "
            + (
                f"the newest {vectors} of each searched tenant from the model, older ones random stand-ins"
                if vectors >= 0
                else "none (words only)"
            )
            + f"; load average {report['load_at_start']} at start, {report['load_at_end']} at end"
        )
        for size, r in report["sizes"].items():
            if "realistic" not in r:  # --fairness-only
                w(f"\n{size} memories in one tenant (+{report['others']} in another), fairness phases only")
                self._print_parallel(r["parallel"])
                continue
            s = r["realistic"]
            w(
                f"\n{size} memories in one tenant (+{report['others']} in another), "
                f"serve {report['processes']} processes × {report['threads']} threads"
            )
            w(
                f"  realistic   p50 {s['p50_ms']:7.2f}  p95 {s['p95_ms']:7.2f}  p99 {s['p99_ms']:7.2f} ms"
                f"  errors {s['errors']}  (429 search_budget waited out: {r['budget_waits']})"
            )
            for label, part in (("back to back", "realistic_back_to_back"), ("after a pause", "realistic_after_pause")):
                ps = r.get(part) or {}
                if ps.get("n"):
                    w(
                        f"    {label:14} {ps['n']:4} answers  p50 {ps['p50_ms']:7.2f}  p95 {ps['p95_ms']:7.2f} ms"
                        + ("  (the answer after each Retry-After wait)" if part.endswith("pause") else "")
                    )
            for name, ws in r["worst"].items():
                w(f"  {name:22} p50 {ws['p50_ms']:7.2f}  max {ws['max_ms']:7.2f} ms  statuses {ws['statuses']}")
            self._print_parallel(r["parallel"])

    def _print_parallel(self, p: dict) -> None:
        w = self.stdout.write
        w(
            f"  another tenant's memory_read, {p['seconds']:.0f} s per phase "
            f"({'Retry-After honoured' if p['retry_after_honoured'] else 'Retry-After ignored'}):"
        )
        w(
            "    phase                          reads  p50 ms  p99 ms  ×idle p99  p99 after 2 s  errors"
            "  server CPU s  load   searches"
        )
        labels = {
            "idle": "idle",
            "cpu_hog": "a CPU hog on one core (floor)",
            "attack_processes": f"{p['clients']} searchers, own process",
            "attack_threads": f"{p['clients']} searchers, same process",
            "attack_split": f"{p['clients']} searchers, other server",
        }
        for name, label in labels.items():
            ph = p.get(name)
            if ph is None:
                continue
            reads = ph["reads"]
            w(
                f"    {label:30} {reads['n']:5}  {reads['p50_ms']:6.2f}  {reads['p99_ms']:6.2f}  "
                f"{ph.get('p99_ratio') or '':>9}  {_or_dash(ph['steady_p99_ms']):>13}  {ph['read_errors']:6}  "
                f"{ph['server_cpu_s']:12}  "
                f"{ph['load'][0]:5}  {ph['searches'] or ''}"
            )
        w("    PostgreSQL during each phase, per second (WAL: the whole cluster's; waits: this database's):")
        for name, label in labels.items():
            pg = (p.get(name) or {}).get("pg")
            if pg:
                w(
                    f"    {label:30} commits {pg['commits_per_s']:7}  WAL {pg['wal_kb_per_s']:7} kB  "
                    f"WAL records {pg['wal_records_per_s']:7}  flushes {pg['wal_syncs_per_s']:6}  "
                    f"active-backend samples {pg['active_samples']}, on the WAL {pg['wal_wait_share']}  "
                    f"{pg['waits']}"
                )
        w(
            "    (own process: the reader and the searchers are separate client processes, as in production; "
            "same process: threads of one process, the old measurement, which adds its own GIL waits. "
            "The CPU hog is a process spinning on one core that has nothing to do with ZeroMem: no reader "
            "can do better than its ratio on this machine. 'p99 after 2 s': the reads that started 2 s or more "
            "into the phase, once a tenant's search burst allowance is spent.)"
        )


class PgCounters:
    """What PostgreSQL did during a phase: this database's commits (pg_stat_database; read-only
    ones too), the cluster's WAL (pg_stat_wal: bytes, records, and flushes — the cluster's,
    so other databases' work counts too), and a sample every 10 ms of what this database's
    active backends wait on (``WALSync``/``WALWrite``: a commit waiting for the flush)."""

    SQL = (
        "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),"
        " pg_current_wal_lsn() - '0/0'::pg_lsn, wal_records, wal_sync FROM pg_stat_wal"
    )
    SAMPLE = (
        "SELECT coalesce(wait_event, 'CPU') FROM pg_stat_activity WHERE datname = current_database()"
        " AND state = 'active' AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
    )

    def __init__(self):
        import threading

        import psycopg

        from zeromem.bench.pgwatch import settings_conninfo

        self.conn = psycopg.connect(settings_conninfo(), autocommit=True)
        self.start = self._read()
        self.t0 = time.monotonic()
        self.waits: dict[str, int] = {}
        self.done = threading.Event()
        self.sampler = threading.Thread(
            target=self._sample, args=(psycopg.connect(settings_conninfo(), autocommit=True),), daemon=True
        )
        self.sampler.start()

    def _read(self):
        return self.conn.execute(self.SQL).fetchone()

    def _sample(self, conn):
        while not self.done.wait(0.01):
            for (event,) in conn.execute(self.SAMPLE).fetchall():
                self.waits[event] = self.waits.get(event, 0) + 1
        conn.close()

    def stop(self, seconds: float) -> dict:
        self.done.set()
        self.sampler.join()
        time.sleep(1.5)  # backends report their statistics at most once a second
        end = self._read()
        self.conn.close()
        span = max(time.monotonic() - self.t0 - 1.5, seconds)
        delta = [float(b) - float(a) for a, b in zip(self.start, end, strict=True)]
        active = sum(self.waits.values())
        on_wal = self.waits.get("WALSync", 0) + self.waits.get("WALWrite", 0)
        return {
            "commits_per_s": round(delta[0] / span),
            "wal_kb_per_s": round(delta[1] / span / 1024, 1),
            "wal_records_per_s": round(delta[2] / span),
            "wal_syncs_per_s": round(delta[3] / span),
            "active_samples": active,
            "wal_wait_share": round(on_wal / active, 2) if active else None,
            "waits": dict(sorted(self.waits.items(), key=lambda kv: -kv[1])[:5]),
        }


def _or_dash(value) -> str:
    # A phase no longer than 2 s has no "after 2 s" part.
    return "—" if value is None else str(value)


def _search(q: str) -> bytes:
    return json.dumps({"name": "memory_search", "arguments": {"query": q, "limit": 5}}).encode()


def _copy_escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _database_url() -> str:
    s = connection.settings_dict
    host = s.get("HOST") or "127.0.0.1"
    port = s.get("PORT") or 5432
    user = s.get("USER") or "postgres"
    pw = f":{s['PASSWORD']}" if s.get("PASSWORD") else ""
    return f"postgres://{user}{pw}@{host}:{port}/{s['NAME']}"
