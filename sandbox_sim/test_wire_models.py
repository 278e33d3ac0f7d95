"""The undo model again, with every guest write going over the wire (9P2000.L, unix socket).

Same Driver actions and the same invariant as ``test_models.py`` (the working tree equals
the post-state of the newest step after every rule), but :class:`SimClient` speaks to a
real :class:`~sandbox.ninep.server.NinePServer` through :class:`sandbox.ninep.wirefs.WireFS`: walks,
lopen/lcreate, reads and writes, setattr, renameat, unlinkat, xattr fids. Safeguard
holds are answered by the server's hold gate, and undo-store errors reach the client as
``Rlerror``. Crash rules are left to the in-process models (a crash there is the whole
process dying; here it would only be the server thread).
"""

from __future__ import annotations

import contextlib


from .budget import model_case
from .client import SimClient
from .driver import Driver
from .test_models import UndoRules
from sandbox.ninep.wirefs import serve_workspace


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


class WireUndoModel(UndoRules):
    driver_class = WireDriver


class RealWireUndoModel(WireUndoModel):
    backend = "real"


TestWireModelSim = model_case(WireUndoModel, 15, 15, 30)
TestWireModelReal = model_case(RealWireUndoModel, 8, 12, 25)
