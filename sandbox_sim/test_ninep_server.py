"""The 9P2000.L server over a real unix socket, driven by the test client.

Covers the protocol surface (attach, walk, create, write, read, rename, unlink, readdir
with many entries, xattrs, locks, flush, pipelined tags), containment (``..``, symlinks
pointing outside, special files, names that are not one component), limits (msize,
fids, open files), the three providers, reply holding for safeguards, and bad input
from the client. Every test checks observable results: bytes on the host, replies on
the wire, the undo history.
"""

from __future__ import annotations

import errno
import os
import stat

import pytest

from sandbox.limits import ServerLimits
from sandbox.mounts import Provider, memory_tree
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client
from sandbox.ninep import server as server_module
from sandbox.ninep.server import ServerConfig
from sandbox_sim import oracle
from sandbox.ninep.wirefs import WireFS, serve

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def work(tmp_path):
    w = tmp_path / "work"
    w.mkdir()
    (w / "hello.txt").write_bytes(b"hello world\n")
    (w / "sub").mkdir()
    (w / "sub" / "deep.txt").write_bytes(b"deep\n")
    return w


@pytest.fixture
def outside(tmp_path):
    o = tmp_path / "outside"
    o.mkdir()
    (o / "secret").write_bytes(b"do not touch\n")
    return o


@pytest.fixture
def served(ws):
    with serve(Provider.intercepted(ws)) as (st, path):
        yield st, path


@pytest.fixture
def client(served):
    with Client.connect_unix(served[1]) as c:
        yield c


def errno_of(fn, *args, **kwargs) -> int:
    with pytest.raises(OSError) as info:
        fn(*args, **kwargs)
    return info.value.errno


# --------------------------------------------------------------------------- basics


def test_version_negotiates_msize_and_attach_gives_root_qid(served, work):
    with Client.connect_unix(served[1], msize=64 * 1024) as c:
        assert c.msize == 64 * 1024
        fid, qid = c.attach()
        assert qid.type == m.QT_DIR and qid.path == os.stat(work).st_ino
    with Client.connect_unix(served[1], msize=64 << 20) as c:
        assert c.msize == ServerConfig().limits.msize_bytes_max  # clamped to the server's maximum


def test_reads_are_clamped_to_iounit(ws, work):
    (work / "big").write_bytes(os.urandom(300_000))
    with serve(Provider.intercepted(ws), ServerConfig(ServerLimits(msize_bytes_max=65536))) as (_st, path):
        with Client.connect_unix(path, msize=1 << 20) as c:
            c.attach()
            fid = c.walk_path("big")
            _qid, iounit = c.lopen(fid, m.DOTL_RDONLY)
            assert iounit == 65536 - 24
            assert len(c.read(fid, 0, 1 << 20)) == iounit
            assert c.read_all(fid) == (work / "big").read_bytes()


def test_frames_larger_than_one_read_and_many_in_one_read_arrive_whole(ws, work):
    """The server reads each connection into one kept buffer (``READ_BUFFER_BYTES``): a
    1 MiB Twrite spans four reads of it and lands whole; a hundred pipelined requests sent in
    one write are all answered; the buffer's reuse never mixes one read's bytes into another's."""
    data = os.urandom(server_module.READ_BUFFER_BYTES * 4 - 1000)
    with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path, msize=1 << 20) as c:
        root, _ = c.attach()
        fid, _ = c.walk(root, [])
        c.lcreate(fid, "big", m.DOTL_WRONLY | m.DOTL_CREATE, 0o644)
        assert c.write(fid, 0, data) == len(data)
        c.clunk(fid)
        tags = c.send_many(m.Tgetattr(root, m.GETATTR_ALL) for _ in range(100))
        assert all(type(c.wait(t)) is m.Rgetattr for t in tags)
        again = c.walk_path("big")
        c.lopen(again, m.DOTL_WRONLY)
        assert c.write(again, 0, b"second") == 6
    assert (work / "big").read_bytes() == b"second" + data[6:]


def test_write_read_rename_unlink_land_on_host_and_undo_exactly(ws, work, served):
    before = oracle.snapshot(ws.fs.host)
    with Client.connect_unix(served[1]) as c:
        fs = WireFS(c)
        fs.write_file("new.txt", b"fresh\n")
        fs.write("hello.txt", 6, b"there")
        fs.mkdir("dir", 0o750)
        fs.rename("sub/deep.txt", "dir/moved.txt")
        fs.unlink("hello.txt")
        fs.symlink("dir/moved.txt", "link")
        fs.chmod("new.txt", 0o600)
        fs.truncate("new.txt", 3)
        assert (work / "new.txt").read_bytes() == b"fre"
        assert (work / "dir" / "moved.txt").read_bytes() == b"deep\n"
        assert not (work / "hello.txt").exists()
        assert os.readlink(work / "link") == "dir/moved.txt"
        assert stat.S_IMODE(os.stat(work / "new.txt").st_mode) == 0o600
        assert fs.read_file("dir/moved.txt") == b"deep\n"
    ws.close_active()  # the ambient step would close after 5 s idle
    hist = ws.history()
    assert hist and hist[0]["type"] == "ambient" and hist[0]["id"] < 0
    ws.rollback(len(hist))
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of writes made over 9P")


def test_writes_join_the_step_the_tracker_says_is_current(ws, work, client):
    fs = WireFS(client)
    with ws.step("echo > a") as step:
        fs.write_file("a", b"in a command step")
    fs.write_file("b", b"ambient")
    ws.close_active()
    hist = ws.history()
    assert [h["type"] for h in hist] == ["ambient", "command"]
    assert hist[1]["id"] == step.id and "a" in hist[1]["paths"] and "b" not in hist[1]["paths"]
    assert "b" in hist[0]["paths"] and "a" not in hist[0]["paths"]


def test_walk_dotdot_never_leaves_the_root(client, work):
    root, rq = client.attach()
    _fid, qids = client.walk(root, [".."] * 16)
    assert [q.path for q in qids] == [rq.path] * 16
    _fid, qids = client.walk(root, ["sub", "..", "..", "sub", "deep.txt"])
    assert qids[-1].path == os.stat(work / "sub" / "deep.txt").st_ino


def test_partial_walk_returns_prefix_and_creates_no_fid(client):
    root, _ = client.attach()
    assert errno_of(client.walk, root, ["nope"]) == errno.ENOENT
    newfid = client.new_fid()
    tag = client.send(m.Twalk(root, newfid, ("sub", "nope", "x")))
    reply = client.wait(tag)
    assert isinstance(reply, m.Rwalk) and len(reply.qids) == 1
    assert errno_of(client.getattr, newfid) == errno.EBADF  # not created


def test_names_that_are_not_one_component_are_refused(client, work):
    root, _ = client.attach()
    for name in ("a/b", "", ".", "..", "x\0y"):
        assert errno_of(client.mkdir, root, name, 0o755) in (errno.EINVAL, errno.EEXIST)
    assert errno_of(client.walk, root, ["sub/deep.txt"]) == errno.EINVAL
    assert sorted(os.listdir(work)) == ["hello.txt", "sub"]


def test_errors_map_to_linux_errnos(client, work):
    fs = WireFS(client)
    assert errno_of(fs.lstat, "missing") == errno.ENOENT
    assert errno_of(fs.mkdir, "sub") == errno.EEXIST
    assert errno_of(fs.rmdir, "sub") == errno.ENOTEMPTY
    assert errno_of(fs.unlink, "sub") == errno.EISDIR
    assert errno_of(fs.lstat, "hello.txt/x") == errno.ENOTDIR
    assert errno_of(client.getattr, 12345) == errno.EBADF
    assert errno_of(fs.write_file, "sub", b"x") == errno.EISDIR


# --------------------------------------------------------------------------- directories


def test_readdir_many_entries_packs_to_count_and_misses_nothing(client, work):
    names = {f"file-{i:05d}-{'x' * (i % 40)}" for i in range(2500)}
    d = work / "many"
    d.mkdir()
    for n in names:
        (d / n).touch()
    root, _ = client.attach()
    fid, _ = client.walk(root, ["many"])
    client.lopen(fid, m.DOTL_RDONLY)
    seen, offset, count = [], 0, 500
    while True:
        tag = client.send(m.Treaddir(fid, offset, count))
        reply = client.wait(tag)
        assert len(reply.data) <= count
        entries = m.unpack_dirents(reply.data)
        if not entries:
            break
        seen += entries
        offset = entries[-1].offset
    got = [e.name for e in seen]
    assert got[:2] == [".", ".."]
    assert sorted(got[2:]) == sorted(names) and len(got) == len(names) + 2
    assert all(e.type == m.DT_REG for e in seen[2:]) and seen[0].type == m.DT_DIR


def test_an_open_directory_lists_the_directory_it_opened_wherever_it_moved(client, work):
    """A fid open on a directory lists that directory — through the descriptor its Tlopen
    took, as a local ``opendir`` does — even after the host moved it and put another
    directory at its path: its own entries, with their own inodes and types."""
    d = work / "d"
    d.mkdir()
    (d / "mine").write_bytes(b"1")
    (d / "sub").mkdir()
    root, _ = client.attach()
    fid, _ = client.walk(root, ["d"])
    client.lopen(fid, m.DOTL_RDONLY)
    os.rename(d, work / "moved")
    (work / "d").mkdir()
    (work / "d" / "theirs").write_bytes(b"2")
    entries = {e.name: e for e in client.readdir_all(fid)}
    assert set(entries) == {".", "..", "mine", "sub"}
    assert entries["."].qid.path == os.stat(work / "moved").st_ino
    assert entries["mine"].qid.path == os.stat(work / "moved" / "mine").st_ino
    assert (entries["mine"].type, entries["sub"].type) == (m.DT_REG, m.DT_DIR)


def test_readdir_reports_emulated_devices_through_the_open_directory(ws, work):
    """An emulated device (a guest's mknod: a placeholder file with the device xattr) is
    listed with its device type, also when the listing's entries are looked up through the
    directory's descriptor."""
    with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path) as c:
        root, _ = c.attach()
        c.rpc(m.Tmknod(root, "tty", stat.S_IFCHR | 0o600, 5, 0, 0))
        c.rpc(m.Tmknod(root, "blk", stat.S_IFBLK | 0o600, 8, 1, 0))
        fid, _ = c.walk(root, [])
        c.lopen(fid, m.DOTL_RDONLY)
        types = {e.name: e.type for e in c.readdir_all(fid)}
    assert (types["tty"], types["blk"], types["hello.txt"]) == (m.DT_CHR, m.DT_BLK, m.DT_REG)


def test_readdir_reports_types_and_special_files(client, work):
    os.mkfifo(work / "fifo")
    os.symlink("hello.txt", work / "ln")
    root, _ = client.attach()
    fid, _ = client.walk(root, [])
    client.lopen(fid, m.DOTL_RDONLY)
    types = {e.name: e.type for e in client.readdir_all(fid)}
    assert types["fifo"] == m.DT_FIFO and types["ln"] == m.DT_LNK and types["sub"] == m.DT_DIR


# --------------------------------------------------------------------------- containment


def test_symlinks_are_never_followed_on_the_host(client, work, outside):
    os.symlink(str(outside), work / "out")
    os.symlink("../outside/secret", work / "rel")
    before = oracle.snapshot_dir(str(outside))
    root, _ = client.attach()
    fid, qids = client.walk(root, ["out"])
    assert qids[0].type == m.QT_SYMLINK
    assert client.readlink(fid) == str(outside)
    assert errno_of(client.lopen, fid, m.DOTL_RDONLY) == errno.ELOOP
    assert errno_of(client.lcreate, fid, "planted", m.DOTL_WRONLY, 0o644) == errno.ENOTDIR
    assert errno_of(client.mkdir, fid, "planted", 0o755) == errno.ENOTDIR
    tag = client.send(m.Twalk(root, client.new_fid(), ("out", "secret")))
    assert len(client.wait(tag).qids) == 1  # stops at the symlink
    rel, _ = client.walk(root, ["rel"])
    assert errno_of(client.lopen, rel, m.DOTL_RDWR | m.DOTL_TRUNC) == errno.ELOOP
    assert errno_of(client.setattr, rel, m.SETATTR_SIZE, size=0) in (errno.ELOOP, errno.EINVAL)
    assert errno_of(client.setattr, rel, m.SETATTR_MODE, mode=0o777) == errno.EOPNOTSUPP
    fs = WireFS(client)
    assert errno_of(fs.rename, "hello.txt", "out/stolen") in (errno.ELOOP, errno.ENOTDIR)
    assert errno_of(fs.link, "hello.txt", "out/linked") in (errno.ELOOP, errno.ENOTDIR)
    assert errno_of(fs.setxattr, "out", "user.x", b"1") == errno.EPERM
    oracle.assert_same(before, oracle.snapshot_dir(str(outside)), "outside the root")


def test_special_files_are_never_opened_and_devices_never_created(client, work):
    os.mkfifo(work / "fifo")  # opening it for reading would block forever
    root, _ = client.attach()
    fid, qids = client.walk(root, ["fifo"])
    assert stat.S_ISFIFO(client.getattr(fid).mode)
    assert errno_of(client.lopen, fid, m.DOTL_RDONLY) == errno.EPERM
    client.mknod(root, "dev", stat.S_IFCHR | 0o600, 1, 3)  # emulated (test_special_files.py)
    client.mknod(root, "pipe", stat.S_IFIFO | 0o600, 0, 0)
    assert sorted(os.listdir(work)) == ["dev", "fifo", "hello.txt", "pipe", "sub"]
    assert stat.S_ISREG(os.lstat(work / "dev").st_mode) and stat.S_ISFIFO(os.lstat(work / "pipe").st_mode)


# --------------------------------------------------------------------------- open files and fids


def test_open_then_unlink_keeps_the_file_usable(client, work):
    root, _ = client.attach()
    fid, _ = client.walk(root, [])
    client.lcreate(fid, "tmp", m.DOTL_RDWR | m.DOTL_CREATE, 0o600)
    client.write(fid, 0, b"before")
    client.unlinkat(root, "tmp", 0)
    assert not (work / "tmp").exists()
    client.write(fid, 6, b" after")
    assert client.read(fid, 0, 100) == b"before after"
    assert client.getattr(fid).size == 12


def test_an_open_unlinked_file_keeps_the_mode_the_guest_gave_it(client, work):
    """Tgetattr of an open fid reads the kept mode through the fid's own handle: after the
    unlink (no path names the file) it still shows the set-uid bit the host never got."""
    root, _ = client.attach()
    fid, _ = client.walk(root, [])
    client.lcreate(fid, "suid", m.DOTL_RDWR | m.DOTL_CREATE, 0o4750)
    assert not os.stat(work / "suid").st_mode & stat.S_ISUID  # kept in the mapping, not on the host
    assert stat.S_IMODE(client.getattr(fid).mode) == 0o4750
    client.unlinkat(root, "suid", 0)
    assert stat.S_IMODE(client.getattr(fid).mode) == 0o4750


def test_rename_moves_every_fid_below_it(client, work):
    root, _ = client.attach()
    deep, _ = client.walk(root, ["sub", "deep.txt"])
    hello, _ = client.walk(root, ["hello.txt"])
    client.renameat(root, "sub", root, "moved")
    assert client.getattr(deep).size == 5  # the fid followed its file
    client.setattr(deep, m.SETATTR_MODE, mode=0o640)
    assert stat.S_IMODE(os.stat(work / "moved" / "deep.txt").st_mode) == 0o640
    client.renameat(root, "hello.txt", root, "renamed.txt")  # a file rename moves its fids too
    client.setattr(hello, m.SETATTR_MODE, mode=0o604)
    assert stat.S_IMODE(os.stat(work / "renamed.txt").st_mode) == 0o604


def test_fid_and_open_file_limits(ws, work):
    (work / "f").write_bytes(b"x")
    with serve(Provider.intercepted(ws), ServerConfig(ServerLimits(fids_per_connection_max=4, open_files_per_connection_max=2))) as (_st, path):
        with Client.connect_unix(path) as c:
            root, _ = c.attach()
            a, _ = c.walk(root, ["f"])
            b, _ = c.walk(root, ["f"])
            c.lopen(a, m.DOTL_RDONLY)
            c.lopen(b, m.DOTL_RDONLY)
            x, _ = c.walk(root, ["f"])
            assert errno_of(c.lopen, x, m.DOTL_RDONLY) == errno.EMFILE
            assert errno_of(c.walk, root, ["f"]) == errno.ENFILE
            c.clunk(a)
            c.lopen(x, m.DOTL_RDONLY)  # a handle freed by clunk is reusable
            assert c.read(x, 0, 10) == b"x"


def test_pipelined_requests_all_answered(client, work):
    fs = WireFS(client)
    fs.write_file("p", b"")
    root, _ = client.attach()
    fid, _ = client.walk(root, ["p"])
    client.lopen(fid, m.DOTL_RDWR)
    tags = [client.send(m.Twrite(fid, i * 4, b"%04d" % i)) for i in range(200)]
    tags += [client.send(m.Tgetattr(fid, m.GETATTR_ALL)) for _ in range(50)]
    replies = {t: client.wait(t) for t in reversed(tags)}
    assert all(isinstance(replies[t], m.Rwrite) for t in tags[:200])
    assert (work / "p").read_bytes() == b"".join(b"%04d" % i for i in range(200))


def test_flush_of_an_answered_or_unknown_tag_is_answered(client):
    client.attach()
    client.flush(4321)  # nothing in flight with that tag: Rflush at once


def test_xattrs_round_trip(client, work):
    fs = WireFS(client)
    fs.setxattr("hello.txt", "user.color", b"blue")
    fs.setxattr("hello.txt", "user.empty-is-remove", b"v")
    assert os.getxattr(work / "hello.txt", "user.color") == b"blue"
    assert fs.xattrs("hello.txt") == {"user.color": b"blue", "user.empty-is-remove": b"v"}
    fs.removexattr("hello.txt", "user.empty-is-remove")
    assert os.listxattr(work / "hello.txt") == ["user.color"]
    root, _ = client.attach()
    fid, _ = client.walk(root, ["hello.txt"])
    assert errno_of(client.xattrwalk, fid, "user.missing") == errno.ENODATA
    assert errno_of(client.setxattr, fid, "user.color", b"x", m.XATTR_CREATE) == errno.EEXIST
    assert errno_of(client.setxattr, fid, "user.nope", b"x", m.XATTR_REPLACE) == errno.ENODATA


def test_posix_locks_between_connections(served, work):
    with Client.connect_unix(served[1]) as a, Client.connect_unix(served[1]) as b:
        fa, _ = a.walk(a.attach()[0], ["hello.txt"])
        fb, _ = b.walk(b.attach()[0], ["hello.txt"])
        a.lopen(fa, m.DOTL_RDWR)
        b.lopen(fb, m.DOTL_RDWR)
        assert a.lock(fa, m.LOCK_TYPE_WRLCK, 0, 0, 10, 1, "a") == m.LOCK_SUCCESS
        assert b.lock(fb, m.LOCK_TYPE_RDLCK, 0, 5, 1, 2, "b") == m.LOCK_BLOCKED
        assert b.lock(fb, m.LOCK_TYPE_WRLCK, 0, 10, 0, 2, "b") == m.LOCK_SUCCESS  # disjoint
        g = b.getlock(fb, m.LOCK_TYPE_WRLCK, 0, 0, 2, "b")
        assert (g.type, g.start, g.length, g.proc_id, g.client_id) == (m.LOCK_TYPE_WRLCK, 0, 10, 1, "a")
        assert a.lock(fa, m.LOCK_TYPE_UNLCK, 0, 0, 0, 1, "a") == m.LOCK_SUCCESS
        assert b.lock(fb, m.LOCK_TYPE_RDLCK, 0, 5, 1, 2, "b") == m.LOCK_SUCCESS
    with Client.connect_unix(served[1]) as c:  # a closed connection's locks are gone
        fc, _ = c.walk(c.attach()[0], ["hello.txt"])
        assert c.lock(fc, m.LOCK_TYPE_WRLCK, 0, 0, 0, 3, "c") == m.LOCK_SUCCESS


# --------------------------------------------------------------------------- providers


def test_read_only_export_refuses_every_mutation(work):
    before = oracle.snapshot_dir(str(work))
    with serve(Provider.read_only_dir(str(work))) as (_st, path):
        with Client.connect_unix(path) as c:
            fs = WireFS(c)
            assert fs.read_file("sub/deep.txt") == b"deep\n"
            assert sorted(fs.listdir("")) == ["hello.txt", "sub"]
            for call in (lambda: fs.write_file("hello.txt", b"x"), lambda: fs.create("n"), lambda: fs.mkdir("d"),
                         lambda: fs.unlink("hello.txt"), lambda: fs.rmdir("sub"), lambda: fs.rename("hello.txt", "x"),
                         lambda: fs.symlink("t", "l"), lambda: fs.link("hello.txt", "h"), lambda: fs.chmod("hello.txt", 0o600),
                         lambda: fs.truncate("hello.txt", 0), lambda: fs.utime("hello.txt", 5),
                         lambda: fs.setxattr("hello.txt", "user.a", b"1"), lambda: fs.write("hello.txt", 0, b"x")):
                assert errno_of(call) == errno.EROFS
            root, _ = c.attach()
            assert errno_of(c.mknod, root, "dev", stat.S_IFIFO | 0o600, 0, 0) == errno.EROFS
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "read-only export")


def test_memory_tree_is_served_read_only_with_intermediate_dirs():
    tree = memory_tree({"tools/hello.sh": b"#!/bin/sh\necho hi\n", "lib/pkg/__init__.py": "x = 1\n", "top": b""})
    with serve(tree) as (_st, path):
        with Client.connect_unix(path) as c:
            fs = WireFS(c)
            assert sorted(fs.listdir("")) == ["lib", "tools", "top"]
            assert fs.read_file("lib/pkg/__init__.py") == b"x = 1\n"
            assert fs.lstat("lib/pkg").kind == "dir"
            assert errno_of(fs.write_file, "top", b"x") == errno.EROFS
            assert errno_of(fs.mkdir, "new") == errno.EROFS


def test_writable_memory_tree_changes_only_memory(tmp_path):
    tree = memory_tree({"a.txt": b"one"}, writable=True)
    with serve(tree) as (_st, path):
        with Client.connect_unix(path) as c:
            fs = WireFS(c)
            fs.write_file("a.txt", b"two")
            fs.makedirs("x/y")
            fs.write_file("x/y/z", b"zz")
            assert fs.read_file("a.txt") == b"two" and fs.read_file("x/y/z") == b"zz"
    assert tree.host.read_all("x/y/z") == b"zz"
    assert tree.interceptor is None  # never undo-tracked


@pytest.mark.parametrize("files", [{"../escape": b""}, {"/abs": b""}, {"a": b"", "a/b": b""}, {"": b"x"}])
def test_memory_tree_rejects_bad_paths(files):
    with pytest.raises(ValueError):
        memory_tree(files)


def test_exports_are_selected_by_attach_name(ws, work):
    tools = memory_tree({"t": b"tool"})
    with serve({"work": Provider.intercepted(ws), "tools": tools}) as (_st, path):
        with Client.connect_unix(path) as c:
            _fid, q = c.attach(aname="tools")
            fid = c.walk_path("t")
            c.lopen(fid, m.DOTL_RDONLY)
            assert c.read(fid, 0, 10) == b"tool"
            assert errno_of(c.attach, aname="nope") == errno.ENOENT
            _fid, q = c.attach(aname="/work")
            assert q.path == os.stat(work).st_ino


# --------------------------------------------------------------------------- more of the surface


def test_tcp_listener_on_loopback(ws, work):
    from sandbox.ninep.server import NinePServer, ServerThread

    with ServerThread(NinePServer(Provider.intercepted(ws)), tcp=True) as st:
        with Client.connect_tcp("127.0.0.1", st.port) as c:
            assert WireFS(c).read_file("hello.txt") == b"hello world\n"


def test_session_rules(client, served):
    raw = Client.connect_unix(served[1])  # version done by the client; now misuse the session
    root, _ = raw.attach()
    assert errno_of(raw.rpc, m.Tauth(raw.new_fid(), "u", "", 0)) == errno.EOPNOTSUPP
    fid, _ = raw.walk(root, ["hello.txt"])
    raw.lopen(fid, m.DOTL_RDONLY)
    assert errno_of(raw.lopen, fid, m.DOTL_RDONLY) == errno.EBADF  # already open
    assert errno_of(raw.write, fid, 0, b"x") == errno.EBADF  # read-only handle
    d, _ = raw.walk(root, ["sub"])
    assert errno_of(raw.lopen, d, m.DOTL_RDWR) == errno.EISDIR
    assert errno_of(raw.readdir, d, 0, 100) == errno.EBADF  # not opened
    assert errno_of(raw.readdir, fid, 0, 100) == errno.ENOTDIR
    raw.lopen(d, m.DOTL_RDONLY)
    assert errno_of(raw.readdir, d, 0, 10) == errno.EINVAL  # not even one entry fits
    assert errno_of(raw.walk, root, ["x"], newfid=fid) == errno.EEXIST  # newfid in use
    reply = raw.rpc(m.Tversion(8192, "9P2000.u"))
    assert reply.version == "unknown"
    raw.close()


def test_remove_and_fid_rename(client, work):
    root, _ = client.attach()
    f, _ = client.walk(root, ["hello.txt"])
    client.remove(f)
    assert not (work / "hello.txt").exists()
    assert errno_of(client.getattr, f) == errno.EBADF  # Tremove clunks
    gone, _ = client.walk(root, ["sub"])
    assert errno_of(client.remove, gone) == errno.ENOTEMPTY
    assert errno_of(client.getattr, gone) == errno.EBADF  # clunked even though it failed
    deep, _ = client.walk(root, ["sub", "deep.txt"])
    client.rename(deep, root, "top.txt")  # the fid-based Trename
    assert (work / "top.txt").read_bytes() == b"deep\n"
    assert client.getattr(deep).size == 5


def test_setattr_times_and_xattr_value_size(client, work):
    root, _ = client.attach()
    f, _ = client.walk(root, ["hello.txt"])
    client.setattr(f, m.SETATTR_MTIME | m.SETATTR_MTIME_SET | m.SETATTR_ATIME | m.SETATTR_ATIME_SET,
                   atime=(1_000_000_000, 5), mtime=(1_200_000_000, 7))
    st = os.stat(work / "hello.txt")
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000 * 10**9 + 5, 1_200_000_000 * 10**9 + 7)
    client.setattr(f, m.SETATTR_ATIME)  # atime "now" alone keeps the mtime
    assert os.stat(work / "hello.txt").st_mtime_ns == st.st_mtime_ns
    assert errno_of(client.setattr, f, m.SETATTR_MTIME | m.SETATTR_MTIME_SET, mtime=(1, 10**9)) == errno.EINVAL
    x, _ = client.walk(root, ["hello.txt"])
    client.xattrcreate(x, "user.short", 10, 0)
    client.write(x, 0, b"abc")  # fewer bytes than declared: the commit at clunk fails
    assert errno_of(client.clunk, x) == errno.EINVAL
    assert "user.short" not in os.listxattr(work / "hello.txt")
    y, _ = client.walk(root, ["hello.txt"])
    client.xattrcreate(y, "user.big", 2, 0)
    assert errno_of(client.write, y, 0, b"abc") == errno.EINVAL  # past the declared size
    assert errno_of(client.clunk, y) == errno.EINVAL  # 0 of 2 bytes: nothing committed
