"""Test helpers for the web page (issue 18): a scripted-guest session served by
:class:`sandbox.api.ui.run.PageServer` in this process, and a small WebSocket client (wsproto)."""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.parse

from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Message, RejectConnection, Request, TextMessage

from sandbox.api.agent import Agent
from sandbox.api.ui.hub import Hub
from sandbox.api.ui.run import PageServer

#: the longest a test waits for one WebSocket frame
RECV_TIMEOUT_S = 30.0


@contextlib.contextmanager
def page_session(workdir: str, **start):
    """A scripted-guest session on ``workdir`` (``start``: more session.start fields) and its page."""
    hub = Hub()
    agent = Agent(hub.publish, guest="scripted")
    agent.handle("session.start", {"working_directories": [{"path": str(workdir)}], **start}, "start")
    server = PageServer(agent, hub)
    server.start_thread()
    try:
        yield server
    finally:
        server.stop()
        agent.shutdown()


def origin_of(server: PageServer) -> str:
    return f"http://127.0.0.1:{server.port}"


class WsClient:
    """A blocking WebSocket client: ``status`` is 101 when accepted, else the HTTP refusal's status."""

    def __init__(self, port: int, *, path: str = "/ws", headers: dict[str, str] | None = None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=RECV_TIMEOUT_S)
        self.ws = WSConnection(ConnectionType.CLIENT)
        extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items() if k.lower() != "host"]
        host = (headers or {}).get("Host", f"127.0.0.1:{port}")
        self.sock.sendall(self.ws.send(Request(host=host, target=path, extra_headers=extra)))
        self.status = None
        self.close_code = None
        self._text: list[str] = []
        self._events: list = []
        while self.status is None:
            for ev in self._read():
                if isinstance(ev, AcceptConnection):
                    self.status = 101
                elif isinstance(ev, RejectConnection):
                    self.status = ev.status_code
                else:
                    self._events.append(ev)

    def _read(self):
        data = self.sock.recv(65536)
        self.ws.receive_data(data or None)
        return list(self.ws.events())

    def send(self, message: dict | str) -> None:
        text = message if isinstance(message, str) else json.dumps(message)
        self.sock.sendall(self.ws.send(Message(data=text)))

    def recv(self) -> dict | None:
        """The next whole message as JSON, or None when the server closed (``close_code``)."""
        while True:
            while self._events:
                ev = self._events.pop(0)
                if isinstance(ev, TextMessage):
                    self._text.append(ev.data)
                    if ev.message_finished:
                        text, self._text = "".join(self._text), []
                        return json.loads(text)
                elif isinstance(ev, CloseConnection):
                    self.close_code = ev.code
                    return None
            self._events.extend(self._read())

    def recv_response(self, request_id) -> dict:
        while True:
            m = self.recv()
            assert m is not None, f"closed ({self.close_code}) before the response to {request_id!r}"
            if m.get("type") == "response" and m.get("request_id") == request_id:
                return m

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def token_cookie(server: PageServer) -> str:
    return f"sandbox_ui_{server.port}={server.token}"


def page_url(server: PageServer, *, token: str | None = None, path: str = "/") -> str:
    q = "" if token is None else "?" + urllib.parse.urlencode({"token": token})
    return f"http://127.0.0.1:{server.port}{path}{q}"


# ------------------------------------------------------------------ a browser (Debian's chromium, Playwright)

CHROMIUM = "/usr/bin/chromium"
#: where screenshots go (gitignored); override with $SANDBOX_TEST_ARTIFACTS
ARTIFACTS_DIR = "test-artifacts"
#: the longest a browser test waits for something to appear on the page (a condition wait, not a sleep)
EXPECT_TIMEOUT_MS = 30_000


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    import os
    import shutil

    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (pip install -e '.[test]')"
    if not (os.access(CHROMIUM, os.X_OK) or shutil.which("chromium")):
        return f"Debian's chromium is not installed ({CHROMIUM}; apt-get install chromium, or ./dev setup)"
    return None


def artifacts_dir(*parts: str) -> str:
    import os

    root = os.environ.get("SANDBOX_TEST_ARTIFACTS") or os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                                                     ARTIFACTS_DIR)
    path = os.path.join(root, *parts)
    os.makedirs(path, exist_ok=True)
    return path


#: browser launches tried before the failure is the test's: Debian's chromium now and then dies
#: at start-up (SIGTRAP before its first page; twice in a row once, on a quiet machine), which says
#: nothing of our page
CHROMIUM_LAUNCH_ATTEMPTS = 3


def launch_chromium(playwright):
    """Debian's chromium, headless, through Playwright (never a downloaded browser); a browser
    that dies while starting is started again, at most :data:`CHROMIUM_LAUNCH_ATTEMPTS` times
    in all (the last failure is raised)."""
    import os
    import shutil

    from playwright.sync_api import Error

    exe = CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")
    for attempt in range(1, CHROMIUM_LAUNCH_ATTEMPTS + 1):
        try:
            return playwright.chromium.launch(executable_path=exe, headless=True,
                                              args=["--no-sandbox"] if os.geteuid() == 0 else [])
        except Error:
            if attempt == CHROMIUM_LAUNCH_ATTEMPTS:
                raise
