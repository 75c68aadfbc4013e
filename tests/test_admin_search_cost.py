"""The admin memory list's search on a large tenant: each word is an ILIKE over every key and
value in scope (no index serves it), so its cost grew with the tenant, unbounded. Its
statements now stop after ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS and the page says what narrows it."""

from __future__ import annotations

import html
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from audit.models import AuditEvent
from tests.factories import write

pytest_plugins = ["tests.admin_fixtures"]  # staff users of each role
# A statement_timeout and a generate_series seed: PostgreSQL (SQLite has no statement deadline).
pytestmark = pytest.mark.postgres

ROWS = 40_000
BATCH = 10_000  # modest INSERTs (each ~20 MB of values)


def _seed(tenant, rows: int = ROWS) -> None:
    with connection.cursor() as cursor:
        for start in range(1, rows + 1, BATCH):
            cursor.execute(
                """INSERT INTO memories_memory (tenant_id, key, namespace, value, search_text, category, subject,
                       tags, importance, source, version, created_at, updated_at, access_count, sources, sensitive)
                   SELECT %s, 'user:u' || g || ':notes', 'user:u' || g,
                       jsonb_build_object('text', repeat(md5(g::text) || ' prefers tea ', 40)),
                       '', 'user', 'u' || g, '[]', 5, '', 1, now(), now(), 0, '[]', false
                   FROM generate_series(%s, %s) g""",
                [tenant.pk, start, min(rows, start + BATCH - 1)],
            )
        cursor.execute("ANALYZE memories_memory")


def _slowest_ms(queries) -> float:
    return max(float(q["time"]) for q in queries) * 1000


def test_a_search_over_a_large_tenant_stops_at_its_deadline_and_says_how_to_narrow_it(
    tenant_a, staff_clients, settings
):
    _seed(tenant_a)
    _user, client = staff_clients["viewer"]
    # What the search costs without a deadline (the statements read every key and value).
    settings.ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS = 600_000
    with CaptureQueriesContext(connection) as unbounded:
        response = client.get("/admin/memories/memory/?q=zebra")
    assert response.status_code == 200
    assert _slowest_ms(unbounded.captured_queries) > 60, "the seeded tenant is too small to show the cost"

    settings.ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS = 20
    browsed = AuditEvent.objects.filter(tenant=tenant_a, action="memory.browse").count()
    started = time.perf_counter()
    with CaptureQueriesContext(connection) as bounded:
        response = client.get("/admin/memories/memory/?q=zebra+tea")
    elapsed = time.perf_counter() - started
    body = response.content.decode()
    assert response.status_code == 200
    assert "q: the search read past its 20 ms" in body.lower() and "key prefix" in body  # (capitalised: "Q:")
    assert "user:u1:notes" not in body  # the page lists nothing
    assert _slowest_ms(bounded.captured_queries) < 60, bounded.captured_queries
    assert elapsed < 2.0
    # The search was still recorded (it ran, in part) and the request's later statements ran.
    assert AuditEvent.objects.filter(tenant=tenant_a, action="memory.browse").count() == browsed + 1
    with connection.cursor() as cursor:
        cursor.execute("SHOW statement_timeout")
        assert cursor.fetchone()[0] == "0"  # the deadline did not outlive the search


def test_a_narrowed_search_finds_its_memory_under_the_deadline(tenant_a, staff_clients, settings):
    _seed(tenant_a, rows=BATCH)
    write(tenant_a, "user:u77777:pref_lang", "zebra stripes", subject="u77777")
    settings.ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS = 1000
    _user, client = staff_clients["viewer"]
    body = client.get("/admin/memories/memory/?subject=u77777&q=zebra").content.decode()
    assert "user:u77777:pref_lang" in body and "the search read past" not in body
    body = client.get("/admin/memories/memory/?q=zebra").content.decode()
    assert "user:u77777:pref_lang" in body  # a small enough search still finds it unnarrowed


def test_a_search_counts_at_most_a_thousand_matches(tenant_a, staff_clients, settings):
    """The count of a common word read 10,000 matching keys and values (1.4 s at 100k
    memories of 1.7 KB); a search's pages count at most 1,000 (20 pages of 50)."""
    _seed(tenant_a, rows=1_500)
    _user, client = staff_clients["viewer"]
    with CaptureQueriesContext(connection) as queries:
        body = client.get("/admin/memories/memory/?q=tea").content.decode()
    counts = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT COUNT(*)")]
    assert counts and all("LIMIT 1000" in sql for sql in counts), counts
    assert "1000 memories" in body  # (the cap, not the 1,500 that match)
    assert "p=20" in body and "p=21" not in body
    # Without a search the list keeps its 10,000 cap.
    with CaptureQueriesContext(connection) as queries:
        client.get("/admin/memories/memory/")
    assert any("LIMIT 10000" in q["sql"] for q in queries.captured_queries)


def test_a_tag_filter_over_a_large_tenant_stops_at_the_deadline_too(tenant_a, staff_clients, settings):
    """A tag no memory carries walked every memory's tags in key order, with no deadline (the
    REST list's tag pages have one)."""
    _seed(tenant_a, rows=BATCH)
    _user, client = staff_clients["viewer"]
    settings.ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS = 1
    with CaptureQueriesContext(connection) as queries:
        body = client.get("/admin/memories/memory/?tag=nobody-has-it").content.decode()
    assert "tag: the search read past its 1 ms" in body.lower(), "no deadline on the tag filter"
    assert _slowest_ms(queries.captured_queries) < 60
    settings.ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS = 10_000
    body = client.get("/admin/memories/memory/?tag=nobody-has-it").content.decode()
    assert "the search read past" not in body and "0 memories" in body


def test_a_select_all_action_on_a_searched_list_stops_at_the_search_deadline(
    tenant_a, staff_clients, settings, monkeypatch
):
    """Select all N and an action on a searched (or tag-filtered) list ran the search again
    to pick the action's memories, with no deadline: the list's own page stopped at
    ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS, the action's query read every key and value in scope.
    Now the action's query stops at the same deadline, and then the action changes nothing."""
    from memories.models import Memory
    from zeromem.kit import admin as kit_admin

    monkeypatch.setattr(kit_admin, "ACTION_MAX", 3)  # (each memory is one service call)
    _seed(tenant_a, rows=BATCH)
    # The one match, last in key order: the action's query reads every memory before it.
    last = write(tenant_a, "user:zzzz:last", "zebra crossing", tags=["rare"])
    _user, client = staff_clients["support"]

    def run(query: str) -> str:
        data = {"action": "move_to_trash", "select_across": "1", "index": "0", "_selected_action": ["1"]}
        response = client.post(f"/admin/memories/memory/?{query}", data, follow=True)
        assert response.status_code == 200
        return html.unescape(response.content.decode())

    settings.ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS = 1
    for query, field in (("q=zebra", "q"), ("tag=rare", "tag")):
        with CaptureQueriesContext(connection) as queries:
            body = run(query)
        assert f"{field}: the action's search read past its 1 ms" in body.lower(), (query, body[-3000:])
        assert "nothing was changed" in body.lower()
        assert _slowest_ms(queries.captured_queries) < 60, query
        assert not Memory.objects.filter(pk=last.pk, deleted_at__isnull=False).exists(), query
        with connection.cursor() as cursor:
            cursor.execute("SHOW statement_timeout")
            assert cursor.fetchone()[0] == "0"
    # Under the deadline the action runs as before: at most ACTION_MAX per run.
    settings.ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS = 10_000
    body = run("q=zebra")
    assert "1 memories moved to the trash" in body and "read past" not in body
    assert Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=False).get().pk == last.pk
    body = run("q=tea")
    assert "at most 3 per run" in body and "3 memories moved to the trash" in body
