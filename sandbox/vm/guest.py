"""The guest a :class:`~sandbox.session.runtime.Session` runs commands in.

A guest mounts the session's shares (one 9P export each, reached through the server's
unix socket) at their guest paths and runs commands, relaying output and exit codes.
Two implementations share one interface:

* :class:`VmGuest` — a real Linux VM in QEMU (SPEC §5): Debian's kernel, busybox init,
  a guest root without host data (the host's ``/usr`` read-only plus a synthesized root
  skeleton, :mod:`sandbox.vm.guestroot`) under an overlay, the shim on the control
  channel, QMP;
* ``sandbox.scripted.guest.ScriptedGuest`` — a test double for the guest only: real 9P
  clients on the same server socket running small file-operation scripts.

The interface (what :class:`Session` calls; coroutines run on the 9P server's loop):
``boot(socket_path=, mounts=, loop=, timeout_s=)`` (blocking), ``exec(exec_id, command, cwd,
env, on_output)`` → an object whose ``completed`` future resolves to
``{"exit_code", "signal"}``, ``cancel(exec_id)``, ``rollback_notify(step_id)``,
``pause() -> bool`` / ``resume()``, ``vm_status()``, ``alive()``, ``tail(n)``, ``stop()``,
``mount(GuestMount)`` / ``unmount(target)`` (live mounts after boot; coroutines), and the
attributes ``accel``/``accel_reason``/``boot_s``.

Invariants of :class:`VmGuest`: :meth:`VmGuest.stop` releases everything :meth:`boot`
acquired, whatever point boot reached (QEMU killed and reaped, channels closed).

Live mounts: the VM boots with ``LIVE_MOUNTS_MAX`` spare forwarded ports
(:func:`sandbox.guest.control.live_mount_ports`), each one connection to the 9P server
socket, attached to nothing until used. :meth:`VmGuest.mount` takes a free port, sends the
``mount`` control message (the shim mounts 9P with that attach name at the target) and
keeps the port until :meth:`VmGuest.unmount` succeeds. A port whose mount ended in a
timeout or a lost channel is never reused (it may still carry a 9P session).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from ..guest import control as proto
from . import guestroot, imageroot
from .console import BootError, Console
from .control import ControlClient, ControlClosed, MountError
from .qemu import VIRTIOFS_QUEUE_SIZE, VmConfig, build_command, hotplug_port, probe_accel
from .qmp import Qmp

log = logging.getLogger("sandbox.session")
NINEP_PORT = proto.NINEP_PORT
LIVE_MOUNTS_MAX = proto.LIVE_MOUNTS_MAX
MSIZE = proto.MSIZE_DEFAULT
BOOT_TIMEOUT_S = 300.0  # TCG on a loaded 2-core machine; KVM boots in about a second
SHIM_TIMEOUT_S = 120.0  # python3 start-up over the 9p host /usr under TCG is several seconds
#: the kinds of guest root (kernel command line ``sandbox.rootfs=``): the host's /usr
#: (:mod:`sandbox.vm.guestroot`) or a cached Debian root (:mod:`sandbox.vm.imageroot`)
GUEST_ROOTS = ("host-usr", "image")


class GuestError(RuntimeError):
    """The guest cannot start or go on; the message says why and what was seen."""


@dataclass(frozen=True)
class GuestMount:
    """One share as the guest mounts it: 9P attach name, guest path, read-only or not."""

    aname: str
    target: str
    read_only: bool
    #: the unix socket of the 9P server serving it; None: ``boot``'s ``socket_path`` (issue 13:
    #: a session's folders may be served by a share-server process, its in-memory trees by the agent)
    socket: str | None = None
    #: -- virtio-fs (issue 17): the vhost-user socket of the device serving it; the guest then
    #: mounts ``-t virtiofs`` the tag :func:`virtiofs_tag` instead of 9P (``socket`` unused)
    virtiofs_socket: str | None = None


#: the first word of a virtio-fs line of the guest's mount table (a 9P line has its port there)
VIRTIOFS_WORD = "virtiofs"


def virtiofs_tag(aname: str) -> str:
    """The virtio-fs tag of the share with attach name ``aname`` (one word, ≤ 36 bytes)."""
    return f"sandbox-{aname}"


def mount_table_text(mounts: list[GuestMount], first_port: int = NINEP_PORT) -> str:
    """The guest's mount table (fw_cfg ``opt/sandbox/mounts``): ``PORT ANAME ro|rw TARGET``
    per line, in the order given (shallowest first); share *k* is on port ``first_port + k``.
    A virtio-fs share (``virtiofs_socket`` set) is ``virtiofs TAG ro|rw TARGET``."""
    lines = []
    for k, m in enumerate(mounts):
        if any(c in m.target for c in "\n\r\0") or not m.target.startswith("/"):
            raise ValueError(f"guest mount target {m.target!r} must be an absolute path on one line")
        if not m.aname or any(c.isspace() for c in m.aname):
            raise ValueError(f"attach name {m.aname!r} must be one word")
        first, name = (VIRTIOFS_WORD, virtiofs_tag(m.aname)) if m.virtiofs_socket else (first_port + k, m.aname)
        lines.append(f"{first} {name} {'ro' if m.read_only else 'rw'} {m.target}")
    return "\n".join(lines) + "\n"


def share_devices(mounts: list[GuestMount], socket_path: str) -> dict:
    """The :class:`VmConfig` fields that carry ``mounts``: a 9P share is a forwarded port to its
    server's socket (share *k* on ``NINEP_PORT + k``, then the spare live-mount ports); a
    virtio-fs share (issue 17) a ``vhost-user-fs-pci`` device with tag :func:`virtiofs_tag`."""
    vfs = [(virtiofs_tag(m.aname), m.virtiofs_socket) for m in mounts if m.virtiofs_socket]
    return {"guestfwds": [(NINEP_PORT + k, m.socket or socket_path) for k, m in enumerate(mounts) if not m.virtiofs_socket]
            + [(port, socket_path) for port in proto.live_mount_ports()],
            "virtiofs": vfs,
            # a virtio-fs guest's live mounts are hot-plugged devices: one empty root port each
            "hotplug_ports": proto.LIVE_MOUNTS_MAX if vfs else 0}


HOTPLUG_REMOVE_S = 30.0  # a hot-unplugged device the guest has not released by then: its port is not reused
HOTPLUG_POLL_S = 0.05


def _hot_chardev(k: int) -> str:
    return f"vfshot{k}"


def _hot_device(k: int) -> str:
    return f"vfsdev{k}"


class VmGuest:
    """A QEMU guest (see the module docstring)."""

    def __init__(self, *, run_dir: str, network: str = "disabled", allow: list[str] | None = None,
                 memory_mb: int = 1024, cpus: int = 2, disk: str | None = None, progress=None,
                 on_refused=None, net_resolve=None, net_dial=None, guest_root: str = "host-usr",
                 user_ids: tuple[int, int] = (guestroot.USER_ID_FALLBACK,) * 2, as_root: bool = False,
                 guest_packages=None):
        if guest_root not in GUEST_ROOTS:
            raise ValueError(f"guest_root must be one of {', '.join(GUEST_ROOTS)}, not {guest_root!r}")
        self.guest_root = guest_root
        #: the image root's packages (validated; None for host-usr)
        self.guest_packages = imageroot.validate_packages(guest_packages) if guest_root == "image" else None
        self.run_dir = run_dir
        # -- network allowlist (issue 13): the host-side proxy (sandbox.vm.netproxy) is the guest's
        # only egress; ``on_refused(message, destination)`` hears each refusal, ``net_resolve`` maps
        # a name to IPv4 addresses host-side (default: the host's resolver), ``net_dial`` where an
        # allowed address is connected (tests: onto the loopback)
        self.on_refused = on_refused
        self.net_resolve = net_resolve
        self.net_dial = net_dial
        self.netproxy = None
        # -- the guest user (issue 13): commands run as `agent` with these ids unless as_root
        self.user_ids = user_ids
        self.as_root = as_root
        self.network = network
        self.allow = list(allow or [])
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.disk = disk
        self.progress = progress or (lambda msg: log.info("%s", msg))
        self.accel: str | None = None
        self.accel_reason: str | None = None
        self.boot_s: float | None = None
        self.console: Console | None = None
        self.control: ControlClient | None = None
        self.qmp: Qmp | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, int] = {}  # live mount target → its forwarded port (also while mounting)
        self._ports_lost: set[int] = set()  # state unknown after a timeout: never reused
        # -- virtio-fs (issue 17): live mounts as hot-plugged devices, one per empty root port
        self.hotplug_ports = 0  # set at boot: the root ports the VM has (0: live mounts over 9P)
        self._slots: dict[str, int] = {}  # live mount target → its root port (also while mounting)
        self._slots_lost: set[int] = set()  # a device that would not go: its port is never reused

    @property
    def mounts_virtiofs(self) -> bool:
        """Live mounts may be virtio-fs devices (``GuestMount.virtiofs_socket``): hot-plugged."""
        return self.hotplug_ports > 0 and self.qmp is not None

    def _run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def boot(self, *, socket_path: str, mounts: list[GuestMount], loop: asyncio.AbstractEventLoop,
             timeout_s: float = BOOT_TIMEOUT_S) -> None:
        from . import image as vm_image

        self._loop = loop
        self.progress("preparing the guest image (first run: downloading Debian's kernel package) …")
        img = vm_image.guest_image()
        choice = probe_accel(img)
        self.accel, self.accel_reason = choice.accel, choice.reason
        self.progress(f"booting the guest ({choice.accel}{': ' + choice.reason if choice.reason else ''}) …")
        table = os.path.join(self.run_dir, "mounts")
        with open(table, "w") as f:
            f.write(mount_table_text(mounts))
        # -- guest root (issue 13): a /usr (the host's, or a cached image root's) and a
        # per-session skeleton, both read-only
        skeleton = os.path.join(self.run_dir, "rootskel")
        try:
            if self.guest_root == "image":
                root = imageroot.ensure_root(list(self.guest_packages), progress=self.progress)
                guestroot.build_skeleton(skeleton, uid=self.user_ids[0], gid=self.user_ids[1], host_root=root,
                                         etc_entries=imageroot.etc_entries(root))
                usr = (imageroot.IMAGE_USR_TAG, os.path.join(root, "usr"))
            else:
                guestroot.build_skeleton(skeleton, uid=self.user_ids[0], gid=self.user_ids[1])
                usr = (guestroot.HOST_USR_TAG, "/usr")
        except (guestroot.GuestRootError, OSError) as e:
            raise GuestError(f"cannot make the guest root: {e}") from None
        virtfs = [usr, (guestroot.SKELETON_TAG, skeleton)]
        append = (f"sandbox.msize={MSIZE} sandbox.vfs_ra_kb={proto.VIRTIOFS_READ_AHEAD_KB} "
                  f"sandbox.net={self.network} sandbox.rootfs={self.guest_root} "
                  f"sandbox.upper={'disk' if self.disk else 'tmpfs'} quiet")
        # -- network allowlist (issue 13): the guest learns nothing of the list; the host enforces it
        fwd_cmds = []
        if self.network == "allowlist":
            from . import netproxy

            self.netproxy = netproxy.NetProxy(netproxy.AllowList.parse(self.allow), resolve=self.net_resolve,
                                              on_refused=self.on_refused, dial=self.net_dial)
            psock, dsock = os.path.join(self.run_dir, "proxy.sock"), os.path.join(self.run_dir, "dns.sock")
            self._run(self.netproxy.start(psock, dsock))
            fwd_cmds = [(netproxy.PROXY_PORT, netproxy.relay_command(psock)),
                        (netproxy.DNS_PORT, netproxy.relay_command(dsock))]
        # -- the guest user (issue 13)
        append += f" sandbox.uid={self.user_ids[0]} sandbox.gid={self.user_ids[1]}" + (" sandbox.root=1" if self.as_root else "")
        cfg = VmConfig(kernel=img.vmlinuz, initrd=img.initrd, append=append, accel=choice.accel, cpu=choice.cpu,
                       memory_mb=self.memory_mb, cpus=self.cpus, console="stdio",
                       qmp_socket=os.path.join(self.run_dir, "qmp.sock"),
                       control_socket=os.path.join(self.run_dir, "control.sock"), virtfs_ro=virtfs,
                       **share_devices(mounts, socket_path),
                       fw_cfg=[("opt/sandbox/mounts", table)], network=self.network, disk=self.disk,
                       guestfwd_cmds=fwd_cmds)
        self.hotplug_ports = cfg.hotplug_ports
        t0 = time.monotonic()
        self.console = Console(build_command(cfg))
        try:
            self.console.wait_for("SANDBOX-READY", timeout_s)
        except BootError as e:
            raise GuestError(f"the guest did not boot: {e}") from None
        self.control = ControlClient()
        try:
            self._run(self.control.connect(cfg.control_socket, timeout_s=30))
            self._run(self.control.wait_ready(SHIM_TIMEOUT_S), timeout_s=SHIM_TIMEOUT_S + 5)
        except Exception as e:
            raise GuestError(f"the guest's shim did not come up ({e}); console:\n" + "\n".join(self.console.tail(30))) from None
        self.boot_s = time.monotonic() - t0
        try:
            qmp = Qmp()
            self._run(qmp.connect(cfg.qmp_socket, timeout_s=10))
            self.qmp = qmp
        except Exception as e:  # pause-on-hold is a nicety: without QMP the held replies still block the guest
            log.warning("QMP unavailable (%s): safeguards hold replies without pausing the VM", e)
        self.progress(f"guest ready in {self.boot_s:.1f} s ({self.accel})")

    # ------------------------------------------------------------------ commands

    async def exec(self, exec_id: int, command: str, cwd: str, env: dict[str, str], on_output):
        return await self.control.exec(exec_id, command, cwd, env, on_output)

    async def cancel(self, exec_id: int) -> None:
        await self.control.cancel(exec_id)

    async def rollback_notify(self, step_id: int, paths: list[dict] | None = None, **undo) -> None:
        await self.control.rollback_notify(step_id, paths, **undo)

    async def sync(self) -> None:
        """``sync`` in the guest, outside any step (it writes no working folder)."""
        ex = await self.control.exec(-1, "sync", "/", {})
        await asyncio.wait_for(ex.completed, 30)

    # ------------------------------------------------------------------ live mounts

    async def mount(self, m: GuestMount) -> None:
        """Mount export ``m.aname`` at ``m.target`` in the running guest (read-only if asked).
        Raises GuestError (no free port, the target is taken, the guest's reason) or
        ValueError (a target or attach name the protocol refuses)."""
        if self.control is None:
            raise GuestError("the guest is not running")
        proto.check_target(m.target)
        proto.check_aname(m.aname)
        if m.target in self._live or m.target in self._slots:
            raise GuestError(f"a live mount is already at {m.target}")
        if m.virtiofs_socket:
            return await self._mount_virtiofs(m)
        busy = set(self._live.values()) | self._ports_lost
        free = [p for p in proto.live_mount_ports() if p not in busy]
        if not free:
            raise GuestError(f"no free port for a live mount: {proto.LIVE_MOUNTS_MAX} at most (LIVE_MOUNTS_MAX)")
        port = free[0]
        self._live[m.target] = port  # reserved before the first await
        try:
            await self.control.mount(port=port, aname=m.aname, target=m.target, read_only=m.read_only, msize=MSIZE)
        except MountError as e:
            del self._live[m.target]
            raise GuestError(f"cannot mount {m.aname!r} at {m.target}: {e}") from None
        except (TimeoutError, ControlClosed) as e:
            del self._live[m.target]
            self._ports_lost.add(port)
            raise GuestError(f"mounting {m.aname!r} at {m.target}: {e or type(e).__name__}") from None

    async def unmount(self, target: str) -> None:
        """Unmount the live mount at ``target``; its port is free again. A busy mount stays
        (GuestError with the guest's EBUSY)."""
        if self.control is None:
            raise GuestError("the guest is not running")
        if target in self._slots:
            return await self._unmount_virtiofs(target)
        if target not in self._live:
            raise GuestError(f"no live mount at {target}")
        await self._shim_unmount(target, self._live, self._ports_lost)
        del self._live[target]

    async def _shim_unmount(self, target: str, held: dict, lost: set) -> None:
        """The shim unmounts ``target``. If the guest does not answer, what ``held`` gave it
        (a 9P port, a hot-plug slot) is taken out and noted ``lost``: never handed out again."""
        try:
            await self.control.unmount(target)
        except MountError as e:
            raise GuestError(f"cannot unmount {target}: {e}") from None
        except (TimeoutError, ControlClosed) as e:
            lost.add(held.pop(target))
            raise GuestError(f"unmounting {target}: {e or type(e).__name__}") from None

    # -- virtio-fs (issue 17): a live mount as a hot-plugged vhost-user-fs-pci
    async def _mount_virtiofs(self, m: GuestMount) -> None:
        """QMP ``chardev-add`` (a client of the device server's socket) and ``device_add`` of a
        ``vhost-user-fs-pci`` on a free root port, then the shim mounts its tag. On failure
        the device and chardev are taken away again."""
        if not self.mounts_virtiofs:
            raise GuestError("this guest has no hot-plug ports: a live mount over virtio-fs needs a virtio-fs session")
        busy = set(self._slots.values()) | self._slots_lost
        free = [k for k in range(self.hotplug_ports) if k not in busy]
        if not free:
            raise GuestError(f"no free hot-plug port for a live mount: {self.hotplug_ports} at most")
        k = free[0]
        self._slots[m.target] = k  # reserved before the first await
        tag = virtiofs_tag(m.aname)
        try:
            await self.qmp.execute("chardev-add", {"id": _hot_chardev(k), "backend": {"type": "socket", "data": {
                "addr": {"type": "unix", "data": {"path": m.virtiofs_socket}}, "server": False}}})
            try:
                await self.qmp.execute("device_add", {"driver": "vhost-user-fs-pci", "id": _hot_device(k),
                                                      "chardev": _hot_chardev(k), "tag": tag, "bus": hotplug_port(k),
                                                      "queue-size": VIRTIOFS_QUEUE_SIZE})
            except Exception:
                await self._remove_chardev(k)
                raise
        except Exception as e:
            del self._slots[m.target]
            raise GuestError(f"cannot hot-plug a virtio-fs device for {m.target}: {e}") from None
        try:
            await self.control.mount(port=proto.live_mount_ports()[0], aname=m.aname, target=m.target,
                                     read_only=m.read_only, tag=tag)
        except (MountError, TimeoutError, ControlClosed) as e:
            await self._unplug(m.target, k)
            raise GuestError(f"cannot mount {m.aname!r} at {m.target}: {e or type(e).__name__}") from None

    async def _unmount_virtiofs(self, target: str) -> None:
        k = self._slots[target]
        await self._shim_unmount(target, self._slots, self._slots_lost)
        await self._unplug(target, k)

    async def _unplug(self, target: str, k: int) -> None:
        """``device_del``, then wait (at most :data:`HOTPLUG_REMOVE_S`) until the guest has
        released the device (it leaves ``/machine/peripheral``), then ``chardev-remove``. A
        device still there after that: its port is never reused (logged)."""
        del self._slots[target]
        try:
            await self.qmp.execute("device_del", {"id": _hot_device(k)})
            deadline = time.monotonic() + HOTPLUG_REMOVE_S
            while any(p.get("name") == _hot_device(k) for p in await self.qmp.execute("qom-list", {"path": "/machine/peripheral"})):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the guest did not release {_hot_device(k)} within {HOTPLUG_REMOVE_S:g} s")
                await asyncio.sleep(HOTPLUG_POLL_S)
            await self._remove_chardev(k)
        except Exception as e:
            self._slots_lost.add(k)
            log.warning("hot-plug port %d is not reused: %s", k, e)

    async def _remove_chardev(self, k: int) -> None:
        try:
            await self.qmp.execute("chardev-remove", {"id": _hot_chardev(k)})
        except Exception as e:
            log.warning("chardev-remove %s: %s", _hot_chardev(k), e)

    def live_mounts(self) -> dict[str, int]:
        """Live mount targets and their forwarded ports."""
        return dict(self._live)

    async def pause(self) -> bool:
        if self.qmp is None:
            return False
        await self.qmp.stop()
        return True

    async def resume(self) -> None:
        if self.qmp is not None:
            await self.qmp.cont()

    async def vm_status(self) -> str:
        if self.qmp is None:
            return "running" if self.alive() else "stopped"
        return await self.qmp.status()

    def alive(self) -> bool:
        return self.console is not None and self.console.alive()

    def tail(self, n: int = 20) -> list[str]:
        return self.console.tail(n) if self.console is not None else []

    def stop(self) -> None:
        errors = []
        if self._loop is not None:
            if self.control is not None and self.disk is not None:
                try:  # the guest's page cache must reach the persistent disk before QEMU goes
                    self._run(self.sync(), timeout_s=40)
                except Exception as e:
                    log.warning("could not sync the persistent disk before stopping: %s", e)
            for closer in (self.control, self.qmp):
                if closer is not None:
                    try:
                        self._run(closer.close(), timeout_s=10)
                    except Exception as e:
                        errors.append(e)
        self.control = self.qmp = None
        if self.console is not None:
            self.console.terminate(timeout_s=10)
        if self.netproxy is not None and self._loop is not None:  # -- network allowlist (issue 13)
            try:
                self._run(self.netproxy.close(), timeout_s=10)
            except Exception as e:
                errors.append(e)
            self.netproxy = None
        if errors:
            log.warning("errors while stopping the guest: %s", errors)
