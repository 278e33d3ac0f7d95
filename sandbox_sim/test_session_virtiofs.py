"""Sessions with ``share="virtiofs"`` (issue 17) without QEMU.

The QEMU side is pure functions: the guest's mount table (``virtiofs TAG ro|rw TARGET`` for a
folder, ``PORT ANAME …`` for an in-memory tree) and the command line (a shared memfd sized
to the guest's RAM, one ``vhost-user-fs-pci`` per folder, no forwarded port for it). The
session side runs for real: a guest factory plays QEMU and the guest kernel on each folder's
vhost-user socket (the test-side front-end and driver of ``test_virtiofs_device.py``), so a
command's FUSE requests reach the folder's export and undo core through the session's own
device servers — in this process (thread share servers) or in each folder's confined
share-server child (process) — one step, undone exactly; a read-only folder answers ``EROFS``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import struct
from types import SimpleNamespace

import pytest

from sandbox.core.safeguard import SafeguardConfig
from sandbox.guest.control import LIVE_MOUNTS_MAX
from sandbox.fuse import abi
from sandbox.fuse import messages as m
from sandbox.session.runtime import Folder, MemoryMount, Session
from sandbox.vm import qemu
from sandbox.vm.guest import NINEP_PORT, GuestMount, mount_table_text, share_devices, virtiofs_tag
from sandbox_sim.oracle import assert_same, snapshot_dir
from sandbox_sim.test_fuse_codec import ref_request
from sandbox_sim.test_fuse_dispatcher import H
from sandbox_sim.test_virtiofs_device import FrontEnd, Guest, fuse_reply, init, open_flags

pytestmark = pytest.mark.timeout(60)


def mounts(tmp_path) -> list[GuestMount]:
    return [GuestMount("0", "/mnt/working/0", False, virtiofs_socket=str(tmp_path / "vfs-0.sock")),
            GuestMount("1", "/mnt/working/1", True, virtiofs_socket=str(tmp_path / "vfs-1.sock")),
            GuestMount("m0", "/mnt/mem", True)]


def test_the_guest_mount_table_says_virtiofs_for_folders_and_9p_for_trees(tmp_path):
    assert mount_table_text(mounts(tmp_path)).splitlines() == [
        "virtiofs sandbox-0 rw /mnt/working/0", "virtiofs sandbox-1 ro /mnt/working/1",
        f"{NINEP_PORT + 2} m0 ro /mnt/mem"]


def test_the_qemu_command_line_has_a_shared_memfd_and_one_device_per_folder(tmp_path):
    kernel, initrd = tmp_path / "vmlinuz", tmp_path / "initrd"
    kernel.write_bytes(b"k")
    initrd.write_bytes(b"i")
    sock = str(tmp_path / "9p.sock")
    fields = share_devices(mounts(tmp_path), sock)
    assert fields["virtiofs"] == [("sandbox-0", str(tmp_path / "vfs-0.sock")), ("sandbox-1", str(tmp_path / "vfs-1.sock"))]
    assert fields["guestfwds"][0] == (NINEP_PORT + 2, sock)  # the tree's port; none for the folders
    assert all(port not in (NINEP_PORT, NINEP_PORT + 1) for port, _ in fields["guestfwds"])
    cmd = qemu.build_command(qemu.VmConfig(kernel=str(kernel), initrd=str(initrd), memory_mb=1536, **fields))
    assert cmd[cmd.index("-object") + 1] == "memory-backend-memfd,id=mem,size=1536M,share=on"
    assert cmd[cmd.index("-numa") + 1] == "node,memdev=mem"
    devices = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-device" and cmd[i + 1].startswith("vhost-user-fs-pci")]
    q = f"queue-size={qemu.VIRTIOFS_QUEUE_SIZE}"
    assert devices == [f"vhost-user-fs-pci,chardev=vfs0,tag=sandbox-0,{q}", f"vhost-user-fs-pci,chardev=vfs1,tag=sandbox-1,{q}"]
    # an empty root port per possible live mount: q35's pcie.0 takes no hot-plugged device
    ports = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-device" and cmd[i + 1].startswith("pcie-root-port")]
    assert ports == [f"pcie-root-port,id={qemu.hotplug_port(k)},bus=pcie.0,chassis={k + 1}"
                     for k in range(LIVE_MOUNTS_MAX)]
    # the default (9P) path is unchanged: no memfd, no device, a port per share
    plain = share_devices([GuestMount("0", "/mnt/working/0", False)], sock)
    assert plain["virtiofs"] == [] and plain["guestfwds"][0] == (NINEP_PORT, sock)
    cmd = qemu.build_command(qemu.VmConfig(kernel=str(kernel), initrd=str(initrd), **plain))
    assert "-object" not in cmd and not any(a.startswith(("vhost-user-fs-pci", "pcie-root-port")) for a in cmd)


def test_tags_fit_the_device_config():
    assert len(virtiofs_tag("l99").encode()) <= qemu.VIRTIOFS_TAG_BYTES_MAX


def test_share_virtiofs_is_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("SANDBOX_SHARE_SERVERS", raising=False)
    with pytest.raises(ValueError, match="guest='vm'"):
        Session([Folder(str(tmp_path))], share="virtiofs", guest="scripted")
    with pytest.raises(ValueError, match="guest='local' serves"):
        Session([Folder(str(tmp_path))], share="virtiofs", guest="local")
    s = Session([Folder(str(tmp_path))], share="virtiofs")
    assert (s.share, s.share_servers) == ("virtiofs", "process")  # a VM's folders stay confined
    assert Session([Folder(str(tmp_path))], guest="scripted").share == "9p"  # other guests keep 9P


def fake_qemu(tmp_path, devices: str):
    """A ``qemu-system-x86_64`` on PATH whose ``-device help`` lists ``devices``."""
    d = tmp_path / "bin"
    d.mkdir()
    q = d / qemu.QEMU
    q.write_text(f"#!/bin/sh\necho '{devices}'\n")  # a shell builtin: PATH has only this directory
    q.chmod(0o755)
    return str(d)


@pytest.mark.parametrize("devices, share", [
    ('name "virtio-9p-pci", bus PCI\nname "vhost-user-fs-pci", bus PCI', "virtiofs"),
    ('name "virtio-9p-pci", bus PCI', "9p"),
])
def test_a_vm_guest_defaults_to_virtiofs_where_qemu_has_the_device(tmp_path, monkeypatch, caplog, devices, share):
    monkeypatch.delenv("SANDBOX_SHARE", raising=False)
    monkeypatch.setenv("PATH", fake_qemu(tmp_path, devices))
    with caplog.at_level("INFO", logger="sandbox.session"):
        s = Session([Folder(str(tmp_path))])
    assert s.share == share
    if share == "9p":  # the fallback says why
        assert "no vhost-user-fs-pci device" in s.share_reason and s.share_reason in caplog.text
    else:
        assert s.share_reason is None
    monkeypatch.setenv("SANDBOX_SHARE", "9p")
    assert Session([Folder(str(tmp_path))]).share == "9p"  # the environment chooses when nobody else did
    assert Session([Folder(str(tmp_path))], share="virtiofs").share == "virtiofs"


def test_no_qemu_means_9p_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.delenv("SANDBOX_SHARE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    s = Session([Folder(str(tmp_path))])
    assert s.share == "9p" and "not installed" in s.share_reason


class DriverGuest:
    """A guest factory's guest: QEMU and the guest kernel on each folder's device socket.
    ``exec(command)`` runs ``scripts[command](drivers)`` on a worker thread; its return value
    is the exit code."""

    accel = accel_reason = boot_s = None

    def __init__(self, scripts):
        self.scripts = scripts
        self.mounts: list[GuestMount] = []
        self.drivers: dict[str, tuple[FrontEnd, Guest]] = {}

    def boot(self, *, socket_path, mounts, loop, timeout_s):
        self.mounts = list(mounts)
        for mt in mounts:
            if mt.virtiofs_socket:
                guest = Guest()
                fe = FrontEnd(mt.virtiofs_socket, guest)
                fe.handshake()
                init(fe, guest)
                self.drivers[mt.target] = (fe, guest)

    async def exec(self, exec_id, command, cwd, env, on_output):
        loop = asyncio.get_running_loop()
        return SimpleNamespace(completed=loop.run_in_executor(None, self._run, command))

    def _run(self, command):
        return {"type": "step_completed", "id": 0, "exit_code": self.scripts[command](self.drivers), "signal": None}

    async def rollback_notify(self, *a, **kw):
        pass

    async def cancel(self, exec_id):
        pass

    async def pause(self):
        return False

    async def resume(self):
        pass

    async def vm_status(self):
        return "running"

    def alive(self):
        return True

    def tail(self, n=20):
        return []

    def stop(self):
        for fe, guest in self.drivers.values():
            fe.close()
            os.close(guest.fd)
        self.drivers.clear()


def mkdir_then_write(fe: FrontEnd, guest: Guest, name: bytes) -> int:
    """MKDIR name, CREATE name/f, WRITE "hello" over the device; the first errno (0: none)."""
    head, at = guest.submit(1, ref_request(m.Mkdir(H(abi.Opcode.MKDIR), 0o755, 0o022, name)), 16 + 128)
    fe.kick_and_wait(1)
    err, _, body = fuse_reply(guest, at, 16 + 128 if guest.peek(at, 4) == (16 + 128).to_bytes(4, "little") else 16)
    if err:
        return -err
    parent = struct.unpack_from("<Q", body)[0]
    create = ref_request(m.Create(H(abi.Opcode.CREATE, parent), os.O_RDWR | os.O_CREAT, 0o644, 0o022, 0, b"f"))
    head, at = guest.submit(1, create, 16 + 128 + 16)
    fe.kick_and_wait(1)
    err, _, body = fuse_reply(guest, at, 160)
    assert err == 0
    nodeid, fh = struct.unpack_from("<Q", body)[0], struct.unpack_from("<Q", body, 128)[0]
    head, at = guest.submit(1, ref_request(m.Write(H(abi.Opcode.WRITE, nodeid), fh, 0, 5, 0, 0, 0, b"hello")), 16 + 8)
    fe.kick_and_wait(1)
    return -fuse_reply(guest, at, 24)[0]


@pytest.mark.parametrize("share_servers", ["thread", "process"])
def test_a_session_serves_its_folders_as_virtiofs_devices_undone_exactly(tmp_path, share_servers):
    work, ro = tmp_path / "work", tmp_path / "ro"
    work.mkdir()
    ro.mkdir()
    (work / "keep").write_bytes(b"k")
    (ro / "keep").write_bytes(b"r")
    before, ro_before = snapshot_dir(str(work)), snapshot_dir(str(ro))
    results = {}

    def write_both(drivers) -> int:
        results["rw"] = mkdir_then_write(*drivers["/mnt/working/0"], b"d")
        results["ro"] = mkdir_then_write(*drivers["/mnt/working/1"], b"d")
        results["mem"] = mkdir_then_write(*drivers["/mnt/mem"], b"d")  # a read-only in-memory tree, served here
        return 0

    guest = DriverGuest({"write": write_both})
    s = Session([Folder(str(work), state_dir=str(tmp_path / "state")), Folder(str(ro), read_only=True)],
                share="virtiofs", guest=lambda run_dir: guest, mounts=[MemoryMount("/mnt/mem", {"a": b"a"})],
                share_servers=share_servers)
    with s:
        assert sorted((mt.aname, bool(mt.virtiofs_socket)) for mt in guest.mounts) == [("0", True), ("1", True),
                                                                                       ("m0", True)]
        st = s.status()
        assert st["share"] == "virtiofs" and len(st["share_server_pids"]) == (2 if share_servers == "process" else 0)
        r = s.run("write")
        assert (r.exit_code, results) == (0, {"rw": 0, "ro": errno.EROFS, "mem": errno.EROFS})
        assert (work / "d" / "f").read_bytes() == b"hello"
        assert_same(ro_before, snapshot_dir(str(ro)), "a read-only folder over virtio-fs")
        assert [h["command"] for h in s.history()] == ["write"]
        s.undo(1)
        assert_same(before, snapshot_dir(str(work)), "undo of a step written over the session's virtio-fs device")
    assert not any(os.path.exists(mt.virtiofs_socket) for mt in guest.mounts if mt.virtiofs_socket)  # the device servers are gone with the session


@pytest.mark.parametrize("share_servers", ["thread", "process"])
def test_virtiofs_direct_io_all_reaches_every_device_of_the_session(tmp_path, share_servers):
    """``virtiofs_direct_io="all"``: the folders' devices (served by the confined children or
    here) and the in-memory trees' (served here) answer a reading open ``FOPEN_DIRECT_IO``;
    the default keeps it cached; ``status()`` says which. Checked before anything starts: an
    unknown mode, or one for a session that does not share over virtio-fs."""
    with pytest.raises(ValueError, match="virtiofs_direct_io must be one of"):
        Session([Folder(str(tmp_path))], share="virtiofs", virtiofs_direct_io="reads")
    with pytest.raises(ValueError, match="needs share='virtiofs'"):
        Session([Folder(str(tmp_path))], share="9p", virtiofs_direct_io="all")
    for mode in ("write-only", "all"):
        work = tmp_path / mode
        work.mkdir()
        (work / "data").write_bytes(b"d")
        seen = {}

        def read_opens(drivers, seen=seen) -> int:
            for target, name in (("/mnt/working/0", b"data"), ("/mnt/mem", b"a")):
                seen[target] = bool(open_flags(*drivers[target], name, os.O_RDONLY) & abi.FOPEN_DIRECT_IO)
            return 0

        guest = DriverGuest({"read": read_opens})
        with Session([Folder(str(work), state_dir=str(tmp_path / f"{mode}.state"))], share="virtiofs",
                     guest=lambda run_dir, guest=guest: guest, mounts=[MemoryMount("/mnt/mem", {"a": b"a"})],
                     share_servers=share_servers, virtiofs_direct_io=mode) as s:
            assert s.status()["virtiofs_direct_io"] == mode
            assert s.run("read").exit_code == 0
        assert seen == {"/mnt/working/0": mode == "all", "/mnt/mem": mode == "all"}, (mode, seen)


@pytest.mark.parametrize("share_servers", ["thread", "process"])
def test_restricted_views_hold_over_the_device(tmp_path, share_servers):
    """``Session.restrict`` (seed 004) narrows what the running device serves, as over 9P: the
    export's provider is swapped and the device's dispatcher reads it at each request —
    outside the view ``EACCES``, a read-only view ``EROFS``, inside it writes land (one step)."""
    work = tmp_path / "work"
    (work / "a").mkdir(parents=True)
    (work / "b").mkdir()
    results = []

    def mkdir_at_root(drivers) -> int:
        results.append(mkdir_then_write(*drivers["/mnt/working/0"], b"d%d" % len(results)))
        return 0

    guest = DriverGuest({"mk": mkdir_at_root})
    s = Session([Folder(str(work), state_dir=str(tmp_path / "state"))], share="virtiofs",
                guest=lambda run_dir: guest, share_servers=share_servers)
    with s:
        s.run("mk")  # the whole folder: written
        s.restrict(s.table.restrict("/mnt/working/0/a"))
        s.run("mk")  # "d1" at the root is outside the view
        s.restrict(s.table.restrict("/mnt/working/0", read_only=True))
        s.run("mk")
        s.restrict(s.table)  # the whole table again (the session's own, not a sub-worker's)
        s.run("mk")
    assert results == [0, errno.EACCES, errno.EROFS, 0]
    assert sorted(os.listdir(work)) == ["a", "b", "d0", "d3"]


@pytest.mark.parametrize("share_servers", ["thread", "process"])
@pytest.mark.parametrize("answer", ["allow", "deny"])
def test_a_safeguard_hold_over_the_session_s_device(tmp_path, share_servers, answer):
    work = tmp_path / "work"
    work.mkdir()
    for i in range(3):
        (work / f"f{i}").write_bytes(b"v")
    before = snapshot_dir(str(work))
    asked, errors = [], []

    def unlink_all(drivers) -> int:
        fe, guest = drivers["/mnt/working/0"]
        for i in range(3):
            head, at = guest.submit(1, ref_request(m.Unlink(H(abi.Opcode.UNLINK), f"f{i}".encode())), 16)
            fe.kick_and_wait(1)  # the held one: answered once decide has answered
            errors.append(-fuse_reply(guest, at, 16)[0])
        return 0 if not any(errors) else 1

    def decide(hold):
        asked.append((hold.kind, sorted(os.listdir(work))))
        return answer

    guest = DriverGuest({"rm": unlink_all})
    s = Session([Folder(str(work), state_dir=str(tmp_path / "state"))], share="virtiofs",
                guest=lambda run_dir: guest, share_servers=share_servers, decide=decide,
                safeguard=SafeguardConfig(delete_threshold=2, timeout_s=30))
    with s:
        r = s.run("rm")
    assert asked == [("delete", ["f1", "f2"])]  # the second deletion waited for the answer
    if answer == "allow":
        assert (r.exit_code, errors, os.listdir(work)) == (0, [0, 0, 0], [])
    else:
        assert r.exit_code == 1 and errors[0] == 0 and errors[1] != 0
        assert_same(before, snapshot_dir(str(work)), "a denied hold over virtio-fs: the step rolled back")
