"""Power-loss mode (``Workspace.open(..., durable=True)``): the machine dies, not just the agent.

The simulated disk keeps only what was fsynced (``MemoryHostFS.power_loss``: the strictest
model — no ordering between files is assumed). With ``durable=True`` the core fsyncs in
WAL order, so a power loss at *any* host call recovers exactly like a crash does. The
negative control shows the same power losses break the undo without ``durable``: the
model has teeth, and the mode is not decoration.
"""

from __future__ import annotations

import pytest

from . import oracle
from .faults import FaultInjector, SimulatedCrash
from .test_crash import seed_fixed, workload
from .world import World


def _prepare(durable: bool, chmod: str = "top"):
    """A simulated world with the fixed tree on the disk, open, and one earlier step (a
    write and a chmod of ``chmod``) long synced: only what runs next is at risk."""
    w = World("sim")
    with w.paused():
        seed_fixed(w.work)
        w.work.sync_all()
    initial = w.snapshot()
    ws = w.open(durable=durable)
    with ws.step("earlier"):
        ws.fs.write_file("earlier.txt", b"from an earlier step")
        ws.fs.chmod(chmod, 0o640)
    w.work.sync_all()  # the earlier step is long on the disk: only the workload is at risk
    w.store.sync_all()
    return w, ws, initial


def _step(ws):
    with ws.step("workload"):
        workload(ws)


def _total_calls(action) -> int:
    w, ws, _ = _prepare(True)
    w.injector = FaultInjector()
    action(ws)
    return w.injector.calls


def _power_loss_in_step(k: int, durable: bool, writeback: bool = False) -> str | None:
    """Crash + power loss at host call k of the workload step; returns a violation or None.

    ``writeback``: before the power went, the kernel had written the working tree back
    (all of it), but of the undo store only what was fsynced survives."""
    w, ws, initial = _prepare(durable)
    pre = w.snapshot()
    w.injector = FaultInjector(crash_at=k)
    try:
        _step(ws)
    except SimulatedCrash:
        pass
    else:
        return None
    at_crash = w.snapshot()
    if writeback:
        w.work.sync_all()
    w.crash(ws, power_loss=True)
    try:
        ws2 = w.open(durable=durable)
        kept = ws2.history()[0]["command"] == "workload"
        d = oracle.diff(at_crash if kept else pre, w.snapshot())
        if d:
            return f"power loss at call {k}: " + "; ".join(d[:3])
        if kept:
            ws2.rollback(1)
        ws2.rollback(1)
        d = oracle.diff(initial, w.snapshot())
        return f"power loss at call {k}, then full rollback: " + "; ".join(d[:3]) if d else None
    except Exception as e:  # noqa: BLE001 - any failure to recover is a violation here
        return f"power loss at call {k}: {type(e).__name__}: {e}"


@pytest.mark.parametrize("writeback", [False, True], ids=["plain", "tree-written-back"])
def test_power_loss_at_every_host_call_of_a_step_recovers_exactly(writeback):
    total = _total_calls(_step)
    assert total > 200  # durable mode adds the fsyncs
    violations = [v for k in range(total) if (v := _power_loss_in_step(k, durable=True, writeback=writeback))]
    assert not violations, "\n".join(violations[:10])


def test_without_durable_mode_power_loss_breaks_undo():
    """Negative control: the same power losses without the fsyncs — some recoveries fail."""
    w, ws, _ = _prepare(False)
    w.injector = FaultInjector()
    _step(ws)
    total = w.injector.calls
    violations = [v for k in range(0, total, 3) if (v := _power_loss_in_step(k, durable=False, writeback=True))]
    assert violations, "power loss without fsync never broke anything: the disk model is too kind"


def test_power_loss_at_every_host_call_of_a_rollback():
    def setup(ws):
        _step(ws)

    w, ws, _ = _prepare(True)
    setup(ws)
    w.injector = FaultInjector()
    ws.rollback(2)
    total = w.injector.calls
    for k in range(total):
        w, ws, initial = _prepare(True)
        after_earlier = w.snapshot()
        setup(ws)
        after_workload = w.snapshot()
        w.injector = FaultInjector(crash_at=k)
        with pytest.raises(SimulatedCrash):
            ws.rollback(2)
        w.crash(ws, power_loss=True)
        ws2 = w.open(durable=True)
        left = tuple(h["command"] for h in ws2.history())
        expected = {("workload", "earlier"): after_workload, ("earlier",): after_earlier, (): initial}[left]
        oracle.assert_same(expected, w.snapshot(), f"power loss at rollback call {k} (history {left})")
        if left:
            ws2.rollback(len(left))
        oracle.assert_same(initial, w.snapshot(), f"power loss at rollback call {k}: full rollback")


def test_power_loss_requires_the_simulated_disk(tmp_path):
    w = World("real", str(tmp_path))
    with pytest.raises(ValueError):
        w.crash(None, power_loss=True)


def test_failed_fsync_then_power_loss_in_rollback():
    """Campaign seed 208: a journal append whose fsync failed must still be durable when the
    step is promoted — else a power loss mid-rollback finds fewer records than its progress
    count says were undone, and leaves a file unrestored."""
    import errno

    def world_with_a(store_error_at):
        w = World("sim")
        with w.paused():
            for name in ("a", "b"):
                w.work.create(name, 0o644)
                w.work.write_all(name, 0, f"original {name}".encode())
            w.work.sync_all()
        pre = w.snapshot()
        ws = w.open(durable=True)
        w.injector = FaultInjector(error_at=(store_error_at, errno.EIO))
        try:
            with ws.step("edit"):
                for op in (lambda: ws.fs.write_file("a", b"changed a" * 50), lambda: ws.fs.chmod("b", 0o600)):
                    try:
                        op()
                    except OSError:
                        pass  # the operation failed: it did not happen
        except OSError:  # opening or closing the step failed; closing is retried
            w.injector = FaultInjector()
            ws.close_active()
        w.injector = FaultInjector()
        return w, ws, pre

    w, ws, _ = world_with_a(10**6)
    w.injector = FaultInjector()
    ws.rollback(1)
    calls = w.injector.calls
    exercised = 0
    for j in range(30):
        for k in range(calls):
            w, ws, pre = world_with_a(j)
            hist = ws.history()
            if not hist or hist[0]["command"] != "edit":
                continue  # the error kept the step from opening: nothing to roll back
            w.injector = FaultInjector(crash_at=k)
            try:
                ws.rollback(1)
            except SimulatedCrash:
                exercised += 1
                w.crash(ws, power_loss=True)
                ws = w.open(durable=True)
                if [h["command"] for h in ws.history()] == ["edit"]:
                    ws.rollback(1)  # the power went before the rollback began: do it now
            w.injector = FaultInjector()
            oracle.assert_same(pre, w.snapshot(), f"EIO at store mutation {j}, power loss at rollback call {k}")
    assert exercised > 300  # EIO then power loss, over the whole grid
