"""What every benchmark measures with: HTTP clients, the client loop, latency samples and
their percentiles, ratios, and the machine's CPU and load.

Clients talk to a server on loopback only (:mod:`zeromem.bench.server` starts it). Every loop
here is bounded in time and in count, and every socket read by a timeout: no run hangs.
"""

from __future__ import annotations

import contextlib
import gc
import http.client
import itertools
import math
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- samples, percentiles, ratios ---------------------------------------------------------


def nearest_rank(sorted_values: list, q: float) -> float:
    """Nearest-rank percentile ``q`` (0 < q ≤ 1) of sorted values, in their unit (NaN when none)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def percentile(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile of nanosecond samples, in milliseconds."""
    return nearest_rank(sorted_ns, q) / 1e6


def percentiles(sorted_ns: list[int], *, digits: int, suffix: str = "_ms") -> dict[str, float]:
    """p50, p95 and p99 of nanosecond samples in milliseconds: ``{"p50_ms": …, "p95_ms": …, "p99_ms": …}``."""
    return {f"p{q}{suffix}": round(percentile(sorted_ns, q / 100), digits) for q in (50, 95, 99)}


@dataclass
class Samples:
    """Latencies of one operation (nanoseconds) and how many of its calls failed."""

    name: str
    what: str
    ns: list[int] = field(default_factory=list)
    errors: int = 0

    def summary(self) -> dict:
        s = sorted(self.ns)
        return {
            "what": self.what,
            "n": len(s),
            "errors": self.errors,
            **percentiles(s, digits=4),
            "mean_ms": round(sum(s) / len(s) / 1e6, 4) if s else None,
            "max_ms": round(s[-1] / 1e6, 4) if s else None,
        }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to two decimals; None when either side is missing, zero or NaN."""
    if not a or not b or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, 2)


def interleaved_samples(
    ops: dict[str, tuple[str, Callable[[int], tuple[bool, int]]]],
    *,
    iterations: int,
    warmup: int,
    max_seconds: float,
    rng: random.Random,
    log: Callable[[str], None],
    on_measure: Callable[[], None] | None = None,
) -> dict[str, Samples]:
    """Run every op once per iteration, in a fresh random order each time, so that machine
    noise hits all of them alike. ``ops`` maps a name to (what it is, ``op(i) -> (ok, elapsed
    ns)``); ``warmup`` iterations run first, unrecorded, then ``on_measure()``. Stops at the
    time cap, warm-up included."""
    names = list(ops)
    samples = {name: Samples(name, ops[name][0]) for name in names}
    deadline = time.monotonic() + max_seconds
    gc.collect()
    gc.disable()  # the client's GC pauses are not what we measure
    try:
        for i in range(-warmup, iterations):
            if i == 0 and on_measure is not None:
                on_measure()
            if time.monotonic() > deadline:
                log(f"  time cap reached after {i} iterations")
                break
            order = names[:]
            rng.shuffle(order)
            for name in order:
                ok, elapsed = ops[name][1](i)
                if i >= 0:
                    if ok:
                        samples[name].ns.append(elapsed)
                    else:
                        samples[name].errors += 1
            if i % 512 == 0:
                gc.collect()  # outside any timer
    finally:
        gc.enable()
    return samples


# --- the machine ----------------------------------------------------------------------------


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process from /proc (None when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def machine_cpu() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v[:8]) - idle, sum(v[:8])


def cpu_busy_pct(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """How busy all CPUs were between two :func:`machine_cpu` readings, in percent."""
    if not (before and after and after[1] > before[1]):
        return None
    return round(100 * (after[0] - before[0]) / (after[1] - before[1]), 1)


def child_pids(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (e.g. a CI timeout) unwinds like Ctrl-C meanwhile, so that servers and
    clusters started by the benchmark are always stopped on the way out."""

    def raise_system_exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, raise_system_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- HTTP clients -----------------------------------------------------------------------------


class HttpClient:
    """One keep-alive HTTP/1.1 connection to the bench server (loopback only)."""

    def __init__(self, port: int, api_key: str, timeout: float = 30.0):
        self.port = port
        self.timeout = timeout  # seconds for connect and for each socket read: no request hangs
        # Accept: what an MCP client sends (the /mcp endpoint requires it; Django ignores it).
        self.headers = {
            "Authorization": f"Bearer {api_key}",
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
        }
        self.conn: http.client.HTTPConnection | None = None
        self.reconnects = 0
        self.last_headers: http.client.HTTPMessage | None = None  # of the last response

    def _connect(self):
        self.conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=self.timeout)
        self.conn.connect()
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> tuple[int, int, bytes]:
        """(elapsed ns, status, body); ``headers`` are sent besides the key's. A connection
        the server closed while idle (keep-alive timeout) is reopened once, outside the timed region."""
        sent = {**self.headers, **headers} if headers else self.headers
        for attempt in (0, 1):
            if self.conn is None:
                self._connect()
            try:
                t0 = time.perf_counter_ns()
                self.conn.request(method, path, body=body, headers=sent)
                resp = self.conn.getresponse()
                data = resp.read()
                elapsed = time.perf_counter_ns() - t0
                self.last_headers = resp.headers
                if resp.will_close:
                    self.close()
                return elapsed, resp.status, data
            except (http.client.RemoteDisconnected, ConnectionError, http.client.CannotSendRequest):
                self.close()
                self.reconnects += 1
                if attempt:
                    raise
        raise AssertionError("unreachable")


def healthz(port: int, *, timeout: float) -> tuple[int, bytes]:
    """(status, body) of ``GET /healthz`` on a fresh connection; OSError when nothing answers."""
    c = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout)
    try:
        c.request("GET", "/healthz")
        resp = c.getresponse()
        return resp.status, resp.read()
    finally:
        c.close()


@dataclass
class LoopTimes:
    """When a :func:`client_loop` ran, on the ``time.monotonic()`` clock."""

    started: float  # every client released at once
    last_end: float  # the last client stopped sending
    joined: float  # every client thread joined (or its join timed out)


def client_loop(
    *,
    clients: int,
    seconds: float,
    max_requests: int,
    make_step: Callable[[int], Callable[[], None]],
    join_timeout: float,
    during: Callable[[float], None] | None = None,
) -> LoopTimes:
    """``clients`` threads released together, each taking steps back to back (a step is
    typically one request on its own keep-alive connection) until ``seconds`` have passed or
    ``max_requests`` steps were taken between them all.

    ``make_step(t)`` builds client ``t``'s step in its own thread, before the start;
    ``during(started)`` runs in the calling thread meanwhile (e.g. a fault timeline)."""
    budget = iter(range(max_requests))
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)
    ends = [0.0] * clients

    def client(t: int):
        step = make_step(t)
        barrier.wait(timeout=30)
        stop_at = time.monotonic() + seconds
        try:
            while time.monotonic() < stop_at:
                with lock:
                    if next(budget, None) is None:
                        break
                step()
        finally:
            ends[t] = time.monotonic()

    threads = [threading.Thread(target=client, args=(t,), daemon=True) for t in range(clients)]
    for th in threads:
        th.start()
    barrier.wait(timeout=30)
    started = time.monotonic()
    if during is not None:
        during(started)
    for th in threads:
        th.join(timeout=join_timeout)
    return LoopTimes(started=started, last_end=max(ends), joined=time.monotonic())


def round_robin(items: list, start: int, step: int) -> Iterator:
    """items[start], items[start + step], … cycling over the list (a client's share of the keys)."""
    return (items[j % len(items)] for j in itertools.count(start, step))
