"""The control channel between the agent and a share-server process: JSON Lines over a socket.

One line is one JSON object, UTF-8, ending in ``\\n``:

* a **request** ``{"id": N, "op": NAME, "args": {...}}`` — either side may send one;
* its **reply** ``{"id": N, "ok": true, "result": ...}`` or
  ``{"id": N, "ok": false, "error": {"type": NAME, "message": str, "data": {...}}}``;
* an **event** ``{"event": NAME, ...}`` — no reply.

Invariants:

* a line is at most :data:`~sandbox.limits.CONTROL_LINE_BYTES_MAX` bytes; the sender refuses
  a longer one (``ValueError``, nothing sent); a reader meeting a longer one closes the
  channel — the framing is lost, and both peers are ours, so it is a bug, not a load;
* a line that is not a JSON object, or has neither ``op``, ``ok`` nor ``event``, is logged
  and skipped (:func:`decode_line` raises :class:`BadLine`); the channel goes on;
* each side's reader runs on its own thread; a request is handled on a worker thread of
  its own (a drain or a rollback must not block a hold's answer), at most
  :data:`~sandbox.limits.CONTROL_REQUESTS_IN_FLIGHT_MAX` at once — one more is answered
  ``channel.busy`` at once;
* a caller waits at most ``timeout_s`` (default :data:`~sandbox.limits.CONTROL_REPLY_TIMEOUT_S`)
  for a reply (``TimeoutError``); when the channel closes, every waiting caller gets
  :class:`ChannelClosed` and ``on_closed`` is called once;
* writes of whole lines are serialised (one lock), so lines never interleave.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from typing import Any, Callable

from ..limits import CONTROL_LINE_BYTES_MAX, CONTROL_REPLY_TIMEOUT_S, CONTROL_REQUESTS_IN_FLIGHT_MAX

log = logging.getLogger("sandbox.channel")
READ_CHUNK_BYTES = 64 * 1024

#: ``handler(op, args) -> result`` (JSON-able); an exception becomes the error reply
Handler = Callable[[str, dict], Any]


class ChannelClosed(ConnectionError):
    """The channel is closed (the peer exited, or a line broke the framing)."""


class BadLine(ValueError):
    """A line that is not a request, a reply or an event."""


class RemoteError(Exception):
    """The peer's handler raised: ``type`` is its class name, ``data`` its fields."""

    def __init__(self, type: str, message: str, data: dict | None = None):
        super().__init__(message)
        self.type = type
        self.message = message
        self.data = dict(data or {})


def encode_line(obj: dict, limit: int = CONTROL_LINE_BYTES_MAX) -> bytes:
    """``obj`` as one line; ValueError (nothing to send) if it is longer than ``limit`` bytes."""
    line = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n"
    if len(line) > limit:
        raise ValueError(f"a control line of {len(line)} bytes is over CONTROL_LINE_BYTES_MAX ({limit})")
    return line


def decode_line(line: bytes) -> dict:
    """One received line (without or with its ``\\n``) as a message dict; :class:`BadLine` if it is none."""
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadLine(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadLine(f"a line is a JSON object, not {type(obj).__name__}")
    if "event" in obj:
        if not isinstance(obj["event"], str):
            raise BadLine("event name is not a string")
        return obj
    if not isinstance(obj.get("id"), int) or isinstance(obj.get("id"), bool):
        raise BadLine("a request or reply needs an integer id")
    if "op" in obj:
        if not isinstance(obj["op"], str) or not isinstance(obj.get("args", {}), dict):
            raise BadLine("a request has a string op and an object args")
        return obj
    if isinstance(obj.get("ok"), bool):
        return obj
    raise BadLine("neither a request, a reply nor an event")


class LineReader:
    """Splits a byte stream into lines, each at most ``limit`` bytes (module docstring)."""

    def __init__(self, limit: int = CONTROL_LINE_BYTES_MAX):
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The complete lines ``data`` finishes; ValueError when a line is longer than the limit."""
        self._buf += data
        out = []
        while True:
            i = self._buf.find(b"\n")
            if i < 0:
                if len(self._buf) > self.limit:
                    raise ValueError(f"a control line is over {self.limit} bytes")
                return out
            if i + 1 > self.limit:
                raise ValueError(f"a control line is over {self.limit} bytes")
            out.append(bytes(self._buf[:i]))
            del self._buf[: i + 1]


class Channel:
    """One end of the control channel on a connected stream socket (module docstring)."""

    def __init__(self, sock: socket.socket, *, handler: Handler | None = None,
                 on_event: Callable[[dict], None] | None = None, on_closed: Callable[[str], None] | None = None,
                 name: str = "channel", line_max: int = CONTROL_LINE_BYTES_MAX,
                 in_flight_max: int = CONTROL_REQUESTS_IN_FLIGHT_MAX):
        self.sock = sock
        self.name = name
        self.handler = handler
        self.on_event = on_event
        self.on_closed = on_closed
        self.line_max = line_max
        self.bad_lines = 0
        self._slots = threading.BoundedSemaphore(in_flight_max)
        self._write_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next_id = 1
        self._waiting: dict[int, list] = {}  # id -> [threading.Event, reply or None]
        self._closed: str | None = None
        self._reader: threading.Thread | None = None

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def start(self) -> "Channel":
        self._reader = threading.Thread(target=self._read_loop, name=f"{self.name}-reader", daemon=True)
        self._reader.start()
        return self

    # ------------------------------------------------------------------ sending

    def _send(self, obj: dict) -> None:
        line = encode_line(obj, self.line_max)
        with self._write_lock:
            if self._closed is not None:
                raise ChannelClosed(f"{self.name}: {self._closed}")
            try:
                self.sock.sendall(line)
            except OSError as e:
                raise ChannelClosed(f"{self.name}: {e}") from None

    def send_event(self, event: str, **fields) -> None:
        """Send an event; ChannelClosed if the channel is closed."""
        self._send({"event": event, **fields})

    def request(self, op: str, args: dict | None = None, *, timeout_s: float = CONTROL_REPLY_TIMEOUT_S) -> Any:
        """Ask the peer to run ``op``; its result, or :class:`RemoteError` (its handler
        raised), :class:`ChannelClosed`, ``TimeoutError``."""
        done = threading.Event()
        with self._lock:
            if self._closed is not None:
                raise ChannelClosed(f"{self.name}: {self._closed}")
            rid = self._next_id
            self._next_id += 1
            box = [done, None]
            self._waiting[rid] = box
        try:
            self._send({"id": rid, "op": op, "args": args or {}})
            if not done.wait(timeout_s):
                raise TimeoutError(f"{self.name}: no reply to {op} within {timeout_s:g} s")
        finally:
            with self._lock:
                self._waiting.pop(rid, None)
        reply = box[1]
        if reply is None:
            raise ChannelClosed(f"{self.name}: {self._closed}")
        if reply["ok"]:
            return reply.get("result")
        err = reply.get("error") or {}
        raise RemoteError(str(err.get("type", "Exception")), str(err.get("message", "")), err.get("data"))

    # ------------------------------------------------------------------ receiving

    def _read_loop(self) -> None:
        reader = LineReader(self.line_max)
        why = "the peer closed the channel"
        try:
            while True:
                try:
                    data = self.sock.recv(READ_CHUNK_BYTES)
                except OSError as e:
                    why = f"read failed: {e}"
                    break
                if not data:
                    break
                try:
                    lines = reader.feed(data)
                except ValueError as e:
                    why = str(e)
                    log.error("%s: %s: closing the channel", self.name, e)
                    break
                for line in lines:
                    self._dispatch(line)
        finally:
            self.close(why)

    def _dispatch(self, line: bytes) -> None:
        try:
            msg = decode_line(line)
        except BadLine as e:
            self.bad_lines += 1
            log.warning("%s: bad line skipped (%s): %r", self.name, e, line[:200])
            return
        if "event" in msg:
            if self.on_event is not None:
                try:
                    self.on_event(msg)
                except Exception:
                    log.exception("%s: event handler failed on %s", self.name, msg.get("event"))
            return
        if "op" in msg:
            self._start_request(msg)
            return
        with self._lock:
            box = self._waiting.get(msg["id"])
        if box is None:
            log.warning("%s: a reply to no waiting request (id %s): skipped", self.name, msg["id"])
            return
        box[1] = msg
        box[0].set()

    def _start_request(self, msg: dict) -> None:
        rid = msg["id"]
        if self.handler is None:
            self._reply_error(rid, "channel.no_handler", f"{self.name} serves no requests")
            return
        if not self._slots.acquire(blocking=False):
            self._reply_error(rid, "channel.busy",
                              f"more than {CONTROL_REQUESTS_IN_FLIGHT_MAX} requests in flight (CONTROL_REQUESTS_IN_FLIGHT_MAX)")
            return
        threading.Thread(target=self._run_request, args=(msg,), name=f"{self.name}-{msg['op']}", daemon=True).start()

    def _run_request(self, msg: dict) -> None:
        rid = msg["id"]
        try:
            try:
                result = self.handler(msg["op"], msg.get("args", {}))
            except Exception as e:
                data = getattr(e, "data", None)
                self._reply_error(rid, type(e).__name__, str(getattr(e, "message", None) or e),
                                  data if isinstance(data, dict) else {})
                return
            try:
                self._send({"id": rid, "ok": True, "result": result})
            except ValueError as e:  # the result is too long: the caller learns why
                self._reply_error(rid, "channel.line_too_long", str(e))
            except ChannelClosed:
                pass
        finally:
            self._slots.release()

    def _reply_error(self, rid: int, type_: str, message: str, data: dict | None = None) -> None:
        try:
            self._send({"id": rid, "ok": False, "error": {"type": type_, "message": message[:4096],
                                                          "data": _jsonable(data or {})}})
        except (ChannelClosed, ValueError):
            pass

    # ------------------------------------------------------------------ closing

    def close(self, why: str = "closed") -> None:
        """Close the channel (idempotent): waiting callers get ChannelClosed, ``on_closed(why)`` once."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = why
            waiting = list(self._waiting.values())
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for box in waiting:
            box[0].set()
        if self.on_closed is not None:
            try:
                self.on_closed(why)
            except Exception:
                log.exception("%s: on_closed failed", self.name)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the reader thread to end (after :meth:`close` or the peer's exit)."""
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout_s)


def _jsonable(data: dict) -> dict:
    """``data`` with what JSON cannot carry turned into strings."""
    try:
        json.dumps(data)
        return data
    except (TypeError, ValueError):
        return {k: v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v) for k, v in data.items()}
