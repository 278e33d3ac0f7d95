"""Own-write attribution: which changes to the working folder did the sandbox make itself?

inotify reports *that* a path changed, never *who* changed it. The external-modification
watcher (:mod:`sandbox.barriers.watch`) therefore asks this journal about every path it is
told about. :class:`RecordingHostFS` wraps the working folder's :class:`~sandbox.hostfs.HostFS`
(everything the sandbox does to the folder — guest writes, rollback restores, deny
rollbacks, crash recovery — goes through that one object) and brackets every mutating call
with :meth:`OwnWrites.begin` / :meth:`OwnWrites.end`:

* ``begin`` marks the paths (and the parent directories whose entries the call changes)
  *in flight*, and the inodes found at them;
* ``end`` (always, also when the call failed: it may have had a partial effect) records
  the *signature* each path was left with — ``(kind, ino, mode, size, mtime_ns, ctime_ns,
  nlink)`` from ``lstat`` (``(kind, ino, mode)`` for a directory, see :func:`signature`),
  or ``None`` if nothing is there — and the same signature under the inode number, so a
  write through an open handle, or through another hard link, is recognised at whatever
  name the kernel reports it. Three calls prove what they left and are recorded without
  a look: an exclusive create (the new inode, ``fstat``-ed through its descriptor; nothing
  was there before it, so ``begin`` does not look either), an unlink or rmdir that
  succeeded (nothing), and the source of a rename that succeeded (nothing — unless the
  looks before it found one file at both names, where the rename does nothing: then it is
  looked at). An open for writing (which neither creates nor truncates) changes nothing at
  its path and is not bracketed: the taint check ``begin`` would make (see the limits) is
  made through the new descriptor's ``fstat``. Writes through handles are recorded by
  inode only (``fstat``); a call that drops one name of a multiply-linked file records the
  file's new state (link count, ctime) for its inode too, through a handle held across the
  call.

Both looks happen under the journal's lock, and :class:`RecordingHostFS` runs its
mutations one at a time (the undo core already runs them under its interceptor lock, so
this costs nothing there): every ``end`` sees exactly the effect of the calls before it.

Invariant: :meth:`OwnWrites.classify` says ``"ours"`` for a path only if the object now at
that path is, signature for signature, what one of our own calls left there (at that path,
or for that inode), or if the path is gone and one of our calls removed or renamed one of
its ancestor directories after we last recorded the path; ``"busy"`` while one of our
calls on it (or on its inode) is running — the caller asks again later; ``"external"``
otherwise (changed since we left it, or never touched by us). Every change by someone
else to a file moves its ``ctime`` (data, metadata, link count, rename), so it is seen.

Known limits:

* an external change in the same timestamp tick as our last change of that object,
  leaving size, mode, ino, nlink and ctime equal, is attributed to us. The rollback's own
  content-hash check (``Workspace._check_unchanged``) still refuses to overwrite it.
* an external change that races one of our calls on the same path (between the call's
  ``begin`` and the ``lstat`` in its ``end``) is attributed to us — except after a create,
  an unlink or at a rename's source, which record what they left without looking. (An
  external hard link of a rename's source put at its destination in that window makes the
  rename do nothing; the source is then recorded as gone although it is still there.)
* an external change that the sandbox overwrites before the watcher examined its event
  (a window of ``settle_s`` plus processing) is attributed to us when we had never
  touched that path before; when we had, ``begin`` notices the file differs from what we
  left and *taints* the path, and its next classification reports it as external. Same
  for an external change to a path whose directory we then remove or rename.
* a directory is compared by kind, inode and mode only: an external ``touch`` or xattr
  change of a directory we last touched is not reported (a ``chmod`` is; the undo core's
  fingerprints do not look at a directory's times or xattrs either).
* dropping a name of a multiply-linked file we cannot open for reading leaves its other
  names' new link count unrecorded: they may be reported if an event names them.
* "external" is acknowledged: the same external state is reported once.
* inode numbers are not qualified by device: a mount point inside the folder may alias.

Memory is bounded: at most ``max_records`` (200 000) paths and as many inodes are kept;
beyond that, records older than ``max_age_s`` (60 s), oldest first, are dropped (events
are classified within a second, so an old record is never needed for our own events).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from ..hostfs import ABSENT_ERRNOS, DIR, REG, Attr, Entry, FileHandle, HostFS, Lock, Stat, StatFS, parent_of

__all__ = ["OwnWrites", "RecordingEntry", "RecordingHostFS", "RecordingFileHandle", "signature", "OURS", "EXTERNAL", "BUSY"]

OURS = "ours"
EXTERNAL = "external"
BUSY = "busy"

MAX_RECORDS = 200_000
MAX_AGE_S = 60.0
_CLASSIFY_TRIES = 3

Signature = tuple  # (kind, ino, mode, size, mtime_ns, ctime_ns, nlink)


def signature(st: Stat | Attr | None) -> Signature | None:
    """``(kind, ino, mode, size, mtime_ns, ctime_ns, nlink)`` of a :class:`Stat` (or ``Attr``).

    A directory's is ``(kind, ino, mode)``: its size, times and link count move whenever
    anyone adds or removes an entry — and those entries have events of their own — so a
    directory of ours that only had its entries changed since is still ours.
    """
    if st is None:
        return None
    if st.kind == DIR:
        return (st.kind, st.ino, st.mode)
    return (st.kind, st.ino, st.mode, st.size, st.mtime_ns, st.ctime_ns, st.nlink)


class _Rec:
    __slots__ = ("sig", "t", "seq", "tainted", "gone_seq")

    def __init__(self, sig, t: float, seq: int, old: "_Rec | None" = None):
        self.sig = sig
        self.t = t
        self.seq = seq
        self.tainted = old is not None and old.tainted
        # the last time one of our calls left nothing at this path (whatever was below it went too)
        self.gone_seq = seq if sig is None and seq else (old.gone_seq if old is not None else 0)


class OwnWrites:
    """Thread-safe journal of the sandbox's own writes to one folder (see the module doc).

    ``lstat(path)`` returns the :class:`Stat` at a relative path or ``None`` if nothing
    is there, and raises :class:`OSError` for anything else (a path whose state cannot
    be read is never attributed to us).
    """

    def __init__(self, lstat: Callable[[str], Stat | None], *, max_records: int = MAX_RECORDS,
                 max_age_s: float = MAX_AGE_S, clock: Callable[[], float] = time.monotonic):
        self._lstat = lstat
        self.max_records = max_records
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seq = 0
        self._inflight: dict[str, int] = {}
        self._inflight_ino: dict[int, int] = {}
        self._begun_ino: dict[str, list[int | None]] = {}  # path -> inodes marked by its open begins
        self._paths: collections.OrderedDict[str, _Rec] = collections.OrderedDict()
        self._inodes: collections.OrderedDict[int, _Rec] = collections.OrderedDict()

    @classmethod
    def for_fs(cls, fs: HostFS, **kwargs) -> "OwnWrites":
        """A journal that looks at the folder through ``fs`` (``fs.lstat_or_none``)."""
        return cls(fs.lstat_or_none, **kwargs)

    # ------------------------------------------------------------------ recording

    def _try_lstat(self, path: str) -> Stat | None | OSError:
        try:
            return self._lstat(path)
        except OSError as e:
            return e

    def begin(self, paths: Iterable[str], parents: Iterable[str] = (), *,
              seen: dict[str, Stat | None | OSError] | None = None) -> None:
        """Our call on ``paths`` (entries it changes; ``parents``: directories whose entry
        list it changes) is about to run. Must be paired with :meth:`end` (same paths).

        ``seen``: for some of the paths, what the caller found there itself just before, with
        none of our calls in between (:class:`RecordingHostFS` looks under its mutex) — taken
        instead of a second look at the same moment."""
        every, primary = _every(paths, parents)
        inflight, inflight_ino, begun = self._inflight, self._inflight_ino, self._begun_ino
        with self._lock:  # look and compare in one step: no end() of ours may slip in between
            for p in every:
                inflight[p] = inflight.get(p, 0) + 1
            for p in every:
                st = seen[p] if seen is not None and p in seen else self._try_lstat(p)
                if isinstance(st, Stat):
                    ino = st.ino
                    inflight_ino[ino] = inflight_ino.get(ino, 0) + 1
                else:
                    ino = None
                stack = begun.get(p)
                if stack is None:
                    begun[p] = [ino]
                else:
                    stack.append(ino)
                if ino is not None and (primary is None or p in primary):
                    self._check_taint(p, st)

    def _check_taint(self, path: str, st: Stat | Attr, own: int = 1) -> None:
        """Under the lock: the object we left at ``path`` changed behind our back (``st``: a
        look at it now; ``own``: how many in-flight counts on it are the asking call's)."""
        rec = self._paths.get(path)
        if rec is None or rec.tainted or rec.sig is None:
            return  # never recorded, already tainted, or we left nothing there: nothing to compare
        cur = signature(st)
        if rec.sig == cur:
            return
        if cur[0] == DIR:  # its mtime moves with every entry anyone adds: those entries have events
            return
        if rec.sig[1] != cur[1]:  # another object now: its own events tell its story
            return
        if self._inflight_ino.get(cur[1], 0) > own or self._inflight.get(path, 0) > own:
            return  # another of our calls is on it right now: the change may be ours
        irec = self._inodes.get(cur[1])
        if irec is not None and irec.sig == cur:
            return  # we changed it through another name or a handle
        rec.tainted = True

    def end(self, paths: Iterable[str], parents: Iterable[str] = (), *,
            left: dict[str, Stat | Attr | None] | None = None, check_taint: Iterable[str] = ()) -> None:
        """Our call on ``paths`` returned (or failed): record what it left.

        ``left``: for some of the paths, what the call itself proves it left there — the new
        file's ``fstat`` through the descriptor an exclusive create returned, ``None`` where an
        unlink succeeded — recorded without looking again: what a racer puts at the name after
        our call is then never recorded as ours. ``check_taint``: paths whose :meth:`begin`
        took no look (``seen`` said nothing was there, which a failed exclusive create
        disproves): the look here gets the taint check that begin's look would have made."""
        every, _primary = _every(paths, parents)
        inflight, begun, table, inodes = self._inflight, self._begun_ino, self._paths, self._inodes
        with self._lock:
            # look while still in flight, and under the lock: the last of our calls on a
            # path or inode to end records the newest state (a look taken before another
            # call's change can never be recorded after that call's own look)
            after = [left[p] if left is not None and p in left else self._try_lstat(p) for p in every]
            if check_taint:
                for p, st in zip(every, after):
                    if p in check_taint and isinstance(st, (Stat, Attr)):
                        self._check_taint(p, st)
            self._seq += 1
            seq = self._seq
            now = self._clock()
            for p, st in zip(every, after):
                n = inflight.get(p, 0) - 1
                if n > 0:
                    inflight[p] = n
                else:
                    inflight.pop(p, None)
                stack = begun.get(p)
                if stack:
                    ino = stack.pop()
                    if not stack:
                        del begun[p]
                    if ino is not None:
                        self._dec_ino(ino)
                if isinstance(st, OSError):  # unknown state: never claim it
                    table.pop(p, None)
                    continue
                sig = signature(st)
                table[p] = _Rec(sig, now, seq, table.get(p))
                table.move_to_end(p)
                if sig is not None:
                    inodes[sig[1]] = _Rec(sig, now, seq)
                    inodes.move_to_end(sig[1])
            if len(table) > self.max_records or len(inodes) > self.max_records:
                self._trim(now)

    def check(self, path: str, fstat: Callable[[], Stat | Attr]) -> Stat | Attr:
        """One of our calls just reached ``path`` without changing it (an open for writing,
        which neither creates nor truncates); ``fstat()`` (called under the lock, like
        ``begin``'s look) says how the file it reached is now, and is returned. Nothing is
        recorded; the taint check :meth:`begin` would make is: the file we left there,
        changed behind our back, is reported even if our writes through that open come
        before the watcher looks."""
        with self._lock:
            st = fstat()
            self._check_taint(path, st, own=0)
        return st

    def begin_inode(self, ino: int) -> None:
        """Our call on an open handle of inode ``ino`` is about to run."""
        with self._lock:
            self._inflight_ino[ino] = self._inflight_ino.get(ino, 0) + 1

    def end_inode(self, ino: int, fstat: Callable[[], Stat | Attr]) -> None:
        """Our call on a handle of inode ``ino`` returned; ``fstat()`` says how it is now
        (called under the journal's lock, like ``end``'s lstat; an OSError: unknown)."""
        inodes = self._inodes
        with self._lock:
            try:
                st = fstat()
            except OSError:
                st = None
            self._seq += 1
            self._dec_ino(ino)
            if st is None:
                inodes.pop(ino, None)
                return
            now = self._clock()
            inodes[ino] = _Rec(signature(st), now, self._seq)
            inodes.move_to_end(ino)
            if len(inodes) > self.max_records:
                self._trim(now)

    @contextmanager
    def writing(self, paths: Iterable[str], parents: Iterable[str] = ()) -> Iterator[None]:
        """``begin``; the block; ``end`` (also when the block raised)."""
        paths, parents = list(paths), list(parents)
        self.begin(paths, parents)
        try:
            yield
        finally:
            self.end(paths, parents)

    def _dec_ino(self, ino: int) -> None:
        n = self._inflight_ino.get(ino, 0) - 1
        if n > 0:
            self._inflight_ino[ino] = n
        else:
            self._inflight_ino.pop(ino, None)

    def _trim(self, now: float) -> None:
        """Under the lock, once a table holds more than ``max_records``: drop its records
        older than ``max_age_s``, oldest first, down to ``max_records``."""
        horizon = now - self.max_age_s
        for table in (self._paths, self._inodes):
            while len(table) > self.max_records:
                key, rec = next(iter(table.items()))
                if rec.t >= horizon:
                    break
                del table[key]

    # ------------------------------------------------------------------ questions

    def in_flight(self, path: str) -> bool:
        with self._lock:
            return path in self._inflight

    def __len__(self) -> int:
        """How many paths are recorded."""
        with self._lock:
            return len(self._paths)

    def classify(self, path: str) -> str:
        """``"ours"``, ``"external"`` or ``"busy"`` for the object now at ``path`` (module doc).

        A path that is gone although we left something there is ours if, since, one of our
        calls left nothing at one of its ancestors (we removed or renamed that directory:
        what was below it went with it — events and listings may still name those paths).

        An ``"external"`` answer is acknowledged: the path's record becomes what is there
        now, so the same external state is reported once (another event about it, or a
        later :meth:`begin` of ours, finds nothing new).
        """
        ancestors = _ancestors(path)
        for _ in range(_CLASSIFY_TRIES):
            with self._lock:
                if path in self._inflight:
                    return BUSY
                seq0 = self._seq
            try:
                cur = signature(self._lstat(path))
            except OSError:
                return EXTERNAL  # cannot look: never claim it
            with self._lock:
                if path in self._inflight or (cur is not None and cur[1] in self._inflight_ino):
                    return BUSY
                rec = self._paths.get(path)
                irec = self._inodes.get(cur[1]) if cur is not None else None
                if (rec is not None and rec.seq > seq0) or (irec is not None and irec.seq > seq0):
                    continue  # one of our calls ended while we looked: look again
                if rec is not None and rec.tainted:
                    rec.tainted = False
                    return self._acknowledge(path, cur)
                if rec is not None and rec.sig == cur:
                    return OURS
                if irec is not None and irec.sig == cur:
                    return OURS
                if cur is None and rec is not None:
                    if any(a in self._inflight for a in ancestors):
                        return BUSY
                    for a in ancestors:
                        arec = self._paths.get(a)
                        if arec is not None and arec.gone_seq > rec.seq:
                            return OURS
                return self._acknowledge(path, cur)
        return BUSY

    def _acknowledge(self, path: str, cur: Signature | None) -> str:
        """Under the lock: remember the external state (seq 0: older than any look in progress)."""
        self._paths[path] = _Rec(cur, self._clock(), 0, self._paths.get(path))
        self._paths.move_to_end(path)
        return EXTERNAL


def _every(paths: Iterable[str], parents: Iterable[str]) -> tuple[list[str], list[str] | None]:
    """The paths a :meth:`OwnWrites.begin` / ``end`` names, each once (``paths`` first), and
    the primary ones among them (``None``: all are). One path and no parents — every call of
    :class:`RecordingHostFS` but a rename, link or exchange — is taken as it is."""
    if not parents:
        if type(paths) is list and len(paths) == 1:
            return paths, None
        return list(dict.fromkeys(paths)), None
    primary = list(dict.fromkeys(paths))
    return list(dict.fromkeys([*primary, *parents])), primary


def _ancestors(path: str) -> list[str]:
    """``"a/b/c"`` → ``["a/b", "a"]`` (nearest first; never the root)."""
    out = []
    while "/" in path:
        path = path[:path.rfind("/")]
        out.append(path)
    return out


class RecordingFileHandle(FileHandle):
    """A handle from :meth:`RecordingHostFS.open`: its mutations (``pwrite``, ``truncate``
    and the metadata calls, which a read-only handle may make too) are recorded against
    the handle's inode (the file may have moved since it was opened). That inode is
    ``ino`` (the caller's ``fstat`` of ``inner``) or, if not given, learnt by one ``fstat``
    at the first mutation (a descriptor's inode never changes): a handle only read through
    (an OPENDIR's, a reader's) costs no look of the journal's."""

    def __init__(self, inner: FileHandle, journal: OwnWrites, mutex: threading.RLock | None = None,
                 ino: int | None = None):
        self.inner = inner
        self.journal = journal
        self.mutex = mutex if mutex is not None else threading.RLock()
        self.path = inner.path
        self.flags = inner.flags
        self._ino = ino

    @property
    def ino(self) -> int:
        if self._ino is None:
            self._ino = self.inner.fstat().ino
        return self._ino

    def _mutating(self, call):
        with self.mutex:
            ino = self.ino
            self.journal.begin_inode(ino)
            try:
                return call()
            finally:
                self.journal.end_inode(ino, self.inner.fstat)

    def pread(self, length: int, offset: int) -> bytes:
        return self.inner.pread(length, offset)

    def read_own(self, length: int, offset: int) -> bytes:
        return self.inner.read_own(length, offset)

    def pwrite(self, data: bytes, offset: int) -> int:
        return self._mutating(lambda: self.inner.pwrite(data, offset))

    def truncate(self, size: int) -> None:
        self._mutating(lambda: self.inner.truncate(size))

    def fsync(self, datasync: bool = False) -> None:
        self.inner.fsync(datasync)

    def fstat(self) -> Attr:
        return self.inner.fstat()

    def fstat_xattr_names(self) -> tuple[Attr, list[str]]:
        return self.inner.fstat_xattr_names()

    def is_inode_of(self, st: Stat | Attr) -> bool:
        return self.inner.is_inode_of(st)

    def chmod(self, mode: int) -> None:
        self._mutating(lambda: self.inner.chmod(mode))

    def utime(self, mtime_ns: int, atime_ns: int | None = None) -> None:
        self._mutating(lambda: self.inner.utime(mtime_ns, atime_ns))

    def chown(self, uid: int, gid: int) -> None:
        self._mutating(lambda: self.inner.chown(uid, gid))

    def listxattr(self) -> list[str]:
        return self.inner.listxattr()

    def getattr_at(self, name: str) -> Attr:
        return self.inner.getattr_at(name)

    def getattr_xattr_names_at(self, name: str) -> tuple[Attr, list[str]]:
        return self.inner.getattr_xattr_names_at(name)

    def listdir(self, *, limit_bytes: int | None = None) -> list[str]:
        return self.inner.listdir(limit_bytes=limit_bytes)

    def getxattr_at(self, name: str, xattr: str) -> bytes:
        return self.inner.getxattr_at(name, xattr)

    def getxattr(self, name: str) -> bytes:
        return self.inner.getxattr(name)

    def setxattr(self, name: str, value: bytes) -> None:
        self._mutating(lambda: self.inner.setxattr(name, value))

    def removexattr(self, name: str) -> None:
        self._mutating(lambda: self.inner.removexattr(name))

    def fallocate(self, offset: int, length: int, mode: int = 0) -> None:
        self._mutating(lambda: self.inner.fallocate(offset, length, mode))

    def copy_range_to(self, dst: FileHandle, src_offset: int, dst_offset: int, length: int) -> int:
        """Recorded against the destination's inode (the source is only read)."""
        inner = dst.inner if isinstance(dst, RecordingFileHandle) else dst
        mutating = dst._mutating if isinstance(dst, RecordingFileHandle) else (lambda call: call())
        return mutating(lambda: self.inner.copy_range_to(inner, src_offset, dst_offset, length))

    def lseek(self, offset: int, whence: int) -> int:
        return self.inner.lseek(offset, whence)

    def close(self) -> None:
        self.inner.close()

    @property
    def closed(self) -> bool:
        return self.inner.closed


class RecordingEntry(Entry):
    """:meth:`RecordingHostFS.entry`: the looks are ``inner``'s entry's (reads, not recorded),
    the removals recorded as :meth:`RecordingHostFS.unlink` and ``rmdir`` record theirs —
    each removal's last look and the call through that same entry."""

    def __init__(self, fs: "RecordingHostFS", inner: Entry):
        super().__init__(fs, inner.path)
        self.inner = inner

    def lstat(self) -> Stat:
        return self.inner.lstat()

    def lstat_or_none(self) -> Stat | None:
        return self.inner.lstat_or_none()

    def xattrs(self) -> dict[str, bytes]:
        return self.inner.xattrs()

    def reader(self, st: Stat):
        return self.inner.reader(st)

    def unlink(self) -> None:
        self.fs._unlink_entry(self.inner)

    def rmdir(self) -> None:
        self.fs._rmdir_entry(self.inner)

    def create_handle(self, mode: int, flags: int = os.O_WRONLY) -> FileHandle:
        """Recorded as :meth:`RecordingHostFS.create_handle` records its path call."""
        return self.fs._create_handle(self.path, lambda: self.inner.create_handle(mode, flags))

    def close(self) -> None:
        self.inner.close()


class RecordingHostFS(HostFS):
    """``inner`` with every mutating call recorded in ``journal`` (default: a new
    :class:`OwnWrites` looking through ``inner``). Reads pass straight through; other
    attributes (``root``, …) are ``inner``'s."""

    def __init__(self, inner: HostFS, journal: OwnWrites | None = None):
        self.inner = inner
        self.journal = journal if journal is not None else OwnWrites.for_fs(inner)
        self.name = inner.name
        # one mutation at a time (the undo core already runs them under its interceptor
        # lock): each end() then sees exactly its own call's effect, never a half-done
        # rename of an ancestor by another thread of ours
        self.mutex = threading.RLock()

    def __getattr__(self, attr: str):
        if attr == "inner":  # not set yet (during unpickling/__init__ failures)
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def __repr__(self) -> str:
        return f"<RecordingHostFS {self.inner!r}>"

    def _rec(self, paths: list[str], parents: list[str] = ()) -> "_Recorded":
        # parents are not journalled: an entry change shows up in inotify as an event on
        # the entry, never on its directory, and a directory's own signature ignores its
        # times (see signature) — recording them cost two lstats per call for nothing
        return _Recorded(self, paths)

    # ------------------------------------------------------------------ reads

    def lstat(self, path: str) -> Stat:
        return self.inner.lstat(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def lstat_head(self, path: str, length: Callable[[Stat], int]) -> tuple[Stat | None, bytes | None]:
        return self.inner.lstat_head(path, length)

    def getattr(self, path: str) -> Attr:
        return self.inner.getattr(path)

    def statfs(self) -> StatFS:
        return self.inner.statfs()

    def listdir(self, path: str, *, limit_bytes: int | None = None) -> list[str]:
        return self.inner.listdir(path, limit_bytes=limit_bytes)

    def read(self, path: str, offset: int, length: int) -> bytes:
        return self.inner.read(path, offset, length)

    def read_all(self, path: str, chunk_bytes: int = 1 << 20) -> bytes:
        return self.inner.read_all(path, chunk_bytes)

    def readlink(self, path: str) -> str:
        return self.inner.readlink(path)

    def listxattr(self, path: str) -> list[str]:
        return self.inner.listxattr(path)

    def getattr_xattr_names(self, path: str) -> tuple[Attr, list[str]]:
        return self.inner.getattr_xattr_names(path)

    def getxattr(self, path: str, name: str) -> bytes:
        return self.inner.getxattr(path, name)

    def xattrs(self, path: str) -> dict[str, bytes]:
        return self.inner.xattrs(path)

    def fsync(self, path: str) -> None:
        self.inner.fsync(path)

    # ------------------------------------------------------------------ mutations

    def open(self, path: str, flags: int) -> FileHandle:
        if flags & (os.O_CREAT | os.O_TRUNC):
            with self._rec([path]):  # open never creates or truncates (EINVAL), but be exact
                return self._wrap(self.inner.open(path, flags))
        # a read-only handle may still chmod, utime, set xattrs: every handle is recorded
        handle = self.inner.open(path, flags)
        if flags & os.O_ACCMODE == os.O_RDONLY:
            return self._wrap(handle)
        # an open for writing changes nothing at the path (no look before and after it); the
        # file it reached, as its descriptor shows it, gets the taint check of a look before
        # our first write through it (RecordingFileHandle records those against the inode)
        try:
            with self.mutex:  # the look after every call of ours before it, as begin's
                a = self.journal.check(path, handle.fstat)
        except BaseException:
            handle.close()
            raise
        return self._wrap(handle, a.ino)

    def open_dir(self, path: str) -> FileHandle:
        """Read-only, for attributes; wrapped as :meth:`open`'s handles are, so that a change
        through it would still be recorded."""
        return self._wrap(self.inner.open_dir(path))

    def _wrap(self, handle: FileHandle, ino: int | None = None) -> RecordingFileHandle:
        try:
            return RecordingFileHandle(handle, self.journal, self.mutex, ino)
        except BaseException:
            handle.close()
            raise

    def create(self, path: str, mode: int) -> None:
        with self._rec([path], [parent_of(path)]):
            self.inner.create(path, mode)

    def create_handle(self, path: str, mode: int, flags: int = os.O_WRONLY) -> FileHandle:
        """The exclusive create recorded without looking at ``path`` (two path resolutions
        fewer): it succeeds only where nothing was, so nothing was there to mark in flight or
        to check for taint before it, and what it left is the new inode, ``fstat``-ed through
        the handle it returns (never whatever a racer has put at the name since). A failed
        create looks afterwards, with the taint check its begin skipped."""
        return self._create_handle(path, lambda: self.inner.create_handle(path, mode, flags))

    def _create_handle(self, path: str, create: Callable[[], FileHandle]) -> FileHandle:
        """:meth:`create_handle`'s record around ``create()`` (the path call, or an entry's)."""
        with self.mutex:
            self.journal.begin([path], seen={path: None})
            try:
                handle = create()
            except BaseException:
                self.journal.end([path], check_taint=[path])
                raise
            try:
                a = handle.fstat()
            except BaseException:
                self.journal.end([path])
                handle.close()
                raise
            self.journal.end([path], left={path: a})
        return self._wrap(handle, a.ino)

    def write(self, path: str, offset: int, data: bytes) -> int:
        with self._rec([path]):
            return self.inner.write(path, offset, data)

    def write_all(self, path: str, offset: int, data: bytes) -> None:
        with self._rec([path]):  # one record for the whole loop, not one per chunk
            self.inner.write_all(path, offset, data)

    def truncate(self, path: str, size: int) -> None:
        with self._rec([path]):
            self.inner.truncate(path, size)

    def _dropping(self, path: str, paths: list[str], call: Callable[[], object], gone: str | None = None,
                  entry: Entry | None = None, moved: str | None = None):
        """``call()`` recorded as :meth:`_rec` records, for a call that may drop one name of a
        multiply-linked file at ``path``: the file's other names see its link count and ctime
        change, so its new state is recorded for its inode (through a handle held across the
        call). The look at ``path`` here is the journal's look before the call too (nothing of
        ours runs between them) — through ``entry`` (``inner.entry(path)``) when the call
        removes that entry through it too; ``gone``: as for :meth:`_recorded`.

        ``moved``: the source of a rename to ``path``. Its look before the call is taken here
        too; if it found an object that is not the one at ``path`` (a rename onto another name
        of the same file does nothing), a rename that succeeded left nothing at ``moved``:
        recorded without a look after (as an unlink's ``gone``)."""
        with self.mutex:
            handle = None
            there: Stat | None | bool = False  # the look at path: False where it failed
            seen: dict | None = None  # the journal looks itself where this look failed otherwise
            try:
                st = there = entry.lstat() if entry is not None else self.inner.lstat(path)
                seen = {path: st}
                if st.kind == REG and st.nlink > 1:
                    handle = self.inner.open(path, os.O_RDONLY)
            except FileNotFoundError:
                seen, there = {path: None}, None  # absent: the journal's look would find nothing either
            except OSError:
                handle = None  # unreadable: its other names may be reported
            if moved is not None:
                try:
                    was: Stat | None | OSError = self.inner.lstat_or_none(moved)
                except OSError as e:  # as the journal's own look records it
                    was = e
                if seen is None or handle is not None:
                    seen = {}  # only the source: the journal looks at path itself, as before
                seen[moved] = was
                if isinstance(was, Stat) and there is not False and (there is None or there.ino != was.ino):
                    gone = moved
            if handle is None:
                return self._recorded(paths, call, seen=seen, gone=gone)
            try:
                ino = handle.fstat().ino
                self.journal.begin_inode(ino)
                try:
                    # the journal looks at path itself here (the source's look: taken above)
                    return self._recorded(paths, call, seen=seen if moved is not None else None, gone=gone)
                finally:
                    self.journal.end_inode(ino, handle.fstat)
            finally:
                handle.close()

    def _recorded(self, paths: list[str], call: Callable[[], object], *, seen=None, gone: str | None = None):
        """``journal.begin``, ``call()``, ``journal.end`` — with ``seen`` (begin's look, taken
        by the caller); ``gone``: a path that ``call``, if it returns, proves it left empty (an
        unlink or rmdir succeeded), recorded without a look."""
        journal = self.journal
        journal.begin(paths, seen=seen)
        try:
            result = call()
        except BaseException:
            journal.end(paths)
            raise
        journal.end(paths, left={gone: None} if gone is not None else None)
        return result

    def entry(self, path: str) -> "RecordingEntry":
        """:meth:`HostFS.entry` of ``inner``, its removals recorded (:class:`RecordingEntry`)."""
        return RecordingEntry(self, self.inner.entry(path))

    def unlink(self, path: str) -> None:
        with self.entry(path) as entry:
            entry.unlink()

    def rmdir(self, path: str) -> None:
        with self.entry(path) as entry:
            entry.rmdir()

    def _unlink_entry(self, entry: Entry) -> None:
        """The journal's look and the unlink through one :meth:`HostFS.entry` of ``inner``:
        on the real disk one resolution of the parent for both, so the entry looked at is the
        one removed (the simulated disk: the same ``lstat`` then ``unlink`` as before)."""
        path = entry.path
        self._dropping(path, [path], entry.unlink, gone=path, entry=entry)

    def _rmdir_entry(self, entry: Entry) -> None:
        """As :meth:`_unlink_entry`: the journal's look (what its ``begin`` would take) and
        the rmdir through one entry."""
        path = entry.path
        with self.mutex:
            try:
                seen: Stat | None | OSError = entry.lstat()
            except OSError as e:  # as the journal's own look (lstat_or_none) records it
                seen = None if e.errno in ABSENT_ERRNOS else e
            self._recorded([path], entry.rmdir, seen={path: seen}, gone=path)

    def mkdir(self, path: str, mode: int) -> None:
        with self._rec([path], [parent_of(path)]):
            self.inner.mkdir(path, mode)

    def rename(self, src: str, dst: str) -> None:
        # dst may be replaced; src, if the rename succeeds, is left empty
        self._dropping(dst, [src, dst], lambda: self.inner.rename(src, dst), moved=src)

    def exchange(self, a: str, b: str) -> None:
        with self._rec([a, b], [parent_of(a), parent_of(b)]):  # nothing is replaced: both move
            self.inner.exchange(a, b)

    def symlink(self, target: str, path: str) -> None:
        with self._rec([path], [parent_of(path)]):
            self.inner.symlink(target, path)

    def mknod(self, path: str, mode: int, fmt: int) -> None:
        with self._rec([path], [parent_of(path)]):
            self.inner.mknod(path, mode, fmt)

    def link(self, existing: str, new: str) -> None:
        with self._rec([new, existing], [parent_of(new)]):  # existing: its nlink and ctime
            self.inner.link(existing, new)

    def chmod(self, path: str, mode: int) -> None:
        with self._rec([path]):
            self.inner.chmod(path, mode)

    def utime(self, path: str, mtime_ns: int, atime_ns: int | None = None) -> None:
        with self._rec([path]):
            self.inner.utime(path, mtime_ns, atime_ns)

    def lchown(self, path: str, uid: int, gid: int) -> None:
        with self._rec([path]):
            self.inner.lchown(path, uid, gid)

    def setxattr(self, path: str, name: str, value: bytes) -> None:
        with self._rec([path]):
            self.inner.setxattr(path, name, value)

    def removexattr(self, path: str, name: str) -> None:
        with self._rec([path]):
            self.inner.removexattr(path, name)

    def fallocate(self, path: str, offset: int, length: int, mode: int = 0) -> None:
        with self._rec([path]):
            self.inner.fallocate(path, offset, length, mode)

    def copy_file_range(self, src: str, dst: str, src_offset: int, dst_offset: int, length: int) -> int:
        with self._rec([dst]):
            return self.inner.copy_file_range(src, dst, src_offset, dst_offset, length)

    def clone_to(self, path: str, dst_fs: HostFS, dst_path: str) -> None:
        """Reflink out of this folder (a read here); a recording destination is unwrapped
        (so two real filesystems still share extents) and the new file recorded there."""
        if isinstance(dst_fs, RecordingHostFS):
            with dst_fs._rec([dst_path], [parent_of(dst_path)]):
                self.inner.clone_to(path, dst_fs.inner, dst_path)
        else:
            self.inner.clone_to(path, dst_fs, dst_path)

    def lock(self, path: str) -> Lock:
        with self._rec([path], [parent_of(path)]):  # creates and writes the lock file
            return self.inner.lock(path)


class _Recorded:
    """:meth:`RecordingHostFS._rec`: the context ``with fs.mutex, fs.journal.writing(paths)``
    (``begin``; the block; ``end``, also when the block raised), without a generator."""

    __slots__ = ("fs", "paths")

    def __init__(self, fs: RecordingHostFS, paths: list[str]):
        self.fs, self.paths = fs, paths

    def __enter__(self) -> None:
        self.fs.mutex.acquire()
        try:
            self.fs.journal.begin(self.paths)
        except BaseException:
            self.fs.mutex.release()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.fs.journal.end(self.paths)
        finally:
            self.fs.mutex.release()
