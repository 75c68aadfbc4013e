"""What a database dump holds (README "Encryption at rest"), with the real ``pg_dump``.

* A dump of a database holding sensitive canary values contains none of them in plaintext.
* A dump taken before a subject is forgotten, restored after the forget into a fresh
  database with the same master keys and the (separate) key store, yields none of that
  subject's sensitive values; another subject's still read.

PostgreSQL only; the second test runs ZeroMem as separate processes against its own
databases (zm_crypto_bk_*), as an operator restoring a backup would.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import subprocess
import sys

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from memories import services
from tests.factories import SYSTEM, make_tenant, summarize, write

pytestmark = [
    pytest.mark.skipif(connection.vendor != "postgresql", reason="pg_dump: PostgreSQL only"),
    pytest.mark.skipif(shutil.which("pg_dump") is None, reason="no pg_dump binary"),
]

CANARIES = ["CANARY-VALUE-4f1a", "CANARY-HISTORY-9b2c", "CANARY-EMAIL-77d0", "CANARY-NOSUBJECT-31e5"]
PLAIN = "PLAIN-CANARY-0c0c"


def _conninfo(name: str) -> str:
    db = settings.DATABASES["default"]
    return f"postgresql://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{name}"


def _pg_env() -> dict:
    db = settings.DATABASES["default"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PGUSER": db["USER"] or "postgres"}
    env["PGHOST"], env["PGPORT"] = db["HOST"] or "127.0.0.1", str(db["PORT"] or 5432)
    if db.get("PASSWORD"):
        env["PGPASSWORD"] = db["PASSWORD"]
    return env


def _dump(name: str, *args: str) -> bytes:
    done = subprocess.run(["pg_dump", *args, name], env=_pg_env(), capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.django_db(transaction=True)
def test_a_dump_holds_no_sensitive_value_in_plaintext(django_capture_on_commit_callbacks):
    tenant = make_tenant("dumped")
    write(tenant, "user:u1:phone", CANARIES[1], sensitive=True)
    write(tenant, "user:u1:phone", CANARIES[0])  # the old value lives on as a version
    tenant.sensitive_fields = ["email"]
    tenant.save()
    write(tenant, "user:u2:contact", {"email": CANARIES[2]})
    write(tenant, "team:vault", CANARIES[3], sensitive=True)  # the tenant's own key
    write(tenant, "user:u1:lang", PLAIN)
    summarize(tenant, "user:u1:", django_capture_on_commit_callbacks)  # made from a sensitive memory
    dump = _dump(connection.settings_dict["NAME"])
    assert PLAIN.encode() in dump  # the scan sees what is there
    for canary in CANARIES:
        assert canary.encode() not in dump, canary
    # Wrapped data keys, no raw one: the dump never holds what decrypts without the master key.
    assert b"memories_datakey" in dump
    assert services.memory_read(tenant=tenant, actor=SYSTEM, key="user:u1:phone").memory.value == CANARIES[0]


SETUP = """
from memories import services
from zeromem.kernel.actors import Actor
a = Actor.system(job="backup-test")
t = services.tenant_create(actor=a, slug="restored", name="Restored")
for user in ("u1", "u2"):
    services.memory_write(tenant=t, actor=a, key=f"user:{user}:phone", value=f"CANARY-{user}-phone-v1", sensitive=True)
    services.memory_write(tenant=t, actor=a, key=f"user:{user}:phone", value=f"CANARY-{user}-phone-v2")
    services.memory_write(tenant=t, actor=a, key=f"user:{user}:note", value=f"CANARY-{user}-note", sensitive=True)
"""

FORGET = """
from memories import services
from memories.models import Tenant
from zeromem.kernel.actors import Actor
a = Actor.system(job="backup-test")
t = Tenant.objects.get(slug="restored")
r = services.forget_request_create(tenant=t, actor=a, subject="u1")
print(json.dumps(services.forget_request_execute(request_id=r.pk)["receipt"]))
"""

READ_BACK = """
from memories.models import Memory, MemoryVersion
from zeromem.kernel.crypto import ErasedValue
out = {}
for m in Memory.objects.order_by("key"):
    out[m.key] = "ERASED" if isinstance(m.value, ErasedValue) else m.value
for v in MemoryVersion.objects.select_related("memory").order_by("memory__key", "version"):
    out[f"{v.memory.key}@{v.version}"] = "ERASED" if isinstance(v.value, ErasedValue) else v.value
print(json.dumps(out))
"""


def test_a_backup_from_before_a_forget_restored_after_it_yields_none_of_the_subject(tmp_path):
    names = {role: f"zm_crypto_bk_{role}_{secrets.token_hex(3)}" for role in ("main", "keys", "restored")}
    schema = _dump(connection.settings_dict["NAME"], "--schema-only", "--no-owner")
    admin = psycopg.connect(_conninfo("postgres"), autocommit=True)
    try:
        for name in names.values():
            admin.execute(f'CREATE DATABASE "{name}"')
        for role in ("main", "keys"):
            # The test database's schema: the main database, and a key store of its own.
            done = subprocess.run(
                ["psql", "-q", "-v", "ON_ERROR_STOP=1", "-d", names[role]],
                input=schema,
                env=_pg_env(),
                capture_output=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "ZEROMEM_ENV": "development",
            "ZEROMEM_EMBEDDINGS": "off",
            "DATABASE_URL": _conninfo(names["main"]),
            "ZEROMEM_KEYSTORE_URL": _conninfo(names["keys"]),
            "ZEROMEM_MASTER_KEYS": base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),
            "ZEROMEM_VAR_DIR": str(tmp_path),
        }

        def run(script: str, database: str) -> str:
            done = subprocess.run(
                [sys.executable, "manage.py", "shell", "-c", "import json\n" + script],
                cwd=settings.BASE_DIR,
                env={**env, "DATABASE_URL": _conninfo(database)},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr
            return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""

        run(SETUP, names["main"])
        backup = tmp_path / "before-forget.dump"
        backup.write_bytes(_dump(names["main"], "-Fc"))
        assert b"CANARY-" not in _dump(names["main"])  # the plain-SQL dump holds no canary either
        receipt = json.loads(run(FORGET, names["main"]))
        assert receipt["data_keys_destroyed"] == 1 and receipt["crypto_shredded"] is True
        done = subprocess.run(
            ["pg_restore", "--no-owner", "-d", names["restored"], str(backup)],
            env=_pg_env(),
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr

        restored = json.loads(run(READ_BACK, names["restored"]))
        u1 = {k: v for k, v in restored.items() if k.startswith("user:u1:")}
        u2 = {k: v for k, v in restored.items() if k.startswith("user:u2:")}
        # The backup still holds u1's rows — and nothing of them opens.
        assert set(u1) == {"user:u1:note", "user:u1:note@1", "user:u1:phone", "user:u1:phone@1", "user:u1:phone@2"}
        assert set(u1.values()) == {"ERASED"}
        assert u2 == {
            "user:u2:note": "CANARY-u2-note",
            "user:u2:note@1": "CANARY-u2-note",
            "user:u2:phone": "CANARY-u2-phone-v2",
            "user:u2:phone@1": "CANARY-u2-phone-v1",
            "user:u2:phone@2": "CANARY-u2-phone-v2",
        }
    finally:
        for name in names.values():
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.mark.django_db(transaction=True)
def test_crypto_reencrypt_killed_with_sigkill_midway_completes_on_rerun(tmp_path):
    """The real command in its own process, SIGKILLed after its first batch committed."""
    import signal

    from memories import keyring
    from memories.models import DataKey, Memory

    tenant = make_tenant("rekeyed")
    for i in range(12):
        write(tenant, f"user:u{i % 3}:n{i}", f"CANARY-rekey-{i}", sensitive=True)
    old_keys = set(DataKey.objects.values_list("pk", flat=True))
    keyring.retire_current()
    db = connection.settings_dict
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "ZEROMEM_ENV": "development",
        "ZEROMEM_EMBEDDINGS": "off",
        "DATABASE_URL": _conninfo(db["NAME"]),
        "ZEROMEM_MASTER_KEYS": ",".join(settings.ZEROMEM_MASTER_KEYS),
        "ZEROMEM_VAR_DIR": str(tmp_path),
    }
    command = [sys.executable, "manage.py", "crypto_reencrypt", "--batch", "2"]
    process = subprocess.Popen(
        [*command, "--pause", "5"], cwd=settings.BASE_DIR, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        first = process.stdout.readline()
        assert first.startswith("batch 1:"), first
        process.send_signal(signal.SIGKILL)  # in its pause after batch 1, or inside batch 2
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        process.stdout.close()

    def under_old_key() -> int:
        return sum(1 for m in Memory.objects.filter(tenant=tenant) if _envelope_key(m) in old_keys)

    left = under_old_key()
    assert 0 < left < 12  # killed mid-way: some moved, some not
    done = subprocess.run(command, cwd=settings.BASE_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"re-encrypted {left} memories" in done.stdout.splitlines()[-1]
    assert under_old_key() == 0
    keyring.forget_cache()
    for i in range(12):
        key = f"user:u{i % 3}:n{i}"
        assert services.memory_read(tenant=tenant, actor=SYSTEM, key=key).memory.value == f"CANARY-rekey-{i}"


def _envelope_key(memory) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT value FROM memories_memory WHERE id = %s", [memory.pk])
        value = cursor.fetchone()[0]
    return int((json.loads(value) if isinstance(value, str) else value)["k"])
