"""What one MCP server instance acts on: :class:`McpHost`.

A host hands the server a started :class:`~sandbox.session.runtime.Session` when a tool
needs one (:meth:`McpHost.wait_session`), and says who answers safeguard holds
(:meth:`McpHost.decides_holds_elsewhere`). ``initialize`` and ``tools/list`` never wait
for it: only tool calls do.

:class:`OwnSessionHost` (``sandbox mcp``) owns its session: it starts booting it in a
background thread the moment the host is made, and stops it in :meth:`close`. Invariants:

* the session is started at most once and stopped at most once (:meth:`close` waits for a
  boot in progress to end first, then stops what it started);
* ``wait_session`` never blocks the event loop: it waits in
  :data:`~.limits.BOOT_PROGRESS_INTERVAL_S` slices and reports each boot progress message
  (and a "still booting" line per slice) through ``progress``;
* a boot failure is remembered: every later ``wait_session`` raises
  ``session.boot_failed`` with the reason, at once.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.to_thread

from ...session.runtime import Session
from .errors import McpToolError
from .limits import BOOT_PROGRESS_INTERVAL_S

log = logging.getLogger("sandbox.mcp")
#: what an unanswerable hold gets (``sandbox mcp --on-hold``)
HOLD_POLICIES = ("deny", "allow")
#: boot progress messages remembered for late waiters (the oldest are dropped)
BOOT_MESSAGES_MAX = 64


class McpHost(abc.ABC):
    """What one MCP server instance acts on: a session it owns or shares."""

    #: applied to a hold nobody can be asked about (no elicitation, or it failed): ``deny``/``allow``
    on_hold: str = "deny"

    @abc.abstractmethod
    async def wait_session(self, progress: Callable[[str], Awaitable[None]] | None = None) -> Session:
        """The started session; while it boots, ``progress(message)`` is awaited with news.
        Raises :class:`~.errors.McpToolError` ``session.not_started`` (there is none) or
        ``session.boot_failed`` (it could not start)."""

    @abc.abstractmethod
    def decides_holds_elsewhere(self) -> bool:
        """True when a frontend (a STDIO client) answers safeguard holds: then MCP does not elicit."""

    @property
    def network(self) -> str:
        """The session's network policy (``disabled``/``open``/``allowlist``), known before it
        boots: the tools' ``openWorldHint``. Unknown → ``open`` (the cautious hint)."""
        return "open"

    def view_of(self, session: Session):
        """The widest view this host's clients may have of ``session`` — their roots only narrow
        it: the whole mount table, unless a frontend narrowed the session (the shared host)."""
        return session.table

    def narrow_guest(self, view) -> None:
        """The connection's view narrowed (MCP roots): a host whose session serves only this
        connection narrows the guest too; a shared session keeps its own (default)."""
        return None

    def claim_command(self, command: str, cancel: threading.Event) -> Callable[[], None]:
        """``execute_command`` is about to run ``command``, cancelled when ``cancel`` is set:
        a host whose session other clients share registers it where they can see and cancel
        it (the shared host: the frontend's ``agent.cancel``), raising ``agent.busy`` while
        another command runs. Returns the release to call when the command has ended. Default:
        nothing to register (this connection's own ``execute_command`` is the only canceller)."""
        return lambda: None

    async def close(self) -> None:
        """Release what the host owns (the connection ended)."""
        return None


class OwnSessionHost(McpHost):
    """`sandbox mcp`: builds a Session from CLI/session options and starts it in the background at once."""

    def __init__(self, session: Session, *, on_hold: str = "deny"):
        if on_hold not in HOLD_POLICIES:
            raise ValueError(f"on_hold must be one of {', '.join(HOLD_POLICIES)}, not {on_hold!r}")
        self.session = session
        self.on_hold = on_hold
        self._lock = threading.Lock()
        self._messages: list[tuple[int, str]] = []  # (seq, message) of the boot, newest last
        self._seq = 0
        self._done = threading.Event()
        self._failed: str | None = None
        self._closed = False
        self._started_at = time.monotonic()
        outer = session.progress

        def progress(msg: str) -> None:
            with self._lock:
                self._seq += 1
                self._messages.append((self._seq, msg))
                del self._messages[:-BOOT_MESSAGES_MAX]
            outer(msg)

        session.progress = progress
        self._thread = threading.Thread(target=self._boot, name="mcp-session-boot", daemon=True)
        self._thread.start()

    def _boot(self) -> None:
        try:
            self.session.start()
            log.info("session started for MCP", extra={"component": "mcp"})
        except BaseException as e:  # noqa: BLE001 — any failure is the boot's, reported to every caller
            self._failed = str(e) or type(e).__name__
            log.error("the session could not start: %s", self._failed, extra={"component": "mcp"})
        finally:
            self._done.set()

    @property
    def network(self) -> str:
        return self.session.network

    #: who else answers holds while it returns True (``sandbox mcp --ui``: a connected page)
    holds_answered_elsewhere: Callable[[], bool] | None = None

    def decides_holds_elsewhere(self) -> bool:
        return bool(self.holds_answered_elsewhere is not None and self.holds_answered_elsewhere())

    def wait_started(self, timeout: float | None = None) -> bool:
        """Block until the boot has ended (started or failed); False on timeout."""
        return self._done.wait(timeout)

    def narrow_guest(self, view) -> None:
        if self.session.running:
            self.session.restrict(view)

    async def wait_session(self, progress: Callable[[str], Awaitable[None]] | None = None) -> Session:
        seen = 0
        while True:
            done = await anyio.to_thread.run_sync(self._done.wait, BOOT_PROGRESS_INTERVAL_S, abandon_on_cancel=True)
            if self._closed:
                raise McpToolError("session.not_started", "the session has been stopped")
            with self._lock:
                news = [m for s, m in self._messages if s > seen]
                seen = self._seq
            if done:
                break
            if progress is not None:
                if not news:
                    news = [f"the session is starting ({time.monotonic() - self._started_at:.0f} s)"]
                for m in news:
                    await progress(m)
        if self._failed is not None:
            raise McpToolError("session.boot_failed", f"the session could not start: {self._failed}",
                               reason=self._failed)
        if not self.session.running:
            raise McpToolError("session.not_started", "the session is not running")
        return self.session

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self.stop)

    def stop(self) -> None:
        """Stop the session (blocking; idempotent): a boot in progress ends first (its own
        timeouts bound it), pending holds are denied, then the session stops."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._thread.join()
        if self.session.running:
            self.session.holds.deny_all("stopped")
            self.session.stop()
