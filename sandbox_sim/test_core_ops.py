"""The undo core's fallocate, copy_file_range (through open handles) and exchange
(``RENAME_EXCHANGE``): each undone exactly, on the simulated disk and a real directory.

An exchange is journalled as one ``exchanged`` intent (with the parents' preimages): its
undo exchanges the two names back, so a file swapped with a directory, hard links and the
files' inodes all come back as they were. The intent carries both inode numbers, so a
rollback that finds them already in place (the exchange never ran: a crash between the
intent and the host call; or an interrupted rollback resumed) leaves them.
"""

from __future__ import annotations

import errno
import os

import pytest

from sandbox.hostfs import DIR, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE
from sandbox.mounts import Provider
from sandbox.mounts.identity import Cred
from sandbox.mounts.provider import COPY_FILE_RANGE_BYTES_MAX

from . import oracle
from .faults import FaultInjector, SimulatedCrash
from .world import FaultyHandle, World

DATA = bytes(range(1, 256)) * 64  # 16320 bytes, no zeros


def _seed(world):
    with world.paused():
        w = world.work
        w.mkdir("d", 0o750)
        w.mkdir("d/sub", 0o700)
        for path, data, mode in (("a", b"alpha", 0o644), ("d/b", b"bravo" * 10, 0o600), ("d/sub/c", b"charlie", 0o640),
                                 ("big", DATA, 0o644)):
            w.create(path, mode)
            w.write_all(path, 0, data)
        w.link("a", "a2")
        w.symlink("../a", "d/ln")
        w.setxattr("d", "user.tag", b"dir")
        for p in ("a", "d/b", "d/sub/c", "big", "d/sub", "d", ""):
            w.utime(p, 1_600_000_000_000_000_000 + len(p))


@pytest.mark.parametrize("mode", [0, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                  FALLOC_FL_ZERO_RANGE, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE])
def test_fallocate_through_a_handle_is_undone_exactly(world, mode):
    _seed(world)
    before = world.snapshot()
    ws = world.open()
    with ws.step("fallocate"):
        with ws.fs.open("big", os.O_RDWR) as h:
            ws.fs.ffallocate(h, "big", 100, 20_000, mode)
            ws.fs.ffallocate(h, "big", 8, 4, mode)
    after = world.snapshot()
    assert after != before or mode == FALLOC_FL_KEEP_SIZE
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


def test_fallocate_of_a_renamed_handle_captures_the_inode_not_the_new_name(world):
    _seed(world)
    before = world.snapshot()
    ws = world.open()
    with ws.step("open, move away, new file at the name, punch through the handle"):
        h = ws.fs.open("big", os.O_RDWR)
        ws.fs.rename("big", "moved")
        ws.fs.write_file("big", b"new file at the old name")
        ws.fs.ffallocate(h, "moved", 0, 4096, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)
        h.close()
    assert world.work.read_all("big") == b"new file at the old name"
    assert world.work.read_all("moved")[:4096] == b"\0" * 4096
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


def test_an_unlink_reads_its_preimage_through_a_descriptor_only_when_it_is_that_file(world):
    """``unlink(path, reader)``: a descriptor the caller holds (a FUSE node's) is used to read
    the preimage (xattrs, bytes) only when it is the inode at ``path``; a write-only one is
    read too; one on another file is ignored — the preimage is always of what is removed."""
    _seed(world)
    before = world.snapshot()
    ws = world.open()
    with ws.step("unlink through descriptors"):
        with ws.fs.open("d/b", os.O_WRONLY) as wo, ws.fs.open("big", os.O_RDONLY) as other, \
                ws.fs.open("a", os.O_RDONLY) as linked:
            ws.fs.unlink("d/b", wo)  # write-only, that file
            ws.fs.unlink("d/sub/c", other)  # another file's descriptor: read by path
            ws.fs.unlink("a", linked)  # one of two hard links
        closed = ws.fs.open("big", os.O_RDONLY)
        closed.close()
        ws.fs.unlink("big", closed)  # closed meanwhile: read by path, the unlink still happens
    assert not any(world.work.exists(p) for p in ("d/b", "d/sub/c", "a", "big"))
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


def test_copy_file_range_between_handles_is_undone_exactly(world):
    _seed(world)
    before = world.snapshot()
    ws = world.open()
    with ws.step("copy"):
        with ws.fs.open("big", os.O_RDONLY) as s, ws.fs.open("d/b", os.O_RDWR) as d:
            assert ws.fs.fcopy_file_range(s, d, "d/b", 10, 3, 1000) == 1000
            assert ws.fs.fcopy_file_range(s, d, "d/b", 16_000, 5_000, 1000) == 320  # clamped; a gap of zeros
        with ws.fs.open("a2", os.O_RDWR) as d, ws.fs.open("big", os.O_RDONLY) as s:
            ws.fs.fcopy_file_range(s, d, "a2", 0, 0, 3)  # through the other hard link
    assert world.work.read_all("a") == DATA[:3] + b"ha"
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


@pytest.mark.parametrize("a, b", [("a", "d/b"), ("d", "big"), ("d/sub", "a"), ("d/ln", "d/sub/c"), ("d/sub", "big")],
                         ids=["file-file", "dir-file", "dir-hardlinked-file", "symlink-file", "dir-file-other-parent"])
def test_exchange_is_undone_exactly(world, a, b):
    _seed(world)
    before = world.snapshot()
    inos = {p: world.work.lstat(p).ino for p in ("a", "a2", "d", "d/sub", "big")}
    ws = world.open()
    with ws.step(f"mv --exchange {a} {b}"):
        ws.fs.exchange(a, b)
    assert world.snapshot() != before
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())
    assert {p: world.work.lstat(p).ino for p in inos} == inos  # the same objects, hard links intact


def test_changes_after_an_exchange_in_the_same_step_are_undone(world):
    """Marks follow the exchange: what was captured at one name is not taken for the other."""
    _seed(world)
    with world.paused():  # a hard-linked file moved and then unlinked in one step is not restored
        world.work.unlink("a2")  # as the same inode (as with rename: the core's known limit), so none here
    before = world.snapshot()
    ws = world.open()
    with ws.step("edit, exchange, edit both again, remove"):
        ws.fs.write("a", 0, b"A1")  # a captured (its marks)
        ws.fs.write("big", 0, b"B1")
        ws.fs.exchange("a", "d")  # a: the directory now; d: the file
        ws.fs.write("d", 0, b"A2")  # the same file as before: already captured
        ws.fs.write_file("a/sub/c", b"rewritten inside the moved directory")
        ws.fs.mkdir("a/new")
        ws.fs.exchange("big", "d")
        ws.fs.write("d", 0, b"the former big, at d")  # never captured at this name
        ws.fs.remove_tree("big")
        ws.fs.exchange("a/sub", "d")
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


def test_exchange_over_several_steps_undoes_one_at_a_time(world):
    _seed(world)
    s0 = world.snapshot()
    ws = world.open()
    with ws.step("first"):
        ws.fs.exchange("d", "a")
    s1 = world.snapshot()
    with ws.step("second"):
        ws.fs.write("d", 5, b"+more")
        ws.fs.exchange("d", "a/sub/c")
    ws.rollback(1)
    oracle.assert_same(s1, world.snapshot())
    ws.rollback(1)
    oracle.assert_same(s0, world.snapshot())


def test_exchange_that_must_fail_records_nothing(world):
    _seed(world)
    before = world.snapshot()
    ws = world.open()
    with ws.step("bad exchanges"):
        for a, b, code in (("a", "missing", errno.ENOENT), ("d", "d/sub", errno.EINVAL)):
            with pytest.raises(OSError) as e:
                ws.fs.exchange(a, b)
            assert e.value.errno == code
        ws.fs.exchange("a", "a2")  # one inode: nothing happens
    assert world.snapshot() == before
    assert not [r for r in ws.records() if r.get("op") == "exchanged"]
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


def test_step_diff_of_an_exchange(world):
    _seed(world)
    ws = world.open()
    with ws.step("swap"):
        ws.fs.exchange("a", "d/b")
    d = ws.step_diff()
    changed = {p["path"]: p["change"] for p in d["paths"]}
    assert changed.get("a") == "modified" and changed.get("d/b") == "modified", d
    assert not d["approximate"]


def _crash_at_every_call(kind, tmp_path, act, what: str) -> list:
    """Run ``act(ws)`` on a seeded world of ``kind`` once to count its host calls (returns the
    trace), then once per call with a crash planned there: recovery must leave the tree as it
    was before ``act``."""
    def make(where):
        w = World(kind, str(where) if kind == "real" else None)
        _seed(w)
        return w

    w = make(tmp_path / "count")
    ws = w.open()
    w.injector = FaultInjector()
    w.injector.trace = traced = []
    act(ws)
    total = w.injector.calls
    assert total > 3
    for k in range(total):
        w = make(tmp_path / str(k))
        pre = w.snapshot()
        ws = w.open()
        w.injector = FaultInjector(crash_at=k)
        try:
            act(ws)
        except SimulatedCrash:
            pass
        else:
            continue  # the crash point was past the step
        w.crash(ws)
        w.open().close()
        oracle.assert_same(pre, w.snapshot(), f"crash at call {k} of {what}")
    return traced


@pytest.mark.parametrize("kind", ["sim", "real"])
def test_crash_at_every_call_of_an_exchange(kind, tmp_path):
    """Recovery after a crash anywhere in an exchange (before or after the host call, or in
    the undo itself) leaves the tree as before the step."""
    def swap(ws):
        with ws.step("swap"):
            ws.fs.exchange("d", "a")

    _crash_at_every_call(kind, tmp_path, swap, "an exchange")


@pytest.mark.parametrize("kind", ["sim", "real"])
def test_crash_at_every_call_of_a_removal(kind, tmp_path):
    """Removals pass every host call through the fault injector on both disks — the unlink
    and rmdir through the entry the preimage looked at (``HostFS.entry``), and the
    preimage's reads through the entry's reader — so a crash can fall between the preimage
    line and the removal; recovery after a crash at any call leaves the tree as before."""
    def remove(ws):
        with ws.step("rm"):
            ws.fs.unlink("d/b")
            ws.fs.unlink("d/sub/c")
            ws.fs.rmdir("d/sub")

    traced = _crash_at_every_call(kind, tmp_path, remove, "a removal")
    assert ("work", "unlink", "d/b") in traced and ("work", "rmdir", "d/sub") in traced, traced
    assert ("work", "entry", "d/b") not in traced  # taking an entry is no host call of its own


def test_a_real_world_runs_the_real_disks_entries_and_handles_under_faults(tmp_path):
    """On a real disk the core gets RealHostFS's own entry (parent resolved once), directory
    handle and journal append handle — not the base class's fallbacks — each wrapped so its
    calls still meet the injector: a planned EIO reaches them."""
    from sandbox.hostfs.real import _RealEntry
    w = World("real", str(tmp_path))
    _seed(w)
    ws = w.open()
    work = ws.fs.host
    with ws.step("touch"):
        ws.fs.write_file("new", b"n")
        out = ws._log.open_step.journal_out
        assert isinstance(out, FaultyHandle) and type(out.inner).__name__ == "RealFileHandle", out
    with work.entry("d/b") as e:
        assert isinstance(e.inner, _RealEntry)
        st = e.lstat()
        with e.reader(st) as r:
            assert r.read_own(5, 0) == b"bravo"
    with work.open_dir("d") as h:
        assert sorted(h.listdir()) == ["b", "ln", "sub"]
    w.injector = FaultInjector(error_if=(lambda fs, op, path: fs == "work" and op in ("read", "listdir"), errno.EIO))
    with work.entry("d/b") as e:
        with e.reader(e.lstat()) as r, pytest.raises(OSError):
            r.read_own(5, 0)
    with work.open_dir("d") as h, pytest.raises(OSError):
        h.listdir()


@pytest.mark.parametrize("kind", ["sim", "real"])
def test_an_error_on_a_removal_reaches_the_caller_and_changes_nothing(kind, tmp_path):
    """EIO planned on the working folder's unlink (through the entry on a real disk too)
    fails the call; the file stays, and the step's undo leaves the tree as before."""
    w = World(kind, str(tmp_path) if kind == "real" else None)
    _seed(w)
    pre = w.snapshot()
    ws = w.open()
    w.injector = FaultInjector(error_if=(lambda fs, op, path: fs == "work" and op == "unlink", errno.EIO))
    with ws.step("rm"):
        with pytest.raises(OSError) as e:
            ws.fs.unlink("d/b")
    assert e.value.errno == errno.EIO
    w.injector = FaultInjector()
    assert w.work.lstat("d/b").size == 50
    ws.rollback()
    oracle.assert_same(pre, w.snapshot(), "after the failed removal's undo")


def test_exchange_copies_nothing(world):
    """A directory exchanged for a file keeps its contents: the exchange copies nothing."""
    _seed(world)
    ws = world.open()
    with ws.step("swap"):
        ws.fs.exchange("d", "a")
    info = ws.steps()[-1]
    assert info.size_bytes < 4096, ws.records(info.id)  # parents' metadata and one intent, no content
    assert world.work.lstat("a").kind == DIR


# --------------------------------------------------------------------------- the Provider (every transport)

NOBODY = Cred(65534, 65534)


@pytest.fixture
def served(world):
    _seed(world)
    ws = world.open()
    return world, ws, Provider.intercepted(ws)


@pytest.mark.parametrize("mode", [0, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                  FALLOC_FL_ZERO_RANGE, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE])
def test_provider_fallocate_each_mode_undone(served, mode):
    world, ws, p = served
    before = world.snapshot()
    h = p.open("big", os.O_RDWR)
    p.fallocate(h, "big", 5, 30_000, mode)
    h.close()
    assert world.work.lstat("big").size == (16_320 if mode & FALLOC_FL_KEEP_SIZE else 30_005)
    ws.close_active()
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


@pytest.mark.parametrize("mode", [0x08, 0x20, 0x40, FALLOC_FL_PUNCH_HOLE, 0x04],
                         ids=["COLLAPSE_RANGE", "INSERT_RANGE", "UNSHARE_RANGE", "PUNCH_HOLE-without-KEEP_SIZE",
                              "NO_HIDE_STALE"])
def test_provider_fallocate_other_modes_are_eopnotsupp_and_record_nothing(served, mode):
    world, ws, p = served
    before = world.snapshot()
    with p.open("big", os.O_RDWR) as h:
        with pytest.raises(OSError) as e:
            p.fallocate(h, "big", 0, 4096, mode)
    assert e.value.errno == errno.EOPNOTSUPP
    assert world.snapshot() == before and ws.history() == []


def test_provider_copy_file_range_undone_and_bounded(served):
    world, ws, p = served
    before = world.snapshot()
    with p.open("big", os.O_RDONLY) as s, p.open("d/b", os.O_RDWR) as d:
        assert p.copy_file_range(s, "big", d, "d/b", 0, 0, 1 << 40) == len(DATA)  # clamped to the source
    assert world.work.read_all("d/b") == DATA
    ws.close_active()
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())
    assert COPY_FILE_RANGE_BYTES_MAX >= 1 << 20


def test_provider_lseek(served):
    world, ws, p = served
    with p.open("big", os.O_RDONLY) as h:
        assert p.lseek(h, "big", 0, os.SEEK_DATA) == 0
        assert p.lseek(h, "big", 7, os.SEEK_HOLE) == len(DATA)
        with pytest.raises(OSError) as e:
            p.lseek(h, "big", len(DATA), os.SEEK_DATA)
        assert e.value.errno == errno.ENXIO
    assert ws.history() == []


def test_provider_exchange_undone(served):
    world, ws, p = served
    before = world.snapshot()
    p.exchange("d", "big")
    assert p.getattr("big").kind == DIR
    ws.close_active()
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


def test_an_unprivileged_fallocate_or_copy_clears_setid_bits_like_a_write(served):
    world, ws, p = served
    for path in ("big", "d/b"):
        p.setattr(path, mode=0o6755)
    with p.open("big", os.O_RDWR) as h:
        p.fallocate(h, "big", 0, 10, FALLOC_FL_ZERO_RANGE)  # root (CAP_FSETID): kept
        assert p.getattr("big").mode == 0o6755
        p.fallocate(h, "big", 0, 10, FALLOC_FL_ZERO_RANGE, cred=NOBODY)
        assert p.getattr("big").mode == 0o755
        with p.open("d/b", os.O_RDWR) as d:
            p.copy_file_range(h, "big", d, "d/b", 0, 0, 5, cred=NOBODY)
    assert p.getattr("d/b").mode == 0o755
    assert world.work.lstat("d/b").mode & 0o6000 == 0  # never on the host


def test_read_only_and_narrowed_providers_refuse(served):
    world, ws, p = served
    ro = p.narrowed("", read_only=True)
    h = p.open("big", os.O_RDWR)
    try:
        for call in (lambda: ro.fallocate(h, "big", 0, 10), lambda: ro.copy_file_range(h, "big", h, "big", 0, 100, 5),
                     lambda: ro.exchange("a", "big")):
            with pytest.raises(OSError) as e:
                call()
            assert e.value.errno == errno.EROFS
        sub = p.narrowed("d")
        with pytest.raises(OSError) as e:
            sub.exchange("d/b", "big")  # one side outside the view
        assert e.value.errno == errno.EACCES
        with pytest.raises(OSError) as e:
            sub.copy_file_range(h, "big", h, "d/b", 0, 0, 5)
        assert e.value.errno == errno.EACCES
        assert ro.lseek(h, "big", 0, os.SEEK_HOLE) == len(DATA)  # a read
    finally:
        h.close()
    assert ws.history() == []


def _rollback_survives_a_crash_at_every_call(kind, tmp_path, steps) -> None:
    """On a fresh seeded world per crash point: ``steps(ws)`` runs steps; a rollback of all of
    them crashes at host call k (every k of an uninterrupted rollback), then recovery and a
    rollback of whatever history is left must give the seeded tree exactly."""
    def make(where):
        w = World(kind, str(where) if kind == "real" else None)
        _seed(w)
        pre = w.snapshot()
        ws = w.open()
        steps(ws)
        return w, ws, pre

    w, ws, pre = make(tmp_path / "count")
    n = len(ws.history())
    w.injector = FaultInjector()
    ws.rollback(n)
    total = w.injector.calls
    oracle.assert_same(pre, w.snapshot(), "rollback without a crash")
    for k in range(total):
        w, ws, pre = make(tmp_path / str(k))
        w.injector = FaultInjector(crash_at=k)
        with pytest.raises(SimulatedCrash):
            ws.rollback(n)
        w.crash(ws)
        ws2 = w.open()
        if ws2.history():
            ws2.rollback(len(ws2.history()))
        ws2.close()
        oracle.assert_same(pre, w.snapshot(), f"crash at call {k} of the rollback")


@pytest.mark.parametrize("kind", ["sim", "real"])
def test_crash_at_every_call_of_undoing_an_exchange_whose_names_were_remade(kind, tmp_path):
    """After the exchange the step replaces what one name holds; its undo re-creates that
    object with a new inode number *before* the exchange is undone. A rollback interrupted
    anywhere (also just after the exchange back, before its progress is kept) and resumed must
    exchange exactly once: the recorded inode still at its own name says it is done."""
    def steps(ws):
        with ws.step("swap"):
            ws.fs.exchange("big", "d/sub/c")
            ws.fs.write_file("tmp", b"replacement")
            ws.fs.rename("tmp", "d/sub/c")  # replaces what the exchange put there (big's object)

    _rollback_survives_a_crash_at_every_call(kind, tmp_path, steps)


@pytest.mark.parametrize("kind", ["sim", "real"])
def test_crash_at_every_call_of_undoing_an_exchange_whose_both_names_were_remade(kind, tmp_path):
    """A later step removes both exchanged objects; undoing it re-creates both with new inode
    numbers (on a real disk, perhaps reused ones), so neither recorded inode tells whether the
    exchange back ran. A rollback of both steps interrupted anywhere — also just after the
    exchange back, before its progress is kept — and resumed must still exchange exactly once
    (found by the issue-19 fan-out as a hard-link group restored under the wrong name)."""
    def steps(ws):
        with ws.step("swap"):
            ws.fs.exchange("big", "d/sub/c")
        with ws.step("rm both"):
            ws.fs.unlink("big")
            ws.fs.unlink("d/sub/c")

    _rollback_survives_a_crash_at_every_call(kind, tmp_path, steps)


def test_an_undo_sets_a_mode_only_where_a_current_look_shows_it_differs():
    """The undo's chmod is skipped where the stat it already took shows the recorded mode
    (no chown and no xattr change since: either may change a mode); everything else is
    restored exactly as before."""
    world = World("sim")
    with world.paused():
        for d in ("same", "chmodded", "xattred"):
            world.work.mkdir(d, 0o755)
    ws = world.open()
    before = world.snapshot()
    with ws.step("s"):
        ws.fs.write_file("same/f", b"1")  # the directory's mtime changes, not its mode
        ws.fs.chmod("chmodded", 0o700)
        ws.fs.setxattr("xattred", "user.k", b"v")
    world.injector = FaultInjector()
    world.injector.trace = trace = []
    ws.rollback(1)
    assert sorted(path for fs, op, path in trace if op == "chmod") == ["chmodded", "xattred"]
    oracle.assert_same(before, world.snapshot(), "undo")
    ws.close()


def test_a_listing_above_a_narrowed_view_looks_up_one_name_and_reads_no_directory():
    """Above a restricted view only the way down is listed: the view's next component, if it
    is there. It is looked up, not found by reading the directory — so a huge directory above
    the view is neither read nor refused by a listing bound (``ENOMEM``) it has no part in."""
    from sandbox.hostfs.memory import MemoryHostFS

    fs = MemoryHostFS()
    for d in ("a", "a/b", "a/b/c"):
        fs.mkdir(d, 0o755)
    for i in range(500):
        fs.mkdir(f"a/n{i:03d}", 0o755)
    p = Provider(fs, None, read_only=False)
    view = p.narrowed("a/b/c")
    before = fs.entries_read
    assert view.listdir("", limit_bytes=0) == ["a"]
    assert view.listdir("a", limit_bytes=0) == ["b"]
    h = fs.open_dir("a")
    try:
        assert view.listdir("a", handle=h, limit_bytes=0) == ["b"]
    finally:
        h.close()
    assert fs.entries_read == before  # no directory was read
    assert sorted(view.listdir("a/b/c")) == []  # inside the view: the directory itself
    fs.rmdir("a/b/c")
    assert view.listdir("a/b") == []  # the way down is gone: nothing to show
    with pytest.raises(OSError) as e:
        view.listdir("a/n000")  # beside the view
    assert e.value.errno == errno.EACCES
