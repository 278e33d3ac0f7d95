#!/usr/bin/env python3
"""The VM-side shim (design §4.2): runs shell commands for the host over JSON Lines.

Runs inside the guest as root, stdlib only, one file. Commands run as the guest user
(``--user UID:GID``, issue 13) unless that is omitted (``--as-root`` sessions). It reads and writes the control
channel — the virtio-serial port ``/dev/virtio-ports/control`` (``--port``) or an
inherited, connected fd (``--fd``, used by tests) — one JSON object per line, UTF-8.

The messages, their fields and the limits are defined once in ``control.py`` (beside
this file, stdlib only, shared with the host): ``exec``/``cancel``/``rollback_notify``/
``ping``/``mount``/``unmount`` in, ``ready``/``step_started``/``output``/``step_completed``/
``rollback_noted``/``pong``/``error``/``mounted``/``mount_failed``/``unmounted``/
``unmount_failed`` out.

Invariants:

* Every ``exec`` accepted with a valid id yields exactly one ``step_started``, then its
  ``output`` messages in pipe order per stream, then exactly one ``step_completed`` —
  queued only once the process has been reaped AND both its pipes reached EOF, so no
  output of it follows. A spawn failure still yields the pair (stderr reason, code 127).
* Input never stops the shim: every rejected line yields one ``error`` and the loop
  goes on; an oversized line is discarded up to its newline and reported once.
* One thread, one ``selectors`` loop (control fd, child pipes, a signal wake-up pipe
  for SIGCHLD/SIGTERM); every message is a whole line appended to one out-queue, so
  lines never interleave and no lock is needed. No sleeps: the loop only waits in
  ``select`` with a timeout set by the nearest deadline (SIGKILL, reconnect, exit).
* Limits: ``COMMANDS_RUNNING_MAX`` commands, ``READ_CHUNK_BYTES_MAX`` per read (so
  per ``output`` chunk), ``--line-max-bytes`` per input line. The out-queue is bounded
  by backpressure: at ``OUT_QUEUE_BYTES_MAX`` the loop stops reading child pipes and
  the control fd (and stops handling buffered input lines) until the host drains it,
  so the input buffer never exceeds one line plus one read chunk.
* A command runs in its own session (setsid), so its process group is its pid;
  ``cancel`` signals the whole group: SIGTERM, then SIGKILL after ``--kill-grace-s``
  if the step has not completed.
* A ``mount``/``unmount`` with a valid id gets exactly one reply (``mounted`` or
  ``mount_failed``, ``unmounted`` or ``unmount_failed``). The syscall runs in a forked
  child (it may wait on the 9P server); the child's exit status is the errno; it is
  reaped on SIGCHLD and SIGKILLed after ``MOUNT_TIMEOUT_S``; at most
  ``MOUNT_OPS_RUNNING_MAX`` run at once.
* The guest user (``--user``): every command runs with exactly that uid and gid, no
  supplementary groups, no capabilities, ``no_new_privs`` set (a set-uid ``sudo``/``su``
  cannot raise it), ``HOME``/``USER``/``LOGNAME`` naming it. The shim stays root: the user
  can neither signal nor ptrace it, and inherits none of its descriptors (all CLOEXEC).
* End of input: on ``--fd`` the host is gone — cancel everything, exit 0 once the
  commands are gone (SIGKILL at the grace, exit at most ``EXIT_GRACE_S`` later). On
  ``--port`` EOF (or EIO) means the host is not connected: close, reopen every
  ``RECONNECT_INTERVAL_S`` and announce ``ready`` first on each (re)open; queued
  messages are kept, except the unsent rest of a half-written line.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import ctypes
import errno
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

if __package__:  # imported from the package (sandbox.guest.shim)
    from . import control as proto
else:  # run as a script: control.py is beside this file (in the guest: /run/sandbox/)
    import control as proto

PROTOCOL_VERSION = proto.PROTOCOL_VERSION
DEFAULT_PORT = proto.DEFAULT_PORT
READ_CHUNK_BYTES_MAX = proto.READ_CHUNK_BYTES_MAX
COMMANDS_RUNNING_MAX = proto.COMMANDS_RUNNING_MAX
OUT_QUEUE_BYTES_MAX = proto.OUT_QUEUE_BYTES_MAX
EXIT_GRACE_S = 2.0
RECONNECT_INTERVAL_S = 0.25
SPAWN_FAILED_EXIT_CODE = proto.SPAWN_FAILED_EXIT_CODE
MS_RDONLY = 1
PR_SET_NO_NEW_PRIVS = 38
GUEST_USER_NAME = "agent"
GUEST_HOME_DEFAULT = "/home/agent"
ID_MAX = 0xFFFFFFFE  # (uid_t)-1 means "unchanged" to the kernel: never a user

_Utf8Decoder = codecs.getincrementaldecoder("utf-8")
_clip = proto.clip
_encode = proto.encode
_describe = proto.describe
_valid_id = proto.valid_id


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class UndoEvents:
    """The undo-notification file (docs/vm.md "Undo notifications in the guest").

    Invariants: the directory is made 0755 and the file 0644, both by the shim (root), so
    the agent user can read but never write or replace them; one ``append`` writes one
    whole JSON line with one ``write`` (O_APPEND), so a reader sees whole lines; a line that
    would take the file past ``UNDO_EVENTS_BYTES_MAX`` first renames it to ``<path>.1``
    (replacing the older one), so the pair never holds more than twice that. Symlinks are
    not followed. Failures are reported on stderr and never stop the shim.
    """

    def __init__(self, path: str, bytes_max: int = proto.UNDO_EVENTS_BYTES_MAX) -> None:
        self.path = path
        self.bytes_max = bytes_max

    def prepare(self) -> None:
        """Make the directory and an empty file, so tools can open it before any undo."""
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
            self._open().close()
        except OSError as exc:
            print(f"shim: undo events file {self.path}: {exc}", file=sys.stderr)

    def _open(self):
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        os.fchmod(fd, 0o644)  # whatever the umask
        return os.fdopen(fd, "ab", buffering=0)

    def append(self, event: dict) -> None:
        line = _encode(event)
        try:
            try:
                size = os.lstat(self.path).st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(line) > self.bytes_max:
                os.replace(self.path, self.path + ".1")
            with self._open() as f:
                f.write(line)
        except OSError as exc:
            print(f"shim: undo events file {self.path}: {exc}", file=sys.stderr)


class _Command:
    """One exec between spawn and ``step_completed``.

    Invariant: ``pipes`` maps exactly the stream fds not yet at EOF; the command is
    complete when ``pipes`` is empty and ``proc.returncode`` is set.
    """

    __slots__ = ("decoders", "id", "kill_at", "pipes", "proc")

    def __init__(self, cid: int, proc: subprocess.Popen) -> None:
        self.id = cid
        self.proc = proc
        self.pipes = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        self.decoders = {"stdout": _Utf8Decoder(errors="replace"), "stderr": _Utf8Decoder(errors="replace")}
        self.kill_at: float | None = None  # SIGKILL deadline once cancelled; None after it fired


class _MountOp:
    """One ``mount``/``unmount`` running in a forked child (the syscall can block on the
    9P server for as long as it likes; the loop must not). The child's exit status is the
    errno (0: done); it is SIGKILLed at ``kill_at``."""

    __slots__ = ("id", "kill_at", "kind", "pid", "target", "timed_out")

    def __init__(self, op_id: int, kind: str, target: str, pid: int) -> None:
        self.id = op_id
        self.kind = kind  # "mount" | "unmount"
        self.target = target
        self.pid = pid
        self.kill_at: float | None = time.monotonic() + proto.MOUNT_TIMEOUT_S
        self.timed_out = False


_libc: Any = None


def _libc_calls() -> Any:
    """libc's mount/umount2 with argtypes set (loaded once, in the shim, before any fork)."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _libc = libc
    return _libc


def _mount_9p(req: dict) -> int:
    """In the child: make the mount point's missing directories, mount; the errno or 0.
    With a ``tag`` (issue 17) the share is the virtio-fs device the host hot-plugged: the
    mount is retried while the kernel has not yet probed it (``EINVAL``/``ENODEV``/``ENOENT``),
    at most :data:`~sandbox.guest.control.VIRTIOFS_APPEAR_S`."""
    try:
        os.makedirs(req["target"], mode=0o755, exist_ok=True)
    except OSError as exc:
        return exc.errno or errno.EIO
    if req.get("tag"):
        deadline = time.monotonic() + proto.VIRTIOFS_APPEAR_S
        while True:
            rc = _libc_calls().mount(req["tag"].encode(), req["target"].encode(), b"virtiofs",
                                     MS_RDONLY if req["read_only"] else 0, None)
            err = 0 if rc == 0 else (ctypes.get_errno() or errno.EIO)
            if err == 0:
                _set_read_ahead(req["target"])
            if err not in (errno.EINVAL, errno.ENODEV, errno.ENOENT) or time.monotonic() >= deadline:
                return err
            time.sleep(proto.VIRTIOFS_RETRY_S)
    data = proto.ninep_mount_options(req["port"], req["aname"], req["msize"])
    rc = _libc_calls().mount(proto.NINEP_ADDR.encode(), req["target"].encode(), b"9p",
                             MS_RDONLY if req["read_only"] else 0, data.encode())
    return 0 if rc == 0 else (ctypes.get_errno() or errno.EIO)


def _set_read_ahead(target: str) -> None:
    """A virtio-fs mount's readahead: :data:`~sandbox.guest.control.VIRTIOFS_READ_AHEAD_KB`
    (best effort: where it cannot be set the kernel's default stays; the mount works)."""
    try:
        with open(proto.bdi_read_ahead_path(os.stat(target).st_dev), "w") as f:
            f.write(f"{proto.VIRTIOFS_READ_AHEAD_KB}\n")
    except OSError as exc:
        print(f"shim: cannot set the readahead of {target}: {exc}", file=sys.stderr)


def _unmount(req: dict) -> int:
    rc = _libc_calls().umount2(req["target"].encode(), 0)
    return 0 if rc == 0 else (ctypes.get_errno() or errno.EIO)


class GuestUser:
    """Who commands run as: ``uid``/``gid`` (never 0) and ``home``."""

    __slots__ = ("gid", "home", "uid")

    def __init__(self, uid: int, gid: int, home: str) -> None:
        assert 0 < uid <= ID_MAX and 0 < gid <= ID_MAX
        self.uid, self.gid, self.home = uid, gid, home

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": GUEST_USER_NAME, "LOGNAME": GUEST_USER_NAME}

    def popen_kwargs(self) -> dict[str, Any]:
        """Popen's credential switch: groups, then gid, then uid (all before exec, in the child),
        then ``no_new_privs`` (``preexec_fn`` runs after the switch)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": [], "preexec_fn": _no_new_privs}


def _no_new_privs() -> None:
    """In the child, before exec: set-uid/set-gid bits and file capabilities stop working."""
    if _libc_calls().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


class Shim:
    """The loop: exactly one of ``port`` (a path) and ``fd`` (inherited) names the host link."""

    def __init__(
        self, *, port: str | None, fd: int | None, shell: str, kill_grace_s: float, line_max_bytes: int,
        user: GuestUser | None = None, undo_events: str | None = None,
    ) -> None:
        assert (port is None) != (fd is None)
        self._undo_events = UndoEvents(undo_events) if undo_events else None
        if self._undo_events is not None:
            self._undo_events.prepare()
        self._port = port
        self._fd: int | None = None
        self._inherited_fd = fd
        self._shell = shell
        self._kill_grace_s = kill_grace_s
        self._line_max_bytes = line_max_bytes
        self._user = user
        if user is not None:
            _libc_calls()  # loaded before any fork: the child only calls it
        self._sel = selectors.DefaultSelector()
        self._control_events = 0
        self._inbuf = bytearray()
        self._discarding = False  # inside an oversized line, dropping bytes up to "\n"
        self._out: collections.deque[bytes] = collections.deque()
        self._out_bytes = 0
        self._out_offset = 0  # bytes of _out[0] already written
        self._ready_line = _encode({"type": "ready", "version": PROTOCOL_VERSION, "pid": os.getpid()})
        self._commands: dict[int, _Command] = {}
        self._mount_ops: dict[int, _MountOp] = {}  # by child pid
        self._pipes_registered: set[int] = set()
        self._reconnect_at: float | None = None
        self._exit_at: float | None = None  # set once shutting down
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    # ---------------------------------------------------------------- main loop

    def run(self) -> int:
        """Serve until the host is gone (``--fd``) or SIGTERM/SIGINT; then return 0."""
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda _signum, _frame: None)  # the wake-up fd carries the number
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        if self._inherited_fd is not None:
            os.set_inheritable(self._inherited_fd, False)
            self._attach(self._inherited_fd)
        else:
            self._reopen()
        while self._exit_at is None or (self._commands and time.monotonic() < self._exit_at):
            now = time.monotonic()
            self._fire_deadlines(now)
            self._process_lines()
            self._update_interest()
            for key, events in self._sel.select(self._timeout(now)):
                if key.data == "wake":
                    self._on_wake()
                elif key.data == "control":
                    self._on_control(key.fd, events)
                else:
                    self._on_pipe(key.fd, *key.data)
        for cmd in self._commands.values():
            _killpg(cmd.proc.pid, signal.SIGKILL)
        for op in self._mount_ops.values():
            _kill(op.pid, signal.SIGKILL)
        return 0

    def _timeout(self, now: float) -> float | None:
        deadlines = [c.kill_at for c in self._commands.values() if c.kill_at is not None]
        deadlines += [op.kill_at for op in self._mount_ops.values() if op.kill_at is not None]
        deadlines += [t for t in (self._reconnect_at, self._exit_at) if t is not None]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _fire_deadlines(self, now: float) -> None:
        for cmd in self._commands.values():
            if cmd.kill_at is not None and now >= cmd.kill_at:
                cmd.kill_at = None
                _killpg(cmd.proc.pid, signal.SIGKILL)
        for op in self._mount_ops.values():
            if op.kill_at is not None and now >= op.kill_at:
                op.kill_at = None
                op.timed_out = True
                _kill(op.pid, signal.SIGKILL)
        if self._reconnect_at is not None and now >= self._reconnect_at:
            self._reconnect_at = None
            self._reopen()

    def _paused(self) -> bool:
        return self._out_bytes >= OUT_QUEUE_BYTES_MAX

    def _update_interest(self) -> None:
        """Register what the loop may wait on now: backpressure pauses pipes and reads."""
        paused = self._paused()
        want = 0
        if self._fd is not None:
            want = (0 if paused else selectors.EVENT_READ) | (selectors.EVENT_WRITE if self._out else 0)
        if want != self._control_events:
            if self._control_events and want:
                self._sel.modify(self._fd, want, "control")
            elif want:
                self._sel.register(self._fd, want, "control")
            else:
                self._sel.unregister(self._fd)
            self._control_events = want
        for cmd in self._commands.values():
            for fd, stream in cmd.pipes.items():
                if paused and fd in self._pipes_registered:
                    self._sel.unregister(fd)
                    self._pipes_registered.discard(fd)
                elif not paused and fd not in self._pipes_registered:
                    self._sel.register(fd, selectors.EVENT_READ, (cmd, stream))
                    self._pipes_registered.add(fd)

    # ---------------------------------------------------------------- control channel

    def _attach(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd = fd
        self._inbuf.clear()
        self._discarding = False
        if self._out_offset:  # the rest of a half-written line would corrupt the new stream
            self._out_bytes -= len(self._out.popleft())
            self._out_offset = 0
        stale = [line for line in self._out if line == self._ready_line]
        self._out = collections.deque(line for line in self._out if line != self._ready_line)
        self._out_bytes -= sum(map(len, stale))
        self._out.appendleft(self._ready_line)
        self._out_bytes += len(self._ready_line)

    def _reopen(self) -> None:
        try:
            fd = os.open(self._port, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            self._reconnect_at = time.monotonic() + RECONNECT_INTERVAL_S
            return
        self._attach(fd)

    def _detach(self) -> None:
        if self._control_events:
            self._sel.unregister(self._fd)
            self._control_events = 0
        os.close(self._fd)
        self._fd = None

    def _lost(self) -> None:
        """The host is gone (``--fd``: shut down) or not connected (``--port``: retry)."""
        self._detach()
        if self._port is None:
            self._shutdown()
        else:
            self._reconnect_at = time.monotonic() + RECONNECT_INTERVAL_S

    def _on_control(self, fd: int, events: int) -> None:
        if fd != self._fd:
            return
        if events & selectors.EVENT_WRITE:
            self._flush()
        if self._fd is None or not events & selectors.EVENT_READ or self._paused():
            return
        try:
            data = os.read(self._fd, READ_CHUNK_BYTES_MAX)
        except BlockingIOError:
            return
        except OSError:  # EIO: a port whose host side hung up
            data = b""
        if not data:
            self._lost()
            return
        self._feed(data)

    def _flush(self) -> None:
        while self._out and self._fd is not None:
            head = self._out[0]
            try:
                n = os.write(self._fd, memoryview(head)[self._out_offset :])
            except BlockingIOError:
                return
            except OSError:
                self._lost()
                return
            self._out_offset += n
            if self._out_offset == len(head):
                self._out.popleft()
                self._out_bytes -= len(head)
                self._out_offset = 0

    def _send(self, obj: dict) -> None:
        self._send_line(_encode(obj))

    def _send_line(self, line: bytes) -> None:
        if self._exit_at is not None:
            return  # shutting down: nobody to tell
        self._out.append(line)
        self._out_bytes += len(line)

    def _error(self, cid: Any, message: str) -> None:
        self._send({"type": "error", "id": cid if _valid_id(cid) else None, "message": _clip(message)})

    # ---------------------------------------------------------------- input

    def _feed(self, data: bytes) -> None:
        if self._discarding:
            newline = data.find(b"\n")
            if newline < 0:
                return
            data = data[newline + 1 :]
            self._discarding = False
        self._inbuf += data

    def _process_lines(self) -> None:
        """Handle buffered complete lines while the out-queue has room."""
        while not self._paused() and self._fd is not None:
            newline = self._inbuf.find(b"\n")
            if newline < 0:
                if len(self._inbuf) > self._line_max_bytes:
                    self._inbuf.clear()
                    self._discarding = True
                    self._error(None, f"line longer than {self._line_max_bytes} bytes: discarded")
                return
            line = bytes(self._inbuf[:newline])
            del self._inbuf[: newline + 1]
            if len(line) > self._line_max_bytes:
                self._error(None, f"line longer than {self._line_max_bytes} bytes: discarded")
                continue
            try:
                self._handle_line(line)
            except Exception as exc:  # noqa: BLE001 — never die of input; a bug is reported, not fatal
                self._error(None, f"internal error: {type(exc).__name__}: {exc}")

    def _handle_line(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            msg = proto.decode(line, self._line_max_bytes)
        except proto.ProtocolError as exc:
            self._error(None, str(exc))
            return
        kind = msg.get("type")
        handler = {
            "exec": self._on_exec,
            "cancel": self._on_cancel,
            "rollback_notify": self._on_rollback_notify,
            "ping": self._on_ping,
            "mount": self._on_mount,
            "unmount": self._on_unmount,
        }.get(kind) if isinstance(kind, str) else None
        if handler is None:
            self._error(msg.get("id"), f"unknown message type: {_describe(kind)}")
            return
        handler(msg)

    def _on_exec(self, msg: dict) -> None:
        cid = msg.get("id")
        if not _valid_id(cid):
            self._error(None, "exec: id must be an integer in the i64 range")
            return
        command, env, cwd = msg.get("command"), msg.get("env"), msg.get("cwd")
        if not isinstance(command, str) or "\0" in command:
            self._error(cid, "exec: command must be a string without NUL")
            return
        if env is None:
            env = {}
        if not isinstance(env, dict) or not all(
            isinstance(v, str) and "\0" not in v and k and "=" not in k and "\0" not in k for k, v in env.items()
        ):
            self._error(cid, "exec: env must map names (non-empty, no '=' or NUL) to strings")
            return
        if cwd is None:
            cwd = "/"
        if not isinstance(cwd, str) or not cwd or "\0" in cwd:
            self._error(cid, "exec: cwd must be a non-empty string without NUL")
            return
        if cid in self._commands:
            self._error(cid, f"exec: id {cid} is already running")
            return
        if len(self._commands) >= COMMANDS_RUNNING_MAX:
            self._error(cid, f"exec: {COMMANDS_RUNNING_MAX} commands already running")
            return
        user = self._user
        try:
            proc = subprocess.Popen(
                [self._shell, "-c", command],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env={**os.environ, **(user.env() if user else {}), **self._undo_env(), **env},
                start_new_session=True,
                close_fds=True,
                **(user.popen_kwargs() if user else {}),
            )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            self._send({"type": "step_started", "id": cid})
            reason = f"shim: cannot start command: {_clip(str(exc))}\n"
            self._send({"type": "output", "id": cid, "stream": "stderr", "data": reason})
            self._send({"type": "step_completed", "id": cid, "exit_code": SPAWN_FAILED_EXIT_CODE})
            return
        cmd = _Command(cid, proc)
        for fd in cmd.pipes:
            os.set_blocking(fd, False)
        self._commands[cid] = cmd
        self._send({"type": "step_started", "id": cid})

    def _on_cancel(self, msg: dict) -> None:
        cid = msg.get("id")
        cmd = self._commands.get(cid) if _valid_id(cid) else None
        if cmd is None:
            self._error(cid, f"cancel: no running command with id {_describe(cid)}")
            return
        self._cancel(cmd)

    def _cancel(self, cmd: _Command) -> None:
        if cmd.kill_at is None:  # first cancel; a repeat keeps the original deadline
            _killpg(cmd.proc.pid, signal.SIGTERM)
            cmd.kill_at = time.monotonic() + self._kill_grace_s

    def _undo_env(self) -> dict[str, str]:
        return {proto.UNDO_EVENTS_ENV: self._undo_events.path} if self._undo_events is not None else {}

    def _on_rollback_notify(self, msg: dict) -> None:
        try:
            n = proto.parse_rollback_notify(msg)
        except proto.ProtocolError as exc:
            self._error(None, str(exc))
            return
        if self._undo_events is not None:
            folder = n["folder"]

            def where(rel: str) -> str:
                return rel if folder is None else folder if rel == "." else folder + "/" + rel

            self._undo_events.append({
                "step_ids": n["step_ids"], "folder": folder, "time_ns": time.time_ns(),
                "paths": [{"path": where(p["path"]), "change": p["change"]} for p in n["paths"]],
                "paths_truncated": n["paths_truncated"]})
        self._send({"type": "rollback_noted", "step_id": n["step_id"]})

    def _on_ping(self, msg: dict) -> None:
        try:
            line = _encode({"type": "pong", "id": msg.get("id")})
        except (ValueError, RecursionError):
            self._error(None, "ping: id cannot be echoed")
            return
        self._send_line(line)

    # ---------------------------------------------------------------- live mounts

    def _on_mount(self, msg: dict) -> None:
        self._start_mount_op(msg, "mount", proto.parse_mount, _mount_9p)

    def _on_unmount(self, msg: dict) -> None:
        self._start_mount_op(msg, "unmount", proto.parse_unmount, _unmount)

    def _start_mount_op(self, msg: dict, kind: str, parse, work) -> None:
        """Check, then fork the child that does the syscall; its reply comes at reaping."""
        op_id = msg.get("id")
        if not _valid_id(op_id):
            self._error(None, f"{kind}: id must be an integer in the i64 range")
            return
        target = msg.get("target")
        shown = target if isinstance(target, str) else None
        try:
            req = parse(msg)
        except proto.ProtocolError as exc:
            self._mount_reply(kind, op_id, shown, str(exc))
            return
        if len(self._mount_ops) >= proto.MOUNT_OPS_RUNNING_MAX:
            self._mount_reply(kind, op_id, shown, f"{kind}: {proto.MOUNT_OPS_RUNNING_MAX} mount operations "
                                                  "already running")
            return
        try:
            _libc_calls()
            pid = os.fork()
        except OSError as exc:
            self._mount_reply(kind, op_id, shown, f"{kind}: cannot fork: {exc}")
            return
        if pid == 0:  # the child: the syscall, then the errno as exit status
            code = 255
            try:
                signal.set_wakeup_fd(-1)
                code = work(req)
            finally:
                os._exit(code)
        self._mount_ops[pid] = _MountOp(op_id, kind, req["target"], pid)

    def _mount_reply(self, kind: str, op_id: int, target: str | None, failure: str | None) -> None:
        if failure is None:
            self._send({"type": "mounted" if kind == "mount" else "unmounted", "id": op_id, "target": target})
        else:
            self._send({"type": f"{kind}_failed", "id": op_id, "target": target, "message": _clip(failure)})

    def _reap_mount_ops(self) -> None:
        for pid, op in list(self._mount_ops.items()):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 255 << 8
            if done == 0:
                continue
            del self._mount_ops[pid]
            code = os.waitstatus_to_exitcode(status)
            if code == 0:
                self._mount_reply(op.kind, op.id, op.target, None)
            elif op.timed_out:
                self._mount_reply(op.kind, op.id, op.target,
                                  f"{op.kind} {op.target}: no answer within {proto.MOUNT_TIMEOUT_S:.0f} s")
            elif 0 < code < 255:
                self._mount_reply(op.kind, op.id, op.target, f"{op.kind} {op.target}: {os.strerror(code)}")
            else:
                self._mount_reply(op.kind, op.id, op.target, f"{op.kind} {op.target}: the helper failed ({code})")

    # ---------------------------------------------------------------- children

    def _on_pipe(self, fd: int, cmd: _Command, stream: str) -> None:
        if cmd.pipes.get(fd) != stream:
            return  # closed earlier in this batch; the number may belong to a new pipe
        try:
            data = os.read(fd, READ_CHUNK_BYTES_MAX)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        decoder = cmd.decoders[stream]
        text = decoder.decode(data, final=not data)
        if text:
            self._send({"type": "output", "id": cmd.id, "stream": stream, "data": text})
        if not data:
            del cmd.pipes[fd]
            if fd in self._pipes_registered:
                self._sel.unregister(fd)
                self._pipes_registered.discard(fd)
            getattr(cmd.proc, stream).close()
            cmd.proc.poll()
            self._maybe_complete(cmd)

    def _maybe_complete(self, cmd: _Command) -> None:
        code = cmd.proc.returncode
        if cmd.pipes or code is None:
            return
        del self._commands[cmd.id]
        msg: dict[str, Any] = {"type": "step_completed", "id": cmd.id, "exit_code": code}
        if code < 0:
            msg.update(exit_code=128 - code, signal=-code)
        self._send(msg)

    def _on_wake(self) -> None:
        signums = bytearray()
        while True:
            try:
                chunk = os.read(self._wake_r, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            signums += chunk
        if signal.SIGTERM in signums or signal.SIGINT in signums:
            self._shutdown()
        self._reap_mount_ops()
        for cmd in list(self._commands.values()):
            if cmd.proc.returncode is None:
                cmd.proc.poll()
            self._maybe_complete(cmd)

    def _shutdown(self) -> None:
        """Stop talking to the host, cancel every command, exit once they are gone."""
        if self._exit_at is not None:
            return
        self._exit_at = time.monotonic() + self._kill_grace_s + EXIT_GRACE_S
        self._reconnect_at = None
        self._out.clear()
        self._out_bytes = self._out_offset = 0
        if self._fd is not None:
            self._detach()
        for cmd in self._commands.values():
            self._cancel(cmd)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    def grace(text: str) -> float:
        value = float(text)
        if not 0.0 <= value <= proto.KILL_GRACE_S_MAX:
            raise argparse.ArgumentTypeError(f"must be within [0, {proto.KILL_GRACE_S_MAX}]")
        return value

    def line_max(text: str) -> int:
        value = int(text)
        if not proto.LINE_MAX_BYTES_MIN <= value <= proto.LINE_MAX_BYTES_MAX:
            raise argparse.ArgumentTypeError(f"must be within [{proto.LINE_MAX_BYTES_MIN}, {proto.LINE_MAX_BYTES_MAX}]")
        return value

    def fd_number(text: str) -> int:
        value = int(text)
        if value < 0:
            raise argparse.ArgumentTypeError("must be >= 0")
        return value

    def ids(text: str) -> tuple[int, int]:
        uid, sep, gid = text.partition(":")
        try:
            pair = (int(uid), int(gid))
        except ValueError:
            pair = None
        if not sep or pair is None or not all(0 < n <= ID_MAX for n in pair):
            raise argparse.ArgumentTypeError(f"UID:GID, both in [1, {ID_MAX}] (omit --user to run as root)")
        return pair

    parser = argparse.ArgumentParser(description="VM-side shim: runs commands for the host over JSON Lines.")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--port", help=f"control character device (default {DEFAULT_PORT})")
    where.add_argument("--fd", type=fd_number, help="an inherited, connected socket/pipe fd; EOF = host gone")
    parser.add_argument("--shell", default="/bin/sh")
    parser.add_argument("--kill-grace-s", type=grace, default=2.0)
    parser.add_argument("--line-max-bytes", type=line_max, default=proto.LINE_MAX_BYTES_DEFAULT)
    parser.add_argument("--user", type=ids, metavar="UID:GID",
                        help="run commands as this unprivileged user (default: as the shim's own user)")
    parser.add_argument("--home", default=GUEST_HOME_DEFAULT, help="the user's HOME (with --user)")
    parser.add_argument("--undo-events", default="", metavar="PATH",
                        help=f"keep the undo notification file here and name it in ${proto.UNDO_EVENTS_ENV} for every "
                             f"command (the guest's init passes {proto.UNDO_EVENTS_PATH}; default: none)")
    args = parser.parse_args(argv)
    if args.port is None and args.fd is None:
        args.port = DEFAULT_PORT
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.fd is not None:
        try:
            os.fstat(args.fd)
        except OSError as exc:
            print(f"shim: --fd {args.fd}: {exc}", file=sys.stderr)
            return 2
    shim = Shim(
        port=args.port,
        fd=args.fd,
        shell=args.shell,
        kill_grace_s=args.kill_grace_s,
        line_max_bytes=args.line_max_bytes,
        user=GuestUser(*args.user, args.home) if args.user else None,
        undo_events=args.undo_events or None,
    )
    return shim.run()


if __name__ == "__main__":
    sys.exit(main())
