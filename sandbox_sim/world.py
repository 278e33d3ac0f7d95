"""A world: a working folder and its undo store that can crash and be reopened.

``World("sim")`` keeps both in memory (MemoryHostFS, deterministic clock, fault hook
built in); ``World("sim-reflink")`` is the same on a simulated disk that can share
extents (:class:`sandbox.hostfs.memory.ReflinkMemoryHostFS`), so large preimages are stored raw as on XFS. ``World("real", tmp)`` uses two real temp directories; faults are injected
by :class:`FaultyHostFS`, a wrapper calling the same injector before each call. The
same model tests run on both, so the simulation never drifts from a real filesystem.

``crash(ws)`` is process death: the workspace object is abandoned without any cleanup
(no step closed, no lock released by our code), and the lock drops as the kernel
would drop a dead process's ``flock``.
"""

from __future__ import annotations

import contextlib
import os

from sandbox.core.workspace import Workspace
from sandbox.hostfs import FileHandle, HostFS
from sandbox.hostfs.real import RealHostFS
from sandbox.hostfs.memory import MemoryHostFS, ReflinkMemoryHostFS, SimClock

from . import oracle
from .faults import FaultInjector, SimulatedCrash


class FaultyHandle:
    """A handle of a :class:`FaultyHostFS`: the injector is called before each call, with
    the op names MemoryFileHandle uses (``pwrite`` is a ``write``, torn like a path write)."""

    _OPS = {"pread": "read", "read_own": "read", "pwrite": "write", "truncate": "truncate", "fsync": "fsync",
            "fstat": "fstat", "is_inode_of": "fstat",
            "chmod": "chmod", "utime": "utime", "chown": "chown", "listxattr": "listxattr", "getxattr": "getxattr",
            "setxattr": "setxattr", "removexattr": "removexattr", "fallocate": "fallocate",
            "copy_range_to": "copy_file_range", "lseek": "lseek",
            # a directory's handle (HostFS.open_dir)
            "listdir": "listdir", "getattr_at": "getattr", "getattr_xattr_names_at": "getattr", "getxattr_at": "getxattr"}
    #: what passes without the injector: no host call (or only the descriptor's close)
    _UNFAULTED = frozenset({"close", "closed", "path", "flags"})

    def __init__(self, fs: "FaultyHostFS", inner):
        self._fs = fs
        self.inner = inner

    def __getattr__(self, attr):
        fn = getattr(self.inner, attr)
        op = self._OPS.get(attr)
        if op is None:
            if attr in self._UNFAULTED or attr.startswith("_"):
                return fn
            # a handle method nobody mapped would reach the disk without a fault
            raise AttributeError(f"FaultyHandle: {attr!r} has no fault op (add it to FaultyHandle._OPS)")

        def call(*args, **kwargs):
            nbytes = len(args[0]) if op == "write" else len(args[-1]) if op == "setxattr" else 0
            limit = self._fs.injector(self._fs, op, self.inner.path, nbytes)
            if op == "write" and limit is not None:
                data, offset = args
                self.inner.pwrite(data[:limit], offset)
                self._fs.injector.after_torn_write(self._fs, self.inner.path, limit)
            return fn(*args, **kwargs)

        return call

    def pwrite_all(self, data: bytes, offset: int) -> None:
        type(self.inner).pwrite_all(self, data, offset)  # the loop, over the faulty pwrite

    def xattrs(self) -> dict:
        return type(self.inner).xattrs(self)

    def fstat_xattr_names(self):
        return FileHandle.fstat_xattr_names(self)  # its fstat and listxattr, each through the injector

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.inner.close()


class FaultyEntry:
    """An entry of a :class:`FaultyHostFS` (:meth:`HostFS.entry`): the inner disk's own entry —
    a real disk resolves the parent once and removes through it (``_RealEntry``) — with the
    injector called before each call under the op names a simulated disk's entry uses
    (``lstat``, ``listxattr``/``getxattr``, ``unlink``, ``rmdir``); its reader is opened as an
    ``open`` and wrapped in a :class:`FaultyHandle`. Taking the entry is no call of its own."""

    def __init__(self, fs: "FaultyHostFS", inner):
        self._fs, self.inner, self.path = fs, inner, inner.path

    def _call(self, op: str) -> None:
        self._fs.injector(self._fs, op, self.path, 0)

    def lstat(self):
        self._call("lstat")
        return self.inner.lstat()

    def lstat_or_none(self):
        self._call("lstat")
        return self.inner.lstat_or_none()

    def xattrs(self) -> dict:
        self._call("listxattr")
        out = self.inner.xattrs()
        for _ in out:  # reads change nothing: faulting them after the read is the same state
            self._call("getxattr")
        return out

    def reader(self, st):
        try:
            self._call("open")
        except OSError:
            return None  # Entry.reader: any failure is None (the caller reads by path)
        handle = self.inner.reader(st)
        return None if handle is None else FaultyHandle(self._fs, handle)

    def unlink(self) -> None:
        self._call("unlink")
        self.inner.unlink()

    def rmdir(self) -> None:
        self._call("rmdir")
        self.inner.rmdir()

    def create_handle(self, mode: int, flags: int = os.O_WRONLY):
        self._call("create_handle")
        return FaultyHandle(self._fs, self.inner.create_handle(mode, flags))

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> "FaultyEntry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FaultyHostFS(HostFS):
    """Any HostFS with the injector called before each operation (used for real dirs);
    the handles it opens are wrapped in a :class:`FaultyHandle` and its entries in a
    :class:`FaultyEntry`, so the inner disk's own handle and entry code runs under faults too
    (``entry``, ``open_dir``, ``append_handle`` are forwarded, not the base's fallbacks)."""

    def __init__(self, inner: HostFS, injector: FaultInjector):
        self.inner = inner
        self.name = inner.name
        self.injector = injector

    def __getattr__(self, op):
        fn = getattr(self.inner, op)

        def call(*args, **kwargs):
            nbytes = len(args[-1]) if op in ("write", "setxattr") else 0
            path = args[0] if args and isinstance(args[0], str) else ""
            limit = self.injector(self, op, path, nbytes)
            if op == "write" and limit is not None:
                path, offset, data = args
                self.inner.write(path, offset, data[:limit])
                self.injector.after_torn_write(self, path, limit)
            result = fn(*args, **kwargs)
            return FaultyHandle(self, result) if op in ("open", "create_handle") else result

        return call

    def entry(self, path: str) -> FaultyEntry:
        return FaultyEntry(self, self.inner.entry(path))

    def open_dir(self, path: str) -> FaultyHandle:
        self.injector(self, "open", path, 0)  # as MemoryHostFS.open_dir
        return FaultyHandle(self, self.inner.open_dir(path))

    def append_handle(self, path: str) -> FaultyHandle | None:
        self.injector(self, "open", path, 0)
        handle = self.inner.append_handle(path)
        return None if handle is None else FaultyHandle(self, handle)


# HostFS declares these abstract; route them all through __getattr__'s wrapper.
for _name in list(HostFS.__abstractmethods__) + ["clone_to"]:
    setattr(FaultyHostFS, _name, property(lambda self, _n=_name: FaultyHostFS.__getattr__(self, _n)))
FaultyHostFS.__abstractmethods__ = frozenset()


class World:
    def __init__(self, kind: str = "sim", tmp: str | None = None):
        self.kind = kind
        self._injector = FaultInjector()
        self._paused = False
        if kind in ("sim", "sim-reflink"):
            disk = ReflinkMemoryHostFS if kind == "sim-reflink" else MemoryHostFS
            clock = SimClock()
            self.clock_ns = clock
            self.work = disk("work", clock=clock)
            self.store = disk("store", clock=clock)
            self._work_view, self._store_view = self.work, self.store
            self._rehook()
        elif kind == "real":
            assert tmp is not None
            os.makedirs(os.path.join(tmp, "work"), exist_ok=True)
            os.makedirs(os.path.join(tmp, "store"), exist_ok=True)
            self.work = RealHostFS(os.path.join(tmp, "work"), name="work")
            self.store = RealHostFS(os.path.join(tmp, "store"), name="store")
            self.clock_ns = None
            self._work_view = FaultyHostFS(self.work, self._hook_obj())
            self._store_view = FaultyHostFS(self.store, self._hook_obj())
        else:
            raise ValueError(kind)
        self.now_s = 1000.0  # the workspace's step clock (ambient idle, quiescence, holds)
        # a simulated working disk's snapshot, read again only where it may have changed
        self._kept = oracle.KeptSnapshot(self.work) if isinstance(self.work, MemoryHostFS) else None

    # The injector can be swapped per run and paused. A simulated disk is attached to the
    # current injector (``FaultInjector.attach``: it calls the injector itself, or only counts
    # into it while nothing is armed — no hop per host call) and to none while paused; both
    # setters re-attach the disks, so the disks always count into the current injector.
    @property
    def injector(self) -> FaultInjector:
        return self._injector

    @injector.setter
    def injector(self, injector: FaultInjector) -> None:
        self._injector = injector
        self._rehook()

    @property
    def injector_paused(self) -> bool:
        return self._paused

    @injector_paused.setter
    def injector_paused(self, paused: bool) -> None:
        self._paused = paused
        self._rehook()

    def _rehook(self) -> None:
        want = None if self.__dict__.get("_paused") else self.__dict__.get("_injector")
        attached = self.__dict__.get("_attached")
        # the simulated disks (a real one is wrapped, see _hook_obj)
        disks = [fs for fs in (self.__dict__.get("work"), self.__dict__.get("store")) if isinstance(fs, MemoryHostFS)]
        if not disks:
            return
        if attached is not None and attached is not want:
            for fs in disks:
                attached.detach(fs)
        if want is not None:
            for fs in disks:
                want.attach(fs)
        self._attached = want

    def _hook_obj(self):
        """The real disks' fault hook (through :class:`FaultyHostFS`): the current injector
        unless paused, with the injector's ``after_torn_write``."""
        world = self

        def hook(fs, op, path, nbytes):
            if world.injector_paused:
                return None
            return world.injector(fs, op, path, nbytes)

        hook.after_torn_write = lambda fs, path, n: world.injector.after_torn_write(fs, path, n)
        return hook

    def clock_s(self) -> float:
        return self.now_s

    def open(self, **kwargs) -> Workspace:
        kwargs.setdefault("clock_s", self.clock_s)
        if self.clock_ns is not None:
            kwargs.setdefault("clock_ns", self.clock_ns)
        return Workspace.open_on(self._work_view, self._store_view, **kwargs)

    def crash(self, ws: Workspace | None, power_loss: bool = False, keep: dict | None = None) -> None:
        """Process death: drop locks, forget the workspace, start the next process fault-free.

        ``power_loss`` (simulated disk only): the machine died too — everything not fsynced
        is lost (``MemoryHostFS.power_loss``), but for ``keep``: ``{"work"|"store": {ino: p}}``,
        the first ``p`` un-fsynced data versions of those inodes (``record_losses``)."""
        if ws is not None and ws._log._lock is not None:
            ws._log._lock.release()
            ws._log._lock = None
        if self.kind != "real":
            self.work.crash()
            self.store.crash()
            if power_loss:
                self.work.power_loss(keep=(keep or {}).get("work"))
                self.store.power_loss(keep=(keep or {}).get("store"))
        elif power_loss:
            raise ValueError("power loss can only be simulated on the simulated disk")
        self.injector.disarm()

    @contextlib.contextmanager
    def paused(self):
        """Host calls made by the test itself (oracle, external edits) are not counted."""
        old, self.injector_paused = self.injector_paused, True
        try:
            yield
        finally:
            self.injector_paused = old

    def snapshot(self) -> oracle.Snapshot:
        """The working tree's snapshot (a new dict each time: callers may keep or change it).
        On a simulated disk it is kept between reads and read again only where it may have
        changed (``oracle.KeptSnapshot``); :meth:`cross_check` compares it with a fresh read."""
        if self._kept is not None:
            return dict(self._kept.read())
        with self.paused():
            return oracle.snapshot(self.work)

    def cross_check(self) -> None:
        """The oracle's ways of reading a simulated disk agree: on both of this world's disks
        the inode walk (``oracle.snapshot_nodes``) and the HostFS calls
        (``oracle.snapshot_via_calls``), and on the working disk the kept snapshot and a fresh
        walk; nothing on a real one."""
        if self.kind == "real":
            return
        with self.paused():
            for fs in (self.work, self.store):
                oracle.assert_same(oracle.snapshot_via_calls(fs), oracle.snapshot_nodes(fs),
                                   f"{fs.name}: the oracle's inode walk vs the HostFS calls")
        oracle.assert_same(oracle.snapshot_nodes(self.work), self._kept.read(), "work: the kept snapshot vs a fresh one")

    def __getattr__(self, name):
        raise AttributeError(name)


__all__ = ["World", "FaultyHostFS", "SimulatedCrash", "FaultInjector"]
