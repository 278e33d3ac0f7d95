"""The MCP server (issue 14) driven by the official SDK's own client, with the scripted guest.

The bulk runs in process — :func:`sandbox.api.mcp.server.serve_streams` on the SDK's memory
streams, a real :class:`~sandbox.session.runtime.Session` (the real 9P server, providers,
undo core, hold broker; only the VM is the scripted guest) — and a few run ``sandbox mcp``
as a real subprocess over stdio. Every structured result is validated with jsonschema
against the ``outputSchema`` the server advertised; undo is checked with the tree oracle
(bytes, modes, mtimes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
from contextlib import asynccontextmanager

import anyio
import jsonschema
import mcp_types as types
import pytest
from hypothesis import given, settings, strategies as st
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError
from mcp.shared.memory import create_client_server_memory_streams

from sandbox import __version__
from sandbox.api.mcp import models
from sandbox.api.mcp.client import BoundedText, _ProgressPump
from sandbox.api.mcp.host import OwnSessionHost
from sandbox.api.mcp.server import serve_streams
from sandbox.api.mcp.tools import TOOLS
from sandbox.core.safeguard import SafeguardConfig
from sandbox.session.runtime import Folder, Session
from sandbox_sim import oracle

pytestmark = pytest.mark.timeout(120)
SANDBOX = os.path.join(os.path.dirname(sys.executable), "sandbox")
#: a wait that must end by an event; the bound only turns a hang into a failure
WAIT_S = 30


@pytest.fixture
def project(tmp_path):
    p = tmp_path / "project"
    (p / "src").mkdir(parents=True)
    (p / "src" / "main.py").write_text("def main():\n    return 1\n")
    (p / "src" / "util.py").write_text("X = 1\nY = 1\n")
    (p / "README.md").write_text("# demo\n")
    (p / "blob.bin").write_bytes(bytes(range(256)))
    (p / "build").mkdir()
    for i in range(12):
        (p / "build" / f"o{i}.o").write_bytes(b"obj%d" % i)
    os.chmod(p / "src" / "util.py", 0o600)
    return p


@pytest.fixture
def state(tmp_path):
    return str(tmp_path / "state")


def make_host(project, state, *, on_hold="deny", **kw) -> OwnSessionHost:
    return OwnSessionHost(Session([Folder(str(project), state_dir=state)], guest="scripted", **kw), on_hold=on_hold)


class Client:
    """The SDK's ClientSession plus the tool list it was given (schemas checked per call)."""

    def __init__(self, session: ClientSession, tools: dict[str, types.Tool]):
        self.s = session
        self.tools = tools

    async def call(self, name: str, args: dict | None = None, **kw) -> types.CallToolResult:
        r = await self.s.call_tool(name, args or {}, **kw)
        assert r.content and r.content[0].type == "text" and r.content[0].text  # text for text-only clients
        if not r.is_error:
            jsonschema.Draft202012Validator(self.tools[name].output_schema).validate(r.structured_content)
        return r

    async def ok(self, name: str, args: dict | None = None, **kw) -> dict:
        r = await self.call(name, args, **kw)
        assert not r.is_error, r.content[0].text
        return r.structured_content

    async def error(self, name: str, args: dict | None = None, **kw) -> dict:
        r = await self.call(name, args, **kw)
        assert r.is_error, r.content[0].text
        sc = r.structured_content
        assert set(sc) == {"code", "message", "data"} and sc["code"] in r.content[0].text
        return sc


@asynccontextmanager
async def connected(host, *, close_host: bool = True, **client_kw):
    """A client connected to ``serve_streams(host)`` over memory streams."""
    async with create_client_server_memory_streams() as ((cr, cw), (sr, sw)):
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_streams, host, sr, sw)
            async with ClientSession(cr, cw, **client_kw) as s:
                await s.initialize()
                tools = {t.name: t for t in (await s.list_tools()).tools}
                yield Client(s, tools)
            await cw.aclose()
    if close_host:
        await host.close()


def run(fn, *args):
    anyio.run(fn, *args)


# ---------------------------------------------------------------------------- tools/list


def test_every_tool_has_explicit_annotations_and_schemas_from_its_models(project, state):
    async def go():
        async with connected(make_host(project, state)) as c:
            assert list(c.tools) == ["execute_command", "read_file", "write_file", "edit_file", "list_directory",
                                     "undo", "get_undo_history", "get_session_status", "diff_step"]
            for spec in TOOLS:
                t = c.tools[spec.name]
                a = t.annotations
                hints = (a.read_only_hint, a.destructive_hint, a.idempotent_hint, a.open_world_hint)
                assert None not in hints, f"{t.name}: every hint is explicit"
                # the shared models' schemas, exactly (sandbox.api.messages.tools)
                assert t.input_schema == models.input_schema(spec.input)
                assert t.output_schema == models.output_schema(spec.output)
                jsonschema.Draft202012Validator.check_schema(t.input_schema)
                jsonschema.Draft202012Validator.check_schema(t.output_schema)
                assert t.output_schema["type"] == "object"
            reads = {"read_file", "list_directory", "get_undo_history", "get_session_status", "diff_step"}
            for name, t in c.tools.items():
                a = t.annotations
                assert a.read_only_hint is (name in reads)
                assert a.destructive_hint is (name not in reads)
                assert a.open_world_hint is False  # network disabled: nothing leaves the sandbox
            assert c.tools["write_file"].annotations.idempotent_hint is True
            for name in ("execute_command", "edit_file", "undo"):
                assert c.tools[name].annotations.idempotent_hint is False
            arg_names = {n: sorted(t.input_schema.get("properties", {})) for n, t in c.tools.items()}
            assert arg_names == {"execute_command": ["command", "timeout_s"], "read_file": ["length", "offset", "path"],
                                 "write_file": ["content", "encoding", "path"],
                                 "edit_file": ["dry_run", "new_text", "old_text", "path"], "list_directory": ["path"],
                                 "undo": ["count", "folder", "force"], "get_undo_history": ["folder"],
                                 "get_session_status": [], "diff_step": ["folder", "step_id"]}
            assert c.s.initialize_result.server_info.version == __version__
    run(go)


def test_open_world_hint_follows_the_network_policy(project, state):
    async def go():
        host = make_host(project, state, network="open")
        async with connected(host) as c:
            assert c.tools["execute_command"].annotations.open_world_hint is True
            assert all(t.annotations.open_world_hint is False for n, t in c.tools.items() if n != "execute_command")
    run(go)


def test_initialize_and_tools_list_answer_while_the_session_boots_and_the_first_call_waits_with_progress(project, state):
    session = Session([Folder(str(project), state_dir=state)], guest="scripted")
    real_start = session.start
    release = threading.Event()

    def gated_start():  # the VM "boots" until the test lets it
        release.wait(WAIT_S)
        return real_start()

    session.start = gated_start

    async def go():
        boot, output = anyio.Event(), anyio.Event()
        host = OwnSessionHost(session)
        with anyio.fail_after(WAIT_S):
            async with connected(host) as c:  # initialize + tools/list: answered before the boot ends
                assert not session.running
                messages = []

                values = []

                async def progress(p, total, msg):
                    messages.append(msg)
                    values.append(p)
                    boot.set()
                    if msg == "booted\n":
                        output.set()

                async with anyio.create_task_group() as tg:
                    result = {}

                    async def call():
                        result["r"] = await c.ok("execute_command", {"command": "echo booted"}, progress_callback=progress)

                    tg.start_soon(call)
                    await boot.wait()  # a progress notification while it boots
                    assert not session.running and "starting" in messages[0]
                    release.set()
                # the client SDK may hand the result over before its last progress callback ran:
                # the server sent the output first (it awaits its progress before answering)
                await output.wait()
                assert result["r"]["stdout"] == "booted\n" and messages[-1] == "booted\n"
                assert values == sorted(set(values))  # one token: progress only increases, boot news then output
    run(go)


def test_output_whose_progress_send_was_cancelled_goes_out_with_the_final_flush():
    """A command's output is sent as progress by a task the call cancels when the command
    ends; a send cancelled half-way (the chunks taken, the first not yet written) must leave
    them for the final flush before the result — else the tail of the output is missing from
    the progress notifications (seen under load: the "booted" of the test above never came)."""
    async def go():
        pump = _ProgressPump(asyncio.get_running_loop())
        sent, stuck = [], anyio.Event()

        async def blocked(chunk: str) -> None:
            stuck.set()
            await anyio.sleep_forever()

        async def send(chunk: str) -> None:
            sent.append(chunk)

        pump.put("one\n")
        pump.put("two\n")
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump.drain, blocked)
            await stuck.wait()
            tg.cancel_scope.cancel()
        await pump.drain(send)
        assert sent == ["one\n", "two\n"]
    run(go)


def test_a_boot_failure_is_a_clear_tool_error_and_the_server_goes_on(project, state):
    def no_vm(run_dir):
        raise RuntimeError("no KVM and no TCG here")

    async def go():
        host = OwnSessionHost(Session([Folder(str(project), state_dir=state)], guest=no_vm))
        async with connected(host) as c:
            e = await c.error("execute_command", {"command": "echo x"})
            assert e["code"] == "session.boot_failed" and "no KVM" in e["message"]
            assert (await c.error("get_session_status"))["code"] == "session.boot_failed"
            assert len(c.tools) == len(TOOLS)  # still answering
    run(go)


# ---------------------------------------------------------------------------- every tool


def test_execute_command_reports_output_step_and_changed_paths_and_undo_restores_the_tree(project, state):
    async def go():
        before = oracle.snapshot_dir(str(project))
        async with connected(make_host(project, state)) as c:
            chunks = []

            async def progress(p, total, msg):
                chunks.append(msg)

            r = await c.ok("execute_command", {"command": "echo removing; rm -r src"}, progress_callback=progress)
            assert r["exit_code"] == 0 and r["stdout"] == "removing\n" and not r["stdout_truncated"]
            assert isinstance(r["step_id"], int) and "undo" in r["undo_hint"]
            ch = r["changes"]
            assert ch["paths_total"] >= 3
            sample = {p["path"]: p["change"] for p in ch["sample"]}
            assert sample["/mnt/working/0/src/main.py"] == "deleted" and ch["deleted"] == ch["paths_total"]
            assert "".join(chunks) == "removing\n"  # output came as progress too
            assert not (project / "src").exists()
            u = await c.ok("undo")
            assert u["step_ids"] == [r["step_id"]] and u["paths_restored"] >= 3 and "re-read" in u["reread_hint"]
            restored = {p["path"]: p["change"] for p in u["paths"]}
            assert restored["/mnt/working/0/src/main.py"] == "recreated" and len(restored) == u["paths_restored"]
            oracle.assert_same(before, oracle.snapshot_dir(str(project)), "after undo")
    run(go)


def test_write_file_and_edit_file_are_one_api_step_each_and_undo_exactly(project, state):
    async def go():
        before = oracle.snapshot_dir(str(project))
        async with connected(make_host(project, state)) as c:
            w = await c.ok("write_file", {"path": "src/new.txt", "content": "fresh\n"})
            assert w["path"] == "/mnt/working/0/src/new.txt" and w["bytes_written"] == 6
            assert (project / "src" / "new.txt").read_text() == "fresh\n"
            w = await c.ok("write_file", {"path": "/mnt/working/0/raw.bin", "content": "AAEC", "encoding": "base64"})
            assert (project / "raw.bin").read_bytes() == b"\0\1\2"

            d = await c.ok("edit_file", {"path": "src/util.py", "old_text": "Y = 1", "new_text": "Y = 2",
                                         "dry_run": True})
            assert not d["applied"] and "-Y = 1" in d["diff"] and "+Y = 2" in d["diff"]
            assert (project / "src" / "util.py").read_text() == "X = 1\nY = 1\n"  # the dry run wrote nothing
            e = await c.ok("edit_file", {"path": "src/util.py", "old_text": "Y = 1", "new_text": "Y = 2"})
            assert e["applied"] and e["diff"] == d["diff"]
            assert (project / "src" / "util.py").read_text() == "X = 1\nY = 2\n"
            assert (project / "src" / "util.py").stat().st_mode & 0o777 == 0o600  # the file's own mode kept

            hist = await c.ok("get_undo_history")
            kinds = [(s["type"], s["paths_sample"]) for s in hist["steps"][:3]]
            assert [k for k, _ in kinds] == ["api", "api", "api"]
            assert "/mnt/working/0/src/util.py" in kinds[0][1] and hist["steps_total"] == 3

            mid = oracle.snapshot_dir(str(project))
            await c.ok("undo")  # the edit
            assert (project / "src" / "util.py").read_text() == "X = 1\nY = 1\n"
            await c.ok("write_file", {"path": "src/util.py", "content": "X = 1\nY = 2\n"})
            await c.ok("undo")
            await c.ok("undo", {"count": 2})  # raw.bin, then new.txt
            oracle.assert_same(before, oracle.snapshot_dir(str(project)), "after undoing every API step")
            assert mid != before
    run(go)


def test_diff_step_shows_each_path_s_change_with_a_unified_diff_and_reads_only(project, state):
    async def go():
        async with connected(make_host(project, state)) as c:
            r = await c.ok("execute_command", {"command": "write src/util.py Y = 7; rm src/main.py; write notes.txt new; "
                                                           "chmod 755 README.md"})
            before = oracle.snapshot_dir(str(project))
            d = await c.ok("diff_step")
            assert d["step_id"] == r["step_id"] and d["folder"] == "/mnt/working/0" and not d["approximate"]
            by = {p["path"]: p for p in d["paths"]}
            util = by["/mnt/working/0/src/util.py"]
            assert util["change"] == "modified" and util["kind"] == "file" and not util["binary"]
            assert "-X = 1" in util["diff"] and "-Y = 1" in util["diff"] and "+Y = 7" in util["diff"]
            assert by["/mnt/working/0/src/main.py"]["change"] == "deleted"
            assert "-def main():" in by["/mnt/working/0/src/main.py"]["diff"]
            assert by["/mnt/working/0/notes.txt"]["change"] == "created"
            readme = by["/mnt/working/0/README.md"]
            assert readme["change"] == "metadata" and "755" in readme["summary"] and not readme["diff"]
            assert d["paths_total"] == len(d["paths"]) == 4
            assert (await c.ok("diff_step", {"step_id": r["step_id"]})) == d
            oracle.assert_same(before, oracle.snapshot_dir(str(project)), "diff_step changed nothing")
            assert [s["step_id"] for s in (await c.ok("get_undo_history"))["steps"]] == [r["step_id"]]

            e = await c.error("diff_step", {"step_id": r["step_id"] + 100})
            assert e["code"] == "undo.no_such_step"
            e = await c.error("diff_step", {"step_id": 0})
            assert e["code"] == "protocol.invalid_request"
    run(go)


def test_edit_file_refuses_no_match_and_ambiguous_text_with_codes(project, state):
    async def go():
        async with connected(make_host(project, state)) as c:
            e = await c.error("edit_file", {"path": "src/util.py", "old_text": "Z = 9", "new_text": "x"})
            assert e["code"] == "edit.no_match"
            e = await c.error("edit_file", {"path": "src/util.py", "old_text": " = 1", "new_text": "x"})
            assert e["code"] == "edit.ambiguous" and e["data"]["occurrences"] == 2
            e = await c.error("edit_file", {"path": "blob.bin", "old_text": "a", "new_text": "b"})
            assert e["code"] == "fs.invalid_argument"
            assert (await c.ok("get_undo_history"))["steps"] == []  # nothing was written
    run(go)


def test_read_file_list_directory_and_status(project, state):
    async def go():
        async with connected(make_host(project, state)) as c:
            r = await c.ok("read_file", {"path": "src/main.py"})
            assert r == {"path": "/mnt/working/0/src/main.py", "size": 25, "offset": 0, "length": 25,
                         "content": "def main():\n    return 1\n", "encoding": "utf-8", "eof": True}
            r = await c.ok("read_file", {"path": "src/main.py", "offset": 4, "length": 4})
            assert r["content"] == "main" and not r["eof"]
            r = await c.ok("read_file", {"path": "blob.bin"})
            assert r["encoding"] == "base64" and r["size"] == 256
            ls = await c.ok("list_directory")
            assert ls["path"] == "/mnt/working/0"
            assert {(e["name"], e["type"]) for e in ls["entries"]} == {
                ("src", "dir"), ("README.md", "file"), ("blob.bin", "file"), ("build", "dir")}
            assert len((await c.ok("list_directory", {"path": "build"}))["entries"]) == 12
            st = await c.ok("get_session_status")
            assert st["state"] == "idle" and st["network"] == "disabled" and st["view"] == "/"
            assert st["folders"] == [{"index": 0, "guest_path": "/mnt/working/0", "host_path": os.path.realpath(project),
                                      "access": "read_write", "undo_available": True}]
            assert st["server_version"] == __version__ and st["pending_safeguards"] == 0
            assert (await c.error("read_file", {"path": "nope.txt"}))["code"] == "fs.not_found"
            assert (await c.error("read_file", {"path": "/etc/passwd"}))["code"] == "fs.outside_mounts"
            assert (await c.error("list_directory", {"path": "README.md"}))["code"] == "fs.not_a_directory"
    run(go)


def test_execute_command_timeout_cancels_the_command_and_bounds_its_output(project, state):
    async def go():
        async with connected(make_host(project, state)) as c:
            r = await c.ok("execute_command", {"command": "write a.txt x; wait", "timeout_s": 0.5})
            assert r["timed_out"] and r["cancelled"] and r["exit_code"] != 0
            long = "y" * 50_000
            r = await c.ok("execute_command", {"command": f"echo {long}"})
            assert r["stdout_truncated"] and len(r["stdout"]) < 40_000 and "characters omitted" in r["stdout"]
            assert r["stdout"].startswith("yyy") and r["stdout"].endswith("y\n")
    run(go)


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(st.text(max_size=30), max_size=30), limit=st.integers(1, 60))
def test_bounded_output_keeps_the_head_and_the_tail_and_counts_the_rest(chunks, limit):
    b = BoundedText(limit)
    for c in chunks:
        b.add(c)
    full = "".join(chunks)
    kept = "".join(b.head) + "".join(b.tail)
    assert len(kept) <= 2 * (limit // 2 or 1) and b.omitted == len(full) - len(kept)
    assert full.startswith("".join(b.head)) and full.endswith("".join(b.tail))
    assert b.truncated == (b.omitted > 0) and (b.text() == full) == (not b.truncated)


# ---------------------------------------------------------------------------- bad input


def test_bad_arguments_are_is_error_results_with_codes_and_the_server_goes_on(project, state):
    async def go():
        async with connected(make_host(project, state)) as c:
            cases = [("read_file", {}), ("read_file", {"path": "x", "bogus": 1}), ("read_file", {"path": 5}),
                     ("read_file", {"path": "x", "offset": -1}), ("undo", {"count": 0}),
                     ("execute_command", {"command": ""}), ("execute_command", {"command": "x", "timeout_s": -1}),
                     ("write_file", {"path": "x", "content": "!!", "encoding": "rot13"}),
                     ("get_undo_history", {"extra": True})]
            for name, args in cases:
                e = await c.error(name, args)
                assert e["code"] == "protocol.invalid_request", (name, args, e)
                assert e["data"]["path"].startswith("$")
            e = await c.error("execute_command", {"command": "echo a\0b"})
            assert e["code"] == "protocol.invalid_request"
            e = await c.error("write_file", {"path": "x", "content": "not base64!", "encoding": "base64"})
            assert e["code"] == "fs.invalid_argument"
            e = await c.error("undo", {"count": 5})
            assert e["code"] == "undo.nothing_to_undo"
            with pytest.raises(MCPError) as ei:  # a protocol fault: a JSON-RPC error
                await c.s.call_tool("no_such_tool", {})
            assert ei.value.code == types.INVALID_PARAMS
            assert (await c.ok("execute_command", {"command": "echo alive"}))["stdout"] == "alive\n"
    run(go)


def test_an_external_edit_makes_undo_explain_the_barrier(project, state):
    async def go():
        host = make_host(project, state, external_policy="barrier")
        async with connected(host) as c:
            await c.ok("write_file", {"path": "README.md", "content": "sandbox edit\n"})
            seen = anyio.Event()
            host.session.on_event = lambda e: e.get("type") == "event.external_modification" and seen.set()
            (project / "README.md").write_text("user edit\n")  # the user, in their editor
            with anyio.fail_after(WAIT_S):
                await seen.wait()
            e = await c.error("undo")
            assert e["code"] == "undo.barrier" and "force" in e["message"] and "the user" in e["message"]
            assert (project / "README.md").read_text() == "user edit\n"
            await c.ok("undo", {"force": True})
            assert (project / "README.md").read_text() == "# demo\n"
    run(go)


# ---------------------------------------------------------------------------- several working folders


@pytest.fixture
def second(tmp_path):
    p = tmp_path / "docs"
    p.mkdir()
    (p / "guide.md").write_text("# guide\n")
    return p


def make_two_folder_host(project, second, state) -> OwnSessionHost:
    return OwnSessionHost(Session([Folder(str(project), state_dir=state),
                                   Folder(str(second), label="docs", state_dir=state + "-docs")], guest="scripted"))


@pytest.mark.filterwarnings("ignore:The roots capability is deprecated")
def test_undo_history_and_diff_step_act_on_the_folder_named_and_say_which(project, second, state):
    """A command writing in two read-write folders makes one step in each; ``folder`` (index,
    label or guest path, as STDIO's ``directory``) picks whose step the undo tools act on, the
    default stays the first folder, and every result names its folder."""
    async def go():
        before0, before1 = oracle.snapshot_dir(str(project)), oracle.snapshot_dir(str(second))
        async with connected(make_two_folder_host(project, second, state)) as c:
            st = await c.ok("get_session_status")
            assert [(f["index"], f["guest_path"]) for f in st["folders"]] == [(0, "/mnt/working/0"),
                                                                             (1, "/mnt/working/1")]
            r = await c.ok("execute_command", {"command": "write a.txt one; write /mnt/working/1/guide.md two"})
            assert r["exit_code"] == 0
            assert {p["path"] for p in r["changes"]["sample"]} == {"/mnt/working/0/a.txt", "/mnt/working/1/guide.md"}
            h0 = await c.ok("get_undo_history")
            assert h0["folder"] == "/mnt/working/0" and len(h0["steps"]) == 1
            assert "/mnt/working/0/a.txt" in h0["steps"][0]["paths_sample"]
            assert all(p.startswith("/mnt/working/0") for p in h0["steps"][0]["paths_sample"])
            for key in (1, "docs", "/mnt/working/1"):
                h1 = await c.ok("get_undo_history", {"folder": key})
                assert h1["folder"] == "/mnt/working/1"
                assert [s["paths_sample"] for s in h1["steps"]] == [["/mnt/working/1/guide.md"]], h1
            d = await c.ok("diff_step", {"folder": "docs"})
            assert d["folder"] == "/mnt/working/1" and [(p["path"], p["change"]) for p in d["paths"]] == [
                ("/mnt/working/1/guide.md", "modified")]
            assert "+two" in d["paths"][0]["diff"]
            assert (await c.ok("diff_step"))["folder"] == "/mnt/working/0"
            u = await c.ok("undo", {"folder": 1})
            assert u["folder"] == "/mnt/working/1" and [p["path"] for p in u["paths"]] == ["/mnt/working/1/guide.md"], u
            oracle.assert_same(before1, oracle.snapshot_dir(str(second)), "folder 1 undone exactly")
            assert (project / "a.txt").read_text() == "one"  # folder 0's step is still there
            assert (await c.error("undo", {"folder": 1}))["code"] == "undo.nothing_to_undo"
            u = await c.ok("undo")
            assert u["folder"] == "/mnt/working/0"
            oracle.assert_same(before0, oracle.snapshot_dir(str(project)), "folder 0 undone exactly")
            for bad in (2, "nope", "/mnt/working/9"):
                for tool in ("undo", "get_undo_history", "diff_step"):
                    e = await c.error(tool, {"folder": bad})
                    assert e["code"] == "session.unknown_directory", (tool, bad, e)
            assert (await c.error("undo", {"folder": -1}))["code"] == "protocol.invalid_request"
    run(go)


@pytest.mark.filterwarnings("ignore:The roots capability is deprecated")
def test_a_folder_outside_the_roots_narrowed_view_is_refused_with_a_code(project, second, state):
    async def go():
        async with connected(make_two_folder_host(project, second, state),
                             list_roots_callback=_roots(second)) as c:
            st = await c.ok("get_session_status")
            assert st["view"] == "/mnt/working/1"
            h = await c.ok("get_undo_history")  # the default: the first folder in the view
            assert h["folder"] == "/mnt/working/1"
            for tool in ("undo", "get_undo_history", "diff_step"):
                for key in (0, "/mnt/working/0", str(project)):
                    e = await c.error(tool, {"folder": key})
                    assert e["code"] == "fs.access_denied" and e["data"]["reason"] == "outside_view", (tool, key, e)
            assert (project / "src" / "main.py").exists()  # nothing of folder 0 was touched
    run(go)


# ---------------------------------------------------------------------------- roots


def _roots(*paths):
    async def list_roots(ctx):
        return types.ListRootsResult(roots=[types.Root(uri=f"file://{p}") for p in paths])
    return list_roots


@pytest.mark.filterwarnings("ignore:The roots capability is deprecated")  # 2026-07-28 drops roots; 2025-11-25 has them
def test_roots_narrow_the_view_for_files_and_commands(project, state):
    async def go():
        roots = [project / "src"]

        async def list_roots(ctx):
            return types.ListRootsResult(roots=[types.Root(uri=f"file://{p}") for p in roots])

        async with connected(make_host(project, state), list_roots_callback=list_roots) as c:
            st = await c.ok("get_session_status")
            assert st["view"] == "/mnt/working/0/src" and st["roots"] == ["/mnt/working/0/src"]
            assert st["roots_refused"] == []
            assert (await c.ok("read_file", {"path": "main.py"}))["path"] == "/mnt/working/0/src/main.py"
            e = await c.error("read_file", {"path": "/mnt/working/0/README.md"})
            assert e["code"] == "fs.access_denied"
            assert (await c.error("write_file", {"path": "/mnt/working/0/x", "content": ""}))["code"] == "fs.access_denied"
            r = await c.ok("execute_command", {"command": "ls; cat /mnt/working/0/README.md"})
            assert r["stdout"].split() == ["main.py", "util.py"] and r["exit_code"] != 0  # the guest sees the view only
            assert (project / "README.md").exists()
            roots[:] = [project / "build"]
            await c.s.send_roots_list_changed()  # the client's roots changed: re-read at the next call
            assert (await c.ok("get_session_status"))["view"] == "/mnt/working/0/build"
    run(go)


def test_roots_never_widen_the_view(project, state, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    async def go():
        async with connected(make_host(project, state),
                             list_roots_callback=_roots(outside, project / "src", "/etc")) as c:
            st = await c.ok("get_session_status")
            assert st["view"] == "/mnt/working/0/src"
            assert st["roots_refused"] == [f"file://{outside}", "file:///etc"]
            assert (await c.error("read_file", {"path": "/etc/passwd"}))["code"] in ("fs.access_denied",
                                                                                    "fs.outside_mounts")
        async with connected(make_host(project, state), list_roots_callback=_roots("/etc")) as c:
            st = await c.ok("get_session_status")
            assert st["view"] == "/" and st["roots"] == [] and st["roots_refused"] == ["file:///etc"]
            assert (await c.error("read_file", {"path": "/etc/passwd"}))["code"] == "fs.outside_mounts"
    run(go)


def test_a_server_view_is_narrowed_further_by_roots_but_never_widened(project, state):
    async def go():
        host = make_host(project, state)
        s = await host.wait_session()
        view = s.table.restrict("/mnt/working/0/src", read_only=True)
        async with create_client_server_memory_streams() as ((cr, cw), (sr, sw)):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: serve_streams(host, sr, sw, view=view))
                async with ClientSession(cr, cw, list_roots_callback=_roots(project)) as cs:
                    await cs.initialize()
                    tools = {t.name: t for t in (await cs.list_tools()).tools}
                    c = Client(cs, tools)
                    st = await c.ok("get_session_status")
                    assert st["view"] == "/mnt/working/0/src" and st["read_only"]
                    assert st["roots_refused"] == [f"file://{project}"]
                    assert (await c.error("write_file", {"path": "x", "content": ""}))["code"] == "fs.access_denied"
                    assert (await c.error("undo"))["code"] == "fs.access_denied"
                await cw.aclose()
        await host.close()
    run(go)


@pytest.mark.filterwarnings("ignore:The roots capability is deprecated")
def test_one_server_object_keeps_each_connection_s_view_and_files_apart(project, state):
    from sandbox.api.mcp.server import build_server

    async def go():
        host = make_host(project, state)
        server = build_server(host)  # as a listener serving many connections uses it

        @asynccontextmanager
        async def connection(**kw):
            async with create_client_server_memory_streams() as ((cr, cw), (sr, sw)):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: server.run(sr, sw, server.create_initialization_options()))
                    async with ClientSession(cr, cw, **kw) as cs:
                        await cs.initialize()
                        yield Client(cs, {t.name: t for t in (await cs.list_tools()).tools})
                    await cw.aclose()

        async with connection(list_roots_callback=_roots(project / "src")) as a, connection() as b:
            assert (await a.ok("get_session_status"))["view"] == "/mnt/working/0/src"
            assert (await b.ok("read_file", {"path": "README.md"}))["content"] == "# demo\n"  # b's view is whole
            assert (await a.ok("read_file", {"path": "main.py"}))["path"] == "/mnt/working/0/src/main.py"
            assert (await a.error("read_file", {"path": "/mnt/working/0/README.md"}))["code"] == "fs.access_denied"
        await host.close()
    run(go)


# ---------------------------------------------------------------------------- safeguards


def _elicit(decision: str | None, asked: list):
    async def elicit(ctx, params):
        asked.append(params.message)
        if decision is None:
            return types.ElicitResult(action="decline")
        return types.ElicitResult(action="accept", content={"decision": decision})
    return elicit


@pytest.mark.parametrize("decision", ["allow", "deny", "decline"])
def test_a_safeguard_is_asked_through_elicitation(project, state, decision):
    async def go():
        before = oracle.snapshot_dir(str(project))
        asked = []
        host = make_host(project, state, safeguard=SafeguardConfig(delete_threshold=5))
        cb = _elicit(None if decision == "decline" else decision, asked)
        async with connected(host, elicitation_callback=cb) as c:
            r = await c.ok("execute_command", {"command": "rm -r build"})
            assert len(asked) == 1 and "build" in asked[0] and "Allow" in asked[0]
            [d] = r["safeguards"]
            assert d["decided_by"] == "user"
            if decision == "allow":
                assert d["action"] == "allow" and r["exit_code"] == 0 and not (project / "build").exists()
            else:
                assert d["action"] == "deny" and r["exit_code"] != 0
                oracle.assert_same(before, oracle.snapshot_dir(str(project)), "after a denied step")
            assert (await c.ok("get_session_status"))["pending_safeguards"] == 0
    run(go)


def test_an_elicitation_the_client_fails_falls_back_to_the_policy(project, state):
    async def go():
        async def fails(ctx, params):
            return types.ErrorData(code=types.INTERNAL_ERROR, message="no UI here")

        host = make_host(project, state, on_hold="allow", safeguard=SafeguardConfig(delete_threshold=5))
        async with connected(host, elicitation_callback=fails) as c:
            r = await c.ok("execute_command", {"command": "rm -r build"})
            assert [(d["action"], d["decided_by"]) for d in r["safeguards"]] == [("allow", "policy")]
            assert r["exit_code"] == 0 and not (project / "build").exists()
    run(go)


@pytest.mark.parametrize("on_hold", ["deny", "allow"])
def test_without_elicitation_the_on_hold_policy_decides(project, state, on_hold):
    async def go():
        before = oracle.snapshot_dir(str(project))
        host = make_host(project, state, on_hold=on_hold, safeguard=SafeguardConfig(delete_threshold=5))
        async with connected(host) as c:
            r = await c.ok("execute_command", {"command": "rm -r build"})
            assert [(d["action"], d["decided_by"]) for d in r["safeguards"]] == [(on_hold, "policy")]
            if on_hold == "allow":
                assert r["exit_code"] == 0 and not (project / "build").exists()
            else:
                assert r["exit_code"] != 0
                oracle.assert_same(before, oracle.snapshot_dir(str(project)), "after a denied step")
    run(go)


def test_a_timeout_while_the_user_is_being_asked_denies_the_hold_and_restores_the_tree(project, state):
    async def go():
        before = oracle.snapshot_dir(str(project))
        asked = anyio.Event()

        async def never_answers(ctx, params):
            asked.set()
            await anyio.sleep_forever()

        host = make_host(project, state, safeguard=SafeguardConfig(delete_threshold=5))
        with anyio.fail_after(WAIT_S):
            async with connected(host, elicitation_callback=never_answers) as c:
                r = await c.ok("execute_command", {"command": "rm -r build", "timeout_s": 1})
                assert asked.is_set() and r["timed_out"] and r["exit_code"] != 0
                oracle.assert_same(before, oracle.snapshot_dir(str(project)), "after the timed-out, held step")
                assert (await c.ok("get_session_status"))["pending_safeguards"] == 0
    run(go)


# ---------------------------------------------------------------------------- disconnect


@pytest.mark.parametrize("while_", ["running", "held"])
def test_a_client_disconnect_mid_command_cancels_the_command_and_closes_its_step(project, state, while_):
    """Running: the command is cancelled. Held by a safeguard while the user is being asked:
    the hold is denied (the step rolled back) — the command cannot end otherwise."""
    async def go():
        before = oracle.snapshot_dir(str(project))
        held = while_ == "held"
        host = make_host(project, state, safeguard=SafeguardConfig(delete_threshold=5) if held else None)
        started = anyio.Event()

        async def progress(p, total, msg):
            if "started" in msg:
                started.set()

        async def ask_forever(ctx, params):
            started.set()
            await anyio.sleep_forever()

        command = "rm -r build" if held else "write a.txt x; echo started; wait"
        with anyio.fail_after(WAIT_S):
            async with create_client_server_memory_streams() as ((cr, cw), (sr, sw)):
                async with anyio.create_task_group() as tg:
                    served = anyio.Event()

                    async def serve():
                        await serve_streams(host, sr, sw)
                        served.set()

                    tg.start_soon(serve)
                    async with ClientSession(cr, cw, elicitation_callback=ask_forever) as cs:
                        await cs.initialize()

                        async def call():
                            with pytest.raises(MCPError, match="Connection closed"):
                                await cs.call_tool("execute_command", {"command": command}, progress_callback=progress)

                        async with anyio.create_task_group() as calls:
                            calls.start_soon(call)
                            await started.wait()
                            await cw.aclose()  # the client goes away mid-command
                            await served.wait()  # the server's connection ended …
                            calls.cancel_scope.cancel()
            s = host.session
            assert not s.command_lock.locked() and s.holds.pending() == []  # … after the command ended
            [step] = s.history()
            assert step["command"] == command and step["ended_ns"]
            if held:
                assert step["outcome"] == "denied"
                oracle.assert_same(before, oracle.snapshot_dir(str(project)), "after the disconnect denied the hold")
        await host.close()
    run(go)


# ---------------------------------------------------------------------------- the real subprocess


def test_sandbox_mcp_over_stdio_rm_and_undo_exact(project, state, tmp_path):
    async def go():
        before = oracle.snapshot_dir(str(project))
        params = StdioServerParameters(command=SANDBOX, args=["mcp", "--workdir", str(project), "--state-dir", state,
                                                               "--guest", "scripted"])
        with open(tmp_path / "stderr", "w") as err:
            async with stdio_client(params, errlog=err) as (r, w):
                async with ClientSession(r, w) as cs:
                    init = await cs.initialize()
                    assert init.server_info.name == "sandbox" and init.server_info.version == __version__
                    c = Client(cs, {t.name: t for t in (await cs.list_tools()).tools})
                    x = await c.ok("execute_command", {"command": "rm -r src"})
                    assert x["exit_code"] == 0 and not (project / "src").exists()
                    await c.ok("undo")
                    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "after undo")
        lines = (tmp_path / "stderr").read_text().splitlines()
        assert lines and all(json.loads(line)["level"] for line in lines)  # logs: JSON lines only
        assert any(json.loads(line)["message"] == "session stopped" for line in lines)
    run(go)


def test_stdout_carries_only_json_rpc(project, state, tmp_path):
    msgs = [{"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
            {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
             "params": {"name": "execute_command", "arguments": {"command": "echo on-stdout"}}},
            {"jsonrpc": "2.0", "id": 4, "method": "no/such_method"}]
    p = subprocess.Popen([SANDBOX, "mcp", "--workdir", str(project), "--state-dir", state, "--guest", "scripted"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "stderr", "w"), text=True)
    p.stdin.write("".join(json.dumps(m) + "\n" for m in msgs))
    p.stdin.flush()
    out = []
    while {1, 2, 3, 4} - {o.get("id") for o in out}:  # stdin stays open: EOF would cancel the command
        line = p.stdout.readline()
        assert line, "stdout ended early"
        out.append(json.loads(line))
    p.stdin.close()
    out += [json.loads(line) for line in p.stdout.read().splitlines()]
    err = (tmp_path / "stderr").read_text()
    assert p.wait(WAIT_S) == 0, err
    assert all(o["jsonrpc"] == "2.0" for o in out)
    by_id = {o["id"]: o for o in out if "id" in o}
    assert by_id[1]["result"]["serverInfo"]["version"] == __version__
    assert len(by_id[2]["result"]["tools"]) == len(TOOLS)
    assert by_id[3]["result"]["structuredContent"]["stdout"] == "on-stdout\n"
    assert by_id[4]["error"]["code"] == -32601
    assert all(json.loads(line) for line in err.splitlines())


# ---------------------------------------------------------------------------- the reference


def test_sandbox_mcp_help_explains_itself():
    r = subprocess.run([SANDBOX, "mcp", "--help"], capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0 and r.stdout.startswith("usage: sandbox mcp ")
    for words in ("--workdir DIR[:ro]", "--on-hold {deny,allow}", "elicitation", "--guest {vm,scripted}",
                  "claude mcp add sandbox -- sandbox mcp --workdir .", "docs/mcp.md", "exit codes:\n  0  "):
        assert words in r.stdout, words
    r = subprocess.run([SANDBOX, "mcp", "--workdir", "/nonexistent-dir"], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=WAIT_S)
    assert r.returncode == 2 and "does not exist" in r.stderr and not r.stdout


def test_docs_mcp_quotes_the_code_s_limits_codes_and_tools():
    from sandbox.api.mcp import limits, models
    from sandbox.api.mcp.errors import MCP_CODES

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "mcp.md")) as f:
        doc = f.read()
    names = [n for n in dir(limits) if n.isupper()] + ["COMMAND_CHARS_MAX", "UNDO_COUNT_MAX", "PATH_CHARS_MAX"]
    for name in names:
        value = getattr(limits, name, None) if hasattr(limits, name) else getattr(models, name)
        assert f"| `{name}` | {value:,} |" in doc, (name, value)
    for code in MCP_CODES:
        assert f"| `{code}` |" in doc, code
    for spec in TOOLS:
        assert f"| `{spec.name}` |" in doc, spec.name


def test_sigterm_mid_command_stops_the_session_and_leaves_an_undoable_step(project, state, tmp_path):
    before = oracle.snapshot_dir(str(project))
    err = open(tmp_path / "stderr", "w")
    p = subprocess.Popen([SANDBOX, "mcp", "--workdir", str(project), "--state-dir", state, "--guest", "scripted"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    msgs = [{"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
             "params": {"name": "execute_command", "_meta": {"progressToken": "t"},
                        "arguments": {"command": "rm -r src; echo started; wait"}}}]
    p.stdin.write("".join(json.dumps(m) + "\n" for m in msgs))
    p.stdin.flush()
    while True:  # until the command's output arrives as progress: it is running
        line = p.stdout.readline()
        assert line, "stdout ended early"
        m = json.loads(line)
        if m.get("method") == "notifications/progress" and "started" in m["params"].get("message", ""):
            break
    p.terminate()
    assert p.wait(WAIT_S) == 0
    err.close()
    logs = [json.loads(line) for line in (tmp_path / "stderr").read_text().splitlines()]
    assert any(e["message"] == "session stopped" for e in logs)
    assert not (project / "src").exists()
    u = subprocess.run([SANDBOX, "undo", "--workdir", str(project), "--state-dir", state], capture_output=True,
                       text=True, timeout=WAIT_S)
    assert u.returncode == 0, u.stderr
    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "after undoing the interrupted step")


def test_sandbox_mcp_over_stdio_bounds_a_message_with_no_end(project, state, tmp_path):
    """A line longer than MESSAGE_BYTES_MAX on stdin (here: with no newline at all) is never
    held whole: the connection is closed, logged, and the server exits cleanly."""
    from sandbox.api.mcp.lines import MESSAGE_BYTES_MAX

    p = subprocess.Popen([SANDBOX, "mcp", "--workdir", str(project), "--state-dir", state, "--guest", "scripted"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "stderr", "w"))

    def flood() -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            chunk = b"x" * (1 << 20)
            for _ in range(MESSAGE_BYTES_MAX // len(chunk) + 1):
                p.stdin.write(chunk)
            p.stdin.flush()  # and stdin stays open: only the bound can end this connection

    writer = threading.Thread(target=flood, daemon=True)
    writer.start()
    try:
        assert p.wait(WAIT_S) == 0
    finally:
        p.kill()
        with contextlib.suppress(OSError):
            p.stdin.close()
    assert p.stdout.read() == b""
    assert f"longer than {MESSAGE_BYTES_MAX} bytes" in (tmp_path / "stderr").read_text()
