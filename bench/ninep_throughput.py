#!/usr/bin/env python3
"""Benchmark: the 9P2000.L server with interception on vs off, side by side in one run.

Run ``python bench/ninep_throughput.py --help``. Prints numbers and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

try:
    import sandbox  # noqa: F401
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox.core.workspace import Workspace
from sandbox.hostfs.real import RealHostFS
from sandbox.session.runtime import open_workspace, watch_workspace
from sandbox.mounts import Provider
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client
from sandbox.ninep.server import NinePServer, ServerConfig, ServerThread

DESCRIPTION = """\
Measure the 9P2000.L server through the test client (sandbox.ninep.client) over a unix
socket, the transport QEMU's guestfwd uses, on two fresh folders on the same disk:

  off      the folder served by a plain Provider (no interception, no undo log)
  on       the folder served through a Workspace (every mutation hooked, preimages in the
           WAL, writes landing in ambient steps)
  watched  as "on", plus what a session adds under external_modification_policy barrier
           (the default of the STDIO API): the own-write journal (an lstat after each
           mutation) and the inotify watcher classifying the events

Workloads (each timed with time.perf_counter, median of --repeat runs, the two sides
alternated within each repeat so machine noise hits both):
  small files  for --files files: walk+lcreate, write 1 KiB, clunk; then walk+lopen,
               read, clunk each; then unlinkat each. Reported as operations/s per phase.
  large file   write --mb MiB in iounit-sized Twrites to a new file, then read it back
               (MB/s). msize is --msize (the server grants up to 1 MiB).

The client is synchronous (one request in flight), like one guest process doing
sequential I/O, so the numbers are per-request latency bound. The ratio on/off is the
cost of interception; a real guest kernel adds its own overhead on both sides.
"""


def small_files(c: Client, root: int, n: int) -> dict[str, float]:
    data = b"x" * 1024
    out = {}
    t = time.perf_counter()
    for i in range(n):
        fid, _ = c.walk(root, [])
        c.lcreate(fid, f"f{i}", m.DOTL_WRONLY | m.DOTL_CREATE, 0o644)
        c.write(fid, 0, data)
        c.clunk(fid)
    out["create+write"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(n):
        fid, _ = c.walk(root, [f"f{i}"])
        c.lopen(fid, m.DOTL_RDONLY)
        c.read(fid, 0, 4096)
        c.clunk(fid)
    out["read"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(n):
        c.unlinkat(root, f"f{i}", 0)
    out["unlink"] = n / (time.perf_counter() - t)
    return out


def large_file(c: Client, root: int, mib: int) -> dict[str, float]:
    chunk = os.urandom(c.msize - m.IOHDRSZ)
    total = mib << 20
    fid, _ = c.walk(root, [])
    c.lcreate(fid, "big", m.DOTL_RDWR | m.DOTL_CREATE, 0o644)
    t = time.perf_counter()
    off = 0
    while off < total:
        off += c.write(fid, off, chunk[: total - off])
    w = total / (time.perf_counter() - t) / 1e6
    t = time.perf_counter()
    off = 0
    while off < total:
        data = c.read(fid, off, c.msize - m.IOHDRSZ)
        if not data:
            break
        off += len(data)
    r = total / (time.perf_counter() - t) / 1e6
    c.clunk(fid)
    c.unlinkat(root, "big", 0)
    return {"write MB/s": w, "read MB/s": r}


def run_side(side: str, base: str, args) -> dict[str, float]:
    work = tempfile.mkdtemp(prefix=f"{side}-", dir=base)
    sock = os.path.join(base, f"{side}.sock")
    ws = detector = None
    state = os.path.join(base, f"state-{os.path.basename(work)}")
    if side == "on":
        ws = Workspace.open(work, state_dir=state)
        provider = Provider.intercepted(ws)
    elif side == "watched":
        ws, own_writes = open_workspace(work, watched=True, state_dir=state)
        provider = Provider.intercepted(ws)
        detector = watch_workspace(own_writes, work)  # logs anything it (wrongly) finds
    else:
        provider = Provider(RealHostFS(work), None, read_only=False)
    try:
        with ServerThread(NinePServer(provider, ServerConfig()), unix_path=sock):
            with Client.connect_unix(sock, msize=args.msize) as c:
                root, _ = c.attach()
                res = small_files(c, root, args.files)
                res.update(large_file(c, root, args.mb))
                return res
    finally:
        if detector is not None:
            detector.stop()
        provider.close()
        if ws is not None:
            ws.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=1000, help="small files per run (default 1000)")
    p.add_argument("--mb", type=int, default=64, help="size of the large file in MiB (default 64)")
    p.add_argument("--msize", type=int, default=1 << 20, help="msize the client asks for (default 1 MiB)")
    p.add_argument("--repeat", type=int, default=3, help="runs per side; the median is reported (default 3)")
    p.add_argument("--quick", action="store_true", help="--files 200 --mb 16 --repeat 1")
    args = p.parse_args()
    if args.quick:
        args.files, args.mb, args.repeat = 200, 16, 1
    base = tempfile.mkdtemp(prefix="sandbox-bench-9p-")
    sides = ("off", "on", "watched")
    results: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    try:
        print("warm-up run (not counted) …", file=sys.stderr, flush=True)
        run_side("off", base, argparse.Namespace(**{**vars(args), "files": 50, "mb": 2}))
        for r in range(args.repeat):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                print(f"run {r + 1}/{args.repeat}: interception {side} …", file=sys.stderr, flush=True)
                for k, v in run_side(side, base, args).items():
                    results[side].setdefault(k, []).append(v)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"9P2000.L over a unix socket, msize {args.msize}, {args.files} small files, {args.mb} MiB large file, "
          f"median of {args.repeat}")
    print(f"{'workload':22} {'off':>12} {'on':>12} {'watched':>12} {'on/off':>8} {'watched/on':>11}")
    for k in results["off"]:
        off, on, w = (statistics.median(results[side][k]) for side in sides)
        unit = "" if "MB/s" in k else " ops/s"
        print(f"{k + unit:22} {off:12.1f} {on:12.1f} {w:12.1f} {on / off:8.2f} {w / on:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
