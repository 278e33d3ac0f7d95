"""Undo notifications in a real VM: after an undo, a command reads ``$SANDBOX_UNDO_EVENTS``
(``/run/sandbox-undo/events.jsonl``, kept by the shim) and finds the restored paths.

One boot (about 10 s under TCG; the guest image rebuilds once when ``sandbox/guest/*``
changed). Skipped with the reason where QEMU or the guest image cannot be had.
"""

from __future__ import annotations

import asyncio
import json

import pytest

import sandbox
from sandbox.guest import control as proto

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def guest_available(vm_guest):
    """The test boots a session VM (conftest.vm_guest skips with the reason otherwise)."""


def test_a_command_reads_the_restored_paths_after_an_undo(tmp_path):
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "app.py").write_text("print('hi')\n")

    async def main():
        async with sandbox.Sandbox(volumes=[sandbox.Volume(str(proj), "/workspace", state_dir=str(tmp_path / "s"))],
                                   network="disabled", guest="vm", external_modification_policy=None) as sb:
            r = await sb.run('echo "$SANDBOX_UNDO_EVENTS"; stat -c %a "$SANDBOX_UNDO_EVENTS" /run/sandbox-undo; '
                             'wc -c < "$SANDBOX_UNDO_EVENTS"; id -u')
            assert r.exit_code == 0, r.stderr
            path, file_mode, dir_mode, size, uid = r.stdout.split()
            assert (path, file_mode, dir_mode, size) == (proto.UNDO_EVENTS_PATH, "644", "755", "0")
            r = await sb.run("rm -rf src && echo new > made.txt")
            assert r.exit_code == 0, r.stderr
            undone = await sb.undo(1)
            assert undone["step_ids"] == [r.step_id]
            r2 = await sb.run('cat "$SANDBOX_UNDO_EVENTS"; { echo x >> "$SANDBOX_UNDO_EVENTS"; } 2>/dev/null && echo WROTE; true')
            assert r2.exit_code == 0, r2.stderr
            return uid, r2.stdout, undone

    uid, out, undone = asyncio.run(main())
    lines = out.splitlines()
    if uid != "0":  # the agent user (the default) cannot write the file
        assert "WROTE" not in lines
    event = json.loads(lines[0])
    assert event["step_ids"] == undone["step_ids"] and event["folder"] == "/workspace"
    changes = {p["path"]: p["change"] for p in event["paths"]}
    assert changes["/workspace/src/app.py"] == "recreated" and changes["/workspace/made.txt"] == "removed"
    assert changes == {"/workspace" + ("" if p["path"] == "." else "/" + p["path"]): p["change"] for p in undone["paths"]}
    assert (proj / "src" / "app.py").read_text() == "print('hi')\n"
