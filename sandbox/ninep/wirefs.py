"""The simulation's filesystem client, over the wire: InterceptedFS's API spoken as 9P2000.L.

:class:`WireFS` has the method names :class:`~sandbox.core.intercepted_fs.InterceptedFS`
has, so :class:`sandbox_sim.client.SimClient` and the undo models drive a real 9P server over a
real unix socket with the same programs and the same invariants. Each call sends the
message sequence a Linux v9fs client sends for it (walk, lopen/lcreate, read/write,
clunk …). What 9P2000.L cannot express fails like it does in a guest: ``fallocate`` is
``EOPNOTSUPP``; ``copy_file_range`` is done with reads and writes, as the guest kernel
falls back to.

:func:`serve_workspace` starts a server on a workspace in a background thread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as _stat
import tempfile
from typing import Iterator

from ..core.tree_ops import TreeOps
from ..hostfs import absent_as_none, DIR, LNK, OTHER, REG, Stat, normalize, parent_of
from ..mounts import Provider
from . import messages as m
from .client import Client
from .server import NinePServer, ServerConfig, ServerThread

_KIND = {_stat.S_IFREG: REG, _stat.S_IFDIR: DIR, _stat.S_IFLNK: LNK}


def stat_of(r: m.Rgetattr) -> Stat:
    kind = _KIND.get(_stat.S_IFMT(r.mode), OTHER)
    return Stat(kind, _stat.S_IMODE(r.mode), r.size, r.mtime_sec * 10**9 + r.mtime_nsec,
                r.ctime_sec * 10**9 + r.ctime_nsec, r.qid.path, r.nlink, fmt=_stat.S_IFMT(r.mode))


class WireFS(TreeOps):
    """InterceptedFS's surface over a 9P client (paths relative to the attach root)."""

    def __init__(self, client: Client, host=None):
        self.c = client
        self.host = host  # for SimClient's tree listing (reads the host directly)
        self.root_fid, _qid = client.attach()
        self.decide = None

    # -- helpers --

    def _walk(self, path: str) -> int:
        """A new fid for ``path``. The guest kernel resolves a path one component at a time,
        so a file or a symlink in the middle is ``ENOTDIR``/``ELOOP`` there, not ``ENOENT``."""
        p = normalize(path)
        names = p.split("/") if p else []
        try:
            fid, _ = self.c.walk(self.root_fid, names)
            return fid
        except FileNotFoundError:
            for k in range(1, len(names)):
                try:
                    f, qids = self.c.walk(self.root_fid, names[:k])
                except FileNotFoundError:
                    break
                self.c.clunk(f)
                if qids[-1].type & m.QT_SYMLINK:
                    raise OSError(errno.ELOOP, "a symlink in the middle of the path", path) from None
                if not qids[-1].type & m.QT_DIR:
                    raise OSError(errno.ENOTDIR, "not a directory", path) from None
            raise

    @contextlib.contextmanager
    def _fid(self, path: str) -> Iterator[int]:
        fid = self._walk(path)
        try:
            yield fid
        finally:
            self.c.clunk(fid)

    def _parent(self, path: str) -> tuple[str, str]:
        p = normalize(path)
        if not p:
            raise OSError(errno.EBUSY, "the root itself", path)
        return parent_of(p), p.rsplit("/", 1)[-1]

    # -- reads --

    def lstat(self, path: str) -> Stat:
        with self._fid(path) as fid:
            return stat_of(self.c.getattr(fid))

    def exists(self, path: str) -> bool:
        """As ``HostFS.exists``: a file or a symlink on the way means "no"."""
        return absent_as_none(self.lstat, path) is not None

    def listdir(self, path: str = "") -> list[str]:
        with self._fid(path) as fid:
            self.c.lopen(fid, m.DOTL_RDONLY)
            return [d.name for d in self.c.readdir_all(fid) if d.name not in (".", "..")]

    def read(self, path: str, offset: int = 0, length: int = 1 << 30) -> bytes:
        with self._fid(path) as fid:
            self.c.lopen(fid, m.DOTL_RDONLY)
            out = bytearray()
            while len(out) < length:
                chunk = self.c.read(fid, offset + len(out), min(length - len(out), self.c.msize - m.IOHDRSZ))
                if not chunk:
                    break
                out += chunk
            return bytes(out)

    def read_file(self, path: str) -> bytes:
        return self.read(path)

    def readlink(self, path: str) -> str:
        with self._fid(path) as fid:
            return self.c.readlink(fid)

    def xattrs(self, path: str) -> dict[str, bytes]:
        with self._fid(path) as fid:
            return {n: self.c.getxattr(fid, n) for n in sorted(self.c.listxattr(fid))}

    # -- mutations --

    def create(self, path: str, mode: int = 0o644) -> None:
        parent, name = self._parent(path)
        with self._fid(parent) as fid:
            self.c.lcreate(fid, name, m.DOTL_WRONLY | m.DOTL_CREATE | m.DOTL_EXCL, mode)

    def open_trunc(self, path: str) -> None:
        with self._fid(path) as fid:
            self.c.lopen(fid, m.DOTL_WRONLY | m.DOTL_TRUNC)

    def write(self, path: str, offset: int, data: bytes) -> int:
        with self._fid(path) as fid:
            self.c.lopen(fid, m.DOTL_WRONLY)
            self.c.write_all(fid, offset, data)
        return len(data)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """``open(O_CREAT|O_TRUNC|O_WRONLY)`` then write, as the kernel sends it."""
        parent, name = self._parent(path)
        try:
            fid = self._walk(path)
        except FileNotFoundError:
            fid = self._walk(parent)
            try:
                self.c.lcreate(fid, name, m.DOTL_WRONLY | m.DOTL_CREATE | m.DOTL_TRUNC, mode)
            except OSError:
                self.c.clunk(fid)
                raise
        else:
            try:
                if stat_of(self.c.getattr(fid)).kind == DIR:
                    raise IsADirectoryError(errno.EISDIR, "is a directory", path)
                self.c.lopen(fid, m.DOTL_WRONLY | m.DOTL_TRUNC)
            except OSError:
                self.c.clunk(fid)
                raise
        try:
            if data:
                self.c.write_all(fid, 0, data)
        finally:
            self.c.clunk(fid)

    def truncate(self, path: str, size: int) -> None:
        with self._fid(path) as fid:
            self.c.setattr(fid, m.SETATTR_SIZE, size=size)

    def unlink(self, path: str) -> None:
        parent, name = self._parent(path)
        with self._fid(parent) as fid:
            self.c.unlinkat(fid, name, 0)

    def rmdir(self, path: str) -> None:
        parent, name = self._parent(path)
        with self._fid(parent) as fid:
            self.c.unlinkat(fid, name, m.AT_REMOVEDIR)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        parent, name = self._parent(path)
        with self._fid(parent) as fid:
            self.c.mkdir(fid, name, mode)

    def rename(self, src: str, dst: str) -> None:
        sp, sn = self._parent(src)
        dp, dn = self._parent(dst)
        with self._fid(sp) as sfid, self._fid(dp) as dfid:
            self.c.renameat(sfid, sn, dfid, dn)

    def symlink(self, target: str, path: str) -> None:
        parent, name = self._parent(path)
        with self._fid(parent) as fid:
            self.c.symlink(fid, name, target)

    def mknod(self, path: str, mode: int, fmt: int, rdev: int = 0) -> None:
        """``mknod(2)`` as v9fs sends it: one ``Tmknod`` with ``fmt | mode`` and the device number."""
        parent, name = self._parent(path)
        with self._fid(parent) as fid:
            self.c.mknod(fid, name, fmt | mode, os.major(rdev), os.minor(rdev))

    def link(self, existing: str, new: str) -> None:
        parent, name = self._parent(new)
        with self._fid(existing) as efid, self._fid(parent) as dfid:
            self.c.link(dfid, efid, name)

    def chmod(self, path: str, mode: int) -> None:
        with self._fid(path) as fid:
            self.c.setattr(fid, m.SETATTR_MODE, mode=mode)

    def utime(self, path: str, mtime_ns: int, atime_ns: int | None = None) -> None:
        valid = m.SETATTR_MTIME | m.SETATTR_MTIME_SET
        atime = (0, 0)
        if atime_ns is not None:
            valid |= m.SETATTR_ATIME | m.SETATTR_ATIME_SET
            atime = divmod(atime_ns, 10**9)
        with self._fid(path) as fid:
            self.c.setattr(fid, valid, atime=atime, mtime=divmod(mtime_ns, 10**9))

    def setxattr(self, path: str, name: str, value: bytes) -> None:
        with self._fid(path) as fid:
            self.c.setxattr(fid, name, bytes(value))

    def removexattr(self, path: str, name: str) -> None:
        with self._fid(path) as fid:  # the server answers ENODATA for an absent name, EPERM where none can be
            self.c.removexattr(fid, name)  # size 0 + XATTR_REPLACE = remove, as Linux v9fs sends it

    def fallocate(self, path: str, offset: int, length: int, mode: int = 0) -> None:
        raise OSError(errno.EOPNOTSUPP, "9P2000.L has no fallocate", path)

    def copy_file_range(self, src: str, dst: str, src_offset: int, dst_offset: int, length: int) -> int:
        data = self.read(src, src_offset, min(length, 1 << 20))
        if data:
            self.write(dst, dst_offset, data)
        return len(data)


@contextlib.contextmanager
def serve(provider: Provider | dict, config: ServerConfig | None = None, decide=None, *,
          holds=None) -> Iterator[tuple[ServerThread, str]]:
    """A server on ``provider`` in a background thread, listening on a fresh unix socket
    (``holds``: the :class:`~sandbox.serving.holds.HoldBroker` deciding its holds)."""
    d = tempfile.mkdtemp(prefix="sandbox-9p-")
    path = os.path.join(d, "9p.sock")
    try:
        with ServerThread(NinePServer(provider, config, decide, holds=holds), unix_path=path) as st:
            yield st, path
    finally:
        try:
            os.rmdir(d)
        except OSError:
            pass


@contextlib.contextmanager
def serve_workspace(ws, config: ServerConfig | None = None, decide=None) -> Iterator[WireFS]:
    """``ws`` served over 9P; yields a connected :class:`WireFS`."""
    with serve(Provider.intercepted(ws), config, decide) as (st, path):
        with Client.connect_unix(path) as client:
            fs = WireFS(client, ws.fs.host)
            fs.server = st
            fs.gate = st.server.exports[""].gate
            fs.holds = st.server.holds  # tests answer holds, or ``holds.ask(decide)``
            yield fs
