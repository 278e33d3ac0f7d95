"""How fast the simulation campaign runs, per fault mix, optionally beside an older commit.

    .venv/bin/python bench/campaign_speed.py                      # this tree only
    .venv/bin/python bench/campaign_speed.py --baseline 4c29a21   # the same campaigns on that commit, interleaved
    .venv/bin/python bench/campaign_speed.py --quick              # fewer, shorter campaigns

With a compiled build of this tree (``python -m sandbox_sim compile``, sandbox_sim/compiled.py)
this tree is measured as campaigns run it, on that build: without ``--baseline`` the table then
sets it beside the same tree interpreted (``--interpreted``: interpreted only).

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

Numbers on a shared machine are noisy: read the ratio, not the absolute values. Where
other jobs share the cores even the CPU time of one run moves by ±20 %; ``--instructions``
then measures work instead of time: every campaign runs under ``valgrind --tool=callgrind``
(about 50× slower: use it with ``--quick`` or few seeds) and the table gives the CPU
instructions per op — those of a campaign of 0 actions (imports, the world's setup)
subtracted — which do not depend on what else runs on the machine, and the ratio
base/this. It also says whether both trees applied the same ops and injected the same
faults (they do unless the core's host calls changed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULT_KINDS = ("crash", "enospc", "eio", "torn", "power")
MIXES = {"none": "", **{k: k for k in FAULT_KINDS}, "all": ",".join(FAULT_KINDS)}
WORKER_TIMEOUT_S = 900  # one campaign; past it the benchmark stops with an error
VALGRIND_SLOWDOWN = 100  # under --instructions a campaign may take this many times longer

# Runs inside the tree under test (old or new): only plan() and execute() of
# sandbox_sim/__main__.py and Driver.ops_done, which every version has.
_WORKER = r"""
import json, sys, time
if sys.argv[4] == "1":  # this tree's compiled build (sandbox_sim/compiled.py), before anything imports the modules
    from sandbox_sim import compiled
    ok, why = compiled.activate()
    if not ok:
        raise SystemExit("the compiled build was not used: " + why)
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


def run_one(side: tuple[str, bool], seed: int, steps: int, faults: str, instructions: bool = False) -> dict:
    """One campaign in a fresh process on ``side`` (a tree, and whether on its compiled build);
    with ``instructions`` under callgrind, the result then also has ``instr``: the instructions
    the whole process executed."""
    tree, use_compiled = side
    env = dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0")
    cmd = [sys.executable, "-c", _WORKER, str(seed), str(steps), faults, "1" if use_compiled else "0"]
    if instructions:
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"] + cmd
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                         timeout=WORKER_TIMEOUT_S * (VALGRIND_SLOWDOWN if instructions else 1))
    if out.returncode != 0:
        raise SystemExit(f"campaign failed to run in {tree} (seed {seed}, faults {faults!r}):\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if instructions:
        m = re.search(r"Collected\s*:\s*(\d+)", out.stderr)
        if m is None:
            raise SystemExit(f"no instruction count from valgrind:\n{out.stderr[-2000:]}")
        r["instr"] = int(m.group(1))
    return r


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
    p.add_argument("--instructions", action="store_true",
                   help="count CPU instructions per op under valgrind instead of timing (immune to other jobs; ~50x slower)")
    p.add_argument("--interpreted", action="store_true",
                   help="this tree interpreted only, even where its compiled build exists (python -m sandbox_sim compile)")
    args = p.parse_args(argv)
    if args.instructions and shutil.which("valgrind") is None:
        p.error("--instructions needs valgrind on PATH")
    if args.quick:
        args.seeds, args.steps = 2, 500
    mixes = [m.strip() for m in args.mixes.split(",") if m.strip()]
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        p.error(f"unknown mix(es) {unknown}; choose from {list(MIXES)}")
    sys.path.insert(0, HERE)
    from sandbox_sim import compiled

    built = not args.interpreted and compiled.built() is not None
    if not built and not args.interpreted:
        print("(no compiled build of this tree: python -m sandbox_sim compile; measuring it interpreted)", flush=True)
    with tempfile.TemporaryDirectory(prefix="campaign-speed-") as tmp:
        # side name -> (tree, on its compiled build); the last side is this tree as campaigns run it
        if args.baseline:
            trees = {"base": (make_baseline(args.baseline, tmp), False), "this": (HERE, built)}
        elif built:
            trees = {"interp": (HERE, False), "compiled": (HERE, True)}
        else:
            trees = {"this": (HERE, False)}
        try:
            return (report_instructions if args.instructions else report)(trees, mixes, args)
        finally:
            if "base" in trees:
                drop_baseline(trees["base"][0])


def _sides(trees: dict) -> str:
    return "; ".join(f"{name} = {'compiled build' if c else 'interpreted'}" for name, (_, c) in trees.items())


def _this_tree() -> str:
    """How the reports name the tree under test: its folder, HEAD and whether it has changes."""
    head = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return f"this tree = {HERE} (HEAD {head}{', uncommitted changes' if _dirty() else ''})"


def report(trees: dict[str, str], mixes: list[str], args) -> int:
    print(f"campaign speed: {args.seeds} seed(s) x {args.steps} actions x {args.repeat} repeat(s) per mix; "
          f"{_this_tree()}"
          + (f"; baseline = {args.baseline}" if "base" in trees else "") + f"; {_sides(trees)}"
          + ("; runs interleaved" if len(trees) == 2 else ""), flush=True)
    print("unit: guest programs applied (the runner's 'ops executed') per CPU second of the campaign process = ops/s per core")
    cols = list(trees)
    first, last = cols[0], cols[-1]
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
                    if c == last:
                        ops, faults = ops + r["ops"], faults + r["faults"]
        med = {c: statistics.median(v) if v else float("nan") for c, v in rates.items()}
        line = f"{mix:8} " + " ".join(f"{med[c]:14,.0f}" for c in cols)
        if len(cols) == 2:
            line += f"   {med[last] / med[first]:8.2f}x"
        print(line + f"   {ops:>5}  {faults:>6}", flush=True)
        for e in errors:
            failed = True
            print(f"  VIOLATION (not a speed): {e}")
    return 1 if failed else 0


def report_instructions(trees: dict[str, str], mixes: list[str], args) -> int:
    print(f"campaign work: {args.seeds} seed(s) x {args.steps} actions per mix, under callgrind; "
          f"{_this_tree()}"
          + (f"; baseline = {args.baseline}" if "base" in trees else "") + f"; {_sides(trees)}", flush=True)
    print("unit: CPU instructions per guest program applied (thousands), a campaign of 0 actions subtracted")
    cols = list(trees)
    first, last = cols[0], cols[-1]
    setup = {c: run_one(trees[c], 1, 0, "", instructions=True)["instr"] for c in cols}
    print(f"{'mix':8} " + " ".join(f"{c + ' kinstr/op':>16}" for c in cols)
          + (f"   {first}/{last}  same work" if len(cols) == 2 else "") + "   ops  faults")
    failed = False
    for mix in mixes:
        instr = {c: 0 for c in cols}
        work = {c: [] for c in cols}
        errors = []
        for seed in range(1, args.seeds + 1):
            for c in cols:
                r = run_one(trees[c], seed, args.steps, MIXES[mix], instructions=True)
                if r["error"]:
                    errors.append(f"{c} seed {seed}: {r['error']}")
                    continue
                instr[c] += r["instr"] - setup[c]
                work[c].append((r["ops"], r["faults"]))
        per = {c: instr[c] / max(1, sum(o for o, _ in work[c])) / 1000 for c in cols}
        line = f"{mix:8} " + " ".join(f"{per[c]:16,.0f}" for c in cols)
        if len(cols) == 2:
            line += f"   {per[first] / per[last]:8.2f}x  {'yes' if work[first] == work[last] else 'NO':>9}"
        ops, faults = sum(o for o, _ in work[last]), sum(f for _, f in work[last])
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
