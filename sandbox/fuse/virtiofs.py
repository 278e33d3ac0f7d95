"""The virtio-fs device: a vhost-user back-end serving FUSE from guest virtqueues (issue 17).

QEMU's ``vhost-user-fs-pci`` connects to our unix socket and drives the device with
vhost-user messages (:mod:`.vhost`): features, the guest's memory (memfd descriptors, mmap'd
here), and per virtqueue its size, addresses, base index and kick/call eventfds. Queue 0
is the high-priority queue (FORGET, BATCH_FORGET: no reply); queues 1.. are request
queues. Each chain's readable bytes are one FUSE request, decoded by the shared codec and
handed to the shared :class:`~.dispatcher.Dispatcher` exactly as the ``/dev/fuse``
transport does; the reply is written into the chain's writable segments, the chain put
in the used ring, and the call eventfd signalled (event index honoured).

:class:`Device` is the vhost-user state machine (message + descriptors in, reply bytes
out; rings as :class:`~.virtqueue.Virtqueue`); :class:`VirtioFsServer` is the asyncio loop
around it: the listening socket (one front-end at a time), ``recvmsg`` with
``SCM_RIGHTS``, the kick eventfds, the undo core's polling; :class:`VirtioFsThread` runs it
in a background thread.

Invariants:

* the front-end is trusted to speak vhost-user (a malformed message ends the connection,
  never the server); the guest is not: ring contents are data — a bad chain is returned
  used with length 0, an impossible ring index stops that queue (logged) until the
  front-end sets it up again;
* a request held by a safeguard keeps its chain unanswered (its memoryviews held) while
  other chains and queues flow; it stays in flight when QEMU stops the rings (a paused VM:
  its reply is parked) and is answered once they start again where they stopped — a ring
  started elsewhere (the driver reset it) or a disconnect forgets it; held bytes ≤ ``held_request_bytes_per_connection_max``,
  beyond it no chain is popped until they drain (the guest's queue fills: backpressure);
* bounded: a request is at most :data:`~.abi.READ_BUFFER_BYTES` (larger: ``EINVAL``
  reply, or dropped with length 0 when not even the header is readable), chains popped
  per wake-up ≤ :data:`CHAINS_PER_WAKEUP_MAX`, virtqueues ≤ :data:`VIRTQUEUES_MAX`,
  descriptors per message ≤ :data:`~.vhost.MEM_REGIONS_MAX` (more are closed, and the
  message refused);
* notifications: a wake-up drains a ring with the driver's kicks off, re-arms them (after a
  barrier, re-checking for entries) and signals the call eventfd once; the high-priority
  queue asks for a kick only :data:`HIPRIO_KICK_BATCH` FORGETs ahead, so a FORGET waits for
  that, a request queue's turn or the sweep of the rings every :data:`RING_SWEEP_S` (which
  also bounds how long any entry whose kick was lost can wait);
* a reply that does not fit its chain's writable space is replaced by ``-EIO`` (or, if
  not even a header fits, the chain is returned with length 0);
* the message logs kept for tests are bounded (:data:`MESSAGE_LOG_MAX` messages per
  connection, the last :data:`CONNECTION_LOGS_MAX` connections);
* on disconnect every ring stops, the memory is unmapped, descriptors closed and the
  dispatcher closed (every handle); a FUSE DESTROY (the guest unmounted) starts a fresh
  dispatcher so the guest can mount again.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..limits import ServerLimits
from ..serving.sockets import private_socket_path
from . import DIRECT_IO_MODES, abi
from . import messages as m
from . import vhost as v
from .codec import decode_request, encode_error, encode_reply_parts
from .dispatcher import Dispatcher
from .transport import POLL_INTERVAL_S, poll_export, reply_bytes
from .virtqueue import (F_EVENT_IDX, F_INDIRECT_DESC, F_VERSION_1, BadChain, BrokenRing, GuestMemory, Virtqueue)

log = logging.getLogger("sandbox.virtiofs")

#: the high-priority queue and this many request queues at most (QEMU's num-request-queues)
REQUEST_QUEUES_MAX = 8
VIRTQUEUES_MAX = 1 + REQUEST_QUEUES_MAX
#: chains popped from one queue per wake-up before other callbacks run
CHAINS_PER_WAKEUP_MAX = 64
#: FORGETs the guest adds to the high-priority queue before it kicks (event index: the
#: device asks for the kick this many entries ahead, at most half the queue); fewer wait for
#: a request queue's turn or the next sweep — the kernel waits for no FORGET
HIPRIO_KICK_BATCH = 32
#: seconds between sweeps of the rings for entries nobody kicked about (see HIPRIO_KICK_BATCH)
RING_SWEEP_S = 0.1
#: the virtio features offered: version 1, indirect descriptors, event index, vhost-user protocol features
FEATURES = F_VERSION_1 | F_INDIRECT_DESC | F_EVENT_IDX | v.F_PROTOCOL_FEATURES
#: the protocol features offered: several queues, acknowledged requests
PROTOCOL_FEATURES = v.ProtocolFeature.MQ | v.ProtocolFeature.REPLY_ACK
#: messages kept in a connection's log (names and flags, for fixtures and tests); later ones are not logged
MESSAGE_LOG_MAX = 1000
#: connections whose logs the server keeps (the oldest is dropped)
CONNECTION_LOGS_MAX = 16
HIPRIO = 0
_FUSE_IN_HEADER_BYTES = 40
_ONE = (1).to_bytes(8, "little")  # an eventfd increment


@dataclass
class Ring:
    index: int
    num: int = 0
    base: int = 0
    addr: v.VringAddr | None = None
    kick: int | None = None
    call: int | None = None
    err: int | None = None
    enabled: bool | None = None  # None: not set by SET_VRING_ENABLE
    vq: Virtqueue | None = None
    broken: bool = False
    paused: bool = False
    held: set = field(default_factory=set)
    #: bumped when the ring's requests in flight are forgotten (a reset): their replies are dropped
    epoch: int = 0
    #: replies to held requests that came while the ring was stopped (a paused VM): (chain, bytes)
    parked: list = field(default_factory=list)
    #: (base, addresses) when the ring last stopped: starting again there resumes it
    resume: tuple | None = None

    def close_fds(self) -> None:
        for name in ("kick", "call", "err"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)


class DeviceError(Exception):
    """The front-end broke the protocol: end the connection."""


class Device:
    """The vhost-user back-end's state (module docstring). :meth:`message` handles one
    message and its descriptors and returns the reply bytes (or ``None``); ring events go
    to ``on_ring_start(ring)`` / ``on_ring_stop(ring)`` (the server watches the kick fd)."""

    def __init__(self, on_ring_start: Callable[[Ring], None] = lambda r: None,
                 on_ring_stop: Callable[[Ring], None] = lambda r: None):
        self.features = 0
        self.protocol_features = 0
        self.owner = False
        self.mem: GuestMemory | None = None
        self.rings = [Ring(i) for i in range(VIRTQUEUES_MAX)]
        self.on_ring_start = on_ring_start
        self.on_ring_stop = on_ring_stop
        self.log: list[tuple[str, int]] = []  # (request name, flags) of every message, for fixtures and tests

    # -- messages

    def message(self, msg: v.Message, fds: list[int]) -> bytes | None:
        """Handle ``msg``; ``fds`` are owned by the device from here (each handler keeps or
        closes them exactly once, also when it fails)."""
        h = msg.header
        try:
            name = v.Req(h.request).name
        except ValueError:
            name = str(h.request)
        if len(self.log) < MESSAGE_LOG_MAX:
            self.log.append((name, h.flags))
        try:
            reply = self._handle(h.request, msg.payload, fds)
            ok = True
        except (v.ProtocolError, DeviceError, BrokenRing, OSError, ValueError) as e:
            if h.request in v.REPLY_TYPES or not (h.need_reply and self._acked(v.ProtocolFeature.REPLY_ACK)):
                raise DeviceError(f"{name}: {e}") from e
            log.warning("virtiofs: %s failed: %s", name, e)
            reply, ok = None, False
        if reply is not None:
            return v.encode_reply(h.request, reply)
        if h.need_reply and self._acked(v.ProtocolFeature.REPLY_ACK):
            return v.encode_reply(h.request, v.U64(0 if ok else 1))
        return None

    def _acked(self, feature: int) -> bool:
        return bool(self.protocol_features & feature)

    def _ring(self, index: int) -> Ring:
        if not 0 <= index < VIRTQUEUES_MAX:
            raise DeviceError(f"virtqueue {index} ≥ {VIRTQUEUES_MAX}")
        return self.rings[index]

    def _handle(self, request: int, p, fds: list[int]) -> v.Payload | None:
        R = v.Req
        if request not in (R.SET_MEM_TABLE, R.SET_VRING_KICK, R.SET_VRING_CALL, R.SET_VRING_ERR,
                           R.SET_LOG_BASE, R.SET_LOG_FD) and fds:
            for fd in fds:
                os.close(fd)
            raise DeviceError(f"{len(fds)} unexpected descriptors")
        if request == R.GET_FEATURES:
            return v.U64(FEATURES)
        if request == R.SET_FEATURES:
            if p.value & ~FEATURES:
                raise DeviceError(f"features {p.value & ~FEATURES:#x} were not offered")
            self.features = p.value
            return None
        if request == R.GET_PROTOCOL_FEATURES:
            return v.U64(int(PROTOCOL_FEATURES))
        if request == R.SET_PROTOCOL_FEATURES:
            self.protocol_features = p.value & PROTOCOL_FEATURES
            return None
        if request == R.GET_QUEUE_NUM:
            return v.U64(VIRTQUEUES_MAX)
        if request == R.SET_OWNER:
            self.owner = True
            return None
        if request in (R.RESET_OWNER, R.RESET_DEVICE):
            self.reset()
            return None
        if request == R.SET_MEM_TABLE:
            self._set_mem_table(p, fds)
            return None
        if request == R.SET_VRING_NUM:
            ring = self._ring(p.index)
            if not (0 < p.num <= 32768 and p.num & (p.num - 1) == 0):
                raise DeviceError(f"queue size {p.num}")
            ring.num = p.num
            return None
        if request == R.SET_VRING_ADDR:
            self._ring(p.index).addr = p
            return None
        if request == R.SET_VRING_BASE:
            self._ring(p.index).base = p.num & 0xFFFF
            return None
        if request == R.GET_VRING_BASE:
            ring = self._ring(p.index)
            self._stop(ring)
            return v.VringState(ring.index, ring.base)
        if request in (R.SET_VRING_KICK, R.SET_VRING_CALL, R.SET_VRING_ERR):
            return self._set_fd(request, p, fds)
        if request == R.SET_VRING_ENABLE:
            ring = self._ring(p.index)
            ring.enabled = bool(p.num)
            if ring.enabled:
                self._maybe_start(ring)
            else:
                self._stop(ring)
            return None
        if request == R.GET_MAX_MEM_SLOTS:
            return v.U64(v.MEM_REGIONS_MAX)
        for fd in fds:
            os.close(fd)
        raise DeviceError("not supported")

    def _set_fd(self, request: int, p: v.VringFd, fds: list[int]) -> None:
        ring = self._ring(p.index)
        if len(fds) != (0 if p.nofd else 1):
            for fd in fds:
                os.close(fd)
            raise DeviceError(f"{len(fds)} descriptors with nofd={p.nofd}")
        fd = fds[0] if fds else None
        name = {v.Req.SET_VRING_KICK: "kick", v.Req.SET_VRING_CALL: "call", v.Req.SET_VRING_ERR: "err"}[request]
        if name == "kick":
            self._stop(ring)
        old = getattr(ring, name)
        if old is not None:
            os.close(old)
        setattr(ring, name, fd)
        if name == "kick":
            if fd is None:
                raise DeviceError("polling rings (no kick descriptor) are not supported")
            os.set_blocking(fd, False)
            self._maybe_start(ring)
        return None

    def _set_mem_table(self, table: v.MemTable, fds: list[int]) -> None:
        new = GuestMemory.map(table, fds)  # closes fds
        old, self.mem = self.mem, new
        for ring in self.rings:  # running rings move to the new mapping; held chains stay held
            if ring.vq is not None:
                vq = ring.vq
                try:
                    ring.vq = Virtqueue(new, ring.num, ring.addr.desc, ring.addr.avail, ring.addr.used,
                                        event_idx=vq.event_idx, indirect=vq.indirect, last_avail=vq.last_avail)
                except BrokenRing as e:
                    log.error("virtiofs: queue %d is not in the new memory table: %s", ring.index, e)
                    ring.vq = vq  # stopped below, with its old mapping
                    self._stop(ring)
                    ring.broken = True
                    continue
                vq.close()
        if old is not None:
            old.close()  # a mapping a held chain still views is freed with the chain

    def _maybe_start(self, ring: Ring) -> None:
        if ring.vq is not None or ring.kick is None or ring.addr is None or self.mem is None or not ring.num:
            return
        needs_enable = bool(self.features & v.F_PROTOCOL_FEATURES)
        if ring.enabled is False or (needs_enable and ring.enabled is None):
            return
        if (ring.held or ring.parked) and ring.resume != (ring.base, ring.addr):
            self._forget_in_flight(ring)  # not where it stopped: the driver reset the queue
        try:
            ring.vq = Virtqueue(self.mem, ring.num, ring.addr.desc, ring.addr.avail, ring.addr.used,
                                event_idx=bool(self.features & F_EVENT_IDX),
                                indirect=bool(self.features & F_INDIRECT_DESC), last_avail=ring.base)
        except BrokenRing as e:
            log.error("virtiofs: queue %d cannot start: %s", ring.index, e)
            ring.broken = True
            return
        ring.broken = False
        self.on_ring_start(ring)

    def _stop(self, ring: Ring) -> None:
        """Stop serving ``ring`` (GET_VRING_BASE, disable, a new kick). Its held requests stay
        in flight: QEMU stops the rings when the VM pauses (a safeguard's QMP pause too) and
        starts them again where they stopped; their replies are parked until then."""
        if ring.vq is not None:
            self.on_ring_stop(ring)
            ring.base = ring.vq.last_avail
            ring.vq.close()
            ring.vq = None
            ring.resume = (ring.base, ring.addr)

    @staticmethod
    def _forget_in_flight(ring: Ring) -> None:
        ring.held.clear()
        ring.epoch += 1
        for chain, _data in ring.parked:
            chain.release()
        ring.parked.clear()

    def reset(self) -> None:
        for ring in self.rings:
            self._stop(ring)
            self._forget_in_flight(ring)
            ring.close_fds()
        self.rings = [Ring(i) for i in range(VIRTQUEUES_MAX)]
        if self.mem is not None:
            self.mem.close()
            self.mem = None
        self.features = self.protocol_features = 0

    def notify(self, ring: Ring) -> None:
        if ring.vq is not None and ring.call is not None and ring.vq.should_notify():
            try:
                os.write(ring.call, _ONE)
            except BlockingIOError:  # the counter is saturated: the guest will see it anyway
                pass


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class VirtioFsServer:
    """Serve FUSE over vhost-user on a unix socket (module docstring); one front-end at a time.

    ``make_dispatcher()`` makes a fresh :class:`Dispatcher` (per connection, and after a
    DESTROY); the export behind it is shared. ``direct_io``: one of :data:`DIRECT_IO_MODES`
    (``ValueError`` otherwise), applied to every dispatcher made."""

    def __init__(self, make_dispatcher: Callable[[], Dispatcher], limits: ServerLimits = ServerLimits(),
                 poll_interval_s: float | None = POLL_INTERVAL_S, capture: bool = False,
                 direct_io: str = "write-only"):
        if direct_io not in DIRECT_IO_MODES:
            raise ValueError(f"direct_io must be one of {', '.join(DIRECT_IO_MODES)}, not {direct_io!r}")
        self.make_dispatcher = make_dispatcher
        self.direct_io = direct_io
        #: with ``capture``: every message's raw bytes and descriptor count, per connection (fixtures)
        self.captures: list[list[tuple[bytes, int]]] | None = [] if capture else None  # unbounded: tests only
        self._raw = bytearray()
        self.limits = limits
        self.poll_interval_s = poll_interval_s
        self.dispatcher: Dispatcher | None = None
        self.device: Device | None = None
        self.conn: socket.socket | None = None
        self.requests = 0
        self.connections = 0
        #: the message logs of the last CONNECTION_LOGS_MAX connections (fixtures, tests)
        self.logs: collections.deque[list[tuple[str, int]]] = collections.deque(maxlen=CONNECTION_LOGS_MAX)
        self._listener: socket.socket | None = None
        self._bound = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._decoder: v.Decoder | None = None
        self._fds: list[int] = []
        self._draining = False
        self._disconnected: asyncio.Event | None = None

    # -- lifetime

    async def serve(self, path: str, ready: Callable[[], None] = lambda: None) -> None:
        """Listen on ``path`` (mode 0600; a stale socket there is replaced, anything else is
        ``FileExistsError``) and serve front-ends one after another until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with private_socket_path(path):  # 0600: only our user's QEMU may connect
                self._listener.bind(path)
            self._bound = True
            self._listener.listen(1)
            self._listener.setblocking(False)
            # None: another loop polls the export's undo core already (a session's 9P server)
            pollers = [self._loop.create_task(self._poll_loop())] if self.poll_interval_s is not None else []
            ready()
            try:
                while True:
                    conn, _ = await self._loop.sock_accept(self._listener)
                    await self._serve_connection(conn)
            finally:
                for poller in pollers:
                    poller.cancel()
                await asyncio.gather(*pollers, return_exceptions=True)
        finally:
            self._listener.close()
            if self._bound:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    async def _poll_loop(self) -> None:
        while self.dispatcher is None:
            await asyncio.sleep(self.poll_interval_s)
        await poll_export(self.dispatcher.export, self.poll_interval_s)

    async def _serve_connection(self, conn: socket.socket) -> None:
        self.connections += 1
        conn.setblocking(False)
        self.conn = conn
        self._decoder = v.Decoder()
        self.device = Device(self._ring_started, self._ring_stopped)
        self.logs.append(self.device.log)
        if self.captures is not None:
            self.captures.append([])
        self._raw.clear()
        self._new_dispatcher()
        self._disconnected = asyncio.Event()
        self._loop.add_reader(conn.fileno(), self._readable)
        sweeper = self._loop.create_task(self._sweep_loop())
        try:
            await self._disconnected.wait()
        finally:
            sweeper.cancel()
            await asyncio.gather(sweeper, return_exceptions=True)
            self._loop.remove_reader(conn.fileno())
            for fd in self._fds:
                _close_quietly(fd)
            self._fds = []
            self.device.reset()
            tasks = self.dispatcher.pipeline.cancel_all()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.dispatcher.close()
            conn.close()
            self.conn = None

    def _new_dispatcher(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.close()
        self.dispatcher = self.make_dispatcher()
        self.dispatcher.on_settled = self._resume
        # no notification queue: the guest's entries expire, negative ones too (1 s)
        self.dispatcher.negative_entries_short = True
        # its pages are dropped at each open and never meanwhile: write-only opens of a file
        # open nowhere else skip them (direct I/O), and so does every open beside one
        self.dispatcher.direct_io_write_only = True
        self.dispatcher.direct_io_all = self.direct_io == "all"

    # -- the vhost-user socket

    def _readable(self) -> None:
        try:
            data, anc, flags, _ = self.conn.recvmsg(self._decoder.wanted,
                                                    socket.CMSG_SPACE(v.MEM_REGIONS_MAX * 4))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.warning("virtiofs: the front-end's socket failed: %s", e)
            self._disconnected.set()
            return
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                n = len(raw) - len(raw) % 4
                self._fds += list(memoryview(raw)[:n].cast("i"))
        if flags & socket.MSG_CTRUNC:  # more descriptors than any message carries (the rest were closed)
            log.error("virtiofs: ending the connection: more than %d descriptors with one message",
                      v.MEM_REGIONS_MAX)
            self._disconnected.set()
            return
        if not data:
            log.info("virtiofs: the front-end disconnected")
            self._disconnected.set()
            return
        if self.captures is not None:
            self._raw += data
        try:
            for msg in self._decoder.feed(data):  # at most one: we never read past its end
                fds, self._fds = self._fds, []
                if self.captures is not None:
                    self.captures[-1].append((bytes(self._raw), len(fds)))
                    self._raw.clear()
                if len(fds) > v.MEM_REGIONS_MAX:
                    for fd in fds:
                        _close_quietly(fd)
                    raise DeviceError(f"{len(fds)} descriptors with one message")
                reply = self.device.message(msg, fds)
                if reply is not None:
                    self.conn.sendall(reply)  # small (≤ 280 bytes): never blocks for long
        except (v.ProtocolError, DeviceError, OSError) as e:
            log.error("virtiofs: ending the connection: %s", e)
            self._disconnected.set()

    # -- rings

    def _ring_started(self, ring: Ring) -> None:
        parked, ring.parked = ring.parked, []
        for chain, data in parked:  # replies that came while it was stopped
            self._answer(ring, ring.vq, chain, data)
        if parked:
            self.device.notify(ring)
        self._loop.add_reader(ring.kick, self._kicked, ring)
        self._loop.call_soon(self._drain, ring)  # entries may be waiting from before a restart

    def _ring_stopped(self, ring: Ring) -> None:
        if ring.kick is not None:
            self._loop.remove_reader(ring.kick)

    def _kicked(self, ring: Ring) -> None:
        try:
            os.read(ring.kick, 8)
        except (BlockingIOError, InterruptedError):
            pass
        self._drain(ring)

    def _over_limits(self) -> bool:
        return self.dispatcher.pipeline.held_bytes > self.limits.held_request_bytes_per_connection_max

    def _resume(self) -> None:
        if self.device is None or self._over_limits():
            return
        for ring in self.device.rings:
            if ring.paused:
                ring.paused = False
                self._loop.call_soon(self._drain, ring)

    def _drain(self, ring: Ring) -> None:
        """Serve what ``ring`` has: kicks off while draining, then armed again (a batch ahead
        on the high-priority queue); one call for what was answered. A request queue's turn
        also takes the FORGETs waiting on the high-priority queue."""
        vq = ring.vq
        if vq is None or self.device is None:
            return
        self._draining = True
        if not vq.event_idx:  # with it, nothing to write (Virtqueue.suppress_kicks)
            vq.suppress_kicks()
        try:
            popped = 0
            held_max = self.limits.held_request_bytes_per_connection_max
            while True:
                while popped < CHAINS_PER_WAKEUP_MAX:
                    popped += 1
                    if self.dispatcher.pipeline.held_bytes > held_max:  # _over_limits, inlined
                        ring.paused = True
                        return
                    try:
                        chain = vq.pop()
                    except BrokenRing as e:
                        log.error("virtiofs: queue %d stopped: %s", ring.index, e)
                        ring.broken = True
                        self._ring_stopped(ring)
                        return
                    if chain is None:
                        break
                    if type(chain) is BadChain:
                        log.warning("virtiofs: queue %d: bad chain %d: %s", ring.index, chain.head, chain.reason)
                        vq.push(chain.head, 0)
                        continue
                    try:
                        self._request(ring, vq, chain)
                    except Exception:  # a defect of ours: that request goes unanswered, the rest flow
                        log.exception("virtiofs: queue %d: request in chain %d failed", ring.index, chain.head)
                else:  # more may wait: after other callbacks (kicks stay off until then)
                    self._loop.call_soon(self._drain, ring)
                    return
                try:
                    if not vq.arm(min(HIPRIO_KICK_BATCH, vq.size // 2) - 1 if ring.index == HIPRIO else 0):
                        break
                except BrokenRing:
                    continue  # the next pop says why and stops the queue
        finally:
            self._draining = False
            self.device.notify(ring)
        if ring.index != HIPRIO:
            hiprio = self.device.rings[HIPRIO]
            if hiprio.vq is not None and not hiprio.broken and not hiprio.paused:
                try:
                    waiting = hiprio.vq.pending() > 0
                except BrokenRing:
                    waiting = True  # _drain stops it, logged
                if waiting:
                    self._drain(hiprio)

    async def _sweep_loop(self) -> None:
        """Every RING_SWEEP_S: drain the rings with entries waiting — the FORGETs short of a
        high-priority batch while the guest is idle, and any kick lost to a race."""
        while True:
            await asyncio.sleep(RING_SWEEP_S)
            device = self.device
            if device is None:
                continue
            for ring in device.rings:
                vq = ring.vq
                if vq is None or ring.broken or ring.paused:
                    continue
                try:
                    waiting = vq.pending() > 0
                except BrokenRing:
                    waiting = True  # _drain stops it, logged
                if waiting:
                    self._drain(ring)

    def _request(self, ring: Ring, vq: Virtqueue, chain) -> None:
        self.requests += 1
        buf = chain.gather(abi.READ_BUFFER_BYTES)
        if buf is None:
            head = bytes(chain.readable[0][:_FUSE_IN_HEADER_BYTES]) if chain.readable else b""
            unique = int.from_bytes(head[8:16], "little") if len(head) == _FUSE_IN_HEADER_BYTES else 0
            if unique:  # 0: no reply can name it (the notifications' id)
                self._answer(ring, vq, chain, encode_error(unique, errno.EINVAL))
            else:
                self._answer(ring, vq, chain, b"")
            return
        try:
            req = decode_request(buf)
        except m.ProtocolError as e:
            if e.unique is None or ring.index == HIPRIO:
                log.warning("virtiofs: undecodable request dropped: %s", e)
                self._answer(ring, vq, chain, b"")
            else:
                if not isinstance(e, m.UnknownOpcode):
                    log.info("virtiofs: bad request: %s", e)
                self._answer(ring, vq, chain, encode_error(e.unique, e.errno))
            return
        dispatcher = self.dispatcher
        if req.OPCODE in m.NO_REPLY or isinstance(req, m.Interrupt):
            dispatcher.submit(req, len(buf), lambda *a: None)
            self._answer(ring, vq, chain, b"")
            return
        ring.held.add(chain.head)
        epoch = ring.epoch

        def send(unique: int, reply, error: BaseException | None) -> None:
            if ring.epoch != epoch:  # the queue was reset meanwhile: nobody waits for this reply
                chain.release()
                return
            ring.held.discard(chain.head)
            data = _reply_parts(unique, reply, error)
            if ring.vq is None:  # stopped (the VM is paused): answered when the ring starts again
                ring.parked.append((chain, data))
                return
            self._answer(ring, ring.vq, chain, data)  # the current mapping's rings
            if not self._draining:
                self.device.notify(ring)

        dispatcher.submit(req, len(buf), send)
        if isinstance(req, m.Destroy):  # the guest unmounted: a later mount starts afresh
            self._new_dispatcher()

    def _answer(self, ring: Ring, vq: Virtqueue, chain, data) -> None:
        """Write the reply ``data`` (bytes, or a tuple of bytes-like parts) into ``chain`` and
        put it in the used ring."""
        parts = data if type(data) is tuple else (data,)
        room = chain.writable_bytes
        size = len(parts[0]) if len(parts) == 1 else sum(map(len, parts))
        if size > room:
            head = bytes(parts[0][:16])
            log.error("virtiofs: a reply of %d bytes does not fit in %d", size, room)
            parts = (encode_error(int.from_bytes(head[8:16], "little"), errno.EIO) if len(head) >= 16 else b"",)
            if len(parts[0]) > room:
                parts = (b"",)
        n = chain.scatter(*parts)
        chain.release()
        vq.push(chain.head, n)


def _reply_parts(unique: int, reply, error: BaseException | None) -> tuple:
    """The reply's wire bytes as parts: a READ's (or READDIR's) payload not joined to its
    header, so it is copied once, into guest memory; anything else as ``reply_bytes``."""
    if error is None and type(reply) is m.Data:
        try:
            return encode_reply_parts(unique, reply)
        except ValueError:
            pass  # reply_bytes logs it and answers EIO
    return (reply_bytes(unique, reply, error),)


class VirtioFsThread:
    """Run a :class:`VirtioFsServer` on ``path`` on its own event loop in a background thread
    — for synchronous embedders, tests and benchmarks: ``with VirtioFsThread(server, path): …``.
    ``call(fn)`` runs ``fn`` on the server's loop (for state the loop owns)."""

    #: seconds to wait for the socket to listen, a call to run, the thread to end
    WAIT_S = 30.0

    def __init__(self, server: VirtioFsServer, path: str):
        self.server = server
        self.path = path
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._task: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run, name="virtiofs-server", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._task = self.loop.create_task(self.server.serve(self.path, self._ready.set))
        try:
            self.loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # e.g. the socket path is taken
            self._failed = e
        finally:
            self._ready.set()
            self.loop.close()

    def __enter__(self) -> VirtioFsThread:
        self._thread.start()
        if not self._ready.wait(self.WAIT_S):
            raise TimeoutError(f"the virtio-fs server did not listen on {self.path} within {self.WAIT_S} s")
        if self._failed is not None:
            raise self._failed
        return self

    def call(self, fn: Callable):
        return asyncio.run_coroutine_threadsafe(self._call(fn), self.loop).result(self.WAIT_S)

    @staticmethod
    async def _call(fn):
        return fn()

    def __exit__(self, *exc) -> None:
        if self._task is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(self.WAIT_S)


async def serve_export(export, path: str, limits: ServerLimits, owners=None,
                       direct_io: str = "write-only") -> tuple[VirtioFsServer, asyncio.Task]:
    """-- session wiring (issue 17): serve ``export`` (a 9P server's :class:`Export`: the same
    provider, hold gate and undo core) as a virtio-fs device on ``path``, on the running loop —
    the loop that serves the export over 9P, which polls its undo core already. Returns once
    the socket listens (or raises why it cannot); cancel the task to stop it. ``direct_io``:
    :data:`DIRECT_IO_MODES`."""
    server = VirtioFsServer(lambda: Dispatcher(export, limits, owners=owners), limits, poll_interval_s=None,
                            direct_io=direct_io)
    listening = asyncio.Event()
    task = asyncio.get_running_loop().create_task(server.serve(path, listening.set))
    waiter = asyncio.get_running_loop().create_task(listening.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        task.result()  # raises why it could not listen
        raise RuntimeError(f"the virtio-fs server on {path} ended before listening")
    return server, task
