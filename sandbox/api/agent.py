"""The host agent behind the STDIO API: one session, every operation of seed 003 §4.5.

:class:`Agent` is transport-free: :meth:`Agent.handle` takes a request's type and payload
(already checked against its schema) and returns the ``ok`` payload or raises
:class:`~sandbox.api.errors.ApiError`; events go to the ``emit`` callback as whole
messages (``{"type": "event.…", "payload": {…}, "request_id"?}``). The STDIO server
(:mod:`sandbox.api.stdio`) and later MCP sit on top of it.

Invariants:

* at most one session; ``session.start``/``stop``/``reset`` are serialised, and every
  other operation sees either no session or a whole one;
* at most one command (``agent.execute``/``agent.prompt``) runs at a time — a second one
  is ``agent.busy`` at once, never queued behind an unbounded wait;
* the events of an operation are emitted before its response is returned (the core emits
  ``event.step_completed`` while the step closes, inside :meth:`Session.run`);
* a ``safeguard.confirm`` answers through the session's hold broker, which tells the undo
  core synchronously, so a deny's rollback is complete when the response is sent;
* file access (``fs.*``) goes through the same providers the guest uses — dir-fd relative,
  no symlink followed, nothing outside a mount; the restricted view only narrows.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import shlex
import threading
from dataclasses import asdict, dataclass  # asdict, not __dict__: a compiled dataclass has none

from .. import __version__
from ..core.safeguard import SafeguardConfig
from ..core.store import Limits
from ..files import READ_FILE_BYTES_MAX, FileService
from ..mounts.table import MountTable, from_docker_style
from ..session.runtime import Folder, LockUnavailable, MemoryMount, Session, SessionError
from . import protocol
from .errors import ApiError, to_api_error
from .messages.bounds import RUNNING_COMMAND_CHARS_MAX
from .payloads import (check_exec_text as _exec_text, decode_data as _decode, default_cwd, diff_in_view, encode_data as _encode,
                       folder_index)

log = logging.getLogger("sandbox.api")

READ_BYTES_MAX = READ_FILE_BYTES_MAX  # per fs.read by path (a handle's read: sandbox.files.READ_CALL_BYTES_MAX)
MEMORY_BYTES_MAX = 256 << 20  # all in-memory mounts together, decoded
FORWARDED_EVENTS = set(protocol.EVENT_NAMES)



@dataclass
class _Running:
    """The session's one running command, whichever client started it (``client``: ``stdio``,
    or ``mcp`` in a shared session): ``agent.cancel`` and ``session.status`` see it here."""

    request_id: object
    cancel: threading.Event
    client: str = "stdio"
    command: str = ""

    def as_dict(self) -> dict:
        return {"request_id": self.request_id, "client": self.client,
                "command": self.command[:RUNNING_COMMAND_CHARS_MAX]}


class Agent:
    def __init__(self, emit, *, guest: str = "vm", progress=None, as_root: bool = False):
        """``emit(message)`` gets every event; ``guest``: ``"vm"``, ``"scripted"`` (tests) or ``"local"``
        (host commands on FUSE mounts, :mod:`sandbox.local`);
        ``as_root``: the default of ``session.start``'s ``as_root`` (``sandbox serve --as-root``)."""
        self.emit = emit
        self.guest = guest
        self.as_root = as_root
        self.progress = progress or (lambda msg: log.info("%s", msg))
        self.session: Session | None = None
        self.view: MountTable | None = None
        self.agent_cfg: dict | None = None
        self.protocol_version = protocol.PROTOCOL_VERSION
        self._lifecycle = threading.RLock()
        self._state_lock = threading.Lock()
        self._running: _Running | None = None
        self._start_payload: dict | None = None
        self._failed: str | None = None
        self.files: FileService | None = None  # this client's file operations (fs.*), made at session.start
        #: called with each session this agent starts or adopts, once it runs (the web page taps its commands)
        self.session_listeners: list = []
        #: request type -> handler(payload, request_id) -> ok payload; exactly the types of protocol.REQUEST_TYPES
        self._dispatch = {
            "hello": self.op_hello,
            "session.start": self.op_session_start,
            "session.stop": self.op_session_stop,
            "session.reset": self.op_session_reset,
            "session.status": self.op_session_status,
            "session.restrict": self.op_session_restrict,
            "undo.rollback": self.op_undo_rollback,
            "undo.history": self.op_undo_history,
            "undo.configure": self.op_undo_configure,
            "undo.discard": self.op_undo_discard,
            "undo.diff": self.op_undo_diff,
            "agent.execute": self.op_agent_execute,
            "agent.prompt": self.op_agent_prompt,
            "agent.cancel": self.op_agent_cancel,
            "fs.list": self.op_fs_list,
            "fs.read": self.op_fs_read,
            "fs.status": self.op_fs_status,
            "fs.open": self.op_fs_open,
            "fs.write": self.op_fs_write,
            "fs.seek": self.op_fs_seek,
            "fs.stat": self.op_fs_stat,
            "fs.close": self.op_fs_close,
            "fs.create_temp": self.op_fs_create_temp,
            "fs.mkdir": self.op_fs_mkdir,
            "fs.remove": self.op_fs_remove,
            "fs.rename": self.op_fs_rename,
            "safeguard.configure": self.op_safeguard_configure,
            "safeguard.confirm": self.op_safeguard_confirm,
            "mount.add": self.op_mount_add,
            "mount.remove": self.op_mount_remove,
        }

    # ------------------------------------------------------------------ dispatch

    def handle(self, type_: str, payload: dict, request_id=None) -> dict:
        """Carry out one request whose payload matched its schema (hence bounded and shallow).
        Integral floats are made ints first: JSON Schema's ``integer`` accepts ``1e9`` and
        ``2.0``, and the handlers count, index and seek with them."""
        fn = self._dispatch.get(type_) if isinstance(type_, str) else None
        if fn is None or type_ not in protocol.REQUEST_TYPES:
            raise ApiError("protocol.unknown_type", f"unknown request type {type_!r}", type=type_,
                           known=sorted(protocol.REQUEST_TYPES))
        try:
            return fn(_integral(payload), request_id)
        except ApiError:
            raise
        except SessionError as e:
            raise ApiError("session.guest_failed", str(e)) from e
        except Exception as e:
            err = to_api_error(e)
            if err.code == "protocol.internal":
                log.exception("request %s (%s) failed", request_id, type_)
            raise err from e

    def event(self, name: str, payload: dict, request_id=None) -> None:
        msg = {"type": name, "payload": payload}
        if request_id is not None:
            msg["request_id"] = request_id
        self.emit(msg)

    # ------------------------------------------------------------------ hello

    def op_hello(self, p: dict, rid) -> dict:
        v = p["protocol_version"]
        if v not in protocol.SUPPORTED_VERSIONS:
            raise ApiError("protocol.unsupported_version",
                           f"protocol version {v} is not supported; this agent speaks {list(protocol.SUPPORTED_VERSIONS)}",
                           requested=v, supported_versions=list(protocol.SUPPORTED_VERSIONS))
        self.protocol_version = v
        return {"protocol_version": v, "supported_versions": list(protocol.SUPPORTED_VERSIONS),
                "agent_version": __version__, "operations": sorted(protocol.REQUEST_TYPES), "events": sorted(protocol.EVENT_NAMES)}

    # ------------------------------------------------------------------ session

    def _require(self) -> Session:
        s = self.session
        if s is None or not s.running:
            raise ApiError("session.not_started", "no session is running: send session.start first")
        return s

    def op_session_start(self, p: dict, rid) -> dict:
        with self._lifecycle:
            if self.session is not None and self.session.running:
                raise ApiError("session.already_started", "a session is already running; stop it first")
            session, restrict = self._build_session(p)
            self.progress("starting the session …")
            try:
                session.start()
            except LockUnavailable as e:
                raise ApiError("session.lock_unavailable", str(e)) from None
            except (SessionError, OSError, ValueError) as e:
                raise ApiError("session.start_failed", f"the session could not start: {e}", reason=str(e)) from None
            self.session = session
            self._start_payload = p
            self.view = session.table
            self.files = FileService(session, self.view, client="stdio")
            self._failed = None
            try:
                if restrict:
                    self._restrict(restrict.get("path"), restrict.get("readonly"))
            except BaseException:  # a bad restrict option: no session is left running
                self._stop()
                raise
            self._started(session)
            return self._describe()

    def adopt(self, session: Session, *, client: str = "ui") -> None:
        """Serve a session someone else started and owns (``sandbox mcp --ui``: the MCP host's):
        its events come here too (chained after its own ``on_event``). The owner stops it;
        :meth:`shutdown` then stops it as well (idempotent), so call it only when the owner has."""
        with self._lifecycle:
            if self.session is not None and self.session.running:
                raise ApiError("session.already_started", "a session is already running; stop it first")
            own = session.on_event

            def on_event(e: dict) -> None:
                if own is not None:
                    own(e)
                self._on_core_event(e)

            session.on_event = on_event
            self.session = session
            self.view = session.table
            self.files = FileService(session, self.view, client=client)
            self._failed = None
            self._started(session)

    def _started(self, session: Session) -> None:
        for fn in list(self.session_listeners):
            try:
                fn(session)
            except Exception:
                log.exception("a session listener failed")

    def running_client(self) -> str | None:
        """Who runs the session's current command (``stdio``, ``mcp``), or None."""
        r = self._running
        return r.client if r is not None else None

    def _build_session(self, p: dict) -> tuple[Session, dict | None]:
        def bad(msg: str, field: str):
            return ApiError("session.invalid_config", msg, field=field)

        wds = list(p.get("working_directories") or [])
        binds = [m for m in p.get("mounts") or [] if "source" in m]
        memory = [m for m in p.get("mounts") or [] if "files" in m]
        if "root" in p:
            if wds:
                raise bad("give either working_directories or root (with bind mounts), not both", "root")
            wds = from_docker_style(p["root"], readonly=p.get("readonly", False),
                                    mounts=[dict(source=m["source"], target=m["target"], readonly=m.get("readonly", False))
                                            for m in binds],
                                    root_target=p.get("root_target", "/mnt/working/0"))
        elif binds:
            raise bad("bind mounts ({source, target}) need root; list extra folders in working_directories", "mounts")
        elif "readonly" in p or "root_target" in p:
            raise bad("readonly and root_target go with root", "root")
        if not wds:
            raise bad("no working directory: give working_directories or root", "working_directories")
        folders = []
        for i, wd in enumerate(wds):
            path = wd["path"]
            if not os.path.isabs(path):
                raise bad(f"working_directories[{i}].path must be absolute: {path!r}", f"working_directories[{i}].path")
            if not os.path.isdir(path):
                raise bad(f"working_directories[{i}].path {path!r} does not exist or is not a directory",
                          f"working_directories[{i}].path")
            folders.append(Folder(path, read_only=wd.get("access", "read_write") == "read_only", target=wd.get("target"),
                                  label=wd.get("label", ""), state_dir=wd.get("state_dir")))
        rw = [(os.path.realpath(f.path), i) for i, f in enumerate(folders) if not f.read_only]
        for a, i in rw:
            for b, j in rw:
                if i < j and (a == b or _within(b, a) or _within(a, b)):
                    raise bad(f"read-write working directories {i} ({a}) and {j} ({b}) overlap: their undo logs would "
                              "both claim the same files (make one read_only, or give only the outer one)",
                              "working_directories")
        mem, total = [], 0
        for j, m in enumerate(memory):
            files = {}
            for rel, b64 in m["files"].items():
                try:
                    data = base64.b64decode(b64, validate=True)
                except (binascii.Error, ValueError):
                    raise bad(f"mounts[{j}].files[{rel!r}] is not valid base64", f"mounts[{j}].files") from None
                total += len(data)
                if total > MEMORY_BYTES_MAX:
                    raise bad(f"in-memory mounts exceed {MEMORY_BYTES_MAX} bytes in total", "mounts")
                files[rel] = data
            mem.append(MemoryMount(m["path"], files, writable=m.get("writable", False), label=m.get("label", "")))
        sg = p.get("safeguard") or {}
        limits = p.get("undo_limits") or {}
        if "agent" in p:
            self.agent_cfg = dict(p["agent"])
        else:
            self.agent_cfg = None
        try:
            session = Session(
                folders, network=p.get("network_policy", "disabled"), allow=p.get("network_allowlist"),
                vm_mode=p.get("vm_mode", "ephemeral"), memory_mb=p.get("memory_mb", 1024), cpus=p.get("cpus", 2),
                safeguard=self._safeguard_config(SafeguardConfig(), sg), limits=Limits(**self._limits(limits)) if limits else None,
                on_event=self._on_core_event, progress=self.progress, mounts=mem,
                python_path=p.get("python_path"), external_policy=p.get("external_modification_policy", "barrier"),
                guest=p.get("guest", self.guest), as_root=p.get("as_root", self.as_root),
                guest_root=p.get("guest_root", "host-usr"), guest_packages=p.get("guest_packages"),
                share=p.get("share"), virtiofs_direct_io=p.get("virtiofs_direct_io") or "write-only")
        except ApiError:
            raise
        except Exception as e:  # the mount table's own codes stand; anything else is the payload's fault
            err = to_api_error(e)
            raise (err if err.code.startswith("session.") else ApiError("session.invalid_config", str(e))) from None
        return session, p.get("restrict")

    def _describe(self) -> dict:
        s = self.session
        st = s.status()
        return {"folders": self._folders(s), "mounts": st["mounts"], "guest": st["guest"], "accel": st["accel"],
                "accel_reason": st["accel_reason"], "boot_s": st["boot_s"], "view": self.view.view,
                "read_only": self.view.read_only, "python_path": st["python_path"],
                "external_modification_policy": st["external_modification_policy"]}

    def _folders(self, s: Session, store: bool = False) -> list[dict]:
        """``store``: with each undo store's size and limits (``session.status``)."""
        out = []
        for i, (f, m) in enumerate(zip(s.folders, s.table.folders)):
            ws = s.workspaces[i] if s.running else None
            out.append({"index": i, "label": m.label, "path": os.path.realpath(f.path), "guest_path": m.target,
                        "access": "read_only" if f.read_only else "read_write",
                        "undo_available": bool(ws is not None and ws.undo_available)})
            if store and ws is not None and ws.undo_available:
                out[-1]["undo_store"] = {"size_bytes": ws.store_size_bytes, **asdict(ws.limits)}
        return out

    def op_session_stop(self, p: dict, rid) -> dict:
        with self._lifecycle:
            self._require()
            self._stop()
            return {}

    def _stop(self) -> None:
        s, self.session = self.session, None
        self.view = None
        files, self.files = self.files, None
        if files is not None:
            files.close_all()
        self._deny_all_holds(s)
        if s is not None:
            s.stop()

    def cancel_running(self) -> None:
        """Cancel the running command (if any) and deny every pending safeguard."""
        r = self._running
        if r is not None:
            r.cancel.set()
        self._deny_all_holds()

    def shutdown(self) -> None:
        """The client went away: cancel what runs, stop the session."""
        self.cancel_running()
        with self._lifecycle:
            self._stop()

    def op_session_reset(self, p: dict, rid) -> dict:
        """Destroy a persistent VM and start the same session again on a fresh one."""
        with self._lifecycle:
            s = self._require()
            payload = self._start_payload
            self._stop()
            s.reset()
            return self.op_session_start(payload, rid)

    def op_session_status(self, p: dict, rid) -> dict:
        s = self.session
        if s is None or not s.running:
            return {"state": "not_started", "vm": "stopped", "guest": None,
                    "accel": None, "folders": [], "mounts": [], "running": None, "pending_safeguards": []}
        st = s.status()
        r = self._running
        state = "running" if r is not None else "idle"
        if self._failed is not None:
            state = "error"
        elif not st["vm"].startswith("running") and st["vm"] != "paused":
            state = "stopped" if st["vm"] == "stopped" else "error"
        return {"state": state, "vm": st["vm"], "guest": st["guest"], "accel": st["accel"],
                "accel_reason": st["accel_reason"], "boot_s": st["boot_s"], "network": st["network"],
                "vm_mode": st["vm_mode"], "as_root": st["as_root"], "guest_root": st["guest_root"],
                "folders": self._folders(s, store=True), "mounts": st["mounts"],
                "running": None if r is None else r.as_dict(),
                "pending_safeguards": s.holds.pending(),
                "view": self.view.view, "read_only": self.view.read_only, "filesystem_backend": s.share,
                "virtiofs_direct_io": st["virtiofs_direct_io"],
                "external_modification_policy": st["external_modification_policy"],
                "files": self.files.counters() if self.files is not None else None}

    def op_session_restrict(self, p: dict, rid) -> dict:
        self._require()
        self._restrict(p.get("path"), p.get("readonly"))
        return {"view": self.view.view, "read_only": self.view.read_only}

    def _restrict(self, path: str | None, readonly: bool | None) -> None:
        """Narrow the view (seed 004) — for the API's file access and for the guest: every
        share hides what is outside the view (EACCES) and, if read-only, refuses writes (EROFS).
        Nothing is mutated: the guest's exports and this client's files get new narrowed providers."""
        view = self.view.restrict(path, readonly)
        self.session.restrict(view)
        self.files.narrow(view)
        self.view = view

    # ------------------------------------------------------------------ directories

    def _directory(self, key) -> int:
        return folder_index(self._require().table, self.view, key)

    def _workspace(self, key):
        s = self._require()
        i = self._directory(key)
        ws = s.workspaces[i]
        if ws is None:
            raise ApiError("session.read_only_directory", f"working directory {i} is read-only: it has no undo history",
                           directory=i)
        return i, ws

    # ------------------------------------------------------------------ undo

    def op_undo_rollback(self, p: dict, rid) -> dict:
        s = self._require()
        if self.view.read_only:
            raise ApiError("fs.access_denied", "the session's view is read-only: undo would write")
        i, ws = self._workspace(p.get("directory"))
        force = p.get("force", False)
        if force:
            log.warning("rollback forced across barriers in folder %d: external edits will be lost", i)
        result = s.undo(p.get("count", 1), force=force, folder=i)
        log.info("rolled back step(s) %s of folder %d: %d path(s) restored", result["step_ids"], i,
                 result["paths_restored"], extra={"component": "undo"})
        return {**result, "directory": i, "forced": force}

    def op_undo_history(self, p: dict, rid) -> dict:
        i, ws = self._workspace(p.get("directory"))
        if not ws.undo_available:
            return {"directory": i, "steps": [], "barriers": [], "undo_available": False}
        steps = ws.history()
        limit = p.get("limit")
        if limit is not None:
            steps = steps[:limit]
        seq_to_id = {st["seq"]: st["id"] for st in steps}
        barriers = []
        for b in ws.barriers():
            blocked = [sid for seq, sid in seq_to_id.items() if seq <= b.get("after_seq", -1)]
            barriers.append({"id": b["id"], "paths": b["paths"], "created_ns": b["created_ns"], "reason": b.get("reason", ""),
                             "after_seq": b.get("after_seq"), "blocks_rollback_of": sorted(blocked),
                             "note": "rollback of the listed steps is refused unless force is true"})
        return {"directory": i, "steps": steps, "barriers": barriers, "undo_available": True}

    def op_undo_diff(self, p: dict, rid) -> dict:
        """What a step changed, preimage vs now (:func:`sandbox.api.payloads.diff_in_view`):
        reads only; a restricted view sees only the paths inside it."""
        i, ws = self._workspace(p.get("directory"))
        return {**diff_in_view(ws, p.get("step_id"), self.view, self._require().table.folders[i]), "directory": i}

    def op_undo_configure(self, p: dict, rid) -> dict:
        i, ws = self._workspace(p.get("directory"))
        limits = self._limits(p)
        try:
            ws.configure_limits(**limits)
        except (TypeError, ValueError) as e:
            raise ApiError("undo.invalid_limits", str(e)) from None
        return {"directory": i, "limits": asdict(ws.limits)}

    @staticmethod
    def _limits(p: dict) -> dict:
        return {k: v for k, v in p.items() if k in protocol.UNDO_LIMIT_FIELDS}

    def op_undo_discard(self, p: dict, rid) -> dict:
        i, ws = self._workspace(p.get("directory"))
        ws.discard()
        return {"directory": i}

    # ------------------------------------------------------------------ commands

    def op_agent_execute(self, p: dict, rid) -> dict:
        return self._run(rid, p["command"], p.get("cwd"), p.get("env"), "event.terminal_output")

    def op_agent_prompt(self, p: dict, rid) -> dict:
        self._require()
        cfg = self.agent_cfg
        if not cfg:
            raise ApiError("agent.not_configured",
                           "no coding agent is configured: give session.start an agent: {command: …}; "
                           "the prompt is passed as its last argument and in $SANDBOX_PROMPT")
        env = {**cfg.get("env", {}), "SANDBOX_PROMPT": p["text"]}
        return self._run(rid, f"{cfg['command']} {shlex.quote(p['text'])}", cfg.get("cwd"), env, "event.agent_output")

    def op_agent_cancel(self, p: dict, rid) -> dict:
        r = self._running
        if r is None or ("request_id" in p and p["request_id"] != r.request_id):
            raise ApiError("agent.not_running", "no command is running" + (
                f" for request {p['request_id']!r}" if "request_id" in p else ""))
        r.cancel.set()
        return {"cancelled": True}

    def _run(self, rid, command: str, cwd: str | None, env: dict | None, output_event: str) -> dict:
        s = self._require()
        _exec_text("$.payload.command", command)
        for name, value in (env or {}).items():
            _exec_text("$.payload.env", name, env_name=True)
            _exec_text(f"$.payload.env.{name}", value)
        if cwd is not None:
            _exec_text("$.payload.cwd", cwd)
        running = self.claim_command(rid, threading.Event(), "stdio", command)
        try:
            if cwd is None:
                cwd = self._default_cwd()
            else:
                self.view.resolve(cwd)  # inside the view (raises otherwise)

            def on_output(stream: str, text: str) -> None:
                self.event(output_event, {"stream": stream if stream in ("stdout", "stderr") else "stdout", "data": text},
                           request_id=rid)

            try:
                r = s.run(command, on_output, cwd=cwd, env=env, cancel=running.cancel)
            except SessionError as e:
                self._failed = str(e)
                log.error("the guest failed: %s", e, extra={"component": "session"})
                self.event("event.error", {"message": str(e), "code": "session.guest_failed"}, request_id=rid)
                raise ApiError("session.guest_failed", f"the guest failed while running the command: {e}") from None
            return {"step_id": r.step_id, "step_ids": r.step_ids, "exit_code": r.exit_code, "signal": r.signal,
                    "cancelled": r.cancelled}
        finally:
            self.release_command(running)

    def claim_command(self, request_id, cancel: threading.Event, client: str, command: str) -> _Running:
        """Make a command the session's one running command, so ``agent.cancel`` (``cancel`` is
        set) and ``session.status.running`` reach it — the frontend's own, or an MCP client's in
        a shared session (:class:`~sandbox.api.mcp.shared.SharedSessionHost`). ``agent.busy``
        (data: the running one's request_id) while another runs. Pair with :meth:`release_command`."""
        with self._state_lock:
            if self._running is not None:
                raise ApiError("agent.busy", "a command is already running; one runs at a time",
                               request_id=self._running.request_id)
            self._running = r = _Running(request_id, cancel, client, command)
        return r

    def release_command(self, running: _Running) -> None:
        """The command ``running`` has ended (idempotent)."""
        with self._state_lock:
            if self._running is running:
                self._running = None

    def _default_cwd(self) -> str:
        return default_cwd(self.view)

    # ------------------------------------------------------------------ files

    def _files(self) -> FileService:
        self._require()
        return self.files

    def op_fs_list(self, p: dict, rid) -> dict:
        return self._files().list(p.get("path", ""), p.get("directory"))

    def op_fs_read(self, p: dict, rid) -> dict:
        """By ``path`` (one-shot, a range of the file) or by ``handle`` (at its position)."""
        files = self._files()
        encoding = p.get("encoding", "utf-8")
        if "handle" in p:
            data = files.read(p["handle"], p.get("length", -1))
            text, encoding = _encode(data, encoding)
            return {"handle": p["handle"], "data": text, "encoding": encoding, "bytes": len(data), "eof": not data}
        want = p.get("length")
        if want is not None and want > READ_BYTES_MAX:
            raise ApiError("fs.too_large", f"at most {READ_BYTES_MAX} bytes per fs.read", limit_bytes=READ_BYTES_MAX)
        offset = p.get("offset", 0)
        guest, size, data = files.read_range(p["path"], offset, want, p.get("directory"))
        text, encoding = _encode(data, encoding)
        return {"path": guest, "size": size, "offset": offset, "data": text, "encoding": encoding,
                "eof": offset + len(data) >= size}

    def op_fs_status(self, p: dict, rid) -> dict:
        return self._files().status(p.get("directory"))

    def op_fs_open(self, p: dict, rid) -> dict:
        files = self._files()
        guest = files.guest_path(p["path"], p.get("directory"))
        h = files.open(guest, p.get("mode", "r"))
        return {"handle": h, "path": guest, "mode": p.get("mode", "r")}

    def op_fs_write(self, p: dict, rid) -> dict:
        """By ``handle`` (at its position) or by ``path`` (create or replace the file: one API step)."""
        files = self._files()
        data = _decode(p["data"], p.get("encoding", "utf-8"))
        if "handle" in p:
            n = files.write(p["handle"], data)
            return {"handle": p["handle"], "bytes_written": n}
        guest = files.write_file(p["path"], data, p.get("directory"))
        return {"path": guest, "bytes_written": len(data)}

    def op_fs_seek(self, p: dict, rid) -> dict:
        whence = {"set": 0, "cur": 1, "end": 2}[p.get("whence", "set")]
        return {"handle": p["handle"], "position": self._files().seek(p["handle"], p["offset"], whence)}

    def op_fs_stat(self, p: dict, rid) -> dict:
        files = self._files()
        if "handle" in p:
            return {"handle": p["handle"], **files.stat(p["handle"])}
        return files.stat(p["path"], p.get("directory"))

    def op_fs_close(self, p: dict, rid) -> dict:
        self._files().close(p["handle"])
        return {"handle": p["handle"]}

    def op_fs_create_temp(self, p: dict, rid) -> dict:
        return {"handle": self._files().create_temp()}

    def op_fs_mkdir(self, p: dict, rid) -> dict:
        return {"path": self._files().mkdir(p["path"], p.get("parents", False), p.get("directory"))}

    def op_fs_remove(self, p: dict, rid) -> dict:
        files = self._files()
        guest = files.guest_path(p["path"], p.get("directory"))
        return {"path": guest, "removed": files.remove(guest, p.get("recursive", False))}

    def op_fs_rename(self, p: dict, rid) -> dict:
        return {"path": self._files().rename(p["src"], p["dst"], p.get("directory"))}

    # ------------------------------------------------------------------ safeguards

    def op_safeguard_configure(self, p: dict, rid) -> dict:
        s = self._require()
        keys = {k: v for k, v in p.items() if k != "directory"}
        targets = [self._workspace(p["directory"])] if "directory" in p else \
            [(i, ws) for i, ws in enumerate(s.workspaces) if ws is not None]
        config = None
        for _i, ws in targets:
            config = self._safeguard_config(ws.safeguard_config, keys)
            ws.configure_safeguard(**asdict(config))
        if config is None:
            config = self._safeguard_config(SafeguardConfig(), keys)
        s.safeguard = config
        return {"config": _safeguard_out(config)}

    @staticmethod
    def _safeguard_config(base: SafeguardConfig, p: dict) -> SafeguardConfig:
        values = asdict(base)
        for k, v in p.items():
            values["timeout_s" if k == "timeout_seconds" else k] = v
        try:
            return SafeguardConfig(**values)
        except (TypeError, ValueError) as e:
            raise ApiError("safeguard.invalid_config", str(e)) from None

    def op_safeguard_confirm(self, p: dict, rid) -> dict:
        sid, action = p["safeguard_id"], p["action"]
        s = self.session
        # the broker tells the undo core before it returns: a deny's rollback is done here, before we answer
        if s is None or not s.running or not self._answer(s, sid, action):
            raise ApiError("safeguard.unknown_id", f"no pending safeguard {sid!r} (answered, timed out, or unknown)",
                           safeguard_id=sid)
        log.info("safeguard %s: %s", sid, action, extra={"component": "safeguard"})
        return {"safeguard_id": sid, "action": action}

    @staticmethod
    def _answer(s: Session, sid: str, action: str) -> bool:
        return s.holds.answer(sid, action)

    def _deny_all_holds(self, s: Session | None = None) -> None:
        s = s if s is not None else self.session
        if s is not None:
            s.holds.deny_all("cancelled" if s is self.session else "stopped")

    # ------------------------------------------------------------------ core events

    def _on_core_event(self, e: dict) -> None:
        """Events from the undo core and the watcher (any thread) → API events."""
        e = dict(e)
        name = e.pop("type", None)
        if name not in FORWARDED_EVENTS:
            log.debug("core event %s not forwarded", name)
            return
        if name == "event.safeguard_triggered":  # the session registered it with its hold broker already
            log.info("safeguard %s triggered: %s", e["safeguard_id"], e.get("message"),
                     extra={"component": "safeguard", "step_id": e.get("step_id")})
        elif name == "event.recovery":
            e.setdefault("paths_restored", 0)
            e.setdefault("message", f"a crashed session's step was rolled back ({e.get('kind', 'recovery')})")
        elif name == "event.step_completed":
            e.pop("paths", None)
            log.info("step %s committed: %d path(s), exit code %s", e.get("step_id"), e.get("paths_count", 0),
                     e.get("exit_code"), extra={"component": "undo", "step_id": e.get("step_id")})
        self.event(name, e)


    # ------------------------------------------------------------------ live mounts (seed 000)
    # mount.add / mount.remove: in-memory trees mounted into the running guest (Session.mount)

    def op_mount_add(self, p: dict, rid) -> dict:
        s = self._require()
        files, total = {}, 0
        for rel, b64 in p["files"].items():
            try:
                data = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError("protocol.invalid_request", f"files[{rel!r}] is not valid base64",
                               path=f"$.files[{rel!r}]") from None
            total += len(data)
            if total > MEMORY_BYTES_MAX:
                raise ApiError("protocol.invalid_request", f"the mount exceeds {MEMORY_BYTES_MAX} bytes", path="$.files")
            files[rel] = data
        try:
            m = s.mount(p["path"], files, writable=p.get("writable", False), label=p.get("label", ""))
        except ValueError as e:  # a bad file path in the tree (MountError has its own code)
            raise ApiError("session.invalid_mounts", str(e)) from None
        self._view_follows_table(s)
        mounts = s.status()["mounts"]
        return {"mount": next(x for x in mounts if x["live"] and x["guest_path"] == m.target), "mounts": mounts}

    def op_mount_remove(self, p: dict, rid) -> dict:
        s = self._require()
        s.unmount(p["path"])
        self._view_follows_table(s)
        return {"mounts": s.status()["mounts"]}

    def _view_follows_table(self, s: Session) -> None:
        """The API's view keeps its subtree and read-only flag over the session's new table."""
        if self.view is not None:
            sub = None if self.view.view == "/" else self.view.view
            self.view = s.table.restrict(sub, self.view.read_only)
            if self.files is not None:
                self.files.narrow(self.view)  # the same narrowing over the new table: a live mount is reachable


def _integral(value):
    """``value`` with every integral float an int (see :meth:`Agent.handle`)."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def _safeguard_out(c: SafeguardConfig) -> dict:
    return {"delete_threshold": c.delete_threshold, "overwrite_threshold": c.overwrite_threshold,
            "overwrite_size_bytes": c.overwrite_size_bytes, "rename_over_threshold": c.rename_over_threshold,
            "timeout_seconds": c.timeout_s}


def _within(path: str, prefix: str) -> bool:
    """Guest path ``path`` is ``prefix`` or below it (whole components)."""
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")
