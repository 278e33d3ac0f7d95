"""The power-loss states between the two extremes, on the simulated disk (issue 19).

With ``MemoryHostFS.record_losses`` on, the disk records each inode's data versions since
its last durability point (fsync, fdatasync, ``sync_all``, a power loss), and
``power_loss(keep={ino: p})`` keeps, per listed inode, the data it had after its first ``p``
un-fsynced changes — a prefix of its own write order; unlisted inodes keep their last
fsynced bytes, as before. A Hypothesis model checks this against a plain history of every
file's bytes; the other tests pin what is offered (only inodes a power loss leaves
reachable), the per-inode bound, and that a kept version is durable afterwards.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox.hostfs.memory import UNSYNCED_VERSIONS_MAX, MemoryHostFS

FILES = ("a", "b", "d/c")

_op = st.one_of(
    st.tuples(st.just("write"), st.sampled_from(FILES), st.integers(0, 40), st.binary(min_size=0, max_size=12)),
    st.tuples(st.just("pwrite"), st.sampled_from(FILES), st.integers(0, 40), st.binary(min_size=1, max_size=12)),
    st.tuples(st.just("truncate"), st.sampled_from(FILES), st.integers(0, 50)),
    st.tuples(st.just("fallocate"), st.sampled_from(FILES), st.integers(0, 30), st.integers(1, 20), st.sampled_from([0, 1, 0x10, 0x11, 0x3])),
    st.tuples(st.just("copy"), st.sampled_from(FILES), st.sampled_from(FILES), st.integers(0, 20), st.integers(0, 20), st.integers(0, 20)),
    st.tuples(st.just("fsync"), st.sampled_from(FILES)),
    st.tuples(st.just("fdatasync"), st.sampled_from(FILES)),
    st.tuples(st.just("chmod"), st.sampled_from(FILES)),  # metadata only: no data version
)


def _disk() -> MemoryHostFS:
    fs = MemoryHostFS()
    fs.mkdir("d", 0o755)
    for path in FILES:
        fs.create(path, 0o644)
        fs.write_all(path, 0, path.encode() * 3)
    fs.sync_all()
    fs.record_losses = True
    return fs


def _apply(fs: MemoryHostFS, op: tuple) -> None:
    kind, path = op[0], op[1]
    try:
        if kind == "write":
            fs.write(path, op[2], op[3])
        elif kind == "pwrite":
            with fs.open(path, os.O_RDWR) as h:
                h.pwrite(op[3], op[2])
        elif kind == "truncate":
            fs.truncate(path, op[2])
        elif kind == "fallocate":
            fs.fallocate(path, op[2], op[3], op[4])
        elif kind == "copy":
            fs.copy_file_range(path, op[2], op[3], op[4], op[5])
        elif kind == "fsync":
            fs.fsync(path)
        elif kind == "fdatasync":
            with fs.open(path, os.O_RDWR) as h:
                h.fsync(datasync=True)
        elif kind == "chmod":
            fs.chmod(path, 0o600)
    except OSError:
        pass  # e.g. an overlapping copy within one file (EINVAL): nothing changed


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_op, max_size=25), pick=st.randoms(use_true_random=False))
def test_a_power_loss_keeps_any_prefix_of_each_file_s_unsynced_changes(ops, pick):
    fs = _disk()
    durable = {p: fs.read_all(p) for p in FILES}
    history: dict[str, list[bytes]] = {p: [] for p in FILES}  # the reference: bytes after each change since the last sync
    for op in ops:
        _apply(fs, op)
        for p in FILES:
            now = fs.read_all(p)
            if op[0] in ("fsync", "fdatasync") and op[1] == p:
                durable[p], history[p] = now, []
            elif now != (history[p][-1] if history[p] else durable[p]):
                history[p].append(now)
    ino = {p: fs.lstat(p).ino for p in FILES}
    assert fs.loss_choices() == {ino[p]: len(history[p]) for p in FILES if history[p]}
    keep = {ino[p]: pick.randint(0, len(history[p])) for p in FILES if history[p] and pick.random() < 0.8}
    fs.power_loss(keep=keep)
    for p in FILES:
        n = keep.get(ino[p], 0)
        assert fs.read_all(p) == (history[p][n - 1] if n else durable[p]), (p, n)
    assert fs.loss_choices() == {}  # what survived is on the disk: durable
    fs.power_loss()
    for p in FILES:
        n = keep.get(ino[p], 0)
        assert fs.read_all(p) == (history[p][n - 1] if n else durable[p]), (p, n, "second power loss")


def test_only_inodes_a_power_loss_leaves_reachable_are_offered():
    fs = _disk()
    fs.create("fresh", 0o644)  # its name is not committed yet
    fs.write("fresh", 0, b"new bytes")
    fs.write("a", 0, b"A")
    assert fs.loss_choices() == {fs.lstat("a").ino: 1}
    fs.fsync("b")  # one journal: the new name commits too; "fresh"'s bytes are still unsynced
    assert fs.loss_choices() == {fs.lstat("a").ino: 1, fs.lstat("fresh").ino: 1}
    fresh = fs.lstat("fresh").ino
    fs.power_loss(keep={fresh: 1})
    assert fs.read_all("fresh") == b"new bytes"
    assert fs.read_all("a") == b"aaa"


def test_hard_links_share_one_history_and_the_lock_file_is_recorded():
    fs = _disk()
    fs.link("a", "d/a2")
    fs.fsync("d")
    fs.write("d/a2", 0, b"X")
    fs.write("a", 1, b"Y")
    assert fs.loss_choices() == {fs.lstat("a").ino: 2}
    fs.lock("lock")
    fs.fsync("")  # the lock file's name commits; its pid is unsynced data
    assert fs.loss_choices()[fs.lstat("lock").ino] == 1
    fs.power_loss(keep={fs.lstat("a").ino: 1})
    assert fs.read_all("d/a2") == b"Xaa"
    assert fs.read_all("lock") == b""


def test_a_change_that_leaves_the_bytes_as_they_were_is_no_new_state():
    fs = _disk()
    fs.write("a", 0, b"a")  # the same byte
    fs.truncate("b", 3)  # the same size
    assert fs.loss_choices() == {}
    fs.write("a", 0, b"Z")
    fs.write("a", 0, b"Z")
    assert fs.loss_choices() == {fs.lstat("a").ino: 1}


def test_beyond_the_per_inode_bound_the_newest_version_replaces_the_last():
    assert UNSYNCED_VERSIONS_MAX == 64
    fs = _disk()
    for i in range(UNSYNCED_VERSIONS_MAX + 5):
        fs.write("a", 0, f"{i:03}".encode())
    ino = fs.lstat("a").ino
    assert fs.loss_choices() == {ino: UNSYNCED_VERSIONS_MAX}
    assert fs.unsynced_versions_dropped == 5
    fs.power_loss(keep={ino: UNSYNCED_VERSIONS_MAX - 1})
    assert fs.read_all("a") == f"{UNSYNCED_VERSIONS_MAX - 2:03}".encode()
    fs2 = _disk()
    for i in range(UNSYNCED_VERSIONS_MAX + 5):
        fs2.write("a", 0, f"{i:03}".encode())
    fs2.power_loss(keep={ino: UNSYNCED_VERSIONS_MAX})
    assert fs2.read_all("a") == f"{UNSYNCED_VERSIONS_MAX + 4:03}".encode()  # the newest, always offered


def test_keep_is_checked_before_anything_is_lost():
    fs = _disk()
    fs.write("a", 0, b"Z")
    ino = fs.lstat("a").ino
    for bad in ({ino: 2}, {ino: -1}, {fs.lstat("b").ino: 1}, {999: 0}):
        with pytest.raises(ValueError):
            fs.power_loss(keep=bad)
    assert fs.read_all("a") == b"Zaa"  # nothing happened
    off = MemoryHostFS()
    off.create("f", 0o644)
    off.sync_all()
    off.write("f", 0, b"x")
    assert off.loss_choices() == {}  # not recording: only the extremes exist
    with pytest.raises(ValueError, match="record_losses"):
        off.power_loss(keep={off.lstat("f").ino: 1})
