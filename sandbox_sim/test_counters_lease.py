"""``counters.json`` holds bounds (``store.COUNTERS_LEASE_STEPS`` ahead), not exact counters.

A step begins without rewriting it while its seq and id lie below the bounds written last; a
clean close writes the exact counters. The never-reuse guarantee (docs/undo-store.md): no seq
or id a step ever had in the store — finished, rolled back, evicted, or in a WAL that a crash
left — is handed out again, whatever call a crash or a power loss falls on. Tried here at every
host call of steps that cross lease bounds, with rollbacks, ambient steps and evictions.
"""

from __future__ import annotations

import errno

import pytest

from sandbox.core import store as store_mod
from sandbox.core.store import unseal

from .faults import FaultInjector, SimulatedCrash
from .test_crash import seed_fixed
from .world import World


def _world(durable: bool = False):
    w = World("sim")
    with w.paused():
        seed_fixed(w.work)
        w.work.sync_all()
    return w, w.open(durable=durable)


def _steps(ws) -> None:
    """Command steps crossing lease bounds, rollbacks (the newest seq and id leave history),
    ambient steps (negative ids) and evictions (the oldest leave history)."""
    ws.configure_limits(max_step_count=3)
    for n in range(5):
        with ws.step(f"s{n}"):
            ws.fs.write_file(f"f{n}", b"x" * n)
        if n % 2:
            ws.rollback(1)
        ws.fs.write_file(f"ambient{n}", b"a")  # opens an ambient step
        ws.close_active()


class _Seen:
    """Every (seq, id) the store held: a finished step's, and the WAL's a crash left."""

    def __init__(self, monkeypatch):
        self.pairs: set[tuple[int, int]] = set()
        self.noting = True  # until the crash: the process after it is the one checked
        finish = store_mod.UndoLog.finish

        def noting(log, *args, **kwargs):
            info = finish(log, *args, **kwargs)
            if self.noting:
                self.pairs.add((info.seq, info.id))
            return info

        monkeypatch.setattr(store_mod.UndoLog, "finish", noting)

    def wal_left(self, w) -> None:
        self.noting = False
        with w.paused():
            try:
                head = w.store.read("wal/in_progress/journal.jsonl", 0, 1 << 16)
            except OSError:
                return
        line, nl, _ = head.partition(b"\n")
        if nl:
            h = unseal(line)
            self.pairs.add((h["seq"], h["id"]))


def _assert_fresh(ws, seen: _Seen, what: str) -> None:
    """The next steps' seqs and ids (a command and an ambient one) are new."""
    with ws.step("after") as s:
        ws.fs.write_file("after", b"z")
    ws.fs.write_file("after-ambient", b"z")
    ws.close_active()
    new = [(h["seq"], h["id"]) for h in ws.history()[:2]]
    assert s.id in {i for _, i in new}, (what, new)
    for seq, sid in new:
        assert seq not in {q for q, _ in seen.pairs}, (what, seq, sorted(seen.pairs))
        assert sid not in {i for _, i in seen.pairs}, (what, sid, sorted(seen.pairs))


def _count(durable: bool) -> int:
    w, ws = _world(durable)
    w.injector = FaultInjector()
    _steps(ws)
    return w.injector.calls


@pytest.mark.parametrize("power_loss", [False, True], ids=["crash", "power-loss"])
def test_no_seq_or_id_is_handed_out_twice_whatever_call_a_crash_falls_on(monkeypatch, power_loss):
    monkeypatch.setattr(store_mod, "COUNTERS_LEASE_STEPS", 2)  # bounds crossed every other step
    total = _count(power_loss)
    assert total > 200
    for k in range(total):
        seen = _Seen(monkeypatch)
        w, ws = _world(power_loss)
        w.injector = FaultInjector(crash_at=k)
        with pytest.raises(SimulatedCrash):
            _steps(ws)
        seen.wal_left(w)
        w.crash(ws, power_loss=power_loss)
        ws2 = w.open(durable=power_loss)
        _assert_fresh(ws2, seen, f"{'power loss' if power_loss else 'crash'} at call {k}")
        ws2.close()


def test_a_step_within_the_bounds_begins_without_writing_the_counters():
    w, ws = _world()
    w.injector = FaultInjector()
    w.injector.trace = trace = []
    for n in range(3):
        with ws.step(f"s{n}"):
            ws.fs.write_file(f"f{n}", b"x")
    writes = [c for c in trace if c[0] == "store" and c[2].startswith("counters.json")]
    assert writes == [("store", "create", "counters.json.tmp"), ("store", "write", "counters.json.tmp"),
                      ("store", "rename", "counters.json.tmp")], writes  # the first step's bounds only


def test_a_clean_close_writes_the_exact_counters_and_a_reopen_continues_without_a_gap():
    w, ws = _world()
    ids = []
    for n in range(3):
        with ws.step(f"s{n}") as s:
            ws.fs.write_file(f"f{n}", b"x")
        ids.append(s.id)
    seqs = [h["seq"] for h in reversed(ws.history())]
    ws.close()
    ws = w.open()
    with ws.step("next") as s:
        ws.fs.write_file("g", b"y")
    assert s.id == ids[-1] + 1 and ws.history()[0]["seq"] == seqs[-1] + 1


def test_after_a_crash_ids_continue_from_the_bounds():
    w, ws = _world()
    with ws.step("s") as s:
        ws.fs.write_file("f", b"x")
    w.crash(ws)
    ws = w.open()
    with ws.step("next") as t:
        ws.fs.write_file("g", b"y")
    assert t.id == s.id + 1 + store_mod.COUNTERS_LEASE_STEPS  # bounds written at s: a gap, never a reuse


def test_a_store_whose_counters_json_holds_exact_counters_continues_after_them():
    """The previous format's ``counters.json`` (exact counters, rewritten at every step's
    begin) is read as bounds: the same file, the same next ids."""
    w, ws = _world()
    with ws.step("s") as s:
        ws.fs.write_file("f", b"x")
    ws.close()
    with w.paused():
        exact = unseal(w.store.read_all("counters.json"))
    assert exact["next_id"] == s.id + 1  # what the previous format wrote at the step's begin
    ws = w.open()
    with ws.step("next") as t:
        ws.fs.write_file("g", b"y")
    assert t.id == exact["next_id"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_close_whose_counters_write_fails_releases_the_store_and_the_bounds_stand(code):
    w, ws = _world()
    with ws.step("s") as s:
        ws.fs.write_file("f", b"x")
    w.injector = FaultInjector(error_if=(lambda disk, op, path: disk == "store" and path.startswith("counters.json"), code))
    ws.close()  # no error: the exact counters are a nicety
    w.injector = FaultInjector()
    ws = w.open()  # the lock was released
    with ws.step("next") as t:
        ws.fs.write_file("g", b"y")
    assert t.id == s.id + 1 + store_mod.COUNTERS_LEASE_STEPS
