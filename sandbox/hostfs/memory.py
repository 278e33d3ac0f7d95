"""MemoryHostFS: an in-memory filesystem with the semantics and errnos of RealHostFS.

It models what the undo core must get right: file types (regular, directory, symlink,
plus "other" special files that are never opened), all 12 mode bits, nanosecond
mtimes and ctimes from a deterministic clock, xattrs, symlink targets, and hardlinks
(shared inodes with a link count; a directory's count is 2 + its subdirectories, as on
ext4). Where filesystems differ (timestamps touched by ``fallocate``, xattr rules), the
reference is Linux on ext4; ``sandbox_sim/test_hostfs.py`` checks both implementations agree.

Every public operation first calls ``fault_hook(fs, op, path, nbytes)`` (without one, it
only counts itself into ``tally``, if set). The hook may
raise (a simulated crash, ``ENOSPC``, ``EIO``) or, for ``write``, return a byte count
smaller than requested: the write is then *torn* — that prefix lands and the hook's
``after_torn_write`` is called (which normally raises the crash). See ``sandbox_sim/faults.py``.

Open handles (:class:`MemoryFileHandle`) hold the inode itself, so they follow it through
renames and outlive an unlink, as a kernel file description does. Their calls go through
the same fault hook with the path-based op names (``read``, ``write`` — torn like a path
write —, ``truncate``, ``fsync``; plus ``open`` and ``fstat``) and change the inode exactly
as the path-based calls do; ``close`` calls no hook.

A simulated process death (:meth:`crash`) drops the locks the dead process held, as the
kernel drops ``flock`` locks of a killed process, and closes its open handles (any later
call on one is ``EBADF``): a handle from before a crash never writes into the next run.

Timestamps: atime is set at creation and by ``utime`` only (as with ``noatime``); the
parity suite compares it only after an explicit ``utime``. Every change of an inode's mode,
mtime, bytes, xattrs or owner (and of a directory's entries) sets its ctime from the clock,
as Linux does; only a power loss sets older ctimes back (it counts in ``power_losses``). With a
:class:`SimClock`, which never returns a value twice, an unchanged ctime is an unchanged
inode — what the simulation's kept snapshot relies on (``sandbox_sim/oracle.py``).
"""

from __future__ import annotations

import errno
import itertools
import os
import stat as _stat
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

from . import (
    DIR,
    LNK,
    OTHER,
    TREE_PATH_BYTES_MAX,
    REG,
    MKNOD_FMTS,
    Attr,
    FileHandle,
    HostFS,
    Stat,
    StatFS,
    StoreBusy,
    bounded_names,
    check_component,
    check_open_flags,
    is_within,
    parent_of,
)

FaultHook = Callable[["MemoryHostFS", str, str, int], Optional[int]]

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_FALLOC_FL_ZERO_RANGE = 0x10

_SYMLINK_MAX = 4095  # a symlink target must fit in PATH_MAX with its NUL
_PATH_MAX = TREE_PATH_BYTES_MAX  # longest path resolved (RealHostFS resolves longer than PATH_MAX in pieces)
_NAME_MAX = 255
_XATTR_NAME_MAX = 255
_XATTR_PREFIXES = ("user.", "trusted.", "security.")
# a str of at most this many characters cannot exceed the byte limit in UTF-8 (4 bytes a
# character at most; a surrogate-escaped byte is 1): the encode is skipped for it
# the calls that change nothing: an fsync's deferred metadata commit may wait past them
_READ_ONLY_OPS = frozenset({"lstat", "getattr", "statfs", "listdir", "read", "open", "readlink", "listxattr", "getxattr",
                            "fstat", "lseek", "fsync"})
_SHORT_NAME = _NAME_MAX // 4
_SHORT_PATH = _PATH_MAX // 4

#: data versions one inode records since its last durability point (``record_losses``);
#: beyond it the newest version replaces the last one recorded (counted in
#: ``unsynced_versions_dropped``): the states in between are no longer offered
UNSYNCED_VERSIONS_MAX = 64

#: inodes one disk notes as changed since its last journal commit (``_meta_changed``); past it
#: the notes are dropped, noting stops and the next commit copies every reachable inode, as
#: before the notes (noting starts again after it)
META_CHANGED_KEPT_MAX = 4096

#: paths whose resolution one disk remembers (``MemoryHostFS._walk``); past it the memory is
#: cleared and refilled by the next lookups (answers never change, only their cost)
RESOLVED_PATHS_KEPT_MAX = 4096


class SimClock:
    """Deterministic nanosecond clock: strictly increasing, 1 ms + 1 ns per tick."""

    def __init__(self, start_ns: int = 1_700_000_000_000_000_000):
        #: the next tick, as calling the clock gives it (one sequence: they share it) — a C
        #: call, without the Python frame of ``__call__``: what ``MemoryHostFS`` calls
        self.tick: Callable[[], int] = itertools.count(start_ns + 1_000_001, 1_000_001).__next__

    def __call__(self) -> int:
        return self.tick()


_USUAL_FMT = {REG: _stat.S_IFREG, DIR: _stat.S_IFDIR, LNK: _stat.S_IFLNK}  # a new inode's S_IFMT by kind (else a fifo)


#: what a byte budget (:meth:`MemoryHostFS.limit_bytes`) counts for one inode and for one
#: name beside their contents (an object, a dict slot; a name's own bytes are added)
INODE_BYTES = 256
NAME_BYTES = 64


class _Budget:
    """The bytes a budgeted :class:`MemoryHostFS` holds (:meth:`MemoryHostFS.limit_bytes`):
    held by the finalizers of its inodes, never by the filesystem, so that dropping the
    filesystem frees its inodes and they give their bytes back."""

    __slots__ = ("bytes_max", "used", "inodes")

    def __init__(self, bytes_max: int):
        self.bytes_max = bytes_max
        self.used = 0
        self.inodes: dict[int, int] = {}  # ino -> bytes it holds (itself, data, xattrs, target)

    def charge(self, n: int, path: str) -> None:
        if n > 0 and self.used + n > self.bytes_max:
            raise _err(errno.ENOSPC, path)
        self.used += n

    def gone(self, ino: int) -> None:
        self.used -= self.inodes.pop(ino, 0)


def _inode_bytes(node: "_Inode") -> int:
    return (INODE_BYTES + len(node.data) + len(node.target.encode("utf-8", "surrogateescape"))
            + sum(len(k) + len(v) for k, v in node.xattrs.items()))


def _name_bytes(name: str) -> int:
    return NAME_BYTES + len(name.encode("utf-8", "surrogateescape"))


@dataclass(slots=True, weakref_slot=True, init=False)
class _Inode:
    ino: int
    kind: str
    mode: int
    mtime_ns: int
    ctime_ns: int
    data: bytearray = field(default_factory=bytearray)
    target: str = ""
    entries: dict[str, "_Inode"] = field(default_factory=dict)
    xattrs: dict[str, bytes] = field(default_factory=dict)
    nlink: int = 1
    durable_meta: tuple | None = None  # metadata as of the last journal commit (see power_loss)
    durable_data: bytes | None = None  # bytes as of this inode's last fsync
    atime_ns: int = 0  # the mtime given at creation unless one is given
    fmt: int = 0  # S_IFMT bits; 0: the usual one for ``kind`` (an OTHER is a fifo)
    uid: int = 0  # the owner (a new inode gets its filesystem's ``uid``/``gid``)
    gid: int = 0
    # (the fields a Stat is made of that can change, that Stat): the last one built, handed
    # out again while those fields are equal (a Stat is frozen, so sharing it is safe)
    kept_stat: tuple | None = field(default=None, compare=False, repr=False)

    def __init__(self, ino: int, kind: str, mode: int, mtime_ns: int, ctime_ns: int, data: bytearray | None = None,
                 target: str = "", entries: dict[str, "_Inode"] | None = None, xattrs: dict[str, bytes] | None = None,
                 nlink: int = 1, durable_meta: tuple | None = None, durable_data: bytes | None = None,
                 atime_ns: int | None = None, fmt: int = 0, uid: int = 0, gid: int = 0, kept_stat: tuple | None = None):
        """The fields above, in their order and with their defaults (a new bytearray and
        dicts where none is given); written out rather than generated: a disk makes one per
        name it creates, and the generated one ran a ``__post_init__`` for the last two rules."""
        self.ino = ino
        self.kind = kind
        self.mode = mode
        self.mtime_ns = mtime_ns
        self.ctime_ns = ctime_ns
        self.data = bytearray() if data is None else data
        self.target = target
        self.entries = {} if entries is None else entries
        self.xattrs = {} if xattrs is None else xattrs
        self.nlink = nlink
        self.durable_meta = durable_meta
        self.durable_data = durable_data
        self.atime_ns = mtime_ns if atime_ns is None else atime_ns
        self.fmt = fmt or _USUAL_FMT.get(kind, _stat.S_IFIFO)
        self.uid = uid
        self.gid = gid
        self.kept_stat = kept_stat

    def meta(self) -> tuple:
        return (self.mode, self.mtime_ns, self.ctime_ns, self.target, dict(self.entries), dict(self.xattrs), self.nlink,
                self.atime_ns, self.uid, self.gid)

    def stat(self) -> Stat:
        kind = self.kind
        size = len(self.data) if kind == REG else len(self.target.encode("utf-8", "surrogateescape")) if kind == LNK else 4096 if kind == DIR else 0
        fields = (self.mode, size, self.mtime_ns, self.ctime_ns, self.nlink, self.uid, self.gid)  # kind, ino, fmt never change
        kept = self.kept_stat
        if kept is not None and kept[0] == fields:
            return kept[1]
        st = Stat(kind, self.mode, size, self.mtime_ns, self.ctime_ns, self.ino, self.nlink, 0, self.fmt, self.uid, self.gid)
        self.kept_stat = (fields, st)
        return st

    def attr(self) -> Attr:
        """As ext4 reports it: whole 4 KiB blocks, symlinks under 60 bytes inline."""
        st = self.stat()
        if self.kind in (REG, DIR):
            blocks = -(-st.size // 4096) * 8
        elif self.kind == LNK:
            blocks = 0 if st.size < 60 else 8
        else:
            blocks = 0
        return Attr(self.kind, self.fmt, self.mode, st.size, self.nlink, self.uid, self.gid, 0, 4096, blocks, self.atime_ns,
                    self.mtime_ns, self.ctime_ns, self.ino)


def _err(code: int, path: str) -> OSError:
    return OSError(code, os.strerror(code), path)


class _SimLock:
    def __init__(self, fs: "MemoryHostFS", path: str):
        self._fs, self._path = fs, path

    def release(self) -> None:
        # like closing the flock'd fd: drops this lock only, and only once
        held = self._fs._locks.get(self._path)
        if held is not None and held[1] is self:
            del self._fs._locks[self._path]


class MemoryFileHandle(FileHandle):
    """A regular file opened by :meth:`MemoryHostFS.open`: holds the inode, not the path."""

    def __init__(self, fs: "MemoryHostFS", node: _Inode, path: str, flags: int):
        self.path = path
        self.flags = flags
        self._fs = fs
        self._node = node
        self._epoch = fs._epoch  # a crash of the process that opened it closes it
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed or self._epoch != self._fs._epoch

    def _call(self, op: str, nbytes: int = 0) -> Optional[int]:
        """EBADF if closed (no host call happens), else the fault hook, as a path call."""
        if self.closed:
            raise _err(errno.EBADF, self.path)
        return self._fs._fault(op, self.path, nbytes)

    def _can(self, write: bool) -> bool:
        acc = self.flags & os.O_ACCMODE
        return acc in (os.O_WRONLY, os.O_RDWR) if write else acc in (os.O_RDONLY, os.O_RDWR)

    def pread(self, length: int, offset: int) -> bytes:
        self._call("read")
        if offset < 0 or length < 0:
            raise _err(errno.EINVAL, self.path)
        if not self._can(write=False):
            raise _err(errno.EBADF, self.path)
        return bytes(self._node.data[offset : offset + length])

    def read_own(self, length: int, offset: int) -> bytes:
        """The server's own read: whatever the handle's access mode (no atime kept here)."""
        self._call("read")
        if offset < 0 or length < 0:
            raise _err(errno.EINVAL, self.path)
        return bytes(self._node.data[offset : offset + length])

    def pwrite(self, data: bytes | bytearray | memoryview, offset: int) -> int:
        limit = self._call("write", len(data))
        if offset < 0:  # checked before O_APPEND moves the offset, as pwrite(2) does
            raise _err(errno.EINVAL, self.path)
        if not self._can(write=True):
            raise _err(errno.EBADF, self.path)
        if self.flags & os.O_APPEND:
            offset = len(self._node.data)
        return self._fs._write_node(self._node, offset, data, limit, self.path)

    def truncate(self, size: int) -> None:
        self._call("truncate")
        if size < 0 or not self._can(write=True):  # ftruncate(2) of a read-only fd: EINVAL
            raise _err(errno.EINVAL, self.path)
        self._fs._truncate_node(self._node, size, self.path)

    def fsync(self, datasync: bool = False) -> None:
        """``fsync`` commits like :meth:`MemoryHostFS.fsync`; ``fdatasync`` makes only this
        file's bytes durable (the strict reading: no journal commit is promised)."""
        self._call("fsync")
        if datasync:
            self._node.durable_data = bytes(self._node.data)
            if self._fs.record_losses:
                self._fs._unsynced.pop(self._node.ino, None)
        else:
            self._fs._fsync_node(self._node)

    def fstat(self) -> Attr:
        self._call("fstat")
        return self._node.attr()

    def listdir(self, *, limit_bytes: int | None = None) -> list[str]:
        """The entries of the directory inode held (:meth:`MemoryHostFS.open_dir`), as
        :meth:`MemoryHostFS.listdir` of a path (the same fault hook, the same bound)."""
        self._call("listdir")
        if self._node.kind != DIR:
            raise _err(errno.ENOTDIR, self.path)
        return self._fs._read_names(self._node, limit_bytes, self.path)

    def getattr_at(self, name: str) -> Attr:
        """The entry ``name`` of the directory inode held, as :meth:`MemoryHostFS.getattr`
        reports a path's (the same fault hook)."""
        self._call("getattr")
        return self._entry_at(name).attr()

    def getattr_xattr_names_at(self, name: str) -> tuple[Attr, list[str]]:
        """The entry ``name`` of the directory inode held (:meth:`MemoryHostFS.open_dir`), as
        :meth:`MemoryHostFS.getattr_xattr_names` reports a path's."""
        self._call("getattr")
        node = self._entry_at(name)
        return node.attr(), self._fs._listed(node)

    def getxattr_at(self, name: str, xattr: str) -> bytes:
        """:meth:`MemoryHostFS.getxattr` of the entry ``name`` of the directory inode held."""
        self._call("getxattr")
        return self._fs._getxattr_node(self._fs._xattr_node_of(self._entry_at(name), xattr, False, self.path),
                                       xattr, self.path)

    def _entry_at(self, name: str):
        check_component(name, self.path)
        if self._node.kind != DIR:
            raise _err(errno.ENOTDIR, self.path)
        node = self._fs._child(self._node, name, self.path)
        if node is None:
            raise _err(errno.ENOENT, self.path)
        return node

    # metadata: the path-based calls' own code, applied to the held inode

    def chmod(self, mode: int) -> None:
        self._call("chmod")
        self._fs._chmod_node(self._node, mode)

    def utime(self, mtime_ns: int, atime_ns: int | None = None) -> None:
        self._call("utime")
        self._fs._utime_node(self._node, mtime_ns, atime_ns)

    def chown(self, uid: int, gid: int) -> None:
        self._call("chown")
        self._fs._chown_node(self._node, uid, gid, self.path)

    def listxattr(self) -> list[str]:
        self._call("listxattr")
        return self._fs._listed(self._node)

    def getxattr(self, name: str) -> bytes:
        self._call("getxattr")
        return self._fs._getxattr_node(self._node, name, self.path)

    def setxattr(self, name: str, value: bytes) -> None:
        self._call("setxattr", len(value))
        self._fs._setxattr_node(self._node, name, value, self.path)

    def removexattr(self, name: str) -> None:
        self._call("removexattr")
        self._fs._removexattr_node(self._node, name, self.path)

    def fallocate(self, offset: int, length: int, mode: int = 0) -> None:
        self._call("fallocate", length)
        if not self._can(write=True):
            raise _err(errno.EBADF, self.path)
        self._fs._fallocate_node(self._node, offset, length, mode, self.path)

    def copy_range_to(self, dst: FileHandle, src_offset: int, dst_offset: int, length: int) -> int:
        self._call("copy_file_range", length)
        if not isinstance(dst, MemoryFileHandle) or dst._fs is not self._fs:
            raise _err(errno.EXDEV, self.path)
        if dst.closed:
            raise _err(errno.EBADF, dst.path)
        if not self._can(write=False) or not dst._can(write=True) or dst.flags & os.O_APPEND:
            raise _err(errno.EBADF, dst.path)
        return self._fs._copy_nodes(self._node, dst._node, src_offset, dst_offset, length, dst.path)

    def lseek(self, offset: int, whence: int) -> int:
        """The whole file is data: the simulator keeps no holes (a punched range reads as
        zeros), which lseek(2) allows."""
        self._call("lseek")
        return super().lseek(offset, whence)

    def close(self) -> None:
        self._closed = True


class MemoryHostFS(HostFS):
    """An in-memory directory tree. ``clock`` supplies timestamps (ns)."""

    def __init__(self, name: str = "work", clock: Callable[[], int] | None = None, fault_hook: FaultHook | None = None, pid: int = 4242,
                 trusted_xattrs: bool = True):
        self.name = name
        #: the server has CAP_SYS_ADMIN (root): ``trusted.*`` xattrs are kept, on every kind
        #: of entry; without it they are refused (EPERM) and never listed, as Linux does
        self.trusted_xattrs = trusted_xattrs
        self.clock = clock or SimClock()  # (sets _tick)
        self.fault_hook = fault_hook
        #: an object counting this disk's host calls while no ``fault_hook`` is set: each call
        #: adds 1 to its ``calls`` and, if its op is in ``tally_mutations``, 1 to its
        #: ``store_mutations`` — a quiet fault injector counting without a Python call per
        #: host call (``sandbox_sim/faults.py``, ``FaultInjector.attach``)
        self.tally: Any = None
        self.tally_mutations: frozenset[str] = frozenset()
        self.pid = pid
        self._inos = itertools.count(2)
        now = self._tick()
        self._root = _Inode(1, DIR, 0o755, now, now, nlink=2)
        #: inodes whose metadata may have changed since the last journal commit, by number
        #: (every change of an inode's metadata — entries, mode, times, xattrs, owner, link
        #: count, target — and every new inode is noted: ``_note``): what a commit copies.
        #: None: nothing is noted and the next commit copies every reachable inode — until
        #: the first commit (a disk that never commits notes nothing) and past
        #: ``META_CHANGED_KEPT_MAX`` notes
        self._meta_changed: dict[int, _Inode] | None = None
        #: every commit copies the metadata of every reachable inode instead (a reference for tests)
        self.commit_whole = False
        self._locks: dict[str, tuple[int, object]] = {}
        self._epoch = 0  # bumped by a process death: handles opened before it are closed
        self._commit_pending = False  # an fsync's metadata commit not taken yet (see _fsync_node)
        self.uid = 0  # who uses this filesystem: the owner of what it creates; only 0 may give files away
        self.gid = 0
        self.record_losses = False  # record un-fsynced data versions for power_loss(keep=...)
        self._unsynced: dict[int, tuple[_Inode, list[bytes]]] = {}  # ino -> (inode, versions since its last fsync)
        self.unsynced_versions_dropped = 0  # versions replaced beyond UNSYNCED_VERSIONS_MAX
        # path -> the inode a successful _walk of it found, or that a call just named by it
        # (create, mkdir, symlink, mknod, link, rename: its parent was resolved as a walk
        # resolves it, the last name checked, so a walk would find that inode now); every kept
        # path leads to its inode now. Adding a name cannot change where an existing path leads, and an inode's kind
        # never changes; a name removed or replaced drops its own path (unlink, rmdir of an
        # empty directory, rename or exchange of non-directories: no kept path leads through
        # them, since a path is one string per entry and no walk passes a non-directory), and a
        # directory moved, and power_loss, drop them all. Failures are not kept, so every
        # error is found by a real walk.
        self._resolved: dict[str, _Inode] = {}
        #: bumped before every call that may change the tree (and by power_loss): equal
        #: values mean an unchanged tree, for callers that keep what they read of it
        self.changes = 0
        #: bumped whenever a directory's entries change — a name added, removed or replaced:
        #: each such change also sets the directory's times (``_entries_changed``) — and by
        #: power_loss: equal values mean every path leads to the inode it led to before
        self.names = 0
        #: power losses so far (each sets older ctimes, bytes and entries back)
        self.power_losses = 0
        #: directory entries ``listdir`` (a path's or a handle's) has read so far: a bounded
        #: listing reads one name past what it returns, never the rest of the directory
        self.entries_read = 0
        self._kept_walk: tuple[int, tuple[tuple[str, _Inode], ...]] | None = None  # (names, tree_nodes())
        #: None (the simulated disk): unbounded; else :meth:`limit_bytes`
        self._budget: _Budget | None = None

    # -- simulation controls (not part of HostFS) --

    @property
    def clock(self) -> Callable[[], int]:
        """Where timestamps come from (ns); every tick goes through ``_tick``: a
        :class:`SimClock`'s ``tick``, else the clock itself."""
        return self._clock

    @clock.setter
    def clock(self, clock: Callable[[], int]) -> None:
        self._clock = clock
        self._tick = clock.tick if type(clock) is SimClock else clock

    @property
    def bytes_max(self) -> int | None:
        """The byte budget (:meth:`limit_bytes`), or None: unbounded."""
        return None if self._budget is None else self._budget.bytes_max

    @property
    def bytes_used(self) -> int:
        return 0 if self._budget is None else self._budget.used

    def limit_bytes(self, spare: int) -> None:
        """From now on, hold at most what the tree holds now plus ``spare`` bytes — file
        bytes, xattr names and values, symlink targets, :data:`INODE_BYTES` an inode and
        :data:`NAME_BYTES` (plus its own) a name: a change that would hold more is ``ENOSPC``
        and changes nothing. An inode's bytes are given back when it is gone (no name, no
        open handle). For a tree an untrusted client may write (a writable in-memory mount);
        not kept across :meth:`power_loss`."""
        budget = _Budget(0)
        seen: set[int] = set()
        for path, node in self.tree_nodes():
            if path:
                budget.used += _name_bytes(path.rsplit("/", 1)[-1])
            if node.ino not in seen:
                seen.add(node.ino)
                self._adopt(budget, node)
        budget.bytes_max = budget.used + spare
        self._budget = budget

    @staticmethod
    def _adopt(budget: _Budget, node: _Inode) -> None:
        n = budget.inodes[node.ino] = _inode_bytes(node)
        budget.used += n
        weakref.finalize(node, budget.gone, node.ino)

    def _charge(self, node: _Inode | None, n: int, path: str) -> None:
        """Budgeted: ``n`` more bytes held (by ``node``'s inode, or a name), or ``ENOSPC``."""
        budget = self._budget
        if budget is not None:
            budget.charge(n, path)
            if node is not None and node.ino in budget.inodes:
                budget.inodes[node.ino] += n

    def _charge_new(self, name: str, target: str, path: str) -> None:
        """Budgeted: a new inode (with ``target``) under the new ``name`` — or ``ENOSPC``."""
        if self._budget is not None:
            self._budget.charge(INODE_BYTES + len(target.encode("utf-8", "surrogateescape")) + _name_bytes(name), path)

    def _new_node(self, node: _Inode, name: str) -> _Inode:
        """``node`` was just made under ``name`` (both charged by :meth:`_charge_new`): its
        bytes are given back when it is gone."""
        budget = self._budget
        if budget is not None:
            budget.inodes[node.ino] = _inode_bytes(node)
            weakref.finalize(node, budget.gone, node.ino)
        return node

    def crash(self) -> None:
        """The process using this filesystem died: its locks and open handles are gone, data stays."""
        self._locks.clear()
        self._epoch += 1

    def make_special(self, path: str, mode: int = 0o644, fmt: int = _stat.S_IFIFO) -> None:
        """Place a special file (a fifo unless ``fmt`` says otherwise) for tests of 'never opened'."""
        if fmt in (0, _stat.S_IFREG, _stat.S_IFDIR, _stat.S_IFLNK) or fmt & ~0o170000:
            raise ValueError(f"not a special file type: {fmt:#o}")
        if self._commit_pending:
            self._commit_metadata()
        self.changes += 1
        self._mknod_node(path, mode, fmt)

    def _mknod_node(self, path: str, mode: int, fmt: int) -> None:
        parent, name, there = self._parent_child(path)
        if there is not None:
            raise _err(errno.EEXIST, path)
        self._charge_new(name, "", path)
        now = self._tick()
        node = parent.entries[name] = self._new_node(
            _Inode(next(self._inos), OTHER, mode & 0o7777, now, now, fmt=fmt, uid=self.uid, gid=self.gid), name)
        self._note(node)
        self._entries_changed(parent, now)
        self._keep_resolved(path, node)

    def tree_nodes(self, path: str = "") -> list[tuple[str, _Inode]]:
        """Every entry at and under ``path`` with its inode, depth first in sorted name order
        (simulation control, not part of HostFS: no fault hook, no host call counted). For
        the simulation's oracle and client, which read the tree without being part of the
        run under test; the inodes are the live ones and must only be read."""
        out: list[tuple[str, _Inode]] = []
        stack = [(path, self._entry(path) if path else self._root)]
        while stack:
            p, node = stack.pop()
            out.append((p, node))
            if node.kind == DIR and node.entries:
                prefix = p + "/" if p else ""
                entries = node.entries
                stack += [(prefix + name, entries[name]) for name in sorted(entries, reverse=True)]
        return out

    def tree_nodes_kept(self) -> tuple[tuple[str, _Inode], ...]:
        """:meth:`tree_nodes` of the whole tree, walked again only after a directory's entries
        changed (``names``): until then every path leads to the same inode, so the same
        walk would find the same pairs (the inodes' contents are live, as there). Shared by
        every caller: only read it. A change made behind the disk's back (to an inode's
        ``entries``) is not seen — the campaign's cross-check compares with a fresh walk."""
        kept = self._kept_walk
        if kept is not None and kept[0] == self.names:
            return kept[1]
        walk = tuple(self.tree_nodes())
        self._kept_walk = (self.names, walk)
        return walk

    # -- internals --

    def _fault(self, op: str, path: str, nbytes: int = 0) -> Optional[int]:
        if op not in _READ_ONLY_OPS:
            self.changes += 1
            if self._commit_pending:
                self._commit_metadata()  # an fsync's journal commit, taken before anything changes
            noted = self._meta_changed
            if noted is not None and len(noted) >= META_CHANGED_KEPT_MAX:  # one call notes a few inodes at most
                self._meta_changed = None
        hook = self.fault_hook
        if hook is not None:
            return hook(self, op, path, nbytes)
        tally = self.tally
        if tally is not None:
            tally.calls += 1
            if op in self.tally_mutations:
                tally.store_mutations += 1
        return None

    def _look(self, op: str, path: str) -> None:
        """:meth:`_fault` of a call that changes nothing (an op of ``_READ_ONLY_OPS`` other
        than ``fsync``, which is no store mutation either): the same hook call or count."""
        hook = self.fault_hook
        if hook is not None:
            hook(self, op, path, 0)
        else:
            tally = self.tally
            if tally is not None:
                tally.calls += 1

    @staticmethod
    def _child(d: _Inode, name: str, path: str) -> Optional[_Inode]:
        """Look ``name`` up in directory ``d``; a name no directory can hold is ENAMETOOLONG."""
        if len(name) > _SHORT_NAME and len(name.encode("utf-8", "surrogateescape")) > _NAME_MAX:
            raise _err(errno.ENAMETOOLONG, path)
        return d.entries.get(name)

    def _walk(self, path: str) -> _Inode:
        """Resolve a whole path, as RealHostFS's single openat2 of it does."""
        node = self._resolved.get(path)
        if node is not None:
            return node
        node = self._root
        if not path:
            return node
        if len(path) > _SHORT_PATH and len(path.encode("utf-8", "surrogateescape")) > _PATH_MAX:
            raise _err(errno.ENAMETOOLONG, path)
        for part in path.split("/"):
            if node.kind != DIR:
                raise _err(errno.ELOOP if node.kind == LNK else errno.ENOTDIR, path)
            if len(part) > _SHORT_NAME and len(part.encode("utf-8", "surrogateescape")) > _NAME_MAX:
                raise _err(errno.ENAMETOOLONG, path)
            child = node.entries.get(part)
            if child is None:
                raise _err(errno.ENOENT, path)
            node = child
        self._keep_resolved(path, node)
        return node

    def _keep_resolved(self, path: str, node: _Inode) -> None:
        if len(self._resolved) >= RESOLVED_PATHS_KEPT_MAX:
            self._resolved.clear()
        self._resolved[path] = node

    def _entry(self, path: str) -> _Inode:
        """Resolve the parent, then the final name, as RealHostFS's ``*at()`` calls do."""
        if not path:
            return self._root
        node = self._resolved.get(path)
        if node is not None:  # resolved before: the same walk, the same checks passed
            return node
        parent, name, node = self._parent_child(path)
        if node is None:
            raise _err(errno.ENOENT, path)
        return node

    def _parent(self, path: str) -> tuple[_Inode, str]:
        if not path:
            raise _err(errno.EBUSY, path)
        if len(path) > _SHORT_PATH and len(path.encode("utf-8", "surrogateescape")) > _PATH_MAX:  # the whole path, as RealHostFS
            raise _err(errno.ENAMETOOLONG, path)
        i = path.rfind("/")
        if i >= 0:
            head = path[:i]
            parent = self._resolved.get(head) or self._walk(head)
        else:
            parent = self._root
        if parent.kind != DIR:
            raise _err(errno.ELOOP if parent.kind == LNK else errno.ENOTDIR, path)
        return parent, path[i + 1:]

    def _parent_child(self, path: str) -> tuple[_Inode, str, Optional[_Inode]]:
        """:meth:`_parent`, then :meth:`_child` of its last name: ``(parent, name, what
        is there or None)``, the same checks in the same order (one call: the most frequent
        resolution of a call that makes or removes a name)."""
        parent, name = self._parent(path)
        if len(name) > _SHORT_NAME and len(name.encode("utf-8", "surrogateescape")) > _NAME_MAX:
            raise _err(errno.ENAMETOOLONG, path)
        return parent, name, parent.entries.get(name)

    def _file(self, path: str) -> _Inode:
        node = self._resolved.get(path) or self._walk(path)
        if node.kind == REG:  # the usual answer first
            return node
        if node.kind == LNK:
            raise _err(errno.ELOOP, path)
        if node.kind == DIR:
            raise _err(errno.EISDIR, path)
        if node.kind != REG:
            raise _err(errno.EPERM, path)
        return node

    def _note(self, node: _Inode) -> None:
        """``node``'s metadata changed, or it is new: the next commit copies it."""
        noted = self._meta_changed
        if noted is not None:
            noted[node.ino] = node

    def _entries_changed(self, d: _Inode, now: int) -> None:
        """Directory ``d`` gained, lost or replaced a name: its times are set and ``names``
        counts the change. Every change of a directory's ``entries`` calls it (but
        power_loss's, which counts itself)."""
        d.mtime_ns = now
        d.ctime_ns = now
        self.names += 1
        noted = self._meta_changed  # _note(d), inline
        if noted is not None:
            noted[d.ino] = d

    # -- queries --

    def lstat(self, path: str) -> Stat:
        self._look("lstat", path)
        return self._entry(path).stat()

    def lstat_or_none(self, path: str) -> Stat | None:
        """:meth:`lstat`, or None where nothing is (``ENOENT``, ``ENOTDIR``, ``ELOOP``: the
        ``ABSENT_ERRNOS`` rule of every "is it there?"), found without raising and catching
        an error: the same fault hook call, the same answers, the same errors otherwise."""
        hook = self.fault_hook  # _look("lstat", path), inline: the disk's most frequent call
        if hook is not None:
            hook(self, "lstat", path, 0)
        else:
            tally = self.tally
            if tally is not None:
                tally.calls += 1
        node = self._resolved.get(path)
        if node is not None:  # resolved before: the whole path and every component passed every check
            return node.stat()
        if not path:
            return self._root.stat()
        if len(path) > _SHORT_PATH and len(path.encode("utf-8", "surrogateescape")) > _PATH_MAX:
            raise _err(errno.ENAMETOOLONG, path)
        i = path.rfind("/")
        node = self._resolved.get(path[:i]) if i > 0 else None
        if node is not None:  # the parent resolved before
            if node.kind != DIR:
                return None
            name = path[i + 1:]
            if len(name) > _SHORT_NAME and len(name.encode("utf-8", "surrogateescape")) > _NAME_MAX:
                raise _err(errno.ENAMETOOLONG, path)
            node = node.entries.get(name)
            if node is None:
                return None
            self._keep_resolved(path, node)
            return node.stat()
        node = self._root
        for part in path.split("/"):  # _entry's checks, in its order
            if node.kind != DIR:
                return None  # a symlink (ELOOP) or another non-directory (ENOTDIR) on the way
            if len(part) > _SHORT_NAME and len(part.encode("utf-8", "surrogateescape")) > _NAME_MAX:
                raise _err(errno.ENAMETOOLONG, path)
            node = node.entries.get(part)
            if node is None:
                return None
        self._keep_resolved(path, node)
        return node.stat()

    def getattr(self, path: str) -> Attr:
        self._look("getattr", path)
        return self._entry(path).attr()

    def statfs(self) -> StatFS:
        self._look("statfs", "")
        return super().statfs()

    def listdir(self, path: str, *, limit_bytes: int | None = None) -> list[str]:
        self._look("listdir", path)
        node = self._walk(path)
        # a final symlink is not followed, and is not a directory: the kernel checks
        # O_DIRECTORY before it would refuse to open a symlink (ELOOP)
        if node.kind != DIR:
            raise _err(errno.ENOTDIR, path)
        return self._read_names(node, limit_bytes, path)

    def _read_names(self, node: _Inode, limit_bytes: int | None, path: str) -> list[str]:
        """A directory's names, read one at a time up to ``limit_bytes`` (:func:`bounded_names`),
        each counted in :attr:`entries_read`."""
        if limit_bytes is None:
            names = list(node.entries)
            self.entries_read += len(names)
            return names
        return bounded_names(self._counted(node.entries), limit_bytes, path)

    def _counted(self, names: Iterable[str]) -> Iterator[str]:
        for name in names:
            self.entries_read += 1
            yield name

    def read(self, path: str, offset: int, length: int) -> bytes:
        self._look("read", path)
        node = self._file(path)
        if offset < 0 or length < 0:
            raise _err(errno.EINVAL, path)
        return bytes(node.data[offset : offset + length])

    def open(self, path: str, flags: int) -> MemoryFileHandle:
        self._look("open", path)
        check_open_flags(flags, path)
        return MemoryFileHandle(self, self._file(path), path, flags)

    def open_dir(self, path: str) -> MemoryFileHandle:
        """:meth:`HostFS.open_dir`: a read-only handle on the directory inode at ``path``; not
        a directory, a final symlink included, ``ENOTDIR`` (as RealHostFS's ``openat2`` with
        ``O_DIRECTORY``, checked before the symlink would be refused), as :meth:`listdir`."""
        self._look("open", path)
        node = self._walk(path)
        if node.kind != DIR:
            raise _err(errno.ENOTDIR, path)
        return MemoryFileHandle(self, node, path, os.O_RDONLY)

    def readlink(self, path: str) -> str:
        self._look("readlink", path)
        node = self._entry(path)
        if node.kind != LNK:
            raise _err(errno.EINVAL, path)
        return node.target

    # -- mutations --

    def create(self, path: str, mode: int) -> None:
        self._fault("create", path)
        self._create_node(path, mode)

    def create_handle(self, path: str, mode: int, flags: int = os.O_WRONLY) -> MemoryFileHandle:
        self._fault("create", path)
        check_open_flags(flags, path)
        return MemoryFileHandle(self, self._create_node(path, mode), path, flags)

    def _create_node(self, path: str, mode: int) -> _Inode:
        parent, name, there = self._parent_child(path)
        if there is not None:
            raise _err(errno.EEXIST, path)
        self._charge_new(name, "", path)
        now = self._tick()
        node = parent.entries[name] = self._new_node(
            _Inode(next(self._inos), REG, mode & 0o7777, now, now, uid=self.uid, gid=self.gid), name)
        noted = self._meta_changed  # _note(node), inline
        if noted is not None:
            noted[node.ino] = node
        self._entries_changed(parent, now)
        self._keep_resolved(path, node)
        return node

    def write(self, path: str, offset: int, data: bytes) -> int:
        limit = self._fault("write", path, len(data))
        node = self._file(path)
        if offset < 0:
            raise _err(errno.EINVAL, path)
        return self._write_node(node, offset, data, limit, path)

    def _write_node(self, node: _Inode, offset: int, data: bytes | bytearray | memoryview, limit: Optional[int], path: str) -> int:
        """The write itself (path or handle): ``limit`` from the fault hook tears it."""
        n = len(data) if limit is None else max(0, min(limit, len(data)))
        if n:  # a zero-byte write changes nothing: no zero-fill, no timestamps
            if self._budget is not None and offset + n > len(node.data):
                self._charge(node, offset + n - len(node.data), path)
            if offset > len(node.data):
                node.data.extend(b"\0" * (offset - len(node.data)))
            node.data[offset : offset + n] = data[:n]
            now = self._tick()
            node.mtime_ns = node.ctime_ns = now
            noted = self._meta_changed  # _note(node), inline: the most frequent change
            if noted is not None:
                noted[node.ino] = node
            if self.record_losses:
                self._record_version(node)
        if limit is not None and n < len(data) and self.fault_hook is not None:
            after = getattr(self.fault_hook, "after_torn_write", None)
            if after is not None:
                after(self, path, n)
        return n

    def truncate(self, path: str, size: int) -> None:
        self._fault("truncate", path)
        node = self._file(path)
        if size < 0:
            raise _err(errno.EINVAL, path)
        self._truncate_node(node, size, path)

    def _truncate_node(self, node: _Inode, size: int, path: str = "") -> None:
        self._charge(node, size - len(node.data), path)
        if size < len(node.data):
            del node.data[size:]
        else:
            node.data.extend(b"\0" * (size - len(node.data)))
        now = self._tick()
        node.mtime_ns = node.ctime_ns = now
        self._note(node)
        if self.record_losses:
            self._record_version(node)

    def unlink(self, path: str) -> None:
        self._fault("unlink", path)
        parent, name, node = self._parent_child(path)
        if node is None:
            raise _err(errno.ENOENT, path)
        if node.kind == DIR:
            raise _err(errno.EISDIR, path)
        del parent.entries[name]
        if self._budget is not None:
            self._charge(None, -_name_bytes(name), path)
        self._resolved.pop(path, None)  # not a directory: no path led through it
        now = self._tick()
        node.nlink -= 1
        node.ctime_ns = now
        noted = self._meta_changed  # _note(node), inline
        if noted is not None:
            noted[node.ino] = node
        self._entries_changed(parent, now)

    def rmdir(self, path: str) -> None:
        self._fault("rmdir", path)
        parent, name, node = self._parent_child(path)
        if node is None:
            raise _err(errno.ENOENT, path)
        if node.kind != DIR:
            raise _err(errno.ENOTDIR, path)
        if node.entries:
            raise _err(errno.ENOTEMPTY, path)
        del parent.entries[name]
        if self._budget is not None:
            self._charge(None, -_name_bytes(name), path)
        self._resolved.pop(path, None)  # empty: no kept path leads through it
        node.nlink = 0
        parent.nlink -= 1
        self._entries_changed(parent, self._tick())

    def mkdir(self, path: str, mode: int) -> None:
        self._fault("mkdir", path)
        parent, name, there = self._parent_child(path)
        if there is not None:
            raise _err(errno.EEXIST, path)
        self._charge_new(name, "", path)
        now = self._tick()
        node = parent.entries[name] = self._new_node(
            _Inode(next(self._inos), DIR, mode & 0o7777, now, now, nlink=2, uid=self.uid, gid=self.gid), name)
        self._note(node)
        parent.nlink += 1
        self._entries_changed(parent, now)
        self._keep_resolved(path, node)

    def rename(self, src: str, dst: str) -> None:
        self._fault("rename", src)
        sparent, sname = self._parent(src)
        dparent, dname = self._parent(dst)
        node = self._child(sparent, sname, src)
        if node is None:
            raise _err(errno.ENOENT, src)
        if node.kind == DIR and (dst == src or dst.startswith(src + "/")):
            if dst == src:
                return
            raise _err(errno.EINVAL, dst)  # source is an ancestor of the target
        if src.startswith(dst + "/"):
            raise _err(errno.ENOTEMPTY, dst)  # target is an ancestor of the source
        existing = self._child(dparent, dname, dst)
        if existing is node:
            return  # same inode (or same path): POSIX says do nothing
        if existing is not None:
            if node.kind == DIR and existing.kind != DIR:
                raise _err(errno.ENOTDIR, dst)
            if node.kind != DIR and existing.kind == DIR:
                raise _err(errno.EISDIR, dst)
            if existing.kind == DIR and existing.entries:
                raise _err(errno.ENOTEMPTY, dst)
        if self._budget is not None:
            self._charge(None, _name_bytes(dname) - _name_bytes(sname) - (_name_bytes(dname) if existing else 0), dst)
        now = self._tick()
        if node.kind == DIR:
            self._resolved.clear()  # every kept path through src now leads elsewhere or nowhere
        else:
            self._resolved.pop(src, None)
            self._resolved.pop(dst, None)  # a replaced target is a file or an empty directory
        del sparent.entries[sname]
        if existing is not None:
            if existing.kind == DIR:
                existing.nlink = 0
                dparent.nlink -= 1
            else:
                existing.nlink -= 1
            existing.ctime_ns = now
            noted = self._meta_changed  # _note(existing), inline
            if noted is not None:
                noted[existing.ino] = existing
        if node.kind == DIR:
            sparent.nlink -= 1
            dparent.nlink += 1
        dparent.entries[dname] = node
        node.ctime_ns = now
        noted = self._meta_changed  # _note(node), inline
        if noted is not None:
            noted[node.ino] = node
        self._entries_changed(sparent, now)
        self._entries_changed(dparent, now)
        self._keep_resolved(dst, node)

    def exchange(self, a: str, b: str) -> None:
        self._fault("exchange", a)
        aparent, aname = self._parent(a)
        bparent, bname = self._parent(b)
        x = self._child(aparent, aname, a)
        y = self._child(bparent, bname, b)
        if x is None or y is None:
            raise _err(errno.ENOENT, a if x is None else b)
        if x is y:
            return  # one inode (or one path): nothing happens, as renameat2 does
        if is_within(b, a) or is_within(a, b):
            raise _err(errno.EINVAL, b)  # one inside the other
        now = self._tick()
        if x.kind == DIR or y.kind == DIR:
            self._resolved.clear()
        else:
            self._resolved.pop(a, None)
            self._resolved.pop(b, None)
        aparent.entries[aname], bparent.entries[bname] = y, x
        if aparent is not bparent and (x.kind == DIR) != (y.kind == DIR):
            step = 1 if x.kind == DIR else -1  # the directory's ".." moves from a's parent to b's
            aparent.nlink -= step
            bparent.nlink += step
        x.ctime_ns = y.ctime_ns = now
        self._note(x)
        self._note(y)
        self._entries_changed(aparent, now)
        self._entries_changed(bparent, now)

    def symlink(self, target: str, path: str) -> None:
        self._fault("symlink", path)
        # the kernel copies the target in before it looks at the new path
        if not target:
            raise _err(errno.ENOENT, path)
        if "\0" in target:
            raise _err(errno.EINVAL, path)
        if len(target.encode("utf-8", "surrogateescape")) > _SYMLINK_MAX:
            raise _err(errno.ENAMETOOLONG, path)
        parent, name, there = self._parent_child(path)
        if there is not None:
            raise _err(errno.EEXIST, path)
        self._charge_new(name, target, path)
        now = self._tick()
        node = parent.entries[name] = self._new_node(
            _Inode(next(self._inos), LNK, 0o777, now, now, target=target, uid=self.uid, gid=self.gid), name)
        self._note(node)
        self._entries_changed(parent, now)
        self._keep_resolved(path, node)

    def mknod(self, path: str, mode: int, fmt: int) -> None:
        """A fifo or a unix-socket node (:data:`~sandbox.hostfs.MKNOD_FMTS`), mode exact."""
        self._fault("mknod", path)
        if fmt not in MKNOD_FMTS:
            raise _err(errno.EPERM, path)
        self._mknod_node(path, mode, fmt)

    def link(self, existing: str, new: str) -> None:
        self._fault("link", new)
        sparent, sname = self._parent(existing)
        node = self._child(sparent, sname, existing)
        if node is None:
            raise _err(errno.ENOENT, existing)
        dparent, dname, there = self._parent_child(new)
        if there is not None:
            raise _err(errno.EEXIST, new)
        if node.kind == DIR:
            raise _err(errno.EPERM, existing)
        if self._budget is not None:
            self._charge(None, _name_bytes(dname), new)
        now = self._tick()
        dparent.entries[dname] = node
        node.nlink += 1
        node.ctime_ns = now
        self._note(node)
        self._entries_changed(dparent, now)
        self._keep_resolved(new, node)

    def chmod(self, path: str, mode: int) -> None:
        self._fault("chmod", path)
        node = self._walk(path)
        if node.kind == LNK:
            raise _err(errno.EOPNOTSUPP, path)
        self._chmod_node(node, mode)

    def _chmod_node(self, node: _Inode, mode: int) -> None:
        node.mode = mode & 0o7777
        node.ctime_ns = self._tick()
        self._note(node)

    def utime(self, path: str, mtime_ns: int, atime_ns: int | None = None) -> None:
        self._fault("utime", path)
        self._utime_node(self._entry(path), mtime_ns, atime_ns)

    def _utime_node(self, node: _Inode, mtime_ns: int, atime_ns: int | None) -> None:
        node.mtime_ns = mtime_ns
        if atime_ns is not None:
            node.atime_ns = atime_ns
        node.ctime_ns = self._tick()
        self._note(node)

    def lchown(self, path: str, uid: int, gid: int) -> None:
        self._fault("chown", path)
        self._chown_node(self._entry(path), uid, gid, path)

    def _chown_node(self, node: _Inode, uid: int, gid: int, path: str) -> None:
        """As Linux's ``chown_common``: only uid 0 gives a file away (an owner may only change the
        group to its own); a non-directory loses set-uid, and set-gid where group-executable,
        whoever changes it — even to the same ids."""
        if self.uid != 0 and (node.uid != self.uid or uid not in (-1, node.uid) or gid not in (-1, node.gid, self.gid)):
            raise _err(errno.EPERM, path)
        node.uid = node.uid if uid == -1 else uid
        node.gid = node.gid if gid == -1 else gid
        if node.kind != DIR:
            node.mode &= ~_stat.S_ISUID
            if node.mode & _stat.S_IXGRP:
                node.mode &= ~_stat.S_ISGID
        node.ctime_ns = self._tick()
        self._note(node)

    def _xattr_node(self, path: str, name: str, write: bool) -> _Inode:
        """The inode whose xattr ``name`` is read (``write`` False) or changed.

        The order of checks is RealHostFS's: the lookup, then symlinks (no xattrs at
        all), then the kernel's name checks, then its rule that ``user.`` names live
        only on regular files and directories.
        """
        return self._xattr_node_of(self._walk(path), name, write, path)

    def _xattr_node_of(self, node: _Inode, name: str, write: bool, path: str) -> _Inode:
        if node.kind == LNK and not name.startswith(("user.", "trusted.")):
            raise _err(errno.EPERM if write else errno.ENODATA, path)
        return self._xattr_checks(node, name, write, path)

    def _xattr_checks(self, node: _Inode, name: str, write: bool, path: str) -> _Inode:
        size = len(name.encode("utf-8", "surrogateescape"))
        if size == 0 or size > _XATTR_NAME_MAX:
            raise _err(errno.ERANGE, path)
        prefix = None
        for p in _XATTR_PREFIXES:
            if name.startswith(p):
                prefix = p
                break
        if prefix == "user." and node.kind not in (REG, DIR):
            raise _err(errno.EPERM if write else errno.ENODATA, path)
        if prefix == "trusted." and not self.trusted_xattrs:  # CAP_SYS_ADMIN only, on any kind
            raise _err(errno.EPERM if write else errno.ENODATA, path)
        if prefix is None:
            raise _err(errno.EOPNOTSUPP, path)
        if name == prefix:
            raise _err(errno.EINVAL, path)
        return node

    def listxattr(self, path: str) -> list[str]:
        self._look("listxattr", path)
        return self._listed(self._walk(path))

    def _listed(self, node: _Inode) -> list[str]:
        """The names ``listxattr`` shows: ``trusted.*`` only to a privileged server."""
        return [n for n in node.xattrs if self.trusted_xattrs or not n.startswith("trusted.")]

    def getxattr(self, path: str, name: str) -> bytes:
        self._look("getxattr", path)
        return self._getxattr_node(self._xattr_node(path, name, write=False), name, path)

    def _getxattr_node(self, node: _Inode, name: str, path: str) -> bytes:
        self._xattr_checks(node, name, False, path)
        if name not in node.xattrs:
            raise _err(errno.ENODATA, path)
        return node.xattrs[name]

    def setxattr(self, path: str, name: str, value: bytes) -> None:
        self._fault("setxattr", path, len(value))
        self._setxattr_node(self._xattr_node(path, name, write=True), name, value, path)

    def _setxattr_node(self, node: _Inode, name: str, value: bytes, path: str) -> None:
        self._xattr_checks(node, name, True, path)
        if len(value) > 65536:
            raise _err(errno.E2BIG, path)
        old = node.xattrs.get(name)
        self._charge(node, len(value) - (len(old) if old is not None else -len(name)), path)
        node.xattrs[name] = bytes(value)
        node.ctime_ns = self._tick()
        self._note(node)

    def removexattr(self, path: str, name: str) -> None:
        self._fault("removexattr", path)
        self._removexattr_node(self._xattr_node(path, name, write=True), name, path)

    def _removexattr_node(self, node: _Inode, name: str, path: str) -> None:
        self._xattr_checks(node, name, True, path)
        if name not in node.xattrs:
            raise _err(errno.ENODATA, path)
        self._charge(node, -len(name) - len(node.xattrs[name]), path)
        del node.xattrs[name]
        node.ctime_ns = self._tick()
        self._note(node)

    def fallocate(self, path: str, offset: int, length: int, mode: int = 0) -> None:
        """Modes 0, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE and ZERO_RANGE[|KEEP_SIZE].

        As on ext4, every successful call sets mtime and ctime, even one that changes
        no byte (preallocation inside the file, or beyond it with KEEP_SIZE).
        """
        self._fault("fallocate", path, length)
        self._fallocate_node(self._file(path), offset, length, mode, path)

    def _fallocate_node(self, node: _Inode, offset: int, length: int, mode: int, path: str) -> None:
        if offset < 0 or length <= 0:
            raise _err(errno.EINVAL, path)
        kind = mode & ~_FALLOC_FL_KEEP_SIZE
        if kind not in (0, _FALLOC_FL_PUNCH_HOLE, _FALLOC_FL_ZERO_RANGE):
            raise _err(errno.EOPNOTSUPP, path)
        if kind == _FALLOC_FL_PUNCH_HOLE and not mode & _FALLOC_FL_KEEP_SIZE:
            raise _err(errno.EOPNOTSUPP, path)
        end = offset + length
        if mode & (_FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_ZERO_RANGE):
            stop = min(end, len(node.data))
            if offset < stop:
                node.data[offset:stop] = b"\0" * (stop - offset)
        if not mode & _FALLOC_FL_KEEP_SIZE and end > len(node.data):
            self._charge(node, end - len(node.data), path)
            node.data.extend(b"\0" * (end - len(node.data)))
        now = self._tick()
        node.mtime_ns = node.ctime_ns = now
        self._note(node)
        if self.record_losses:
            self._record_version(node)

    def copy_file_range(self, src: str, dst: str, src_offset: int, dst_offset: int, length: int) -> int:
        self._fault("copy_file_range", dst, length)
        return self._copy_nodes(self._file(src), self._file(dst), src_offset, dst_offset, length, dst)

    def _copy_nodes(self, s: _Inode, d: _Inode, src_offset: int, dst_offset: int, length: int, path: str) -> int:
        if length < 0:
            raise _err(errno.EINVAL, path)
        if src_offset < 0 or dst_offset < 0:
            raise _err(errno.EOVERFLOW, path)
        chunk = bytes(s.data[src_offset : src_offset + length])
        if s is d and dst_offset + len(chunk) > src_offset and dst_offset < src_offset + len(chunk):
            raise _err(errno.EINVAL, path)  # overlapping ranges of one file
        if not chunk:
            return 0
        if dst_offset + len(chunk) > len(d.data):
            self._charge(d, dst_offset + len(chunk) - len(d.data), path)
        if dst_offset > len(d.data):
            d.data.extend(b"\0" * (dst_offset - len(d.data)))
        d.data[dst_offset : dst_offset + len(chunk)] = chunk
        now = self._tick()
        d.mtime_ns = d.ctime_ns = now
        self._note(d)
        if self.record_losses:
            self._record_version(d)
        return len(chunk)

    def fsync(self, path: str) -> None:
        """This inode's bytes become durable, and so does all metadata so far (one journal)."""
        self._fault("fsync", path)
        self._fsync_node(self._walk(path))

    def _fsync_node(self, node: _Inode) -> None:
        # the journal commit of all metadata so far is *deferred* to the next call that may
        # change something (``_fault`` of an op not in _READ_ONLY_OPS, ``make_special``,
        # ``power_loss``): nothing changes in between, so the committed state is the same,
        # and fsyncs in a row (a file then its directory) commit once
        self._commit_pending = True
        node.durable_data = bytes(node.data)
        if self.record_losses:
            self._unsynced.pop(node.ino, None)

    # -- power loss (simulation control, not part of HostFS) --
    #
    # The model is a journaling filesystem (ext4 data=ordered, xfs): metadata — directory
    # entries, modes, times, xattrs, symlink targets — is journaled and committed in order,
    # so a rename is atomic and any fsync commits every earlier metadata change; file *data*
    # survives only its own file's fsync. Power loss keeps the last committed metadata, and
    # per file the last fsynced bytes (none if never fsynced).
    #
    # With ``record_losses`` on, the states in between exist too: every change of an inode's
    # bytes (write, truncate, fallocate, copy_file_range, the lock's pid) since its last
    # durability point (fsync, fdatasync, sync_all, a power loss) is recorded as a version,
    # and ``power_loss(keep={ino: p})`` keeps that inode's first ``p`` versions — a prefix of
    # its own write order (the kernel's writeback reached it at some moment), chosen per
    # inode independently (writeback orders no two files). Not modelled: one file's changes
    # reaching the disk out of order, or one write in part (torn writes are the process
    # crash's fault), and metadata between the last commit and now (it is all lost, as before).

    def _reachable(self) -> list[_Inode]:
        seen: dict[int, _Inode] = {}
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.ino not in seen:
                seen[node.ino] = node
                stack.extend(node.entries.values())
        return list(seen.values())

    def _record_version(self, node: _Inode) -> None:
        """``record_losses``: ``node``'s bytes changed — a new version, unless they are
        the bytes of its newest one (or of its last fsync): no new state."""
        entry = self._unsynced.get(node.ino)
        if entry is None:
            if node.data != (node.durable_data or b""):
                self._unsynced[node.ino] = (node, [bytes(node.data)])
            return
        versions = entry[1]
        if node.data == versions[-1]:
            return
        if len(versions) >= UNSYNCED_VERSIONS_MAX:
            versions[-1] = bytes(node.data)
            self.unsynced_versions_dropped += 1
        else:
            versions.append(bytes(node.data))

    def _durable_reachable(self) -> set[int]:
        """The inodes a power loss now leaves reachable (its tree: the committed entries)."""
        if self._commit_pending:
            self._commit_metadata()
        seen: set[int] = set()
        root = self._root
        stack = [node for node in (root.durable_meta[4] if root.durable_meta is not None else {}).values()]
        seen.add(root.ino)
        while stack:
            node = stack.pop()
            if node.ino not in seen:
                seen.add(node.ino)
                stack.extend((node.durable_meta[4] if node.durable_meta is not None else node.entries).values())
        return seen

    def loss_choices(self) -> dict[int, int]:
        """``{ino: n}``: each inode a power loss now would leave reachable with ``n`` > 0
        un-fsynced data versions recorded — ``power_loss(keep={ino: p})`` for ``p`` in
        ``0..n``. Empty unless ``record_losses`` is on."""
        if not self._unsynced:
            return {}
        reachable = self._durable_reachable()
        return {ino: len(versions) for ino, (_, versions) in sorted(self._unsynced.items()) if ino in reachable}

    def _commit_metadata(self) -> None:
        """The journal commit: the metadata of every reachable inode as it is now becomes what a
        power loss goes back to. Only the inodes noted in ``_meta_changed`` since the last
        commit are copied: every other reachable inode was reachable and unchanged at that
        commit (an inode becomes reachable only as a new inode, or moved — both noted — or by a
        power loss, which notes only what was never committed), so its commit stands. A noted inode that
        is no longer reachable is copied too: it is in no committed directory now (the
        directory it left is noted and copied), so no power loss can bring it back.
        With nothing noted (``_meta_changed`` None: the first commit, notes dropped at
        ``META_CHANGED_KEPT_MAX``) or ``commit_whole``, every reachable inode is copied."""
        self._commit_pending = False
        noted = self._meta_changed
        if noted is None or self.commit_whole:
            for node in self._reachable():
                node.durable_meta = node.meta()
        else:
            for node in noted.values():
                node.durable_meta = node.meta()
        self._meta_changed = {}

    def sync_all(self) -> None:
        """Everything now on the disk is durable (a tree that has been there for a while)."""
        self._commit_pending = False
        for node in self._reachable():
            node.durable_meta = node.meta()
            node.durable_data = bytes(node.data)
        self._meta_changed = {}
        self._unsynced.clear()

    def power_loss(self, keep: dict[int, int] | None = None) -> None:
        """The machine lost power: back to the last committed metadata and fsynced data.

        ``keep`` (needs ``record_losses``): ``{ino: p}`` — that inode keeps the data of its
        first ``p`` un-fsynced versions (:meth:`loss_choices`); checked before anything is
        lost (``ValueError``). What survived is then durable."""
        kept: dict[int, bytes] = {}
        for ino, p in (keep or {}).items():
            if not self.record_losses:
                raise ValueError("power_loss(keep=...) needs record_losses on")
            if ino not in self._unsynced:
                raise ValueError(f"inode {ino} has no un-fsynced data versions")
            versions = self._unsynced[ino][1]
            if not 0 <= p <= len(versions):
                raise ValueError(f"inode {ino} has {len(versions)} un-fsynced data versions; cannot keep {p}")
            if p:
                kept[ino] = versions[p - 1]
        if self._commit_pending:
            self._commit_metadata()
        self._resolved.clear()
        self.changes += 1
        self.names += 1  # entries go back to the last commit
        self.power_losses += 1
        if self._root.durable_meta is None:
            self._root.entries, self._root.xattrs = {}, {}
        revert_stack, seen = [self._root], set()
        never_committed: dict[int, _Inode] = {}  # the root, if nothing was ever committed
        while revert_stack:
            node = revert_stack.pop()
            if node.ino in seen:
                continue
            seen.add(node.ino)
            if node.durable_meta is not None:
                (node.mode, node.mtime_ns, node.ctime_ns, node.target, entries, xattrs, node.nlink, node.atime_ns,
                 node.uid, node.gid) = node.durable_meta
                node.entries, node.xattrs = dict(entries), dict(xattrs)
            else:
                never_committed[node.ino] = node
            if node.ino in kept:
                node.durable_data = kept[node.ino]
            node.data = bytearray(node.durable_data or b"")
            revert_stack.extend(node.entries.values())
        self._meta_changed = never_committed  # every other reachable inode is as committed now
        self._unsynced.clear()
        self._locks.clear()
        self._epoch += 1  # the process died with the machine: its handles are gone

    def lock(self, path: str) -> _SimLock:
        """Lock the regular file ``path`` (created 0600 if missing) and write the pid in it.

        Like RealHostFS: the root is ``EBUSY``, a symlink ``ELOOP``, a directory
        ``EISDIR``, a special file ``EPERM`` (never opened); a lock held by anyone —
        including this process through another handle — is :class:`StoreBusy`.
        """
        self._fault("lock", path)
        parent, name = self._parent(path)
        if self._child(parent, name, path) is None:
            self.create(path, 0o600)
        node = self._file(path)
        holder = self._locks.get(path)
        if holder is not None:
            raise StoreBusy(f"<{self.name}>/{parent_of(path)}", holder[0])
        lock = _SimLock(self, path)
        self._locks[path] = (self.pid, lock)
        node.data[:] = f"{self.pid}\n".encode()
        node.mtime_ns = node.ctime_ns = self._tick()
        self._note(node)
        if self.record_losses:
            self._record_version(node)
        return lock


class ReflinkMemoryHostFS(MemoryHostFS):
    """A simulated disk that can clone files to another one (what FICLONE does on XFS or
    btrfs): the clone holds the same bytes, so the undo store keeps large preimages raw."""

    def clone_to(self, path: str, dst_fs: HostFS, dst_path: str) -> None:
        if not isinstance(dst_fs, ReflinkMemoryHostFS):
            raise OSError(errno.EOPNOTSUPP, "reflink needs two simulated reflink disks")
        self._fault("clone_to", path)
        data = self.read_all(path)
        dst_fs.create(dst_path, 0o600)
        dst_fs.write_all(dst_path, 0, data)
