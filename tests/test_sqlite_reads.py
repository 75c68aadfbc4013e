"""SQLite (the embedded default): reads, lists and searches take no write lock, and their
audit events are still written before they answer (audit.services.audited_operation with
atomic=False; the search's deadline opens no transaction there).

Runs in a child process on a file database of its own: the test database is in memory,
where another connection cannot reach it and WAL does not apply."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import json, os, sqlite3, time
import django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "zeromem.settings")
django.setup()
from django.conf import settings
from django.core.management import call_command
from django.db import transaction
call_command("migrate", verbosity=0)
from audit.models import AuditEvent
from memories import services
from memories.search import ranking
from zeromem.kernel.actors import Actor

actor = Actor.system(job="sqlite-reads")
tenant = services.tenant_create(actor=actor, slug="t", name="t")
services.memory_write(tenant=tenant, actor=actor, key="fact:a", value="zebra orchid")
database = str(settings.DATABASES["default"]["NAME"])
observed = {}


def another_request_writes(label):
    # What another request does meanwhile: take the write lock, write, commit.
    other = sqlite3.connect(database, timeout=0.5, isolation_level=None)
    started = time.monotonic()
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("UPDATE memories_tenant SET name = ? WHERE id = ?", (label, tenant.pk))
        other.execute("COMMIT")
        observed[label] = "ok"
    except sqlite3.OperationalError as exc:
        observed[label] = str(exc)
    observed[label + "_s"] = round(time.monotonic() - started, 3)
    other.close()


real = ranking._candidate_lists


def slow_ranker(**kw):
    another_request_writes("during_search")
    return real(**kw)


ranking._candidate_lists = slow_ranker
observed["results"] = [h.memory.key for h in services.memory_search(tenant=tenant, actor=actor, query="zebra")]
observed["audited"] = AuditEvent.objects.filter(action="memory.search", outcome="ok").count()
services.memory_read(tenant=tenant, actor=actor, key="fact:a")
observed["read_audited"] = AuditEvent.objects.filter(action="memory.read", outcome="ok").count()
# The control: inside an ordinary (IMMEDIATE) transaction the same write has to wait.
with transaction.atomic():
    another_request_writes("during_immediate")
print(json.dumps(observed))
"""


def test_a_search_on_sqlite_blocks_no_writer_and_is_still_audited(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(ZEROMEM_ENV="development", ZEROMEM_VAR_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    observed = json.loads(done.stdout.strip().splitlines()[-1])
    # Another request wrote and committed while the search was reading...
    assert observed["during_search"] == "ok" and observed["during_search_s"] < 0.25
    # ...and the search still answered, with its event written after its read.
    assert observed["results"] == ["fact:a"] and observed["audited"] == 1
    assert observed["read_audited"] == 1
    # Under the write lock an ordinary transaction holds, the same write waits and gives up.
    assert observed["during_immediate"] == "database is locked"
