"""Search terms fold out what writers put in or leave out as they please (README "Search"):
Arabic harakat and tatweel, Hebrew niqqud; and the zero-width non-joiner and joiner inside a
word. A question finds a memory whichever way either was spelt. Values and keys are stored as
given: only the terms are folded. Memories indexed before need ``manage.py search_reindex``."""

import io

import pytest
from django.core.management import call_command

from memories.models import Memory
from memories.search import text
from memories.search.text import query_words, tokenize

# A book, with and without harakat (fatha, kasra, tanween), stretched with tatweel.
KITAB_VOWELLED, KITAB, KITAB_STRETCHED = "كِتَابٌ", "كتاب", "كـتـاب"
SEFER_POINTED, SEFER = "סֵפֶר", "ספר"  # Hebrew "book", with and without niqqud


def test_harakat_tatweel_and_niqqud_are_folded_out_of_the_terms():
    assert tokenize(f"{KITAB_VOWELLED} {KITAB_STRETCHED} {KITAB}") == [KITAB] * 3
    assert tokenize("قَرَأْتُ الْكِتَابَ") == ["قرأت", "الكتاب"]  # sukun and shadda-free; hamza kept
    assert tokenize("مُحَمَّدٌ") == ["محمد"]  # shadda
    assert tokenize("هٰذَا") == ["هذا"]  # superscript alef
    assert tokenize(f"{SEFER_POINTED} עִבְרִית שָׁלוֹם") == [SEFER, "עברית", "שלום"]  # shin dot too
    assert tokenize("בְּרֵאשִׁ֖ית") == ["בראשית"]  # a cantillation mark (tipeha)
    # Marks of other scripts are the word's own letters' vowels: kept.
    assert tokenize("हिंदी ที่อยู่ café") == ["हिंदी", "ที่อยู่", "café"]
    # Hebrew punctuation in the block (maqaf) is no mark: it still separates words.
    assert tokenize("בֵּית־סֵפֶר") == ["בית", SEFER]
    assert query_words(f"أين {KITAB_VOWELLED}؟") == ["أين", KITAB]


def test_a_joiner_inside_a_word_is_dropped_from_its_term():
    # Persian: the joined word, then its parts (کتاب finds کتاب‌ها, "books").
    assert tokenize("کتاب\u200cها") == ["کتابها", "کتاب", "ها"]
    assert tokenize("می\u200cخواهم") == ["میخواهم", "می", "خواهم"]
    # Indic: the word whole, without its joiner (a half form, a conjunct).
    assert tokenize("क्\u200dष") == ["क्ष"]
    assert tokenize("ශ්\u200dරී ලංකා") == ["ශ්රී", "ලංකා"]
    assert tokenize("এন্\u200cটার") == ["এন্টার"]
    # A joiner at a word's edge is dropped with the blanks around it.
    assert tokenize("\u200cکتاب \u200d x") == ["کتاب", "x"]


def _keys(api, query, **extra):
    status, body = api.call("memory_search", query=query, **extra)
    assert status == 200, body
    return sorted(r["key"] for r in body["results"])


def test_arabic_with_or_without_harakat_finds_the_other(api):
    assert api.call("memory_write", key="note:ar:vowelled", value=f"هذا {KITAB_VOWELLED} جديد")[0] == 200
    assert api.call("memory_write", key="note:ar:bare", value=f"{KITAB} قديم")[0] == 200
    assert api.call("memory_write", key="note:ar:stretched", value=f"{KITAB_STRETCHED} مزخرف")[0] == 200
    assert api.call("memory_write", key="note:ar:other", value="قلم")[0] == 200
    everywhere = ["note:ar:bare", "note:ar:stretched", "note:ar:vowelled"]
    assert _keys(api, KITAB) == everywhere
    assert _keys(api, KITAB_VOWELLED) == everywhere
    assert _keys(api, KITAB_STRETCHED) == everywhere
    assert _keys(api, "جَدِيدٌ") == ["note:ar:vowelled"]
    # Stored as given: the value keeps its harakat and tatweel.
    assert api.call("memory_read", key="note:ar:vowelled")[1]["value"] == f"هذا {KITAB_VOWELLED} جديد"
    assert api.call("memory_read", key="note:ar:stretched")[1]["value"] == f"{KITAB_STRETCHED} مزخرف"


def test_hebrew_with_or_without_niqqud_finds_the_other(api):
    assert api.call("memory_write", key="note:he:pointed", value=f"{SEFER_POINTED} חָדָשׁ")[0] == 200
    assert api.call("memory_write", key="note:he:bare", value=f"{SEFER} ישן")[0] == 200
    assert _keys(api, SEFER) == ["note:he:bare", "note:he:pointed"]
    assert _keys(api, SEFER_POINTED) == ["note:he:bare", "note:he:pointed"]
    assert _keys(api, "חדש") == ["note:he:pointed"]


def test_persian_with_or_without_the_non_joiner_finds_the_other(api):
    assert api.call("memory_write", key="note:fa:zwnj", value="این کتاب\u200cها را می\u200cخواهم")[0] == 200
    assert api.call("memory_write", key="note:fa:joined", value="کتابها")[0] == 200
    assert api.call("memory_write", key="note:fa:single", value="یک کتاب")[0] == 200
    assert _keys(api, "کتاب\u200cها") == ["note:fa:joined", "note:fa:single", "note:fa:zwnj"]
    # (and note:fa:single by the abbreviation every word longer than 4 letters looks for)
    _, body = api.call("memory_search", query="کتابها")
    assert sorted(r["key"] for r in body["results"][:2]) == ["note:fa:joined", "note:fa:zwnj"], body
    assert _keys(api, "میخواهم") == ["note:fa:zwnj"]
    assert api.call("memory_read", key="note:fa:zwnj")[1]["value"] == "این کتاب\u200cها را می\u200cخواهم"


def test_a_tag_and_a_key_segment_are_folded_too(api):
    assert api.call("memory_write", key=f"note:ar:{KITAB_VOWELLED}", value="x", tags=["عَرَبِيّ"])[0] == 200
    assert _keys(api, KITAB) == [f"note:ar:{KITAB_VOWELLED}"]
    assert _keys(api, "عربي") == [f"note:ar:{KITAB_VOWELLED}"]


def test_memories_indexed_before_the_folding_are_found_after_search_reindex(api, tenant_a, monkeypatch):
    """Written by the old tokenizer (terms with their harakat), a memory is not found by the
    bare word until ``manage.py search_reindex`` rewrites its terms."""
    with monkeypatch.context() as m:
        m.setattr(text, "fold", lambda t: t)
        assert api.call("memory_write", key="note:ar:old", value=KITAB_VOWELLED)[0] == 200
    assert f"{tenant_a.pk}:{KITAB_VOWELLED}" in Memory.objects.get(key="note:ar:old").search_text
    assert _keys(api, KITAB) == []
    call_command("search_reindex", tenant=tenant_a.slug, stdout=io.StringIO())
    assert Memory.objects.get(key="note:ar:old").search_text.endswith(f"{tenant_a.pk}:{KITAB}")
    assert _keys(api, KITAB) == ["note:ar:old"]
    assert _keys(api, KITAB_VOWELLED) == ["note:ar:old"]


@pytest.mark.parametrize("sample", ["हिंदी नमस्ते " * 500, "周报发送时间 " * 1000, "the quick brown fox " * 500])
def test_text_without_folded_marks_tokenizes_as_before(sample):
    """The fold is one regex pass that finds nothing in other scripts."""
    assert text.fold(sample) == sample
