"""The web page's server: static files and one WebSocket per page, over a session's :class:`~sandbox.api.agent.Agent`.

Who may talk to it (docs/ui.md):

* loopback only (:func:`sandbox.api.mcp.http.bind` on ``127.0.0.1``, a random port);
* DNS rebinding: the ``Host`` and ``Origin`` checks of :class:`sandbox.api.mcp.http.LoopbackOrigin`
  (Host wrong: ``421``; Origin from elsewhere: ``403``); a WebSocket without an ``Origin`` is
  refused too (browsers always send one);
* a per-session token (``TOKEN_BYTES`` random bytes, hex): in the URL's query (``?token=``) or
  in the ``sandbox_ui_<port>`` cookie the page sets (``HttpOnly; SameSite=Strict``); without it
  no file is served (``403``) and no WebSocket accepted (closed before the handshake
  completes: ``403``).

The WebSocket speaks the STDIO API (docs/stdio-api.md): the page sends requests
(``{"type", "request_id", "payload"}``, checked against the same schema as ``sandbox serve``)
and gets their responses; every event of the session reaches every page (:class:`~.hub.Hub`).
The page uses exactly the operations a STDIO frontend uses (``agent.execute``,
``undo.history``, ``undo.diff``, ``undo.rollback`` with and without ``force``,
``safeguard.confirm``, ``session.status`` …); it cannot start, stop or reset the session
(``UI_OPERATIONS``: the process that serves the page owns it). On connecting a page first
gets ``ui.welcome`` (the backlog of events, how many were dropped, the limits).

Bounds: ``WS_MESSAGE_BYTES_MAX`` per message from a page (more: the socket is closed, 1009);
``REQUESTS_IN_FLIGHT_MAX`` requests of one page at once (more: ``protocol.busy``); and the
hub's (:mod:`.hub`).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import urllib.parse
from http.cookies import SimpleCookie

import anyio
import anyio.to_thread
from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse, Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from .. import protocol
from ..agent import Agent
from ..errors import ApiError, to_api_error
from ..mcp.http import LoopbackOrigin
from ..stdio import decode_request
from . import hub as hub_mod
from .hub import Hub

log = logging.getLogger("sandbox.ui")

#: one message from a page (more: the WebSocket is closed with 1009, message too big)
WS_MESSAGE_BYTES_MAX = 1 << 20
#: requests of one page being carried out at once (more: answered protocol.busy)
REQUESTS_IN_FLIGHT_MAX = 8
#: the token's cookie is ``sandbox_ui_<port>``: cookies are not kept apart by port, two pages must not share one
COOKIE_PREFIX = "sandbox_ui_"
#: what the page may ask for: the STDIO operations minus the session's lifecycle and mounts
UI_OPERATIONS = frozenset(protocol.REQUEST_TYPES) - {"session.start", "session.stop", "session.reset",
                                                   "mount.add", "mount.remove"}
STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
#: the files served (path -> file name, content type); nothing else
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/app.css": ("app.css", "text/css; charset=utf-8")}
#: the page loads nothing from anywhere else, and no other site may frame it
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; connect-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class UiApp:
    """The ASGI app of one page server: ``agent``'s session, events through ``hub``."""

    def __init__(self, agent: Agent, hub: Hub, *, port: int, token: str):
        self.agent = agent
        self.hub = hub
        self.token = token.encode()
        self.loopback = LoopbackOrigin(port)
        self.cookie = f"{COOKIE_PREFIX}{port}"

    # ------------------------------------------------------------------ who may

    def _token_ok(self, scope: Scope, headers: Headers) -> bool:
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        given = [v for v in query.get("token", [])]
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # a malformed cookie header: no token from it
            cookie = SimpleCookie()
        if self.cookie in cookie:
            given.append(cookie[self.cookie].value)
        return any(hmac.compare_digest(g.encode(), self.token) for g in given)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return
        headers = Headers(scope=scope)
        refused = self.loopback.refusal(headers, origin_required=scope["type"] == "websocket")
        if refused is None and not self._token_ok(scope, headers):
            refused = 403, "the page's token is missing or wrong: open the URL `sandbox ui` printed"
        if refused is not None:
            log.warning("%s %s refused (%d): %s", scope["type"], scope.get("path"), *refused,
                        extra={"component": "ui"})
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": refused[1][:100]})
                return
            return await PlainTextResponse(refused[1], status_code=refused[0])(scope, receive, send)
        if scope["type"] == "websocket":
            if scope.get("path") != "/ws":
                await send({"type": "websocket.close", "code": 1008, "reason": "the page's WebSocket is /ws"})
                return
            return await self._page(WebSocket(scope, receive, send))
        await self._file(scope, receive, send)

    async def _file(self, scope: Scope, receive: Receive, send: Send) -> None:
        entry = FILES.get(scope.get("path", ""))
        if scope.get("method") not in ("GET", "HEAD"):
            resp: Response = PlainTextResponse("only GET", status_code=405, headers={"Allow": "GET, HEAD"})
        elif entry is None:
            resp = PlainTextResponse("not found", status_code=404)
        else:
            name, ctype = entry
            with open(os.path.join(STATIC_DIR, name), "rb") as f:
                body = f.read()
            resp = Response(body, media_type=ctype, headers=SECURITY_HEADERS)
            if name == "index.html":  # later requests (app.js, the WebSocket) carry the token as a cookie
                resp.set_cookie(self.cookie, self.token.decode(), httponly=True, samesite="strict", path="/")
        await resp(scope, receive, send)

    # ------------------------------------------------------------------ one page

    async def _page(self, ws: WebSocket) -> None:
        await ws.accept()
        joined = self.hub.join()
        if joined is None:
            await ws.close(hub_mod.CLOSE_TOO_MANY, f"{self.hub.clients_max} pages are already open")
            return
        client, backlog, dropped = joined
        log.info("a page connected (%d open)", len(self.hub.clients), extra={"component": "ui"})
        try:
            await ws.send_text(hub_mod.encode({"type": "ui.welcome", "payload": {
                "backlog": [json.loads(t) for t in backlog], "dropped": dropped,
                "operations": sorted(UI_OPERATIONS),
                "limits": {"clients_max": self.hub.clients_max, "client_queue_max": self.hub.queue_max,
                           "backlog_messages_max": hub_mod.BACKLOG_MESSAGES_MAX,
                           "backlog_chars_max": self.hub.backlog_chars_max,
                           "requests_in_flight_max": REQUESTS_IN_FLIGHT_MAX,
                           "message_bytes_max": WS_MESSAGE_BYTES_MAX}}}))
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._sender, ws, client, tg.cancel_scope)
                await self._receiver(ws, client, tg)
                tg.cancel_scope.cancel()
        except (WebSocketDisconnect, anyio.ClosedResourceError, OSError):
            pass
        finally:
            self.hub.leave(client)
            log.info("a page disconnected (%d open)", len(self.hub.clients), extra={"component": "ui"})

    async def _sender(self, ws: WebSocket, client: hub_mod.Client, scope: anyio.CancelScope) -> None:
        try:
            while True:
                text = await client.queue.get()
                if text is None:  # the hub cut this page off (too slow)
                    log.warning("a page was closed: %s", client.closed_reason, extra={"component": "ui"})
                    await ws.close(hub_mod.CLOSE_TOO_SLOW, "too far behind: reload to catch up")
                    break
                await ws.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
        scope.cancel()

    async def _receiver(self, ws: WebSocket, client: hub_mod.Client, tg) -> None:
        in_flight = [0]
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            raw = msg.get("text")
            raw = raw.encode("utf-8", "surrogatepass") if raw is not None else (msg.get("bytes") or b"")
            rid = None
            try:
                req = decode_request(raw)
                if not isinstance(req, dict):
                    raise ApiError("protocol.not_an_object", "a request is a JSON object")
                rid = req.get("request_id")
                if not protocol.valid_request_id(rid):
                    rid = None
                t = req.get("type")
                if isinstance(t, str) and t in protocol.REQUEST_TYPES and t not in UI_OPERATIONS:
                    raise ApiError("protocol.not_allowed", f"the page cannot {t}: the process serving it owns the session",
                                   type=t)
                problem = protocol.first_error("request", req)
                if problem is not None:
                    raise ApiError("protocol.invalid_request", f"{problem[0]}: {problem[1]}", path=problem[0],
                                   reason=problem[1])
                if in_flight[0] >= REQUESTS_IN_FLIGHT_MAX:
                    raise ApiError("protocol.busy", f"more than {REQUESTS_IN_FLIGHT_MAX} requests in flight",
                                   limit=REQUESTS_IN_FLIGHT_MAX)
            except ApiError as e:
                client.put(_response(rid, error=e))
                continue
            except Exception as e:  # a bug: answered, the page stays connected
                log.exception("a page's message could not be handled")
                client.put(_response(rid, error=ApiError("protocol.internal", f"internal error: {type(e).__name__}",
                                                         exception=type(e).__name__)))
                continue
            in_flight[0] += 1
            tg.start_soon(self._run, client, t, req.get("payload", {}), rid, in_flight)

    async def _run(self, client: hub_mod.Client, t: str, payload: dict, rid, in_flight: list[int]) -> None:
        try:
            try:
                result = await anyio.to_thread.run_sync(self.agent.handle, t, payload, rid, abandon_on_cancel=True)
            except Exception as e:  # every failure becomes the response
                err = to_api_error(e)
                if err.code == "protocol.internal":
                    log.exception("request %s failed", t)
                client.put(_response(rid, error=err))
            else:
                client.put(_response(rid, result))
        finally:
            in_flight[0] -= 1


def _response(rid, payload: dict | None = None, error: ApiError | None = None) -> str:
    if error is None:
        return hub_mod.encode({"type": "response", "request_id": rid, "status": "ok", "payload": payload or {}})
    return hub_mod.encode({"type": "response", "request_id": rid, "status": "error", "error": error.as_dict()})
