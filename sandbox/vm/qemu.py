"""The QEMU command line for a guest, and the choice between KVM and TCG.

:func:`build_command` is a pure function of a :class:`VmConfig`: it validates the config
and returns the argv, and never starts anything — it is tested without QEMU.
:func:`probe_accel` decides the accelerator once per (QEMU binary, host kernel, guest
kernel) and remembers the answer in a small JSON file.

Measured facts behind the flags (SPEC §5):

* q35, direct kernel boot, serial console on ``ttyS0``; ``-no-reboot`` plus the kernel's
  ``panic=-1`` turn a guest panic into QEMU exiting, so a dead guest is never silent.
* ``no_timer_check``: an x86 kernel checks at boot that the IO-APIC timer interrupt arrives
  within a few busy-waited jiffies and panics ("IO-APIC + timer doesn't work") if not. Under
  TCG on a loaded host the emulated CPU can run too slowly for that window — a bench run at
  host load ~10 lost a boot to it (docs/virtiofs.md) — while the timer itself works. The
  parameter skips only that check.
* The 9P shares travel over ``-netdev user`` ``guestfwd`` to host **unix** sockets
  (never a host TCP port: ~10× slower). QEMU names each forward ``guestfwd.tcp.PORT``,
  so two forwards on one port collide. ``restrict=on`` keeps the guest off the network
  and the forwards still work.
* A session guest's root is the host's ``/usr`` and a per-session root skeleton, each a
  read-only export of QEMU's built-in 9p with ``multidevs=remap`` (``virtfs_ro``;
  :mod:`sandbox.vm.guestroot`). ``host_root`` (the host's whole ``/``) is for test
  harnesses only; no session sets it.
* The control channel is a virtio-serial port named ``control`` whose chardev is a unix
  socket server on the host.
* On these machines ``/dev/kvm`` exists but ``-cpu host`` aborts (MSR 0x10a) and other
  models hang at boot, so KVM is only used after a guest has booted with it.

Option-string escaping (QemuOpts): a comma inside a value is written ``,,``. A
``guestfwd`` target is parsed twice — once as a ``-netdev`` option value, then again as
a chardev spec (``unix:PATH`` with ``path`` implied) — so a comma in its path is
``,,,,`` on the command line (verified with QEMU 7.2: ``,,`` fails with "Invalid
parameter", ``,,,,`` connects). ``-kernel``, ``-initrd`` and ``-append`` are taken
verbatim.

Invariants: every path that becomes a unix socket fits ``sun_path`` (107 bytes); no
argument holds a NUL or a newline; guest forward ports are distinct; the probe never
waits longer than its timeout per CPU model and always kills and reaps what it started.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from . import image as vm_image

QEMU = "qemu-system-x86_64"
KVM_DEVICE = "/dev/kvm"
ACCELS = ("kvm", "tcg")
NETWORKS = ("disabled", "open", "allowlist")
#: CPU models tried under KVM, in order; the first that boots the probe guest wins
KVM_CPU_MODELS = ("host", "max")
#: The CPU under TCG: QEMU's ``max`` without ERMS and FSRM ("fast ``rep movsb``"). QEMU 7.2's
#: TCG runs ``rep movs`` one element per loop of translated code, so a guest that believes
#: ``rep movsb`` is fast (its kernel's ``copy_to_user``/``copy_from_user``, glibc's large
#: ``memcpy``) moves one byte per loop where ``rep movsq`` or a vector loop moves 8 or more.
#: Measured here (``bench/guest_9p.py``, 3 boots a side, ``max`` then this): the guest's own
#: 32 MiB tmpfs read 0.15 → 0.10 s and write 0.26 → 0.17 s; the whole workload 0.85× over our
#: virtio-fs, 0.79× over C virtiofsd, 0.88× over QEMU's 9p (docs/vm.md). KVM guests run the
#: host's CPU (:data:`KVM_CPU_MODELS`), not this.
TCG_CPU = "max,erms=off,fsrm=off"
#: what ``VmConfig.cpu`` accepts: a model name, then ``,feature=on|off`` items
CPU_MODEL_RE = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+=(on|off))*")
GUESTFWD_ADDR = "10.0.2.100"
PROBE_FLAG = "sandbox.probe=1"
PROBE_MARKER = "SANDBOX-PROBE-OK"
PROBE_CACHE_FILE = "accel-probe.json"
PROBE_CACHE_ENTRIES_MAX = 16
ENV_ACCEL = "SANDBOX_ACCEL"
UNIX_PATH_BYTES_MAX = 107  # sizeof(sun_path) - 1 for the terminating NUL
MEMORY_MB_MIN, MEMORY_MB_MAX = 64, 1 << 20
CPUS_MAX = 64
BASE_APPEND = "console=ttyS0 panic=-1 no_timer_check"


class QemuError(RuntimeError):
    """QEMU is missing or misbehaves outside a guest boot (e.g. ``--version`` fails)."""


@dataclass
class VmConfig:
    kernel: str
    initrd: str
    append: str = ""
    accel: str = "tcg"  # "kvm" | "tcg"
    memory_mb: int = 1024
    cpus: int = 2
    console: str = "stdio"  # "stdio" (serial on stdio, for pexpect) or a file path
    qmp_socket: str | None = None
    #: host unix socket (QEMU is the server) behind the virtio-serial port named "control"
    control_socket: str | None = None
    host_root: bool = False  # the host's / as 9p tag "hostroot", read-only (test harnesses only)
    #: (9p mount tag, host directory) exported read-only with QEMU's built-in 9p
    virtfs_ro: list[tuple[str, str]] = field(default_factory=list)
    #: (guest TCP port on 10.0.2.100, host unix socket path)
    guestfwds: list[tuple[int, str]] = field(default_factory=list)
    network: str = "disabled"  # "disabled" | "allowlist" (both restrict=on) | "open"
    # -- network allowlist (issue 13): (guest TCP port on 10.0.2.100, host program QEMU spawns
    # for each guest connection, stdin/stdout = the connection; see sandbox.vm.netproxy)
    guestfwd_cmds: list[tuple[int, str]] = field(default_factory=list)
    disk: str | None = None  # a raw disk image, the guest's /dev/vda
    #: (name, host file) pairs exposed to the guest with ``-fw_cfg`` (names start ``opt/``)
    fw_cfg: list[tuple[str, str]] = field(default_factory=list)
    #: virtio-fs shares (issue 17): (tag, the vhost-user socket of its device server, e.g.
    #: ``sandbox serve-virtiofs``); the guest's RAM then is a shared memfd the servers map
    virtiofs: list[tuple[str, str]] = field(default_factory=list)
    #: empty PCIe root ports (``vfsrp0`` …) a ``vhost-user-fs-pci`` can be hot-plugged into
    #: over QMP (q35's ``pcie.0`` takes no hot-plug): live mounts over virtio-fs
    hotplug_ports: int = 0
    extra: list[str] = field(default_factory=list)
    #: None: :data:`TCG_CPU` under TCG, "host" under KVM; set it to what :func:`probe_accel` found
    cpu: str | None = None
    qemu: str = QEMU


@dataclass(frozen=True)
class AccelChoice:
    accel: str  # "kvm" | "tcg"
    reason: str  # why (what failed, or what worked)
    boot_s: float | None  # time to the probe marker under KVM; None when no guest booted with it
    cpu: str = TCG_CPU  # the -cpu model to use with this accelerator
    cached: bool = False


# ---------------------------------------------------------------------------- command line


#: bytes of a virtio-fs tag (the device's config space holds 36)
VIRTIOFS_TAG_BYTES_MAX = 36
#: entries of each ``vhost-user-fs-pci`` virtqueue (QEMU's default is 128; at most its
#: VIRTQUEUE_MAX_SIZE, 1024). The guest's virtio-fs driver caps a request at the request
#: queue's size less 4 entries for its headers (Linux 5.14+), so with 128 a 1 MiB write was
#: three WRITEs (124 + 124 + 8 pages); 1024 lets one request carry the 256 pages (1 MiB) our
#: INIT grants (``fuse.abi.MAX_PAGES``). The device server accepts such chains
#: (``fuse.virtqueue.INDIRECT_DESCS_MAX``)
VIRTIOFS_QUEUE_SIZE = 1024
HOTPLUG_PORTS_MAX = 16
HOTPLUG_CHASSIS_FIRST = 1  # the root ports' chassis numbers (unique per machine; nothing else sets one)


def hotplug_port(k: int) -> str:
    """The id of empty root port ``k`` (:attr:`VmConfig.hotplug_ports`)."""
    return f"vfsrp{k}"



def escape_opt(value: str) -> str:
    """A value inside a QemuOpts option string (``key=value,…``): commas doubled."""
    return value.replace(",", ",,")


def _check_path(what: str, path: str) -> None:
    if not path:
        raise ValueError(f"{what}: empty path")
    if "\0" in path or "\n" in path:
        raise ValueError(f"{what}: a path with a NUL or a newline: {path!r}")


def _check_socket_path(what: str, path: str) -> None:
    _check_path(what, path)
    if len(os.fsencode(path)) > UNIX_PATH_BYTES_MAX:
        raise ValueError(f"{what}: unix socket path longer than {UNIX_PATH_BYTES_MAX} bytes: {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{what}: directory {parent!r} does not exist")


def _validate(cfg: VmConfig) -> None:
    for what, path in (("kernel", cfg.kernel), ("initrd", cfg.initrd)):
        _check_path(what, path)
        if not os.path.isfile(path):
            raise ValueError(f"{what} {path!r} does not exist")
    if cfg.accel not in ACCELS:
        raise ValueError(f"accel must be one of {', '.join(ACCELS)}, not {cfg.accel!r}")
    if cfg.network not in NETWORKS:
        raise ValueError(f"network must be one of {', '.join(NETWORKS)}, not {cfg.network!r}")
    if not (MEMORY_MB_MIN <= cfg.memory_mb <= MEMORY_MB_MAX):
        raise ValueError(f"memory_mb must be in [{MEMORY_MB_MIN}, {MEMORY_MB_MAX}], not {cfg.memory_mb}")
    if not (1 <= cfg.cpus <= CPUS_MAX):
        raise ValueError(f"cpus must be in [1, {CPUS_MAX}], not {cfg.cpus}")
    if cfg.cpu is not None and not CPU_MODEL_RE.fullmatch(cfg.cpu):
        raise ValueError(f"cpu model {cfg.cpu!r}: a model name, then only ',feature=on|off' items are accepted")
    if "\n" in cfg.append or "\0" in cfg.append:
        raise ValueError("append: the kernel command line is one line")
    if cfg.console != "stdio":
        _check_path("console", cfg.console)
        parent = os.path.dirname(os.path.abspath(cfg.console))
        if not os.path.isdir(parent):
            raise ValueError(f"console: directory {parent!r} does not exist")
    if cfg.qmp_socket is not None:
        _check_socket_path("qmp_socket", cfg.qmp_socket)
    if cfg.control_socket is not None:
        _check_socket_path("control_socket", cfg.control_socket)
    ports: set[int] = set()
    for port, path in cfg.guestfwds + cfg.guestfwd_cmds:
        if not isinstance(port, int) or not (1 <= port <= 65535):
            raise ValueError(f"guestfwd port must be in [1, 65535], not {port!r}")
        if port in ports:
            raise ValueError(f"guestfwd port {port} given twice (QEMU names forwards by port)")
        ports.add(port)
        if (port, path) in cfg.guestfwd_cmds:
            if not path.strip() or "\0" in path or "\n" in path:
                raise ValueError(f"guestfwd {port}: a command on one line, not {path!r}")
        else:
            _check_socket_path(f"guestfwd {port}", path)
    tags = {"hostroot"} if cfg.host_root else set()
    for tag, path in cfg.virtfs_ro:
        if not re.fullmatch(r"[A-Za-z0-9_]{1,31}", tag) or tag in tags:
            raise ValueError(f"virtfs tag {tag!r}: one word of [A-Za-z0-9_], at most 31, not given twice")
        tags.add(tag)
        _check_path(f"virtfs {tag}", path)
        if not os.path.isdir(path):
            raise ValueError(f"virtfs {tag}: directory {path!r} does not exist")
    vfs_tags: set[str] = set()
    for tag, path in cfg.virtiofs:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,%d}" % VIRTIOFS_TAG_BYTES_MAX, tag) or tag in vfs_tags:
            raise ValueError(f"virtio-fs tag {tag!r}: one word of [A-Za-z0-9_.-], at most "
                             f"{VIRTIOFS_TAG_BYTES_MAX}, not given twice")
        vfs_tags.add(tag)
        _check_socket_path(f"virtio-fs {tag}", path)
    if not 0 <= cfg.hotplug_ports <= HOTPLUG_PORTS_MAX or (cfg.hotplug_ports and not cfg.virtiofs):
        raise ValueError(f"hotplug_ports: 0 to {HOTPLUG_PORTS_MAX}, and only with virtio-fs shares (the shared memfd RAM)")
    if cfg.disk is not None:
        _check_path("disk", cfg.disk)
        if not os.path.isfile(cfg.disk):
            raise ValueError(f"disk {cfg.disk!r} does not exist")
    for name, path in cfg.fw_cfg:
        if not re.fullmatch(r"opt/[A-Za-z0-9._/-]+", name):
            raise ValueError(f"fw_cfg name {name!r}: must start with opt/ and use [A-Za-z0-9._/-]")
        _check_path(f"fw_cfg {name}", path)
        if not os.path.isfile(path):
            raise ValueError(f"fw_cfg {name}: file {path!r} does not exist")
    for arg in cfg.extra:
        if "\0" in arg:
            raise ValueError(f"extra argument with a NUL: {arg!r}")


def build_command(cfg: VmConfig) -> list[str]:
    """The argv that boots ``cfg`` (validated; raises ValueError with the reason)."""
    _validate(cfg)
    cpu = cfg.cpu or ("host" if cfg.accel == "kvm" else TCG_CPU)
    cmd = [cfg.qemu, "-machine", f"q35,accel={cfg.accel}", "-cpu", cpu,
           "-m", str(cfg.memory_mb), "-smp", str(cfg.cpus),
           "-nodefaults", "-no-user-config", "-no-reboot", "-display", "none"]
    if cfg.console == "stdio":
        cmd += ["-serial", "stdio"]
    else:
        cmd += ["-chardev", f"file,id=serial0,path={escape_opt(cfg.console)}", "-serial", "chardev:serial0"]
    cmd += ["-kernel", cfg.kernel, "-initrd", cfg.initrd,
            "-append", f"{BASE_APPEND} {cfg.append}".strip()]
    netdev = "user,id=n0"
    if cfg.network in ("disabled", "allowlist"):  # allowlist: the host proxy is the only way out
        netdev += ",restrict=on"
    for port, path in cfg.guestfwds:
        # parsed twice (netdev option, then chardev spec): a comma is doubled twice
        netdev += f",guestfwd=tcp:{GUESTFWD_ADDR}:{port}-unix:{escape_opt(escape_opt(path))}"
    for port, command in cfg.guestfwd_cmds:  # parsed once as an option value, then split by the shell rules
        netdev += f",guestfwd=tcp:{GUESTFWD_ADDR}:{port}-cmd:{escape_opt(command)}"
    cmd += ["-netdev", netdev, "-device", "virtio-net-pci,netdev=n0"]
    cmd += ["-device", "virtio-rng-pci"]  # entropy early in boot (python3 start-up, TLS)
    if cfg.host_root:
        cmd += ["-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"]
    for tag, path in cfg.virtfs_ro:
        cmd += ["-virtfs", f"local,path={escape_opt(path)},mount_tag={tag},security_model=none,readonly=on,multidevs=remap"]
    if cfg.control_socket is not None:
        cmd += ["-chardev", f"socket,id=control,path={escape_opt(cfg.control_socket)},server=on,wait=off",
                "-device", "virtio-serial-pci",
                "-device", "virtserialport,chardev=control,name=control"]
    if cfg.virtiofs:  # the device servers map the guest's RAM: it must be a shared memfd
        cmd += ["-object", f"memory-backend-memfd,id=mem,size={cfg.memory_mb}M,share=on", "-numa", "node,memdev=mem"]
    for k, (tag, path) in enumerate(cfg.virtiofs):
        cmd += ["-chardev", f"socket,id=vfs{k},path={escape_opt(path)}",
                "-device", f"vhost-user-fs-pci,chardev=vfs{k},tag={tag},queue-size={VIRTIOFS_QUEUE_SIZE}"]
    for k in range(cfg.hotplug_ports):
        cmd += ["-device", f"pcie-root-port,id={hotplug_port(k)},bus=pcie.0,chassis={HOTPLUG_CHASSIS_FIRST + k}"]
    if cfg.disk is not None:
        cmd += ["-drive", f"file={escape_opt(cfg.disk)},if=virtio,format=raw,cache=writeback,discard=unmap"]
    for name, path in cfg.fw_cfg:
        cmd += ["-fw_cfg", f"name={name},file={escape_opt(path)}"]
    if cfg.qmp_socket is not None:
        cmd += ["-qmp", f"unix:{escape_opt(cfg.qmp_socket)},server=on,wait=off"]
    cmd += list(cfg.extra)
    return cmd


# -- virtio-fs (issue 17): whether a session's shares can be vhost-user-fs devices here
VIRTIOFS_DEVICE = "vhost-user-fs-pci"
DEVICE_PROBE_TIMEOUT_S = 10.0
_virtiofs_probed: dict[str, str | None] = {}  # resolved QEMU path -> reason (None: available); one per binary


def virtiofs_unavailable(qemu: str = QEMU) -> str | None:
    """Why a VM session cannot share over virtio-fs here (None: it can): not Linux, no
    ``memfd_create`` (the guest RAM the device maps), QEMU missing, or its ``-device help``
    not listing :data:`VIRTIOFS_DEVICE`. Asked once per QEMU binary (by its resolved path)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return "virtio-fs needs Linux with memfd_create (the guest's RAM is a shared memfd)"
    path = shutil.which(qemu)
    if path is None:
        return f"{qemu} is not installed"
    path = os.path.realpath(path)
    if path not in _virtiofs_probed:
        try:
            p = subprocess.run([path, "-machine", "none", "-device", "help"], check=False, capture_output=True,
                               text=True, stdin=subprocess.DEVNULL, timeout=DEVICE_PROBE_TIMEOUT_S)
            listed = re.search(r'name "%s"' % re.escape(VIRTIOFS_DEVICE), p.stdout) is not None
            reason = None if listed else f"{path} has no {VIRTIOFS_DEVICE} device (-device help)"
        except (OSError, subprocess.TimeoutExpired) as e:
            reason = f"{path} -device help failed: {e}"
        _virtiofs_probed[path] = reason
    return _virtiofs_probed[path]


def qemu_version(qemu: str = QEMU) -> str:
    """``"7.2.22"`` from ``qemu-system-x86_64 --version``."""
    try:
        p = subprocess.run([qemu, "--version"], check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=10)
    except FileNotFoundError:
        raise QemuError(f"{qemu} is not installed") from None
    except subprocess.TimeoutExpired:
        raise QemuError(f"{qemu} --version did not answer within 10 s") from None
    m = re.search(r"version\s+(\d+(?:\.\d+)+)", p.stdout)
    if p.returncode != 0 or m is None:
        raise QemuError(f"{qemu} --version: unexpected answer {(p.stdout + p.stderr).strip()[:200]!r}")
    return m.group(1)


# ---------------------------------------------------------------------------- accelerator probe


def _kvm_unusable() -> str | None:
    """Why /dev/kvm cannot be used, or None when it opens read/write."""
    if not os.path.exists(KVM_DEVICE):
        return f"KVM: {KVM_DEVICE} does not exist"
    try:
        fd = os.open(KVM_DEVICE, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return f"KVM: cannot open {KVM_DEVICE} read/write: {e.strerror}"
    os.close(fd)
    return None


def _cache_key(qemu_path: str, kernel_version: str) -> str:
    st = os.stat(qemu_path)
    raw = json.dumps([os.path.realpath(qemu_path), st.st_mtime_ns, kernel_version, os.uname().release])
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _cache_load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


def _cache_store(path: str, key: str, choice: AccelChoice) -> None:
    entries = _cache_load(path)
    entries.pop(key, None)
    entries[key] = {**asdict(choice), "cached": False, "probed_at": time.time()}
    while len(entries) > PROBE_CACHE_ENTRIES_MAX:  # oldest first (insertion order)
        entries.pop(next(iter(entries)))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".accel-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": 1, "entries": entries}, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _from_cache(entry: object) -> AccelChoice | None:
    """A cached choice; a TCG one runs today's :data:`TCG_CPU`, whatever model it was cached
    with (TCG's model is not probed: an entry written before it changed must not bring the
    old one back)."""
    if not isinstance(entry, dict):
        return None
    try:
        accel = entry["accel"]
        choice = AccelChoice(accel=accel, reason=str(entry["reason"]), boot_s=entry.get("boot_s"),
                             cpu=TCG_CPU if accel == "tcg" else str(entry["cpu"]), cached=True)
    except (KeyError, TypeError):
        return None
    return choice if choice.accel in ACCELS else None


def _died_how(status: int | None) -> str:
    if status is None:
        return "did not exit"
    return f"exit status {status}" if status >= 0 else f"signal {-status}"


def _qemu_complaint(lines: list[str], qemu_name: str) -> str:
    """QEMU's own complaint (its stderr shares the pty): its first ``error:`` line, else its
    last line, else the console's last line."""
    own = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(qemu_name + ":")]
    if own:
        return next((ln for ln in own if ln.startswith("error:")), own[-1])
    rest = [ln.strip() for ln in lines if ln.strip()]
    return rest[-1] if rest else "no output"


def _try_kvm(image: vm_image.Image, cpu: str, timeout_s: float, qemu: str) -> tuple[float | None, str]:
    """Boot the probe guest under KVM with ``cpu``: (boot seconds, "") or (None, what failed)."""
    from .console import BootError, Console

    cfg = VmConfig(kernel=image.vmlinuz, initrd=image.initrd, append=f"{PROBE_FLAG} quiet", accel="kvm", cpu=cpu,
                   memory_mb=256, cpus=1, host_root=False, qemu=qemu)
    t0 = time.monotonic()
    with Console(build_command(cfg), timeout_s=timeout_s) as con:
        try:
            con.wait_for(PROBE_MARKER, timeout_s)
            return time.monotonic() - t0, ""
        except BootError as e:
            died = e
        con.terminate(timeout_s=1.0)  # a hung KVM guest: SIGTERM, SIGKILL a second later
        lines = con.tail(40)
    if not died.timed_out:
        complaint = _qemu_complaint(lines, os.path.basename(qemu))
        if died.returncode == 0:  # the guest ran but its init did not answer the probe
            return None, f"-cpu {cpu}: QEMU exited without {PROBE_MARKER} ({complaint})"
        return None, f"-cpu {cpu} aborted ({_died_how(died.returncode)}): {complaint}"
    seen = [ln for ln in lines if ln.strip()]
    if not seen:
        return None, f"-cpu {cpu}: no output within {timeout_s:g} s"
    return None, f"-cpu {cpu}: no {PROBE_MARKER} within {timeout_s:g} s (last line: {seen[-1].strip()[:160]!r})"


def probe_accel(image: vm_image.Image | Callable[[], vm_image.Image], timeout_s: float = 15.0,
                cache_dir: str | None = None, qemu: str = QEMU) -> AccelChoice:
    """KVM if a guest actually boots with it here, else TCG — with the reason.

    ``SANDBOX_ACCEL=tcg|kvm`` decides without probing. Otherwise an unusable /dev/kvm
    means TCG at once; a usable one means booting ``image`` (whose init must print
    ``SANDBOX-PROBE-OK`` and power off when the kernel command line has
    ``sandbox.probe=1``) with each of :data:`KVM_CPU_MODELS`, at most ``timeout_s`` each.
    The answer is cached in ``cache_dir`` (default: the image cache) per QEMU binary
    (path and mtime), host kernel release and guest kernel version. ``image`` may be a
    function returning it, called only when the probe needs a guest (``/dev/kvm`` usable,
    no ``SANDBOX_ACCEL``): the nightly e2e runner asks this of every node without building
    an image where there is no KVM to probe."""
    forced = os.environ.get(ENV_ACCEL, "").strip()
    if forced:
        if forced not in ACCELS:
            raise ValueError(f"{ENV_ACCEL}={forced!r}: must be one of {', '.join(ACCELS)}")
        return AccelChoice(forced, f"{ENV_ACCEL}={forced}", None, cpu="host" if forced == "kvm" else TCG_CPU)
    why_not = _kvm_unusable()
    if why_not is not None:
        return AccelChoice("tcg", why_not, None)
    qemu_path = shutil.which(qemu)
    if qemu_path is None:
        raise QemuError(f"{qemu} is not installed")
    if callable(image):
        image = image()
    cache = os.path.join(cache_dir or vm_image.cache_root(), PROBE_CACHE_FILE)
    key = _cache_key(qemu_path, image.kernel.version)
    hit = _from_cache(_cache_load(cache).get(key))
    if hit is not None:
        return hit
    failures = []
    choice = None
    for cpu in KVM_CPU_MODELS:
        boot_s, failure = _try_kvm(image, cpu, timeout_s, qemu_path)
        if boot_s is not None:
            choice = AccelChoice("kvm", f"KVM boots with -cpu {cpu}", round(boot_s, 3), cpu=cpu)
            break
        failures.append(failure)
    if choice is None:
        choice = AccelChoice("tcg", "KVM: " + "; ".join(failures), None)
    try:
        _cache_store(cache, key, choice)
    except OSError:
        pass  # an unwritable cache only costs a probe next time
    return choice
