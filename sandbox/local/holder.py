"""The namespace holder: a private mount namespace where the local guest's FUSE mounts live.

Run by :class:`sandbox.local.guest.LocalGuest` as ``python holder.py SOCKFD [--user]
[--net]`` (standard library only; it runs as a script, importing nothing of the package).
What it makes, once, at start:

* a new **mount namespace** (``unshare(CLONE_NEWNS)``) whose mounts are all made private
  (``MS_REC|MS_PRIVATE`` on ``/``): a FUSE mount made here is never seen by the host's own
  namespace, and nothing mounted on the host later propagates in;
* with ``--user`` (the agent is not root) a new **user namespace** first, mapping the
  caller's uid and gid to themselves, so an unprivileged caller may mount FUSE where the
  kernel allows it (Linux ≥ 4.18; ``/dev/fuse`` must be openable);
* with ``--net`` a new **network namespace** with only the loopback interface (brought up):
  the session's ``network="disabled"``;
* a new **PID namespace**, whose init is the holder's child (``fork`` after
  ``unshare(CLONE_NEWPID)``). Every command the guest runs is entered into it (``nsenter
  --pid``), so when init exits — the session stops, or the agent dies and the parent-death
  signal reaches the holder and then init — the kernel kills every process still in it,
  daemonized ones included;
* a fresh **/proc** of that PID namespace, mounted by init over ``/proc`` in the private
  mount namespace (``nosuid,nodev,noexec``): commands see their own processes (init is pid
  1), not the host's. Best effort: where the kernel refuses it (a user namespace whose
  ``/proc`` has masked parts, as in some containers), the host's ``/proc`` stays and the
  ready message says ``"proc": false``.

The parent stays outside, waits until init has mounted /proc (or failed to), sends
``{"ready": true, "pid": <init's pid>, "proc": bool}`` (the pid in the agent's PID
namespace: what ``nsenter --target`` needs), then waits for init and exits with its status.
Init answers requests on the socket (``SOCK_SEQPACKET``, one JSON object per message):

* ``{"op": "mount", "target": PATH, "read_only": bool, "uid": U, "gid": G}``: open
  ``/dev/fuse``, ``mount(2)`` it at PATH (``fuse.sandbox``, ``nosuid,nodev`` always, ``ro``
  if asked, ``default_permissions,allow_other``); the reply ``{"ok": true}`` carries the
  ``/dev/fuse`` descriptor (``SCM_RIGHTS``) for the server to read; init keeps no copy;
* ``{"op": "umount", "target": PATH}``: ``umount2(PATH, MNT_DETACH)``;
* anything else, or a failure: ``{"ok": false, "errno": E, "error": TEXT}``.

End of file on the socket (the agent closed it, or died) ends init, and with it the
namespace and everything in it. Invariants: init never exits while the socket is open
unless killed; it ignores ``SIGCHLD`` so orphans reparented to it are reaped by the
kernel; it is tied to the parent by ``PR_SET_PDEATHSIG`` (the parent is tied to the agent
by the agent's own spawn).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import struct
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 0x4000, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
FS_TYPE, FS_NAME = b"fuse.sandbox", b"sandbox"
#: one request or reply message (a path is ≤ 4 KiB)
MESSAGE_BYTES_MAX = 16384
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    finally:
        s.close()


def enter(user: bool, net: bool) -> None:
    """The namespaces (module docstring), in this process; init is forked afterwards."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | (CLONE_NEWUSER if user else 0) | (CLONE_NEWNET if net else 0)
    _check(_libc.unshare(flags), "unshare")
    if user:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    _check(_libc.mount(b"none", b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None), "making / private")
    if net:
        _loopback_up()


def mount_proc() -> bool:
    """In init (pid 1 of the new PID namespace, in the private mount namespace): a /proc of
    this PID namespace over the host's. False if the kernel refused it."""
    flags = ctypes.c_ulong(MS_NOSUID | MS_NODEV | MS_NOEXEC)
    return _libc.mount(b"proc", b"/proc", b"proc", flags, None) == 0


def _reply(sock: socket.socket, msg: dict, fd: int | None = None) -> None:
    data = json.dumps(msg).encode()
    if fd is None:
        sock.send(data)
    else:
        socket.send_fds(sock, [data], [fd])


def mount_fuse(target: str, read_only: bool, uid: int, gid: int) -> int:
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        opts = f"fd={fd},rootmode=40000,user_id={uid},group_id={gid},default_permissions,allow_other".encode()
        flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
        _check(_libc.mount(FS_NAME, os.fsencode(target), FS_TYPE, ctypes.c_ulong(flags), opts), f"mount {target}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def serve(sock: socket.socket) -> None:
    """Init's loop: requests until end of file."""
    while True:
        try:
            data = sock.recv(MESSAGE_BYTES_MAX)
        except InterruptedError:
            continue
        if not data:
            return
        fd = None
        try:
            req = json.loads(data)
            op = req.get("op")
            if op == "mount":
                fd = mount_fuse(str(req["target"]), bool(req.get("read_only")), int(req["uid"]), int(req["gid"]))
                _reply(sock, {"ok": True}, fd)
            elif op == "umount":
                if _libc.umount2(os.fsencode(str(req["target"])), MNT_DETACH) != 0:
                    e = ctypes.get_errno()
                    if e not in (errno.EINVAL, errno.ENOENT):  # not mounted (any more)
                        raise OSError(e, f"umount {req['target']}: {os.strerror(e)}")
                _reply(sock, {"ok": True})
            else:
                raise OSError(errno.EINVAL, f"unknown request {op!r}")
        except OSError as e:
            _reply(sock, {"ok": False, "errno": e.errno or errno.EIO, "error": e.strerror or str(e)})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            _reply(sock, {"ok": False, "errno": errno.EINVAL, "error": f"bad request: {e}"})
        finally:
            if fd is not None:
                os.close(fd)


def _parent_gone(alive_r: int) -> bool:
    """True if the parent already exited (its end of the pipe is closed): then no
    parent-death signal will ever come, and init must not run untied."""
    os.set_blocking(alive_r, False)
    try:
        return os.read(alive_r, 1) == b""
    except BlockingIOError:
        return False


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    try:
        enter("--user" in argv, "--net" in argv)
    except OSError as e:
        _reply(sock, {"ready": False, "errno": e.errno, "error": str(e)})
        return 1
    alive_r, alive_w = os.pipe()  # init's view of the parent (getppid() is 0 across the PID namespace)
    proc_r, proc_w = os.pipe()  # init says whether it mounted /proc (b"1"/b"0"; nothing: it died)
    pid = os.fork()
    if pid == 0:  # init of the new PID namespace
        try:
            os.close(alive_w)
            os.close(proc_r)
            if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or _parent_gone(alive_r):
                os._exit(1)
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps orphans
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.write(proc_w, b"1" if mount_proc() else b"0")
            os.close(proc_w)
            serve(sock)
        finally:
            os._exit(0)
    os.close(alive_r)
    os.close(proc_w)
    try:
        proc = os.read(proc_r, 1) == b"1"
    finally:
        os.close(proc_r)
    _reply(sock, {"ready": True, "pid": pid, "proc": proc})
    sock.close()
    while True:
        try:
            _pid, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status) & 0xFF
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
