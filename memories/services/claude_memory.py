"""Claude's memory tool (``memory_20250818``) on ZeroMem memories.

The model sees a directory, ``/memories``; each file is one memory whose value is the file's
text. A path maps to a key under a root key (default ``claude:memories``, a request may name
another, e.g. ``user:u10086:memories``): ``/memories/notes/a.md`` is the key
``claude:memories:notes:a.md`` — path segments become key segments, so a path segment must be
a valid key segment (letters, digits, ``_ - . @ + = ~``). Directories are not stored: a path
is a directory when keys lie under it (``/memories`` itself always is one), so a directory
disappears with its last file, as in git. The tool never makes a path both a file and a
directory, but other surfaces write any keys (REST ``claude:memories:a`` and
``claude:memories:a:b``): then the file wins, as on a file system — what lies under a file is
not listed, read or edited through it (a path through a file does not exist), and goes with
it on a delete or a rename, so the path the model deleted or moved is gone. The key's
allowlist and scopes govern the root like any key; every step runs through the memory
services (their audit events carry the surface, ``anthropic_memory``).

The six commands answer with the texts of the Anthropic SDK's reference file-system backend
(``anthropic.lib.tools._beta_builtin_memory_tool.BetaLocalFilesystemMemoryTool``); what it
raises as a ``ToolError`` (an ``is_error`` tool result the model reads) is
:class:`MemoryToolError` here. A directory's size in a listing is the bytes of the files
under it (a file system shows its inode size).
"""

from __future__ import annotations

import errno
import json
import math
import os
import unicodedata
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from audit.services import audit_record, events_written
from memories import selectors
from memories.models import Memory, Tenant
from memories.services import memories as mem
from memories.services.api_keys import rate_limit_charge_items
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor
from zeromem.kernel.crypto import ErasedValue
from zeromem.kernel.errors import Conflict, Forbidden, InvalidInput, NotFound, PayloadTooLarge
from zeromem.kernel.outcomes import Outcome

DEFAULT_ROOT = "claude:memories"
# Creating a file or renaming onto a path checks that no file stands where a directory is
# needed and no directory where the file goes; two such commands at once (/memories/a.md and
# /memories/a.md/b.md) could both pass, leaving a path both a file and a directory. And a
# directory's rename moves the files it listed: a file created in it meanwhile (the create
# answered first) stayed at the old path, outside the directory the model moved. A
# directory's delete likewise: a file created in it (or renamed into it) meanwhile was left
# behind, the directory the model deleted still there. And an edit that had read its file
# before a rename or delete of it went on after them, answering an error result ("deleted or
# renamed concurrently"; its row lock and version check kept the text, not the order). So
# every command but view first takes transaction-level advisory locks on its paths' keys and
# every key above them, in the tree of keys: exclusive on the path it writes (a rename: on
# its source and its destination), shared on each key above it (so the root's, and those
# above the root's: a root under another root is one tree). Commands whose paths can clash
# (one path is the other or above it) meet on a key one holds exclusive: the second waits for
# the first's commit and sees its work. Creates in one directory only share the locks above
# them, and run at once. Taken in key order (a key sorts before those under it): two renames
# a -> b and b -> a take them in one order, so neither holds one the other waits for.
# Only the first TREE_LOCK_DEPTH key segments are locked: a deeper path locks that deep a key
# exclusive in its place (still meeting every path that can clash with it, at the cost of
# creates deeper than that in one directory waiting on each other). A 512-character key has
# up to 256 segments: a rename of two such paths held 512 locks, and a few dozen such commands
# at once would fill PostgreSQL's lock table (64 × max_connections, shared with every
# table's locks): "out of shared memory" for every tenant.
# One bigint each: hashtextextended() of "ZT:<tenant>:<key>", 64 bits. It was two ints, a
# namespace and hashtext(), 32 bits: 100,000 names (all tenants') held ~1 pair whose commands
# waited on each other; 64 bits, ~3e-10 pairs. PostgreSQL keeps one-bigint locks apart from
# the other services' two-int ones.
_TREE_LOCK_TAG = "ZT"
TREE_LOCK_DEPTH = 8

ROOT_PATH = "/memories"
MAX_LINES = 999999
LINE_NUMBER_WIDTH = len(str(MAX_LINES))
# A listing reads at most this many memories under the directory (200 per page).
LIST_MAX_MEMORIES = 5000
# A listing answers at most this many characters (the largest slice a read of a value
# answers, README "Token cost"); past it, it ends with a line saying which entries it showed
# and the view_range that lists the next ones. 10,000 files of long names were 2.5 MB.
LIST_MAX_CHARS = 16384
# A directory's rename loads the values of this many files at a time.
MOVE_CHUNK = 100
COMMANDS = ("view", "create", "str_replace", "insert", "delete", "rename")


class MemoryToolError(Exception):
    """What the model gets back as an error tool result (``is_error``), in the SDK's words;
    ``field``: the command's field it is about, when known (a path refused as such)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Place:
    path: str  # as the model wrote it
    key: str  # the memory key it maps to
    is_root: bool
    names: tuple[str, ...] = ()  # its names under /memories, "." and ".." resolved

    def shown(self, depth: int | None = None) -> str:
        """The path as a file system spells it (resolved), or that of its first ``depth`` names."""
        return "/".join((ROOT_PATH, *self.names[:depth]))


class MemoryTool:
    """One tenant's and actor's view of the ``/memories`` directory under ``root``."""

    def __init__(self, *, tenant: Tenant, actor: Actor, root: Any = None):
        root = DEFAULT_ROOT if root in (None, "") else root
        self.root = validation.key(root, field="root")
        self.tenant = tenant
        self.actor = actor

    # --- paths and keys ------------------------------------------------------------------

    def place(self, path: str, field: str = "path") -> Place:
        if path != ROOT_PATH and not path.startswith(ROOT_PATH + "/"):
            raise MemoryToolError(f"Path must start with /memories, got: {path}", field)
        segments: list[str] = []
        for segment in path[len(ROOT_PATH) :].split("/"):
            if segment in ("", "."):
                continue
            if segment == "..":
                if not segments:
                    raise MemoryToolError(f"Path {path} would escape /memories directory", field)
                segments.pop()
                continue
            # NFC: macOS spells names decomposed ("e" + U+0301); composed, "café" either way
            # is one file (keys themselves are taken as given: two spellings, two keys).
            segments.append(unicodedata.normalize("NFC", segment))
        key = ":".join([self.root, *segments])
        try:
            # A ':' would split a name into key segments: /memories/a:b the file /memories/a/b.
            if any(":" in segment for segment in segments):
                raise InvalidInput("a name may not contain ':'", field="path")
            validation.key(key)
        except InvalidInput as exc:
            raise MemoryToolError(
                f"Path {path} cannot be stored: each name is letters (with their combining marks), "
                f"digits or _ - . @ + = ~ ({exc.message})",
                field,
            ) from None
        return Place(path=path, key=key, is_root=not segments, names=tuple(segments))

    def _memory(self, place: Place) -> Memory | None:
        """The file's memory, or None when there is no file at the path."""
        if place.is_root:
            return None
        if not self.actor.may_touch(place.key) and self._reaches(place.key):
            # Not a file to this caller but maybe a directory: an allowlist of
            # user:u1:m:notes: covers what lies under /memories/notes, not its own key (reading
            # it was a 403 for a view, delete or rename of the directory it lists).
            return None
        try:
            return mem.memory_read(tenant=self.tenant, actor=self.actor, key=place.key).memory
        except NotFound:
            return None

    def _reaches(self, key: str) -> bool:
        """Whether the key's allowlist reaches the key or anything under it."""
        return self.actor.may_touch(key) or bool(self.actor.prefix_filters(key + ":"))

    def _text(self, place: Place) -> tuple[str, int] | None:
        """The file's text and version, or None when there is no file at the path."""
        memory = self._memory(place)
        if memory is None:
            return None
        value = memory.value
        return (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)), memory.version

    def _under(self, place: Place, *, limit: int | None = None, rows: str = "memories") -> list:
        """The live memories under the directory ``place``, in key order (at most ``limit``,
        by default ``LIST_MAX_MEMORIES``): ``rows`` "memories" (values loaded), "keys", or
        "sizes" ((key, bytes of its text) pairs: the database measures the values). A page
        of "memories" stops at ``ZEROMEM_PAGE_VALUES_MAX_BYTES`` (``memory_list``), maybe
        short of ``limit``: what acts on all of a directory takes "keys" or "sizes"."""
        limit = LIST_MAX_MEMORIES if limit is None else limit
        # One page, so one memory.list event: pages of LIMIT_MAX wrote 25 for 5,000 files.
        return mem.memory_list(
            tenant=self.tenant,
            actor=self.actor,
            prefix=place.key + ":",
            limit=limit,
            keys_only=rows == "keys",
            sizes=rows == "sizes",
            page_max=LIST_MAX_MEMORIES + 1,
        ).keys

    def _all_under(self, place: Place, path: str, *, rows: str = "memories") -> list:
        """Every live memory under the directory ``place`` (``rows`` as :meth:`_under`), for a
        delete or a rename, which acts on all of them or on none: past ``LIST_MAX_MEMORIES``
        it is an error result (it did the first ones and answered success)."""
        under = self._under(place, limit=LIST_MAX_MEMORIES + 1, rows=rows)
        if len(under) > LIST_MAX_MEMORIES:
            raise MemoryToolError(
                f"The directory {path} holds more than {LIST_MAX_MEMORIES} files; "
                "delete or rename its subdirectories one at a time."
            )
        return under

    def _charge(self, files: int, *, field: str) -> None:
        """A directory's delete or rename changes every file under it in one command: one unit
        of an API key's rate limit per file, before anything changes (past the limit the command
        is refused, 429 ``rate_limited``)."""
        rate_limit_charge_items(
            self.actor,
            files,
            field=field,
            message=f"this command changes {files} files, one unit of the API key's rate limit each, "
            "past what is left of it this minute; try again later or on a smaller directory",
        )

    def _is_dir(self, place: Place) -> bool:
        return place.is_root or bool(self._under(place, limit=1, rows="keys"))

    def _under_a_file(self, place: Place) -> int | None:
        """How many names of ``place`` lead to the first of its parents that is a file
        (/memories/a.md/b/c.md while /memories/a.md is a file: 1), or None when none is: a
        path under a file is neither a file nor a directory. One indexed SELECT (the
        parents' keys; none of them is read, so no audit event)."""
        parents = {":".join([self.root, *place.names[:depth]]): depth for depth in range(1, len(place.names))}
        keys = [key for key in parents if self.actor.may_touch(key)]
        if not keys:
            return None
        files = selectors.memories_live(tenant=self.tenant).filter(key__in=keys).values_list("key", flat=True)
        return min((parents[key] for key in files), default=None)

    def _write(self, key: str, text: str) -> None:
        try:
            mem.memory_write(tenant=self.tenant, actor=self.actor, key=key, value=text)
        except PayloadTooLarge as exc:
            raise MemoryToolError(f"The file is too large: {exc.message}") from None

    def _move(self, memory: Memory, key: str) -> None:
        """``memory`` written again at ``key`` with what it carries besides its value — its
        subject, sensitivity, tags, category, importance, source and the rest of its TTL — so
        a renamed file stays encrypted, found by a forget of its subject, and expiring."""
        ttl = None
        if memory.expires_at is not None:
            left = math.ceil((memory.expires_at - timezone.now()).total_seconds())
            ttl = min(max(1, left), validation.TTL_MAX_SECONDS)
        erased = isinstance(memory.value, ErasedValue)  # nothing left to keep secret
        try:
            mem.memory_write(
                tenant=self.tenant,
                actor=self.actor,
                key=key,
                value=dict(memory.value) if erased else memory.value,
                ttl_seconds=ttl,
                tags=memory.tags,
                subject=memory.subject,
                category=memory.category,
                importance=memory.importance,
                source=memory.source or None,
                sensitive=memory.sensitive and not erased,
            )
        except PayloadTooLarge as exc:
            raise MemoryToolError(f"The file is too large: {exc.message}") from None

    def _update(self, place: Place, text: str, version: int) -> None:
        try:
            mem.memory_update(tenant=self.tenant, actor=self.actor, key=place.key, value=text, expected_version=version)
        except PayloadTooLarge as exc:
            raise MemoryToolError(f"The file is too large: {exc.message}") from None
        except (Conflict, NotFound):
            raise MemoryToolError(
                f"The file {place.path} no longer exists (may have been deleted or renamed concurrently)."
            ) from None

    # --- the commands --------------------------------------------------------------------

    def view(self, path: str, view_range: list[int] | None = None) -> str:
        place = self.place(path)
        if self._under_a_file(place) is not None:
            raise MemoryToolError(f"The path {path} does not exist. Please provide a valid path.")
        found = self._text(place)
        if found is not None:
            return self._view_file(path, found[0], view_range)
        if view_range and len(view_range) == 3:
            raise InvalidInput(
                "takes a third number (the character a line reads on from) on a file only; a directory's "
                "entries take two",
                field="view_range",
            )
        # One past the cap: a directory holding more is listed from its first LIST_MAX_MEMORIES
        # files and says so (it listed them as if they were all, leaving out the rest).
        sizes = self._under(place, limit=LIST_MAX_MEMORIES + 1, rows="sizes")
        if not sizes and not place.is_root:
            raise MemoryToolError(f"The path {path} does not exist. Please provide a valid path.")
        cut = len(sizes) > LIST_MAX_MEMORIES
        return self._listing(path, place, sizes[:LIST_MAX_MEMORIES], cut=cut, view_range=view_range)

    def _view_file(self, path: str, content: str, view_range: list[int] | None) -> str:
        lines = content.split("\n")
        if len(lines) > MAX_LINES:
            raise MemoryToolError(f"File {path} exceeds maximum line limit of 999,999 lines.")
        display, start, column = lines, 1, 1
        if view_range and len(view_range) >= 2:
            first = max(1, view_range[0]) - 1
            end = len(lines) if view_range[1] == -1 else view_range[1]
            display, start = lines[first:end], first + 1
            if len(view_range) == 3 and display:
                # A third number: the character of the first line to start at, where a cut
                # line's last line said to read on (the reference backend takes two numbers).
                column = view_range[2]
                display = [display[0][column - 1 :], *display[1:]]
        header = f"Here's the content of {path} with line numbers:"
        # At most LIST_MAX_CHARS, cut at a line's end: the line numbers alone made a 256 KB file
        # of short lines a ~1 MB answer. The last line says what view_range reads on. A first
        # line longer than that is cut within it, its last line saying from which character
        # to read on: a view of a 200,000-character line (a tenant's raised value cap)
        # answered 200,188 characters, ~50,000 tokens.
        left = LIST_MAX_CHARS - len(header) - len(path) - 200
        numbered = []
        for i, line in enumerate(display):
            text = f"{str(i + start).rjust(LINE_NUMBER_WIDTH)}\t{line}"
            if not numbered and len(text) + 1 > left:
                shown = left - 1 - (len(text) - len(line))
                numbered.append(text[: len(text) - len(line) + shown])
                last = column + shown - 1
                numbered.append(
                    f"(File cut at {LIST_MAX_CHARS} characters: line {start} of {len(lines)}, characters "
                    f"{column}-{last} of {column - 1 + len(line)} shown. "
                    f"View {path} with view_range [{start}, -1, {last + 1}] for the rest of it.)"
                )
                break
            if numbered and len(text) + 1 > left:
                last = start + len(numbered) - 1
                numbered.append(
                    f"(File cut at {LIST_MAX_CHARS} characters: lines {start}-{last} of {len(lines)} shown. "
                    f"View {path} with view_range [{last + 1}, -1] for the next ones.)"
                )
                break
            numbered.append(text)
            left -= len(text) + 1
        return header + "\n" + "\n".join(numbered)

    def _listing(
        self,
        path: str,
        place: Place,
        sizes: list[tuple[str, int]],
        *,
        cut: bool = False,
        view_range: list[int] | None = None,
    ) -> str:
        # Relative names → size; a directory's size is the bytes of the files under it.
        files: dict[tuple[str, ...], int] = {}
        for key, size in sizes:
            files[tuple(key[len(place.key) + 1 :].split(":"))] = size
        # A memory under a file (written by another surface) is behind it: not listed. Nor is
        # one whose names are not in NFC (another surface's "cafe\u0301"): no path reaches it,
        # since a path's names are taken in NFC (place).
        files = {
            rel: size
            for rel, size in files.items()
            if not any(rel[:d] in files for d in range(1, len(rel)))
            and all(unicodedata.is_normalized("NFC", name) for name in rel)
        }
        dirs: dict[tuple[str, ...], int] = {}
        for rel, size in files.items():
            for depth in range(1, len(rel)):
                dirs[rel[:depth]] = dirs.get(rel[:depth], 0) + size
        # Each entry's name under its parent, gathered once: looking for a directory's children
        # among every entry made a view of 5,000 top-level directories 6.4 s of CPU.
        children: dict[tuple[str, ...], set[str]] = {}
        for rel in (*files, *dirs):
            children.setdefault(rel[:-1], set()).add(rel[-1])
        items: list[tuple[str, str]] = []

        def collect(parent: tuple[str, ...], depth: int) -> None:
            for name in sorted(children.get(parent, ())):
                if name.startswith("."):
                    continue
                rel = (*parent, name)
                if rel in dirs:
                    items.append((_format_size(dirs[rel]), "/".join(rel) + "/"))
                    if depth < 2:
                        collect(rel, depth + 1)
                if rel in files:
                    items.append((_format_size(files[rel]), "/".join(rel)))

        collect((), 1)
        header = f"Here're the files and directories up to 2 levels deep in {path}, excluding hidden items:"
        lines = [f"{_format_size(sum(files.values()))}\t{path}"]
        # view_range on a directory: its entries first to end (1-based, end -1: the last), as
        # the line after a cut listing says; the reference backend ignores it there.
        first, end = 1, len(items)
        if view_range:
            first = max(1, view_range[0])
            end = len(items) if view_range[1] == -1 else min(len(items), view_range[1])
        # What is left for entries once the header, the directory's line and the notes below
        # (each ~200 characters and the path) are counted.
        left = LIST_MAX_CHARS - len(header) - len(lines[0]) - 2 * (len(path) + 220)
        shown = first - 1
        for size, name in items[first - 1 : end]:
            line = f"{size}\t{path}/{name}"
            if len(line) + 1 > left:
                break
            lines.append(line)
            left -= len(line) + 1
            shown += 1
        if shown < end:
            lines.append(
                f"(Listing cut at {LIST_MAX_CHARS} characters: entries {first}-{shown} of {len(items)} shown. "
                f"View {path} with view_range [{shown + 1}, -1] for the next ones.)"
            )
        if cut:
            lines.append(
                f"(Listing cut: {path} holds more than {LIST_MAX_MEMORIES} files; only the first "
                f"{LIST_MAX_MEMORIES} by name are listed and counted in the sizes above. "
                "View a subdirectory to see the rest.)"
            )
        return f"{header}\n" + "\n".join(lines)

    def _tree_locked(self, places: tuple[Place, ...], run):
        """``run()`` in one transaction holding the tree locks of ``places`` (see
        ``_TREE_LOCK_TAG``): every command but ``view`` runs in it. A refusal
        (:class:`MemoryToolError`) is raised after the commit, so the reads that led to it keep
        their audit events."""
        exclusive: dict[str, bool] = {}
        for place in places:
            if place.is_root:
                continue  # refused by the command: /memories is neither created nor moved
            segments = place.key.split(":")[:TREE_LOCK_DEPTH]
            for depth in range(1, len(segments)):
                exclusive.setdefault(":".join(segments[:depth]), False)
            exclusive[":".join(segments)] = True
        refused = None
        with transaction.atomic():
            if connection.vendor == "postgresql":  # SQLite: one writing transaction at a time
                with connection.cursor() as cursor:
                    # One statement a lock, so they are taken in this order: one per key
                    # segment and name, 4 for /memories/notes/a.md, 0.19 ms here (one lock,
                    # as before: 0.05 ms) of a create's ~5 ms.
                    for key in sorted(exclusive):
                        lock = "pg_advisory_xact_lock" if exclusive[key] else "pg_advisory_xact_lock_shared"
                        cursor.execute(
                            f"SELECT {lock}(hashtextextended(%s, 0))", [f"{_TREE_LOCK_TAG}:{self.tenant.pk}:{key}"]
                        )
            try:
                result = run()
            except MemoryToolError as exc:
                refused = exc
        if refused is not None:
            raise refused
        return result

    def create(self, path: str, file_text: str) -> str:
        place = self.place(path)
        return self._tree_locked((place,), lambda: self._create(place, path, file_text))

    def _create(self, place: Place, path: str, file_text: str) -> str:
        depth = self._under_a_file(place)
        if depth is not None:
            # Where the reference backend's mkdir, or its open, finds a file for a directory
            # (first: a memory another surface wrote behind the file is not "already there").
            raise MemoryToolError(_not_a_directory(place.shown(depth + 1)))
        if place.is_root or self._text(place) is not None or self._is_dir(place):
            raise MemoryToolError(f"File {path} already exists")
        self._write(place.key, file_text)
        return f"File created successfully at: {path}"

    def _file(self, place: Place, path: str) -> tuple[str, int]:
        if self._under_a_file(place) is not None:
            raise MemoryToolError(f"The path {path} does not exist. Please provide a valid path.")
        found = self._text(place)
        if found is None:
            if self._is_dir(place):
                raise MemoryToolError(f"The path {path} is not a file.")
            raise MemoryToolError(f"The path {path} does not exist. Please provide a valid path.")
        return found

    def str_replace(self, path: str, old_str: str, new_str: str) -> str:
        place = self.place(path)
        return self._tree_locked((place,), lambda: self._str_replace(place, path, old_str, new_str))

    def _str_replace(self, place: Place, path: str, old_str: str, new_str: str) -> str:
        content, version = self._file(place, path)
        count = content.count(old_str) if old_str else 0
        if count == 0:
            raise MemoryToolError(
                f"No replacement was performed, old_str `{old_str}` did not appear verbatim in {path}."
            )
        if count > 1:
            # The reference counts the newlines before each occurrence from the start: over a
            # file of 256 KB (a tenant's raised value cap) of one repeated character, 19 s of
            # CPU. Counted on from the previous occurrence: the same numbers, one pass.
            lines_at, start, line, counted = [], 0, 1, 0
            while (pos := content.find(old_str, start)) != -1:
                line += content.count("\n", counted, pos)
                counted = pos
                lines_at.append(line)
                start = pos + 1
            raise MemoryToolError(
                f"No replacement was performed. Multiple occurrences of old_str `{old_str}` in lines: "
                f"{', '.join(map(str, lines_at))}. Please ensure it is unique"
            )
        changed = content[: content.find(old_str)].count("\n")
        new_content = content.replace(old_str, new_str)
        self._update(place, new_content, version)
        new_lines = new_content.split("\n")
        first, end = max(0, changed - 2), min(len(new_lines), changed + 3)
        snippet = [f"{str(n).rjust(LINE_NUMBER_WIDTH)}\t{new_lines[n - 1]}" for n in range(first + 1, end + 1)]
        return "The memory file has been edited. Here is the snippet showing the change (with line numbers):\n" + (
            "\n".join(snippet)
        )

    def insert(self, path: str, insert_line: int, insert_text: str) -> str:
        place = self.place(path)
        return self._tree_locked((place,), lambda: self._insert(place, path, insert_line, insert_text))

    def _insert(self, place: Place, path: str, insert_line: int, insert_text: str) -> str:
        content, version = self._file(place, path)
        lines = content.split("\n")
        if lines[-1] == "":
            lines.pop()
        if insert_line < 0 or insert_line > len(lines):
            raise MemoryToolError(
                f"Invalid `insert_line` parameter: {insert_line}. It should be within the range [0, {len(lines)}]."
            )
        lines.insert(insert_line, insert_text.rstrip("\n"))
        new_content = "\n".join(lines)
        if not new_content.endswith("\n"):
            new_content += "\n"
        self._update(place, new_content, version)
        return f"The file {path} has been edited."

    def delete(self, path: str) -> str:
        place = self.place(path)
        return self._tree_locked((place,), lambda: self._delete(place, path))

    def _delete(self, place: Place, path: str) -> str:
        if place.is_root:
            raise MemoryToolError("Cannot delete the /memories directory itself")
        if self._under_a_file(place) is not None:
            raise MemoryToolError(f"The path {path} does not exist")
        # A file goes with what another surface wrote under it (the path is gone after).
        is_file = self._text(place) is not None
        under = self._all_under(place, path, rows="keys")
        if not is_file and not under:
            raise MemoryToolError(f"The path {path} does not exist")
        keys = ([place.key] if is_file else []) + under
        self._charge(len(keys), field="path")
        with transaction.atomic():
            for key in keys:
                try:
                    mem.memory_delete(tenant=self.tenant, actor=self.actor, key=key)
                except NotFound:
                    pass  # deleted (or expired) since the listing: gone, as this command wants
        return f"Successfully deleted {path}"

    def rename(self, old_path: str, new_path: str) -> str:
        old, new = self.place(old_path, "old_path"), self.place(new_path, "new_path")
        return self._tree_locked((old, new), lambda: self._rename(old, new, old_path, new_path))

    def _rename(self, old: Place, new: Place, old_path: str, new_path: str) -> str:
        if old.is_root:
            raise MemoryToolError("Cannot rename the /memories directory itself")
        depth = self._under_a_file(new)
        if depth is None and (new.is_root or self._text(new) is not None or self._is_dir(new)):
            raise MemoryToolError(f"The destination {new_path} already exists")
        if depth is not None:
            # As the reference backend: its mkdir of the destination's missing parents fails
            # at the file, or (the file is the destination's parent) its rename(2) does, before
            # looking at the source.
            parent_is_file = depth == len(new.names) - 1
            blocked = (old.shown(), new.shown()) if parent_is_file else (new.shown(depth + 1),)
            raise MemoryToolError(_not_a_directory(*blocked))
        if self._under_a_file(old) is not None:
            # The reference backend's rename(2) of a path through a file.
            raise MemoryToolError(_not_a_directory(old.shown(), new.shown()))
        found = self._memory(old)
        # A file moves with what another surface wrote under it (the old path is gone after).
        # The listing reads keys only: the values are loaded MOVE_CHUNK at a time as they move,
        # so a rename of 5,000 files holds one chunk of values in memory, not 5,000 (up to
        # ZEROMEM_VALUE_MAX_BYTES each: 80 MB of text at the default cap, more at a tenant's).
        under = self._all_under(old, old_path, rows="keys")
        if found is None and not under:
            raise MemoryToolError(f"The path {old_path} does not exist")
        if new.key.startswith(old.key + ":"):
            raise MemoryToolError(f"Cannot move {old_path} into itself ({new_path})")
        self._charge(len(under) + (found is not None), field="old_path")
        key = old.key
        try:
            with transaction.atomic():
                # Each file is loaded again locked (FOR UPDATE) and moved as it is now: an edit
                # answered between the read and the delete (unlocked, the rename wrote the text
                # it had read at the new path and deleted the edited file) waits for this
                # transaction, then finds its file gone, an error result.
                if found is not None:
                    live = selectors.memories_live(tenant=self.tenant)
                    found = live.filter(pk=found.pk).select_for_update().first()
                    if found is None:
                        raise NotFound("no memory at this key", field="key")
                    self._move(found, new.key)
                    mem.memory_delete(tenant=self.tenant, actor=self.actor, key=found.key)
                for start in range(0, len(under), MOVE_CHUNK):
                    chunk = under[start : start + MOVE_CHUNK]
                    # The listed keys (the actor's allowlist applied by the listing), live now,
                    # locked in key order (two renames of one directory lock in the same order).
                    loaded = {
                        m.key: m
                        for m in selectors.memories_live(tenant=self.tenant)
                        .filter(key__in=chunk)
                        .order_by("key")
                        .select_for_update()
                    }
                    for key in chunk:
                        if key not in loaded:
                            raise NotFound("no memory at this key", field="key")
                        self._move(loaded.pop(key), new.key + key[len(old.key) :])
                        mem.memory_delete(tenant=self.tenant, actor=self.actor, key=key)
        except NotFound:
            # Deleted (or expired) since the listing: its move is undone with the others
            # rather than writing a file that is gone at its new path.
            gone = "/".join((ROOT_PATH, *key[len(self.root) + 1 :].split(":")))
            raise MemoryToolError(
                f"The file {gone} no longer exists (may have been deleted or renamed concurrently)."
            ) from None
        return f"Successfully renamed {old_path} to {new_path}"


def _not_a_directory(path: str, destination: str | None = None) -> str:
    """A file system's refusal of a path under a file, as the reference backend's OSError
    says it ("[Errno 20] Not a directory: '/memories/a.md/b.md'"), with the model's paths."""
    return str(NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path, None, destination))


def _format_size(size: int) -> str:
    if size == 0:
        return "0B"
    units = ["B", "K", "M", "G"]
    i = min((size.bit_length() - 1) // 10, len(units) - 1)
    value = size / (1024**i)
    return f"{int(value)}{units[i]}" if value == int(value) else f"{value:.1f}{units[i]}"


# --- one command as the model sends it ------------------------------------------------------


def _string(command: dict, name: str, *, required: bool = True) -> str | None:
    value = command.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise InvalidInput("is required (a string)" if value is None else "must be a string", field=name)
    if name in _STORED_TEXTS and "\x00" in value:
        # What the memory service would refuse naming "value", named as the command names it.
        raise InvalidInput("must not contain NUL characters", field=name)
    return value


_STORED_TEXTS = frozenset({"file_text", "new_str", "insert_text"})


def _integer(command: dict, name: str) -> int:
    value = command.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput("is required (an integer)" if value is None else "must be an integer", field=name)
    return value


FIELDS = {
    "view": ("path", "view_range"),
    "create": ("path", "file_text"),
    "str_replace": ("path", "old_str", "new_str"),
    "insert": ("path", "insert_line", "insert_text"),
    "delete": ("path",),
    "rename": ("old_path", "new_path"),
}


def memory_tool_run(*, tenant: Tenant, actor: Actor, command: Any, root: Any = None) -> str:
    """Run one ``memory_20250818`` command (the tool_use ``input``) and return the tool result
    text; :class:`MemoryToolError` is the error result the model should see. A command that
    is not shaped as the tool's schema says is :class:`InvalidInput` naming the field."""
    if not isinstance(command, dict):
        raise InvalidInput("the body must be a JSON object (the tool_use input)", field="body")
    name = command.get("command")
    if name not in COMMANDS:
        raise InvalidInput(f"must be one of {', '.join(COMMANDS)}", field="command")
    for field in command:
        if field != "command" and field not in FIELDS[name]:
            raise InvalidInput(f"{name} takes no field '{field}'", field=field, code="unknown_field")
    tool = MemoryTool(tenant=tenant, actor=actor, root=root)
    written = events_written()
    try:
        return _run(tool, name, command)
    except MemoryToolError as exc:
        if events_written() == written:
            # Refused before any memory service ran (a path outside /memories or escaping
            # it, a name no key can hold, the directory itself): the command's one event.
            audit_record(
                tenant=tenant,
                actor=actor,
                action="anthropic.memory",
                outcome=Outcome.INVALID,
                target=tool.root,
                detail={"code": "invalid_path", "field": exc.field or FIELDS[name][0]},
            )
        raise
    except Forbidden as exc:
        if exc.code == "key_not_allowed" and exc.field == "key":
            # The memory services name "key", which no command has: name what the model (or
            # the caller, for the root) wrote that leads outside the key's allowlist.
            exc.field = _outside_allowlist(tool, name, command)
        raise


def _outside_allowlist(tool: MemoryTool, name: str, command: dict) -> str:
    if not tool._reaches(tool.root):
        return "root"  # nothing under it is within reach
    if name != "rename":
        return "path"
    try:
        old = tool.place(command["old_path"])
    except MemoryToolError:  # not reached: the command got as far as a refusal
        return "old_path"
    return "new_path" if tool._reaches(old.key) else "old_path"


def _run(tool: MemoryTool, name: str, command: dict) -> str:
    if name == "view":
        view_range = command.get("view_range")
        if view_range is not None and (
            not isinstance(view_range, list)
            or len(view_range) not in (2, 3)
            or any(isinstance(n, bool) or not isinstance(n, int) for n in view_range)
            or (len(view_range) == 3 and view_range[2] < 1)
        ):
            raise InvalidInput(
                "must be two integers [start, end] (end -1: to the end), or three: [start, end, the "
                "character of line start to begin at, 1 or more] (a file's view reading on a cut line)",
                field="view_range",
            )
        return tool.view(_string(command, "path"), view_range)
    if name == "create":
        return tool.create(_string(command, "path"), _string(command, "file_text"))
    if name == "str_replace":
        return tool.str_replace(_string(command, "path"), _string(command, "old_str"), _string(command, "new_str"))
    if name == "insert":
        return tool.insert(_string(command, "path"), _integer(command, "insert_line"), _string(command, "insert_text"))
    if name == "delete":
        return tool.delete(_string(command, "path"))
    return tool.rename(_string(command, "old_path"), _string(command, "new_path"))
