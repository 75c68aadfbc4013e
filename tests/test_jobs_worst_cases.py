"""Worst cases of the background work, found by an outside review (rv4): what a tenant's data
or an LLM endpoint's answer can make a worker hold, and what overlapping schedule runs do.

Against the real database; only the outside world (the LLM endpoint) is faked.
"""

from __future__ import annotations

import json
import tracemalloc

import pytest

from memories.models import Memory
from memories.services import summaries
from tests.factories import make_tenant


def _bulk(tenant, prefix: str, n: int, value) -> None:
    # One row per INSERT: PostgreSQL parses each jsonb value in the statement's memory.
    Memory.objects.bulk_create(
        [
            Memory(tenant=tenant, key=f"{prefix}k{i:04d}", namespace=prefix.rstrip(":"), value=value, version=1)
            for i in range(n)
        ],
        batch_size=1,
    )


@pytest.mark.django_db
def test_a_digest_reads_only_the_values_it_needs_not_a_page_of_401_whole_values(settings):
    """The digest keeps ZEROMEM_SUMMARY_MAX_CHARS (2000) characters, but read the first
    max_chars // 5 + 1 = 401 memories under the prefix whole, values and all, before looking
    at one: 401 values of 16 KiB (the default value limit) of "[{},{},...]" held 168 MB of
    Python objects in the worker (2.3 s) for a digest of one line; at the hard cap (256 KiB,
    a tenant's limit raised) ~2.7 GB, every attempt, on every worker taking such a job."""
    tenant = make_tenant("digest-mem")
    value = [{}] * ((settings.ZEROMEM_VALUE_MAX_BYTES - 10) // 3)  # "[{},{},...]" under 16 KiB
    assert len(json.dumps(value, separators=(",", ":"))) <= settings.ZEROMEM_VALUE_MAX_BYTES
    _bulk(tenant, "session:s1:", 401, value)

    tracemalloc.start()
    try:
        digest = summaries._digest(tenant=tenant, prefix="session:s1:", max_chars=settings.ZEROMEM_SUMMARY_MAX_CHARS)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert len(digest.sources) == 1 and digest.left_out == 400
    assert len(digest.text) <= settings.ZEROMEM_SUMMARY_MAX_CHARS
    print(f"digest peak {peak / 1e6:.1f} MB")
    assert peak < 12 * 1024 * 1024, f"{peak / 1e6:.1f} MB"


@pytest.mark.django_db
def test_a_digest_of_many_small_values_still_reads_every_line_it_keeps(settings):
    """Reading in small groups changes nothing of what the digest holds: 500 short values,
    as many lines as fit, the rest counted."""
    tenant = make_tenant("digest-small")
    _bulk(tenant, "session:s2:", 500, "v")
    digest = summaries._digest(tenant=tenant, prefix="session:s2:", max_chars=2000)
    lines = digest.text.split("\n")
    assert lines[-1] == f"(+{digest.left_out} more not shown)"
    assert len(lines) - 1 == len(digest.sources) > 100
    assert len(digest.sources) + digest.left_out == 500
    assert [m.key for m in digest.sources] == sorted(m.key for m in digest.sources)[::-1]  # newest (last id) first
