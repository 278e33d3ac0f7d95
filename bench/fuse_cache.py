"""What the FUSE mount's caching choice costs: timeouts and page-cache modes, side by side.

Sides (one run, the same tree, the same workload, as root with /dev/fuse):

* ``plain``   — the working folder itself (no FUSE): the reference;
* ``t0``      — the mount with entry/attribute timeouts 0 and the page cache dropped at each
  open: every stat and every path step asks the server;
* ``t1``      — timeouts 1 s, page cache dropped at each open: what the mount does without
  the watcher (``ENTRY_VALID_S``/``ATTR_VALID_S``);
* ``w-drop``  — the watcher's invalidations and 60 s timeouts, but the page cache dropped at
  each open;
* ``watched`` — the watcher's invalidations on, so timeouts of ``COHERENT_*_VALID_S`` (60 s)
  and the page cache kept across opens (``FOPEN_KEEP_CACHE``): what ``sandbox mount`` does.

Workloads, each in a child process (a page fault on the mount would hold this process's GIL,
which the server needs): ``stat`` — lstat every file of a tree of ``--files`` files in 20
directories, ``--stat-rounds`` times, ``--gap-s`` apart (not counted; the gap lets a 1 s
timeout expire between rounds, as for a tool that polls the tree); ``reread`` — open, read whole and close every file of the tree (4 KiB each)
``--rounds`` times; ``big`` — read a ``--big-mb`` MiB file whole ``--rounds`` times; ``edit`` — a host edit (same size) to the first time it reads back
through the mount, median of 20 (with no invalidation: until the attribute timeout).

    sudo .venv/bin/python bench/fuse_cache.py [--files 2000] [--rounds 10]

Prints seconds per side and the ratio to ``plain``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from sandbox.fuse import abi
from sandbox.fuse import dispatcher as dispatcher_module
from sandbox.fuse.dispatcher import Dispatcher
from sandbox.fuse.notify import watch
from sandbox.fuse.transport import FuseServer, mount, unmount
from sandbox.limits import ServerLimits
from sandbox.mounts import Provider
from sandbox.serving import Export, HoldBroker
from sandbox.serving.workspaces import open_workspace

STAT = """
import os, sys, time
root, rounds, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
paths = [os.path.join(root, d, f) for d in sorted(os.listdir(root)) if d.startswith("d") for f in sorted(os.listdir(os.path.join(root, d)))]
spent = 0.0
for _ in range(rounds):
    time.sleep(gap)  # a tool polling the tree (a build watcher, an editor): not counted
    t = time.perf_counter()
    for p in paths:
        os.lstat(p)
    spent += time.perf_counter() - t
print(spent)
"""
BIGREAD = """
import sys, time
path, rounds = sys.argv[1], int(sys.argv[2])
t = time.perf_counter()
for _ in range(rounds):
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
print(time.perf_counter() - t)
"""
REREAD = """
import os, sys, time
root, rounds = sys.argv[1], int(sys.argv[2])
paths = [os.path.join(root, d, f) for d in sorted(os.listdir(root)) if d.startswith("d") for f in sorted(os.listdir(os.path.join(root, d)))]
t = time.perf_counter()
for _ in range(rounds):
    for p in paths:
        with open(p, "rb") as f:
            f.read()
print(time.perf_counter() - t)
"""
EDIT = """
import os, sys, time, statistics
host, mnt = sys.argv[1], sys.argv[2]
lat = []
for i in range(20):
    want = b"%04d" % i
    with open(mnt, "rb") as f:
        f.read()  # cached through the mount
    t = time.perf_counter()
    with open(host, "r+b") as f:
        f.write(want)
    while True:
        with open(mnt, "rb") as f:
            if f.read(4) == want:
                break
        if time.perf_counter() - t > 5:
            break
    lat.append(time.perf_counter() - t)
print(statistics.median(lat))
"""


def make_tree(root: str, files: int) -> None:
    for i in range(files):
        d = os.path.join(root, f"d{i % 20:02d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i:05d}"), "wb") as f:
            f.write(os.urandom(4096))


def child(script: str, *args: str) -> float:
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise SystemExit(r.stderr)
    return float(r.stdout)


class Served:
    """``work`` served at ``point`` in this process (the loop in a thread)."""

    def __init__(self, work: str, point: str, state: str, side: str):
        self.point = point
        self.ws, own = open_workspace(work, watched=True, state_dir=state)
        self.provider = Provider.intercepted(self.ws)
        limits = ServerLimits()
        self.fd, self.via = mount(point)
        self.server = FuseServer(Dispatcher(Export(self.provider, HoldBroker(), limits), limits), self.fd, limits)
        self.stop_watch = watch(self.server, work, own) if side in ("watched", "w-drop") else (lambda: None)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.server.serve(),), daemon=True)
        self.thread.start()

    def close(self) -> None:
        unmount(self.point, self.via)
        self.thread.join(30)
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.stop)
            self.thread.join(30)
        self.stop_watch()
        os.close(self.fd)
        self.provider.close()
        self.ws.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--stat-rounds", type=int, default=5)
    ap.add_argument("--gap-s", type=float, default=1.2, help="seconds between stat rounds (not counted)")
    ap.add_argument("--big-mb", type=int, default=64, help="the size of the file read whole --rounds times")
    ap.add_argument("--dir", help="where to make the temporary tree (default: the system's)")
    args = ap.parse_args()
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        raise SystemExit("needs root and /dev/fuse (the mount uses mount(2))")
    base = tempfile.mkdtemp(prefix="fuse-cache-", dir=args.dir)
    try:
        work, point = os.path.join(base, "work"), os.path.join(base, "mnt")
        os.makedirs(point)
        os.makedirs(work)
        make_tree(work, args.files)
        with open(os.path.join(work, "edited"), "wb") as f:
            f.write(b"----")
        with open(os.path.join(work, "big"), "wb") as f:
            for _ in range(args.big_mb):
                f.write(os.urandom(1 << 20))
        results: dict[str, dict[str, float]] = {}
        keep = Dispatcher._open_flags
        for side in ("plain", "t0", "t1", "w-drop", "watched"):
            served = None
            timeouts = {"t0": 0, "t1": 1}.get(side)
            if timeouts is not None:
                dispatcher_module.ENTRY_VALID_S = dispatcher_module.ATTR_VALID_S = timeouts
            Dispatcher._open_flags = (lambda self: keep(self) & ~abi.FOPEN_KEEP_CACHE) if side == "w-drop" else keep
            if side != "plain":
                served = Served(work, point, os.path.join(base, f"state-{side}"), side)
            root = work if side == "plain" else point
            try:
                r = results[side] = {}
                r["stat"] = child(STAT, root, str(args.stat_rounds), str(args.gap_s))
                r["reread"] = child(REREAD, root, str(args.rounds))
                r["big"] = child(BIGREAD, os.path.join(root, "big"), str(args.rounds))
                r["edit"] = child(EDIT, os.path.join(work, "edited"), os.path.join(root, "edited"))
            finally:
                if served is not None:
                    served.close()
        print(f"{args.files} files, {args.rounds} rounds; seconds (ratio to plain)")
        print(f"{'side':8} {'stat':>16} {'reread':>16} {'big reread':>16} {'edit seen after':>16}")
        p = results["plain"]
        for side, r in results.items():
            cells = " ".join(f"{r[k]:8.3f} ({r[k] / p[k]:5.1f}×)" for k in ("stat", "reread", "big"))
            print(f"{side:8} {cells} {r['edit'] * 1000:13.1f} ms")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
