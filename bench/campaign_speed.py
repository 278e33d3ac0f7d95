"""How fast the simulation campaign runs, per fault mix, optionally beside an older commit.

    .venv/bin/python bench/campaign_speed.py                      # this tree only
    .venv/bin/python bench/campaign_speed.py --baseline 4c29a21   # the same campaigns on that commit, interleaved
    .venv/bin/python bench/campaign_speed.py --quick              # fewer, shorter campaigns

What is measured: for each fault mix — ``none``; each of ``crash``, ``enospc``, ``eio``,
``torn``, ``power`` alone; ``all`` of them — fixed-seed campaigns exactly as
``python -m sandbox_sim run --seed S --steps N --faults MIX`` runs them (the same
``plan`` and ``execute``, the undo invariant checked after every action). The unit is the
runner's own: *ops* are the guest programs the campaign applies through the intercepted
filesystem (``Driver.ops_done``, what the runner prints as "ops executed"), per CPU second of
the process running them (``time.process_time``: one campaign is one thread, so this is
ops/s per core, and less disturbed than wall time by other work on the machine).

Each campaign runs in a fresh subprocess (imports and all), so a tree's module cache never
leaks into the other's numbers. With ``--baseline REF`` a detached ``git worktree`` of REF is
made under a temporary directory and every campaign is run on REF and on this tree
alternately (REF, this, REF, this …) so that noise from other processes falls on both sides;
the table shows medians over seeds and repeats and the ratio this/REF. A campaign that finds
a violation is reported as such (its number is not a speed).

Numbers on a shared machine are noisy: read the ratio, not the absolute values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULT_KINDS = ("crash", "enospc", "eio", "torn", "power")
MIXES = {"none": "", **{k: k for k in FAULT_KINDS}, "all": ",".join(FAULT_KINDS)}
WORKER_TIMEOUT_S = 900  # one campaign; past it the benchmark stops with an error

# Runs inside the tree under test (old or new): only plan() and execute() of
# sandbox_sim/__main__.py and Driver.ops_done, which every version has.
_WORKER = r"""
import json, sys, time
from sandbox_sim.__main__ import plan, execute
seed, steps, faults = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
config, actions = plan(seed, steps, {f for f in faults.split(",") if f})
w0, c0 = time.perf_counter(), time.process_time()
d, fail_at, err = execute(config, actions)
cpu, wall = time.process_time() - c0, time.perf_counter() - w0
print(json.dumps({"ops": d.ops_done if d is not None else 0, "cpu": cpu, "wall": wall,
                  "faults": d.faults_injected if d is not None else 0,
                  "error": None if err is None else f"{type(err).__name__} at action {fail_at}: {str(err)[:200]}"}))
"""


def run_one(tree: str, seed: int, steps: int, faults: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0")
    out = subprocess.run([sys.executable, "-c", _WORKER, str(seed), str(steps), faults], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    if out.returncode != 0:
        raise SystemExit(f"campaign failed to run in {tree} (seed {seed}, faults {faults!r}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_baseline(ref: str, tmp: str) -> str:
    path = os.path.join(tmp, "baseline")
    subprocess.run(["git", "-C", HERE, "worktree", "add", "--detach", "--quiet", path, ref], check=True)
    return path


def drop_baseline(path: str) -> None:
    subprocess.run(["git", "-C", HERE, "worktree", "remove", "--force", path], check=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", metavar="REF", help="also run every campaign on this commit (a temporary git worktree), interleaved")
    p.add_argument("--seeds", type=int, default=3, help="campaign seeds per mix (1..N, default 3)")
    p.add_argument("--steps", type=int, default=2000, help="actions per campaign (default 2000)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each campaign per tree (default 1)")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"which fault mixes (default all: {','.join(MIXES)})")
    p.add_argument("--quick", action="store_true", help="2 seeds of 500 actions")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = 2, 500
    mixes = [m.strip() for m in args.mixes.split(",") if m.strip()]
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        p.error(f"unknown mix(es) {unknown}; choose from {list(MIXES)}")
    with tempfile.TemporaryDirectory(prefix="campaign-speed-") as tmp:
        trees = {"this": HERE}
        if args.baseline:
            trees = {"base": make_baseline(args.baseline, tmp), "this": HERE}
        try:
            return report(trees, mixes, args)
        finally:
            if "base" in trees:
                drop_baseline(trees["base"])


def report(trees: dict[str, str], mixes: list[str], args) -> int:
    head = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"campaign speed: {args.seeds} seed(s) x {args.steps} actions x {args.repeat} repeat(s) per mix; "
          f"this tree = {HERE} (HEAD {head}{', uncommitted changes' if _dirty() else ''})"
          + (f"; baseline = {args.baseline}, runs interleaved" if "base" in trees else ""), flush=True)
    print("unit: guest programs applied (the runner's 'ops executed') per CPU second of the campaign process = ops/s per core")
    cols = list(trees)
    print(f"{'mix':8} " + " ".join(f"{c + ' ops/s':>14}" for c in cols) + ("   speed-up" if len(cols) == 2 else "") + "   ops  faults")
    failed = False
    for mix in mixes:
        rates: dict[str, list[float]] = {c: [] for c in cols}
        ops = faults = 0
        errors = []
        for seed in range(1, args.seeds + 1):
            for _ in range(args.repeat):
                for c in cols:  # interleaved: base, this, base, this …
                    r = run_one(trees[c], seed, args.steps, MIXES[mix])
                    if r["error"]:
                        errors.append(f"{c} seed {seed}: {r['error']}")
                        continue
                    rates[c].append(r["ops"] / r["cpu"])
                    if c == "this":
                        ops, faults = ops + r["ops"], faults + r["faults"]
        med = {c: statistics.median(v) if v else float("nan") for c, v in rates.items()}
        line = f"{mix:8} " + " ".join(f"{med[c]:14,.0f}" for c in cols)
        if len(cols) == 2:
            line += f"   {med['this'] / med['base']:8.2f}x"
        print(line + f"   {ops:>5}  {faults:>6}", flush=True)
        for e in errors:
            failed = True
            print(f"  VIOLATION (not a speed): {e}")
    return 1 if failed else 0


def _dirty() -> bool:
    out = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return bool(out.stdout.strip())


if __name__ == "__main__":
    sys.exit(main())
