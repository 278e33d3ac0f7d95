"""Host calls per guest program in fixed-seed campaigns, by disk (working folder, undo store) and kind.

    PYTHONPATH=. .venv/bin/python bench/host_calls.py                 # seeds 1-3 x 1000 actions, no faults
    PYTHONPATH=. .venv/bin/python bench/host_calls.py --faults power  # power-loss mode (its fsyncs)

Counts every call that reaches a simulated disk's entry points (``MemoryHostFS._fault``,
``_look`` and ``lstat_or_none``: what a fault injector counts, plus the harness's own looks
through the disk's API, which are few since the oracle reads inodes), divided by the
campaign's guest programs (``Driver.ops_done``). Run it on two trees to compare the core's
host-call pattern; it measures calls, not time (see ``campaign_speed.py``).
"""

from __future__ import annotations

import argparse
import collections

from sandbox.hostfs import memory
from sandbox_sim.campaign import execute, plan


def count(seeds: int, steps: int, faults: set[str]) -> tuple[int, collections.Counter]:
    counts: collections.Counter = collections.Counter()
    fault, look, lstat_or_none = memory.MemoryHostFS._fault, memory.MemoryHostFS._look, memory.MemoryHostFS.lstat_or_none

    def counted_fault(self, op, path, nbytes=0):
        counts[(self.name, op)] += 1
        return fault(self, op, path, nbytes)

    def counted_look(self, op, path):
        counts[(self.name, op)] += 1
        return look(self, op, path)

    def counted_lstat_or_none(self, path):
        counts[(self.name, "lstat")] += 1
        return lstat_or_none(self, path)

    memory.MemoryHostFS._fault, memory.MemoryHostFS._look = counted_fault, counted_look
    memory.MemoryHostFS.lstat_or_none = counted_lstat_or_none
    ops = 0
    try:
        for seed in range(1, seeds + 1):
            config, actions = plan(seed, steps, faults)
            d, at, err = execute(config, actions)
            if err is not None:
                raise SystemExit(f"seed {seed}: action {at} failed: {err!r}")
            ops += d.ops_done
    finally:
        memory.MemoryHostFS._fault, memory.MemoryHostFS._look = fault, look
        memory.MemoryHostFS.lstat_or_none = lstat_or_none
    return ops, counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--faults", default="", help="comma-separated fault kinds (default: none)")
    p.add_argument("--top", type=int, default=16, help="kinds of call listed")
    a = p.parse_args()
    ops, counts = count(a.seeds, a.steps, {f for f in a.faults.split(",") if f})
    by_disk: collections.Counter = collections.Counter()
    for (disk, _), n in counts.items():
        by_disk[disk] += n
    print(f"{ops} guest programs, seeds 1..{a.seeds} x {a.steps} actions, faults: {a.faults or 'none'}")
    print("host calls per program: " + ", ".join(f"{disk} {n / ops:.2f}" for disk, n in sorted(by_disk.items()))
          + f", all {sum(by_disk.values()) / ops:.2f}")
    for (disk, op), n in counts.most_common(a.top):
        print(f"  {disk:6s} {op:12s} {n / ops:6.2f}")


if __name__ == "__main__":
    main()
