"""The virtio-fs device server (``sandbox/fuse/virtiofs.py``) end to end without QEMU: a
test-side vhost-user front-end (the messages QEMU sends, descriptors passed with
``SCM_RIGHTS``) and a test-side guest driver writing split rings by hand into a memfd,
FUSE requests from the reference encoder of ``test_fuse_codec.py``. The server runs its own
asyncio loop in a thread (``VirtioFsThread``), over a real unix socket, with the shared dispatcher on an
intercepted workspace.

Checked: the vhost-user handshake and REPLY_ACK; FUSE requests on a request queue answered
in guest memory and the call eventfd signalled; FORGET on the high-priority queue (no
reply); hostile chains answered with length 0 while the queue goes on; a held deletion's
chain stays unanswered while other requests flow, and is answered after "allow"; a
protocol error ends the connection, not the server; a new front-end is served after a
disconnect; what was written is undone exactly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox.core.safeguard import SafeguardConfig
from sandbox.core.workspace import Workspace
from sandbox.fuse import abi
from sandbox.fuse import messages as m
from sandbox.fuse import vhost as v
from sandbox.fuse.dispatcher import ENTRY_VALID_S, Dispatcher
from sandbox.fuse.virtiofs import FEATURES, VIRTQUEUES_MAX, VirtioFsServer, VirtioFsThread
from sandbox.limits import ServerLimits
from sandbox.mounts import Provider
from sandbox.serving import Export, HoldBroker
from sandbox_sim.budget import scale
from sandbox_sim.oracle import assert_same, snapshot_dir
from sandbox_sim.test_fuse_codec import ref_request
from sandbox_sim.test_fuse_dispatcher import H

pytestmark = pytest.mark.timeout(60)
WAIT_S = 10  # a condition wait's deadline (the server answers in microseconds)
MEM = 1 << 20
GPA, UVA = 0x1_0000_0000, 0x7F12_0000_0000
QSIZE = 16
RINGS_AT = 0x0  # queue q's rings at RINGS_AT + q * 0x2000: desc, avail (+0x100), used (+0x200)
DATA_AT = 0x40000


def le(n: int, w: int) -> bytes:
    return n.to_bytes(w, "little")


class Guest:
    """Guest memory (a memfd) and the driver side of each split ring."""

    def __init__(self):
        self.fd = os.memfd_create("guest-ram")
        os.ftruncate(self.fd, MEM)
        self.avail = [0] * VIRTQUEUES_MAX
        self.next_desc = [0] * VIRTQUEUES_MAX
        self.seen_used = [0] * VIRTQUEUES_MAX
        self.data_at = DATA_AT

    def poke(self, off, data):
        os.pwrite(self.fd, data, off)

    def peek(self, off, n):
        return os.pread(self.fd, n, off)

    @staticmethod
    def ring(q):
        base = RINGS_AT + q * 0x2000
        return base, base + 0x100, base + 0x200

    def alloc(self, n: int) -> int:
        if self.data_at + n >= MEM:
            self.data_at = DATA_AT  # wrap: earlier chains are all answered by now
        at = self.data_at
        self.data_at += (n + 15) // 16 * 16 or 16
        return at

    def submit(self, q: int, request: bytes, reply_room: int) -> tuple[int, int]:
        """Offer a chain (the request readable, ``reply_room`` writable); its head and the reply's offset."""
        desc, avail, _ = self.ring(q)
        rd = self.alloc(len(request))
        self.poke(rd, request)
        segs = [(GPA + rd, len(request), 0)]
        wr = None
        if reply_room:
            wr = self.alloc(reply_room)
            segs.append((GPA + wr, reply_room, 2))
        return self.offer(q, segs), wr

    def offer(self, q: int, segs: list[tuple[int, int, int]]) -> int:
        desc, avail, _ = self.ring(q)
        head = self.next_desc[q] % QSIZE
        for j, (a, n, f) in enumerate(segs):
            i = (head + j) % QSIZE
            self.poke(desc + 16 * i, le(a, 8) + le(n, 4) + le(f | (1 if j + 1 < len(segs) else 0), 2)
                      + le((i + 1) % QSIZE, 2))
        self.next_desc[q] += len(segs)
        self.poke(avail + 4 + 2 * (self.avail[q] % QSIZE), le(head, 2))
        self.avail[q] = (self.avail[q] + 1) & 0xFFFF
        self.poke(avail + 2, le(self.avail[q], 2))
        return head

    def used(self, q: int) -> list[tuple[int, int]]:
        """Used entries not seen before."""
        _, _, used = self.ring(q)
        idx = int.from_bytes(self.peek(used + 2, 2), "little")
        out = []
        while self.seen_used[q] != idx:
            k = self.seen_used[q] % QSIZE
            out.append((int.from_bytes(self.peek(used + 4 + 8 * k, 4), "little"),
                        int.from_bytes(self.peek(used + 8 + 8 * k, 4), "little")))
            self.seen_used[q] = (self.seen_used[q] + 1) & 0xFFFF
        return out


class FrontEnd:
    """What QEMU does on the vhost-user socket, and the kick/call eventfds."""

    def __init__(self, path: str, guest: Guest):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(WAIT_S)
        self.guest = guest
        self.kick = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(2)]
        self.call = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(2)]

    def close(self):
        self.sock.close()
        for fd in self.kick + self.call:
            os.close(fd)
        self.kick = self.call = []  # closed once (a test may close it before device_session does)

    def send(self, request, payload=v.Empty(), fds=(), flags=0):
        socket.send_fds(self.sock, [v.encode(request, payload, flags)], list(fds))

    def recv(self) -> v.Message:
        dec = v.Decoder(replies=True)
        while True:
            got = dec.feed(self.sock.recv(dec.wanted))
            if got:
                return got[0]

    def ask(self, request, payload=v.Empty()):
        self.send(request, payload)
        msg = self.recv()
        assert msg.header.request == request and msg.header.flags & v.FLAG_REPLY
        return msg.payload

    def acked(self, request, payload=v.Empty(), fds=()):
        self.send(request, payload, fds, v.FLAG_NEED_REPLY)
        msg = self.recv()
        assert msg.header.request == request
        return msg.payload.value

    def handshake(self):
        features = self.ask(v.Req.GET_FEATURES).value
        assert features & v.F_PROTOCOL_FEATURES and features == FEATURES
        proto = self.ask(v.Req.GET_PROTOCOL_FEATURES).value
        assert proto & v.ProtocolFeature.REPLY_ACK
        self.send(v.Req.SET_PROTOCOL_FEATURES, v.U64(v.ProtocolFeature.MQ | v.ProtocolFeature.REPLY_ACK))
        assert self.ask(v.Req.GET_QUEUE_NUM).value == VIRTQUEUES_MAX
        assert self.acked(v.Req.SET_OWNER) == 0
        assert self.acked(v.Req.SET_FEATURES, v.U64(features)) == 0
        table = v.MemTable((v.MemRegion(GPA, MEM, UVA, 0),))
        assert self.acked(v.Req.SET_MEM_TABLE, table, [self.guest.fd]) == 0
        for q in range(2):
            desc, avail, used = Guest.ring(q)
            assert self.acked(v.Req.SET_VRING_NUM, v.VringState(q, QSIZE)) == 0
            assert self.acked(v.Req.SET_VRING_BASE, v.VringState(q, 0)) == 0
            assert self.acked(v.Req.SET_VRING_ADDR, v.VringAddr(q, 0, UVA + desc, UVA + used, UVA + avail, 0)) == 0
            assert self.acked(v.Req.SET_VRING_KICK, v.VringFd(q, False), [self.kick[q]]) == 0
            assert self.acked(v.Req.SET_VRING_CALL, v.VringFd(q, False), [self.call[q]]) == 0
            assert self.acked(v.Req.SET_VRING_ENABLE, v.VringState(q, 1)) == 0

    def stop_rings(self) -> list[int]:
        """What QEMU does when the VM pauses: disable, then GET_VRING_BASE; the bases."""
        bases = []
        for q in range(2):
            assert self.acked(v.Req.SET_VRING_ENABLE, v.VringState(q, 0)) == 0
            state = self.ask(v.Req.GET_VRING_BASE, v.VringState(q, 0))
            assert state.index == q
            bases.append(state.num)
        return bases

    def start_rings(self, bases: list[int]) -> None:
        """What QEMU does when the VM runs again (vhost_dev_start), from ``bases``."""
        for q in range(2):
            desc, avail, used = Guest.ring(q)
            assert self.acked(v.Req.SET_VRING_NUM, v.VringState(q, QSIZE)) == 0
            assert self.acked(v.Req.SET_VRING_BASE, v.VringState(q, bases[q])) == 0
            assert self.acked(v.Req.SET_VRING_ADDR, v.VringAddr(q, 0, UVA + desc, UVA + used, UVA + avail, 0)) == 0
            assert self.acked(v.Req.SET_VRING_KICK, v.VringFd(q, False), [self.kick[q]]) == 0
            assert self.acked(v.Req.SET_VRING_CALL, v.VringFd(q, False), [self.call[q]]) == 0
            assert self.acked(v.Req.SET_VRING_ENABLE, v.VringState(q, 1)) == 0

    def kick_and_wait(self, q: int, n: int = 1) -> list[tuple[int, int]]:
        """Kick queue q; wait (condition: the call eventfd) until n new used entries. The
        driver asks for a call at the next used entry (event index: used_event)."""
        _, avail, _ = Guest.ring(q)
        self.guest.poke(avail + 4 + 2 * QSIZE, le(self.guest.seen_used[q], 2))
        os.eventfd_write(self.kick[q], 1)
        return self.wait_used(q, n)

    def wait_used(self, q: int, n: int = 1) -> list[tuple[int, int]]:
        """Wait (condition: the call eventfd) until n new used entries of queue q. What the
        device used before used_event was set (its sweep may take an entry before the kick)
        came with no call: look first, as Linux's virtqueue_enable_cb does; and a call may
        be one left from an earlier batch: look again after each."""
        got: list = self.guest.used(q)
        while len(got) < n:
            r, _, _ = select.select([self.call[q]], [], [], WAIT_S)
            assert r, f"no call on queue {q} within {WAIT_S} s (got {got})"
            os.eventfd_read(self.call[q])
            got += self.guest.used(q)
        return got


def fuse_reply(guest: Guest, at: int, n: int) -> tuple[int, int, bytes]:
    raw = guest.peek(at, n)
    length, error, unique = struct.unpack_from("<IiQ", raw)
    assert length == n
    return error, unique, raw[16:]


class Served:
    """The server on an intercepted workspace, in a thread."""

    def __init__(self, tmp_path, safeguard=None, **server_kw):
        self.work = str(tmp_path / "work")
        os.makedirs(self.work)
        self.before = snapshot_dir(self.work)
        self.state = str(tmp_path / "state")
        kw = {"safeguard": safeguard} if safeguard else {}
        self.ws = Workspace.open(self.work, state_dir=self.state, **kw)
        self.provider = Provider.intercepted(self.ws)
        self.holds = HoldBroker()
        limits = ServerLimits()
        self.export = Export(self.provider, self.holds, limits)
        self.path = str(tmp_path / "vfs.sock")
        self.server = VirtioFsServer(lambda: Dispatcher(self.export, limits), limits, poll_interval_s=0.05,
                                     **server_kw)
        self.thread = VirtioFsThread(self.server, self.path).__enter__()

    def in_loop(self, fn):
        return self.thread.call(fn)

    def close(self):
        self.thread.__exit__(None, None, None)
        self.provider.close()
        self.ws.close()


def init(fe: FrontEnd, guest: Guest) -> None:
    req = ref_request(m.Init(H(abi.Opcode.INIT), 7, 38, 1 << 17, 0xFFFFFFFF & ~abi.FUSE_INIT_RESERVED, 0))
    head, at = guest.submit(1, req, 16 + 64)
    (used,) = fe.kick_and_wait(1)
    assert used == (head, 80)
    err, _, body = fuse_reply(guest, at, 80)
    assert err == 0 and struct.unpack_from("<II", body) == (7, 38)


@contextlib.contextmanager
def device_session(srv: Served):
    """A front end over ``srv`` that has made the vhost-user handshake and sent INIT; the
    front end, the served device and the guest memory are closed after the block."""
    guest = Guest()
    fe = FrontEnd(srv.path, guest)
    try:
        fe.handshake()
        init(fe, guest)
        yield guest, fe
    finally:
        fe.close()
        srv.close()
        os.close(guest.fd)


def test_requests_are_served_through_guest_memory_and_undone_exactly(tmp_path):
    srv = Served(tmp_path)
    with device_session(srv) as (guest, fe):
        # CREATE f, WRITE "hello", READ it back
        create = ref_request(m.Create(H(abi.Opcode.CREATE), os.O_RDWR | os.O_CREAT, 0o644, 0o022, 0, b"f"))
        head, at = guest.submit(1, create, 16 + 128 + 16)
        assert fe.kick_and_wait(1) == [(head, 160)]
        err, _, body = fuse_reply(guest, at, 160)
        assert err == 0
        nodeid, fh = struct.unpack_from("<Q", body)[0], struct.unpack_from("<Q", body, 128)[0]
        write = ref_request(m.Write(H(abi.Opcode.WRITE, nodeid), fh, 0, 5, 0, 0, 0, b"hello"))
        head, at = guest.submit(1, write, 16 + 8)
        assert fe.kick_and_wait(1) == [(head, 24)]
        assert fuse_reply(guest, at, 24)[0] == 0
        with open(os.path.join(srv.work, "f"), "rb") as f:
            assert f.read() == b"hello"
        read = ref_request(m.Read(H(abi.Opcode.READ, nodeid), fh, 0, 4096, 0, 0, 0))
        head, at = guest.submit(1, read, 16 + 4096)
        assert fe.kick_and_wait(1) == [(head, 21)]
        assert fuse_reply(guest, at, 21)[2] == b"hello"
        # a reply larger than the chain's room: -EIO in what fits
        head, at = guest.submit(1, ref_request(m.Getattr(H(abi.Opcode.GETATTR, nodeid), 0, 0)), 20)
        assert fe.kick_and_wait(1) == [(head, 16)]
        assert fuse_reply(guest, at, 16)[0] == -5
        # FORGET on the high-priority queue: consumed, no reply
        head, _ = guest.submit(0, ref_request(m.Forget(H(abi.Opcode.FORGET, nodeid), 1)), 0)
        assert fe.kick_and_wait(0) == [(head, 0)]
        # hostile chains: outside memory, a loop; the queue goes on
        bad = guest.offer(1, [(GPA + MEM - 8, 64, 0)])
        assert fe.kick_and_wait(1) == [(bad, 0)]
        desc, _, _ = Guest.ring(1)
        loop_head = guest.offer(1, [(GPA + DATA_AT, 8, 0), (GPA + DATA_AT, 8, 0)])
        guest.poke(desc + 16 * ((loop_head + 1) % QSIZE) + 12, le(1, 2) + le(loop_head, 2))  # back to the head
        assert fe.kick_and_wait(1) == [(loop_head, 0)]
        # garbage where a FUSE request should be: answered, or dropped, never a crash
        head, at = guest.submit(1, b"\xff" * 40, 16)
        assert fe.kick_and_wait(1) == [(head, 16) if guest.peek(at, 4) == le(16, 4) else (head, 0)]
        mkdir = ref_request(m.Mkdir(H(abi.Opcode.MKDIR), 0o755, 0o022, b"d"))
        head, at = guest.submit(1, mkdir, 16 + 128)
        assert fe.kick_and_wait(1) == [(head, 144)]
        assert os.path.isdir(os.path.join(srv.work, "d"))
        assert srv.server.requests >= 7
        log = [name for name, _ in srv.server.logs[0]]
        assert log[:4] == ["GET_FEATURES", "GET_PROTOCOL_FEATURES", "SET_PROTOCOL_FEATURES", "GET_QUEUE_NUM"]
    ws = Workspace.open(srv.work, state_dir=srv.state)
    try:
        ws.rollback(len(ws.history()))
    finally:
        ws.close()
    assert_same(srv.before, snapshot_dir(srv.work), "after undoing everything written over virtio-fs")


def test_a_missing_name_is_a_short_negative_entry_through_the_device(tmp_path):
    """The device cannot invalidate the guest's entries (no notification queue), so a
    missing name is answered as a negative entry (nodeid 0) valid 1 s — the bound of every
    positive entry — and the guest stops asking for it meanwhile; made on the host, it is
    found when asked again."""
    srv = Served(tmp_path)
    with device_session(srv) as (guest, fe):
        lookup = ref_request(m.Lookup(H(abi.Opcode.LOOKUP), b"later"))
        head, at = guest.submit(1, lookup, 16 + 128)
        assert fe.kick_and_wait(1) == [(head, 144)]
        err, _, body = fuse_reply(guest, at, 144)
        nodeid, _gen, entry_valid = struct.unpack_from("<QQQ", body)
        assert (err, nodeid, entry_valid) == (0, 0, ENTRY_VALID_S)
        with open(os.path.join(srv.work, "later"), "w"):
            pass
        head, at = guest.submit(1, ref_request(m.Lookup(H(abi.Opcode.LOOKUP), b"later")), 16 + 128)
        assert fe.kick_and_wait(1) == [(head, 144)]
        err, _, body = fuse_reply(guest, at, 144)
        assert err == 0 and struct.unpack_from("<Q", body)[0] != 0


def test_a_write_only_create_is_direct_io_through_the_device_and_a_reading_open_is_not(tmp_path):
    """The device's dispatcher answers a write-only open of a file open nowhere else with
    ``FOPEN_DIRECT_IO`` (the guest's writes skip its page cache, as virtiofsd cache=none);
    an open that may read (and map shared) keeps the page cache."""
    srv = Served(tmp_path)
    with open(os.path.join(srv.work, "old"), "w") as f:
        f.write("x")
    with device_session(srv) as (guest, fe):
        create = m.Create(H(abi.Opcode.CREATE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, 0o022, 0, b"out")
        head, at = guest.submit(1, ref_request(create), 16 + 128 + 16)
        assert fe.kick_and_wait(1) == [(head, 160)]
        err, _, body = fuse_reply(guest, at, 160)
        assert err == 0 and struct.unpack_from("<I", body, 128 + 8)[0] & abi.FOPEN_DIRECT_IO
        head, at = guest.submit(1, ref_request(m.Lookup(H(abi.Opcode.LOOKUP), b"old")), 16 + 128)
        assert fe.kick_and_wait(1) == [(head, 144)]
        err, _, body = fuse_reply(guest, at, 144)
        old = struct.unpack_from("<Q", body)[0]
        head, at = guest.submit(1, ref_request(m.Open(H(abi.Opcode.OPEN, old), os.O_RDONLY, 0)), 16 + 16)
        assert fe.kick_and_wait(1) == [(head, 32)]
        err, _, body = fuse_reply(guest, at, 32)
        flags = struct.unpack_from("<I", body, 8)[0]
        assert err == 0 and flags & abi.FOPEN_NOFLUSH and not flags & abi.FOPEN_DIRECT_IO


def open_flags(fe: FrontEnd, guest: Guest, name: bytes, flags: int) -> int:
    """The ``open_flags`` the device answers a LOOKUP of ``name`` (in the root) then an OPEN of
    it with ``flags`` (the handle is left open)."""
    head, at = guest.submit(1, ref_request(m.Lookup(H(abi.Opcode.LOOKUP), name)), 16 + 128)
    assert fe.kick_and_wait(1) == [(head, 144)]
    err, _, body = fuse_reply(guest, at, 144)
    assert err == 0, err
    node = struct.unpack_from("<Q", body)[0]
    head, at = guest.submit(1, ref_request(m.Open(H(abi.Opcode.OPEN, node), flags, 0)), 16 + 16)
    assert fe.kick_and_wait(1) == [(head, 32)]
    err, _, body = fuse_reply(guest, at, 32)
    assert err == 0, err
    return struct.unpack_from("<I", body, 8)[0]


def test_direct_io_all_makes_a_reading_open_direct_through_the_device(tmp_path):
    """``VirtioFsServer(direct_io="all")`` (``serve-virtiofs --direct-io all``): an open that may
    read is answered ``FOPEN_DIRECT_IO`` too (virtiofsd ``cache=none``'s trade), on every
    connection's dispatcher; an unknown mode is refused before anything is served."""
    with pytest.raises(ValueError, match="direct_io"):
        VirtioFsServer(lambda: None, direct_io="reads")
    srv = Served(tmp_path, direct_io="all")
    with open(os.path.join(srv.work, "old"), "w") as f:
        f.write("x")
    with device_session(srv) as (guest, fe):
        for flags in (os.O_RDONLY, os.O_RDWR):
            assert open_flags(fe, guest, b"old", flags) & abi.FOPEN_DIRECT_IO, flags


def avail_event(guest: Guest, q: int) -> int:
    return int.from_bytes(guest.peek(Guest.ring(q)[2] + 4 + 8 * QSIZE, 2), "little")


@pytest.mark.parametrize("sweep", [False, True])
def test_forgets_are_taken_in_batches_without_a_kick_each(tmp_path, monkeypatch, sweep):
    """The high-priority queue asks for a kick only a batch ahead (event index); a FORGET short
    of it is taken on a request queue's turn (no sweep meanwhile), or by the sweep while the
    guest is idle."""
    from sandbox.fuse import virtiofs
    if not sweep:
        monkeypatch.setattr(virtiofs, "RING_SWEEP_S", 3600.0)
    srv = Served(tmp_path)
    open(os.path.join(srv.work, "f"), "w").close()
    with device_session(srv) as (guest, fe):
        assert avail_event(guest, 0) == QSIZE // 2 - 1  # kick me when the 8th FORGET comes
        lookup = ref_request(m.Lookup(H(abi.Opcode.LOOKUP), b"f"))
        head, at = guest.submit(1, lookup, 16 + 128)
        assert fe.kick_and_wait(1) == [(head, 144)]
        nodeid = struct.unpack_from("<Q", fuse_reply(guest, at, 144)[2])[0]
        nodes = srv.in_loop(lambda: len(srv.server.dispatcher.nodes))
        guest.poke(Guest.ring(0)[1] + 4 + 2 * QSIZE, le(guest.seen_used[0], 2))  # call at the next entry
        forget = guest.submit(0, ref_request(m.Forget(H(abi.Opcode.FORGET, nodeid), 1)), 0)[0]  # no kick
        if not sweep:  # taken on queue 1's turn (right after queue 1's call)
            head, _ = guest.submit(1, ref_request(m.Getattr(H(abi.Opcode.GETATTR), 0, 0)), 16 + 104)
            assert fe.kick_and_wait(1) == [(head, 120)]
        r, _, _ = select.select([fe.call[0]], [], [], WAIT_S)  # a condition wait: the call for it
        assert r and guest.used(0) == [(forget, 0)]
        assert os.eventfd_read(fe.call[0]) == 1  # one call
        assert srv.in_loop(lambda: len(srv.server.dispatcher.nodes)) == nodes - 1
        assert avail_event(guest, 0) == 1 + QSIZE // 2 - 1


def test_a_held_chain_stays_unanswered_while_others_flow(tmp_path):
    srv = Served(tmp_path, safeguard=SafeguardConfig(delete_threshold=2, timeout_s=30))
    for i in range(2):
        open(os.path.join(srv.work, f"f{i}"), "w").close()
    with device_session(srv) as (guest, fe):
        h0, _ = guest.submit(1, ref_request(m.Unlink(H(abi.Opcode.UNLINK), b"f0")), 16)
        assert fe.kick_and_wait(1) == [(h0, 16)]
        h1, at1 = guest.submit(1, ref_request(m.Unlink(H(abi.Opcode.UNLINK), b"f1")), 16)  # crosses the threshold
        h2, at2 = guest.submit(1, ref_request(m.Getattr(H(abi.Opcode.GETATTR), 0, 0)), 16 + 104)
        assert fe.kick_and_wait(1) == [(h2, 120)]  # the read flows past the held deletion
        assert os.path.exists(os.path.join(srv.work, "f1"))
        gate = srv.export.gate

        def pending():
            return gate.pending.id if gate.pending is not None else None
        hold = srv.in_loop(pending)
        while hold is None:  # a condition wait: the held task registers on its first turn
            select.select([], [], [], 0.01)
            hold = srv.in_loop(pending)
        guest.poke(Guest.ring(1)[1] + 4 + 2 * QSIZE, le(guest.seen_used[1], 2))  # call at the next entry
        assert guest.used(1) == []  # still held
        assert srv.in_loop(lambda: srv.holds.answer(hold, "allow"))
        assert fe.wait_used(1) == [(h1, 16)]
        assert fuse_reply(guest, at1, 16)[0] == 0
        assert not os.path.exists(os.path.join(srv.work, "f1"))


def test_protocol_errors_end_the_connection_not_the_server(tmp_path):
    srv = Served(tmp_path)
    guest = Guest()
    try:
        fe = FrontEnd(srv.path, guest)
        fe.sock.sendall(le(1, 4) + le(0, 4) + le(0, 4))  # version 0
        assert fe.sock.recv(1) == b""  # closed by the server
        fe.close()
        fe = FrontEnd(srv.path, guest)
        fe.handshake()
        fe.send(v.Req.SET_VRING_NUM, v.VringState(VIRTQUEUES_MAX, QSIZE))  # no such queue
        assert fe.sock.recv(1) == b""
        fe.close()
        fe = FrontEnd(srv.path, guest)
        fe.handshake()
        fds = [os.eventfd(0) for _ in range(v.MEM_REGIONS_MAX + 1)]  # more than any message carries
        fe.send(v.Req.SET_VRING_CALL, v.VringFd(0, False), fds)
        for fd in fds:
            os.close(fd)
        try:
            assert fe.sock.recv(1) == b""
        except ConnectionResetError:  # closed with the message's payload unread: also an end
            pass
        fe.close()
        fe = FrontEnd(srv.path, guest)  # a fresh front-end: served from the start
        fe.handshake()
        init(fe, guest)
        fe.close()
        assert srv.server.connections == 4
    finally:
        srv.close()
        os.close(guest.fd)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One initialised server, front-end and guest for the fuzzing examples."""
    srv = Served(tmp_path_factory.mktemp("fuzz"))
    guest = Guest()
    fe = FrontEnd(srv.path, guest)
    fe.handshake()
    init(fe, guest)
    yield srv, fe, guest
    fe.close()
    srv.close()
    os.close(guest.fd)


MUTATE_FROM = [ref_request(r) for r in (
    m.Lookup(H(abi.Opcode.LOOKUP), b"x"), m.Getattr(H(abi.Opcode.GETATTR), 0, 0),
    m.Mkdir(H(abi.Opcode.MKDIR), 0o755, 0, b"d"), m.Read(H(abi.Opcode.READ), 1, 0, 4096, 0, 0, 0),
    m.BatchForget(H(abi.Opcode.BATCH_FORGET), ((1, 1), (99, 2))), m.Opendir(H(abi.Opcode.OPENDIR), 0, 0))]


@settings(max_examples=scale(60, 1000), deadline=None)
@given(st.sampled_from(MUTATE_FROM), st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=6),
       st.binary(max_size=80), st.integers(0, 300), st.sampled_from([0, 1]))
def test_fuzz_hostile_requests_through_the_rings(live, base, flips, tail, room, q):
    """Mutated and random FUSE requests on either queue: each chain comes back used, its
    length within the room given and a well-formed reply header when there is one; the
    server keeps serving (a GETATTR of the root answers afterwards)."""
    srv, fe, guest = live
    wire = bytearray(base + tail)
    for at, byte in flips:
        wire[at % len(wire)] = byte
    head, at = guest.submit(q, bytes(wire), room)
    ((used_head, n),) = fe.kick_and_wait(q)
    assert used_head == head and n <= room
    if n:
        length, error, _unique = struct.unpack_from("<IiQ", guest.peek(at, 16))
        assert length == n and -4095 <= error <= 0
    if not srv.in_loop(lambda: srv.server.dispatcher.initialized):  # a mutated DESTROY: the guest mounts again
        init(fe, guest)
    head, at = guest.submit(1, ref_request(m.Getattr(H(abi.Opcode.GETATTR), 0, 0)), 16 + 104)
    assert fe.kick_and_wait(1) == [(head, 120)]


def test_the_virtiofs_doc_says_the_code_s_limits():
    import re
    from pathlib import Path

    from sandbox.fuse import dispatcher, virtiofs, virtqueue
    from sandbox.guest import control
    from sandbox.session import runtime
    from sandbox.vm import guest, qemu

    doc = (Path(__file__).resolve().parent.parent / "docs" / "virtiofs.md").read_text()
    quoted = re.findall(r"`(\w+)` = (\d[\d,]*(?:\.\d+)?)(?! MiB)( B)?", doc)
    assert len({name for name, _, _ in quoted}) >= 12
    for name, value, _ in quoted:
        owner = next(mod for mod in (v, virtiofs, virtqueue, abi, qemu, control, guest, runtime, dispatcher)
                     if hasattr(mod, name))
        assert getattr(owner, name) == float(value.replace(",", "")), name
    assert f"`READ_BUFFER_BYTES` = 1 MiB + {abi.READ_BUFFER_BYTES - (1 << 20)} B" in doc
    assert f"`held_request_bytes_per_connection_max` = {ServerLimits().held_request_bytes_per_connection_max >> 20} MiB" in doc


def test_qemu_leaving_with_a_held_request_cancels_it_and_the_next_qemu_is_served(tmp_path):
    srv = Served(tmp_path, safeguard=SafeguardConfig(delete_threshold=2, timeout_s=30))
    for i in range(2):
        open(os.path.join(srv.work, f"f{i}"), "w").close()
    with device_session(srv) as (guest, fe):
        h0, _ = guest.submit(1, ref_request(m.Unlink(H(abi.Opcode.UNLINK), b"f0")), 16)
        assert fe.kick_and_wait(1) == [(h0, 16)]
        guest.submit(1, ref_request(m.Unlink(H(abi.Opcode.UNLINK), b"f1")), 16)  # held
        os.eventfd_write(fe.kick[1], 1)

        def held():
            return srv.server.dispatcher.pipeline.held_bytes
        while srv.in_loop(held) == 0:  # a condition wait: the kick is served on the loop
            select.select([], [], [], 0.01)
        fe.close()  # QEMU goes away (killed, or the guest powered off)
        while srv.in_loop(lambda: srv.server.conn is not None):
            select.select([], [], [], 0.01)
        assert srv.in_loop(lambda: srv.export.gate.pending) is None  # the hold was withdrawn
        assert os.path.exists(os.path.join(srv.work, "f1"))  # the held deletion never happened
        guest2 = Guest()
        fe = FrontEnd(srv.path, guest2)
        fe.handshake()
        init(fe, guest2)
        head, at = guest2.submit(1, ref_request(m.Getattr(H(abi.Opcode.GETATTR), 0, 0)), 16 + 104)
        assert fe.kick_and_wait(1) == [(head, 120)]
        os.close(guest2.fd)


def test_a_new_memory_table_moves_running_rings_and_keeps_held_chains(tmp_path):
    """QEMU sends SET_MEM_TABLE again when guest memory changes (hotplug): the rings go on
    from where they were, and a chain held across the change is answered after it."""
    srv = Served(tmp_path, safeguard=SafeguardConfig(delete_threshold=2, timeout_s=30))
    for i in range(2):
        open(os.path.join(srv.work, f"f{i}"), "w").close()
    with device_session(srv) as (guest, fe):
        h0, _ = guest.submit(1, ref_request(m.Unlink(H(abi.Opcode.UNLINK), b"f0")), 16)
        assert fe.kick_and_wait(1) == [(h0, 16)]
        h1, at1 = guest.submit(1, ref_request(m.Unlink(H(abi.Opcode.UNLINK), b"f1")), 16)  # held
        os.eventfd_write(fe.kick[1], 1)
        gate = srv.export.gate
        while srv.in_loop(lambda: gate.pending) is None:  # a condition wait
            select.select([], [], [], 0.01)
        table = v.MemTable((v.MemRegion(GPA, MEM, UVA, 0),))
        assert fe.acked(v.Req.SET_MEM_TABLE, table, [guest.fd]) == 0
        head, _ = guest.submit(1, ref_request(m.Getattr(H(abi.Opcode.GETATTR), 0, 0)), 16 + 104)
        assert fe.kick_and_wait(1) == [(head, 120)]  # served through the new mapping
        guest.poke(Guest.ring(1)[1] + 4 + 2 * QSIZE, le(guest.seen_used[1], 2))
        assert srv.in_loop(lambda: srv.holds.answer(gate.pending.id, "allow"))
        assert fe.wait_used(1) == [(h1, 16)] and fuse_reply(guest, at1, 16)[0] == 0
        assert not os.path.exists(os.path.join(srv.work, "f1"))


@pytest.mark.parametrize("restart", ["resume", "reset"])
def test_a_held_request_survives_a_paused_vm_and_is_forgotten_by_a_reset(tmp_path, restart):
    """QEMU stops the rings when the VM pauses (a safeguard's QMP pause too): the held
    deletion stays in flight, its reply is parked while the rings are stopped, and lands
    when they start again where they stopped. A queue started elsewhere (the driver reset
    it) forgets it: no stale used entry, the ring works from its new base."""
    srv = Served(tmp_path, safeguard=SafeguardConfig(delete_threshold=2, timeout_s=30))
    for i in range(2):
        open(os.path.join(srv.work, f"f{i}"), "w").close()
    with device_session(srv) as (guest, fe):
        h0, _ = guest.submit(1, ref_request(m.Unlink(H(abi.Opcode.UNLINK), b"f0")), 16)
        assert fe.kick_and_wait(1) == [(h0, 16)]
        h1, at1 = guest.submit(1, ref_request(m.Unlink(H(abi.Opcode.UNLINK), b"f1")), 16)  # held
        os.eventfd_write(fe.kick[1], 1)
        gate = srv.export.gate
        while srv.in_loop(lambda: gate.pending) is None:  # a condition wait
            select.select([], [], [], 0.01)
        bases = fe.stop_rings()
        assert bases == [0, 3]  # INIT, the first UNLINK and the held one were taken
        assert srv.in_loop(lambda: srv.holds.answer(gate.pending.id, "allow"))
        while os.path.exists(os.path.join(srv.work, "f1")):  # a condition wait: the deletion is done
            select.select([], [], [], 0.01)
        assert guest.used(1) == []  # parked: nothing is written into a stopped ring
        guest.poke(Guest.ring(1)[1] + 4 + 2 * QSIZE, le(guest.seen_used[1], 2))
        if restart == "resume":
            fe.start_rings(bases)
            assert fe.wait_used(1) == [(h1, 16)] and fuse_reply(guest, at1, 16)[0] == 0
        else:
            for q in range(2):  # the driver reset its queues: fresh rings from index 0
                _, avail, used = Guest.ring(q)
                guest.poke(avail, b"\0" * (6 + 2 * QSIZE))
                guest.poke(used, b"\0" * (6 + 8 * QSIZE))
                guest.avail[q] = guest.seen_used[q] = guest.next_desc[q] = 0
            fe.start_rings([0, 0])
            head, _ = guest.submit(1, ref_request(m.Getattr(H(abi.Opcode.GETATTR), 0, 0)), 16 + 104)
            assert fe.kick_and_wait(1) == [(head, 120)]  # and no stale entry for the forgotten one


@pytest.mark.parametrize("unique", [0, 7])
def test_a_request_too_big_to_gather_is_refused_by_its_unique_or_dropped(live, unique):
    """A chain whose readable bytes exceed the request buffer (two descriptors over the same
    768 KiB, 1.5 MiB in all) is not gathered: answered EINVAL under its header's unique, or —
    unique 0, the notifications' id, which no reply may carry — returned empty; the server
    keeps serving."""
    srv, fe, guest = live
    span = MEM - DATA_AT
    assert 2 * span > abi.READ_BUFFER_BYTES
    guest.poke(DATA_AT, struct.pack("<IIQ", 2 * span, abi.Opcode.GETATTR, unique))
    reply_at = 0x30000
    head = guest.offer(1, [(GPA + DATA_AT, span, 0), (GPA + DATA_AT, span, 0), (GPA + reply_at, 64, 2)])
    ((used_head, n),) = fe.kick_and_wait(1)
    assert used_head == head
    if unique:
        assert n == 16 and struct.unpack_from("<IiQ", guest.peek(reply_at, 16)) == (16, -errno.EINVAL, unique)
    else:
        assert n == 0
    head, at = guest.submit(1, ref_request(m.Getattr(H(abi.Opcode.GETATTR), 0, 0)), 16 + 104)
    assert fe.kick_and_wait(1) == [(head, 120)]


@pytest.mark.parametrize("region", [
    v.MemRegion(GPA, 2**64 - 4096, UVA, 0),  # no mmap can take it (more than ssize_t)
    v.MemRegion(GPA, MEM, UVA, 2**63),  # an offset as absurd
    v.MemRegion(GPA, 2 * MEM, UVA, 0),  # past the memfd's end: a mapping that would fault
], ids=["huge-size", "huge-offset", "past-the-file"])
def test_a_memory_region_not_inside_its_file_is_refused_and_the_front_end_goes_on(tmp_path, region):
    """A SET_MEM_TABLE region the memfd beside it cannot back is a failed REPLY_ACK (never
    an exception that leaves QEMU waiting for its ack); a good table after it is served."""
    srv = Served(tmp_path)
    guest = Guest()
    try:
        fe = FrontEnd(srv.path, guest)
        fe.handshake()
        assert fe.acked(v.Req.SET_MEM_TABLE, v.MemTable((region,)), [guest.fd]) == 1
        assert fe.acked(v.Req.SET_MEM_TABLE, v.MemTable((v.MemRegion(GPA, MEM, UVA, 0),)), [guest.fd]) == 0
        init(fe, guest)
        fe.close()
    finally:
        srv.close()
        os.close(guest.fd)


@pytest.mark.parametrize("then", ["destroy", "same-unique"])
def test_no_held_request_outlives_its_mount_or_hides_behind_a_reused_unique(tmp_path, then):
    """A held deletion, then either a DESTROY (the guest unmounts: a fresh dispatcher) or a
    second request reusing its unique (the guest picks uniques). DESTROY cancels what the
    old mount has waiting (answered EIO); a reused unique is refused (EINVAL) rather than
    replacing the first request in the pipeline, where nothing could cancel it any more.
    When QEMU leaves, nothing is left in flight: the hold is withdrawn, nothing deleted."""
    srv = Served(tmp_path, safeguard=SafeguardConfig(delete_threshold=2, timeout_s=30))
    for i in range(3):
        open(os.path.join(srv.work, f"f{i}"), "w").close()
    with device_session(srv) as (guest, fe):
        h0, _ = guest.submit(1, ref_request(m.Unlink(H(abi.Opcode.UNLINK), b"f0")), 16)
        assert fe.kick_and_wait(1) == [(h0, 16)]
        header = H(abi.Opcode.UNLINK)
        held, held_at = guest.submit(1, ref_request(m.Unlink(header, b"f1")), 16)
        os.eventfd_write(fe.kick[1], 1)
        gate = srv.export.gate
        while srv.in_loop(lambda: gate.pending) is None:  # a condition wait
            select.select([], [], [], 0.01)
        if then == "destroy":  # the old mount's held request is answered EIO, never run
            head, _ = guest.submit(1, ref_request(m.Destroy(H(abi.Opcode.DESTROY))), 16)
            got = fe.kick_and_wait(1)
            if len(got) < 2:  # the cancelled request's reply comes a turn later: a call at the next entry
                guest.poke(Guest.ring(1)[1] + 4 + 2 * QSIZE, le(guest.seen_used[1], 2))
                got += fe.wait_used(1)
            assert sorted(h for h, _n in got) == sorted([held, head])
            assert fuse_reply(guest, held_at, 16)[:2] == (-errno.EIO, header.unique)
        else:
            head, at = guest.submit(1, ref_request(m.Unlink(header, b"f2")), 16)
            assert fe.kick_and_wait(1) == [(head, 16)]
            assert fuse_reply(guest, at, 16)[:2] == (-errno.EINVAL, header.unique)
        fe.close()  # QEMU goes away
        while srv.in_loop(lambda: srv.server.conn is not None):
            select.select([], [], [], 0.01)
        assert srv.in_loop(lambda: gate.pending) is None  # the hold was withdrawn
        assert all(os.path.exists(os.path.join(srv.work, f"f{i}")) for i in (1, 2))
