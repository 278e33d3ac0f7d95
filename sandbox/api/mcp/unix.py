"""``sandbox serve --mcp-socket PATH``: MCP on a unix socket, beside the STDIO API, over one shared session.

Who may connect — three checks, each enough to keep another user out:

* **the directory**: the socket's parent directory is created ``0700`` if it is missing; an
  existing one must be a real directory (not a symlink) owned by this process's user with no
  group/world access bits, else the server refuses to start (:class:`SocketPathError`);
* **the socket file** is ``0600``; a stale socket at the path (nobody listening) is replaced,
  a live one or any other file is refused;
* **peer credentials**: each accepted connection's ``SO_PEERCRED`` uid must be this
  process's uid or root (0), else it is refused;
* **the token**: 32 random bytes (hex) made per server, written ``0600`` to ``PATH.token``
  (:func:`token_path`) and never logged or printed. The client's first line is the
  handshake ``SANDBOX-MCP/1 <token>\\n`` (at most ``HANDSHAKE_LINE_BYTES_MAX`` bytes, within
  ``HANDSHAKE_TIMEOUT_S``); the answer is ``OK\\n``, or ``ERR <reason> <message>\\n`` and the
  connection is closed. Reasons: ``bad_handshake``, ``bad_token``, ``peer_refused``, ``busy``.

After ``OK`` the connection carries newline-delimited JSON-RPC (:mod:`sandbox.api.mcp.lines`):
one connection is one MCP session, served by ``serve_connection(read_stream, write_stream)``
(``sandbox.api.mcp.server.serve_streams`` over the shared session's host).

Bounds: at most ``SOCKET_CONNECTIONS_MAX`` connections are served at once (one more gets
``ERR busy`` and is closed, logged); the handshake's size and time limits above; a message's
size (:data:`~sandbox.api.mcp.lines.MESSAGE_BYTES_MAX`).

The server runs its own event loop on its own thread (:meth:`McpSocketServer.start`), so the
threaded STDIO server is untouched; :meth:`McpSocketServer.close` cancels every connection,
removes the socket and the token file, and returns when the loop has ended.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import socket
import stat
import struct
import threading
from typing import Awaitable, Callable

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.abc import SocketAttribute, SocketListener, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from .lines import line_streams

log = logging.getLogger("sandbox.mcp")

#: MCP connections served at once over the socket (one more: ``ERR busy``, closed)
SOCKET_CONNECTIONS_MAX = 8
#: the handshake line, newline included
HANDSHAKE_LINE_BYTES_MAX = 512
#: from accept to the handshake's newline
HANDSHAKE_TIMEOUT_S = 10.0
TOKEN_BYTES = 32
HANDSHAKE_MAGIC = "SANDBOX-MCP/1"
TOKEN_SUFFIX = ".token"

ServeConnection = Callable[[object, object], Awaitable[None]]


class SocketPathError(ValueError):
    """The socket path cannot be used safely (the message says why)."""


def token_path(socket_path: str) -> str:
    """Where the server writes the token of the socket at ``socket_path`` (``PATH.token``)."""
    return socket_path + TOKEN_SUFFIX


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected unix socket (``SO_PEERCRED``)."""
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def peer_allowed(uid: int) -> bool:
    """The same user as this process, or root."""
    return uid in (os.geteuid(), 0)


def check_private_dir(path: str, *, create: bool) -> None:
    """``path`` is a directory of ours that nobody else can enter (created ``0700`` if asked
    and missing); else :class:`SocketPathError`."""
    if create and not os.path.lexists(path):
        try:
            os.mkdir(path, 0o700)
        except FileNotFoundError:
            raise SocketPathError(f"cannot create {path!r}: its parent does not exist") from None
        os.chmod(path, 0o700)  # the umask may have taken bits away; never adds any
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SocketPathError(f"the socket's directory {path!r} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SocketPathError(f"the socket's directory {path!r} is not a directory (a symlink is refused)")
    if st.st_uid != os.geteuid():
        raise SocketPathError(f"the socket's directory {path!r} belongs to uid {st.st_uid}, not to us "
                              f"(uid {os.geteuid()}): choose a directory of your own")
    if st.st_mode & 0o077:
        raise SocketPathError(f"the socket's directory {path!r} is accessible to others "
                              f"(mode {stat.S_IMODE(st.st_mode):04o}): it must be 0700")


def _remove_stale(path: str) -> None:
    """A socket at ``path`` that nobody listens on is removed; a live one, or any other
    file, is :class:`SocketPathError`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{path!r} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)
        return
    except OSError as e:
        raise SocketPathError(f"{path!r}: {e.strerror}") from None
    finally:
        probe.close()
    raise SocketPathError(f"{path!r} is in use: another server listens on it")


def bind_socket(path: str) -> socket.socket:
    """A listening unix socket at ``path`` (``0600``, in a private directory): see the module's checks."""
    path = os.path.abspath(path)
    check_private_dir(os.path.dirname(path), create=True)
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(SOCKET_CONNECTIONS_MAX)
    except BaseException:
        sock.close()
        raise
    return sock


def write_token(path: str) -> str:
    """A fresh token, written ``0600`` to ``path`` (replacing a file there, never following a symlink)."""
    token = secrets.token_hex(TOKEN_BYTES)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return token


def read_token(socket_path: str) -> str:
    """The token of the server at ``socket_path`` (OSError if it cannot be read)."""
    with open(token_path(socket_path), "rb") as f:
        return f.read(2 * TOKEN_BYTES + 2).decode("ascii", "replace").strip()


def handshake_line(token: str) -> bytes:
    return f"{HANDSHAKE_MAGIC} {token}\n".encode()


class McpSocketServer:
    """Listens on ``path``; each authenticated connection is served by ``serve_connection``."""

    def __init__(self, path: str, serve_connection: ServeConnection, *,
                 connections_max: int = SOCKET_CONNECTIONS_MAX, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S):
        self.path = os.path.abspath(path)
        self.serve_connection = serve_connection
        self.connections_max = connections_max
        self.handshake_timeout_s = handshake_timeout_s
        self.active = 0  # connections past the handshake (loop thread only)
        self._token = ""
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._loop_token = None
        self._scope: anyio.CancelScope | None = None
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind (checks above), write the token, serve on a thread; returns once it accepts.
        Raises :class:`SocketPathError` or ``OSError`` when the socket cannot be made."""
        self._sock = bind_socket(self.path)
        try:
            self._token = write_token(token_path(self.path))
        except BaseException:
            self._remove_files(token=False)
            raise
        self._thread = threading.Thread(target=self._run, name="mcp-socket", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """Stop accepting, end every connection, remove the socket and the token file."""
        if self._thread is None:
            return
        if self._loop_token is not None and self._scope is not None:
            try:
                anyio.from_thread.run_sync(self._scope.cancel, token=self._loop_token)
            except RuntimeError:
                pass  # the loop has already ended
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        try:
            anyio.run(self._main)
        except BaseException as e:  # noqa: BLE001 — reported to start(), or logged
            if not self._ready.is_set():
                self._failure = e
            else:
                log.exception("the MCP socket server failed")
        finally:
            self._remove_files()
            self._ready.set()

    def _remove_files(self, token: bool = True) -> None:
        for p in (self.path, token_path(self.path)) if token else (self.path,):
            try:
                os.unlink(p)
            except OSError:
                pass
        if self._sock is not None:
            self._sock.close()

    async def _main(self) -> None:
        listener = await SocketListener.from_socket(self._sock)
        self._loop_token = anyio.lowlevel.current_token()
        with anyio.CancelScope() as scope:
            self._scope = scope
            self._ready.set()
            log.info("MCP socket listening on %s", self.path, extra={"component": "mcp"})
            async with listener, anyio.create_task_group() as tg:
                while True:
                    try:
                        conn = await listener.accept()
                    except OSError as e:  # EMFILE and friends: the next accept may work
                        log.warning("accept failed: %s", e, extra={"component": "mcp"})
                        await anyio.sleep(0.1)
                        continue
                    tg.start_soon(self._connection, conn)

    # ------------------------------------------------------------------ one connection

    async def _refuse(self, conn: SocketStream, reason: str, message: str) -> None:
        log.warning("MCP socket connection refused (%s): %s", reason, message, extra={"component": "mcp"})
        with anyio.move_on_after(1):
            try:
                await conn.send(f"ERR {reason} {message}\n".encode())
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
        await conn.aclose()

    async def _connection(self, conn: SocketStream) -> None:
        try:
            uid = peer_uid(conn.extra(SocketAttribute.raw_socket))
        except OSError as e:
            return await self._refuse(conn, "peer_refused", f"peer credentials unavailable: {e.strerror}")
        if not peer_allowed(uid):
            return await self._refuse(conn, "peer_refused", f"uid {uid} is not the server's user")
        if self.active >= self.connections_max:
            return await self._refuse(conn, "busy", f"{self.connections_max} MCP connections are already served")
        self.active += 1  # counted from here: a slow handshake holds a slot until its deadline
        try:
            buffered = BufferedByteReceiveStream(conn)
            line = b""
            with anyio.move_on_after(self.handshake_timeout_s):
                try:
                    line = await buffered.receive_until(b"\n", HANDSHAKE_LINE_BYTES_MAX)
                except (anyio.DelimiterNotFound, anyio.IncompleteRead, anyio.EndOfStream, OSError,
                        anyio.BrokenResourceError, anyio.ClosedResourceError):
                    line = b""
            magic, _, token = line.decode("ascii", "replace").strip().partition(" ")
            if magic != HANDSHAKE_MAGIC:
                return await self._refuse(conn, "bad_handshake",
                                          f"expected '{HANDSHAKE_MAGIC} <token>' within {self.handshake_timeout_s:g} s "
                                          f"and {HANDSHAKE_LINE_BYTES_MAX} bytes")
            if not hmac.compare_digest(token.encode(), self._token.encode()):
                return await self._refuse(conn, "bad_token", "the token does not match this server's")
            await conn.send(b"OK\n")
            log.info("MCP connection accepted (uid %d, %d active)", uid, self.active, extra={"component": "mcp"})
            async with line_streams(conn, buffered=buffered) as (read_stream, write_stream):
                await self.serve_connection(read_stream, write_stream)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
            log.info("MCP connection lost: %s", type(e).__name__, extra={"component": "mcp"})
        except Exception:
            log.exception("an MCP connection failed")
        finally:
            self.active -= 1
            with anyio.CancelScope(shield=True):
                await conn.aclose()
            log.info("MCP connection closed (%d active)", self.active, extra={"component": "mcp"})


def connect_error(e: OSError) -> str:
    """A sentence for a failed connect to the socket."""
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return "no MCP socket there: is `sandbox serve --mcp-socket PATH` running?"
    if e.errno == errno.ECONNREFUSED:
        return "nobody listens on the socket (a stale socket: the server has gone)"
    if e.errno == errno.EACCES:
        return "permission denied: the socket belongs to another user"
    return e.strerror or str(e)
