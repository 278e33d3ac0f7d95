#!/usr/bin/env python3
"""LOOKUPs of the names of one file with many hard links, through the FUSE dispatcher (no
kernel): is the cost per LOOKUP flat as the node's names grow? A guest may give one file as
many names as the host allows (ext4: 65,000 links) and look each up; the dispatcher used to
scan all of a node's names on every LOOKUP (quadratic: 4.7 s for 20,000 names here).

Prints the µs per LOOKUP of each successive block of names and the ratio of the last block
to the first (≈ 1: linear overall). Run:

    PYTHONPATH=. .venv/bin/python bench/fuse_hard_links.py [--links 20000] [--block 5000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox.fuse import abi  # noqa: E402
from sandbox.fuse import messages as m  # noqa: E402
from sandbox_sim.test_fuse_dispatcher import H, Mount  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", type=int, default=20_000)
    ap.add_argument("--block", type=int, default=5_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mnt = Mount(Path(tmp))
        try:
            os.mkdir(mnt.host("d"))
            open(mnt.host("d/f"), "w").close()
            for i in range(args.links):
                os.link(mnt.host("d/f"), mnt.host(f"d/l{i:06d}"))
            d = mnt.lookup("d").nodeid
            per_block = []
            for start in range(0, args.links, args.block):
                t = time.perf_counter()
                for i in range(start, min(start + args.block, args.links)):
                    mnt.call(m.Lookup(H(abi.Opcode.LOOKUP, d), f"l{i:06d}".encode()))
                n = min(start + args.block, args.links) - start
                per_block.append((time.perf_counter() - t) / n * 1e6)
                print(f"names {start + 1:>7}..{start + n:<7} {per_block[-1]:8.1f} µs per LOOKUP")
            print(f"last block / first block: {per_block[-1] / per_block[0]:.2f}")
        finally:
            mnt.close()


if __name__ == "__main__":
    main()
