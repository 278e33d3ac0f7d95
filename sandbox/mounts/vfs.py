"""User-implemented trees served to the guest (seed 000's ``VirtualFileSystem``).

An embedder mounts either a flat ``{relative_path: bytes}`` dict (an in-memory snapshot:
:func:`~sandbox.mounts.memory.memory_tree`) or an object implementing
:class:`VirtualFileSystem`; :class:`VfsHostFS` adapts that object to the narrow
:class:`~sandbox.hostfs.HostFS` interface, so the protocol servers serve it like any
other provider — no special case on the wire. Unlike a dict, a VFS is *live*: every
lookup, listing and open asks the user's object again.

Paths given to the user's object are relative, ``/``-separated and normalised (``""`` is
the mount's root), exactly as the guest named them below the mount point.

Invariants:

* the user's object is never trusted to be well behaved: any exception other than the
  ``OSError``/``KeyError``/``FileNotFoundError`` it may raise for "no such entry" becomes
  ``EIO`` (logged), a malformed answer (a bad type, a name with ``/``) is ``EIO`` too —
  nothing the object does takes the session down;
* one open reads the whole file once (at most :data:`VFS_FILE_BYTES_MAX`, more is
  ``EFBIG``): a reader sees one consistent version of a file for as long as it holds it;
  handles that read the same bytes object share it, a handle copies it at its first write,
  and what a mount's open handles hold (each distinct object once) is at most
  :data:`VFS_HANDLE_BYTES_MAX` (``ENOMEM`` at the open or write past it);
* read-only unless the object has ``write`` and the mount is writable; a write replaces
  the whole file through ``write(path, data)`` (read-modify-write at the handle), and
  every other mutation (mkdir, unlink, rename, links, chmod, xattrs) is ``EPERM``;
* never undo-tracked and never persisted (as every in-memory mount, seed 000).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat as _stat
import time
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, runtime_checkable

from ..hostfs import (DIR, NAME_LEN_MAX, REG, SYNTHETIC_STATFS, Attr, FileHandle, HostFS, Stat, StatFS, bounded_names,
                      check_open_flags)
from .provider import Provider

__all__ = ["VirtualFileSystem", "FileStat", "VfsHostFS", "vfs_tree", "is_vfs", "VFS_FILE_BYTES_MAX",
           "VFS_HANDLE_BYTES_MAX", "VFS_LIST_ENTRIES_MAX"]

log = logging.getLogger("sandbox.mounts.vfs")

#: the largest file one open of a VFS file reads (more is EFBIG)
VFS_FILE_BYTES_MAX = 64 << 20
#: what the open handles of one VFS mount hold, each distinct content once (handles that
#: read the same bytes object share it; a handle's private copy, made at its first write,
#: counts apart); an open or a first write past it is ``ENOMEM``
VFS_HANDLE_BYTES_MAX = 256 << 20
#: the most names one directory listing of a VFS may return (more is EIO)
VFS_LIST_ENTRIES_MAX = 100_000
FILE_MODE, DIR_MODE = 0o644, 0o755


@dataclass(frozen=True)
class FileStat:
    """What :meth:`VirtualFileSystem.stat` returns (a dict with these keys works too)."""

    type: str  # "file" | "dir"
    size: int = 0
    mode: int | None = None  # permission bits; default 0644 / 0755
    mtime_ns: int | None = None  # default: when the mount was made


@runtime_checkable
class VirtualFileSystem(Protocol):
    """A tree the embedder implements. ``write(path, data)`` is optional (writable mounts)."""

    def list(self, path: str) -> Iterable[str]:
        """The names in directory ``path``."""

    def stat(self, path: str) -> "FileStat | dict":
        """The entry at ``path``; raise ``FileNotFoundError`` (or ``KeyError``) if none."""

    def read(self, path: str) -> bytes:
        """The whole content of file ``path``."""


def is_vfs(obj: Any) -> bool:
    return not isinstance(obj, dict) and isinstance(obj, VirtualFileSystem)


def _err(code: int, path: str, why: str = "") -> OSError:
    return OSError(code, why or os.strerror(code), path)


class _VfsHandle(FileHandle):
    """One open file: its bytes read once at open (shared with every handle that read the
    same object, held in the mount's :meth:`VfsHostFS._hold`), copied for this handle at its
    first change; writes go back through ``write``."""

    def __init__(self, fs: "VfsHostFS", path: str, flags: int, data: bytes, attr: Attr):
        self.path, self.flags = path, flags
        fs._hold(data, path)
        self._fs, self._data, self._attr, self._closed = fs, data, attr, False

    def _own(self, size: int) -> bytearray:
        """This handle's private copy of its bytes, made now if need be, with room held for
        ``size`` bytes (``ENOMEM`` past ``VFS_HANDLE_BYTES_MAX``)."""
        data = self._data
        if type(data) is not bytearray:
            copy = bytearray(data)
            self._fs._hold(copy, self.path, max(size, len(copy)))
            self._fs._release(data)
            self._data = data = copy
        elif size > len(data):
            self._fs._grow(data, size, self.path)
        return data

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self, write: bool | None = None) -> None:
        if self._closed:
            raise _err(errno.EBADF, self.path)
        acc = self.flags & os.O_ACCMODE
        if write is True and acc not in (os.O_WRONLY, os.O_RDWR):
            raise _err(errno.EBADF, self.path)
        if write is False and acc not in (os.O_RDONLY, os.O_RDWR):
            raise _err(errno.EBADF, self.path)

    def pread(self, length: int, offset: int) -> bytes:
        self._check(False)
        if offset < 0 or length < 0:
            raise _err(errno.EINVAL, self.path)
        return bytes(self._data[offset:offset + length])

    def _store(self) -> None:
        self._fs._put(self.path, bytes(self._data))
        self._attr = self._fs.getattr(self.path)

    def pwrite(self, data: bytes, offset: int) -> int:
        self._check(True)
        if offset < 0:
            raise _err(errno.EINVAL, self.path)
        if self.flags & os.O_APPEND:
            offset = len(self._data)
        end = offset + len(data)
        if end > VFS_FILE_BYTES_MAX:
            raise _err(errno.EFBIG, self.path)
        buf = self._own(end)
        if offset > len(buf):
            buf.extend(b"\0" * (offset - len(buf)))
        buf[offset:end] = data
        self._store()
        return len(data)

    def truncate(self, size: int) -> None:
        self._check()
        if size < 0 or (self.flags & os.O_ACCMODE) == os.O_RDONLY:
            raise _err(errno.EINVAL, self.path)
        if size > VFS_FILE_BYTES_MAX:
            raise _err(errno.EFBIG, self.path)
        buf = self._own(size)
        del buf[size:]
        buf.extend(b"\0" * (size - len(buf)))
        self._store()

    def fsync(self, datasync: bool = False) -> None:
        self._check()

    def fstat(self) -> Attr:
        self._check()
        return self._attr

    def chmod(self, mode: int) -> None:
        self._check()
        raise _err(errno.EPERM, self.path)

    def utime(self, mtime_ns: int, atime_ns: int | None = None) -> None:
        self._check()
        raise _err(errno.EPERM, self.path)

    def chown(self, uid: int, gid: int) -> None:
        self._check()
        raise _err(errno.EPERM, self.path)

    def listxattr(self) -> list[str]:
        self._check()
        return []

    def getxattr(self, name: str) -> bytes:
        self._check()
        raise _err(errno.ENODATA, self.path)

    def setxattr(self, name: str, value: bytes) -> None:
        self._check()
        raise _err(errno.EPERM, self.path)

    def removexattr(self, name: str) -> None:
        self._check()
        raise _err(errno.ENODATA, self.path)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._fs._release(self._data)


class VfsHostFS(HostFS):
    """A :class:`HostFS` over a user's :class:`VirtualFileSystem` (module docstring)."""

    def __init__(self, vfs: VirtualFileSystem, *, writable: bool = False, name: str = "vfs"):
        self.vfs = vfs
        self.name = name
        self.writable = bool(writable) and callable(getattr(vfs, "write", None))
        self.mounted_ns = time.time_ns()
        #: id(bytes held by open handles) -> [the object, handles holding it, bytes counted]
        self._held: dict[int, list] = {}
        #: their total, at most VFS_HANDLE_BYTES_MAX
        self.held_bytes = 0

    # -- what open handles hold (VFS_HANDLE_BYTES_MAX)

    def _hold(self, data, path: str, size: int | None = None) -> None:
        """One more handle holds ``data`` (counted once however many do; ``size``: the room
        counted for it, its length by default); ``ENOMEM`` if a new one does not fit."""
        entry = self._held.get(id(data))
        if entry is not None:
            entry[1] += 1
            return
        n = len(data) if size is None else size
        if self.held_bytes + n > VFS_HANDLE_BYTES_MAX:
            raise _err(errno.ENOMEM, path, f"open files of this mount hold over {VFS_HANDLE_BYTES_MAX} bytes")
        self._held[id(data)] = [data, 1, n]
        self.held_bytes += n

    def _grow(self, data, size: int, path: str) -> None:
        """``data`` (held by one handle alone: its private copy) grows to ``size``."""
        entry = self._held[id(data)]
        if size > entry[2]:
            if self.held_bytes + size - entry[2] > VFS_HANDLE_BYTES_MAX:
                raise _err(errno.ENOMEM, path, f"open files of this mount hold over {VFS_HANDLE_BYTES_MAX} bytes")
            self.held_bytes += size - entry[2]
            entry[2] = size

    def _release(self, data) -> None:
        entry = self._held.get(id(data))
        if entry is not None and entry[0] is data:
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[id(data)]
                self.held_bytes -= entry[2]

    # -- calling the user's object safely

    def _ask(self, what: str, path: str, *args):
        try:
            return getattr(self.vfs, what)(path, *args)
        except OSError as e:  # FileNotFoundError("x") carries no errno: its class says it
            code = e.errno or (errno.ENOENT if isinstance(e, FileNotFoundError) else errno.EIO)
            raise _err(code, path) from None
        except KeyError:
            raise _err(errno.ENOENT, path) from None
        except Exception as e:  # noqa: BLE001 - the user's code: never crash the server
            log.warning("virtual file system %s: %s(%r) failed: %r", self.name, what, path, e)
            raise _err(errno.EIO, path, f"the mounted object's {what} failed: {e!r}") from None

    def _ino(self, path: str) -> int:
        return int.from_bytes(hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=7).digest(),
                              "big") | 1

    def _attr(self, path: str) -> Attr:
        st = self._ask("stat", path)
        if isinstance(st, dict):
            try:
                st = FileStat(**st)
            except TypeError:
                raise _err(errno.EIO, path, f"stat returned an unknown shape: {sorted(st)}") from None
        if not isinstance(st, FileStat) and hasattr(st, "type"):
            st = FileStat(st.type, getattr(st, "size", 0), getattr(st, "mode", None), getattr(st, "mtime_ns", None))
        if not isinstance(st, FileStat) or st.type not in ("file", "dir"):
            raise _err(errno.EIO, path, f"stat must return a FileStat of type file/dir, not {st!r}")
        kind = REG if st.type == "file" else DIR
        size = st.size if isinstance(st.size, int) and st.size >= 0 else 0
        mode = (st.mode if isinstance(st.mode, int) else (FILE_MODE if kind == REG else DIR_MODE)) & 0o777
        if not self.writable:
            mode &= ~0o222
        mtime = st.mtime_ns if isinstance(st.mtime_ns, int) and st.mtime_ns >= 0 else self.mounted_ns
        fmt = _stat.S_IFREG if kind == REG else _stat.S_IFDIR
        return Attr(kind, fmt, mode, size, 1 if kind == REG else 2, 0, 0, 0, 4096, -(-size // 512), mtime, mtime,
                    mtime, self._ino(path))

    def _put(self, path: str, data: bytes) -> None:
        if not self.writable:
            raise _err(errno.EROFS, path)
        self._ask("write", path, data)

    # -- reads

    def getattr(self, path: str) -> Attr:
        return self._attr(path)

    def lstat(self, path: str) -> Stat:
        a = self._attr(path)
        return Stat(a.kind, a.mode, a.size, a.mtime_ns, a.ctime_ns, a.ino, a.nlink, fmt=a.fmt)

    def statfs(self) -> StatFS:
        return SYNTHETIC_STATFS

    def listdir(self, path: str, *, limit_bytes: int | None = None) -> list[str]:
        """The mounted object's names (at most :data:`VFS_LIST_ENTRIES_MAX`, ``EIO`` beyond:
        what it returned is already in memory), sorted, within ``limit_bytes`` as
        :meth:`HostFS.listdir` (:func:`~sandbox.hostfs.bounded_names`)."""
        if self._attr(path).kind != DIR:
            raise _err(errno.ENOTDIR, path)
        names = self._ask("list", path)
        out: list[str] = []
        for n in names:
            if len(out) >= VFS_LIST_ENTRIES_MAX:
                raise _err(errno.EIO, path, f"more than {VFS_LIST_ENTRIES_MAX} entries")
            if (not isinstance(n, str) or not n or n in (".", "..") or "/" in n or "\0" in n
                    or len(n.encode("utf-8", "surrogateescape")) > NAME_LEN_MAX):
                raise _err(errno.EIO, path, f"the mounted object listed an invalid name {n!r}")
            out.append(n)
        return bounded_names(sorted(set(out)), limit_bytes, path)

    def _content(self, path: str) -> bytes:
        data = self._ask("read", path)
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise _err(errno.EIO, path, f"read must return bytes, not {type(data).__name__}")
        if len(data) > VFS_FILE_BYTES_MAX:
            raise _err(errno.EFBIG, path, f"larger than {VFS_FILE_BYTES_MAX} bytes")
        return bytes(data)

    def open(self, path: str, flags: int) -> FileHandle:
        check_open_flags(flags, path)
        a = self._attr(path)
        if a.kind == DIR:
            raise _err(errno.EISDIR, path)
        if (flags & os.O_ACCMODE) != os.O_RDONLY and not self.writable:
            raise _err(errno.EROFS, path)
        return _VfsHandle(self, path, flags, self._content(path), a)

    def read(self, path: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise _err(errno.EINVAL, path)
        return self._content(path)[offset:offset + length]

    def readlink(self, path: str) -> str:
        self._attr(path)
        raise _err(errno.EINVAL, path)  # a VFS has no symlinks

    def listxattr(self, path: str) -> list[str]:
        self._attr(path)
        return []

    def getxattr(self, path: str, name: str) -> bytes:
        self._attr(path)
        raise _err(errno.ENODATA, path)

    # -- writes (whole-file, through the optional ``write``)

    def create(self, path: str, mode: int) -> None:
        if not self.writable:
            raise _err(errno.EROFS, path)
        try:
            self._attr(path)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
        else:
            raise _err(errno.EEXIST, path)
        self._put(path, b"")

    def create_handle(self, path: str, mode: int, flags: int = os.O_WRONLY) -> FileHandle:
        check_open_flags(flags, path)
        self.create(path, mode)
        return _VfsHandle(self, path, flags, b"", self._attr(path))

    def write(self, path: str, offset: int, data: bytes) -> int:
        with self.open(path, os.O_RDWR) as h:
            return h.pwrite(data, offset)

    def truncate(self, path: str, size: int) -> None:
        with self.open(path, os.O_RDWR) as h:
            h.truncate(size)

    def _refuse(self, path: str, *_a, **_k):
        raise _err(errno.EPERM if self.writable else errno.EROFS, path)

    unlink = rmdir = chmod = symlink = _refuse

    def fsync(self, path: str) -> None:
        self._attr(path)

    def mkdir(self, path: str, mode: int) -> None:
        self._refuse(path)

    def rename(self, src: str, dst: str) -> None:
        self._refuse(src)

    def exchange(self, a: str, b: str) -> None:
        self._refuse(a)

    def mknod(self, path: str, mode: int, fmt: int) -> None:
        self._refuse(path)

    def link(self, existing: str, new: str) -> None:
        self._refuse(new)

    def utime(self, path: str, mtime_ns: int, atime_ns: int | None = None) -> None:
        self._refuse(path)

    def lchown(self, path: str, uid: int, gid: int) -> None:
        self._refuse(path)

    def setxattr(self, path: str, name: str, value: bytes) -> None:
        self._refuse(path)

    def removexattr(self, path: str, name: str) -> None:
        self._refuse(path)

    def fallocate(self, path: str, offset: int, length: int, mode: int = 0) -> None:
        self._refuse(path)

    def copy_file_range(self, src: str, dst: str, src_offset: int, dst_offset: int, length: int) -> int:
        self._refuse(dst)

    def lock(self, path: str):
        raise _err(errno.ENOTSUP, path)


def vfs_tree(vfs: VirtualFileSystem, *, writable: bool = False, label: str = "vfs") -> Provider:
    """A provider over the user's object (read-only unless ``writable`` and it has ``write``)."""
    host = VfsHostFS(vfs, writable=writable, name=label)
    return Provider(host, None, read_only=not host.writable, label=label)
