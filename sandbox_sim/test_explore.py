"""The crash-state exploration API (``sandbox_sim/explore.py``; issue 19).

On the fixed workload of ``test_crash.py`` (every primitive, hard links, a directory
rename, ``rm -rf``) after an earlier step, then a rollback of both: every crash point is
explored, both outcomes of a crash inside a step occur (rolled back, kept), and nothing is
violated — with a crash, and with power loss in durable mode. The explorer has teeth: power
loss without the core's fsyncs, and a planted undo defect, are found, each with the crash
point that replays it alone.
"""

from __future__ import annotations

import pytest

from . import defects
from .explore import EXPLORE_STATES_MAX, Rollback, Step, explore_crashes
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
