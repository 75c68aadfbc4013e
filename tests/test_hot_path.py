"""The read's hot path (issue 11 item 2): statements per authenticated, audited read, the
API key cache and its revocation bound, access counts folded from the audit log."""

import json
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from audit.models import AuditEvent
from audit.services import audit_seal_all
from memories import services
from memories.models import AccessCountFold, Memory, Tenant
from memories.services import access, key_cache
from tests.factories import SYSTEM, make_keyed_client, write
from zeromem.schedules import SCHEDULES

KEY = "user:u1:pref_lang"


@pytest.fixture(autouse=True)
def _token_usage_as_in_production(settings):
    # Production writes tokens returned once per ZEROMEM_USAGE_FLUSH_SECONDS per process, not
    # per response (tests/conftest.py writes at once): the read's statements do not include it.
    from memories.services import usage

    settings.ZEROMEM_USAGE_FLUSH_SECONDS = 3600
    usage.flush()
    yield
    usage.discard_pending()


def _tool_read(client, key=KEY):
    return client.post("/api/v1/tools/call", {"name": "memory_read", "arguments": {"key": key}})


def _statements(request) -> list[str]:
    """The SQL a request sent, but a database rate-limit counter's: that one is in Redis in
    production (REDIS_URL), the database's only without it."""
    with CaptureQueriesContext(connection) as queries:
        response = request()
    assert response.status_code == 200, response.content
    return [q["sql"] for q in queries.captured_queries if "ratecounter" not in q["sql"]]


# --- statements per read -----------------------------------------------------------------


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda c: _tool_read(c), id="tool memory_read"),
        pytest.param(lambda c: c.get(f"/api/v1/memories/{KEY}"), id="REST GET"),
    ],
)
def test_authenticated_audited_read_is_two_statements_after_warm_up(tenant_a, read):
    write(tenant_a, KEY, "zh-CN")
    client, _ = make_keyed_client(tenant_a)
    read(client)  # warm-up: the key lookup (then cached) and last_used_at (then once a minute)
    before = AuditEvent.objects.filter(action="memory.read").count()
    sql = _statements(lambda: read(client))
    assert len(sql) <= 2, sql
    assert sql[0].startswith("SELECT") and "memories_memory" in sql[0]
    assert sql[1].startswith("INSERT") and "audit_auditevent" in sql[1]
    assert AuditEvent.objects.filter(action="memory.read").count() == before + 1


def test_read_inside_a_batch_still_writes_its_event(tenant_a):
    write(tenant_a, KEY, "zh-CN")
    client, _ = make_keyed_client(tenant_a)
    body = {"calls": [{"name": "memory_read", "arguments": {"key": KEY}}] * 3}
    r = client.post("/api/v1/tools/batch", body)
    assert r.status_code == 200 and all(x["value"] == "zh-CN" for x in r.json()["results"])
    assert AuditEvent.objects.filter(action="memory.read", target=KEY, outcome="ok").count() == 3


# --- the API key cache -------------------------------------------------------------------


@pytest.fixture
def fake_clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(key_cache, "clock", lambda: now[0])
    return now


def test_revocation_through_the_service_is_refused_at_once(tenant_a):
    write(tenant_a, KEY, "zh-CN")
    client, key = make_keyed_client(tenant_a)
    assert _tool_read(client).status_code == 200  # now cached
    assert services.api_key_revoke(tenant=tenant_a, actor=SYSTEM, key_id=key.pk)
    r = _tool_read(client)
    assert r.status_code == 401 and r.json()["error"]["code"] == "key_revoked"


def test_a_key_verified_while_it_is_revoked_is_not_cached_past_the_revocation(
    tenant_a, monkeypatch, django_capture_on_commit_callbacks
):
    """A request that read the key just before a revocation in this process committed must
    not put it in the cache after the revocation has emptied it: the next request of this
    process would pass with a revoked key for the cache's TTL."""
    from types import SimpleNamespace

    from memories.services import api_keys

    write(tenant_a, KEY, "zh-CN")
    client, key = make_keyed_client(tenant_a)
    revoked = []

    def now():  # verify_api_key asks for the time right after it read the key
        if not revoked:
            with django_capture_on_commit_callbacks(execute=True):
                revoked.append(services.api_key_revoke(tenant=tenant_a, actor=SYSTEM, key_id=key.pk))
        return timezone.now()

    monkeypatch.setattr(api_keys, "timezone", SimpleNamespace(now=now))
    assert _tool_read(client).status_code == 200  # in flight when the revocation came: it passes
    assert revoked == [True]
    r = _tool_read(client)
    assert r.status_code == 401 and r.json()["error"]["code"] == "key_revoked"


def test_revocation_elsewhere_is_refused_once_the_cache_ttl_has_passed(tenant_a, settings, fake_clock):
    settings.ZEROMEM_API_KEY_CACHE_SECONDS = 10
    write(tenant_a, KEY, "zh-CN")
    client, key = make_keyed_client(tenant_a)
    assert _tool_read(client).status_code == 200  # cached at t=1000
    # Another process (or instance) revokes: through the service, whose in-process
    # invalidation happens there, not here — this process only has its TTL.
    services.api_key_revoke(tenant=tenant_a, actor=SYSTEM, key_id=key.pk)
    key_cache.put(key)  # as if this process had never heard of it
    fake_clock[0] += 9.9
    assert _tool_read(client).status_code == 200  # within the documented bound
    fake_clock[0] += 0.1
    r = _tool_read(client)
    assert r.status_code == 401 and r.json()["error"]["code"] == "key_revoked"


def test_cached_key_is_refused_once_it_expires(tenant_a, monkeypatch):
    write(tenant_a, KEY, "zh-CN")
    client, _ = make_keyed_client(tenant_a, expires_in_days=1)
    assert _tool_read(client).status_code == 200
    later = timezone.now() + timedelta(days=1, seconds=1)
    monkeypatch.setattr(timezone, "now", lambda: later)
    r = _tool_read(client)
    assert r.status_code == 401 and r.json()["error"]["code"] == "key_expired"


def test_wrong_secret_with_a_cached_keys_lookup_is_invalid(tenant_a):
    client, _ = make_keyed_client(tenant_a)
    assert client.get("/api/v1/memories").status_code == 200
    forged = make_keyed_client(tenant_a)[0]
    forged.raw_key = client.raw_key[:-4] + ("AAAA" if not client.raw_key.endswith("AAAA") else "BBBB")
    r = forged.get("/api/v1/memories")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_key"


def test_scope_change_by_a_model_save_drops_the_cached_key(tenant_a):
    write(tenant_a, KEY, "zh-CN")
    client, key = make_keyed_client(tenant_a)
    assert _tool_read(client).status_code == 200
    key.scopes = ["memory:write"]
    key.save(update_fields=["scopes"])  # as the admin's change form does
    r = _tool_read(client)
    assert r.status_code == 403 and r.json()["error"]["code"] == "missing_scope"


def test_cache_off_looks_the_key_up_every_time(tenant_a, settings):
    settings.ZEROMEM_API_KEY_CACHE_SECONDS = 0
    write(tenant_a, KEY, "zh-CN")
    client, _ = make_keyed_client(tenant_a)
    _tool_read(client)
    sql = _statements(lambda: _tool_read(client))
    assert len(sql) == 3 and "memories_apikey" in sql[0]


# --- access counts -----------------------------------------------------------------------


def _counts(tenant, key=KEY):
    m = Memory.objects.get(tenant=tenant, key=key, deleted_at__isnull=True)
    return m.access_count, m.last_accessed_at


def test_reads_are_counted_by_the_fold_exactly_once(tenant_a, tenant_b):
    write(tenant_a, KEY, "zh-CN")
    write(tenant_b, KEY, "en")
    a, _ = make_keyed_client(tenant_a)
    b, _ = make_keyed_client(tenant_b)
    for _ in range(3):
        assert _tool_read(a).status_code == 200
    assert a.get(f"/api/v1/memories/{KEY}").status_code == 200
    assert b.get(f"/api/v1/memories/{KEY}").status_code == 200
    assert _tool_read(a, "user:u1:missing").status_code == 200  # not_found: not a read of anything
    assert _counts(tenant_a)[0] == 0  # nothing on the request path
    assert access.access_counts_fold() == 5
    count, last = _counts(tenant_a)
    assert count == 4 and last is not None
    assert _counts(tenant_b)[0] == 1
    assert access.access_counts_fold() == 0  # run again: nothing counted twice
    assert _counts(tenant_a)[0] == 4
    _tool_read(a)
    assert access.access_counts_fold() == 1 and _counts(tenant_a)[0] == 5


def test_reads_not_yet_sealed_wait_for_the_next_run(tenant_a):
    write(tenant_a, KEY, "zh-CN")
    a, _ = make_keyed_client(tenant_a)
    access.access_counts_fold()
    _tool_read(a)
    assert access.access_counts_fold(seal=False) == 0  # its event is not in a seal yet
    assert access.access_counts_fold() == 1 and _counts(tenant_a)[0] == 1


def test_a_failed_fold_counts_nothing_and_the_next_one_counts_all(tenant_a, monkeypatch):
    write(tenant_a, KEY, "zh-CN")
    a, _ = make_keyed_client(tenant_a)
    _tool_read(a)
    _tool_read(a)

    def crash(*args, **kwargs):
        raise RuntimeError("worker killed")

    monkeypatch.setattr(access, "_credited", crash)
    with pytest.raises(RuntimeError):
        access.access_counts_fold()
    assert _counts(tenant_a)[0] == 0
    assert not AccessCountFold.objects.filter(tenant=tenant_a, seal__gt=0).exists()
    monkeypatch.undo()
    assert access.access_counts_fold() == 2 and _counts(tenant_a)[0] == 2


def test_reads_of_a_deleted_then_rewritten_key_go_to_the_memory_read(tenant_a):
    write(tenant_a, KEY, "old")
    a, _ = make_keyed_client(tenant_a)
    _tool_read(a)
    access.access_counts_fold()
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key=KEY)
    write(tenant_a, KEY, "new")
    _tool_read(a)
    _tool_read(a)
    access.access_counts_fold()
    assert _counts(tenant_a)[0] == 2
    assert Memory.objects.get(tenant=tenant_a, key=KEY, deleted_at__isnull=False).access_count == 1


def _read(tenant, key=KEY):
    services.memory_read(tenant=tenant, actor=SYSTEM, key=key)


@pytest.mark.postgres
def test_the_fold_updates_every_memory_read_with_one_statement(tenant_a):
    """One UPDATE for all the memories a group of seals read (after one SELECT locking them in
    id order), not one UPDATE — a round trip and the ORM's query building — per memory."""
    keys = [f"user:u{i}:lang" for i in range(30)]
    for key in keys:
        write(tenant_a, key, "en")
    access.access_counts_fold()
    for key in keys:
        _read(tenant_a, key)
    _read(tenant_a, keys[0])
    with CaptureQueriesContext(connection) as queries:
        assert access.access_counts_fold() == 31
    updates = [q["sql"] for q in queries if q["sql"].lstrip().startswith("UPDATE") and "memories_memory " in q["sql"]]
    assert len(updates) == 1, updates
    assert _counts(tenant_a, keys[0])[0] == 2 and _counts(tenant_a, keys[29])[0] == 1


def test_a_count_at_the_top_of_its_column_stays_there(tenant_a):
    """access_count is a 32-bit column: a fold that would pass its top leaves it there instead
    of failing (and failing again every minute, the tenant's reads never counted)."""
    write(tenant_a, KEY, "zh-CN")
    access.access_counts_fold()
    Memory.objects.filter(tenant=tenant_a, key=KEY).update(access_count=2**31 - 2)
    for _ in range(3):
        _read(tenant_a)
    assert access.access_counts_fold() == 3
    assert _counts(tenant_a)[0] == 2**31 - 1


def test_a_backlog_is_folded_in_groups_each_moving_the_watermark(tenant_a, settings, monkeypatch):
    """A backlog of seals (the job stopped for a while) is read a group at a time, each group
    its own transaction with the watermark: a crash keeps the groups before it, counts the
    rest on the next run, and nothing twice."""
    settings.ZEROMEM_AUDIT_SEAL_BATCH = 1  # a seal per event
    monkeypatch.setattr(access, "FOLD_EVENTS", 2)
    write(tenant_a, KEY, "zh-CN")
    access.access_counts_fold()
    for _ in range(5):
        _read(tenant_a)
    real, calls = access._add_counts, []

    def crash_on_second_group(credited):
        calls.append(credited)
        if len(calls) == 2:
            raise RuntimeError("worker killed")
        real(credited)

    monkeypatch.setattr(access, "_add_counts", crash_on_second_group)
    with pytest.raises(RuntimeError):
        access.access_counts_fold()
    assert _counts(tenant_a)[0] == 2  # the first group of two seals, committed with its watermark
    monkeypatch.setattr(access, "_add_counts", real)
    assert access.access_counts_fold(seal=False) == 3 and _counts(tenant_a)[0] == 5
    assert access.access_counts_fold() == 0


@pytest.mark.postgres
def test_counting_reads_leaves_the_indexes_alone_where_the_page_has_room(tenant_a):
    """memories_memory's pages are filled to 80% (migration 0031): the fold's UPDATE, which
    changes no indexed column, finds room beside the row and is HOT — no entry in any index,
    none in the search GIN per word. On pages filled to 100% it moved every row it updated."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = 'memories_memory'")
        assert "fillfactor=80" in (cursor.fetchone()[0] or [])
    keys = [f"fact:f{i}:note" for i in range(300)]
    for key in keys:
        write(tenant_a, key, f"note {key} about several words of a value")
    access.access_counts_fold()
    for key in keys[::10]:
        _read(tenant_a, key)
    stats = "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = 'memories_memory'"
    with connection.cursor() as cursor:
        cursor.execute(stats)
        updates_before, hot_before = cursor.fetchone()
        assert access.access_counts_fold() == 30
        cursor.execute(stats)
        updates, hot = cursor.fetchone()
    assert updates - updates_before == 30
    assert hot - hot_before == 30


@pytest.mark.postgres
def test_finding_the_tenants_to_fold_reads_no_more_seals_than_there_are_tenants(tenant_a, tenant_b):
    """Seals accumulate with the log's whole history (one per tenant and sealing run): which
    tenants have reads to fold is one index probe each, not a grouped MAX over every seal."""
    write(tenant_a, KEY, "zh-CN")
    access.access_counts_fold()
    with connection.cursor() as cursor:  # 20,000 old seals of tenant b, all folded (below)
        cursor.execute(
            """INSERT INTO audit_auditseal (seq, first_event_id, last_event_id, count, total, prev_hash, hash,
                   sealed_at, tenant_id, by_range)
               SELECT s + 1000, 0, 0, 1, s, '', '', now(), %s, true FROM generate_series(1, 20000) s""",
            [tenant_b.pk],
        )
        cursor.execute("ANALYZE audit_auditseal")
    _read(tenant_a)
    audit_seal_all()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO memories_accesscountfold (tenant_id, seal, folded_at)"
            " SELECT %s, max(seq), now() FROM audit_auditseal WHERE tenant_id = %s"
            " ON CONFLICT (tenant_id) DO UPDATE SET seal = EXCLUDED.seal",
            [tenant_b.pk, tenant_b.pk],
        )
    plan = json.loads(access._due_tenants().explain(format="json", analyze=True))[0]["Plan"]

    def seal_rows(node):
        own = node.get("Actual Rows", 0) * node.get("Actual Loops", 1)
        here = own if node.get("Relation Name") == "audit_auditseal" else 0
        return here + sum(seal_rows(child) for child in node.get("Plans", []))

    assert seal_rows(plan) <= Tenant.objects.count(), plan
    assert list(access._due_tenants()) == [tenant_a.pk]


def test_the_fold_is_scheduled_every_minute():
    func, _type, minutes = SCHEDULES["zeromem:access-counts"]
    assert func == "memories.tasks.access_counts_fold_task" and minutes == 1


# --- middleware ----------------------------------------------------------------------------


def test_static_files_are_still_served(settings, tmp_path, client):
    settings.STATIC_ROOT = tmp_path
    (tmp_path / "zm-probe.txt").write_text("probe")
    r = client.get("/static/zm-probe.txt")
    assert r.status_code == 200 and r["Content-Length"] == "5"
    assert client.get("/static/missing.txt").status_code == 404


def test_wsgi_requests_outside_static_go_through_no_async_adapter(db, client, monkeypatch):
    # ServeStatic's middleware is async-only: adapted under WSGI it made every request run
    # through async_to_sync (an event loop and thread hops). Only /static/ pays that now.
    from asgiref import sync

    calls = []
    real = sync.AsyncToSync.__call__
    monkeypatch.setattr(sync.AsyncToSync, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    assert client.get("/healthz").status_code == 200
    assert calls == []


# --- statements per write ----------------------------------------------------------------


def test_a_write_over_an_existing_memory_is_four_statements_after_warm_up(tenant_a):
    """The row lock, the UPDATE, the version INSERT and the audit INSERT (each built once per
    process, zeromem/kernel/hotsql.py), in one transaction; the version history stays exact."""
    write(tenant_a, KEY, "zh-CN")
    client, _ = make_keyed_client(tenant_a)
    body = {"name": "memory_write", "arguments": {"key": KEY, "value": "en"}}
    assert client.post("/api/v1/tools/call", body).json()["version"] == 2  # warm-up
    body["arguments"]["value"] = "de"
    # (The test runs inside a transaction: the write's BEGIN/COMMIT are a SAVEPOINT/RELEASE here.)
    # Watched, the statements go one by one; unwatched on PostgreSQL the UPDATE and the two
    # INSERTs are one statement (hotsql.holding; round trips: tests/test_hot_write.py).
    sql = _statements(lambda: client.post("/api/v1/tools/call", body))
    sql = [s for s in sql if not s.startswith(("SAVEPOINT", "RELEASE"))]
    verbs = [s.split()[0] for s in sql]
    assert verbs == ["SELECT", "UPDATE", "INSERT", "INSERT"], sql
    assert "memories_memory" in sql[0] and "memories_memoryversion" in sql[2] and "audit_auditevent" in sql[3]
    # The row lock (SQLite has no FOR UPDATE: its write transactions are IMMEDIATE, one at a time).
    assert ("FOR UPDATE" in sql[0]) == (connection.vendor == "postgresql")
    memory = Memory.objects.get(tenant=tenant_a, key=KEY, deleted_at__isnull=True)
    history = list(memory.versions.order_by("version").values_list("version", "value"))
    assert memory.version == 3 and history == [(1, "zh-CN"), (2, "en"), (3, "de")]


# --- prepared statements (zeromem/kernel/hotsql.py, DB_PREPARED_STATEMENTS) ----------------


def _prepared() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements WHERE NOT from_sql")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's prepared statements")
def test_the_hot_statements_are_prepared_once_per_connection(tenant_a):
    """A read's SELECT and audit INSERT and a write's row lock and its UPDATE with its version
    and audit INSERTs are parsed and planned once per connection; later calls send only their
    parameters."""
    write(tenant_a, KEY, "zh-CN")
    client, _ = make_keyed_client(tenant_a)
    body = {"name": "memory_write", "arguments": {"key": KEY, "value": "en"}}
    for value in ("en", "de"):
        body["arguments"]["value"] = value
        assert client.post("/api/v1/tools/call", body).status_code == 200
        assert _tool_read(client).json()["value"] == value
    prepared = _prepared()
    assert any(s.startswith("SELECT") and "memories_memory" in s and "FOR UPDATE" not in s for s in prepared)
    assert any(s.startswith("SELECT") and "FOR UPDATE" in s for s in prepared)
    # The write's UPDATE, version INSERT and audit INSERT: one statement (hotsql.holding).
    assert any(
        s.startswith('WITH h0 AS (UPDATE "memories_memory"')
        and 'INSERT INTO "memories_memoryversion"' in s
        and 'INSERT INTO "audit_auditevent"' in s
        for s in prepared
    )
    assert any(s.startswith("INSERT") and "audit_auditevent" in s for s in prepared)  # the read's
    assert all("$1" in s for s in prepared)  # parameters apart from the text, never inlined
    for value in ("fr", "it", "es"):  # the same statements again: nothing more is prepared
        body["arguments"]["value"] = value
        client.post("/api/v1/tools/call", body)
        assert _tool_read(client).json()["value"] == value
    assert sorted(_prepared()) == sorted(prepared)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's prepared statements")
def test_the_hot_statements_are_planned_once_not_by_the_tenants_statistics(tenant_a):
    """A prepared statement gets one generic plan from its first execution (plan_cache_mode):
    PostgreSQL's custom plans of the first five read the tenant's statistics, and for a tenant
    imported since the last ANALYZE (no rows, as far as they say) a point read filtered the
    whole tenant on its first index: 23 ms instead of 0.04 ms at 100k memories."""
    write(tenant_a, KEY, "zh-CN")
    client, _ = make_keyed_client(tenant_a)
    for _ in range(3):
        assert _tool_read(client).json()["value"] == "zh-CN"
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('plan_cache_mode')")
        assert cursor.fetchone()[0] == "force_generic_plan"
        cursor.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE NOT from_sql AND statement LIKE 'SELECT%%memories_memory%%'"
        )
        plans = cursor.fetchall()
    assert plans and all(generic >= 1 and custom == 0 for _statement, generic, custom in plans), plans


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's prepared statements")
def test_without_prepared_statements_the_hot_path_binds_client_side(tenant_a, monkeypatch):
    """Behind PgBouncer in transaction mode (ZEROMEM_PGBOUNCER, or DB_PREPARED_STATEMENTS=false)
    the connection has no prepare threshold: nothing is prepared, the answers are the same."""
    from zeromem.kernel import hotsql

    def no_server_binding(conn):
        raise AssertionError("a statement was bound server-side")

    connection.ensure_connection()
    monkeypatch.setattr(connection.connection, "prepare_threshold", None)
    monkeypatch.setattr(hotsql, "_server_bound", no_server_binding)
    write(tenant_a, KEY, "zh-CN")
    client, _ = make_keyed_client(tenant_a)
    body = {"name": "memory_write", "arguments": {"key": KEY, "value": "en"}}
    assert client.post("/api/v1/tools/call", body).json()["version"] == 2
    assert _tool_read(client).json()["value"] == "en"
    assert AuditEvent.objects.filter(tenant=tenant_a, action__in=["memory.read", "memory.write"]).count() == 3


def test_prepared_statements_follow_the_pgbouncer_setting():
    """settings.py: on by default, off behind PgBouncer unless asked for (PgBouncer >= 1.21
    with max_prepared_statements tracks them), off when asked."""
    import os
    import subprocess
    import sys

    code = (
        "import zeromem.settings as s; o = s.DATABASES['default']['OPTIONS']; "
        "print('force_generic_plan' in o.get('options', ''), o.get('prepare_threshold'))"
    )

    def threshold(**env):
        base = {k: v for k, v in os.environ.items() if k not in ("ZEROMEM_PGBOUNCER", "DB_PREPARED_STATEMENTS")}
        base |= {"DATABASE_URL": "postgres://u@127.0.0.1:5432/x", "SECRET_KEY": "k" * 50, **env}
        done = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return " ".join(done.stdout.split()[-2:])

    # (generic plans for the prepared statements, the prepare threshold)
    assert threshold() == "True 5"
    assert threshold(ZEROMEM_PGBOUNCER="true") == "False None"
    assert threshold(ZEROMEM_PGBOUNCER="true", DB_PREPARED_STATEMENTS="true") == "False 5"
    assert threshold(DB_PREPARED_STATEMENTS="false") == "False None"


# --- content negotiation (zeromem/kit/negotiation.py) ---------------------------------------


@pytest.mark.parametrize("accept", [None, "*/*", "application/json", "application/*", "application/json; q=0.9"])
def test_json_is_served_for_every_accept_that_allows_it(tenant_a, accept):
    write(tenant_a, KEY, "zh-CN")
    client, _ = make_keyed_client(tenant_a)
    r = client.get(f"/api/v1/memories/{KEY}", headers=None if accept is None else {"Accept": accept})
    assert r.status_code == 200 and r["Content-Type"] == "application/json"
    assert r.json()["value"] == "zh-CN"


def test_an_accept_json_cannot_satisfy_is_refused_as_before(tenant_a):
    client, _ = make_keyed_client(tenant_a)
    r = client.get("/api/v1/memories", headers={"Accept": "text/html"})
    assert r.status_code == 406 and r.json()["error"]["code"] == "not_acceptable"
