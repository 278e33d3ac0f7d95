"""Hypothesis model of barriers: rollback never silently clobbers what the sandbox did not write.

Sandbox steps interleave with *external* edits made straight on the host (as a user's
editor would), sometimes reported as a barrier, sometimes not detected at all.
Invariants, for every rollback without ``force``:

* if a barrier sits after any step being undone, the rollback is refused;
* a refused rollback leaves the tree exactly as it was;
* a rollback that goes through leaves every external edit exactly as the user made it.

With ``force`` the rollback goes through, crosses the barriers and removes them — also
after the user replaced a directory by a symlink (inside, outside, dangling), a file by a
directory or a symlink by a directory — and leaves no unfinished rollback behind.
"""

from __future__ import annotations

import random
import tempfile

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sandbox.core.errors import BarrierInTheWay, ExternalChange, StepUnprotected
from sandbox.hostfs import DIR, LNK, REG, is_within, parent_of

from . import oracle
from .budget import model_case
from .client import REPLACEMENT_LINK_TARGETS, SimClient, random_op, seed_tree
from .world import World

seeds = st.integers(0, 2**32 - 1)


class BarrierModel(RuleBasedStateMachine):
    backend = "sim"

    def __init__(self):
        super().__init__()
        self._tmp = tempfile.TemporaryDirectory(prefix="sandbox-barrier-") if self.backend == "real" else None
        self.world = World(self.backend, self._tmp.name if self._tmp else None)
        self.ws = None
        self.external: dict[str, object] = {}  # path -> what the user left there (see _state)
        self.origin: dict[str, object] = {}  # path -> what was there before the user's first change
        self.barrier_seqs: list[int] = []

    def teardown(self):
        if self.ws is not None:
            self.ws.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    @initialize(seed=seeds)
    def setup(self, seed):
        with self.world.paused():
            seed_tree(self.world.work, random.Random(seed))
        self.ws = self.world.open()
        self.client = SimClient(self.ws.fs)

    def _forget_touched(self, paths: list[str]) -> None:
        """The sandbox wrote these (or their parents moved): they are its own now."""
        for p in list(self.external):
            if any(is_within(p, t) for t in paths if t):
                del self.external[p]
                self.origin.pop(p, None)

    def _user_changed(self, path: str, before: object) -> None:
        """Remember what the user left at ``path`` — unless it is what was there before their
        first change (created, then deleted again): then there is no edit of theirs to keep."""
        origin = self.origin.setdefault(path, before)
        now = self._state(path)
        if now == origin:
            del self.origin[path]
            self.external.pop(path, None)
        else:
            self.external[path] = now

    @rule(seed=seeds, count=st.integers(1, 5))
    def step(self, seed, count):
        rng = random.Random(seed)
        with self.ws.step(f"ops {seed}"):
            for _ in range(count):
                random_op(self.client, rng, 1_700_000_000_000_000_000)
        # a write through one name of a file is the sandbox's write under every name it had:
        # the names its preimages list (``links``) are the sandbox's too
        linked = [q for r in self.ws.records() for q in r.get("links", ())] if self.ws.steps() else []
        self._forget_touched(self.ws.history()[0]["paths"] + linked)

    def _candidates(self, touched_only: bool) -> list[str]:
        """Regular files now in the tree, and paths the newest step deleted (to re-create)."""
        hist = self.ws.history()
        touched = set(hist[0]["paths"]) if hist and touched_only else None
        out = []
        with self.world.paused():
            def walk(p):
                for name in sorted(self.world.work.listdir(p)):
                    c = f"{p}/{name}" if p else name
                    kind = self.world.work.lstat(c).kind
                    if kind == DIR:
                        walk(c)
                    elif kind == REG and (touched is None or c in touched):
                        out.append(c)
            walk("")
            for p in sorted(touched or ()):
                if p and not self.world.work.exists(p) and self.world.work.exists(parent_of(p)) \
                        and self.world.work.lstat(parent_of(p)).kind == DIR:
                    out.append(p)
        return out

    @rule(pick=st.integers(0, 1000), touched_only=st.booleans(), data=st.binary(max_size=40), delete=st.booleans(),
          report=st.booleans())
    def external_edit(self, pick, touched_only, data, delete, report):
        """The user edits, creates or deletes a file on the host, behind the sandbox's back."""
        candidates = self._candidates(touched_only) or self._candidates(False)
        if not candidates:
            return
        path = candidates[pick % len(candidates)]
        with self.world.paused():
            before = self._state(path)
            exists = self.world.work.exists(path)
            links = []  # an edit in place changes every name of the file: the user edited each
            if exists and not delete:
                st = self.world.work.lstat(path)
                if st.nlink > 1:
                    same = [q for q in self._candidates(False) if q != path]  # (some may not exist)
                    links = [(q, self._state(q)) for q in same
                             if getattr(self.world.work.lstat_or_none(q), "ino", None) == st.ino]
            if delete and exists:
                self.world.work.unlink(path)
            else:
                if not exists:
                    self.world.work.create(path, 0o644)
                self.world.work.truncate(path, 0)
                self.world.work.write_all(path, 0, data)
            self._user_changed(path, before)
            for q, was in links:
                self._user_changed(q, was)
        if report:
            b = self.ws.record_external_modification([path])
            self.barrier_seqs.append(b["after_seq"])

    def _state(self, path: str) -> object:
        """What is at ``path`` as the user sees it: bytes of a file, ``("lnk", target)``,
        ``("dir",)``, or None (nothing, also below a symlink)."""
        st = self.world.work.lstat_or_none(path)
        if st is None:
            return None
        if st.kind == REG:
            return self.world.work.read_all(path)
        if st.kind == LNK:
            return ("lnk", self.world.work.readlink(path))
        return (st.kind,)

    @rule(pick=st.integers(0, 1000), kind=st.sampled_from(["dir_by_symlink", "file_by_dir", "symlink_by_dir"]),
          link_to=st.sampled_from(REPLACEMENT_LINK_TARGETS), report=st.booleans())
    def external_replace(self, pick, kind, link_to, report):
        """The user replaces an object by one of another kind on the host (`rm -rf d && ln -s
        … d`, a file by a directory, a symlink by a directory), behind the sandbox's back."""
        want = {"dir_by_symlink": DIR, "file_by_dir": REG, "symlink_by_dir": LNK}[kind]
        with self.world.paused():
            found = []

            def walk(p):
                for name in sorted(self.world.work.listdir(p)):
                    c = f"{p}/{name}" if p else name
                    k = self.world.work.lstat(c).kind
                    if k == want:
                        found.append(c)
                    if k == DIR:
                        walk(c)
            walk("")
            if not found:
                return
            path = found[pick % len(found)]
            before = self._state(path)
            self._remove(path)
            if kind == "dir_by_symlink":
                self.world.work.symlink(link_to, path)
            else:
                self.world.work.mkdir(path, 0o755)
                self.world.work.create(f"{path}/users-file", 0o644)
                self.world.work.write_all(f"{path}/users-file", 0, b"the user's")
        for p in [p for p in self.external if is_within(p, path) and p != path]:
            del self.external[p]  # gone with what they were in: what counts is what replaced it
            self.origin.pop(p, None)
        with self.world.paused():
            self._user_changed(path, before)
            if kind != "dir_by_symlink":
                self._user_changed(f"{path}/users-file", None)
        if report:
            b = self.ws.record_external_modification([path])
            self.barrier_seqs.append(b["after_seq"])

    def _remove(self, path: str) -> None:
        st = self.world.work.lstat(path)
        if st.kind == DIR:
            for name in self.world.work.listdir(path):
                self._remove(f"{path}/{name}")
            self.world.work.rmdir(path)
        else:
            self.world.work.unlink(path)

    @precondition(lambda self: self.ws is not None and self.ws.steps())
    @rule(n=st.integers(1, 3))
    def rollback(self, n):
        steps = self.ws.steps()
        n = min(n, len(steps))
        oldest = steps[-n].seq
        must_refuse = any(seq >= oldest for seq in self.barrier_seqs)
        before = self.world.snapshot()
        # the moves being undone, newest first: an edit inside a tree a step moved is where
        # undoing the move puts it (the user edited the file, not the sandbox's name for it)
        moves = [r for step in reversed(steps[-n:]) for r in reversed(self.ws.records(step.id))
                 if r["op"] in ("renamed", "exchanged")]
        try:
            self.ws.rollback(n)
        except (BarrierInTheWay, ExternalChange) as e:
            assert must_refuse or isinstance(e, ExternalChange)
            oracle.assert_same(before, self.world.snapshot(), "a refused rollback changed the tree")
            return
        except StepUnprotected:
            return
        assert not must_refuse, "rollback crossed a barrier without force"
        self.barrier_seqs = [s for s in self.barrier_seqs if s < oldest]
        self.external = {_moved_back(p, moves): data for p, data in self.external.items()}
        self.origin = {_moved_back(p, moves): data for p, data in self.origin.items()}
        with self.world.paused():
            for path, data in self.external.items():
                now = self._state(path)
                assert now == data, f"rollback clobbered the user's edit of {path!r}: {data!r} -> {now!r}"

    @precondition(lambda self: self.ws is not None and self.ws.steps())
    @rule()
    def forced_rollback(self):
        oldest = self.ws.steps()[-1].seq
        try:
            self.ws.rollback(1, force=True)
        except StepUnprotected:
            return
        assert not self.ws.rollback_pending, "a forced rollback left an unfinished rollback behind"
        self.barrier_seqs = [s for s in self.barrier_seqs if s < oldest]
        self.external.clear()  # force may overwrite them: that is what force means
        self.origin.clear()

    @invariant()
    def barriers_are_visible(self):
        if self.ws is not None:
            shown = sum(len(h["barriers"]) for h in self.ws.history())
            live = len([b for b in self.ws.barriers() if any(s.seq == b["after_seq"] for s in self.ws.steps())])
            assert shown == live


def _moved_back(path: str, moves: list[dict]) -> str:
    """Where ``path`` is after undoing ``moves`` (``renamed``/``exchanged`` records, newest
    first): under a rename's destination it goes back under its source; under one side of an
    exchange, under the other."""
    for r in moves:
        src, dst = r["src"], r["dst"]
        if is_within(path, dst):
            path = src + path[len(dst):]
        elif r["op"] == "exchanged" and is_within(path, src):
            path = dst + path[len(src):]
    return path


class RealBarrierModel(BarrierModel):
    backend = "real"


TestBarrierModelSim = model_case(BarrierModel, 50, 25)
TestBarrierModelReal = model_case(RealBarrierModel, 10, 15, 30)


def test_an_edit_inside_a_tree_the_step_moved_moves_back_with_it():
    """Hypothesis's example (seed 0): a step moves ``d2`` to ``d1/e/moved``; the user then
    empties a file hard-linked as ``c.ln``, ``d1/c.ln`` and ``d1/e/moved/b``. Undoing the step
    moves the directory back: the user's bytes are at ``d2/b`` and under the other names,
    never overwritten — what the model expects wherever undoing a move puts an edit."""
    m = BarrierModel()
    try:
        m.setup(seed=0)
        m.step(count=1, seed=0)
        m.external_replace(kind="file_by_dir", link_to="d2", pick=0, report=False)
        m.forced_rollback()
        m.external_replace(kind="dir_by_symlink", link_to="d2", pick=0, report=False)
        m.step(count=1, seed=119394)
        assert any(r["op"] == "renamed" and r["dst"] == "d1/e/moved" for r in m.ws.records(m.ws.steps()[-1].id))
        m.external_edit(data=b"", delete=False, pick=2, report=False, touched_only=False)
        assert m.external.get("d1/e/moved/b") == b""
        m.rollback(n=1)
        assert m.external.get("d2/b") == b"" and m.world.work.read_all("d2/b") == b""
        assert m.world.work.read_all("c.ln") == b"" and m.world.work.lstat("c.ln").ino == m.world.work.lstat("d2/b").ino
    finally:
        m.teardown()
