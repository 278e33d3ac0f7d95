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

from .budget import model_case
from .server_drivers import WireDriver
from .test_models import UndoRules


class WireUndoModel(UndoRules):
    driver_class = WireDriver


class RealWireUndoModel(WireUndoModel):
    backend = "real"


TestWireModelSim = model_case(WireUndoModel, 15, 15, 30)
TestWireModelReal = model_case(RealWireUndoModel, 8, 12, 25)
