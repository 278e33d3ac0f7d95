"""The 9P2000.L codec (sandbox.ninep.messages / codec) and the test client's framing.

No sockets except the small socketpair tests of :mod:`sandbox.ninep.client` at the end.

The layout of every message is checked three ways, so a bug that is symmetric in
encode/decode cannot hide behind the round trip:

1. ``KERNEL`` below transcribes, independently of the code under test, the type number
   and the ``p9pdu_readf``/``writef`` format of every message from the Linux client
   (include/net/9p/9p.h, net/9p/client.c, net/9p/protocol.c; composite letters expanded:
   'A' = Rgetattr's "qQdugqqqqqqqqqqqqqqq", 'I' = Tsetattr's "ddugqqqqq", 'u'/'g' = 'd').
2. A naive reference encoder (``_ref_frame``), written letter by letter from that table,
   must produce exactly the codec's bytes for random values, and the codec must decode
   them back (Hypothesis, every message type).
3. Hand-assembled byte vectors pin the reference encoder itself.

Then bounds: truncation at every cut, bad sizes, unknown types, trailing bytes, nwname
17, counts that lie; fuzzing (arbitrary and mutated frames raise only ProtocolError, and
any frame decode accepts re-encodes to the same bytes); FrameSplitter under arbitrary
chunking; directory-entry packing.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from dataclasses import fields

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sandbox.ninep import messages as m
from sandbox.ninep.client import Client, NinePError
from sandbox.ninep.codec import FrameSplitter, ProtocolError, decode, encode
from sandbox.ninep.messages import (
    MESSAGE_TYPES,
    Dirent,
    Qid,
    pack_dirents,
    unpack_dirents,
)
from sandbox_sim.budget import scale

_SETTINGS = settings(max_examples=scale(40, 1000), deadline=None, suppress_health_check=[HealthCheck.too_slow])

# name -> (type byte, kernel wire format). T = nwname[2] + nwname strings, R = nwqid[2] +
# nwqid qids, D = count[4] + count bytes, Q = qid[13], s = len[2] + bytes.
KERNEL = {
    "Rlerror": (7, "d"),
    "Tstatfs": (8, "d"),
    "Rstatfs": (9, "ddqqqqqqd"),
    "Tlopen": (12, "dd"),
    "Rlopen": (13, "Qd"),
    "Tlcreate": (14, "dsddd"),
    "Rlcreate": (15, "Qd"),
    "Tsymlink": (16, "dssd"),
    "Rsymlink": (17, "Q"),
    "Tmknod": (18, "dsdddd"),
    "Rmknod": (19, "Q"),
    "Trename": (20, "dds"),
    "Rrename": (21, ""),
    "Treadlink": (22, "d"),
    "Rreadlink": (23, "s"),
    "Tgetattr": (24, "dq"),
    "Rgetattr": (25, "qQdddqqqqqqqqqqqqqqq"),
    "Tsetattr": (26, "d" + "dddd" + "qqqqq"),
    "Rsetattr": (27, ""),
    "Txattrwalk": (30, "dds"),
    "Rxattrwalk": (31, "q"),
    "Txattrcreate": (32, "dsqd"),
    "Rxattrcreate": (33, ""),
    "Treaddir": (40, "dqd"),
    "Rreaddir": (41, "D"),
    "Tfsync": (50, "dd"),
    "Rfsync": (51, ""),
    "Tlock": (52, "dbdqqds"),
    "Rlock": (53, "b"),
    "Tgetlock": (54, "dbqqds"),
    "Rgetlock": (55, "bqqds"),
    "Tlink": (70, "dds"),
    "Rlink": (71, ""),
    "Tmkdir": (72, "dsdd"),
    "Rmkdir": (73, "Q"),
    "Trenameat": (74, "dsds"),
    "Rrenameat": (75, ""),
    "Tunlinkat": (76, "dsd"),
    "Runlinkat": (77, ""),
    "Tversion": (100, "ds"),
    "Rversion": (101, "ds"),
    "Tauth": (102, "dssd"),
    "Rauth": (103, "Q"),
    "Tattach": (104, "ddssd"),
    "Rattach": (105, "Q"),
    "Tflush": (108, "w"),
    "Rflush": (109, ""),
    "Twalk": (110, "ddT"),
    "Rwalk": (111, "R"),
    "Tread": (116, "dqd"),
    "Rread": (117, "D"),
    "Twrite": (118, "dqD"),
    "Rwrite": (119, "d"),
    "Tclunk": (120, "d"),
    "Rclunk": (121, ""),
    "Tremove": (122, "d"),
    "Rremove": (123, ""),
}

ALL_CLASSES = sorted(MESSAGE_TYPES.values(), key=lambda c: c.TYPE)


def _ref_frame(type_: int, tag: int, fmt: str, values: list) -> bytes:
    """Reference encoder: one struct.pack per letter, as the kernel's p9pdu_writef."""
    body = b""
    for letter, v in zip(fmt, values, strict=True):
        if letter in "bwdq":
            body += struct.pack("<" + {"b": "B", "w": "H", "d": "I", "q": "Q"}[letter], v)
        elif letter == "s":
            raw = v.encode("utf-8", "surrogateescape")
            body += struct.pack("<H", len(raw)) + raw
        elif letter == "Q":
            body += struct.pack("<B", v.type) + struct.pack("<I", v.version) + struct.pack("<Q", v.path)
        elif letter == "T":
            body += struct.pack("<H", len(v))
            for name in v:
                raw = name.encode("utf-8", "surrogateescape")
                body += struct.pack("<H", len(raw)) + raw
        elif letter == "R":
            body += struct.pack("<H", len(v))
            for q in v:
                body += struct.pack("<BIQ", q.type, q.version, q.path)
        elif letter == "D":
            body += struct.pack("<I", len(v)) + v
        else:
            raise AssertionError(letter)
    return struct.pack("<IBH", 7 + len(body), type_, tag) + body


# -- strategies ----------------------------------------------------------------------

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)
# Linux names are bytes: carry arbitrary ones through surrogateescape, plus real text.
names = st.one_of(
    st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.text(max_size=20),
)
qids = st.builds(Qid, u8, u32, u64)
LETTER = {
    "b": u8,
    "w": u16,
    "d": u32,
    "q": u64,
    "s": names,
    "Q": qids,
    "T": st.lists(names, max_size=16).map(tuple),
    "R": st.lists(qids, max_size=16).map(tuple),
    "D": st.binary(max_size=300),
}


def message_strategy(cls: type[m.Message]) -> st.SearchStrategy:
    return st.tuples(*[LETTER[c] for c in KERNEL[cls.__name__][1]]).map(lambda vs: cls(*vs))


any_message = st.sampled_from(ALL_CLASSES).flatmap(message_strategy)


def sample(cls: type[m.Message]) -> m.Message:
    """A fixed, non-trivial instance of ``cls`` (non-empty strings, names, data)."""
    values = {
        "b": 3,
        "w": 0x1234,
        "d": 0xDEADBEEF,
        "q": 0x0102030405060708,
        "s": "n\udcffme",
        "Q": Qid(m.QT_DIR, 7, 99),
        "T": ("a", "bc", "d\udce9"),
        "R": (Qid(0, 1, 2), Qid(m.QT_DIR, 3, 4)),
        "D": b"payload",
    }
    return cls(*[values[c] for c in KERNEL[cls.__name__][1]])


# -- the table itself -----------------------------------------------------------------


def test_every_kernel_message_is_implemented_with_its_kernel_layout():
    assert {c.__name__ for c in ALL_CLASSES} == set(KERNEL)
    for cls in ALL_CLASSES:
        type_, fmt = KERNEL[cls.__name__]
        assert (cls.TYPE, cls.WIRE) == (type_, fmt), cls.__name__
        assert MESSAGE_TYPES[type_] is cls
        assert len(fields(cls)) == len(fmt)


def test_constants_match_the_kernel():
    assert (m.SETATTR_ATIME_SET, m.SETATTR_MTIME_SET) == (1 << 7, 1 << 8)  # not 0x100/0x200
    assert (m.SETATTR_MODE, m.SETATTR_UID, m.SETATTR_GID, m.SETATTR_SIZE) == (1, 2, 4, 8)
    assert (m.SETATTR_ATIME, m.SETATTR_MTIME, m.SETATTR_CTIME) == (0x10, 0x20, 0x40)
    assert (m.GETATTR_BASIC, m.GETATTR_ALL, m.GETATTR_DATA_VERSION) == (0x7FF, 0x3FFF, 0x2000)
    assert (m.DOTL_CREATE, m.DOTL_EXCL, m.DOTL_TRUNC, m.DOTL_APPEND) == (0o100, 0o200, 0o1000, 0o2000)
    assert (m.DOTL_DIRECTORY, m.DOTL_NOFOLLOW, m.DOTL_SYNC) == (0o200000, 0o400000, 0o4000000)
    assert (m.NOTAG, m.NOFID, m.HEADER_SIZE, m.IOHDRSZ, m.WALK_NAMES_MAX) == (0xFFFF, 0xFFFFFFFF, 7, 24, 16)
    assert m.AT_REMOVEDIR == 0x200


# -- round trip + differential against the reference encoder ---------------------------


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
@_SETTINGS
@given(data=st.data())
def test_round_trip_matches_reference_encoder(cls, data):
    tag = data.draw(u16, label="tag")
    msg = data.draw(message_strategy(cls), label="msg")
    frame = encode(tag, msg)
    type_, fmt = KERNEL[cls.__name__]
    assert frame == _ref_frame(type_, tag, fmt, [getattr(msg, f.name) for f in fields(msg)])
    assert decode(frame) == (tag, msg)
    assert decode(bytearray(frame)) == (tag, msg)
    assert decode(memoryview(frame)) == (tag, msg)


@_SETTINGS
@given(raw=st.binary(max_size=60))
@example(raw=b"\xed\xa0\x80")  # an encoded surrogate: not UTF-8, must still round-trip
@example(raw=b"\xff\xfe/\x00")
def test_names_round_trip_byte_exact(raw):
    name = raw.decode("utf-8", "surrogateescape")
    frame = encode(1, m.Tlcreate(1, name, 0, 0o644, 0))
    assert frame[13 : 13 + len(raw)] == raw
    _, back = decode(frame)
    assert back.name.encode("utf-8", "surrogateescape") == raw


# -- known byte vectors ------------------------------------------------------------------


def _hex(s: str) -> bytes:
    return bytes.fromhex("".join(line.split("#")[0] for line in s.splitlines()))


VECTORS = [
    (
        0xFFFF,
        m.Tversion(8192, "9P2000.L"),
        _hex("""
        15000000 64 ffff      # size 21, type 100, NOTAG
        00200000              # msize 8192
        0800 3950323030302e4c # "9P2000.L"
        """),
    ),
    (
        1,
        m.Twalk(1, 2, ("usr", "lib")),
        _hex("""
        1b000000 6e 0100      # size 27, type 110, tag 1
        01000000 02000000     # fid 1, newfid 2
        0200                  # nwname 2
        0300 757372 0300 6c6962
        """),
    ),
    (
        2,
        m.Rwalk((Qid(0x80, 1, 2),)),
        _hex("""
        16000000 6f 0200      # size 22, type 111
        0100                  # nwqid 1
        80 01000000 0200000000000000
        """),
    ),
    (
        3,
        m.Rgetattr(
            0x7FF, Qid(0, 5, 0x1122334455667788), 0o100644, 1000, 100, 1, 0, 4096, 4096, 8,
            1700000000, 123, 1700000001, 456, 1700000002, 789, 0, 0, 0, 0,
        ),
        _hex("""
        a0000000 19 0300                          # size 160, type 25
        ff07000000000000                          # valid
        00 05000000 8877665544332211              # qid
        a4810000 e8030000 64000000                # mode 0100644, uid 1000, gid 100
        0100000000000000 0000000000000000         # nlink, rdev
        0010000000000000 0010000000000000         # size, blksize
        0800000000000000                          # blocks
        00f1536500000000 7b00000000000000         # atime
        01f1536500000000 c801000000000000         # mtime
        02f1536500000000 1503000000000000         # ctime
        0000000000000000 0000000000000000         # btime
        0000000000000000 0000000000000000         # gen, data_version
        """),
    ),
    (
        4,
        m.Tsetattr(9, m.SETATTR_MTIME | m.SETATTR_MTIME_SET, 0, 0, 0, 0, 0, 0, 1700000000, 5),
        _hex("""
        43000000 1a 0400                          # size 67, type 26
        09000000 20010000                         # fid 9, valid MTIME|MTIME_SET = 0x120
        00000000 00000000 00000000                # mode uid gid
        0000000000000000                          # size
        0000000000000000 0000000000000000         # atime
        00f1536500000000 0500000000000000         # mtime
        """),
    ),
    (
        5,
        m.Tlock(3, m.LOCK_TYPE_WRLCK, m.LOCK_FLAGS_BLOCK, 0, 0, 1234, "host"),
        _hex("""
        2a000000 34 0500      # size 42, type 52
        03000000 01 01000000  # fid, type u8, flags u32
        0000000000000000 0000000000000000  # start, length
        d2040000 0400 686f7374             # proc_id, client_id "host"
        """),
    ),
    (6, m.Rlerror(errno.ENOENT), _hex("0b000000 07 0600 02000000")),
    (7, m.Tfsync(4, 1), _hex("0f000000 32 0700 04000000 01000000")),
    (8, m.Rlock(m.LOCK_BLOCKED), _hex("08000000 35 0800 01")),
    (9, m.Tflush(5), _hex("09000000 6c 0900 0500")),
    (10, m.Tattach(0, m.NOFID, "root", "", 0), _hex("1b000000 68 0a00 00000000 ffffffff 0400 726f6f74 0000 00000000")),
    (11, m.Rclunk(), _hex("07000000 79 0b00")),
    (12, m.Twrite(1, 2, b"hi"), _hex("19000000 76 0c00 01000000 0200000000000000 02000000 6869")),
    (
        13,
        m.Rstatfs(0x01021997, 4096, 10, 9, 8, 7, 6, 5, 255),
        _hex("""
        4300 0000 09 0d00 97190201 00100000
        0a00000000000000 0900000000000000 0800000000000000
        0700000000000000 0600000000000000 0500000000000000 ff000000
        """),
    ),
    (
        14,
        m.Txattrcreate(2, "user.a", 3, m.XATTR_CREATE),
        _hex("1f000000 20 0e00 02000000 0600 757365722e61 0300000000000000 01000000"),
    ),
]


def _vector_id(value: object) -> str | None:
    return type(value).__name__ if isinstance(value, m.Message) else None


@pytest.mark.parametrize(("tag", "msg", "wire"), VECTORS, ids=_vector_id)
def test_known_byte_vectors(tag, msg, wire):
    assert encode(tag, msg) == wire
    assert decode(wire) == (tag, msg)
    type_, fmt = KERNEL[type(msg).__name__]
    assert _ref_frame(type_, tag, fmt, [getattr(msg, f.name) for f in fields(msg)]) == wire


def test_rreaddir_vector_and_dirents():
    entries = [Dirent(Qid(m.QT_DIR, 0, 2), 1, m.DT_DIR, "."), Dirent(Qid(0, 0, 12), 2, m.DT_REG, "ab")]
    data, n = pack_dirents(entries, 1000)
    assert n == 2
    assert data == _hex("""
        80 00000000 0200000000000000 0100000000000000 04 0100 2e
        00 00000000 0c00000000000000 0200000000000000 08 0200 6162
        """)
    assert unpack_dirents(data) == entries
    frame = encode(1, m.Rreaddir(data))
    assert frame[:11] == struct.pack("<IBHI", 11 + len(data), 41, 1, len(data))


# -- bounds ------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_truncation_at_every_cut_point(cls):
    frame = encode(0x4242, sample(cls))
    for cut in range(len(frame)):
        short = frame[:cut]
        with pytest.raises(ProtocolError) as info:
            decode(short)
        assert info.value.tag == (0x4242 if cut >= 7 else None)
        if cut >= 7:
            # Same cut with the size field telling the truth: the body parser must notice.
            patched = struct.pack("<I", cut) + short[4:]
            with pytest.raises(ProtocolError) as info:
                decode(patched)
            assert info.value.tag == 0x4242


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_trailing_bytes_rejected(cls):
    frame = encode(9, sample(cls)) + b"\x00"
    with pytest.raises(ProtocolError):
        decode(frame)  # size field now disagrees
    patched = struct.pack("<I", len(frame)) + frame[4:]
    with pytest.raises(ProtocolError, match="trailing|count|expected") as info:
        decode(patched)
    assert info.value.tag == 9


def test_header_errors_carry_the_tag_when_readable():
    with pytest.raises(ProtocolError) as info:
        decode(b"\x07\x00\x00")
    assert info.value.tag is None
    with pytest.raises(ProtocolError, match="size field 8 != frame length 7") as info:
        decode(struct.pack("<IBH", 8, 120, 77))
    assert info.value.tag == 77
    with pytest.raises(ProtocolError, match="size field 3"):
        decode(struct.pack("<IBH", 3, 120, 77))
    for unknown in (0, 6, 106, 107, 112, 113, 114, 124, 126, 255):
        with pytest.raises(ProtocolError, match="unknown message type") as info:
            decode(struct.pack("<IBH", 7, unknown, 5))
        assert info.value.tag == 5
    assert "tag 5" in str(info.value)


def test_walk_element_counts_are_bounded():
    body = struct.pack("<IIH", 1, 2, 17) + b"\x01\x00a" * 17
    with pytest.raises(ProtocolError, match="nwname 17 > 16"):
        decode(struct.pack("<IBH", 7 + len(body), 110, 3) + body)
    body = struct.pack("<H", 17) + bytes(13 * 17)
    with pytest.raises(ProtocolError, match="nwqid 17 > 16"):
        decode(struct.pack("<IBH", 7 + len(body), 111, 3) + body)
    # 16 is fine both ways
    assert decode(encode(1, m.Twalk(1, 2, ("a",) * 16)))[1].wnames == ("a",) * 16
    # a huge nwname with no data must not allocate or loop: rejected on the count
    body = struct.pack("<IIH", 1, 2, 0xFFFF)
    with pytest.raises(ProtocolError, match="nwname"):
        decode(struct.pack("<IBH", 7 + len(body), 110, 3) + body)


@pytest.mark.parametrize(("type_", "head"), [(117, b""), (41, b""), (118, struct.pack("<IQ", 1, 0))])
def test_data_count_must_equal_bytes_present(type_, head):
    for count, data in ((5, b"abcd"), (3, b"abcd"), (0xFFFFFFFF, b"")):
        body = head + struct.pack("<I", count) + data
        with pytest.raises(ProtocolError, match="count"):
            decode(struct.pack("<IBH", 7 + len(body), type_, 1) + body)


def test_string_length_beyond_frame():
    body = struct.pack("<IH", 1, 0xFFFF) + b"abc" + struct.pack("<III", 0, 0, 0)
    with pytest.raises(ProtocolError, match="Tlcreate.name"):
        decode(struct.pack("<IBH", 7 + len(body), 14, 1) + body)


def test_decode_releases_bytearray_views():
    buf = bytearray(encode(1, m.Tclunk(3)))
    decode(buf)
    buf += b"x"  # would raise BufferError if a view were still exported
    with pytest.raises(ProtocolError):
        decode(buf)
    buf += b"y"
    frame = encode(2, m.Twrite(1, 0, b"z"))
    assert len(frame) % 2 == 0
    assert decode(memoryview(frame).cast("H")) == (2, m.Twrite(1, 0, b"z"))


# -- encode refuses what decode could not produce -----------------------------------------


@pytest.mark.parametrize(
    ("tag", "msg", "error", "match"),
    [
        (1, m.Tclunk(1 << 32), ValueError, "Tclunk.fid"),
        (1, m.Tclunk(-1), ValueError, "Tclunk.fid"),
        (1 << 16, m.Tclunk(1), ValueError, "tag"),
        (1, m.Tlock(1, 256, 0, 0, 0, 0, ""), ValueError, "Tlock.type"),
        (1, m.Tgetattr(1, 1 << 64), ValueError, "request_mask"),
        (1, m.Rattach(Qid(0, 1 << 32, 0)), ValueError, "qid.version"),
        (1, m.Rwalk((Qid(256, 0, 0),)), ValueError, "qids"),
        (1, m.Twalk(1, 2, ("a",) * 17), ValueError, "17 walk names"),
        (1, m.Rwalk((Qid(0, 0, 0),) * 17), ValueError, "17 walk qids"),
        (1, m.Tmkdir(1, "x" * 65536, 0, 0), ValueError, "65536 bytes"),
        (1, m.Twalk(1, 2, ("x" * 65536,)), ValueError, "65536 bytes"),
        (1, m.Tmkdir(1, "\ud800", 0, 0), ValueError, "surrogate"),
        (1, m.Tclunk("1"), TypeError, "Tclunk.fid"),
        (1, m.Tmkdir(1, 5, 0, 0), TypeError, "str or bytes"),
        (1, m.Rattach("qid"), TypeError, "Rattach"),
        (1, "Tclunk", TypeError, "not a 9P2000.L message"),
    ],
)
def test_encode_validates(tag, msg, error, match):
    with pytest.raises(error, match=match):
        encode(tag, msg)


def test_encode_accepts_bytes_names_and_bytearray_data():
    assert decode(encode(1, m.Tmkdir(1, b"\xff", 0o755, 0)))[1].name == "\udcff"
    assert decode(encode(1, m.Twrite(1, 0, bytearray(b"ab"))))[1].data == b"ab"
    assert decode(encode(1, m.Twrite(1, 0, memoryview(b"abcd")[1:3])))[1].data == b"bc"


# -- fuzzing --------------------------------------------------------------------------


def _decode_or_protocol_error(frame: bytes) -> None:
    """The decode contract: ProtocolError or a message that re-encodes to these bytes."""
    try:
        tag, msg = decode(frame)
    except ProtocolError as exc:
        assert exc.tag is None or (len(frame) >= 7 and exc.tag == struct.unpack_from("<H", frame, 5)[0])
        return
    assert encode(tag, msg) == frame


@settings(max_examples=scale(500, 20000), deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_arbitrary_bytes(raw):
    _decode_or_protocol_error(raw)


@settings(max_examples=scale(500, 20000), deadline=None)
@given(type_=st.sampled_from(sorted(MESSAGE_TYPES)), tag=u16, body=st.binary(max_size=200))
def test_fuzz_valid_header_random_body(type_, tag, body):
    _decode_or_protocol_error(struct.pack("<IBH", 7 + len(body), type_, tag) + body)


@st.composite
def mutated_frames(draw):
    frame = bytearray(encode(draw(u16), draw(any_message)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(len(frame) - 1, 0)))
        if op == "flip" and frame:
            frame[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and frame:
            frame[pos] = draw(st.sampled_from([0, 1, 0x10, 0x7F, 0x80, 0xFF]))
        elif op == "insert":
            frame[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del frame[pos : pos + draw(st.integers(1, 4))]
        else:
            del frame[pos:]
    if draw(st.booleans()) and len(frame) >= 4:
        frame[0:4] = struct.pack("<I", len(frame))  # reach the body parser
    return bytes(frame)


@settings(max_examples=scale(1000, 30000), deadline=None)
@given(mutated_frames())
def test_fuzz_mutated_valid_frames(frame):
    _decode_or_protocol_error(frame)


def test_atheris_fuzz_decode(tmp_path):
    """Coverage-guided fuzzing of decode for a bounded number of runs (skips without atheris)."""
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for cls in ALL_CLASSES:
        (corpus / cls.__name__).write_bytes(encode(1, sample(cls)))
    script = textwrap.dedent("""
        import struct, sys
        import atheris
        with atheris.instrument_imports():
            from sandbox.ninep import codec, messages
        def target(data):
            try:
                tag, msg = codec.decode(data)
            except codec.ProtocolError:
                return
            if codec.encode(tag, msg) != data:
                raise AssertionError("decode accepted a non-canonical frame")
            if isinstance(msg, messages.Rreaddir):
                try:
                    messages.unpack_dirents(msg.data)
                except codec.ProtocolError:
                    pass
        atheris.Setup(sys.argv, target)
        atheris.Fuzz()
    """)
    runs = scale(20000, 500000)
    proc = subprocess.run(
        [sys.executable, "-c", script, f"-runs={runs}", "-max_len=512", "-seed=1", str(corpus)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Done" in proc.stderr, proc.stderr[-2000:]


# -- FrameSplitter --------------------------------------------------------------------


@_SETTINGS
@given(msgs=st.lists(st.tuples(u16, any_message), max_size=12), data=st.data())
def test_splitter_arbitrary_chunking(msgs, data):
    frames = [encode(tag, msg) for tag, msg in msgs]
    stream = b"".join(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    splitter = FrameSplitter(1 << 20)
    got: list[bytes] = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        piece = stream[prev:cut]
        kind = data.draw(st.sampled_from([bytes, bytearray, memoryview]))
        got += splitter.feed(kind(piece))
        prev = cut
    assert got == frames
    assert all(type(f) is bytes for f in got)
    assert splitter.buffered == 0


def test_splitter_rejects_bad_sizes():
    for size in (0, 3, 6):
        with pytest.raises(ProtocolError, match=f"size field {size} < 7"):
            FrameSplitter(8192).feed(struct.pack("<IBH", size, 120, 1))
    for size in (4, 5, 6):  # a whole "frame" of exactly its (too small) size
        with pytest.raises(ProtocolError, match=f"size field {size} < 7"):
            FrameSplitter(8192).feed(struct.pack("<I", size) + bytes(size - 4))
    with pytest.raises(ProtocolError, match="> msize 64"):  # whole, in one feed
        FrameSplitter(64).feed(encode(1, m.Twrite(1, 0, bytes(64))))
    splitter = FrameSplitter(8192)
    with pytest.raises(ProtocolError, match="> msize 8192"):
        splitter.feed(struct.pack("<I", 8193))  # rejected on the size field alone
    splitter = FrameSplitter(1 << 20)
    assert splitter.feed(b"\x40\x00") == []
    splitter.msize = 32  # after version negotiation
    with pytest.raises(ProtocolError, match="> msize 32"):
        splitter.feed(b"\x00\x00")
    # a bad size after good frames, in the same feed
    splitter = FrameSplitter(64)
    with pytest.raises(ProtocolError):
        splitter.feed(encode(1, m.Tclunk(1)) + struct.pack("<I", 65))


def test_splitter_large_frame_in_pieces():
    payload = os.urandom(4 << 20)
    frame = encode(1, m.Twrite(1, 0, payload))
    tail = encode(2, m.Tclunk(1))
    stream = frame + tail
    splitter = FrameSplitter(len(frame))
    got: list[bytes] = []
    for i in range(0, len(stream), 4096):
        got += splitter.feed(stream[i : i + 4096])
    assert got == [frame, tail]  # (speed: bench/ninep_throughput.py; no timed asserts here)
    # 512 KiB in 64 KiB pieces (the brief's case), plus many small frames per feed
    frame = encode(3, m.Rread(os.urandom(512 * 1024 - 11)))
    splitter = FrameSplitter(512 * 1024)
    got = []
    for i in range(0, len(frame), 64 * 1024):
        got += splitter.feed(frame[i : i + 64 * 1024])
    assert got == [frame]
    small = [encode(t, m.Tclunk(t)) for t in range(2000)]
    assert splitter.feed(b"".join(small)) == small


# -- directory entries ------------------------------------------------------------------

dirents = st.builds(Dirent, qids, u64, u8, names)


@_SETTINGS
@given(entries=st.lists(dirents, max_size=20), count=st.integers(0, 800))
def test_pack_dirents_fills_exactly_and_round_trips(entries, count):
    data, n = pack_dirents(entries, count)
    assert len(data) <= count
    assert 0 <= n <= len(entries)
    assert unpack_dirents(data) == entries[:n]
    assert len(data) == sum(m.dirent_size(e.name) for e in entries[:n])
    if n < len(entries):  # maximal: the next entry would not have fit
        assert len(data) + m.dirent_size(entries[n].name) > count
    # and it survives a trip through Rreaddir
    assert decode(encode(1, m.Rreaddir(data)))[1].data == data


@_SETTINGS
@given(entries=st.lists(dirents, min_size=1, max_size=5), data=st.data())
def test_unpack_dirents_rejects_truncation(entries, data):
    packed, n = pack_dirents(entries, 1 << 20)
    assert n == len(entries)
    boundaries = {0}
    for e in entries:
        boundaries.add(max(boundaries) + m.dirent_size(e.name))
    cut = data.draw(st.integers(0, len(packed)))
    if cut in boundaries:
        assert unpack_dirents(packed[:cut]) == entries[: sorted(boundaries).index(cut)]
    else:
        with pytest.raises(ProtocolError):
            unpack_dirents(packed[:cut])


def test_pack_dirents_needs_a_sequence_and_valid_names():
    entry = Dirent(Qid(0, 0, 1), 1, m.DT_REG, "a")
    with pytest.raises(TypeError):
        pack_dirents(iter([entry]), 100)
    with pytest.raises(ValueError):
        pack_dirents([Dirent(Qid(0, 0, 1), 1, m.DT_REG, "x" * 65536)], 1 << 20)
    assert pack_dirents([entry], m.DIRENT_HEADER_SIZE) == (b"", 0)
    assert pack_dirents([entry], m.DIRENT_HEADER_SIZE + 1)[1] == 1


# -- the client over a socketpair ------------------------------------------------------


class FakeServer:
    """A scripted 9P peer on one end of a socketpair, run by a thread this test owns.

    ``handler(tag, msg)`` returns the replies to send, as a list of (tag, message); it
    may return [] and answer later (out of order) from a subsequent call.
    """

    def __init__(self, handler, msize: int = 8192, version: str = "9P2000.L"):
        self.handler = handler
        self.msize = msize
        self.version = version
        self.requests: list[m.Message] = []
        self.client_sock, self.sock = socket.socketpair()
        self.sock.settimeout(10)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.client_sock.close()
        self.thread.join(10)
        self.sock.close()
        assert not self.thread.is_alive()
        if self.error and not exc[0]:
            raise self.error

    def _run(self):
        splitter = FrameSplitter(1 << 20)
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    return
                for frame in splitter.feed(data):
                    tag, msg = decode(frame)
                    self.requests.append(msg)
                    if isinstance(msg, m.Tversion):
                        replies = [(tag, m.Rversion(min(msg.msize, self.msize), self.version))]
                    else:
                        replies = self.handler(tag, msg)
                    for rtag, reply in replies:
                        self.sock.sendall(encode(rtag, reply))
        except OSError:
            return
        except Exception as exc:  # noqa: BLE001 - re-raised in __exit__
            self.error = exc


def test_client_negotiates_version_and_maps_rlerror():
    def handler(tag, msg):
        if isinstance(msg, m.Tattach):
            return [(tag, m.Rattach(Qid(m.QT_DIR, 0, 1)))]
        return [(tag, m.Rlerror(errno.ENOENT))]

    with FakeServer(handler, msize=8192) as srv, Client(srv.client_sock, msize=512 * 1024) as client:
        assert client.msize == 8192
        assert client.iounit == 8192 - 24
        fid, qid = client.attach()
        assert qid == Qid(m.QT_DIR, 0, 1)
        assert client.root_fid == fid
        with pytest.raises(NinePError) as info:
            client.getattr(fid)
        assert isinstance(info.value, OSError)
        assert info.value.errno == errno.ENOENT
        assert info.value.strerror == os.strerror(errno.ENOENT)
        assert isinstance(info.value, FileNotFoundError)  # catchable as os's errors are
        with pytest.raises(FileNotFoundError):
            client.walk(fid, ["nope"])
        assert isinstance(NinePError(errno.EEXIST), FileExistsError)
        assert isinstance(NinePError(errno.EPERM), PermissionError)
        assert type(NinePError(errno.EIO)) is NinePError
        with pytest.raises(NinePError):
            client.walk(fid, ["nope"])
        assert srv.requests[0] == m.Tversion(512 * 1024, "9P2000.L")
        assert srv.requests[1] == m.Tattach(fid, m.NOFID, "root", "", 0)


def test_client_refuses_other_versions():
    with FakeServer(lambda tag, msg: [], version="9P2000.u") as srv, pytest.raises(ProtocolError, match="9P2000.u"):
        Client(srv.client_sock)


def test_client_holds_replies_for_other_tags():
    held: list[tuple[int, m.Message]] = []

    def handler(tag, msg):
        held.append((tag, m.Rclunk() if isinstance(msg, m.Tclunk) else m.Rlerror(errno.EBADF)))
        if len(held) < 3:
            return []
        out = [held[1], held[0], held[2]]  # the rpc's own reply comes last
        held.clear()
        return out

    with FakeServer(handler) as srv, Client(srv.client_sock) as client:
        t1 = client.send(m.Tclunk(1))
        t2 = client.send(m.Tremove(2))
        assert len({t1, t2}) == 2
        assert client.rpc(m.Tclunk(3)) == m.Rclunk()  # t2's and t1's replies arrive first: held
        assert client.recv() == (t2, m.Rlerror(errno.EBADF))  # held ones, in arrival order
        assert client.wait(t1) == m.Rclunk()
        with pytest.raises(ValueError, match="not outstanding"):
            client.wait(t1)


def test_client_walk_path_splits_long_walks_and_reads_in_iounit_chunks():
    content = os.urandom(20000)

    def handler(tag, msg):
        if isinstance(msg, m.Tattach):
            return [(tag, m.Rattach(Qid(m.QT_DIR, 0, 1)))]
        if isinstance(msg, m.Twalk):
            return [(tag, m.Rwalk(tuple(Qid(0, 0, i) for i, _ in enumerate(msg.wnames))))]
        if isinstance(msg, m.Tlopen):
            return [(tag, m.Rlopen(Qid(0, 0, 9), 0))]
        if isinstance(msg, m.Tread):
            return [(tag, m.Rread(content[msg.offset : msg.offset + msg.count]))]
        if isinstance(msg, m.Tclunk):
            return [(tag, m.Rclunk())]
        raise AssertionError(msg)

    with FakeServer(handler, msize=8192) as srv, Client(srv.client_sock) as client:
        root, _ = client.attach()
        path = "/".join(f"d{i}" for i in range(20))
        fid = client.walk_path(path)
        walks = [r for r in srv.requests if isinstance(r, m.Twalk)]
        assert walks == [
            m.Twalk(root, fid, tuple(f"d{i}" for i in range(16))),
            m.Twalk(fid, fid, tuple(f"d{i}" for i in range(16, 20))),
        ]
        client.lopen(fid, m.DOTL_RDONLY)
        assert client.read_all(fid) == content
        reads = [r for r in srv.requests if isinstance(r, m.Tread)]
        assert {r.count for r in reads} == {8192 - 24}
        client.clunk(fid)
        assert client.new_fid() != root  # root is still live


def test_client_xattrs_follow_v9fs_sequence():
    store = {"user.a": b"value"}

    def handler(tag, msg):
        if isinstance(msg, m.Tattach):
            return [(tag, m.Rattach(Qid(m.QT_DIR, 0, 1)))]
        if isinstance(msg, m.Twalk):
            return [(tag, m.Rwalk(()))]
        if isinstance(msg, m.Txattrwalk):
            if msg.name == "":
                return [(tag, m.Rxattrwalk(len(b"user.a\0")))]
            return [(tag, m.Rxattrwalk(len(store[msg.name])))]
        if isinstance(msg, m.Tread):
            xattr = next(r for r in reversed(srv.requests) if isinstance(r, m.Txattrwalk))
            value = store[xattr.name] if xattr.name else b"user.a\0"
            return [(tag, m.Rread(value[msg.offset : msg.offset + msg.count]))]
        if isinstance(msg, (m.Txattrcreate,)):
            return [(tag, m.Rxattrcreate())]
        if isinstance(msg, m.Twrite):
            return [(tag, m.Rwrite(len(msg.data)))]
        if isinstance(msg, m.Tclunk):
            return [(tag, m.Rclunk())]
        raise AssertionError(msg)

    with FakeServer(handler) as srv, Client(srv.client_sock) as client:
        root, _ = client.attach()
        assert client.getxattr(root, "user.a") == b"value"
        assert client.listxattr(root) == ["user.a"]
        del srv.requests[:]
        client.setxattr(root, "user.b", b"xyz", m.XATTR_CREATE)
        clone = srv.requests[0].newfid
        assert srv.requests == [
            m.Twalk(root, clone, ()),
            m.Txattrcreate(clone, "user.b", 3, m.XATTR_CREATE),
            m.Twrite(clone, 0, b"xyz"),
            m.Tclunk(clone),
        ]
