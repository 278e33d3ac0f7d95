"""The MCP server: the SDK's low-level :class:`mcp.server.Server` with our tool table.

* :func:`build_server` — the SDK server object for a host (one per transport listener,
  or one per connection — both work: each connection's state lives in the SDK's
  per-connection ``Connection.state`` and is torn down with it);
* :func:`serve_streams` — serve one connection over a pair of SDK streams; returns when it ends;
* :func:`serve_stdio` — ``sandbox mcp``: one connection over stdin/stdout, then close the host.

Invariants:

* ``initialize`` and ``tools/list`` never wait for the session: the tool list depends only
  on the host's network policy (``openWorldHint``); the first tool call waits for the boot
  with progress notifications, and a boot failure is that call's ``isError`` result;
* protocol faults (an unknown tool, malformed params) are JSON-RPC errors; every tool
  failure — bad arguments included — is an ``isError`` result whose ``structuredContent``
  is ``{code, message, data}`` with a stable code (:mod:`.errors`); a bug is
  ``protocol.internal``, logged with its traceback — the server goes on either way;
* a successful call's ``structuredContent`` is its output model dumped (it validates
  against the advertised ``outputSchema``), with a short text rendering beside it;
* stdout carries only JSON-RPC (:func:`serve_stdio` moves fd 1 to stderr for everything
  else); logs — ours and the SDK's — are JSON lines on stderr (:func:`route_sdk_logs`).
"""

from __future__ import annotations

import fcntl
import logging
import os

import anyio
import anyio.abc
import mcp_types as types
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError

from ... import __version__
from ...mounts.table import MountTable
from ..errors import ApiError
from .client import McpClient
from .errors import tool_error
from .host import McpHost
from .tools import BY_NAME, TOOLS

log = logging.getLogger("sandbox.mcp")
SERVER_NAME = "sandbox"
#: the key of this server's per-connection state in the SDK's ``Connection.state``
STATE_KEY = "sandbox.mcp.client"
#: third-party loggers whose records go to our JSON lines on stderr
SDK_LOGGERS = ("mcp", "mcp_types", "uvicorn", "uvicorn.error", "uvicorn.access", "starlette", "httpx", "httpcore",
               "anyio")
INSTRUCTIONS = (
    "Every tool acts inside a sandbox VM on the user's working folders. Each command (execute_command) and each "
    "file write (write_file, edit_file) is one undo step: after a mistake, call undo instead of repairing by "
    "hand, then re-read the paths it lists. get_undo_history lists the steps. Paths are relative to the first "
    "working folder, or absolute guest paths (/mnt/working/0/...).")


def build_server(host: McpHost, *, view: MountTable | None = None) -> Server:
    """The SDK server for ``host``; ``view`` narrows every connection's view (default: the
    session's whole mount table). Module docstring: invariants."""

    def client_of(ctx: ServerRequestContext) -> McpClient:
        conn = getattr(ctx.session, "_connection", None)  # the SDK's per-connection object
        state = conn.state if conn is not None else fallback
        c = state.get(STATE_KEY)
        if c is None:
            c = state[STATE_KEY] = McpClient(host, view)
            if conn is not None:
                conn.exit_stack.push_async_callback(c.close)
        return c

    fallback: dict = {}

    async def list_tools(ctx: ServerRequestContext, params) -> types.ListToolsResult:
        network = host.network
        return types.ListToolsResult(tools=[t.tool(network) for t in TOOLS])

    async def call_tool(ctx: ServerRequestContext, params: types.CallToolRequestParams) -> types.CallToolResult:
        spec = BY_NAME.get(params.name)
        if spec is None:
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}",
                           {"known": sorted(BY_NAME)})
        try:
            args = spec.input.model_validate(params.arguments or {})
        except ValidationError as e:
            first = e.errors()[0]
            where = "$." + ".".join(str(x) for x in first.get("loc", ())) if first.get("loc") else "$"
            return error_result(ApiError("protocol.invalid_request", f"{spec.name}: {where}: {first.get('msg')}",
                                         path=where, reason=first.get("msg", ""),
                                         errors=[{"path": ".".join(map(str, x.get("loc", ()))), "reason": x.get("msg")}
                                                 for x in e.errors()[:10]]))
        client = client_of(ctx)
        try:
            out, text = await getattr(client, spec.name)(ctx, args)
        except Exception as e:
            err = tool_error(e)
            if err.code == "protocol.internal":
                log.error("tool %s failed", spec.name, exc_info=e, extra={"component": "mcp"})
            else:
                log.info("tool %s: %s: %s", spec.name, err.code, err.message, extra={"component": "mcp"})
            return error_result(err)
        # exclude_unset: an optional field a shape leaves out (an entry's size…) stays out, never null
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                    structured_content=out.model_dump(mode="json", exclude_unset=True))

    async def roots_changed(ctx: ServerRequestContext, params) -> None:
        client_of(ctx).roots_dirty = True  # re-read at the next tool call

    server = Server(SERVER_NAME, version=__version__, title="sandbox: undoable commands in a VM",
                    instructions=INSTRUCTIONS, on_list_tools=list_tools, on_call_tool=call_tool)
    # registered directly: the constructor's on_roots_list_changed warns (roots are deprecated in 2026-07-28)
    server.add_notification_handler("notifications/roots/list_changed", types.NotificationParams, roots_changed)
    return server


def error_result(err: ApiError) -> types.CallToolResult:
    """A tool failure as the client sees it: ``isError``, the code in text and structured."""
    d = err.as_dict()
    return types.CallToolResult(content=[types.TextContent(type="text", text=f"error {d['code']}: {d['message']}")],
                                structured_content=d, is_error=True)


async def serve_streams(host: McpHost, read_stream, write_stream, *, view: MountTable | None = None) -> None:
    """Serve one MCP connection over the SDK streams; returns when it ends (the host stays open)."""
    server = build_server(host, view=view)
    await server.run(read_stream, write_stream, server.create_initialization_options())


async def serve_stdio(host: McpHost) -> None:
    """``sandbox mcp``: one connection over stdin/stdout; the host is closed when it ends.

    The protocol gets private descriptors for stdin and stdout; fd 0 becomes ``/dev/null``
    and fd 1 stderr, so nothing else — a stray print, a library, a child process (QEMU) —
    can read from or write into the protocol. Messages are framed by
    :func:`~.lines.line_streams`, as on the socket: a line longer than
    ``MESSAGE_BYTES_MAX`` ends the connection (the SDK's stdio transport would hold a line
    of any length in memory)."""
    import sys

    from .lines import line_streams

    sys.stdout.flush()
    protocol_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)  # not inherited by children
    protocol_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        async with line_streams(_FdStream(protocol_in, protocol_out)) as (read_stream, write_stream):
            await serve_streams(host, read_stream, write_stream)
    finally:
        with anyio.CancelScope(shield=True):  # also when the caller cancels us (a signal)
            await host.close()


class _FdStream(anyio.abc.ByteStream):
    """A byte stream reading one descriptor and writing another (``sandbox mcp``'s stdio), in
    worker threads. A read still blocked when the stream is cancelled is abandoned, and the
    read descriptor is never closed under it (it could be reused while that thread reads)."""

    def __init__(self, fd_in: int, fd_out: int):
        self._in, self._out = fd_in, fd_out

    async def receive(self, max_bytes: int = 65536) -> bytes:
        data = await anyio.to_thread.run_sync(os.read, self._in, max_bytes, abandon_on_cancel=True)
        if not data:
            raise anyio.EndOfStream
        return data

    async def send(self, item: bytes) -> None:
        await anyio.to_thread.run_sync(self._write_all, item)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._out, view):]

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        if self._out >= 0:
            os.close(self._out)
            self._out = -1


def route_sdk_logs(handler: logging.Handler, level: int) -> None:
    """Send the SDK's and its web stack's loggers to ``handler`` (our JSON lines on stderr)."""
    for name in SDK_LOGGERS:
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.addHandler(handler)
        lg.setLevel(max(level, logging.INFO) if name != "mcp" else level)
        lg.propagate = False
