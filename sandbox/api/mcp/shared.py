"""One session, two clients (seed 003 §4.6): a frontend on the STDIO API and an LLM on MCP.

``sandbox serve --mcp-socket PATH`` builds its STDIO agent as a :class:`SharedSessionAgent`
— the STDIO :class:`~sandbox.api.agent.Agent` that also tells listeners when its session
starts or stops — and serves each MCP connection with a :class:`SharedSessionHost` over it.

Invariants:

* the frontend owns the session: it starts, restricts, resets and stops it over STDIO; MCP
  never starts or stops it (:meth:`SharedSessionHost.close` releases nothing);
* a tool call waits for a started session (:meth:`SharedSessionHost.wait_session`), with
  a progress message per ``SHARED_WAIT_PROGRESS_INTERVAL_S``, at most
  ``SHARED_WAIT_SESSION_S_MAX`` (then ``session.not_started``);
* safeguard holds: the session's one :class:`~sandbox.serving.holds.HoldBroker` serves both
  clients. A hold raised by the LLM's command reaches the frontend as
  ``event.safeguard_triggered`` (the agent is the session's event sink) and the frontend's
  ``safeguard.confirm`` answers it; while the frontend is connected MCP does not elicit
  (:meth:`SharedSessionHost.decides_holds_elsewhere`);
* one running command, visible and cancellable from both sides: the LLM's ``execute_command``
  is registered as the agent's running command (:meth:`SharedSessionHost.claim_command`, the
  agent's own :meth:`~sandbox.api.agent.Agent.claim_command` — the one slot STDIO commands use
  too), with a request id ``mcp-N``: ``session.status.running`` names it (``client: mcp``)
  and the frontend's ``agent.cancel`` (without ``request_id``, or with ``mcp-N``) cancels it;
  while it runs the frontend's ``agent.execute`` is ``agent.busy``, and the other way round;
* the LLM sees no more than the frontend: the MCP connection's view is the agent's current
  view (:meth:`SharedSessionHost.view_of`, narrowed further by the client's roots, never widened).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.to_thread

from ...session.runtime import Session
from ..agent import Agent
from .errors import McpToolError
from .host import McpHost

log = logging.getLogger("sandbox.mcp")

#: the longest a tool call waits for the frontend to start a session; then ``session.not_started``
SHARED_WAIT_SESSION_S_MAX = 600.0
#: seconds between two "waiting for the frontend" progress notifications
SHARED_WAIT_PROGRESS_INTERVAL_S = 1.0
WAITING_MESSAGE = "waiting for the frontend to start a session"


class SharedSessionAgent(Agent):
    """The STDIO agent of ``sandbox serve --mcp-socket``: ``session_up`` is set while it has a
    started session (set after ``session.start`` succeeds, cleared by every stop)."""

    def __init__(self, *args, **kwargs):
        self.session_up = threading.Event()
        super().__init__(*args, **kwargs)

    def op_session_start(self, p: dict, rid) -> dict:
        result = super().op_session_start(p, rid)
        self.session_up.set()
        return result

    def _stop(self) -> None:
        self.session_up.clear()
        super()._stop()


class SharedSessionHost(McpHost):
    """An MCP connection's host over the STDIO agent's session. ``frontend_connected()``:
    whether the STDIO client is still there (it answers holds while it is)."""

    on_hold = "deny"

    def __init__(self, agent: SharedSessionAgent, frontend_connected: Callable[[], bool], *,
                 wait_s_max: float = SHARED_WAIT_SESSION_S_MAX):
        self.agent = agent
        self.frontend_connected = frontend_connected
        self.wait_s_max = wait_s_max
        self._ids = itertools.count(1)  # the request ids of the LLM's commands: mcp-1, mcp-2, …

    def _running(self) -> Session | None:
        s = self.agent.session
        return s if s is not None and s.running else None

    async def wait_session(self, progress: Callable[[str], Awaitable[None]] | None = None) -> Session:
        started = time.monotonic()
        while True:
            s = self._running()
            if s is not None:
                return s
            if not self.frontend_connected():
                raise McpToolError("session.not_started", "no session: the frontend has disconnected")
            waited = time.monotonic() - started
            if waited >= self.wait_s_max:
                raise McpToolError("session.not_started",
                                   f"the frontend started no session within {self.wait_s_max:g} s")
            if progress is not None:
                await progress(f"{WAITING_MESSAGE} ({waited:.0f} s)" if waited >= 1 else WAITING_MESSAGE)
            await anyio.to_thread.run_sync(self.agent.session_up.wait,
                                           min(SHARED_WAIT_PROGRESS_INTERVAL_S, self.wait_s_max - waited),
                                           abandon_on_cancel=True)

    def decides_holds_elsewhere(self) -> bool:
        return self.frontend_connected()

    def claim_command(self, command: str, cancel: threading.Event) -> Callable[[], None]:
        running = self.agent.claim_command(f"mcp-{next(self._ids)}", cancel, "mcp", command)
        return lambda: self.agent.release_command(running)

    @property
    def network(self) -> str:
        s = self._running()
        return s.network if s is not None else "open"

    def view_of(self, session: Session):
        """The frontend's current view of ``session`` (its ``session.restrict``), or the whole table."""
        v = self.agent.view
        return v if v is not None and self.agent.session is session else session.table


class SharedMcpSocket:
    """``sandbox serve --mcp-socket PATH``: the socket server over ``agent``'s session, started at
    once (:class:`~.unix.SocketPathError`/``OSError`` if it cannot be). The path and the token
    file are logged (a JSON line on stderr, like every log of ``sandbox serve``); the token is not.
    :meth:`close` when the STDIO client has gone: MCP stops deferring holds to it, every MCP
    connection is closed, the socket and token file are removed."""

    def __init__(self, path: str, agent: SharedSessionAgent):
        from .server import serve_streams
        from .unix import McpSocketServer, token_path

        self._frontend = threading.Event()
        self._frontend.set()
        self.host = SharedSessionHost(agent, self._frontend.is_set)
        self.server = McpSocketServer(path, lambda read, write: serve_streams(self.host, read, write))
        self.server.start()
        log.info("MCP socket ready: connect with `sandbox mcp --attach %s`", self.server.path,
                 extra={"component": "mcp", "socket": self.server.path, "token_file": token_path(self.server.path)})

    def close(self) -> None:
        self._frontend.clear()
        self.server.close()
