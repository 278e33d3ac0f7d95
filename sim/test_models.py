"""Hypothesis stateful models of the undo core.

One machine, :class:`UndoModel`, is the specification: after every rule the working
tree must equal the post-state of the newest step in history (see ``sim/checker.py``).
Rules run steps of random guest programs, ambient writes, rollbacks, reopen, and the
same with a crash at a random host call, a torn write, or ENOSPC/EIO from the undo
store. It runs against the simulated disk and against a real temp directory.
"""

from __future__ import annotations

import errno
import random
import tempfile

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sandbox.core.errors import NothingToUndo, SafeguardDenied, StepUnprotected
from sandbox.core.store import Limits

from . import oracle
from .checker import Checker
from .client import SimClient, random_op, seed_tree
from .faults import FaultInjector, SimulatedCrash
from .world import World

seeds = st.integers(0, 2**32 - 1)


class UndoModel(RuleBasedStateMachine):
    backend = "sim"

    def __init__(self):
        super().__init__()
        self._tmp = None
        if self.backend == "real":
            self._tmp = tempfile.TemporaryDirectory(prefix="sandbox-model-")
        self.world = World(self.backend, self._tmp.name if self._tmp else None)
        self.ws = None

    def teardown(self):
        if self.ws is not None and not self.ws._closed:
            try:
                self.ws.close()
            except Exception:
                pass
        if self._tmp is not None:
            self._tmp.cleanup()

    # ------------------------------------------------------------------ helpers

    def _open(self):
        self.ws = self.world.open(limits=self.limits)
        self.client = SimClient(self.ws.fs)

    def _now_ns(self) -> int:
        return 1_700_000_000_000_000_000

    def _ops(self, seed: int, count: int) -> list[str]:
        rng = random.Random(seed)
        done = []
        for _ in range(count):
            desc, _ok = random_op(self.client, rng, self._now_ns())
            done.append(desc)
        return done

    def _crash_and_reopen(self, rolled_back=()) -> None:
        tree = self.world.snapshot()  # the process is dead: nothing changes after this
        self.world.crash(self.ws)
        self._open()
        self.checker.sync(self.ws, tree=tree, rolled_back=rolled_back)

    def _top_seqs(self, n: int) -> tuple[int, ...]:
        return tuple(s.seq for s in self.ws.log.steps()[-n:])

    # ------------------------------------------------------------------ rules

    @initialize(seed=seeds, max_steps=st.integers(2, 6), tight=st.booleans())
    def setup(self, seed, max_steps, tight):
        with self.world.paused():
            seed_tree(self.world.work, random.Random(seed))
        self.limits = Limits(max_step_count=max_steps,
                             max_single_step_size_bytes=6000 if tight else 200 << 20,
                             max_log_size_bytes=40_000 if tight else 1 << 30)
        self.checker = Checker(self.world)
        self._open()

    @rule(seed=seeds, count=st.integers(1, 6))
    def step(self, seed, count):
        with self.ws.step(f"ops {seed}"):
            self._ops(seed, count)
        self.checker.sync(self.ws)

    @rule(seed=seeds, count=st.integers(1, 4))
    def ambient(self, seed, count):
        self._ops(seed, count)  # no step open: an ambient step opens by itself
        self.world.now_s += 5.0  # idle for the ambient timeout
        self.ws.poll()
        assert self.ws.tracker.active is None
        self.checker.sync(self.ws)

    @precondition(lambda self: self.ws is not None and self.ws.log.steps())
    @rule(n=st.integers(1, 3))
    def rollback(self, n):
        n = min(n, len(self.ws.log.steps()))
        before = self.world.snapshot()
        top = self._top_seqs(n)
        try:
            self.ws.rollback(n)
        except StepUnprotected:
            oracle.assert_same(before, self.world.snapshot(), "refused rollback changed the tree")
            return
        self.checker.sync(self.ws, rolled_back=top)

    @rule()
    def rollback_too_far(self):
        n = len(self.ws.log.steps()) + 1
        before = self.world.snapshot()
        try:
            self.ws.rollback(n)
        except NothingToUndo:
            pass
        else:
            raise AssertionError("rollback past the start of history succeeded")
        oracle.assert_same(before, self.world.snapshot(), "refused rollback changed the tree")

    @rule()
    def reopen(self):
        self.ws.close()
        self._open()
        assert self.ws.recovery is None
        self.checker.sync(self.ws)

    @rule(seed=seeds, count=st.integers(1, 5), k=st.integers(0, 400))
    def crash_in_step(self, seed, count, k):
        self.world.injector = FaultInjector(crash_at=k)
        try:
            with self.ws.step(f"crashy {seed}"):
                self._ops(seed, count)
        except SimulatedCrash:
            self._crash_and_reopen()
            return
        self.world.injector = FaultInjector()
        self.checker.sync(self.ws)

    @rule(seed=seeds, count=st.integers(1, 5), k=st.integers(0, 300), rseed=seeds)
    def torn_write_in_step(self, seed, count, k, rseed):
        self.world.injector = FaultInjector(torn_at=k, seed=rseed)
        try:
            with self.ws.step(f"torn {seed}"):
                self._ops(seed, count)
        except SimulatedCrash:
            self._crash_and_reopen()
            return
        self.world.injector = FaultInjector()
        self.checker.sync(self.ws)

    @rule(seed=seeds, count=st.integers(1, 5), j=st.integers(0, 60), code=st.sampled_from([errno.ENOSPC, errno.EIO]))
    def store_error_in_step(self, seed, count, j, code):
        self.world.injector = FaultInjector(error_at=(j, code))
        try:
            with self.ws.step(f"enospc {seed}"):
                self._ops(seed, count)  # ops hit by the error fail; nothing unrecorded may happen
        except OSError as e:
            assert e.errno == code, e
            self.world.injector = FaultInjector()
            self.ws.interceptor.close_now()  # closing the step is retried once the disk recovers
        self.world.injector = FaultInjector()
        assert self.ws.tracker.active is None
        self.checker.sync(self.ws)

    @precondition(lambda self: self.ws is not None and self.ws.log.steps())
    @rule(n=st.integers(1, 3), k=st.integers(0, 200))
    def crash_in_rollback(self, n, k):
        n = min(n, len(self.ws.log.steps()))
        top = self._top_seqs(n)
        self.world.injector = FaultInjector(crash_at=k)
        try:
            self.ws.rollback(n)
        except SimulatedCrash:
            self._crash_and_reopen(rolled_back=top)
            return
        except StepUnprotected:
            pass
        self.world.injector = FaultInjector()
        self.checker.sync(self.ws, rolled_back=top)

    @precondition(lambda self: self.ws is not None and self.ws.log.steps())
    @rule(n=st.integers(1, 3), j=st.integers(0, 40), code=st.sampled_from([errno.ENOSPC, errno.EIO]))
    def store_error_in_rollback(self, n, j, code):
        n = min(n, len(self.ws.log.steps()))
        top = self._top_seqs(n)
        self.world.injector = FaultInjector(error_at=(j, code))
        try:
            self.ws.rollback(n)
        except OSError as e:
            assert e.errno == code, e
            self.world.injector = FaultInjector()
            self.ws.finish_pending()
        except StepUnprotected:
            pass
        self.world.injector = FaultInjector()
        self.checker.sync(self.ws, rolled_back=top)

    @rule(seed=seeds, files=st.integers(2, 12), threshold=st.integers(1, 8), allow=st.booleans())
    def guarded_rm_rf(self, seed, files, threshold, allow):
        """Safeguard: the crossing delete is held before it runs; deny restores the pre-step tree."""
        with self.ws.step("setup for rm -rf"):
            self.ws.fs.remove_tree("victim")
            self.ws.fs.makedirs("victim")
            for i in range(files):
                self.ws.fs.write_file(f"victim/f{i}", b"x" * i)
        self.checker.sync(self.ws)
        before = self.world.snapshot()
        seen = []

        def decide(hold):
            remaining = len(self.ws.fs.listdir("victim"))
            seen.append((hold.kind, hold.count, files - remaining))
            return "allow" if allow else "deny"

        self.ws.fs.decide = decide
        self.ws.configure_safeguard(delete_threshold=threshold)
        try:
            with self.ws.step("rm -rf victim"):
                self.ws.fs.remove_tree("victim")
        except SafeguardDenied:
            assert not allow
        finally:
            self.ws.fs.decide = None
            self.ws.configure_safeguard(delete_threshold=None)
        if threshold <= files + 1:
            assert seen, "the safeguard never fired"
            kind, count, deleted_before_hold = seen[0]
            assert kind == "delete" and count == threshold
            assert deleted_before_hold == threshold - 1, "a delete past the threshold reached the host before the hold"
        if not allow and seen:
            oracle.assert_same(before, self.world.snapshot(), "denied step")
            assert self.ws.history()[0]["outcome"] == "denied"
        self.checker.sync(self.ws)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def tree_matches_history(self):
        if self.ws is not None:
            self.checker.check(self.ws, "after rule")

    @invariant()
    def limits_hold(self):
        if self.ws is not None:
            assert len(self.ws.log.steps()) <= self.limits.max_step_count or self.ws.log.eviction_pending


class RealUndoModel(UndoModel):
    backend = "real"


TestUndoModelSim = UndoModel.TestCase
TestUndoModelSim.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestUndoModelReal = RealUndoModel.TestCase
TestUndoModelReal.settings = settings(max_examples=12, stateful_step_count=15, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture(autouse=True)
def _no_leaks():
    yield
