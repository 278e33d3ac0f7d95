"""The undo model again, with every guest write going over the wire (9P2000.L, unix socket).

Same Driver actions and the same invariant as ``test_models.py`` (the working tree equals
the post-state of the newest step after every rule), but :class:`SimClient` speaks to a
real :class:`~sandbox.ninep.server.NinePServer` through :class:`sim.wire.WireFS`: walks,
lopen/lcreate, reads and writes, setattr, renameat, unlinkat, xattr fids. Safeguard
holds are answered by the server's hold gate, and undo-store errors reach the client as
``Rlerror``. Crash rules are left to the in-process models (a crash there is the whole
process dying; here it would only be the server thread).
"""

from __future__ import annotations

import contextlib
import tempfile

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sandbox.core.store import Limits

from .budget import scale
from .client import SimClient
from .driver import STORE_ERRORS, Driver
from .wire import serve_workspace
from .world import World

seeds = st.integers(0, 2**32 - 1)
has_history = precondition(lambda self: self.d is not None and self.d.history_len() > 0)


class WireDriver(Driver):
    """The Driver with its client on the far side of a 9P server."""

    def _open(self) -> None:
        self.ws = self.world.open(limits=self.limits, durable=self.durable)
        self._serving = contextlib.ExitStack()
        self.wire = self._serving.enter_context(serve_workspace(self.ws))
        self.client = SimClient(self.wire)

    def _set_decide(self, decide) -> None:
        self.wire.gate.decide = decide

    def reopen(self) -> None:
        self._serving.close()
        super().reopen()

    def close(self) -> None:
        self._serving.close()
        super().close()


class WireUndoModel(RuleBasedStateMachine):
    backend = "sim"

    def __init__(self):
        super().__init__()
        self._tmp = tempfile.TemporaryDirectory(prefix="sandbox-wire-") if self.backend == "real" else None
        self.world = World(self.backend, self._tmp.name if self._tmp else None)
        self.d: WireDriver | None = None

    def teardown(self):
        if self.d is not None:
            try:
                self.d.close()
            except Exception:
                pass
        if self._tmp is not None:
            self._tmp.cleanup()

    @initialize(seed=seeds, max_steps=st.integers(2, 6), tight=st.booleans())
    def setup(self, seed, max_steps, tight):
        limits = Limits(max_step_count=max_steps, max_single_step_size_bytes=6000 if tight else 200 << 20,
                        max_log_size_bytes=40_000 if tight else 1 << 30)
        self.d = WireDriver(self.world, seed, limits)

    @rule(seed=seeds, count=st.integers(1, 6))
    def step(self, seed, count):
        self.d.step(seed, count)

    @rule(seed=seeds, count=st.integers(1, 4))
    def ambient(self, seed, count):
        self.d.ambient(seed, count)

    @has_history
    @rule(n=st.integers(1, 3))
    def rollback(self, n):
        self.d.rollback(n)

    @rule()
    def reopen(self):
        self.d.reopen()

    @rule(seed=seeds, count=st.integers(1, 5), j=st.integers(0, 60), code=st.sampled_from(STORE_ERRORS))
    def store_error_in_step(self, seed, count, j, code):
        self.d.store_error_in_step(seed, count, j, code)

    @rule(files=st.integers(2, 12), threshold=st.integers(1, 8), allow=st.booleans())
    def guarded_rm_rf(self, files, threshold, allow):
        self.d.guarded_rm_rf(files, threshold, allow)

    @invariant()
    def tree_matches_history(self):
        if self.d is not None:
            self.d.check()


class RealWireUndoModel(WireUndoModel):
    backend = "real"


_health = [HealthCheck.too_slow, HealthCheck.filter_too_much]
TestWireModelSim = WireUndoModel.TestCase
TestWireModelSim.settings = settings(max_examples=scale(15, 150), stateful_step_count=scale(15, 30), deadline=None,
                                     suppress_health_check=_health)
TestWireModelReal = RealWireUndoModel.TestCase
TestWireModelReal.settings = settings(max_examples=scale(8, 80), stateful_step_count=scale(12, 25), deadline=None,
                                      suppress_health_check=_health)
