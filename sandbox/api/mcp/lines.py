"""JSON-RPC messages as newline-delimited JSON over a byte stream — the unix socket transport's framing.

The same framing the SDK's stdio transport uses (one message per line, UTF-8, no embedded
newlines: JSON escapes them), over any anyio byte stream, with the bounds the stdio
transport lacks:

* a message is at most ``MESSAGE_BYTES_MAX`` bytes; a longer one closes the connection
  (logged): its end cannot be found without reading it all, so framing is lost;
* a line that is not a JSON-RPC message is handed to the server as the exception it raised
  (as the SDK's stdio transport does: the server answers or logs it and reads on);
* blank lines are skipped.

:func:`line_streams` yields the ``(read_stream, write_stream)`` pair the SDK's servers and
``ClientSession`` take. When the peer closes its side the read stream ends, so the MCP
session ends; when the caller leaves the context, the writer is cancelled and the byte
stream closed.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

import anyio
import mcp_types as types
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream
from mcp.shared.message import SessionMessage

from ..stdio import LINE_BYTES_MAX

log = logging.getLogger("sandbox.mcp")

#: one JSON-RPC message on the socket (the STDIO API's line limit: a write_file's content travels inside)
MESSAGE_BYTES_MAX = LINE_BYTES_MAX
#: messages decoded but not yet taken by the server, and replies not yet written (then the sender waits)
QUEUED_MESSAGES_MAX = 16


@asynccontextmanager
async def line_streams(stream: ByteStream, *, message_bytes_max: int = MESSAGE_BYTES_MAX,
                       buffered: BufferedByteReceiveStream | None = None
                       ) -> AsyncIterator[tuple[anyio.abc.ObjectReceiveStream, anyio.abc.ObjectSendStream]]:
    """The SDK's stream pair over ``stream``. ``buffered``: a reader already used on it (a
    handshake read before), so bytes it holds beyond the handshake are not lost."""
    reader_in = buffered or BufferedByteReceiveStream(stream)
    read_send, read_recv = anyio.create_memory_object_stream[SessionMessage | Exception](QUEUED_MESSAGES_MAX)
    write_send, write_recv = anyio.create_memory_object_stream[SessionMessage](QUEUED_MESSAGES_MAX)

    async def reader() -> None:
        async with read_send:
            while True:
                try:
                    line = await reader_in.receive_until(b"\n", message_bytes_max)
                except anyio.DelimiterNotFound:
                    log.warning("an MCP message longer than %d bytes: connection closed", message_bytes_max,
                                extra={"component": "mcp"})
                    return
                except (anyio.IncompleteRead, anyio.EndOfStream, anyio.ClosedResourceError,
                        anyio.BrokenResourceError, OSError):
                    return  # the peer closed its side (a partial last line is dropped)
                if not line.strip():
                    continue
                try:
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except Exception as exc:  # the server answers a parse error; the connection goes on
                    await read_send.send(exc)
                    continue
                await read_send.send(SessionMessage(message))

    async def writer() -> None:
        async with write_recv:
            async for session_message in write_recv:
                data = session_message.message.model_dump_json(by_alias=True, exclude_unset=True)
                try:
                    await stream.send(data.encode("utf-8") + b"\n")
                except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                    return  # the peer is gone; the reader sees it too

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            tg.start_soon(writer)
            try:
                yield read_recv, write_send
            finally:
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
