"""In-memory trees (seed 000 ``MemoryFS``/``HostMount``): files a host injects into the guest.

Built from a flat ``{relative_path: bytes | str}`` dict; intermediate directories are
created. Served through a :class:`~sandbox.mounts.provider.Provider` like any other
export, so the protocol servers need nothing special for them.

Invariants: read-only unless ``writable=True``, and then bounded (what the guest adds is at
most :data:`WRITABLE_TREE_SPARE_BYTES`, ``ENOSPC`` beyond); never undo-tracked (writes to a writable
tree change only the in-memory copy, and are lost with it); the tree is a snapshot —
later changes to the dict are not seen. Paths are validated exactly as guest paths are
(no ``..``, not absolute, components ≤ 255 bytes); a path that is both a file and a
directory is a ``ValueError``.
"""

from __future__ import annotations

import time

from ..core.intercepted_fs import InterceptedFS
from ..hostfs import PathError, normalize, parent_of
from ..hostfs.memory import SimClock, MemoryHostFS
from .provider import Provider

FILE_MODE = 0o644
DIR_MODE = 0o755
#: a writable tree holds at most this many bytes more than the files it was made from (file
#: bytes, names, inodes, xattrs, symlink targets: :meth:`MemoryHostFS.limit_bytes`); beyond
#: it a write, truncate, create or setxattr is ``ENOSPC`` — the guest writes into our memory
WRITABLE_TREE_SPARE_BYTES = 64 << 20


def memory_hostfs(files: dict[str, bytes | str], name: str = "memory") -> MemoryHostFS:
    """A :class:`MemoryHostFS` (the in-memory host filesystem) holding ``files``."""
    host = MemoryHostFS(name, clock=SimClock(time.time_ns()))
    fs = InterceptedFS(host, None)  # pass-through: the same mkdir -p as everywhere
    for raw in sorted(files):
        data = files[raw]
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"{raw!r}: contents must be bytes or str, not {type(data).__name__}")
        try:
            path = normalize(raw)
        except PathError as e:
            raise ValueError(f"invalid mount path {raw!r}: {e.strerror}") from None
        if not path:
            raise ValueError("a file cannot be the mount root itself")
        try:
            fs.makedirs(parent_of(path), DIR_MODE)
        except NotADirectoryError as e:
            raise ValueError(f"{raw!r} needs {e.filename!r} to be a directory, but it is a file") from None
        try:
            host.create(path, FILE_MODE)
        except FileExistsError:
            raise ValueError(f"{raw!r} is given twice or is also a directory") from None
        host.write_all(path, 0, bytes(data))
    return host


def memory_tree(files: dict[str, bytes | str], *, writable: bool = False, label: str = "memory") -> Provider:
    """A provider over an in-memory snapshot of ``files`` (read-only by default; writable,
    within :data:`WRITABLE_TREE_SPARE_BYTES` more)."""
    host = memory_hostfs(files, label)
    if writable:
        host.limit_bytes(WRITABLE_TREE_SPARE_BYTES)
    return Provider(host, None, read_only=not writable, label=label)
