"""The FUSE codec (sandbox.fuse.abi / messages / codec), checked against fuse.h.

No /dev/fuse here: captured real-kernel traffic comes with the transport (the mount
helper records fixtures from a real mount). The layout of every request and reply is
checked against an INDEPENDENT reference written in this file from
``include/uapi/linux/fuse.h`` (7.38): the opcodes, the flag values, and each
``fuse_*_in``/``fuse_*_out`` struct typed out again as a format string with its padding
spelled as explicit zero fields (nothing imported from :mod:`sandbox.fuse.abi` or the
codec's formats). So a layout bug that is symmetric in the codec cannot hide:

1. requests the reference builds decode to exactly the values it was built from
   (Hypothesis, every request type); the struct sizes are pinned to fuse.h's sizeof;
2. replies and notifications the codec encodes equal the reference's bytes, and the
   reference's decoder reads back the same values (Hypothesis, every reply type);
3. READDIR/READDIRPLUS packing read back by a reference parser (8-byte records).

Then bounds (every prefix of a valid request, lying lengths, long names, unknown
opcodes -> only ProtocolError), INIT negotiation, and encoder refusals.
"""

from __future__ import annotations

import ast
import errno
import struct
from dataclasses import astuple, fields, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sandbox.fuse import abi
from sandbox.fuse import messages as m
from sandbox.fuse.codec import (
    DirentPacker,
    ProtocolError,
    UnknownOpcode,
    decode_request,
    dirent_size,
    encode_error,
    encode_notify,
    encode_reply,
    negotiate_init,
)
from sandbox_sim.budget import scale

_SETTINGS = settings(max_examples=scale(40, 1000), deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------
# The reference, typed from fuse.h. Padding/unused/dummy fields appear as ``0`` in the
# field lists and are written as zeros.
# ---------------------------------------------------------------------------------------

IN_HEADER = "<IIQQIIIHH"  # len opcode unique nodeid uid gid pid total_extlen padding
OUT_HEADER = "<IiQ"  # len error unique
READ_IN = ("<QQIIQII", ["fh", "offset", "size", "read_flags", "lock_owner", "flags", 0])
RELEASE_IN = ("<QIIQ", ["fh", "flags", "release_flags", "lock_owner"])
FSYNC_IN = ("<QII", ["fh", "fsync_flags", 0])
OPEN_IN = ("<II", ["flags", "open_flags"])
LK_IN = ("<QQQQIIII", ["fh", "owner", "start", "end", "type", "pid", "lk_flags", 0])

# class name -> (opcode, fixed format, fixed fields, tail)
REF: dict[str, tuple[int, str, list, str]] = {
    "Lookup": (1, "<", [], "n"),
    "Forget": (2, "<Q", ["nlookup"], ""),
    "Getattr": (3, "<IIQ", ["getattr_flags", 0, "fh"], ""),
    "Setattr": (4, "<IIQQQQQQIIIIIIII", ["valid", 0, "fh", "size", "lock_owner", "atime", "mtime", "ctime",
                                         "atimensec", "mtimensec", "ctimensec", "mode", 0, "uid", "gid", 0], ""),
    "Readlink": (5, "<", [], ""),
    "Symlink": (6, "<", [], "nt"),
    "Mknod": (8, "<IIII", ["mode", "rdev", "umask", 0], "n"),
    "Mkdir": (9, "<II", ["mode", "umask"], "n"),
    "Unlink": (10, "<", [], "n"),
    "Rmdir": (11, "<", [], "n"),
    "Rename": (12, "<Q", ["newdir"], "nn"),
    "Link": (13, "<Q", ["oldnodeid"], "l"),
    "Open": (14, *OPEN_IN, ""),
    "Read": (15, *READ_IN, ""),
    "Write": (16, "<QQIIQII", ["fh", "offset", "size", "write_flags", "lock_owner", "flags", 0], "d"),
    "Statfs": (17, "<", [], ""),
    "Release": (18, *RELEASE_IN, ""),
    "Fsync": (20, *FSYNC_IN, ""),
    "Setxattr": (21, "<IIII", ["size", "flags", "setxattr_flags", 0], "xv"),
    "Getxattr": (22, "<II", ["size", 0], "x"),
    "Listxattr": (23, "<II", ["size", 0], ""),
    "Removexattr": (24, "<", [], "x"),
    "Flush": (25, "<QIIQ", ["fh", 0, 0, "lock_owner"], ""),
    "Opendir": (27, *OPEN_IN, ""),
    "Readdir": (28, *READ_IN, ""),
    "Releasedir": (29, *RELEASE_IN, ""),
    "Fsyncdir": (30, *FSYNC_IN, ""),
    "Getlk": (31, *LK_IN, ""),
    "Setlk": (32, *LK_IN, ""),
    "Setlkw": (33, *LK_IN, ""),
    "Access": (34, "<II", ["mask", 0], ""),
    "Create": (35, "<IIII", ["flags", "mode", "umask", "open_flags"], "n"),
    "Interrupt": (36, "<Q", ["unique"], ""),
    "Destroy": (38, "<", [], ""),
    "Fallocate": (43, "<QQQII", ["fh", "offset", "length", "mode", 0], ""),
    "Readdirplus": (44, *READ_IN, ""),
    "Rename2": (45, "<QII", ["newdir", "flags", 0], "nn"),
    "Lseek": (46, "<QQII", ["fh", "offset", "whence", 0], ""),
    "CopyFileRange": (47, "<QQQQQQQ", ["fh_in", "off_in", "nodeid_out", "fh_out", "off_out", "len", "flags"], ""),
}
SPECIAL = {"Init": 26, "BatchForget": 42}
TAIL_FIELDS = {"": [], "n": ["name"], "l": ["newname"], "nn": ["oldname", "newname"], "nt": ["name", "target"], "d": ["data"],
               "x": ["name"], "xv": ["name", "value"]}
# sizeof(struct fuse_<op>_in) from fuse.h
SIZEOF = {"Forget": 8, "Getattr": 16, "Setattr": 88, "Mknod": 16, "Mkdir": 8, "Rename": 8, "Rename2": 16, "Link": 8,
          "Open": 8, "Create": 16, "Read": 40, "Write": 40, "Release": 24, "Flush": 24, "Fsync": 16, "Setxattr": 16,
          "Getxattr": 8, "Listxattr": 8, "Access": 8, "Fallocate": 32, "CopyFileRange": 56, "Lseek": 24,
          "Getlk": 48, "Interrupt": 8}


def ref_body(r: m.Request, *, compat_setxattr: bool = False) -> bytes:
    name = type(r).__name__
    if name == "Init":
        return struct.pack("<IIIII44x", r.major, r.minor, r.max_readahead, r.flags, r.flags2)
    if name == "BatchForget":
        return struct.pack("<II", len(r.forgets), 0) + b"".join(struct.pack("<QQ", *f) for f in r.forgets)
    _, fmt, names, tail = REF[name]
    if name == "Setxattr" and compat_setxattr:
        fmt, names = "<II", ["size", "flags"]
    body = struct.pack(fmt, *[0 if f == 0 else getattr(r, f) for f in names])
    for f in TAIL_FIELDS[tail]:
        value = bytes(getattr(r, f))
        body += value if f in ("data", "value") else value + b"\0"
    return body


def ref_request(r: m.Request, *, compat_setxattr: bool = False, ext: bytes = b"") -> bytes:
    """The bytes the kernel would send for ``r`` (header.len recomputed)."""
    name = type(r).__name__
    opcode = SPECIAL.get(name) or REF[name][0]
    body = ref_body(r, compat_setxattr=compat_setxattr) + ext
    h = r.header
    return struct.pack(IN_HEADER, 40 + len(body), opcode, h.unique, h.nodeid, h.uid, h.gid, h.pid,
                       len(ext) // 8, 0) + body


def with_len(r: m.Request, wire: bytes) -> m.Request:
    return replace(r, header=replace(r.header, len=len(wire)))


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

U16, U32, U64 = st.integers(0, 2**16 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
_BY_CODE = {"Q": U64, "I": U32, "H": U16, "i": st.integers(-(2**31), 2**31 - 1)}
NAMES = st.binary(min_size=1, max_size=255).filter(lambda b: b"\0" not in b and b"/" not in b) | st.sampled_from(
    [b"a", b".", b"..", b"x" * 255, "é".encode(), b"\xff\xfe"])
TARGETS = st.binary(min_size=1, max_size=300).filter(lambda b: b"\0" not in b) | st.sampled_from(
    [b"/" * 4095, b"../x", b"a/b/c"])
XNAMES = st.binary(min_size=1, max_size=255).filter(lambda b: b"\0" not in b) | st.just(b"user." + b"z" * 250)
HEADERS = st.builds(m.InHeader, st.just(0), st.just(0), st.integers(1, 2**64 - 1), U64, U32, U32, U32)


def _fixed_strategies(fmt: str, names: list) -> dict:
    codes = [c for c in fmt[1:]]
    return {f: _BY_CODE[c] for f, c in zip(names, codes) if f != 0}


@st.composite
def requests(draw, name: str | None = None):
    name = name or draw(st.sampled_from(sorted([*REF, *SPECIAL])))
    cls = getattr(m, name)
    header = replace(draw(HEADERS), opcode=SPECIAL.get(name) or REF[name][0])
    if name == "Init":
        flags = draw(U32)
        flags2 = draw(U32) if flags & (1 << 30) else 0
        return cls(header, draw(U32), draw(U32), draw(U32), flags, flags2)
    if name == "BatchForget":
        return cls(header, tuple(draw(st.lists(st.tuples(U64, U64), max_size=40))))
    _, fmt, names, tail = REF[name]
    kw = {f: draw(s) for f, s in _fixed_strategies(fmt, names).items()}
    for f in TAIL_FIELDS[tail]:
        if f == "data":
            kw[f] = draw(st.binary(max_size=3000))
            kw["size"] = len(kw[f])
        elif f == "value":
            kw[f] = draw(st.binary(max_size=3000) | st.just(b"v" * 65536))
            kw["size"] = len(kw[f])
        elif f == "target":
            kw[f] = draw(TARGETS)
        elif tail in ("x", "xv"):
            kw[f] = draw(XNAMES)
        else:
            kw[f] = draw(NAMES)
    return cls(header, **kw)


ATTRS = st.builds(m.FuseAttr, U64, U64, U64, U64, U64, U64, *[U32] * 10)
ENTRIES = st.builds(m.EntryOut, U64, U64, U64, U64, U32, U32, ATTRS)
REPLIES = st.one_of(
    ENTRIES,
    st.builds(m.AttrOut, U64, U32, ATTRS),
    st.builds(m.OpenOut, U64, U32),
    st.builds(m.CreateOut, ENTRIES, st.builds(m.OpenOut, U64, U32)),
    st.builds(m.WriteOut, U32),
    st.builds(m.StatfsOut, U64, U64, U64, U64, U64, U32, U32, U32),
    st.builds(m.InitOut, U32, U32, U32, U32.map(lambda f: f | (1 << 30)), U16, U16, U32, U32, U16, U32, U16),
    st.builds(m.InitOut, U32, U32, U32, U32, U16, U16, U32, U32, U16),
    st.builds(m.GetxattrOut, U32),
    st.builds(m.LseekOut, U64),
    st.builds(m.LkOut, U64, U64, U32, U32),
    st.builds(m.Data, st.binary(max_size=5000)),
)

# reply type -> (format with explicit padding, field getter)
ATTR_FMT = "QQQQQQIIIIIIIIII"


def _attr(a):
    return [a.ino, a.size, a.blocks, a.atime, a.mtime, a.ctime, a.atimensec, a.mtimensec, a.ctimensec, a.mode,
            a.nlink, a.uid, a.gid, a.rdev, a.blksize, a.flags]


def _entry(e):
    return [e.nodeid, e.generation, e.entry_valid, e.attr_valid, e.entry_valid_nsec, e.attr_valid_nsec, *_attr(e.attr)]


REPLY_REF = {
    "EntryOut": ("<QQQQII" + ATTR_FMT, _entry),
    "AttrOut": ("<QII" + ATTR_FMT, lambda r: [r.attr_valid, r.attr_valid_nsec, 0, *_attr(r.attr)]),
    "OpenOut": ("<QII", lambda r: [r.fh, r.open_flags, 0]),
    "CreateOut": ("<QQQQII" + ATTR_FMT + "QII", lambda r: [*_entry(r.entry), r.open.fh, r.open.open_flags, 0]),
    "WriteOut": ("<II", lambda r: [r.size, 0]),
    "GetxattrOut": ("<II", lambda r: [r.size, 0]),
    "StatfsOut": ("<QQQQQIIII24x", lambda r: [r.blocks, r.bfree, r.bavail, r.files, r.ffree, r.bsize, r.namelen,
                                               r.frsize, 0]),
    "InitOut": ("<IIIIHHIIHHI28x", lambda r: [r.major, r.minor, r.max_readahead, r.flags & 0xFFFFFFFF,
                                              r.max_background, r.congestion_threshold, r.max_write, r.time_gran,
                                              r.max_pages, r.map_alignment, r.flags2 | (r.flags >> 32)]),
    "LseekOut": ("<Q", lambda r: [r.offset]),
    "LkOut": ("<QQII", lambda r: [r.start, r.end, r.type, r.pid]),
}
# sizeof(struct fuse_*_out) from fuse.h
REPLY_SIZEOF = {"EntryOut": 128, "AttrOut": 104, "OpenOut": 16, "CreateOut": 144, "WriteOut": 8, "GetxattrOut": 8,
                "StatfsOut": 80, "InitOut": 64, "LseekOut": 8, "LkOut": 24}


def ref_reply(unique: int, reply) -> bytes:
    name = type(reply).__name__
    if name == "Data":
        body = bytes(reply.data)
    else:
        fmt, get = REPLY_REF[name]
        body = struct.pack(fmt, *get(reply))
    return struct.pack(OUT_HEADER, 16 + len(body), 0, unique) + body


def ref_decode_reply(wire: bytes, cls: type):
    """Read a reply back into ``cls`` with the reference layouts (the inverse of ref_reply)."""
    length, err, unique = struct.unpack_from(OUT_HEADER, wire)
    assert length == len(wire) and err == 0
    body = wire[16:]
    if cls is m.Data:
        return unique, m.Data(body)
    fmt = REPLY_REF[cls.__name__][0]
    assert struct.calcsize(fmt) == len(body)
    v = list(struct.unpack(fmt, body))

    def attr(vs):
        return m.FuseAttr(*vs)

    if cls is m.EntryOut:
        return unique, m.EntryOut(*v[:6], attr(v[6:]))
    if cls is m.AttrOut:
        return unique, m.AttrOut(v[0], v[1], attr(v[3:]))
    if cls is m.CreateOut:
        return unique, m.CreateOut(m.EntryOut(*v[:6], attr(v[6:22])), m.OpenOut(v[22], v[23]))
    if cls in (m.OpenOut, m.StatfsOut):
        return unique, cls(*v[: len(fields(cls))])
    if cls is m.InitOut:
        return unique, m.InitOut(*v[:9], flags2=v[10], map_alignment=v[9])
    return unique, cls(*v[: len(fields(cls))])


def _normal_init(r):
    """An InitOut with its high flag bits moved to flags2 (how it reads back)."""
    if type(r) is not m.InitOut:
        return r
    flags = r.flags | (r.flags2 << 32)
    return replace(r, flags=flags & 0xFFFFFFFF, flags2=flags >> 32)


# ---------------------------------------------------------------------------------------
# ABI constants against the header
# ---------------------------------------------------------------------------------------

FUSE_H_OPCODES = {"LOOKUP": 1, "FORGET": 2, "GETATTR": 3, "SETATTR": 4, "READLINK": 5, "SYMLINK": 6, "MKNOD": 8,
                  "MKDIR": 9, "UNLINK": 10, "RMDIR": 11, "RENAME": 12, "LINK": 13, "OPEN": 14, "READ": 15,
                  "WRITE": 16, "STATFS": 17, "RELEASE": 18, "FSYNC": 20, "SETXATTR": 21, "GETXATTR": 22,
                  "LISTXATTR": 23, "REMOVEXATTR": 24, "FLUSH": 25, "INIT": 26, "OPENDIR": 27, "READDIR": 28,
                  "RELEASEDIR": 29, "FSYNCDIR": 30, "GETLK": 31, "SETLK": 32, "SETLKW": 33, "ACCESS": 34,
                  "CREATE": 35, "INTERRUPT": 36, "BMAP": 37, "DESTROY": 38, "IOCTL": 39, "POLL": 40,
                  "NOTIFY_REPLY": 41, "BATCH_FORGET": 42, "FALLOCATE": 43, "READDIRPLUS": 44, "RENAME2": 45,
                  "LSEEK": 46, "COPY_FILE_RANGE": 47, "SETUPMAPPING": 48, "REMOVEMAPPING": 49, "SYNCFS": 50,
                  "TMPFILE": 51, "CUSE_INIT": 4096}
FUSE_H_FLAGS = {"FUSE_ASYNC_READ": 0, "FUSE_POSIX_LOCKS": 1, "FUSE_ATOMIC_O_TRUNC": 3, "FUSE_EXPORT_SUPPORT": 4,
                "FUSE_BIG_WRITES": 5, "FUSE_DONT_MASK": 6, "FUSE_FLOCK_LOCKS": 10, "FUSE_AUTO_INVAL_DATA": 12,
                "FUSE_DO_READDIRPLUS": 13, "FUSE_READDIRPLUS_AUTO": 14, "FUSE_ASYNC_DIO": 15,
                "FUSE_WRITEBACK_CACHE": 16, "FUSE_PARALLEL_DIROPS": 18, "FUSE_HANDLE_KILLPRIV": 19,
                "FUSE_POSIX_ACL": 20, "FUSE_ABORT_ERROR": 21, "FUSE_MAX_PAGES": 22, "FUSE_CACHE_SYMLINKS": 23,
                "FUSE_NO_OPENDIR_SUPPORT": 24, "FUSE_EXPLICIT_INVAL_DATA": 25, "FUSE_HANDLE_KILLPRIV_V2": 28,
                "FUSE_SETXATTR_EXT": 29, "FUSE_INIT_EXT": 30, "FUSE_SECURITY_CTX": 32, "FUSE_HAS_EXPIRE_ONLY": 35,
                "FATTR_MODE": 0, "FATTR_UID": 1, "FATTR_GID": 2, "FATTR_SIZE": 3, "FATTR_ATIME": 4,
                "FATTR_MTIME": 5, "FATTR_FH": 6, "FATTR_ATIME_NOW": 7, "FATTR_MTIME_NOW": 8, "FATTR_LOCKOWNER": 9,
                "FATTR_CTIME": 10, "FATTR_KILL_SUIDGID": 11, "FOPEN_DIRECT_IO": 0, "FOPEN_KEEP_CACHE": 1,
                "FOPEN_NONSEEKABLE": 2, "FOPEN_CACHE_DIR": 3, "FOPEN_STREAM": 4, "FOPEN_NOFLUSH": 5,
                "RENAME_NOREPLACE": 0, "RENAME_EXCHANGE": 1, "RENAME_WHITEOUT": 2, "FUSE_WRITE_KILL_SUIDGID": 2,
                "FUSE_RELEASE_FLUSH": 0, "FUSE_GETATTR_FH": 0, "FUSE_FSYNC_FDATASYNC": 0, "FUSE_EXPIRE_ONLY": 0}


def test_abi_values_are_fuse_h():
    assert {op.name: op.value for op in abi.Opcode} == FUSE_H_OPCODES
    for name, bit in FUSE_H_FLAGS.items():
        assert getattr(abi, name) == 1 << bit, name
    assert (abi.KERNEL_VERSION, abi.FUSE_ROOT_ID) == (7, 1)
    assert 31 <= abi.KERNEL_MINOR_VERSION_MIN <= abi.KERNEL_MINOR_VERSION <= 38
    assert abi.REQUEST_BYTES_MAX == 40 + 40 + abi.MAX_WRITE_BYTES == 40 + 40 + (1 << 20)
    assert abi.READ_BUFFER_BYTES >= max(8192, 80 + abi.MAX_WRITE_BYTES)
    assert abi.MAX_PAGES * 4096 >= abi.MAX_WRITE_BYTES
    assert (abi.NotifyCode.INVAL_INODE, abi.NotifyCode.INVAL_ENTRY, abi.NotifyCode.DELETE) == (2, 3, 6)


def test_every_request_class_is_covered_and_named_by_its_opcode():
    assert set(m.REQUEST_TYPES) == {FUSE_H_OPCODES[n] for n in FUSE_H_OPCODES if n not in
                                    ("BMAP", "IOCTL", "POLL", "NOTIFY_REPLY", "SETUPMAPPING", "REMOVEMAPPING",
                                     "SYNCFS", "TMPFILE", "CUSE_INIT")}
    for op, cls in m.REQUEST_TYPES.items():
        assert cls.__name__ == "".join(p.capitalize() for p in abi.Opcode(op).name.split("_"))
        assert fields(cls)[0].name == "header"
    assert {*REF, *SPECIAL} == {cls.__name__ for cls in m.REQUEST_TYPES.values()}


def test_reference_layouts_have_fuse_h_sizes():
    for name, size in SIZEOF.items():
        assert struct.calcsize(REF[name][1]) == size, name
    for name, size in REPLY_SIZEOF.items():
        assert struct.calcsize(REPLY_REF[name][0]) == size, name
    assert struct.calcsize(IN_HEADER) == 40 and struct.calcsize(OUT_HEADER) == 16
    assert struct.calcsize("<" + ATTR_FMT) == 88  # fuse_attr


def test_codec_modules_import_nothing_of_ours_but_each_other():
    """… and the leaf ``sandbox.frozen`` (the messages' cheaper ``__init__``), which itself
    imports nothing but the standard library."""
    pkg = Path(__file__).resolve().parent.parent / "sandbox" / "fuse"
    leaf = ast.parse((pkg.parent / "frozen.py").read_text())
    assert all(not isinstance(n, ast.ImportFrom) or (n.level == 0 and not (n.module or "").startswith("sandbox"))
               for n in ast.walk(leaf))
    for mod in ("abi", "messages", "codec"):
        tree = ast.parse((pkg / f"{mod}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 2:
                    assert node.module == "frozen", (mod, node.module)
                elif node.level:
                    assert node.module in (None, "abi", "messages", "codec"), (mod, node.module)
                else:
                    assert not (node.module or "").startswith("sandbox"), (mod, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("sandbox") for a in node.names), mod


# ---------------------------------------------------------------------------------------
# Requests: the reference encodes, the codec decodes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted([*REF, *SPECIAL]))
@_SETTINGS
@given(data=st.data())
def test_reference_requests_decode_to_their_values(name, data):
    r = data.draw(requests(name))
    wire = ref_request(r)
    ext = name == "Setxattr"  # the reference sends the FUSE_SETXATTR_EXT layout
    got = decode_request(wire, setxattr_ext=ext)
    assert got == with_len(r, wire)
    assert type(got) is type(r)
    assert decode_request(bytearray(wire), setxattr_ext=ext) == got == decode_request(memoryview(wire),
                                                                                      setxattr_ext=ext)


@_SETTINGS
@given(r=requests("Setxattr"))
def test_setxattr_compat_and_ext_layouts(r):
    wire = ref_request(replace(r, setxattr_flags=0), compat_setxattr=True)
    assert decode_request(wire) == with_len(replace(r, setxattr_flags=0), wire)
    wire = ref_request(r)
    assert decode_request(wire, setxattr_ext=True) == with_len(r, wire)


def _hdr(opcode: int, body: bytes, unique: int = 9, extlen: int = 0) -> bytes:
    return struct.pack(IN_HEADER, 40 + len(body), opcode, unique, 1, 1000, 1000, 42, extlen, 0) + body


def test_hand_assembled_vectors():
    # LOOKUP "hello" under the root, as bytes written out by hand
    wire = bytes.fromhex("2e000000" "01000000" "0700000000000000" "0100000000000000" "e8030000" "e8030000"
                         "2a000000" "0000" "0000") + b"hello\0"
    assert decode_request(wire) == m.Lookup(m.InHeader(46, 1, 7, 1, 1000, 1000, 42), b"hello")
    # WRITE of "abc" at offset 5 to fh 3
    wire = _hdr(16, struct.pack("<QQIIQII", 3, 5, 3, 0, 0, 0o2, 0) + b"abc")
    w = decode_request(wire)
    assert (type(w), w.fh, w.offset, w.size, w.flags, bytes(w.data)) == (m.Write, 3, 5, 3, 0o2, b"abc")
    # an error reply: ENOENT to unique 7
    assert encode_error(7, errno.ENOENT) == bytes.fromhex("10000000" "feffffff" "0700000000000000")
    # INIT from a 7.31 kernel: the 16-byte fuse_init_in of that time, flags2 absent
    i = decode_request(_hdr(26, struct.pack("<IIII", 7, 31, 131072, 1 << 30)))
    assert (i.major, i.minor, i.max_readahead, i.flags, i.flags2) == (7, 31, 131072, 1 << 30, 0)


def test_extensions_are_skipped():
    r = m.Lookup(m.InHeader(0, 1, 5, 1, 0, 0, 0), b"name")
    wire = ref_request(r, ext=struct.pack("<II", 8, 32) + bytes(8))
    assert decode_request(wire).name == b"name"
    with pytest.raises(ProtocolError) as e:
        decode_request(_hdr(1, b"x\0", extlen=200))
    assert e.value.errno == errno.EINVAL and e.value.unique == 9


def test_write_data_is_a_view_only_of_immutable_buffers():
    wire = _hdr(16, struct.pack("<QQIIQII", 3, 0, 2, 0, 0, 0, 0) + b"ab")
    assert isinstance(decode_request(wire).data, memoryview)
    buf = bytearray(wire)
    w = decode_request(buf)
    buf[-2:] = b"zz"  # the transport reuses its buffer
    assert bytes(w.data) == b"ab"
    mv = memoryview(bytearray(wire))
    w = decode_request(mv)
    mv[-1] = 0
    assert bytes(w.data) == b"ab"


# ---------------------------------------------------------------------------------------
# Bounds: only ProtocolError, with the right errno
# ---------------------------------------------------------------------------------------


def _err(buf, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        decode_request(buf, **kw)
    return e.value


def test_bounds_errnos():
    assert _err(b"").unique is None
    # unique 0 is the notifications' id: no reply could name such a request, so nobody is
    # answered (a reply encoded for it would raise) — malformed or not; FORGETs need none
    zero = _hdr(1, b"hello\0", unique=0)
    assert _err(zero).unique is None and _err(zero + b"\0").unique is None
    assert decode_request(_hdr(2, struct.pack("<Q", 1), unique=0)).header.unique == 0
    assert _err(bytes(39)).errno == errno.EINVAL
    good = _hdr(1, b"hello\0")
    assert (_err(good + b"\0").errno, _err(good + b"\0").unique) == (errno.EINVAL, 9)  # len != buffer
    assert _err(good[:-1]).errno == errno.EINVAL
    big = _hdr(16, struct.pack("<QQIIQII", 0, 0, abi.MAX_WRITE_BYTES + 1, 0, 0, 0, 0) + bytes(abi.MAX_WRITE_BYTES + 1))
    assert len(big) == abi.REQUEST_BYTES_MAX + 1 and _err(big).errno == errno.EINVAL
    full = _hdr(16, struct.pack("<QQIIQII", 0, 0, abi.MAX_WRITE_BYTES, 0, 0, 0, 0) + bytes(abi.MAX_WRITE_BYTES))
    assert len(decode_request(full).data) == abi.MAX_WRITE_BYTES
    assert _err(_hdr(3, bytes(15))).errno == errno.EINVAL  # short fuse_getattr_in
    assert _err(_hdr(3, bytes(17))).errno == errno.EINVAL  # trailing byte
    assert _err(_hdr(1, b"hello")).errno == errno.EINVAL  # no NUL
    assert _err(_hdr(1, b"\0")).errno == errno.EINVAL  # empty name
    assert _err(_hdr(1, b"a/b\0")).errno == errno.EINVAL
    assert _err(_hdr(1, b"a\0b")).errno == errno.EINVAL  # trailing bytes after the name
    assert decode_request(_hdr(1, b"n" * 255 + b"\0")).name == b"n" * 255
    assert _err(_hdr(1, b"n" * 256 + b"\0")).errno == errno.ENAMETOOLONG
    assert _err(_hdr(1, b"n" * 5000)).errno == errno.ENAMETOOLONG
    assert decode_request(_hdr(6, b"l\0" + b"t" * 4095 + b"\0")).target == b"t" * 4095
    assert _err(_hdr(6, b"l\0" + b"t" * 4096 + b"\0")).errno == errno.ENAMETOOLONG
    assert _err(_hdr(6, b"l\0")).errno == errno.EINVAL  # target missing
    assert _err(_hdr(22, struct.pack("<II", 0, 0) + b"x" * 256 + b"\0")).errno == errno.ERANGE
    assert _err(_hdr(21, struct.pack("<II", 65537, 0) + b"user.a\0" + bytes(65537))).errno == errno.E2BIG
    assert _err(_hdr(21, struct.pack("<II", 3, 0) + b"user.a\0ab")).errno == errno.EINVAL
    assert _err(_hdr(16, struct.pack("<QQIIQII", 0, 0, 4, 0, 0, 0, 0) + b"abc")).errno == errno.EINVAL
    assert _err(_hdr(16, struct.pack("<QQ", 0, 0))).errno == errno.EINVAL  # short fuse_write_in
    assert _err(_hdr(42, struct.pack("<II", 2, 0) + bytes(16))).errno == errno.EINVAL  # count lies
    assert _err(_hdr(26, bytes(20))).errno == errno.EINVAL  # neither 16 nor 64 bytes


@pytest.mark.parametrize("opcode", [0, 7, 19, 37, 39, 40, 41, 48, 49, 50, 51, 52, 4096, 2**32 - 1])
def test_unknown_opcodes_are_enosys_not_malformed(opcode):
    e = _err(_hdr(opcode, b"whatever"))
    assert isinstance(e, UnknownOpcode) and e.errno == errno.ENOSYS and (e.unique, e.opcode) == (9, opcode)
    e = _err(_hdr(opcode, b"x")[:-1])  # a broken frame is malformed first
    assert not isinstance(e, UnknownOpcode) and e.errno == errno.EINVAL


@_SETTINGS
@given(r=requests(), data=st.data())
def test_every_prefix_of_a_valid_request_is_a_protocol_error(r, data):
    wire = ref_request(r)
    cuts = data.draw(st.lists(st.integers(0, len(wire) - 1), min_size=1, max_size=30, unique=True))
    for cut in [*cuts, len(wire) - 1, 40, 39]:
        if cut < 0 or cut >= len(wire):
            continue
        prefix = wire[:cut]
        with pytest.raises(ProtocolError):  # the header's len no longer matches
            decode_request(prefix)
        if cut < 40:
            continue
        fixed = struct.pack("<I", cut) + prefix[4:]  # len fixed up: the body is what is short
        if type(r) is m.Init and cut == 56:
            assert decode_request(fixed).flags2 == 0  # the pre-7.36 fuse_init_in
            continue
        with pytest.raises(ProtocolError) as e:
            decode_request(fixed, setxattr_ext=type(r) is m.Setxattr)
        assert e.value.unique == r.header.unique and not isinstance(e.value, UnknownOpcode)


@_SETTINGS
@given(raw=st.binary(max_size=600))
@example(raw=b"")
def test_random_bytes_raise_only_protocol_errors(raw):
    try:
        decode_request(raw)
    except ProtocolError:
        pass


@_SETTINGS
@given(opcode=st.sampled_from(sorted(m.REQUEST_TYPES)), body=st.binary(max_size=400), extlen=st.integers(0, 3))
def test_random_bodies_with_a_right_length_raise_only_protocol_errors(opcode, body, extlen):
    try:
        r = decode_request(_hdr(opcode, body, extlen=extlen))
    except ProtocolError as e:
        assert e.unique == 9 and e.errno in (errno.EINVAL, errno.ENAMETOOLONG, errno.ERANGE, errno.E2BIG)
        return
    assert type(r).OPCODE == opcode


# ---------------------------------------------------------------------------------------
# Replies: the codec encodes, byte for byte the reference
# ---------------------------------------------------------------------------------------


@_SETTINGS
@given(unique=st.integers(1, 2**64 - 1), reply=REPLIES)
def test_replies_match_the_reference_and_read_back(unique, reply):
    wire = encode_reply(unique, reply)
    assert wire == ref_reply(unique, reply)
    got_unique, back = ref_decode_reply(wire, type(reply))
    assert got_unique == unique
    assert back == _normal_init(reply) if type(reply) is not m.Data else bytes(back.data) == bytes(reply.data)


def test_empty_reply_and_errors():
    assert encode_reply(5, None) == struct.pack(OUT_HEADER, 16, 0, 5)
    for e in (1, errno.ENOSYS, 511):
        assert encode_error(2**64 - 1, e) == struct.pack(OUT_HEADER, 16, -e, 2**64 - 1)
    for bad in (0, -1, 512, 4095):
        with pytest.raises(ValueError):
            encode_error(1, bad)
    for unique in (0, -1, 2**64):
        with pytest.raises(ValueError):
            encode_reply(unique, None)
        with pytest.raises(ValueError):
            encode_error(unique, 1)


@pytest.mark.parametrize("reply", [
    m.WriteOut(2**32), m.WriteOut(-1), m.OpenOut(2**64, 0), m.LkOut(0, 0, 0, 2**32),
    m.InitOut(7, 38, 0, 0, 2**16, 0, 0, 0, 0), m.InitOut(7, 38, 0, 1 << 32, 0, 0, 0, 0, 0),
    m.InitOut(7, 38, 0, 0, 0, 0, 0, 0, 0, flags2=1),
])
def test_out_of_range_replies_are_value_errors(reply):
    with pytest.raises(ValueError):
        encode_reply(1, reply)


def test_not_a_reply_is_a_type_error():
    with pytest.raises(TypeError):
        encode_reply(1, m.Forget(m.InHeader(0, 2, 1, 1, 0, 0, 0), 1))
    with pytest.raises(TypeError):
        encode_reply(1, m.Data("text"))


@_SETTINGS
@given(parent=U64, child=U64, name=NAMES, flags=st.sampled_from([0, 1]), ino=U64,
       off=st.integers(-(2**63), 2**63 - 1), length=st.integers(-(2**63), 2**63 - 1))
def test_notifications_match_the_reference(parent, child, name, flags, ino, off, length):
    assert encode_notify(m.NotifyInvalInode(ino, off, length)) == struct.pack(OUT_HEADER, 40, 2, 0) + struct.pack(
        "<Qqq", ino, off, length)
    assert encode_notify(m.NotifyInvalEntry(parent, name, flags)) == struct.pack(
        OUT_HEADER, 16 + 16 + len(name) + 1, 3, 0) + struct.pack("<QII", parent, len(name), flags) + name + b"\0"
    assert encode_notify(m.NotifyDelete(parent, child, name)) == struct.pack(
        OUT_HEADER, 16 + 24 + len(name) + 1, 6, 0) + struct.pack("<QQII", parent, child, len(name), 0) + name + b"\0"


@pytest.mark.parametrize("name", [b"", b"a/b", b"a\0b", b"x" * 256])
def test_notify_refuses_names_the_kernel_would(name):
    with pytest.raises(ValueError):
        encode_notify(m.NotifyInvalEntry(1, name))


# ---------------------------------------------------------------------------------------
# READDIR / READDIRPLUS
# ---------------------------------------------------------------------------------------


def ref_parse_dirents(buf: bytes, plus: bool) -> list:
    """fuse.h's FUSE_DIRENT_SIZE / FUSE_DIRENTPLUS_SIZE walk, as the kernel's parse_dirfile."""
    out, pos = [], 0
    head = 128 + 24 if plus else 24
    while pos < len(buf):
        entry = struct.unpack_from("<QQQQII" + ATTR_FMT, buf, pos) if plus else None
        ino, off, namelen, typ = struct.unpack_from("<QQII", buf, pos + head - 24)
        name = buf[pos + head: pos + head + namelen]
        size = (head + namelen + 7) & ~7
        assert buf[pos + head + namelen: pos + size] == bytes(size - head - namelen)  # zero padding
        out.append((ino, off, typ, name, entry))
        pos += size
    assert pos == len(buf)
    return out


DIRENTS = st.lists(st.tuples(U64, U64, st.integers(0, 15), NAMES), max_size=60)


@_SETTINGS
@given(entries=DIRENTS, size=st.integers(0, 9000), plus=st.booleans(), data=st.data())
def test_dirent_packer_against_the_reference(entries, size, plus, data):
    p = DirentPacker(size, plus)
    added, stopped = [], False
    for ino, off, typ, name in entries:
        entry = data.draw(ENTRIES | st.none()) if plus else None
        before = len(p)
        said = p.fits(len(name.encode("utf-8", "surrogateescape") if isinstance(name, str) else name))
        fits = p.add(ino, off, typ, name, entry)
        assert said == fits  # what READDIR asks before it looks an entry up
        assert fits == (before + dirent_size(len(name), plus) <= size)
        if not fits:
            assert len(p) == before
            stopped = True
            break
        added.append((ino, off, typ, name, entry))
    out = p.bytes()
    assert len(out) <= size and len(out) % 8 == 0 and p.count == len(added)
    parsed = ref_parse_dirents(out, plus)
    assert [e[:4] for e in parsed] == [e[:4] for e in added]
    if plus:
        for (*_, got), (*_, want) in zip(parsed, added):
            assert got == tuple(_entry(want)) if want is not None else got[0] == 0
    assert stopped or len(added) == len(entries)


@_SETTINGS
@given(entries=st.lists(st.tuples(U64, U64, st.integers(0, 15), NAMES, ENTRIES), max_size=30),
       size=st.integers(0, 9000))
def test_dirent_packer_add_entry_packs_what_add_packs(entries, size):
    """``add_entry`` (a READDIRPLUS entry's fuse_entry_out as its field values, what the
    dispatcher packs per listed name) gives the bytes, counts and stops ``add`` gives."""
    a, b = DirentPacker(size, True), DirentPacker(size, True)
    for ino, off, typ, name, entry in entries:
        values = (entry.nodeid, entry.generation, entry.entry_valid, entry.attr_valid, entry.entry_valid_nsec,
                  entry.attr_valid_nsec, *astuple(entry.attr))
        assert a.add(ino, off, typ, name, entry) == b.add_entry(ino, off, typ, name, values)
    assert a.bytes() == b.bytes() and a.count == b.count
    with pytest.raises(ValueError):
        DirentPacker(4096, False).add_entry(1, 1, 8, b"f", values if entries else (0,) * 22)
    with pytest.raises(ValueError):
        DirentPacker(4096, True).add_entry(1, 1, 8, b"f", (0,) * 21)
    with pytest.raises(ValueError):
        DirentPacker(4096, True).add_entry(1, 1, 8, b"a/b", (0,) * 22)


def test_dirent_sizes():
    assert [dirent_size(n, False) for n in (1, 8, 9, 255)] == [32, 32, 40, 280]
    assert [dirent_size(n, True) for n in (1, 8, 9, 255)] == [160, 160, 168, 408]
    p = DirentPacker(4096, False)
    assert p.add(1, 1, 4, ".") and p.add(1, 2, 4, "..") and p.add(5, 3, 8, "é")
    with pytest.raises(ValueError):
        p.add(1, 4, 8, b"a/b")
    with pytest.raises(ValueError):
        p.add(1, 4, 8, b"ok", m.EntryOut(0, 0, 0, 0, 0, 0, m.FuseAttr(*[0] * 15)))


# ---------------------------------------------------------------------------------------
# INIT negotiation
# ---------------------------------------------------------------------------------------


def _init(minor=38, flags=0, flags2=0, readahead=131072):
    return m.Init(m.InHeader(104, 26, 1, 0, 0, 0, 0), 7, minor, readahead, flags, flags2)


@_SETTINGS
@given(offered=U32, offered2=U32, wanted=st.integers(0, 2**64 - 1))
def test_negotiation_grants_only_what_both_sides_have(offered, offered2, wanted):
    r = negotiate_init(_init(flags=offered, flags2=offered2), wanted)
    granted = r.flags | (r.flags2 << 32)
    kernel = offered | ((offered2 << 32) if offered & abi.FUSE_INIT_EXT else 0)
    assert granted & ~abi.FUSE_INIT_EXT == wanted & kernel & ~abi.FUSE_INIT_EXT
    assert bool(granted & abi.FUSE_INIT_EXT) == bool(offered & abi.FUSE_INIT_EXT)
    assert (r.major, r.minor, r.time_gran) == (7, abi.KERNEL_MINOR_VERSION, 1)
    if granted & abi.FUSE_MAX_PAGES:
        assert (r.max_write, r.max_pages) == (abi.MAX_WRITE_BYTES, abi.MAX_WRITE_BYTES // 4096)
    else:
        assert r.max_write == 32 * 4096 and r.max_pages == 0
    encode_reply(1, r)  # always encodable


def test_negotiation_limits():
    ext = abi.FUSE_INIT_EXT | abi.FUSE_MAX_PAGES
    r = negotiate_init(_init(flags=ext, flags2=1), abi.FUSE_SECURITY_CTX | abi.FUSE_MAX_PAGES,
                       max_readahead=1 << 30, max_write=65536 + 1)
    assert r.flags2 == 1 and r.max_readahead == 131072 and (r.max_write, r.max_pages) == (65537, 17)
    with pytest.raises(ProtocolError) as e:
        negotiate_init(_init(minor=30), 0)
    assert e.value.errno == errno.EPROTO
    with pytest.raises(ProtocolError):
        negotiate_init(replace(_init(), major=8), 0)
    with pytest.raises(ValueError):
        negotiate_init(_init(), 0, max_write=abi.MAX_WRITE_BYTES + 1)


def test_the_fuse_doc_says_the_code_s_limits():
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "fuse.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([\d,]+) \|", doc, re.M))
    assert len(rows) >= 10
    for name, value in rows.items():
        assert getattr(abi, name) == int(value.replace(",", "")), name
    assert f"Protocol 7.{abi.KERNEL_MINOR_VERSION}" in doc and f"older than 7.{abi.KERNEL_MINOR_VERSION_MIN}" in doc


def test_requests_captured_from_a_real_kernel_decode():
    """fixtures/fuse/linux-6.18-requests.hex: a Linux 6.18 kernel's requests (see its README)."""
    path = Path(__file__).resolve().parent.parent / "fixtures" / "fuse" / "linux-6.18-requests.hex"
    wires = [bytes.fromhex(line) for line in path.read_text().split()]
    decoded, unknown = [], []
    for w in wires:
        try:
            decoded.append(decode_request(w, setxattr_ext=True))  # the probe granted SETXATTR_EXT
        except UnknownOpcode as e:  # e.g. an IOCTL: answered ENOSYS
            unknown.append(e.opcode)
    assert set(unknown) <= {abi.Opcode.IOCTL, abi.Opcode.POLL, abi.Opcode.BMAP}, unknown
    wires = [w for w in wires if struct.unpack_from("<I", w, 4)[0] not in unknown]
    init = decoded[0]
    assert type(init) is m.Init and init.major == 7 and init.minor >= 31 and init.flags & abi.FUSE_INIT_EXT
    out = negotiate_init(init, abi.FUSE_MAX_PAGES | abi.FUSE_SETXATTR_EXT | abi.FUSE_DO_READDIRPLUS)
    assert out.max_pages == 256 and out.flags & abi.FUSE_SETXATTR_EXT
    kinds = {type(r).__name__ for r in decoded}
    assert {"Lookup", "Getattr", "Mkdir", "Create", "Write", "Symlink", "Readdirplus", "Setxattr", "Getxattr",
            "Rename", "Statfs", "Fallocate", "Lseek", "Unlink", "Release", "Flush"} <= kinds, kinds
    for r, wire in zip(decoded, wires):
        assert r.header.len == len(wire)
        assert ref_request(r) == wire, type(r).__name__  # the reference writes the kernel's bytes
        if type(r) is m.Write:
            assert bytes(r.data) == b"x" * r.size
        if type(r) is m.Setxattr:
            assert (r.name, bytes(r.value)) == (b"user.k", b"val")
