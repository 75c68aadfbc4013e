"""A server process's long-lived objects are out of the garbage collector's full passes
(zeromem/kernel/heap.py): a full pass over them held the GIL 85-115 ms and stalled every
request thread of the process."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ENTRY_POINT = """
import gc, json, threading
import {module}
for thread in threading.enumerate():  # the model's background load, which the import started
    if thread.name == "zeromem-embed-load":
        thread.join(timeout=60)
print(json.dumps({{"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}}))
"""

MODEL_LOAD = """
import gc, json, django
django.setup()
before = gc.get_freeze_count()
from memories.search import embeddings
embeddings.encode(["warm up"])
print(json.dumps({"before": before, "after": gc.get_freeze_count()}))
"""


def _run(code: str, *, embeddings: str = "on") -> dict:
    env = {
        **os.environ,
        "ZEROMEM_ENV": "development",
        "ZEROMEM_EMBEDDINGS": embeddings,
        "DJANGO_SETTINGS_MODULE": "zeromem.settings",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_asgi_entry_point_leaves_its_imports_frozen():
    # No model (it freezes too, below): Django, the apps and the MCP SDK are tens of thousands
    # of objects, all frozen by the entry point itself; a full pass walks a small rest.
    seen = _run(ENTRY_POINT.format(module="zeromem.asgi"), embeddings="off")
    assert seen["frozen"] > 50_000
    assert seen["tracked"] < seen["frozen"] // 10


def test_the_wsgi_entry_point_leaves_its_imports_frozen():
    seen = _run(ENTRY_POINT.format(module="zeromem.wsgi"), embeddings="off")
    assert seen["frozen"] > 50_000 and seen["tracked"] < seen["frozen"] // 10


def test_loading_the_embedding_model_freezes_what_the_process_holds():
    seen = _run(MODEL_LOAD)
    assert seen["before"] == 0 and seen["after"] > 50_000
