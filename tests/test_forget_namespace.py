"""A subject's forget reaches the memories of its own namespace (``user:<subject>:`` and
``usr:<subject>:``) that name no other end user: written with ``subject: ""`` ("no subject",
as an LLM filling an optional field sends it), or cleared to "" by a later write. Before,
the forget went by the ``subject`` column alone: it completed, redacted the audit events of
those keys and cancelled the namespace's summarize jobs, and left the memories themselves —
values, versions, summaries made from them — for any reader of the tenant."""

import pytest

from memories import services
from memories.models import ForgetRequest, Memory, MemoryVersion
from memories.services import forget, subjects
from tests.factories import SYSTEM, summarize, write
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import NotFound
from zeromem.kernel.outcomes import ActorKind
from zeromem.kernel.scopes import Scope

CANARY = "CANARY-ns-5c1f"


def forget_subject(tenant, subject):
    request = forget.forget_request_create(tenant=tenant, actor=SYSTEM, subject=subject)
    forget.forget_request_execute(request_id=request.pk)
    request.refresh_from_db()
    assert request.status == ForgetRequest.Status.COMPLETED
    return request


def test_a_subject_forget_erases_its_namespace_written_without_a_subject(tenant_a, tenant_b):
    write(tenant_a, "user:u9:diary", f"{CANARY} diary", subject="")
    write(tenant_a, "usr:u9:phone", f"{CANARY} phone", subject="")
    # Written with its inferred subject, then cleared by a later write ("" is no subject).
    write(tenant_a, "user:u9:note", f"{CANARY} note v1")
    write(tenant_a, "user:u9:note", f"{CANARY} note v2", subject="")
    assert Memory.objects.get(tenant=tenant_a, key="user:u9:note").subject == ""
    write(tenant_a, "user:u9:gone", f"{CANARY} trashed", subject="")
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key="user:u9:gone")
    # Kept: another end user's namespace, the key handed to u10 explicitly, another tenant's.
    write(tenant_a, "user:u90:diary", "u90 keeps this", subject="")
    write(tenant_a, "user:u9:handed", "now about u10", subject="u10")
    write(tenant_b, "user:u9:diary", "tenant b keeps this", subject="")

    request = forget_subject(tenant_a, "u9")

    left = sorted(Memory.objects.filter(tenant=tenant_a).values_list("key", flat=True))
    assert left == sorted(["user:u9:handed", "user:u90:diary"])
    assert not [v for v in MemoryVersion.objects.filter(tenant=tenant_a) if CANARY in str(v.value)]
    assert Memory.objects.filter(tenant=tenant_b, key="user:u9:diary").exists()
    assert request.receipt["memories"] == 4


def test_a_summary_of_a_subjectless_namespace_goes_with_it(tenant_a, django_capture_on_commit_callbacks):
    write(tenant_a, "user:u9:a", f"{CANARY} a", subject="")
    write(tenant_a, "user:u9:b", f"{CANARY} b", subject="")
    summary = summarize(tenant_a, "user:u9:", django_capture_on_commit_callbacks)
    assert CANARY in str(summary.value) and summary.subject == ""

    request = forget_subject(tenant_a, "u9")

    assert not Memory.objects.filter(tenant=tenant_a).exists()
    assert (request.receipt["memories"], request.receipt["summaries"]) == (2, 1)


def test_a_write_without_subject_committed_during_the_forget_is_erased_before_it_completes(tenant_a, monkeypatch):
    """The completion's look for the target again (forget._target_left) covers the namespace too."""
    write(tenant_a, "user:u9:a", "first", subject="")
    real = forget._shred
    wrote = []

    def shred_then_write(request_id):
        if not wrote:
            wrote.append(write(tenant_a, "user:u9:late", f"{CANARY} late", subject=""))
        return real(request_id)

    monkeypatch.setattr(forget, "_shred", shred_then_write)
    forget_subject(tenant_a, "u9")
    assert wrote and not Memory.objects.filter(tenant=tenant_a).exists()


def _end_user(subject):
    return Actor(kind=ActorKind.END_USER, id=subject, scopes=frozenset({Scope.MEMORY_READ, Scope.FORGET_CREATE}))


def test_the_end_users_portal_lists_and_forgets_their_namespace_written_without_a_subject(
    tenant_a, django_capture_on_commit_callbacks
):
    """What their forget erases, the end user sees on their page and may forget one by one:
    the page went by the ``subject`` column alone, so u9 never saw ``user:u9:diary`` written
    with ``subject: ""``, and "forget this one" on it was a 404."""
    write(tenant_a, "user:u9:diary", f"{CANARY} diary", subject="")
    write(tenant_a, "user:u9:city", "Oslo")  # subject u9, inferred
    write(tenant_a, "user:u9:handed", "about u10", subject="u10")
    write(tenant_a, "user:u90:diary", "u90's", subject="")
    u9 = _end_user("u9")

    rows, total = subjects.subject_memories(tenant=tenant_a, actor=u9, subject="u9")
    assert (sorted(m.key for m in rows), total) == (["user:u9:city", "user:u9:diary"], 2)

    with django_capture_on_commit_callbacks(execute=False):
        request = subjects.subject_forget(tenant=tenant_a, actor=u9, subject="u9", key="user:u9:diary")
    forget.forget_request_execute(request_id=request.pk)
    request.refresh_from_db()
    assert (request.status, request.receipt["memories"]) == ("completed", 1)
    left = sorted(Memory.objects.filter(tenant=tenant_a).values_list("key", flat=True))
    assert left == sorted(["user:u9:city", "user:u9:handed", "user:u90:diary"])


def test_an_end_user_cannot_forget_a_key_of_their_namespace_written_for_someone_else(tenant_a):

    write(tenant_a, "user:u9:handed", "about u10", subject="u10")
    with pytest.raises(NotFound):
        subjects.subject_forget(tenant=tenant_a, actor=_end_user("u9"), subject="u9", key="user:u9:handed")


@pytest.mark.postgres
@pytest.mark.parametrize(
    "target", [{"subject": "u77"}, {"prefix": "user:u77:"}, {"keys": ["user:u77:k1", "user:u78:k4"]}]
)
def test_a_forget_batch_reads_its_targets_on_indexes_not_every_tenants_memories(tenant_a, target):
    """No index holds every memory by key (the two partial ones hold the live and the trashed):
    a forget by prefix or keys looked for its batch with a sequential scan of the whole table,
    every tenant's memories, once a batch."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO memories_memory (tenant_id, key, namespace, value, sensitive, search_text, category,
                   subject, tags, importance, source, version, created_at, updated_at, access_count, sources,
                   deleted_at)
               SELECT %s, 'user:u' || i || ':k' || j, 'user:u' || i, '"v"', false, '', 'user',
                      CASE WHEN j = 0 THEN '' ELSE 'u' || i END, '[]', 5, '', 1, now(), now(), 0, '[]',
                      CASE WHEN j = 4 THEN now() END
               FROM generate_series(1, 20000) i, generate_series(0, 4) j""",
            [tenant_a.pk],
        )
        cursor.execute("ANALYZE memories_memory")
    request = ForgetRequest(tenant=tenant_a, reach={}, **target)
    batch = forget._target_memories(request).order_by("pk").select_for_update().values_list("pk")[:500]
    assert "Seq Scan" not in batch.explain()
    assert len(batch) == {"subject": 5, "prefix": 5, "keys": 2}[next(iter(target))]


@pytest.mark.postgres
def test_a_completed_forget_leaves_no_word_only_the_subject_had_in_the_term_statistics(api):
    """The term statistics (``SearchTerm``: each word of the tenant's memories and how many
    hold it) kept a forgotten subject's words — a name, a diagnosis — after the request
    completed, until the search-stats schedule's next recount (10 minutes, longer when it
    lags): a backup or dump taken meanwhile held them. A word someone else held at the count stays."""
    from memories.models import SearchTerm
    from memories.tasks import search_stats_refresh_task

    api.call("memory_write", key="user:u7:note", value="pelican zanzibar")
    api.call("memory_write", key="user:u7:odd", value="o'brien's back\\slash 钱包")  # odd words for the probe
    api.call("memory_write", key="user:u7:trashed", value="pelican quixotry")  # counted while live
    api.call("memory_write", key="user:u8:note", value="pelican")
    api.call("memory_write", key="user:u9:note", value="zzyzx")
    search_stats_refresh_task()
    api.call("memory_delete", key="user:u7:trashed")
    api.call("memory_write", key="user:u7:late", value="oxbow zzyzx")  # after the count
    terms = lambda: dict(SearchTerm.objects.filter(tenant=api.tenant).values_list("term", "ndoc"))  # noqa: E731
    before = terms()
    assert {"zanzibar", "quixotry", "pelican", "zzyzx"} <= set(before)

    forget_subject(api.tenant, "u7")

    left = terms()
    assert "zanzibar" not in left and "quixotry" not in left
    # Nothing but the words of u8's and u9's memories (their keys' too); "u7" itself went.
    # "zzyzx" went too: by the count only u9's memory held it, and u7's late one (written
    # since) is erased — until the recount it counts as rare, as any word new since a count.
    assert set(left) == {"user", "u8", "u9", "note", "pelican"}, left
    search_stats_refresh_task()
    assert terms()["zzyzx"] == 1
    assert left["pelican"] >= 1  # held by u8's memory
