"""Claude's memory tool (memory_20250818) on ZeroMem: POST /api/v1/anthropic/memory and the
client's BetaAbstractMemoryTool, driven end to end by the real ``anthropic`` SDK's tool
runner against a fake Anthropic API (a local HTTP server playing the model), into a live
ZeroMem. Each result is compared with what the SDK's own file-system backend
(BetaLocalFilesystemMemoryTool) answers to the same command."""

from __future__ import annotations

import asyncio
import json
import re
import time

import anthropic
import pytest
from anthropic.lib.tools._beta_builtin_memory_tool import BetaLocalFilesystemMemoryTool
from anthropic.lib.tools._beta_functions import ToolError
from zeromem_client import AsyncZeroMem, ZeroMem
from zeromem_client.anthropic import AsyncZeroMemMemoryTool, ZeroMemMemoryTool

from audit.models import AuditEvent
from memories.models import Memory
from memories.services import claude_memory
from tests.factories import make_key, make_tenant
from tests.helpers import FakeJSONEndpoint, rest_error
from zeromem.kernel.errors import Conflict, NotFound

URL = "/api/v1/anthropic/memory"

# What the model does, one tool_use per turn; then it answers in text.
SCRIPT = [
    {"command": "view", "path": "/memories"},
    {"command": "create", "path": "/memories/notes/coffee.md", "file_text": "likes coffee\nhates tea\n"},
    {"command": "create", "path": "/memories/notes/coffee.md", "file_text": "again"},
    {"command": "str_replace", "path": "/memories/notes/coffee.md", "old_str": "hates tea", "new_str": "loves tea"},
    {"command": "str_replace", "path": "/memories/notes/coffee.md", "old_str": "absent", "new_str": "x"},
    {"command": "insert", "path": "/memories/notes/coffee.md", "insert_line": 1, "insert_text": "oat milk\n"},
    {"command": "insert", "path": "/memories/notes/coffee.md", "insert_line": 9, "insert_text": "too far"},
    {"command": "view", "path": "/memories/notes/coffee.md", "view_range": [2, 3]},
    {"command": "create", "path": "/memories/todo.md", "file_text": "- call Ann\n- call Ann\n"},
    {"command": "str_replace", "path": "/memories/todo.md", "old_str": "call Ann", "new_str": "call Bo"},
    {"command": "view", "path": "/memories"},
    {"command": "rename", "old_path": "/memories/notes", "new_path": "/memories/prefs"},
    {"command": "view", "path": "/memories/notes/coffee.md"},
    {"command": "view", "path": "/memories/prefs/coffee.md"},
    {"command": "rename", "old_path": "/memories/todo.md", "new_path": "/memories/prefs"},
    {"command": "view", "path": "/etc/passwd"},
    {"command": "view", "path": "/memories/../secrets"},
    {"command": "delete", "path": "/memories/prefs"},
    {"command": "delete", "path": "/memories/prefs/coffee.md"},
    {"command": "delete", "path": "/memories"},
]


class FakeAnthropic:
    """The Messages API as the SDK calls it: each POST /v1/messages gets the next scripted
    assistant turn; the requests (with the tool_results the runner sent) are kept."""

    def __init__(self, script):
        self.turns = [self._tool_use(i, command) for i, command in enumerate(script)] + [self._text("Noted.")]
        self.endpoint = FakeJSONEndpoint(lambda body, n: self.turns[n - 1])
        self.requests = self.endpoint.requests
        self.url = self.endpoint.url

    def close(self) -> None:
        self.endpoint.close()

    @staticmethod
    def _message(content, stop_reason):
        usage = {"input_tokens": 10, "output_tokens": 5}
        return {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": "claude-fake",
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": usage,
        }

    def _tool_use(self, i, command):
        block = {"type": "tool_use", "id": f"toolu_{i:02d}", "name": "memory", "input": command}
        return self._message([block], "tool_use")

    def _text(self, text):
        return self._message([{"type": "text", "text": text}], "end_turn")

    def tool_results(self) -> list[dict]:
        results = []
        for request in self.requests[1:]:
            block = request["messages"][-1]["content"][0]
            assert block["type"] == "tool_result"
            results.append(block)
        return results


def _reference_results(tmp_path, script) -> list[tuple[str, bool]]:
    """The SDK's own file-system backend on the same commands: (text, is_error) each."""
    tool = BetaLocalFilesystemMemoryTool(base_path=str(tmp_path))
    out = []
    for command in script:
        try:
            out.append((tool.call(command), False))
        except ToolError as exc:
            out.append((str(exc), True))
        except OSError as exc:  # the file system's own refusal, with the model's paths for its own
            out.append((str(exc).replace(str((tmp_path / "memories").resolve()), "/memories"), True))
    return out


def _content(block) -> str:
    content = block["content"]
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def _without_dir_sizes(text: str) -> str:
    # A file system lists a directory with its inode size (4.0K); ZeroMem with its files' bytes.
    return re.sub(r"^[0-9.]+[BKMG]\t(\S+/)$|^[0-9.]+[BKMG]\t(/memories)$", r"DIR\t\1\2", text, flags=re.M)


@pytest.fixture
def acme(transactional_db):
    tenant = make_tenant("acme")
    return tenant, make_key(tenant)[1]


def test_the_sdk_tool_runner_drives_all_six_commands_into_zeromem(live_server, acme, tmp_path):
    tenant, raw = acme
    fake = FakeAnthropic(SCRIPT)
    with ZeroMem(live_server.url, raw) as zm:
        memory = ZeroMemMemoryTool(zm)
        client = anthropic.Anthropic(base_url=fake.url, api_key="sk-fake", max_retries=0)
        runner = client.beta.messages.tool_runner(
            model="claude-fake",
            max_tokens=1024,
            tools=[memory],
            messages=[{"role": "user", "content": "Remember what I like."}],
        )
        final = runner.until_done()
    fake.close()
    assert final.content[0].text == "Noted."
    assert fake.requests[0]["tools"] == [{"type": "memory_20250818", "name": "memory"}]

    results = fake.tool_results()
    assert [r["tool_use_id"] for r in results] == [f"toolu_{i:02d}" for i in range(len(SCRIPT))]
    ours = [(_content(r), bool(r.get("is_error"))) for r in results]
    reference = _reference_results(tmp_path, SCRIPT)
    for command, got, want in zip(SCRIPT, ours, reference, strict=True):
        assert (_without_dir_sizes(got[0]), got[1]) == (_without_dir_sizes(want[0]), want[1]), command
    # Spot checks of what the comparison covers.
    assert ours[2] == ("File /memories/notes/coffee.md already exists", True)
    assert ours[7][0] == (
        "Here's the content of /memories/notes/coffee.md with line numbers:\n     2\toat milk\n     3\tloves tea"
    )
    assert ours[10][0].splitlines()[1:] == [
        "54B\t/memories",
        "32B\t/memories/notes/",
        "32B\t/memories/notes/coffee.md",
        "22B\t/memories/todo.md",
    ]
    assert "Multiple occurrences of old_str `call Ann` in lines: 1, 2" in ours[9][0]

    live = dict(Memory.objects.filter(tenant=tenant, deleted_at__isnull=True).values_list("key", "value"))
    assert live == {"claude:memories:todo.md": "- call Ann\n- call Ann\n"}
    trashed = set(Memory.objects.filter(tenant=tenant, deleted_at__isnull=False).values_list("key", flat=True))
    assert trashed == {"claude:memories:notes:coffee.md", "claude:memories:prefs:coffee.md"}
    surfaces = set(AuditEvent.objects.filter(tenant=tenant, action__startswith="memory.").values_list("surface"))
    assert surfaces == {("anthropic_memory",)}
    assert AuditEvent.objects.filter(tenant=tenant, action="memory.write", outcome="ok").count() == 3


# A path under a file is neither a file nor a directory: a file system refuses to create one.
UNDER_A_FILE = [
    {"command": "create", "path": "/memories/a.md", "file_text": "x\n"},
    {"command": "create", "path": "/memories/a.md/b.md", "file_text": "y"},
    {"command": "create", "path": "/memories/./a.md/b/c.md", "file_text": "y"},
    {"command": "create", "path": "/memories/d/e.md", "file_text": "e\n"},
    {"command": "create", "path": "/memories/d", "file_text": "a file where a directory is"},
    {"command": "rename", "old_path": "/memories/d/e.md", "new_path": "/memories/a.md/e.md"},
    {"command": "rename", "old_path": "/memories/d/e.md", "new_path": "/memories/a.md/x/e.md"},
    {"command": "rename", "old_path": "/memories/d", "new_path": "/memories/a.md/d"},
    {"command": "rename", "old_path": "/memories/a.md", "new_path": "/memories/a.md/x"},
    {"command": "rename", "old_path": "/memories/missing.md", "new_path": "/memories/a.md/m.md"},
    {"command": "rename", "old_path": "/memories/d", "new_path": "/memories/a.md"},
    {"command": "view", "path": "/memories"},
]


def test_a_path_under_a_file_is_refused_as_the_file_system_refuses_it(live_server, acme, tmp_path):
    tenant, raw = acme
    fake = FakeAnthropic(UNDER_A_FILE)
    with ZeroMem(live_server.url, raw) as zm:
        client = anthropic.Anthropic(base_url=fake.url, api_key="sk-fake", max_retries=0)
        runner = client.beta.messages.tool_runner(
            model="claude-fake",
            max_tokens=1024,
            tools=[ZeroMemMemoryTool(zm)],
            messages=[{"role": "user", "content": "File it."}],
        )
        runner.until_done()
    fake.close()
    ours = [(_content(r), bool(r.get("is_error"))) for r in fake.tool_results()]
    reference = _reference_results(tmp_path, UNDER_A_FILE)
    for command, got, want in zip(UNDER_A_FILE, ours, reference, strict=True):
        assert (_without_dir_sizes(got[0]), got[1]) == (_without_dir_sizes(want[0]), want[1]), command
    assert ours[1] == ("[Errno 20] Not a directory: '/memories/a.md/b.md'", True)
    assert ours[5] == ("[Errno 20] Not a directory: '/memories/d/e.md' -> '/memories/a.md/e.md'", True)
    live = dict(Memory.objects.filter(tenant=tenant, deleted_at__isnull=True).values_list("key", "value"))
    assert live == {"claude:memories:a.md": "x\n", "claude:memories:d:e.md": "e\n"}
    assert not Memory.objects.filter(tenant=tenant, deleted_at__isnull=False).exists()


def test_the_async_tool_runner_with_the_async_tool(live_server, acme, tmp_path):
    tenant, raw = acme
    script = [
        {"command": "create", "path": "/memories/a.md", "file_text": "one\ntwo\n"},
        {"command": "insert", "path": "/memories/a.md", "insert_line": 0, "insert_text": "zero"},
        {"command": "view", "path": "/memories/a.md"},
        {"command": "view", "path": "/memories/missing.md"},
    ]
    fake = FakeAnthropic(script)

    async def main():
        async with AsyncZeroMem(live_server.url, raw) as zm:
            client = anthropic.AsyncAnthropic(base_url=fake.url, api_key="sk-fake", max_retries=0)
            runner = client.beta.messages.tool_runner(
                model="claude-fake",
                max_tokens=1024,
                tools=[AsyncZeroMemMemoryTool(zm, root="user:u1:memories")],
                messages=[{"role": "user", "content": "Count."}],
            )
            return await runner.until_done()

    try:
        final = asyncio.run(main())
    finally:
        fake.close()
    assert final.content[0].text == "Noted."
    ours = [(_content(r), bool(r.get("is_error"))) for r in fake.tool_results()]
    assert ours == _reference_results(tmp_path, script)
    assert Memory.objects.get(tenant=tenant, key="user:u1:memories:a.md").value == "zero\none\ntwo\n"


def test_root_is_governed_by_the_allowlist_and_scopes(api, tenant_a, make_client):
    limited, _ = make_client(tenant_a, allow=["user:u1:"])
    create = {"command": "create", "path": "/memories/a.md", "file_text": "hi"}
    r = limited.post(URL, create)
    assert r.status_code == 403 and rest_error(r)["code"] == "key_not_allowed"
    r = limited.post(URL + "?root=user:u1:memories", create)
    assert r.status_code == 200
    assert r.json() == {"content": "File created successfully at: /memories/a.md", "is_error": False}
    assert Memory.objects.get(tenant=tenant_a, key="user:u1:memories:a.md").value == "hi"
    reader, _ = make_client(tenant_a, scopes=["memory:read"])
    r = reader.post(URL + "?root=user:u1:memories", {"command": "delete", "path": "/memories/a.md"})
    assert r.status_code == 403 and rest_error(r)["code"] == "missing_scope"
    r = reader.post(URL + "?root=user:u1:memories", {"command": "view", "path": "/memories/a.md"})
    assert r.json()["content"].endswith("     1\thi")


@pytest.mark.parametrize(
    ("root", "command", "field"),
    [
        (None, {"command": "create", "path": "/memories/a.md", "file_text": "x"}, "root"),
        ("user:u1:m", {"command": "create", "path": "/memories/a.md", "file_text": "x"}, "path"),
        ("user:u1:m", {"command": "view", "path": "/memories/a.md"}, "path"),
        ("user:u1:m", {"command": "insert", "path": "/memories/a.md", "insert_line": 0, "insert_text": "x"}, "path"),
        ("user:u1:m", {"command": "delete", "path": "/memories/a.md"}, "path"),
        ("user:u1:m", {"command": "rename", "old_path": "/memories/notes/n.md", "new_path": "/memories/b"}, "new_path"),
        ("user:u1:m", {"command": "rename", "old_path": "/memories/a.md", "new_path": "/memories/notes/b"}, "old_path"),
    ],
)
def test_a_path_outside_the_keys_allowlist_is_a_403_naming_the_commands_field(
    api, tenant_a, make_client, root, command, field
):
    # The refusal named "key", a field no command has: the model's path, or the root, is at fault.
    api.post(URL + "?root=user:u1:m", {"command": "create", "path": "/memories/notes/n.md", "file_text": "n"})
    api.post(URL + "?root=user:u1:m", {"command": "create", "path": "/memories/a.md", "file_text": "a"})
    before = set(Memory.objects.values_list("pk", "version"))
    limited, _ = make_client(tenant_a, allow=["user:u1:m:notes:"])
    r = limited.post(URL + (f"?root={root}" if root else ""), command)
    assert r.status_code == 403, r.content
    assert (rest_error(r)["code"], rest_error(r)["field"]) == ("key_not_allowed", field)
    assert set(Memory.objects.values_list("pk", "version")) == before


def test_a_key_allowed_a_directorys_contents_views_deletes_and_renames_the_directory(api, tenant_a, make_client):
    # A key allowed user:u1:m:notes: saw /memories/notes/ in the listing of /memories, but a
    # view, delete or rename of /memories/notes was a 403: the tool first read the path as a
    # file, at the key user:u1:m:notes, which that allowlist does not cover (only keys under it).
    root = URL + "?root=user:u1:m"
    for name in ("a.md", "sub/b.md"):
        api.post(root, {"command": "create", "path": f"/memories/notes/{name}", "file_text": "n"})
    limited, _ = make_client(tenant_a, allow=["user:u1:m:notes:"])
    r = limited.post(root, {"command": "view", "path": "/memories/notes"})
    assert r.status_code == 200, r.content
    assert r.json()["content"].splitlines()[1:] == [
        "2B\t/memories/notes",
        "1B\t/memories/notes/a.md",
        "1B\t/memories/notes/sub/",
        "1B\t/memories/notes/sub/b.md",
    ]
    r = limited.post(root, {"command": "rename", "old_path": "/memories/notes", "new_path": "/memories/elsewhere"})
    assert r.status_code == 403 and rest_error(r)["field"] == "new_path"  # outside: refused, named
    r = limited.post(root, {"command": "delete", "path": "/memories/notes"})
    assert r.json() == {"content": "Successfully deleted /memories/notes", "is_error": False}
    assert not Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True).exists()


def test_another_tenant_sees_nothing(api, api_b, tenant_a):
    api.post(URL, {"command": "create", "path": "/memories/secret.md", "file_text": "CANARY-a"})
    for command in (
        {"command": "view", "path": "/memories"},
        {"command": "view", "path": "/memories/secret.md"},
        {"command": "delete", "path": "/memories/secret.md"},
    ):
        r = api_b.post(URL, command)
        assert r.status_code == 200 and "CANARY" not in r.content.decode()
    assert api_b.post(URL, {"command": "view", "path": "/memories"}).json()["content"].endswith("0B\t/memories")
    assert Memory.objects.get(tenant=tenant_a, key="claude:memories:secret.md").deleted_at is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"path": "/memories"}, "command"),
        ({"command": "rm", "path": "/memories"}, "command"),
        ({"command": "view"}, "path"),
        ({"command": "view", "path": 3}, "path"),
        ({"command": "view", "path": "/memories", "view_range": [1]}, "view_range"),
        ({"command": "create", "path": "/memories/a"}, "file_text"),
        ({"command": "insert", "path": "/memories/a", "insert_line": "1", "insert_text": "x"}, "insert_line"),
        ({"command": "delete", "path": "/memories/a", "force": True}, "force"),
        ([1, 2], "body"),
        # No value holds NUL: the refusal named "value", a field the command does not have.
        ({"command": "create", "path": "/memories/a", "file_text": "a\x00b"}, "file_text"),
        ({"command": "str_replace", "path": "/memories/a", "old_str": "a", "new_str": "\x00"}, "new_str"),
        ({"command": "insert", "path": "/memories/a", "insert_line": 0, "insert_text": "\x00"}, "insert_text"),
    ],
)
def test_malformed_commands_are_400_naming_the_field(api, tenant_a, body, field):
    r = api.post(URL, body)
    assert r.status_code == 400 and rest_error(r)["field"] == field
    assert not Memory.objects.filter(tenant=tenant_a).exists()


def test_a_path_that_is_not_a_key_is_a_tool_error_and_a_bad_root_a_400(api):
    r = api.post(URL, {"command": "create", "path": "/memories/my notes.md", "file_text": "x"})
    assert r.status_code == 200 and r.json()["is_error"] is True
    assert r.json()["content"].startswith("Path /memories/my notes.md cannot be stored")
    r = api.post(URL + "?root=bad%20root", {"command": "view", "path": "/memories"})
    assert r.status_code == 400 and rest_error(r)["field"] == "root"


def test_a_name_in_nfd_is_stored_as_its_nfc_one_file_as_the_reference_backend_stores_it(api, tenant_a, tmp_path):
    """macOS spells file names decomposed (NFD: "e" + U+0301), which the key grammar refused
    ("cannot be stored") while the SDK's own backend stores them. Names are NFC on the way in:
    "café" composed or decomposed names one file, whatever spelling the model uses."""
    decomposed, composed = "/memories/cafe\u0301/re\u0301sume\u0301.md", "/memories/caf\u00e9/r\u00e9sum\u00e9.md"
    create = {"command": "create", "path": decomposed, "file_text": "likes tea\n"}
    [(reference, is_error)] = _reference_results(tmp_path, [create])
    r = api.post(URL, create)
    assert (
        r.json()
        == {"content": reference, "is_error": is_error}
        == {
            "content": f"File created successfully at: {decomposed}",
            "is_error": False,
        }
    )
    [memory] = Memory.objects.filter(tenant=tenant_a)
    assert memory.key == "claude:memories:caf\u00e9:r\u00e9sum\u00e9.md" and memory.value == "likes tea\n"
    r = api.post(URL, {"command": "str_replace", "path": composed, "old_str": "tea", "new_str": "coffee"})
    assert r.json()["is_error"] is False, r.json()
    r = api.post(URL, {"command": "view", "path": decomposed})
    assert r.json() == {
        "content": "Here's the content of " + decomposed + " with line numbers:\n     1\tlikes coffee\n     2\t",
        "is_error": False,
    }
    r = api.post(URL, {"command": "create", "path": composed, "file_text": "again"})
    assert r.json()["is_error"] is True and "already exists" in r.json()["content"]
    r = api.post(URL, {"command": "rename", "old_path": composed, "new_path": "/memories/cafe\u0301/old.md"})
    assert r.json()["is_error"] is False, r.json()
    live = Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True).values_list("key", flat=True)
    assert list(live) == ["claude:memories:caf\u00e9:old.md"]


def test_a_colon_in_a_path_name_is_a_tool_error_not_a_second_path_to_a_file(api, tenant_a):
    # /memories/notes:a.md would be the key claude:memories:notes:a.md — the file
    # /memories/notes/a.md: the model would read, edit or delete one file under two names.
    r = api.post(URL, {"command": "create", "path": "/memories/notes/a.md", "file_text": "likes tea\n"})
    assert r.json() == {"content": "File created successfully at: /memories/notes/a.md", "is_error": False}
    for command in (
        {"command": "view", "path": "/memories/notes:a.md"},
        {"command": "create", "path": "/memories/other:b.md", "file_text": "x"},
        {"command": "str_replace", "path": "/memories/notes:a.md", "old_str": "tea", "new_str": "coffee"},
        {"command": "delete", "path": "/memories/notes:a.md"},
        {"command": "rename", "old_path": "/memories/notes/a.md", "new_path": "/memories/x:y.md"},
    ):
        r = api.post(URL, command)
        assert r.status_code == 200 and r.json()["is_error"] is True, command
        assert "cannot be stored" in r.json()["content"], command
    live = Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True)
    assert [(m.key, m.value) for m in live] == [("claude:memories:notes:a.md", "likes tea\n")]


def test_rename_keeps_each_memorys_subject_sensitivity_tags_and_expiry(api, tenant_a):
    # Files written through the tool call (a subject, sensitive, a TTL, tags), then moved by Claude:
    # the moved memories stay encrypted, forgettable by their subject and expiring as before.
    api.call(
        "memory_write",
        key="claude:memories:notes:health.md",
        value="allergic to nuts",
        subject="u7",
        sensitive=True,
        ttl_seconds=3600,
        tags=["medical"],
    )
    api.call("memory_write", key="claude:memories:notes:prefs.json", value={"lang": "fr"}, category="user")
    r = api.post(URL, {"command": "rename", "old_path": "/memories/notes", "new_path": "/memories/archive"})
    assert r.json() == {"content": "Successfully renamed /memories/notes to /memories/archive", "is_error": False}
    moved = Memory.objects.get(tenant=tenant_a, key="claude:memories:archive:health.md", deleted_at__isnull=True)
    assert (moved.subject, moved.sensitive, moved.tags) == ("u7", True, ["medical"])
    assert moved.expires_at is not None
    before = Memory.objects.get(tenant=tenant_a, key="claude:memories:notes:health.md")
    # The time left, rounded up to a whole second, from a moment later: never earlier, < 2 s later.
    assert 0 <= (moved.expires_at - before.expires_at).total_seconds() < 2
    assert "nuts" not in (moved.search_text or "")  # a sensitive value is never indexed
    other = Memory.objects.get(tenant=tenant_a, key="claude:memories:archive:prefs.json", deleted_at__isnull=True)
    assert (other.value, other.category) == ({"lang": "fr"}, "user")  # the JSON value, not its text


def test_renaming_one_sensitive_file_keeps_it_encrypted_and_its_subject(api, tenant_a):
    api.call("memory_write", key="claude:memories:card.md", value="4111 1111", subject="u7", sensitive=True)
    r = api.post(URL, {"command": "rename", "old_path": "/memories/card.md", "new_path": "/memories/old-card.md"})
    assert r.json()["is_error"] is False
    moved = Memory.objects.get(tenant=tenant_a, key="claude:memories:old-card.md")
    assert (moved.subject, moved.sensitive, moved.value) == ("u7", True, "4111 1111")


@pytest.mark.parametrize(
    "command",
    [
        {"command": "delete", "path": "/memories/big"},
        {"command": "rename", "old_path": "/memories/big", "new_path": "/memories/moved"},
    ],
    ids=["delete", "rename"],
)
def test_a_directory_past_the_listing_cap_is_refused_whole_not_half_done(api, tenant_a, monkeypatch, command):
    # It answered "Successfully ..." having done the first LIST_MAX_MEMORIES files only.
    monkeypatch.setattr(claude_memory, "LIST_MAX_MEMORIES", 3)
    for i in range(4):
        api.post(URL, {"command": "create", "path": f"/memories/big/f{i}.md", "file_text": "x"})
    r = api.post(URL, command)
    assert r.status_code == 200 and r.json()["is_error"] is True, r.json()
    assert "more than 3 files" in r.json()["content"]
    live = Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True)
    assert sorted(live.values_list("key", flat=True)) == [f"claude:memories:big:f{i}.md" for i in range(4)]
    monkeypatch.setattr(claude_memory, "LIST_MAX_MEMORIES", 4)
    assert api.post(URL, command).json()["is_error"] is False  # at the cap: done whole


def test_a_view_of_a_directory_past_the_listing_cap_says_it_is_cut(api, tenant_a, monkeypatch):
    # A listing read the first LIST_MAX_MEMORIES files and showed them as the whole directory:
    # 5,001 files under /memories/a/ hid /memories/z.md, and the model was not told.
    monkeypatch.setattr(claude_memory, "LIST_MAX_MEMORIES", 3)
    for i in range(3):
        api.post(URL, {"command": "create", "path": f"/memories/a/x/f{i}.md", "file_text": "x"})
    whole = api.post(URL, {"command": "view", "path": "/memories"}).json()
    assert whole["is_error"] is False and "Listing cut" not in whole["content"]  # at the cap: all of it
    api.post(URL, {"command": "create", "path": "/memories/z.md", "file_text": "zz"})
    r = api.post(URL, {"command": "view", "path": "/memories"})
    lines = r.json()["content"].splitlines()
    assert lines[1:-1] == ["3B\t/memories", "3B\t/memories/a/", "3B\t/memories/a/x/"]
    assert lines[-1] == (
        "(Listing cut: /memories holds more than 3 files; only the first 3 by name are listed and "
        "counted in the sizes above. View a subdirectory to see the rest.)"
    )
    events = AuditEvent.objects.filter(tenant=tenant_a, action="memory.list").order_by("-pk")
    assert events.first().count == 4  # one page: the cap and the one past it


@pytest.mark.parametrize(
    ("command", "field"),
    [
        ({"command": "delete", "path": "/memories/big"}, "path"),
        ({"command": "rename", "old_path": "/memories/big", "new_path": "/memories/moved"}, "old_path"),
    ],
    ids=["delete", "rename"],
)
def test_a_directory_command_costs_a_rate_limit_unit_per_file(api, tenant_a, settings, limiter_minute, command, field):
    """A rename or delete of a directory changes up to LIST_MAX_MEMORIES files (10,000 version
    and audit rows for a rename) for one unit of the key's rate limit, where a batch pays per
    call: a key could change millions of memories a minute. Now each file costs a unit, taken
    before anything changes."""
    from memories import services
    from tests.factories import SYSTEM

    def files(directory):
        for i in range(6):
            services.memory_write(tenant=tenant_a, actor=SYSTEM, key=f"claude:memories:{directory}:f{i}.md", value="x")

    def live():
        return sorted(Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True).values_list("key", flat=True))

    files("big")
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 8
    assert api.post(URL, {"command": "view", "path": "/memories"}).status_code == 200  # 1 unit
    assert api.post(URL, {"command": "view", "path": "/memories/big"}).status_code == 200  # 2
    r = api.post(URL, command)  # 3, and 5 more files: 8, the limit
    assert (r.status_code, r.json()["is_error"]) == (200, False), r.content

    files("big")
    before = live()
    settings.ZEROMEM_RATE_LIMIT_PER_MINUTE = 12
    r = api.post(URL, dict(command, **({"new_path": "/memories/again"} if field == "old_path" else {})))
    # The request's own unit is the 9th (within 12); its 5 more files would make 14.
    assert r.status_code == 429, r.content
    error = rest_error(r)
    assert (error["code"], error["field"]) == ("rate_limited", field)
    assert "6 files" in error["message"] and int(r["Retry-After"]) >= 1
    assert live() == before  # refused before anything changed


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("first", "second"),
    [
        (
            {"command": "create", "path": "/memories/a.md", "file_text": "file"},
            {"command": "create", "path": "/memories/a.md/b.md", "file_text": "under it"},
        ),
        (
            {"command": "rename", "old_path": "/memories/x.md", "new_path": "/memories/a.md"},
            {"command": "create", "path": "/memories/a.md/b.md", "file_text": "under it"},
        ),
    ],
)
def test_concurrent_commands_never_leave_a_path_both_a_file_and_a_directory(
    transactional_db, monkeypatch, first, second
):
    """Two connections: each command, once its checks pass, waits (up to 3 s) for the other
    to pass its own before writing. Unlocked, both passed (no file yet at /memories/a.md, nothing
    under it yet) and both wrote; with the tree lock the second waits for the first's commit,
    then sees the file."""
    import threading

    from django.db import connection

    from tests.factories import SYSTEM

    tenant = make_tenant("race-tree")
    claude_memory.memory_tool_run(
        tenant=tenant, actor=SYSTEM, command={"command": "create", "path": "/memories/x.md", "file_text": "x"}
    )
    both_checked = threading.Barrier(2, timeout=3)
    write = claude_memory.MemoryTool._write

    def write_after_the_other_checked(self, key, text):
        try:
            both_checked.wait()
        except threading.BrokenBarrierError:
            pass  # the other is waiting for this one's lock
        return write(self, key, text)

    monkeypatch.setattr(claude_memory.MemoryTool, "_write", write_after_the_other_checked)
    outcomes = {}

    def run(name, command):
        try:
            outcomes[name] = claude_memory.memory_tool_run(tenant=tenant, actor=SYSTEM, command=command)
        except claude_memory.MemoryToolError as exc:
            outcomes[name] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("first", first), ("second", second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    keys = set(Memory.objects.filter(tenant=tenant, deleted_at__isnull=True).values_list("key", flat=True))
    file, under = "claude:memories:a.md", "claude:memories:a.md:b.md"
    assert not (file in keys and under in keys), (keys, outcomes)
    refused = [o for o in outcomes.values() if isinstance(o, claude_memory.MemoryToolError)]
    assert len(refused) == 1, outcomes  # one ran, the other was refused as a file system would
    assert "Not a directory" in str(refused[0]) or "already exists" in str(refused[0]), refused


def test_memories_written_under_a_file_through_rest_stay_behind_it(api, tenant_a):
    # REST (or MCP, a batch, an import) may write both claude:memories:a and keys under it; a
    # file system cannot hold /memories/a as a file and a directory. The file wins: what lies
    # under it is not listed, read, edited or deleted by a path through it, and moves with it.
    for key, value in (
        ("claude:memories:a", "file a"),
        ("claude:memories:a:b", "under a"),
        ("claude:memories:a:c:d", "deeper"),
        ("claude:memories:e:f", "ok"),
    ):
        assert api.put(f"/api/v1/memories/{key}", {"value": value}).status_code == 201

    def run(command):
        r = api.post(URL, command)
        assert r.status_code == 200, r.content
        return r.json()["content"], r.json()["is_error"]

    listing, _ = run({"command": "view", "path": "/memories"})
    assert listing.splitlines()[1:] == ["8B\t/memories", "6B\t/memories/a", "2B\t/memories/e/", "2B\t/memories/e/f"]
    for path in ("/memories/a/b", "/memories/a/c", "/memories/a/c/d"):
        assert run({"command": "view", "path": path}) == (
            f"The path {path} does not exist. Please provide a valid path.",
            True,
        )
    for command in (
        {"command": "str_replace", "path": "/memories/a/b", "old_str": "under", "new_str": "over"},
        {"command": "insert", "path": "/memories/a/b", "insert_line": 0, "insert_text": "x"},
    ):
        assert run(command) == ("The path /memories/a/b does not exist. Please provide a valid path.", True)
    assert run({"command": "delete", "path": "/memories/a/c"}) == ("The path /memories/a/c does not exist", True)
    assert run({"command": "create", "path": "/memories/a/c", "file_text": "x"}) == (
        "[Errno 20] Not a directory: '/memories/a/c'",
        True,
    )
    assert run({"command": "rename", "old_path": "/memories/a/b", "new_path": "/memories/q"}) == (
        "[Errno 20] Not a directory: '/memories/a/b' -> '/memories/q'",
        True,
    )
    assert run({"command": "rename", "old_path": "/memories/e", "new_path": "/memories/a/b"}) == (
        "[Errno 20] Not a directory: '/memories/e' -> '/memories/a/b'",
        True,
    )
    # Nothing under the file was read (no audit event) or changed.
    read = AuditEvent.objects.filter(tenant=tenant_a, action="memory.read", target__startswith="claude:memories:a:")
    assert not read.exists()
    live = dict(Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True).values_list("key", "value"))
    assert live == {
        "claude:memories:a": "file a",
        "claude:memories:a:b": "under a",
        "claude:memories:a:c:d": "deeper",
        "claude:memories:e:f": "ok",
    }

    # A rename moves the file with what lies under it: the old path is gone, not a directory.
    assert run({"command": "rename", "old_path": "/memories/a", "new_path": "/memories/z"}) == (
        "Successfully renamed /memories/a to /memories/z",
        False,
    )
    assert run({"command": "view", "path": "/memories/a"})[1] is True
    live = dict(Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True).values_list("key", "value"))
    assert live == {
        "claude:memories:z": "file a",
        "claude:memories:z:b": "under a",
        "claude:memories:z:c:d": "deeper",
        "claude:memories:e:f": "ok",
    }
    # A delete of the file takes what lies under it too (to the trash): the path is gone.
    assert run({"command": "delete", "path": "/memories/z"}) == ("Successfully deleted /memories/z", False)
    assert run({"command": "view", "path": "/memories/z"})[1] is True
    live = Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True).values_list("key", flat=True)
    assert list(live) == ["claude:memories:e:f"]


@pytest.mark.postgres
def test_a_listing_reads_the_sizes_of_files_not_their_values(api, tenant_a):
    # A view of /memories loaded every value under it (up to 5,000 of up to 256 KB: 500 files
    # of 250 KB took 1.0 s and 152 MB of Python heap) to show sizes. The database measures a
    # plaintext value's text now; a sensitive one, sealed there, is still opened to be measured.
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    files = {
        "claude:memories:notes:a.md": "héllo\n",
        "claude:memories:notes:b.json": {"lang": "fr", "n": [1, 2.5], "s": 'q"\n'},
        "claude:memories:c.md": "x" * 3000,
    }
    for key, value in files.items():
        api.call("memory_write", key=key, value=value)
    api.call("memory_write", key="claude:memories:notes:secret.md", value="pin 1234", subject="u7", sensitive=True)
    with CaptureQueriesContext(connection) as queries:
        listing = api.post(URL, {"command": "view", "path": "/memories"}).json()["content"]
    assert listing.splitlines()[1:] == [
        "3.0K\t/memories",
        "2.9K\t/memories/c.md",
        "58B\t/memories/notes/",
        "7B\t/memories/notes/a.md",
        "43B\t/memories/notes/b.json",
        "8B\t/memories/notes/secret.md",
    ]
    reads_values = [
        q["sql"] for q in queries if '"memories_memory"."value"' in q["sql"] and not q["sql"].startswith("INSERT")
    ]
    assert len(reads_values) == 1 and "secret.md" in str(reads_values)  # the sealed one only


def _names_whose_32_bit_lock_keys_collide(tenant) -> tuple[str, str]:
    """Two top-level names whose tree locks were one lock when the key was 32 bits
    (``hashtext('<tenant>:<root>:<name>')``): found among 300,000 names (~10 pairs)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT min(name), max(name) FROM (SELECT 'n' || i AS name,"
            " hashtext(%s || 'n' || i) AS h FROM generate_series(1, 300000) AS i) AS names"
            " GROUP BY h HAVING count(*) > 1 LIMIT 1",
            [f"{tenant.pk}:{claude_memory.DEFAULT_ROOT}:"],
        )
        return cursor.fetchone()


@pytest.mark.postgres
def test_commands_on_names_whose_32_bit_lock_keys_collide_do_not_wait_on_each_other(transactional_db, monkeypatch):
    """The tree lock's key was 32 bits: a command on /memories/<a> waited for one on an
    unrelated /memories/<b> whose key collided (any tenant's). It is 64 bits now."""
    import threading

    from tests.factories import SYSTEM
    from tests.helpers import start_thread

    tenant = make_tenant("tree-collide")
    a, b = _names_whose_32_bit_lock_keys_collide(tenant)
    holding, release = threading.Event(), threading.Event()
    write = claude_memory.MemoryTool._write

    def write_holding_the_lock(self, key, text):
        if key.startswith(f"{claude_memory.DEFAULT_ROOT}:{a}:"):
            holding.set()
            release.wait(10)
        return write(self, key, text)

    monkeypatch.setattr(claude_memory.MemoryTool, "_write", write_holding_the_lock)

    def create(name):
        command = {"command": "create", "path": f"/memories/{name}/f.md", "file_text": name}
        return lambda: claude_memory.memory_tool_run(tenant=tenant, actor=SYSTEM, command=command)

    failures: list = []
    first = start_thread(create(a), failures)
    second_done = threading.Event()
    try:
        assert holding.wait(10), failures
        second = start_thread(create(b), failures, done=second_done)
        assert second_done.wait(5), f"/memories/{b} waited for /memories/{a}'s lock"
    finally:
        release.set()
        first.join()
    second.join()
    assert not failures, failures
    keys = set(Memory.objects.filter(tenant=tenant).values_list("key", flat=True))
    assert keys == {f"claude:memories:{a}:f.md", f"claude:memories:{b}:f.md"}


@pytest.mark.postgres
def test_a_listing_of_many_directories_does_work_in_proportion_to_its_entries(api, tenant_a, monkeypatch):
    # The listing looked for each directory's children among every file and directory under
    # /memories: a view of 5,000 top-level directories of one file each (any key with
    # memory:write can write them) took 6.4 s of one CPU, holding the interpreter, per request.
    # It counts Python calls (generator steps included) in the listing, not time.
    import sys

    from django.db import connection

    dirs = 1500
    api.call("memory_write", key="claude:memories:d0:f.md", value="x")
    with connection.cursor() as cursor:  # 1,499 more in one statement (no versions or audit)
        columns = [
            connection.ops.quote_name(f.column)
            for f in Memory._meta.concrete_fields
            if not f.primary_key and not getattr(f, "generated", False)
        ]
        select = ", ".join(
            "'claude:memories:d' || g || ':f.md'"
            if c == '"key"'
            else ("'claude:memories:d' || g" if c == '"namespace"' else c)
            for c in columns
        )
        cursor.execute(
            f"INSERT INTO memories_memory ({', '.join(columns)}) SELECT {select} "  # noqa: S608 (the model's columns)
            "FROM memories_memory, generate_series(1, %s) AS g WHERE key = 'claude:memories:d0:f.md'",
            [dirs - 1],
        )
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    listing = claude_memory.MemoryTool._listing

    def counted(self, *args, **kwargs):
        sys.setprofile(count)
        try:
            return listing(self, *args, **kwargs)
        finally:
            sys.setprofile(None)

    monkeypatch.setattr(claude_memory.MemoryTool, "_listing", counted)
    monkeypatch.setattr(claude_memory, "LIST_MAX_CHARS", 10**6)  # every entry (the work, not the cut)
    content = api.post(URL, {"command": "view", "path": "/memories"}).json()["content"]
    lines = content.splitlines()
    assert len(lines) == 2 + 2 * dirs  # header, the total, then each directory and its file
    assert lines[2:4] == ["1B\t/memories/d0/", "1B\t/memories/d0/f.md"]
    assert calls < 100 * dirs, calls  # was 1500 directories x 4500 entries: 6.8 million


@pytest.mark.parametrize(
    "old_str", ["tea", "aa", "\n", "tea\nand", "a"], ids=["word", "overlapping", "newline", "across-lines", "char"]
)
def test_a_str_replace_of_several_occurrences_names_the_lines_the_reference_names(api, tmp_path, old_str):
    # The line numbers are counted in one pass now (the reference's count from the start
    # took 19 s on 256 KB of one character): the same refusal, word for word.
    text = "tea\n\naaaa tea\nand tea\n" + "x\n" * 50 + "tea aa\ntea\nand\n"
    script = [
        {"command": "create", "path": "/memories/t.md", "file_text": text},
        {"command": "str_replace", "path": "/memories/t.md", "old_str": old_str, "new_str": "z"},
    ]
    ours = [(r.json()["content"], r.json()["is_error"]) for r in (api.post(URL, command) for command in script)]
    assert ours == _reference_results(tmp_path, script)
    assert ours[1][1] and "Multiple occurrences" in ours[1][0]


@pytest.mark.parametrize(
    ("command", "answer"),
    [
        ({"command": "delete", "path": "/memories/d"}, "Successfully deleted /memories/d"),
        (
            {"command": "rename", "old_path": "/memories/d", "new_path": "/memories/e"},
            "The file /memories/d/f1.md no longer exists (may have been deleted or renamed concurrently).",
        ),
    ],
    ids=["delete", "rename"],
)
def test_a_file_deleted_while_its_directory_is_deleted_or_renamed_is_no_404(
    api, tenant_a, monkeypatch, command, answer
):
    # A file another client deleted after the command listed the directory made the
    # command's delete of it raise NotFound: an HTTP 404 "no memory at this key" where the
    # model expects a tool result. A delete leaves the gone file out; a rename, which would
    # write the gone file at its new path first, does nothing and says which file went.
    from memories import services
    from tests.factories import SYSTEM

    for i in range(3):
        services.memory_write(tenant=tenant_a, actor=SYSTEM, key=f"claude:memories:d:f{i}.md", value="x")
    charge = claude_memory.MemoryTool._charge

    def deleted_meanwhile(self, files, *, field):
        services.memory_delete(tenant=tenant_a, actor=SYSTEM, key="claude:memories:d:f1.md")
        return charge(self, files, field=field)

    monkeypatch.setattr(claude_memory.MemoryTool, "_charge", deleted_meanwhile)
    r = api.post(URL, command)
    assert r.status_code == 200, r.content
    assert r.json() == {"content": answer, "is_error": command["command"] == "rename"}
    live = sorted(Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True).values_list("key", flat=True))
    assert live == ([] if command["command"] == "delete" else ["claude:memories:d:f0.md", "claude:memories:d:f2.md"])


@pytest.mark.postgres
def test_a_view_of_a_large_directory_writes_one_audit_event(api, tenant_a):
    # The listing read the directory 200 keys a page, each page a memory.list event: a view
    # of 5,000 files wrote 25 audit rows for one request (and one unit of the rate limit).
    from tests.helpers import copy_memory

    api.post(URL, {"command": "create", "path": "/memories/f", "file_text": "x"})
    copy_memory(Memory.objects.get(tenant=tenant_a, key="claude:memories:f"), 449)
    before = AuditEvent.objects.count()
    r = api.post(URL, {"command": "view", "path": "/memories"})
    assert r.status_code == 200 and len(r.json()["content"].splitlines()) == 2 + 450, r.content
    events = list(AuditEvent.objects.order_by("pk")[before:].values_list("action", "count"))
    assert events == [("memory.list", 450)], events


def test_a_rename_loads_its_files_values_a_chunk_at_a_time(api, tenant_a, monkeypatch):
    # A directory's rename read every file's value up front (5,000 files, up to the value cap
    # each, in one process's memory for one request); now the listing reads keys and the values
    # are loaded MOVE_CHUNK at a time as they move. The files move whole, with their versions.
    from memories import selectors as memory_selectors
    from memories.services import memories as mem

    monkeypatch.setattr(claude_memory, "MOVE_CHUNK", 2)
    for i in range(5):
        api.post(URL, {"command": "create", "path": f"/memories/d/f{i}.md", "file_text": f"text {i}"})
    listed, loaded = [], []
    memory_list, memories_live = mem.memory_list, memory_selectors.memories_live

    def listing(**kwargs):
        listed.append(kwargs.get("keys_only", True) or kwargs.get("sizes", False))
        return memory_list(**kwargs)

    class Recorded:
        # The queryset, counting the rows a load of a chunk of keys (filter(key__in=…)) yields.
        def __init__(self, qs, chunk=False):
            self.qs, self.chunk = qs, chunk

        def __getattr__(self, name):
            attr = getattr(self.qs, name)
            if name in ("order_by", "select_for_update"):
                return lambda *a, **k: Recorded(attr(*a, **k), self.chunk)
            return attr

        def filter(self, *args, **kwargs):
            return Recorded(self.qs.filter(*args, **kwargs), self.chunk or "key__in" in kwargs)

        def __iter__(self):
            rows = list(self.qs)
            if self.chunk:
                loaded.append(len(rows))
            return iter(rows)

    def live(**kwargs):
        return Recorded(memories_live(**kwargs))

    monkeypatch.setattr(mem, "memory_list", listing)
    monkeypatch.setattr(memory_selectors, "memories_live", live)
    r = api.post(URL, {"command": "rename", "old_path": "/memories/d", "new_path": "/memories/e"})
    assert r.status_code == 200 and r.json()["content"] == "Successfully renamed /memories/d to /memories/e", r.content
    assert listed and all(listed), listed  # no listing loaded values
    assert loaded == [2, 2, 1], loaded  # the values, two files at a time
    live_keys = sorted(Memory.objects.filter(tenant=tenant_a, deleted_at__isnull=True).values_list("key", flat=True))
    assert live_keys == [f"claude:memories:e:f{i}.md" for i in range(5)]
    moved = Memory.objects.get(tenant=tenant_a, key="claude:memories:e:f3.md", deleted_at__isnull=True)
    assert moved.value == "text 3"


@pytest.mark.parametrize(
    "body,field",
    [
        ({"command": "view", "path": "/etc/passwd"}, "path"),
        ({"command": "view", "path": "/memories/../../etc/passwd"}, "path"),
        ({"command": "create", "path": "/memories/a b.md", "file_text": "x"}, "path"),
        ({"command": "delete", "path": "/memories"}, "path"),
        ({"command": "rename", "old_path": "/memories/a.md", "new_path": "/tmp/a.md"}, "new_path"),
        ({"command": "rename", "old_path": "/memories/../x", "new_path": "/memories/b.md"}, "old_path"),
        ({"command": "rename", "old_path": "/memories", "new_path": "/memories/b"}, "old_path"),
    ],
)
def test_a_command_refused_before_any_memory_is_touched_writes_one_audit_event(api, tenant_a, body, field):
    # A path outside /memories, one escaping it or naming what no key can hold, the directory
    # itself: the error result came back with no audit event (a model probing for
    # /etc/passwd left no trace), while every other command's steps are audited.
    api.post(URL, {"command": "create", "path": "/memories/a.md", "file_text": "x"})
    before = AuditEvent.objects.count()
    r = api.post(URL, body)
    assert r.status_code == 200 and r.json()["is_error"] is True, r.content
    events = list(AuditEvent.objects.order_by("pk")[before:])
    assert [(e.action, e.outcome, e.target, e.detail) for e in events] == [
        ("anthropic.memory", "invalid", "claude:memories", {"code": "invalid_path", "field": field})
    ]
    assert (events[0].surface, events[0].actor_kind) == ("anthropic_memory", "api_key")
    assert events[0].request_id == r.headers["X-Request-ID"]


def test_an_error_result_after_audited_steps_adds_no_event_of_its_own(api, tenant_a):
    before = AuditEvent.objects.count()
    r = api.post(URL, {"command": "view", "path": "/memories/none.md"})
    assert r.json()["is_error"] is True
    events = list(AuditEvent.objects.order_by("pk")[before:].values_list("action", "outcome"))
    assert events == [("memory.read", "not_found"), ("memory.list", "ok")]


@pytest.mark.postgres
@pytest.mark.parametrize("editor", ["tool", "rest"])
@pytest.mark.parametrize(
    ("old_path", "new_path", "edited"),
    [
        ("/memories/a.md", "/memories/b.md", "/memories/a.md"),
        ("/memories/d", "/memories/e", "/memories/d/a.md"),
    ],
    ids=["file", "directory"],
)
def test_an_edit_acknowledged_while_its_file_is_renamed_is_never_lost(
    transactional_db, old_path, new_path, edited, editor
):
    """Two agents of one tenant: one renames, the other edits the file being renamed. The
    rename read the file (a file: before its transaction; a directory: each chunk, unlocked),
    the edit committed and answered success, then the rename wrote the text it had read at the
    new path and deleted the old one — the acknowledged edit was gone. The rename's
    ``_move`` waits here for the edit to be answered or to wait on a lock; with the rows locked
    as they are loaded, an edit through REST (the memory services: no tree lock) waits for the
    rename on the row and answers a conflict; one through the tool waits on the tree lock, then
    finds no file at the path."""
    import threading

    from memories import services
    from tests.factories import SYSTEM
    from tests.helpers import lock_waiters, start_thread

    tenant = make_tenant("race-rename")
    claude_memory.memory_tool_run(
        tenant=tenant, actor=SYSTEM, command={"command": "create", "path": edited, "file_text": "v1\n"}
    )
    key = claude_memory.MemoryTool(tenant=tenant, actor=SYSTEM).place(edited).key
    loaded, answered = threading.Event(), threading.Event()
    move = claude_memory.MemoryTool._move

    def move_after_the_edit(self, memory, key):
        loaded.set()
        deadline = time.monotonic() + 20
        while not answered.is_set() and lock_waiters() == 0:
            assert time.monotonic() < deadline, "the edit neither ran nor waited"
            time.sleep(0.01)
        return move(self, memory, key)

    outcomes, failures = {}, []

    def rename():
        outcomes["rename"] = claude_memory.MemoryTool(tenant=tenant, actor=SYSTEM).rename(old_path, new_path)

    def edit():
        assert loaded.wait(10)
        try:
            if editor == "rest":
                outcomes["edit"] = services.memory_update(
                    tenant=tenant, actor=SYSTEM, key=key, value="v2\n", expected_version=1
                ).status
            else:
                outcomes["edit"] = claude_memory.memory_tool_run(
                    tenant=tenant,
                    actor=SYSTEM,
                    command={"command": "str_replace", "path": edited, "old_str": "v1", "new_str": "v2"},
                )
        except (claude_memory.MemoryToolError, NotFound, Conflict) as exc:
            outcomes["edit"] = exc
        finally:
            answered.set()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(claude_memory.MemoryTool, "_move", move_after_the_edit)
        threads = [start_thread(rename, failures), start_thread(edit, failures)]
        for t in threads:
            t.join(30)
    assert not failures, failures
    assert outcomes["rename"] == f"Successfully renamed {old_path} to {new_path}", outcomes
    moved = edited.replace(old_path, new_path, 1)
    text = claude_memory.MemoryTool(tenant=tenant, actor=SYSTEM)._text(
        claude_memory.MemoryTool(tenant=tenant, actor=SYSTEM).place(moved)
    )
    live = sorted(Memory.objects.filter(tenant=tenant, deleted_at__isnull=True).values_list("key", flat=True))
    assert len(live) == 1, live
    if isinstance(outcomes["edit"], str):  # acknowledged: the edit must be in the file
        assert text[0] == "v2\n", (outcomes, text)
    else:  # refused: the file moved as it was
        refusal = "does not exist" if editor == "tool" else "no memory at this key"
        assert refusal in str(outcomes["edit"]) and text[0] == "v1\n", (outcomes, text)


@pytest.mark.postgres
def test_a_view_of_a_huge_directory_answers_at_most_the_listing_budget(api, tenant_a):
    # 10,000 files of 480-character names: the view answered the first 5,000, 2,494,708
    # characters (~624,000 estimated tokens, three times a model's context window, where the
    # tool result then stays). Now at most LIST_MAX_CHARS, ending with how to list the rest.
    from tests.helpers import copy_memory
    from zeromem.kernel.tokens import estimate_tokens

    name = "n" * 480
    api.post(URL, {"command": "create", "path": f"/memories/{name}", "file_text": "x"})
    copy_memory(Memory.objects.get(tenant=tenant_a, key=f"claude:memories:{name}"), 9999)
    r = api.post(URL, {"command": "view", "path": "/memories"})
    assert r.status_code == 200 and not r.json()["is_error"], r.content[:300]
    content = r.json()["content"]
    assert len(content) <= claude_memory.LIST_MAX_CHARS, len(content)
    assert estimate_tokens(content) <= claude_memory.LIST_MAX_CHARS // 4 + 100
    entries = [line for line in content.splitlines()[2:] if line.startswith(("1B\t", "2B\t"))]
    assert len(entries) >= 25, len(entries)
    assert content.splitlines()[-2] == (
        f"(Listing cut at {claude_memory.LIST_MAX_CHARS} characters: entries 1-{len(entries)} of 5000 shown. "
        f"View /memories with view_range [{len(entries) + 1}, -1] for the next ones.)"
    )
    assert content.splitlines()[-1].startswith("(Listing cut: /memories holds more than 5000 files;")


def test_a_view_of_a_big_file_of_short_lines_answers_at_most_the_budget_and_pages_on(api, tenant_a, settings):
    """A file of 60,000 one-character lines (120 KB, under a raised value cap) answered ~540,000
    characters — its line numbers, not its text. Now at most LIST_MAX_CHARS, cut at a line's
    end, with the view_range that reads on; reading on that way gives every line once."""
    tenant_a.value_max_bytes = 256 * 1024
    tenant_a.save(update_fields=["value_max_bytes"])
    text = "\n".join("abcdefghij"[i % 10] for i in range(60_000))
    r = api.post(URL, {"command": "create", "path": "/memories/big.txt", "file_text": text})
    assert r.status_code == 200 and not r.json()["is_error"], r.content[:300]
    seen, start, pages = [], 1, 0
    while True:
        body = {"command": "view", "path": "/memories/big.txt"}
        if start > 1:
            body["view_range"] = [start, -1]
        content = api.post(URL, body).json()["content"]
        assert len(content) <= claude_memory.LIST_MAX_CHARS, len(content)
        lines = content.splitlines()
        assert lines[0] == "Here's the content of /memories/big.txt with line numbers:"
        numbered = [line for line in lines[1:] if not line.startswith("(File cut")]
        seen += [line.split("\t", 1)[1] for line in numbered]
        assert int(numbered[0].split("\t")[0]) == start
        pages += 1
        if not lines[-1].startswith("(File cut"):
            break
        last = start + len(numbered) - 1
        assert lines[-1] == (
            f"(File cut at {claude_memory.LIST_MAX_CHARS} characters: lines {start}-{last} of 60000 shown. "
            f"View /memories/big.txt with view_range [{last + 1}, -1] for the next ones.)"
        )
        start = last + 1
    assert seen == text.split("\n") and pages > 30


def test_a_short_file_and_a_range_are_answered_whole_as_before(api):
    api.post(URL, {"command": "create", "path": "/memories/notes.md", "file_text": "one\ntwo\nthree"})
    whole = api.post(URL, {"command": "view", "path": "/memories/notes.md"}).json()["content"]
    assert whole == (
        "Here's the content of /memories/notes.md with line numbers:\n     1\tone\n     2\ttwo\n     3\tthree"
    )
    part = api.post(URL, {"command": "view", "path": "/memories/notes.md", "view_range": [2, 3]}).json()["content"]
    assert part.splitlines()[1:] == ["     2\ttwo", "     3\tthree"]


def test_a_cut_listing_pages_on_with_view_range_to_every_entry_once(api, tenant_a, monkeypatch):
    for i in range(40):
        api.post(URL, {"command": "create", "path": f"/memories/d{i % 3}/{'f' * 200}{i:03d}.md", "file_text": "x" * i})
    api.post(URL, {"command": "create", "path": "/memories/top.md", "file_text": "top"})
    whole = api.post(URL, {"command": "view", "path": "/memories"}).json()["content"].splitlines()
    monkeypatch.setattr(claude_memory, "LIST_MAX_CHARS", 3000)
    seen, start, pages = [], 1, 0
    while True:
        body = {"command": "view", "path": "/memories"}
        if start > 1:
            body["view_range"] = [start, -1]
        content = api.post(URL, body).json()["content"]
        assert len(content) <= 3000, len(content)
        lines = content.splitlines()
        assert lines[:2] == whole[:2]  # the header and the directory's own line, every page
        pages += 1
        if not lines[-1].startswith("(Listing cut at"):
            seen.extend(lines[2:])
            break
        seen.extend(lines[2:-1])
        start = int(lines[-1].split("view_range [")[1].split(",")[0])
    assert pages > 2 and seen == whole[2:], (pages, len(seen), len(whole))


def _read_on(api, path: str) -> tuple[str, int]:
    """The file at ``path`` read as a model reads it: view, then each cut line's view_range,
    until a page ends uncut; (the text put back together, the pages read). Each page is held
    to LIST_MAX_CHARS and starts where the previous one's last line said."""
    parts: list[str] = []  # the text, line by line, a cut line in pieces
    view_range, pages = None, 0
    while True:
        body = {"command": "view", "path": path}
        if view_range:
            body["view_range"] = view_range
        r = api.post(URL, body)
        assert r.status_code == 200 and not r.json()["is_error"], r.content[:300]
        content = r.json()["content"]
        assert len(content) <= claude_memory.LIST_MAX_CHARS, (len(content), view_range)
        pages += 1
        assert pages < 100, view_range
        lines = content.split("\n")
        cut = lines[-1].startswith("(File cut")
        numbered = lines[1:-1] if cut else lines[1:]
        first = view_range[0] if view_range else 1
        for n, line in enumerate(numbered):
            number, text = line.split("\t", 1)
            assert int(number) == first + n, (line[:20], view_range)
            if n == 0 and view_range and len(view_range) == 3:
                parts[-1] += text  # the rest of the line the previous page cut
            else:
                parts.append(text)
        if not cut:
            return "\n".join(parts), pages
        view_range = json.loads(lines[-1].split("view_range ")[1].split("]")[0] + "]")


def test_a_line_longer_than_the_budget_is_cut_and_read_on_from_its_next_character(api, tenant_a):
    """A file with a 200,000-character line (under a tenant's raised value cap): a view of that
    line answered it whole past the 16,384-character budget (200,188 characters, ~50,000
    tokens). Now the line
    is cut too, ending with the view_range whose third number is the character it reads on
    from; reading on that way gives the file back, every page within the budget."""
    tenant_a.value_max_bytes = 256 * 1024
    tenant_a.save(update_fields=["value_max_bytes"])
    long = "".join(f"{i:07d}," for i in range(25_000))  # 200,000 characters, each place distinct
    text = f"head\n{long}\nmiddle\n{long[:20_000]}é\ntail\n"
    api.post(URL, {"command": "create", "path": "/memories/long.txt", "file_text": text})

    first = api.post(URL, {"command": "view", "path": "/memories/long.txt"}).json()["content"]
    assert first.split("\n")[1:] == [
        "     1\thead",
        "(File cut at 16384 characters: lines 1-1 of 6 shown. "
        "View /memories/long.txt with view_range [2, -1] for the next ones.)",
    ]
    page = api.post(URL, {"command": "view", "path": "/memories/long.txt", "view_range": [2, -1]}).json()["content"]
    assert len(page) <= claude_memory.LIST_MAX_CHARS, len(page)
    shown = page.split("\n")[1].split("\t", 1)[1]
    assert long.startswith(shown) and len(shown) > 16_000, len(shown)
    assert page.split("\n")[-1] == (
        f"(File cut at 16384 characters: line 2 of 6, characters 1-{len(shown)} of 200000 shown. "
        f"View /memories/long.txt with view_range [2, -1, {len(shown) + 1}] for the rest of it.)"
    )
    read, pages = _read_on(api, "/memories/long.txt")
    assert read == text and pages > 14, pages


def test_a_view_range_reads_a_line_on_from_a_character_and_refuses_a_bad_one(api):
    api.post(URL, {"command": "create", "path": "/memories/n.md", "file_text": "one\ntwo\nthree"})
    body = {"command": "view", "path": "/memories/n.md", "view_range": [2, 3, 2]}
    assert api.post(URL, body).json()["content"].split("\n")[1:] == ["     2\two", "     3\tthree"]
    for bad in ([2, 3, 0], [2, 3, -1], [1, 2, 3, 4], [2, 3, True]):
        r = api.post(URL, {"command": "view", "path": "/memories/n.md", "view_range": bad})
        assert r.status_code == 400 and rest_error(r)["field"] == "view_range", (bad, r.content)
    r = api.post(URL, {"command": "view", "path": "/memories", "view_range": [1, -1, 2]})
    assert r.status_code == 400 and rest_error(r)["field"] == "view_range", r.content


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("old_path", "new_path", "created", "moved"),
    [
        ("/memories/d", "/memories/e", "/memories/d/new.md", "/memories/e/new.md"),
        ("/memories/d", "/memories/e", "/memories/d/sub/deep/new.md", "/memories/e/sub/deep/new.md"),
        ("/memories/d/sub", "/memories/d/other", "/memories/d/sub/new.md", "/memories/d/other/new.md"),
        ("/memories/d/sub", "/memories/e", "/memories/d/sub/x/new.md", "/memories/e/x/new.md"),
        ("/memories/1/2/3/4/5/6/7", "/memories/e", "/memories/1/2/3/4/5/6/7/8/new.md", "/memories/e/8/new.md"),
    ],
    ids=["top-level", "nested-create", "nested-rename", "out-of-its-parent", "past-the-lock-depth"],
)
def test_a_file_created_in_a_directory_being_renamed_moves_with_it(
    transactional_db, old_path, new_path, created, moved
):
    """Two agents of one tenant: one renames a directory, the other creates a file in it. The
    create (locking only its top-level name, the rename only its destination's) went on while
    the rename was moving the files it had listed: it answered success first, then the
    rename's commit left it at the old path, outside the directory the model moved. The
    rename's ``_move`` here waits until the create either answers or waits on a lock (no
    sleep decides it): locked, the create waits for the rename and creates its file after
    it; were it answered first, its file would have to have moved."""
    import threading

    from tests.factories import SYSTEM
    from tests.helpers import lock_waiters, start_thread

    tenant = make_tenant("race-create-rename")
    for path in (f"{old_path}/a.md", f"{old_path}/sub2/b.md"):
        claude_memory.memory_tool_run(
            tenant=tenant, actor=SYSTEM, command={"command": "create", "path": path, "file_text": "x"}
        )
    moving, created_done = threading.Event(), threading.Event()
    answered: list[str] = []
    move = claude_memory.MemoryTool._move

    def move_once_the_create_ran_or_waits(self, memory, key):
        if not moving.is_set():
            moving.set()
            deadline = time.monotonic() + 20
            while not created_done.is_set() and lock_waiters() == 0:
                assert time.monotonic() < deadline, "the create neither ran nor waited"
                time.sleep(0.01)
        return move(self, memory, key)

    def rename():
        claude_memory.MemoryTool(tenant=tenant, actor=SYSTEM).rename(old_path, new_path)
        answered.append("rename")

    def create():
        assert moving.wait(20)
        claude_memory.memory_tool_run(
            tenant=tenant, actor=SYSTEM, command={"command": "create", "path": created, "file_text": "new"}
        )
        answered.append("create")

    failures: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(claude_memory.MemoryTool, "_move", move_once_the_create_ran_or_waits)
        threads = [start_thread(rename, failures), start_thread(create, failures, done=created_done)]
        for t in threads:
            t.join(30)
    assert not failures, failures
    keys = set(Memory.objects.filter(tenant=tenant, deleted_at__isnull=True).values_list("key", flat=True))
    key = "claude:memories" + (moved if answered[0] == "create" else created)[len("/memories") :].replace("/", ":")
    assert key in keys and len(keys) == 3, (answered, sorted(keys))
    assert answered == ["rename", "create"], answered  # the create waited for the rename's lock


@pytest.mark.postgres
def test_two_renames_each_onto_the_others_source_take_their_locks_in_one_order(transactional_db):
    """rename a -> b and b -> a at once lock both paths each. A third session holds b's lock
    until both renames wait on a lock: a -> b holds a and waits for b; taken in key order,
    b -> a waits for a too, holding nothing it needs. Taken source first, b -> a could get b
    on its release and then wait for a: a deadlock, one of them a 500."""
    import threading

    from django.db import connection, transaction

    from tests.factories import SYSTEM
    from tests.helpers import lock_waiters, start_thread

    tenant = make_tenant("race-swap")
    claude_memory.memory_tool_run(
        tenant=tenant, actor=SYSTEM, command={"command": "create", "path": "/memories/a", "file_text": "x"}
    )
    held, release = threading.Event(), threading.Event()

    def hold_b():
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                [f"{claude_memory._TREE_LOCK_TAG}:{tenant.pk}:claude:memories:b"],
            )
            held.set()
            release.wait(20)

    outcomes, failures = {}, []

    def rename(old, new):
        def run():
            try:
                outcomes[old] = claude_memory.memory_tool_run(
                    tenant=tenant, actor=SYSTEM, command={"command": "rename", "old_path": old, "new_path": new}
                )
            except claude_memory.MemoryToolError as exc:
                outcomes[old] = exc

        return run

    holder, renames = start_thread(hold_b, failures), []
    try:
        assert held.wait(10), failures
        # b -> a first: taking its source first, it would wait for b; then a -> b holds a
        # and waits for b behind it, and b -> a, granted b, waits for a.
        for waiting, paths in enumerate((("/memories/b", "/memories/a"), ("/memories/a", "/memories/b")), 1):
            renames.append(start_thread(rename(*paths), failures))
            deadline = time.monotonic() + 20
            while lock_waiters() < waiting:
                assert time.monotonic() < deadline and not failures, (f"{paths} never waited", failures)
                time.sleep(0.01)
    finally:
        release.set()
        holder.join()
    for t in renames:
        t.join(30)
    assert not failures, failures
    assert len(outcomes) == 2, outcomes
    live = list(Memory.objects.filter(tenant=tenant, deleted_at__isnull=True).values_list("key", flat=True))
    assert len(live) == 1 and live[0] in ("claude:memories:a", "claude:memories:b"), (live, outcomes)


@pytest.mark.postgres
def test_a_deep_path_takes_at_most_the_lock_depth_of_tree_locks(api):
    # A 512-character key of one-character names: a rename of two such paths took 512 locks,
    # and a few dozen of them at once would fill PostgreSQL's shared lock table.
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    deep = "/memories/" + "/".join("abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(200))
    for body in (
        {"command": "create", "path": f"{deep}/f", "file_text": "x"},
        {"command": "rename", "old_path": deep, "new_path": f"{deep[:-2]}/moved"},
        {"command": "str_replace", "path": f"{deep[:-2]}/moved/f", "old_str": "x", "new_str": "y"},
        {"command": "insert", "path": f"{deep[:-2]}/moved/f", "insert_line": 0, "insert_text": "z"},
        {"command": "delete", "path": f"{deep[:-2]}/moved"},
    ):
        with CaptureQueriesContext(connection) as queries:
            r = api.post(URL, body)
        assert r.status_code == 200 and not r.json()["is_error"], r.content[:300]
        locks = [q["sql"] for q in queries if "pg_advisory_xact_lock" in q["sql"]]
        # TREE_LOCK_DEPTH (8) for each path: a rename's two, the others' one.
        assert 0 < len(locks) <= 8 * (1 + (body["command"] == "rename")), (body["command"], len(locks))


@pytest.mark.postgres
@pytest.mark.parametrize(
    "body",
    [
        {"command": "create", "path": "/memories/notes/b.md", "file_text": "x"},
        {"command": "str_replace", "path": "/memories/notes/a.md", "old_str": "x", "new_str": "y"},
        {"command": "insert", "path": "/memories/notes/a.md", "insert_line": 0, "insert_text": "z"},
        {"command": "delete", "path": "/memories/notes/a.md"},
        {"command": "view", "path": "/memories/notes/a.md"},
    ],
    ids=lambda body: body["command"],
)
def test_each_write_takes_one_lock_a_key_segment_and_a_view_none(api, body):
    # claude, claude:memories, claude:memories:notes shared; claude:memories:notes:a.md exclusive.
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    assert not api.post(URL, {"command": "create", "path": "/memories/notes/a.md", "file_text": "x"}).json()["is_error"]
    with CaptureQueriesContext(connection) as queries:
        r = api.post(URL, body)
    assert r.status_code == 200 and not r.json()["is_error"], r.content[:300]
    locks = [q["sql"].split("(")[0] for q in queries if "pg_advisory_xact_lock" in q["sql"]]
    expected = [] if body["command"] == "view" else ["SELECT pg_advisory_xact_lock_shared"] * 3
    assert locks == expected + ([] if body["command"] == "view" else ["SELECT pg_advisory_xact_lock"]), locks


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("deleted", "write", "written"),
    [
        ("/memories/d", ("create", "/memories/d/new.md"), "/memories/d/new.md"),
        ("/memories/d", ("create", "/memories/d/sub/deep/new.md"), "/memories/d/sub/deep/new.md"),
        ("/memories/d/sub", ("create", "/memories/d/sub/x/new.md"), "/memories/d/sub/x/new.md"),
        ("/memories/d", ("rename", "/memories/x.md"), "/memories/d/new.md"),
        ("/memories/1/2/3/4/5/6/7", ("create", "/memories/1/2/3/4/5/6/7/8/new.md"), "/memories/1/2/3/4/5/6/7/8/new.md"),
    ],
    ids=["top-level", "nested-create", "nested-delete", "rename-into", "past-the-lock-depth"],
)
def test_a_file_written_into_a_directory_being_deleted_goes_with_it_or_comes_after(
    transactional_db, deleted, write, written
):
    """Two agents of one tenant: one deletes a directory, the other creates a file in it (or
    renames one into it). The delete took no lock: it listed the directory's files, the create
    answered success, then the delete removed what it had listed and answered success too —
    leaving the new file, and the directory the model deleted, behind. The delete's
    ``_charge`` (after its listing) here waits until the write either answers or waits on a
    lock (no sleep decides it): locked, the write waits for the delete and lands after it;
    were it answered first, its file would have to be gone."""
    import threading

    from tests.factories import SYSTEM
    from tests.helpers import lock_waiters, start_thread

    tenant = make_tenant("race-delete-create")
    for path in (f"{deleted}/a.md", f"{deleted}/sub2/b.md", "/memories/x.md"):
        claude_memory.memory_tool_run(
            tenant=tenant, actor=SYSTEM, command={"command": "create", "path": path, "file_text": "x"}
        )
    listed, written_done = threading.Event(), threading.Event()
    answered: list[str] = []
    charge = claude_memory.MemoryTool._charge

    def charge_once_the_write_ran_or_waits(self, files, *, field):
        if not listed.is_set():  # the delete's (a rename into the directory charges too)
            listed.set()
            deadline = time.monotonic() + 20
            while not written_done.is_set() and lock_waiters() == 0:
                assert time.monotonic() < deadline, "the write neither ran nor waited"
                time.sleep(0.01)
        return charge(self, files, field=field)

    def delete():
        claude_memory.memory_tool_run(tenant=tenant, actor=SYSTEM, command={"command": "delete", "path": deleted})
        answered.append("delete")

    def write_into_it():
        assert listed.wait(20)
        name, path = write
        command = (
            {"command": "create", "path": path, "file_text": "new"}
            if name == "create"
            else {"command": "rename", "old_path": path, "new_path": written}
        )
        claude_memory.memory_tool_run(tenant=tenant, actor=SYSTEM, command=command)
        answered.append(name)

    failures: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(claude_memory.MemoryTool, "_charge", charge_once_the_write_ran_or_waits)
        threads = [start_thread(delete, failures), start_thread(write_into_it, failures, done=written_done)]
        for t in threads:
            t.join(30)
    assert not failures, failures
    keys = set(Memory.objects.filter(tenant=tenant, deleted_at__isnull=True).values_list("key", flat=True))
    key = "claude:memories" + written[len("/memories") :].replace("/", ":")
    if answered[0] == "delete":  # the write came after: its file is all there is in the directory
        assert keys == {key} | ({"claude:memories:x.md"} if write[0] == "create" else set()), (answered, sorted(keys))
    else:  # the write answered first: the delete must have taken its file too
        assert key not in keys, (answered, sorted(keys))
    assert answered[0] == "delete", answered  # the write waited for the delete's lock


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("edit", "other", "edited", "after"),
    [
        (
            {"command": "str_replace", "old_str": "v1", "new_str": "v2"},
            {"command": "rename", "old_path": "/memories/d", "new_path": "/memories/e"},
            "/memories/d/a.md",
            "/memories/e/a.md",
        ),
        (
            {"command": "insert", "insert_line": 0, "insert_text": "v0"},
            {"command": "rename", "old_path": "/memories/a.md", "new_path": "/memories/b.md"},
            "/memories/a.md",
            "/memories/b.md",
        ),
        (
            {"command": "str_replace", "old_str": "v1", "new_str": "v2"},
            {"command": "delete", "path": "/memories/d"},
            "/memories/d/a.md",
            None,
        ),
    ],
    ids=["str_replace-directory-rename", "insert-file-rename", "str_replace-directory-delete"],
)
def test_an_edit_read_before_a_rename_or_delete_of_its_file_answers_in_the_order_it_ran(
    transactional_db, edit, other, edited, after
):
    """Two agents of one tenant: one edits a file, the other renames or deletes it (or its
    directory) after the edit has read it. The edit took no lock: the rename (delete) ran and
    answered, and the edit, answering after it, was refused as if the file had gone under it
    — "may have been deleted or renamed concurrently" — an error result the model cannot act
    on but by reading again. The edit's ``_update`` (after its read) here waits until the
    other command answers or waits on a lock: locked, that command waits for the edit, which
    is applied first and then moved (or deleted) with its file."""
    import threading

    from tests.factories import SYSTEM
    from tests.helpers import lock_waiters, start_thread

    tenant = make_tenant("race-edit-rename")
    claude_memory.memory_tool_run(
        tenant=tenant, actor=SYSTEM, command={"command": "create", "path": edited, "file_text": "v1\n"}
    )
    read, other_done = threading.Event(), threading.Event()
    answered: list[str] = []
    outcomes: dict = {}
    update = claude_memory.MemoryTool._update

    def update_once_the_other_ran_or_waits(self, place, text, version):
        read.set()
        deadline = time.monotonic() + 20
        while not other_done.is_set() and lock_waiters() == 0:
            assert time.monotonic() < deadline, "the other command neither ran nor waited"
            time.sleep(0.01)
        return update(self, place, text, version)

    def run_edit():
        try:
            outcomes["edit"] = claude_memory.memory_tool_run(
                tenant=tenant, actor=SYSTEM, command={**edit, "path": edited}
            )
        except claude_memory.MemoryToolError as exc:
            outcomes["edit"] = exc
        answered.append("edit")

    def run_other():
        assert read.wait(20)
        outcomes["other"] = claude_memory.memory_tool_run(tenant=tenant, actor=SYSTEM, command=other)
        answered.append("other")

    failures: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(claude_memory.MemoryTool, "_update", update_once_the_other_ran_or_waits)
        threads = [start_thread(run_edit, failures), start_thread(run_other, failures, done=other_done)]
        for t in threads:
            t.join(30)
    assert not failures, failures
    assert answered == ["edit", "other"] and isinstance(outcomes["edit"], str), (answered, outcomes)
    live = Memory.objects.filter(tenant=tenant, deleted_at__isnull=True)
    if after is None:
        assert not live.exists(), list(live.values_list("key", flat=True))
    else:
        tool = claude_memory.MemoryTool(tenant=tenant, actor=SYSTEM)
        assert list(live.values_list("key", flat=True)) == [tool.place(after).key]
        assert tool._text(tool.place(after))[0] == ("v2\n" if edit["command"] == "str_replace" else "v0\nv1\n")
