"""Operator commands: create_tenant, create_api_key, and the batch options of the others."""

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from audit.models import AuditEvent
from memories import services
from memories.models import ApiKey, Tenant, hash_api_key
from tests.factories import KeyedClient
from zeromem.kernel.actors import Actor


def run(*args, **options):
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err, **options)
    return out.getvalue(), err.getvalue()


def test_create_tenant_creates_it_with_its_name(db):
    out, _ = run("create_tenant", "umbrella", "--name", "Umbrella Corp")
    tenant = Tenant.objects.get(slug="umbrella")
    assert tenant.name == "Umbrella Corp"
    assert "umbrella" in out
    assert AuditEvent.objects.filter(tenant=tenant, action="tenant.create", actor_kind="system").count() == 1


def test_create_tenant_twice_is_a_command_error(db):
    run("create_tenant", "umbrella")
    with pytest.raises(CommandError, match="already exists"):
        run("create_tenant", "umbrella")
    assert Tenant.objects.filter(slug="umbrella").count() == 1


def test_create_tenant_with_bad_slug_is_a_command_error(db):
    with pytest.raises(CommandError):
        run("create_tenant", "not a slug!")
    assert not Tenant.objects.exists()


@pytest.mark.parametrize(
    "args, field",
    [
        (["x" * 64], "slug"),
        (["umbrella", "--name", "n" * 201], "name"),
        (["umbrella", "--name", "Umbrella\x00Corp"], "name"),
        (["umbrella", "--name", "   "], "name"),
    ],
)
def test_create_tenant_with_a_slug_or_name_that_cannot_be_stored_is_a_command_error_naming_it(db, args, field):
    # Were: a 64-character slug and a 201-character name DataError tracebacks, a NUL a
    # psycopg ValueError, a blank name a nameless tenant.
    with pytest.raises(CommandError, match=f"^{field}: "):
        run("create_tenant", *args)
    assert not Tenant.objects.exists()


@pytest.fixture
def umbrella(db):
    run("create_tenant", "umbrella", "--name", "Umbrella")
    return Tenant.objects.get(slug="umbrella")


def _create_key_json(*extra):
    out, _ = run("create_api_key", "--tenant", "umbrella", "--name", "agent-1", *extra, "--json")
    return json.loads(out)  # the whole output is exactly one JSON object


def test_create_api_key_json_prints_one_object_with_the_key(umbrella):
    data = _create_key_json("--scopes", "memory:read", "--allow", "user:u1:", "--expires-in-days", "3")
    raw = data["key"]
    assert raw.startswith("zm_")
    assert data["tenant"] == "umbrella"
    assert data["scopes"] == ["memory:read"]
    assert data["allowed_prefixes"] == ["user:u1:"]
    key = ApiKey.objects.get(pk=data["id"])
    assert key.tenant == umbrella
    assert data["prefix"] == key.display_prefix and raw.startswith(key.display_prefix + "_")
    # Only the hash is stored.
    assert key.key_hash == hash_api_key(raw) and raw not in key.key_hash
    assert timedelta(days=2, hours=23) < key.expires_at - timezone.now() <= timedelta(days=3)
    assert raw not in json.dumps(list(AuditEvent.objects.values()), default=str)


def test_created_key_works_with_exactly_its_scope_and_allowlist(umbrella):
    data = _create_key_json("--scopes", "memory:read", "--allow", "user:u1:", "--expires-in-days", "3")
    # Seed data through a separate full key of the same tenant.
    full = KeyedClient(_create_key_json()["key"], umbrella, Client())
    full.call("memory_write", key="user:u1:lang", value="zh")
    full.call("memory_write", key="user:u2:lang", value="en")

    client = KeyedClient(data["key"], umbrella, Client())
    status, body = client.call("memory_read", key="user:u1:lang")
    assert status == 200 and body["value"] == "zh"
    _, body = client.call("memory_list", prefix="")
    assert body["keys"] == ["user:u1:lang"]
    status, body = client.call("memory_read", key="user:u2:lang")
    assert status == 403 and body["error"]["code"] == "key_not_allowed"
    status, body = client.call("memory_write", key="user:u1:lang", value="x")
    assert status == 403 and body["error"]["code"] == "missing_scope"
    status, body = client.call("memory_search", query="zh")
    assert status == 403 and body["error"]["code"] == "missing_scope"
    status, body = client.call("memory_delete", key="user:u1:lang")
    assert status == 403 and body["error"]["code"] == "missing_scope"


def test_created_key_stops_working_after_its_expiry(umbrella):
    data = _create_key_json("--expires-in-days", "1")
    ApiKey.objects.filter(pk=data["id"]).update(expires_at=timezone.now() - timedelta(seconds=1))
    status, body = KeyedClient(data["key"], umbrella, Client()).call("memory_list")
    assert status == 401 and body["error"]["code"] == "key_expired"


def test_create_api_key_defaults_to_the_memory_scopes(umbrella):
    data = _create_key_json()
    assert sorted(data["scopes"]) == ["memory:delete", "memory:read", "memory:search", "memory:write"]
    assert data["allowed_prefixes"] == [] and data["expires_at"] is None


def test_create_api_key_accepts_several_scopes_and_prefixes(umbrella):
    data = _create_key_json("--scopes", "memory:read,memory:write", "--allow", "user:u1:", "--allow", "task:")
    assert data["scopes"] == ["memory:read", "memory:write"]
    assert data["allowed_prefixes"] == ["user:u1:", "task:"]


def test_create_api_key_without_json_prints_the_key_once(umbrella):
    out, _ = run("create_api_key", "--tenant", "umbrella", "--name", "human")
    lines = out.splitlines()
    raw = [line for line in lines if line.startswith("zm_")]
    assert len(raw) == 1
    assert ApiKey.objects.get(tenant=umbrella).key_hash == hash_api_key(raw[0])


def test_create_api_key_for_unknown_tenant_is_a_command_error(umbrella):
    with pytest.raises(CommandError, match="no tenant"):
        run("create_api_key", "--tenant", "nope", "--name", "x", "--json")
    assert not ApiKey.objects.exists()


@pytest.mark.parametrize("scopes", ["memory:admin", "memory:read,root", "MEMORY:READ"])
def test_create_api_key_with_unknown_scope_is_a_command_error(umbrella, scopes):
    with pytest.raises(CommandError, match="scope"):
        run("create_api_key", "--tenant", "umbrella", "--name", "x", "--scopes", scopes, "--json")
    assert not ApiKey.objects.exists()


@pytest.mark.parametrize("days", ["0", "-1", "3651", "3000000", "1000000000"])
def test_create_api_key_with_an_expiry_out_of_range_is_a_command_error_naming_it(umbrella, days):
    with pytest.raises(CommandError, match="expires_in_days: must be between 1 and 3650"):
        run("create_api_key", "--tenant", "umbrella", "--name", "x", "--expires-in-days", days, "--json")
    assert not ApiKey.objects.exists()


@pytest.mark.parametrize("prefix", ["user::", "bad prefix", "a/b"])
def test_create_api_key_with_bad_allow_prefix_is_a_command_error(umbrella, prefix):
    with pytest.raises(CommandError, match="allowed_prefixes"):
        run("create_api_key", "--tenant", "umbrella", "--name", "x", "--allow", prefix)
    assert not ApiKey.objects.exists()


def test_create_api_key_with_a_bare_allow_entry_never_reaches_its_neighbours(umbrella):
    # "user:u1" as a plain prefix would also cover user:u10:secret.
    out, _ = run(
        "create_api_key", "--tenant", "umbrella", "--name", "x", "--allow", " user:u1 ", "--scopes", "memory:read"
    )
    assert "'user:u1' covers the key user:u1 and the keys under user:u1: (not user:u10:…)" in out
    raw = next(line for line in out.splitlines() if line.startswith("zm_"))
    assert ApiKey.objects.get().allowed_prefixes == ["user:u1"]
    for key, value in (("user:u10:secret", "u10's"), ("user:u1:lang", "en")):
        services.memory_write(tenant=umbrella, actor=Actor.system(), key=key, value=value)
    client = KeyedClient(raw, umbrella, Client())
    assert client.call("memory_read", key="user:u10:secret")[0] == 403
    assert client.call("memory_read", key="user:u1:lang")[0] == 200


@pytest.mark.parametrize("name", ["", "   ", "x" * 101, "a\x00b", "bot\nsecond line"])
def test_create_api_key_with_a_name_that_cannot_be_stored_is_a_command_error_naming_it(umbrella, name):
    # Were: "" and "   " stored as a nameless key, 101 characters a DataError traceback,
    # a NUL a psycopg ValueError traceback.
    with pytest.raises(CommandError, match="^name: "):
        run("create_api_key", "--tenant", "umbrella", "--name", name, "--json")
    assert not ApiKey.objects.exists()


def test_create_api_key_keeps_each_scope_once(umbrella):
    data = _create_key_json("--scopes", "memory:read,memory:search,memory:read")
    assert data["scopes"] == ["memory:read", "memory:search"]
    assert ApiKey.objects.get().scopes == ["memory:read", "memory:search"]


@pytest.mark.parametrize("days", ["0", "-3"])
def test_create_api_key_with_non_positive_expiry_is_a_command_error(umbrella, days):
    with pytest.raises(CommandError, match="expires_in_days"):
        run("create_api_key", "--tenant", "umbrella", "--name", "x", "--expires-in-days", days)
    assert not ApiKey.objects.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pg-datadir", "/var/lib/postgresql/15/main", "--pg-port", "5432"], "never the shared 5432"),
        (["--pg-port", "6543"], "--pg-datadir"),
        (["--pg-datadir", "/tmp/pg"], "--pg-datadir needs --pg-port"),
        (["--fault-seconds", "20", "--outage-at", "15", "--outage-seconds", "10"], "before the fault phase does"),
    ],
)
def test_bench_load_refuses_the_shared_cluster_and_impossible_timelines_before_touching_anything(args, message):
    # Checked before any cluster is created, stopped or started (no database needed).
    with pytest.raises(CommandError, match=message):
        call_command("bench_load", *args, stdout=StringIO())


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args, named",
    [
        # Before: a ValueError ("Negative indexing is not supported"), or 0 rows reindexed, said as done.
        (["search_reindex", "--batch", "-1"], "--batch must be at least 1"),
        (["search_reindex", "--batch", "0"], "--batch must be at least 1"),
        # Before: nothing purged, reported as a finished purge.
        (["purge_expired", "--max-batches", "0", "--no-progress"], "--max-batches must be at least 1"),
        (["purge_expired", "--max-batches", "-3", "--no-progress"], "--max-batches must be at least 1"),
    ],
)
def test_a_batch_option_below_one_is_a_command_error_naming_it(args, named):
    Tenant.objects.create(slug="reindexed", name="Reindexed")
    events = AuditEvent.objects.count()
    with pytest.raises(CommandError, match=named):
        run(*args)
    assert AuditEvent.objects.count() == events
