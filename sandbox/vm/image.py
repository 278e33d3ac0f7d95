"""Guest kernel and initramfs: fetched from the Debian archive, built and cached locally.

SPEC §5: the guest runs Debian's own kernel (``linux-image-amd64``), fetched with
``apt-get download`` and unpacked with ``dpkg -x`` into a cache directory — no host
kernel install, nothing downloaded outside the package archive. The initramfs is
busybox (``busybox-static``) plus exactly the kernel modules asked for (with their
dependencies, resolved from each module's ``.modinfo``) and an ``/init`` script.

This is the host-side builder; the guest's init and shim live in ``guest/``. It ships
inside the package so ``sandbox`` can build an image on demand.

Invariants: the cache key is a hash of every input (kernel package file name, busybox
binary, module list, init script, extra files), so a changed input builds a new image
and an unchanged one is reused; files are written to a temporary name and renamed into
place, so an interrupted build never leaves a half image that looks complete.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import stat
import struct
import subprocess
import tempfile
from dataclasses import dataclass

BUSYBOX = "/bin/busybox"
KERNEL_META_PACKAGE = "linux-image-amd64"
#: what a guest needs to reach a 9P share over QEMU user networking (virtio-net + trans=tcp)
NINEP_MODULES = ("virtio_pci", "virtio_net", "9pnet_fd", "9p")


class ImageError(RuntimeError):
    """The guest image cannot be built here (no apt, no network to the archive, …)."""


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sandbox", "guest")


def _run(cmd: list[str], cwd: str | None = None) -> str:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    except FileNotFoundError:
        raise ImageError(f"{cmd[0]} is not installed (a Debian/Ubuntu host is needed to build the guest)") from None
    if p.returncode != 0:
        raise ImageError(f"{' '.join(cmd)} failed: {(p.stderr or p.stdout).strip()[-500:]}")
    return p.stdout


@dataclass(frozen=True)
class Kernel:
    version: str  # e.g. "6.1.0-50-amd64"
    root: str  # the unpacked package (boot/, lib/modules/…)

    @property
    def vmlinuz(self) -> str:
        return os.path.join(self.root, "boot", f"vmlinuz-{self.version}")

    @property
    def modules_dir(self) -> str:
        return os.path.join(self.root, "lib", "modules", self.version)


def fetch_kernel(cache: str | None = None) -> Kernel:
    """The current Debian kernel package, downloaded and unpacked once into ``cache``."""
    cache = cache or cache_root()
    deps = _run(["apt-cache", "depends", KERNEL_META_PACKAGE])
    names = [line.split(":", 1)[1].strip() for line in deps.splitlines() if line.strip().startswith("Depends:")]
    pkg = next((n for n in names if n.startswith("linux-image-") and not n.endswith("-unsigned")), None)
    if pkg is None:
        raise ImageError(f"apt-cache found no kernel package behind {KERNEL_META_PACKAGE} (apt sources missing?)")
    version = pkg[len("linux-image-"):]
    root = os.path.join(cache, "kernel", version)
    kernel = Kernel(version, root)
    if os.path.exists(kernel.vmlinuz) and os.path.isdir(kernel.modules_dir):
        return kernel
    os.makedirs(os.path.dirname(root), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(root)) as tmp:
        _run(["apt-get", "download", pkg], cwd=tmp)
        debs = [f for f in os.listdir(tmp) if f.endswith(".deb")]
        if len(debs) != 1:
            raise ImageError(f"apt-get download {pkg} gave {debs}")
        unpacked = os.path.join(tmp, "root")
        _run(["dpkg", "-x", os.path.join(tmp, debs[0]), unpacked])
        if not os.path.exists(os.path.join(unpacked, "boot", f"vmlinuz-{version}")):
            raise ImageError(f"{debs[0]} has no boot/vmlinuz-{version}")
        shutil.rmtree(root, ignore_errors=True)
        os.rename(unpacked, root)
    return kernel


# ---------------------------------------------------------------------------- modules


def modinfo(path: str) -> dict[str, str]:
    """The ``.modinfo`` section of an ELF64 kernel module (first value of each key)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ImageError(f"{path} is not an ELF64 module (compressed modules are not supported)")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, off, size

    _n, stroff, _s = section(shstrndx)
    out: dict[str, str] = {}
    for i in range(shnum):
        name, off, size = section(i)
        end = data.index(b"\0", stroff + name)
        if data[stroff + name:end] == b".modinfo":
            for item in data[off:off + size].split(b"\0"):
                key, sep, value = item.partition(b"=")
                if sep:
                    out.setdefault(key.decode(), value.decode(errors="replace"))
    return out


def resolve_modules(kernel: Kernel, wanted: tuple[str, ...]) -> list[str]:
    """Paths of ``wanted`` modules and their dependencies, dependencies first.
    A name with no ``.ko`` is taken to be built into the kernel."""
    index: dict[str, str] = {}
    for dirpath, _dirs, files in os.walk(os.path.join(kernel.modules_dir, "kernel")):
        for f in files:
            if f.endswith(".ko"):
                index[f[:-3].replace("-", "_")] = os.path.join(dirpath, f)
    order: list[str] = []

    def add(name: str, chain: tuple[str, ...]) -> None:
        name = name.replace("-", "_")
        if not name or name in order or name not in index:
            return
        if name in chain:
            raise ImageError(f"module dependency cycle: {' -> '.join(chain + (name,))}")
        for dep in modinfo(index[name]).get("depends", "").split(","):
            add(dep, chain + (name,))
        order.append(name)

    for w in wanted:
        add(w, ())
    return [index[n] for n in order]


# ---------------------------------------------------------------------------- initramfs


def cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A ``newc`` cpio archive of ``(path, st_mode, data)``; symlinks carry their target as data."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate(entries + [("TRAILER!!!", 0, b"")], start=1):
        nb = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0)
        out += b"070701" + "".join(f"{v:08X}" for v in fields).encode() + nb
        out += b"\0" * (-len(out) % 4)
        out += data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


@dataclass(frozen=True)
class Image:
    kernel: Kernel
    initrd: str

    @property
    def vmlinuz(self) -> str:
        return self.kernel.vmlinuz


def build_initramfs(kernel: Kernel, init_script: str, modules: tuple[str, ...] = NINEP_MODULES,
                    files: dict[str, bytes] | None = None, cache: str | None = None) -> Image:
    """Busybox + ``modules`` (loaded in dependency order before ``init_script`` runs) + ``files``.

    ``init_script`` is shell run by busybox as PID 1 after /proc, /sys and /dev are
    mounted and the modules are loaded. Cached by the hash of all inputs."""
    if not os.path.exists(BUSYBOX):
        raise ImageError(f"{BUSYBOX} is missing: apt-get install busybox-static")
    with open(BUSYBOX, "rb") as f:
        busybox = f.read()
    mods = resolve_modules(kernel, modules)
    files = dict(files or {})
    h = hashlib.sha256()
    for part in [kernel.version.encode(), busybox, init_script.encode(), *(m.encode() for m in mods),
                 *(k.encode() + b"\0" + v for k, v in sorted(files.items()))]:
        h.update(hashlib.sha256(part).digest())
    cache = cache or cache_root()
    path = os.path.join(cache, "initrd", f"{h.hexdigest()[:24]}.cpio.gz")
    if os.path.exists(path):
        return Image(kernel, path)
    names = [os.path.basename(m) for m in mods]
    init = ["#!/bin/busybox sh", "/bin/busybox --install -s /bin", "export PATH=/bin",
            "mount -t proc proc /proc", "mount -t sysfs sys /sys", "mount -t devtmpfs dev /dev"]
    init += [f"insmod /lib/modules/{n}" for n in names]
    entries: list[tuple[str, int, bytes]] = [(d, stat.S_IFDIR | 0o755, b"") for d in
                                            ("bin", "dev", "proc", "sys", "mnt", "tmp", "lib", "lib/modules")]
    entries.append(("bin/busybox", stat.S_IFREG | 0o755, busybox))
    for m, n in zip(mods, names):
        with open(m, "rb") as f:
            entries.append((f"lib/modules/{n}", stat.S_IFREG | 0o644, f.read()))
    for name, data in sorted(files.items()):
        entries.append((name.lstrip("/"), stat.S_IFREG | 0o755, data))
    entries.append(("init", stat.S_IFREG | 0o755, ("\n".join(init) + "\n" + init_script).encode()))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as f:
        f.write(gzip.compress(cpio_newc(entries), compresslevel=6))
    os.rename(tmp, path)
    return Image(kernel, path)


# ---------------------------------------------------------------------------- the product image

#: what a session's guest loads: virtio transport, the 9P client (TCP for working folders,
#: virtio for the host root), overlay for the writable layer, the control port, a disk for
#: persistent mode, and the virtiofs/FUSE modules the virtiofs backend will use
GUEST_MODULES = NINEP_MODULES + ("9pnet_virtio", "overlay", "virtio_console", "virtio_blk", "crc32c_generic", "ext4",
                                 "nf_tables", "nft_chain_nat", "nft_redir", "qemu_fw_cfg",
                                 "virtiofs", "fuse")


#: what runs in the guest besides init.sh (sandbox/guest/, package data)
GUEST_FILES = ("shim.py", "control.py", "netstub.py")


def guest_dir() -> str:
    """Where the guest's files live: ``sandbox/guest/`` (package data: init.sh, shim.py)."""
    d = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "guest"))
    if not os.path.exists(os.path.join(d, "init.sh")):
        raise ImageError(f"sandbox/guest/init.sh was not found in {d}: the package is incomplete")
    return d


def guest_image(cache: str | None = None) -> Image:
    """The session guest: Debian's kernel, busybox, GUEST_MODULES, sandbox/guest/init.sh as PID 1,
    sandbox/guest/shim.py and the protocol module it imports, sandbox/guest/control.py (both at
    the initramfs root; init.sh copies them side by side). Built on first use and cached;
    rebuilt when any input changes."""
    g = guest_dir()
    with open(os.path.join(g, "init.sh")) as f:
        init = f.read()
    files = {}
    for name in GUEST_FILES:
        with open(os.path.join(g, name), "rb") as f:
            files[name] = f.read()
    return build_initramfs(fetch_kernel(cache), init, GUEST_MODULES, files=files, cache=cache)
