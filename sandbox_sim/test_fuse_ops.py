"""FALLOCATE, COPY_FILE_RANGE, LSEEK and RENAME2's RENAME_EXCHANGE through the FUSE
dispatcher (no kernel), onto a real folder under an intercepted workspace: each reply, the
host, the nodes and handles afterwards, the hold gate, and the undo of every change.
"""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from sandbox.core.safeguard import SafeguardConfig
from sandbox.core.workspace import Workspace
from sandbox.fuse import abi
from sandbox.fuse import messages as m
from sandbox.mounts.provider import COPY_FILE_RANGE_BYTES_MAX
from sandbox_sim.oracle import assert_same, snapshot_dir
from sandbox_sim.test_fuse_dispatcher import ROOT, H, Mount, replies

pytestmark = pytest.mark.timeout(60)
DATA = bytes(range(1, 256)) * 64  # no zeros
NOBODY = 65534


@pytest.fixture
def mnt(tmp_path):
    work = tmp_path / "work"
    (work / "d" / "sub").mkdir(parents=True)
    (work / "big").write_bytes(DATA)
    (work / "small").write_bytes(b"small file")
    (work / "d" / "sub" / "leaf").write_bytes(b"leaf")
    mo = Mount(tmp_path)
    mo.before = snapshot_dir(mo.work)
    yield mo
    mo.close()


def _open(mnt, name: str, flags: int = os.O_RDWR, parent: int = ROOT) -> tuple[int, int]:
    node = mnt.lookup(name, parent).nodeid
    return node, mnt.call(m.Open(H(abi.Opcode.OPEN, node), flags, 0)).fh


def _undo_all(mnt) -> None:
    mnt.d.close()
    mnt.ws.close()
    ws = Workspace.open(mnt.work, state_dir=os.path.join(os.path.dirname(mnt.work), "state"))
    try:
        assert ws.history(), "nothing was journalled"
        ws.rollback(len(ws.history()))
    finally:
        ws.close()
    assert_same(mnt.before, snapshot_dir(mnt.work), "after undo")
    mnt.d.close = mnt.ws.close = lambda: None


@pytest.mark.parametrize("mode, size, head", [
    (0, 40_000, DATA[:16]),
    (abi.FALLOC_FL_KEEP_SIZE, len(DATA), DATA[:16]),
    (abi.FALLOC_FL_PUNCH_HOLE | abi.FALLOC_FL_KEEP_SIZE, len(DATA), DATA[:8] + b"\0" * 8),
    (abi.FALLOC_FL_ZERO_RANGE, 40_000, DATA[:8] + b"\0" * 8),
], ids=["plain", "keep-size", "punch-hole", "zero-range"])
def test_fallocate_each_mode_then_undo(mnt, mode, size, head):
    node, fh = _open(mnt, "big")
    assert mnt.call(m.Fallocate(H(abi.Opcode.FALLOCATE, node), fh, 8, 40_000 - 8, mode)) is None
    with open(mnt.host("big"), "rb") as f:
        got = f.read()
    assert (len(got), got[:16]) == (size, head)
    assert mnt.getattr(node).size == size
    mnt.release(node, fh)
    _undo_all(mnt)


@pytest.mark.parametrize("mode", [0x08, 0x20, 0x40, abi.FALLOC_FL_PUNCH_HOLE],
                         ids=["COLLAPSE_RANGE", "INSERT_RANGE", "UNSHARE_RANGE", "PUNCH_HOLE-without-KEEP_SIZE"])
def test_other_fallocate_modes_are_eopnotsupp(mnt, mode):
    node, fh = _open(mnt, "big")
    assert mnt.err(m.Fallocate(H(abi.Opcode.FALLOCATE, node), fh, 0, 4096, mode)) == errno.EOPNOTSUPP
    assert snapshot_dir(mnt.work) == mnt.before and mnt.ws.history() == []


def test_fallocate_needs_a_writable_handle(mnt):
    node, fh = _open(mnt, "big", os.O_RDONLY)
    assert mnt.err(m.Fallocate(H(abi.Opcode.FALLOCATE, node), fh, 0, 10, 0)) == errno.EBADF
    assert mnt.err(m.Fallocate(H(abi.Opcode.FALLOCATE, node), 999, 0, 10, 0)) == errno.EBADF
    assert mnt.err(m.Fallocate(H(abi.Opcode.FALLOCATE, node), fh, 1 << 63, 10, 0)) == errno.EFBIG


def test_copy_file_range_then_undo(mnt):
    s, sfh = _open(mnt, "big", os.O_RDONLY)
    d, dfh = _open(mnt, "small")
    out = mnt.call(m.CopyFileRange(H(abi.Opcode.COPY_FILE_RANGE, s), sfh, 100, d, dfh, 5, 1 << 40, 0))
    assert out.size == len(DATA) - 100  # clamped to the source's end
    with open(mnt.host("small"), "rb") as f:
        assert f.read() == b"small" + DATA[100:]
    assert mnt.getattr(d).size == 5 + len(DATA) - 100
    assert mnt.err(m.CopyFileRange(H(abi.Opcode.COPY_FILE_RANGE, s), sfh, 0, s, dfh, 0, 5, 0)) == errno.EINVAL
    assert mnt.err(m.CopyFileRange(H(abi.Opcode.COPY_FILE_RANGE, s), sfh, 0, d, dfh, 0, 5, 1)) == errno.EINVAL
    assert mnt.err(m.CopyFileRange(H(abi.Opcode.COPY_FILE_RANGE, s), dfh, 0, s, sfh, 0, 5, 0)) == errno.EBADF
    mnt.release(s, sfh)
    mnt.release(d, dfh)
    assert COPY_FILE_RANGE_BYTES_MAX < 1 << 32  # the reply's size is a u32
    _undo_all(mnt)


def test_fallocate_and_copy_by_another_uid_clear_setid_bits(mnt):
    s, sfh = _open(mnt, "big")
    out = mnt.call(m.Setattr(H(abi.Opcode.SETATTR, s), abi.FATTR_MODE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0o6777, 0, 0))
    assert out.attr.mode & 0o7777 == 0o6777
    mnt.call(m.Fallocate(H(abi.Opcode.FALLOCATE, s, uid=NOBODY, gid=NOBODY), sfh, 0, 10, abi.FALLOC_FL_ZERO_RANGE))
    assert mnt.getattr(s).mode & 0o7777 == 0o777
    d, dfh = _open(mnt, "small")
    mnt.call(m.Setattr(H(abi.Opcode.SETATTR, d), abi.FATTR_MODE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0o4755, 0, 0))
    mnt.call(m.CopyFileRange(H(abi.Opcode.COPY_FILE_RANGE, s, uid=NOBODY, gid=NOBODY), sfh, 0, d, dfh, 0, 3, 0))
    assert mnt.getattr(d).mode & 0o7777 == 0o755


def test_lseek_data_and_hole(mnt):
    node, fh = _open(mnt, "big", os.O_RDONLY)
    assert mnt.call(m.Lseek(H(abi.Opcode.LSEEK, node), fh, 0, os.SEEK_DATA)).offset == 0
    assert mnt.call(m.Lseek(H(abi.Opcode.LSEEK, node), fh, 10, os.SEEK_HOLE)).offset == len(DATA)
    assert mnt.err(m.Lseek(H(abi.Opcode.LSEEK, node), fh, len(DATA), os.SEEK_DATA)) == errno.ENXIO
    assert mnt.err(m.Lseek(H(abi.Opcode.LSEEK, node), fh, 1 << 63, os.SEEK_HOLE)) == errno.ENXIO
    assert mnt.err(m.Lseek(H(abi.Opcode.LSEEK, node), fh, 0, os.SEEK_SET)) == errno.EINVAL
    w, wfh = _open(mnt, "small")
    mnt.call(m.Fallocate(H(abi.Opcode.FALLOCATE, w), wfh, 0, 1 << 20, 0))  # 1 MiB, mostly unwritten
    hole = mnt.call(m.Lseek(H(abi.Opcode.LSEEK, w), wfh, 0, os.SEEK_HOLE)).offset
    fd = os.open(mnt.host("small"), os.O_RDONLY)
    try:
        assert hole == os.lseek(fd, 0, os.SEEK_HOLE)  # the host's own answer
    finally:
        os.close(fd)


def test_exchange_a_file_and_a_directory_moves_nodes_and_handles(mnt):
    f, fh = _open(mnt, "big")
    d = mnt.lookup("d").nodeid
    leaf, lfh = _open(mnt, "leaf", parent=mnt.lookup("sub", d).nodeid)
    mnt.call(m.Rename2(H(abi.Opcode.RENAME2), ROOT, abi.RENAME_EXCHANGE, b"big", b"d"))
    assert os.path.isdir(mnt.host("big")) and os.path.isfile(mnt.host("d"))
    assert mnt.d.nodes[f].path == "d" and mnt.d.nodes[d].path == "big"
    assert mnt.d.nodes[leaf].path == "big/sub/leaf"
    assert mnt.lookup("d").nodeid == f and mnt.lookup("big").nodeid == d
    mnt.write(leaf, lfh, b"LEAF")  # a handle follows its file
    with open(mnt.host("big", "sub", "leaf"), "rb") as fo:
        assert fo.read() == b"LEAF"
    assert mnt.getattr(f).size == len(DATA)
    assert mnt.err(m.Rename2(H(abi.Opcode.RENAME2), ROOT, abi.RENAME_EXCHANGE, b"big", b"missing")) == errno.ENOENT
    both = abi.RENAME_EXCHANGE | abi.RENAME_NOREPLACE
    assert mnt.err(m.Rename2(H(abi.Opcode.RENAME2), ROOT, both, b"big", b"d")) == errno.EINVAL
    assert mnt.err(m.Rename2(H(abi.Opcode.RENAME2), d, abi.RENAME_EXCHANGE, b"sub", b"missing")) == errno.ENOENT
    mnt.release(f, fh)
    mnt.release(leaf, lfh)
    _undo_all(mnt)


def test_exchange_across_directories_then_undo(mnt):
    d = mnt.lookup("d").nodeid
    sub = mnt.lookup("sub", d).nodeid
    mnt.call(m.Rename2(H(abi.Opcode.RENAME2, sub), ROOT, abi.RENAME_EXCHANGE, b"leaf", b"small"))
    with open(mnt.host("small"), "rb") as fo:
        assert fo.read() == b"leaf"
    mnt.call(m.Rename2(H(abi.Opcode.RENAME2, d), ROOT, abi.RENAME_EXCHANGE, b"sub", b"small"))
    assert os.path.isdir(mnt.host("small")) and os.path.isfile(mnt.host("d", "sub"))
    with open(mnt.host("small", "leaf"), "rb") as fo:
        assert fo.read() == b"small file"
    assert mnt.d.nodes[sub].path == "small"
    _undo_all(mnt)


def test_the_new_mutations_pass_the_hold_gate(tmp_path):
    """A safeguard hold pending on the export holds FALLOCATE, COPY_FILE_RANGE and the
    exchange too (they are mutations); LSEEK (a read) flows. Allowing releases them."""
    work = tmp_path / "work"
    work.mkdir()
    for i in range(2):
        (work / f"f{i}").write_bytes(b"x")
    (work / "big").write_bytes(DATA)
    mo = Mount(tmp_path, safeguard=SafeguardConfig(delete_threshold=1, timeout_s=30))
    node, fh = _open(mo, "big")

    async def go():
        sent, settled, send = replies()

        held = [m.Unlink(H(abi.Opcode.UNLINK), b"f0"),
                m.Fallocate(H(abi.Opcode.FALLOCATE, node), fh, 0, 100_000, 0),
                m.CopyFileRange(H(abi.Opcode.COPY_FILE_RANGE, node), fh, 0, node, fh, 20_000, 10, 0),
                m.Rename2(H(abi.Opcode.RENAME2), ROOT, abi.RENAME_EXCHANGE, b"f1", b"big")]
        deferred = [mo.d.submit(r, 64, send) for r in held]
        assert deferred == [True, True, True, True]
        seek = m.Lseek(H(abi.Opcode.LSEEK, node), fh, 0, os.SEEK_HOLE)
        assert mo.d.submit(seek, 64, send) is False and sent[seek.header.unique] == (m.LseekOut(len(DATA)), None)
        assert os.path.getsize(work / "big") == len(DATA) and (work / "f0").exists()
        gate = mo.export.gate
        while gate.pending is None:
            await asyncio.sleep(0)
        assert mo.holds.answer(gate.pending.id, "allow")
        while len(sent) < 5:
            settled.clear()
            await settled.wait()
        assert all(sent[r.header.unique][1] is None for r in held), [sent[r.header.unique] for r in held]

    try:
        asyncio.run(go())
        assert not (work / "f0").exists()
        assert os.path.getsize(work / "f1") == 100_000 and (work / "big").read_bytes() == b"x"
    finally:
        mo.release(node, fh)
        mo.close()
