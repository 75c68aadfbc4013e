"""The stdio bridge: ``python3 -m zeromem mcp --url https://…/mcp --key zm_…``.

For MCP clients that only start local commands (Claude Desktop): an MCP server on this
process's stdin/stdout (the SDK's stdio transport) whose ``tools/list`` and ``tools/call`` are
forwarded, as they are, to ZeroMem's streamable HTTP endpoint by the SDK's client, with the
API key as its bearer token. It imports neither Django nor ZeroMem's settings and touches no
database: all it needs is the URL and the key (``--url``/``--key``, or ``ZEROMEM_MCP_URL`` and
``ZEROMEM_API_KEY``, which keep the key out of the process list).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import anyio
import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from memories.mcp import INSTRUCTIONS, SERVER_NAME

# As the SDK's own default client: 30 s to connect or send, 300 s to read.
TIMEOUT = httpx2.Timeout(30.0, read=300.0)


class _Unreachable(httpx2.AsyncBaseTransport):
    """The HTTP transport, but a request that gets no answer (ZeroMem restarting, the network
    down, no reply within the timeout) is answered here: a 502 carrying a JSON-RPC error that
    says so, which the SDK's client hands back as that one request's error. Left to the SDK's
    client, the connection error ends its task group: the bridge exits, and the MCP client
    waits for the call's answer forever."""

    def __init__(self, url: str):
        self.url = url
        self.inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            response = await self.inner.handle_async_request(request)
        except httpx2.TransportError as exc:
            return self._error(request, 502, f"is unreachable ({type(exc).__name__}: {exc}); retry")
        if response.status_code < 400:
            return response
        # A refusal outside JSON-RPC (401 for a bad key, 429, 503, a wrong URL's 404) would
        # reach the client as the SDK's "Server returned an error response": say what it was.
        body = await response.aread()
        await response.aclose()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and "jsonrpc" in parsed and "error" in parsed:
            headers = {"content-type": "application/json"}  # the body as read: decoded
            return httpx2.Response(response.status_code, headers=headers, content=body, request=request)
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(error, dict):  # ZeroMem's shape
            detail = f"{error.get('code')}: {error.get('message')}"
        elif isinstance(parsed, dict) and isinstance(error, str):  # the SDK's OAuth shape
            detail = f"{error}: {parsed.get('error_description', '')}"
        else:
            detail = response.reason_phrase
        if response.status_code == 401:
            detail += " (check the API key: --key or ZEROMEM_API_KEY)"
        if response.headers.get("retry-after"):
            detail += f"; retry after {response.headers['retry-after']} s"
        return self._error(request, response.status_code, f"answered {response.status_code} {detail}")

    def _error(self, request: httpx2.Request, status: int, what: str) -> httpx2.Response:
        message = f"ZeroMem at {self.url} {what}"[:1000]
        error = {"jsonrpc": "2.0", "id": None, "error": {"code": types.INTERNAL_ERROR, "message": message}}
        return httpx2.Response(status, json=error, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def proxy_server(upstream: Client) -> Server:
    """A stdio-side server whose tools are the upstream endpoint's."""

    async def list_tools(ctx, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return await upstream.list_tools(cursor=params.cursor if params else None)

    async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        return await upstream.call_tool(params.name, params.arguments)

    return Server(
        SERVER_NAME,
        version="0.1.0",
        title="ZeroMem memory (stdio bridge)",
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def run(url: str, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx2.AsyncClient(headers=headers, timeout=TIMEOUT, transport=_Unreachable(url)) as http:
        async with Client(streamable_http_client(url, http_client=http)) as upstream:
            server = proxy_server(upstream)
            async with stdio_server() as (read_stream, write_stream):
                await server.run(read_stream, write_stream, server.create_initialization_options())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m zeromem mcp", description="MCP over stdio, forwarded to ZeroMem's /mcp endpoint."
    )
    parser.add_argument("--url", default=os.environ.get("ZEROMEM_MCP_URL"), help="e.g. https://memory.example.com/mcp")
    parser.add_argument("--key", default=os.environ.get("ZEROMEM_API_KEY"), help="an API key, zm_... (or env)")
    args = parser.parse_args(argv)
    if not args.url or not args.key:
        parser.error("--url and --key (or ZEROMEM_MCP_URL and ZEROMEM_API_KEY) are required")
    if not args.url.startswith(("http://", "https://")):
        parser.error("--url must be an http:// or https:// URL of the /mcp endpoint")
    try:
        anyio.run(run, args.url, args.key)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the client shows stderr; a traceback helps nobody there
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]  # the SDK's task groups wrap the one error that ended them
        print(f"zeromem mcp: {exc or repr(exc)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
