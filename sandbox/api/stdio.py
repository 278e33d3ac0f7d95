"""``sandbox serve``: the STDIO API's transport — JSON Lines on stdin/stdout.

Reading: one request per line, at most ``max_line_bytes`` (a longer line is discarded up
to its newline and answered with ``protocol.line_too_long``). Every line is answered:
bad JSON, a non-object, a schema violation, an unknown type — each gets an error
response (``request_id`` null unless the line carried a valid one: a request_id that is
not a string of at most 256 characters or a 64-bit integer is never echoed). Nothing a
client sends can stop the agent; only the end of stdin (or SIGTERM/SIGINT) does, and
then the session is stopped cleanly.

Decoding (:func:`decode_request`, sans-I/O): the nesting of arrays and objects is measured
on the text *before* it is parsed — a linear scan, no recursion — and a line nested
deeper than ``max_json_depth`` is refused with ``protocol.too_deep``, so neither the
parser, the schema validator nor an error message ever recurses over client-chosen
depth. Numbers: an integral float (``1e9``, ``2.0``) is decoded as an ``int`` — JSON
Schema counts it as an integer, so the handlers must see one; ``NaN``/``Infinity`` are
not JSON and are refused. Any other failure while handling a line is a bug: it is
answered ``protocol.internal``, logged with its traceback, and the next line is read.

Order: requests are started in the order they arrive, and each runs on its own thread
(at most ``max_in_flight``), so a long one (``agent.execute``) does not hold up the rest
and responses come in completion order — correlate by ``request_id``. Two exceptions
keep pipelining safe: ``session.start``/``stop``/``reset`` are barriers — they start once
every earlier request has finished (so ``session.stop`` waits for a running command:
send ``agent.cancel`` first to cut it short), and later requests start after them; and
``hello``, ``session.status``, ``safeguard.confirm`` and ``agent.cancel`` start at once,
even while a barrier waits.

Writing: one writer thread owns stdout, fed by an :class:`Outbox` of at most
``max_output_bytes`` of encoded messages, so a slow reader never blocks the filesystem
server that emits events — and a client that stops reading cannot grow the agent's memory.
When the outbox is full, a response or a command's output event waits for room (so the
reader stops reading stdin, and a command's output is paced by the client, as a pipe
paces it); any other event is dropped instead — counted, and reported by one
``event.warning`` just before the next message that gets through. One message larger than the whole limit waits until
the outbox is empty, then goes alone. Messages of one operation are queued in order — its
events before its response. Nothing but protocol messages is ever written to stdout; logs
go to stderr (:mod:`sandbox.api.logs`).

Ending: at the end of stdin every request already received is carried out and answered,
then the session is stopped and :meth:`StdioServer.serve` returns. SIGTERM or SIGINT
(:class:`KeyboardInterrupt`) instead cancels the running command and stops at once.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import queue
import re
import threading
from typing import BinaryIO

from . import protocol
from .agent import Agent
from .errors import ApiError, to_api_error
from .logs import bind_context, bound

log = logging.getLogger("sandbox.api")

LINE_BYTES_MAX = 64 << 20  # in-memory mounts travel as base64 inside session.start
#: encoded messages waiting for stdout (a 16 MiB fs.read is ~22 MiB of base64 in one response)
OUTPUT_BYTES_MAX = 64 << 20
#: messages that wait for room in a full outbox rather than being dropped
_WAIT_FOR_ROOM = frozenset({"response", "event.terminal_output", "event.agent_output"})
IN_FLIGHT_MAX = 32
#: arrays/objects nested in one line, the request object counting 1 (a valid request nests at most 5)
JSON_DEPTH_MAX = 64
_STOP = object()
#: finish before anything that arrived after them starts
LIFECYCLE = frozenset({"session.start", "session.stop", "session.reset"})
#: start at once, ahead of queued requests (answers a frontend needs while others wait)
IMMEDIATE = frozenset({"hello", "session.status", "safeguard.confirm", "agent.cancel"})


# A JSON string, possessively (each character is consumed once: linear on any input). An
# unterminated string runs to the end of the text rather than failing, so a hostile line of
# quotes and backslashes cannot make the search restart at every quote.
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """The deepest nesting of arrays/objects in ``text`` without parsing it: strings are cut
    out, then the brackets left are counted. Linear time, no recursion. Exact for valid JSON;
    for invalid JSON it still counts every bracket the parser would open before its first
    error (up to there, strings begin and end where the parser's do), so the parser never
    nests deeper than this says."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, brackets), initial=0))


def _number(literal: str) -> int | float:
    """A JSON number with a fraction or exponent: an int when integral (``1e9``, ``2.0``) —
    JSON Schema's ``integer`` accepts those, so handlers must get an int — else a float."""
    f = float(literal)
    return int(f) if f.is_integer() else f


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def decode_request(line: bytes, depth_max: int = JSON_DEPTH_MAX) -> object:
    """One line → its JSON value, or :class:`ApiError` (``protocol.invalid_json``/``too_deep``).

    The encoding is detected as :func:`json.loads` does (UTF-8 unless a BOM or NULs say
    UTF-16/32); the depth is checked on the decoded text before parsing (the bracket count
    is a cheap upper bound, so the scan runs only for lines with many brackets).
    """
    try:
        text = line.decode(json.detect_encoding(line), "surrogatepass")
    except UnicodeDecodeError as e:
        raise ApiError("protocol.invalid_json", f"not JSON: not valid {e.encoding} at byte {e.start}",
                       position=e.start) from None
    if text.count("[") + text.count("{") > depth_max and json_depth(text) > depth_max:
        raise ApiError("protocol.too_deep", f"arrays/objects nested deeper than {depth_max} levels: not parsed",
                       limit=depth_max)
    try:
        return json.loads(text, parse_float=_number, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ApiError("protocol.invalid_json", f"not JSON: {e.msg}", position=e.pos) from None
    except (ValueError, RecursionError) as e:  # a 5,000-digit integer, NaN (RecursionError: defensive, see json_depth)
        raise ApiError("protocol.invalid_json", f"not JSON: {str(e)[:200]}") from None


def _encode(msg: dict) -> bytes:
    """One protocol line, always valid UTF-8: a message holding a lone surrogate (a client's
    ``"\\ud800"`` echoed in a request_id or a path) is written with ``\\u`` escapes instead."""
    text = json.dumps(msg, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(msg, separators=(",", ":")).encode("ascii")


class Outbox:
    """The messages waiting for stdout: at most ``bytes_max`` encoded bytes (module docstring).

    :meth:`put` of a line that does not fit waits for room if ``wait`` (else it is dropped and
    counted); nothing waits once the writer is gone (:meth:`close`: the client closed stdout)
    or the agent is stopping (:meth:`stop_waiting`) — a line that does not fit is then dropped."""

    def __init__(self, bytes_max: int = OUTPUT_BYTES_MAX, dropped_line=None):
        """``dropped_line(n)``: the line that reports ``n`` dropped lines; it goes in just before
        the next line that gets in, and counts against the bound with it: a line for which
        there is room, but not for the report too, waits or is dropped like any line that
        does not fit."""
        self.bytes_max = bytes_max
        self._dropped_line = dropped_line
        self.queued_bytes = 0
        self.dropped = 0  # lines dropped since the last warning about it
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._waiting = 0
        self._closed = False
        self._no_wait = False

    def put(self, line, *, wait: bool) -> bool:
        """Queue ``line`` (bytes, or the writer's stop sentinel, which always goes in)."""
        n = len(line) if isinstance(line, bytes) else 0
        with self._cond:
            while True:
                report = self._dropped_line(self.dropped) if self.dropped and n and self._dropped_line is not None else None
                if not (n and self.queued_bytes and self.queued_bytes + n + (len(report) if report else 0) > self.bytes_max):
                    break
                if not wait or self._closed or self._no_wait:
                    self.dropped += 1
                    return False
                self._waiting += 1
                self._cond.notify_all()
                try:
                    self._cond.wait()
                finally:
                    self._waiting -= 1
            if self._closed and n:
                return False
            if report is not None:
                self._items.append(report)
                self.queued_bytes += len(report)
                self.dropped = 0
            self._items.append(line)
            self.queued_bytes += n
            self._cond.notify_all()
            return True

    def get(self):
        with self._cond:
            while not self._items:
                self._cond.wait()
            line = self._items.popleft()
            self.queued_bytes -= len(line) if isinstance(line, bytes) else 0
            self._cond.notify_all()
            return line

    def close(self) -> None:
        """The writer is gone: nothing is queued or waits any more."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self.queued_bytes = 0
            self._cond.notify_all()

    def stop_waiting(self) -> None:
        """The agent is stopping at once (a signal): a line that does not fit is dropped."""
        with self._cond:
            self._no_wait = True
            self._cond.notify_all()

    def wait_blocked(self, timeout: float | None = None) -> bool:
        """Wait until some :meth:`put` waits for room (tests; True if one does)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting > 0, timeout)


def _dropped_warning(bytes_max: int):
    return lambda n: _encode({"type": "event.warning", "payload": {
        "message": f"{n} events were dropped: the client did not read stdout (more than {bytes_max} bytes were waiting)"}})


def _line_of(msg) -> bytes | None:
    """``msg`` encoded; a message that cannot be (a bug, RecursionError too) never breaks the
    stream: a response becomes ``protocol.internal`` for its request, an event is dropped (None)."""
    try:
        return _encode(msg)
    except Exception as e:
        log.exception("unserialisable message replaced by protocol.internal")
        if not (isinstance(msg, dict) and msg.get("type") == "response"):
            return None
        rid = msg.get("request_id")  # the client still gets its one response
        return _encode({"type": "response", "request_id": rid if protocol.valid_request_id(rid) else None,
                        "status": "error", "error": ApiError("protocol.internal",
                                                             "internal error: the response could not be encoded",
                                                             exception=type(e).__name__).as_dict()})


class StdioServer:
    def __init__(self, infile: BinaryIO, outfile: BinaryIO, *, guest: str = "vm",
                 max_line_bytes: int = LINE_BYTES_MAX, max_in_flight: int = IN_FLIGHT_MAX,
                 max_json_depth: int = JSON_DEPTH_MAX, max_output_bytes: int = OUTPUT_BYTES_MAX,
                 as_root: bool = False, agent_class: type[Agent] = Agent):
        """``agent_class``: the :class:`Agent` to build (``sandbox serve --mcp-socket`` passes one that
        also tells the MCP socket when its session starts and stops)."""
        self.infile = infile
        self.outfile = outfile
        self.max_line_bytes = max_line_bytes
        self.max_json_depth = max_json_depth
        self.max_in_flight = max_in_flight
        self.output = Outbox(max_output_bytes, _dropped_warning(max_output_bytes))
        self._writer = threading.Thread(target=self._write_loop, name="stdio-writer", daemon=True)
        self._queue: queue.Queue = queue.Queue()  # requests in arrival order, for the dispatcher
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="stdio-dispatch", daemon=True)
        self._in_flight = threading.BoundedSemaphore(max_in_flight)
        self._workers: set[threading.Thread] = set()
        self._workers_lock = threading.Lock()
        self.agent = agent_class(self.send, guest=guest, as_root=as_root)

    # ------------------------------------------------------------------ output

    def send(self, message: dict) -> None:
        """Queue one message for stdout (any thread); see :class:`Outbox` for a full one."""
        if message is _STOP:
            self.output.put(_STOP, wait=False)
            return
        line = _line_of(message)
        if line is None:
            return
        wait = isinstance(message, dict) and message.get("type") in _WAIT_FOR_ROOM
        if not self.output.put(line, wait=wait) and not wait and self.output.dropped == 1:  # the first of a run
            log.warning("stdout is full: events are dropped until the client reads (first: %s)", message.get("type"))

    def _write_loop(self) -> None:
        while True:
            line = self.output.get()
            if line is _STOP:
                return
            try:
                self.outfile.write(line + b"\n")
                self.outfile.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.output.close()
                return  # the client is gone; the reader sees EOF too

    def _respond(self, request_id, payload: dict | None = None, error: ApiError | None = None) -> None:
        if error is None:
            self.send({"type": "response", "request_id": request_id, "status": "ok", "payload": payload or {}})
        else:
            self.send({"type": "response", "request_id": request_id, "status": "error", "error": error.as_dict()})

    # ------------------------------------------------------------------ input

    def serve(self) -> int:
        """Read requests until EOF; returns the process exit code (0)."""
        self._writer.start()
        self._dispatcher.start()
        log.info("stdio API ready (protocol %d)", protocol.PROTOCOL_VERSION)
        interrupted = False
        try:
            while True:
                line = self.infile.readline(self.max_line_bytes + 1)
                if not line:
                    break
                if len(line) > self.max_line_bytes and not line.endswith(b"\n"):
                    self._discard_rest()
                    self._respond(None, error=ApiError("protocol.line_too_long",
                                                       f"a line longer than {self.max_line_bytes} bytes was discarded",
                                                       limit_bytes=self.max_line_bytes))
                    continue
                if line.strip():
                    self._line(line)
        except KeyboardInterrupt:
            log.info("interrupted: cancelling and stopping")
            interrupted = True
        finally:
            self._shutdown(interrupted)
        return 0

    def _discard_rest(self) -> None:
        while True:
            chunk = self.infile.readline(1 << 20)
            if not chunk or chunk.endswith(b"\n"):
                return

    def _line(self, line: bytes) -> None:
        """Answer one line; never raises (an unexpected exception is a bug: protocol.internal)."""
        rid = None
        try:
            msg = decode_request(line, self.max_json_depth)
            if not isinstance(msg, dict):
                raise ApiError("protocol.not_an_object", "a request is a JSON object")
            rid = msg.get("request_id")
            if not protocol.valid_request_id(rid):
                rid = None  # never echoed: it may be huge, deep or of any type
            t = msg.get("type")
            if isinstance(t, str) and t not in protocol.REQUEST_TYPES:
                raise ApiError("protocol.unknown_type", f"unknown request type {t[:100]!r}",
                               type=t[:100], known=sorted(protocol.REQUEST_TYPES))
            problem = protocol.first_error("request", msg)
            if problem is not None:
                path, reason = problem
                raise ApiError("protocol.invalid_request", f"{path}: {reason}", path=path, reason=reason)
            self._submit(t, msg.get("payload", {}), rid)
        except ApiError as e:
            self._respond(rid, error=e)
        except Exception as e:
            log.exception("a request line could not be handled")
            self._respond(rid, error=ApiError("protocol.internal", f"internal error: {type(e).__name__}",
                                              exception=type(e).__name__))

    def _submit(self, t: str, payload: dict, rid) -> None:
        if not self._in_flight.acquire(blocking=False):
            raise ApiError("protocol.busy", f"more than {self.max_in_flight} requests in flight", limit=self.max_in_flight)
        try:
            if t == "hello":  # answered before anything read after it
                self._run(t, payload, rid)
            elif t in IMMEDIATE:
                self._spawn(t, payload, rid)
            else:
                self._queue.put((t, payload, rid))
        except BaseException:
            if t != "hello":  # _run releases its own slot
                self._in_flight.release()
            raise

    def _dispatch_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            t, payload, rid = item
            try:
                if t not in LIFECYCLE:
                    self._spawn(t, payload, rid)
                    continue
                self._join_workers()  # a barrier: after everything before it, before everything after it
            except Exception as e:  # a bug (or no thread to be had): answer it, keep dispatching
                self._in_flight.release()
                log.exception("request %s could not be started", t)
                self._respond(rid, error=ApiError("protocol.internal", f"internal error: {type(e).__name__}",
                                                  exception=type(e).__name__))
                continue
            self._run(t, payload, rid)  # never raises: every failure becomes its response

    def _spawn(self, t: str, payload: dict, rid) -> None:
        """Run the request on a new worker thread; if none can start, the caller still owns its slot."""
        worker = threading.Thread(target=bind_context(self._run, t, payload, rid), name=f"request-{rid}", daemon=True)
        with self._workers_lock:
            self._workers.add(worker)
        try:
            worker.start()
        except BaseException:
            with self._workers_lock:
                self._workers.discard(worker)
            raise

    def _run(self, t: str, payload: dict, rid) -> None:
        try:
            with bound(request_id=rid):
                log.debug("request %s", t)
                try:
                    result = self.agent.handle(t, payload, rid)
                except BaseException as e:  # noqa: BLE001 — every failure becomes a response
                    err = to_api_error(e)
                    if err.code == "protocol.internal":
                        log.exception("request %s failed", t)
                    else:
                        log.info("request %s: %s", t, err.code)
                    self._respond(rid, error=err)
                else:
                    self._respond(rid, result)
        finally:
            self._in_flight.release()
            with self._workers_lock:
                self._workers.discard(threading.current_thread())

    def _shutdown(self, interrupted: bool) -> None:
        if interrupted:
            self.output.stop_waiting()  # nothing waits for a client that may never read again
            self.agent.cancel_running()
        else:
            log.info("stdin closed: finishing the requests received, then stopping")
        self._queue.put(_STOP)
        while True:
            try:
                self._join_requests()
                break
            except KeyboardInterrupt:  # a signal while finishing: cancel, then finish quickly
                log.info("interrupted: cancelling the running command")
                self.agent.cancel_running()
        try:
            self.agent.shutdown()
        except Exception:
            log.exception("stopping the session failed")
        self.output.put(_STOP, wait=False)
        self._writer.join(timeout=10)

    def _join_requests(self) -> None:
        self._dispatcher.join()
        self._join_workers()

    def _join_workers(self) -> None:
        while True:
            with self._workers_lock:
                workers = list(self._workers)
            if not workers:
                return
            for w in workers:
                w.join()
