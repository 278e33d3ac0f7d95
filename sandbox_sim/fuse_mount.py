"""A real FUSE mount served in process, for tests: the kernel, ``/dev/fuse``, our dispatcher.

:class:`ServedMount` mounts a :class:`~sandbox.mounts.Provider` at a directory with
:func:`sandbox.fuse.transport.mount` and runs :class:`~sandbox.fuse.transport.FuseServer`
on an asyncio loop in a background thread — what ``sandbox mount`` does, minus the CLI —
so a test can run real system calls (its own ``os.*`` calls, forked helpers, real programs)
on the mount while it inspects the folder and the undo core directly.

``lock`` (optional): a :class:`threading.Lock` the server takes around each batch of
requests it reads. A test that holds it while it uses the undo core from its own thread
(step boundaries, rollbacks, snapshots) keeps the server from running at the same time —
the kernel sends some requests on its own (RELEASE after a close, FORGET) — and releases
it while it makes system calls on the mount (:class:`Unlocked`).

:func:`fuse_unavailable` says why a real mount cannot be made here (``None``: it can);
tests skip with that reason.

:class:`MountFS` is the undo model's client on a mount: the HostFS API of
:class:`~sandbox.hostfs.real.RealHostFS` rooted at the mount point (every path resolved
beneath it with ``openat2``, no symlink followed, so a model's symlink to ``/etc/passwd``
is never written through), plus the few program-shaped calls
:class:`sandbox_sim.client.SimClient` uses (``write_file`` is one ``open(O_CREAT|O_TRUNC)``
and a write, as a shell's ``>`` is).
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import threading

from sandbox.core.tree_ops import TreeOps
from sandbox.fuse.dispatcher import Dispatcher
from sandbox.fuse.transport import FuseServer, mount, unmount
from sandbox.hostfs import DIR
from sandbox.hostfs.real import RealHostFS
from sandbox.limits import ServerLimits
from sandbox.serving import Export, HoldBroker

#: seconds a test waits for the server thread to end after the unmount
STOP_TIMEOUT_S = 30
#: the server's poll interval when the test drives the undo core's clock itself (never, in practice)
NO_POLL_S = 10**6


def fuse_unavailable() -> str | None:
    """Why no FUSE filesystem can be mounted here by this process, or None."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if os.geteuid() != 0:
        return "not root: the in-process mount uses mount(2) (the fusermount3 path is not exercised here)"
    return None


class _LockedServer(FuseServer):
    """FuseServer that reads and handles each batch of requests under ``lock``."""

    lock: threading.Lock

    def _readable(self) -> None:
        with self.lock:
            super()._readable()


class ServedMount:
    """``provider`` mounted at ``point`` and served from a background thread (module doc)."""

    def __init__(self, provider, point: str, *, holds: HoldBroker | None = None,
                 limits: ServerLimits = ServerLimits(), lock: threading.Lock | None = None,
                 poll_interval_s: float = NO_POLL_S, coherent: bool = False):
        """``coherent``: serve as a mount whose watcher runs (long caches, no-open), for
        tests that change the folder only through the mount (nothing beside it to notify)."""
        self.provider = provider
        self.coherent = coherent
        self.point = os.path.realpath(point)
        self.holds = holds if holds is not None else HoldBroker()
        self.limits = limits
        self.lock = lock
        self.poll_interval_s = poll_interval_s
        self.export = Export(provider, self.holds, limits)
        self._thread: threading.Thread | None = None
        self._fd = -1
        self.failure: BaseException | None = None

    def start(self) -> "ServedMount":
        """Mount and serve; ``OSError`` if the kernel refuses the mount (the caller skips)."""
        self.dispatcher = Dispatcher(self.export, self.limits)
        self.dispatcher.coherent = self.coherent
        self._fd, self._via_fusermount = mount(self.point)
        if self.lock is not None:
            server = _LockedServer(self.dispatcher, self._fd, self.limits, self.poll_interval_s)
            server.lock = self.lock
        else:
            server = FuseServer(self.dispatcher, self._fd, self.limits, self.poll_interval_s)
        self.server = server

        def run() -> None:
            try:
                asyncio.run(server.serve())
            except BaseException as e:  # reported by stop()
                self.failure = e

        self._thread = threading.Thread(target=run, name=f"fuse {self.point}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Unmount (lazily) and wait for the loop to read ``ENODEV`` and close every handle.
        The caller must not hold ``lock``."""
        if self._thread is None:
            return
        try:
            unmount(self.point, self._via_fusermount)
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                self.server._loop.call_soon_threadsafe(self.server.stop)
                self._thread.join(STOP_TIMEOUT_S)
            assert not self._thread.is_alive(), "the FUSE server did not stop after the unmount"
        finally:
            self._thread = None
            os.close(self._fd)
        if self.failure is not None:
            raise AssertionError(f"the FUSE server failed: {self.failure!r}") from self.failure

    def __enter__(self) -> "ServedMount":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MountFS(RealHostFS, TreeOps):
    """The undo model's client on a mount point (module doc)."""

    def open_trunc(self, path: str) -> None:
        os.close(self._open_file(path, os.O_WRONLY | os.O_TRUNC))

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """``echo data > path``: one ``open(O_WRONLY|O_CREAT|O_TRUNC)`` (a CREATE, or an
        OPEN with ``O_TRUNC``), then the write. A FIFO there is ``ENXIO`` without opening it
        (what a non-blocking open gives with no reader): ``echo`` would wait for a reader
        forever, and no test has one."""
        try:
            st = self.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and st.kind == DIR:
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        if st is not None and st.fmt == stat.S_IFIFO:
            raise OSError(errno.ENXIO, "a FIFO with no reader", path)
        pfd, name = self._parent(path)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                         dir_fd=pfd)
        finally:
            os.close(pfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


class Unlocked:
    """``target`` whose method calls run with ``lock`` released (the caller holds it): the
    FUSE server may then serve the system calls they make."""

    def __init__(self, target, lock: threading.Lock):
        self._target = target
        self._lock = lock

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            self._lock.release()
            try:
                return value(*args, **kwargs)
            finally:
                self._lock.acquire()

        return call
