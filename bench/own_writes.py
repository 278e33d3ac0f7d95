#!/usr/bin/env python3
"""The own-write journal's own CPU per host call: ``RecordingHostFS`` (the journal a watched
workspace writes through, ``sandbox/barriers/journal.py``) minus the bare ``RealHostFS`` it
wraps, on a temporary folder on a real disk.

Per round, 2,000 files in one directory: an exclusive create (``create_handle``), a
``pwrite`` and a ``futimens`` through the handle, a ``write_all`` by path, an open read-write +
close, a rename, an unlink; and 500 directories' ``mkdir`` and ``rmdir`` (rmdir timed). Each
call's CPU µs (process time) with and without the journal, and their difference; medians of
``--rounds`` rounds, alternating which side goes first. With ``--other TREE`` each side is a
child process per tree (``PYTHONPATH``), alternating, and the journal's µs are printed side by
side with their ratio. The exclusive create's time is the disk's (hundreds of µs here) and
swings more than the journal's part: read its difference with care. Nothing is asserted.

    .venv/bin/python bench/own_writes.py [--files 2000] [--rounds 5] [--runs 3] [--other ../wt-base]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def one_round(wrap: bool, files: int, where: str | None) -> dict[str, float]:
    from sandbox.barriers.journal import RecordingHostFS
    from sandbox.hostfs.real import RealHostFS

    base = tempfile.mkdtemp(prefix="own-writes-", dir=where)
    try:
        inner = RealHostFS(base)
        fs = RecordingHostFS(inner) if wrap else inner
        fs.mkdir("d", 0o755)
        names = [f"d/f{i:05d}" for i in range(files)]
        out: dict[str, float] = {}

        def timed(label: str, fn, items) -> None:
            c = time.process_time()
            for x in items:
                fn(x)
            out[label] = (time.process_time() - c) / len(items) * 1e6

        handles = []
        timed("create_handle", lambda p: handles.append(fs.create_handle(p, 0o644, os.O_RDWR)), names)
        timed("pwrite through a handle", lambda h: h.pwrite(b"x" * 1024, 0), handles)
        timed("futimens through a handle", lambda h: h.utime(12345, 12345), handles)
        for h in handles:
            h.close()
        timed("write_all by path", lambda p: fs.write_all(p, 0, b"y" * 100), names)
        timed("open read-write + close", lambda p: fs.open(p, os.O_RDWR).close(), names)
        timed("rename", lambda p: fs.rename(p, p + "r"), names)
        timed("unlink", lambda p: fs.unlink(p + "r"), names)
        dirs = [f"d/g{i:05d}" for i in range(min(500, files))]
        for p in dirs:
            fs.mkdir(p, 0o755)
        timed("rmdir", fs.rmdir, dirs)
        fs.close()
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(files: int, rounds: int, where: str | None) -> dict[str, float]:
    """The journal's µs per call: median over rounds of (recorded − bare)."""
    diffs: dict[str, list[float]] = {}
    for i in range(rounds):
        sides = {}
        for wrap in ((False, True) if i % 2 == 0 else (True, False)):
            sides[wrap] = one_round(wrap, files, where)
        for k in sides[True]:
            diffs.setdefault(k, []).append(sides[True][k] - sides[False][k])
    return {k: statistics.median(v) for k, v in diffs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5, help="rounds per run (medians)")
    ap.add_argument("--runs", type=int, default=3, help="with --other: child runs per tree (medians)")
    ap.add_argument("--other", help="another checkout to run side by side (its PYTHONPATH)")
    ap.add_argument("--dir", help="where to make the temporary folders (a real disk)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json or not args.other:
        res = run(args.files, args.rounds, args.dir)
        if args.json:
            print(json.dumps(res))
            return
        print(f"{args.files} files, medians of {args.rounds} rounds, load average {os.getloadavg()[0]:.2f}")
        print(f"{'call':28} {'journal CPU µs':>15}")
        for k, v in res.items():
            print(f"{k:28} {v:15.1f}")
        return
    trees = {"this": os.environ.get("PYTHONPATH") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             "other": os.path.abspath(args.other)}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    cmd = [sys.executable, os.path.abspath(__file__), "--json", "--files", str(args.files), "--rounds", str(args.rounds)]
    if args.dir:
        cmd += ["--dir", args.dir]
    for i in range(args.runs):
        for k in (list(trees) if i % 2 == 0 else list(reversed(trees))):
            r = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=trees[k]), capture_output=True, text=True,
                               timeout=1800)
            if r.returncode:
                raise SystemExit(f"{trees[k]}: {r.stderr}")
            runs[k].append(json.loads(r.stdout))
    print(f"{args.files} files, {args.rounds} rounds a run, {args.runs} runs a tree, load average "
          f"{os.getloadavg()[0]:.2f}; the journal's CPU µs per call; other = {args.other}")
    print(f"{'call':28} {'this':>8} {'other':>8} {'ratio':>6}")
    for k in runs["this"][0]:
        a = statistics.median(r[k] for r in runs["this"])
        b = statistics.median(r[k] for r in runs["other"])
        print(f"{k:28} {a:8.1f} {b:8.1f} {a / b if b > 0 else float('nan'):6.2f}")


if __name__ == "__main__":
    main()
