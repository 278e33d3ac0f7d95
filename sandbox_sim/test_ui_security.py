"""The web page's server (issue 18) refuses whoever lacks the session's token, and DNS rebinding:
plain HTTP and WebSocket handshakes, no browser. The page's WebSocket speaks the STDIO API,
minus the session's lifecycle."""

from __future__ import annotations

import http.client

import pytest

from sandbox.api.ui import hub as hub_mod
from sandbox.api.ui import server as ui_server

from .ui_page import WsClient, origin_of, page_session, token_cookie


@pytest.fixture
def work(tmp_path):
    (tmp_path / "work" / "src").mkdir(parents=True)
    (tmp_path / "work" / "src" / "a.txt").write_text("alpha\n")
    return tmp_path / "work"


@pytest.fixture
def served(work):
    with page_session(work) as server:
        yield server


def get(server, path, headers=None, method="GET"):
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def test_the_page_needs_the_token(served):
    assert get(served, "/")[0] == 403
    assert get(served, "/?token=" + "0" * len(served.token))[0] == 403
    assert get(served, "/app.js")[0] == 403
    status, headers, body = get(served, f"/?token={served.token}")
    assert status == 200 and b"<title>sandbox</title>" in body
    assert "HttpOnly" in headers["set-cookie"] and "SameSite=strict" in headers["set-cookie"]
    assert "default-src 'self'" in headers["content-security-policy"]
    assert headers["set-cookie"].startswith(token_cookie(served) + ";")
    assert get(served, "/app.js", {"Cookie": token_cookie(served)})[0] == 200  # the cookie the page got
    assert get(served, "/app.js", {"Cookie": f"sandbox_ui_1={served.token}"})[0] == 403  # another port's name
    assert get(served, "/nothing", {"Cookie": token_cookie(served)})[0] == 404
    assert get(served, "/", {"Cookie": token_cookie(served)}, method="POST")[0] == 405


def test_host_and_origin_are_checked(served):
    ok = f"/?token={served.token}"
    assert get(served, ok, {"Host": f"evil.example:{served.port}"})[0] == 421
    assert get(served, ok, {"Host": "127.0.0.1:1"})[0] == 421
    assert get(served, ok, {"Origin": "http://evil.example"})[0] == 403
    assert get(served, ok, {"Origin": origin_of(served)})[0] == 200
    assert get(served, ok, {"Host": f"localhost:{served.port}"})[0] == 200


def test_websocket_refused_without_token_or_with_a_foreign_origin(served):
    cases = [
        ({"Origin": origin_of(served)}, 403),                                              # no token
        ({"Origin": origin_of(served), "Cookie": f"sandbox_ui_{served.port}=wrong"}, 403),                 # wrong token
        ({"Cookie": token_cookie(served)}, 403),                                           # no Origin
        ({"Origin": "http://evil.example", "Cookie": token_cookie(served)}, 403),         # foreign Origin
        ({"Origin": origin_of(served), "Cookie": token_cookie(served), "Host": "evil.example"}, 403),  # Host
        ({"Origin": origin_of(served), "Cookie": token_cookie(served)}, 101),
    ]
    for headers, status in cases:
        ws = WsClient(served.port, headers=headers)
        try:
            assert ws.status == status, headers
        finally:
            ws.close()


def _open(served) -> WsClient:
    ws = WsClient(served.port, headers={"Origin": origin_of(served), "Cookie": token_cookie(served)})
    assert ws.status == 101
    welcome = ws.recv()
    assert welcome["type"] == "ui.welcome"
    return ws


def test_page_speaks_the_stdio_api_but_cannot_stop_the_session(served, work):
    ws = _open(served)
    try:
        ws.send({"type": "session.stop", "request_id": "s", "payload": {}})
        assert ws.recv_response("s")["error"]["code"] == "protocol.not_allowed"
        ws.send("{not json")
        m = ws.recv()
        assert m["type"] == "response" and m["error"]["code"] == "protocol.invalid_json"
        ws.send({"type": "undo.rollback", "request_id": "r", "payload": {"count": "x"}})
        assert ws.recv_response("r")["error"]["code"] == "protocol.invalid_request"
        ws.send({"type": "agent.execute", "request_id": "e", "payload": {"command": "rm -rf src"}})
        assert ws.recv_response("e")["status"] == "ok"
        assert not (work / "src").exists()
        ws.send({"type": "undo.rollback", "request_id": "u", "payload": {"count": 1}})
        assert ws.recv_response("u")["status"] == "ok"
        assert (work / "src" / "a.txt").read_text() == "alpha\n"
        assert served.agent.session.running  # nothing the page sent stopped it
    finally:
        ws.close()


def test_a_reconnecting_page_gets_the_backlog(served):
    ws = _open(served)
    ws.send({"type": "agent.execute", "request_id": "e", "payload": {"command": "echo hello page"}})
    assert ws.recv_response("e")["status"] == "ok"
    ws.close()
    ws2 = WsClient(served.port, headers={"Origin": origin_of(served), "Cookie": token_cookie(served)})
    try:
        welcome = ws2.recv()
        kinds = [m["type"] for m in welcome["payload"]["backlog"]]
        assert "ui.command" in kinds and "event.step_completed" in kinds
        assert any(m["type"] == "event.terminal_output" and "hello page" in m["payload"]["data"]
                   for m in welcome["payload"]["backlog"])
        assert welcome["payload"]["limits"]["clients_max"] == hub_mod.CLIENTS_MAX
    finally:
        ws2.close()


def test_more_pages_than_the_limit_are_told_and_closed(served):
    opened = [_open(served) for _ in range(served.hub.clients_max)]
    try:
        extra = WsClient(served.port, headers={"Origin": origin_of(served), "Cookie": token_cookie(served)})
        assert extra.status == 101 and extra.recv() is None and extra.close_code == hub_mod.CLOSE_TOO_MANY
        extra.close()
    finally:
        for ws in opened:
            ws.close()


def test_a_page_too_far_behind_is_closed_and_the_backlog_is_bounded():
    h = hub_mod.Hub(queue_max=3, backlog_max=4, backlog_chars_max=10_000)
    import asyncio

    async def scenario():
        h.bind(asyncio.get_running_loop())
        client, backlog, dropped = h.join()
        for i in range(6):
            h._deliver(hub_mod.encode({"type": "event.warning", "payload": {"message": str(i)}}))
        assert client.closed_reason is not None and client.queue.get_nowait() is None  # told to close
        again, backlog, dropped = h.join()
        assert len(backlog) == 4 and dropped == 2 and '"5"' in backlog[-1]

    asyncio.run(scenario())
    assert ui_server.UI_OPERATIONS.isdisjoint({"session.start", "session.stop", "session.reset"})


# ------------------------------------------------------------------ the commands


def _url_from(stream) -> str:
    """The page's URL from the command's output (read line by line; pytest-timeout bounds it)."""
    import re

    for raw in stream:
        line = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        m = re.search(r"the page is at (http://127\.0\.0\.1:\d+/\?token=[0-9a-f]+)", line)
        if m:
            return m.group(1)
    raise AssertionError("the command ended without printing the page's URL")


def _status(url: str, *, with_token: bool = True) -> int:
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        c.request("GET", "/?" + u.query if with_token else "/")
        return c.getresponse().status
    finally:
        c.close()


def test_sandbox_ui_prints_its_url_and_serves_the_page_only_with_the_token(work):
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "ui", "--workdir", str(work), "--guest", "scripted",
                             "--no-browser", "--log-level", "warn"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        url = _url_from(proc.stdout)
        assert _status(url) == 200 and _status(url, with_token=False) == 403
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_sandbox_serve_ui_shows_the_stdio_frontends_session(work):
    import json
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "serve", "--guest", "scripted", "--ui", "--log-level",
                             "warn"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = _url_from(proc.stderr)
        port = int(url.split(":")[2].split("/")[0])
        token = url.split("token=")[1]
        proc.stdin.write(json.dumps({"type": "session.start", "request_id": 1, "payload": {
            "working_directories": [{"path": str(work)}]}}).encode() + b"\n")
        proc.stdin.write(json.dumps({"type": "agent.execute", "request_id": 2,
                                     "payload": {"command": "rm -r src"}}).encode() + b"\n")
        proc.stdin.flush()
        for line in proc.stdout:
            if json.loads(line).get("request_id") == 2:
                break
        ws = WsClient(port, headers={"Origin": f"http://127.0.0.1:{port}", "Cookie": f"sandbox_ui_{port}={token}"})
        try:
            backlog = ws.recv()["payload"]["backlog"]
            assert any(m["type"] == "ui.command" and m["payload"]["command"] == "rm -r src" for m in backlog)
            ws.send({"type": "undo.rollback", "request_id": "u", "payload": {"count": 1}})
            assert ws.recv_response("u")["status"] == "ok"  # the page undid the frontend's step
        finally:
            ws.close()
        assert (work / "src" / "a.txt").read_text() == "alpha\n"
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0


def test_docs_ui_quotes_the_real_limits():
    import os
    import re

    from sandbox.api.mcp.http import TOKEN_BYTES

    doc = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "ui.md")).read()
    js = open(os.path.join(ui_server.STATIC_DIR, "app.js")).read()

    def row(name: str) -> str:
        m = re.search(rf"^\| `{name}`[^|]*\| ([0-9]+)", doc, re.M)
        assert m, f"docs/ui.md has no row for {name}"
        return m.group(1)

    assert int(row("CLIENTS_MAX")) == hub_mod.CLIENTS_MAX
    assert int(row("CLIENT_QUEUE_MAX")) == hub_mod.CLIENT_QUEUE_MAX
    assert int(row("BACKLOG_MESSAGES_MAX")) == hub_mod.BACKLOG_MESSAGES_MAX
    assert int(row("BACKLOG_CHARS_MAX")) == hub_mod.BACKLOG_CHARS_MAX
    assert int(row("WS_MESSAGE_BYTES_MAX")) == ui_server.WS_MESSAGE_BYTES_MAX
    assert int(row("REQUESTS_IN_FLIGHT_MAX")) == ui_server.REQUESTS_IN_FLIGHT_MAX
    assert int(row("TOKEN_BYTES")) == TOKEN_BYTES
    for name in ("TERMINAL_CHARS_MAX", "NOTICES_MAX", "RETRY_MS_MAX"):  # the page's own
        value = re.search(rf"const {name} = ([^;]+);", js).group(1)
        assert int(row(name)) == eval(value, {}), name  # noqa: S307 - our own literal (e.g. 1 << 20)


def test_sandbox_ui_refuses_the_options_it_cannot_honour(work, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "sandbox", "ui", "--workdir", str(work), "--guest", "scripted",
                        "--no-browser", "--on-hold", "allow"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not take --on-hold" in r.stderr, r.stderr


def test_sandbox_ui_keeps_the_undo_store_where_state_dir_says(work, tmp_path):
    import signal
    import subprocess
    import sys

    store = tmp_path / "named" / "store"
    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "ui", "--workdir", str(work), "--guest", "scripted",
                             "--no-browser", "--state-dir", str(store), "--log-level", "warn"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        _url_from(proc.stdout)  # printed once the session has started (and opened its store)
        assert (store / "VERSION").is_file()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_sandbox_ui_passes_share_to_its_session(work):
    """``--share`` reaches ``session.start``: the session checks it (virtio-fs needs a VM)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "sandbox", "ui", "--workdir", str(work), "--guest", "scripted",
                        "--no-browser", "--share", "virtiofs"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "session.invalid_config" in r.stderr and "virtiofs" in r.stderr, r.stderr


def test_sandbox_mcp_ui_logs_the_page_url_and_serves_it(work):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "mcp", "--workdir", str(work), "--guest", "scripted",
                             "--ui", "--log-level", "warn"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        url = _url_from(proc.stderr)
        assert _status(url) == 200 and _status(url, with_token=False) == 403
    finally:
        proc.stdin.close()  # the MCP client leaves: the session stops
        assert proc.wait(timeout=60) == 0


def test_the_browser_is_opened_only_where_one_can_be_shown():
    from sandbox.api.ui.run import display_available

    assert not display_available({}) or __import__("sys").platform == "darwin"
    assert display_available({"DISPLAY": ":0"})
    assert display_available({"WAYLAND_DISPLAY": "wayland-0"})
    assert display_available({"BROWSER": "firefox"})


def test_sandbox_ui_stops_cleanly_on_a_signal_that_lands_inside_the_page_loop(work, monkeypatch):
    """A SIGTERM after the URL is printed but before the page's loop handles signals itself runs
    `sandbox ui`'s own handler inside one of that loop's tasks: its stop comes out of the loop
    wrapped in an exception group, and is still a clean stop (exit 0, the session shut down)."""
    import os
    import signal

    import anyio

    from sandbox import cli
    from sandbox.api.ui import run as ui_run

    def serve(self, *, open_browser=False):
        async def main():
            async def signalled():
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at this task's next step
                await anyio.sleep_forever()

            async with anyio.create_task_group() as tg:
                tg.start_soon(signalled)

        try:
            anyio.run(main)
        finally:
            self.sock.close()

    monkeypatch.setattr(ui_run.PageServer, "serve", serve)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        rc = cli.main(["ui", "--workdir", str(work), "--guest", "scripted", "--no-browser", "--log-level", "warn"])
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
    assert rc == 0
