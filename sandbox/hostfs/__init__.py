"""The narrow host-filesystem interface: every host syscall the core makes goes through it.

Two implementations share one contract:

* :class:`~sandbox.hostfs.real.RealHostFS` — a directory on the real host, every call
  resolved relative to a directory file descriptor with ``openat2(RESOLVE_BENEATH |
  RESOLVE_NO_SYMLINKS)``: nothing outside the root is ever reached, no symlink is ever
  followed (a symlink in the middle of a path is ``ELOOP``; a symlink as the final
  component is operated on itself, never its target).
* :class:`~sandbox.hostfs.sim.SimHostFS` — an in-memory tree with the same semantics and
  the same errnos, and a fault hook called before every operation.

Paths are ``str`` relative to the root, ``/``-separated, already normalised by
:func:`normalize` (``""`` is the root itself). Errors are :class:`OSError` with a Linux
errno; callers map them, never parse messages.

Invariants both implementations keep (the parity suite in ``sim/test_hostfs.py`` runs
against both):

* ``create``/``mkdir`` apply the given mode exactly (no umask): the guest already applied
  its own.
* only regular files, directories and symlinks are created; a special file that exists
  is never opened (``read``/``write`` on it fail with ``EPERM``).
* ``chmod`` of a symlink is ``EOPNOTSUPP`` (Linux has no lchmod); symlinks carry no
  user xattrs (``setxattr`` is ``EPERM``, ``listxattr`` is empty).
"""

from __future__ import annotations

import errno
import stat as _stat
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "HostFS",
    "Stat",
    "Lock",
    "PathError",
    "StoreBusy",
    "normalize",
    "join",
    "parent_of",
    "REG",
    "DIR",
    "LNK",
    "OTHER",
    "PATH_LEN_MAX",
    "NAME_LEN_MAX",
]

REG = "reg"
DIR = "dir"
LNK = "lnk"
OTHER = "other"  # fifo, socket, device: never created, never opened

PATH_LEN_MAX = 4096
NAME_LEN_MAX = 255


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
        return self.strerror


def normalize(path: str) -> str:
    """Return the canonical relative form of ``path`` or raise :class:`PathError`.

    ``"a//b/./c/"`` → ``"a/b/c"``; ``"."`` and ``""`` → ``""`` (the root).
    ``..`` is refused outright rather than resolved: resolving it lexically would be
    wrong across symlinks, and the guest kernel never sends it to a server.
    """
    if not isinstance(path, str):
        raise PathError(errno.EINVAL, f"path must be str, not {type(path).__name__}")
    if "\0" in path:
        raise PathError(errno.EINVAL, f"path contains a NUL byte: {path!r}")
    if path.startswith("/"):
        raise PathError(errno.EINVAL, f"path must be relative to the working root: {path!r}")
    if len(path.encode("utf-8", "surrogateescape")) > PATH_LEN_MAX:
        raise PathError(errno.ENAMETOOLONG, f"path longer than {PATH_LEN_MAX} bytes")
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


@dataclass(frozen=True, slots=True)
class Stat:
    """What the core needs to know about one directory entry (never follows symlinks)."""

    kind: str  # REG | DIR | LNK | OTHER
    mode: int  # all 12 permission bits (S_IMODE)
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    nlink: int

    @classmethod
    def from_os(cls, st) -> "Stat":
        fmt = _stat.S_IFMT(st.st_mode)
        kind = {_stat.S_IFREG: REG, _stat.S_IFDIR: DIR, _stat.S_IFLNK: LNK}.get(fmt, OTHER)
        return cls(kind, _stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_nlink)


class Lock(Protocol):
    def release(self) -> None: ...


class HostFS(ABC):
    """Every host operation the core performs. Paths are normalised and relative."""

    #: a short name for diagnostics and fault plans ("work", "store")
    name: str = "host"

    @abstractmethod
    def lstat(self, path: str) -> Stat: ...

    def exists(self, path: str) -> bool:
        try:
            self.lstat(path)
        except (FileNotFoundError, NotADirectoryError):  # like os.path.exists: a file as a parent means "no"
            return False
        return True

    @abstractmethod
    def listdir(self, path: str) -> list[str]: ...

    @abstractmethod
    def read(self, path: str, offset: int, length: int) -> bytes: ...

    @abstractmethod
    def create(self, path: str, mode: int) -> None:
        """Create an empty regular file; ``EEXIST`` if anything is at ``path``."""

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
    def symlink(self, target: str, path: str) -> None: ...

    @abstractmethod
    def readlink(self, path: str) -> str: ...

    @abstractmethod
    def link(self, existing: str, new: str) -> None: ...

    @abstractmethod
    def chmod(self, path: str, mode: int) -> None: ...

    @abstractmethod
    def utime(self, path: str, mtime_ns: int) -> None:
        """Set mtime (ns) without following a final symlink."""

    @abstractmethod
    def listxattr(self, path: str) -> list[str]: ...

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
        out = bytearray()
        while True:
            chunk = self.read(path, len(out), chunk_bytes)
            if not chunk:
                return bytes(out)
            out += chunk

    def write_all(self, path: str, offset: int, data: bytes) -> None:
        """Write every byte of ``data`` at ``offset`` (loops over short writes)."""
        view = memoryview(data)
        done = 0
        while done < len(view):
            n = self.write(path, offset + done, bytes(view[done : done + (1 << 20)]))
            if n <= 0:
                raise OSError(errno.EIO, f"write made no progress on {path!r}")
            done += n

    def xattrs(self, path: str) -> dict[str, bytes]:
        return {name: self.getxattr(path, name) for name in sorted(self.listxattr(path))}
