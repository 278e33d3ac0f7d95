"""One connection's request pipeline: requests run at once, or wait as tasks behind a hold gate.

Shared by the protocol servers (9P today; FUSE and virtio-fs next): the server decodes a
request and says which export's gate it must pass (``export``: None for a request that
cannot mutate an intercepted tree — the protocol's message table decides that); the
pipeline runs it:

* not gated — at once, in the caller's turn of the event loop;
* gated — it counts as *in flight* for the export's step tracker from now until its reply
  (``Provider.op_started``/``op_finished``), so a step's quiescence window waits for it;
  if the gate is busy, or the request meets a safeguard hold, it becomes a task owned by
  the pipeline under the request's ``key`` (a 9P tag, a FUSE unique id) and its reply
  goes out when the task ends — later requests go on (pipelining);
* :meth:`RequestPipeline.cancel` (``Tflush``, FUSE ``INTERRUPT``) cancels a waiting
  request: it never runs (the gate hands its place on) and is never answered — unless
  the canceller gives an ``answer`` (FUSE must answer an interrupted request: ``EINTR``);
  a safeguard hold it was waiting on stays pending (:mod:`.holds`).

Invariants: ``reply(result, error)`` is called exactly once per request that is not
cancelled, and for a cancelled one only with the canceller's ``answer`` (once, after the
task has ended); a request that ended before the cancel took effect keeps its own reply;
``held_bytes`` is the size of the requests
waiting now (the server's backpressure bound); every task is in ``tasks`` until it ends,
and :meth:`RequestPipeline.cancel_all` cancels them for the caller to await — nothing is
left running.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Hashable, TypeVar

from ..core.errors import HoldRequired
from .exports import Export

T = TypeVar("T")
Reply = Callable[[object, "BaseException | None"], None]


class RequestPipeline:
    def __init__(self, on_settled: Callable[[], None] | None = None):
        """``on_settled()`` runs after a deferred request's reply (the server reads on)."""
        self.tasks: dict[Hashable, asyncio.Task] = {}
        self.held_bytes = 0  # bytes of requests waiting behind a hold gate
        self._answers: dict[Hashable, BaseException] = {}  # cancelled requests to answer anyway
        self._on_settled = on_settled or (lambda: None)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.tasks

    def run(self, key: Hashable, export: Export | None, op: Callable[[], T], size: int, reply: Reply) -> bool:
        """Carry out request ``key`` (``op`` does it; ``size``: its bytes). True if it was
        deferred (its reply comes later), False if ``reply`` was already called."""
        if export is None or export.gate is None:
            try:
                result = op()
            except Exception as e:
                reply(None, e)
            else:
                reply(result, None)
            return False
        provider, gate = export.provider, export.gate
        provider.op_started()
        try:
            if gate.busy:
                self._defer(key, gate.submit(op), provider, size, reply)
                return True
            try:
                result = op()
            except HoldRequired as held:
                self._defer(key, gate.submit(op, held.hold), provider, size, reply)
                return True
        except Exception as e:
            provider.op_finished()
            reply(None, e)
            return False
        provider.op_finished()
        reply(result, None)
        return False

    def _defer(self, key: Hashable, task: asyncio.Task, provider, size: int, reply: Reply) -> None:
        self.tasks[key] = task
        self.held_bytes += size

        def done(t: asyncio.Task) -> None:
            provider.op_finished()
            self.tasks.pop(key, None)
            self.held_bytes -= size
            answer = self._answers.pop(key, None)
            if t.cancelled():
                if answer is not None:
                    reply(None, answer)
                self._on_settled()
                return
            e = t.exception()
            reply(t.result() if e is None else None, e)
            self._on_settled()

        task.add_done_callback(done)

    def own(self, key: Hashable, task: asyncio.Task) -> None:
        """Keep a protocol's own task (e.g. the one answering a flush) under ``key`` until it ends."""
        self.tasks[key] = task
        task.add_done_callback(lambda _t: (self.tasks.pop(key, None), self._answers.pop(key, None)))

    def cancel(self, key: Hashable, answer: BaseException | None = None) -> asyncio.Task | None:
        """Cancel request ``key`` if it is waiting; returns its task (await it), or None.
        ``answer``: the error a cancelled request is answered with (None: no answer)."""
        t = self.tasks.get(key)
        if t is not None and t.cancel() and answer is not None and key not in self._answers:
            self._answers[key] = answer
        return t

    def cancel_all(self, answer: BaseException | None = None) -> list[asyncio.Task]:
        """Cancel every task (the connection is gone); returns them for the caller to await.
        ``answer``: as for :meth:`cancel`."""
        tasks = list(self.tasks.values())
        for key in list(self.tasks):
            self.cancel(key, answer)
        return tasks
