"""The client's OpenAI Agents SDK Session (zeromem_client.openai_agents.ZeroMemSession): a
round trip with the real ``openai-agents`` Runner (its model a fake OpenAI endpoint — a local
HTTP server playing the model) into a live ZeroMem, and the four Session operations giving
what the SDK's own SQLiteSession gives on the same calls."""

from __future__ import annotations

import asyncio

import pytest
from agents import Agent, OpenAIChatCompletionsModel, Runner, SQLiteSession, set_tracing_disabled
from agents.memory import Session
from openai import AsyncOpenAI
from zeromem_client import AsyncZeroMem, ZeroMemError
from zeromem_client.openai_agents import ZeroMemSession

from audit.models import AuditEvent
from memories.models import Memory
from tests.factories import make_key, make_tenant
from tests.helpers import FakeJSONEndpoint


def _completion(body: dict, n: int) -> dict:
    return {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": 0,
        "model": "gpt-fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": f"Hello {n}"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def FakeOpenAI() -> FakeJSONEndpoint:
    """POST /v1/chat/completions: answers "Hello <n>" (n counts the requests); keeps the requests."""
    return FakeJSONEndpoint(_completion, path="/v1")


@pytest.fixture
def acme(transactional_db):
    tenant = make_tenant("acme")
    return tenant, make_key(tenant)[1]


def test_runner_round_trip_keeps_the_history_in_zeromem(live_server, acme):
    tenant, raw = acme
    set_tracing_disabled(True)
    fake = FakeOpenAI()

    async def main():
        model = OpenAIChatCompletionsModel(model="gpt-fake", openai_client=AsyncOpenAI(base_url=fake.url, api_key="x"))
        agent = Agent(name="Assistant", instructions="Be brief.", model=model)
        async with AsyncZeroMem(live_server.url, raw) as zm:
            session = ZeroMemSession("chat-1", zm)
            assert isinstance(session, Session)
            first = await Runner.run(agent, "My name is Ann.", session=session)
            second = await Runner.run(agent, "What is my name?", session=session)
            # A new session object (another process) sees the same history.
            history = await ZeroMemSession("chat-1", zm).get_items()
            return first.final_output, second.final_output, history

    try:
        first, second, history = asyncio.run(main())
    finally:
        fake.close()
    assert (first, second) == ("Hello 1", "Hello 2")
    # The second model call was sent the first exchange, read back from ZeroMem.
    sent = [(m["role"], m["content"]) for m in fake.requests[1]["messages"]]
    assert sent == [
        ("system", "Be brief."),
        ("user", "My name is Ann."),
        ("assistant", "Hello 1"),
        ("user", "What is my name?"),
    ]
    assert [(i["role"], _text(i)) for i in history] == [
        ("user", "My name is Ann."),
        ("assistant", "Hello 1"),
        ("user", "What is my name?"),
        ("assistant", "Hello 2"),
    ]
    keys = list(Memory.objects.filter(tenant=tenant, deleted_at__isnull=True).values_list("key", flat=True))
    assert len(keys) == 4 and all(k.startswith("agent_session:chat-1:items:") for k in keys)
    assert AuditEvent.objects.filter(tenant=tenant, action="memory.write").count() == 4


def _text(item) -> str:
    content = item["content"]
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def test_session_operations_match_the_sdks_sqlite_session(live_server, acme):
    tenant, raw = acme
    items = [{"role": "user", "content": f"message {i}"} for i in range(60)]  # more than one batch

    async def run(session):
        out = [await session.get_items(), await session.pop_item()]
        await session.add_items(items[:3])
        await session.add_items(items[3:])
        out += [await session.get_items(limit=2), len(await session.get_items())]
        out += [await session.pop_item(), await session.pop_item(), (await session.get_items())[-1]]
        await session.clear_session()
        out += [await session.get_items(), await session.pop_item()]
        await session.add_items(items[:1])
        out.append(await session.get_items())
        return out

    async def main():
        async with AsyncZeroMem(live_server.url, raw) as zm:
            return await run(ZeroMemSession("s-1", zm)), await run(SQLiteSession("s-1"))

    ours, sqlite = asyncio.run(main())
    assert ours == sqlite
    assert ours[2] == items[58:] and ours[4] == items[59] and ours[6] == items[57]
    live = Memory.objects.filter(tenant=tenant, deleted_at__isnull=True)
    assert [m.value for m in live] == items[:1]


def test_a_session_id_holding_a_colon_is_refused_since_it_would_nest_in_another_session(live_server, acme):
    """Session "a" keeps its items under agent_session:a:items:, so a session "a:items:x" would
    keep its own under agent_session:a:items:x:items: — inside "a"'s — and session "a" would
    read, pop and clear them. A ':' in a session id is refused before anything is written."""
    tenant, raw = acme

    async def main():
        async with AsyncZeroMem(live_server.url, raw) as zm:
            for session_id in ("a:items:x", "", 7):
                with pytest.raises(ValueError, match="session_id"):
                    ZeroMemSession(session_id, zm)
            await ZeroMemSession("a", zm).add_items([{"role": "user", "content": "mine"}])
            return await ZeroMemSession("a", zm).get_items()

    assert asyncio.run(main()) == [{"role": "user", "content": "mine"}]
    keys = list(Memory.objects.filter(tenant=tenant).values_list("key", flat=True))
    assert len(keys) == 1 and keys[0].startswith("agent_session:a:items:") and keys[0].count(":") == 3


def test_pop_item_racing_another_pop_takes_the_next_item(live_server, acme):
    """Two processes pop the same session at once: the one that loses the race for the last
    item looks again and pops the one before it, as the README promises — it does not raise."""
    tenant, raw = acme
    items = [{"role": "user", "content": f"message {i}"} for i in range(3)]

    class Racing(AsyncZeroMem):
        """A client whose first read of an item lets another process pop it just before."""

        popped = None

        async def get(self, key):
            if self.popped is None:
                async with AsyncZeroMem(live_server.url, raw) as other:
                    self.popped = await ZeroMemSession("s-1", other).pop_item()
            return await super().get(key)

    async def main():
        async with Racing(live_server.url, raw) as zm:
            session = ZeroMemSession("s-1", zm)
            await session.add_items(items)
            mine = await session.pop_item()
            return zm.popped, mine, await session.get_items()

    theirs, mine, left = asyncio.run(main())
    assert (theirs, mine, left) == (items[2], items[1], items[:1])


def test_get_items_without_a_limit_honours_session_settings_as_sqlite_session_does(live_server, acme):
    from agents.memory import SessionSettings

    tenant, raw = acme
    items = [{"role": "user", "content": f"message {i}"} for i in range(5)]

    async def run(session):
        await session.add_items(items)
        return [await session.get_items(), await session.get_items(limit=3), await session.get_items(limit=-1)]

    async def main():
        settings = SessionSettings(limit=2)
        async with AsyncZeroMem(live_server.url, raw) as zm:
            ours = await run(ZeroMemSession("s-2", zm, session_settings=settings))
        return ours, await run(SQLiteSession("s-2", session_settings=settings))

    ours, sqlite = asyncio.run(main())
    assert ours == sqlite
    assert ours == [items[3:], items[2:], items]


def test_clear_session_refused_for_some_items_raises_instead_of_passing_for_cleared(live_server, acme):
    """Each call of a batch stands alone: a key that may not delete got a 200 batch of refusals,
    and clear_session returned as though the history were gone."""
    tenant, raw = acme
    reader_only = make_key(tenant, scopes=["memory:read", "memory:write"])[1]

    async def main():
        async with AsyncZeroMem(live_server.url, raw) as zm:
            await ZeroMemSession("chat-9", zm).add_items([{"role": "user", "content": "hi"}])
        async with AsyncZeroMem(live_server.url, reader_only) as zm:
            session = ZeroMemSession("chat-9", zm)
            with pytest.raises(ZeroMemError) as refused:
                await session.clear_session()
            return refused.value, await session.get_items()

    error, left = asyncio.run(main())
    assert (error.status, error.code) == (403, "missing_scope")
    assert left == [{"role": "user", "content": "hi"}]


def test_the_latest_items_are_read_from_the_end_not_by_walking_the_whole_history(live_server, acme):
    """get_items(limit=3) and pop_item on a 450-item session read the list newest first: one
    page each (memory.list events), where they walked all three pages of the history."""
    tenant, raw = acme
    items = [{"role": "user", "content": f"message {i}"} for i in range(450)]
    lists = AuditEvent.objects.filter(tenant=tenant, action="memory.list")

    def on_session(operation):
        async def main():
            async with AsyncZeroMem(live_server.url, raw) as zm:
                return await operation(ZeroMemSession("long", zm))

        before = lists.count()
        result = asyncio.run(main())
        return result, lists.count() - before

    on_session(lambda session: session.add_items(items))
    assert on_session(lambda session: session.get_items(limit=3)) == (items[-3:], 1)
    assert on_session(lambda session: session.pop_item()) == (items[-1], 1)
    many, pages = on_session(lambda session: session.get_items(limit=250))  # past one page
    assert (many, pages) == (items[-251:-1], 2)


def test_add_items_refused_for_one_item_adds_none_of_them(live_server, acme):
    """Each call of a batch stands alone: an item past the tenant's value cap was refused while
    the others of its call (and of the batches before it) stayed, a history with a hole in it.
    SQLiteSession adds the items of one call in one transaction: all or none."""
    tenant, raw = acme
    items = [{"role": "user", "content": f"message {i}"} for i in range(60)]
    items[55] = {"role": "user", "content": "x" * 20_000}  # past the 16 KiB default cap

    async def main():
        async with AsyncZeroMem(live_server.url, raw) as zm:
            session = ZeroMemSession("chat-7", zm)
            await session.add_items([{"role": "user", "content": "before"}])
            with pytest.raises(RuntimeError, match="value"):
                await session.add_items(items)
            return await session.get_items()

    assert asyncio.run(main()) == [{"role": "user", "content": "before"}]
    live = Memory.objects.filter(tenant=tenant, deleted_at__isnull=True, key__startswith="agent_session:chat-7:")
    assert live.count() == 1
