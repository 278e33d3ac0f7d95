"""9P2000.L constants and message types: what the codec turns bytes into, and back.

Pure data: no I/O, no state. :mod:`sandbox.ninep.codec` turns these into frames.

Wire layout (little-endian throughout, as the Linux client ``net/9p`` speaks it)::

    size[4] type[1] tag[2] body...

``size`` counts itself, so the smallest frame is :data:`HEADER_SIZE` (7) bytes. Each
message class carries its wire ``TYPE`` byte and a ``WIRE`` spec: one letter per
dataclass field, in field order, which is the wire order. The letters follow the
kernel's ``p9pdu_readf``/``writef`` conventions so a spec can be read against
``net/9p/client.c``:

====  ============================================================================
b     u8
w     u16
d     u32
q     u64
s     string: u16 byte length + bytes (no NUL). Python ``str``; bytes that are not
      UTF-8 are carried with ``surrogateescape`` both ways, so a Linux file name (any
      bytes but ``/`` and NUL) round-trips byte-exact.
Q     qid: type[1] version[4] path[8] (13 bytes) -> :class:`Qid`
T     walk names: nwname[2] then nwname strings, ``nwname <= WALK_NAMES_MAX``
R     walk qids: nwqid[2] then nwqid qids, ``nwqid <= WALK_NAMES_MAX``
D     data: count[4] then exactly count bytes -> ``bytes``
====  ============================================================================

Invariants:

* Field order of every dataclass is its wire order; ``len(WIRE)`` equals its number of
  fields (checked at import).
* Message objects are immutable (frozen, slotted). Values are not range-checked on
  construction -- that would tax every decode on the server's hot path; instead
  :func:`~sandbox.ninep.codec.encode` refuses out-of-range values with ``ValueError``, and
  :func:`~sandbox.ninep.codec.decode` can only produce in-range values.
* Directory entries (:func:`pack_dirents` / :func:`unpack_dirents`) bound every size they
  read or write; a malformed ``Rreaddir`` payload raises :class:`ProtocolError`, nothing
  else.

Where the design document (seed 003, Appendix A) disagrees with the kernel, the kernel
wins and this module follows it: see the notes at the message-type table below.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "DIRENT_HEADER_SIZE",
    "MESSAGE_TYPES",
    "Dirent",
    "Message",
    "ProtocolError",
    "Qid",
    "dirent_size",
    "pack_dirents",
    "unpack_dirents",
]


class ProtocolError(Exception):
    """A frame (or a payload inside one) is malformed.

    ``tag`` is the frame's tag when the 7-byte header was readable, so a server can
    answer ``Rlerror(EINVAL)`` to that tag and carry on; ``None`` when it was not (the
    caller should then close the connection: framing is lost).

    Defined here rather than in :mod:`~sandbox.ninep.codec` (which re-exports it) because
    :func:`unpack_dirents` raises it too; ``codec.ProtocolError is messages.ProtocolError``.
    """

    def __init__(self, message: str, tag: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.tag = tag

    def __str__(self) -> str:
        if self.tag is None:
            return self.message
        return f"{self.message} (tag {self.tag})"


# ---------------------------------------------------------------------------------------
# Constants (include/net/9p/9p.h unless noted)
# ---------------------------------------------------------------------------------------

VERSION = "9P2000.L"
HEADER_SIZE = 7  # size[4] type[1] tag[2]  (P9_HDRSZ)
IOHDRSZ = 24  # room reserved for the Twrite/Rread header: iounit = msize - IOHDRSZ
READDIRHDRSZ = 24  # the kernel asks Treaddir for at most msize - 24 bytes
WALK_NAMES_MAX = 16  # P9_MAXWELEM
STRING_BYTES_MAX = 0xFFFF  # a string's length prefix is a u16

NOTAG = 0xFFFF
NOFID = 0xFFFFFFFF

# qid.type
QT_DIR = 0x80
QT_APPEND = 0x40
QT_EXCL = 0x20
QT_MOUNT = 0x10
QT_AUTH = 0x08
QT_TMP = 0x04
QT_SYMLINK = 0x02
QT_LINK = 0x01
QT_FILE = 0x00

# Tgetattr request_mask / Rgetattr valid (P9_STATS_*)
GETATTR_MODE = 0x00000001
GETATTR_NLINK = 0x00000002
GETATTR_UID = 0x00000004
GETATTR_GID = 0x00000008
GETATTR_RDEV = 0x00000010
GETATTR_ATIME = 0x00000020
GETATTR_MTIME = 0x00000040
GETATTR_CTIME = 0x00000080
GETATTR_INO = 0x00000100
GETATTR_SIZE = 0x00000200
GETATTR_BLOCKS = 0x00000400
GETATTR_BTIME = 0x00000800
GETATTR_GEN = 0x00001000
GETATTR_DATA_VERSION = 0x00002000
GETATTR_BASIC = 0x000007FF  # MODE..BLOCKS
GETATTR_ALL = 0x00003FFF

# Tsetattr valid (P9_ATTR_*, fs/9p/vfs_inode_dotl.c). The seed document gives
# ATIME_SET=0x100 and MTIME_SET=0x200; the kernel (and QEMU's server) use 1<<7 and 1<<8.
SETATTR_MODE = 0x001
SETATTR_UID = 0x002
SETATTR_GID = 0x004
SETATTR_SIZE = 0x008
SETATTR_ATIME = 0x010  # set atime (to "now" unless ATIME_SET)
SETATTR_MTIME = 0x020  # set mtime (to "now" unless MTIME_SET)
SETATTR_CTIME = 0x040
SETATTR_ATIME_SET = 0x080  # use atime_sec/atime_nsec as given
SETATTR_MTIME_SET = 0x100  # use mtime_sec/mtime_nsec as given

# Tlopen / Tlcreate flags (P9_DOTL_*). Octal, equal to Linux x86 O_* values -- but NOT to
# the host's os.O_* on every platform (macOS, Windows, and arm Linux for DIRECTORY,
# NOFOLLOW, DIRECT, LARGEFILE): a server must map them bit by bit.
DOTL_RDONLY = 0o0
DOTL_WRONLY = 0o1
DOTL_RDWR = 0o2
DOTL_NOACCESS = 0o3
DOTL_ACCMODE = 0o3  # mask for the three access modes above (not a kernel name)
DOTL_CREATE = 0o100
DOTL_EXCL = 0o200
DOTL_NOCTTY = 0o400
DOTL_TRUNC = 0o1000
DOTL_APPEND = 0o2000
DOTL_NONBLOCK = 0o4000
DOTL_DSYNC = 0o10000
DOTL_FASYNC = 0o20000
DOTL_DIRECT = 0o40000
DOTL_LARGEFILE = 0o100000
DOTL_DIRECTORY = 0o200000
DOTL_NOFOLLOW = 0o400000
DOTL_NOATIME = 0o1000000
DOTL_CLOEXEC = 0o2000000
DOTL_SYNC = 0o4000000

# Tunlinkat flags (P9_DOTL_AT_REMOVEDIR)
AT_REMOVEDIR = 0x200

# Tlock / Tgetlock
LOCK_TYPE_RDLCK = 0
LOCK_TYPE_WRLCK = 1
LOCK_TYPE_UNLCK = 2
LOCK_SUCCESS = 0
LOCK_BLOCKED = 1
LOCK_ERROR = 2
LOCK_GRACE = 3
LOCK_FLAGS_BLOCK = 1
LOCK_FLAGS_RECLAIM = 2

# Txattrcreate flags (Linux setxattr(2))
XATTR_CREATE = 1
XATTR_REPLACE = 2

# Dirent.type (Linux DT_*)
DT_UNKNOWN = 0
DT_FIFO = 1
DT_CHR = 2
DT_DIR = 4
DT_BLK = 6
DT_REG = 8
DT_LNK = 10
DT_SOCK = 12


# ---------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Qid:
    """A server's identity for a file: type (QT_*), version (u32), path (u64, unique)."""

    type: int
    version: int
    path: int


class Message:
    """Base of every T- and R-message dataclass.

    ``TYPE`` is the wire type byte; ``WIRE`` the field spec (see the module docstring).
    """

    __slots__ = ()
    TYPE: ClassVar[int]
    WIRE: ClassVar[str]


def _short(data: bytes) -> str:
    if len(data) <= 32:
        return repr(data)
    return f"<{len(data)} bytes>"


# Type numbers are the kernel's (enum p9_msg_t). The seed document's A.2.2 table numbers
# Tauth/Tattach/Tflush/Twalk as 104/108/112/114; the kernel has 102/104/108/110 (104/108
# are its Tattach and Tflush, 112/114 are the legacy Topen/Tcreate). Tfsync carries a
# datasync[4] after the fid, which the seed's table omits.


# -- session ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tversion(Message):
    TYPE: ClassVar[int] = 100
    WIRE: ClassVar[str] = "ds"
    msize: int
    version: str


@dataclass(frozen=True, slots=True)
class Rversion(Message):
    TYPE: ClassVar[int] = 101
    WIRE: ClassVar[str] = "ds"
    msize: int
    version: str


@dataclass(frozen=True, slots=True)
class Tauth(Message):
    TYPE: ClassVar[int] = 102
    WIRE: ClassVar[str] = "dssd"
    afid: int
    uname: str
    aname: str
    n_uname: int


@dataclass(frozen=True, slots=True)
class Rauth(Message):
    TYPE: ClassVar[int] = 103
    WIRE: ClassVar[str] = "Q"
    aqid: Qid


@dataclass(frozen=True, slots=True)
class Tattach(Message):
    TYPE: ClassVar[int] = 104
    WIRE: ClassVar[str] = "ddssd"
    fid: int
    afid: int
    uname: str
    aname: str
    n_uname: int


@dataclass(frozen=True, slots=True)
class Rattach(Message):
    TYPE: ClassVar[int] = 105
    WIRE: ClassVar[str] = "Q"
    qid: Qid


@dataclass(frozen=True, slots=True)
class Rlerror(Message):
    """The error reply of 9P2000.L: a Linux errno (there is no Tlerror)."""

    TYPE: ClassVar[int] = 7
    WIRE: ClassVar[str] = "d"
    ecode: int


@dataclass(frozen=True, slots=True)
class Tflush(Message):
    TYPE: ClassVar[int] = 108
    WIRE: ClassVar[str] = "w"
    oldtag: int


@dataclass(frozen=True, slots=True)
class Rflush(Message):
    TYPE: ClassVar[int] = 109
    WIRE: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Twalk(Message):
    TYPE: ClassVar[int] = 110
    WIRE: ClassVar[str] = "ddT"
    fid: int
    newfid: int
    wnames: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Rwalk(Message):
    TYPE: ClassVar[int] = 111
    WIRE: ClassVar[str] = "R"
    qids: tuple[Qid, ...]


# -- files ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tlopen(Message):
    TYPE: ClassVar[int] = 12
    WIRE: ClassVar[str] = "dd"
    fid: int
    flags: int


@dataclass(frozen=True, slots=True)
class Rlopen(Message):
    TYPE: ClassVar[int] = 13
    WIRE: ClassVar[str] = "Qd"
    qid: Qid
    iounit: int


@dataclass(frozen=True, slots=True)
class Tlcreate(Message):
    TYPE: ClassVar[int] = 14
    WIRE: ClassVar[str] = "dsddd"
    fid: int
    name: str
    flags: int
    mode: int
    gid: int


@dataclass(frozen=True, slots=True)
class Rlcreate(Message):
    TYPE: ClassVar[int] = 15
    WIRE: ClassVar[str] = "Qd"
    qid: Qid
    iounit: int


@dataclass(frozen=True, slots=True)
class Tread(Message):
    TYPE: ClassVar[int] = 116
    WIRE: ClassVar[str] = "dqd"
    fid: int
    offset: int
    count: int


@dataclass(frozen=True, slots=True, repr=False)
class Rread(Message):
    TYPE: ClassVar[int] = 117
    WIRE: ClassVar[str] = "D"
    data: bytes

    def __repr__(self) -> str:
        return f"Rread(data={_short(self.data)})"


@dataclass(frozen=True, slots=True, repr=False)
class Twrite(Message):
    TYPE: ClassVar[int] = 118
    WIRE: ClassVar[str] = "dqD"
    fid: int
    offset: int
    data: bytes

    def __repr__(self) -> str:
        return f"Twrite(fid={self.fid}, offset={self.offset}, data={_short(self.data)})"


@dataclass(frozen=True, slots=True)
class Rwrite(Message):
    TYPE: ClassVar[int] = 119
    WIRE: ClassVar[str] = "d"
    count: int


@dataclass(frozen=True, slots=True)
class Tclunk(Message):
    TYPE: ClassVar[int] = 120
    WIRE: ClassVar[str] = "d"
    fid: int


@dataclass(frozen=True, slots=True)
class Rclunk(Message):
    TYPE: ClassVar[int] = 121
    WIRE: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Tremove(Message):
    TYPE: ClassVar[int] = 122
    WIRE: ClassVar[str] = "d"
    fid: int


@dataclass(frozen=True, slots=True)
class Rremove(Message):
    TYPE: ClassVar[int] = 123
    WIRE: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Tfsync(Message):
    TYPE: ClassVar[int] = 50
    WIRE: ClassVar[str] = "dd"
    fid: int
    datasync: int


@dataclass(frozen=True, slots=True)
class Rfsync(Message):
    TYPE: ClassVar[int] = 51
    WIRE: ClassVar[str] = ""


# -- attributes -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tgetattr(Message):
    TYPE: ClassVar[int] = 24
    WIRE: ClassVar[str] = "dq"
    fid: int
    request_mask: int


@dataclass(frozen=True, slots=True)
class Rgetattr(Message):
    """``mode`` is a Linux st_mode (S_IFREG|0644 ...), not 9P DM* bits. Fields whose
    GETATTR_* bit is clear in ``valid`` carry no information."""

    TYPE: ClassVar[int] = 25
    WIRE: ClassVar[str] = "qQdddqqqqqqqqqqqqqqq"
    valid: int
    qid: Qid
    mode: int
    uid: int
    gid: int
    nlink: int
    rdev: int
    size: int
    blksize: int
    blocks: int
    atime_sec: int
    atime_nsec: int
    mtime_sec: int
    mtime_nsec: int
    ctime_sec: int
    ctime_nsec: int
    btime_sec: int
    btime_nsec: int
    gen: int
    data_version: int


@dataclass(frozen=True, slots=True)
class Tsetattr(Message):
    TYPE: ClassVar[int] = 26
    WIRE: ClassVar[str] = "dddddqqqqq"
    fid: int
    valid: int
    mode: int
    uid: int
    gid: int
    size: int
    atime_sec: int
    atime_nsec: int
    mtime_sec: int
    mtime_nsec: int


@dataclass(frozen=True, slots=True)
class Rsetattr(Message):
    TYPE: ClassVar[int] = 27
    WIRE: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Tstatfs(Message):
    TYPE: ClassVar[int] = 8
    WIRE: ClassVar[str] = "d"
    fid: int


@dataclass(frozen=True, slots=True)
class Rstatfs(Message):
    TYPE: ClassVar[int] = 9
    WIRE: ClassVar[str] = "ddqqqqqqd"
    type: int
    bsize: int
    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    fsid: int
    namelen: int


@dataclass(frozen=True, slots=True)
class Txattrwalk(Message):
    """``name == ""`` walks to the list of names (listxattr)."""

    TYPE: ClassVar[int] = 30
    WIRE: ClassVar[str] = "dds"
    fid: int
    newfid: int
    name: str


@dataclass(frozen=True, slots=True)
class Rxattrwalk(Message):
    TYPE: ClassVar[int] = 31
    WIRE: ClassVar[str] = "q"
    size: int


@dataclass(frozen=True, slots=True)
class Txattrcreate(Message):
    TYPE: ClassVar[int] = 32
    WIRE: ClassVar[str] = "dsqd"
    fid: int
    name: str
    attr_size: int
    flags: int


@dataclass(frozen=True, slots=True)
class Rxattrcreate(Message):
    TYPE: ClassVar[int] = 33
    WIRE: ClassVar[str] = ""


# -- directories and links --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Treaddir(Message):
    TYPE: ClassVar[int] = 40
    WIRE: ClassVar[str] = "dqd"
    fid: int
    offset: int
    count: int


@dataclass(frozen=True, slots=True, repr=False)
class Rreaddir(Message):
    """``data`` is packed directory entries; see :func:`unpack_dirents`."""

    TYPE: ClassVar[int] = 41
    WIRE: ClassVar[str] = "D"
    data: bytes

    def __repr__(self) -> str:
        return f"Rreaddir(data={_short(self.data)})"


@dataclass(frozen=True, slots=True)
class Tsymlink(Message):
    TYPE: ClassVar[int] = 16
    WIRE: ClassVar[str] = "dssd"
    fid: int
    name: str
    symtgt: str
    gid: int


@dataclass(frozen=True, slots=True)
class Rsymlink(Message):
    TYPE: ClassVar[int] = 17
    WIRE: ClassVar[str] = "Q"
    qid: Qid


@dataclass(frozen=True, slots=True)
class Tmknod(Message):
    TYPE: ClassVar[int] = 18
    WIRE: ClassVar[str] = "dsdddd"
    dfid: int
    name: str
    mode: int
    major: int
    minor: int
    gid: int


@dataclass(frozen=True, slots=True)
class Rmknod(Message):
    TYPE: ClassVar[int] = 19
    WIRE: ClassVar[str] = "Q"
    qid: Qid


@dataclass(frozen=True, slots=True)
class Trename(Message):
    TYPE: ClassVar[int] = 20
    WIRE: ClassVar[str] = "dds"
    fid: int
    dfid: int
    name: str


@dataclass(frozen=True, slots=True)
class Rrename(Message):
    TYPE: ClassVar[int] = 21
    WIRE: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Treadlink(Message):
    TYPE: ClassVar[int] = 22
    WIRE: ClassVar[str] = "d"
    fid: int


@dataclass(frozen=True, slots=True)
class Rreadlink(Message):
    TYPE: ClassVar[int] = 23
    WIRE: ClassVar[str] = "s"
    target: str


@dataclass(frozen=True, slots=True)
class Tlink(Message):
    TYPE: ClassVar[int] = 70
    WIRE: ClassVar[str] = "dds"
    dfid: int
    fid: int
    name: str


@dataclass(frozen=True, slots=True)
class Rlink(Message):
    TYPE: ClassVar[int] = 71
    WIRE: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Tmkdir(Message):
    TYPE: ClassVar[int] = 72
    WIRE: ClassVar[str] = "dsdd"
    dfid: int
    name: str
    mode: int
    gid: int


@dataclass(frozen=True, slots=True)
class Rmkdir(Message):
    TYPE: ClassVar[int] = 73
    WIRE: ClassVar[str] = "Q"
    qid: Qid


@dataclass(frozen=True, slots=True)
class Trenameat(Message):
    TYPE: ClassVar[int] = 74
    WIRE: ClassVar[str] = "dsds"
    olddirfid: int
    oldname: str
    newdirfid: int
    newname: str


@dataclass(frozen=True, slots=True)
class Rrenameat(Message):
    TYPE: ClassVar[int] = 75
    WIRE: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Tunlinkat(Message):
    TYPE: ClassVar[int] = 76
    WIRE: ClassVar[str] = "dsd"
    dirfid: int
    name: str
    flags: int


@dataclass(frozen=True, slots=True)
class Runlinkat(Message):
    TYPE: ClassVar[int] = 77
    WIRE: ClassVar[str] = ""


# -- locks ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tlock(Message):
    TYPE: ClassVar[int] = 52
    WIRE: ClassVar[str] = "dbdqqds"
    fid: int
    type: int
    flags: int
    start: int
    length: int
    proc_id: int
    client_id: str


@dataclass(frozen=True, slots=True)
class Rlock(Message):
    TYPE: ClassVar[int] = 53
    WIRE: ClassVar[str] = "b"
    status: int


@dataclass(frozen=True, slots=True)
class Tgetlock(Message):
    TYPE: ClassVar[int] = 54
    WIRE: ClassVar[str] = "dbqqds"
    fid: int
    type: int
    start: int
    length: int
    proc_id: int
    client_id: str


@dataclass(frozen=True, slots=True)
class Rgetlock(Message):
    TYPE: ClassVar[int] = 55
    WIRE: ClassVar[str] = "bqqds"
    type: int
    start: int
    length: int
    proc_id: int
    client_id: str


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Rlerror,
        Tstatfs, Rstatfs,
        Tlopen, Rlopen,
        Tlcreate, Rlcreate,
        Tsymlink, Rsymlink,
        Tmknod, Rmknod,
        Trename, Rrename,
        Treadlink, Rreadlink,
        Tgetattr, Rgetattr,
        Tsetattr, Rsetattr,
        Txattrwalk, Rxattrwalk,
        Txattrcreate, Rxattrcreate,
        Treaddir, Rreaddir,
        Tfsync, Rfsync,
        Tlock, Rlock,
        Tgetlock, Rgetlock,
        Tlink, Rlink,
        Tmkdir, Rmkdir,
        Trenameat, Rrenameat,
        Tunlinkat, Runlinkat,
        Tversion, Rversion,
        Tauth, Rauth,
        Tattach, Rattach,
        Tflush, Rflush,
        Twalk, Rwalk,
        Tread, Rread,
        Twrite, Rwrite,
        Tclunk, Rclunk,
        Tremove, Rremove,
    )
}  # fmt: skip


def _check_specs() -> None:
    from dataclasses import fields

    for type_, cls in MESSAGE_TYPES.items():
        n_fields = len(fields(cls))
        if len(cls.WIRE) != n_fields or set(cls.WIRE) - set("bwdqsQTRD"):
            raise AssertionError(f"{cls.__name__}: WIRE {cls.WIRE!r} vs {n_fields} fields")
        if cls.__name__[0] == "T" and type_ % 2 or cls.__name__[0] == "R" and not type_ % 2:
            raise AssertionError(f"{cls.__name__}: T-messages are even, R-messages odd")
    if len(MESSAGE_TYPES) != 57:
        raise AssertionError(f"{len(MESSAGE_TYPES)} message types")


_check_specs()


# ---------------------------------------------------------------------------------------
# Directory entries (the payload of Rreaddir)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dirent:
    """One Rreaddir entry: ``offset`` is the opaque cookie that resumes *after* it."""

    qid: Qid
    offset: int
    type: int
    name: str


# qid[13] offset[8] type[1] name-length[2], then the name
_DIRENT_HEAD = struct.Struct("<BIQQBH")
DIRENT_HEADER_SIZE = _DIRENT_HEAD.size  # 24


def _name_bytes(name: str | bytes) -> bytes:
    if isinstance(name, str):
        return name.encode("utf-8", "surrogateescape")
    return bytes(name)


def dirent_size(name: str | bytes) -> int:
    """Bytes the entry for ``name`` takes in an Rreaddir payload."""
    return DIRENT_HEADER_SIZE + len(_name_bytes(name))


def pack_dirents(entries: Sequence[Dirent], count: int) -> tuple[bytes, int]:
    """Pack whole entries, in order, while they fit in ``count`` bytes.

    Returns ``(data, n)``: ``len(data) <= count`` and ``data`` holds exactly
    ``entries[:n]``; ``n`` is the largest such prefix (the first entry that does not fit
    ends the batch, even if a later, shorter one would fit -- offsets must stay in
    order). ``entries`` must be a Sequence so that an entry that does not fit is not lost:
    the caller resumes from ``entries[n]``. A name over 65535 bytes is a ValueError.
    ``n == 0`` with entries left means ``count`` cannot hold even the next entry.
    """
    if not isinstance(entries, Sequence):
        raise TypeError("pack_dirents needs a Sequence (an iterator would lose the entry that does not fit)")
    if count < 0:
        raise ValueError(f"count {count} < 0")
    pack = _DIRENT_HEAD.pack
    parts: list[bytes] = []
    used = 0
    n = 0
    for entry in entries:
        name = _name_bytes(entry.name)
        if len(name) > STRING_BYTES_MAX:
            raise ValueError(f"directory entry name of {len(name)} bytes (max {STRING_BYTES_MAX})")
        size = DIRENT_HEADER_SIZE + len(name)
        if used + size > count:
            break
        q = entry.qid
        try:
            parts.append(pack(q.type, q.version, q.path, entry.offset, entry.type, len(name)))
        except struct.error as exc:
            raise ValueError(f"directory entry {entry!r}: {exc}") from None
        parts.append(name)
        used += size
        n += 1
    return b"".join(parts), n


def unpack_dirents(data: bytes | bytearray | memoryview) -> list[Dirent]:
    """Parse an Rreaddir payload. A truncated entry raises :class:`ProtocolError`."""
    buf = data if isinstance(data, bytes) else bytes(data)
    end = len(buf)
    unpack_from = _DIRENT_HEAD.unpack_from
    out: list[Dirent] = []
    o = 0
    while o < end:
        if o + DIRENT_HEADER_SIZE > end:
            raise ProtocolError(f"readdir entry at byte {o}: header truncated to {end - o} bytes")
        qtype, qversion, qpath, offset, dtype, n = unpack_from(buf, o)
        o += DIRENT_HEADER_SIZE
        if o + n > end:
            raise ProtocolError(f"readdir entry at byte {o - DIRENT_HEADER_SIZE}: name of {n} bytes overruns payload")
        name = buf[o : o + n].decode("utf-8", "surrogateescape")
        o += n
        out.append(Dirent(Qid(qtype, qversion, qpath), offset, dtype, name))
    return out
