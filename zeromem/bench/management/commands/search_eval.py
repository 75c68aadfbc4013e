"""Measure search quality on question→answer data that this project did not write.

    python manage.py search_eval [--dataset NAME ...] [--limit N] [--k 1,3,5] [--json] [--misses N]

Each dataset is loaded into its own throw-away tenant: every answer passage becomes one
memory (key ``fact:<dataset>:<id>``, written through ``services.memory_write`` by a system
actor), so for each question all the other passages are distractors. Every question is
then asked through ``services.memory_search`` and the rank of the memory that answers it
is recorded: hit@k (the answer is among the first k results), MRR (mean of 1/rank over the
first 10 results, 0 when it is not there) and the search latency p50/p95, per dataset and
per language. Everything runs in one transaction that is rolled back at the end (``--keep``
commits it instead), so no tenant, memory or audit event is left behind.

Data sources, all from package registries and read from the installed package at run time:

* ``debian-faq-en`` / ``debian-faq-zh``: the Debian GNU/Linux FAQ, English and its
  Simplified Chinese translation (Debian packages ``debian-faq`` and ``debian-faq-zh-cn``,
  11.1; ``apt-get install debian-faq debian-faq-zh-cn``). Each section whose heading is a
  question is one pair: the heading is the question, the section's own text the answer.
  Sections whose heading is not a question are loaded as extra distractors.
  License: verbatim and modified copies permitted (copyright Software in the Public Interest).
* ``zaragoza-faq-en``: Swedish Construction FAQ, English version, 503 pairs (PyPI
  ``zaragoza-construction-faq==1.2.1``, CC BY 4.0, "Swedish Construction FAQ by Zaragoza AB").
* ``chatterbot-zh`` / ``chatterbot-en``: the knowledge categories (ai, computers, history,
  literature, money, movies, politics, science, sports, trivia) of the ChatterBot dialog
  corpus (PyPI ``chatterbot-corpus==1.3.3``, BSD-3-Clause). A statement and the bot's reply
  form a pair; replies are short and often share no word with the statement, so this set
  shows the limit of word matching rather than the ranking.

A dataset whose package is not installed is skipped with a note.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction

from memories import services
from zeromem.kernel.actors import Actor

MRR_DEPTH = 10


@dataclass
class Dataset:
    name: str
    lang: str
    source: str
    passages: dict[str, str] = field(default_factory=dict)  # id -> answer text
    questions: list[tuple[str, str, set[str]]] = field(default_factory=list)  # (qid, question, answer ids)


class Unavailable(Exception):
    pass


# --- Loaders --------------------------------------------------------------------------

_WS = re.compile(r"\s+")
_NUM_HEADING = re.compile(r"^(\d+(?:\.\d+)+)\.\s*(.+)$", re.S)
_XHTML = "{http://www.w3.org/1999/xhtml}"
DEBIAN_FAQ_DIR = Path("/usr/share/doc/debian/FAQ")


def _clean(text: str) -> str:
    return _WS.sub(" ", text.replace("\u00a0", " ")).strip()


def _deb_version(package: str) -> str:
    """The installed version, from the package's changelog ("debian-faq (11.1) unstable; ...")."""
    try:
        with gzip.open(f"/usr/share/doc/{package}/changelog.gz", "rt", encoding="utf-8") as f:
            m = re.match(r"\S+ \(([^)]+)\)", f.readline())
    except OSError:
        return "?"
    return m.group(1) if m else "?"


def _debian_faq(lang: str) -> Dataset:
    if lang == "en":
        files, package = sorted(DEBIAN_FAQ_DIR.glob("*.en.html")), "debian-faq"
    else:
        files, package = sorted((DEBIAN_FAQ_DIR / "zh-cn").glob("*.zh-cn.html")), "debian-faq-zh-cn"
    if not files:
        raise Unavailable(f"apt-get install {package}")
    ds = Dataset(
        name=f"debian-faq-{lang}",
        lang=lang,
        source=f"Debian package {package} {_deb_version(package)} ({DEBIAN_FAQ_DIR})",
    )
    for path in files:
        # bandit B314 (marked): a file of the installed Debian package, not user input.
        root = ET.parse(path).getroot()  # nosec B314
        for section in root.iter(f"{_XHTML}div"):
            if section.get("class") != "section":
                continue
            heading = None
            body: list[str] = []
            for child in section:
                cls = child.get("class") or ""
                if child.tag == f"{_XHTML}div" and cls == "titlepage":
                    h = next((e for e in child.iter() if e.tag[len(_XHTML) :] in ("h2", "h3", "h4", "h5")), None)
                    heading = _clean("".join(h.itertext())) if h is not None else None
                elif child.tag == f"{_XHTML}div" and cls in ("section", "toc"):
                    continue
                else:
                    body.append("".join(child.itertext()))
            text = _clean(" ".join(body))
            m = _NUM_HEADING.match(heading or "")
            if not m or len(text) < 20:
                continue
            sid, title = m.group(1), m.group(2)
            ds.passages[sid] = text
            if "?" in title or "？" in title:
                ds.questions.append((sid, title, {sid}))
    return ds


def _zaragoza(lang: str) -> Dataset:
    try:
        import zaragoza_construction_faq as zcf
    except ImportError:
        raise Unavailable("pip install zaragoza-construction-faq==1.2.1") from None
    ds = Dataset(
        name=f"zaragoza-faq-{lang}",
        lang=lang,
        source=f"PyPI zaragoza-construction-faq {getattr(zcf, '__version__', '?')} (CC BY 4.0)",
    )
    for row in zcf.load(lang=lang):
        ds.passages[row["id"]] = _clean(row["a"])
        ds.questions.append((row["id"], _clean(row["q"]), {row["id"]}))
    return ds


CHATTERBOT_CATEGORIES = (
    "ai",
    "computers",
    "history",
    "literature",
    "money",
    "movies",
    "politics",
    "science",
    "sports",
    "trivia",
)


def _chatterbot(lang: str) -> Dataset:
    try:
        import chatterbot_corpus
        import yaml
    except ImportError:
        raise Unavailable("pip install chatterbot-corpus==1.3.3 pyyaml") from None
    folder = Path(chatterbot_corpus.__file__).parent / "data" / {"zh": "chinese", "en": "english"}[lang]
    from importlib.metadata import version

    ds = Dataset(
        name=f"chatterbot-{lang}",
        lang=lang,
        source=f"PyPI chatterbot-corpus {version('chatterbot-corpus')} (BSD-3-Clause)",
    )
    by_text: dict[str, str] = {}
    by_question: dict[str, set[str]] = {}
    order: list[str] = []
    for category in CHATTERBOT_CATEGORIES:
        path = folder / f"{category}.yml"
        if not path.exists():
            continue
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        for n, conv in enumerate(data.get("conversations") or []):
            if not isinstance(conv, list) or len(conv) < 2:
                continue
            question, answer = _clean(str(conv[0])), _clean(str(conv[1]))
            if not question or not answer:
                continue
            pid = by_text.get(answer)
            if pid is None:
                pid = by_text[answer] = f"{category}-{n + 1}"
                ds.passages[pid] = answer
            if question not in by_question:
                by_question[question] = set()
                order.append(question)
            by_question[question].add(pid)
    for i, question in enumerate(order):
        ds.questions.append((f"q{i + 1}", question, by_question[question]))
    return ds


LOADERS = {
    "debian-faq-en": lambda: _debian_faq("en"),
    "debian-faq-zh": lambda: _debian_faq("zh"),
    "zaragoza-faq-en": lambda: _zaragoza("en"),
    "chatterbot-en": lambda: _chatterbot("en"),
    "chatterbot-zh": lambda: _chatterbot("zh"),
}


# --- Evaluation -----------------------------------------------------------------------


class _Rollback(Exception):
    pass


def _percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = max(0, min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1))
    return ordered[idx]


def _summary(ranks: list[int | None], latencies: list[float], ks: list[int]) -> dict:
    n = len(ranks)
    out = {"questions": n}
    for k in ks:
        out[f"hit@{k}"] = round(sum(1 for r in ranks if r is not None and r <= k) / n, 4) if n else 0.0
    out["mrr"] = round(sum(1 / r for r in ranks if r is not None and r <= MRR_DEPTH) / n, 4) if n else 0.0
    out["p50_ms"] = round(_percentile(latencies, 50), 2)
    out["p95_ms"] = round(_percentile(latencies, 95), 2)
    return out


class Command(BaseCommand):
    help = "Measure how often search returns the memory that answers a question (hit@k, MRR, latency)."

    def add_arguments(self, parser):
        parser.add_argument(
            "--dataset",
            action="append",
            choices=sorted(LOADERS),
            help="dataset to run (repeatable); default: every installed one",
        )
        parser.add_argument("--limit", type=int, default=None, help="at most N questions per dataset")
        parser.add_argument("--k", default="1,3,5", help="cut-offs for hit@k, comma-separated (default 1,3,5)")
        parser.add_argument("--json", action="store_true", help="print the figures as JSON")
        parser.add_argument("--misses", type=int, default=0, help="list up to N missed questions per dataset")
        parser.add_argument("--keep", action="store_true", help="commit the evaluation tenants instead of rolling back")

    def handle(self, *args, dataset, limit, k, json: bool, misses, keep, **options):
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
        results: dict[str, dict] = {}
        per_question: list[dict] = []
        try:
            with transaction.atomic():
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
            lang: _summary([r["rank"] for r in rows], [r["ms"] for r in rows], ks)
            for lang, rows in sorted(by_lang.items())
        }
        overall = _summary([r["rank"] for r in per_question], [r["ms"] for r in per_question], ks)
        report = {
            "backend": connection.vendor,
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
        if json:
            self.stdout.write(_json_dumps(report))
        else:
            self._print(report, ks)

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
        questions = ds.questions[:limit] if limit else ds.questions
        rows = []
        latencies = []
        ranks = []
        for qid, question, answers in questions:
            relevant = {_key(ds.name, a) for a in answers}
            started = time.perf_counter()
            found = services.memory_search(tenant=tenant, actor=actor, query=question[:500], limit=depth)
            ms = (time.perf_counter() - started) * 1000
            keys = [m.key for m, _score in found]
            rank = next((i + 1 for i, key in enumerate(keys) if key in relevant), None)
            ranks.append(rank)
            latencies.append(ms)
            rows.append(
                {
                    "dataset": ds.name,
                    "lang": ds.lang,
                    "id": qid,
                    "question": question,
                    "expected": sorted(relevant),
                    "rank": rank,
                    "top": keys[:3],
                    "ms": round(ms, 2),
                }
            )
        summary = _summary(ranks, latencies, ks)
        summary.update(lang=ds.lang, memories=len(ds.passages), source=ds.source)
        if truncated:
            summary["truncated_values"] = truncated
        return summary, rows

    def _print(self, report: dict, ks: list[int]) -> None:
        cols = [f"hit@{k}" for k in ks] + ["mrr"]
        header = f"{'':18} {'lang':4} {'qs':>5} {'mems':>5} " + " ".join(f"{c:>6}" for c in cols)
        header += f" {'p50ms':>7} {'p95ms':>7}"
        w = self.stdout.write
        w(f"backend: {report['backend']}   (MRR over the first {report['mrr_depth']} results)")
        w(header)

        def line(label, lang, s, mems=""):
            figures = " ".join(f"{s[c]:6.3f}" for c in cols)
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


def _json_dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=2)
