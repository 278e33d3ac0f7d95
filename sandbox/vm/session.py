"""A VM session: a real Linux guest running commands on the user's folders, every write undoable.

What :meth:`Session.start` puts together (SPEC §3, §5):

* one :class:`~sandbox.core.workspace.Workspace` per read-write working folder (its undo
  store outside the folder), a read-only provider per read-only folder;
* one :class:`~sandbox.ninep.server.NinePServer` on a unix socket in a private run
  directory, exporting folder *i* under the attach name ``"i"``; QEMU's ``guestfwd`` maps
  guest port 564+i to it, and the guest mounts it at ``/mnt/working/i``;
* the guest (``sandbox.vm.image.guest_image``: Debian's kernel, busybox init, the host
  root read-only under an overlay, the shim), booted with the accelerator the probe chose;
* the control channel to the shim, and QMP when it connects.

:meth:`run` makes one command one step: the host opens the step (its id is the host's),
relays ``exec``, takes ``step_started`` as the acknowledgement, and after
``step_completed`` lets the step drain (in-flight 9P requests reach zero or the
quiescence window passes) before it closes — so late writes still belong to it.

Invariants: every exit path of :meth:`start` and :meth:`stop` (errors, Ctrl-C) releases what
was acquired — QEMU is killed and reaped, the server closed, sockets and the run
directory removed, the workspaces closed (their active steps closed, stores unlocked).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..core.safeguard import SafeguardConfig
from ..core.workspace import Workspace, default_state_dir
from ..mounts import Provider
from ..ninep.server import NinePServer, ServerConfig, ServerThread
from . import image as vm_image
from .console import BootError, Console
from .control import ControlClient, ControlClosed
from .qemu import VmConfig, build_command, probe_accel
from .qmp import Qmp

log = logging.getLogger("sandbox.session")
NINEP_PORT = 564
MSIZE = 512 * 1024
BOOT_TIMEOUT_S = 300.0  # TCG on a loaded 2-core machine; KVM boots in about a second
SHIM_TIMEOUT_S = 120.0  # python3 start-up over the 9p host root under TCG is several seconds
NETWORKS = ("disabled", "open", "allowlist")
VM_MODES = ("ephemeral", "persistent")
PERSISTENT_DISK_BYTES = 8 << 30  # sparse


class SessionError(RuntimeError):
    """The session cannot start or go on; the message says why and what was seen."""


@dataclass
class Folder:
    path: str
    read_only: bool = False

    @classmethod
    def parse(cls, spec: str) -> "Folder":
        """``DIR`` or ``DIR:ro`` / ``DIR:rw`` (the CLI's ``--workdir``)."""
        path, sep, mode = spec.rpartition(":")
        if sep and mode in ("ro", "rw"):
            return cls(path, mode == "ro")
        return cls(spec)


@dataclass
class StepResult:
    step_id: int | None  # None for a read-only-only session (nothing to undo)
    exit_code: int
    signal: int | None = None
    cancelled: bool = False


@dataclass
class _Started:
    run_dir: str
    server: ServerThread | None = None
    console: Console | None = None
    control: ControlClient | None = None
    qmp: Qmp | None = None
    workspaces: list = field(default_factory=list)
    providers: list = field(default_factory=list)


def _cidrs(items: list[str]) -> list[str]:
    """Normalised IPv4 networks (``1.2.3.4`` → ``1.2.3.4/32``); ValueError names a bad one."""
    import ipaddress

    out = []
    for item in items:
        try:
            net = ipaddress.ip_network(item.strip(), strict=False)
        except ValueError:
            raise ValueError(f"not an IP address or CIDR: {item!r}") from None
        if net.version != 4:
            raise ValueError(f"only IPv4 is routed into the guest (QEMU user networking): {item!r}")
        out.append(str(net))
    return out


def vm_state_dir(folder: str) -> str:
    """Where a persistent VM's disk lives: beside the first folder's undo store."""
    return os.path.join(os.path.dirname(default_state_dir(folder)), "..", "vm", os.path.basename(default_state_dir(folder)))


class Session:
    def __init__(self, folders: list[Folder], *, network: str = "disabled", allow: list[str] | None = None,
                 vm_mode: str = "ephemeral",
                 memory_mb: int = 1024, cpus: int = 2, safeguard: SafeguardConfig | None = None,
                 decide: Callable | None = None, on_event: Callable[[dict], None] | None = None,
                 progress: Callable[[str], None] | None = None, state_dirs: list[str | None] | None = None):
        if not folders:
            raise ValueError("at least one working folder")
        if len(folders) > 8:
            raise ValueError("at most 8 working folders")
        if network not in NETWORKS:
            raise ValueError(f"network must be one of {', '.join(NETWORKS)}")
        self.allow = _cidrs(allow or []) if network == "allowlist" else []
        if network == "allowlist" and not self.allow:
            raise ValueError("network allowlist needs at least one IP or CIDR")
        if vm_mode not in VM_MODES:
            raise ValueError(f"vm_mode must be one of {', '.join(VM_MODES)}")
        for f in folders:
            if not os.path.isdir(f.path):
                raise ValueError(f"working folder {f.path!r} does not exist or is not a directory")
        self.folders = folders
        self.network = network
        self.vm_mode = vm_mode
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.safeguard = safeguard
        self.decide = decide
        self.on_event = on_event
        self.progress = progress or (lambda msg: log.info("%s", msg))
        self.state_dirs = state_dirs or [None] * len(folders)
        self.accel = None
        self.boot_s: float | None = None
        self._s: _Started | None = None
        self._lock = threading.Lock()  # one command at a time through run()

    # ------------------------------------------------------------------ lifecycle

    @property
    def workspaces(self) -> list[Workspace | None]:
        """Per folder: its Workspace, or None for a read-only folder."""
        return list(self._s.workspaces) if self._s else []

    def guest_path(self, i: int = 0) -> str:
        return f"/mnt/working/{i}"

    def start(self) -> "Session":
        if self._s is not None:
            raise SessionError("the session is already started")
        s = _Started(tempfile.mkdtemp(prefix="sandbox-vm-"))
        self._s = s
        try:
            self._start(s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, s: _Started) -> None:
        self.progress("preparing the guest image (first run: downloading Debian's kernel package) …")
        img = vm_image.guest_image()
        for f, state in zip(self.folders, self.state_dirs):
            if f.read_only:
                s.workspaces.append(None)
                s.providers.append(Provider.read_only_dir(f.path, label=os.path.basename(f.path)))
            else:
                ws = Workspace.open(f.path, state_dir=state, safeguard=self.safeguard, on_event=self.on_event)
                s.workspaces.append(ws)
                s.providers.append(Provider.intercepted(ws, label=os.path.basename(f.path)))
        sock = os.path.join(s.run_dir, "9p.sock")
        server = NinePServer({str(i): p for i, p in enumerate(s.providers)}, ServerConfig(msize_max=1 << 20),
                             decide=self._decide if self.decide else None)
        s.server = ServerThread(server, unix_path=sock).__enter__()
        self.accel = probe_accel(img)
        self.progress(f"booting the guest ({self.accel.accel}{': ' + self.accel.reason if self.accel.reason else ''}) …")
        disk = self._persistent_disk() if self.vm_mode == "persistent" else None
        append = (f"sandbox.folders={len(self.folders)} sandbox.msize={MSIZE} sandbox.net={self.network} "
                  f"sandbox.upper={'disk' if disk else 'tmpfs'} quiet")
        if self.allow:
            append += f" sandbox.allow={','.join(self.allow)}"
        cfg = VmConfig(kernel=img.vmlinuz, initrd=img.initrd, append=append, accel=self.accel.accel, cpu=self.accel.cpu,
                       memory_mb=self.memory_mb, cpus=self.cpus, console="stdio",
                       qmp_socket=os.path.join(s.run_dir, "qmp.sock"),
                       control_socket=os.path.join(s.run_dir, "control.sock"), host_root=True,
                       guestfwds=[(NINEP_PORT + i, sock) for i in range(len(self.folders))],
                       network=self.network, disk=disk)
        t0 = time.monotonic()
        s.console = Console(build_command(cfg))
        try:
            s.console.wait_for("SANDBOX-READY", BOOT_TIMEOUT_S)
        except BootError as e:
            raise SessionError(f"the guest did not boot: {e}") from None
        s.control = ControlClient()
        try:
            s.server.run(s.control.connect(cfg.control_socket, timeout_s=30))
            s.server.run(s.control.wait_ready(SHIM_TIMEOUT_S), timeout_s=SHIM_TIMEOUT_S + 5)
        except Exception as e:
            raise SessionError(f"the guest's shim did not come up ({e}); console:\n" + "\n".join(s.console.tail(30))) from None
        self.boot_s = time.monotonic() - t0
        try:
            qmp = Qmp()
            s.server.run(qmp.connect(cfg.qmp_socket, timeout_s=10))
            s.qmp = qmp
        except Exception as e:  # pause-on-hold is a nicety: without QMP the held replies still block the guest
            log.warning("QMP unavailable (%s): safeguards hold replies without pausing the VM", e)
        self.progress(f"guest ready in {self.boot_s:.1f} s ({self.accel.accel})")

    def _persistent_disk(self) -> str:
        d = os.path.normpath(vm_state_dir(self.folders[0].path))
        os.makedirs(d, exist_ok=True)
        disk = os.path.join(d, "overlay.ext4")
        if not os.path.exists(disk):
            tmp = disk + ".new"
            with open(tmp, "wb") as f:
                f.truncate(PERSISTENT_DISK_BYTES)
            p = subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "sandbox-vm", tmp], capture_output=True, text=True)
            if p.returncode != 0:
                os.unlink(tmp)
                raise SessionError(f"cannot make the persistent VM disk: {p.stderr.strip()}")
            os.rename(tmp, disk)
        return disk

    def _guest_sync(self, s: _Started) -> None:
        """``sync`` in the guest, outside any step (it writes no working folder)."""
        async def go():
            ex = await s.control.exec(-1, "sync", "/", {})
            await asyncio.wait_for(ex.completed, 30)

        s.server.run(go(), timeout_s=40)

    def reset(self) -> None:
        """Forget a persistent VM's disk (the next start boots a fresh one). Not while running."""
        if self._s is not None:
            raise SessionError("stop the session before resetting its VM")
        shutil.rmtree(os.path.normpath(vm_state_dir(self.folders[0].path)), ignore_errors=True)

    def stop(self) -> None:
        """Shut everything down; safe to call more than once and after a failed start."""
        s, self._s = self._s, None
        if s is None:
            return
        errors = []
        if s.server is not None and s.control is not None and self.vm_mode == "persistent":
            try:  # the guest's page cache must reach the persistent disk before QEMU goes
                self._guest_sync(s)
            except Exception as e:
                log.warning("could not sync the persistent disk before stopping: %s", e)
        if s.server is not None:
            try:
                if s.control is not None:
                    s.server.run(s.control.close(), timeout_s=10)
                if s.qmp is not None:
                    s.server.run(s.qmp.close(), timeout_s=10)
            except Exception as e:
                errors.append(e)
        if s.console is not None:
            s.console.terminate(timeout_s=10)
        if s.server is not None:
            try:
                s.server.__exit__(None, None, None)
            except Exception as e:
                errors.append(e)
        for p in s.providers:
            p.close()
        for ws in s.workspaces:
            if ws is not None:
                ws.close()
        shutil.rmtree(s.run_dir, ignore_errors=True)
        if errors:
            log.warning("errors while stopping the session: %s", errors)

    def __enter__(self) -> "Session":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ commands

    def run(self, command: str, on_output: Callable[[str, str], None] | None = None, *, cwd: str | None = None,
            env: dict[str, str] | None = None, cancel: threading.Event | None = None) -> StepResult:
        """Run ``command`` in the guest's shell as one step of every read-write folder.

        ``on_output(stream, text)`` is called as output arrives (on the session's I/O
        thread). Setting ``cancel`` cancels the command (SIGTERM, then SIGKILL)."""
        s = self._require()
        with self._lock:
            ids = [ws.begin_step(command) if ws is not None else None for ws in s.workspaces]
            step_id = next((i for i in ids if i is not None), None)
            exec_id = step_id if step_id is not None else int(time.time() * 1000) % (1 << 31)
            result = None
            try:
                try:
                    ex = s.server.run(s.control.exec(exec_id, command, cwd or self.guest_path(0), env or {}, on_output))
                    done = self._wait(ex.completed, cancel, exec_id)
                except (ControlClosed, RuntimeError) as e:  # the shim went away, or refused the command
                    raise SessionError(f"{e}; console:\n" + "\n".join(s.console.tail(20) if s.console else [])) from None
                result = StepResult(step_id, int(done.get("exit_code", 1)), done.get("signal"),
                                    cancelled=cancel is not None and cancel.is_set())
                return result
            finally:
                code = result.exit_code if result is not None else 1
                for ws, sid in zip(s.workspaces, ids):
                    if ws is not None and sid is not None:
                        self._close_step(ws, sid, code)

    def _wait(self, fut, cancel: threading.Event | None, exec_id: int) -> dict:
        s = self._s
        sent_cancel = False

        async def wait_some():
            return await asyncio.wait_for(asyncio.shield(fut), 0.2)

        while True:
            try:
                return s.server.run(wait_some(), timeout_s=30)
            except (asyncio.TimeoutError, TimeoutError):
                pass
            except KeyboardInterrupt:
                if cancel is None:
                    cancel = threading.Event()
                cancel.set()
            if cancel is not None and cancel.is_set() and not sent_cancel:
                s.server.run(s.control.cancel(exec_id))
                sent_cancel = True
            if s.console is not None and not s.console.alive():
                raise SessionError("the VM exited while the command was running; console:\n" + "\n".join(s.console.tail(20)))

    def _close_step(self, ws: Workspace, step_id: int, exit_code: int) -> None:
        """step_completed: drain late writes (in flight → 0, or the quiescence window), then close."""
        with ws.interceptor.lock:
            if ws.tracker.active is None or ws.tracker.active.id != step_id:
                return
            ws.complete_step(step_id, exit_code)
        drained = threading.Event()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            ws.poll()
            if ws.tracker.active is None or ws.tracker.active.id != step_id:
                return
            drained.wait(0.02)
        with ws.interceptor.lock:
            ws.interceptor.close_now()

    # ------------------------------------------------------------------ undo

    def undo(self, n: int = 1, force: bool = False, folder: int = 0) -> dict:
        """Roll back the newest ``n`` steps of ``folder`` while the guest runs; the guest sees
        the restored files at once (cache=none) and the shim is told."""
        s = self._require()
        ws = s.workspaces[folder]
        if ws is None:
            raise SessionError(f"working folder {folder} is read-only: it has no undo history")
        result = ws.rollback(n, force=force)
        for sid in result.get("step_ids", []):
            try:
                s.server.run(s.control.rollback_notify(sid), timeout_s=10)
            except Exception as e:
                log.warning("could not notify the guest of the rollback: %s", e)
        return result

    def status(self) -> dict:
        """What is running: the accelerator and why, boot time, folders, and the VM's QMP state."""
        s = self._s
        vm = "stopped"
        if s is not None:
            vm = "running"
            if s.qmp is not None:
                try:
                    vm = s.server.run(s.qmp.status(), timeout_s=10)
                except Exception as e:
                    vm = f"unknown ({e})"
        return {
            "vm": vm,
            "accel": self.accel.accel if self.accel else None,
            "accel_reason": self.accel.reason if self.accel else None,
            "boot_s": self.boot_s,
            "network": self.network,
            "allow": list(self.allow),
            "vm_mode": self.vm_mode,
            "folders": [{"path": os.path.realpath(f.path), "guest_path": self.guest_path(i), "read_only": f.read_only}
                        for i, f in enumerate(self.folders)],
        }

    def history(self, folder: int = 0) -> list[dict]:
        ws = self._require().workspaces[folder]
        return [] if ws is None else ws.history()

    def _require(self) -> _Started:
        if self._s is None:
            raise SessionError("the session is not running")
        return self._s

    # ------------------------------------------------------------------ safeguards

    async def _decide(self, hold) -> str:
        """Pause the VM over QMP (when available) while the user decides; resume after."""
        s = self._s
        paused = False
        if s is not None and s.qmp is not None:
            try:
                await s.qmp.stop()
                paused = True
            except Exception as e:
                log.warning("could not pause the VM: %s", e)
        try:
            if asyncio.iscoroutinefunction(self.decide):
                return await self.decide(hold)
            # a prompt blocks: keep the server's loop (reads, other folders) going meanwhile
            return await asyncio.get_running_loop().run_in_executor(None, self.decide, hold)
        finally:
            if paused:
                try:
                    await s.qmp.cont()
                except Exception as e:
                    log.warning("could not resume the VM: %s", e)
