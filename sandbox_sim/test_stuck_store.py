"""The undo store never wedges (issue 11, items 2 and 10).

Whatever keeps failing — a working-folder disk that answers EIO, an immutable file, a
journal nobody can parse, an undo store whose disk is full — the store must end up in a
state the next open can finish or *report*:

* opening never fails because recovery cannot finish: the problem is an ``event.warning``
  and the open's recovery report (``kind: "rollback_incomplete"``), history stays readable;
* undo is refused with ``undo.rollback_incomplete`` naming the step and the cause, and
  writes are refused (``EIO``: the tree is between two steps, a new step would be undone
  by the unfinished rollback later);
* discarding always works, and a repaired disk lets the next open finish the rollback;
* a step whose promotion fails (the store's disk filled at that moment) is a warning, not
  an error loop: it stays in the WAL and promotion is retried at the next boundary (a write,
  a step, an undo, close); if the process ends first, the next open rolls it back and says so;
* reading history needs no free space.
"""

from __future__ import annotations

import errno
import threading

import pytest

from sandbox.core.errors import RollbackIncomplete
from sandbox.mounts import Provider
from sandbox.ninep.client import Client
from sandbox_sim import oracle
from sandbox_sim.faults import FaultInjector
from sandbox.ninep.wirefs import WireFS, serve
from sandbox_sim.world import World

pytestmark = pytest.mark.timeout(120)


def _edited(kind: str = "sim", tmp=None):
    """A world with two steps: "seed" and "edit" (which rewrites a, adds d/new, chmods d)."""
    w = World(kind, tmp)
    ws = w.open()
    with ws.step("seed"):
        ws.fs.write_file("a", b"seeded a")
        ws.fs.makedirs("d")
        ws.fs.write_file("d/b", b"seeded b")
    before = w.snapshot()
    with ws.step("edit") as s:
        ws.fs.write_file("a", b"edited a")
        ws.fs.write_file("d/new", b"new")
        ws.fs.chmod("d", 0o700)
    return w, ws, before, s.id


def _eio_writing(path: str):
    """The working folder's disk answers EIO to every write of ``path``, until repaired."""
    return (lambda fs, op, p: fs == "work" and op in ("create", "write", "truncate") and p == path, errno.EIO)


def _warnings(ws) -> list[str]:
    return [e["message"] for e in ws.events if e["type"] == "event.warning"]


# ---------------------------------------------------------------------------- item 2: a rollback that cannot finish


def test_an_undo_that_keeps_failing_is_reported_at_every_open_never_raised():
    w, ws, before, edit_id = _edited()
    w.injector = FaultInjector(error_if=_eio_writing("a"))
    with pytest.raises(OSError) as e:
        ws.rollback(1)
    assert e.value.errno == errno.EIO
    assert w.store.exists("wal/rollback")  # part-way: pending
    ws.close()
    for _ in range(3):  # every open reports the same problem instead of failing
        ws = w.open()
        r = ws.recovery
        assert r["kind"] == "rollback_incomplete" and r["step_id"] == edit_id and r["paths_restored"] == 0
        assert "'a'" in r["message"] and "Input/output error" in r["message"]
        assert any("could not finish" in m for m in _warnings(ws))
        assert [h["command"] for h in ws.history()] == ["seed"]  # readable; the step being undone has left it
        with pytest.raises(RollbackIncomplete) as e:
            ws.rollback(1)
        assert e.value.code == "undo.rollback_incomplete" and e.value.data["step_id"] == edit_id
        assert e.value.data["errno"] == "EIO" and e.value.data["path"] == "a"
        with pytest.raises(OSError) as e:  # no new step on a half-restored tree
            ws.fs.write_file("elsewhere", b"x")
        assert e.value.errno == errno.EIO and "could not finish" in str(e.value)
        assert not w.work.exists("elsewhere")
        ws.close()
    w.injector = FaultInjector()  # the disk is repaired: the next open finishes the undo
    ws = w.open()
    assert ws.recovery["kind"] == "rollback_finished" and ws.recovery["step_id"] == edit_id
    oracle.assert_same(before, w.snapshot())
    assert [h["command"] for h in ws.history()] == ["seed"]
    ws.fs.write_file("elsewhere", b"x")  # and steps work again
    ws.close()


def test_a_failing_pending_rollback_is_also_retried_by_undo_and_finished_once_repaired():
    w, ws, before, edit_id = _edited()
    w.injector = FaultInjector(error_if=_eio_writing("a"))
    with pytest.raises(OSError):
        ws.rollback(1)
    with pytest.raises(RollbackIncomplete):
        ws.rollback(1)
    w.injector = FaultInjector()
    assert ws.finish_pending()["step_id"] == edit_id
    oracle.assert_same(before, w.snapshot())
    ws.rollback(1)  # the seed step now
    assert ws.history() == []


def test_the_stdio_api_answers_undo_failed_with_the_cause():
    from sandbox.api.errors import to_api_error

    w, ws, _before, edit_id = _edited()
    w.injector = FaultInjector(error_if=_eio_writing("a"))
    with pytest.raises(OSError):
        ws.rollback(1)
    with pytest.raises(RollbackIncomplete) as e:
        ws.rollback(1)
    err = to_api_error(e.value).as_dict()
    assert err["code"] == "undo.failed" and "could not finish" in err["message"]
    assert (err["data"]["step_id"], err["data"]["path"], err["data"]["errno"]) == (edit_id, "a", "EIO")


def test_discard_works_on_a_store_whose_rollback_cannot_finish():
    w, ws, _before, _ = _edited()
    w.injector = FaultInjector(error_if=_eio_writing("a"))
    with pytest.raises(OSError):
        ws.rollback(1)
    ws.close()
    ws = w.open()
    assert ws.recovery["kind"] == "rollback_incomplete"
    half = w.snapshot()
    ws.discard()
    assert ws.history() == [] and not w.store.exists("wal/rollback")
    oracle.assert_same(half, w.snapshot(), "discard touches nothing in the working folder")
    w.injector = FaultInjector()
    with ws.step("after discard"):
        ws.fs.write_file("fresh", b"x")
    ws.rollback(1)
    oracle.assert_same(half, w.snapshot())
    ws.close()
    assert w.open().recovery is None


def test_an_unreadable_in_progress_journal_is_reported_and_the_store_stays_usable():
    """A crash left wal/in_progress whose journal is garbage mid-file: every open raised
    CorruptStep. Now: recovery undoes what it can verify (nothing here), says the journal
    was damaged, history stays readable and new steps work — no discard needed."""
    w, ws, _before, _ = _edited()
    ws.close()
    w.store.mkdir("wal/in_progress", 0o700)
    w.store.create("wal/in_progress/journal.jsonl", 0o600)
    w.store.write_all("wal/in_progress/journal.jsonl", 0, b'{"seq": 9, "id": 9}\nnot json at all\n{"op": "created", "path": "x"}\n')
    left = w.snapshot()
    ws = w.open()
    assert ws.recovery["kind"] == "in_progress_rolled_back" and "damaged journal" in ws.recovery["message"]
    oracle.assert_same(left, w.snapshot(), "nothing unverified was undone")
    assert [h["command"] for h in ws.history()] == ["edit", "seed"]
    with ws.step("after"):
        ws.fs.write_file("x", b"x")
    ws.rollback(1)
    oracle.assert_same(left, w.snapshot())
    ws.close()


def test_a_resumed_forced_rollback_is_still_forced(world):
    """The user's --force is part of the pending rollback: an interrupted forced undo that
    is finished by the next open still clears what the user put in its way."""
    ws = world.open()
    with ws.step("seed"):
        ws.fs.makedirs("src")
        ws.fs.write_file("src/f", b"f")
        ws.fs.write_file("z", b"z")
    before = world.snapshot()
    with ws.step("mv src dst; edit z"):
        ws.fs.rename("src", "dst")
        ws.fs.write_file("z", b"zz")
    with world.paused():  # the user puts a directory where src was
        world.work.mkdir("src", 0o755)
        world.work.create("src/users", 0o644)
    # the forced undo dies (EIO) on its first record — the newest: z's rewrite
    world.injector = FaultInjector(error_if=_eio_writing("z"))
    with pytest.raises(OSError):
        ws.rollback(1, force=True)
    ws.close()
    world.injector = FaultInjector()
    ws = world.open()
    assert ws.recovery["kind"] == "rollback_finished"
    oracle.assert_same(before, world.snapshot())  # src is the step's src again, not the user's
    ws.close()


def test_recovery_finishes_through_a_symlink_the_user_put_in_its_way(world):
    """A step died after `mv d/a x`; before the next open the user replaced d/ by a symlink.
    Recovery (always completing, like a forced undo) moves a back into a directory d."""
    ws = world.open()
    with ws.step("seed"):
        ws.fs.makedirs("d")
        ws.fs.write_file("d/a", b"a")
    before = world.snapshot()
    ws.begin_step("mv d/a x")
    ws.fs.rename("d/a", "x")
    world.crash(ws)
    with world.paused():
        world.work.rmdir("d")
        world.work.symlink("nowhere", "d")
    ws = world.open()
    assert ws.recovery["kind"] == "in_progress_rolled_back", ws.recovery
    without_root = lambda snap: {p: v for p, v in snap.items() if p}  # noqa: E731
    oracle.assert_same(without_root(before), without_root(world.snapshot()))
    ws.close()


# ---------------------------------------------------------------------------- item 10: the store's disk is full


def _store_full(fs: str, op: str, path: str) -> bool:
    return fs == "store" and op in ("create", "write", "truncate", "mkdir", "fallocate", "copy_file_range", "symlink")


def test_a_promotion_that_fails_is_a_warning_then_retried_at_the_next_boundary():
    w = World("sim")
    ws = w.open()
    with ws.step("seed"):
        ws.fs.write_file("a", b"a")
    # the disk fills exactly at promotion: the manifest cannot be written
    w.injector = FaultInjector(error_if=(lambda fs, op, p: fs == "store" and "manifest" in p, errno.ENOSPC))
    with pytest.raises(OSError) as e:
        with ws.step("work that must not be lost") as s:
            ws.fs.write_file("b", b"the agent's work")
    assert e.value.errno == errno.ENOSPC
    assert any(f"step {s.id}" in m and "No space left" in m for m in _warnings(ws))
    assert ws.active_step_id is None  # the step has ended; its undo data waits in the WAL
    assert [h["command"] for h in ws.history()] == ["seed"]
    n_warnings = len(_warnings(ws))
    ws.poll()  # time passing retries nothing (no error loop) …
    with pytest.raises(OSError) as e:  # … a write does (and is refused while the disk is full)
        ws.fs.write_file("c", b"c")
    assert e.value.errno == errno.ENOSPC and not w.work.exists("c")
    assert len(_warnings(ws)) == n_warnings  # warned once per step, not once per retry
    w.injector = FaultInjector()  # space freed
    ws.fs.write_file("c", b"c")  # promotes the waiting step first
    ws.close_active()
    assert [h["command"] for h in ws.history()] == ["", "work that must not be lost", "seed"]
    completed = [e["step_id"] for e in ws.events if e["type"] == "event.step_completed"]
    assert s.id in completed
    ws.rollback(2)
    assert not w.work.exists("b") and not w.work.exists("c")
    ws.close()


def test_close_with_a_pending_promotion_warns_and_the_next_open_reports_the_rollback():
    w = World("sim")
    ws = w.open()
    before = w.snapshot()
    w.injector = FaultInjector(error_if=(lambda fs, op, p: fs == "store" and "manifest" in p, errno.ENOSPC))
    with pytest.raises(OSError):
        with ws.step("lost"):
            ws.fs.write_file("b", b"the agent's work")
    ws.close()  # does not raise: the step stays in the WAL, and says so
    assert any("rolled back when the folder is next opened" in m for m in _warnings(ws))
    w.injector = FaultInjector()
    ws = w.open()
    assert ws.recovery["kind"] == "in_progress_rolled_back" and ws.recovery["paths_restored"] >= 1
    assert [e for e in ws.events if e["type"] == "event.recovery"]
    oracle.assert_same(before, w.snapshot())
    ws.close()


def test_history_is_readable_while_the_store_disk_is_full():
    """A crash left a step in the WAL; the store's disk is full, so recovery cannot even
    write its progress count: opening reports it, and history reads."""
    w = World("sim")
    ws = w.open()
    with ws.step("seed"):
        ws.fs.write_file("a", b"a")
    ws.begin_step("interrupted")
    ws.fs.write_file("b", b"b")
    w.crash(ws)  # the process dies mid-step
    w.injector = FaultInjector(error_if=(_store_full, errno.ENOSPC))
    for _ in range(2):
        ws = w.open()
        assert ws.recovery["kind"] == "rollback_incomplete" and "No space left" in ws.recovery["message"]
        assert [h["command"] for h in ws.history()] == ["seed"]
        with pytest.raises(RollbackIncomplete):
            ws.rollback(1)
        ws.close()
    w.injector = FaultInjector()
    ws = w.open()
    assert ws.recovery["kind"] == "in_progress_rolled_back"
    assert not w.work.exists("b") and w.work.exists("a")
    ws.close()


def test_over_9p_a_failed_promotion_leaves_the_server_serving(caplog):
    """The poll loop closes an idle ambient step while the store is full: one warning, no
    traceback every poll, reads still served, writes refused (ENOSPC) until there is room —
    then the waiting step is promoted and the write goes through."""
    w = World("sim")
    warned = threading.Event()
    ws = w.open(on_event=lambda e: warned.set() if e["type"] == "event.warning" else None)
    with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path) as c:
        fs = WireFS(c)
        fs.write_file("a", b"the agent's work")
        w.injector = FaultInjector(error_if=(lambda f, op, p: f == "store" and "manifest" in p, errno.ENOSPC))
        w.now_s += 60  # idle: the server's poll loop closes the ambient step
        assert warned.wait(30), "no warning for the failed promotion"
        assert fs.read_file("a") == b"the agent's work"
        with pytest.raises(OSError) as e:
            fs.write_file("b", b"b")
        assert e.value.errno == errno.ENOSPC
        w.injector = FaultInjector()
        fs.write_file("b", b"b")
    ws.close()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.records
    assert len([e for e in ws.events if e["type"] == "event.warning"]) == 1
    assert {p for h in ws.history() for p in h["paths"]} >= {"a", "b"}
