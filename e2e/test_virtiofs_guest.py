"""A real Linux virtio-fs client (Debian's kernel in QEMU 7.2, ``vhost-user-fs-pci``) on our
vhost-user device server (``sandbox/fuse/virtiofs.py``): the smoke tier of issue 17.

The guest boots a busybox initramfs with ``virtiofs.ko``/``fuse.ko``, mounts the tag
``work`` (an intercepted folder served by :class:`~sandbox.fuse.virtiofs.VirtioFsServer`
in a thread) with ``mount -t virtiofs``, runs a script (writes, reads, renames, removes,
``fallocate``), prints its output and powers off. Then every step is undone and the
folder must be exactly as before.

Set ``SANDBOX_CAPTURE_VHOST=PATH`` to write the vhost-user messages QEMU sent as a fixture
(``fixtures/virtiofs/``). Skipped with the reason where QEMU, the vhost-user-fs device,
busybox-static or the Debian kernel package cannot be had.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import shutil
import subprocess
import sys
import threading
import time

import pytest

from sandbox.core.safeguard import SafeguardConfig
from sandbox.core.workspace import Workspace
from sandbox.fuse import abi
from sandbox.fuse import messages as m
from sandbox.fuse.dispatcher import Dispatcher
from sandbox.fuse.virtiofs import VirtioFsServer, VirtioFsThread
from sandbox.limits import ServerLimits
from sandbox.mounts import Provider, memory_tree
from sandbox.serving import Export, HoldBroker
from sandbox.vm import image as vm_image
from sandbox.vm.qemu import VmConfig, build_command
from sandbox_sim import oracle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
MODULES = ("virtio_pci", "virtiofs", "fuse")
MEMORY_MB = 512

INIT = r"""
mkdir -p /mnt/work
mount -t virtiofs work /mnt/work || echo "MOUNT-FAILED work"
cd /mnt/work
echo "=== BEGIN"
sh /run.sh 2>&1
echo "=== EXIT $?"
cd /
umount /mnt/work || echo "UMOUNT-FAILED"
poweroff -f
"""


@pytest.fixture(scope="module")
def image():
    """``image(script)``: the guest image that runs ``script`` (as /run.sh) on the mount."""
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (./dev setup installs qemu-system-x86)")
    devs = subprocess.run(["qemu-system-x86_64", "-device", "help"], capture_output=True, text=True).stdout
    if "vhost-user-fs-pci" not in devs:
        pytest.skip("this QEMU has no vhost-user-fs-pci device")
    try:
        kernel = vm_image.fetch_kernel()
    except vm_image.ImageError as e:
        pytest.skip(f"cannot build the guest image here: {e}")
    return lambda script: vm_image.build_initramfs(kernel, INIT, modules=MODULES, files={"run.sh": script.encode()})


def run_guest(image, tmp_path, ws: Workspace | None, script: str, decide=None, qmp: str | None = None,
              on_server=None, provider=None, dispatcher=Dispatcher) -> tuple[int, str, VirtioFsThread]:
    sock = str(tmp_path / "vfs.sock")
    image = image(script)
    cfg = VmConfig(kernel=image.vmlinuz, initrd=image.initrd, append="loglevel=3", memory_mb=MEMORY_MB,
                   virtiofs=[("work", sock)], qmp_socket=qmp)
    limits = ServerLimits()
    holds = HoldBroker()
    if decide is not None:
        holds.ask(decide)
    export = Export(provider or Provider.intercepted(ws), holds, limits)
    server = VirtioFsServer(lambda: dispatcher(export, limits), limits, capture=True)
    with VirtioFsThread(server, sock) as srv:
        if on_server is not None:
            on_server(srv)
        p = subprocess.run(build_command(cfg), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    out = p.stdout.replace("\r", "")
    assert "=== BEGIN" in out and "=== EXIT" in out, f"guest did not run the script:\n{out[-3000:]}\n{p.stderr[-2000:]}"
    assert "MOUNT-FAILED" not in out and "UMOUNT-FAILED" not in out, out[-3000:]
    body = out.split("=== BEGIN\n", 1)[1]
    text, _, rest = body.partition("=== EXIT ")
    capture = os.environ.get("SANDBOX_CAPTURE_VHOST")
    if capture:
        with open(capture, "w") as f:
            for raw, nfds in srv.server.captures[0]:
                f.write(f"{nfds} {raw.hex()}\n")
    return int(rest.split()[0]), text, srv


def test_a_real_guest_writes_over_virtiofs_and_is_undone_exactly(image, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_bytes(b"precious\n")
    (work / "src").mkdir()
    (work / "src" / "main.py").write_bytes(b"print('hi')\n")
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"))
    before = oracle.snapshot_dir(str(work))
    script = r"""
set -e
mkdir -p build/out
echo compiled > build/out/app.bin
cat build/out/app.bin
cp keep.txt build/keep.copy
mv build/keep.copy build/keep.moved
echo appended >> keep.txt
ln -s out/app.bin build/latest
readlink build/latest
dd if=/dev/zero of=build/zeros bs=65536 count=40 2>/dev/null
stat -c '%n %s' build/zeros
dd if=/dev/urandom of=build/big bs=1M count=4 2>/dev/null
echo 3 > /proc/sys/vm/drop_caches
echo "big $(md5sum < build/big | cut -d' ' -f1)"
fallocate -l 1048576 build/falloc && stat -c '%n %s' build/falloc || echo "FALLOCATE-FAILED"
rm -rf src
ls
"""
    writes: list[int] = []  # WRITE sizes, as the guest sent them

    class Recording(Dispatcher):
        def submit(self, req, size, send):
            if type(req) is m.Write:
                writes.append(req.size)
            return super().submit(req, size, send)

    status, out, srv = run_guest(image, tmp_path, ws, script, dispatcher=Recording)
    assert status == 0, out
    assert "compiled" in out and "out/app.bin" in out and "build/zeros 2621440" in out, out
    # the device's queues hold a whole 1 MiB request (qemu.VIRTIOFS_QUEUE_SIZE): `dd bs=1M` of
    # 4 MiB is 4 WRITEs of 1 MiB, not 124 + 124 + 8 pages each as with QEMU's default 128
    assert writes.count(abi.MAX_WRITE_BYTES) == 4 and max(writes) == abi.MAX_WRITE_BYTES, writes
    assert (work / "build" / "out" / "app.bin").read_bytes() == b"compiled\n"
    # 1 MiB writes and reads: the guest's largest requests (one indirect table past the queue size)
    assert f"big {hashlib.md5((work / 'build' / 'big').read_bytes()).hexdigest()}" in out, out
    assert os.path.getsize(work / "build" / "big") == 4 << 20
    assert (work / "keep.txt").read_bytes() == b"precious\nappended\n"
    assert not (work / "src").exists()
    assert "build/falloc 1048576" in out and os.path.getsize(work / "build" / "falloc") == 1 << 20, out
    names = [n for n, _ in srv.server.logs[0]]
    assert "SET_MEM_TABLE" in names and "SET_VRING_KICK" in names
    assert srv.server.requests > 10
    ws.close_active()
    ws.rollback(len(ws.history()))
    ws.close()
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "undo of a real guest's work over virtio-fs")


def test_a_reader_beside_a_write_only_writer_sees_its_bytes_and_undo_is_exact(image, tmp_path):
    """Write-only opens of a file open nowhere else are direct I/O (the guest's page cache is
    skipped; Linux 6.1's direct write drops no cached page), so: a reader opened while such a
    writer runs is direct too and reads what the writer writes after its first read; a
    writer opened beside a reader (``tail -f log`` beside ``cmd >> log``) is not direct: the
    reader caches the file's last page between the writer's appends and must read them, not
    the zeros of that page. Every step is undone exactly."""
    work = tmp_path / "work"
    work.mkdir()
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"))
    before = oracle.snapshot_dir(str(work))
    script = r"""
set -e
exec 3>w.log
printf abc >&3
exec 4<w.log
cat <&4 | tr '\000' Z; echo "|"
printf def >&3
cat <&4 | tr '\000' Z; echo "|"
exec 3>&- 4<&-
printf 123 > r.log
exec 4<r.log
cat <&4 | tr '\000' Z; echo "|"
exec 3>>r.log
printf 456 >&3
cat <&4 | tr '\000' Z; echo "|"
printf 789 >&3
cat <&4 | tr '\000' Z; echo "|"
exec 3>&- 4<&-
cat w.log r.log; echo "|"
"""
    status, out, _srv = run_guest(image, tmp_path, ws, script)
    assert status == 0, out
    lines = [line for line in out.split("\n") if line.endswith("|")]  # kernel messages may interleave
    assert lines == ["abc|", "def|", "123|", "456|", "789|", "abcdef123456789|"], out
    assert (work / "w.log").read_bytes() == b"abcdef" and (work / "r.log").read_bytes() == b"123456789"
    ws.close_active()
    ws.rollback(len(ws.history()))
    ws.close()
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "undo of a direct writer and its readers")


@pytest.mark.parametrize("answer", ["allow", "deny"])
def test_a_safeguard_hold_blocks_the_guest_until_decided(image, tmp_path, answer):
    """The 4th deletion's chain stays unanswered (the guest's rm blocks in the kernel) until
    the decision; deny rolls the step back and the guest sees EIO."""
    work = tmp_path / "work"
    victims = work / "victims"
    victims.mkdir(parents=True)
    for i in range(8):
        (victims / f"v{i}").write_bytes(b"v" * i)
    before = oracle.snapshot_dir(str(work))
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"), safeguard=SafeguardConfig(delete_threshold=4))
    seen = []

    def decide(hold):
        seen.append((hold.kind, hold.count, len(os.listdir(victims))))  # the guest is blocked right now
        return answer

    status, out, _srv = run_guest(image, tmp_path, ws, "rm -rf victims; echo rc=$?\n", decide=decide)
    assert seen == [("delete", 4, 5)], seen  # 3 deleted; the 4th waits for the answer
    if answer == "allow":
        assert not victims.exists() and "rc=0" in out, out
    else:
        assert "rc=1" in out, out
        oracle.assert_same(before, oracle.snapshot_dir(str(work)), "denied step")
    ws.close()


class SyncQmp:
    """A few QMP commands, synchronously (the hold decider runs in its own thread)."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(30)
        self.file = self.sock.makefile("rwb")
        self._read()  # the greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict:
        while True:
            msg = json.loads(self.file.readline())
            if "event" not in msg:
                return msg

    def execute(self, cmd: str) -> dict:
        self.file.write(json.dumps({"execute": cmd}).encode() + b"\n")
        self.file.flush()
        reply = self._read()
        assert "return" in reply, reply
        return reply["return"]

    def close(self):
        self.file.close()
        self.sock.close()


def test_a_held_request_survives_a_qmp_pause_of_the_guest(image, tmp_path):
    """A safeguard's QMP pause while a deletion is held: QEMU stops the device's rings
    (GET_VRING_BASE); the deletion is allowed while the VM is paused (its reply parked),
    the VM continues, the rings start where they stopped and the guest's rm completes."""
    work = tmp_path / "work"
    victims = work / "victims"
    victims.mkdir(parents=True)
    for i in range(6):
        (victims / f"v{i}").write_bytes(b"v")
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"), safeguard=SafeguardConfig(delete_threshold=4))
    qmp_path = str(tmp_path / "qmp.sock")
    server = []
    seen = []

    def rings_stopped() -> bool:
        return all(r.vq is None for r in server[0].server.device.rings[:2])

    def decide(hold):
        q = SyncQmp(qmp_path)
        try:
            q.execute("stop")  # what a session does while a hold waits
            seen.append(q.execute("query-status")["status"])
            deadline = time.monotonic() + 60
            while not server[0].call(rings_stopped):  # a condition wait on the device's state
                assert time.monotonic() < deadline, "QEMU did not stop the device's rings"
                time.sleep(0.05)
            seen.append("rings stopped")

            def resume_when_parked():
                q2 = SyncQmp(qmp_path)
                try:
                    end = time.monotonic() + 60
                    while not server[0].call(lambda: any(r.parked for r in server[0].server.device.rings)):
                        if time.monotonic() > end:
                            break  # resume anyway: the test then fails on what the guest saw
                        time.sleep(0.05)  # a condition wait: the allowed reply is parked
                    q2.execute("cont")
                finally:
                    q2.close()
            threading.Thread(target=resume_when_parked, daemon=True).start()
        finally:
            q.close()
        return "allow"

    status, out, srv = run_guest(image, tmp_path, ws, "rm -rf victims; echo rc=$?\n", decide=decide,
                                 qmp=qmp_path, on_server=server.append)
    assert seen == ["paused", "rings stopped"], seen
    assert "rc=0" in out and not victims.exists(), out
    names = [n for n, _ in srv.server.logs[0]]
    assert names.count("GET_VRING_BASE") >= 4, names  # stopped for the pause, and at power-off
    ws.close()


@pytest.mark.parametrize("kind", ["read-only folder", "in-memory tree"])
def test_read_only_folders_and_in_memory_trees_over_virtiofs(image, tmp_path, kind):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_bytes(b"from the host\n")
    before = oracle.snapshot_dir(str(work))
    provider = (Provider.read_only_dir(str(work)) if kind == "read-only folder"
                else memory_tree({"notes.txt": "from the host\n", "sub/deep.txt": "deep\n"}))
    script = "cat notes.txt; touch new.txt 2>&1 || echo TOUCH-REFUSED; rm notes.txt 2>&1 || echo RM-REFUSED\n"
    try:
        status, out, _srv = run_guest(image, tmp_path, None, script, provider=provider)
    finally:
        provider.close()
    assert "from the host" in out and "TOUCH-REFUSED" in out and "RM-REFUSED" in out, out
    assert "Read-only file system" in out, out  # EROFS
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "nothing changed on the host")


def test_sigkill_of_serve_virtiofs_under_a_writing_guest_recovers_exactly(image, tmp_path):
    """`sandbox serve-virtiofs` (its own process) is SIGKILLed while a real guest writes
    through it; QEMU is then stopped. The next open of the folder recovers: the tree is
    exactly as before the session (the interrupted step is rolled back)."""
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "src" / "main.py").write_bytes(b"print('hi')\\n")
    before = oracle.snapshot_dir(str(work))
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg")}
    sock = str(tmp_path / "vfs.sock")
    server = subprocess.Popen([sys.executable, "-m", "sandbox", "serve-virtiofs", "--root", str(work),
                               "--socket", sock], stderr=subprocess.PIPE, text=True, env=env,
                              stdin=subprocess.DEVNULL)
    qemu = None
    try:
        line = server.stderr.readline()  # blocks until it listens (or dies)
        assert "serving" in line, line + server.stderr.read()
        script = ("i=0; while :; do echo $i > f$i; echo more >> src/main.py; rm -f f$((i-3)); i=$((i+1)); done\n")
        img = image(script)
        cfg = VmConfig(kernel=img.vmlinuz, initrd=img.initrd, append="loglevel=3", memory_mb=MEMORY_MB,
                       virtiofs=[("work", sock)])
        qemu = subprocess.Popen(build_command(cfg), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 240
        while (work / "src" / "main.py").read_bytes().count(b"more") < 20:  # a condition wait: the guest writes
            assert time.monotonic() < deadline and qemu.poll() is None, "the guest never wrote"
            time.sleep(0.05)
        server.kill()
        server.wait(30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        if qemu is not None:
            qemu.kill()
            qemu.wait(30)
    assert (work / "src" / "main.py").read_bytes() != b"print('hi')\\n"  # the guest's writes landed
    r = subprocess.run([sys.executable, "-m", "sandbox", "history", "--workdir", str(work)], capture_output=True,
                       text=True, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "recovered" in r.stderr, r
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "recovery after SIGKILL of serve-virtiofs")
