"""Fan-out: many campaign seeds as Ray tasks (the optional ``sandbox[cluster]`` extra).

    python -m sandbox_sim fanout --seeds 0:200 --steps 500 --faults crash,torn [--address ray://head:10001]

The seeds ``A..B-1`` are cut into chunks; each chunk is one Ray task
(:func:`run_chunk`, one CPU) that runs its campaigns with :func:`sandbox_sim.campaign.run_seed`
— the same ``plan``/``execute`` as ``python -m sandbox_sim run``, so a seed gives the same
campaign here and there — and *shrinks a failure where it happens*, in the worker, so only
plain data comes back: per seed its counts and, for a violation, ``(seed, config, minimal
trace)`` with the replay command. Without ``--address`` a local Ray is started for the
command (``--num-cpus``, default this machine's CPUs up to ``FANOUT_LOCAL_CPUS_MAX``) and
stopped after it; with one, the tasks go to that cluster, whose nodes need this package
installed (``pip install 'sandbox[cluster]'`` from a checkout) — or ``--ship-code`` uploads
``sandbox`` and ``sandbox_sim`` with the job (their dependencies must be on the nodes).

Bounds: at most ``FANOUT_SEEDS_MAX`` seeds per command, ``FANOUT_CHUNK_SEEDS_MAX`` seeds per
task, ``FANOUT_IN_FLIGHT_MAX`` tasks submitted and not yet collected (more are submitted as
those finish). A task that raises (not a violation: the framework itself failed) is reported
with its seeds and counted as failed; the command then exits 3. Exit 0: no violation; 1:
at least one violation (each printed with its replay command); 2: bad arguments or no Ray.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from . import compiled

# the campaign's modules (sandbox.core, the simulated disk) are imported in the functions: a
# worker that unpickles run_chunk imports this module only, so run_chunk can still choose the
# compiled build of those modules (sandbox_sim/compiled.py) before they are imported

#: seeds one command may fan out (its results are kept in memory until printed)
FANOUT_SEEDS_MAX = 1_000_000
#: seeds one task runs at most (a task is the unit of retry and of progress)
FANOUT_CHUNK_SEEDS_MAX = 50
#: tasks submitted and not yet collected; the rest wait in this process
FANOUT_IN_FLIGHT_MAX = 256
#: CPUs a local cluster is started with at most (default: this machine's)
FANOUT_LOCAL_CPUS_MAX = 64
#: the local cluster's object store: results are small, a campaign holds nothing there
FANOUT_LOCAL_OBJECT_STORE_BYTES = 128 << 20
#: a task lost with its worker (node died) is run again this many times
FANOUT_TASK_RETRIES = 2
#: default chunking: about this many tasks per CPU, so the last ones finish together
FANOUT_TASKS_PER_CPU = 4


def parse_seeds(text: str) -> range:
    """``"A:B"`` -> ``range(A, B)``; ``ValueError`` unless 0 <= A < B and at most FANOUT_SEEDS_MAX seeds."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--seeds must be A:B (seeds A to B-1), not {text!r}") from None
    if not 0 <= a < b:
        raise ValueError(f"--seeds {text}: need 0 <= A < B")
    if b - a > FANOUT_SEEDS_MAX:
        raise ValueError(f"--seeds {text}: {b - a} seeds, at most {FANOUT_SEEDS_MAX} (FANOUT_SEEDS_MAX) per command")
    return range(a, b)


def chunks(seeds: range, cpus: int, chunk: int | None = None) -> list[list[int]]:
    """The seeds cut into tasks: ``chunk`` seeds each, or by default about
    ``FANOUT_TASKS_PER_CPU`` tasks per CPU; never more than ``FANOUT_CHUNK_SEEDS_MAX``."""
    if chunk is None:
        chunk = math.ceil(len(seeds) / (max(1, cpus) * FANOUT_TASKS_PER_CPU))
    chunk = max(1, min(chunk, FANOUT_CHUNK_SEEDS_MAX))
    return [list(seeds[i:i + chunk]) for i in range(0, len(seeds), chunk)]


def run_chunk(seeds: list[int], steps: int, faults: list[str], shrink_budget_s: float | None = None,
              plant: str | None = None, programs: str = "undo", driver: str = "sim", use_compiled: bool = True) -> list[dict]:
    """One task: the campaigns of ``seeds`` (each shrunk where it fails), as plain data. With
    ``plant``, that defect is installed for this task only (workers are reused). The worker's
    first task chooses its code: the compiled build where ``use_compiled`` (and not ``plant``)
    and one matches its sources, else the interpreted modules (each result says which)."""
    if use_compiled and not plant:
        compiled.activate()
    from .campaign import SHRINK_BUDGET_S, run_seed

    if shrink_budget_s is None:
        shrink_budget_s = SHRINK_BUDGET_S
    remove = None
    if plant:
        from .defects import plant as plant_defect

        remove = plant_defect(plant)
    try:
        return [run_seed(seed, steps, set(faults), shrink_budget_s, plant, programs, driver) for seed in seeds]
    finally:
        if remove is not None:
            remove()


def _import_ray():
    try:
        import ray
    except ImportError:
        return None
    return ray


def cmd_fanout(args) -> int:
    from .campaign import parse_faults, plan

    try:
        seeds = parse_seeds(args.seeds)
        faults = sorted(parse_faults(args.faults))
        plan(0, 0, set(faults), getattr(args, "programs", "undo"), getattr(args, "driver", "sim"))  # the combination is valid
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    ray = _import_ray()
    if ray is None:
        print("fanout needs Ray: pip install 'sandbox[cluster]' (or ./dev setup, which installs it)", file=sys.stderr)
        return 2
    started = start_or_attach(ray, args.address, args.num_cpus, getattr(args, "ship_code", False))
    try:
        return _fan_out(ray, args, seeds, faults)
    finally:
        if started:
            ray.shutdown()


def start_or_attach(ray, address: str | None, num_cpus: int | None, ship_code: bool = False,
                    resources: dict[str, float] | None = None) -> bool:
    """Connect this process to Ray: to ``address`` when given (a running cluster, left running),
    else to a local Ray started here with ``num_cpus`` (default this machine's, at most
    ``FANOUT_LOCAL_CPUS_MAX``) and the custom node ``resources`` (e.g. ``{"kvm": 1}``).
    ``ship_code`` uploads ``sandbox`` and ``sandbox_sim`` with the job. Returns whether it
    connected (the caller then calls ``ray.shutdown()``); False when Ray was already initialised.
    Also used by ``python -m sandbox_sim nightly`` (sandbox_sim/nightly.py)."""
    if ray.is_initialized():
        return False
    kwargs = {"include_dashboard": False, "log_to_driver": True}
    if ship_code:
        import sandbox

        kwargs["runtime_env"] = {"py_modules": [sandbox, sys.modules[__package__]]}  # sandbox, sandbox_sim
    if address:
        ray.init(address=address, **kwargs)
    else:
        cpus = num_cpus or min(os.cpu_count() or 1, FANOUT_LOCAL_CPUS_MAX)
        ray.init(num_cpus=max(1, min(cpus, FANOUT_LOCAL_CPUS_MAX)), object_store_memory=FANOUT_LOCAL_OBJECT_STORE_BYTES,
                 resources=dict(resources or {}), **kwargs)
    return True


def _fan_out(ray, args, seeds: range, faults: list[str]) -> int:
    cpus = int(ray.cluster_resources().get("CPU", 1))
    tasks = chunks(seeds, cpus, args.chunk)
    where = args.address or f"a local Ray with {cpus} CPU(s)"
    print(f"fanout: seeds {seeds.start}..{seeds.stop - 1} ({len(seeds)}), {args.steps} actions each, "
          f"faults={','.join(faults) or 'none'}, {len(tasks)} task(s) of <= {len(tasks[0])} seed(s) on {where}"
          + (f", PLANTED DEFECT: {args.plant}" if args.plant else ""), flush=True)
    remote = ray.remote(num_cpus=1, max_retries=FANOUT_TASK_RETRIES)(run_chunk)
    if getattr(args, "interpreted", False) or args.plant:
        # workers of their own (Ray keeps one pool per runtime_env), which never load the compiled
        # build: a worker that ran a compiled task before cannot take a planted one
        remote = remote.options(runtime_env={"env_vars": {compiled.ENV_DISABLE: "0"}})
    t0 = time.perf_counter()
    pending = list(reversed(tasks))
    in_flight: dict = {}
    results: list[dict] = []
    failed: list[tuple[list[int], str]] = []
    done_tasks, every = 0, max(1, len(tasks) // 10)
    while pending or in_flight:
        while pending and len(in_flight) < FANOUT_IN_FLIGHT_MAX:
            chunk = pending.pop()
            in_flight[remote.remote(chunk, args.steps, faults, args.shrink_budget, args.plant,
                                    getattr(args, "programs", "undo"), getattr(args, "driver", "sim"),
                                    not getattr(args, "interpreted", False))] = chunk
        ready, _ = ray.wait(list(in_flight), num_returns=1)
        for ref in ready:
            chunk = in_flight.pop(ref)
            try:
                results.extend(ray.get(ref))
            except Exception as e:  # noqa: BLE001 - a task's own failure is reported, the others go on
                failed.append((chunk, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"))
            done_tasks += 1
            if done_tasks % every == 0 or not (pending or in_flight):
                bad = sum(1 for r in results if "violation" in r)
                print(f"  {done_tasks}/{len(tasks)} tasks, {len(results)} seeds done, {bad} violation(s)", flush=True)
    wall = time.perf_counter() - t0
    results.sort(key=lambda r: r["seed"])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return report(results, failed, wall)


def report(results: list[dict], failed: list[tuple[list[int], str]], wall_s: float) -> int:
    ops = sum(r["ops"] for r in results)
    cpu = sum(r["cpu_s"] for r in results)
    violations = [r for r in results if "violation" in r]
    print(f"fanout done: {len(results)} seed(s), {ops} ops, {sum(r['faults'] for r in results)} faults injected, "
          f"{sum(r['recoveries'] for r in results)} recoveries verified, {len(violations)} violation(s); "
          f"{wall_s:.1f} s wall, {cpu:.1f} CPU s in campaigns ({ops / cpu if cpu else 0:.0f} ops/s per core)")
    if results:
        n = sum(1 for r in results if r.get("compiled"))
        print(f"code: {n} of {len(results)} seed(s) ran the compiled build"
              + ("" if n == len(results) else " (the rest interpreted: --interpreted, --plant, or no build of "
                 "these sources where they ran: python -m sandbox_sim compile)"))
    for r in violations:
        print(f"VIOLATION seed {r['seed']}: {r['violation'].splitlines()[0]}", file=sys.stderr)
        print(f"  config: {r['config']}", file=sys.stderr)
        print(f"  minimal trace ({len(r['trace'])} actions): {[tuple(a) for a in r['trace']]}", file=sys.stderr)
        print("  it fails with: " + r["minimal_error"].replace("\n", "\n    "), file=sys.stderr)
        print(f"  replay: {r['replay']}", file=sys.stderr)
    for chunk, why in failed:
        print(f"TASK FAILED for seeds {chunk}: {why}", file=sys.stderr)
    if failed:
        return 3
    return 1 if violations else 0
