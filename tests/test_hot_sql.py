"""The hot statements on the driver's cursor (zeromem/kernel/hotsql.py): the same SQL and
values as the ORM's save(), the ORM itself when receivers must see the save, Django's errors
and Django's cursor whenever statements are being watched."""

import re

import pytest
from django.db import DatabaseError, OperationalError, connection, transaction
from django.db.models.signals import pre_save
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from audit.models import AuditEvent
from memories import services
from memories.models import Memory, MemoryVersion
from tests.factories import SYSTEM, write
from tests.helpers import copy_memory, fresh_memory_table
from zeromem.kernel import crypto, hotsql

KEY = "user:u1:pref_lang"


def _orm_sql(action) -> list[str]:
    with CaptureQueriesContext(connection) as queries:
        action()
    return [q["sql"] for q in queries.captured_queries]


def test_the_update_is_the_one_save_update_fields_sends(tenant_a):
    memory = write(tenant_a, KEY, "zh-CN")
    names = ["value", "updated_at", "tags", "version"]
    orm = _orm_sql(lambda: memory.save(update_fields=names))
    sql, _fields = hotsql._update_plan(Memory, tuple(names), connection.vendor)
    _literals(orm[-1], sql)  # the same statement, the values aside


def _literals(rendered: str, template: str) -> tuple:
    """The values the ORM's (rendered) statement holds where ``template`` has ``%s``."""
    pattern = re.escape(template).replace(re.escape("%s"), "(.+?)") + "$"
    match = re.match(pattern, rendered)
    assert match, (rendered, template)
    return match.groups()


def test_the_insert_is_the_one_save_sends(tenant_a):
    memory = write(tenant_a, KEY, "zh-CN")
    version = MemoryVersion(
        tenant_id=tenant_a.pk, memory=memory, version=99, value="v", op="write", actor_kind="system"
    )
    orm = _orm_sql(lambda: version.save(force_insert=True))
    sql, _fields = hotsql._insert_plan(MemoryVersion, connection.vendor)
    _literals(orm[-1], sql)  # the same statement, the values aside


def test_update_and_insert_store_what_save_stores(tenant_a):
    memory = write(tenant_a, KEY, {"a": 1})
    memory.value, memory.tags, memory.version = {"b": [1, 2]}, ["x"], memory.version + 1
    hotsql.update(memory, ["value", "tags", "version"])
    row = Memory.objects.get(pk=memory.pk)
    assert (row.value, row.tags, row.version) == ({"b": [1, 2]}, ["x"], memory.version)
    version = MemoryVersion(tenant_id=tenant_a.pk, memory=memory, version=7, value=[1], op="write", actor_kind="x")
    hotsql.insert(version)
    assert version.pk is not None and not version._state.adding
    stored = MemoryVersion.objects.get(pk=version.pk)
    assert (stored.version, stored.value, stored.created_at) == (7, [1], version.created_at)


def test_a_sensitive_version_is_sealed_by_its_field(tenant_a):
    memory = services.memory_write(tenant=tenant_a, actor=SYSTEM, key=KEY, value="secret", sensitive=True).memory
    with connection.cursor() as cursor:
        cursor.execute("SELECT value FROM memories_memoryversion WHERE memory_id = %s", [memory.pk])
        (raw,) = cursor.fetchone()
    assert crypto.ENVELOPE_MARK in str(raw) and "secret" not in str(raw)  # an envelope, not the value
    assert MemoryVersion.objects.get(memory=memory).value == "secret"


def test_an_update_of_a_row_that_is_gone_raises_as_save_does(tenant_a):
    memory = write(tenant_a, KEY, "zh-CN")
    Memory.objects.filter(pk=memory.pk).delete()
    with pytest.raises(DatabaseError, match="did not affect any rows"):
        hotsql.update(memory, ["version"])


def test_receivers_of_pre_save_get_the_orm_save(tenant_a):
    seen = []

    def receiver(sender, instance, **kwargs):
        seen.append(instance.version)

    pre_save.connect(receiver, sender=MemoryVersion)
    try:
        write(tenant_a, KEY, "a")
        write(tenant_a, KEY, "b")
    finally:
        pre_save.disconnect(receiver, sender=MemoryVersion)
    assert seen == [1, 2]
    assert list(
        MemoryVersion.objects.filter(memory__key=KEY).values_list("version", flat=True).order_by("version")
    ) == [
        1,
        2,
    ]


def test_driver_errors_are_djangos(tenant_a):
    with pytest.raises(DatabaseError):
        hotsql.fetchone("SELECT * FROM no_such_table_here", [])


def test_a_broken_transaction_is_refused_as_by_djangos_cursor(tenant_a):
    from django.db.transaction import TransactionManagementError

    with transaction.atomic():
        try:
            with transaction.atomic(savepoint=False):
                hotsql.fetchone("SELECT * FROM no_such_table_here", [])
        except DatabaseError:
            pass
        with pytest.raises(TransactionManagementError):
            hotsql.fetchone("SELECT 1", [])


def test_statements_are_logged_while_queries_are_captured(tenant_a):
    write(tenant_a, KEY, "zh-CN")
    with CaptureQueriesContext(connection) as queries:
        services.memory_read(tenant=tenant_a, actor=SYSTEM, key=KEY)
    assert [q["sql"].split()[0] for q in queries.captured_queries] == ["SELECT", "INSERT"]
    assert AuditEvent.objects.filter(action="memory.read", target=KEY).count() == 1


def test_an_unreachable_database_is_an_operational_error(tenant_a, monkeypatch):
    """What the API turns into 503 database_unavailable (zeromem/kit/api.py)."""

    def down(*args, **kwargs):
        raise OperationalError("the database is unavailable")

    with monkeypatch.context() as patched, pytest.raises(OperationalError):
        patched.setattr(connection, "ensure_connection", down)
        hotsql.fetchone("SELECT 1", [])


def test_memories_by_ids_built_once_returns_what_the_orm_returns(tenant_a, tenant_b):
    # The ranked memories of a search are loaded by a statement compiled once (an array of
    # ids on PostgreSQL): the same live rows of the tenant as the queryset, nothing else.
    from datetime import timedelta

    from django.utils import timezone

    from memories import selectors

    kept = [write(tenant_a, f"fact:{i}", {"n": i, "text": "zebra"}, tags=["t"]) for i in range(4)]
    trashed = write(tenant_a, "fact:trashed", "x")
    Memory.objects.filter(pk=trashed.pk).update(deleted_at=timezone.now())
    expired = write(tenant_a, "fact:expired", "x")
    Memory.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    other = write(tenant_b, "fact:0", "another tenant's")
    ids = [m.pk for m in kept] + [trashed.pk, expired.pk, other.pk, 10**12]

    got = selectors.memories_by_ids(tenant=tenant_a, ids=ids)
    orm = {m.pk: m for m in selectors.memories_live(tenant=tenant_a).filter(pk__in=ids)}
    assert sorted(got) == sorted(orm) == sorted(m.pk for m in kept)
    for pk, memory in got.items():
        for field in Memory._meta.concrete_fields:
            if field.attname in memory.__dict__:
                assert getattr(memory, field.attname) == getattr(orm[pk], field.attname), field.attname
    assert got[kept[0].pk].value == {"n": 0, "text": "zebra"} and got[kept[0].pk].tags == ["t"]
    assert list(selectors.memories_by_ids(tenant=tenant_b, ids=ids)) == [other.pk]
    assert selectors.memories_by_ids(tenant=tenant_a, ids=[]) == {}


@pytest.mark.postgres
def test_memories_by_ids_is_a_primary_key_lookup_even_when_the_tenants_statistics_are_stale(tenant_a, tenant_b):
    """A search's ranked memories are a handful of ids: their statement must look them up by
    primary key. With the tenant's own condition indexable, the planner scanned the whole
    tenant by its (tenant, key) index whenever its statistics said the tenant was small —
    here: analyzed with one memory, then grown to 3,000 (a bulk import, a new tenant in a big
    table) — 166 ms a search at 100k memories in bench_search's build."""
    from memories import selectors

    fresh_memory_table()
    template = write(tenant_b, "fact:seed", {"text": "zebra"})
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE memories_memory")  # the statistics, with tenant_b at one memory
    copy_memory(template, 3000)
    ids = list(Memory.objects.filter(tenant=tenant_b).order_by("-pk").values_list("pk", flat=True)[:15])
    plan = selectors._plan("live_by_ids", connection.vendor)
    values = {"tenant": tenant_b.pk, "now": template.updated_at, "ids": ids}
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + plan.sql, [values[name] for name in plan.order])
        explained = "\n".join(line for (line,) in cursor.fetchall())
    assert "memories_memory_pkey" in explained, explained
    assert sorted(selectors.memories_by_ids(tenant=tenant_b, ids=ids)) == sorted(ids)
    assert selectors.memories_by_ids(tenant=tenant_a, ids=ids) == {}  # still the tenant's own only


def test_the_previous_releases_inserts_still_work_during_a_rolling_deploy(tenant_a):
    # Columns this release added (MemoryVersion.subject, ForgetRequest.stalled_attempts) keep
    # a database default: the code of the release before, still running on other instances
    # after `migrate`, inserts rows without naming them — without it every write failed
    # (NOT NULL) until the last old instance was gone.
    memory = write(tenant_a, KEY, "zh-CN")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO memories_memoryversion (tenant_id, memory_id, version, value, sensitive, op, actor_kind,"
            " actor_id, created_at) VALUES (%s, %s, 99, '\"v\"', false, 'write', 'system', '', %s)",
            [tenant_a.pk, memory.pk, timezone.now()],
        )
    assert MemoryVersion.objects.get(memory=memory, version=99).subject == ""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT table_name, column_name, column_default FROM information_schema.columns"
                " WHERE (table_name, column_name) IN (('memories_memoryversion', 'subject'),"
                " ('memories_forgetrequest', 'stalled_attempts')) ORDER BY 1"
            )
            defaults = cursor.fetchall()
        assert [(t, c, d is not None) for t, c, d in defaults] == [
            ("memories_forgetrequest", "stalled_attempts", True),
            ("memories_memoryversion", "subject", True),
        ]
