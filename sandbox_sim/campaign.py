"""Campaigns: long random runs of the undo model, deterministic for a seed.

A campaign is ``plan(seed, steps, faults)`` — a config and a list of actions of
``sandbox_sim/driver.py``, all drawn from the seed up front — and ``execute(config,
actions)``, which runs them on a fresh simulated world and checks the undo invariant after
every action (``Checker``: the tree equals the post-state of the newest step in history).
On the simulated disk the oracle reads the tree from its inodes; every
``CROSS_CHECK_EVERY`` actions, and after the last, that snapshot is compared with one taken
through the HostFS calls, so the fast oracle cannot drift from the slow one unnoticed.
``shrink`` reduces a failing trace (delta debugging). ``python -m sandbox_sim run`` and
``fanout`` (``sandbox_sim/fanout.py``) both run campaigns through here.
"""

from __future__ import annotations

import contextlib
import errno
import random
import shlex
import shutil
import tempfile
import time

from sandbox.core.store import Limits

from . import compiled
from .client import PROGRAM_SETS
from .driver import Driver
from .world import World

#: every this many actions (and after the last) a campaign compares the oracle's inode walk
#: with a snapshot through the HostFS calls (working folder and store)
CROSS_CHECK_EVERY = 100
#: how long ``shrink`` may take by default before it returns the smallest failing trace so far
SHRINK_BUDGET_S = 300.0

FAULTS = ("crash", "enospc", "eio", "torn", "power")
#: where a campaign's programs can run (``server_drivers.DRIVERS`` has the classes)
DRIVER_NAMES = ("sim", "wire", "fuse", "fuse-noopen")


def plan(seed: int, steps: int, faults: set[str], programs: str = "undo", driver: str = "sim") -> tuple[dict, list[tuple]]:
    """Everything a campaign does, drawn from the seed up front (so it can be replayed).
    ``programs``: the guest programs' set (``client.PROGRAM_SETS``); ``driver``: where the
    programs run (``server_drivers.DRIVERS``: the simulated disk, or through a 9P server or
    a real FUSE mount). Each is kept in the config when it is not the default, so the plans
    of every earlier seed are unchanged."""
    if programs not in PROGRAM_SETS:
        raise ValueError(f"unknown program set {programs!r} (choose from {', '.join(PROGRAM_SETS)})")
    if driver not in DRIVER_NAMES:
        raise ValueError(f"unknown driver {driver!r} (choose from {', '.join(DRIVER_NAMES)})")
    if driver != "sim" and programs != "undo":
        raise ValueError(f"the {programs} programs call the undo core's descriptor API: on the simulated disk only "
                         "(over a server, its own calls are the ones to test)")
    if driver != "sim":
        from .server_drivers import DRIVER_FAULTS

        if faults - DRIVER_FAULTS[driver]:
            raise ValueError(f"the {driver} driver takes only the fault kinds {','.join(sorted(DRIVER_FAULTS[driver]))} "
                             "(a crash there would be the server thread's, not the process's)")
    rng = random.Random(seed)
    tight = rng.random() < 0.3
    config = {"seed": rng.randrange(2**32), "max_step_count": rng.randint(2, 8), "tight": tight, "durable": "power" in faults}
    if programs != "undo":
        config["programs"] = programs
    if driver != "sim":
        config["driver"] = driver
    actions: list[tuple] = []
    # k (the host call a fault hits) is drawn over about the calls a step of 1..6 programs
    # makes: the client's own look at the tree is not a host call of the run (it reads the
    # simulated disk's inodes), so these ranges are smaller than before issue 19 and a
    # campaign injects at least as many faults per action as it did
    for _ in range(steps):
        r = rng.random()
        s, c = rng.randrange(2**32), rng.randint(1, 6)
        fault = rng.choice(sorted(faults)) if faults and rng.random() < 0.35 else None
        if r < 0.45:
            if fault == "crash":
                actions.append(("crash_in_step", s, c, rng.randint(0, 210)))
            elif fault == "power":
                actions.append(("power_loss_in_step", s, c, rng.randint(0, 340), rng.random() < 0.5))
            elif fault == "torn":
                actions.append(("torn_write_in_step", s, c, rng.randint(0, 170)))
            elif fault in ("enospc", "eio"):
                actions.append(("store_error_in_step", s, c, rng.randint(0, 58), errno.ENOSPC if fault == "enospc" else errno.EIO))
            else:
                actions.append(("step", s, c))
        elif r < 0.55:
            actions.append(("ambient", s, c))
        elif r < 0.8:
            n = rng.randint(1, 3)
            if fault == "crash":
                actions.append(("crash_in_rollback", n, rng.randint(0, 170)))
            elif fault == "power":
                actions.append(("power_loss_in_rollback", n, rng.randint(0, 255)))
            elif fault in ("enospc", "eio"):
                actions.append(("store_error_in_rollback", n, rng.randint(0, 40), errno.ENOSPC if fault == "enospc" else errno.EIO))
            else:
                actions.append(("rollback", n))
        elif r < 0.9:
            actions.append(("guarded_rm_rf", rng.randint(2, 12), rng.randint(1, 8), rng.random() < 0.5))
        else:
            actions.append(("reopen",))
    return config, actions


def _limits(config: dict) -> Limits:
    return Limits(max_step_count=config["max_step_count"],
                  max_single_step_size_bytes=6000 if config["tight"] else 200 << 20,
                  max_log_size_bytes=40_000 if config["tight"] else 1 << 30)


def execute(config: dict, actions: list[tuple], progress=None) -> tuple[Driver | None, int, BaseException | None]:
    """Run actions; returns (driver, index of the failing action or -1, error). A driver
    through a server (``config["driver"]``) is closed (its mount unmounted, its temporary
    folder removed) whatever happens; the simulated one is left open after a violation."""
    kind = config.get("driver", "sim")
    if kind == "sim":
        return _execute(World("sim"), Driver, config, actions, progress)
    from .server_drivers import DRIVER_WORLDS, DRIVERS

    tmp = tempfile.mkdtemp(prefix="sandbox-campaign-") if DRIVER_WORLDS[kind] == "real" else None
    try:
        d, fail_at, err = _execute(World(DRIVER_WORLDS[kind], tmp), DRIVERS[kind], config, actions, progress)
        if d is not None and err is not None:
            with contextlib.suppress(BaseException):
                d.close()
        return d, fail_at, err
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _execute(world: World, driver_class, config: dict, actions: list[tuple], progress) -> tuple[Driver | None, int, BaseException | None]:
    try:
        d = driver_class(world, config["seed"], _limits(config), durable=config.get("durable", False),
                         programs=PROGRAM_SETS[config.get("programs", "undo")])
    except BaseException as e:  # noqa: BLE001 - a campaign reports every failure
        return None, 0, e
    for i, action in enumerate(actions):
        if d.history_len() == 0 and action[0] in ("rollback", "crash_in_rollback", "store_error_in_rollback", "power_loss_in_rollback"):
            action = ("rollback_too_far",)
        try:
            d.run(action)
            d.check(f"after action {i} {action}")
            if (i + 1) % CROSS_CHECK_EVERY == 0 or i == len(actions) - 1:
                world.cross_check()
        except BaseException as e:  # noqa: BLE001
            return d, i, e
        if progress is not None:
            progress(i, d)
    d.close()
    return d, -1, None


#: where a fault action keeps its fault's position: the index in its tuple of ``k`` (the host
#: call, counted from the action's start, that crashes, loses power or tears) or ``j`` (the
#: store mutation that fails)
FAULT_POSITION = {"crash_in_step": 3, "power_loss_in_step": 3, "torn_write_in_step": 3, "store_error_in_step": 3,
                  "crash_in_rollback": 2, "power_loss_in_rollback": 2, "store_error_in_rollback": 2}
#: a position past the end of any action: the fault never hits
UNREACHED = 10**9


def at_position(action: tuple, position: int) -> tuple:
    """``action`` with its fault at ``position`` (a fault action) — ``KeyError`` otherwise."""
    i = FAULT_POSITION[action[0]]
    return (*action[:i], position, *action[i + 1:])


def fault_positions(config: dict, trace: list[tuple], i: int) -> int:
    """How many positions fault action ``trace[i]`` can take after ``trace[:i]``: the host
    calls (crash, power loss, torn write) or store mutations (store errors) it makes with its
    fault placed past its end. 0 when it never arms (a rollback with no history)."""
    d, fail_at, err = execute(config, [*trace[:i], at_position(trace[i], UNREACHED)])
    if err is not None:
        raise AssertionError(f"the trace fails before its fault at {i}: action {fail_at}: {err!r}")
    if d is None or d.last_armed is None:
        return 0
    calls, store_mutations = d.last_armed
    return store_mutations if trace[i][0].startswith("store_error") else calls


def sweep(config: dict, trace: list[tuple], i: int) -> list[tuple[int, int, BaseException]]:
    """Run ``trace`` with fault action ``trace[i]``'s fault at every position it can take
    (:func:`fault_positions`), the rest as written; returns ``(position, failing action,
    error)`` of every run that fails. A regression trace checked this way keeps covering
    the scenario it was found in when the core makes more or fewer host calls in that
    action, which moves the position the trace was shrunk with."""
    failures = []
    for k in range(fault_positions(config, trace, i)):
        _, fail_at, err = execute(config, [*trace[:i], at_position(trace[i], k), *trace[i + 1:]])
        if err is not None:
            failures.append((k, fail_at, err))
    return failures


def shrink(config: dict, actions: list[tuple], fail_at: int, budget_s: float = SHRINK_BUDGET_S) -> list[tuple]:
    """Delta debugging: from the failing prefix, drop chunks of actions (halves, quarters,
    … single actions) while the trace still fails. Stops after ``budget_s`` seconds with
    the smallest failing trace found so far."""
    trace = actions[: fail_at + 1]
    deadline = time.monotonic() + budget_s

    def fails(t: list[tuple]) -> bool:
        _, _, err = execute(config, t)
        return err is not None and not isinstance(err, KeyboardInterrupt)

    chunk = max(1, len(trace) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i = 0
        removed = False
        while i < len(trace) - 1 and time.monotonic() < deadline:
            candidate = trace[:i] + trace[i + chunk:]
            if candidate and fails(candidate):
                trace, removed = candidate, True
            else:
                i += chunk
        if not removed:
            chunk //= 2
    return trace




def replay_command(seed: int, config: dict, trace: list[tuple], plant: str | None = None) -> str:
    """The shell command that replays ``trace`` (what a failing run prints)."""
    planted = f"--plant {plant} " if plant else ""
    return (f"python -m sandbox_sim replay {planted}--seed {seed} --config {_quote(repr(config))} "
            f"--trace {_quote(repr([tuple(a) for a in trace]))}")


def _quote(text: str) -> str:
    """One shell word: in double quotes when nothing in it is special there (a Python
    literal of numbers and quoted names usually), else ``shlex.quote``."""
    return f'"{text}"' if not set(text) & set('"$`\\!') else shlex.quote(text)


def parse_faults(text: str) -> set[str]:
    """``"crash,torn"`` -> ``{"crash", "torn"}``; ``ValueError`` naming an unknown kind."""
    faults = {f.strip() for f in text.split(",") if f.strip()} if text else set()
    unknown = faults - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown fault kind(s): {', '.join(sorted(unknown))} (choose from {', '.join(FAULTS)})")
    return faults


def run_seed(seed: int, steps: int, faults: set[str], shrink_budget_s: float = SHRINK_BUDGET_S,
             plant: str | None = None, programs: str = "undo", driver: str = "sim") -> dict:
    """One campaign, shrunk where it fails: ``{"seed", "ops", "faults", "recoveries",
    "cpu_s"}`` plus, on a violation, ``"violation"`` (the error), ``"config"``, ``"trace"``
    (the minimal failing trace), ``"minimal_error"`` (what the minimal trace fails with) and
    ``"replay"`` (the command). Plain data: what a fan-out task returns."""
    config, actions = plan(seed, steps, faults, programs, driver)
    c0 = time.process_time()
    d, fail_at, err = execute(config, actions)
    out = {"seed": seed, "steps": steps, "faults_kinds": sorted(faults), "ops": d.ops_done if d else 0,
           "faults": d.faults_injected if d else 0, "recoveries": d.recoveries if d else 0,
           "compiled": compiled.state is not None and compiled.state[0]}
    if err is not None:
        minimal = shrink(config, actions, fail_at, shrink_budget_s)
        _, _, err2 = execute(config, minimal)
        out.update(violation=f"action {fail_at}: {type(err).__name__}: {err}", config=config, trace=minimal,
                   minimal_error=f"{type(err2).__name__}: {err2}" if err2 is not None else "no violation (flaky?)",
                   replay=replay_command(seed, config, minimal, plant))
    out["cpu_s"] = time.process_time() - c0
    return out
