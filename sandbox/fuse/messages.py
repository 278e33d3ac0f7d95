"""FUSE requests and replies as typed values: what the codec turns bytes into, and back.

Pure data: no I/O, no state. :mod:`sandbox.fuse.codec` turns requests from bytes and
replies into bytes; :mod:`sandbox.fuse.abi` has the constants.

Invariants:

* One frozen, slotted dataclass per request opcode, named by the CamelCase of the opcode
  (``FUSE_COPY_FILE_RANGE`` -> :class:`CopyFileRange`), with ``OPCODE`` as a class
  attribute. The first field is always ``header`` (:class:`InHeader`); the rest are the
  fields of its ``fuse_<op>_in`` struct with fuse.h's names and order (padding, ``dummy``
  and ``unused`` fields left out), then its variable parts: names and symlink targets are
  ``bytes`` without their NUL, write data and xattr values ``bytes`` (or a ``memoryview``
  of the request buffer).
* Locks (``fuse_lk_in``) are flattened: ``Getlk(header, fh, owner, start, end, type, pid,
  lk_flags)``. ``BatchForget.forgets`` is a tuple of ``(nodeid, nlookup)``.
* Values are not range-checked on construction (that would tax every decode);
  :func:`~sandbox.fuse.codec.decode_request` produces only in-range values and the
  encoders refuse out-of-range ones with ``ValueError``.
* Only :class:`ProtocolError` (and its subclass :class:`UnknownOpcode`) escapes the
  decoder; ``errno`` is the errno the dispatcher answers with, ``unique`` the request's id
  when the header was readable.
"""

from __future__ import annotations

import errno as _errno
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..frozen import fast_init
from .abi import Opcode

__all__ = [
    "REQUEST_TYPES",
    "AttrOut",
    "CreateOut",
    "Data",
    "EntryOut",
    "FuseAttr",
    "GetxattrOut",
    "InHeader",
    "InitOut",
    "LkOut",
    "LseekOut",
    "NotifyDelete",
    "NotifyInvalEntry",
    "NotifyInvalInode",
    "OpenOut",
    "ProtocolError",
    "Reply",
    "Request",
    "StatfsOut",
    "UnknownOpcode",
    "WriteOut",
]


class ProtocolError(Exception):
    """A request is malformed (or outside our bounds).

    ``errno`` is what the dispatcher answers (``EINVAL`` for malformed bytes,
    ``ENAMETOOLONG``/``ERANGE``/``E2BIG`` for over-long names and values, ``ENOSYS`` for
    :class:`UnknownOpcode`); ``unique`` is the request's id when the header was readable
    (``None``: not even that, or 0 — the id of notifications, which no request may carry —:
    there is nobody to answer), ``opcode`` likewise.
    """

    def __init__(self, errno: int, message: str, unique: int | None = None, opcode: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.message = message
        self.unique = unique or None
        self.opcode = opcode

    def __str__(self) -> str:
        where = "" if self.unique is None else f" (unique {self.unique})"
        return f"{self.message}{where} [{_errno.errorcode.get(self.errno, self.errno)}]"


class UnknownOpcode(ProtocolError):
    """A well-formed header with an opcode we do not decode: answer ``ENOSYS`` (the kernel
    then stops sending it), distinguishable from malformed input."""

    def __init__(self, message: str, unique: int | None, opcode: int) -> None:
        super().__init__(_errno.ENOSYS, message, unique, opcode)


# ---------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InHeader:
    """``fuse_in_header`` without its extension length (extensions are skipped)."""

    len: int
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int


@dataclass(frozen=True, slots=True)
class Request:
    """Base of every request; ``OPCODE`` is the :class:`~sandbox.fuse.abi.Opcode`."""

    OPCODE: ClassVar[Opcode]
    header: InHeader


def _req(opcode: Opcode):
    def wrap(cls):
        cls.OPCODE = opcode
        return dataclass(frozen=True, slots=True)(cls)

    return wrap


@dataclass(frozen=True, slots=True)
class _ReadIn(Request):
    """The fields of ``fuse_read_in`` (shared by Read, Readdir, Readdirplus)."""

    fh: int
    offset: int
    size: int
    read_flags: int
    lock_owner: int
    flags: int


@dataclass(frozen=True, slots=True)
class _ReleaseIn(Request):
    """The fields of ``fuse_release_in`` (shared by Release, Releasedir)."""

    fh: int
    flags: int
    release_flags: int
    lock_owner: int


@dataclass(frozen=True, slots=True)
class _FsyncIn(Request):
    """The fields of ``fuse_fsync_in`` (shared by Fsync, Fsyncdir)."""

    fh: int
    fsync_flags: int


@dataclass(frozen=True, slots=True)
class _OpenIn(Request):
    """The fields of ``fuse_open_in`` (shared by Open, Opendir)."""

    flags: int
    open_flags: int


@dataclass(frozen=True, slots=True)
class _LkIn(Request):
    """The fields of ``fuse_lk_in, its lock flattened`` (shared by Getlk, Setlk, Setlkw)."""

    fh: int
    owner: int
    start: int
    end: int
    type: int
    pid: int
    lk_flags: int


@_req(Opcode.INIT)
class Init(Request):
    """``flags2`` is 0 unless the kernel set ``FUSE_INIT_EXT`` (then: bits 32..63)."""

    major: int
    minor: int
    max_readahead: int
    flags: int
    flags2: int


@_req(Opcode.LOOKUP)
class Lookup(Request):
    name: bytes


@_req(Opcode.FORGET)
class Forget(Request):
    nlookup: int


@_req(Opcode.BATCH_FORGET)
class BatchForget(Request):
    forgets: tuple[tuple[int, int], ...]


@_req(Opcode.GETATTR)
class Getattr(Request):
    getattr_flags: int
    fh: int


@_req(Opcode.SETATTR)
class Setattr(Request):
    valid: int
    fh: int
    size: int
    lock_owner: int
    atime: int
    mtime: int
    ctime: int
    atimensec: int
    mtimensec: int
    ctimensec: int
    mode: int
    uid: int
    gid: int


@_req(Opcode.READLINK)
class Readlink(Request):
    pass


@_req(Opcode.SYMLINK)
class Symlink(Request):
    name: bytes
    target: bytes


@_req(Opcode.MKNOD)
class Mknod(Request):
    mode: int
    rdev: int
    umask: int
    name: bytes


@_req(Opcode.MKDIR)
class Mkdir(Request):
    mode: int
    umask: int
    name: bytes


@_req(Opcode.UNLINK)
class Unlink(Request):
    name: bytes


@_req(Opcode.RMDIR)
class Rmdir(Request):
    name: bytes


@_req(Opcode.RENAME)
class Rename(Request):
    newdir: int
    oldname: bytes
    newname: bytes


@_req(Opcode.RENAME2)
class Rename2(Request):
    newdir: int
    flags: int
    oldname: bytes
    newname: bytes


@_req(Opcode.LINK)
class Link(Request):
    oldnodeid: int
    newname: bytes


@_req(Opcode.OPEN)
class Open(_OpenIn):
    pass


@_req(Opcode.CREATE)
class Create(Request):
    flags: int
    mode: int
    umask: int
    open_flags: int
    name: bytes


@_req(Opcode.READ)
class Read(_ReadIn):
    pass


@_req(Opcode.WRITE)
class Write(Request):
    """``len(data) == size`` (checked by the decoder)."""

    fh: int
    offset: int
    size: int
    write_flags: int
    lock_owner: int
    flags: int
    data: bytes | memoryview


@_req(Opcode.RELEASE)
class Release(_ReleaseIn):
    pass


@_req(Opcode.FLUSH)
class Flush(Request):
    fh: int
    lock_owner: int


@_req(Opcode.FSYNC)
class Fsync(_FsyncIn):
    pass


@_req(Opcode.OPENDIR)
class Opendir(_OpenIn):
    pass


@_req(Opcode.READDIR)
class Readdir(_ReadIn):
    pass


@_req(Opcode.READDIRPLUS)
class Readdirplus(_ReadIn):
    pass


@_req(Opcode.RELEASEDIR)
class Releasedir(_ReleaseIn):
    pass


@_req(Opcode.FSYNCDIR)
class Fsyncdir(_FsyncIn):
    pass


@_req(Opcode.STATFS)
class Statfs(Request):
    pass


@_req(Opcode.GETXATTR)
class Getxattr(Request):
    size: int
    name: bytes


@_req(Opcode.SETXATTR)
class Setxattr(Request):
    """``setxattr_flags`` is 0 unless ``FUSE_SETXATTR_EXT`` was negotiated (the decoder is
    told so); ``len(value) == size``."""

    size: int
    flags: int
    setxattr_flags: int
    name: bytes
    value: bytes | memoryview


@_req(Opcode.LISTXATTR)
class Listxattr(Request):
    size: int


@_req(Opcode.REMOVEXATTR)
class Removexattr(Request):
    name: bytes


@_req(Opcode.ACCESS)
class Access(Request):
    mask: int


@_req(Opcode.FALLOCATE)
class Fallocate(Request):
    fh: int
    offset: int
    length: int
    mode: int


@_req(Opcode.COPY_FILE_RANGE)
class CopyFileRange(Request):
    fh_in: int
    off_in: int
    nodeid_out: int
    fh_out: int
    off_out: int
    len: int
    flags: int


@_req(Opcode.LSEEK)
class Lseek(Request):
    fh: int
    offset: int
    whence: int


@_req(Opcode.GETLK)
class Getlk(_LkIn):
    pass


@_req(Opcode.SETLK)
class Setlk(_LkIn):
    pass


@_req(Opcode.SETLKW)
class Setlkw(_LkIn):
    pass


@_req(Opcode.INTERRUPT)
class Interrupt(Request):
    unique: int


@_req(Opcode.DESTROY)
class Destroy(Request):
    pass


#: opcode -> request class, for every opcode the codec decodes
REQUEST_TYPES: dict[int, type[Request]] = {
    cls.OPCODE: cls
    for cls in (
        Init, Lookup, Forget, BatchForget, Getattr, Setattr, Readlink, Symlink, Mknod, Mkdir, Unlink, Rmdir,
        Rename, Rename2, Link, Open, Create, Read, Write, Release, Flush, Fsync, Opendir, Readdir, Readdirplus,
        Releasedir, Fsyncdir, Statfs, Getxattr, Setxattr, Listxattr, Removexattr, Access, Fallocate,
        CopyFileRange, Lseek, Getlk, Setlk, Setlkw, Interrupt, Destroy,
    )
}
#: requests the kernel expects no reply to
NO_REPLY = frozenset({Opcode.FORGET, Opcode.BATCH_FORGET})

# ---------------------------------------------------------------------------------------
# Replies (encode_reply(unique, reply); ``None`` is the empty success reply)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FuseAttr:
    """``struct fuse_attr``."""

    ino: int
    size: int
    blocks: int
    atime: int
    mtime: int
    ctime: int
    atimensec: int
    mtimensec: int
    ctimensec: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    blksize: int
    flags: int = 0


@dataclass(frozen=True, slots=True)
class EntryOut:
    """LOOKUP, MKNOD, MKDIR, SYMLINK, LINK (and each READDIRPLUS entry)."""

    nodeid: int
    generation: int
    entry_valid: int
    attr_valid: int
    entry_valid_nsec: int
    attr_valid_nsec: int
    attr: FuseAttr


@dataclass(frozen=True, slots=True)
class AttrOut:
    """GETATTR, SETATTR."""

    attr_valid: int
    attr_valid_nsec: int
    attr: FuseAttr


@dataclass(frozen=True, slots=True)
class OpenOut:
    """OPEN, OPENDIR."""

    fh: int
    open_flags: int


@dataclass(frozen=True, slots=True)
class CreateOut:
    """CREATE: an entry and an open handle."""

    entry: EntryOut
    open: OpenOut


@dataclass(frozen=True, slots=True)
class WriteOut:
    """WRITE, COPY_FILE_RANGE."""

    size: int


@dataclass(frozen=True, slots=True)
class StatfsOut:
    """STATFS (``struct fuse_kstatfs``)."""

    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    bsize: int
    namelen: int
    frsize: int


@dataclass(frozen=True, slots=True)
class InitOut:
    """INIT. ``flags`` may carry bits 32..63 only with ``FUSE_INIT_EXT`` set (the encoder
    splits them into ``flags2``); ``flags2`` given separately is OR-ed in."""

    major: int
    minor: int
    max_readahead: int
    flags: int
    max_background: int
    congestion_threshold: int
    max_write: int
    time_gran: int
    max_pages: int
    flags2: int = 0
    map_alignment: int = 0


@dataclass(frozen=True, slots=True)
class GetxattrOut:
    """GETXATTR/LISTXATTR with ``size == 0``: the size the value/list needs."""

    size: int


@dataclass(frozen=True, slots=True)
class LseekOut:
    offset: int


@dataclass(frozen=True, slots=True)
class LkOut:
    """GETLK (``struct fuse_file_lock``)."""

    start: int
    end: int
    type: int
    pid: int


@dataclass(frozen=True, slots=True)
class Data:
    """A raw payload: READ, READLINK, GETXATTR/LISTXATTR with ``size > 0``, and the
    packed entries of READDIR/READDIRPLUS (see :class:`~sandbox.fuse.codec.DirentPacker`)."""

    data: bytes | bytearray | memoryview


Reply = (
    EntryOut | AttrOut | OpenOut | CreateOut | WriteOut | StatfsOut | InitOut | GetxattrOut | LseekOut | LkOut | Data
)

# ---------------------------------------------------------------------------------------
# Notifications (server -> kernel, unique 0): encode_notify(n)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NotifyInvalInode:
    """Drop cached attributes and the page cache range [off, off+len) (len <= 0: to the
    end; off < 0: attributes only)."""

    ino: int
    off: int = 0
    len: int = 0


@dataclass(frozen=True, slots=True)
class NotifyInvalEntry:
    """Drop the cached dentry ``name`` under ``parent`` (``FUSE_EXPIRE_ONLY`` in flags:
    only expire it)."""

    parent: int
    name: bytes
    flags: int = 0


@dataclass(frozen=True, slots=True)
class NotifyDelete:
    """``name`` under ``parent`` (inode ``child``) was deleted: drop the dentry."""

    parent: int
    child: int
    name: bytes


Notify = NotifyInvalInode | NotifyInvalEntry | NotifyDelete

# Every message class is built once or more per request: the cheaper __init__ of
# :func:`sandbox.frozen.fast_init` (the same fields and defaults, still frozen).
for _cls in list(globals().values()):
    if isinstance(_cls, type) and dataclasses.is_dataclass(_cls) and _cls.__module__ == __name__:
        fast_init(_cls)
del _cls
