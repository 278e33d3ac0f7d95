"""The undo model a third time, every write made by a real system call on a real FUSE mount.

Same Driver actions and the same invariant as ``test_models.py`` (the working tree equals the
post-state of the newest step after every rule, checked with the tree-snapshot oracle:
bytes, type, mode, mtime, xattrs, owners, symlink targets). Here :class:`SimClient`'s
programs are ``os.*`` calls on a mount of the working folder (:class:`MountFS`): the kernel
turns them into FUSE requests, our dispatcher serves them from ``/dev/fuse`` onto the
intercepted Provider (:class:`ServedMount`, in process). Safeguard holds block the calling
system call until the hold is answered; a deny reaches it as ``EIO``.

Undo is what a user does: the mount goes away, the steps are undone, the folder is mounted
again (``sandbox undo`` refuses while ``sandbox mount`` holds the store). So rollbacks and
reopen unmount first. The test holds the server's lock while it uses the undo core itself
(step boundaries, rollbacks, snapshots) and releases it only for the client's system calls,
so requests the kernel sends on its own (RELEASE, FORGET) never race it. Crash rules stay
with the in-process models. Skipped, saying why, without ``/dev/fuse`` or root.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest

from sandbox.mounts import Provider

from .budget import model_case
from .client import SimClient
from .driver import Driver
from .fuse_mount import MountFS, ServedMount, Unlocked, fuse_unavailable
from .test_models import UndoRules

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(fuse_unavailable() is not None, reason=str(fuse_unavailable()))]


class FuseDriver(Driver):
    """The Driver with its client on a FUSE mount of the working folder.

    Invariant: between actions the test thread holds ``self.lock`` (the server waits);
    it is released only inside the client's calls (``Unlocked``) and while unmounting."""

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
            pytest.skip(f"mounting a FUSE filesystem failed here: {e}")
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


class FuseUndoModel(UndoRules):
    backend = "real"
    driver_class = FuseDriver

    def teardown(self):
        d = self.d
        super().teardown()
        if d is not None:  # the programs really went through the kernel and our server, not around them
            assert d.ops_done == 0 or getattr(d, "requests_served", 0) > d.ops_done, (d.ops_done, d.requests_served)


TestFuseModel = model_case(FuseUndoModel, 20, 15, 25)


class FuseNoOpenDriver(FuseDriver):
    """The mount served coherent, as with the watcher running: long caches and no-open
    (no OPEN/RELEASE; READ/WRITE through the nodes' own descriptors; O_TRUNC as SETATTR)."""

    no_open = True


class FuseNoOpenUndoModel(FuseUndoModel):
    driver_class = FuseNoOpenDriver

    def teardown(self):
        d = self.d
        if d is not None and d.mounted is not None:
            assert d.mounted.dispatcher.no_open, "the kernel did not take no-open"
        super().teardown()


TestFuseNoOpenModel = model_case(FuseNoOpenUndoModel, 10, 15, 25)


@pytest.mark.timeout(60)
def test_the_clients_write_to_a_fifo_fails_instead_of_waiting_for_a_reader(tmp_path):
    """The models' programs make FIFOs and write to random names: ``MountFS.write_file`` of a
    FIFO is ``ENXIO`` at once (an open for writing would wait for a reader that never comes)."""
    os.mkfifo(tmp_path / "p")
    with pytest.raises(OSError) as e:
        MountFS(str(tmp_path)).write_file("p", b"x")
    assert e.value.errno == errno.ENXIO
