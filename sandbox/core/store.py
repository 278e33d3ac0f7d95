"""UndoLog: the on-disk undo store, outside the working folder.

Layout (all reached through the store's HostFS, rooted at the state directory)::

    VERSION               format version, "1"
    lock                  flock'd by the opener; holds its pid
    WORKDIR               the working folder's real path (for humans)
    counters.json         next step seq / id / ambient id (ids are never reused)
    wal/in_progress/      the open step: journal.jsonl (+ b/<n> preimage blobs)
    wal/rollback/         a step being rolled back: its files + progress (1 byte/record)
                          (+ ``forced``: the user forced it, and so is its resumption)
    steps/<seq>/          finished steps: manifest.json, journal.jsonl, b/<n>
    barriers/<n>.json     recorded external modifications
    trash/                directories being deleted (evictions, finished rollbacks)

Journal: one JSON object per line. Line 1 is the header; each later line one record
(see ``preimage.py``) or ``{"op": "void", "n": [...]}`` cancelling earlier records whose
host call failed, or ``{"op": "unprotected"}``. A final line without its newline is torn
and ignored: its mutation never started.

Preimage contents: zstd level 3, inline in the record when the compressed form is small
(saves a file per small file), else in ``b/<n>``; a reflink (FICLONE, stored raw) when the
filesystems allow it.
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass, field
from typing import Callable, Iterator

import zstandard

from ..hostfs import ABSENT_ERRNOS, REG, HostFS, Stat, is_within, join, parent_of
from . import preimage
from .errors import CorruptStep, NothingToUndo, RollbackIncomplete, StepUnprotected, UndoUnavailable
from .preimage import b64, unb64

FORMAT_VERSION = 1
ZSTD_LEVEL = 3
INLINE_MAX_BYTES = 4096  # compressed preimages up to this size live in the journal line
REFLINK_MIN_BYTES = 64 * 1024

WAL = "wal/in_progress"
ROLLBACK = "wal/rollback"


@dataclass
class Limits:
    """Undo log limits (seed §4.4.3). Units in the names."""

    max_log_size_bytes: int = 1 << 30
    max_step_count: int = 100
    max_single_step_size_bytes: int = 200 << 20

    def __post_init__(self):
        for name in ("max_log_size_bytes", "max_step_count", "max_single_step_size_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer")


@dataclass
class StepInfo:
    """One step of history, as the store knows it."""

    seq: int
    id: int
    type: str  # command | api | ambient
    command: str
    started_ns: int
    ended_ns: int | None = None
    exit_code: int | None = None
    outcome: str = "completed"  # completed | denied | recovered
    unprotected: bool = False
    size_bytes: int = 0
    paths: list[str] = field(default_factory=list)
    fingerprints: dict = field(default_factory=dict)
    corrupt: str | None = None  # why the step cannot be read

    @property
    def dirname(self) -> str:
        return f"steps/{self.seq:010d}"


@dataclass
class OpenStep:
    seq: int
    id: int
    type: str
    command: str
    started_ns: int
    records: list[dict] = field(default_factory=list)
    size_bytes: int = 0
    unprotected: bool = False
    journal_offset: int = 0
    touched_ns: int = 0
    blobs: int = 0  # blob names are never reused, even after a failed capture
    outcome: str = "completed"
    # set when the step has ended (its command finished) but its promotion failed: the
    # exit code and whether a safeguard denied it; promotion is retried at the next boundary
    closing: tuple[int | None, bool] | None = None
    closing_warned: bool = False


@dataclass
class Barrier:
    id: int
    after_seq: int
    paths: list[str]
    created_ns: int
    reason: str = "external modification"


def _errno_name(code: int | None) -> str | None:
    return None if code is None else errno.errorcode.get(code, str(code))


def _dumps(obj) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=True) + "\n").encode("ascii")


def parse_journal(data: bytes, where: str) -> tuple[dict | None, list[dict]]:
    """(header, live records) of a journal; a torn final line is dropped.

    Voided records are removed here, so every caller sees the same list.
    """
    lines = data.split(b"\n")
    lines.pop()  # the part after the last newline: empty, or a torn line
    header = None
    records: list[dict] = []
    voided: set[int] = set()
    for i, line in enumerate(lines):
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise CorruptStep(f"{where}: journal line {i + 1} is unreadable ({e})", where=where) from None
        if i == 0:
            header = obj
            continue
        if obj.get("op") == "void":
            voided.update(obj.get("n", []))
        else:
            records.append(obj)
    live = [r for j, r in enumerate(records) if j not in voided]
    return header, live


class UndoLog:
    """The undo store of one working folder. Not thread-safe: the interceptor serialises."""

    def __init__(self, store: HostFS, limits: Limits | None = None, clock_ns: Callable[[], int] | None = None,
                 emit: Callable[[dict], None] | None = None, durable: bool = False):
        """``durable``: power-loss mode — fsync in WAL order (see :meth:`_sync`). Off by
        default: the target is an agent crash, which the page cache survives."""
        import time

        self.durable = durable
        self.fs = store
        self.limits = limits or Limits()
        self.clock_ns = clock_ns or time.time_ns
        self._emit = emit or (lambda event: None)
        self._lock = None
        self.available = True
        self.version_problem: str | None = None
        self.open_step: OpenStep | None = None
        self._steps: list[StepInfo] = []  # oldest first
        self._barriers: list[Barrier] = []
        self._counters = {"next_seq": 1, "next_id": 1, "next_ambient": -1, "next_barrier": 1}
        self._reflink_ok: bool | None = None
        self.eviction_pending = False
        self._cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)

    # ------------------------------------------------------------------ opening

    def open(self, work: HostFS, workdir_label: str = "") -> dict | None:
        """Lock, check the version, recover. Returns the recovery report (or None)."""
        self._work = work
        self._lock = self.fs.lock("lock")
        try:
            names = set(self.fs.listdir(""))
            if "VERSION" not in names:
                if names - {"lock", "WORKDIR"}:
                    self._unavailable("the store has no VERSION file")
                    return None
                self._init_fresh(workdir_label)
            else:
                raw = self.fs.read_all("VERSION")
                text = raw.decode("ascii", "replace").strip()
                if text != str(FORMAT_VERSION):
                    self._unavailable(f"undo log format version {text or '(empty)'!r}, this agent uses {FORMAT_VERSION}")
                    return None
            self._load()
            report = self._recover()
            self.enforce_limits(best_effort=True)  # e.g. a crash interrupted an eviction
            return report
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _unavailable(self, why: str) -> None:
        self.available = False
        self.version_problem = why
        self._emit({"type": "event.undo_version_mismatch", "message": why})

    def require_available(self) -> None:
        if not self.available:
            raise UndoUnavailable(f"undo is unavailable: {self.version_problem}; discard the undo history to continue "
                                  "(`sandbox discard --workdir DIR`)", reason=self.version_problem)

    def _init_fresh(self, workdir_label: str) -> None:
        for d in ("wal", "steps", "barriers", "trash"):
            if not self.fs.exists(d):
                self.fs.mkdir(d, 0o700)
        self._sync("")
        if workdir_label:
            self._write_file("WORKDIR", (workdir_label + "\n").encode("utf-8", "surrogateescape"))
        self._write_file("VERSION", f"{FORMAT_VERSION}\n".encode())

    def _sync(self, *paths: str) -> None:
        """Power-loss mode: make these store paths durable (a directory: its entries)."""
        if self.durable:
            for p in paths:
                self.fs.fsync(p)

    def sync_work(self, work: HostFS, *paths: str) -> None:
        """Power-loss mode: make these working paths and their directory entries durable."""
        if not self.durable:
            return
        for p in paths:
            for q in ((p, parent_of(p)) if p else (p,)):
                try:
                    work.fsync(q)
                except OSError as e:
                    if e.errno not in ABSENT_ERRNOS:
                        raise

    def _write_file(self, path: str, data: bytes) -> None:
        """Replace ``path`` atomically: write a temp file, then rename over."""
        tmp = path + ".tmp"
        if self.fs.exists(tmp):
            self.fs.unlink(tmp)
        self.fs.create(tmp, 0o600)
        self.fs.write_all(tmp, 0, data)
        self._sync(tmp)
        self.fs.rename(tmp, path)
        self._sync(parent_of(path))

    def discard(self, workdir_label: str = "") -> None:
        """Delete all undo history (after a version mismatch, on the user's word), whatever
        state the store is in: an unfinished rollback and a step waiting for its promotion
        go too (the working folder stays as it is)."""
        if self.open_step is not None and self.open_step.closing is None:
            raise UndoUnavailable("cannot discard while a step is open")
        self.open_step = None
        for name in self.fs.listdir(""):
            if name != "lock":
                preimage.remove_tree(self.fs, name)
        self._steps, self._barriers = [], []
        self._counters = {"next_seq": 1, "next_id": 1, "next_ambient": -1, "next_barrier": 1}
        self._init_fresh(workdir_label)
        self.available, self.version_problem = True, None

    def wipe(self, workdir_label: str = "") -> None:
        """Lock the store, :meth:`discard` it, unlock — without :meth:`open`: no recovery
        runs and nothing is read, so it works whatever the store holds (an unfinished
        rollback, a journal nobody can parse, a foreign version). ``StoreBusy`` if in use."""
        self._lock = self.fs.lock("lock")
        try:
            self.discard(workdir_label)
        finally:
            self.close()

    def _load(self) -> None:
        for d in ("wal", "steps", "barriers", "trash"):
            if not self.fs.exists(d):
                self.fs.mkdir(d, 0o700)
        try:
            self._counters.update(json.loads(self.fs.read_all("counters.json")))
        except (FileNotFoundError, ValueError):
            pass
        self._steps = []
        for name in sorted(self.fs.listdir("steps")):
            if name.isdigit():
                self._steps.append(self._read_step(int(name)))
        self._barriers = []
        for name in sorted(self.fs.listdir("barriers")):
            if name.endswith(".json"):
                try:
                    self._barriers.append(Barrier(**json.loads(self.fs.read_all(join("barriers", name)))))
                except (ValueError, TypeError) as e:
                    self._emit({"type": "event.warning", "message": f"barrier file {name} unreadable ({e}); treated as a barrier after every step"})
                    self._barriers.append(Barrier(id=0, after_seq=1 << 62, paths=[], created_ns=0, reason=f"unreadable barrier {name}"))
        # counters never go backwards, even if counters.json was lost
        top_seq = max([s.seq for s in self._steps], default=0)
        top_id = max([s.id for s in self._steps if s.id > 0], default=0)
        low_amb = min([s.id for s in self._steps if s.id < 0], default=0)
        self._counters["next_seq"] = max(self._counters["next_seq"], top_seq + 1)
        self._counters["next_id"] = max(self._counters["next_id"], top_id + 1)
        self._counters["next_ambient"] = min(self._counters["next_ambient"], low_amb - 1)
        self._counters["next_barrier"] = max(self._counters["next_barrier"], max([b.id for b in self._barriers], default=0) + 1)

    def _read_step(self, seq: int) -> StepInfo:
        where = f"steps/{seq:010d}"
        try:
            man = json.loads(self.fs.read_all(join(where, "manifest.json")))
            return StepInfo(seq=seq, id=man["id"], type=man["type"], command=man["command"], started_ns=man["started_ns"],
                            ended_ns=man.get("ended_ns"), exit_code=man.get("exit_code"), outcome=man.get("outcome", "completed"),
                            unprotected=man.get("unprotected", False), size_bytes=man.get("size_bytes", 0),
                            paths=man.get("paths", []), fingerprints=man.get("fingerprints", {}))
        except (OSError, ValueError, KeyError, TypeError) as e:
            reason = f"manifest of step dir {where} is unreadable ({e.__class__.__name__}: {e})"
            return StepInfo(seq=seq, id=0, type="unknown", command="", started_ns=0, corrupt=reason)

    # ------------------------------------------------------------------ ids

    def allocate_id(self, ambient: bool) -> int:
        key = "next_ambient" if ambient else "next_id"
        value = self._counters[key]
        self._counters[key] = value - 1 if ambient else value + 1
        return value

    def _save_counters(self) -> None:
        self._write_file("counters.json", json.dumps(self._counters).encode())

    # ------------------------------------------------------------------ the open step

    def begin(self, step_id: int, step_type: str, command: str) -> OpenStep:
        self.require_available()
        if self.open_step is not None:
            raise RuntimeError("a step is already open")
        self.finish_recovery()  # RollbackIncomplete: no step may begin between two steps
        if self.eviction_pending:
            self.enforce_limits(best_effort=True)
        seq = self._counters["next_seq"]
        self._counters["next_seq"] = seq + 1
        self._save_counters()
        now = self.clock_ns()
        step = OpenStep(seq=seq, id=step_id, type=step_type, command=command, started_ns=now, touched_ns=now)
        self.fs.mkdir(WAL, 0o700)
        header = {"seq": seq, "id": step_id, "type": step_type, "command": command, "started_ns": now}
        self.fs.create(join(WAL, "journal.jsonl"), 0o600)
        self._append_line(step, header)
        self._sync(WAL, "wal")
        self.open_step = step
        return step

    def _append_line(self, step: OpenStep, obj: dict, written: Callable[[], None] | None = None) -> None:
        """Append one journal line. Once the write has succeeded the line exists, so memory
        is updated (``written``) *before* the fsync: if the fsync fails the caller's operation
        fails, but memory and file still agree (record indices and offsets never drift)."""
        line = _dumps(obj)
        self.fs.write_all(join(WAL, "journal.jsonl"), step.journal_offset, line)
        step.journal_offset += len(line)
        if written is not None:
            written()
        self._sync(join(WAL, "journal.jsonl"))

    def append(self, rec: dict) -> int:
        """Make ``rec`` durable in the WAL (rule 1); returns its index."""
        step = self.open_step
        assert step is not None
        self._append_line(step, rec, lambda: step.records.append(rec))
        return len(step.records) - 1

    def void(self, indices: list[int]) -> None:
        """Cancel records whose host call failed (rule 2)."""
        step = self.open_step
        assert step is not None
        def written() -> None:
            for i in indices:
                step.records[i] = {"op": "void"}

        if indices:
            self._append_line(step, {"op": "void", "n": indices}, written)

    def capture_content(self, work: HostFS, path: str, st: Stat, index: int) -> dict:
        """Store the bytes of regular file ``path``; returns the record fields describing them."""
        step = self.open_step
        assert step is not None
        step.blobs += 1
        name = f"b{step.blobs}"
        blob = join(WAL, name)
        if st.size >= REFLINK_MIN_BYTES and self._reflink_ok is not False:
            try:
                work.clone_to(path, self.fs, blob)
                self._sync(blob, WAL)
                self._reflink_ok = True
                return {"enc": "raw", "blob": name, "size": st.size, "stored": st.size}
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.ENOSYS):
                    raise
                self._reflink_ok = False
        comp = self._cctx.compressobj()
        pending = bytearray()
        stored = 0
        size = 0
        in_blob = False
        offset = 0
        while True:
            chunk = work.read(path, offset, preimage.CHUNK_BYTES)
            if not chunk:
                break
            offset += len(chunk)
            size += len(chunk)
            pending += comp.compress(chunk)
            if len(pending) > INLINE_MAX_BYTES:
                if not in_blob:
                    self.fs.create(blob, 0o600)
                    in_blob = True
                self.fs.write_all(blob, stored, bytes(pending))
                stored += len(pending)
                pending.clear()
        pending += comp.flush()
        if not in_blob and len(pending) <= INLINE_MAX_BYTES:
            return {"enc": "zstd", "data": b64(bytes(pending)), "size": size, "stored": len(pending)}
        if not in_blob:
            self.fs.create(blob, 0o600)
        self.fs.write_all(blob, stored, bytes(pending))
        self._sync(blob, WAL)
        stored += len(pending)
        return {"enc": "zstd", "blob": name, "size": size, "stored": stored}

    def mark_unprotected(self) -> None:
        step = self.open_step
        assert step is not None
        if step.unprotected:
            return
        self._append_line(step, {"op": "unprotected"}, lambda: setattr(step, "unprotected", True))
        for name in self.fs.listdir(WAL):
            if name.startswith("b"):
                self.fs.unlink(join(WAL, name))
        self._emit({"type": "event.warning", "message": f"step {step.id} exceeded max_single_step_size_bytes "
                    f"({self.limits.max_single_step_size_bytes}); it is unprotected and cannot be rolled back"})

    def finish(self, work: HostFS, exit_code: int | None, outcome: str = "completed") -> StepInfo:
        """Fingerprint what the step left, write its manifest, promote it (rule 4), apply limits."""
        step = self.open_step
        assert step is not None
        live = [r for r in step.records if r.get("op") not in ("void", "unprotected")]
        info = StepInfo(seq=step.seq, id=step.id, type=step.type, command=step.command, started_ns=step.started_ns,
                        ended_ns=self.clock_ns(), exit_code=exit_code, outcome=step.outcome if step.outcome != "completed" else outcome, unprotected=step.unprotected,
                        size_bytes=0 if step.unprotected else step.size_bytes)
        # power-loss mode: the journal (an append's fsync may have failed since), the step's
        # effects, then its promotion
        self._sync(join(WAL, "journal.jsonl"))
        self.sync_work(work, *self.final_paths(live))
        info.paths, info.fingerprints = self._fingerprints(work, live)
        man = {"id": info.id, "type": info.type, "command": info.command, "started_ns": info.started_ns,
               "ended_ns": info.ended_ns, "exit_code": exit_code, "outcome": outcome, "unprotected": info.unprotected,
               "size_bytes": info.size_bytes, "paths": info.paths, "fingerprints": info.fingerprints,
               "format": FORMAT_VERSION}
        self._write_file(join(WAL, "manifest.json"), json.dumps(man, ensure_ascii=True).encode("ascii"))
        self.fs.rename(WAL, info.dirname)  # the promotion: from here on the step is finished
        self.open_step = None
        self._steps.append(info)
        try:
            self._sync("steps", "wal")
        finally:
            self.enforce_limits(best_effort=True)
        return info

    @staticmethod
    def touched_paths(records: list[dict]) -> list[str]:
        """Every path the step's records name, at the moment each was written."""
        seen: dict[str, None] = {}
        for r in records:
            if r.get("op") == "renamed":
                seen.setdefault(r["src"], None)
                seen.setdefault(r["dst"], None)
            elif "path" in r:
                seen.setdefault(r["path"], None)
        return list(seen)

    @staticmethod
    def final_paths(records: list[dict]) -> dict[str, bool]:
        """Where each touched thing is at the end of the step: every recorded path moved
        forward through the step's later renames. Value: True if it was created in the step."""
        out: dict[str, bool] = {}
        later: list[tuple[str, str]] = []  # renames after the record in hand, chronological
        for r in reversed(records):
            op = r.get("op")
            for p in ((r["src"], r["dst"]) if op == "renamed" else (r["path"],) if "path" in r else ()):
                for src, dst in later:
                    if is_within(p, src):
                        p = dst + p[len(src):]
                out[p] = out.get(p, False) or op == "created"
            if op == "renamed":
                later.insert(0, (r["src"], r["dst"]))
        return out

    def _fingerprints(self, work: HostFS, records: list[dict]) -> tuple[list[str], dict]:
        final = self.final_paths(records)
        fps = {p: preimage.fingerprint(work, p, with_dir_mtime=created) for p, created in final.items()}
        return self.touched_paths(records), fps

    def deny_open(self, work: HostFS) -> int:
        """Roll back the open step (a safeguard said deny) and keep it open, empty, as
        a tombstone: history will show it with ``outcome: "denied"``. Returns records undone.

        A crash half-way is safe: the journal still holds every record until the rewrite,
        and undoing a record twice is harmless.
        """
        step = self.open_step
        assert step is not None
        live = [r for r in step.records if r.get("op") not in ("void", "unprotected")]
        self._undo_resumable(work, WAL, live)
        header = _dumps({"seq": step.seq, "id": step.id, "type": step.type, "command": step.command, "started_ns": step.started_ns})
        self._write_file(join(WAL, "journal.jsonl"), header)
        for name in self.fs.listdir(WAL):
            if name.startswith("b") or name == "progress":
                self.fs.unlink(join(WAL, name))
        step.records, step.journal_offset, step.size_bytes, step.outcome = [], len(header), 0, "denied"
        return len(live)

    # ------------------------------------------------------------------ history

    def steps(self) -> list[StepInfo]:
        """Finished steps, oldest first."""
        return list(self._steps)

    def barriers(self) -> list[Barrier]:
        return list(self._barriers)

    def add_barrier(self, paths: list[str], reason: str = "external modification") -> Barrier:
        self.require_available()
        after = self.open_step.seq if self.open_step is not None else max([s.seq for s in self._steps], default=0)
        b = Barrier(id=self._counters["next_barrier"], after_seq=after, paths=sorted(paths)[:1000], created_ns=self.clock_ns(), reason=reason)
        self._counters["next_barrier"] += 1
        self._save_counters()
        self._write_file(f"barriers/{b.id:010d}.json", json.dumps(b.__dict__).encode())
        self._barriers.append(b)
        return b

    def remove_barrier(self, b: Barrier) -> None:
        name = f"barriers/{b.id:010d}.json"
        if self.fs.exists(name):
            self.fs.unlink(name)
            self._sync("barriers")
        self._barriers.remove(b)

    def records_of(self, info: StepInfo, where: str | None = None) -> list[dict]:
        where = where or info.dirname
        try:
            header, records = parse_journal(self.fs.read_all(join(where, "journal.jsonl")), where)
        except OSError as e:
            raise CorruptStep(f"step {info.id} ({where}): journal unreadable ({e})", step_id=info.id) from None
        except CorruptStep as e:
            raise CorruptStep(f"step {info.id}: {e.message}", step_id=info.id) from None
        return [r for r in records if r.get("op") != "unprotected"]

    # ------------------------------------------------------------------ rollback

    def rollback_top(self, work: HostFS, force: bool = False) -> int:
        """Undo the newest finished step (rollback is pop). Returns records undone."""
        self.require_available()
        self.finish_pending_rollback()
        if not self._steps:
            raise NothingToUndo("no step to undo")
        info = self._steps[-1]
        if info.corrupt:
            raise CorruptStep(f"cannot undo: {info.corrupt}", seq=info.seq)
        if info.unprotected:
            raise StepUnprotected(f"step {info.id} is unprotected (it exceeded max_single_step_size_bytes) and cannot be rolled back", step_id=info.id)
        records = self.records_of(info)  # the caller has verified content and fingerprints
        self.fs.rename(info.dirname, ROLLBACK)
        self._steps.pop()
        if force:  # before any record is undone: a resumption is forced too
            self.fs.create(join(ROLLBACK, "forced"), 0o600)
        self._sync(ROLLBACK, "steps", "wal")
        n = self._undo_resumable(work, ROLLBACK, records, user_forced=force)
        self._to_trash(ROLLBACK, f"rb-{info.seq}")
        self._drop_barriers_from(info.seq)
        return n

    def check_content(self, info: StepInfo, records: list[dict]) -> None:
        """Every preimage a rollback will read is present and decodes to its recorded size —
        checked before the tree is touched, so a corrupt store refuses instead of half-undoing."""
        open_content = self._open_content(info.dirname)
        for r in records:
            if r.get("op") == "pre" and r.get("kind") == REG:
                if "blob" in r and not self.fs.exists(join(info.dirname, r["blob"])):
                    raise CorruptStep(f"step {info.id}: preimage of {r['path']!r} is missing ({info.dirname}/{r['blob']})",
                                      step_id=info.id)
                try:
                    for _ in open_content(r):
                        pass
                except CorruptStep as e:
                    raise CorruptStep(f"step {info.id}: {e.message}", step_id=info.id) from None
                except (KeyError, TypeError, ValueError) as e:
                    raise CorruptStep(f"step {info.id}: record for {r.get('path')!r} is malformed ({e})", step_id=info.id) from None

    def _open_content(self, where: str):
        def gen(rec: dict) -> Iterator[bytes]:
            size = 0
            if "data" in rec:
                try:
                    data = zstandard.ZstdDecompressor().decompressobj().decompress(unb64(rec["data"]))
                except (ValueError, zstandard.ZstdError) as e:
                    raise CorruptStep(f"{where}: preimage of {rec['path']!r} is corrupt ({e})") from None
                size = len(data)
                yield data
            else:
                blob = join(where, rec["blob"])
                dec = zstandard.ZstdDecompressor().decompressobj() if rec["enc"] == "zstd" else None
                offset = 0
                while True:
                    try:
                        chunk = self.fs.read(blob, offset, preimage.CHUNK_BYTES)
                    except OSError as e:
                        raise CorruptStep(f"{where}: preimage of {rec['path']!r} unreadable ({e})") from None
                    if not chunk:
                        break
                    offset += len(chunk)
                    if dec is not None:
                        try:
                            chunk = dec.decompress(chunk)
                        except zstandard.ZstdError as e:
                            raise CorruptStep(f"{where}: preimage of {rec['path']!r} is corrupt ({e})") from None
                    size += len(chunk)
                    yield chunk
            if size != rec["size"]:
                raise CorruptStep(f"{where}: preimage of {rec['path']!r} has {size} bytes, expected {rec['size']}")
        return gen

    def _undo_resumable(self, work: HostFS, where: str, records: list[dict], user_forced: bool = False) -> int:
        """Undo a journal directory's records, resuming after the ones already undone.

        ``<where>/progress`` grows by one byte per record undone, after the undo; so a crash,
        ENOSPC or EIO at any point leaves a count that is exact or one short, and redoing
        one record's undo is harmless (every undo is idempotent on its own). Undoing from
        the newest again would not be: a ``renamed`` record's inverse must never run twice.
        Used by rollback, recovery and deny alike.
        """
        try:
            done = self.fs.lstat(join(where, "progress")).size
        except FileNotFoundError:
            self.fs.create(join(where, "progress"), 0o600)
            self._sync(where)
            done = 0
        done = min(done, len(records))
        return self._undo_records(work, where, records, start=done, progress=done, user_forced=user_forced)

    def _undo_records(self, work: HostFS, where: str, records: list[dict], start: int, progress: int | None,
                      user_forced: bool = False) -> int:
        """Pass 1: undo records newest first, skipping the ``start`` already done (rule 3).
        Pass 2: directory metadata, deepest first (idempotent, so always redone whole)."""
        open_content = self._open_content(where)
        done = start
        for rec in reversed(records[: len(records) - start]):
            # a rollback that began always completes (force); only the user's force overrides
            # the evidence that a rename never ran (see preimage.restore)
            try:
                preimage.restore(work, rec, open_content, force=True, dir_meta=False, user_forced=user_forced)
            except OSError as e:  # name the path being restored, not just the host call's final component
                raise OSError(e.errno, e.strerror or str(e), rec["src"] if rec["op"] == "renamed" else rec["path"]) from e
            self.sync_work(work, *((rec["src"], rec["dst"]) if rec["op"] == "renamed" else (rec["path"],)))
            done += 1
            if progress is not None:
                self.fs.write_all(join(where, "progress"), done - 1, b".")
                self._sync(join(where, "progress"))
        plan = preimage.dir_meta_plan(records)
        for rec in plan:
            preimage.apply_dir_meta(work, rec)
        self.sync_work(work, *(rec["path"] for rec in plan))
        return done - start

    def _to_trash(self, path: str, name: str) -> None:
        """Atomically retire ``path`` (one rename), then delete it. If the deletion fails
        the directory is already out of the way; ``open`` empties trash/ again."""
        dst = join("trash", name)
        if self.fs.exists(dst):
            preimage.remove_tree(self.fs, dst)
        self.fs.rename(path, dst)  # the retirement: after this the caller's change has happened
        try:
            self._sync(parent_of(path), "trash")
            preimage.remove_tree(self.fs, dst)
        except OSError as e:
            self._emit({"type": "event.warning", "message": f"could not delete {dst} from the undo store ({e}); retried on next open"})

    # ------------------------------------------------------------------ limits

    def total_size_bytes(self) -> int:
        return sum(s.size_bytes for s in self._steps) + (self.open_step.size_bytes if self.open_step else 0)

    def enforce_limits(self, best_effort: bool = False) -> None:
        """Evict oldest steps until within limits. With ``best_effort`` an I/O error only
        warns and leaves ``eviction_pending`` set; the next step boundary retries."""
        evicted = []
        try:
            while len(self._steps) > self.limits.max_step_count:
                evicted.append(self._evict_oldest())
            while self._steps and self.total_size_bytes() > self.limits.max_log_size_bytes:
                evicted.append(self._evict_oldest())
            self.eviction_pending = False
        except OSError as e:
            self.eviction_pending = True
            if not best_effort:
                raise
            self._emit({"type": "event.warning", "message": f"evicting old undo steps failed ({e}); retried at the next step"})
        if evicted:
            oldest = self._steps[0].seq if self._steps else self._counters["next_seq"]
            for b in [b for b in self._barriers if b.after_seq < oldest]:
                self.remove_barrier(b)  # nothing it guarded can be rolled back any more
            self._emit({"type": "event.warning", "message": f"undo history limit reached: evicted {len(evicted)} oldest step(s) "
                        f"({', '.join(str(i) for i in evicted)})", "evicted_step_ids": evicted})

    def _evict_oldest(self) -> int:
        info = self._steps[0]
        self._to_trash(info.dirname, f"ev-{info.seq}")  # the rename into trash/ is the eviction
        self._steps.pop(0)
        return info.id

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> dict | None:
        """Rule 5, on open. Returns ``{"kind", "step_id", "paths_restored"}`` or None if
        there was nothing to do.

        Never fails because the work cannot be finished now (a disk that answers EIO or is
        full, an immutable file, an unparsable journal): that is reported — kind
        ``rollback_incomplete`` with a ``message``, and an ``event.warning`` — and history
        stays readable; undo and new steps are refused until :meth:`finish_recovery`
        succeeds (it is retried before each), or the store is discarded. An open that
        failed instead would fail the same way every time: a wedged store.
        """
        try:
            for name in self.fs.listdir("trash"):
                preimage.remove_tree(self.fs, join("trash", name))
        except OSError as e:  # only space is lost; retried at the next open
            self._emit({"type": "event.warning", "message": f"could not empty the undo store's trash ({e}); retried on next open"})
        try:
            report = self.finish_recovery()
        except RollbackIncomplete as e:
            report = {"kind": "rollback_incomplete", "step_id": e.data.get("step_id"), "paths_restored": 0,
                      "message": e.message}
            self._emit({"type": "event.warning", "code": e.code, "message": e.message})
        if report is not None:
            self._emit({"type": "event.recovery", **report})
        return report

    def finish_recovery(self) -> dict | None:
        """Finish what an earlier run (or call) left half-done: an interrupted rollback
        (``wal/rollback``), then the WAL of a step that never finished (never this run's own
        open step). Returns what was done, like :meth:`_recover`, or None.

        Raises :class:`RollbackIncomplete` if it cannot finish now; what was done so far
        stays done (progress counts), so the next call resumes.
        """
        report = None
        finished = self.finish_pending_rollback()
        if finished is not None:
            report = {"kind": "rollback_finished", **finished}
        if self.open_step is None and self.fs.exists(WAL):
            report = self._recover_wal() or report
        return report

    def _recover_wal(self) -> dict | None:
        """Roll back (or, if unprotected, keep) the step a dead process left in the WAL."""
        work = self._work
        header = None
        try:
            header, records, unprotected = self._read_wal(WAL)
            if header is None or (not records and not unprotected):
                self._to_trash(WAL, "wal-empty")  # died before its first record: nothing happened
                return None
            if unprotected:
                # its preimages are gone; promote it as unprotected so history says what happened
                self.open_step = OpenStep(seq=header["seq"], id=header["id"], type=header["type"], command=header["command"],
                                          started_ns=header["started_ns"], records=records, unprotected=True)
                try:
                    self.finish(work, None, outcome="recovered")
                except BaseException:
                    self.open_step = None  # still in the WAL: the next recovery tries again
                    raise
                return {"kind": "unprotected_step_kept", "step_id": header["id"], "paths_restored": 0}
            self._undo_resumable(work, WAL, records)
            self._to_trash(WAL, f"wal-{header['seq']}")
            return {"kind": "in_progress_rolled_back", "step_id": header["id"],
                    "paths_restored": len(self.touched_paths(records))}
        except (OSError, CorruptStep, KeyError, TypeError) as e:
            raise self._incomplete("recovery of an interrupted step", header, e) from e

    def _incomplete(self, what: str, header: dict | None, e: BaseException) -> RollbackIncomplete:
        step_id = header.get("id") if isinstance(header, dict) else None
        path = getattr(e, "filename", None)
        code = getattr(e, "errno", None)
        cause = (f"{e.strerror or e}{f' on {path!r}' if path is not None else ''}" if isinstance(e, OSError)
                 else getattr(e, "message", None) or f"{type(e).__name__}: {e}")
        step = f"step {step_id}" if step_id is not None else "a step"
        return RollbackIncomplete(
            f"{what} ({step}) could not finish: {cause}. The working folder is between two steps: undo and "
            "new steps are refused until it finishes — it is retried on every open and undo once the cause is "
            "fixed — or discard the undo history (`sandbox discard`)",
            os_errno=code if isinstance(code, int) else None,
            step_id=step_id, path=path, errno=_errno_name(code), reason=cause)

    def _read_wal(self, where: str) -> tuple[dict | None, list[dict], bool]:
        """(header, live records, unprotected) of a WAL-like directory; no journal = no header."""
        try:
            data = self.fs.read_all(join(where, "journal.jsonl"))
        except FileNotFoundError:
            return None, [], False
        header, records = parse_journal(data, where)
        unprotected = any(r.get("op") == "unprotected" for r in records)
        return header, [r for r in records if r.get("op") != "unprotected"], unprotected

    @property
    def rollback_pending(self) -> bool:
        """A rollback or a recovery stopped part-way and is not finished yet."""
        return self.fs.exists(ROLLBACK) or (self.open_step is None and self.fs.exists(WAL))

    def finish_pending_rollback(self) -> dict | None:
        """Finish a rollback that was interrupted (crash, ENOSPC, EIO) from its progress count,
        forced if the user forced it. :class:`RollbackIncomplete` if it cannot finish now.

        Until this succeeds no new step may begin: the tree is between two steps.
        """
        if not self.fs.exists(ROLLBACK):
            return None
        header = None
        try:
            header, records, _ = self._read_wal(ROLLBACK)
            seq = header["seq"] if header else 0
            self._steps = [s for s in self._steps if s.seq != seq]
            forced = self.fs.exists(join(ROLLBACK, "forced"))
            self._undo_resumable(self._work, ROLLBACK, records, user_forced=forced)
            self._to_trash(ROLLBACK, f"rb-{seq}")
        except (OSError, CorruptStep, KeyError, TypeError) as e:
            raise self._incomplete("an undo", header, e) from e
        self._drop_barriers_from(seq)
        return {"step_id": header["id"] if header else None, "paths_restored": len(self.touched_paths(records))}

    def _drop_barriers_from(self, seq: int) -> None:
        """Barriers after a step that no longer exists in history mean nothing now."""
        for b in [b for b in self._barriers if b.after_seq >= seq]:
            self.remove_barrier(b)
