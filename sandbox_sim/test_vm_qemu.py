"""The QEMU command line and the accelerator probe, without QEMU.

:func:`sandbox.vm.qemu.build_command` is pure: these tests assert on the exact flags that
carry meaning (accelerator and CPU, the control port's chardev and name, guestfwd strings
with QEMU's comma escaping, ``restrict=on`` only when the network is disabled, QMP, the
disk, the host root) and on the validation errors.

The probe runs for real against a stand-in QEMU — a shell script that behaves like the
measured one (``-cpu host`` aborts on MSR 0x10a; ``-cpu max`` boots or hangs, per test)
— through the real :class:`~sandbox.vm.console.Console`; ``KVM_DEVICE`` points at a
file the test controls.
"""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from sandbox.vm import qemu
from sandbox.vm.image import Image, Kernel

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_accel_override(monkeypatch):
    monkeypatch.delenv(qemu.ENV_ACCEL, raising=False)


@pytest.fixture
def boot_files(tmp_path):
    kernel = tmp_path / "vmlinuz"
    initrd = tmp_path / "initrd.cpio.gz"
    kernel.write_bytes(b"k")
    initrd.write_bytes(b"i")
    return str(kernel), str(initrd)


def cfg(boot_files, **kw) -> qemu.VmConfig:
    return qemu.VmConfig(kernel=boot_files[0], initrd=boot_files[1], **kw)


def values(cmd: list[str], flag: str) -> list[str]:
    """Every argument that follows ``flag``."""
    return [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == flag]


def netdev(cmd: list[str]) -> list[str]:
    (nd,) = values(cmd, "-netdev")
    return split_opts(nd)


def split_opts(s: str) -> list[str]:
    """A QemuOpts string split at single commas (``,,`` is an escaped comma, kept as is)."""
    out, cur, i = [], "", 0
    while i < len(s):
        if s[i] == ",":
            if s[i + 1:i + 2] == ",":
                cur += ",,"
                i += 2
                continue
            out.append(cur)
            cur = ""
        else:
            cur += s[i]
        i += 1
    return out + [cur]


# --------------------------------------------------------------------------- build_command


def test_tcg_defaults(boot_files):
    cmd = qemu.build_command(cfg(boot_files))
    assert cmd[0] == "qemu-system-x86_64"
    assert values(cmd, "-machine") == ["q35,accel=tcg"]
    # QEMU's max model, but without the "fast rep movsb" TCG runs a byte a loop (qemu.TCG_CPU)
    assert values(cmd, "-cpu") == ["max,erms=off,fsrm=off"] == [qemu.TCG_CPU]
    assert values(cmd, "-m") == ["1024"] and values(cmd, "-smp") == ["2"]
    for flag in ("-nodefaults", "-no-reboot"):
        assert flag in cmd
    assert values(cmd, "-display") == ["none"]
    assert values(cmd, "-serial") == ["stdio"]
    assert values(cmd, "-kernel") == [boot_files[0]] and values(cmd, "-initrd") == [boot_files[1]]
    assert values(cmd, "-append") == ["console=ttyS0 panic=-1 no_timer_check"]
    assert netdev(cmd) == ["user", "id=n0", "restrict=on"]
    assert "virtio-net-pci,netdev=n0" in values(cmd, "-device")
    assert "-virtfs" not in cmd  # nothing of the host's files unless asked
    assert "-qmp" not in cmd and "-drive" not in cmd and "-chardev" not in cmd


def test_append_keeps_console_and_panic(boot_files):
    cmd = qemu.build_command(cfg(boot_files, append="quiet sandbox.folders=2"))
    assert values(cmd, "-append") == ["console=ttyS0 panic=-1 no_timer_check quiet sandbox.folders=2"]


def test_kvm_uses_host_cpu_unless_told(boot_files):
    cmd = qemu.build_command(cfg(boot_files, accel="kvm"))
    assert values(cmd, "-machine") == ["q35,accel=kvm"] and values(cmd, "-cpu") == ["host"]
    cmd = qemu.build_command(cfg(boot_files, accel="kvm", cpu="max"))
    assert values(cmd, "-cpu") == ["max"]


def test_sizes_and_extra(boot_files):
    cmd = qemu.build_command(cfg(boot_files, memory_mb=256, cpus=1, extra=["-S", "-d", "guest_errors"]))
    assert values(cmd, "-m") == ["256"] and values(cmd, "-smp") == ["1"]
    assert cmd[-3:] == ["-S", "-d", "guest_errors"]


def test_console_to_a_file(boot_files, tmp_path):
    path = str(tmp_path / "con,sole.log")
    cmd = qemu.build_command(cfg(boot_files, console=path))
    assert values(cmd, "-serial") == ["chardev:serial0"]
    assert values(cmd, "-chardev") == [f"file,id=serial0,path={tmp_path}/con,,sole.log"]


def test_control_port(boot_files, tmp_path):
    sock = str(tmp_path / "control.sock")
    cmd = qemu.build_command(cfg(boot_files, control_socket=sock))
    assert values(cmd, "-chardev") == [f"socket,id=control,path={sock},server=on,wait=off"]
    devices = values(cmd, "-device")
    assert "virtio-serial-pci" in devices
    assert "virtserialport,chardev=control,name=control" in devices


def test_guestfwds_one_per_port_commas_escaped_twice(boot_files, tmp_path):
    d = tmp_path / "a,b"
    d.mkdir()
    plain, comma = str(tmp_path / "9p.sock"), str(d / "9p.sock")
    cmd = qemu.build_command(cfg(boot_files, guestfwds=[(564, plain), (565, comma)]))
    opts = netdev(cmd)
    assert opts[:3] == ["user", "id=n0", "restrict=on"]
    # the target is parsed as an option value, then again as a chardev spec: "," -> ",,,,"
    assert opts[3:] == [f"guestfwd=tcp:10.0.2.100:564-unix:{plain}",
                        f"guestfwd=tcp:10.0.2.100:565-unix:{tmp_path}/a,,,,b/9p.sock"]


@pytest.mark.parametrize("network, restricted", [("disabled", True), ("open", False), ("allowlist", True)])
def test_restrict_only_when_network_disabled(boot_files, tmp_path, network, restricted):
    cmd = qemu.build_command(cfg(boot_files, network=network, guestfwds=[(564, str(tmp_path / "s"))]))
    opts = netdev(cmd)
    assert ("restrict=on" in opts) is restricted
    assert not any(o.startswith("restrict") for o in opts if o != "restrict=on")
    assert f"guestfwd=tcp:10.0.2.100:564-unix:{tmp_path}/s" in opts  # the shares work either way


def test_guestfwd_commands_for_the_allowlist_proxy(boot_files, tmp_path):
    cmd = qemu.build_command(cfg(boot_files, network="allowlist", guestfwds=[(564, str(tmp_path / "s"))],
                                 guestfwd_cmds=[(3128, "/usr/bin/python3 -I relay.py '/r,un/p.sock'")]))
    opts = netdev(cmd)
    assert "restrict=on" in opts  # the proxy is the only way out
    assert "guestfwd=tcp:10.0.2.100:3128-cmd:/usr/bin/python3 -I relay.py '/r,,un/p.sock'" in ",".join(opts)
    with pytest.raises(ValueError, match="given twice"):
        qemu.build_command(cfg(boot_files, guestfwds=[(53, str(tmp_path / "s"))], guestfwd_cmds=[(53, "x")]))
    with pytest.raises(ValueError, match="one line"):
        qemu.build_command(cfg(boot_files, guestfwd_cmds=[(53, "a\nb")]))


def test_qmp_socket_escaped(boot_files, tmp_path):
    d = tmp_path / "r,un"
    d.mkdir()
    cmd = qemu.build_command(cfg(boot_files, qmp_socket=str(d / "qmp.sock")))
    assert values(cmd, "-qmp") == [f"unix:{tmp_path}/r,,un/qmp.sock,server=on,wait=off"]


def test_disk(boot_files, tmp_path):
    disk = tmp_path / "over,lay.ext4"
    disk.write_bytes(b"")
    cmd = qemu.build_command(cfg(boot_files, disk=str(disk)))
    (drive,) = values(cmd, "-drive")
    opts = split_opts(drive)
    assert opts[0] == f"file={tmp_path}/over,,lay.ext4"
    assert {"if=virtio", "format=raw", "cache=writeback"} <= set(opts[1:])


def test_host_root_only_when_asked(boot_files):
    assert values(qemu.build_command(cfg(boot_files, host_root=True)), "-virtfs") == [
        "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"]


def test_read_only_exports(boot_files, tmp_path):
    skel = tmp_path / "ro,ot"
    skel.mkdir()
    cmd = qemu.build_command(cfg(boot_files, virtfs_ro=[("hostusr", "/usr"), ("rootskel", str(skel))]))
    assert values(cmd, "-virtfs") == [
        "local,path=/usr,mount_tag=hostusr,security_model=none,readonly=on,multidevs=remap",
        f"local,path={tmp_path}/ro,,ot,mount_tag=rootskel,security_model=none,readonly=on,multidevs=remap"]


@pytest.mark.parametrize("tag, path, match", [
    ("bad tag", "/usr", "one word"), ("x" * 32, "/usr", "one word"), ("t", "/nonexistent-dir", "does not exist")])
def test_read_only_exports_are_validated(boot_files, tag, path, match):
    with pytest.raises(ValueError, match=match):
        qemu.build_command(cfg(boot_files, virtfs_ro=[(tag, path)]))


def test_a_read_only_export_tag_is_given_once(boot_files):
    with pytest.raises(ValueError, match="given twice"):
        qemu.build_command(cfg(boot_files, virtfs_ro=[("usr", "/usr"), ("usr", "/usr")]))


def test_virtiofs_shares_share_the_guest_ram_as_a_memfd(boot_files, tmp_path):
    cmd = qemu.build_command(cfg(boot_files, memory_mb=768,
                                 virtiofs=[("work", str(tmp_path / "a,b.sock")), ("w1", str(tmp_path / "c.sock"))]))
    assert values(cmd, "-object") == ["memory-backend-memfd,id=mem,size=768M,share=on"]
    assert values(cmd, "-numa") == ["node,memdev=mem"]
    assert values(cmd, "-chardev")[-2:] == [f"socket,id=vfs0,path={tmp_path}/a,,b.sock",
                                            f"socket,id=vfs1,path={tmp_path}/c.sock"]
    assert [d for d in values(cmd, "-device") if d.startswith("vhost-user-fs")] == [
        f"vhost-user-fs-pci,chardev=vfs0,tag=work,queue-size={qemu.VIRTIOFS_QUEUE_SIZE}",
        f"vhost-user-fs-pci,chardev=vfs1,tag=w1,queue-size={qemu.VIRTIOFS_QUEUE_SIZE}"]
    assert "-object" not in qemu.build_command(cfg(boot_files))  # no share, no memfd


def test_the_virtiofs_queue_lets_the_guest_send_one_mebibyte_requests():
    """Linux's virtio-fs caps a request at the request queue's size less 4 header entries
    (fs/fuse/virtio_fs.c, since 5.14): with QEMU's default 128 a 1 MiB write became WRITEs of
    124 + 124 + 8 pages. The queue must hold the 256 pages our INIT grants, plus the headers,
    and stay within QEMU's VIRTQUEUE_MAX_SIZE and our device's indirect-table bound."""
    from sandbox.fuse import abi
    from sandbox.fuse.virtqueue import INDIRECT_DESCS_MAX

    q = qemu.VIRTIOFS_QUEUE_SIZE
    assert q & (q - 1) == 0 and q <= 1024 and q <= INDIRECT_DESCS_MAX
    assert q - 4 >= abi.MAX_PAGES


@pytest.mark.parametrize("tag, match", [("bad tag", "one word"), ("x" * 37, "one word"), ("a,b", "one word")])
def test_virtiofs_tags_are_validated(boot_files, tmp_path, tag, match):
    with pytest.raises(ValueError, match=match):
        qemu.build_command(cfg(boot_files, virtiofs=[(tag, str(tmp_path / "s.sock"))]))
    with pytest.raises(ValueError, match="given twice"):
        qemu.build_command(cfg(boot_files, virtiofs=[("t", str(tmp_path / "s")), ("t", str(tmp_path / "s2"))]))
    with pytest.raises(ValueError, match="does not exist"):
        qemu.build_command(cfg(boot_files, virtiofs=[("t", "/nonexistent-dir/s.sock")]))


def test_a_full_session_config(boot_files, tmp_path):
    disk = tmp_path / "d.img"
    disk.write_bytes(b"")
    c = cfg(boot_files, accel="kvm", cpu="max", append="quiet", memory_mb=2048, cpus=4,
            qmp_socket=str(tmp_path / "q.sock"), control_socket=str(tmp_path / "c.sock"),
            guestfwds=[(564, str(tmp_path / "9p.sock")), (565, str(tmp_path / "9p.sock"))],
            network="open", disk=str(disk), virtfs_ro=[("hostusr", "/usr"), ("rootskel", str(tmp_path))])
    cmd = qemu.build_command(c)
    assert cmd == qemu.build_command(c)  # pure
    assert len(values(cmd, "-netdev")) == 1 and "restrict=on" not in netdev(cmd)
    assert [o for o in netdev(cmd) if o.startswith("guestfwd=")] == [
        f"guestfwd=tcp:10.0.2.100:{p}-unix:{tmp_path}/9p.sock" for p in (564, 565)]
    assert len(values(cmd, "-qmp")) == 1 and len(values(cmd, "-drive")) == 1 and len(values(cmd, "-virtfs")) == 2


@pytest.mark.parametrize("change, message", [
    (dict(accel="hvf"), "accel must be one of"),
    (dict(network="some"), "network must be one of"),
    (dict(memory_mb=16), "memory_mb"),
    (dict(cpus=0), "cpus"),
    (dict(cpu="host,+vmx"), "cpu model"),
    (dict(cpu="max,erms=off,"), "cpu model"),
    (dict(cpu="max,erms=maybe"), "cpu model"),
    (dict(cpu="max,erms=off -S"), "cpu model"),
    (dict(append="a\nb"), "one line"),
    (dict(guestfwds=[(564, "/tmp/a.sock"), (564, "/tmp/b.sock")]), "given twice"),
    (dict(guestfwds=[(0, "/tmp/a.sock")]), "port must be"),
    (dict(guestfwds=[(70000, "/tmp/a.sock")]), "port must be"),
    (dict(qmp_socket="/tmp/" + "x" * 120), "longer than 107 bytes"),
    (dict(control_socket="/nonexistent-dir/c.sock"), "does not exist"),
    (dict(guestfwds=[(564, "/tmp/a\n.sock")]), "newline"),
    (dict(disk="/nonexistent/disk.img"), "disk"),
    (dict(console="/nonexistent-dir/console.log"), "console"),
])
def test_validation(boot_files, change, message):
    with pytest.raises(ValueError, match=message):
        qemu.build_command(cfg(boot_files, **change))


def test_kernel_and_initrd_must_exist(boot_files, tmp_path):
    with pytest.raises(ValueError, match="kernel"):
        qemu.build_command(qemu.VmConfig(kernel=str(tmp_path / "nope"), initrd=boot_files[1]))
    with pytest.raises(ValueError, match="initrd"):
        qemu.build_command(qemu.VmConfig(kernel=boot_files[0], initrd=str(tmp_path / "nope")))


# --------------------------------------------------------------------------- qemu_version


def script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_qemu_version(tmp_path):
    fake = script(tmp_path / "qemu-system-x86_64",
                  'echo "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)"\n')
    assert qemu.qemu_version(fake) == "7.2.22"
    with pytest.raises(qemu.QemuError, match="not installed"):
        qemu.qemu_version(str(tmp_path / "missing"))
    broken = script(tmp_path / "broken", "echo nonsense; exit 1\n")
    with pytest.raises(qemu.QemuError, match="unexpected"):
        qemu.qemu_version(broken)


# --------------------------------------------------------------------------- probe_accel

# A stand-in QEMU as measured on these machines: -cpu host aborts at once with the MSR
# complaint on stderr; -cpu max does what MAX says: "boot" (prints the probe marker when
# the kernel command line asks for it) or "hang" (prints nothing, runs until killed).
FAKE_QEMU = r"""
echo "$*" >> "$(dirname "$0")/runs"
case " $* " in
  *" -cpu host "*)
    echo "qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69" >&2
    echo "qemu-system-x86_64: ../../target/i386/kvm/kvm.c:3183: kvm_buf_set_msrs: Assertion failed." >&2
    kill -ABRT $$ ;;
esac
case "$*" in
  *sandbox.probe=1*) ;;
  *) echo "not a probe"; exit 1 ;;
esac
"""
MAX_BOOTS = 'echo "[    0.000000] Linux version 6.1.0"; echo SANDBOX-PROBE-OK; exit 0\n'
MAX_HANGS = "exec sleep 30\n"


@pytest.fixture
def image(tmp_path):
    root = tmp_path / "kernel"
    (root / "boot").mkdir(parents=True)
    (root / "boot" / "vmlinuz-6.1.0-test-amd64").write_bytes(b"k")
    initrd = tmp_path / "probe.cpio.gz"
    initrd.write_bytes(b"i")
    return Image(Kernel("6.1.0-test-amd64", str(root)), str(initrd))


@pytest.fixture
def kvm_device(tmp_path, monkeypatch):
    """A /dev/kvm that opens read/write."""
    dev = tmp_path / "kvm"
    dev.write_bytes(b"")
    monkeypatch.setattr(qemu, "KVM_DEVICE", str(dev))
    return dev


def fake_qemu(tmp_path, max_behaviour: str) -> str:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    return script(d / "qemu-system-x86_64", FAKE_QEMU + max_behaviour)


@pytest.mark.parametrize("cpu", ["max", "host", "Skylake-Client-v4", "max,erms=off,fsrm=off", "qemu64,avx2=on"])
def test_a_cpu_model_with_features_on_or_off_is_taken_verbatim(boot_files, cpu):
    assert values(qemu.build_command(cfg(boot_files, cpu=cpu)), "-cpu") == [cpu]


def runs(fake: str) -> list[str]:
    path = os.path.join(os.path.dirname(fake), "runs")
    return open(path).read().splitlines() if os.path.exists(path) else []


def test_probe_without_dev_kvm_is_tcg(image, tmp_path, monkeypatch):
    monkeypatch.setattr(qemu, "KVM_DEVICE", str(tmp_path / "no-kvm"))
    fake = fake_qemu(tmp_path, MAX_BOOTS)
    choice = qemu.probe_accel(image, cache_dir=str(tmp_path / "cache"), qemu=fake)
    assert (choice.accel, choice.cpu, choice.boot_s) == ("tcg", qemu.TCG_CPU, None)
    assert choice.reason == f"KVM: {tmp_path}/no-kvm does not exist"
    assert runs(fake) == []  # nothing was booted


def test_probe_with_unopenable_dev_kvm_is_tcg(image, tmp_path, monkeypatch):
    not_a_device = tmp_path / "kvm-dir"
    not_a_device.mkdir()  # open(O_RDWR) fails even for root
    monkeypatch.setattr(qemu, "KVM_DEVICE", str(not_a_device))
    choice = qemu.probe_accel(image, cache_dir=str(tmp_path / "cache"), qemu=fake_qemu(tmp_path, MAX_BOOTS))
    assert choice.accel == "tcg"
    assert choice.reason.startswith(f"KVM: cannot open {not_a_device} read/write:")


@pytest.mark.parametrize("value, accel, cpu", [("tcg", "tcg", qemu.TCG_CPU), ("kvm", "kvm", "host")])
def test_env_override_skips_probing(image, tmp_path, kvm_device, monkeypatch, value, accel, cpu):
    monkeypatch.setenv("SANDBOX_ACCEL", value)
    fake = fake_qemu(tmp_path, MAX_BOOTS)
    choice = qemu.probe_accel(image, cache_dir=str(tmp_path / "cache"), qemu=fake)
    assert (choice.accel, choice.cpu) == (accel, cpu)
    assert "SANDBOX_ACCEL" in choice.reason
    assert runs(fake) == [] and not (tmp_path / "cache").exists()


def test_env_override_rejects_nonsense(image, monkeypatch):
    monkeypatch.setenv("SANDBOX_ACCEL", "fast")
    with pytest.raises(ValueError, match="SANDBOX_ACCEL"):
        qemu.probe_accel(image)


def test_probe_host_aborts_then_max_hangs_is_tcg_within_the_timeouts(image, tmp_path, kvm_device):
    fake = fake_qemu(tmp_path, MAX_HANGS)
    t0 = time.monotonic()
    choice = qemu.probe_accel(image, timeout_s=0.5, cache_dir=str(tmp_path / "cache"), qemu=fake)
    elapsed = time.monotonic() - t0
    assert choice.accel == "tcg" and choice.boot_s is None
    assert choice.reason == ("KVM: -cpu host aborted (signal 6): error: failed to set MSR 0x10a to 0x69; "
                             "-cpu max: no output within 0.5 s")
    assert elapsed < 0.5 + 1.0 + 2.0  # max's timeout + its SIGTERM grace + slack; host fails at once
    assert [r.split(" -cpu ")[1].split()[0] for r in runs(fake)] == ["host", "max"]
    assert all("sandbox.probe=1" in r and "accel=kvm" in r for r in runs(fake))


def test_probe_result_is_cached_per_qemu_binary(image, tmp_path, kvm_device):
    fake = fake_qemu(tmp_path, MAX_BOOTS)
    cache = tmp_path / "cache"
    first = qemu.probe_accel(image, timeout_s=5, cache_dir=str(cache), qemu=fake)
    assert (first.accel, first.cpu, first.cached) == ("kvm", "max", False)
    assert first.reason == "KVM boots with -cpu max" and first.boot_s is not None and first.boot_s < 5
    assert len(runs(fake)) == 2  # host (aborted), max (booted)

    again = qemu.probe_accel(image, timeout_s=5, cache_dir=str(cache), qemu=fake)
    assert again.cached and (again.accel, again.cpu, again.reason, again.boot_s) == (
        first.accel, first.cpu, first.reason, first.boot_s)
    assert len(runs(fake)) == 2  # not probed again
    data = json.loads((cache / qemu.PROBE_CACHE_FILE).read_text())
    assert len(data["entries"]) == 1

    (tmp_path / "kernel" / "boot" / "vmlinuz-6.1.0-other-amd64").write_bytes(b"k")
    other_kernel = Image(Kernel("6.1.0-other-amd64", image.kernel.root), image.initrd)
    assert not qemu.probe_accel(other_kernel, timeout_s=5, cache_dir=str(cache), qemu=fake).cached
    assert len(runs(fake)) == 4

    st = os.stat(fake)  # an upgraded QEMU binary (new mtime) is probed afresh
    os.utime(fake, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not qemu.probe_accel(image, timeout_s=5, cache_dir=str(cache), qemu=fake).cached
    assert len(runs(fake)) == 6
    assert len(json.loads((cache / qemu.PROBE_CACHE_FILE).read_text())["entries"]) == 3


def test_a_cached_tcg_choice_runs_todays_tcg_cpu(image, tmp_path, kvm_device):
    """A TCG fallback cached before TCG_CPU changed (it said "max") boots today's model; a
    cached KVM choice keeps the model its probe booted."""
    fake = fake_qemu(tmp_path, MAX_HANGS)
    cache = tmp_path / "cache"
    first = qemu.probe_accel(image, timeout_s=0.5, cache_dir=str(cache), qemu=fake)
    assert (first.accel, first.cpu, first.cached) == ("tcg", qemu.TCG_CPU, False)
    path = cache / qemu.PROBE_CACHE_FILE
    data = json.loads(path.read_text())
    (key, entry), = data["entries"].items()
    assert entry["cpu"] == qemu.TCG_CPU
    entry["cpu"] = "max"  # as the cache was written before
    data["entries"]["kvm-key"] = {**entry, "accel": "kvm", "cpu": "Skylake-Client"}
    path.write_text(json.dumps(data))
    again = qemu.probe_accel(image, timeout_s=0.5, cache_dir=str(cache), qemu=fake)
    assert again.cached and (again.accel, again.cpu) == ("tcg", qemu.TCG_CPU)
    assert qemu._from_cache(data["entries"]["kvm-key"]).cpu == "Skylake-Client"
    assert len(runs(fake)) == 2  # probed once (host, max), not again


def test_a_damaged_cache_means_probing_again(image, tmp_path, kvm_device):
    fake = fake_qemu(tmp_path, MAX_BOOTS)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / qemu.PROBE_CACHE_FILE).write_text("{not json")
    choice = qemu.probe_accel(image, timeout_s=5, cache_dir=str(cache), qemu=fake)
    assert choice.accel == "kvm" and not choice.cached
    assert qemu.probe_accel(image, timeout_s=5, cache_dir=str(cache), qemu=fake).cached


def test_probe_cache_is_bounded(image, tmp_path, kvm_device):
    cache = tmp_path / "cache"
    path = str(cache / qemu.PROBE_CACHE_FILE)
    for i in range(qemu.PROBE_CACHE_ENTRIES_MAX + 5):
        qemu._cache_store(path, f"key{i}", qemu.AccelChoice("tcg", "r", None))
    entries = json.loads((cache / qemu.PROBE_CACHE_FILE).read_text())["entries"]
    assert len(entries) == qemu.PROBE_CACHE_ENTRIES_MAX
    assert "key0" not in entries and f"key{qemu.PROBE_CACHE_ENTRIES_MAX + 4}" in entries
    assert stat.S_ISREG(os.stat(path).st_mode) and [f for f in os.listdir(cache) if f.startswith(".")] == []
