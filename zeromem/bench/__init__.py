"""Benchmarks and evaluations: tools that measure the product, not part of it.

The management commands (``bench``, ``bench_load``, ``bench_audit``, ``bench_forget``,
``bench_purge``, ``bench_admin``, ``search_eval``) live in ``management/commands/``; what they
share lives beside them. They call the services and the HTTP API like any other surface, and
nothing in the product imports them (the layer contract in pyproject.toml keeps it so).
"""
