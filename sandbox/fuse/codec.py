"""Sans-I/O FUSE codec: one whole request in, one typed request out; replies to bytes.

No descriptors, no asyncio, no state: the transport reads ``/dev/fuse`` (one request per
``read``, a buffer of :data:`~sandbox.fuse.abi.READ_BUFFER_BYTES`) and writes what these
functions return (one reply per ``write``)::

    request = decode_request(buf)            # bytes -> Request (or ProtocolError)
    wire = encode_reply(unique, reply)       # AttrOut/EntryOut/.../Data/None -> bytes
    wire = encode_error(unique, errno)       # out header with -errno
    wire = encode_notify(NotifyInvalInode(ino))

Invariants:

* **Only ProtocolError escapes decode_request.** Whatever the bytes, it returns a
  :class:`~sandbox.fuse.messages.Request` or raises
  :class:`~sandbox.fuse.messages.ProtocolError` -- never IndexError, struct.error,
  UnicodeError or MemoryError. ``ProtocolError.unique`` is set whenever the 40-byte header
  was readable, so the dispatcher can answer ``-errno`` and carry on;
  :class:`~sandbox.fuse.messages.UnknownOpcode` (``ENOSYS``) is a well-formed request we
  do not decode, every other ProtocolError is malformed input.
* **Every size is bounded before it is used.** The header's ``len`` equals the buffer's
  length and is at most :data:`~sandbox.fuse.abi.REQUEST_BYTES_MAX`; a fixed struct must
  be exactly present; names end in their NUL, are 1..255 bytes with no ``/``
  (ENAMETOOLONG beyond), xattr names 1..255 (ERANGE), symlink targets 1..4095
  (ENAMETOOLONG), xattr values at most 65536 (E2BIG) and exactly ``size``; a WRITE's data
  is exactly ``size`` bytes, at most MAX_WRITE_BYTES; no trailing bytes. Extension bytes
  (``total_extlen``; only sent for features we never negotiate) are skipped, bounded.
* **Encoders refuse what the kernel would reject.** Out-of-range integers, a reply or
  error to ``unique`` 0 (reserved for notifications), an errno outside 1..511, names the
  kernel would refuse -> ``ValueError``.
* ``decode_request(reference_encoding(r)) == r`` for every valid request ``r`` (the
  tests' encoder is written separately from fuse.h).

Table-driven: each request class has one precompiled :class:`struct.Struct` for its fixed
``fuse_<op>_in`` part (padding as ``x``, so it is neither read nor stored) and a tail
kind for its variable part.
"""

from __future__ import annotations

import errno as E
import struct
from collections.abc import Callable

from . import abi
from . import messages as m
from .abi import (
    IN_HEADER_SIZE,
    MAX_WRITE_BYTES,
    NAME_BYTES_MAX,
    OUT_HEADER_SIZE,
    REQUEST_BYTES_MAX,
    SYMLINK_TARGET_BYTES_MAX,
    XATTR_NAME_BYTES_MAX,
    XATTR_VALUE_BYTES_MAX,
    Opcode,
)
from .messages import ProtocolError, UnknownOpcode

__all__ = [
    "DirentPacker",
    "ProtocolError",
    "UnknownOpcode",
    "decode_request",
    "dirent_size",
    "encode_error",
    "encode_notify",
    "encode_reply",
    "encode_reply_parts",
    "negotiate_init",
]

_IN_HEADER = struct.Struct("<IIQQIIIHH")
_OUT_HEADER = struct.Struct("<IiQ")
_U64 = 0xFFFFFFFFFFFFFFFF

# ---------------------------------------------------------------------------------------
# Request layouts: class -> (fixed part, tail kind)
#
# Tail kinds: ""   nothing after the fixed part
#             "n"  one file name + NUL              "nn" two names (RENAME/RENAME2)
#             "nt" name + NUL, target + NUL         "d"  data: the rest, == size (WRITE)
#             "x"  xattr name + NUL                 "xv" xattr name + NUL, value == size
# ---------------------------------------------------------------------------------------

_READ_IN = "QQIIQI4x"  # fuse_read_in (also READDIR, READDIRPLUS)
_RELEASE_IN = "QIIQ"
_FSYNC_IN = "QI4x"
_OPEN_IN = "II"
_LK_IN = "QQQQIII4x"  # fh, owner, fuse_file_lock{start, end, type, pid}, lk_flags

_LAYOUT: dict[type[m.Request], tuple[str, str]] = {
    m.Lookup: ("", "n"),
    m.Forget: ("Q", ""),
    m.Getattr: ("I4xQ", ""),
    m.Setattr: ("I4xQQQQQQIIII4xII4x", ""),
    m.Readlink: ("", ""),
    m.Symlink: ("", "nt"),
    m.Mknod: ("III4x", "n"),
    m.Mkdir: ("II", "n"),
    m.Unlink: ("", "n"),
    m.Rmdir: ("", "n"),
    m.Rename: ("Q", "nn"),
    m.Rename2: ("QI4x", "nn"),
    m.Link: ("Q", "n"),
    m.Open: (_OPEN_IN, ""),
    m.Create: ("IIII", "n"),
    m.Read: (_READ_IN, ""),
    m.Write: (_READ_IN, "d"),
    m.Release: (_RELEASE_IN, ""),
    m.Flush: ("Q8xQ", ""),
    m.Fsync: (_FSYNC_IN, ""),
    m.Opendir: (_OPEN_IN, ""),
    m.Readdir: (_READ_IN, ""),
    m.Readdirplus: (_READ_IN, ""),
    m.Releasedir: (_RELEASE_IN, ""),
    m.Fsyncdir: (_FSYNC_IN, ""),
    m.Statfs: ("", ""),
    m.Getxattr: ("I4x", "x"),
    m.Setxattr: ("III4x", "xv"),  # the FUSE_SETXATTR_EXT layout; the compat one is "II"
    m.Listxattr: ("I4x", ""),
    m.Removexattr: ("", "x"),
    m.Access: ("I4x", ""),
    m.Fallocate: ("QQQI4x", ""),
    m.CopyFileRange: ("QQQQQQQ", ""),
    m.Lseek: ("QQI4x", ""),
    m.Getlk: (_LK_IN, ""),
    m.Setlk: (_LK_IN, ""),
    m.Setlkw: (_LK_IN, ""),
    m.Interrupt: ("Q", ""),
    m.Destroy: ("", ""),
}
_SETXATTR_COMPAT = struct.Struct("<II")  # fuse_setxattr_in before 7.33 / without SETXATTR_EXT
_INIT_IN = struct.Struct("<IIII")  # major, minor, max_readahead, flags
_INIT_IN_SIZES = (16, 64)  # before 7.36 / sizeof(struct fuse_init_in) since
_BATCH_FORGET_IN = struct.Struct("<I4x")
_FORGET_ONE = struct.Struct("<QQ")


class _Ctx:
    """What one decode knows for its error messages."""

    __slots__ = ("opcode", "unique")

    def __init__(self, unique: int, opcode: int) -> None:
        self.unique = unique
        self.opcode = opcode

    def error(self, errno: int, message: str) -> ProtocolError:
        name = Opcode(self.opcode).name
        return ProtocolError(errno, f"{name}: {message}", self.unique, self.opcode)


def _cstring(buf, pos: int, end: int, limit: int, too_long: int, what: str, ctx: _Ctx) -> tuple[bytes, int]:
    """The NUL-terminated string at ``pos``: (its bytes without the NUL, position after it)."""
    nul = buf.find(b"\0", pos, min(end, pos + limit + 1))
    if nul < 0:
        if end - pos > limit:
            raise ctx.error(too_long, f"{what} longer than {limit} bytes")
        raise ctx.error(E.EINVAL, f"{what} without its NUL")
    if nul == pos:
        raise ctx.error(E.EINVAL, f"empty {what}")
    return bytes(buf[pos:nul]), nul + 1


def _name(buf, pos: int, end: int, ctx: _Ctx, what: str = "name") -> tuple[bytes, int]:
    name, pos = _cstring(buf, pos, end, NAME_BYTES_MAX, E.ENAMETOOLONG, what, ctx)
    if b"/" in name:
        raise ctx.error(E.EINVAL, f"{what} {name[:40]!r} contains '/'")
    return name, pos


def _tail(kind: str, buf, pos: int, end: int, fixed: tuple, ctx: _Ctx) -> tuple:
    """Decode a tail of ``kind`` that must end exactly at ``end``."""
    if kind == "d":
        size = fixed[2]
        if size > MAX_WRITE_BYTES:
            raise ctx.error(E.EINVAL, f"size {size} > {MAX_WRITE_BYTES}")
        if end - pos != size:
            raise ctx.error(E.EINVAL, f"size {size} but {end - pos} data bytes")
        if isinstance(buf, bytes) or (isinstance(buf, memoryview) and buf.readonly):
            return (memoryview(buf)[pos:end],)  # immutable: a view is safe and free
        return (bytes(buf[pos:end]),)
    if kind == "xv":
        size = fixed[0]
        name, pos = _cstring(buf, pos, end, XATTR_NAME_BYTES_MAX, E.ERANGE, "xattr name", ctx)
        if size > XATTR_VALUE_BYTES_MAX:
            raise ctx.error(E.E2BIG, f"value of {size} bytes > {XATTR_VALUE_BYTES_MAX}")
        if end - pos != size:
            raise ctx.error(E.EINVAL, f"size {size} but {end - pos} value bytes")
        return name, bytes(buf[pos:end])
    out: list[bytes] = []
    for i, part in enumerate(kind):
        if part == "n":
            value, pos = _name(buf, pos, end, ctx, ("oldname", "newname")[i] if kind == "nn" else "name")
        elif part == "t":
            value, pos = _cstring(buf, pos, end, SYMLINK_TARGET_BYTES_MAX, E.ENAMETOOLONG, "target", ctx)
        else:  # "x"
            value, pos = _cstring(buf, pos, end, XATTR_NAME_BYTES_MAX, E.ERANGE, "xattr name", ctx)
        out.append(value)
    if pos != end:
        raise ctx.error(E.EINVAL, f"{end - pos} trailing bytes")
    return tuple(out)


_Decoder = Callable[[object, int, int, m.InHeader, _Ctx, bool], m.Request]


def _make_decoder(cls: type[m.Request], codes: str, kind: str) -> _Decoder:
    fixed = struct.Struct("<" + codes)
    size = fixed.size

    if not kind:

        def decode(buf, pos, end, header, ctx, ext):
            if end - pos != size:
                raise ctx.error(E.EINVAL, f"body of {end - pos} bytes, expected {size}")
            return cls(header, *fixed.unpack_from(buf, pos))

    elif kind == "n":  # one name after the struct (LOOKUP, UNLINK, RMDIR, MKDIR, CREATE, ...):
        # what _tail("n", ...) does, without its loop and the list it builds

        def decode(buf, pos, end, header, ctx, ext):
            if end - pos < size:
                raise ctx.error(E.EINVAL, f"body of {end - pos} bytes, shorter than its {size}-byte struct")
            name, after = _name(buf, pos + size, end, ctx)
            if after != end:
                raise ctx.error(E.EINVAL, f"{end - after} trailing bytes")
            if size:
                return cls(header, *fixed.unpack_from(buf, pos), name)
            return cls(header, name)

    else:

        def decode(buf, pos, end, header, ctx, ext):
            if end - pos < size:
                raise ctx.error(E.EINVAL, f"body of {end - pos} bytes, shorter than its {size}-byte struct")
            values = fixed.unpack_from(buf, pos)
            return cls(header, *values, *_tail(kind, buf, pos + size, end, values, ctx))

    return decode


def _decode_setxattr(buf, pos, end, header, ctx, ext):
    if ext:
        return _DECODERS[Opcode.SETXATTR.value](buf, pos, end, header, ctx, ext)
    size = _SETXATTR_COMPAT.size
    if end - pos < size:
        raise ctx.error(E.EINVAL, f"body of {end - pos} bytes, shorter than its {size}-byte struct")
    vsize, flags = _SETXATTR_COMPAT.unpack_from(buf, pos)
    name, value = _tail("xv", buf, pos + size, end, (vsize,), ctx)
    return m.Setxattr(header, vsize, flags, 0, name, value)


def _decode_init(buf, pos, end, header, ctx, ext):
    if end - pos not in _INIT_IN_SIZES:
        raise ctx.error(E.EINVAL, f"body of {end - pos} bytes, expected one of {_INIT_IN_SIZES}")
    major, minor, max_readahead, flags = _INIT_IN.unpack_from(buf, pos)
    flags2 = 0
    if end - pos > 16 and flags & abi.FUSE_INIT_EXT:
        (flags2,) = struct.unpack_from("<I", buf, pos + 16)
    return m.Init(header, major, minor, max_readahead, flags, flags2)


def _decode_batch_forget(buf, pos, end, header, ctx, ext):
    if end - pos < _BATCH_FORGET_IN.size:
        raise ctx.error(E.EINVAL, f"body of {end - pos} bytes, shorter than its 8-byte struct")
    (count,) = _BATCH_FORGET_IN.unpack_from(buf, pos)
    pos += _BATCH_FORGET_IN.size
    if end - pos != count * _FORGET_ONE.size:
        raise ctx.error(E.EINVAL, f"count {count} but {end - pos} bytes of entries")
    return m.BatchForget(header, tuple(_FORGET_ONE.iter_unpack(buf[pos:end])))


_DECODERS: dict[int, _Decoder] = {
    cls.OPCODE.value: _make_decoder(cls, codes, kind) for cls, (codes, kind) in _LAYOUT.items()
}
_DISPATCH: dict[int, _Decoder] = dict(_DECODERS)
_DISPATCH[Opcode.SETXATTR.value] = _decode_setxattr
_DISPATCH[Opcode.INIT.value] = _decode_init
_DISPATCH[Opcode.BATCH_FORGET.value] = _decode_batch_forget
assert set(_DISPATCH) == set(m.REQUEST_TYPES), "every request class has a decoder"


_NO_REPLY_OPCODES = frozenset(op.value for op in m.NO_REPLY)
_WRITE_OPCODE = Opcode.WRITE.value


def decode_request(buf: bytes | bytearray | memoryview, *, setxattr_ext: bool = False) -> m.Request:
    """One request read from ``/dev/fuse`` -> its :class:`~sandbox.fuse.messages.Request`.

    ``setxattr_ext``: ``FUSE_SETXATTR_EXT`` was negotiated (SETXATTR then carries the
    16-byte ``fuse_setxattr_in``, otherwise the 8-byte compat one). A WRITE's ``data`` is a
    view into ``buf`` when ``buf`` is immutable (``bytes``, a read-only view), otherwise a
    copy.
    Raises :class:`ProtocolError` (only) for anything malformed; see the module invariants.
    """
    if isinstance(buf, memoryview) and not (buf.c_contiguous and buf.format == "B"):
        buf = buf.tobytes()
    n = len(buf)
    if n < IN_HEADER_SIZE:
        raise ProtocolError(E.EINVAL, f"request of {n} bytes, shorter than its {IN_HEADER_SIZE}-byte header")
    length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = _IN_HEADER.unpack_from(buf, 0)
    if length != n:
        raise ProtocolError(E.EINVAL, f"header len {length} but {n} bytes read", unique, opcode)
    if unique == 0 and opcode not in _NO_REPLY_OPCODES:  # no reply can name it: nobody to answer
        raise ProtocolError(E.EINVAL, "a request with unique 0 (the id of notifications)", None, opcode)
    if n > REQUEST_BYTES_MAX:
        raise ProtocolError(E.EINVAL, f"request of {n} bytes > {REQUEST_BYTES_MAX}", unique, opcode)
    end = n - 8 * extlen
    if end < IN_HEADER_SIZE:
        raise ProtocolError(E.EINVAL, f"{8 * extlen} extension bytes overrun the request", unique, opcode)
    decode = _DISPATCH.get(opcode)
    if decode is None:
        try:
            name = Opcode(opcode).name
        except ValueError:
            name = "unknown"
        raise UnknownOpcode(f"opcode {opcode} ({name}) not supported", unique, opcode)
    if opcode != _WRITE_OPCODE and isinstance(buf, memoryview):
        buf = buf.tobytes()  # names need .find(); such requests are small
    header = m.InHeader(length, opcode, unique, nodeid, uid, gid, pid)
    return decode(buf, IN_HEADER_SIZE, end, header, _Ctx(unique, opcode), setxattr_ext)


# ---------------------------------------------------------------------------------------
# INIT negotiation
# ---------------------------------------------------------------------------------------


def negotiate_init(
    init: m.Init,
    wanted: int,
    *,
    max_write: int = MAX_WRITE_BYTES,
    max_readahead: int | None = None,
    max_background: int = abi.DEFAULT_MAX_BACKGROUND,
    congestion_threshold: int = abi.DEFAULT_CONGESTION_THRESHOLD,
    time_gran: int = abi.TIME_GRAN_NS,
) -> m.InitOut:
    """The INIT reply granting ``wanted & offered`` (flags as one 64-bit set).

    Refuses (``ProtocolError(EPROTO)``) a major other than 7 or a minor below
    :data:`~sandbox.fuse.abi.KERNEL_MINOR_VERSION_MIN`. ``FUSE_INIT_EXT`` is answered
    whenever the kernel offered it (so bits 32..63 can be granted). With ``FUSE_MAX_PAGES``
    granted, ``max_pages`` covers ``max_write``; without it the kernel caps requests at 32
    pages, so ``max_write`` is capped to match. ``max_readahead`` never exceeds the
    kernel's.
    """
    ctx = _Ctx(init.header.unique, Opcode.INIT)
    if init.major != abi.KERNEL_VERSION or init.minor < abi.KERNEL_MINOR_VERSION_MIN:
        raise ctx.error(E.EPROTO, f"kernel speaks {init.major}.{init.minor}, we need "
                                  f"{abi.KERNEL_VERSION}.{abi.KERNEL_MINOR_VERSION_MIN} or later")
    if not abi.PAGE_SIZE <= max_write <= MAX_WRITE_BYTES:
        raise ValueError(f"max_write {max_write} outside {abi.PAGE_SIZE}..{MAX_WRITE_BYTES}")
    offered = init.flags
    if offered & abi.FUSE_INIT_EXT:
        offered |= init.flags2 << 32
    granted = wanted & offered & ~abi.FUSE_INIT_EXT
    if offered & abi.FUSE_INIT_EXT:
        granted |= abi.FUSE_INIT_EXT
    else:
        granted &= 0xFFFFFFFF
    if granted & abi.FUSE_MAX_PAGES:
        max_pages = -(-max_write // abi.PAGE_SIZE)
    else:
        max_pages = 0
        max_write = min(max_write, abi.DEFAULT_MAX_PAGES * abi.PAGE_SIZE)
    readahead = init.max_readahead if max_readahead is None else min(max_readahead, init.max_readahead)
    return m.InitOut(abi.KERNEL_VERSION, abi.KERNEL_MINOR_VERSION, readahead, granted & 0xFFFFFFFF,
                     max_background, congestion_threshold, max_write, time_gran, max_pages, granted >> 32)


# ---------------------------------------------------------------------------------------
# Replies
# ---------------------------------------------------------------------------------------

_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr (88)
_ENTRY = struct.Struct("<QQQQII" + _ATTR.format[1:])  # fuse_entry_out (128)
_ATTR_OUT = struct.Struct("<QI4x" + _ATTR.format[1:])  # fuse_attr_out (104)
_OPEN_OUT = struct.Struct("<QI4x")
_WRITE_OUT = struct.Struct("<I4x")  # also fuse_getxattr_out
_STATFS_OUT = struct.Struct("<QQQQQIII4x24x")  # fuse_kstatfs (80)
_INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")  # fuse_init_out (64)
_LSEEK_OUT = struct.Struct("<Q")
_LK_OUT = struct.Struct("<QQII")
_DIRENT = struct.Struct("<QQII")  # fuse_dirent without its name (24)
_INVAL_INODE = struct.Struct("<Qqq")
_INVAL_ENTRY = struct.Struct("<QII")
_DELETE = struct.Struct("<QQI4x")


def _attr_values(a: m.FuseAttr) -> tuple:
    return (a.ino, a.size, a.blocks, a.atime, a.mtime, a.ctime, a.atimensec, a.mtimensec, a.ctimensec, a.mode,
            a.nlink, a.uid, a.gid, a.rdev, a.blksize, a.flags)


def _entry_values(e: m.EntryOut) -> tuple:
    return (e.nodeid, e.generation, e.entry_valid, e.attr_valid, e.entry_valid_nsec, e.attr_valid_nsec,
            *_attr_values(e.attr))


def _pack(s: struct.Struct, *values) -> bytes:
    try:
        return s.pack(*values)
    except struct.error as exc:
        raise ValueError(f"reply field out of range: {exc}") from None


def _init_values(r: m.InitOut) -> tuple:
    flags = r.flags | (r.flags2 << 32)
    if flags >> 32 and not flags & abi.FUSE_INIT_EXT:
        raise ValueError("INIT flags above bit 31 need FUSE_INIT_EXT")
    return (r.major, r.minor, r.max_readahead, flags & 0xFFFFFFFF, r.max_background, r.congestion_threshold,
            r.max_write, r.time_gran, r.max_pages, r.map_alignment, flags >> 32)


def _body(reply: m.Reply | None) -> bytes | bytearray | memoryview:
    if reply is None:
        return b""
    t = type(reply)
    if t is m.Data:
        data = reply.data
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"Data.data must be bytes-like, not {type(data).__name__}")
        return data
    if t is m.AttrOut:
        return _pack(_ATTR_OUT, reply.attr_valid, reply.attr_valid_nsec, *_attr_values(reply.attr))
    if t is m.EntryOut:
        return _pack(_ENTRY, *_entry_values(reply))
    if t is m.OpenOut:
        return _pack(_OPEN_OUT, reply.fh, reply.open_flags)
    if t is m.CreateOut:
        return _pack(_ENTRY, *_entry_values(reply.entry)) + _pack(_OPEN_OUT, reply.open.fh, reply.open.open_flags)
    if t is m.WriteOut or t is m.GetxattrOut:
        return _pack(_WRITE_OUT, reply.size)
    if t is m.StatfsOut:
        return _pack(_STATFS_OUT, reply.blocks, reply.bfree, reply.bavail, reply.files, reply.ffree, reply.bsize,
                     reply.namelen, reply.frsize)
    if t is m.InitOut:
        return _pack(_INIT_OUT, *_init_values(reply))
    if t is m.LseekOut:
        return _pack(_LSEEK_OUT, reply.offset)
    if t is m.LkOut:
        return _pack(_LK_OUT, reply.start, reply.end, reply.type, reply.pid)
    raise TypeError(f"not a FUSE reply: {t.__name__}")


def _check_unique(unique: int) -> None:
    if not isinstance(unique, int) or not 0 < unique <= _U64:
        raise ValueError(f"unique {unique!r} outside 1..2**64-1 (0 is for notifications)")


def encode_reply(unique: int, reply: m.Reply | None) -> bytes:
    """The whole reply to request ``unique``: out header (error 0) + the reply's struct
    (``None``: header only, for requests whose success carries nothing)."""
    header, body = encode_reply_parts(unique, reply)
    return header + body


def encode_reply_parts(unique: int, reply: m.Reply | None) -> tuple[bytes, bytes | bytearray | memoryview]:
    """:func:`encode_reply` as (out header, body) not joined: a :class:`~.messages.Data`
    body is the payload itself, so a transport that scatters it (virtio-fs) copies it once."""
    _check_unique(unique)
    body = _body(reply)
    return _OUT_HEADER.pack(OUT_HEADER_SIZE + len(body), 0, unique), body


def encode_error(unique: int, errno: int) -> bytes:
    """The error reply: an out header alone with ``error = -errno`` (1 <= errno <= 511)."""
    _check_unique(unique)
    if not isinstance(errno, int) or not 0 < errno <= abi.ERRNO_MAX:
        raise ValueError(f"errno {errno!r} outside 1..{abi.ERRNO_MAX}")
    return _OUT_HEADER.pack(OUT_HEADER_SIZE, -errno, unique)


def _name_bytes(name: bytes | str) -> bytes:
    """A file name to send: 1..255 bytes, no NUL, no ``/`` (``str`` via surrogateescape)."""
    if isinstance(name, str):
        name = name.encode("utf-8", "surrogateescape")
    elif not isinstance(name, bytes):
        raise TypeError(f"a name must be bytes or str, not {type(name).__name__}")
    if not 0 < len(name) <= NAME_BYTES_MAX or b"\0" in name or b"/" in name:
        raise ValueError(f"bad name {name[:40]!r}: 1..{NAME_BYTES_MAX} bytes, no NUL or '/'")
    return name


def encode_notify(notify: m.Notify) -> bytes:
    """A notification for the kernel: unique 0, ``error`` = the notify code."""
    t = type(notify)
    if t is m.NotifyInvalInode:
        code, body = abi.NotifyCode.INVAL_INODE, _pack(_INVAL_INODE, notify.ino, notify.off, notify.len)
    elif t is m.NotifyInvalEntry:
        name = _name_bytes(notify.name)
        code, body = abi.NotifyCode.INVAL_ENTRY, _pack(_INVAL_ENTRY, notify.parent, len(name), notify.flags) + name
        body += b"\0"
    elif t is m.NotifyDelete:
        name = _name_bytes(notify.name)
        code, body = abi.NotifyCode.DELETE, _pack(_DELETE, notify.parent, notify.child, len(name)) + name + b"\0"
    else:
        raise TypeError(f"not a FUSE notification: {t.__name__}")
    return _OUT_HEADER.pack(OUT_HEADER_SIZE + len(body), code, 0) + body


# ---------------------------------------------------------------------------------------
# READDIR / READDIRPLUS
# ---------------------------------------------------------------------------------------


def dirent_size(namelen: int, plus: bool) -> int:
    """Bytes one entry takes: ``FUSE_DIRENT_SIZE`` / ``FUSE_DIRENTPLUS_SIZE`` (8-aligned)."""
    head = abi.DIRENTPLUS_HEADER_SIZE if plus else abi.DIRENT_HEADER_SIZE
    return (head + namelen + 7) & ~7


_ENTRY_DIRENT = struct.Struct(_ENTRY.format + _DIRENT.format[1:])  # fuse_direntplus without its name (152)
_ZEROS = bytes(8)
_NO_ENTRY = m.EntryOut(0, 0, 0, 0, 0, 0, m.FuseAttr(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
_ENTRY_FIELDS = len(_entry_values(_NO_ENTRY))  # 6 of fuse_entry_out's own, 16 of its fuse_attr


class DirentPacker:
    """Packs directory entries for one READDIR (``plus=False``) or READDIRPLUS reply.

    Holds at most ``min(size, READDIR_BYTES_MAX)`` bytes: :meth:`add` returns False, and
    packs nothing, when the next entry does not fit (the caller stops there and resumes
    from that entry's offset next time). Each entry is ``fuse_dirent`` (ino, off, namelen,
    type) + the name, zero-padded to 8 bytes; READDIRPLUS puts a ``fuse_entry_out`` first
    (an ``entry`` of None sends nodeid 0: the kernel then takes no lookup reference).
    ``off`` is the cookie the kernel passes back to continue *after* this entry.
    """

    __slots__ = ("_buf", "_limit", "count", "plus")

    def __init__(self, size: int, plus: bool) -> None:
        if size < 0:
            raise ValueError(f"size {size} < 0")
        self._limit = min(size, abi.READDIR_BYTES_MAX)
        self._buf = bytearray()
        self.plus = plus
        self.count = 0

    def add(self, ino: int, off: int, type: int, name: bytes | str, entry: m.EntryOut | None = None) -> bool:
        """Append one entry if it fits; ``type`` is the DT_* value (``mode >> 12 & 15``)."""
        if entry is not None and not self.plus:
            raise ValueError("an entry_out only goes into READDIRPLUS")
        return self._add(ino, off, type, _name_bytes(name),
                         _entry_values(entry if entry is not None else _NO_ENTRY) if self.plus else None)

    def add_entry(self, ino: int, off: int, type: int, name: bytes | str, entry_values: tuple) -> bool:
        """:meth:`add` of a READDIRPLUS entry whose ``fuse_entry_out`` is given as its 22 field
        values in the struct's order (an ``EntryOut``'s, then its ``FuseAttr``'s, ``flags``
        last): the same bytes, with no message objects built per entry only to be taken
        apart again (a directory's listing packs one per name)."""
        if not self.plus:
            raise ValueError("an entry_out only goes into READDIRPLUS")
        if len(entry_values) != _ENTRY_FIELDS:
            raise ValueError(f"an entry_out has {_ENTRY_FIELDS} fields, not {len(entry_values)}")
        return self._add(ino, off, type, _name_bytes(name), entry_values)

    def _add(self, ino: int, off: int, type: int, name: bytes, entry_values: tuple | None) -> bool:
        size = dirent_size(len(name), self.plus)
        buf = self._buf
        if len(buf) + size > self._limit:
            return False
        if entry_values is not None:  # fuse_entry_out and fuse_dirent in one pack
            head = _pack(_ENTRY_DIRENT, *entry_values, ino, off, len(name), type)
        else:
            head = _pack(_DIRENT, ino, off, len(name), type)
        buf += head
        buf += name
        buf += _ZEROS[: size - len(head) - len(name)]  # to the 8-byte boundary
        self.count += 1
        return True

    def fits(self, namelen: int) -> bool:
        """Whether an entry with a name of ``namelen`` bytes still fits (what :meth:`add`
        would find): the caller can stop before looking the entry up."""
        return len(self._buf) + dirent_size(namelen, self.plus) <= self._limit

    def __len__(self) -> int:
        return len(self._buf)

    def bytes(self) -> bytes:
        """The packed entries (the READDIR reply's payload: ``Data(packer.bytes())``)."""
        return bytes(self._buf)
