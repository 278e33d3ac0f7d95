"""Exhaustive fault injection over a fixed workload, as SQLite fails the N-th I/O for every N.

The workload is one step that exercises every primitive (create, O_TRUNC rewrite, an
editor's temp-then-rename, chmod, utime, symlink, xattr, fallocate, copy_file_range, a
directory rename, ``rm -rf``, ``mkdir -p``) on a tree with hard links, whose names it
replaces, writes through and removes (an undo must leave them one inode again). For every k, a crash at host call k must
recover to exactly the tree before the step — or, if the crash came after the step was
promoted, exactly the tree the step left; and the rest of history must still roll back.
"""

from __future__ import annotations

import errno

import pytest

from sandbox.core.errors import SafeguardDenied

from . import oracle
from .client import SimClient
from .faults import FaultInjector, SimulatedCrash
from .world import World

BASE_TREE_MTIME = 1_600_000_000_000_000_000


def seed_fixed(fs) -> None:
    fs.mkdir("d1", 0o755)
    fs.mkdir("d1/e", 0o750)
    fs.mkdir("d2", 0o2775)
    for path, data, mode in (("d1/a", b"alpha" * 50, 0o644), ("d1/e/c", b"", 0o600), ("d2/b", bytes(range(256)) * 40, 0o4755),
                             ("top", b"top file\n", 0o444)):
        fs.create(path, mode)
        if data:
            fs.write_all(path, 0, data)
    fs.symlink("../top", "d2/link")
    fs.link("d2/b", "d1/e/b.hard")  # hard links: one name replaced, then removed; the other survives
    fs.link("top", "d2/top.hard")  # written through one name, the other removed by rm -rf
    fs.link("d1/e/c", "d2/c.hard")  # both names removed, one after a directory rename
    fs.setxattr("d1/a", "user.note", b"keep me")
    fs.setxattr("d2", "user.dir", b"dir attr")
    for p in ("d1/a", "d1/e/c", "d2/b", "top", "d1/e", "d1", "d2", ""):
        fs.utime(p, BASE_TREE_MTIME + len(p))


def workload(ws) -> None:
    fs = ws.fs
    c = SimClient(fs)
    c.echo_to("new.txt", b"fresh")
    c.echo_to("d1/a", b"rewritten")
    c.editor_save("d2/b", b"saved by the editor")
    fs.chmod("d1", 0o700)
    fs.utime("d1/e", 1_500_000_000_000_000_000)
    fs.symlink("../nowhere", "d1/ln")
    fs.setxattr("new.txt", "user.k", b"v")
    fs.removexattr("d1/a", "user.note")
    fs.fallocate("new.txt", 0, 100)
    fs.copy_file_range("top", "d1/a", 0, 2, 5)
    fs.truncate("top", 3)
    fs.rename("d1", "moved")
    c.rm_rf("d2")
    c.mkdir_p("x/y/z")
    fs.rename("moved/e", "x/y/z/e")
    fs.unlink("x/y/z/e/c")


def _world(kind: str, tmp_path) -> World:
    w = World(kind, str(tmp_path) if kind == "real" else None)
    with w.paused():
        seed_fixed(w.work)
    return w


def _prepare(kind, tmp_path):
    """A world with one finished step in history (so recovery must not disturb it)."""
    w = _world(kind, tmp_path)
    initial = w.snapshot()
    ws = w.open()
    with ws.step("earlier"):
        ws.fs.write_file("earlier.txt", b"from an earlier step")
        ws.fs.chmod("top", 0o640)
    return w, ws, initial


def _count_calls(kind, tmp_path, action) -> int:
    w, ws, _ = _prepare(kind, tmp_path / "count" if kind == "real" else None)
    w.injector = FaultInjector()
    action(ws)
    return w.injector.calls


def _ks(total: int, kind: str) -> list[int]:
    return list(range(total)) if kind == "sim" else list(range(0, total, 11))


def _step(ws):
    with ws.step("workload"):
        workload(ws)


@pytest.mark.parametrize("kind", ["sim", "real"])
def test_crash_at_every_host_call_of_a_step(kind, tmp_path):
    total = _count_calls(kind, tmp_path, _step)
    assert total > 100  # the workload really exercises the store and the tree
    outcomes = {"rolled back": 0, "kept": 0}
    for k in _ks(total, kind):
        w, ws, initial = _prepare(kind, tmp_path / str(k))
        pre = w.snapshot()
        w.injector = FaultInjector(crash_at=k)
        with pytest.raises(SimulatedCrash):
            _step(ws)
        at_crash = w.snapshot()
        w.crash(ws)
        ws2 = w.open()
        ids = [h["command"] for h in ws2.history()]
        if ids[0] == "workload":
            outcomes["kept"] += 1
            oracle.assert_same(at_crash, w.snapshot(), f"crash at call {k} after promotion")
            ws2.rollback(1)
        else:
            outcomes["rolled back"] += 1
            assert ws2.recovery is not None or at_crash == pre, f"crash at call {k}: changed tree but no recovery"
            oracle.assert_same(pre, w.snapshot(), f"crash at call {k} inside the step")
        ws2.rollback(1)
        oracle.assert_same(initial, w.snapshot(), f"crash at call {k}: earlier step no longer rolls back")
        ws2.close()
    # promotion (one rename) is the step's last host call, so every crash lands before it
    assert outcomes == {"rolled back": len(_ks(total, kind)), "kept": 0}, outcomes


def test_torn_write_at_every_write_of_a_step(tmp_path):
    total = _count_calls("sim", tmp_path, _step)
    torn = 0
    for k in range(total):
        w, ws, initial = _prepare("sim", None)
        pre = w.snapshot()
        w.injector = FaultInjector(torn_at=k, seed=k)
        try:
            _step(ws)
        except SimulatedCrash:
            torn += 1
            w.crash(ws)
            ws = w.open()
            if ws.history()[0]["command"] != "workload":
                oracle.assert_same(pre, w.snapshot(), f"torn write at call {k}")
                ws.rollback(1)
                oracle.assert_same(initial, w.snapshot(), f"torn write at call {k}: earlier step")
            continue
    assert torn > 20


def _store_error_sweep(code: int, run_step, command: str) -> tuple[int, int]:
    """For every store mutation j of ``run_step(ws)`` (a step named ``command``, after one
    earlier step): fail mutation j with ``code``; an error reaching the caller carries that
    code, closing the step is retried once the disk recovers, and undo gives back the tree
    before the step (if it opened) and then the one before the earlier step. Returns
    ``(store mutations, errors that reached the caller)``."""
    w, ws, _ = _prepare("sim", None)
    w.injector = FaultInjector()
    run_step(ws)
    total = w.injector.store_mutations
    failed_ops = 0
    for j in range(total):
        w, ws, initial = _prepare("sim", None)
        pre = w.snapshot()
        w.injector = FaultInjector(error_at=(j, code))
        try:
            run_step(ws)
        except OSError as e:
            assert e.errno == code, f"store error {j}: unexpected {e!r}"
            failed_ops += 1
        w.injector = FaultInjector()
        ws.close_active()  # the disk recovered: closing is retried
        if ws.history()[0]["command"] != command:
            # the error hit opening the step: it never started, and nothing was touched
            oracle.assert_same(pre, w.snapshot(), f"{errno.errorcode[code]} at store mutation {j} (step never opened)")
        else:
            ws.rollback(1)
            oracle.assert_same(pre, w.snapshot(), f"{errno.errorcode[code]} at store mutation {j}")
        ws.rollback(1)
        oracle.assert_same(initial, w.snapshot(), f"{errno.errorcode[code]} at store mutation {j}: earlier step")
    return total, failed_ops


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_store_error_at_every_store_mutation_of_a_step(code):
    total, failed_ops = _store_error_sweep(code, _step, "workload")
    assert total > 20
    assert failed_ops == total  # every injected error surfaced to the caller, none was swallowed


@pytest.mark.parametrize("kind", ["sim", "real"])
def test_crash_at_every_host_call_of_a_rollback(kind, tmp_path):
    def setup(w, ws):
        _step(ws)

    def action(ws):
        ws.rollback(2)

    w, ws, _ = _prepare(kind, tmp_path / "count" if kind == "real" else None)
    setup(w, ws)
    w.injector = FaultInjector()
    action(ws)
    total = w.injector.calls
    for k in _ks(total, kind):
        w, ws, initial = _prepare(kind, tmp_path / str(k))
        after_earlier = w.snapshot()
        setup(w, ws)
        w.injector = FaultInjector(crash_at=k)
        with pytest.raises(SimulatedCrash):
            action(ws)
        w.crash(ws)
        ws2 = w.open()
        left = [h["command"] for h in ws2.history()]
        expected = {("workload", "earlier"): None, ("earlier",): after_earlier, (): initial}[tuple(left)]
        if expected is not None:
            oracle.assert_same(expected, w.snapshot(), f"crash at rollback call {k} (history {left})")
        ws2.rollback(len(left)) if left else None
        oracle.assert_same(initial, w.snapshot(), f"crash at rollback call {k}: full rollback after recovery")
        ws2.close()


def _crashed_mid_step(at: int = 100):
    """A world whose process died at host call ``at`` of the workload step."""
    w, ws, _ = _prepare("sim", None)
    pre = w.snapshot()
    w.injector = FaultInjector(crash_at=at)
    with pytest.raises(SimulatedCrash):
        _step(ws)
    w.crash(ws)
    assert w.snapshot() != pre
    return w, pre


@pytest.mark.parametrize("first", [45, 75, 100, 120])
def test_crash_at_every_host_call_of_recovery_itself(first):
    """A second crash while recovering from the first (and a third) still ends at the pre-step tree."""
    w, _ = _crashed_mid_step(first)
    w.injector = FaultInjector()
    w.open().close()
    total = w.injector.calls
    assert total > 10
    for k in range(total):
        for second in (None, k // 2):
            w, pre = _crashed_mid_step(first)
            w.injector = FaultInjector(crash_at=k)
            with pytest.raises(SimulatedCrash):
                w.open()
            w.crash(None)
            if second is not None:  # and crash the second recovery too
                w.injector = FaultInjector(crash_at=second)
                try:
                    w.open().close()
                except SimulatedCrash:
                    w.crash(None)
            w.injector = FaultInjector()
            ws2 = w.open()
            oracle.assert_same(pre, w.snapshot(), f"crash at recovery call {k} (then {second}) after step crash at {first}")
            ws2.close()


def test_rename_then_crash_in_recovery_does_not_move_contents():
    """The SIGKILL suite's minimal case: rename a over b, die, die again mid-recovery."""
    for k in range(40):
        w = World("sim")
        with w.paused():
            for name, mode in (("a", 0o644), ("b", 0o600)):
                w.work.create(name, mode)
                w.work.write_all(name, 0, f"content of {name}".encode())
        pre = w.snapshot()
        ws = w.open()
        ws.begin_step("mv a b")
        ws.fs.rename("a", "b")
        w.crash(ws)
        w.injector = FaultInjector(crash_at=k)
        try:
            w.open().close()
        except SimulatedCrash:
            w.crash(None)
        w.injector = FaultInjector()
        w.open().close()
        oracle.assert_same(pre, w.snapshot(), f"recovery crashed at call {k}")


def test_crash_during_eviction_keeps_history_consistent():
    for k in range(0, 120):
        w = _world("sim", None)
        ws = w.open()
        posts = []
        for i in range(3):
            with ws.step(f"s{i}"):
                ws.fs.write_file(f"f{i}", b"x" * (i + 1) * 100)
                ws.fs.remove_tree("d2") if i == 1 else None
            posts.append(w.snapshot())
        ws.configure_limits(max_step_count=3)
        w.injector = FaultInjector(crash_at=k)
        try:
            ws.configure_limits(max_step_count=1)  # evicts two steps
        except SimulatedCrash:
            w.crash(ws)
            ws = w.open()
        w.injector = FaultInjector()
        oracle.assert_same(posts[-1], w.snapshot(), f"crash at eviction call {k}")
        left = [h["command"] for h in ws.history()]
        assert left[0] == "s2" and left == ["s2", "s1", "s0"][: len(left)]
        ws.rollback(1)
        oracle.assert_same(posts[-2], w.snapshot(), f"crash at eviction call {k}: rollback after")


def test_deny_then_crash_is_consistent():
    w, ws, _ = _prepare("sim", None)
    pre = w.snapshot()
    ws.configure_safeguard(delete_threshold=3)
    ws.fs.decide = lambda hold: "deny"
    with pytest.raises(SafeguardDenied):
        _step(ws)
    oracle.assert_same(pre, w.snapshot(), "denied step")
    w.crash(ws)
    w.open()
    oracle.assert_same(pre, w.snapshot(), "reopened after deny")


@pytest.mark.parametrize("kind", ["sim", "real"])
def test_crash_at_every_call_of_a_rename_over_an_existing_file(kind, tmp_path):
    """Campaign seed 30: a crash between a rename's intent and the rename itself, where the
    source was never captured (untouched) and the destination exists: recovery must see the
    rename never ran — not move the destination over the user's source file."""
    def make(k_dir):
        w = World(kind, str(k_dir) if kind == "real" else None)
        with w.paused():
            for name, data, mode in (("src", b"the user's source", 0o640), ("dst", b"destination", 0o644)):
                w.work.create(name, mode)
                w.work.write_all(name, 0, data)
        return w

    w = make(tmp_path / "count")
    ws = w.open()
    w.injector = FaultInjector()
    with ws.step("mv src dst"):
        ws.fs.rename("src", "dst")
    total = w.injector.calls
    for k in range(total):
        w = make(tmp_path / str(k))
        pre = w.snapshot()
        ws = w.open()
        w.injector = FaultInjector(crash_at=k)
        with pytest.raises(SimulatedCrash):
            with ws.step("mv src dst"):
                ws.fs.rename("src", "dst")
        w.crash(ws)
        w.open().close()
        oracle.assert_same(pre, w.snapshot(), f"crash at call {k} of `mv src dst`")



def _linked_world() -> tuple[World, object, dict]:
    """``a``, ``d/b``, ``d/e/c`` one inode; one step writes through ``a`` and removes the
    other names. With the link index empty (as past ``LINK_INDEX_ENTRIES_MAX``) the records
    name no survivors: the undo remakes ``d/e/c`` and ``d/b`` as one new inode, then finds
    ``a`` in place and relinks them to it (a temporary name, then a rename over)."""
    w = World("sim")
    with w.paused():
        w.work.mkdir("d", 0o755)
        w.work.mkdir("d/e", 0o755)
        w.work.create("a", 0o640)
        w.work.write_all("a", 0, b"one inode, three names")
        w.work.link("a", "d/b")
        w.work.link("a", "d/e/c")
    initial = w.snapshot()
    ws = w.open()
    with ws.step("write a, rm the others"):
        ws.fs.write("a", 0, b"ONE")
        ws.fs.unlink("d/b")
        ws.fs.unlink("d/e/c")
    return w, ws, initial


@pytest.mark.interpreted_only
def test_crash_at_every_host_call_of_a_rollback_that_relinks(monkeypatch):
    from sandbox.core import preimage

    monkeypatch.setattr(preimage, "LINK_INDEX_ENTRIES_MAX", 0)
    relinked = []
    real_relink = preimage._relink
    monkeypatch.setattr(preimage, "_relink", lambda fs, existing, name: (relinked.append(name), real_relink(fs, existing, name)))
    w, ws, initial = _linked_world()
    w.injector = FaultInjector()
    ws.rollback(1)
    total = w.injector.calls
    assert sorted(relinked) == ["d/b", "d/e/c"], relinked  # remade as one inode, then both relinked to a
    oracle.assert_same(initial, w.snapshot())
    for k in range(total):
        w, ws, initial = _linked_world()
        w.injector = FaultInjector(crash_at=k)
        with pytest.raises(SimulatedCrash):
            ws.rollback(1)
        w.crash(ws)
        ws2 = w.open()  # finishes an interrupted rollback from its progress count
        if ws2.history():  # the crash came before the rollback began
            ws2.rollback(1)
        oracle.assert_same(initial, w.snapshot(), f"crash at rollback call {k}")
        ws2.close()


def _failing_moves(ws):
    """A step whose renames reach the host and fail there (ENOENT: no such parent) after
    their intents are journalled, with ordinary changes around them; every error is caught,
    as a program would."""
    with ws.step("failing moves"):
        for op in (lambda: ws.fs.rename("d2", "nowhere/moved"), lambda: ws.fs.chmod("d2/b", 0o600),
                   lambda: ws.fs.write_file("d2/new", b"x"), lambda: ws.fs.rename("top", "gone/top"),
                   lambda: ws.fs.write_file("top", b"rewritten")):
            try:
                op()
            except OSError:
                pass


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_store_error_at_every_store_mutation_of_a_step_whose_moves_fail(code):
    """The store may fail just as a host call fails — also on the very line that voids the
    failed call's intent. The void is then owed and written before anything else, so the
    finished step never holds an intent that did not run: its rollback restores the tree and
    is never refused as if something outside had moved things (found by the issue-19
    fan-out: an ExternalChange refusal after a store error)."""
    total, _ = _store_error_sweep(code, _failing_moves, "failing moves")
    assert total > 10


def _failing_creates_in_a_row(ws):
    """Files created in folders that do not exist, one after the other: each create's
    intent (``created``, the first line it journals) is voided when the host refuses it, so
    the intent written right after an owed void is itself voided next."""
    with ws.step("failing creates in a row"):
        for op in (lambda: ws.fs.write_file("nowhere/a", b"a"), lambda: ws.fs.write_file("gone/b", b"b"),
                   lambda: ws.fs.write_file("none/c", b"c"), lambda: ws.fs.write_file("top", b"rewritten")):
            try:
                op()
            except OSError:
                pass


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_store_error_at_every_store_mutation_of_a_step_whose_creates_fail_in_a_row(code):
    """An intent journalled just after an owed void is recorded at its own journal line
    (not the void's): when its host call fails too, its void names the intent's line, and
    the finished step is not corrupt ("voided but holds no intent", found by
    bench/campaign_speed.py, seed 3 with ENOSPC)."""
    total, _ = _store_error_sweep(code, _failing_creates_in_a_row, "failing creates in a row")
    assert total > 10


def test_an_injector_with_nothing_planned_counts_calls_as_an_armed_one_does():
    """Fault positions are counts of host calls: an injector with nothing planned (which
    only counts) must count exactly as one with faults planned, or a seed's ``k`` would
    name another call. Compared on the fixed workload: nothing planned; a crash and a
    store error planned past the end; a trace of every call; and a crash at the last call
    of the quiet count, which must be the traced call."""
    counts = []
    traced = None
    for injector in (FaultInjector(), FaultInjector(crash_at=10**9), FaultInjector(error_at=(10**9, errno.EIO)), FaultInjector()):
        w, ws, _ = _prepare("sim", None)
        if traced is None and len(counts) == 3:
            injector.trace = traced = []
        w.injector = injector
        _step(ws)
        counts.append((injector.calls, injector.store_mutations))
    assert len(set(counts)) == 1 and counts[0][0] > 100 and counts[0][1] > 10, counts
    assert len(traced) == counts[0][0]
    last = counts[0][0] - 1
    w, ws, _ = _prepare("sim", None)
    w.injector = FaultInjector(crash_at=last)
    with pytest.raises(SimulatedCrash, match=rf"crash at call {last}: {traced[-1][0]}\.{traced[-1][1]} "):
        _step(ws)


def test_an_attached_quiet_injector_counts_as_the_same_injector_called_as_a_hook():
    """A world's simulated disks are attached to its injector: while it is quiet they call
    no hook and count into it themselves (``MemoryHostFS.tally``). Those counts must be the
    ones the injector makes when every disk calls it as its fault hook, or a planned
    position would name another call; a swapped-out injector and a paused one count
    nothing; planning a fault makes the disks call the injector again."""
    counts = []
    for attached in (True, False):
        w, ws, _ = _prepare("sim", None)
        injector = FaultInjector()
        w.injector = injector
        if attached:
            assert (w.work.fault_hook, w.work.tally, w.store.tally) == (None, injector, injector)
        else:  # the disks call the injector itself on every host call
            w.injector_paused = True
            w.work.fault_hook = w.store.fault_hook = injector
        _step(ws)
        counts.append((injector.calls, injector.store_mutations))
    assert counts[0] == counts[1] and counts[0][0] > 100 and counts[0][1] > 10, counts

    w, ws, _ = _prepare("sim", None)
    old, new = w.injector, FaultInjector()
    before = old.calls
    w.injector = new
    with ws.step("after the swap"):
        ws.fs.write_file("swapped", b"x")
    assert old.calls == before and new.calls > 0
    with w.paused():
        n = new.calls
        ws.fs.lstat("swapped")
        assert new.calls == n
    new.crash_at = new.calls + 1  # the second call from here dies
    assert w.work.fault_hook is new and w.store.fault_hook is new
    ws.fs.lstat("swapped")
    with pytest.raises(SimulatedCrash, match=rf"crash at call {new.calls}:"):
        ws.fs.lstat("swapped")


def test_a_crash_planned_at_a_named_call_hits_the_first_call_it_names():
    """``crash_if``: the position is a call's name, not its count — the first traced call
    the predicate holds for is the one that dies, and no call before it."""
    w, ws, _ = _prepare("sim", None)
    w.injector = FaultInjector()
    w.injector.trace = traced = []
    _step(ws)
    first = next(i for i, (fs, op, path) in enumerate(traced) if fs == "store" and op == "rename")
    w, ws, _ = _prepare("sim", None)
    w.injector = FaultInjector(crash_if=lambda fs, op, path: fs == "store" and op == "rename")
    with pytest.raises(SimulatedCrash, match=rf"crash at call {first}: store\.rename {traced[first][2]!r}"):
        _step(ws)
    assert w.injector.calls == first + 1


def test_planning_a_fault_on_a_live_injector_takes_effect_at_once():
    w, ws, _ = _prepare("sim", None)
    w.injector = FaultInjector()
    seen = []
    with pytest.raises(SimulatedCrash):  # closing the step dies too: the process is dead
        with ws.step("s"):
            ws.fs.write_file("a", b"1")
            w.injector.crash_at = w.injector.calls  # the very next host call dies
            for call in (lambda: ws.fs.write_file("b", b"2"), lambda: ws.fs.lstat("a")):
                try:
                    call()
                except SimulatedCrash as e:
                    seen.append(str(e))
    assert seen[0].startswith("crash at call") and "already dead" in seen[1], seen
    w.injector.disarm()
    w.injector.calls, n = 0, w.injector.calls
    w.store.lstat("")  # disarmed: counted again, nothing raised
    assert w.injector.calls == 1 and n > 0
