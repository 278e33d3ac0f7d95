"""The agent's side of a share-server process: :class:`ShareProcess` and :class:`RemoteWorkspace`.

:class:`ShareProcess` starts ``python -m sandbox.serving.shareserver`` through the spawner
thread (:func:`sandbox.lifeline.run_in_spawner`, ``PR_SET_PDEATHSIG``: it dies with the
agent), hands it one end of a socketpair as its control channel, sends the configuration
and waits (at most :data:`~sandbox.limits.SHARE_SERVER_START_TIMEOUT_S`) for ``ready``.

:class:`RemoteWorkspace` has the method and property names of
:class:`~sandbox.core.workspace.Workspace` that the session, the STDIO agent, the file
service and the SDK use; each is one request on the channel, and the undo core's
exceptions come back as the same classes (:func:`raise_remote`), so error codes do not
change with the process boundary.

Events from the child are handled on one thread of their own, in order (never on the
channel's reader thread: a handler may itself make requests, whose replies that reader
delivers); at most :data:`SHARE_EVENTS_QUEUED_MAX` wait — more are dropped and logged.

Failure: when the channel closes without :meth:`ShareProcess.stop` (the child died, or
broke the framing), ``on_died(reason)`` is called once and every later request raises
``dead_error`` (the session passes its ``SessionError``).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from typing import Callable

from ..core import errors as core_errors
from ..core.safeguard import Hold, SafeguardConfig
from ..core.store import Limits
from ..lifeline import child_setup, run_in_spawner
from ..limits import CONTROL_REPLY_TIMEOUT_S, SHARE_SERVER_START_TIMEOUT_S
from .channel import Channel, ChannelClosed, RemoteError, encode_line

log = logging.getLogger("sandbox.shareserver")
SHARE_EVENTS_QUEUED_MAX = 10_000  # child events not yet handled; more are dropped (logged)
STOP_TIMEOUT_S = 30.0  # the child closing its workspaces after "stop"; then it is killed
#: an ordered request's reply waits at most this for the events the child sent before it to be
#: handled (so ``event.step_completed`` comes before ``run`` returns, as in thread mode); then
#: it returns anyway (logged)
EVENTS_ORDER_WAIT_S = 30.0

#: the undo core's exceptions a reply may name, rebuilt as themselves
_CORE_ERRORS = {name: getattr(core_errors, name) for name in
                ("NothingToUndo", "NoSuchStep", "UndoUnavailable", "BarrierInTheWay", "ExternalChange", "StepUnprotected",
                 "CorruptStep", "StepError", "UndoError", "SandboxError")}
_BUILTIN_ERRORS = {"ValueError": ValueError, "RuntimeError": RuntimeError, "KeyError": KeyError,
                   "TypeError": TypeError, "FileNotFoundError": FileNotFoundError, "PermissionError": PermissionError}


def hold_of(d: dict) -> Hold:
    """A :class:`Hold` from its ``as_dict()`` (times are the child's business: zero here)."""
    return Hold(d["safeguard_id"], d["step_id"], d["kind"], d["count"], d["path"], list(d["sample_paths"]), 0.0, 0.0)


def raise_remote(e: RemoteError):
    """Raise what the child's handler raised, as the same class where it is one we know."""
    if e.type in _CORE_ERRORS:
        raise _CORE_ERRORS[e.type](e.message, **e.data) from None
    if e.type == "RollbackIncomplete":
        raise core_errors.RollbackIncomplete(e.message, e.data.pop("errno", None), **e.data) from None
    if e.type == "SafeguardDenied":
        raise core_errors.SafeguardDenied(e.message) from None
    if e.type == "HoldRequired":  # an API write held by the child's core: the caller denies it
        raise core_errors.HoldRequired(hold_of(e.data)) from None
    if isinstance(e.data.get("errno"), int) and "strerror" in e.data:  # the same OSError subclass
        raise OSError(e.data["errno"], e.data["strerror"] or e.message, e.data.get("filename")) from None
    if e.type in _BUILTIN_ERRORS:
        raise _BUILTIN_ERRORS[e.type](e.message) from None
    if e.type == "OSError":
        raise OSError(e.data.get("errno"), e.message) from None
    raise e


def child_env(env) -> dict:
    """The child's environment: ``env`` with the directory this ``sandbox`` package is in
    first on ``PYTHONPATH``. The child runs with ``-P`` (the agent's working directory is
    not on its path, so not among the paths confinement keeps readable), and an editable
    install's import hook is not a ``sys.path`` entry — this makes the package's own
    directory one, so it stays importable (readable) once the child is confined."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": here + (os.pathsep + rest if rest else "")}


class ShareProcess:
    """One confined share-server child and its control channel (module docstring)."""

    def __init__(self, config: dict, *, on_event: Callable[[dict], None], on_died: Callable[[str], None],
                 dead_error: type[Exception] = RuntimeError, env: dict | None = None):
        self.config = config
        self.on_event = on_event
        self.on_died = on_died
        self.dead_error = dead_error
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self.ready: dict | None = None
        self.died: str | None = None
        self._stopping = False
        self._ready = threading.Event()
        self._events: queue.Queue = queue.Queue(SHARE_EVENTS_QUEUED_MAX)
        self._events_thread: threading.Thread | None = None
        self.events_dropped = 0
        self._events_in = 0  # events queued (by the channel's reader, in the order received)
        self._events_done = 0  # … and handled
        self._events_cond = threading.Condition()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> dict:
        """Spawn, configure, wait for ``ready``; returns its payload. On failure nothing is left."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            theirs.set_inheritable(True)
            fd = theirs.fileno()
            parent = os.getpid()
            env = child_env(os.environ if self.env is None else self.env)
            self.proc = run_in_spawner(lambda: subprocess.Popen(
                [sys.executable, "-P", "-m", "sandbox.serving.shareserver", "--fd", str(fd)], pass_fds=(fd,),
                preexec_fn=child_setup(parent), env=env, stdin=subprocess.DEVNULL))
        except BaseException:
            ours.close()
            theirs.close()
            raise
        theirs.close()
        self.channel = Channel(ours, on_event=self._queue_event, on_closed=self._closed, name="share-server")
        self._events_thread = threading.Thread(target=self._event_loop, name="share-server-events", daemon=True)
        self._events_thread.start()
        try:
            ours.sendall(encode_line({"event": "config", "config": self.config}))
            self.channel.start()
            if not self._ready.wait(SHARE_SERVER_START_TIMEOUT_S):
                raise self.dead_error(f"the share server was not ready within {SHARE_SERVER_START_TIMEOUT_S:g} s")
            if self.ready is None:
                raise self.dead_error(f"the share server failed to start: {self.died}")
            return self.ready
        except BaseException:
            self.stop()
            raise

    # ------------------------------------------------------------------ events

    def _queue_event(self, msg: dict) -> None:
        kind = msg.get("event")
        if kind == "ready":
            self.ready = msg
            self._ready.set()
            return
        if kind == "log":  # the child's log record, logged here the agent's way (shareserver.forward_logs)
            name = str(msg.get("name") or "")
            level = msg.get("level")
            logging.getLogger(name if name.startswith("sandbox") else "sandbox.shareserver").log(
                level if isinstance(level, int) else logging.WARNING, "share server: %s", msg.get("message"))
            return
        if kind == "fatal":
            self.died = f"{msg.get('type')}: {msg.get('message')}"
            self._ready.set()
            return
        try:
            with self._events_cond:
                self._events.put_nowait(msg)
                self._events_in += 1
        except queue.Full:
            self.events_dropped += 1
            log.warning("share server event dropped (%d queued: SHARE_EVENTS_QUEUED_MAX): %s",
                        SHARE_EVENTS_QUEUED_MAX, kind)

    def _event_loop(self) -> None:
        while True:
            msg = self._events.get()
            if msg is None:
                return
            try:
                self.on_event(msg)
            except Exception:
                log.exception("share server event %s: handler failed", msg.get("event"))
            finally:
                with self._events_cond:
                    self._events_done += 1
                    self._events_cond.notify_all()

    def _closed(self, why: str) -> None:
        if self.died is None:
            self.died = why
        self._ready.set()
        if self._stopping:
            return
        code = self.proc.poll() if self.proc is not None else None
        reason = f"the share server process exited ({'status ' + str(code) if code is not None else why})"
        log.error("%s", reason)
        self.died = reason
        self._events.put(None)
        try:
            self.on_died(reason)
        except Exception:
            log.exception("on_died failed")

    # ------------------------------------------------------------------ requests

    def request(self, op: str, args: dict | None = None, timeout_s: float = CONTROL_REPLY_TIMEOUT_S, *,
                ordered: bool = False):
        """One request; ``ordered``: return only once the events the child sent before the reply
        are handled (at most :data:`EVENTS_ORDER_WAIT_S`; never on the events thread itself)."""
        if self.channel is None or (self.died is not None and not self._stopping):
            raise self.dead_error(self.died or "the share server is not running")
        try:
            try:
                return self.channel.request(op, args, timeout_s=timeout_s)
            finally:
                if ordered:
                    self._wait_events_before()
        except ChannelClosed:
            raise self.dead_error(self.died or "the share server's channel is closed") from None
        except RemoteError as e:
            raise_remote(e)

    def _wait_events_before(self) -> None:
        if threading.current_thread() is self._events_thread:
            return  # a handler's own request: the events after it wait for it
        with self._events_cond:
            target = self._events_in  # every event received before the reply (the reader's order)
            if not self._events_cond.wait_for(lambda: self._events_done >= target or self.died is not None,
                                              EVENTS_ORDER_WAIT_S):
                log.warning("share server events not handled within %g s (EVENTS_ORDER_WAIT_S): replying anyway",
                            EVENTS_ORDER_WAIT_S)

    def stop(self) -> None:
        """Ask the child to close everything, wait for it (then kill it); idempotent."""
        if self._stopping:
            return
        self._stopping = True
        ch, proc = self.channel, self.proc
        if ch is not None and not ch.closed and self.ready is not None:
            try:
                ch.request("stop", timeout_s=STOP_TIMEOUT_S)
            except Exception as e:
                log.warning("the share server did not stop cleanly: %s", e)
        if ch is not None:
            ch.close("stopped")
        if proc is not None:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if ch is not None:
            ch.join(5)
            ch.sock.close()
        self._events.put(None)

    # ------------------------------------------------------------------ test probes

    def probe_open(self, path: str) -> dict:
        """Open ``path`` inside the child (only with ``SANDBOX_TEST_PROBES=1`` in its environment)."""
        return self.request("probe_open", {"path": path})


class RemoteWorkspace:
    """A :class:`~sandbox.core.workspace.Workspace` in a share-server process, by the names
    callers use (module docstring). ``directory``: the folder's index in the session."""

    def __init__(self, share: ShareProcess, directory: int, label: str, recovery=None):
        self.share = share
        self.directory = directory
        self.label = label
        self.recovery = recovery

    def _call(self, method: str, **args):
        """A workspace method: its reply comes after the events it caused (``ordered``)."""
        return self.share.request("call", {"directory": self.directory, "method": method, "args": args}, ordered=True)

    def _get(self, name: str):
        return self.share.request("get", {"directory": self.directory, "name": name})

    # -- steps
    def begin_step(self, command: str, type: str = "command") -> int:
        return self._call("begin_step", command=command, type=type)

    def complete_step(self, step_id: int, exit_code: int | None) -> None:
        self._call("complete_step", step_id=step_id, exit_code=exit_code)

    def close_step(self, step_id: int, exit_code: int | None, drain_s: float | None = None) -> bool:
        args = {"step_id": step_id, "exit_code": exit_code}
        if drain_s is not None:
            args["drain_s"] = drain_s
        return self._call("close_step", **args)

    def close_active(self) -> None:
        self._call("close_active")

    def poll(self) -> None:
        self._call("poll")

    # -- undo
    def rollback(self, n: int = 1, force: bool = False) -> dict:
        return self._call("rollback", n=n, force=force)

    def history(self) -> list[dict]:
        return self._call("history")

    def step_diff(self, step_id: int | None = None) -> dict:
        """Computed in the child, where the store is; a result over the control line's limit
        (diff text of ~1 MiB) is refused with ``channel.line_too_long``."""
        return self._call("step_diff", step_id=step_id)

    def barriers(self) -> list[dict]:
        return self._call("barriers")

    def record_external_modification(self, paths: list[str], reason: str = "external modification") -> dict:
        return self._call("record_external_modification", paths=list(paths), reason=reason)

    def finish_pending(self) -> dict | None:
        return self._call("finish_pending")

    def discard(self) -> None:
        self._call("discard")

    # -- safeguards and limits
    def configure_safeguard(self, **config) -> None:
        self._call("configure_safeguard", **config)

    def configure_limits(self, **limits) -> None:
        self._call("configure_limits", **limits)

    def resolve_hold(self, hold_id: str, action: str) -> dict:
        """Answer a hold of this folder in the child (its held 9P request goes on or fails);
        KeyError if the child's core has no such hold pending."""
        if action not in ("allow", "deny"):
            raise ValueError("action must be 'allow' or 'deny'")
        return self.share.request("resolve_hold", {"directory": self.directory, "hold_id": hold_id, "action": action})

    @property
    def safeguard_config(self) -> SafeguardConfig:
        return SafeguardConfig(**self._get("safeguard_config"))

    @property
    def limits(self) -> Limits:
        return Limits(**self._get("limits"))

    @property
    def pending_hold(self) -> Hold | None:
        d = self._get("pending_hold")
        if d is None:
            return None
        return hold_of(d)

    # -- state
    @property
    def active_step_id(self) -> int | None:
        return self._get("active_step_id")

    def current_step(self) -> int | None:
        return self._get("current_step")

    @property
    def undo_available(self) -> bool:
        return self._get("undo_available")

    @property
    def undo_unavailable_reason(self) -> str | None:
        return self._get("undo_unavailable_reason")

    @property
    def rollback_pending(self) -> bool:
        return self._get("rollback_pending")

    @property
    def unrecorded_step_id(self) -> int | None:
        return self._get("unrecorded_step_id")

    @property
    def requests_in_flight(self) -> int:
        return self._get("requests_in_flight")

    @property
    def store_size_bytes(self) -> int:
        return self._get("store_size_bytes")

    @property
    def eviction_pending(self) -> bool:
        return self._get("eviction_pending")

    def close(self) -> None:
        """The child closes its workspaces when the share process stops; nothing to do here."""
