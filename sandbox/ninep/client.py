"""A small synchronous 9P2000.L client over a blocking socket, built on the codec.

For tests, benchmarks and poking at a server by hand -- not for mounting (the kernel's
v9fs is the real client). It speaks exactly what :mod:`.codec` encodes and checks every
reply with :func:`~.codec.decode`, so a malformed reply surfaces as ProtocolError.

Invariants and limits:

* **Nothing waits forever.** Every socket operation has a timeout (``timeout_s``,
  default 30 s); on expiry ``TimeoutError`` (``socket.timeout``) propagates.
* **Tags are never reused while outstanding** (at most :data:`TAGS_MAX` in flight;
  NOTAG is only used by Tversion). Replies that arrive for another tag while
  :meth:`Client.rpc` waits are held (at most ``TAGS_MAX``, one per outstanding tag) and
  handed out by :meth:`Client.wait` or :meth:`Client.recv`, in arrival order.
* **Fids are never reused while live.** :meth:`Client.new_fid` skips live fids; clunk
  and remove release a fid whatever the server answers (as the kernel does: a fid is
  gone after Tclunk even if Rlerror came back); a failed walk releases its new fid.
* ``Rlerror`` becomes :class:`NinePError` (an ``OSError`` with ``errno`` = ecode) in
  :meth:`rpc`/:meth:`wait` and every convenience method; :meth:`recv` returns it raw.

Not thread-safe: one thread drives one Client.
"""

from __future__ import annotations

import errno as _errno
import os
import socket
from collections import deque
from collections.abc import Iterable
from typing import Self

from . import messages as m
from .codec import FrameSplitter, ProtocolError, decode, encode
from .messages import GETATTR_ALL, IOHDRSZ, NOFID, NOTAG, VERSION, Dirent, Message, Qid

__all__ = ["TAGS_MAX", "XATTR_SIZE_MAX", "Client", "NinePError"]

TAGS_MAX = 0xFFFF  # tags 0..0xFFFE; 0xFFFF is NOTAG
MSIZE_DEFAULT = 512 * 1024
MSIZE_MIN = 4096  # as the kernel: a server offering less is refused
TIMEOUT_S_DEFAULT = 30.0
RECV_BYTES_MAX = 256 * 1024  # one recv() call
XATTR_SIZE_MAX = 64 * 1024  # Linux's XATTR_SIZE_MAX / XATTR_LIST_MAX
READ_ALL_BYTES_MAX = 1 << 30
READDIR_ENTRIES_MAX = 1_000_000


class NinePError(OSError):
    """The server answered Rlerror: ``errno`` is the Linux errno it sent.

    Like ``OSError(errno, ...)`` itself, ``NinePError(ENOENT)`` is also a
    ``FileNotFoundError`` (``EEXIST`` a ``FileExistsError``, ``EACCES``/``EPERM`` a
    ``PermissionError`` ...), so callers can catch what they would catch from ``os``.
    """

    def __new__(cls, ecode: int, context: str = "") -> Self:
        try:
            text = os.strerror(ecode)
        except (ValueError, OverflowError):
            text = f"errno {ecode}"
        if context:
            text = f"{text} [{context}]"
        # OSError parses (errno, strerror) in __new__ when a subclass overrides it.
        kind = _ERRNO_CLASSES.get(ecode, cls) if cls is NinePError else cls
        return super().__new__(kind, ecode, text)

    def __init__(self, ecode: int, context: str = "") -> None:
        pass  # everything was set by __new__


def _errno_classes() -> dict[int, type[NinePError]]:
    """errno -> a NinePError subclass that is also the builtin OSError subclass Python
    picks for that errno (FileNotFoundError, ...), asked of OSError itself."""
    classes: dict[int, type[NinePError]] = {}
    combined: dict[type, type[NinePError]] = {}
    for code in sorted(_errno.errorcode):
        builtin = type(OSError(code, ""))
        if builtin is OSError:
            continue
        if builtin not in combined:
            combined[builtin] = type(f"NinePError_{builtin.__name__}", (NinePError, builtin), {"__module__": __name__})
        classes[code] = combined[builtin]
    return classes


_ERRNO_CLASSES = _errno_classes()


class Client:
    """One 9P2000.L session: ``Client(sock)`` negotiates the version; then attach.

    The client owns ``sock`` from then on (``close()`` closes it; so does a failed
    version negotiation). ``msize`` is what we ask for; ``self.msize`` what was agreed.
    """

    def __init__(
        self, sock: socket.socket, msize: int = MSIZE_DEFAULT, *, timeout_s: float = TIMEOUT_S_DEFAULT
    ) -> None:
        if msize < MSIZE_MIN:
            raise ValueError(f"msize {msize} < {MSIZE_MIN}")
        self.sock = sock
        self.timeout_s = timeout_s
        sock.settimeout(timeout_s)
        self._splitter = FrameSplitter(msize)
        self._frames: deque[bytes] = deque()  # received, not yet decoded
        self._pending: set[int] = set()  # tags sent, reply not yet handed out
        self._held: dict[int, Message] = {}  # replies received for tags nobody asked yet
        self._next_tag = 0
        self._live_fids: set[int] = set()
        self._next_fid = 1
        self._iounits: dict[int, int] = {}
        self.root_fid: int | None = None
        self.msize = msize
        self._closed = False
        try:
            self._version(msize)
        except BaseException:
            self.close()
            raise

    # -- construction -------------------------------------------------------------

    @classmethod
    def connect_unix(
        cls, path: str, msize: int = MSIZE_DEFAULT, *, timeout_s: float = TIMEOUT_S_DEFAULT
    ) -> Client:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return cls(sock, msize, timeout_s=timeout_s)

    @classmethod
    def connect_tcp(
        cls, host: str, port: int, msize: int = MSIZE_DEFAULT, *, timeout_s: float = TIMEOUT_S_DEFAULT
    ) -> Client:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        return cls(sock, msize, timeout_s=timeout_s)

    def _version(self, msize: int) -> None:
        self._send_frame(encode(NOTAG, m.Tversion(msize, VERSION)))
        tag, reply = self._read_reply()
        if tag != NOTAG or not isinstance(reply, m.Rversion):
            raise ProtocolError(f"expected Rversion to NOTAG, got {reply!r} to tag {tag}", tag)
        if reply.version != VERSION:
            raise ProtocolError(f"server speaks {reply.version!r}, not {VERSION!r}")
        if reply.msize < MSIZE_MIN:
            raise ProtocolError(f"server msize {reply.msize} < {MSIZE_MIN}")
        self.msize = min(msize, reply.msize)
        self._splitter.msize = self.msize

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def iounit(self) -> int:
        """Largest read/write payload one message can carry at this msize."""
        return self.msize - IOHDRSZ

    # -- frames ---------------------------------------------------------------------

    def _send_frame(self, frame: bytes) -> None:
        if self._closed:
            raise ConnectionError("client is closed")
        self.sock.sendall(frame)

    def _read_reply(self) -> tuple[int, Message]:
        """The next reply off the wire (ignores held replies)."""
        while not self._frames:
            data = self.sock.recv(RECV_BYTES_MAX)
            if not data:
                raise ConnectionError("9P server closed the connection")
            self._frames.extend(self._splitter.feed(data))
        return decode(self._frames.popleft())

    # -- low level ------------------------------------------------------------------

    def _alloc_tag(self) -> int:
        if len(self._pending) + len(self._held) >= TAGS_MAX:
            raise RuntimeError(f"{TAGS_MAX} requests outstanding: no free tag")
        tag = self._next_tag
        while tag in self._pending or tag in self._held:
            tag = (tag + 1) % TAGS_MAX
        self._next_tag = (tag + 1) % TAGS_MAX
        return tag

    def send(self, msg: Message) -> int:
        """Send a T-message with a fresh tag; return the tag."""
        tag = self._alloc_tag()
        frame = encode(tag, msg)
        if len(frame) > self.msize:
            raise ValueError(f"{type(msg).__name__} of {len(frame)} bytes exceeds msize {self.msize}")
        self._send_frame(frame)
        self._pending.add(tag)
        return tag

    def send_many(self, msgs: Iterable[Message]) -> list[int]:
        """Send T-messages pipelined in one write (as a busy kernel client may); their tags."""
        tags, frames = [], []
        for msg in msgs:
            tag = self._alloc_tag()
            frame = encode(tag, msg)
            if len(frame) > self.msize:
                raise ValueError(f"{type(msg).__name__} of {len(frame)} bytes exceeds msize {self.msize}")
            self._pending.add(tag)  # reserved now so the next _alloc_tag skips it
            tags.append(tag)
            frames.append(frame)
        self._send_frame(b"".join(frames))
        return tags

    def recv(self) -> tuple[int, Message]:
        """The next reply in arrival order (held ones first), Rlerror included, raw."""
        if self._held:
            tag = next(iter(self._held))
            return tag, self._held.pop(tag)
        tag, reply = self._read_reply()
        if tag not in self._pending:
            raise ProtocolError(f"reply {reply!r} to tag {tag}, which is not outstanding", tag)
        self._pending.discard(tag)
        return tag, reply

    def wait(self, tag: int) -> Message:
        """The reply to ``tag`` (sent earlier with :meth:`send`); Rlerror -> NinePError."""
        if tag in self._held:
            return _check(self._held.pop(tag), tag)
        if tag not in self._pending:
            raise ValueError(f"tag {tag} is not outstanding")
        while True:
            got, reply = self._read_reply()
            if got not in self._pending:
                raise ProtocolError(f"reply {reply!r} to tag {got}, which is not outstanding", got)
            self._pending.discard(got)
            if got == tag:
                return _check(reply, tag)
            self._held[got] = reply

    def rpc(self, msg: Message) -> Message:
        """Send ``msg`` and wait for its reply; Rlerror -> NinePError."""
        reply = self.wait(self.send(msg))
        expected = m.MESSAGE_TYPES.get(msg.TYPE + 1)
        if type(reply) is not expected:
            raise ProtocolError(f"{type(msg).__name__} answered by {reply!r}")
        return reply

    def flush(self, oldtag: int) -> None:
        """Tflush ``oldtag``; after Rflush the old tag is free (a reply that arrived
        before Rflush stays available to :meth:`wait`)."""
        self.rpc(m.Tflush(oldtag))
        self._pending.discard(oldtag)

    # -- fids -----------------------------------------------------------------------

    def new_fid(self) -> int:
        """A fid number not live on this session (the server learns it on first use)."""
        if len(self._live_fids) >= NOFID - 1:
            raise RuntimeError("no free fid")
        fid = self._next_fid
        while fid in self._live_fids or fid == NOFID:
            fid = (fid + 1) & 0xFFFFFFFF
        self._next_fid = (fid + 1) & 0xFFFFFFFF
        self._live_fids.add(fid)
        return fid

    def _release(self, fid: int) -> None:
        self._live_fids.discard(fid)
        self._iounits.pop(fid, None)

    def _claim(self, fid: int | None) -> int:
        """A fresh fid, or the caller's choice marked live."""
        if fid is None:
            return self.new_fid()
        self._live_fids.add(fid)
        return fid

    # -- session --------------------------------------------------------------------

    def attach(
        self, fid: int | None = None, uname: str = "root", aname: str = "", n_uname: int = 0, afid: int = NOFID
    ) -> tuple[int, Qid]:
        """Tattach ``fid`` (fresh by default); the first attach becomes ``root_fid``."""
        fid = self._claim(fid)
        try:
            reply = self.rpc(m.Tattach(fid, afid, uname, aname, n_uname))
        except BaseException:
            self._release(fid)  # an attach that failed established no fid
            raise
        if self.root_fid is None:
            self.root_fid = fid
        return fid, reply.qid  # type: ignore[attr-defined]

    def walk(self, fid: int, names: Iterable[str], newfid: int | None = None) -> tuple[int, list[Qid]]:
        """Walk ``names`` from ``fid`` to ``newfid`` (a fresh fid by default).

        More than 16 names are sent as several Twalks (the first clones, the rest walk
        ``newfid`` in place). A walk that stops short raises NinePError(ENOENT), as in the
        kernel, and leaves no new fid behind. ``names == []`` clones ``fid``.
        """
        names = list(names)
        in_place = newfid == fid
        newfid = self._claim(newfid)
        qids: list[Qid] = []
        created = in_place  # does newfid exist on the server yet?
        try:
            first = True
            while first or names:
                batch, names = names[: m.WALK_NAMES_MAX], names[m.WALK_NAMES_MAX :]
                src = fid if first else newfid
                reply = self.rpc(m.Twalk(src, newfid, tuple(batch)))
                got = list(reply.qids)  # type: ignore[attr-defined]
                if len(got) != len(batch):
                    raise NinePError(_errno.ENOENT, f"walk stopped at {batch[len(got)]!r}")
                created = True
                qids += got
                first = False
        except BaseException:
            if created and not in_place:
                self._clunk_quietly(newfid)
            elif not in_place:
                self._release(newfid)
            raise
        return newfid, qids

    def walk_path(self, path: str, fid: int | None = None) -> int:
        """A new fid for ``path`` ("/"-separated, relative to the attach fid or ``fid``)."""
        start = self.root_fid if fid is None else fid
        if start is None:
            raise RuntimeError("walk_path before attach")
        newfid, _ = self.walk(start, [part for part in path.split("/") if part])
        return newfid

    def clunk(self, fid: int) -> None:
        try:
            self.rpc(m.Tclunk(fid))
        finally:
            self._release(fid)
            if fid == self.root_fid:
                self.root_fid = None

    def _clunk_quietly(self, fid: int) -> None:
        try:
            self.clunk(fid)
        except (OSError, ProtocolError):
            pass

    def remove(self, fid: int) -> None:
        try:
            self.rpc(m.Tremove(fid))
        finally:
            self._release(fid)

    # -- files ----------------------------------------------------------------------

    def lopen(self, fid: int, flags: int) -> tuple[Qid, int]:
        reply = self.rpc(m.Tlopen(fid, flags))
        self._iounits[fid] = reply.iounit  # type: ignore[attr-defined]
        return reply.qid, reply.iounit  # type: ignore[attr-defined]

    def lcreate(self, fid: int, name: str, flags: int, mode: int, gid: int = 0) -> tuple[Qid, int]:
        reply = self.rpc(m.Tlcreate(fid, name, flags, mode, gid))
        self._iounits[fid] = reply.iounit  # type: ignore[attr-defined]
        return reply.qid, reply.iounit  # type: ignore[attr-defined]

    def _chunk(self, fid: int) -> int:
        unit = self._iounits.get(fid, 0)
        limit = self.msize - IOHDRSZ
        return unit if 0 < unit <= limit else limit

    def read(self, fid: int, offset: int, count: int) -> bytes:
        reply = self.rpc(m.Tread(fid, offset, count))
        data = reply.data  # type: ignore[attr-defined]
        if len(data) > count:
            raise ProtocolError(f"Rread of {len(data)} bytes for a Tread of {count}")
        return data

    def write(self, fid: int, offset: int, data: bytes) -> int:
        count = self.rpc(m.Twrite(fid, offset, data)).count  # type: ignore[attr-defined]
        if count > len(data):
            raise ProtocolError(f"Rwrite count {count} for a Twrite of {len(data)} bytes")
        return count

    def read_all(self, fid: int, offset: int = 0, max_bytes: int = READ_ALL_BYTES_MAX) -> bytes:
        """Read from ``offset`` to end of file, in iounit-sized Treads."""
        chunk = self._chunk(fid)
        parts: list[bytes] = []
        total = 0
        while True:
            data = self.read(fid, offset + total, chunk)
            if not data:
                return b"".join(parts)
            parts.append(data)
            total += len(data)
            if total > max_bytes:
                raise OSError(_errno.EFBIG, f"read_all: more than {max_bytes} bytes")

    def write_all(self, fid: int, offset: int, data: bytes) -> int:
        """Write all of ``data`` at ``offset`` in iounit-sized Twrites; returns len(data)."""
        chunk = self._chunk(fid)
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = self.write(fid, offset + done, bytes(view[done : done + chunk]))
            if n == 0:
                raise OSError(_errno.EIO, f"write_all: server wrote 0 bytes at offset {offset + done}")
            done += n
        return done

    def fsync(self, fid: int, datasync: int = 0) -> None:
        self.rpc(m.Tfsync(fid, datasync))

    # -- attributes -----------------------------------------------------------------

    def getattr(self, fid: int, mask: int = GETATTR_ALL) -> m.Rgetattr:
        return self.rpc(m.Tgetattr(fid, mask))  # type: ignore[return-value]

    def setattr(
        self,
        fid: int,
        valid: int,
        mode: int = 0,
        uid: int = 0,
        gid: int = 0,
        size: int = 0,
        atime: tuple[int, int] = (0, 0),
        mtime: tuple[int, int] = (0, 0),
    ) -> None:
        self.rpc(m.Tsetattr(fid, valid, mode, uid, gid, size, atime[0], atime[1], mtime[0], mtime[1]))

    def statfs(self, fid: int) -> m.Rstatfs:
        return self.rpc(m.Tstatfs(fid))  # type: ignore[return-value]

    # -- directories ----------------------------------------------------------------

    def readdir(self, fid: int, offset: int, count: int) -> list[Dirent]:
        reply = self.rpc(m.Treaddir(fid, offset, count))
        data = reply.data  # type: ignore[attr-defined]
        if len(data) > count:
            raise ProtocolError(f"Rreaddir of {len(data)} bytes for a count of {count}")
        return m.unpack_dirents(data)

    def readdir_all(self, fid: int, max_entries: int = READDIR_ENTRIES_MAX) -> list[Dirent]:
        """All entries of the directory open on ``fid``, following offsets until empty."""
        count = self.msize - m.READDIRHDRSZ
        out: list[Dirent] = []
        offset = 0
        while True:
            batch = self.readdir(fid, offset, count)
            if not batch:
                return out
            out += batch
            if len(out) > max_entries:
                raise OSError(_errno.EFBIG, f"readdir_all: more than {max_entries} entries (offset loop?)")
            offset = batch[-1].offset

    def mkdir(self, dfid: int, name: str, mode: int = 0o755, gid: int = 0) -> Qid:
        return self.rpc(m.Tmkdir(dfid, name, mode, gid)).qid  # type: ignore[attr-defined]

    def symlink(self, dfid: int, name: str, target: str, gid: int = 0) -> Qid:
        return self.rpc(m.Tsymlink(dfid, name, target, gid)).qid  # type: ignore[attr-defined]

    def mknod(self, dfid: int, name: str, mode: int, major: int = 0, minor: int = 0, gid: int = 0) -> Qid:
        return self.rpc(m.Tmknod(dfid, name, mode, major, minor, gid)).qid  # type: ignore[attr-defined]

    def readlink(self, fid: int) -> str:
        return self.rpc(m.Treadlink(fid)).target  # type: ignore[attr-defined]

    def link(self, dfid: int, fid: int, name: str) -> None:
        self.rpc(m.Tlink(dfid, fid, name))

    def rename(self, fid: int, dfid: int, name: str) -> None:
        self.rpc(m.Trename(fid, dfid, name))

    def renameat(self, olddirfid: int, oldname: str, newdirfid: int, newname: str) -> None:
        self.rpc(m.Trenameat(olddirfid, oldname, newdirfid, newname))

    def unlinkat(self, dirfid: int, name: str, flags: int = 0) -> None:
        self.rpc(m.Tunlinkat(dirfid, name, flags))

    # -- locks ----------------------------------------------------------------------

    def lock(
        self,
        fid: int,
        type: int,
        flags: int = 0,
        start: int = 0,
        length: int = 0,
        proc_id: int = 0,
        client_id: str = "",
    ) -> int:
        """Tlock; returns the status (LOCK_SUCCESS, LOCK_BLOCKED, ...)."""
        reply = self.rpc(m.Tlock(fid, type, flags, start, length, proc_id, client_id))
        return reply.status  # type: ignore[attr-defined]

    def getlock(
        self, fid: int, type: int, start: int = 0, length: int = 0, proc_id: int = 0, client_id: str = ""
    ) -> m.Rgetlock:
        return self.rpc(m.Tgetlock(fid, type, start, length, proc_id, client_id))  # type: ignore[return-value]

    # -- extended attributes ----------------------------------------------------------

    def xattrwalk(self, fid: int, name: str) -> tuple[int, int]:
        """Txattrwalk to a fresh fid; returns (newfid, size). ``name == ""`` lists."""
        newfid = self.new_fid()
        try:
            size = self.rpc(m.Txattrwalk(fid, newfid, name)).size  # type: ignore[attr-defined]
        except BaseException:
            self._release(newfid)
            raise
        return newfid, size

    def xattrcreate(self, fid: int, name: str, attr_size: int, flags: int = 0) -> None:
        self.rpc(m.Txattrcreate(fid, name, attr_size, flags))

    def _read_xattr_fid(self, xfid: int, size: int) -> bytes:
        try:
            if size > XATTR_SIZE_MAX:
                raise OSError(_errno.E2BIG, f"xattr of {size} bytes > {XATTR_SIZE_MAX}")
            chunk = self._chunk(xfid)
            parts: list[bytes] = []
            got = 0
            while got < size:
                data = self.read(xfid, got, min(chunk, size - got))
                if not data:
                    break
                parts.append(data)
                got += len(data)
            value = b"".join(parts)
        except BaseException:
            self._clunk_quietly(xfid)
            raise
        self.clunk(xfid)
        if len(value) != size:
            raise ProtocolError(f"xattr fid promised {size} bytes, gave {len(value)}")
        return value

    def getxattr(self, path_fid: int, name: str) -> bytes:
        """The value of xattr ``name`` (Txattrwalk, Tread on the xattr fid, Tclunk)."""
        xfid, size = self.xattrwalk(path_fid, name)
        return self._read_xattr_fid(xfid, size)

    def listxattr(self, fid: int) -> list[str]:
        """Names of the xattrs of ``fid`` (Txattrwalk with an empty name)."""
        xfid, size = self.xattrwalk(fid, "")
        raw = self._read_xattr_fid(xfid, size)
        return [part.decode("utf-8", "surrogateescape") for part in raw.split(b"\0") if part]

    def setxattr(self, fid: int, name: str, value: bytes, flags: int = 0) -> None:
        """Set xattr ``name`` as Linux v9fs does: clone ``fid``, Txattrcreate on the
        clone, Twrite the value, and Tclunk -- the clunk commits (its error is raised)."""
        xfid, _ = self.walk(fid, [])
        try:
            self.xattrcreate(xfid, name, len(value), flags)
            if value:
                self.write_all(xfid, 0, value)
        except BaseException:
            self._clunk_quietly(xfid)
            raise
        self.clunk(xfid)

    def removexattr(self, fid: int, name: str) -> None:
        """Remove xattr ``name`` (v9fs: Txattrcreate of size 0 with XATTR_REPLACE)."""
        self.setxattr(fid, name, b"", m.XATTR_REPLACE)


def _check(reply: Message, tag: int) -> Message:
    if isinstance(reply, m.Rlerror):
        raise NinePError(reply.ecode)
    return reply
