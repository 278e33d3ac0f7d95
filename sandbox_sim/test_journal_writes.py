"""One journal write per intercepted operation: its preimage lines and its intent line.

An operation that captures preimages and then journals an intent (a create in a directory
not yet captured, a rename over a file, a link, an unlink, an exchange) writes those lines
in one write (``UndoLog.hold``, flushed by the interceptor's hooks) instead of one write
each. The lines' bytes and order are those of separate writes; only where a crash, a torn
write or a power loss can fall between them changes. Every such point is tried here: the
folder comes back exactly as before the step (the step is never promoted by then), the
earlier step stays in history and still rolls back.
"""

from __future__ import annotations

import errno

import pytest

from . import oracle
from .faults import FaultInjector, SimulatedCrash
from .test_crash import _store_error_sweep
from .test_power_loss import _prepare as _prepare_world

JOURNAL = "wal/in_progress/journal.jsonl"


def _ops(ws) -> None:
    """Operations whose hooks journal several lines: preimages, then an intent."""
    fs = ws.fs
    fs.write_file("d1/e/new", b"made in a directory not yet captured")  # d1/e's pre + created
    fs.rename("top", "d2/b")  # both parents' pres, d2/b's pre (a file with a hard link) + renamed
    fs.link("d1/a", "d2/a.link")  # d1/a's pre + created
    fs.unlink("d1/e/c")  # d1/e/c's pre (its parent is captured already)
    fs.exchange("d1", "d2/link")  # the root's pre (d2's is kept) + exchanged
    fs.mkdir("fresh", 0o700)
    fs.write_file("fresh/f", b"f")  # fresh's pre + created


def _step(ws) -> None:
    with ws.step("batched"):
        _ops(ws)


def _prepare(durable: bool = False):
    return _prepare_world(durable, chmod="d1/a")


def _traced(durable: bool = False) -> list[tuple[str, str, str]]:
    w, ws, _ = _prepare(durable)
    w.injector = FaultInjector()
    w.injector.trace = trace = []
    _step(ws)
    return trace


def _recovered(w, initial, pre, at_crash, what: str) -> str:
    """After the crash: exactly the tree before the step (or, if the step's promotion was
    done, the tree the step left: the fsyncs after it in power-loss mode), the earlier step
    in history and still undone exactly. Returns which of the two it was."""
    ws2 = w.open()
    history = [h["command"] for h in ws2.history()]
    if history == ["batched", "earlier"]:
        oracle.assert_same(at_crash, w.snapshot(), f"{what}: the promoted step")
        ws2.rollback(1)
        kept = "kept"
    else:
        assert history == ["earlier"], (what, history)
        kept = "rolled back"
    oracle.assert_same(pre, w.snapshot(), what)
    ws2.rollback(1)
    oracle.assert_same(initial, w.snapshot(), f"{what}: the earlier step no longer rolls back")
    ws2.close()
    return kept


def test_an_operation_writes_its_preimages_and_its_intent_in_one_journal_write():
    """Each operation of the step writes the journal once (the header once at its begin): the
    lines it wrote one by one before come in one write, the same bytes in the same order."""
    trace = _traced()
    writes = [c for c in trace if c == ("store", "write", JOURNAL)]
    assert len(writes) == 1 + 7, trace  # the header, then one per operation (write_file: one record op)
    w, ws, _ = _prepare()
    _step(ws)
    records = ws._log.records_of(ws._log.steps()[-1])
    ops = [r["op"] for r in records]
    assert ops.count("created") == 4 and "renamed" in ops and "exchanged" in ops, ops
    assert len(records) > 8  # more lines than writes: preimages went with their intents


def test_a_crash_at_every_host_call_of_batched_operations_recovers_the_tree_before_the_step():
    total = len(_traced())
    assert total > 60
    outcomes = []
    for k in range(total):
        w, ws, initial = _prepare()
        pre = w.snapshot()
        w.injector = FaultInjector(crash_at=k)
        with pytest.raises(SimulatedCrash):
            _step(ws)
        at_crash = w.snapshot()
        w.crash(ws)
        outcomes.append(_recovered(w, initial, pre, at_crash, f"crash at call {k}"))
    assert set(outcomes) == {"rolled back"}  # the promotion is the step's last host call


def test_a_torn_write_at_every_write_of_batched_operations_recovers_the_tree_before_the_step():
    trace = _traced()
    torn = 0
    for k, call in enumerate(trace):
        if call[1] != "write":
            continue
        w, ws, initial = _prepare()
        pre = w.snapshot()
        w.injector = FaultInjector(torn_at=k, seed=k)
        try:
            _step(ws)
        except SimulatedCrash:
            torn += 1
        else:
            continue  # a one-byte write: not torn
        at_crash = w.snapshot()
        w.crash(ws)
        assert _recovered(w, initial, pre, at_crash, f"torn write at call {k} {call}") == "rolled back"
    assert torn > 8  # every journal write among them, each holding several lines


def test_a_power_loss_at_every_host_call_of_batched_operations_recovers_the_tree_before_the_step():
    total = len(_traced(durable=True))
    outcomes = []
    for k in range(total):
        for writeback in (False, True):
            w, ws, initial = _prepare(durable=True)
            pre = w.snapshot()
            w.injector = FaultInjector(crash_at=k)
            with pytest.raises(SimulatedCrash):
                _step(ws)
            at_crash = w.snapshot()
            if writeback:
                w.work.sync_all()  # the kernel had written the working tree back; the store only what was fsynced
            w.crash(ws, power_loss=True)
            what = f"power loss at call {k}" + (" (tree written back)" if writeback else "")
            outcomes.append(_recovered(w, initial, pre, at_crash, what))
    assert outcomes.count("kept") <= 4 and outcomes.count("rolled back") > 2 * total - 4  # kept: the fsyncs after the promotion


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_store_error_at_every_store_mutation_of_batched_operations_fails_the_operation_and_undoes_exactly(code):
    """A batched write that fails (whole or part-way) fails its operation, which never runs:
    the held preimages go with it, the step goes on, and its undo and the earlier step's are
    exact (``test_crash._store_error_sweep``)."""
    total, failed_ops = _store_error_sweep(code, _step, "batched")
    assert total > 10
    assert failed_ops == total
