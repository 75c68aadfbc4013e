"""Measure search quality on question→answer data that this project did not write.

    python manage.py search_eval [--dataset NAME ...] [--limit N] [--k 1,5,10] [--json] [--misses N]
                                 [--semantic on|off] [--fusion weighted|rrf]

Each dataset is loaded into its own throw-away tenant: every answer passage becomes one
memory (key ``fact:<dataset>:<id>``, written through ``services.memory_write`` by a system
actor), so for each question all the other passages are distractors (for a dataset that
scopes its questions, e.g. to one conversation of several, the other passages under the
question's key prefix: ``memory_search``'s ``prefix``). Every question is
then asked through ``services.memory_search`` and the rank of the memory that answers it
is recorded: hit@k (the answer is among the first k results), recall@10 (the share of a
question's answers among the first 10 results, averaged), MRR (mean of 1/rank over the
first 10 results, 0 when it is not there) and the search latency p50/p95, per dataset and
per language.

``--semantic on`` (the default) embeds every passage first, as the embedding job would
(memories/search/embeddings.py), and waits for the model to load, so the search fuses words
and meaning; ``--semantic off`` measures the word ranking alone. ``--fusion`` picks the
fusion (``ZEROMEM_SEMANTIC_FUSION``) to compare the two.

Everything runs in one transaction that is rolled back at the end (``--keep`` commits it
instead), so no tenant, memory or audit event is left behind.

The datasets, where each comes from and how to add one: :mod:`zeromem.bench.search_datasets`.
A dataset whose package is not installed is skipped with a note.
"""

from __future__ import annotations

import re
import time
import uuid

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.test.utils import override_settings

from memories import services
from memories.search import embeddings
from zeromem.bench.harness import nearest_rank
from zeromem.bench.options import BenchCommand
from zeromem.bench.search_datasets import LOADERS, Dataset, Unavailable
from zeromem.kernel.actors import Actor

MRR_DEPTH = 10
RECALL_DEPTH = 10


class _Rollback(Exception):
    pass


def _percentile(values: list[float], p: float) -> float:
    return nearest_rank(sorted(values), p / 100) if values else 0.0


def _summary(ranks: list[int | None], latencies: list[float], ks: list[int], recalls: list[float]) -> dict:
    n = len(ranks)
    out = {"questions": n}
    for k in ks:
        out[f"hit@{k}"] = round(sum(1 for r in ranks if r is not None and r <= k) / n, 4) if n else 0.0
    out[f"recall@{RECALL_DEPTH}"] = round(sum(recalls) / n, 4) if n else 0.0
    out["mrr"] = round(sum(1 / r for r in ranks if r is not None and r <= MRR_DEPTH) / n, 4) if n else 0.0
    out["p50_ms"] = round(_percentile(latencies, 50), 2)
    out["p95_ms"] = round(_percentile(latencies, 95), 2)
    return out


class Command(BenchCommand):
    help = "Measure how often search returns the memory that answers a question (hit@k, MRR, latency)."

    shared_options = ("json",)
    json_dumps_options = {"ensure_ascii": False, "indent": 2}

    def add_bench_arguments(self, parser):
        parser.add_argument(
            "--dataset",
            action="append",
            choices=sorted(LOADERS),
            help="dataset to run (repeatable); default: every installed one",
        )
        parser.add_argument("--limit", type=int, default=None, help="at most N questions per dataset")
        parser.add_argument("--k", default="1,5,10", help="cut-offs for hit@k, comma-separated (default 1,5,10)")
        parser.add_argument("--misses", type=int, default=0, help="list up to N missed questions per dataset")
        parser.add_argument("--keep", action="store_true", help="commit the evaluation tenants instead of rolling back")
        parser.add_argument(
            "--semantic",
            choices=("on", "off"),
            default="on",
            help="on: embed the passages and fuse words with meaning (default); off: words only",
        )
        parser.add_argument(
            "--fusion", choices=("weighted", "rrf"), default=None, help="fusion of words and meaning (default: setting)"
        )

    def handle(self, *args, dataset, limit, k, misses, keep, semantic, fusion, **options):
        try:
            ks = sorted({int(x) for x in k.split(",") if x.strip()})
        except ValueError:
            raise CommandError("--k: comma-separated positive integers, e.g. 1,3,5") from None
        if not ks or ks[0] < 1:
            raise CommandError("--k: comma-separated positive integers, e.g. 1,3,5")
        depth = max(ks[-1], MRR_DEPTH)

        names = dataset or sorted(LOADERS)
        loaded: list[Dataset] = []
        skipped: dict[str, str] = {}
        for name in names:
            try:
                loaded.append(LOADERS[name]())
            except Unavailable as exc:
                skipped[name] = f"not installed: {exc}"
                if dataset:
                    raise CommandError(f"{name}: {skipped[name]}") from None
        if not loaded:
            raise CommandError("no dataset available: " + "; ".join(f"{n}: {why}" for n, why in skipped.items()))

        actor = Actor.system(job="search_eval")
        # Quality, not latency: a search that a busy machine slows past the production
        # timeout is still ranked (the latency columns show what it cost).
        overrides = {
            "ZEROMEM_EMBEDDINGS": semantic,
            "ZEROMEM_EMBEDDINGS_LOAD_WAIT": True,
            "ZEROMEM_SEARCH_TIMEOUT_MS": max(settings.ZEROMEM_SEARCH_TIMEOUT_MS, 10_000),
            # Thousands of questions back to back: no tenant search time budget.
            "ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND": 0,
        }
        if fusion:
            overrides["ZEROMEM_SEMANTIC_FUSION"] = fusion
        if semantic == "on":
            try:
                with override_settings(**overrides):
                    embeddings.encode(["warm up"])  # load the model before any timing
            except embeddings.EncoderUnavailable as exc:
                raise CommandError(f"--semantic on: {exc}") from None
        results: dict[str, dict] = {}
        per_question: list[dict] = []
        try:
            with override_settings(**overrides), transaction.atomic():
                for ds in loaded:
                    results[ds.name], rows = self._run(ds, actor=actor, limit=limit, ks=ks, depth=depth)
                    per_question.extend(rows)
                if not keep:
                    raise _Rollback
        except _Rollback:
            pass

        by_lang: dict[str, list[dict]] = {}
        for row in per_question:
            by_lang.setdefault(row["lang"], []).append(row)
        languages = {
            lang: _summary([r["rank"] for r in rows], [r["ms"] for r in rows], ks, [r["recall"] for r in rows])
            for lang, rows in sorted(by_lang.items())
        }
        overall = _summary(
            [r["rank"] for r in per_question], [r["ms"] for r in per_question], ks, [r["recall"] for r in per_question]
        )
        report = {
            "backend": connection.vendor,
            "semantic": semantic,
            "fusion": (fusion or settings.ZEROMEM_SEMANTIC_FUSION) if semantic == "on" else None,
            "k": ks,
            "mrr_depth": MRR_DEPTH,
            "datasets": results,
            "languages": languages,
            "all": overall,
            "skipped": skipped,
        }
        if misses:
            report["misses"] = {
                ds.name: [r for r in per_question if r["dataset"] == ds.name and (r["rank"] or depth + 1) > 1][:misses]
                for ds in loaded
            }
        self.emit(report)

    def _run(self, ds: Dataset, *, actor: Actor, limit, ks, depth) -> tuple[dict, list[dict]]:
        slug = f"search-eval-{uuid.uuid4().hex[:12]}"
        tenant = services.tenant_create(actor=actor, slug=slug, name=f"search_eval {ds.name}")
        max_bytes = tenant.effective_value_max_bytes
        truncated = 0
        for pid, text in ds.passages.items():
            value = text
            while len(value.encode()) + 2 > max_bytes:  # JSON string quotes
                value = value[: int(len(value) * 0.9)]
                truncated += 1
            services.memory_write(tenant=tenant, actor=actor, key=_key(ds.name, pid), value=value)
        embedded = 0
        if settings.ZEROMEM_EMBEDDINGS != "off":
            embedded = embeddings.embeddings_refresh(full=True, tenant_id=tenant.pk, time_budget=float("inf"))[
                "embedded"
            ]
        questions = ds.questions[:limit] if limit else ds.questions
        rows = []
        latencies = []
        ranks = []
        recalls = []
        for qid, question, answers in questions:
            relevant = {_key(ds.name, a) for a in answers}
            prefix = _key(ds.name, ds.scopes[qid]) if qid in ds.scopes else ""
            started = time.perf_counter()
            found = services.memory_search(tenant=tenant, actor=actor, query=question[:500], prefix=prefix, limit=depth)
            ms = (time.perf_counter() - started) * 1000
            keys = [hit.memory.key for hit in found]
            rank = next((i + 1 for i, key in enumerate(keys) if key in relevant), None)
            recall = len(relevant.intersection(keys[:RECALL_DEPTH])) / len(relevant)
            ranks.append(rank)
            recalls.append(recall)
            latencies.append(ms)
            rows.append(
                {
                    "dataset": ds.name,
                    "lang": ds.lang,
                    "id": qid,
                    "question": question,
                    "expected": sorted(relevant),
                    "rank": rank,
                    "recall": recall,
                    "top": keys[:3],
                    "ms": round(ms, 2),
                }
            )
        summary = _summary(ranks, latencies, ks, recalls)
        summary.update(lang=ds.lang, memories=len(ds.passages), embedded=embedded, source=ds.source)
        if truncated:
            summary["truncated_values"] = truncated
        return summary, rows

    def print_table(self, report: dict) -> None:
        ks = report["k"]
        cols = [f"hit@{k}" for k in ks] + [f"recall@{RECALL_DEPTH}", "mrr"]
        header = f"{'':18} {'lang':4} {'qs':>5} {'mems':>5} " + " ".join(f"{c:>9}" for c in cols)
        header += f" {'p50ms':>7} {'p95ms':>7}"
        w = self.stdout.write
        mode = f"words + meaning ({report['fusion']} fusion)" if report["semantic"] == "on" else "words only"
        w(f"backend: {report['backend']}   ranking: {mode}   (MRR over the first {report['mrr_depth']} results)")
        w(header)

        def line(label, lang, s, mems=""):
            figures = " ".join(f"{s[c]:9.3f}" for c in cols)
            return (
                f"{label:18} {lang:4} {s['questions']:5d} {str(mems):>5} {figures} "
                f"{s['p50_ms']:7.2f} {s['p95_ms']:7.2f}"
            )

        for name, s in report["datasets"].items():
            w(line(name, s["lang"], s, s["memories"]))
        w("-" * len(header))
        for lang, s in report["languages"].items():
            w(line(f"language {lang}", lang, s))
        w(line("all", "", report["all"]))
        for name, why in report["skipped"].items():
            w(f"skipped {name}: {why}")
        for name, rows in report.get("misses", {}).items():
            w(f"\nmisses in {name} (rank > 1):")
            for r in rows:
                w(f"  [{r['rank'] or '-'}] {r['question']}  expected {r['expected'][0]}  got {', '.join(r['top'])}")
        w("\nsources:")
        for name, s in report["datasets"].items():
            w(f"  {name}: {s['source']}")


def _key(dataset: str, pid: str) -> str:
    return f"fact:{dataset}:" + re.sub(r"[^\w.@+=~-]", "_", pid)
