"""Safeguard decisions: pure logic, no I/O (seed §4.5.1).

A check is made *before* each operation that could cross a threshold. If the operation
would reach the threshold, the verdict is a :class:`Hold` and the operation must not
run until the hold is resolved: ``allow`` lifts that kind of safeguard for the rest of
the step (the held operation is then retried and runs); ``deny`` means the caller rolls
the step back. While a hold is pending every further mutation is held behind it.
A hold older than ``timeout_s`` resolves to deny.

Kinds: ``delete`` (unlink or rmdir count reaches ``delete_threshold``), ``overwrite``
(truncation or overwrite of an existing file larger than ``overwrite_size_bytes``; the
``overwrite_threshold``-th such operation holds), ``rename_over`` (a rename onto an
existing destination; the ``rename_over_threshold``-th holds). A threshold of ``None``
turns that kind off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

KINDS = ("delete", "overwrite", "rename_over")
SAMPLE_PATHS_MAX = 10


@dataclass
class SafeguardConfig:
    delete_threshold: int | None = None
    overwrite_size_bytes: int = 1 << 20
    overwrite_threshold: int | None = None
    rename_over_threshold: int | None = None
    timeout_s: float = 30.0

    def __post_init__(self):
        for name in ("delete_threshold", "overwrite_threshold", "rename_over_threshold"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None")
        if self.overwrite_size_bytes < 0 or self.timeout_s <= 0:
            raise ValueError("overwrite_size_bytes must be >= 0 and timeout_s > 0")

    def threshold(self, kind: str) -> int | None:
        return {"delete": self.delete_threshold, "overwrite": self.overwrite_threshold,
                "rename_over": self.rename_over_threshold}[kind]


@dataclass
class Hold:
    id: str
    step_id: int
    kind: str
    count: int  # operations of this kind in the step, including the held one
    path: str  # the held operation's path
    sample_paths: list[str]
    created_s: float
    deadline_s: float

    @property
    def message(self) -> str:
        what = {"delete": "delete", "overwrite": "overwrite or truncate large files,", "rename_over": "rename onto existing files,"}[self.kind]
        return f"Step {self.step_id} is attempting to {what} {self.count} so far. Awaiting confirmation."

    def as_dict(self) -> dict:
        return {"safeguard_id": self.id, "step_id": self.step_id, "kind": self.kind, "count": self.count,
                "delete_count": self.count if self.kind == "delete" else None, "path": self.path,
                "sample_paths": list(self.sample_paths), "message": self.message}


@dataclass
class _StepCounts:
    step_id: int
    counts: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    samples: dict = field(default_factory=lambda: {k: [] for k in KINDS})
    allowed: set = field(default_factory=set)


class Safeguard:
    def __init__(self, config: SafeguardConfig | None = None, clock_s: Callable[[], float] | None = None):
        self.config = config or SafeguardConfig()
        self.clock_s = clock_s or time.monotonic
        self.pending: Hold | None = None
        self._step: _StepCounts | None = None
        self._next_id = 1

    def _counts(self, step_id: int) -> _StepCounts:
        if self._step is None or self._step.step_id != step_id:
            self._step = _StepCounts(step_id)
        return self._step

    def check(self, step_id: int, kind: str, path: str) -> Hold | None:
        """Verdict for one operation of ``kind``: None (go ahead, counted) or a Hold."""
        if self.pending is not None:
            return self.pending
        sc = self._counts(step_id)
        limit = self.config.threshold(kind)
        if limit is not None and kind not in sc.allowed and sc.counts[kind] + 1 >= limit:
            now = self.clock_s()
            samples = (sc.samples[kind] + [path])[:SAMPLE_PATHS_MAX]
            self.pending = Hold(f"sg_{self._next_id:03d}", step_id, kind, sc.counts[kind] + 1, path, samples, now,
                                now + self.config.timeout_s)
            self._next_id += 1
            return self.pending
        sc.counts[kind] += 1
        if len(sc.samples[kind]) < SAMPLE_PATHS_MAX:
            sc.samples[kind].append(path)
        return None

    def resolve(self, hold_id: str, action: str) -> Hold:
        if action not in ("allow", "deny"):
            raise ValueError(f"action must be 'allow' or 'deny', not {action!r}")
        hold = self.pending
        if hold is None or hold.id != hold_id:
            raise KeyError(f"no pending safeguard {hold_id!r}")
        self.pending = None
        if action == "allow":
            self._counts(hold.step_id).allowed.add(hold.kind)
        return hold

    def expired(self) -> Hold | None:
        """The pending hold if its timeout has passed (the caller denies it)."""
        if self.pending is not None and self.clock_s() >= self.pending.deadline_s:
            return self.pending
        return None

    def step_ended(self, step_id: int) -> None:
        if self._step is not None and self._step.step_id == step_id:
            self._step = None
