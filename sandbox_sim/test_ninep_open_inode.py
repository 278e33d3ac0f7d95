"""An open fid is bound to the inode it opened — for its metadata too (issue 11, item 8).

A guest opens ``x``, the file is unlinked (or renamed away) and a new ``x`` is made;
``ftruncate``/``fchmod``/``futimens``/``fsetxattr`` through the still-open descriptor
must change the old file, never the new one — as on a local disk. Over the wire that is
a ``Tsetattr`` or an xattr set (clone, ``Txattrcreate``, ``Tclunk``) through the old fid,
or through a walked, unopened fid of the same file (the guest's dentry fid). Undo of the
step must still restore the tree exactly: the path is captured only while it names the
inode the change reaches.
"""

from __future__ import annotations

import errno
import os
import stat

import pytest

from sandbox.mounts import Provider
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client
from sandbox_sim import oracle
from sandbox.ninep.wirefs import serve

pytestmark = pytest.mark.timeout(60)

OLD = b"old contents"
NEW = b"the new file at the old name"


@pytest.fixture
def work(tmp_path):
    w = tmp_path / "work"
    w.mkdir()
    (w / "x").write_bytes(OLD)
    os.chmod(w / "x", 0o644)
    os.setxattr(w / "x", "user.keep", b"old")
    (w / "other").write_bytes(b"bystander")
    return w


@pytest.fixture
def served(ws):
    with serve(Provider.intercepted(ws)) as (st, path):
        yield path


def host_state(path) -> tuple:
    """Everything about one host file: bytes, mode, mtime, ctime, inode, xattrs."""
    st = os.lstat(path)
    xattrs = {n: os.getxattr(path, n) for n in sorted(os.listxattr(path))}
    return (path.read_bytes(), stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_ctime_ns, st.st_ino, xattrs)


def replace_x(c: Client, how: str) -> None:
    """Unlink (or rename away) ``x`` and make a new ``x`` — what the other side does."""
    if how == "unlink":
        c.unlinkat(c.root_fid, "x")
    else:
        c.renameat(c.root_fid, "x", c.root_fid, "y")
    nf = c.walk_path("")
    c.lcreate(nf, "x", m.DOTL_WRONLY | m.DOTL_CREATE | m.DOTL_EXCL, 0o640)
    c.write_all(nf, 0, NEW)
    c.setxattr(nf, "user.new", b"new")
    c.clunk(nf)


def change_everything(c: Client, fid: int, truncate: bool = True) -> None:
    """ftruncate, fchmod, futimens, fsetxattr, fremovexattr — through ``fid``."""
    if truncate:
        c.setattr(fid, m.SETATTR_SIZE, size=3)
    c.setattr(fid, m.SETATTR_MODE, mode=0o600)
    c.setattr(fid, m.SETATTR_MTIME | m.SETATTR_MTIME_SET | m.SETATTR_ATIME | m.SETATTR_ATIME_SET,
              mtime=(1000, 5), atime=(900, 0))
    c.setxattr(fid, "user.k", b"v")
    c.removexattr(fid, "user.keep")


def assert_old_inode_changed(c: Client, fid: int, size: int = 3) -> None:
    a = c.getattr(fid)  # an open fid's getattr is its inode's
    assert (a.size, a.mode & 0o7777, a.mtime_sec, a.mtime_nsec) == (size, 0o600, 1000, 5)
    assert sorted(c.listxattr(fid)) == ["user.k"] and c.getxattr(fid, "user.k") == b"v"


@pytest.mark.parametrize("how", ["unlink", "rename"])
@pytest.mark.parametrize("conns", ["one", "two"])
def test_metadata_through_an_open_fid_reaches_its_inode_not_the_new_file(ws, work, served, how, conns):
    before = oracle.snapshot(ws.fs.host)
    with Client.connect_unix(served) as a, Client.connect_unix(served) as b:
        a.attach()
        b.attach()
        other = a if conns == "one" else b
        with ws.step(f"{how} x; new x; chmod etc. through the old fd"):
            fid = a.walk_path("x")
            a.lopen(fid, m.DOTL_RDWR)
            old_ino = a.getattr(fid).qid.path
            replace_x(other, how)
            new_x = host_state(work / "x")
            assert new_x[4] != old_ino
            change_everything(a, fid)
            assert host_state(work / "x") == new_x  # byte for byte, mode, mtime, ctime, xattrs
            assert_old_inode_changed(a, fid)
            assert a.read(fid, 0, 100) == OLD[:3]
            if how == "rename":  # the tree still reaches the old inode, at y
                y = host_state(work / "y")
                assert (y[0], y[1], y[2], y[4], y[5]) == (OLD[:3], 0o600, 1000 * 10**9 + 5, old_ino, {"user.k": b"v"})
            a.clunk(fid)
        assert host_state(work / "x") == new_x
    ws.rollback(1)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), f"undo of {how} + new x + metadata through the old fid")


def test_write_through_an_open_fid_after_replace_reaches_its_inode_and_undoes_exactly(ws, work, served):
    before = oracle.snapshot(ws.fs.host)
    with Client.connect_unix(served) as c:
        c.attach()
        with ws.step("write through the old fd"):
            fid = c.walk_path("x")
            c.lopen(fid, m.DOTL_RDWR)
            replace_x(c, "unlink")
            new_x = host_state(work / "x")
            c.write_all(fid, 0, b"OLD")
            assert host_state(work / "x") == new_x
            assert c.read(fid, 0, 100) == b"OLD" + OLD[3:]
            c.clunk(fid)
    ws.rollback(1)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of a write through a replaced file's fid")


def test_walked_fid_of_an_open_file_changes_that_file_then_is_stale(ws, work, served):
    """A fid walked to x but not opened (the guest's dentry fid) follows the inode too —
    through an open fid's handle on it; once nothing holds that inode open: ESTALE."""
    with Client.connect_unix(served) as c:
        c.attach()
        dentry = c.walk_path("x")
        opened = c.walk_path("x")
        c.lopen(opened, m.DOTL_RDONLY)
        replace_x(c, "unlink")
        new_x = host_state(work / "x")
        change_everything(c, dentry, truncate=False)  # (a guest's ftruncate comes on its open fid)
        assert host_state(work / "x") == new_x
        assert_old_inode_changed(c, opened, size=len(OLD))
        assert_old_inode_changed(c, dentry, size=len(OLD))  # getattr and xattrs of the dentry fid: the same file
        with pytest.raises(OSError) as info:  # only ftruncate could reach it now: not on a read-only fd
            c.setattr(dentry, m.SETATTR_SIZE, size=1)
        assert info.value.errno == errno.EINVAL
        c.clunk(opened)
        for call in (lambda: c.setattr(dentry, m.SETATTR_MODE, mode=0o777),
                     lambda: c.setattr(dentry, m.SETATTR_UID, uid=0),  # a chown is kept now: never on the new file
                     lambda: c.setxattr(dentry, "user.z", b"z"),
                     lambda: c.removexattr(dentry, "user.new")):
            with pytest.raises(OSError) as info:
                call()
            assert info.value.errno == errno.ESTALE
        assert host_state(work / "x") == new_x
        fresh = c.walk_path("x")  # a fresh walk names the new file
        c.setattr(fresh, m.SETATTR_MODE, mode=0o604)
        assert stat.S_IMODE(os.lstat(work / "x").st_mode) == 0o604


def test_walked_fid_of_a_removed_file_is_enoent(ws, work, served):
    with Client.connect_unix(served) as c:
        c.attach()
        fid = c.walk_path("x")
        c.unlinkat(c.root_fid, "x")
        with pytest.raises(FileNotFoundError):
            c.setattr(fid, m.SETATTR_MODE, mode=0o600)


def test_truncate_through_a_read_only_fid_of_a_file_still_there_is_a_truncate(ws, work, served):
    """truncate(path) in a guest may reach us on a read-only open fid: still allowed."""
    with Client.connect_unix(served) as c:
        c.attach()
        fid = c.walk_path("x")
        c.lopen(fid, m.DOTL_RDONLY)
        c.setattr(fid, m.SETATTR_SIZE, size=2)
        assert (work / "x").read_bytes() == OLD[:2]
        replace_x(c, "unlink")
        with pytest.raises(OSError) as info:  # now only ftruncate could reach it: not on a read-only fd
            c.setattr(fid, m.SETATTR_SIZE, size=1)
        assert info.value.errno == errno.EINVAL
        assert (work / "x").read_bytes() == NEW


# --------------------------------------------------------------------------- the cause, in the core


def test_hooks_capture_the_path_only_while_it_names_the_handles_inode(ws, work):
    """InterceptedFS's handle calls: no preimage of a file the change does not reach."""
    fs = ws.fs
    h = fs.open("x", os.O_RDWR)
    fs.unlink("x")
    fs.write_file("x", NEW)  # the new file is older than the next step and untouched by it
    ws.close_active()
    before = oracle.snapshot(fs.host)
    with ws.step("through the old handle") as step:
        fs.fchmod(h, "x", 0o600)
        fs.fsetxattr(h, "x", "user.a", b"1")
        fs.fremovexattr(h, "x", "user.keep")
        fs.ftruncate(h, "x", 1)
        fs.pwrite(h, "x", 0, b"Z")
        fs.futime(h, "x", 10**9)
        assert [r for r in ws.records(step.id) if r.get("path") == "x"] == []
        g = fs.open("other", os.O_RDONLY)
        fs.fchmod(g, "other", 0o600)  # the path names the handle's file: captured first
        assert [r["op"] for r in ws.records(step.id) if r.get("path") == "other"] == ["meta"]
    assert (work / "x").read_bytes() == NEW and h.pread(10, 0) == b"Z"
    a = h.fstat()
    assert (a.mode, a.mtime_ns, h.xattrs()) == (0o600, 10**9, {"user.a": b"1"})
    ws.rollback(1)
    oracle.assert_same(before, oracle.snapshot(fs.host), "undo of handle calls")
    h.close()
    g.close()
