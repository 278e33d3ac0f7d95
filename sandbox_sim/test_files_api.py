"""The handle-based file API (seed 002) over STDIO: ``sandbox serve`` with the scripted guest.

Handles, one-shot calls, API steps and their undo, listings above the mounts, restricted
views, and bad input — every error a stable code carrying its errno, never
``protocol.internal``. Every message is validated against the shipped schema as it arrives.
"""

from __future__ import annotations

import base64
import os

import pytest

from sandbox.api import schema
from sandbox.files import HANDLES_MAX, READ_CALL_BYTES_MAX
from sandbox_sim import test_stdio_api as base
from sandbox_sim.test_stdio_api import start

# the STDIO tests' fixtures: a `sandbox serve` client factory, the project, the scripted guest
api, cmds, guest, project, state_home = base.api, base.cmds, base.guest, base.project, base.state_home

pytestmark = pytest.mark.timeout(180)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_the_agent_dispatches_exactly_the_schema_s_operations():
    from sandbox.api.agent import Agent

    assert set(Agent(lambda m: None, guest="scripted")._dispatch) == set(schema.REQUESTS)


def test_handles_write_read_seek_stat_close_and_the_handle_is_one_undoable_api_step(api, project):
    c = api()
    start(c, project)
    h = c.ok("fs.open", {"path": "notes.txt", "mode": "w"})["handle"]
    assert c.ok("fs.write", {"handle": h, "data": "hello "})["bytes_written"] == 6
    assert c.ok("fs.write", {"handle": h, "data": b64(b"world\n"), "encoding": "base64"})["bytes_written"] == 6
    assert c.ok("fs.stat", {"handle": h})["size"] == 12
    c.ok("fs.close", {"handle": h})
    assert (project / "notes.txt").read_text() == "hello world\n"
    steps = c.ok("undo.history")["steps"]
    assert steps[0]["type"] == "api" and "notes.txt" in steps[0]["paths"]
    assert len([s for s in steps if s["type"] == "api"]) == 1  # one step for the whole handle

    h = c.ok("fs.open", {"path": "/mnt/working/0/notes.txt", "mode": "r+"})["handle"]
    assert c.ok("fs.read", {"handle": h, "length": 5})["data"] == "hello"
    assert c.ok("fs.seek", {"handle": h, "offset": -6, "whence": "end"})["position"] == 6
    c.ok("fs.write", {"handle": h, "data": "WORLD"})
    assert c.ok("fs.seek", {"handle": h, "offset": 0})["position"] == 0
    r = c.ok("fs.read", {"handle": h})
    assert r["data"] == "hello WORLD\n" and not r["eof"]
    assert c.ok("fs.read", {"handle": h})["eof"]
    c.ok("fs.close", {"handle": h})
    c.ok("undo.rollback", {})  # the r+ handle's step
    assert (project / "notes.txt").read_text() == "hello world\n"
    c.ok("undo.rollback", {})  # the w handle's step: the file did not exist
    assert not (project / "notes.txt").exists()


def test_one_shot_write_mkdir_rename_remove_are_each_an_api_step(api, project):
    c = api()
    start(c, project)
    before = c.ok("undo.history")["steps"]
    assert c.ok("fs.write", {"path": "new.txt", "data": "one\n"})["bytes_written"] == 4
    assert c.ok("fs.mkdir", {"path": "a/b/c", "parents": True})["path"] == "/mnt/working/0/a/b/c"
    assert c.ok("fs.rename", {"src": "new.txt", "dst": "a/b/c/moved.txt"})["path"] == "/mnt/working/0/a/b/c/moved.txt"
    assert c.ok("fs.remove", {"path": "victims", "recursive": True})["removed"] == 21
    assert c.ok("fs.read", {"path": "a/b/c/moved.txt"})["data"] == "one\n"
    steps = c.ok("undo.history")["steps"]
    assert [s["type"] for s in steps[:4]] == ["api"] * 4 and len(steps) == len(before) + 4
    c.ok("undo.rollback", {"count": 4})
    assert not (project / "a").exists() and not (project / "new.txt").exists()
    assert len(list((project / "victims").iterdir())) == 20


def test_create_temp_never_reaches_the_folder(api, project):
    c = api()
    start(c, project)
    h = c.ok("fs.create_temp")["handle"]
    c.ok("fs.write", {"handle": h, "data": "scratch"})
    c.ok("fs.seek", {"handle": h, "offset": 0})
    assert c.ok("fs.read", {"handle": h})["data"] == "scratch"
    st = c.ok("fs.stat", {"handle": h})
    assert st["size"] == 7 and st["temporary"] is True
    c.ok("fs.close", {"handle": h})
    assert c.ok("undo.history")["steps"] == [] or all(s["type"] != "api" for s in c.ok("undo.history")["steps"])
    assert sorted(p.name for p in project.iterdir()) == ["README.md", "src", "victims"]


def test_listing_above_the_mounts_and_in_memory_mounts(api, project):
    c = api()
    start(c, project, mounts=[{"path": "/mnt/tools", "files": {"hello.sh": b64(b"hi\n"), "lib/x.py": b64(b"x\n")}}])
    assert [e["name"] for e in c.ok("fs.list", {"path": "/"})["entries"]] == ["mnt"]
    assert {e["name"]: e["type"] for e in c.ok("fs.list", {"path": "/mnt"})["entries"]} == {"working": "dir", "tools": "dir"}
    assert {e["name"] for e in c.ok("fs.list", {"path": "/mnt/tools"})["entries"]} == {"hello.sh", "lib"}
    h = c.ok("fs.open", {"path": "/mnt/tools/hello.sh"})["handle"]
    assert c.ok("fs.read", {"handle": h})["data"] == "hi\n"
    e = c.error("fs.open", {"path": "/mnt/tools/hello.sh", "mode": "a"})  # a read-only mount
    assert e["code"] == "fs.access_denied" and e["data"]["errno"] == "EACCES"
    assert c.error("fs.list", {"path": "/etc"})["code"] == "fs.outside_mounts"


def test_restrict_narrows_the_api_s_files_and_closes_handles_it_no_longer_allows(api, project):
    c = api()
    start(c, project)
    h_src = c.ok("fs.open", {"path": "src/app.py"})["handle"]
    h_readme = c.ok("fs.open", {"path": "README.md"})["handle"]
    c.ok("session.restrict", {"path": "/mnt/working/0/src", "readonly": True})
    assert c.ok("fs.read", {"handle": h_src})["data"] == "print('hello')\n"
    assert c.error("fs.read", {"handle": h_readme})["code"] == "fs.invalid_handle"  # closed by the restriction
    assert c.error("fs.open", {"path": "/mnt/working/0/README.md"})["code"] == "fs.access_denied"
    assert c.error("fs.write", {"path": "app.py", "data": "x"})["code"] == "fs.access_denied"
    assert [e["name"] for e in c.ok("fs.list", {"path": "/mnt/working/0"})["entries"]] == ["src"]  # the way down
    assert [e["name"] for e in c.ok("fs.list", {"path": "/mnt"})["entries"]] == ["working"]


def test_bad_input_gets_stable_codes_with_errnos_never_internal(api, project):
    c = api()
    start(c, project)
    h = c.ok("fs.open", {"path": "README.md"})["handle"]
    c.ok("fs.close", {"handle": h})
    cases = [
        ("fs.read", {"handle": h}, "fs.invalid_handle", "EINVAL"),  # closed
        ("fs.read", {"handle": 10 ** 6}, "fs.invalid_handle", "EINVAL"),  # never opened
        ("fs.close", {"handle": h}, "fs.invalid_handle", "EINVAL"),
        ("fs.open", {"path": "/etc/passwd"}, "fs.outside_mounts", "EACCES"),
        ("fs.open", {"path": "../secret"}, "fs.outside_mounts", "EACCES"),
        ("fs.open", {"path": "a\ud800b"}, "fs.invalid_path", "EINVAL"),  # a lone surrogate: no file has that name
        ("fs.write", {"path": "\udcff", "data": "x"}, "fs.invalid_path", "EINVAL"),
        ("fs.open", {"path": "missing"}, "fs.not_found", "ENOENT"),
        ("fs.open", {"path": "src"}, "fs.is_a_directory", "EISDIR"),
        ("fs.open", {"path": "README.md", "mode": "x"}, "fs.exists", "EEXIST"),
        ("fs.mkdir", {"path": "src"}, "fs.exists", "EEXIST"),
        ("fs.remove", {"path": "src"}, "fs.not_empty", "ENOTEMPTY"),
        ("fs.remove", {"path": "/mnt/working/0"}, "fs.busy", "EBUSY"),
        ("fs.write", {"path": "x", "data": "!!", "encoding": "base64"}, "fs.invalid_argument", "EINVAL"),
    ]
    for t, p, code, err in cases:
        e = c.error(t, p)
        assert (e["code"], e["data"].get("errno")) == (code, err), (t, p, e)
    h = c.ok("fs.open", {"path": "README.md"})["handle"]
    assert c.error("fs.seek", {"handle": h, "offset": -1})["code"] == "fs.invalid_argument"
    assert c.error("fs.seek", {"handle": h, "offset": 2 ** 63 - 1, "whence": "end"})["code"] == "fs.invalid_argument"
    assert c.error("fs.read", {"handle": h, "length": READ_CALL_BYTES_MAX + 1})["code"] == "fs.too_large"
    assert c.error("fs.write", {"handle": h, "data": "x"})["data"]["errno"] == "EBADF"  # opened r
    c.ok("fs.seek", {"handle": h, "offset": 2 ** 62})
    assert c.ok("fs.read", {"handle": h})["data"] == ""  # past the end: empty, eof
    w = c.ok("fs.open", {"path": "big", "mode": "w"})["handle"]
    c.ok("fs.seek", {"handle": w, "offset": 2 ** 62})
    assert c.error("fs.write", {"handle": w, "data": "x"})["code"] == "fs.too_large"  # a 4 EiB hole
    c.ok("fs.close", {"handle": w})
    opened = [h, w]
    codes = set()
    for _ in range(HANDLES_MAX + 2):  # a flood
        r = c.request("fs.open", {"path": "README.md"})
        if r["status"] == "ok":
            opened.append(r["payload"]["handle"])
        else:
            codes.add(r["error"]["code"])
    assert codes == {"fs.too_many_handles"}
    assert c.ok("session.status")["files"]["handles_open"] == HANDLES_MAX
    assert c.ok("session.status")["files"]["rejects"] >= len(cases)


def test_a_write_while_a_command_runs_joins_the_command_s_step(api, project, cmds):
    c = api()
    start(c, project)
    m = c.mark()
    rid = c.send("agent.execute", {"command": f"{cmds.echo('started')}; {cmds.wait()}"})
    c.wait_event("event.terminal_output", lambda p: "started" in p["data"], m)  # the command's step is open
    c.ok("fs.write", {"path": "during.txt", "data": "x"})
    c.ok("agent.cancel", {"request_id": rid})
    assert c.response(rid)["status"] == "ok"
    steps = c.ok("undo.history")["steps"]
    assert steps[0]["type"] == "command" and "during.txt" in steps[0]["paths"]
    assert not any(s["type"] == "api" for s in steps)
    c.ok("undo.rollback", {})
    assert not (project / "during.txt").exists()


def test_an_open_write_handle_does_not_block_a_command_or_an_undo(api, project, cmds):
    c = api()
    start(c, project)
    h = c.ok("fs.open", {"path": "log.txt", "mode": "w"})["handle"]
    c.ok("fs.write", {"handle": h, "data": "before\n"})
    r = c.ok("agent.execute", {"command": cmds.write("/mnt/working/0/cmd.txt", "c")})
    assert r["exit_code"] == 0
    c.ok("fs.write", {"handle": h, "data": "after\n"})
    c.ok("fs.close", {"handle": h})
    steps = c.ok("undo.history")["steps"]
    assert [(s["type"], sorted(set(s["paths"]) - {""})) for s in steps[:3]] == [
        ("api", ["log.txt"]), ("command", ["cmd.txt"]), ("api", ["log.txt"])]
    c.ok("undo.rollback", {"count": 3})
    assert not (project / "log.txt").exists() and not (project / "cmd.txt").exists()


def test_an_api_write_that_trips_a_safeguard_is_denied_and_its_step_rolled_back(api, project):
    c = api()
    start(c, project, safeguard={"delete_threshold": 3})
    before = sorted(p.name for p in (project / "victims").iterdir())
    m = c.mark()
    e = c.error("fs.remove", {"path": "victims", "recursive": True})
    assert e["code"] == "safeguard.denied"
    assert c.events("event.safeguard_triggered", m)  # the frontend is told what happened
    assert sorted(p.name for p in (project / "victims").iterdir()) == before  # rolled back
    assert c.ok("session.status")["pending_safeguards"] == []
    c.ok("fs.write", {"path": "after.txt", "data": "ok"})  # the next API step is fine
    assert (project / "after.txt").read_text() == "ok"


def test_a_recursive_remove_of_a_tree_deeper_than_python_s_stack_is_one_undoable_step(api, project):
    """A tree nested 1,500 levels (made by a local process, or a guest's runaway script)
    is removed without recursion: never ``protocol.internal``, and one undo brings it back."""
    fd = os.open(project, os.O_RDONLY)
    os.mkdir("deep", dir_fd=fd)
    d = os.open("deep", os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    for _ in range(1500):
        os.mkdir("d", dir_fd=d)
        n = os.open("d", os.O_RDONLY, dir_fd=d)
        os.close(d)
        d = n
    with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d), "w") as f:
        f.write("bottom\n")
    os.close(d)
    c = api()
    start(c, project)
    assert c.ok("fs.remove", {"path": "deep", "recursive": True})["removed"] == 1502
    assert not (project / "deep").exists()
    c.ok("undo.rollback", {})
    assert (project / "deep" / "d" / "d").is_dir()
    c.ok("fs.remove", {"path": "deep", "recursive": True})  # pytest's own cleanup recurses


def test_writing_over_a_symlink_or_a_special_file_says_what_is_there_and_never_follows(api, project, tmp_path):
    """A write by path onto a symlink (here one leading out of the folder) or a FIFO fails
    with the same code a read gets — ``fs.symlink``/``ELOOP``, ``fs.not_a_file``/``ENXIO`` —
    and the target outside is untouched."""
    outside = tmp_path / "outside.txt"
    outside.write_text("secret\n")
    os.symlink(outside, project / "out")
    os.mkfifo(project / "pipe")
    c = api()
    start(c, project)
    for t, p in [("fs.write", {"path": "out", "data": "x"}), ("fs.open", {"path": "out", "mode": "w"}),
                 ("fs.open", {"path": "out", "mode": "r+"}), ("fs.read", {"path": "out"})]:
        e = c.error(t, p)
        assert (e["code"], e["data"]["errno"]) == ("fs.symlink", "ELOOP"), (t, p, e)
    for t, p in [("fs.write", {"path": "pipe", "data": "x"}), ("fs.open", {"path": "pipe", "mode": "a"}),
                 ("fs.read", {"path": "pipe"})]:
        e = c.error(t, p)
        assert (e["code"], e["data"]["errno"]) == ("fs.not_a_file", "ENXIO"), (t, p, e)
    assert outside.read_text() == "secret\n" and os.readlink(project / "out") == str(outside)
