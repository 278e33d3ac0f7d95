"""The vhost-user codec (``sandbox/fuse/vhost.py``): round trips against an independent
reference encoder, strictness, bounded buffering, and fuzzing (hostile bytes give messages
or ``ProtocolError``, never anything else).

The reference encoder below is written from the vhost-user spec's message layouts, by
hand with ``int.to_bytes`` (not the codec's ``struct`` formats), so a layout mistake in the
codec cannot be mirrored here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox.fuse import vhost as v
from sandbox.fuse.virtiofs import FEATURES, Device
from sandbox_sim.budget import scale


def le(n: int, width: int) -> bytes:
    return n.to_bytes(width, "little")


def ref_payload(request: int, fields: dict) -> bytes:
    """The spec's layouts: u64 / vring state (u32 index, u32 num) / vring address
    (u32 index, u32 flags, u64 descriptor, u64 used, u64 available, u64 log) / memory
    (u32 nregions, u32 padding, regions of u64 guest address, size, user address, mmap
    offset) / config (u32 offset, u32 size, u32 flags, bytes)."""
    kind = fields["kind"]
    if kind == "empty":
        return b""
    if kind == "u64":
        return le(fields["value"], 8)
    if kind == "state":
        return le(fields["index"], 4) + le(fields["num"], 4)
    if kind == "fd":
        return le(fields["index"] | (0x100 if fields["nofd"] else 0), 8)
    if kind == "addr":
        return b"".join(le(fields[k], w) for k, w in (("index", 4), ("flags", 4), ("desc", 8), ("used", 8),
                                                       ("avail", 8), ("log", 8)))
    if kind == "mem":
        regions = fields["regions"]
        return le(len(regions), 4) + b"\0\0\0\0" + b"".join(
            le(g, 8) + le(s, 8) + le(u, 8) + le(o, 8) for g, s, u, o in regions)
    if kind == "config":
        return le(fields["offset"], 4) + le(len(fields["data"]), 4) + le(fields["flags"], 4) + fields["data"]
    raise AssertionError(kind)


def ref_message(request: int, flags: int, payload: bytes) -> bytes:
    return le(request, 4) + le(flags | 1, 4) + le(len(payload), 4) + payload


u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


def expected(request: int, f: dict) -> v.Payload:
    kind = f["kind"]
    return {
        "empty": lambda: v.Empty(),
        "u64": lambda: v.U64(f.get("value", 0)),
        "state": lambda: v.VringState(f.get("index", 0), f.get("num", 0)),
        "fd": lambda: v.VringFd(f.get("index", 0), f.get("nofd", False)),
        "addr": lambda: v.VringAddr(*(f.get(k, 0) for k in ("index", "flags", "desc", "used", "avail", "log"))),
        "mem": lambda: v.MemTable(tuple(v.MemRegion(*r) for r in f.get("regions", ()))),
        "config": lambda: v.Config(f.get("offset", 0), f.get("flags", 0), f.get("data", b"")),
    }[kind]()


@st.composite
def messages(draw):
    choice = draw(st.sampled_from(["empty", "u64", "state", "fd", "addr", "mem", "config"]))
    request = draw(st.sampled_from({
        "empty": [v.Req.GET_FEATURES, v.Req.SET_OWNER, v.Req.RESET_OWNER, v.Req.GET_PROTOCOL_FEATURES,
                  v.Req.GET_QUEUE_NUM],
        "u64": [v.Req.SET_FEATURES, v.Req.SET_PROTOCOL_FEATURES, v.Req.SET_STATUS],
        "state": [v.Req.SET_VRING_NUM, v.Req.SET_VRING_BASE, v.Req.GET_VRING_BASE, v.Req.SET_VRING_ENABLE],
        "fd": [v.Req.SET_VRING_KICK, v.Req.SET_VRING_CALL, v.Req.SET_VRING_ERR],
        "addr": [v.Req.SET_VRING_ADDR], "mem": [v.Req.SET_MEM_TABLE],
        "config": [v.Req.GET_CONFIG, v.Req.SET_CONFIG]}[choice]))
    f: dict = {"kind": choice}
    if choice == "u64":
        f["value"] = draw(u64)
    elif choice == "state":
        f.update(index=draw(u32), num=draw(u32))
    elif choice == "fd":
        f.update(index=draw(st.integers(0, 255)), nofd=draw(st.booleans()))
    elif choice == "addr":
        f.update(index=draw(u32), flags=draw(u32), desc=draw(u64), used=draw(u64), avail=draw(u64), log=draw(u64))
    elif choice == "mem":
        f["regions"] = draw(st.lists(st.tuples(u64, u64, u64, u64), max_size=v.MEM_REGIONS_MAX))
    elif choice == "config":
        f.update(offset=draw(u32), flags=draw(u32), data=draw(st.binary(max_size=v.CONFIG_BYTES_MAX)))
    flags = draw(st.sampled_from([0, v.FLAG_NEED_REPLY]))
    return int(request), flags, f


@settings(max_examples=scale(200, 5000))
@given(messages(), st.data())
def test_reference_bytes_decode_and_reencode_exactly(msg, data):
    request, flags, f = msg
    wire = ref_message(request, flags, ref_payload(request, f))
    # fed in arbitrary pieces: framing does not depend on how the bytes arrive
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=4)))
    dec = v.Decoder()
    got = []
    for a, b in zip([0, *cuts], [*cuts, len(wire)]):
        got += dec.feed(wire[a:b])
    assert len(got) == 1 and dec.pending == 0
    assert got[0].header == v.Header(request, flags | v.VERSION, len(wire) - v.HEADER_BYTES)
    assert got[0].header.need_reply == bool(flags & v.FLAG_NEED_REPLY)
    assert got[0].payload == expected(request, f)
    assert v.encode(request, got[0].payload, flags) == wire


def test_replies_decode_by_request():
    for request, payload, want in [
        (v.Req.GET_FEATURES, le(1 << 30 | 1 << 32, 8), v.U64(1 << 30 | 1 << 32)),
        (v.Req.GET_VRING_BASE, le(1, 4) + le(77, 4), v.VringState(1, 77)),
        (v.Req.SET_VRING_ADDR, le(0, 8), v.U64(0)),  # a REPLY_ACK status
    ]:
        (msg,) = v.Decoder(replies=True).feed(ref_message(request, v.FLAG_REPLY, payload))
        assert msg.payload == want
        assert v.encode_reply(request, want) == ref_message(request, v.FLAG_REPLY, payload)


@pytest.mark.parametrize("wire, why", [
    (le(1, 4) + le(0, 4) + le(0, 4), "version 0"),
    (le(1, 4) + le(2, 4) + le(0, 4), "version 2"),
    (le(1, 4) + le(1, 4) + le(v.PAYLOAD_BYTES_MAX + 1, 4), "oversized payload"),
    (ref_message(v.Req.SET_FEATURES, 0, le(1, 4)), "short u64"),
    (ref_message(v.Req.SET_OWNER, 0, b"x"), "payload on an empty request"),
    (ref_message(v.Req.SET_VRING_NUM, 0, le(0, 12)), "long vring state"),
    (ref_message(v.Req.SET_VRING_KICK, 0, le(0x200, 8)), "reserved fd bits"),
    (ref_message(v.Req.SET_MEM_TABLE, 0, le(9, 4) + le(0, 4) + le(0, 9 * 32)[:256]), "9 regions"),
    (ref_message(v.Req.SET_MEM_TABLE, 0, le(2, 4) + le(0, 4) + le(0, 32)), "count disagrees"),
    (ref_message(v.Req.GET_CONFIG, 0, le(0, 4) + le(10, 4) + le(0, 4) + b"abc"), "config size lies"),
])
def test_malformed_messages_are_protocol_errors(wire, why):
    with pytest.raises(v.ProtocolError):
        v.Decoder().feed(wire)


def test_an_oversized_size_is_refused_before_its_payload_is_buffered():
    dec = v.Decoder()
    with pytest.raises(v.ProtocolError):
        dec.feed(le(5, 4) + le(1, 4) + le(2**32 - 1, 4))
    assert dec.pending == 0


def test_unknown_requests_decode_raw():
    (msg,) = v.Decoder().feed(ref_message(99, 0, b"abc"))
    assert msg.header.request == 99 and msg.payload == v.Raw(b"abc")


@settings(max_examples=scale(300, 20000))
@given(st.binary(max_size=400))
def test_fuzz_random_bytes(wire):
    try:
        msgs = v.Decoder().feed(wire)
    except v.ProtocolError:
        return
    for msg in msgs:
        assert msg.header.size <= v.PAYLOAD_BYTES_MAX
        # whatever decodes re-encodes to a message that decodes to the same
        again = v.Decoder().feed(v.encode(msg.header.request, msg.payload, msg.header.flags))
        assert [x.payload for x in again] == [msg.payload]


@settings(max_examples=scale(200, 5000))
@given(messages(), st.integers(0, 400), st.integers(0, 255))
def test_fuzz_mutated_messages(msg, where, byte):
    request, flags, f = msg
    wire = bytearray(ref_message(request, flags, ref_payload(request, f)))
    wire[where % len(wire)] = byte
    try:
        for m in v.Decoder().feed(bytes(wire)):
            assert m.header.size <= v.PAYLOAD_BYTES_MAX
    except v.ProtocolError:
        pass


# -- the session QEMU 7.2's vhost-user-fs-pci really sent (fixtures/virtiofs/README.md)
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "virtiofs" / "qemu-7.2-vhost-user-fs.txt"


def fixture_messages() -> list[tuple[int, bytes]]:
    return [(int(n), bytes.fromhex(h)) for n, h in (line.split() for line in FIXTURE.read_text().splitlines())]


def test_qemu_7_2_session_decodes_and_reencodes():
    names = []
    for nfds, wire in fixture_messages():
        (msg,) = v.Decoder().feed(wire)
        names.append(v.Req(msg.header.request).name)
        assert v.encode(msg.header.request, msg.payload, msg.header.flags) == wire
        p = msg.payload
        want_fds = (len(p.regions) if isinstance(p, v.MemTable) else
                    0 if not isinstance(p, v.VringFd) else 0 if p.nofd else 1)
        assert nfds == want_fds, (names[-1], p)
    for name in ("GET_FEATURES", "SET_FEATURES", "GET_PROTOCOL_FEATURES", "SET_PROTOCOL_FEATURES", "SET_OWNER",
                 "SET_MEM_TABLE", "SET_VRING_NUM", "SET_VRING_ADDR", "SET_VRING_BASE", "SET_VRING_KICK",
                 "SET_VRING_CALL", "SET_VRING_ERR", "GET_VRING_BASE", "SET_VRING_ENABLE", "GET_QUEUE_NUM"):
        assert name in names, name


def test_qemu_7_2_session_replays_against_the_device():
    """Every message of the captured session, with stand-in descriptors (a sparse memfd of
    each region's size, eventfds), is accepted by the device; the rings start and stop."""
    started, stopped = [], []
    dev = Device(lambda r: started.append(r.index), lambda r: stopped.append(r.index))
    replies = []
    try:
        for nfds, wire in fixture_messages():
            (msg,) = v.Decoder().feed(wire)
            fds = []
            if isinstance(msg.payload, v.MemTable):
                for r in msg.payload.regions:
                    fd = os.memfd_create("ram")
                    os.ftruncate(fd, r.mmap_offset + r.size)
                    fds.append(fd)
            else:
                fds = [os.eventfd(0) for _ in range(nfds)]
            reply = dev.message(msg, fds)
            if reply is not None:
                (r,) = v.Decoder(replies=True).feed(reply)
                replies.append((v.Req(r.header.request).name, r.payload))
    finally:
        dev.reset()
    assert ("SET_MEM_TABLE", v.U64(0)) in replies  # QEMU asked for an acknowledgement (REPLY_ACK)
    assert replies[0] == ("GET_FEATURES", v.U64(FEATURES))
    assert sorted(started) == [0, 1] and sorted(stopped) == [0, 1]
    assert ("GET_VRING_BASE", v.VringState(0, 0)) in replies
