"""The argument set the benchmark commands share, and the command they all derive from.

A command names the shared options it takes (``shared_options``), with its own default where
it differs (``option_defaults``), and adds only what is its own in ``add_bench_arguments``.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from zeromem.serving import DEFAULT_THREADS, default_processes


def _flag(flag: str, **spec) -> Callable[[ArgumentParser, Any], None]:
    def add(parser: ArgumentParser, default: Any) -> None:
        parser.add_argument(flag, **{**spec, **({} if default is None else {"default": default})})

    return add


OPTIONS: dict[str, Callable[[ArgumentParser, Any], None]] = {
    "json": _flag("--json", action="store_true", help="print one JSON object instead of the table"),
    "seed": _flag("--seed", type=int, default=1, help="seed of the shuffles and random picks (%(default)s)"),
    "n": _flag("--n", type=int, default=2000, help="latency samples per operation (%(default)s)"),
    "keys": _flag("--keys", type=int, default=100, help="seeded keys the requests go to (%(default)s)"),
    # The serving model of `python3 -m zeromem serve` (zeromem/serving.py): its defaults.
    "processes": _flag(
        "--processes", type=int, default=default_processes(), help="server processes (the cores: %(default)s)"
    ),
    "threads": _flag("--threads", type=int, default=DEFAULT_THREADS, help="request threads per process (%(default)s)"),
    # The same option under two names: `bench` has always called its clients a concurrency.
    "clients": _flag("--clients", type=int, default=16, help="concurrent keep-alive clients (%(default)s)"),
    "concurrency": _flag("--concurrency", type=int, default=16, help="concurrent keep-alive clients (%(default)s)"),
    "max_seconds": _flag(
        "--max-seconds", type=float, default=600.0, help="time cap of each timed phase, s (%(default)s)"
    ),
}


class BenchCommand(BaseCommand):
    """A benchmark or an evaluation: the shared options, progress on stderr when stdout carries
    JSON, and the result as one JSON object (``--json``) or as the command's table."""

    shared_options: tuple[str, ...] = ()
    option_defaults: dict[str, Any] = {}
    json_dumps_options: dict[str, Any] = {"default": str}
    # What require_postgresql() says on another database: what is measured is PostgreSQL's.
    postgresql_needed: str = ""

    def add_arguments(self, parser):
        for name in self.shared_options:
            OPTIONS[name](parser, self.option_defaults.get(name))
        self.add_bench_arguments(parser)

    def add_bench_arguments(self, parser):
        """The options of this command alone."""

    def execute(self, *args, **options):
        self.json_output = bool(options.get("json"))
        return super().execute(*args, **options)

    def require_postgresql(self) -> None:
        if connection.vendor != "postgresql":
            raise CommandError(self.postgresql_needed)

    def log(self, message: str) -> None:
        """Progress: on stdout before a table, on stderr when stdout carries JSON."""
        (self.stderr if self.json_output else self.stdout).write(message)

    def emit(self, result: dict) -> None:
        if self.json_output:
            self.stdout.write(json.dumps(result, **self.json_dumps_options))
        else:
            self.print_table(result)

    def print_table(self, result: dict) -> None:
        raise NotImplementedError
