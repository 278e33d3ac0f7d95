"""A real Linux v9fs session, recorded on the wire, decoded and replayed against the server.

``fixtures/ninep/linux-6.1-v9fs-session.cap`` holds every byte a Linux 6.1 kernel client
(``mount -t 9p -o trans=tcp,version=9p2000.L,cache=none,msize=524288``) and our server
exchanged while the guest ran ``linux-6.1-v9fs-session.sh`` on an export holding only
``hello.txt`` (see ``fixtures/ninep/README.md``). Two checks:

1. **Codec against a real kernel.** Every T frame decodes to a T-message, every R frame to
   an R-message, and re-encoding each gives the identical bytes.
2. **Replay.** The recorded T frames are sent, one at a time and in recorded order, to a
   fresh server on a fresh copy of the initial export; each reply must match the recorded
   reply in everything that does not depend on the host's inode numbers, clocks or
   filesystem (see :func:`comparable`). The folder then holds exactly the script's end
   state, and undoing the whole history restores the initial tree exactly.
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
import stat
import struct
from dataclasses import dataclass, fields
from functools import cache

import pytest

from sandbox.core.workspace import Workspace
from sandbox.hostfs import DIR, LNK, REG
from sandbox.mounts import Provider
from sandbox.ninep import messages as m
from sandbox.ninep.codec import FrameSplitter, decode, encode
from sandbox_sim import oracle
from sandbox.ninep.wirefs import serve

pytestmark = pytest.mark.timeout(60)

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "ninep")
SESSION, OPS = "linux-6.1-v9fs-session", "linux-6.1-v9fs-ops"
MSIZE = 524288  # what the session negotiated
SPLIT_MSIZE = 1 << 20  # FrameSplitter bound: more than any frame of the session

HELLO = b"hello from host\n"

# The T-message types the recorded session contains (all of them: see the README).
T_TYPES_SEEN = {
    m.Tversion, m.Tattach, m.Twalk, m.Tgetattr, m.Tlopen, m.Treaddir, m.Tread, m.Tlcreate,
    m.Twrite, m.Tclunk, m.Tmkdir, m.Trenameat, m.Tsymlink, m.Tunlinkat, m.Treadlink,
}  # fmt: skip
R_TYPES_SEEN = {
    m.Rversion, m.Rattach, m.Rwalk, m.Rgetattr, m.Rlopen, m.Rreaddir, m.Rread, m.Rlcreate,
    m.Rwrite, m.Rclunk, m.Rmkdir, m.Rrenameat, m.Rsymlink, m.Runlinkat, m.Rreadlink, m.Rlerror,
}  # fmt: skip
# linux-6.1-v9fs-ops.sh (made with fixtures/ninep/capture.py): metadata, links, fsync, statfs,
# special files (fifo, unix socket, emulated char and block devices), recursive removal; its
# end state is in linux-6.1-v9fs-ops.end.json.
T_TYPES_SEEN_OPS = {
    m.Tsetattr, m.Tstatfs, m.Tlink, m.Tfsync, m.Tmknod, m.Txattrwalk, m.Tunlinkat, m.Trenameat,
    m.Tlcreate, m.Twrite, m.Tmkdir,
}  # fmt: skip
R_TYPES_SEEN_OPS = {m.Rlerror, m.Rsetattr, m.Rlink, m.Rmknod}
TYPES_SEEN = {SESSION: (T_TYPES_SEEN, R_TYPES_SEEN), OPS: (T_TYPES_SEEN_OPS, R_TYPES_SEEN_OPS)}
# The special files the ops script makes, by name: (S_IFMT type, (major, minor)).
OPS_SPECIALS = {
    "pipe": (stat.S_IFIFO, (0, 0)), "sock": (stat.S_IFSOCK, (0, 0)),
    "null": (stat.S_IFCHR, (1, 3)), "disk": (stat.S_IFBLK, (8, 0)),
}  # fmt: skip


# --------------------------------------------------------------------------- the capture


@dataclass(frozen=True)
class Exchange:
    """One recorded request and the recorded reply to it."""

    index: int  # position of the request in the T stream
    tag: int
    t_frame: bytes
    t_msg: m.Message
    r_frame: bytes
    r_msg: m.Message


def read_records(path: str) -> list[tuple[bytes, bytes]]:
    """``[(b"T" | b"R", chunk)]``: direction[1] + u32 LE length + bytes, repeated."""
    with open(path, "rb") as f:
        data = f.read()
    out, pos = [], 0
    while pos < len(data):
        assert pos + 5 <= len(data), f"truncated record header at byte {pos}"
        direction = data[pos : pos + 1]
        (n,) = struct.unpack_from("<I", data, pos + 1)
        assert direction in (b"T", b"R"), f"bad direction {direction!r} at byte {pos}"
        assert pos + 5 + n <= len(data), f"record at byte {pos} overruns the file"
        out.append((direction, data[pos + 5 : pos + 5 + n]))
        pos += 5 + n
    return out


@cache
def exchanges(name: str = SESSION) -> tuple[Exchange, ...]:
    """Frames of both directions, each reply paired with its request.

    The records keep the order in which the proxy read the chunks, so a reply is matched
    with the request carrying its tag that is outstanding at that point of the stream (a
    tag is free for reuse once its reply has been seen).
    """
    splitters = {b"T": FrameSplitter(SPLIT_MSIZE), b"R": FrameSplitter(SPLIT_MSIZE)}
    requests: list[tuple[int, bytes, m.Message]] = []
    outstanding: dict[int, int] = {}  # tag -> index in requests
    replies: dict[int, tuple[bytes, m.Message]] = {}
    for direction, chunk in read_records(os.path.join(FIXTURES, f"{name}.cap")):
        for frame in splitters[direction].feed(chunk):
            tag, msg = decode(frame)
            if direction == b"T":
                assert tag not in outstanding, f"tag {tag} reused while in flight: {msg!r}"
                outstanding[tag] = len(requests)
                requests.append((tag, frame, msg))
            else:
                assert tag in outstanding, f"reply {msg!r} to tag {tag}, which has no request in flight"
                replies[outstanding.pop(tag)] = (frame, msg)
    for direction, sp in splitters.items():
        assert sp.buffered == 0, f"{direction!r} stream ends inside a frame ({sp.buffered} bytes)"
    assert not outstanding, f"requests never answered: {[requests[i][2] for i in outstanding.values()]}"
    return tuple(Exchange(i, tag, tf, tm, *replies[i]) for i, (tag, tf, tm) in enumerate(requests))


@pytest.mark.parametrize("name", [SESSION, OPS])
def test_capture_decodes_and_reencodes_byte_exact(name):
    ex = exchanges(name)
    assert len(ex) > 100
    for e in ex:
        assert type(e.t_msg).__name__[0] == "T", f"T stream frame {e.index} decodes to {e.t_msg!r}"
        assert type(e.r_msg).__name__[0] == "R", f"R stream frame {e.index} decodes to {e.r_msg!r}"
        assert encode(e.tag, e.t_msg) == e.t_frame, f"re-encoding {e.t_msg!r} changed its bytes"
        assert encode(e.tag, e.r_msg) == e.r_frame, f"re-encoding {e.r_msg!r} changed its bytes"
        if isinstance(e.r_msg, m.Rreaddir):  # the payload too: the kernel parses it
            dirents = m.unpack_dirents(e.r_msg.data)
            assert m.pack_dirents(dirents, len(e.r_msg.data)) == (e.r_msg.data, len(dirents))
    first = ex[0]
    assert first.t_msg == m.Tversion(msize=MSIZE, version="9P2000.L") and first.tag == m.NOTAG
    assert first.r_msg == m.Rversion(msize=MSIZE, version="9P2000.L")
    t_seen, r_seen = TYPES_SEEN[name]
    assert {type(e.t_msg) for e in ex} >= t_seen
    assert {type(e.r_msg) for e in ex} >= r_seen


def test_ops_capture_makes_every_kind_of_special_file():
    """The real kernel's mkfifo, socket bind and mknod of a char and a block device each
    reach the server as a ``Tmknod`` and were answered ``Rmknod`` with a qid (the recording
    server made them; nothing refused)."""
    made = {}
    for e in exchanges(OPS):
        if isinstance(e.t_msg, m.Tmknod):
            assert isinstance(e.r_msg, m.Rmknod), f"{e.t_msg!r} answered {e.r_msg!r}"
            made[e.t_msg.name] = (stat.S_IFMT(e.t_msg.mode), (e.t_msg.major, e.t_msg.minor))
    assert made == OPS_SPECIALS
    reported = {}  # what the server's Tgetattr said of each, by the walk that named it
    fid_names = {}
    for e in exchanges(OPS):
        if isinstance(e.t_msg, m.Twalk) and isinstance(e.r_msg, m.Rwalk) and len(e.t_msg.wnames) == 1:
            fid_names[e.t_msg.newfid] = e.t_msg.wnames[0]
        elif isinstance(e.t_msg, m.Tgetattr) and isinstance(e.r_msg, m.Rgetattr):
            name = fid_names.get(e.t_msg.fid)
            if name in OPS_SPECIALS:
                reported[name] = (stat.S_IFMT(e.r_msg.mode), (os.major(e.r_msg.rdev), os.minor(e.r_msg.rdev)))
    assert reported == OPS_SPECIALS


# --------------------------------------------------------------------------- replay


def _qid_type(v):
    return ("qid-type", v.type) if isinstance(v, m.Qid) else v


def comparable(r: m.Message) -> tuple:
    """What a replayed reply must share with the recorded one.

    Excluded everywhere: qid paths and versions (inode numbers and mtimes of another
    host). Per type:

    * Rgetattr: ``valid``, ``mode``, ``size``, ``nlink``, ``rdev`` and the qid type. Not
      times, inode/qid path, blocks, blksize, gen, data_version (host numbers), nor
      uid/gid (the recording's server ran as root; the test may not).
      Directory ``size``/``nlink`` are also the host filesystem's numbers; they are
      checked separately (see :func:`test_replay_matches_recorded_replies`).
    * Rreaddir: each entry's name, type and offset (offsets are the server's cookies).
    * Rstatfs: nothing but its type (numbers of another filesystem).
    * everything else: every field, qids reduced to their type (Rlerror ecode, Rread
      data, Rwrite count, Rwalk qid count and types, Rlopen/Rlcreate iounit and qid type,
      Rreadlink target, Rversion msize and version ...).
    """
    if isinstance(r, m.Rgetattr):
        return (m.Rgetattr, r.valid, r.qid.type, r.mode, r.rdev)
    if isinstance(r, m.Rreaddir):
        return (m.Rreaddir, tuple((d.name, d.type, d.offset) for d in m.unpack_dirents(r.data)))
    if isinstance(r, m.Rstatfs):
        return (m.Rstatfs,)
    if isinstance(r, m.Rwalk):
        return (m.Rwalk, tuple(q.type for q in r.qids))
    return (type(r), *(_qid_type(getattr(r, f.name)) for f in fields(r)))


class FidPaths:
    """Which path each fid of the replayed session stands for (to lstat it on the host)."""

    def __init__(self):
        self.paths: dict[int, str] = {}

    def update(self, t: m.Message, r: m.Message) -> None:
        if isinstance(r, m.Rlerror):
            return
        if isinstance(t, m.Tattach):
            self.paths[t.fid] = ""
        elif isinstance(t, m.Twalk) and len(r.qids) == len(t.wnames):  # a partial walk makes no fid
            p = self.paths[t.fid]
            for name in t.wnames:
                p = posixpath.dirname(p) if name == ".." else p if name == "." else posixpath.join(p, name)
            self.paths[t.newfid] = p
        elif isinstance(t, m.Tlcreate):
            self.paths[t.fid] = posixpath.join(self.paths[t.fid], t.name)
        elif isinstance(t, m.Trenameat):
            old = posixpath.join(self.paths[t.olddirfid], t.oldname)
            new = posixpath.join(self.paths[t.newdirfid], t.newname)
            for fid, p in self.paths.items():  # fids follow the renamed file
                if p == old or p.startswith(old + "/"):
                    self.paths[fid] = new + p[len(old) :]
        elif isinstance(t, (m.Tclunk, m.Tremove)):
            self.paths.pop(t.fid, None)


def _dirs_sized_like_ext4(tmp_path) -> bool:
    """Does the test's filesystem give directories the size and link count the recording
    host (ext4) did? A directory holding one subdirectory: size 4096, 3 links."""
    probe = tmp_path / "probe"
    (probe / "sub").mkdir(parents=True)
    st = os.lstat(probe)
    (probe / "sub").rmdir()
    probe.rmdir()
    return st.st_size == 4096 and st.st_nlink == 3


class Replayer:
    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.splitter = FrameSplitter(SPLIT_MSIZE)
        self.ready: list[bytes] = []

    def roundtrip(self, frame: bytes) -> tuple[int, m.Message, bytes]:
        self.sock.sendall(frame)
        while not self.ready:
            data = self.sock.recv(1 << 20)
            assert data, "the server closed the connection"
            self.ready += self.splitter.feed(data)
        reply = self.ready.pop(0)
        tag, msg = decode(reply)
        return tag, msg, reply

    def close(self):
        self.sock.close()


@pytest.fixture
def work(tmp_path):
    w = tmp_path / "work"
    w.mkdir()
    (w / "hello.txt").write_bytes(HELLO)
    os.chmod(w / "hello.txt", 0o644)
    return w


@pytest.mark.parametrize("name", [SESSION, OPS])
def test_replay_matches_recorded_replies(tmp_path, work, name):
    ex = exchanges(name)
    like_ext4 = _dirs_sized_like_ext4(tmp_path)
    before = oracle.snapshot_dir(str(work))
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"))
    try:
        with serve(Provider.intercepted(ws)) as (_st, path):
            r = Replayer(path)
            fids = FidPaths()
            try:
                # The session was strictly sequential (one request in flight at a time), so
                # waiting for each reply before the next request is what the kernel did.
                for e in ex:
                    tag, got, _frame = r.roundtrip(e.t_frame)
                    where = f"request #{e.index} {e.t_msg!r}: recorded {e.r_msg!r}, replayed {got!r}"
                    assert tag == e.tag, where
                    assert comparable(got) == comparable(e.r_msg), (
                        f"{where}\n  recorded {comparable(e.r_msg)}\n  replayed {comparable(got)}")
                    if isinstance(got, m.Rgetattr):
                        host = os.lstat(work / fids.paths[e.t_msg.fid])  # work / "" is work
                        assert (got.size, got.nlink) == (host.st_size, host.st_nlink), where
                        # Regular files and symlinks: size and nlink are the file's own,
                        # whatever the host. Directories: the host filesystem's numbers,
                        # so they match the recording only on an ext4-like host.
                        if not stat.S_ISDIR(got.mode) or like_ext4:
                            assert (got.size, got.nlink) == (e.r_msg.size, e.r_msg.nlink), where
                    fids.update(e.t_msg, got)
            finally:
                r.close()
        assert fids.paths == {}, "the session clunked every fid"

        if name != SESSION:  # the end state the capture recorded
            with open(os.path.join(FIXTURES, f"{name}.end.json")) as f:
                assert oracle.content_shape(str(work)) == json.load(f)
        # The session's end state: hello.txt removed, new.txt moved into d/, d/e/f, link.
        after = oracle.snapshot_dir(str(work))
        shape = {p: (kind, mode, content, xattrs) for p, (kind, mode, _mtime, content, xattrs, *_) in after.items()}
        assert name != SESSION or shape == {
            "": (DIR, before[""][1], None, ()),
            "d": (DIR, 0o755, None, ()),
            "d/e": (DIR, 0o755, None, ()),
            "d/e/f": (REG, 0o644, b"data\n", ()),
            "d/moved.txt": (REG, 0o644, b"from guest\n", ()),
            "link": (LNK, after["link"][1], "d/moved.txt", ()),
        }
        assert name != SESSION or os.readlink(work / "link") == "d/moved.txt"

        ws.close_active()  # the ambient step would close after 5 s idle
        hist = ws.history()
        assert hist, "the replayed writes are in the undo history"
        ws.rollback(len(hist))
        oracle.assert_same(before, oracle.snapshot_dir(str(work)), "undo of the replayed kernel session")
    finally:
        ws.close()
