"""A writable in-memory mount (``memory_tree(..., writable=True)``) served to an untrusted
guest has a byte budget: what the guest adds — file bytes, names, inodes, xattrs, symlink
targets — stays within ``WRITABLE_TREE_SPARE_BYTES`` beyond the injected files
(``ENOSPC`` past it), and what it removes is given back (a file's bytes when its inode is
gone: no name and no open handle). Driven through the FUSE dispatcher, as the guest would.
"""

from __future__ import annotations

import errno
import gc
import os
import stat

import pytest

from sandbox.fuse import abi
from sandbox.fuse import messages as m
from sandbox.fuse.dispatcher import Dispatcher
from sandbox.limits import ServerLimits
from sandbox.mounts.memory import WRITABLE_TREE_SPARE_BYTES, memory_tree
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
