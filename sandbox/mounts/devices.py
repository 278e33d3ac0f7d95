"""Emulated device nodes: what a guest's ``mknod`` of a character or block device becomes.

A device node is never created on the host (it would be a host privilege: a guest's
``mknod c 8 0`` must not become a raw disk the host user can be tricked into opening).
Instead the server makes a **placeholder**: an empty regular file, its mode without set-id
bits, carrying the host xattr :data:`DEV_XATTR` = ASCII ``b"c 1 3"`` / ``b"b 8 0"``
(type, major, minor) — as QEMU's ``mapped-xattr`` security model does. The rules, as pure
functions (the :class:`~sandbox.mounts.Provider` applies them):

* getattr/lookup of a placeholder report ``S_IFCHR``/``S_IFBLK`` and the ``rdev``
  (:func:`emulated_attr`), size 0, kind ``OTHER``: the guest sees a device;
* it is never opened, read or written (``EPERM``, like every special file), and the xattr
  lies under the reserved prefix, so the guest never sees or sets it;
* a value that is not exactly one this module writes (:func:`decode_dev`) is ignored: the
  file is then what the host says it is, a regular file — a damaged or host-set value
  can never turn a file into something it was not made as;
* undo needs nothing special: a placeholder is a regular file with an xattr, captured and
  restored like every other.

Invariant: ``decode_dev(encode_dev(fmt, rdev)) == (fmt, rdev)`` for every device type and
every ``rdev`` whose major and minor fit in 32 bits.
"""

from __future__ import annotations

import dataclasses
import os
import stat as _stat

from ..hostfs import OTHER, REG, Attr
from .identity import RESERVED_PREFIX

#: the host xattr that makes a regular file an emulated device node
DEV_XATTR = RESERVED_PREFIX + "dev"
#: the device types that are emulated (never made on the host)
DEVICE_FMTS = {_stat.S_IFCHR: b"c", _stat.S_IFBLK: b"b"}
#: longest :data:`DEV_XATTR` value read back (``b"b 4294967295 4294967295"`` is 23); longer is not ours
DEV_VALUE_BYTES_MAX = 32
#: largest major or minor number kept (Linux's dev_t has 32 bits of each)
DEV_NUMBER_MAX = 0xFFFF_FFFF

_TYPES = {v: k for k, v in DEVICE_FMTS.items()}


def is_device(fmt: int) -> bool:
    """True for the file types that are emulated: character and block devices."""
    return fmt in DEVICE_FMTS


def encode_dev(fmt: int, rdev: int) -> bytes:
    """``(S_IFCHR, makedev(1, 3))`` → ``b"c 1 3"`` (readable with ``getfattr`` on the host)."""
    major, minor = os.major(rdev), os.minor(rdev)
    return b"%s %d %d" % (DEVICE_FMTS[fmt], major, minor)


def rdev_of(major: int, minor: int) -> int:
    """``makedev(major, minor)``; ``ValueError`` for a number outside ``[0, 2**32-1]``."""
    if not (0 <= major <= DEV_NUMBER_MAX and 0 <= minor <= DEV_NUMBER_MAX):
        raise ValueError(f"device number {major}:{minor} out of range")
    return os.makedev(major, minor)


def decode_dev(value: bytes | None) -> tuple[int, int] | None:
    """``(fmt, rdev)`` from a :data:`DEV_XATTR` value, or None for anything that is not
    exactly what :func:`encode_dev` writes (absent, too long, another type, not decimal,
    out of range)."""
    if not value or len(value) > DEV_VALUE_BYTES_MAX:
        return None
    parts = value.split(b" ")
    if len(parts) != 3 or parts[0] not in _TYPES:
        return None
    numbers = parts[1:]
    if not all(n.isdigit() and n.isascii() and (n == b"0" or not n.startswith(b"0")) for n in numbers):
        return None
    try:
        return _TYPES[parts[0]], rdev_of(int(numbers[0]), int(numbers[1]))
    except ValueError:
        return None


def emulated_attr(a: Attr, value: bytes | None) -> Attr:
    """``a`` (a regular file's attributes) as the guest sees it: a device of the type and
    ``rdev`` ``value`` names, if it names one; otherwise ``a`` unchanged."""
    dev = decode_dev(value) if a.kind == REG else None
    if dev is None:
        return a
    fmt, rdev = dev
    return dataclasses.replace(a, kind=OTHER, fmt=fmt, rdev=rdev, size=0)
