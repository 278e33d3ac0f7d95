"""Confine the calling process: Landlock (files, TCP, signals) and ``PR_SET_NO_NEW_PRIVS``.

A file server needs its share(s), its undo store, the directory of its socket, and — read
only — what Python needs to keep importing. :func:`confine` takes exactly that list and
asks the kernel to refuse everything else, for this process and every child it starts:
an ``open`` of any other path fails with EACCES, whatever bug or request led to it.

The Landlock syscalls are called through ctypes (no binding is needed: three syscalls and
two packed structs, ``linux/landlock.h``). The ABI version is probed first; only the
access rights that ABI knows are handled (ABI 1: files; 2: ``REFER``, renames between
directories; 3: ``TRUNCATE``; 4: TCP bind/connect; 5: device ioctls; 6: abstract unix
sockets and signals scoped to the domain). Without Landlock (kernel < 5.13, disabled, not
Linux) confinement is logged and skipped: :func:`confine` reports what it did.

Invariants: ``no_new_privs`` is set before ``landlock_restrict_self`` (the kernel requires
it of an unprivileged caller) and whether or not Landlock exists; confinement is
irreversible and applies to the calling **thread** and its future children and threads
only — so :func:`confine` refuses (:class:`ConfineError`) while other threads run, which
would stay unconfined; a path that does not exist is skipped, never created; a failure
after the ruleset is built closes its descriptor.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
import threading
from dataclasses import dataclass, field

log = logging.getLogger("sandbox.confine")

# linux/landlock.h (x86_64 / aarch64 / every arch with the generic syscall table share these numbers)
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
LANDLOCK_RULE_PATH_BENEATH = 1
LANDLOCK_RULE_NET_PORT = 2
PR_SET_NO_NEW_PRIVS = 38

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1

#: every file right each ABI handles (a newer ABI adds rights; an older kernel rejects unknown bits)
_FS_ABI1 = (1 << 13) - 1
FS_RIGHTS_BY_ABI = {1: _FS_ABI1, 2: _FS_ABI1 | FS_REFER, 3: _FS_ABI1 | FS_REFER | FS_TRUNCATE,
                    4: _FS_ABI1 | FS_REFER | FS_TRUNCATE,
                    5: _FS_ABI1 | FS_REFER | FS_TRUNCATE | FS_IOCTL_DEV}
ABI_KNOWN_MAX = 7  # ABI 7 (Linux 6.15) adds audit flags only

READ_ONLY = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
READ_WRITE = (FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_READ_DIR | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_DIR
              | FS_MAKE_REG | FS_MAKE_SOCK | FS_MAKE_FIFO | FS_MAKE_SYM | FS_REFER | FS_TRUNCATE)
#: a socket's directory: create the socket, remove it when done — nothing else there
SOCKET_DIR = FS_MAKE_SOCK | FS_REMOVE_FILE
DEVICES = ("/dev/null", "/dev/urandom", "/dev/random")  # read/write files Python and the core may open


class ConfineError(RuntimeError):
    """Confinement was asked for and cannot be applied as asked (nothing was applied)."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPortAttr(ctypes.Structure):
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
    _prctl = _libc.prctl
    _prctl.restype = ctypes.c_int
except (OSError, AttributeError):
    _libc = _syscall = _prctl = None


def _call(*args) -> int:
    ctypes.set_errno(0)
    r = _syscall(*args)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when there is no usable Landlock (the reason is logged)."""
    if _syscall is None or not sys.platform.startswith("linux"):
        return 0
    try:
        return _call(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                     ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.EOPNOTSUPP):  # not built in, or disabled at boot
            return 0
        raise


def set_no_new_privs() -> None:
    """``PR_SET_NO_NEW_PRIVS``: no exec from here on can gain privileges (set-id, file caps)."""
    if _prctl is None:
        return
    if _prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(e)}")


@dataclass
class Confinement:
    """What :func:`confine` applied: ``abi`` 0 means Landlock was skipped (``reason`` says why)."""

    abi: int
    no_new_privs: bool
    reason: str = ""
    rules: list[tuple[str, int]] = field(default_factory=list)  # (path, allowed rights) actually added

    @property
    def landlocked(self) -> bool:
        return self.abi > 0


def python_read_paths() -> list[str]:
    """What this Python needs to go on importing (read/execute only): its prefixes, every
    ``sys.path`` entry that exists, the shared libraries' usual places."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable),
             os.path.realpath(sys.executable)]
    paths += [p for p in sys.path if p]
    paths += ["/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/share/zoneinfo", "/etc/localtime", "/etc/ld.so.cache",
              "/proc/self", "/proc/thread-self", "/sys/devices/system/cpu"]
    return paths


def confine(*, read_write: list[str], read_only: list[str] = (), socket_dirs: list[str] = (),
            tcp_bind_ports: list[int] | None = None, python: bool = True) -> Confinement:
    """Confine this process for good: afterwards it may read and write beneath ``read_write``,
    read beneath ``read_only`` (plus :func:`python_read_paths` when ``python``), create and
    remove sockets in ``socket_dirs``; bind TCP only to ``tcp_bind_ports`` (None: TCP bind not
    restricted; the server never connects out, so TCP connect is refused), send no signal and
    reach no abstract unix socket outside its own domain (ABI ≥ 6).

    ``no_new_privs`` is always set. Without Landlock the rest is logged and skipped.
    Raises :class:`ConfineError` (nothing applied) while other threads run, or when a path in
    ``read_write`` is missing."""
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        raise ConfineError(f"confinement applies to one thread only; other threads would stay unconfined: {others}")
    for p in read_write:
        if not os.path.exists(p):
            raise ConfineError(f"cannot confine to {p!r}: it does not exist")
    set_no_new_privs()
    abi = landlock_abi()
    if abi == 0:
        log.warning("Landlock is not available on this kernel: the process is not confined to its files "
                    "(no_new_privs is set)")
        return Confinement(0, True, reason="Landlock is not available (kernel < 5.13, or disabled)")
    handled_fs = FS_RIGHTS_BY_ABI[min(abi, 5)]
    attr = _RulesetAttr(handled_access_fs=handled_fs)
    size = ctypes.sizeof(ctypes.c_uint64)
    if abi >= 4:
        attr.handled_access_net = NET_CONNECT_TCP | (NET_BIND_TCP if tcp_bind_ports is not None else 0)
        size = 2 * ctypes.sizeof(ctypes.c_uint64)
    if abi >= 6:
        attr.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
        size = ctypes.sizeof(_RulesetAttr)
    ruleset = _call(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size),
                    ctypes.c_uint32(0))
    applied = Confinement(abi, True)
    try:
        wanted = [(p, READ_WRITE) for p in read_write] + [(p, READ_ONLY) for p in read_only]
        wanted += [(p, SOCKET_DIR) for p in socket_dirs]
        if python:
            wanted += [(p, READ_ONLY) for p in python_read_paths()]
            wanted += [(p, FS_READ_FILE | FS_WRITE_FILE) for p in DEVICES]
        for path, rights in wanted:
            _add_path_rule(ruleset, path, rights & handled_fs, applied)
        if abi >= 4 and tcp_bind_ports is not None:
            for port in tcp_bind_ports:
                rule = _NetPortAttr(allowed_access=NET_BIND_TCP, port=port)
                _call(ctypes.c_long(SYS_LANDLOCK_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_NET_PORT),
                      ctypes.byref(rule), ctypes.c_uint32(0))
        _call(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    log.info("confined (Landlock ABI %d, no_new_privs): read-write %s; read-only %s; sockets in %s", abi,
             read_write, list(read_only), list(socket_dirs))
    return applied


def _add_path_rule(ruleset: int, path: str, rights: int, applied: Confinement) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # missing (or unreachable): nothing to allow there
    try:
        if not os.path.isdir(path):
            # a file may only be given file rights (EINVAL otherwise)
            rights &= FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
        if not rights:
            return
        rule = _PathBeneathAttr(allowed_access=rights, parent_fd=fd)
        _call(ctypes.c_long(SYS_LANDLOCK_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
              ctypes.byref(rule), ctypes.c_uint32(0))
        applied.rules.append((path, rights))
    finally:
        os.close(fd)
