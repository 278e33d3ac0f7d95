"""Bad input over a real socket: the server answers errors or drops that connection, stays
up for everyone else, and nothing outside the export root is ever written or opened.

Hypothesis draws programs of frames: well-formed requests with hostile arguments (fid
reuse, unknown fids, ``..`` chains, names with ``/`` or NUL, over-long names, symlinks
that point outside, absurd offsets and counts), well-formed frames with corrupted bytes,
truncated frames, frames whose size field lies, unknown message types and random bytes.
Outside the root sit a canary tree and a FIFO that symlinks inside point to: writing
the canary changes the snapshot, and opening the FIFO would block the server (the test
would time out).
"""

from __future__ import annotations

import os
import socket
import struct

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from sandbox.core.workspace import Workspace
from sandbox.mounts import Provider
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client
from sandbox.ninep.codec import encode
from sandbox_sim import oracle
from sandbox_sim.budget import scale
from sandbox.ninep.wirefs import serve

pytestmark = pytest.mark.timeout(300)

NAMES = st.sampled_from(["a", "b", "sub", "..", ".", "out", "fifo_link", "rel", "x/y", "", "n\0ul", "f" * 300,
                         "../../outside/secret", "deep.txt"])
FIDS = st.integers(0, 6) | st.just(m.NOFID)
U64 = st.integers(0, 2**64 - 1)
SMALL = st.integers(0, 70_000) | U64.map(lambda x: x & 0xFFFFFFFF)
FLAGS = st.sampled_from([m.DOTL_RDONLY, m.DOTL_WRONLY, m.DOTL_RDWR, m.DOTL_RDWR | m.DOTL_TRUNC, 3,
                         m.DOTL_WRONLY | m.DOTL_CREATE | m.DOTL_EXCL, m.DOTL_APPEND | m.DOTL_WRONLY, 0xFFFFFFFF])

REQUESTS = st.one_of(
    st.builds(m.Tattach, FIDS, FIDS, st.just("root"), st.sampled_from(["", "/", "nope", ".."]), st.just(0)),
    st.builds(m.Twalk, FIDS, FIDS, st.lists(NAMES, max_size=16).map(tuple)),
    st.builds(m.Tlopen, FIDS, FLAGS),
    st.builds(m.Tlcreate, FIDS, NAMES, FLAGS, st.integers(0, 0o177777), st.just(0)),
    st.builds(m.Tread, FIDS, U64, SMALL.map(lambda x: x & 0xFFFFFFFF)),
    st.builds(m.Twrite, FIDS, U64, st.binary(max_size=64)),
    st.builds(m.Tclunk, FIDS),
    st.builds(m.Tremove, FIDS),
    st.builds(m.Tgetattr, FIDS, st.just(m.GETATTR_ALL)),
    st.builds(m.Tsetattr, FIDS, st.integers(0, 0x1FF), st.integers(0, 0o7777), st.just(0), st.just(0),
              st.integers(0, 10_000), st.integers(0, 2**40), st.integers(0, 2 * 10**9),
              st.integers(0, 2**40), st.integers(0, 2 * 10**9)),
    st.builds(m.Treaddir, FIDS, st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1)),
    st.builds(m.Tsymlink, FIDS, NAMES, st.sampled_from(["/etc/passwd", "../outside", "a"]), st.just(0)),
    st.builds(m.Tmknod, FIDS, NAMES, st.integers(0, 0o177777), st.integers(0, 10), st.integers(0, 10), st.just(0)),
    st.builds(m.Trename, FIDS, FIDS, NAMES),
    st.builds(m.Trenameat, FIDS, NAMES, FIDS, NAMES),
    st.builds(m.Treadlink, FIDS),
    st.builds(m.Tlink, FIDS, FIDS, NAMES),
    st.builds(m.Tmkdir, FIDS, NAMES, st.integers(0, 0o7777), st.just(0)),
    st.builds(m.Tunlinkat, FIDS, NAMES, st.sampled_from([0, m.AT_REMOVEDIR, 0xFFFFFFFF])),
    st.builds(m.Tfsync, FIDS, st.integers(0, 1)),
    st.builds(m.Tlock, FIDS, st.integers(0, 3), st.integers(0, 3), U64, U64, st.integers(0, 9), st.just("c")),
    st.builds(m.Tgetlock, FIDS, st.integers(0, 3), U64, U64, st.integers(0, 9), st.just("c")),
    st.builds(m.Txattrwalk, FIDS, FIDS, st.sampled_from(["", "user.a", "trusted.x", "security.capability"])),
    st.builds(m.Txattrcreate, FIDS, st.sampled_from(["user.a", "", "user." + "z" * 300]), st.integers(0, 70_000),
              st.integers(0, 3)),
    st.builds(m.Tstatfs, FIDS),
    st.builds(m.Tflush, st.integers(0, 0xFFFF)),
    st.builds(m.Tauth, FIDS, st.just("u"), st.just(""), st.just(0)),
    st.builds(m.Tversion, st.integers(0, 2**32 - 1), st.sampled_from(["9P2000.L", "9P2000", "junk"])),
)


@st.composite
def frames(draw) -> bytes:
    kind = draw(st.integers(0, 9))
    tag = draw(st.integers(0, 0xFFFF))
    if kind <= 5:
        return encode(tag, draw(REQUESTS))
    if kind == 6:  # a valid frame with bytes flipped (the size field kept right)
        raw = bytearray(encode(tag, draw(REQUESTS)))
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(4, len(raw) - 1))
            raw[i] = draw(st.integers(0, 255))
        return bytes(raw)
    if kind == 7:  # truncated, size field fixed up to match
        raw = encode(tag, draw(REQUESTS))
        cut = draw(st.integers(7, len(raw)))
        return struct.pack("<I", cut) + raw[4:cut]
    if kind == 8:  # unknown or reply-side type
        body = draw(st.binary(max_size=20))
        return struct.pack("<IBH", 7 + len(body), draw(st.integers(0, 255)), tag) + body
    body = draw(st.binary(max_size=40))  # a size field that lies (may close the connection)
    return struct.pack("<I", draw(st.integers(0, 2**32 - 1))) + body


@pytest.fixture(scope="module")
def arena(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    work, outside = base / "work", base / "outside"
    work.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"canary\n")
    os.mkfifo(outside / "fifo")
    (work / "a").write_bytes(b"aaaa")
    (work / "sub").mkdir()
    (work / "sub" / "deep.txt").write_bytes(b"deep")
    os.symlink(str(outside), work / "out")
    os.symlink(str(outside / "fifo"), work / "fifo_link")
    os.symlink("../outside/secret", work / "rel")
    os.mkfifo(work / "fifo")
    ws = Workspace.open(str(work), state_dir=str(base / "state"))
    with serve(Provider.intercepted(ws)) as (st_, path):
        yield path, outside, oracle.snapshot_dir(str(outside))
    ws.close()


def _drain(sock: socket.socket) -> None:
    """Half-close and read to EOF: the server has processed every frame we sent."""
    try:
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass


@settings(max_examples=scale(150, 1500), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                               HealthCheck.function_scoped_fixture])
@given(program=st.lists(frames(), min_size=1, max_size=25))
def test_hostile_frames_never_escape_nor_kill_the_server(arena, program):
    path, outside, before = arena
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    try:
        sock.sendall(encode(m.NOTAG, m.Tversion(65536, m.VERSION)) + encode(1, m.Tattach(0, m.NOFID, "root", "", 0)))
        for frame in program:
            try:
                sock.sendall(frame)
            except OSError:
                break  # the server closed this connection: allowed
        _drain(sock)
    finally:
        sock.close()
    with Client.connect_unix(path) as c:  # the server is still up for everyone else
        fid, _ = c.attach()
        c.getattr(fid)
    oracle.assert_same(before, oracle.snapshot_dir(str(outside)), "outside the export root")
