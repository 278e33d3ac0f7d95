"""The undo model's Driver with its client on the far side of a real server.

:class:`WireDriver`: every program goes over 9P2000.L to a :class:`~sandbox.ninep.server.NinePServer`
on a unix socket in process (:class:`sandbox.ninep.wirefs.WireFS`). :class:`FuseDriver`: every
program is a real system call on a real FUSE mount of the working folder, served from
``/dev/fuse`` by our dispatcher in process (:class:`~.fuse_mount.ServedMount`; root and
``/dev/fuse``); :class:`FuseNoOpenDriver` serves it coherent (no-open, long caches), as
``sandbox mount`` does with its watcher. The Hypothesis models (``test_wire_models.py``,
``test_fuse_models.py``) and campaigns (``python -m sandbox_sim run --driver wire|fuse|fuse-noopen``)
use them.

What they cannot do: crash, torn-write and power-loss actions (a crash is the whole process
dying; here it would only be the server thread) — a campaign over them takes store errors
(ENOSPC, EIO) at most (:data:`DRIVER_FAULTS`).
"""

from __future__ import annotations

import contextlib
import os
import threading

from sandbox.mounts import Provider
from sandbox.ninep.wirefs import serve_workspace

from .client import SimClient
from .driver import Driver
from .fuse_mount import MountFS, ServedMount, Unlocked


class MountFailed(RuntimeError):
    """The FUSE mount could not be made here (the tests skip with it)."""


class WireDriver(Driver):
    """The Driver with its client on the far side of a 9P server."""

    def _open(self) -> None:
        self.ws = self.world.open(limits=self.limits, durable=self.durable)
        self._serving = contextlib.ExitStack()
        self.wire = self._serving.enter_context(serve_workspace(self.ws))
        self.client = SimClient(self.wire)

    def _set_decide(self, decide) -> None:
        """The server's hold broker puts holds to ``decide`` (None: nobody answers)."""
        unask = getattr(self, "_unask", None)
        if unask is not None:
            unask()
        self._unask = self.wire.server.server.holds.ask(decide) if decide is not None else None

    def reopen(self) -> None:
        self._serving.close()
        super().reopen()

    def close(self) -> None:
        self._serving.close()
        super().close()


class FuseDriver(Driver):
    """The Driver with its client on a FUSE mount of the working folder (a real directory).

    Undo is what a user does: the mount goes away, the steps are undone, the folder is
    mounted again (``sandbox undo`` refuses while ``sandbox mount`` holds the store).

    Invariant: between actions this thread holds ``self.lock`` (the server waits); it is
    released only inside the client's calls (``Unlocked``) and while unmounting, so requests
    the kernel sends on its own (RELEASE, FORGET) never race the undo core's use here."""

    #: serve the mount coherent (no-open): :class:`FuseNoOpenDriver`
    no_open = False

    def _open(self) -> None:
        if not hasattr(self, "lock"):
            self.lock = threading.Lock()
            self.lock.acquire()
            self.point = os.path.join(os.path.dirname(self.world.work.root), "mnt")
            os.makedirs(self.point, exist_ok=True)
        self.ws = self.world.open(limits=self.limits, durable=self.durable)
        self.mounted = None
        self._mount()

    def _mount(self) -> None:
        self.mounted = ServedMount(Provider.intercepted(self.ws), self.point, lock=self.lock, coherent=self.no_open)
        try:
            self.mounted.start()
        except OSError as e:
            self.mounted = None
            raise MountFailed(f"mounting a FUSE filesystem failed here: {e}") from e
        self.lock.release()  # opening the mount point's root is served by the server (INIT, LOOKUP)
        try:
            fs = MountFS(self.point, name="mount")
        finally:
            self.lock.acquire()
        fs.host = self.world.work  # SimClient lists the tree on the host (it picks names from it)
        self.client = SimClient(Unlocked(fs, self.lock))

    def _unmount(self) -> None:
        if self.mounted is None:
            return
        self.client.fs._target.close()
        self.lock.release()
        try:
            self.mounted.stop()
        finally:
            self.lock.acquire()
            self.requests_served = getattr(self, "requests_served", 0) + self.mounted.server.requests
            self.mounted = None

    def _set_decide(self, decide) -> None:
        """The mount's hold broker puts holds to ``decide`` (None: nobody answers)."""
        unask = getattr(self, "_unask", None)
        if unask is not None:
            unask()
        self._unask = self.mounted.holds.ask(decide) if decide is not None else None

    def _remounted(self, action, *args) -> None:
        self._unmount()
        try:
            action(*args)
        finally:
            if self.mounted is None and not self.ws._closed:
                self._mount()

    def rollback(self, n: int) -> None:
        self._remounted(super().rollback, n)

    def rollback_too_far(self) -> None:
        self._remounted(super().rollback_too_far)

    def store_error_in_rollback(self, n: int, j: int, code: int) -> None:
        self._remounted(super().store_error_in_rollback, n, j, code)

    def _guarded_setup(self, files: int) -> None:
        """The victim tree is made beside the mount (an external edit): the kernel may hold
        entries and attributes of what was there for up to a second (docs/fuse.md, Caching;
        no invalidation notifications yet), so the folder is mounted afresh after it."""
        self._remounted(super()._guarded_setup, files)

    def reopen(self) -> None:
        self._unmount()
        super().reopen()  # closes the workspace, opens it again and mounts (_open)

    def close(self) -> None:
        try:
            self._unmount()
        finally:
            super().close()


class FuseNoOpenDriver(FuseDriver):
    """The mount served coherent, as with the watcher running: long caches and no-open
    (no OPEN/RELEASE; READ/WRITE through the nodes' own descriptors; O_TRUNC as SETATTR)."""

    no_open = True


#: a campaign's drivers, by the name its config keeps (``driver``; absent: ``sim``)
DRIVERS = {"sim": Driver, "wire": WireDriver, "fuse": FuseDriver, "fuse-noopen": FuseNoOpenDriver}
#: the world each runs on: the simulated disk, or a real temporary directory (a FUSE mount's)
DRIVER_WORLDS = {"sim": "sim", "wire": "sim", "fuse": "real", "fuse-noopen": "real"}
#: the fault kinds each can take (None: all); a server's drivers take store errors only
DRIVER_FAULTS = {"sim": None, "wire": {"enospc", "eio"}, "fuse": {"enospc", "eio"}, "fuse-noopen": {"enospc", "eio"}}
