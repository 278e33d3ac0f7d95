"""StepTracker: which step a write belongs to, right now.

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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

COMMAND, API, AMBIENT = "command", "api", "ambient"
STEP_TYPES = (COMMAND, API, AMBIENT)


@dataclass
class ActiveStep:
    id: int
    type: str
    command: str
    last_write_s: float
    draining: bool = False
    drain_deadline_s: float = 0.0
    exit_code: int | None = None
    denied: bool = False


class StepTracker:
    def __init__(self, clock_s: Callable[[], float] | None = None, ambient_idle_s: float = 5.0, quiescence_s: float = 0.1):
        if ambient_idle_s <= 0 or quiescence_s < 0:
            raise ValueError("ambient_idle_s must be > 0 and quiescence_s >= 0")
        self.clock_s = clock_s or time.monotonic
        self.ambient_idle_s = ambient_idle_s
        self.quiescence_s = quiescence_s
        self.active: ActiveStep | None = None
        self.in_flight = 0

    def begin(self, step_id: int, step_type: str, command: str) -> ActiveStep:
        if step_type not in STEP_TYPES:
            raise ValueError(f"unknown step type {step_type!r}")
        if self.active is not None:
            raise RuntimeError(f"step {self.active.id} is still active")
        self.active = ActiveStep(step_id, step_type, command, self.clock_s())
        return self.active

    def touch(self) -> None:
        if self.active is not None:
            self.active.last_write_s = self.clock_s()

    def complete(self, step_id: int, exit_code: int | None) -> None:
        a = self.active
        if a is None or a.id != step_id:
            raise KeyError(f"step {step_id} is not the active step")
        a.exit_code = exit_code
        a.draining = True
        a.drain_deadline_s = self.clock_s() + self.quiescence_s

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

    def end(self) -> ActiveStep:
        a = self.active
        assert a is not None
        self.active = None
        return a
