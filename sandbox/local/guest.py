"""The local guest: commands run on the host, against FUSE mounts of the session's shares.

``guest="local"`` (``sandbox run --local``, ``Sandbox(guest="local")``, ``sandbox serve
--guest local``): no VM. Each share is served by the FUSE dispatcher
(:class:`~sandbox.fuse.dispatcher.Dispatcher`, on the session's own
:class:`~sandbox.serving.exports.Export` — the same hold gate, handle registry and
provider the 9P server uses) and mounted **at its own path** inside a private mount
namespace kept by the namespace holder (:mod:`sandbox.local.holder`). Every command is
entered into that namespace (``nsenter --mount --pid``, then ``cd`` to the command's cwd
*there* — never ``nsenter --wd``, which opens the directory beforehand, outside), so it
sees the FUSE mount where the folder is, while the server — in the agent's namespace,
where no mount covers the folder — keeps reaching the real files through the workspace's
directory descriptor. **It gives undo, not isolation**: commands run on the host, as the
agent's user, and can reach everything that user can outside the mounts.

How it fits the :class:`~sandbox.session.guest.Guest` protocol:

* ``boot``: start the holder (tied to the agent by the parent-death signal, in its own
  session), then for each share in order (shallowest first): ask the holder to mount
  ``/dev/fuse`` at the target, take the descriptor it passes back, and serve it with a
  :class:`~sandbox.fuse.transport.FuseServer` task on the session's loop (before the next,
  deeper mount, whose path lookup goes through it);
* ``exec``: ``nsenter`` as a child tied to the agent, in a new process group, stdin
  ``/dev/null``, stdout/stderr relayed as they come (incremental UTF-8, invalid bytes
  replaced); complete when the process has exited and both pipes are at end of file, as
  the VM's shim does; a signal death is ``exit_code`` 128+N with ``signal`` N;
* ``cancel``: SIGTERM to the command's process group, SIGKILL after :data:`CANCEL_GRACE_S`;
* ``pause``: False — there is no VM to freeze; a held safeguard request keeps the command
  blocked in its system call (the kernel waits for our reply), which is what matters;
* ``rollback_notify``: appended to an undo events file named in ``$SANDBOX_UNDO_EVENTS``
  for every command (the shim's :class:`~sandbox.guest.shim.UndoEvents`, same format), and
  the kernel told to forget its cached dentries and attributes of the undone paths (FUSE
  notifications through the mount's :class:`~sandbox.fuse.notify.Notifier`; every node when
  the path list was truncated), so the next command sees the restored tree at once;
* live ``mount``/``unmount``: one more FUSE mount (the target must exist) / detach it;
* ``stop``: SIGKILL every command's process group, detach every mount (deepest first),
  close the holder's socket (init exits; the kernel kills whatever is left in its PID
  namespace), stop the FUSE servers and close their descriptors. Idempotent; safe at any
  point of ``boot``.

Invariants: at most :data:`COMMANDS_RUNNING_MAX` commands at once (``RuntimeError``
beyond); output is relayed in reads of at most :data:`READ_CHUNK_BYTES_MAX`; a holder
request waits at most :data:`HOLDER_REPLY_TIMEOUT_S`; nothing the guest starts outlives
the agent (the holder and each ``nsenter`` get ``PR_SET_PDEATHSIG`` from
:mod:`sandbox.lifeline`; init dies with the holder, and every command's processes are in
init's PID namespace). Needs the in-process share servers (``share_servers="thread"``):
the dispatcher serves the session's exports in this process.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..fuse.dispatcher import Dispatcher
from ..fuse.notify import EVERYTHING
from ..fuse.transport import FuseServer
from ..guest import control as proto
from ..guest.shim import UndoEvents
from ..lifeline import child_setup, run_in_spawner
from ..limits import ServerLimits
from ..vm.guest import GuestError
from . import holder as _holder

log = logging.getLogger("sandbox.local")

#: commands running at once (the session runs one; API and tests may start more)
COMMANDS_RUNNING_MAX = 16
#: bytes read from a command's pipe per wake-up
READ_CHUNK_BYTES_MAX = 65536
#: seconds between a cancel's SIGTERM and its SIGKILL
CANCEL_GRACE_S = 5.0
#: seconds the holder may take to start or to answer a mount/umount
HOLDER_REPLY_TIMEOUT_S = 30.0
#: seconds stop() waits for the holder, a FUSE server or a killed command to end
STOP_TIMEOUT_S = 10.0
#: seconds an undo waits for its invalidations to reach the kernel before the next command
UNDO_NOTIFY_WAIT_S = 5.0
#: "1": make the private namespace inside a user namespace even as root (what a non-root agent
#: always does; lets the unprivileged path be exercised on a root test machine)
USER_NS_ENV = "SANDBOX_LOCAL_USERNS"
#: lines of what the guest did, for ``tail``
TAIL_LINES_MAX = 2000


#: run by /bin/sh inside the namespace: cd to the command's cwd there (so it resolves through
#: the FUSE mount), then the command in a fresh shell
ENTER_SCRIPT = 'cd -- "$1" || exit 126; exec /bin/sh -c "$2"'


class LocalGuestError(GuestError):
    """The local guest cannot start here (no /dev/fuse, no nsenter, no right to mount)."""


@dataclass
class Execution:
    """One ``exec``: ``completed`` resolves to ``{"type": "step_completed", "id", "exit_code", "signal"}``."""

    id: int
    command: str
    cwd: str
    proc: subprocess.Popen
    completed: asyncio.Future
    pipes: dict = field(default_factory=dict)  # fd -> (stream, decoder) of pipes not at EOF
    pidfd: int | None = None
    exited: bool = False


@dataclass
class _Mount:
    aname: str
    target: str
    read_only: bool
    fd: int
    server: FuseServer
    task: Any  # concurrent.futures.Future of server.serve() on the loop


def check_usable() -> None:
    """Raise :class:`LocalGuestError` saying what is missing for the local guest."""
    if not os.path.exists("/dev/fuse"):
        raise LocalGuestError("the local guest needs /dev/fuse (load the fuse module, or pass the device in)")
    if shutil.which("nsenter") is None:
        raise LocalGuestError("the local guest needs nsenter (util-linux)")
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise LocalGuestError("the local guest is not root and cannot open /dev/fuse (mode "
                              f"{os.stat('/dev/fuse').st_mode & 0o777:o}): run as root, or make /dev/fuse 0666")


class LocalGuest:
    """Commands on the host against FUSE mounts in a private namespace (module docstring)."""

    accel = "none"
    accel_reason = "local guest: no VM; commands run on the host against FUSE mounts (undo, not isolation)"

    def __init__(self, run_dir: str, exports: dict, *, limits: ServerLimits | None = None, network: bool = True,
                 progress: Callable[[str], None] | None = None, watched: frozenset = frozenset()):
        """``exports``: the session's live export table (attach name → Export);
        ``network``: False gives commands a private network namespace (loopback only);
        ``watched``: attach names whose folders the session watches for changes made beside
        it and reports here (:meth:`folder_changed`): their mounts cache long (coherent)."""
        self.run_dir = run_dir
        self.exports = exports
        self.watched = watched
        self.limits = limits or ServerLimits()
        self.network = network
        self.progress = progress or (lambda msg: None)
        self.boot_s: float | None = None
        self.user_ns = os.geteuid() != 0 or os.environ.get(USER_NS_ENV) == "1"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._holder: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._sock_lock = threading.Lock()
        self.init_pid: int | None = None
        self._mounts: list[_Mount] = []
        self._running: dict[int, Execution] = {}
        self._stopped = False
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES_MAX)
        self.undo_events = UndoEvents(os.path.join(run_dir, "undo-events.jsonl"))

    # ------------------------------------------------------------------ lifecycle

    def boot(self, *, socket_path: str, mounts: list, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        t0 = time.monotonic()
        self._loop = loop
        check_usable()
        try:
            self._start_holder()
            for spec in mounts:
                self._mount_sync(spec)
            self.undo_events.prepare()
        except BaseException:
            self.stop()
            raise
        self.boot_s = time.monotonic() - t0
        self._log(f"booted: {len(mounts)} FUSE mount(s) in namespace of pid {self.init_pid}")
        self.progress(f"local guest: {len(mounts)} share(s) mounted through FUSE at their own paths in a private "
                      "namespace — undo, not isolation (commands run on this host as you)")

    def _start_holder(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-I", os.path.abspath(_holder.__file__), str(theirs.fileno())]
        argv += ["--user"] if self.user_ns else []
        argv += [] if self.network else ["--net"]
        agent = os.getpid()
        try:
            self._holder = run_in_spawner(lambda: subprocess.Popen(
                argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=child_setup(agent)))
        finally:
            theirs.close()
        self._sock = ours
        ours.settimeout(HOLDER_REPLY_TIMEOUT_S)
        try:
            data = ours.recv(_holder.MESSAGE_BYTES_MAX)
        except (TimeoutError, OSError) as e:
            raise LocalGuestError(f"the namespace holder did not start: {e}") from None
        msg = json.loads(data) if data else {}
        if not msg.get("ready"):
            why = msg.get("error", "it exited")
            hint = (" (unprivileged: the kernel must allow user namespaces; or run as root)" if self.user_ns else "")
            raise LocalGuestError(f"cannot make the private mount namespace: {why}{hint}")
        self.init_pid = int(msg["pid"])
        #: commands see a /proc of their own PID namespace (False: the kernel refused it; the host's)
        self.private_proc = bool(msg.get("proc"))
        if not self.private_proc:
            log.warning("local guest: could not mount a private /proc; commands see the host's processes")

    def _request(self, req: dict) -> tuple[dict, int | None]:
        with self._sock_lock:
            if self._sock is None:
                raise LocalGuestError("the local guest is stopped")
            self._sock.send(json.dumps(req).encode())
            data, fds, _flags, _addr = socket.recv_fds(self._sock, _holder.MESSAGE_BYTES_MAX, 1)
        if not data:
            for fd in fds:
                os.close(fd)
            raise LocalGuestError("the namespace holder exited")
        msg = json.loads(data)
        fd = fds[0] if fds else None
        if not msg.get("ok"):
            if fd is not None:
                os.close(fd)
            raise OSError(msg.get("errno") or 5, msg.get("error", "failed"))
        return msg, fd

    def _mount_sync(self, spec) -> _Mount:
        """Mount ``spec`` (a GuestMount: aname, target, read_only) and serve it; not on the loop."""
        export = self.exports.get(spec.aname)
        if export is None:
            raise LocalGuestError(f"no export named {spec.aname!r}")
        target = os.path.realpath(spec.target)
        try:
            _msg, fd = self._request({"op": "mount", "target": target, "read_only": bool(spec.read_only),
                                      "uid": os.getuid(), "gid": os.getgid()})
        except OSError as e:
            raise LocalGuestError(f"cannot mount {target} through FUSE in the private namespace: {e.strerror}"
                                  + (" (the local guest mounts only at existing directories)"
                                     if e.errno == 2 else "")) from None
        os.set_inheritable(fd, False)
        try:
            server = asyncio.run_coroutine_threadsafe(self._server(export, fd, spec.aname in self.watched),
                                                      self._loop).result(HOLDER_REPLY_TIMEOUT_S)
        except BaseException:
            os.close(fd)
            raise
        task = asyncio.run_coroutine_threadsafe(server.serve(), self._loop)
        m = _Mount(spec.aname, target, bool(spec.read_only), fd, server, task)
        self._mounts.append(m)
        self._log(f"mounted {spec.aname} at {target}{' (ro)' if spec.read_only else ''}")
        return m

    async def _server(self, export, fd: int, coherent: bool) -> FuseServer:
        """Made on the loop, where the export is served (the dispatcher reads its root)."""
        server = FuseServer(Dispatcher(export, self.limits), fd, self.limits, poll_interval_s=None)
        server.set_coherent(coherent)
        return server

    # ------------------------------------------------------------------ the session's watcher (any thread)

    def folder_changed(self, aname: str, paths: list[str]) -> None:
        """The folder served as ``aname`` changed beside the mount at ``paths`` (relative):
        the kernel forgets what it cached of them."""
        for m in list(self._mounts):
            if m.aname == aname:
                m.server.invalidate(paths)

    def folder_unwatched(self, aname: str, overflow: bool = False) -> None:
        """The watcher lost events (``overflow``) or can no longer see the whole folder: the
        kernel forgets everything of that mount; unless it was only an overflow, the mount
        goes back to the short timeouts."""
        for m in list(self._mounts):
            if m.aname == aname:
                if not overflow:
                    m.server.set_coherent(False)
                m.server.invalidate_all()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for ex in list(self._running.values()):
            _killpg(ex.proc.pid, signal.SIGKILL)
        for ex in list(self._running.values()):
            try:
                ex.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("command %d did not end after SIGKILL", ex.id)
        for m in reversed(self._mounts):  # deepest first
            try:
                self._request({"op": "umount", "target": m.target})
            except Exception as e:
                log.warning("could not unmount %s: %s", m.target, e)
        with self._sock_lock:
            if self._sock is not None:
                self._sock.close()  # init sees end of file: the namespace ends with it
                self._sock = None
        if self._holder is not None:
            try:
                self._holder.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._holder.kill()
                self._holder.wait()
        for m in reversed(self._mounts):
            self._end_server(m)
        self._mounts.clear()
        self._log("stopped")

    def _end_server(self, m: _Mount) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(m.server.stop)
                m.task.result(STOP_TIMEOUT_S)
            except Exception as e:
                log.warning("FUSE server of %s did not stop cleanly: %s", m.target, e)
        try:
            os.close(m.fd)  # the last descriptor of the connection: the kernel aborts what is left
        except OSError:
            pass

    def alive(self) -> bool:
        return not self._stopped and self._holder is not None and self._holder.poll() is None

    def tail(self, n: int = 20) -> list[str]:
        return list(self._tail)[-n:]

    def _log(self, line: str) -> None:
        self._tail.append(line)
        log.info("%s", line)

    # ------------------------------------------------------------------ commands

    async def exec(self, exec_id: int, command: str, cwd: str, env: dict[str, str],
                   on_output: Callable[[str, str], None] | None) -> Execution:
        if not self.alive():
            raise RuntimeError("the local guest is not running")
        if len(self._running) >= COMMANDS_RUNNING_MAX:
            raise RuntimeError(f"at most {COMMANDS_RUNNING_MAX} commands at once")
        if exec_id in self._running:
            raise RuntimeError(f"command {exec_id} is already running")
        loop = asyncio.get_running_loop()
        argv = ["nsenter", "-t", str(self.init_pid), "-m", "-p"] + ([] if self.network else ["-n"])
        argv += ["-U", "--preserve-credentials"] if self.user_ns else []
        # not nsenter --wd: it opens the directory before entering, i.e. the real folder under the
        # mount — every write there would bypass the interception. cd after entering instead.
        argv += ["--", "/bin/sh", "-c", ENTER_SCRIPT, "sandbox-local", cwd, command]
        full_env = {**os.environ, **env, proto.UNDO_EVENTS_ENV: self.undo_events.path}
        agent = os.getpid()

        def spawn() -> subprocess.Popen:
            return subprocess.Popen(argv, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, preexec_fn=child_setup(agent))

        proc = await loop.run_in_executor(None, run_in_spawner, spawn)
        ex = Execution(exec_id, command, cwd, proc, loop.create_future())
        self._running[exec_id] = ex
        self._log(f"exec {exec_id} (pid {proc.pid}) in {cwd}: {command[:200]}")
        for stream, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            ex.pipes[fd] = (stream, codecs.getincrementaldecoder("utf-8")("replace"))
            loop.add_reader(fd, self._readable, ex, fd, on_output)
        ex.pidfd = os.pidfd_open(proc.pid)
        loop.add_reader(ex.pidfd, self._exited, ex)
        return ex

    def _readable(self, ex: Execution, fd: int, on_output) -> None:
        stream, decoder = ex.pipes[fd]
        try:
            data = os.read(fd, READ_CHUNK_BYTES_MAX)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        text = decoder.decode(data, final=not data)
        if text and on_output is not None:
            try:
                on_output(stream, text)
            except Exception:
                log.exception("on_output failed")
        if not data:
            self._loop_of(ex).remove_reader(fd)
            del ex.pipes[fd]
            self._maybe_complete(ex)

    def _exited(self, ex: Execution) -> None:
        loop = self._loop_of(ex)
        loop.remove_reader(ex.pidfd)
        os.close(ex.pidfd)
        ex.pidfd = None
        ex.proc.wait()  # it has exited: no wait
        ex.exited = True
        self._maybe_complete(ex)

    @staticmethod
    def _loop_of(ex: Execution) -> asyncio.AbstractEventLoop:
        return ex.completed.get_loop()

    def _maybe_complete(self, ex: Execution) -> None:
        if ex.pipes or not ex.exited:
            return
        self._running.pop(ex.id, None)
        ex.proc.stdout.close()
        ex.proc.stderr.close()
        code = ex.proc.returncode
        result: dict[str, Any] = {"type": "step_completed", "id": ex.id, "exit_code": code, "signal": None}
        if code < 0:
            result.update(exit_code=128 - code, signal=-code)
        self._log(f"exec {ex.id} ended: exit {result['exit_code']}")
        if not ex.completed.done():
            ex.completed.set_result(result)

    async def cancel(self, exec_id: int) -> None:
        ex = self._running.get(exec_id)
        if ex is None:
            return
        _killpg(ex.proc.pid, signal.SIGTERM)
        self._log(f"cancel {exec_id}: SIGTERM")

        def kill() -> None:
            if exec_id in self._running:
                _killpg(ex.proc.pid, signal.SIGKILL)
                self._log(f"cancel {exec_id}: SIGKILL")

        asyncio.get_running_loop().call_later(CANCEL_GRACE_S, kill)

    # ------------------------------------------------------------------ the rest of the Guest protocol

    async def rollback_notify(self, step_id: int, paths: list[dict] | None = None, *, step_ids: list[int] | None = None,
                              folder: str | None = None, paths_truncated: bool = False) -> None:
        msg = proto.rollback_notify_request(step_id, step_ids=step_ids, folder=folder, paths=paths,
                                            paths_truncated=paths_truncated)

        def where(rel: str) -> str:
            return rel if folder is None else folder if rel == "." else folder + "/" + rel

        self.undo_events.append({"step_ids": msg["step_ids"], "folder": folder, "time_ns": time.time_ns(),
                                 "paths": [{"path": where(p["path"]), "change": p["change"]} for p in msg["paths"]],
                                 "paths_truncated": msg["paths_truncated"]})
        # the kernel's caches of what the undo changed behind its back: dentries, attributes,
        # pages — through the mount's notifier (written off the loop, never while a request
        # is held); the next command starts once they are written
        target = os.path.realpath(folder) if folder else None
        for m in self._mounts:
            if m.target == target:
                notifier = m.server.notifier
                since = notifier.mark()
                if paths_truncated or paths is None:
                    m.server.invalidate_all()
                    key = EVERYTHING
                elif paths:
                    rels = ["" if p["path"] in (".", "") else p["path"].strip("/") for p in paths]
                    m.server.invalidate(rels)
                    key = rels[0]
                else:
                    continue
                if not await asyncio.get_running_loop().run_in_executor(
                        None, notifier.wait_flushed, key, UNDO_NOTIFY_WAIT_S, since):
                    log.warning("local guest: the undo's invalidations were not written within %.0f s",
                                UNDO_NOTIFY_WAIT_S)

    async def pause(self) -> bool:
        return False  # no VM to freeze: a held request blocks its command in the kernel anyway

    async def resume(self) -> None:
        return None

    async def vm_status(self) -> str:
        return "running" if self.alive() else "stopped"

    async def mount(self, mount) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._mount_sync, mount)

    async def unmount(self, target: str) -> None:
        target = os.path.realpath(target)
        m = next((m for m in self._mounts if m.target == target), None)
        if m is None:
            raise LocalGuestError(f"nothing is mounted at {target}")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._request, {"op": "umount", "target": target})
        self._mounts.remove(m)
        m.server.stop()
        await asyncio.wrap_future(m.task)
        os.close(m.fd)
        self._log(f"unmounted {target}")


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
