"""Reflink (FICLONE) preimages, on a real XFS filesystem and on a disk without reflinks.

``UndoLog.capture_content`` stores the preimage of a regular file of at least
``REFLINK_MIN_BYTES`` (64 KiB) as a reflink of the file when the working folder and the
undo store share a filesystem that can clone extents: the journal record then says
``"enc": "raw"`` and the blob costs no data blocks. Everywhere else it falls back to
zstd (``"enc": "zstd"``).

* The XFS tests (``@pytest.mark.e2e``) build a sparse 512 MiB image (``mkfs.xfs -m
  reflink=1``; xfsprogs >= 5.19 refuses anything under 300 MB), attach it with
  ``losetup`` and mount it on a temp mountpoint; the working folder and the state dir
  both live on it. They skip, saying why, when mkfs.xfs is missing, when we are not
  root, or when losetup/mount fail (e.g. no loop devices in a container).
* The fallback test runs on the normal temp dir (ext4 here, no reflink).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import shutil
import struct
import subprocess

import pytest

from sandbox import Workspace
from sandbox.core.store import REFLINK_MIN_BYTES
from sandbox.hostfs.real import RealHostFS
from sandbox_sim.oracle import assert_same, snapshot

FICLONE = 0x40049409
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_SHARED = 0x2000
MiB = 1 << 20
IMAGE_BYTES = 512 * MiB  # sparse: costs only what XFS writes


# --------------------------------------------------------------------------- helpers


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def xfs_mount(tmp_path_factory):
    """A freshly made reflink-capable XFS, loop-mounted; unmounted and detached after."""
    mkfs = shutil.which("mkfs.xfs")
    if mkfs is None:
        pytest.skip("mkfs.xfs not found: install xfsprogs (apt-get install -y xfsprogs)")
    if os.geteuid() != 0:
        pytest.skip("not root: attaching a loop device and mounting need root (CAP_SYS_ADMIN)")
    for tool in ("losetup", "mount", "umount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found")
    base = tmp_path_factory.mktemp("xfs")
    image, mnt = str(base / "xfs.img"), str(base / "mnt")
    os.mkdir(mnt)
    with open(image, "wb") as f:
        f.truncate(IMAGE_BYTES)
    r = _run([mkfs, "-q", "-m", "reflink=1", image])
    if r.returncode != 0:
        pytest.skip(f"mkfs.xfs -m reflink=1 failed (rc={r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    r = _run(["losetup", "--find", "--show", image])
    if r.returncode != 0:
        pytest.skip(f"losetup could not attach a loop device (rc={r.returncode}): {r.stderr.strip()}")
    dev = r.stdout.strip()
    mounted = False
    try:
        r = _run(["mount", "-t", "xfs", dev, mnt])
        if r.returncode != 0:
            pytest.skip(f"mounting the XFS loop device {dev} failed (rc={r.returncode}): {r.stderr.strip()}")
        mounted = True
        yield mnt
    finally:
        problems = []
        if mounted:
            r = _run(["umount", mnt])
            if r.returncode != 0:
                problems.append(f"umount {mnt}: {r.stderr.strip()}")
                _run(["umount", "-l", mnt])
        r = _run(["losetup", "-d", dev])
        if r.returncode != 0:
            problems.append(f"losetup -d {dev}: {r.stderr.strip()}")
        assert not problems, "; ".join(problems)


def _fiemap(path: str, max_extents: int = 256) -> list[tuple[int, int, int, int]]:
    """(logical, physical, length, flags) of every extent of ``path`` (FS_IOC_FIEMAP)."""
    head = struct.Struct("=QQIIII")
    ext = struct.Struct("=QQQQQIIII")
    buf = bytearray(head.size + max_extents * ext.size)
    head.pack_into(buf, 0, 0, (1 << 64) - 1, FIEMAP_FLAG_SYNC, 0, max_extents, 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
    finally:
        os.close(fd)
    mapped = head.unpack_from(buf, 0)[3]
    out = []
    for i in range(mapped):
        logical, physical, length, _, _, flags, _, _, _ = ext.unpack_from(buf, head.size + i * ext.size)
        out.append((logical, physical, length, flags))
    return out


def _reflink_works(directory: str) -> bool:
    """Can two files in ``directory`` share extents (FICLONE)?"""
    src, dst = os.path.join(directory, ".reflink-probe-src"), os.path.join(directory, ".reflink-probe-dst")
    try:
        with open(src, "wb") as f:
            f.write(os.urandom(REFLINK_MIN_BYTES))
        with open(src, "rb") as s, open(dst, "wb") as d:
            try:
                fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
                return True
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.ENOSYS):
                    return False
                raise
    finally:
        for p in (src, dst):
            if os.path.exists(p):
                os.unlink(p)


def _records(journal: str, path: str) -> list[dict]:
    """Parsed journal records (header skipped) that name ``path``."""
    with open(journal, "rb") as f:
        lines = f.read().decode("ascii").splitlines()
    return [r for r in map(json.loads, lines[1:]) if r.get("path") == path]


def _raw_line(journal: str, path: str) -> str:
    with open(journal, "rb") as f:
        (line,) = [ln for ln in f.read().decode("ascii").splitlines() if f'"path":{json.dumps(path)}' in ln]
    return line


def _make_work(root: str) -> tuple[str, str, bytes, bytes]:
    """A working folder with a 1 MiB file and a small one; returns (work, state, big, small)."""
    work, state = os.path.join(root, "work"), os.path.join(root, "state")
    os.mkdir(work)
    big, small = os.urandom(MiB), os.urandom(10_000)
    for name, data, mode in (("big.bin", big, 0o640), ("small.bin", small, 0o600)):
        p = os.path.join(work, name)
        with open(p, "wb") as f:
            f.write(data)
        os.chmod(p, mode)
        os.utime(p, ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    os.utime(work, ns=(1_600_000_001_000_000_001, 1_600_000_001_000_000_001))
    return work, state, big, small


def _snap(work: str):
    fs = RealHostFS(work)
    try:
        return snapshot(fs)
    finally:
        fs.close()


def _overwrite_step_then_rollback(work: str, state: str, big: bytes) -> tuple[dict, dict]:
    """Overwrite big.bin (O_TRUNC + write) and small.bin in one step, check the WAL while
    the step is open, roll back, require the exact old tree. Returns the two records."""
    before = _snap(work)
    ws = Workspace.open(work, state_dir=state)
    try:
        with ws.step("overwrite big.bin"):
            ws.fs.write_file("big.bin", os.urandom(MiB))
            ws.fs.write_file("small.bin", b"small now")
            wal = os.path.join(state, "wal", "in_progress", "journal.jsonl")
            (rec_wal,) = _records(wal, "big.bin")
            if "blob" in rec_wal:  # the preimage is durable before the mutation, in the WAL
                with open(os.path.join(state, "wal", "in_progress", rec_wal["blob"]), "rb") as f:
                    blob = f.read()
                if rec_wal["enc"] == "raw":
                    assert blob == big, "the raw (reflinked) preimage blob is not the old content"
        (journal,) = glob.glob(os.path.join(state, "steps", "*", "journal.jsonl"))
        (rec,) = _records(journal, "big.bin")
        (rec_small,) = _records(journal, "small.bin")
        assert rec == rec_wal
        assert rec["size"] == MiB
        if rec["enc"] == "raw":
            assert '"enc":"raw"' in _raw_line(journal, "big.bin")
        with open(os.path.join(work, "big.bin"), "rb") as f:
            assert f.read() != big
        ws.rollback(1)
        assert_same(before, _snap(work), "tree after rollback(1)")
        with open(os.path.join(work, "big.bin"), "rb") as f:
            assert f.read() == big
    finally:
        ws.close()
    return rec, rec_small


# --------------------------------------------------------------------------- XFS


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_xfs_overwrite_preimage_is_a_reflink(xfs_mount):
    root = os.path.join(xfs_mount, "overwrite")
    os.mkdir(root)
    assert _reflink_works(root), "the fresh XFS made with -m reflink=1 refuses FICLONE"
    work, state, big, _ = _make_work(root)
    rec, rec_small = _overwrite_step_then_rollback(work, state, big)
    assert rec["enc"] == "raw", f"expected a reflinked preimage on XFS, got {rec}"
    assert rec["stored"] == MiB and "blob" in rec and "data" not in rec
    # under REFLINK_MIN_BYTES the preimage is compressed even where reflinks work
    assert rec_small["enc"] == "zstd", rec_small


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_xfs_reflinked_blob_shares_extents_with_the_file(xfs_mount):
    """An append keeps the file's old extents, so the preimage blob must still share them
    with it (FIEMAP_EXTENT_SHARED): proof of a clone, not of a copy that calls itself raw."""
    root = os.path.join(xfs_mount, "append")
    os.mkdir(root)
    work, state, big, _ = _make_work(root)
    before = _snap(work)
    ws = Workspace.open(work, state_dir=state)
    try:
        with ws.step("append to big.bin"):
            ws.fs.write("big.bin", MiB, b"appended tail")
        (journal,) = glob.glob(os.path.join(state, "steps", "*", "journal.jsonl"))
        (rec,) = _records(journal, "big.bin")
        assert rec["enc"] == "raw", rec
        blob = os.path.join(os.path.dirname(journal), rec["blob"])
        extents = _fiemap(blob)
        assert extents, "the blob has no extents"
        shared = sum(length for _, _, length, flags in extents if flags & FIEMAP_EXTENT_SHARED)
        assert shared >= MiB, f"only {shared} of {MiB} blob bytes share extents: {extents}"
        file_phys = {phys for _, phys, _, _ in _fiemap(os.path.join(work, "big.bin"))}
        assert {phys for _, phys, _, _ in extents} <= file_phys, "blob extents are not the file's extents"
        ws.rollback(1)
        assert_same(before, _snap(work), "tree after rollback(1)")
    finally:
        ws.close()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_xfs_work_and_store_on_different_filesystems_fall_back(xfs_mount, tmp_path):
    """FICLONE across filesystems is EXDEV: the store must fall back to zstd."""
    root = os.path.join(xfs_mount, "cross")
    os.mkdir(root)
    work, _, big, _ = _make_work(root)
    state = str(tmp_path / "state")  # the normal temp dir, another filesystem
    assert os.stat(work).st_dev != os.stat(str(tmp_path)).st_dev
    rec, _ = _overwrite_step_then_rollback(work, state, big)
    assert rec["enc"] == "zstd", f"expected the zstd fallback across filesystems, got {rec}"


# --------------------------------------------------------------------------- no reflink


@pytest.mark.timeout(60)
def test_no_reflink_filesystem_falls_back_to_zstd(tmp_path):
    if _reflink_works(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on a filesystem with reflinks: the fallback cannot be seen there")
    work, state, big, _ = _make_work(str(tmp_path))
    rec, rec_small = _overwrite_step_then_rollback(work, state, big)
    assert rec["enc"] == "zstd", f"expected the zstd fallback, got {rec}"
    # 1 MiB of random bytes does not compress: a blob file, not inline data
    assert "blob" in rec and rec["stored"] > 4096
    assert rec_small["enc"] == "zstd"


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_xfs_a_flipped_bit_in_a_reflinked_blob_is_refused_by_name(xfs_mount):
    """A raw blob has no zstd frame to fail: only the preimage hash in its record sees a
    flipped bit. The CLI refuses the undo (exit 4, one line naming the step and the path)
    and the working folder is untouched. (Writing to the blob unshares its extents: the
    working file keeps its bytes.)"""
    import subprocess
    import sys

    root = os.path.join(xfs_mount, "corrupt")
    os.mkdir(root)
    work, state, big, _ = _make_work(root)
    with Workspace.open(work, state_dir=state) as ws:
        with ws.step("overwrite big.bin"):
            ws.fs.write_file("big.bin", b"new")
        step_id = ws.history()[0]["id"]
    (journal,) = glob.glob(os.path.join(state, "steps", "*", "journal.jsonl"))
    (rec,) = _records(journal, "big.bin")
    assert rec["enc"] == "raw", rec
    with open(os.path.join(os.path.dirname(journal), rec["blob"]), "r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0x04]))
    before = _snap(work)
    r = subprocess.run([sys.executable, "-m", "sandbox", "undo", "--workdir", work, "--state-dir", state],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 4, (r.returncode, r.stderr)
    (line,) = [ln for ln in r.stderr.splitlines() if not ln.startswith("undoing")]
    assert f"step {step_id} " in line and "big.bin" in line and "checksum" in line, line
    assert_same(before, _snap(work), "tree after a refused undo")
