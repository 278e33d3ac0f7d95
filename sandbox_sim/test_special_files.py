"""Special files (issue 15 class 1): fifos and unix-socket nodes made, captured and undone
exactly; emulated device nodes; nothing special is ever opened by the server.

Two layers: the undo core (``InterceptedFS.mknod``, capture and restore of a fifo/socket
node) on the simulated disk and on a real one; and the whole path a guest takes — 9P
``Tmknod``/``Tlopen``/``Tunlinkat`` through the shared :class:`~sandbox.mounts.Provider`
— against a real folder, compared with the oracle after an undo.
"""

from __future__ import annotations

import errno
import os
import stat

import pytest

from sandbox.hostfs import OTHER, REG
from sandbox.mounts import Provider, devices

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


def test_trusted_xattrs_of_symlinks_fifos_and_sockets_are_undone_exactly(world):
    """What a privileged server keeps on a symlink, fifo or socket (the guest's owner, in
    ``trusted.sandbox.owner``) is in its preimage: undoing a change of it, an unlink (the
    node remade) and a rename brings it back; undoing a step that set one removes it."""
    if world.kind == "real" and os.geteuid() != 0:
        pytest.skip("trusted.* xattrs need CAP_SYS_ADMIN")
    ws = world.open()
    with ws.step("seed"):
        ws.fs.mknod("p", 0o644, stat.S_IFIFO)
        ws.fs.mknod("s", 0o600, stat.S_IFSOCK)
        ws.fs.symlink("target", "l")
        ws.fs.symlink("target", "l2")
        for p in ("p", "s", "l"):
            ws.fs.setxattr(p, "trusted.o", b"1:1")
    before = world.snapshot()
    assert before["l"][4] == (("trusted.o", b"1:1"),)
    with ws.step("change"):
        ws.fs.setxattr("p", "trusted.o", b"2:2")
        ws.fs.removexattr("l", "trusted.o")
        ws.fs.setxattr("l2", "trusted.o", b"3:3")
        ws.fs.unlink("s")
        ws.fs.rename("p", "moved")
        ws.fs.rename("l", "p")
    ws.rollback()
    oracle.assert_same(before, world.snapshot(), "after undoing xattr changes, unlink and rename")
    with ws.step("rm"):
        for p in ("p", "s", "l"):
            ws.fs.unlink(p)
    ws.rollback()
    oracle.assert_same(before, world.snapshot(), "after undoing their removal")


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


# ---------------------------------------------------------------------------- emulated devices (pure)


@pytest.mark.parametrize("fmt,major,minor,text", [(stat.S_IFCHR, 1, 3, b"c 1 3"), (stat.S_IFBLK, 8, 0, b"b 8 0"),
                                                  (stat.S_IFCHR, 0, 0, b"c 0 0"),
                                                  (stat.S_IFBLK, 4095, 0xFFFFF, b"b 4095 1048575")])
def test_device_value_round_trips(fmt, major, minor, text):
    rdev = devices.rdev_of(major, minor)
    assert devices.encode_dev(fmt, rdev) == text
    assert devices.decode_dev(text) == (fmt, rdev)


@pytest.mark.parametrize("bad", [None, b"", b"c 1", b"c 1 3 4", b"p 1 3", b"c  1 3", b"c 01 3", b"c -1 3",
                                 b"c 1 4294967296", b"c 1 \xd9\xa3", b"c 1 3" + b" " * 40, b"C 1 3"])
def test_a_device_value_that_is_not_ours_is_ignored(bad):
    assert devices.decode_dev(bad) is None


# ---------------------------------------------------------------------------- over the 9P wire, a real folder


@pytest.fixture
def wire(tmp_path):
    """(WireFS over an intercepted real folder, the Workspace, the folder's path)."""
    from sandbox import Workspace
    from sandbox.ninep.client import Client
    from sandbox.ninep.wirefs import WireFS, serve

    work = tmp_path / "work"
    work.mkdir()
    with Workspace.open(str(work), state_dir=str(tmp_path / "state")) as ws:
        with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path) as c:
            yield WireFS(c), ws, work


def _getattr(fs, path):
    fid = fs._walk(path)
    try:
        return fs.c.getattr(fid)
    finally:
        fs.c.clunk(fid)


def _fds_on(inode: os.stat_result) -> list[int]:
    """This process's descriptors (the server runs in a thread of it) on that inode."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (st.st_ino, st.st_dev) == (inode.st_ino, inode.st_dev):
            out.append(int(name))
    return out


@pytest.mark.timeout(60)
def test_wire_mknod_makes_fifos_sockets_and_emulated_devices(wire):
    from sandbox.ninep import messages as m

    fs, _ws, work = wire
    fs.mkdir("d", 0o755)
    fs.mknod("d/p", 0o644, stat.S_IFIFO)
    fs.mknod("d/s", 0o4755, stat.S_IFSOCK)  # a set-id bit is never applied on the host ...
    fs.mknod("d/null", 0o666, stat.S_IFCHR, os.makedev(1, 3))
    fs.mknod("d/sda", 0o660, stat.S_IFBLK, os.makedev(8, 0))
    kept = 0o4755 if os.geteuid() == 0 else 0o755  # ... but kept in trusted.sandbox.mode by a root server
    want = {"p": (stat.S_IFIFO | 0o644, 0), "s": (stat.S_IFSOCK | kept, 0),
            "null": (stat.S_IFCHR | 0o666, os.makedev(1, 3)), "sda": (stat.S_IFBLK | 0o660, os.makedev(8, 0))}
    for name, (mode, rdev) in want.items():
        r = _getattr(fs, f"d/{name}")
        assert (r.mode, r.rdev, r.size) == (mode, rdev, 0), name
        assert fs.lstat(f"d/{name}").kind == OTHER
    assert stat.S_ISFIFO(os.lstat(work / "d/p").st_mode)
    assert os.lstat(work / "d/s").st_mode == stat.S_IFSOCK | 0o755
    for name, value in (("null", b"c 1 3"), ("sda", b"b 8 0")):  # the host has a placeholder, no device
        st = os.lstat(work / "d" / name)
        assert stat.S_ISREG(st.st_mode) and st.st_size == 0 and stat.S_IMODE(st.st_mode) == want[name][0] & 0o777
        assert os.getxattr(work / "d" / name, devices.DEV_XATTR) == value
        assert fs.xattrs(f"d/{name}") == {}  # the reserved xattr is invisible to the guest
    fid = fs._walk("d")
    try:
        fs.c.lopen(fid, m.DOTL_RDONLY)
        types = {e.name: e.type for e in fs.c.readdir_all(fid) if e.name not in (".", "..")}
    finally:
        fs.c.clunk(fid)
    assert types == {"p": m.DT_FIFO, "s": m.DT_SOCK, "null": m.DT_CHR, "sda": m.DT_BLK}


@pytest.mark.timeout(60)
def test_wire_special_files_are_never_opened(wire):
    """A fifo with no reader would block an open for writing (and one with no writer an
    open for reading): the server answers at once, and holds no descriptor on it."""
    from sandbox.ninep import messages as m

    fs, _ws, work = wire
    fs.mknod("p", 0o666, stat.S_IFIFO)
    fs.mknod("s", 0o666, stat.S_IFSOCK)
    fs.mknod("null", 0o666, stat.S_IFCHR, os.makedev(1, 3))
    for name in ("p", "s", "null"):
        for flags in (m.DOTL_RDONLY, m.DOTL_WRONLY, m.DOTL_RDWR | m.DOTL_TRUNC):
            fid = fs._walk(name)
            try:
                _check(errno.EPERM, fs.c.lopen, fid, flags)
            finally:
                fs.c.clunk(fid)
        _check(errno.EPERM, fs.read, name)
    fid = fs._walk("")
    try:  # creat() of an existing emulated device opens it: refused too
        _check(errno.EPERM, fs.c.lcreate, fid, "null", m.DOTL_WRONLY | m.DOTL_CREATE | m.DOTL_TRUNC, 0o644)
    finally:
        fs.c.clunk(fid)
    assert os.lstat(work / "null").st_size == 0
    assert _fds_on(os.lstat(work / "p")) == []
    # and nobody opened it for writing: a non-blocking reader sees no writer's data, no EOF from one
    fd = os.open(work / "p", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert os.read(fd, 10) == b""
    finally:
        os.close(fd)


def test_wire_mknod_errors(wire, tmp_path):
    from sandbox.ninep.client import Client
    from sandbox.ninep.wirefs import WireFS, serve

    fs, _ws, work = wire
    fs.mknod("p", 0o644, stat.S_IFIFO)
    _check(errno.EEXIST, fs.mknod, "p", 0o644, stat.S_IFSOCK)
    _check(errno.EEXIST, fs.mknod, "p", 0o644, stat.S_IFCHR, os.makedev(1, 3))
    for fmt in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, 0):
        _check(errno.EINVAL, fs.mknod, "x", 0o644, fmt)
    assert sorted(os.listdir(work)) == ["p"]
    ro = tmp_path / "ro"
    ro.mkdir()
    with serve(Provider.read_only_dir(str(ro))) as (_st, path), Client.connect_unix(path) as c:
        _check(errno.EROFS, WireFS(c).mknod, "p", 0o644, stat.S_IFIFO)
    assert os.listdir(ro) == []


@pytest.mark.timeout(60)
def test_wire_rm_rf_of_a_tree_with_special_files_then_undo_is_exact(wire):
    fs, ws, work = wire
    with ws.step("make"):
        fs.makedirs("t/sub")
        fs.write_file("t/f", b"data")
        fs.mknod("t/p", 0o640, stat.S_IFIFO)
        fs.mknod("t/sub/s", 0o700, stat.S_IFSOCK)
        fs.mknod("t/null", 0o666, stat.S_IFCHR, os.makedev(1, 3))
        fs.mknod("t/sub/sda", 0o600, stat.S_IFBLK, os.makedev(8, 0))
        fs.utime("t/p", T1)
    before = oracle.snapshot_dir(str(work))
    with ws.step("rm -rf t"):
        fs.remove_tree("t")
    assert os.listdir(work) == []
    ws.rollback()
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "after undoing rm -rf over 9P")
    r = _getattr(fs, "t/null")
    assert (r.mode, r.rdev) == (stat.S_IFCHR | 0o666, os.makedev(1, 3))  # still a device to the guest
    ws.rollback()  # and the step that made them
    assert os.listdir(work) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", [stat.S_IFIFO, stat.S_IFSOCK])
def test_wire_chmod_of_a_fifo_or_socket_with_setid_bits_keeps_them_in_a_trusted_xattr(wire, fmt):
    """A chmod with set-id bits of a fifo or socket succeeds, as on Linux; the bits are never
    applied on the host: a root server keeps them in ``trusted.sandbox.mode`` (no user xattrs
    on a fifo) and reports them, an unprivileged one drops them. The rest of the mode —
    sticky included — is applied; undo restores what was there."""
    fs, ws, work = wire
    with ws.step("make"):
        fs.mknod("n", 0o644, fmt)
    before = oracle.snapshot_dir(str(work))
    with ws.step("chmod"):
        fs.chmod("n", 0o6755)
        assert stat.S_IMODE(os.lstat(work / "n").st_mode) == 0o755
        assert stat.S_IMODE(_getattr(fs, "n").mode) == (0o6755 if os.geteuid() == 0 else 0o755)
        fs.chmod("n", 0o1600)
        assert stat.S_IMODE(_getattr(fs, "n").mode) == 0o1600
        assert os.listxattr(work / "n") == []  # nothing left to keep
        fs.chmod("n", 0o2640)
    ws.rollback(1)
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "after undoing chmods of a special node")


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="trusted.* xattrs need CAP_SYS_ADMIN")
def test_wire_mknod_of_a_fifo_with_setid_bits_keeps_them_and_a_chown_clears_them(wire):
    """As Linux's chown_common does for every non-directory: set-uid, and set-gid where
    group-executable, fall at a chown (pjdfstest chown/00.t's fifo and socket cases)."""
    fs, _ws, work = wire
    fs.mknod("n", 0o6644, stat.S_IFIFO)
    assert stat.S_IMODE(os.lstat(work / "n").st_mode) == 0o644
    assert stat.S_IMODE(_getattr(fs, "n").mode) == 0o6644
    from sandbox.ninep import messages as m

    fs.chmod("n", 0o6555)
    fid = fs._walk("n")
    try:
        fs.c.setattr(fid, m.SETATTR_UID | m.SETATTR_GID, uid=65534, gid=65533)
    finally:
        fs.c.clunk(fid)
    a = _getattr(fs, "n")
    assert (stat.S_IMODE(a.mode), a.uid, a.gid) == (0o555, 65534, 65533)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", [stat.S_IFIFO, stat.S_IFSOCK])
def test_wire_an_acl_on_a_fifo_or_socket_is_unsupported_so_cp_a_falls_back_to_chmod(wire, fmt):
    """``cp -a`` sets a POSIX ACL on the copy, and falls back to chmod only on ``EOPNOTSUPP``: a
    fifo/socket cannot keep the mapped (``user.``) xattr, so it is ``EOPNOTSUPP``, never ``EPERM``;
    nothing changes on the host. A user xattr stays ``EPERM``, as Linux answers."""
    fs, _ws, work = wire
    fs.mknod("n", 0o644, fmt)
    before = os.lstat(work / "n")
    _check(errno.EOPNOTSUPP, fs.setxattr, "n", "system.posix_acl_access", b"\x02\x00\x00\x00")
    _check(errno.EOPNOTSUPP, fs.setxattr, "n", "security.capability", b"x")
    _check(errno.EPERM, fs.setxattr, "n", "user.a", b"x")
    after = os.lstat(work / "n")
    assert (after.st_mode, after.st_mtime_ns, os.listxattr(work / "n", follow_symlinks=False)) == \
        (before.st_mode, before.st_mtime_ns, [])
    fs.chmod("n", 0o600)  # the fallback works
    assert stat.S_IMODE(os.lstat(work / "n").st_mode) == 0o600
