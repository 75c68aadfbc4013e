"""Idempotency-Key and answers that say "try again": a transient failure (429, 5xx; inside a
batch, a call's error of that kind) is never kept as the key's final answer, a batch whose
other calls committed resumes only the calls that did not get through, and a request slower
than the claim's lease is never run a second time while it still runs (its process renews
the claim), while the claim of a process that died is still given up after the lease."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import OperationalError
from django.utils import timezone

from audit import limits
from audit.models import AuditEvent
from memories import services
from memories.models import IdempotencyRecord, Memory
from memories.services import forget, idempotency
from tests.factories import SYSTEM, make_keyed_client, make_tenant
from tests.helpers import rest_error, start_thread
from zeromem.kernel.errors import TenantBusy, Unavailable

CALL = "/api/v1/tools/call"
BATCH = "/api/v1/tools/batch"

# What an inner call (or a whole request) meets that says "not done, try again", and the code
# its error carries: the database gone, a service's 503 and 429s, and a bug's 500.
TRANSIENT = {
    "database_unavailable": lambda: OperationalError("the database went away"),
    "search_timeout": lambda: Unavailable("ran out of time", code="search_timeout", retry_after=1),
    "tenant_busy": lambda: TenantBusy("busy", retry_after=1),
    "rate_limited": lambda: TenantBusy("throttled", code="rate_limited", retry_after=1),
    "internal_error": lambda: RuntimeError("a bug"),
}


def _key(value):
    return {"Idempotency-Key": value}


def _write(key, value):
    return {"name": "memory_write", "arguments": {"key": key, "value": value}}


@pytest.fixture
def fail_once(monkeypatch):
    """``fail_once(key, exc)``: the next memory_write of ``key`` raises ``exc`` (the outside
    world failing once), the following ones run for real. Returns the calls seen per key."""
    real = services.memory_write
    seen: dict[str, int] = {}
    failing: dict[str, BaseException] = {}

    def write(**kwargs):
        seen[kwargs["key"]] = seen.get(kwargs["key"], 0) + 1
        exc = failing.pop(kwargs["key"], None)
        if exc is not None:
            raise exc
        return real(**kwargs)

    monkeypatch.setattr(services, "memory_write", write)

    def arm(key, exc):
        failing[key] = exc
        return seen

    return arm


@pytest.mark.parametrize("code", TRANSIENT)
def test_a_batch_resumes_only_the_call_that_failed_transiently(api, tenant_a, fail_once, code):
    """Calls 1 and 3 committed, call 2 met a transient failure: the 200 is not the key's final
    answer. The retry with the same key runs call 2 alone (1 and 3 are not written twice) and
    answers all three; that answer is the final one, replayed after."""
    seen = fail_once("fact:b", TRANSIENT[code]())
    body = {"calls": [_write("fact:a", 1), _write("fact:b", 2), _write("fact:c", 3)]}
    first = api.post(BATCH, body, headers=_key("b-1"))
    assert first.status_code == 200
    results = first.json()["results"]
    assert [r["status"] for r in results] == ["ok", "error", "ok"] and results[1]["error"]["code"] == code

    again = api.post(BATCH, body, headers=_key("b-1"))
    assert again.status_code == 200 and not again.has_header("Idempotent-Replayed")
    assert [r["status"] for r in again.json()["results"]] == ["ok", "ok", "ok"]
    assert again.json()["results"][0] == results[0] and again.json()["results"][2] == results[2]
    assert seen == {"fact:a": 1, "fact:b": 2, "fact:c": 1}
    versions = dict(Memory.objects.filter(tenant=tenant_a).values_list("key", "version"))
    assert versions == {"fact:a": 1, "fact:b": 1, "fact:c": 1}
    assert AuditEvent.objects.filter(tenant=tenant_a, action="memory.write", outcome="ok").count() == 3

    last = api.post(BATCH, body, headers=_key("b-1"))
    assert last.get("Idempotent-Replayed") == "true" and last.json() == again.json()
    assert seen == {"fact:a": 1, "fact:b": 2, "fact:c": 1}


def test_a_batch_whose_every_call_failed_transiently_keeps_nothing(api, tenant_a, fail_once):
    seen = fail_once("fact:a", OperationalError("gone"))
    body = {"calls": [_write("fact:a", 1)]}
    first = api.post(BATCH, body, headers=_key("b-2"))
    assert first.json()["results"][0]["error"]["code"] == "database_unavailable"
    assert not IdempotencyRecord.objects.filter(key="b-2").exists()
    again = api.post(BATCH, body, headers=_key("b-2"))
    assert again.json()["results"][0]["status"] == "ok" and seen == {"fact:a": 2}


def test_a_batch_resumed_twice_keeps_what_each_attempt_got_through(api, tenant_a, fail_once):
    """The resumed call fails transiently again: still not final, and the next retry runs it
    alone again — the first attempt's results are kept across both."""
    seen = fail_once("fact:b", OperationalError("gone"))
    body = {"calls": [_write("fact:a", 1), _write("fact:b", 2)]}
    api.post(BATCH, body, headers=_key("b-3"))
    fail_once("fact:b", Unavailable("later", retry_after=1))
    second = api.post(BATCH, body, headers=_key("b-3"))
    assert [r["status"] for r in second.json()["results"]] == ["ok", "error"]
    third = api.post(BATCH, body, headers=_key("b-3"))
    assert [r["status"] for r in third.json()["results"]] == ["ok", "ok"]
    assert seen == {"fact:a": 1, "fact:b": 3}
    assert Memory.objects.get(tenant=tenant_a, key="fact:a").version == 1


def test_a_resumed_batch_keeps_a_sealed_first_attempt_sealed(api, tenant_a, fail_once):
    """The first attempt read a sensitive value: its partial answer is kept sealed (no
    plaintext at rest), opened for the resumed run, and the final answer sealed again."""
    api.call("memory_write", key="user:u1:phone", value="CANARY-555", subject="u1", sensitive=True)
    fail_once("fact:b", OperationalError("gone"))
    body = {"calls": [{"name": "memory_read", "arguments": {"key": "user:u1:phone"}}, _write("fact:b", 2)]}
    api.post(BATCH, body, headers=_key("b-4"))
    assert b"CANARY-555" not in bytes(IdempotencyRecord.objects.get(key="b-4").body)
    again = api.post(BATCH, body, headers=_key("b-4"))
    assert [r["status"] for r in again.json()["results"]] == ["ok", "ok"]
    assert again.json()["results"][0]["value"] == "CANARY-555"
    assert b"CANARY-555" not in bytes(IdempotencyRecord.objects.get(key="b-4").body)
    assert api.post(BATCH, body, headers=_key("b-4")).json() == again.json()


def test_a_resumption_whose_answer_cannot_be_stored_gives_the_partial_answer_back(
    api, tenant_a, fail_once, monkeypatch
):
    """Storing the resumed answer fails on the database: the request still answers what it
    did, and the key holds the partial answer again (not nothing, which would run call 1 twice)."""
    api.call("memory_write", key="user:u1:phone", value="CANARY-555", subject="u1", sensitive=True)
    seen = fail_once("fact:b", OperationalError("gone"))
    body = {"calls": [{"name": "memory_read", "arguments": {"key": "user:u1:phone"}}, _write("fact:b", 2)]}
    api.post(BATCH, body, headers=_key("b-7"))
    fail_once("fact:b", OperationalError("gone again"))
    real_seal = idempotency._seal

    def seal_fails(*args):
        raise OperationalError("the database went away while storing the answer")

    monkeypatch.setattr(idempotency, "_seal", seal_fails)
    second = api.post(BATCH, body, headers=_key("b-7"))
    assert second.status_code == 200
    record = IdempotencyRecord.objects.get(key="b-7")
    assert (record.status, record.pending) == (200, [1])
    monkeypatch.setattr(idempotency, "_seal", real_seal)
    third = api.post(BATCH, body, headers=_key("b-7"))
    assert [r["status"] for r in third.json()["results"]] == ["ok", "ok"]
    assert seen["fact:b"] == 3


def test_a_resumption_refused_as_a_whole_leaves_the_partial_answer_to_resume(api, tenant_a, fail_once, settings):
    """The retry that would resume is itself answered 429 tenant_busy (before any call ran):
    the partial answer stands again, and the next retry resumes it — call 1 still not twice."""
    seen = fail_once("fact:b", OperationalError("gone"))
    body = {"calls": [_write("fact:a", 1), _write("fact:b", 2)]}
    api.post(BATCH, body, headers=_key("b-5"))
    settings.ZEROMEM_TENANT_BUSY_WAIT_SECONDS = 0
    holder = f"tenant:{tenant_a.pk}"
    tokens = [limits.slot_acquire(holder, limit=settings.ZEROMEM_TENANT_MAX_CONCURRENT, lease=60) for _ in range(4)]
    busy = api.post(BATCH, body, headers=_key("b-5"))
    for token in tokens:
        limits.slot_release(holder, token)
    assert busy.status_code == 429
    record = IdempotencyRecord.objects.get(key="b-5")
    assert (record.status, record.pending) == (200, [1])
    again = api.post(BATCH, body, headers=_key("b-5"))
    assert [r["status"] for r in again.json()["results"]] == ["ok", "ok"] and seen == {"fact:a": 1, "fact:b": 2}


@pytest.mark.django_db(transaction=True)
def test_a_resumption_whose_process_died_is_resumed_again_after_the_lease(settings, fail_once, clock):
    """The process resuming a partial answer dies mid-way: its claim lapses after the lease,
    and the next retry resumes the same partial answer (it is still in the row) instead of
    running the whole batch again."""
    tenant = make_tenant("idem-resume-died")
    client, key_row = make_keyed_client(tenant)
    seen = fail_once("fact:b", OperationalError("gone"))
    body = {"calls": [_write("fact:a", 1), _write("fact:b", 2)]}
    client.post(BATCH, body, headers=_key("b-6"))
    fingerprint = idempotency.fingerprint(method="POST", path=BATCH, if_match=None, data=body)
    dying = idempotency.claim(tenant=tenant, api_key=key_row, key="b-6", fingerprint=fingerprint)
    assert idempotency.resumption(dying)[1] == [1]
    idempotency._drop(dying)  # the process is gone: nothing renews or finishes its claim
    settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS = 0
    assert client.post(BATCH, body, headers=_key("b-6")).status_code == 409
    clock.skip(settings.ZEROMEM_IDEMPOTENCY_LEASE_SECONDS + 1)
    again = client.post(BATCH, body, headers=_key("b-6"))
    assert [r["status"] for r in again.json()["results"]] == ["ok", "ok"] and seen == {"fact:a": 1, "fact:b": 2}
    assert Memory.objects.get(tenant=tenant, key="fact:a").version == 1


# --- the answer says which calls are pending ------------------------------------------------


def test_a_batch_answer_says_which_calls_a_retry_runs_again(api, tenant_a, fail_once):
    """Calls 1 and 3 (from 0) meet transient failures, call 4 a final one (a bad key): the
    answer's ``pending`` is [1, 3] — no client has to guess it from the codes. The resumption
    runs call 1 alone, which fails again: [1]. The next gets it through: [], and that answer
    (with its []) is the one replayed."""
    seen = fail_once("fact:b", OperationalError("gone"))
    fail_once("fact:d", Unavailable("later", code="embedding_unavailable", retry_after=1))
    calls = [_write("fact:a", 1), _write("fact:b", 2), _write("fact:c", 3), _write("fact:d", 4), _write("bad key", 5)]
    body = {"calls": calls}
    first = api.post(BATCH, body, headers=_key("p-1"))
    assert first.status_code == 200 and first.json()["pending"] == [1, 3]
    assert [r["status"] for r in first.json()["results"]] == ["ok", "error", "ok", "error", "error"]
    assert first.json()["results"][3]["error"]["code"] == "embedding_unavailable"  # a code no list knew
    fail_once("fact:b", Unavailable("later", retry_after=1))
    second = api.post(BATCH, body, headers=_key("p-1"))
    assert second.json()["pending"] == [1] and [r["status"] for r in second.json()["results"]][:4] == [
        "ok",
        "error",
        "ok",
        "ok",
    ]
    third = api.post(BATCH, body, headers=_key("p-1"))
    assert third.json()["pending"] == [] and not third.has_header("Idempotent-Replayed")
    replayed = api.post(BATCH, body, headers=_key("p-1"))
    assert replayed.get("Idempotent-Replayed") == "true" and replayed.json() == third.json()
    assert replayed.json()["pending"] == []
    assert {k: seen[k] for k in ("fact:a", "fact:b", "fact:c", "fact:d")} == {
        "fact:a": 1,
        "fact:b": 3,
        "fact:c": 1,
        "fact:d": 2,
    }


def test_a_batch_answer_without_a_key_says_which_calls_failed_transiently(api, tenant_a, fail_once):
    """No Idempotency-Key: nothing is kept, but ``pending`` still names the calls that met a
    transient failure (to retry them needs a key; the batch sent again runs every call)."""
    fail_once("fact:a", TenantBusy("busy", retry_after=1))
    r = api.post(BATCH, {"calls": [_write("fact:a", 1), _write("fact:b", 2)]})
    assert r.status_code == 200 and r.json()["pending"] == [0]
    assert not IdempotencyRecord.objects.exists()
    clean = api.post(BATCH, {"calls": [_write("fact:c", 1), _write("bad key", 2)]})
    assert clean.json()["pending"] == [] and clean.json()["results"][1]["error"]["code"] == "invalid_key"


def test_a_batch_none_of_whose_calls_got_through_says_all_are_pending(api, tenant_a, fail_once):
    fail_once("fact:a", OperationalError("gone"))
    fail_once("fact:b", RuntimeError("a bug"))
    r = api.post(BATCH, {"calls": [_write("fact:a", 1), _write("fact:b", 2)]}, headers=_key("p-3"))
    assert r.json()["pending"] == [0, 1] and not IdempotencyRecord.objects.filter(key="p-3").exists()


@pytest.mark.parametrize("code", ["database_unavailable", "search_timeout", "tenant_busy", "rate_limited"])
def test_a_single_tool_call_that_failed_transiently_is_not_kept(api, tenant_a, fail_once, code):
    seen = fail_once("fact:a", TRANSIENT[code]())
    first = api.post(CALL, _write("fact:a", 1), headers=_key("c-1"))
    assert first.status_code in (429, 503) and first.json()["error"]["code"] == code
    assert not IdempotencyRecord.objects.filter(key="c-1").exists()
    again = api.post(CALL, _write("fact:a", 1), headers=_key("c-1"))
    assert again.status_code == 200 and not again.has_header("Idempotent-Replayed") and seen == {"fact:a": 2}


@pytest.mark.parametrize("code", ["database_unavailable", "search_timeout", "tenant_busy"])
def test_a_rest_write_that_failed_transiently_is_not_kept(api, tenant_a, fail_once, code):
    seen = fail_once("fact:a", TRANSIENT[code]())
    first = api.put("/api/v1/memories/fact:a", {"value": 1}, headers=_key("r-1"))
    assert first.status_code in (429, 503) and rest_error(first)["code"] == code
    assert not IdempotencyRecord.objects.filter(key="r-1").exists()
    again = api.put("/api/v1/memories/fact:a", {"value": 1}, headers=_key("r-1"))
    assert again.status_code in (200, 201) and not again.has_header("Idempotent-Replayed") and seen == {"fact:a": 2}


# --- a request slower than the lease ------------------------------------------------------


@pytest.fixture
def clock(monkeypatch):
    """A faked wall clock: ``clock.skip(seconds)`` moves it on; threads see it too."""
    real = timezone.now

    class Clock:
        offset = timedelta(0)

        def skip(self, seconds):
            self.offset += timedelta(seconds=seconds)

    fake = Clock()
    monkeypatch.setattr(timezone, "now", lambda: real() + fake.offset)
    return fake


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_request_slower_than_the_lease_is_not_run_twice(settings, monkeypatch, clock):
    """The first request runs past the lease (the clock skips 301 s while it writes): its
    process keeps renewing the claim, so a retry then waits / gets 409 instead of taking the
    claim over and writing a second time; once the first ends the retry gets its answer."""
    settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS = 0
    monkeypatch.setattr(idempotency, "renew_every", lambda: 0.05)  # the heartbeat, sped up
    tenant = make_tenant("idem-slow")
    client, _ = make_keyed_client(tenant)
    real = services.memory_write
    started, finish = threading.Event(), threading.Event()
    runs = []

    def slow_write(**kwargs):
        runs.append(kwargs["key"])
        if len(runs) == 1:
            started.set()
            finish.wait(30)
        return real(**kwargs)

    monkeypatch.setattr(services, "memory_write", slow_write)
    failures, answers = [], []
    first = start_thread(
        lambda: answers.append(client.post(CALL, _write("fact:slow", 1), headers=_key("s-1"))), failures
    )
    try:
        assert started.wait(20)
        claimed_at = IdempotencyRecord.objects.get(key="s-1").created_at
        clock.skip(settings.ZEROMEM_IDEMPOTENCY_LEASE_SECONDS + 1)
        # Until the running request's process has renewed its claim on the skipped clock (a
        # heartbeat); before the fix nothing renewed it and this gave up after 5 s.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            renewed = IdempotencyRecord.objects.filter(key="s-1").values_list("renewed_at", flat=True).first()
            if renewed is not None and renewed > claimed_at + timedelta(seconds=60):
                break
            time.sleep(0.05)
        retry = client.post(CALL, _write("fact:slow", 1), headers=_key("s-1"))
        assert retry.status_code == 409 and rest_error(retry)["code"] == "idempotency_in_progress"
        assert runs == ["fact:slow"]
    finally:
        finish.set()
        first.join(30)
    assert not failures, failures
    assert answers[0].status_code == 200
    replay = client.post(CALL, _write("fact:slow", 1), headers=_key("s-1"))
    assert replay.get("Idempotent-Replayed") == "true" and runs == ["fact:slow"]
    assert Memory.objects.get(tenant=tenant, key="fact:slow").version == 1


@pytest.mark.django_db(transaction=True)
def test_the_claim_of_a_process_that_died_is_given_up_after_the_lease(settings, clock):
    """A claim nobody renews (its process was killed mid-work): before the lease a retry gets
    409, after it the retry runs the work."""
    settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS = 0
    tenant = make_tenant("idem-killed")
    client, key_row = make_keyed_client(tenant)
    call = _write("fact:x", 1)
    fingerprint = idempotency.fingerprint(method="POST", path=CALL, if_match=None, data=call)
    # The claim a killed process left: taken by its INSERT, never renewed nor completed.
    IdempotencyRecord.objects.create(tenant=tenant, api_key=key_row, key="k-1", fingerprint=fingerprint)
    busy = client.post(CALL, call, headers=_key("k-1"))
    assert busy.status_code == 409
    clock.skip(settings.ZEROMEM_IDEMPOTENCY_LEASE_SECONDS + 1)
    done = client.post(CALL, call, headers=_key("k-1"))
    assert done.status_code == 200 and not done.has_header("Idempotent-Replayed")
    assert Memory.objects.get(tenant=tenant, key="fact:x").version == 1


@pytest.mark.django_db(transaction=True)
def test_a_resumption_whose_process_died_after_a_forget_runs_afresh(settings, fail_once, clock):
    """A forget completes while a partial answer is being resumed, and the resuming process
    dies: the row still holds the partial answer (a read's value the forget erased). After the
    lease the retry must not resume it — that answered the erased value again — but run afresh."""
    tenant = make_tenant("idem-resume-forgotten")
    client, key_row = make_keyed_client(tenant)
    client.call("memory_write", key="user:u1:note", value="CANARY-777", subject="u1")
    fail_once("fact:b", OperationalError("gone"))
    body = {"calls": [{"name": "memory_read", "arguments": {"key": "user:u1:note"}}, _write("fact:b", 2)]}
    first = client.post(BATCH, body, headers=_key("b-8"))
    assert first.json()["results"][0]["value"] == "CANARY-777"
    fingerprint = idempotency.fingerprint(method="POST", path=BATCH, if_match=None, data=body)
    dying = idempotency.claim(tenant=tenant, api_key=key_row, key="b-8", fingerprint=fingerprint)
    assert idempotency.resumption(dying)[1] == [1]
    # The subject's forget completes meanwhile (its value erased, the tenant's answers dropped).
    request = forget.forget_request_create(tenant=tenant, actor=SYSTEM, subject="u1")
    forget.forget_request_execute(request_id=request.pk)
    assert not Memory.objects.filter(tenant=tenant, key="user:u1:note").exists()
    idempotency._drop(dying)  # the process is gone: nothing renews or finishes its claim
    clock.skip(settings.ZEROMEM_IDEMPOTENCY_LEASE_SECONDS + 1)
    again = client.post(BATCH, body, headers=_key("b-8"))
    assert b"CANARY-777" not in again.content
    assert [r["status"] for r in again.json()["results"]] == ["not_found", "ok"]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_an_answer_that_fails_to_be_kept_on_a_bug_does_not_hold_the_key_forever(settings, monkeypatch, clock):
    """Keeping the answer fails on something other than the database (a bug; a master key
    missing from the settings: keyring.MasterKeyError while sealing): the claim was left in
    the process's running claims, which the heartbeat renews for as long as the process lives
    — every retry got 409 idempotency_in_progress, past the lease, forever. Now it is given up
    as on a database failure: the answer is the request's, and a retry runs."""
    settings.ZEROMEM_IDEMPOTENCY_WAIT_SECONDS = 0
    monkeypatch.setattr(idempotency, "renew_every", lambda: 0.05)  # the heartbeat, sped up
    tenant = make_tenant("idem-seal-bug")
    client, _ = make_keyed_client(tenant)
    client.call("memory_write", key="user:u1:phone", value="CANARY-555", subject="u1", sensitive=True)

    def seal_fails(*args):
        raise RuntimeError("a bug while sealing the answer")

    monkeypatch.setattr(idempotency, "_seal", seal_fails)
    read = {"name": "memory_read", "arguments": {"key": "user:u1:phone"}}
    first = client.post(CALL, read, headers=_key("seal-1"))
    assert first.status_code == 200 and first.json()["value"] == "CANARY-555"
    clock.skip(settings.ZEROMEM_IDEMPOTENCY_LEASE_SECONDS + 1)
    time.sleep(0.5)  # a few heartbeat rounds
    retry = client.post(CALL, read, headers=_key("seal-1"))
    assert retry.status_code == 200, retry.content


@pytest.mark.django_db
def test_a_claim_held_past_the_max_hold_is_no_longer_renewed():
    """The heartbeat renewed a claim for as long as its process lived: a request that never
    finished nor gave it up (a bug, a hang) held its key — every retry 409 — for good. Past
    ``MAX_HOLD_SECONDS`` it lets the claim go, which then lapses one lease later."""
    tenant = make_tenant("idem-held")
    _client, key_row = make_keyed_client(tenant)
    claim = idempotency.claim(tenant=tenant, api_key=key_row, key="held-1", fingerprint="f")
    assert isinstance(claim, int)
    try:
        now = time.monotonic()
        assert idempotency.renew_round(now=now) == 1
        assert IdempotencyRecord.objects.get(pk=claim).renewed_at is not None
        IdempotencyRecord.objects.filter(pk=claim).update(renewed_at=None)
        assert idempotency.renew_round(now=now + idempotency.MAX_HOLD_SECONDS + 1) == 0
        assert IdempotencyRecord.objects.get(pk=claim).renewed_at is None
        assert claim not in idempotency._running  # let go: later rounds do not renew it either
    finally:
        idempotency.release(claim)


def test_a_process_forked_while_the_heartbeat_holds_its_lock_can_take_claims():
    """A fork copies the running claims' lock as it was: held by another thread of the parent
    at that moment, the child's first claim waited on it forever."""
    import os

    with idempotency._running_lock:
        pid = os.fork()
        if pid == 0:  # the child: its lock must be free, its claims none
            ok = idempotency._running_lock.acquire(timeout=2) and not idempotency._running
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
