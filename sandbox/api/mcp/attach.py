"""``sandbox mcp --attach PATH``: a stdio MCP client's bridge to ``sandbox serve --mcp-socket PATH``.

An MCP client starts this as its server process; it connects to the socket, checks that the
server runs as our user or root (``SO_PEERCRED``: the token is never sent to anyone else),
sends the handshake with the token from ``PATH.token`` (:mod:`sandbox.api.mcp.unix`), and
then copies bytes both ways unchanged — stdin to the socket, the socket to stdout — until
either side closes. It never parses the messages (the server bounds them) and imports no MCP code.

Ending (:func:`attach` returns the exit code; every failure prints one line on stderr):

* the client closes stdin: the socket's write side is shut, the server's last replies are
  copied, then exit ``0``; stdout closed by the client: exit ``0``;
* the socket is missing, nobody listens, or the token file cannot be read: exit ``1``;
* the server refuses the handshake (``ERR bad_token`` …) or is not our user: exit ``3``;
* the server closes the connection while the client is still there (the frontend ended the
  ``sandbox serve``): exit ``1``, "the sandbox server closed the connection".
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from .unix import HANDSHAKE_LINE_BYTES_MAX, HANDSHAKE_TIMEOUT_S, connect_error, handshake_line, peer_allowed, \
    peer_uid, read_token

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 3
#: bytes copied per read, each way
CHUNK_BYTES = 64 << 10


class AttachError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def connect(path: str) -> socket.socket:
    """A connection to the server at ``path`` past its handshake; :class:`AttachError` otherwise."""
    try:
        token = read_token(path)
    except OSError as e:
        if not os.path.exists(path):
            raise AttachError(f"{path}: {connect_error(e)}", EXIT_FAILED) from None
        raise AttachError(f"cannot read the token file {path}.token: {e.strerror}", EXIT_FAILED) from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.connect(path)
        except OSError as e:
            raise AttachError(f"{path}: {connect_error(e)}", EXIT_FAILED) from None
        uid = peer_uid(sock)
        if not peer_allowed(uid):
            raise AttachError(f"{path}: the server runs as uid {uid}, not as you: the token is not sent", EXIT_REFUSED)
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            sock.sendall(handshake_line(token))
            reply = _read_line(sock)
        except OSError as e:
            raise AttachError(f"{path}: the handshake failed: {e.strerror or e}", EXIT_FAILED) from None
        sock.settimeout(None)
        if reply == "OK":
            return sock
        if reply.startswith("ERR "):
            _, reason, message = (reply.split(" ", 2) + ["", ""])[:3]
            raise AttachError(f"{path}: refused by the server ({reason}): {message}", EXIT_REFUSED)
        raise AttachError(f"{path}: the server closed the connection during the handshake", EXIT_FAILED)
    except BaseException:
        sock.close()
        raise


def _read_line(sock: socket.socket) -> str:
    """The server's one-line answer (byte by byte: nothing after it may be consumed here)."""
    out = bytearray()
    while len(out) < HANDSHAKE_LINE_BYTES_MAX:
        b = sock.recv(1)
        if not b or b == b"\n":
            break
        out += b
    return out.decode("utf-8", "replace")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def bridge(sock: socket.socket, stdin_fd: int = 0, stdout_fd: int = 1) -> int:
    """Copy stdin → socket and socket → stdout until one side ends; the exit code (module docstring)."""
    stdin_closed = threading.Event()

    def upstream() -> None:
        try:
            while True:
                data = os.read(stdin_fd, CHUNK_BYTES)
                if not data:
                    break
                sock.sendall(data)
        except OSError:
            pass  # the socket is gone: downstream sees it
        finally:
            stdin_closed.set()
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    threading.Thread(target=upstream, name="attach-upstream", daemon=True).start()
    try:
        while True:
            data = sock.recv(CHUNK_BYTES)
            if not data:
                break
            _write_all(stdout_fd, data)
    except (BrokenPipeError, ValueError):
        return EXIT_OK  # the client closed its stdout: it has gone
    except OSError as e:
        print(f"sandbox: the connection to the sandbox server failed: {e.strerror or e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        sock.close()
    if stdin_closed.is_set():
        return EXIT_OK
    print("sandbox: the sandbox server closed the connection (the frontend's `sandbox serve` has ended?)",
          file=sys.stderr)
    return EXIT_FAILED


def attach(path: str) -> int:
    """Connect, then bridge this process's stdin/stdout; the exit code."""
    try:
        sock = connect(path)
    except AttachError as e:
        print(f"sandbox: {e}", file=sys.stderr)
        return e.code
    return bridge(sock)
