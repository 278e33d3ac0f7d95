"""Telling the kernel what changed beside the mount: FUSE invalidation notifications.

The watcher (:mod:`sandbox.barriers.watch`) reports paths that changed on the host without
going through the mount; a safeguard's deny rolls a step back behind the kernel's back.
Either way the kernel's caches (names, attributes, file pages) may now be wrong, and
:class:`Notifier` tells it to forget them: ``NotifyInvalEntry`` for a name under a
directory node, ``NotifyInvalInode`` for a node's attributes and pages (what
:meth:`~sandbox.fuse.dispatcher.Dispatcher.invalidations` computes).

Invariants:

* notifications are written by the notifier's own thread, never on the event loop: the
  kernel may need one of our replies before such a write returns (dropping a file's pages
  waits for page locks that an unanswered READ or WRITE holds; dropping a name waits for
  the directory's lock that an unanswered UNLINK, CREATE or RENAME holds), and the loop is
  what answers them;
* a notification is written only while no request waits behind a safeguard hold
  (:meth:`Notifier.set_quiet`): those may wait long, and the write would wait with them;
* the nodes a path names are read on the event loop (the dispatcher's tables are the
  loop's), handed over with a bounded wait (:data:`NOTIFY_HANDOFF_TIMEOUT_S`; if the loop
  does not answer in time — it is stopping — the batch is dropped);
* bounded: at most :data:`NOTIFY_PATHS_PENDING_MAX` paths wait; one more turns the pending
  work into one "everything" invalidation (every name and node the kernel knows);
* the kernel not knowing a node or name any more (``ENOENT``) is not an error; the mount
  being gone (``ENODEV``, ``EBADF``) ends the thread;
* :meth:`Notifier.stop` lets no new write start; the write under way, if any, ends when the
  request it waits for is answered (the server keeps answering until :meth:`join`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import threading
from collections import deque
from typing import Callable

from . import messages as m
from .codec import encode_notify

log = logging.getLogger("sandbox.fuse")

#: changed paths waiting to be notified; one more: everything is invalidated instead
NOTIFY_PATHS_PENDING_MAX = 4096
#: seconds the notifier waits for the event loop to say which nodes a batch names
NOTIFY_HANDOFF_TIMEOUT_S = 5.0
#: paths whose notifications were written, remembered for :meth:`Notifier.wait_flushed`
FLUSHED_REMEMBERED_MAX = 1024
#: what :meth:`Notifier.wait_flushed` sees after an "everything" invalidation
EVERYTHING = "*"
#: seconds without a new inotify event before the watcher hands a batch over (the barrier
#: watcher's default is 50 ms: here it is how long a host edit may be served stale), and
#: the longest a batch may keep growing under a stream of events
WATCH_SETTLE_S = 0.005
WATCH_BATCH_MAX_S = 0.1


class Notifier:
    """Invalidation notifications for one mount's descriptor ``fd`` (module docstring).

    ``compute(paths)``: the notifications for ``paths`` (None: everything), run on the loop
    given to :meth:`start`; changes reported before it are kept until then."""

    def __init__(self, fd: int, compute: Callable[[list[str] | None], list[m.Notify]],
                 paths_max: int = NOTIFY_PATHS_PENDING_MAX):
        self.fd = fd
        self.compute = compute
        self.loop: asyncio.AbstractEventLoop | None = None
        self.paths_max = paths_max
        self.written = 0  # notifications written (the kernel took them, or had forgotten the node)
        self.batches = 0  # batches whose notifications were all written
        self.flushed: deque[tuple[int, str]] = deque(maxlen=FLUSHED_REMEMBERED_MAX)  # (batch, path)
        self._cond = threading.Condition()
        self._paths: set[str] = set()
        self._everything = False
        self._quiet = True
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="sandbox-fuse-notify", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> "Notifier":
        self.loop = loop
        self._thread.start()
        return self

    # -- any thread

    def changed(self, paths) -> None:
        """``paths`` changed beside the mount: notify the kernel (soon, in order of batches)."""
        with self._cond:
            if self._stopping:
                return
            if not self._everything:
                self._paths.update(paths)
                if len(self._paths) > self.paths_max:
                    log.warning("fuse: more than %d changed paths pending: invalidating everything", self.paths_max)
                    self._paths.clear()
                    self._everything = True
            self._cond.notify_all()

    def everything(self) -> None:
        """Anything may have changed: every name and node the kernel knows is invalidated."""
        with self._cond:
            if self._stopping:
                return
            self._paths.clear()
            self._everything = True
            self._cond.notify_all()

    def set_quiet(self, quiet: bool) -> None:
        """The server says whether no request waits behind a hold now (notifications wait if one does)."""
        with self._cond:
            if quiet != self._quiet:
                self._quiet = quiet
                self._cond.notify_all()

    def mark(self) -> int:
        """The number of batches written so far (for :meth:`wait_flushed`)."""
        with self._cond:
            return self.batches

    def wait_flushed(self, path: str, timeout_s: float, since: int = 0) -> bool:
        """Wait until the notifications of a batch after the ``since``-th holding ``path``
        (or an "everything") have been written; False if ``timeout_s`` passed first."""
        def done() -> bool:
            return any(n > since and p in (path, EVERYTHING) for n, p in self.flushed)

        with self._cond:
            return self._cond.wait_for(done, timeout_s)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def join(self, timeout_s: float | None = None) -> bool:
        """True if the thread has ended."""
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or (self._quiet and (self._paths or self._everything)))
                if self._stopping:
                    return
                batch, every = sorted(self._paths), self._everything
                self._paths, self._everything = set(), False
            notes = self._handoff(None if every else batch)
            if notes is None:
                continue
            for note in notes:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or self._quiet)
                    if self._stopping:
                        return
                if not self._write(note):
                    return
            with self._cond:
                self.batches += 1
                self.flushed.extend((self.batches, p) for p in ([EVERYTHING] if every else batch))
                self._cond.notify_all()

    def _handoff(self, paths: list[str] | None) -> list[m.Notify] | None:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def compute() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(self.compute(paths))
                except BaseException as e:  # noqa: BLE001 - handed to the notifier thread, which logs it
                    fut.set_exception(e)

        try:
            self.loop.call_soon_threadsafe(compute)
            return fut.result(NOTIFY_HANDOFF_TIMEOUT_S)
        except (RuntimeError, concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            fut.cancel()
            log.info("fuse: the event loop did not answer (stopping?): %s invalidation(s) dropped",
                     "all" if paths is None else len(paths))
        except Exception:
            log.exception("fuse: computing invalidations failed")
        return None

    def _write(self, note: m.Notify) -> bool:
        try:
            os.write(self.fd, encode_notify(note))
        except OSError as e:
            if e.errno in (errno.ENODEV, errno.EBADF):
                return False  # the mount is gone
            if e.errno != errno.ENOENT:  # ENOENT: the kernel had forgotten it already
                log.warning("fuse: notification %s failed: %s", note, e)
        self.written += 1
        return True


def watch(server, folder: str, own_writes=None) -> Callable[[], None]:
    """Start the external-modification watcher on ``folder`` (the mount's working folder)
    for ``server`` (a :class:`~sandbox.fuse.transport.FuseServer`): each change it sees is
    invalidated in the kernel, and while it runs the dispatcher is *coherent* (long
    timeouts, the page cache kept across opens). ``own_writes``: the journal of the
    workspace's own writes (:func:`~sandbox.serving.workspaces.open_workspace`), which are
    not reported; None (a read-only mount, nothing written through it): every change is.
    A lost batch (the inotify queue overflowed) invalidates everything; a watcher that can
    no longer see everything (the watch limit, a failure) also makes the dispatcher
    non-coherent again. Returns ``stop()`` (call it before closing the workspace)."""
    from ..barriers.watch import OVERFLOW_WARNING, TreeWatcher
    from ..serving.workspaces import watch_workspace

    def on_external(paths) -> None:
        server.invalidate(paths)

    def on_warning(message: str) -> None:
        log.warning("fuse: %s", message)
        if message != OVERFLOW_WARNING:
            server.set_coherent(False)  # parts of the tree go unwatched: short timeouts again
        server.invalidate_all()

    if own_writes is not None:
        detector = watch_workspace(own_writes, folder, on_external, on_warning, settle_s=WATCH_SETTLE_S,
                                   batch_max_s=WATCH_BATCH_MAX_S)
    else:
        detector = TreeWatcher(os.path.realpath(folder), on_external, on_warning, settle_s=WATCH_SETTLE_S,
                               batch_max_s=WATCH_BATCH_MAX_S).start()
    server.set_coherent(True)

    def stop() -> None:
        server.set_coherent(False)
        detector.stop()

    return stop
