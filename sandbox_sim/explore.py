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

``power_loss=True`` (durable mode): each crash point is explored as the machine losing power.
``loss_states="extremes"`` (the default) explores two states: nothing but fsynced data
surviving (``MemoryHostFS.power_loss``, the strictest model) and the kernel having written
the working tree back. ``loss_states="prefixes"`` explores the states in between as well:
the simulated disks record each inode's un-fsynced data versions (``record_losses``), and
every combination of per-inode prefixes — each inode of the working folder and of the undo
store independently keeping the first ``p`` of its un-fsynced changes, ``0 <= p <= n``,
:func:`prefix_states` — is a state, plus the written-back tree. More than
``loss_states_max`` (default ``EXPLORE_LOSS_STATES_MAX``) combinations at one crash point
are sampled: both ends (nothing kept, all kept) and a seeded draw (``seed``), the same
for the same seed;
``report.loss_states_sampled`` counts such points and ``report.loss_states_possible`` the
states there were. ``durable=False`` with ``power_loss`` is the negative control: the same
losses without the core's fsyncs, which must find violations.

Each violation carries ``(k, mode, keep)`` and ``replay``, the keyword arguments that
explore that state alone: ``explore_crashes(make_tree, workload, **v.replay)`` (``ks=[k]``;
for a state between the extremes also ``keep``, the ``(disk, ino, p)`` of every inode that
kept ``p > 0`` un-fsynced versions). ``k == -1`` is the run without a crash (a workload that
fails by itself, or whose final rollback of all history is not exact: then the crash points
are explored all the same). At most ``EXPLORE_STATES_MAX`` states per call — counting
``1 + loss_states_max`` per point for ``"prefixes"`` — unless ``ks`` names the crash points.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
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
#: ``loss_states="prefixes"``: combinations of per-inode prefixes explored at one crash point
#: at most (the default ``loss_states_max``); beyond it a seeded sample of this many
EXPLORE_LOSS_STATES_MAX = 64

LOSS_STATES = ("extremes", "prefixes")

#: a state between the extremes: ``(disk, ino, p)`` of every inode keeping ``p > 0`` of its
#: un-fsynced data versions, sorted; ``()`` keeps none (the strict extreme)
Keep = tuple[tuple[str, int, int], ...]


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
    mode: str  # "crash" | "power loss" | "power loss after writeback" | "power loss keeping un-fsynced writes"
    action: int  # the workload action running when it died (-1: none, the dry run)
    error: str
    keep: Keep = ()  # the un-fsynced versions that survived (see Keep)
    replay: dict = field(default_factory=dict, compare=False)  # explore_crashes(make_tree, workload, **replay): this state alone


@dataclass
class CrashReport:
    host_calls: int  # crash points: the host calls of the workload's dry run
    states: int = 0  # crash states explored
    outcomes: Counter = field(default_factory=Counter)  # how each state recovered
    violations: list[CrashViolation] = field(default_factory=list)
    explored: list[tuple[int, str, Keep]] = field(default_factory=list)  # (k, mode, keep) of each state, in order
    loss_states_possible: int = 0  # "prefixes": the power-loss states there were at the points explored
    loss_states_sampled: int = 0  # "prefixes": crash points with more than loss_states_max combinations (sampled)


def prefix_states(choices: dict[tuple[str, int], int], k: int, seed: int, limit: int) -> tuple[list[Keep], int]:
    """The states between the extremes at crash point ``k``: every combination of a prefix
    ``0..n`` per inode (``choices``: ``(disk, ino) -> n`` un-fsynced versions), as
    :data:`Keep` tuples in a fixed order, the strict extreme ``()`` first; and how many
    combinations there are. More than ``limit`` (>= 2): both ends (nothing kept, all kept)
    and ``limit - 2`` others drawn with ``random.Random(f"{seed}:{k}")``, in the same order."""
    keys = sorted(choices)
    radices = [choices[key] + 1 for key in keys]
    total = math.prod(radices)

    def keep(digits) -> Keep:
        return tuple((disk, ino, p) for (disk, ino), p in zip(keys, digits) if p)

    if total <= limit:
        return [keep(digits) for digits in itertools.product(*(range(r) for r in radices))], total

    def digits_of(index: int) -> list[int]:
        out = []
        for r in reversed(radices):  # the last key varies fastest, as in itertools.product
            index, p = divmod(index, r)
            out.append(p)
        return out[::-1]

    rng = random.Random(f"{seed}:{k}")
    if total - 2 <= sys.maxsize:
        picked = rng.sample(range(1, total - 1), limit - 2)
    else:  # too many to index with a range: draw digits (a repeat, or an end, is drawn again)
        seen: set[int] = set()
        while len(seen) < limit - 2:
            index = 0
            for r in radices:
                index = index * r + rng.randrange(r)
            if 0 < index < total - 1:
                seen.add(index)
        picked = list(seen)
    return [keep(digits_of(i)) for i in [0, *sorted(picked), total - 1]], total


class _BadKeep(ValueError):
    """A ``keep`` asked for versions the crash state does not have (not a violation)."""


def _modes(power_loss: bool) -> list[tuple[str, bool, bool]]:
    return [("power loss", True, False), ("power loss after writeback", True, True)] if power_loss else [("crash", False, False)]


def explore_crashes(make_tree: Callable[[HostFS], None], workload: list[Step | Rollback], *, power_loss: bool = False,
                    durable: bool | None = None, limits: Limits | None = None, ks: list[int] | None = None,
                    loss_states: str = "extremes", loss_states_max: int = EXPLORE_LOSS_STATES_MAX, seed: int = 0,
                    keep: Keep | None = None) -> CrashReport:
    """Explore every crash state of ``workload`` (see the module docstring)."""
    if loss_states not in LOSS_STATES:
        raise ValueError(f"loss_states must be one of {LOSS_STATES}, not {loss_states!r}")
    prefixes = loss_states == "prefixes"
    if prefixes and not power_loss:
        raise ValueError('loss_states="prefixes" needs power_loss=True')
    if keep is not None and not (prefixes and ks is not None):
        raise ValueError('keep replays one state: it needs loss_states="prefixes" and ks')
    if loss_states_max < 2:
        raise ValueError("loss_states_max must be at least 2 (the two ends)")
    durable = power_loss if durable is None else durable
    limits = limits or Limits()
    dry = _driver(make_tree, limits, durable, record=False)
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
    per_point = 1 + loss_states_max if prefixes else len(_modes(power_loss))
    if ks is None and len(points) * per_point > EXPLORE_STATES_MAX:
        raise ValueError(f"up to {len(points) * per_point} crash states, more than EXPLORE_STATES_MAX ({EXPLORE_STATES_MAX}): "
                         "pass ks to choose crash points" + (" or lower loss_states_max" if prefixes else ""))
    base = {"power_loss": True, "durable": durable} if power_loss else {}

    def explore(k: int, mode: str, writeback: bool = False, keep_: Keep | None = None, seen: dict | None = None) -> None:
        report.states += 1
        report.explored.append((k, mode, keep_ or ()))
        d = _driver(make_tree, limits, durable, record=prefixes)
        d._arm(FaultInjector(crash_at=k))
        outcome, error = _run(d, workload, power=power_loss, writeback=writeback, keep=keep_, seen=seen)
        report.outcomes[outcome] += 1
        if error is not None:
            replay = dict(base, ks=[k])
            if prefixes and not writeback:
                replay.update(loss_states="prefixes", keep=keep_ or ())
            report.violations.append(CrashViolation(k, mode, error[0], error[1], keep_ or (), replay))

    for k in points:
        if not prefixes:
            for mode, _power, writeback in _modes(power_loss):
                explore(k, mode, writeback)
            continue
        if keep is not None:
            report.loss_states_possible += 1
            explore(k, "power loss keeping un-fsynced writes" if keep else "power loss", keep_=tuple(keep))
            continue
        seen: dict = {}
        explore(k, "power loss", keep_=(), seen=seen)  # the strict extreme; learns what else could survive
        explore(k, "power loss after writeback", writeback=True)
        states, total = prefix_states(seen.get("choices", {}), k, seed, loss_states_max)
        report.loss_states_possible += total + 1
        report.loss_states_sampled += total > loss_states_max
        for state in states[1:]:
            explore(k, "power loss keeping un-fsynced writes", keep_=state)
    return report


def _driver(make_tree, limits: Limits, durable: bool, record: bool) -> Driver:
    world = World("sim")
    world.work.record_losses = world.store.record_losses = record  # from before the initial tree's sync on
    return Driver(world, 0, limits, durable=durable, tree=make_tree)


def _survivors(world: World, keep: Keep | None, seen: dict | None) -> dict[str, dict[int, int]]:
    """At the crash, before the power goes: what could survive (into ``seen["choices"]``:
    ``(disk, ino) -> n``), and ``keep`` as ``World.crash`` takes it (checked against that)."""
    choices = {(fs.name, ino): n for fs in (world.work, world.store) for ino, n in fs.loss_choices().items()}
    if seen is not None:
        seen["choices"] = choices
    by_disk: dict[str, dict[int, int]] = {"work": {}, "store": {}}
    for disk, ino, p in keep or ():
        if not 0 < p <= choices.get((disk, ino), 0):
            raise _BadKeep(f"{disk} inode {ino}: {choices.get((disk, ino), 'no')} un-fsynced versions at this crash point, "
                           f"cannot keep {p}")
        by_disk[disk][ino] = p
    return by_disk


def _run(d: Driver, workload, power: bool = False, writeback: bool = False, keep: Keep | None = None,
         seen: dict | None = None) -> tuple[str, tuple[int, str] | None]:
    """Run the workload on ``d``; on the armed crash, recover and check. Returns (outcome,
    (action, error) or None). ``keep``: the un-fsynced versions the power loss keeps;
    ``seen["choices"]``: what it could have kept (``(disk, ino) -> n``)."""
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
                by_disk = _survivors(d.world, keep, seen) if power and not writeback else None
                d._crash_and_reopen(rolled_back=top, power=power, writeback=writeback, keep=by_disk)
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
        if isinstance(e, (KeyboardInterrupt, _BadKeep)):
            raise
        return outcome, (i, f"{type(e).__name__}: {e}")
    finally:
        d.close()
    return outcome, None
