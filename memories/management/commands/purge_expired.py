"""``python manage.py purge_expired``: the scheduled purge, run by hand.

A progress bar goes to stderr (so ``--json`` output on stdout stays clean for scripts),
the summary to stdout. Safe to run while the workers run the same job (see
``memories.services.retention.purge_expired``).
"""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from memories.services import retention
from zeromem.kernel.errors import ServiceError

BAR_WIDTH = 30


class ProgressBar:
    """``[#####.....]  512/1000  51%`` redrawn in place; only when the text changes."""

    def __init__(self, out, total: int):
        self.out = out
        self.total = total
        self.last = ""

    def __call__(self, done: int) -> None:
        total = max(self.total, done)  # rows that expired while counting still get erased
        filled = BAR_WIDTH * done // total if total else BAR_WIDTH
        percent = 100 * done // total if total else 100
        text = f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} {percent:3d}%"
        if text != self.last:
            self.out.write(text, style_func=str, ending="")
            self.out.flush()
            self.last = text

    def finish(self) -> None:
        if self.last:
            self.out.write("", style_func=str)


class Command(BaseCommand):
    help = "Erase expired memories and trash past its retention, with their versions (idempotent)."

    def add_arguments(self, parser):
        parser.add_argument(
            "--batch-size",
            type=int,
            default=retention.DEFAULT_BATCH_SIZE,
            help=f"memories per transaction (default {retention.DEFAULT_BATCH_SIZE})",
        )
        parser.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
        parser.add_argument("--json", dest="as_json", action="store_true", help="print the summary as one JSON object")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    def handle(self, *args, batch_size, max_batches, as_json: bool, no_progress: bool, **options):
        if batch_size < 1:
            raise CommandError("--batch-size must be at least 1")
        if max_batches is not None and max_batches < 1:
            raise CommandError(f"--max-batches must be at least 1, not {max_batches}")
        bar = None
        if not no_progress:
            pending = retention.purge_pending()
            bar = ProgressBar(self.stderr, pending["expired"] + pending["trash"])
            bar(0)
        try:
            result = retention.purge_expired(batch_size=batch_size, max_batches=max_batches, progress=bar)
        except ServiceError as exc:
            raise CommandError(exc.message) from exc
        finally:
            if bar is not None:
                bar.finish()
        if as_json:
            self.stdout.write(json.dumps(result, sort_keys=True))
            return
        erased = result["expired"] + result["trash"]
        rate = erased / result["seconds"] if result["seconds"] else 0
        self.stdout.write(
            f"Purged {result['expired']} expired and {result['trash']} trashed memories "
            f"({result['versions']} versions) in {result['batches']} batches, "
            f"{result['seconds']:.2f} s ({rate:,.0f} memories/s)."
        )
