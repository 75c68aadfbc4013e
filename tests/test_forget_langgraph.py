"""A subject's forget reaches the LangGraph store's items about them, and every version of
what was theirs.

1. An item of a namespace ``("users", <id>, ...)`` (the memory ``lg:users:<id>:...``) is
   about the end user ``<id>``: its ``subject`` is inferred from the key as ``user:<id>:...``'s
   is (zeromem.kernel.subjectkeys). Before, LangGraph puts stored no subject, and a forget of
   ``<id>`` completed leaving the items, their versions and their audit events' keys; the
   end user's portal did not list them. Items stored before (no subject) are reached by the
   namespace, as ``user:<id>:`` keys written with ``subject: ""`` are.
2. A version written with no subject under a subject's namespace was theirs: it goes with
   their forget even when the key was later handed to someone else (it stayed in the
   history); and a memory whose current subject is the forgotten one goes with every version,
   those written before it was given a subject included.

The end-to-end check with the real ``langgraph_sdk`` client is in tests/test_langgraph_store.py
(``sdk_items_of_a_user_namespace_go_with_their_forget``)."""

import json

import pytest

from audit.models import AuditEvent
from memories import services
from memories.models import ForgetRequest, Memory, MemoryVersion
from memories.services import forget, subjects
from tests.factories import SYSTEM, make_keyed_client, summarize, write
from zeromem.kernel.actors import Actor
from zeromem.kernel.outcomes import ActorKind
from zeromem.kernel.scopes import Scope
from zeromem.kernel.subjectkeys import subject_of_key

CANARY = "CANARY-lg-4e2a"
ITEMS = "/api/v1/langgraph/store/items"


def forget_subject(tenant, subject):
    request = forget.forget_request_create(tenant=tenant, actor=SYSTEM, subject=subject)
    forget.forget_request_execute(request_id=request.pk)
    request.refresh_from_db()
    assert request.status == ForgetRequest.Status.COMPLETED
    return request


def put(client, namespace, key, value):
    r = client.put(ITEMS, {"namespace": namespace, "key": key, "value": value})
    assert r.status_code == 204, r.content


def canaries(tenant):
    return [v.key for v in Memory.objects.filter(tenant=tenant) if CANARY in str(v.value)] + [
        v.memory_id for v in MemoryVersion.objects.filter(tenant=tenant) if CANARY in str(v.value)
    ]


@pytest.mark.parametrize(
    "key,subject",
    [
        ("user:u1:k", "u1"),
        ("usr:u1:k", "u1"),
        ("lg:users:u1:prefs", "u1"),
        ("lg:user:u1:prefs", "u1"),
        ("lg:usr:u1:a:b", "u1"),
        ("lg:users:a~3Ab:prefs", "a:b"),  # the label unescaped, as the app named the user
        ("lg:users:u1", ""),  # namespace ("users",), key "u1": no user named
        ("lg:memories:u1:prefs", ""),
        ("lg:users:a~0Ab:prefs", ""),  # a control character: no subject a write could store
        ("lg:users:a~7e:prefs", ""),  # no item's key (lowercase escape)
        ("users:u1:prefs", ""),
    ],
)
def test_the_subject_a_key_names(key, subject):
    assert subject_of_key(key) == subject


@pytest.mark.django_db
def test_langgraph_items_of_a_users_namespace_carry_that_subject(tenant_a):
    client, _ = make_keyed_client(tenant_a)
    put(client, ["users", "u1"], "prefs", {"lang": "fr"})
    put(client, ["users", "u1", "notes"], "n1", {"text": "x"})
    put(client, ["users", "a:b"], "prefs", {"lang": "de"})
    put(client, ["docs", "u1"], "readme", {"text": "about no one"})
    put(client, ["users"], "u1", {"text": "a key, not a namespace"})
    subjects_by_key = dict(Memory.objects.filter(tenant=tenant_a).values_list("key", "subject"))
    assert subjects_by_key == {
        "lg:users:u1:prefs": "u1",
        "lg:users:u1:notes:n1": "u1",
        "lg:users:a~3Ab:prefs": "a:b",
        "lg:docs:u1:readme": "",
        "lg:users:u1": "",
    }
    # A put over an item keeps the subject it has (as a write of a user:<id>: key does):
    # a key handed to another end user through the REST API stays theirs.
    write(tenant_a, "lg:users:u1:prefs", {"lang": "fr"}, subject="u10")
    put(client, ["users", "u1"], "prefs", {"lang": "en"})
    assert Memory.objects.get(tenant=tenant_a, key="lg:users:u1:prefs").subject == "u10"


@pytest.mark.django_db
def test_a_subject_forget_erases_their_langgraph_items_versions_and_audit_keys(tenant_a, tenant_b):
    client, _ = make_keyed_client(tenant_a)
    put(client, ["users", "u1"], "prefs", {"note": f"{CANARY} v1"})
    put(client, ["users", "u1"], "prefs", {"note": f"{CANARY} v2"})
    put(client, ["users", "u1", "deep"], "k", {"note": f"{CANARY} deep"})
    put(client, ["users", "u1"], "gone", {"note": f"{CANARY} trashed"})
    body = json.dumps({"namespace": ["users", "u1"], "key": "gone"})
    gone = client.client.delete(ITEMS, body, content_type="application/json", headers=client._headers(None))
    assert gone.status_code == 204, gone.content
    # Stored before LangGraph items carried a subject: none recorded, on the row or its versions.
    write(tenant_a, "lg:users:u1:old", {"note": f"{CANARY} old"}, subject="")
    # Kept: another user's namespace, a namespace naming no user, the other tenant's.
    put(client, ["users", "u10"], "prefs", {"note": "u10 keeps this"})
    put(client, ["docs", "u1"], "readme", {"note": "about no one"})
    client_b, _ = make_keyed_client(tenant_b)
    put(client_b, ["users", "u1"], "prefs", {"note": "tenant b keeps this"})

    request = forget_subject(tenant_a, "u1")

    left = sorted(Memory.objects.filter(tenant=tenant_a).values_list("key", flat=True))
    assert left == ["lg:docs:u1:readme", "lg:users:u10:prefs"]
    assert canaries(tenant_a) == []
    assert request.receipt["memories"] == 4 and request.receipt["versions"] == 6  # the trashed one has its delete's
    # The item keys name the user: their audit events' keys are redacted with the rest.
    assert not AuditEvent.objects.filter(tenant=tenant_a, target__startswith="lg:users:u1:").exists()
    assert AuditEvent.objects.filter(tenant=tenant_a, target="lg:users:u10:prefs").exists()
    assert Memory.objects.filter(tenant=tenant_b, key="lg:users:u1:prefs").exists()
    assert client.get(ITEMS, {"namespace": "users.u1", "key": "prefs"}).status_code == 404


@pytest.mark.django_db
def test_the_end_users_portal_lists_their_langgraph_items_and_forgets_one(tenant_a, django_capture_on_commit_callbacks):
    client, _ = make_keyed_client(tenant_a)
    put(client, ["users", "u1"], "prefs", {"lang": "fr"})
    write(tenant_a, "lg:users:u1:old", {"lang": "it"}, subject="")
    put(client, ["users", "u2"], "prefs", {"lang": "de"})
    u1 = Actor(kind=ActorKind.END_USER, id="u1", scopes=frozenset({Scope.MEMORY_READ, Scope.FORGET_CREATE}))

    rows, total = subjects.subject_memories(tenant=tenant_a, actor=u1, subject="u1")
    assert (sorted(m.key for m in rows), total) == (["lg:users:u1:old", "lg:users:u1:prefs"], 2)
    with django_capture_on_commit_callbacks(execute=False):
        request = subjects.subject_forget(tenant=tenant_a, actor=u1, subject="u1", key="lg:users:u1:old")
    forget.forget_request_execute(request_id=request.pk)
    left = sorted(Memory.objects.filter(tenant=tenant_a).values_list("key", flat=True))
    assert left == ["lg:users:u1:prefs", "lg:users:u2:prefs"]


@pytest.mark.django_db
def test_a_key_limited_to_a_users_langgraph_namespace_may_name_that_user_as_subject(tenant_a):
    client, _ = make_keyed_client(tenant_a, allow=["lg:users:u1:"])
    put(client, ["users", "u1"], "prefs", {"lang": "fr"})
    r = client.put("/api/v1/memories/lg:users:u1:other", {"value": "x", "subject": "u1"})
    assert r.status_code in (200, 201), r.content
    r = client.put("/api/v1/memories/lg:users:u1:other", {"value": "x", "subject": "u2"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "subject_not_allowed"


@pytest.mark.parametrize("key", ["user:u9:note", "lg:users:u9:prefs"])
@pytest.mark.django_db
def test_a_version_of_their_namespace_naming_no_one_goes_after_the_key_is_handed_over(tenant_a, key):
    """v1 named no one under u9's namespace (theirs, as forget.subject_q reads it); v2 handed
    the key to u10. u9's forget erased neither: the memory is u10's now, and the version's
    empty subject was not u9's — it stayed in the history u10 (and the admin) can read."""
    write(tenant_a, key, f"{CANARY} u9's, no subject", subject="")
    write(tenant_a, key, "u10 now", subject="u10")
    memory = Memory.objects.get(tenant=tenant_a, key=key)

    request = forget_subject(tenant_a, "u9")

    memory.refresh_from_db()
    assert (memory.value, memory.subject) == ("u10 now", "u10")
    assert list(MemoryVersion.objects.filter(memory=memory).values_list("version", "subject")) == [(2, "u10")]
    assert request.receipt["versions"] == 1
    assert canaries(tenant_a) == []


@pytest.mark.django_db
def test_a_summary_made_while_their_namespace_key_named_no_one_goes_after_the_hand_over(
    tenant_a, django_capture_on_commit_callbacks
):
    write(tenant_a, "user:u9:note", f"{CANARY} note", subject="")
    made = summarize(tenant_a, "user:u9:", django_capture_on_commit_callbacks)
    assert CANARY in str(made.value)
    write(tenant_a, "user:u9:note", "u10 now", subject="u10")

    forget_subject(tenant_a, "u9")

    assert not Memory.objects.filter(pk=made.pk).exists()
    assert canaries(tenant_a) == []


@pytest.mark.parametrize("key", ["notes:x", "lg:users:u1:prefs", "lg:docs:d1:k"])
@pytest.mark.django_db
def test_every_version_of_a_memory_now_about_them_goes_those_naming_no_one_too(tenant_a, key):
    """A key later given to u1 (its subject set by a later version): the versions written
    before, with no subject, go with u1's forget — live or in the trash."""
    write(tenant_a, key, f"{CANARY} v1 no subject", subject="")
    write(tenant_a, key, f"{CANARY} v2", subject="u1")
    write(tenant_a, "notes:y", f"{CANARY} trashed v1", subject="")
    write(tenant_a, "notes:y", f"{CANARY} trashed v2", subject="u1")
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key="notes:y")

    request = forget_subject(tenant_a, "u1")

    assert not Memory.objects.filter(tenant=tenant_a).exists()
    assert not MemoryVersion.objects.filter(tenant=tenant_a).exists()
    assert (request.receipt["memories"], request.receipt["versions"]) == (2, 5)


@pytest.mark.django_db
def test_a_subject_with_a_colon_names_no_user_namespace_so_its_forget_leaves_another_users_keys(tenant_a):
    """``user:a:b:note`` is user ``a``'s key (the id is the segment after ``user:``). A forget of
    the subject ``a:b`` took ``user:a:b:`` as that subject's namespace: it erased ``a``'s memories
    there that named no one and pseudonymised ``a``'s audit events. A subject with ``:`` names
    no ``user:``/``usr:`` namespace (only its escaped LangGraph ones)."""
    from zeromem.kernel.subjectkeys import subject_namespaces

    assert not [p for p in subject_namespaces("a:b") if p.startswith(("user:", "usr:"))]
    assert "lg:users:a~3Ab:" in subject_namespaces("a:b")
    assert "user:a:" in subject_namespaces("a")
    write(tenant_a, "user:a:b:note", "a's note, no subject", subject="")
    write(tenant_a, "user:a:b:pref", "a's pref")
    before = set(AuditEvent.objects.filter(tenant=tenant_a, target__startswith="user:a:b:").values_list("pk", "target"))

    forget_subject(tenant_a, "a:b")

    kept = set(Memory.objects.filter(tenant=tenant_a).values_list("key", flat=True))
    assert kept == {"user:a:b:note", "user:a:b:pref"}
    after = set(AuditEvent.objects.filter(tenant=tenant_a, target__startswith="user:a:b:").values_list("pk", "target"))
    assert before and before <= after
