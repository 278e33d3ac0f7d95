"""One 9P2000.L connection's state and its request handlers — synchronous, no I/O of its own.

:meth:`Connection.handle` turns one T-message into its R-message by calling the export's
:class:`~sandbox.mounts.Provider`; it raises ``OSError`` (the server answers
``Rlerror(errno)``) or :class:`~sandbox.core.errors.HoldRequired` (the server queues the
request behind the hold and calls ``handle`` again). A handler therefore changes no
session state before its provider mutation has succeeded, so a retry is exact.

Invariants:

* a fid names a path relative to its export's root; walks resolve one name at a time
  with :func:`~sandbox.mounts.child` (``..`` at the root stays at the root) and every
  host access goes through the provider's HostFS, which never leaves the root nor
  follows a symlink;
* a rename through any connection moves every live fid below the old name (the export
  keeps the registry, :class:`~sandbox.serving.exports.Export`), so fids follow their
  files as a local file descriptor would;
* a fid remembers the inode it was walked to; a change of attributes or xattrs through
  it goes to that inode — through its own open handle, or another open fid's handle on
  the same inode — never to a different file now at its path (an unlink or rename and
  a new file there); with no handle on that inode left it is ``ESTALE``;
* bounded (:class:`~sandbox.limits.ServerLimits`): fids per connection (``ENFILE``
  beyond); open host handles per connection (``EMFILE``; also never more than a share of
  the process's budget; an opened directory takes one while one is free — its listing and
  its entries are read through it — and is read by path when none is) and in the whole process (the shared
  :class:`~sandbox.limits.DescriptorBudget`, ``ENFILE``); xattr values ≤ 64 KiB
  each and the bytes of values held for one connection's xattr fids (``ENOMEM``);
  directory listings kept between Treaddirs (least recently used dropped first, see
  :meth:`Connection._listing`); read/readdir counts clamped to the negotiated ``msize``;
* nothing here is trusted from the client except as data: unknown fids are ``EBADF``,
  a fid in use as a new fid is ``EEXIST``, a name that is not a single component is
  ``EINVAL``.
"""

from __future__ import annotations

import errno
import os
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field

from ..hostfs import DIR, LNK, OTHER, REG, Attr, FileHandle, ListingTooLarge, parent_of
from ..limits import LISTING_DOTS_COST, PROCESS_DESCRIPTORS, DescriptorBudget, ServerLimits, listing_cost
from ..mounts import child
from ..mounts.identity import Cred, OwnerMap, attach_cred
from ..mounts.provider import XATTR_SIZE_MAX
from ..serving.exports import Export
from ..serving.locks import INF
from . import messages as m

V9FS_MAGIC = 0x01021997
READDIR_HEADER = 11  # size[4] type[1] tag[2] count[4]
DIRENT_FIXED = 13 + 8 + 1 + 2

# 9P2000.L open flags (the Linux x86 values, which the protocol adopted) → host os flags
_DOTL_TO_OS = ((0o1000, os.O_TRUNC), (0o2000, os.O_APPEND), (0o200, os.O_EXCL))


def os_flags(dotl: int) -> int:
    acc = dotl & 3
    if acc == 3:
        raise OSError(errno.EINVAL, "invalid access mode")
    out = (os.O_RDONLY, os.O_WRONLY, os.O_RDWR)[acc]
    for bit, osbit in _DOTL_TO_OS:
        if dotl & bit:
            out |= osbit
    return out


_QT = {DIR: m.QT_DIR, LNK: m.QT_SYMLINK}
_DT = {REG: m.DT_REG, DIR: m.DT_DIR, LNK: m.DT_LNK}


OFFSET_MAX = (1 << 63) - 1  # loff_t


def _offset(x: int) -> int:
    if x > OFFSET_MAX:
        raise OSError(errno.EINVAL, "offset beyond the largest file offset")
    return x


def qid_of(a: Attr) -> m.Qid:
    version = ((a.mtime_ns // 1000) ^ ((a.ctime_ns // 1000) << 7) ^ a.size) & 0xFFFFFFFF
    return m.Qid(_QT.get(a.kind, m.QT_FILE), version, a.ino & 0xFFFFFFFFFFFFFFFF)


def _dtype(a: Attr) -> int:
    if a.kind != OTHER:
        return _DT[a.kind]
    return (a.fmt >> 12) & 0xF  # DT_* is S_IFMT >> 12


@dataclass(eq=False, slots=True)
class _XattrNew:
    name: str
    size: int
    flags: int
    value: bytearray = field(default_factory=bytearray)


@dataclass(eq=False, slots=True)
class Fid:
    export: Export
    path: str
    kind: str
    opened: bool = False
    handle: FileHandle | None = None
    dir_handle: FileHandle | None = None  # an open directory's descriptor (listed through it), if one was free
    dir_names: list[str] | None = None  # the kept listing (a tail of it after a resume), or None
    dir_base: int = 0  # the readdir offset of dir_names[0]
    dir_last: tuple[int, str] | None = None  # (offset after, name) of the last entry returned
    xattr_value: bytes | None = None
    xattr_new: _XattrNew | None = None
    inode: tuple[int, int] | None = None  # (st_ino, st_dev) of the file walked to
    cred: Cred | None = None  # who its attach named (identity.attach_cred); walks pass it on


def _inode(a: Attr) -> tuple[int, int]:
    return (a.ino, a.dev)


_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # nothing at the path (a symlink on the way)


class Connection:
    def __init__(self, exports: dict[str, Export], conn_id: int, limits: ServerLimits = ServerLimits(),
                 descriptors: DescriptorBudget = PROCESS_DESCRIPTORS, owners: OwnerMap | None = None):
        if not exports:
            raise ValueError("at least one export")
        self.exports = exports
        self.default_export = next(iter(exports.values()))
        self.conn_id = conn_id
        self.limits = limits
        self.descriptors = descriptors
        self.owners = owners  # what Rgetattr reports as owners (None: the host's)
        self.msize_max = limits.msize_bytes_max
        self.msize = 0  # 0 until Tversion
        self.fids_max = limits.fids_per_connection_max
        self.open_files_max = limits.open_files_per_connection_max
        self.fids: dict[int, Fid] = {}
        self.open_files = 0  # host handles held (each also one unit of ``descriptors``)
        self.xattr_bytes = 0  # bytes of xattr values held by xattr fids (declared sizes for Txattrcreate)
        self._listings: OrderedDict[Fid, int] = OrderedDict()  # fids keeping a listing → its cost, LRU first
        self.listing_bytes = 0
        self._handlers = {
            m.Tversion: self._version, m.Tauth: self._auth, m.Tattach: self._attach, m.Twalk: self._walk,
            m.Tlopen: self._lopen, m.Tlcreate: self._lcreate, m.Tread: self._read, m.Twrite: self._write,
            m.Tclunk: self._clunk, m.Tremove: self._remove, m.Tgetattr: self._getattr, m.Tsetattr: self._setattr,
            m.Treaddir: self._readdir, m.Tstatfs: self._statfs, m.Tsymlink: self._symlink, m.Tmknod: self._mknod,
            m.Trename: self._rename, m.Trenameat: self._renameat, m.Treadlink: self._readlink, m.Tlink: self._link,
            m.Tmkdir: self._mkdir, m.Tunlinkat: self._unlinkat, m.Tfsync: self._fsync, m.Tlock: self._lock,
            m.Tgetlock: self._getlock, m.Txattrwalk: self._xattrwalk, m.Txattrcreate: self._xattrcreate,
        }

    @property
    def iounit(self) -> int:
        return self.msize - m.IOHDRSZ

    # ------------------------------------------------------------------ dispatch

    def handle(self, msg: m.Message) -> m.Message:
        h = self._handlers.get(type(msg))
        if h is None:
            raise OSError(errno.EOPNOTSUPP, f"{type(msg).__name__} is not a request")
        if self.msize == 0 and not isinstance(msg, m.Tversion):
            raise OSError(errno.EPROTO, "Tversion must come first")
        return h(msg)

    def gated_export(self, msg: m.Message) -> Export | None:
        """The export whose hold gate ``msg`` must pass (it may mutate an intercepted tree):
        9P's part of export gating — which messages are mutations; the rest is
        :class:`~sandbox.serving.pipeline.RequestPipeline`'s."""
        t = type(msg)
        if t in (m.Tlcreate, m.Tsetattr, m.Tsymlink, m.Tmknod, m.Tmkdir, m.Tunlinkat, m.Tremove, m.Tlink,
                 m.Trenameat, m.Trename):
            fid = msg.olddirfid if t is m.Trenameat else (msg.dfid if t in (m.Tmknod, m.Tmkdir, m.Tlink) else
                                                           msg.dirfid if t is m.Tunlinkat else msg.fid)
        elif t is m.Twrite:
            fid = msg.fid
            f = self.fids.get(fid)
            if f is None or f.xattr_new is not None:
                return None
        elif t is m.Tlopen:
            if not msg.flags & m.DOTL_TRUNC:
                return None
            fid = msg.fid
        elif t is m.Tclunk:
            f = self.fids.get(msg.fid)
            if f is None or f.xattr_new is None:
                return None
            fid = msg.fid
        else:
            return None
        f = self.fids.get(fid)
        return f.export if f is not None and f.export.gate is not None else None

    def close(self) -> None:
        """The connection is gone: release handles, fids and this connection's locks."""
        for fid in list(self.fids):
            self._drop(fid)
        for export in self.exports.values():
            export.locks.drop_owner(lambda owner: owner[0] == self.conn_id)

    # ------------------------------------------------------------------ fid helpers

    def _fid(self, fid: int) -> Fid:
        f = self.fids.get(fid)
        if f is None:
            raise OSError(errno.EBADF, f"unknown fid {fid}")
        return f

    def _dir(self, fid: int) -> Fid:
        f = self._fid(fid)
        if f.kind != DIR:
            raise OSError(errno.ENOTDIR, "not a directory", f.path)
        return f

    def _new_fid(self, fid: int, export: Export, path: str, kind: str, replacing: int | None = None,
                 cred: Cred | None = None) -> Fid:
        if fid == m.NOFID:
            raise OSError(errno.EINVAL, "NOFID cannot name a file")
        if fid in self.fids and fid != replacing:
            raise OSError(errno.EEXIST, f"fid {fid} is in use")
        if fid not in self.fids and len(self.fids) >= self.fids_max:
            raise OSError(errno.ENFILE, f"more than {self.fids_max} fids on this connection")
        if fid in self.fids:
            self._drop(fid)
        f = Fid(export, path, kind, cred=cred)
        self.fids[fid] = f
        export.add(f)
        return f

    def _drop(self, fid: int) -> None:
        f = self.fids.pop(fid, None)
        if f is None:
            return
        f.export.discard(f)
        self._forget_listing(f)
        if f.xattr_value is not None:
            self.xattr_bytes -= len(f.xattr_value)
        if f.xattr_new is not None:
            self.xattr_bytes -= f.xattr_new.size
        for h in (f.handle, f.dir_handle):
            if h is not None:
                self.open_files -= 1
                self.descriptors.release()
                h.close()
        f.handle = f.dir_handle = None

    def _attr(self, f: Fid) -> Attr:
        if f.handle is not None:
            return f.export.provider.fstat(f.handle, f.path, cred=f.cred)  # the open inode, even if moved or unlinked
        try:
            a = f.export.provider.getattr(f.path, cred=f.cred)
        except OSError as e:
            h = self._borrow(f) if e.errno in _GONE else None
            if h is None:
                raise
            return f.export.provider.fstat(h, f.path, cred=f.cred)
        if f.inode is not None and _inode(a) != f.inode:
            h = self._borrow(f)  # the path names another file now: the fid's own, if still open somewhere
            if h is not None:
                return f.export.provider.fstat(h, f.path, cred=f.cred)
        return a

    def _inode_handle(self, f: Fid, strict: bool = True) -> FileHandle | None:
        """The handle a call through ``f`` must use, or None: act by path.

        An open fid has its own handle. Any other fid (the client's dentry fid, a clone
        made for an xattr) uses an open handle on its inode if there is one
        (:meth:`_borrow`): the same file whether or not its path still names it.
        Without one, the path is used if it still names the fid's inode; if it does not,
        a change (``strict``) is ``ESTALE`` (``ENOENT`` if nothing is at the path) and a
        read falls back to the path, as before.
        """
        if f.handle is not None:
            return f.handle
        h = self._borrow(f)
        if h is not None or not strict:
            return h
        try:
            a = f.export.provider.lookup(f.path)  # an inode number: no mode needed
        except OSError as e:
            if e.errno not in _GONE:
                raise
            raise OSError(errno.ENOENT, "no such file", f.path) from None
        if f.inode is not None and _inode(a) != f.inode:
            raise OSError(errno.ESTALE, "the file this fid named was removed or replaced", f.path)
        return None

    @staticmethod
    def _borrow(f: Fid) -> FileHandle | None:
        """An open handle (of any connection; one open for writing if there is one) on
        ``f``'s inode. The fids at ``f``'s path are the candidates (fids stay at the path
        of an unlink and follow a rename together); an open fid's ``inode`` is its
        handle's, so this makes no host call."""
        if f.inode is None:
            return None
        found = None
        for g in f.export.fids_at(f.path):
            h = g.handle
            if h is not None and g.inode == f.inode and not h.closed:
                if h.flags & os.O_ACCMODE != os.O_RDONLY:
                    return h
                found = found or h
        return found

    def _opened(self, open_fn, *args):
        """``open_fn(*args)`` — a provider call returning a new host handle (or a tuple
        holding one) — within this connection's and the process's descriptor limits."""
        cap = min(self.open_files_max,
                  max(1, int(self.descriptors.capacity * self.limits.open_files_per_connection_share_max)))
        if self.open_files >= cap:
            raise OSError(errno.EMFILE, f"more than {cap} open files on this connection")
        self.descriptors.acquire()  # ENFILE when the process's budget is spent
        try:
            out = open_fn(*args)
        except BaseException:
            self.descriptors.release()
            raise
        self.open_files += 1
        return out

    def _charge_xattr(self, size: int) -> None:
        """Hold ``size`` more bytes of xattr value for this connection, or ``ENOMEM``."""
        if self.xattr_bytes + size > self.limits.xattr_bytes_per_connection_max:
            raise OSError(errno.ENOMEM, f"more than {self.limits.xattr_bytes_per_connection_max} bytes of "
                                        "xattr values held on this connection (clunk xattr fids)")
        self.xattr_bytes += size

    # ------------------------------------------------------------------ session

    def _version(self, msg: m.Tversion) -> m.Rversion:
        for fid in list(self.fids):
            self._drop(fid)  # a Tversion resets the session
        if msg.msize < 4096:
            raise OSError(errno.EINVAL, f"msize {msg.msize} is too small")
        self.msize = min(msg.msize, self.msize_max)
        ok = msg.version == m.VERSION or msg.version.startswith(m.VERSION + ".")
        return m.Rversion(self.msize, m.VERSION if ok else "unknown")

    def _auth(self, msg: m.Tauth) -> m.Message:
        raise OSError(errno.EOPNOTSUPP, "authentication is not required")

    def _attach(self, msg: m.Tattach) -> m.Rattach:
        name = msg.aname.strip("/")
        export = self.default_export if name == "" else self.exports.get(name)
        if export is None:
            raise OSError(errno.ENOENT, f"no export named {msg.aname!r}")
        a = export.provider.getattr("")
        cred = attach_cred(msg.uname, msg.n_uname, self.owners)
        self._new_fid(msg.fid, export, "", DIR, cred=cred).inode = _inode(a)
        return m.Rattach(qid_of(a))

    def _walk(self, msg: m.Twalk) -> m.Rwalk:
        f = self._fid(msg.fid)
        if len(msg.wnames) > m.WALK_NAMES_MAX:
            raise OSError(errno.EINVAL, "more than 16 names in one walk")
        if msg.newfid != msg.fid and msg.newfid in self.fids:
            raise OSError(errno.EEXIST, f"fid {msg.newfid} is in use")
        provider = f.export.provider
        path, kind, inode, qids = f.path, f.kind, f.inode, []  # a clone names the same inode
        for i, name in enumerate(msg.wnames):
            try:
                nxt = parent_of(path) if name == ".." else child(path, name)
                a = provider.lookup(nxt)  # a qid: no mode needed
            except OSError:
                if i == 0:
                    raise
                break
            qids.append(qid_of(a))
            path, kind, inode = nxt, a.kind, _inode(a)
        if len(qids) == len(msg.wnames):
            self._new_fid(msg.newfid, f.export, path, kind, replacing=msg.fid, cred=f.cred).inode = inode
        return m.Rwalk(tuple(qids))

    def _clunk(self, msg: m.Tclunk) -> m.Rclunk:
        f = self._fid(msg.fid)
        if f.xattr_new is not None:
            x = f.xattr_new
            try:
                if len(x.value) != x.size:
                    raise OSError(errno.EINVAL, f"xattr {x.name}: {len(x.value)} of {x.size} bytes written")
                handle = self._inode_handle(f)
                if x.size == 0 and x.flags & m.XATTR_REPLACE:  # how Linux v9fs removes one (a set of "" is flags 0/CREATE)
                    f.export.provider.removexattr(f.path, x.name, handle=handle)
                else:
                    f.export.provider.setxattr(f.path, x.name, bytes(x.value), x.flags, handle=handle)
            except OSError:
                self._drop(msg.fid)
                raise
        self._drop(msg.fid)
        return m.Rclunk()

    # ------------------------------------------------------------------ files

    def _lopen(self, msg: m.Tlopen) -> m.Rlopen:
        f = self._fid(msg.fid)
        if f.opened:
            raise OSError(errno.EBADF, "fid is already open")
        provider = f.export.provider
        a = provider.lookup(f.path)  # its kind (the reply's qid is the opened descriptor's)
        flags = os_flags(msg.flags)
        if a.kind == DIR:
            if flags & os.O_ACCMODE != os.O_RDONLY:
                raise OSError(errno.EISDIR, "is a directory", f.path)
            f.dir_handle = self._dir_descriptor(provider, f.path)
            if f.dir_handle is not None:
                a = f.dir_handle.fstat()  # the directory opened (the path may have changed since the getattr)
        elif a.kind == REG:
            f.handle = self._opened(lambda: provider.open(f.path, flags, cred=f.cred))
            a = f.handle.fstat()  # the inode opened (the path may have changed since the getattr)
        elif a.kind == LNK:
            raise OSError(errno.ELOOP, "is a symlink", f.path)
        else:
            raise OSError(errno.EPERM, "special files are never opened on the host", f.path)
        f.opened, f.kind, f.inode = True, a.kind, _inode(a)
        return m.Rlopen(qid_of(a), self.iounit)

    def _dir_descriptor(self, provider, path: str) -> FileHandle | None:
        """A descriptor of the directory ``path`` for its fid's listing — the directory this
        open found, listed and its entries looked up through it wherever it moves — within
        the descriptor limits; None where none is left or the host has none (the listing then
        goes by path, as it did before directories kept one)."""
        try:
            return self._opened(provider.open_dir, path)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.EOPNOTSUPP, errno.ENOTSUP):
                return None
            raise

    def _lcreate(self, msg: m.Tlcreate) -> m.Rlcreate:
        d = self._dir(msg.fid)
        if d.opened:
            raise OSError(errno.EBADF, "fid is open")
        path = child(d.path, msg.name)
        handle, _made = self._opened(lambda: d.export.provider.create(path, msg.mode, os_flags(msg.flags), cred=d.cred,
                                                                      gid=msg.gid))
        d.export.move(d, path)  # the fid is now the new file
        a = handle.fstat()
        d.kind, d.opened, d.handle, d.inode = REG, True, handle, _inode(a)
        return m.Rlcreate(qid_of(a), self.iounit)

    def _read(self, msg: m.Tread) -> m.Rread:
        f = self._fid(msg.fid)
        count = min(msg.count, self.iounit)
        if f.xattr_value is not None:
            return m.Rread(f.xattr_value[msg.offset:msg.offset + count])
        if f.handle is None:
            raise OSError(errno.EISDIR if f.kind == DIR else errno.EBADF, "fid is not open for reading", f.path)
        return m.Rread(f.handle.pread(count, _offset(msg.offset)))

    def _write(self, msg: m.Twrite) -> m.Rwrite:
        f = self._fid(msg.fid)
        if f.xattr_new is not None:
            x = f.xattr_new
            end = msg.offset + len(msg.data)
            if msg.offset != len(x.value) or end > x.size:
                raise OSError(errno.EINVAL, "xattr value written out of order or past its declared size")
            x.value += msg.data
            return m.Rwrite(len(msg.data))
        if f.handle is None:
            raise OSError(errno.EBADF, "fid is not open for writing", f.path)
        return m.Rwrite(f.export.provider.write(f.handle, f.path, _offset(msg.offset), msg.data, cred=f.cred))

    def _remove(self, msg: m.Tremove) -> m.Rremove:
        f = self._fid(msg.fid)
        try:
            if f.kind == DIR:
                f.export.provider.rmdir(f.path)
            else:
                f.export.provider.unlink(f.path)
        except OSError:
            self._drop(msg.fid)  # Tremove clunks the fid whatever happens (but not while held)
            raise
        self._drop(msg.fid)
        return m.Rremove()

    def _fsync(self, msg: m.Tfsync) -> m.Rfsync:
        f = self._fid(msg.fid)
        f.export.provider.fsync(f.handle, bool(msg.datasync))
        return m.Rfsync()

    # ------------------------------------------------------------------ attributes

    def _getattr(self, msg: m.Tgetattr) -> m.Rgetattr:
        f = self._fid(msg.fid)
        a = self._attr(f)
        return m.Rgetattr(
            m.GETATTR_BASIC, qid_of(a), a.fmt | a.mode, a.uid, a.gid, a.nlink, a.rdev, a.size, a.blksize, a.blocks,
            a.atime_ns // 10**9, a.atime_ns % 10**9, a.mtime_ns // 10**9, a.mtime_ns % 10**9,
            a.ctime_ns // 10**9, a.ctime_ns % 10**9, 0, 0, 0, 0)

    def _setattr(self, msg: m.Tsetattr) -> m.Rsetattr:
        f = self._fid(msg.fid)
        v = msg.valid

        def when(flag: int, set_flag: int, sec: int, nsec: int) -> int | None:
            if not v & flag:
                return None
            if not v & set_flag:
                return -1  # "now"
            if nsec >= 10**9:
                raise OSError(errno.EINVAL, "nanoseconds out of range")
            return sec * 10**9 + nsec

        changes = v & (m.SETATTR_MODE | m.SETATTR_SIZE | m.SETATTR_ATIME | m.SETATTR_MTIME | m.SETATTR_UID
                       | m.SETATTR_GID)
        f.export.provider.setattr(
            f.path, handle=self._inode_handle(f) if changes else f.handle,
            mode=msg.mode if v & m.SETATTR_MODE else None,
            size=_offset(msg.size) if v & m.SETATTR_SIZE else None,
            atime_ns=when(m.SETATTR_ATIME, m.SETATTR_ATIME_SET, msg.atime_sec, msg.atime_nsec),
            mtime_ns=when(m.SETATTR_MTIME, m.SETATTR_MTIME_SET, msg.mtime_sec, msg.mtime_nsec),
            chown=bool(v & (m.SETATTR_UID | m.SETATTR_GID)),
            uid=msg.uid if v & m.SETATTR_UID else None, gid=msg.gid if v & m.SETATTR_GID else None, cred=f.cred)
        return m.Rsetattr()

    def _statfs(self, msg: m.Tstatfs) -> m.Rstatfs:
        f = self._fid(msg.fid)
        s = f.export.provider.statfs()
        return m.Rstatfs(V9FS_MAGIC, s.bsize, s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.fsid, s.namelen)

    # ------------------------------------------------------------------ directories

    def _readdir(self, msg: m.Treaddir) -> m.Rreaddir:
        f = self._fid(msg.fid)
        if f.kind != DIR or not f.opened:
            raise OSError(errno.ENOTDIR if f.kind != DIR else errno.EBADF, "not an open directory", f.path)
        provider, held = f.export.provider, f.dir_handle
        names, base = self._listing(f, msg.offset)
        start = msg.offset - base
        count = min(msg.count, self.msize - READDIR_HEADER)
        entries, used = [], 0
        for i in range(start, len(names)):
            name = names[i]
            size = DIRENT_FIXED + len(name.encode("utf-8", "surrogateescape"))
            if used + size > count:
                break
            target = f.path if name == "." else parent_of(f.path) if name == ".." else f.path + "/" + name if f.path else name
            try:  # a qid and a d_type: no mode needed; through the open directory where it has a descriptor
                a = provider.lookup(target) if held is None or name == ".." else held.fstat() if name == "." \
                    else provider.lookup_at(held, target)
            except OSError:
                continue  # vanished since the listing: skip it, keep the cookies stable
            entries.append(m.Dirent(qid_of(a), base + i + 1, _dtype(a), name))
            used += size
        if not entries and start < len(names) and used == 0 and count > 0:
            first = names[start]
            if DIRENT_FIXED + len(first.encode("utf-8", "surrogateescape")) > count:
                raise OSError(errno.EINVAL, "count too small for the next directory entry")
        if entries:
            f.dir_last = (entries[-1].offset, entries[-1].name)
        data, _n = m.pack_dirents(entries, count)
        return m.Rreaddir(data)

    def _listing(self, f: Fid, offset: int) -> tuple[list[str], int]:
        """The listing a Treaddir at ``offset`` reads from, and the offset of its first entry.

        Offsets are positions in the sorted listing (``.``, ``..``, then names in code
        point order) taken when the scan began, so a fid reads a stable listing while it
        is kept. Kept listings cost ``len(name) + DIR_ENTRY_OVERHEAD_BYTES`` each entry
        (:func:`~sandbox.limits.listing_cost`); one connection keeps at most
        ``dir_listing_bytes_per_connection_max`` of them, dropping the least recently read
        first. No listing is larger: the host reads a directory only up to that bound, and
        one over it is ``ENOMEM`` (the FUSE server's OPENDIR says the same). A fid whose listing was dropped lists the directory again: if it continues
        where it stopped (``offset`` is the one after the last entry it returned), it
        resumes after that *name* — every entry that stayed is returned exactly once,
        whatever was added or removed meanwhile; any other offset indexes the new
        listing (exact while the directory is unchanged)."""
        if offset != 0 and f.dir_names is not None and offset >= f.dir_base:
            self._listings.move_to_end(f)
            return f.dir_names, f.dir_base
        self._forget_listing(f)
        budget = self.limits.dir_listing_bytes_per_connection_max
        try:
            names = [".", ".."] + sorted(f.export.provider.listdir(f.path, handle=f.dir_handle,
                                                                   limit_bytes=max(budget - LISTING_DOTS_COST, 0)))
        except ListingTooLarge:
            raise OSError(errno.ENOMEM, f"a directory listing over {budget} bytes held on this connection") from None
        base, last = 0, f.dir_last
        if offset != 0 and last is not None and last[0] == offset:
            after = {".": 1, "..": 2}.get(last[1])
            if after is None:
                after = bisect_right(names, last[1], lo=2)
            names, base = names[after:], offset
        if offset == 0:
            f.dir_last = None
        cost = listing_cost(names)
        if cost <= budget:
            while self.listing_bytes + cost > budget:
                old, old_cost = self._listings.popitem(last=False)
                old.dir_names = None
                self.listing_bytes -= old_cost
            f.dir_names, f.dir_base = names, base
            self._listings[f] = cost
            self.listing_bytes += cost
        return names, base

    def _forget_listing(self, f: Fid) -> None:
        cost = self._listings.pop(f, None)
        if cost is not None:
            self.listing_bytes -= cost
        f.dir_names = None

    def _mkdir(self, msg: m.Tmkdir) -> m.Rmkdir:
        d = self._dir(msg.dfid)
        path = child(d.path, msg.name)
        d.export.provider.mkdir(path, msg.mode, cred=d.cred, gid=msg.gid)
        return m.Rmkdir(qid_of(d.export.provider.getattr(path)))

    def _symlink(self, msg: m.Tsymlink) -> m.Rsymlink:
        d = self._dir(msg.fid)
        path = child(d.path, msg.name)
        d.export.provider.symlink(msg.symtgt, path, cred=d.cred, gid=msg.gid)
        return m.Rsymlink(qid_of(d.export.provider.getattr(path)))

    def _mknod(self, msg: m.Tmknod) -> m.Rmknod:
        d = self._dir(msg.dfid)
        path = child(d.path, msg.name)
        d.export.provider.mknod(path, msg.mode & 0o7777, msg.mode & 0o170000, os.makedev(msg.major, msg.minor),
                                cred=d.cred, gid=msg.gid)
        return m.Rmknod(qid_of(d.export.provider.lookup(path)))

    def _link(self, msg: m.Tlink) -> m.Rlink:
        d, f = self._dir(msg.dfid), self._fid(msg.fid)
        if f.export is not d.export:
            raise OSError(errno.EXDEV, "link across exports")
        d.export.provider.link(f.path, child(d.path, msg.name))
        return m.Rlink()

    def _move(self, export: Export, src: str, dst: str) -> None:
        export.provider.rename(src, dst)
        try:
            is_dir = export.provider.getattr(dst).kind == DIR
        except OSError:
            is_dir = True  # cannot tell (raced away): look at every fid
        export.renamed(src, dst, is_dir)

    def _rename(self, msg: m.Trename) -> m.Rrename:
        f, d = self._fid(msg.fid), self._dir(msg.dfid)
        if f.export is not d.export:
            raise OSError(errno.EXDEV, "rename across exports")
        if f.path == "":
            raise OSError(errno.EBUSY, "cannot rename the root")
        self._move(f.export, f.path, child(d.path, msg.name))
        return m.Rrename()

    def _renameat(self, msg: m.Trenameat) -> m.Rrenameat:
        od, nd = self._dir(msg.olddirfid), self._dir(msg.newdirfid)
        if od.export is not nd.export:
            raise OSError(errno.EXDEV, "rename across exports")
        self._move(od.export, child(od.path, msg.oldname), child(nd.path, msg.newname))
        return m.Rrenameat()

    def _unlinkat(self, msg: m.Tunlinkat) -> m.Runlinkat:
        d = self._dir(msg.dirfid)
        path = child(d.path, msg.name)
        if msg.flags & m.AT_REMOVEDIR:
            d.export.provider.rmdir(path)
        else:
            d.export.provider.unlink(path)
        return m.Runlinkat()

    def _readlink(self, msg: m.Treadlink) -> m.Rreadlink:
        f = self._fid(msg.fid)
        return m.Rreadlink(f.export.provider.readlink(f.path))

    # ------------------------------------------------------------------ locks

    def _lock_file(self, f: Fid) -> int:
        return self._attr(f).ino

    def _lock(self, msg: m.Tlock) -> m.Rlock:
        f = self._fid(msg.fid)
        owner = (self.conn_id, msg.client_id, msg.proc_id)
        ok = f.export.locks.lock(self._lock_file(f), owner, msg.type, msg.start, msg.length)
        return m.Rlock(m.LOCK_SUCCESS if ok else m.LOCK_BLOCKED)

    def _getlock(self, msg: m.Tgetlock) -> m.Rgetlock:
        f = self._fid(msg.fid)
        owner = (self.conn_id, msg.client_id, msg.proc_id)
        r = f.export.locks.conflict(self._lock_file(f), owner, msg.type, msg.start, msg.length)
        if r is None:
            return m.Rgetlock(m.LOCK_TYPE_UNLCK, msg.start, msg.length, msg.proc_id, msg.client_id)
        length = 0 if r.end == INF else r.end - r.start
        return m.Rgetlock(r.type, r.start, length, r.owner[2], r.owner[1])

    # ------------------------------------------------------------------ xattrs

    def _xattrwalk(self, msg: m.Txattrwalk) -> m.Rxattrwalk:
        f = self._fid(msg.fid)
        if msg.newfid != msg.fid and msg.newfid in self.fids:
            raise OSError(errno.EEXIST, f"fid {msg.newfid} is in use")
        provider = f.export.provider
        handle = self._inode_handle(f, strict=False)  # an open file's own xattrs, wherever it is now (no host call)
        if msg.name == "":
            value = b"".join(n.encode("utf-8", "surrogateescape") + b"\0"
                             for n in provider.listxattr(f.path, handle=handle))
        else:
            value = provider.getxattr(f.path, msg.name, handle=handle)
        if len(value) > XATTR_SIZE_MAX:
            raise OSError(errno.E2BIG, "xattr larger than 64 KiB", f.path)
        self._charge_xattr(len(value))
        try:
            nf = self._new_fid(msg.newfid, f.export, f.path, f.kind, replacing=msg.fid)
        except BaseException:
            self.xattr_bytes -= len(value)
            raise
        nf.xattr_value, nf.inode = value, f.inode
        return m.Rxattrwalk(len(value))

    def _xattrcreate(self, msg: m.Txattrcreate) -> m.Rxattrcreate:
        f = self._fid(msg.fid)
        if f.export.provider.read_only:
            raise OSError(errno.EROFS, "read-only export", f.path)
        if not msg.name or "\0" in msg.name or len(msg.name.encode("utf-8", "surrogateescape")) > 255:
            raise OSError(errno.EINVAL, f"invalid xattr name {msg.name!r}")
        if msg.attr_size > XATTR_SIZE_MAX:
            raise OSError(errno.E2BIG, "xattr larger than 64 KiB", f.path)
        if f.opened:
            raise OSError(errno.EBADF, "fid is open")
        self._charge_xattr(msg.attr_size - (f.xattr_new.size if f.xattr_new is not None else 0))
        f.xattr_new = _XattrNew(msg.name, msg.attr_size, msg.flags)
        return m.Rxattrcreate()
