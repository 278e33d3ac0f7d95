"""The guest's root without host data: the ``host-usr`` kind (SPEC §5, issue 13).

The guest's userland is the host's ``/usr`` (QEMU 9p, tag ``hostusr``, read-only) plus a
small *root skeleton* synthesized here, on the host, per session: the merged-usr links
(``bin -> usr/bin`` …, as on the host), empty directories (``home``, ``root``, ``tmp``,
``var``, …) and an ``/etc`` made of

* copies of an explicit allowlist of non-secret host files (:data:`ETC_ALLOWLIST`: the
  loader cache, alternatives, CA certificates, name-service switch, os-release, …), and
* generated files (:func:`generated_etc`): ``passwd``/``group`` with root, the guest user
  ``agent`` and nobody — no ``shadow``/``gshadow`` at all — ``hosts``, ``hostname`` and a
  placeholder ``resolv.conf`` (the guest's network setup writes the real one).

The skeleton travels to the guest as a second read-only 9p export (tag ``rootskel``);
init.sh copies it into a tmpfs, makes root own it, and unmounts the export.

Invariants: nothing outside the allowlist is read from the host's ``/etc``; of what the
allowlist names, only symlinks (copied as links, never followed) and regular files that
are world-readable on the host are copied — a file the host keeps from other users is
never shipped, whatever its name; names in :data:`ETC_NEVER` are refused even if an
allowlist entry would reach them; the copy is bounded (:data:`ETC_ENTRIES_MAX`,
:data:`ETC_BYTES_MAX`) and exceeding a bound is an error, not a truncated ``/etc``.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import stat

#: the host's /etc entries (files, symlinks or directories, relative to /etc; shell globs
#: allowed) copied into the guest's /etc. Deliberately absent: shadow/gshadow, ssh/, sudoers,
#: ssl/private, pip.conf (index URLs with tokens), gitconfig and environment (may carry
#: credentials or proxies), profile.d/, apt/, machine-id, hostname (identifying).
ETC_ALLOWLIST = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d",  # the dynamic loader
    "alternatives",  # Debian's /usr/bin/… -> /etc/alternatives/… links
    "ssl/certs", "ssl/openssl.cnf", "ca-certificates.conf", "ca-certificates/update.d",  # TLS trust
    "nsswitch.conf", "host.conf", "gai.conf", "protocols", "services", "networks", "ethertypes",
    "os-release", "debian_version", "lsb-release", "localtime", "timezone",
    "shells", "login.defs", "profile", "bash.bashrc", "inputrc", "magic", "magic.mime", "mime.types",
    "python3", "python3.*",  # Debian's python3 site configuration
    "locale.alias", "locale.conf", "default/locale",
)
#: path components never shipped, whatever the allowlist says (a second fence)
ETC_NEVER = ("shadow", "shadow-", "gshadow", "gshadow-", "ssh", "sudoers", "sudoers.d", "private",
             "passwd", "passwd-", "group", "group-", "machine-id", "*.key", "*.pem.key", "id_*")
ETC_ENTRIES_MAX = 8192
ETC_BYTES_MAX = 32 << 20
#: merged-usr links that a host-usr root needs (the first three must be links on the host)
MERGED_USR_REQUIRED = ("bin", "sbin", "lib")
MERGED_USR_OPTIONAL = ("lib32", "lib64", "libx32")
#: empty directories of the skeleton and their modes
SKELETON_DIRS = (("dev", 0o755), ("proc", 0o555), ("sys", 0o555), ("run", 0o755), ("tmp", 0o1777),
                 ("usr", 0o755), ("home", 0o755), ("root", 0o700), ("mnt", 0o755), ("srv", 0o755),
                 ("opt", 0o755), ("media", 0o755), ("var", 0o755), ("var/tmp", 0o1777), ("var/lib", 0o755),
                 ("var/cache", 0o755), ("var/log", 0o755), ("var/mail", 0o755))
USER_NAME = "agent"
USER_HOME = "/home/agent"
#: the guest user's uid/gid when root owns the working folder
USER_ID_FALLBACK = 1000
HOSTNAME = "sandbox"
SKELETON_TAG = "rootskel"
HOST_USR_TAG = "hostusr"


class GuestRootError(RuntimeError):
    """The guest root cannot be made here (not a merged-usr host, an /etc over its bounds)."""


def user_ids(folder: str) -> tuple[int, int]:
    """The guest user's (uid, gid): the owner of ``folder`` (working folder 0), or
    :data:`USER_ID_FALLBACK` for both when root owns it (and for the gid alone when the
    folder's group is root's: the guest user never gets group 0)."""
    st = os.stat(folder)
    if st.st_uid == 0:
        return USER_ID_FALLBACK, USER_ID_FALLBACK
    return st.st_uid, st.st_gid or USER_ID_FALLBACK


def _never(rel: str) -> bool:
    return any(fnmatch.fnmatch(part, pat) for part in rel.split("/") for pat in ETC_NEVER)


def allowed_etc(host_etc: str = "/etc") -> list[str]:
    """The allowlisted entries present under ``host_etc`` (relative paths, sorted; a
    directory's whole subtree, without following symlinks), minus :data:`ETC_NEVER`."""
    out: list[str] = []
    for pattern in ETC_ALLOWLIST:
        head, _, tail = pattern.rpartition("/")
        base = os.path.join(host_etc, head) if head else host_etc
        try:
            names = sorted(n for n in os.listdir(base) if fnmatch.fnmatch(n, tail))
        except OSError:
            continue  # the host has no such directory: nothing to copy
        if names and head:  # the directories above an entry (e.g. ssl for ssl/certs)
            parts = head.split("/")
            out += ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
        for name in names:
            rel = f"{head}/{name}" if head else name
            if _never(rel):
                continue
            path = os.path.join(host_etc, rel)
            out.append(rel)
            if os.path.isdir(path) and not os.path.islink(path):
                for dirpath, dirs, files in os.walk(path):  # never follows links
                    dirs.sort()
                    for n in sorted(dirs) + sorted(files):
                        sub = os.path.relpath(os.path.join(dirpath, n), host_etc)
                        if not _never(sub):
                            out.append(sub)
                    dirs[:] = [d for d in dirs if not _never(os.path.relpath(os.path.join(dirpath, d), host_etc))]
    return sorted(set(out))


def generated_etc(uid: int, gid: int, shell: str = "/bin/sh") -> dict[str, bytes]:
    """The guest's identity files: root, the guest user and nobody; no password hashes
    anywhere (``x`` with no shadow file: nobody can log in with a password)."""
    if not (0 < uid < 1 << 31 and 0 < gid < 1 << 31):
        raise ValueError(f"the guest user's uid/gid must be positive, not {uid}/{gid}")
    passwd = (f"root:x:0:0:root:/root:{shell}\n"
              f"{USER_NAME}:x:{uid}:{gid}:sandbox agent:{USER_HOME}:{shell}\n"
              "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    group = f"root:x:0:\n{USER_NAME}:x:{gid}:\nnogroup:x:65534:\n" if gid != 65534 else "root:x:0:\nnogroup:x:65534:\n"
    return {
        "passwd": passwd.encode(),
        "group": group.encode(),
        "hostname": f"{HOSTNAME}\n".encode(),
        "hosts": f"127.0.0.1 localhost\n127.0.1.1 {HOSTNAME}\n::1 localhost ip6-localhost ip6-loopback\n".encode(),
        "resolv.conf": b"# written by the guest's network setup (no DNS unless the network allows it)\n",
    }


def merged_usr_links(host_root: str = "/") -> dict[str, str]:
    """The host's merged-usr links (name -> target, e.g. ``bin -> usr/bin``); a host whose
    ``/bin``, ``/sbin`` or ``/lib`` is a real directory cannot lend only its ``/usr``."""
    links = {}
    for name in MERGED_USR_REQUIRED + MERGED_USR_OPTIONAL:
        path = os.path.join(host_root, name)
        if os.path.islink(path):
            target = os.readlink(path)
            if os.path.normpath(os.path.join("/", target)).split("/")[1:2] != ["usr"]:
                raise GuestRootError(f"/{name} -> {target}: not a link into /usr (host-usr needs a merged-usr host)")
            links[name] = target
        elif name in MERGED_USR_REQUIRED:
            raise GuestRootError(f"/{name} is not a link into /usr: host-usr needs a merged-usr host "
                                 "(use the image guest root)")
    return links


def build_skeleton(dest: str, *, uid: int, gid: int, host_root: str = "/", etc_entries: list[str] | None = None) -> None:
    """Write the root skeleton (everything of the guest root but ``/usr``'s contents) into
    the new directory ``dest``. Raises GuestRootError when the host cannot lend its /usr
    or its allowlisted /etc is over the bounds. ``etc_entries`` (relative to
    ``host_root``/etc, sorted): what of /etc to copy instead of the allowlist — an image root's
    own /etc (:func:`sandbox.vm.imageroot.etc_entries`); the same checks and bounds apply."""
    host_etc = os.path.join(host_root, "etc")
    links = merged_usr_links(host_root)
    os.makedirs(dest)
    for name, target in links.items():
        os.symlink(target, os.path.join(dest, name))
    for d, mode in SKELETON_DIRS:
        p = os.path.join(dest, d)
        os.makedirs(p, exist_ok=True)
        os.chmod(p, mode)
    etc = os.path.join(dest, "etc")
    os.mkdir(etc, 0o755)
    entries = allowed_etc(host_etc) if etc_entries is None else [e for e in etc_entries if not _never(e)]
    if len(entries) > ETC_ENTRIES_MAX:
        raise GuestRootError(f"the allowlisted /etc has {len(entries)} entries, more than {ETC_ENTRIES_MAX}")
    total = 0
    made = {""}  # directories created here: a child is written only under one (never through a link)
    for rel in entries:  # sorted: a directory comes before what is in it
        src, dst = os.path.join(host_etc, rel), os.path.join(etc, rel)
        if os.path.dirname(rel) not in made:
            continue  # its parent was not copied (a link, or a directory others cannot read)
        st = os.lstat(src)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), dst)
        elif stat.S_ISDIR(st.st_mode):
            if st.st_mode & stat.S_IROTH and st.st_mode & stat.S_IXOTH:
                os.mkdir(dst, 0o755)
                made.add(rel)
        elif stat.S_ISREG(st.st_mode) and st.st_mode & stat.S_IROTH:
            total += st.st_size
            if total > ETC_BYTES_MAX:
                raise GuestRootError(f"the allowlisted /etc is larger than {ETC_BYTES_MAX} bytes")
            shutil.copyfile(src, dst, follow_symlinks=False)
            os.chmod(dst, 0o644 | (st.st_mode & 0o111))
    shell = "/bin/bash" if os.path.exists(os.path.join(host_root, "usr/bin/bash")) else "/bin/sh"
    for name, data in generated_etc(uid, gid, shell).items():
        with open(os.path.join(etc, name), "wb") as f:
            f.write(data)
