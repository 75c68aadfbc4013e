"""The write's own Python (README "The hot path", `manage.py bench_write`): what was made
cheaper gives what it gave before — the search columns (the key's and tags' terms computed
once per key, the tsvector and search text built with fewer calls), the version row built
without ``Model.__init__``, the client address prepared once per address."""

import dataclasses

import pytest
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models.signals import post_init

from audit import services as audit_services
from audit.models import AuditEvent
from memories import selectors, services
from memories.models import Memory, MemoryVersion
from memories.search import text
from memories.services import memories as memory_services
from tests.factories import SYSTEM, write

KEY = "user:u1:pref_lang"


# --- the search columns: the first implementation, kept here to compare with --------------


def _reference_document(*, key, value, tags=None) -> text.IndexDocument:
    seen: dict[str, int] = {}

    def capped(words):
        kept = []
        for word in words:
            term = text.stem(word)
            n = seen.get(term, 0)
            if n == 0 and len(seen) >= text.DOC_MAX_TERMS:
                continue
            if n < text.TERM_CAP:
                seen[term] = n + 1
                kept.append(term)
        return kept

    key_terms = capped(text.tokenize(key.replace(":", " ")))
    tag_terms = capped(text.tokenize(" ".join(tags or ())))
    body_terms = capped(text.tokenize(text.value_text(value)))
    return text.IndexDocument(key=key_terms, tags=tag_terms, body=body_terms)


def _reference_search_text(doc, tenant_id) -> str:
    return text.FIELD_SEPARATOR.join(" ".join(f"{tenant_id}:{t}" for t in terms) for terms in doc.fields)


def _reference_tsvector(doc, tenant_id) -> str:
    positions: dict[str, list[str]] = {}
    pos = 0
    for terms, weight in zip(doc.fields, ("A", "B", ""), strict=True):
        for term in terms:
            pos = min(pos + 1, text._MAX_POSITION)
            positions.setdefault(term, []).append(f"{pos}{weight}")
    return " ".join(f"'{text._tsquote(f'{tenant_id}:{term}')}':{','.join(p)}" for term, p in positions.items())


DOCUMENTS = [
    ("user:u1:pref_lang", "value 1 in a few words", []),
    ("user:u1:pref_lang", "", None),
    ("user:u1:pref_lang", None, ["lang", "prefs"]),
    ("", "", []),
    ("note:x", {"lang": "zh-CN", "note": "简体中文的用户偏好", "n": [1, 2.5, True, None]}, ["中文", "a"]),
    ("task:deadline:deadlines", "installed packages installing distributions deadline deadline", ["task", "task"]),
    ("k", "हिंदी ภาษาไทย café naïve Ｆｕｌｌ ﬁne 한국어 かな", ["é"]),
    ("lang:lang:lang", "lang lang lang lang", ["lang", "lang"]),
    ("x", " ".join(f"w{i}" for i in range(20000)), []),  # positions past 16383, clamped
    ("x", " ".join(f"w{i % 50}" for i in range(40000)), []),
    ("x", "a" * 65 + " " + "b" * 64, ["c" * 65]),
]


@pytest.mark.parametrize(("key", "value", "tags"), DOCUMENTS)
@pytest.mark.parametrize("tenant_id", [17, 1, "o'k\\"])
def test_the_search_columns_are_the_ones_the_first_implementation_built(key, value, tags, tenant_id):
    for _ in range(2):  # computed, then from the key's cached terms
        doc = text.index_document(key=key, value=value, tags=tags)
        reference = _reference_document(key=key, value=value, tags=tags)
        assert doc == reference
        assert doc.search_text(tenant_id) == _reference_search_text(reference, tenant_id)
        assert doc.tsvector(tenant_id) == _reference_tsvector(reference, tenant_id)


def test_a_quote_or_backslash_in_a_term_is_quoted_as_before():
    doc = text.IndexDocument(key=["it's"], tags=["a\\b"], body=["plain", "it's"])
    assert doc.tsvector(3) == _reference_tsvector(doc, 3) == "'3:it''s':1A,4 '3:a\\\\b':2B '3:plain':3"


def test_the_cached_key_terms_are_not_shared_with_a_document():
    first = text.index_document(key="user:u9:prefs", value="prefs again", tags=["t"])
    first.key.append("changed"), first.tags.clear(), first.body.clear()
    again = text.index_document(key="user:u9:prefs", value="prefs again", tags=["t"])
    assert again == _reference_document(key="user:u9:prefs", value="prefs again", tags=["t"])
    # The value's terms were counted after the key's (each term at most TERM_CAP times).
    assert again.key == ["user", "u9", "pref"] and again.body == ["pref", "again"]


# --- the version row built directly ----------------------------------------------------


def _as_built(v: MemoryVersion) -> dict:
    fields = {k: v for k, v in v.__dict__.items() if k != "_state"}
    return {
        "fields": fields,
        "adding": v._state.adding,
        "db": v._state.db,
        "cache": dict(v._state.fields_cache),
        "type": type(v),
    }


def _attrs(memory, now):
    return {
        "tenant_id": memory.tenant_id,
        "version": memory.version,
        "value": memory.value,
        "sensitive": memory.sensitive,
        "op": MemoryVersion.Op.WRITE,
        "actor_kind": SYSTEM.kind,
        "actor_id": SYSTEM.id,
        "created_at": now,
        "subject": memory.subject,
    }


@pytest.mark.parametrize("sensitive", [False, True])
def test_the_version_row_is_the_instance_model_init_builds(tenant_a, sensitive):
    write(tenant_a, KEY, {"lang": "zh-CN"}, sensitive=sensitive, subject="u1")
    memory = selectors.memory_get_live(tenant=tenant_a, key=KEY)
    now = memory.updated_at
    direct = memory_services._new_version(memory, **_attrs(memory, now))
    assert memory_services._version_built_directly()
    assert _as_built(direct) == _as_built(MemoryVersion(memory=memory, **_attrs(memory, now)))
    assert direct.memory is memory and direct.pk is None


def test_a_version_built_while_an_init_receiver_listens_goes_through_model_init(tenant_a):
    write(tenant_a, KEY, "zh-CN")
    memory = selectors.memory_get_live(tenant=tenant_a, key=KEY)
    seen = []

    def receiver(sender, instance, **kwargs):
        seen.append(instance)

    post_init.connect(receiver, sender=MemoryVersion)
    try:
        built = memory_services._new_version(memory, **_attrs(memory, memory.updated_at))
    finally:
        post_init.disconnect(receiver, sender=MemoryVersion)
    assert seen == [built]


def test_writes_record_their_versions_as_before(tenant_a):
    write(tenant_a, KEY, "one", subject="u1")
    write(tenant_a, KEY, {"two": 2}, sensitive=True)
    write(tenant_a, KEY, "three")
    memory = Memory.objects.get(tenant=tenant_a, key=KEY)
    versions = list(MemoryVersion.objects.filter(memory=memory).order_by("version"))
    assert [(v.version, v.value, v.sensitive, v.op, v.subject, v.tenant_id) for v in versions] == [
        (1, "one", True, "write", "u1", tenant_a.pk),  # sealed when the memory turned sensitive
        (2, {"two": 2}, True, "write", "u1", tenant_a.pk),
        (3, "three", True, "write", "u1", tenant_a.pk),
    ]
    assert all(v.created_at is not None and v.actor_kind == SYSTEM.kind for v in versions)


# --- the client address prepared once ---------------------------------------------------


@pytest.mark.parametrize("address", ["10.0.0.1", "2001:db8::1", "::ffff:10.0.0.1", "fe80::1%eth0"])
def test_a_client_address_is_prepared_as_its_field_prepares_it(address, db):
    conn = connections[DEFAULT_DB_ALIAS]
    field = AuditEvent._meta.get_field("client_ip")
    stored = audit_services._ip(address)
    if stored is None:
        pytest.skip("not an address _ip keeps")
    expected = field.get_db_prep_save(stored, conn)
    assert audit_services._ip_prepared(field, stored, conn) == expected
    assert audit_services._ip_prepared(field, stored, conn) == expected  # from the cache
    assert type(audit_services._ip_prepared(field, stored, conn)) is type(expected)


def test_the_prepared_addresses_are_bounded(db, monkeypatch):
    conn = connections[DEFAULT_DB_ALIAS]
    field = AuditEvent._meta.get_field("client_ip")
    monkeypatch.setattr(audit_services, "_IP_PREPARED", {})
    monkeypatch.setattr(audit_services, "_IP_PREPARED_MAX", 4)
    for i in range(10):
        assert audit_services._ip_prepared(field, f"10.0.0.{i}", conn) == field.get_db_prep_save(f"10.0.0.{i}", conn)
        assert len(audit_services._IP_PREPARED) <= 4


def test_the_event_stores_the_client_address(tenant_a):
    actor = dataclasses.replace(SYSTEM, client_ip="2001:0db8:0000::0001")
    for _ in range(2):
        services.memory_write(tenant=tenant_a, actor=actor, key=KEY, value="v")
    events = AuditEvent.objects.filter(tenant=tenant_a, action="memory.write").order_by("-id")[:2]
    assert [e.client_ip for e in events] == ["2001:db8::1", "2001:db8::1"]
