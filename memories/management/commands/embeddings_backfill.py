"""Embed memories for semantic search now, instead of waiting for the schedule.

    python manage.py embeddings_backfill [--full] [--batch-size 32] [--json]

Without ``--full`` it does what the ``zeromem:embed-memories`` schedule does (memories written
since the newest embedded one, minus a margin); ``--full`` checks every live memory — after
upgrading, after switching ``ZEROMEM_EMBEDDINGS`` back on, or to catch a memory whose
transaction committed long after it was written. Idempotent; safe beside running workers.
"""

import json as jsonlib

from django.core.management.base import BaseCommand, CommandError

from memories.search import embeddings


class Command(BaseCommand):
    help = "Compute the embeddings semantic search needs (memories/embeddings.py)."

    def add_arguments(self, parser):
        parser.add_argument("--full", action="store_true", help="check every live memory, not only recent writes")
        parser.add_argument("--batch-size", type=int, default=embeddings.BATCH_SIZE)
        parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")

    def handle(self, *args, full, batch_size, json: bool = False, **options):
        if batch_size < 1:
            raise CommandError("--batch-size must be at least 1")
        try:
            embeddings.encode(["warm up"])  # fail here, clearly, when the model cannot load
        except embeddings.EncoderUnavailable as exc:
            raise CommandError(str(exc)) from None
        result = embeddings.embeddings_refresh(full=full, batch_size=batch_size, time_budget=float("inf"))
        if json:
            self.stdout.write(jsonlib.dumps(result))
        else:
            self.stdout.write(
                f"embedded {result['embedded']}, unchanged {result['unchanged']} "
                f"in {result['batches']} batches, {result['seconds']} s"
            )
