"""The ``/dev/fuse`` transport: mount, the request loop, unmount.

A thin loop around the codec and the :class:`~sandbox.fuse.dispatcher.Dispatcher`, on an
asyncio event loop (as the 9P server): the ``/dev/fuse`` descriptor is non-blocking and
watched with ``add_reader``; each readable wake-up reads up to
:data:`REQUESTS_PER_WAKEUP_MAX` requests, each into one reused buffer of
:data:`~sandbox.fuse.abi.READ_BUFFER_BYTES` (the largest request: a 1 MiB write and its
headers; a fresh 1 MiB ``os.read`` per request cost ~50 µs of allocation, most of a small
request's round trip), decodes it from a read-only view of that buffer (a WRITE's data
stays a view of it down to the host's ``pwrite``: no copy) and hands it to the dispatcher,
whose pipeline answers it at once or — a mutation met by a safeguard hold — later, while
other requests flow; a deferred request keeps no view of the buffer (its WRITE data is
copied then: a request waiting costs its own size, not the buffer's). Replies are
written whole with one ``write(2)`` each.

Mounting (:func:`mount`): as root with ``mount(2)`` (ctypes) — options
``fd=N,rootmode=40000,user_id=U,group_id=G,default_permissions,allow_other``, flags
``MS_NOSUID|MS_NODEV``; otherwise through ``fusermount3`` (``_FUSE_COMMFD``: it opens
``/dev/fuse``, mounts, and passes the descriptor back with ``SCM_RIGHTS``), without
``allow_other``. Always ``nosuid,nodev``: the mount reports emulated device nodes and
guest set-id bits, which must never be honoured on the host. ``default_permissions``: the
kernel checks permissions against the attributes we report (the mapped owners and modes).

Invariants:

* errors are never fatal: a request that fails is answered ``-errno`` (``EIO`` for the
  unexpected, logged); one that cannot be decoded but has a readable unique id is answered
  with the decoder's errno (``ENOSYS`` for an unknown opcode); one without is logged and
  dropped; a reply the kernel no longer wants (``ENOENT``: interrupted) is dropped;
* ``ENODEV`` on read (the mount is gone: unmounted, or the connection aborted) ends the
  loop, which then closes every handle (:meth:`Dispatcher.close`);
* stopping (``ENODEV``, :meth:`FuseServer.stop`): gated requests fail ``EIO`` at once, held
  ones are answered ``EIO``, and requests are still answered until the notifier's thread
  has ended (≤ :data:`NOTIFY_STOP_TIMEOUT_S`) — its last write may wait for one of them;
* invalidation notifications (:meth:`FuseServer.invalidate`, from any thread) are written
  by the :class:`~sandbox.fuse.notify.Notifier`'s thread, never this loop's, and only while
  no request is held; a safeguard's deny (a rollback behind the kernel's back) invalidates
  everything the kernel knows;
* bounded: one request buffer per read (:data:`~sandbox.fuse.abi.READ_BUFFER_BYTES`);
  requests held behind a safeguard hold ≤ ``held_request_bytes_per_connection_max``
  bytes — beyond it the descriptor is not read until they drain (the kernel queues, the
  callers block: backpressure); the kernel's own queue is bounded by ``max_background``.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import socket
import subprocess

from ..core.errors import HoldRequired
from ..limits import ServerLimits
from . import abi
from . import messages as m
from .codec import decode_request, encode_error, encode_reply
from .dispatcher import Dispatcher, errno_of
from .notify import Notifier

log = logging.getLogger("sandbox.fuse")


def _opcode_name(opcode: int | None) -> str:
    """What :attr:`FuseServer.op_counts` calls a request it could not decode."""
    if opcode is None:
        return "undecodable"
    try:
        return abi.Opcode(opcode).name
    except ValueError:
        return f"opcode {opcode}"

#: requests read per wake-up of the event loop before it runs other callbacks (held tasks, timers)
REQUESTS_PER_WAKEUP_MAX = 64
#: seconds between runs of the undo core's time-driven transitions (ambient step close, hold expiry)
POLL_INTERVAL_S = 0.2
#: seconds the server, stopping, keeps answering requests so the notifier's last write can finish
NOTIFY_STOP_TIMEOUT_S = 5.0
#: seconds `fusermount3` may take to mount or unmount
FUSERMOUNT_TIMEOUT_S = 30
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
#: the filesystem type and source name the mount shows in /proc/mounts
FS_TYPE, FS_NAME = "fuse.sandbox", "sandbox"


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def mount_options(fd: int, uid: int, gid: int, allow_other: bool) -> str:
    opts = f"fd={fd},rootmode=40000,user_id={uid},group_id={gid},default_permissions"
    return opts + (",allow_other" if allow_other else "")


def mount(mountpoint: str, *, read_only: bool = False) -> tuple[int, bool]:
    """Mount an empty FUSE filesystem at ``mountpoint``; returns ``(fd, via_fusermount)``.

    As root: ``mount(2)`` with ``allow_other`` (tools running as other users work on it,
    checked by ``default_permissions``). Otherwise ``fusermount3``; ``OSError`` if neither
    is possible (``EPERM`` with the reason)."""
    mountpoint = os.path.abspath(mountpoint)
    if os.geteuid() == 0:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        flags = MS_NOSUID | MS_NODEV | (1 if read_only else 0)  # MS_RDONLY = 1
        opts = mount_options(fd, os.getuid(), os.getgid(), allow_other=True).encode()
        if _libc().mount(FS_NAME.encode(), os.fsencode(mountpoint), FS_TYPE.encode(), ctypes.c_ulong(flags), opts):
            e = ctypes.get_errno()
            os.close(fd)
            raise OSError(e, f"mount(2) of a FUSE filesystem failed: {os.strerror(e)}", mountpoint)
        return fd, False
    return _fusermount(mountpoint, read_only), True


def _fusermount(mountpoint: str, read_only: bool) -> int:
    tool = shutil.which("fusermount3")
    if tool is None:
        raise OSError(errno.EPERM, "not root, and fusermount3 is not installed (apt-get install fuse3)", mountpoint)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        opts = f"default_permissions,nosuid,nodev,fsname={FS_NAME},subtype=sandbox" + (",ro" if read_only else "")
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        proc = subprocess.run([tool, "-o", opts, "--", mountpoint], env=env, pass_fds=(theirs.fileno(),),
                              capture_output=True, timeout=FUSERMOUNT_TIMEOUT_S)
        theirs.close()
        if proc.returncode != 0:
            raise OSError(errno.EPERM, f"fusermount3 failed: {proc.stderr.decode(errors='replace').strip()}",
                          mountpoint)
        _msg, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
        if not fds:
            raise OSError(errno.EIO, "fusermount3 passed no descriptor", mountpoint)
        os.set_inheritable(fds[0], False)
        return fds[0]
    finally:
        theirs.close()
        ours.close()


def unmount(mountpoint: str, via_fusermount: bool) -> None:
    """Detach the mount (lazily: busy files stay usable until closed; the request loop then
    reads ``ENODEV``). A mount already gone is not an error."""
    mountpoint = os.path.abspath(mountpoint)
    if via_fusermount:
        tool = shutil.which("fusermount3") or "fusermount3"
        subprocess.run([tool, "-u", "-z", "--", mountpoint], capture_output=True, timeout=FUSERMOUNT_TIMEOUT_S)
        return
    if _libc().umount2(os.fsencode(mountpoint), MNT_DETACH):
        e = ctypes.get_errno()
        if e not in (errno.EINVAL, errno.ENOENT):  # not mounted (any more)
            raise OSError(e, f"umount2 failed: {os.strerror(e)}", mountpoint)


def reply_bytes(unique: int, reply, error: BaseException | None) -> bytes:
    """The wire bytes of the dispatcher's answer to ``unique`` (``-errno`` for an error;
    ``EIO``, logged, for the unexpected or a reply that cannot be encoded) — shared by the
    /dev/fuse and virtio-fs servers."""
    if error is not None:
        if isinstance(error, HoldRequired):  # pragma: no cover - only gated requests can hold
            log.error("fuse: request %d held outside the gate", unique)
        elif not isinstance(error, OSError):
            log.error("fuse: request %d failed unexpectedly", unique, exc_info=error)
        return encode_error(unique, errno_of(error))
    try:
        return encode_reply(unique, reply)
    except ValueError as e:  # a reply we cannot represent: a bug or absurd host data
        log.error("fuse: cannot encode the reply to %d: %s", unique, e)
        return encode_error(unique, errno.EIO)


async def poll_export(export, interval_s: float) -> None:
    """Forever: every ``interval_s``, the undo core's time-driven transitions (ambient step
    close, hold expiry) for ``export`` — shared by the /dev/fuse and virtio-fs servers."""
    while True:
        await asyncio.sleep(interval_s)
        if export.gate is not None:
            export.gate.broker.poll()
        try:
            export.provider.poll()
        except Exception:
            log.exception("undo core poll failed for %s", export.provider.label)


class FuseServer:
    """Serve ``dispatcher`` on the FUSE descriptor ``fd`` until the mount goes away
    (:meth:`serve`) — module docstring."""

    def __init__(self, dispatcher: Dispatcher, fd: int, limits: ServerLimits = ServerLimits(),
                 poll_interval_s: float | None = POLL_INTERVAL_S):
        """``poll_interval_s``: None when another loop already polls the export's undo core and
        holds (a session's 9P server does, for every export)."""
        self.dispatcher = dispatcher
        self.fd = fd
        self.limits = limits
        self.poll_interval_s = poll_interval_s
        self.reading = False
        self.requests = 0  # handled (for tests and logs)
        #: requests read, by opcode name (cheap; ``sandbox mount --op-counts`` prints them for
        #: benchmarks): every one, also those answered without being decoded (an IOCTL: ENOSYS)
        self.op_counts: collections.Counter[str] = collections.Counter()
        self.notifier = Notifier(fd, self._invalidations)  # its thread runs while serving
        self._buf = memoryview(bytearray(abi.READ_BUFFER_BYTES))  # reused; each request is copied out
        self._done: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False  # never read again (stopped, or the mount is gone)
        dispatcher.on_settled = self._resume  # a held request ended: read again if paused
        # the host's kernel, with the watcher's notifications: no-open when coherent at INIT
        # (docs/fuse.md "No-open"); the virtio-fs device does not set it
        dispatcher.no_open_allowed = True
        # without the watcher, host changes the dispatcher notices in attributes it reports
        dispatcher.on_host_changed = self.invalidate
        # a filling node table: the kernel is asked to forget the oldest names (Dispatcher._relieve)
        dispatcher.on_node_pressure = self.invalidate

    async def serve(self) -> None:
        """Until ``ENODEV`` (unmounted) or :meth:`stop`; then every handle is closed."""
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        os.set_blocking(self.fd, False)
        self.notifier.start(self._loop)
        unsubscribe = self._on_denials()
        self._start_reading()
        pollers = [self._loop.create_task(self._poll_loop())] if self.poll_interval_s is not None else []
        try:
            await self._done
        finally:
            unsubscribe()
            await self._drain()
            self._closed = True
            self._stop_reading()
            for p in pollers:
                p.cancel()
            await asyncio.gather(*pollers, return_exceptions=True)
            self.dispatcher.close()

    async def _drain(self) -> None:
        """Stopping: gated requests fail at once (no new hold), held ones are answered ``EIO``
        (the kernel releases what they lock), and requests are still answered until the
        notifier's last write — which may wait for one of them — has finished."""
        self.dispatcher.closing = True
        self.notifier.stop()
        tasks = self.dispatcher.pipeline.cancel_all(OSError(errno.EIO, "the mount is going away"))
        await asyncio.gather(*tasks, return_exceptions=True)
        self._resume()
        if not await self._loop.run_in_executor(None, self.notifier.join, NOTIFY_STOP_TIMEOUT_S):
            log.warning("fuse: a notification still waits for the kernel after %.0f s; stopping anyway",
                        NOTIFY_STOP_TIMEOUT_S)

    def stop(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    # -- invalidation (any thread)

    def invalidate(self, paths) -> None:
        """``paths`` (relative to the root) changed beside the mount: the kernel forgets them."""
        self.notifier.changed(paths)

    def invalidate_all(self) -> None:
        """Anything may have changed (a rollback, lost watcher events): the kernel forgets all."""
        self.notifier.everything()

    def set_coherent(self, coherent: bool) -> None:
        """Whether every change beside the mount is notified (:attr:`Dispatcher.coherent`).
        Losing it invalidates everything once (what the kernel cached may already be stale;
        from then on the dispatcher compares what it reports, :meth:`Dispatcher._told`)."""
        if not coherent and self.dispatcher.coherent:
            self.invalidate_all()
        if self._loop is None or self._closed:
            self.dispatcher.coherent = coherent
            return
        try:
            self._loop.call_soon_threadsafe(setattr, self.dispatcher, "coherent", coherent)
        except RuntimeError:  # the loop is closed: nothing is served any more
            pass

    def _invalidations(self, paths):
        return self.dispatcher.invalidations_all() if paths is None else self.dispatcher.invalidations(paths)

    def _on_denials(self):
        """A safeguard's deny rolled a step back behind the kernel's back: invalidate all."""
        gate = self.dispatcher.export.gate
        if gate is None:
            return lambda: None

        def on(kind: str, payload: dict) -> None:
            if kind == "resolved" and payload.get("action") == "deny":
                self.invalidate_all()

        return gate.broker.subscribe(on)

    def _quiet(self) -> None:
        self.notifier.set_quiet(not self.dispatcher.pipeline.tasks)

    async def _poll_loop(self) -> None:
        await poll_export(self.dispatcher.export, self.poll_interval_s)

    # -- reading, with backpressure

    def _over_limits(self) -> bool:
        return self.dispatcher.pipeline.held_bytes > self.limits.held_request_bytes_per_connection_max

    def _start_reading(self) -> None:
        if not self.reading and self._done is not None and not self._closed:
            self.reading = True
            self._loop.add_reader(self.fd, self._readable)

    def _stop_reading(self) -> None:
        if self.reading:
            self.reading = False
            self._loop.remove_reader(self.fd)

    def _resume(self) -> None:
        self._quiet()
        if not self.reading and not self._over_limits():
            self._start_reading()

    def _readable(self) -> None:
        for _ in range(REQUESTS_PER_WAKEUP_MAX):
            if self._over_limits():
                self._stop_reading()
                return
            try:
                n = os.readv(self.fd, [self._buf])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno == errno.ENOENT:  # interrupted before we read it
                    continue
                if e.errno != errno.ENODEV:
                    log.error("fuse: read from /dev/fuse failed: %s; stopping", e)
                self._closed = True  # never read again (the descriptor stays readable)
                self._stop_reading()
                self.stop()
                return
            # the buffer is read into again at once, even after a request deferred behind a
            # hold: that keeps no view of it (Dispatcher.submit copies a deferred WRITE's data)
            self._request(self._buf[:n].toreadonly())

    def _request(self, buf: memoryview) -> bool:
        """Decode and submit one request read into ``buf`` (a read-only view of the read
        buffer, valid until the next read); True if it was deferred behind a hold."""
        self.requests += 1
        try:
            req = decode_request(buf)
        except m.ProtocolError as e:
            self.op_counts[_opcode_name(e.opcode)] += 1
            if e.unique is None:
                log.warning("fuse: undecodable request dropped: %s", e)
            else:
                if not isinstance(e, m.UnknownOpcode):
                    log.info("fuse: bad request: %s", e)
                self._send(e.unique, None, OSError(e.errno, e.message))
            return False
        self.op_counts[req.OPCODE.name] += 1
        deferred = self.dispatcher.submit(req, len(buf), self._send)
        if deferred or isinstance(req, m.Interrupt):
            self._quiet()
        if isinstance(req, m.Destroy):
            self.stop()
        return deferred

    def _send(self, unique: int, reply, error: BaseException | None) -> None:
        data = reply_bytes(unique, reply, error)
        try:
            os.write(self.fd, data)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV):  # interrupted, or the mount is gone
                log.error("fuse: writing the reply to %d failed: %s", unique, e)
