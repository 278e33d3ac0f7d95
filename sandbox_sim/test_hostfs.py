"""Parity suite for the HostFS contract: every test runs against MemoryHostFS *and* RealHostFS.

The real implementation is the reference (it is the Linux kernel behind openat2 and the
``*at()`` calls); MemoryHostFS must give the same results and the same errnos. A test that
passes for "real" and fails for "sim" is a bug in the simulator, and the other way round
a bug in RealHostFS's resolution rules.

Real-case extras: symlinks that point *outside* the root (a sibling directory of the
root inside ``tmp_path``, and ``/etc``) are created, and every test that goes through
them checks afterwards that nothing outside the root was read, written, chmod'ed, …
(contents, modes, mtimes, ctimes, xattrs and listings are compared). Open file handles
are checked the same way, and also after the path they were opened by has been turned
into a symlink to the outside: a handle is bound to its inode and never re-resolved.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import sandbox
from sandbox.hostfs import (
    DIR,
    LNK,
    NAME_LEN_MAX,
    OTHER,
    PATH_LEN_MAX,
    REG,
    SYNTHETIC_STATFS,
    Attr,
    FileHandle,
    HostFS,
    ListingTooLarge,
    PathError,
    Stat,
    StatFS,
    StoreBusy,
    TREE_PATH_BYTES_MAX,
    is_within,
    join,
    normalize,
    parent_of,
)
from sandbox.hostfs.real import RealHostFS
from sandbox.hostfs.memory import MemoryHostFS
from sandbox.limits import DIR_ENTRY_OVERHEAD_BYTES, listing_cost
from sandbox_sim.faults import FaultInjector, SimulatedCrash

IS_ROOT = os.geteuid() == 0
KEEP_SIZE = 0x01
PUNCH_HOLE = 0x02
ZERO_RANGE = 0x10
T1 = 1_234_567_890_123_456_789  # an mtime with every nanosecond digit significant
OUTSIDE_CANARY = "sandbox-hostfs-parity-canary"  # a name that must never appear in /etc


# --------------------------------------------------------------------------- fixtures


class Env:
    """One implementation under test plus what the tests need to set the scene."""

    def __init__(self, kind: str, fs: HostFS, root: Path | None, outside: Path):
        self.kind = kind
        self.fs = fs
        self.root = root  # the real root directory (None for the simulator)
        self.outside = outside  # a directory beside the root (only populated for real)

    @property
    def real(self) -> bool:
        return self.kind == "real"

    def special(self, path: str, mode: int = 0o644, fmt: int = stat.S_IFIFO) -> None:
        """Put a fifo (or a socket, ``fmt=S_IFSOCK``) at ``path``: real, or simulated."""
        if self.real:
            full = os.path.join(self.root, path)
            if fmt == stat.S_IFIFO:
                os.mkfifo(full)
            else:
                os.mknod(full, fmt | 0o600)  # fifos and sockets need no privilege
            os.chmod(full, mode)
        else:
            self.fs.make_special(path, mode, fmt)

    def tick(self) -> None:
        """Let the real clock move past the kernel's timestamp granularity."""
        if self.real:
            time.sleep(0.02)

    def outside_snapshot(self) -> dict:
        """Everything observable about the tree beside the root (empty for the simulator)."""
        if not self.real:
            return {}
        snap = {}
        for dirpath, dirnames, filenames in os.walk(self.outside):
            for name in [""] + sorted(dirnames) + sorted(filenames):
                p = os.path.join(dirpath, name) if name else dirpath
                st = os.lstat(p)
                entry = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink, st.st_ino)
                xattrs = {n: os.getxattr(p, n, follow_symlinks=False) for n in sorted(os.listxattr(p, follow_symlinks=False))}
                content = Path(p).read_bytes() if stat.S_ISREG(st.st_mode) else None
                listing = sorted(os.listdir(p)) if stat.S_ISDIR(st.st_mode) else None
                snap[p] = (entry, xattrs, content, listing)
        return snap


@pytest.fixture(params=["sim", "real"])
def env(request, tmp_path):
    outside = tmp_path / "outside"
    if request.param == "sim":
        yield Env("sim", MemoryHostFS(), None, outside)
        return
    root = tmp_path / "root"
    root.mkdir()
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious outside data")
    os.chmod(outside / "victim", 0o640)
    os.setxattr(outside / "victim", "user.keep", b"outside")
    (outside / "sub").mkdir()
    (outside / "sub2").mkdir()
    (outside / "sub2" / "inner").write_bytes(b"inner")
    os.utime(outside / "victim", ns=(T1, T1))
    fs = RealHostFS(str(root))
    try:
        yield Env("real", fs, root, outside)
    finally:
        fs.close()


@pytest.fixture
def fs(env) -> HostFS:
    return env.fs


def check_errno(code: int, fn, *args, **kwargs) -> OSError:
    with pytest.raises(OSError) as info:
        fn(*args, **kwargs)
    got = info.value.errno
    assert got == code, f"expected {errno.errorcode[code]}, got {errno.errorcode.get(got, got)}: {info.value!r}"
    return info.value


def mkfile(fs: HostFS, path: str, data: bytes = b"", mode: int = 0o644) -> None:
    fs.create(path, mode)
    if data:
        fs.write_all(path, 0, data)


def skip_unless_root_for(mode: int) -> None:
    if mode & 0o6000 and not IS_ROOT:
        pytest.skip("setuid/setgid bits are only kept exactly with CAP_FSETID (run as root)")


MODES = [0o000, 0o400, 0o600, 0o644, 0o755, 0o777, 0o1777, 0o1000, 0o2755, 0o4755, 0o4000, 0o6777, 0o7777]


# --------------------------------------------------------------------------- create / mkdir


@pytest.mark.parametrize("mode", MODES, ids=oct)
def test_create_applies_mode_exactly(fs, mode):
    skip_unless_root_for(mode)
    fs.create("f", mode)
    st = fs.lstat("f")
    assert (st.kind, st.mode, st.size, st.nlink) == (REG, mode, 0, 1)
    assert fs.read("f", 0, 10) == b""


@pytest.mark.parametrize("mode", MODES, ids=oct)
def test_mkdir_applies_mode_exactly(fs, mode):
    skip_unless_root_for(mode)
    fs.mkdir("d", mode)
    st = fs.lstat("d")
    assert (st.kind, st.mode) == (DIR, mode)
    assert fs.listdir("d") == []


def test_create_and_mkdir_ignore_umask(fs):
    old = os.umask(0o077)
    try:
        fs.create("f", 0o666)
        fs.mkdir("d", 0o777)
        fs.mkdir("d/e", 0o775)
    finally:
        os.umask(old)
    assert fs.lstat("f").mode == 0o666
    assert fs.lstat("d").mode == 0o777
    assert fs.lstat("d/e").mode == 0o775


def test_mode_is_masked_to_permission_bits(fs):
    fs.create("f", stat.S_IFREG | 0o640)
    fs.mkdir("d", stat.S_IFDIR | 0o750)
    assert fs.lstat("f").mode == 0o640
    assert fs.lstat("d").mode == 0o750


@pytest.mark.skipif(not IS_ROOT, reason="setgid on a directory needs CAP_FSETID here")
def test_mkdir_in_setgid_dir_does_not_inherit_setgid(fs):
    # Linux gives a new subdirectory of a setgid directory the setgid bit; the mode the
    # guest asked for must win.
    fs.mkdir("g", 0o2775)
    fs.mkdir("g/child", 0o755)
    fs.create("g/file", 0o644)
    assert fs.lstat("g/child").mode == 0o755
    assert fs.lstat("g/file").mode == 0o644


def test_create_on_existing_path_is_eexist(env, fs):
    mkfile(fs, "f", b"keep")
    fs.mkdir("d", 0o755)
    fs.symlink("f", "l")
    fs.symlink("nowhere", "dangling")
    env.special("p")
    for p in ("f", "d", "l", "dangling", "p"):
        check_errno(errno.EEXIST, fs.create, p, 0o600)
    assert fs.read_all("f") == b"keep"
    assert fs.lstat("f").mode == 0o644
    assert fs.readlink("dangling") == "nowhere"
    assert not fs.exists("nowhere")


def test_mkdir_on_existing_path_is_eexist(env, fs):
    mkfile(fs, "f", b"keep")
    fs.mkdir("d", 0o700)
    mkfile(fs, "d/inner")
    fs.symlink("d", "l")
    fs.symlink("nowhere", "dangling")
    env.special("p")
    for p in ("f", "d", "l", "dangling", "p"):
        check_errno(errno.EEXIST, fs.mkdir, p, 0o755)
    assert fs.lstat("d").mode == 0o700
    assert fs.listdir("d") == ["inner"]
    assert not fs.exists("nowhere")


def test_create_and_mkdir_missing_or_bad_parent(env, fs):
    mkfile(fs, "f")
    env.special("p")
    check_errno(errno.ENOENT, fs.create, "missing/f", 0o644)
    check_errno(errno.ENOENT, fs.mkdir, "missing/d", 0o755)
    check_errno(errno.ENOTDIR, fs.create, "f/x", 0o644)
    check_errno(errno.ENOTDIR, fs.mkdir, "f/x", 0o755)
    check_errno(errno.ENOTDIR, fs.create, "p/x", 0o644)
    assert sorted(fs.listdir("")) == ["f", "p"]


def test_create_and_mkdir_update_parent_times(env, fs):
    fs.mkdir("d", 0o755)
    fs.utime("d", T1)
    before = fs.lstat("d")
    env.tick()
    fs.create("d/f", 0o644)
    mid = fs.lstat("d")
    assert mid.mtime_ns != T1 and mid.ctime_ns > before.ctime_ns
    fs.utime("d", T1)
    env.tick()
    fs.mkdir("d/e", 0o755)
    assert fs.lstat("d").mtime_ns != T1


def test_directory_link_counts(env, fs):
    if env.real and os.lstat(env.root).st_nlink == 1:
        pytest.skip("this filesystem does not count subdirectories in a directory's nlink")
    root0 = fs.lstat("").nlink
    fs.mkdir("d", 0o755)
    assert fs.lstat("d").nlink == 2
    assert fs.lstat("").nlink == root0 + 1
    fs.mkdir("d/e", 0o755)
    fs.mkdir("d/f", 0o755)
    mkfile(fs, "d/file")
    assert fs.lstat("d").nlink == 4
    fs.rmdir("d/e")
    assert fs.lstat("d").nlink == 3
    fs.rename("d/f", "f")  # a directory changes parent
    assert fs.lstat("d").nlink == 2
    assert fs.lstat("").nlink == root0 + 2
    fs.mkdir("g", 0o755)
    fs.rename("g", "f")  # over an empty directory: the replaced one's '..' is gone
    assert fs.lstat("").nlink == root0 + 2
    fs.rename("d", "f")
    assert fs.lstat("").nlink == root0 + 1
    assert fs.lstat("f").nlink == 2


# --------------------------------------------------------------------------- read / write / truncate


def test_write_returns_count_and_read_back(fs):
    fs.create("f", 0o644)
    assert fs.write("f", 0, b"hello world") == 11
    assert fs.lstat("f").size == 11
    assert fs.read("f", 0, 100) == b"hello world"
    assert fs.read("f", 6, 3) == b"wor"
    assert fs.read("f", 6, 100) == b"world"
    assert fs.read("f", 11, 10) == b""
    assert fs.read("f", 1000, 10) == b""
    assert fs.read("f", 3, 0) == b""


def test_write_in_the_middle_overwrites_without_growing(fs):
    mkfile(fs, "f", b"0123456789")
    assert fs.write("f", 3, b"abc") == 3
    assert fs.read_all("f") == b"012abc6789"
    assert fs.write("f", 8, b"XYZ") == 3  # straddles EOF
    assert fs.read_all("f") == b"012abc67XYZ"
    assert fs.lstat("f").size == 11


def test_write_past_eof_zero_fills(fs):
    mkfile(fs, "f", b"ab")
    assert fs.write("f", 10, b"cd") == 2
    assert fs.lstat("f").size == 12
    assert fs.read_all("f") == b"ab" + b"\0" * 8 + b"cd"


def test_empty_write_changes_nothing(env, fs):
    mkfile(fs, "f", b"ab")
    fs.utime("f", T1)
    before = fs.lstat("f")
    env.tick()
    assert fs.write("f", 100, b"") == 0
    assert fs.write("f", 0, b"") == 0
    after = fs.lstat("f")
    assert after.size == 2 and fs.read_all("f") == b"ab"
    assert (after.mtime_ns, after.ctime_ns) == (T1, before.ctime_ns)


def test_write_updates_mtime_and_ctime(env, fs):
    mkfile(fs, "f", b"ab")
    fs.utime("f", T1)
    before = fs.lstat("f")
    env.tick()
    fs.write("f", 0, b"x")
    after = fs.lstat("f")
    assert after.mtime_ns != T1
    assert after.ctime_ns > before.ctime_ns


def test_negative_offsets_and_lengths_are_einval(fs):
    mkfile(fs, "f", b"0123456789")
    check_errno(errno.EINVAL, fs.read, "f", -1, 3)
    check_errno(errno.EINVAL, fs.read, "f", 0, -1)
    check_errno(errno.EINVAL, fs.write, "f", -1, b"x")
    check_errno(errno.EINVAL, fs.truncate, "f", -1)
    assert fs.read_all("f") == b"0123456789"


def test_truncate_shrinks_and_grows_with_zeros(env, fs):
    mkfile(fs, "f", b"0123456789")
    fs.truncate("f", 4)
    assert fs.read_all("f") == b"0123"
    fs.truncate("f", 8)
    assert fs.read_all("f") == b"0123\0\0\0\0"
    assert fs.lstat("f").size == 8
    fs.truncate("f", 0)
    assert fs.read_all("f") == b"" and fs.lstat("f").size == 0
    fs.utime("f", T1)
    env.tick()
    fs.truncate("f", 0)  # same size: still a modification (ftruncate always sets mtime)
    assert fs.lstat("f").mtime_ns != T1


def test_large_read_all_write_all(fs):
    data = bytes(range(256)) * (10 * 1024 + 7)  # ~2.5 MiB: several chunks
    fs.create("big", 0o644)
    fs.write_all("big", 0, data)
    assert fs.lstat("big").size == len(data)
    assert fs.read_all("big") == data
    assert fs.read_all("big", chunk_bytes=4096 * 3 + 1) == data


def test_io_on_a_directory_is_eisdir(fs):
    fs.mkdir("d", 0o755)
    check_errno(errno.EISDIR, fs.read, "d", 0, 10)
    check_errno(errno.EISDIR, fs.write, "d", 0, b"x")
    check_errno(errno.EISDIR, fs.truncate, "d", 0)
    check_errno(errno.EISDIR, fs.fallocate, "d", 0, 10)
    mkfile(fs, "f", b"abc")
    check_errno(errno.EISDIR, fs.copy_file_range, "d", "f", 0, 0, 3)
    check_errno(errno.EISDIR, fs.copy_file_range, "f", "d", 0, 0, 3)


def test_io_on_a_symlink_is_eloop_and_target_untouched(fs):
    mkfile(fs, "target", b"secret")
    fs.utime("target", T1)
    fs.symlink("target", "l")
    check_errno(errno.ELOOP, fs.read, "l", 0, 10)
    check_errno(errno.ELOOP, fs.read_all, "l")
    check_errno(errno.ELOOP, fs.write, "l", 0, b"pwned")
    check_errno(errno.ELOOP, fs.truncate, "l", 0)
    check_errno(errno.ELOOP, fs.fallocate, "l", 0, 100)
    check_errno(errno.ELOOP, fs.copy_file_range, "l", "target", 0, 0, 3)
    check_errno(errno.ELOOP, fs.copy_file_range, "target", "l", 0, 0, 3)
    assert fs.read_all("target") == b"secret"
    assert fs.lstat("target").mtime_ns == T1


def test_io_on_missing_or_through_a_file(fs):
    mkfile(fs, "f", b"abc")
    check_errno(errno.ENOENT, fs.read, "missing", 0, 1)
    check_errno(errno.ENOENT, fs.write, "missing", 0, b"x")
    check_errno(errno.ENOENT, fs.truncate, "missing", 0)
    check_errno(errno.ENOENT, fs.read, "nodir/f", 0, 1)
    check_errno(errno.ENOTDIR, fs.read, "f/x", 0, 1)
    check_errno(errno.ENOTDIR, fs.write, "f/x", 0, b"x")
    check_errno(errno.ENOTDIR, fs.lstat, "f/x")
    assert not fs.exists("missing")
    assert not fs.exists("f/x")  # like os.path.exists: a file as a parent means "does not exist"
    fs.symlink("f", "l")
    assert not fs.exists("l/x")  # nor does a path through a symlink (never followed): ELOOP is "absent"


# --------------------------------------------------------------------------- unlink / rmdir


def test_unlink_and_rmdir_remove(env, fs):
    mkfile(fs, "f", b"x")
    fs.mkdir("d", 0o755)
    env.special("p")
    fs.symlink("d", "l")
    fs.unlink("f")
    fs.unlink("p")
    fs.unlink("l")  # the link, not the directory it names
    assert fs.listdir("") == ["d"]
    fs.rmdir("d")
    assert fs.listdir("") == []
    check_errno(errno.ENOENT, fs.lstat, "f")


def test_unlink_of_a_dir_is_eisdir(fs):
    fs.mkdir("d", 0o755)
    check_errno(errno.EISDIR, fs.unlink, "d")
    assert fs.lstat("d").kind == DIR


def test_rmdir_of_non_directories_is_enotdir(env, fs):
    mkfile(fs, "f")
    fs.mkdir("d", 0o755)
    fs.symlink("d", "l")
    env.special("p")
    for p in ("f", "l", "p"):
        check_errno(errno.ENOTDIR, fs.rmdir, p)
    assert sorted(fs.listdir("")) == ["d", "f", "l", "p"]


def test_rmdir_non_empty_is_enotempty(fs):
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/f")
    check_errno(errno.ENOTEMPTY, fs.rmdir, "d")
    fs.mkdir("e", 0o755)
    fs.mkdir("e/sub", 0o755)
    check_errno(errno.ENOTEMPTY, fs.rmdir, "e")
    fs.unlink("d/f")
    fs.rmdir("d")
    assert fs.listdir("") == ["e"]


def test_unlink_rmdir_enoent_and_enotdir(fs):
    mkfile(fs, "f")
    check_errno(errno.ENOENT, fs.unlink, "missing")
    check_errno(errno.ENOENT, fs.rmdir, "missing")
    check_errno(errno.ENOENT, fs.unlink, "missing/x")
    check_errno(errno.ENOENT, fs.rmdir, "missing/x")
    check_errno(errno.ENOTDIR, fs.unlink, "f/x")
    check_errno(errno.ENOTDIR, fs.rmdir, "f/x")


def test_unlink_updates_parent_and_remaining_link(env, fs):
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/a", b"shared")
    fs.link("d/a", "d/b")
    fs.utime("d", T1)
    before = fs.lstat("d/b")
    env.tick()
    fs.unlink("d/a")
    after = fs.lstat("d/b")
    assert after.nlink == 1 and after.ctime_ns > before.ctime_ns
    assert fs.read_all("d/b") == b"shared"
    assert fs.lstat("d").mtime_ns != T1
    fs.utime("d", T1)
    fs.mkdir("d/e", 0o755)
    fs.utime("d", T1)
    env.tick()
    fs.rmdir("d/e")
    assert fs.lstat("d").mtime_ns != T1


# --------------------------------------------------------------------------- rename


def test_rename_file_over_file(env, fs):
    mkfile(fs, "a", b"new")
    mkfile(fs, "b", b"old content")
    ino = fs.lstat("a").ino
    fs.rename("a", "b")
    assert fs.listdir("") == ["b"]
    assert fs.read_all("b") == b"new"
    assert fs.lstat("b").ino == ino


def test_rename_over_a_file_with_other_links(fs):
    mkfile(fs, "a", b"new")
    mkfile(fs, "b", b"old")
    fs.link("b", "b2")
    fs.rename("a", "b")
    assert fs.read_all("b") == b"new"
    assert fs.read_all("b2") == b"old"
    assert fs.lstat("b2").nlink == 1


def test_rename_moves_between_directories_with_contents(fs):
    fs.mkdir("src", 0o755)
    fs.mkdir("src/tree", 0o711)
    mkfile(fs, "src/tree/leaf", b"leaf")
    fs.setxattr("src/tree/leaf", "user.tag", b"t")
    fs.mkdir("dst", 0o755)
    fs.rename("src/tree", "dst/moved")
    assert fs.listdir("src") == []
    assert fs.lstat("dst/moved").mode == 0o711
    assert fs.read_all("dst/moved/leaf") == b"leaf"
    assert fs.getxattr("dst/moved/leaf", "user.tag") == b"t"


def test_rename_updates_times(env, fs):
    fs.mkdir("s", 0o755)
    fs.mkdir("t", 0o755)
    mkfile(fs, "s/f", b"x")
    for p in ("s", "t", "s/f"):
        fs.utime(p, T1)
    before = fs.lstat("s/f")
    env.tick()
    fs.rename("s/f", "t/f")
    moved = fs.lstat("t/f")
    assert moved.mtime_ns == T1  # contents untouched
    assert moved.ctime_ns > before.ctime_ns
    assert fs.lstat("s").mtime_ns != T1
    assert fs.lstat("t").mtime_ns != T1


def test_rename_dir_over_empty_dir(fs):
    fs.mkdir("a", 0o700)
    mkfile(fs, "a/inner", b"i")
    fs.mkdir("b", 0o755)
    fs.rename("a", "b")
    assert fs.listdir("") == ["b"]
    assert fs.lstat("b").mode == 0o700
    assert fs.read_all("b/inner") == b"i"


def test_rename_dir_over_non_empty_dir_is_enotempty(fs):
    fs.mkdir("a", 0o755)
    fs.mkdir("b", 0o755)
    mkfile(fs, "b/keep", b"k")
    check_errno(errno.ENOTEMPTY, fs.rename, "a", "b")
    assert fs.read_all("b/keep") == b"k"
    assert fs.lstat("a").kind == DIR


def test_rename_file_over_dir_is_eisdir(fs):
    mkfile(fs, "f", b"x")
    fs.mkdir("empty", 0o755)
    fs.mkdir("full", 0o755)
    mkfile(fs, "full/x")
    check_errno(errno.EISDIR, fs.rename, "f", "empty")
    check_errno(errno.EISDIR, fs.rename, "f", "full")
    assert fs.read_all("f") == b"x"


def test_rename_dir_over_non_dir_is_enotdir(env, fs):
    fs.mkdir("d", 0o755)
    mkfile(fs, "f", b"x")
    fs.symlink("d", "l")
    env.special("p")
    for p in ("f", "l", "p"):
        check_errno(errno.ENOTDIR, fs.rename, "d", p)
    assert fs.read_all("f") == b"x"
    assert fs.readlink("l") == "d"


def test_rename_dir_into_its_own_subtree_is_einval(fs):
    fs.mkdir("a", 0o755)
    fs.mkdir("a/b", 0o755)
    fs.mkdir("a/b/c", 0o755)
    check_errno(errno.EINVAL, fs.rename, "a", "a/b/new")
    check_errno(errno.EINVAL, fs.rename, "a", "a/b/c")
    check_errno(errno.EINVAL, fs.rename, "a/b", "a/b/c/d")
    assert fs.listdir("a/b/c") == []


def test_rename_onto_an_ancestor_is_enotempty(fs):
    fs.mkdir("a", 0o755)
    fs.mkdir("a/sub", 0o755)
    fs.mkdir("a/sub/deep", 0o755)
    mkfile(fs, "a/file", b"x")
    check_errno(errno.ENOTEMPTY, fs.rename, "a/sub", "a")
    check_errno(errno.ENOTEMPTY, fs.rename, "a/sub/deep", "a")
    check_errno(errno.ENOTEMPTY, fs.rename, "a/file", "a")  # even for a file: the kernel checks ancestry first
    assert sorted(fs.listdir("a")) == ["file", "sub"]


def test_rename_to_itself_is_a_no_op(fs):
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/f", b"x")
    fs.rename("d", "d")
    fs.rename("d/f", "d/f")
    assert fs.read_all("d/f") == b"x"


def test_rename_between_hardlinks_is_a_no_op(fs):
    mkfile(fs, "a", b"same inode")
    fs.link("a", "b")
    fs.rename("a", "b")
    assert sorted(fs.listdir("")) == ["a", "b"]
    assert fs.lstat("a").nlink == 2 and fs.lstat("a").ino == fs.lstat("b").ino
    fs.symlink("t", "l1")
    fs.link("l1", "l2")
    fs.rename("l2", "l1")
    assert sorted(fs.listdir("")) == ["a", "b", "l1", "l2"]


def test_rename_missing_source_is_enoent(fs):
    fs.mkdir("d", 0o755)
    mkfile(fs, "f")
    check_errno(errno.ENOENT, fs.rename, "missing", "x")
    check_errno(errno.ENOENT, fs.rename, "missing", "f")
    check_errno(errno.ENOENT, fs.rename, "f", "nodir/x")
    check_errno(errno.ENOENT, fs.rename, "missing", "nodir/x")
    check_errno(errno.ENOTDIR, fs.rename, "missing", "f/x")  # the target's parent is looked up first
    check_errno(errno.ENOTDIR, fs.rename, "d", "f/x")
    assert sorted(fs.listdir("")) == ["d", "f"]


def test_rename_symlinks_and_specials_move_themselves(env, fs):
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/t", b"target")
    fs.symlink("d/t", "l")
    env.special("p", 0o600)
    fs.rename("l", "d/l2")
    fs.rename("p", "d/p2")
    assert fs.readlink("d/l2") == "d/t"
    st = fs.lstat("d/p2")
    assert (st.kind, st.mode) == (OTHER, 0o600)
    mkfile(fs, "f", b"replacement")
    fs.rename("f", "d/l2")  # a file replaces a symlink, not its target
    assert fs.lstat("d/l2").kind == REG
    assert fs.read_all("d/t") == b"target"


# --------------------------------------------------------------------------- symlinks


SYMLINK_TARGETS = ["/etc/passwd", "../../outside", "dangling", "d/f", "a/../b", ".", "/", "x" * 255, "dir/", "sp ace\ttab", "ünïcødé"]


@pytest.mark.parametrize("target", SYMLINK_TARGETS)
def test_symlink_target_stored_verbatim(fs, target):
    fs.symlink(target, "l")
    st = fs.lstat("l")
    assert st.kind == LNK
    assert st.size == len(target.encode())
    assert st.mode == 0o777
    assert st.nlink == 1
    assert fs.readlink("l") == target
    assert fs.listxattr("l") == []


def test_symlink_long_target(fs):
    fs.symlink("a/" * 2047 + "b", "ok")  # 4095 bytes: the longest that fits PATH_MAX
    assert len(fs.readlink("ok")) == 4095
    check_errno(errno.ENAMETOOLONG, fs.symlink, "x" * 4096, "toolong")
    assert not fs.exists("toolong")


def test_symlink_errors(fs):
    mkfile(fs, "f")
    check_errno(errno.EEXIST, fs.symlink, "x", "f")
    check_errno(errno.ENOENT, fs.symlink, "", "empty")
    check_errno(errno.ENOENT, fs.symlink, "", "f")  # the target is checked before the name
    check_errno(errno.EINVAL, fs.symlink, "a\0b", "nul")
    check_errno(errno.ENOENT, fs.symlink, "x", "missing/l")
    check_errno(errno.ENOTDIR, fs.symlink, "x", "f/l")
    check_errno(errno.ENAMETOOLONG, fs.symlink, "x" * 4096, "missing/l")  # target first, then the path
    check_errno(errno.EINVAL, fs.symlink, "a\0b", "f/l")
    assert fs.listdir("") == ["f"]


def test_readlink_errors(env, fs):
    mkfile(fs, "f")
    fs.mkdir("d", 0o755)
    env.special("p")
    for p in ("f", "d", "p", ""):
        check_errno(errno.EINVAL, fs.readlink, p)
    check_errno(errno.ENOENT, fs.readlink, "missing")
    check_errno(errno.ENOTDIR, fs.readlink, "f/x")


def test_symlink_updates_parent_mtime(env, fs):
    fs.mkdir("d", 0o755)
    fs.utime("d", T1)
    env.tick()
    fs.symlink("x", "d/l")
    assert fs.lstat("d").mtime_ns != T1


# Operations that go *through* a symlink in the middle of a path. Each takes (fs, victim
# name); every one of them must fail with ELOOP. "safe" ones cannot harm /etc even if
# the implementation were broken; the others only run against scratch targets.
def _m_lock(fs, v):
    fs.lock(f"L/{OUTSIDE_CANARY}.lock").release()


def _m_open_write(fs, v):
    with fs.open(f"L/{v}", os.O_RDWR | os.O_APPEND) as h:
        h.pwrite(b"pwned", 0)
        h.truncate(1)


MIDDLE_OPS = {
    "lstat": (True, lambda fs, v: fs.lstat(f"L/{v}")),
    "lstat_missing": (True, lambda fs, v: fs.lstat("L/no-such-entry")),
    "listdir": (True, lambda fs, v: fs.listdir("L/sub")),
    "read": (True, lambda fs, v: fs.read(f"L/{v}", 0, 100)),
    "read_all": (True, lambda fs, v: fs.read_all(f"L/{v}")),
    "readlink": (True, lambda fs, v: fs.readlink(f"L/{v}")),
    "listxattr": (True, lambda fs, v: fs.listxattr(f"L/{v}")),
    "getxattr": (True, lambda fs, v: fs.getxattr(f"L/{v}", "user.keep")),
    "fsync": (True, lambda fs, v: fs.fsync(f"L/{v}")),
    "create": (True, lambda fs, v: fs.create(f"L/{OUTSIDE_CANARY}", 0o644)),
    "mkdir": (True, lambda fs, v: fs.mkdir(f"L/{OUTSIDE_CANARY}", 0o755)),
    "symlink": (True, lambda fs, v: fs.symlink("x", f"L/{OUTSIDE_CANARY}")),
    "rename_dst": (True, lambda fs, v: fs.rename("mine", f"L/{OUTSIDE_CANARY}")),
    "link_dst": (True, lambda fs, v: fs.link("mine", f"L/{OUTSIDE_CANARY}")),
    "link_src": (True, lambda fs, v: fs.link(f"L/{v}", "stolen")),
    "copy_src": (True, lambda fs, v: fs.copy_file_range(f"L/{v}", "mine", 0, 0, 100)),
    "lock": (True, _m_lock),
    "getattr": (True, lambda fs, v: fs.getattr(f"L/{v}")),
    "getattr_dir": (True, lambda fs, v: fs.getattr("L/sub")),
    "open": (True, lambda fs, v: fs.open(f"L/{v}", os.O_RDONLY)),
    "open_write": (False, _m_open_write),
    "utime_atime": (False, lambda fs, v: fs.utime(f"L/{v}", 1, 2)),
    "write": (False, lambda fs, v: fs.write(f"L/{v}", 0, b"pwned")),
    "write_all": (False, lambda fs, v: fs.write_all(f"L/{v}", 0, b"pwned")),
    "truncate": (False, lambda fs, v: fs.truncate(f"L/{v}", 0)),
    "fallocate": (False, lambda fs, v: fs.fallocate(f"L/{v}", 0, 1 << 20)),
    "punch": (False, lambda fs, v: fs.fallocate(f"L/{v}", 0, 4, PUNCH_HOLE | KEEP_SIZE)),
    "copy_dst": (False, lambda fs, v: fs.copy_file_range("mine", f"L/{v}", 0, 0, 100)),
    "unlink": (False, lambda fs, v: fs.unlink(f"L/{v}")),
    "rmdir": (False, lambda fs, v: fs.rmdir("L/sub")),
    "rename_src": (False, lambda fs, v: fs.rename(f"L/{v}", "stolen")),
    "chmod": (False, lambda fs, v: fs.chmod(f"L/{v}", 0o777)),
    "chmod_dir": (False, lambda fs, v: fs.chmod("L/sub", 0o777)),
    "lchown": (False, lambda fs, v: fs.lchown(f"L/{v}", -1, -1)),
    "utime": (False, lambda fs, v: fs.utime(f"L/{v}", 1)),
    "setxattr": (False, lambda fs, v: fs.setxattr(f"L/{v}", "user.evil", b"1")),
    "removexattr": (False, lambda fs, v: fs.removexattr(f"L/{v}", "user.keep")),
}

# (link target, victim name, destructive ops allowed?)
LINK_TARGETS = {
    "inside": ("d", "victim", True),
    "outside_abs": (None, "victim", True),  # None: the absolute path of the outside dir
    "outside_rel": ("../outside", "victim", True),
    "outside_sub": ("../outside/sub2/../", "victim", True),
    "etc": ("/etc", "passwd", False),
}


def _setup_link(env: Env, where: str) -> tuple[str, str]:
    fs = env.fs
    target, victim, _ = LINK_TARGETS[where]
    if target is None:
        target = str(env.outside)
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/victim", b"precious inside data", 0o640)
    fs.setxattr("d/victim", "user.keep", b"inside")
    fs.mkdir("d/sub", 0o755)
    fs.utime("d/victim", T1)
    mkfile(fs, "mine", b"mine")
    fs.symlink(target, "L")
    return target, victim


def _inside_state(fs: HostFS) -> tuple:
    return (fs.lstat("d"), fs.lstat("d/victim"), fs.read_all("d/victim"), fs.xattrs("d/victim"),
            fs.lstat("d/sub"), sorted(fs.listdir("d")), sorted(fs.listdir("")), fs.read_all("mine"))


def _etc_untouched() -> None:
    leaked = [n for n in os.listdir("/etc") if n.startswith(OUTSIDE_CANARY)]
    for n in leaked:  # clean up before failing
        p = os.path.join("/etc", n)
        os.rmdir(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    assert not leaked, f"created in /etc through a symlink: {leaked}"


@pytest.mark.parametrize(
    "op, where",
    # destructive operations only go through scratch targets, never through /etc
    [(op, where) for op in MIDDLE_OPS for where in LINK_TARGETS if MIDDLE_OPS[op][0] or LINK_TARGETS[where][2]],
)
def test_symlink_in_the_middle_of_a_path_is_eloop(env, fs, op, where):
    _, fn = MIDDLE_OPS[op]
    _, victim = _setup_link(env, where)
    outside_before = env.outside_snapshot()
    inside_before = _inside_state(fs)
    etc_passwd = Path("/etc/passwd").read_bytes() if env.real and where == "etc" else None
    check_errno(errno.ELOOP, fn, fs, victim)
    if where == "etc" and env.real:
        _etc_untouched()
        assert Path("/etc/passwd").read_bytes() == etc_passwd
    assert env.outside_snapshot() == outside_before
    assert _inside_state(fs) == inside_before


@pytest.mark.parametrize("where", list(LINK_TARGETS) + ["dangling", "to_file"])
def test_a_path_through_a_symlink_does_not_exist_there(env, fs, where):
    """What the undo core probes after ``rm -rf d && ln -s TARGET d``: below ``d`` nothing
    is reachable without following a link, so ``lstat`` is ELOOP (the one errno both
    implementations give for "a symlink on the way", at any depth) and ``exists`` is False
    — never True because the target happens to hold that name."""
    if where in LINK_TARGETS:
        _, victim = _setup_link(env, where)
    else:
        victim = "victim"
        mkfile(fs, "file", b"a file")
        fs.symlink("nowhere/at/all" if where == "dangling" else "file", "L")
    outside_before = env.outside_snapshot()
    for path in (f"L/{victim}", "L/no-such-entry", f"L/{victim}/deeper", "L/sub/x"):
        check_errno(errno.ELOOP, fs.lstat, path)
        check_errno(errno.ELOOP, fs.getattr, path)
        assert fs.exists(path) is False, path
    assert fs.exists("L") and fs.lstat("L").kind == LNK
    check_errno(errno.ENOTDIR, fs.listdir, "L")
    assert env.outside_snapshot() == outside_before


@pytest.mark.parametrize("where", ["inside", "outside_abs", "outside_rel", "etc"])
def test_symlink_as_final_component_is_never_followed(env, fs, where):
    target, victim = _setup_link(env, where)
    fs.symlink(f"{target.rstrip('/')}/{victim}", "F")  # a link to the victim file itself
    ftarget = fs.readlink("F")
    outside_before = env.outside_snapshot()
    inside_before = _inside_state(fs)
    for link in ("L", "F"):
        check_errno(errno.ELOOP, fs.read, link, 0, 100)
        check_errno(errno.ELOOP, fs.read_all, link)
        check_errno(errno.ELOOP, fs.copy_file_range, link, "mine", 0, 0, 100)
        check_errno(errno.ENODATA, fs.getxattr, link, "user.keep")
        assert fs.listxattr(link) == []
        assert fs.xattrs(link) == {}
        check_errno(errno.EEXIST, fs.create, link, 0o644)
        check_errno(errno.EEXIST, fs.mkdir, link, 0o755)
        check_errno(errno.EEXIST, fs.symlink, "x", link)
        check_errno(errno.EEXIST, fs.link, "mine", link)
        check_errno(errno.ENOTDIR, fs.rmdir, link)
        check_errno(errno.ELOOP, fs.open, link, os.O_RDONLY)
        fs.fsync(link)
        assert fs.lstat(link).kind == LNK
        a = fs.getattr(link)
        assert (a.kind, a.fmt, a.size) == (LNK, stat.S_IFLNK, len(fs.readlink(link).encode()))
    check_errno(errno.ENOTDIR, fs.listdir, "L")  # not followed, and not a directory
    if LINK_TARGETS[where][2]:  # operations that would write through a broken resolver
        for link in ("L", "F"):
            check_errno(errno.ELOOP, fs.write, link, 0, b"pwned")
            check_errno(errno.ELOOP, fs.truncate, link, 0)
            check_errno(errno.ELOOP, fs.fallocate, link, 0, 100)
            check_errno(errno.ELOOP, fs.copy_file_range, "mine", link, 0, 0, 100)
            check_errno(errno.ELOOP, fs.lock, link)
            for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_APPEND):
                check_errno(errno.ELOOP, fs.open, link, flags)
            check_errno(errno.EOPNOTSUPP, fs.chmod, link, 0o600)
            check_errno(errno.EPERM, fs.setxattr, link, "user.evil", b"1")
            check_errno(errno.EPERM, fs.removexattr, link, "user.keep")
            fs.utime(link, 42_000_000_007)
            assert fs.lstat(link).mtime_ns == 42_000_000_007
            fs.utime(link, 42_000_000_009, 43_000_000_011)
            assert (fs.getattr(link).mtime_ns, fs.getattr(link).atime_ns) == (42_000_000_009, 43_000_000_011)
            assert fs.lstat(link).mode == 0o777
    # the links themselves can be linked, renamed and removed
    fs.link("F", "F2")
    assert fs.lstat("F2").kind == LNK and fs.lstat("F").nlink == 2
    fs.rename("F2", "F3")
    assert fs.readlink("F3") == ftarget
    fs.unlink("F3")
    fs.unlink("F")
    fs.unlink("L")
    assert env.outside_snapshot() == outside_before
    now = _inside_state(fs)
    assert now[:6] == inside_before[:6] and now[7] == inside_before[7]
    if where == "etc" and env.real:
        _etc_untouched()


def test_chmod_symlink_is_eopnotsupp(fs):
    mkfile(fs, "t", b"x", 0o600)
    fs.symlink("t", "l")
    check_errno(errno.EOPNOTSUPP, fs.chmod, "l", 0o644)
    assert fs.lstat("l").mode == 0o777
    assert fs.lstat("t").mode == 0o600


def test_utime_symlink_changes_only_the_link(env, fs):
    mkfile(fs, "t", b"x")
    fs.utime("t", T1)
    fs.symlink("t", "l")
    t_before = fs.lstat("t")
    fs.utime("l", 5_000_000_001)
    assert fs.lstat("l").mtime_ns == 5_000_000_001
    assert fs.lstat("t") == t_before
    if env.real:
        assert os.lstat(env.root / "l").st_mtime_ns == 5_000_000_001
        assert os.stat(env.root / "t").st_mtime_ns == T1


def test_utime_dangling_and_outside_symlink(env, fs):
    fs.symlink("nowhere", "dangling")
    fs.symlink(str(env.outside / "victim"), "out")
    before = env.outside_snapshot()
    fs.utime("dangling", 7)
    fs.utime("out", 8)
    assert fs.lstat("dangling").mtime_ns == 7
    assert fs.lstat("out").mtime_ns == 8
    assert not fs.exists("nowhere")
    assert env.outside_snapshot() == before


# --------------------------------------------------------------------------- hardlinks


def test_link_shares_content_and_counts(env, fs):
    mkfile(fs, "a", b"one", 0o640)
    fs.mkdir("d", 0o755)
    fs.link("a", "d/b")
    sa, sb = fs.lstat("a"), fs.lstat("d/b")
    assert sa.ino == sb.ino and sa.nlink == sb.nlink == 2
    assert sb.mode == 0o640
    fs.write("d/b", 3, b" two")
    assert fs.read_all("a") == b"one two"
    fs.chmod("a", 0o600)
    assert fs.lstat("d/b").mode == 0o600
    fs.setxattr("a", "user.x", b"y")
    assert fs.getxattr("d/b", "user.x") == b"y"
    fs.utime("d/b", T1)
    assert fs.lstat("a").mtime_ns == T1
    fs.link("d/b", "c")
    assert fs.lstat("a").nlink == 3
    fs.unlink("a")
    assert fs.lstat("c").nlink == 2
    fs.unlink("d/b")
    assert fs.lstat("c").nlink == 1
    assert fs.read_all("c") == b"one two"


def test_link_updates_ctime_not_mtime(env, fs):
    mkfile(fs, "a", b"x")
    fs.utime("a", T1)
    before = fs.lstat("a")
    env.tick()
    fs.link("a", "b")
    after = fs.lstat("a")
    assert after.mtime_ns == T1
    assert after.ctime_ns > before.ctime_ns


def test_link_of_a_dir_is_eperm(fs):
    fs.mkdir("d", 0o755)
    check_errno(errno.EPERM, fs.link, "d", "d2")
    assert fs.listdir("") == ["d"]


def test_link_to_an_existing_name_is_eexist(fs):
    mkfile(fs, "a", b"a")
    mkfile(fs, "b", b"b")
    fs.mkdir("d", 0o755)
    fs.symlink("nowhere", "l")
    for dst in ("b", "d", "l", "a"):
        check_errno(errno.EEXIST, fs.link, "a", dst)
    check_errno(errno.EEXIST, fs.link, "d", "b")  # EEXIST wins over EPERM
    assert fs.read_all("b") == b"b"
    assert fs.lstat("a").nlink == 1


def test_link_errors(fs):
    mkfile(fs, "f")
    check_errno(errno.ENOENT, fs.link, "missing", "x")
    check_errno(errno.ENOENT, fs.link, "f", "nodir/x")
    check_errno(errno.ENOTDIR, fs.link, "f", "f/x")
    check_errno(errno.ENOTDIR, fs.link, "f/x", "y")
    check_errno(errno.ENOENT, fs.link, "missing", "f/x")  # the source is looked up first
    check_errno(errno.ENOENT, fs.link, "missing", "nodir/x")
    assert fs.listdir("") == ["f"]


def test_link_of_symlinks_and_specials(env, fs):
    fs.symlink("nowhere", "l")
    env.special("p", 0o600)
    fs.link("l", "l2")
    fs.link("p", "p2")
    assert fs.lstat("l2").kind == LNK and fs.readlink("l2") == "nowhere"
    assert fs.lstat("l").nlink == 2
    assert fs.lstat("p2").kind == OTHER and fs.lstat("p").nlink == 2
    assert not fs.exists("nowhere")


# --------------------------------------------------------------------------- chmod / utime


@pytest.mark.parametrize("mode", MODES, ids=oct)
def test_chmod_exact_bits(fs, mode):
    skip_unless_root_for(mode)
    mkfile(fs, "f", b"x", 0o644)
    fs.mkdir("d", 0o755)
    fs.chmod("f", mode)
    fs.chmod("d", mode)
    assert fs.lstat("f").mode == mode
    assert fs.lstat("d").mode == mode
    assert fs.read_all("f") == b"x"  # permissions are not modelled as a barrier for root


def test_chmod_changes_ctime_not_mtime(env, fs):
    mkfile(fs, "f", b"x")
    fs.utime("f", T1)
    before = fs.lstat("f")
    env.tick()
    fs.chmod("f", 0o600)
    after = fs.lstat("f")
    assert after.mode == 0o600
    assert after.mtime_ns == T1
    assert after.ctime_ns > before.ctime_ns


def test_chmod_and_utime_of_special_files(env, fs):
    env.special("p", 0o644)
    fs.chmod("p", 0o4711 if IS_ROOT else 0o711)
    fs.utime("p", T1)
    st = fs.lstat("p")
    assert st.kind == OTHER and st.mode == (0o4711 if IS_ROOT else 0o711) and st.mtime_ns == T1


def test_chmod_utime_errors(fs):
    mkfile(fs, "f")
    check_errno(errno.ENOENT, fs.chmod, "missing", 0o644)
    check_errno(errno.ENOENT, fs.utime, "missing", 1)
    check_errno(errno.ENOTDIR, fs.chmod, "f/x", 0o644)
    check_errno(errno.ENOTDIR, fs.utime, "f/x", 1)


@pytest.mark.parametrize("mtime", [0, 1, 999_999_999, 1_000_000_000, T1, 4_102_444_800_000_000_001, -1_000_000_001])
def test_utime_sets_mtime_ns_exactly(env, fs, mtime):
    mkfile(fs, "f", b"x")
    fs.mkdir("d", 0o755)
    before = fs.lstat("f")
    env.tick()
    fs.utime("f", mtime)
    fs.utime("d", mtime)
    after = fs.lstat("f")
    assert after.mtime_ns == mtime
    assert fs.lstat("d").mtime_ns == mtime
    assert after.ctime_ns > before.ctime_ns
    assert fs.read_all("f") == b"x"


# --------------------------------------------------------------------------- xattrs


@pytest.mark.parametrize("kind", ["file", "dir", "root"])
def test_xattr_roundtrip(env, fs, kind):
    path = {"file": "f", "dir": "d", "root": ""}[kind]
    if kind == "file":
        mkfile(fs, "f", b"content")
    elif kind == "dir":
        fs.mkdir("d", 0o755)
    base = set(fs.listxattr(path))
    fs.setxattr(path, "user.a", b"1")
    fs.setxattr(path, "user.b", b"\0\xffbinary\n")
    fs.setxattr(path, "user.empty", b"")
    assert set(fs.listxattr(path)) - base == {"user.a", "user.b", "user.empty"}
    assert fs.getxattr(path, "user.a") == b"1"
    assert fs.getxattr(path, "user.b") == b"\0\xffbinary\n"
    assert fs.getxattr(path, "user.empty") == b""
    fs.setxattr(path, "user.a", b"replaced value")
    assert fs.getxattr(path, "user.a") == b"replaced value"
    fs.removexattr(path, "user.a")
    check_errno(errno.ENODATA, fs.getxattr, path, "user.a")
    assert set(fs.listxattr(path)) - base == {"user.b", "user.empty"}
    assert {k: v for k, v in fs.xattrs(path).items() if k.startswith("user.")} == {"user.b": b"\0\xffbinary\n", "user.empty": b""}
    if kind == "file":
        assert fs.read_all("f") == b"content"


def test_fresh_entries_have_no_xattrs(fs):
    mkfile(fs, "f")
    fs.mkdir("d", 0o755)
    assert fs.listxattr("f") == []
    assert fs.listxattr("d") == []
    assert fs.xattrs("f") == {}


def test_xattr_missing_is_enodata(fs):
    mkfile(fs, "f")
    fs.mkdir("d", 0o755)
    for p in ("f", "d"):
        check_errno(errno.ENODATA, fs.getxattr, p, "user.missing")
        check_errno(errno.ENODATA, fs.removexattr, p, "user.missing")


def test_xattr_bad_names(fs):
    mkfile(fs, "f")
    check_errno(errno.EOPNOTSUPP, fs.setxattr, "f", "noprefix", b"v")
    check_errno(errno.EOPNOTSUPP, fs.setxattr, "f", "bogus.name", b"v")
    check_errno(errno.EOPNOTSUPP, fs.getxattr, "f", "bogus.name")
    check_errno(errno.EINVAL, fs.setxattr, "f", "user.", b"v")
    check_errno(errno.EINVAL, fs.getxattr, "f", "user.")
    check_errno(errno.EINVAL, fs.removexattr, "f", "user.")
    check_errno(errno.ERANGE, fs.setxattr, "f", "user." + "x" * 251, b"v")
    check_errno(errno.ERANGE, fs.getxattr, "f", "user." + "x" * 251)
    check_errno(errno.ERANGE, fs.removexattr, "f", "user." + "x" * 251)
    check_errno(errno.ERANGE, fs.setxattr, "f", "x" * 300, b"v")
    check_errno(errno.ERANGE, fs.setxattr, "f", "", b"v")
    fs.setxattr("f", "user." + "x" * 250, b"longest")  # 255 bytes: allowed
    assert fs.listxattr("f") == ["user." + "x" * 250]


@pytest.mark.skipif(not IS_ROOT, reason="trusted.* xattrs need CAP_SYS_ADMIN")
def test_trusted_xattrs_as_root(fs):
    mkfile(fs, "f")
    fs.setxattr("f", "trusted.t", b"v")
    assert fs.getxattr("f", "trusted.t") == b"v"
    assert "trusted.t" in fs.listxattr("f")
    fs.removexattr("f", "trusted.t")
    assert fs.listxattr("f") == []


def test_xattrs_on_symlinks(fs):
    mkfile(fs, "t")
    fs.setxattr("t", "user.t", b"target's")
    fs.symlink("t", "l")
    assert fs.listxattr("l") == []
    check_errno(errno.EPERM, fs.setxattr, "l", "user.a", b"1")
    check_errno(errno.ENODATA, fs.getxattr, "l", "user.t")
    check_errno(errno.EPERM, fs.removexattr, "l", "user.t")
    assert fs.xattrs("t") == {"user.t": b"target's"}


def test_user_xattrs_on_special_files(env, fs):
    env.special("p")
    assert fs.listxattr("p") == []
    check_errno(errno.EPERM, fs.setxattr, "p", "user.a", b"1")
    check_errno(errno.ENODATA, fs.getxattr, "p", "user.a")
    check_errno(errno.EPERM, fs.removexattr, "p", "user.a")
    assert fs.listxattr("p") == []


@pytest.mark.skipif(not IS_ROOT, reason="trusted.* xattrs need CAP_SYS_ADMIN")
def test_trusted_xattrs_on_symlinks_fifos_and_sockets_as_root(env, fs):
    """The one namespace a privileged server can keep on every kind of entry: a symlink's
    are its own (never its target's), a fifo's and a socket's too; user.* stays refused."""
    mkfile(fs, "t")
    fs.symlink("t", "l")
    env.special("p")
    env.special("s", fmt=stat.S_IFSOCK)
    for p in ("l", "p", "s"):
        fs.setxattr(p, "trusted.o", b"1:2")
        assert fs.getxattr(p, "trusted.o") == b"1:2" and fs.listxattr(p) == ["trusted.o"], p
        assert fs.getattr_xattr_names(p)[1] == ["trusted.o"], p
        check_errno(errno.EPERM, fs.setxattr, p, "user.a", b"1")
        check_errno(errno.ENODATA, fs.getxattr, p, "trusted.none")
    assert fs.listxattr("t") == []  # the symlink's target is untouched
    fs.link("p", "p2")  # one inode, one value under every name
    assert fs.getxattr("p2", "trusted.o") == b"1:2"
    for p in ("l", "p", "s"):
        fs.removexattr(p, "trusted.o")
        assert fs.listxattr(p) == [], p
    check_errno(errno.ENODATA, fs.removexattr, "l", "trusted.o")


def test_trusted_xattrs_without_cap_sys_admin(tmp_path):
    """The model of an unprivileged server (what a real one gets from Linux, checked below
    when not root): trusted.* is refused on every kind and never listed."""
    fs = MemoryHostFS(trusted_xattrs=False)
    mkfile(fs, "f")
    fs.symlink("f", "l")
    for p in ("f", "l"):
        check_errno(errno.EPERM, fs.setxattr, p, "trusted.o", b"1:2")
        check_errno(errno.ENODATA, fs.getxattr, p, "trusted.o")
    privileged = MemoryHostFS()
    mkfile(privileged, "f")
    privileged.setxattr("f", "trusted.o", b"1")
    privileged.trusted_xattrs = False  # the same tree served by an unprivileged process
    assert privileged.listxattr("f") == [] and privileged.open("f", os.O_RDONLY).listxattr() == []
    if not IS_ROOT:
        (tmp_path / "f").write_bytes(b"")
        os.symlink("f", tmp_path / "l")
        real = RealHostFS(str(tmp_path))
        for p in ("f", "l"):
            check_errno(errno.EPERM, real.setxattr, p, "trusted.o", b"1:2")


def test_xattr_missing_path(fs):
    mkfile(fs, "f")
    check_errno(errno.ENOENT, fs.listxattr, "missing")
    check_errno(errno.ENOENT, fs.getxattr, "missing", "user.a")
    check_errno(errno.ENOENT, fs.setxattr, "missing", "user.a", b"1")
    check_errno(errno.ENOENT, fs.removexattr, "missing", "user.a")
    check_errno(errno.ENOTDIR, fs.setxattr, "f/x", "user.a", b"1")


def test_setxattr_changes_ctime_not_mtime(env, fs):
    mkfile(fs, "f", b"x")
    fs.utime("f", T1)
    before = fs.lstat("f")
    env.tick()
    fs.setxattr("f", "user.a", b"1")
    mid = fs.lstat("f")
    assert mid.mtime_ns == T1 and mid.ctime_ns > before.ctime_ns
    env.tick()
    fs.removexattr("f", "user.a")
    after = fs.lstat("f")
    assert after.mtime_ns == T1 and after.ctime_ns > mid.ctime_ns


# --------------------------------------------------------------------------- fallocate


def test_fallocate_mode0_extends_with_zeros(fs):
    mkfile(fs, "f", b"abc")
    fs.fallocate("f", 0, 10)
    assert fs.lstat("f").size == 10
    assert fs.read_all("f") == b"abc" + b"\0" * 7
    fs.fallocate("f", 20, 5)
    assert fs.read_all("f") == b"abc" + b"\0" * 22
    fs.fallocate("f", 0, 4)  # inside the file: nothing visible changes
    assert fs.read_all("f") == b"abc" + b"\0" * 22


def test_fallocate_keep_size(fs):
    mkfile(fs, "f", b"abc")
    fs.fallocate("f", 0, 1 << 16, KEEP_SIZE)
    assert fs.lstat("f").size == 3
    assert fs.read_all("f") == b"abc"
    fs.write("f", 5, b"z")  # data written later is not affected by the preallocation
    assert fs.read_all("f") == b"abc\0\0z"


def test_fallocate_punch_hole(fs):
    data = bytes(range(1, 201)) * 50  # 10000 bytes, no zeros
    mkfile(fs, "f", data)
    fs.fallocate("f", 100, 5000, PUNCH_HOLE | KEEP_SIZE)
    assert fs.lstat("f").size == len(data)
    assert fs.read_all("f") == data[:100] + b"\0" * 5000 + data[5100:]
    fs.fallocate("f", 9000, 5000, PUNCH_HOLE | KEEP_SIZE)  # past EOF: still no growth
    assert fs.lstat("f").size == len(data)
    assert fs.read_all("f") == data[:100] + b"\0" * 5000 + data[5100:9000] + b"\0" * 1000


def test_fallocate_zero_range(fs):
    mkfile(fs, "f", b"0123456789")
    fs.fallocate("f", 2, 3, ZERO_RANGE)
    assert fs.read_all("f") == b"01\0\0\x0056789"
    fs.fallocate("f", 8, 5, ZERO_RANGE | KEEP_SIZE)
    assert fs.read_all("f") == b"01\0\0\x00567\0\0"
    fs.fallocate("f", 8, 5, ZERO_RANGE)
    assert fs.read_all("f") == b"01\0\0\x00567" + b"\0" * 5


@pytest.mark.parametrize("mode", [0, KEEP_SIZE, PUNCH_HOLE | KEEP_SIZE])
def test_fallocate_sets_mtime_and_ctime(env, fs, mode):
    mkfile(fs, "f", b"0123456789")
    fs.utime("f", T1)
    before = fs.lstat("f")
    env.tick()
    fs.fallocate("f", 2, 3, mode)
    after = fs.lstat("f")
    assert after.mtime_ns != T1 and after.ctime_ns > before.ctime_ns


def test_fallocate_errors(env, fs):
    mkfile(fs, "f", b"0123456789")
    check_errno(errno.EINVAL, fs.fallocate, "f", 0, 0)
    check_errno(errno.EINVAL, fs.fallocate, "f", 0, -5)
    check_errno(errno.EINVAL, fs.fallocate, "f", -1, 5)
    check_errno(errno.EOPNOTSUPP, fs.fallocate, "f", 0, 5, PUNCH_HOLE)
    check_errno(errno.EOPNOTSUPP, fs.fallocate, "f", 0, 5, PUNCH_HOLE | ZERO_RANGE | KEEP_SIZE)
    check_errno(errno.EOPNOTSUPP, fs.fallocate, "f", 0, 5, 0x04)  # NO_HIDE_STALE
    check_errno(errno.ENOENT, fs.fallocate, "missing", 0, 5)
    assert fs.read_all("f") == b"0123456789"


# --------------------------------------------------------------------------- copy_file_range


def test_copy_file_range_whole_and_offsets(fs):
    mkfile(fs, "src", b"0123456789")
    fs.create("dst", 0o644)
    assert fs.copy_file_range("src", "dst", 0, 0, 10) == 10
    assert fs.read_all("dst") == b"0123456789"
    mkfile(fs, "dst2", b"abcdefghij")
    assert fs.copy_file_range("src", "dst2", 2, 5, 3) == 3
    assert fs.read_all("dst2") == b"abcde234ij"
    assert fs.read_all("src") == b"0123456789"


def test_copy_file_range_clamps_and_extends(fs):
    mkfile(fs, "src", b"0123456789")
    mkfile(fs, "dst", b"ab")
    assert fs.copy_file_range("src", "dst", 7, 0, 100) == 3  # only what the source has
    assert fs.read_all("dst") == b"789"
    assert fs.copy_file_range("src", "dst", 0, 6, 2) == 2  # past the destination's EOF
    assert fs.read_all("dst") == b"789\0\0\x0001"
    assert fs.copy_file_range("src", "dst", 10, 0, 5) == 0  # source exhausted
    assert fs.copy_file_range("src", "dst", 50, 100, 5) == 0  # nothing written, no growth
    assert fs.copy_file_range("src", "dst", 0, 100, 0) == 0
    assert fs.read_all("dst") == b"789\0\0\x0001"


def test_copy_file_range_within_one_file(fs):
    mkfile(fs, "f", b"0123456789")
    fs.link("f", "g")
    assert fs.copy_file_range("f", "f", 0, 6, 2) == 2
    assert fs.read_all("f") == b"0123450189"
    check_errno(errno.EINVAL, fs.copy_file_range, "f", "f", 0, 2, 4)  # overlapping
    check_errno(errno.EINVAL, fs.copy_file_range, "f", "g", 0, 0, 1)  # same inode through a hardlink
    assert fs.copy_file_range("f", "f", 9, 8, 5) == 1  # clamped to 1 byte first: no overlap
    assert fs.read_all("f") == b"0123450199"


def test_copy_file_range_errors(env, fs):
    mkfile(fs, "src", b"abc")
    mkfile(fs, "dst", b"xyz")
    check_errno(errno.ENOENT, fs.copy_file_range, "missing", "dst", 0, 0, 1)
    check_errno(errno.ENOENT, fs.copy_file_range, "src", "missing", 0, 0, 1)
    check_errno(errno.EOVERFLOW, fs.copy_file_range, "src", "dst", -1, 0, 1)
    check_errno(errno.EOVERFLOW, fs.copy_file_range, "src", "dst", 0, -1, 1)
    check_errno(errno.EINVAL, fs.copy_file_range, "src", "dst", 0, 0, -1)
    assert fs.read_all("dst") == b"xyz"


def test_copy_file_range_sets_destination_times(env, fs):
    mkfile(fs, "src", b"abc")
    mkfile(fs, "dst", b"")
    fs.utime("src", T1)
    fs.utime("dst", T1)
    env.tick()
    assert fs.copy_file_range("src", "dst", 0, 0, 3) == 3
    assert fs.lstat("dst").mtime_ns != T1
    assert fs.lstat("src").mtime_ns == T1


# --------------------------------------------------------------------------- special files


@pytest.mark.timeout(10)
def test_special_file_is_never_opened(env, fs):
    env.special("p", 0o644)
    mkfile(fs, "f", b"abc")
    st = fs.lstat("p")
    assert (st.kind, st.mode, st.size, st.nlink) == (OTHER, 0o644, 0, 1)
    check_errno(errno.EPERM, fs.read, "p", 0, 10)
    check_errno(errno.EPERM, fs.read_all, "p")
    check_errno(errno.EPERM, fs.write, "p", 0, b"x")
    check_errno(errno.EPERM, fs.write_all, "p", 0, b"x")
    check_errno(errno.EPERM, fs.truncate, "p", 0)
    check_errno(errno.EPERM, fs.fallocate, "p", 0, 10)
    check_errno(errno.EPERM, fs.copy_file_range, "p", "f", 0, 0, 3)
    check_errno(errno.EPERM, fs.copy_file_range, "f", "p", 0, 0, 3)
    check_errno(errno.EPERM, fs.lock, "p")
    check_errno(errno.ENOTDIR, fs.listdir, "p")
    check_errno(errno.ENOTDIR, fs.lstat, "p/x")
    check_errno(errno.ENOTDIR, fs.create, "p/x", 0o644)
    fs.fsync("p")
    assert fs.lstat("p").kind == OTHER
    assert fs.read_all("f") == b"abc"
    if env.real:
        assert stat.S_ISFIFO(os.lstat(env.root / "p").st_mode)


@pytest.mark.skipif(not IS_ROOT, reason="mknod of a device needs CAP_MKNOD")
@pytest.mark.timeout(10)
def test_real_device_node_is_never_opened(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    try:
        os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("no CAP_MKNOD in this container")
    fs = RealHostFS(str(root))
    try:
        assert fs.lstat("null").kind == OTHER
        a = fs.getattr("null")
        assert (a.kind, a.fmt, a.rdev) == (OTHER, stat.S_IFCHR, os.makedev(1, 3))
        for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR | os.O_APPEND):
            check_errno(errno.EPERM, fs.open, "null", flags)
        check_errno(errno.EPERM, fs.read, "null", 0, 1)
        check_errno(errno.EPERM, fs.write, "null", 0, b"x")
        check_errno(errno.EPERM, fs.truncate, "null", 0)
        check_errno(errno.EPERM, fs.lock, "null")
        fs.fsync("null")
    finally:
        fs.close()


# --------------------------------------------------------------------------- mknod (fifos, sockets)


SPECIAL_FMTS = [stat.S_IFIFO, stat.S_IFSOCK]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("fmt", SPECIAL_FMTS, ids=["fifo", "sock"])
@pytest.mark.parametrize("mode", MODES, ids=oct)
def test_mknod_applies_type_and_mode_exactly(env, fs, fmt, mode):
    skip_unless_root_for(mode)
    old = os.umask(0o077)
    try:
        fs.mknod("n", mode, fmt)
    finally:
        os.umask(old)
    st, a = fs.lstat("n"), fs.getattr("n")
    assert (st.kind, st.fmt, st.mode, st.size, st.nlink) == (OTHER, fmt, mode, 0, 1)
    assert (a.kind, a.fmt, a.mode, a.rdev) == (OTHER, fmt, mode, 0)
    assert Attr.from_stat(st).fmt == fmt
    check_errno(errno.EPERM, fs.read, "n", 0, 1)  # made, never opened (a fifo without a reader would block)
    check_errno(errno.EPERM, fs.open, "n", os.O_WRONLY)
    if env.real:
        assert stat.S_IFMT(os.lstat(env.root / "n").st_mode) == fmt


def test_mknod_masks_mode_and_updates_parent(env, fs):
    fs.mkdir("d", 0o755)
    fs.utime("d", T1)
    env.tick()
    fs.mknod("d/p", stat.S_IFIFO | 0o640, stat.S_IFIFO)
    assert fs.lstat("d/p").mode == 0o640
    d = fs.lstat("d")
    assert d.mtime_ns != T1 and d.mtime_ns == d.ctime_ns
    assert fs.listdir("d") == ["p"]


@pytest.mark.parametrize("fmt", [stat.S_IFCHR, stat.S_IFBLK, stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, 0, 0o7777],
                         ids=["chr", "blk", "reg", "dir", "lnk", "zero", "junk"])
def test_mknod_never_makes_devices_or_other_types(env, fs, fmt):
    check_errno(errno.EPERM, fs.mknod, "n", 0o644, fmt)
    assert not fs.exists("n")


def test_mknod_errors(env, fs):
    mkfile(fs, "f")
    fs.symlink("f", "l")
    fs.mkdir("d", 0o755)
    for path in ("f", "l", "d"):
        check_errno(errno.EEXIST, fs.mknod, path, 0o644, stat.S_IFIFO)
    check_errno(errno.ENOENT, fs.mknod, "missing/p", 0o644, stat.S_IFIFO)
    check_errno(errno.ENOTDIR, fs.mknod, "f/p", 0o644, stat.S_IFIFO)
    check_errno(errno.ELOOP, fs.mknod, "l/p", 0o644, stat.S_IFSOCK)
    check_errno(errno.EBUSY, fs.mknod, "", 0o644, stat.S_IFIFO)
    assert sorted(fs.listdir("")) == ["d", "f", "l"]


def test_special_nodes_metadata_and_entry_ops(env, fs):
    """What the undo core needs on a fifo/socket: chmod, utime (no follow), rename, link, unlink."""
    fs.mknod("p", 0o644, stat.S_IFIFO)
    fs.mknod("s", 0o600, stat.S_IFSOCK)
    fs.chmod("p", 0o1711 if IS_ROOT else 0o711)
    fs.utime("p", T1, T1 - 5)
    a = fs.getattr("p")
    assert (a.mode, a.mtime_ns, a.atime_ns) == (0o1711 if IS_ROOT else 0o711, T1, T1 - 5)
    assert fs.listxattr("p") == []
    check_errno(errno.EPERM, fs.setxattr, "s", "user.x", b"1")  # the kernel keeps user xattrs off specials
    fs.rename("s", "s2")
    fs.link("p", "p2")
    assert fs.lstat("p2").nlink == 2 and fs.lstat("s2").fmt == stat.S_IFSOCK
    fs.unlink("p")
    fs.unlink("p2")
    fs.unlink("s2")
    assert fs.listdir("") == []


def test_stat_fmt_of_every_kind(env, fs):
    mkfile(fs, "f")
    fs.mkdir("d", 0o755)
    fs.symlink("f", "l")
    want = {"f": stat.S_IFREG, "d": stat.S_IFDIR, "l": stat.S_IFLNK, "": stat.S_IFDIR}
    for path, fmt in want.items():
        st = fs.lstat(path)
        assert st.fmt == fmt and st.file_type == fmt, path
    assert Stat(OTHER, 0o644, 0, 1, 1, 9, 1).file_type == stat.S_IFIFO  # fmt unknown: the kind's usual one


# --------------------------------------------------------------------------- open handles


ACCESS_FLAGS = [os.O_RDONLY, os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_APPEND, os.O_WRONLY | os.O_APPEND,
                os.O_RDWR | os.O_APPEND]
BAD_OPEN_FLAGS = {
    "O_CREAT": os.O_RDWR | os.O_CREAT,
    "O_TRUNC": os.O_WRONLY | os.O_TRUNC,
    "O_EXCL": os.O_RDWR | os.O_CREAT | os.O_EXCL,
    "O_ACCMODE": os.O_ACCMODE,
    "O_NONBLOCK": os.O_RDONLY | os.O_NONBLOCK,
    "O_DIRECTORY": os.O_RDONLY | os.O_DIRECTORY,
    "O_NOFOLLOW": os.O_RDONLY | os.O_NOFOLLOW,
    "O_PATH": os.O_PATH,
    "O_SYNC": os.O_WRONLY | os.O_SYNC,
    "O_CLOEXEC": os.O_RDONLY | os.O_CLOEXEC,
    "O_NOCTTY": os.O_RDONLY | os.O_NOCTTY,
}


def _flag_id(flags: int) -> str:
    names = {os.O_RDONLY: "RDONLY", os.O_WRONLY: "WRONLY", os.O_RDWR: "RDWR"}
    return names[flags & os.O_ACCMODE] + ("|APPEND" if flags & os.O_APPEND else "")


def test_open_read_write_roundtrip(fs):
    mkfile(fs, "f", b"0123456789")
    h = fs.open("f", os.O_RDWR)
    assert isinstance(h, FileHandle)
    assert (h.path, h.flags, h.closed) == ("f", os.O_RDWR, False)
    assert h.pread(4, 2) == b"2345"
    assert h.pread(100, 8) == b"89"
    assert h.pread(10, 10) == b"" and h.pread(10, 1000) == b"" and h.pread(0, 3) == b""
    assert h.pwrite(b"ab", 3) == 2
    assert fs.read_all("f") == b"012ab56789"  # visible through the path at once
    fs.write("f", 0, b"P")
    assert h.pread(3, 0) == b"P12"  # and the other way round
    assert h.pwrite(b"Z", 12) == 1  # past EOF: zero-filled
    assert h.pread(100, 0) == b"P12ab56789\0\0Z"
    assert h.fstat().size == 13 == fs.lstat("f").size
    h.truncate(4)
    assert fs.read_all("f") == b"P12a"
    h.truncate(6)
    assert h.pread(10, 0) == b"P12a\0\0"
    h.fsync()
    h.fsync(datasync=True)
    h.close()
    assert h.closed
    assert fs.read_all("f") == b"P12a\0\0"


@pytest.mark.parametrize("flags", ACCESS_FLAGS, ids=_flag_id)
def test_open_accepts_every_access_mode(fs, flags):
    mkfile(fs, "f", b"abc")
    with fs.open("f", flags) as h:
        assert h.flags == flags
        assert h.fstat().size == 3
    assert h.closed


@pytest.mark.parametrize("name", list(BAD_OPEN_FLAGS))
def test_open_with_other_flags_is_einval_and_touches_nothing(env, fs, name):
    flags = BAD_OPEN_FLAGS[name]
    mkfile(fs, "f", b"keep")
    fs.utime("f", T1)
    before = fs.lstat("f")
    env.tick()
    check_errno(errno.EINVAL, fs.open, "f", flags)
    check_errno(errno.EINVAL, fs.open, "missing", flags)  # checked before the lookup: nothing is created
    check_errno(errno.EINVAL, fs.open, "d/missing", flags)
    assert fs.lstat("f") == before
    assert fs.read_all("f") == b"keep"
    assert fs.listdir("") == ["f"]


def test_open_errors(env, fs):
    mkfile(fs, "f", b"abc")
    fs.mkdir("d", 0o755)
    fs.symlink("f", "l")
    fs.symlink("nowhere", "dangling")
    fs.symlink("d", "ld")
    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR | os.O_APPEND):
        check_errno(errno.EISDIR, fs.open, "d", flags)
        check_errno(errno.ELOOP, fs.open, "l", flags)
        check_errno(errno.ELOOP, fs.open, "dangling", flags)
        check_errno(errno.ELOOP, fs.open, "ld", flags)
        check_errno(errno.ELOOP, fs.open, "ld/x", flags)
        check_errno(errno.ENOENT, fs.open, "missing", flags)
        check_errno(errno.ENOENT, fs.open, "missing/x", flags)
        check_errno(errno.ENOTDIR, fs.open, "f/x", flags)
    assert not fs.exists("nowhere") and not fs.exists("missing")
    assert fs.read_all("f") == b"abc"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("fmt", [stat.S_IFIFO, stat.S_IFSOCK], ids=["fifo", "socket"])
def test_open_of_a_special_file_is_eperm_and_never_opens_it(env, fs, fmt):
    env.special("p", 0o666, fmt)
    before = fs.lstat("p")
    for flags in ACCESS_FLAGS:  # a real fifo opened for reading or writing would block here
        check_errno(errno.EPERM, fs.open, "p", flags)
    assert fs.lstat("p") == before
    if env.real:
        assert stat.S_IFMT(os.lstat(env.root / "p").st_mode) == fmt


def test_handle_access_modes(fs):
    mkfile(fs, "f", b"0123456789")
    ro = fs.open("f", os.O_RDONLY)
    check_errno(errno.EBADF, ro.pwrite, b"x", 0)
    check_errno(errno.EBADF, ro.pwrite, b"", 0)  # even an empty write
    check_errno(errno.EINVAL, ro.truncate, 0)  # what ftruncate(2) of a read-only fd says
    check_errno(errno.EINVAL, ro.truncate, 100)
    assert ro.pread(3, 0) == b"012"
    ro.fsync()
    ro.fsync(datasync=True)
    ro_app = fs.open("f", os.O_RDONLY | os.O_APPEND)
    check_errno(errno.EBADF, ro_app.pwrite, b"x", 0)
    wo = fs.open("f", os.O_WRONLY)
    check_errno(errno.EBADF, wo.pread, 3, 0)
    check_errno(errno.EBADF, wo.pread, 0, 0)  # even an empty read
    assert wo.pwrite(b"W", 0) == 1
    wo.truncate(5)
    assert wo.fstat().size == 5
    assert ro.pread(100, 0) == b"W1234"
    for h in (ro, ro_app, wo):
        h.close()
    assert fs.read_all("f") == b"W1234"


def test_handle_negative_arguments_are_einval(fs):
    mkfile(fs, "f", b"0123456789")
    rw = fs.open("f", os.O_RDWR)
    app = fs.open("f", os.O_WRONLY | os.O_APPEND)
    wo = fs.open("f", os.O_WRONLY)
    ro = fs.open("f", os.O_RDONLY)
    check_errno(errno.EINVAL, rw.pread, -1, 0)
    check_errno(errno.EINVAL, rw.pread, 1, -1)
    check_errno(errno.EINVAL, rw.pwrite, b"x", -1)
    check_errno(errno.EINVAL, app.pwrite, b"x", -1)  # checked before O_APPEND moves the offset
    check_errno(errno.EINVAL, rw.truncate, -1)
    check_errno(errno.EINVAL, wo.pread, 1, -1)  # the offset is checked before the access mode
    check_errno(errno.EINVAL, ro.pwrite, b"x", -1)
    assert fs.read_all("f") == b"0123456789"
    for h in (rw, app, wo, ro):
        h.close()


def test_append_handle_appends_whatever_the_offset(env, fs):
    mkfile(fs, "f", b"abc")
    app = fs.open("f", os.O_WRONLY | os.O_APPEND)
    assert app.pwrite(b"X", 0) == 1
    assert app.pwrite(b"YZ", 1000) == 2  # no zero-fill up to 1000: appended
    assert fs.read_all("f") == b"abcXYZ"
    fs.utime("f", T1)
    env.tick()
    assert app.pwrite(b"", 0) == 0  # an empty append changes nothing
    assert fs.lstat("f").mtime_ns == T1 and fs.lstat("f").size == 6
    app.truncate(2)
    assert app.pwrite(b"!", 0) == 1  # at the new end
    rw = fs.open("f", os.O_RDWR | os.O_APPEND)
    assert rw.pread(10, 0) == b"ab!"
    assert rw.pwrite(b"?", 1) == 1
    assert fs.read_all("f") == b"ab!?"
    app.close()
    rw.close()


def test_handle_io_sets_times_like_path_io(env, fs):
    mkfile(fs, "f", b"ab")
    h = fs.open("f", os.O_RDWR)
    fs.utime("f", T1)
    before = fs.lstat("f")
    env.tick()
    assert h.pwrite(b"", 100) == 0  # an empty write changes nothing, not even the size
    assert h.pread(10, 0) == b"ab"
    after = fs.lstat("f")
    assert (after.size, after.mtime_ns, after.ctime_ns) == (2, T1, before.ctime_ns)
    h.pwrite(b"x", 0)
    mid = fs.lstat("f")
    assert mid.mtime_ns != T1 and mid.ctime_ns > before.ctime_ns
    fs.utime("f", T1)
    env.tick()
    h.truncate(2)  # same size: still a modification
    assert fs.lstat("f").mtime_ns != T1
    h.close()


def test_handle_fstat_is_the_files_getattr(env, fs):
    mkfile(fs, "f", b"x" * 5000, 0o640)
    fs.link("f", "g")
    fs.utime("f", T1, T1 + 1)
    with fs.open("f", os.O_RDONLY) as h:
        a = h.fstat()
        assert a == fs.getattr("f") == fs.getattr("g")
        assert (a.kind, a.fmt, a.mode, a.size, a.nlink, a.mtime_ns, a.atime_ns) == (REG, stat.S_IFREG, 0o640, 5000, 2, T1, T1 + 1)
        assert a.ino == fs.lstat("f").ino


def test_handle_survives_unlink(env, fs):
    mkfile(fs, "f", b"data", 0o600)
    ino = fs.lstat("f").ino
    h = fs.open("f", os.O_RDWR)
    other = fs.open("f", os.O_RDONLY)
    fs.unlink("f")
    assert not fs.exists("f") and fs.listdir("") == []
    assert h.pwrite(b"more", 4) == 4
    assert h.pread(100, 0) == b"datamore"
    assert other.pread(100, 0) == b"datamore"  # the same inode through another handle
    a = h.fstat()
    assert (a.kind, a.size, a.nlink, a.ino, a.mode) == (REG, 8, 0, ino, 0o600)
    h.truncate(2)
    h.fsync()
    assert other.pread(100, 0) == b"da"
    mkfile(fs, "f", b"new file")  # a new file at the old path is another inode
    assert fs.lstat("f").ino != ino
    assert h.pread(100, 0) == b"da"
    h.pwrite(b"!", 2)
    assert fs.read_all("f") == b"new file"
    h.close()
    other.close()


def test_handle_follows_rename(env, fs):
    fs.mkdir("d", 0o755)
    fs.mkdir("e", 0o755)
    mkfile(fs, "d/f", b"0123")
    ino = fs.lstat("d/f").ino
    h = fs.open("d/f", os.O_RDWR)
    fs.rename("d/f", "e/g")
    assert h.pwrite(b"AB", 0) == 2
    assert fs.read_all("e/g") == b"AB23"
    fs.rename("e", "e2")  # the parent moves too
    h.pwrite(b"C", 4)
    assert fs.read_all("e2/g") == b"AB23C"
    assert h.fstat().ino == ino == fs.lstat("e2/g").ino
    assert h.path == "d/f"  # diagnostics only: the path at open time
    mkfile(fs, "x", b"replacement")
    fs.rename("x", "e2/g")  # the name now holds another inode; the handle keeps the old one
    h.pwrite(b"Z", 0)
    assert fs.read_all("e2/g") == b"replacement"
    assert h.pread(10, 0) == b"ZB23C" and h.fstat().nlink == 0
    h.close()


def test_handle_sees_hardlink_writes(fs):
    mkfile(fs, "a", b"one")
    fs.link("a", "b")
    with fs.open("b", os.O_RDWR) as h:
        fs.write("a", 3, b" two")
        assert h.pread(100, 0) == b"one two"
        h.pwrite(b"ONE", 0)
        assert fs.read_all("a") == b"ONE two"
        assert h.fstat().nlink == 2


def test_handle_close_is_idempotent_then_ebadf(fs):
    mkfile(fs, "f", b"abc")
    h = fs.open("f", os.O_RDWR)
    keep = fs.open("f", os.O_RDONLY)
    h.close()
    h.close()
    assert h.closed and not keep.closed
    check_errno(errno.EBADF, h.pread, 1, 0)
    check_errno(errno.EBADF, h.pwrite, b"x", 0)
    check_errno(errno.EBADF, h.truncate, 0)
    check_errno(errno.EBADF, h.fsync)
    check_errno(errno.EBADF, h.fsync, True)
    check_errno(errno.EBADF, h.fstat)
    check_errno(errno.EBADF, h.pread, -1, -1)  # closed wins over bad arguments
    assert keep.pread(10, 0) == b"abc"  # another handle on the same file is unaffected
    assert fs.read_all("f") == b"abc"
    with fs.open("f", os.O_RDONLY) as h2:
        pass
    check_errno(errno.EBADF, h2.pread, 1, 0)
    assert "closed" in repr(h2) and "'f'" in repr(h2)
    keep.close()


def test_many_handles_on_one_file(fs):
    mkfile(fs, "f")
    handles = [fs.open("f", os.O_RDWR) for _ in range(20)]
    for i, h in enumerate(handles):
        h.pwrite(bytes([65 + i]), i)
    assert fs.read_all("f") == bytes(range(65, 85))
    for h in handles:
        h.close()


def test_handle_is_bound_to_its_inode_not_its_path(env, fs):
    """Turning the opened path into a symlink to the outside never redirects the handle."""
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/f", b"inside")
    mkfile(fs, "g", b"gee")
    outside = str(env.outside)
    hf = fs.open("d/f", os.O_RDWR)
    hg = fs.open("g", os.O_WRONLY | os.O_APPEND)
    before = env.outside_snapshot()
    fs.rename("d", "moved")
    fs.symlink(outside, "d")  # d/victim would now be the outside victim
    fs.unlink("g")
    fs.symlink(f"{outside}/victim", "g")  # and g the victim itself
    assert hf.pwrite(b"HANDLE", 0) == 6
    hf.truncate(4)
    hf.fsync()
    assert hg.pwrite(b"+", 0) == 1
    hg.truncate(1)
    assert hg.fstat().nlink == 0
    assert fs.read_all("moved/f") == b"HAND"
    assert hf.fstat().ino == fs.lstat("moved/f").ino
    check_errno(errno.ELOOP, fs.open, "d/victim", os.O_RDWR)
    check_errno(errno.ELOOP, fs.open, "g", os.O_RDWR)
    hf.close()
    hg.close()
    assert env.outside_snapshot() == before
    if env.real:
        assert (env.outside / "victim").read_bytes() == b"precious outside data"


# metadata through a handle (fchmod, futimens, f*xattr): the handle's inode, never the path's


@pytest.mark.parametrize("how", ["unlink", "rename"])
@pytest.mark.parametrize("flags", [os.O_RDONLY, os.O_WRONLY, os.O_RDWR], ids=_flag_id)
def test_handle_metadata_reaches_its_inode_not_a_new_file_at_its_path(env, fs, flags, how):
    mkfile(fs, "f", b"old", 0o644)
    fs.setxattr("f", "user.keep", b"old")
    ino = fs.lstat("f").ino
    h = fs.open("f", flags)  # no access mode is needed for metadata
    if how == "unlink":
        fs.unlink("f")
    else:
        fs.rename("f", "moved")
    mkfile(fs, "f", b"new file", 0o640)
    fs.setxattr("f", "user.new", b"new")
    fs.utime("f", T1)
    new_before = (fs.lstat("f"), fs.xattrs("f"), fs.read_all("f"))
    h.chmod(0o4600 if IS_ROOT else 0o600)
    h.utime(T1 + 7, 5)
    h.setxattr("user.k", b"v")
    h.removexattr("user.keep")
    assert h.listxattr() == ["user.k"] and h.getxattr("user.k") == b"v" and h.xattrs() == {"user.k": b"v"}
    check_errno(errno.ENODATA, h.getxattr, "user.keep")
    check_errno(errno.ENODATA, h.removexattr, "user.keep")
    a = h.fstat()
    assert (a.ino, a.mode, a.mtime_ns, a.atime_ns) == (ino, 0o4600 if IS_ROOT else 0o600, T1 + 7, 5)
    h.utime(T1 + 9)  # atime None: kept
    assert (h.fstat().mtime_ns, h.fstat().atime_ns) == (T1 + 9, 5)
    assert (fs.lstat("f"), fs.xattrs("f"), fs.read_all("f")) == new_before  # its ctime too: untouched
    if how == "rename":
        st = fs.lstat("moved")
        assert (st.ino, st.mode, st.mtime_ns, fs.xattrs("moved")) == (ino, a.mode, T1 + 9, {"user.k": b"v"})
    h.close()


def test_handle_metadata_errors_and_closed_handle(fs):
    mkfile(fs, "f", b"x")
    h = fs.open("f", os.O_RDONLY)
    check_errno(errno.ENODATA, h.getxattr, "user.missing")
    check_errno(errno.ENODATA, h.removexattr, "user.missing")
    check_errno(errno.EOPNOTSUPP, h.setxattr, "bogus.name", b"v")
    check_errno(errno.EINVAL, h.setxattr, "user.", b"v")
    check_errno(errno.ERANGE, h.setxattr, "user." + "x" * 251, b"v")
    h.chmod(stat.S_IFREG | 0o7640 if IS_ROOT else 0o640)  # only the permission bits
    assert fs.lstat("f").mode == (0o7640 if IS_ROOT else 0o640)
    h.close()
    for fn, args in [(h.chmod, (0o600,)), (h.utime, (T1,)), (h.listxattr, ()), (h.getxattr, ("user.a",)),
                     (h.setxattr, ("user.a", b"1")), (h.removexattr, ("user.a",)), (h.xattrs, ())]:
        check_errno(errno.EBADF, fn, *args)
    assert fs.lstat("f").mode == (0o7640 if IS_ROOT else 0o640) and fs.listxattr("f") == []


def test_handle_metadata_never_reaches_outside(env, fs):
    """The handle's path turned into a symlink to the outside changes nothing out there."""
    mkfile(fs, "f", b"inside")
    h = fs.open("f", os.O_RDONLY)
    before = env.outside_snapshot()
    fs.unlink("f")
    fs.symlink(f"{env.outside}/victim", "f")
    h.chmod(0o777)
    h.utime(T1 + 1)
    h.setxattr("user.keep", b"overwritten?")
    h.removexattr("user.keep")
    h.close()
    assert env.outside_snapshot() == before


# create_handle: create, and a handle on the new inode itself


@pytest.mark.parametrize("flags", ACCESS_FLAGS, ids=_flag_id)
def test_create_handle_makes_the_file_and_a_handle_on_it(env, fs, flags):
    mode = 0o4751 if IS_ROOT else 0o751
    h = fs.create_handle("f", mode, flags)
    assert isinstance(h, FileHandle) and (h.path, h.flags, h.closed) == ("f", flags, False)
    st = fs.lstat("f")
    assert (st.kind, st.mode, st.size, st.nlink) == (REG, mode, 0, 1)
    assert h.fstat().ino == st.ino
    if flags & os.O_ACCMODE != os.O_RDONLY:
        assert h.pwrite(b"abc", 0) == 3
        assert fs.read_all("f") == b"abc"
    else:
        check_errno(errno.EBADF, h.pwrite, b"abc", 0)
    fs.rename("f", "g")
    mkfile(fs, "f", b"other")  # a new file at the name is never reached
    h.chmod(0o600)
    h.setxattr("user.a", b"1")
    assert fs.lstat("f").mode == 0o644 and fs.xattrs("f") == {} and fs.read_all("f") == b"other"
    assert fs.lstat("g").mode == 0o600 and fs.xattrs("g") == {"user.a": b"1"}
    h.close()


def test_create_handle_errors_are_creates(env, fs):
    mkfile(fs, "f", b"keep")
    fs.symlink("nowhere", "dangling")
    for p in ("f", "dangling"):
        check_errno(errno.EEXIST, fs.create_handle, p, 0o600)
    check_errno(errno.ENOENT, fs.create_handle, "missing/f", 0o600)
    check_errno(errno.ENOTDIR, fs.create_handle, "f/x", 0o600)
    check_errno(errno.EINVAL, fs.create_handle, "new", 0o600, os.O_RDWR | os.O_TRUNC)
    assert fs.read_all("f") == b"keep" and not fs.exists("nowhere")
    assert sorted(fs.listdir("")) == ["dangling", "f"]


# --------------------------------------------------------------------------- getattr


def _ceil512(n: int) -> int:
    return -(-n // 512)


def test_getattr_of_every_kind(env, fs):
    mkfile(fs, "f", b"y" * 10000, 0o640)
    fs.mkdir("d", 0o750)
    fs.symlink("f", "l")
    env.special("p", 0o604)
    fs.fsync("f")
    want = {"f": (REG, stat.S_IFREG), "d": (DIR, stat.S_IFDIR), "l": (LNK, stat.S_IFLNK), "p": (OTHER, stat.S_IFIFO),
            "": (DIR, stat.S_IFDIR)}
    for path, (kind, fmt) in want.items():
        a, st = fs.getattr(path), fs.lstat(path)
        assert isinstance(a, Attr)
        assert (a.kind, a.fmt) == (kind, fmt), path
        assert a.st_mode == fmt | st.mode
        # everything the core's Stat says, getattr says too
        assert (a.kind, a.mode, a.size, a.mtime_ns, a.ctime_ns, a.ino, a.nlink) == \
            (st.kind, st.mode, st.size, st.mtime_ns, st.ctime_ns, st.ino, st.nlink), path
        assert a.blksize > 0 and a.blocks >= 0 and a.rdev == 0
        if env.real:
            assert (a.uid, a.gid) == (os.geteuid(), os.getegid())
    f = fs.getattr("f")
    assert (f.mode, f.size, f.nlink) == (0o640, 10000, 1)
    assert f.blocks >= _ceil512(10000)  # not sparse: every byte has a block
    assert fs.getattr("d").mode == 0o750
    assert fs.getattr("p").size == 0 and fs.getattr("p").mode == 0o604
    assert fs.getattr("l").size == 1 and fs.getattr("l").mode == 0o777


def test_getattr_of_a_socket_keeps_its_type(env, fs):
    env.special("s", 0o600, stat.S_IFSOCK)
    a = fs.getattr("s")
    assert (a.kind, a.fmt, a.mode, a.st_mode) == (OTHER, stat.S_IFSOCK, 0o600, stat.S_IFSOCK | 0o600)
    assert fs.lstat("s").kind == OTHER


def test_getattr_tracks_changes(env, fs):
    mkfile(fs, "f", b"abc")
    a0 = fs.getattr("f")
    env.tick()
    fs.link("f", "g")
    fs.write("f", 10, b"z")
    a1 = fs.getattr("g")
    assert (a1.nlink, a1.size, a1.ino) == (2, 11, a0.ino)
    assert a1.mtime_ns > a0.mtime_ns and a1.ctime_ns > a0.ctime_ns
    fs.chmod("g", 0o600)
    assert fs.getattr("f").mode == 0o600
    fs.truncate("f", 0)
    assert fs.getattr("f").size == 0 and fs.getattr("f").blocks == 0


def test_getattr_errors(env, fs):
    mkfile(fs, "f")
    env.special("p")
    check_errno(errno.ENOENT, fs.getattr, "missing")
    check_errno(errno.ENOENT, fs.getattr, "missing/x")
    check_errno(errno.ENOTDIR, fs.getattr, "f/x")
    check_errno(errno.ENOTDIR, fs.getattr, "p/x")


def test_getattr_default_is_built_from_lstat(env, fs):
    mkfile(fs, "f", b"x" * 1000, 0o640)
    fs.symlink("f", "l")
    env.special("p")
    for path in ("f", "l", "p", ""):
        st = fs.lstat(path)
        a = HostFS.getattr(fs, path)  # the ABC's fallback, whatever the implementation overrides
        assert a == Attr.from_stat(st)
        assert (a.kind, a.mode, a.size, a.nlink, a.mtime_ns, a.ctime_ns, a.ino) == \
            (st.kind, st.mode, st.size, st.nlink, st.mtime_ns, st.ctime_ns, st.ino)
        assert (a.uid, a.gid, a.rdev, a.blksize, a.atime_ns) == (0, 0, 0, 4096, st.mtime_ns)
        assert a.blocks == _ceil512(st.size)
    assert HostFS.getattr(fs, "p").fmt == stat.S_IFIFO
    assert HostFS.statfs(fs) == SYNTHETIC_STATFS


def test_attr_from_stat():
    a = Attr.from_stat(Stat(REG, 0o644, 513, 7, 8, 9, 1))
    assert a == Attr(REG, stat.S_IFREG, 0o644, 513, 1, 0, 0, 0, 4096, 2, 7, 7, 8, 9)
    assert Attr.from_stat(Stat(DIR, 0o755, 4096, 1, 1, 2, 2)).fmt == stat.S_IFDIR
    assert Attr.from_stat(Stat(LNK, 0o777, 3, 1, 1, 3, 1)).fmt == stat.S_IFLNK
    assert Attr.from_stat(Stat(REG, 0o644, 0, 1, 1, 4, 1)).blocks == 0


# --------------------------------------------------------------------------- utime with atime


@pytest.mark.parametrize("atime", [0, 1, T1, 4_102_444_800_000_000_001, -1_000_000_001])
def test_utime_sets_atime_exactly_and_none_keeps_it(env, fs, atime):
    mkfile(fs, "f", b"x")
    fs.mkdir("d", 0o755)
    fs.symlink("f", "l")
    env.special("p")
    for path in ("f", "d", "l", "p", ""):
        before = fs.lstat(path)
        env.tick()
        fs.utime(path, T1, atime)
        a = fs.getattr(path)
        assert (a.mtime_ns, a.atime_ns) == (T1, atime), path
        assert a.ctime_ns > before.ctime_ns
        fs.utime(path, 5_000_000_003)  # two arguments, as the core calls it: atime stays
        a = fs.getattr(path)
        assert (a.mtime_ns, a.atime_ns) == (5_000_000_003, atime), path
        fs.utime(path, 6_000_000_007, None)
        assert fs.getattr(path).atime_ns == atime
    assert fs.getattr("f").mtime_ns == 6_000_000_007  # the symlink's utime did not reach its target
    if env.real:
        st = os.lstat(env.root / "l")
        assert (st.st_mtime_ns, st.st_atime_ns) == (6_000_000_007, atime)


def test_utime_with_atime_errors(fs):
    mkfile(fs, "f")
    check_errno(errno.ENOENT, fs.utime, "missing", 1, 2)
    check_errno(errno.ENOTDIR, fs.utime, "f/x", 1, 2)


# --------------------------------------------------------------------------- statfs


def test_statfs(env, fs):
    mkfile(fs, "f", b"x")
    sf = fs.statfs()
    assert isinstance(sf, StatFS)
    assert sf.bsize > 0 and sf.namelen == NAME_LEN_MAX
    assert 0 <= sf.bavail <= sf.bfree <= sf.blocks and sf.blocks > 0
    assert 0 <= sf.ffree <= sf.files
    assert isinstance(sf.fsid, int)
    if env.real:
        vfs = os.statvfs(env.root)
        assert (sf.bsize, sf.blocks, sf.files, sf.fsid, sf.namelen) == \
            (vfs.f_frsize, vfs.f_blocks, vfs.f_files, vfs.f_fsid, vfs.f_namemax)


# --------------------------------------------------------------------------- handles in the simulator


class _Recorder:
    def __init__(self, torn: int | None = None):
        self.calls: list[tuple[str, str, int]] = []
        self.torn = torn
        self.after: list[tuple[str, int]] = []

    def __call__(self, fs, op, path, nbytes):
        self.calls.append((op, path, nbytes))
        if op == "write" and self.torn is not None:
            return self.torn
        return None

    def after_torn_write(self, fs, path, n):
        self.after.append((path, n))
        raise SimulatedCrash(f"torn {path}")


def test_sim_handles_call_the_fault_hook_with_path_op_names():
    rec = _Recorder()
    fs = MemoryHostFS(fault_hook=rec)
    mkfile(fs, "f", b"abc")
    rec.calls.clear()
    h = fs.open("f", os.O_RDWR)
    h.pread(2, 0)
    h.pwrite(b"xyz", 1)
    h.truncate(1)
    h.fsync()
    h.fsync(datasync=True)
    h.fstat()
    fs.getattr("f")
    fs.statfs()
    h.close()
    assert rec.calls == [("open", "f", 0), ("read", "f", 0), ("write", "f", 3), ("truncate", "f", 0),
                         ("fsync", "f", 0), ("fsync", "f", 0), ("fstat", "f", 0), ("getattr", "f", 0),
                         ("statfs", "", 0)]
    rec.calls.clear()
    check_errno(errno.EBADF, h.pwrite, b"x", 0)  # a closed handle makes no host call
    h.close()
    assert rec.calls == []


def test_sim_handle_fault_can_fail_an_operation():
    def hook(fs, op, path, nbytes):
        if op == "write":
            raise OSError(errno.ENOSPC, "full", path)

    fs = MemoryHostFS(fault_hook=hook)
    fs.create("f", 0o644)
    h = fs.open("f", os.O_RDWR)
    check_errno(errno.ENOSPC, h.pwrite, b"abc", 0)
    assert h.pread(10, 0) == b""


def test_sim_handle_write_tears_like_a_path_write():
    rec = _Recorder(torn=2)
    fs = MemoryHostFS(fault_hook=rec)
    mkfile(fs, "f", b"")
    rec.torn = 2
    h = fs.open("f", os.O_WRONLY | os.O_APPEND)
    with pytest.raises(SimulatedCrash):
        h.pwrite(b"abcdef", 0)
    assert rec.after == [("f", 2)]
    rec.torn = None
    assert fs.read_all("f") == b"ab"


def test_sim_handle_torn_by_the_injector():
    inj = FaultInjector(torn_at=1, seed=3)
    fs = MemoryHostFS(fault_hook=inj)
    fs.create("f", 0o644)  # call 0
    h = fs.open("f", os.O_RDWR)  # call 1: not a write, nothing torn
    inj.torn_at = 2
    with pytest.raises(SimulatedCrash):
        h.pwrite(b"0123456789", 0)  # call 2
    assert inj.injected and "torn write" in inj.injected[0]
    inj.disarm()
    fs.crash()
    n = len(fs.read_all("f"))
    assert 1 <= n < 10 and fs.read_all("f") == b"0123456789"[:n]


def test_sim_crash_closes_open_handles():
    fs = MemoryHostFS()
    mkfile(fs, "f", b"before")
    h = fs.open("f", os.O_RDWR)
    h.pwrite(b"B", 0)
    fs.crash()
    assert h.closed
    check_errno(errno.EBADF, h.pwrite, b"resurrected", 0)
    check_errno(errno.EBADF, h.pread, 10, 0)
    check_errno(errno.EBADF, h.fstat)
    h.close()
    assert fs.read_all("f") == b"Before"  # data stays: only the process died
    with fs.open("f", os.O_RDONLY) as h2:  # the next process opens afresh
        assert h2.pread(10, 0) == b"Before"


def test_sim_power_loss_and_handle_fsync():
    fs = MemoryHostFS()
    mkfile(fs, "kept", b"old")
    mkfile(fs, "synced", b"old")
    mkfile(fs, "datasynced", b"old")
    fs.sync_all()
    hk = fs.open("kept", os.O_RDWR)
    hs = fs.open("synced", os.O_RDWR)
    hd = fs.open("datasynced", os.O_RDWR)
    for h in (hk, hs, hd):
        h.pwrite(b"NEW!", 0)  # dirty data, exactly as a path write
    hs.fsync()
    hd.fsync(datasync=True)
    fs.create("fresh", 0o644)
    hf = fs.open("fresh", os.O_RDWR)
    hf.pwrite(b"fresh", 0)
    hf.fsync(datasync=True)  # the bytes, but no journal commit: the new name is not durable
    fs.power_loss()
    assert fs.read_all("kept") == b"old"
    assert fs.read_all("synced") == b"NEW!"
    assert fs.read_all("datasynced") == b"NEW!"
    assert not fs.exists("fresh")
    for h in (hk, hs, hd, hf):
        check_errno(errno.EBADF, h.pwrite, b"x", 0)


def test_sim_handle_fsync_commits_metadata_like_path_fsync():
    fs = MemoryHostFS()
    fs.sync_all()
    fs.create("a", 0o644)
    fs.mkdir("d", 0o755)
    with fs.open("a", os.O_WRONLY) as h:
        h.pwrite(b"data", 0)
        h.fsync()  # one journal: every earlier metadata change commits too
    fs.power_loss()
    assert sorted(fs.listdir("")) == ["a", "d"]
    assert fs.read_all("a") == b"data"


def test_sim_special_file_types():
    fs = MemoryHostFS()
    fs.make_special("c", 0o600, stat.S_IFCHR)
    assert (fs.getattr("c").fmt, fs.getattr("c").kind) == (stat.S_IFCHR, OTHER)
    check_errno(errno.EPERM, fs.open, "c", os.O_RDONLY)
    for bad in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, 0, 0o777):
        with pytest.raises(ValueError):
            fs.make_special("x", 0o600, bad)


def test_sim_atime_survives_power_loss_like_other_metadata():
    fs = MemoryHostFS()
    mkfile(fs, "f", b"x")
    fs.utime("f", T1, 11)
    fs.sync_all()
    fs.utime("f", T1, 22)
    fs.power_loss()
    assert fs.getattr("f").atime_ns == 11


# --------------------------------------------------------------------------- real handles


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_real_handles_release_their_fds(tmp_path):
    fs = RealHostFS(str(tmp_path))
    try:
        fs.create("f", 0o644)
        base = _open_fds()
        handles = [fs.open("f", os.O_RDWR) for _ in range(10)]
        assert _open_fds() == base + 10
        for h in handles:
            h.close()
            h.close()
        assert _open_fds() == base
        for flags in BAD_OPEN_FLAGS.values():
            check_errno(errno.EINVAL, fs.open, "f", flags)
        for _ in range(5):  # failed opens leak nothing either
            check_errno(errno.EISDIR, fs.open, "", os.O_RDONLY)
        assert _open_fds() == base
    finally:
        fs.close()


def test_real_handle_outlives_the_hostfs(tmp_path):
    fs = RealHostFS(str(tmp_path))
    fs.create("f", 0o644)
    h = fs.open("f", os.O_RDWR)
    fs.close()  # the root fd is gone; the handle's own fd is not
    h.pwrite(b"still", 0)
    h.close()
    assert (tmp_path / "f").read_bytes() == b"still"


def test_real_handle_opens_with_the_given_flags(tmp_path):
    import fcntl

    fs = RealHostFS(str(tmp_path))
    try:
        fs.create("f", 0o644)
        for flags in ACCESS_FLAGS:
            with fs.open("f", flags) as h:
                got = fcntl.fcntl(h._fd, fcntl.F_GETFL)
                assert got & (os.O_ACCMODE | os.O_APPEND) == flags
                assert fcntl.fcntl(h._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        fs.close()


def test_real_close_waits_for_a_call_in_progress(tmp_path):
    """A close from another thread must not release the fd number under a running call."""
    import threading

    fs = RealHostFS(str(tmp_path))
    try:
        fs.create("f", 0o644)
        h = fs.open("f", os.O_RDWR)
        fd = h._acquire()  # a call in progress
        h.close()
        assert h.closed
        os.fstat(fd)  # still ours
        check_errno(errno.EBADF, h.pread, 1, 0)
        h._release()
        check_errno(errno.EBADF, os.fstat, fd)  # released by the last user
        h2 = fs.open("f", os.O_RDWR)
        errors = []

        def hammer():
            try:
                for i in range(2000):
                    h2.pwrite(b"x", i)
            except OSError as e:
                errors.append(e.errno)

        t = threading.Thread(target=hammer)
        t.start()
        h2.close()
        t.join()
        assert set(errors) <= {errno.EBADF}
    finally:
        fs.close()


# --------------------------------------------------------------------------- names


def test_names_are_opaque(env, fs):
    names = ["sp ace", "tab\tname", "new\nline", "ünïcødé", "bad\udcffbyte", "-dash", ".dot", "...", "x" * 255]
    for n in names:
        mkfile(fs, n, n.encode("utf-8", "surrogateescape"))
    fs.mkdir("dir\udcfe", 0o755)
    fs.symlink("tgt\udcfd", "dir\udcfe/link")
    assert sorted(fs.listdir("")) == sorted(names + ["dir\udcfe"])
    for n in names:
        assert fs.read_all(n) == n.encode("utf-8", "surrogateescape")
    assert fs.readlink("dir\udcfe/link") == "tgt\udcfd"
    assert fs.lstat("dir\udcfe/link").size == len("tgt") + 1
    check_errno(errno.ENAMETOOLONG, fs.create, "y" * 256, 0o644)


def test_name_too_long(fs):
    long = "y" * (NAME_LEN_MAX + 1)
    mkfile(fs, "f")
    for fn, args in [(fs.create, (long, 0o644)), (fs.mkdir, (long, 0o755)), (fs.lstat, (long,)),
                     (fs.unlink, (long,)), (fs.rmdir, (long,)), (fs.read, (long, 0, 1)),
                     (fs.symlink, ("x", long)), (fs.link, ("f", long)), (fs.rename, ("f", long)),
                     (fs.lstat, (f"{long}/x",)), (fs.create, (f"{long}/x", 0o644)), (fs.chmod, (long, 0o644)),
                     (fs.getattr, (long,)), (fs.open, (long, os.O_RDONLY)), (fs.utime, (long, 1, 2))]:
        check_errno(errno.ENAMETOOLONG, fn, *args)
    assert not fs.exists("y" * NAME_LEN_MAX)
    check_errno(errno.ENOENT, fs.rename, "missing", long)  # the source is looked up first
    check_errno(errno.ENOENT, fs.lstat, f"missing/{long}")
    check_errno(errno.ENOTDIR, fs.lstat, f"f/{long}")
    assert fs.listdir("") == ["f"]


def deep_dirs(fs: HostFS, total: int) -> str:
    """Make directories of 255-byte names down to a path of about ``total`` bytes
    (``total - 256 < len <= total``); return it."""
    path = ""
    while len(path) + 256 <= total:
        path = join(path, f"{len(path):08d}".ljust(NAME_LEN_MAX, "d"))
        fs.mkdir(path, 0o755)
    return path


def deep_path(fs: HostFS, total: int) -> tuple[str, str]:
    """(directory, a free path in it of exactly ``total`` bytes)."""
    d = deep_dirs(fs, total - 257)
    rest = total - len(d) - 2  # two names and their slashes: 255 <= rest <= 510
    d = join(d, "e" * (rest // 2))
    fs.mkdir(d, 0o755)
    return d, join(d, "c" * (rest - rest // 2))


@pytest.mark.parametrize("total", [4096, 3 * PATH_LEN_MAX + 17, TREE_PATH_BYTES_MAX - 300], ids=str)
def test_paths_longer_than_path_max(env, fs, total):
    """A guest builds trees deeper than PATH_MAX with relative walks: every HostFS call
    works on such a path (RealHostFS resolves it in pieces), up to TREE_PATH_BYTES_MAX."""
    d, path = deep_path(fs, total)
    assert len(path) == total and normalize(path) == path
    fs.create(path, 0o644)
    assert fs.lstat(path).kind == REG and fs.exists(path)
    assert fs.write(path, 0, b"deep") == 4 and fs.read(path, 0, 10) == b"deep"
    fs.truncate(path, 2)
    assert fs.read_all(path) == b"de"
    fs.utime(path, T1, 5)
    a = fs.getattr(path)
    assert (a.kind, a.mtime_ns, a.atime_ns, a.ino) == (REG, T1, 5, fs.lstat(path).ino)
    fs.chmod(path, 0o600)
    assert fs.lstat(path).mode == 0o600
    fs.setxattr(path, "user.a", b"1")
    assert fs.listxattr(path) == ["user.a"] and fs.getxattr(path, "user.a") == b"1"
    fs.removexattr(path, "user.a")
    fs.fsync(path)
    h = fs.open(path, os.O_RDWR)
    try:
        assert h.pread(2, 0) == b"de"
    finally:
        h.close()
    fs.link(path, d + "/hard")
    assert fs.lstat(path).nlink == 2
    fs.unlink(d + "/hard")
    fs.symlink("t" * 100, d + "/sym")
    assert fs.readlink(d + "/sym") == "t" * 100
    check_errno(errno.ELOOP, fs.lstat, d + "/sym/x")
    fs.rename(path, "short")
    assert fs.read_all("short") == b"de"
    fs.rename("short", path)
    assert sorted(fs.listdir(d)) == sorted([path.rsplit("/", 1)[1], "sym"])
    fs.unlink(path)
    fs.unlink(d + "/sym")
    fs.mkdir(path, 0o700)
    fs.rmdir(path)
    assert fs.listdir(d) == []
    check_errno(errno.ENOENT, fs.lstat, d + "/missing/x")
    first = d.split("/")[0]
    fs.rename(first, "moved")  # a long path through a renamed directory is gone
    check_errno(errno.ENOENT, fs.lstat, d)


def test_a_symlink_or_file_deep_in_a_long_path(env, fs):
    d = deep_dirs(fs, 2 * PATH_LEN_MAX)
    mid = "/".join(d.split("/")[:20])  # past the first piece RealHostFS resolves
    before = env.outside_snapshot()
    fs.rename(mid, mid[:-1] + "x")
    fs.symlink(mid.rsplit("/", 1)[1][:-1] + "x", mid)  # a symlink to the moved directory
    check_errno(errno.ELOOP, fs.lstat, d)
    check_errno(errno.ELOOP, fs.create, d + "/f", 0o644)
    fs.unlink(mid)
    fs.symlink(str(env.outside), mid)  # … and one to the outside
    check_errno(errno.ELOOP, fs.create, mid + "/sub/" + "f" * 255, 0o644)
    check_errno(errno.ELOOP, fs.mkdir, d, 0o755)
    fs.unlink(mid)
    mkfile(fs, mid)
    check_errno(errno.ENOTDIR, fs.lstat, d)
    check_errno(errno.ENOTDIR, fs.mkdir, d, 0o755)
    assert env.outside_snapshot() == before


def test_paths_beyond_tree_path_bytes_max(fs):
    _d, too_long = deep_path(fs, TREE_PATH_BYTES_MAX + 1)
    assert len(too_long) == TREE_PATH_BYTES_MAX + 1
    for fn, args in [(fs.create, (too_long, 0o644)), (fs.mkdir, (too_long, 0o755)), (fs.lstat, (too_long,)),
                     (fs.open, (too_long, os.O_RDONLY)), (fs.symlink, ("x", too_long))]:
        check_errno(errno.ENAMETOOLONG, fn, *args)
    with pytest.raises(PathError) as info:
        normalize(too_long)
    assert info.value.errno == errno.ENAMETOOLONG


# --------------------------------------------------------------------------- clone_to


def test_clone_to_is_all_or_nothing(env, fs):
    data = b"cloned bytes " * 1000
    mkfile(fs, "src", data, 0o640)
    try:
        fs.clone_to("src", fs, "dst")
    except OSError as e:  # no reflinks on this filesystem
        assert e.errno in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL), e
        assert not fs.exists("dst")
    else:
        assert fs.read_all("dst") == data
    assert fs.read_all("src") == data
    other = MemoryHostFS()
    check_errno(errno.EOPNOTSUPP, fs.clone_to, "src", other, "dst2")
    assert not other.exists("dst2") and not fs.exists("dst2")


# --------------------------------------------------------------------------- lock


def _pid_of(env: Env) -> int:
    return os.getpid() if env.real else env.fs.pid


def test_lock_creates_file_with_pid(env, fs):
    lk = fs.lock("lock")
    st = fs.lstat("lock")
    assert (st.kind, st.mode) == (REG, 0o600)
    assert fs.read_all("lock") == f"{_pid_of(env)}\n".encode()
    lk.release()
    assert fs.exists("lock")  # releasing keeps the file


def test_lock_overwrites_stale_content(env, fs):
    mkfile(fs, "lock", b"999999999\nstale stuff that is long", 0o640)
    lk = fs.lock("lock")
    assert fs.read_all("lock") == f"{_pid_of(env)}\n".encode()
    assert fs.lstat("lock").mode == 0o640  # an existing lock file keeps its mode
    lk.release()


def test_second_lock_is_store_busy_until_released(env, fs):
    fs.mkdir("store", 0o755)
    lk = fs.lock("store/lock")
    with pytest.raises(StoreBusy) as info:
        fs.lock("store/lock")
    busy = info.value
    assert isinstance(busy, OSError) and busy.errno == errno.EWOULDBLOCK
    assert busy.pid == _pid_of(env)
    assert f"in use by pid {_pid_of(env)}" in str(busy)
    assert fs.read_all("store/lock") == f"{_pid_of(env)}\n".encode()  # the failed attempt wrote nothing
    lk.release()
    lk.release()  # idempotent
    lk2 = fs.lock("store/lock")
    with pytest.raises(StoreBusy):
        fs.lock("store/lock")
    lk.release()  # a stale handle must not drop the new holder's lock
    with pytest.raises(StoreBusy):
        fs.lock("store/lock")
    lk2.release()
    fs.lock("store/lock").release()


def test_locks_on_different_files_are_independent(fs):
    a = fs.lock("a.lock")
    b = fs.lock("b.lock")
    a.release()
    b.release()


def test_lock_errors(env, fs):
    fs.mkdir("d", 0o755)
    mkfile(fs, "f")
    fs.symlink("f", "l")
    fs.symlink("d", "ld")
    check_errno(errno.EISDIR, fs.lock, "d")
    check_errno(errno.ELOOP, fs.lock, "l")
    check_errno(errno.ELOOP, fs.lock, "ld/lock")
    check_errno(errno.EBUSY, fs.lock, "")
    check_errno(errno.ENOENT, fs.lock, "missing/lock")
    check_errno(errno.ENOTDIR, fs.lock, "f/lock")
    assert fs.read_all("f") == b""
    assert sorted(fs.listdir("")) == ["d", "f", "l", "ld"]
    assert fs.listdir("d") == []


def test_sim_crash_drops_locks():
    fs = MemoryHostFS(pid=77)
    fs.lock("lock")
    with pytest.raises(StoreBusy, match="in use by pid 77"):
        fs.lock("lock")
    fs.crash()
    fs.lock("lock").release()


def test_real_second_instance_conflicts(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    one, two = RealHostFS(str(root)), RealHostFS(str(root))
    try:
        lk = one.lock("lock")
        with pytest.raises(StoreBusy, match=f"in use by pid {os.getpid()}"):
            two.lock("lock")
        lk.release()
        two.lock("lock").release()
    finally:
        one.close()
        two.close()


_CHILD = textwrap.dedent(
    """
    import os, sys
    from sandbox.hostfs import StoreBusy
    from sandbox.hostfs.real import RealHostFS
    fs = RealHostFS(sys.argv[1])
    try:
        lk = fs.lock(sys.argv[2])
    except StoreBusy as e:
        print("busy", e.pid, str(e), flush=True)
        sys.exit(0)
    print("locked", os.getpid(), flush=True)
    sys.stdin.readline()
    lk.release()
    print("released", flush=True)
    """
)


def _child(root: Path, name: str) -> subprocess.Popen:
    env = dict(os.environ)
    src = str(Path(sandbox.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(root), name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


@pytest.mark.timeout(60)
def test_real_lock_held_by_another_process(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    child = _child(root, "lock")
    try:
        line = child.stdout.readline().split()
        assert line == ["locked", str(child.pid)]
        fs = RealHostFS(str(root))
        with pytest.raises(StoreBusy) as info:
            fs.lock("lock")
        assert info.value.pid == child.pid
        assert f"in use by pid {child.pid}" in str(info.value)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "released"
        assert child.wait(timeout=30) == 0
        lk = fs.lock("lock")
        other = _child(root, "lock")  # and now the other way round
        out = other.stdout.readline().split()
        assert other.wait(timeout=30) == 0
        assert out[:2] == ["busy", str(os.getpid())]
        assert f"in use by pid {os.getpid()}" in " ".join(out)
        lk.release()
        fs.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.timeout(60)
def test_real_lock_released_when_holder_dies(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    child = _child(root, "lock")
    try:
        assert child.stdout.readline().split()[0] == "locked"
        child.kill()
        child.wait()
        fs = RealHostFS(str(root))
        fs.lock("lock").release()
        fs.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# --------------------------------------------------------------------------- the root


def test_root_queries_and_metadata(env, fs):
    st = fs.lstat("")
    assert st.kind == DIR
    assert fs.exists("")
    assert fs.listdir("") == []
    mkfile(fs, "a")
    fs.mkdir("b", 0o755)
    assert sorted(fs.listdir("")) == ["a", "b"]
    fs.chmod("", 0o751)
    assert fs.lstat("").mode == 0o751
    before = fs.lstat("")
    env.tick()
    fs.utime("", T1)
    after = fs.lstat("")
    assert after.mtime_ns == T1 and after.ctime_ns > before.ctime_ns
    fs.utime("", T1, 77)
    a = fs.getattr("")
    assert (a.kind, a.fmt, a.mode, a.mtime_ns, a.atime_ns, a.ino) == (DIR, stat.S_IFDIR, 0o751, T1, 77, fs.lstat("").ino)
    fs.fsync("")
    fs.setxattr("", "user.root", b"r")
    assert fs.getxattr("", "user.root") == b"r"
    fs.removexattr("", "user.root")
    if env.real:
        st = os.lstat(env.root)
        assert stat.S_IMODE(st.st_mode) == 0o751 and st.st_mtime_ns == T1 and st.st_atime_ns == 77


def test_root_entry_operations_are_ebusy(fs):
    mkfile(fs, "f")
    check_errno(errno.EBUSY, fs.unlink, "")
    check_errno(errno.EBUSY, fs.rmdir, "")
    check_errno(errno.EBUSY, fs.rename, "", "x")
    check_errno(errno.EBUSY, fs.rename, "f", "")
    check_errno(errno.EBUSY, fs.create, "", 0o644)
    check_errno(errno.EBUSY, fs.mkdir, "", 0o755)
    check_errno(errno.EBUSY, fs.symlink, "x", "")
    check_errno(errno.EBUSY, fs.link, "", "x")
    check_errno(errno.EBUSY, fs.link, "f", "")
    check_errno(errno.EBUSY, fs.lock, "")
    assert fs.listdir("") == ["f"]
    assert fs.lstat("").kind == DIR


def test_root_io_is_eisdir(fs):
    check_errno(errno.EISDIR, fs.read, "", 0, 1)
    check_errno(errno.EISDIR, fs.write, "", 0, b"x")
    check_errno(errno.EISDIR, fs.truncate, "", 0)
    check_errno(errno.EISDIR, fs.fallocate, "", 0, 1)
    check_errno(errno.EINVAL, fs.readlink, "")
    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):
        check_errno(errno.EISDIR, fs.open, "", flags)


def test_listdir_errors(env, fs):
    mkfile(fs, "f")
    check_errno(errno.ENOENT, fs.listdir, "missing")
    check_errno(errno.ENOTDIR, fs.listdir, "f")
    fs.mkdir("d", 0o755)
    fs.symlink("d", "l")
    check_errno(errno.ENOTDIR, fs.listdir, "l")  # a final symlink is not followed


def test_fsync(env, fs):
    mkfile(fs, "f", b"x")
    fs.mkdir("d", 0o755)
    fs.symlink("nowhere", "l")
    for p in ("f", "d", "l", ""):
        assert fs.fsync(p) is None
    check_errno(errno.ENOENT, fs.fsync, "missing")


def test_real_root_is_resolved_once(tmp_path):
    # the root path may itself contain a symlink: it is resolved at construction only
    (tmp_path / "actual").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "actual")
    fs = RealHostFS(str(tmp_path / "alias"))
    try:
        fs.create("f", 0o644)
        assert (tmp_path / "actual" / "f").exists()
        assert fs.root == str((tmp_path / "actual").resolve())
    finally:
        fs.close()


# --------------------------------------------------------------------------- normalize & path helpers


@pytest.mark.parametrize(
    "raw, want",
    [
        ("a//b/./c/", "a/b/c"),
        (".", ""),
        ("", ""),
        ("./", ""),
        ("./.", ""),
        ("a", "a"),
        ("a/./.", "a"),
        ("a/b", "a/b"),
        ("...", "..."),
        ("..a/b..", "..a/b.."),
        (".hidden", ".hidden"),
        ("x" * NAME_LEN_MAX, "x" * NAME_LEN_MAX),
        ("ünï/cødé", "ünï/cødé"),
    ],
)
def test_normalize(raw, want):
    assert normalize(raw) == want


@pytest.mark.parametrize(
    "raw, code",
    [
        ("/abs", errno.EINVAL),
        ("/", errno.EINVAL),
        ("//a", errno.EINVAL),
        ("..", errno.EINVAL),
        ("../x", errno.EINVAL),
        ("a/..", errno.EINVAL),
        ("a/../b", errno.EINVAL),
        ("a/./../b", errno.EINVAL),
        ("a\0b", errno.EINVAL),
        ("\0", errno.EINVAL),
        ("x" * (NAME_LEN_MAX + 1), errno.ENAMETOOLONG),
        ("a/" + "é" * 128, errno.ENAMETOOLONG),  # 256 bytes in UTF-8
        ("a/" * (TREE_PATH_BYTES_MAX // 2) + "b", errno.ENAMETOOLONG),
    ],
    ids=lambda v: repr(v)[:24] if isinstance(v, str) else str(v),
)
def test_normalize_rejects(raw, code):
    with pytest.raises(PathError) as info:
        normalize(raw)
    assert isinstance(info.value, OSError)
    assert info.value.errno == code


def test_normalize_rejects_non_str():
    for bad in (b"a/b", None, 3):
        with pytest.raises(PathError) as info:
            normalize(bad)
        assert info.value.errno == errno.EINVAL


def test_normalize_path_length_boundary():
    ok = "/".join(["x" * 255] * 128)  # 128*256 - 1 = 32767 bytes
    assert len(ok) == TREE_PATH_BYTES_MAX - 1 and normalize(ok) == ok
    assert normalize(ok + "/") == ok  # TREE_PATH_BYTES_MAX raw bytes: still allowed
    with pytest.raises(PathError):
        normalize(ok + "/y")  # one more


def _normalize_reference(path: str) -> str:
    """What normalize returned before its fast path for canonical ASCII paths: every
    component looked at, the byte lengths measured in UTF-8."""
    if "\0" in path or path.startswith("/"):
        raise PathError(errno.EINVAL, "bad path")
    if len(path.encode("utf-8", "surrogateescape")) > TREE_PATH_BYTES_MAX:
        raise PathError(errno.ENAMETOOLONG, "path too long")
    parts = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise PathError(errno.EINVAL, "..")
        if len(part.encode("utf-8", "surrogateescape")) > NAME_LEN_MAX:
            raise PathError(errno.ENAMETOOLONG, "component too long")
        parts.append(part)
    return "/".join(parts)


@settings(max_examples=2000, deadline=None)
@given(hs.lists(hs.sampled_from(["a", "b", ".", "..", "", "/", "//", "\0", "é", "x" * 120]), max_size=8).map("".join))
def test_normalize_of_any_path_is_what_the_component_loop_gives(raw):
    """The fast path (a canonical ASCII path of at most NAME_LEN_MAX characters is returned
    as it is) agrees with the full loop on every input: the same result or the same errno."""
    from sandbox.hostfs import _normalize

    try:
        want: str | int = _normalize_reference(raw)
    except PathError as e:
        want = e.errno
    try:
        got: str | int = _normalize(raw)
    except PathError as e:
        got = e.errno
    assert got == want


def test_path_helpers():
    assert join("", "a") == "a"
    assert join("a/b", "c") == "a/b/c"
    assert parent_of("a/b/c") == "a/b"
    assert parent_of("a") == ""
    assert parent_of("") == ""
    assert is_within("a/b", "a") and is_within("a", "a") and is_within("x", "")
    assert not is_within("ab", "a") and not is_within("a", "a/b")


# --------------------------------------------------------------------------- owners (lchown, fchown)


def _me(env: Env) -> tuple[int, int]:
    """Who owns what ``env``'s filesystem creates."""
    return (os.geteuid(), os.getegid()) if env.real else (env.fs.uid, env.fs.gid)


def _owner(fs: HostFS, path: str) -> tuple[int, int]:
    st = fs.lstat(path)
    a = fs.getattr(path)
    assert (st.uid, st.gid) == (a.uid, a.gid)
    return st.uid, st.gid


def test_new_entries_belong_to_their_creator(env, fs):
    mkfile(fs, "f")
    fs.mkdir("d", 0o755)
    fs.symlink("f", "l")
    with fs.create_handle("g", 0o600) as h:
        assert (h.fstat().uid, h.fstat().gid) == _me(env)
    for p in ("f", "d", "l", "g"):
        assert _owner(fs, p) == _me(env)
    assert fs.lstat("f").fmt == stat.S_IFREG and fs.lstat("l").fmt == stat.S_IFLNK


def test_lchown_sets_each_id_and_never_follows(env, fs):
    if env.real and not IS_ROOT:
        pytest.skip("giving a file to another uid needs root")
    mkfile(fs, "f")
    fs.symlink("f", "l")
    fs.mkdir("d", 0o755)
    fs.lchown("l", 1000, 1001)
    assert _owner(fs, "l") == (1000, 1001)
    assert _owner(fs, "f") == _me(env)  # the target is untouched
    fs.lchown("f", 2000, -1)
    assert _owner(fs, "f") == (2000, _me(env)[1])
    fs.lchown("f", -1, 3000)
    assert _owner(fs, "f") == (2000, 3000)
    fs.lchown("d", 65534, 65534)
    assert _owner(fs, "d") == (65534, 65534)
    fs.lchown("", 0, 0)
    assert _owner(fs, "") == (0, 0)
    check_errno(errno.ENOENT, fs.lchown, "missing", 1, 1)
    check_errno(errno.ENOTDIR, fs.lchown, "f/x", 1, 1)


def test_lchown_changes_ctime_and_clears_setid_of_non_directories(env, fs):
    skip_unless_root_for(0o6000)
    mkfile(fs, "f", mode=0o6755)
    mkfile(fs, "g", mode=0o2745)  # set-gid without group-execute: a lock marker, kept
    fs.mkdir("d", 0o755)
    fs.chmod("d", 0o6755)
    before = fs.lstat("f").ctime_ns
    env.tick()
    for p in ("f", "g", "d"):
        fs.lchown(p, -1, -1)  # even "no change" clears them, as chown(2) does
    assert fs.lstat("f").mode == 0o755
    assert fs.lstat("g").mode == 0o2745
    assert fs.lstat("d").mode == 0o6755
    assert fs.lstat("f").ctime_ns > before


def test_fchown_acts_on_the_handles_inode(env, fs):
    if env.real and not IS_ROOT:
        pytest.skip("giving a file to another uid needs root")
    mkfile(fs, "f", b"x")
    with fs.open("f", os.O_RDONLY) as h:
        fs.rename("f", "g")
        mkfile(fs, "f")
        h.chown(4242, 4343)
        assert (h.fstat().uid, h.fstat().gid) == (4242, 4343)
    assert _owner(fs, "g") == (4242, 4343)
    assert _owner(fs, "f") == _me(env)


def test_unprivileged_lchown_gives_nothing_away(env, fs):
    if env.real and IS_ROOT:
        pytest.skip("as root every chown is allowed (the simulator's unprivileged case still runs)")
    if not env.real:
        fs.uid, fs.gid = 1000, 1000
    me = _me(env)
    mkfile(fs, "f")
    fs.lchown("f", me[0], me[1])  # to what it is: allowed
    fs.lchown("f", -1, -1)
    check_errno(errno.EPERM, fs.lchown, "f", 0, -1)
    with fs.open("f", os.O_RDONLY) as h:
        check_errno(errno.EPERM, h.chown, 0, -1)
    assert _owner(fs, "f") == me


def test_path_reads_leave_an_atime_older_than_the_mtime(env, fs):
    """The server's own reads (preimages, hashes) never move a client's atime (relatime would)."""
    mkfile(fs, "f", b"data")
    fs.utime("f", T1, T1 - 10**9)
    assert fs.read("f", 0, 4) == b"data" and fs.read_all("f") == b"data"
    assert fs.getattr("f").atime_ns == T1 - 10**9


# --------------------------------------------------------------------------- handles: fallocate, lseek, copy


@pytest.mark.parametrize("mode, expect", [
    (0, b"0123456789" + b"\0" * 5),
    (KEEP_SIZE, b"0123456789"),
    (PUNCH_HOLE | KEEP_SIZE, b"01\0\0\x0056789"),
    (ZERO_RANGE, b"01\0\0\x0056789"),
])
def test_handle_fallocate_is_the_path_calls_own(fs, mode, expect):
    mkfile(fs, "f", b"0123456789")
    fs.link("f", "g")
    with fs.open("f", os.O_RDWR) as h:
        if mode in (0, KEEP_SIZE):
            h.fallocate(5, 10, mode)
        else:
            h.fallocate(2, 3, mode)
        assert h.pread(100, 0) == expect
    assert fs.read_all("g") == expect  # the inode's bytes, under any name


def test_handle_fallocate_follows_the_inode_and_checks_access(env, fs):
    mkfile(fs, "f", b"abc")
    with fs.open("f", os.O_RDWR) as h:
        fs.rename("f", "g")
        mkfile(fs, "f", b"new")
        h.fallocate(0, 8)
    assert fs.read_all("g") == b"abc" + b"\0" * 5
    assert fs.read_all("f") == b"new"
    with fs.open("f", os.O_RDONLY) as h:
        check_errno(errno.EBADF, h.fallocate, 0, 8)
        with fs.open("f", os.O_WRONLY) as w:
            check_errno(errno.EINVAL, w.fallocate, 0, 0)
            check_errno(errno.EINVAL, w.fallocate, -1, 4)
            check_errno(errno.EOPNOTSUPP, w.fallocate, 0, 4, PUNCH_HOLE)  # without KEEP_SIZE
            check_errno(errno.EOPNOTSUPP, w.fallocate, 0, 4, 0x08)  # COLLAPSE_RANGE
    assert fs.read_all("f") == b"new"
    h = fs.open("f", os.O_RDWR)
    h.close()
    check_errno(errno.EBADF, h.fallocate, 0, 4)


def test_handle_lseek_data_and_hole(fs):
    """A file without holes: data from any offset inside it, the hole at EOF; ENXIO past it
    (lseek(2)). Where the host tracks holes it may say more; these answers hold everywhere."""
    mkfile(fs, "f", b"x" * 5000)
    with fs.open("f", os.O_RDONLY) as h:
        assert h.lseek(0, os.SEEK_DATA) == 0
        assert h.lseek(4999, os.SEEK_DATA) == 4999
        assert h.lseek(0, os.SEEK_HOLE) == 5000
        assert h.lseek(123, os.SEEK_HOLE) == 5000
        check_errno(errno.ENXIO, h.lseek, 5000, os.SEEK_DATA)
        check_errno(errno.ENXIO, h.lseek, 5000, os.SEEK_HOLE)
        check_errno(errno.ENXIO, h.lseek, -1, os.SEEK_DATA)
        check_errno(errno.EINVAL, h.lseek, 0, os.SEEK_SET)  # only SEEK_DATA/SEEK_HOLE: I/O is positional
    mkfile(fs, "empty")
    with fs.open("empty", os.O_WRONLY) as h:
        check_errno(errno.ENXIO, h.lseek, 0, os.SEEK_DATA)


def test_handle_lseek_finds_a_hole_it_may_report(env, fs):
    mkfile(fs, "f", b"a" * (1 << 20))
    with fs.open("f", os.O_RDWR) as h:
        h.fallocate(0, 1 << 19, PUNCH_HOLE | KEEP_SIZE)
        hole = h.lseek(0, os.SEEK_HOLE)
        data = h.lseek(0, os.SEEK_DATA)
    assert hole in (0, 1 << 20)  # the punched range, or the generic answer: all data
    assert data in (0, 1 << 19)
    assert (hole == 0) == (data == 1 << 19)


def test_handle_copy_range_to(fs):
    mkfile(fs, "src", b"0123456789")
    mkfile(fs, "dst", b"abcdefghij")
    with fs.open("src", os.O_RDONLY) as s, fs.open("dst", os.O_RDWR) as d:
        fs.rename("dst", "moved")
        mkfile(fs, "dst", b"other")
        assert s.copy_range_to(d, 2, 5, 3) == 3
        assert s.copy_range_to(d, 7, 12, 100) == 3  # clamped to the source; past the destination's EOF
        assert s.copy_range_to(d, 10, 0, 5) == 0
    assert fs.read_all("moved") == b"abcde234ij\0\x00789"
    assert fs.read_all("dst") == b"other"


def test_handle_copy_range_to_errors(fs):
    mkfile(fs, "f", b"0123456789")
    mkfile(fs, "g", b"xyz")
    with fs.open("f", os.O_RDWR) as f, fs.open("g", os.O_RDONLY) as g, fs.open("g", os.O_WRONLY | os.O_APPEND) as ga:
        check_errno(errno.EBADF, f.copy_range_to, g, 0, 0, 2)  # destination not writable
        check_errno(errno.EBADF, f.copy_range_to, ga, 0, 0, 2)  # O_APPEND destination
        with fs.open("f", os.O_WRONLY) as w:
            check_errno(errno.EBADF, w.copy_range_to, f, 0, 0, 2)  # source not readable
        check_errno(errno.EINVAL, f.copy_range_to, f, 0, 2, 4)  # overlapping, one file
        assert f.copy_range_to(f, 0, 6, 2) == 2
        check_errno(errno.EINVAL, g.copy_range_to, f, 0, 0, -1)
    assert fs.read_all("f") == b"0123450189" and fs.read_all("g") == b"xyz"


# --------------------------------------------------------------------------- exchange (RENAME_EXCHANGE)


def test_exchange_swaps_two_files(env, fs):
    fs.mkdir("d", 0o755)
    mkfile(fs, "a", b"A")
    mkfile(fs, "d/b", b"BB", 0o600)
    ia, ib = fs.lstat("a").ino, fs.lstat("d/b").ino
    env.tick()
    before = fs.lstat("d")
    fs.exchange("a", "d/b")
    assert (fs.read_all("a"), fs.read_all("d/b")) == (b"BB", b"A")
    assert (fs.lstat("a").ino, fs.lstat("d/b").ino) == (ib, ia)
    assert fs.lstat("a").mode == 0o600
    assert fs.lstat("d").mtime_ns > before.mtime_ns


def test_exchange_a_file_with_a_directory(fs):
    fs.mkdir("d", 0o711)
    fs.mkdir("d/sub", 0o755)
    mkfile(fs, "d/sub/leaf", b"leaf")
    fs.mkdir("p", 0o755)
    mkfile(fs, "p/f", b"file")
    nd, np_ = fs.lstat("").nlink, fs.lstat("p").nlink
    fs.exchange("d", "p/f")
    assert fs.read_all("d") == b"file"
    assert fs.lstat("p/f").kind == DIR and fs.lstat("p/f").mode == 0o711
    assert fs.read_all("p/f/sub/leaf") == b"leaf"
    assert (fs.lstat("").nlink, fs.lstat("p").nlink) == (nd - 1, np_ + 1)  # the directory's ".." moved
    fs.exchange("d", "p/f")
    assert fs.read_all("d/sub/leaf") == b"leaf" and fs.read_all("p/f") == b"file"
    assert (fs.lstat("").nlink, fs.lstat("p").nlink) == (nd, np_)


def test_exchange_symlinks_and_specials(env, fs):
    fs.symlink("target", "l")
    env.special("s")
    fs.exchange("l", "s")
    assert fs.readlink("s") == "target" and fs.lstat("l").kind == OTHER


def test_exchange_errors(fs):
    fs.mkdir("d", 0o755)
    fs.mkdir("d/e", 0o755)
    mkfile(fs, "f", b"f")
    check_errno(errno.ENOENT, fs.exchange, "f", "missing")
    check_errno(errno.ENOENT, fs.exchange, "missing", "f")
    check_errno(errno.EINVAL, fs.exchange, "d", "d/e")  # into its own subtree
    check_errno(errno.EINVAL, fs.exchange, "d/e", "d")
    fs.symlink("d", "l")
    check_errno(errno.ELOOP, fs.exchange, "l/e", "f")
    check_errno(errno.EBUSY, fs.exchange, "", "f")
    fs.link("f", "g")
    fs.exchange("f", "g")  # one inode: nothing happens
    fs.exchange("f", "f")
    assert fs.read_all("f") == b"f" and sorted(fs.listdir("")) == ["d", "f", "g", "l"]


@pytest.mark.parametrize("listxattrat", [True, False], ids=["listxattrat", "proc"])
def test_getattr_xattr_names_is_getattr_and_listxattr_of_one_entry(env, fs, monkeypatch, listxattrat):
    """One resolution for both (the real fs: O_PATH|O_NOFOLLOW, fstat, listxattr through the
    descriptor): the same answers as getattr and listxattr — by path, ``listxattrat`` beneath
    the parent's descriptor, or through ``/proc`` where the kernel lacks it —, a symlink has no
    names, and the errors of both are getattr's (missing, a symlink on the way)."""
    from sandbox.hostfs import real

    if listxattrat and not real._LISTXATTRAT:
        pytest.skip("this kernel has no listxattrat (Linux < 6.13)")
    monkeypatch.setattr(real, "_LISTXATTRAT", listxattrat)
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/f", b"abc")
    fs.setxattr("d/f", "user.k", b"v")
    fs.symlink("f", "d/l")
    for p in ("", "d", "d/f", "d/l"):
        a, names = fs.getattr_xattr_names(p)
        assert a == fs.getattr(p), p
        assert sorted(names) == sorted(fs.listxattr(p)), p
    assert "user.k" in fs.getattr_xattr_names("d/f")[1]
    assert fs.listxattr("d/l") == [] and "user.k" in fs.listxattr("d/f")
    fs.symlink("d", "dl")
    for call in (fs.getattr_xattr_names, fs.listxattr):
        check_errno(errno.ENOENT, call, "d/missing")
        check_errno(errno.ELOOP, call, "dl/f")
        check_errno(errno.ENOTDIR, call, "d/f/x")


def test_a_directory_handle_reads_its_entries_as_paths_are_read(env, fs):
    """``open_dir``'s handle answers for its entries (``getattr_at``, ``getattr_xattr_names_at``,
    ``getxattr_at``: the real fs's ``fstatat`` and ``l*xattr`` beneath the descriptor) as
    ``getattr_xattr_names`` and ``getxattr`` answer for their paths — a file, a symlink (its
    own, never followed), a subdirectory, a fifo — and still after the directory is renamed
    (its inode's entries); a name that is not one component is EINVAL, a missing one ENOENT."""
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/f", b"abc")
    fs.setxattr("d/f", "user.k", b"v")
    fs.symlink("f", "d/l")
    fs.mkdir("d/s", 0o700)
    env.special("d/p")
    h = fs.open_dir("d")
    try:
        want = {n: fs.getattr_xattr_names(f"d/{n}") for n in ("f", "l", "s", "p")}
        fs.rename("d", "moved")
        for n, (a, names) in want.items():
            got, got_names = h.getattr_xattr_names_at(n)
            assert got == a and sorted(got_names) == sorted(names), n
            assert h.getattr_at(n) == a, n
        assert h.getxattr_at("f", "user.k") == b"v" and h.fstat() == fs.getattr("moved")
        check_errno(errno.ENODATA, h.getxattr_at, "f", "user.none")
        check_errno(errno.ENODATA, h.getxattr_at, "l", "user.k")  # the link's own: none
        check_errno(errno.ENOENT, h.getattr_xattr_names_at, "missing")
        check_errno(errno.ENOENT, h.getattr_at, "missing")
        for bad in ("", ".", "..", "s/x"):
            check_errno(errno.EINVAL, h.getattr_xattr_names_at, bad)
            check_errno(errno.EINVAL, h.getattr_at, bad)
            check_errno(errno.EINVAL, h.getxattr_at, bad, "user.k")
    finally:
        h.close()
    check_errno(errno.EBADF, h.getattr_xattr_names_at, "f")
    check_errno(errno.EBADF, h.getattr_at, "f")
    check_errno(errno.ENOTDIR, fs.open_dir, "moved/f")
    check_errno(errno.ENOENT, fs.open_dir, "d")
    fs.symlink("moved", "dl")
    check_errno(errno.ENOTDIR, fs.open_dir, "dl")  # never followed (O_DIRECTORY checked first)
    check_errno(errno.ELOOP, fs.open_dir, "dl/s")


def test_a_handle_answers_its_attributes_and_xattr_names_in_one_call(fs):
    """``FileHandle.fstat_xattr_names`` (a GETATTR through a kept descriptor): what ``fstat``
    and ``listxattr`` answer, of the handle's inode wherever its name went — a file and a
    directory (``open_dir``) — and EBADF once closed, as every call."""
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/f", b"abc")
    fs.setxattr("d/f", "user.k", b"v")
    fs.setxattr("d", "user.dk", b"w")
    f, d = fs.open("d/f", os.O_RDONLY), fs.open_dir("d")
    try:
        fs.rename("d", "moved")
        for h, path in ((f, "moved/f"), (d, "moved")):
            a, names = h.fstat_xattr_names()
            assert a == h.fstat() == fs.getattr(path)
            assert sorted(names) == sorted(h.listxattr()) == sorted(fs.getattr_xattr_names(path)[1])
        assert "user.k" in f.fstat_xattr_names()[1] and "user.dk" in d.fstat_xattr_names()[1]
    finally:
        f.close()
        d.close()
    check_errno(errno.EBADF, f.fstat_xattr_names)
    check_errno(errno.EBADF, d.fstat_xattr_names)


def test_a_handle_knows_its_own_inode_after_its_name_is_replaced(fs):
    """``FileHandle.is_inode_of``: true for the stat of the handle's own file (also after its
    name was unlinked and made again: the new file is another inode), false for another
    file's; ``EBADF`` once closed (the real handle answers from its first ``fstat``)."""
    mkfile(fs, "f", b"a")
    mkfile(fs, "g", b"b")
    h = fs.open("f", os.O_RDONLY)
    try:
        first = fs.lstat("f")
        assert h.is_inode_of(first) and not h.is_inode_of(fs.lstat("g"))
        fs.unlink("f")
        mkfile(fs, "f", b"c")
        assert not h.is_inode_of(fs.lstat("f")) and h.is_inode_of(first)
    finally:
        h.close()
    check_errno(errno.EBADF, h.is_inode_of, first)


def test_an_entry_looks_then_removes_as_the_path_calls_do(env, fs):
    """``HostFS.entry``: a look and then the removal of one path answer as ``lstat``,
    ``unlink`` and ``rmdir`` of the path do (errors included: a missing parent is tried
    again). On the real disk the parent is resolved once: a directory moved between the look
    and the unlink still loses the entry that was looked at, never one put at the old path."""
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/f", b"abc")
    fs.mkdir("d/e", 0o755)
    mkfile(fs, "d/e/x", b"x")
    with fs.entry("d/f") as e:
        assert e.lstat() == fs.lstat("d/f")
        e.unlink()
    assert fs.lstat_or_none("d/f") is None
    with fs.entry("d/e") as e:
        check_errno(errno.ENOTEMPTY, e.rmdir)
        check_errno(errno.EISDIR, e.unlink)
        fs.unlink("d/e/x")
        e.rmdir()
    assert fs.listdir("d") == []
    with fs.entry("d/missing") as e:
        check_errno(errno.ENOENT, e.lstat)
        check_errno(errno.ENOENT, e.unlink)
    with fs.entry("n/f") as e:
        check_errno(errno.ENOENT, e.lstat)
        fs.mkdir("n", 0o755)  # the parent that was missing is looked for again
        mkfile(fs, "n/f", b"n")
        e.unlink()
    assert fs.listdir("n") == []
    for p in ("", "d/f/x"):
        with fs.entry(p) as e:
            check_errno(errno.EBUSY if not p else errno.ENOENT, e.unlink)
    if not env.real:
        return
    mkfile(fs, "d/g", b"looked at")
    with fs.entry("d/g") as e:
        seen = e.lstat()
        fs.rename("d", "moved")
        fs.mkdir("d", 0o755)
        mkfile(fs, "d/g", b"someone else's")
        e.unlink()
    assert fs.lstat_or_none("moved/g") is None and fs.read_all("d/g") == b"someone else's"
    assert seen.ino != fs.lstat("d/g").ino


def test_an_entry_reads_the_file_it_looked_at_for_a_preimage(env, fs):
    """``Entry.xattrs`` is ``HostFS.xattrs`` of the entry (a directory's, a symlink's own);
    ``Entry.reader(st)`` on the real disk is a read-only handle on the very inode ``st``
    describes — its bytes and xattrs —, and ``None`` for anything else: a directory, a
    symlink, a file or fifo put at the name after the look (never opened). The simulated
    disk gives none (reads by path, the same calls as before)."""
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/f", b"abc")
    fs.setxattr("d/f", "user.k", b"v")
    fs.setxattr("d", "user.dir", b"w")
    fs.symlink("f", "d/l")
    with fs.entry("d") as e:
        assert e.xattrs() == fs.xattrs("d") == {"user.dir": b"w"}
        assert e.reader(e.lstat()) is None
    with fs.entry("d/l") as e:
        assert e.xattrs() == fs.xattrs("d/l")
        assert e.reader(e.lstat()) is None
    with fs.entry("d/f") as e:
        st = e.lstat()
        assert e.xattrs() == {"user.k": b"v"}
        r = e.reader(st)
        if env.real:
            assert r is not None
            try:
                assert r.is_inode_of(st) and r.read_own(10, 0) == b"abc" and r.xattrs() == {"user.k": b"v"}
            finally:
                r.close()
        else:
            assert r is None
        fs.rename("d/f", "d/kept")  # kept: its inode number is not reused
        mkfile(fs, "d/f", b"someone else's")
        assert e.reader(st) is None  # not the inode looked at
        fs.unlink("d/f")
        fs.mknod("d/f", 0o644, stat.S_IFIFO)
        assert e.reader(st) is None  # a fifo is never opened (this would block)
        fs.unlink("d/f")
        assert e.reader(st) is None  # gone


def test_an_entry_creates_exclusively_where_its_look_found_nothing(env, fs):
    """``Entry.create_handle`` is ``HostFS.create_handle`` of the entry (the undo core's look
    before a CREATE and the creation): a new file with the mode given, the handle on it;
    ``EEXIST`` where anything is, a symlink included (never followed), so the look's "nothing
    there" holds or the create fails. On the real disk through the parent the look resolved:
    the directory looked in, even if it was renamed between the look and the create (the
    simulated disk's generic entry creates by path)."""
    fs.mkdir("d", 0o755)
    fs.symlink("nowhere", "d/l")
    mkfile(fs, "d/f", b"x")
    with fs.entry("d/n") as e:
        assert e.lstat_or_none() is None
        with e.create_handle(0o640, os.O_RDWR) as h:
            h.pwrite(b"new", 0)
            assert h.fstat().ino == fs.lstat("d/n").ino
    assert fs.read_all("d/n") == b"new" and fs.lstat("d/n").mode & 0o7777 == 0o640
    for name in ("f", "l", "n"):
        with fs.entry(f"d/{name}") as e:
            check_errno(errno.EEXIST, e.create_handle, 0o644, os.O_WRONLY)
    assert fs.readlink("d/l") == "nowhere" and not fs.exists("nowhere")
    with fs.entry("d/m") as e:
        assert e.lstat_or_none() is None
        fs.rename("d", "moved")
        if env.real:
            e.create_handle(0o644, os.O_WRONLY).close()
            assert fs.exists("moved/m")
        else:  # the path call: no "d" any more
            check_errno(errno.ENOENT, e.create_handle, 0o644, os.O_WRONLY)


def test_a_directory_handle_lists_its_inode_wherever_it_moved(fs):
    """``FileHandle.listdir`` of an ``open_dir`` handle: ``listdir`` of the path while it
    names the directory, and still that directory's names after it is renamed and another
    is made at its old path; a file's handle cannot list (``ENOTDIR``)."""
    fs.mkdir("d", 0o755)
    mkfile(fs, "d/a", b"a")
    fs.mkdir("d/s", 0o755)
    h = fs.open_dir("d")
    try:
        assert sorted(h.listdir()) == sorted(fs.listdir("d")) == ["a", "s"]
        assert sorted(h.listdir()) == ["a", "s"]  # again: the descriptor was rewound
        fs.rename("d", "moved")
        fs.mkdir("d", 0o755)
        mkfile(fs, "d/other", b"o")
        assert sorted(h.listdir()) == ["a", "s"]
    finally:
        h.close()
    f = fs.open("d/other", os.O_RDONLY)
    try:
        check_errno(errno.ENOTDIR, f.listdir)
    finally:
        f.close()


def test_a_bounded_listing_reads_only_up_to_its_bound(env, fs):
    """``listdir(path, limit_bytes=N)`` (and a directory handle's): every name read costs
    ``len(name) + DIR_ENTRY_OVERHEAD_BYTES`` (:func:`~sandbox.limits.listing_cost`); the read
    stops at the first name that would pass ``N`` — ``ListingTooLarge`` (``ENOMEM``) holding
    only the names read before it — so a huge directory never costs more than the bound. A
    listing within the bound is the whole one; the handle lists whole again afterwards."""
    fs.mkdir("d", 0o755)
    names = [f"n{i:05d}" for i in range(300)]
    for n in names:
        mkfile(fs, f"d/{n}")
    whole = listing_cost(names)
    each = len(names[0]) + DIR_ENTRY_OVERHEAD_BYTES
    assert whole == each * len(names)
    h = fs.open_dir("d")
    try:
        for listdir in (lambda **kw: fs.listdir("d", **kw), lambda **kw: h.listdir(**kw)):
            assert sorted(listdir(limit_bytes=whole)) == names  # exactly at the bound: whole
            for bound in (whole - 1, 5 * each, 5 * each + each - 1, 0):
                before = None if env.real else fs.entries_read
                e = check_errno(errno.ENOMEM, listdir, limit_bytes=bound)
                assert isinstance(e, ListingTooLarge) and e.limit_bytes == bound
                assert len(e.names) == bound // each and set(e.names) <= set(names)
                if not env.real:  # the host read stopped at the name that passed the bound
                    assert fs.entries_read - before == len(e.names) + 1
            assert sorted(listdir()) == names  # unbounded, and the handle was rewound
        fs.mkdir("empty", 0o755)
        assert fs.listdir("empty", limit_bytes=0) == []
        check_errno(errno.ENOTDIR, fs.listdir, "d/n00000", limit_bytes=0)
    finally:
        h.close()


def test_sim_remembered_paths_never_outlive_a_rename_a_removal_or_a_power_loss():
    """MemoryHostFS remembers where a path led (``_walk``); every answer must still be the
    one a fresh walk gives after the tree's names move, go or come back from a power loss."""
    fs = MemoryHostFS()
    fs.mkdir("d", 0o755)
    fs.mkdir("d/e", 0o755)
    mkfile(fs, "d/e/f", b"one")
    fs.sync_all()
    assert fs.read_all("d/e/f") == b"one" and fs.lstat_or_none("d/e/f") is not None  # both remembered now
    fs.rename("d", "g")
    check_errno(errno.ENOENT, fs.read, "d/e/f", 0, 3)
    assert fs.lstat_or_none("d/e/f") is None and fs.read_all("g/e/f") == b"one"
    fs.unlink("g/e/f")
    fs.rmdir("g/e")
    mkfile(fs, "g/e", b"a file now")  # the name now holds a file: no longer a way through
    check_errno(errno.ENOTDIR, fs.read, "g/e/f", 0, 3)
    assert fs.lstat_or_none("g/e/f") is None
    fs.mkdir("x", 0o755)
    fs.mkdir("y", 0o755)
    mkfile(fs, "x/in_x", b"x")
    mkfile(fs, "y/in_y", b"y")
    assert fs.read_all("x/in_x") == b"x"
    fs.exchange("x", "y")
    assert fs.read_all("x/in_y") == b"y" and fs.lstat_or_none("x/in_x") is None
    fs.power_loss()  # back to the synced tree: d/e/f, and nothing made since
    assert fs.read_all("d/e/f") == b"one"
    for gone in ("g/e", "x/in_y", "y/in_x"):
        assert fs.lstat_or_none(gone) is None
        check_errno(errno.ENOENT, fs.read, gone, 0, 1)


def _name_call(fs, op: str, p: str, q: str, rng) -> None:
    """One call of the remembered-path tests' random sequences (an ``OSError`` as the disk raises it)."""
    if op == "file":
        mkfile(fs, p, rng.choice([b"1", b"22", b"333"]))
    elif op == "create":
        fs.create(p, 0o644)
    elif op == "mkdir":
        fs.mkdir(p, 0o755)
    elif op == "symlink":
        fs.symlink("d", p)
    elif op == "mknod":
        fs.mknod(p, 0o644, stat.S_IFIFO)
    elif op in ("unlink", "rmdir"):
        getattr(fs, op)(p)
    elif op in ("rename", "exchange", "link"):
        getattr(fs, op)(p, q)
    else:
        fs.lstat_or_none(p)


def test_sim_remembered_paths_answer_as_a_fresh_walk_after_random_names_go_and_come():
    """A removed or replaced file or empty directory drops only its own remembered path
    (a directory moved drops them all): after every call of a random sequence of creates,
    links, removals, renames and exchanges over a small name space, every path answers
    ``lstat_or_none`` and ``read`` as a walk with nothing remembered does."""
    import random

    names = ["a", "b", "d", "d/a", "d/b", "d/e", "d/e/a", "e", "e/a"]
    for seed in range(30):
        rng = random.Random(seed)
        fs = MemoryHostFS()
        for _ in range(120):
            p, q = rng.choice(names), rng.choice(names)
            op = rng.choice(["file", "file", "mkdir", "unlink", "rmdir", "rename", "rename", "exchange", "link"])
            try:
                _name_call(fs, op, p, q, rng)
            except OSError:
                pass
            for path in names:
                remembered = fs.lstat_or_none(path)
                kept, fs._resolved = fs._resolved, {}
                fresh = fs.lstat_or_none(path)
                fs._resolved = kept
                assert remembered == fresh, (seed, op, p, q, path)
                if fresh is not None and fresh.kind == "reg":
                    kept, fs._resolved = fs._resolved, {}
                    data = fs.read(path, 0, 8)
                    fs._resolved = kept
                    assert fs.read(path, 0, 8) == data, (seed, path)


def test_sim_a_name_just_made_is_remembered_and_every_remembered_path_leads_where_a_walk_does():
    """A path a call just made (create, mkdir, symlink, mknod, link, rename to it) is
    remembered at once — the next call on it does not walk — and after every call of a
    random sequence that also removes, replaces, moves and exchanges names, every path the
    disk remembers leads to the inode a walk with nothing remembered finds (read straight
    from the memory: no look in between refills it)."""
    import random

    names = ["a", "b", "d", "d/a", "d/b", "d/e", "d/e/a", "e", "e/a", "l/a"]
    made_ops = {"create", "mkdir", "symlink", "mknod", "link", "rename"}

    def walked(fs, path):
        kept, fs._resolved = fs._resolved, {}
        try:
            return fs._walk(path)
        except OSError:
            return None
        finally:
            fs._resolved = kept

    made = 0
    for seed in range(40):
        rng = random.Random(seed)
        fs = MemoryHostFS()
        for _ in range(120):
            p, q = rng.choice(names), rng.choice(names)
            op = rng.choice(["create", "create", "mkdir", "symlink", "mknod", "unlink", "rmdir", "rename", "rename",
                             "exchange", "link", "look"])
            target = q if op in ("rename", "link") else p
            # a rename onto the same inode (or name) does nothing: nothing is made
            noop = op == "rename" and walked(fs, p) is walked(fs, q)
            try:
                _name_call(fs, op, p, q, rng)
            except OSError:
                pass
            else:
                if op in made_ops and not noop:
                    assert fs._resolved.get(target) is walked(fs, target) is not None, (seed, op, p, q)
                    made += 1
            for path, node in list(fs._resolved.items()):
                assert walked(fs, path) is node, (seed, op, p, q, path)
    assert made > 300, made


def test_sim_clock_ticks_are_one_sequence_whoever_calls_it():
    """A disk's own ticks (``SimClock.tick``) and calls of the clock draw from one strictly
    increasing sequence, 1 ms + 1 ns apart, from the start given; another clock is called."""
    from sandbox.hostfs.memory import SimClock

    clock = SimClock(1000)
    fs = MemoryHostFS(clock=clock)  # its root's times: the first tick
    assert fs.lstat("").mtime_ns == 1000 + 1_000_001
    assert clock() == 1000 + 2 * 1_000_001
    fs.create("f", 0o644)
    assert fs.lstat("f").ctime_ns == 1000 + 3 * 1_000_001
    assert clock() == 1000 + 4 * 1_000_001
    fs.clock = lambda: 7
    fs.create("g", 0o644)
    assert fs.lstat("g").mtime_ns == 7 and fs.clock() == 7


def test_sim_remembered_paths_are_bounded():
    from sandbox.hostfs.memory import RESOLVED_PATHS_KEPT_MAX

    fs = MemoryHostFS()
    fs.mkdir("d", 0o755)
    for i in range(RESOLVED_PATHS_KEPT_MAX + 10):
        fs.create(f"d/{i}", 0o644)
        fs.read(f"d/{i}", 0, 1)
    assert 0 < len(fs._resolved) <= RESOLVED_PATHS_KEPT_MAX
    assert all(fs.lstat(f"d/{i}").kind == "reg" for i in range(0, RESOLVED_PATHS_KEPT_MAX + 10, 97))


def test_sim_changes_counts_every_call_that_may_change_the_tree():
    fs = MemoryHostFS()
    mkfile(fs, "f", b"x")
    n = fs.changes
    fs.read_all("f")
    fs.lstat("f")
    fs.listdir("")
    assert fs.changes == n  # reads change nothing
    with fs.open("f", os.O_RDWR) as h:
        h.pwrite(b"y", 0)  # through a handle
        assert fs.changes == n + 1
    fs.chmod("f", 0o600)
    fs.power_loss()
    assert fs.changes == n + 3


def test_sim_read_all_and_write_all_make_exactly_the_calls_of_their_loops():
    """write_all: one write per chunk, continuing after a short write where it stopped, none
    for no bytes; read_all: reads until one returns nothing (one read for an empty file)."""
    rec = _Recorder()
    short = {"left": 1}

    def hook(fs, op, path, nbytes):
        rec(fs, op, path, nbytes)
        if op == "write" and short["left"]:
            short["left"] -= 1
            return 3  # a short write (no crash follows: this hook has no after_torn_write)
        return None

    fs = MemoryHostFS(fault_hook=hook)
    fs.create("f", 0o644)
    rec.calls.clear()
    fs.write_all("f", 0, b"abcdefgh")
    fs.write_all("f", 8, bytearray(b"ij"))
    fs.write_all("f", 10, b"")
    assert [c for c in rec.calls if c[0] == "write"] == [("write", "f", 8), ("write", "f", 5), ("write", "f", 2)]
    rec.calls.clear()
    assert fs.read_all("f") == b"abcdefghij" and type(fs.read_all("f")) is bytes
    fs.create("empty", 0o644)
    assert fs.read_all("empty") == b""
    assert fs.read_all("f", chunk_bytes=4) == b"abcdefghij"
    assert [c[1:] for c in rec.calls if c[0] == "read"] == [("f", 0), ("f", 0), ("f", 0), ("f", 0), ("empty", 0), ("f", 0), ("f", 0), ("f", 0),
                                          ("f", 0)]


def test_read_own_reads_a_write_only_handle_without_moving_its_atime(tmp_path):
    """``FileHandle.read_own`` (the undo core's preimage read through a client's descriptor):
    the handle's inode, whatever its access mode and wherever its name went, and — as a read
    by path — ``O_NOATIME``: an atime a client set stays."""
    fs = RealHostFS(str(tmp_path))
    fs.create("f", 0o644)
    fs.write_all("f", 0, b"the bytes")
    old = 1_000_000_000 * 10**9
    os.utime(tmp_path / "f", ns=(old, 2_000_000_000 * 10**9))  # atime older than mtime: relatime would move it
    with fs.open("f", os.O_WRONLY) as h:
        with pytest.raises(OSError):
            h.pread(4, 0)  # the client's own reads keep the access mode
        fs.rename("f", "g")
        fs.create("f", 0o644)  # someone else's file at the old name
        assert h.read_own(100, 4) == b"bytes"
        assert h.read_own(4, 0) == b"the "
    assert os.stat(tmp_path / "g").st_atime_ns == old
    mem = MemoryHostFS()
    mem.create("m", 0o644)
    mem.write_all("m", 0, b"simulated")
    with mem.open("m", os.O_WRONLY) as h:
        assert h.read_own(100, 0) == b"simulated"


@pytest.mark.parametrize("flags", [os.O_RDWR, os.O_RDONLY, os.O_RDWR | os.O_APPEND])
def test_read_own_through_a_readable_handle_moves_no_atime_and_leaves_its_flags(tmp_path, flags):
    """``read_own`` through a handle open for reading reads its own descriptor with
    ``O_NOATIME`` for that read alone: the atime a client set stays, and the handle is as it
    was after — its own reads move the atime again (relatime), an ``O_APPEND`` handle still
    appends."""
    fs = RealHostFS(str(tmp_path))
    fs.create("f", 0o644)
    fs.write_all("f", 0, b"the bytes")
    old = 1_000_000_000 * 10**9
    os.utime(tmp_path / "f", ns=(old, 2_000_000_000 * 10**9))  # atime older than mtime: relatime would move it
    with fs.open("f", flags) as h:
        assert h.read_own(100, 4) == b"bytes"
        assert os.stat(tmp_path / "f").st_atime_ns == old
        if flags & os.O_APPEND:
            h.pwrite(b"!", 0)
            assert fs.read_all("f") == b"the bytes!"
        else:
            assert h.pread(3, 0) == b"the"
            assert os.stat(tmp_path / "f").st_atime_ns != old


@pytest.mark.timeout(30)
def test_lstat_head_is_lstat_then_read_in_one_resolution(tmp_path):
    """``RealHostFS.lstat_head`` (a fingerprint's look and first read) answers as the base
    class's two calls do — for a file, a symlink, a fifo (never opened: that would block
    here), a directory, nothing, and a path below a symlink — and leaves the atime."""
    from sandbox.hostfs import HostFS

    fs = RealHostFS(str(tmp_path))
    fs.create("f", 0o640)
    fs.write_all("f", 0, b"0123456789")
    old = 1_000_000_000 * 10**9
    os.utime(tmp_path / "f", ns=(old, 2_000_000_000 * 10**9))
    fs.symlink("f", "ln")
    fs.mkdir("d", 0o755)
    os.mkfifo(tmp_path / "fifo")
    os.symlink(str(tmp_path / "d"), tmp_path / "outside")
    for path in ("f", "ln", "fifo", "d", "missing", "outside/x", "f/below"):
        for length in (lambda s: s.size + 1, lambda s: 4):
            assert fs.lstat_head(path, length) == HostFS.lstat_head(fs, path, length), path
    st, head = fs.lstat_head("f", lambda s: 4)
    assert (st.kind, st.size, head) == ("reg", 10, b"0123")
    assert fs.lstat_head("fifo", lambda s: 4)[1] is None
    assert os.stat(tmp_path / "f").st_atime_ns == old


def test_stat_is_frozen_and_compared_hashed_copied_by_its_fields():
    import copy
    import dataclasses
    import pickle

    from sandbox.hostfs import Stat

    s = Stat("reg", 0o644, 5, 1, 2, 3, 1, uid=7)
    assert dataclasses.astuple(s) == ("reg", 0o644, 5, 1, 2, 3, 1, 0, 0, 7, 0)
    assert s == Stat("reg", 0o644, 5, 1, 2, 3, 1, 0, 0, 7, 0) and hash(s) == hash(Stat("reg", 0o644, 5, 1, 2, 3, 1, 0, 0, 7, 0))
    assert s != Stat("reg", 0o644, 6, 1, 2, 3, 1, 0, 0, 7, 0)
    assert copy.copy(s) == s and pickle.loads(pickle.dumps(s)) == s
    assert dataclasses.replace(s, size=9).size == 9 and s.size == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.size = 6


@pytest.mark.parametrize("syscall", [True, False], ids=["listxattrat", "proc"])
def test_an_entrys_xattr_names_beneath_a_directory_are_llistxattrs(tmp_path, monkeypatch, syscall):
    """``_listxattr_at`` (a listed entry's and a removal's xattr names, beneath the directory's
    descriptor) answers what ``llistxattr`` of the entry answers — with ``listxattrat`` where
    the kernel has it and through ``/proc/self/fd`` where not: the names decoded alike (a
    non-UTF-8 one too), a list longer than the first buffer, a symlink's own (never its
    target's), a missing name ``ENOENT``."""
    from sandbox.hostfs import real

    if syscall and not real._LISTXATTRAT:
        pytest.skip("this kernel has no listxattrat (Linux < 6.13)")
    monkeypatch.setattr(real, "_LISTXATTRAT", syscall)
    f = tmp_path / "f"
    f.write_bytes(b"x")
    try:
        for i in range(20):  # 20 names of 25 bytes: past the first 256-byte buffer
            os.setxattr(f, f"user.{'n' * 16}{i:03d}", b"v")
        os.setxattr(f, os.fsdecode(b"user.\xff"), b"v")
    except OSError as e:
        pytest.skip(f"no user xattrs here: {e}")
    os.symlink("f", tmp_path / "l")
    dfd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        for name in ("f", "l"):
            assert sorted(real._listxattr_at(dfd, name)) == sorted(os.listxattr(tmp_path / name, follow_symlinks=False))
        assert len(real._listxattr_at(dfd, "f")) == 21 and real._listxattr_at(dfd, "l") == []
        with pytest.raises(OSError) as e:
            real._listxattr_at(dfd, "missing")
        assert e.value.errno == errno.ENOENT
    finally:
        os.close(dfd)
