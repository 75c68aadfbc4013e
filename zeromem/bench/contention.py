"""One tenant's load against another tenant's reads, with each side a client of its own.

In production the reader and the tenant that floods the server with searches are different
clients on different machines. A benchmark that runs them as threads of one Python process
measures its own GIL too: the reader's thread waits for the 20 attacking threads' JSON and
socket work before it can even read its response. So each side here is a **process of its
own** (``multiprocessing``, spawn: no state inherited from the Django command):

* :func:`reader` — one keep-alive connection reading one memory in a loop until told to stop;
* :func:`searchers` — ``clients`` threads sending searches back to back (a well-behaved client
  waits a 429's or 503's Retry-After);
* :func:`cpu_hog` — a process spinning on one core that has nothing to do with ZeroMem: the
  machine's floor for "another tenant uses a core" (the reader's p99 cannot beat it).

``threads`` mode runs the reader and the searchers as threads of the calling process, the way
the benchmark measured before: kept to show the difference once.

Standard library only (and the harness): a spawned child imports this and nothing of Django.
"""

from __future__ import annotations

import multiprocessing
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from zeromem.bench.harness import HttpClient, Samples, client_loop, percentile

TOOL_CALL = "/api/v1/tools/call"
# Reads that started this many seconds into a phase make its "steady" p99.
STEADY_AFTER = 2.0


@dataclass
class Attack:
    """``clients`` clients of one key sending ``bodies`` (picked at random) for ``seconds``."""

    api_key: str
    bodies: list[bytes]
    clients: int
    seconds: float
    honour_retry_after: bool = True
    seed: int = 1


@dataclass
class Outcome:
    """What one phase measured: the reader's samples and what the searchers got."""

    reads: Samples
    statuses: dict[int, int] = field(default_factory=dict)
    search_ns: list[int] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)  # when each read started, s into the phase

    def summary(self) -> dict:
        s = sorted(self.search_ns)
        later = sorted(ns for ns, at in zip(self.reads.ns, self.starts, strict=False) if at >= STEADY_AFTER)
        return {
            "reads": self.reads.summary(),
            # The reads once a burst allowance spent at the start is behind (diagnostic).
            "steady_p99_ms": round(percentile(later, 0.99), 2) if later else None,
            "read_errors": self.reads.errors,
            "searches": dict(sorted(self.statuses.items())),
            "search_p50_ms": round(s[len(s) // 2] / 1e6, 2) if s else None,
        }


# --- the sides, each runnable in a process of its own -------------------------------------


def reader(port: int, api_key: str, body: bytes, ready, go, stop, conn) -> None:
    """Read in a loop between ``go`` and ``stop``; send (latencies ns, errors) on ``conn``."""
    client = HttpClient(port, api_key, timeout=30)
    for _ in range(20):  # warm: the connection, the key cache
        client.request("POST", TOOL_CALL, body)
    ready.set()
    go.wait(60)
    ns: list[int] = []
    starts: list[float] = []
    errors = 0
    t0 = time.monotonic()
    while not stop.is_set():
        starts.append(time.monotonic() - t0)
        elapsed, status, _b = client.request("POST", TOOL_CALL, body)
        ns.append(elapsed)
        errors += status != 200
    client.close()
    conn.send((ns, errors, starts))
    conn.close()


def searchers(port: int, attack: Attack, ready, go, conn) -> None:
    """``attack.clients`` threads searching for ``attack.seconds`` from ``go``; send
    ({status: count}, latencies ns of the answered searches) on ``conn``."""
    statuses: dict[int, int] = {}
    latencies: list[int] = []
    lock = threading.Lock()
    rng = random.Random(attack.seed)

    def make_step(_t: int):
        client = HttpClient(port, attack.api_key, timeout=30)

        def step():
            ns, status, _b = client.request("POST", TOOL_CALL, rng.choice(attack.bodies))
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    latencies.append(ns)
            wait = client.last_headers.get("Retry-After") if client.last_headers is not None else None
            if wait and attack.honour_retry_after:
                time.sleep(float(wait))  # as a well-behaved client does

        return step

    ready.set()
    go.wait(60)
    client_loop(
        clients=attack.clients,
        seconds=attack.seconds,
        max_requests=10**7,
        make_step=make_step,
        join_timeout=attack.seconds + 30,
    )
    conn.send((statuses, latencies))
    conn.close()


HOG = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def cpu_hog(seconds: float) -> subprocess.Popen:
    """A process spinning on one core for ``seconds`` (plain Python, no I/O, default priority)."""
    return subprocess.Popen([sys.executable, "-c", HOG.format(seconds=float(seconds))])


# --- phases -------------------------------------------------------------------------------


def phase(
    port: int,
    *,
    reader_key: str,
    read_body: bytes,
    seconds: float,
    attack: Attack | None = None,
    hog: bool = False,
    mode: str = "processes",
    attack_port: int | None = None,
) -> Outcome:
    """The reader's latencies for ``seconds`` while nothing else runs (idle), a CPU hog spins
    (``hog``), or ``attack`` runs. ``mode``: ``processes`` (each side its own process) or
    ``threads`` (both sides threads of this process, the old way). ``attack_port``: the
    searchers send to another server instance (same database) than the reader's."""
    if mode == "threads":
        return _in_threads(port, reader_key=reader_key, read_body=read_body, seconds=seconds, attack=attack, hog=hog)
    ctx = multiprocessing.get_context("spawn")
    ready_r, go, stop = ctx.Event(), ctx.Event(), ctx.Event()
    mine, theirs = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=reader, args=(port, reader_key, read_body, ready_r, go, stop, theirs), daemon=True)]
    attack_pipe = None
    readies = [ready_r]
    if attack is not None:
        ready_a = ctx.Event()
        attack_pipe, attack_theirs = ctx.Pipe(duplex=False)
        procs.append(
            ctx.Process(target=searchers, args=(attack_port or port, attack, ready_a, go, attack_theirs), daemon=True)
        )
        readies.append(ready_a)
    hog_proc = None
    try:
        for p in procs:
            p.start()
        for r in readies:
            if not r.wait(120):
                raise RuntimeError("a client process did not start within 120 s")
        if hog:
            hog_proc = cpu_hog(seconds + 2)
            time.sleep(0.5)  # spinning before the first timed read
        go.set()
        time.sleep(seconds)
        stop.set()
        if not mine.poll(60):
            raise RuntimeError("the reader process sent nothing within 60 s")
        ns, errors, starts = mine.recv()
        statuses, search_ns = ({}, [])
        if attack_pipe is not None:
            if not attack_pipe.poll(attack.seconds + 60):
                raise RuntimeError("the searchers' process sent nothing")
            statuses, search_ns = attack_pipe.recv()
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if hog_proc is not None:
            hog_proc.kill()
            hog_proc.wait()
    what = "attack" if attack is not None else ("cpu hog" if hog else "idle")
    return Outcome(
        reads=Samples(what, f"other tenant memory_read, {what}", ns=ns, errors=errors),
        statuses=statuses,
        search_ns=search_ns,
        starts=starts,
    )


def _in_threads(port, *, reader_key, read_body, seconds, attack, hog) -> Outcome:
    """The old measurement: the reader a thread of this process beside the searchers' threads."""
    reads = Samples("attack (threads)", "other tenant memory_read, a thread beside the searchers")
    stop = threading.Event()
    client = HttpClient(port, reader_key, timeout=30)
    for _ in range(20):
        client.request("POST", TOOL_CALL, read_body)

    starts: list[float] = []
    t0 = time.monotonic()

    def loop():
        while not stop.is_set():
            starts.append(time.monotonic() - t0)
            ns, status, _b = client.request("POST", TOOL_CALL, read_body)
            reads.ns.append(ns)
            reads.errors += status != 200

    statuses: dict[int, int] = {}
    search_ns: list[int] = []
    hog_proc = cpu_hog(seconds + 2) if hog else None
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        if attack is None:
            time.sleep(seconds)
        else:
            # The searchers' own function, its threads in this process.
            class _Now:
                def set(self):
                    pass

                def wait(self, _timeout=None):
                    return True

            class _Collect:
                def send(self, result):
                    statuses.update(result[0])
                    search_ns.extend(result[1])

                def close(self):
                    pass

            searchers(port, Attack(**{**attack.__dict__, "seconds": seconds}), _Now(), _Now(), _Collect())
    finally:
        stop.set()
        t.join(timeout=30)
        client.close()
        if hog_proc is not None:
            hog_proc.kill()
            hog_proc.wait()
    return Outcome(reads=reads, statuses=statuses, search_ns=search_ns, starts=starts)
