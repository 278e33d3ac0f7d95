"""A real Linux v9fs client (Debian's kernel in QEMU) on our 9P server: the smoke tier.

The guest boots a busybox initramfs (``sandbox.vm.image``), mounts two exports of one
:class:`~sandbox.ninep.server.NinePServer` over ``trans=tcp`` through QEMU ``guestfwd``
to the server's unix socket (SPEC §5): ``work`` — an intercepted folder — and ``tools``
— an in-memory tree holding the script to run. It runs the script, prints its output
and exit status on the serial console and powers off.

Skipped with the reason where QEMU, busybox-static or the Debian kernel package cannot
be had. Under TCG one boot takes a few seconds.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

from sandbox.core.safeguard import SafeguardConfig
from sandbox.core.workspace import Workspace
from sandbox.mounts import Provider, memory_tree
from sandbox.ninep.server import NinePServer, ServerThread
from sandbox.vm import image as vm_image
from sandbox.vm.qemu import VmConfig, build_command
from sandbox_sim import oracle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

INIT = r"""
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
mkdir -p /mnt/work /mnt/tools
opts=trans=tcp,version=9p2000.L,cache=none,msize=524288
mount -t 9p -o $opts,port=565,aname=tools 10.0.2.100 /mnt/tools || echo "MOUNT-FAILED tools"
mount -t 9p -o $opts,port=564,aname=work 10.0.2.100 /mnt/work || echo "MOUNT-FAILED work"
cd /mnt/work
echo "=== BEGIN"
sh /mnt/tools/run.sh 2>&1
echo "=== EXIT $?"
cd /
umount /mnt/work
umount /mnt/tools
poweroff -f
"""


# The host's own userland (git, python3, coreutils) as the guest's, read-only through QEMU's
# built-in 9p with a tmpfs overlay (SPEC §5); the working folder is mounted inside it.
INIT_HOST_USERLAND = r"""
mkdir -p /host /upper /merged
mount -t 9p -o trans=virtio,version=9p2000.L,ro hostroot /host || echo "MOUNT-FAILED hostroot"
mount -t tmpfs tmpfs /upper
mkdir -p /upper/u /upper/w
mount -t overlay overlay -o lowerdir=/host,upperdir=/upper/u,workdir=/upper/w /merged || echo "MOUNT-FAILED overlay"
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
opts=trans=tcp,version=9p2000.L,cache=none,msize=524288
mkdir -p /merged/mnt/work /merged/mnt/tools
mount -t 9p -o $opts,port=565,aname=tools 10.0.2.100 /merged/mnt/tools || echo "MOUNT-FAILED tools"
mount -t 9p -o $opts,port=564,aname=work 10.0.2.100 /merged/mnt/work || echo "MOUNT-FAILED work"
mount -t proc proc /merged/proc
mount -t devtmpfs dev /merged/dev
mount -t tmpfs tmp /merged/tmp
echo "=== BEGIN"
chroot /merged /bin/sh -c 'cd /mnt/work && HOME=/tmp sh /mnt/tools/run.sh' 2>&1
echo "=== EXIT $?"
umount /merged/mnt/work
poweroff -f
"""


def _image(init: str, modules: tuple[str, ...]):
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (./dev setup installs qemu-system-x86)")
    try:
        return vm_image.build_initramfs(vm_image.fetch_kernel(), init, modules=modules)
    except vm_image.ImageError as e:
        pytest.skip(f"cannot build the guest image here: {e}")


@pytest.fixture(scope="module")
def guest_image():
    return _image(INIT, vm_image.NINEP_MODULES)


@pytest.fixture(scope="module")
def userland_image():
    return _image(INIT_HOST_USERLAND, vm_image.NINEP_MODULES + ("9pnet_virtio", "overlay"))


def run_guest(image, tmp_path, ws: Workspace, script: str, decide=None, host_root: bool = False,
              memory_mb: int = 512) -> tuple[int, str]:
    """Boot, run ``script`` in the working folder, return (exit status, its output)."""
    sock = str(tmp_path / "9p.sock")
    tools = memory_tree({"run.sh": script})
    server = NinePServer({"work": Provider.intercepted(ws), "tools": tools}, decide=decide)
    cfg = VmConfig(kernel=image.vmlinuz, initrd=image.initrd, append="loglevel=3", memory_mb=memory_mb, host_root=host_root,
                   guestfwds=[(564, sock), (565, sock)])  # one port per guestfwd (QEMU names them by port)
    with ServerThread(server, unix_path=sock):
        p = subprocess.run(build_command(cfg), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=240)
    out = p.stdout.replace("\r", "")
    assert "=== BEGIN" in out and "=== EXIT" in out, f"guest did not run the script:\n{out[-3000:]}\n{p.stderr[-2000:]}"
    assert "MOUNT-FAILED" not in out, out[-3000:]
    body = out.split("=== BEGIN\n", 1)[1]
    text, _, rest = body.partition("=== EXIT ")
    return int(rest.split()[0]), text


@pytest.fixture
def project(tmp_path):
    work = tmp_path / "work"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "sandbox", "data", "sample-project"), work, symlinks=True)
    return work


def test_guest_workload_is_intercepted_and_undone_exactly(guest_image, tmp_path, project):
    before = oracle.snapshot_dir(str(project))
    ws = Workspace.open(str(project), state_dir=str(tmp_path / "state"))
    script = r"""
set -e
mkdir -p build/out
echo "compiled" > build/out/app.bin
cp -a README.md build/README.copy
mv build/README.copy build/README.moved
echo "appended line" >> README.md
ln -s out/app.bin build/latest
chmod 600 build/out/app.bin
touch -d "2001-02-03 04:05:06" build/out/app.bin
dd if=/dev/zero of=build/zeros bs=4096 count=300 2>/dev/null
truncate -s 1000 build/zeros
sed -i 's/a/A/g' README.md
tar -cf build/src.tar -C . README.md
rm -rf $(ls | grep -v build | head -n 2)
ls -la build build/out
stat -c '%n %s %a' build/out/app.bin build/zeros
readlink build/latest
"""
    status, out = run_guest(guest_image, tmp_path, ws, script)
    assert status == 0, out
    assert "build/out/app.bin 9 600" in out and "build/zeros 1000" in out and "out/app.bin" in out
    assert (project / "build" / "out" / "app.bin").read_bytes() == b"compiled\n"
    assert os.stat(project / "build" / "out" / "app.bin").st_mtime == pytest.approx(981173106, abs=86400)
    assert os.path.getsize(project / "build" / "zeros") == 1000
    assert os.readlink(project / "build" / "latest") == "out/app.bin"
    ws.close_active()
    hist = ws.history()
    assert hist and all(h["type"] == "ambient" for h in hist)
    ws.rollback(len(hist))
    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "undo of a real guest's work")
    ws.close()


def test_guest_posix_semantics_over_the_share(guest_image, tmp_path, project):
    ws = Workspace.open(str(project), state_dir=str(tmp_path / "state"))
    script = r"""
mkdir many
i=0; while [ $i -lt 600 ]; do : > many/file-$i-with-a-longish-name; i=$((i+1)); done
ls many | wc -l
echo keep-me > tmpf
exec 3< tmpf
rm tmpf
cat <&3
exec 3<&-
[ -e tmpf ] && echo "STILL-THERE" || echo "gone"
mkfifo fifo && [ -p fifo ] && echo "fifo made"
echo through-the-fifo > fifo & cat fifo
mknod null c 1 3 && [ -c null ] && echo "device made"
echo discarded > null && echo "device written"
ln tmp-missing x 2>/dev/null || echo "link of missing refused"
echo hello > a; ln a b; echo "nlink $(stat -c %h a)"
mv a c; cat c b
mkdir -p d/e; echo x > d/e/f; mv d z; cat z/e/f
rmdir z 2>/dev/null || echo "rmdir non-empty refused"
"""
    status, out = run_guest(guest_image, tmp_path, ws, script)
    lines = out.split("\n")
    assert "600" in lines, out
    assert "keep-me" in out and "gone" in out and "STILL-THERE" not in out
    assert "fifo made" in out and stat.S_ISFIFO(os.lstat(project / "fifo").st_mode)
    assert "through-the-fifo" in out  # the guest kernel joins reader and writer; the server never opens it
    assert "device made" in out and "device written" in out  # the guest's own driver 1:3 (its /dev/null)
    st = os.lstat(project / "null")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 0  # emulated: never a device on the host, never written
    assert "link of missing refused" in out
    assert "nlink 2" in out and out.count("hello") >= 2
    assert "rmdir non-empty refused" in out
    assert len(os.listdir(project / "many")) == 600
    ws.close()


def test_guest_setid_bits_are_kept_not_applied_on_the_host(guest_image, tmp_path, project):
    """The guest's root is not the host's root (docs/identity.md): ``chmod u+s`` and a
    set-gid ``mkdir`` show in the guest's ``stat``; the host files get no set-id bit."""
    before = oracle.snapshot_dir(str(project))
    ws = Workspace.open(str(project), state_dir=str(tmp_path / "state"))
    script = r"""
echo '#!/bin/sh' > tool
chmod 755 tool
chmod u+s tool
mkdir -m 2775 shared
chmod g+s README.md
stat -c '%n %a' tool shared README.md
"""
    status, out = run_guest(guest_image, tmp_path, ws, script)
    assert status == 0, out
    assert "tool 4755" in out and "shared 2775" in out, out
    assert os.lstat(project / "tool").st_mode & 0o7777 == 0o755
    assert os.lstat(project / "shared").st_mode & 0o7777 == 0o775
    assert not os.lstat(project / "README.md").st_mode & 0o6000
    ws.close_active()
    ws.rollback(len(ws.history()))
    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "undo of the guest's set-id changes")
    ws.close()


@pytest.mark.parametrize("answer", ["allow", "deny"])
def test_safeguard_hold_blocks_the_guest_until_decided(guest_image, tmp_path, project, answer):
    victims = project / "victims"
    victims.mkdir()
    for i in range(8):
        (victims / f"v{i}").write_bytes(b"v" * i)
    before = oracle.snapshot_dir(str(project))
    ws = Workspace.open(str(project), state_dir=str(tmp_path / "state"),
                        safeguard=SafeguardConfig(delete_threshold=4))
    seen = []

    def decide(hold):
        seen.append((hold.kind, hold.count, len(os.listdir(victims))))  # the guest is blocked right now
        return answer

    status, out = run_guest(guest_image, tmp_path, ws, "rm -rf victims; echo rc=$?; ls victims 2>&1 | wc -l\n",
                            decide=decide)
    assert seen == [("delete", 4, 5)], seen  # 3 deleted; the 4th waits for the answer
    if answer == "allow":
        assert not victims.exists() and "rc=0" in out
    else:
        assert "rc=1" in out and ("I/O error" in out or "Input/output error" in out), out
        oracle.assert_same(before, oracle.snapshot_dir(str(project)), "denied step")
    ws.close()


def test_git_and_python_in_the_guest_then_undo(userland_image, tmp_path, project):
    """Real tools on the share: git (lock files, renames, fsync, mmap'ed reads) and python3."""
    before = oracle.snapshot_dir(str(project))
    ws = Workspace.open(str(project), state_dir=str(tmp_path / "state"))
    script = r"""
set -e
g() { git -c user.email=agent@example.com -c user.name=agent "$@"; }
g init -q .
g add -A
g commit -qm first
echo change >> README.md
g commit -qam second
g log --oneline | wc -l
g checkout -q HEAD~1
g status --short | wc -l
python3 -c "import os, json; print(json.dumps(sorted(os.listdir('.'))))"
"""
    status, out = run_guest(userland_image, tmp_path, ws, script, host_root=True, memory_mb=1024)
    assert status == 0, out
    lines = [line for line in out.split("\n") if not line.startswith("[")]  # kernel messages may interleave
    assert lines[:2] == ["2", "0"], out
    assert (project / ".git" / "HEAD").exists()
    ws.close_active()
    ws.rollback(len(ws.history()))
    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "undo of git in the guest")
    ws.close()


def test_guest_owners_setid_clearing_and_ns_times(userland_image, tmp_path, project):
    """A real guest kernel (root in the VM, attaching per uid): root gives a directory to
    65534, which then creates a file in it (its owner shows as 65534 in the guest, the host
    file stays the server's); a write by 65534 clears set-uid; utimensat reaches the server
    in whole seconds (the v9fs client's granularity, docs/identity.md "Owners"). Undo
    restores the tree exactly."""
    before = oracle.snapshot_dir(str(project))
    ws = Workspace.open(str(project), state_dir=str(tmp_path / "state"))
    script = r"""
set -e
mkdir own
chown 65534:65534 own
python3 - <<'PY'
import os, stat


def as_nobody(fn):
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            fn()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


as_nobody(lambda: open("own/x", "w").write("by nobody"))
st = os.stat("own/x")
print("OWNER", st.st_uid, st.st_gid)
open("s", "w").write("s")
os.chmod("s", 0o4777)
as_nobody(lambda: open("s", "a").write("more"))
print("MODE", oct(stat.S_IMODE(os.stat("s").st_mode)))
open("t", "w").close()
os.utime("t", ns=(100000000_100000000, 200000000_200000000))
st = os.stat("t")
print("TIMES", st.st_atime_ns, st.st_mtime_ns)
PY
"""
    status, out = run_guest(userland_image, tmp_path, ws, script, host_root=True, memory_mb=1024)
    assert status == 0, out
    assert "OWNER 65534 65534" in out and "MODE 0o777" in out, out
    # Linux v9fs leaves s_time_gran at 1 s: the guest kernel truncates the times it sets to
    # whole seconds before the Tsetattr (atime_nsec=0 on the wire) — a client limit; every
    # nanosecond the server is given is kept (sandbox_sim/test_ownership.py)
    assert "TIMES 100000000000000000 200000000000000000" in out, out
    assert os.lstat(project / "own" / "x").st_uid == os.geteuid()  # the host file stays the server's
    ws.close_active()
    ws.rollback(len(ws.history()))
    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "undo of the guest's owners")
    ws.close()


def test_guest_privileged_xattrs_stay_in_the_guest(userland_image, tmp_path, project):
    """A real guest kernel (root in the VM) sets a file capability, a trusted.* xattr and an
    SELinux label and reads them back; the host file carries none of them (docs/identity.md)."""
    before = oracle.snapshot_dir(str(project))
    ws = Workspace.open(str(project), state_dir=str(tmp_path / "state"))
    script = r"""
set -e
printf '#!/bin/sh\n' > tool
python3 - <<'PY'
import os, struct
cap = struct.pack("<IIIII", 0x02000001, 1 << 7, 0, 0, 0)  # cap_setuid+ep
os.setxattr("tool", "security.capability", cap)
os.setxattr("tool", "trusted.x", b"t")
os.setxattr("tool", "security.selinux", b"system_u:object_r:bin_t:s0")
print("CAP", os.getxattr("tool", "security.capability") == cap)
print("NAMES", " ".join(sorted(n for n in os.listxattr("tool") if not n.startswith("user."))))
PY
"""
    status, out = run_guest(userland_image, tmp_path, ws, script, host_root=True, memory_mb=1024)
    assert status == 0, out
    assert "CAP True" in out and "NAMES security.capability security.selinux trusted.x" in out, out
    names = os.listxattr(project / "tool")
    assert not [n for n in names if not n.startswith("user.sandbox.x.")], names
    with pytest.raises(OSError):
        os.getxattr(project / "tool", "security.capability")  # no real file capability
    ws.close_active()
    ws.rollback(len(ws.history()))
    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "undo of the guest's privileged xattrs")
    ws.close()
