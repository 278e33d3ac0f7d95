"""``undo.diff`` through a real ``sandbox serve`` (scripted guest), the rollback result's
``paths`` on STDIO, and ``sandbox diff`` as a subprocess.

Every message the agent emits is validated against the shipped schema by the client.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import sandbox
from sandbox_sim import oracle
from sandbox_sim.test_stdio_api import api, cmds, guest, project, start, state_home  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(180)


def test_undo_diff_over_stdio_then_rollback_lists_paths(api, project, cmds):  # noqa: F811
    c = api()
    start(c, project)
    before = oracle.snapshot_dir(str(project))
    r = c.ok("agent.execute", {"command": f"{cmds.write('README.md', 'changed')}; {cmds.write('new.txt', 'hi')}; "
                                          f"{cmds.rm_r('victims')}"})
    sid = r["step_id"]
    d = c.ok("undo.diff", {})
    assert d["step_id"] == sid and d["directory"] == 0 and d["type"] == "command"
    p = {e["path"]: e for e in d["paths"]}
    assert p["README.md"]["change"] == "modified" and "-# project\n" in p["README.md"]["diff"]
    assert p["new.txt"]["change"] == "created" and p["victims/v00"]["change"] == "deleted"
    assert p["victims"]["change"] == "deleted" and p["victims"]["kind"] == "dir"
    assert d["paths_total"] == len(d["paths"]) and not d["paths_truncated"]
    assert c.ok("undo.diff", {"step_id": sid, "directory": "project"})["paths"] == d["paths"]
    e = c.error("undo.diff", {"step_id": sid + 100})
    assert e["code"] == "undo.no_such_step" and e["data"]["step_id"] == sid + 100
    assert c.error("undo.diff", {"step_id": "x"})["code"] == "protocol.invalid_request"
    assert oracle.snapshot_dir(str(project)) != before  # the diff changed nothing
    rb = c.ok("undo.rollback", {})
    changes = {x["path"]: x["change"] for x in rb["paths"]}
    assert changes["README.md"] == "restored" and changes["new.txt"] == "removed"
    assert changes["victims/v00"] == "recreated" and rb["paths_truncated"] is False
    assert oracle.snapshot_dir(str(project)) == before
    assert c.error("undo.diff", {})["code"] == "undo.no_such_step"  # nothing left in history


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120)


def test_sandbox_diff_cli(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    state = str(tmp_path / "state")
    with sandbox.Workspace.open(str(work), state_dir=state) as ws:
        with ws.step("first"):
            ws.fs.write_file("a.txt", b"one\n")
        with ws.step("second") as second:
            ws.fs.write_file("a.txt", b"two\n")
            ws.fs.chmod("a.txt", 0o600)
    r = _cli("diff", "--workdir", str(work), "--state-dir", state)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"step {second.id} (command): second\n1 path(s) changed\n")
    assert "modified  file     a.txt" in r.stdout and "-one\n+two\n" in r.stdout
    r = _cli("diff", "-n", "2", "--workdir", str(work), "--state-dir", state, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["command"] == "first" and d["paths"][0]["change"] == "created" and "+two\n" in d["paths"][0]["diff"]
    r = _cli("diff", "--step", str(second.id), "--workdir", str(work), "--state-dir", state, "--json")
    assert json.loads(r.stdout)["step_id"] == second.id
    r = _cli("diff", "-n", "3", "--workdir", str(work), "--state-dir", state)
    assert r.returncode == 1 and "only 2 step(s)" in r.stderr
    r = _cli("diff", "--step", "999", "--workdir", str(work), "--state-dir", state)
    assert r.returncode == 1 and "no step 999" in r.stderr
    r = _cli("diff", "-n", "0", "--workdir", str(work), "--state-dir", state)
    assert r.returncode == 2
    assert (work / "a.txt").read_bytes() == b"two\n"
    with sandbox.Workspace.open(str(work), state_dir=state) as ws:
        assert [h["command"] for h in ws.history()] == ["second", "first"]


def test_undo_diff_in_a_restricted_view_lists_only_paths_inside_it(api, project, cmds):  # noqa: F811
    c = api()
    start(c, project)
    c.ok("agent.execute", {"command": f"{cmds.write('src/app.py', 'x')}; {cmds.write('README.md', 'secret')}"})
    assert {e["path"] for e in c.ok("undo.diff")["paths"]} == {"src/app.py", "README.md"}
    c.ok("session.restrict", {"path": "/mnt/working/0/src"})
    d = c.ok("undo.diff")
    assert [e["path"] for e in d["paths"]] == ["src/app.py"] and d["paths_total"] == 1
    assert "secret" not in json.dumps(d["paths"])
