"""Hypothesis stateful model of the undo core.

:class:`UndoModel` is the specification: after every rule the working tree must equal
the post-state of the newest step in history (``sandbox_sim/checker.py``). Rules run steps of
random guest programs, ambient writes, rollbacks, reopen, and the same with a crash at
a random host call, a torn write, or ENOSPC/EIO from the undo store, plus safeguarded
``rm -rf``. The actions live in ``sandbox_sim/driver.py`` (shared with ``python -m sandbox_sim run``).
The machine runs against the simulated disk and against a real temp directory.
"""

from __future__ import annotations

import tempfile

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sandbox.core.store import Limits

from .budget import model_case
from .driver import STORE_ERRORS, Driver
from .world import World

seeds = st.integers(0, 2**32 - 1)
has_history = precondition(lambda self: self.d is not None and self.d.history_len() > 0)


class UndoRules(RuleBasedStateMachine):
    """The rules every backend supports; :class:`UndoModel` adds crashes and torn writes.
    ``driver_class`` decides where the client's writes go (in process, or over 9P)."""

    backend = "sim"
    durable = False
    driver_class = Driver

    def __init__(self):
        super().__init__()
        self._tmp = tempfile.TemporaryDirectory(prefix="sandbox-model-") if self.backend == "real" else None
        self.world = World(self.backend, self._tmp.name if self._tmp else None)
        self.d: Driver | None = None

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
        # "tight" limits make unprotected steps and size-driven eviction common
        limits = Limits(max_step_count=max_steps, max_single_step_size_bytes=6000 if tight else 200 << 20,
                        max_log_size_bytes=40_000 if tight else 1 << 30)
        self.d = self.driver_class(self.world, seed, limits, durable=self.durable)

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
    def rollback_too_far(self):
        self.d.rollback_too_far()

    @rule()
    def reopen(self):
        self.d.reopen()

    @rule(seed=seeds, count=st.integers(1, 5), j=st.integers(0, 60), code=st.sampled_from(STORE_ERRORS))
    def store_error_in_step(self, seed, count, j, code):
        self.d.store_error_in_step(seed, count, j, code)

    @has_history
    @rule(n=st.integers(1, 3), j=st.integers(0, 40), code=st.sampled_from(STORE_ERRORS))
    def store_error_in_rollback(self, n, j, code):
        self.d.store_error_in_rollback(n, j, code)

    @rule(files=st.integers(2, 12), threshold=st.integers(1, 8), allow=st.booleans())
    def guarded_rm_rf(self, files, threshold, allow):
        self.d.guarded_rm_rf(files, threshold, allow)

    @invariant()
    def tree_matches_history(self):
        if self.d is not None:
            self.d.check()


class UndoModel(UndoRules):
    """The in-process model: the common rules plus the process dying at any host call."""

    @rule(seed=seeds, count=st.integers(1, 5), k=st.integers(0, 400))
    def crash_in_step(self, seed, count, k):
        self.d.crash_in_step(seed, count, k)

    @rule(seed=seeds, count=st.integers(1, 5), k=st.integers(0, 300))
    def torn_write_in_step(self, seed, count, k):
        self.d.torn_write_in_step(seed, count, k)

    @has_history
    @rule(n=st.integers(1, 3), k=st.integers(0, 200))
    def crash_in_rollback(self, n, k):
        self.d.crash_in_rollback(n, k)


class RealUndoModel(UndoModel):
    backend = "real"


class DurableUndoModel(UndoModel):
    """Power-loss mode: the same rules, plus the machine dying at any host call."""

    durable = True

    @rule(seed=seeds, count=st.integers(1, 5), k=st.integers(0, 600), writeback=st.booleans())
    def power_loss_in_step(self, seed, count, k, writeback):
        self.d.power_loss_in_step(seed, count, k, writeback)

    @has_history
    @rule(n=st.integers(1, 3), k=st.integers(0, 300))
    def power_loss_in_rollback(self, n, k):
        self.d.power_loss_in_rollback(n, k)


TestUndoModelSim = model_case(UndoModel, 60, 25)
TestUndoModelDurable = model_case(DurableUndoModel, 40, 25)
TestUndoModelReal = model_case(RealUndoModel, 12, 15, 30)
