"""An OpenAI Agents SDK ``Session`` kept in ZeroMem: the conversation history of an agent
survives the process, under the tenant's scopes, allowlist, audit and forget requests::

    from agents import Agent, Runner
    from zeromem_client import AsyncZeroMem
    from zeromem_client.openai_agents import ZeroMemSession

    session = ZeroMemSession("u10086-chat", AsyncZeroMem("http://127.0.0.1:8000", api_key="zm_..."))
    await Runner.run(Agent(name="Assistant"), "My name is Ann", session=session)

Each item is one memory, ``<prefix>:<session_id>:items:<20-digit nanosecond time>-<random>``
(the prefix is ``agent_session`` unless given; not ``session:``, which the idle-session
schedule summarizes), its value the item as JSON. Key order is the order the items were
added (by the adding process's clock, never going back within one session object). An item
must fit the tenant's value cap (16 KiB by default). Needs only httpx; ``agents`` is not
imported here.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from zeromem_client import AsyncZeroMem, NotFound, PreconditionFailed, ZeroMemError

__all__ = ["ZeroMemSession"]

BATCH = 50
PAGE = 200  # the list API's largest page
# Codes of a call refused for who is asking (a 403 when sent alone).
_REFUSALS = frozenset({"forbidden", "missing_scope", "key_not_allowed", "subject_not_allowed"})


class ZeroMemSession:
    """Implements ``agents.memory.Session`` (``get_items``, ``add_items``, ``pop_item``,
    ``clear_session``) over :class:`AsyncZeroMem`."""

    session_settings = None

    def __init__(self, session_id: str, client: AsyncZeroMem, *, prefix: str = "agent_session", session_settings=None):
        # One key segment: with a ':' the session's keys would nest under another session's
        # items (session "a:items:x" under "a"), which would read, pop and clear them.
        if not isinstance(session_id, str) or not session_id or ":" in session_id:
            raise ValueError(f"session_id must be a non-empty string without ':', got {session_id!r}")
        self.session_id = session_id
        self.client = client
        self.base = f"{prefix}:{session_id}"
        self.items_prefix = f"{self.base}:items:"
        self._last_ns = 0
        if session_settings is not None:
            self.session_settings = session_settings

    async def _all(self) -> list[dict]:
        return [m async for m in self.client.iter(self.items_prefix)]

    async def get_items(self, limit: int | None = None) -> list[Any]:
        """The history, oldest first; with ``limit`` (else ``session_settings.limit``), the
        latest ``limit`` items — as ``SQLiteSession``: 0 is none, a negative limit all."""
        if limit is None and self.session_settings is not None:
            settings = self.session_settings
            limit = settings.get("limit") if isinstance(settings, dict) else settings.limit
        if limit is None or limit < 0:
            return [m["value"] for m in await self._all()]
        return [m["value"] for m in reversed(await self._latest(limit))] if limit > 0 else []

    async def _latest(self, count: int) -> list[dict]:
        """The last ``count`` items, newest first: pages of the list in descending key order,
        so a long history is not read to find its end."""
        found: list[dict] = []
        cursor = None
        while len(found) < count:
            page = await self.client.list(
                self.items_prefix, limit=min(count - len(found), PAGE), cursor=cursor, order="desc"
            )
            found.extend(page["results"])
            cursor = page.get("next_cursor")
            if not cursor:
                break
        return found[:count]

    def _keys(self, count: int) -> list[str]:
        # Time-ordered, fixed width (key order is time order), never going back within this
        # session object, with a random tail so that two writers never pick the same key.
        now = max(time.time_ns(), self._last_ns + 1)
        self._last_ns = now + count
        tail = secrets.token_hex(4)
        return [f"{self.items_prefix}{now + i:020d}-{tail}" for i in range(count)]

    async def add_items(self, items: list[Any]) -> None:
        if not items:
            return
        calls = [
            {"name": "memory_write", "arguments": {"key": key, "value": item}}
            for key, item in zip(self._keys(len(items)), items, strict=True)
        ]
        # All or none, as SQLiteSession adds them in one transaction: each call of a batch
        # stands alone, so an item refused (past the value cap, say) left the others of this
        # call written, a history with a hole in it. Those written are deleted again.
        written: list[str] = []
        try:
            for i in range(0, len(calls), BATCH):
                chunk = calls[i : i + BATCH]
                results = await self.client.batch(chunk)
                written.extend(
                    call["arguments"]["key"]
                    for call, result in zip(chunk, results, strict=False)
                    if result.get("status") == "ok"
                )
                refused = next((r for r in results if r.get("status") != "ok"), None)
                if refused is not None:
                    raise RuntimeError(f"ZeroMem refused a session item: {refused.get('error')}")
        except BaseException:
            await self._delete(written)
            raise

    async def _delete(self, keys: list[str]) -> None:
        """Undo the writes of an add_items that failed (best effort: the error is the add's)."""
        for i in range(0, len(keys), BATCH):
            try:
                await self.client.batch(
                    [{"name": "memory_delete", "arguments": {"key": key}} for key in keys[i : i + BATCH]]
                )
            except Exception:
                return

    async def pop_item(self) -> Any | None:
        while True:
            items = await self._latest(1)
            if not items:
                return None
            last = items[0]
            try:
                current = await self.client.get(last["key"])
                await self.client.delete(last["key"], if_match=current["etag"])
            except (NotFound, PreconditionFailed):
                continue  # another writer popped or changed it: look again
            return current["value"]

    async def clear_session(self) -> None:
        keys = [m["key"] for m in await self._all()]
        calls = [{"name": "memory_delete", "arguments": {"key": key}} for key in keys]
        for i in range(0, len(calls), BATCH):
            results = await self.client.batch(calls[i : i + BATCH])
            # Each call of a batch stands alone: one refused (scope, allowlist) must not pass
            # for a cleared session. (not_found: another process removed it first.)
            refused = next((r for r in results if r.get("status") == "error"), None)
            if refused is not None:
                raise ZeroMemError(403 if refused["error"].get("code") in _REFUSALS else 400, refused)
