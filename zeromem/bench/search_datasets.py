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

A dataset whose package is not installed is skipped with a note.
"""

from __future__ import annotations

import gzip
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
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
