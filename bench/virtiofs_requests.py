#!/usr/bin/env python3
"""The virtio-fs device's own CPU per request, without QEMU: what ``sandbox.fuse.virtiofs``
adds to the dispatcher for one request (issue 17).

A guest driver written here puts each request in a split ring over a memfd (queue size 1024,
event index, one readable and one writable descriptor, as Linux's driver does for a small
request), kicks the ring's eventfd and consumes the call; the server's wake-up
(``VirtioFsServer._kicked``: the kick eventfd read, the ring drained with kicks off and
re-armed, the chain walked, the request decoded and dispatched, the reply written into guest
memory, the used entry pushed, the call eventfd written) is timed in thread CPU time. The
same requests are also run straight through ``Dispatcher.submit`` + ``reply_bytes`` (what
``bench/fuse_requests.py`` measures), so ``device - direct`` is this device's part; the
asyncio loop's turn (``epoll_wait``, the callback) is not included.

The mount is what a session's virtio-fs share runs: intercepted, not coherent, OPEN/RELEASE
(no no-open). One request per wake-up, as a guest's single program issues them. After the
LOOKUP/GETATTR/GETXATTR/OPEN/READ/RELEASE of each file, the ``rm -rf`` mix: a directory of
``--files`` files and a tenth as many empty directories listed (OPENDIR, READDIRPLUS pages,
RELEASEDIR), then per file a GETATTR of the directory (``rm GETATTR``), UNLINK and FORGET,
per empty directory RMDIR and FORGET — in a step of its own (each UNLINK takes a preimage).

    .venv/bin/python bench/virtiofs_requests.py [--files 500] [--repeat 3]

Prints, per opcode, the median CPU µs per request through the device and directly, and the
difference. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuse_requests import Wire, last_offset  # noqa: E402  (the kernel's request bytes)

MEM = 4 << 20
GPA, UVA = 0x1_0000_0000, 0x7F12_0000_0000
QSIZE = 1024
DESC_AT, AVAIL_AT, USED_AT = 0x0, 0x4000, 0x5000
REQ_AT, REPLY_AT = 0x10000, 0x20000
REPLY_ROOM = 0x10000


class Ring:
    """The driver side of one split ring (event index on)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.avail = 0
        self.seen = 0

    def offer(self, raw: bytes) -> None:
        os.pwrite(self.fd, raw, REQ_AT)
        head = (2 * self.avail) % QSIZE
        d = struct.pack("<QIHH", GPA + REQ_AT, len(raw), 1, (head + 1) % QSIZE) \
            + struct.pack("<QIHH", GPA + REPLY_AT, REPLY_ROOM, 2, 0)
        os.pwrite(self.fd, d, DESC_AT + 16 * head)
        os.pwrite(self.fd, struct.pack("<H", head), AVAIL_AT + 4 + 2 * (self.avail % QSIZE))
        self.avail = (self.avail + 1) & 0xFFFF
        os.pwrite(self.fd, struct.pack("<H", self.avail), AVAIL_AT + 2)
        os.pwrite(self.fd, struct.pack("<H", self.seen), AVAIL_AT + 4 + 2 * QSIZE)  # used_event: call at the next

    def reply(self) -> bytes:
        idx = struct.unpack("<H", os.pread(self.fd, 2, USED_AT + 2))[0]
        assert idx == (self.seen + 1) & 0xFFFF, (idx, self.seen)
        _head, n = struct.unpack("<II", os.pread(self.fd, 8, USED_AT + 4 + 8 * (self.seen % QSIZE)))
        self.seen = idx
        return os.pread(self.fd, n, REPLY_AT)


def run_once(files: int, base: str) -> dict[str, dict[str, float]]:
    from sandbox.fuse import abi
    from sandbox.fuse import vhost as v
    from sandbox.fuse.codec import decode_request
    from sandbox.fuse.dispatcher import Dispatcher
    from sandbox.fuse.transport import reply_bytes
    from sandbox.fuse.virtiofs import Device, VirtioFsServer
    from sandbox.fuse.virtqueue import GuestMemory, Virtqueue
    from sandbox.limits import ServerLimits
    from sandbox.mounts import Provider
    from sandbox.serving import Export, HoldBroker
    from sandbox.serving.workspaces import open_workspace

    work, state = os.path.join(base, "work"), os.path.join(base, "state")
    os.makedirs(work)
    names = [f"f{i:05d}".encode() for i in range(files)]
    for name in names:
        with open(os.path.join(work, name.decode()), "wb") as f:
            f.write(b"x" * 1024)
    ws, _own = open_workspace(work, watched=False, state_dir=state)
    provider = Provider.intercepted(ws)
    limits = ServerLimits()
    export = Export(provider, HoldBroker(), limits)
    w = Wire()

    # the device side: a server whose dispatcher serves queue 1 of a memfd "guest"
    gfd = os.memfd_create("guest-ram")
    os.ftruncate(gfd, MEM)
    server = VirtioFsServer(lambda: Dispatcher(export, limits), limits, poll_interval_s=None)
    loop = asyncio.new_event_loop()
    server._loop = loop
    server._new_dispatcher()
    server.device = Device()
    mem = GuestMemory.map(v.MemTable((v.MemRegion(GPA, MEM, UVA, 0),)), [os.dup(gfd)])
    ring = server.device.rings[1]
    ring.num = QSIZE
    ring.vq = Virtqueue(mem, QSIZE, UVA + DESC_AT, UVA + AVAIL_AT, UVA + USED_AT, event_idx=True, indirect=True)
    ring.kick = os.eventfd(0, os.EFD_NONBLOCK)
    ring.call = os.eventfd(0, os.EFD_NONBLOCK)
    guest = Ring(gfd)

    def via_device(raw: bytes) -> bytes:
        guest.offer(raw)
        os.eventfd_write(ring.kick, 1)
        t = time.thread_time_ns()
        server._kicked(ring)
        dt = time.thread_time_ns() - t
        os.eventfd_read(ring.call)
        out = guest.reply()
        samples[current].append(dt)
        return out

    # the direct side: the same requests straight into a dispatcher
    direct = Dispatcher(export, limits)
    got: list = []

    def via_dispatcher(raw: bytes) -> bytes:
        t = time.thread_time_ns()
        direct.submit(decode_request(memoryview(raw).toreadonly()), len(raw),
                      lambda u, r, e: got.append(reply_bytes(u, r, e)))
        dt = time.thread_time_ns() - t
        samples[current].append(dt)
        return got.pop() if got else b""  # FORGET: no reply

    def workload(call, side: str) -> None:
        nonlocal current
        current = f"{side}:INIT"
        assert struct.unpack_from("<i", call(w.init(0xFFFFFFFF & ~abi.FUSE_INIT_RESERVED, 0xFFFFFFFF)), 4)[0] == 0
        nodes = []
        for name in names:
            current = f"{side}:LOOKUP"
            out = call(w.lookup(abi.FUSE_ROOT_ID, name))
            nodes.append(struct.unpack_from("<Q", out, 16)[0])
        for op, make in (("GETATTR", w.getattr), ("GETXATTR", lambda n: w.getxattr(n, b"security.capability"))):
            current = f"{side}:{op}"
            for nodeid in nodes:
                call(make(nodeid))
        for nodeid in nodes:
            current = f"{side}:OPEN"
            out = call(w.req(14, nodeid, struct.pack("<II", os.O_RDONLY, 0)))
            fh = struct.unpack_from("<Q", out, 16)[0]
            current = f"{side}:READ"
            call(w.req(15, nodeid, struct.pack("<QQIIQII", fh, 0, 4096, 0, 0, os.O_RDONLY, 0)))
            current = f"{side}:RELEASE"
            call(w.req(18, nodeid, struct.pack("<QIIQ", fh, os.O_RDONLY, 0, 0)))
        rm_mix(call, side)

    def rm_mix(call, side: str) -> None:
        """What ``rm -rf`` sends (docs/virtiofs.md "What the guest asks"), in its own step on
        files made beside the mount (so each UNLINK takes a preimage): a directory of
        ``files`` files and ``files // 10`` empty directories is listed (OPENDIR,
        READDIRPLUS until empty, RELEASEDIR), then each file gets a GETATTR of the directory,
        its UNLINK and FORGET, and each empty directory its RMDIR and FORGET."""
        nonlocal current
        top = f"rm-{side}"
        os.mkdir(os.path.join(work, top))
        for name in names:
            with open(os.path.join(work, top, name.decode()), "wb") as f:
                f.write(b"y" * 1024)
        empties = [f"e{j:04d}".encode() for j in range(max(1, len(names) // 10))]
        for e in empties:
            os.mkdir(os.path.join(work, top, e.decode()))
        current = f"{side}:-"
        d = struct.unpack_from("<Q", call(w.lookup(abi.FUSE_ROOT_ID, top.encode())), 16)[0]
        kids = {n: struct.unpack_from("<Q", call(w.lookup(d, n)), 16)[0] for n in [*names, *empties]}
        ws.close_active()  # the listing and removals in a step of their own, as after an idle mount
        current = f"{side}:OPENDIR"
        fh = struct.unpack_from("<Q", call(w.opendir(d)), 16)[0]
        offset = 0
        while True:
            current = f"{side}:READDIRPLUS"
            offset = last_offset(call(w.readdirplus(d, fh, offset)))
            if offset is None:
                break
        current = f"{side}:RELEASEDIR"
        call(w.releasedir(d, fh))
        for name in names:
            current = f"{side}:rm GETATTR"
            call(w.getattr(d))
            current = f"{side}:UNLINK"
            assert struct.unpack_from("<i", call(w.unlink(d, name)), 4)[0] == 0
            current = f"{side}:FORGET"
            call(w.forget(kids[name], 2))  # the lookup's and the listing's
        for e in empties:
            current = f"{side}:RMDIR"
            assert struct.unpack_from("<i", call(w.rmdir(d, e)), 4)[0] == 0
            current = f"{side}:FORGET"
            call(w.forget(kids[e], 2))

    samples: dict[str, list[int]] = collections.defaultdict(list)
    current = ""
    workload(via_device, "device")
    workload(via_dispatcher, "direct")
    server.dispatcher.close()
    direct.close()
    server.device.reset()
    mem.close()
    os.close(gfd)
    loop.close()
    provider.close()
    ws.close()
    return {k: statistics.median(ns) / 1000 for k, ns in samples.items() if not k.endswith((":INIT", ":-"))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=500)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    runs = []
    for _ in range(args.repeat):
        base = tempfile.mkdtemp(prefix="sandbox-bench-vfsreq-")
        try:
            runs.append(run_once(args.files, base))
        finally:
            shutil.rmtree(base, ignore_errors=True)
    ops = sorted({k.split(":", 1)[1] for r in runs for k in r})
    print(f"CPU µs per request (thread time, median of {args.files} per run, median of {args.repeat} runs)")
    print(f"{'request':10} {'device':>8} {'direct':>8} {'device part':>12}")
    for op in ops:
        dev = statistics.median(r[f"device:{op}"] for r in runs)
        dire = statistics.median(r[f"direct:{op}"] for r in runs)
        print(f"{op:10} {dev:8.1f} {dire:8.1f} {dev - dire:12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
