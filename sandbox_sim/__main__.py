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
import sys
import time
import traceback

from .campaign import FAULTS, execute, plan, shrink

__all__ = ["FAULTS", "execute", "plan", "shrink", "main"]


def cmd_run(args) -> int:
    faults = {f.strip() for f in args.faults.split(",") if f.strip()} if args.faults else set()
    unknown = faults - set(FAULTS)
    if unknown:
        print(f"unknown fault kind(s): {', '.join(sorted(unknown))} (choose from {', '.join(FAULTS)})", file=sys.stderr)
        return 2
    config, actions = plan(args.seed, args.steps, faults)
    print(f"campaign seed={args.seed} steps={args.steps} faults={','.join(sorted(faults)) or 'none'} "
          f"limits: max_step_count={config['max_step_count']} tight={config['tight']} durable={config['durable']}", flush=True)
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
    print(f"minimal trace ({len(minimal)} actions; replay: python -m sandbox_sim replay --seed {args.seed} "
          f"--config '{config}' --trace \"{minimal}\"):", file=sys.stderr)
    for a in minimal:
        print(f"  {a}", file=sys.stderr)
    _, i, err2 = execute(config, minimal)
    print(f"it fails with: {type(err2).__name__}: {err2}", file=sys.stderr)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sandbox_sim", description="Simulation campaigns against the undo core: random "
                                "guest programs, rollbacks and injected faults on a simulated disk, with the undo "
                                "invariant checked after every action.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a campaign (deterministic for a seed)")
    r.add_argument("--seed", type=int, default=0, help="campaign seed (default 0)")
    r.add_argument("--steps", type=int, default=500, help="number of actions (default 500)")
    r.add_argument("--faults", default="", help=f"comma-separated fault kinds to inject: {','.join(FAULTS)}")
    r.add_argument("--quiet", action="store_true", help="no progress lines")
    r.add_argument("-v", "--verbose", action="store_true", help="print the violation's traceback")
    r.set_defaults(fn=cmd_run)
    rp = sub.add_parser("replay", help="replay a trace printed by a failing run")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--config", required=True)
    rp.add_argument("--trace", required=True)
    rp.set_defaults(fn=cmd_replay)
    args = p.parse_args(argv)
    if getattr(args, "steps", 1) < 1:
        p.error("--steps must be at least 1")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
