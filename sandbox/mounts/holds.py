"""HoldGate: mutations on one export wait, in arrival order, behind a safeguard hold.

When the undo core says *hold* (an operation would cross a safeguard threshold), the
operation has not run. The server does not answer it: the guest blocks mid-syscall.
Every later mutation on the same export queues behind it (reads and other exports go
on). The hold is resolved by a decision — the ``decide`` callback, an external
:meth:`HoldGate.resolve` (the STDIO API), or the timeout, which denies:

* **allow** — the held operation is retried and runs, then the queue is released one
  operation at a time, in order (each may hold again; the rest stay queued);
* **deny** — the core rolls the step back; the held operation and every queued one
  fail with ``EIO`` (:class:`~sandbox.core.errors.SafeguardDenied`).

Invariants: at most one operation of the export is past the gate at a time while the
gate is busy (the *head*); the queue never exceeds ``queue_max`` (one more is
``ENOSPC``); a waiter that is cancelled (``Tflush``) leaves the queue without running,
and if it had already been handed the head it hands it on. Whatever resolved the hold,
the truth is learnt by retrying the operation: the core refuses it if the step was
denied, so a decision made elsewhere cannot be misread here.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
from collections import deque
from typing import Awaitable, Callable, TypeVar

from ..core.errors import HoldRequired, SafeguardDenied
from ..core.safeguard import Hold
from ..limits import HELD_REQUESTS_PER_EXPORT_MAX

T = TypeVar("T")
QUEUE_MAX = HELD_REQUESTS_PER_EXPORT_MAX  # ServerLimits.held_requests_per_export_max
Decide = Callable[[Hold], "str | Awaitable[str]"]
log = logging.getLogger("sandbox.safeguard")


class HoldGate:
    def __init__(self, interceptor, decide: Decide | None = None, queue_max: int = QUEUE_MAX):
        if queue_max < 1:
            raise ValueError("queue_max must be >= 1")
        self.interceptor = interceptor
        self.decide = decide
        self.queue_max = queue_max
        self._queue: deque[asyncio.Future] = deque()
        self._head = False  # an operation owns the gate (holding or running)
        self._answers: dict[str, asyncio.Future] = {}
        self.pending: Hold | None = None  # the hold the head is waiting on

    @property
    def busy(self) -> bool:
        """True if a new mutation must go through :meth:`run` instead of running inline."""
        return self._head or bool(self._queue)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def resolve(self, hold_id: str, action: str) -> bool:
        """Answer the pending hold from outside (e.g. ``safeguard.confirm``). False if none."""
        if action not in ("allow", "deny"):
            raise ValueError(f"action must be 'allow' or 'deny', not {action!r}")
        fut = self._answers.get(hold_id)
        if fut is None or fut.done():
            return False
        fut.set_result(action)
        return True

    def submit(self, op: Callable[[], T], hold: Hold | None = None) -> "asyncio.Task[T]":
        """Take ``op``'s place in line now, synchronously, and return the task that runs it.

        ``hold``: ``op`` was just tried inline while the gate was idle and raised
        :class:`HoldRequired` for it — it becomes the head. Otherwise, if the gate is busy,
        ``op`` queues (``ENOSPC`` past ``queue_max``), else it is the head at once. The
        task's result is ``op``'s; cancelling it (``Tflush``) at any moment — even before
        it started — gives its place up, and hands the head on if it had it."""
        loop = asyncio.get_running_loop()
        if hold is None and self.busy:
            if len(self._queue) >= self.queue_max:
                raise OSError(errno.ENOSPC, f"more than {self.queue_max} operations waiting behind a safeguard hold")
            turn = loop.create_future()
            self._queue.append(turn)
        else:
            self._head, turn = True, None
        task = loop.create_task(self._run(op, hold, turn))
        task.add_done_callback(lambda _t: self._settle(turn))
        return task

    async def _run(self, op: Callable[[], T], hold: Hold | None, turn: asyncio.Future | None) -> T:
        if turn is not None:
            await turn  # a result: the head is ours; an exception: the step was denied
        while True:
            if hold is None:
                try:
                    return op()
                except HoldRequired as held:
                    hold = held.hold
                except SafeguardDenied as denied:
                    self._fail_queue(denied)
                    raise
            await self._decision(hold)
            hold = None  # retry: the core now knows the answer, whoever gave it

    def _settle(self, turn: asyncio.Future | None) -> None:
        """A task ended (done, failed or cancelled): give up its place or hand the head on."""
        if turn is None or (turn.done() and not turn.cancelled() and turn.exception() is None):
            self._hand_on()  # it was the head
        elif not turn.done():
            turn.cancel()  # cancelled while waiting (or before it ever ran): skipped by _hand_on

    def _hand_on(self) -> None:
        while self._queue:
            fut = self._queue.popleft()
            if not fut.done():
                fut.set_result(None)  # the head passes to this waiter
                return
        self._head = False

    def _fail_queue(self, denied: SafeguardDenied) -> None:
        while self._queue:
            fut = self._queue.popleft()
            if not fut.done():
                fut.set_exception(SafeguardDenied(str(denied)))

    async def _decision(self, hold: Hold) -> None:
        loop = asyncio.get_running_loop()
        answer = self._answers.get(hold.id)
        if answer is None:
            answer = self._answers[hold.id] = loop.create_future()
        self.pending = hold
        timeout_s = max(0.0, hold.deadline_s - hold.created_s)
        asker = None
        if self.decide is not None:
            asker = loop.create_task(self._ask(hold, answer))
        try:
            action = await asyncio.wait_for(asyncio.shield(answer), timeout_s)
        except asyncio.TimeoutError:
            action = "deny"
            log.warning("safeguard %s timed out after %.1f s: denied", hold.id, timeout_s)
        finally:
            self.pending = None
            self._answers.pop(hold.id, None)
            if asker is not None and not asker.done():
                asker.cancel()
                await asyncio.gather(asker, return_exceptions=True)
        try:
            self.interceptor.resolve_hold(hold.id, action)
        except KeyError:
            pass  # resolved elsewhere (expired in poll(), or answered through the core)

    async def _ask(self, hold: Hold, answer: asyncio.Future) -> None:
        try:
            result = self.decide(hold)
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("safeguard decision callback failed for %s: denying", hold.id)
            result = "deny"
        if not answer.done():
            answer.set_result("allow" if result == "allow" else "deny")
