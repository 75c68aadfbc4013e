"""ZeroMem's Python client: tool calls, memories as REST resources with ETags, batches, and
retries that are safe to repeat.

Depends on httpx only; importing it needs no Django. ``ZeroMem`` is synchronous,
``AsyncZeroMem`` the same API with ``await``::

    from zeromem_client import ZeroMem

    zm = ZeroMem("http://127.0.0.1:8000", api_key="zm_...")
    zm.memory_write(key="user:u1:pref_lang", value="zh-CN")
    zm.memory_read(key="user:u1:pref_lang")["value"]          # 'zh-CN' (as the model reads it:
                                                               # past 2,000 characters, cut)
    m = zm.get("user:u1:pref_lang")                            # REST, with m["etag"]
    zm.put("user:u1:pref_lang", "en", if_match=m["etag"])      # PreconditionFailed if it moved

Retries: a 429 (rate limited, tenant busy), a 503 (database unavailable, search timeout), a
409 ``idempotency_in_progress`` (a retry that found its first attempt still running) or a
connection error is retried up to ``max_attempts`` times in all, waiting ``Retry-After`` when
the server gives one, else exponential backoff with full jitter. Every write (POST, PUT,
PATCH, DELETE) carries an ``Idempotency-Key`` that stays the same across its retries, so a
retried write is answered with the first answer instead of being done twice.

A batch answers 200 whatever its calls met. When some of its calls met a transient failure
(rate limited, busy, the database or a search unavailable, a server bug: the answer's
``pending`` lists them; from an older server without it, :data:`TRANSIENT_CALL_CODES`), the
server keeps the answer as a partial one that a retry with the same ``Idempotency-Key``
resumes: only those calls run again, the others' results stand. ``batch``
sends it again so, within the same ``max_attempts`` and waits (a call's ``retry_after``, else
backoff), and returns the last results. A batch sent without a key (``idempotency=False`` and
no ``idempotency_key=``) is not sent again: the server would run every call a second time.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from urllib.parse import quote

import httpx

__all__ = [
    "AsyncZeroMem",
    "ZeroMem",
    "ZeroMemError",
    "NotFound",
    "Conflict",
    "PreconditionFailed",
    "RateLimited",
    "Unavailable",
    "TOOL_NAMES",
    "TRANSIENT_CALL_CODES",
]

__version__ = "0.1.0"

TOOL_NAMES = (
    "memory_write",
    "memory_read",
    "memory_update",
    "memory_delete",
    "memory_list",
    "memory_search",
    "memory_recall",
    "memory_summarize",
)

RETRY_STATUSES = frozenset({429, 503})
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# A batch call's error codes that say "not done, try again" (the server's 429s and 5xx, and a
# call's internal_error): the server keeps such a batch's answer as a partial one that a retry
# with the same Idempotency-Key resumes, running those calls alone. Used only for a server too
# old to say which calls are pending (the answer's "pending", which wins when present). A code
# missing here is not resumed (safe); one the server kept as final would be replayed as it was
# (harmless).
TRANSIENT_CALL_CODES = frozenset(
    {
        "rate_limited",
        "tenant_busy",
        "search_budget",
        "too_many_jobs",
        "database_unavailable",
        "search_timeout",
        "list_timeout",
        "unavailable",
        "internal_error",
    }
)


class ZeroMemError(Exception):
    """An error answer: ``status``, and the error envelope's ``code``, ``message``, ``field``."""

    def __init__(self, status: int, body: Any, headers: httpx.Headers | None = None):
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        self.status = status
        self.code = error.get("code") or f"http_{status}"
        self.message = error.get("message") or ""
        self.field = error.get("field")
        self.body = body
        self.headers = headers or httpx.Headers()
        super().__init__(f"{status} {self.code}: {self.message}" + (f" (field {self.field})" if self.field else ""))


class NotFound(ZeroMemError):
    """404: no memory there (another tenant's memory answers the same)."""


class Conflict(ZeroMemError):
    """409: ``expected_version`` is not the current version."""


class PreconditionFailed(ZeroMemError):
    """412: ``If-Match`` names a version that is no longer current."""


class RateLimited(ZeroMemError):
    """429 after the last attempt (``rate_limited`` or ``tenant_busy``)."""


class Unavailable(ZeroMemError):
    """503 after the last attempt."""


_ERRORS = {404: NotFound, 409: Conflict, 412: PreconditionFailed, 429: RateLimited, 503: Unavailable}


def _error(response: httpx.Response) -> ZeroMemError:
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"code": f"http_{response.status_code}", "message": response.text[:200]}}
    return _ERRORS.get(response.status_code, ZeroMemError)(response.status_code, body, response.headers)


def _error_code(response: httpx.Response) -> str | None:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def transient_errors(response: httpx.Response) -> list[dict]:
    """The errors of a batch answer's calls that met a transient failure, in call order; none
    for any other answer. Those the answer's ``pending`` names (the calls a retry with the same
    ``Idempotency-Key`` runs again, as the server decided); from a server too old to say, those
    whose code is in :data:`TRANSIENT_CALL_CODES`."""
    # An answer with no error result is not decoded (it may be megabytes): a pending call's
    # result is always an error. One with "error" anywhere in it (a value saying so) costs a
    # decoding more.
    if response.status_code != 200 or b'"error"' not in response.content:
        return []
    try:
        body = response.json()
    except ValueError:
        return []
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list):
        return []
    pending = body.get("pending")
    if isinstance(pending, list):
        indexes = [i for i in pending if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(results)]
        errors = [results[i].get("error") if isinstance(results[i], dict) else None for i in indexes]
        # A pending call's error is there whatever its code; an entry without one still counts.
        return [e if isinstance(e, dict) else {} for e in errors]
    errors = [r.get("error") for r in results if isinstance(r, dict)]
    return [e for e in errors if isinstance(e, dict) and e.get("code") in TRANSIENT_CALL_CODES]


def retry_after_seconds(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header: a number of seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class _Core:
    """What both clients share: URLs, headers, the retry schedule, answers into results."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        max_attempts: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        max_retry_after: float = 60.0,
        timeout: float = 30.0,
        idempotency: bool = True,
    ):
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        base = base_url.rstrip("/")
        if not base.endswith("/api/v1"):
            base += "/api/v1"
        self.base = base
        self.headers = {"Authorization": f"Bearer {api_key}", "User-Agent": f"zeromem-client/{__version__}"}
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_retry_after = max_retry_after
        self.timeout = timeout
        self.idempotency = idempotency

    def _headers(self, method: str, headers: dict | None, idempotency_key: str | None) -> dict:
        out = dict(headers or {})
        # idempotency=False turns off the keys made up here; a key the caller chose is sent.
        if method in WRITE_METHODS and (self.idempotency or idempotency_key):
            out.setdefault("Idempotency-Key", idempotency_key or uuid.uuid4().hex)
        return out

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        """How long to wait before attempt ``attempt + 1`` (attempts count from 1)."""
        if response is not None:
            seconds = retry_after_seconds(response.headers.get("Retry-After"))
            if seconds is None:  # a batch's 200: the longest its transient calls were told
                afters = [e["retry_after"] for e in transient_errors(response) if _seconds(e.get("retry_after"))]
                seconds = max(afters, default=None)
            if seconds is not None:
                # The server said when; a little jitter spreads clients told the same second.
                return min(seconds, self.max_retry_after) + random.uniform(0, 0.1)  # nosec B311: jitter
        ceiling = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
        return random.uniform(0, ceiling)  # nosec B311: full jitter, not a secret

    def _retryable(self, attempt: int, response: httpx.Response | None) -> bool:
        if attempt >= self.max_attempts:
            return False
        if response is None or response.status_code in RETRY_STATUSES:
            return True
        # A retry that found its first attempt still running (it timed out here, not there):
        # waiting gets that attempt's answer; raising Conflict would report a write not done.
        return response.status_code == 409 and _error_code(response) == "idempotency_in_progress"

    def _resumable(self, attempt: int, headers: dict, response: httpx.Response) -> bool:
        """Whether a batch's answer is sent again to resume it: some of its calls met a
        transient failure, attempts are left, and it carries an ``Idempotency-Key`` — without
        one the server could not tell the resend from a new batch, and every call that
        committed would run a second time."""
        return attempt < self.max_attempts and "Idempotency-Key" in headers and bool(transient_errors(response))

    @staticmethod
    def _settled(response: httpx.Response, partial: httpx.Response | None) -> httpx.Response:
        """The answer a request ends with: after a batch's partial 200, a resumption refused
        (still busy once the attempts ran out, the connection lost) leaves that 200 — its
        results are true, and raising would hide the calls that committed."""
        return partial if partial is not None and response.status_code != 200 else response

    @staticmethod
    def _may_resend(method: str, headers: dict, exc: httpx.TransportError) -> bool:
        """Whether a request that failed in transit may be sent again. A write without an
        ``Idempotency-Key`` (``idempotency=False``) may have been done before its answer was
        lost, and the server could not tell a resend from a new write: only a connection
        that never carried it is retried."""
        if method not in WRITE_METHODS or "Idempotency-Key" in headers:
            return True
        return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)

    @staticmethod
    def _memory_path(key: str) -> str:
        # "." and ".." are keys, but as a URL path segment httpx removes them (RFC 3986 dot
        # segments): spelled %2E, they reach the memory (the server decodes them).
        quoted = quote(key, safe="")
        return f"/memories/{quoted.replace('.', '%2E') if quoted in ('.', '..') else quoted}"

    @staticmethod
    def _memory(response: httpx.Response) -> dict:
        body = response.json()
        body["etag"] = response.headers.get("ETag")
        return body

    @staticmethod
    def _tool_result(response: httpx.Response) -> dict:
        if response.status_code >= 400:
            raise _error(response)  # before decoding: a proxy's error page is not JSON
        return response.json()

    @staticmethod
    def _call_body(name: str, arguments: dict) -> dict:
        return {"name": name, "arguments": {k: v for k, v in arguments.items() if v is not None}}

    @staticmethod
    def _fields(value: Any, fields: dict) -> dict:
        body = {k: v for k, v in fields.items() if v is not None}
        if value is not _MISSING:
            body["value"] = value
        return body

    @staticmethod
    def _if_match(if_match: str | None) -> dict:
        return {"If-Match": if_match} if if_match else {}


_MISSING = object()


def _seconds(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _tool_method(name: str):
    def sync_method(self, **arguments):
        return self.call(name, **arguments)

    sync_method.__name__ = name
    sync_method.__doc__ = (
        f"The ``{name}`` tool; keyword arguments as in GET /api/v1/tools; its result as the model"
        " sees it (``memory_read`` and each ``memory_search`` result cut a long value: ``get`` reads"
        " it whole)."
    )
    return sync_method


class ZeroMem(_Core):
    """Synchronous client. ``sleep`` is how it waits between attempts (``time.sleep``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        http: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        **options,
    ):
        super().__init__(base_url, api_key, **options)
        self._http = http or httpx.Client(timeout=self.timeout)
        self._sleep = sleep

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ZeroMem:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = _MISSING,
        params: dict | None = None,
        headers: dict | None = None,
        idempotency_key: str | None = None,
        resume_batch: bool = False,
    ) -> httpx.Response:
        """One logical request, with its retries: the last response (any status).

        ``resume_batch``: a 200 some of whose calls met a transient failure is sent again
        with its ``Idempotency-Key`` (see :meth:`_resumable`), within the same attempts."""
        headers = {**self.headers, **self._headers(method, headers, idempotency_key)}
        kwargs = {} if json is _MISSING else {"json": json}
        attempt, partial = 0, None
        while True:
            attempt += 1
            try:
                response = self._http.request(method, self.base + path, params=params, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                if not self._retryable(attempt, None) or not self._may_resend(method, headers, exc):
                    if partial is not None:
                        return partial
                    raise
                self._sleep(self._delay(attempt, None))
                continue
            if resume_batch and self._resumable(attempt, headers, response):
                partial = response
            elif not self._retryable(attempt, response):
                return self._settled(response, partial)
            self._sleep(self._delay(attempt, response))

    def _ok(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            raise _error(response)
        return response

    # --- tool calls ---------------------------------------------------------------------

    def tools(self, format: str = "openai", *, strict: bool = True) -> list[dict]:
        r = self._ok(self.request("GET", "/tools", params={"format": format, "strict": str(strict).lower()}))
        return r.json()["tools"]

    def call(self, name: str, *, idempotency_key: str | None = None, **arguments) -> dict:
        """Run one tool; ``ok``, ``not_found`` and ``conflict`` results are returned, errors raised."""
        body = self._call_body(name, arguments)
        return self._tool_result(self.request("POST", "/tools/call", json=body, idempotency_key=idempotency_key))

    def batch(self, calls: list[dict], *, idempotency_key: str | None = None) -> list[dict]:
        """Up to 50 calls (``{"name", "arguments"}``) in one round trip; each result stands alone.

        Calls that met a transient failure are run again — the batch sent again with its
        ``Idempotency-Key``, which the server resumes (the other calls are not run twice) —
        until none is left or ``max_attempts`` ran out; the last results are returned. Not
        without a key (``idempotency=False`` and no ``idempotency_key``): their errors are
        returned as they are."""
        body = {"calls": calls}
        r = self.request("POST", "/tools/batch", json=body, idempotency_key=idempotency_key, resume_batch=True)
        return self._ok(r).json()["results"]

    for _name in TOOL_NAMES:
        locals()[_name] = _tool_method(_name)
    del _name

    # --- memories as resources ----------------------------------------------------------

    def get(self, key: str) -> dict:
        """One memory, with ``etag`` (for ``if_match``). Raises NotFound."""
        return self._memory(self._ok(self.request("GET", self._memory_path(key))))

    def put(self, key: str, value: Any = _MISSING, *, if_match: str | None = None, **fields) -> dict:
        """Create or replace; with ``if_match`` only that version (else PreconditionFailed)."""
        r = self.request(
            "PUT", self._memory_path(key), json=self._fields(value, fields), headers=self._if_match(if_match)
        )
        return self._memory(self._ok(r))

    def patch(self, key: str, value: Any = _MISSING, *, if_match: str | None = None, **fields) -> dict:
        """Change fields of an existing memory (NotFound, PreconditionFailed, Conflict)."""
        r = self.request(
            "PATCH", self._memory_path(key), json=self._fields(value, fields), headers=self._if_match(if_match)
        )
        return self._memory(self._ok(r))

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        """Move to the trash (NotFound, PreconditionFailed)."""
        self._ok(self.request("DELETE", self._memory_path(key), headers=self._if_match(if_match)))

    def list(self, prefix: str = "", *, limit: int | None = None, cursor: str | None = None, **filters) -> dict:
        """One page: ``{"results": [...], "next_cursor": ...}``."""
        params = {k: v for k, v in {"prefix": prefix, "limit": limit, "cursor": cursor, **filters}.items() if v}
        return self._ok(self.request("GET", "/memories", params=params)).json()

    def iter(self, prefix: str = "", *, page_size: int = 200, **filters) -> Iterator[dict]:
        """Every memory under ``prefix``, following the cursor."""
        cursor = None
        while True:
            page = self.list(prefix, limit=page_size, cursor=cursor, **filters)
            yield from page["results"]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def history(self, key: str, *, limit: int | None = None) -> list[dict]:
        """The ``limit`` (default 50) newest versions, following ``next_cursor``: a page stops
        early at the server's byte budget (ZEROMEM_PAGE_VALUES_MAX_BYTES)."""
        wanted, found, cursor = limit or 50, [], None
        while len(found) < wanted:
            params = {"limit": wanted - len(found), **({"cursor": cursor} if cursor else {})}
            page = self._ok(self.request("GET", self._memory_path(key) + "/history", params=params)).json()
            found.extend(page["results"])
            cursor = page.get("next_cursor")
            if not cursor:
                break
        return found

    # --- Claude's memory tool -----------------------------------------------------------

    def anthropic_memory(self, command: dict, *, root: str | None = None) -> httpx.Response:
        """One ``memory_20250818`` command (the tool_use input) → the raw answer."""
        params = {"root": root} if root else None
        return self.request("POST", "/anthropic/memory", json=command, params=params)


def _async_tool_method(name: str):
    async def async_method(self, **arguments):
        return await self.call(name, **arguments)

    async_method.__name__ = name
    async_method.__doc__ = (
        f"The ``{name}`` tool; keyword arguments as in GET /api/v1/tools; its result as the model"
        " sees it (``memory_read`` and each ``memory_search`` result cut a long value: ``get`` reads"
        " it whole)."
    )
    return async_method


async def _async_sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


class AsyncZeroMem(_Core):
    """Asynchronous client: the same methods as :class:`ZeroMem`, awaited."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        http: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Any] = _async_sleep,
        **options,
    ):
        super().__init__(base_url, api_key, **options)
        self._http = http or httpx.AsyncClient(timeout=self.timeout)
        self._sleep = sleep

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncZeroMem:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = _MISSING,
        params: dict | None = None,
        headers: dict | None = None,
        idempotency_key: str | None = None,
        resume_batch: bool = False,
    ) -> httpx.Response:
        headers = {**self.headers, **self._headers(method, headers, idempotency_key)}
        kwargs = {} if json is _MISSING else {"json": json}
        attempt, partial = 0, None
        while True:
            attempt += 1
            try:
                response = await self._http.request(method, self.base + path, params=params, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                if not self._retryable(attempt, None) or not self._may_resend(method, headers, exc):
                    if partial is not None:
                        return partial
                    raise
                await self._sleep(self._delay(attempt, None))
                continue
            if resume_batch and self._resumable(attempt, headers, response):
                partial = response
            elif not self._retryable(attempt, response):
                return self._settled(response, partial)
            await self._sleep(self._delay(attempt, response))

    def _ok(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            raise _error(response)
        return response

    async def tools(self, format: str = "openai", *, strict: bool = True) -> list[dict]:
        r = await self.request("GET", "/tools", params={"format": format, "strict": str(strict).lower()})
        return self._ok(r).json()["tools"]

    async def call(self, name: str, *, idempotency_key: str | None = None, **arguments) -> dict:
        body = self._call_body(name, arguments)
        return self._tool_result(await self.request("POST", "/tools/call", json=body, idempotency_key=idempotency_key))

    async def batch(self, calls: list[dict], *, idempotency_key: str | None = None) -> list[dict]:
        """As :meth:`ZeroMem.batch`: calls that met a transient failure resumed with its key."""
        body = {"calls": calls}
        r = await self.request("POST", "/tools/batch", json=body, idempotency_key=idempotency_key, resume_batch=True)
        return self._ok(r).json()["results"]

    for _name in TOOL_NAMES:
        locals()[_name] = _async_tool_method(_name)
    del _name

    async def get(self, key: str) -> dict:
        return self._memory(self._ok(await self.request("GET", self._memory_path(key))))

    async def put(self, key: str, value: Any = _MISSING, *, if_match: str | None = None, **fields) -> dict:
        r = await self.request(
            "PUT", self._memory_path(key), json=self._fields(value, fields), headers=self._if_match(if_match)
        )
        return self._memory(self._ok(r))

    async def patch(self, key: str, value: Any = _MISSING, *, if_match: str | None = None, **fields) -> dict:
        r = await self.request(
            "PATCH", self._memory_path(key), json=self._fields(value, fields), headers=self._if_match(if_match)
        )
        return self._memory(self._ok(r))

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        self._ok(await self.request("DELETE", self._memory_path(key), headers=self._if_match(if_match)))

    async def list(self, prefix: str = "", *, limit: int | None = None, cursor: str | None = None, **filters) -> dict:
        params = {k: v for k, v in {"prefix": prefix, "limit": limit, "cursor": cursor, **filters}.items() if v}
        return self._ok(await self.request("GET", "/memories", params=params)).json()

    async def iter(self, prefix: str = "", *, page_size: int = 200, **filters) -> AsyncIterator[dict]:
        cursor = None
        while True:
            page = await self.list(prefix, limit=page_size, cursor=cursor, **filters)
            for item in page["results"]:
                yield item
            cursor = page.get("next_cursor")
            if not cursor:
                return

    async def history(self, key: str, *, limit: int | None = None) -> list[dict]:
        """As :meth:`ZeroMem.history`: the ``limit`` newest versions, across pages."""
        wanted, found, cursor = limit or 50, [], None
        while len(found) < wanted:
            params = {"limit": wanted - len(found), **({"cursor": cursor} if cursor else {})}
            r = await self.request("GET", self._memory_path(key) + "/history", params=params)
            page = self._ok(r).json()
            found.extend(page["results"])
            cursor = page.get("next_cursor")
            if not cursor:
                break
        return found

    async def anthropic_memory(self, command: dict, *, root: str | None = None) -> httpx.Response:
        params = {"root": root} if root else None
        return await self.request("POST", "/anthropic/memory", json=command, params=params)
