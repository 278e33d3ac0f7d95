"""``sandbox serve``: the STDIO API's transport — JSON Lines on stdin/stdout.

Reading: one request per line, at most ``max_line_bytes`` (a longer line is discarded up
to its newline and answered with ``protocol.line_too_long``). Every line is answered:
bad JSON, a non-object, a schema violation, an unknown type — each gets an error
response (``request_id`` null when it could not be read). Nothing a client sends can
stop the agent; only the end of stdin (or SIGTERM/SIGINT) does, and then the session
is stopped cleanly.

Order: requests are started in the order they arrive, and each runs on its own thread
(at most ``max_in_flight``), so a long one (``agent.execute``) does not hold up the rest
and responses come in completion order — correlate by ``request_id``. Two exceptions
keep pipelining safe: ``session.start``/``stop``/``reset`` are barriers — they start once
every earlier request has finished (so ``session.stop`` waits for a running command:
send ``agent.cancel`` first to cut it short), and later requests start after them; and
``hello``, ``session.status``, ``safeguard.confirm`` and ``agent.cancel`` start at once,
even while a barrier waits.

Writing: one writer thread owns stdout, fed by a queue, so a slow reader never blocks
the filesystem server that emits events. Messages of one operation are queued in order
— its events before its response. Nothing but protocol messages is ever written to
stdout; logs go to stderr (:mod:`sandbox.api.logs`).

Ending: at the end of stdin every request already received is carried out and answered,
then the session is stopped and :meth:`StdioServer.serve` returns. SIGTERM or SIGINT
(:class:`KeyboardInterrupt`) instead cancels the running command and stops at once.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import BinaryIO

from . import schema
from .agent import Agent
from .errors import ApiError, to_api_error
from .logs import bind_context, bound

log = logging.getLogger("sandbox.api")

LINE_BYTES_MAX = 64 << 20  # in-memory mounts travel as base64 inside session.start
IN_FLIGHT_MAX = 32
_STOP = object()
#: finish before anything that arrived after them starts
LIFECYCLE = frozenset({"session.start", "session.stop", "session.reset"})
#: start at once, ahead of queued requests (answers a frontend needs while others wait)
IMMEDIATE = frozenset({"hello", "session.status", "safeguard.confirm", "agent.cancel"})


class StdioServer:
    def __init__(self, infile: BinaryIO, outfile: BinaryIO, *, guest: str = "vm",
                 max_line_bytes: int = LINE_BYTES_MAX, max_in_flight: int = IN_FLIGHT_MAX):
        self.infile = infile
        self.outfile = outfile
        self.max_line_bytes = max_line_bytes
        self.max_in_flight = max_in_flight
        self._out: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="stdio-writer", daemon=True)
        self._queue: queue.Queue = queue.Queue()  # requests in arrival order, for the dispatcher
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="stdio-dispatch", daemon=True)
        self._in_flight = threading.BoundedSemaphore(max_in_flight)
        self._workers: set[threading.Thread] = set()
        self._workers_lock = threading.Lock()
        self.agent = Agent(self.send, guest=guest)

    # ------------------------------------------------------------------ output

    def send(self, message: dict) -> None:
        """Queue one message for stdout (any thread)."""
        self._out.put(message)

    def _write_loop(self) -> None:
        while True:
            msg = self._out.get()
            if msg is _STOP:
                return
            try:
                line = json.dumps(msg, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
            except (TypeError, ValueError) as e:  # a bug: never let it break the stream
                log.error("unserialisable message dropped: %s", e)
                continue
            try:
                self.outfile.write(line + b"\n")
                self.outfile.flush()
            except (BrokenPipeError, ValueError, OSError):
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
        log.info("stdio API ready (protocol %d)", schema.PROTOCOL_VERSION)
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
        try:
            msg = json.loads(line)
        except json.JSONDecodeError as e:
            self._respond(None, error=ApiError("protocol.invalid_json", f"not JSON: {e.msg}", position=e.pos))
            return
        except (ValueError, RecursionError) as e:
            self._respond(None, error=ApiError("protocol.invalid_json", f"not JSON: {e}"))
            return
        if not isinstance(msg, dict):
            self._respond(None, error=ApiError("protocol.not_an_object", "a request is a JSON object"))
            return
        rid = msg.get("request_id")
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            rid = None
        t = msg.get("type")
        if isinstance(t, str) and t not in schema.REQUESTS:
            self._respond(rid, error=ApiError("protocol.unknown_type", f"unknown request type {t[:100]!r}",
                                              type=t[:100], known=sorted(schema.REQUESTS)))
            return
        problem = schema.first_error("request", msg)
        if problem is not None:
            path, reason = problem
            self._respond(rid, error=ApiError("protocol.invalid_request", f"{path}: {reason}", path=path, reason=reason))
            return
        payload = msg.get("payload", {})
        if not self._in_flight.acquire(blocking=False):
            self._respond(rid, error=ApiError("protocol.busy", f"more than {self.max_in_flight} requests in flight",
                                              limit=self.max_in_flight))
            return
        if t == "hello":  # answered before anything read after it
            self._run(t, payload, rid)
        elif t in IMMEDIATE:
            self._spawn(t, payload, rid)
        else:
            self._queue.put((t, payload, rid))

    def _dispatch_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            t, payload, rid = item
            if t in LIFECYCLE:  # a barrier: after everything before it, before everything after it
                self._join_workers()
                self._run(t, payload, rid)
            else:
                self._spawn(t, payload, rid)

    def _spawn(self, t: str, payload: dict, rid) -> None:
        worker = threading.Thread(target=bind_context(self._run, t, payload, rid), name=f"request-{rid}", daemon=True)
        with self._workers_lock:
            self._workers.add(worker)
        worker.start()

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
        self._out.put(_STOP)
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
