"""Idempotency-Key: a retried write gets the first answer and is not done again; another
request under the same key is 422; a concurrent duplicate waits for the first answer; the
answers are purged after their window, and by a forget request."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

import httpx
import pytest
from django.db import connection, transaction
from django.utils import timezone

from audit import limits
from audit.models import AuditEvent
from memories import services
from memories.models import ForgetRequest, IdempotencyRecord, Memory, MemoryVersion
from memories.services import idempotency
from memories.services.idempotency import idempotency_purge
from memories.services.jobs import _PENDING_LOCK_NAMESPACES
from memories.tasks import idempotency_purge_task
from tests.factories import SYSTEM, make_key, make_keyed_client, make_tenant
from tests.helpers import rest_error, start_thread, wait_for_a_lock_waiter
from zeromem.kernel.errors import Conflict
from zeromem.schedules import SCHEDULES

CALL = "/api/v1/tools/call"
BATCH = "/api/v1/tools/batch"


def _key(value):
    return {"Idempotency-Key": value}


def test_a_retried_tool_call_gets_the_first_answer_without_doing_it_again(api, tenant_a):
    api.call("memory_write", key="task:t1:step", value=1)
    update = {"name": "memory_update", "arguments": {"key": "task:t1:step", "value": 2}}
    first = api.post(CALL, update, headers=_key("k-1"))
    again = api.post(CALL, update, headers=_key("k-1"))
    assert first.status_code == again.status_code == 200
    assert first.json() == again.json() == {"status": "ok", "key": "task:t1:step", "version": 2, "created": False}
    assert again["Idempotent-Replayed"] == "true" and not first.has_header("Idempotent-Replayed")
    memory = Memory.objects.get(tenant=tenant_a, key="task:t1:step")
    assert memory.version == 2  # not 3: the retry did not update again
    assert MemoryVersion.objects.filter(memory=memory).count() == 2
    assert AuditEvent.objects.filter(tenant=tenant_a, action="memory.update").count() == 1
    # A new key is a new request.
    assert api.post(CALL, update, headers=_key("k-2")).json()["version"] == 3


def test_the_stored_fingerprint_is_keyed_so_a_short_value_cannot_be_guessed_from_it(api, tenant_a):
    """The fingerprint is kept for the key's window beside the answer; a plain hash of a body
    holding a phone number could be matched against every candidate number. It is keyed with a
    secret the database does not hold; a record made before (a plain hash) still replays."""
    import hashlib
    import json

    from memories.services import idempotency

    body = {"name": "memory_write", "arguments": {"key": "user:u1:phone", "value": "555-0100", "sensitive": True}}
    assert api.post(CALL, body, headers=_key("k-phone")).status_code == 200
    stored = IdempotencyRecord.objects.get(tenant=tenant_a, key="k-phone").fingerprint
    for guess in ("555-0100", "555-0101"):
        data = {**body, "arguments": {**body["arguments"], "value": guess}}
        text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert stored != hashlib.sha256("\n".join(["POST", CALL, "", text]).encode()).hexdigest()
    parts = {"method": "POST", "path": CALL, "if_match": None, "data": body}
    assert stored == idempotency.fingerprint(**parts)
    # A record from before the keyed fingerprint: a retry of its request is replayed, not refused.
    IdempotencyRecord.objects.filter(key="k-phone").update(fingerprint=idempotency.legacy_fingerprint(**parts))
    again = api.post(CALL, body, headers=_key("k-phone"))
    assert again.status_code == 200 and again["Idempotent-Replayed"] == "true"
    assert Memory.objects.get(tenant=tenant_a, key="user:u1:phone").version == 1


def test_a_replayed_answer_is_recorded_in_the_audit_log(api, tenant_a):
    # A replay hands the first answer out again — a memory_read's value, even after the
    # memory went to the trash — and wrote no audit event: the log showed one reading where
    # the value left twice. Now the replay is an event of its own (the work's event stays one).
    api.call("memory_write", key="user:u1:a", value="first")
    read = {"name": "memory_read", "arguments": {"key": "user:u1:a"}}
    first = api.post(CALL, read, headers=_key("k-read"))
    api.call("memory_delete", key="user:u1:a")
    again = api.post(CALL, read, headers=_key("k-read"))
    assert again["Idempotent-Replayed"] == "true" and again.json() == first.json()
    assert AuditEvent.objects.filter(tenant=tenant_a, action="memory.read").count() == 1
    replay = AuditEvent.objects.get(tenant=tenant_a, action="request.replay")
    original = AuditEvent.objects.get(tenant=tenant_a, action="memory.read")
    assert (replay.actor_kind, replay.actor_id, replay.surface) == (original.actor_kind, original.actor_id, "tool")
    assert (replay.outcome, replay.request_id) == ("ok", again["X-Request-ID"])
    assert replay.detail == {"action": "tool.call", "status": 200, "claimed_at": replay.detail["claimed_at"]}
    # When the first request claimed the key: its own event follows within moments, by the same key.
    claimed = datetime.fromisoformat(replay.detail["claimed_at"])
    assert claimed <= original.occurred_at < claimed + timedelta(seconds=30)
    path = "/api/v1/memories/user:u1:b"
    api.put(path, {"value": 1}, headers=_key("k-put"))
    assert api.put(path, {"value": 1}, headers=_key("k-put")).status_code == 201
    put = AuditEvent.objects.filter(tenant=tenant_a, action="request.replay").latest("pk")
    assert (put.target, put.surface, put.detail["action"], put.detail["status"]) == (
        "user:u1:b",
        "rest",
        "memory.write",
        201,
    )


def test_rest_writes_replay_status_and_etag(api, tenant_a):
    path = "/api/v1/memories/user:u1:name"
    first = api.put(path, {"value": "Ann"}, headers=_key("put-1"))
    again = api.put(path, {"value": "Ann"}, headers=_key("put-1"))
    assert first.status_code == again.status_code == 201
    assert again["ETag"] == first["ETag"] and again.content == first.content
    assert again["Content-Type"] == first["Content-Type"] == "application/json"
    assert Memory.objects.get(tenant=tenant_a, key="user:u1:name").version == 1
    deleted = api.delete(path, headers={**_key("del-1"), "If-Match": first["ETag"]})
    replayed = api.delete(path, headers={**_key("del-1"), "If-Match": first["ETag"]})
    assert deleted.status_code == replayed.status_code == 204
    assert api.delete(path, headers={"If-Match": first["ETag"]}).status_code == 412  # without the key: run again


def test_a_batch_is_replayed_whole(api, tenant_a):
    body = {"calls": [{"name": "memory_write", "arguments": {"key": f"fact:f{i}", "value": i}} for i in range(3)]}
    first = api.post(BATCH, body, headers=_key("batch-1"))
    again = api.post(BATCH, body, headers=_key("batch-1"))
    assert first.json() == again.json() and [r["created"] for r in again.json()["results"]] == [True] * 3
    assert MemoryVersion.objects.filter(tenant=tenant_a).count() == 3


def test_the_same_key_with_another_request_is_422_and_changes_nothing(api, tenant_a):
    api.post(CALL, {"name": "memory_write", "arguments": {"key": "a:b", "value": 1}}, headers=_key("same"))
    before = MemoryVersion.objects.count()
    for other in (
        lambda: api.post(CALL, {"name": "memory_write", "arguments": {"key": "a:b", "value": 2}}, headers=_key("same")),
        lambda: api.put("/api/v1/memories/a:b", {"value": 1}, headers=_key("same")),
    ):
        r = other()
        assert r.status_code == 422
        assert rest_error(r)["code"] == "idempotency_key_reused" and rest_error(r)["field"] == "Idempotency-Key"
    assert MemoryVersion.objects.count() == before
    assert Memory.objects.get(tenant=tenant_a, key="a:b").value == 1


def test_keys_are_per_tenant_and_per_api_key(api, api_b, tenant_a, tenant_b):
    call = {"name": "memory_write", "arguments": {"key": "user:u1:x", "value": "mine"}}
    assert api.post(CALL, call, headers=_key("shared"))["Content-Type"] == "application/json"
    other_key, _ = make_keyed_client(tenant_a)
    r = other_key.post(CALL, {**call, "arguments": {"key": "user:u1:x", "value": "theirs"}}, headers=_key("shared"))
    assert r.status_code == 200 and not r.has_header("Idempotent-Replayed") and r.json()["version"] == 2
    r = api_b.post(CALL, call, headers=_key("shared"))
    assert r.json()["created"] is True and not r.has_header("Idempotent-Replayed")
    assert Memory.objects.get(tenant=tenant_b, key="user:u1:x").value == "mine"


@pytest.mark.parametrize("bad", ["", "has space", "x" * 256, "ключ"])
def test_a_malformed_key_is_400_naming_the_header(api, tenant_a, bad):
    r = api.post(CALL, {"name": "memory_write", "arguments": {"key": "a:b", "value": 1}}, headers=_key(bad))
    assert r.status_code == 400 and rest_error(r)["field"] == "Idempotency-Key"
    assert not Memory.objects.filter(tenant=tenant_a).exists()


def test_an_answer_that_says_retry_is_not_kept(api, tenant_a, settings):
    """A real 429 tenant_busy: the retry with the same key does the work."""
    settings.ZEROMEM_TENANT_BUSY_WAIT_SECONDS = 0
    holder = f"tenant:{tenant_a.pk}"
    tokens = [limits.slot_acquire(holder, limit=settings.ZEROMEM_TENANT_MAX_CONCURRENT, lease=60) for _ in range(4)]
    body = {"calls": [{"name": "memory_write", "arguments": {"key": "a:b", "value": 1}}]}
    assert api.post(BATCH, body, headers=_key("busy")).status_code == 429
    for token in tokens:
        limits.slot_release(holder, token)
    r = api.post(BATCH, body, headers=_key("busy"))
    assert r.status_code == 200 and not r.has_header("Idempotent-Replayed")
    assert Memory.objects.get(tenant=tenant_a, key="a:b").version == 1


def test_after_the_window_the_key_is_new_and_the_purge_deletes_it(api, tenant_a):
    call = {"name": "memory_update", "arguments": {"key": "a:b", "value": 2}}
    api.call("memory_write", key="a:b", value=1)
    api.post(CALL, call, headers=_key("old"))
    api.post(CALL, {"name": "memory_read", "arguments": {"key": "a:b"}}, headers=_key("fresh"))
    IdempotencyRecord.objects.filter(key="old").update(created_at=timezone.now() - timedelta(hours=24, seconds=1))
    assert api.post(CALL, call, headers=_key("old")).json()["version"] == 3  # ran again
    IdempotencyRecord.objects.filter(key="old").update(created_at=timezone.now() - timedelta(hours=25))
    assert idempotency_purge() == 1
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["fresh"]
    assert idempotency_purge_task() == 0
    assert SCHEDULES["zeromem:idempotency-purge"][0] == "memories.tasks.idempotency_purge_task"


def test_a_forget_request_drops_the_stored_answers(api, tenant_a):
    api.call("memory_write", key="user:u7:secret", value="CANARY-forget")
    api.post(CALL, {"name": "memory_read", "arguments": {"key": "user:u7:secret"}}, headers=_key("read-1"))
    assert b"CANARY-forget" in bytes(IdempotencyRecord.objects.get(key="read-1").body)
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u7")
    services.forget_request_execute(request_id=request.pk)
    assert not IdempotencyRecord.objects.filter(tenant=tenant_a).exists()


def test_a_forget_keeps_a_running_requests_claim_but_not_its_answer(tenant_a, settings):
    """A request still running when a forget request completes: a retry must not do its work
    a second time alongside it (409 while it runs), and its answer — which may hold what the
    forget erased — is not kept; once it has ended, a retry runs afresh."""
    settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS = 0
    api_key, _ = make_key(tenant_a)
    running = idempotency.claim(tenant=tenant_a, api_key=api_key, key="k-running", fingerprint="f")
    assert isinstance(running, int)
    request = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u7")
    services.forget_request_execute(request_id=request.pk)

    with pytest.raises(Conflict) as retried:
        idempotency.claim(tenant=tenant_a, api_key=api_key, key="k-running", fingerprint="f")
    assert retried.value.code == "idempotency_in_progress"
    idempotency.complete(running, status=200, body=b'{"value": "CANARY-erased"}', headers={})
    assert not IdempotencyRecord.objects.filter(tenant=tenant_a).exists()  # the answer was not kept
    again = idempotency.claim(tenant=tenant_a, api_key=api_key, key="k-running", fingerprint="f")
    assert isinstance(again, int) and again != running  # a new claim: the retry does the work
    idempotency.complete(again, status=200, body=b'{"value": "new"}', headers={})
    assert bytes(IdempotencyRecord.objects.get(pk=again).body) == b'{"value": "new"}'  # kept as usual


FORGET = "/api/v1/forget-requests"


@pytest.mark.django_db(transaction=True)
def test_a_retried_forget_request_gets_its_first_answer_though_the_forget_ran_before_it_was_stored(settings):
    """The worker can finish a small forget before the POST that filed it has stored its
    answer (here: tasks run inline, so the forget runs in the POST's on-commit, between the
    claim and the answer). Its own claim is not marked by the forget it filed, nor is its
    stored answer dropped by a later forget: a retry gets the same request, none is filed
    twice. Other requests' answers still go (they may hold what was erased)."""
    settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS = 0
    tenant = make_tenant("idem-forget")
    client, _key_row = make_keyed_client(tenant)
    client.call("memory_write", key="user:u7:secret", value="CANARY-forget", subject="u7")
    read = {"name": "memory_read", "arguments": {"key": "user:u7:secret"}}
    assert client.post(CALL, read, headers=_key("read-1")).status_code == 200

    body = {"subject": "u7"}
    first = client.post(FORGET, body, headers=_key("forget-1"))
    assert first.status_code == 202, first.content
    request_id = first.json()["id"]
    request = services.forget_request_get(tenant=tenant, actor=SYSTEM, request_id=request_id)
    assert request.status == "completed"  # it ran before the POST's answer was stored
    assert not Memory.objects.filter(tenant=tenant, key="user:u7:secret").exists()
    assert not IdempotencyRecord.objects.filter(tenant=tenant, key="read-1").exists()  # holds the value: gone

    again = client.post(FORGET, body, headers=_key("forget-1"))
    assert (again.status_code, again["Idempotent-Replayed"]) == (202, "true"), again.content
    assert again.json()["id"] == request_id and again["Location"] == first["Location"]
    # A later forget of the tenant keeps that answer too (it holds no memory value).
    later = client.post(FORGET, {"subject": "u8"}, headers=_key("forget-2"))
    assert later.status_code == 202 and later.json()["id"] != request_id
    third = client.post(FORGET, body, headers=_key("forget-1"))
    assert (third.status_code, third.json()["id"]) == (202, request_id)
    assert ForgetRequest.objects.filter(tenant=tenant).count() == 2
    assert AuditEvent.objects.filter(tenant=tenant, action="forget.create").count() == 2


def _hold(work, failures):
    """``work()`` in a transaction of its own thread, kept open until the returned event is
    set: (thread, done, release)."""
    done, release = threading.Event(), threading.Event()

    def run():
        with transaction.atomic():
            work()
            done.set()
            release.wait(30)

    return start_thread(run, failures, done=done), done, release


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_forget_completing_between_a_forget_posts_claim_and_its_filing_keeps_that_posts_answer(settings):
    """Another forget request of the tenant completes while the POST filing a new one has
    claimed its Idempotency-Key but not yet filed (here: it waits for the pending-forgets cap's
    lock): that forget marks the running claim ``keep_answer`` off before the filing marks it
    ``holds_no_values``. The filing's answer holds no memory value all the same: it is kept,
    and a retry gets the same request instead of filing a second one."""
    settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS = 0
    tenant = make_tenant("idem-forget-race")
    client, _key_row = make_keyed_client(tenant)
    failures, posted = [], []

    def cap_lock():  # what require_pending_room takes for this tenant's forget requests
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [_PENDING_LOCK_NAMESPACES["forget"], tenant.pk])

    def post():
        posted.append(client.post(FORGET, {"subject": "u7"}, headers=_key("f-1")))

    holder, held, release = _hold(cap_lock, failures)
    try:
        assert held.wait(20)
        poster = start_thread(post, failures)
        wait_for_a_lock_waiter("the filing POST", alive=poster.is_alive)  # claimed, waiting for the cap's lock
        other = services.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u9")  # runs inline
        assert ForgetRequest.objects.get(pk=other.pk).status == "completed"
    finally:
        release.set()
        holder.join(30)
    poster.join(30)
    assert not failures, failures
    first = posted[0]
    assert first.status_code == 202, first.content
    again = client.post(FORGET, {"subject": "u7"}, headers=_key("f-1"))
    assert (again.status_code, again.get("Idempotent-Replayed")) == (202, "true"), again.content
    assert again.json()["id"] == first.json()["id"]
    assert ForgetRequest.objects.filter(tenant=tenant, subject="u7").count() == 1


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", ["forget", "complete"])
def test_a_claim_completing_while_a_forget_completes_keeps_no_answer_in_either_order(first, settings):
    """The forget's mark and delete (in its completing transaction) and the request's
    complete() race on one row: whichever commits first, no answer of a request that ran
    alongside the forget is left to replay, and the retry then runs afresh."""
    settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS = 0
    tenant = make_tenant("idem-race")
    api_key, _ = make_key(tenant)
    running = idempotency.claim(tenant=tenant, api_key=api_key, key="k-race", fingerprint="f")
    forget = lambda: idempotency.tenant_forget(tenant=tenant)  # noqa: E731
    answer = lambda: idempotency.complete(running, status=200, body=b'{"v": "CANARY"}', headers={})  # noqa: E731
    holding, other = (forget, answer) if first == "forget" else (answer, forget)
    failures = []
    thread, done, release = _hold(holding, failures)
    try:
        assert done.wait(20)
        second = start_thread(other, failures)
        wait_for_a_lock_waiter("the second writer", alive=second.is_alive)  # it waits for the row
    finally:
        release.set()
        thread.join(30)
    second.join(30)
    assert not failures, failures
    assert not IdempotencyRecord.objects.filter(tenant=tenant).exists()
    again = idempotency.claim(tenant=tenant, api_key=api_key, key="k-race", fingerprint="f")
    assert isinstance(again, int)  # a new claim: the retry does the work, nothing replayed


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_marked_claim_whose_worker_died_is_given_up_after_its_lease(settings):
    """A claim the forget marked whose process died never completes: after the lease a retry
    claims afresh, and its answer is kept as usual (a later retry replays it)."""
    settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS = 0
    tenant = make_tenant("idem-dead")
    api_key, _ = make_key(tenant)
    dead = idempotency.claim(tenant=tenant, api_key=api_key, key="k-dead", fingerprint="f")
    idempotency.tenant_forget(tenant=tenant)
    past = timezone.now() - timedelta(seconds=settings.ZEROMEM_IDEMPOTENCY_LEASE_SECONDS + 1)
    IdempotencyRecord.objects.filter(pk=dead).update(created_at=past)
    retry = idempotency.claim(tenant=tenant, api_key=api_key, key="k-dead", fingerprint="f")
    assert isinstance(retry, int) and retry != dead
    idempotency.complete(retry, status=200, body=b'{"v": "new"}', headers={})
    replayed = idempotency.claim(tenant=tenant, api_key=api_key, key="k-dead", fingerprint="f")
    assert isinstance(replayed, IdempotencyRecord) and bytes(replayed.body) == b'{"v": "new"}'


@pytest.mark.postgres
def test_concurrent_duplicates_get_the_first_answer_and_write_once(live_server, transactional_db):
    """Eight threads send the same write with the same key at once, against a live server:
    one does the work, the others wait for its answer; one version, one audit event."""
    tenant = make_tenant("acme")
    _, raw = make_key(tenant)
    services.memory_write(tenant=tenant, actor=SYSTEM, key="task:t1:count", value=0)
    url = f"{live_server.url}{CALL}"
    headers = {"Authorization": f"Bearer {raw}", "Idempotency-Key": "once"}
    body = {"name": "memory_update", "arguments": {"key": "task:t1:count", "value": 1}}
    start = threading.Barrier(8)
    answers = []

    def send():
        with httpx.Client(timeout=30) as http:
            start.wait()
            r = http.post(url, json=body, headers=headers)
            answers.append((r.status_code, r.json(), r.headers.get("Idempotent-Replayed")))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {(status, str(result)) for status, result, _ in answers} == {
        (200, str({"status": "ok", "key": "task:t1:count", "version": 2, "created": False}))
    }
    assert sorted(replayed or "" for *_, replayed in answers) == [""] + ["true"] * 7
    memory = Memory.objects.get(tenant=tenant, key="task:t1:count")
    assert memory.version == 2
    assert AuditEvent.objects.filter(tenant=tenant, action="memory.update").count() == 1
