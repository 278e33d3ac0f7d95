"""The unix sockets our file servers listen on (9P, virtio-fs's vhost-user).

Invariant: a server's listening socket is 0600 (only our user's QEMU or client may connect);
a stale socket left at its path by an earlier run is replaced; anything else there (a file,
a directory, a symlink) is never removed — ``FileExistsError``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Iterator


@contextlib.contextmanager
def private_socket_path(path: str) -> Iterator[None]:
    """Make ``path`` ready for a socket and bind it inside this context: the umask (process
    wide, restored on exit) makes what is bound 0600."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(errno.EEXIST, f"{path} exists and is not a socket")
        os.unlink(path)  # a stale socket of an earlier run
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)
