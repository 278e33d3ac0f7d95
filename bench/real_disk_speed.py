"""A no-fault campaign's actions on a real directory, beside another tree: what the core's host
calls cost where they are system calls.

    PYTHONPATH=. .venv/bin/python bench/real_disk_speed.py --baseline /path/to/other/tree
    PYTHONPATH=. .venv/bin/python bench/real_disk_speed.py --baseline /path/to/other/tree --durable

The actions of ``plan(seed, steps)`` (no faults) run through ``Driver`` on a ``World("real")``
in a temporary directory under ``--dir`` (default ``/var/tmp``); the undo invariant is not
checked (that is the simulated campaign's job: ``campaign_speed.py``), so this times the
folder's operations, their undo and the store's I/O. ``--durable`` is power-loss mode (an
fsync after each journal write, WAL order). Each run is a fresh subprocess, alternating
between the trees; the table gives medians of ops per wall second (system calls and fsyncs
wait on the disk, which CPU time would not show) and per CPU second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TIMEOUT_S = 900  # one run; past it the benchmark stops with an error

_WORKER = r"""
import json, os, sys, tempfile, time
from sandbox_sim.campaign import plan, _limits
from sandbox_sim.driver import Driver
from sandbox_sim.world import World
seed, steps, durable, where = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
config, actions = plan(seed, steps, set())
with tempfile.TemporaryDirectory(dir=where) as d:
    w = World("real", d)
    w.work.sync_all = os.sync  # the driver's "initial tree on the disk" (a simulated disk's call)
    drv = Driver(w, seed, _limits(config), durable=durable)
    c0, w0 = time.process_time(), time.perf_counter()
    for a in actions:
        drv.run(a)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
print(json.dumps({"ops": drv.ops_done, "cpu": cpu, "wall": wall}))
"""


def run(tree: str, seed: int, steps: int, durable: bool, where: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", _WORKER, str(seed), str(steps), "1" if durable else "0", where],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if out.returncode != 0:
        raise SystemExit(f"run failed on {tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, metavar="TREE", help="another checkout (e.g. a git worktree of main)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--durable", action="store_true", help="power-loss mode (fsyncs)")
    p.add_argument("--dir", default="/var/tmp", help="where the temporary folders go (a real disk)")
    a = p.parse_args()
    trees = {"base": os.path.abspath(a.baseline), "this": HERE}
    wall: dict[str, list[float]] = {"base": [], "this": []}
    cpu: dict[str, list[float]] = {"base": [], "this": []}
    ops: dict[str, set[int]] = {"base": set(), "this": set()}
    for seed in range(1, a.seeds + 1):
        for _ in range(a.repeat):
            for name, tree in trees.items():
                r = run(tree, seed, a.steps, a.durable, a.dir)
                wall[name].append(r["ops"] / r["wall"])
                cpu[name].append(r["ops"] / r["cpu"])
                ops[name].add((seed, r["ops"]))
    print(f"real disk ({a.dir}), {a.seeds} seed(s) x {a.steps} actions x {a.repeat} repeat(s), no faults, "
          f"{'durable (power-loss mode)' if a.durable else 'not durable'}; base = {trees['base']}")
    print(f"{'':6s} {'ops/s wall':>11s} {'ops/s CPU':>10s}")
    for name in trees:
        print(f"{name:6s} {statistics.median(wall[name]):11,.0f} {statistics.median(cpu[name]):10,.0f}")
    print(f"speed-up (wall) {statistics.median(wall['this']) / statistics.median(wall['base']):.2f}x, "
          f"(CPU) {statistics.median(cpu['this']) / statistics.median(cpu['base']):.2f}x; "
          f"same ops: {'yes' if ops['base'] == ops['this'] else 'NO'}")


if __name__ == "__main__":
    main()
