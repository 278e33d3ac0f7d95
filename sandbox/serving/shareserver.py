"""The share server: a VM session's folders served from a confined child process (issue 13).

``python -m sandbox.serving.shareserver --fd N`` is started by the agent
(:class:`sandbox.serving.remote.ShareProcess`) through :mod:`sandbox.lifeline` (it dies with
the agent), with one end of a socketpair as descriptor ``N``: the control channel
(:mod:`sandbox.serving.channel`). What it does, in this order:

1. reads its configuration — the first line on the channel, read before any thread exists:
   the folders (path, read-only, undo store, attach name), the 9P socket path, the run
   directory, safeguard and undo limits, the owner map, the external-modification policy;
2. opens one :class:`~sandbox.core.workspace.Workspace` per read-write folder (recovery on
   open rolls back a step a dead agent or share server left) and a read-only provider per
   read-only folder; the undo core's events are kept until the channel runs;
3. **confines itself** (:func:`sandbox.confine.confine`, while it has one thread): read-write
   beneath the read-write folders and their undo stores, read-only beneath the read-only
   folders, sockets in the run directory, what Python reads; ``no_new_privs``;
4. serves the folders on its own :class:`~sandbox.ninep.server.NinePServer` (unix socket
   in the run directory), starts the external-modification watchers, starts the channel
   and sends ``ready`` (with each workspace's recovery and the confinement applied);
   with ``virtiofs`` in the configuration (``{attach name: socket path}``, issue 17) each
   such folder's export is also served as a virtio-fs device on that socket in the run
   directory (same export, holds and undo core; on the 9P server's loop).

Safeguard holds: the server's gates wait on this process's own
:class:`~sandbox.serving.holds.HoldBroker`; each hold the undo core raises is registered
there *and* sent to the agent as ``event.safeguard_triggered`` (the agent's broker asks
its subscribers, pauses the VM); the agent's answer comes back as ``resolve_hold``, which
answers the local broker — so the held 9P request is answered only then. A hold that
ends here (its deadline) is reported as ``hold_resolved``.

Requests from the agent (``args`` in brackets) — each runs on its own thread:
``call`` [``directory``, ``method`` of :data:`METHODS`, ``args``], ``get`` [``directory``,
``name`` of :data:`PROPERTIES`], ``resolve_hold`` [``directory``, ``hold_id``, ``action``],
``restrict`` [``name``, ``view``, ``read_only``], ``fs`` and ``handle`` (an API client's
writes, :mod:`sandbox.serving.remotefs`), ``stop`` [], and with
``SANDBOX_TEST_PROBES=1`` in its environment only, ``probe_open`` [``path``] (the
confinement's evidence: opens a path and reports the errno).

Invariants: nothing is served before confinement; a failure before ``ready`` is sent as
``fatal`` and the process exits 1 with everything it opened closed; ``stop`` closes the
server, the watchers and the workspaces (active steps closed, stores unlocked) before it
replies; the process exits when the channel closes (the agent is gone: nobody may steer
it any more).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading

from ..confine import confine
from ..core.safeguard import SafeguardConfig
from ..core.store import Limits
from ..core.workspace import default_state_dir
from ..fuse.virtiofs import serve_export  # -- virtio-fs (issue 17): imported before confinement
from ..limits import ServerLimits
from ..mounts import Provider
from ..mounts.identity import OwnerMap
from ..ninep.server import NinePServer, ServerConfig, ServerThread
from .channel import Channel, LineReader, decode_line, encode_line
from .holds import HoldBroker
from .remotefs import FsDoor
from .workspaces import open_workspace, watch_workspace

log = logging.getLogger("sandbox.shareserver")
PROBES_ENV = "SANDBOX_TEST_PROBES"
EARLY_EVENTS_MAX = 1000  # events (recovery, log records) kept before the channel runs; more are dropped
#: Workspace methods the agent may call (``call``); results are JSON-able
METHODS = frozenset({"begin_step", "complete_step", "close_step", "close_active", "rollback", "history", "barriers",
                     "record_external_modification", "finish_pending", "configure_safeguard", "configure_limits",
                     "discard", "poll", "step_diff"})
#: Workspace properties the agent may read (``get``)
PROPERTIES = frozenset({"active_step_id", "undo_available", "undo_unavailable_reason", "safeguard_config", "limits",
                        "rollback_pending", "pending_hold", "recovery", "unrecorded_step_id", "requests_in_flight",
                        "store_size_bytes", "eviction_pending", "label", "current_step"})


def jsonable(value):
    """A workspace result as JSON: dataclasses as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if hasattr(value, "as_dict"):
        return jsonable(value.as_dict())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    return value


class ShareServer:
    """The child's state: workspaces, providers, the 9P server, the watchers, the channel."""

    def __init__(self, config: dict, sock: socket.socket):
        self.config = config
        self.sock = sock
        self.workspaces: dict[int, object] = {}
        self.journals: dict[int, object] = {}
        self.providers: dict[str, Provider] = {}
        self.names: dict[int, str] = {}
        self.detectors: list = []
        self.server: ServerThread | None = None
        self.virtiofs: list = []  # -- virtio-fs (issue 17): the device servers' tasks, on the 9P server's loop
        self.channel: Channel | None = None
        self.holds = HoldBroker()
        self.door = FsDoor(lambda i: self.providers[self.names[self._ws_index(i)]].fs)  # API writes (remotefs)
        self._early: list[dict] = []  # events before the channel runs (recovery)
        self._hold_ids: dict[str, tuple[int, str]] = {}  # local public hold id -> (directory, core id)
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ events

    def emit(self, event: str, **fields) -> None:
        with self._lock:
            if self.channel is None:
                if len(self._early) < EARLY_EVENTS_MAX:
                    self._early.append({"event": event, **fields})
                return
        try:
            self.channel.send_event(event, **fields)
        except (ConnectionError, ValueError) as e:
            log.warning("could not send %s to the agent: %s", event, e)

    def _core_events(self, i: int):
        def on_event(event: dict) -> None:
            event = jsonable({**event, "directory": i})
            if event.get("type") == "event.safeguard_triggered":
                ws = self.workspaces[i]
                payload = {k: v for k, v in event.items() if k != "type"}
                got = self.holds.register(payload, self.providers[self.names[i]].interceptor.resolve_hold,
                                          timeout_s=ws.safeguard_config.timeout_s)
                if got is not None:
                    with self._lock:
                        self._hold_ids[got["safeguard_id"]] = (i, payload["safeguard_id"])
            self.emit("core", payload=event)

        return on_event

    def _hold_changed(self, kind: str, payload: dict) -> None:
        if kind != "resolved":
            return
        with self._lock:
            where = self._hold_ids.pop(payload.get("safeguard_id"), None)
        if where is not None:
            self.emit("hold_resolved", directory=where[0], hold_id=where[1], action=payload.get("action"),
                      reason=payload.get("reason"))

    # ------------------------------------------------------------------ start

    def open(self) -> None:
        """Step 2 of the module docstring (no thread is started here)."""
        c = self.config
        safeguard = SafeguardConfig(**c["safeguard"]) if c.get("safeguard") else None
        limits = Limits(**c["limits"]) if c.get("limits") else None
        watched = c.get("external_policy") is not None
        for f in c["folders"]:
            i, name = f["index"], f["name"]
            self.names[i] = name
            if f["read_only"]:
                self.providers[name] = Provider.read_only_dir(f["path"], label=f["label"])
                continue
            ws, journal = open_workspace(f["path"], watched=watched, state_dir=f["state_dir"], safeguard=safeguard,
                                         limits=limits, on_event=self._core_events(i))
            self.workspaces[i] = ws
            self.journals[i] = journal
            self.providers[name] = Provider.intercepted(ws, label=f["label"])

    def preload(self) -> None:
        """Load now what the server would load lazily and cannot once confined: the
        watchers' ``inotify_simple`` finds libc with ``ctypes.util.find_library``, which
        runs ``ldconfig`` with a temporary file (no temp directory is writable later)."""
        if self.config.get("external_policy") is not None:
            from inotify_simple import INotify

            INotify().close()

    def confinement_paths(self) -> dict:
        rw, ro = [], []
        for f in self.config["folders"]:
            real = os.path.realpath(f["path"])
            if f["read_only"]:
                ro.append(real)
            else:
                rw += [real, os.path.realpath(f["state_dir"] or default_state_dir(real))]
        return {"read_write": rw, "read_only": ro, "socket_dirs": [self.config["run_dir"]]}

    def serve(self) -> None:
        """Step 4 of the module docstring."""
        c = self.config
        owners = OwnerMap(host_uids=frozenset(c["owners"]["host_uids"]), host_gids=frozenset(c["owners"]["host_gids"]),
                          guest_uid=c["owners"]["guest_uid"], guest_gid=c["owners"]["guest_gid"]) \
            if c.get("owners") else None
        limits = ServerLimits(connections_max=max(ServerLimits().connections_max, int(c.get("connections_max", 0))))
        server = NinePServer(dict(self.providers), ServerConfig(limits, owners=owners), holds=self.holds)
        self.server = ServerThread(server, unix_path=c["socket"]).__enter__()
        for name, path in (c.get("virtiofs") or {}).items():  # -- virtio-fs (issue 17): a device per folder
            self.virtiofs.append(self.server.run(serve_export(server.exports[name], path, limits, owners,
                                                              c.get("virtiofs_direct_io", "write-only")),
                                                 timeout_s=30)[1])
        self.holds.subscribe(self._hold_changed)
        if c.get("external_policy") is not None:
            for i, ws in self.workspaces.items():
                self.detectors.append(watch_workspace(
                    self.journals[i], ws.label,
                    lambda paths, i=i: self.emit("external", directory=i, paths=list(paths)),
                    lambda message, i=i: self.emit("warning", directory=i, message=message)))

    def start_channel(self) -> None:
        ch = Channel(self.sock, handler=self.handle, on_closed=self._channel_closed, name="share-server")
        with self._lock:
            self.channel = ch
            early, self._early = self._early, []
        for e in early:
            ch.send_event(e.pop("event"), **e)
        ch.start()

    def _channel_closed(self, why: str) -> None:
        log.info("control channel closed (%s): stopping", why)
        self._stopped.set()

    # ------------------------------------------------------------------ requests

    def _ws_index(self, i) -> int:
        if i not in self.workspaces:
            raise ValueError(f"no read-write folder {i!r} in this share server")
        return i

    def _ws(self, args: dict):
        ws = self.workspaces.get(args.get("directory"))
        if ws is None:
            raise ValueError(f"no read-write folder {args.get('directory')!r} in this share server")
        return ws

    def handle(self, op: str, args: dict):
        if op == "call":
            method = args.get("method")
            if method not in METHODS:
                raise ValueError(f"no such workspace method: {method!r}")
            return jsonable(getattr(self._ws(args), method)(**args.get("args", {})))
        if op == "get":
            name = args.get("name")
            if name not in PROPERTIES:
                raise ValueError(f"no such workspace property: {name!r}")
            value = getattr(self._ws(args), name)
            return jsonable(value() if callable(value) else value)
        if op in ("fs", "handle"):  # an API client's mutation / open handle (sandbox.serving.remotefs)
            try:
                return jsonable(self.door.fs(args) if op == "fs" else self.door.handle(args))
            except OSError as e:
                if not hasattr(e, "data"):  # the same OSError subclass and errno on the agent's side
                    e.data = {"errno": e.errno, "strerror": e.strerror, "filename": e.filename}
                raise
        if op == "resolve_hold":
            return self._resolve_hold(args)
        if op == "restrict":
            return self._restrict(args)
        if op == "stop":
            self.stop()
            return {}
        if op == "probe_open" and os.environ.get(PROBES_ENV) == "1":
            return probe_open(args["path"])
        raise ValueError(f"unknown request {op!r}")

    def _resolve_hold(self, args: dict) -> dict:
        i, hold_id, action = args["directory"], args["hold_id"], args["action"]
        resolve = self.providers[self.names[i]].interceptor.resolve_hold
        if self.holds.answer_core(resolve, hold_id, action):
            return {"answered": True}
        resolve(hold_id, action)  # KeyError (back to the agent) if the core has no such hold
        return {"answered": True}

    def _restrict(self, args: dict) -> dict:
        exports = self.server.server.exports
        name = args["name"]
        view = args.get("view", "")
        self.server.call(lambda: setattr(exports[name], "provider",
                                         self.providers[name].narrowed(view, bool(args.get("read_only")))))
        return {}

    def stop(self) -> None:
        """Close everything (idempotent enough: each part once)."""
        if self.server is not None:
            self.holds.deny_all()
            server, self.server = self.server, None
            tasks, self.virtiofs = self.virtiofs, []

            async def cancel_all() -> None:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            if tasks:
                server.run(cancel_all(), timeout_s=30)
            server.__exit__(None, None, None)
        for d in self.detectors:
            d.stop()
        self.detectors = []
        self.door.close_all()
        for p in self.providers.values():
            p.close()
        for ws in self.workspaces.values():
            ws.close()
        self.workspaces = {}
        self._stopped.set()

    def wait(self) -> None:
        self._stopped.wait()


class _ForwardLogs(logging.Handler):
    """The child's ``sandbox.*`` records go to the agent as ``log`` events; the agent logs
    them its own way (JSON Lines under ``sandbox serve``), so the child writes nothing to
    the stderr they share. A record logged while one is being sent is dropped (no loop)."""

    def __init__(self, srv: "ShareServer"):
        super().__init__()
        self.srv = srv
        self._sending = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(self._sending, "on", False):
            return
        self._sending.on = True
        try:
            self.srv.emit("log", level=record.levelno, name=record.name, message=record.getMessage()[:4096])
        except Exception:
            pass
        finally:
            self._sending.on = False


def forward_logs(srv: "ShareServer", level) -> None:
    """The ``sandbox`` logger of this process: at the agent's level, to the agent only."""
    logger = logging.getLogger("sandbox")
    logger.setLevel(os.environ.get("SANDBOX_SHARE_LOG") or level)
    logger.addHandler(_ForwardLogs(srv))
    logger.propagate = False


def probe_open(path: str) -> dict:
    """Open ``path`` for reading from inside the server (test builds only): ``{"errno": 0}`` or the error's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return {"errno": e.errno, "error": os.strerror(e.errno)}
    os.close(fd)
    return {"errno": 0}


def read_config(sock: socket.socket) -> dict:
    """The first line on the channel (no thread: read here, before confinement)."""
    reader = LineReader()
    while True:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the agent closed the channel before sending the configuration")
        lines = reader.feed(data)
        if lines:
            if len(lines) > 1:
                raise ValueError("the agent sent more than the configuration before ready")
            return decode_line(lines[0])["config"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sandbox-share-server")
    ap.add_argument("--fd", type=int, required=True)
    a = ap.parse_args(argv)
    # Ctrl-C reaches the terminal's whole process group: the agent cancels its command and
    # stops the session (``stop``); this process ends when told, or when the agent is gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("SANDBOX_SHARE_LOG", "WARNING"), stream=sys.stderr,
                        format="share-server %(levelname)s %(name)s: %(message)s")
    sock = socket.socket(fileno=a.fd)
    srv = None
    try:
        config = read_config(sock)
        srv = ShareServer(config, sock)
        forward_logs(srv, config.get("log_level", logging.WARNING))
        srv.open()
        srv.preload()
        applied = confine(**srv.confinement_paths())
        srv.serve()
    except BaseException as e:
        try:
            sock.sendall(encode_line({"event": "fatal", "type": type(e).__name__, "message": str(e)[:4096]}))
        except OSError:
            pass
        if srv is not None:
            srv.stop()
        log.error("share server failed to start: %s", e)
        return 1
    srv.emit("ready", pid=os.getpid(), landlock_abi=applied.abi, no_new_privs=applied.no_new_privs,
             reason=applied.reason,
             recovery={str(i): jsonable(ws.recovery) for i, ws in srv.workspaces.items()})
    srv.start_channel()
    log.info("serving %d folder(s) on %s (Landlock ABI %s)", len(srv.providers), config["socket"], applied.abi)
    srv.wait()
    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
