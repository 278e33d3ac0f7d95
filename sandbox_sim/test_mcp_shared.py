"""One session, two clients: a STDIO frontend and an MCP client through ``sandbox mcp --attach``.

``sandbox serve --mcp-socket PATH --guest scripted`` runs as a real subprocess; the STDIO side
is :class:`~sandbox_sim.api_client.ApiClient` (JSON lines, every message schema-checked, every
stderr line a JSON log); the MCP side is the SDK's own ``ClientSession`` over
``stdio_client`` spawning ``sandbox mcp --attach PATH`` — the configuration a real MCP client
uses. A safeguard the LLM's ``execute_command`` triggers is answered by the frontend's
``safeguard.confirm``. The socket's guards are probed with raw sockets: modes, the token,
the handshake bounds, another uid (as root: a child that drops to ``nobody``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from contextlib import asynccontextmanager

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from sandbox.api.mcp.unix import HANDSHAKE_MAGIC, token_path
from sandbox_sim import oracle
from sandbox_sim.api_client import ApiClient, Commands
from sandbox_sim import test_stdio_api as base
from sandbox_sim.test_stdio_api import start

# the STDIO tests' fixtures: a `sandbox serve` client factory, the scripted guest, the project (src/,
# victims/ with 20 files), the state directory
api, guest, project, state_home = base.api, base.guest, base.project, base.state_home

pytestmark = pytest.mark.timeout(180)
#: an MCP call or a STDIO wait (the scripted guest answers in milliseconds; this bounds a hang)
WAIT_S = 60


@pytest.fixture
def sock_path():
    """In a fresh directory under /tmp (which everyone may traverse, unlike pytest's tmp_path, so
    another uid's view can be tested); "run" does not exist: the server creates it 0700."""
    base = tempfile.mkdtemp(prefix="sandbox-mcp-test-", dir="/tmp")
    os.chmod(base, 0o711)
    yield os.path.join(base, "run", "mcp.sock")
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def frontend(api, sock_path):
    """``sandbox serve --mcp-socket`` clients (the STDIO suite's ``api`` factory: checked and closed)."""

    def make(*extra: str) -> ApiClient:
        c = api("--mcp-socket", sock_path, *extra)
        c._wait(lambda: any(r.get("socket") == sock_path for r in c.logs), WAIT_S, "the MCP socket's ready log")
        return c

    return make


@asynccontextmanager
async def attached(path: str, env: dict | None = None):
    """The SDK's ClientSession over ``sandbox mcp --attach PATH`` (a subprocess), initialized."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "sandbox", "mcp", "--attach", path],
                                   env={**os.environ, **(env or {})})
    async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
        with anyio.fail_after(WAIT_S):
            await s.initialize()
        yield s


def run(fn):
    """Run an async test body (the tests are sync so the STDIO client's blocking waits stay simple)."""
    return anyio.run(fn)


def attach(path: str, stdin: bytes = b"", timeout: float = WAIT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox", "mcp", "--attach", path], input=stdin,
                          capture_output=True, timeout=timeout)


# ---------------------------------------------------------------------------- the shared session


@pytest.mark.parametrize("answer", ["allow", "deny"])
def test_a_safeguard_of_the_llms_command_is_answered_by_the_stdio_frontend(frontend, project, sock_path, answer):
    c = frontend()
    start(c, project, safeguard={"delete_threshold": 5, "timeout_seconds": 120})
    before = oracle.snapshot_dir(str(project))
    cmds = Commands("scripted")

    async def body():
        async with attached(sock_path) as s:
            result = {}

            async def call():
                result["r"] = await s.call_tool("execute_command", {"command": cmds.rm_r("victims")})

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                m = 0
                ev = await anyio.to_thread.run_sync(
                    lambda: c.wait_event("event.safeguard_triggered", since=m, timeout_s=WAIT_S))
                p = ev["payload"]
                assert p["kind"] == "delete" and p["count"] == 5 and p["sample_paths"]
                assert len(os.listdir(project / "victims")) == 20 - 4  # held: the 5th deletion has not happened
                assert "r" not in result  # the LLM's command waits for the frontend
                st = await anyio.to_thread.run_sync(lambda: c.ok("session.status"))
                assert [h["safeguard_id"] for h in st["pending_safeguards"]] == [p["safeguard_id"]]
                await anyio.to_thread.run_sync(
                    lambda: c.ok("safeguard.confirm", {"safeguard_id": p["safeguard_id"], "action": answer}))
            return result["r"]

    r = run(body)
    out = r.structured_content
    if answer == "allow":
        assert not r.is_error and out["exit_code"] == 0, r
        assert not (project / "victims").exists()
        assert out["changes"]["paths_total"] >= 20, out["changes"]
    else:
        assert oracle.snapshot_dir(str(project)) == before
        assert r.is_error or out["exit_code"] != 0, r
        assert c.ok("undo.history")["steps"][0]["outcome"] == "denied"


def test_the_llms_steps_are_the_frontends_history_and_either_side_undoes(frontend, project, sock_path):
    c = frontend()
    start(c, project)
    before = oracle.snapshot_dir(str(project))

    async def body():
        async with attached(sock_path) as s:
            w = await s.call_tool("write_file", {"path": "notes.txt", "content": "from the LLM\n"})
            assert not w.is_error, w
            st = await s.call_tool("get_session_status", {})
            assert not st.is_error, st
            return w

    run(body)
    assert (project / "notes.txt").read_text() == "from the LLM\n"
    hist = c.ok("undo.history")["steps"]
    assert hist[0]["type"] == "api"  # the LLM's write is an API step of the shared session
    c.ok("undo.rollback", {"count": 1})
    assert oracle.snapshot_dir(str(project)) == before


@pytest.mark.parametrize("by", ["no_request_id", "its_request_id"])
def test_the_frontend_sees_and_cancels_the_llms_running_command(frontend, project, sock_path, by):
    """The LLM's ``execute_command`` is the session's running command: ``session.status.running``
    names it (client ``mcp``), the frontend's own command is ``agent.busy`` meanwhile, and
    ``agent.cancel`` — without a request id, or with the one status gave — stops it; the MCP
    result says cancelled and the step is closed (in the history, undoable)."""
    c = frontend()
    start(c, project)
    command = "write a.txt x; echo started; wait"
    before = oracle.snapshot_dir(str(project))

    async def body():
        async with attached(sock_path) as s:
            started = anyio.Event()
            result = {}

            async def on_progress(progress, total, message):
                if message and "started" in message:
                    started.set()

            async def call():
                result["r"] = await s.call_tool("execute_command", {"command": command},
                                                progress_callback=on_progress)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                with anyio.fail_after(WAIT_S):
                    await started.wait()
                st = await anyio.to_thread.run_sync(lambda: c.ok("session.status"))
                running = st["running"]
                assert st["state"] == "running" and running["client"] == "mcp" and running["command"] == command
                busy = await anyio.to_thread.run_sync(lambda: c.error("agent.execute", {"command": "echo hi"}))
                assert busy["code"] == "agent.busy" and busy["data"]["request_id"] == running["request_id"]
                wrong = await anyio.to_thread.run_sync(lambda: c.error("agent.cancel", {"request_id": "other"}))
                assert wrong["code"] == "agent.not_running"
                assert "r" not in result  # a cancel naming another command left it running
                p = {} if by == "no_request_id" else {"request_id": running["request_id"]}
                assert (await anyio.to_thread.run_sync(lambda: c.ok("agent.cancel", p))) == {"cancelled": True}
            return result["r"]

    r = run(body)
    assert not r.is_error, r.content[0].text
    out = r.structured_content
    assert out["cancelled"] is True and out["timed_out"] is False and out["exit_code"] != 0
    assert "cancelled" in r.content[0].text
    assert c.ok("session.status")["running"] is None
    hist = c.ok("undo.history")["steps"]
    assert hist[0]["command"] == command and hist[0]["id"] == out["step_id"]
    c.ok("undo.rollback", {"count": 1})
    assert oracle.snapshot_dir(str(project)) == before
    assert c.ok("agent.execute", {"command": "echo still here"})["exit_code"] == 0  # the session goes on


def test_the_frontends_restriction_narrows_the_llms_file_tools_too(frontend, project, sock_path):
    c = frontend()
    start(c, project)

    async def body():
        async with attached(sock_path) as s:
            seen = await s.call_tool("read_file", {"path": "README.md"})
            assert not seen.is_error, seen  # the whole folder, before the frontend narrows it
            view = (await anyio.to_thread.run_sync(lambda: c.ok("session.restrict", {"path": "/mnt/working/0/src"})))
            assert view["view"] == "/mnt/working/0/src"
            out = await s.call_tool("read_file", {"path": "/mnt/working/0/README.md"})
            w = await s.call_tool("write_file", {"path": "/mnt/working/0/planted.txt", "content": "x"})
            inside = await s.call_tool("list_directory", {"path": "/mnt/working/0/src"})
            st = (await s.call_tool("get_session_status", {})).structured_content
            return out, w, inside, st

    out, w, inside, st = run(body)
    assert out.is_error and out.structured_content["code"] == "fs.access_denied", out
    assert w.is_error and not (project / "planted.txt").exists(), w
    assert not inside.is_error, inside
    assert st["view"] == "/mnt/working/0/src"


def test_a_tool_call_waits_for_the_frontend_to_start_the_session(frontend, project, sock_path):
    c = frontend()
    progress: list[str] = []

    async def body():
        async with attached(sock_path) as s:
            result = {}
            waiting = anyio.Event()

            async def on_progress(done, total, message):
                progress.append(message or "")
                waiting.set()

            async def call():
                result["r"] = await s.call_tool("list_directory", {}, progress_callback=on_progress)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                with anyio.fail_after(WAIT_S):
                    await waiting.wait()  # the call reported that it waits
                assert "r" not in result
                await anyio.to_thread.run_sync(lambda: start(c, project))
            return result["r"]

    r = run(body)
    assert not r.is_error, r
    assert any("waiting for the frontend" in m for m in progress), progress
    assert {e["name"] for e in r.structured_content["entries"]} >= {"src", "victims"}


def test_the_frontend_leaving_ends_the_attached_client_with_a_message(frontend, project, sock_path):
    c = frontend()
    start(c, project)
    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "mcp", "--attach", sock_path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n')
        proc.stdin.flush()
        assert b'"id":1' in proc.stdout.readline()  # connected and served
        assert c.close() == 0
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert b"closed the connection" in err
    assert not os.path.exists(sock_path) and not os.path.exists(token_path(sock_path))


def test_an_attached_client_killed_mid_command_cancels_it_and_the_frontend_goes_on(frontend, project, sock_path):
    c = frontend()
    start(c, project)
    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "mcp", "--attach", sock_path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def send(msg: dict) -> None:
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", **msg}).encode() + b"\n")
        proc.stdin.flush()

    try:
        send({"id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                                          "clientInfo": {"name": "raw", "version": "0"}}})
        assert b'"id":1' in proc.stdout.readline()
        send({"method": "notifications/initialized"})
        m = c.mark()
        send({"id": 2, "method": "tools/call", "params": {
            "name": "execute_command", "arguments": {"command": "write a.txt x; echo started; wait"},
            "_meta": {"progressToken": "p"}}})
        while b"started" not in proc.stdout.readline():  # progress notifications carry the output
            assert proc.poll() is None
        proc.kill()  # the MCP client's side of the socket closes mid-command
        proc.wait(WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = c.wait_event("event.step_completed", since=m, timeout_s=WAIT_S)["payload"]
    assert done["exit_code"] != 0  # cancelled, not finished
    assert c.ok("undo.history")["steps"][0]["command"] == "write a.txt x; echo started; wait"
    assert c.ok("agent.execute", {"command": "echo still here"})["exit_code"] == 0  # the session goes on


# ---------------------------------------------------------------------------- the socket's guards


def test_the_socket_its_directory_and_token_file_are_private(frontend, sock_path):
    frontend()
    assert stat.S_IMODE(os.stat(os.path.dirname(sock_path)).st_mode) == 0o700
    st = os.stat(sock_path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(token_path(sock_path)).st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o750, 0o701, 0o777])
def test_a_directory_others_can_enter_is_refused(tmp_path, mode, state_home):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(mode)
    r = subprocess.run([sys.executable, "-m", "sandbox", "serve", "--guest", "scripted", "--mcp-socket",
                        str(d / "mcp.sock")], input=b"", capture_output=True, timeout=WAIT_S,
                       env={**os.environ, "XDG_STATE_HOME": state_home})
    assert r.returncode == 2
    assert b"accessible to others" in r.stderr and b"0700" in r.stderr
    assert not (d / "mcp.sock").exists()


def test_a_live_socket_is_not_taken_over_and_a_stale_one_is_replaced(frontend, sock_path, state_home):
    frontend()
    r = subprocess.run([sys.executable, "-m", "sandbox", "serve", "--guest", "scripted", "--mcp-socket", sock_path],
                       input=b"", capture_output=True, timeout=WAIT_S, env={**os.environ, "XDG_STATE_HOME": state_home})
    assert r.returncode == 2 and b"in use" in r.stderr


def _handshake(path: str, line: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(WAIT_S)
        s.connect(path)
        s.sendall(line)
        out = b""
        while not out.endswith(b"\n"):
            chunk = s.recv(1024)
            if not chunk:
                break
            out += chunk
        return out


def test_a_wrong_token_or_handshake_is_refused_and_the_server_goes_on(frontend, sock_path, project):
    c = frontend()
    assert _handshake(sock_path, f"{HANDSHAKE_MAGIC} {'0' * 64}\n".encode()).startswith(b"ERR bad_token ")
    assert _handshake(sock_path, b"GET / HTTP/1.1\r\n\r\n").startswith(b"ERR bad_handshake ")
    assert _handshake(sock_path, b"x" * 4096).startswith(b"ERR bad_handshake ")  # over the line limit
    with open(token_path(sock_path)) as f:
        token = f.read().strip()
    assert _handshake(sock_path, f"{HANDSHAKE_MAGIC} {token}\n".encode()) == b"OK\n"
    start(c, project)  # the STDIO side never noticed


def test_attach_reports_a_missing_socket_and_a_refused_token(tmp_path, frontend, sock_path):
    missing = str(tmp_path / "nothing" / "mcp.sock")
    r = attach(missing)
    assert r.returncode == 1 and b"is `sandbox serve --mcp-socket PATH` running?" in r.stderr and not r.stdout
    frontend()
    with open(token_path(sock_path), "w") as f:
        f.write("f" * 64 + "\n")
    r = attach(sock_path)
    assert r.returncode == 3 and b"refused by the server (bad_token)" in r.stderr and not r.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another uid")
def test_another_uid_is_refused_by_peer_credentials_even_on_an_open_socket(frontend, sock_path):
    frontend()
    probe = ("import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.settimeout(30)\ns.connect(sys.argv[1])\n"
             "sys.stdout.write(s.recv(200).decode())\n")  # refused at accept, before any handshake

    def as_nobody() -> subprocess.CompletedProcess:
        return subprocess.run(["/usr/bin/python3", "-c", probe, sock_path], capture_output=True, timeout=WAIT_S,
                              preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)), text=True)

    r = as_nobody()
    assert "PermissionError" in r.stderr and not r.stdout  # the 0700 directory keeps it out
    # a misconfiguration opens the directory and the socket to everyone: SO_PEERCRED still refuses
    os.chmod(os.path.dirname(sock_path), 0o711)
    os.chmod(sock_path, 0o666)
    r = as_nobody()
    assert r.stdout.startswith("ERR peer_refused "), (r.stdout, r.stderr)


def test_attach_takes_no_session_options():
    r = subprocess.run([sys.executable, "-m", "sandbox", "mcp", "--attach", "/nonexistent/mcp.sock", "--workdir", "."],
                       capture_output=True, timeout=WAIT_S, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and b"no --workdir with it" in r.stderr and not r.stdout
    r = subprocess.run([sys.executable, "-m", "sandbox", "mcp"], capture_output=True, timeout=WAIT_S,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and b"--attach PATH" in r.stderr


def test_docs_mcp_quotes_the_transports_limits():
    from sandbox.api.mcp import http, lines, shared, unix

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "mcp.md")) as f:
        doc = f.read()
    for module, names in [(unix, ["SOCKET_CONNECTIONS_MAX", "HANDSHAKE_LINE_BYTES_MAX", "HANDSHAKE_TIMEOUT_S"]),
                          (lines, ["MESSAGE_BYTES_MAX", "QUEUED_MESSAGES_MAX"]),
                          (shared, ["SHARED_WAIT_SESSION_S_MAX", "SHARED_WAIT_PROGRESS_INTERVAL_S"]),
                          (http, ["HTTP_SESSIONS_MAX", "HTTP_BODY_BYTES_MAX", "HTTP_SESSION_IDLE_S"])]:
        for name in names:
            assert f"| `{name}` | {getattr(module, name):,} |" in doc, (module.__name__, name)


def test_a_silent_handshake_times_out_and_connections_past_the_limit_are_busy(tmp_path):
    """The socket server in process with its bounds made small; the connection handler just
    holds the connection until the test lets it go."""
    import threading

    from sandbox.api.mcp.unix import McpSocketServer

    release = threading.Event()
    path = str(tmp_path / "run" / "s.sock")

    async def hold(read_stream, write_stream):
        await anyio.to_thread.run_sync(release.wait, WAIT_S)

    server = McpSocketServer(path, hold, connections_max=1, handshake_timeout_s=0.5)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.settimeout(WAIT_S)
            silent.connect(path)
            assert silent.recv(200).startswith(b"ERR bad_handshake ")  # nothing sent within the deadline
        with open(token_path(path)) as f:
            token = f.read().strip()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
            first.settimeout(WAIT_S)
            first.connect(path)
            first.sendall(f"{HANDSHAKE_MAGIC} {token}\n".encode())
            assert first.recv(3) == b"OK\n"
            assert _handshake(path, f"{HANDSHAKE_MAGIC} {token}\n".encode()).startswith(b"ERR busy ")
    finally:
        release.set()
        server.close()
    assert not os.path.exists(path) and not os.path.exists(token_path(path))
