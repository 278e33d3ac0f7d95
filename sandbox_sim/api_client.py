"""A test client for ``sandbox serve``: spawns it, speaks JSON Lines, validates everything.

Every line the agent writes to stdout is parsed and validated against the shipped JSON
Schema (``response`` or ``event``) as it arrives, and every result and event payload also
against its pydantic model (:mod:`sandbox.api.messages`: model and schema agree) — a
message that does not match fails the test that receives it. Every stderr line must be a JSON log record. Waiting is
condition-based: :meth:`ApiClient.request` waits for its response, :meth:`wait_event`
for a matching event, each with a timeout; nothing sleeps.

``Commands`` spells the few file operations the tests need for either guest: the
scripted guest's script language or a real shell in the VM.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys
import threading
from typing import Callable

from pydantic import ValidationError

from sandbox.api import schema
from sandbox.api.messages.events import EVENTS
from sandbox.api.messages.results import RESULTS

TIMEOUT_S = 60.0


class ProtocolViolation(AssertionError):
    pass


def model_error(msg: dict, request_type: str | None) -> tuple[str, str] | None:
    """``(model, reason)`` if ``msg``'s payload — the result of a ``request_type`` request, or
    an event — does not validate against its pydantic model (strictly: no coercion), else None."""
    model = RESULTS.get(request_type) if request_type else EVENTS.get(msg.get("type"))
    if model is None or msg.get("status") == "error":
        return None
    try:
        model.model_validate_json(json.dumps(msg.get("payload")), strict=True)
    except ValidationError as e:
        return model.__name__, str(e)[:300]
    return None


class ApiClient:
    def __init__(self, *args: str, guest: str = "scripted", env: dict | None = None, log_level: str = "debug",
                 timeout_s: float = TIMEOUT_S):
        self.timeout_s = timeout_s
        cmd = [sys.executable, "-m", "sandbox", "serve", "--guest", guest, "--log-level", log_level, *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, **(env or {})})
        self.messages: list[dict] = []  # everything from stdout, in order
        self.logs: list[dict] = []
        self.violations: list[str] = []
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._sent: dict = {}  # request_id -> type, so an ok response's payload is checked against result.<type>
        self._eof = False
        self._threads = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ reading

    def _read_stdout(self) -> None:
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                msg = None
            problem = None
            if not isinstance(msg, dict):
                problem = f"stdout line is not a JSON object: {raw[:200]!r}"
            else:
                kind = "response" if msg.get("type") == "response" else "event"
                err = schema.first_error(kind, msg)
                if err is None and kind == "response" and msg.get("status") == "ok":
                    rid = msg.get("request_id")
                    kind = f"result.{self._sent.get(rid) if isinstance(rid, (str, int)) else None}"
                    if kind in schema.shipped()["$defs"]:
                        err = schema.first_error(kind, msg.get("payload"))
                if err is None:
                    err = model_error(msg, self._sent.get(msg.get("request_id")) if kind.startswith("result.") else None)
                if err is not None:
                    problem = f"{kind} does not match the schema at {err[0]}: {err[1]} — {str(msg)[:300]}"
            with self._cond:
                if problem:
                    self.violations.append(problem)
                if isinstance(msg, dict):
                    self.messages.append(msg)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            try:
                rec = json.loads(raw)
                ok = isinstance(rec, dict) and {"timestamp", "level", "component", "message"} <= rec.keys()
            except ValueError:
                rec, ok = None, False
            with self._cond:
                if ok:
                    self.logs.append(rec)
                else:
                    self.violations.append(f"stderr line is not a JSON log record: {raw[:200]!r}")
                self._cond.notify_all()  # a wait may be for a log record

    def _wait(self, predicate: Callable[[], object], timeout_s: float | None, what: str):
        with self._cond:
            self._cond.wait_for(lambda: predicate() or self._eof, timeout_s or self.timeout_s)
            value = predicate()
            if value:
                return value
            if self._eof:
                raise AssertionError(f"the agent exited (rc={self.proc.poll()}) while waiting for {what}; "
                                     f"stderr tail: {self.logs[-5:]}")
            raise TimeoutError(f"no {what} within {timeout_s or self.timeout_s} s")

    # ------------------------------------------------------------------ writing

    def send_raw(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, type_: str, payload: dict | None = None, request_id=None) -> object:
        rid = request_id if request_id is not None else f"r{next(self._ids)}"
        msg = {"type": type_, "request_id": rid}
        if isinstance(rid, (str, int)):
            self._sent[rid] = type_
        if payload is not None:
            msg["payload"] = payload
        self.send_raw(json.dumps(msg).encode() + b"\n")
        return rid

    def response(self, rid, timeout_s: float | None = None) -> dict:
        def find():
            return next((m for m in self.messages if m.get("type") == "response" and m.get("request_id") == rid), None)

        return self._wait(find, timeout_s, f"the response to {rid!r}")

    def request(self, type_: str, payload: dict | None = None, timeout_s: float | None = None) -> dict:
        """Send and wait; returns the whole response (status ok or error)."""
        return self.response(self.send(type_, payload), timeout_s)

    def ok(self, type_: str, payload: dict | None = None, timeout_s: float | None = None) -> dict:
        r = self.request(type_, payload, timeout_s)
        if r["status"] != "ok":
            raise AssertionError(f"{type_} failed: {r['error']}")
        return r["payload"]

    def error(self, type_: str, payload: dict | None = None, timeout_s: float | None = None) -> dict:
        r = self.request(type_, payload, timeout_s)
        if r["status"] != "error":
            raise AssertionError(f"{type_} succeeded but an error was expected: {r['payload']}")
        return r["error"]

    def events(self, name: str | None = None, since: int = 0) -> list[dict]:
        with self._cond:
            return [m for m in self.messages[since:] if m.get("type", "").startswith("event.")
                    and (name is None or m["type"] == name)]

    def mark(self) -> int:
        with self._cond:
            return len(self.messages)

    def wait_event(self, name: str, where: Callable[[dict], bool] = lambda p: True, since: int = 0,
                   timeout_s: float | None = None) -> dict:
        def find():
            return next((m for m in self.messages[since:] if m.get("type") == name and where(m["payload"])), None)

        return self._wait(find, timeout_s, f"event {name}")

    # ------------------------------------------------------------------ lifecycle

    def close(self, timeout_s: float = 60.0) -> int:
        """Close stdin (the agent stops its session and exits); returns the exit code."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("the agent did not exit after stdin closed") from None
        for t in self._threads:
            t.join(10)
        return rc

    def check(self) -> None:
        """Every message so far matched its schema and every stderr line was a JSON log."""
        with self._cond:
            if self.violations:
                raise ProtocolViolation("\n".join(self.violations[:10]))


class Commands:
    """The file operations the protocol tests run, for the scripted guest or a real shell."""

    def __init__(self, guest: str):
        self.vm = guest == "vm"

    def write(self, path: str, text: str) -> str:
        return f"printf %s {shlex.quote(text)} > {shlex.quote(path)}" if self.vm else f"write {shlex.quote(path)} {shlex.quote(text)}"

    def gen(self, d: str, n: int) -> str:
        if self.vm:
            return f"mkdir -p {shlex.quote(d)} && for i in $(seq -w 1 {n}); do echo $i > {shlex.quote(d)}/f$i; done"
        return f"gen {shlex.quote(d)} {n}"

    def rm_r(self, path: str) -> str:
        return f"rm -rf {shlex.quote(path)}" if self.vm else f"rm -r -f {shlex.quote(path)}"

    def replace_by_symlink(self, path: str, target: str) -> str:
        """``rm -rf PATH && ln -s TARGET PATH`` in one command."""
        if self.vm:
            return f"rm -rf {shlex.quote(path)} && ln -s {shlex.quote(target)} {shlex.quote(path)}"
        return f"rm -r -f {shlex.quote(path)}; ln -s {shlex.quote(target)} {shlex.quote(path)}"

    def wait(self) -> str:
        return "sleep 1000" if self.vm else "wait"

    def crash(self) -> str:
        """The guest dies mid-command."""
        return "poweroff -ff; echo o > /proc/sysrq-trigger; sleep 60" if self.vm else "halt"

    def echo(self, text: str) -> str:
        return f"echo {shlex.quote(text)}"

    def exit(self, code: int) -> str:
        return f"exit {code}"
