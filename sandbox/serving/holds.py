"""Safeguard holds while serving: one :class:`HoldBroker` per session, a :class:`HoldGate` per export.

**The broker** owns every pending hold of a session, the answers and the one deadline.
Whoever meets a hold registers it (:meth:`HoldBroker.register` — the session does when
the undo core reports one; a gate does when a request meets it, :meth:`HoldBroker.wait`);
subscribers (:meth:`HoldBroker.subscribe`: the STDIO agent, the SDK, later MCP, the
session's VM pause/resume hook, a ``decide`` callback through :meth:`HoldBroker.ask`) get
``("triggered", payload)`` once per hold and ``("resolved", payload)`` once when it ends;
anyone answers with :meth:`HoldBroker.answer`. Invariants:

* a hold is answered at most once: the first answer wins (``True``), later ones — from
  anywhere — get ``False``; the answer reaches the undo core (``resolve(id, action)``, a
  deny rolls the step back) in the answering thread *before* ``answer`` returns, and only
  then are the waiting requests woken;
* one deadline per hold, set when it is registered: ``timeout_s`` of the safeguard
  (:class:`~sandbox.core.safeguard.SafeguardConfig`; the hold carries it) after that.
  When it passes the hold is denied (``reason: "timeout"``) by whoever notices first —
  a waiting request or :meth:`HoldBroker.poll`, which the servers call;
* a waiter that is cancelled (``Tflush``, a closed connection) leaves the hold pending:
  the next request that meets it waits on the same entry and the same deadline;
* bounded: ``HOLDS_PENDING_PER_SESSION_MAX`` pending holds (one more is denied at once,
  logged), ``HOLD_SUBSCRIBERS_MAX`` subscribers (one more: ``RuntimeError``);
* thread-safe: any thread may register, answer, subscribe. Callbacks run in the thread
  that caused the change (a server's loop, the answering thread); they must not block
  and must not answer synchronously (answer from a task or another thread) — an
  exception in one is logged and ignored.

**The gate** (one per intercepted export): mutations on the export wait, in arrival order,
behind a safeguard hold. When the undo core says *hold* (an operation would cross a
safeguard threshold), the operation has not run. The server does not answer it: the
guest blocks mid-syscall. Every later mutation on the same export queues behind it
(reads and other exports go on). The hold is decided through the broker:

* **allow** — the held operation is retried and runs, then the queue is released one
  operation at a time, in order (each may hold again; the rest stay queued);
* **deny** (an answer, the deadline, or the session stopping) — the core rolls the step
  back; the held operation and every queued one fail with ``EIO``
  (:class:`~sandbox.core.errors.SafeguardDenied`).

Gate invariants: at most one operation of the export is past the gate at a time while the
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
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

from ..core.errors import HoldRequired, SafeguardDenied
from ..core.safeguard import Hold
from ..limits import HELD_REQUESTS_PER_EXPORT_MAX, HOLD_SUBSCRIBERS_MAX, HOLDS_PENDING_PER_SESSION_MAX

T = TypeVar("T")
ACTIONS = ("allow", "deny")
#: ``resolve(hold_id, action)``: tell the undo core (``Interceptor.resolve_hold``); KeyError if it no longer has the hold
Resolve = Callable[[str, str], object]
#: ``callback(kind, payload)``, kind ``"triggered"`` or ``"resolved"``
Subscriber = Callable[[str, dict], None]
Decide = Callable[[Hold], "str | Awaitable[str]"]
#: ended holds remembered, so a request retried just after the answer does not raise the hold again
#: (an id is not reused by its core: a restarted session's cores are new objects)
FINISHED_REMEMBERED_MAX = 4 * HOLDS_PENDING_PER_SESSION_MAX
log = logging.getLogger("sandbox.safeguard")


def _check_action(action: str) -> None:
    if action not in ACTIONS:
        raise ValueError(f"action must be 'allow' or 'deny', not {action!r}")


def hold_of(payload: dict) -> Hold:
    """A :class:`Hold` with a payload's fields (for ``decide(hold)`` callbacks); times relative to 0."""
    return Hold(payload["safeguard_id"], payload.get("step_id", 0), payload.get("kind", "delete"),
                payload.get("count", 0), payload.get("path", ""), list(payload.get("sample_paths", [])),
                0.0, float(payload.get("timeout_seconds", 0.0)))


def _scope(resolve: Resolve):
    """Whose hold it is: the undo core ``resolve`` belongs to (each numbers its holds on its own)."""
    return getattr(resolve, "__self__", resolve)


class _Ref:
    """A reference to a scope that never confuses a dead one with a new one at the same address."""

    def __init__(self, obj):
        try:
            self._get = weakref.ref(obj)
        except TypeError:
            self._get = lambda: obj

    def alive_as(self, obj) -> bool:
        return self._get() is obj


@dataclass(eq=False)
class _Entry:
    payload: dict  # the event.safeguard_triggered payload; its safeguard_id is the public id
    core_id: str  # the id the undo core knows it by
    key: tuple  # (id(scope), core_id)
    resolve: Resolve
    registered_s: float
    deadline_s: float
    exact: bool  # the deadline came from the Hold itself (not a caller's timeout)
    waiters: list = field(default_factory=list)  # (loop, future) of requests waiting; (None, threading.Event)
    tasks: list = field(default_factory=list)  # (loop, task) of decide callbacks, cancelled when resolved


class HoldBroker:
    """The session's safeguard holds: pending ones, their answers, their one deadline (module docstring).

    Public ids: a hold keeps its undo core's id (``sg_001``) unless another core's pending
    hold has it already (two working folders number their holds independently); then it
    is ``sg_001.2``, ``sg_001.3``, … — an answer always names exactly one hold."""

    def __init__(self, *, pending_max: int = HOLDS_PENDING_PER_SESSION_MAX,
                 subscribers_max: int = HOLD_SUBSCRIBERS_MAX, clock_s: Callable[[], float] = time.monotonic):
        if pending_max < 1 or subscribers_max < 1:
            raise ValueError("pending_max and subscribers_max must be >= 1")
        self.pending_max = pending_max
        self.subscribers_max = subscribers_max
        self.clock_s = clock_s
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # public id -> pending hold
        self._by_key: dict[tuple, str] = {}  # (id(scope), core id) -> public id, pending holds
        #: recently ended holds (so a request retried just after the answer does not raise it
        #: again): (id(scope), core id) -> (action, _Ref(scope))
        self._finished: OrderedDict[tuple, tuple[str, _Ref]] = OrderedDict()
        self._subscribers: list[_Subscription] = []

    # ------------------------------------------------------------------ registering

    def register(self, hold: Hold | dict, resolve: Resolve, *, timeout_s: float | None = None,
                 context: dict | None = None) -> dict | None:
        """Make ``hold`` pending (idempotent: a hold already pending keeps its entry and
        deadline, and subscribers hear of it once). ``hold``: the core's :class:`Hold`, or an
        ``event.safeguard_triggered`` payload with ``timeout_s``; ``resolve``: how the
        answer reaches that core (a bound method: its object tells cores apart).
        ``context``: fields added to the payload (e.g. ``directory``). Returns the payload
        (with the public ``safeguard_id``), or None when ``pending_max`` holds are pending
        already (the caller denies it)."""
        if isinstance(hold, Hold):
            payload, timeout, exact = hold.as_dict(), max(0.0, hold.deadline_s - hold.created_s), True
        else:
            if timeout_s is None:
                raise ValueError("a hold given as a payload needs timeout_s")
            payload, timeout, exact = dict(hold), max(0.0, float(timeout_s)), False
        core_id = payload["safeguard_id"]
        scope = _scope(resolve)
        key = (id(scope), core_id)
        with self._lock:
            if self._ended(key, scope) is not None:  # met again after its answer (a retry racing it)
                return {**payload, **(context or {}), "timeout_seconds": timeout}
            public = self._by_key.get(key)
            if public is not None:
                e = self._entries[public]
                for k, v in (context or {}).items():
                    e.payload.setdefault(k, v)
                if exact and not e.exact:  # the hold's own timeout is the one that counts
                    e.deadline_s, e.exact = e.registered_s + timeout, True
                    e.payload["timeout_seconds"] = timeout
                return dict(e.payload)
            if len(self._entries) >= self.pending_max:
                log.error("safeguard %s: %d holds are pending already (HOLDS_PENDING_PER_SESSION_MAX): denied",
                          core_id, len(self._entries))
                return None
            public, n = core_id, 1
            while public in self._entries:
                n += 1
                public = f"{core_id}.{n}"
            now = self.clock_s()
            payload = {**payload, **(context or {}), "timeout_seconds": timeout, "safeguard_id": public}
            self._entries[public] = _Entry(payload, core_id, key, resolve, now, now + timeout, exact)
            self._by_key[key] = public
            out = dict(payload)
        self._notify("triggered", out)
        return out

    def _ended(self, key: tuple, scope) -> str | None:
        """The action a hold that ended recently was given, or None. Under the lock."""
        got = self._finished.get(key)
        if got is None or not got[1].alive_as(scope):
            return None
        return got[0]

    async def wait(self, hold: Hold, resolve: Resolve, context: dict | None = None) -> str:
        """Register ``hold`` and wait (on the running loop) until it is answered or its
        deadline passes; return the action. Cancelling the wait leaves the hold pending."""
        if self.register(hold, resolve, context=context) is None:
            return self._refused(hold.id, resolve)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        waiter = (loop, fut)
        public, remaining = self._attach(hold.id, resolve, waiter)
        if public is None:
            return remaining
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), remaining)
                except asyncio.TimeoutError:
                    pass
                remaining = self._past_deadline(public)  # the loop's timer may fire a little early
                if remaining is None:
                    return self._outcome(hold.id, resolve)
        finally:
            self._drop_waiter(public, waiter)

    def wait_blocking(self, hold: Hold, resolve: Resolve, context: dict | None = None) -> str:
        """:meth:`wait` for a thread without an event loop (e.g. an ``InterceptedFS.decide``)."""
        if self.register(hold, resolve, context=context) is None:
            return self._refused(hold.id, resolve)
        done = threading.Event()
        waiter = (None, done)
        public, remaining = self._attach(hold.id, resolve, waiter)
        if public is None:
            return remaining
        try:
            while not done.wait(remaining):
                remaining = self._past_deadline(public)
                if remaining is None:
                    break
            return getattr(done, "action", None) or self._outcome(hold.id, resolve)
        finally:
            self._drop_waiter(public, waiter)

    def _attach(self, core_id: str, resolve: Resolve, waiter) -> tuple:
        """(public id, seconds to wait) with ``waiter`` attached — or (None, action) if it ended."""
        scope = _scope(resolve)
        key = (id(scope), core_id)
        with self._lock:
            public = self._by_key.get(key)
            if public is None:
                return None, self._ended(key, scope) or "deny"
            e = self._entries[public]
            e.waiters.append(waiter)
            return public, max(0.0, e.deadline_s - self.clock_s())

    def _outcome(self, core_id: str, resolve: Resolve) -> str:
        scope = _scope(resolve)
        with self._lock:
            return self._ended((id(scope), core_id), scope) or "deny"

    def _past_deadline(self, public: str) -> float | None:
        """A waiter's timer ran out: deny the hold if its deadline has passed. None if it
        has ended (here or elsewhere), else the seconds still to wait."""
        self._expire(public)
        with self._lock:
            e = self._entries.get(public)
            return None if e is None else max(0.0, e.deadline_s - self.clock_s())

    def _refused(self, core_id: str, resolve: Resolve) -> str:
        try:
            resolve(core_id, "deny")
        except KeyError:
            pass
        return "deny"

    def _drop_waiter(self, public: str, waiter) -> None:
        with self._lock:
            e = self._entries.get(public)
            if e is not None and waiter in e.waiters:
                e.waiters.remove(waiter)

    # ------------------------------------------------------------------ answering

    def pending(self) -> list[dict]:
        """The ``event.safeguard_triggered`` payloads of every pending hold, oldest first."""
        with self._lock:
            return [dict(e.payload) for e in self._entries.values()]

    def answer(self, hold_id: str, action: str) -> bool:
        """Decide a pending hold (its public id): the undo core hears it (a deny rolls the
        step back) before this returns. False if no such hold is pending (answered, timed
        out, unknown) — or if the core had already let it go (its own expiry): then it is
        denied."""
        _check_action(action)
        return self._finish(hold_id, action, "answered")

    def answer_core(self, resolve: Resolve, core_id: str, action: str) -> bool:
        """:meth:`answer` for a hold known by its undo core's own id and the ``resolve`` it was
        registered with (a caller inside the process that met the hold itself, e.g. an API
        write that cannot wait). False if that hold is not pending here."""
        _check_action(action)
        with self._lock:
            public = self._by_key.get((id(_scope(resolve)), core_id))
        return public is not None and self._finish(public, action, "answered")

    def deny_all(self, reason: str = "stopped") -> int:
        """Deny every pending hold (the session stops, the command is cancelled); how many."""
        with self._lock:
            ids = list(self._entries)
        return sum(self._finish(i, "deny", reason) for i in ids)

    def poll(self) -> int:
        """Deny the holds whose deadline has passed (nobody may be waiting on them); how many."""
        now = self.clock_s()
        with self._lock:
            due = [i for i, e in self._entries.items() if e.deadline_s <= now]
        return sum(self._expire(i) for i in due)

    def _expire(self, public: str) -> bool:
        with self._lock:
            e = self._entries.get(public)
            if e is None or e.deadline_s > self.clock_s():
                return False
        log.warning("safeguard %s timed out after %.1f s: denied", public, e.deadline_s - e.registered_s)
        return self._finish(public, "deny", "timeout")

    def _finish(self, public: str, action: str, reason: str) -> bool:
        with self._lock:
            e = self._entries.pop(public, None)
            if e is None:
                return False
            del self._by_key[e.key]
            ref = _Ref(_scope(e.resolve))
            self._finished[e.key] = (action, ref)
            while len(self._finished) > FINISHED_REMEMBERED_MAX:
                self._finished.popitem(last=False)
        decided, error = True, None
        try:
            e.resolve(e.core_id, action)
        except KeyError:  # the core let it go already (its own expiry): it was denied
            decided, action, reason = False, "deny", "timeout"
            with self._lock:
                self._finished[e.key] = (action, ref)
        except BaseException as exc:  # a failed rollback: the waiters still learn it from the core
            error = exc
        for loop, w in e.waiters:
            if loop is None:
                w.action = action
                w.set()
            else:
                loop.call_soon_threadsafe(lambda f=w, a=action: f.done() or f.set_result(a))
        for loop, t in e.tasks:
            loop.call_soon_threadsafe(t.cancel)
        self._notify("resolved", {**e.payload, "action": action, "reason": reason})
        if error is not None:
            raise error
        return decided

    # ------------------------------------------------------------------ subscribing

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """``callback(kind, payload)`` for every hold from now on; returns ``unsubscribe()``
        (idempotent). Holds already pending are not replayed: read :meth:`pending`."""
        with self._lock:
            if len(self._subscribers) >= self.subscribers_max:
                raise RuntimeError(f"more than {self.subscribers_max} hold subscribers (HOLD_SUBSCRIBERS_MAX)")
            token = _Subscription(callback)
            self._subscribers.append(token)

        def unsubscribe() -> None:
            with self._lock:
                if token in self._subscribers:
                    self._subscribers.remove(token)

        return unsubscribe

    def ask(self, decide: Decide) -> Callable[[], None]:
        """Subscribe a ``decide(hold) -> "allow" | "deny"`` callback (sync or async): each
        triggered hold is put to it and its answer given. An async one runs as a task on
        the loop that met the hold (cancelled if the hold is resolved otherwise); a sync
        one — it may prompt a human — in its own thread. A failing callback denies."""
        def on(kind: str, payload: dict) -> None:
            if kind != "triggered":
                return
            hold = hold_of(payload)
            if inspect.iscoroutinefunction(decide) or inspect.iscoroutinefunction(getattr(decide, "__call__", None)):  # noqa: B004 — is its __call__ a coroutine function, not "is it callable"
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    loop = None
                if loop is not None:
                    task = loop.create_task(self._ask_async(decide, hold))
                    with self._lock:
                        e = self._entries.get(hold.id)
                        if e is not None:
                            e.tasks.append((loop, task))
                            return
                    task.cancel()
                    return
                run = lambda: self._give(hold.id, asyncio.run(self._call(decide, hold)))  # noqa: E731
            else:
                run = lambda: self._give(hold.id, self._call_sync(decide, hold))  # noqa: E731
            threading.Thread(target=run, name=f"safeguard-{hold.id}", daemon=True).start()

        return self.subscribe(on)

    async def _ask_async(self, decide: Decide, hold: Hold) -> None:
        self._give(hold.id, await self._call(decide, hold))

    @staticmethod
    async def _call(decide: Decide, hold: Hold) -> str:
        try:
            result = decide(hold)
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("safeguard decision callback failed for %s: denying", hold.id)
            result = "deny"
        return result

    @staticmethod
    def _call_sync(decide: Decide, hold: Hold) -> str:
        try:
            return decide(hold)
        except Exception:
            log.exception("safeguard decision callback failed for %s: denying", hold.id)
            return "deny"

    def _give(self, hold_id: str, result) -> None:
        try:
            self.answer(hold_id, "allow" if result == "allow" else "deny")
        except Exception:
            log.exception("safeguard %s: answering failed", hold_id)

    def _notify(self, kind: str, payload: dict) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for s in subscribers:
            try:
                s.callback(kind, dict(payload))
            except Exception:
                log.exception("safeguard subscriber failed on %s %s", kind, payload.get("safeguard_id"))


@dataclass(eq=False)
class _Subscription:
    callback: Subscriber


class HoldGate:
    """One export's queue of mutations behind a safeguard hold (module docstring); its
    holds are decided through ``broker``. ``context``: fields for the hold's payload
    (e.g. the export's name)."""

    def __init__(self, interceptor, broker: HoldBroker, queue_max: int = HELD_REQUESTS_PER_EXPORT_MAX,
                 context: dict | None = None):
        if queue_max < 1:
            raise ValueError("queue_max must be >= 1")
        self.interceptor = interceptor
        self.broker = broker
        self.queue_max = queue_max
        self.context = dict(context or {})
        self._queue: deque[asyncio.Future] = deque()
        self._head = False  # an operation owns the gate (holding or running)
        self.pending: Hold | None = None  # the hold the head is waiting on

    @property
    def busy(self) -> bool:
        """True if a new mutation must go through :meth:`submit` instead of running inline."""
        return self._head or bool(self._queue)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, op: Callable[[], T], hold: Hold | None = None) -> "asyncio.Task[T]":
        """Take ``op``'s place in line now, synchronously, and return the task that runs it.

        ``hold``: ``op`` was just tried inline while the gate was idle and raised
        :class:`HoldRequired` for it — it becomes the head (and the hold is registered with
        the broker now, before anything else runs). Otherwise, if the gate is busy, ``op``
        queues (``ENOSPC`` past ``queue_max``), else it is the head at once. The task's
        result is ``op``'s; cancelling it (``Tflush``) at any moment — even before it
        started — gives its place up, and hands the head on if it had it."""
        loop = asyncio.get_running_loop()
        if hold is None and self.busy:
            if len(self._queue) >= self.queue_max:
                raise OSError(errno.ENOSPC, f"more than {self.queue_max} operations waiting behind a safeguard hold")
            turn = loop.create_future()
            self._queue.append(turn)
        else:
            self._head, turn = True, None
            if hold is not None:
                self.broker.register(hold, self.interceptor.resolve_hold, context=self.context)
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
            self.pending = hold
            try:
                await self.broker.wait(hold, self.interceptor.resolve_hold, self.context)
            finally:
                self.pending = None
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
