"""Driver: the actions of the undo model, shared by the Hypothesis machine and the campaign.

Every action is deterministic given its arguments (and the world's simulated clock), so a
list of ``(name, *args)`` tuples is a replayable trace. After each action :meth:`check`
asserts the invariant of ``sandbox_sim/checker.py``.
"""

from __future__ import annotations

import errno
import random
from typing import Callable

from sandbox.core.errors import NothingToUndo, StepUnprotected
from sandbox.core.store import Limits
from sandbox.hostfs import HostFS

from . import oracle
from .checker import Checker
from .client import OPS_UNDO_MODEL, SimClient, random_op, seed_tree
from .faults import FaultInjector, SimulatedCrash
from .world import World

NOW_NS = 1_700_000_000_000_000_000


class Driver:
    def __init__(self, world: World, seed: int, limits: Limits, durable: bool = False,
                 tree: Callable[[HostFS], None] | None = None, programs: tuple[str, ...] = OPS_UNDO_MODEL):
        """``durable``: power-loss mode; the power_loss_* actions need it (and a simulated disk).
        ``tree``: makes the initial tree on the working folder (default: a random one from ``seed``).
        ``programs``: the guest programs steps draw from (``client.PROGRAM_SETS``)."""
        self.world = world
        self.programs = programs
        self.limits = limits
        self.durable = durable
        with world.paused():
            if tree is not None:
                tree(world.work)
            else:
                seed_tree(world.work, random.Random(seed))
            if durable:
                world.work.sync_all()
        self.checker = Checker(world)
        self.ops_done = 0
        self.faults_injected = 0
        self.recoveries = 0
        #: (host calls, store mutations) the last armed injector counted, read when it is
        #: disarmed: how many positions a fault of that action could take
        self.last_armed: tuple[int, int] | None = None
        self.ws = None
        self._open()

    def close(self) -> None:
        if self.ws is not None and not self.ws._closed:
            self.ws.close()

    # ------------------------------------------------------------------ helpers

    def _open(self) -> None:
        self.ws = self.world.open(limits=self.limits, durable=self.durable)
        self.client = SimClient(self.ws.fs)

    def _ops(self, seed: int, count: int) -> list[str]:
        rng = random.Random(seed)
        done = []
        for _ in range(count):
            desc, _ok = random_op(self.client, rng, NOW_NS, self.programs)
            self.ops_done += 1
            done.append(desc)
        return done

    def _arm(self, injector: FaultInjector) -> None:
        self.world.injector = injector

    def _disarm(self) -> None:
        self.last_armed = (self.world.injector.calls, self.world.injector.store_mutations)
        if self.world.injector.injected:
            self.faults_injected += len(self.world.injector.injected)
        self.world.injector = FaultInjector()

    def _crash_and_reopen(self, rolled_back=(), power: bool = False, writeback: bool = False,
                          keep: dict | None = None) -> None:
        """``keep``: the un-fsynced data the power loss keeps (``World.crash``)."""
        tree = self.world.snapshot()  # the process is dead: nothing changes after this
        self.faults_injected += len(self.world.injector.injected)
        if power and writeback:
            self.world.work.sync_all()  # the kernel had written the working tree back
        self.world.crash(self.ws, power_loss=power, keep=keep)
        self._open()
        self.recoveries += 1
        if power and (self.ws.recovery or {}).get("kind") == "unprotected_step_kept":
            tree = None  # an unprotected step promises nothing: after a power loss its post-state is what survived
        self.checker.sync(self.ws, tree=tree, rolled_back=rolled_back)

    def _top_seqs(self, n: int) -> tuple[int, ...]:
        return tuple(self.ws.step_seqs()[-n:])

    def history_len(self) -> int:
        return len(self.ws.step_seqs())

    # ------------------------------------------------------------------ actions

    def step(self, seed: int, count: int) -> None:
        with self.ws.step(f"ops {seed}"):
            self._ops(seed, count)
        self.checker.sync(self.ws)

    def ambient(self, seed: int, count: int) -> None:
        self._ops(seed, count)  # no step open: an ambient step opens by itself
        self.world.now_s += 5.0  # idle for the ambient timeout
        self.ws.poll()
        assert self.ws.active_step_id is None, "ambient step did not close after 5 s idle"
        self.checker.sync(self.ws)

    def rollback(self, n: int) -> None:
        n = max(1, min(n, self.history_len()))
        before = self.world.snapshot()
        top = self._top_seqs(n)
        try:
            self.ws.rollback(n)
        except (StepUnprotected, NothingToUndo):
            oracle.assert_same(before, self.world.snapshot(), "a refused rollback changed the tree")
            return
        self.checker.sync(self.ws, rolled_back=top)

    def rollback_too_far(self) -> None:
        before = self.world.snapshot()
        try:
            self.ws.rollback(self.history_len() + 1)
        except NothingToUndo:
            pass
        else:
            raise AssertionError("rollback past the start of history succeeded")
        oracle.assert_same(before, self.world.snapshot(), "a refused rollback changed the tree")

    def reopen(self) -> None:
        self.ws.close()
        self._open()
        assert self.ws.recovery is None, "clean reopen ran a recovery"
        self.checker.sync(self.ws)

    def crash_in_step(self, seed: int, count: int, k: int) -> None:
        self._faulty_step(FaultInjector(crash_at=k), seed, count)

    def power_loss_in_step(self, seed: int, count: int, k: int, writeback: bool) -> None:
        """The machine dies at host call k: only fsynced data survives (durable mode)."""
        assert self.durable, "power-loss actions need a durable driver"
        self._faulty_step(FaultInjector(crash_at=k), seed, count, power=True, writeback=writeback)

    def power_loss_in_rollback(self, n: int, k: int) -> None:
        assert self.durable, "power-loss actions need a durable driver"
        self.crash_in_rollback(n, k, power=True)

    def torn_write_in_step(self, seed: int, count: int, k: int) -> None:
        self._faulty_step(FaultInjector(torn_at=k, seed=seed), seed, count)

    def _faulty_step(self, injector: FaultInjector, seed: int, count: int, power: bool = False,
                     writeback: bool = False) -> None:
        self._arm(injector)
        try:
            with self.ws.step(f"faulty {seed}"):
                self._ops(seed, count)
        except SimulatedCrash:
            self._crash_and_reopen(power=power, writeback=writeback)
            return
        self._disarm()
        self.checker.sync(self.ws)

    def store_error_in_step(self, seed: int, count: int, j: int, code: int) -> None:
        self._arm(FaultInjector(error_at=(j, code)))
        try:
            with self.ws.step(f"store error {seed}"):
                self._ops(seed, count)  # ops hit by the error fail; nothing unrecorded may happen
        except OSError as e:
            assert e.errno == code, e
            self._disarm()
            self.ws.close_active()  # closing is retried once the disk recovers
        self._disarm()
        assert self.ws.active_step_id is None
        self.checker.sync(self.ws)

    def crash_in_rollback(self, n: int, k: int, power: bool = False) -> None:
        n = max(1, min(n, self.history_len()))
        top = self._top_seqs(n)
        self._arm(FaultInjector(crash_at=k))
        try:
            self.ws.rollback(n)
        except SimulatedCrash:
            self._crash_and_reopen(rolled_back=top, power=power)
            return
        except (StepUnprotected, NothingToUndo):
            pass
        self._disarm()
        self.checker.sync(self.ws, rolled_back=top)

    def store_error_in_rollback(self, n: int, j: int, code: int) -> None:
        n = max(1, min(n, self.history_len()))
        top = self._top_seqs(n)
        self._arm(FaultInjector(error_at=(j, code)))
        try:
            self.ws.rollback(n)
        except OSError as e:
            assert e.errno == code, e
            self._disarm()
            self.ws.finish_pending()
        except (StepUnprotected, NothingToUndo):
            pass
        self._disarm()
        self.checker.sync(self.ws, rolled_back=top)

    def _set_decide(self, decide) -> None:
        """Who answers a safeguard hold for the client's writes (the wire driver: the server)."""
        self.ws.fs.decide = decide

    def _guarded_setup(self, files: int) -> None:
        """guarded_rm_rf's victim tree, made by the test itself (not the client), in a step."""
        with self.ws.step("setup for rm -rf"):
            self.ws.fs.remove_tree("victim")
            self.ws.fs.makedirs("victim")
            for i in range(files):
                self.ws.fs.write_file(f"victim/f{i}", b"x" * i)

    def guarded_rm_rf(self, files: int, threshold: int, allow: bool) -> None:
        """The crossing delete is held before it runs; deny restores the pre-step tree."""
        self._guarded_setup(files)
        self.checker.sync(self.ws)
        before = self.world.snapshot()
        seen = []

        def decide(hold):
            remaining = len(self.ws.fs.listdir("victim"))
            seen.append((hold.kind, hold.count, files - remaining))
            return "allow" if allow else "deny"

        self._set_decide(decide)
        self.ws.configure_safeguard(delete_threshold=threshold)
        try:
            with self.ws.step("rm -rf victim"):
                self.client.fs.remove_tree("victim")
        except OSError as e:  # SafeguardDenied is EIO; over the wire it arrives as Rlerror(EIO)
            assert not allow and e.errno == errno.EIO, e
        finally:
            self._set_decide(None)
            self.ws.configure_safeguard(delete_threshold=None)
        if threshold <= files + 1:  # files + the directory itself
            assert seen, "the safeguard never fired"
            kind, count, deleted_before_hold = seen[0]
            assert kind == "delete" and count == threshold
            assert deleted_before_hold == threshold - 1, "a delete past the threshold reached the host before the hold"
        if not allow and seen:
            oracle.assert_same(before, self.world.snapshot(), "denied step")
            assert self.ws.history()[0]["outcome"] == "denied"
        self.checker.sync(self.ws)

    # ------------------------------------------------------------------ invariants

    def check(self, what: str = "after action") -> None:
        self.checker.check(self.ws, what)
        assert len(self.ws.step_seqs()) <= self.limits.max_step_count or self.ws.eviction_pending

    def run(self, action: tuple) -> None:
        getattr(self, action[0])(*action[1:])


STORE_ERRORS = (errno.ENOSPC, errno.EIO)
