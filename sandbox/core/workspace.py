"""Workspace: the undo core for one working folder, as embedders use it.

    ws = Workspace.open(workdir)            # lock the store, recover; ws.recovery reports it
    with ws.step("rm -rf build") as step:   # step.id is host-assigned
        ws.fs.remove_tree("build")          # ws.fs is the InterceptedFS
    ws.history()                            # newest first
    ws.rollback(1)

Servers use the doors below, never the parts behind them (the interceptor, the step
tracker and the undo log are private): ``begin_step``/``close_step`` (a command's step,
drained of late writes), ``op_started``/``op_finished`` (requests in flight),
``resolve_hold``/``pending_hold``, ``safeguard_config``/``limits``, ``active_step_id``/
``step_state``. A step's lifecycle is the state machine of :mod:`sandbox.core.steps`.

The store lives outside the working folder: by default under the user's state
directory, keyed by the folder's real path; ``state_dir=`` overrides it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import threading
import time
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

from ..hostfs import HostFS, is_within
from ..hostfs.real import RealHostFS
from . import preimage
from .errors import BarrierInTheWay, CorruptStep, ExternalChange, NoSuchStep, NothingToUndo, StepError, StepUnprotected, UndoUnavailable
from .intercepted_fs import Decide, InterceptedFS
from .interceptor import UndoInterceptor
from .safeguard import Hold, Safeguard, SafeguardConfig
from .steps import API, COMMAND, StepState, StepTracker
from .store import Limits, StepInfo, UndoLog

EVENTS_MAX = 1000
#: paths named in a rollback's result (``paths``; ``paths_truncated`` says more were undone, ``paths_restored`` counts all)
ROLLBACK_PATHS_LISTED_MAX = 1000
#: the longest :meth:`Workspace.close_step` waits for a step's late writes (wall clock)
DRAIN_S_MAX = 5.0
#: the shortest wait between two drain checks (no busy loop if the clocks disagree)
DRAIN_WAKE_S_MIN = 0.001


def default_state_dir(workdir: str) -> str:
    """``$XDG_STATE_HOME/sandbox/undo/<name>-<hash of the real path>`` (``~/.local/state`` default)."""
    real = os.path.realpath(workdir)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    digest = hashlib.sha256(os.fsencode(real)).hexdigest()[:16]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in os.path.basename(real))[:40] or "root"
    return os.path.join(base, "sandbox", "undo", f"{name}-{digest}")


@dataclass(init=False)
class StepHandle:
    id: int
    type: str
    command: str
    exit_code: int | None = None

    def __init__(self, id: int, type: str, command: str, exit_code: int | None = None):
        """Written out rather than generated, so that a campaign's build compiles it."""
        self.id = id
        self.type = type
        self.command = command
        self.exit_code = exit_code


class Workspace:
    def __init__(self, work: HostFS, store: HostFS, *, label: str = "", limits: Limits | None = None,
                 safeguard: SafeguardConfig | None = None, clock_s: Callable[[], float] | None = None,
                 clock_ns: Callable[[], int] | None = None, on_event: Callable[[dict], None] | None = None,
                 decide: Decide | None = None, ambient_idle_s: float = 5.0, quiescence_s: float = 0.1,
                 durable: bool = False):
        """Prefer :meth:`open` (real folders) or :meth:`open_on` (any HostFS pair)."""
        self.events: collections.deque[dict] = collections.deque(maxlen=EVENTS_MAX)
        self._on_event = on_event
        self.work = work
        self.store = store
        self.label = label
        self._log = UndoLog(store, limits, clock_ns=clock_ns, emit=self._emit, durable=durable)
        self.recovery = self._log.open(work, label)
        self._tracker = StepTracker(clock_s, ambient_idle_s=ambient_idle_s, quiescence_s=quiescence_s)
        self._interceptor = UndoInterceptor(work, self._log, self._tracker, Safeguard(safeguard, clock_s), emit=self._emit)
        # signalled when a request finishes or a step ends: close_step's drain waits on it
        self._settled = threading.Condition(self._interceptor.lock)
        self._drain_waiters = 0  # close_step calls waiting on it now (under the lock): whom op_finished wakes
        self.fs = InterceptedFS(work, self._interceptor, decide)
        self._closed = False
        self.unrecorded_step_id: int | None = None  # see close()
        self._real_fs: tuple[HostFS, ...] = ()  # open(): the real folders under any wrap_work, closed by close()

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, workdir: str, state_dir: str | None = None, *,
             wrap_work: Callable[[HostFS], HostFS] | None = None, **kwargs) -> "Workspace":
        """Open the working folder ``workdir`` with its undo store (created if needed).

        ``wrap_work(fs)``, if given, wraps the folder's host filesystem before anything
        touches it (e.g. a :class:`~sandbox.barriers.journal.RecordingHostFS`); every access
        to the folder then goes through the wrapper. :meth:`close` still closes the real one.
        """
        real, state = _store_path(workdir, state_dir)
        os.makedirs(state, mode=0o700, exist_ok=True)
        work = RealHostFS(real, name="work")
        store = RealHostFS(state, name="store")
        try:
            ws = cls(wrap_work(work) if wrap_work is not None else work, store, label=real, **kwargs)
            ws._real_fs = (work, store)
            return ws
        except BaseException:
            work.close()
            store.close()
            raise

    @staticmethod
    def discard_store(workdir: str, state_dir: str | None = None) -> None:
        """Delete the undo history of ``workdir`` without opening it: lock the store, wipe
        it, start a fresh one. Nothing is recovered, read or checked first, and the working
        folder is not touched — so it works whatever state the store is in (an undo that
        cannot finish, an unreadable journal, a foreign version): the way out when nothing
        else works. :class:`StoreBusy` if another process has the store open."""
        real, state = _store_path(workdir, state_dir)
        store = RealHostFS(state, name="store")
        try:
            UndoLog(store).wipe(real)
        finally:
            store.close()

    @classmethod
    def open_on(cls, work: HostFS, store: HostFS, **kwargs) -> "Workspace":
        """Open over any pair of host filesystems (the simulation uses MemoryHostFS)."""
        return cls(work, store, **kwargs)

    def close(self) -> None:
        """Close the active step (if any) and release the store's lock.

        A step that cannot be recorded now (the store's disk is full) does not make this
        fail: it stays in the write-ahead log, an ``event.warning`` says so, and
        :attr:`unrecorded_step_id` names it — the next open rolls it back (rule 5) and
        reports that in its recovery report."""
        if self._closed:
            return
        try:
            self._interceptor.close_now()
        except OSError as e:
            step = self._log.open_step
            if step is None or step.closing is None:
                raise
            self.unrecorded_step_id = step.id
            self._emit({"type": "event.warning", "code": "undo.promotion_failed", "step_id": step.id,
                        "message": f"closing: step {step.id} could not be recorded in the undo store ({e}); its changes "
                                   "stay in the folder, and it will be rolled back when the folder is next opened"})
        finally:
            self._closed = True
            self._log.close()
            for fs in (self.work, self.store, *self._real_fs):
                if isinstance(fs, RealHostFS):
                    fs.close()

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _emit(self, event: dict) -> None:
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)

    # ------------------------------------------------------------------ steps

    @contextlib.contextmanager
    def step(self, command: str, type: str = COMMAND) -> Iterator[StepHandle]:
        """One step: everything written inside the block is undone together.

        On an exception the step still closes (recording ``exit_code`` 1 unless set).
        """
        if type not in (COMMAND, API):
            raise ValueError("step type must be 'command' or 'api' (ambient steps open by themselves)")
        step_id = self._interceptor.begin_step(type, command)
        handle = StepHandle(step_id, type, command)
        try:
            yield handle
        except BaseException:
            if handle.exit_code is None:
                handle.exit_code = 1
            raise
        finally:
            with self._interceptor.lock:
                a = self._tracker.active
                if a is not None and a.id == step_id:
                    if not a.draining:
                        self._tracker.complete(step_id, handle.exit_code if handle.exit_code is not None else 0)
                    self._interceptor.close_now()

    def begin_step(self, command: str, type: str = COMMAND) -> int:
        """For servers: open a command step (the control channel's exec)."""
        if type not in (COMMAND, API):
            raise ValueError("step type must be 'command' or 'api' (ambient steps open by themselves)")
        return self._interceptor.begin_step(type, command)

    def complete_step(self, step_id: int, exit_code: int | None) -> None:
        """For servers: the command ended; the step drains, then closes (see poll)."""
        self._interceptor.complete_step(step_id, exit_code)

    def close_step(self, step_id: int, exit_code: int | None, drain_s: float = DRAIN_S_MAX) -> bool:
        """The command of step ``step_id`` ended with ``exit_code``: let the step drain —
        until no request is in flight (:meth:`op_finished`) or its quiescence window has
        passed — then close it; after ``drain_s`` (wall clock) it is closed regardless.
        Returns once the step has ended: True if it drained, False if ``drain_s`` cut it
        off (a request still in flight then lands in the next step). No-op (True) if
        ``step_id`` is not the active step (closed already, e.g. by an undo or a stop)."""
        deadline = time.monotonic() + max(0.0, drain_s)
        t = self._tracker
        with self._settled:  # the interceptor's lock: waiting releases it
            a = t.active
            if a is None or a.id != step_id:
                return True
            if not a.draining:
                self._interceptor.complete_step(step_id, exit_code)
            while True:
                self._interceptor.poll()
                a = t.active
                if a is None or a.id != step_id:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # still here: a request is in flight and the quiescence window is open; wake
                # when a request finishes (op_finished) or when the window is due to close
                quiet_in_s = a.drain_deadline_s - t.clock_s()
                self._drain_waiters += 1
                try:
                    self._settled.wait(min(left, max(quiet_in_s, DRAIN_WAKE_S_MIN)))
                finally:
                    self._drain_waiters -= 1
            self._interceptor.close_now()
            return False

    def poll(self) -> None:
        """Advance time-driven state: ambient idle close, quiescence, hold timeouts."""
        self._interceptor.poll()

    def close_active(self) -> None:
        """Close whatever step is active now, without waiting for it to drain or idle; or
        retry recording a step that has ended but could not be recorded yet (OSError if
        that fails again)."""
        self._interceptor.close_now()

    # ------------------------------------------------------------------ in flight

    def op_started(self) -> None:
        """A server received a request that may write: a draining step waits for it."""
        with self._interceptor.lock:
            self._tracker.op_started()

    def op_finished(self) -> None:
        """That request is answered (or abandoned); a draining :meth:`close_step` wakes."""
        with self._interceptor.lock:
            self._tracker.op_finished()
            if self._drain_waiters:  # none waits: no Condition to signal (every gated request comes here)
                self._settled.notify_all()

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """``op_started`` … ``op_finished`` around a block."""
        self.op_started()
        try:
            yield
        finally:
            self.op_finished()

    @property
    def requests_in_flight(self) -> int:
        with self._interceptor.lock:
            return self._tracker.in_flight

    # ------------------------------------------------------------------ step state

    @property
    def active_step_id(self) -> int | None:
        """The step writes are attributed to now (OPEN, COMPLETING or DENIED), as of the
        last poll; None: the next write opens an ambient step."""
        with self._interceptor.lock:
            a = self._tracker.active
            return a.id if a is not None else None

    def current_step(self) -> int | None:
        """:attr:`active_step_id` after a :meth:`poll` (time-driven closes applied)."""
        return self._interceptor.current_step()

    def step_state(self, step_id: int | None = None) -> StepState | None:
        """The lifecycle state (:class:`~sandbox.core.steps.StepState`) of the active step,
        or of the step that has ended and waits to be recorded (ENDED); with ``step_id``,
        that step's — also the final state (CLOSED, ROLLED_BACK, DISCARDED) of the newest
        step that reached one. None for anything else."""
        with self._interceptor.lock:
            for s in (self._tracker.active, self._tracker.ended):
                if s is not None and (step_id is None or s.id == step_id):
                    return s.state
            last = self._tracker.last
            if step_id is not None and last is not None and last.id == step_id:
                return last.state
            return None

    # ------------------------------------------------------------------ safeguards

    def resolve_hold(self, hold_id: str, action: str) -> Hold:
        """Answer a pending hold: ``allow`` (the held operation may be retried) or ``deny``
        (the step is rolled back now, and refuses further writes). KeyError if no such hold
        is pending (answered, or timed out)."""
        if action not in ("allow", "deny"):
            raise ValueError("action must be 'allow' or 'deny'")
        return self._interceptor.resolve_hold(hold_id, action)

    @property
    def pending_hold(self) -> Hold | None:
        """The hold every mutation waits behind (at most one per workspace), or None."""
        with self._interceptor.lock:
            return self._interceptor.safeguard.pending

    @property
    def safeguard_config(self) -> SafeguardConfig:
        """A copy of the safeguard settings (change them with :meth:`configure_safeguard`)."""
        with self._interceptor.lock:
            return dataclasses.replace(self._interceptor.safeguard.config)

    @property
    def limits(self) -> Limits:
        """A copy of the undo store's limits (change them with :meth:`configure_limits`)."""
        with self._interceptor.lock:
            return dataclasses.replace(self._log.limits)

    # ------------------------------------------------------------------ history

    def step_diff(self, step_id: int | None = None) -> dict:
        """What the finished step ``step_id`` (None: the newest) changed, preimage vs now —
        :func:`sandbox.core.diff.step_diff`, a method so a workspace served in another
        process (:class:`sandbox.serving.remote.RemoteWorkspace`) answers it where its store is."""
        from .diff import step_diff

        return step_diff(self, step_id)

    def history(self) -> list[dict]:
        """Finished steps, newest first, with the barriers that sit after each."""
        self._log.require_available()
        with self._interceptor.lock:
            barriers = self._log.barriers()
            out = []
            for s in reversed(self._log.steps()):
                entry = {"id": s.id, "seq": s.seq, "type": s.type, "command": s.command, "paths": list(s.paths),
                         "exit_code": s.exit_code, "outcome": s.outcome, "unprotected": s.unprotected,
                         "size_bytes": s.size_bytes, "started_ns": s.started_ns, "ended_ns": s.ended_ns,
                         "barriers": [{"id": b.id, "paths": b.paths, "created_ns": b.created_ns, "reason": b.reason}
                                      for b in barriers if b.after_seq == s.seq]}
                if s.corrupt:
                    entry["corrupt"] = s.corrupt
                out.append(entry)
            return out

    def barriers(self) -> list[dict]:
        return [b.as_dict() for b in self._log.barriers()]

    def record_external_modification(self, paths: list[str], reason: str = "external modification") -> dict:
        """A change to the folder that did not come through us: place a barrier after the newest step."""
        with self._interceptor.lock:
            b = self._log.add_barrier(list(paths), reason)
            self._emit({"type": "event.external_modification", "paths": b.paths, "barrier_id": b.id})
            return b.as_dict()

    # ------------------------------------------------------------------ rollback

    def rollback(self, n: int = 1, force: bool = False) -> dict:
        """Undo the newest ``n`` steps, newest first; they leave history (no redo).

        Refused, before anything is touched, if a barrier or an external change is in
        the way (unless ``force``), or if a step is unprotected or corrupt.

        Returns ``step_ids`` (undone, newest first), ``paths_restored`` (how many paths the
        steps touched), ``paths`` — ``{"path", "change": "restored"|"removed"|"recreated"}``
        per path, sorted, bounded (:func:`_rollback_paths`) — and ``paths_truncated``.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError("n must be a positive integer")
        i = self._interceptor
        with i.lock:
            self._log.require_available()
            a = self._tracker.active
            if a is not None and a.running:
                raise StepError(f"step {a.id} is still running; undo when it has finished", step_id=a.id)
            i.close_now()  # also promotes a step that ended but waits to be recorded (OSError if it still cannot)
            self._log.finish_recovery()  # RollbackIncomplete if an earlier rollback still cannot finish
            steps = self._log.steps()
            if len(steps) < n:
                raise NothingToUndo(f"only {len(steps)} step(s) in history, cannot undo {n}", available=len(steps))
            targets = steps[-n:]
            try:
                for s in reversed(targets):
                    if s.corrupt:
                        raise self._log.corrupt(s)
                    if s.unprotected:
                        raise StepUnprotected(f"step {s.id} is unprotected (it exceeded max_single_step_size_bytes) and cannot be rolled back", step_id=s.id)
                # every journal line, count and preimage checksum, before anything is touched
                records = {s.seq: self._log.records_of(s) for s in targets}
                for s in targets:
                    self._log.check_content(s, records[s.seq])
            except CorruptStep as e:
                raise CorruptStep(f"cannot undo: {e.message}; nothing was undone", **e.data) from None
            looked: dict[str, bool] = {}
            if not force:
                self._check_barriers(targets)
                looked = self._check_unchanged(targets, records)
            touched = sorted({p for s in targets for p in s.paths})
            present = {p for p in touched if (looked[p] if p in looked else self.work.lstat_or_none(p) is not None)}
            undone = []
            for s in reversed(targets):
                self._log.rollback_top(self.work, force=force, checked=records)
                undone.append(s.id)
            listed, truncated = _rollback_paths(self.work, touched, present)
            self._emit({"type": "event.rollback", "step_ids": undone, "paths_restored": len(touched)})
            return {"step_ids": undone, "paths_restored": len(touched), "paths": listed, "paths_truncated": truncated}

    def finish_pending(self) -> dict | None:
        """Finish a rollback interrupted by an I/O error (also done before the next step,
        rollback or open). Returns what it restored, or None if nothing was pending;
        :class:`RollbackIncomplete` if it still cannot finish."""
        with self._interceptor.lock:
            return self._log.finish_recovery()

    @property
    def rollback_pending(self) -> bool:
        """An undo or a recovery stopped part-way and is not finished yet (see
        :class:`RollbackIncomplete`): undo and new steps are refused until it is."""
        with self._interceptor.lock:
            return self._log.rollback_pending

    def _check_barriers(self, targets) -> None:
        oldest = targets[0].seq
        blocking = [b for b in self._log.barriers() if b.after_seq >= oldest]
        if blocking:
            names = sorted({p for b in blocking for p in b.paths})
            raise BarrierInTheWay(
                f"undo barrier in the way: {len(blocking)} external modification(s) since step {targets[0].id} "
                f"({', '.join(names[:5]) or 'paths unknown'}{', …' if len(names) > 5 else ''}); "
                "rolling back would overwrite them — use force to do it anyway",
                barrier_ids=[b.id for b in blocking], paths=names)

    def _check_unchanged(self, targets, records) -> dict[str, bool]:
        """Every path the rollback touches is exactly as its newest step left it. Returns
        whether something is at each path it looked at (nothing changes until the undo, all
        under the interceptor's lock), so the rollback need not look again.

        Paths moved by a newer step's rename are followed to where they are now. A file
        that changed only because a newer step wrote it through another hard link (the
        same inode, left by that step exactly as fingerprinted) is not an external change.
        """
        expected: dict[str, tuple[list | None, int]] = {}
        later_renames: list[tuple[str, str, str]] = []  # chronological, from steps newer than the one in hand
        for age, s in enumerate(reversed(targets)):
            for path, fp in s.fingerprints.items():
                for op, src, dst in later_renames:
                    if is_within(path, src):
                        path = dst + path[len(src):]
                    elif is_within(path, dst):
                        if op == "exchanged":  # swapped, not replaced: it is at the other name
                            path = src + path[len(dst):]
                            continue
                        path = None  # a newer step renamed something over it: that step's undo covers it
                        break
                if path is not None:
                    expected.setdefault(path, (fp, age))
            mine = [(r["op"], r["src"], r["dst"]) for r in records[s.seq] if r.get("op") in ("renamed", "exchanged")]
            later_renames = mine + later_renames

        looked: dict[str, bool] = {}

        def current(path: str, fp) -> list | str | None:
            try:
                now = preimage.fingerprint(self.work, path, with_dir_mtime=fp is not None and len(fp) == 2 and fp[0] == "dir")
            except OSError:
                return "unreadable"
            looked[path] = now is not None
            return now

        # per age, (name, inode) of the other names of files a step changed (``links`` of its preimages)
        linked = [{(q, r["ino"]) for r in records[s.seq] if r.get("op") == "pre" and r.get("kind") != "dir"
                   for q in r.get("links", ())} for s in reversed(targets)]
        changed = [p for p, (fp, _) in expected.items() if current(p, fp) != fp]
        changed = [p for p in changed if not self._changed_through_link(p, expected, current, linked)]
        if changed:
            changed.sort()
            raise ExternalChange(
                f"{len(changed)} path(s) changed outside the sandbox since the sandbox last wrote them "
                f"({', '.join(changed[:5])}{', …' if len(changed) > 5 else ''}); rolling back would overwrite "
                "those changes — use force to do it anyway", paths=changed)
        return looked

    def _changed_through_link(self, path: str, expected: dict, current, linked: list[set]) -> bool:
        """``path`` changed because a newer step of the rollback changed its inode through
        another name: one that step left as it fingerprinted it, or one whose preimage
        named ``path`` among its ``links`` (the name may be gone since: removed by that step)."""
        try:
            st = self.work.lstat(path)
        except OSError:
            return False
        age = expected[path][1]
        if st.kind != "dir" and any((path, st.ino) in linked[a] for a in range(age)):
            return True
        if st.kind == "dir" or st.nlink < 2:
            return False
        for other, (fp, other_age) in expected.items():
            if other_age < age and fp is not None and fp[0] != "dir":
                try:
                    if self.work.lstat(other).ino == st.ino and current(other, fp) == fp:
                        return True
                except OSError:
                    continue
        return False

    # ------------------------------------------------------------------ configuration

    def configure_limits(self, **limits) -> None:
        with self._interceptor.lock:
            # replace(): a new Limits from the current fields and these (the fields as a dict
            # would need the instance's __dict__, which a compiled one has not: compiled.py)
            self._log.limits = dataclasses.replace(self._log.limits, **limits)
            self._log.enforce_limits()

    def configure_safeguard(self, **config) -> None:
        with self._interceptor.lock:
            self._interceptor.safeguard.config = dataclasses.replace(self._interceptor.safeguard.config, **config)

    def discard(self) -> None:
        """Delete all undo history (the way out of a version mismatch)."""
        with self._interceptor.lock:
            try:
                self._interceptor.close_now()
            except OSError:
                if self._log.open_step is None or self._log.open_step.closing is None:
                    raise  # a step waiting for its promotion is discarded with the rest
            self._log.discard(self.label)
            self._tracker.discarded()

    @property
    def undo_available(self) -> bool:
        return self._log.available

    @property
    def undo_unavailable_reason(self) -> str | None:
        """Why undo is unavailable (a foreign store version, …), or None."""
        return self._log.version_problem

    # ------------------------------------------------------------------ inspection (read-only)

    def records(self, step_id: int | None = None) -> list[dict]:
        """The journal records of a step, oldest first — what undoing it applies: the
        newest finished step by default; the step in the write-ahead log (active or ended)
        if ``step_id`` names it. KeyError if there is no such step. For tools and tests."""
        with self._interceptor.lock:
            wal = self._log.open_step
            if wal is not None and step_id == wal.id:
                return [dict(r) for r in wal.records]
            steps = self._log.steps()
            info = steps[-1] if step_id is None and steps else next((s for s in steps if s.id == step_id), None)
            if info is None:
                raise KeyError(f"no step {step_id}" if step_id is not None else "no finished step")
            return self._log.records_of(info)

    def step_info(self, step_id: int | None = None) -> StepInfo:
        """The finished step ``step_id`` (None: the newest) as the store holds it (a copy);
        :class:`NoSuchStep` if history has none such (never made, undone, evicted)."""
        self._log.require_available()
        with self._interceptor.lock:
            steps = self._log.steps()
            info = steps[-1] if step_id is None and steps else next((s for s in steps if s.id == step_id), None)
            if info is None:
                what = f"no step {step_id} in history" if step_id is not None else "no finished step in history"
                raise NoSuchStep(what, step_id=step_id)
            return info.copy()

    def step_records(self, info: StepInfo) -> list[dict]:
        """The checked journal records of the finished step ``info`` (:meth:`step_info`),
        oldest first; :class:`CorruptStep` if its journal is damaged. Reads only."""
        with self._interceptor.lock:
            return self._log.records_of(info)

    def step_preimage(self, info: StepInfo, rec: dict, max_bytes: int) -> bytes | None:
        """The checked preimage bytes of ``rec`` (a regular file's ``pre`` record of ``info``),
        None if over ``max_bytes``; :class:`CorruptStep` if damaged or not kept. Reads only."""
        with self._interceptor.lock:
            return self._log.preimage_bytes(info, rec, max_bytes)

    def replay_undo_onto(self, info: StepInfo, records: list[dict], onto: HostFS, open_content) -> None:
        """Apply the undo of ``info`` to ``onto`` (a scratch filesystem, never :attr:`work`),
        as a rollback would; ``open_content(rec)`` gives a ``pre`` record's bytes. The store
        and the working folder are only read (:mod:`sandbox.core.diff` uses it)."""
        if onto is self.work:
            raise ValueError("replay_undo_onto never writes the working folder: use rollback")
        with self._interceptor.lock:
            self._log.replay_undo(info, records, onto, open_content)

    def steps(self) -> list[StepInfo]:
        """Finished steps as the store holds them, oldest first (:meth:`history` is the
        public summary). Copies: changing them changes nothing."""
        with self._interceptor.lock:
            return [s.copy() for s in self._log.steps()]

    def step_seqs(self) -> list[int]:
        """The ``seq`` of each finished step, oldest first: :meth:`steps` without copying them."""
        with self._interceptor.lock:
            return [s.seq for s in self._log.steps()]

    @property
    def store_size_bytes(self) -> int:
        """What the finished steps take in the undo store (limits apply to this)."""
        with self._interceptor.lock:
            return self._log.total_size_bytes()

    @property
    def eviction_pending(self) -> bool:
        """The store is over a limit and evicting the oldest step failed (I/O error): it
        is retried at the next step boundary."""
        with self._interceptor.lock:
            return self._log.eviction_pending


def _rollback_paths(work: HostFS, touched: list[str], present: set[str]) -> tuple[list[dict], bool]:
    """What an undo did to each path its steps touched (``touched``, sorted; ``present``:
    those that existed just before it), at most :data:`ROLLBACK_PATHS_LISTED_MAX`, and
    whether more were left off: ``restored`` (there before and after the undo: content or
    metadata put back), ``recreated`` (absent before: the step had deleted it), ``removed``
    (the step had made it). A path absent both times (made and removed within the undone
    steps) is not listed. The working root is ``"."``."""
    out: list[dict] = []
    for p in touched:
        was, now = p in present, work.lstat_or_none(p) is not None
        if not (was or now):
            continue
        if len(out) == ROLLBACK_PATHS_LISTED_MAX:
            return out, True
        out.append({"path": p or ".", "change": "restored" if was and now else "recreated" if now else "removed"})
    return out, False


def _store_path(workdir: str, state_dir: str | None) -> tuple[str, str]:
    """(real path of the working folder, real path of its undo store), checked: the store
    must be outside the folder (the guest would see it)."""
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"working folder {workdir!r} does not exist or is not a directory")
    real = os.path.realpath(workdir)
    state = os.path.realpath(state_dir or default_state_dir(real))
    rel = os.path.relpath(state, real)
    if rel == "." or not (rel == ".." or rel.startswith("../")):
        raise ValueError(f"the undo store {state!r} must be outside the working folder {real!r} (the guest would see it)")
    return real, state


__all__ = ["Workspace", "StepHandle", "default_state_dir", "UndoUnavailable", "ROLLBACK_PATHS_LISTED_MAX"]
