"""The guest's root without host data: the ``image`` kind (issue 13).

A Debian root built by ``mmdebstrap`` (variant ``apt``) from the host's apt sources, with
packages the user chooses (:data:`DEFAULT_PACKAGES` otherwise; :data:`REQUIRED_PACKAGES`
always — the shim is Python). It is cached under
``~/.cache/sandbox/guest/roots/<key>`` where the key (:func:`cache_key`) hashes the package
list, the suite and the architecture: built once, in a temporary directory renamed into
place, so a cached root is always complete. The guest gets it like ``host-usr``: its
``/usr`` read-only (QEMU 9p, tag :data:`IMAGE_USR_TAG`) and a per-session skeleton
(:func:`sandbox.vm.guestroot.build_skeleton` with ``host_root`` = the image) whose
``/etc`` is the image's own ``/etc`` minus :data:`~sandbox.vm.guestroot.ETC_NEVER`, plus the
generated ``passwd``/``group``/``hosts``/``hostname``/``resolv.conf``.

Invariants: no host file is copied into the image — the apt sources are generated here
from the host's (URIs, suites, components, keyring path: no credentials), and the files
mmdebstrap copies from the host (``/etc/resolv.conf``, ``/etc/hostname``) are deleted by a
customize hook before the root is renamed into the cache; package names are Debian
package names (:data:`PACKAGE_NAME_RE`), at most :data:`GUEST_PACKAGES_MAX` of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time

from . import guestroot

#: always in an image root: the shim and netstub are Python
REQUIRED_PACKAGES = ("python3",)
#: what real agents need when the user names nothing: Python with venv/pip, git, a C
#: toolchain, TLS roots, nft for the allowlist's transparent redirection
DEFAULT_PACKAGES = ("python3", "python3-venv", "python3-pip", "git", "ca-certificates", "build-essential",
                    "nftables")
GUEST_PACKAGES_MAX = 256
PACKAGE_NAME_BYTES_MAX = 128
#: Debian policy §5.6.7: lowercase letters, digits, + - . ; at least two; starts alphanumeric.
#: An optional ``:arch`` qualifier is not accepted (one architecture per root).
PACKAGE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9+.-]+")
#: bumped when the way a root is built changes (part of the cache key)
ROOT_FORMAT = 1
VARIANT = "apt"
IMAGE_USR_TAG = "imageusr"
BUILD_TIMEOUT_S = 3600.0
SOURCES_FILE = "/etc/apt/sources.list.d/debian.sources"
SOURCES_BYTES_MAX = 1 << 20
#: mmdebstrap copies these from the host into the chroot; they are removed (the skeleton generates its own)
HOST_COPIED = ("etc/resolv.conf", "etc/hostname")
#: lines of mmdebstrap's output kept for an error message
ERROR_TAIL_LINES = 30


class ImageRootError(guestroot.GuestRootError):
    """The image root cannot be built (no mmdebstrap, no usable apt source, a failed build)."""


def parse_packages(text: str) -> list[str]:
    """``"git,python3, make"`` -> ``["git", "python3", "make"]`` (empty items dropped; not validated)."""
    return [p.strip() for p in text.split(",") if p.strip()]


def validate_packages(packages) -> tuple[str, ...]:
    """The package list an image root is built from: the names given (or
    :data:`DEFAULT_PACKAGES` when ``packages`` is None) plus :data:`REQUIRED_PACKAGES`,
    sorted, without repeats. Raises ValueError on a name that is not a Debian package
    name, or more than :data:`GUEST_PACKAGES_MAX` names."""
    if packages is None:
        packages = DEFAULT_PACKAGES
    if isinstance(packages, str) or not isinstance(packages, (list, tuple)):
        raise ValueError(f"guest_packages must be a list of Debian package names, not {packages!r}")
    if len(packages) > GUEST_PACKAGES_MAX:
        raise ValueError(f"guest_packages: at most {GUEST_PACKAGES_MAX} packages, not {len(packages)}")
    for p in packages:
        if not isinstance(p, str) or len(p) > PACKAGE_NAME_BYTES_MAX or not PACKAGE_NAME_RE.fullmatch(p):
            raise ValueError(f"guest_packages: {p!r} is not a Debian package name "
                             "(lowercase letters, digits, + - . ; at least two characters)")
    return tuple(sorted(set(packages) | set(REQUIRED_PACKAGES)))


def parse_sources(text: str) -> list[dict]:
    """The ``Types: deb`` stanzas of a deb822 sources file, as dicts with ``uris``,
    ``suites``, ``components`` (lists) and ``signed_by`` (a keyring path or None);
    disabled (``Enabled: no``) stanzas and comments are skipped."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line[0] in " \t" and key:  # a continuation line
                fields[key] += " " + line.strip()
                continue
            key, sep, value = line.partition(":")
            if not sep:
                key = None
                continue
            key = key.strip().lower()
            fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        entry = {"uris": fields.get("uris", "").split(), "suites": fields.get("suites", "").split(),
                 "components": fields.get("components", "").split(), "signed_by": fields.get("signed-by")}
        if entry["uris"] and entry["suites"]:
            out.append(entry)
    return out


def host_sources(path: str = SOURCES_FILE) -> list[dict]:
    """The host's Debian apt sources (:func:`parse_sources`); ImageRootError without any."""
    try:
        with open(path, "rb") as f:
            text = f.read(SOURCES_BYTES_MAX + 1)
    except OSError as e:
        raise ImageRootError(f"cannot read the host's apt sources {path}: {e.strerror}") from None
    if len(text) > SOURCES_BYTES_MAX:
        raise ImageRootError(f"{path} is larger than {SOURCES_BYTES_MAX} bytes")
    entries = parse_sources(text.decode("utf-8", "replace"))
    if not entries:
        raise ImageRootError(f"{path} has no enabled 'Types: deb' source")
    for e in entries:
        for uri in e["uris"]:
            if "@" in uri.partition("://")[2].partition("/")[0]:
                raise ImageRootError(f"{path}: a source URI with credentials is not used for the guest image")
    return entries


def sources_text(entries: list[dict]) -> str:
    """A deb822 sources file generated from :func:`parse_sources` entries (no host text copied)."""
    out = []
    for e in entries:
        lines = ["Types: deb", "URIs: " + " ".join(e["uris"]), "Suites: " + " ".join(e["suites"]),
                 "Components: " + " ".join(e["components"] or ["main"])]
        if e["signed_by"] and e["signed_by"].startswith("/") and "\n" not in e["signed_by"]:
            lines.append("Signed-By: " + e["signed_by"])
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)


def host_arch() -> str:
    try:
        return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        raise ImageRootError(f"cannot ask dpkg for the architecture: {e}") from None


def cache_key(packages, suite: str, arch: str) -> str:
    """The name of a cached root: a hash of the (validated, sorted) package list, the suite,
    the architecture and :data:`ROOT_FORMAT`; the order and repeats of ``packages`` do not matter."""
    doc = {"format": ROOT_FORMAT, "variant": VARIANT, "packages": list(validate_packages(list(packages))),
           "suite": suite, "arch": arch}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def roots_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sandbox", "guest", "roots")


def mmdebstrap_command(target: str, packages, suite: str, arch: str, sources_path: str) -> list[str]:
    """The mmdebstrap command line that builds ``target`` (a directory that does not exist yet)."""
    rm = " ".join(f'"$1/{p}"' for p in HOST_COPIED)
    return ["mmdebstrap", f"--variant={VARIANT}", f"--architectures={arch}",
            "--include=" + ",".join(packages),
            f"--customize-hook=rm -f {rm}",  # host files mmdebstrap copied in
            suite, target, sources_path]


def ensure_root(packages=None, *, progress=print, sources_path: str = SOURCES_FILE, cache: str | None = None,
                arch: str | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> str:
    """The path of a complete image root for ``packages`` (:func:`validate_packages`),
    built now unless cached. The build runs in a temporary directory beside the cache
    entry and is renamed into place only when mmdebstrap succeeded; a concurrent build of
    the same key loses the rename and its copy is removed."""
    pkgs = validate_packages(packages)
    entries = host_sources(sources_path)
    suite = entries[0]["suites"][0]
    arch = arch or host_arch()
    cache = cache or roots_dir()
    final = os.path.join(cache, cache_key(pkgs, suite, arch))
    if os.path.isdir(os.path.join(final, "usr")):
        return final
    if shutil.which("mmdebstrap") is None:
        raise ImageRootError("mmdebstrap is not installed (apt-get install mmdebstrap; ./dev installs it)")
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=cache)
    try:
        src = os.path.join(tmp, "debian.sources")
        with open(src, "w") as f:
            f.write(sources_text(entries))
        target = os.path.join(tmp, "root")
        cmd = mmdebstrap_command(target, pkgs, suite, arch, src)
        progress(f"building the image guest root ({suite}/{arch}, {len(pkgs)} packages: {', '.join(pkgs)}) …")
        t0 = time.monotonic()
        tail: list[str] = []
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        try:
            deadline = t0 + timeout_s
            for line in proc.stdout:  # mmdebstrap's stages ("I: downloading packages with apt...")
                line = line.rstrip()
                tail = (tail + [line])[-ERROR_TAIL_LINES:]
                if line.startswith(("I: ", "E: ", "W: ")):
                    progress(f"  mmdebstrap: {line[3:]}")
                if time.monotonic() > deadline:
                    proc.kill()
                    break
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        finally:
            proc.stdout.close()
        if rc != 0:
            raise ImageRootError(f"mmdebstrap failed (exit {rc}):\n" + "\n".join(tail))
        for p in HOST_COPIED:  # a second fence: mmdebstrap's hook ran, but never keep a host file
            try:
                os.unlink(os.path.join(target, p))
            except FileNotFoundError:
                pass
        try:
            os.rename(target, final)
        except OSError:
            if not os.path.isdir(os.path.join(final, "usr")):
                raise
        progress(f"image guest root built in {time.monotonic() - t0:.0f} s: {final}")
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def etc_entries(root: str) -> list[str]:
    """Every entry of the image's ``/etc`` (relative, sorted, links not followed), minus
    :data:`~sandbox.vm.guestroot.ETC_NEVER` (shadow, passwd/group — generated —, ssh, …)."""
    etc = os.path.join(root, "etc")
    out = []
    for dirpath, dirs, files in os.walk(etc):
        dirs[:] = sorted(d for d in dirs if not guestroot._never(os.path.relpath(os.path.join(dirpath, d), etc)))
        for n in dirs + sorted(files):
            rel = os.path.relpath(os.path.join(dirpath, n), etc)
            if not guestroot._never(rel):
                out.append(rel)
    return sorted(out)
