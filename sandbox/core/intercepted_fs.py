"""InterceptedFS: POSIX-like primitive operations on paths relative to the working root.

Each mutation runs the interceptor's pre-hook and then the host call through the
narrow host-filesystem interface, both under the interceptor's lock, so the WAL record
and the mutation it protects are never interleaved with another operation. This is the
object the protocol servers and the simulated client both call (SPEC §3).

Paths: every argument is normalised (``..``, absolute paths and NUL bytes are
refused with :class:`~sandbox.hostfs.PathError` before anything is touched); symlinks
are never followed on the host — a path routed through one fails with ``ELOOP``.
Symlink *targets* are data and are stored as given.

Pass-through: with ``interceptor=None`` there are no hooks and no undo — the same
operations, checks and errors, for providers that are never undo-tracked (an
in-memory share made writable). One code path either way.

Open handles: :meth:`open` returns a host :class:`~sandbox.hostfs.FileHandle` (the
inode, not the path); :meth:`pwrite`, :meth:`ftruncate`, :meth:`fchmod`, :meth:`futime`,
:meth:`fsetxattr`, :meth:`fremovexattr`, :meth:`ffallocate` and :meth:`fcopy_file_range` run the hooks for the path the caller names
(a server's fid path) and then act on the handle, so a file that was renamed or unlinked
while open keeps working as it does on a local disk — and a new file made at its old
name is never touched. The hooks capture that path only while it still names the
handle's inode (see :mod:`sandbox.core.interceptor`).

Safeguards: if a pre-hook says *hold*, the optional ``decide(hold) -> "allow"|"deny"``
callback is asked synchronously; without one, :class:`HoldRequired` propagates to the
caller (servers hold the reply, resolve, and retry). A deny rolls the step back and the
operation fails with :class:`SafeguardDenied` (``EIO``).
"""

from __future__ import annotations

import errno
from typing import Callable

import os

from ..hostfs import DIR, NAME_LEN_MAX, PATH_LEN_MAX, FileHandle, HostFS, PathError, Stat, normalize
from .errors import HoldRequired, SafeguardDenied
from .interceptor import UndoInterceptor
from .safeguard import Hold
from .tree_ops import TreeOps, entry_path as _entry

Decide = Callable[[Hold], str]


class InterceptedFS(TreeOps):
    def __init__(self, host: HostFS, interceptor: UndoInterceptor | None, decide: Decide | None = None):
        self.host = host
        self.interceptor = interceptor
        self.decide = decide

    # ------------------------------------------------------------------ machinery

    def _run(self, hook: Callable[[], None], call: Callable[[], object], sync: tuple[str, ...] = ()):
        i = self.interceptor
        if i is None:
            return call()
        with i.lock:
            while True:
                try:
                    hook()
                    break
                except HoldRequired as held:
                    if self.decide is None:
                        raise
                    action = self.decide(held.hold)
                    i.resolve_hold(held.hold.id, "allow" if action == "allow" else "deny")
                    if action != "allow":
                        raise SafeguardDenied(f"{held.hold.message} Denied: step {held.hold.step_id} was rolled back.") from None
                except (SafeguardDenied, OSError):
                    i.op_failed()  # e.g. the intent's fsync failed: the host call will not run
                    raise
            try:
                result = call()
            except Exception:
                i.op_failed()
                raise
            if sync and i.log.durable:
                i.log.sync_work(self.host, *sync)  # power-loss mode: each mutation durable before the next
            return result

    # ------------------------------------------------------------------ reads (no hooks)

    def lstat(self, path: str) -> Stat:
        return self.host.lstat(normalize(path))

    def exists(self, path: str) -> bool:
        return self.host.exists(normalize(path))

    def listdir(self, path: str = "") -> list[str]:
        return self.host.listdir(normalize(path))

    def read(self, path: str, offset: int = 0, length: int = 1 << 30) -> bytes:
        return self.host.read(normalize(path), offset, length)

    def read_file(self, path: str) -> bytes:
        return self.host.read_all(normalize(path))

    def readlink(self, path: str) -> str:
        return self.host.readlink(normalize(path))

    def xattrs(self, path: str) -> dict[str, bytes]:
        return self.host.xattrs(normalize(path))

    # ------------------------------------------------------------------ primitives

    def create(self, path: str, mode: int = 0o644) -> None:
        p = _entry(path, "create")
        i = self.interceptor
        self._run(lambda: i.pre_create(p), lambda: self.host.create(p, mode), sync=(p,))  # type: ignore[union-attr]
        if i is not None:
            i.post_create(p)

    def create_handle(self, path: str, mode: int = 0o644, flags: int = os.O_WRONLY) -> FileHandle:
        """:meth:`create`, returning a handle (``flags``: an access mode [| ``O_APPEND``])
        on the new inode itself — never on whatever the name may be swapped for after."""
        p = _entry(path, "create")
        i = self.interceptor
        with self.host.entry(p) as e:  # the look and the creation beneath one parent (HostFS.entry)
            handle = self._run(lambda: i.pre_create(p, look=e), lambda: e.create_handle(mode, flags), sync=(p,))  # type: ignore[union-attr]
        if i is not None:
            i.post_create(p)
        return handle

    def open_trunc(self, path: str) -> None:
        p = _entry(path, "truncate")
        self._run(lambda: self.interceptor.pre_open_trunc(p), lambda: self.host.truncate(p, 0), sync=(p,))  # type: ignore[union-attr]

    def write(self, path: str, offset: int, data: bytes | bytearray | memoryview) -> int:
        p = _entry(path, "write")
        if offset < 0:
            raise OSError(errno.EINVAL, "negative offset", path)
        self._run(lambda: self.interceptor.pre_write(p), lambda: self.host.write_all(p, offset, bytes(data)), sync=(p,))  # type: ignore[union-attr]
        return len(data)

    def truncate(self, path: str, size: int) -> None:
        p = _entry(path, "truncate")
        if size < 0:
            raise OSError(errno.EINVAL, "negative size", path)
        self._run(lambda: self.interceptor.pre_setattr(p, size=size), lambda: self.host.truncate(p, size), sync=(p,))  # type: ignore[union-attr]

    def unlink(self, path: str, reader: FileHandle | None = None) -> None:
        """Remove the name ``path``. ``reader``: a descriptor the caller holds that may be on
        the file there (a FUSE node's): its preimage is read through it when it is."""
        p = _entry(path, "unlink")
        with self.host.entry(p) as e:  # the preimage's look and the removal through one entry (HostFS.entry)
            self._run(lambda: self.interceptor.pre_unlink(p, False, reader, look=e), e.unlink, sync=(p,))  # type: ignore[union-attr]

    def rmdir(self, path: str) -> None:
        p = _entry(path, "remove")
        with self.host.entry(p) as e:
            self._run(lambda: self.interceptor.pre_unlink(p, True, look=e), e.rmdir, sync=(p,))  # type: ignore[union-attr]

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        p = _entry(path, "create")
        i = self.interceptor
        self._run(lambda: i.pre_create(p), lambda: self.host.mkdir(p, mode), sync=(p,))  # type: ignore[union-attr]
        if i is not None:
            i.post_mkdir(p)

    def rename(self, src: str, dst: str) -> None:
        s, d = _entry(src, "rename"), _entry(dst, "replace")
        self._run(lambda: self.interceptor.pre_rename(s, d), lambda: self.host.rename(s, d), sync=(s, d))  # type: ignore[union-attr]

    def exchange(self, a: str, b: str) -> None:
        """``renameat2(RENAME_EXCHANGE)``: the objects at ``a`` and ``b`` swap names
        (:meth:`HostFS.exchange`); undone by exchanging them back."""
        x, y = _entry(a, "exchange"), _entry(b, "exchange")
        self._run(lambda: self.interceptor.pre_exchange(x, y), lambda: self.host.exchange(x, y), sync=(x, y))  # type: ignore[union-attr]

    def symlink(self, target: str, path: str) -> None:
        p = _entry(path, "create")
        if not isinstance(target, str) or not target or "\0" in target or len(target.encode("utf-8", "surrogateescape")) > PATH_LEN_MAX:
            raise PathError(errno.EINVAL, f"invalid symlink target {target!r}")
        i = self.interceptor
        self._run(lambda: i.pre_create(p), lambda: self.host.symlink(target, p), sync=(p,))  # type: ignore[union-attr]
        if i is not None:
            i.post_symlink(target, p)

    def mknod(self, path: str, mode: int, fmt: int) -> None:
        """A fifo or a unix-socket node (:meth:`HostFS.mknod`: anything else is ``EPERM``),
        journalled like any creation (``pre_create``: its undo removes it)."""
        p = _entry(path, "create")
        i = self.interceptor
        self._run(lambda: i.pre_create(p), lambda: self.host.mknod(p, mode, fmt), sync=(p,))  # type: ignore[union-attr]
        if i is not None:
            i.post_create(p)

    def link(self, existing: str, new: str) -> None:
        e, n = _entry(existing, "link"), _entry(new, "create")
        self._run(lambda: self.interceptor.pre_link(e, n), lambda: self.host.link(e, n), sync=(e, n))  # type: ignore[union-attr]

    def chmod(self, path: str, mode: int) -> None:
        p = normalize(path)
        self._run(lambda: self.interceptor.pre_setattr(p), lambda: self.host.chmod(p, mode), sync=(p,))  # type: ignore[union-attr]

    def utime(self, path: str, mtime_ns: int, atime_ns: int | None = None) -> None:
        p = normalize(path)
        self._run(lambda: self.interceptor.pre_setattr(p), lambda: self.host.utime(p, mtime_ns, atime_ns), sync=(p,))  # type: ignore[union-attr]

    def setxattr(self, path: str, name: str, value: bytes | bytearray | memoryview) -> None:
        p = normalize(path)
        if not name or "\0" in name or len(name) > NAME_LEN_MAX:
            raise OSError(errno.EINVAL, f"invalid xattr name {name!r}", path)
        self._run(lambda: self.interceptor.pre_xattr(p), lambda: self.host.setxattr(p, name, bytes(value)), sync=(p,))  # type: ignore[union-attr]

    def removexattr(self, path: str, name: str) -> None:
        p = normalize(path)
        self._run(lambda: self.interceptor.pre_xattr(p), lambda: self.host.removexattr(p, name), sync=(p,))  # type: ignore[union-attr]

    def fallocate(self, path: str, offset: int, length: int, mode: int = 0) -> None:
        p = _entry(path, "fallocate")
        self._run(lambda: self.interceptor.pre_fallocate(p), lambda: self.host.fallocate(p, offset, length, mode), sync=(p,))  # type: ignore[union-attr]

    def copy_file_range(self, src: str, dst: str, src_offset: int, dst_offset: int, length: int) -> int:
        s, d = normalize(src), _entry(dst, "write")
        return self._run(lambda: self.interceptor.pre_copy_file_range(d),  # type: ignore[union-attr]
                         lambda: self.host.copy_file_range(s, d, src_offset, dst_offset, length), sync=(d,))

    # ------------------------------------------------------------------ open handles

    def open(self, path: str, flags: int) -> FileHandle:
        """Open a regular file. ``O_TRUNC`` (with write access) runs the truncation hook
        first, as ``open(2)`` would truncate; every other flag is the host's business."""
        p = normalize(path)
        if flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY:
            self.open_trunc(p)
        return self.host.open(p, flags & ~os.O_TRUNC)

    def pwrite(self, handle: FileHandle, path: str, offset: int, data: bytes | bytearray | memoryview) -> int:
        """Write all of ``data`` through ``handle``; ``path`` is where the file is now."""
        p = _entry(path, "write")
        if offset < 0:
            raise OSError(errno.EINVAL, "negative offset", path)

        def call() -> int:
            view, done = memoryview(data), 0
            while done < len(view):
                # the whole of a write up to 1 MiB as given (bytes, or a read-only view: no copy)
                chunk = data if done == 0 and len(view) <= 1 << 20 else bytes(view[done:done + (1 << 20)])
                n = handle.pwrite(chunk, offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"write made no progress on {path!r}")
                done += n
            return done

        return self._run(lambda: self.interceptor.pre_write(p, handle), call, sync=(p,))  # type: ignore[union-attr]

    def ftruncate(self, handle: FileHandle, path: str, size: int) -> None:
        p = _entry(path, "truncate")
        if size < 0:
            raise OSError(errno.EINVAL, "negative size", path)
        self._run(lambda: self.interceptor.pre_setattr(p, size=size, handle=handle), lambda: handle.truncate(size),  # type: ignore[union-attr]
                  sync=(p,))

    def fchmod(self, handle: FileHandle, path: str, mode: int) -> None:
        p = normalize(path)
        self._run(lambda: self.interceptor.pre_setattr(p, handle=handle), lambda: handle.chmod(mode), sync=(p,))  # type: ignore[union-attr]

    def futime(self, handle: FileHandle, path: str, mtime_ns: int, atime_ns: int | None = None) -> None:
        p = normalize(path)
        self._run(lambda: self.interceptor.pre_setattr(p, handle=handle), lambda: handle.utime(mtime_ns, atime_ns),  # type: ignore[union-attr]
                  sync=(p,))

    def fsetxattr(self, handle: FileHandle, path: str, name: str, value: bytes | bytearray | memoryview) -> None:
        p = normalize(path)
        if not name or "\0" in name or len(name) > NAME_LEN_MAX:
            raise OSError(errno.EINVAL, f"invalid xattr name {name!r}", path)
        self._run(lambda: self.interceptor.pre_xattr(p, handle=handle), lambda: handle.setxattr(name, bytes(value)),  # type: ignore[union-attr]
                  sync=(p,))

    def fremovexattr(self, handle: FileHandle, path: str, name: str) -> None:
        p = normalize(path)
        self._run(lambda: self.interceptor.pre_xattr(p, handle=handle), lambda: handle.removexattr(name), sync=(p,))  # type: ignore[union-attr]

    def ffallocate(self, handle: FileHandle, path: str, offset: int, length: int, mode: int = 0) -> None:
        """``fallocate(2)`` through ``handle`` (:meth:`FileHandle.fallocate`); ``path`` is where
        the file is now. Every mode may change bytes or the size: a full preimage first."""
        p = _entry(path, "fallocate")
        self._run(lambda: self.interceptor.pre_fallocate(p, handle), lambda: handle.fallocate(offset, length, mode),  # type: ignore[union-attr]
                  sync=(p,))

    def fcopy_file_range(self, src: FileHandle, dst: FileHandle, dst_path: str, src_offset: int, dst_offset: int,
                         length: int) -> int:
        """``copy_file_range(2)`` from ``src`` to ``dst`` (:meth:`FileHandle.copy_range_to`);
        ``dst_path`` is where the destination is now (its preimage is taken there)."""
        d = _entry(dst_path, "write")
        return self._run(lambda: self.interceptor.pre_copy_file_range(d, dst),  # type: ignore[union-attr]
                         lambda: src.copy_range_to(dst, src_offset, dst_offset, length), sync=(d,))

    # ------------------------------------------------------------------ conveniences

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Replace or create a file the way ``open(O_CREAT|O_TRUNC); write`` does."""
        p = _entry(path, "write")
        try:
            st = self.host.lstat(p)
        except FileNotFoundError:
            self.create(p, mode)
        else:
            if st.kind == DIR:
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            self.open_trunc(p)
        if data:
            self.write(p, 0, data)
