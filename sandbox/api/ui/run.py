"""Start the page's server for an agent's session: a loopback socket, a token, the URL, the browser."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import webbrowser
from collections.abc import Callable

import anyio

from ..agent import Agent
from ..mcp.http import bind, new_token, serve_app
from .hub import Hub
from . import tap
from .server import WS_MESSAGE_BYTES_MAX, UiApp

log = logging.getLogger("sandbox.ui")


def display_available(env=os.environ) -> bool:
    """Whether a browser could be shown: ``$BROWSER`` names one, or there is a display."""
    return bool(env.get("BROWSER") or env.get("DISPLAY") or env.get("WAYLAND_DISPLAY")) or sys.platform == "darwin"


class PageServer:
    """The page of ``agent``'s session (its events: ``hub``) on ``127.0.0.1``, a random port.
    ``url`` carries the token; :meth:`serve` runs until SIGINT/SIGTERM (main thread) or
    :meth:`start_thread` runs it beside something else until :meth:`stop`."""

    def __init__(self, agent: Agent, hub: Hub, *, host: str = "127.0.0.1"):
        self.agent = agent
        self.hub = hub
        self.sock: socket.socket = bind(host, 0)
        self.port = self.sock.getsockname()[1]
        self.token = new_token()
        self.url = f"http://{host}:{self.port}/?token={self.token}"
        self.app = UiApp(agent, hub, port=self.port, token=self.token)
        tap.attach(agent, hub)
        self._stop: anyio.Event | None = None
        self._thread: threading.Thread | None = None
        self._portal_loop = None

    async def _main(self, signals: bool, ready: Callable[[], None] | None = None) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        self.hub.bind(loop)
        self._portal_loop = loop
        self._stop = anyio.Event()
        if ready is not None:
            ready()
        await serve_app(self.app, self.sock, signals=signals, stop=self._stop, ws="wsproto",
                        ws_max_size=WS_MESSAGE_BYTES_MAX)

    def serve(self, *, open_browser: bool = False) -> None:
        """Serve until SIGINT/SIGTERM (main thread); ``open_browser``: open ``url`` when a display exists."""
        def ready() -> None:
            if open_browser and display_available():
                threading.Thread(target=webbrowser.open, args=(self.url,), daemon=True).start()

        try:
            anyio.run(self._main, True, ready)
        finally:
            self.sock.close()

    def start_thread(self) -> None:
        """Serve on a thread of its own (no signal handling) until :meth:`stop`."""
        started = threading.Event()
        self._thread = threading.Thread(target=lambda: anyio.run(self._main, False, started.set), name="ui-server",
                                        daemon=True)
        self._thread.start()
        started.wait()

    def stop(self) -> None:
        loop, ev = self._portal_loop, self._stop
        if loop is not None and ev is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sock.close()


def page_for_agent(agent: Agent) -> PageServer:
    """`sandbox serve --ui`: the page over the STDIO agent's session (whenever its frontend starts
    one), served on a thread; the agent's events go to the frontend and to the page alike."""
    hub = Hub()
    emit = agent.emit

    def both(message: dict) -> None:
        emit(message)
        hub.publish(message)

    agent.emit = both
    page = PageServer(agent, hub)
    page.start_thread()
    return page


def page_for_mcp_host(host, *, guest: str = "vm") -> PageServer:
    """`sandbox mcp --ui`: the page over an :class:`~sandbox.api.mcp.host.OwnSessionHost`'s session,
    served on a thread. A page-side agent adopts the session once it has booted (the host keeps
    owning it: stop the host, then the page); while a page is connected it answers safeguard
    holds and MCP does not elicit them."""
    hub = Hub()
    agent = Agent(hub.publish, guest=guest)
    host.holds_answered_elsewhere = lambda: bool(hub.clients)
    page = PageServer(agent, hub)
    page.start_thread()

    def adopt() -> None:
        host.wait_started()
        if host.session.running:
            agent.adopt(host.session)

    threading.Thread(target=adopt, name="ui-adopt", daemon=True).start()
    return page
