"""The server process's long-lived objects, kept out of the garbage collector's full passes.

A full (generation 2) collection walks every container object the process holds, and it
holds the GIL while it does: with Django, the apps, the MCP SDK and the embedding model
loaded, one pass took **85–115 ms** here (156k tracked objects; a 128k-element list among
them), and every request thread of that process would stall behind it (not shown to be the
cause, but the size of the one 188-ms answer a one-CJK-character search got at 1M in
``bench_search``, whose other answers took 8–20 ms). Those objects live as
long as the process: :func:`freeze_long_lived` moves everything alive now into the permanent
generation (``gc.freeze()``), after which a full pass took 0.05 ms. Objects made later
(requests, caches) are collected as before. Called once the app is imported and once the
embedding model has loaded (zeromem/asgi.py, zeromem/wsgi.py, memories/search/embeddings.py).
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> None:
    """Move every object tracked now into the permanent generation. Garbage left by imports
    is collected first (young generations only: a full pass is what this avoids paying
    again), so that little of it is frozen for good."""
    gc.collect(1)
    gc.freeze()
