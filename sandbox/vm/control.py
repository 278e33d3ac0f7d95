"""The host end of the control channel: JSON Lines to and from the guest shim (seed §4.2).

QEMU exposes the guest's virtio-serial port ``control`` as a unix socket; this client
connects to it, sends ``exec``/``cancel``/``rollback_notify``/``mount``/``unmount`` and
routes what the shim sends back: ``ready``, ``step_started`` (an acknowledgement — step
ids are the host's), ``output`` chunks, ``step_completed``, ``error``, and the mount
replies. The messages, fields and limits are those of :mod:`sandbox.guest.control`, the
one definition both ends import.

Invariants: one reader task per connection, owned by the client and cancelled by
:meth:`close`; a line longer than ``line_max_bytes`` or not a JSON object is dropped with
a warning, never fatal; mount requests have their own id space (their replies are
never ``error``); every waiter has a timeout or is woken by the connection closing
(:class:`ControlClosed`), so nothing waits forever on a dead guest.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable

from ..guest import control as proto

log = logging.getLogger("sandbox.control")
LINE_MAX_BYTES = proto.LINE_MAX_BYTES_DEFAULT
ERRORS_KEPT_MAX = 100


class MountError(OSError):
    """The guest could not mount or unmount (``mount_failed``/``unmount_failed``)."""


class ControlClosed(ConnectionError):
    """The guest side of the control channel went away."""


@dataclass
class _Exec:
    id: int
    started: asyncio.Future
    completed: asyncio.Future
    on_output: Callable[[str, str], None] | None
    output_bytes: int = 0
    messages: list = field(default_factory=list)


class ControlClient:
    def __init__(self, line_max_bytes: int = LINE_MAX_BYTES):
        self.line_max_bytes = line_max_bytes
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None
        self._ready: asyncio.Future | None = None
        self._execs: dict[int, _Exec] = {}
        self._mount_ops: dict[int, asyncio.Future] = {}  # by mount request id
        self._mount_ids = itertools.count(1)
        self.errors: list[dict] = []  # error messages from the shim (at most ERRORS_KEPT_MAX)

    async def connect(self, path: str, timeout_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        deadline = loop.time() + timeout_s
        while True:  # QEMU creates the socket as it starts
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(path, limit=self.line_max_bytes + 2)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise ControlClosed(f"control socket {path} did not appear within {timeout_s:.0f} s") from None
                await asyncio.sleep(0.05)
        self._task = loop.create_task(self._read_loop())

    async def wait_ready(self, timeout_s: float) -> dict:
        """The shim's first ``ready`` message."""
        return await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                try:
                    line = await self._reader.readuntil(b"\n")
                except asyncio.LimitOverrunError:
                    log.warning("control: a line over %d bytes from the guest was dropped", self.line_max_bytes)
                    await self._skip_line()
                    continue
                except asyncio.IncompleteReadError:
                    break
                try:
                    msg = proto.decode(line, self.line_max_bytes)
                except proto.ProtocolError as e:
                    log.warning("control: a bad line from the guest (%s): %r", e, line[:200])
                    continue
                self._dispatch(msg)
        finally:
            self._fail_all(ControlClosed("the guest's control channel closed"))

    async def _skip_line(self) -> None:
        while True:
            try:
                await self._reader.readuntil(b"\n")
                return
            except asyncio.LimitOverrunError as e:
                await self._reader.readexactly(e.consumed)

    def _dispatch(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)
            return
        if kind == "error":
            log.warning("control: the shim reports: %s", msg.get("message"))
            if len(self.errors) < ERRORS_KEPT_MAX:
                self.errors.append(msg)
            ex = self._execs.get(msg.get("id"))
            if ex is not None and not ex.started.done():  # the exec itself was refused
                ex.started.set_exception(RuntimeError(f"the guest refused the command: {msg.get('message')}"))
                ex.completed.set_exception(RuntimeError(f"the guest refused the command: {msg.get('message')}"))
                ex.completed.exception()  # whoever awaited `started` has seen it: never "exception was never retrieved"
            return
        if kind in ("mounted", "mount_failed", "unmounted", "unmount_failed"):
            fut = self._mount_ops.pop(msg.get("id"), None) if proto.valid_id(msg.get("id")) else None
            if fut is not None and not fut.done():
                if kind.endswith("_failed"):
                    fut.set_exception(MountError(f"the guest: {msg.get('message')}"))
                else:
                    fut.set_result(msg)
            return
        ex = self._execs.get(msg.get("id"))
        if ex is None:
            return  # a message for a command we no longer track
        if kind == "step_started":
            if not ex.started.done():
                ex.started.set_result(msg)
        elif kind == "output":
            data = msg.get("data")
            if isinstance(data, str) and ex.on_output is not None:
                ex.output_bytes += len(data)
                try:
                    ex.on_output(str(msg.get("stream")), data)
                except Exception:
                    log.exception("control: output callback failed")
        elif kind == "step_completed":
            if not ex.started.done():
                ex.started.set_result(msg)
            if not ex.completed.done():
                ex.completed.set_result(msg)
            self._execs.pop(ex.id, None)

    def _fail_all(self, exc: Exception) -> None:
        for ex in list(self._execs.values()):
            for fut in (ex.started, ex.completed):
                if not fut.done():
                    fut.set_exception(exc)
        self._execs.clear()
        for fut in self._mount_ops.values():
            if not fut.done():
                fut.set_exception(exc)
        self._mount_ops.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(exc)

    async def send(self, msg: dict) -> None:
        if self._writer is None or self._writer.is_closing():
            raise ControlClosed("the control channel is not connected")
        # any str can be sent (a lone surrogate goes ASCII-escaped); the shim decides
        self._writer.write(proto.encode(msg))
        await self._writer.drain()

    async def exec(self, exec_id: int, command: str, cwd: str, env: dict[str, str] | None = None,
                   on_output: Callable[[str, str], None] | None = None) -> _Exec:
        """Send ``exec``; returns the handle whose ``started``/``completed`` futures resolve."""
        loop = asyncio.get_running_loop()
        if exec_id in self._execs:
            raise ValueError(f"command {exec_id} is already running")
        ex = _Exec(exec_id, loop.create_future(), loop.create_future(), on_output)
        self._execs[exec_id] = ex
        try:
            await self.send({"type": "exec", "id": exec_id, "command": command, "cwd": cwd, "env": env or {}})
        except BaseException:
            self._execs.pop(exec_id, None)
            raise
        return ex

    async def cancel(self, exec_id: int) -> None:
        await self.send({"type": "cancel", "id": exec_id})

    async def rollback_notify(self, step_id: int, paths: list[dict] | None = None, *, step_ids: list[int] | None = None,
                              folder: str | None = None, paths_truncated: bool = False) -> None:
        """An undo happened: the shim appends it to the guest's undo events file (the paths
        bounded by :func:`sandbox.guest.control.rollback_notify_request`)."""
        await self.send(proto.rollback_notify_request(step_id, step_ids=step_ids, folder=folder, paths=paths,
                                                      paths_truncated=paths_truncated))

    async def mount(self, *, port: int, aname: str, target: str, read_only: bool,
                    msize: int = proto.MSIZE_DEFAULT, timeout_s: float = proto.MOUNT_TIMEOUT_S + 10,
                    tag: str | None = None) -> dict:
        """Ask the shim to mount export ``aname`` through forwarded ``port`` at ``target``.
        Returns the ``mounted`` message; raises :class:`MountError` (the guest's reason),
        ``ValueError`` (a field the protocol refuses, nothing sent), ``TimeoutError`` or
        :class:`ControlClosed`."""
        req_id = next(self._mount_ids)
        msg = proto.mount_request(req_id, port=port, aname=aname, target=target, read_only=read_only, msize=msize,
                                  tag=tag)
        return await self._mount_op(req_id, msg, timeout_s)

    async def unmount(self, target: str, timeout_s: float = proto.MOUNT_TIMEOUT_S + 10) -> dict:
        """Ask the shim to unmount ``target``; the ``unmounted`` message, or raises as :meth:`mount`."""
        req_id = next(self._mount_ids)
        return await self._mount_op(req_id, proto.unmount_request(req_id, target), timeout_s)

    async def _mount_op(self, req_id: int, msg: dict, timeout_s: float) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self._mount_ops[req_id] = fut
        try:
            await self.send(msg)
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._mount_ops.pop(req_id, None)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._fail_all(ControlClosed("closed"))
