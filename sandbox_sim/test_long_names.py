"""NAME_MAX names and paths longer than PATH_MAX, over the 9P wire, and their undo (issue 15).

Every operation a guest can send with a name of 1..255 bytes — ASCII, multi-byte UTF-8,
and bytes that are not UTF-8 at all (the codec carries them with ``surrogateescape``) —
works, and undoing the step restores the tree oracle-exactly; 256 bytes is
``ENAMETOOLONG`` and changes nothing. A guest builds trees deeper than PATH_MAX with
relative walks (pjdfstest ``mkdir -p``'s a PATH_MAX-1 path *below* its test directory):
the server's relative path then exceeds 4096 bytes though every syscall the guest made
was legal; such a tree is written, removed with ``rm -rf`` and undone exactly, up to
:data:`~sandbox.hostfs.TREE_PATH_BYTES_MAX` (beyond: ``ENAMETOOLONG``).

Each test runs against a real temporary folder (RealHostFS, openat2) and against the
simulation (MemoryHostFS), both behind a real 9P server and our client.
"""

from __future__ import annotations

import errno

import pytest

from sandbox.core.workspace import Workspace
from sandbox.hostfs import NAME_LEN_MAX, PATH_LEN_MAX, TREE_PATH_BYTES_MAX, join
from sandbox.hostfs.memory import MemoryHostFS
from sandbox.mounts import Provider
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client
from sandbox.ninep.wirefs import WireFS, serve
from sandbox_sim import oracle

pytestmark = pytest.mark.timeout(120)

#: 255-byte names: ASCII, 2- and 3-byte UTF-8, and raw non-UTF-8 bytes (0x80..0xff)
NAMES = {
    "ascii": "a" * NAME_LEN_MAX,
    "utf8-2": "é" * 127 + "a",
    "utf8-3": "日" * 85,
    "not-utf8": "".join(chr(0xDC80 + i % 128) for i in range(NAME_LEN_MAX)),
    "mixed": "x\udcffé日" * 36 + "abc",
}


def nbytes(name: str) -> int:
    return len(name.encode("utf-8", "surrogateescape"))


def variant(name: str, last: str) -> str:
    """Another name of at most 255 bytes: ``name`` with its last character replaced."""
    return name[:-1] + last


@pytest.fixture(params=["real", "sim"])
def share(request, tmp_path):
    """(workspace, WireFS over a real 9P server on it)."""
    if request.param == "real":
        work = tmp_path / "work"
        work.mkdir()
        (work / "dir").mkdir()
        (work / "dir" / "keep").write_bytes(b"keep")
        ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"))
    else:
        host = MemoryHostFS("work")
        host.mkdir("dir", 0o755)
        host.create("dir/keep", 0o644)
        host.write_all("dir/keep", 0, b"keep")
        ws = Workspace.open_on(host, MemoryHostFS("store"))
    try:
        with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path) as c:
            yield ws, WireFS(c)
    finally:
        ws.close()


def undo_all(ws) -> None:
    ws.close_active()
    ws.rollback(len(ws.history()))


def errno_of(fn, *args) -> int:
    with pytest.raises(OSError) as info:
        fn(*args)
    return info.value.errno


def test_the_names_are_name_max_long():
    for name in NAMES.values():
        assert nbytes(name) == NAME_LEN_MAX, name


@pytest.mark.parametrize("kind", sorted(NAMES))
def test_every_operation_on_a_name_max_name_and_its_undo(share, kind):
    ws, fs = share
    name = NAMES[kind]
    other, third, sub = variant(name, "1"), variant(name, "2"), variant(name, "3")
    before = oracle.snapshot(ws.fs.host)
    f, d = join("dir", name), join("dir", sub)
    fs.write_file(f, b"content of a long name")
    fs.mkdir(d, 0o750)
    fs.write_file(join(d, name), b"inner")
    fs.symlink(name, join(d, other))  # a 255-byte name pointing at a 255-byte target
    assert fs.readlink(join(d, other)) == name
    fs.rename(f, join("dir", other))
    fs.link(join("dir", other), join("dir", third))
    assert fs.lstat(join("dir", third)).nlink == 2
    fs.setxattr(join("dir", third), "user.long", b"v")
    fs.setxattr(d, "user.long", b"d")
    assert fs.xattrs(join("dir", other)) == {"user.long": b"v"}
    fs.removexattr(d, "user.long")
    fs.chmod(join("dir", other), 0o600)
    fs.utime(join("dir", other), 1_234_567_891_123_456_789)
    assert sorted(fs.listdir("dir")) == sorted(["keep", other, third, sub])
    assert sorted(fs.listdir(d)) == sorted([name, other])
    assert fs.read_file(join("dir", third)) == b"content of a long name"
    ws.close_active()  # the removals are the next step
    mid = oracle.snapshot(ws.fs.host)
    fs.unlink(join(d, other))
    fs.unlink(join(d, name))
    fs.rmdir(d)
    fs.unlink(join("dir", third))
    assert sorted(fs.listdir("dir")) == sorted(["keep", other])
    ws.close_active()
    ws.rollback(1)  # the removals alone: undone exactly
    oracle.assert_same(mid, oracle.snapshot(ws.fs.host), "undo of the removals of 255-byte names")
    undo_all(ws)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of every operation on 255-byte names")


def test_a_name_of_256_bytes_is_enametoolong_everywhere(share):
    ws, fs = share
    long = "b" * (NAME_LEN_MAX + 1)
    long_utf8 = "é" * 128  # 256 bytes, 128 characters
    fs.write_file("dir/f", b"x")
    before = oracle.snapshot(ws.fs.host)
    for bad in (long, long_utf8):
        p = join("dir", bad)
        assert errno_of(fs.write_file, p, b"x") == errno.ENAMETOOLONG
        assert errno_of(fs.create, p) == errno.ENAMETOOLONG
        assert errno_of(fs.mkdir, p) == errno.ENAMETOOLONG
        assert errno_of(fs.symlink, "t", p) == errno.ENAMETOOLONG
        assert errno_of(fs.rename, "dir/f", p) == errno.ENAMETOOLONG
        assert errno_of(fs.link, "dir/f", p) == errno.ENAMETOOLONG
        assert errno_of(fs.unlink, p) == errno.ENAMETOOLONG
        assert errno_of(fs.rmdir, p) == errno.ENAMETOOLONG
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "refused 256-byte names")


def test_undo_of_removing_a_directory_of_name_max_names(share):
    """``rm -rf`` of a directory holding many 255-byte names (the preimage lists them)."""
    ws, fs = share
    fs.mkdir("dir/" + NAMES["utf8-3"])
    for i, name in enumerate(NAMES.values()):
        fs.write_file(join("dir/" + NAMES["utf8-3"], name), bytes([i]) * 100)
        fs.symlink(name, join("dir/" + NAMES["utf8-3"], variant(name, "L")))
    ws.close_active()
    before = oracle.snapshot(ws.fs.host)
    fs.remove_tree("dir")
    assert not fs.exists("dir")
    ws.close_active()
    ws.rollback(1)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of rm -rf of 255-byte names")


# --------------------------------------------------------------------------- deeper than PATH_MAX


def mkdir_p_relative(fs: WireFS, start: str, total: int) -> tuple[int, list[str]]:
    """``mkdir -p`` as a guest does it below ``start``: one Tmkdir and one single-name
    Twalk from the previous directory's fid at a time, until the relative path is
    ``total`` bytes. Returns (fid of the deepest directory, the names)."""
    c = fs.c
    fid = c.walk_path(start, fs.root_fid)
    names: list[str] = []
    size = -1
    while size < total:
        left = total - size - 1
        n = min(NAME_LEN_MAX, left if left <= NAME_LEN_MAX or left - NAME_LEN_MAX > 1 else left - 2)
        name = f"{len(names):04d}".ljust(n, "p")[:n]
        c.mkdir(fid, name, 0o755)
        nfid, _ = c.walk(fid, [name])
        c.clunk(fid)
        fid = nfid
        names.append(name)
        size += 1 + n
    assert size == total
    return fid, names


@pytest.mark.parametrize("total", [PATH_LEN_MAX - 1, 3 * PATH_LEN_MAX], ids=str)
def test_a_tree_deeper_than_path_max_written_removed_and_undone(share, total):
    ws, fs = share
    before = oracle.snapshot(ws.fs.host)
    fid, names = mkdir_p_relative(fs, "dir", total)
    c = fs.c
    c.lcreate(fid, "file", m.DOTL_WRONLY | m.DOTL_CREATE | m.DOTL_EXCL, 0o640)
    c.write_all(fid, 0, b"deep content")
    c.clunk(fid)
    deep = "dir/" + "/".join(names)
    assert len(deep.encode()) > PATH_LEN_MAX  # the server's relative path is beyond PATH_MAX
    assert fs.read_file(deep + "/file") == b"deep content"
    fs.symlink("file", deep + "/link")
    fs.setxattr(deep + "/file", "user.deep", b"1")
    fs.rename(deep + "/file", deep + "/moved")
    assert fs.lstat(deep + "/moved").size == 12
    ws.close_active()  # the removal is the next step
    written = oracle.snapshot(ws.fs.host)
    assert deep + "/moved" in written
    fs.remove_tree("dir")  # rm -rf
    assert fs.listdir("") == []
    ws.close_active()
    ws.rollback(1)
    oracle.assert_same(written, oracle.snapshot(ws.fs.host), "undo of rm -rf of a tree deeper than PATH_MAX")
    undo_all(ws)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of building a tree deeper than PATH_MAX")


def test_beyond_tree_path_bytes_max_is_enametoolong(share):
    ws, fs = share
    fid, names = mkdir_p_relative(fs, "dir", TREE_PATH_BYTES_MAX - len("dir/") - 10)
    c = fs.c
    c.mkdir(fid, "x" * 5)  # dir/… is exactly 10 bytes short: "/" + 5 fits
    with pytest.raises(OSError) as info:
        c.mkdir(fid, "y" * 20)
    assert info.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as info:
        c.lcreate(fid, "z" * 20, m.DOTL_WRONLY | m.DOTL_CREATE, 0o644)
    assert info.value.errno == errno.ENAMETOOLONG
    c.clunk(fid)
    ws.close_active()
    undo_all(ws)
    assert ws.fs.host.listdir("dir") == ["keep"]
