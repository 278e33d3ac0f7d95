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

import pytest

from . import server_drivers
from .budget import model_case
from .fuse_mount import MountFS, fuse_unavailable
from .test_models import UndoRules

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(fuse_unavailable() is not None, reason=str(fuse_unavailable()))]


class FuseDriver(server_drivers.FuseDriver):
    """:class:`server_drivers.FuseDriver`, skipping (with the reason) where no mount can be made."""

    def _mount(self) -> None:
        try:
            super()._mount()
        except server_drivers.MountFailed as e:
            pytest.skip(str(e))


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
    """The mount served coherent (:class:`server_drivers.FuseNoOpenDriver`)."""

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
