"""POSIX advisory byte-range locks for Tlock/Tgetlock, kept by the server per export.

Locks are never taken on the host (a guest must not be able to block a host process,
and host locks would be per server process anyway). They are arbitrated here between
all clients of one export, with ``fcntl(F_SETLK)`` semantics:

* an owner is ``(connection, client_id, proc_id)``; a file is its qid path (inode);
* read locks share, a write lock excludes every other owner's overlapping lock;
  an owner's own locks never conflict with it and are replaced/split by a new request
  (``F_UNLCK`` splits too);
* a conflicting request answers ``BLOCKED`` and changes nothing — the Linux client
  retries blocking requests itself, so the server never waits;
* ``length == 0`` means "to the end of file, however large it grows";
* a connection's locks vanish with it. The table is bounded: ``locks_max`` ranges per
  export (one more → ``ENOLCK``).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from ..limits import LOCKS_PER_EXPORT_MAX

RDLCK, WRLCK, UNLCK = 0, 1, 2
INF = 1 << 64
LOCKS_MAX = LOCKS_PER_EXPORT_MAX  # ServerLimits.locks_per_export_max


@dataclass(frozen=True, slots=True)
class Range:
    owner: tuple
    type: int
    start: int
    end: int  # exclusive; INF for "to EOF"


def _end(start: int, length: int) -> int:
    return INF if length == 0 else min(INF, start + length)


class LockTable:
    def __init__(self, locks_max: int = LOCKS_MAX):
        self.locks_max = locks_max
        self._files: dict[int, list[Range]] = {}
        self._count = 0

    def conflict(self, file: int, owner: tuple, type: int, start: int, length: int) -> Range | None:
        """The first other owner's lock that would prevent ``type`` on the range, if any."""
        if type == UNLCK:
            return None
        end = _end(start, length)
        for r in self._files.get(file, ()):
            if r.owner != owner and r.start < end and start < r.end and (type == WRLCK or r.type == WRLCK):
                return r
        return None

    def lock(self, file: int, owner: tuple, type: int, start: int, length: int) -> bool:
        """Apply (True) or refuse because of a conflict (False)."""
        if type not in (RDLCK, WRLCK, UNLCK):
            raise OSError(errno.EINVAL, f"invalid lock type {type}")
        if self.conflict(file, owner, type, start, length) is not None:
            return False
        end = _end(start, length)
        old = self._files.get(file, [])
        new: list[Range] = []
        for r in old:
            if r.owner != owner or r.end <= start or end <= r.start:
                new.append(r)
                continue
            if r.start < start:
                new.append(Range(owner, r.type, r.start, start))
            if end < r.end:
                new.append(Range(owner, r.type, end, r.end))
        if type != UNLCK:
            new.append(Range(owner, type, start, end))
        count = self._count - len(old) + len(new)
        if count > self.locks_max:
            raise OSError(errno.ENOLCK, f"more than {self.locks_max} locks on this export")
        self._count = count
        if new:
            self._files[file] = new
        else:
            self._files.pop(file, None)
        return True

    def drop_owner(self, match) -> None:
        """Remove every lock whose owner satisfies ``match(owner)`` (a connection closed)."""
        for file in list(self._files):
            old = self._files[file]
            keep = [r for r in old if not match(r.owner)]
            self._count -= len(old) - len(keep)
            if keep:
                self._files[file] = keep
            else:
                del self._files[file]
