"""A session: a guest running commands on the user's folders, every write undoable.

What :meth:`Session.start` puts together (SPEC §3, §5):

* the **mount table** (:class:`~sandbox.mounts.table.MountTable`): every working folder and
  every in-memory tree at its guest path (folders default to ``/mnt/working/<i>``);
* one :class:`~sandbox.core.workspace.Workspace` per read-write working folder (its undo
  store outside the folder), a read-only provider per read-only folder, an in-memory
  provider per injected tree (seed 000: never undo-tracked);
* one :class:`~sandbox.ninep.server.NinePServer` on a unix socket in a private run
  directory, exporting each share under its attach name (folder *i* is ``"i"``, tree *j*
  is ``"m<j>"``);
* for each read-write folder, when ``external_policy`` is set, the external-modification
  watcher (:mod:`sandbox.barriers.watch`): the workspace's host filesystem records the
  sandbox's own writes (:mod:`sandbox.barriers.journal`), so only changes made by
  something else are reported — ``barrier`` places an undo barrier, ``warn`` only
  reports, ``lock`` also bind-mounts the folder read-only for everyone else
  (:mod:`sandbox.barriers.lock`);
* the session's one :class:`~sandbox.serving.holds.HoldBroker` (:attr:`Session.holds`):
  every safeguard hold of every folder is registered with it when the undo core reports
  it (``event.safeguard_triggered`` carries ``timeout_seconds`` and ``directory``); the
  server's gates wait on it; embedders subscribe and answer through it; the VM is paused
  while any hold is pending and resumed when none is; ``decide`` is subscribed to it;
  :meth:`stop` denies what is still pending.
* the guest (:class:`~sandbox.session.guest.Guest`): a QEMU VM, the scripted guest, the
  local guest (:mod:`sandbox.local`: host commands on FUSE mounts of the same exports, each
  folder at its own path; undo, not isolation), or a caller's factory; the share transport
  is ``share="virtiofs"`` for a VM where QEMU offers it (else ``"9p"``, the reason logged): each
  working folder and in-memory tree a virtio-fs device served from the same export, on the loop
  of the 9P server serving it (the share-server child's in process mode); live mounts are
  hot-plugged devices; ``"local"``: FUSE on the host, with the local guest.

**Live mounts** (seed 000, :meth:`Session.mount`/:meth:`Session.unmount`): after start, a
``{rel: bytes}`` dict or a :class:`~sandbox.mounts.vfs.VirtualFileSystem` becomes a new
export (attach name ``l<k>``) on the running server, enters the mount table (so listings
see it) and the guest mounts it at once. At most :data:`LIVE_MOUNTS_MAX`; never undo-tracked
and never persisted; gone when the session stops.

:meth:`run` makes one command one step: the host opens the step (its id is the host's),
relays ``exec``, and after ``step_completed`` lets the step drain (in-flight 9P requests
reach zero or the quiescence window passes) before it closes — so late writes still
belong to it.

Invariants: every exit path of :meth:`start` and :meth:`stop` (errors, Ctrl-C) releases what
was acquired — the guest stopped, the server closed, watchers stopped, locks undone,
sockets and the run directory removed, the workspaces closed (active steps closed,
stores unlocked).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..core.safeguard import SafeguardConfig
from ..guest.control import LIVE_MOUNTS_MAX  # the guest's spare share ports bound the live mounts
from ..core.store import Limits
from ..core.workspace import Workspace, default_state_dir
from ..fuse import DIRECT_IO_MODES
from ..fuse.dispatcher import ATTR_VALID_S, ENTRY_VALID_S
from ..limits import ServerLimits
from ..mounts import Provider, memory_tree
from ..mounts.identity import OwnerMap
from ..mounts.table import MEMORY, Mount, MountError, MountTable, PathDenied, check_mount_points, guest_path
from ..mounts.vfs import is_vfs, vfs_tree
from ..ninep.server import NinePServer, ServerConfig, ServerThread
from ..serving.holds import HoldBroker
from ..serving.remote import RemoteWorkspace, ShareProcess
from ..serving.remotefs import remote_provider
from ..serving.workspaces import OpenedWorkspace, open_workspace, watch_workspace  # noqa: F401 (re-exported)
from ..vm.control import ControlClosed
from ..vm import guestroot, imageroot
from ..vm.guest import BOOT_TIMEOUT_S, GUEST_ROOTS, GuestError, GuestMount, VmGuest
from .guest import check_share

log = logging.getLogger("sandbox.session")
NETWORKS = ("disabled", "open", "allowlist")
VM_MODES = ("ephemeral", "persistent")
EXTERNAL_POLICIES = ("barrier", "warn", "lock")
SHARE_SERVERS = ("process", "thread")  # -- confined share servers (issue 13)
SHARE_SERVERS_ENV = "SANDBOX_SHARE_SERVERS"  # the default of share_servers when it is not given
FOLDERS_MAX = 8
LIVE_MOUNT_TIMEOUT_S = 60.0  # the guest mounting (or unmounting) one live mount
MEMORY_MOUNTS_MAX = 8
PERSISTENT_DISK_BYTES = 8 << 30  # sparse


# -- stale run directories (issue 13)
RUN_DIR_PREFIX = "sandbox-vm-"
RUN_LOCK_NAME = "owner.lock"
STALE_RUN_DIRS_MAX = 256  # looked at per start; the rest wait for the next start


# -- virtio-fs (issue 17)
#: how long after a rollback the guest of a virtio-fs session may still use entries and
#: attributes its kernel cached before it: the device's timeouts (the dispatcher's 1 s) and a
#: margin for replies the guest had not yet taken when the rollback ended. Session.undo returns
#: this long after the rollback
VIRTIOFS_UNDO_MARGIN_S = 0.25
VIRTIOFS_UNDO_SETTLE_S = max(ENTRY_VALID_S, ATTR_VALID_S) + VIRTIOFS_UNDO_MARGIN_S
SHARE_ENV = "SANDBOX_SHARE"  # the default of share when it is not given (VM guests only)


def default_share(guest) -> tuple[str, str | None]:
    """``(share, why not virtio-fs)`` for a session not told its share: ``$SANDBOX_SHARE`` if
    set (a VM guest), else virtio-fs for a VM guest where QEMU and the kernel offer it (else
    9P, with the reason, logged), 9P for every other guest."""
    if guest != "vm":
        return "9p", None
    if os.environ.get(SHARE_ENV):
        return os.environ[SHARE_ENV], None
    from ..vm.qemu import virtiofs_unavailable

    reason = virtiofs_unavailable()
    if reason is None:
        return "virtiofs", None
    log.info("the VM's shares go over 9P: %s", reason)
    return "9p", reason


def new_run_dir(base: str | None = None) -> tuple[str, int]:
    """A private run directory (sockets, mount table) and the descriptor that holds its
    ``flock``: the lock lives exactly as long as the owning process — the kernel drops it
    however the owner dies — so a directory whose lock can be taken is stale. The lock
    file is locked before it gets its name, so a named lock file is never free while its
    owner lives."""
    d = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=base)
    tmp = os.path.join(d, RUN_LOCK_NAME + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, os.path.join(d, RUN_LOCK_NAME))
    except BaseException:
        os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        raise
    return d, fd


def remove_stale_run_dirs(base: str | None = None) -> list[str]:
    """Remove the run directories (and the sockets in them) that a killed session left in
    ``base`` (the temp dir): ours (same uid), with a lock file nobody holds. A directory
    without a lock file is skipped (being created, or not ours to judge). Returns the paths."""
    base = base or tempfile.gettempdir()
    removed = []
    try:
        names = sorted(n for n in os.listdir(base) if n.startswith(RUN_DIR_PREFIX))[:STALE_RUN_DIRS_MAX]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(path, RUN_LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its session is alive
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d run director%s left by killed sessions: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed
# -- end stale run directories


GUESTS = ("vm", "scripted", "local")


def _refuse_target(f: "Folder"):
    raise ValueError(f"guest='local' shows each folder at its own path: {f.path!r} cannot be at {f.target!r} "
                     "(give no guest path)")


class SessionError(GuestError):
    """The session cannot start or go on; the message says why and what was seen."""


class LockUnavailable(SessionError):
    """external_policy="lock" needs the right to bind-mount (root / CAP_SYS_ADMIN)."""


@dataclass
class Folder:
    path: str
    read_only: bool = False
    target: str | None = None  # guest path; default /mnt/working/<i>
    label: str = ""
    state_dir: str | None = None  # the undo store; default beside the user's state

    @classmethod
    def parse(cls, spec: str) -> "Folder":
        """``DIR`` or ``DIR:ro`` / ``DIR:rw`` (the CLI's ``--workdir``)."""
        path, sep, mode = spec.rpartition(":")
        if sep and mode in ("ro", "rw"):
            return cls(path, mode == "ro")
        return cls(spec)


@dataclass
class MemoryMount:
    """Seed 000: files a host injects at ``target`` (read-only unless ``writable``): a flat
    ``{rel: bytes}`` snapshot, or a live :class:`~sandbox.mounts.vfs.VirtualFileSystem`."""

    target: str
    files: dict[str, bytes] | object
    writable: bool = False
    label: str = ""


@dataclass
class StepResult:
    step_id: int | None  # None for a session without read-write folders (nothing to undo)
    exit_code: int
    signal: int | None = None
    cancelled: bool = False
    step_ids: list = field(default_factory=list)  # per folder: its step id, or None
    stdout: str = ""  # what the SDK collected (bounded: sandbox.sdk.OUTPUT_CHARS_MAX)
    stderr: str = ""
    output_truncated: bool = False


@dataclass
class _Started:
    run_dir: str
    run_lock_fd: int | None = None  # holds the run directory's flock (see new_run_dir)
    server: ServerThread | None = None
    share: ShareProcess | None = None  # share_servers="process": folder 0's confined server
    shares: dict = field(default_factory=dict)  # share_servers="process": folder index -> its ShareProcess
    virtiofs: list = field(default_factory=list)  # share="virtiofs": (VirtioFsServer, its task) per folder
    live_virtiofs: dict = field(default_factory=dict)  # live mount name -> (VirtioFsServer, task): hot-plugged
    share_died: str | None = None  # why the share server went away mid-session
    guest: object = None
    workspaces: list = field(default_factory=list)
    providers: dict = field(default_factory=dict)  # attach name -> Provider
    detectors: list = field(default_factory=list)
    unlocks: list = field(default_factory=list)
    own_writes: list = field(default_factory=list)  # per folder: its OwnWrites journal, or None
    live: dict = field(default_factory=dict)  # live mount target -> (Mount, MemoryMount)
    hold_hooks: list = field(default_factory=list)  # unsubscribe() of the session's own hold subscribers
    pausing: set = field(default_factory=set)  # concurrent futures of _pause_sync runs not finished
    paused: bool = False  # the VM was paused for a pending hold
    pause_lock: asyncio.Lock | None = None


# -- network allowlist (issue 13)
#: what a command in an allowlist guest sees: the host proxy (sandbox.vm.netproxy) on QEMU's
#: forward address; both spellings, since tools read one or the other
PROXY_ENV = {k: v for name in ("http_proxy", "https_proxy", "all_proxy")
             for k, v in ((name, "http://10.0.2.100:3128"), (name.upper(), "http://10.0.2.100:3128"))}
PROXY_ENV.update(no_proxy="localhost,127.0.0.1,10.0.2.100", NO_PROXY="localhost,127.0.0.1,10.0.2.100")


def _allow_items(items: list[str]) -> list[str]:
    """Normalised allowlist items: IPv4 networks (``1.2.3.4`` → ``1.2.3.4/32``) and domain
    names (lower-case; each allows its subdomains); ValueError names a bad one."""
    from ..vm.netproxy import AllowList

    return AllowList.parse(items).items()


# -- the guest user (issue 13)
def guest_owner_map(folder: str, as_root: bool) -> OwnerMap | None:
    """What the 9P server reports as owners to a VM guest: the folder owner's and the server's
    own files are the guest user's (else the user could not write where the server creates
    files as itself); None with ``as_root`` (the guest's root passes every check anyway)."""
    if as_root:
        return None
    st = os.stat(folder)
    uid, gid = guestroot.user_ids(folder)
    return OwnerMap(host_uids=frozenset({st.st_uid, os.geteuid()}), host_gids=frozenset({st.st_gid, os.getegid()}),
                    guest_uid=uid, guest_gid=gid)


def vm_state_dir(folder: str) -> str:
    """Where a persistent VM's disk lives: beside the first folder's undo store."""
    return os.path.join(os.path.dirname(default_state_dir(folder)), "..", "vm", os.path.basename(default_state_dir(folder)))


def _tree(files, writable: bool, label: str) -> Provider:
    """The provider of an in-memory mount: a snapshot of a dict, or a live VFS."""
    if is_vfs(files):
        return vfs_tree(files, writable=writable, label=label)
    if not isinstance(files, dict):
        raise ValueError(f"a mount's files are a {{path: bytes}} dict or a VirtualFileSystem, not {type(files).__name__}")
    return memory_tree(files, writable=writable, label=label)


def build_table(folders: list[Folder], memory: list[MemoryMount]) -> MountTable:
    """The session's mount table: folder *i* is export ``"i"``, tree *j* is ``"m<j>"``."""
    mounts = [Mount(target=f.target or f"/mnt/working/{i}", name=str(i), read_only=f.read_only,
                    label=f.label, source=os.path.realpath(f.path), kind="folder") for i, f in enumerate(folders)]
    mounts += [Mount(target=m.target, name=f"m{j}", read_only=not m.writable, label=m.label, source=None, kind="memory")
               for j, m in enumerate(memory)]
    return MountTable(mounts)


class Session:
    def __init__(self, folders: list[Folder], *, network: str = "disabled", allow: list[str] | None = None,
                 vm_mode: str = "ephemeral", memory_mb: int = 1024, cpus: int = 2,
                 safeguard: SafeguardConfig | None = None, limits: Limits | None = None,
                 decide: Callable | None = None, on_event: Callable[[dict], None] | None = None,
                 progress: Callable[[str], None] | None = None, state_dirs: list[str | None] | None = None,
                 mounts: list[MemoryMount] | None = None, python_path: list[str] | None = None,
                 external_policy: str | None = None, guest: str | Callable = "vm", share: str | None = None,
                 as_root: bool = False, guest_root: str = "host-usr", guest_packages: list[str] | None = None,
                 share_servers: str | None = None, virtiofs_direct_io: str = "write-only"):
        """``guest``: ``"vm"`` (QEMU), ``"scripted"`` (:mod:`sandbox.scripted`, no VM), or a
        factory ``(run_dir) -> guest`` (:class:`~sandbox.session.guest.Guest`).
        ``external_policy``: None (no watcher) or one of ``barrier``/``warn``/``lock``.
        ``share``: the transport of the shares — ``"virtiofs"`` (a VM guest or a factory: each
        working folder and in-memory tree a virtio-fs device served from its 9P export, in the
        share-server process or thread that serves it; issue 17), ``"9p"`` (through QEMU's
        ``guestfwd``); ``"local"`` (FUSE on the host) goes with ``guest="local"``, which implies it.
        Default (None): ``$SANDBOX_SHARE`` if set, else for ``guest="vm"`` virtio-fs where
        :func:`~sandbox.vm.qemu.virtiofs_unavailable` finds no reason against it (else 9P, the
        reason logged and in :attr:`share_reason`), and 9P for scripted guests and factories.
        ``guest="local"`` (:mod:`sandbox.local`): commands run on the host, each folder FUSE-mounted
        at its own path in a private mount namespace — undo, not isolation; folders' guest paths
        default to (and must be) their own paths; ``network`` ``disabled`` is a private network
        namespace, ``open`` the host's, ``allowlist`` refused; ``share_servers`` is ``"thread"``.
        ``as_root``: a VM's commands run as root instead of the unprivileged guest user
        ``agent`` (:func:`~sandbox.vm.guestroot.user_ids`).
        ``guest_root``: the VM's userland — ``"host-usr"`` (the host's /usr and an allowlisted
        /etc; :mod:`sandbox.vm.guestroot`) or ``"image"`` (a cached Debian root built by
        mmdebstrap; :mod:`sandbox.vm.imageroot`). ``guest_packages``: the image root's Debian
        packages (default :data:`~sandbox.vm.imageroot.DEFAULT_PACKAGES`; python3 always);
        only with ``guest_root="image"``.
        ``share_servers``: where the working folders are served (issue 13) — ``"process"``: a
        confined child process (:mod:`sandbox.serving.shareserver`) owns their workspaces and
        9P server; ``"thread"``: the agent's own server thread. Default: the environment
        variable ``SANDBOX_SHARE_SERVERS`` if set, else ``"process"`` for ``guest="vm"`` and
        ``"thread"`` for the scripted guest and factories.
        ``virtiofs_direct_io``: with ``share="virtiofs"``, which opens skip the guest's page cache
        (:data:`~sandbox.fuse.DIRECT_IO_MODES`) — ``"write-only"`` (default; shared maps work) or
        ``"all"`` (every open, as C virtiofsd ``cache=none``: large reads skip the guest's copy, but
        a 6.1 guest refuses a shared map of any file on the share with ``ENODEV``)."""
        # -- local guest (issue 16): FUSE mounts of the shares, commands on the host
        if guest == "local" or share == "local":
            if guest != "local":
                raise ValueError("share='local' (FUSE on the host) goes with guest='local'")
            if share not in (None, "9p", "local"):
                raise ValueError(f"share={share!r} goes with guest='vm'; guest='local' serves the folders over FUSE "
                                 "on the host")
            if share_servers == "process":
                raise ValueError("guest='local' needs share_servers='thread': its FUSE dispatcher serves the "
                                 "folders' exports in this process")
            share_servers, share = "thread", "9p"  # the env default does not apply; 9P still serves API clients
            if network == "allowlist":
                raise ValueError("guest='local' cannot enforce a network allowlist: network is 'disabled' (a private "
                                 "network namespace, loopback only) or 'open'")
            folders = [f if f.target is None or os.path.realpath(f.target) == os.path.realpath(f.path) else
                       _refuse_target(f) for f in folders]
            for f in folders:
                f.target = os.path.realpath(f.path)
        # -- virtio-fs (issue 17): the default of VM guests where QEMU can; each device is served where its export is
        self.share_reason: str | None = None  # why a VM guest's default share is 9P, if it is
        if share is None:
            share, self.share_reason = default_share(guest)
        if share == "virtiofs" and guest != "vm" and not callable(guest):
            raise ValueError("share='virtiofs' goes with guest='vm' (QEMU's vhost-user-fs-pci) or a guest factory "
                             "(it is given each folder's vhost-user socket: GuestMount.virtiofs_socket)")
        # -- confined share servers (issue 13)
        if share_servers is None:  # a VM's folders are served confined; scripted/factory guests: in-process
            share_servers = os.environ.get(SHARE_SERVERS_ENV) or ("process" if guest == "vm" else "thread")
        if share_servers not in SHARE_SERVERS:
            raise ValueError(f"share_servers must be one of {', '.join(SHARE_SERVERS)}, not {share_servers!r}")
        self.share_servers = share_servers
        # -- guest root (issue 13)
        if guest_root not in GUEST_ROOTS:
            raise ValueError(f"guest_root must be one of {', '.join(GUEST_ROOTS)}, not {guest_root!r}")
        self.guest_root = guest_root
        if guest_packages is not None and guest_root != "image":
            raise ValueError("guest_packages needs guest_root='image' (host-usr has the host's software)")
        self.guest_packages = list(imageroot.validate_packages(guest_packages)) if guest_root == "image" else None
        self.share = "local" if guest == "local" else check_share(share)
        if virtiofs_direct_io not in DIRECT_IO_MODES:
            raise ValueError(f"virtiofs_direct_io must be one of {', '.join(DIRECT_IO_MODES)}, "
                             f"not {virtiofs_direct_io!r}")
        if virtiofs_direct_io != "write-only" and self.share != "virtiofs":
            raise ValueError(f"virtiofs_direct_io={virtiofs_direct_io!r} needs share='virtiofs' (this session's "
                             f"share is {self.share!r})")
        self.virtiofs_direct_io = virtiofs_direct_io
        if not (callable(guest) or guest in GUESTS):
            raise ValueError(f"guest must be 'vm', 'scripted', 'local' or a factory, not {guest!r}")
        if not folders:
            raise ValueError("at least one working folder")
        if len(folders) > FOLDERS_MAX:
            raise ValueError(f"at most {FOLDERS_MAX} working folders")
        mounts = list(mounts or [])
        if len(mounts) > MEMORY_MOUNTS_MAX:
            raise ValueError(f"at most {MEMORY_MOUNTS_MAX} in-memory mounts")
        if network not in NETWORKS:
            raise ValueError(f"network must be one of {', '.join(NETWORKS)}")
        self.allow = _allow_items(allow or []) if network == "allowlist" else []
        if network == "allowlist" and not self.allow:
            raise ValueError("network allowlist needs at least one IP, CIDR or domain name")
        if vm_mode not in VM_MODES:
            raise ValueError(f"vm_mode must be one of {', '.join(VM_MODES)}")
        if external_policy is not None and external_policy not in EXTERNAL_POLICIES:
            raise ValueError(f"external_modification_policy must be one of {', '.join(EXTERNAL_POLICIES)}")
        for f in folders:
            if not os.path.isdir(f.path):
                raise ValueError(f"working folder {f.path!r} does not exist or is not a directory")
        if state_dirs is not None:
            for f, sd in zip(folders, state_dirs):
                f.state_dir = f.state_dir or sd
        for p in python_path or []:
            if not isinstance(p, str) or not p.startswith("/") or ":" in p or "\0" in p:
                raise ValueError(f"python_path entries are absolute guest paths without ':': {p!r}")
        self.folders = folders
        self.memory_mounts = mounts
        self.table = build_table(folders, mounts)  # validates targets, labels
        check_mount_points(self.table, self._mount_point_exists)
        self.python_path = list(python_path or [])
        self.network = network
        # -- the guest user (issue 13)
        if not isinstance(as_root, bool):
            raise ValueError(f"as_root must be true or false, not {as_root!r}")
        self.as_root = as_root
        self.vm_mode = vm_mode
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.safeguard = safeguard
        self.limits = limits
        self.decide = decide
        #: the session's safeguard holds: ``pending()``, ``answer(id, action)``, ``subscribe(cb)``
        self.holds = HoldBroker()
        self.on_event = on_event
        self.external_policy = external_policy
        self.progress = progress or (lambda msg: log.info("%s", msg))
        self.guest_kind = guest
        self.started_at: float | None = None
        self._s: _Started | None = None
        self._lock = threading.Lock()  # one command at a time through run()
        self._mount_lock = threading.Lock()  # live mounts: one change at a time
        self._live_seq = 0  # attach names l0, l1, … are never reused within a session
        self._boot_table = self.table
        #: called (under command_lock) before a command step opens or an undo runs: API clients
        #: end their open API steps there (sandbox.files.FileService.end_steps)
        self.before_step: list[Callable[[], None]] = []
        #: told of every command (``{"type": "command", "command", "step_id"}``, before it runs) and
        #: its output (``{"type": "output", "stream", "data", "step_id"}``, on the I/O thread),
        #: whichever client ran it — a watcher's tap (the web page, issue 18); must not block
        self.command_listeners: list[Callable[[dict], None]] = []

    @property
    def state_dirs(self) -> list[str | None]:
        return [f.state_dir for f in self.folders]

    def _mount_point_exists(self, parent: Mount, rel: str) -> bool:
        if parent.kind == "memory":
            if parent.name.startswith("l"):  # a live mount: ask what it serves
                try:
                    return self._require().providers[parent.name].host.lstat(rel).kind == "dir"
                except (OSError, KeyError):
                    return False
            files = self.memory_mounts[int(parent.name[1:])].files
            if is_vfs(files):
                try:
                    return vfs_tree(files).host.lstat(rel).kind == "dir"
                except OSError:
                    return False
            return any(k.strip("/").startswith(rel + "/") for k in files)
        try:
            return os.path.isdir(os.path.join(parent.source, rel)) and not os.path.islink(os.path.join(parent.source, rel))
        except OSError:
            return False

    # ------------------------------------------------------------------ lifecycle

    @property
    def workspaces(self) -> list[Workspace | None]:
        """Per folder: its Workspace, or None for a read-only folder."""
        return list(self._s.workspaces) if self._s else []

    def provider(self, name: str) -> Provider:
        """The provider serving the share with attach name ``name`` (see :func:`build_table`)."""
        return self._require().providers[name]

    @property
    def command_lock(self) -> threading.Lock:
        """Held while a command runs (:meth:`run`): API steps take it without waiting, to
        know that no command is running and to keep one from starting meanwhile."""
        return self._lock

    def restrict(self, view: MountTable) -> None:
        """From now on the guest sees only ``view`` (seed 004): each export is served by a
        provider narrowed to it (outside: ``EACCES``; read-only: ``EROFS``). The session's
        own providers (:meth:`provider`) stay whole — API clients narrow them for themselves."""
        s = self._require()  # a virtio-fs device's dispatcher reads its export's provider at each request
        exports = s.server.server.exports
        for m in self.table.mounts:
            if s.share is not None and m.kind == "folder":
                s.shares[int(m.name)].request("restrict", {"name": m.name, "view": view.view_within(m), "read_only": view.read_only})
            else:
                exports[m.name].provider = s.providers[m.name].narrowed(view.view_within(m), view.read_only)

    def _before_step(self) -> None:
        for hook in list(self.before_step):
            hook()

    @property
    def running(self) -> bool:
        return self._s is not None

    def guest_path(self, i: int = 0) -> str:
        return self.table.folders[i].target

    @property
    def accel(self):
        g = self._s.guest if self._s else None
        return getattr(g, "accel", None)

    @property
    def boot_s(self) -> float | None:
        g = self._s.guest if self._s else None
        return getattr(g, "boot_s", None)

    def start(self) -> "Session":
        if self._s is not None:
            raise SessionError("the session is already started")
        remove_stale_run_dirs()
        s = _Started(*new_run_dir())
        self._s = s
        try:
            self._start(s)
        except BaseException:
            self.stop()
            raise
        self.started_at = time.time()
        log.info("session started: %s guest, %d folder(s), %d in-memory mount(s), external modifications: %s",
                 self.guest_kind if isinstance(self.guest_kind, str) else "custom", len(self.folders), len(self.memory_mounts),
                 self.external_policy or "not watched")
        return self

    def _folder_events(self, i: int) -> Callable[[dict], None]:
        """Folder ``i``'s undo-core events: a safeguard hold is registered with :attr:`holds`
        before anyone hears of it (so an answer can never arrive before the hold is known)."""
        def on_event(event: dict) -> None:
            event = {**event, "directory": i}
            if event.get("type") == "event.safeguard_triggered":
                event = self._hold_triggered(i, event)
            if self.on_event is not None:
                self.on_event(event)

        return on_event

    def _hold_triggered(self, i: int, event: dict) -> dict:
        s = self._s
        ws = s.workspaces[i] if s is not None and i < len(s.workspaces) else None
        if ws is None:
            return event
        payload = {k: v for k, v in event.items() if k != "type"}
        provider = s.providers.get(self.table.folders[i].name)
        # the resolver the export's gate uses too: the broker tells holds of different cores apart by it
        resolve = provider.interceptor.resolve_hold if provider is not None and provider.interceptor is not None \
            else _resolver(ws)
        registered = self.holds.register(payload, resolve, timeout_s=_hold_timeout_s(ws))
        return {"type": event["type"], **(registered or payload)}

    def deny_hold(self, i: int, core_id: str) -> None:
        """Deny folder ``i``'s hold ``core_id`` now (an in-process caller that cannot wait, e.g.
        an API write): through :attr:`holds` when it is registered there, so nobody is left
        listing it, else straight to the undo core. The step is rolled back on return."""
        s = self._require()
        provider = s.providers.get(self.table.folders[i].name)
        resolve = provider.interceptor.resolve_hold if provider is not None and provider.interceptor is not None \
            else _resolver(s.workspaces[i])
        if not self.holds.answer_core(resolve, core_id, "deny"):
            try:
                resolve(core_id, "deny")
            except KeyError:
                pass  # resolved meanwhile (its deadline, or the session stopping)

    def _open_workspace(self, s: _Started, i: int, f: Folder) -> OpenedWorkspace:
        """The folder's workspace; with a watcher, its host filesystem records our own writes.

        Under the lock policy, a read-only bind mount already on the folder was left by a
        crashed session if nobody holds the folder's undo store: it is removed first, so the
        workspace's directory fd (and its crash recovery) is on the writable mount."""
        if self.external_policy == "lock":
            self._clear_stale_lock(f)
        return self._open_workspace_once(i, f)

    def _clear_stale_lock(self, f: Folder) -> None:
        from ..barriers.lock import is_locked, unlock_folder
        from ..hostfs.real import RealHostFS

        real = os.path.realpath(f.path)
        if not is_locked(real):
            return
        state = os.path.realpath(f.state_dir or default_state_dir(real))
        os.makedirs(state, mode=0o700, exist_ok=True)
        store = RealHostFS(state, name="store")
        try:
            held = store.lock("lock")  # StoreBusy if a live session has the folder
            try:
                log.warning("removing a stale lock (read-only bind mount) on %s left by a crashed session", real)
                unlock_folder(real)
            finally:
                held.release()
        finally:
            store.close()

    def _watched(self) -> bool:
        """Read-write folders are watched for changes made beside the sandbox: for the
        external-modification policy, or so a local guest's FUSE mounts can cache long (the
        kernel is told of every change the watcher sees: docs/fuse.md, Caching)."""
        return self.external_policy is not None or self.guest_kind == "local"

    def _open_workspace_once(self, i: int, f: Folder) -> OpenedWorkspace:
        return open_workspace(f.path, watched=self._watched(), state_dir=f.state_dir,
                              safeguard=self.safeguard, limits=self.limits, on_event=self._folder_events(i))

    def _watch(self, s: _Started, i: int, ws: Workspace, own_writes, path: str) -> None:
        from ..barriers.watch import OVERFLOW_WARNING

        name = self.table.folders[i].name

        def on_external(paths: list[str]) -> None:
            if self.external_policy is not None:
                self._external(i, ws, paths)
            changed = getattr(s.guest, "folder_changed", None)  # a local guest's kernel caches
            if changed is not None:
                changed(name, paths)

        def on_warning(message: str) -> None:
            if self.on_event is not None and self.external_policy is not None:
                self.on_event({"type": "event.warning", "message": message, "directory": i})
            lost = getattr(s.guest, "folder_unwatched", None)
            if lost is not None:
                lost(name, overflow=message == OVERFLOW_WARNING)

        if self.external_policy == "lock":
            from ..barriers.lock import lock_folder

            real = os.path.realpath(path)
            try:
                s.unlocks.append(lock_folder(real))
            except PermissionError as e:
                raise LockUnavailable(f"external_modification_policy lock: {e}") from None
        s.detectors.append(watch_workspace(own_writes, path, on_external, on_warning))

    def _external(self, i: int, ws: Workspace, paths: list[str]) -> None:
        """Something other than the sandbox changed folder ``i``."""
        log.info("external modification of %d path(s) in folder %d: %s", len(paths), i, ", ".join(paths[:5]))
        if self.external_policy in ("barrier", "lock"):
            ws.record_external_modification(paths)  # emits event.external_modification with the barrier
        elif self.on_event is not None:
            self.on_event({"type": "event.external_modification", "paths": list(paths), "barrier_id": None,
                           "directory": i})

    def _start(self, s: _Started) -> None:
        if self.share_servers == "process":
            self._start_share_process(s)
        for i, f in enumerate(self.folders):
            if s.share is not None:
                break
            mount = self.table.folders[i]
            if f.read_only:
                s.workspaces.append(None)
                s.own_writes.append(None)
                s.providers[mount.name] = Provider.read_only_dir(f.path, label=mount.label or os.path.basename(f.path))
            else:
                ws, journal = self._open_workspace(s, i, f)
                s.workspaces.append(ws)
                s.own_writes.append(journal)
                s.providers[mount.name] = Provider.intercepted(ws, label=mount.label or os.path.basename(f.path))
        for j, m in enumerate(self.memory_mounts):
            s.providers[f"m{j}"] = _tree(m.files, m.writable, m.label or m.target)
        if self._watched() and s.share is None:
            for i, (f, ws, journal) in enumerate(zip(self.folders, s.workspaces, s.own_writes)):
                if ws is not None:
                    self._watch(s, i, ws, journal, f.path)
        sock = os.path.join(s.run_dir, "9p.sock")
        # one connection per guest mount, and room for a remount (limits: sandbox/limits.py)
        limits = ServerLimits(connections_max=max(ServerLimits().connections_max,
                                                  2 * (len(self.table.mounts) + LIVE_MOUNTS_MAX)))
        # -- the guest user (issue 13): a VM guest's user sees the folder owner's files as its own
        owners = guest_owner_map(self.folders[0].path, self.as_root) if self.guest_kind == "vm" else None
        served = {k: p for k, p in s.providers.items() if s.share is None or not k.isdigit()}
        self._limits, self._owners = limits, owners  # what live mounts' devices are served with
        server = NinePServer(served, ServerConfig(limits, owners=owners), holds=self.holds)
        s.server = ServerThread(server, unix_path=sock).__enter__()
        if self.share == "virtiofs":  # in process mode each child serves its folder's own; trees are served here
            self._start_virtiofs(s, limits, owners)
        s.hold_hooks.append(self.holds.subscribe(lambda kind, payload: self._pause_while_held(s)))
        if self.decide is not None:
            s.hold_hooks.append(self.holds.ask(self.decide))
        s.guest = self._make_guest(s.run_dir)
        guest_mounts = [GuestMount(m.name, m.target, m.read_only,
                                   s.shares[int(m.name)].config["socket"] if s.shares and m.kind == "folder" else None,
                                   virtiofs_socket=self._virtiofs_socket(s, m.name) if self.share == "virtiofs"
                                   else None)
                        for m in self.table.mounts]
        try:
            s.guest.boot(socket_path=sock, mounts=guest_mounts, loop=s.server.loop, timeout_s=BOOT_TIMEOUT_S)
        except GuestError as e:
            raise SessionError(str(e)) from None

    # -- virtio-fs (issue 17)
    @staticmethod
    def _virtiofs_socket(s: _Started, name: str) -> str:
        return os.path.join(s.run_dir, f"vfs-{name}.sock")

    def _start_virtiofs(self, s: _Started, limits: ServerLimits, owners: OwnerMap | None) -> None:
        """One virtio-fs device server per share served by this process's 9P server — every
        working folder in thread mode, every in-memory tree in both modes — on that server's
        loop, serving the share's 9P export itself (same provider, hold gate, undo core; the
        9P server polls the core). QEMU connects to each socket at boot."""
        from ..fuse.virtiofs import serve_export

        for m in self.table.mounts:
            if m.kind == "folder" and s.share is not None:
                continue  # its confined child serves it
            export = s.server.server.exports[m.name]
            s.virtiofs.append(s.server.run(serve_export(export, self._virtiofs_socket(s, m.name), limits, owners,
                                                        self.virtiofs_direct_io), timeout_s=30))

    @staticmethod
    def _stop_virtiofs(s: _Started) -> None:
        async def cancel_all() -> None:
            tasks = [task for _server, task in s.virtiofs + list(s.live_virtiofs.values())]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if (s.virtiofs or s.live_virtiofs) and s.server is not None and not s.server.loop.is_closed():
            s.server.run(cancel_all(), timeout_s=30)
        s.virtiofs.clear()
        s.live_virtiofs.clear()

    # -- confined share servers (issue 13)
    def _start_share_process(self, s: _Started) -> None:
        """The folders' workspaces, providers, 9P servers and watchers in confined children
        (:mod:`sandbox.serving.shareserver`), **one per folder** — each confined to its own
        folder and undo store, each its own interpreter (so shares can use more than one
        core); started together. Here: a :class:`RemoteWorkspace` per read-write folder and,
        for API clients (:class:`~sandbox.files.FileService`), a provider that reads the
        folder straight from disk and sends each mutation to the child's undo core
        (:func:`~sandbox.serving.remotefs.remote_provider`): API writes are API steps
        there, undoable as in thread mode."""
        as_root = self.as_root or self.guest_kind != "vm"
        owners = guest_owner_map(self.folders[0].path, as_root) if self.guest_kind == "vm" else None
        base = {
            "run_dir": s.run_dir,
            "safeguard": asdict(self.safeguard) if self.safeguard is not None else None,
            "limits": asdict(self.limits) if self.limits is not None else None,
            "owners": None if owners is None else {"host_uids": sorted(owners.host_uids), "host_gids": sorted(owners.host_gids),
                                                   "guest_uid": owners.guest_uid, "guest_gid": owners.guest_gid},
            "external_policy": self.external_policy,
            "connections_max": 2 * (1 + LIVE_MOUNTS_MAX),
            "log_level": logging.getLogger("sandbox").getEffectiveLevel(),
        }
        if self.external_policy == "lock":
            for f in self.folders:
                if not f.read_only:
                    self._clear_stale_lock(f)
        for i, f in enumerate(self.folders):
            name = self.table.folders[i].name
            folder = {"index": i, "name": name, "path": os.path.realpath(f.path),
                      "read_only": f.read_only, "state_dir": f.state_dir,
                      "label": self.table.folders[i].label or os.path.basename(f.path)}
            vfs = {name: self._virtiofs_socket(s, name)} if self.share == "virtiofs" else {}  # -- virtio-fs (issue 17)
            s.shares[i] = ShareProcess({**base, "folders": [folder], "socket": os.path.join(s.run_dir, f"shares-{i}.sock"),
                                        "virtiofs": vfs, "virtiofs_direct_io": self.virtiofs_direct_io},
                                       on_event=lambda msg: self._share_event(s, msg),
                                       on_died=lambda reason: self._share_died(s, reason), dead_error=SessionError)
        s.share = s.shares[0]
        ready, failed = {}, []

        def start(i: int) -> None:
            try:
                ready[i] = s.shares[i].start()
            except BaseException as e:  # re-raised below, on the starting thread
                failed.append(e)

        starters = [threading.Thread(target=start, args=(i,), name=f"share-server-{i}") for i in s.shares]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if failed:
            raise failed[0]
        for i, f in enumerate(self.folders):
            log.info("share server of folder %d: pid %s, Landlock ABI %s%s", i, ready[i].get("pid"),
                     ready[i].get("landlock_abi"), f" ({ready[i]['reason']})" if ready[i].get("reason") else "")
            mount = self.table.folders[i]
            label = mount.label or os.path.basename(f.path)
            s.providers[mount.name] = Provider.read_only_dir(f.path, label=label) if f.read_only else \
                remote_provider(s.shares[i], i, f.path, label)
            s.own_writes.append(None)
            s.workspaces.append(None if f.read_only else
                                RemoteWorkspace(s.shares[i], i, label, (ready[i].get("recovery") or {}).get(str(i))))
        if self.external_policy == "lock":
            from ..barriers.lock import lock_folder

            for f in self.folders:
                if not f.read_only:
                    try:
                        s.unlocks.append(lock_folder(os.path.realpath(f.path)))
                    except PermissionError as e:
                        raise LockUnavailable(f"external_modification_policy lock: {e}") from None

    def _share_event(self, s: _Started, msg: dict) -> None:
        """An event of the share server (on its events thread, in order)."""
        kind = msg.get("event")
        if kind == "core":
            payload = dict(msg.get("payload") or {})
            self._folder_events(int(payload.pop("directory", 0)))(payload)
        elif kind == "hold_resolved":  # ended in the child (its deadline): the broker forgets it too
            ws = s.workspaces[msg["directory"]]
            if ws is not None:
                self.holds.answer_core(ws.resolve_hold, msg["hold_id"], "deny")
        elif kind == "external":
            ws = s.workspaces[msg["directory"]]
            if ws is not None:
                self._external(msg["directory"], ws, list(msg.get("paths", [])))
        elif kind == "warning" and self.on_event is not None:
            self.on_event({"type": "event.warning", "message": msg.get("message", ""), "directory": msg.get("directory")})

    def _share_died(self, s: _Started, reason: str) -> None:
        """The share server went away mid-session: say so, stop the guest (its shares are gone)."""
        s.share_died = reason
        self.holds.deny_all("share server exited")
        if self.on_event is not None:
            self.on_event({"type": "event.warning", "message": f"{reason}: the guest is stopped; the next start "
                           "recovers the step that was running"})
        if s.guest is not None:
            threading.Thread(target=s.guest.stop, name="stop-guest", daemon=True).start()

    def _make_guest(self, run_dir: str):
        if callable(self.guest_kind):
            return self.guest_kind(run_dir)
        if self.guest_kind == "scripted":
            from ..scripted.guest import ScriptedGuest

            return ScriptedGuest()
        if self.guest_kind == "local":  # -- local guest (issue 16)
            from ..local.guest import LocalGuest

            watched = frozenset(self.table.folders[i].name for i, ws in enumerate(self._s.workspaces)
                                if ws is not None and self._s.share is None)
            return LocalGuest(run_dir, self._s.server.server.exports, network=self.network != "disabled",
                              progress=self.progress, watched=watched)
        if self.guest_kind != "vm":
            raise ValueError(f"guest must be 'vm', 'scripted' or 'local', not {self.guest_kind!r}")
        disk = self._persistent_disk() if self.vm_mode == "persistent" else None
        return VmGuest(run_dir=run_dir, network=self.network, allow=self.allow, memory_mb=self.memory_mb,
                       cpus=self.cpus, disk=disk, progress=self.progress, on_refused=self._net_refused,
                       guest_root=self.guest_root, user_ids=guestroot.user_ids(self.folders[0].path),
                       as_root=self.as_root, guest_packages=self.guest_packages)

    def _net_refused(self, message: str, destination: str) -> None:  # -- network allowlist (issue 13)
        if self.on_event is not None:
            self.on_event({"type": "event.warning", "message": message, "destination": destination})

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
        self.table = self._boot_table  # live mounts end with the session
        self.started_at = None
        errors = []
        self.holds.deny_all()  # nobody can answer any more: the steps roll back, held requests fail
        for unsubscribe in s.hold_hooks:
            unsubscribe()
        for f in list(s.pausing):  # the VM resumes before it is stopped
            try:
                f.result(timeout=10)
            except Exception as e:
                log.warning("could not resume the VM after the last hold: %s", e)
        if s.guest is not None:
            try:
                s.guest.stop()
            except Exception as e:
                errors.append(e)
        try:
            self._stop_virtiofs(s)  # after QEMU: it has disconnected
        except Exception as e:
            errors.append(e)
        if s.server is not None:
            try:
                s.server.__exit__(None, None, None)
            except Exception as e:
                errors.append(e)
        for share in s.shares.values():  # each stopped, started or not (stop is idempotent)
            try:
                share.stop()
            except Exception as e:
                errors.append(e)
        for d in s.detectors:
            try:
                d.stop()
            except Exception as e:
                errors.append(e)
        for unlock in s.unlocks:
            try:
                unlock()
            except Exception as e:
                errors.append(e)
        for p in s.providers.values():
            p.close()
        for ws in s.workspaces:
            if ws is not None:
                ws.close()
        shutil.rmtree(s.run_dir, ignore_errors=True)
        if s.run_lock_fd is not None:
            os.close(s.run_lock_fd)  # after the removal: nobody may take the directory for stale before
        if errors:
            log.warning("errors while stopping the session: %s", errors)
        log.info("session stopped")

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
        env = dict(env or {})
        if self.network == "allowlist":  # -- network allowlist (issue 13)
            env = {**PROXY_ENV, **env}
        if self.python_path:  # user paths first (seed 000)
            env["PYTHONPATH"] = ":".join(self.python_path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        with self._lock:
            self._before_step()
            ids = [ws.begin_step(command) if ws is not None else None for ws in s.workspaces]
            step_id = next((i for i in ids if i is not None), None)
            log.info("step %s: exec %s", step_id, command[:200], extra={"step_id": step_id})
            exec_id = step_id if step_id is not None else int(time.time() * 1000) % (1 << 31)
            result = None
            on_output = self._tapped(command, step_id, on_output)
            try:
                try:
                    ex = s.server.run(s.guest.exec(exec_id, command, cwd or self.guest_path(0), env, on_output))
                    done = self._wait(ex.completed, cancel, exec_id)
                except (ControlClosed, RuntimeError) as e:  # the shim went away, or refused the command
                    raise SessionError(f"{e}; console:\n" + "\n".join(s.guest.tail(20))) from None
                result = StepResult(step_id, int(done.get("exit_code", 1)), done.get("signal"),
                                    cancelled=cancel is not None and cancel.is_set(), step_ids=ids)
                return result
            finally:
                code = result.exit_code if result is not None else 1
                for ws, sid in zip(s.workspaces, ids):
                    if ws is not None and sid is not None:
                        self._close_step(ws, sid, code)

    def _tapped(self, command: str, step_id: int | None, on_output):
        """``on_output``, also telling :attr:`command_listeners` (a failing listener is logged, never raised)."""
        listeners = list(self.command_listeners)
        if not listeners:
            return on_output

        def tell(event: dict) -> None:
            for fn in listeners:
                try:
                    fn(event)
                except Exception:
                    log.exception("a command listener failed")

        tell({"type": "command", "command": command, "step_id": step_id})

        def out(stream: str, text: str) -> None:
            if on_output is not None:
                on_output(stream, text)
            tell({"type": "output", "stream": stream, "data": text, "step_id": step_id})

        return out

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
                s.server.run(s.guest.cancel(exec_id))
                sent_cancel = True
            if not s.guest.alive():
                raise SessionError("the guest exited while the command was running; console:\n" + "\n".join(s.guest.tail(20)))

    def _close_step(self, ws: Workspace, step_id: int, exit_code: int) -> None:
        """step_completed: drain late writes (in flight → 0, or the quiescence window), then close."""
        ws.close_step(step_id, exit_code)

    # ------------------------------------------------------------------ undo

    def undo(self, n: int = 1, force: bool = False, folder: int = 0) -> dict:
        """Roll back the newest ``n`` steps of ``folder`` while the guest runs; the shim is told.
        The guest sees the restored files when this returns: over 9P at once (cache=none); over
        virtio-fs, whose guest driver has no notification queue to invalidate what its kernel
        cached, this returns once every entry and attribute cached before the rollback ended
        has expired (:data:`VIRTIOFS_UNDO_SETTLE_S` after it)."""
        s = self._require()
        ws = s.workspaces[folder]
        if ws is None:
            raise SessionError(f"working folder {folder} is read-only: it has no undo history")
        if self._lock.acquire(blocking=False):  # a running command: rollback refuses anyway (undo.step_running)
            try:
                self._before_step()
            finally:
                self._lock.release()
        result = ws.rollback(n, force=force)
        settled_at = time.monotonic() + VIRTIOFS_UNDO_SETTLE_S
        for sid in result.get("step_ids", [])[:1]:  # one notification per undo: every step and path (diff helper, issue 14)
            try:
                s.server.run(s.guest.rollback_notify(sid, result.get("paths"), step_ids=result["step_ids"], folder=self.guest_path(
                    folder), paths_truncated=result.get("paths_truncated", False)), timeout_s=10)
            except Exception as e:
                log.warning("could not notify the guest of the rollback: %s", e)
        if self.share == "virtiofs" and result.get("step_ids"):  # the guest's cached entries run out meanwhile
            time.sleep(max(0.0, settled_at - time.monotonic()))
        return result

    def status(self) -> dict:
        """What is running: the accelerator and why, boot time, folders, and the VM's QMP state."""
        s = self._s
        vm = "stopped"
        if s is not None:
            try:
                vm = s.server.run(s.guest.vm_status(), timeout_s=10)
            except Exception as e:
                vm = f"unknown ({e})"
        return {
            "vm": vm,
            "accel": self.accel,
            "accel_reason": getattr(s.guest, "accel_reason", None) if s else None,
            "boot_s": self.boot_s,
            "guest": None if s is None else (self.guest_kind if isinstance(self.guest_kind, str) else
                                             "vm" if isinstance(s.guest, VmGuest) else "scripted"),
            "python_path": list(self.python_path),
            "external_modification_policy": self.external_policy,
            "network": self.network,
            "allow": list(self.allow),
            "vm_mode": self.vm_mode,
            "as_root": self.as_root,
            "guest_root": self.guest_root,
            "guest_packages": self.guest_packages,
            "share_servers": self.share_servers,
            "share_server_pid": s.share.pid if s is not None and s.share is not None else None,
            "share_server_pids": [sh.pid for sh in s.shares.values()] if s is not None else [],
            "share": self.share,
            "virtiofs_direct_io": self.virtiofs_direct_io if self.share == "virtiofs" else None,
            "folders": [{"path": os.path.realpath(f.path), "guest_path": self.guest_path(i), "read_only": f.read_only,
                         "label": self.table.folders[i].label} for i, f in enumerate(self.folders)],
            "mounts": [{"guest_path": m.target, "read_only": not m.writable, "label": m.label,
                        **({} if is_vfs(m.files) else {"files": len(m.files)}), "live": live}
                       for live, ms in ((False, self.memory_mounts), (True, self.live_mounts)) for m in ms],
        }

    # ------------------------------------------------------------------ live mounts (seed 000)

    @property
    def live_mounts(self) -> list[MemoryMount]:
        """The live mounts made since start, in the order made."""
        return [mm for _m, mm in self._s.live.values()] if self._s else []

    def mount(self, target: str, files, *, writable: bool = False, label: str = "") -> Mount:
        """Mount ``files`` (a ``{rel: bytes}`` dict, snapshotted now, or a
        :class:`~sandbox.mounts.vfs.VirtualFileSystem`, asked live) at the guest path
        ``target`` while the session runs; the guest sees it when this returns.

        :class:`~sandbox.mounts.table.MountError` (``session.invalid_mounts``) for a bad or
        taken target, a mount point that does not exist inside an enclosing share, or more
        than :data:`LIVE_MOUNTS_MAX` live mounts; :class:`SessionError` if the guest cannot
        mount it (then nothing of it is left)."""
        s = self._require()
        with self._mount_lock:
            if len(s.live) >= LIVE_MOUNTS_MAX:
                raise MountError(f"at most {LIVE_MOUNTS_MAX} live mounts (unmount one first)", count=len(s.live))
            name = f"l{self._live_seq}"
            m = Mount(target=target, name=name, read_only=not writable, label=label, source=None, kind=MEMORY)
            table = self.table.with_mount(m)  # unique target/label, MAX_MOUNTS
            provider = _tree(files, writable, label or m.target)
            try:
                s.providers[name] = provider  # _mount_point_exists may look at live parents
                check_mount_points(table, self._mount_point_exists)
                s.server.call(lambda: s.server.server.add_export(name, provider))
            except BaseException:
                s.providers.pop(name, None)
                provider.close()
                raise
            self._live_seq += 1
            try:
                vfs = self._start_live_virtiofs(s, name)  # -- virtio-fs (issue 17): a hot-plugged device
                s.server.run(s.guest.mount(GuestMount(name, m.target, m.read_only, virtiofs_socket=vfs)),
                             timeout_s=LIVE_MOUNT_TIMEOUT_S)
            except BaseException as e:
                self._drop_export(s, name)
                if isinstance(e, Exception) and not isinstance(e, MountError):
                    raise SessionError(f"the guest could not mount {m.target}: {e}") from None
                raise
            self.table = table
            s.live[m.target] = (m, MemoryMount(m.target, files, writable=writable, label=label))
            log.info("live mount %s at %s (%s)", name, m.target, "rw" if writable else "ro")
            return m

    def unmount(self, target: str) -> None:
        """Undo :meth:`mount` of ``target`` (the guest unmounts it first, then the export
        goes). ``MountError`` if no live mount is there (boot-time mounts stay)."""
        s = self._require()
        with self._mount_lock:
            try:
                entry = s.live.get(guest_path(target))
            except PathDenied as e:
                raise MountError(f"mount target: {e.message}", target=target) from None
            if entry is None:
                raise MountError(f"{target} is not a live mount (only mounts made after start can be unmounted)",
                                 target=target)
            mount, _mm = entry
            try:
                s.server.run(s.guest.unmount(mount.target), timeout_s=LIVE_MOUNT_TIMEOUT_S)
            except Exception as e:
                raise SessionError(f"the guest could not unmount {mount.target}: {e}") from None
            self._drop_export(s, mount.name)
            del s.live[mount.target]
            self.table = self.table.without(mount.target)
            log.info("live mount %s at %s removed", mount.name, mount.target)

    def _start_live_virtiofs(self, s: _Started, name: str) -> str | None:
        """A live mount of a virtio-fs session whose guest hot-plugs devices: its device server
        (on the 9P server's loop, serving the new export); its socket, or None (9P)."""
        if self.share != "virtiofs" or not getattr(s.guest, "mounts_virtiofs", False):
            return None
        from ..fuse.virtiofs import serve_export

        path = self._virtiofs_socket(s, name)
        s.live_virtiofs[name] = s.server.run(serve_export(s.server.server.exports[name], path, self._limits, self._owners,
                                                          self.virtiofs_direct_io), timeout_s=30)
        return path

    def _drop_export(self, s: _Started, name: str) -> None:
        served = s.live_virtiofs.pop(name, None)
        if served is not None:  # the device (already unplugged, or never plugged) and its server go first
            async def cancel(task=served[1]) -> None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

            try:
                s.server.run(cancel(), timeout_s=30)
            except Exception as e:
                log.warning("stopping the device server of %s: %s", name, e)
        try:
            s.server.call(lambda: s.server.server.remove_export(name))
        except Exception as e:  # not served (the add failed): nothing to remove
            log.debug("remove_export %s: %s", name, e)
        p = s.providers.pop(name, None)
        if p is not None:
            p.close()

    def history(self, folder: int = 0) -> list[dict]:
        ws = self._require().workspaces[folder]
        return [] if ws is None else ws.history()

    def _require(self) -> _Started:
        if self._s is None:
            raise SessionError("the session is not running")
        if self._s.share_died is not None:
            raise SessionError(f"{self._s.share_died}; the guest was stopped — stop the session and start it "
                               "again (the step is recovered on open)")
        return self._s

    # ------------------------------------------------------------------ safeguards

    def _pause_while_held(self, s: _Started) -> None:
        """A hold subscriber (of the started session ``s``, also while it stops): the VM is
        paused (QMP, when available) while any hold is pending — the user may take longer
        than the guest's own timeouts — and resumed when none is."""
        if s.server is None or s.server.loop.is_closed():
            return
        f = asyncio.run_coroutine_threadsafe(self._pause_sync(s), s.server.loop)
        s.pausing.add(f)
        f.add_done_callback(s.pausing.discard)

    async def _pause_sync(self, s: _Started) -> None:
        """Make the VM's state match the broker's: paused iff a hold is pending. Runs on the
        server's loop only, one run at a time (each awaits QMP), so the last one wins."""
        if s.pause_lock is None:
            s.pause_lock = asyncio.Lock()  # on the server's loop, the only one using it
        async with s.pause_lock:
            want = bool(self.holds.pending())
            if want and not s.paused:
                try:
                    s.paused = bool(await s.guest.pause())
                except Exception as e:
                    log.warning("could not pause the VM: %s", e)
            elif not want and s.paused:
                s.paused = False
                try:
                    await s.guest.resume()
                except Exception as e:
                    log.warning("could not resume the VM: %s", e)


def _resolver(ws: Workspace):
    """How a hold of ``ws`` reaches its undo core (the workspace's door, when it has one)."""
    door = getattr(ws, "resolve_hold", None)
    return door if door is not None else ws.interceptor.resolve_hold


def _hold_timeout_s(ws: Workspace) -> float:
    """The safeguard's ``timeout_s`` for ``ws`` (SafeguardConfig: defined there only)."""
    config = getattr(ws, "safeguard_config", None)
    if config is None:
        config = ws.interceptor.safeguard.config
    return config.timeout_s
