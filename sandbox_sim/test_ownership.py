"""Owners, set-id clearing and nanosecond times over the 9P wire (issue 15, classes 2, 4, 5).

Against a real temporary folder served by the intercepted provider (as root in CI): a
guest's chown is kept in ``user.sandbox.owner`` and reported, never applied; a creation
by an attach of another uid/gid shows that owner while the host file stays the server's;
a write or truncate by a non-root attach clears set-uid (and group-executable set-gid) as
Linux does, root's does not; a non-root owner sets sticky/set-gid; times keep their
nanoseconds through every setattr path; undo restores all of it exactly — mapped owners
through the xattrs, real host owners through the undo core. Then the pure owner rules.
"""

from __future__ import annotations

import errno
import os
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox.hostfs.memory import MemoryHostFS
from sandbox.mounts import Provider, identity
from sandbox.mounts.identity import Cred
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client
from sandbox.ninep.wirefs import WireFS, serve
from sandbox_sim import oracle

pytestmark = pytest.mark.timeout(60)

IS_ROOT = os.geteuid() == 0
NOBODY = 65534
T_NS = 1_234_567_890_123_456_789  # every nanosecond digit significant
T2_NS = 200_000_000_200_000_000  # pjdfstest's utimensat/08: 0.2 s past a whole second


@pytest.fixture
def work(tmp_path):
    w = tmp_path / "work"
    w.mkdir()
    os.chmod(w, 0o777)
    (w / "f").write_bytes(b"data")
    (w / "d").mkdir()
    os.chmod(w / "d", 0o777)
    os.symlink("f", w / "l")
    return w


@pytest.fixture
def c(ws):
    with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path) as client:
        WireFS(client)  # version + attach as root (uid 0)
        yield client


def nobody_root(c: Client) -> int:
    """A second attach, as Linux v9fs makes one per guest uid (``access=user``)."""
    fid, _ = c.attach(uname="nobody", n_uname=NOBODY)
    return fid


def owner(c: Client, path: str, root: int | None = None) -> tuple[int, int]:
    fid = c.walk_path(path, root)
    try:
        r = c.getattr(fid)
        return r.uid, r.gid
    finally:
        c.clunk(fid)


def mode(c: Client, path: str) -> int:
    fid = c.walk_path(path)
    try:
        return stat.S_IMODE(c.getattr(fid).mode)
    finally:
        c.clunk(fid)


def setattr(c: Client, path: str, valid: int, root: int | None = None, **kw) -> None:
    fid = c.walk_path(path, root)
    try:
        c.setattr(fid, valid, **kw)
    finally:
        c.clunk(fid)


def chown(c: Client, path: str, uid: int, gid: int) -> None:
    setattr(c, path, m.SETATTR_UID | m.SETATTR_GID, uid=uid, gid=gid)


def host_owner(p) -> tuple[int, int]:
    st_ = os.lstat(p)
    return st_.st_uid, st_.st_gid


def reserved(p) -> list[str]:
    return [n for n in os.listxattr(p, follow_symlinks=False) if n.startswith(identity.RESERVED_PREFIX)]


def undo_all(ws) -> None:
    ws.close_active()
    ws.rollback(len(ws.history()))


ME = (os.geteuid(), os.getegid())


# --------------------------------------------------------------------------- chown


def test_chown_then_stat_shows_the_new_owner_and_the_host_keeps_its_own(c, ws, work):
    before = oracle.snapshot(ws.fs.host)
    chown(c, "f", 1000, 1001)
    chown(c, "d", NOBODY, NOBODY)
    assert owner(c, "f") == (1000, 1001) and owner(c, "d") == (NOBODY, NOBODY)
    assert host_owner(work / "f") == ME and host_owner(work / "d") == ME  # nothing given away
    assert os.getxattr(work / "f", identity.OWNER_XATTR) == b"1000:1001"
    setattr(c, "f", m.SETATTR_GID, gid=7)  # one id at a time; the other stays
    assert owner(c, "f") == (1000, 7)
    chown(c, "f", *ME)  # back to what the guest sees anyway: no mapping left
    assert owner(c, "f") == ME and reserved(work / "f") == []
    undo_all(ws)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of guest chowns")


def test_the_owner_mapping_is_invisible_and_unforgeable(c, work):
    chown(c, "f", 1000, 1000)
    fid = c.walk_path("f")
    try:
        assert identity.OWNER_XATTR not in c.listxattr(fid)
    finally:
        c.clunk(fid)
    # the guest's own "user.sandbox.owner" is stored beside it, under the mapped prefix
    os.setxattr(work / "d", identity.MAPPED_PREFIX + identity.OWNER_XATTR, b"0:0")
    assert owner(c, "d") == ME


@pytest.mark.parametrize("value", [b"abc", b"1:2:3", b"-1:0", b"1:", b"4294967295:0", b"99999999999:1", b" 1:2"])
def test_a_damaged_owner_mapping_is_ignored(c, work, value):
    os.setxattr(work / "f", identity.OWNER_XATTR, value)
    assert owner(c, "f") == ME


@pytest.mark.skipif(not IS_ROOT, reason="trusted.* xattrs need CAP_SYS_ADMIN (the fallback: test_without_cap_sys_admin_...)")
def test_chown_of_a_symlink_fifo_or_socket_is_kept_in_a_trusted_xattr(c, ws, work):
    """Linux keeps user xattrs off symlinks, fifos and sockets: their owner is kept in
    ``trusted.sandbox.owner`` — per inode, so a hard link shows it too — and undone exactly."""
    os.mkfifo(work / "p")
    os.mknod(work / "s", stat.S_IFSOCK | 0o600)
    before = oracle.snapshot(ws.fs.host)
    for p in ("l", "p", "s"):
        chown(c, p, 1000, 1001)
        assert owner(c, p) == (1000, 1001) and host_owner(work / p) == ME, p  # nothing given away
        assert os.getxattr(work / p, identity.SPECIAL_OWNER_XATTR, follow_symlinks=False) == b"1000:1001"
    assert owner(c, "f") == ME and os.listxattr(work / "f") == []  # the symlink's target is untouched
    setattr(c, "p", m.SETATTR_GID, gid=7)
    assert owner(c, "p") == (1000, 7)
    dfid, pfid = c.walk_path("d"), c.walk_path("p")
    c.link(dfid, pfid, "p2")  # one inode: the same owner under every name
    c.clunk(dfid), c.clunk(pfid)
    assert owner(c, "d/p2") == (1000, 7)
    chown(c, "s", *ME)  # back to what the guest sees anyway: no mapping left
    assert owner(c, "s") == ME and os.listxattr(work / "s") == []
    undo_all(ws)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of chowns of a symlink, fifo and socket")
    assert all(os.listxattr(work / p, follow_symlinks=False) == [] for p in ("l", "p", "s"))


@pytest.mark.skipif(not IS_ROOT, reason="trusted.* xattrs need CAP_SYS_ADMIN")
def test_an_unlinked_or_renamed_chowned_fifo_gets_its_owner_back_on_undo(c, ws, work):
    os.mkfifo(work / "p")
    os.symlink("f", work / "d" / "l")
    chown(c, "p", 1000, 1000)
    chown(c, "d/l", 1001, 1001)
    ws.close_active()
    before = oracle.snapshot(ws.fs.host)
    dfid, rfid = c.walk_path("d"), c.walk_path("")
    c.unlinkat(rfid, "p", 0)
    c.renameat(dfid, "l", rfid, "l2")
    c.clunk(dfid), c.clunk(rfid)
    assert owner(c, "l2") == (1001, 1001)  # a rename keeps the inode, and so the owner
    ws.close_active()
    ws.rollback(1)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of an unlink and a rename")
    assert owner(c, "p") == (1000, 1000) and owner(c, "d/l") == (1001, 1001)


def test_the_trusted_owner_is_never_the_guests_to_read_list_set_or_remove():
    """The guest's own ``trusted.sandbox.owner`` is a name like any other privileged one:
    mapped under ``user.sandbox.x.`` (so refused where user xattrs are), never the host's."""
    host = MemoryHostFS()
    p = Provider(host, None, read_only=False)
    host.create("f", 0o644)
    host.symlink("f", "l")
    host.make_special("q", 0o644, stat.S_IFIFO)
    name = identity.SPECIAL_OWNER_XATTR
    assert identity.guest_xattr_name(name) is None and identity.host_xattr_name(name) != name
    p.setattr("q", uid=1000, gid=1000)
    p.setattr("l", uid=1000, gid=1000)
    assert host.getxattr("q", name) == b"1000:1000" and host.getxattr("l", name) == b"1000:1000"
    for path, refused in (("q", errno.EOPNOTSUPP), ("l", errno.EPERM)):
        assert p.listxattr(path) == []
        with pytest.raises(OSError) as e:
            p.getxattr(path, name)
        assert e.value.errno == errno.ENODATA
        with pytest.raises(OSError) as e:
            p.setxattr(path, name, b"0:0")
        assert e.value.errno == refused
        with pytest.raises(OSError) as e:
            p.removexattr(path, name)
        assert e.value.errno in (errno.ENODATA, errno.EPERM)
        assert (p.getattr(path).uid, p.getattr(path).gid) == (1000, 1000)
    p.setxattr("f", name, b"0:0")  # a regular file keeps the guest's under the mapped name
    assert host.getxattr("f", identity.MAPPED_PREFIX + name) == b"0:0" and name not in host.listxattr("f")
    assert p.listxattr("f") == [name]


def test_without_cap_sys_admin_a_symlink_or_fifo_owner_is_accepted_and_not_kept():
    """The fallback where the host refuses ``trusted.*`` (an unprivileged server): the chown
    succeeds and the host's owner shows; a creation by another uid works and shows it too."""
    host = MemoryHostFS(trusted_xattrs=False)
    p = Provider(host, None, read_only=False)
    host.create("f", 0o644)
    host.symlink("f", "l")
    host.make_special("q", 0o644, stat.S_IFIFO)
    mine = (host.getattr("q").uid, host.getattr("q").gid)
    for path in ("l", "q"):
        p.setattr(path, uid=1000, gid=1000)
        assert (p.getattr(path).uid, p.getattr(path).gid) == mine and host.listxattr(path) == []
    cred = Cred(NOBODY, NOBODY)
    p.symlink("f", "l2", cred=cred)
    p.mknod("q2", 0o644, stat.S_IFIFO, cred=cred)
    for path in ("l2", "q2"):
        assert (p.getattr(path).uid, p.getattr(path).gid) == mine
    p.setattr("q", mode=0o6644)  # a fifo's set-id bits: dropped, as its owner is not kept
    p.mknod("q3", 0o6644, stat.S_IFIFO, cred=cred)
    assert p.getattr("q").mode & 0o7777 == 0o644 and p.getattr("q3").mode & 0o7777 == 0o644
    p.setattr("f", uid=1000, gid=1000)  # a regular file still keeps it
    assert (p.getattr("f").uid, p.getattr("f").gid) == (1000, 1000)
    privileged = Provider(MemoryHostFS(), None, read_only=False)
    privileged.symlink("x", "l", cred=cred, gid=100)
    privileged.mknod("q", 0o644, stat.S_IFSOCK, cred=cred)
    assert (privileged.getattr("l").uid, privileged.getattr("l").gid) == (NOBODY, 100)
    assert (privileged.getattr("q").uid, privileged.getattr("q").gid) == (NOBODY, NOBODY)
    privileged.setattr("q", mode=0o6644)
    assert privileged.getattr("q").mode & 0o7777 == 0o6644 and privileged.host.getattr("q").mode & 0o7777 == 0o644


def test_chown_of_a_file_clears_setid_bits_as_the_kernel_does(c, work):
    setattr(c, "f", m.SETATTR_MODE, mode=0o6755)
    chown(c, "f", 1000, 1000)
    assert mode(c, "f") == 0o755
    setattr(c, "f", m.SETATTR_MODE, mode=0o2745)  # set-gid without group-execute stays
    chown(c, "f", 1001, 1001)
    assert mode(c, "f") == 0o2745
    setattr(c, "d", m.SETATTR_MODE, mode=0o2775)  # a directory keeps them
    chown(c, "d", 1000, 1000)
    assert mode(c, "d") == 0o2775
    # a chown that carries the mode (what the guest kernel sends) applies that mode
    setattr(c, "f", m.SETATTR_MODE, mode=0o4755)
    setattr(c, "f", m.SETATTR_UID | m.SETATTR_MODE, uid=5, mode=0o4755)
    assert mode(c, "f") == 0o4755 and owner(c, "f")[0] == 5


# --------------------------------------------------------------------------- creation by another uid


def test_creations_by_a_non_root_attach_belong_to_it_in_the_guest(c, ws, work):
    before = oracle.snapshot(ws.fs.host)
    root = nobody_root(c)
    dfid = c.walk_path("d", root)
    c.lcreate(dfid, "new", m.DOTL_WRONLY | m.DOTL_CREATE | m.DOTL_EXCL, 0o644, gid=NOBODY)
    assert (c.getattr(dfid).uid, c.getattr(dfid).gid) == (NOBODY, NOBODY)  # on the open fid of the new file
    c.clunk(dfid)
    dfid = c.walk_path("d", root)
    c.mkdir(dfid, "sub", 0o755, gid=100)
    c.symlink(dfid, "sym", "new", gid=NOBODY)
    c.clunk(dfid)
    assert owner(c, "d/new") == (NOBODY, NOBODY)
    assert owner(c, "d/sub", root) == (NOBODY, 100)  # the request's gid (e.g. a set-gid parent's)
    # a symlink keeps it in trusted.sandbox.owner — the host's owner without CAP_SYS_ADMIN
    assert owner(c, "d/sym") == ((NOBODY, NOBODY) if IS_ROOT else ME)
    for p in ("d/new", "d/sub", "d/sym"):
        assert host_owner(work / p) == ME  # the host files stay the server's
    # root's own creations need no mapping
    dfid = c.walk_path("d")
    c.mkdir(dfid, "rootdir", 0o755, gid=0)
    c.clunk(dfid)
    assert reserved(work / "d" / "rootdir") == [] or ME != (0, 0)
    # chown -R back to the default: the mappings go
    for p in ("d/new", "d/sub"):
        chown(c, p, *ME)
        assert reserved(work / p) == []
    undo_all(ws)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of creations by another uid")


def test_nobody_works_in_a_directory_it_owns_in_the_guest(c, work):
    """The conformance suite's pattern: root makes a directory, gives it to 65534, and the guest
    kernel's permission checks (which see owner and mode) let 65534 work in it."""
    dfid = c.walk_path("")
    c.mkdir(dfid, "mine", 0o755, gid=0)
    c.clunk(dfid)
    chown(c, "mine", NOBODY, NOBODY)
    root = nobody_root(c)
    assert owner(c, "mine", root) == (NOBODY, NOBODY)
    fid = c.walk_path("mine", root)
    c.lcreate(fid, "x", m.DOTL_WRONLY | m.DOTL_CREATE, 0o644, gid=NOBODY)
    c.clunk(fid)
    assert owner(c, "mine/x") == (NOBODY, NOBODY)


def test_the_guest_users_view_needs_no_mapping_for_its_own_files(ws, work):
    """With a VM's owner map (the server's ids shown as the guest user's), the guest user's
    creations are what it sees anyway: no xattr is written."""
    view = identity.OwnerMap(host_uids=frozenset({ME[0]}), host_gids=frozenset({ME[1]}), guest_uid=4242,
                             guest_gid=4243)
    from sandbox.ninep.server import ServerConfig

    with serve(Provider.intercepted(ws), ServerConfig(owners=view)) as (_st, path), Client.connect_unix(path) as c:
        root, _ = c.attach(uname="", n_uname=4242)
        dfid = c.walk_path("d", root)
        c.mkdir(dfid, "u", 0o755, gid=4243)
        c.clunk(dfid)
        assert owner(c, "d/u", root) == (4242, 4243)
        assert reserved(work / "d" / "u") == []
        chown(c, "d/u", 0, 0)  # root in the guest gives it to guest root: kept
        assert owner(c, "d/u", root) == (0, 0)
        assert os.getxattr(work / "d" / "u", identity.OWNER_XATTR) == b"0:0"


# --------------------------------------------------------------------------- set-id clearing


def _write_as(c: Client, root: int | None, path: str, data: bytes = b"x") -> None:
    fid = c.walk_path(path, root)
    try:
        c.lopen(fid, m.DOTL_WRONLY)
        c.write(fid, 0, data)
    finally:
        c.clunk(fid)


@pytest.mark.parametrize("before,after", [(0o4777, 0o777), (0o2777, 0o777), (0o6777, 0o777), (0o2767, 0o2767),
                                          (0o4767, 0o767)], ids=oct)
def test_a_write_by_a_non_root_uid_clears_setid_bits(c, work, before, after):
    setattr(c, "f", m.SETATTR_MODE, mode=before)
    _write_as(c, None, "f")  # root (CAP_FSETID): nothing cleared
    assert mode(c, "f") == before
    _write_as(c, nobody_root(c), "f")
    assert mode(c, "f") == after
    assert stat.S_IMODE(os.lstat(work / "f").st_mode) & 0o6000 == 0  # never on the host


@pytest.mark.parametrize("how", ["setattr", "lopen_trunc"])
def test_a_truncate_by_a_non_root_uid_clears_setid_bits(c, how):
    setattr(c, "f", m.SETATTR_MODE, mode=0o6777)
    setattr(c, "f", m.SETATTR_SIZE, size=1)  # root: kept
    assert mode(c, "f") == 0o6777
    root = nobody_root(c)
    if how == "setattr":
        setattr(c, "f", m.SETATTR_SIZE, root, size=0)
    else:
        fid = c.walk_path("f", root)
        c.lopen(fid, m.DOTL_WRONLY | m.DOTL_TRUNC)
        c.clunk(fid)
    assert mode(c, "f") == 0o777


def test_a_non_root_owner_sets_sticky_and_setgid(c, work):
    root = nobody_root(c)
    dfid = c.walk_path("d", root)
    c.mkdir(dfid, "shared", 0o755, gid=NOBODY)
    c.clunk(dfid)
    setattr(c, "d/shared", m.SETATTR_MODE, root, mode=0o3777)
    assert mode(c, "d/shared") == 0o3777
    assert stat.S_IMODE(os.lstat(work / "d" / "shared").st_mode) == 0o1777  # sticky grants nothing: applied
    fid = c.walk_path("d/shared", root)
    c.lcreate(fid, "g", m.DOTL_WRONLY | m.DOTL_CREATE, 0o644, gid=NOBODY)
    c.clunk(fid)
    setattr(c, "d/shared/g", m.SETATTR_MODE, root, mode=0o2755)
    assert mode(c, "d/shared/g") == 0o2755


# --------------------------------------------------------------------------- nanosecond times


def _times(c: Client, path: str) -> tuple[int, int]:
    fid = c.walk_path(path)
    try:
        r = c.getattr(fid)
        return r.atime_sec * 10**9 + r.atime_nsec, r.mtime_sec * 10**9 + r.mtime_nsec
    finally:
        c.clunk(fid)


def _set_times(c: Client, fid: int, a: int | None, mt: int | None) -> None:
    valid = 0
    if a is not None:
        valid |= m.SETATTR_ATIME | (m.SETATTR_ATIME_SET if a >= 0 else 0)
    if mt is not None:
        valid |= m.SETATTR_MTIME | (m.SETATTR_MTIME_SET if mt >= 0 else 0)
    c.setattr(fid, valid, atime=divmod(max(a or 0, 0), 10**9), mtime=divmod(max(mt or 0, 0), 10**9))


@pytest.mark.parametrize("by,path", [("path", "f"), ("path", "d"), ("path", "l"), ("open_fid", "f"),
                                     ("open_elsewhere", "f")])
def test_times_keep_their_nanoseconds_through_every_9p_setattr(c, work, by, path):
    fid = c.walk_path(path)
    other = None
    try:
        if by == "open_fid":
            c.lopen(fid, m.DOTL_RDWR)
        elif by == "open_elsewhere":  # the dentry fid, while another fid has the file open
            other = c.walk_path(path)
            c.lopen(other, m.DOTL_RDONLY)
        _set_times(c, fid, T2_NS + 100_000_000, T2_NS)
        assert _times(c, path) == (T2_NS + 100_000_000, T2_NS)
        _set_times(c, fid, None, T_NS)  # mtime alone: atime stays
        assert _times(c, path) == (T2_NS + 100_000_000, T_NS)
        _set_times(c, fid, T_NS + 1, None)  # atime alone: mtime stays
        assert _times(c, path) == (T_NS + 1, T_NS)
        host = os.lstat(work / path)
        assert (host.st_atime_ns, host.st_mtime_ns) == (T_NS + 1, T_NS)
        _set_times(c, fid, -1, -1)  # "now"
        a, mt = _times(c, path)
        assert a == mt and a > T_NS
    finally:
        c.clunk(fid)
        if other is not None:
            c.clunk(other)


def test_times_keep_their_nanoseconds_through_the_provider_and_undo(ws, work):
    """The API's path (the Provider by path and by handle; InterceptedFS utime/futime under
    it) and the undo restore."""
    p = Provider.intercepted(ws)
    before = oracle.snapshot(ws.fs.host)
    p.setattr("f", atime_ns=T_NS, mtime_ns=T2_NS)
    assert (os.lstat(work / "f").st_atime_ns, os.lstat(work / "f").st_mtime_ns) == (T_NS, T2_NS)
    with p.open("f", os.O_RDWR) as h:
        p.setattr("f", handle=h, atime_ns=T2_NS + 7, mtime_ns=T_NS + 9)
        assert (h.fstat().atime_ns, h.fstat().mtime_ns) == (T2_NS + 7, T_NS + 9)
    p.setattr("l", mtime_ns=T_NS + 3)  # a symlink's own times
    assert os.lstat(work / "l").st_mtime_ns == T_NS + 3
    ws.close_active()
    assert p.getattr("f").atime_ns == T2_NS + 7  # the core's own reads leave the guest's atime alone
    undo_all(ws)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of nanosecond times")


# --------------------------------------------------------------------------- undo of real host owners


@pytest.mark.skipif(not IS_ROOT, reason="giving host files to other uids needs root")
def test_undo_restores_the_host_owners_a_removal_lost(c, ws, work):
    os.chown(work / "f", 4242, 4343)
    os.chown(work / "d", 4444, 4545)
    (work / "d" / "inner").write_bytes(b"inner")
    os.chown(work / "d" / "inner", 31337, 31338)
    os.lchown(work / "l", 5151, 5252)
    ws.close_active()
    before = oracle.snapshot(ws.fs.host)
    for path in ("f", "l", "d/inner"):
        fid = c.walk_path(os.path.dirname(path))
        c.rpc(m.Tunlinkat(fid, os.path.basename(path), 0))
        c.clunk(fid)
    fid = c.walk_path("")
    c.rpc(m.Tunlinkat(fid, "d", m.AT_REMOVEDIR))
    c.clunk(fid)
    assert not (work / "d").exists()
    undo_all(ws)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of rm -rf of other users' files")
    assert host_owner(work / "d" / "inner") == (31337, 31338)


def test_the_oracle_sees_owners():
    fs = MemoryHostFS()
    fs.create("f", 0o644)
    before = oracle.snapshot(fs)
    fs.lchown("f", 7, 8)
    (line,) = oracle.diff(before, oracle.snapshot(fs))
    assert "uid" in line and "gid" in line


def test_undo_in_the_simulation_restores_owners():
    """MemoryHostFS keeps owners, so the core's restore runs without root: files of other
    users removed by a step come back with their owners."""
    from .world import World

    w = World("sim")
    with w.paused():
        w.work.mkdir("d", 0o755)
        w.work.create("d/f", 0o644)
        w.work.lchown("d/f", 1000, 1001)
        w.work.lchown("d", 2000, 2001)
        w.work.symlink("f", "d/l")
        w.work.lchown("d/l", 3000, 3001)
    ws = w.open()
    before = w.snapshot()
    ws.fs.remove_tree("d")
    assert not w.work.exists("d")
    undo_all(ws)
    oracle.assert_same(before, w.snapshot(), "simulated undo of removed owned files")


# --------------------------------------------------------------------------- the pure rules


ids = st.integers(0, identity.ID_MAX)


@given(ids, ids)
def test_an_owner_mapping_reads_back(uid, gid):
    assert identity.decode_owner(identity.encode_owner(uid, gid)) == (uid, gid)
    assert len(identity.encode_owner(uid, gid)) <= identity.OWNER_VALUE_BYTES_MAX


@given(st.binary(max_size=30))
def test_a_damaged_owner_value_is_never_trusted(value):
    got = identity.decode_owner(value)
    assert got is None or identity.encode_owner(*got) == value


@given(ids, ids, ids, ids)
def test_no_mapping_is_kept_for_what_the_guest_sees_anyway(uid, gid, huid, hgid):
    value = identity.owner_mapping((uid, gid), huid, hgid)
    assert (value is None) == ((uid, gid) == (huid, hgid))
    assert identity.guest_owner(huid, hgid, value) == (uid, gid)


def test_attach_credentials():
    assert identity.attach_cred("root", identity.NONUNAME) == Cred(0, 0)
    assert identity.attach_cred("nobody", identity.NONUNAME) == Cred(NOBODY, NOBODY)
    assert identity.attach_cred("", 1000) == Cred(1000, 1000)
    assert identity.attach_cred("root", 0xFFFFFFFE) == Cred(0xFFFFFFFE, 0xFFFFFFFE)
    assert identity.chowned((1, 2), -1, None) == (1, 2)
    assert identity.chowned((1, 2), identity.NONUNAME, 5) == (1, 5)
    assert identity.privileges_on_chown(0o6755) == 0o6000 and identity.privileges_on_chown(0o2745) == 0


def test_an_emulated_device_and_a_fifo_keep_their_creators_owner(c, work):
    root = nobody_root(c)
    dfid = c.walk_path("d", root)
    c.mknod(dfid, "null", stat.S_IFCHR | 0o666, 1, 3, gid=NOBODY)
    c.mknod(dfid, "pipe", stat.S_IFIFO | 0o644, gid=NOBODY)
    c.clunk(dfid)
    assert owner(c, "d/null") == (NOBODY, NOBODY)  # a regular placeholder on the host: it can keep one
    # no user xattrs on a fifo: trusted.sandbox.owner — the host's owner without CAP_SYS_ADMIN
    assert owner(c, "d/pipe") == ((NOBODY, NOBODY) if IS_ROOT else ME)
    assert host_owner(work / "d" / "null") == ME and host_owner(work / "d" / "pipe") == ME
    chown(c, "d/null", 0, 0)
    assert owner(c, "d/null") == (0, 0)
