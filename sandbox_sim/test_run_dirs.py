"""Run directories of killed sessions are removed at the next start; live ones never.

Real processes own the directories (a SIGKILLed one leaves its directory, a live one holds
its lock); the session under test is a scripted one (no VM). The temp dir is the test's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

from sandbox.session.runtime import RUN_LOCK_NAME, Folder, Session, new_run_dir, remove_stale_run_dirs

OWNER = textwrap.dedent("""
    import socket, sys, os
    from sandbox.session.runtime import new_run_dir
    d, fd = new_run_dir(sys.argv[1])
    s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(d, "9p.sock"))  # what a session leaves
    print(d, flush=True)
    sys.stdin.read()
""")


def _owner(base: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.Popen([sys.executable, "-c", OWNER, base], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                         text=True)
    line = p.stdout.readline().strip()
    assert line, f"the owner ended (rc={p.wait()})"
    return p, line


def _end(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()
    p.stdin.close()
    p.stdout.close()


def test_a_killed_sessions_run_dir_goes_at_the_next_start_a_live_ones_stays(tmp_path, monkeypatch):
    base = str(tmp_path / "tmp")
    os.mkdir(base)
    monkeypatch.setattr(tempfile, "tempdir", base)
    killed, stale = _owner(base)
    live, alive = _owner(base)
    foreign = os.path.join(base, "sandbox-vm-nolock")  # no lock file: not ours to judge
    os.mkdir(foreign)
    work = tmp_path / "work"
    work.mkdir()
    try:
        killed.send_signal(signal.SIGKILL)
        assert killed.wait() == -signal.SIGKILL
        assert os.path.exists(os.path.join(stale, "9p.sock"))
        with Session([Folder(str(work), state_dir=str(tmp_path / "state"))], guest="scripted") as s:
            mine = s._s.run_dir
            assert not os.path.exists(stale), "the killed session's run dir (and socket) is still there"
            assert os.path.exists(os.path.join(alive, "9p.sock")), "a live session's run dir was removed"
            assert os.path.isdir(foreign)
            assert remove_stale_run_dirs(base) == [], "a running session's own run dir counted as stale"
        assert not os.path.exists(mine)
        assert sorted(os.listdir(base)) == sorted([os.path.basename(alive), "sandbox-vm-nolock"])
    finally:
        _end(killed)
        _end(live)


def test_the_lock_file_is_named_only_once_locked(tmp_path):
    d, fd = new_run_dir(str(tmp_path))
    try:
        assert os.listdir(d) == [RUN_LOCK_NAME]
        assert remove_stale_run_dirs(str(tmp_path)) == []
    finally:
        os.close(fd)
    assert remove_stale_run_dirs(str(tmp_path)) == [d]
    assert os.listdir(tmp_path) == []


def test_symlinks_and_other_files_are_left_alone(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / RUN_LOCK_NAME).write_text("")
    base = tmp_path / "tmp"
    base.mkdir()
    os.symlink(target, base / "sandbox-vm-link")
    (base / "sandbox-vm-file").write_text("")
    assert remove_stale_run_dirs(str(base)) == []
    assert (target / RUN_LOCK_NAME).exists()
