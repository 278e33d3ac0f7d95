"""UndoInterceptor: the hooks every filesystem backend calls around each mutation.

Call protocol (``InterceptedFS`` follows it; servers that apply operations themselves
must too)::

    with interceptor.lock:
        interceptor.pre_xxx(...)        # may raise HoldRequired / SafeguardDenied / OSError
        try:
            host call
        except Exception:
            interceptor.op_failed()     # voids intent records, restores dedup marks
            raise
        interceptor.post_xxx(...)       # only for creations

Hook names are the seed's (§4.3.3) plus ``pre_create``: a creation must be journalled
*before* the host call or a crash right after it would leave an unrecorded file (WAL
rule 2), so ``post_create``/``post_mkdir``/``post_symlink`` only confirm.

First touch: each path is captured at most once per step at each level — ``META``
(mode, mtime, xattrs: enough for chmod/utime/xattr of a regular file) or ``FULL``
(bytes too; directories and symlinks are always FULL since their "content" is their
metadata/target). Marks follow renames: a subtree renamed in the step keeps its marks
under the new name (the ``renamed`` record moves it back before older records apply).
Two undos must never be skipped by marks: the ``pre`` of a directory being removed
(rmdir, or replaced by a rename) — its children's undos need it to exist first.

Hard links: linking captures the existing file first (writes through either name change
both); a rollback restores bytes in place, so links that survive the step stay links. The
``pre`` of a regular file with more than one link also records its inode number, link
count and other names (from the step's link index, :func:`preimage.link_index`), so a
rollback makes names the step deleted or replaced one inode again
(:class:`preimage.LinkGroups`; docs/undo-store.md § Hard links).

Open handles: a change made through a handle (``pre_write``, ``pre_setattr``,
``pre_xattr`` with ``handle=``) reaches the handle's inode, not whatever the path names
now. The path is captured only if it still names that inode (``st_ino``/``st_dev``);
otherwise the file was unlinked, renamed away or replaced since it was opened, the
tree no longer reaches it at that path, and there is nothing there to capture (nor a
safeguard to ask: no content the tree reaches is overwritten). Corner left open: if
that inode is still reachable under *another* name — a hard link made before, or a
rename the server did not see (the host's) — the change to it is not captured.
"""

from __future__ import annotations

import errno
import functools
import threading
from typing import Callable

from ..hostfs import DIR, OTHER, REG, Entry, FileHandle, HostFS, Stat, has_entries, is_within, parent_of, same_inode
from .errors import HoldRequired, RollbackIncomplete, SafeguardDenied
from .preimage import INTENT_OPS, LINKS_PER_RECORD_MAX, is_restorable_special, link_index, meta_of
from .safeguard import Hold, Safeguard
from .steps import AMBIENT, StepTracker
from .store import UndoLog

META, FULL = 1, 2


def _journalled(hook):
    """A pre-hook whose preimage records are held (:meth:`UndoLog.hold`) and written with its
    intent — one journal write per operation — or, if it has none, when it returns; also when
    it raises (as they were before, each written as captured), so the journal never lacks a
    record whose capture succeeded. A write that fails then does not hide the hook's error."""
    @functools.wraps(hook)
    def run(self, *args, **kwargs):
        with self.lock:
            try:
                result = hook(self, *args, **kwargs)
            except BaseException:
                try:
                    self.log.flush()
                except BaseException:  # noqa: BLE001 - the hook's own error is the one to report
                    pass
                raise
            self.log.flush()
            return result
    return run


#: at most this many paths are listed in a step_completed event (paths_count has the total)
AFFECTED_PATHS_MAX = 1000


class UndoInterceptor:
    def __init__(self, work: HostFS, log: UndoLog, tracker: StepTracker, safeguard: Safeguard,
                 emit: Callable[[dict], None] | None = None):
        self.work = work
        self.log = log
        self.tracker = tracker
        self.safeguard = safeguard
        self._emit = emit or (lambda e: None)
        self.lock = threading.RLock()
        self._marks: dict[str, int] = {}
        self._linked: set[int] = set()  # inodes of this step captured with more than one name
        self._names: dict[int, set[str]] | None = None  # the step's link index (see _other_names)
        self._names_changed = False  # the operation in hand changed the link index (op_failed drops it)
        self._mark_undo: list[tuple[str, int | None]] | None = None
        self._op_mark: tuple[int, int] | None = None  # (step seq, first record index) of the operation in hand

    # ------------------------------------------------------------------ steps

    def current_step(self) -> int | None:
        """The id writes go to right now (None: the next write opens an ambient step)."""
        with self.lock:
            self.poll()
            a = self.tracker.active
            return a.id if a is not None else None

    def begin_step(self, step_type: str, command: str, step_id: int | None = None) -> int:
        """Open a command or API step (closing a draining or ambient one first)."""
        with self.lock:
            if self.tracker.active is not None:
                a = self.tracker.active
                if a.running:
                    raise RuntimeError(f"step {a.id} is still running")
                self._close_active()
            if step_id is None:
                step_id = self.log.allocate_id(ambient=step_type == AMBIENT)
            self._open(step_id, step_type, command)
            return step_id

    def complete_step(self, step_id: int, exit_code: int | None) -> None:
        """The command finished; late writes drain into it until quiescence (see steps.py)."""
        with self.lock:
            self.tracker.complete(step_id, exit_code)
            self.poll()

    def close_now(self) -> None:
        """Close whatever step is active, without waiting for quiescence; or retry the
        promotion of a step that has ended but could not be recorded yet (OSError if that
        fails again)."""
        with self.lock:
            if self.tracker.active is not None:
                self._close_active()
            else:
                self._promote()

    def poll(self) -> None:
        """Time-driven transitions: expired holds deny; due steps close. Cheap; call often.

        A due step whose promotion fails (the store's disk is full) has still ended: the
        failure is one ``event.warning``, and promotion waits for the next boundary (a
        write, a step, an undo, close) — time alone never retries it, so a server polling
        every 200 ms does not turn one full disk into an error loop.
        """
        with self.lock:
            hold = self.safeguard.expired()
            if hold is not None:
                self._emit({"type": "event.warning", "message": f"safeguard {hold.id} timed out: denied"})
                self.resolve_hold(hold.id, "deny")
            if self.tracker.due() and not self._held():  # a held step waits for its answer (or deadline)
                try:
                    self._close_active()
                except OSError:
                    if self.log.open_step is None or self.log.open_step.closing is None:
                        raise  # not a promotion waiting for a boundary

    def _held(self) -> bool:
        """The active step has a safeguard hold waiting for an answer: it may not end by time."""
        hold, a = self.safeguard.pending, self.tracker.active
        return hold is not None and a is not None and hold.step_id == a.id

    def _open(self, step_id: int, step_type: str, command: str) -> None:
        self._marks = {}
        self._linked, self._names = set(), None
        if self.log.available:
            self._promote()  # a step that ended but waits for its promotion goes first
            self.log.begin(step_id, step_type, command)
        self._settle_ended()
        self.tracker.begin(step_id, step_type, command)

    def _close_active(self) -> None:
        """End the active step and promote it (OSError if the promotion fails: the step has
        ended all the same, and waits in the WAL for :meth:`_promote`)."""
        a = self.tracker.active
        if self._held():  # ended before anyone answered (the next step began, or closed now): no answer is a deny
            hold = self.safeguard.pending
            self._emit({"type": "event.warning",
                        "message": f"safeguard {hold.id}: step {a.id} ended before it was answered: denied"})  # type: ignore[union-attr]
            self.resolve_hold(hold.id, "deny")  # type: ignore[union-attr]
        denied = a.denied  # type: ignore[union-attr]
        self.tracker.end()
        self.safeguard.step_ended(a.id)  # type: ignore[union-attr]
        self._marks = {}
        if self.log.open_step is not None:
            self.log.open_step.closing = (a.exit_code, denied)  # type: ignore[union-attr]
            self._promote()
        else:
            self.tracker.recorded(denied)  # no store (undo unavailable): nothing to record it in

    def _settle_ended(self) -> None:
        """An ended step that is no longer in the WAL, and was not recorded, went with the
        history (:meth:`Workspace.discard`, or a store wiped under us): DISCARDED."""
        ended = self.tracker.ended
        if ended is not None and (self.log.open_step is None or self.log.open_step.id != ended.id):
            self.tracker.discarded()

    def _promote(self) -> None:
        """Promote the step that has ended (WAL rule 4) and report it; no-op if none waits.

        If it fails, the step stays in the WAL with its exit code; the first failure of a
        step is an ``event.warning``. If the process ends before a retry succeeds, the next
        open rolls the step back (rule 5) and reports it (``event.recovery``)."""
        step = self.log.open_step
        if step is None or step.closing is None:
            self._settle_ended()
            return
        ended = self.tracker.ended
        assert ended is None or ended.id == step.id, f"step {ended.id} ended, but the WAL holds step {step.id}"
        exit_code, denied = step.closing
        try:
            if denied and step.outcome != "denied":
                self.log.deny_open(self.work)  # a deny that failed half-way (I/O error): finish it first
            info = self.log.finish(self.work, exit_code)
        except OSError as e:
            if self.log.open_step is not step:  # promoted: a sync after the rename failed
                self.tracker.recorded(denied)
            if not step.closing_warned:
                step.closing_warned = True
                self._emit({"type": "event.warning", "code": "undo.promotion_failed", "step_id": step.id,
                            "message": f"step {step.id} has ended but could not be recorded in the undo store ({e}); "
                                       "its undo data waits in the write-ahead log and recording is retried before the "
                                       "next write, step or undo — if the sandbox stops first, the step is rolled back "
                                       "when the folder is next opened"})
            raise
        self.tracker.recorded(info is not None and info.outcome == "denied")
        if info is not None:
            paths = sorted(info.paths)
            self._emit({"type": "event.step_completed", "step_id": info.id, "step_type": info.type,
                        "exit_code": info.exit_code, "paths": len(paths), "paths_count": len(paths),
                        "affected_paths": paths[:AFFECTED_PATHS_MAX], "unprotected": info.unprotected,
                        "outcome": info.outcome})

    # ------------------------------------------------------------------ safeguard

    def resolve_hold(self, hold_id: str, action: str) -> Hold:
        """allow: the held operation may be retried. deny: the step is rolled back now."""
        with self.lock:
            hold = self.safeguard.resolve(hold_id, action)
            if action == "deny":
                a = self.tracker.active
                if a is not None and a.id == hold.step_id and not a.denied:
                    self.tracker.deny()
                    if self.log.open_step is not None:
                        self.log.deny_open(self.work)
                    self._marks = {}
            return hold

    # ------------------------------------------------------------------ entry

    def _mark_op(self) -> None:
        """Where this operation's records begin — set before anything can fail, so that
        op_failed never voids an earlier operation's records."""
        step = self.log.open_step
        self._op_mark = (step.seq, len(step.records)) if step is not None else None
        self._mark_undo = []
        self._names_changed = False

    def _enter(self, kind: str | None = None, path: str = "") -> bool:
        """Common start of every pre-hook. Returns True if captures are to be made."""
        self._mark_op()
        self.poll()
        if self.tracker.active is None:
            try:
                self._open(self.log.allocate_id(ambient=True), AMBIENT, "")
            except RollbackIncomplete as e:  # writes on a half-restored tree would be undone by it later
                raise OSError(errno.EIO, e.message, path or None) from e
            self._mark_op()
        a = self.tracker.active
        if a.denied:  # type: ignore[union-attr]
            raise SafeguardDenied(f"step {a.id} was denied by a safeguard and rolled back; further writes fail")  # type: ignore[union-attr]
        if kind is not None:
            hold = self.safeguard.check(a.id, kind, path)  # type: ignore[union-attr]
            if hold is not None:
                self._emit({"type": "event.safeguard_triggered", **hold.as_dict()})
                raise HoldRequired(hold)
        elif self.safeguard.pending is not None:
            raise HoldRequired(self.safeguard.pending)
        self.tracker.touch()
        step = self.log.open_step
        if step is None:
            return False
        if self._op_mark is None or self._op_mark[0] != step.seq:
            self._mark_op()  # poll() closed the step this operation began in
        return not step.unprotected

    def op_failed(self) -> None:
        """The host call after the last pre-hook failed: void its intents, restore marks;
        a link index the operation changed (a rename or link that did not happen) is
        dropped, to be built again from the tree when next needed."""
        with self.lock:
            if self._names_changed:
                self._names, self._names_changed = None, False
            step = self.log.open_step
            mark, self._op_mark = self._op_mark, None
            try:
                if step is not None and not step.unprotected and mark is not None and mark[0] == step.seq:
                    void = [i for i in range(mark[1], len(step.records)) if step.records[i].get("op") in INTENT_OPS]
                    self.log.void(void)  # if the store fails too, the void is owed (UndoLog.void)
            finally:
                for path, old in reversed(self._mark_undo or []):
                    if old is None:
                        self._marks.pop(path, None)
                    else:
                        self._marks[path] = old
                self._mark_undo = []

    # ------------------------------------------------------------------ marks

    def _set_mark(self, path: str, level: int | None) -> None:
        old = self._marks.get(path)
        if old == level:
            return
        if self._mark_undo is not None:
            self._mark_undo.append((path, old))
        if level is None:
            self._marks.pop(path, None)
        else:
            self._marks[path] = level

    def _drop_subtree(self, path: str) -> list[tuple[str, int]]:
        if path == "":
            under = list(self._marks.items())
        else:
            pre = path + "/"
            under = [(p, m) for p, m in self._marks.items() if p == path or p.startswith(pre)]
        for p, _ in under:
            self._set_mark(p, None)
        return under

    # ------------------------------------------------------------------ capture

    def _lstat(self, path: str) -> Stat | None:
        return self.work.lstat_or_none(path)  # below a symlink is "absent" too: the host call fails ELOOP

    def _account(self, rec: dict) -> bool:
        """Charge a record to the step; False (and the step turns unprotected) past the limit."""
        step = self.log.open_step
        cost = rec.get("stored", 0) + 256
        limit = min(self.log.limits.max_single_step_size_bytes, self.log.limits.max_log_size_bytes)
        if step.size_bytes + cost > limit:  # type: ignore[union-attr]
            self.log.mark_unprotected()
            return False
        step.size_bytes += cost  # type: ignore[union-attr]
        if self.log.total_size_bytes() > self.log.limits.max_log_size_bytes:
            self.log.enforce_limits()
        return True

    def _named(self, path: str, handle: FileHandle | None, look: Entry | None = None) -> Stat | None:
        """What is at ``path`` — None if nothing, or (with ``handle``) if it is not the
        handle's inode: the change then lands on a file the tree does not reach there.
        ``look``: the caller's :meth:`HostFS.entry` of ``path`` (the same look, through it)."""
        st = look.lstat_or_none() if look is not None else self._lstat(path)
        if st is not None and handle is not None and not handle.is_inode_of(st):
            return None
        return st

    def _capture(self, path: str, level: int, always: bool = False, handle: FileHandle | None = None,
                 reader: FileHandle | None = None, look: Entry | None = None) -> None:
        """The preimage of ``path`` (of ``handle``'s file if given, else nothing: see
        :meth:`_named`). Its xattrs and bytes are read through ``handle``, or through
        ``reader`` — a descriptor that may be on the file at ``path`` (an unlink's) — when it is
        that file's inode; otherwise by path."""
        step = self.log.open_step
        if step.unprotected or (not always and self._marks.get(path, 0) >= level):  # type: ignore[union-attr]
            return
        st = self._named(path, handle, look)
        if st is None:
            return  # nothing there (the host call will fail or create it), or not the handle's file
        if st.kind == OTHER and not is_restorable_special(st):
            raise OSError(errno.EPERM, "device nodes on the host are never changed by the sandbox", path)
        via = handle
        if via is None and reader is not None and st.kind == REG:
            try:
                via = reader if reader.is_inode_of(st) else None
            except OSError:  # closed meanwhile (EBADF): by path, as without it
                via = None
        own = None  # a removal's: the bytes and xattrs through the entry it looked at (Entry.reader)
        if via is None and look is not None and st.kind == REG:
            via = own = look.reader(st)
        try:
            op = "meta" if (level == META and st.kind == REG) else "pre"
            # without a handle, a removal's other kinds' xattrs through its entry (Entry.xattrs)
            rec = {"op": op, "path": path, **meta_of(self.work, path, st, via if via is not None else look)}
            if op == "pre" and st.kind == REG:
                rec.update(self.log.capture_content(self.work, path, st, len(step.records), via))  # type: ignore[union-attr]
            if op == "pre" and st.kind != DIR and (st.nlink > 1 or st.ino in self._linked):
                # its names are made one inode again (preimage.LinkGroups): a regular file,
                # and a symlink, fifo or socket too (one inode: one mode and mtime for all names)
                rec["ino"], rec["nlink"] = st.ino, st.nlink
                rec["links"] = self._other_names(path, st) if st.nlink > 1 else []
                self._linked.add(st.ino)
        finally:
            if own is not None:
                own.close()
        if not self._account(rec):
            return
        self.log.hold(rec)  # written with the operation's intent, or as the hook returns (_journalled)
        self._set_mark(path, FULL if rec["op"] == "pre" else META)

    def _other_names(self, path: str, st: Stat) -> list[str]:
        """The other names of the file at ``path`` (``st``) now, as far as the step's link
        index knows them (built at the first call of a step: :func:`preimage.link_index`;
        kept up to date by ``ln`` and renames), each checked to be that inode."""
        if self._names is None:
            self._names = link_index(self.work)
        out = []
        for q in sorted(self._names.get(st.ino, ())):
            o = self._lstat(q) if q != path else None
            if o is not None and o.kind == st.kind and same_inode(o, st):
                out.append(q)
                if len(out) == LINKS_PER_RECORD_MAX:
                    break
        return out

    def _names_moved(self, src: str, dst: str, moved: Stat, exchange: bool = False) -> None:
        """The link index follows a rename (or an exchange) of ``src`` (``moved``) to ``dst``:
        one set for a file, every set for a directory or an exchange."""
        if self._names is None:
            return
        self._names_changed = True
        if not exchange and moved.kind != DIR:
            names = self._names.get(moved.ino)
            if names is not None and src in names:
                names.discard(src)
                names.add(dst)
            return
        for names in self._names.values():
            gone = {p for p in names if is_within(p, src) or (exchange and is_within(p, dst))}
            if gone:
                names -= gone
                names |= {dst + p[len(src):] if is_within(p, src) else src + p[len(dst):] for p in gone}

    def _capture_parent(self, path: str) -> None:
        self._capture(parent_of(path), FULL)

    def _intent(self, rec: dict) -> bool:
        if not self._account(rec):
            return False
        self.log.append(rec)
        return True

    # ------------------------------------------------------------------ content hooks

    @_journalled
    def _content_hook(self, path: str, gate_overwrite: bool, handle: FileHandle | None = None) -> None:
        with self.lock:
            st = self._lstat(path) if gate_overwrite else None
            large = st is not None and st.kind == REG and st.size > self.safeguard.config.overwrite_size_bytes
            if self._enter("overwrite" if large else None, path):
                self._capture(path, FULL, handle=handle)

    def pre_write(self, path: str, handle: FileHandle | None = None) -> None:
        """Bytes are about to change — of the file at ``path``, or of ``handle``'s (module docstring)."""
        self._content_hook(path, gate_overwrite=False, handle=handle)

    def pre_open_trunc(self, path: str) -> None:
        """An existing file is about to be truncated by open(O_TRUNC) — not post_create."""
        self._content_hook(path, gate_overwrite=True)

    def pre_fallocate(self, path: str, handle: FileHandle | None = None) -> None:
        """fallocate of the file at ``path``, or of ``handle``'s: any mode may change bytes."""
        self._content_hook(path, gate_overwrite=False, handle=handle)

    def pre_copy_file_range(self, dst_path: str, handle: FileHandle | None = None) -> None:
        """Bytes copied into the file at ``dst_path``, or into ``handle``'s."""
        self._content_hook(dst_path, gate_overwrite=False, handle=handle)

    @_journalled
    def pre_setattr(self, path: str, size: int | None = None, handle: FileHandle | None = None) -> None:
        """chmod/chown/utimes (metadata) or, with ``size``, a truncate (contents) — of the
        file at ``path``, or of ``handle``'s (module docstring)."""
        with self.lock:
            if size is not None:
                st = self._named(path, handle)
                large = st is not None and st.kind == REG and size < st.size and st.size > self.safeguard.config.overwrite_size_bytes
                if self._enter("overwrite" if large else None, path):
                    self._capture(path, FULL, handle=handle)
            elif self._enter():
                self._capture(path, META, handle=handle)

    @_journalled
    def pre_xattr(self, path: str, handle: FileHandle | None = None) -> None:
        with self.lock:
            if self._enter():
                self._capture(path, META, handle=handle)

    # ------------------------------------------------------------------ entry hooks

    @_journalled
    def pre_unlink(self, path: str, is_dir: bool, reader: FileHandle | None = None,
                   look: Entry | None = None) -> None:
        """``reader``: a descriptor the caller holds that may be on the file at ``path``; its
        preimage is read through it when it is (:meth:`_capture`). ``look``: the
        :meth:`HostFS.entry` the caller removes ``path`` through; the preimage's look at the
        path is taken through it (the same ``lstat_or_none``)."""
        with self.lock:
            if not self._enter("delete", path):
                return
            parent = parent_of(path)
            if self._marks.get(parent, 0) < FULL:  # else _capture_parent returns at once
                self._capture(parent, FULL)
            if is_dir:
                self._capture(path, FULL, always=True, look=look)
            else:
                self._capture(path, FULL, reader=reader, look=look)
            self._set_mark(path, None)  # a directory being removed is empty: no marks below it

    @_journalled
    def pre_create(self, path: str, look: Entry | None = None) -> None:
        """Something new (file, directory, symlink) is about to appear at ``path`` (``look``:
        the entry the creation goes through, :meth:`HostFS.entry`, looked at instead of the path)."""
        with self.lock:
            if not self._enter() or (self._lstat(path) if look is None else look.lstat_or_none()) is not None:
                return  # something is there: the host call fails with EEXIST; no intent to record
            self._capture_parent(path)
            if self._intent({"op": "created", "path": path}):
                self._set_mark(path, FULL)

    def post_create(self, path: str) -> None:
        """A new inode was created at ``path`` (its intent was journalled by pre_create)."""

    def post_mkdir(self, path: str) -> None:
        """A directory was created at ``path`` (its intent was journalled by pre_create)."""

    def post_symlink(self, target: str, link_path: str) -> None:
        """A symlink was created (its intent was journalled by pre_create)."""

    @_journalled
    def pre_link(self, target: str, link_path: str) -> None:
        with self.lock:
            if not self._enter() or self._lstat(link_path) is not None:
                return  # EEXIST follows; nothing to record
            self._capture(target, FULL)  # writes through the new name change this file too
            self._capture_parent(link_path)
            if self._intent({"op": "created", "path": link_path}) and self._names is not None:
                t = self._lstat(target)
                if t is not None and t.kind != DIR:
                    self._names.setdefault(t.ino, set()).update((target, link_path))
                    self._names_changed = True

    @_journalled
    def pre_rename(self, src: str, dst: str) -> None:
        with self.lock:
            s = self._lstat(src)
            d = self._lstat(dst)
            if s is not None and d is not None and s.ino == d.ino:
                self._enter()
                return  # same file: rename(2) does nothing
            if not self._enter("rename_over" if (s is not None and d is not None) else None, dst):
                return
            if s is None or self._rename_will_fail(src, dst, s, d):
                return  # the host call fails; an intent would be a lie
            self._capture_parent(src)
            self._capture_parent(dst)
            if d is not None:
                self._capture(dst, FULL, always=d.kind == DIR)
            if not self._intent({"op": "renamed", "src": src, "dst": dst}):
                return
            self._names_moved(src, dst, s)
            if s.kind == DIR or (d is not None and d.kind == DIR):
                self._drop_subtree(dst)
                for p, m in self._drop_subtree(src):
                    self._set_mark(dst + p[len(src):], m)
            else:
                mark = self._marks.get(src)
                self._set_mark(src, None)
                self._set_mark(dst, mark)

    @_journalled
    def pre_exchange(self, a: str, b: str) -> None:
        """``a`` and ``b`` are about to swap names (RENAME_EXCHANGE). Journalled as the two
        parents' preimages and one ``exchanged`` intent carrying both inode numbers (its undo
        swaps them back unless they are already back: see :func:`preimage.restore`). The
        objects themselves do not change, so nothing of theirs is copied; their marks (and
        those below them) swap with them."""
        with self.lock:
            x, y = self._lstat(a), self._lstat(b)
            if x is not None and y is not None and x.ino == y.ino:
                self._enter()
                return  # one inode: renameat2 does nothing
            if not self._enter() or x is None or y is None:  # nothing is replaced: no safeguard counts it
                return  # ENOENT follows: nothing to record
            if is_within(a, b) or is_within(b, a):
                return  # EINVAL follows
            self._capture_parent(a)
            self._capture_parent(b)
            if not self._intent({"op": "exchanged", "src": a, "dst": b, "src_ino": x.ino, "dst_ino": y.ino}):
                return
            self._names_moved(a, b, x, exchange=True)
            under_a, under_b = self._drop_subtree(a), self._drop_subtree(b)
            for p, m in under_a:
                self._set_mark(b + p[len(a):], m)
            for p, m in under_b:
                self._set_mark(a + p[len(b):], m)

    def _rename_will_fail(self, src: str, dst: str, s: Stat, d: Stat | None) -> bool:
        """The kernel's certain refusals, checked first so no intent is journalled for them."""
        if s.kind == DIR and (dst + "/").startswith(src + "/"):
            return True  # EINVAL: into itself
        if d is None:
            return False
        if (s.kind == DIR) != (d.kind == DIR):
            return True  # ENOTDIR / EISDIR
        return d.kind == DIR and has_entries(self.work, dst)  # ENOTEMPTY: one entry read answers
