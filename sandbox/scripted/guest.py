"""A scripted guest: a test double for the guest VM that speaks real 9P to the real server.

Instead of QEMU, a Linux kernel and a shell, :class:`ScriptedGuest` connects one real
9P2000.L client (:class:`sandbox.ninep.client.Client`, through :class:`sandbox.ninep.wirefs.WireFS`)
per share to the session's unix socket and runs *commands* written in a tiny script
language (:mod:`sandbox.scripted.script`). Every file operation is a real 9P message sequence (walk, lopen/lcreate,
read/write, clunk …), so the whole host path — server, providers, the undo core,
safeguard holds — is exercised without a VM. It replaces only the guest: nothing of our
own code is stubbed.

The interface is the one the session drives for the QEMU guest: ``boot`` (connect and
attach, blocking), ``exec`` (returns an :class:`Execution` whose ``completed`` future
resolves to ``{"type": "step_completed", "id", "exit_code", "signal"}``), ``cancel``,
``rollback_notify``, ``pause``/``resume`` (it cannot pause: ``pause`` returns False),
``vm_status``, ``alive``, ``tail`` and ``stop`` — and live mounts: ``mount(GuestMount)``
attaches one more 9P client to the same socket (as the VM mounts on a spare forwarded
port), ``unmount(target)`` closes it; at most ``LIVE_MOUNTS_MAX`` at once, and only live
mounts can be unmounted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from ..guest import control as proto
from ..guest.control import LIVE_MOUNTS_MAX, check_aname, check_target
from ..ninep.client import Client
from ..ninep.messages import ProtocolError
from ..ninep.wirefs import WireFS
from ..vm.guest import GuestError, GuestMount  # noqa: F401 — the session passes these
from .script import (  # noqa: F401 — the language's public names, re-exported
    EXIT_CANCELLED,
    SHOWN_MAX,
    SIGTERM,
    ScriptSyntaxError,
    _components,
    _Script,
    _strerror,
    parse_script,
    unescape,
)

__all__ = ["Execution", "GuestMount", "ScriptSyntaxError", "ScriptedGuest", "parse_script", "unescape"]

log = logging.getLogger("sandbox.scripted_guest")

TAIL_LINES_MAX = 2000
JOIN_TIMEOUT_S = 10.0

#: undo notifications the scripted guest keeps (older ones are dropped)
UNDO_EVENTS_RECORDED_MAX = 1000


@dataclass
class Execution:
    """One ``exec``: ``completed`` resolves (on the loop ``exec`` ran on) to the shim's
    ``step_completed`` dict; ``started`` is resolved at once (the shim's ``step_started``)."""

    id: int
    command: str
    cwd: str
    started: asyncio.Future
    completed: asyncio.Future
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)


# ---------------------------------------------------------------------------- mounts


class _MountFS(WireFS):
    """WireFS attached to the export named ``aname`` (WireFS itself attaches to the default)."""

    def __init__(self, client: Client, aname: str):  # not super().__init__: it attaches aname ""
        self.c = client
        self.host = None
        self.decide = None
        self.root_fid, _qid = client.attach(aname=aname)


@dataclass
class _Mount:
    spec: GuestMount
    parts: tuple[str, ...]
    client: Client
    fs: _MountFS
    live: bool = False  # mounted after boot (``ScriptedGuest.mount``)


# ---------------------------------------------------------------------------- the guest


def _complete(fut: asyncio.Future, result: dict) -> None:
    if not fut.done():
        fut.set_result(result)


class ScriptedGuest:
    """The guest VM's stand-in: real 9P clients, commands are scripts (module docstring)."""

    accel = "none"
    accel_reason = "scripted guest: no VM, commands are file-operation scripts over the real 9P server"

    def __init__(self, *, reply_timeout_s: float | None = None):
        """``reply_timeout_s``: how long a 9P reply may take once booted (None: for ever, as
        the kernel waits on a held reply; ``stop`` still ends the wait)."""
        self.reply_timeout_s = reply_timeout_s
        self.rollbacks: list[int] = []
        #: what the shim would append to its undo events file, one per undo (the newest UNDO_EVENTS_RECORDED_MAX)
        self.undo_events: collections.deque[dict] = collections.deque(maxlen=UNDO_EVENTS_RECORDED_MAX)
        self.boot_s: float | None = None  # how long boot took (connect + attach)
        self._mounts: list[_Mount] = []  # deepest target first; replaced whole, never mutated (scripts read it)
        self._socket_path: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._current: Execution | None = None
        self._workers: list[threading.Thread] = []
        self._booted = False
        self._stopped = False
        self._log_lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES_MAX)
        self._log_lock = threading.Lock()

    # -- log --

    def _log(self, line: str) -> None:
        with self._log_lock:
            self._log_lines.append(line)
        log.debug("scripted guest: %s", line)

    def tail(self, n: int = 20) -> list[str]:
        """The last ``n`` lines of what the guest did (like a console tail)."""
        with self._log_lock:
            lines = list(self._log_lines)
        return lines[-n:] if n > 0 else []

    # -- lifecycle --

    def boot(self, *, socket_path: str, mounts: list[GuestMount], loop: asyncio.AbstractEventLoop,
             timeout_s: float = 30.0) -> None:
        """Connect one 9P client per mount to ``socket_path`` and attach ``aname``.
        Blocking; call it from a normal thread, not ``loop``. On failure nothing stays open."""
        with self._lock:
            if self._booted or self._stopped:
                raise RuntimeError("the scripted guest was already booted")
            self._booted = True
        self._loop = loop
        self._socket_path = socket_path
        t0 = time.monotonic()
        opened: list[_Mount] = []
        try:
            seen: set[tuple[str, ...]] = set()
            for spec in mounts:
                if not spec.target.startswith("/"):
                    raise ValueError(f"mount target {spec.target!r} is not an absolute guest path")
                parts = _components(spec.target)
                if parts in seen:
                    raise ValueError(f"two shares mounted at {spec.target!r}")
                seen.add(parts)
                client = Client.connect_unix(spec.socket or socket_path, timeout_s=timeout_s)
                try:
                    fs = _MountFS(client, spec.aname)
                except BaseException:
                    client.close()
                    raise
                client.sock.settimeout(self.reply_timeout_s)
                opened.append(_Mount(spec, parts, client, fs))
                self._log(f"boot: attached {spec.aname!r} at {'/' + '/'.join(parts)} "
                          f"({'ro' if spec.read_only else 'rw'})")
        except BaseException as e:
            for mount in opened:
                mount.client.close()
            self._log(f"boot failed: {e!r}")
            with self._lock:
                self._stopped = True
            raise
        with self._lock:
            stopped = self._stopped  # stop() from another thread while booting
            self._mounts = sorted(opened, key=lambda mt: len(mt.parts), reverse=True)
        if stopped:
            for mount in opened:
                mount.client.close()
            raise RuntimeError("the scripted guest was stopped while booting")
        self.boot_s = time.monotonic() - t0
        self._log(f"ready: {len(opened)} share(s)")

    # -- live mounts --

    async def mount(self, m: GuestMount) -> None:
        """Attach a new 9P client to export ``m.aname`` and mount it at ``m.target``.
        Raises GuestError (not running, target taken, LIVE_MOUNTS_MAX reached, the server
        refused the attach) or ValueError (a target or attach name the protocol refuses)."""
        check_target(m.target)
        check_aname(m.aname)
        parts = _components(m.target)
        with self._lock:
            if not self.alive() or self._socket_path is None:
                raise GuestError("the scripted guest is not running")
            if any(mt.parts == parts for mt in self._mounts):
                raise GuestError(f"a share is already mounted at {m.target}")
            if sum(mt.live for mt in self._mounts) >= LIVE_MOUNTS_MAX:
                raise GuestError(f"no free port for a live mount: {LIVE_MOUNTS_MAX} at most (LIVE_MOUNTS_MAX)")
            placeholder = _Mount(m, parts, None, None, live=True)  # reserves the target and the count
            self._mounts = sorted([*self._mounts, placeholder], key=lambda mt: len(mt.parts), reverse=True)
        try:  # blocking client calls answered by the server on ``loop``: off the loop
            client, fs = await asyncio.get_running_loop().run_in_executor(None, self._attach, m)
        except BaseException as e:
            with self._lock:
                self._mounts = [mt for mt in self._mounts if mt is not placeholder]
            if isinstance(e, (OSError, ProtocolError)):
                raise GuestError(f"cannot mount {m.aname!r} at {m.target}: {_strerror(e)}") from None
            raise
        with self._lock:
            stopped = self._stopped
            self._mounts = sorted([_Mount(m, parts, client, fs, live=True) if mt is placeholder else mt
                                   for mt in self._mounts], key=lambda mt: len(mt.parts), reverse=True)
        if stopped:
            client.close()
            raise GuestError("the scripted guest was stopped while mounting")
        self._log(f"mount: attached {m.aname!r} at {m.target} ({'ro' if m.read_only else 'rw'})")

    def _attach(self, m: GuestMount) -> tuple[Client, _MountFS]:
        client = Client.connect_unix(self._socket_path, timeout_s=JOIN_TIMEOUT_S)
        try:
            fs = _MountFS(client, m.aname)
        except BaseException:
            client.close()
            raise
        client.sock.settimeout(self.reply_timeout_s)
        return client, fs

    async def unmount(self, target: str) -> None:
        """Unmount the live mount at ``target`` (its client is closed). GuestError if there is none."""
        parts = _components(target)
        with self._lock:
            found = [mt for mt in self._mounts if mt.parts == parts and mt.live and mt.client is not None]
            if not found:
                raise GuestError(f"no live mount at {target}")
            self._mounts = [mt for mt in self._mounts if mt is not found[0]]
        found[0].client.close()
        self._log(f"unmount: {target}")

    def alive(self) -> bool:
        return self._booted and not self._stopped and not getattr(self, "_halted", False)

    async def vm_status(self) -> str:
        return "running" if self.alive() else "stopped"

    async def pause(self) -> bool:
        return False  # nothing to pause: a held reply blocks the script's thread by itself

    async def resume(self) -> None:
        return None

    def stop(self) -> None:
        """Cancel a running script, end every 9P wait (the sockets are shut down), join the
        worker (bounded) and close the clients. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            current = self._current
            workers = list(self._workers)
        if current is not None:
            current._cancel.set()
        for mount in self._mounts:
            if mount.client is None:
                continue  # a live mount still attaching: mount() closes it on seeing _stopped
            with contextlib.suppress(OSError):
                mount.client.sock.shutdown(socket.SHUT_RDWR)  # wakes a recv blocked on a held reply
        for t in workers:
            if t is threading.current_thread():
                continue  # stop() from the script's own output callback
            t.join(JOIN_TIMEOUT_S)
            if t.is_alive():
                log.warning("scripted guest: worker %s did not end within %.0f s", t.name, JOIN_TIMEOUT_S)
        for mount in self._mounts:
            if mount.client is not None:
                mount.client.close()
        self._log("stopped")

    # -- commands --

    async def exec(self, exec_id: int, command: str, cwd: str, env: dict[str, str],
                   on_output: Callable[[str, str], None] | None = None) -> Execution:
        """Start ``command`` (a script) on a worker thread and return at once."""
        loop = asyncio.get_running_loop()
        ex = Execution(exec_id, command, cwd, loop.create_future(), loop.create_future())
        with self._lock:
            if not self.alive():
                raise RuntimeError("the scripted guest is not running")
            if self._current is not None:
                raise RuntimeError(f"a script is already running (exec {self._current.id})")
            self._current = ex
            self._workers = [t for t in self._workers if t.is_alive()]
            worker = threading.Thread(target=self._main, args=(ex, dict(env or {}), on_output),
                                      name=f"scripted-guest-{exec_id}", daemon=True)
            self._workers.append(worker)
        first = command.strip().splitlines()[0] if command.strip() else ""
        self._log(f"exec {exec_id} in {cwd}: {first[:SHOWN_MAX]}")
        ex.started.set_result({"type": "step_started", "id": exec_id})
        try:
            worker.start()
        except BaseException:
            with self._lock:
                self._current = None
            raise
        return ex

    def _main(self, ex: Execution, env: dict[str, str], on_output) -> None:
        code: int = 1
        try:
            code = _Script(self, ex, env, on_output).run()
        except BaseException as e:  # noqa: BLE001 - a bug in the scripted guest: report it as a failure, never hang
            self._log(f"[{ex.id}] internal error: {e!r}")
            log.error("scripted guest: exec %d failed: %s", ex.id, "".join(traceback.format_exception(e)))
            if on_output is not None:
                with contextlib.suppress(Exception):
                    on_output("stderr", f"scripted guest: internal error: {e!r}\n")
        if ex._cancel.is_set() and code != 0:
            code = EXIT_CANCELLED
        signal = SIGTERM if code == EXIT_CANCELLED and ex._cancel.is_set() else None
        result = {"type": "step_completed", "id": ex.id, "exit_code": code, "signal": signal}
        self._log(f"[{ex.id}] exit {code}" + (" (SIGTERM)" if signal else ""))
        with self._lock:
            if self._current is ex:
                self._current = None
        loop = ex.completed.get_loop()
        try:
            loop.call_soon_threadsafe(_complete, ex.completed, result)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    async def cancel(self, exec_id: int) -> None:
        with self._lock:
            current = self._current
        if current is None or current.id != exec_id:
            self._log(f"cancel {exec_id}: not running")
            return
        self._log(f"cancel {exec_id}")
        current._cancel.set()

    async def rollback_notify(self, step_id: int, paths: list[dict] | None = None, *, step_ids: list[int] | None = None,
                              folder: str | None = None, paths_truncated: bool = False) -> None:
        """Records it: ``rollbacks`` (step ids, as before) and ``undo_events`` — the line the
        VM's shim would append to its undo events file, built by the same protocol code."""
        msg = proto.rollback_notify_request(step_id, step_ids=step_ids, folder=folder, paths=paths,
                                            paths_truncated=paths_truncated)
        self.rollbacks.append(step_id)
        self.undo_events.append({"step_ids": msg["step_ids"], "folder": folder, "paths": msg["paths"],
                                 "paths_truncated": msg["paths_truncated"]})
        self._log(f"rollback_notify {step_id}")
