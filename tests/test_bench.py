"""The benchmarks' app: where the commands live, the options they share, the harness's figures.

The benchmarks themselves run against a server and PostgreSQL (``manage.py bench`` …); these
tests check only what must not drift when the shared code changes, and need no database.
"""

import math

import pytest
from django.core.management import get_commands, load_command_class

from zeromem.bench.harness import Samples, nearest_rank, percentile, ratio
from zeromem.serving import DEFAULT_THREADS, default_processes

BENCHMARKS = (
    "bench",
    "bench_serve",
    "bench_scale",
    "bench_load",
    "bench_audit",
    "bench_crypto",
    "bench_forget",
    "bench_purge",
    "bench_admin",
    "bench_dashboard",
    "bench_purge_fk",
    "search_eval",
    "bench_search",
    "bench_tokens",
    "bench_fold",
    "bench_stats",
)


def defaults(name: str) -> dict:
    command = load_command_class(get_commands()[name], name)
    return vars(command.create_parser("manage.py", name).parse_args([]))


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_commands_keep_their_names_in_the_bench_app(name):
    assert get_commands()[name] == "zeromem.bench"


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "bench",
            {
                "n": 2000,
                "concurrency": 16,
                "processes": default_processes(),
                "threads": DEFAULT_THREADS,
                "keys": 100,
                "max_seconds": 600.0,
                "seed": 1,
                "json": False,
            },
        ),
        (
            "bench_load",
            {"clients": 16, "processes": default_processes(), "threads": 8, "keys": 200, "seed": 1, "json": False},
        ),
        (
            "bench_serve",
            {"clients": 16, "processes": default_processes(), "threads": 8, "seconds": 5.0, "slow": 4, "json": False},
        ),
        ("bench_scale", {"clients": 16, "threads": 8, "seconds": 5.0, "keys": 100, "json": False}),
        ("bench_audit", {"n": 2000, "json": False}),
        ("bench_crypto", {"n": 1000, "keys": 50, "max_seconds": 300.0, "json": False}),
        ("bench_forget", {"json": False, "batch_size": 0}),
        ("bench_purge", {"max_seconds": 120.0, "rounds": 3}),
        ("bench_admin", {"events": 1_000_000, "repeat": 5}),
        ("search_eval", {"json": False, "k": "1,5,10"}),
        ("bench_tokens", {"n": 500, "memories": 200, "reads": 2000, "json": False}),
        (
            "bench_search",
            {"sizes": "10000,100000,1000000", "others": 100000, "n": 200, "parallel": 20, "json": False},
        ),
    ],
)
def test_shared_options_keep_each_commands_own_defaults(name, expected):
    got = defaults(name)
    assert {key: got[key] for key in expected} == expected


def test_percentiles_are_nearest_rank_in_milliseconds():
    ns = [1_000_000, 2_000_000, 3_000_000, 4_000_000]
    assert (nearest_rank(ns, 0.5), percentile(ns, 0.5), percentile(ns, 0.99)) == (2_000_000, 2.0, 4.0)
    assert math.isnan(percentile([], 0.5))
    summary = Samples("read", "a read", ns=[3_000_000, 1_000_000]).summary()
    assert list(summary) == ["what", "n", "errors", "p50_ms", "p95_ms", "p99_ms", "mean_ms", "max_ms"]
    assert (summary["p50_ms"], summary["max_ms"], summary["mean_ms"]) == (1.0, 3.0, 2.0)


def test_ratio_is_none_when_a_side_is_missing():
    assert (ratio(3.0, 2.0), ratio(None, 2.0), ratio(1.0, 0), ratio(float("nan"), 1.0)) == (1.5, None, None, None)


@pytest.mark.postgres
@pytest.mark.django_db
def test_the_benchmarks_raw_inserts_name_every_required_column():
    """The benchmarks seed with raw SQL (INSERT … SELECT, COPY) for speed, so a NOT NULL column
    added to a model without a database default breaks them silently (it did: `sensitive`).
    Every required column of the tables they write must be in each statement's column list."""
    import re
    from pathlib import Path

    from django.db import connection

    import zeromem.bench.management.commands as commands

    statement = re.compile(r"(?:INSERT INTO|COPY)\s+(memories_memory|memories_memoryversion)\s*\(([^)]*)\)", re.S)
    required = {}
    with connection.cursor() as cursor:
        for table in ("memories_memory", "memories_memoryversion"):
            cursor.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = %s "
                "AND is_nullable = 'NO' AND column_default IS NULL AND is_identity = 'NO' AND column_name <> 'id'",
                [table],
            )
            required[table] = {name for (name,) in cursor.fetchall()}
    found = 0
    for path in sorted(Path(commands.__file__).parent.glob("*.py")):
        source = re.sub(r'"\s*\n\s*"', "", path.read_text())  # join implicitly concatenated strings
        for table, columns in statement.findall(source):
            found += 1
            named = {c.strip() for c in columns.replace('"', "").split(",")}
            assert required[table] <= named, f"{path.name}: {table} lacks {sorted(required[table] - named)}"
    assert found >= 7  # bench_purge, bench_purge_fk, bench_admin, bench_dashboard, bench_search
