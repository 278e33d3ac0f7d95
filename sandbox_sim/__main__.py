"""Campaign runner for research: long random runs of the undo model, outside pytest.

    python -m sandbox_sim run --seed 7 --steps 2000 --faults crash,enospc,eio,torn

Each campaign step is one action of ``sandbox_sim/driver.py`` (a step of random guest programs,
an ambient burst, a rollback, a reopen, or the same with a fault), chosen from the seed
alone, so a seed replays exactly. After every action the undo invariant is checked. On
a violation the runner shrinks the trace (shortest failing prefix, then drops actions
one at a time), prints the seed and the minimal trace as replayable tuples, and exits 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback

if __name__ == "__main__":  # first, before the campaign's modules are imported (sandbox_sim/compiled.py)
    from sandbox_sim import compiled as _compiled

    _compiled.activate_for(sys.argv[1:])

from .campaign import DRIVER_NAMES, FAULTS, execute, parse_faults, plan, replay_command, shrink
from .client import PROGRAM_SETS

__all__ = ["FAULTS", "execute", "plan", "shrink", "main"]


def _planted(args):
    """Install ``--plant``'s defect for this command (a no-op without it); returns its removal."""
    if not getattr(args, "plant", None):
        return lambda: None
    from . import defects

    return defects.plant(args.plant)


def cmd_run(args) -> int:
    try:
        faults = parse_faults(args.faults)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        config, actions = plan(args.seed, args.steps, faults, args.programs, args.driver)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"campaign seed={args.seed} steps={args.steps} faults={','.join(sorted(faults)) or 'none'} "
          + (f"programs={args.programs} " if args.programs != "undo" else "")
          + (f"driver={args.driver} " if args.driver != "sim" else "")
          + f"limits: max_step_count={config['max_step_count']} tight={config['tight']} durable={config['durable']}"
          + (f" PLANTED DEFECT: {args.plant}" if args.plant else ""), flush=True)
    print(code_line(), flush=True)
    t0 = time.perf_counter()
    every = max(1, args.steps // 10)

    def progress(i, d):
        if (i + 1) % every == 0 and not args.quiet:
            print(f"  {i + 1}/{args.steps} actions: {d.ops_done} ops, {d.faults_injected} faults, "
                  f"{d.recoveries} recoveries, history {d.history_len()}", flush=True)

    d, fail_at, err = execute(config, actions, progress)
    elapsed = time.perf_counter() - t0
    if err is None:
        print(f"ok: {args.steps} actions, {d.ops_done} ops executed, {d.faults_injected} faults injected, "
              f"{d.recoveries} recoveries verified, {d.ops_done / elapsed:.0f} ops/s ({elapsed:.1f} s)")
        return 0
    print(f"VIOLATION at action {fail_at} of seed {args.seed}: {type(err).__name__}: {err}", file=sys.stderr)
    if args.verbose:
        traceback.print_exception(err)
    print("shrinking the trace…", file=sys.stderr, flush=True)
    minimal = shrink(config, actions, fail_at)
    print(f"minimal trace ({len(minimal)} actions):", file=sys.stderr)
    for a in minimal:
        print(f"  {a}", file=sys.stderr)
    _, i, err2 = execute(config, minimal)
    print(f"it fails with: {type(err2).__name__}: {err2}", file=sys.stderr)
    print(f"replay: {replay_command(args.seed, config, minimal, args.plant)}", file=sys.stderr)
    return 1


def cmd_replay(args) -> int:
    import ast

    config = ast.literal_eval(args.config)
    actions = ast.literal_eval(args.trace)
    _, i, err = execute(config, actions)
    if err is None:
        print("replay: no violation")
        return 0
    print(f"replay: violation at action {i}: {type(err).__name__}: {err}", file=sys.stderr)
    traceback.print_exception(err)
    return 1


def cmd_compile(args) -> int:
    from . import compiled

    try:
        compiled.build()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"compile: {e}", file=sys.stderr)
        return 1
    return 0


def code_line() -> str:
    """Which code this process's campaigns run: compiled, or interpreted and why."""
    from . import compiled

    if compiled.state is None:
        return "code: interpreted"
    return f"code: {compiled.state[1]}"


def cmd_fanout(args) -> int:
    from . import fanout

    return fanout.cmd_fanout(args)


def cmd_nightly(args) -> int:
    from . import nightly

    return nightly.cmd_nightly(args)


def main(argv: list[str] | None = None) -> int:
    from .defects import DEFECTS
    from .nightly import NIGHTLY_SHARD_TIMEOUT_S, NIGHTLY_SHARDS_DEFAULT

    p = argparse.ArgumentParser(prog="python -m sandbox_sim", description="Simulation campaigns against the undo core: random "
                                "guest programs, rollbacks and injected faults on a simulated disk, with the undo "
                                "invariant checked after every action.")
    sub = p.add_subparsers(dest="cmd", required=True)
    programs_help = ("the guest programs steps draw from: undo (default: the undo model's) or handles (also "
                     "writes, truncates, chmods, fallocates and copy_file_range through open descriptors, after "
                     "the file was renamed or lost a name)")
    driver_help = ("where the programs run: sim (default: the simulated disk, in process), wire (over 9P2000.L "
                   "to our server on a unix socket), fuse or fuse-noopen (real system calls on a real FUSE mount "
                   "of a temporary folder; root and /dev/fuse). The servers' drivers take the fault kinds "
                   "enospc,eio only")
    interpreted_help = ("run the interpreted modules even where a compiled build of this tree exists (python -m "
                        "sandbox_sim compile; --plant implies it)")
    plant_help = f"plant a defect first, to check the campaign catches it: {', '.join(DEFECTS)} (sandbox_sim/defects.py)"
    r = sub.add_parser("run", help="run a campaign (deterministic for a seed)")
    r.add_argument("--seed", type=int, default=0, help="campaign seed (default 0)")
    r.add_argument("--steps", type=int, default=500, help="number of actions (default 500)")
    r.add_argument("--faults", default="", help=f"comma-separated fault kinds to inject: {','.join(FAULTS)}")
    r.add_argument("--quiet", action="store_true", help="no progress lines")
    r.add_argument("-v", "--verbose", action="store_true", help="print the violation's traceback")
    r.add_argument("--plant", metavar="DEFECT", help=plant_help)
    r.add_argument("--programs", choices=sorted(PROGRAM_SETS), default="undo", help=programs_help)
    r.add_argument("--driver", choices=DRIVER_NAMES, default="sim", help=driver_help)
    r.add_argument("--interpreted", action="store_true", help=interpreted_help)
    r.set_defaults(fn=cmd_run)
    rp = sub.add_parser("replay", help="replay a trace printed by a failing run")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--config", required=True)
    rp.add_argument("--trace", required=True)
    rp.add_argument("--plant", metavar="DEFECT", help=plant_help)
    rp.add_argument("--interpreted", action="store_true", help=interpreted_help)
    rp.set_defaults(fn=cmd_replay)
    f = sub.add_parser("fanout", help="run many seeds as Ray tasks (the sandbox[cluster] extra); shrink failures where they happen")
    f.add_argument("--seeds", required=True, metavar="A:B", help="seeds A to B-1 (Python range)")
    f.add_argument("--steps", type=int, default=500, help="actions per campaign (default 500)")
    f.add_argument("--faults", default="", help=f"comma-separated fault kinds to inject: {','.join(FAULTS)}")
    f.add_argument("--address", help="a running Ray cluster (e.g. ray://head:10001 or auto); default: start a local one")
    f.add_argument("--num-cpus", type=int, help="CPUs of the local cluster (default: this machine's, at most FANOUT_LOCAL_CPUS_MAX)")
    f.add_argument("--chunk", type=int, help="seeds per task (default: about 4 tasks per CPU, at most FANOUT_CHUNK_SEEDS_MAX)")
    f.add_argument("--shrink-budget", type=float, default=120.0, help="seconds a task may spend shrinking one failure (default 120)")
    f.add_argument("--json", metavar="PATH", help="also write every seed's result as JSON lines here")
    f.add_argument("--ship-code", action="store_true", help="upload sandbox and sandbox_sim with the job (a cluster whose nodes lack them)")
    f.add_argument("--plant", metavar="DEFECT", help=plant_help + "; planted in every worker")
    f.add_argument("--programs", choices=sorted(PROGRAM_SETS), default="undo", help=programs_help)
    f.add_argument("--driver", choices=DRIVER_NAMES, default="sim", help=driver_help)
    f.add_argument("--interpreted", action="store_true", help=interpreted_help)
    f.set_defaults(fn=cmd_fanout)
    c = sub.add_parser("compile", help="compile the campaign's hot modules with mypyc (needs mypy and a C compiler; "
                       "./dev setup does it); run, replay and fanout then use that build while the sources match it")
    c.set_defaults(fn=cmd_compile)
    n = sub.add_parser("nightly", help="shard pytest -m e2e over Ray nodes (kvm resource where the KVM probe finds it); "
                       "JUnit XML per shard and a summary in --out")
    n.add_argument("paths", nargs="*", help="test paths to collect from (default: e2e)")
    n.add_argument("--out", metavar="DIR", help="an absent or empty directory for shard-NN.xml, shard-NN.log, summary.json")
    n.add_argument("--shards", type=int, default=NIGHTLY_SHARDS_DEFAULT, help=f"number of shards, files kept whole (default {NIGHTLY_SHARDS_DEFAULT}, at most NIGHTLY_SHARDS_MAX)")
    n.add_argument("--timeout", type=float, default=NIGHTLY_SHARD_TIMEOUT_S, help="hard timeout per shard in seconds: its process "
                   f"group is killed and the shard reported as timeout (default {NIGHTLY_SHARD_TIMEOUT_S:g}, at most NIGHTLY_SHARD_TIMEOUT_MAX_S)")
    n.add_argument("--marker", default="e2e", help="the pytest marker expression to collect (default e2e)")
    n.add_argument("--cwd", default=".", help="where pytest collects and runs (the checkout; same path on every node)")
    n.add_argument("--pytest-arg", action="append", metavar="ARG", help="an extra pytest argument for collection and "
                   "every shard (repeatable), e.g. --pytest-arg=-x")
    n.add_argument("--env", action="append", metavar="NAME=VALUE", help="set in every shard's environment (repeatable), "
                   "e.g. --env SANDBOX_TEST_FULL=1 for the slow tests")
    n.add_argument("--address", help="a running Ray cluster; default: start a local one (kvm resource from the probe)")
    n.add_argument("--num-cpus", type=int, help="CPUs of the local cluster (default: this machine's)")
    n.add_argument("--require-kvm", action="store_true", help="refuse to run (exit 2) unless a node advertises kvm")
    n.add_argument("--weights-from", metavar="DIR", help="balance the shards by each file's seconds in an earlier "
                   "run's --out DIR (its summary.json) instead of by test count")
    n.add_argument("--plan", action="store_true", help="only collect and print the shards (no Ray, nothing run)")
    n.add_argument("--ship-code", action="store_true", help="upload sandbox and sandbox_sim with the job")
    n.add_argument("--node-resources", action="store_true", help="only print this host's Ray resources from the KVM "
                   "probe as JSON, for: ray start --resources \"$(python -m sandbox_sim nightly --node-resources)\"")
    n.set_defaults(fn=cmd_nightly)
    args = p.parse_args(argv)
    if getattr(args, "steps", 1) < 1:
        p.error("--steps must be at least 1")
    if getattr(args, "plant", None) and args.plant not in DEFECTS:
        print(f"unknown defect {args.plant!r}; choose from {', '.join(DEFECTS)}", file=sys.stderr)
        return 2
    if args.cmd in ("fanout", "nightly"):
        return args.fn(args)  # the workers plant it themselves
    remove = _planted(args)
    try:
        return args.fn(args)
    finally:
        remove()


if __name__ == "__main__":
    sys.exit(main())
