"""A step's lifecycle as a named state machine (sandbox/core/steps.py), and the Workspace
doors servers use instead of its interceptor, tracker and undo log.

The table of edges is checked exhaustively; then the doors drive real steps through each
path of the machine (drained, cut off, denied, discarded, waiting for a full disk), and a
Hypothesis machine drives random door calls — any illegal transition the code made would
raise there (``Step._transition`` asserts every edge).
"""

from __future__ import annotations

import errno
import itertools
import threading
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sandbox import HoldRequired, SafeguardConfig, SafeguardDenied
from sandbox.core.steps import ACTIVE_STATES, EDGES, FINAL_STATES, Step, StepState, StepTracker
from sandbox.core.workspace import Workspace
from sandbox.session.runtime import OpenedWorkspace, open_workspace, watch_workspace

from .faults import FaultInjector
from .world import World

S = StepState


# ---------------------------------------------------------------------------- the table


@pytest.mark.parametrize("src,dst", list(itertools.product(StepState, StepState)))
def test_every_edge_outside_the_table_is_refused(src, dst):
    step = Step(1, "command", "x", 0.0, state=src)
    if dst in EDGES[src]:
        step._transition(dst)
        assert step.state is dst and step.trail[-1] is dst
    else:
        with pytest.raises(AssertionError, match="illegal transition"):
            step._transition(dst)
        assert step.state is src


def test_the_graph_starts_at_open_reaches_a_final_state_from_everywhere_and_has_no_cycle():
    assert set(EDGES) == set(StepState)
    assert FINAL_STATES == {S.CLOSED, S.ROLLED_BACK, S.DISCARDED}
    assert ACTIVE_STATES == {S.OPEN, S.COMPLETING, S.DENIED}

    def reach(s, seen=()):
        assert s not in seen, f"cycle through {s}"
        out = {s}
        for t in EDGES[s]:
            out |= reach(t, seen + (s,))
        return out

    assert reach(S.OPEN) == set(StepState)
    for s in StepState:
        assert reach(s) & FINAL_STATES, s


def test_the_tracker_moves_only_along_the_edges():
    t = StepTracker(lambda: 0.0)
    t.begin(1, "command", "x")
    t.complete(1, 0)
    with pytest.raises(AssertionError, match="completed twice"):
        t.complete(1, 0)
    t.deny()  # a hold denied while it drains
    t.end()
    with pytest.raises(AssertionError):
        t.begin(2, "command", "y")  # the ended step is neither recorded nor discarded
    assert t.recorded(outcome_denied=True).trail == (S.OPEN, S.COMPLETING, S.DENIED, S.ENDED, S.ROLLED_BACK)
    t.begin(2, "command", "y")


# ---------------------------------------------------------------------------- through the doors


def test_a_command_step_drains_its_late_write_then_closes(world):
    ws = world.open()
    sid = ws.begin_step("make")
    assert (ws.active_step_id, ws.step_state()) == (sid, S.OPEN)
    ws.op_started()  # a request in flight when the command ends
    ws.complete_step(sid, 0)
    assert ws.step_state(sid) is S.COMPLETING and ws.requests_in_flight == 1
    ws.fs.write_file("late", b"2")
    ws.op_finished()
    assert ws.close_step(sid, 0) is True  # drained: nothing in flight any more
    assert ws.step_state(sid) is S.CLOSED and ws.active_step_id is None
    assert ws.history()[0]["id"] == sid and "late" in ws.history()[0]["paths"]


def _held_ambient(world, timeout_s=30.0):
    """A workspace whose ambient step (guest writes outside any command) is held by a safeguard."""
    for i in range(3):
        world.work.create(f"f{i}", 0o644)
    ws = world.open(safeguard=SafeguardConfig(delete_threshold=2, timeout_s=timeout_s))
    ws.fs.unlink("f0")
    with pytest.raises(HoldRequired) as e:
        ws.fs.unlink("f1")  # the second delete reaches delete_threshold: held before it runs
    return ws, e.value.hold


def test_a_held_ambient_step_does_not_idle_out_and_a_late_deny_still_rolls_it_back(world):
    ws, hold = _held_ambient(world)
    world.now_s += 10  # past ambient_idle_s (5 s): an unheld ambient step would have ended
    ws.poll()
    assert ws.active_step_id == hold.step_id and ws.step_state(hold.step_id) is S.OPEN
    ws.resolve_hold(hold.id, "deny")
    assert sorted(world.work.listdir("")) == ["f0", "f1", "f2"]  # the step's deletes are undone


def test_a_held_step_ended_by_the_next_step_is_denied_first(world):
    ws, hold = _held_ambient(world)
    sid = ws.begin_step("make")  # the next command begins before anyone answered
    assert ws.step_state(hold.step_id) is S.ROLLED_BACK and ws.pending_hold is None
    assert sorted(world.work.listdir("")) == ["f0", "f1", "f2"]
    with pytest.raises(KeyError):
        ws.resolve_hold(hold.id, "allow")  # too late: it was denied
    assert ws.active_step_id == sid


def test_a_held_command_step_does_not_close_at_quiescence(world):
    for i in range(3):
        world.work.create(f"f{i}", 0o644)
    ws = world.open(safeguard=SafeguardConfig(delete_threshold=2, timeout_s=30.0))
    sid = ws.begin_step("rm -f f*")
    ws.fs.unlink("f0")
    with pytest.raises(HoldRequired) as e:
        ws.fs.unlink("f1")
    ws.complete_step(sid, 0)  # the command exited; the held request is still unanswered
    world.now_s += 1  # past the 100 ms quiescence window
    ws.poll()
    assert ws.step_state(sid) is S.COMPLETING
    world.now_s += 60  # past the hold's deadline: no answer is a deny, then the step closes
    ws.poll()
    ws.poll()
    assert ws.step_state(sid) is S.ROLLED_BACK and e.value.hold.step_id == sid
    assert sorted(world.work.listdir("")) == ["f0", "f1", "f2"]


def test_close_step_waits_for_the_request_in_flight_and_keeps_its_write(world):
    ws = world.open()  # the world's clock stands still: only op_finished can end the drain
    sid = ws.begin_step("make")
    ws.op_started()
    request = threading.Thread(target=lambda: (ws.fs.write_file("late", b"x"), ws.op_finished()))
    result = []
    closer = threading.Thread(target=lambda: result.append(ws.close_step(sid, 0, drain_s=600)))
    closer.start()
    request.start()
    request.join()
    closer.join()
    assert result == [True]
    assert ws.step_state(sid) is S.CLOSED and "late" in ws.history()[0]["paths"]


@pytest.mark.timeout(60)
def test_a_request_that_finishes_wakes_the_close_step_waiting_for_it(world):
    """The drain's wait ends when the request in flight is answered, not at its quiescence
    window: with the world's clock standing still and an hour's window, only op_finished's
    signal can wake it (without it this test waits out its timeout)."""
    ws = world.open(quiescence_s=3600.0)
    sid = ws.begin_step("make")
    ws.op_started()
    result = []
    closer = threading.Thread(target=lambda: result.append(ws.close_step(sid, 0, drain_s=3600)))
    closer.start()
    # the closer holds the interceptor's lock from complete_step until its wait releases it:
    # a look under that lock that finds the step completing finds the closer waiting
    deadline = time.monotonic() + 30
    while ws.step_state(sid) is not S.COMPLETING:
        assert time.monotonic() < deadline, "close_step never began to drain"
        closer.join(0.001)
    ws.op_finished()
    closer.join()
    assert result == [True] and ws.step_state(sid) is S.CLOSED


def test_close_step_cut_off_at_drain_s_closes_and_the_late_write_opens_the_next_step(world):
    ws = world.open()
    sid = ws.begin_step("make")
    with ws.in_flight():
        assert ws.close_step(sid, 7, drain_s=0) is False
        assert ws.step_state(sid) is S.CLOSED and ws.history()[0]["exit_code"] == 7
        ws.fs.write_file("late", b"x")
        assert ws.active_step_id is not None and ws.active_step_id < 0  # ambient
    assert ws.requests_in_flight == 0
    assert ws.close_step(sid, 7) is True  # not the active step: nothing to do


def test_a_denied_step_refuses_writes_drains_and_is_recorded_as_rolled_back(world):
    ws = world.open(safeguard=SafeguardConfig(delete_threshold=1))
    with ws.step("seed"):
        ws.fs.write_file("f", b"f")
    sid = ws.begin_step("rm f")
    with pytest.raises(HoldRequired) as held:
        ws.fs.unlink("f")
    assert ws.pending_hold is not None and ws.pending_hold.id == held.value.hold.id
    with pytest.raises(ValueError):
        ws.resolve_hold(held.value.hold.id, "maybe")
    ws.resolve_hold(held.value.hold.id, "deny")
    assert ws.step_state(sid) is S.DENIED and ws.pending_hold is None
    with pytest.raises(KeyError):
        ws.resolve_hold(held.value.hold.id, "allow")  # answered already
    with pytest.raises(SafeguardDenied):
        ws.fs.write_file("g", b"g")
    assert ws.close_step(sid, 1) is True
    assert ws.step_state(sid) is S.ROLLED_BACK and ws.history()[0]["outcome"] == "denied"


def test_a_step_waiting_for_a_full_disk_stays_ended_until_recorded_or_discarded():
    w = World("sim")
    ws = w.open()
    w.injector = FaultInjector(error_if=(lambda fs, op, p: fs == "store" and "manifest" in p, errno.ENOSPC))
    sid = ws.begin_step("work")
    ws.fs.write_file("b", b"b")
    assert ws.close_step(sid, 0) is True  # it has ended; recording it failed: a warning, not an error
    assert any(e.get("code") == "undo.promotion_failed" for e in ws.events)
    assert ws.active_step_id is None and ws.step_state() is S.ENDED
    with pytest.raises(OSError):
        ws.close_active()  # the retry fails while the disk is full
    assert ws.step_state(sid) is S.ENDED
    ws.discard()  # the way out: the waiting step goes with the history
    assert ws.step_state(sid) is S.DISCARDED and ws.step_state() is None
    w.injector = FaultInjector()
    with ws.step("next") as s:
        ws.fs.write_file("c", b"c")
    assert ws.step_state(s.id) is S.CLOSED


def test_configuration_doors_return_copies(world):
    ws = world.open(safeguard=SafeguardConfig(delete_threshold=5))
    cfg = ws.safeguard_config
    cfg.delete_threshold = 1
    assert ws.safeguard_config.delete_threshold == 5
    ws.configure_safeguard(delete_threshold=2)
    assert ws.safeguard_config.delete_threshold == 2
    limits = ws.limits
    ws.configure_limits(max_step_count=limits.max_step_count + 1)
    assert ws.limits.max_step_count == limits.max_step_count + 1


def test_the_workspace_keeps_its_parts_private(world):
    ws = world.open()
    for name in ("interceptor", "tracker", "log", "own_writes"):
        assert not hasattr(ws, name), name


def test_the_own_write_journal_is_returned_beside_the_workspace_not_set_on_it(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    opened = open_workspace(str(work), watched=True, state_dir=str(tmp_path / "state"))
    assert isinstance(opened, OpenedWorkspace) and opened.own_writes is not None
    ws, journal = opened
    found = []
    detector = watch_workspace(journal, str(work), found.append)
    try:
        assert not hasattr(ws, "own_writes")
    finally:
        detector.stop()
        ws.close()
    plain = open_workspace(str(work), state_dir=str(tmp_path / "state"))
    try:
        assert plain.own_writes is None
        with pytest.raises(ValueError, match="watched=True"):
            watch_workspace(plain.own_writes, str(work))
    finally:
        plain.workspace.close()


# ---------------------------------------------------------------------------- random door calls


class DoorMachine(RuleBasedStateMachine):
    """Random sequences of door calls on the simulated disk: every transition the code
    makes must be an edge of the table (or ``_transition`` raises), and what the doors
    report agrees with a small model."""

    def __init__(self):
        super().__init__()
        self.world = World("sim")
        self.ws: Workspace = self.world.open(safeguard=SafeguardConfig(delete_threshold=2))
        self.n = 0
        self.files: set[str] = set()
        self.in_flight = 0
        self.hold = None

    def teardown(self):
        self.ws.close()

    @rule()
    def begin(self):
        try:
            self.ws.begin_step(f"cmd {self.n}")
        except RuntimeError:
            assert self.ws.step_state() in (S.OPEN, S.DENIED)  # a command step is running
            return
        assert self.ws.step_state() is S.OPEN

    @rule()
    def write(self):
        self.n += 1
        name = f"f{self.n % 5}"
        try:
            self.ws.fs.write_file(name, b"x" * self.n)
            self.files.add(name)
        except (HoldRequired, SafeguardDenied):
            pass

    @precondition(lambda self: self.files)
    @rule(data=st.data())
    def delete(self, data):
        name = data.draw(st.sampled_from(sorted(self.files)))
        try:
            self.ws.fs.unlink(name)
            self.files.discard(name)
        except HoldRequired as e:
            self.hold = e.hold
        except SafeguardDenied:
            pass

    @precondition(lambda self: self.ws.pending_hold is not None)
    @rule(action=st.sampled_from(["allow", "deny"]))
    def answer(self, action):
        hold = self.ws.pending_hold
        was_active = self.ws.active_step_id == hold.step_id
        self.ws.resolve_hold(hold.id, action)
        # a held step never ends by time (idling out, quiescence), and ending it otherwise (the
        # next begin_step, closing it now) denies the hold first: an answer always meets its step
        assert was_active, (hold, self.ws.active_step_id)
        if action == "deny":
            assert self.ws.step_state(hold.step_id) is S.DENIED

    @rule()
    def start_request(self):
        self.ws.op_started()
        self.in_flight += 1

    @precondition(lambda self: self.in_flight)
    @rule()
    def finish_request(self):
        self.ws.op_finished()
        self.in_flight -= 1

    @rule(code=st.integers(0, 3))
    def complete(self, code):
        sid = self.ws.active_step_id
        if sid is not None and sid > 0 and self.ws.step_state() in (S.OPEN, S.DENIED):
            try:
                self.ws.complete_step(sid, code)
            except AssertionError:
                assert self.ws.step_state() is S.DENIED  # its command had exited already
                return
            assert self.ws.step_state(sid) in (S.COMPLETING, S.DENIED, S.CLOSED, S.ROLLED_BACK)

    @rule(code=st.integers(0, 3))
    def close_step(self, code):
        sid = self.ws.active_step_id
        if sid is not None:
            self.ws.close_step(sid, code, drain_s=0)
            assert self.ws.step_state(sid) in (S.CLOSED, S.ROLLED_BACK)

    @rule(seconds=st.sampled_from([0.05, 0.2, 6.0]))
    def time_passes(self, seconds):
        self.world.now_s += seconds
        self.ws.poll()

    @rule()
    def close_active(self):
        self.ws.close_active()
        assert self.ws.active_step_id is None

    @invariant()
    def doors_agree(self):
        assert self.ws.requests_in_flight == self.in_flight
        state = self.ws.step_state()
        assert (state in ACTIVE_STATES) == (self.ws.active_step_id is not None)
        assert state is not S.ENDED  # the disk never fills here: an ended step is recorded at once

    @invariant()
    def files_model_follows_rollbacks(self):
        # any door that ends a held step (answer deny, begin, close_active, close_step) rolls it
        # back: the files it created are gone again — the model only names files that exist
        self.files = {f for f in self.files if self.world.work.exists(f)}


TestDoorMachine = DoorMachine.TestCase
TestDoorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
