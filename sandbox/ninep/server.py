"""The asyncio 9P2000.L server: sockets, pipelining, flush and reply holding.

A thin loop around the codec (``codec``) and the per-connection :class:`~sandbox.ninep.connection.Connection`:
frames are split and decoded as bytes arrive; each request is handled at once in the
event loop (host calls are short and never block — special files are never opened)
and its reply written. A request that must wait — a mutation queued behind a
safeguard hold — becomes a task owned by its connection's
:class:`~sandbox.serving.pipeline.RequestPipeline`, keyed by its tag, so later requests
on the same connection go on (pipelining) and ``Tflush`` can cancel it. The holds are
decided through the session's :class:`~sandbox.serving.holds.HoldBroker` (``holds=``);
the export registry and gates are :mod:`sandbox.serving`'s — 9P keeps framing, Tflush
and its message table.

Invariants:

* errors while handling a request are never fatal: every exception becomes
  ``Rlerror(errno)`` (``EIO`` for the unexpected, which is also logged); a frame that
  cannot be decoded but has a readable tag gets ``Rlerror(EINVAL)``; only a broken
  frame boundary (size < 7 or > msize — 8 KiB until Tversion), a duplicate in-flight
  tag or a frame left incomplete too long closes that connection — the server and its
  other connections stay up;
* ``Tflush(oldtag)`` is answered after ``oldtag``'s reply if that was already sent,
  and otherwise cancels it so that it is never answered;
* every task belongs to its connection and is cancelled and awaited when the
  connection or the server closes; nothing is left running;
* mutating requests on an intercepted export count as in flight for the step tracker
  from receipt to reply, so a step's quiescence window waits for them;
* bounded — every limit is a field of :class:`~sandbox.limits.ServerLimits`, whose
  docstring has the table: connections (one more is accepted and closed at once, with a
  log line); per connection, the receive side holds at most one partial frame plus the
  unhandled frames of one read (``READ_BUFFER_BYTES``, read into one buffer kept per connection); a connection whose unsent replies pass
  ``write_buffer_bytes_max``, or whose requests held behind a safeguard pass
  ``held_request_bytes_per_connection_max``, is not read (its frames wait, in order)
  until they drain — backpressure instead of buffering without end; fids, open files,
  xattr values and directory listings per connection (:mod:`.connection`); the hold queue
  and locks per export; open files per process (a shared
  :class:`~sandbox.limits.DescriptorBudget`; the soft ``RLIMIT_NOFILE`` is raised to
  the hard limit when a server starts listening).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..core.errors import HoldRequired
from ..limits import PROCESS_DESCRIPTORS, DescriptorBudget, ServerLimits, raise_nofile_soft_limit
from ..mounts import Provider
from ..mounts.identity import OwnerMap
from ..serving import Export, HoldBroker, RequestPipeline
from ..serving.sockets import private_socket_path
from . import messages as m
from .codec import FrameSplitter, ProtocolError, decode, encode
from .connection import Connection

log = logging.getLogger("sandbox.fs_backend")

#: bytes one read of a connection's socket takes at most (asyncio's own read size), into a
#: buffer the connection allocates once: a plain ``recv`` of that size allocates (and frees) a
#: fresh 256 KiB object for every read, ~12 µs per request for a 40-byte Twalk (measured here)
READ_BUFFER_BYTES = 256 * 1024


@dataclass(frozen=True)
class ServerConfig:
    #: every resource limit (``sandbox/limits.py``); ``msize_bytes_max`` ≥ 512 KiB recommended
    limits: ServerLimits = field(default_factory=ServerLimits)
    #: how often the undo core's time-driven transitions run (ambient step close, hold expiry)
    poll_interval_s: float = 0.2
    #: the owners the guest sees (issue 13: the guest user's; :class:`sandbox.mounts.identity.OwnerMap`)
    owners: OwnerMap | None = None

    def __post_init__(self):
        if self.poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be positive")


def _errno_of(exc: BaseException) -> int:
    if isinstance(exc, OSError) and isinstance(exc.errno, int) and 0 < exc.errno < 4096:
        return exc.errno
    return errno.EIO


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, server: "NinePServer", conn_id: int):
        self.server = server
        self.conn_id = conn_id
        self.limits = limits = server.config.limits
        self.conn = Connection(server.exports, conn_id, limits, server.descriptors, owners=server.config.owners)
        self.splitter = FrameSplitter(limits.frame_bytes_before_version_max)
        self.inbox: deque[bytes] = deque()  # frames received, not yet handled (reading paused)
        self.pipeline = RequestPipeline(on_settled=self._pump)  # tasks by tag; held_bytes
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.refused = False
        self.reading = True  # False while paused by backpressure
        self._frame_timer: asyncio.TimerHandle | None = None
        self._read_buffer = memoryview(bytearray(READ_BUFFER_BYTES))  # what each read fills (see get_buffer)

    # -- transport callbacks --

    def connection_made(self, transport) -> None:
        self.transport = transport
        if len(self.server._connections) >= self.limits.connections_max:
            self.refused = self.closed = True
            log.warning("9p connection %d refused: %d connections are open (connections_max)",
                        self.conn_id, len(self.server._connections))
            transport.abort()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # SPEC §5: Nagle costs 10×
        transport.set_write_buffer_limits(high=self.limits.write_buffer_bytes_max)
        self.server._connections.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._stop_frame_timer()
        if self.refused:
            return
        self.inbox.clear()
        self.server._connections.discard(self)
        self.server._spawn(self._finish(self.pipeline.cancel_all()))

    async def _finish(self, tasks: list) -> None:
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.conn.close()

    def pause_writing(self) -> None:
        pass  # _pump checks the write buffer after every frame

    def resume_writing(self) -> None:
        self._pump()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_buffer  # filled by the socket's recv_into; buffer_updated copies out what it keeps

    def buffer_updated(self, nbytes: int) -> None:
        with self._read_buffer[:nbytes] as data:
            self.data_received(data)

    def data_received(self, data: bytes | memoryview) -> None:
        """``data``: received bytes, valid only during this call (the splitter copies the
        frames and any partial frame it keeps)."""
        try:
            frames = self.splitter.feed(data)
        except ProtocolError as e:
            log.warning("9p connection %d: %s; closing it", self.conn_id, e)
            self.transport.close()
            return
        if frames:
            self._stop_frame_timer()  # whatever is buffered now is a new frame: its clock starts now
            self.inbox.extend(frames)
        self._pump()

    # -- backpressure and the incomplete-frame deadline --

    def _over_limits(self) -> bool:
        return (self.transport.get_write_buffer_size() > self.limits.write_buffer_bytes_max
                or self.pipeline.held_bytes > self.limits.held_request_bytes_per_connection_max)

    def _pump(self) -> None:
        """Handle received frames in order while the connection is within its limits;
        stop reading it while it is over them, read again once they drained."""
        while self.inbox and not self.closed and not self.transport.is_closing():
            if self._over_limits():
                break
            self._frame(self.inbox.popleft())
        if self.closed or self.transport.is_closing():
            return
        want = not self.inbox and not self._over_limits()
        if want != self.reading:
            self.reading = want
            (self.transport.resume_reading if want else self.transport.pause_reading)()
        if self.reading and self.splitter.buffered:
            if self._frame_timer is None:  # from a frame's first byte; more bytes of it don't reset the clock
                self._frame_timer = asyncio.get_running_loop().call_later(
                    self.limits.frame_incomplete_timeout_s, self._frame_timeout)
        else:
            self._stop_frame_timer()  # a complete frame, or not reading: its sender may be blocked by us

    def _stop_frame_timer(self) -> None:
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def _frame_timeout(self) -> None:
        self._frame_timer = None
        if self.closed:
            return
        if any(e.gate is not None and e.gate.busy for e in self.server.exports.values()):
            # a VM paused while the user answers a safeguard cannot finish its frame: wait
            self._pump()
            return
        log.warning("9p connection %d: a frame incomplete for %g s (%d bytes of it received); closing it",
                    self.conn_id, self.limits.frame_incomplete_timeout_s, self.splitter.buffered)
        self.transport.abort()

    # -- requests --

    def _send(self, tag: int, msg: m.Message) -> None:
        if self.closed:
            return
        try:
            data = encode(tag, msg)
        except ValueError as e:  # a reply we cannot represent: a bug or absurd host data
            log.error("9p: cannot encode %s: %s", type(msg).__name__, e)
            data = encode(tag, m.Rlerror(errno.EIO))
        self.transport.write(data)

    def _frame(self, frame: bytes) -> None:
        try:
            tag, msg = decode(frame)
        except ProtocolError as e:
            if e.tag is None:
                log.warning("9p connection %d: %s; closing it", self.conn_id, e)
                self.transport.close()
            else:
                log.info("9p connection %d: bad request (tag %d): %s", self.conn_id, e.tag, e)
                self._send(e.tag, m.Rlerror(errno.EINVAL))
            return
        if tag in self.pipeline:
            log.warning("9p connection %d: tag %d reused while in flight; closing it", self.conn_id, tag)
            self.transport.close()
            return
        if isinstance(msg, m.Tflush):
            self._flush(tag, msg.oldtag)
            return
        try:
            export = self.conn.gated_export(msg)
        except Exception:  # pragma: no cover - gated_export only reads the fid table
            export = None

        def reply(result, error) -> None:
            self._send(tag, result if error is None else self._error(msg, error))

        self.pipeline.run(tag, export, lambda: self.conn.handle(msg), len(frame), reply)
        if isinstance(msg, m.Tversion):  # frames are bounded by the msize now agreed
            self.splitter.msize = self.conn.msize or self.limits.frame_bytes_before_version_max

    def _error(self, msg: m.Message, e: BaseException) -> m.Rlerror:
        if isinstance(e, HoldRequired):  # pragma: no cover - only gated requests can hold
            log.error("9p: %s held outside the gate", type(msg).__name__)
        elif not isinstance(e, OSError):
            log.exception("9p: %s failed unexpectedly", type(msg).__name__, exc_info=e)
        return m.Rlerror(_errno_of(e))

    def _flush(self, tag: int, oldtag: int) -> None:
        t = self.pipeline.cancel(oldtag)
        if t is None:
            self._send(tag, m.Rflush())
            return

        async def answer():
            await asyncio.gather(t, return_exceptions=True)
            self._send(tag, m.Rflush())

        self.pipeline.own(tag, asyncio.get_running_loop().create_task(answer()))


class NinePServer:
    """Serve one or more providers (selected by the attach name; the first is the default).

    ``holds``: the session's :class:`~sandbox.serving.holds.HoldBroker` (a server of its
    own gets one). ``decide(hold) -> "allow"|"deny"`` (sync or async), if given, is
    subscribed to it (:meth:`HoldBroker.ask`) until the server closes."""

    def __init__(self, exports: Provider | dict[str, Provider], config: ServerConfig | None = None,
                 decide: Callable | None = None, descriptors: DescriptorBudget = PROCESS_DESCRIPTORS,
                 *, holds: HoldBroker | None = None):
        self.config = config or ServerConfig()
        self.descriptors = descriptors
        self.holds = holds if holds is not None else HoldBroker()
        self._unask = self.holds.ask(decide) if decide is not None else None
        if isinstance(exports, Provider):
            exports = {"": exports}
        self.exports = {name.strip("/"): Export(p, self.holds, self.config.limits, name=name.strip("/"))
                        for name, p in exports.items()}
        self._sockets_reserved = 0
        self._servers: list[asyncio.base_events.Server] = []
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._next_conn = 1
        self._poller: asyncio.Task | None = None
        self.unix_path: str | None = None

    # -- lifecycle --

    def _protocol(self) -> _Connection:
        conn = _Connection(self, self._next_conn)
        self._next_conn += 1
        return conn

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _listening(self) -> None:
        """Once per server, when it first listens (before any connection): raise the process's soft
        ``RLIMIT_NOFILE`` to the hard limit and keep a descriptor for each possible
        connection's socket out of the budget clients' open files share."""
        if not self._sockets_reserved:
            raise_nofile_soft_limit()
            self._sockets_reserved = self.config.limits.connections_max
            self.descriptors.reserve_sockets(self._sockets_reserved)

    def _start_poller(self) -> None:
        if self._poller is None and any(e.provider.interceptor is not None for e in self.exports.values()):
            self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            self.holds.poll()  # deadlines of holds nobody waits on (their connection closed)
            for e in self.exports.values():
                try:
                    e.provider.poll()
                except Exception:
                    log.exception("undo core poll failed for %s", e.provider.label)

    async def start_unix(self, path: str) -> None:
        """Listen on a unix socket (mode 0600). A stale socket at ``path`` is replaced;
        anything else there is an error."""
        with private_socket_path(path):
            srv = await asyncio.get_running_loop().create_unix_server(self._protocol, path)
        self._listening()
        self.unix_path = path
        self._servers.append(srv)
        self._start_poller()

    async def start_tcp(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on TCP (loopback by default); returns the port."""
        srv = await asyncio.get_running_loop().create_server(self._protocol, host, port)
        self._listening()
        self._servers.append(srv)
        self._start_poller()
        return srv.sockets[0].getsockname()[1]

    def resolve(self, hold_id: str, action: str) -> bool:
        """Answer a pending safeguard hold (``self.holds.answer``)."""
        return self.holds.answer(hold_id, action)

    def add_export(self, name: str, provider: Provider) -> None:
        """Serve ``provider`` under the attach name ``name`` from now on (a live mount).
        Call on the server's loop. ``ValueError`` if the name is taken."""
        name = name.strip("/")
        if not name or name in self.exports:
            raise ValueError(f"export name {name!r} is empty or already served")
        # connections share this dict: a new attach finds the export at once
        self.exports[name] = Export(provider, None, self.config.limits)

    def remove_export(self, name: str) -> Provider:
        """Stop serving ``name`` to new attaches; fids already attached keep their export
        until clunked. Returns the provider (the caller closes it). Call on the loop."""
        name = name.strip("/")
        if len(self.exports) <= 1 or name not in self.exports:
            raise ValueError(f"no removable export named {name!r}")
        return self.exports.pop(name).provider

    async def close(self) -> None:
        if self._unask is not None:
            self._unask()
            self._unask = None
        for srv in self._servers:
            srv.close()
        for conn in list(self._connections):
            if conn.transport is not None:
                conn.transport.close()
        for srv in self._servers:
            await srv.wait_closed()
        self._servers.clear()
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._sockets_reserved:
            self.descriptors.release_sockets(self._sockets_reserved)
            self._sockets_reserved = 0
        if self.unix_path is not None:
            try:
                os.unlink(self.unix_path)
            except FileNotFoundError:
                pass
            self.unix_path = None


class ServerThread:
    """Run a :class:`NinePServer` on its own event loop in a background thread.

    For synchronous embedders and tests: ``with ServerThread(server, unix_path=p): …``.
    ``call(fn)`` runs ``fn`` on the server's loop and returns its result (for state the
    loop owns)."""

    def __init__(self, server: NinePServer, unix_path: str | None = None, tcp: bool = False):
        self.server = server
        self.unix_path = unix_path
        self.tcp = tcp
        self.port: int | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="9p-server", daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        try:
            self.run(self._start())
        except BaseException:
            self._stop_loop()
            raise
        return self

    async def _start(self) -> None:
        if self.unix_path:
            await self.server.start_unix(self.unix_path)
        if self.tcp:
            self.port = await self.server.start_tcp()

    def run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn: Callable, timeout_s: float = 60.0):
        async def go():
            return fn()

        return self.run(go(), timeout_s)

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()

    def __exit__(self, *exc) -> None:
        try:
            self.run(self.server.close())
        finally:
            self._stop_loop()
