"""Undo notifications in the guest: the ``rollback_notify`` message, the shim's undo events
file and ``$SANDBOX_UNDO_EVENTS``, and the session telling the (scripted) guest.

The shim runs for real as a subprocess (as in ``test_shim.py``); ``e2e/test_undo_events_vm.py``
shows a command in a real VM reading the file after an undo.
"""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import pytest

import sandbox
from sandbox.guest import control as proto
from sandbox.guest.shim import UndoEvents
from sandbox.scripted.guest import ScriptedGuest

from .test_shim import ShimProcess, text_of

pytestmark = pytest.mark.timeout(60)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_shim_appends_one_line_per_undo_and_names_the_file_for_commands(tmp_path):
    events = tmp_path / "run" / "sandbox-undo" / "events.jsonl"
    shim = ShimProcess(tmp_path, "--undo-events", str(events))
    try:
        assert events.read_bytes() == b""  # there before any undo, so tools can open it
        assert stat.S_IMODE(events.stat().st_mode) == 0o644 and stat.S_IMODE(events.parent.stat().st_mode) == 0o755
        assert text_of(shim.run(1, f'echo "${proto.UNDO_EVENTS_ENV}"'), "stdout") == f"{events}\n"
        msg = proto.rollback_notify_request(7, step_ids=[7, 6], folder="/mnt/working/0",
                                            paths=[{"path": ".", "change": "restored"},
                                                   {"path": "src/a.py", "change": "recreated"}])
        shim.send(msg)
        assert shim.recv() == {"type": "rollback_noted", "step_id": 7}
        (line,) = _lines(events)
        assert line["step_ids"] == [7, 6] and line["folder"] == "/mnt/working/0" and line["paths_truncated"] is False
        assert line["paths"] == [{"path": "/mnt/working/0", "change": "restored"},
                                 {"path": "/mnt/working/0/src/a.py", "change": "recreated"}]
        assert isinstance(line["time_ns"], int)
        shim.send({"type": "rollback_notify", "step_id": 8})  # the old form: still noted, and a line
        assert shim.recv() == {"type": "rollback_noted", "step_id": 8}
        assert _lines(events)[1] == {**_lines(events)[1], "step_ids": [8], "folder": None, "paths": []}
        bad = [{"type": "rollback_notify", "step_id": 9, "paths": [{"path": "/etc/passwd", "change": "restored"}]},
               {"type": "rollback_notify", "step_id": 9, "paths": [{"path": "a", "change": "eaten"}]},
               {"type": "rollback_notify", "step_id": 9, "folder": "relative"},
               {"type": "rollback_notify", "step_id": 9, "paths": [{"path": "a\nb", "change": "removed"}]},
               {"type": "rollback_notify", "step_id": 9, "paths_truncated": "yes"}]
        for b in bad:
            shim.send(b)
            assert shim.recv()["type"] == "error", b
        assert len(_lines(events)) == 2  # refused messages write nothing
        shim.send({"type": "ping", "id": 1})
        assert shim.recv() == {"type": "pong", "id": 1}
    finally:
        assert shim.close() == 0


def test_without_the_option_there_is_no_file_and_no_variable(tmp_path):
    shim = ShimProcess(tmp_path)
    try:
        assert text_of(shim.run(1, f'echo "[${proto.UNDO_EVENTS_ENV}]"'), "stdout") == "[]\n"
        shim.send({"type": "rollback_notify", "step_id": 3})
        assert shim.recv() == {"type": "rollback_noted", "step_id": 3}
    finally:
        assert shim.close() == 0


def test_the_file_rotates_at_its_limit_and_never_follows_symlinks(tmp_path):
    path = tmp_path / "events.jsonl"
    ev = UndoEvents(str(path), bytes_max=200)
    ev.prepare()
    for i in range(6):
        ev.append({"step_ids": [i], "pad": "x" * 60})
    assert path.stat().st_size <= 200 and (tmp_path / "events.jsonl.1").stat().st_size <= 200
    assert _lines(path)[-1]["step_ids"] == [5]
    assert all(x["step_ids"][0] < 5 for x in _lines(tmp_path / "events.jsonl.1"))
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(victim)
    UndoEvents(str(link)).append({"step_ids": [1]})  # O_NOFOLLOW: refused (reported on stderr), never written
    assert victim.read_text() == "mine\n"


def test_notify_request_bounds_the_paths():
    many = [{"path": f"d/f{i:05d}", "change": "removed"} for i in range(proto.ROLLBACK_NOTIFY_PATHS_MAX + 5)]
    msg = proto.rollback_notify_request(1, paths=many)
    assert len(msg["paths"]) == proto.ROLLBACK_NOTIFY_PATHS_MAX and msg["paths_truncated"] is True
    long = [{"path": "x" * 4000 + str(i), "change": "restored"} for i in range(100)]
    msg = proto.rollback_notify_request(1, paths=long)
    assert sum(len(p["path"]) for p in msg["paths"]) <= proto.ROLLBACK_NOTIFY_PATH_BYTES_MAX and msg["paths_truncated"]
    assert len(proto.encode(msg)) < proto.LINE_MAX_BYTES_DEFAULT


def test_guest_init_passes_the_documented_path():
    init = (Path(sandbox.__file__).parent / "guest" / "init.sh").read_text()
    assert f"--undo-events {proto.UNDO_EVENTS_PATH}" in init


def test_session_undo_tells_the_guest_every_step_and_path(tmp_path):
    asyncio.run(_session_undo(tmp_path))


async def _session_undo(tmp_path):
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "a.txt").write_text("alpha\n")
    guest = ScriptedGuest()
    vol = sandbox.Volume(str(proj), "/workspace", False, state_dir=str(tmp_path / "state"))
    async with sandbox.Sandbox(volumes=[vol], guest=lambda run_dir: guest, external_modification_policy=None) as sb:
        first = await sb.run("write /workspace/src/a.txt changed")
        second = await sb.run("write /workspace/new.txt x; rm /workspace/src/a.txt")
        undone = await sb.undo(2)
        assert undone["step_ids"] == [second.step_id, first.step_id]
        assert {p["path"]: p["change"] for p in undone["paths"]} == {
            ".": "restored", "new.txt": "removed", "src": "restored", "src/a.txt": "recreated"}
    (event,) = guest.undo_events
    assert event["step_ids"] == [second.step_id, first.step_id] and event["folder"] == "/workspace"
    assert event["paths"] == undone["paths"] and event["paths_truncated"] is False
    assert guest.rollbacks == [second.step_id]
