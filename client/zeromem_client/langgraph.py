"""A LangGraph ``BaseStore`` backed by ZeroMem, for graphs that run in process.

    from zeromem_client.langgraph import ZeroMemStore

    store = ZeroMemStore("https://memory.example.com", api_key="zm_...")
    graph = builder.compile(store=store)

It speaks to ZeroMem's LangGraph routes (``/api/v1/langgraph/store/...``) with httpx: no
Django, nothing else. Items live in ZeroMem as memories under the server's prefix
(``ZEROMEM_LANGGRAPH_PREFIX``, default ``lg``): namespace ``("users", "u1")`` and key
``"prefs"`` is the memory ``lg:users:u1:prefs``, scoped, allowlisted and audited like any
other. Needs ``pip install 'zeromem-client[langgraph]'`` (httpx and langgraph).

Semantics, as LangGraph's ``InMemoryStore``: in one ``batch`` the reads (get, search, list
namespaces) see the state before the batch's puts, and the last put of a (namespace, key)
wins; deleting a missing item is no error. Where ZeroMem differs: a search without a query
is ordered by the memory key, labels and key joined by ``:`` (``("a",)``/``"k"`` after
``("a", "b")``/``"k"``; ``InMemoryStore``: insertion order); a search with a query
is ranked by ZeroMem's own search (lexical and semantic), with its ``score``, and returns
only items that match the query (``InMemoryStore`` without an index ignores the query); TTLs
are whole minutes (a fraction is rounded up).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import httpx
from langgraph.store.base import (
    BaseStore,
    GetOp,
    InvalidNamespaceError,
    Item,
    ListNamespacesOp,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    TTLConfig,
)

API_PATH = "/api/v1/langgraph"
# What one request of the routes takes: a search's limit (and, with a query, offset + limit:
# ZeroMem ranks at most that many items), a namespace listing's limit, and max_depth (a key of
# 512 characters holds fewer labels). LangGraph takes any: larger reads go in pages.
SEARCH_PAGE = 200
NAMESPACES_PAGE = 1000
MAX_DEPTH = 512


class ZeroMemStoreError(Exception):
    """ZeroMem refused a store operation: ``status`` (HTTP), ``code``, ``field``, ``message``."""

    def __init__(self, status: int, error: dict):
        self.status = status
        self.code = error.get("code")
        self.field = error.get("field")
        self.message = error.get("message", "")
        super().__init__(f"{status} {self.code}: {self.message} (field: {self.field})")


def _error(response: httpx.Response) -> Exception:
    try:
        error = response.json().get("error") or {}
    except ValueError:
        error = {"code": "http_error", "message": response.text[:200]}
    if response.status_code == 400 and error.get("field") in ("namespace", "namespace_prefix"):
        return InvalidNamespaceError(error.get("message", "invalid namespace"))
    return ZeroMemStoreError(response.status_code, error)


def _item(data: dict) -> Item:
    return Item(
        value=data["value"],
        key=data["key"],
        namespace=tuple(data["namespace"]),
        created_at=datetime.fromisoformat(data["created_at"]),
        updated_at=datetime.fromisoformat(data["updated_at"]),
    )


def _search_item(data: dict) -> SearchItem:
    return SearchItem(
        namespace=tuple(data["namespace"]),
        key=data["key"],
        value=data["value"],
        created_at=datetime.fromisoformat(data["created_at"]),
        updated_at=datetime.fromisoformat(data["updated_at"]),
        score=data.get("score"),
    )


def _ttl_minutes(ttl: float | None) -> int | None:
    return None if ttl is None else max(1, math.ceil(ttl))


def _request(op: Op) -> tuple[str, str, dict]:
    """(method, path, httpx keyword arguments) of one operation."""
    if isinstance(op, GetOp):
        params = {"namespace": ".".join(op.namespace), "key": op.key, "refresh_ttl": str(bool(op.refresh_ttl)).lower()}
        return "GET", "/store/items", {"params": params}
    if isinstance(op, PutOp):
        if op.value is None:
            return "DELETE", "/store/items", {"json": {"namespace": list(op.namespace), "key": op.key}}
        body: dict[str, Any] = {"namespace": list(op.namespace), "key": op.key, "value": dict(op.value)}
        if op.index is not None:
            body["index"] = op.index
        if op.ttl is not None:
            body["ttl"] = _ttl_minutes(op.ttl)
        return "PUT", "/store/items", {"json": body}
    if isinstance(op, SearchOp):
        body = {
            "namespace_prefix": list(op.namespace_prefix),
            "limit": op.limit,
            "offset": op.offset,
            "refresh_ttl": bool(op.refresh_ttl),
        }
        if op.filter:
            body["filter"] = op.filter
        if op.query:
            body["query"] = op.query
        return "POST", "/store/items/search", {"json": body}
    if isinstance(op, ListNamespacesOp):
        body = {"limit": op.limit, "offset": op.offset}
        for condition in op.match_conditions or ():
            body[condition.match_type] = list(condition.path)
        if op.max_depth is not None:
            body["max_depth"] = op.max_depth
        return "POST", "/store/namespaces", {"json": body}
    raise ValueError(f"unknown operation type: {type(op).__name__}")


def _result(op: Op, response: httpx.Response) -> Result:
    if isinstance(op, GetOp) and response.status_code == 404:
        return None
    if response.status_code >= 400:
        raise _error(response)
    if isinstance(op, GetOp):
        return _item(response.json())
    if isinstance(op, SearchOp):
        return [_search_item(i) for i in response.json()["items"]]
    if isinstance(op, ListNamespacesOp):
        return [tuple(ns) for ns in response.json()["namespaces"]]
    return None


def _cut(response: httpx.Response) -> bool:
    """Whether a search page stopped at the server's byte budget (its ``cut``)."""
    body = response.json()
    return isinstance(body, dict) and body.get("cut") is True


def _refusal(field: str, message: str) -> Exception:
    """What the server answers to such a request (a 400 naming ``field``), raised before any is sent."""
    if field == "namespace":
        return InvalidNamespaceError(message)
    return ZeroMemStoreError(400, {"code": "invalid", "field": field, "message": message})


def _check(op: Op) -> None:
    """Refuse what the server would refuse of a get or a put, before the batch sends anything.
    A get's namespace travels as its labels joined by ".": a label holding one was split by
    the server into two (("a.b",) read the item of ("a", "b")). A put refused by the server
    after the batch's earlier puts were written left the batch half done."""
    if not isinstance(op, GetOp | PutOp):
        return
    namespace = op.namespace
    if not isinstance(namespace, tuple | list) or not namespace:
        raise _refusal("namespace", "must be a non-empty tuple of labels")
    for label in namespace:
        if not isinstance(label, str) or not label or "." in label:
            raise _refusal("namespace", f"labels must be non-empty strings without '.', got {label!r}")
    if not isinstance(op.key, str) or not op.key:
        raise _refusal("key", "must be a non-empty string")
    if isinstance(op, PutOp) and op.value is not None and not isinstance(op.value, Mapping):
        raise _refusal("value", "must be a JSON object (a dict)")


def _window(op: Op) -> tuple[Op, int, int] | None:
    """A search or namespace listing as (its first request, its limit, a page's size), the
    limit past what ZeroMem can hold cut off; None for any other operation (one request)."""
    if isinstance(op, SearchOp):
        limit = op.limit
        if op.query:
            limit = max(0, min(limit, SEARCH_PAGE - op.offset))
        return op, limit, SEARCH_PAGE
    if isinstance(op, ListNamespacesOp):
        if op.max_depth is not None and op.max_depth > MAX_DEPTH:
            op = op._replace(max_depth=MAX_DEPTH)
        return op, op.limit, NAMESPACES_PAGE
    return None


def _next_page(op: Op, left: int, page: int, got: list | None, cut: bool = False) -> Op | None:
    """The next request of a paged read (``left`` still wanted after ``got``), or None when done:
    a page shorter than asked is the end, unless the server ``cut`` it at its byte budget
    (ZEROMEM_PAGE_VALUES_MAX_BYTES) — then the rest follows it."""
    if left <= 0 or (got is not None and (not got or (len(got) < op.limit and not cut))):
        return None
    offset = op.offset if got is None else op.offset + len(got)
    return op._replace(offset=offset, limit=min(left, page))


def _plan(ops: Iterable[Op]) -> tuple[list[Op], list[int], list[PutOp]]:
    """The batch as InMemoryStore runs it: reads first (in order), then the puts, the last
    put of each (namespace, key) winning. Every get and put is checked first (:func:`_check`)."""
    ops = list(ops)
    for op in ops:
        _check(op)
    reads = [i for i, op in enumerate(ops) if not isinstance(op, PutOp)]
    puts: dict[tuple, PutOp] = {}
    for op in ops:
        if isinstance(op, PutOp):
            puts[(op.namespace, op.key)] = op
    return ops, reads, list(puts.values())


class ZeroMemStore(BaseStore):
    """LangGraph store on a ZeroMem server. ``url``: the server (``https://host``); ``api_key``:
    a ZeroMem key (``zm_...``) whose scopes and allowlist bound what the graph may do.
    Pass ``client``/``aclient`` to reuse your own httpx clients (their base URL must be the
    server's ``/api/v1/langgraph``)."""

    supports_ttl = True

    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float = 10.0,
        ttl: TTLConfig | None = None,
        client: httpx.Client | None = None,
        aclient: httpx.AsyncClient | None = None,
    ) -> None:
        if client is None and aclient is None and not (url and api_key):
            raise ValueError("give url and api_key (or your own httpx clients)")
        base = (url or "").rstrip("/") + API_PATH
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client
        self._aclient = aclient
        self._client_args = {"base_url": base, "headers": headers, "timeout": timeout}
        self.ttl_config = ttl

    # httpx clients are made on first use, so a store built for async use never opens a sync one.
    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(**self._client_args)
        return self._client

    @property
    def aclient(self) -> httpx.AsyncClient:
        if self._aclient is None:
            self._aclient = httpx.AsyncClient(**self._client_args)
        return self._aclient

    def _read(self, op: Op) -> Result:
        window = _window(op)
        if window is None:
            method, path, kwargs = _request(op)
            return _result(op, self.client.request(method, path, **kwargs))
        first, left, page = window
        out: list = []
        got, request = None, _next_page(first, left, page, None)
        while request is not None:
            method, path, kwargs = _request(request)
            response = self.client.request(method, path, **kwargs)
            got = _result(request, response)
            out.extend(got)
            left -= len(got)
            request = _next_page(request, left, page, got, _cut(response))
        return out

    async def _aread(self, op: Op) -> Result:
        window = _window(op)
        if window is None:
            method, path, kwargs = _request(op)
            return _result(op, await self.aclient.request(method, path, **kwargs))
        first, left, page = window
        out: list = []
        got, request = None, _next_page(first, left, page, None)
        while request is not None:
            method, path, kwargs = _request(request)
            response = await self.aclient.request(method, path, **kwargs)
            got = _result(request, response)
            out.extend(got)
            left -= len(got)
            request = _next_page(request, left, page, got, _cut(response))
        return out

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        ops, reads, puts = _plan(ops)
        results: list[Result] = [None] * len(ops)
        for i in reads:
            results[i] = self._read(ops[i])
        for op in puts:
            method, path, kwargs = _request(op)
            _result(op, self.client.request(method, path, **kwargs))
        return results

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        ops, reads, puts = _plan(ops)
        results: list[Result] = [None] * len(ops)
        for i in reads:
            results[i] = await self._aread(ops[i])
        for op in puts:
            method, path, kwargs = _request(op)
            _result(op, await self.aclient.request(method, path, **kwargs))
        return results

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    async def aclose(self) -> None:
        if self._aclient is not None:
            await self._aclient.aclose()
