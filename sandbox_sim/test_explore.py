"""The crash-state exploration API (``sandbox_sim/explore.py``; issue 19).

On the fixed workload of ``test_crash.py`` (every primitive, hard links, a directory
rename, ``rm -rf``) after an earlier step, then a rollback of both: every crash point is
explored, both outcomes of a crash inside a step occur (rolled back, kept), and nothing is
violated — with a crash, and with power loss in durable mode. The explorer has teeth: power
loss without the core's fsyncs, and a planted undo defect, are found, each with the crash
point that replays it alone.

Between the power-loss extremes (``loss_states="prefixes"``): the same workload survives
every per-inode prefix of un-fsynced writes; a toy store bug that relies on the order of
two un-fsynced writes is found there and only there, and replayed alone; the per-point
limit samples the same states for the same seed.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox.core.store import UndoLog

from . import defects
from .explore import EXPLORE_LOSS_STATES_MAX, EXPLORE_STATES_MAX, Rollback, Step, explore_crashes, prefix_states
from .test_crash import seed_fixed, workload


def _earlier(ws):
    ws.fs.write_file("earlier.txt", b"from an earlier step")
    ws.fs.chmod("top", 0o640)


WORKLOAD = [Step("earlier", _earlier), Step("workload", workload), Rollback(2)]


def test_every_crash_point_of_steps_and_a_rollback_recovers_exactly():
    report = explore_crashes(seed_fixed, WORKLOAD)
    assert report.host_calls > 150
    assert report.states == report.host_calls
    assert not report.violations, report.violations[:3]
    kinds = " ".join(report.outcomes)
    assert "died in action 1 (step)" in kinds and "died in action 2 (rollback)" in kinds, report.outcomes
    assert sum(report.outcomes.values()) == report.states


def test_power_loss_at_every_point_in_durable_mode_and_the_negative_control():
    report = explore_crashes(seed_fixed, WORKLOAD[:2], power_loss=True)
    assert report.states == 2 * report.host_calls
    assert not report.violations, report.violations[:3]
    control = explore_crashes(seed_fixed, WORKLOAD[:2], power_loss=True, durable=False)
    assert control.violations, "power loss without the core's fsyncs must lose the undo somewhere"


@pytest.mark.interpreted_only
def test_a_planted_defect_is_found_with_the_crash_point_that_replays_it():
    remove = defects.plant("forget_mtime")
    try:
        report = explore_crashes(seed_fixed, WORKLOAD[:2])
        assert report.violations[0].k == -1 and "mtime_ns" in report.violations[0].error  # the plain rollback too
        crashed = [v for v in report.violations if v.k >= 0]
        assert crashed, "no crash state found the defect"
        v = crashed[0]
        assert "mtime_ns" in v.error, v
        again = explore_crashes(seed_fixed, WORKLOAD[:2], ks=[v.k])
        assert again.states == 1 and again.violations and again.violations[0].error == v.error
    finally:
        remove()
    assert not explore_crashes(seed_fixed, WORKLOAD[:2], ks=[v.k]).violations


def test_more_states_than_the_bound_are_refused_unless_the_points_are_named(monkeypatch):
    from . import explore

    assert EXPLORE_STATES_MAX == 100_000
    monkeypatch.setattr(explore, "EXPLORE_STATES_MAX", 50)
    with pytest.raises(ValueError, match="EXPLORE_STATES_MAX"):
        explore_crashes(seed_fixed, WORKLOAD[:2])
    assert explore_crashes(seed_fixed, WORKLOAD[:2], ks=[0, 60, 120]).states == 3


# ---------------------------------------------------------------- the states between the extremes

BIG = random.Random(19).randbytes(16 * 1024)  # incompressible: its preimage goes to a blob file, not the journal line


def _big_tree(fs):
    fs.create("big", 0o644)
    fs.write_all("big", 0, BIG)
    fs.mkdir("d", 0o755)


def _overwrite(ws):
    ws.fs.write_file("big", b"short now")
    ws.fs.write_file("d/new", b"fresh")


SMALL = [Step("overwrite", _overwrite)]
UNDONE = [Step("overwrite", _overwrite), Rollback(1)]


@contextlib.contextmanager
def _work_synced_with_the_next_store_sync():
    """A toy store bug: the working folder's fsyncs wait for the store's next fsync. A
    rollback then writes an undone record's progress mark before the restored bytes are
    durable — two inodes written without an fsync between them, relying on the restore
    reaching the disk first; only a power loss *between* the extremes shows it."""
    sync_work, sync = UndoLog.sync_work, UndoLog._sync

    def planted_sync_work(self, work, *paths):
        self.__dict__.setdefault("_owed_work_syncs", []).append((work, paths))  # per store: dies with its process

    def planted_sync(self, *paths):
        owed = self.__dict__.setdefault("_owed_work_syncs", [])
        while owed:
            work, owed_paths = owed.pop(0)
            sync_work(self, work, *owed_paths)
        sync(self, *paths)

    UndoLog.sync_work, UndoLog._sync = planted_sync_work, planted_sync
    try:
        yield
    finally:
        UndoLog.sync_work, UndoLog._sync = sync_work, sync


@pytest.mark.interpreted_only
def test_a_store_relying_on_unsynced_order_is_found_only_between_the_extremes():
    with _work_synced_with_the_next_store_sync():
        extremes = explore_crashes(_big_tree, UNDONE, power_loss=True)
        between = explore_crashes(_big_tree, UNDONE, power_loss=True, loss_states="prefixes")
    assert not extremes.violations, extremes.violations[:3]  # both extremes recover: the bug hides there
    assert between.violations, "keeping a progress mark but not the restore it counts must break the undo"
    v = between.violations[0]
    assert v.mode == "power loss keeping un-fsynced writes" and v.k >= 0 and v.action == 1, v  # in the rollback
    assert any(disk == "store" and p > 0 for disk, _ino, p in v.keep), v.keep  # the mark survived
    assert v.replay == {"power_loss": True, "durable": True, "loss_states": "prefixes", "ks": [v.k], "keep": v.keep}
    with _work_synced_with_the_next_store_sync():
        again = explore_crashes(_big_tree, UNDONE, **v.replay)  # exactly that state, alone
    assert again.states == 1 and [(w.k, w.keep, w.error) for w in again.violations] == [(v.k, v.keep, v.error)]


def test_the_real_core_survives_every_state_between_the_extremes():
    """Every primitive, hard links, a directory rename, ``rm -rf`` after an earlier step,
    then a rollback of both: every crash point with every prefix of every inode's
    un-fsynced writes, in both disks."""
    between = explore_crashes(seed_fixed, WORKLOAD, power_loss=True, loss_states="prefixes")
    assert not between.violations, between.violations[:3]
    extremes = 2 * between.host_calls  # what loss_states="extremes" explores
    assert between.states > extremes * 3 // 2, (between.states, extremes)
    assert between.loss_states_sampled == 0 and between.loss_states_possible == between.states
    assert sum(between.outcomes.values()) == between.states
    assert len({keep for _k, _mode, keep in between.explored}) > 20  # many different survivors, not one repeated
    assert {disk for _k, _mode, keep in between.explored for disk, _ino, _p in keep} == {"work", "store"}


def test_more_loss_states_than_the_limit_are_sampled_deterministically_per_seed():
    assert EXPLORE_LOSS_STATES_MAX == 64
    full = explore_crashes(_big_tree, SMALL, power_loss=True, loss_states="prefixes")
    runs = [explore_crashes(_big_tree, SMALL, power_loss=True, loss_states="prefixes", loss_states_max=3, seed=s)
            for s in (1, 1, 2)]
    a, b, c = runs
    assert a.loss_states_sampled > 0 and a.loss_states_possible == full.states
    assert a.states < full.states
    assert (a.states, a.explored) == (b.states, b.explored)  # the same seed: the same states
    assert a.explored != c.explored  # another seed: others
    assert set(a.explored) <= set(full.explored) and set(c.explored) <= set(full.explored)


def test_loss_options_are_checked():
    with pytest.raises(ValueError, match="power_loss"):
        explore_crashes(_big_tree, SMALL, loss_states="prefixes")
    with pytest.raises(ValueError, match="loss_states"):
        explore_crashes(_big_tree, SMALL, power_loss=True, loss_states="everything")
    with pytest.raises(ValueError, match="ks"):
        explore_crashes(_big_tree, SMALL, power_loss=True, loss_states="prefixes", keep=())
    with pytest.raises(ValueError, match="no un-fsynced"):
        explore_crashes(_big_tree, SMALL, power_loss=True, loss_states="prefixes", ks=[0], keep=(("store", 999, 1),))


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 6), min_size=0, max_size=8), limit=st.integers(2, 40), seed=st.integers(0, 3),
       k=st.integers(0, 500))
def test_the_loss_states_of_a_crash_point(counts, limit, seed, k):
    choices = {("store" if i % 2 else "work", 10 + i): n for i, n in enumerate(counts)}
    states, total = prefix_states(choices, k, seed, limit)
    assert total == math.prod(n + 1 for n in counts)
    assert len(states) == min(total, limit)
    assert len(set(states)) == len(states)  # distinct
    assert states[0] == ()  # the strict extreme first
    if total > 1 and limit >= 2:
        assert tuple((d, i, n) for (d, i), n in sorted(choices.items())) in states  # the other one: all kept
    for s in states:
        assert all(0 < p <= choices[(d, i)] for d, i, p in s)
    assert prefix_states(choices, k, seed, limit) == (states, total)  # deterministic


def test_the_loss_states_of_more_combinations_than_an_index_holds():
    choices = {("store", i): 1 + i % 3 for i in range(70)}  # more than sys.maxsize combinations
    states, total = prefix_states(choices, 7, 0, 10)
    assert total == math.prod(2 + i % 3 for i in range(70)) and total > sys.maxsize
    assert len(states) == len(set(states)) == 10
    assert states[0] == () and states[-1] == tuple(("store", i, 1 + i % 3) for i in range(70))
    assert prefix_states(choices, 7, 0, 10) == (states, total) != prefix_states(choices, 7, 1, 10)
