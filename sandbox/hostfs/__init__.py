"""The narrow host-filesystem interface: every host syscall the core makes goes through it.

Two implementations share one contract:

* :class:`~sandbox.hostfs.real.RealHostFS` — a directory on the real host, every call
  resolved relative to a directory file descriptor with ``openat2(RESOLVE_BENEATH |
  RESOLVE_NO_SYMLINKS)``: nothing outside the root is ever reached, no symlink is ever
  followed (a symlink in the middle of a path is ``ELOOP``; a symlink as the final
  component is operated on itself, never its target).
* :class:`~sandbox.hostfs.memory.MemoryHostFS` — an in-memory tree with the same semantics and
  the same errnos, and a fault hook called before every operation.

Paths are ``str`` relative to the root, ``/``-separated, already normalised by
:func:`normalize` (``""`` is the root itself). Errors are :class:`OSError` with a Linux
errno; callers map them, never parse messages.

Invariants both implementations keep (the parity suite in ``sandbox_sim/test_hostfs.py`` runs
against both):

* ``create``/``mkdir`` apply the given mode exactly (no umask): the guest already applied
  its own.
* only regular files, directories, symlinks and — through :meth:`HostFS.mknod` only —
  fifos and unix-socket nodes are created (never a device); a special file is never
  opened (``read``/``write`` on it fail with ``EPERM``).
* ``chmod`` of a symlink is ``EOPNOTSUPP`` (Linux has no lchmod); symlinks, fifos and
  sockets carry no user xattrs (``setxattr`` of ``user.*`` is ``EPERM``); the xattrs of a
  symlink are its own, never its target's. ``trusted.*`` xattrs are kept on every kind of
  entry for a server with ``CAP_SYS_ADMIN`` (root), and refused (``EPERM``, never listed)
  without it.
* :meth:`HostFS.open` returns a :class:`FileHandle` bound to the *inode*, not the path:
  after a rename or an unlink the handle still reads, writes, truncates, chmods, sets the
  times and the xattrs of that same file (the open-then-unlink pattern works), never of
  whatever the path names now. ``open`` never creates or truncates (``O_CREAT``,
  ``O_TRUNC``, … are ``EINVAL``): those go through ``create``/``truncate`` so that the
  undo hooks see them. A closed handle answers every call with ``EBADF``.
* :meth:`HostFS.create_handle` creates like ``create`` and returns a handle on the new
  inode: what follows a creation (content, mode, times, xattrs) goes through that handle
  and never looks the name up again — someone else may have replaced it meanwhile.
* :class:`Attr` (``getattr``) is the full ``lstat`` of an entry, for protocol replies —
  the exact file type (``fmt``: a fifo is a fifo), owners, blocks, all three times.
  :class:`Stat` (``lstat``) stays the smaller record the undo core compares.
* :class:`StatFS` (``statfs``) describes the filesystem holding the root.
"""

from __future__ import annotations

import errno
import os
import stat as _stat
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from ..frozen import fast_init
from ..limits import DIR_ENTRY_OVERHEAD_BYTES

__all__ = [
    "HostFS",
    "FileHandle",
    "Stat",
    "Attr",
    "StatFS",
    "Lock",
    "PathError",
    "StoreBusy",
    "ListingTooLarge",
    "bounded_names",
    "has_entries",
    "normalize",
    "join",
    "parent_of",
    "REG",
    "DIR",
    "LNK",
    "OTHER",
    "PATH_LEN_MAX",
    "NAME_LEN_MAX",
    "TREE_PATH_BYTES_MAX",
    "OPEN_FLAGS",
    "check_open_flags",
    "same_inode",
    "names_inode",
    "ABSENT_ERRNOS",
    "MKNOD_FMTS",
]

REG = "reg"
DIR = "dir"
LNK = "lnk"
OTHER = "other"  # fifo, socket, device: never created, never opened

PATH_LEN_MAX = 4096  # the kernel's PATH_MAX (with the NUL): one syscall's path, a symlink target, a guest path
NAME_LEN_MAX = 255  # NAME_MAX: one component, in bytes
#: the longest path *relative to the tree's root* that a HostFS resolves (bytes, UTF-8 with
#: surrogateescape). A guest builds trees deeper than PATH_MAX with relative paths (every
#: syscall it made was legal), so this is well above PATH_MAX; RealHostFS resolves a longer
#: path in pieces (see :mod:`sandbox.hostfs.real`). Beyond it: ``ENAMETOOLONG``.
TREE_PATH_BYTES_MAX = 8 * PATH_LEN_MAX

#: errnos of a lookup that mean "nothing is at this path": it is missing (``ENOENT``), a
#: non-directory is on the way (``ENOTDIR``), or a symlink is on the way (``ELOOP``: never
#: followed, so whatever lies behind it is not *at* this path — after ``rm -rf d && ln -s
#: t d``, ``d/f`` does not exist, whatever ``t`` holds). Only for lookups (``lstat``,
#: ``getattr``, ``exists``): a final symlink given to ``read``/``open`` is also ``ELOOP``
#: and means "is a symlink", not "absent".
ABSENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})

#: the only ``open`` flags: an access mode, optionally ``O_APPEND``
OPEN_FLAGS = os.O_ACCMODE | os.O_APPEND

#: the only file types :meth:`HostFS.mknod` makes: a fifo and a unix-socket node (never a device)
MKNOD_FMTS = frozenset({_stat.S_IFIFO, _stat.S_IFSOCK})
#: lseek(2) whences for the next data / the next hole (Linux values)
SEEK_DATA, SEEK_HOLE = 3, 4
#: fallocate(2) modes every implementation serves: 0, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE,
#: ZERO_RANGE[|KEEP_SIZE]; any other (COLLAPSE_RANGE, INSERT_RANGE, UNSHARE_RANGE, …) is EOPNOTSUPP
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10
FALLOCATE_MODES = frozenset({0, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                             FALLOC_FL_ZERO_RANGE, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE})

_FMT_OF_KIND = {REG: _stat.S_IFREG, DIR: _stat.S_IFDIR, LNK: _stat.S_IFLNK, OTHER: _stat.S_IFIFO}


class PathError(OSError):
    """A path argument that can never name something inside the root.

    Raised for absolute paths, ``..`` components, NUL bytes and over-long paths
    (errno ``EINVAL``/``ENAMETOOLONG``), before anything on the host is touched.
    """


class StoreBusy(OSError):
    """The undo store is locked by another live process (errno ``EWOULDBLOCK``)."""

    def __init__(self, path: str, pid: int | None):
        self.pid = pid
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(errno.EWOULDBLOCK, f"undo store {path} is in use by {holder}")

    def __str__(self) -> str:
        return str(self.strerror)


class ListingTooLarge(OSError):
    """A bounded :meth:`HostFS.listdir` (``limit_bytes``) met a name that would pass its bound
    (errno ``ENOMEM``): the read stopped there. ``names`` are those read before it, in the
    directory's order (their :func:`~sandbox.limits.listing_cost` is within the bound) — a
    caller that can answer with a part of the directory (the API's ``list``) uses them."""

    def __init__(self, path: str, limit_bytes: int, names: list[str]):
        super().__init__(errno.ENOMEM, f"directory listing over {limit_bytes} bytes", path)
        self.limit_bytes = limit_bytes
        self.names = names


def bounded_names(names: Iterable[str], limit_bytes: int | None, path: str) -> list[str]:
    """The names ``names`` yields, read one at a time and counted as
    :func:`~sandbox.limits.listing_cost` counts them; the first that would pass
    ``limit_bytes`` stops the read (:class:`ListingTooLarge`): what is held never exceeds the
    bound, however large the directory. ``limit_bytes`` None: all of them."""
    if limit_bytes is None:
        return list(names)
    out: list[str] = []
    cost = 0
    for name in names:
        cost += len(name) + DIR_ENTRY_OVERHEAD_BYTES
        if cost > limit_bytes:
            raise ListingTooLarge(path, limit_bytes, out)
        out.append(name)
    return out


def has_entries(fs: "HostFS", path: str) -> bool:
    """Does the directory ``path`` hold any entry? One name read answers, however many it
    holds (a :meth:`HostFS.listdir` bounded at 0 bytes: its first name passes the bound)."""
    try:
        fs.listdir(path, limit_bytes=0)
    except ListingTooLarge:
        return True
    return False


#: paths :func:`normalize` remembers (it is a pure function of the string); all forgotten
#: when this many are kept. Errors are never remembered.
NORMALIZED_KEPT_MAX = 4096
_normalized: dict[str, str] = {}


def normalize(path: str) -> str:
    """Return the canonical relative form of ``path`` or raise :class:`PathError`.

    ``"a//b/./c/"`` → ``"a/b/c"``; ``"."`` and ``""`` → ``""`` (the root).
    ``..`` is refused outright rather than resolved: resolving it lexically would be
    wrong across symlinks, and the guest kernel never sends it to a server.
    """
    if type(path) is str:
        done = _normalized.get(path)
        if done is not None:
            return done
    out = _normalize(path)
    if len(_normalized) >= NORMALIZED_KEPT_MAX:
        _normalized.clear()
    _normalized[path] = out
    return out


def _normalize(path: str) -> str:
    if not isinstance(path, str):
        raise PathError(errno.EINVAL, f"path must be str, not {type(path).__name__}")
    if path.isascii() and len(path) <= NAME_LEN_MAX and "\0" not in path:
        # already canonical (a server's ``parent/name``): no empty, ``.`` or ``..`` component,
        # hence no leading or trailing ``/``; ASCII, so characters are bytes and no component
        # can be longer than NAME_LEN_MAX bytes — exactly what the loop below returns unchanged
        parts = path.split("/")
        if "" not in parts and "." not in parts and ".." not in parts:
            return path
    if "\0" in path:
        raise PathError(errno.EINVAL, f"path contains a NUL byte: {path!r}")
    if path.startswith("/"):
        raise PathError(errno.EINVAL, f"path must be relative to the working root: {path!r}")
    if len(path.encode("utf-8", "surrogateescape")) > TREE_PATH_BYTES_MAX:
        raise PathError(errno.ENAMETOOLONG, f"path longer than {TREE_PATH_BYTES_MAX} bytes (TREE_PATH_BYTES_MAX)")
    parts = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise PathError(errno.EINVAL, f"path escapes the working root via '..': {path!r}")
        if len(part.encode("utf-8", "surrogateescape")) > NAME_LEN_MAX:
            raise PathError(errno.ENAMETOOLONG, f"path component longer than {NAME_LEN_MAX} bytes")
        parts.append(part)
    return "/".join(parts)


def join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def parent_of(path: str) -> str:
    """Parent of a normalised path (the root's parent is the root)."""
    i = path.rfind("/")
    return path[:i] if i >= 0 else ""


def is_within(path: str, prefix: str) -> bool:
    """True if ``path`` is ``prefix`` or below it (both normalised)."""
    return prefix == "" or path == prefix or path.startswith(prefix + "/")


_set_fields = object.__setattr__  # a frozen dataclass's own __setattr__ refuses every name


@dataclass(frozen=True, init=False)
class Stat:
    """What the core needs to know about one directory entry (never follows symlinks).

    Frozen (assigning a field raises ``FrozenInstanceError``), compared and hashed by its
    fields. Its ``__init__`` sets its ``__dict__`` to one dict of the fields instead of the
    frozen dataclass's one ``object.__setattr__`` per field: every lstat builds one."""

    kind: str  # REG | DIR | LNK | OTHER
    mode: int  # all 12 permission bits (S_IMODE)
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    nlink: int
    dev: int = 0  # st_dev (0 on the simulator: one device); (ino, dev) names an inode
    fmt: int = 0  # the exact S_IFMT bits (a fifo vs a socket, both OTHER); 0: not known (the kind's usual one)
    uid: int = 0  # the host owner
    gid: int = 0

    def __init__(self, kind: str, mode: int, size: int, mtime_ns: int, ctime_ns: int, ino: int, nlink: int,
                 dev: int = 0, fmt: int = 0, uid: int = 0, gid: int = 0):
        _set_fields(self, "__dict__", {"kind": kind, "mode": mode, "size": size, "mtime_ns": mtime_ns, "ctime_ns": ctime_ns,
                                       "ino": ino, "nlink": nlink, "dev": dev, "fmt": fmt, "uid": uid, "gid": gid})

    @classmethod
    def from_os(cls, st) -> "Stat":
        mode = st.st_mode
        fmt = mode & _S_IFMT  # _stat.S_IFMT / S_IMODE, without their calls: one or more per request
        return cls(_KIND_OF_FMT.get(fmt, OTHER), mode & 0o7777, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                   st.st_nlink, st.st_dev, fmt, st.st_uid, st.st_gid)

    @property
    def file_type(self) -> int:
        """The ``S_IFMT`` bits: :attr:`fmt`, or the kind's usual one when it is not known."""
        return self.fmt or _FMT_OF_KIND[self.kind]


_KIND_OF_FMT = {_stat.S_IFREG: REG, _stat.S_IFDIR: DIR, _stat.S_IFLNK: LNK}  # any other format: OTHER
_S_IFMT = 0o170000


def _kind_of(fmt: int) -> str:
    return _KIND_OF_FMT.get(fmt, OTHER)


@fast_init  # one or more per request of every protocol server
@dataclass(frozen=True, slots=True)
class Attr:
    """Everything ``getattr`` reports about one entry (never follows a final symlink).

    ``kind`` is :class:`Stat`'s coarse type; ``fmt`` the exact ``S_IFMT`` bits (``S_IFIFO``,
    ``S_IFSOCK``, ``S_IFCHR``, … for an ``OTHER``), so ``fmt | mode`` is an ``st_mode``.
    ``blocks`` counts 512-byte units, as ``st_blocks`` does.
    """

    kind: str  # REG | DIR | LNK | OTHER
    fmt: int  # S_IFMT(st_mode)
    mode: int  # all 12 permission bits (S_IMODE)
    size: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    blksize: int
    blocks: int  # 512-byte units
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int = 0  # st_dev (0 on the simulator: one device); (ino, dev) names an inode

    @property
    def st_mode(self) -> int:
        return self.fmt | self.mode

    @classmethod
    def from_os(cls, st) -> "Attr":
        mode = st.st_mode
        fmt = mode & _S_IFMT
        return cls(_KIND_OF_FMT.get(fmt, OTHER), fmt, mode & 0o7777, st.st_size, st.st_nlink, st.st_uid, st.st_gid,
                   st.st_rdev, st.st_blksize, st.st_blocks, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                   st.st_dev)

    @classmethod
    def from_stat(cls, st: Stat) -> "Attr":
        """What a :class:`Stat` alone says: owner root, atime = mtime, 4 KiB blocks, no rdev.

        ``blocks`` is ``ceil(size / 512)``; an ``OTHER`` of unknown ``fmt`` is reported as a fifo.
        """
        return cls(st.kind, st.file_type, st.mode, st.size, st.nlink, 0, 0, 0, 4096, -(-st.size // 512),
                   st.mtime_ns, st.mtime_ns, st.ctime_ns, st.ino, st.dev)


@dataclass(frozen=True, slots=True)
class StatFS:
    """The filesystem holding the root (``statfs``); ``blocks``/``bfree``/``bavail`` are
    counted in ``bsize`` units, ``files``/``ffree`` in inodes."""

    bsize: int
    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    fsid: int
    namelen: int


#: what ``HostFS.statfs`` reports when an implementation knows no better: 16 GiB, half free
SYNTHETIC_STATFS = StatFS(bsize=4096, blocks=1 << 22, bfree=1 << 21, bavail=1 << 21, files=1 << 20, ffree=1 << 19,
                          fsid=0x5A4D_4653, namelen=NAME_LEN_MAX)


def check_open_flags(flags: int, path: str) -> None:
    """``EINVAL`` unless ``flags`` is ``O_RDONLY``/``O_WRONLY``/``O_RDWR``, optionally ``| O_APPEND``."""
    if not isinstance(flags, int) or flags & ~OPEN_FLAGS or flags & os.O_ACCMODE == os.O_ACCMODE:
        raise OSError(errno.EINVAL, f"open flags {flags:#o} are not an access mode [| O_APPEND]"
                      if isinstance(flags, int) else f"open flags must be int, not {type(flags).__name__}", path)


class FileHandle(ABC):
    """An open regular file: the server keeps it between open and close.

    Invariants both implementations keep:

    * the handle is bound to the inode opened, not to its path: after a rename or an
      unlink of the path, every call still acts on that same file (which, unlinked,
      lives on until the handle is closed);
    * access follows ``flags`` as the kernel enforces it: reading a write-only handle or
      writing a read-only one is ``EBADF``, truncating a read-only one ``EINVAL``; with
      ``O_APPEND`` every ``pwrite`` appends whatever the offset (Linux's pwrite);
    * negative offsets, lengths and sizes are ``EINVAL``;
    * the metadata calls (``chmod``, ``utime``, the xattr calls) are ``fchmod``,
      ``futimens``, ``f*xattr``: they need no access mode (a read-only handle may chmod),
      only the permissions the path-based calls need, and follow the same rules and errnos
      as :meth:`HostFS.chmod` etc. on a regular file;
    * ``close`` is idempotent; every other call on a closed handle is ``EBADF`` (and never
      reaches a file descriptor number that may since have been reused).
    """

    #: the path at open time, for diagnostics only (the file may since have moved)
    path: str
    #: the flags given to :meth:`HostFS.open`
    flags: int

    @abstractmethod
    def pread(self, length: int, offset: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (fewer at EOF, ``b""`` past it)."""

    @abstractmethod
    def pwrite(self, data: bytes | bytearray | memoryview, offset: int) -> int:
        """Write at ``offset`` (at EOF with ``O_APPEND``); may write fewer bytes (callers loop).
        ``data`` may be a view (:meth:`InterceptedFS.pwrite` passes a FUSE write's as it is)."""

    @abstractmethod
    def truncate(self, size: int) -> None: ...

    @abstractmethod
    def fsync(self, datasync: bool = False) -> None:
        """``fsync`` (``fdatasync`` when ``datasync``: the bytes, not every timestamp)."""

    @abstractmethod
    def fstat(self) -> Attr: ...

    @abstractmethod
    def chmod(self, mode: int) -> None:
        """``fchmod``: all 12 permission bits of ``mode``, exactly."""

    @abstractmethod
    def utime(self, mtime_ns: int, atime_ns: int | None = None) -> None:
        """``futimens``: mtime (and atime, unless ``None``: kept as it is) in ns."""

    @abstractmethod
    def chown(self, uid: int, gid: int) -> None:
        """``fchown``: ``-1`` leaves that id as it is; ``EPERM`` where the process may not."""

    @abstractmethod
    def listxattr(self) -> list[str]: ...

    @abstractmethod
    def getxattr(self, name: str) -> bytes: ...

    @abstractmethod
    def setxattr(self, name: str, value: bytes) -> None: ...

    @abstractmethod
    def removexattr(self, name: str) -> None: ...

    def xattrs(self) -> dict[str, bytes]:
        names = self.listxattr()  # most files have none: no sort, no comprehension then
        return {name: self.getxattr(name) for name in sorted(names)} if names else {}

    def fstat_xattr_names(self) -> tuple[Attr, list[str]]:
        """:meth:`fstat` and :meth:`listxattr` of this handle's inode in one call (a GETATTR
        through a kept descriptor); names it cannot list (no xattrs here, ``EOPNOTSUPP``) are
        none. A failing ``fstat`` raises, as :meth:`fstat` does."""
        a = self.fstat()
        try:
            return a, self.listxattr()
        except OSError:
            return a, []

    def getattr_at(self, name: str) -> Attr:
        """For a directory's handle: :meth:`HostFS.getattr` of its entry ``name``, found as
        :meth:`getattr_xattr_names_at` finds it (a final symlink's own attributes), without
        the xattr names. Here: ``EOPNOTSUPP``."""
        raise OSError(errno.EOPNOTSUPP, "no entries read through this handle", self.path)

    def getattr_xattr_names_at(self, name: str) -> tuple[Attr, list[str]]:
        """For a directory's handle (:meth:`HostFS.open_dir`): :meth:`HostFS.getattr_xattr_names`
        of its entry ``name`` — looked up in this directory's inode wherever its path now is,
        a final symlink never followed (its own attributes and xattr names). ``name`` is one
        component (empty, ``.``, ``..`` or a ``/`` in it: ``EINVAL``); a missing one ``ENOENT``,
        a handle on no directory ``ENOTDIR``. Every implementation of ``open_dir`` defines it;
        here (a handle kind that cannot): ``EOPNOTSUPP``."""
        raise OSError(errno.EOPNOTSUPP, "no entries read through this handle", self.path)

    def listdir(self, *, limit_bytes: int | None = None) -> list[str]:
        """For a directory's handle: :meth:`HostFS.listdir` of its inode, wherever its path now
        is (one caller at a time: the listing rewinds the descriptor), read only up to
        ``limit_bytes`` as there. Here: ``EOPNOTSUPP``."""
        raise OSError(errno.EOPNOTSUPP, "no entries read through this handle", self.path)

    def getxattr_at(self, name: str, xattr: str) -> bytes:
        """For a directory's handle: :meth:`HostFS.getxattr` of its entry ``name`` (as
        :meth:`getattr_xattr_names_at` finds it: a symlink's own). Here: ``EOPNOTSUPP``."""
        raise OSError(errno.EOPNOTSUPP, "no entries read through this handle", self.path)

    def is_inode_of(self, st: "Stat | Attr") -> bool:
        """Is this handle's file the inode ``st`` describes (:func:`same_inode`: inode number
        and device)? An open descriptor's inode never changes, so an implementation may answer
        from its first ``fstat`` (:class:`~sandbox.hostfs.real.RealFileHandle`); this body
        asks :meth:`fstat` each time."""
        return same_inode(st, self.fstat())

    def read_own(self, length: int, offset: int) -> bytes:
        """A read by the server itself (a preimage), of this handle's inode, whatever its access
        mode: as :meth:`HostFS.read` of a path, it never moves an atime a client set. The
        default is :meth:`pread` (for an implementation that keeps no atime)."""
        return self.pread(length, offset)

    def pwrite_all(self, data: bytes, offset: int) -> None:
        """Write every byte of ``data`` at ``offset`` (loops over short writes)."""
        view = memoryview(data)
        done = 0
        while done < len(view):
            n = self.pwrite(bytes(view[done : done + (1 << 20)]), offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"write made no progress on {self.path!r}")
            done += n

    def fallocate(self, offset: int, length: int, mode: int = 0) -> None:
        """``fallocate(2)`` on the open file, with :meth:`HostFS.fallocate`'s modes, rules and
        errnos; ``EBADF`` unless open for writing. Here (a handle kind that cannot): ``EOPNOTSUPP``."""
        raise OSError(errno.EOPNOTSUPP, "fallocate is not supported on this handle", self.path)

    def copy_range_to(self, dst: "FileHandle", src_offset: int, dst_offset: int, length: int) -> int:
        """``copy_file_range(2)`` from this handle to ``dst`` (a handle of the same filesystem):
        up to ``length`` bytes, clamped to this file's end; the count copied. ``EBADF`` unless
        this one is readable and ``dst`` writable without ``O_APPEND``; overlapping ranges of
        one inode ``EINVAL``; a negative length ``EINVAL``, a negative offset ``EOVERFLOW``
        (as :meth:`HostFS.copy_file_range`). Here (a handle kind that cannot): ``EOPNOTSUPP``."""
        raise OSError(errno.EOPNOTSUPP, "copy_file_range is not supported on this handle", self.path)

    def lseek(self, offset: int, whence: int) -> int:
        """``lseek(2)`` with ``SEEK_DATA``/``SEEK_HOLE`` only (all I/O here is positional, so
        there is no position to move; any other ``whence`` is ``EINVAL``): the next data or
        hole at or after ``offset``; ``ENXIO`` when ``offset`` is negative or at/after EOF.
        A filesystem may report the whole file as data (the hole at EOF), which is this
        generic body's answer."""
        size = self.fstat().size
        if whence not in (SEEK_DATA, SEEK_HOLE):
            raise OSError(errno.EINVAL, "only SEEK_DATA and SEEK_HOLE", self.path)
        if offset < 0 or offset >= size:
            raise OSError(errno.ENXIO, os.strerror(errno.ENXIO), self.path)
        return offset if whence == SEEK_DATA else size

    @abstractmethod
    def close(self) -> None: ...

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    def __enter__(self) -> "FileHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"flags={self.flags:#o}"
        return f"<{type(self).__name__} {self.path!r} {state}>"


class Entry:
    """:meth:`HostFS.entry`: a look at one path, then its removal (or its exclusive creation),
    by one caller (not shared between threads). This generic one calls ``fs.lstat``,
    ``fs.unlink``, ``fs.rmdir``, ``fs.create_handle``."""

    def __init__(self, fs: "HostFS", path: str):
        self.fs, self.path = fs, path

    def lstat(self) -> Stat:
        return self.fs.lstat(self.path)

    def lstat_or_none(self) -> Stat | None:
        """:meth:`lstat`, or ``None`` where nothing is (:data:`ABSENT_ERRNOS`), as
        :meth:`HostFS.lstat_or_none` of the path."""
        return self.fs.lstat_or_none(self.path)

    def xattrs(self) -> dict[str, bytes]:
        """The entry's own xattrs (a symlink's, never its target's), as :meth:`HostFS.xattrs`
        of the path — the removal's preimage reads them through the entry it looked at."""
        return self.fs.xattrs(self.path)

    def reader(self, st: Stat) -> "FileHandle | None":
        """A read-only handle on the regular file at the entry when it is the inode ``st``
        describes, for the preimage's reads (:meth:`FileHandle.xattrs`,
        :meth:`FileHandle.read_own`; the caller closes it), or ``None``: read by path. Here
        always ``None`` (the same host calls as before the entry existed)."""
        return None

    def unlink(self) -> None:
        self.fs.unlink(self.path)

    def rmdir(self) -> None:
        self.fs.rmdir(self.path)

    def create_handle(self, mode: int, flags: int = os.O_WRONLY) -> "FileHandle":
        """:meth:`HostFS.create_handle` of the entry's path — an exclusive create, the handle on
        the new inode — e.g. after :meth:`lstat_or_none` found nothing there (the undo core's
        look before a create): an implementation that keeps the parent's resolution creates
        through it. Here the path call."""
        return self.fs.create_handle(self.path, mode, flags)

    def close(self) -> None:
        """Release what the entry holds (nothing here); idempotent."""

    def __enter__(self) -> "Entry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_component(name: str, path: str) -> None:
    """``EINVAL`` unless ``name`` is one entry name: not empty, ``.`` or ``..``, no ``/`` or NUL."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise OSError(errno.EINVAL, f"not one entry name: {name!r}", path)


def same_inode(a: "Stat | Attr", b: "Stat | Attr") -> bool:
    """Do two stat records describe the same inode (``st_ino`` and ``st_dev``)?"""
    return a.ino == b.ino and a.dev == b.dev


def names_inode(fs: "HostFS", path: str, handle: FileHandle) -> bool:
    """Is ``path`` (final symlink not followed) the inode ``handle`` has open?

    False when nothing is there (or a symlink is on the way): the handle's file was
    unlinked, renamed away or replaced, and ``path`` no longer reaches it.
    """
    try:
        st = fs.lstat(path)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return False
        raise
    return same_inode(st, handle.fstat())


class Lock(Protocol):
    def release(self) -> None: ...



def absent_as_none(lstat, path: str):
    """``lstat(path)``, or ``None`` where nothing is (:data:`ABSENT_ERRNOS`: ``ENOENT``,
    ``ENOTDIR``, a symlink on the way) — the one rule every "is it there?" uses."""
    try:
        return lstat(path)
    except OSError as e:
        if e.errno in ABSENT_ERRNOS:
            return None
        raise


_WRITE_ALL_CHUNK = 1 << 20  # HostFS.write_all: bytes per write call


class HostFS(ABC):
    """Every host operation the core performs. Paths are normalised and relative."""

    #: a short name for diagnostics and fault plans ("work", "store")
    name: str = "host"

    @abstractmethod
    def lstat(self, path: str) -> Stat: ...

    def exists(self, path: str) -> bool:
        """Is an object at ``path``, reachable without following a symlink? A file or a
        symlink as a parent means "no" (:data:`ABSENT_ERRNOS`)."""
        return self.lstat_or_none(path) is not None

    def lstat_or_none(self, path: str) -> Stat | None:
        """:meth:`lstat`, or ``None`` where nothing is (:data:`ABSENT_ERRNOS`)."""
        return absent_as_none(self.lstat, path)

    def lstat_head(self, path: str, length: "Callable[[Stat], int]") -> tuple[Stat | None, bytes | None]:
        """:meth:`lstat_or_none` and, for a regular file, its first ``length(st)`` bytes
        (``(st, None)`` for anything else). This body is those two calls, :meth:`read` at
        offset 0 after the look; an implementation may make them one resolution of ``path``
        (:class:`~sandbox.hostfs.real.RealHostFS`: the bytes then come from the inode the
        stat describes)."""
        st = self.lstat_or_none(path)
        if st is None or st.kind != REG:
            return st, None
        return st, self.read(path, 0, length(st))

    def entry(self, path: str) -> "Entry":
        """The entry ``path`` for one caller that looks at it (:meth:`Entry.lstat`) and then
        removes it (:meth:`Entry.unlink` / :meth:`Entry.rmdir`), e.g. the own-write journal's
        last look before the removal; a context manager (closed at its end). This body's
        :class:`Entry` is those separate calls, the same host calls in the same order; an
        implementation may resolve the parent once for all of them
        (:class:`~sandbox.hostfs.real.RealHostFS`: the look is then of the very directory
        entry that is removed, wherever that directory is moved meanwhile)."""
        return Entry(self, path)

    @abstractmethod
    def getattr(self, path: str) -> Attr:
        """Full attributes of the entry at ``path`` (a final symlink is not followed).

        Every implementation defines it (so wrappers that forward the abstract methods
        forward this too); this body is the fallback built from :meth:`lstat`
        (:meth:`Attr.from_stat`), which an implementation may return via ``super()``.
        """
        return Attr.from_stat(self.lstat(path))

    @abstractmethod
    def statfs(self) -> StatFS:
        """The filesystem holding the root; this body is a fixed synthetic fallback."""
        return SYNTHETIC_STATFS

    @abstractmethod
    def listdir(self, path: str, *, limit_bytes: int | None = None) -> list[str]:
        """The names in directory ``path`` (no ``.``/``..``; a final symlink is not followed:
        ``ENOTDIR``), in the directory's order. ``limit_bytes``: the directory is read only
        until a name would pass it, counted as :func:`~sandbox.limits.listing_cost` counts
        (:func:`bounded_names`), then :class:`ListingTooLarge` (``ENOMEM``) — a guest's
        million-name directory costs a bounded caller its bound, never the whole listing."""

    @abstractmethod
    def open(self, path: str, flags: int) -> FileHandle:
        """Open the regular file ``path`` and return a handle on its inode.

        ``flags`` is ``os.O_RDONLY``, ``os.O_WRONLY`` or ``os.O_RDWR``, optionally
        ``| os.O_APPEND``; any other bit (``O_CREAT``, ``O_TRUNC``, ``O_EXCL``, …) is
        ``EINVAL`` — creation and truncation go through :meth:`create` and
        :meth:`truncate`. A directory is ``EISDIR``, a symlink ``ELOOP`` (never
        followed), a special file ``EPERM`` (never opened), a missing path ``ENOENT``.
        The same resolution rules as every other call apply: nothing outside the root is
        ever reached.
        """

    def append_handle(self, path: str) -> FileHandle | None:
        """A handle for many writes to ``path``, a file that only the caller changes (the
        undo store's journal), kept open across them — or None: the caller writes by path.
        The caller drops it before it replaces or renames the file. This base makes no host
        call and returns None, so a simulated or fault-injected disk sees exactly the calls
        it saw before; :class:`~sandbox.hostfs.real.RealHostFS` opens the file for writing
        (one resolution for all the writes)."""
        return None

    def open_dir(self, path: str) -> FileHandle:
        """A read-only handle on the directory ``path`` (never a symlink followed, nothing
        outside the root), for :meth:`FileHandle.fstat` and xattr reads of its inode — a
        server's repeated look at a directory without a path resolution each time; never
        listed, written or changed through. Not every implementation offers it
        (``EOPNOTSUPP``: the caller looks by path)."""
        raise OSError(errno.EOPNOTSUPP, "no directory handles here", path)

    @abstractmethod
    def read(self, path: str, offset: int, length: int) -> bytes: ...

    @abstractmethod
    def create(self, path: str, mode: int) -> None:
        """Create an empty regular file; ``EEXIST`` if anything is at ``path``."""

    @abstractmethod
    def create_handle(self, path: str, mode: int, flags: int = os.O_WRONLY) -> FileHandle:
        """:meth:`create`, and a handle (``flags`` as for :meth:`open`) on the new inode.

        The handle comes from the creating call itself, never from a second lookup of
        ``path``: whatever someone puts at ``path`` after the creation, writes and
        metadata through the handle reach only the file this call made.
        """

    @abstractmethod
    def write(self, path: str, offset: int, data: bytes) -> int:
        """Write at ``offset``; may write fewer bytes than given (callers loop)."""

    @abstractmethod
    def truncate(self, path: str, size: int) -> None: ...

    @abstractmethod
    def unlink(self, path: str) -> None: ...

    @abstractmethod
    def rmdir(self, path: str) -> None: ...

    @abstractmethod
    def mkdir(self, path: str, mode: int) -> None: ...

    @abstractmethod
    def rename(self, src: str, dst: str) -> None: ...

    @abstractmethod
    def exchange(self, a: str, b: str) -> None:
        """``renameat2(a, b, RENAME_EXCHANGE)``: the objects at ``a`` and ``b`` (any kinds: a
        file and a directory too) swap names atomically, each keeping its inode. Both must
        exist (``ENOENT``); one inside the other is ``EINVAL``; two names of one inode: nothing
        happens. Both parents' mtimes change, as for a rename."""

    @abstractmethod
    def symlink(self, target: str, path: str) -> None: ...

    @abstractmethod
    def mknod(self, path: str, mode: int, fmt: int) -> None:
        """Create a fifo (``fmt`` ``S_IFIFO``) or a unix-socket node (``S_IFSOCK``) with
        exactly ``mode`` (all 12 bits, no umask); any other ``fmt`` is ``EPERM`` (a device
        is never made on the host), anything at ``path`` ``EEXIST``. The new node is never
        opened for I/O; its mode is set through an ``O_PATH`` descriptor of it, never by
        name again."""

    @abstractmethod
    def readlink(self, path: str) -> str: ...

    @abstractmethod
    def link(self, existing: str, new: str) -> None: ...

    @abstractmethod
    def chmod(self, path: str, mode: int) -> None: ...

    @abstractmethod
    def utime(self, path: str, mtime_ns: int, atime_ns: int | None = None) -> None:
        """Set mtime (and atime, unless ``None``: kept as it is) in ns, without following a
        final symlink."""

    @abstractmethod
    def lchown(self, path: str, uid: int, gid: int) -> None:
        """Set the owner of ``path`` itself (a symlink's own, never its target's); ``-1``
        leaves that id as it is; ``EPERM`` where the process may not (only root gives files away)."""

    @abstractmethod
    def listxattr(self, path: str) -> list[str]: ...

    def getattr_xattr_names(self, path: str) -> tuple[Attr, list[str]]:
        """:meth:`getattr` of ``path`` and the names of its xattrs (a symlink's own too; none
        where they cannot be listed), for callers that need both on every call (a server's
        getattr reads the kept mode and owner). Raises as :meth:`getattr`. This fallback
        resolves the path twice; an implementation may do both from one resolution."""
        a = self.getattr(path)
        try:
            return a, self.listxattr(path)
        except OSError:
            return a, []

    @abstractmethod
    def getxattr(self, path: str, name: str) -> bytes: ...

    @abstractmethod
    def setxattr(self, path: str, name: str, value: bytes) -> None: ...

    @abstractmethod
    def removexattr(self, path: str, name: str) -> None: ...

    @abstractmethod
    def fallocate(self, path: str, offset: int, length: int, mode: int = 0) -> None: ...

    @abstractmethod
    def copy_file_range(self, src: str, dst: str, src_offset: int, dst_offset: int, length: int) -> int: ...

    @abstractmethod
    def fsync(self, path: str) -> None: ...

    def clone_to(self, path: str, dst_fs: "HostFS", dst_path: str) -> None:
        """Reflink ``path`` to a new file ``dst_path`` of ``dst_fs`` (FICLONE).

        Raises ``OSError(EOPNOTSUPP)`` when the filesystems cannot share extents; the
        caller falls back to copying.
        """
        raise OSError(errno.EOPNOTSUPP, "reflink not supported")

    @abstractmethod
    def lock(self, path: str) -> Lock:
        """Take an exclusive lock on the file ``path`` (created if missing) or raise StoreBusy."""

    # -- conveniences built on the primitives (same for both implementations) --

    def read_all(self, path: str, chunk_bytes: int = 1 << 20) -> bytes:
        """Every byte of ``path``: reads from offset 0 until a read returns nothing. A file
        read whole by its first read is returned as that read's bytes (no copy)."""
        first = self.read(path, 0, chunk_bytes)
        if not first:
            return b""
        chunk = self.read(path, len(first), chunk_bytes)
        if not chunk:
            return first if type(first) is bytes else bytes(first)
        out = bytearray(first)
        while chunk:
            out += chunk
            chunk = self.read(path, len(out), chunk_bytes)
        return bytes(out)

    def write_all(self, path: str, offset: int, data: bytes) -> None:
        """Write every byte of ``data`` at ``offset`` (loops over short writes), at most
        ``_WRITE_ALL_CHUNK`` bytes a call. ``bytes`` that fit one call are passed as they are."""
        if type(data) is bytes and 0 < len(data) <= _WRITE_ALL_CHUNK:
            n = self.write(path, offset, data)
            if n == len(data):
                return
            if n <= 0:
                raise OSError(errno.EIO, f"write made no progress on {path!r}")
            done = n
        else:
            done = 0
        view = memoryview(data)
        while done < len(view):
            n = self.write(path, offset + done, bytes(view[done : done + _WRITE_ALL_CHUNK]))
            if n <= 0:
                raise OSError(errno.EIO, f"write made no progress on {path!r}")
            done += n

    def xattrs(self, path: str) -> dict[str, bytes]:
        names = self.listxattr(path)  # most files have none: no sort, no comprehension then
        return {name: self.getxattr(path, name) for name in sorted(names)} if names else {}
