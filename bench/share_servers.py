"""Share servers in the agent's thread vs. in their own confined process (issue 13).

The same workload on two working folders of one session, served by the agent's 9P server
thread (``share_servers="thread"``) and by the confined share-server process
(``share_servers="process"``). The guest is replaced by two client *processes* (one per
share, each its own 9P connection over the unix socket, as a guest kernel's mount has), so
only where the server runs differs. Each client creates, writes, reads and deletes
``--files`` small files in its share, inside one step per folder. Printed: wall time per mode
and the ratio. Numbers for people to read: nothing is asserted.

    .venv/bin/python bench/share_servers.py --quick
    .venv/bin/python bench/share_servers.py --files 2000 --repeat 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox.ninep.client import Client  # noqa: E402
from sandbox.scripted.guest import _MountFS  # noqa: E402
from sandbox.session.runtime import Folder, Session  # noqa: E402


class NullGuest:
    """Boots nothing: the bench's client processes stand for the guest."""

    def boot(self, *, socket_path, mounts, loop, timeout_s):
        self.sockets = {m.aname: m.socket or socket_path for m in mounts}

    def stop(self):
        pass

    def alive(self):
        return True

    def tail(self, n):
        return []


def client(sock: str, aname: str, files: int, size: int, start, done) -> None:
    c = Client.connect_unix(sock)
    fs = _MountFS(c, aname)
    data = os.urandom(size)
    start.wait()
    for i in range(files):
        fs.write_file(f"f{i}", data)
    for i in range(files):
        fs.read_file(f"f{i}")
    for i in range(files):
        fs.unlink(f"f{i}")
    c.close()
    done.put(aname)


def run(mode: str, files: int, size: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        folders = []
        for k in range(2):
            os.makedirs(f"{d}/w{k}")
            folders.append(Folder(f"{d}/w{k}", state_dir=f"{d}/s{k}"))
        guest = NullGuest()
        with Session(folders, guest=lambda run_dir: guest, share_servers=mode) as s:
            ids = [ws.begin_step("bench") for ws in s.workspaces]
            ctx = multiprocessing.get_context("fork")
            start, done = ctx.Event(), ctx.Queue()
            procs = [ctx.Process(target=client, args=(guest.sockets[a], a, files, size, start, done)) for a in ("0", "1")]
            for p in procs:
                p.start()
            t0 = time.perf_counter()
            start.set()
            for _ in procs:
                done.get(timeout=600)
            wall = time.perf_counter() - t0
            for p in procs:
                p.join()
            for ws, sid in zip(s.workspaces, ids):
                ws.close_step(sid, 0)
        return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=1000, help="small files per share (default 1000)")
    ap.add_argument("--size", type=int, default=4096, help="bytes per file (default 4096)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="200 files, one repeat")
    a = ap.parse_args()
    if a.quick:
        a.files, a.repeat = 200, 1
    print(f"two shares, 2 client processes, {a.files} files x {a.size} B each (create+write, read, unlink); "
          f"{os.cpu_count()} CPUs")
    best = {}
    for mode in ("thread", "process"):
        times = [run(mode, a.files, a.size) for _ in range(a.repeat)]
        best[mode] = min(times)
        ops = 2 * 3 * a.files
        print(f"  {mode:8s} best {best[mode]:.2f} s of {a.repeat}  ({ops / best[mode]:.0f} file ops/s)")
    print(f"  thread / process wall time: {best['thread'] / best['process']:.2f}x")


if __name__ == "__main__":
    main()
