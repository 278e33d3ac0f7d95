"""Crash-state exploration: every crash point of a workload, as a library call (issue 19).

    from sandbox_sim.explore import Rollback, Step, explore_crashes

    report = explore_crashes(make_tree, [Step("build", build), Step("clean", clean), Rollback(1)])
    report.states, report.outcomes, report.violations

For a workload — a list of :class:`Step` (a named step of the undo core running a function
of the :class:`~sandbox.core.workspace.Workspace`, whose ``fs`` is the intercepted
filesystem) and :class:`Rollback` — on the initial tree ``make_tree(fs)`` makes: a dry run
counts the host calls the workload makes (working folder and undo store together); then for
*every* call ``k`` a fresh world runs the workload with the process killed before call ``k``,
reopens (recovery) and checks the undo invariant (``sandbox_sim/checker.py``: the tree equals
the post-state of the newest step in history; a step the crash interrupted either never
reached history and is gone, or is whole), then rolls every step left in history back and
checks again (history stays usable). The crash handling is the campaign driver's own
(:class:`~sandbox_sim.driver.Driver`).

``power_loss=True`` (durable mode): each crash point is explored twice, as the machine
losing power — once with nothing but fsynced data surviving (``MemoryHostFS.power_loss``,
the strictest model: no write reached the disk unless fsynced) and once after the kernel
had written the working tree back. The states in between — some un-fsynced writes lost,
others kept, in any order — are **not** enumerated (the simulated disk does not record
un-fsynced writes one by one). ``durable=False`` with ``power_loss`` is the negative
control: the same losses without the core's fsyncs, which must find violations.

Each violation carries ``(k, mode)`` — rerun it alone with ``ks=[k]`` — and the error;
``k == -1`` is the run without a crash (a workload that fails by itself, or whose final
rollback of all history is not exact: then the crash points are explored all the same).
At most ``EXPLORE_STATES_MAX`` states per call unless ``ks`` names the crash points.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from sandbox.core.store import Limits
from sandbox.core.workspace import Workspace
from sandbox.hostfs import HostFS

from .driver import Driver
from .faults import FaultInjector, SimulatedCrash
from .world import World

#: crash states one call explores at most (each is a fresh world and a whole run)
EXPLORE_STATES_MAX = 100_000


@dataclass(frozen=True)
class Step:
    """One step of the workload: ``run(ws)`` inside ``ws.step(name)``."""

    name: str
    run: Callable[[Workspace], None]


@dataclass(frozen=True)
class Rollback:
    """Undo the newest ``n`` steps (``ws.rollback(n)``)."""

    n: int = 1


@dataclass(frozen=True)
class CrashViolation:
    k: int  # the host call the process died before
    mode: str  # "crash" | "power loss" | "power loss after writeback"
    action: int  # the workload action running when it died (-1: none, the dry run)
    error: str


@dataclass
class CrashReport:
    host_calls: int  # crash points: the host calls of the workload's dry run
    states: int = 0  # crash states explored
    outcomes: Counter = field(default_factory=Counter)  # how each state recovered
    violations: list[CrashViolation] = field(default_factory=list)


def _modes(power_loss: bool) -> list[tuple[str, bool, bool]]:
    return [("power loss", True, False), ("power loss after writeback", True, True)] if power_loss else [("crash", False, False)]


def explore_crashes(make_tree: Callable[[HostFS], None], workload: list[Step | Rollback], *, power_loss: bool = False,
                    durable: bool | None = None, limits: Limits | None = None, ks: list[int] | None = None) -> CrashReport:
    """Explore every crash state of ``workload`` (see the module docstring)."""
    durable = power_loss if durable is None else durable
    limits = limits or Limits()
    dry = _driver(make_tree, limits, durable)
    dry._arm(FaultInjector())
    _, error = _run(dry, workload)
    report = CrashReport(host_calls=getattr(dry, "calls", 0))
    if error is not None:
        report.violations.append(CrashViolation(-1, "no crash", error[0], error[1]))
        if not hasattr(dry, "calls"):
            return report  # the workload itself failed: its crash points are unknown
    if ks is not None:
        report.violations = []  # only the crash points asked for
    points = list(range(report.host_calls)) if ks is None else list(ks)
    modes = _modes(power_loss)
    if ks is None and len(points) * len(modes) > EXPLORE_STATES_MAX:
        raise ValueError(f"{len(points) * len(modes)} crash states, more than EXPLORE_STATES_MAX ({EXPLORE_STATES_MAX}): "
                         "pass ks to choose crash points")
    for k in points:
        for mode, power, writeback in modes:
            report.states += 1
            d = _driver(make_tree, limits, durable)
            d._arm(FaultInjector(crash_at=k))
            outcome, error = _run(d, workload, power=power, writeback=writeback)
            report.outcomes[outcome] += 1
            if error is not None:
                report.violations.append(CrashViolation(k, mode, error[0], error[1]))
    return report


def _driver(make_tree, limits: Limits, durable: bool) -> Driver:
    return Driver(World("sim"), 0, limits, durable=durable, tree=make_tree)


def _run(d: Driver, workload, power: bool = False, writeback: bool = False) -> tuple[str, tuple[int, str] | None]:
    """Run the workload on ``d``; on the armed crash, recover and check. Returns (outcome,
    (action, error) or None)."""
    outcome = "not reached"
    i = -1
    try:
        for i, action in enumerate(workload):
            top = d._top_seqs(max(1, min(action.n, d.history_len()))) if isinstance(action, Rollback) else ()
            try:
                if isinstance(action, Rollback):
                    d.ws.rollback(action.n)
                else:
                    with d.ws.step(action.name):
                        action.run(d.ws)
            except SimulatedCrash:
                d._crash_and_reopen(rolled_back=top, power=power, writeback=writeback)
                recovery = d.ws.recovery or {}
                outcome = f"died in action {i} ({'rollback' if isinstance(action, Rollback) else 'step'}): " \
                          f"{recovery.get('kind', 'nothing to recover')}"
                d.check(f"after a crash in action {i}")
                break
            d.checker.sync(d.ws, rolled_back=top)
            d.check(f"after action {i}")
        d.calls = d.world.injector.calls  # the workload's host calls (the dry run's are the crash points)
        d._disarm()
        if d.history_len():
            d.rollback(d.history_len())  # history stays usable: everything left undoes exactly
            d.check("after rolling back all history")
    except BaseException as e:  # noqa: BLE001 - every failure is a violation of this state
        if isinstance(e, KeyboardInterrupt):
            raise
        return outcome, (i, f"{type(e).__name__}: {e}")
    finally:
        d.close()
    return outcome, None
