"""Identity: what a guest's privileged metadata becomes on the host (SPEC §5 "Identity").

The server runs as whoever started it — in CI and for many users, root. The guest's root
must not be the host's root: nothing a guest sets may become a host privilege, whoever
owns the folder. The rules, as pure functions (the :class:`~sandbox.mounts.Provider`
applies them to every client request; ``docs/identity.md`` tells the whole model):

* **set-id bits are mapped, not applied.** :func:`host_mode` is what the host gets for a
  guest's mode: never a set-uid/set-gid bit (:data:`SETID_BITS`) the object does not
  already have on the host (a bit the host user set stays as long as the guest keeps it).
  What the host does not get is kept in the host xattr :data:`MODE_XATTR` as the guest's
  whole mode (:func:`encode_mode`), and reported back by :func:`guest_mode` — only while
  the host's mode is still the one applied from it, so a host-side ``chmod`` since wins.
* **privileged xattrs are mapped into** ``user.``. Every name outside the ``user.``
  namespace (``security.*`` — file capabilities, SELinux labels —, ``trusted.*``,
  ``system.posix_acl_*``, anything else) and every guest name under the reserved prefix
  :data:`RESERVED_PREFIX` is stored on the host as :data:`MAPPED_PREFIX` + the name
  (:func:`host_xattr_name`), which no kernel, LSM or ACL code honours. Other ``user.*``
  names pass through unchanged.
* **the reserved prefix is invisible.** The host's :data:`RESERVED_PREFIX` names (the
  mode, the mapped xattrs) are never shown or settable under their host names; the host's
  own privileged xattrs (a real ACL, an SELinux label) are neither shown to the guest nor
  changed by it. :func:`guest_xattr_name` is the inverse of :func:`host_xattr_name` on
  exactly the names it produces, so listing, reading and writing agree.
* **a guest write disarms a host set-id file.** The host kernel clears set-id bits on a
  write only for a writer without ``CAP_FSETID`` — and a server running as root has it. So
  before a guest can write to a regular file with such bits (:func:`privileges_on_write`)
  they are cleared on the host and kept in :data:`MODE_XATTR`, as the guest's root still
  sees them. (File capabilities need nothing: the kernel drops ``security.capability`` on
  every write, whoever writes.)
* **owners are mapped, never applied** (issue 15): a request acts as a :class:`Cred` (the
  9P attach's uid, :func:`attach_cred`; a creating request's gid). A chown, and a creation
  by a cred whose owner differs from what the client sees anyway (:func:`presented_owner`),
  keep ``b"<uid>:<gid>"`` in :data:`OWNER_XATTR` of a regular file or directory, which
  getattr reports (:func:`guest_owner`; a damaged value is ignored); a chown back to the
  presented owner removes it. The host file keeps the server's owner: nothing is given to
  another host user. Symlinks, fifos and sockets cannot carry user xattrs: theirs is kept
  in :data:`SPECIAL_OWNER_XATTR` (``trusted.``) where the server has ``CAP_SYS_ADMIN``;
  without it their owners are the host's (a chown of one is accepted and not kept).
* **set-id bits fall as Linux drops them**: a write or truncate by a cred without
  ``CAP_FSETID`` (uid != 0) clears :func:`privileges_on_write` of the guest's mode; a chown
  of a non-directory clears :func:`privileges_on_chown`, whoever asks.
* **owners are reported for the guest user** (issue 13, :class:`OwnerMap`, a cred's
  ``view``): a VM's commands run as an unprivileged guest user; the server reports the
  working folder owner's and its own uid/gid as that user's (where no owner is kept), so
  the guest kernel's permission checks let the user work in its shares. A presentation
  only: nothing on the host changes, other owners are shown as they are, and the host
  still checks every access as the server's user.

Invariants (``sandbox_sim/test_identity.py`` checks them for every mode and name it generates):
``host_mode(m, cur) & SETID_BITS ⊆ cur & SETID_BITS``; ``host_mode(m, cur)`` equals ``m``
outside :data:`SETID_BITS`; ``guest_mode(host_mode(m, cur), mode_mapping(m, cur)) == m``;
``guest_xattr_name(host_xattr_name(n)) == n``; no name :func:`host_xattr_name` returns lies
outside ``user.``.
"""

from __future__ import annotations

import errno
import stat as _stat
from dataclasses import dataclass

#: the mode bits a guest may never give a host file: set-user-id and set-group-id
SETID_BITS = _stat.S_ISUID | _stat.S_ISGID  # 0o6000
#: the permission bits a mode carries (what chmod(2) takes)
MODE_BITS = 0o7777
#: the one xattr namespace the host kernel gives no meaning to
USER_NAMESPACE = "user."
#: host xattrs under this prefix belong to the server: never shown to or set by a guest
RESERVED_PREFIX = "user.sandbox."
#: the guest's whole mode, when the host's mode lacks set-id bits the guest gave it
MODE_XATTR = RESERVED_PREFIX + "mode"
#: a guest xattr the host must not honour is stored under this prefix + its name
MAPPED_PREFIX = RESERVED_PREFIX + "x."
#: the kernel's longest xattr name (XATTR_NAME_MAX), in bytes
XATTR_NAME_BYTES_MAX = 255
#: longest :data:`MODE_XATTR` value read back (``b"7777"`` is 4); longer is not ours
MODE_VALUE_BYTES_MAX = 8
#: the owner the guest gave a file (``b"<uid>:<gid>"``), when it is not what the guest sees anyway
OWNER_XATTR = RESERVED_PREFIX + "owner"
#: longest :data:`OWNER_XATTR` value read back (``b"4294967295:4294967295"`` is 21); longer is not ours
OWNER_VALUE_BYTES_MAX = 21
#: the same for a symlink, fifo or socket, which Linux lets carry no ``user.`` xattr: a
#: ``trusted.`` one, kept only by a server with ``CAP_SYS_ADMIN``. Never a guest's name: a
#: guest's ``trusted.*`` is stored under :data:`MAPPED_PREFIX` and the host's is never shown
SPECIAL_OWNER_XATTR = "trusted.sandbox.owner"
#: the guest's whole mode of a fifo or socket with set-id bits (as :data:`MODE_XATTR`), kept the same way
SPECIAL_MODE_XATTR = "trusted.sandbox.mode"
#: the largest id a guest can give (2**32-1 is "no change", -1, in chown(2))
ID_MAX = 0xFFFFFFFE
#: 9P's ``n_uname`` "none": the attach names its user by ``uname`` only
NONUNAME = 0xFFFFFFFF
#: the uid (and gid) an attach without a numeric uid that is not "root" acts as (Linux's overflowuid)
NOBODY_ID = 65534


@dataclass(frozen=True)
class OwnerMap:
    """The owners the guest sees: a uid in ``host_uids`` is reported as ``guest_uid``, a gid in
    ``host_gids`` as ``guest_gid``; every other id as it is. The guest ids are never 0 (a map
    that made host files root's in the guest would hand the guest user nothing, and hide owners)."""

    host_uids: frozenset[int]
    host_gids: frozenset[int]
    guest_uid: int
    guest_gid: int

    def __post_init__(self):
        if not (0 < self.guest_uid < 0xFFFFFFFF and 0 < self.guest_gid < 0xFFFFFFFF):
            raise ValueError(f"guest ids must be in [1, 2**32-2], not {self.guest_uid}:{self.guest_gid}")

    def uid(self, host_uid: int) -> int:
        return self.guest_uid if host_uid in self.host_uids else host_uid

    def gid(self, host_gid: int) -> int:
        return self.guest_gid if host_gid in self.host_gids else host_gid


def _name_bytes(name: str) -> int:
    return len(name.encode("utf-8", "surrogateescape"))


# ---------------------------------------------------------------------------- modes


def host_mode(mode: int, current: int = 0) -> int:
    """The mode to apply on the host for a guest's ``mode``: the guest's bits, except that a
    set-id bit is kept only if the host object already has it (``current``, 0 for a new one)."""
    mode &= MODE_BITS
    return (mode & ~SETID_BITS) | (mode & current & SETID_BITS)


def privileges_on_write(mode: int) -> int:
    """The set-id bits of a host ``mode`` that a write by someone without ``CAP_FSETID``
    clears (the kernel's ``should_remove_suid``): set-uid always, set-gid when group-executable
    (without it, set-gid grants nothing at exec)."""
    kill = mode & _stat.S_ISUID
    if mode & _stat.S_ISGID and mode & _stat.S_IXGRP:
        kill |= _stat.S_ISGID
    return kill


def mode_mapping(mode: int, current: int = 0) -> bytes | None:
    """The :data:`MODE_XATTR` value to keep for a guest's ``mode`` (None: keep none — the
    host's mode says it all)."""
    mode &= MODE_BITS
    return encode_mode(mode) if host_mode(mode, current) != mode else None


def encode_mode(mode: int) -> bytes:
    """``0o4755`` → ``b"4755"`` (ASCII octal: readable with ``getfattr`` on the host)."""
    return b"%04o" % (mode & MODE_BITS)


def decode_mode(value: bytes | None) -> int | None:
    """The mode in a :data:`MODE_XATTR` value, or None for anything that is not one (absent,
    too long, not octal, beyond 0o7777): a damaged value is ignored, never trusted."""
    if not value or len(value) > MODE_VALUE_BYTES_MAX or not all(0x30 <= c <= 0x37 for c in value):
        return None
    mode = int(value, 8)
    return mode if mode <= MODE_BITS else None


def guest_mode(host: int, value: bytes | None) -> int:
    """The mode the guest is told: the kept one (``value``) while the host mode ``host`` is
    still what it was applied as; the host's own otherwise (a host-side chmod since wins)."""
    kept = decode_mode(value)
    if kept is None or host_mode(kept, host) != host & MODE_BITS:
        return host & MODE_BITS
    return kept


# ---------------------------------------------------------------------------- xattr names


def is_passthrough(name: str) -> bool:
    """True if a guest's xattr ``name`` is stored on the host as it is."""
    return name.startswith(USER_NAMESPACE) and not name.startswith(RESERVED_PREFIX)


def host_xattr_name(name: str) -> str:
    """The host name for a guest's xattr ``name``: itself for ``user.*`` outside the reserved
    prefix, :data:`MAPPED_PREFIX` + ``name`` for everything else. ``ERANGE`` (the kernel's
    errno for an over-long name) if the mapped name exceeds :data:`XATTR_NAME_BYTES_MAX`."""
    if is_passthrough(name):
        return name
    mapped = MAPPED_PREFIX + name
    if _name_bytes(mapped) > XATTR_NAME_BYTES_MAX:
        raise OSError(errno.ERANGE, f"xattr name {name!r} is too long to be kept "
                      f"(at most {XATTR_NAME_BYTES_MAX - _name_bytes(MAPPED_PREFIX)} bytes outside user.*)")
    return mapped


def guest_xattr_name(host_name: str) -> str | None:
    """The name a guest sees for a host xattr, or None if it is not shown: the host's own
    privileged xattrs, the server's reserved names, and any name under :data:`MAPPED_PREFIX`
    that :func:`host_xattr_name` would not have produced."""
    if host_name.startswith(MAPPED_PREFIX):
        name = host_name[len(MAPPED_PREFIX):]
        return None if is_passthrough(name) or not name else name
    return host_name if is_passthrough(host_name) else None


#: guest names whose removal, when absent, succeeds: the kernel treats removing a POSIX
#: ACL as setting none (``cp -a`` relies on it), unlike every other xattr (``ENODATA``)
ACL_XATTRS = ("system.posix_acl_access", "system.posix_acl_default")


def absent_removal_ok(name: str) -> bool:
    """True if removing the guest's xattr ``name`` when it is not there is a success."""
    return name in ACL_XATTRS


def guest_xattr_names(host_names: list[str]) -> list[str]:
    """What a guest's ``listxattr`` shows for the host's list, in the host's order."""
    return [g for g in map(guest_xattr_name, host_names) if g is not None]


# ---------------------------------------------------------------------------- credentials


@dataclass(frozen=True)
class Cred:
    """Who a client request acts as: the guest's uid and gid (the 9P attach's ``n_uname``, a
    creating request's ``gid``). ``None`` in place of a Cred means the API/SDK, acting as the
    folder owner. Only uid 0 has ``CAP_FSETID``/``CAP_CHOWN`` in the guest's view."""

    uid: int
    gid: int
    #: how this client sees host owners (the VM's guest-user map), None: as they are
    view: OwnerMap | None = None

    @property
    def privileged(self) -> bool:
        return self.uid == 0


# ---------------------------------------------------------------------------- owners


def attach_cred(uname: str, n_uname: int, view: "OwnerMap | None" = None) -> Cred:
    """The credentials of a 9P2000.L attach: ``n_uname`` (the guest's fsuid; Linux v9fs attaches
    once per uid with ``access=user``/``client``) — or, when it is :data:`NONUNAME`, 0 for
    ``uname`` "root" and :data:`NOBODY_ID` for any other name. The attach carries no gid: the
    uid stands for it (a creating request brings its own gid)."""
    uid = n_uname if n_uname != NONUNAME else 0 if uname == "root" else NOBODY_ID
    if uid > ID_MAX:
        uid = NOBODY_ID
    return Cred(uid, uid, view)


def encode_owner(uid: int, gid: int) -> bytes:
    """``(65534, 100)`` → ``b"65534:100"`` (ASCII: readable with ``getfattr`` on the host)."""
    return b"%d:%d" % (uid, gid)


def decode_owner(value: bytes | None) -> tuple[int, int] | None:
    """The ``(uid, gid)`` in an :data:`OWNER_XATTR` value, or None for anything that is not
    exactly two decimal ids ≤ :data:`ID_MAX` joined by ``:`` (damaged: ignored, never trusted)."""
    if not value or len(value) > OWNER_VALUE_BYTES_MAX or value.count(b":") != 1:
        return None
    parts = value.split(b":")
    if not all(p and len(p) <= 10 and all(0x30 <= c <= 0x39 for c in p) for p in parts):
        return None
    uid, gid = (int(p) for p in parts)
    return (uid, gid) if uid <= ID_MAX and gid <= ID_MAX else None


def owner_xattr(regular_or_dir: bool) -> str:
    """The host xattr that keeps a guest's owner: :data:`OWNER_XATTR` on a regular file or
    directory, :data:`SPECIAL_OWNER_XATTR` on a symlink, fifo or socket."""
    return OWNER_XATTR if regular_or_dir else SPECIAL_OWNER_XATTR


def mode_xattr(regular_or_dir: bool) -> str:
    """The host xattr that keeps a guest's mode: :data:`MODE_XATTR` on a regular file or
    directory, :data:`SPECIAL_MODE_XATTR` on a fifo or socket."""
    return MODE_XATTR if regular_or_dir else SPECIAL_MODE_XATTR


def presented_owner(uid: int, gid: int, view: "OwnerMap | None") -> tuple[int, int]:
    """What a client sees as the owner of a host file that carries no :data:`OWNER_XATTR`:
    the host's ids, through ``view`` (:class:`OwnerMap`) if the client has one."""
    return (uid, gid) if view is None else (view.uid(uid), view.gid(gid))


def guest_owner(uid: int, gid: int, value: bytes | None, view: "OwnerMap | None" = None) -> tuple[int, int]:
    """The owner a client is told for a host file owned by ``uid:gid`` whose
    :data:`OWNER_XATTR` is ``value``: the kept owner if it is valid, else :func:`presented_owner`."""
    kept = decode_owner(value)
    return kept if kept is not None else presented_owner(uid, gid, view)


def unchanged_id(i: int | None) -> bool:
    """True for an id that chown(2) takes as "leave it": None, -1, or -1 as a u32 on the wire."""
    return i is None or i == -1 or i == NONUNAME


def chowned(current: tuple[int, int], uid: int | None, gid: int | None) -> tuple[int, int]:
    """The owner after ``chown(uid, gid)`` of a file owned by ``current`` (:func:`unchanged_id`: kept)."""
    return (current[0] if unchanged_id(uid) else uid, current[1] if unchanged_id(gid) else gid)


def owner_mapping(owner: tuple[int, int], host_uid: int, host_gid: int, view: "OwnerMap | None" = None) -> bytes | None:
    """The :data:`OWNER_XATTR` value to keep for a guest's ``owner`` of a host file owned by
    ``host_uid:host_gid`` (None: keep none — it is what the client sees anyway)."""
    if owner == presented_owner(host_uid, host_gid, view):
        return None
    if not all(0 <= i <= ID_MAX for i in owner):
        raise OSError(errno.EINVAL, f"invalid owner {owner[0]}:{owner[1]}")
    return encode_owner(*owner)


def privileges_on_chown(mode: int) -> int:
    """The set-id bits a chown of a non-directory clears (Linux's ``chown_common``: set-uid
    always, set-gid when group-executable; whoever chowns, even to the same ids)."""
    return privileges_on_write(mode)
