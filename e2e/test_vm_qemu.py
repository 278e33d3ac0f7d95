"""Real QEMU (TCG) behind :mod:`sandbox.vm.qemu`, :mod:`~sandbox.vm.console` and :mod:`~sandbox.vm.qmp`.

Each test boots Debian's kernel with a tiny busybox initramfs of its own
(``sandbox.vm.image``): a guest that prints a marker and waits, one that panics, the KVM
probe guest, and one that talks over the virtio-serial port named ``control``. All
synchronisation is on console markers, QMP replies and socket reads — never sleeps.

Skipped with the reason where QEMU, busybox-static or the Debian kernel package cannot be
had. Under TCG one boot takes about 7 s on the project's 2-core machines.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time

import pytest

from sandbox.vm import image as vm_image
from sandbox.vm import qemu
from sandbox.vm.console import BootError, Console
from sandbox.vm.qmp import Qmp, QmpError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

BOOT_TIMEOUT_S = 60.0  # TCG on a loaded 2-core machine; about 7 s when idle

WAITING_INIT = r"""
echo GUEST-UP
sleep 60
poweroff -f
"""

PROBE_INIT = "grep -q sandbox.probe=1 /proc/cmdline && echo SANDBOX-PROBE-OK; poweroff -f\n"

# No udev in the guest: find the virtio-serial port by its name in sysfs; devtmpfs has
# made /dev/vportNpM for it. The name arrives from the host shortly after the device is
# probed, so look again for a bounded while.
CONTROL_INIT = r"""
find_port() {
  for n in /sys/class/virtio-ports/vport*; do
    [ "$(cat "$n/name" 2>/dev/null)" = "$1" ] && { echo "/dev/${n##*/}"; return 0; }
  done
  return 1
}
i=0
until port=$(find_port control); do
  i=$((i + 1)); [ "$i" -gt 100 ] && { echo "NO-CONTROL-PORT"; poweroff -f; }
  sleep 0.1
done
echo "CONTROL-PORT $port"
exec 3<>"$port"
echo "GUEST-HELLO" >&3
read -r line <&3
echo "GOT:$line"
sleep 60
poweroff -f
"""


def _image(init: str, modules: tuple[str, ...] = ()) -> vm_image.Image:
    if shutil.which(qemu.QEMU) is None:
        pytest.skip("qemu-system-x86_64 is not installed (./dev setup installs qemu-system-x86)")
    try:
        return vm_image.build_initramfs(vm_image.fetch_kernel(), init, modules=modules)
    except vm_image.ImageError as e:
        pytest.skip(f"cannot build the guest image here: {e}")


def tcg(image: vm_image.Image, **kw) -> qemu.VmConfig:
    kw.setdefault("append", "quiet")
    return qemu.VmConfig(kernel=image.vmlinuz, initrd=image.initrd, accel="tcg", memory_mb=256, cpus=1,
                         host_root=False, **kw)


@pytest.fixture(scope="module")
def waiting_image():
    return _image(WAITING_INIT)


def test_boot_to_a_marker_then_a_timeout_then_terminate(waiting_image, tmp_path):
    log = tmp_path / "console.log"
    with Console(qemu.build_command(tcg(waiting_image)), log_path=str(log)) as con:
        con.wait_for("GUEST-UP", BOOT_TIMEOUT_S)
        assert con.alive() and con.returncode is None
        t0 = time.monotonic()
        with pytest.raises(BootError) as e:
            con.wait_for("NEVER-PRINTED", 1.0)
        assert 1.0 <= time.monotonic() - t0 < 3.0
        assert e.value.timed_out and e.value.returncode is None
        assert "'NEVER-PRINTED' did not appear within 1 s" in str(e.value) and "GUEST-UP" in str(e.value)
        assert con.tail(1) == ["GUEST-UP"]
        t0 = time.monotonic()
        con.terminate(timeout_s=10)
        assert time.monotonic() - t0 < 10
        assert not con.alive() and con.returncode is not None
        assert con.terminate() == con.returncode  # idempotent
    assert "GUEST-UP" in log.read_text()


def test_a_guest_that_never_prints_the_marker_raises_with_the_log_tail(waiting_image):
    # rdinit points nowhere: the kernel finds no init, panics, panic=-1 resets, -no-reboot exits
    cfg = tcg(waiting_image, append="rdinit=/nonexistent")
    with Console(qemu.build_command(cfg)) as con, pytest.raises(BootError) as e:
        con.wait_for("GUEST-UP", BOOT_TIMEOUT_S)
    msg = str(e.value)
    assert not e.value.timed_out and e.value.returncode == 0
    assert msg.startswith("QEMU exited with status 0 before 'GUEST-UP' appeared; last 40 console lines:")
    assert "Kernel panic" in msg
    assert len(msg.splitlines()) == 41  # the headline and exactly the last 40 lines


def test_probe_accel_on_this_machine(tmp_path, monkeypatch):
    """Here /dev/kvm opens but KVM guests abort or hang (SPEC §5): TCG, with the reason,
    within the per-model timeout; the answer is cached."""
    monkeypatch.delenv(qemu.ENV_ACCEL, raising=False)
    image = _image(PROBE_INIT)
    timeout_s = 5.0
    t0 = time.monotonic()
    choice = qemu.probe_accel(image, timeout_s=timeout_s, cache_dir=str(tmp_path))
    elapsed = time.monotonic() - t0
    assert elapsed < len(qemu.KVM_CPU_MODELS) * (timeout_s + 1.0) + 5.0, elapsed  # + SIGTERM grace, slack
    print(f"probe: {choice} in {elapsed:.2f} s")
    if choice.accel == "kvm":  # a machine where KVM works: the probe guest booted with it
        assert choice.boot_s is not None and choice.boot_s < timeout_s and choice.cpu in qemu.KVM_CPU_MODELS
    else:
        assert choice.reason.startswith("KVM: ") and choice.boot_s is None and choice.cpu == qemu.TCG_CPU
        if qemu._kvm_unusable() is None:  # /dev/kvm opened, so every CPU model was tried and failed
            assert "-cpu host" in choice.reason and "-cpu max" in choice.reason
    if qemu._kvm_unusable() is None:
        t0 = time.monotonic()
        again = qemu.probe_accel(image, timeout_s=timeout_s, cache_dir=str(tmp_path))
        assert again.cached and again.accel == choice.accel and time.monotonic() - t0 < 1.0


def test_qmp_status_stop_cont_quit(waiting_image, tmp_path):
    cfg = tcg(waiting_image, qmp_socket=str(tmp_path / "qmp.sock"))

    async def drive() -> list[str]:
        qmp = Qmp()
        await qmp.connect(cfg.qmp_socket, timeout_s=10)
        seen = [await qmp.status()]
        await qmp.stop()
        seen.append(await qmp.status())
        await qmp.cont()
        seen.append(await qmp.status())
        with pytest.raises(QmpError) as e:
            await qmp.execute("no-such-command")
        assert e.value.error_class == "CommandNotFound" and "no-such-command" in str(e.value)
        seen.append(await qmp.status())  # an error reply leaves the session usable
        await qmp.quit()
        await qmp.close()  # idempotent
        return seen

    with Console(qemu.build_command(cfg)) as con:
        con.wait_for("GUEST-UP", BOOT_TIMEOUT_S)
        assert asyncio.run(drive()) == ["running", "paused", "running", "running"]
        assert con.wait(10.0) == 0  # quit ends QEMU by itself
        assert not con.alive()


def test_control_port_both_ways(tmp_path):
    image = _image(CONTROL_INIT, modules=("virtio_pci", "virtio_console"))
    cfg = tcg(image, control_socket=str(tmp_path / "control.sock"))
    with Console(qemu.build_command(cfg)) as con:
        con.wait_for("CONTROL-PORT ", BOOT_TIMEOUT_S)
        port = con.wait_for("\n", 5.0).strip()
        assert port.startswith("/dev/vport"), port
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(20.0)
            s.connect(cfg.control_socket)
            with s.makefile("rwb") as f:
                assert f.readline() == b"GUEST-HELLO\n"  # the guest's write waited for us to connect
                f.write(b"HOST-HELLO\n")
                f.flush()
            con.wait_for("GOT:HOST-HELLO", 20.0)
        assert "NO-CONTROL-PORT" not in "\n".join(con.tail(40))
        assert os.path.exists(cfg.control_socket)
