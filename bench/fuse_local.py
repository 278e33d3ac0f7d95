#!/usr/bin/env python3
"""Benchmark: `sandbox mount` (FUSE, the local backend) against the plain directory, side by side.

Run ``python bench/fuse_local.py --help``. Prints medians and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import page_cache_folios  # noqa: E402  (bench/page_cache_folios.py, beside this script)

DESCRIPTION = """\
One workload, timed on three sides, in fresh folders on the same disk:

  intercepted  `sandbox mount --workdir DIR MNT`: every change through the undo core
  no-undo      the same mount with interception off (the hidden `--no-undo`: the same
               dispatcher, /dev/fuse loop, watcher and own-write journal on a plain
               read-write Provider: no undo core)
  plain        DIR itself, no FUSE
  bindfs       only when asked (--sides ...,bindfs) and installed: DIR through `bindfs`, a C
               passthrough FUSE server (libfuse's multi-threaded loop, no undo, no watcher),
               with the entry and attribute timeouts our watched mount uses (60 s): a
               reference for what the FUSE round trips cost without our server (skipped,
               with a message, where `bindfs` is missing; never part of the set-up)

Phases (each timed with time.perf_counter, and the server's own CPU time read from
/proc/PID/task/*/schedstat before and after, which the load of other processes changes least; the sides are interleaved round by round, in a
rotated order, and each phase's median over --repeat rounds is printed):
  create    --files small files (1 KiB, in 20 directories): open, write, close
  stat      os.stat of each file
  read      open, read, close each file
  git       `git init` then `git add -A && git commit` of the tree (git's identity from env)
  write     --mb MiB written sequentially in 1 MiB writes, then fsync
  read-seq  the same file read back in 1 MiB reads (warm: the host's page cache holds it on
            every side, and the mount's own page cache keeps what its writes filled, so the
            mount's reads are served by the kernel without the server)
  rm -rf    `rm -rf` of everything

The goals of issue 16 (printed as met or not; nothing is asserted): metadata-heavy phases
(create, stat, read, git, rm -rf) at most 3x the plain directory's time; sequential write
and read at least 50 % of its bandwidth.
"""

SIDES = ("intercepted", "no-undo", "plain")
OPTIONAL_SIDES = ("bindfs",)
#: bindfs's entry and attribute timeouts: COHERENT_ENTRY_VALID_S / COHERENT_ATTR_VALID_S of
#: the watched `sandbox mount` (sandbox/fuse/dispatcher.py), so both get the same requests
BINDFS_TIMEOUT_S = 60
METADATA = ("create", "stat", "read", "git", "rm -rf")
SEQUENTIAL = ("write", "read-seq")
#: seconds to wait for `sandbox mount` to come up, and to exit after SIGTERM
MOUNT_TIMEOUT_S = 60
CHUNK = 1 << 20


class Mounted:
    """`sandbox mount` of ``work`` at ``point`` as a subprocess (stopped with SIGTERM)."""

    def __init__(self, work: str, point: str, state: str, no_undo: bool, counts: str | None = None):
        argv = [sys.executable, "-m", "sandbox", "mount", "--workdir", work, "--state-dir", state, point,
                "--on-hold", "allow"] + (["--no-undo"] if no_undo else []) + (["--op-counts", counts] if counts else [])
        self.counts = counts
        self.proc = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True)
        line: list[str] = []
        t = threading.Thread(target=lambda: line.append(self.proc.stderr.readline()), daemon=True)
        t.start()
        t.join(MOUNT_TIMEOUT_S)
        if not line or "mounted at" not in line[0]:
            self.proc.kill()
            raise SystemExit(f"sandbox mount did not come up: {line[0] if line else 'timeout'}")

    def op_counts(self) -> dict:
        """The server's requests read so far, by opcode (+ "notified": invalidations written)."""
        before = _lines(self.counts)
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while _lines(self.counts) == before:  # a condition wait for the server's line
            if time.monotonic() > deadline:
                raise SystemExit("the server did not write its request counts")
            time.sleep(0.01)
        with open(self.counts) as f:
            last = json.loads(f.read().splitlines()[-1])
        return dict(last["ops"], notified=last["notified"])

    def cpu_s(self) -> float:
        """Seconds of CPU the server has used so far, all its threads (``/proc/PID/task/*/schedstat``:
        nanoseconds on a CPU; the serving loop's, the watcher's and the notifier's)."""
        total = 0
        task = f"/proc/{self.proc.pid}/task"
        for tid in os.listdir(task):
            try:
                with open(f"{task}/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass  # a thread that ended meanwhile
        return total / 1e9

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(MOUNT_TIMEOUT_S)
        self.proc.stderr.close()


class BindfsMounted:
    """`bindfs -f` of ``work`` at ``point`` (stopped by unmounting); CPU as :class:`Mounted`'s.
    It counts no requests (``op_counts`` is None)."""

    counts = None

    def __init__(self, work: str, point: str):
        opts = f"attr_timeout={BINDFS_TIMEOUT_S},entry_timeout={BINDFS_TIMEOUT_S}"
        self.point = point
        self.proc = subprocess.Popen(["bindfs", "-f", "-o", opts, work, point], stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not os.path.ismount(point):  # a condition wait for the mount to appear
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit(f"bindfs did not come up: {self.proc.stderr.read()}")
            time.sleep(0.01)

    cpu_s = Mounted.cpu_s

    def op_counts(self) -> None:
        return None

    def stop(self) -> None:
        unmount = ["umount", self.point] if os.geteuid() == 0 else ["fusermount", "-u", self.point]
        subprocess.run(unmount, check=False, capture_output=True)
        self.proc.wait(MOUNT_TIMEOUT_S)
        self.proc.stderr.close()


def _lines(path: str) -> int:
    try:
        with open(path) as f:
            return len(f.read().splitlines())
    except FileNotFoundError:
        return 0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def small_file_phases(root: str, files: int) -> dict:
    """The small-file phases, by name, as functions of no argument (``bench/fuse_floor.py`` runs
    the same ones): ``create`` makes ``files`` files of 1 KiB in 20 directories under ``root``,
    ``stat`` and ``read`` (Python's ``open``, so an ``isatty`` each) visit them, ``rm -rf``
    removes everything under ``root``."""
    names = [os.path.join(root, f"d{i % 20}", f"f{i}.txt") for i in range(files)]
    data = b"x" * 1024

    def create():
        for i in range(20):
            os.mkdir(os.path.join(root, f"d{i}"))
        for n in names:
            with open(n, "wb") as f:
                f.write(data)

    def stat():
        for n in names:
            os.stat(n)

    def read():
        for n in names:
            with open(n, "rb") as f:
                f.read()

    def rm_rf():
        entries = [os.path.join(root, n) for n in os.listdir(root)]
        subprocess.run(["rm", "-rf", "--", *entries], check=True)

    return {"create": create, "stat": stat, "read": read, "rm -rf": rm_rf}


def workload(root: str, files: int, mb: int, env: dict, counted=None, after_read_seq=None) -> dict[str, float]:
    """Each phase's seconds; ``counted(phase, before)``: called before (True) and after
    (False) each phase (``--counts``); ``after_read_seq(path)``: called with the big file's
    path once the ``read-seq`` phase is timed (``--folios``)."""
    out = {}
    small = small_file_phases(root, files)

    def git():
        for argv in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "bench"]):
            subprocess.run(argv, cwd=root, env=env, check=True, capture_output=True)

    big = os.path.join(root, "big.bin")
    block = os.urandom(CHUNK)

    def write():
        fd = os.open(big, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(mb):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_seq():
        fd = os.open(big, os.O_RDONLY)
        try:
            while os.read(fd, CHUNK):
                pass
        finally:
            os.close(fd)

    for name, fn in (("create", small["create"]), ("stat", small["stat"]), ("read", small["read"]), ("git", git),
                     ("write", write), ("read-seq", read_seq), ("rm -rf", small["rm -rf"])):
        if counted:
            counted(name, True)
        out[name] = _timed(fn)
        if counted:
            counted(name, False)
        if name == "read-seq" and after_read_seq:
            after_read_seq(big)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="where the folders go (a real disk, not tmpfs; default: the system temp dir)")
    ap.add_argument("--quick", action="store_true", help="300 files, 32 MiB, 2 rounds")
    ap.add_argument("--sides", default=",".join(SIDES),
                    help=f"a comma-separated subset of {SIDES + OPTIONAL_SIDES} (bindfs only when named)")
    ap.add_argument("--counts", action="store_true",
                    help="also print the FUSE requests each phase made, by opcode (last round; the server's "
                         "hidden --op-counts: SIGUSR1 between phases)")
    ap.add_argument("--folios", action="store_true",
                    help="after read-seq, print how the kernel holds the big file in its page cache: the share "
                         "of its pages in large folios (bench/page_cache_folios.py; root only)")
    args = ap.parse_args(argv)
    if args.quick:
        args.files, args.mb, args.repeat = 300, 32, 2
    sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in sides if s not in SIDES + OPTIONAL_SIDES]
    if unknown:
        ap.error(f"unknown sides {unknown}")
    if "bindfs" in sides and not shutil.which("bindfs"):
        print("bindfs is not installed: its side is skipped (apt-get install bindfs; it is no part of the "
              "set-up)", file=sys.stderr)
        sides.remove("bindfs")
    if args.folios and page_cache_folios.available():
        print(f"--folios: {page_cache_folios.available()}; not printed", file=sys.stderr)
        args.folios = False
    if os.geteuid() != 0 and not shutil.which("fusermount3"):
        print("needs root or fusermount3", file=sys.stderr)
        return 1
    base = tempfile.mkdtemp(prefix="fuse-bench-", dir=args.dir)
    home = os.path.join(base, "home")
    os.mkdir(home)
    env = dict(os.environ, HOME=home, GIT_AUTHOR_NAME="bench", GIT_AUTHOR_EMAIL="bench@example.invalid",
               GIT_COMMITTER_NAME="bench", GIT_COMMITTER_EMAIL="bench@example.invalid", GIT_CONFIG_NOSYSTEM="1")
    results: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    ops: dict[str, dict[str, collections.Counter]] = {s: {} for s in sides}
    cpu: dict[str, list[dict[str, float]]] = {s: [] for s in sides if s != "plain"}
    held: dict[str, list[str]] = {s: [] for s in sides}  # --folios: each round's page cache of the big file
    print(f"{args.files} files, {args.mb} MiB, {args.repeat} rounds, in {base}", flush=True)
    try:
        for r in range(args.repeat):
            order = sides[r % len(sides):] + sides[:r % len(sides)]
            for side in order:
                d = os.path.join(base, f"{side}-{r}")
                work, point, state = d + "/work", d + "/mnt", d + "/state"
                for x in (work, point, state):
                    os.makedirs(x)
                counts = os.path.join(d, "counts.jsonl") if args.counts else None
                if side == "plain":
                    mounted = None
                elif side == "bindfs":
                    mounted = BindfsMounted(work, point)
                else:
                    mounted = Mounted(work, point, state, side == "no-undo", counts)
                counted = None
                if mounted is not None:
                    marks: dict = {}
                    server_cpu = {}
                    cpu[side].append(server_cpu)

                    def counted(phase, before, mounted=mounted, marks=marks, side=side, server_cpu=server_cpu,
                                counts=counts):
                        if not before:
                            server_cpu[phase] = mounted.cpu_s() - marks[phase, "cpu"]
                        if mounted.counts:
                            now = mounted.op_counts()
                            if before:
                                marks[phase] = now
                            else:
                                ops[side][phase] = collections.Counter(now) - collections.Counter(marks[phase])
                        if before:
                            marks[phase, "cpu"] = mounted.cpu_s()
                def folios(path, side=side):
                    held[side].append(page_cache_folios.describe(page_cache_folios.folios(path)))

                try:
                    times = workload(work if side == "plain" else point, args.files, args.mb, env, counted,
                                     folios if args.folios else None)
                finally:
                    if mounted is not None:
                        mounted.stop()
                results[side].append(times)
                print(f"  round {r + 1} {side:12s} " + "  ".join(f"{k} {v:.3f}s" for k, v in times.items()),
                      flush=True)
                shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(results, args.files, args.mb)
    report_cpu(cpu, ops if args.counts else None)
    if args.counts:
        report_counts(ops)
    if args.folios:
        print("\nthe big file in the page cache after read-seq (each round)")
        for side, lines in held.items():
            for line in lines:
                print(f"  {side:12s} {line}")
    return 0


def report_cpu(cpu: dict, ops: dict | None) -> None:
    """The server's own CPU per phase (medians): what the load of other processes changes least."""
    if not any(cpu.values()):
        return
    print("\nserver CPU per phase (ms, medians; all its threads)" + (", and µs per request" if ops else ""))
    for side, runs in cpu.items():
        if not runs:
            continue
        cells = []
        for phase in runs[0]:
            ms = statistics.median(r[phase] for r in runs) * 1000
            n = sum(v for k, v in ops[side].get(phase, {}).items() if k != "notified") if ops else 0
            cells.append(f"{phase} {ms:.0f}" + (f" ({ms * 1000 / n:.0f} µs/req)" if n else ""))
        print(f"  {side:12s} " + "  ".join(cells))


def report_counts(ops: dict) -> None:
    print("\nFUSE requests per phase (last round; 'notified': invalidations the server wrote)")
    for side, phases in ops.items():
        for phase, c in phases.items():
            print(f"  {side:12s} {phase:9s} {sum(v for k, v in c.items() if k != 'notified'):7d}  "
                  + " ".join(f"{k}={v}" for k, v in c.most_common()))


def report(results: dict, files: int, mb: int) -> None:
    phases = list(next(iter(results.values()))[0])
    med = {s: {p: statistics.median(t[p] for t in runs) for p in phases} for s, runs in results.items()}
    print(f"\nmedian seconds ({files} files, {mb} MiB); ratio = side time / plain time")
    print(f"{'phase':10s}" + "".join(f"{s:>14s}" for s in med) + "".join(f"{s + '/plain':>20s}" for s in med
                                                                         if s != "plain"))
    for p in phases:
        line = f"{p:10s}" + "".join(f"{med[s][p]:14.3f}" for s in med)
        if "plain" in med:
            line += "".join(f"{med[s][p] / med['plain'][p]:19.2f}x" for s in med if s != "plain")
        print(line)
    if "plain" not in med:
        return
    print("\nbandwidth (MB/s) of the sequential phases")
    for p in SEQUENTIAL:
        print(f"{p:10s}" + "".join(f"{mb * 1.048576 / med[s][p]:14.1f}" for s in med))
    print("\ngoals (issue 16): metadata <= 3x plain, sequential >= 50 % of plain's bandwidth")
    for s in med:
        if s == "plain":
            continue
        for p in METADATA:
            ratio = med[s][p] / med["plain"][p]
            print(f"  {s:12s} {p:9s} {ratio:6.2f}x plain   {'met' if ratio <= 3 else 'NOT met'}")
        for p in SEQUENTIAL:
            share = med["plain"][p] / med[s][p]
            print(f"  {s:12s} {p:9s} {share * 100:5.0f} % of plain   {'met' if share >= 0.5 else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
