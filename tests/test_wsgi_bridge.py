"""The WSGI bridge behind the ASGI router (zeromem/kit/wsgi_bridge.py): a small request body is
read before the request takes a thread, a whole response reaches the server without the thread
waiting on the event loop, a streaming one is sent chunk by chunk with the thread waiting on
each (so a gone client stops it), and a slow sender holds no request thread."""

import asyncio
import io
import json
import threading
import time

import pytest

from tests.factories import make_key, make_tenant
from zeromem.kit.fair_threads import FairThreads
from zeromem.kit.wsgi_bridge import WsgiBridge


def _scope(method="POST", path="/x", headers=()):
    return {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1"), *headers],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1),
    }


def _receiver(*pieces: bytes):
    """An ASGI receive() handing out ``pieces`` as the body's messages, counting the calls."""
    calls = {"n": 0}

    async def receive():
        calls["n"] += 1
        index = calls["n"] - 1
        if index >= len(pieces):
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": pieces[index], "more_body": index < len(pieces) - 1}

    return receive, calls


@pytest.fixture
def hops(monkeypatch):
    """How many times a request thread waited on the event loop (asyncio.run_coroutine_threadsafe,
    which a2wsgi's Body and the bridge's streaming use)."""
    count = {"n": 0}
    real = asyncio.run_coroutine_threadsafe

    def counted(coro, loop):
        count["n"] += 1
        return real(coro, loop)

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", counted)
    return count


def test_a_small_body_is_read_first_and_a_whole_response_costs_the_thread_no_hop(hops):
    seen = {}
    closed = []

    class Answer(list):
        def close(self):
            closed.append(threading.current_thread().name)

    def app(environ, start_response):
        seen["input"] = type(environ["wsgi.input"])
        seen["body"] = environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"]))
        start_response("201 Created", [("Content-Type", "application/json")])
        return Answer([b'{"ok":', b"true}"])

    receive, calls = _receiver(b'{"na', b'me": 1}')
    sent = []
    asyncio.run(WsgiBridge(app, 2)(_scope(headers=[(b"content-length", b"11")]), receive, _async(sent.append)))
    assert seen == {"input": io.BytesIO, "body": b'{"name": 1}'}
    assert calls["n"] == 2  # both pieces, read in the loop
    assert sent == [
        {"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]},
        {"type": "http.response.body", "body": b'{"ok":true}', "more_body": False},
    ]
    assert closed and closed[0].startswith("WSGI")  # closed in the request thread
    assert hops["n"] == 0


def test_a_chunked_or_large_body_streams_to_the_app_as_it_arrives(hops):
    seen = {}

    def app(environ, start_response):
        seen["body"] = environ["wsgi.input"].read()
        start_response("200 OK", [])
        return [b"done"]

    receive, calls = _receiver(b"a" * 10, b"b" * 10, b"c" * 10)
    sent = []
    bridge = WsgiBridge(app, 2, preread_bytes=16)
    asyncio.run(bridge(_scope(headers=[(b"content-length", b"30")]), receive, _async(sent.append)))
    assert seen["body"] == b"a" * 10 + b"b" * 10 + b"c" * 10
    assert hops["n"] == 3  # one per message, received from the request thread
    assert sent[-1] == {"type": "http.response.body", "body": b"done", "more_body": False}

    receive, calls = _receiver(b"x" * 5, b"y" * 5)
    hops["n"] = 0
    asyncio.run(bridge(_scope(headers=[(b"transfer-encoding", b"chunked")]), receive, _async(sent.append)))
    assert seen["body"] == b"x" * 5 + b"y" * 5 and hops["n"] == 2


def test_a_streaming_response_is_sent_chunk_by_chunk_and_a_gone_client_stops_it(hops):
    produced, closed = [], []

    class Stream:
        streaming = True

        def __iter__(self):
            for n in range(100):
                produced.append(n)
                yield f"chunk {n}\n".encode()

        def close(self):
            closed.append(True)

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/csv")])
        return Stream()

    sent = []

    async def send(message):
        if len(sent) == 3:
            raise OSError("the client went away")
        sent.append(message)

    receive, _calls = _receiver()
    with pytest.raises(OSError, match="went away"):
        asyncio.run(WsgiBridge(app, 2)(_scope(method="GET"), receive, send))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent[1] == {"type": "http.response.body", "body": b"chunk 0\n", "more_body": True}
    assert len(produced) == 3  # the chunk whose send failed was the last one made
    assert closed == [True]
    assert hops["n"] == 4  # start, two chunks, and the one that failed


def test_a_websocket_is_closed():
    sent = []
    receive, _calls = _receiver()
    asyncio.run(WsgiBridge(lambda environ, start_response: [], 1)({"type": "websocket"}, receive, _async(sent.append)))
    assert sent == [{"type": "websocket.close", "code": 1000}]


def test_a_whole_response_to_a_gone_client_returns_only_once_its_thread_has_closed_it():
    closed = []

    class Answer(list):
        def close(self):
            time.sleep(0.2)  # the request's deferred work
            closed.append(True)

    def app(environ, start_response):
        start_response("200 OK", [])
        return Answer([b"x"])

    async def send(message):
        raise OSError("the client went away")

    receive, _calls = _receiver()
    with pytest.raises(OSError, match="went away"):
        asyncio.run(WsgiBridge(app, 1)(_scope(method="GET"), receive, send))
    assert closed == [True]


def test_an_app_that_fails_before_answering_sends_nothing_and_raises():
    def app(environ, start_response):
        raise RuntimeError("boom")

    sent = []
    receive, _calls = _receiver()
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(WsgiBridge(app, 1)(_scope(method="GET"), receive, _async(sent.append)))
    assert sent == []


def test_a_client_sending_its_body_slowly_holds_no_request_thread():
    """Through the router with one request thread: a POST whose body has not arrived waits
    without a thread, and a GET of another caller is answered meanwhile."""
    from zeromem.asgi import Router

    def app(environ, start_response):
        body = environ["wsgi.input"].read()
        start_response("200 OK", [])
        return [b"got " + body]

    class NoMcp:
        session_manager = None

        async def __call__(self, scope, receive, send):  # pragma: no cover - /mcp is not called
            raise AssertionError

    router = Router(WsgiBridge(app, 1), NoMcp(), FairThreads(1, 1))

    async def scenario():
        arrived = asyncio.Event()

        async def slow_receive():
            await arrived.wait()
            return {"type": "http.request", "body": b"late", "more_body": False}

        slow_sent, quick_sent = [], []
        slow_scope = _scope(path="/slow", headers=[(b"content-length", b"4")])
        slow = asyncio.create_task(router(slow_scope, slow_receive, _async(slow_sent.append)))
        await asyncio.sleep(0.05)
        quick_receive, _calls = _receiver()
        quick_scope = _scope(method="GET", path="/quick") | {"client": ("127.0.0.2", 1)}
        await asyncio.wait_for(router(quick_scope, quick_receive, _async(quick_sent.append)), timeout=5)
        assert not slow.done()
        arrived.set()
        await asyncio.wait_for(slow, timeout=5)
        return slow_sent, quick_sent

    slow_sent, quick_sent = asyncio.run(scenario())
    assert quick_sent[-1]["body"] == b"got " and slow_sent[-1]["body"] == b"got late"


@pytest.mark.django_db(transaction=True)
def test_django_through_the_bridge_answers_a_tool_call_and_closes_the_request():
    """Django's own app behind the bridge (what ``serve`` runs): a tool call's JSON answer, the
    request id header, and the response closed (its connection back, request_finished sent)."""
    from django.core.signals import request_finished

    from zeromem.asgi import django_app

    tenant = make_tenant("bridge")
    _key, raw = make_key(tenant)
    finished = []

    def on_finished(**kwargs):
        finished.append(threading.current_thread().name)

    request_finished.connect(on_finished)
    try:
        body = json.dumps({"name": "memory_write", "arguments": {"key": "fact:bridge:1", "value": "v"}}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"authorization", f"Bearer {raw}".encode()),
        ]
        receive, _calls = _receiver(body)
        sent = []
        asyncio.run(
            django_app("wsgi")(_scope(path="/api/v1/tools/call", headers=headers), receive, _async(sent.append))
        )
    finally:
        request_finished.disconnect(on_finished)
    start, answer = sent
    assert start["status"] == 200 and (b"x-request-id" in dict(start["headers"]))
    assert json.loads(answer["body"])["status"] == "ok" and answer["more_body"] is False
    assert finished and finished[0].startswith("WSGI")
    assert tenant.memories.get(key="fact:bridge:1").value == "v"


def _async(function):
    async def call(message):
        function(message)

    return call


# --- bodies over 64 KiB and chunked ones, read before the request takes a thread, within the
# process's budget (zeromem/kit/read_ahead.py): they streamed to the app from a request thread,
# so a few keys sending big bodies slowly held every thread of a process.

KB500 = 500_000


def _trickled(body: bytes, gate: asyncio.Event, pieces: int = 10, stall: bool = False):
    """receive() handing out ``body`` in ``pieces`` messages, the last one once ``gate`` is set
    (``stall``: never; the client stopped sending)."""
    step = -(-len(body) // pieces)
    parts = [body[i : i + step] for i in range(0, len(body), step)]
    calls = {"n": 0}

    async def receive():
        calls["n"] += 1
        index = calls["n"] - 1
        if index == len(parts) - 1:
            await (asyncio.Event().wait() if stall else gate.wait())
        if index >= len(parts):
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": parts[index], "more_body": index < len(parts) - 1}

    return receive, calls


class _Echo:
    """The WSGI app and the MCP endpoint of the router under test: each keeps the body it was
    given (by path and key) and answers its length."""

    session_manager = None

    def __init__(self):
        self.seen = {}

    def wsgi(self, environ, start_response):
        self.seen[(environ["PATH_INFO"], environ.get("HTTP_AUTHORIZATION", ""))] = environ["wsgi.input"].read()
        start_response("200 OK", [])
        return [b"wsgi %d" % len(self.seen[(environ["PATH_INFO"], environ.get("HTTP_AUTHORIZATION", ""))])]

    async def __call__(self, scope, receive, send):  # /mcp
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        headers = dict(scope["headers"])
        self.seen[(scope["path"], headers.get(b"authorization", b"").decode())] = b"".join(chunks)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"mcp %d" % len(b"".join(chunks))})


def _router(threads: int = 4, per_caller: int = 2):
    from zeromem.asgi import Router

    echo = _Echo()
    return Router(WsgiBridge(echo.wsgi, threads), echo, FairThreads(threads, per_caller)), echo


def _body_scope(path: str, key: str, length: int | None, client: str = "127.0.0.1"):
    framing = (b"content-length", str(length).encode()) if length is not None else (b"transfer-encoding", b"chunked")
    headers = [framing, (b"authorization", f"Bearer {key}".encode())]
    return _scope(path=path, headers=headers) | {"client": (client, 1)}


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_four_slow_500_kb_bodies_from_four_keys_leave_another_tenant_answered(framing):
    """4 threads, 2 a caller: four keys (one address) sending 500 KB bodies slowly, two to
    Django and two to /mcp. They held all four threads while their bodies arrived and another
    tenant's read waited for them; now it is answered at once, and each app sees every byte."""
    import os

    router, echo = _router()
    bodies = [os.urandom(KB500) for _ in range(4)]

    async def scenario():
        gate = asyncio.Event()
        slow, sent = [], [[] for _ in range(4)]
        for n, body in enumerate(bodies):
            receive, _calls = _trickled(body, gate)
            path = "/mcp" if n % 2 else "/api/v1/tools/call"
            scope = _body_scope(path, f"zm_slow{n}_secret", len(body) if framing == "content-length" else None)
            slow.append(asyncio.create_task(router(scope, receive, _async(sent[n].append))))
        await asyncio.sleep(0.1)
        quick = []
        quick_scope = _scope(method="GET", path="/api/v1/memories/k") | {"client": ("127.0.0.2", 1)}
        started = time.monotonic()
        await asyncio.wait_for(router(quick_scope, _receiver()[0], _async(quick.append)), timeout=3)
        waited = time.monotonic() - started
        charged = router.read_ahead.used
        assert not any(task.done() for task in slow)
        gate.set()
        await asyncio.wait_for(asyncio.gather(*slow), timeout=10)
        return charged, waited, sent, quick

    charged, waited, sent, quick = asyncio.run(scenario())
    assert quick[-1]["body"] == b"wsgi 0" and waited < 1
    # A declared body holds its length while it arrives, a chunked one what has arrived (9 of
    # its 10 pieces here; it held the whole 1 MiB cap).
    assert charged == (4 * KB500 if framing == "content-length" else 4 * (KB500 - KB500 // 10))
    assert router.read_ahead.used == 0  # all given back
    for n, body in enumerate(bodies):
        path = "/mcp" if n % 2 else "/api/v1/tools/call"
        assert echo.seen[(path, f"Bearer zm_slow{n}_secret")] == body  # bytes in = bytes seen
        assert sent[n][-1]["body"] == (b"mcp %d" if n % 2 else b"wsgi %d") % KB500


def test_past_the_budget_a_big_body_is_refused_503_and_small_ones_go_on(settings):
    settings.ZEROMEM_BODY_READ_AHEAD_BYTES = 1_100_000  # two 500 KB bodies; the cap is 1 MiB
    router, echo = _router()

    async def scenario():
        gate = asyncio.Event()
        held, sent = [], []
        for n in range(2):
            receive, _calls = _trickled(b"h" * KB500, gate)
            scope = _body_scope("/api/v1/tools/call", f"zm_held{n}_s", KB500)
            held.append(asyncio.create_task(router(scope, receive, _async(sent.append))))
        await asyncio.sleep(0.05)
        refused = {}
        for name, length in (("declared", KB500), ("chunked", None)):
            receive, calls = _trickled(b"r" * KB500, gate)
            answer = []
            await router(_body_scope("/mcp", f"zm_{name}_s", length), receive, _async(answer.append))
            refused[name] = (answer, calls["n"])
        small = []
        small_receive, _calls = _receiver(b"x" * 1000)
        await router(_body_scope("/mcp", "zm_small_s", 1000), small_receive, _async(small.append))
        gate.set()
        await asyncio.gather(*held)
        used_after = router.read_ahead.used
        again = []
        receive, _calls = _trickled(b"a" * KB500, gate)
        await router(_body_scope("/api/v1/tools/call", "zm_again_s", KB500), receive, _async(again.append))
        return refused, small, used_after, again

    refused, small, used_after, again = asyncio.run(scenario())
    for name, (answer, receive_calls) in refused.items():
        start, body = answer
        assert start["status"] == 503, name
        assert (b"retry-after", b"1") in start["headers"]
        assert json.loads(body["body"])["error"] == {
            "code": "body_budget",
            "message": "the server is reading too many request bodies at once: retry",
            "field": "body",
        }
        # A declared body: not a byte read; a chunked one is charged as it arrives, and is
        # refused once past the 100 KB left (two 50 KB pieces fit, the third does not).
        assert receive_calls == (0 if name == "declared" else 3), name
    assert small[-1]["body"] == b"mcp 1000"  # a small body is read outside the budget
    assert used_after == 0 and again[-1]["body"] == b"wsgi %d" % KB500  # the budget came back


def test_a_sender_that_stops_mid_body_is_answered_408_and_one_gone_runs_nothing(settings):
    # granian times out the headers only: a client that stopped mid-body was waited for until
    # it closed its connection (2 min in a test, the body's thread held all along).
    settings.ZEROMEM_BODY_READ_TIMEOUT_SECONDS = 0.2
    router, echo = _router()

    async def scenario():
        answers = {}
        for name, length in (("big", KB500), ("chunked", None), ("small", 2000)):
            receive, _calls = _trickled(b"s" * (length or KB500), asyncio.Event(), pieces=4, stall=True)
            answers[name] = []
            scope = _body_scope("/api/v1/tools/call", f"zm_{name}_s", length)
            await asyncio.wait_for(router(scope, receive, _async(answers[name].append)), timeout=5)
        pieces = [b"g" * 100_000, None]  # a client gone after 100 KB of 500

        async def gone():
            piece = pieces.pop(0)
            if piece is None:
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": piece, "more_body": True}

        answers["gone"] = []
        await router(_body_scope("/mcp", "zm_gone_s", KB500), gone, _async(answers["gone"].append))
        return answers

    answers = asyncio.run(scenario())
    for name in ("big", "chunked", "small"):
        start, body = answers[name]
        assert start["status"] == 408 and json.loads(body["body"])["error"]["code"] == "body_timeout", name
    assert answers["gone"] == []
    assert echo.seen == {}  # no app ran
    assert router.read_ahead.used == 0


# --- fairness of the budget: one caller's share, a bound on the whole body's read, a chunked
# body charged what has arrived.


def test_one_caller_holds_at_most_its_share_of_the_budget_and_another_callers_big_body_goes_in(settings):
    """One caller (one address, one key) trickling 500 KB bodies took the whole budget and
    every other caller's big body got 503 body_budget while its own went on. Now it holds at
    most ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES: its third body is refused (503,
    Retry-After, nothing read) and another caller's body is read."""
    settings.ZEROMEM_BODY_READ_AHEAD_BYTES = 2_000_000  # four 500 KB bodies
    settings.ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES = 1_100_000  # two of them
    router, echo = _router()

    async def scenario():
        gate = asyncio.Event()
        held, sent = [], [[] for _ in range(4)]
        for n in range(4):  # the same caller four times
            receive, calls = _trickled(b"h" * KB500, gate)
            scope = _body_scope("/api/v1/tools/call", "zm_hog_s", KB500)
            held.append((asyncio.create_task(router(scope, receive, _async(sent[n].append))), calls))
        await asyncio.sleep(0.05)
        hog_used = router.read_ahead.used
        other = []
        receive, _calls = _trickled(b"o" * KB500, gate)
        other_task = asyncio.create_task(
            router(_body_scope("/mcp", "zm_other_s", KB500, client="127.0.0.9"), receive, _async(other.append))
        )
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.wait_for(asyncio.gather(other_task, *(task for task, _ in held)), timeout=10)
        return hog_used, sent, [calls["n"] for _, calls in held], other

    hog_used, sent, calls, other = asyncio.run(scenario())
    assert hog_used == 2 * KB500  # its share: two bodies of four
    answered = [s[-1]["body"] for s in sent if s[0]["status"] == 200]
    refused = [s for s in sent if s[0]["status"] == 503]
    assert answered == [b"wsgi %d" % KB500] * 2 and len(refused) == 2
    for start, body in refused:
        assert (b"retry-after", b"1") in start["headers"]
        assert json.loads(body["body"])["error"]["code"] == "body_budget"
    assert sorted(calls) == [0, 0, 10, 10]  # the refused ones: not a byte read
    assert other[0]["status"] == 200 and other[-1]["body"] == b"mcp %d" % KB500
    assert echo.seen[("/mcp", "Bearer zm_other_s")] == b"o" * KB500
    assert router.read_ahead.used == 0 and router.read_ahead.holding == {}


def test_a_sender_trickling_a_body_under_the_silence_timeout_is_answered_408_and_a_slow_one_goes_in(settings):
    """The timeout was per message: a sender sending 1 KB every 0.1 s with a 0.2 s timeout was
    never dropped (its budget held until it was done or gone). Now a body has the timeout plus
    one second per ZEROMEM_BODY_READ_MIN_BYTES_PER_SECOND bytes that arrived: the trickler is
    answered 408 and its budget given back, while a slow body at the rate, taking ten times the
    timeout, is read whole."""
    settings.ZEROMEM_BODY_READ_TIMEOUT_SECONDS = 0.2
    settings.ZEROMEM_BODY_READ_MIN_BYTES_PER_SECOND = 200_000
    router, echo = _router()

    def paced(piece: bytes, pieces: int, every: float):
        calls = {"n": 0}

        async def receive():
            calls["n"] += 1
            await asyncio.sleep(every)
            return {"type": "http.request", "body": piece, "more_body": calls["n"] < pieces}

        return receive

    async def scenario():
        answers = {}
        # name: (piece, pieces, seconds apart, declared length or chunked)
        cases = {
            "trickle": (b"t" * 1000, 500, 0.1, 500_000),
            "trickle-chunked": (b"t" * 1000, 500, 0.1, None),
            "trickle-small": (b"t" * 100, 500, 0.1, 50_000),
            "slow": (b"s" * 25_000, 20, 0.1, 500_000),  # 250 KB/s: 2 s in all
        }
        for name, (piece, pieces, every, length) in cases.items():
            answers[name] = []
            scope = _body_scope("/api/v1/tools/call", f"zm_{name}_s", length)
            started = time.monotonic()
            await asyncio.wait_for(router(scope, paced(piece, pieces, every), _async(answers[name].append)), timeout=5)
            answers[name].append(time.monotonic() - started)
        return answers

    answers = asyncio.run(scenario())
    for name in ("trickle", "trickle-chunked", "trickle-small"):
        start, body, waited = answers[name]
        assert start["status"] == 408 and json.loads(body["body"])["error"]["code"] == "body_timeout", name
        assert waited < 0.5, (name, waited)
    start, body, waited = answers["slow"]
    assert start["status"] == 200 and body["body"] == b"wsgi 500000" and waited > 1.9
    assert echo.seen == {("/api/v1/tools/call", "Bearer zm_slow_s"): b"s" * 500_000}
    assert router.read_ahead.used == 0


def test_a_chunked_body_is_charged_what_has_arrived_and_refused_when_the_budget_runs_out(settings):
    """A chunked body took the whole cap (1 MiB) while it arrived: with a 1.2 MB budget a
    second 100 KB chunked body got 503. Now each holds what has arrived: three go in together;
    one that grows past the budget is answered 503 body_budget once it does, and gives back
    what it held."""
    settings.ZEROMEM_BODY_READ_AHEAD_BYTES = 1_200_000
    settings.ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES = 1_200_000
    router, echo = _router()

    async def scenario():
        gate = asyncio.Event()
        tasks, sent = [], [[] for _ in range(3)]
        for n in range(3):
            receive, _calls = _trickled(b"c" * 100_000, gate)
            scope = _body_scope("/api/v1/tools/call", f"zm_chunked{n}_s", None, client=f"127.0.0.{n + 1}")
            tasks.append(asyncio.create_task(router(scope, receive, _async(sent[n].append))))
        await asyncio.sleep(0.05)
        arrived = router.read_ahead.used
        # A chunked body that grows to 1 MiB while 270 KB are held: refused at the budget.
        big = []
        receive, calls = _trickled(b"b" * (1024 * 1024), asyncio.Event(), pieces=16, stall=True)
        scope = _body_scope("/mcp", "zm_big_s", None, client="127.0.0.8")
        await asyncio.wait_for(router(scope, receive, _async(big.append)), timeout=3)
        after_big = router.read_ahead.used
        gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        return arrived, sent, big, calls["n"], after_big

    arrived, sent, big, big_calls, after_big = asyncio.run(scenario())
    assert arrived == 3 * 90_000  # 9 of 10 pieces each, not 3 caps
    for n in range(3):
        assert sent[n][-1]["body"] == b"wsgi 100000"
        assert echo.seen[("/api/v1/tools/call", f"Bearer zm_chunked{n}_s")] == b"c" * 100_000
    start, body = big
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    assert json.loads(body["body"])["error"]["code"] == "body_budget"
    assert big_calls == 15  # refused mid-body: 14 pieces of 64 KiB fit in the 930 KB left, not 15
    assert after_big == arrived and ("/mcp", "Bearer zm_big_s") not in echo.seen
    assert router.read_ahead.used == 0
