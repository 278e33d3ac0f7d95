#!/usr/bin/env python3
"""The rm mix's requests repeated in process, in CPU time: a steadier per-request figure than
``fuse_requests.py``'s one pass, for comparing two trees on a loaded machine.

The dispatcher, Provider and undo core as ``fuse_requests.py`` builds them (intercepted, the
own-write journal), ``--mode no-open`` (coherent, no-open: ``sandbox mount``) or ``--mode
handles`` (not coherent, OPEN handles: what the virtio-fs device runs). In a folder with one
directory of 25 files:

  GETATTR of the directory and of a file, LOOKUP of a name found and missing, FORGET of 0:
  1,500 each per round;
  a directory pass: OPENDIR, READDIRPLUS until empty, RELEASEDIR (27 entries), 200 per round;
  rm: per file made beside the mount (written once through the mount in no-open mode, so its
  node keeps descriptors, as after a create), in a step of its own: GETATTR of the directory,
  UNLINK, FORGET; then RMDIR and FORGET of empty directories — 300 files and 100 directories
  per round;
  write mix: per file, in a step: CREATE, WRITE (1 KiB, through the CREATE's handle); then in
  the next step: SETATTR (mtime), RENAME (in its directory), WRITE, RELEASE — 300 files per
  round (the own-write journal's requests; the second step's first change of each file takes
  its preimage).

Three rounds; a request's figure is its least CPU µs per request over them (process CPU:
the kernel's part of its system calls included). With ``--other TREE`` each run is a child
process per tree (``PYTHONPATH``), alternating which goes first, and the medians of the runs'
figures are printed side by side with their ratio. Nothing is asserted.

    .venv/bin/python bench/fuse_requests_repeat.py [--mode no-open|handles] [--runs 5] [--other ../wt-base]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fuse_requests as fr  # noqa: E402  (the kernel's request bytes)

ROUNDS = 3


def _timed(call, t: dict, steps) -> None:
    """Each ``(label, request bytes, must succeed)`` in turn: its CPU ns added to ``t[label]``
    (the check after the clock stops)."""
    for label, raw, ok in steps:
        c = time.process_time_ns()
        err = call(raw)[0]
        t[label] += time.process_time_ns() - c
        assert not ok or err is None, (label, err)


def run_once(no_open: bool) -> dict[str, float]:
    from sandbox.fuse import abi

    base = tempfile.mkdtemp(prefix="fuse-req-repeat-")
    try:
        work, state = os.path.join(base, "work"), os.path.join(base, "state")
        os.makedirs(work)
        ws, d, call = fr.dispatcher_on(work, state, no_open)
        w = fr.Wire()

        def nodeid(out: bytes) -> int:
            return struct.unpack_from("<Q", out, 16)[0]

        call(w.init(0xFFFFFFFF & ~abi.FUSE_INIT_RESERVED, 0xFFFFFFFF))
        os.mkdir(os.path.join(work, "d"))
        for i in range(25):
            with open(os.path.join(work, "d", f"f{i:05d}"), "wb") as f:
                f.write(b"x" * 1024)
        dn = nodeid(call(w.lookup(abi.FUSE_ROOT_ID, b"d"))[1])
        fn = nodeid(call(w.lookup(dn, b"f00000"))[1])
        ws.close_active()
        res: dict[str, list[float]] = {}

        def repeated(label: str, make, n: int = 1500) -> None:
            for _ in range(ROUNDS):
                raws = [make() for _ in range(n)]
                c = time.process_time()
                for raw in raws:
                    call(raw)
                res.setdefault(label, []).append((time.process_time() - c) / n * 1e6)

        repeated("GETATTR of a directory", lambda: w.getattr(dn))
        repeated("GETATTR of a file", lambda: w.getattr(fn))
        repeated("LOOKUP, found", lambda: w.lookup(dn, b"f00001"))
        repeated("LOOKUP, missing", lambda: w.lookup(dn, b"nope"))
        repeated("FORGET of 0", lambda: w.forget(fn, 0))
        for _ in range(ROUNDS):
            c, n = time.process_time(), 200
            for _ in range(n):
                fh = nodeid(call(w.opendir(dn))[1])
                offset = 0
                while (offset := fr.last_offset(call(w.readdirplus(dn, fh, offset))[1])) is not None:
                    pass
                call(w.releasedir(dn, fh))
            res.setdefault("directory pass (27 entries)", []).append((time.process_time() - c) / n * 1e6)
        for r in range(ROUNDS):
            names = [f"u{r}_{i:05d}" for i in range(300)]
            for name in names:
                with open(os.path.join(work, "d", name), "wb") as f:
                    f.write(b"y" * 1024)
            nodes = [nodeid(call(w.lookup(dn, name.encode()))[1]) for name in names]
            if no_open:  # the node keeps descriptors, as after a create through the mount
                for n in nodes:
                    call(w.write(n, b"z" * 1024))
            empties = [f"r{r}_{i:05d}" for i in range(100)]
            for name in empties:
                os.mkdir(os.path.join(work, "d", name))
            dnodes = [nodeid(call(w.lookup(dn, name.encode()))[1]) for name in empties]
            ws.close_active()  # the removals in a step of their own: each UNLINK takes a preimage
            t = dict.fromkeys(("rm: GETATTR", "rm: UNLINK", "rm: FORGET", "RMDIR", "rmdir: FORGET"), 0)
            for name, n in zip(names, nodes):
                _timed(call, t, (("rm: GETATTR", w.getattr(dn), False), ("rm: UNLINK", w.unlink(dn, name.encode()), True),
                                 ("rm: FORGET", w.forget(n, 9), False)))
            for name, n in zip(empties, dnodes):
                _timed(call, t, (("RMDIR", w.rmdir(dn, name.encode()), True), ("rmdir: FORGET", w.forget(n, 9), False)))
            for k, v in t.items():
                res.setdefault(k, []).append(v / (len(empties) if "RMDIR" in k or "rmdir" in k else len(names)) / 1000)
            ws.close_active()
        for r in range(ROUNDS):
            names = [f"w{r}_{i:05d}".encode() for i in range(300)]
            t = dict.fromkeys(("write mix: CREATE", "write mix: WRITE, new", "write mix: SETATTR", "write mix: RENAME",
                               "write mix: WRITE", "write mix: RELEASE"), 0)
            made = []
            for name in names:
                raw = w.create(dn, name)
                c0 = time.process_time_ns()
                err, out = call(raw)
                c1 = time.process_time_ns()
                assert err is None, err
                n, fh = nodeid(out), struct.unpack_from("<Q", out, 16 + fr.ENTRY_OUT_BYTES)[0]
                raw = w.write(n, b"w" * 1024, fh)
                c2 = time.process_time_ns()
                assert call(raw)[0] is None
                c3 = time.process_time_ns()
                t["write mix: CREATE"] += c1 - c0
                t["write mix: WRITE, new"] += c3 - c2
                made.append((name, n, fh))
            ws.close_active()
            for name, n, fh in made:
                raws = (w.setattr_mtime(n, 1_700_000_000), w.rename(dn, name, dn, name + b".r"),
                        w.write(n, b"v" * 1024, fh), w.release(n, fh))
                _timed(call, t, zip(("write mix: SETATTR", "write mix: RENAME", "write mix: WRITE", "write mix: RELEASE"),
                                    raws, (True,) * 4))
            for k, v in t.items():
                res.setdefault(k, []).append(v / len(names) / 1000)
            ws.close_active()
        d.close()
        d.provider.close()
        ws.close()
        return {k: min(v) for k, v in res.items()}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("no-open", "handles"), default="no-open")
    ap.add_argument("--runs", type=int, default=3, help="child runs per tree (medians are printed)")
    ap.add_argument("--other", help="another checkout to run side by side (its PYTHONPATH)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        print(json.dumps(run_once(args.mode == "no-open")))
        return
    trees = {"this": os.environ.get("PYTHONPATH") or os.path.dirname(HERE)}
    if args.other:
        trees["other"] = os.path.abspath(args.other)
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for i in range(args.runs):
        for k in (list(trees) if i % 2 == 0 else list(reversed(trees))):
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", "--mode", args.mode],
                               env=dict(os.environ, PYTHONPATH=trees[k]), capture_output=True, text=True, timeout=1800)
            if r.returncode:
                raise SystemExit(f"{trees[k]}: {r.stderr}")
            runs[k].append(json.loads(r.stdout))
    print(f"--mode {args.mode}, {args.runs} runs a tree, load average {os.getloadavg()[0]:.2f}; CPU µs per request"
          + (f"; other = {args.other}" if args.other else ""))
    print(f"{'request':30} {'this':>8}" + (f" {'other':>8} {'ratio':>6}" if args.other else ""))
    for key in runs["this"][0]:
        a = statistics.median(r[key] for r in runs["this"])
        line = f"{key:30} {a:8.1f}"
        if args.other:
            b = statistics.median(r[key] for r in runs["other"])
            line += f" {b:8.1f} {a / b:6.2f}"
        print(line)


if __name__ == "__main__":
    main()
