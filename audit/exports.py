"""Audit exports as CSV or JSON Lines, streamed: rows come in keyset pages of CHUNK_ROWS
and leave as they are encoded, so memory stays flat however many rows match
(``manage.py bench_audit`` measures it on a million events).

Under ASGI the response body is an async iterator that fetches each chunk in the request's
thread (a sync iterator would be read whole into a list by Django before sending).

Its end — the last chunk taken, or the stream closed early — is recorded as
``audit.export_end`` with the rows delivered (:func:`_chunks`).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import UTC

from asgiref.sync import sync_to_async
from django.db import connection, connections
from django.http import StreamingHttpResponse
from django.utils import timezone

from audit import selectors
from audit.models import REVIEW_FIELDS
from audit.seals import seal_numbers
from audit.selectors import AuditFilters, few_by_index, list_page_bounds
from audit.services import audit_export_end, audit_export_start
from zeromem.kernel import opaque
from zeromem.kernel.actors import Actor, require_still_held
from zeromem.kernel.replica import REPLICA, replica_configured, replica_reads

logger = logging.getLogger(__name__)

CHUNK_ROWS = 2000
COLUMNS = (*REVIEW_FIELDS, "seal", "digest")
CONTENT_TYPES = {"csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson"}
# Spreadsheets run a cell that starts with one of these as a formula (CSV injection);
# such cells get a leading apostrophe in CSV exports (JSON Lines keep the text as it is).
_FORMULA_CHARS = r"=+\-@\t\r"
# A cell starts at the field's start, after a ";" inside it (a spreadsheet in a locale with
# a decimal comma splits CSV on ";"; after a '"' there a quoted cell opens) and after a CR or
# LF inside it (the same reader, its quoting lapsed, starts a row there; so does any reader
# that splits lines without minding quotes). Quoting every field (QUOTE_ALL) would not do: a
# ";" reader takes the quote after a closed quoted field as plain text, so the next field's
# ";" splits unquoted. A cell whose first character other than spaces, tabs and quotes is a
# formula character (spreadsheets may trim the spaces: " =1+1") gets the apostrophe at its
# very start: "'" + field, ";'" and "\n'".
_FORMULA_CELL = re.compile(rf'(?:^|(?<=[;\r\n]))(?=[ \t"]*[{_FORMULA_CHARS}])')
_CELL_MAY_START = (" ", "\t", '"', "=", "+", "-", "@", "\r")
# Line breaks to str.splitlines() and JavaScript, which json.dumps leaves raw in a string
# (it escapes only the ASCII controls): escaped, so a JSON Lines record stays one line.
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def _plain(row: dict) -> dict:
    # The instant as the REST list writes it (DRF: UTC, "Z"), so an export and the list
    # show an event alike and can be compared as text.
    # "id" is the event's uid: its row id comes from a sequence every tenant shares.
    out = dict(row)
    out["id"] = str(out.pop("uid"))
    out["actor_id"] = opaque.shown_actor_id(row["actor_kind"], row["actor_id"])
    out["occurred_at"] = row["occurred_at"].astimezone(UTC).isoformat().replace("+00:00", "Z")
    return out


def _csv_cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, dict):
        value = json.dumps(value, sort_keys=True, ensure_ascii=False)
    text = str(value)
    # Most cells have no cell start but their first character: one cheap look first.
    if not text.startswith(_CELL_MAY_START) and ";" not in text and "\n" not in text and "\r" not in text:
        return text
    return _FORMULA_CELL.sub("'", text)


def _one_line(text: str) -> str:
    for char, escape in _LINE_BREAKS.items():
        if char in text:
            text = text.replace(char, escape)
    return text


def encode_rows(rows: Iterator[dict], fmt: str) -> Iterator[bytes]:
    """Encode rows, yielding one bytes chunk per CHUNK_ROWS rows (CSV starts with a header)."""
    for chunk, _rows in _encoded(rows, fmt):
        yield chunk


def _encoded(rows: Iterator[dict], fmt: str) -> Iterator[tuple[bytes, int]]:
    """:func:`encode_rows`'s chunks, each with how many rows it holds."""
    buffer = io.StringIO()
    writer = csv.writer(buffer) if fmt == "csv" else None
    if writer is not None:
        writer.writerow(COLUMNS)
    n = 0
    for row in rows:
        row = _plain(row)
        if writer is not None:
            writer.writerow([_csv_cell(row[c]) for c in COLUMNS])
        else:
            line = json.dumps({c: row[c] for c in COLUMNS}, ensure_ascii=False, separators=(",", ":"))
            buffer.write(_one_line(line))
            buffer.write("\n")
        n += 1
        if n % CHUNK_ROWS == 0:
            yield buffer.getvalue().encode(), CHUNK_ROWS
            buffer.seek(0)
            buffer.truncate()
    if buffer.tell():
        yield buffer.getvalue().encode(), n % CHUNK_ROWS


def _pages(queryset, tenant, filters: AuditFilters, actor: Actor) -> Iterator[dict]:
    """The rows, newest first, in windows of the tenant's log as the review list reads it
    (:func:`audit.selectors.list_page_bounds`): each query reads at most
    ``selectors.EXPORT_SCAN_MAX`` of the tenant's events (a subject or key prefix naming few
    events: by its own index) and answers at most CHUNK_ROWS of the matches, by keyset on
    the id inside the window, then the next window below it. No server-side cursor, and the
    database connection goes back between queries: a client that reads slowly holds a
    thread, never a pooled connection, and a filter few events match (an actor, an action,
    an outcome) no longer reads the tenant's whole log in one query. The windows are
    contiguous id ranges, so every matching event comes once, in order. A row's ``seal`` is
    its seal's number (a range seal's: one query over the page's seals). Before each page
    after the first, the reader's credential is asked again
    (:func:`~zeromem.kernel.actors.require_still_held`): an API key revoked or expired since
    the export began, or a staff user disabled or no longer holding their role in the tenant
    (the admin's export), ends the stream there, cut short (the server aborts the body)."""
    with replica_reads():  # an export may lag the log by the replica's delay
        few = few_by_index(tenant=tenant, filters=filters)
    before = bounds = None
    first = True
    while True:
        if not first:
            require_still_held(actor, tenant.pk)
        first = False
        with replica_reads():
            if bounds is None:
                bounds = list_page_bounds(
                    tenant=tenant, filters=filters, before=before, few=few, window=selectors.EXPORT_SCAN_MAX
                )
            rows = list(bounds.narrow(queryset).order_by("-id").values(*COLUMNS, "uid")[:CHUNK_ROWS])
            numbers = seal_numbers(tenant.pk, [r["id"] for r in rows if r["seal"] is None])
        for row in rows:
            if row["seal"] is None:
                row["seal"] = numbers.get(row["id"])
        if not connection.in_atomic_block:
            connection.close()  # with the pool: back to the pool until the next query
            if replica_configured():
                connections[REPLICA].close()
        yield from rows
        if len(rows) == CHUNK_ROWS:  # more of this window below the last row
            bounds = replace(bounds, before=rows[-1]["id"])
        elif bounds.floor is not None:  # the window is read: the next one below it
            before, bounds = bounds.floor, None
        else:
            return


def _chunks(queryset, tenant, filters: AuditFilters, fmt: str, actor: Actor, export: int | None) -> Iterator[bytes]:
    """The export's body; when it ends, its ``audit.export_end`` event (:func:`_ended`): the
    rows delivered — a chunk's once the server comes back for the next one (it has sent it),
    every row when the body runs to its end — and whether it did. Cut short (the server
    closes the body when the client goes away; the reader's key withdrawn) it counts what went
    out before."""
    delivered, complete = 0, False
    try:
        for chunk, rows in _encoded(_pages(queryset, tenant, filters, actor), fmt):
            yield chunk
            delivered += rows
        complete = True
    finally:
        _ended(tenant=tenant, actor=actor, export=export, rows=delivered, complete=complete)


def _ended(**event) -> None:
    """Write the ``audit.export_end`` event in a short transaction of its own, then hand the
    connection back (as between pages): nothing is held while the server finishes the body.
    A failure to write it (the database gone) is logged, not raised over the stream's end."""
    try:
        audit_export_end(**event)
    except Exception:
        logger.exception("audit export %s: its end could not be recorded", event.get("export"))
    if not connection.in_atomic_block:
        connection.close()


async def _async_chunks(
    queryset, tenant, filters: AuditFilters, fmt: str, actor: Actor, export: int | None
) -> AsyncIterator[bytes]:
    chunks = _chunks(queryset, tenant, filters, fmt, actor, export)
    fetch = sync_to_async(lambda: next(chunks, None), thread_sensitive=True)
    try:
        while (chunk := await fetch()) is not None:
            yield chunk
    finally:
        # Cut short (the client went away): the sync body's end is recorded in the request's
        # thread, where its connection lives, not when the garbage collector gets to it.
        await sync_to_async(chunks.close, thread_sensitive=True)()


def audit_export_response(
    *, tenant, actor, filters: AuditFilters, fmt: str, asynchronous: bool = False
) -> StreamingHttpResponse:
    """Check, audit (``audit.export``) and stream the tenant's events matching ``filters``,
    newest first, and audit its end with the rows delivered (``audit.export_end``).
    ``asynchronous``: the request is served under ASGI."""
    queryset, export = audit_export_start(tenant=tenant, actor=actor, filters=filters, fmt=fmt)
    chunks = _async_chunks if asynchronous else _chunks
    body = chunks(queryset, tenant, filters, fmt, actor, export)
    response = StreamingHttpResponse(body, content_type=CONTENT_TYPES[fmt])
    stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
    response["Content-Disposition"] = f'attachment; filename="audit-{tenant.slug}-{stamp}.{fmt}"'
    response["Cache-Control"] = "no-store"
    return response
