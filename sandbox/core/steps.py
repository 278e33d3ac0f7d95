"""StepTracker: which step a write belongs to, right now — and the step's lifecycle.

Pure state over an injectable clock (seconds). Invariants:

* at most one step is active; ids are host-assigned (the UndoLog allocates them):
  command and API steps count up from 1, ambient steps down from -1;
* a write with no active step opens an *ambient* step, which closes after
  ``ambient_idle_s`` without writes (seed §11.3: 5 s);
* ``complete`` does not close a command step at once: it *drains* until the in-flight
  request count reaches zero or ``quiescence_s`` passes, and late writes meanwhile still
  belong to it (SPEC §4);
* a step denied by a safeguard stays active but refuses every further write until it
  ends, so nothing lands after its rollback.

A step's lifecycle is a named state machine (:class:`StepState`). Every change of state
goes through :meth:`Step._transition`, which refuses (``AssertionError``) any edge not in
:data:`EDGES` — the way SQLite's pager names its states and asserts each move::

    begin ─► OPEN ───── complete(exit code) ─────► COMPLETING  (draining: until nothing is
              │  │                                   │  │       in flight, or the quiescence
              │  └─ deny ─► DENIED ◄──── deny ───────┘  │       window has passed)
              │    (a hold   │  (refuses writes)        │
              │    refused:  │                          │
              │    writes    │ ends                     │ drained, or closed now
              │    undone)   ▼                          │
              └──────────► ENDED ◄──────────────────────┘
        idle (ambient),      │   (in the WAL; not yet in history)
        or closed now        │
             ┌───────────────┼───────────────────────┐
             ▼ recorded      ▼ recorded as denied    ▼ history discarded first
           CLOSED        ROLLED_BACK             DISCARDED

OPEN, COMPLETING and DENIED are *active* (writes are attributed to the step; a DENIED
one refuses them). A DENIED step whose command has exited still drains before it ends:
its exit code is data, not a state. ENDED lasts while the promotion fails (the store's
disk is full): the step waits in the write-ahead log, retried at the next boundary; if
the process stops first, the next open rolls it back (WAL rule 5). CLOSED, ROLLED_BACK
and DISCARDED are final.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable

COMMAND, API, AMBIENT = "command", "api", "ambient"
STEP_TYPES = (COMMAND, API, AMBIENT)


class StepState(str, enum.Enum):
    OPEN = "open"
    COMPLETING = "completing"
    DENIED = "denied"
    ENDED = "ended"
    CLOSED = "closed"
    ROLLED_BACK = "rolled_back"
    DISCARDED = "discarded"


S = StepState
#: every legal edge of the lifecycle (the module docstring draws it); nothing else happens
EDGES: dict[StepState, frozenset[StepState]] = {
    S.OPEN: frozenset({S.COMPLETING, S.DENIED, S.ENDED}),
    S.COMPLETING: frozenset({S.DENIED, S.ENDED}),
    S.DENIED: frozenset({S.ENDED}),
    S.ENDED: frozenset({S.CLOSED, S.ROLLED_BACK, S.DISCARDED}),
    S.CLOSED: frozenset(),
    S.ROLLED_BACK: frozenset(),
    S.DISCARDED: frozenset(),
}
ACTIVE_STATES = frozenset({S.OPEN, S.COMPLETING, S.DENIED})
FINAL_STATES = frozenset(s for s, out in EDGES.items() if not out)


@dataclass(init=False)
class Step:
    """One step from its beginning to its record in history (or its discard)."""

    id: int
    type: str
    command: str
    last_write_s: float
    state: StepState = S.OPEN
    drain_deadline_s: float = 0.0
    exit_code: int | None = None
    #: the states it has been in, in order (bounded: the graph has no cycle, so at most 5)
    trail: tuple[StepState, ...] = (S.OPEN,)

    def __init__(self, id: int, type: str, command: str, last_write_s: float, state: StepState = S.OPEN,
                 drain_deadline_s: float = 0.0, exit_code: int | None = None, trail: tuple[StepState, ...] = (S.OPEN,)):
        """The fields above, in their order and with their defaults; written out rather than
        generated, so that a campaign's build compiles it (``sandbox_sim/compiled.py``)."""
        self.id = id
        self.type = type
        self.command = command
        self.last_write_s = last_write_s
        self.state = state
        self.drain_deadline_s = drain_deadline_s
        self.exit_code = exit_code
        self.trail = trail

    def _transition(self, to: StepState) -> None:
        """The only place ``state`` changes; an edge outside :data:`EDGES` is a bug."""
        if to not in EDGES[self.state]:
            raise AssertionError(f"step {self.id}: illegal transition {self.state.name} -> {to.name}")
        self.state = to
        self.trail += (to,)

    @property
    def draining(self) -> bool:
        """The command has exited: the step waits for its late writes, then ends."""
        return self.state in (S.COMPLETING, S.DENIED) and self.exit_code is not None

    @property
    def denied(self) -> bool:
        return self.state in (S.DENIED, S.ROLLED_BACK)

    @property
    def running(self) -> bool:
        """A command or API step whose command has not exited (undo and new steps wait)."""
        return self.state in ACTIVE_STATES and self.type != AMBIENT and not self.draining



class StepTracker:
    def __init__(self, clock_s: Callable[[], float] | None = None, ambient_idle_s: float = 5.0, quiescence_s: float = 0.1):
        if ambient_idle_s <= 0 or quiescence_s < 0:
            raise ValueError("ambient_idle_s must be > 0 and quiescence_s >= 0")
        self.clock_s = clock_s or time.monotonic
        self.ambient_idle_s = ambient_idle_s
        self.quiescence_s = quiescence_s
        self.active: Step | None = None  # OPEN, COMPLETING or DENIED
        self.ended: Step | None = None  # ENDED: waits to be recorded (its promotion failed so far)
        self.last: Step | None = None  # the newest step in a final state
        self.in_flight = 0

    def begin(self, step_id: int, step_type: str, command: str) -> Step:
        if step_type not in STEP_TYPES:
            raise ValueError(f"unknown step type {step_type!r}")
        if self.active is not None:
            raise RuntimeError(f"step {self.active.id} is still active")
        if self.ended is not None:
            raise AssertionError(f"step {self.ended.id} has ended but is neither recorded nor discarded")
        self.active = Step(step_id, step_type, command, self.clock_s())
        return self.active

    def touch(self) -> None:
        if self.active is not None:
            self.active.last_write_s = self.clock_s()

    def complete(self, step_id: int, exit_code: int | None) -> None:
        a = self.active
        if a is None or a.id != step_id:
            raise KeyError(f"step {step_id} is not the active step")
        if a.draining:
            raise AssertionError(f"step {step_id} completed twice")
        if a.state is S.OPEN:
            a._transition(S.COMPLETING)
        a.exit_code = exit_code  # a DENIED step stays DENIED: it drains all the same
        a.drain_deadline_s = self.clock_s() + self.quiescence_s

    def deny(self) -> Step:
        """A hold on the active step was denied: it refuses every further write."""
        a = self.active
        assert a is not None
        a._transition(S.DENIED)
        return a

    def op_started(self) -> None:
        """A server received a request that may write (bounded by the server's own limits)."""
        self.in_flight += 1

    def op_finished(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def due(self) -> bool:
        """Should the active step be closed now?"""
        a = self.active
        if a is None:
            return False
        now = self.clock_s()
        if a.type == AMBIENT:
            return now - a.last_write_s >= self.ambient_idle_s
        if a.draining:
            return self.in_flight == 0 or now >= a.drain_deadline_s
        return False

    def end(self) -> Step:
        """The active step ends: ENDED until :meth:`recorded` or :meth:`discarded`."""
        a = self.active
        assert a is not None
        a._transition(S.ENDED)
        self.active, self.ended = None, a
        return a

    def recorded(self, outcome_denied: bool) -> Step | None:
        """The ended step is in history now (or there was no store to record it in)."""
        e = self.ended
        if e is None:
            return None
        e._transition(S.ROLLED_BACK if outcome_denied else S.CLOSED)
        self.ended, self.last = None, e
        return e

    def discarded(self) -> Step | None:
        """The undo history was discarded before the ended step could be recorded."""
        e = self.ended
        if e is None:
            return None
        e._transition(S.DISCARDED)
        self.ended, self.last = None, e
        return e
