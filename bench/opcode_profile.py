"""Python bytecodes per guest program in a fixed-seed campaign, by file and by function.

    PYTHONPATH=. .venv/bin/python bench/opcode_profile.py                  # seed 1, 500 actions, no faults
    PYTHONPATH=. .venv/bin/python bench/opcode_profile.py --faults power --top 60

A deterministic profile for choosing what to make cheaper: every bytecode the interpreter
runs in the campaign (a ``sys.settrace`` opcode event, charged to the function it runs in)
and every call of each function, divided by the campaign's guest programs
(``Driver.ops_done``). Unlike cProfile's times, which charge each call its profiler's own
overhead and so overweight small functions many times over, and unlike sampled times, it does
not move with other jobs. It does not see work done inside C (JSON encoding, blake2b, zstd,
``marshal``, dict and str methods): ``campaign_speed.py --instructions`` measures the
whole, and decides. About 100 times slower than the campaign itself.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

from sandbox_sim.campaign import execute, plan

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def profile(seed: int, steps: int, faults: set[str]) -> tuple[int, collections.Counter, collections.Counter]:
    """(guest programs, bytecodes by function, calls by function) of one campaign."""
    opcodes: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def where(code) -> tuple[str, str, int]:
        return code.co_filename.removeprefix(_ROOT), code.co_qualname, code.co_firstlineno

    def trace(frame, event, arg):
        if event == "opcode":
            opcodes[where(frame.f_code)] += 1
        elif event == "call":
            frame.f_trace_opcodes = True
            calls[where(frame.f_code)] += 1
        return trace

    config, actions = plan(seed, steps, faults)
    sys.settrace(trace)
    try:
        d, at, err = execute(config, actions)
    finally:
        sys.settrace(None)
    if err is not None:
        raise SystemExit(f"seed {seed}: action {at} failed: {err!r}")
    return d.ops_done, opcodes, calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--faults", default="", help="comma-separated fault kinds (default: none)")
    p.add_argument("--top", type=int, default=40, help="functions listed")
    a = p.parse_args()
    ops, opcodes, calls = profile(a.seed, a.steps, {f for f in a.faults.split(",") if f})
    total = sum(opcodes.values())
    print(f"seed {a.seed}, {a.steps} actions, faults {a.faults or 'none'}: {ops} guest programs, "
          f"{total / ops:,.0f} bytecodes and {sum(calls.values()) / ops:,.0f} Python calls per program")
    by_file: collections.Counter = collections.Counter()
    for (path, _, _), n in opcodes.items():
        by_file[path] += n
    print("\nshare  bytecodes/program  file")
    for path, n in by_file.most_common(20):
        print(f"{100 * n / total:5.1f}% {n / ops:10,.0f}  {path}")
    print("\nshare  bytecodes/program  calls/program  function")
    for key, n in opcodes.most_common(a.top):
        path, name, line = key
        print(f"{100 * n / total:5.2f}% {n / ops:10,.0f} {calls[key] / ops:12.2f}  {path}:{line} {name}")


if __name__ == "__main__":
    main()
