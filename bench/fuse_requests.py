#!/usr/bin/env python3
"""The FUSE server's own CPU per request, without the kernel: the real dispatcher, Provider
and undo core on a temporary folder, fed encoded requests.
Each phase is its own step (the one before is closed first), so its changes to files made
earlier take preimages, as on a mount whose ambient step closed while it was idle.

Each request is built as the kernel's bytes, decoded by ``decode_request``, run through
``Dispatcher.submit`` (the request pipeline and the export's hold gate, as the /dev/fuse loop
does) and its reply encoded by the transport's ``reply_bytes``; only the read of the request
and the write of the reply — the kernel's part — are missing. The mount is what
``sandbox mount`` runs with its watcher: intercepted (``open_workspace(watched=True)``: the undo
core and the own-write journal), coherent, no-open.

Phases, per file of ``--files`` (in 20 directories), the requests Linux sends for the
benchmark's phases (docs/fuse.md "Benchmark"):

  create  LOOKUP (a missing name) + GETATTR (its directory) + CREATE + GETXATTR
          (security.capability) + WRITE (1 KiB, no handle) + RELEASE
  stat    GETATTR
  read    READ (no handle)
  git     LOOKUP + GETATTR + SETATTR (mtime) of each file
  freshen SETATTR (atime and mtime "now") of one file, once per file: what ``git add -A`` of
          identical files sends, a ``utime(blob, NULL)`` of the one object they share each time
  readdir each directory's OPENDIR + READDIRPLUS (4 KiB replies, until empty) + RELEASEDIR:
          what ``rm -rf`` reads before it unlinks (µs per file: the directories' requests
          over all files)
  rm      GETATTR (its directory) + UNLINK + FORGET
  rmdir   GETATTR (the root) + RMDIR + FORGET of each directory (µs per file, as readdir)

Prints µs per request per opcode (the median of the phase's requests, in the thread's CPU time
and in wall time) and, per phase, µs per file in process CPU time and wall time. With
``--other TREE`` (a checkout, e.g. a worktree of another commit) each round runs both trees in
child processes (``PYTHONPATH=TREE``), alternating which goes first, and prints the medians side
by side with their ratio. Nothing is asserted. ``--dir /dev/shm`` (a tmpfs) keeps the disk's own
time out: on an ext4 the host's ``open(O_CREAT)`` alone swings by 10x between runs.

    .venv/bin/python bench/fuse_requests.py [--files 2000] [--repeat 5] [--other ../wt-base]
    .venv/bin/python bench/fuse_requests.py --profile create     # cProfile of one phase (CPU time)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

PHASES = ("create", "stat", "read", "git", "freshen", "readdir", "rm", "rmdir")
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
DIRS = 20
DATA = os.urandom(1024)
READDIR_BYTES = 4096  # what Linux asks a READDIRPLUS for (one page)
ENTRY_OUT_BYTES = 128  # struct fuse_entry_out, before each fuse_dirent of a READDIRPLUS reply


class Wire:
    """Requests as the kernel's bytes (struct layouts from include/uapi/linux/fuse.h)."""

    def __init__(self):
        self.unique = 1
        self.uid, self.gid = os.getuid(), os.getgid()

    def req(self, opcode: int, nodeid: int, body: bytes) -> bytes:
        self.unique += 1
        return IN_HEADER.pack(40 + len(body), opcode, self.unique, nodeid, self.uid, self.gid, 4242, 0, 0) + body

    def init(self, flags: int, flags2: int) -> bytes:
        return self.req(26, 0, struct.pack("<IIIII44x", 7, 38, 1 << 17, flags, flags2))

    def lookup(self, parent: int, name: bytes) -> bytes:
        return self.req(1, parent, name + b"\0")

    def getattr(self, nodeid: int) -> bytes:
        return self.req(3, nodeid, struct.pack("<IIQ", 0, 0, 0))

    def create(self, parent: int, name: bytes) -> bytes:
        return self.req(35, parent, struct.pack("<IIII", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o100644, 0o022, 0)
                        + name + b"\0")

    def getxattr(self, nodeid: int, name: bytes) -> bytes:
        return self.req(22, nodeid, struct.pack("<II", 0, 0) + name + b"\0")

    def write(self, nodeid: int, data: bytes, fh: int = 0) -> bytes:
        return self.req(16, nodeid, struct.pack("<QQIIQII", fh, 0, len(data), 0, 0, os.O_WRONLY, 0) + data)

    def release(self, nodeid: int, fh: int = 0) -> bytes:
        return self.req(18, nodeid, struct.pack("<QIIQ", fh, os.O_WRONLY, 0, 0))

    def rename(self, parent: int, name: bytes, newparent: int, newname: bytes) -> bytes:
        return self.req(12, parent, struct.pack("<Q", newparent) + name + b"\0" + newname + b"\0")

    def read(self, nodeid: int, size: int) -> bytes:
        return self.req(15, nodeid, struct.pack("<QQIIQII", 0, 0, size, 0, 0, os.O_RDONLY, 0))

    def setattr_now(self, nodeid: int) -> bytes:
        valid = 1 << 4 | 1 << 5 | 1 << 7 | 1 << 8  # FATTR_ATIME | FATTR_MTIME | FATTR_ATIME_NOW | FATTR_MTIME_NOW
        return self.req(4, nodeid, struct.pack("<IIQQQQQQIIIIIIII", valid, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                               0, 0, 0))

    def setattr_mtime(self, nodeid: int, sec: int) -> bytes:
        valid = 1 << 4 | 1 << 5  # FATTR_ATIME | FATTR_MTIME
        return self.req(4, nodeid, struct.pack("<IIQQQQQQIIIIIIII", valid, 0, 0, 0, 0, sec, sec, 0, 0, 0, 0, 0, 0,
                                               0, 0, 0))

    def unlink(self, parent: int, name: bytes) -> bytes:
        return self.req(10, parent, name + b"\0")

    def forget(self, nodeid: int, n: int) -> bytes:
        return self.req(2, nodeid, struct.pack("<Q", n))

    def opendir(self, nodeid: int) -> bytes:
        return self.req(27, nodeid, struct.pack("<II", os.O_RDONLY | os.O_DIRECTORY, 0))

    def readdirplus(self, nodeid: int, fh: int, offset: int) -> bytes:
        return self.req(44, nodeid, struct.pack("<QQIIQII", fh, offset, READDIR_BYTES, 0, 0, os.O_RDONLY, 0))

    def releasedir(self, nodeid: int, fh: int) -> bytes:
        return self.req(29, nodeid, struct.pack("<QIIQ", fh, os.O_RDONLY, 0, 0))

    def rmdir(self, parent: int, name: bytes) -> bytes:
        return self.req(11, parent, name + b"\0")


def last_offset(reply: bytes) -> int | None:
    """The offset of a READDIRPLUS reply's last entry (its header skipped), None if empty."""
    pos, off = 16, None
    while pos < len(reply):
        _ino, off, namelen, _type = struct.unpack_from("<QQII", reply, pos + ENTRY_OUT_BYTES)
        pos += ENTRY_OUT_BYTES + (24 + namelen + 7) // 8 * 8
    return off


def dispatcher_on(work: str, state: str, no_open: bool = True):
    """``(workspace, dispatcher, call)`` over ``work``, intercepted and watched as ``sandbox
    mount`` runs it (``no_open``: coherent, no OPEN/RELEASE); ``call(raw)`` decodes the
    kernel's request bytes, submits them and returns ``(errno or None, reply bytes)``."""
    from sandbox.fuse.codec import decode_request
    from sandbox.fuse.dispatcher import Dispatcher
    from sandbox.fuse.transport import reply_bytes
    from sandbox.limits import ServerLimits
    from sandbox.mounts import Provider
    from sandbox.serving import Export, HoldBroker
    from sandbox.serving.workspaces import open_workspace

    ws, _own = open_workspace(work, watched=True, state_dir=state)
    limits = ServerLimits()
    d = Dispatcher(Export(Provider.intercepted(ws), HoldBroker(), limits), limits)
    d.no_open_allowed = d.coherent = no_open
    replies: list = []

    def send(unique, reply, error):
        replies.append((error, reply_bytes(unique, reply, error)))

    def call(raw: bytes):
        del replies[:]
        d.submit(decode_request(memoryview(raw).toreadonly()), len(raw), send)
        return replies[0] if replies else (None, b"")

    return ws, d, call


def run_once(files: int, base: str, profile: str | None, marks: bool = False) -> dict:
    """One full run in a fresh folder: per phase, CPU and wall µs per file, and per opcode
    the wall µs per request."""
    from sandbox.fuse import abi

    work, state = os.path.join(base, "work"), os.path.join(base, "state")
    os.makedirs(work)
    ws, d, call = dispatcher_on(work, state)  # what a /dev/fuse mount with its watcher runs
    w = Wire()

    err, _ = call(w.init(0xFFFFFFFF & ~abi.FUSE_INIT_RESERVED, 0xFFFFFFFF))
    assert err is None and d.no_open, (err, d.no_open)
    dirs = []
    for i in range(DIRS):
        os.mkdir(os.path.join(work, f"d{i:02d}"))
    for i in range(DIRS):
        err, out = call(w.lookup(abi.FUSE_ROOT_ID, f"d{i:02d}".encode()))
        assert err is None, err
        dirs.append(struct.unpack_from("<Q", out, 16)[0])
    names = [(dirs[i % DIRS], f"f{i:05d}".encode()) for i in range(files)]
    nodes: list[int] = []
    ops: dict[str, list[int]] = collections.defaultdict(list)
    cpu_ops: dict[str, list[int]] = collections.defaultdict(list)
    result: dict = {"phases": {}, "ops": {}, "cpu_ops": {}}

    def timed(op: str, raw: bytes, ok=(None,)):
        c, t = time.thread_time_ns(), time.perf_counter_ns()
        err, out = call(raw)
        ops[op].append(time.perf_counter_ns() - t)
        cpu_ops[op].append(time.thread_time_ns() - c)
        if err is not None and err.errno not in ok:
            raise SystemExit(f"{op}: {err!r}")
        return out

    def create():
        for parent, name in names:
            timed("LOOKUP-", w.lookup(parent, name), ok=(None, 2))
            timed("GETATTR", w.getattr(parent))
            out = timed("CREATE", w.create(parent, name))
            nodeid = struct.unpack_from("<Q", out, 16)[0]
            nodes.append(nodeid)
            timed("GETXATTR", w.getxattr(nodeid, b"security.capability"), ok=(61,))
            timed("WRITE", w.write(nodeid, DATA))
            timed("RELEASE", w.release(nodeid))

    def stat():
        for nodeid in nodes:
            timed("GETATTR", w.getattr(nodeid))

    def read():
        for nodeid in nodes:
            timed("READ", w.read(nodeid, 4096))

    def git():
        for (parent, name), nodeid in zip(names, nodes):
            timed("LOOKUP+", w.lookup(parent, name))
            timed("GETATTR", w.getattr(nodeid))
            timed("SETATTR", w.setattr_mtime(nodeid, 1_700_000_000))
            call(w.forget(nodeid, 1))  # the lookup's count back: one per node stays

    def freshen():
        for _ in nodes:
            timed("SETATTR", w.setattr_now(nodes[0]))

    def readdir():
        for nodeid in dirs:
            fh = struct.unpack_from("<Q", timed("OPENDIR", w.opendir(nodeid)), 16)[0]
            offset = 0
            while (offset := last_offset(timed("READDIRPLUS", w.readdirplus(nodeid, fh, offset)))) is not None:
                pass
            timed("RELEASEDIR", w.releasedir(nodeid, fh))

    def rm():
        for (parent, name), nodeid in zip(names, nodes):
            timed("GETATTR", w.getattr(parent))
            timed("UNLINK", w.unlink(parent, name))
            timed("FORGET", w.forget(nodeid, 2))  # the git phase's lookup and readdir's

    def rmdir():
        for i, nodeid in enumerate(dirs):
            timed("GETATTR", w.getattr(abi.FUSE_ROOT_ID))
            timed("RMDIR", w.rmdir(abi.FUSE_ROOT_ID, f"d{i:02d}".encode()))
            timed("FORGET", w.forget(nodeid, 1))

    for phase, fn in zip(PHASES, (create, stat, read, git, freshen, readdir, rm, rmdir)):
        ws.close_active()
        if marks:
            os.path.lexists(f"/fuse-requests-phase-{phase}")  # a marker line for strace  # each phase its own step, as an idle mount's ambient steps close between them
        ops.clear()
        cpu_ops.clear()
        prof = None
        if profile == phase:
            import cProfile

            prof = cProfile.Profile(time.thread_time)  # CPU time: the machine's load does not count
            prof.enable()
        c, t = time.process_time(), time.perf_counter()
        fn()
        c, t = time.process_time() - c, time.perf_counter() - t
        if prof is not None:
            import pstats

            prof.disable()
            for key in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=sys.stderr).sort_stats(key).print_stats(35)
        result["phases"][phase] = {"cpu_us": c / files * 1e6, "wall_us": t / files * 1e6}
        for op, ns in ops.items():
            result["ops"][f"{phase}:{op}"] = statistics.median(ns) / 1000
            result["cpu_ops"][f"{phase}:{op}"] = statistics.median(cpu_ops[op]) / 1000
    d.close()
    d.provider.close()
    ws.close()
    return result


def child(tree: str, files: int, where: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, os.path.abspath(__file__), "--files", str(files), "--json", "--repeat", "1"]
    if where:
        cmd += ["--dir", where]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{tree}: {r.stderr}")
    return json.loads(r.stdout)


def medians(runs: list[dict]) -> dict:
    out: dict = {"phases": {}, "ops": {}, "cpu_ops": {}}
    for phase in runs[0]["phases"]:
        out["phases"][phase] = {k: statistics.median(r["phases"][phase][k] for r in runs)
                                for k in ("cpu_us", "wall_us")}
    for key in ("ops", "cpu_ops"):
        for op in runs[0][key]:
            out[key][op] = statistics.median(r[key][op] for r in runs if op in r[key])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3, help="rounds (medians are printed)")
    ap.add_argument("--other", help="another checkout to run side by side (its PYTHONPATH)")
    ap.add_argument("--profile", choices=PHASES, help="cProfile this phase in this process, in the thread's CPU time; stderr, by own then cumulative time")
    ap.add_argument("--dir", help="where to make the temporary folders (also the --other runs'; a tmpfs such as "
                                  "/dev/shm keeps the disk's own time out of the figures)")
    ap.add_argument("--marks", action="store_true",
                    help="in this process, look up /fuse-requests-phase-PHASE before each phase (splits strace output)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args.json or args.profile or args.marks:
        runs = []
        for _ in range(args.repeat):
            base = tempfile.mkdtemp(prefix="fuse-req-", dir=args.dir)
            try:
                runs.append(run_once(args.files, base, args.profile, args.marks))
            finally:
                shutil.rmtree(base, ignore_errors=True)
        if args.json:
            print(json.dumps(medians(runs)))
            return
        sides = {"this": medians(runs)}
    else:
        trees = {"this": os.environ.get("PYTHONPATH") or here}
        if args.other:
            trees["other"] = os.path.abspath(args.other)
        runs = {k: [] for k in trees}
        for i in range(args.repeat):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for k in order:
                runs[k].append(child(trees[k], args.files, args.dir))
        sides = {k: medians(v) for k, v in runs.items()}
    this = sides["this"]
    other = sides.get("other")
    load = os.getloadavg()[0]
    print(f"{args.files} files, medians of {args.repeat} rounds, load average {load:.2f}"
          + (f"; other = {args.other}" if other else ""))
    print(f"{'phase':8} {'CPU µs/file':>12} {'wall µs/file':>13}" + (f" {'other CPU':>10} {'ratio':>6}" if other else ""))
    for phase, v in this["phases"].items():
        line = f"{phase:8} {v['cpu_us']:12.1f} {v['wall_us']:13.1f}"
        if other:
            o = other["phases"][phase]["cpu_us"]
            line += f" {o:10.1f} {v['cpu_us'] / o:6.2f}"
        print(line)
    print(f"{'request':20} {'CPU µs':>8} {'wall µs':>8}"
          + (f" {'other CPU':>10} {'ratio':>6} {'other wall':>10} {'ratio':>6}" if other else ""))
    for op, us in this["ops"].items():
        cpu = this["cpu_ops"][op]
        line = f"{op:20} {cpu:8.1f} {us:8.1f}"
        if other and op in other["ops"]:
            line += (f" {other['cpu_ops'][op]:10.1f} {cpu / other['cpu_ops'][op]:6.2f}"
                     f" {other['ops'][op]:10.1f} {us / other['ops'][op]:6.2f}")
        print(line)


if __name__ == "__main__":
    main()
