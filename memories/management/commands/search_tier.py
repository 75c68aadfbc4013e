"""``python manage.py search_tier --socket PATH``: one search process of the search tier
(memories/search/tier.py, README "Search tier"). ``python3 -m zeromem serve`` starts these
beside the web processes and restarts one that exits; run by hand only to debug."""

from __future__ import annotations

import os

from django.core.management.base import BaseCommand

from memories.search import tier
from memories.search.embeddings import warm_up


class Command(BaseCommand):
    help = "Rank searches for the web processes on a Unix socket (the search tier)."

    def add_arguments(self, parser):
        parser.add_argument("--socket", required=True, help="the Unix socket to listen on")
        parser.add_argument(
            "--nice",
            type=int,
            default=0,
            help="lower this process's CPU priority by this much (serve: ZEROMEM_SEARCH_TIER_NICE)",
        )

    def handle(self, *args, socket: str, nice: int, **options):
        if nice > 0:
            os.nice(nice)
        warm_up()  # the model loads in the background; searches meanwhile rank on words alone
        self.stdout.write(f"search tier: ranking on {socket}")
        self.stdout.flush()
        try:
            tier.serve(socket)
        except KeyboardInterrupt:  # Ctrl-C reaches the whole terminal's process group
            pass
