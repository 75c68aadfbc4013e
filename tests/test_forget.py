"""Forget requests: POST/GET /api/v1/forget-requests, the job that carries them out
(memories.services.forget), its receipt, deadline, retries and the residue it must not leave."""

import json
import threading
import uuid
from datetime import datetime, timedelta

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType
from django.db import connection, transaction
from django.utils import timezone
from django_q.models import OrmQ, Task
from django_q.signing import SignedPackage

from audit import services as audit_services
from audit.models import AuditEvent
from audit.verify import audit_verify
from memories import services, tasks
from memories.models import ForgetRequest, Job, Membership, Memory, MemoryVersion
from memories.services import forget, jobs, subjects
from tests.factories import SYSTEM, make_staff, make_tenant, seed_user, summarize, write
from tests.helpers import memory_rows, rest_error, start_thread, wait_for_a_lock_waiter
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import NotFound
from zeromem.kernel.outcomes import ActorKind
from zeromem.kernel.scopes import Scope

URL = "/api/v1/forget-requests"
RECEIPT_FIELDS = {
    "memories",
    "versions",
    "summaries",
    "admin_log_entries",
    "batches",
    "audit_events_redacted",
    "summaries_rebuilt",
    "data_keys_destroyed",
    "crypto_shredded",
    "received_at",
    "started_at",
    "completed_at",
}
CANARY = "CANARY-7d1e-ZZ"
END_USER_IP = "198.51.100.77"  # the forgotten end user's own address (portal)


def post(client, capture, body, run=True):
    """POST a forget request; with ``run`` its job runs inline once the request commits."""
    with capture(execute=run):
        return client.post(URL, body)


def pk_of(uid) -> int:
    """The row id of the request shown as ``uid`` (the API shows the uid, never the row id)."""
    return ForgetRequest.objects.values_list("pk", flat=True).get(uid=uid)


def get(client, pk):
    """GET a request by its uid (a row id given here is looked up: the URL takes the uid)."""
    uid = ForgetRequest.objects.get(pk=pk).uid if isinstance(pk, int) else pk
    r = client.get(f"{URL}/{uid}")
    assert r.status_code == 200, r.content
    return r.json()


# --- accepting a request ------------------------------------------------------------------


def test_request_is_stored_and_answered_202_before_the_job_runs(api, tenant_a, django_capture_on_commit_callbacks):
    seed_user(tenant_a)
    before = memory_rows(tenant_a)
    with django_capture_on_commit_callbacks() as callbacks:
        r = api.post(URL, {"subject": "u1", "reason": "user asked"})
    assert r.status_code == 202, r.content
    body = r.json()
    assert r["Location"] == f"{URL}/{body['id']}"
    assert body["status"] == "received" and body["target"] == {"subject": "u1"} and body["receipt"] is None
    assert body["overdue"] is False and body["reason"] == "user asked"
    due = datetime.fromisoformat(body["due_at"].replace("Z", "+00:00"))
    assert timedelta(days=29, hours=23) < due - timezone.now() <= timedelta(days=30)

    # Stored (and committed: the enqueue waits for the commit) before the answer; the job
    # has not run yet, and its queue payload is the id alone.
    stored = ForgetRequest.objects.get(uid=body["id"])
    assert stored.status == "received" and stored.tenant == tenant_a and stored.subject == "u1"
    assert memory_rows(tenant_a) == before
    assert len(callbacks) == 1
    assert callbacks[0].func is forget._enqueue and callbacks[0].args == (stored.pk,)

    callbacks[0]()  # the worker picks it up (django-q2 runs it inline in tests)
    done = get(api, stored.pk)
    assert done["status"] == "completed" and done["receipt"]["memories"] == 5
    assert memory_rows(tenant_a, subject="u1") == []


@pytest.mark.django_db(transaction=True)
def test_request_is_committed_before_it_is_enqueued(monkeypatch, make_client):
    tenant = make_tenant("durable")
    client, _key = make_client(tenant, scopes=[Scope.FORGET_CREATE])
    seen = []

    def record_enqueue(func, request_id, **options):
        # Enqueued outside any transaction, with the row already there for any worker.
        seen.append(
            (func, request_id, connection.in_atomic_block, ForgetRequest.objects.filter(pk=request_id).exists())
        )

    monkeypatch.setattr(forget, "async_task", record_enqueue)
    r = client.post(URL, {"keys": ["user:u1:a"]})
    assert r.status_code == 202
    assert seen == [("memories.tasks.forget_request_task", pk_of(r.json()["id"]), False, True)]


def test_forget_by_subject_erases_memories_versions_trash_and_summaries(
    api, api_b, tenant_a, tenant_b, django_capture_on_commit_callbacks
):
    seed_user(tenant_a, "u1", n=3, versions=2)  # 5 memories, 3×2 + 2 + 1 versions
    seed_user(tenant_a, "u2", n=2)
    seed_user(tenant_b, "u1", n=2)  # same subject, another tenant
    summary = summarize(tenant_a, "user:u1:", django_capture_on_commit_callbacks)  # subject u1
    other_summary = summarize(tenant_a, "user:u2:", django_capture_on_commit_callbacks)
    untouched = (memory_rows(tenant_a, subject="u2"), memory_rows(tenant_b))
    versions_u2 = MemoryVersion.objects.filter(memory__subject="u2").count()

    r = post(api, django_capture_on_commit_callbacks, {"subject": "u1"})
    assert r.status_code == 202, r.content
    done = get(api, r.json()["id"])

    assert done["status"] == "completed" and done["completed_at"] and done["started_at"]
    receipt = done["receipt"]
    assert set(receipt) == RECEIPT_FIELDS
    assert {k: receipt[k] for k in ("memories", "versions", "summaries", "admin_log_entries")} == {
        "memories": 5,
        "versions": 3 * 2 + 2 + 1 + 1,  # + the summary's one version
        "summaries": 1,
        "admin_log_entries": 0,
    }
    # The writes of u1's memories (subject u1) were audited; their events are redacted now.
    assert receipt["batches"] >= 1 and receipt["audit_events_redacted"] >= 5
    for name in ("received_at", "started_at", "completed_at"):
        datetime.fromisoformat(receipt[name].replace("Z", "+00:00"))
    assert receipt["received_at"] <= receipt["started_at"] <= receipt["completed_at"]

    assert Memory.objects.filter(tenant=tenant_a, subject="u1").count() == 0
    assert not Memory.objects.filter(pk=summary.pk).exists()
    assert not MemoryVersion.objects.filter(memory_id=summary.pk).exists()
    assert MemoryVersion.objects.filter(tenant=tenant_a, memory__subject="u1").count() == 0
    assert Memory.objects.filter(pk=other_summary.pk).exists()
    assert (memory_rows(tenant_a, subject="u2"), memory_rows(tenant_b)) == untouched
    assert MemoryVersion.objects.filter(memory__subject="u2").count() == versions_u2


def test_a_whitespace_only_subject_stored_before_writes_refused_it_can_still_be_forgotten(
    api, tenant_a, django_capture_on_commit_callbacks
):
    legacy = write(tenant_a, "note:n1:x", "about nobody in particular")
    Memory.objects.filter(pk=legacy.pk).update(subject="  ")  # as written before the rule
    kept = write(tenant_a, "note:n1:y", "kept", subject="u2")
    r = post(api, django_capture_on_commit_callbacks, {"subject": "  "})
    assert r.status_code == 202, r.content
    assert get(api, r.json()["id"])["receipt"]["memories"] == 1
    assert not Memory.objects.filter(pk=legacy.pk).exists() and Memory.objects.filter(pk=kept.pk).exists()


def test_forget_by_subject_erases_their_versions_of_a_key_since_rewritten_for_someone_else(
    api, tenant_a, tenant_b, django_capture_on_commit_callbacks
):
    """A key the app rewrote for another end user keeps its memory (the value now is theirs);
    the forgotten user's earlier values go from its history."""
    write(tenant_a, "shared:other", "u3 only", subject="u3")
    for tenant in (tenant_a, tenant_b):
        write(tenant, "shared:profile", f"{CANARY} u1 v1", subject="u1")
        write(tenant, "shared:profile", f"{CANARY} u1 v2", subject="u1")
    made_before = summarize(tenant_a, "shared:", django_capture_on_commit_callbacks)  # u1's v2 and u3's
    assert CANARY in made_before.value
    for tenant in (tenant_a, tenant_b):
        write(tenant, "shared:profile", "u2 now", subject="u2")
    made_after = summarize(tenant_a, "shared:pro", django_capture_on_commit_callbacks)  # u2's value
    made_after_value = made_after.value
    memory = Memory.objects.get(tenant=tenant_a, key="shared:profile")
    assert list(MemoryVersion.objects.filter(memory=memory).order_by("version").values_list("subject", flat=True)) == [
        "u1",
        "u1",
        "u2",
    ]
    b_versions = list(MemoryVersion.objects.filter(tenant=tenant_b).values_list("pk", "value"))

    r = post(api, django_capture_on_commit_callbacks, {"subject": "u1"})
    done = get(api, r.json()["id"])

    assert done["status"] == "completed"
    assert (done["receipt"]["memories"], done["receipt"]["versions"]) == (0, 2 + 1)  # + the summary's
    # The summary made while the profile was u1's goes (staff reach every summary: erased
    # whole, as one made of a forgotten memory); the one made of u2's value stays.
    assert done["receipt"]["summaries"] == 1 and not Memory.objects.filter(pk=made_before.pk).exists()
    made_after.refresh_from_db()
    assert made_after.value == made_after_value
    memory.refresh_from_db()
    assert (memory.value, memory.subject, memory.version) == ("u2 now", "u2", 3)
    assert list(MemoryVersion.objects.filter(memory=memory).values_list("version", "value")) == [(3, "u2 now")]
    history = api.get("/api/v1/memories/shared:profile/history")
    assert history.status_code == 200, history.content
    assert CANARY not in history.content.decode()
    assert Memory.objects.filter(tenant=tenant_a, key="shared:other").exists()
    assert list(MemoryVersion.objects.filter(tenant=tenant_b).values_list("pk", "value")) == b_versions
    erased = AuditEvent.objects.filter(tenant=tenant_a, action="forget.erase", detail__forget_request=r.json()["id"])
    assert [(e.detail["versions"], e.detail["summaries"]) for e in erased] == [(3, 1)]
    # The erased version cannot be brought back by a restore of its number (support staff's).
    with pytest.raises(NotFound):
        services.memory_restore_version(tenant=tenant_a, actor=SYSTEM, memory_id=memory.pk, version=1)
    assert MemoryVersion.objects.filter(memory=memory).count() == 1


def test_an_end_users_forget_of_one_key_erases_their_versions_of_it_and_keeps_the_new_owners(
    tenant_a, django_capture_on_commit_callbacks
):
    write(tenant_a, "user:u1:nick", f"{CANARY} nick", tags=["a"])  # subject u1 (from the key)
    write(tenant_a, "user:u1:city", f"{CANARY} city")  # theirs, not asked for
    write(tenant_a, "user:u2:addr", "u2 lives on Elm Street")
    shared = summarize(tenant_a, "user:", django_capture_on_commit_callbacks)  # of everyone's, u1's nick too
    assert shared.subject == "" and f"{CANARY} nick" in shared.value
    end_user = Actor(kind=ActorKind.END_USER, id="u1", scopes=frozenset({Scope.MEMORY_READ, Scope.FORGET_CREATE}))
    with django_capture_on_commit_callbacks(execute=False):
        request = subjects.subject_forget(tenant=tenant_a, actor=end_user, subject="u1", key="user:u1:nick")
    # Before the job runs, the app gives both keys to another end user.
    write(tenant_a, "user:u1:nick", "u7 took it", subject="u7")
    write(tenant_a, "user:u1:city", "u7 city", subject="u7")
    later = summarize(tenant_a, "user:u1:", django_capture_on_commit_callbacks)  # made of u7's values
    later_value = later.value
    assert "u7 took it" in later_value and CANARY not in later_value
    forget.forget_request_execute(request_id=request.pk)
    request.refresh_from_db()

    assert request.status == "completed"
    assert (request.receipt["memories"], request.receipt["versions"]) == (0, 1)
    # The summary made while the nick was u1's is rebuilt without it (it is of other people
    # too); the one made of u7's values stays as it was.
    assert request.receipt["summaries_rebuilt"] == ["summary:user"]
    shared.refresh_from_db()
    assert f"{CANARY} nick" not in str(shared.value) and "user:u1:nick" not in shared.sources
    assert "u2 lives on Elm Street" in shared.value
    later.refresh_from_db()
    assert later.value == later_value
    nick = Memory.objects.get(tenant=tenant_a, key="user:u1:nick")
    assert (nick.value, nick.subject) == ("u7 took it", "u7")
    assert list(MemoryVersion.objects.filter(memory=nick).values_list("value", flat=True)) == ["u7 took it"]
    # Only the key asked for: their versions under another key stay.
    city = Memory.objects.get(tenant=tenant_a, key="user:u1:city")
    assert MemoryVersion.objects.filter(memory=city, subject="u1").count() == 1


@pytest.mark.parametrize("after_hand_over", ["summarized_again", "trashed", "tagged"])
def test_a_summary_made_while_a_handed_over_key_was_theirs_goes_whatever_happened_to_it_since(
    tenant_a, after_hand_over, django_capture_on_commit_callbacks
):
    """Whether a summary holds the forgotten user's value was judged by its last write
    (``updated_at``) alone: a summary made from u1's value and then made again from u2's kept
    u1's text in its history; one trashed or re-tagged after the hand-over kept it as its value."""
    write(tenant_a, "shared:profile", f"{CANARY} u1", subject="u1")
    write(tenant_a, "shared:other", "u3 only", subject="u3")
    made = summarize(tenant_a, "shared:", django_capture_on_commit_callbacks)
    assert CANARY in str(made.value)
    write(tenant_a, "shared:profile", "u2 now", subject="u2")  # handed over
    if after_hand_over == "summarized_again":
        summarize(tenant_a, "shared:", django_capture_on_commit_callbacks)  # of u2's value now
    elif after_hand_over == "trashed":
        services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=made.key)
    else:
        services.memory_update(tenant=tenant_a, actor=SYSTEM, key=made.key, tags=["kept"])

    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    forget.forget_request_execute(request_id=request.pk)
    request.refresh_from_db()

    assert request.status == "completed"
    assert not [m.key for m in Memory.objects.filter(tenant=tenant_a) if CANARY in str(m.value)]
    assert not [
        (v.memory_id, v.version) for v in MemoryVersion.objects.filter(tenant=tenant_a) if CANARY in str(v.value)
    ]
    assert request.receipt["summaries"] == 1  # staff reach every summary: erased whole
    profile = Memory.objects.get(tenant=tenant_a, key="shared:profile")
    assert (profile.value, profile.subject) == ("u2 now", "u2")


def test_a_summary_first_made_before_a_handed_over_key_existed_and_again_after_stays(
    tenant_a, django_capture_on_commit_callbacks
):
    """Its first version predates the key (no version of it then: not the forgotten user's
    value), its second was made of the new owner's value: nothing of u1's in it."""
    write(tenant_a, "shared:other", "u3 only", subject="u3")
    summarize(tenant_a, "shared:", django_capture_on_commit_callbacks)  # of u3's only
    write(tenant_a, "shared:profile", f"{CANARY} u1", subject="u1")
    write(tenant_a, "shared:profile", "u2 now", subject="u2")  # handed over
    again = summarize(tenant_a, "shared:", django_capture_on_commit_callbacks)
    assert "u2 now" in str(again.value) and "shared:profile" in again.sources
    versions = list(MemoryVersion.objects.filter(memory=again).order_by("version").values_list("version", "value"))

    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    forget.forget_request_execute(request_id=request.pk)
    request.refresh_from_db()

    assert request.status == "completed" and request.receipt["summaries"] == 0
    assert list(MemoryVersion.objects.filter(memory=again).order_by("version").values_list("version", "value")) == (
        versions
    )


def test_forget_by_prefix_follows_lineage_to_summaries_without_the_subject(
    api, tenant_a, django_capture_on_commit_callbacks
):
    # A team namespace with memories of two subjects: its summary has no subject, only sources.
    write(tenant_a, "team:t1:lead", "Ann leads", subject="u1")
    write(tenant_a, "team:t1:plan", "ship it", subject="u2")
    write(tenant_a, "doc:d1:intro", "unrelated")
    write(tenant_a, "doc:d2:intro", "doc two")
    team_summary = summarize(tenant_a, "team:t1:", django_capture_on_commit_callbacks)
    doc_summary = summarize(tenant_a, "doc:", django_capture_on_commit_callbacks)
    assert team_summary.subject == "" and set(team_summary.sources) == {"team:t1:lead", "team:t1:plan"}

    r = post(api, django_capture_on_commit_callbacks, {"prefix": "team:t1:"})
    receipt = get(api, r.json()["id"])["receipt"]

    assert (receipt["memories"], receipt["summaries"]) == (2, 1)
    assert not Memory.objects.filter(key__startswith="team:t1:").exists()
    assert not Memory.objects.filter(pk=team_summary.pk).exists()
    assert Memory.objects.filter(pk=doc_summary.pk).exists()
    assert memory_rows(tenant_a, key__startswith="doc:") == [
        ("doc:d1:intro", 1, None),
        ("doc:d2:intro", 1, None),
    ]


def test_forget_by_prefix_keeps_the_keys_that_differ_from_it_only_in_case(
    api, tenant_a, django_capture_on_commit_callbacks
):
    # Keys are case-sensitive; on SQLite the prefix's LIKE was not, and erased these too.
    write(tenant_a, "team:t1:lead", "Ann leads")
    for key in ("TEAM:T1:lead", "Team:t1:plan"):
        write(tenant_a, key, "kept")
    r = post(api, django_capture_on_commit_callbacks, {"prefix": "team:t1:"})
    assert get(api, r.json()["id"])["receipt"]["memories"] == 1
    assert sorted(Memory.objects.filter(tenant=tenant_a).values_list("key", flat=True)) == [
        "TEAM:T1:lead",
        "Team:t1:plan",
    ]


def _shared_summary(tenant, capture):
    """summary:user over u1's, u2's and u10's memories (no subject: they are three people)."""
    write(tenant, "user:u1:pref_lang", f"zh-CN {CANARY}")
    write(tenant, "user:u2:addr", "u2 lives on Elm Street")
    write(tenant, "user:u10:secret", "u10 keeps a secret")
    summary = summarize(tenant, "user:", capture)
    assert summary.subject == "" and CANARY in summary.value
    return summary


def _assert_rebuilt_without_the_canary(summary):
    rebuilt = Memory.objects.get(pk=summary.pk)  # rebuilt in place, not erased
    assert CANARY not in str(rebuilt.value) and "user:u1:pref_lang" not in rebuilt.sources
    assert "u2 lives on Elm Street" in rebuilt.value and "u10 keeps a secret" in rebuilt.value
    assert set(rebuilt.sources) == {"user:u2:addr", "user:u10:secret"}
    history = list(MemoryVersion.objects.filter(memory_id=summary.pk).values_list("value", flat=True))
    assert history == [rebuilt.value]  # the old versions held the forgotten line
    assert CANARY not in rebuilt.search_text


def test_a_limited_keys_forget_rebuilds_a_shared_summary_instead_of_erasing_it(
    tenant_a, make_client, django_capture_on_commit_callbacks
):
    summary = _shared_summary(tenant_a, django_capture_on_commit_callbacks)
    client, _ = make_client(tenant_a, allow=["user:u1:"])
    r = post(client, django_capture_on_commit_callbacks, {"keys": ["user:u1:pref_lang"]})
    assert r.status_code == 202, r.content
    done = get(client, r.json()["id"])
    assert done["status"] == "completed"
    assert (done["receipt"]["memories"], done["receipt"]["summaries"]) == (1, 0)
    # summary:user is outside the key's allowlist: counted, not named (DESIGN: an agent never
    # sees keys outside its allowlist); a key that may read it sees its name.
    assert (done["receipt"]["summaries_rebuilt"], done["receipt"]["summaries_rebuilt_outside_allowlist"]) == ([], 1)
    assert "summary:user" not in r.content.decode() + json.dumps(get(client, r.json()["id"]))
    listed = client.get("/api/v1/forget-requests").json()["results"]
    assert [row["receipt"]["summaries_rebuilt"] for row in listed] == [[]]
    wide, _ = make_client(tenant_a)
    seen = get(wide, r.json()["id"])["receipt"]
    assert seen["summaries_rebuilt"] == ["summary:user"] and "summaries_rebuilt_outside_allowlist" not in seen
    _assert_rebuilt_without_the_canary(summary)


def test_a_summary_rebuilt_without_its_only_permanent_source_expires_with_the_rest(
    tenant_a, make_client, django_capture_on_commit_callbacks
):
    write(tenant_a, "user:u1:pref_lang", f"zh-CN {CANARY}")  # permanent
    write(tenant_a, "user:u2:addr", "u2 lives on Elm Street", ttl_seconds=600)
    last = write(tenant_a, "user:u10:secret", "u10 keeps a secret", ttl_seconds=1200)
    summary = summarize(tenant_a, "user:", django_capture_on_commit_callbacks)
    assert summary.expires_at is None  # one source never expires
    client, _ = make_client(tenant_a, allow=["user:u1:"])
    r = post(client, django_capture_on_commit_callbacks, {"keys": ["user:u1:pref_lang"]})
    assert get(client, r.json()["id"])["receipt"]["summaries_rebuilt_outside_allowlist"] == 1
    _assert_rebuilt_without_the_canary(summary)
    # What is left of it is the expiring sources' text: it expires when the last of them does.
    assert Memory.objects.get(pk=summary.pk).expires_at == last.expires_at


def test_a_limited_prefix_forget_rebuilds_summaries_of_summaries_outside_its_allowlist(
    tenant_a, make_client, django_capture_on_commit_callbacks
):
    summary = _shared_summary(tenant_a, django_capture_on_commit_callbacks)
    # A free-text (LLM-like) summary made from the shared summary and another memory.
    write(tenant_a, "team:t1:plan", "ship on friday")
    weekly = write(tenant_a, "summary:weekly", f"weekly: {CANARY} and a plan", category="summary")
    Memory.objects.filter(pk=weekly.pk).update(sources=["summary:user", "team:t1:plan"])
    client, _ = make_client(tenant_a, allow=["user:u1:"])
    r = post(client, django_capture_on_commit_callbacks, {"prefix": "user:u1:"})
    done = get(client, r.json()["id"])
    assert done["receipt"]["summaries"] == 0
    assert (done["receipt"]["summaries_rebuilt"], done["receipt"]["summaries_rebuilt_outside_allowlist"]) == ([], 2)
    stored = ForgetRequest.objects.get(uid=r.json()["id"]).receipt
    assert stored["summaries_rebuilt"] == ["summary:user", "summary:weekly"]
    _assert_rebuilt_without_the_canary(summary)
    weekly = Memory.objects.get(pk=weekly.pk)
    assert CANARY not in str(weekly.value) and "ship on friday" in weekly.value and "u2 lives" in weekly.value
    assert [v for v in MemoryVersion.objects.filter(memory_id=weekly.pk).values_list("value", flat=True)] == [
        weekly.value
    ]


def test_an_end_users_forget_of_one_memory_rebuilds_summaries_of_other_people(
    tenant_a, django_capture_on_commit_callbacks
):
    summary = _shared_summary(tenant_a, django_capture_on_commit_callbacks)
    own = summarize(tenant_a, "user:u1:", django_capture_on_commit_callbacks)  # subject u1: theirs
    end_user = Actor(kind=ActorKind.END_USER, id="u1", scopes=frozenset({Scope.MEMORY_READ, Scope.FORGET_CREATE}))
    with django_capture_on_commit_callbacks(execute=True):
        request = subjects.subject_forget(tenant=tenant_a, actor=end_user, subject="u1", key="user:u1:pref_lang")
    request.refresh_from_db()
    assert request.status == "completed"
    assert (request.receipt["summaries"], request.receipt["summaries_rebuilt"]) == (1, ["summary:user"])
    assert not Memory.objects.filter(pk=own.pk).exists()
    _assert_rebuilt_without_the_canary(summary)


def test_a_summary_made_only_of_forgotten_memories_is_erased_even_outside_the_allowlist(
    tenant_a, make_client, django_capture_on_commit_callbacks
):
    write(tenant_a, "user:u1:pref_lang", f"zh-CN {CANARY}")
    summary = summarize(tenant_a, "user:u1:", django_capture_on_commit_callbacks)
    client, _ = make_client(tenant_a, allow=["user:u1:"])  # summary:user:u1 is outside it
    done = get(client, post(client, django_capture_on_commit_callbacks, {"prefix": "user:u1:"}).json()["id"])
    assert (done["receipt"]["summaries"], done["receipt"]["summaries_rebuilt"]) == (1, [])
    assert not Memory.objects.filter(pk=summary.pk).exists()


def test_forgetting_a_subject_drops_its_prefix_and_key_from_finished_summarize_jobs(
    api, tenant_a, django_capture_on_commit_callbacks
):
    write(tenant_a, "user:u9:lang", "de")
    write(tenant_a, "team:t1:plan", "ship")
    summarize(tenant_a, "user:u9:", django_capture_on_commit_callbacks)
    summarize(tenant_a, "team:t1:", django_capture_on_commit_callbacks)
    post(api, django_capture_on_commit_callbacks, {"subject": "u9"})
    jobs = {job.pk: (job.params, job.result) for job in Job.objects.order_by("pk")}
    assert "u9" not in str(jobs)
    (theirs, _), (other, other_result) = jobs.values()
    assert theirs == {"archive": False, "redacted": True}
    assert other["prefix"] == "team:t1:" and other_result["key"] == "summary:team:t1"


def test_a_summarize_job_still_pending_when_its_namespace_is_forgotten_is_cancelled_and_redacted(
    api, tenant_a, django_capture_on_commit_callbacks
):
    """A job asked for before the forget completes is part of what is forgotten: a queued
    summarize of ``user:u9:`` ran after the forget, found nothing and kept ``user:u9:`` in its
    params and ``summary:user:u9`` in its result for good (only finished jobs were redacted)."""
    write(tenant_a, "user:u9:lang", "de")
    write(tenant_a, "team:t1:plan", "ship")
    with django_capture_on_commit_callbacks(execute=False):  # queued, not yet run
        theirs = services.summarize_start(tenant=tenant_a, actor=SYSTEM, prefix="user:u9:")
        other = services.summarize_start(tenant=tenant_a, actor=SYSTEM, prefix="team:t1:")
    r = post(api, django_capture_on_commit_callbacks, {"subject": "u9"})
    assert get(api, r.json()["id"])["status"] == "completed"
    services.summarize_run(job_id=theirs.pk)  # its delivery comes after all
    theirs.refresh_from_db()
    assert theirs.status == "cancelled" and theirs.finished_at is not None
    assert theirs.params == {"archive": False, "redacted": True} and not theirs.result
    assert "u9" not in str((theirs.params, theirs.result, theirs.error))
    assert not Memory.objects.filter(tenant=tenant_a, key="summary:user:u9").exists()
    event = AuditEvent.objects.get(tenant=tenant_a, action="memory.summarize.cancel")
    assert (event.count, event.detail["reason"], event.detail["job_ids"]) == (1, "forgotten", [str(theirs.uid)])
    assert event.detail["forget_request"] == r.json()["id"] and "u9" not in str(event.detail)
    other.refresh_from_db()
    assert other.status == "queued" and other.params["prefix"] == "team:t1:"


def test_forget_by_keys_erases_those_keys_and_summaries_of_summaries(api, tenant_a, django_capture_on_commit_callbacks):
    write(tenant_a, "note:n1:a", "first")
    write(tenant_a, "note:n1:a", "first, again")
    write(tenant_a, "note:n1:b", "second")
    write(tenant_a, "note:n1:c", "kept")
    level1 = summarize(tenant_a, "note:n1:", django_capture_on_commit_callbacks)
    # A summary made from that summary (lineage as the summarizer records it).
    level2 = write(tenant_a, "summary:weekly", "digest of digests", category="summary")
    Memory.objects.filter(pk=level2.pk).update(sources=[level1.key])
    unrelated = write(tenant_a, "summary:other", "other digest", category="summary")
    Memory.objects.filter(pk=unrelated.pk).update(sources=["note:n2:x"])

    r = post(api, django_capture_on_commit_callbacks, {"keys": ["note:n1:a", "note:n1:b", "note:n1:none"]})
    assert r.status_code == 202 and r.json()["target"] == {"keys": ["note:n1:a", "note:n1:b", "note:n1:none"]}
    receipt = get(api, r.json()["id"])["receipt"]

    assert (receipt["memories"], receipt["versions"], receipt["summaries"]) == (2, 3 + 2, 2)
    assert memory_rows(tenant_a, key__startswith="note:") == [("note:n1:c", 1, None)]
    assert not Memory.objects.filter(pk__in=[level1.pk, level2.pk]).exists()
    assert Memory.objects.filter(pk=unrelated.pk).exists()


def test_the_job_is_audited_per_batch_with_counts_and_never_values(api, tenant_a, django_capture_on_commit_callbacks):
    for i in range(7):
        write(tenant_a, f"user:u1:k{i}", f"secret value {i}")
    with django_capture_on_commit_callbacks() as callbacks:
        r = api.post(URL, {"subject": "u1"})
    pk = pk_of(r.json()["id"])
    forget.forget_request_execute(request_id=pk, batch_size=3)
    assert len(callbacks) == 1

    events = list(AuditEvent.objects.filter(tenant=tenant_a, action__startswith="forget.").order_by("pk"))
    assert [e.action for e in events] == [
        "forget.create",
        "forget.start",
        "forget.erase",
        "forget.erase",
        "forget.erase",
        "forget.complete",
    ]
    create, erases = events[0], events[2:5]
    uid = str(ForgetRequest.objects.get(pk=pk).uid)  # audit events name it as the API shows it
    assert create.actor_kind == "api_key" and create.detail["forget_request"] == uid
    assert [e.count for e in erases] == [3, 3, 1]
    assert all(e.actor_kind == "system" and e.actor_id == "forget" and e.surface == "job" for e in erases)
    assert all(e.detail["forget_request"] == uid for e in events)
    for e in events:
        assert "secret" not in repr((e.target, e.subject, e.detail)) and e.subject == ""


@pytest.mark.postgres
@pytest.mark.parametrize("wal", ["off", "auto"])
def test_the_erasing_batches_compress_their_wal_when_the_role_may_and_erase_the_same(
    api, tenant_a, django_capture_on_commit_callbacks, settings, monkeypatch, wal
):
    settings.ZEROMEM_PURGE_WAL_COMPRESSION = wal
    for i in range(5):
        write(tenant_a, f"user:u1:k{i}", f"value {i}")
        write(tenant_a, f"user:u1:k{i}", f"value {i}, again")
    write(tenant_a, "user:u2:k", "kept")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('wal_compression'), enumvals FROM pg_settings WHERE name = 'wal_compression'"
        )
        server, methods = cursor.fetchone()
    seen = []
    real = forget._erase_batch

    def watching(request_id, *, batch_size, **kwargs):
        more = real(request_id, batch_size=batch_size, **kwargs)
        with connection.cursor() as cursor:  # the test's one transaction: SET LOCAL still shows
            cursor.execute("SELECT current_setting('wal_compression')")
            seen.append(cursor.fetchone()[0])
        return more

    monkeypatch.setattr(forget, "_erase_batch", watching)
    with django_capture_on_commit_callbacks() as callbacks:
        pk = pk_of(api.post(URL, {"subject": "u1"}).json()["id"])
    receipt = forget.forget_request_execute(request_id=pk, batch_size=2)["receipt"]

    assert len(callbacks) == 1
    assert (receipt["memories"], receipt["versions"], receipt["batches"]) == (5, 10, 3)
    assert memory_rows(tenant_a, key__startswith="user:") == [("user:u2:k", 1, None)]
    best = next(m for m in ("zstd", "lz4", "pglz") if m in methods)
    assert seen == [server if wal == "off" else best] * 4


def test_forgetting_a_prefix_redacts_its_keys_in_old_audit_events(
    api, tenant_a, tenant_b, django_capture_on_commit_callbacks
):
    write(tenant_a, "user:u1:k", "value")
    write(tenant_a, "user:u2:k", "value")
    write(tenant_b, "user:u1:k", "value")
    r = post(api, django_capture_on_commit_callbacks, {"prefix": "user:u1:"})
    assert get(api, r.json()["id"])["receipt"]["audit_events_redacted"] >= 1
    assert not AuditEvent.objects.filter(tenant=tenant_a, target__startswith="user:u1:").exists()
    assert AuditEvent.objects.filter(tenant=tenant_a, target="user:u2:k").exists()
    assert AuditEvent.objects.filter(tenant=tenant_b, target="user:u1:k").exists()  # another tenant's


def test_the_queue_and_task_rows_carry_only_the_id(api, tenant_a, django_capture_on_commit_callbacks):
    write(tenant_a, "user:u1:k", "value")
    r = post(api, django_capture_on_commit_callbacks, {"subject": "u1"})
    pk = pk_of(r.json()["id"])
    task = Task.objects.get(name=f"forget-request-{pk}")
    assert task.success and task.func == "memories.tasks.forget_request_task"
    assert task.args == (pk,) and task.kwargs == {}
    assert task.result["status"] == "completed" and set(task.result["receipt"]) == RECEIPT_FIELDS


def test_django_q2s_task_results_hold_no_key_or_value_of_a_forgotten_subject(
    api, tenant_a, monkeypatch, django_capture_on_commit_callbacks
):
    """django-q2 keeps what a task returned (and, for a failed one, its exception's text) in
    its own Task table, which no forget touches: a summarize task returned the summary's key
    (``summary:user:u9``), and a failed attempt's exception text — a database error quotes
    the row it failed on — was kept there for good. Tasks now return ids, statuses and counts
    only, and a failure is re-raised as its class name (the details go to the server log)."""
    from django.db import DataError

    from memories.services import summaries

    write(tenant_a, "user:u9:lang", f"{CANARY} de")
    with django_capture_on_commit_callbacks(execute=True):
        services.summarize_start(tenant=tenant_a, actor=SYSTEM, prefix="user:u9:")
    assert Memory.objects.filter(tenant=tenant_a, key="summary:user:u9").exists()

    def failing(**kwargs):
        raise DataError(f'value too long for type character varying(8): "user:u9:lang" = "{CANARY}"')

    monkeypatch.setattr(summaries, "_digest", failing)
    with django_capture_on_commit_callbacks(execute=False):
        job = services.summarize_start(tenant=tenant_a, actor=SYSTEM, prefix="user:u9:")
    try:  # what django-q2's worker stores as a failed task's result (django_q/worker.py)
        tasks.summarize_task(job.pk)
    except Exception as e:
        import traceback

        stored = f"{e} : {traceback.format_exc()}"
    assert "django.db.utils.DataError" in stored
    assert CANARY not in stored and "user:u9" not in stored

    r = post(api, django_capture_on_commit_callbacks, {"subject": "u9"})
    assert get(api, r.json()["id"])["status"] == "completed"
    assert tables_holding(CANARY) == {}
    assert "django_q_task" not in tables_holding("user:u9")
    assert Task.objects.get(func="memories.tasks.summarize_task").result["sources"] == 1


def _every_task():
    """The dotted path of every task the workers run: the schedules' and the enqueued ones."""
    from zeromem.schedules import SCHEDULES

    return sorted({path for path, _kind, _minutes in SCHEDULES.values()} | ENQUEUED_TASKS)


ENQUEUED_TASKS = {"memories.tasks.summarize_task", "memories.tasks.forget_request_task"}


@pytest.mark.parametrize("path", _every_task())
def test_every_task_is_wrapped_so_django_q2_keeps_only_a_failures_class_name(path):
    import importlib

    from zeromem.kernel.tasks import kept

    module_name, name = path.rsplit(".", 1)
    task = getattr(importlib.import_module(module_name), name)
    assert task.__code__ is kept(len).__code__, f"{path} is not wrapped by zeromem.kernel.tasks.kept"


@pytest.mark.parametrize(
    "module, service, task",
    [
        ("audit.services", "audit_seal_all", "audit.tasks.audit_seal_task"),
        ("audit.partitions", "ensure_partitions", "audit.tasks.audit_partitions_task"),
        ("memories.portal.tasks", "portal_links_purge", "memories.portal.tasks.portal_links_purge_task"),
    ],
)
def test_an_audit_or_portal_task_failure_reaches_django_q2_as_its_class_name(module, service, task, monkeypatch):
    """Only the memories tasks were wrapped: a failed audit or portal task's exception text —
    a database error quotes the row it failed on — was kept in django-q2's Task table."""
    import importlib

    from django.db import DataError

    from zeromem.kernel.tasks import TaskFailed

    def failing(*args, **kwargs):
        raise DataError(f'value too long: "user:u9:lang" = "{CANARY}"')

    monkeypatch.setattr(importlib.import_module(module), service, failing)
    module_name, name = task.rsplit(".", 1)
    with pytest.raises(TaskFailed) as raised:
        getattr(importlib.import_module(module_name), name)()
    assert str(raised.value) == "django.db.utils.DataError (details in the server log)"
    assert raised.value.__suppress_context__ and CANARY not in repr(raised.value)


# --- refused requests ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,field,code",
    [
        ({}, "subject", "missing_target"),
        ({"reason": "no target"}, "subject", "missing_target"),
        ({"subject": "u1", "prefix": "user:u1:"}, "prefix", "conflicting_target"),
        ({"prefix": "user:u1:", "keys": ["user:u1:a"]}, "keys", "conflicting_target"),
        ({"subject": ""}, "subject", "blank"),
        ({"subject": 5}, "subject", "invalid"),
        ({"subject": "u\x01"}, "subject", "invalid"),
        ({"subject": "u" * 256}, "subject", "max_length"),
        ({"prefix": "user::"}, "prefix", "invalid_prefix"),
        ({"keys": []}, "keys", "min_length"),
        ({"keys": "user:u1:a"}, "keys", "not_a_list"),
        ({"keys": ["user:u1:a", "bad key"]}, "keys.1", "invalid_key"),
        ({"keys": [f"user:u1:k{i}" for i in range(1001)]}, "keys", "max_length"),
        ({"subject": "u1", "due_in_days": 31}, "due_in_days", "max_value"),
        ({"subject": "u1", "due_in_days": 0}, "due_in_days", "min_value"),
        ({"subject": "u1", "due_in_days": "5"}, "due_in_days", "invalid"),
        ({"subject": "u1", "reason": "x" * 1001}, "reason", "max_length"),
        ({"subject": "u1", "reason": "nul\x00"}, "reason", "null_characters_not_allowed"),
        ({"subject": "u1", "reason": "bell\x07"}, "reason", "invalid"),
        ({"subject": "u1", "value": "x"}, "value", "unknown_field"),
    ],
)
def test_bad_input_is_400_naming_the_field_and_stores_nothing(
    api, body, field, code, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks() as callbacks:
        r = api.post(URL, body)
    assert r.status_code == 400, r.content
    error = rest_error(r)
    assert (error["field"], error["code"]) == (field, code), error
    assert ForgetRequest.objects.count() == 0 and callbacks == []
    refused = AuditEvent.objects.filter(action="forget.create").get()
    assert refused.outcome == "invalid"


def test_bad_input_is_refused_by_the_service_too(tenant_a):
    with pytest.raises(forget.InvalidInput) as exc:
        services.forget_request_create(tenant=tenant_a, actor=SYSTEM, keys=["a"] * 2, subject="u1")
    assert exc.value.field == "keys"
    with pytest.raises(forget.InvalidInput) as exc:
        services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1", due_in_days=31)
    assert exc.value.field == "due_in_days"
    assert ForgetRequest.objects.count() == 0


def test_missing_scope_is_403_and_stores_nothing(tenant_a, make_client, django_capture_on_commit_callbacks):
    client, _ = make_client(tenant_a, scopes=[Scope.MEMORY_READ, Scope.MEMORY_WRITE, Scope.MEMORY_DELETE])
    write(tenant_a, "user:u1:k", "value")
    r = post(client, django_capture_on_commit_callbacks, {"subject": "u1"})
    assert r.status_code == 403 and rest_error(r)["code"] == "missing_scope"
    assert ForgetRequest.objects.count() == 0 and Memory.objects.filter(key="user:u1:k").exists()
    assert AuditEvent.objects.filter(action="forget.create", outcome="denied").count() == 1

    assert client.get(URL).status_code == 403
    pk = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1").pk
    assert client.get(f"{URL}/{pk}").status_code == 403


def test_a_key_limited_to_prefixes_forgets_only_inside_them(tenant_a, make_client, django_capture_on_commit_callbacks):
    client, _ = make_client(tenant_a, allow=["user:u1:"])
    for body, field in (
        ({"subject": "u1"}, "subject"),
        ({"prefix": "user:"}, "prefix"),
        ({"keys": ["user:u1:a", "user:u2:a"]}, "keys.1"),
    ):
        r = post(client, django_capture_on_commit_callbacks, body)
        assert r.status_code == 403 and (rest_error(r)["code"], rest_error(r)["field"]) == ("key_not_allowed", field)
    assert ForgetRequest.objects.count() == 0

    write(tenant_a, "user:u1:a", "mine")
    write(tenant_a, "user:u2:a", "not mine")
    r = post(client, django_capture_on_commit_callbacks, {"prefix": "user:u1:"})
    assert r.status_code == 202
    assert memory_rows(tenant_a) == [("user:u2:a", 1, None)]


def test_a_request_filed_by_a_key_revoked_before_it_runs_still_runs_within_that_keys_reach(
    tenant_a, make_client, django_capture_on_commit_callbacks
):
    """Unlike a summarize job (cancelled with its key: it writes on the key's behalf), an
    erasure is owed to the people it names: revoking the key that filed it does not cancel it,
    and it erases no more than that key could reach (the allowlist is kept with the request)."""
    client, key = make_client(tenant_a, allow=["user:u1:"])
    write(tenant_a, "user:u1:a", "mine")
    write(tenant_a, "user:u2:a", "not mine")
    summary_a = write(tenant_a, "summary:user", "u1:a = mine\nu2:a = not mine", category="summary")
    Memory.objects.filter(pk=summary_a.pk).update(sources=["user:u1:a", "user:u2:a"])
    r = post(client, django_capture_on_commit_callbacks, {"keys": ["user:u1:a"]}, run=False)
    assert r.status_code == 202
    services.api_key_revoke(tenant=tenant_a, actor=SYSTEM, key_id=key.pk)
    done = forget.forget_request_execute(request_id=pk_of(r.json()["id"]))
    assert done["status"] == "completed" and done["receipt"]["summaries_rebuilt"] == ["summary:user"]
    assert memory_rows(tenant_a) == [("summary:user", 2, None), ("user:u2:a", 1, None)]
    assert Memory.objects.get(key="summary:user").value == "u2:a = not mine"


# --- reading requests ---------------------------------------------------------------------


def test_another_tenants_request_is_not_found_like_a_missing_one(api, api_b, tenant_a, tenant_b):
    theirs = services.forget_request_create(tenant=tenant_b, actor=SYSTEM, subject="u1")
    r = api.get(f"{URL}/{theirs.uid}")
    missing = api.get(f"{URL}/{uuid.uuid4()}")
    assert r.status_code == missing.status_code == 404
    assert (
        r.json()
        == missing.json()
        == {"error": {"code": "not_found", "message": "no such forget request", "field": "request_id"}}
    )
    assert api.get(f"{URL}/{2**63}").status_code == 404  # beyond bigint: not found, no 500
    assert api.get(URL).json()["results"] == []
    assert [x["id"] for x in api_b.get(URL).json()["results"]] == [str(theirs.uid)]
    assert (
        not AuditEvent.objects.filter(tenant=tenant_b, action__in=["forget.read", "forget.list"])
        .filter(actor_kind="api_key", actor_id__in=[str(k.pk) for k in tenant_a.api_keys.all()])
        .exists()
    )


def test_a_key_limited_to_prefixes_sees_only_its_own_requests(api, tenant_a, make_client):
    limited, key = make_client(tenant_a, allow=["user:u1:"])
    tenant_wide = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u2")
    r = limited.post(URL, {"prefix": "user:u1:"})
    own = r.json()["id"]
    assert [x["id"] for x in limited.get(URL).json()["results"]] == [own]
    assert limited.get(f"{URL}/{tenant_wide.uid}").status_code == 404
    assert get(limited, own)["target"] == {"prefix": "user:u1:"}
    # An unrestricted key of the tenant sees both.
    assert [x["id"] for x in api.get(URL).json()["results"]] == [own, str(tenant_wide.uid)]


def _age(request, *, due_days_ago):
    # The clock: the request was due this many days ago.
    ForgetRequest.objects.filter(pk=request.pk).update(due_at=timezone.now() - timedelta(days=due_days_ago))


def test_overdue_and_status_filters(api, tenant_a, django_capture_on_commit_callbacks):
    def create(**target):
        return services.forget_request_create(tenant=tenant_a, actor=SYSTEM, **target)

    late = create(subject="late")
    _age(late, due_days_ago=1)
    on_time = create(subject="on-time")
    done_late = create(subject="done-late")
    forget.forget_request_execute(request_id=done_late.pk)
    _age(done_late, due_days_ago=2)
    failed = create(subject="failed")
    ForgetRequest.objects.filter(pk=failed.pk).update(attempts=99, stalled_attempts=99)
    forget.forget_request_execute(request_id=failed.pk)  # gives up: failed
    _age(failed, due_days_ago=3)

    def ids(**params):
        r = api.get(URL, params)
        assert r.status_code == 200, r.content
        return [pk_of(x["id"]) for x in r.json()["results"]]

    assert ids(overdue="true") == [failed.pk, late.pk]
    assert ids(overdue="false") == [done_late.pk, on_time.pk]
    assert ids(status="failed") == [failed.pk]
    assert ids(status="completed", overdue="true") == []
    assert ids(status="received") == [on_time.pk, late.pk]
    assert ids() == [failed.pk, done_late.pk, on_time.pk, late.pk]
    assert get(api, late.pk)["overdue"] is True and get(api, done_late.pk)["overdue"] is False
    failed_body = get(api, failed.pk)
    assert failed_body["overdue"] is True and failed_body["receipt"] is None
    assert failed_body["error"].startswith("gave up after")

    for params, field in (
        ({"status": "done"}, "status"),
        ({"status": ""}, "status"),
        ({"overdue": "yes"}, "overdue"),
        ({"overdue": ""}, "overdue"),
        ({"limit": 0}, "limit"),
    ):
        r = api.get(URL, params)
        assert r.status_code == 400 and rest_error(r)["field"] == field


def test_list_is_cursor_paginated_newest_first(api, tenant_a):
    created = [services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject=f"s{i}").pk for i in range(5)]
    seen, cursor = [], None
    while True:
        body = api.get(URL, {"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        seen += [pk_of(x["id"]) for x in body["results"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == created[::-1]
    r = api.get(URL, {"cursor": "not-a-cursor!"})
    assert r.status_code == 400 and rest_error(r)["field"] == "cursor"


# --- status, retries and idempotency ------------------------------------------------------


def test_status_only_moves_forward(api, tenant_a, monkeypatch, django_capture_on_commit_callbacks):
    for i in range(4):
        write(tenant_a, f"user:u1:k{i}", "v")
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    seen = [ForgetRequest.objects.get(pk=request.pk).status]
    real = forget._erase_batch

    def watching(request_id, *, batch_size, **kwargs):
        seen.append(ForgetRequest.objects.get(pk=request_id).status)
        return real(request_id, batch_size=batch_size, **kwargs)

    monkeypatch.setattr(forget, "_erase_batch", watching)
    forget.forget_request_execute(request_id=request.pk, batch_size=2)
    seen.append(ForgetRequest.objects.get(pk=request.pk).status)
    assert seen == ["received", "running", "running", "running", "completed"]

    # A late or duplicate delivery changes nothing: no new attempt, same receipt, no events.
    done = ForgetRequest.objects.get(pk=request.pk)
    events = AuditEvent.objects.count()
    result = forget.forget_request_execute(request_id=request.pk)
    again = ForgetRequest.objects.get(pk=request.pk)
    assert result["status"] == again.status == "completed"
    assert (again.attempts, again.receipt, again.completed_at) == (done.attempts, done.receipt, done.completed_at)
    assert AuditEvent.objects.count() == events
    # Nor does any other transition: completed is final, and nothing leads back to received.
    assert forget._advance(request.pk, "running") is False and forget._advance(request.pk, "failed") is False
    assert "received" not in forget._FORWARD
    assert ForgetRequest.objects.get(pk=request.pk).status == "completed"


def _seed_for_interruption(tenant, capture):
    for i in range(12):
        write(tenant, f"user:u7:k{i:02}", f"value {i}")
        write(tenant, f"user:u7:k{i:02}", f"value {i} again")
    summarize(tenant, "user:u7:", capture)
    write(tenant, "user:u8:k", "someone else")


def test_a_job_interrupted_after_its_first_batch_completes_on_retry_with_the_same_result(
    tenant_a, tenant_b, monkeypatch, django_capture_on_commit_callbacks
):
    _seed_for_interruption(tenant_a, django_capture_on_commit_callbacks)
    _seed_for_interruption(tenant_b, django_capture_on_commit_callbacks)
    interrupted = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u7")
    straight = services.forget_request_create(tenant=tenant_b, actor=SYSTEM, subject="u7")

    real = forget._erase_batch
    batches = []

    def killed_after_first_batch(request_id, *, batch_size, **kwargs):
        if batches:
            raise ConnectionError("worker killed")
        batches.append(request_id)
        return real(request_id, batch_size=batch_size, **kwargs)

    monkeypatch.setattr(forget, "_erase_batch", killed_after_first_batch)
    with pytest.raises(ConnectionError):
        forget.forget_request_execute(request_id=interrupted.pk, batch_size=5)
    halfway = ForgetRequest.objects.get(pk=interrupted.pk)
    assert halfway.status == "running" and halfway.attempts == 1
    # The first batch took 5 memories and, through its lineage, the summary made from them.
    assert (halfway.receipt["batches"], halfway.receipt["memories"], halfway.receipt["summaries"]) == (1, 5, 1)
    assert halfway.error == "builtins.ConnectionError"
    assert Memory.objects.filter(tenant=tenant_a, subject="u7").count() == 12 - 5

    monkeypatch.setattr(forget, "_erase_batch", real)
    forget.forget_request_execute(request_id=interrupted.pk, batch_size=5)
    forget.forget_request_execute(request_id=straight.pk, batch_size=5)

    a, b = ForgetRequest.objects.get(pk=interrupted.pk), ForgetRequest.objects.get(pk=straight.pk)
    counts = ("memories", "versions", "summaries", "admin_log_entries", "batches", "audit_events_redacted")
    assert a.status == b.status == "completed" and (a.attempts, b.attempts) == (2, 1)
    assert {k: a.receipt[k] for k in counts} == {k: b.receipt[k] for k in counts}
    assert a.receipt["memories"] == 12 and a.receipt["summaries"] == 1 and a.receipt["versions"] == 25
    assert a.error == ""
    for tenant in (tenant_a, tenant_b):
        assert memory_rows(tenant) == [("user:u8:k", 1, None)]
        assert MemoryVersion.objects.filter(tenant=tenant).count() == 1


def test_attempts_are_bounded_and_then_the_request_fails(
    tenant_a, monkeypatch, settings, django_capture_on_commit_callbacks
):
    settings.ZEROMEM_JOB_MAX_ATTEMPTS = 2
    write(tenant_a, "user:u1:k", "value")
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")

    def always_killed(request_id, *, batch_size, **kwargs):
        raise ConnectionError("worker killed")

    monkeypatch.setattr(forget, "_erase_batch", always_killed)
    for _ in range(2):
        with pytest.raises(ConnectionError):
            forget.forget_request_execute(request_id=request.pk)
    result = forget.forget_request_execute(request_id=request.pk)

    failed = ForgetRequest.objects.get(pk=request.pk)
    assert result["status"] == failed.status == "failed"
    assert failed.attempts == 3 and failed.completed_at is None
    assert failed.error == "gave up after 2 attempts; last error: builtins.ConnectionError"
    assert AuditEvent.objects.filter(action="forget.fail", detail__forget_request=str(request.uid)).count() == 1
    assert Memory.objects.filter(key="user:u1:k").exists()  # nothing half-claimed as done
    # Final: later deliveries neither retry nor count.
    assert forget.forget_request_execute(request_id=request.pk)["status"] == "failed"
    assert ForgetRequest.objects.get(pk=request.pk).attempts == 3


def test_a_forget_that_erases_something_on_every_attempt_is_never_given_up(tenant_a, monkeypatch, settings):
    """A subject too large for one attempt (~1,500 memories/s here: ~450k per Q_TIMEOUT of
    300 s) was killed by the timeout on every attempt, each one erasing batches, and marked
    failed for good after ZEROMEM_JOB_MAX_ATTEMPTS — the obligation left unmet. Only attempts
    in a row that erase nothing count."""
    settings.ZEROMEM_JOB_MAX_ATTEMPTS = 2
    for n in range(5):
        write(tenant_a, f"user:u1:k{n}", "value")
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    real = forget._erase_batch

    def one_batch_then_killed(request_id, *, batch_size, **kwargs):
        # The first batch of each attempt commits; the worker then dies (Q_TIMEOUT's kill).
        if calls.pop():
            raise ConnectionError("worker killed by the timeout")
        return real(request_id, batch_size=batch_size, **kwargs)

    monkeypatch.setattr(forget, "_erase_batch", one_batch_then_killed)
    for attempt in range(1, 4):  # batches of 2: three attempts erase 2, 2 and 1 memories
        calls = [True, False]
        with pytest.raises(ConnectionError):
            forget.forget_request_execute(request_id=request.pk, batch_size=2)
        assert ForgetRequest.objects.get(pk=request.pk).status == "running", f"given up at attempt {attempt}"
    calls = [False, False, False]
    assert forget.forget_request_execute(request_id=request.pk, batch_size=2)["status"] == "completed"
    done = ForgetRequest.objects.get(pk=request.pk)
    assert done.attempts == 4 and done.receipt["memories"] == 5
    assert not Memory.objects.filter(tenant=tenant_a, subject="u1").exists()


def test_a_long_forget_hands_its_worker_back_and_continues_at_the_back_of_the_queue(tenant_a, tenant_b, monkeypatch):
    """One request held a worker until it ended or Q_TIMEOUT killed it: two of one tenant's
    huge forgets held both default workers, every other tenant's job waiting behind. After
    FORGET_SLICE_SECONDS of batches it enqueues itself again (the back of the line) and
    returns, so the other tenants' jobs queued meanwhile run first."""
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", False)  # enqueued for real, run here by hand
    monkeypatch.setattr(forget, "FORGET_SLICE_SECONDS", 0)  # every batch is a slice's last
    for n in range(3):
        write(tenant_a, f"user:u1:k{n}", "value")
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    OrmQ.objects.all().delete()  # (its enqueue on commit did not run: no commit in this test)

    result = forget.forget_request_execute(request_id=request.pk, batch_size=2)
    assert result["status"] == "running" and result["continued"] is True
    assert ForgetRequest.objects.get(pk=request.pk).receipt["batches"] == 1
    assert Memory.objects.filter(tenant=tenant_a, subject="u1").count() == 1
    (entry,) = OrmQ.objects.all()
    assert SignedPackage.loads(entry.payload)["args"] == (request.pk,)

    assert forget.forget_request_execute(request_id=request.pk, batch_size=2)["status"] == "running"
    # The audit redaction's page is a slice of its own too (the slice here is 0 s).
    assert forget.forget_request_execute(request_id=request.pk, batch_size=2)["status"] == "running"
    assert forget.forget_request_execute(request_id=request.pk, batch_size=2)["status"] == "completed"
    done = ForgetRequest.objects.get(pk=request.pk)
    assert done.receipt["memories"] == 3 and done.receipt["batches"] == 2
    assert done.receipt["audit_events_redacted"] >= 3


def test_a_second_delivery_of_a_sliced_forget_does_not_become_a_second_chain_of_slices(
    tenant_a, settings, monkeypatch, django_capture_on_commit_callbacks
):
    """Each step that hands its worker back enqueues a delivery. A second delivery of the
    request — the resume schedule's, once a continuation waited in a long queue past Q_RETRY,
    or a redelivery — continued it too, at every one of its slices: two runs of one request for
    ever after (each a worker, the second mostly waiting on the first's row lock), a third at
    the next resume. A delivery is now a turn: one that comes while a step of the request holds
    a worker begins nothing (services.jobs.turn_claim_next), and one line of steps is left."""
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", False)  # enqueued for real, run here by hand
    monkeypatch.setattr(forget, "FORGET_SLICE_SECONDS", 0)  # every batch is a slice's last
    for n in range(8):
        write(tenant_a, f"user:u1:k{n}", "value")
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    OrmQ.objects.all().delete()  # (its enqueue on commit did not run: no commit in this test)

    def run_queue():
        entries = list(OrmQ.objects.order_by("pk"))
        OrmQ.objects.filter(pk__in=[e.pk for e in entries]).delete()
        for entry in entries:
            task = SignedPackage.loads(entry.payload)
            tasks.forget_request_task(*task["args"], **task["kwargs"])
        return len(entries)

    forget.forget_request_execute(request_id=request.pk, batch_size=1)  # slice 1: its delivery queued
    (continuation,) = OrmQ.objects.all()
    # A worker takes it and begins the next step; meanwhile the resume schedule finds the
    # request not moving (the continuation had waited in a long queue) and enqueues it again.
    continuation.delete()
    step = forget.forget_step_begin(request.pk)
    long_ago = timezone.now() - timedelta(seconds=settings.Q_CLUSTER["retry"] + 1)
    ForgetRequest.objects.filter(pk=request.pk).update(progress_at=long_ago)
    with django_capture_on_commit_callbacks(execute=True):
        assert services.forget_requests_resume() == 1
    assert run_queue() == 1  # the resume's delivery: the step holds a worker, it begins nothing
    assert ForgetRequest.objects.get(pk=request.pk).attempts == 2
    forget.forget_step_run(step, batch_size=1)  # that step hands back: one delivery queued
    assert OrmQ.objects.count() == 1
    steps = 2
    while run_queue():  # each delivery one step, which queues the next: one line
        steps += 1
        assert OrmQ.objects.count() <= 1
    done = ForgetRequest.objects.get(pk=request.pk)
    assert done.status == "completed" and done.receipt["memories"] == 8
    assert done.attempts == steps
    assert not Memory.objects.filter(tenant=tenant_a, subject="u1").exists()


def test_the_audit_redaction_is_sliced_too_and_each_page_is_progress(tenant_a, settings, monkeypatch):
    """The redaction after the last batch was one step: a heavy user's years of audited reads
    (millions of events at ~3k/s; bench_forget: 100k events took 29 of 32 s) held the worker
    until Q_TIMEOUT killed it, every attempt counted as erasing nothing, and the request ended
    failed for good. It now goes page by page from a cursor in the request, in the same slices
    as the batches, and every page resets the stalled attempts."""
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", False)  # enqueued for real, run here by hand
    monkeypatch.setattr(forget, "FORGET_SLICE_SECONDS", 0)  # every page is a slice's last
    monkeypatch.setattr(forget, "REDACT_PAGE", 10)
    settings.ZEROMEM_JOB_MAX_ATTEMPTS = 2
    write(tenant_a, "user:u1:lang", "zh-CN")
    for _ in range(34):
        services.memory_read(tenant=tenant_a, actor=SYSTEM, key="user:u1:lang")
    naming = AuditEvent.objects.filter(tenant=tenant_a, subject="u1").count()
    assert naming >= 35
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    OrmQ.objects.all().delete()  # (its enqueue on commit did not run: no commit in this test)

    runs = 0
    forget.forget_request_execute(request_id=request.pk)
    while entries := list(OrmQ.objects.order_by("pk")):
        OrmQ.objects.filter(pk__in=[e.pk for e in entries]).delete()
        for entry in entries:
            task = SignedPackage.loads(entry.payload)
            forget.forget_request_execute(request_id=task["args"][0], **task["kwargs"])
            runs += 1
            mid = ForgetRequest.objects.get(pk=request.pk)
            assert mid.status in ("running", "completed") and mid.stalled_attempts <= 1
    done = ForgetRequest.objects.get(pk=request.pk)
    assert done.status == "completed", done.error
    assert runs >= naming // 10  # a page per slice
    assert done.receipt["audit_events_redacted"] == naming
    assert forget.REDACT_CURSOR not in done.receipt  # the cursor goes with the run
    assert not AuditEvent.objects.filter(tenant=tenant_a, subject="u1").exists()
    # One trail however many steps: each step after a slice went through the shred again and
    # recorded another datakey.destroy (count 0) before.
    trail = AuditEvent.objects.filter(tenant=tenant_a, detail__forget_request=str(request.uid))
    assert trail.filter(action="datakey.destroy").count() == 1
    assert trail.filter(action="forget.complete").count() == 1
    assert trail.filter(action="forget.start").count() == runs + 1  # one per step


def test_resume_enqueues_requests_that_stopped_moving(tenant_a, settings, django_capture_on_commit_callbacks):
    write(tenant_a, "user:u1:k", "value")
    write(tenant_a, "user:u2:k", "value")
    stuck = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")  # its enqueue was lost
    fresh = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u2")
    done = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u3")
    forget.forget_request_execute(request_id=done.pk)
    long_ago = timezone.now() - timedelta(seconds=settings.Q_CLUSTER["retry"] + 1)
    ForgetRequest.objects.filter(pk__in=[stuck.pk, done.pk]).update(progress_at=long_ago)

    with django_capture_on_commit_callbacks(execute=True):
        assert services.forget_requests_resume() == 1
    assert ForgetRequest.objects.get(pk=stuck.pk).status == "completed"
    assert ForgetRequest.objects.get(pk=fresh.pk).status == "received"
    assert not Memory.objects.filter(key="user:u1:k").exists()
    assert AuditEvent.objects.filter(action="forget.resume", detail__forget_request=str(stuck.uid)).count() == 1
    with django_capture_on_commit_callbacks(execute=True):
        assert services.forget_requests_resume() == 0  # nothing pending is old


def test_resume_audits_a_request_waiting_in_a_long_queue_once_not_every_run(
    tenant_a, settings, monkeypatch, django_capture_on_commit_callbacks
):
    """A request merely waiting its turn behind a long queue does not move, so the schedule
    (every 10 minutes) enqueued it again and wrote a ``forget.resume`` event every run: an
    hour's wait was six events of noise per request. It still enqueues it each time, but
    audits a request's resume once per state of it: again only after a step of it began."""
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", False)  # enqueued, not run: the queue is long
    write(tenant_a, "user:u1:k", "value")
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    long_ago = timezone.now() - timedelta(seconds=settings.Q_CLUSTER["retry"] + 1)
    resumes = AuditEvent.objects.filter(action="forget.resume", detail__forget_request=str(request.uid))

    def schedule_runs():
        ForgetRequest.objects.filter(pk=request.pk).update(progress_at=long_ago)
        with django_capture_on_commit_callbacks(execute=True) as enqueued:
            assert services.forget_requests_resume() == 1
        assert len(enqueued) == 1  # enqueued again every run

    for _ in range(6):
        schedule_runs()
    assert resumes.count() == 1
    assert ForgetRequest.objects.get(pk=request.pk).status == "received"

    # A step of it begins (its turn came) and dies: the next resume is a new one, audited.
    forget.forget_step_begin(request.pk)
    ForgetRequest.objects.filter(pk=request.pk).update(stepping=False)
    for _ in range(3):
        schedule_runs()
    assert resumes.count() == 2
    assert list(resumes.order_by("pk").values_list("detail__attempts", flat=True)) == [0, 1]


def test_the_resume_schedule_is_declared():
    from zeromem.schedules import SCHEDULES

    func, _type, minutes = SCHEDULES["zeromem:forget-requests-resume"]
    assert func == "memories.tasks.forget_requests_resume_task" and minutes <= 10


# --- residue ------------------------------------------------------------------------------


def tables_holding(text: str) -> dict[str, int]:
    """Every table (and every django-q2 pickle, decoded) that holds ``text``: table → rows."""
    found: dict[str, int] = {}
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            name = connection.ops.quote_name(table)
            if connection.vendor == "postgresql":
                cursor.execute(f"SELECT count(*) FROM {name} AS t WHERE t::text LIKE %s", [f"%{text}%"])
                rows = cursor.fetchone()[0]
            else:
                cursor.execute(f"SELECT * FROM {name}")
                rows = sum(1 for row in cursor.fetchall() if text in repr(row))
            if rows:
                found[table] = rows
    # django-q2 keeps task arguments and results pickled (base64 text): a LIKE cannot see them.
    tasks = sum(1 for t in Task.objects.all() if text in repr((t.name, t.args, t.kwargs, t.result)))
    queued = sum(1 for q in OrmQ.objects.all() if text in repr(SignedPackage.loads(q.payload)))
    if tasks:
        found["django_q_task (unpickled)"] = tasks
    if queued:
        found["django_q_ormq (unpickled)"] = queued
    return found


def test_the_residue_scanner_sees_pickled_queue_payloads(db, monkeypatch):
    from django_q.conf import Conf
    from django_q.tasks import async_task

    monkeypatch.setattr(Conf, "SYNC", False)  # a real ORM-broker queue entry
    async_task("math.floor", 1.5, task_name="probe", note=f"leaky {CANARY}")
    assert tables_holding(CANARY) == {"django_q_ormq (unpickled)": 1}


def test_forgetting_a_subject_leaves_its_canary_nowhere_in_the_database(
    api, tenant_a, tenant_b, monkeypatch, django_capture_on_commit_callbacks
):
    from django_q.conf import Conf

    for v in range(3):  # three versions
        write(tenant_a, "user:u9:diary", f"{CANARY} entry {v}", tags=["diary"])
    write(tenant_a, "user:u9:secret", {"text": f"the {CANARY} secret", "n": 1})
    write(tenant_a, "user:u9:trashed", f"{CANARY} in the trash")
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key="user:u9:trashed")
    write(tenant_a, "user:u9:expired", f"{CANARY} expired")
    Memory.objects.filter(key="user:u9:expired").update(expires_at=timezone.now() - timedelta(minutes=1))
    summary = summarize(tenant_a, "user:u9:", django_capture_on_commit_callbacks)  # a job, a django-q2 task row
    assert summary.sources and CANARY in str(summary.value)
    write(tenant_a, "user:u10:diary", "not the canary")  # another subject stays
    # A key the app wrote for u9 and then handed to u10: u10's value stays, u9's history goes.
    write(tenant_a, "shared:draft", f"{CANARY} draft", subject="u9")
    write(tenant_a, "shared:draft", "handed over", subject="u10")
    # Support staff changed the memory in the admin, and the change message quoted it.
    staff = get_user_model().objects.create_user("support", password="x" * 12)
    diary = Memory.objects.get(key="user:u9:diary")
    LogEntry.objects.create(
        user=staff,
        content_type=ContentType.objects.get_for_model(Memory),
        object_id=str(diary.pk),
        object_repr=str(diary),
        action_flag=CHANGE,
        change_message=f"value was {CANARY}",
    )

    # Identifiers of u9 outside memories: an unauthenticated request for one of u9's keys (a
    # failed-auth event), and u9 opening their portal from their own address and filing a
    # forget there (the end user's actor id and IP on portal and forget.create events).
    from django.test import Client

    from memories.portal.services import portal_link_create

    bad = Client().get("/api/v1/memories/user:u9:diary", headers={"Authorization": "Bearer zm_nope_nope"})
    assert bad.status_code == 401
    _link, token = portal_link_create(tenant=tenant_a, actor=SYSTEM, subject="u9")
    end_user = Client(REMOTE_ADDR=END_USER_IP)
    assert end_user.post(f"/portal/open/{token}").status_code == 302
    with django_capture_on_commit_callbacks(execute=False):
        filed = end_user.post("/portal/forget", {"what": "one", "key": "user:u9:secret"})
    assert filed.status_code == 302
    assert AuditEvent.objects.filter(action="forget.create", client_ip=END_USER_IP).exists()
    assert Job.objects.filter(tenant=tenant_a, params__prefix="user:u9:").exists()

    # Positive control: the scanner finds the canary and the identifiers where they are.
    before = tables_holding(CANARY)
    assert {"memories_memory", "memories_memoryversion", "django_admin_log"} <= set(before), before
    assert "memories_job" in tables_holding("user:u9:") and "audit_auditevent" in tables_holding(END_USER_IP)

    # The request goes through a real ORM-broker queue entry (left behind, as a worker that
    # died would leave it), and the job runs in-process as a worker would run it.
    monkeypatch.setattr(Conf, "SYNC", False)
    with django_capture_on_commit_callbacks(execute=True):
        r = api.post(URL, {"subject": "u9", "reason": "GDPR art. 17"})
    assert r.status_code == 202
    assert OrmQ.objects.count() == 1
    assert SignedPackage.loads(OrmQ.objects.get().payload)["args"] == (pk_of(r.json()["id"]),)
    forget.forget_request_execute(request_id=pk_of(r.json()["id"]))

    done = get(api, r.json()["id"])
    assert done["status"] == "completed"
    assert (done["receipt"]["memories"], done["receipt"]["summaries"], done["receipt"]["admin_log_entries"]) == (
        4,
        1,
        1,
    )
    assert tables_holding(CANARY) == {}
    # No key of u9 (memories, versions, jobs' params and results, failed-auth events, audit
    # targets), no address of u9 (portal and forget.create events), no end-user actor id.
    # (Only the record of erasure names u9: the end user's own earlier request for one key,
    # as the completed request names its subject.)
    assert tables_holding("user:u9:") == {"memories_forgetrequest": 1}
    assert ForgetRequest.objects.filter(keys=["user:u9:secret"]).count() == 1
    assert tables_holding(END_USER_IP) == {}
    assert not AuditEvent.objects.filter(actor_kind="end_user", actor_id=subjects.end_user_actor_id("u9")).exists()
    assert CANARY not in str(done)
    assert memory_rows(tenant_a) == [("shared:draft", 2, None), ("user:u10:diary", 1, None)]


# --- benchmark ----------------------------------------------------------------------------


@pytest.mark.postgres
def test_bench_forget_command_reports_the_time_to_completed(transactional_db, capsys, monkeypatch):
    """Committed for real (transactional_db): the POST's queue entry reaches the ORM broker,
    and the bench picks it up as a worker would."""
    import json

    from django.core.management import call_command
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", False)
    call_command("bench_forget", memories=60, versions=2, others=20, batch_size=25, events=2, json=True)
    report = json.loads(capsys.readouterr().out)
    assert report["meets_target"] and report["left_of_subject"] == 0 and report["other_subjects_kept"] == 20
    assert report["seeded"]["audit_events"] == 120 and report["audit_events_redacted"] >= 120
    assert not OrmQ.objects.exists()  # the entry was taken and acknowledged
    assert (report["receipt"]["memories"], report["receipt"]["versions"], report["receipt"]["batches"]) == (60, 121, 3)


# --- jobs are not kept for ever ------------------------------------------------------------


def test_finished_jobs_are_purged_after_the_retention_period(tenant_a, tenant_b, settings, monkeypatch):
    from zeromem.schedules import SCHEDULES

    assert SCHEDULES["zeromem:jobs-purge"][0] == "memories.tasks.jobs_purge_task"
    settings.ZEROMEM_JOB_RETENTION_DAYS = 30
    now = timezone.now()
    old, recent = now - timedelta(days=31), now - timedelta(days=29)
    make = lambda tenant, status, created: Job.objects.create(  # noqa: E731
        tenant=tenant, kind=Job.Kind.SUMMARIZE, status=status, params={"prefix": "user:u1:"}, created_at=created
    )
    gone = [
        make(tenant_a, Job.Status.SUCCEEDED, old),
        make(tenant_a, Job.Status.FAILED, old),
        make(tenant_b, "succeeded", old),
    ]
    kept = [make(tenant_a, Job.Status.SUCCEEDED, recent), make(tenant_a, Job.Status.QUEUED, old)]  # running work stays
    from memories import tasks

    assert tasks.jobs_purge_task() == 3
    assert set(Job.objects.values_list("pk", flat=True)) == {j.pk for j in kept}
    assert not Job.objects.filter(pk__in=[j.pk for j in gone]).exists()
    events = AuditEvent.objects.filter(action="job.purge").order_by("tenant_id")
    assert [(e.tenant_id, e.count) for e in events] == [(tenant_a.pk, 2), (tenant_b.pk, 1)]
    assert tasks.jobs_purge_task() == 0


def test_jobs_purge_counts_age_from_when_the_job_finished(tenant_a, settings):
    """A job accepted long ago that ran late (retried, or behind a backlog) is kept for the
    whole retention period after it finished; an unfinished one is never purged."""
    settings.ZEROMEM_JOB_RETENTION_DAYS = 30
    now = timezone.now()
    make = lambda status, created, finished: Job.objects.create(  # noqa: E731
        tenant=tenant_a,
        kind=Job.Kind.SUMMARIZE,
        status=status,
        params={"prefix": "user:u1:"},
        created_at=created,
        finished_at=finished,
    )
    just_done = make(Job.Status.SUCCEEDED, now - timedelta(days=40), now - timedelta(hours=1))
    just_failed = make(Job.Status.FAILED, now - timedelta(days=40), now - timedelta(days=29))
    running = make(Job.Status.RUNNING, now - timedelta(days=40), None)
    gone = make(Job.Status.SUCCEEDED, now - timedelta(days=40), now - timedelta(days=31))

    assert jobs.jobs_purge() == 1
    assert set(Job.objects.values_list("pk", flat=True)) == {just_done.pk, just_failed.pk, running.pk}
    assert not Job.objects.filter(pk=gone.pk).exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_write_and_an_embedding_racing_a_forget_are_erased_with_the_memory(monkeypatch, settings):
    """Versions and embeddings have no foreign key in the database (memories 0015, 0018): a
    forget locks its memories before it erases them, so a write and the embedding job that
    hold a memory when the forget comes finish first and their rows go with it. Without the
    lock the forget's DELETEs of versions and embeddings run first, its DELETE of the memory
    waits, and what they then commit outlives the memory."""
    from memories.models import MemoryEmbedding
    from memories.search import embeddings

    settings.ZEROMEM_EMBEDDINGS = "on"
    monkeypatch.setattr(forget, "async_task", lambda *args, **kwargs: None)  # run below, in this thread
    tenant = make_tenant("forget-race")
    memory = write(tenant, "user:u7:diet", "vegetarian", subject="u7")
    request = forget.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u7")
    locked, failures = threading.Event(), []

    def writer_and_embedding_job():
        with transaction.atomic():
            Memory.objects.select_for_update().get(pk=memory.pk)
            locked.set()
            wait_for_a_lock_waiter("the forget")  # the forget is waiting for this memory now
            services.memory_update(tenant=tenant, actor=SYSTEM, key="user:u7:diet", value="vegan")
            assert embeddings.embeddings_refresh()["embedded"] == 1  # the job, under this lock

    racer = start_thread(writer_and_embedding_job, failures, done=locked)
    assert locked.wait(20)
    forget.forget_request_execute(request_id=request.pk)
    racer.join(30)

    assert not failures, failures
    request.refresh_from_db()
    assert request.status == "completed"
    assert request.receipt["versions"] == 2  # the first version and the one the racer wrote
    assert not Memory.objects.filter(pk=memory.pk).exists()
    assert not MemoryVersion.objects.filter(memory_id=memory.pk).exists()
    assert not MemoryEmbedding.objects.filter(memory_id=memory.pk).exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_forget_batch_does_not_hold_up_the_tenants_other_writes(monkeypatch):
    """A batch locks its request row, not the tenant's (``of=("self",)``): a version or an
    audit event of the same tenant checks its tenant foreign key (KEY SHARE on the tenant row),
    which a FOR UPDATE of the tenant would make wait for the whole batch."""
    monkeypatch.setattr(forget, "async_task", lambda *args, **kwargs: None)
    tenant = make_tenant("forget-fair")
    write(tenant, "user:u7:diet", "vegetarian", subject="u7")
    request = forget.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u7")
    in_batch, release, outcome = threading.Event(), threading.Event(), []
    targets = forget._target_memories

    def paused(req):  # inside the batch's transaction, after its lock
        in_batch.set()
        release.wait(20)
        return targets(req)

    monkeypatch.setattr(forget, "_target_memories", paused)

    def other_write():
        try:
            assert in_batch.wait(20)
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = '2s'")
            outcome.append(write(tenant, "user:u8:diet", "vegan", subject="u8").version)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            release.set()
            with connection.cursor() as cursor:  # the pooled connection goes back as it came
                cursor.execute("RESET lock_timeout")
            connection.close()

    writer = threading.Thread(target=other_write)
    writer.start()
    forget.forget_request_execute(request_id=request.pk)
    writer.join(30)
    assert outcome == [1]
    request.refresh_from_db()
    assert request.status == "completed" and request.receipt["memories"] == 1


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_summary_job_that_read_its_sources_before_a_forget_writes_nothing_of_them_after_it(monkeypatch):
    """A summarize job reads its sources outside any transaction (an LLM may think for seconds
    meanwhile) and writes the summary later. A forget of those sources that completes in
    between must not find their values back in a summary written after it: nothing would
    erase that summary (the forget is over). Without the job's check its summary held them."""
    from memories.services import summaries

    monkeypatch.setattr(forget, "async_task", lambda *args, **kwargs: None)  # run below, in this thread
    monkeypatch.setattr(summaries, "_enqueue", lambda job_id: None)
    tenant = make_tenant("summary-race")
    write(tenant, "user:u7:diet", f"{CANARY} vegetarian")
    job = summaries.summarize_start(tenant=tenant, actor=SYSTEM, prefix="user:u7:")
    digest = summaries._digest

    def digest_then_forget(**kwargs):
        read = digest(**kwargs)  # the sources are read ...
        request = forget.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u7")
        forget.forget_request_execute(request_id=request.pk)  # ... and forgotten before the write
        return read

    monkeypatch.setattr(summaries, "_digest", digest_then_forget)
    # The forget cancelled the job (its namespace forgotten): the attempt writes nothing.
    assert summaries.summarize_run(job_id=job.pk) == {"status": "cancelled", "job_id": job.pk}
    assert not Memory.objects.filter(tenant=tenant, key="summary:user:u7").exists()
    assert tables_holding(CANARY) == {}
    assert tables_holding("user:u7") == {}  # nor its prefix, in the job or an audit event
    job.refresh_from_db()
    assert job.status == "cancelled" and "prefix" not in job.params


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_summary_job_whose_sources_a_forget_by_keys_erased_meanwhile_writes_nothing_of_them(monkeypatch):
    """As above, for a forget by keys, which leaves the job of their namespace to run: the
    write finds a source gone and fails the attempt; the retry summarizes the rest."""
    from memories.services import summaries

    monkeypatch.setattr(forget, "async_task", lambda *args, **kwargs: None)  # run below, in this thread
    monkeypatch.setattr(summaries, "_enqueue", lambda job_id: None)
    tenant = make_tenant("summary-race-keys")
    write(tenant, "user:u7:diet", f"{CANARY} vegetarian")
    write(tenant, "user:u7:city", "Lyon")
    job = summaries.summarize_start(tenant=tenant, actor=SYSTEM, prefix="user:u7:")
    digest = summaries._digest

    def digest_then_forget(**kwargs):
        read = digest(**kwargs)  # the sources are read ...
        request = forget.forget_request_create(tenant=tenant, actor=SYSTEM, keys=["user:u7:diet"])
        forget.forget_request_execute(request_id=request.pk)  # ... and one forgotten before the write
        return read

    monkeypatch.setattr(summaries, "_digest", digest_then_forget)
    with pytest.raises(summaries.SummarizerError):
        summaries.summarize_run(job_id=job.pk)
    assert not Memory.objects.filter(tenant=tenant, key="summary:user:u7").exists()
    assert tables_holding(CANARY) == {}
    job.refresh_from_db()
    assert job.status == "queued" and "erased" in job.error  # retried; nothing of the erased value said

    monkeypatch.setattr(summaries, "_digest", digest)
    assert summaries.summarize_run(job_id=job.pk)["sources"] == 1  # the retry summarizes the rest
    assert CANARY not in str(Memory.objects.get(tenant=tenant, key="summary:user:u7").value)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_summary_committed_while_a_forget_batch_waits_for_its_sources_is_erased_with_them(monkeypatch):
    """A summarize job holds its sources locked while it writes the summary; a forget batch
    that comes then waits for them. It must look for derived summaries after that wait:
    looked for before it (the summary not committed yet), the batch erased the sources and
    left the summary holding their values."""
    from memories.services import summaries

    monkeypatch.setattr(forget, "async_task", lambda *args, **kwargs: None)
    monkeypatch.setattr(summaries, "_enqueue", lambda job_id: None)
    tenant = make_tenant("summary-lock")
    write(tenant, "user:u7:diet", f"{CANARY} vegetarian")
    job = summaries.summarize_start(tenant=tenant, actor=SYSTEM, prefix="user:u7:")
    # By key: the summary is found by its lineage alone (a subject's forget also finds it by
    # its subject, in a later batch).
    request = forget.forget_request_create(tenant=tenant, actor=SYSTEM, keys=["user:u7:diet"])
    written, failures = threading.Event(), []
    write_summary = summaries._write_summary

    def write_and_wait_for_the_forget(**kwargs):
        result = write_summary(**kwargs)  # the sources locked, the summary written, not committed
        written.set()
        wait_for_a_lock_waiter("the forget")  # the forget is waiting for the sources now
        return result

    monkeypatch.setattr(summaries, "_write_summary", write_and_wait_for_the_forget)

    def summary_job():
        assert summaries.summarize_run(job_id=job.pk)["sources"] == 1

    racer = start_thread(summary_job, failures, done=written)
    assert written.wait(20)
    forget.forget_request_execute(request_id=request.pk)
    racer.join(30)

    assert not failures, failures
    request.refresh_from_db()
    assert request.status == "completed" and request.receipt["summaries"] == 1
    assert not Memory.objects.filter(tenant=tenant, key="summary:user:u7").exists()
    assert tables_holding(CANARY) == {}


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_summary_rebuild_waits_for_a_write_to_the_summary_and_versions_after_it(
    monkeypatch, make_client, django_capture_on_commit_callbacks
):
    """A forget rebuilds a shared summary outside its reach from the row it read. A write to
    that summary committing in between must come first, and the rebuild take the next
    version: read unlocked, the rebuild wrote the version the write had been acknowledged
    with (two different texts under one version number, the write's gone)."""
    monkeypatch.setattr(forget, "async_task", lambda *args, **kwargs: None)  # run below
    tenant = make_tenant("rebuild-race")
    summary = _shared_summary(tenant, django_capture_on_commit_callbacks)
    client, _ = make_client(tenant, allow=["user:u1:"])
    r = client.post(URL, {"keys": ["user:u1:pref_lang"]})
    assert r.status_code == 202, r.content
    written, failures, acked = threading.Event(), [], []

    def write_the_summary_and_wait_for_the_forget():
        with transaction.atomic():
            acked.append(write(tenant, summary.key, "a note an agent wrote").version)
            written.set()
            wait_for_a_lock_waiter("the forget")  # the forget is waiting for the summary now

    racer = start_thread(write_the_summary_and_wait_for_the_forget, failures, done=written)
    assert written.wait(20)
    forget.forget_request_execute(request_id=pk_of(r.json()["id"]))
    racer.join(30)

    assert not failures, failures
    final = Memory.objects.get(pk=summary.pk)
    assert acked == [summary.version + 1]
    assert final.version == acked[0] + 1  # after the write, not over it
    assert CANARY not in str(final.value)
    history = list(MemoryVersion.objects.filter(memory_id=summary.pk).values_list("version", flat=True))
    assert history == [final.version]


# --- writes acknowledged while a request is open --------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sensitive", [False, True])
def test_a_write_acknowledged_after_the_erasing_but_before_completion_is_forgotten_too(monkeypatch, sensitive):
    """The rule: what is written for the target before the request completes is forgotten
    (before the job runs, or while it runs); what is written after ``completed_at`` stays.
    A write committed by another connection after the erasing batches, while the job redacts
    the audit log, was kept under a ``completed`` receipt (and, sealed, under a data key the
    shred had missed)."""
    monkeypatch.setattr(forget, "async_task", lambda *args, **kwargs: None)  # run below, in this thread
    tenant = make_tenant("forget-late-write")
    write(tenant, "user:u7:diet", "vegetarian", subject="u7")
    request = forget.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u7")
    write(tenant, "user:u7:city", "Lyon", subject="u7")  # after acceptance, before the job: forgotten
    redact, failures, passes = forget.audit_redact_subject, [], []

    def redact_after_a_late_write(**kwargs):
        def late_write():
            write(tenant, "user:u7:pet", "a cat named " + CANARY, subject="u7", sensitive=sensitive)

        if not passes:  # once: the job's first pass over the audit log
            start_thread(late_write, failures).join(30)
        passes.append(kwargs["after"])
        return redact(**kwargs)

    monkeypatch.setattr(forget, "audit_redact_subject", redact_after_a_late_write)
    forget.forget_request_execute(request_id=request.pk)

    assert not failures, failures
    request.refresh_from_db()
    assert request.status == "completed"
    assert len(passes) == 2 and passes[1] > passes[0]  # the second pass went on from the cursor
    assert not Memory.objects.filter(tenant=tenant, subject="u7").exists()
    assert not MemoryVersion.objects.filter(tenant=tenant, subject="u7").exists()
    assert request.receipt["memories"] == 3
    assert not AuditEvent.objects.filter(tenant=tenant, target="user:u7:pet").exists()
    if sensitive:  # the late write's key (the shred before it found none) is destroyed too
        from memories.models import DataKey

        assert request.receipt["data_keys_destroyed"] == 1
        assert not DataKey.objects.filter(tenant_id=tenant.pk, subject="u7").exists()
    # After completion a write is new data about them, and stays.
    write(tenant, "user:u7:diet", "vegan", subject="u7")
    assert Memory.objects.filter(tenant=tenant, subject="u7").count() == 1


def test_forgetting_a_prefix_redacts_the_keys_of_its_summaries_in_old_audit_events(
    api, tenant_a, django_capture_on_commit_callbacks
):
    """The summary of ``user:u9:`` is ``summary:user:u9``: erased with the prefix (lineage),
    its key stayed in the audit events of its write and reads, naming whom the prefix was
    about, since it does not start with the prefix."""
    write(tenant_a, "user:u9:lang", "de")
    write(tenant_a, "user:u9:sessions:s1:a", "x")
    summarize(tenant_a, "user:u9:", django_capture_on_commit_callbacks)
    summarize(tenant_a, "user:u9:sessions:s1:", django_capture_on_commit_callbacks)
    services.memory_read(tenant=tenant_a, actor=SYSTEM, key="summary:user:u9")
    write(tenant_a, "summary:user:u90", "another user's summary, kept")
    assert AuditEvent.objects.filter(tenant=tenant_a, target="summary:user:u9").count() >= 2
    r = post(api, django_capture_on_commit_callbacks, {"prefix": "user:u9:"})
    assert get(api, r.json()["id"])["receipt"]["summaries"] == 2
    assert tables_holding("user:u9:") == {"memories_forgetrequest": 1}
    assert (
        not AuditEvent.objects.filter(tenant=tenant_a, target__startswith="summary:user:u9")
        .exclude(target="summary:user:u90")
        .exists()
    )
    assert AuditEvent.objects.filter(tenant=tenant_a, target="summary:user:u90").exists()


def test_a_forget_redacts_memory_keys_never_the_targets_of_key_and_membership_events(
    api, tenant_a, django_capture_on_commit_callbacks
):
    """A forget pseudonymizes what names the forgotten end user or keys: a memory key, a
    prefix. An API key's public prefix (api_key.create/revoke), a staff username
    (membership.set/remove) or a tenant's slug is no memory key: a forget of the prefix
    "zm_" (or of a subject spelled like a staff username) pseudonymized who was given
    which key and role — the access-control trail a compliance review reads — leaving
    only that *someone* got a key."""
    key, _raw = services.api_key_create(tenant=tenant_a, actor=SYSTEM, name="ci", scopes=["memory:read"])
    services.api_key_revoke(tenant=tenant_a, actor=SYSTEM, key_id=key.pk)
    staff = make_staff(tenant_a, "support", username="u7")
    write(tenant_a, "zm_notes:k", "value")  # a memory key that does start with zm_
    write(tenant_a, "user:u7:k", "value")
    # Their readings in the admin name them the same way (api_key.view, membership.view).
    services.api_key_view(tenant=tenant_a, actor=SYSTEM, key_id=key.pk)
    membership = Membership.objects.get(tenant=tenant_a, user=staff)
    services.membership_view(tenant=tenant_a, actor=SYSTEM, membership_id=membership.pk)
    access = ("api_key.create", "api_key.revoke", "api_key.view", "membership.set", "membership.view")
    before = dict(AuditEvent.objects.filter(tenant=tenant_a, action__in=access).values_list("action", "target"))
    assert before["api_key.create"] == key.display_prefix and before["membership.set"] == staff.username
    assert before["api_key.view"] == key.display_prefix and before["membership.view"] == staff.username

    for body in ({"prefix": "zm_"}, {"subject": "u7"}, {"keys": [key.display_prefix, staff.username]}):
        r = post(api, django_capture_on_commit_callbacks, body)
        assert get(api, r.json()["id"])["status"] == "completed"

    after = dict(AuditEvent.objects.filter(tenant=tenant_a, action__in=access).values_list("action", "target"))
    assert after == before
    # The memory keys those requests named are redacted as before.
    assert not AuditEvent.objects.filter(tenant=tenant_a, target__in=["zm_notes:k", "user:u7:k"]).exists()
    audit_services.audit_seal(tenant_id=tenant_a.pk)
    assert audit_verify(tenant_id=tenant_a.pk).ok


def _attempt_fail_events(request) -> list[AuditEvent]:
    return list(
        AuditEvent.objects.filter(action="forget.attempt_fail", detail__forget_request=str(request.uid)).order_by("pk")
    )


def test_each_failed_forget_attempt_is_audited_once_with_its_attempt_and_error_code(tenant_a, monkeypatch, settings):
    # Once only the give-up was (forget.fail): a compliance reviewer could not see that an end
    # user's erasure failed three times before it succeeded.
    from django.db import OperationalError

    settings.ZEROMEM_JOB_MAX_ATTEMPTS = 5
    write(tenant_a, "user:u1:diagnosis", "the secret diagnosis")
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    real = forget._erase_batch

    def database_down(request_id, *, batch_size, **kwargs):
        # A database error's message can quote the row it failed on.
        raise OperationalError('duplicate key (key)=(user:u1:diagnosis) "the secret diagnosis"')

    monkeypatch.setattr(forget, "_erase_batch", database_down)
    for _ in range(3):
        with pytest.raises(OperationalError):
            forget.forget_request_execute(request_id=request.pk)
    monkeypatch.setattr(forget, "_erase_batch", real)
    assert forget.forget_request_execute(request_id=request.pk)["status"] == "completed"

    events = _attempt_fail_events(request)
    assert [(e.outcome, e.actor_kind, e.actor_id, e.target, e.subject) for e in events] == [
        ("unavailable", "system", "forget", "", "")
    ] * 3
    assert [e.detail for e in events] == [
        {"forget_request": str(request.uid), "attempt": n, "max_attempts": 5, "error": "database_error"}
        | {"gave_up": False}
        for n in (1, 2, 3)
    ]
    done = ForgetRequest.objects.get(pk=request.pk)
    assert (done.attempts, done.error) == (4, "")
    assert forget.FAILURE_AUDITED not in done.receipt  # the final receipt: counts and times only
    for e in AuditEvent.objects.all():
        text = json.dumps([e.target, e.detail, e.subject])
        assert "secret diagnosis" not in text and "user:u1:diagnosis" not in text


def test_the_forget_attempt_that_uses_the_last_one_says_it_gave_up(tenant_a, monkeypatch, settings):
    settings.ZEROMEM_JOB_MAX_ATTEMPTS = 2
    write(tenant_a, "user:u1:k", "value")
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")

    def broken(request_id, *, batch_size, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(forget, "_erase_batch", broken)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            forget.forget_request_execute(request_id=request.pk)
    assert forget.forget_request_execute(request_id=request.pk)["status"] == "failed"
    assert [(e.detail["attempt"], e.detail["error"], e.detail["gave_up"]) for e in _attempt_fail_events(request)] == [
        (1, "internal_error", False),
        (2, "internal_error", True),
    ]
    assert AuditEvent.objects.filter(action="forget.fail", detail__forget_request=str(request.uid)).count() == 1


def test_a_failed_forget_attempts_event_is_in_the_transaction_that_records_the_failure(tenant_a, monkeypatch):
    write(tenant_a, "user:u1:k", "value")
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")

    def broken(request_id, *, batch_size, **kwargs):
        raise ConnectionError("worker lost the database")

    def broken_record(*args, **kwargs):
        raise RuntimeError("audit INSERT failed")

    monkeypatch.setattr(forget, "_erase_batch", broken)
    monkeypatch.setattr(forget, "_record_failed_attempt", broken_record)
    with pytest.raises(ConnectionError):  # the step's own error, not the audit's
        forget.forget_request_execute(request_id=request.pk)
    halfway = ForgetRequest.objects.get(pk=request.pk)
    # The failure is not recorded without its event (the attempt still counts).
    assert (halfway.status, halfway.attempts, halfway.error) == ("running", 1, "")
    assert forget.FAILURE_AUDITED not in halfway.receipt


def test_a_forget_step_whose_worker_stopped_is_audited_when_the_next_one_begins(tenant_a, monkeypatch, settings):
    write(tenant_a, "user:u1:k", "value")
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    real = forget._erase_batch

    def killed(request_id, *, batch_size, **kwargs):
        raise SystemExit("SIGKILL")  # no except clause of the step runs, as for a kill -9

    monkeypatch.setattr(forget, "_erase_batch", killed)
    with pytest.raises(SystemExit):
        forget.forget_request_execute(request_id=request.pk)
    monkeypatch.setattr(forget, "_erase_batch", real)
    assert ForgetRequest.objects.get(pk=request.pk).stepping
    assert _attempt_fail_events(request) == []

    # django-q2 kills a task at Q_TIMEOUT: the step is over then (the clock moved on).
    timeout = settings.Q_CLUSTER.get("timeout", 300)
    ForgetRequest.objects.filter(pk=request.pk).update(turn_at=timezone.now() - timedelta(seconds=timeout + 1))
    assert forget.forget_request_execute(request_id=request.pk)["status"] == "completed"
    assert [e.detail for e in _attempt_fail_events(request)] == [
        {
            "forget_request": str(request.uid),
            "attempt": 1,
            "max_attempts": settings.ZEROMEM_JOB_MAX_ATTEMPTS,
            "error": "worker_stopped",
            "gave_up": False,
        }
    ]


def test_a_step_that_failed_is_not_audited_again_as_stopped(tenant_a, monkeypatch, settings):
    write(tenant_a, "user:u1:k", "value")
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    real = forget._erase_batch

    def broken(request_id, *, batch_size, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(forget, "_erase_batch", broken)
    with pytest.raises(RuntimeError):
        forget.forget_request_execute(request_id=request.pk)
    monkeypatch.setattr(forget, "_erase_batch", real)
    timeout = settings.Q_CLUSTER.get("timeout", 300)
    ForgetRequest.objects.filter(pk=request.pk).update(turn_at=timezone.now() - timedelta(seconds=timeout + 1))
    assert forget.forget_request_execute(request_id=request.pk)["status"] == "completed"
    assert [e.detail["error"] for e in _attempt_fail_events(request)] == ["internal_error"]
