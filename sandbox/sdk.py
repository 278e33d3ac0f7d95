"""The embedding SDK: :class:`Sandbox` (async) and :class:`SyncSandbox` (scripts).

::

    import sandbox
    async with sandbox.Sandbox(volumes=[("~/proj", "/workspace"), ("~/data", "/data", "ro")],
                               mounts={"/mnt/tools": {"hello.sh": b"#!/bin/sh\\necho hi\\n"}},
                               python_path=["/mnt/tools"], network="disabled",
                               safeguard=sandbox.SafeguardConfig(delete_threshold=50)) as sb:
        r = await sb.run("rm -rf build && make", on_output=print)   # StepResult
        await sb.undo(1)
        await sb.history()

:class:`Sandbox` is the composition root over the threaded
:class:`~sandbox.session.runtime.Session` (mount table, workspaces, the 9P server, the
guest): every blocking call runs in a worker thread, so the caller's event loop never
blocks; output, events and safeguard notifications come back onto the caller's loop.

* ``run(cmd, on_output=...)`` — one command, one step of every read-write volume.
  ``on_output`` gets each chunk as an :class:`Output` (a ``str`` with ``.stream``), so
  ``print`` works; a coroutine function is awaited, in order, before ``run`` returns.
  The :class:`~sandbox.session.runtime.StepResult` also carries the output (at most
  :data:`OUTPUT_CHARS_MAX` characters per stream, then ``output_truncated``). Cancelling
  the ``run`` task cancels the command in the guest (SIGTERM, then SIGKILL) and waits for it.
* ``events()`` — the session's events as dicts (``type``: ``step_completed``,
  ``safeguard_triggered``, ``safeguard_resolved``, ``external_modification``,
  ``recovery``, ``warning``, …). One bounded buffer per sandbox, filled from start
  (:data:`EVENTS_BUFFERED_MAX`; when full the oldest is dropped and counted in
  :attr:`Sandbox.events_dropped`); for several consumers pass ``on_event=``.
* ``safeguards`` — pending holds, ``confirm(id, "allow"|"deny")``, ``on_hold(callback)``.
* ``mount(guest_path, files_or_vfs, writable=False)`` / ``unmount(guest_path)`` — live
  mounts (seed 000), never undo-tracked or persisted.
* ``files`` — the handle-based file API (seed 002): :class:`FileAPI`, :class:`FileHandle`.

``guest="local"`` (:mod:`sandbox.local`): no VM — commands run on the host against FUSE
mounts of the volumes at their own paths (give no guest path), in a private mount namespace.
Undo, not isolation: the commands can reach everything the agent's user can.

Invariants: ``stop()`` is idempotent and releases everything ``start()`` acquired (also
after a failed start); after ``stop()`` the ``events()`` iterators end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Union

from .core.safeguard import SafeguardConfig
from .core.store import Limits
from .files import FileService
from .session.guest import check_share
from .session.runtime import EXTERNAL_POLICIES, Folder, MemoryMount, Session, SessionError, StepResult

__all__ = ["Sandbox", "SyncSandbox", "Volume", "Output", "Safeguards", "StepResult",
           "EVENTS_BUFFERED_MAX", "OUTPUT_CHARS_MAX", "SYNC_CALL_TIMEOUT_S"]

log = logging.getLogger("sandbox.sdk")

#: events kept for ``events()`` until read; one more drops the oldest (counted)
EVENTS_BUFFERED_MAX = 10_000
#: characters of each stream a StepResult keeps; the rest is only streamed to on_output
OUTPUT_CHARS_MAX = 1 << 20
#: the longest a SyncSandbox call waits for its loop thread (a command may take long)
SYNC_CALL_TIMEOUT_S = 24 * 3600.0
_END = object()  # events() sentinel at stop


class Output(str):
    """A chunk of a command's output; ``stream`` is ``"stdout"`` or ``"stderr"``."""

    stream: str

    def __new__(cls, text: str, stream: str) -> "Output":
        o = super().__new__(cls, text)
        o.stream = stream
        return o


@dataclass(frozen=True)
class Volume:
    """A host folder at a guest path: ``read_only`` volumes have no undo history.
    ``state_dir``: where its undo store lives (default: beside the user's state)."""

    host: str
    guest: str | None = None
    read_only: bool = False
    label: str = ""
    state_dir: str | None = None

    @classmethod
    def parse(cls, spec) -> "Volume":
        """``Volume``, ``"host"``, ``(host, guest)`` or ``(host, guest, "ro"|"rw")``."""
        if isinstance(spec, Volume):
            return spec
        if isinstance(spec, (str, os.PathLike)):
            return cls(os.fspath(spec))
        if isinstance(spec, (tuple, list)) and len(spec) in (2, 3):
            mode = spec[2] if len(spec) == 3 else "rw"
            if mode not in ("ro", "rw"):
                raise ValueError(f"volume access must be 'ro' or 'rw', not {mode!r}")
            return cls(os.fspath(spec[0]), spec[1], mode == "ro")
        raise ValueError(f"a volume is (host, guest[, 'ro'|'rw']) or a Volume, not {spec!r}")


def _event_out(e: dict) -> dict:
    e = dict(e)
    t = e.get("type", "")
    e["type"] = t[len("event."):] if t.startswith("event.") else t
    return e


class Safeguards:
    """``sb.safeguards``: answer holds (SPEC §4: deny rolls the step back; no answer within
    the configured timeout denies). Either register ``on_hold(callback)`` — called on the
    caller's loop with the ``safeguard_triggered`` payload, returning ``"allow"``/``"deny"``
    (or an awaitable of it), or ``None`` to answer later — or watch ``events()`` and call
    :meth:`confirm`."""

    def __init__(self, sandbox: "Sandbox"):
        self._sb = sandbox
        self._callback: Callable[[dict], Any] | None = None

    def on_hold(self, callback: Callable[[dict], Any] | None) -> None:
        self._callback = callback

    def pending(self) -> list[dict]:
        """The ``safeguard_triggered`` payloads of the holds still waiting for an answer."""
        return self._sb._holds.pending()

    def confirm(self, safeguard_id: str, action: str) -> bool:
        """Answer a pending hold; False if it is not pending (answered, timed out, unknown).
        A deny has rolled the step back when this returns."""
        return self._sb._holds.answer(safeguard_id, action)

    async def _triggered(self, payload: dict) -> None:
        cb = self._callback
        if cb is None:
            return
        try:
            action = cb(payload)
            if inspect.isawaitable(action):
                action = await action
        except Exception:
            log.exception("safeguard callback failed for %s: denying", payload.get("safeguard_id"))
            action = "deny"
        if action in ("allow", "deny"):
            self.confirm(payload["safeguard_id"], action)


Files = Union[dict, Any]  # {rel: bytes} or a VirtualFileSystem


class Sandbox:
    """A session: a guest (VM, scripted or local) running commands on host folders, every write
    undoable. See the module docstring; every argument is keyword-only."""

    def __init__(self, *, volumes: Iterable = (), mounts: dict[str, Files] | Iterable[MemoryMount] | None = None,
                 python_path: list[str] | None = None, network: str = "disabled", allow: list[str] | None = None,
                 vm_mode: str = "ephemeral", memory_mb: int = 1024, cpus: int = 2,
                 safeguard: SafeguardConfig | None = None, limits: Limits | None = None,
                 external_modification_policy: str | None = "barrier", guest: str | Callable = "vm",
                 share: str | None = None, restrict: str | None = None, read_only: bool = False,
                 guest_root: str = "host-usr", guest_packages: list[str] | None = None,
                 on_event: Callable[[dict], Any] | None = None,
                 on_safeguard: Callable[[dict], Any] | None = None, progress: Callable[[str], None] | None = None,
                 as_root: bool = False, virtiofs_direct_io: str = "write-only"):
        if share is not None:
            check_share(share)
        if external_modification_policy not in (None, *EXTERNAL_POLICIES):
            raise ValueError(f"external_modification_policy must be None or one of {', '.join(EXTERNAL_POLICIES)}")
        vols = [Volume.parse(v) for v in volumes]
        if not vols:
            raise ValueError("at least one volume: volumes=[(host_dir, guest_path)]")
        folders = [Folder(os.path.expanduser(v.host), v.read_only, v.guest, v.label, v.state_dir) for v in vols]
        mems: list[MemoryMount] = []
        if isinstance(mounts, dict):
            for target, files in mounts.items():
                mems.append(MemoryMount(target, files))
        else:
            for m in mounts or ():
                if not isinstance(m, MemoryMount):
                    raise ValueError(f"mounts is {{guest_path: files}} or a list of MemoryMount, not {m!r}")
                mems.append(m)
        self._session = Session(folders, network=network, allow=allow, vm_mode=vm_mode, memory_mb=memory_mb,
                                cpus=cpus, safeguard=safeguard, limits=limits,
                                on_event=self._on_core_event, progress=progress, mounts=mems,
                                python_path=python_path, external_policy=external_modification_policy,
                                guest=guest, share=share, as_root=as_root, guest_root=guest_root,
                                guest_packages=guest_packages, virtiofs_direct_io=virtiofs_direct_io)
        self._on_event = on_event
        #: the view (seed 004) the guest and ``files`` get: a guest path and read-only flag,
        #: None/False = everything; applied at start, narrowed further by :meth:`restrict`
        self._view_args = (restrict, read_only)
        if restrict or read_only:
            self._session.table.restrict(restrict, read_only)  # a bad view is refused before anything starts
        self._view = None
        self.safeguards = Safeguards(self)
        if on_safeguard is not None:
            self.safeguards.on_hold(on_safeguard)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: collections.deque = collections.deque()
        self._events_ready: asyncio.Event | None = None
        self.events_dropped = 0
        self._unsubscribe: Callable[[], None] | None = None
        self._tasks: set[asyncio.Task] = set()
        self._files: FileAPI | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    @contextlib.asynccontextmanager
    async def create(cls, **kwargs) -> AsyncIterator["Sandbox"]:
        """``async with Sandbox.create(volumes=…) as sb`` (seed 001): start, yield, stop."""
        sb = cls(**kwargs)
        await sb.start()
        try:
            yield sb
        finally:
            await sb.stop()

    async def __aenter__(self) -> "Sandbox":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def sync(self) -> "SyncSandbox":
        """The synchronous facade over this sandbox (not started yet)."""
        return SyncSandbox._wrap(self)

    @property
    def session(self) -> Session:
        """The underlying threaded session (internal; may change)."""
        return self._session

    @property
    def _holds(self):
        """The session's one :class:`~sandbox.serving.holds.HoldBroker`."""
        return self._session.holds

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> "Sandbox":
        self._loop = asyncio.get_running_loop()
        self._events_ready = asyncio.Event()
        await asyncio.to_thread(self._session.start)
        try:
            self._unsubscribe = self._holds.subscribe(self._on_hold)
            path, ro = self._view_args
            self._view = self._session.table.restrict(path, ro) if (path or ro) else self._session.table
            if path or ro:
                self._session.restrict(self._view)
            self._files = FileAPI(FileService(self._session, self._view, client="sdk"))
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        files, self._files = self._files, None
        self._view = None
        if files is not None:
            files._service.close_all()
        await asyncio.to_thread(self._session.stop)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._loop is not None:
            self._push(_END)

    @property
    def running(self) -> bool:
        return self._session.running

    # ------------------------------------------------------------------ events

    def _call_soon(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _push(self, item) -> None:
        """On the loop: buffer one event for events() (drop the oldest when full)."""
        if len(self._events) >= EVENTS_BUFFERED_MAX:
            self._events.popleft()
            self.events_dropped += 1
        self._events.append(item)
        if self._events_ready is not None:
            self._events_ready.set()

    def _deliver(self, e: dict) -> None:
        self._push(e)
        if self._on_event is not None:
            try:
                r = self._on_event(e)
                if inspect.isawaitable(r):
                    self._spawn(r)
            except Exception:
                log.exception("on_event callback failed")

    def _spawn(self, coro: Awaitable) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _on_core_event(self, e: dict) -> None:
        """Events from the undo core and the watcher (any thread)."""
        self._call_soon(self._deliver, _event_out(e))

    def _on_hold(self, kind: str, payload: dict) -> None:
        """Broker notifications (any thread): ``resolved`` becomes an event; ``triggered``
        asks the on_hold callback (the core's own safeguard_triggered event is the event)."""
        if kind == "resolved":
            self._call_soon(self._deliver, {"type": "safeguard_resolved", **payload})
        elif kind == "triggered":
            self._call_soon(lambda: self._spawn(self.safeguards._triggered(payload)))

    async def events(self, *, wait: bool = True) -> AsyncIterator[dict]:
        """The session's events, oldest first. ``wait=False`` yields what is buffered and
        ends; otherwise the iterator waits for more and ends when the sandbox stops."""
        if self._events_ready is None:
            raise SessionError("the sandbox is not started")
        while True:
            while self._events:
                item = self._events.popleft()
                if item is _END:
                    return
                yield item
            if not wait:
                return
            self._events_ready.clear()
            await self._events_ready.wait()

    # ------------------------------------------------------------------ commands

    async def run(self, command: str, on_output: Callable[[str], Any] | None = None, *, cwd: str | None = None,
                  env: dict[str, str] | None = None) -> StepResult:
        """Run ``command`` as one step (module docstring). ``cwd`` defaults to the first
        volume's guest path."""
        if not isinstance(command, str):
            raise TypeError(f"command must be str, not {type(command).__name__}")
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        kept = {"stdout": [], "stderr": []}
        sizes = {"stdout": 0, "stderr": 0}
        truncated = False
        pending: list[Awaitable] = []

        def on_chunk(stream: str, text: str) -> None:  # on the loop, in arrival order
            nonlocal truncated
            room = OUTPUT_CHARS_MAX - sizes[stream]
            if len(text) > room:
                truncated = True
            if room > 0:
                kept[stream].append(text[:room])
                sizes[stream] += min(len(text), room)
            if on_output is not None:
                try:
                    r = on_output(Output(text, stream))
                    if inspect.isawaitable(r):
                        pending.append(asyncio.ensure_future(r))
                except Exception:
                    log.exception("on_output callback failed")

        def from_thread(stream: str, text: str) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(on_chunk, stream, text)

        work = asyncio.ensure_future(asyncio.to_thread(self._session.run, command, from_thread, cwd=cwd, env=env,
                                                       cancel=cancel))
        try:
            result = await asyncio.shield(work)
        except asyncio.CancelledError:
            cancel.set()  # the command is cancelled in the guest; its step still closes
            with contextlib.suppress(Exception):
                await work
            raise
        await asyncio.sleep(0)  # output scheduled before completion runs first (FIFO)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        result.stdout = "".join(kept["stdout"])
        result.stderr = "".join(kept["stderr"])
        result.output_truncated = truncated
        return result

    # ------------------------------------------------------------------ undo

    async def undo(self, n: int = 1, *, force: bool = False, volume: int = 0) -> dict:
        """Roll back the newest ``n`` steps of a read-write volume (index in ``volumes``)."""
        return await asyncio.to_thread(self._session.undo, n, force, volume)

    async def history(self, *, volume: int = 0) -> list[dict]:
        return await asyncio.to_thread(self._session.history, volume)

    async def status(self) -> dict:
        return await asyncio.to_thread(self._session.status)

    # ------------------------------------------------------------------ live mounts

    async def mount(self, guest_path: str, files: Files, *, writable: bool = False, label: str = "") -> dict:
        """Mount ``files`` (``{rel: bytes}`` or a VirtualFileSystem) at ``guest_path`` now."""
        m = await asyncio.to_thread(self._session.mount, guest_path, files, writable=writable, label=label)
        self._follow_table()
        return {"guest_path": m.target, "read_only": m.read_only, "label": m.label}

    async def unmount(self, guest_path: str) -> None:
        await asyncio.to_thread(self._session.unmount, guest_path)
        self._follow_table()

    def _follow_table(self) -> None:
        """The view keeps its subtree and read-only flag over the session's new table (a live
        mount came or went); ``files`` follows it."""
        if self._view is None:
            return
        v = self._view
        self._view = self._session.table.restrict(None if v.view == "/" else v.view, v.read_only)
        if self._files is not None:
            self._files._service.narrow(self._view)

    async def restrict(self, path: str | None = None, read_only: bool | None = None) -> dict:
        """Narrow what the guest and ``files`` see (seed 004): only ``path`` (a guest path inside
        the current view; outside it ``EACCES``), and/or read-only (writes ``EROFS``). It only
        narrows: widening raises :class:`~sandbox.mounts.table.WidenDenied`."""
        def go():
            view = self._view.restrict(path, read_only)
            self._session.restrict(view)
            self._files._service.narrow(view)
            self._view = view
            return {"view": view.view, "read_only": view.read_only}
        if self._view is None:
            raise SessionError("the sandbox is not running")
        return await asyncio.to_thread(go)

    # ------------------------------------------------------------------ files

    @property
    def files(self) -> "FileAPI":
        """The handle-based file API (seed 002) over this session's mount table; see :class:`FileAPI`."""
        if self._files is None:
            raise SessionError("the sandbox is not running: files are available between start() and stop()")
        return self._files


class FileHandle:
    """An open file of :class:`FileAPI` (``async with await sb.files.open(p, "w") as f``).

    Its writes are one API step from the first to :meth:`close` (one undo reverses them)."""

    def __init__(self, service: FileService, handle: int, path: str):
        self._service, self.handle, self.path = service, handle, path

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes from the position (at most ``sandbox.files.READ_CALL_BYTES_MAX``
        per call; ``-1``: as much as that); ``b""`` at the end."""
        return await asyncio.to_thread(self._service.read, self.handle, n)

    async def write(self, data: bytes) -> int:
        return await asyncio.to_thread(self._service.write, self.handle, bytes(data))

    async def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return await asyncio.to_thread(self._service.seek, self.handle, offset, whence)

    async def stat(self) -> dict:
        return await asyncio.to_thread(self._service.stat, self.handle)

    async def close(self) -> None:
        await asyncio.to_thread(self._service.close, self.handle)

    async def __aenter__(self) -> "FileHandle":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class FileAPI:
    """``sb.files``: :class:`sandbox.files.FileService` (the file operations STDIO and MCP use
    too) made async. Paths are guest paths (``/workspace/notes.txt``) or relative to the first
    volume; every error is an :class:`~sandbox.api.errors.ApiError` with a stable ``code`` and
    the ``errno`` in its ``data``. Writes go through the undo core as API steps: a one-shot call
    is one step, a handle's writes one step until it is closed."""

    def __init__(self, service: FileService):
        self._service = service

    async def _do(self, fn, *args):
        return await asyncio.to_thread(fn, *args)

    async def open(self, path: str, mode: str = "r") -> FileHandle:
        """Modes ``r r+ w w+ a a+ x x+`` (binary; a ``b`` is ignored)."""
        def go():
            guest = self._service.guest_path(path)
            return FileHandle(self._service, self._service.open(guest, mode), guest)
        return await self._do(go)

    async def create_temp(self) -> FileHandle:
        """An in-memory scratch file that never reaches a working folder."""
        return FileHandle(self._service, await self._do(self._service.create_temp), "")

    async def read_file(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return await self._do(self._service.read_file, path, offset, length)

    async def write_file(self, path: str, data: bytes) -> str:
        return await self._do(self._service.write_file, path, bytes(data))

    async def list(self, path: str = "") -> dict:
        return await self._do(self._service.list, path)

    async def stat(self, path: str) -> dict:
        return await self._do(self._service.stat, path)

    async def mkdir(self, path: str, parents: bool = False) -> str:
        return await self._do(self._service.mkdir, path, parents)

    async def remove(self, path: str, recursive: bool = False) -> int:
        return await self._do(self._service.remove, path, recursive)

    async def rename(self, src: str, dst: str) -> str:
        return await self._do(self._service.rename, src, dst)

    def counters(self) -> dict:
        """opens, reads, writes, closes, bytes in/out, rejects, errors, handles open."""
        return self._service.counters()


class _Blocking:
    """The synchronous face of an async object of the SDK (:class:`FileAPI`, :class:`FileHandle`):
    each coroutine method becomes a blocking call on the facade's loop; handles come back
    blocking too, and work as ``with`` blocks."""

    def __init__(self, target, call):
        self._target, self._call = target, call

    def __getattr__(self, name: str):
        attr = getattr(self._target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def blocking(*args, **kwargs):
            out = self._call(attr(*args, **kwargs))
            return _Blocking(out, self._call) if isinstance(out, FileHandle) else out
        return blocking

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._call(self._target.close())


class SyncSandbox:
    """The same :class:`Sandbox`, driven synchronously from a script: a private event loop
    runs on its own thread; every method blocks until the async one finishes.

    ``with SyncSandbox(volumes=[...], guest="scripted") as sb: sb.run("make")``. Callbacks
    (``on_output``, ``on_event``, ``on_safeguard``) run on that loop thread."""

    def __init__(self, **kwargs):
        self._sb: Sandbox | None = None
        self._kwargs = kwargs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sandbox-sdk-loop", daemon=True)
        self._thread.start()
        try:
            self._sb = self._call(self._make())
        except BaseException:
            self._close_loop()
            raise

    @classmethod
    def _wrap(cls, sb: Sandbox) -> "SyncSandbox":
        self = cls.__new__(cls)
        self._kwargs = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sandbox-sdk-loop", daemon=True)
        self._thread.start()
        self._sb = sb
        return self

    async def _make(self) -> Sandbox:
        return Sandbox(**self._kwargs)

    def _call(self, coro, timeout_s: float = SYNC_CALL_TIMEOUT_S):
        if threading.current_thread() is self._thread:
            raise RuntimeError("a SyncSandbox method was called from its own callback: use the async Sandbox")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _close_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    @property
    def sandbox(self) -> Sandbox:
        return self._sb

    @property
    def safeguards(self) -> Safeguards:
        return self._sb.safeguards

    def start(self) -> "SyncSandbox":
        self._call(self._sb.start())
        return self

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self._sb.stop())
        finally:
            self._close_loop()

    def __enter__(self) -> "SyncSandbox":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self, command: str, on_output: Callable[[str], Any] | None = None, **kw) -> StepResult:
        return self._call(self._sb.run(command, on_output, **kw))

    def undo(self, n: int = 1, **kw) -> dict:
        return self._call(self._sb.undo(n, **kw))

    def history(self, **kw) -> list[dict]:
        return self._call(self._sb.history(**kw))

    def status(self) -> dict:
        return self._call(self._sb.status())

    def mount(self, guest_path: str, files: Files, **kw) -> dict:
        return self._call(self._sb.mount(guest_path, files, **kw))

    def unmount(self, guest_path: str) -> None:
        self._call(self._sb.unmount(guest_path))

    def restrict(self, path: str | None = None, read_only: bool | None = None) -> dict:
        return self._call(self._sb.restrict(path, read_only))

    @property
    def files(self):
        """:class:`FileAPI` with blocking methods (handles too: ``with sb.files.open(p, "w") as f``)."""
        return _Blocking(self._sb.files, self._call)

    def events(self) -> Iterator[dict]:
        """The events buffered so far (never blocks)."""
        async def drain() -> list[dict]:
            return [e async for e in self._sb.events(wait=False)]
        return iter(self._call(drain()))
