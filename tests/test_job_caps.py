"""One tenant cannot fill the job queue every tenant shares.

django-q2's queue is one FIFO line for all tenants (the ORM broker hands out its oldest
rows). Measured before the caps (tmp script, 2 workers, PostgreSQL): 300 summarize POSTs of
one key, sent in 5.1 s, put another tenant's forget request 10.2 s behind them; one client
enqueues ~60 jobs/s and the workers run ~30/s, so a key at its rate limit (6000/min) grows
the line without bound. So each tenant may have at most ``ZEROMEM_TENANT_MAX_PENDING_JOBS``
summarize jobs and ``ZEROMEM_TENANT_MAX_PENDING_FORGETS`` forget requests pending (queued or
running) at once; past it the caller gets ``429 too_many_jobs`` naming the limit, nothing is
stored, and another tenant is not affected.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from django_q.conf import Conf

from memories import services
from memories.models import ForgetRequest, Job
from memories.services import summaries
from memories.services.api_keys import key_actor
from tests.factories import SYSTEM, make_key, make_staff, make_tenant, write
from tests.helpers import rest_error, tool_error
from zeromem.kernel.actors import Actor, staff_actor
from zeromem.kernel.errors import TenantBusy


def _summarize(api, prefix):
    return api.post("/api/v1/summaries", {"prefix": prefix})


def _forget(api, subject):
    return api.post("/api/v1/forget-requests", {"subject": subject})


# --- summarize jobs -----------------------------------------------------------------------


def test_summarize_past_the_tenants_pending_jobs_is_429_naming_the_limit(api, api_b, settings):
    settings.ZEROMEM_TENANT_MAX_PENDING_JOBS = 3
    # Not run (the test's transaction never commits, so nothing is enqueued): they stay queued.
    for n in range(3):
        assert _summarize(api, f"session:s{n}:").status_code == 202
    r = _summarize(api, "session:s3:")
    assert r.status_code == 429, r.content
    assert int(r["Retry-After"]) >= 1
    error = rest_error(r)
    assert error["code"] == "too_many_jobs"
    assert "3" in error["message"] and "ZEROMEM_TENANT_MAX_PENDING_JOBS" in error["message"]
    assert Job.objects.filter(tenant=api.tenant).count() == 3  # nothing stored
    status, body = api.call("memory_summarize", prefix="session:s4:")
    assert tool_error(body)["code"] == "too_many_jobs"
    # Another tenant's own limit is untouched.
    assert _summarize(api_b, "session:b0:").status_code == 202


def test_a_finished_job_makes_room_again(api, settings):
    settings.ZEROMEM_TENANT_MAX_PENDING_JOBS = 2
    # The API shows a job's uid; the worker takes its row id.
    uids = [_summarize(api, f"session:s{n}:").json()["job_id"] for n in range(2)]
    ids = [Job.objects.get(uid=uid).pk for uid in uids]
    assert _summarize(api, "session:s2:").status_code == 429
    summaries.summarize_run(job_id=ids[0])  # the worker runs one (an empty namespace: succeeded)
    assert Job.objects.get(pk=ids[0]).status == "succeeded"
    assert _summarize(api, "session:s2:").status_code == 202


def test_idle_sessions_take_at_most_the_cap_per_tenant_so_one_tenant_cannot_hold_the_batch(
    tenant_a, tenant_b, settings, monkeypatch
):
    """Longest idle first across tenants: tenant A's thousands of old sessions took the whole
    batch on every run, and tenant B's sessions waited for hours."""
    settings.ZEROMEM_TENANT_MAX_PENDING_JOBS = 2
    monkeypatch.setattr(summaries, "IDLE_BATCH", 3)
    long_ago = timezone.now() - timedelta(hours=5)
    for n in range(5):
        write(tenant_a, f"session:a{n}:k", "v")
    write(tenant_b, "session:b0:k", "v")
    from memories.models import Memory

    Memory.objects.filter(tenant=tenant_a).update(updated_at=long_ago)  # A idle longest
    Memory.objects.filter(tenant=tenant_b).update(updated_at=long_ago + timedelta(hours=1))

    assert services.summarize_idle_sessions() == 3
    assert Job.objects.filter(tenant=tenant_a).count() == 2
    assert list(Job.objects.filter(tenant=tenant_b).values_list("params__prefix", flat=True)) == ["session:b0:"]
    # The next run finds A at its cap still (nothing ran): nothing more for A, no refusal raised.
    assert services.summarize_idle_sessions() == 0


# --- forget requests ----------------------------------------------------------------------


def test_forget_requests_past_the_tenants_pending_requests_are_429_naming_the_limit(api, api_b, settings):
    settings.ZEROMEM_TENANT_MAX_PENDING_FORGETS = 3
    for n in range(3):
        assert _forget(api, f"u{n}").status_code == 202
    r = _forget(api, "u3")
    assert r.status_code == 429, r.content
    assert int(r["Retry-After"]) >= 1
    error = rest_error(r)
    assert error["code"] == "too_many_jobs"
    assert "3" in error["message"] and "ZEROMEM_TENANT_MAX_PENDING_FORGETS" in error["message"]
    assert ForgetRequest.objects.filter(tenant=api.tenant).count() == 3
    assert _forget(api_b, "u0").status_code == 202


def test_a_completed_forget_request_makes_room_again(api, settings):
    settings.ZEROMEM_TENANT_MAX_PENDING_FORGETS = 1
    first = ForgetRequest.objects.get(uid=_forget(api, "u0").json()["id"]).pk
    assert _forget(api, "u1").status_code == 429
    services.forget_request_execute(request_id=first)
    assert ForgetRequest.objects.get(pk=first).status == "completed"
    assert _forget(api, "u1").status_code == 202


def test_one_end_user_cannot_fill_the_tenants_forget_cap_for_everyone_else(api, tenant_a, settings):
    # The tenant's cap alone let one end user file a request per memory they own (the portal's
    # "forget this one") until every other end user and the app's keys got 429.
    from memories.services import subjects

    settings.ZEROMEM_TENANT_MAX_PENDING_FORGETS = 5
    settings.ZEROMEM_END_USER_MAX_PENDING_FORGETS = 2
    for n in range(4):
        write(tenant_a, f"user:u1:k{n}", f"v{n}")
    write(tenant_a, "user:u2:k0", "v")
    u1 = Actor(kind="end_user", id="u1", scopes=frozenset({"memory:read", "forget:create"}))
    u2 = Actor(kind="end_user", id="u2", scopes=frozenset({"memory:read", "forget:create"}))
    for n in range(2):
        subjects.subject_forget(tenant=tenant_a, actor=u1, subject="u1", key=f"user:u1:k{n}")
    with pytest.raises(TenantBusy) as refused:
        subjects.subject_forget(tenant=tenant_a, actor=u1, subject="u1", key="user:u1:k2")
    assert refused.value.code == "too_many_jobs"
    assert "ZEROMEM_END_USER_MAX_PENDING_FORGETS" in refused.value.message
    assert ForgetRequest.objects.filter(tenant=tenant_a).count() == 2
    # Another end user and the app's keys still file theirs.
    subjects.subject_forget(tenant=tenant_a, actor=u2, subject="u2", key="user:u2:k0")
    assert _forget(api, "u9").status_code == 202
    assert ForgetRequest.objects.filter(tenant=tenant_a).count() == 4


def test_staff_and_the_system_are_not_capped(tenant_a, settings):
    """The console and the schedules are not driven at API rate; a tenant over its cap must
    still be able to have support file a forget request."""
    settings.ZEROMEM_TENANT_MAX_PENDING_FORGETS = 1
    services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u0")
    services.forget_request_create(tenant=tenant_a, actor=Actor.system(job="test"), subject="u1")
    staff = staff_actor(user=make_staff(tenant_a, "support"), role="support")
    services.forget_request_create(tenant=tenant_a, actor=staff, subject="u2")
    assert ForgetRequest.objects.filter(tenant=tenant_a, status="received").count() == 3


# --- exact under concurrency ----------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["summarize", "forget"])
def test_the_cap_is_exact_when_a_tenants_requests_race(kind, monkeypatch, settings):
    """Eight starts at once with room for three: three are accepted, not eight (each one
    counting the others' uncommitted rows as absent)."""
    monkeypatch.setattr(Conf, "SYNC", False)  # enqueued for real (ORM broker), not run
    settings.ZEROMEM_TENANT_MAX_PENDING_JOBS = 3
    settings.ZEROMEM_TENANT_MAX_PENDING_FORGETS = 3
    tenant = make_tenant("race")
    key, _raw = make_key(tenant)
    actor = key_actor(key, surface="rest")
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def start(n):
        try:
            barrier.wait(timeout=10)
            if kind == "summarize":
                services.summarize_start(tenant=tenant, actor=actor, prefix=f"session:r{n}:")
            else:
                services.forget_request_create(tenant=tenant, actor=actor, subject=f"u{n}")
            outcomes.append("ok")
        except TenantBusy as exc:
            outcomes.append(exc.code)
        finally:
            connection.close()

    threads = [threading.Thread(target=start, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(outcomes) == ["ok"] * 3 + ["too_many_jobs"] * 5
    model = Job if kind == "summarize" else ForgetRequest
    assert model.objects.filter(tenant=tenant).count() == 3


@pytest.mark.postgres
def test_a_tenant_with_a_64_bit_id_can_start_jobs_and_seal_its_log(make_client):
    # Ids are BigAutoField: the cap's and the sealer's advisory locks passed the tenant id as
    # the second int of pg_advisory_xact_lock(int, int) — past 2^31-1 the statement failed
    # (no pg_advisory_xact_lock(integer, bigint)) and every summarize start of that tenant
    # answered 500, and its log could not be sealed.
    if connection.vendor != "postgresql":
        pytest.skip("advisory locks are PostgreSQL's")
    from audit.services import audit_seal
    from memories.models import Tenant

    big = Tenant.objects.create(pk=2**40 + 7, slug="big-id", name="Big id")
    client, _key = make_client(big)
    write(big, "session:s1:a", "hello")
    r = _summarize(client, "session:s1:")
    assert r.status_code == 202, r.content
    assert Job.objects.filter(tenant=big).count() == 1
    assert audit_seal(tenant_id=big.pk) >= 1
