"""The vhost-user message codec (issue 17): bytes in, messages out — no I/O.

A vhost-user message is a 12-byte little-endian header — ``request`` (u32), ``flags``
(u32: bits 0–1 the version, always :data:`VERSION`; :data:`FLAG_REPLY`;
:data:`FLAG_NEED_REPLY`), ``size`` (u32, the payload's length) — then ``size`` bytes of
payload. File descriptors travel beside the bytes (``SCM_RIGHTS``), never in them: the
socket loop passes them to the device with the decoded message.

:class:`Decoder` is fed bytes as they arrive and yields whole messages; payloads are
decoded by request into the dataclasses below (:func:`decode_payload`), and
:func:`encode` is the inverse (the device's replies; the tests' front-end).

Invariants:

* bounded: a payload is at most :data:`PAYLOAD_BYTES_MAX` (the largest QEMU sends is a
  memory table of :data:`MEM_REGIONS_MAX` regions, 264 bytes) — a larger ``size`` is a
  :class:`ProtocolError` before any of it is buffered; the decoder holds at most one
  header and one payload;
* strict: a wrong version, a payload whose length is not exactly its request's, a memory
  table with more than :data:`MEM_REGIONS_MAX` regions or whose count disagrees with its
  length, a config read larger than :data:`CONFIG_BYTES_MAX` — all raise
  :class:`ProtocolError` (the front-end is buggy or hostile: the device drops the
  connection). An unknown request decodes to :class:`Raw` (the device answers what it can:
  nothing, or a failed REPLY_ACK);
* round trip: ``decode_payload(r, encode_payload(msg)) == msg`` for every message.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

#: the protocol version in bits 0–1 of the header's flags
VERSION = 0x1
VERSION_MASK = 0x3
FLAG_REPLY = 0x4
FLAG_NEED_REPLY = 0x8
HEADER = struct.Struct("<III")
HEADER_BYTES = HEADER.size
#: memory regions in one SET_MEM_TABLE (VHOST_MEMORY_BASELINE_NREGIONS)
MEM_REGIONS_MAX = 8
#: bytes of a device-config read/write (GET_CONFIG/SET_CONFIG); virtio config spaces are small
CONFIG_BYTES_MAX = 256
#: the largest payload accepted: a config message with its space (the memory table is 264)
PAYLOAD_BYTES_MAX = 12 + CONFIG_BYTES_MAX
#: bits 0–7 of a SET_VRING_KICK/CALL/ERR payload: the ring index; bit 8: no descriptor comes
VRING_INDEX_MASK = 0xFF
VRING_NOFD = 0x100


class ProtocolError(ValueError):
    """A malformed message: the front-end is not speaking vhost-user correctly."""


class Req(enum.IntEnum):
    """Front-end → back-end requests (the vhost-user spec's numbering)."""
    GET_FEATURES = 1
    SET_FEATURES = 2
    SET_OWNER = 3
    RESET_OWNER = 4
    SET_MEM_TABLE = 5
    SET_LOG_BASE = 6
    SET_LOG_FD = 7
    SET_VRING_NUM = 8
    SET_VRING_ADDR = 9
    SET_VRING_BASE = 10
    GET_VRING_BASE = 11
    SET_VRING_KICK = 12
    SET_VRING_CALL = 13
    SET_VRING_ERR = 14
    GET_PROTOCOL_FEATURES = 15
    SET_PROTOCOL_FEATURES = 16
    GET_QUEUE_NUM = 17
    SET_VRING_ENABLE = 18
    SEND_RARP = 19
    NET_SET_MTU = 20
    SET_BACKEND_REQ_FD = 21
    IOTLB_MSG = 22
    SET_VRING_ENDIAN = 23
    GET_CONFIG = 24
    SET_CONFIG = 25
    GET_INFLIGHT_FD = 31
    SET_INFLIGHT_FD = 32
    RESET_DEVICE = 34
    VRING_KICK = 35
    GET_MAX_MEM_SLOTS = 36
    ADD_MEM_REG = 37
    REM_MEM_REG = 38
    SET_STATUS = 39
    GET_STATUS = 40


class ProtocolFeature(enum.IntFlag):
    """GET/SET_PROTOCOL_FEATURES bits (those this codebase names)."""
    MQ = 1 << 0
    LOG_SHMFD = 1 << 1
    REPLY_ACK = 1 << 3
    CONFIG = 1 << 9
    RESET_DEVICE = 1 << 13
    CONFIGURE_MEM_SLOTS = 1 << 15
    STATUS = 1 << 16


#: bit 30 of GET_FEATURES: the back-end speaks GET/SET_PROTOCOL_FEATURES
F_PROTOCOL_FEATURES = 1 << 30


@dataclass(frozen=True)
class Header:
    request: int
    flags: int
    size: int

    @property
    def need_reply(self) -> bool:
        return bool(self.flags & FLAG_NEED_REPLY)


@dataclass(frozen=True)
class Empty:
    """No payload (SET_OWNER, RESET_OWNER, GET_FEATURES, GET_PROTOCOL_FEATURES, …)."""


@dataclass(frozen=True)
class U64:
    """One u64: features, protocol features, queue count, a REPLY_ACK status, a status byte."""
    value: int


@dataclass(frozen=True)
class VringState:
    """SET_VRING_NUM/BASE/ENABLE, GET_VRING_BASE (request and reply)."""
    index: int
    num: int


@dataclass(frozen=True)
class VringAddr:
    """SET_VRING_ADDR: ring addresses in the FRONT-END's virtual address space."""
    index: int
    flags: int
    desc: int
    used: int
    avail: int
    log: int


@dataclass(frozen=True)
class VringFd:
    """SET_VRING_KICK/CALL/ERR: the ring's index; ``nofd``: no descriptor accompanies it."""
    index: int
    nofd: bool

    @property
    def value(self) -> int:
        return self.index | (VRING_NOFD if self.nofd else 0)


@dataclass(frozen=True)
class MemRegion:
    guest_addr: int
    size: int
    user_addr: int
    mmap_offset: int


@dataclass(frozen=True)
class MemTable:
    """SET_MEM_TABLE: one descriptor per region comes beside it, in order."""
    regions: tuple[MemRegion, ...]


@dataclass(frozen=True)
class Config:
    """GET_CONFIG/SET_CONFIG: ``offset``, ``flags`` and ``data`` (its length is the size)."""
    offset: int
    flags: int
    data: bytes


@dataclass(frozen=True)
class LogBase:
    """SET_LOG_BASE: the dirty log's size and offset in the descriptor beside it."""
    size: int
    offset: int


@dataclass(frozen=True)
class Raw:
    """A request this codec does not decode: its payload as is."""
    data: bytes


Payload = Empty | U64 | VringState | VringAddr | VringFd | MemTable | Config | LogBase | Raw

_U64 = struct.Struct("<Q")
_STATE = struct.Struct("<II")
_ADDR = struct.Struct("<IIQQQQ")
_REGION = struct.Struct("<QQQQ")
_TABLE = struct.Struct("<I4x")
_CONFIG = struct.Struct("<III")
_LOG = struct.Struct("<QQ")

_EMPTY = {Req.GET_FEATURES, Req.SET_OWNER, Req.RESET_OWNER, Req.GET_PROTOCOL_FEATURES, Req.GET_QUEUE_NUM,
          Req.GET_MAX_MEM_SLOTS, Req.RESET_DEVICE, Req.GET_STATUS}
_U64_REQ = {Req.SET_FEATURES, Req.SET_PROTOCOL_FEATURES, Req.SET_STATUS}
_STATE_REQ = {Req.SET_VRING_NUM, Req.SET_VRING_BASE, Req.GET_VRING_BASE, Req.SET_VRING_ENABLE}
_FD_REQ = {Req.SET_VRING_KICK, Req.SET_VRING_CALL, Req.SET_VRING_ERR}
#: replies (back-end → front-end) by request: their payload type
REPLY_TYPES = {Req.GET_FEATURES: U64, Req.GET_PROTOCOL_FEATURES: U64, Req.GET_QUEUE_NUM: U64,
               Req.GET_MAX_MEM_SLOTS: U64, Req.GET_STATUS: U64, Req.GET_VRING_BASE: VringState,
               Req.GET_CONFIG: Config}


def _exact(data, size: int, what: str) -> None:
    if len(data) != size:
        raise ProtocolError(f"{what}: payload of {len(data)} bytes, expected {size}")


def _decode_config(data) -> Config:
    if len(data) < _CONFIG.size:
        raise ProtocolError(f"config message of {len(data)} bytes")
    offset, size, flags = _CONFIG.unpack_from(data)
    if size > CONFIG_BYTES_MAX or len(data) != _CONFIG.size + size:
        raise ProtocolError(f"config message: size {size} with {len(data) - _CONFIG.size} bytes")
    return Config(offset, flags, bytes(data[_CONFIG.size:]))


def decode_payload(request: int, data: bytes | memoryview, *, reply: bool = False) -> Payload:
    """The payload ``data`` of ``request`` (a reply's with ``reply``); ``ProtocolError`` if malformed."""
    if reply and request in REPLY_TYPES:
        kind = REPLY_TYPES[request]
        if kind is Config:
            return _decode_config(data)
        if kind is VringState:
            _exact(data, _STATE.size, "vring state")
            return VringState(*_STATE.unpack_from(data))
        _exact(data, _U64.size, Req(request).name)
        return U64(_U64.unpack_from(data)[0])
    if reply:  # a REPLY_ACK status
        _exact(data, _U64.size, "reply ack")
        return U64(_U64.unpack_from(data)[0])
    if request in _EMPTY:
        _exact(data, 0, Req(request).name)
        return Empty()
    if request in _U64_REQ:
        _exact(data, _U64.size, Req(request).name)
        return U64(_U64.unpack_from(data)[0])
    if request in _STATE_REQ:
        _exact(data, _STATE.size, Req(request).name)
        return VringState(*_STATE.unpack_from(data))
    if request in _FD_REQ:
        _exact(data, _U64.size, Req(request).name)
        (v,) = _U64.unpack_from(data)
        if v & ~(VRING_INDEX_MASK | VRING_NOFD):
            raise ProtocolError(f"{Req(request).name}: reserved bits set in {v:#x}")
        return VringFd(v & VRING_INDEX_MASK, bool(v & VRING_NOFD))
    if request == Req.SET_VRING_ADDR:
        _exact(data, _ADDR.size, "SET_VRING_ADDR")
        return VringAddr(*_ADDR.unpack_from(data))
    if request == Req.SET_MEM_TABLE:
        if len(data) < _TABLE.size:
            raise ProtocolError(f"SET_MEM_TABLE of {len(data)} bytes")
        (n,) = _TABLE.unpack_from(data)
        if n > MEM_REGIONS_MAX:
            raise ProtocolError(f"SET_MEM_TABLE: {n} regions > {MEM_REGIONS_MAX}")
        if len(data) != _TABLE.size + n * _REGION.size:
            raise ProtocolError(f"SET_MEM_TABLE: {n} regions in {len(data)} bytes")
        return MemTable(tuple(MemRegion(*_REGION.unpack_from(data, _TABLE.size + i * _REGION.size))
                              for i in range(n)))
    if request in (Req.GET_CONFIG, Req.SET_CONFIG):
        return _decode_config(data)
    if request == Req.SET_LOG_BASE:
        _exact(data, _LOG.size, "SET_LOG_BASE")
        return LogBase(*_LOG.unpack_from(data))
    return Raw(bytes(data))


def encode_payload(msg: Payload) -> bytes:
    if isinstance(msg, Empty):
        return b""
    if isinstance(msg, U64):
        return _U64.pack(msg.value)
    if isinstance(msg, VringState):
        return _STATE.pack(msg.index, msg.num)
    if isinstance(msg, VringFd):
        return _U64.pack(msg.value)
    if isinstance(msg, VringAddr):
        return _ADDR.pack(msg.index, msg.flags, msg.desc, msg.used, msg.avail, msg.log)
    if isinstance(msg, MemTable):
        if len(msg.regions) > MEM_REGIONS_MAX:
            raise ValueError(f"{len(msg.regions)} regions > {MEM_REGIONS_MAX}")
        return _TABLE.pack(len(msg.regions)) + b"".join(
            _REGION.pack(r.guest_addr, r.size, r.user_addr, r.mmap_offset) for r in msg.regions)
    if isinstance(msg, Config):
        if len(msg.data) > CONFIG_BYTES_MAX:
            raise ValueError(f"config of {len(msg.data)} bytes > {CONFIG_BYTES_MAX}")
        return _CONFIG.pack(msg.offset, len(msg.data), msg.flags) + msg.data
    if isinstance(msg, LogBase):
        return _LOG.pack(msg.size, msg.offset)
    if isinstance(msg, Raw):
        return msg.data
    raise TypeError(f"not a vhost-user payload: {msg!r}")


def encode(request: int, msg: Payload, flags: int = 0) -> bytes:
    """One message: the header (version set) and ``msg``'s payload."""
    body = encode_payload(msg)
    if len(body) > PAYLOAD_BYTES_MAX:
        raise ValueError(f"payload of {len(body)} bytes > {PAYLOAD_BYTES_MAX}")
    return HEADER.pack(request, (flags & ~VERSION_MASK) | VERSION, len(body)) + body


def encode_reply(request: int, msg: Payload) -> bytes:
    return encode(request, msg, FLAG_REPLY)


def parse_header(data) -> Header:
    """The header in the first :data:`HEADER_BYTES` of ``data``; ``ProtocolError`` if bad."""
    request, flags, size = HEADER.unpack_from(data)
    if flags & VERSION_MASK != VERSION:
        raise ProtocolError(f"version {flags & VERSION_MASK} in flags {flags:#x}, expected {VERSION}")
    if size > PAYLOAD_BYTES_MAX:
        raise ProtocolError(f"payload of {size} bytes > {PAYLOAD_BYTES_MAX}")
    return Header(request, flags, size)


@dataclass(frozen=True)
class Message:
    header: Header
    payload: Payload


class Decoder:
    """Feed bytes as they arrive; :meth:`feed` returns the whole messages completed.

    Holds at most one header and one payload (≤ :data:`PAYLOAD_BYTES_MAX`). After a
    :class:`ProtocolError` the stream is unusable (framing is lost): drop the connection.
    ``replies``: decode messages as replies (the front-end's side, for tests)."""

    def __init__(self, *, replies: bool = False):
        self._buf = bytearray()
        self._header: Header | None = None
        self._replies = replies

    @property
    def pending(self) -> int:
        """bytes of an incomplete message held"""
        return len(self._buf)

    @property
    def wanted(self) -> int:
        """bytes that complete the current header or payload: a reader that asks for no more
        never reads into the next message (so descriptors received belong to this one)"""
        if self._header is None:
            return HEADER_BYTES - len(self._buf)
        return self._header.size - len(self._buf)

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while True:
            if self._header is None:
                if len(self._buf) < HEADER_BYTES:
                    return out
                try:
                    self._header = parse_header(self._buf)
                except ProtocolError:
                    self._buf.clear()  # framing is lost: nothing more is decoded
                    raise
                del self._buf[:HEADER_BYTES]
            h = self._header
            if len(self._buf) < h.size:
                return out
            body = bytes(self._buf[:h.size])
            del self._buf[:h.size]
            self._header = None
            out.append(Message(h, decode_payload(h.request, body, reply=self._replies)))
