"""The undo invariant, checked after every action of a model or campaign.

Every step the history holds has a *post-state*: the tree it left. The invariant:

    the working tree equals the post-state of the newest step in history
    (or, when history is empty, of the newest step ever evicted, or the initial tree)

It covers every core guarantee at once: rollback(n) restores exactly the tree before
those n steps; a crash inside a step recovers exactly the pre-step tree (the step never
reaches history); a crash during rollback or eviction recovers to a step boundary that
history agrees with; a denied step leaves its pre-step tree.
"""

from __future__ import annotations

from sandbox.core.workspace import Workspace

from . import oracle
from .world import World


class Checker:
    def __init__(self, world: World):
        self.world = world
        self.post: dict[int, oracle.Snapshot] = {0: world.snapshot()}
        self.floor_seq = 0  # the newest seq that left history by eviction
        self.known: set[int] = set()

    def expected_seq(self, ws: Workspace) -> int:
        seqs = ws.step_seqs()
        return max(seqs) if seqs else self.floor_seq

    def sync(self, ws: Workspace, tree: oracle.Snapshot | None = None, rolled_back: tuple[int, ...] = ()) -> None:
        """Catch up with history: new steps get ``tree`` (default: now) as post-state;
        steps gone from history were popped (if in ``rolled_back``) or evicted."""
        seqs = set(ws.step_seqs())
        for seq in sorted(seqs):  # new steps: not in post (a set of post's keys would grow with the run)
            if seq not in self.post:
                self.post[seq] = tree if tree is not None else self.world.snapshot()
        for q in self.known - seqs:
            if q in rolled_back:
                self.post.pop(q, None)
            else:
                self.floor_seq = max(self.floor_seq, q)
        self.known = seqs

    def check(self, ws: Workspace, what: str) -> None:
        seq = self.expected_seq(ws)
        oracle.assert_same(self.post[seq], self.world.snapshot(), f"{what}: tree vs post-state of step seq {seq}")
