"""``sandbox serve-9p`` as a researcher runs it: a real process, a real socket, SIGTERM.

Writes made over 9P land in ambient steps that ``sandbox history`` lists and
``sandbox undo`` undoes once the server has stopped; while it runs, the undo store is
locked (exit 5). ``--read-only`` refuses writes. Bad usage exits 2 with a reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from sandbox.ninep.client import Client
from sandbox_sim import oracle
from sandbox.ninep.wirefs import WireFS

pytestmark = pytest.mark.timeout(120)


def sandbox_cmd(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL)


def start(*args: str, env) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "sandbox", "serve-9p", *args], stderr=subprocess.PIPE, text=True,
                         env=env, stdin=subprocess.DEVNULL)
    line = p.stderr.readline()  # blocks until the server announces itself (or dies)
    assert "serving" in line, line + p.stderr.read()
    return p


class Served:
    """A ``sandbox serve-9p`` process while :func:`served` runs: ``fs`` is a connected
    client; once stopped (SIGTERM), ``returncode`` and ``stderr``."""

    fs: WireFS
    returncode: int | None = None
    stderr: str = ""


@contextlib.contextmanager
def served(*args: str, sock: str, env):
    """Start ``serve-9p`` on ``sock``, connect one client, yield; then SIGTERM and wait."""
    run = Served()
    p = start(*args, "--socket", sock, env=env)
    try:
        with Client.connect_unix(sock) as c:
            run.fs = WireFS(c)
            yield run
    finally:
        p.send_signal(signal.SIGTERM)
        _out, run.stderr = p.communicate(timeout=60)
        run.returncode = p.returncode


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg")}


@pytest.fixture
def work(tmp_path):
    w = tmp_path / "work"
    w.mkdir()
    (w / "keep.txt").write_bytes(b"precious\n")
    (w / "src").mkdir()
    (w / "src" / "main.py").write_bytes(b"print('hi')\n")
    return w


def test_serve_write_sigterm_then_history_and_undo(tmp_path, work, env):
    before = oracle.snapshot_dir(str(work))
    sock = str(tmp_path / "9p.sock")
    with served("--root", str(work), sock=sock, env=env) as run:
        run.fs.remove_tree("src")
        run.fs.write_file("keep.txt", b"clobbered\n")
        busy = sandbox_cmd("undo", "--workdir", str(work), env=env)
        assert busy.returncode == 5 and "in use" in busy.stderr
    assert run.returncode == 0, run.stderr
    assert "server stopped" in run.stderr and not os.path.exists(sock)
    hist = sandbox_cmd("history", "--workdir", str(work), env=env)
    assert hist.returncode == 0 and "ambient" in hist.stdout, hist
    undo = sandbox_cmd("undo", "--workdir", str(work), "-n", "1", env=env)
    assert undo.returncode == 0, undo.stderr
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "undo after serve-9p")


def test_read_only_serves_and_refuses_writes(tmp_path, work, env):
    sock = str(tmp_path / "ro.sock")
    p = start("--root", str(work), "--socket", sock, "--read-only", env=env)
    try:
        with Client.connect_unix(sock) as c:
            fs = WireFS(c)
            assert fs.read_file("keep.txt") == b"precious\n"
            with pytest.raises(OSError) as e:
                fs.unlink("keep.txt")
            assert e.value.errno == 30  # EROFS
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)
    assert p.returncode == 0
    assert not os.path.exists(tmp_path / "xdg")  # no undo store for a read-only export


@pytest.mark.parametrize("args, words", [
    (["--root", "/nonexistent-dir", "--socket", "/tmp/x.sock"], "not a directory"),
    (["--root", "."], "--socket"),
    (["--root", ".", "--tcp", "nope"], "[HOST:]PORT"),
])
def test_bad_usage_exits_2(args, words, env, tmp_path):
    r = sandbox_cmd("serve-9p", *args, env=env)
    assert r.returncode == 2 and words in r.stderr, r


def test_a_regular_file_at_the_socket_path_is_not_replaced(tmp_path, work, env):
    victim = tmp_path / "not-a-socket"
    victim.write_bytes(b"data")
    r = sandbox_cmd("serve-9p", "--root", str(work), "--socket", str(victim), env=env)
    assert r.returncode == 1 and "not a socket" in r.stderr, r
    assert victim.read_bytes() == b"data"


def test_help_explains(env):
    r = sandbox_cmd("serve-9p", "--help", env=env)
    assert r.returncode == 0
    for words in ("9P2000.L", "--read-only", "sandbox history", "mount -t 9p", "SIGTERM"):
        assert words in r.stdout


@pytest.mark.parametrize("where", ["inside", "outside", "dangling"])
def test_a_directory_replaced_by_a_symlink_is_recorded_and_undone(tmp_path, work, env, where):
    """`rm -rf src && ln -s TARGET src` over the wire: the server stops cleanly (it exited 1
    on ELOOP when closing the step), history lists the step with no recovery at the next
    open, and undo restores the tree exactly."""
    outside = tmp_path / "outside"
    (outside / "main.py").mkdir(parents=True)
    (work / "other").mkdir()
    target = {"inside": "other", "outside": str(outside), "dangling": "nowhere/at/all"}[where]
    before = oracle.snapshot_dir(str(work))
    sock = str(tmp_path / "9p.sock")
    with served("--root", str(work), sock=sock, env=env) as run:
        run.fs.remove_tree("src")
        run.fs.symlink(target, "src")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert os.readlink(work / "src") == target
    hist = sandbox_cmd("history", "--workdir", str(work), "--json", env=env)
    assert hist.returncode == 0 and "recovered" not in hist.stderr, hist
    assert os.readlink(work / "src") == target  # no recovery rolled the work back
    undo = sandbox_cmd("undo", "--workdir", str(work), env=env)
    assert undo.returncode == 0, undo.stderr
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "undo after serve-9p")


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs for the undo store, and a way to fill it up and free it again."""
    import errno as _errno

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")

    class Disk:
        path = mnt
        filler = mnt / "filler"

        def fill(self) -> None:
            fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                while True:
                    os.write(fd, b"\0" * 4096)
            except OSError as e:
                assert e.errno == _errno.ENOSPC, e
            finally:
                os.close(fd)

        def free(self) -> None:
            os.unlink(self.filler)

    try:
        yield Disk()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_store_at_promotion_is_reported_and_history_needs_no_space(tmp_path, work, env, tiny_disk):
    """Issue 11, item 10: the store's disk fills exactly when the step is to be recorded.
    Stopping says so (no traceback); `history` works on the full disk and says recovery is
    waiting; once there is room, the next open rolls the step back and tells the user."""
    before = oracle.snapshot_dir(str(work))
    state = str(tiny_disk.path / "state")
    sock = str(tmp_path / "9p.sock")
    with served("--root", str(work), "--state-dir", state, sock=sock, env=env) as run:
        run.fs.write_file("agent.txt", b"the agent's work\n")
        tiny_disk.fill()
    err = run.stderr
    assert "Traceback" not in err, err
    assert run.returncode == 1 and "could not be recorded" in err and "rolled back when the folder is next opened" in err, err
    assert (work / "agent.txt").exists()
    history = ("history", "--workdir", str(work), "--state-dir", state)
    hist = sandbox_cmd(*history, env=env)  # the disk is still full
    assert hist.returncode == 0 and hist.stdout.strip() == "no steps in history", hist
    assert "could not finish" in hist.stderr and "No space left on device" in hist.stderr, hist.stderr
    tiny_disk.free()
    hist = sandbox_cmd(*history, env=env)
    assert hist.returncode == 0, hist.stderr
    assert "never finished and was rolled back" in hist.stderr, hist.stderr
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "recovery")
    # a store with history, read on a full disk
    with served("--root", str(work), "--state-dir", state, sock=sock, env=env) as run:
        run.fs.write_file("kept.txt", b"kept\n")
    assert run.returncode == 0, run.stderr
    tiny_disk.fill()
    hist = sandbox_cmd(*history, "--json", env=env)
    assert hist.returncode == 0 and hist.stderr == "", hist
    assert "kept.txt" in hist.stdout
