#!/usr/bin/env python3
"""Benchmark: a real guest's work on our 9P server vs on QEMU's built-in 9p, side by side.

Run ``python bench/guest_9p.py --help``. Prints numbers and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

try:
    import sandbox  # noqa: F401
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox.fuse import messages as fm
from sandbox.fuse.dispatcher import Dispatcher
from sandbox.fuse.virtiofs import VirtioFsServer, VirtioFsThread
from sandbox.guest.control import VIRTIOFS_READ_AHEAD_KB
from sandbox.hostfs.real import RealHostFS
from sandbox.limits import ServerLimits
from sandbox.mounts import Provider
from sandbox.ninep.server import NinePServer, ServerThread
from sandbox.serving import Export, HoldBroker
from sandbox.vm import image as vm_image
from sandbox.vm.qemu import VmConfig, build_command, probe_accel
from sandbox.session.runtime import open_workspace, watch_workspace

DESCRIPTION = """\
Boot Debian's kernel in QEMU (sandbox.vm.image; TCG unless you change accel) with the
host's userland read-only as the guest's (QEMU's built-in 9p + a tmpfs overlay, as
SPEC §5 describes), and time one workload in the guest on a fresh copy of the sample
project, mounted two ways (cache=none, msize 512 KiB both):

  ours  sandbox.ninep.server, intercepted (undo log on), over trans=tcp through QEMU
        guestfwd to the server's unix socket — how sessions mount working folders
  plain the same server and transport with interception off (no undo log): ours/plain
        is the cost of undo, plain/qemu the cost of our server + the guestfwd transport
  qemu  QEMU's built-in virtio-9p (-virtfs local, security_model=none), in-process C,
        no interception — the reference
  watched  ours plus the external-modification watcher a session runs by default (the
        own-write journal: an lstat after each mutation; inotify events classified):
        watched/ours is its cost
  diod  Debian's C 9P2000.L server (package diod) behind the same guestfwd transport
        as ours, no interception — the transport held equal (skipped if not installed)
  vfs   ours over virtio-fs (sandbox.fuse.virtiofs, intercepted; QEMU vhost-user-fs-pci,
        guest RAM a shared memfd) — how sessions will mount working folders (issue 17)
  vfs-cached  vfs with every open cached (Dispatcher.direct_io_write_only pinned off): how vfs
        opened files before write-only opens got direct I/O — vfs/vfs-cached is that change
        (not run unless named in BENCH_SIDES)
  vfs-direct  vfs with every open direct I/O (serve-virtiofs --direct-io all, a session's
        virtiofs_direct_io="all"): virtiofsd cache=none's caching, shared mmap refused (ENODEV)
        in the 6.1 guest — vfs-direct/virtiofsd is the server with the caching held equal
        (not run unless named in BENCH_SIDES)
  virtiofsd  QEMU's C virtiofsd (/usr/lib/qemu/virtiofsd, cache=none, sandbox=chroot),
        no interception — the virtio-fs reference (skipped if not installed); cache=none
        opens every file FOPEN_DIRECT_IO (no guest page cache) with 0 s timeouts
  virtiofsd-auto  the same with its default cache=auto: 1 s timeouts and the guest's page
        cache dropped at each open — the caching vfs uses for every open that may read
  Every virtio-fs side's device has queues of 1024 entries (sandbox.vm.qemu.VIRTIOFS_QUEUE_SIZE,
  as sessions: 1 MiB requests); only the vfs sides' mounts read ahead 1 MiB (VIRTIOFS_READ_AHEAD_KB, set
  as sandbox/guest/init.sh sets it for sessions), the virtiofsd sides keep Linux's 128 KiB

Phases (timed inside the guest with `date +%s%N`): create N small files; read them
back; `git init && git add -A && git commit`; write a 32 MiB file with dd (1 MiB
blocks); read it back; the same two on the guest's own tmpfs (tmpfsW32M, tmpfsR32M: the
guest's page-cache copies alone, the floor of every side that caches; not in the total);
`rm -rf` everything; "server cpu" is the CPU seconds the file
server used during the boot (ours: this process; diod/virtiofsd: theirs; qemu's 9p runs
inside QEMU: not measured); "boot (uptime)" the guest's uptime at its first output. Median
of --repeat boots per side, alternating sides; the host's load average is printed too (the
machine may be shared). For vfs, the guest marks each phase with a LOOKUP of
".bench-phase-NAME" (every side runs the same script): --counts prints the FUSE requests
of each phase by opcode and the server thread's CPU seconds per phase; --profile FILE
profiles the vfs server thread (cProfile in the thread's CPU time, not wall time: the idle
epoll waits and host calls blocked on the disk are left out; slows it: not for timing). Under TCG the guest CPU is emulated, so absolute numbers are low and
ratios understate the server's share; on KVM hosts run it again.
"""

INIT = r"""
mkdir -p /host /upper /merged
mount -t 9p -o trans=virtio,version=9p2000.L,ro hostroot /host || echo MOUNT-FAILED
mount -t tmpfs tmpfs /upper
mkdir -p /upper/u /upper/w
mount -t overlay overlay -o lowerdir=/host,upperdir=/upper/u,workdir=/upper/w /merged || echo MOUNT-FAILED
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
mkdir -p /merged/mnt/work
opts=version=9p2000.L,cache=none,msize=524288
aname=$(tr ' ' '\n' < /proc/cmdline | sed -n 's/^sbx_aname=//p')
if grep -q sbx_work=vfs /proc/cmdline; then
  mount -t virtiofs work /merged/mnt/work || echo MOUNT-FAILED
  ra=$(tr ' ' '\n' < /proc/cmdline | sed -n 's/^sandbox.vfs_ra_kb=//p')
  if [ -n "$ra" ]; then  # as sandbox/guest/init.sh does for a session's virtio-fs shares
    BDI_NAME
    echo "$ra" > /sys/class/bdi/$(bdi_name "$(stat -c %d /merged/mnt/work)")/read_ahead_kb || echo MOUNT-FAILED
  fi
elif grep -q sbx_work=ours /proc/cmdline; then
  mount -t 9p -o trans=tcp,port=564,uname=root,$opts${aname:+,aname=$aname} 10.0.2.100 /merged/mnt/work || echo MOUNT-FAILED
else
  mount -t 9p -o trans=virtio,$opts work /merged/mnt/work || echo MOUNT-FAILED
fi
mount -t proc proc /merged/proc
mount -t devtmpfs dev /merged/dev
mount -t tmpfs tmp /merged/tmp
cp /bench.sh /merged/tmp/bench.sh
chroot /merged /bin/sh -c 'cd /mnt/work && HOME=/tmp sh /tmp/bench.sh' 2>&1
umount /merged/mnt/work
poweroff -f
"""

WORKLOAD = r"""
echo "BOOTED $(cut -d' ' -f1 /proc/uptime)"
t() { date +%s%N; }
phase() { echo "PHASE $1 $(( $(t) - $2 ))"; }
g() { git -c user.email=b@example.com -c user.name=bench "$@"; }
mark() { test -e .bench-phase-$1; }  # a LOOKUP the server can see: where --counts starts the phase
mark create; s=$(t); mkdir many; i=0; while [ $i -lt NFILES ]; do echo "file $i" > many/f$i; i=$((i+1)); done; phase create $s
mark read; s=$(t); cat many/* > /dev/null; phase read $s
mark git; s=$(t); g init -q . && g add -A && g commit -qm bench; phase git $s
mark write32M; s=$(t); dd if=/dev/zero of=big bs=1M count=32 2>/dev/null; phase write32M $s
mark read32M; s=$(t); dd if=big of=/dev/null bs=1M 2>/dev/null; phase read32M $s
s=$(t); dd if=/dev/zero of=/tmp/floor bs=1M count=32 2>/dev/null; phase tmpfsW32M $s
s=$(t); dd if=/tmp/floor of=/dev/null bs=1M 2>/dev/null; phase tmpfsR32M $s; rm -f /tmp/floor
mark rm; s=$(t); rm -rf ./* .git; phase rm $s
mark end
echo BENCH-DONE
"""


VIRTIOFSD = "/usr/lib/qemu/virtiofsd"
VIRTIOFS_SIDES = ("vfs", "vfs-cached", "vfs-direct", "virtiofsd", "virtiofsd-auto")
MEMORY_MB = 1024
PHASES = ("create", "read", "git", "write32M", "read32M", "rm")
#: the ratio columns printed when both sides ran
RATIOS = [("ours", "plain"), ("plain", "qemu"), ("ours", "qemu"), ("watched", "ours"), ("plain", "diod"),
          ("ours", "diod"), ("vfs", "virtiofsd"), ("vfs", "virtiofsd-auto"), ("vfs", "qemu"), ("vfs", "ours"),
          ("vfs", "vfs-cached"), ("vfs-cached", "virtiofsd"), ("vfs-direct", "virtiofsd")]


class PhaseCounts:
    """The vfs server's requests by opcode and its thread's CPU seconds, per guest phase (split
    at the guest's ``.bench-phase-NAME`` LOOKUPs; called on the server's thread)."""

    MARK = b".bench-phase-"

    def __init__(self):
        self.phase = "mount"
        self.counts: dict[str, collections.Counter] = {}
        self.cpu: dict[str, float] = {}
        self._t0 = time.thread_time()

    def see(self, req) -> None:
        if type(req) is fm.Lookup and req.name.startswith(self.MARK):
            now = time.thread_time()
            self.cpu[self.phase] = self.cpu.get(self.phase, 0.0) + now - self._t0
            self._t0 = now
            self.phase = req.name[len(self.MARK):].decode()
        self.counts.setdefault(self.phase, collections.Counter())[req.OPCODE.name] += 1


def _counting(export, limits, phases: PhaseCounts):
    class CountingDispatcher(Dispatcher):
        def submit(self, req, size, send):
            phases.see(req)
            return super().submit(req, size, send)
    return lambda: CountingDispatcher(export, limits)


class CachedDispatcher(Dispatcher):
    """The ``vfs-cached`` side: :attr:`Dispatcher.direct_io_write_only` stays off whatever the
    device server sets, so every open keeps the guest's page cache."""

    direct_io_write_only = property(lambda self: False, lambda self, value: None)


def run(side: str, image, base: str, sample: str, accel, phases: PhaseCounts | None = None,
        profile: cProfile.Profile | None = None) -> dict[str, float]:
    work = tempfile.mkdtemp(prefix=f"{side}-", dir=base)
    shutil.rmtree(work)
    shutil.copytree(sample, work, symlinks=True)
    sock = os.path.join(base, "9p.sock")
    virtio_fs = side in VIRTIOFS_SIDES
    kind = "vfs" if virtio_fs else "qemu" if side == "qemu" else "ours"
    extra = ["-virtfs", f"local,path={work},mount_tag=work,security_model=none"] if side == "qemu" else []
    cfg = VmConfig(kernel=image.vmlinuz, initrd=image.initrd, memory_mb=MEMORY_MB, host_root=True,
                   accel=accel.accel, cpu=accel.cpu,
                   append=f"sbx_work={kind}" + (f" sbx_aname={work}" if side == "diod" else "")
                   + (f" sandbox.vfs_ra_kb={VIRTIOFS_READ_AHEAD_KB}" if side in ("vfs", "vfs-cached", "vfs-direct") else ""),
                   guestfwds=[(564, sock)] if kind == "ours" else [], extra=extra,
                   virtiofs=[("work", sock)] if virtio_fs else [])
    cmd = build_command(cfg)
    ws = None
    cpu = float("nan")
    try:
        if side in ("virtiofsd", "virtiofsd-auto"):
            cache = "cache=none" if side == "virtiofsd" else "cache=auto"
            p, cpu = _beside_daemon([VIRTIOFSD, f"--socket-path={sock}", "-o", f"source={work}", "-o", cache,
                                     "-o", "sandbox=chroot", "-o", "log_level=err"], sock, cmd)
        elif side in ("vfs", "vfs-cached", "vfs-direct"):
            ws, _own = open_workspace(work, watched=False, state_dir=work + ".state")
            provider = Provider.intercepted(ws)
            limits = ServerLimits()
            export = Export(provider, HoldBroker(), limits)
            dispatcher_class = CachedDispatcher if side == "vfs-cached" else Dispatcher
            make = _counting(export, limits, phases) if phases is not None else lambda: dispatcher_class(export, limits)
            t0 = _self_cpu_s()
            direct_io = "all" if side == "vfs-direct" else "write-only"
            with VirtioFsThread(VirtioFsServer(make, limits, direct_io=direct_io), sock) as th:
                if profile is not None:
                    th.call(profile.enable)  # on the server's thread
                p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
                if profile is not None:
                    th.call(profile.disable)
            cpu = _self_cpu_s() - t0
            provider.close()
        elif side == "diod":
            p, cpu = _beside_daemon(["diod", "-f", "-n", "-N", "-u", str(os.getuid()), "-e", work, "-l", sock,
                                     "-L", os.path.join(base, "diod.log")], sock, cmd)
        elif side in ("ours", "plain", "watched"):
            detector = None
            if side in ("ours", "watched"):
                ws, own_writes = open_workspace(work, watched=side == "watched", state_dir=work + ".state")
                provider = Provider.intercepted(ws)
                if side == "watched":
                    detector = watch_workspace(own_writes, work)  # logs anything it (wrongly) finds
            else:
                provider = Provider(RealHostFS(work), None, read_only=False)
            try:
                t0 = _self_cpu_s()
                with ServerThread(NinePServer(provider), unix_path=sock):
                    p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
                cpu = _self_cpu_s() - t0
            finally:
                if detector is not None:
                    detector.stop()
            provider.close()
        else:
            p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    finally:
        if ws is not None:
            ws.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(work + ".state", ignore_errors=True)
    out = p.stdout.replace("\r", "")
    if "BENCH-DONE" not in out or "MOUNT-FAILED" in out:
        log = ""
        if side == "diod" and os.path.exists(os.path.join(base, "diod.log")):
            with open(os.path.join(base, "diod.log")) as f:
                log = "\ndiod log:\n" + f.read()[-2000:]
        raise SystemExit(f"guest run ({side}) failed:\n{out[-3000:]}\n{p.stderr[-1000:]}{log}")
    res = {name: int(ns) / 1e9 for name, ns in re.findall(r"PHASE (\S+) (\d+)", out)}  # console noise may precede
    booted = re.search(r"BOOTED ([0-9.]+)", out)
    if booted:
        res["boot (uptime)"] = float(booted.group(1))
    res["server cpu"] = cpu
    return res


def _init_sh_bdi_name() -> str:
    """The session guest's ``bdi_name`` shell function (sandbox/guest/init.sh), reused here."""
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sandbox", "guest",
                           "init.sh")) as f:
        fn = re.search(r"^bdi_name\(\) \{.*\}$", f.read(), re.M)
    if fn is None:
        raise SystemExit("sandbox/guest/init.sh no longer defines bdi_name()")
    return fn.group(0)


def _self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime



def _beside_daemon(argv: list[str], sock: str, cmd: list[str]):
    """Run the reference server ``argv`` (it creates ``sock`` as it starts), then the guest
    ``cmd`` against it: ``(completed process, the server's CPU seconds)``."""
    d = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        for _ in range(200):  # wait for its socket
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
        return p, _proc_cpu_s(d.pid)
    finally:
        d.terminate()
        d.wait(10)
        if os.path.exists(sock):
            os.unlink(sock)

def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a live process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=500, help="small files to create (default 500)")
    p.add_argument("--repeat", type=int, default=3, help="boots per side; medians are reported (default 3)")
    p.add_argument("--counts", action="store_true", help="vfs: FUSE requests by opcode and server CPU per phase")
    p.add_argument("--profile", metavar="FILE", help="vfs: cProfile the server thread into FILE (not for timing)")
    args = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    image = vm_image.build_initramfs(vm_image.fetch_kernel(), INIT.replace("BDI_NAME", _init_sh_bdi_name()),
                                     modules=vm_image.NINEP_MODULES + ("9pnet_virtio", "overlay", "virtiofs", "fuse"),
                                     files={"bench.sh": WORKLOAD.replace("NFILES", str(args.files)).encode()})
    base = tempfile.mkdtemp(prefix="sandbox-bench-guest-")
    sides = ("ours", "plain", "qemu", "watched") + (("diod",) if shutil.which("diod") else ()) + ("vfs",) \
        + (("virtiofsd", "virtiofsd-auto") if os.access(VIRTIOFSD, os.X_OK) else ())
    if os.environ.get("BENCH_SIDES"):
        sides = tuple(os.environ["BENCH_SIDES"].split(","))
    if "diod" not in sides:
        print("diod is not installed (apt-get install diod): its column is left out", file=sys.stderr)
    accel = probe_accel(image)
    print(f"accelerator: {accel.accel} ({accel.reason})", file=sys.stderr)
    res: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    phases = [] if args.counts else None
    profile = cProfile.Profile(time.thread_time) if args.profile else None  # CPU time: not the idle epoll waits
    loads = [os.getloadavg()[0]]
    try:
        for r in range(args.repeat):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                print(f"boot {r + 1}/{args.repeat}: {side} …", file=sys.stderr, flush=True)
                pc = PhaseCounts() if phases is not None and side == "vfs" else None
                for k, v in run(side, image, base, os.path.join(here, "sandbox", "data", "sample-project"), accel,
                                pc, profile if side == "vfs" else None).items():
                    res[side].setdefault(k, []).append(v)
                if pc is not None:
                    phases.append(pc)
                loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"guest workload ({accel.accel}), seconds, median of {args.repeat}; {args.files} small files; "
          f"host load average (1 min) after each boot: min {min(loads):.2f}, median {statistics.median(loads):.2f}, "
          f"max {max(loads):.2f} on {os.cpu_count()} CPUs")
    for side in sides:  # the workload's total: the sum of the phases (boot and server CPU apart)
        runs = len(next(iter(res[side].values())))
        res[side]["total"] = [sum(v[i] for k, v in res[side].items() if k in PHASES) for i in range(runs)]
    med = {side: {k: statistics.median(v) for k, v in res[side].items()} for side in sides}
    ratios = [(a, b) for a, b in RATIOS if a in sides and b in sides]
    cols = list(sides) + [f"{a}/{b}" for a, b in ratios]
    width = max(15, *(len(c) + 2 for c in cols))  # every heading apart from its neighbours
    print(f"{'phase':14}" + "".join(f"{c:>{width}}" for c in cols))
    for k in med[sides[0]]:
        row = [med[side].get(k, float("nan")) for side in sides]
        row += [med[a].get(k, float("nan")) / med[b].get(k, float("nan")) if med[b].get(k) else float("nan")
                for a, b in ratios]
        print(f"{k:14}" + "".join(f"{v:{width}.2f}" for v in row))
    report_floor(res, sides)
    if phases:
        report_phases(phases)
    if profile is not None:
        profile.dump_stats(args.profile)
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(40)
    return 0


def report_floor(res: dict[str, dict[str, list[float]]], sides) -> None:
    """The 32 MiB phases over the same dd on the guest's tmpfs in the same boot (median, min–max
    of the boots): the guest's CPU, which the host's load slows, cancels out."""
    print("\n32 MiB phases over the guest's tmpfs in the same boot (median, min-max of the boots):")
    for side in sides:
        cells = []
        for phase, floor in (("write32M", "tmpfsW32M"), ("read32M", "tmpfsR32M")):
            r = [a / b for a, b in zip(res[side].get(phase, []), res[side].get(floor, [])) if b]
            if r:
                cells.append(f"{phase}/{floor} {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")
        print(f"  {side:15} " + ", ".join(cells))


def report_phases(phases: list[PhaseCounts]) -> None:
    """Per phase (medians over the vfs boots): the server thread's CPU seconds, the requests
    and their opcodes."""
    print("\nvfs server, per phase (median of the boots): CPU seconds of its thread, FUSE requests by opcode")
    for phase in [p for p in PHASES if any(p in pc.counts for pc in phases)]:
        cpu = statistics.median(pc.cpu.get(phase, 0.0) for pc in phases)
        ops = sorted({op for pc in phases for op in pc.counts.get(phase, {})})
        med = {op: statistics.median(pc.counts.get(phase, {}).get(op, 0) for pc in phases) for op in ops}
        total = sum(med.values())
        per = f", {1e6 * cpu / total:.0f} µs/request" if total else ""
        print(f"  {phase:9} cpu {cpu:6.2f} s, {total:6.0f} requests{per}: "
              + ", ".join(f"{op} {n:.0f}" for op, n in sorted(med.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    sys.exit(main())
