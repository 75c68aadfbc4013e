"""The audit chain: every single edit, deletion, insertion or reordering of an event is
detected and named; a cut-off tail is detected against a kept checkpoint; the database
refuses changes on PostgreSQL; redaction and the retention purge keep the chain valid.

Tampering is done with raw SQL, as an attacker with database access would (on PostgreSQL
with triggers switched off, as a superuser can)."""

import io
import json
import random
import threading
import time
from datetime import timedelta

import pytest
from django.apps import apps as django_apps
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from audit import chain
from audit.models import AuditCheckpoint, AuditEvent, AuditSeal
from audit.seals import seal_numbers, unsealed_q
from audit.selectors import AuditFilters
from audit.services import (
    audit_checkpoint_create,
    audit_event_list,
    audit_export_start,
    audit_list_record,
    audit_purge,
    audit_record,
    audit_redact_subject,
    audit_seal,
    event_fields,
)
from audit.verify import RangedEvents, audit_verify
from memories import services
from tests.factories import SYSTEM, make_tenant
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import NotFound

TABLE = AuditEvent._meta.db_table
SEALS = AuditSeal._meta.db_table

AGENT = Actor(
    kind="api_key",
    id="7",
    label="zm_agent",
    scopes=frozenset(["memory:read", "memory:write"]),
    surface="tool",
    request_id="req-1",
    client_ip="203.0.113.9",
)


def raw(sql, params=()):
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # An attacker with superuser rights switches the append-only triggers off.
            cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute(sql, params)


def activity(tenant, n=12, user="u1"):
    for i in range(n):
        services.memory_write(tenant=tenant, actor=AGENT, key=f"user:{user}:k{i}", value=f"v{i}")
    services.memory_read(tenant=tenant, actor=AGENT, key=f"user:{user}:k0")
    with pytest.raises(NotFound):
        services.memory_read(tenant=tenant, actor=AGENT, key=f"user:{user}:missing")


def sealed_ids(tenant):
    """The ids of the tenant's events a seal holds (range seals: nothing marks the events)."""
    unsealed = unsealed_q(tenant.pk)
    return list(AuditEvent.objects.filter(tenant=tenant).exclude(unsealed).order_by("id").values_list("id", flat=True))


def first_id_of(tenant, seq):
    return AuditSeal.objects.get(tenant=tenant, seq=seq).first_event_id


def first_problem(tenant, **kwargs):
    result = audit_verify(tenant_id=tenant.pk, **kwargs)
    assert not result.ok, "tampering went undetected"
    return result.first_problem


@pytest.fixture
def chained(tenant_a, tenant_b):
    """Tenant A with 15 events in seals of 4 (the last 3 in seal 4), tenant B with its own."""
    activity(tenant_a)
    activity(tenant_b, n=3)
    audit_seal(tenant_id=tenant_a.pk, batch_size=4)
    audit_seal(tenant_id=tenant_b.pk, batch_size=4)
    return tenant_a


def test_sealed_chains_verify_per_tenant(chained, tenant_b):
    result = audit_verify(tenant_id=chained.pk)
    assert result.ok, result.problems
    assert (result.events, result.seals, result.unsealed) == (15, 4, 0)
    assert audit_verify(tenant_id=tenant_b.pk).ok
    seals = list(AuditSeal.objects.filter(tenant=chained).order_by("seq"))
    assert [s.count for s in seals] == [4, 4, 4, 3] and seals[-1].total == 15
    assert [s.prev_hash for s in seals[1:]] == [s.hash for s in seals[:-1]]
    assert seals[0].prev_hash == chain.genesis(chained.pk)


def test_recording_an_event_needs_no_chain_lock_and_later_events_go_to_the_next_seal(chained):
    services.memory_read(tenant=chained, actor=AGENT, key="user:u1:k1")
    assert AuditEvent.objects.filter(unsealed_q(chained.pk)).count() == 1
    assert audit_verify(tenant_id=chained.pk).unsealed == 1
    audit_seal(tenant_id=chained.pk)
    assert AuditSeal.objects.filter(tenant=chained).order_by("-seq").first().count == 1
    assert audit_verify(tenant_id=chained.pk).ok


def _slow_request(tenant, started, release):
    """A request whose transaction holds an event (a lower id) uncommitted until released."""
    with transaction.atomic():
        audit_record(tenant=tenant, actor=AGENT, action="memory.read", outcome="ok", target="user:u1:slow")
        started.set()
        release.wait(10)
    connection.close()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_sealing_never_passes_an_event_that_may_still_commit(settings):
    # Recording takes no chain lock, so a slow transaction can commit its event after events
    # with higher ids committed. A range seal would never see it: the sealing job seals only
    # below a horizon that every open writer has passed, so nothing is sealed meanwhile.
    settings.ZEROMEM_AUDIT_SEAL_WAIT = 0.3
    tenant = make_tenant("latecomer")
    started, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=_slow_request, args=(tenant, started, release))
    thread.start()
    assert started.wait(10)
    for i in range(3):
        audit_record(tenant=tenant, actor=AGENT, action="memory.read", outcome="ok", target=f"user:u1:fast{i}")
    assert audit_seal(tenant_id=tenant.pk) == 0  # the slow one is still open: no seal yet
    assert not AuditSeal.objects.filter(tenant=tenant).exists()
    release.set()
    thread.join(10)
    assert audit_seal(tenant_id=tenant.pk) == 5  # with tenant.create, in id order

    slow = AuditEvent.objects.get(target="user:u1:slow")
    fast = AuditEvent.objects.filter(target__startswith="user:u1:fast").order_by("id")
    assert slow.pk < fast[0].pk
    assert seal_numbers(tenant.pk, [slow.pk, fast[0].pk]) == {slow.pk: 1, fast[0].pk: 1}
    assert audit_verify(tenant_id=tenant.pk).ok


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_every_event_lands_in_exactly_one_seal_while_writers_commit_out_of_id_order():
    # Writers hold their events uncommitted for random times (commits out of id order) while
    # the sealing job runs again and again: at the end every event is in exactly one seal.
    tenant = make_tenant("racing")
    stop = threading.Event()
    written = []

    def writer(n):
        rng = random.Random(n)
        try:
            for i in range(15):
                with transaction.atomic():
                    for j in range(rng.randint(1, 2)):
                        target = f"user:u{n}:k{i}.{j}"
                        written.append(
                            audit_record(tenant=tenant, actor=AGENT, action="memory.read", outcome="ok", target=target)
                        )
                        time.sleep(rng.random() * 0.02)
        finally:
            connection.close()

    writers = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for w in writers:
        w.start()
    sealed = 0
    while any(w.is_alive() for w in writers):
        sealed += audit_seal(tenant_id=tenant.pk, batch_size=7)
    for w in writers:
        w.join(10)
    sealed += audit_seal(tenant_id=tenant.pk, batch_size=7)
    stop.set()
    result = audit_verify(tenant_id=tenant.pk)
    assert result.ok, result.problems
    total = AuditEvent.objects.filter(tenant=tenant).count()
    assert sealed == total == len(written) + 1 and result.unsealed == 0  # with tenant.create
    assert sum(AuditSeal.objects.filter(tenant=tenant).values_list("count", flat=True)) == total
    assert len(seal_numbers(tenant.pk, written)) == len(written)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_sealing_waits_for_an_open_writer_and_not_for_an_idle_reader():
    tenant = make_tenant("waiter")
    for i in range(2):
        audit_record(tenant=tenant, actor=AGENT, action="memory.read", outcome="ok", target=f"user:u1:k{i}")
    reader_in, reader_out = threading.Event(), threading.Event()

    def idle_reader():  # a transaction that has read and written nothing holds no event id
        with transaction.atomic():
            AuditEvent.objects.filter(tenant=tenant).count()
            reader_in.set()
            reader_out.wait(10)
        connection.close()

    reader = threading.Thread(target=idle_reader)
    reader.start()
    assert reader_in.wait(10)
    started, release = threading.Event(), threading.Event()
    writer = threading.Thread(target=_slow_request, args=(tenant, started, release))
    writer.start()
    assert started.wait(10)
    threading.Timer(0.3, release.set).start()  # the writer commits while the sealer waits
    try:
        assert audit_seal(tenant_id=tenant.pk) == 4  # tenant.create, two reads, the slow one
    finally:
        release.set()
        reader_out.set()
        writer.join(10)
        reader.join(10)
    assert audit_verify(tenant_id=tenant.pk).ok


def test_editing_any_field_of_a_sealed_event_names_that_event(chained):
    victim = sealed_ids(chained)[5]
    edits = [("target", "user:u9:other"), ("outcome", "denied"), ("occurred_at", timezone.now())]
    edits.append(("actor_filter", "u9"))  # a committed field left out of the digest while empty
    for column, value in edits:
        with transaction.atomic():
            raw(f"UPDATE {TABLE} SET {column} = %s WHERE id = %s", [value, victim])
            problem = first_problem(chained)
            assert (problem.event_id, problem.seal) == (victim, 2), column
            assert "digest" in problem.message
            transaction.set_rollback(True)


def test_editing_an_unsealed_event_is_detected_too(chained):
    services.memory_read(tenant=chained, actor=AGENT, key="user:u1:k1")
    victim = AuditEvent.objects.filter(unsealed_q(chained.pk)).get().pk
    raw(f"UPDATE {TABLE} SET actor_label = 'someone else' WHERE id = %s", [victim])
    assert first_problem(chained).event_id == victim


def test_deleting_an_event_names_its_seal(chained):
    ids = sealed_ids(chained)
    raw(f"DELETE FROM {TABLE} WHERE id = %s", [ids[5]])  # in seal 2
    problem = first_problem(chained)
    assert problem.seal == 2 and "holds 3 events, the seal says 4" in problem.message


def test_deleting_the_last_event_of_a_seal_names_it(chained):
    ids = sealed_ids(chained)
    raw(f"DELETE FROM {TABLE} WHERE id = %s", [ids[7]])  # the last of seal 2
    problem = first_problem(chained)
    assert (problem.event_id, problem.seal) == (ids[7], 2)


FORGED = f"""INSERT INTO {TABLE} (id, uid, tenant_id, occurred_at, actor_kind, actor_id, actor_label, surface,
        action, target, subject, outcome, request_id, count, version, detail, digest, seal, chain, redacted)
    VALUES (%s, %s, %s, %s, 'staff', '1', 'mallory', 'admin', 'memory.read', 'user:u1:k1', 'u1', 'ok',
            '', NULL, NULL, '{{}}', %s, %s, %s, '{{}}')"""


@pytest.mark.parametrize("seal", [2, None], ids=["claiming a seal number", "into the unsealed tail"])
def test_inserting_a_forged_event_names_it(chained, seal):
    forged_id = sealed_ids(chained)[-1] + 1000
    uid = "6f1c2a1e-0000-4000-8000-000000000001"
    raw(FORGED, [forged_id, uid, chained.pk, timezone.now(), "0" * 64, seal, "0" * 64 if seal else ""])
    assert first_problem(chained).event_id == forged_id


def test_inserting_a_copy_of_a_genuine_event_is_detected(chained):
    ids = sealed_ids(chained)
    columns = "uid, tenant_id, occurred_at, actor_kind, actor_id, actor_label, surface, action, target, subject, "
    columns += "outcome, request_id, client_ip, count, version, detail, digest, redacted"
    raw(f"INSERT INTO {TABLE} ({columns}, chain) SELECT {columns}, '' FROM {TABLE} WHERE id = %s", [ids[3]])
    problem = first_problem(chained)
    assert "copy" in problem.message and problem.event_id > ids[-1]


def test_reordering_two_events_names_their_seal(chained):
    ids = sealed_ids(chained)
    a, b = ids[4], ids[5]
    raw(f"UPDATE {TABLE} SET id = -1 WHERE id = %s", [a])
    raw(f"UPDATE {TABLE} SET id = %s WHERE id = %s", [a, b])
    raw(f"UPDATE {TABLE} SET id = %s WHERE id = -1", [b])
    problem = first_problem(chained)
    assert problem.seal == 2 and "reordered" in problem.message


def test_a_forged_event_between_two_seals_ranges_is_named(chained, tenant_b):
    # tenant B's events lie between tenant A's seal 4 and the next: forge one of A's there.
    gap = AuditEvent.objects.filter(tenant=tenant_b).order_by("-id").values_list("id", flat=True).first()
    services.memory_read(tenant=chained, actor=AGENT, key="user:u1:k1")
    audit_seal(tenant_id=chained.pk)  # seal 5 starts after tenant B's ids
    # A genuine event of A copied under that free id: its digest verifies (ids are not in it).
    columns = "uid, tenant_id, occurred_at, actor_kind, actor_id, actor_label, surface, action, target, subject, "
    columns += "outcome, request_id, client_ip, count, version, detail, digest, redacted, chain"
    raw(f"DELETE FROM {TABLE} WHERE id = %s", [gap])
    raw(
        f"INSERT INTO {TABLE} (id, {columns}) SELECT %s, {columns} FROM {TABLE} WHERE id = %s",
        [gap, sealed_ids(chained)[3]],
    )
    problem = first_problem(chained)
    assert problem.event_id == gap and "outside every seal" in problem.message


def test_verify_reads_range_seals_events_in_pages(chained, monkeypatch):
    monkeypatch.setattr(RangedEvents, "PAGE", 2)  # pages end inside and between seals
    result = audit_verify(tenant_id=chained.pk)
    assert result.ok and (result.events, result.seals) == (15, 4)
    raw(f"DELETE FROM {TABLE} WHERE id = %s", [sealed_ids(chained)[9]])  # in seal 3
    assert first_problem(chained).seal == 3


def test_editing_a_seal_is_detected(chained):
    raw(f"UPDATE {SEALS} SET count = 3 WHERE tenant_id = %s AND seq = 2", [chained.pk])
    assert first_problem(chained).seal == 2


def test_cutting_off_the_tail_is_detected_against_a_kept_checkpoint(chained):
    kept = services_checkpoint(chained)
    raw(f"DELETE FROM {TABLE} WHERE tenant_id = %s AND id >= %s", [chained.pk, first_id_of(chained, 4)])
    raw(f"DELETE FROM {SEALS} WHERE tenant_id = %s AND seq >= 4", [chained.pk])
    assert audit_verify(tenant_id=chained.pk).ok  # a clean cut looks like a shorter chain...
    problem = first_problem(chained, checkpoint=kept)  # ...until compared with what was kept
    assert "cut off" in problem.message


def test_faking_a_purge_to_excuse_deleted_events_is_detected(chained):
    seal = AuditSeal.objects.get(tenant=chained, seq=2)
    raw(f"DELETE FROM {TABLE} WHERE id BETWEEN %s AND %s", [seal.first_event_id, seal.last_event_id])
    raw(f"UPDATE {SEALS} SET purged_at = %s WHERE tenant_id = %s AND seq = 2", [timezone.now(), chained.pk])
    assert "no purge checkpoint" in first_problem(chained).message
    raw(
        f"""INSERT INTO {AuditCheckpoint._meta.db_table} (tenant_id, seal_seq, head_hash, total, created_at,
                reason, purged_through, mac) VALUES (%s, 4, 'x', 15, %s, 'purge', 2, %s)""",
        [chained.pk, timezone.now(), "0" * 64],
    )
    assert "forged" in str(audit_verify(tenant_id=chained.pk).problems)


def services_checkpoint(tenant):
    return audit_checkpoint_create(tenant=tenant, actor=SYSTEM).as_dict()


# --- the commands ------------------------------------------------------------------------


def test_audit_verify_command_exits_nonzero_naming_the_first_bad_event(chained):
    out = io.StringIO()
    call_command("audit_verify", "--tenant", chained.slug, stdout=out)
    assert "ok" in out.getvalue() and "events/s" in out.getvalue()
    victim = sealed_ids(chained)[2]
    raw(f"UPDATE {TABLE} SET subject = 'u2' WHERE id = %s", [victim])
    err = io.StringIO()
    with pytest.raises(CommandError) as failed:
        call_command("audit_verify", "--tenant", chained.slug, stdout=io.StringIO(), stderr=err)
    assert failed.value.returncode == 1
    assert f"event {victim}:" in err.getvalue()


@pytest.mark.parametrize("args", [["--tenant", "-"], ["--out", "/nonexistent-dir/checkpoint.json"], ["--out", "/"]])
def test_checkpoint_command_with_a_bad_argument_is_a_command_error_recording_no_checkpoint(chained, args):
    # Before: an IndexError for the tenant-less chain; an OSError after the checkpoints were
    # recorded (audited) for a file that cannot be written.
    with pytest.raises(CommandError, match=args[0]):
        call_command("audit_checkpoint", *args, stdout=io.StringIO(), stderr=io.StringIO())
    assert not AuditEvent.objects.filter(action="audit.checkpoint").exists()
    assert not AuditCheckpoint.objects.exists()


def test_checkpoint_command_output_detects_a_cut_tail(chained, tmp_path):
    path = tmp_path / "checkpoint.json"
    call_command("audit_checkpoint", "--tenant", chained.slug, "--out", str(path), stderr=io.StringIO())
    kept = json.loads(path.read_text())
    assert kept["tenant"] == chained.slug and kept["events"] == 15 and kept["seal"] == 4
    assert AuditEvent.objects.filter(tenant=chained, action="audit.checkpoint").count() == 1
    call_command("audit_verify", "--tenant", chained.slug, "--checkpoint", str(path), stdout=io.StringIO())
    raw(f"DELETE FROM {TABLE} WHERE tenant_id = %s AND id >= %s", [chained.pk, first_id_of(chained, 3)])
    raw(f"DELETE FROM {SEALS} WHERE tenant_id = %s AND seq >= 3", [chained.pk])
    with pytest.raises(CommandError):
        call_command(
            "audit_verify",
            "--tenant",
            chained.slug,
            "--checkpoint",
            str(path),
            stdout=io.StringIO(),
            stderr=io.StringIO(),
        )


# --- append-only ------------------------------------------------------------------------


def test_the_models_refuse_updates_and_deletes(chained):
    event = AuditEvent.objects.filter(tenant=chained).first()
    with pytest.raises(TypeError):
        AuditEvent.objects.filter(pk=event.pk).update(target="x")
    with pytest.raises(TypeError):
        AuditEvent.objects.filter(pk=event.pk).delete()
    with pytest.raises(TypeError):
        event.save()
    with pytest.raises(TypeError):
        AuditSeal.objects.filter(tenant=chained).delete()


@pytest.mark.postgres
@pytest.mark.parametrize(
    "sql",
    [
        f"UPDATE {TABLE} SET target = 'x' WHERE tenant_id = %s",
        f"UPDATE {TABLE} SET seal = NULL, chain = '' WHERE tenant_id = %s",
        f"DELETE FROM {TABLE} WHERE tenant_id = %s",
        f"UPDATE {SEALS} SET hash = 'x' WHERE tenant_id = %s",
        f"DELETE FROM {SEALS} WHERE tenant_id = %s",
    ],
)
def test_postgresql_refuses_changes_outside_the_maintenance_paths(chained, sql):
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, [chained.pk])


@pytest.mark.postgres
@pytest.mark.parametrize("table", [TABLE, SEALS, "audit_auditcheckpoint"])
def test_postgresql_refuses_truncate_of_the_audit_tables(chained, table):
    before = AuditEvent.objects.count()
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL zeromem.audit_mode = ''")  # the suite's own flush sets 'flush'
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # no pending FK checks from the inserts
        cursor.execute(f"TRUNCATE {table} CASCADE")
    assert AuditEvent.objects.count() == before


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("mode", "change"),
    [
        ("redact", "outcome = 'denied'"),  # it changes only identifying fields
        # The seal mode writes an event's seal and chain value, nothing else: not the actor a
        # reading of the log filtered by either (audit migration 0014's column, audit/0015).
        ("seal", "seal = 1, actor_filter = 'u1'"),
    ],
)
def test_postgresql_lets_a_maintenance_mode_change_only_its_own_fields(chained, mode, change):
    victim = sealed_ids(chained)[0]
    before = AuditEvent.objects.filter(pk=victim).values().get()
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('zeromem.audit_mode', %s, true)", [mode])
        cursor.execute(f"UPDATE {TABLE} SET {change} WHERE id = %s", [victim])
    assert AuditEvent.objects.filter(pk=victim).values().get() == before


# --- redaction ----------------------------------------------------------------------------

# End user u1 reading in the portal, from an address redaction must clear.
END_USER_U1 = Actor(
    kind="end_user",
    id="u1",
    label="end user",
    scopes=frozenset(["memory:read"]),
    surface="portal",
    client_ip="198.51.100.7",
)


def test_redacting_a_subject_replaces_its_identifiers_and_the_chain_still_verifies(chained, tenant_b):
    activity(chained, n=2, user="u2")
    end_user = END_USER_U1
    services.memory_read(tenant=chained, actor=end_user, key="user:u1:k1")
    before_u2 = list(AuditEvent.objects.filter(tenant=chained, subject="u2").values_list("target", flat=True))

    changed = audit_redact_subject(tenant=chained, subject="u1")

    assert changed >= 15
    assert not AuditEvent.objects.filter(tenant=chained, target__contains="u1").exists()
    assert not AuditEvent.objects.filter(tenant=chained, subject="u1").exists()
    own = AuditEvent.objects.get(tenant=chained, actor_kind="end_user")
    assert own.actor_id.startswith("redacted:") and own.client_ip is None
    redacted = AuditEvent.objects.filter(tenant=chained, target__startswith="redacted:").first()
    assert set(redacted.redacted) >= {"target", "subject"}
    # The same subject gets the same pseudonym: a reviewer can still group its events.
    assert AuditEvent.objects.filter(tenant=chained, subject=redacted.subject).count() >= 13
    assert list(AuditEvent.objects.filter(tenant=chained, subject="u2").values_list("target", flat=True)) == before_u2
    assert AuditEvent.objects.filter(tenant=tenant_b, subject="u1").exists()  # another tenant's subject u1
    audit_seal(tenant_id=chained.pk)
    assert audit_verify(tenant_id=chained.pk).ok
    assert audit_redact_subject(tenant=chained, subject="u1") == 0  # idempotent


def test_a_reviewers_actor_filter_naming_a_forgotten_end_user_is_redacted(chained):
    """Reading the log with actor=<end user> (REST list, export, the admin's list) records
    the filter; once that end user is forgotten no audit row holds their id."""
    services.memory_read(tenant=chained, actor=END_USER_U1, key="user:u1:k1")
    reviewer = Actor(
        kind="api_key", id="9", label="zm_review", scopes=frozenset(["audit:read", "forget:create"]), surface="rest"
    )
    audit_event_list(tenant=chained, actor=reviewer, filters=AuditFilters(actor="u1"))
    audit_export_start(tenant=chained, actor=reviewer, filters=AuditFilters(actor="u1", action="memory."), fmt="csv")
    audit_list_record(tenant=chained, actor=reviewer, filters={"actor": "u1"}, count=3)
    audit_event_list(tenant=chained, actor=reviewer, filters=AuditFilters(actor="zm_agent"))  # names no end user
    reads = AuditEvent.objects.filter(tenant=chained, action__in=["audit.list", "audit.export"])
    assert reads.filter(actor_filter="u1").count() == 3  # what the reviewer filtered by, until the forget

    request = services.forget_request_create(tenant=chained, actor=reviewer, subject="u1")
    services.forget_request_execute(request_id=request.pk)

    def holds_u1(row):
        return any("u1" in json.dumps(v, default=str) for v in row.values())

    rows = list(AuditEvent.objects.filter(tenant=chained).values())
    assert [row["id"] for row in rows if holds_u1(row)] == []
    assert reads.filter(actor_filter="zm_agent").count() == 1  # another actor's filter stays readable
    assert reads.filter(actor_filter__startswith="redacted:").count() == 3
    audit_seal(tenant_id=chained.pk)
    assert audit_verify(tenant_id=chained.pk).ok


def test_clearing_a_readings_actor_filter_is_detected(chained):
    reviewer = Actor(kind="api_key", id="9", label="zm_review", scopes=frozenset(["audit:read"]), surface="rest")
    audit_event_list(tenant=chained, actor=reviewer, filters=AuditFilters(actor="u1"))
    audit_seal(tenant_id=chained.pk)
    victim = AuditEvent.objects.get(tenant=chained, actor_filter="u1").pk
    raw(f"UPDATE {TABLE} SET actor_filter = '' WHERE id = %s", [victim])
    assert first_problem(chained).event_id == victim


def test_a_redacted_field_edited_afterwards_is_still_detected(chained):
    audit_redact_subject(tenant=chained, subject="u1")
    sealed = sealed_ids(chained)
    victim = AuditEvent.objects.filter(tenant=chained, target__startswith="redacted:", pk__in=sealed).first()
    raw(f"UPDATE {TABLE} SET redacted = %s WHERE id = %s", [json.dumps({"target": "0" * 64}), victim.pk])
    assert first_problem(chained).event_id == victim.pk


# --- retention purge ---------------------------------------------------------------------


def test_purge_removes_old_sealed_batches_after_a_checkpoint_and_the_rest_verifies(chained):
    now = timezone.now()
    ids = sealed_ids(chained)
    old = now - timedelta(days=500)
    raw(f"UPDATE {TABLE} SET occurred_at = %s WHERE id <= %s", [old, ids[9]])  # seals 1, 2 and half of 3
    # Those rows were edited (back-dated) for the test: give them valid digests again.
    _refresh_digests(chained, ids[:10])

    result = audit_purge(tenant=chained, now=now)

    assert result == {"events": 8, "seals": 2, "through": 2}  # seal 3 has a recent event: kept whole
    assert AuditEvent.objects.filter(tenant=chained, pk__lt=first_id_of(chained, 3)).count() == 0
    checkpoint = AuditCheckpoint.objects.get(tenant=chained, reason="purge")
    assert checkpoint.purged_through == 2
    event = AuditEvent.objects.get(tenant=chained, action="audit.purge")
    assert event.count == 8 and event.actor_kind == "system" and checkpoint.created_at <= event.occurred_at
    verified = audit_verify(tenant_id=chained.pk)
    assert verified.ok, verified.problems
    assert verified.purged_seals == 2
    assert audit_purge(tenant=chained, now=now)["events"] == 0  # nothing more is old enough


def test_purge_keeps_everything_inside_the_retention_period(chained):
    chained.audit_retention_days = 1
    chained.save()
    assert audit_purge(tenant=chained)["events"] == 0
    assert audit_purge(tenant=chained, now=timezone.now() + timedelta(days=2))["events"] == 15


def _refresh_digests(tenant, ids):
    """Re-seal from scratch after a test back-dated events (test set-up, not tampering)."""
    raw(f"DELETE FROM {SEALS} WHERE tenant_id = %s", [tenant.pk])
    raw(f"UPDATE {TABLE} SET seal = NULL, chain = '' WHERE tenant_id = %s", [tenant.pk])
    for row in AuditEvent.objects.filter(pk__in=ids).values("id", *chain.DIGEST_FIELDS):
        raw(f"UPDATE {TABLE} SET digest = %s WHERE id = %s", [chain.digest(event_fields(row)), row["id"]])
    audit_seal(tenant_id=tenant.pk, batch_size=4)


# --- seals made before range seals (audit migration 0011) ---------------------------------


def _seal_the_old_way(tenant, events):
    """A seal as the job made them before audit migration 0011: each event's seal number and
    chain value written into its row (in the ``seal`` maintenance mode), ``by_range`` false."""
    head = AuditSeal.objects.filter(tenant=tenant).order_by("-seq").first()
    seq, prev_hash = (head.seq + 1, head.hash) if head else (1, chain.genesis(tenant.pk))
    value = prev_hash
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT set_config('zeromem.audit_mode', 'seal', true)")
        for event in sorted(events, key=lambda e: e.pk):
            value = chain.link(value, event.pk, event.digest)
            cursor.execute(f"UPDATE {TABLE} SET seal = %s, chain = %s WHERE id = %s", [seq, value, event.pk])
        total = (head.total if head else 0) + len(events)
        first, last = min(e.pk for e in events), max(e.pk for e in events)
        AuditSeal.objects.create(
            tenant=tenant,
            seq=seq,
            first_event_id=first,
            last_event_id=last,
            count=len(events),
            total=total,
            prev_hash=prev_hash,
            hash=chain.seal_hash(
                prev_hash=prev_hash,
                tenant_id=tenant.pk,
                seq=seq,
                first=first,
                last=last,
                count=len(events),
                total=total,
                last_chain=value,
            ),
        )


@pytest.fixture
def upgraded(tenant_a):
    """Tenant A's log across the upgrade: seal 1 made the old way (tenant.create and reads 1,
    2 and 4 — read 3 committed late, after read 4 was sealed), then reads 5 and 6; the range
    seal that follows holds read 3 (below seal 1's last id), 5 and 6."""
    ids = [
        audit_record(tenant=tenant_a, actor=AGENT, action="memory.read", outcome="ok", target=f"user:u1:k{i}")
        for i in range(1, 7)
    ]
    events = {e.pk: e for e in AuditEvent.objects.filter(tenant=tenant_a)}
    _seal_the_old_way(tenant_a, [e for pk, e in events.items() if pk not in (ids[2], ids[4], ids[5])])
    assert audit_seal(tenant_id=tenant_a.pk) == 3
    return tenant_a, ids


def test_a_chain_of_old_seals_then_range_seals_verifies_and_shows_each_events_seal(upgraded):
    tenant, ids = upgraded
    seals = list(AuditSeal.objects.filter(tenant=tenant).order_by("seq"))
    assert [(s.by_range, s.count, s.first_event_id) for s in seals] == [
        (False, 4, seals[0].first_event_id),
        (True, 3, ids[2]),
    ]
    result = audit_verify(tenant_id=tenant.pk)
    assert result.ok, result.problems
    assert (result.events, result.seals, result.unsealed) == (7, 2, 0)
    assert seal_numbers(tenant.pk, [ids[2], ids[4], ids[5]]) == {ids[2]: 2, ids[4]: 2, ids[5]: 2}
    assert AuditEvent.objects.get(pk=ids[3]).seal == 1  # the old seal's own number stays on its events


@pytest.mark.parametrize("victim", [1, 2], ids=["an old seal's event", "a range seal's late event"])
def test_deleting_an_event_on_either_side_of_the_upgrade_is_detected(upgraded, victim):
    tenant, ids = upgraded
    raw(f"DELETE FROM {TABLE} WHERE id = %s", [ids[victim]])
    assert first_problem(tenant).seal == (1 if victim == 1 else 2)


def test_purge_and_daily_counts_across_the_upgrade(upgraded):
    tenant, _ids = upgraded
    from audit import daily

    today = timezone.now().date()
    assert daily.counts(tenant.pk, since=today)["reads"] == {today: 6}
    result = audit_purge(tenant=tenant, now=timezone.now() + timedelta(days=10_000))
    assert result == {"events": 7, "seals": 2, "through": 2}
    assert AuditEvent.objects.filter(tenant=tenant).exclude(action="audit.purge").count() == 0
    assert audit_verify(tenant_id=tenant.pk).ok
    assert daily.counts(tenant.pk, since=today)["reads"] == {today: 6}  # folded counts outlive the events


@pytest.mark.postgres
def test_postgresql_lets_the_purge_mode_delete_only_sealed_events(chained):
    services.memory_read(tenant=chained, actor=AGENT, key="user:u1:k1")  # unsealed
    unsealed = AuditEvent.objects.filter(unsealed_q(chained.pk)).get().pk
    sealed = sealed_ids(chained)[0]
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('zeromem.audit_mode', 'purge', true)")
        cursor.execute(f"DELETE FROM {TABLE} WHERE id = %s", [unsealed])
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('zeromem.audit_mode', 'purge', true)")
        cursor.execute(f"DELETE FROM {TABLE} WHERE id = %s", [sealed])
        assert cursor.rowcount == 1
        transaction.set_rollback(True)
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT set_config('zeromem.audit_mode', 'purge', true)")
        cursor.execute(f"UPDATE {SEALS} SET by_range = false WHERE tenant_id = %s AND seq = 1", [chained.pk])


# --- forgeries the purge and redaction must not hide ----------------------------------------


def _plain_sql(sql, params=()):
    """As the application's role: no trigger switched off (an INSERT needs none)."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def test_a_forged_event_inserted_into_a_purged_seals_range_is_named(chained):
    audit_purge(tenant=chained, now=timezone.now() + timedelta(days=10_000))  # seals 1-4 purged
    assert audit_verify(tenant_id=chained.pk).ok
    inside = first_id_of(chained, 2) + 1  # an id a purged range seal held
    uid = "6f1c2a1e-0000-4000-8000-000000000002"
    _plain_sql(FORGED, [inside, uid, chained.pk, timezone.now(), "0" * 64, None, ""])
    problem = first_problem(chained)
    assert (problem.event_id, problem.seal) == (inside, 2) and "purged" in problem.message


def test_a_forged_event_claiming_a_purged_old_seal_is_named(upgraded):
    tenant, _ids = upgraded
    audit_purge(tenant=tenant, now=timezone.now() + timedelta(days=10_000))  # the old seal 1 and seal 2
    assert audit_verify(tenant_id=tenant.pk).ok
    forged_id = first_id_of(tenant, 1)
    uid = "6f1c2a1e-0000-4000-8000-000000000003"
    _plain_sql(FORGED, [forged_id, uid, tenant.pk, timezone.now(), "0" * 64, 1, "0" * 64])
    problem = first_problem(tenant)
    assert (problem.event_id, problem.seal) == (forged_id, 1) and "purged" in problem.message


@pytest.mark.parametrize(
    "column, value",
    [
        ("target", "user:u7:k1"),
        ("subject", "u7"),
        ("target", "redacted:not-a-pseudonym"),
        # Well formed, and another forgotten user's: bound to nothing this event committed to.
        ("target", chain.pseudonym(None, "user:u7:k1")),
        ("subject", "redacted:0123456789abcdef"),
    ],
    ids=["a named key", "a named subject", "no pseudonym", "another pseudonym", "a made-up pseudonym"],
)
def test_a_redacted_field_overwritten_in_the_redact_mode_names_the_event(chained, column, value):
    audit_redact_subject(tenant=chained, subject="u1")
    victim = AuditEvent.objects.filter(tenant=chained, pk__in=sealed_ids(chained), target__startswith="redacted:")[0]
    assert audit_verify(tenant_id=chained.pk).ok
    with transaction.atomic(), connection.cursor() as cursor:  # the app's role may announce the mode too
        if connection.vendor == "postgresql":
            cursor.execute("SELECT set_config('zeromem.audit_mode', 'redact', true)")
        cursor.execute(f"UPDATE {TABLE} SET {column} = %s WHERE id = %s", [value, victim.pk])
    problem = first_problem(chained)
    assert problem.event_id == victim.pk and column in problem.message


def test_redactions_made_before_their_pseudonyms_were_bound_are_bound_by_the_migration(chained):
    """audit 0016: events redacted before bindings existed verify after it, and are then held
    to the pseudonyms they had."""
    import importlib

    audit_redact_subject(tenant=chained, subject="u1")
    redacted = list(AuditEvent.objects.filter(tenant=chained).exclude(redacted={}).order_by("id"))
    assert redacted and all(set(e.redacted[chain.BOUND]) == set(e.redacted) - {chain.BOUND} for e in redacted)
    with transaction.atomic(), connection.cursor() as cursor:  # as they were before the migration
        if connection.vendor == "postgresql":
            cursor.execute("SELECT set_config('zeromem.audit_mode', 'redact', true)")
        for event in redacted:
            old = {k: v for k, v in event.redacted.items() if k != chain.BOUND}
            cursor.execute(f"UPDATE {TABLE} SET redacted = %s WHERE id = %s", [json.dumps(old), event.pk])
    assert first_problem(chained).event_id == redacted[0].pk
    migration = importlib.import_module("audit.migrations.0016_audit_bind_pseudonyms")
    migration.forward(django_apps, None)
    assert audit_verify(tenant_id=chained.pk).ok
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT set_config('zeromem.audit_mode', 'redact', true)")
        cursor.execute(f"UPDATE {TABLE} SET target = %s WHERE id = %s", ["redacted:0123456789abcdef", redacted[0].pk])
    problem = first_problem(chained)
    assert problem.event_id == redacted[0].pk and "another pseudonym" in problem.message


def test_a_redacted_client_address_written_back_names_the_event(chained):
    end_user = END_USER_U1
    services.memory_read(tenant=chained, actor=end_user, key="user:u1:k1")
    audit_redact_subject(tenant=chained, subject="u1")
    own = AuditEvent.objects.get(tenant=chained, actor_kind="end_user")
    assert own.client_ip is None and audit_verify(tenant_id=chained.pk).ok
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT set_config('zeromem.audit_mode', 'redact', true)")
        cursor.execute(f"UPDATE {TABLE} SET client_ip = '192.0.2.1' WHERE id = %s", [own.pk])
    problem = first_problem(chained)
    assert problem.event_id == own.pk and "client_ip" in problem.message


def test_a_kept_checkpoint_whose_tenant_is_gone_fails_verification(chained, tmp_path):
    path = tmp_path / "checkpoints.json"
    call_command("audit_checkpoint", "--out", str(path), stderr=io.StringIO())
    call_command("audit_verify", "--checkpoint", str(path), stdout=io.StringIO())
    raw("UPDATE memories_tenant SET slug = 'renamed' WHERE id = %s", [chained.pk])  # no trigger guards it
    err = io.StringIO()
    with pytest.raises(CommandError) as failed:
        call_command("audit_verify", "--checkpoint", str(path), stdout=io.StringIO(), stderr=err)
    assert failed.value.returncode == 1 and f"'{chained.slug}'" in err.getvalue()
    with pytest.raises(CommandError, match=chained.slug):  # asked for by name: no such tenant
        call_command("audit_verify", "--tenant", chained.slug, "--checkpoint", str(path), stdout=io.StringIO())
    err = io.StringIO()
    with pytest.raises(CommandError) as failed:  # the renamed chain has no checkpoint in the file
        call_command("audit_verify", "--tenant", "renamed", "--checkpoint", str(path), stdout=io.StringIO(), stderr=err)
    assert failed.value.returncode == 1 and "renamed" in err.getvalue()


@pytest.mark.parametrize(
    "content, field",
    [('{"tenant": "acme", "seal": "four"}', "seal"), ('{"tenant": "acme", "seal": 4}', "head_hash"), ("[1]", "")],
)
def test_a_malformed_checkpoint_file_is_a_command_error_naming_the_field(chained, tmp_path, content, field):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(CommandError, match=f"{path}.*{field}"):
        call_command("audit_verify", "--checkpoint", str(path), stdout=io.StringIO(), stderr=io.StringIO())


@pytest.mark.postgres
def test_a_redaction_reads_its_own_tenants_events_not_every_tenants(chained, tenant_b):
    # The pages walked the events by id alone, filtering the tenant: every tenant's events
    # after the subject's first one were read (2.4M rows for one page in a 2.9M-event database,
    # most of a forget's time). With no event of an older seal above the cursor, a page says
    # seal IS NULL and reads the tenant's own on audit_unsealed (tenant, id). Both tenants
    # keep their chains; the other tenant's u1 is left alone.
    from django.test.utils import CaptureQueriesContext

    from tests.test_audit_api import _event_rows_scanned

    for i in range(60):  # tenant B's busy log after A's subject's events
        audit_record(tenant=tenant_b, actor=AGENT, action="memory.read", outcome="ok", target=f"user:u1:b{i}")
    activity(chained, n=2, user="u1")
    mine = AuditEvent.objects.filter(tenant=chained).count()
    with CaptureQueriesContext(connection) as queries:
        assert audit_redact_subject(tenant=chained, subject="u1", batch_size=5) > 0
    pages = [q["sql"] for q in queries if q["sql"].startswith("SELECT") and '"redacted"' in q["sql"]]
    assert len(pages) > 3
    with transaction.atomic(), connection.cursor() as cursor:
        # As on a big table (a sort of all the tenant's matches is no option): pages walk an index in id order.
        cursor.execute("SET LOCAL enable_bitmapscan = off")
        cursor.execute("SET LOCAL enable_sort = off")
        scanned = [_event_rows_scanned(sql) for sql in pages]
    assert max(scanned) <= mine, (scanned, mine)
    assert not AuditEvent.objects.filter(tenant=chained, subject="u1").exists()
    assert AuditEvent.objects.filter(tenant=tenant_b, target__startswith="user:u1:b").count() == 60
    audit_seal(tenant_id=chained.pk)
    audit_seal(tenant_id=tenant_b.pk)
    assert audit_verify(tenant_id=chained.pk).ok and audit_verify(tenant_id=tenant_b.pk).ok
