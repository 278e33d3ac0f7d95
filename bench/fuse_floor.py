#!/usr/bin/env python3
"""Benchmark: the FUSE round-trip floor — a C server answering from memory — beside `sandbox mount`
and the plain directory.

Run ``python bench/fuse_floor.py --help``. Prints medians, ratios and request counts; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuse_local import MOUNT_TIMEOUT_S, Mounted, _timed, small_file_phases  # noqa: E402  (bench/fuse_local.py, beside this)

DESCRIPTION = """\
What do the metadata-heavy phases of bench/fuse_local.py cost through FUSE on this machine when
the server costs (almost) nothing? Three sides, interleaved round by round in a rotated order,
in fresh folders on the same disk; each phase's median over --repeat rounds:

  floor        bench/fuse_floor.c (compiled here with gcc): a single-threaded loop over the raw
               /dev/fuse protocol, no libfuse, an in-memory tree; mounted with mount(2) with the
               options `sandbox mount` uses; the same INIT flags, no-open mode (OPEN and FLUSH
               answered ENOSYS once), FOPEN_NOFLUSH|KEEP_CACHE on CREATE, 60 s entry and attribute
               timeouts, negative entries, GETXATTR answered ENODATA: the kernel sends it the
               same requests it sends ours
  intercepted  `sandbox mount --workdir DIR MNT` (every change through the undo core)
  plain        DIR itself, no FUSE

Phases (as bench/fuse_local.py's, time.perf_counter): create (--files 1 KiB files in 20
directories: open, write, close), stat, read (open, read, close), rm -rf. git and the big
sequential phases need a real disk behind the floor: not run here (bench/fuse_local.py has them).
After the times: the requests each phase made on the two FUSE sides (last round), and each
server's CPU per phase (/proc/PID/task/*/schedstat).

--pin: where the scheduler may run them. none (default): anywhere; same: this script (the
workload and its `rm`) and every thread of the server on CPU 0; split: the workload on CPU 0,
the server on CPU 1. A round trip that wakes a server sleeping on the other CPU of a VM costs
a cross-CPU wakeup (an IPI to an idle virtual CPU): --pin shows what that costs here.
"""

SIDES = ("floor", "intercepted", "plain")
PHASES = ("create", "stat", "read", "rm -rf")
PINS = {"none": None, "same": ({0}, {0}), "split": ({0}, {1})}  # (workload CPUs, server CPUs)
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuse_floor.c")


class Floor:
    """The compiled ``fuse_floor`` serving ``point`` (it mounts itself; stopped by unmounting)."""

    def __init__(self, binary: str, point: str):
        self.point = point
        self.proc = subprocess.Popen([binary, point], stdout=subprocess.PIPE, text=True)
        if self._line() != "mounted":
            self.proc.kill()
            raise SystemExit("fuse_floor did not come up")

    def _line(self) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], MOUNT_TIMEOUT_S)
        return self.proc.stdout.readline().strip() if ready else ""

    def op_counts(self) -> dict:
        """Requests read so far, by opcode (its SIGUSR1 handler writes one line at once)."""
        self.proc.send_signal(signal.SIGUSR1)
        return {k: int(v) for k, v in (kv.split("=") for kv in self._line().split())}

    cpu_s = Mounted.cpu_s

    def stop(self) -> None:
        subprocess.run(["umount", self.point], check=False, capture_output=True)
        self.proc.wait(MOUNT_TIMEOUT_S)
        self.proc.stdout.close()


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def workload(root: str, files: int, mounted=None) -> tuple[dict, dict, dict]:
    """Each phase's seconds, requests (by opcode) and server CPU seconds (the last two: FUSE sides)."""
    phases = small_file_phases(root, files)

    times, ops, cpu = {}, {}, {}
    for name in PHASES:
        fn = phases[name]
        if mounted:
            before, cpu0 = mounted.op_counts(), mounted.cpu_s()
        times[name] = _timed(fn)
        if mounted:
            cpu[name] = mounted.cpu_s() - cpu0
            after = mounted.op_counts()
            ops[name] = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    return times, ops, cpu


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (the floor server mounts with mount(2))"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if not shutil.which("gcc"):
        return "gcc is missing (./dev setup installs it)"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pin", choices=PINS, default="none", help="CPU placement (above)")
    ap.add_argument("--dir", help="where the folders go (a real disk, not tmpfs; default: the system temp dir)")
    args = ap.parse_args(argv)
    why = unavailable() or (args.pin != "none" and os.cpu_count() < 2 and "--pin needs 2 CPUs")
    if why:
        print(f"skipped: {why}", file=sys.stderr)
        return 0
    base = tempfile.mkdtemp(prefix="fuse-floor-", dir=args.dir)
    binary = os.path.join(base, "fuse_floor")
    subprocess.run(["gcc", "-O2", "-Wall", "-o", binary, SOURCE], check=True)
    results = {s: [] for s in SIDES}
    ops, cpu = {}, {s: [] for s in SIDES if s != "plain"}
    placement = PINS[args.pin]
    if placement:
        pin(os.getpid(), placement[0])
    print(f"{args.files} files, {args.repeat} rounds, --pin {args.pin}, in {base}", flush=True)
    try:
        for r in range(args.repeat):
            for side in SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]:
                d = os.path.join(base, f"{side}-{r}")
                work, point, state = d + "/work", d + "/mnt", d + "/state"
                for x in (work, point, state):
                    os.makedirs(x)
                mounted = (None if side == "plain" else Floor(binary, point) if side == "floor"
                           else Mounted(work, point, state, False, os.path.join(d, "counts.jsonl")))
                if mounted and placement:
                    pin(mounted.proc.pid, placement[1])
                try:
                    times, ops[side], used = workload(work if side == "plain" else point, args.files, mounted)
                finally:
                    if mounted:
                        mounted.stop()
                results[side].append(times)
                if mounted:
                    cpu[side].append(used)
                print(f"  round {r + 1} {side:12s} " + "  ".join(f"{k} {v:.3f}s" for k, v in times.items()),
                      flush=True)
                shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(results, ops, cpu)
    return 0


def report(results: dict, ops: dict, cpu: dict) -> None:
    med = {s: {p: statistics.median(t[p] for t in runs) for p in PHASES} for s, runs in results.items()}
    print("\nmedian seconds; ratio = side time / plain time")
    print(f"{'phase':8s}" + "".join(f"{s:>13s}" for s in SIDES) + f"{'floor/plain':>14s}{'ours/plain':>13s}"
          f"{'ours/floor':>13s}")
    for p in PHASES:
        f, o, pl = med["floor"][p], med["intercepted"][p], med["plain"][p]
        print(f"{p:8s}" + "".join(f"{med[s][p]:13.3f}" for s in SIDES) + f"{f / pl:13.2f}x{o / pl:12.2f}x"
              f"{o / f:12.2f}x")
    print("\nrequests per phase (last round) and server CPU (median ms, µs per request)")
    for side in ("floor", "intercepted"):
        for p in PHASES:
            n = sum(v for k, v in ops[side][p].items() if k not in ("notified",))
            ms = statistics.median(c[p] for c in cpu[side]) * 1000
            by = " ".join(f"{k} {v}" for k, v in sorted(ops[side][p].items(), key=lambda kv: -kv[1]) if v)
            print(f"  {side:12s} {p:7s} {n:6d} requests  {ms:8.1f} ms  {ms * 1000 / max(n, 1):7.1f} µs/req  {by}")
    print("\nissue 16's goal: metadata phases <= 3x plain; the floor is what any FUSE server could reach here")
    for p in PHASES:
        ratio = med["floor"][p] / med["plain"][p]
        print(f"  floor {p:7s} {ratio:6.2f}x plain   {'reachable' if ratio <= 3 else 'NOT reachable through FUSE'}")


if __name__ == "__main__":
    sys.exit(main())
