"""Migration 0044: LangGraph items stored before their subject was inferred (subject "") get
the subject their namespace ``("users", <id>, …)`` names, live and trashed, by the rule a
write uses (zeromem.kernel.subjectkeys.subject_of_key). Before, ``?subject=`` lists, the
admin's subject filter and everything keyed on ``subject`` missed them."""

import importlib
import json

import pytest
from django.core.management import call_command

from audit.models import AuditEvent
from memories import services
from memories.models import Memory, MemoryVersion
from tests.factories import SYSTEM, make_keyed_client, make_tenant, write
from zeromem.kernel import subjectkeys

ITEMS = "/api/v1/langgraph/store/items"
MIGRATION = "memories.migrations.0044_langgraph_items_subject_backfill"


def put(client, namespace, key, value):
    r = client.put(ITEMS, {"namespace": namespace, "key": key, "value": value})
    assert r.status_code == 204, r.content


def listed(client, subject):
    r = client.get("/api/v1/memories", {"subject": subject})
    assert r.status_code == 200, r.content
    return sorted(m["key"] for m in r.json()["results"])


def test_the_migration_uses_the_rule_a_write_uses():
    assert importlib.import_module(MIGRATION).subject_of_key is subjectkeys.subject_of_key


@pytest.mark.django_db(transaction=True)
def test_old_langgraph_items_get_the_subject_their_namespace_names(monkeypatch):
    migration = importlib.import_module(MIGRATION)
    monkeypatch.setattr(migration, "BATCH", 2)  # several batches per namespace range
    tenant, other = make_tenant("lg-backfill"), make_tenant("lg-backfill-other")
    client, _ = make_keyed_client(tenant)
    other_client, _ = make_keyed_client(other)
    put(client, ["users", "u1"], "prefs", {"lang": "fr"})
    put(client, ["users", "u1"], "prefs", {"lang": "en"})  # two versions
    put(client, ["users", "u1", "notes"], "n1", {"text": "x"})
    put(client, ["users", "u1", "notes"], "n2", {"text": "y"})
    put(client, ["user", "u2"], "prefs", {"lang": "de"})
    put(client, ["usr", "u3", "a"], "b", {"lang": "it"})
    put(client, ["users", "a:b"], "prefs", {"lang": "nl"})
    put(client, ["users", "u1"], "gone", {"text": "trashed"})
    body = json.dumps({"namespace": ["users", "u1"], "key": "gone"})
    r = client.client.delete(ITEMS, body, content_type="application/json", headers=client._headers(None))
    assert r.status_code == 204, r.content
    put(client, ["docs", "u1"], "readme", {"text": "about no one"})
    put(client, ["users"], "u1", {"text": "a key, not a namespace"})
    put(other_client, ["users", "u1"], "prefs", {"lang": "fr"})
    write(tenant, "lg:users:u4:prefs", {"lang": "pt"}, subject="u10")  # handed to another user
    write(tenant, "lg:users:a~7e:prefs", {"x": 1})  # no item's key: names no one
    write(tenant, "user:u5:note", {"x": 1}, subject="")  # not LangGraph: left as it is
    # As stored before subjects were inferred: none on the LangGraph items, nor their versions.
    old = Memory.objects.filter(key__startswith="lg:").exclude(key="lg:users:u4:prefs")
    MemoryVersion.objects.filter(memory__in=old).update(subject="")
    old.update(subject="")
    assert Memory.objects.filter(tenant=tenant, key="lg:users:u1:gone").exclude(deleted_at=None).exists()
    assert listed(client, "u1") == []
    before = {m.pk: (m.version, m.updated_at) for m in Memory.objects.all()}
    events = AuditEvent.objects.count()
    try:
        call_command("migrate", "memories", "0043", verbosity=0)
        call_command("migrate", "memories", "0044", verbosity=0)
    finally:
        call_command("migrate", verbosity=0)
    # Only the subject moved: no version, no new write time, no audit event; versions keep "".
    assert AuditEvent.objects.count() == events
    assert {m.pk: (m.version, m.updated_at) for m in Memory.objects.all()} == before
    assert set(MemoryVersion.objects.filter(memory__in=old).values_list("subject", flat=True)) == {""}
    subjects = dict(Memory.objects.filter(tenant=tenant).values_list("key", "subject"))
    assert subjects == {
        "lg:users:u1:prefs": "u1",
        "lg:users:u1:notes:n1": "u1",
        "lg:users:u1:notes:n2": "u1",
        "lg:user:u2:prefs": "u2",
        "lg:usr:u3:a:b": "u3",
        "lg:users:a~3Ab:prefs": "a:b",
        "lg:users:u1:gone": "u1",  # trashed
        "lg:docs:u1:readme": "",
        "lg:users:u1": "",
        "lg:users:u4:prefs": "u10",
        "lg:users:a~7e:prefs": "",
        "user:u5:note": "",
    }
    assert Memory.objects.get(tenant=other, key="lg:users:u1:prefs").subject == "u1"
    assert listed(client, "u1") == ["lg:users:u1:notes:n1", "lg:users:u1:notes:n2", "lg:users:u1:prefs"]
    assert listed(client, "u2") == ["lg:user:u2:prefs"] and listed(other_client, "u2") == []
    # A subject's forget still takes them, versions and all.
    request = services.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u1")
    services.forget_request_execute(request_id=request.pk)
    assert not Memory.objects.filter(tenant=tenant, key__startswith="lg:users:u1:").exists()
    assert not MemoryVersion.objects.filter(tenant=tenant, memory__key__startswith="lg:users:u1:").exists()
    assert Memory.objects.filter(tenant=other, key="lg:users:u1:prefs").exists()
