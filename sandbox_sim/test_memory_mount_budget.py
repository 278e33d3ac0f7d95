"""In-memory mounts served to an untrusted guest hold bounded host memory. A writable
memory tree (``memory_tree(..., writable=True)``) has a byte budget: what the guest adds —
file bytes, names, inodes, xattrs, symlink targets — stays within
``WRITABLE_TREE_SPARE_BYTES`` beyond the injected files (``ENOSPC`` past it), and what it
removes is given back (a file's bytes when its inode is gone: no name and no open handle).
A live VFS mount's open handles share the bytes they read and hold at most
``VFS_HANDLE_BYTES_MAX``. Driven through the FUSE dispatcher, as the guest would.
"""

from __future__ import annotations

import errno
import gc
import os
import stat
import tracemalloc

import pytest

from sandbox.fuse import abi
from sandbox.fuse import messages as m
from sandbox.fuse.dispatcher import Dispatcher
from sandbox.limits import ServerLimits
from sandbox.mounts.memory import WRITABLE_TREE_SPARE_BYTES, memory_tree
from sandbox.mounts.vfs import VFS_HANDLE_BYTES_MAX, vfs_tree
from sandbox.serving import Export, HoldBroker
from sandbox_sim.test_fuse_dispatcher import H

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


@pytest.fixture
def d():
    provider = memory_tree({"given/big": b"x" * (3 * MiB)}, writable=True)
    disp = Dispatcher(Export(provider, HoldBroker(), ServerLimits()), ServerLimits())
    disp.handle(m.Init(H(abi.Opcode.INIT), 7, 38, 1 << 17, 0xFFFFFFFF & ~abi.FUSE_INIT_RESERVED, 0xFFFFFFFF))
    yield disp
    disp.close()
    provider.close()


def _create(d, name: bytes) -> m.CreateOut:
    return d.handle(m.Create(H(abi.Opcode.CREATE), os.O_RDWR | os.O_CREAT, 0o644, 0o022, 0, name))


def _grow(d, c: m.CreateOut, size: int) -> None:
    d.handle(m.Setattr(H(abi.Opcode.SETATTR, c.entry.nodeid), abi.FATTR_SIZE | abi.FATTR_FH, c.open.fh, size,
                       0, 0, 0, 0, 0, 0, 0, 0, 0, 0))


def _errno(fn) -> int:
    with pytest.raises(OSError) as e:
        fn()
    return e.value.errno


def test_a_guest_cannot_grow_a_writable_memory_mount_past_its_budget(d):
    c = _create(d, b"f")
    assert _errno(lambda: _grow(d, c, 1 << 40)) == errno.ENOSPC  # one truncate of a TiB: refused, nothing allocated
    assert _errno(lambda: _grow(d, c, WRITABLE_TREE_SPARE_BYTES + 1)) == errno.ENOSPC
    _grow(d, c, WRITABLE_TREE_SPARE_BYTES // 2)
    w = m.Write(H(abi.Opcode.WRITE, c.entry.nodeid), c.open.fh, WRITABLE_TREE_SPARE_BYTES, 4, 0, 0, os.O_RDWR, b"abcd")
    assert _errno(lambda: d.handle(w)) == errno.ENOSPC  # a write past the end: its zero fill counts
    made = 0
    while True:  # inodes, names and targets count too: a guest cannot make entries for ever
        try:
            e = d.handle(m.Symlink(H(abi.Opcode.SYMLINK), b"s%07d" % made, b"t" * 4000))
        except OSError as e:
            assert e.errno == errno.ENOSPC
            break
        d.handle(m.Forget(H(abi.Opcode.FORGET, e.nodeid), 1))  # the kernel's node table stays small
        made += 1
        assert made < WRITABLE_TREE_SPARE_BYTES // 4000
    assert made > WRITABLE_TREE_SPARE_BYTES // 2 // 5000
    for i in range(10):  # what is left holds fewer than ten more fifos
        try:
            e = d.handle(m.Mknod(H(abi.Opcode.MKNOD), stat.S_IFIFO | 0o644, 0, 0, b"n%d" % i + b"n" * 200))
        except OSError as e:
            assert e.errno == errno.ENOSPC
            break
        d.handle(m.Forget(H(abi.Opcode.FORGET, e.nodeid), 1))
    else:
        pytest.fail("ten fifos made in less room than one symlink takes")
    value = b"v" * 60000
    assert _errno(lambda: d.handle(m.Setxattr(H(abi.Opcode.SETXATTR, c.entry.nodeid), len(value), 0, 0, b"user.a",
                                              value))) == errno.ENOSPC


def test_what_the_guest_removes_is_given_back_once_its_inode_is_gone(d):
    c = _create(d, b"f")
    _grow(d, c, WRITABLE_TREE_SPARE_BYTES * 3 // 4)
    d.handle(m.Unlink(H(abi.Opcode.UNLINK), b"f"))
    g = _create(d, b"g")
    # f is unlinked but still open (as a program may hold it): its bytes still count
    assert _errno(lambda: _grow(d, g, WRITABLE_TREE_SPARE_BYTES // 2)) == errno.ENOSPC
    d.handle(m.Release(H(abi.Opcode.RELEASE, c.entry.nodeid), c.open.fh, 0, 0, 0))
    d.handle(m.Forget(H(abi.Opcode.FORGET, c.entry.nodeid), 1))
    gc.collect()
    _grow(d, g, WRITABLE_TREE_SPARE_BYTES // 2)  # f's inode is gone: room again
    _grow(d, g, 0)
    for _ in range(3):  # create, fill, delete, again: never runs out
        h = _create(d, b"h")
        _grow(d, h, WRITABLE_TREE_SPARE_BYTES * 3 // 4)
        d.handle(m.Release(H(abi.Opcode.RELEASE, h.entry.nodeid), h.open.fh, 0, 0, 0))
        d.handle(m.Unlink(H(abi.Opcode.UNLINK), b"h"))
        d.handle(m.Forget(H(abi.Opcode.FORGET, h.entry.nodeid), 1))
        gc.collect()


def test_a_read_only_memory_mount_and_the_simulated_disk_have_no_budget():
    provider = memory_tree({"a": b"1"})
    try:
        assert provider.host.bytes_max is None
    finally:
        provider.close()


class _OneBigFile:
    """A VFS of one file, ``size`` bytes; ``fresh``: each read makes new bytes (generated
    content), else the same object every time (a dict-backed tree)."""

    def __init__(self, size: int, fresh: bool = False):
        self.size, self.fresh = size, fresh
        self.data = b"x" * size
        self.written: dict[str, bytes] = {}

    def list(self, path):
        return ["big"]

    def stat(self, path):
        if path == "":
            return {"type": "dir"}
        if path != "big":
            raise FileNotFoundError(path)
        return {"type": "file", "size": self.size}

    def read(self, path):
        return bytes(bytearray(self.data)) if self.fresh else self.data

    def write(self, path, data):
        self.written[path] = data


def _vfs_dispatcher(vfs, writable: bool) -> Dispatcher:
    provider = vfs_tree(vfs, writable=writable)
    disp = Dispatcher(Export(provider, HoldBroker(), ServerLimits()), ServerLimits())
    disp.handle(m.Init(H(abi.Opcode.INIT), 7, 38, 1 << 17, 0xFFFFFFFF & ~abi.FUSE_INIT_RESERVED, 0xFFFFFFFF))
    return disp


def test_open_handles_of_a_vfs_file_share_its_bytes_and_are_bounded():
    """One open of a VFS file holds its whole content (a reader sees one version). Handles
    that read the same bytes object share it — 48 readers of an 8 MiB file hold 8 MiB, not
    48 copies (each open used to copy it into a bytearray) — and what all handles of a mount
    hold, each distinct content once, is at most ``VFS_HANDLE_BYTES_MAX``: an open past it is
    ``ENOMEM``; a handle's private copy is made at its first write, and counted."""
    size = 8 * MiB
    d = _vfs_dispatcher(_OneBigFile(size), writable=True)
    try:
        node = d.handle(m.Lookup(H(abi.Opcode.LOOKUP), b"big")).nodeid
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(48):
                d.handle(m.Open(H(abi.Opcode.OPEN, node), os.O_RDONLY, 0))
            assert tracemalloc.get_traced_memory()[0] - before < size
        finally:
            tracemalloc.stop()
        writers = []
        for _ in range(VFS_HANDLE_BYTES_MAX // size):
            fh = d.handle(m.Open(H(abi.Opcode.OPEN, node), os.O_RDWR, 0)).fh
            try:
                d.handle(m.Write(H(abi.Opcode.WRITE, node), fh, 0, 1, 0, 0, os.O_RDWR, b"y"))
            except OSError as e:
                assert e.errno == errno.ENOMEM
                break
            writers.append(fh)
        else:
            pytest.fail(f"{VFS_HANDLE_BYTES_MAX // size} private copies of {size} bytes fit")
        for fh in writers:
            d.handle(m.Release(H(abi.Opcode.RELEASE, node), fh, 0, 0, 0))
        fh = d.handle(m.Open(H(abi.Opcode.OPEN, node), os.O_RDWR, 0)).fh  # room again
        d.handle(m.Write(H(abi.Opcode.WRITE, node), fh, 0, 1, 0, 0, os.O_RDWR, b"y"))
    finally:
        d.close()


def test_opens_of_generated_vfs_content_are_bounded():
    size = 8 * MiB
    d = _vfs_dispatcher(_OneBigFile(size, fresh=True), writable=False)
    try:
        node = d.handle(m.Lookup(H(abi.Opcode.LOOKUP), b"big")).nodeid
        opened = 0
        with pytest.raises(OSError) as e:
            while opened <= VFS_HANDLE_BYTES_MAX // size:
                d.handle(m.Open(H(abi.Opcode.OPEN, node), os.O_RDONLY, 0))
                opened += 1
        assert e.value.errno == errno.ENOMEM and opened == VFS_HANDLE_BYTES_MAX // size
    finally:
        d.close()
