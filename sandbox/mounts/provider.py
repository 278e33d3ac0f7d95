"""Provider: what a protocol server serves — one tree, reached by relative paths.

The 9P server (and later the FUSE server) speaks to a :class:`Provider` only. One
class covers the three kinds of export SPEC §3 names, because they differ only in
*who performs a mutation*:

* **intercepted host directory** — mutations go through the workspace's
  :class:`~sandbox.core.intercepted_fs.InterceptedFS` (hooks, WAL, safeguards), so a
  guest's write lands in the current step exactly as the simulation's writes do;
* **read-only host directory** — every mutation is ``EROFS`` before anything is touched;
* **in-memory tree** — the same operations over an in-memory :class:`HostFS`, through a
  pass-through ``InterceptedFS`` (no undo), read-only unless made writable.

Invariants:

* every host access goes through a :class:`~sandbox.hostfs.HostFS`, whose real
  implementation resolves each path beneath the root's directory fd with ``openat2``
  and never follows a symlink — a path string here can never name anything outside;
* names coming from a client are checked by :func:`child` (one component, no ``/``,
  not ``.``/``..``, no NUL, ≤ 255 bytes) before they are joined;
* special files are reported (getattr/readdir) but never opened, read, written or
  followed; ``mknod`` makes a fifo or a unix-socket node on the host, and a character or
  block device only as an *emulated* one (:mod:`~sandbox.mounts.devices`: an empty
  regular placeholder with a reserved xattr, reported as the device, never opened);
* ownership is *mapped*, never applied (:mod:`~sandbox.mounts.identity`, "Owners"): a
  client's chown, and a creation by a client :class:`~sandbox.mounts.identity.Cred` other
  than what it would see anyway, keep the owner in the reserved xattr ``user.sandbox.owner``
  of a regular file or directory — ``trusted.sandbox.owner`` of a symlink, fifo or socket,
  where the server has ``CAP_SYS_ADMIN`` —, which getattr reports; the host file stays the
  server's;
* a write or truncate by a cred without ``CAP_FSETID`` (uid != 0) clears set-uid, and
  set-gid where group-executable, in the guest's view; a chown of a non-directory too;
* the guest's root is not the host's root (:mod:`~sandbox.mounts.identity`): a set-id bit
  the host object does not already have is kept in a reserved host xattr and reported
  back, never applied; xattrs outside ``user.`` (capabilities, SELinux labels, ACLs,
  ``trusted.*``) are stored under ``user.sandbox.x.``; the reserved names are invisible;
* a mutation may raise :class:`~sandbox.core.errors.HoldRequired` *before* it has any
  effect; the server queues it and calls it again once the hold is resolved;
* a restricted **view** (:meth:`Provider.narrowed`, seed 004: a new provider, the
  original unchanged) only narrows: outside it
  every access is ``EACCES``; the directories above it can be looked up and listed (the
  listing shows only the way down), never changed; ``read_only`` never goes back to
  writable.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import time
from typing import Callable

from ..core.intercepted_fs import InterceptedFS
from ..hostfs import (DIR, FALLOCATE_MODES, LNK, MKNOD_FMTS, NAME_LEN_MAX, REG, Attr, FileHandle, HostFS, StatFS, is_within,
                      join, names_inode)
from . import devices, identity
from .identity import Cred

XATTR_CREATE, XATTR_REPLACE = 1, 2
XATTR_SIZE_MAX = 65536  # the kernel's limit for one value
XATTR_LIST_MAX = 65536
#: one copy_file_range copies at most this much (a longer request returns the short count
#: copied, which copy_file_range(2) allows and callers loop over): one request never holds
#: the serving loop for a whole large file
COPY_FILE_RANGE_BYTES_MAX = 64 << 20


def child(parent: str, name: str) -> str:
    """``parent/name`` for a client-supplied single component, or ``OSError``."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise OSError(errno.EINVAL, f"invalid name {name!r}")
    if len(name.encode("utf-8", "surrogateescape")) > NAME_LEN_MAX:
        raise OSError(errno.ENAMETOOLONG, "name longer than 255 bytes")
    return join(parent, name)


class Provider:
    """A tree served to clients. See the module docstring for the three kinds."""

    def __init__(self, host: HostFS, fs: InterceptedFS | None, *, read_only: bool, label: str = "",
                 poll: Callable[[], None] | None = None, workspace=None):
        self.host = host
        self.fs = fs if fs is not None else InterceptedFS(host, None)
        self.read_only = read_only
        self.view: str | None = ""  # "" everything; a relative path: that subtree; None: nothing
        self.label = label or host.name
        self._poll = poll
        self._workspace = workspace  # its in-flight accounting (op_started/op_finished)
        self._owner = True  # close() closes the host (see narrowed)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def intercepted(cls, workspace, label: str = "") -> "Provider":
        """The working folder of ``workspace``; every mutation is undo-tracked."""
        ws = workspace
        return cls(ws.work, ws.fs, read_only=False, label=label or "work", poll=ws.poll, workspace=ws)

    @classmethod
    def read_only_dir(cls, root: str, label: str = "") -> "Provider":
        from ..hostfs.real import RealHostFS

        return cls(RealHostFS(root, name=label or "ro"), None, read_only=True, label=label)

    @property
    def intercepted_fs(self) -> InterceptedFS | None:
        return self.fs if self.fs.interceptor is not None else None

    @property
    def interceptor(self):
        return self.fs.interceptor

    @property
    def workspace(self):
        """The :class:`~sandbox.core.workspace.Workspace` behind an intercepted export (its
        doors: ``resolve_hold``, ``pending_hold``, in-flight accounting), else None."""
        return self._workspace

    # ------------------------------------------------------------------ housekeeping

    def poll(self) -> None:
        """Time-driven transitions of the undo core (ambient steps closing, hold expiry)."""
        if self._poll is not None:
            self._poll()

    def op_started(self) -> None:
        """A request that may write was received (the step's quiescence waits for it)."""
        if self._workspace is not None:
            self._workspace.op_started()

    def op_finished(self) -> None:
        if self._workspace is not None:
            self._workspace.op_finished()

    def close(self) -> None:
        close = getattr(self.host, "close", None)
        if close is not None and self.fs.interceptor is None and self._owner:
            close()  # an intercepted host belongs to its workspace

    # ------------------------------------------------------------------ views

    def narrowed(self, view: str | None = "", read_only: bool = False) -> "Provider":
        """A NEW provider over the same tree (the same host filesystem, undo interception and
        step accounting) that shows only the subtree ``view`` ("" all, None nothing), read-only
        if asked or if this one is. ``self`` is not changed, so different clients can hold
        different views of one tree. Never widens: a view outside this one's is nothing."""
        cur = self.view
        if cur is None or view is None:
            v = None
        elif is_within(view, cur):
            v = view
        elif is_within(cur, view):
            v = cur
        else:
            v = None  # disjoint: nothing left
        out = Provider(self.host, self.fs, read_only=self.read_only or read_only, label=self.label,
                       poll=self._poll, workspace=self._workspace)
        out.view = v
        out._owner = False  # the host belongs to the provider this one narrows
        return out

    def _see(self, path: str, *, above_ok: bool = True) -> None:
        v = self.view
        if v == "" or (v is not None and (is_within(path, v) or (above_ok and is_within(v, path)))):
            return
        raise OSError(errno.EACCES, "outside the restricted view", path)

    # ------------------------------------------------------------------ queries

    def getattr(self, path: str, *, cred: Cred | None = None) -> Attr:
        """The attributes a client is told: the host's, with the mode and owner the guest
        gave (owners as ``cred``'s view shows them)."""
        self._see(path)
        a, names = self.host.getattr_xattr_names(path)  # one resolution for both (the kept mode, owner)
        return self._as_device(path, self._guest_attr(path, a, view=_view(cred), names=names), names)

    def getattr_at(self, directory: FileHandle, path: str, *, cred: Cred | None = None) -> Attr:
        """:meth:`getattr` of ``path``, an entry of the directory open on ``directory`` (from
        :meth:`open_dir`) — a listing's entries: looked up in that directory's inode, wherever
        its path is now, with no path resolved (``FileHandle.getattr_xattr_names_at``; the
        kept mode and owner, and a device's xattr, where the names show them, through
        ``getxattr_at``). The same mapping code as :meth:`getattr`."""
        self._see(path)
        entry = _EntryOf(directory, path.rsplit("/", 1)[-1])
        a, names = directory.getattr_xattr_names_at(entry.name)
        return self._as_device(path, self._guest_attr(path, a, entry, view=_view(cred), names=names), names, entry)

    def lookup_at(self, directory: FileHandle, path: str) -> Attr:
        """:meth:`lookup` of ``path``, an entry of the directory open on ``directory`` (from
        :meth:`open_dir`): found in that directory's inode wherever its path is now, no path
        resolved (``FileHandle.getattr_at``; only an empty regular file costs an xattr read
        more, as for :meth:`lookup`) — a listing's qids and d_types."""
        self._see(path)
        entry = _EntryOf(directory, path.rsplit("/", 1)[-1])
        return self._as_device(path, directory.getattr_at(entry.name), handle=entry)

    def lookup(self, path: str) -> Attr:
        """The host's attributes of ``path`` without the guest's mode — for what only names an
        entry (a 9P qid: type, inode, mtime; a readdir d_type). Anything that reports a
        mode to a client uses :meth:`getattr`, which costs one xattr read more."""
        self._see(path)
        return self._as_device(path, self.host.getattr(path))

    def fstat(self, handle: FileHandle, path: str, *, cred: Cred | None = None) -> Attr:
        """:meth:`getattr` of the file open on ``handle`` (even if renamed away or unlinked);
        ``path`` is where the server last saw it."""
        a, names = handle.fstat_xattr_names()  # one call for both (names it cannot list: none)
        return self._guest_attr(path, a, handle, view=_view(cred), names=names)

    def open_dir(self, path: str) -> FileHandle:
        """A read-only handle on the directory ``path`` for :meth:`fstat` (``HostFS.open_dir``:
        ``EOPNOTSUPP`` where the host offers none) — never listed or changed through."""
        self._see(path)
        return self.host.open_dir(path)

    def listdir(self, path: str, *, handle: FileHandle | None = None, limit_bytes: int | None = None) -> list[str]:
        """The names in directory ``path`` — read through ``handle`` (from :meth:`open_dir`,
        on that directory's inode: no path resolved) if given; read only up to ``limit_bytes``
        (``HostFS.listdir``: ``ListingTooLarge``, ``ENOMEM``, past it). Above the view only
        the way down is shown — the view's next component, if it is there: looked up, no
        directory read, no bound applies."""
        self._see(path)
        v = self.view
        if v and not is_within(path, v):  # above the view
            down = (v[len(path) + 1:] if path else v).split("/", 1)[0]
            return [down] if self.host.exists(join(path, down)) else []
        if handle is not None:
            return handle.listdir(limit_bytes=limit_bytes)
        return self.host.listdir(path, limit_bytes=limit_bytes)

    def readlink(self, path: str) -> str:
        self._see(path, above_ok=False)
        return self.host.readlink(path)

    def listxattr(self, path: str, *, handle: FileHandle | None = None) -> list[str]:
        """The xattr names at ``path`` — of ``handle``'s inode if given (see :meth:`setattr`)."""
        self._see(path)
        return identity.guest_xattr_names(handle.listxattr() if handle is not None else self.host.listxattr(path))

    def getxattr(self, path: str, name: str, *, handle: FileHandle | None = None) -> bytes:
        self._see(path)
        name = identity.host_xattr_name(name)
        return handle.getxattr(name) if handle is not None else self.host.getxattr(path, name)

    def statfs(self) -> StatFS:
        return self.host.statfs()

    def open(self, path: str, flags: int, *, cred: Cred | None = None) -> FileHandle:
        """Open a regular file; ``flags`` are Linux ``O_*`` bits. ``O_TRUNC`` is a mutation
        (by an unprivileged ``cred`` it clears set-id bits, as a truncate does)."""
        self._see(path, above_ok=False)
        self._refuse_device(path)
        acc = flags & os.O_ACCMODE
        if acc not in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):
            raise OSError(errno.EINVAL, "invalid access mode", path)
        keep = acc | (flags & (os.O_APPEND | os.O_TRUNC))
        if keep & (os.O_TRUNC | os.O_APPEND) or acc != os.O_RDONLY:
            self._writable(path)
            handle = self._disarmed(self.fs.open(path, keep), path)
            if keep & os.O_TRUNC:
                self._killed_on_write(handle, path, cred)
            return handle
        return self.fs.open(path, keep)

    # ------------------------------------------------------------------ mutations

    def _writable(self, path: str = "") -> None:
        self._see(path, above_ok=False)
        if self.read_only:
            raise OSError(errno.EROFS, "read-only export", path)

    def create(self, path: str, mode: int, flags: int, *, cred: Cred | None = None,
               gid: int | None = None) -> tuple[FileHandle, bool]:
        """``open(O_CREAT)``: create (or, without ``O_EXCL``, open) a regular file.

        Returns the handle and whether a new file was made. The mode is applied as given
        (the client applied its umask). A new file belongs to ``cred`` (its uid, and ``gid``
        if given, the group the client chose) in the guest's view."""
        self._writable(path)
        acc = flags & os.O_ACCMODE
        try:  # the handle comes from the creation itself: no second lookup a racer could redirect
            handle = self.fs.create_handle(path, identity.host_mode(mode), acc | (flags & os.O_APPEND))
        except FileExistsError:
            if flags & os.O_EXCL:
                raise
            self._refuse_device(path)
            keep = acc | (flags & (os.O_APPEND | os.O_TRUNC))
            handle = self.fs.open(path, keep)
            writes = acc != os.O_RDONLY or keep & (os.O_APPEND | os.O_TRUNC)
            if writes:
                handle = self._disarmed(handle, path)
                if keep & os.O_TRUNC:
                    self._killed_on_write(handle, path, cred)
            return handle, False
        try:
            self._keep_new_mode(path, mode, handle)
            self._keep_new_owner(path, handle, cred, gid)
        except BaseException:
            handle.close()
            raise
        return handle, True

    def write(self, handle: FileHandle, path: str, offset: int, data: bytes, *, cred: Cred | None = None) -> int:
        """Write through ``handle``; by an unprivileged ``cred`` it first clears the set-id
        bits a write clears (:func:`identity.privileges_on_write`), as Linux does."""
        self._writable(path)
        self._killed_on_write(handle, path, cred)
        return self.fs.pwrite(handle, path, offset, data)

    def drop_capability(self, handle: FileHandle, path: str) -> None:
        """Before a write through ``handle``: the file's kept ``security.capability`` (mapped
        into ``user.``, :func:`identity.host_xattr_name`) is removed, undo-tracked, as Linux
        removes a file's capabilities on every write, whoever writes. For a client whose kernel
        leaves that to the server (FUSE's ``HANDLE_KILLPRIV_V2``); one ``fgetxattr`` when the
        file has none."""
        name = identity.host_xattr_name(CAPABILITY_XATTR)
        try:
            handle.getxattr(name)
        except OSError:
            return  # none (ENODATA), or no xattrs here: nothing to drop
        self._writable(path)
        self.fs.fremovexattr(handle, path, name)

    def fallocate(self, handle: FileHandle, path: str, offset: int, length: int, mode: int = 0, *,
                  cred: Cred | None = None) -> None:
        """``fallocate(2)`` through ``handle`` (open for writing): modes 0, ``KEEP_SIZE``,
        ``PUNCH_HOLE|KEEP_SIZE``, ``ZERO_RANGE[|KEEP_SIZE]``, each undo-tracked with a full
        preimage; any other (``COLLAPSE_RANGE``, ``INSERT_RANGE``, ``UNSHARE_RANGE``, …) is
        ``EOPNOTSUPP`` before anything is touched. By an unprivileged ``cred`` it clears set-id
        bits first, as a write does (Linux's ``file_modified``)."""
        self._writable(path)
        if offset < 0 or length <= 0:  # checked first, as fallocate(2) does
            raise OSError(errno.EINVAL, "invalid fallocate range", path)
        if mode not in FALLOCATE_MODES:
            raise OSError(errno.EOPNOTSUPP, f"fallocate mode {mode:#x} is not served", path)
        self._killed_on_write(handle, path, cred)
        self.fs.ffallocate(handle, path, offset, length, mode)

    def copy_file_range(self, src: FileHandle, src_path: str, dst: FileHandle, dst_path: str, src_offset: int,
                        dst_offset: int, length: int, *, cred: Cred | None = None) -> int:
        """``copy_file_range(2)`` from ``src`` (open for reading; at ``src_path``) into ``dst``
        (open for writing; at ``dst_path``): at most :data:`COPY_FILE_RANGE_BYTES_MAX` bytes
        per call, clamped to the source's end; the count copied. The destination is
        undo-tracked (a full preimage) and, by an unprivileged ``cred``, loses its set-id bits
        as on a write."""
        self._see(src_path, above_ok=False)
        self._writable(dst_path)
        self._killed_on_write(dst, dst_path, cred)
        return self.fs.fcopy_file_range(src, dst, dst_path, src_offset, dst_offset,
                                        min(length, COPY_FILE_RANGE_BYTES_MAX))

    def lseek(self, handle: FileHandle, path: str, offset: int, whence: int) -> int:
        """``SEEK_DATA``/``SEEK_HOLE`` on ``handle``'s file (:meth:`FileHandle.lseek`: the
        host's answer; ``ENXIO`` at or past EOF). A read: never journalled."""
        self._see(path, above_ok=False)
        return handle.lseek(offset, whence)

    def exchange(self, a: str, b: str) -> None:
        """``renameat2(RENAME_EXCHANGE)``: ``a`` and ``b`` (both existing, any kinds) swap
        names atomically on the host, undo-tracked as one ``exchanged`` intent."""
        self._writable(a)
        self._writable(b)
        self.fs.exchange(a, b)

    def fsync(self, handle: FileHandle | None, datasync: bool = False) -> None:
        if handle is not None:
            handle.fsync(datasync)

    def setattr(self, path: str, *, handle: FileHandle | None = None, mode: int | None = None,
                size: int | None = None, atime_ns: int | None = None, mtime_ns: int | None = None,
                chown: bool = False, uid: int | None = None, gid: int | None = None,
                cred: Cred | None = None) -> None:
        """Apply what is given: owner, mode, size, times.

        With ``handle`` (the file a client's fid has open) every change goes to that
        handle's inode — after an unlink or a rename and a new file at ``path``, never to
        the new file; ``path`` is only where the undo hooks look. The one exception is a
        size change through a handle not open for writing while ``path`` still names its
        file: ``truncate(path)`` of a file the client happens to have open read-only.

        ``atime_ns``/``mtime_ns`` of ``-1`` mean "now" (else exact nanoseconds). ``uid``/``gid``
        (``-1``: unchanged) are mapped, never applied (:meth:`_chown`); ``chown`` without them is
        accepted and does nothing. A size change by an unprivileged ``cred`` clears set-id bits."""
        owner = not (identity.unchanged_id(uid) and identity.unchanged_id(gid))
        if mode is None and size is None and atime_ns is None and mtime_ns is None and not owner:
            return
        self._writable(path)
        if owner:
            self._chown(path, handle, uid, gid, _view(cred), keep_mode=mode is None)
        if mode is not None:
            mode = self._keep_mode(path, mode & 0o7777, handle)
            if handle is not None:
                self.fs.fchmod(handle, path, mode)
            else:
                self.fs.chmod(path, mode)
        if size is not None:
            if handle is not None and (handle.flags & os.O_ACCMODE != os.O_RDONLY
                                       or not names_inode(self.host, path, handle)):
                self.fs.ftruncate(handle, path, size)  # a read-only handle: EINVAL, as ftruncate(2)
            else:
                self.fs.truncate(path, size)
            self._killed_on_write(handle, path, cred)
        if atime_ns is not None or mtime_ns is not None:
            now = time.time_ns()
            if mtime_ns is None:  # only the atime changes: the mtime stays as it is now
                m = (handle.fstat() if handle is not None else self.host.getattr(path)).mtime_ns
            else:
                m = now if mtime_ns == -1 else mtime_ns
            a = None if atime_ns is None else (now if atime_ns == -1 else atime_ns)
            if handle is not None:
                self.fs.futime(handle, path, m, a)
            else:
                self.fs.utime(path, m, a)

    def mkdir(self, path: str, mode: int, *, cred: Cred | None = None, gid: int | None = None) -> None:
        self._writable(path)
        self.fs.mkdir(path, identity.host_mode(mode))
        self._keep_new_mode(path, mode)
        self._keep_new_owner(path, None, cred, gid)

    def symlink(self, target: str, path: str, *, cred: Cred | None = None, gid: int | None = None) -> None:
        """A new symlink belongs to ``cred`` in the guest's view, as a new file does — kept in
        :data:`identity.SPECIAL_OWNER_XATTR` where the host allows it (else the host's owner)."""
        self._writable(path)
        self.fs.symlink(target, path)
        self._keep_new_owner(path, None, cred, gid)

    def link(self, existing: str, new: str) -> None:
        self._see(existing, above_ok=False)
        self._writable(new)
        self.fs.link(existing, new)

    def mknod(self, path: str, mode: int, fmt: int, rdev: int = 0, *, cred=None, gid: int | None = None) -> None:
        """``mknod(2)``: ``fmt`` is the ``S_IFMT`` type, ``mode`` the permission bits (the
        client applied its umask), ``rdev`` a device's number.

        A fifo or a unix-socket node is made on the host (:meth:`HostFS.mknod`, never opened),
        never with set-id bits (the guest's are kept in ``trusted.sandbox.mode`` where the
        host allows it, else dropped: no user xattrs on a fifo); a
        character or block device is emulated (:mod:`~sandbox.mounts.devices`); any other
        type is ``EINVAL``, as ``mknod(2)`` says — a regular file too (``creat`` makes those).
        """
        self._writable(path)
        if not isinstance(rdev, int) or not 0 <= rdev < 1 << 64:
            raise OSError(errno.EINVAL, "invalid device number", path)
        fmt &= 0o170000
        if fmt in MKNOD_FMTS:
            self.fs.mknod(path, identity.host_mode(mode), fmt)
            self._keep_new_mode(path, mode, name=identity.SPECIAL_MODE_XATTR)
            self._keep_new_owner(path, None, cred, gid)
        elif devices.is_device(fmt):
            self._make_device(path, mode, fmt, rdev, cred=cred, gid=gid)
        else:
            raise OSError(errno.EINVAL, f"mknod of file type {fmt:#o}", path)

    def rename(self, src: str, dst: str) -> None:
        self._writable(src)
        self._writable(dst)
        self.fs.rename(src, dst)

    def unlink(self, path: str, *, reader: FileHandle | None = None) -> None:
        """Remove the name ``path``; ``reader``: a descriptor that may be on the file there
        (:meth:`InterceptedFS.unlink`)."""
        self._writable(path)
        if reader is not None and isinstance(self.fs, InterceptedFS):
            self.fs.unlink(path, reader)
        else:
            self.fs.unlink(path)

    def rmdir(self, path: str) -> None:
        self._writable(path)
        self.fs.rmdir(path)

    def setxattr(self, path: str, name: str, value: bytes, flags: int = 0, *, handle: FileHandle | None = None) -> None:
        """Set xattr ``name`` — of ``handle``'s inode if given (see :meth:`setattr`)."""
        self._writable(path)
        self._refuse_user_xattr(path, name, handle)
        self._refuse_unstorable_xattr(path, name, handle)
        name = identity.host_xattr_name(name)
        if len(value) > XATTR_SIZE_MAX:
            raise OSError(errno.E2BIG, "xattr value larger than 64 KiB", path)
        if flags & (XATTR_CREATE | XATTR_REPLACE):
            present = name in (handle.listxattr() if handle is not None else self.host.listxattr(path))
            if flags & XATTR_CREATE and present:
                raise OSError(errno.EEXIST, f"xattr {name} exists", path)
            if flags & XATTR_REPLACE and not present:
                raise OSError(errno.ENODATA, f"no xattr {name}", path)
        if handle is not None:
            self.fs.fsetxattr(handle, path, name, value)
        else:
            self.fs.setxattr(path, name, value)

    def removexattr(self, path: str, name: str, *, handle: FileHandle | None = None) -> None:
        """Remove xattr ``name`` — of ``handle``'s inode if given (see :meth:`setattr`)."""
        self._writable(path)
        self._refuse_user_xattr(path, name, handle)
        host_name = identity.host_xattr_name(name)
        try:
            if handle is not None:
                self.fs.fremovexattr(handle, path, host_name)
            else:
                self.fs.removexattr(path, host_name)
        except OSError as e:
            if e.errno != errno.ENODATA or not identity.absent_removal_ok(name):
                raise

    def _refuse_user_xattr(self, path: str, name: str, handle: FileHandle | None) -> None:
        """``EPERM`` for a write of a guest ``user.*`` xattr on anything the guest does not see
        as a regular file or directory, present or not (the kernel's ``xattr_permission``). The
        host answers so for symlinks, fifos and sockets; this covers an emulated device too (a
        regular placeholder on the host). An open handle is always a regular file's."""
        if handle is not None or not name.startswith(identity.USER_NAMESPACE):
            return
        if self._as_device(path, self.host.getattr(path)).kind not in (REG, DIR):
            raise OSError(errno.EPERM, "user xattrs belong to regular files and directories only", path)

    def _refuse_unstorable_xattr(self, path: str, name: str, handle: FileHandle | None) -> None:
        """``EOPNOTSUPP`` for a guest xattr outside ``user.`` (a POSIX ACL, a security label…) on a
        fifo or socket: it would be mapped into a host ``user.`` xattr, which Linux keeps only on
        regular files and directories. ``EOPNOTSUPP`` is what tools expect from a filesystem
        without such xattrs — ``cp -a``/``tar`` then fall back to ``chmod`` — where the host's
        ``EPERM`` would fail them. (A symlink keeps its documented ``EPERM``.)"""
        if handle is not None or name.startswith(identity.USER_NAMESPACE):
            return
        if self._as_device(path, self.host.getattr(path)).kind not in (REG, DIR, LNK):
            raise OSError(errno.EOPNOTSUPP, "this host keeps no xattrs outside user. on fifos and sockets",
                          path)

    # ------------------------------------------------------------------ emulated devices (devices.py)

    def _make_device(self, path: str, mode: int, fmt: int, rdev: int, *, cred: Cred | None = None,
                     gid: int | None = None) -> None:
        """An emulated device: a new empty regular file (never a device on the host), its
        :data:`~sandbox.mounts.devices.DEV_XATTR` set through the creation's own handle.
        A host that cannot keep user xattrs gets no half-made device: the placeholder is
        removed (undo-tracked) and the mknod is ``EPERM``."""
        try:
            value = devices.encode_dev(fmt, rdev)
        except (ValueError, OverflowError):
            raise OSError(errno.EINVAL, "invalid device number", path) from None
        handle = self.fs.create_handle(path, identity.host_mode(mode), os.O_RDONLY)
        try:
            try:
                self.fs.fsetxattr(handle, path, devices.DEV_XATTR, value)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
                    raise
                if names_inode(self.host, path, handle):
                    self.fs.unlink(path)
                raise OSError(errno.EPERM, "device nodes are emulated with a user xattr, and this host "
                              "filesystem has none", path) from None
            self._keep_new_mode(path, mode, handle)
            self._keep_new_owner(path, handle, cred, gid)  # a placeholder is a regular file: it can keep one
        finally:
            handle.close()

    def _device_value(self, path: str, handle=None) -> bytes | None:
        try:
            return handle.getxattr(devices.DEV_XATTR) if handle is not None else self.host.getxattr(path, devices.DEV_XATTR)
        except OSError:  # ENODATA (the usual case), ENOTSUP, gone meanwhile: not a device
            return None

    def _as_device(self, path: str, a: Attr, names: list[str] | None = None, handle=None) -> Attr:
        """``a`` as the guest sees it: an emulated device if it is a placeholder. Only an
        empty regular file can be one (others cost no xattr read); with its xattr ``names``
        read along with ``a`` (the same resolution), only one that has the device's xattr
        (read through ``handle``, the file ``a`` describes, if given)."""
        if a.kind != REG or a.size != 0 or (names is not None and devices.DEV_XATTR not in names):
            return a
        return devices.emulated_attr(a, self._device_value(path, handle))

    def _refuse_device(self, path: str) -> None:
        """``EPERM`` for an emulated device: never opened, like every special file."""
        if self._as_device(path, self.host.getattr(path)).kind != REG:
            raise OSError(errno.EPERM, "special files are never opened on the host", path)

    # ------------------------------------------------------------------ identity (identity.py)

    def _reserved(self, path: str, handle: FileHandle | None, names: list[str] | None = None,
                  regular_or_dir: bool = True) -> dict[str, bytes]:
        """The mappings (:data:`identity.MODE_XATTR`, :data:`identity.OWNER_XATTR`) of
        ``handle``'s inode, or else of ``path``: one ``listxattr`` (unless its ``names`` are
        given), a ``getxattr`` per one present. Unreadable (no user xattrs, gone meanwhile): none.
        For a symlink, fifo or socket they are read from :data:`identity.SPECIAL_MODE_XATTR`
        and :data:`identity.SPECIAL_OWNER_XATTR` (returned under the same keys)."""
        out = {}
        wanted = ((identity.MODE_XATTR, identity.MODE_XATTR), (identity.OWNER_XATTR, identity.OWNER_XATTR)) \
            if regular_or_dir else ((identity.MODE_XATTR, identity.SPECIAL_MODE_XATTR),
                                    (identity.OWNER_XATTR, identity.SPECIAL_OWNER_XATTR))
        try:
            if names is None:
                names = handle.listxattr() if handle is not None else self.host.listxattr(path)
            for key, name in wanted:
                if name in names:
                    out[key] = handle.getxattr(name) if handle is not None else self.host.getxattr(path, name)
        except OSError:
            pass
        return out

    def _guest_attr(self, path: str, a: Attr, handle: FileHandle | None = None, view=None,
                    names: list[str] | None = None) -> Attr:
        """``a`` with the mode and owner the guest set, kept, not applied; owners without a
        kept one as ``view`` (:class:`identity.OwnerMap`) presents them.

        A symlink, fifo or socket carries them in ``trusted.`` xattrs (the kernel allows user
        xattrs on regular files and directories only).
        With ``handle``, ``a`` is its inode's and so are the mappings read — wherever ``path``
        points now."""
        kept = self._reserved(path, handle, names, a.kind in (REG, DIR))
        mode = identity.guest_mode(a.mode, kept.get(identity.MODE_XATTR)) if kept else a.mode
        uid, gid = identity.guest_owner(a.uid, a.gid, kept.get(identity.OWNER_XATTR), view)
        if (mode, uid, gid) == (a.mode, a.uid, a.gid):
            return a
        return dataclasses.replace(a, mode=mode, uid=uid, gid=gid)

    def _set_mapping(self, path: str, handle: FileHandle | None, value: bytes | None,
                     name: str = identity.MODE_XATTR) -> None:
        """Keep ``value`` as the mapping ``name`` (None: drop it), through the undo-tracked fs,
        on ``handle``'s inode if given."""
        names = handle.listxattr() if handle is not None else self.host.listxattr(path)
        if value is None:
            if name not in names:
                return
            if handle is not None:
                self.fs.fremovexattr(handle, path, name)
            else:
                self.fs.removexattr(path, name)
        elif handle is not None:
            self.fs.fsetxattr(handle, path, name, value)
        else:
            self.fs.setxattr(path, name, value)

    def _keep_mode(self, path: str, mode: int, handle: FileHandle | None = None) -> int:
        """A guest's chmod: keep (or drop) the mapping of ``mode``; return the mode to apply.

        Refused with ``EPERM`` before anything changes if a set-id bit must be kept and the
        host cannot store user xattrs there (the bit is never applied instead)."""
        cur = handle.fstat() if handle is not None else self.host.lstat(path)
        if cur.kind == LNK:
            return mode  # the host refuses (EOPNOTSUPP): there is nothing to keep
        value = identity.mode_mapping(mode, cur.mode)
        if cur.kind not in (REG, DIR):  # a fifo or socket: in trusted.*, where the host allows it
            try:
                self._set_mapping(path, handle, value, identity.SPECIAL_MODE_XATTR)
            except OSError as e:  # no CAP_SYS_ADMIN: its set-id bits are dropped
                if value is None or e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
                    raise
            return identity.host_mode(mode, cur.mode)
        try:
            self._set_mapping(path, handle, value)
        except OSError as e:
            if value is None or e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
                raise
            raise OSError(errno.EPERM, "set-id bits from the guest are never applied, and this host "
                          "filesystem cannot keep them (no user xattrs)", path) from None
        return identity.host_mode(mode, cur.mode)

    def _disarmed(self, handle: FileHandle, path: str) -> FileHandle:
        """``handle``, opened for writing, once its file has no set-id bit a write by the
        guest could abuse (:func:`identity.privileges_on_write`): those are cleared on the
        host and kept for the guest, who sees its file unchanged. Both go through the handle
        (its inode, whatever the name points at by now). On any error the handle is closed
        (a held operation is retried from the start)."""
        try:
            a = handle.fstat()
            kill = identity.privileges_on_write(a.mode) if a.kind == REG else 0
            if kill:
                seen = self._guest_attr(path, a, handle).mode
                try:
                    self.fs.fsetxattr(handle, path, identity.MODE_XATTR, identity.encode_mode(seen))
                except OSError as e:  # nowhere to keep them: cleared all the same, as the kernel would
                    if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
                        raise
                self.fs.fchmod(handle, path, a.mode & ~kill)
        except BaseException:
            handle.close()
            raise
        return handle

    def _keep_new_mode(self, path: str, mode: int, handle: FileHandle | None = None,
                       name: str = identity.MODE_XATTR) -> None:
        """After a create (through its ``handle``) or a mkdir: keep the set-id bits of
        ``mode`` the host was not given.

        Where the host cannot keep them (no user xattrs) they are dropped, as the kernel
        itself silently drops S_ISGID on create for a caller outside the group: the object
        exists, and failing the create now would leave it behind."""
        value = identity.mode_mapping(mode)
        if value is not None:
            try:
                if handle is not None:
                    self.fs.fsetxattr(handle, path, name, value)
                else:
                    self.fs.setxattr(path, name, value)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
                    raise

    # ------------------------------------------------------------------ owners (identity.py "Owners")

    def _keep_new_owner(self, path: str, handle: FileHandle | None, cred: Cred | None, gid: int | None) -> None:
        """After a create (through its ``handle``) or a mkdir by ``cred``: keep the owner the
        guest gave it (``cred``'s uid, ``gid`` or else ``cred``'s) where it differs from what
        ``cred`` sees anyway. Nowhere to keep it (no user xattrs; for a symlink, fifo or socket
        no ``trusted.`` ones, as without ``CAP_SYS_ADMIN``): the host's owner shows, as the
        create cannot be undone now."""
        if cred is None:
            return
        a = handle.fstat() if handle is not None else self.host.lstat(path)
        owner = (cred.uid, cred.gid if identity.unchanged_id(gid) else gid)
        value = identity.owner_mapping(owner, a.uid, a.gid, cred.view)
        if value is None:  # the owner it shows anyway: a new object has no mapping to drop
            return
        try:
            self._set_mapping(path, handle, value, identity.owner_xattr(a.kind in (REG, DIR)))
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
                raise

    def _chown(self, path: str, handle: FileHandle | None, uid: int | None, gid: int | None, view,
               keep_mode: bool) -> None:
        """A client's chown: the new owner is kept in :data:`identity.OWNER_XATTR` (removed when
        it is the presented one again), never applied to the host file. A non-directory loses
        the set-id bits chown clears (unless ``keep_mode`` is False: the request sets the mode
        itself). Symlinks, fifos and sockets keep it in :data:`identity.SPECIAL_OWNER_XATTR`;
        where the host refuses that (no ``CAP_SYS_ADMIN``, no ``trusted.`` xattrs) the chown is
        accepted and not kept. Where the host cannot store user xattrs on a regular file or
        directory: ``EPERM`` before anything changes."""
        a = handle.fstat() if handle is not None else self.host.getattr(path)
        special = a.kind not in (REG, DIR)
        seen = self._guest_attr(path, a, handle, view)
        value = identity.owner_mapping(identity.chowned((seen.uid, seen.gid), uid, gid), a.uid, a.gid, view)
        try:
            self._set_mapping(path, handle, value, identity.owner_xattr(not special))
        except OSError as e:
            if value is None or e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
                raise
            if special:
                return  # nowhere to keep it: accepted and not kept (docs/identity.md)
            raise OSError(errno.EPERM, "owners from the guest are never applied, and this host filesystem "
                          "cannot keep them (no user xattrs)", path) from None
        kill = identity.privileges_on_chown(seen.mode) if keep_mode and a.kind not in (DIR, LNK) else 0
        if kill:
            self._set_guest_mode(path, handle, seen.mode & ~kill)

    def _set_guest_mode(self, path: str, handle: FileHandle | None, mode: int) -> None:
        """A chmod the server makes for the guest (set-id bits a write or chown clears)."""
        mode = self._keep_mode(path, mode, handle)
        if handle is not None:
            self.fs.fchmod(handle, path, mode)
        else:
            self.fs.chmod(path, mode)

    def _killed_on_write(self, handle: FileHandle | None, path: str, cred: Cred | None) -> None:
        """Before a write or truncate by ``cred``: without ``CAP_FSETID`` (uid != 0) the guest's
        set-uid bit, and set-gid where group-executable, are cleared (Linux's
        ``file_remove_privs``; the host kernel never does it for a root server). The API
        (``cred`` None, the folder owner's own tool) leaves them, as before."""
        if cred is None or cred.privileged:
            return
        a = handle.fstat() if handle is not None else self.host.getattr(path)
        if a.kind != REG:
            return
        try:  # only the kept mode (one getxattr, ENODATA as a rule): this runs before every such write
            value = handle.getxattr(identity.MODE_XATTR) if handle is not None else \
                self.host.getxattr(path, identity.MODE_XATTR)
        except OSError:
            value = None
        seen = identity.guest_mode(a.mode, value)
        kill = identity.privileges_on_write(seen)
        if kill:
            self._set_guest_mode(path, handle, seen & ~kill)


#: the xattr holding a file's capabilities (kept mapped into ``user.``, never honoured)
CAPABILITY_XATTR = "security.capability"


class _EntryOf:
    """The xattr reads of the entry ``name`` of a held directory (``FileHandle.getxattr_at``),
    in the shape :meth:`Provider._reserved` and :meth:`Provider._as_device` read a handle's."""

    __slots__ = ("directory", "name")

    def __init__(self, directory: FileHandle, name: str):
        self.directory, self.name = directory, name

    def listxattr(self) -> list[str]:
        return self.directory.getattr_xattr_names_at(self.name)[1]

    def getxattr(self, xattr: str) -> bytes:
        return self.directory.getxattr_at(self.name, xattr)


def _view(cred: Cred | None):
    return cred.view if cred is not None else None
