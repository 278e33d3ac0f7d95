"""Special files (issue 15 class 1): fifos and unix-socket nodes made, captured and undone
exactly; emulated device nodes; nothing special is ever opened by the server.

Two layers: the undo core (``InterceptedFS.mknod``, capture and restore of a fifo/socket
node) on the simulated disk and on a real one; and the whole path a guest takes — 9P
``Tmknod``/``Tlopen``/``Tunlinkat`` through the shared :class:`~sandbox.mounts.Provider`
— against a real folder, compared with the oracle after an undo.
"""

from __future__ import annotations

import errno
import stat

import pytest

from sandbox.hostfs import OTHER, REG
from sandbox.mounts import devices

from . import oracle
from .world import World

T1 = 1_234_567_890_123_456_789


@pytest.fixture(params=["sim", "real"])
def world(request, tmp_path):
    w = World(request.param, None if request.param == "sim" else str(tmp_path))
    yield w


def _check(code: int, fn, *args) -> None:
    with pytest.raises(OSError) as e:
        fn(*args)
    assert e.value.errno == code, e.value


def _tree_with_specials(ws) -> None:
    """``t/`` with a file, a fifo, a socket node, a sub-directory with a fifo, and an
    emulated device (a regular file with its xattr)."""
    with ws.step("seed"):
        ws.fs.makedirs("t/sub")
        ws.fs.write_file("t/f", b"data")
        ws.fs.mknod("t/p", 0o640, stat.S_IFIFO)
        ws.fs.mknod("t/s", 0o755, stat.S_IFSOCK)
        ws.fs.mknod("t/sub/q", 0o1600, stat.S_IFIFO)
        ws.fs.utime("t/p", T1)
        ws.fs.create("t/null", 0o666)
        ws.fs.setxattr("t/null", devices.DEV_XATTR, b"c 1 3")


# ---------------------------------------------------------------------------- the undo core


def test_mknod_in_a_step_is_undone_by_removing_it(world):
    ws = world.open()
    ws.fs.mkdir("d")
    before = world.snapshot()
    with ws.step("mkfifo"):
        ws.fs.mknod("d/p", 0o644, stat.S_IFIFO)
        ws.fs.mknod("d/s", 0o600, stat.S_IFSOCK)
    st = world.work.lstat("d/p")
    assert (st.kind, st.fmt, st.mode) == (OTHER, stat.S_IFIFO, 0o644)
    assert {"op": "created", "path": "d/p"} in ws.records()
    ws.rollback()
    oracle.assert_same(before, world.snapshot(), "after undoing mkfifo")


def test_mknod_never_makes_a_device_and_records_nothing(world):
    ws = world.open()
    before = world.snapshot()
    with ws.step("mknod"):
        for fmt in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFREG):
            _check(errno.EPERM, ws.fs.mknod, "n", 0o644, fmt)
    assert world.snapshot() == before
    ws.rollback()  # the voided intents undo nothing
    assert world.snapshot() == before


@pytest.mark.timeout(30)
def test_rm_rf_of_a_tree_with_specials_is_undone_exactly(world):
    ws = world.open()
    _tree_with_specials(ws)
    before = world.snapshot()
    assert before["t/p"][5] == stat.S_IFIFO and before["t/s"][5] == stat.S_IFSOCK
    with ws.step("rm -rf t"):
        ws.fs.remove_tree("t")
    assert not world.work.exists("t")
    pre = [r for r in ws.records() if r["op"] == "pre" and r["kind"] == OTHER]
    assert {(r["path"], r["fmt"], r["mode"]) for r in pre} == {
        ("t/p", stat.S_IFIFO, 0o640), ("t/s", stat.S_IFSOCK, 0o755), ("t/sub/q", stat.S_IFIFO, 0o1600)}
    assert next(r for r in pre if r["path"] == "t/p")["mtime_ns"] == T1
    ws.rollback()
    oracle.assert_same(before, world.snapshot(), "after undoing rm -rf")


def test_rename_over_and_metadata_of_a_fifo_are_undone(world):
    ws = world.open()
    with ws.step("seed"):
        ws.fs.mknod("p", 0o644, stat.S_IFIFO)
        ws.fs.mknod("s", 0o600, stat.S_IFSOCK)
        ws.fs.write_file("f", b"x")
    before = world.snapshot()
    with ws.step("change"):
        ws.fs.chmod("p", 0o600)
        ws.fs.utime("p", T1)
        ws.fs.rename("f", "s")  # a file over a socket node
        ws.fs.rename("p", "moved")
        ws.fs.mknod("p", 0o777, stat.S_IFSOCK)  # a socket where the fifo was
    assert world.work.lstat("p").fmt == stat.S_IFSOCK
    ws.rollback()
    oracle.assert_same(before, world.snapshot(), "after undoing changes of special nodes")


def test_a_fifo_undone_into_the_wrong_type_is_seen_by_the_oracle(world):
    ws = world.open()
    with ws.step("seed"):
        ws.fs.mknod("p", 0o644, stat.S_IFIFO)
    before = world.snapshot()
    with world.paused():  # what a broken undo would leave: same kind, mode, mtime — another type
        world.work.unlink("p")
        world.work.mknod("p", 0o644, stat.S_IFSOCK)
        world.work.utime("p", before["p"][2])
    lines = oracle.diff(before, world.snapshot())
    assert [line for line in lines if line.startswith("~ p:")] == [f"~ p: fmt {stat.S_IFIFO} != {stat.S_IFSOCK}"]


def test_a_device_node_on_the_host_is_still_never_changed():
    w = World("sim")
    with w.paused():
        w.work.mkdir("d", 0o755)
        w.work.make_special("d/null", 0o666, stat.S_IFCHR)
    ws = w.open()
    _check(errno.EPERM, ws.fs.unlink, "d/null")
    _check(errno.EPERM, ws.fs.remove_tree, "d")
    assert w.work.lstat("d/null").fmt == stat.S_IFCHR


def test_emulated_device_is_captured_and_restored_as_a_regular_file(world):
    ws = world.open()
    _tree_with_specials(ws)
    before = world.snapshot()
    assert before["t/null"][0] == REG and dict(before["t/null"][4]) == {devices.DEV_XATTR: b"c 1 3"}
    with ws.step("rm"):
        ws.fs.unlink("t/null")
    ws.rollback()
    oracle.assert_same(before, world.snapshot(), "after undoing rm of an emulated device")


def test_step_diff_names_special_files(world):
    ws = world.open()
    ws.fs.mkdir("d")
    with ws.step("mk"):
        ws.fs.mknod("d/p", 0o644, stat.S_IFIFO)
        ws.fs.mknod("d/s", 0o600, stat.S_IFSOCK)
    paths = {e["path"]: e for e in ws.step_diff()["paths"]}
    assert (paths["d/p"]["change"], paths["d/p"]["kind"], paths["d/p"]["summary"]) == ("created", "other", "fifo, mode 0644")
    assert paths["d/s"]["summary"] == "socket, mode 0600"
    with ws.step("rm"):
        ws.fs.unlink("d/p")
    (only,) = ws.step_diff()["paths"]
    assert (only["path"], only["change"], only["summary"]) == ("d/p", "deleted", "fifo, mode 0644")
