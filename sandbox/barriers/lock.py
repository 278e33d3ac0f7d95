"""The ``lock`` policy for host-side edits: while a session runs, edits from the host fail.

:func:`lock_folder` bind-mounts the working folder over itself and remounts that bind
read-only (``mount(2)`` through libc: ``MS_BIND``, then ``MS_REMOUNT | MS_BIND |
MS_RDONLY``, keeping the ``nosuid``/``nodev``/``noexec``/atime flags the folder's mount
already had, which a remount must not drop).

What it does and does not do:

* a process that opened the folder's directory fd *before* the lock — the sandbox's own
  :class:`~sandbox.hostfs.real.RealHostFS`, opened first — still reaches the original,
  read-write mount through that fd (every access of RealHostFS is relative to it), so the
  sandbox keeps writing;
* every path lookup by anyone else (``open("P/f", "w")``, ``rm P/x``, an editor's save)
  goes through the read-only bind mount and fails with ``EROFS``; so do lookups by the
  sandbox through new paths. Reads work as before;
* a process whose current directory, or an fd opened earlier, is inside the folder keeps
  writing through the original mount (the lock is about path lookups, not inodes);
* the bind is not recursive: a filesystem mounted *below* the folder is hidden from other
  processes while the lock holds (they see the read-only mount-point directory);
* it is a mount: it needs root (``CAP_SYS_ADMIN``) — :class:`PermissionError` otherwise —
  root can unmount it at any time, and a shared mount propagates it to peer mount
  namespaces like any other mount;
* after a crash the bind mount stays until ``umount PATH``: :func:`is_locked` tells a
  restart whether a stale lock is there and :func:`unlock_folder` removes it.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Callable

__all__ = ["lock_folder", "unlock_folder", "is_locked"]

_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOEXEC = 0x8
_MS_REMOUNT = 0x20
_MS_NOATIME = 0x400
_MS_NODIRATIME = 0x800
_MS_BIND = 0x1000
_MS_RELATIME = 0x200000
_MS_NOSYMFOLLOW = 0x100
_MNT_DETACH = 0x2
_ST_NOSYMFOLLOW = 0x2000

#: statvfs f_flag bit -> the mount flag a remount must repeat to keep it
_KEEP = {os.ST_NOSUID: _MS_NOSUID, os.ST_NODEV: _MS_NODEV, os.ST_NOEXEC: _MS_NOEXEC, os.ST_NOATIME: _MS_NOATIME,
         os.ST_NODIRATIME: _MS_NODIRATIME, os.ST_RELATIME: _MS_RELATIME, _ST_NOSYMFOLLOW: _MS_NOSYMFOLLOW}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.mount.restype = ctypes.c_int
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.umount2.restype = ctypes.c_int


def _errno_error(what: str, path: str) -> OSError:
    e = ctypes.get_errno()
    if e in (errno.EPERM, errno.EACCES):
        return PermissionError(e, f"{what} needs root (CAP_SYS_ADMIN) to lock the folder against host-side "
                                  f"edits: {os.strerror(e)}", path)
    return OSError(e, f"{what}: {os.strerror(e)}", path)


def _mount(source: str | None, target: str, flags: int, what: str) -> None:
    src = os.fsencode(source) if source is not None else None
    if _libc.mount(src, os.fsencode(target), None, flags, None) != 0:
        raise _errno_error(what, target)


def _umount(path: str) -> None:
    """Unmount the top mount at ``path``; lazily if it is busy."""
    if _libc.umount2(os.fsencode(path), 0) == 0:
        return
    if ctypes.get_errno() == errno.EBUSY and _libc.umount2(os.fsencode(path), _MNT_DETACH) == 0:
        return
    raise _errno_error("umount", path)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mountinfo() -> list[dict]:
    mounts = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 6:
                continue
            mounts.append({"id": int(fields[0]), "parent": int(fields[1]), "dev": fields[2],
                           "root": _unescape(fields[3]), "point": _unescape(fields[4]),
                           "opts": fields[5].split(",")})
    return mounts


def is_locked(path: str) -> bool:
    """True if the topmost mount exactly at ``path`` is a read-only bind of ``path`` onto
    itself (what :func:`lock_folder` makes): same device as the mount below it, and the
    same directory of that device."""
    real = os.path.realpath(path)
    mounts = _mountinfo()
    at = [m for m in mounts if m["point"] == real]
    if not at:
        return False
    top = at[-1]  # mountinfo lists mounts in the order they were stacked
    if "ro" not in top["opts"]:
        return False
    under = next((m for m in mounts if m["id"] == top["parent"]), None)
    if under is None or under["dev"] != top["dev"]:
        return False
    rel = os.path.relpath(real, under["point"])
    expect = os.path.normpath(os.path.join(under["root"], rel)) if rel != "." else under["root"]
    return expect == top["root"]


def unlock_folder(path: str) -> bool:
    """Remove a lock (e.g. a stale one left by a crash). False if ``path`` was not locked."""
    real = os.path.realpath(path)
    if not is_locked(real):
        return False
    _umount(real)
    return True


def lock_folder(path: str) -> Callable[[], None]:
    """Make ``path`` read-only to every path lookup (module doc); returns ``unlock()``.

    Open the folder's :class:`~sandbox.hostfs.real.RealHostFS` *before* calling this.
    ``unlock()`` unmounts the bind (lazily if it is busy); calling it again does nothing.
    Raises :class:`PermissionError` without ``CAP_SYS_ADMIN``, and ``OSError(EBUSY)`` if
    the folder is already locked (a stale lock: :func:`unlock_folder` first).
    """
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise NotADirectoryError(errno.ENOTDIR, "can only lock a directory", real)
    if is_locked(real):
        raise OSError(errno.EBUSY, "the folder is already locked read-only (a stale lock after a crash? "
                                   f"unlock it with 'umount {real}')", real)
    _mount(real, real, _MS_BIND, "bind mount of the folder onto itself")
    try:
        st = os.statvfs(real)
        keep = 0
        for bit, flag in _KEEP.items():
            if st.f_flag & bit:
                keep |= flag
        _mount(None, real, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | keep, "read-only remount of the folder's bind mount")
    except BaseException:
        try:
            _umount(real)
        except OSError:
            pass
        raise
    done = False

    def unlock() -> None:
        nonlocal done
        if done:
            return
        if is_locked(real):
            _umount(real)
        done = True

    return unlock
