"""MCP over streamable HTTP: ``sandbox mcp --http 127.0.0.1:0 --guest scripted`` as a real subprocess.

The SDK's own streamable-HTTP client (``streamable_http_client`` + ``ClientSession``) with the
bearer token the server logged on stderr calls tools; raw HTTP requests probe the guards: no
token → 401, a foreign Host → 421, a foreign Origin → 403, a non-loopback bind refused before
anything listens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import anyio
import httpx2
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from sandbox_sim import oracle
from sandbox_sim import test_mcp

project = test_mcp.project  # the MCP suite's project fixture
pytestmark = pytest.mark.timeout(180)
WAIT_S = 60


class HttpServer:
    """``sandbox mcp --http`` in a subprocess; ``url`` and ``token`` from its ready log line."""

    def __init__(self, project, state_home: str, *extra: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox", "mcp", "--http", "127.0.0.1:0", "--workdir", str(project),
             "--guest", "scripted", *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "XDG_STATE_HOME": state_home})
        self.logs: list[dict] = []
        self.bad_lines: list[bytes] = []
        self.ready = threading.Event()
        self.url = self.token = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(WAIT_S):
            self.stop()
            raise AssertionError(f"no ready line from sandbox mcp --http: {self.logs[-5:]} {self.bad_lines[-5:]}")

    def _read(self) -> None:
        for raw in self.proc.stderr:
            try:
                rec = json.loads(raw)
            except ValueError:
                self.bad_lines.append(raw)
                continue
            self.logs.append(rec)
            if rec.get("url") and rec.get("token"):
                self.url, self.token = rec["url"], rec["token"]
                self.ready.set()
        self.ready.set()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(WAIT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture
def http_server(project, tmp_path):
    servers = []
    state = tmp_path / "state"
    state.mkdir()

    def make(*extra: str) -> HttpServer:
        s = HttpServer(project, str(state), *extra)
        servers.append(s)
        return s

    yield make
    for s in servers:
        assert s.stop() == 0
        assert not s.bad_lines, s.bad_lines[:5]  # stderr: JSON log lines only
        assert s.proc.stdout.read() == b""  # nothing on stdout over HTTP


def test_the_sdk_client_calls_tools_with_the_token_and_the_step_is_undoable(http_server, project):
    srv = http_server()
    assert srv.url.startswith("http://127.0.0.1:") and srv.url.endswith("/mcp")
    before = oracle.snapshot_dir(str(project))

    async def body():
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {srv.token}"}, timeout=WAIT_S) as hc:
            async with streamable_http_client(srv.url, http_client=hc) as (read, write), \
                    ClientSession(read, write) as s:
                with anyio.fail_after(WAIT_S):
                    init = await s.initialize()
                    assert init.server_info.name
                    tools = {t.name for t in (await s.list_tools()).tools}
                    assert {"execute_command", "write_file", "undo"} <= tools
                    w = await s.call_tool("write_file", {"path": "notes.txt", "content": "over HTTP\n"})
                    assert not w.is_error, w
                    assert (project / "notes.txt").read_text() == "over HTTP\n"
                    u = await s.call_tool("undo", {})
                    assert not u.is_error, u

    anyio.run(body)
    assert oracle.snapshot_dir(str(project)) == before


def _post(srv, headers: dict) -> httpx2.Response:
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
    return httpx2.post(srv.url, json=body, headers={"Accept": "application/json, text/event-stream", **headers},
                       timeout=WAIT_S)


def test_requests_without_the_token_or_from_a_foreign_host_or_origin_are_refused(http_server):
    srv = http_server()
    auth = {"Authorization": f"Bearer {srv.token}"}
    r = _post(srv, {})
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert _post(srv, {"Authorization": "Bearer " + "0" * 64}).status_code == 401
    assert _post(srv, {"Authorization": srv.token}).status_code == 401  # not a bearer scheme
    port = srv.url.split(":")[2].split("/")[0]
    assert _post(srv, {**auth, "Host": f"attacker.example:{port}"}).status_code == 421  # DNS rebinding
    assert _post(srv, {**auth, "Host": "127.0.0.1:1"}).status_code == 421
    assert _post(srv, {**auth, "Origin": "http://attacker.example"}).status_code == 403
    assert _post(srv, {**auth, "Origin": f"http://localhost:{port}"}).status_code == 200
    assert _post(srv, auth).status_code == 200


@pytest.mark.parametrize("spec", ["0.0.0.0:0", "192.0.2.1:8080", "example.org:80", "[::]:0", "127.0.0.1"])
def test_a_non_loopback_or_malformed_bind_is_refused(project, spec, tmp_path):
    r = subprocess.run([sys.executable, "-m", "sandbox", "mcp", "--http", spec, "--workdir", str(project),
                        "--guest", "scripted"], capture_output=True, timeout=WAIT_S, stdin=subprocess.DEVNULL,
                       env={**os.environ, "XDG_STATE_HOME": str(tmp_path)})
    assert r.returncode == 2, r.stderr
    assert b"loopback" in r.stderr


def test_sessions_are_bounded_and_a_deleted_one_frees_its_place(http_server):
    from sandbox.api.mcp.http import HTTP_SESSIONS_MAX

    srv = http_server()
    auth = {"Authorization": f"Bearer {srv.token}"}
    ids = []
    for _ in range(HTTP_SESSIONS_MAX):
        r = _post(srv, auth)
        assert r.status_code == 200
        ids.append(r.headers["mcp-session-id"])
    assert _post(srv, auth).status_code == 503
    r = httpx2.delete(srv.url, headers={**auth, "mcp-session-id": ids[0]}, timeout=WAIT_S)
    assert r.status_code == 200
    assert httpx2.delete(srv.url, headers={**auth, "mcp-session-id": ids[0]}, timeout=WAIT_S).status_code == 404
    assert _post(srv, auth).status_code == 200
