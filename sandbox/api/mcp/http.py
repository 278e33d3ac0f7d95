"""``sandbox mcp --http 127.0.0.1:PORT``: MCP over the SDK's streamable-HTTP transport, on loopback only.

Who may talk to it:

* **loopback only**: the bind address must be a loopback address (``127.0.0.0/8``, ``::1``)
  or ``localhost``; anything else is refused before binding (:class:`HttpBindError`);
* **DNS rebinding**: every request's ``Host`` header must name the loopback address and the
  bound port (``127.0.0.1:PORT``, ``localhost:PORT``, ``[::1]:PORT``) → else ``421``; an
  ``Origin`` header, when present, must be ``http://`` one of those → else ``403``;
* **a bearer token**: random per run (``TOKEN_BYTES`` bytes, hex), printed on stderr with
  the URL; a request without ``Authorization: Bearer <token>`` → ``401``.

The endpoint is ``/mcp`` (anything else: ``404``). Each MCP session (``Mcp-Session-Id``) is
one connection for :func:`sandbox.api.mcp.server.serve_streams`; the SDK's
:class:`~mcp.server.streamable_http.StreamableHTTPServerTransport` speaks the HTTP side
(POST; the GET stream; DELETE ends the session). Responses are streamed as the transport
specifies (an SSE-framed body per POST, so progress notifications and elicitation work); the
deprecated HTTP+SSE transport (``/sse``) is not served.

Bounds: ``HTTP_SESSIONS_MAX`` MCP sessions at once (one more: ``503``);
``HTTP_BODY_BYTES_MAX`` per request body (more: ``413``, by the SDK's body-limit middleware);
a session with no request in flight for ``HTTP_SESSION_IDLE_S`` is ended (its id then
answers ``404``).
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import secrets
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup, TaskStatus
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER, StreamableHTTPServerTransport
from mcp.server.transport_security import RequestBodyLimitMiddleware
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from .host import McpHost
from .lines import MESSAGE_BYTES_MAX

log = logging.getLogger("sandbox.mcp")

#: MCP sessions served at once (one more: HTTP 503)
HTTP_SESSIONS_MAX = 8
#: one request body (more: HTTP 413) — the socket transport's message limit
HTTP_BODY_BYTES_MAX = MESSAGE_BYTES_MAX
#: a session with no request in flight this long is ended
HTTP_SESSION_IDLE_S = 30 * 60.0
TOKEN_BYTES = 32
ENDPOINT = "/mcp"

ServeConnection = Callable[[object, object], Awaitable[None]]


class HttpBindError(ValueError):
    """The ``--http`` address is not a loopback address and port."""


def parse_bind(spec: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) → (host, port), loopback only; else :class:`HttpBindError`."""
    host, sep, port_s = spec.rpartition(":")
    if not sep or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise HttpBindError(f"--http wants HOST:PORT on loopback (e.g. 127.0.0.1:8765, port 0 = any), not {spec!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise HttpBindError(f"--http binds to loopback only (127.0.0.1, ::1 or localhost), not {host!r}: "
                                "anyone who can reach the port could drive the sandbox")
    return ("127.0.0.1" if host == "localhost" else host), int(port_s)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: the kernel chooses)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(HTTP_SESSIONS_MAX * 4)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def url_of(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{ENDPOINT}"


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str, **headers: str) -> None:
    log.warning("HTTP %s %s refused (%d): %s", scope.get("method"), scope.get("path"), status, message,
                extra={"component": "mcp"})
    await JSONResponse({"error": message}, status_code=status, headers=headers or None)(scope, receive, send)


class LoopbackOrigin:
    """The DNS-rebinding checks of a loopback server on ``port`` (this module's, and the web
    page's, :mod:`sandbox.api.ui.server`): the ``Host`` header must name the loopback address
    and the port; an ``Origin`` header, when present, must be ``http://`` one of those."""

    def __init__(self, port: int):
        names = ("127.0.0.1", "localhost", "[::1]")
        self.hosts = {f"{n}:{port}" for n in names}
        self.origins = {f"http://{h}" for h in self.hosts}

    def refusal(self, headers: Headers, *, origin_required: bool = False) -> tuple[int, str] | None:
        """None if ``headers`` pass, else (HTTP status, reason): 421 for the Host, 403 for the
        Origin (``origin_required``: a missing one too — a browser's WebSocket always sends it)."""
        if headers.get("host", "") not in self.hosts:
            return 421, "the Host header does not name this loopback server"
        origin = headers.get("origin")
        if (origin is None and origin_required) or (origin is not None and origin not in self.origins):
            return 403, "requests from another origin are refused"
        return None


class Guard:
    """ASGI middleware: Host, Origin (:class:`LoopbackOrigin`) and the bearer token, then ``app``."""

    def __init__(self, app, *, port: int, token: str):
        self.app = app
        self.token = token.encode()
        self.loopback = LoopbackOrigin(port)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refused = self.loopback.refusal(headers)
        if refused is not None:
            return await _refuse(scope, receive, send, *refused)
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token):
            return await _refuse(scope, receive, send, 401, "a bearer token is required (printed on stderr at start)",
                                 **{"WWW-Authenticate": 'Bearer realm="sandbox"'})
        if scope.get("path") != ENDPOINT:
            return await _refuse(scope, receive, send, 404, f"the MCP endpoint is {ENDPOINT}")
        await self.app(scope, receive, send)


class HttpSessions:
    """The MCP sessions of one HTTP server: each new one (a request without ``Mcp-Session-Id``)
    gets a transport and a task serving it (``serve_connection``) in ``tg``; requests naming
    a known id go to its transport; an unknown id: ``404``."""

    def __init__(self, tg: TaskGroup, serve_connection: ServeConnection, *, sessions_max: int = HTTP_SESSIONS_MAX,
                 idle_s: float = HTTP_SESSION_IDLE_S):
        self.tg = tg
        self.serve_connection = serve_connection
        self.sessions_max = sessions_max
        self.idle_s = idle_s
        self.sessions: dict[str, StreamableHTTPServerTransport] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sid = Headers(scope=scope).get(MCP_SESSION_ID_HEADER)
        if sid is not None:
            transport = self.sessions.get(sid)
            if transport is None:
                return await _refuse(scope, receive, send, 404, "no such MCP session (ended or expired)")
            await transport.handle_request(scope, receive, send)
            if transport.is_terminated:
                await self._discard(sid, transport)
            return
        if len(self.sessions) >= self.sessions_max:
            return await _refuse(scope, receive, send, 503, f"{self.sessions_max} MCP sessions are already open")
        sid = uuid.uuid4().hex
        transport = StreamableHTTPServerTransport(mcp_session_id=sid, idle_timeout=self.idle_s)
        self.sessions[sid] = transport
        status: list[int] = []

        async def watch(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.tg.start(self._serve, sid, transport)
            await transport.handle_request(scope, receive, watch)
        finally:
            if not status or status[0] >= 400:  # the opening request failed: nothing was established
                await self._discard(sid, transport)

    async def _serve(self, sid: str, transport: StreamableHTTPServerTransport, *,
                     task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with transport.connect() as (read_stream, write_stream):
                task_status.started()
                log.info("MCP HTTP session %s opened (%d open)", sid[:8], len(self.sessions), extra={"component": "mcp"})
                with transport.idle_scope or anyio.CancelScope():
                    await self.serve_connection(read_stream, write_stream)
        except Exception:
            log.exception("MCP HTTP session %s failed", sid[:8])
        finally:
            await self._discard(sid, transport)
            log.info("MCP HTTP session %s ended", sid[:8], extra={"component": "mcp"})

    async def _discard(self, sid: str, transport: StreamableHTTPServerTransport) -> None:
        self.sessions.pop(sid, None)
        if not transport.is_terminated:
            with anyio.CancelScope(shield=True):
                await transport.terminate()


async def serve_app(app, sock: socket.socket, *, signals: bool = True, stop: anyio.Event | None = None,
                    **config) -> None:
    """Serve the ASGI ``app`` on the listening ``sock`` with uvicorn until SIGINT/SIGTERM or ``stop``
    is set (then a graceful shutdown), or until cancelled. ``signals``: receive SIGINT/SIGTERM (main
    thread only; uvicorn's own handling, which re-raises them, is off either way). ``config``: more
    uvicorn settings."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    server = Server(uvicorn.Config(app, log_config=None, lifespan="off", access_log=False,
                                   timeout_graceful_shutdown=5, **config))
    async with anyio.create_task_group() as tg:
        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("signal %d: stopping the HTTP server", signum, extra={"component": "mcp"})
                    server.should_exit = True
                    return

        async def on_stop() -> None:
            await stop.wait()
            server.should_exit = True

        if signals:
            tg.start_soon(on_signal)
        if stop is not None:
            tg.start_soon(on_stop)
        await server.serve(sockets=[sock])
        tg.cancel_scope.cancel()


async def serve_http(serve_connection: ServeConnection, sock: socket.socket, token: str) -> None:
    """Serve MCP on the listening ``sock`` (:func:`serve_app`): on SIGINT/SIGTERM open sessions
    end and ``serve_connection`` tasks are cancelled."""
    port = sock.getsockname()[1]
    async with anyio.create_task_group() as tg:
        app = Guard(RequestBodyLimitMiddleware(HttpSessions(tg, serve_connection), HTTP_BODY_BYTES_MAX),
                    port=port, token=token)
        await serve_app(app, sock)
        tg.cancel_scope.cancel()


def new_token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


class _SharedByConnections(McpHost):
    """``host`` as every HTTP session sees it: they share its session, so one client's roots do not
    narrow the guest for the others (each connection's own view still narrows), and a session
    ending closes nothing — the server closes ``host`` when it stops."""

    def __init__(self, host: McpHost):
        self.inner = host
        self.on_hold = host.on_hold

    async def wait_session(self, progress=None):
        return await self.inner.wait_session(progress)

    def decides_holds_elsewhere(self) -> bool:
        return self.inner.decides_holds_elsewhere()

    @property
    def network(self) -> str:
        return self.inner.network


def run(host: McpHost, spec: str) -> None:
    """``sandbox mcp --http SPEC``: serve until SIGINT/SIGTERM (the caller then stops ``host``). The URL and
    the token are logged once listening (a JSON line on stderr: fields ``url`` and ``token``).
    :class:`HttpBindError` for a non-loopback ``spec``, ``OSError`` if it cannot be bound."""
    from .server import serve_streams

    bind_host, port = parse_bind(spec)
    sock = bind(bind_host, port)
    token = new_token()
    shared = _SharedByConnections(host)
    url = url_of(bind_host, sock.getsockname()[1])

    async def main() -> None:
        log.info("MCP over streamable HTTP at %s (send the header Authorization: Bearer <token>)", url,
                 extra={"component": "mcp", "url": url, "token": token})
        await serve_http(lambda read, write: serve_streams(shared, read, write), sock, token)

    try:
        anyio.run(main)
    finally:
        sock.close()
