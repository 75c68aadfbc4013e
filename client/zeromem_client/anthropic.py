"""Claude's memory tool (``memory_20250818``) backed by ZeroMem: hand
:class:`ZeroMemMemoryTool` to the Anthropic SDK's tool runner and every ``/memories/...``
file Claude keeps is a memory in ZeroMem (scoped, audited, under the API key's allowlist)::

    import anthropic
    from zeromem_client import ZeroMem
    from zeromem_client.anthropic import ZeroMemMemoryTool

    memory = ZeroMemMemoryTool(ZeroMem("http://127.0.0.1:8000", api_key="zm_..."), root="user:u10086:memories")
    runner = anthropic.Anthropic().beta.messages.tool_runner(
        model="claude-sonnet-4-5", max_tokens=1024, tools=[memory],
        messages=[{"role": "user", "content": "Remember that I like coffee"}],
    )
    for message in runner: ...

Needs the ``anthropic`` package (``pip install ./client[anthropic]``). ``root`` is the key
``/memories`` maps to (default ``claude:memories``): ``/memories/notes/a.md`` is the key
``<root>:notes:a.md``.
"""

from __future__ import annotations

from typing import Any

from anthropic.lib.tools import BetaAbstractMemoryTool, BetaAsyncAbstractMemoryTool, ToolError

from zeromem_client import AsyncZeroMem, ZeroMem, _error

__all__ = ["ZeroMemMemoryTool", "AsyncZeroMemMemoryTool"]


def _input(command: Any) -> dict:
    return command.model_dump(exclude_none=True) if hasattr(command, "model_dump") else dict(command)


def _result(response) -> str:
    if response.status_code >= 400:
        raise _error(response)
    body = response.json()
    if body.get("is_error"):
        raise ToolError(body["content"])
    return body["content"]


class ZeroMemMemoryTool(BetaAbstractMemoryTool):
    """The six commands, each one ``POST /api/v1/anthropic/memory``; an error result of the
    tool (a missing file, an ambiguous ``old_str``) is a ``ToolError``, as the SDK expects."""

    def __init__(self, client: ZeroMem, *, root: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.client = client
        self.root = root

    def _run(self, command) -> str:
        return _result(self.client.anthropic_memory(_input(command), root=self.root))

    def view(self, command):
        return self._run(command)

    def create(self, command):
        return self._run(command)

    def str_replace(self, command):
        return self._run(command)

    def insert(self, command):
        return self._run(command)

    def delete(self, command):
        return self._run(command)

    def rename(self, command):
        return self._run(command)


class AsyncZeroMemMemoryTool(BetaAsyncAbstractMemoryTool):
    """:class:`ZeroMemMemoryTool` for the async tool runner, over :class:`AsyncZeroMem`."""

    def __init__(self, client: AsyncZeroMem, *, root: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.client = client
        self.root = root

    async def _run(self, command) -> str:
        return _result(await self.client.anthropic_memory(_input(command), root=self.root))

    async def view(self, command):
        return await self._run(command)

    async def create(self, command):
        return await self._run(command)

    async def str_replace(self, command):
        return await self._run(command)

    async def insert(self, command):
        return await self._run(command)

    async def delete(self, command):
        return await self._run(command)

    async def rename(self, command):
        return await self._run(command)
