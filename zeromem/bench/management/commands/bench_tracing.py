"""``python manage.py bench_tracing``: what traces cost a tool read, in CPU per call.

Each variant is a process of its own that builds Django's WSGI app as a server process does
(``zeromem.wsgi``: tracing set up when on) and runs ``memory_read`` tool calls through it
with Django's test client (the whole middleware chain, the view, the service and its SQL on
``DATABASE_URL``; no socket):

- ``off``: this checkout, ``ZEROMEM_TRACING`` unset;
- ``on``: this checkout, ``ZEROMEM_TRACING=true``, every span exported over OTLP/HTTP (batches,
  the SDK's schedule) to a sink on loopback that answers 200 (``ZEROMEM_BENCH_PORT``, else any);
- ``sampled`` (with ``--ratio R``): as ``on``, a fraction R of the traces kept
  (``OTEL_TRACES_SAMPLER=parentbased_traceidratio``): what the others cost;
- ``baseline`` (with ``--baseline DIR``): another checkout (e.g. main), as it is.

The variants run in turns (``--rounds`` × ``--calls`` calls each, the order rotated every
round), so a machine whose load drifts weighs on all alike. Per call: the process's CPU (all
threads: the exporter's included) and the calling thread's, median and spread over rounds.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from zeromem.bench.harness import loadavg

WORKER = r"""
import json, os, sys, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "zeromem.settings")
import zeromem.wsgi  # noqa: F401  (the server's entry point: tracing set up when on)
from django.test import Client
from memories import services
from zeromem.kernel.actors import Actor

system = Actor.system(job="bench_tracing")
tenant = services.tenant_create(actor=system, slug=sys.argv[1], name="bench_tracing (throw-away)")
_key, raw = services.api_key_create(tenant=tenant, actor=system, name="bench_tracing")
services.memory_write(tenant=tenant, actor=system, key="user:u1:pref_lang", value="zh-CN")
client = Client(headers={"Authorization": f"Bearer {raw}"})
body = json.dumps({"name": "memory_read", "arguments": {"key": "user:u1:pref_lang"}})

def calls(n):
    for _ in range(n):
        response = client.post("/api/v1/tools/call", body, content_type="application/json")
        assert response.status_code == 200, response.content

calls(50)  # warm-up: the key cache, the pool, the first spans
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    process, thread = time.process_time(), time.thread_time()
    calls(n)
    print(json.dumps({"process": time.process_time() - process, "thread": time.thread_time() - thread}), flush=True)
services.api_key_revoke(tenant=tenant, actor=system, key_id=_key.pk)
"""


class _Sink(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class Command(BaseCommand):
    help = "CPU per memory_read tool call with tracing off, on, and (--baseline) another checkout."

    def add_arguments(self, parser):
        parser.add_argument("--rounds", type=int, default=10, help="turns of each variant (%(default)s)")
        parser.add_argument("--calls", type=int, default=50, help="tool calls per turn (%(default)s)")
        parser.add_argument("--baseline", help="another checkout's root (e.g. main) to run as it is")
        parser.add_argument("--ratio", type=float, help="also run tracing on with this fraction of traces sampled")

    def handle(self, *args, rounds: int, calls: int, baseline: str | None, ratio: float | None, **options):
        sink = ThreadingHTTPServer(("127.0.0.1", int(os.environ.get("ZEROMEM_BENCH_PORT") or 0)), _Sink)
        threading.Thread(target=sink.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{sink.server_address[1]}"
        root = Path(settings.BASE_DIR)
        variants = {
            "off": (root, {}),
            "on": (root, {"ZEROMEM_TRACING": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}),
        }
        if ratio is not None:
            variants["sampled"] = (
                root,
                {
                    **variants["on"][1],
                    "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                    "OTEL_TRACES_SAMPLER_ARG": str(ratio),
                },
            )
        if baseline:
            variants["baseline"] = (Path(baseline).resolve(), {})
        load_before = loadavg()
        with tempfile.TemporaryDirectory() as var:
            workers = {name: self._start(name, where, env, var) for name, (where, env) in variants.items()}
            try:
                samples = {name: {"process": [], "thread": []} for name in workers}
                names = list(workers)
                for r in range(rounds):
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        worker = workers[name]
                        worker.stdin.write(f"{calls}\n")
                        worker.stdin.flush()
                        result = json.loads(worker.stdout.readline())
                        for kind in ("process", "thread"):
                            samples[name][kind].append(result[kind] / calls * 1e6)
            finally:
                for worker in workers.values():
                    worker.stdin.close()
                    worker.wait(timeout=60)
                sink.shutdown()
        report = {
            "rounds": rounds,
            "calls_per_round": calls,
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
            "us_per_call": {
                name: {
                    kind: {
                        "median": round(statistics.median(values), 1),
                        "min": round(min(values), 1),
                        "max": round(max(values), 1),
                    }
                    for kind, values in kinds.items()
                }
                for name, kinds in samples.items()
            },
        }
        median = {name: report["us_per_call"][name]["process"]["median"] for name in samples}
        report["on_minus_off_us"] = round(median["on"] - median["off"], 1)
        if ratio is not None:
            report["sampled_minus_off_us"] = round(median["sampled"] - median["off"], 1)
        if baseline:
            report["off_minus_baseline_us"] = round(median["off"] - median["baseline"], 1)
        self.stdout.write(json.dumps(report, indent=2))

    def _start(self, name: str, where: Path, extra: dict, var: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "ZEROMEM_TRACING"}
        env.update(
            {
                "PYTHONPATH": str(where),
                "ZEROMEM_ENV": "development",
                "DEBUG": "false",  # no per-query bookkeeping (Django's DEBUG) in what is measured
                "ZEROMEM_VAR_DIR": var,
                "ZEROMEM_EMBEDDINGS": "off",
                "LOG_LEVEL": "WARNING",
                **extra,
            }
        )
        slug = f"bench-tracing-{name}-{secrets.token_hex(3)}"
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, slug],
            cwd=where,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = worker.stdout.readline()
        if line.strip() != "ready":
            worker.kill()
            raise RuntimeError(f"bench_tracing: the {name} worker did not start ({line!r})")
        return worker
