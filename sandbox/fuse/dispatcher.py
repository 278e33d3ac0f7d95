"""The FUSE dispatcher: one mount's state and its request handlers — no I/O of its own.

:meth:`Dispatcher.handle` turns one decoded request (:mod:`.messages`) into its reply by
calling the export's :class:`~sandbox.mounts.Provider`, exactly as
:class:`~sandbox.ninep.connection.Connection` does for 9P; POSIX semantics (modes,
owners, set-id clearing, special files, xattr mapping) stay in the Provider. It raises
``OSError`` (the transport answers ``-errno``) or
:class:`~sandbox.core.errors.HoldRequired`; :meth:`Dispatcher.submit` runs a request
through the shared :class:`~sandbox.serving.pipeline.RequestPipeline`, so a mutation met
by a safeguard hold waits as a task (its reply comes later) while other requests flow.
A handler changes no dispatcher state before its provider mutation has succeeded, so a
retry after a hold is exact.

Invariants:

* **nodes.** A node id names an inode the kernel was told about (LOOKUP, the creating
  requests, LINK, READDIRPLUS entries), with the path relative to the export root where it
  was last seen and its ``(st_ino, st_dev)``. Node ids are never reused within a mount
  (a 64-bit counter), so the generation is constant (:data:`GENERATION`). A node lives
  while its lookup count is positive: every entry reply adds one, FORGET/BATCH_FORGET
  subtract; at zero it is dropped (the root, :data:`~.abi.FUSE_ROOT_ID`, never is).
  One inode has one node while the node's path still names it (hard links share it);
  otherwise (removed, replaced, moved outside us) a lookup makes a new node.
* nodes and open files are in the export's handle registry, so a rename moves every node
  and handle at or below the old name (:meth:`~sandbox.serving.exports.Export.renamed`).
* a change of attributes or xattrs goes to the node's inode — through an open handle on
  it if there is one, else by path only while the path still names that inode (else
  ``ESTALE``), as 9P does;
* **handles.** A file handle holds one host descriptor (the Provider's
  :class:`~sandbox.hostfs.FileHandle`) from OPEN/CREATE to RELEASE; a directory handle
  keeps the listing taken at OPENDIR (``.``, ``..``, then names in code-point order), so
  READDIR offsets are positions in a stable snapshot. Handle ids are never reused.
* **no-open** (:attr:`Dispatcher.no_open`, chosen at INIT for a coherent /dev/fuse mount):
  OPEN and FLUSH are ``ENOSYS``, CREATE answers handle 0, and I/O with handle 0 goes through
  the node's own descriptors (``Node.ro``/``Node.rw``), opened by path while the path names
  the node's inode, at most :attr:`Dispatcher.node_descriptors_max` nodes holding them (LRU); a regular
  file whose last known name is removed through the mount gets them first and keeps them
  (``Node.pinned``, outside the LRU) until its node is dropped; reads never open for writing.
* **credentials** come from each request's header uid/gid (:class:`Cred`), which the
  Provider uses for owners and set-id clearing; permission checks are the kernel's
  (the mount's ``default_permissions``).
* bounded (:class:`~sandbox.limits.ServerLimits`): nodes ≤ ``fids_per_connection_max``
  (``ENFILE``; a READDIRPLUS stops short at the first entry it has no node for, and counts
  lookups only for the entries it answers) — on a transport that can invalidate
  (:attr:`Dispatcher.on_node_pressure`) the kernel is asked to forget the oldest names from
  :data:`NODE_RELIEF_AT` of it, so only names in use can fill it, open files ≤ ``open_files_per_connection_max`` and the process's
  :class:`~sandbox.limits.DescriptorBudget` (``EMFILE``/``ENFILE``), directory
  snapshots ≤ ``dir_listing_bytes_per_connection_max`` in total (``ENOMEM`` at OPENDIR; the
  host reads a directory only up to what is left of it, so a huge one costs no more),
  reads and readdirs ≤ :data:`~.abi.MAX_WRITE_BYTES`, xattr values ≤ 64 KiB (``E2BIG``).
* **caching**: entry/attribute timeouts and the page-cache mode follow :attr:`Dispatcher.coherent`
  (True while the watcher's invalidations run: long timeouts, ``FOPEN_KEEP_CACHE``);
  :meth:`Dispatcher.invalidations` says what the kernel must forget for changed paths —
  only nodes and names it knows. No writeback cache: every write is a request. Not coherent,
  a regular file's (mtime, ctime, size) in a reply that differs from the last one reported
  (``Node.told``; the mount's own writes and SETATTRs update it) is a host change:
  :attr:`Dispatcher.on_host_changed` is asked to invalidate it (no-open keeps pages across opens);
  with :attr:`Dispatcher.direct_io_write_only` (the virtio-fs device) and not coherent, a node's
  open handles are all direct I/O or all cached: a write-only open of a node open nowhere else
  is ``FOPEN_DIRECT_IO``, and so is every open beside a direct one (:meth:`Dispatcher._direct`);
  with :attr:`Dispatcher.direct_io_all` every open is;
* **INTERRUPT** cancels a request waiting behind a hold and answers it ``EINTR``; the hold
  stays pending (as after a 9P ``Tflush``).
* nothing from the kernel is trusted except as data: unknown node ids and handles are
  ``ENOENT``/``EBADF``, a name that is not one component ``EINVAL``; any request before
  INIT is ``EIO``; an opcode the Provider cannot serve is ``ENOSYS`` (``docs/fuse.md``).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat as _stat
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from ..core.errors import HoldRequired
from ..hostfs import DIR, LNK, OTHER, REG, Attr, FileHandle, ListingTooLarge, parent_of
from ..limits import LISTING_DOTS_COST, PROCESS_DESCRIPTORS, DescriptorBudget, ServerLimits, listing_cost
from ..mounts import child
from ..mounts.identity import Cred, OwnerMap
from ..mounts.provider import XATTR_SIZE_MAX
from ..serving.exports import Export
from ..serving.pipeline import RequestPipeline
from . import abi
from . import messages as m
from .codec import DirentPacker, negotiate_init

#: seconds the kernel may cache a name → node answer and a node's attributes when nothing
#: tells it of changes made on the host beside the mount (no watcher): they show within a second
ENTRY_VALID_S = 1
ATTR_VALID_S = 1
#: the same while the watcher's invalidations tell the kernel of every change it sees
#: (:attr:`Dispatcher.coherent`; docs/fuse.md "Caching" has the measurements)
COHERENT_ENTRY_VALID_S = 60
COHERENT_ATTR_VALID_S = 60
#: node ids are never reused within one mount: one generation
GENERATION = 1
#: INIT: background requests the kernel may queue for us, and where it starts throttling
MAX_BACKGROUND = 64
CONGESTION_THRESHOLD = 48
#: INIT flags we ask for when the kernel offers them (docs/fuse.md "Dispatcher and mount"):
#: no writeback cache (every write reaches the interceptor, in order), no POSIX/flock locks
#: (the kernel arbitrates them locally), no DONT_MASK (the kernel applies the umask), no
#: AUTO_INVAL_DATA (it would drop the pages our own writes just filled, whenever the file's
#: mtime moved: the host's changes are dropped by the watcher's notifications instead);
#: HANDLE_KILLPRIV_V2: the kernel no longer asks for a file's security.capability before every
#: write(2) — the server clears what a write clears (the Provider: set-id bits for an
#: unprivileged writer, on write, truncate, O_TRUNC open and chown; the capability on write:
#: :meth:`Dispatcher._write`)
WANTED_INIT_FLAGS = (abi.FUSE_ASYNC_READ | abi.FUSE_ATOMIC_O_TRUNC | abi.FUSE_BIG_WRITES | abi.FUSE_MAX_PAGES
                     | abi.FUSE_DO_READDIRPLUS | abi.FUSE_READDIRPLUS_AUTO | abi.FUSE_PARALLEL_DIROPS
                     | abi.FUSE_HANDLE_KILLPRIV_V2 | abi.FUSE_INIT_EXT)
#: names answered "no such entry" with the coherent entry timeout, remembered (oldest first)
#: so an invalidation of everything reaches them too; when full (after expiring those the
#: kernel no longer trusts), a missing name is answered ENOENT, not cached
NEGATIVE_ENTRIES_MAX = 4096
#: no-open mode (:attr:`Dispatcher.no_open`): host descriptors kept on nodes for READ/WRITE,
#: which then carry no handle; beyond it the least recently used node's are closed (reopened
#: by path at its next use). Never more than the mount's share of the process's descriptor budget
#: allows either, two a node (:attr:`Dispatcher.node_descriptors_max`: 2,468 nodes under a soft
#: RLIMIT_NOFILE of 20,000, 96 under 1,024). Large enough that a tree of a few thousand files the
#: kernel keeps cached is served through its nodes' descriptors: a READ is one ``pread``, a
#: GETATTR one ``fstat`` and one ``flistxattr``, no path resolved (docs/fuse.md "Benchmark").
#: Nodes whose last name was removed while the kernel knew them keep theirs until FORGET (an
#: unlinked file a program still has open) and are not counted here
NODE_DESCRIPTORS_MAX = 4096

#: not no-open: open directories (OPENDIR..RELEASEDIR) that hold a descriptor of the directory
#: for their READDIRPLUS (:meth:`Dispatcher._listing_descriptor`); beyond it a listing looks
#: its entries up by path, as without one — so a guest that opens many directories and never
#: releases them cannot take the descriptors its file OPENs need
LISTING_DESCRIPTORS_MAX = 64
#: a transport that can make the kernel forget names (/dev/fuse: :attr:`Dispatcher.on_node_pressure`)
#: asks it to, once the node table holds this share of ``fids_per_connection_max``: the names
#: of the oldest nodes not open, NODE_RELIEF_SHARE of the table at a time (the kernel drops
#: its cached entries and FORGETs the inodes nothing uses; the next use looks them up again).
#: The kernel keeps what it caches until memory runs short: without this a program walking
#: more files than the table holds (``git status`` in a very large tree) met ENFILE
NODE_RELIEF_AT = 0.75
NODE_RELIEF_SHARE = 0.125
#: the requests' credentials kept for reuse (:meth:`Dispatcher._cred`): a guest has a few
#: users; past this many distinct (uid, gid) pairs all are dropped and made again as needed
CREDS_KEPT_MAX = 64

_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
_DT = {REG: _stat.S_IFREG >> 12, DIR: _stat.S_IFDIR >> 12, LNK: _stat.S_IFLNK >> 12}
#: opcodes not served: ENOSYS, which the kernel remembers (locks are the kernel's: one host)
UNSUPPORTED = frozenset({abi.Opcode.GETLK, abi.Opcode.SETLK, abi.Opcode.SETLKW})
#: requests that may mutate the tree: they pass the export's hold gate
_MUTATING = (m.Setattr, m.Symlink, m.Mknod, m.Mkdir, m.Unlink, m.Rmdir, m.Rename, m.Rename2, m.Link, m.Create,
             m.Write, m.Setxattr, m.Removexattr, m.Fallocate, m.CopyFileRange)
#: the same as exact types (a request is always one of the codec's classes: ``type(req) in``)
_MUTATING_TYPES = frozenset(_MUTATING)
#: requests the kernel expects no reply to (:data:`~.messages.NO_REPLY`), as types
_NO_REPLY_TYPES = frozenset({m.Forget, m.BatchForget})
#: the largest file offset (loff_t)
_OFF_MAX = (1 << 63) - 1
_U64 = (1 << 64) - 1
#: the attributes of a negative entry (nodeid 0): never read by the kernel
_NO_ATTR = m.FuseAttr(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


def errno_of(exc: BaseException) -> int:
    """The errno a failed request is answered with (``EIO`` for anything unexpected)."""
    if isinstance(exc, OSError) and isinstance(exc.errno, int) and 0 < exc.errno <= abi.ERRNO_MAX:
        return exc.errno
    return errno.EIO


def _inode(a: Attr) -> tuple[int, int]:
    return (a.ino, a.dev)


class _Inode(NamedTuple):
    """A node's ``(ino, dev)`` under the names :meth:`FileHandle.is_inode_of` reads."""

    ino: int
    dev: int


def _is_node_inode(h: FileHandle, n: "Node") -> bool:
    """Is ``h`` open on ``n``'s inode? Answered from the inode ``h`` already knows where it
    knows one (a :class:`~sandbox.hostfs.real.RealFileHandle` after its first ``fstat``: the
    journal's look at a new write descriptor, or ``Provider``'s set-id check), else one ``fstat``
    — a descriptor's inode never changes."""
    return h.is_inode_of(_Inode(*n.inode))


def _name(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


#: POSIX ACLs are not negotiated (no FUSE_POSIX_ACL): their xattrs are EOPNOTSUPP, so tools
#: (``cp -a``, ``tar --acls``) fall back to chmod, and the mode stays the one truth
ACL_XATTR_PREFIX = "system.posix_acl_"


def _xattr_name(raw: bytes) -> str:
    name = _name(raw)
    if name.startswith(ACL_XATTR_PREFIX):
        raise OSError(errno.EOPNOTSUPP, "POSIX ACLs are not served over FUSE")
    return name


def _dtype(a: Attr) -> int:
    return _DT[a.kind] if a.kind != OTHER else (a.fmt >> 12) & 0xF


def wire_seconds(sec: int) -> int:
    """Seconds as the wire carries them: ``fuse_attr``'s and ``fuse_setattr_in``'s u64 fields
    are the kernel's signed ``time64_t`` (a time before 1970 is the two's complement)."""
    return sec & _U64


def host_seconds(sec: int) -> int:
    """The inverse of :func:`wire_seconds`: the signed seconds of a wire u64."""
    return sec - (1 << 64) if sec >> 63 else sec


def fuse_attr_values(a: Attr) -> tuple:
    """The fields of :func:`fuse_attr` in ``struct fuse_attr``'s order, ``flags`` (0) last —
    what a READDIRPLUS entry packs (``DirentPacker.add_entry``) with no ``FuseAttr`` built."""
    return (a.ino & _U64, a.size, a.blocks, (a.atime_ns // 10**9) & _U64, (a.mtime_ns // 10**9) & _U64,
            (a.ctime_ns // 10**9) & _U64, a.atime_ns % 10**9, a.mtime_ns % 10**9, a.ctime_ns % 10**9,
            a.fmt | a.mode, a.nlink & 0xFFFFFFFF, a.uid, a.gid, a.rdev & 0xFFFFFFFF, min(a.blksize, 0xFFFFFFFF), 0)


def fuse_attr(a: Attr) -> m.FuseAttr:
    """A Provider :class:`Attr` as ``struct fuse_attr`` (times as :func:`wire_seconds`)."""
    return m.FuseAttr(*fuse_attr_values(a))


@dataclass(eq=False, slots=True)
class Link:
    """One name of a node's inode, kept in the export's registry (renames move it)."""

    path: str
    node: "Node"


@dataclass(eq=False, slots=True)
class Node:
    """An inode the kernel knows by ``nodeid`` (module docstring): its names (``links``,
    the first the one used; hard links add more), the open files on it."""

    nodeid: int
    inode: tuple[int, int]
    kind: str
    lookups: int = 0
    links: list = field(default_factory=list)
    files: list = field(default_factory=list)
    #: no-open mode: the node's own host descriptors (read-only, and one open for writing); a
    #: directory's ``ro`` only reads its attributes (:meth:`Dispatcher._dir_descriptor`)
    ro: FileHandle | None = None
    rw: FileHandle | None = None
    #: no-open mode: its last name was removed while the kernel knew it (descriptors kept)
    pinned: bool = False
    #: a regular file's (mtime_ns, ctime_ns, size) as last reported to the kernel (None: not
    #: yet): while not coherent, a report that differs drops its pages (:meth:`Dispatcher._told`)
    told: tuple[int, int, int] | None = None

    @property
    def path(self) -> str:
        return self.links[0].path

    @property
    def handle(self) -> FileHandle | None:
        """An open host handle on this inode (one open for writing if there is one), or None."""
        found = None
        for f in self.files:
            h = f.handle
            if h.closed:
                continue
            if h.flags & os.O_ACCMODE != os.O_RDONLY:
                return h
            found = found or h
        if self.kind == DIR:  # a directory's kept descriptor only reads its attributes
            return None
        return found or self.rw or self.ro


@dataclass(eq=False, slots=True)
class OpenFile:
    node: Node
    handle: FileHandle
    #: answered ``FOPEN_DIRECT_IO`` (:meth:`Dispatcher._direct`)
    direct: bool = False


@dataclass(eq=False, slots=True)
class OpenDir:
    node: Node
    names: list[str]
    cost: int
    #: not no-open: the directory's own read-only descriptor from OPENDIR to RELEASEDIR (its
    #: entries' attributes at READDIRPLUS, :meth:`Dispatcher._listing_descriptor`), or None
    handle: FileHandle | None = None


class Dispatcher:
    """One FUSE mount of ``export`` (module docstring)."""

    @property
    def provider(self):
        """The export's provider *now*: a restricted view (seed 004, ``Session.restrict``) swaps
        it on the export, as for the 9P server's fids, and the next request sees it."""
        return self.export.provider

    def __init__(self, export: Export, limits: ServerLimits = ServerLimits(),
                 descriptors: DescriptorBudget = PROCESS_DESCRIPTORS, owners: OwnerMap | None = None,
                 on_settled: Callable[[], None] | None = None):
        self.export = export
        self.limits = limits
        self.descriptors = descriptors
        self.owners = owners
        #: (uid, gid) -> its Cred, at most CREDS_KEPT_MAX (:meth:`_cred`)
        self._creds: dict[tuple, Cred] = {}
        self.initialized = False
        self.minor = 0
        self.nodes: dict[int, Node] = {}
        self._by_inode: dict[tuple[int, int], Node] = {}
        self._next_node = abi.FUSE_ROOT_ID + 1
        self.files: dict[int, OpenFile] = {}
        self.dirs: dict[int, OpenDir] = {}
        self._next_fh = 1
        self.listing_bytes = 0
        #: open directories holding a descriptor (at most LISTING_DESCRIPTORS_MAX)
        self._listing_descriptors = 0
        #: (parent nodeid, name) answered as a cached negative entry -> when the kernel stops
        #: trusting it (time.monotonic); bounded by NEGATIVE_ENTRIES_MAX
        self.negative: OrderedDict[tuple[int, bytes], float] = OrderedDict()
        #: True while every change made beside the mount is notified to the kernel (the
        #: watcher runs): long timeouts and the page cache kept across opens; False: short
        #: timeouts, the page cache dropped at each open
        self.coherent = False
        #: the transport lets the kernel cache past opens: a /dev/fuse mount (set by its
        #: FuseServer), not the virtio-fs device (docs/fuse.md "No-open")
        self.no_open_allowed = False
        #: chosen at INIT (allowed, coherent, offered by the kernel): OPEN is answered ENOSYS,
        #: so the kernel sends no OPEN/RELEASE/FLUSH and READ/WRITE carry no handle — they use
        #: the node's own descriptors (:data:`NODE_DESCRIPTORS_MAX`); no ATOMIC_O_TRUNC, so an
        #: O_TRUNC open arrives as a SETATTR of the size (a gated truncate)
        self.no_open = False
        #: paths found changed beside the mount while not coherent (a regular file's mtime,
        #: ctime or size moved since the kernel was last told): the transport invalidates them
        #: (the kernel's pages stay across opens in no-open mode, and AUTO_INVAL_DATA is off).
        #: None (a transport without notifications: the virtio-fs device): nothing is compared
        self.on_host_changed: Callable[[list[str]], None] | None = None
        #: the transport can never invalidate the kernel's entries (the virtio-fs device, set by
        #: its server): while not coherent a missing name is a negative entry valid
        #: ENTRY_VALID_S, the bound every positive entry has — a name made beside the mount
        #: shows within it. Not remembered (nothing could invalidate it). False: plain ENOENT
        self.negative_entries_short = False
        #: the transport can make the kernel forget names (/dev/fuse): called with the paths of
        #: the oldest nodes when the table fills (:meth:`_relieve`). None: the table's bound
        #: is a hard ENFILE (virtio-fs has no notification queue)
        self.on_node_pressure: Callable[[list[str]], None] | None = None
        #: the node count at which :meth:`_relieve` runs next, and the last node id it named
        self._relief_base = max(1, int(limits.fids_per_connection_max * NODE_RELIEF_AT))
        self._relief_at = self._relief_base
        self._relieved_up_to = abi.FUSE_ROOT_ID
        #: the transport drops the kernel's pages at each open and can invalidate nothing
        #: meanwhile (the virtio-fs device, set by its server): while not coherent, a
        #: write-only open of a node open nowhere else gets FOPEN_DIRECT_IO (its writes skip
        #: the guest's page cache), and so does every open beside a direct one
        #: (:meth:`_direct`). False: no open is direct
        self.direct_io_write_only = False
        #: every open gets FOPEN_DIRECT_IO, whatever its mode (the virtio-fs device's
        #: ``direct_io="all"``, virtiofsd ``cache=none``'s trade): no open fills the guest's
        #: page cache, and a 6.1 guest refuses shared maps of every file (``ENODEV``)
        self.direct_io_all = False
        #: no-open: nodes holding descriptors, least recently used first (never pinned ones)
        self._lru: OrderedDict[int, Node] = OrderedDict()
        #: the mount is going away: gated requests fail with EIO at once instead of waiting
        self.closing = False
        #: the largest request unique read so far (an INTERRUPT beyond it came before its request)
        self.last_unique = 0
        #: held requests cancelled by INTERRUPT (answered EINTR)
        self.interrupts = 0
        #: called after a held request's reply (the transport reads again if it paused)
        self.on_settled = on_settled or (lambda: None)
        self.pipeline = RequestPipeline(on_settled=lambda: self.on_settled())
        a = self.provider.getattr("")
        root = Node(abi.FUSE_ROOT_ID, _inode(a), DIR, lookups=1)
        self._add_name(root, "")
        self.nodes[root.nodeid] = root
        self._by_inode[root.inode] = root
        self._handlers = {
            m.Init: self._init, m.Lookup: self._lookup, m.Forget: self._forget, m.BatchForget: self._batch_forget,
            m.Getattr: self._getattr, m.Setattr: self._setattr, m.Readlink: self._readlink,
            m.Symlink: self._symlink, m.Mknod: self._mknod, m.Mkdir: self._mkdir, m.Unlink: self._unlink,
            m.Rmdir: self._rmdir, m.Rename: self._rename, m.Rename2: self._rename, m.Link: self._link,
            m.Open: self._open, m.Create: self._create, m.Read: self._read, m.Write: self._write,
            m.Release: self._release, m.Flush: self._flush, m.Fsync: self._fsync, m.Opendir: self._opendir,
            m.Readdir: self._readdir, m.Readdirplus: self._readdir, m.Releasedir: self._releasedir,
            m.Fsyncdir: self._fsyncdir, m.Statfs: self._statfs, m.Getxattr: self._getxattr,
            m.Setxattr: self._setxattr, m.Listxattr: self._listxattr, m.Removexattr: self._removexattr,
            m.Access: self._access, m.Interrupt: self._interrupt, m.Destroy: self._destroy,
            m.Fallocate: self._fallocate, m.CopyFileRange: self._copy_file_range, m.Lseek: self._lseek,
        }

    # ------------------------------------------------------------------ dispatch

    def handle(self, req: m.Request):
        """The reply to ``req`` (``None``: the empty success reply, or no reply for FORGET,
        BATCH_FORGET and INTERRUPT); raises ``OSError`` or ``HoldRequired``."""
        h = self._handlers.get(type(req))
        if h is None:
            raise OSError(errno.ENOSYS, f"{type(req).__name__} is not served")
        if not self.initialized and type(req) is not m.Init:
            raise OSError(errno.EIO, "INIT must come first")
        return h(req)

    def gated(self, req: m.Request) -> Export | None:
        """The export whose hold gate ``req`` must pass (it may mutate an intercepted tree)."""
        if self.export.gate is None:
            return None
        if type(req) in _MUTATING_TYPES or (type(req) is m.Open and req.flags & os.O_TRUNC):
            return self.export
        return None

    def submit(self, req: m.Request, size: int, send: Callable[[int, object, BaseException | None], None]) -> bool:
        """Run ``req`` through the pipeline; ``send(unique, reply, error)`` is called once with
        the result (never for a request that expects no reply; for one cancelled by INTERRUPT,
        ``EINTR``).
        True if it was deferred behind a hold (its reply comes later). A deferred request keeps
        no view of the caller's buffer (a WRITE's data is copied then): the caller may reuse
        it as soon as this returns."""
        unique = req.header.unique
        kind = type(req)
        if kind is m.Interrupt:
            self._interrupted(req, send)
            return False
        if unique > self.last_unique:
            self.last_unique = unique
        if kind in _NO_REPLY_TYPES:
            try:
                self.handle(req)
            except Exception:  # pragma: no cover - forgets never fail
                pass
            return False
        if unique in self.pipeline:  # a virtio-fs guest picks uniques: one in flight names one request
            send(unique, None, OSError(errno.EINVAL, f"unique {unique} is in flight already"))
            return False
        if req.OPCODE in UNSUPPORTED:
            send(unique, None, OSError(errno.ENOSYS, f"{req.OPCODE.name} is not served"))
            return False
        gate = self.gated(req)
        if gate is None:  # the pipeline's ungated case, without its closures: at once, in this turn
            try:
                result = self.handle(req)
            except Exception as e:
                send(unique, None, e)
            else:
                send(unique, result, None)
            return False
        if self.closing:
            send(unique, None, OSError(errno.EIO, "the mount is going away"))
            return False
        box = [req]
        deferred = self.pipeline.run(unique, gate, lambda: self.handle(box[0]), size,
                                     lambda result, error: send(unique, result, error))
        if deferred and kind is m.Write and type(req.data) is memoryview:
            # it runs later: its data becomes its own (the caller's read buffer is reused at once)
            box[0] = dataclasses.replace(req, data=bytes(req.data))
        return deferred

    def _interrupted(self, req: m.Interrupt, send) -> None:
        """INTERRUPT of request ``req.unique`` (docs/fuse.md "Interrupts"): a request waiting
        behind a safeguard hold is cancelled and answered ``EINTR`` (it never ran; the hold
        stays pending, as after a 9P Tflush). A request already answered, or unknown, is
        left alone (the kernel may send INTERRUPT late). One not seen yet (a unique beyond
        every one read) gets ``EAGAIN`` on the INTERRUPT itself: the kernel sends it again."""
        if not self.initialized:
            return
        if self.pipeline.cancel(req.unique, InterruptedError(errno.EINTR, "interrupted")) is not None:
            self.interrupts += 1
            return
        if req.unique > self.last_unique:
            send(req.header.unique, None, BlockingIOError(errno.EAGAIN, "INTERRUPT before its request"))

    def close(self) -> None:
        """The mount is gone: requests waiting behind a hold are cancelled (answered ``EIO``
        once their tasks end: nothing runs on a closed mount, and their holds are withdrawn),
        every open file closed, every node dropped."""
        self.closing = True
        self.pipeline.cancel_all(OSError(errno.EIO, "the mount is going away"))
        for fh in list(self.files):
            self._close_file(fh)
        for fh in list(self.dirs):
            self._close_dir(fh)
        for node in list(self.nodes.values()):
            self._close_node_handles(node)
            for link in node.links:
                self.export.discard(link)
        self.nodes.clear()
        self._by_inode.clear()

    # ------------------------------------------------------------------ nodes

    def _node(self, nodeid: int) -> Node:
        n = self.nodes.get(nodeid)
        if n is None:
            raise OSError(errno.ENOENT, f"unknown node {nodeid}")
        return n

    def _dir(self, nodeid: int) -> Node:
        n = self._node(nodeid)
        if n.kind != DIR:
            raise OSError(errno.ENOTDIR, "not a directory", n.path)
        return n

    def _cred(self, req: m.Request) -> Cred:
        """The request's :class:`Cred` — one per (uid, gid) while at most
        :data:`CREDS_KEPT_MAX` are kept and :attr:`owners` is the one it was made with (a
        Cred is immutable; when full, the kept ones are dropped and made again as needed)."""
        h = req.header
        key = (h.uid, h.gid)
        c = self._creds.get(key)
        if c is None or c.view is not self.owners:
            if len(self._creds) >= CREDS_KEPT_MAX:
                self._creds.clear()
            c = self._creds[key] = Cred(h.uid, h.gid, self.owners)
        return c

    def _names(self, path: str, inode: tuple[int, int], kind: str | None = None) -> bool:
        """``path`` names ``inode`` (of ``kind``: a reused inode number of another type is
        another file)."""
        try:
            a = self.provider.lookup(path)
        except OSError:
            return False
        return _inode(a) == inode and (kind is None or a.kind == kind)

    def _still_names(self, node: Node) -> bool:
        return self._names(node.path, node.inode, node.kind)

    def _add_name(self, node: Node, path: str) -> None:
        link = Link(path, node)
        node.links.insert(0, link)  # the newest name first: the one the kernel just used
        self.export.add(link)

    def _remember(self, path: str, a: Attr, count: int = 1) -> Node:
        """The node for the inode ``a`` found at ``path`` (made if new), its lookup count
        raised by ``count``. A known inode found under a new name is the same node if one
        of its names still names it (a hard link: the name is added); if none does, the
        host reused the inode number (or moved it behind our back): a new node."""
        key = _inode(a)
        n = self._by_inode.get(key)
        if n is not None and n.kind == a.kind:
            # one of its names already? asked of the registry by path: a node may have as many
            # names as the host allows links (ext4: 65,000), so never a walk of n.links here
            if any(type(x) is Link and x.node is n for x in self.export.fids_at(path)):
                n.lookups += count
                return n
            if any(self._names(link.path, key, n.kind) for link in n.links):
                self._add_name(n, path)
                n.lookups += count
                return n
        if len(self.nodes) >= self.limits.fids_per_connection_max:
            raise OSError(errno.ENFILE, f"more than {self.limits.fids_per_connection_max} nodes")
        n = Node(self._next_node, key, a.kind, lookups=count)
        self._next_node += 1
        self._add_name(n, path)
        self.nodes[n.nodeid] = n
        self._by_inode[key] = n
        if len(self.nodes) >= self._relief_at and self.on_node_pressure is not None:
            self._relieve()
        return n

    def _relieve(self) -> None:
        """The node table is filling (:data:`NODE_RELIEF_AT`): ask the kernel to forget the
        names of the oldest nodes not open (ids grow with age; each call goes on after the
        last node it named, round the table) — :data:`NODE_RELIEF_SHARE` of the table; then
        again once as many more nodes came, or once the table shrank below the mark and
        reached it again."""
        batch = max(1, int(self.limits.fids_per_connection_max * NODE_RELIEF_SHARE))
        paths: list[str] = []
        last = self._relieved_up_to
        for nodeid, n in self.nodes.items():  # oldest first: ids are handed out in order
            if nodeid <= last or n.files or nodeid == abi.FUSE_ROOT_ID:
                continue
            paths.append(n.path)
            last = nodeid
            if len(paths) >= batch:
                break
        else:
            last = abi.FUSE_ROOT_ID  # the end of the table: from the oldest again next time
        self._relieved_up_to = last
        self._relief_at = len(self.nodes) + batch
        if paths:
            self.on_node_pressure(paths)

    def _entry(self, path: str, a: Attr | None = None, cred: Cred | None = None) -> m.EntryOut:
        if a is None:
            a = self.provider.getattr(path, cred=cred)
        n = self._remember(path, a)
        return self._entry_out(n, a)

    @property
    def entry_valid_s(self) -> int:
        return COHERENT_ENTRY_VALID_S if self.coherent else ENTRY_VALID_S

    @property
    def attr_valid_s(self) -> int:
        return COHERENT_ATTR_VALID_S if self.coherent else ATTR_VALID_S

    def _entry_out(self, n: Node, a: Attr) -> m.EntryOut:
        self._told(n, a)
        return m.EntryOut(n.nodeid, GENERATION, self.entry_valid_s, self.attr_valid_s, 0, 0, fuse_attr(a))

    def _told(self, n: Node, a: Attr) -> None:
        """``a`` is about to be reported to the kernel for ``n``. Not coherent (no watcher),
        a regular file whose mtime, ctime or size moved since the last report was changed
        beside the mount (the mount's own writes update :attr:`Node.told`, :meth:`_own_write`):
        its pages are invalidated — what the kernel's ``AUTO_INVAL_DATA`` would do, which we
        do not ask for (it would also drop what our own writes cached)."""
        if n.kind != REG:
            return
        stamp = (a.mtime_ns, a.ctime_ns, a.size)
        if n.told is not None and n.told != stamp and not self.coherent and self.on_host_changed is not None:
            self.on_host_changed([n.path])
        n.told = stamp

    def _own_write(self, n: Node, h: FileHandle, write: Callable[[], object]):
        """``write()`` (a change of ``n``'s data through ``h``) — not coherent, its new
        (mtime, ctime, size) become what the kernel was told, after a host change found
        before it is invalidated (two ``fstat`` of the host file, only then)."""
        if self.coherent or n.told is None or self.on_host_changed is None:
            return write()
        before = h.fstat()
        if (before.mtime_ns, before.ctime_ns, before.size) != n.told:
            self.on_host_changed([n.path])
        result = write()
        after = h.fstat()
        n.told = (after.mtime_ns, after.ctime_ns, after.size)
        return result

    # ------------------------------------------------------------------ invalidation

    def _nodes_at(self, path: str) -> list[Node]:
        return [x.node for x in self.export.handles_at(path)
                if isinstance(x, Link) and self.nodes.get(x.node.nodeid) is x.node]

    def invalidations(self, paths) -> list[m.Notify]:
        """What the kernel must forget after ``paths`` (relative to the root) changed beside
        the mount: for each, the cached name under its parent's node (``NotifyInvalEntry``),
        the parent's attributes, and the attributes and page cache of the node(s) it names
        (``NotifyInvalInode``). Only nodes the kernel knows; duplicates once."""
        out: dict = {}
        for path in paths:
            for n in self._nodes_at(path):
                out[m.NotifyInvalInode(n.nodeid, 0, 0)] = None
            if path == "":
                continue
            name = path.rsplit("/", 1)[-1].encode("utf-8", "surrogateescape")
            if not name or len(name) > abi.NAME_BYTES_MAX:
                continue
            for parent in self._nodes_at(parent_of(path)):
                if parent.kind == DIR:
                    out[m.NotifyInvalEntry(parent.nodeid, name)] = None
                    out[m.NotifyInvalInode(parent.nodeid, -1, 0)] = None
                    self.negative.pop((parent.nodeid, name), None)
        return list(out)

    def invalidations_all(self) -> list[m.Notify]:
        """What the kernel must forget when anything may have changed (a rollback, a missed
        watcher event): every name and every node it knows, and every negative entry it
        may still hold from us."""
        paths = {link.path for n in self.nodes.values() for link in n.links}
        out = dict.fromkeys(self.invalidations(sorted(paths)))
        out.update(dict.fromkeys(m.NotifyInvalEntry(parent, name) for parent, name in self.negative
                                 if parent in self.nodes))
        self.negative.clear()
        return list(out)

    def _drop_lookups(self, nodeid: int, count: int) -> None:
        n = self.nodes.get(nodeid)
        if n is None or nodeid == abi.FUSE_ROOT_ID:
            return
        n.lookups -= min(count, n.lookups)
        if n.lookups == 0 and not n.files:
            self._drop_node(n)

    def _drop_node(self, n: Node) -> None:
        self._close_node_handles(n)
        self.nodes.pop(n.nodeid, None)
        if len(self.nodes) < self._relief_base:  # the kernel forgot enough: from the mark again
            self._relief_at = self._relief_base
        if self._by_inode.get(n.inode) is n:
            del self._by_inode[n.inode]
        for link in n.links:
            self.export.discard(link)

    def _links_at(self, path: str) -> list[Link]:
        """The node names the kernel knows at ``path`` now (a list: the callers change the set)."""
        return [x for x in self.export.fids_at(path) if isinstance(x, Link)]

    def _unlinked(self, path: str, links: list[Link] | None = None) -> None:
        """The name ``path`` was removed. A node with other names keeps those; a node that
        had only this one keeps it (calls then go through its open handles, or fail with
        ``ESTALE``), and no longer stands for its inode number, which the host may reuse.
        ``links``: :meth:`_links_at` of ``path``, taken by the caller before the removal (no
        request ran in between: nothing added or dropped a name there)."""
        for link in self._links_at(path) if links is None else links:
            n = link.node
            if len(n.links) > 1:
                n.links.remove(link)
                self.export.discard(link)
                continue
            if self._by_inode.get(n.inode) is n:
                del self._by_inode[n.inode]
            if n.kind == DIR:  # nothing reads a removed directory through it: closed now
                self._close_node_handles(n)
            elif n.ro is not None or n.rw is not None:  # no-open: kept until FORGET, never evicted
                n.pinned = True
                self._lru.pop(n.nodeid, None)

    def _attr(self, n: Node, cred: Cred | None = None, fh: int | None = None) -> Attr:
        """The node's inode's attributes — through an open handle, else by path while the
        path names it."""
        f = self.files.get(fh) if fh is not None else None
        h = f.handle if f is not None and f.node is n else n.handle
        if h is None and n.kind == DIR and self.no_open:
            h = self._dir_descriptor(n)
        if h is not None:
            return self.provider.fstat(h, n.path, cred=cred)
        try:
            a = self.provider.getattr(n.path, cred=cred)
        except OSError as e:
            if e.errno in _GONE:
                raise OSError(errno.ENOENT, "no such file", n.path) from None
            raise
        if (_inode(a) != n.inode or a.kind != n.kind) and n.nodeid != abi.FUSE_ROOT_ID:  # a reused number too
            raise OSError(errno.ESTALE, "the file this node named was removed or replaced", n.path)
        return a

    def _inode_handle(self, n: Node) -> FileHandle | None:
        """The handle a change through ``n`` must use, or None (act by path, which still
        names the node's inode); ``ESTALE`` when neither is possible."""
        h = n.handle
        if h is not None:
            return h
        if n.nodeid != abi.FUSE_ROOT_ID and not self._still_names(n):
            raise OSError(errno.ESTALE, "the file this node named was removed or replaced", n.path)
        return None

    # ------------------------------------------------------------------ session

    def _init(self, req: m.Init) -> m.InitOut:
        if req.major > abi.KERNEL_VERSION:  # the kernel sends INIT again with our major
            return m.InitOut(abi.KERNEL_VERSION, 0, 0, 0, 0, 0, 0, 0, 0)
        offered = req.flags | (req.flags2 << 32 if req.flags & abi.FUSE_INIT_EXT else 0)
        no_open = self.no_open_allowed and self.coherent and bool(offered & abi.FUSE_NO_OPEN_SUPPORT)
        # no-open: the kernel would skip both the OPEN carrying O_TRUNC and the truncating
        # SETATTR with ATOMIC_O_TRUNC granted, so it is not asked for (O_TRUNC is a SETATTR)
        wanted = WANTED_INIT_FLAGS & ~abi.FUSE_ATOMIC_O_TRUNC if no_open else WANTED_INIT_FLAGS
        try:
            out = negotiate_init(req, wanted, max_background=MAX_BACKGROUND,
                                 congestion_threshold=CONGESTION_THRESHOLD)
        except m.ProtocolError as e:
            raise OSError(e.errno, e.message) from None
        self.no_open = no_open
        self.minor = min(req.minor, out.minor)
        self.initialized = True
        return out

    def _destroy(self, req: m.Destroy) -> None:
        self.close()
        self.initialized = False

    def _interrupt(self, req: m.Interrupt) -> None:
        return None  # answered by submit (:meth:`_interrupted`): only a waiting request can be

    def _forget(self, req: m.Forget) -> None:
        self._drop_lookups(req.header.nodeid, req.nlookup)

    def _batch_forget(self, req: m.BatchForget) -> None:
        for nodeid, nlookup in req.forgets:
            self._drop_lookups(nodeid, nlookup)

    # ------------------------------------------------------------------ names

    def _lookup(self, req: m.Lookup) -> m.EntryOut:
        d = self._dir(req.header.nodeid)
        name = _name(req.name)
        path = d.path if name == "." else parent_of(d.path) if name == ".." else child(d.path, name)
        try:
            return self._entry(path, cred=self._cred(req))
        except OSError as e:
            if e.errno != errno.ENOENT or name in (".", ".."):
                raise
            if self._remember_negative(d, req.name):
                return m.EntryOut(0, 0, COHERENT_ENTRY_VALID_S, 0, 0, 0, _NO_ATTR)
            if self.negative_entries_short and not self.coherent:
                return m.EntryOut(0, 0, ENTRY_VALID_S, 0, 0, 0, _NO_ATTR)
            raise

    def _remember_negative(self, d: Node, name: bytes) -> bool:
        """Whether the missing ``name`` in ``d`` may be cached by the kernel as a negative
        entry (coherent only: the watcher's notifications drop it when the host makes the
        name; :meth:`invalidations_all` reaches it). Remembered until the kernel stops
        trusting it; none when :data:`NEGATIVE_ENTRIES_MAX` are."""
        if not self.coherent:
            return False
        now = time.monotonic()
        neg = self.negative
        while neg and next(iter(neg.values())) <= now:
            neg.popitem(last=False)
        key = (d.nodeid, bytes(name))
        if key not in neg and len(neg) >= NEGATIVE_ENTRIES_MAX:
            return False
        neg[key] = now + COHERENT_ENTRY_VALID_S
        neg.move_to_end(key)
        return True

    def _setgid_dir(self, d, cred: Cred, mode: int, is_dir: bool) -> tuple[int, int | None]:
        """``(mode, gid)`` of a new entry in directory ``d``: in a set-gid directory it takes
        the directory's group, and a new directory the set-gid bit — what a local filesystem
        does (the kernel leaves it to a FUSE server; a 9P guest's v9fs does it itself).
        Elsewhere ``(mode, None)``: the caller's group."""
        # no-open: through the directory node's own descriptor (:meth:`_dir_descriptor`)
        a = self._attr(d, cred) if self.no_open else self.provider.getattr(d.path, cred=cred)
        if not a.mode & _stat.S_ISGID:
            return mode, None
        return (mode | _stat.S_ISGID if is_dir else mode), a.gid

    def _mkdir(self, req: m.Mkdir) -> m.EntryOut:
        d = self._dir(req.header.nodeid)
        path = child(d.path, _name(req.name))
        cred = self._cred(req)
        mode, gid = self._setgid_dir(d, cred, req.mode & 0o7777, True)
        self.provider.mkdir(path, mode, cred=cred, gid=gid)
        return self._entry(path, cred=cred)

    def _mknod(self, req: m.Mknod) -> m.EntryOut:
        d = self._dir(req.header.nodeid)
        path = child(d.path, _name(req.name))
        cred = self._cred(req)
        fmt = req.mode & 0o170000
        _mode, gid = self._setgid_dir(d, cred, 0, False)
        if fmt == _stat.S_IFREG:  # mknod(2) of a regular file: an exclusive create
            handle, _made = self.provider.create(path, req.mode & 0o7777, os.O_WRONLY | os.O_EXCL, cred=cred,
                                                 gid=gid)
            handle.close()
        else:
            self.provider.mknod(path, req.mode & 0o7777, fmt, req.rdev, cred=cred, gid=gid)
        return self._entry(path, cred=cred)

    def _symlink(self, req: m.Symlink) -> m.EntryOut:
        d = self._dir(req.header.nodeid)
        path = child(d.path, _name(req.name))
        cred = self._cred(req)
        _mode, gid = self._setgid_dir(d, cred, 0, False)
        self.provider.symlink(_name(req.target), path, cred=cred, gid=gid)
        return self._entry(path, cred=cred)

    def _link(self, req: m.Link) -> m.EntryOut:
        d = self._dir(req.header.nodeid)
        old = self._node(req.oldnodeid)
        if old.kind == DIR:
            raise OSError(errno.EPERM, "hard link to a directory", old.path)
        path = child(d.path, _name(req.newname))
        if not self._still_names(old):  # never link whatever else is at its old name now
            raise OSError(errno.ESTALE, "the file this node named was removed or replaced", old.path)
        self.provider.link(old.path, path)
        return self._entry(path, cred=self._cred(req))

    def _unlink(self, req: m.Unlink) -> None:
        d = self._dir(req.header.nodeid)
        path = child(d.path, _name(req.name))
        links = self._links_at(path)  # one look at the names known there, for all three steps
        if not links:  # a name the kernel never looked up (or forgot): nothing to keep or drop
            self.provider.unlink(path)
            return
        self._hold_open(path, links)
        self.provider.unlink(path, reader=self._descriptor_at(path, links))
        self._unlinked(path, links)

    def _descriptor_at(self, path: str, links: list[Link] | None = None) -> FileHandle | None:
        """An open descriptor of a regular file's node at ``path``, if one has any: the undo
        core reads the file's preimage through it when it is still the file there (checked
        there, by inode) — no path resolution per read. ``links``: :meth:`_links_at`."""
        for link in self._links_at(path) if links is None else links:
            if link.node.kind == REG:
                h = link.node.handle
                if h is not None and not h.closed:
                    return h
        return None

    def _rmdir(self, req: m.Rmdir) -> None:
        d = self._dir(req.header.nodeid)
        path = child(d.path, _name(req.name))
        links = self._links_at(path)
        self.provider.rmdir(path)
        if links:
            self._unlinked(path, links)

    def _rename(self, req: m.Rename | m.Rename2) -> None:
        flags = getattr(req, "flags", 0)
        if flags & ~(abi.RENAME_NOREPLACE | abi.RENAME_EXCHANGE) or flags == abi.RENAME_NOREPLACE | abi.RENAME_EXCHANGE:
            raise OSError(errno.EINVAL, "RENAME_WHITEOUT is not served; NOREPLACE and EXCHANGE exclude each other")
        od, nd = self._dir(req.header.nodeid), self._dir(req.newdir)
        src, dst = child(od.path, _name(req.oldname)), child(nd.path, _name(req.newname))
        if flags & abi.RENAME_EXCHANGE:
            self._exchange(src, dst)
            return
        if flags & abi.RENAME_NOREPLACE:
            try:
                self.provider.lookup(dst)
            except OSError as e:
                if e.errno not in _GONE:
                    raise
            else:
                raise OSError(errno.EEXIST, "the new name exists (RENAME_NOREPLACE)", dst)
        a = self.provider.lookup(src)
        try:
            replaced = self.provider.lookup(dst)
        except OSError:
            replaced = None
        if replaced is not None and _inode(replaced) != _inode(a) and replaced.kind == REG:
            self._hold_open(dst)
        self.provider.rename(src, dst)
        if replaced is not None and _inode(replaced) != _inode(a):
            self._unlinked(dst)
        self.export.renamed(src, dst, a.kind == DIR)

    def _exchange(self, src: str, dst: str) -> None:
        """RENAME_EXCHANGE: both names stay, their objects (and the nodes and handles at or
        below them) swap."""
        a, b = self.provider.lookup(src), self.provider.lookup(dst)  # ENOENT before anything changes
        self.provider.exchange(src, dst)
        if _inode(a) != _inode(b):
            self.export.exchanged(src, dst, a.kind == DIR, b.kind == DIR)

    # ------------------------------------------------------------------ attributes

    def _getattr(self, req: m.Getattr) -> m.AttrOut:
        n = self._node(req.header.nodeid)
        fh = req.fh if req.getattr_flags & abi.FUSE_GETATTR_FH else None
        a = self._attr(n, self._cred(req), fh)
        self._told(n, a)
        return m.AttrOut(self.attr_valid_s, 0, fuse_attr(a))

    def _setattr(self, req: m.Setattr) -> m.AttrOut:
        n = self._node(req.header.nodeid)
        v = req.valid
        cred = self._cred(req)
        f = self.files.get(req.fh) if v & abi.FATTR_FH else None
        handle = f.handle if f is not None and f.node is n else self._inode_handle(n)

        def when(flag: int, now: int, sec: int, nsec: int) -> int | None:
            if not v & flag:
                return None
            if v & now:
                return -1
            if nsec >= 10**9:
                raise OSError(errno.EINVAL, "nanoseconds out of range")
            return host_seconds(sec) * 10**9 + nsec

        if v & abi.FATTR_SIZE and req.size > (1 << 63) - 1:
            raise OSError(errno.EFBIG, "size beyond the largest file offset")
        if not self.coherent and n.told is not None and n.kind == REG and self.on_host_changed is not None:
            # a host change before ours
            self._told(n, self._attr(n, cred, req.fh if f is not None else None))
        self.provider.setattr(
            n.path, handle=handle, mode=req.mode & 0o7777 if v & abi.FATTR_MODE else None,
            size=req.size if v & abi.FATTR_SIZE else None,
            atime_ns=when(abi.FATTR_ATIME, abi.FATTR_ATIME_NOW, req.atime, req.atimensec),
            mtime_ns=when(abi.FATTR_MTIME, abi.FATTR_MTIME_NOW, req.mtime, req.mtimensec),
            chown=bool(v & (abi.FATTR_UID | abi.FATTR_GID)),
            uid=req.uid if v & abi.FATTR_UID else None, gid=req.gid if v & abi.FATTR_GID else None, cred=cred)
        a = self._attr(n, cred, req.fh if f is not None else None)
        n.told = (a.mtime_ns, a.ctime_ns, a.size) if n.kind == REG else None  # our own change
        return m.AttrOut(self.attr_valid_s, 0, fuse_attr(a))

    def _readlink(self, req: m.Readlink) -> m.Data:
        n = self._node(req.header.nodeid)
        if n.kind != LNK:
            raise OSError(errno.EINVAL, "not a symlink", n.path)
        return m.Data(self.provider.readlink(n.path).encode("utf-8", "surrogateescape"))

    def _access(self, req: m.Access) -> None:
        self._attr(self._node(req.header.nodeid))  # exists; the permission check is the kernel's

    def _statfs(self, req: m.Statfs) -> m.StatfsOut:
        s = self.provider.statfs()
        return m.StatfsOut(s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.bsize)

    # ------------------------------------------------------------------ files

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _opened(self, open_fn):
        """``open_fn()`` — a Provider call returning a new host handle (or a tuple holding
        one) — within this mount's and the process's descriptor limits."""
        cap = min(self.limits.open_files_per_connection_max,
                  max(1, int(self.descriptors.capacity * self.limits.open_files_per_connection_share_max)))
        if len(self.files) >= cap:
            raise OSError(errno.EMFILE, f"more than {cap} open files on this mount")
        self.descriptors.acquire()
        try:
            return open_fn()
        except BaseException:
            self.descriptors.release()
            raise

    def _add_file(self, n: Node, handle: FileHandle, direct: bool = False) -> int:
        fh = self._new_fh()
        f = OpenFile(n, handle, direct)
        n.files.append(f)
        self.files[fh] = f
        return fh

    def _close_file(self, fh: int) -> None:
        f = self.files.pop(fh, None)
        if f is None:
            return
        f.node.files.remove(f)
        self.descriptors.release()
        f.handle.close()
        if f.node.lookups == 0 and not f.node.files and f.node.nodeid != abi.FUSE_ROOT_ID:
            self._drop_node(f.node)

    def _open(self, req: m.Open) -> m.OpenOut:
        if self.no_open:  # the kernel remembers it: no OPEN, RELEASE or FLUSH any more
            raise OSError(errno.ENOSYS, "no-open: READ and WRITE use the node's own descriptors")
        n = self._node(req.header.nodeid)
        if n.kind == DIR:
            raise OSError(errno.EISDIR, "is a directory", n.path)
        if n.kind != REG:
            raise OSError(errno.EPERM, "special files are never opened on the host", n.path)
        flags = req.flags & (os.O_ACCMODE | os.O_APPEND | os.O_TRUNC)
        if not self._still_names(n):  # never open (let alone truncate) another file now at its name
            raise OSError(errno.ESTALE, "the file this node named was removed or replaced", n.path)
        handle = self._opened(lambda: self.provider.open(n.path, flags, cred=self._cred(req)))
        if not _is_node_inode(handle, n):
            handle.close()
            self.descriptors.release()
            raise OSError(errno.ESTALE, "the file this node named was replaced", n.path)
        return self._opened_out(n, handle, req.flags)

    def _opened_out(self, n: Node, handle: FileHandle, flags: int) -> m.OpenOut:
        """The reply to an OPEN or CREATE of ``n`` that opened ``handle`` (not yet on ``n``)."""
        direct = self._direct(n, flags)
        return m.OpenOut(self._add_file(n, handle, direct), self._open_flags(direct))

    def _direct(self, n: Node, flags: int) -> bool:
        """Whether a new open of ``n`` with ``flags`` gets ``FOPEN_DIRECT_IO``: only with
        :attr:`direct_io_write_only` and not coherent (the kernel drops ``n``'s pages at each
        open); then if another handle of ``n`` is direct (a reader opened beside a direct
        writer must not cache pages its writes leave stale: Linux 6.1's direct write drops
        none), or if the open is write-only and ``n`` has no other handle (write-only: it can
        never be mapped, so refusing shared mmap costs nothing; no other handle: no cached
        reader or map that would cache pages between its writes — the pages cached before
        are dropped by this very open). Invariant: ``n``'s handles are all direct or all cached.
        With :attr:`direct_io_all`: every open, whatever else holds."""
        if self.direct_io_all:
            return True
        if not self.direct_io_write_only or self.coherent:
            return False
        if n.files:
            return any(f.direct for f in n.files)
        return flags & os.O_ACCMODE == os.O_WRONLY

    def _open_flags(self, direct: bool = False) -> int:
        """``FOPEN_NOFLUSH`` always: nothing is buffered here, so a close sends no FLUSH (dirty
        pages of a shared mmap are written back at msync/munmap, as before). Coherent: keep
        the page cache across opens (the watcher's notifications drop what the host changes);
        otherwise the kernel drops it at each open. ``direct``: ``FOPEN_DIRECT_IO``."""
        return (abi.FOPEN_NOFLUSH | (abi.FOPEN_KEEP_CACHE if self.coherent else 0)
                | (abi.FOPEN_DIRECT_IO if direct else 0))

    def _create(self, req: m.Create) -> m.CreateOut:
        d = self._dir(req.header.nodeid)
        path = child(d.path, _name(req.name))
        cred = self._cred(req)
        _mode, gid = self._setgid_dir(d, cred, 0, False)
        if self.no_open:
            return self._create_no_open(req, path, cred, gid)
        handle, _made = self._opened(lambda: self.provider.create(path, req.mode & 0o7777, req.flags, cred=cred,
                                                                  gid=gid))
        n, a = self._remember_created(handle, path, cred)
        return m.CreateOut(self._entry_out(n, a), self._opened_out(n, handle, req.flags))

    def _remember_created(self, handle, path: str, cred: Cred):
        """The node and attributes of a file CREATE just made, read through its new
        descriptor; if that fails the descriptor is closed and its count given back."""
        try:
            a = self.provider.fstat(handle, path, cred=cred)
            return self._remember(path, a), a
        except BaseException:
            handle.close()
            self.descriptors.release()
            raise

    def _create_no_open(self, req: m.Create, path: str, cred: Cred, gid: int | None) -> m.CreateOut:
        """CREATE without handles: the new file's descriptor becomes its node's own
        (answered with handle 0, as a no-open OPEN would be). Opened read-write where the
        program asked write-only (reads of partial pages need it), without ``O_APPEND``
        (each WRITE says whether it appends)."""
        flags = req.flags & ~os.O_APPEND
        if flags & os.O_ACCMODE == os.O_WRONLY:
            flags = flags & ~os.O_ACCMODE | os.O_RDWR
        self._take_descriptor()
        try:
            handle, _made = self.provider.create(path, req.mode & 0o7777, flags, cred=cred, gid=gid)
        except BaseException:
            self.descriptors.release()
            raise
        n, a = self._remember_created(handle, path, cred)
        self._keep_handle(n, handle)
        return m.CreateOut(self._entry_out(n, a), m.OpenOut(0, self._open_flags()))

    def _file(self, fh: int) -> OpenFile:
        f = self.files.get(fh)
        if f is None:
            raise OSError(errno.EBADF, f"unknown file handle {fh}")
        return f

    # ------------------------------------------------------------------ no-open: nodes' own descriptors

    def _io(self, nodeid: int, fh: int, write: bool) -> OpenFile:
        """The open file a READ/WRITE/… names: its handle, or (no-open: handle 0) the node's own
        descriptor — one open for writing if ``write`` (``EBADF`` without)."""
        f = self.files.get(fh)
        if f is not None or not self.no_open:
            return f if f is not None else self._file(fh)
        n = self._node(nodeid)
        return OpenFile(n, self._node_handle(n, write))

    def _node_handle(self, n: Node, write: bool) -> FileHandle:
        """``n``'s own descriptor for reading (read-write or read-only) or writing, opened by
        path on first use while the path still names ``n``'s inode (``ESTALE`` otherwise)."""
        if n.kind != REG:
            raise OSError(errno.EBADF, "not a regular file", n.path)
        rw = n.rw if n.rw is not None and not n.rw.closed else None
        h = rw if write or (rw is not None and rw.flags & os.O_ACCMODE == os.O_RDWR) else n.ro
        if h is not None and not h.closed:
            if n.nodeid in self._lru:
                self._lru.move_to_end(n.nodeid)
            return h
        if n.pinned:
            raise OSError(errno.EBADF, "removed while open, and not open for this here", n.path)
        # opening for writing may change the file (set-id bits cleared): only the node's own
        # inode; a read-only open changes nothing, so the inode check after it suffices
        if write and not self._still_names(n):
            raise OSError(errno.ESTALE, "the file this node named was removed or replaced", n.path)
        self._take_descriptor()
        try:
            h = self._open_by_path(n.path, write)
        except BaseException as e:
            self.descriptors.release()
            if isinstance(e, OSError) and e.errno in _GONE:
                raise OSError(errno.ESTALE, "the file this node named was removed or replaced", n.path) from None
            raise
        if not _is_node_inode(h, n):
            h.close()
            self.descriptors.release()
            raise OSError(errno.ESTALE, "the file this node named was replaced", n.path)
        self._keep_handle(n, h)
        return h

    def _dir_descriptor(self, n: Node) -> FileHandle | None:
        """No-open: directory ``n``'s own read-only descriptor, for its attributes only (a
        GETATTR, a CREATE's set-gid check: ``fstat`` + ``flistxattr`` instead of a path
        resolution each time) — opened by path while the path names ``n``'s inode, in the
        same LRU and budget as files' (:meth:`_take_descriptor`), closed when the directory is
        removed through the mount. None where it cannot be had (another inode at the path,
        no permission, a host without directory handles): the caller looks by path."""
        h = n.ro
        if h is not None and not h.closed:
            if n.nodeid in self._lru:
                self._lru.move_to_end(n.nodeid)
            return h
        if n.pinned or not n.links:
            return None
        self._take_descriptor()
        h = self._open_dir_if_same(n)
        if h is not None:
            self._keep_handle(n, h)
        return h

    def _open_dir_if_same(self, n: Node) -> FileHandle | None:
        """``n``'s directory opened by path, if that is still ``n``'s inode; else None, and
        the descriptor the caller took for it is given back."""
        try:
            h = self.provider.open_dir(n.path)
        except OSError:
            self.descriptors.release()
            return None
        try:
            same = _inode(h.fstat()) == n.inode
        except OSError:
            same = False
        if not same:
            h.close()
            self.descriptors.release()
            return None
        return h

    def _open_by_path(self, path: str, write: bool) -> FileHandle:
        if not write:
            return self.provider.open(path, os.O_RDONLY)
        try:
            return self.provider.open(path, os.O_RDWR)
        except PermissionError:  # an unprivileged server and a file it may only write
            return self.provider.open(path, os.O_WRONLY)

    def _keep_handle(self, n: Node, h: FileHandle) -> None:
        """``h`` (its descriptor already counted) becomes ``n``'s own; a duplicate is closed."""
        slot = "ro" if h.flags & os.O_ACCMODE == os.O_RDONLY else "rw"
        old = getattr(n, slot)
        if old is not None and not old.closed:
            h.close()
            self.descriptors.release()
        else:
            setattr(n, slot, h)
        if not n.pinned:
            self._lru[n.nodeid] = n
            self._lru.move_to_end(n.nodeid)

    @property
    def node_descriptors_max(self) -> int:
        """How many nodes may keep descriptors now (no-open): :data:`NODE_DESCRIPTORS_MAX`, and
        at most half of this mount's share of the process's descriptor budget (the share
        ``open_files_per_connection_share_max`` an OPEN-handle mount may hold), at least one."""
        return self._node_bound(self.descriptors.capacity)

    def _node_bound(self, capacity: int) -> int:
        share = int(capacity * self.limits.open_files_per_connection_share_max)
        return max(1, min(NODE_DESCRIPTORS_MAX, share // 2))

    def _take_descriptor(self) -> None:
        """Count the descriptor a node is about to open in the budget (``ENFILE`` if none is
        left; the caller releases it if the open fails). At most :attr:`node_descriptors_max`
        nodes keep descriptors: first close the least recently used one's (it reopens by path
        when next used). Also while the process's budget has no descriptor left for the one
        about to be opened (other mounts or servers of this process hold the rest): this
        mount's idle ones go first, not the request."""
        budget = self.descriptors
        capacity = budget.capacity  # the soft RLIMIT_NOFILE, read once here (a getrlimit) ...
        bound = self._node_bound(capacity)
        while self._lru and (len(self._lru) >= bound or budget.held >= capacity):
            _nodeid, n = self._lru.popitem(last=False)
            self._close_node_handles(n)
        budget.acquire(capacity)  # ... and used for the count too

    def _close_node_handles(self, n: Node) -> None:
        self._lru.pop(n.nodeid, None)
        for slot in ("ro", "rw"):
            h = getattr(n, slot)
            if h is not None:
                setattr(n, slot, None)
                if not h.closed:
                    h.close()
                    self.descriptors.release()

    def _hold_open(self, path: str, links: list[Link] | None = None) -> None:
        """No-open, before the name ``path`` is removed (unlink, rename over it): a regular
        file known to the kernel under no other name gets its own descriptors now — a
        program may hold it open, and only the kernel knows — which live until FORGET.
        ``links``: :meth:`_links_at` of ``path`` (opening descriptors adds or drops no name)."""
        if not self.no_open:
            return
        for link in self._links_at(path) if links is None else links:
            n = link.node
            if n.kind != REG or len(n.links) > 1 or self.nodes.get(n.nodeid) is not n:
                continue
            try:
                self._node_handle(n, write=True)
            except OSError:
                try:
                    self._node_handle(n, write=False)
                except OSError:
                    pass  # gone or replaced already: nothing of it to keep

    def _read(self, req: m.Read) -> m.Data:
        f = self._io(req.header.nodeid, req.fh, write=False)
        if req.offset > (1 << 63) - 1:
            raise OSError(errno.EINVAL, "offset beyond the largest file offset")
        return m.Data(f.handle.pread(min(req.size, abi.MAX_WRITE_BYTES), req.offset))

    def _write(self, req: m.Write) -> m.WriteOut:
        f = self._io(req.header.nodeid, req.fh, write=True)
        if req.offset > (1 << 63) - 1:
            raise OSError(errno.EFBIG, "offset beyond the largest file offset")
        offset = req.offset
        if (f.handle.flags & os.O_APPEND == 0 and req.flags & os.O_APPEND
                and not req.write_flags & abi.FUSE_WRITE_CACHE):
            offset = f.handle.fstat().size  # no-open: an O_APPEND write(2) appends at the host's end
        # HANDLE_KILLPRIV_V2: the kernel left the capability to us (set-id bits: Provider.write)
        self.provider.drop_capability(f.handle, f.node.path)
        # req.data: a read-only view of the request's own bytes (no copy of up to 1 MiB here)
        return m.WriteOut(self._own_write(f.node, f.handle, lambda: self.provider.write(
            f.handle, f.node.path, offset, req.data, cred=self._cred(req))))

    def _fallocate(self, req: m.Fallocate) -> None:
        f = self._io(req.header.nodeid, req.fh, write=True)
        if req.offset > _OFF_MAX or req.length > _OFF_MAX - req.offset:
            raise OSError(errno.EFBIG, "beyond the largest file offset")
        self._own_write(f.node, f.handle, lambda: self.provider.fallocate(
            f.handle, f.node.path, req.offset, req.length, req.mode, cred=self._cred(req)))

    def _copy_file_range(self, req: m.CopyFileRange) -> m.WriteOut:
        """From the open file ``fh_in`` to ``fh_out`` (of node ``nodeid_out``); the count
        copied (at most :data:`~sandbox.mounts.provider.COPY_FILE_RANGE_BYTES_MAX`)."""
        src = self._io(req.header.nodeid, req.fh_in, write=False)
        dst = self._io(req.nodeid_out, req.fh_out, write=True)
        if dst.node.nodeid != req.nodeid_out or req.flags:
            raise OSError(errno.EINVAL, "copy_file_range: flags, or a handle of another node")
        if req.off_in > _OFF_MAX or req.off_out > _OFF_MAX:
            raise OSError(errno.EOVERFLOW, "beyond the largest file offset")
        length = min(req.len, _OFF_MAX - req.off_out)
        return m.WriteOut(self._own_write(dst.node, dst.handle, lambda: self.provider.copy_file_range(
            src.handle, src.node.path, dst.handle, dst.node.path, req.off_in, req.off_out, length,
            cred=self._cred(req))))

    def _lseek(self, req: m.Lseek) -> m.LseekOut:
        """SEEK_DATA/SEEK_HOLE through the open file's descriptor (the kernel answers
        SEEK_SET/CUR/END itself); ``ENXIO`` at or past EOF, as lseek(2)."""
        f = self._io(req.header.nodeid, req.fh, write=False)
        if req.offset > _OFF_MAX:
            raise OSError(errno.ENXIO, "beyond the largest file offset")
        return m.LseekOut(self.provider.lseek(f.handle, f.node.path, req.offset, req.whence))

    def _release(self, req: m.Release) -> None:
        self._close_file(req.fh)

    def _flush(self, req: m.Flush) -> None:
        if self.no_open:  # a no-open file has no FOPEN_NOFLUSH: ENOSYS stops FLUSH for good
            raise OSError(errno.ENOSYS, "nothing is buffered here")
        self._file(req.fh)  # writes are never buffered here: nothing to flush

    def _fsync(self, req: m.Fsync) -> None:
        f = self._io(req.header.nodeid, req.fh, write=False)
        self.provider.fsync(f.handle, bool(req.fsync_flags & abi.FUSE_FSYNC_FDATASYNC))

    # ------------------------------------------------------------------ directories

    def _opendir(self, req: m.Opendir) -> m.OpenOut:
        n = self._dir(req.header.nodeid)
        held = None if self.no_open else self._listing_descriptor(n)
        try:
            listing = held
            if held is None:
                self._attr(n)  # still there (ESTALE/ENOENT otherwise); with ``held``: its inode, checked
                if self.no_open:  # the node's own descriptor, if it has one: its inode, no path resolved
                    listing = n.ro if n.ro is not None and not n.ro.closed else None
            budget = self.limits.dir_listing_bytes_per_connection_max
            over = OSError(errno.ENOMEM, f"directory listings over {budget} bytes held on this mount")
            room = budget - self.listing_bytes - LISTING_DOTS_COST  # the host reads the directory only up to it
            try:
                names = [".", ".."] + sorted(self.provider.listdir(n.path, handle=listing, limit_bytes=max(room, 0)))
            except ListingTooLarge:
                raise over from None
            cost = listing_cost(names)
            if self.listing_bytes + cost > budget:  # room < 0: not even "." and ".." fit
                raise over
        except BaseException:
            if held is not None:
                held.close()
                self.descriptors.release()
                self._listing_descriptors -= 1
            raise
        fh = self._new_fh()
        self.dirs[fh] = OpenDir(n, names, cost, held)
        self.listing_bytes += cost
        return m.OpenOut(fh, 0)

    def _listing_descriptor(self, n: Node) -> FileHandle | None:
        """Not no-open: a read-only descriptor of directory ``n`` for one OPENDIR..RELEASEDIR
        (READDIRPLUS then reads its entries' attributes beneath it: ``fstatat`` and
        ``llistxattr``, where a path takes four calls), counted in the process's descriptor
        budget — opened by path, kept only while it is ``n``'s inode. None (the listing looks
        by path, as before) where it cannot be had: :data:`LISTING_DESCRIPTORS_MAX` held
        already, no descriptor left, gone, replaced, a host without directory handles; the
        caller's path look then says why, if anything is wrong."""
        if self._listing_descriptors >= LISTING_DESCRIPTORS_MAX:
            return None
        try:
            self.descriptors.acquire()
        except OSError:
            return None
        h = self._open_dir_if_same(n)
        if h is not None:
            self._listing_descriptors += 1
        return h

    def _close_dir(self, fh: int) -> None:
        d = self.dirs.pop(fh, None)
        if d is not None:
            self.listing_bytes -= d.cost
            if d.handle is not None:
                d.handle.close()
                self.descriptors.release()
                self._listing_descriptors -= 1

    def _releasedir(self, req: m.Releasedir) -> None:
        self._close_dir(req.fh)

    def _fsyncdir(self, req: m.Fsyncdir) -> None:
        if req.fh not in self.dirs:
            raise OSError(errno.EBADF, f"unknown directory handle {req.fh}")

    def _readdir(self, req: m.Readdir | m.Readdirplus) -> m.Data:
        d = self.dirs.get(req.fh)
        if d is None:
            raise OSError(errno.EBADF, f"unknown directory handle {req.fh}")
        plus = isinstance(req, m.Readdirplus)
        packer = DirentPacker(min(req.size, abi.MAX_WRITE_BYTES), plus)
        base = d.node.path
        # each entry looked up through a descriptor of the directory (READDIRPLUS's attributes: 2
        # system calls where a path takes 4; READDIR's inode and type: 1 where a path takes 3):
        # no-open, the node's own; else the one OPENDIR took; where none, by path
        try:
            held = self._dir_descriptor(d.node) if self.no_open else d.handle
        except OSError:  # no descriptor left in the budget (ENFILE): by path
            held = None
        cred = self._cred(req)
        # each entry's fuse_entry_out after its nodeid (what _entry_out builds, as values)
        entry_head = (GENERATION, self.entry_valid_s, self.attr_valid_s, 0, 0)
        for i in range(req.offset, len(d.names)):
            name = d.names[i]
            raw = name.encode("utf-8", "surrogateescape")
            if not packer.fits(len(raw)):  # full: not looked up now (the next READDIR starts here)
                break
            dots = name in (".", "..")
            path = base if name == "." else parent_of(base) if name == ".." else child(base, name)
            if name == ".." and base:
                ino = self._known_directory_ino(path)
                if ino is not None:  # only the inode and the type are sent: no host call
                    if not packer.add(ino & (2**64 - 1), i + 1, _DT[DIR], raw):
                        break
                    continue
            try:
                if name == "." and held is not None:  # the listed inode itself
                    a = held.fstat()
                elif not plus or dots:  # only the inode and the type are sent for these
                    a = self.provider.lookup(path) if held is None or name == ".." else self.provider.lookup_at(held, path)
                elif held is not None:
                    a = self.provider.getattr_at(held, path, cred=cred)
                else:
                    a = self.provider.getattr(path, cred=cred)
            except OSError:
                continue  # vanished since OPENDIR: skipped, the offsets stay stable
            if not plus or dots:  # "." and "..": nodeid 0, the kernel takes no lookup for these
                if not packer.add(a.ino & (2**64 - 1), i + 1, _dtype(a), raw):
                    break
                continue
            try:
                n = self._remember(path, a, count=0)
            except OSError:  # the node table is full (ENFILE): a short listing, if anything fits
                if not len(packer):
                    raise
                break
            self._told(n, a)
            if not packer.add_entry(a.ino & _U64, i + 1, _dtype(a), raw, (n.nodeid, *entry_head, *fuse_attr_values(a))):
                if n.lookups == 0 and not n.files:
                    self._drop_node(n)
                break
            n.lookups += 1
        return m.Data(packer.bytes())

    def _known_directory_ino(self, path: str) -> int | None:
        """The inode number of the directory node this mount knows at ``path`` (a listing's
        ``..``: the kernel reached the listed directory through it, so it is known while the
        listing is), or None. The inode the node was looked up as — the directory that holds
        the listed one even if the host has since moved it and put another at ``path``."""
        for f in self.export.fids_at(path):
            if type(f) is Link and f.node.kind == DIR:
                return f.node.inode[0]
        return None

    # ------------------------------------------------------------------ xattrs

    def _getxattr(self, req: m.Getxattr):
        n = self._node(req.header.nodeid)
        value = self.provider.getxattr(n.path, _xattr_name(req.name), handle=n.handle)
        return self._sized(value, req.size)

    def _listxattr(self, req: m.Listxattr):
        n = self._node(req.header.nodeid)
        names = [x for x in self.provider.listxattr(n.path, handle=n.handle) if not x.startswith(ACL_XATTR_PREFIX)]
        return self._sized(b"".join(x.encode("utf-8", "surrogateescape") + b"\0" for x in names), req.size)

    @staticmethod
    def _sized(value: bytes, size: int):
        if len(value) > XATTR_SIZE_MAX:
            raise OSError(errno.E2BIG, "xattr larger than 64 KiB")
        if size == 0:
            return m.GetxattrOut(len(value))
        if len(value) > size:
            raise OSError(errno.ERANGE, "the buffer is too small")
        return m.Data(value)

    def _setxattr(self, req: m.Setxattr) -> None:
        n = self._node(req.header.nodeid)
        self.provider.setxattr(n.path, _xattr_name(req.name), bytes(req.value), req.flags, handle=self._inode_handle(n))

    def _removexattr(self, req: m.Removexattr) -> None:
        n = self._node(req.header.nodeid)
        self.provider.removexattr(n.path, _xattr_name(req.name), handle=self._inode_handle(n))


__all__ = ["Dispatcher", "HoldRequired", "Node", "errno_of", "fuse_attr"]
