"""External-modification watcher: changes to the working folder that did not come through us.

:class:`TreeWatcher` watches a real directory tree with inotify (``inotify_simple``: one
fd, one daemon thread) and delivers the relative paths that changed, in batches.
:class:`ExternalChangeDetector` classifies each delivered path with the own-write journal
(:class:`~sandbox.barriers.journal.OwnWrites`, filled by the
:class:`~sandbox.barriers.journal.RecordingHostFS` the workspace writes through) and
reports only the external ones. It keeps working while a rollback runs: the rollback's
restores go through the recording filesystem like every other write of ours.

Use (the journal must be the one the workspace writes through; stop the detector before
closing the workspace — its lstat goes through the workspace's folder fd)::

    wrapped = []
    ws = Workspace.open(folder, wrap_work=lambda fs: wrapped.append(RecordingHostFS(fs)) or wrapped[-1])
    det = ExternalChangeDetector(folder, wrapped[0].journal, ws.record_external_modification, warn)
    det.start()
    ...
    det.stop()
    ws.close()

Invariants:

* every directory of the tree has a watch (added at :meth:`TreeWatcher.start`, and for
  each directory created in or moved into the tree); a watch is added *before* the
  directory is listed, and every entry found while listing a new directory is delivered
  too, so nothing created before its directory's watch existed is missed;
* directories are reached beneath the root with ``openat2`` and no symlink followed, and
  watched through that fd (``/proc/self/fd/N``): a symlink swapped into the tree can
  never make us watch, or list, anything outside it (hence no ``IN_DONT_FOLLOW``: the
  magic link must be followed, and the fd is already the directory itself);
* a path is delivered as ``dir/name`` relative to the root (``""`` is the root); an
  event on a watched directory itself (attributes, deleted, moved) is its own path;
* a directory renamed inside the tree keeps its watches, re-mapped by the
  ``IN_MOVED_FROM``/``IN_MOVED_TO`` cookie pair; one moved out (no ``IN_MOVED_TO`` by the
  time the batch settles) loses its watches; one moved in is watched like a new one;
* callbacks run on the watcher thread; an exception from one is logged and the thread
  carries on. :meth:`TreeWatcher.stop` wakes the thread through a pipe (no polling).

Events watched: ``IN_MODIFY IN_ATTRIB IN_CREATE IN_DELETE IN_MOVED_FROM IN_MOVED_TO
IN_DELETE_SELF IN_MOVE_SELF`` with ``IN_ONLYDIR`` and ``IN_EXCL_UNLINK`` (writes to a
file after its last name is gone are invisible in the folder). Opens, reads and closes
are not watched.

Limits:

* inotify queues at most ``fs.inotify.max_queued_events`` events; beyond that the kernel
  drops events and says so once (``IN_Q_OVERFLOW``): ``on_warning`` is called, changes
  in that window may be missed, and the tree is walked again so that directories created
  or moved unseen are watched from then on (their contents are not reported);
* at most ``fs.inotify.max_user_watches`` directories can be watched (per user, all
  processes together); beyond that ``on_warning`` is called once and changes in the
  directories left unwatched are not seen;
* between a directory being moved out of the tree and the batch settling, events from
  inside it are still reported under its old path;
* a change made while no watcher runs (before ``start``, after ``stop``) is not seen.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
import time
from typing import Callable

from inotify_simple import INotify
from inotify_simple import flags as _F

from ..hostfs import is_within, join
from ..hostfs.real import _openat2
from .journal import BUSY, EXTERNAL, OwnWrites

__all__ = ["TreeWatcher", "ExternalChangeDetector", "WATCH_MASK", "OVERFLOW_WARNING", "WATCH_LIMIT_WARNING"]

log = logging.getLogger("sandbox.watch")

WATCH_MASK = (_F.MODIFY | _F.ATTRIB | _F.CREATE | _F.DELETE | _F.MOVED_FROM | _F.MOVED_TO | _F.DELETE_SELF
              | _F.MOVE_SELF | _F.ONLYDIR | _F.EXCL_UNLINK)
OVERFLOW_WARNING = "file watcher queue overflowed: external modifications may have been missed"
WATCH_LIMIT_WARNING = ("file watcher limit reached (sysctl fs.inotify.max_user_watches): external modifications "
                       "in some folders will not be detected")
_GONE_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV)
#: seconds the thread waits after reading the inotify queue before it reads it again (it wakes
#: for stop meanwhile): a burst of changes — git's ``utime`` of one object for every file it
#: adds, through a FUSE mount — is read in one wake-up per interval, not one per change (each
#: wake-up takes the interpreter lock from the thread serving requests), and the kernel merges
#: identical consecutive events queued meanwhile. Adds at most this to a report's delay (after
#: ``settle_s``); the kernel's queue (``fs.inotify.max_queued_events``, 16,384 by default) holds
#: far more than one interval's events (overflow: as without it, see Limits)
EVENT_READ_INTERVAL_S = 0.005


class TreeWatcher:
    """Recursive inotify watch of the real directory ``root`` (see the module doc).

    ``on_paths(paths)`` gets each batch: after an event, events are read until none has
    come for ``settle_s`` (or ``batch_max_s`` has passed since the batch began). It is
    also called with an empty set when a re-check asked for by :meth:`recheck_in` falls
    due with no events in between.
    """

    def __init__(self, root: str, on_paths: Callable[[set[str]], None], on_warning: Callable[[str], None], *,
                 settle_s: float = 0.05, batch_max_s: float = 1.0):
        self.root = os.path.realpath(root)
        self.on_paths = on_paths
        self.on_warning = on_warning
        self.settle_s = settle_s
        self.batch_max_s = batch_max_s
        self._inotify: INotify | None = None
        self._root_fd = -1
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wd: dict[int, str] = {}  # watch descriptor -> directory path relative to the root
        self._root_wd: int | None = None
        self._moves: dict[int, tuple[str, list[int]]] = {}  # cookie -> (source dir, its subtree's wds)
        self._limit_warned = False
        self._recheck_lock = threading.Lock()
        self._recheck_at: float | None = None
        self._fd_lock = threading.Lock()  # the wake pipe is never written after it is closed

    # ------------------------------------------------------------------ life cycle

    def start(self) -> "TreeWatcher":
        """Watch every directory under the root, then start the thread."""
        if self._thread is not None:
            raise RuntimeError("watcher already started")
        self._root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._inotify = INotify()
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._add_tree("", None)
            if self._root_wd is None:
                raise OSError(errno.ENOENT, "cannot watch the folder", self.root)
        except BaseException:
            self._close_fds()
            raise
        self._thread = threading.Thread(target=self._run, name=f"sandbox-watch:{self.root}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Wake the thread, wait for it, close the inotify fd. Events already queued are
        delivered first (one last batch, no settling). Idempotent; may be called from a
        callback (the thread then ends when the callback returns)."""
        self._stopping.set()
        t = self._thread
        if t is None:
            self._close_fds()
            return
        self._wake()
        if t is not threading.current_thread():
            t.join()

    def __enter__(self) -> "TreeWatcher":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def watched(self) -> set[str]:
        """The directories watched now (a snapshot; for diagnostics and tests)."""
        return set(dict(self._wd).values())

    def recheck_in(self, delay_s: float) -> None:
        """Deliver an (empty) batch in ``delay_s`` unless a batch is delivered before then."""
        due = time.monotonic() + max(0.0, delay_s)
        with self._recheck_lock:
            if self._recheck_at is None or due < self._recheck_at:
                self._recheck_at = due
        if threading.current_thread() is not self._thread:
            self._wake()

    def _wake(self) -> None:
        with self._fd_lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full: a wake is pending anyway

    def _close_fds(self) -> None:
        with self._fd_lock:
            if self._inotify is not None:
                self._inotify.close()
                self._inotify = None
            for fd in (self._root_fd, self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._root_fd = self._wake_r = self._wake_w = -1
            self._wd.clear()

    # ------------------------------------------------------------------ watches

    def _add_tree(self, top: str, found: set[str] | None) -> set[int]:
        """Watch ``top`` and every directory below it; add each entry met to ``found``.
        Returns the watch descriptors of the directories met."""
        seen: set[int] = set()
        stack = [top]
        while stack:
            d = stack.pop()
            try:
                fd = _openat2(self._root_fd, d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError as e:
                if e.errno not in _GONE_ERRNOS:
                    log.warning("cannot watch %r in %s: %s", d, self.root, e)
                continue  # vanished, replaced by a symlink or a file, or unreadable
            try:
                try:
                    wd = self._inotify.add_watch(f"/proc/self/fd/{fd}", WATCH_MASK)
                except OSError as e:
                    if d == "" and self._thread is None:
                        raise  # start(): the folder itself cannot be watched
                    if e.errno == errno.ENOSPC:
                        if not self._limit_warned:
                            self._limit_warned = True
                            log.warning("%s (at %r in %s)", WATCH_LIMIT_WARNING, d, self.root)
                            self._call(self.on_warning, WATCH_LIMIT_WARNING)
                    else:
                        log.warning("cannot watch %r in %s: %s", d, self.root, e)
                else:
                    self._wd[wd] = d
                    seen.add(wd)
                    if d == "":
                        self._root_wd = wd
                try:
                    entries = list(os.scandir(fd))
                except OSError:
                    continue
                for entry in entries:
                    p = join(d, entry.name)
                    if found is not None:
                        found.add(p)
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(p)
                    except OSError:
                        continue
            finally:
                os.close(fd)
        return seen

    def _rewatch(self) -> None:
        """After an overflow: events were lost (directories created, moved or removed
        unseen), so walk the tree again — new directories get watches, moved ones their
        current paths, and watches on directories no longer in the tree are dropped."""
        seen = self._add_tree("", None)
        self._forget([wd for wd in self._wd if wd not in seen])

    def _subtree_wds(self, top: str) -> list[int]:
        return [wd for wd, p in self._wd.items() if is_within(p, top)]

    def _forget(self, wds: list[int]) -> None:
        for wd in wds:
            if self._wd.pop(wd, None) is not None:
                try:
                    self._inotify.rm_watch(wd)
                except OSError:
                    pass  # already gone (IN_IGNORED on its way)

    # ------------------------------------------------------------------ the thread

    def _call(self, fn: Callable, arg) -> None:
        try:
            fn(arg)
        except Exception:
            log.exception("file watcher callback %r failed", getattr(fn, "__qualname__", fn))

    def _run(self) -> None:
        poller = select.poll()
        ino_fd = self._inotify.fileno()
        poller.register(ino_fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        wake_only = select.poll()  # while a burst gathers (EVENT_READ_INTERVAL_S)
        wake_only.register(self._wake_r, select.POLLIN)
        batch: set[str] = set()
        began = last = next_read = 0.0
        try:
            while not self._stopping.is_set():
                with self._recheck_lock:
                    recheck = self._recheck_at
                if batch or self._moves:
                    deadline = min(last + self.settle_s, began + self.batch_max_s)
                else:
                    deadline = recheck
                now = time.monotonic()
                if now < next_read:  # read moments ago: let the burst gather
                    deadline = next_read if deadline is None else min(deadline, next_read)
                timeout = None if deadline is None else max(0, int((deadline - now) * 1000) + 1)
                ready = {fd for fd, _ in (wake_only if now < next_read else poller).poll(timeout)}
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    if self._stopping.is_set():
                        break
                if ino_fd in ready:
                    events = self._inotify.read(timeout=0)
                    next_read = time.monotonic() + EVENT_READ_INTERVAL_S
                    if events:
                        now = time.monotonic()
                        if not batch and not self._moves:
                            began = now
                        last = now
                        self._process(events, batch)
                now = time.monotonic()
                if batch or self._moves:
                    if now >= last + self.settle_s or now >= began + self.batch_max_s:
                        self._settle_moves()
                        out, batch = batch, set()
                        if out:
                            with self._recheck_lock:
                                self._recheck_at = None
                            self._call(self.on_paths, out)
                elif recheck is not None and now >= recheck:
                    with self._recheck_lock:
                        if self._recheck_at is not None and self._recheck_at <= now:
                            self._recheck_at = None
                    self._call(self.on_paths, set())
            # stopping: what happened before stop() is still delivered, without waiting
            self._process(self._inotify.read(timeout=0), batch)
            self._settle_moves()
            if batch:
                self._call(self.on_paths, batch)
        except Exception:  # pragma: no cover - a bug: say so rather than die silently
            log.exception("file watcher for %s failed; external modifications are no longer detected", self.root)
            self._call(self.on_warning, "file watcher failed: external modifications are no longer detected")
        finally:
            self._close_fds()

    def _process(self, events, batch: set[str]) -> None:
        for ev in events:
            mask = ev.mask
            if mask & _F.Q_OVERFLOW:
                self._rewatch()  # first: when the warning is out, the tree is watched again
                log.warning("%s (%s)", OVERFLOW_WARNING, self.root)
                self._call(self.on_warning, OVERFLOW_WARNING)
                continue
            if mask & _F.IGNORED:
                self._wd.pop(ev.wd, None)
                if ev.wd == self._root_wd:
                    self._root_wd = None
                continue
            d = self._wd.get(ev.wd)
            if d is None:
                continue  # a watch we have dropped
            path = join(d, ev.name) if ev.name else d
            batch.add(path)
            if mask & _F.UNMOUNT:
                self._call(self.on_warning, f"the filesystem holding {os.path.join(self.root, d)!r} was unmounted")
                continue
            if ev.wd == self._root_wd and not ev.name and mask & (_F.DELETE_SELF | _F.MOVE_SELF):
                what = "deleted" if mask & _F.DELETE_SELF else "moved"
                log.warning("the working folder %s itself was %s", self.root, what)
                self._call(self.on_warning, f"the working folder {self.root} itself was {what}")
            if not mask & _F.ISDIR or not ev.name:
                continue
            if mask & _F.CREATE:
                self._add_tree(path, batch)
            elif mask & _F.MOVED_FROM:
                self._moves[ev.cookie] = (path, self._subtree_wds(path))
            elif mask & _F.MOVED_TO:
                self._moved_in(ev.cookie, path, batch)

    def _moved_in(self, cookie: int, dst: str, batch: set[str]) -> None:
        src, wds = self._moves.pop(cookie, (None, []))
        moved = [wd for wd in wds if wd in self._wd]
        if src is None or not any(self._wd[wd] == src for wd in moved):
            # from outside the tree, or never watched (created and moved before we looked)
            self._add_tree(dst, batch)
            return
        for wd in moved:
            p = self._wd[wd]
            if is_within(p, src):
                self._wd[wd] = dst + p[len(src):]

    def _settle_moves(self) -> None:
        """Directories moved away with no ``IN_MOVED_TO`` in the tree: out of it."""
        for src, wds in self._moves.values():
            self._forget([wd for wd in wds if wd in self._wd and is_within(self._wd[wd], src)])
        self._moves.clear()


class ExternalChangeDetector:
    """Report the changes to ``root`` that :class:`OwnWrites` ``journal`` does not claim.

    ``on_external(paths)``: once per batch with at least one external path, the paths
    sorted. A path that is *busy* (one of our calls on it still running) is re-examined
    with the next batch, or ``recheck_s`` later, driven by the watcher thread.
    ``watcher_kwargs`` go to :class:`TreeWatcher` (``settle_s``, ``batch_max_s``).
    Callbacks run on the watcher thread. :meth:`stop` classifies what was queued before
    it; paths still busy then are dropped (our own calls were running on them). Do not
    call :meth:`stop` while holding a lock that ``on_external`` takes (the workspace's, if
    it calls ``record_external_modification``): stop waits for the callback.
    """

    def __init__(self, root: str, journal: OwnWrites, on_external: Callable[[list[str]], None],
                 on_warning: Callable[[str], None], *, recheck_s: float = 0.05, **watcher_kwargs):
        self.journal = journal
        self.on_external = on_external
        self.recheck_s = recheck_s
        self._pending: set[str] = set()
        self._pending_lock = threading.Lock()
        self.watcher = TreeWatcher(root, self._on_paths, on_warning, **watcher_kwargs)

    @property
    def pending(self) -> set[str]:
        """Paths waiting for one of our calls to finish before they can be classified."""
        with self._pending_lock:
            return set(self._pending)

    def start(self) -> "ExternalChangeDetector":
        self.watcher.start()
        return self

    def stop(self) -> None:
        self.watcher.stop()

    def __enter__(self) -> "ExternalChangeDetector":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _on_paths(self, paths: set[str]) -> None:
        with self._pending_lock:
            todo = self._pending | paths
        busy, external = set(), []
        for p in sorted(todo):
            verdict = self.journal.classify(p)
            if verdict == BUSY:
                busy.add(p)
            elif verdict == EXTERNAL:
                external.append(p)
        with self._pending_lock:
            self._pending = busy
        if busy:
            self.watcher.recheck_in(self.recheck_s)
        if external:
            log.info("external modification of %d path(s) in %s: %s%s", len(external), self.watcher.root,
                     ", ".join(external[:5]), ", …" if len(external) > 5 else "")
            self.on_external(external)
