"""The FUSE dispatcher driven with codec messages against a real folder (no kernel).

Requests are :mod:`sandbox.fuse.messages` values as the decoder makes them (a few go
through ``decode_request`` from bytes the reference way is built in the codec's tests);
every reply is encoded with ``encode_reply`` so it is one the kernel can be sent. The
folder is a real directory under an intercepted :class:`Workspace`, so every change is
also checked on the host and through the undo core.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import stat

import pytest

from sandbox.core.safeguard import SafeguardConfig
from sandbox.core.workspace import Workspace
from sandbox.fuse import abi
from sandbox.fuse import messages as m
from sandbox.fuse.codec import encode_error, encode_notify, encode_reply
from sandbox.fuse import dispatcher as dispatcher_module
from sandbox.fuse.dispatcher import (ATTR_VALID_S, COHERENT_ATTR_VALID_S, COHERENT_ENTRY_VALID_S, ENTRY_VALID_S,
                                     NEGATIVE_ENTRIES_MAX, WANTED_INIT_FLAGS, Dispatcher, errno_of)
from sandbox.limits import DIR_ENTRY_OVERHEAD_BYTES, DescriptorBudget, ServerLimits, listing_cost
from sandbox.mounts import Provider, memory_tree
from sandbox.serving import Export, HoldBroker
from sandbox_sim.oracle import assert_same, snapshot_dir
from sandbox_sim.test_fuse_codec import ref_parse_dirents

pytestmark = pytest.mark.timeout(60)
ROOT = abi.FUSE_ROOT_ID
UID, GID = os.getuid(), os.getgid()
_unique = itertools.count(2)


def H(op: abi.Opcode, nodeid: int = ROOT, uid: int = UID, gid: int = GID) -> m.InHeader:
    return m.InHeader(0, int(op), next(_unique), nodeid, uid, gid, 4242)


def replies():
    """``(sent, settled, send)``: ``send`` is a dispatcher's reply callback recording each
    ``(reply, error)`` in ``sent`` by unique and setting the event ``settled``."""
    sent: dict[int, tuple] = {}
    settled = asyncio.Event()

    def send(unique, reply, error):
        sent[unique] = (reply, error)
        settled.set()
    return sent, settled, send


class Mount:
    """A dispatcher on ``tmp_path/work``, initialised; ``call`` returns the reply (encoded
    once, to prove it encodes) or raises the handler's OSError."""

    def __init__(self, tmp_path, limits: ServerLimits = ServerLimits(), safeguard: SafeguardConfig | None = None,
                 descriptors: DescriptorBudget | None = None, no_open: bool = False):
        self.work = str(tmp_path / "work")
        os.makedirs(self.work, exist_ok=True)
        kw = {"safeguard": safeguard} if safeguard is not None else {}
        self.ws = Workspace.open(self.work, state_dir=str(tmp_path / "state"), **kw)
        self.provider = Provider.intercepted(self.ws)
        self.holds = HoldBroker()
        self.export = Export(self.provider, self.holds, limits)
        self.d = Dispatcher(self.export, limits, **({"descriptors": descriptors} if descriptors else {}))
        if no_open:  # what a /dev/fuse server with the watcher running is at INIT
            self.d.no_open_allowed = self.d.coherent = True
        out = self.call(m.Init(H(abi.Opcode.INIT), 7, 38, 1 << 17,
                               0xFFFFFFFF & ~abi.FUSE_INIT_RESERVED, 0xFFFFFFFF))
        self.init = out

    def call(self, req):
        reply = self.d.handle(req)
        if req.OPCODE not in m.NO_REPLY:
            encode_reply(req.header.unique, reply)
        return reply

    def err(self, req) -> int:
        with pytest.raises(OSError) as e:
            self.call(req)
        encode_error(req.header.unique, errno_of(e.value))
        return e.value.errno

    def lookup(self, name: str, parent: int = ROOT) -> m.EntryOut:
        return self.call(m.Lookup(H(abi.Opcode.LOOKUP, parent), name.encode()))

    def create(self, name: str, mode: int = 0o644, parent: int = ROOT, flags: int = os.O_RDWR) -> m.CreateOut:
        return self.call(m.Create(H(abi.Opcode.CREATE, parent), flags | os.O_CREAT, mode, 0o022, 0, name.encode()))

    def write(self, node: int, fh: int, data: bytes, offset: int = 0) -> int:
        return self.call(m.Write(H(abi.Opcode.WRITE, node), fh, offset, len(data), 0, 0, os.O_RDWR, data)).size

    def read(self, node: int, fh: int, size: int, offset: int = 0) -> bytes:
        return bytes(self.call(m.Read(H(abi.Opcode.READ, node), fh, offset, size, 0, 0, 0)).data)

    def release(self, node: int, fh: int) -> None:
        self.call(m.Release(H(abi.Opcode.RELEASE, node), fh, 0, 0, 0))

    def getattr(self, node: int) -> m.FuseAttr:
        return self.call(m.Getattr(H(abi.Opcode.GETATTR, node), 0, 0)).attr

    def forget(self, node: int, n: int) -> None:
        self.call(m.Forget(H(abi.Opcode.FORGET, node), n))

    def host(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    def close(self) -> None:
        self.d.close()
        self.ws.close()


@pytest.fixture
def mnt(tmp_path):
    mo = Mount(tmp_path)
    yield mo
    mo.close()


def test_init_grants_what_we_want_and_nothing_else(mnt):
    out = mnt.init
    granted = out.flags | (out.flags2 << 32)
    assert granted & ~(WANTED_INIT_FLAGS | abi.FUSE_INIT_EXT) == 0
    assert not granted & (abi.FUSE_WRITEBACK_CACHE | abi.FUSE_POSIX_LOCKS | abi.FUSE_DONT_MASK | abi.FUSE_POSIX_ACL)
    assert granted & abi.FUSE_ATOMIC_O_TRUNC and granted & abi.FUSE_DO_READDIRPLUS
    assert (out.major, out.max_write, out.time_gran) == (7, abi.MAX_WRITE_BYTES, 1)
    assert out.max_pages * abi.PAGE_SIZE >= abi.MAX_WRITE_BYTES


def test_requests_before_init_and_old_kernels_are_refused(tmp_path):
    ws = Workspace.open(str(tmp_path), state_dir=str(tmp_path.parent / (tmp_path.name + "-state")))
    try:
        d = Dispatcher(Export(Provider.intercepted(ws), HoldBroker()))
        with pytest.raises(OSError) as e:
            d.handle(m.Getattr(H(abi.Opcode.GETATTR), 0, 0))
        assert e.value.errno == errno.EIO
        with pytest.raises(OSError) as e:
            d.handle(m.Init(H(abi.Opcode.INIT), 7, 30, 0, 0, 0))
        assert e.value.errno == errno.EPROTO
        d.close()
    finally:
        ws.close()


def test_create_write_read_release_round_trip(mnt):
    c = mnt.create("a.txt", 0o640)
    node, fh = c.entry.nodeid, c.open.fh
    assert mnt.write(node, fh, b"hello world") == 11
    assert mnt.read(node, fh, 5, 6) == b"world"
    mnt.release(node, fh)
    with open(mnt.host("a.txt"), "rb") as f:
        assert f.read() == b"hello world"
    a = mnt.getattr(node)
    assert (stat.S_IFMT(a.mode), a.mode & 0o7777, a.size) == (stat.S_IFREG, 0o640, 11)
    assert mnt.err(m.Read(H(abi.Opcode.READ, node), fh, 0, 1, 0, 0, 0)) == errno.EBADF  # released


def test_lookup_counts_and_forget(mnt):
    with open(mnt.host("f"), "w") as f:
        f.write("x")
    a, b = mnt.lookup("f"), mnt.lookup("f")
    assert a.nodeid == b.nodeid != ROOT and a.generation == b.generation
    mnt.forget(a.nodeid, 1)
    assert mnt.getattr(a.nodeid).size == 1  # one lookup left
    mnt.forget(a.nodeid, 1)
    assert mnt.err(m.Getattr(H(abi.Opcode.GETATTR, a.nodeid), 0, 0)) == errno.ENOENT
    c = mnt.lookup("f")
    assert c.nodeid > a.nodeid  # node ids are never reused
    mnt.call(m.BatchForget(H(abi.Opcode.BATCH_FORGET, 0), ((c.nodeid, 1), (ROOT, 5), (999999, 1))))
    assert c.nodeid not in mnt.d.nodes and ROOT in mnt.d.nodes
    assert mnt.err(m.Lookup(H(abi.Opcode.LOOKUP), b"missing")) == errno.ENOENT
    assert mnt.err(m.Lookup(H(abi.Opcode.LOOKUP), b"a/b")) == errno.EINVAL


def test_a_hard_link_keeps_its_node_when_the_first_name_goes(mnt):
    """git's object files: written to a temporary name, linked to the final one, unlinked."""
    c = mnt.create("tmp_obj")
    mnt.write(c.entry.nodeid, c.open.fh, b"blob")
    mnt.release(c.entry.nodeid, c.open.fh)
    e = mnt.call(m.Link(H(abi.Opcode.LINK), c.entry.nodeid, b"final"))
    assert e.nodeid == c.entry.nodeid and e.attr.nlink == 2
    mnt.call(m.Unlink(H(abi.Opcode.UNLINK), b"tmp_obj"))
    a = mnt.getattr(e.nodeid)
    assert (a.size, a.nlink) == (4, 1)
    o = mnt.call(m.Open(H(abi.Opcode.OPEN, e.nodeid), os.O_RDONLY, 0))
    assert mnt.read(e.nodeid, o.fh, 10) == b"blob"


def test_rename_moves_nodes_below_it(mnt):
    d = mnt.call(m.Mkdir(H(abi.Opcode.MKDIR), 0o755, 0o022, b"dir"))
    c = mnt.create("f", parent=d.nodeid)
    mnt.release(c.entry.nodeid, c.open.fh)
    mnt.call(m.Rename(H(abi.Opcode.RENAME), ROOT, b"dir", b"moved"))
    assert os.path.exists(mnt.host("moved", "f"))
    assert mnt.getattr(c.entry.nodeid).size == 0
    o = mnt.call(m.Open(H(abi.Opcode.OPEN, c.entry.nodeid), os.O_WRONLY, 0))
    mnt.write(c.entry.nodeid, o.fh, b"z")
    with open(mnt.host("moved", "f")) as f:
        assert f.read() == "z"
    with open(mnt.host("other"), "w"):
        pass
    assert mnt.err(m.Rename2(H(abi.Opcode.RENAME2), ROOT, abi.RENAME_NOREPLACE, b"moved", b"other")) == errno.EEXIST
    assert mnt.err(m.Rename2(H(abi.Opcode.RENAME2), ROOT, abi.RENAME_WHITEOUT, b"moved", b"other")) == errno.EINVAL


def test_a_node_replaced_on_the_host_is_stale(mnt):
    c = mnt.create("f")
    mnt.release(c.entry.nodeid, c.open.fh)
    os.rename(mnt.host("f"), mnt.host("kept"))  # behind the mount's back; the old inode lives on
    with open(mnt.host("f"), "w") as f:
        f.write("new")
    assert mnt.err(m.Getattr(H(abi.Opcode.GETATTR, c.entry.nodeid), 0, 0)) == errno.ESTALE
    assert mnt.err(m.Setattr(H(abi.Opcode.SETATTR, c.entry.nodeid), abi.FATTR_MODE, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                             0o600, 0, 0)) == errno.ESTALE
    assert mnt.err(m.Open(H(abi.Opcode.OPEN, c.entry.nodeid), os.O_WRONLY | os.O_TRUNC, 0)) == errno.ESTALE
    assert mnt.err(m.Link(H(abi.Opcode.LINK), c.entry.nodeid, b"again")) == errno.ESTALE
    with open(mnt.host("f")) as f:
        assert f.read() == "new"  # not truncated through the stale node
    assert mnt.lookup("f").nodeid != c.entry.nodeid  # the new file is a new node


def test_setattr_mode_size_times_and_owner(mnt):
    c = mnt.create("f", 0o644)
    node = c.entry.nodeid
    mnt.write(node, c.open.fh, b"0123456789")
    valid = abi.FATTR_MODE | abi.FATTR_SIZE | abi.FATTR_MTIME | abi.FATTR_ATIME
    out = mnt.call(m.Setattr(H(abi.Opcode.SETATTR, node), valid | abi.FATTR_FH, c.open.fh, 4, 0, 10, 20, 0, 5, 7, 0,
                             0o600, 0, 0))
    assert (out.attr.size, out.attr.mode & 0o7777, out.attr.mtime, out.attr.mtimensec) == (4, 0o600, 20, 7)
    st = os.stat(mnt.host("f"))
    assert (st.st_size, st.st_mode & 0o777, st.st_mtime_ns, st.st_atime_ns) == (4, 0o600, 20 * 10**9 + 7, 10 * 10**9 + 5)
    out = mnt.call(m.Setattr(H(abi.Opcode.SETATTR, node, uid=0, gid=0), abi.FATTR_UID | abi.FATTR_GID, 0, 0, 0, 0, 0,
                             0, 0, 0, 0, 0, 4321, 8765))
    assert (out.attr.uid, out.attr.gid) == (4321, 8765)  # mapped for the mount's view ...
    assert (os.stat(mnt.host("f")).st_uid, os.stat(mnt.host("f")).st_gid) == (UID, GID)  # ... never applied
    assert mnt.err(m.Setattr(H(abi.Opcode.SETATTR, node), abi.FATTR_MTIME, 0, 0, 0, 0, 1, 0, 0, 10**9, 0, 0, 0,
                             0)) == errno.EINVAL


def test_readdir_offsets_are_a_stable_snapshot(mnt):
    names = [f"n{i:03}" for i in range(40)]
    for n in names:
        open(mnt.host(n), "w").close()
    o = mnt.call(m.Opendir(H(abi.Opcode.OPENDIR), os.O_RDONLY, 0))
    open(mnt.host("zz-late"), "w").close()  # after OPENDIR: not in this listing
    seen, offset = [], 0
    while True:
        data = bytes(mnt.call(m.Readdir(H(abi.Opcode.READDIR), o.fh, offset, 200, 0, 0, 0)).data)
        if not data:
            break
        pos = 0
        while pos < len(data):
            ino, off, namelen, _typ = (int.from_bytes(data[pos + i:pos + i + w], "little")
                                       for i, w in ((0, 8), (8, 8), (16, 4), (20, 4)))
            seen.append(data[pos + 24:pos + 24 + namelen].decode())
            offset = off
            pos += (24 + namelen + 7) & ~7
    assert seen == [".", ".."] + names
    mnt.call(m.Releasedir(H(abi.Opcode.RELEASEDIR), o.fh, 0, 0, 0))
    assert mnt.d.listing_bytes == 0


def test_readdirplus_takes_one_lookup_per_entry(mnt):
    open(mnt.host("a"), "w").close()
    o = mnt.call(m.Opendir(H(abi.Opcode.OPENDIR), os.O_RDONLY, 0))
    mnt.call(m.Readdirplus(H(abi.Opcode.READDIRPLUS), o.fh, 0, 4096, 0, 0, 0))
    node = mnt.lookup("a")
    assert mnt.d.nodes[node.nodeid].lookups == 2  # the entry's and the lookup's
    mnt.forget(node.nodeid, 2)
    assert node.nodeid not in mnt.d.nodes


def test_xattrs_sizes_and_acl_names(mnt):
    c = mnt.create("f")
    node = c.entry.nodeid
    mnt.call(m.Setxattr(H(abi.Opcode.SETXATTR, node), 3, 0, 0, b"user.k", b"val"))
    assert mnt.call(m.Getxattr(H(abi.Opcode.GETXATTR, node), 0, b"user.k")).size == 3
    assert bytes(mnt.call(m.Getxattr(H(abi.Opcode.GETXATTR, node), 3, b"user.k")).data) == b"val"
    assert mnt.err(m.Getxattr(H(abi.Opcode.GETXATTR, node), 2, b"user.k")) == errno.ERANGE
    assert bytes(mnt.call(m.Listxattr(H(abi.Opcode.LISTXATTR, node), 100)).data) == b"user.k\0"
    mnt.call(m.Removexattr(H(abi.Opcode.REMOVEXATTR, node), b"user.k"))
    assert mnt.err(m.Getxattr(H(abi.Opcode.GETXATTR, node), 0, b"user.k")) == errno.ENODATA
    acl = b"system.posix_acl_access"
    assert mnt.err(m.Setxattr(H(abi.Opcode.SETXATTR, node), 4, 0, 0, acl, b"\2\0\0\0")) == errno.EOPNOTSUPP
    assert mnt.err(m.Getxattr(H(abi.Opcode.GETXATTR, node), 0, acl)) == errno.EOPNOTSUPP


def test_special_files_are_made_never_opened(mnt):
    e = mnt.call(m.Mknod(H(abi.Opcode.MKNOD), stat.S_IFIFO | 0o640, 0, 0o022, b"pipe"))
    assert stat.S_ISFIFO(os.lstat(mnt.host("pipe")).st_mode) and stat.S_ISFIFO(e.attr.mode)
    assert mnt.err(m.Open(H(abi.Opcode.OPEN, e.nodeid), os.O_RDONLY, 0)) == errno.EPERM
    r = mnt.call(m.Mknod(H(abi.Opcode.MKNOD), stat.S_IFREG | 0o600, 0, 0o022, b"plain"))
    assert stat.S_ISREG(os.lstat(mnt.host("plain")).st_mode) and r.attr.mode & 0o777 == 0o600
    s = mnt.call(m.Symlink(H(abi.Opcode.SYMLINK), b"ln", b"target/x"))
    assert bytes(mnt.call(m.Readlink(H(abi.Opcode.READLINK, s.nodeid))).data) == b"target/x"


@pytest.mark.skipif(os.geteuid() != 0, reason="trusted.* xattrs need CAP_SYS_ADMIN (the fallback: test_ownership.py)")
def test_owners_of_fifos_and_symlinks_are_kept_over_fuse_and_undone(mnt):
    """A fifo or symlink made by uid 65534, or chowned, shows that owner in GETATTR (kept in
    trusted.sandbox.owner, per inode: a hard link shows it too); the host's stays; undo
    restores what was there."""
    nobody = 65534
    p = mnt.call(m.Mknod(H(abi.Opcode.MKNOD, uid=nobody, gid=nobody), stat.S_IFIFO | 0o644, 0, 0o022, b"pipe"))
    s = mnt.call(m.Symlink(H(abi.Opcode.SYMLINK, uid=nobody, gid=nobody), b"ln", b"pipe"))
    for e in (p, s):
        assert (e.attr.uid, e.attr.gid) == (nobody, nobody)
        assert (mnt.getattr(e.nodeid).uid, mnt.getattr(e.nodeid).gid) == (nobody, nobody)
    assert (os.lstat(mnt.host("ln")).st_uid, os.lstat(mnt.host("pipe")).st_uid) == (UID, UID)  # never applied
    mnt.ws.close_active()
    for e in (p, s):
        out = mnt.call(m.Setattr(H(abi.Opcode.SETATTR, e.nodeid, uid=0, gid=0), abi.FATTR_UID | abi.FATTR_GID, 0, 0, 0,
                                 0, 0, 0, 0, 0, 0, 0, 1000, 1001))
        assert (out.attr.uid, out.attr.gid) == (1000, 1001)
    hard = mnt.call(m.Link(H(abi.Opcode.LINK), p.nodeid, b"pipe2"))
    assert (hard.attr.uid, hard.attr.gid) == (1000, 1001)
    mnt.ws.close_active()
    mnt.ws.rollback(1)  # the chowns and the link
    for name in ("pipe", "ln"):
        e = mnt.lookup(name)
        assert (e.attr.uid, e.attr.gid) == (nobody, nobody), name
    assert not os.path.lexists(mnt.host("pipe2"))


def test_open_files_are_bounded(tmp_path):
    mo = Mount(tmp_path, ServerLimits(open_files_per_connection_max=2))
    try:
        fhs = [mo.create(f"f{i}") for i in range(2)]
        assert mo.err(m.Create(H(abi.Opcode.CREATE), os.O_RDWR | os.O_CREAT, 0o644, 0, 0, b"f9")) == errno.EMFILE
        assert not os.path.exists(mo.host("f9"))
        mo.release(fhs[0].entry.nodeid, fhs[0].open.fh)
        mo.create("f9")
    finally:
        mo.close()


def test_unsupported_opcodes_are_enosys_and_forget_has_no_reply(mnt):
    async def go():
        sent = []
        send = lambda u, r, e: sent.append((u, r, e))  # noqa: E731
        mnt.d.submit(m.Setlk(H(abi.Opcode.SETLK), 1, 0, 0, 10, 1, 0, 0), 80, send)
        mnt.d.submit(m.Forget(H(abi.Opcode.FORGET), 1), 48, send)
        mnt.d.submit(m.Statfs(H(abi.Opcode.STATFS)), 40, send)
        return sent

    sent = asyncio.run(go())
    assert len(sent) == 2
    assert sent[0][2].errno == errno.ENOSYS and sent[1][2] is None and sent[1][1].namelen == 255


def test_a_held_delete_waits_while_other_requests_flow(tmp_path):
    mo = Mount(tmp_path, safeguard=SafeguardConfig(delete_threshold=2, timeout_s=30))
    for i in range(3):
        open(mo.host(f"f{i}"), "w").close()
    before_step = snapshot_dir(mo.work)

    async def go():
        sent, settled, send = replies()

        reqs = [m.Unlink(H(abi.Opcode.UNLINK), f"f{i}".encode()) for i in range(3)]
        deferred = [mo.d.submit(r, 64, send) for r in reqs]
        assert deferred == [False, True, True]  # the second delete crosses the threshold; the third queues
        read = m.Getattr(H(abi.Opcode.GETATTR), 0, 0)
        assert mo.d.submit(read, 56, send) is False and sent[read.header.unique][1] is None  # reads go on
        assert sorted(os.listdir(mo.work)) == ["f1", "f2"]
        assert mo.d.pipeline.held_bytes == 128
        gate = mo.export.gate
        while gate.pending is None:
            await asyncio.sleep(0)  # the held task registers its hold on its first turn
        settled.clear()
        assert mo.holds.answer(gate.pending.id, "allow")
        while len(sent) < 4:
            settled.clear()
            await settled.wait()
        assert all(sent[r.header.unique][1] is None for r in reqs)
        assert os.listdir(mo.work) == []

    try:
        asyncio.run(go())
    finally:
        mo.close()
    ws = Workspace.open(mo.work, state_dir=str(tmp_path / "state"))
    try:
        ws.rollback(len(ws.history()))
    finally:
        ws.close()
    assert_same(before_step, snapshot_dir(mo.work), "after undoing the held step")


def _interrupt(target: int) -> m.Interrupt:
    h = H(abi.Opcode.INTERRUPT)
    return m.Interrupt(m.InHeader(h.len, h.opcode, target | 1, 0, 0, 0, 0), target)  # the kernel's FUSE_INT_REQ_BIT


def test_interrupt_answers_a_held_request_eintr_and_the_hold_stays_pending(tmp_path):
    """An INTERRUPT cancels a request waiting behind a hold (the head, or one queued behind
    it): each is answered EINTR and never runs. The hold stays pending, as after a 9P
    Tflush: the next mutation meets it again, and its answer still decides the step."""
    mo = Mount(tmp_path, safeguard=SafeguardConfig(delete_threshold=2, timeout_s=30))
    for i in range(4):
        open(mo.host(f"f{i}"), "w").close()

    async def go():
        sent, settled, send = replies()

        async def until(n):
            while len(sent) < n:
                settled.clear()
                await settled.wait()

        reqs = [m.Unlink(H(abi.Opcode.UNLINK), f"f{i}".encode()) for i in range(3)]
        assert [mo.d.submit(r, 64, send) for r in reqs] == [False, True, True]
        gate = mo.export.gate
        while gate.pending is None:
            await asyncio.sleep(0)  # the held task registers its hold on its first turn
        hold_id = gate.pending.id
        mo.d.submit(_interrupt(reqs[2].header.unique), 48, send)  # the queued one
        await until(2)
        assert sent[reqs[2].header.unique][1].errno == errno.EINTR
        assert gate.pending is not None and mo.d.pipeline.held_bytes == 64
        mo.d.submit(_interrupt(reqs[1].header.unique), 48, send)  # the head
        await until(3)
        assert sent[reqs[1].header.unique][1].errno == errno.EINTR
        assert sorted(os.listdir(mo.work)) == ["f1", "f2", "f3"]  # neither ran
        assert [h["safeguard_id"] for h in mo.holds.pending()] == [hold_id]  # still pending
        assert mo.d.pipeline.held_bytes == 0 and not mo.export.gate.busy
        assert mo.d.interrupts == 2
        again = m.Unlink(H(abi.Opcode.UNLINK), b"f3")
        assert mo.d.submit(again, 64, send) is True  # meets the same hold
        while gate.pending is None:
            await asyncio.sleep(0)
        assert gate.pending.id == hold_id and len(mo.holds.pending()) == 1
        assert mo.holds.answer(hold_id, "allow")
        await until(4)
        assert sent[again.header.unique][1] is None
        assert sorted(os.listdir(mo.work)) == ["f1", "f2"]

    try:
        asyncio.run(go())
    finally:
        mo.close()


def test_interrupt_of_a_finished_or_unknown_request_is_ignored_and_an_early_one_is_eagain(mnt):
    async def go():
        sent = []
        send = lambda u, r, e: sent.append((u, r, e))  # noqa: E731
        done = m.Statfs(H(abi.Opcode.STATFS))
        mnt.d.submit(done, 40, send)
        assert len(sent) == 1
        mnt.d.submit(_interrupt(done.header.unique), 48, send)  # answered already: late, ignored
        mnt.d.submit(_interrupt(2), 48, send)  # long gone (below the last unique read): ignored
        assert len(sent) == 1 and mnt.d.interrupts == 0
        ahead = done.header.unique + 1000 * 2
        mnt.d.submit(_interrupt(ahead), 48, send)  # never read yet: EAGAIN to the INTERRUPT itself
        assert len(sent) == 2
        unique, reply, error = sent[1]
        assert unique == ahead | 1 and error.errno == errno.EAGAIN
        encode_error(unique, errno_of(error))

    asyncio.run(go())


def test_a_hold_interrupted_then_denied_rolls_the_step_back(tmp_path):
    mo = Mount(tmp_path, safeguard=SafeguardConfig(delete_threshold=2, timeout_s=30))
    for i in range(3):
        open(mo.host(f"f{i}"), "w").close()
    before = snapshot_dir(mo.work)

    async def go():
        sent: dict[int, tuple] = {}
        send = lambda u, r, e: sent.__setitem__(u, (r, e))  # noqa: E731
        reqs = [m.Unlink(H(abi.Opcode.UNLINK), f"f{i}".encode()) for i in range(2)]
        assert [mo.d.submit(r, 64, send) for r in reqs] == [False, True]
        gate = mo.export.gate
        while gate.pending is None:
            await asyncio.sleep(0)
        hold_id = gate.pending.id
        mo.d.submit(_interrupt(reqs[1].header.unique), 48, send)
        await asyncio.gather(*mo.d.pipeline.tasks.values(), return_exceptions=True)
        await asyncio.sleep(0)
        assert sent[reqs[1].header.unique][1].errno == errno.EINTR
        assert mo.holds.answer(hold_id, "deny")  # nobody waits on it any more; it still decides
        assert_same(before, snapshot_dir(mo.work), "the folder after the interrupted hold was denied")

    try:
        asyncio.run(go())
    finally:
        mo.close()


def test_invalidations_name_what_the_kernel_knows(mnt):
    """A changed path: its name under each known parent node, the parent's attributes, and
    the node(s) it names (attributes and pages); an unknown path: nothing."""
    os.mkdir(mnt.host("d"))
    open(mnt.host("d", "f"), "w").close()
    d = mnt.lookup("d").nodeid
    f = mnt.lookup("f", d).nodeid
    assert mnt.d.invalidations(["d/f"]) == [m.NotifyInvalInode(f, 0, 0), m.NotifyInvalEntry(d, b"f"),
                                            m.NotifyInvalInode(d, -1, 0)]
    assert mnt.d.invalidations(["d/new"]) == [m.NotifyInvalEntry(d, b"new"), m.NotifyInvalInode(d, -1, 0)]
    assert mnt.d.invalidations(["elsewhere/x", "elsewhere"]) == [m.NotifyInvalEntry(ROOT, b"elsewhere"),
                                                                 m.NotifyInvalInode(ROOT, -1, 0)]
    assert mnt.d.invalidations([""]) == [m.NotifyInvalInode(ROOT, 0, 0)]
    every = mnt.d.invalidations_all()
    assert set(every) == {m.NotifyInvalInode(ROOT, 0, 0), m.NotifyInvalInode(d, 0, 0), m.NotifyInvalInode(f, 0, 0),
                          m.NotifyInvalEntry(ROOT, b"d"), m.NotifyInvalEntry(d, b"f"),
                          m.NotifyInvalInode(ROOT, -1, 0), m.NotifyInvalInode(d, -1, 0)}
    mnt.forget(f, 1)  # forgotten: the kernel no longer knows it
    assert m.NotifyInvalInode(f, 0, 0) not in mnt.d.invalidations(["d/f"])
    for n in every:
        encode_notify(n)


def test_coherent_means_long_timeouts_and_kept_pages(mnt):
    open(mnt.host("f"), "w").close()
    e = mnt.lookup("f")
    assert (e.entry_valid, e.attr_valid) == (ENTRY_VALID_S, ATTR_VALID_S)
    o = mnt.call(m.Open(H(abi.Opcode.OPEN, e.nodeid), os.O_RDONLY, 0))
    assert not o.open_flags & abi.FOPEN_KEEP_CACHE
    mnt.d.coherent = True
    e2 = mnt.lookup("f")
    assert (e2.entry_valid, e2.attr_valid) == (COHERENT_ENTRY_VALID_S, COHERENT_ATTR_VALID_S)
    assert mnt.call(m.Getattr(H(abi.Opcode.GETATTR, e.nodeid), 0, 0)).attr_valid == COHERENT_ATTR_VALID_S
    o2 = mnt.call(m.Open(H(abi.Opcode.OPEN, e.nodeid), os.O_RDONLY, 0))
    assert o2.open_flags & abi.FOPEN_KEEP_CACHE
    # every write is a request (no writeback cache); our own writes' pages are not dropped
    # when the mtime moves (no AUTO_INVAL_DATA: the watcher's notifications drop the host's)
    assert not WANTED_INIT_FLAGS & (abi.FUSE_AUTO_INVAL_DATA | abi.FUSE_WRITEBACK_CACHE)
    # nothing is buffered here: no FLUSH at close, whatever the mode
    assert o.open_flags & abi.FOPEN_NOFLUSH and o2.open_flags & abi.FOPEN_NOFLUSH
    assert mnt.create("g").open.open_flags & abi.FOPEN_NOFLUSH


def test_missing_names_are_cached_negative_entries_only_while_coherent(mnt):
    """Coherent: a missing name is answered as a negative entry (nodeid 0) with the long
    entry timeout, and remembered, so an invalidation of everything reaches it; a path
    invalidation of that name drops it from the memory. Not coherent: ENOENT (nothing cached)."""
    assert mnt.err(m.Lookup(H(abi.Opcode.LOOKUP, ROOT), b"nope")) == errno.ENOENT
    assert not mnt.d.negative
    mnt.d.coherent = True
    e = mnt.lookup("nope")
    assert (e.nodeid, e.entry_valid) == (0, COHERENT_ENTRY_VALID_S)
    os.mkdir(mnt.host("d"))
    d = mnt.lookup("d").nodeid
    assert mnt.lookup("gone", parent=d).nodeid == 0
    assert mnt.err(m.Lookup(H(abi.Opcode.LOOKUP, ROOT), b"d/x")) == errno.EINVAL  # not one name: never cached
    assert set(mnt.d.negative) == {(ROOT, b"nope"), (d, b"gone")}
    assert m.NotifyInvalEntry(d, b"gone") in mnt.d.invalidations(["d/gone"])
    assert set(mnt.d.negative) == {(ROOT, b"nope")}
    mnt.lookup("again", parent=d)
    every = mnt.d.invalidations_all()
    assert m.NotifyInvalEntry(ROOT, b"nope") in every and m.NotifyInvalEntry(d, b"again") in every
    assert len(every) == len(set(every)) and not mnt.d.negative
    for n in every:
        encode_notify(n)


def test_a_transport_that_cannot_invalidate_gets_short_negative_entries(mnt):
    """``negative_entries_short`` (the virtio-fs device: no notification queue): while not
    coherent a missing name is a negative entry valid ENTRY_VALID_S — the bound of every
    positive entry — and nothing is remembered (nothing could invalidate it); a name made
    on the host is found once it expires. Coherent, the remembered long entries as before."""
    mnt.d.negative_entries_short = True
    e = mnt.lookup("nope")
    assert (e.nodeid, e.entry_valid, e.attr_valid) == (0, ENTRY_VALID_S, 0)
    assert not mnt.d.negative
    assert mnt.err(m.Lookup(H(abi.Opcode.LOOKUP, ROOT), b"d/x")) == errno.EINVAL  # other errors stay errors
    with open(mnt.host("nope"), "w"):
        pass
    assert mnt.lookup("nope").nodeid != 0  # asked again (the kernel's entry expired): found
    mnt.d.coherent = True
    assert mnt.lookup("gone").entry_valid == COHERENT_ENTRY_VALID_S and (ROOT, b"gone") in mnt.d.negative
    mnt.d.coherent, mnt.d.negative_entries_short = False, False
    assert mnt.err(m.Lookup(H(abi.Opcode.LOOKUP, ROOT), b"other")) == errno.ENOENT


def test_negative_entries_are_bounded(mnt):
    """At :data:`NEGATIVE_ENTRIES_MAX` remembered (none expired yet), a missing name is plain
    ENOENT — never a negative entry an invalidation of everything would not reach."""
    mnt.d.coherent = True
    for i in range(NEGATIVE_ENTRIES_MAX):
        assert mnt.lookup(f"n{i}").nodeid == 0
    assert mnt.err(m.Lookup(H(abi.Opcode.LOOKUP, ROOT), b"one-more")) == errno.ENOENT
    assert mnt.lookup("n0").nodeid == 0  # one already remembered may be answered again
    assert len(mnt.d.negative) == NEGATIVE_ENTRIES_MAX


def _direct(o: m.OpenOut) -> bool:
    return bool(o.open_flags & abi.FOPEN_DIRECT_IO)


def test_write_only_opens_of_a_file_open_nowhere_else_are_direct_and_so_is_every_open_beside_them(mnt):
    """``direct_io_write_only`` (the virtio-fs device: the guest's page cache is dropped at
    each open, never invalidated meanwhile): a write-only OPEN or CREATE of a node with no
    other open handle is answered ``FOPEN_DIRECT_IO`` (it can never be mapped, and its
    writes skip the guest's page cache); while a node has a direct handle every other open
    of it is direct too (its reader never caches pages the direct writer leaves stale); a
    write-only open beside a cached handle is not (the cached reader would read stale
    pages); the rule resets when the handles are released. Off, or coherent: never."""
    for name in ("w", "r", "rw"):
        with open(mnt.host(name), "w") as f:
            f.write("x")
    w, r, rw = (mnt.lookup(n).nodeid for n in ("w", "r", "rw"))

    def open_(node: int, flags: int) -> m.OpenOut:
        return mnt.call(m.Open(H(abi.Opcode.OPEN, node), flags, 0))

    # off (a /dev/fuse mount): nothing is direct
    o = open_(w, os.O_WRONLY)
    assert not _direct(o) and o.open_flags & abi.FOPEN_NOFLUSH
    mnt.release(w, o.fh)
    mnt.d.direct_io_write_only = True
    # reading opens stay cached (they may be mapped shared)
    for node, flags in ((r, os.O_RDONLY), (rw, os.O_RDWR)):
        o = open_(node, flags)
        assert not _direct(o) and o.open_flags & abi.FOPEN_NOFLUSH
        mnt.release(node, o.fh)
    # the sole write-only open is direct; every open beside it too, whatever its mode
    wo = open_(w, os.O_WRONLY | os.O_APPEND)
    assert _direct(wo) and wo.open_flags & abi.FOPEN_NOFLUSH
    beside = [open_(w, flags) for flags in (os.O_RDONLY, os.O_RDWR, os.O_WRONLY)]
    assert all(_direct(o) for o in beside)
    mnt.release(w, wo.fh)
    beside.append(open_(w, os.O_RDONLY))  # direct handles are still open: still direct
    assert _direct(beside[-1])
    for o in beside:
        mnt.release(w, o.fh)
    # every handle gone: the rule starts again (pages were dropped at this open)
    rd = open_(w, os.O_RDONLY)
    assert not _direct(rd)
    # a write-only open beside a cached reader (tail -f before cmd >> log) stays cached
    assert not _direct(open_(w, os.O_WRONLY))
    # write-only CREATE: a new file open nowhere else is direct; O_RDWR is not
    c = mnt.create("new", flags=os.O_WRONLY)
    assert _direct(c.open) and c.open.open_flags & abi.FOPEN_NOFLUSH
    assert _direct(open_(c.entry.nodeid, os.O_RDWR))
    assert not _direct(mnt.create("new-rw", flags=os.O_RDWR).open)
    # a CREATE that opens an existing file with a cached handle on it is not direct
    assert not _direct(mnt.create("w", flags=os.O_WRONLY).open)
    # coherent (pages kept across opens): never direct
    mnt.d.coherent = True
    o = open_(r, os.O_WRONLY)
    assert not _direct(o) and o.open_flags & abi.FOPEN_KEEP_CACHE


def test_direct_io_all_makes_every_open_direct_whatever_its_mode_and_the_handles_beside_it(mnt):
    """``direct_io_all`` (the virtio-fs device's ``direct_io="all"``, virtiofsd ``cache=none``'s
    trade): every OPEN and CREATE is answered ``FOPEN_DIRECT_IO`` — reading ones too, beside a
    cached handle or not, coherent or not — so no open fills the guest's page cache."""
    for name in ("r", "rw"):
        with open(mnt.host(name), "w") as f:
            f.write("x")
    r, rw = (mnt.lookup(n).nodeid for n in ("r", "rw"))
    mnt.d.direct_io_write_only = True
    cached = mnt.call(m.Open(H(abi.Opcode.OPEN, r), os.O_RDONLY, 0))
    assert not _direct(cached)
    mnt.d.direct_io_all = True
    for node, flags in ((r, os.O_RDONLY), (rw, os.O_RDWR), (rw, os.O_WRONLY), (r, os.O_WRONLY)):
        o = mnt.call(m.Open(H(abi.Opcode.OPEN, node), flags, 0))
        assert _direct(o) and o.open_flags & abi.FOPEN_NOFLUSH, (node, flags)
    assert _direct(mnt.create("new-rw", flags=os.O_RDWR).open)
    mnt.d.coherent = True
    assert _direct(mnt.call(m.Open(H(abi.Opcode.OPEN, rw), os.O_RDONLY, 0)))


def test_entries_made_in_a_setgid_directory_take_its_group_and_directories_its_setgid_bit(mnt):
    """What a local filesystem does (the kernel leaves it to a FUSE server): in a set-gid
    directory a new file, directory or node gets the directory's group, and a new directory
    keeps the set-gid bit. Found by the POSIX model over FUSE (mkdir d; chmod 2755 d;
    mkdir d/s gave 0755 where the kernel gives 2755)."""
    d = mnt.call(m.Mkdir(H(abi.Opcode.MKDIR), 0o755, 0o022, b"shared")).nodeid
    mnt.call(m.Setattr(H(abi.Opcode.SETATTR, d, uid=0, gid=0), abi.FATTR_GID, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4242))
    mnt.call(m.Setattr(H(abi.Opcode.SETATTR, d), abi.FATTR_MODE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0o2775, 0, 0))
    assert (mnt.getattr(d).mode & 0o7777, mnt.getattr(d).gid) == (0o2775, 4242)
    sub = mnt.call(m.Mkdir(H(abi.Opcode.MKDIR, d), 0o755, 0o022, b"sub"))
    assert (sub.attr.mode & 0o7777, sub.attr.gid) == (0o2755, 4242)
    f = mnt.create("file", 0o640, parent=d)
    assert (f.entry.attr.mode & 0o7777, f.entry.attr.gid) == (0o640, 4242)
    fifo = mnt.call(m.Mknod(H(abi.Opcode.MKNOD, d), stat.S_IFIFO | 0o640, 0, 0o022, b"pipe"))
    assert fifo.attr.mode & 0o7777 == 0o640  # a fifo keeps no owner of its own (the host's shows)
    plain = mnt.call(m.Mkdir(H(abi.Opcode.MKDIR), 0o755, 0o022, b"plain"))
    assert (plain.attr.mode & 0o7777, plain.attr.gid) == (0o755, GID)  # elsewhere: the caller's group


def test_an_inode_number_reused_for_another_type_is_stale_not_the_same_node(mnt):
    """The host reuses a freed inode number (ext4 often does at once): a file removed behind
    the mount and a directory made at its name may carry the file's (st_ino, st_dev). The
    file's node must not answer with the directory's attributes — the kernel would see its file
    change type, mark the inode bad and fail every later call on it with EIO (found by the undo
    model over FUSE). The type is checked too: ESTALE, and a lookup makes a new node."""
    for _attempt in range(100):
        c = mnt.create("victim")
        mnt.release(c.entry.nodeid, c.open.fh)
        ino = os.lstat(mnt.host("victim")).st_ino
        os.unlink(mnt.host("victim"))  # behind the mount's back
        os.mkdir(mnt.host("victim"))
        if os.lstat(mnt.host("victim")).st_ino == ino:
            break
        os.rmdir(mnt.host("victim"))
    else:
        pytest.skip("the host filesystem never reused the inode number here")
    assert mnt.err(m.Getattr(H(abi.Opcode.GETATTR, c.entry.nodeid), 0, 0)) == errno.ESTALE
    d = mnt.lookup("victim")
    assert d.nodeid != c.entry.nodeid and stat.S_ISDIR(d.attr.mode)


def test_a_write_drops_the_kept_capability_undoably(mnt):
    """HANDLE_KILLPRIV_V2 leaves dropping a file's capability on write to the server: the
    kept (mapped) ``security.capability`` is removed before the bytes land, whoever writes,
    and the undo brings it back."""
    from sandbox.mounts.identity import host_xattr_name

    name = host_xattr_name("security.capability")
    with open(mnt.host("f"), "wb") as f:
        f.write(b"abc")
    os.setxattr(mnt.host("f"), name, b"\x00\x00\x00\x02" + bytes(16))
    e = mnt.lookup("f")
    o = mnt.call(m.Open(H(abi.Opcode.OPEN, e.nodeid), os.O_WRONLY, 0))
    assert mnt.write(e.nodeid, o.fh, b"X") == 1
    assert name not in os.listxattr(mnt.host("f"))
    assert mnt.write(e.nodeid, o.fh, b"Y", 1) == 1  # none left: nothing to drop
    mnt.call(m.Release(H(abi.Opcode.RELEASE, e.nodeid), o.fh, 0, 0, 0))
    mnt.ws.rollback(1)
    assert os.getxattr(mnt.host("f"), name) == b"\x00\x00\x00\x02" + bytes(16)
    assert open(mnt.host("f"), "rb").read() == b"abc"


# ---------------------------------------------------------------------- no-open (docs/fuse.md "No-open")


@pytest.fixture
def nomnt(tmp_path):
    mo = Mount(tmp_path, no_open=True)
    yield mo
    mo.close()


def _granted(out: m.InitOut) -> int:
    return out.flags | (out.flags2 << 32)


@pytest.mark.parametrize("allowed,coherent", [(False, False), (True, False), (False, True), (True, True)])
def test_no_open_only_on_a_transport_that_allows_it_and_while_coherent(tmp_path, allowed, coherent):
    """No-open is chosen at INIT, only for /dev/fuse (the virtio-fs device does not allow it)
    and only while the watcher's invalidations run; it gives up ATOMIC_O_TRUNC."""
    mo = Mount(tmp_path)
    try:
        d = Dispatcher(mo.export, ServerLimits())
        d.no_open_allowed, d.coherent = allowed, coherent
        out = d.handle(m.Init(H(abi.Opcode.INIT), 7, 38, 1 << 17, 0xFFFFFFFF & ~abi.FUSE_INIT_RESERVED, 0xFFFFFFFF))
        assert d.no_open == (allowed and coherent)
        assert bool(_granted(out) & abi.FUSE_ATOMIC_O_TRUNC) == (not d.no_open)
        assert not _granted(out) & abi.FUSE_WRITEBACK_CACHE
        d2 = Dispatcher(mo.export, ServerLimits())  # a kernel that does not offer it
        d2.no_open_allowed = d2.coherent = True
        d2.handle(m.Init(H(abi.Opcode.INIT), 7, 38, 1 << 17,
                         0xFFFFFFFF & ~abi.FUSE_INIT_RESERVED & ~abi.FUSE_NO_OPEN_SUPPORT, 0xFFFFFFFF))
        assert not d2.no_open
        d.close()
        d2.close()
    finally:
        mo.close()


def test_no_open_answers_open_and_flush_enosys_and_reads_writes_by_node(nomnt):
    with open(nomnt.host("f"), "wb") as f:
        f.write(b"0123456789")
    e = nomnt.lookup("f")
    assert nomnt.err(m.Open(H(abi.Opcode.OPEN, e.nodeid), os.O_RDONLY, 0)) == errno.ENOSYS
    assert nomnt.err(m.Flush(H(abi.Opcode.FLUSH, e.nodeid), 0, 0)) == errno.ENOSYS
    assert nomnt.read(e.nodeid, 0, 4, 2) == b"2345"
    assert nomnt.write(e.nodeid, 0, b"ab", 8) == 2
    assert open(nomnt.host("f"), "rb").read() == b"01234567ab"
    nomnt.release(e.nodeid, 0)  # a RELEASE of handle 0 (a CREATE'd file's) is harmless
    nomnt.call(m.Fsync(H(abi.Opcode.FSYNC, e.nodeid), 0, 0))
    c = nomnt.create("new", flags=os.O_WRONLY)
    assert c.open.fh == 0 and c.open.open_flags & abi.FOPEN_KEEP_CACHE
    assert nomnt.write(c.entry.nodeid, 0, b"hello") == 5
    assert nomnt.read(c.entry.nodeid, 0, 5) == b"hello"  # write-only asked, read-write kept: partial pages
    nomnt.ws.rollback(1)
    assert open(nomnt.host("f"), "rb").read() == b"0123456789"
    assert not os.path.exists(nomnt.host("new"))


def test_no_open_an_append_write_lands_at_the_hosts_end(nomnt):
    with open(nomnt.host("log"), "wb") as f:
        f.write(b"one\n")
    e = nomnt.lookup("log")
    with open(nomnt.host("log"), "ab") as f:  # beside the mount: the kernel's size is 4 until told
        f.write(b"host\n")
    w = m.Write(H(abi.Opcode.WRITE, e.nodeid), 0, 4, 4, 0, 0, os.O_WRONLY | os.O_APPEND, b"two\n")
    assert nomnt.call(w).size == 4
    assert open(nomnt.host("log"), "rb").read() == b"one\nhost\ntwo\n"
    # a page written back from the cache (mmap) is placed where the kernel says
    w = m.Write(H(abi.Opcode.WRITE, e.nodeid), 0, 0, 3, abi.FUSE_WRITE_CACHE, 0, os.O_APPEND, b"ONE")
    assert nomnt.call(w).size == 3
    assert open(nomnt.host("log"), "rb").read() == b"ONE\nhost\ntwo\n"


def test_no_open_o_trunc_is_a_gated_truncating_setattr_undone_exactly(nomnt):
    """Without ATOMIC_O_TRUNC the kernel truncates an ``O_TRUNC`` open with SETATTR(size 0,
    handle 0): a mutation through the hold gate, its preimage kept."""
    with open(nomnt.host("f"), "wb") as f:
        f.write(b"precious")
    e = nomnt.lookup("f")
    req = m.Setattr(H(abi.Opcode.SETATTR, e.nodeid), abi.FATTR_SIZE | abi.FATTR_FH, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                    0, 0, 0)
    assert nomnt.d.gated(req) is nomnt.export
    assert nomnt.call(req).attr.size == 0
    assert nomnt.write(e.nodeid, 0, b"new") == 3
    assert open(nomnt.host("f"), "rb").read() == b"new"
    nomnt.ws.rollback(1)
    assert open(nomnt.host("f"), "rb").read() == b"precious"


def test_no_open_an_unlinked_file_keeps_its_descriptor_until_forget(tmp_path):
    budget = DescriptorBudget(reserved=0, nofile=lambda: 1000)
    mo = Mount(tmp_path, no_open=True, descriptors=budget)
    try:
        with open(mo.host("tmp"), "wb") as f:
            f.write(b"data")
        e = mo.lookup("tmp")  # a program opens it (no request: no-open), then unlinks it
        mo.call(m.Unlink(H(abi.Opcode.UNLINK), b"tmp"))
        assert not os.path.exists(mo.host("tmp"))
        assert mo.read(e.nodeid, 0, 4) == b"data"
        assert mo.write(e.nodeid, 0, b"more", 4) == 4
        assert mo.read(e.nodeid, 0, 8) == b"datamore"
        assert mo.getattr(e.nodeid).size == 8
        for i in range(mo.d.node_descriptors_max + 3):  # the LRU never closes it
            with open(mo.host(f"o{i}"), "wb") as f:
                f.write(b"x")
            assert mo.read(mo.lookup(f"o{i}").nodeid, 0, 1) == b"x"
        assert mo.read(e.nodeid, 0, 8) == b"datamore"
        held = budget.held
        mo.forget(e.nodeid, 1)
        assert budget.held < held and e.nodeid not in mo.d.nodes
        # renamed over: the replaced file is kept the same way
        with open(mo.host("a"), "wb") as f:
            f.write(b"old")
        with open(mo.host("b"), "wb") as f:
            f.write(b"new")
        old = mo.lookup("a")
        mo.call(m.Rename(H(abi.Opcode.RENAME), ROOT, b"b", b"a"))
        assert mo.read(old.nodeid, 0, 3) == b"old"
    finally:
        mo.close()
    assert budget.held == 0


def test_no_open_descriptors_are_bounded_least_recently_used_first(tmp_path, monkeypatch):
    monkeypatch.setattr(dispatcher_module, "NODE_DESCRIPTORS_MAX", 3)
    budget = DescriptorBudget(reserved=0, nofile=lambda: 1000)
    mo = Mount(tmp_path, no_open=True, descriptors=budget)
    try:
        nodes = []
        for i in range(8):
            with open(mo.host(f"f{i}"), "wb") as f:
                f.write(bytes([65 + i]))
            nodes.append(mo.lookup(f"f{i}").nodeid)
            assert mo.read(nodes[-1], 0, 1) == bytes([65 + i])
            assert mo.write(nodes[-1], 0, b"z", 1) == 1
            holding = [n for n in mo.d.nodes.values() if n.ro is not None or n.rw is not None]
            assert len(holding) <= 3 and budget.held <= 2 * 3
        assert mo.read(nodes[0], 0, 2) == b"Az"  # closed long ago: reopened by path
        os.rename(mo.host("f1"), mo.host("moved"))  # beside the mount: the node's name now names nothing
        assert mo.err(m.Read(H(abi.Opcode.READ, nodes[1]), 0, 0, 1, 0, 0, 0)) in (errno.ESTALE, errno.ENOENT)
    finally:
        mo.close()
    assert budget.held == 0


def test_no_open_descriptors_stay_within_the_mounts_share_of_the_process_budget(tmp_path):
    """NODE_DESCRIPTORS_MAX is large (a cached tree's files are served through their nodes'
    descriptors); under a small RLIMIT_NOFILE the bound is half the mount's share of the
    process's budget (two descriptors a node), so the LRU closes before the budget runs out."""
    budget = DescriptorBudget(reserved=0, nofile=lambda: 40)  # share 1/4: 10 descriptors, 5 nodes
    mo = Mount(tmp_path, no_open=True, descriptors=budget)
    try:
        assert mo.d.node_descriptors_max == 5 < dispatcher_module.NODE_DESCRIPTORS_MAX
        for i in range(12):
            with open(mo.host(f"f{i}"), "wb") as f:
                f.write(bytes([65 + i]))
            nodeid = mo.lookup(f"f{i}").nodeid
            assert mo.read(nodeid, 0, 1) == bytes([65 + i])
            assert mo.write(nodeid, 0, b"z", 1) == 1
            holding = [n for n in mo.d.nodes.values() if n.ro is not None or n.rw is not None]
            assert len(holding) <= 5 and budget.held <= 10
    finally:
        mo.close()
    assert budget.held == 0


def test_no_open_a_full_process_budget_closes_idle_node_descriptors_before_failing_a_read(tmp_path):
    """Other servers of the process hold all but one descriptor: a read needing a new one first
    closes this mount's least recently used node's, instead of failing with ENFILE."""
    budget = DescriptorBudget(reserved=0, nofile=lambda: 40)  # 5 nodes for this mount
    mo = Mount(tmp_path, no_open=True, descriptors=budget)
    try:
        for _ in range(39):  # the rest of the process
            budget.acquire()
        nodes = []
        for i in range(3):
            with open(mo.host(f"f{i}"), "wb") as f:
                f.write(bytes([65 + i]))
            nodes.append(mo.lookup(f"f{i}").nodeid)
            assert mo.read(nodes[-1], 0, 1) == bytes([65 + i])
            assert budget.held == 40
        assert mo.read(nodes[0], 0, 1) == b"A"  # reopened by path, another one closed
        for _ in range(39):
            budget.release()
    finally:
        mo.close()
    assert budget.held == 0


def test_no_open_without_the_watcher_a_host_edit_seen_in_attributes_drops_the_pages(nomnt):
    """A no-open mount that lost its watcher (not coherent): the kernel keeps a file's pages
    across opens and has no AUTO_INVAL_DATA, so the server does its part — a LOOKUP or GETATTR
    reply whose mtime, ctime or size differ from what the kernel was last told of that file
    asks for the file's invalidation (its path, to :attr:`Dispatcher.on_host_changed`). The
    mount's own writes and truncations are no such change; nothing is asked while coherent."""
    asked: list[str] = []
    nomnt.d.on_host_changed = asked.extend
    with open(nomnt.host("f"), "wb") as f:
        f.write(b"0123456789")
    e = nomnt.lookup("f")
    os.utime(nomnt.host("f"), ns=(0, 10**9))  # beside the mount, while coherent: the watcher's part
    nomnt.getattr(e.nodeid)
    assert asked == []
    nomnt.d.coherent = False  # the watcher is gone
    nomnt.getattr(e.nodeid)
    assert asked == []  # nothing changed since the kernel was last told
    with open(nomnt.host("f"), "r+b") as f:  # the same size: only the mtime and ctime move
        f.write(b"ABC")
    nomnt.getattr(e.nodeid)
    assert asked == ["f"]
    nomnt.getattr(e.nodeid)
    nomnt.lookup("f")
    assert asked == ["f"]  # once per change
    os.utime(nomnt.host("f"), ns=(0, 2 * 10**9))
    assert nomnt.lookup("f").attr.mtime == 2
    assert asked == ["f", "f"]
    assert nomnt.write(e.nodeid, 0, b"own", 3) == 3  # the mount's own write: no invalidation
    nomnt.getattr(e.nodeid)
    req = m.Setattr(H(abi.Opcode.SETATTR, e.nodeid), abi.FATTR_SIZE, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert nomnt.call(req).attr.size == 4
    nomnt.getattr(e.nodeid)
    assert asked == ["f", "f"]
    with open(nomnt.host("f"), "r+b") as f:  # beside the mount, then the mount's own write
        f.write(b"H")
    os.utime(nomnt.host("f"), ns=(0, 5 * 10**9))  # an mtime surely unlike the truncation's
    assert nomnt.write(e.nodeid, 0, b"w", 3) == 1
    assert asked == ["f", "f", "f"]  # the host's edit before it is still seen
    nomnt.getattr(e.nodeid)
    assert asked == ["f", "f", "f"]
    assert open(nomnt.host("f"), "rb").read() == b"HBCw"


def test_no_open_a_directory_node_answers_getattr_through_its_own_descriptor(tmp_path, monkeypatch):
    """No-open: a directory's GETATTR (the kernel asks before each create or unlink in it) and
    a CREATE's set-gid check read its attributes through a read-only descriptor the node keeps
    (one ``fstat`` and ``flistxattr``, no path resolution), as a regular file's node does: the
    node's own inode — still answered after the directory is renamed beside the mount, where
    a path lookup says ESTALE — read afresh each time (a host chmod shows at once). The
    descriptors count in the same LRU bound and budget; an RMDIR or FORGET closes them."""
    monkeypatch.setattr(dispatcher_module, "NODE_DESCRIPTORS_MAX", 3)
    budget = DescriptorBudget(reserved=0, nofile=lambda: 1000)
    mo = Mount(tmp_path, no_open=True, descriptors=budget)
    try:
        d = mo.call(m.Mkdir(H(abi.Opcode.MKDIR), 0o755, 0o022, b"d")).nodeid
        held = budget.held
        assert mo.getattr(d).mode & 0o7777 == 0o755
        assert budget.held == held + 1 and mo.d.nodes[d].ro is not None
        mo.call(m.Setattr(H(abi.Opcode.SETATTR, d), abi.FATTR_MODE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0o2775, 0, 0))
        assert mo.getattr(d).mode & 0o7777 == 0o2775  # the kept mode, read through the descriptor
        os.chown(mo.host("d"), -1, 4242)  # beside the mount: read afresh, never cached here
        assert mo.getattr(d).gid == 4242 and budget.held == held + 1
        f = mo.create("f", 0o640, parent=d)  # the set-gid check: the directory's group
        assert f.entry.attr.gid == 4242
        os.rename(mo.host("d"), mo.host("moved"))  # beside the mount: the node is its inode
        assert mo.getattr(d).gid == 4242
        os.rename(mo.host("moved"), mo.host("d"))
        dirs = []
        for i in range(6):  # bounded with the files' descriptors, least recently used first
            dirs.append(mo.call(m.Mkdir(H(abi.Opcode.MKDIR), 0o755, 0o022, f"s{i}".encode())).nodeid)
            assert stat.S_ISDIR(mo.getattr(dirs[-1]).mode)
            holding = [n for n in mo.d.nodes.values() if n.ro is not None or n.rw is not None]
            assert len(holding) <= 3
        assert stat.S_ISDIR(mo.getattr(d).mode)  # closed by the LRU meanwhile: reopened by path
        held = budget.held
        mo.call(m.Rmdir(H(abi.Opcode.RMDIR), b"s5"))  # removed: closed at once, never pinned
        assert budget.held == held - 1 and mo.d.nodes[dirs[5]].ro is None
        assert mo.err(m.Getattr(H(abi.Opcode.GETATTR, dirs[5]), 0, 0)) == errno.ENOENT
        mo.getattr(dirs[4])
        held = budget.held
        mo.forget(dirs[4], 1)
        assert budget.held == held - 1
    finally:
        mo.close()
    assert budget.held == 0


def test_no_open_readdirplus_reads_each_entry_through_the_listed_directorys_descriptor(nomnt):
    """No-open: READDIRPLUS reads each entry's attributes through the listed directory's own
    descriptor (``fstatat`` and ``llistxattr`` beneath it: 2 system calls where a path takes
    4), with the same mapping as a GETATTR — a file's kept set-uid bit, an emulated device, a
    symlink as itself — and so answers for the inode it listed, also after the directory was
    renamed beside the mount (by path, every entry would be gone and skipped); a plain READDIR
    too (the inode and type of each)."""
    _readdirplus_through_the_directorys_descriptor(nomnt)


def test_no_open_opendir_lists_the_inode_its_node_holds_wherever_it_moved(nomnt):
    """No-open: OPENDIR lists the names through the directory node's own descriptor — the
    inode whose entries READDIRPLUS then reads beneath it — with no path resolved: after the
    host moved the directory away and made another at its name, the listing is the moved
    one's, each entry with its attributes (by path it was the newcomer's names, each then
    missing beneath the node's descriptor and skipped)."""
    os.makedirs(nomnt.host("d"))
    for name in ("a", "b"):
        open(nomnt.host("d", name), "w").close()
    d = nomnt.lookup("d").nodeid
    nomnt.getattr(d)  # the node's own descriptor, as the kernel's GETATTR before a listing takes it
    os.rename(nomnt.host("d"), nomnt.host("d2"))
    os.mkdir(nomnt.host("d"))
    open(nomnt.host("d", "c"), "w").close()
    o = nomnt.call(m.Opendir(H(abi.Opcode.OPENDIR, d), os.O_RDONLY, 0))
    data = nomnt.call(m.Readdirplus(H(abi.Opcode.READDIRPLUS, d), o.fh, 0, 4096, 0, 0, 0)).data
    got = {name: ino for ino, _off, _typ, name, _e in ref_parse_dirents(bytes(data), True)}
    assert set(got) == {b".", b"..", b"a", b"b"}
    assert got[b"a"] == os.stat(nomnt.host("d2", "a")).st_ino
    nomnt.call(m.Releasedir(H(abi.Opcode.RELEASEDIR, d), o.fh, 0, 0, 0))


@pytest.mark.skipif(os.geteuid() != 0, reason="trusted.* xattrs need CAP_SYS_ADMIN (the fallback: test_ownership.py)")
def test_readdirplus_reads_each_entry_through_the_descriptor_its_opendir_took(mnt):
    """With OPEN handles (the virtio-fs device): OPENDIR takes one descriptor of the directory
    (counted in the process's budget) that READDIRPLUS reads the entries through — the same
    answers as the no-open node's own descriptor gives — and RELEASEDIR gives it back."""
    held = mnt.d.descriptors.held
    _readdirplus_through_the_directorys_descriptor(mnt, held)
    assert mnt.d.descriptors.held == held


def test_a_listings_dotdot_is_the_inode_the_kernel_knows_as_its_parent(mnt):
    """``..`` in READDIR and READDIRPLUS is the parent directory's inode as the dispatcher knows
    its node (no host call): after the host renames the parent away under an open listing and
    makes another at its old name, ``..`` is still the directory that holds the listed one, never the newcomer a
    lookup of the old path would find. Where no node is known, the path is looked up."""
    os.makedirs(mnt.host("a", "b"))
    a = mnt.lookup("a").nodeid
    b = mnt.lookup("b", parent=a).nodeid
    parent_ino = os.stat(mnt.host("a")).st_ino
    o = mnt.call(m.Opendir(H(abi.Opcode.OPENDIR, b), os.O_RDONLY, 0))
    os.rename(mnt.host("a"), mnt.host("a2"))
    os.mkdir(mnt.host("a"))
    assert os.stat(mnt.host("a")).st_ino != parent_ino
    for plus in (True, False):
        req = (m.Readdirplus if plus else m.Readdir)(H(abi.Opcode.READDIRPLUS if plus else abi.Opcode.READDIR, b),
                                                     o.fh, 0, 4096, 0, 0, 0)
        got = {name: (ino, typ) for ino, _off, typ, name, _e in ref_parse_dirents(bytes(mnt.call(req).data), plus)}
        assert got[b".."] == (parent_ino, stat.S_IFDIR >> 12), plus
    mnt.call(m.Releasedir(H(abi.Opcode.RELEASEDIR, b), o.fh, 0, 0, 0))
    o = mnt.call(m.Opendir(H(abi.Opcode.OPENDIR, ROOT), os.O_RDONLY, 0))  # the root's ".." by path
    req = m.Readdirplus(H(abi.Opcode.READDIRPLUS, ROOT), o.fh, 0, 4096, 0, 0, 0)
    got = {name: ino for ino, _off, _typ, name, _e in ref_parse_dirents(bytes(mnt.call(req).data), True)}
    assert got[b".."] == os.stat(mnt.work).st_ino
    mnt.call(m.Releasedir(H(abi.Opcode.RELEASEDIR, ROOT), o.fh, 0, 0, 0))


def _readdirplus_through_the_directorys_descriptor(mo, held_before: int | None = None):
    d = mo.call(m.Mkdir(H(abi.Opcode.MKDIR), 0o755, 0o022, b"d")).nodeid
    open(mo.host("d", "f"), "w").close()
    os.symlink("f", mo.host("d", "l"))
    f = mo.lookup("f", parent=d).nodeid
    mo.call(m.Setattr(H(abi.Opcode.SETATTR, f), abi.FATTR_MODE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0o4755, 0, 0))
    assert not os.stat(mo.host("d", "f")).st_mode & stat.S_ISUID  # kept, not applied
    dev = os.makedev(1, 3)
    mo.call(m.Mknod(H(abi.Opcode.MKNOD, d), stat.S_IFCHR | 0o600, dev, 0o022, b"null"))
    want = {name: mo.getattr(mo.lookup(name, parent=d).nodeid) for name in ("f", "l", "null")}
    o = mo.call(m.Opendir(H(abi.Opcode.OPENDIR, d), os.O_RDONLY, 0))
    if held_before is not None:
        assert mo.d.descriptors.held == held_before + 1 and mo.d.dirs[o.fh].handle is not None
    os.rename(mo.host("d"), mo.host("moved"))
    data = bytes(mo.call(m.Readdirplus(H(abi.Opcode.READDIRPLUS, d), o.fh, 0, 4096, 0, 0, 0)).data)
    got = {name.decode(): (typ, entry[6:]) for _ino, _off, typ, name, entry in ref_parse_dirents(data, True)}
    assert sorted(got) == [".", "..", "f", "l", "null"]
    for name, a in want.items():
        typ, (ino, size, _blocks, _at, mtime, _ct, _atn, mtimensec, _ctn, mode, nlink, uid, gid, rdev, _bs,
              _fl) = got[name]
        assert (ino, size, mtime, mtimensec, mode, nlink, uid, gid, rdev) == \
            (a.ino, a.size, a.mtime, a.mtimensec, a.mode, a.nlink, a.uid, a.gid, a.rdev), name
        assert typ == stat.S_IFMT(a.mode) >> 12, name
    assert got["f"][1][9] & 0o7777 == 0o4755 and stat.S_ISLNK(got["l"][1][9])
    assert stat.S_ISCHR(got["null"][1][9]) and got["null"][1][13] == dev
    # a plain READDIR (inode and type only) looks its entries up through the same descriptor
    data = bytes(mo.call(m.Readdir(H(abi.Opcode.READDIR, d), o.fh, 0, 4096, 0, 0, 0)).data)
    plain = {name.decode(): (ino, typ) for ino, _off, typ, name, _e in ref_parse_dirents(data, False)}
    assert sorted(plain) == [".", "..", "f", "l", "null"]
    assert {n: plain[n] for n in want} == {n: (a.ino, stat.S_IFMT(a.mode) >> 12) for n, a in want.items()}
    assert plain["."][0] == os.stat(mo.host("moved")).st_ino
    mo.call(m.Releasedir(H(abi.Opcode.RELEASEDIR, d), o.fh, 0, 0, 0))


def test_no_open_a_directorys_changes_still_act_by_path_and_are_undone_exactly(tmp_path):
    """The kept descriptor only reads: a chmod, utime or xattr of a directory through the
    mount goes by path through the undo core (gate, preimage, WAL) and is undone exactly."""
    mo = Mount(tmp_path, no_open=True)
    try:
        os.mkdir(mo.host("d"))
        before = snapshot_dir(mo.work)
        d = mo.lookup("d").nodeid
        assert stat.S_ISDIR(mo.getattr(d).mode) and mo.d.nodes[d].ro is not None
        mo.call(m.Setattr(H(abi.Opcode.SETATTR, d), abi.FATTR_MODE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0o4700, 0, 0))
        mo.call(m.Setattr(H(abi.Opcode.SETATTR, d), abi.FATTR_MTIME, 0, 0, 0, 0, 1_000_000, 0, 0, 0, 0, 0, 0, 0))
        mo.call(m.Setxattr(H(abi.Opcode.SETXATTR, d), 1, 0, 0, b"user.k", b"v"))
        assert mo.getattr(d).mode & 0o7777 == 0o4700 and mo.getattr(d).mtime == 1_000_000
        assert mo.d.nodes[d].handle is None  # never a handle for changes
        mo.ws.rollback(1)
        assert_same(before, snapshot_dir(mo.work))
    finally:
        mo.close()


def test_open_directories_hold_at_most_their_bound_of_descriptors_and_list_by_path_beyond(mnt):
    """Not no-open: at most ``LISTING_DESCRIPTORS_MAX`` open directories hold a descriptor (a
    guest that never releases its OPENDIRs cannot take the descriptors OPEN needs); one
    beyond lists by path, with the same entries; RELEASEDIR gives every one back."""
    from sandbox.fuse.dispatcher import LISTING_DESCRIPTORS_MAX

    open(mnt.host("a"), "w").close()
    held = mnt.d.descriptors.held
    fhs = [mnt.call(m.Opendir(H(abi.Opcode.OPENDIR), os.O_RDONLY, 0)).fh for _ in range(LISTING_DESCRIPTORS_MAX + 2)]
    assert mnt.d.descriptors.held == held + LISTING_DESCRIPTORS_MAX
    assert [mnt.d.dirs[fh].handle is not None for fh in fhs[-3:]] == [True, False, False]
    for fh in (fhs[0], fhs[-1]):
        data = bytes(mnt.call(m.Readdirplus(H(abi.Opcode.READDIRPLUS), fh, 0, 4096, 0, 0, 0)).data)
        assert sorted(e[3] for e in ref_parse_dirents(data, True)) == [b".", b"..", b"a"]
    for fh in fhs:
        mnt.call(m.Releasedir(H(abi.Opcode.RELEASEDIR), fh, 0, 0, 0))
    assert mnt.d.descriptors.held == held and mnt.d._listing_descriptors == 0


def test_times_before_1970_travel_as_the_kernels_signed_seconds_and_are_undone_exactly(mnt):
    """``fuse_attr``'s and ``fuse_setattr_in``'s seconds are u64 on the wire but the kernel's
    ``time64_t``: a time before 1970 is their two's complement. A host file from 1960 is
    reported (its entry and attributes encode: ``ls -l`` and READDIRPLUS work), and a
    ``touch -d 1960-01-01`` through the mount sets it — undone exactly."""
    os.mknod(mnt.host("old"))
    os.utime(mnt.host("old"), ns=(-315_619_200 * 10**9 + 5, -315_619_200 * 10**9 + 7))
    before = snapshot_dir(mnt.work)
    node = mnt.lookup("old").nodeid
    a = mnt.getattr(node)
    assert (a.mtime - 2**64, a.mtimensec, a.atime - 2**64, a.atimensec) == (-315_619_200, 7, -315_619_200, 5)
    fh = mnt.call(m.Opendir(H(abi.Opcode.OPENDIR), 0, 0)).fh
    mnt.call(m.Readdirplus(H(abi.Opcode.READDIRPLUS), fh, 0, 4096, 0, 0, 0))
    sec = (-1_000_000_000) & (2**64 - 1)  # 1938
    out = mnt.call(m.Setattr(H(abi.Opcode.SETATTR, node), abi.FATTR_ATIME | abi.FATTR_MTIME, 0, 0, 0, sec, sec, 0,
                             3, 4, 0, 0, 0, 0))
    assert (out.attr.mtime, out.attr.mtimensec) == (sec, 4)
    st = os.stat(mnt.host("old"))
    assert (st.st_atime_ns, st.st_mtime_ns) == (-10**18 + 3, -10**18 + 4)
    mnt.ws.rollback(1)
    assert_same(before, snapshot_dir(mnt.work), "after undo")


def test_a_deferred_write_keeps_no_view_of_the_transports_buffer(tmp_path):
    """The /dev/fuse transport decodes each request from one reused read buffer (a WRITE's
    data is a view of it). A WRITE deferred behind a hold must not keep that view — the
    transport reads the next request into the same buffer at once (it used to give each
    deferred request a fresh 1 MiB buffer: ~1 MiB resident per request waiting, for up to
    ``held_requests_per_export_max`` of them, whatever their own size). Overwriting the
    buffer after ``submit`` changes nothing: the allowed write lands with its own bytes."""
    mo = Mount(tmp_path, safeguard=SafeguardConfig(delete_threshold=2, timeout_s=30))
    for i in range(2):
        open(mo.host(f"f{i}"), "w").close()
    c = mo.create("w")

    async def go():
        sent, settled, send = replies()

        assert [mo.d.submit(m.Unlink(H(abi.Opcode.UNLINK), f"f{i}".encode()), 64, send) for i in range(2)] == [
            False, True]  # the second delete is held: the gate is busy
        buf = bytearray(b"payload!")
        write = m.Write(H(abi.Opcode.WRITE, c.entry.nodeid), c.open.fh, 0, len(buf), 0, 0, os.O_RDWR,
                        memoryview(buf).toreadonly())
        assert mo.d.submit(write, 80 + len(buf), send) is True  # queued behind the hold
        buf[:] = b"XXXXXXXX"  # the transport's next read
        gate = mo.export.gate
        while gate.pending is None:
            await asyncio.sleep(0)  # the held task registers its hold on its first turn
        assert mo.holds.answer(gate.pending.id, "allow")
        while write.header.unique not in sent:
            settled.clear()
            await settled.wait()
        assert sent[write.header.unique] == (m.WriteOut(8), None)

    try:
        asyncio.run(go())
        with open(mo.host("w"), "rb") as f:
            assert f.read() == b"payload!"
    finally:
        mo.close()


def test_readdirplus_at_the_node_limit_answers_the_entries_it_could_and_counts_only_those(tmp_path):
    """With the node table full, READDIRPLUS answers the entries it has nodes for (a short
    listing: the kernel asks again from the next offset) — not ENFILE after counting a
    lookup for entries the kernel never received (those nodes could never be forgotten, and
    the table stayed full for good). Once the kernel forgets them, the rest are listed."""
    mo = Mount(tmp_path, limits=ServerLimits(fids_per_connection_max=4))
    try:
        for name in "abcdef":
            open(mo.host(name), "w").close()
        fh = mo.call(m.Opendir(H(abi.Opcode.OPENDIR), os.O_RDONLY, 0)).fh
        got = ref_parse_dirents(bytes(mo.call(m.Readdirplus(H(abi.Opcode.READDIRPLUS), fh, 0, 65536, 0, 0, 0)).data),
                                True)
        entries = [(name, entry[0]) for _ino, _off, _typ, name, entry in got if name not in (b".", b"..")]
        assert [name for name, _ in entries] == [b"a", b"b", b"c"]  # the root and three nodes: the limit
        assert sorted(n.lookups for n in mo.d.nodes.values() if n.nodeid != ROOT) == [1, 1, 1]
        for _name, nodeid in entries:
            mo.forget(nodeid, 1)
        assert list(mo.d.nodes) == [ROOT]
        got = ref_parse_dirents(bytes(mo.call(m.Readdirplus(H(abi.Opcode.READDIRPLUS), fh, got[-1][1], 65536, 0, 0,
                                                            0)).data), True)
        assert [name for _ino, _off, _typ, name, _e in got] == [b"d", b"e", b"f"]
    finally:
        mo.close()


def test_opendir_reads_a_directory_only_up_to_the_listing_budget_left():
    """A directory whose listing would pass what is left of ``dir_listing_bytes_per_connection_max``
    is ``ENOMEM`` at OPENDIR, as before — and the host stopped reading it at that bound (the
    in-memory host counts the names it read: one past the bound, never the rest). What is
    left is the budget less the listings held: a listing that fits alone is refused while
    two others are held, and opens once one is released."""
    big = [f"f{i:04d}" for i in range(2000)]
    small = [f"f{i:02d}" for i in range(20)]
    tree = memory_tree({f"big/{n}": b"" for n in big} | {f"small/{n}": b"" for n in small})
    limits = ServerLimits(dir_listing_bytes_per_connection_max=4096)
    d = Dispatcher(Export(tree, HoldBroker(), limits), limits)
    d.handle(m.Init(H(abi.Opcode.INIT), 7, 38, 1 << 17, 0xFFFFFFFF & ~abi.FUSE_INIT_RESERVED, 0xFFFFFFFF))
    dots = listing_cost([".", ".."])

    def opendir(name: str):
        node = d.handle(m.Lookup(H(abi.Opcode.LOOKUP), name.encode())).nodeid
        before = tree.host.entries_read
        try:
            return d.handle(m.Opendir(H(abi.Opcode.OPENDIR, node), os.O_RDONLY, 0)).fh, node
        except OSError as e:
            assert e.errno == errno.ENOMEM
            return None, tree.host.entries_read - before

    fh, read = opendir("big")
    assert fh is None and read == (4096 - dots) // (5 + DIR_ENTRY_OVERHEAD_BYTES) + 1 < len(big)
    assert d.listing_bytes == 0
    held = [opendir("small") for _ in range(2)]
    assert all(fh is not None for fh, _ in held)
    assert d.listing_bytes == 2 * listing_cost([".", ".."] + small) > 4096 - listing_cost([".", ".."] + small)
    fh, read = opendir("small")
    assert fh is None and read == (4096 - d.listing_bytes - dots) // (3 + DIR_ENTRY_OVERHEAD_BYTES) + 1 < len(small)
    fh, node = held.pop()
    d.handle(m.Releasedir(H(abi.Opcode.RELEASEDIR, node), fh, 0, 0, 0))
    fh, _node = opendir("small")
    assert fh is not None and d.listing_bytes == 2 * listing_cost([".", ".."] + small)
    d.close()


def test_opendir_of_a_real_directory_over_the_listing_budget_is_enomem_and_holds_nothing(tmp_path):
    """The same on a real folder (its listing read through the directory's descriptor, bounded):
    ``ENOMEM``, nothing held afterwards — no listing bytes, no descriptor — and a directory that
    fits still opens and lists whole."""
    limits = ServerLimits(dir_listing_bytes_per_connection_max=4096)
    mo = Mount(tmp_path, limits)
    try:
        os.mkdir(mo.host("big"))
        for i in range(2000):
            open(mo.host("big", f"f{i:04d}"), "w").close()
        os.mkdir(mo.host("small"))
        open(mo.host("small", "x"), "w").close()
        big = mo.lookup("big").nodeid
        assert mo.err(m.Opendir(H(abi.Opcode.OPENDIR, big), os.O_RDONLY, 0)) == errno.ENOMEM
        assert mo.d.listing_bytes == 0 and mo.d._listing_descriptors == 0
        small = mo.lookup("small").nodeid
        o = mo.call(m.Opendir(H(abi.Opcode.OPENDIR, small), os.O_RDONLY, 0))
        assert mo.d.listing_bytes == listing_cost([".", "..", "x"])
        entries = ref_parse_dirents(bytes(mo.call(m.Readdir(H(abi.Opcode.READDIR, small), o.fh, 0, 4096, 0, 0, 0)).data), False)
        assert [e[3] for e in entries] == [b".", b"..", b"x"]
    finally:
        mo.close()
