"""Live mounts in a real VM: the host adds an export to the running 9P server, the guest
mounts it through the ``mount`` control message on a spare forwarded port, reads it, and
unmounts it; the port is used again.

The guest is Debian's kernel under QEMU (TCG here), booted by :class:`VmGuest` against a
:class:`NinePServer` of our own (no session): what is tested is the control protocol, the
shim's mount and the spare ports, not the SDK above them. Skipped with the reason where
QEMU or the guest image cannot be had.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from sandbox.guest import control as proto
from sandbox.mounts.memory import memory_tree
from sandbox.mounts.provider import Provider
from sandbox.ninep.server import NinePServer, ServerThread
from sandbox.vm.guest import GuestError, GuestMount, VmGuest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
COMMAND_TIMEOUT_S = 120.0


@pytest.fixture(scope="module", autouse=True)
def guest_available(vm_guest):
    """Every test here boots a session VM (conftest.vm_guest skips with the reason otherwise)."""


class Vm:
    def __init__(self, st: ServerThread, guest: VmGuest):
        self.st, self.guest = st, guest
        self._ids = itertools.count(1)

    def sh(self, command: str) -> tuple[int, str, str]:
        out: dict[str, list[str]] = {"stdout": [], "stderr": []}

        async def go():
            ex = await self.guest.exec(next(self._ids), command, "/", {}, lambda s, d: out[s].append(d))
            return await asyncio.wait_for(ex.completed, COMMAND_TIMEOUT_S)

        done = self.st.run(go(), timeout_s=COMMAND_TIMEOUT_S + 10)
        return done["exit_code"], "".join(out["stdout"]), "".join(out["stderr"])

    def mount(self, aname: str, target: str, read_only: bool = True) -> None:
        self.st.run(self.guest.mount(GuestMount(aname, target, read_only)), timeout_s=proto.MOUNT_TIMEOUT_S + 30)

    def unmount(self, target: str) -> None:
        self.st.run(self.guest.unmount(target), timeout_s=proto.MOUNT_TIMEOUT_S + 30)


@pytest.fixture(scope="module")
def vm(tmp_path_factory):
    share = tmp_path_factory.mktemp("share")
    (share / "a.txt").write_text("boot share\n")
    run_dir = tmp_path_factory.mktemp("run")
    server = NinePServer({"w0": Provider.read_only_dir(str(share))})
    with ServerThread(server, unix_path=str(run_dir / "9p.sock")) as st:
        # as root: this suite is about the mount mechanism; the share's files belong to whoever runs
        # the tests, without the session's owner mapping (e2e/test_guest_user.py covers the user)
        guest = VmGuest(run_dir=str(run_dir), memory_mb=512, cpus=1, as_root=True)
        try:
            guest.boot(socket_path=str(run_dir / "9p.sock"), mounts=[GuestMount("w0", "/mnt/w", True)], loop=st.loop)
            yield Vm(st, guest)
        finally:
            guest.stop()


def test_a_live_export_mounted_after_boot_is_read_in_the_guest(vm):
    vm.st.call(lambda: vm.st.server.add_export("l0", memory_tree({"hello.txt": b"live\n", "sub/x.txt": b"x\n"})))
    vm.mount("l0", "/mnt/tools/live")
    code, out, err = vm.sh("cat /mnt/tools/live/hello.txt /mnt/w/a.txt; ls /mnt/tools/live/sub")
    assert (code, out) == (0, "live\nboot share\nx.txt\n"), err
    code, _out, err = vm.sh("touch /mnt/tools/live/new")
    assert code != 0 and "Read-only file system" in err
    assert vm.guest.live_mounts() == {"/mnt/tools/live": proto.live_mount_ports()[0]}

    vm.unmount("/mnt/tools/live")
    assert vm.guest.live_mounts() == {}
    code, out, _err = vm.sh("test -e /mnt/tools/live/hello.txt; echo $?; grep -c ' /mnt/tools/live ' /proc/mounts")
    assert out.split() == ["1", "0"]
    with pytest.raises(GuestError, match="no live mount"):
        vm.unmount("/mnt/tools/live")


def test_every_spare_port_mounts_again_after_unmount_and_one_more_is_refused(vm):
    files = {f"l{k}": {"who": f"export {k}\n".encode()} for k in range(1, proto.LIVE_MOUNTS_MAX + 2)}
    for name, tree in files.items():
        vm.st.call(lambda name=name, tree=tree: vm.st.server.add_export(name, memory_tree(tree, writable=True)))
    names = list(files)[: proto.LIVE_MOUNTS_MAX]
    for k, name in enumerate(names):  # the first port was used and released by the test above
        vm.mount(name, f"/mnt/m{k}", read_only=(k % 2 == 0))
    with pytest.raises(GuestError, match="LIVE_MOUNTS_MAX"):
        vm.mount(list(files)[-1], "/mnt/extra")
    code, out, err = vm.sh("; ".join(f"cat /mnt/m{k}/who" for k in range(len(names))))
    assert code == 0 and out == "".join(f"export {k + 1}\n" for k in range(len(names))), err
    code, out, err = vm.sh("echo written > /mnt/m1/new && cat /mnt/m1/new")
    assert (code, out) == (0, "written\n"), err

    for k in range(len(names)):
        vm.unmount(f"/mnt/m{k}")
    vm.mount(list(files)[-1], "/mnt/extra")
    code, out, err = vm.sh("cat /mnt/extra/who")
    assert (code, out) == (0, f"export {proto.LIVE_MOUNTS_MAX + 1}\n"), err


def test_a_mount_the_guest_cannot_make_fails_with_the_reason_and_frees_the_port(vm):
    with pytest.raises(GuestError, match="cannot mount 'nosuch'"):
        vm.mount("nosuch", "/mnt/nosuch")  # the server refuses the attach name
    assert "/mnt/nosuch" not in vm.guest.live_mounts()
    with pytest.raises(ValueError):
        vm.mount("bad,aname", "/mnt/x")
    with pytest.raises(ValueError):
        vm.mount("l0", "relative/path")
    vm.mount("l0", "/mnt/again")
    code, out, err = vm.sh("cat /mnt/again/hello.txt")
    assert (code, out) == (0, "live\n"), err
    vm.unmount("/mnt/again")
