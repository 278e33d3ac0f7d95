"""External-modification watcher: inotify batches, own-write attribution, the folder lock.

Everything runs on real temporary directories (inotify needs a real filesystem). Waiting
is bounded and event-driven: callbacks set a Condition; a test that must prove nothing was
reported makes a final external *sentinel* change after its own writes, waits until the
sentinel is reported, and then checks that the sentinel is all that was — events are
queued in order, and paths left "busy" are re-examined with every batch, so everything
before the sentinel has been classified by then.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from sandbox.core.errors import BarrierInTheWay, ExternalChange
from sandbox.core.workspace import Workspace
from sandbox.hostfs import Stat
from sandbox.barriers.lock import is_locked, lock_folder, unlock_folder
from sandbox.hostfs.real import RealHostFS
from sandbox.barriers.journal import BUSY, EXTERNAL, MAX_AGE_S, MAX_RECORDS, OURS, OwnWrites, RecordingHostFS
from sandbox.barriers.watch import OVERFLOW_WARNING, WATCH_LIMIT_WARNING, ExternalChangeDetector, TreeWatcher

pytestmark = pytest.mark.timeout(30)

WAIT_S = 10
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PR_CAPBSET_DROP = 24
CAP_SYS_ADMIN = 21


class Reports:
    """What the callbacks said, with bounded waits."""

    def __init__(self):
        self.cond = threading.Condition()
        self.batches: list[list[str]] = []
        self.warnings: list[str] = []
        self._sentinels = itertools.count()

    def on_paths(self, paths) -> None:
        with self.cond:
            self.batches.append(sorted(paths))
            self.cond.notify_all()

    on_external = on_paths

    def on_warning(self, message: str) -> None:
        with self.cond:
            self.warnings.append(message)
            self.cond.notify_all()

    def paths(self) -> set[str]:
        with self.cond:
            return {p for b in self.batches for p in b}

    def wait_for(self, predicate, what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, WAIT_S):
                pytest.fail(f"timed out waiting for {what}; reported so far: {self.batches}, warnings: {self.warnings}")

    def wait_paths(self, expected: set[str]) -> None:
        self.wait_for(lambda: expected <= {p for b in self.batches for p in b}, f"paths {sorted(expected)}")

    def sentinel(self, folder) -> str:
        """An external change, waited for until reported; returns its path."""
        name = f"zz-sentinel-{next(self._sentinels)}"
        with open(os.path.join(folder, name), "w") as f:
            f.write("sentinel")
        self.wait_paths({name})
        return name


@pytest.fixture
def folder(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    return str(work)


@pytest.fixture
def stack():
    """Things to stop/close at the end of the test, last first."""
    items = []
    yield items
    for stop in reversed(items):
        stop()


def detect(folder, journal, reports: Reports, stack, **kwargs) -> ExternalChangeDetector:
    det = ExternalChangeDetector(folder, journal, reports.on_external, reports.on_warning, **kwargs)
    det.start()
    stack.append(det.stop)
    return det


def recording(folder, stack) -> RecordingHostFS:
    fs = RecordingHostFS(RealHostFS(folder))
    stack.append(fs.close)
    return fs


def xattrs_supported(folder) -> bool:
    probe = os.path.join(folder, ".xattr-probe")
    open(probe, "w").close()
    try:
        os.setxattr(probe, "user.probe", b"1")
        return True
    except OSError:
        return False
    finally:
        os.unlink(probe)


def write(folder, rel, data="x"):
    with open(os.path.join(folder, rel), "w") as f:
        f.write(data)


# ---------------------------------------------------------------------- external changes


def test_external_changes_are_reported_with_relative_paths(folder, stack):
    write(folder, "a", "one")
    os.makedirs(os.path.join(folder, "deep/er"))
    write(folder, "deep/er/f")
    fs = recording(folder, stack)
    r = Reports()
    detect(folder, fs.journal, r, stack)
    expected: set[str] = set()

    def step(paths):
        expected.update(paths)
        r.wait_paths(set(paths))

    write(folder, "a", "two")  # modify
    step({"a"})
    write(folder, "deep/er/f", "changed")  # a pre-existing subdirectory is watched
    step({"deep/er/f"})
    write(folder, "b")  # create
    step({"b"})
    os.unlink(os.path.join(folder, "a"))  # delete
    step({"a"})
    os.rename(os.path.join(folder, "b"), os.path.join(folder, "c"))  # rename
    step({"b", "c"})
    os.chmod(os.path.join(folder, "c"), 0o600)  # chmod
    step({"c"})
    os.makedirs(os.path.join(folder, "n/sub"))  # mkdir with files inside, faster than we add watches
    write(folder, "n/sub/f")
    step({"n", "n/sub", "n/sub/f"})
    write(folder, "n/sub/g")  # the new directories are watched now
    step({"n/sub/g"})
    os.rename(os.path.join(folder, "n"), os.path.join(folder, "m"))  # a directory rename re-maps its watches
    step({"n", "m"})
    write(folder, "m/sub/h")
    step({"m/sub/h"})
    os.symlink("c", os.path.join(folder, "ln"))
    step({"ln"})
    shutil.rmtree(os.path.join(folder, "m"))
    step({"m", "m/sub", "m/sub/f", "m/sub/g", "m/sub/h"})
    sentinel = r.sentinel(folder)
    assert r.paths() == expected | {sentinel}
    for batch in r.batches:
        assert batch == sorted(set(batch)), "one report per batch, sorted, no duplicates"
    assert r.warnings == []


def test_directories_moved_in_and_out_of_the_tree(folder, tmp_path, stack):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "f").write_text("x")
    os.makedirs(os.path.join(folder, "d/e"))
    r = Reports()
    w = TreeWatcher(folder, r.on_paths, r.on_warning)
    w.start()
    stack.append(w.stop)
    assert w.watched() == {"", "d", "d/e"}

    os.rename(outside, os.path.join(folder, "in"))  # moved in: watched, its entries reported
    r.wait_paths({"in", "in/sub", "in/sub/f"})
    write(folder, "in/sub/g")
    r.wait_paths({"in/sub/g"})
    assert w.watched() == {"", "d", "d/e", "in", "in/sub"}

    gone = tmp_path / "gone"
    os.rename(os.path.join(folder, "d"), gone)  # moved out: its watches are dropped
    r.wait_paths({"d"})
    r.wait_for(lambda: "d/e" not in w.watched(), "the moved-out directory's watches to go")
    assert w.watched() == {"", "in", "in/sub"}
    (gone / "e" / "stale").write_text("not in the folder any more")
    sentinel = r.sentinel(folder)
    assert "d/e/stale" not in r.paths()
    assert r.paths() == {"in", "in/sub", "in/sub/f", "in/sub/g", "d", sentinel}


def test_symlinks_are_never_followed(folder, tmp_path, stack):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, os.path.join(folder, "ln"))
    r = Reports()
    w = TreeWatcher(folder, r.on_paths, r.on_warning)
    w.start()
    stack.append(w.stop)
    assert w.watched() == {""}
    (outside / "f").write_text("outside the folder")
    sentinel = r.sentinel(folder)
    assert r.paths() == {sentinel}


# ---------------------------------------------------------------------- own writes


def test_own_writes_are_never_reported(folder, stack):
    write(folder, "pre", "before")
    os.mkdir(os.path.join(folder, "olddir"))
    with_xattrs = xattrs_supported(folder)
    fs = recording(folder, stack)
    r = Reports()
    detect(folder, fs.journal, r, stack)

    fs.create("f", 0o644)
    fs.write_all("f", 0, b"hello world")
    fs.write("pre", 0, b"BEF")
    fs.truncate("pre", 2)
    fs.rename("f", "g")
    fs.mkdir("d", 0o755)
    fs.create("d/inside", 0o600)  # created before the watcher can have watched d
    fs.write_all("d/inside", 0, b"x" * 5000)
    fs.mkdir("d/sub", 0o700)
    fs.chmod("g", 0o600)
    fs.chmod("d", 0o750)
    fs.utime("g", 1_000_000_000_123_456_789)
    fs.utime("d", 2_000_000_000_000_000_000, 1_000)
    fs.utime("", 1_500_000_000_000_000_000)  # the root itself
    if with_xattrs:
        fs.setxattr("g", "user.x", b"1")
        fs.setxattr("d", "user.y", b"2")
        fs.removexattr("g", "user.x")
    fs.symlink("g", "sl")
    fs.link("g", "hard")
    fs.write_all("hard", 0, b"through the other name")
    fs.fallocate("g", 0, 1 << 16)
    fs.create("copy", 0o644)
    fs.copy_file_range("g", "copy", 0, 0, 100)
    handle = fs.open("g", os.O_RDWR)
    try:
        handle.pwrite(b"by handle", 0)
        fs.rename("g", "d/moved")  # the handle's path is stale now: the write shows up as d/moved
        handle.pwrite(b"after the rename", 3)
        handle.truncate(7)
        fs.unlink("d/moved")
        handle.pwrite(b"unlinked but open", 0)
    finally:
        handle.close()
    fs.rename("d", "d2")  # a directory rename
    fs.create("d2/sub/late", 0o644)
    fs.unlink("hard")
    fs.unlink("sl")
    fs.rmdir("olddir")
    fs.unlink("d2/inside")
    with pytest.raises(FileExistsError):
        fs.create("copy", 0o644)  # a failed call is recorded too
    lock = fs.lock("lockfile")
    lock.release()

    sentinel = r.sentinel(folder)
    assert r.paths() == {sentinel}
    assert r.warnings == []


def test_workspace_step_and_rollback_are_not_reported(tmp_path, folder, stack):
    write(folder, "keep", "original")
    write(folder, "other.txt", "someone else's")
    os.mkdir(os.path.join(folder, "old"))
    wrapped: list[RecordingHostFS] = []

    def wrap(fs):
        wrapped.append(RecordingHostFS(fs))
        return wrapped[-1]

    ws = Workspace.open(folder, state_dir=str(tmp_path / "state"), wrap_work=wrap)
    stack.append(ws.close)
    assert ws.work is wrapped[0] and ws.fs.host is wrapped[0]
    r = Reports()
    detect(folder, wrapped[0].journal, r, stack)

    with ws.step("edit"):
        ws.fs.write_file("keep", b"edited by the guest")
        ws.fs.makedirs("new/deeper")
        ws.fs.write_file("new/deeper/x", b"1")
        ws.fs.rename("old", "new/old")
        ws.fs.chmod("keep", 0o600)
    result = ws.rollback(1)
    assert result["step_ids"]
    with open(os.path.join(folder, "keep")) as f:
        assert f.read() == "original"
    assert sorted(os.listdir(folder)) == ["keep", "old", "other.txt"]
    sentinel1 = r.sentinel(folder)
    assert r.paths() == {sentinel1}

    with ws.step("again"):
        ws.fs.write_file("keep", b"v3")
    write(folder, "other.txt", "edited on the host")  # between the step and its rollback
    r.wait_paths({"other.txt"})
    ws.rollback(1)
    sentinel2 = r.sentinel(folder)
    assert r.paths() == {sentinel1, "other.txt", sentinel2}
    assert r.warnings == []


def test_rollback_relinking_hard_links_is_not_reported(tmp_path, folder, stack):
    """A rollback that makes deleted and replaced names one inode again (link, then a
    temporary name renamed over) does it all through the recording filesystem: nothing is
    reported, and the names are one inode again."""
    os.mkdir(os.path.join(folder, "d"))
    write(folder, "a", "shared")
    for name in ("d/b", "c", "d/keep"):
        os.link(os.path.join(folder, "a"), os.path.join(folder, name))
    wrapped: list[RecordingHostFS] = []
    ws = Workspace.open(folder, state_dir=str(tmp_path / "state"),
                        wrap_work=lambda fs: wrapped.append(RecordingHostFS(fs)) or wrapped[-1])
    stack.append(ws.close)
    r = Reports()
    detect(folder, wrapped[0].journal, r, stack)
    with ws.step("replace one name, write through another, remove two"):
        ws.fs.write_file("new", b"other")
        ws.fs.rename("new", "c")
        ws.fs.write("d/keep", 0, b"SH")
        ws.fs.unlink("a")
        ws.fs.unlink("d/b")
    ws.rollback(1)
    inodes = {os.lstat(os.path.join(folder, n)).st_ino for n in ("a", "d/b", "c", "d/keep")}
    assert len(inodes) == 1 and os.lstat(os.path.join(folder, "a")).st_nlink == 4
    sentinel = r.sentinel(folder)
    assert r.paths() == {sentinel}
    assert r.warnings == []


def test_reports_feed_the_undo_barrier(tmp_path, folder, stack):
    wrapped: list[RecordingHostFS] = []
    ws = Workspace.open(folder, state_dir=str(tmp_path / "state"),
                        wrap_work=lambda fs: wrapped.append(RecordingHostFS(fs)) or wrapped[-1])
    stack.append(ws.close)
    r = Reports()

    def on_external(paths):
        ws.record_external_modification(paths)
        r.on_external(paths)

    det = ExternalChangeDetector(folder, wrapped[0].journal, on_external, r.on_warning)
    det.start()
    stack.append(det.stop)
    with ws.step("guest"):
        ws.fs.write_file("mine", b"guest")
    write(folder, "theirs", "host")
    r.wait_paths({"theirs"})
    with pytest.raises(BarrierInTheWay) as e:
        ws.rollback(1)
    assert type(e.value) is BarrierInTheWay and e.value.data["paths"] == ["theirs"]


def test_workspace_close_closes_the_wrapped_real_fs(tmp_path, folder):
    wrapped: list[RecordingHostFS] = []
    ws = Workspace.open(folder, state_dir=str(tmp_path / "state"),
                        wrap_work=lambda fs: wrapped.append(RecordingHostFS(fs)) or wrapped[-1])
    real = wrapped[0].inner
    assert isinstance(real, RealHostFS) and wrapped[0].root == real.root and wrapped[0].name == "work"
    ws.close()
    assert real._root_fd == -1
    with pytest.raises(OSError):
        real.lstat("")


def test_a_mixed_batch_reports_only_the_external_paths(folder, stack):
    fs = recording(folder, stack)
    r = Reports()
    det = detect(folder, fs.journal, r, stack, settle_s=0.5, batch_max_s=20)
    raw: list[set[str]] = []
    inner = det.watcher.on_paths

    def spy(paths):
        raw.append(set(paths))
        inner(paths)

    det.watcher.on_paths = spy
    fs.create("own1", 0o644)
    write(folder, "ext1")
    fs.write_all("own1", 0, b"ours")
    fs.mkdir("ownd", 0o755)
    write(folder, "ext2")
    fs.create("ownd/f", 0o644)
    os.mkdir(os.path.join(folder, "extd"))
    fs.rename("own1", "own2")
    r.wait_paths({"ext1", "ext2", "extd"})
    assert any({"own1", "own2", "ownd", "ownd/f", "ext1", "ext2", "extd"} <= b for b in raw), raw
    assert r.batches == [["ext1", "ext2", "extd"]]


def test_a_busy_path_is_rechecked_by_the_watcher_thread(folder, stack):
    fs = recording(folder, stack)
    r = Reports()
    det = detect(folder, fs.journal, r, stack, recheck_s=0.02)
    fs.journal.begin(["g"])  # one of our calls on g is running: whatever happens to g is ours
    write(folder, "g", "written by the call in flight")
    s1 = r.sentinel(folder)
    assert det.pending == {"g"}

    armed = threading.Event()
    rechecked = threading.Event()
    inner = det.watcher.on_paths

    def spy(paths):
        was_armed = armed.is_set()
        inner(paths)
        if was_armed and not paths:
            rechecked.set()

    det.watcher.on_paths = spy
    fs.journal.end(["g"])
    armed.set()
    assert rechecked.wait(WAIT_S), "no re-check after the call ended"
    assert det.pending == set()
    s2 = r.sentinel(folder)
    assert r.paths() == {s1, s2}


# ---------------------------------------------------------------------- the journal itself


def test_journal_classification(folder, stack):
    fs = recording(folder, stack)
    j = fs.journal
    path = os.path.join(folder, "f")

    assert j.classify("f") == EXTERNAL  # never recorded (and absent)
    fs.create("f", 0o644)
    fs.write_all("f", 0, b"ours")
    assert j.classify("f") == OURS
    j.begin(["f"])
    assert j.classify("f") == BUSY
    j.end(["f"])
    assert j.classify("f") == OURS

    with open(path, "a") as f:
        f.write(" and theirs")
    assert j.classify("f") == EXTERNAL
    assert j.classify("f") == OURS, "the same external state is reported once"

    os.chmod(path, 0o600)  # external, then overwritten by us before anyone classified it
    fs.write_all("f", 0, b"OURS")
    assert j.classify("f") == EXTERNAL, "the external change must taint the path"
    assert j.classify("f") == OURS

    fs.unlink("f")
    assert j.classify("f") == OURS  # absent, as we left it
    write(folder, "f", "recreated by someone else")
    assert j.classify("f") == EXTERNAL

    fs.create("h", 0o644)
    handle = fs.open("h", os.O_WRONLY)
    try:
        fs.rename("h", "i")
        handle.pwrite(b"through the handle", 0)  # recorded against the inode
        assert j.classify("i") == OURS
        j.begin_inode(os.stat(os.path.join(folder, "i")).st_ino)
        assert j.classify("i") == BUSY
        j.end_inode(os.stat(os.path.join(folder, "i")).st_ino, lambda: fs.lstat("i"))
    finally:
        handle.close()
    assert j.classify("i") == OURS
    os.utime(os.path.join(folder, "i"), ns=(1, 2))
    assert j.classify("i") == EXTERNAL

    with pytest.raises(OSError):
        fs.write_all("d/missing", 0, b"x")  # failed calls still end: nothing stays in flight
    assert not j.in_flight("d/missing")
    assert j.classify("d/missing") == OURS  # we looked: nothing there


def _ours_then_theirs(folder, stack):
    """A recording folder whose ``f`` we wrote (classified ours), then someone else appended
    to — not classified yet."""
    fs = recording(folder, stack)
    fs.create("f", 0o644)
    fs.write_all("f", 0, b"ours")
    assert fs.journal.classify("f") == OURS
    with open(os.path.join(folder, "f"), "a") as f:
        f.write(" and theirs")
    return fs


def test_an_open_for_writing_still_finds_an_external_change_to_what_we_left(folder, stack):
    """An open for writing takes no look at the path before and after it (it changes nothing
    there): the taint check is made through the new descriptor's ``fstat``. A file we left,
    changed behind our back and then written by us through that open before the watcher
    looked, is still reported as external — once — and our own write through it after is ours."""
    fs = _ours_then_theirs(folder, stack)
    j = fs.journal
    for flags in (os.O_WRONLY, os.O_RDWR | os.O_APPEND):
        handle = fs.open("f", flags)
        try:
            assert not j.in_flight("f")
            handle.pwrite(b"OURS", 0)  # overwrites the evidence before the watcher looks
        finally:
            handle.close()
        if flags == os.O_WRONLY:
            assert j.classify("f") == EXTERNAL, "the external change must taint the path"
        assert j.classify("f") == OURS  # acknowledged; then our own write through the second open

    os.chmod(os.path.join(folder, "f"), 0o600)  # external, and our open is read-only: no check
    handle = fs.open("f", os.O_RDONLY)
    handle.close()
    assert j.classify("f") == EXTERNAL


def test_a_read_only_handle_learns_its_inode_at_its_first_change(folder, stack):
    """A handle opened for reading (or a directory's) takes no look when it is opened; a
    change through it later — after its file was renamed and another file took the name it
    was opened at — is recorded for its own inode, found then."""
    fs = recording(folder, stack)
    j = fs.journal
    fs.create("h", 0o644)
    handle = fs.open("h", os.O_RDONLY)
    try:
        fs.rename("h", "i")
        fs.create("h", 0o644)
        handle.chmod(0o600)  # a read-only descriptor may still change metadata
        assert j.classify("i") == OURS
        assert j.classify("h") == OURS
    finally:
        handle.close()
    os.chmod(os.path.join(folder, "i"), 0o640)
    assert j.classify("i") == EXTERNAL


class RacingHostFS(RealHostFS):
    """A real folder where a local process acts on a name right after our own call on it
    returns, before the journal records what the call left (``racer(path)``)."""

    racer = None

    def _race(self, path: str) -> None:
        if self.racer is not None:
            self.racer(path)

    def create_handle(self, path, mode, flags=os.O_WRONLY):
        handle = super().create_handle(path, mode, flags)
        self._race(path)
        return handle

    def unlink(self, path):
        super().unlink(path)
        self._race(path)

    def rename(self, src, dst):
        super().rename(src, dst)
        self._race(src)

    def entry(self, path):  # the journal's look and unlink through one parent (RecordingHostFS.unlink)
        e = super().entry(path)
        unlink = e.unlink

        def racing_unlink():
            unlink()
            self._race(path)

        e.unlink = racing_unlink
        return e


def test_a_racer_at_the_name_after_our_create_or_unlink_is_never_recorded_as_ours(folder, stack):
    """What an exclusive create left is the inode its descriptor names, and what a successful
    unlink left is nothing: a file someone else puts at the name before the journal records
    the call is theirs (a second look at the path would have claimed it)."""
    fs = RecordingHostFS(RacingHostFS(folder))
    stack.append(fs.close)
    j = fs.journal

    def replace(path):  # another process renames its own file over the name we just made
        write(folder, "theirs", "someone else's")
        os.rename(os.path.join(folder, "theirs"), os.path.join(folder, path))

    fs.inner.racer = replace
    handle = fs.create_handle("new", 0o644)
    fs.inner.racer = None
    try:
        assert j.classify("new") == EXTERNAL
        handle.pwrite(b"ours, through our descriptor", 0)  # recorded against our (now nameless) inode
    finally:
        handle.close()

    fs.create("gone", 0o644)
    fs.inner.racer = lambda path: write(folder, path, "recreated by someone else at once")
    fs.unlink("gone")
    fs.inner.racer = None
    assert j.classify("gone") == EXTERNAL

    fs.inner.unlink("new")  # plain paths as before: ours when nobody raced
    handle = fs.create_handle("new", 0o644)
    handle.close()
    assert j.classify("new") == OURS
    fs.unlink("new")
    assert j.classify("new") == OURS


def test_the_source_of_a_rename_is_left_empty_unless_both_names_were_one_file(folder, stack):
    """A rename that succeeded left nothing at its source: recorded without a look after it,
    so a file someone else puts there at once is theirs. Unless the looks before it found one
    file at both names (hard links: the rename does nothing), which is then looked at again:
    the source is still there, and someone else's removal of it is reported."""
    fs = RecordingHostFS(RacingHostFS(folder))
    stack.append(fs.close)
    j = fs.journal
    fs.create("a", 0o644)
    fs.inner.racer = lambda path: write(folder, path, "someone else's, at once")
    fs.rename("a", "b")
    fs.inner.racer = None
    assert j.classify("a") == EXTERNAL
    assert j.classify("b") == OURS

    fs.create("x", 0o644)
    fs.rename("x", "y")  # nobody raced: the source is ours, empty
    assert j.classify("x") == OURS
    assert j.classify("y") == OURS
    fs.mkdir("d", 0o755)
    fs.rename("d", "e")
    assert j.classify("d") == OURS

    fs.link("b", "c")  # one file, two names
    fs.rename("b", "c")  # does nothing
    assert os.path.exists(os.path.join(folder, "b"))
    assert j.classify("b") == OURS
    os.unlink(os.path.join(folder, "b"))  # someone else's
    assert j.classify("b") == EXTERNAL


def test_a_failed_exclusive_create_still_finds_an_external_change_to_what_we_left(folder, stack):
    """The exclusive create takes no look before it (it succeeds only where nothing is); when
    it fails, the look after it makes the taint check: the file we left, changed behind our
    back, is still reported as external, never recorded as ours."""
    fs = _ours_then_theirs(folder, stack)
    j = fs.journal
    with pytest.raises(FileExistsError):
        fs.create_handle("f", 0o644)
    assert not j.in_flight("f")
    assert j.classify("f") == EXTERNAL
    assert j.classify("f") == OURS  # acknowledged


def test_journal_memory_is_bounded():
    assert (MAX_RECORDS, MAX_AGE_S) == (200_000, 60.0)
    now = [0.0]
    j = OwnWrites(lambda p: None, max_records=10, clock=lambda: now[0])
    for k in range(20):
        j.begin([f"p{k}"])
        j.end([f"p{k}"])
    assert len(j) == 20  # all younger than max_age_s: kept
    now[0] = 100.0
    j.begin(["late"])
    j.end(["late"])
    assert len(j) == 10
    assert j.classify("late") == OURS
    assert j.classify("p0") == EXTERNAL  # forgotten
    assert j.classify("p19") == OURS


def test_journal_lstat_errors_are_never_claimed():
    def lstat(path):
        raise OSError(errno.EACCES, "denied", path)

    j = OwnWrites(lstat)
    j.begin(["x"])
    j.end(["x"])
    assert j.classify("x") == EXTERNAL


# ---------------------------------------------------------------------- watcher mechanics


def test_queue_overflow_warns(folder, stack):
    with open("/proc/sys/fs/inotify/max_queued_events") as f:
        limit = int(f.read())
    if limit > 1_000_000:
        pytest.skip(f"fs.inotify.max_queued_events is {limit}: overflowing it would be too slow")
    r = Reports()
    entered, release = threading.Event(), threading.Event()

    def on_paths(paths):
        r.on_paths(paths)
        entered.set()
        release.wait(WAIT_S)  # the watcher thread is blocked: the kernel queue fills up

    w = TreeWatcher(folder, on_paths, r.on_warning)
    w.start()
    stack.append(w.stop)
    stack.append(release.set)
    write(folder, "first")
    assert entered.wait(WAIT_S)
    fds = [os.open(os.path.join(folder, n), os.O_WRONLY | os.O_CREAT, 0o644) for n in ("a", "b")]
    try:
        for k in range(limit + 100):  # alternate files: identical consecutive events would be merged
            os.pwrite(fds[k & 1], b"x", 0)
    finally:
        for fd in fds:
            os.close(fd)
    os.mkdir(os.path.join(folder, "late"))  # the queue is full: this creation goes unseen
    release.set()
    r.wait_for(lambda: OVERFLOW_WARNING in r.warnings, "the overflow warning")
    assert r.warnings == [OVERFLOW_WARNING]
    write(folder, "late/f")  # the tree was walked again after the overflow: "late" is watched
    r.wait_paths({"late/f"})
    sentinel = r.sentinel(folder)  # and the watcher keeps going
    assert sentinel in r.paths()


def test_watch_limit_warns_once_and_keeps_going(folder, tmp_path, stack):
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "f").write_text("already inside when it arrives")
    r = Reports()
    w = TreeWatcher(folder, r.on_paths, r.on_warning)
    w.start()
    stack.append(w.stop)

    def no_space(path, mask):
        raise OSError(errno.ENOSPC, "no space for watches")

    w._inotify.add_watch = no_space
    os.mkdir(os.path.join(folder, "d1"))
    os.rename(staged, os.path.join(folder, "d2"))  # moved in: not watched, but listed while trying
    r.wait_paths({"d1", "d2", "d2/f"})
    sentinel = r.sentinel(folder)
    assert sentinel in r.paths()
    assert r.warnings == [WATCH_LIMIT_WARNING]


def test_callback_errors_are_logged_and_the_thread_survives(folder, stack, caplog):
    r = Reports()
    calls = []
    first = threading.Event()

    def on_paths(paths):
        calls.append(paths)
        if len(calls) == 1:
            first.set()
            raise RuntimeError("callback bug")
        r.on_paths(paths)

    w = TreeWatcher(folder, on_paths, r.on_warning)
    with caplog.at_level(logging.ERROR, logger="sandbox.watch"):
        w.start()
        stack.append(w.stop)
        write(folder, "one")
        assert first.wait(WAIT_S)
        r.sentinel(folder)  # delivered only if the thread survived the first call
    assert calls[0] == {"one"}
    assert any("callback bug" in (rec.exc_text or "") or rec.exc_info for rec in caplog.records)


def test_stop_wakes_the_thread_and_closes_everything(folder):
    r = Reports()
    w = TreeWatcher(folder, r.on_paths, r.on_warning, settle_s=5)
    w.start()
    thread = w._thread
    assert thread.is_alive()
    write(folder, "x")  # a batch is open (5 s settle): stop must not wait for it
    t0 = time.monotonic()
    w.stop()
    assert time.monotonic() - t0 < 3
    assert not thread.is_alive()
    assert r.batches == [["x"]]  # but it delivers what happened before it
    assert w._inotify is None and w._wake_w == -1
    w.stop()  # idempotent


def test_stop_from_a_callback(folder):
    r = Reports()
    holder = {}

    def on_paths(paths):
        holder["w"].stop()
        r.on_paths(paths)

    w = holder["w"] = TreeWatcher(folder, on_paths, r.on_warning)
    w.start()
    write(folder, "x")
    r.wait_paths({"x"})
    w._thread.join(WAIT_S)
    assert not w.running


# ---------------------------------------------------------------------- the lock policy


def _lock_or_skip(path: str):
    if os.geteuid() != 0:
        pytest.skip("locking a folder needs root (CAP_SYS_ADMIN for mount)")
    try:
        return lock_folder(path)
    except PermissionError as e:
        pytest.skip(f"mount is not permitted here: {e}")


def test_lock_makes_host_edits_fail_but_not_ours(folder, stack):
    write(folder, "f", "before")
    fs = RealHostFS(folder)  # opened before the lock, as the sandbox does
    stack.append(fs.close)
    assert not is_locked(folder)
    unlock = _lock_or_skip(folder)
    stack.append(unlock)
    assert is_locked(folder)
    with pytest.raises(OSError) as e:
        open(os.path.join(folder, "f"), "w")
    assert e.value.errno == errno.EROFS
    with pytest.raises(OSError) as e:
        os.mkdir(os.path.join(folder, "newdir"))
    assert e.value.errno == errno.EROFS
    fs.create("g", 0o644)  # the sandbox still writes through its fd
    fs.write_all("g", 0, b"ours")
    fs.write_all("f", 0, b"AFTER!")
    with open(os.path.join(folder, "g")) as f:  # and everyone reads as before
        assert f.read() == "ours"
    with pytest.raises(OSError) as e:
        lock_folder(folder)
    assert e.value.errno == errno.EBUSY

    unlock()
    assert not is_locked(folder)
    write(folder, "f", "host edits work again")
    unlock()  # idempotent


def test_a_stale_lock_is_found_and_removed(folder):
    _lock_or_skip(folder)  # "crash": the unlock function is lost
    try:
        assert is_locked(folder)
        assert is_locked(folder + "/")
    finally:
        assert unlock_folder(folder) is True
    assert not is_locked(folder)
    assert unlock_folder(folder) is False
    write(folder, "f")


def test_lock_without_privileges_is_a_permission_error(folder):
    """A child process without CAP_SYS_ADMIN (dropped from its bounding set before exec,
    so not even root regains it) gets a PermissionError that says what is missing."""
    def drop_sys_admin():
        if os.geteuid() == 0:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) != 0:
                os._exit(99)

    code = ("import sys\nfrom sandbox.barriers.lock import lock_folder\n"
            "try:\n    lock_folder(sys.argv[1])\nexcept PermissionError as e:\n    print('PermissionError', e)\n"
            "else:\n    print('locked')\n")
    try:
        out = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True, timeout=20,
                             preexec_fn=drop_sys_admin, cwd=ROOT)
    finally:
        if is_locked(folder):
            unlock_folder(folder)
    if out.returncode == 99:
        pytest.skip("cannot drop CAP_SYS_ADMIN from the bounding set here")
    assert out.stdout.startswith("PermissionError"), (out.stdout, out.stderr)
    assert "CAP_SYS_ADMIN" in out.stdout
    assert not is_locked(folder)


def test_is_locked_is_false_for_plain_directories_and_mount_points(folder):
    assert not is_locked(folder)
    assert not is_locked("/proc")  # a mount point, but no bind of itself
    assert not is_locked("/")


def test_stat_signature_fields():
    st = Stat("reg", 0o644, 3, 10, 20, 7, 1)
    from sandbox.barriers.journal import signature

    assert signature(st) == ("reg", 7, 0o644, 3, 10, 20, 1)
    assert signature(Stat("dir", 0o755, 4096, 10, 20, 8, 3)) == ("dir", 8, 0o755)  # entries move the rest
    assert signature(None) is None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_workloads_and_rollbacks_are_never_reported(tmp_path, folder, stack, seed):
    """Random guest programs (every op the simulation knows, hard links included), each
    its own step, some of them rolled back: none of it is reported."""
    import random

    from sandbox_sim.client import OPS_WITH_HARDLINKS, SimClient, random_op, seed_tree

    rng = random.Random(seed)
    seed_fs = RealHostFS(folder)
    seed_tree(seed_fs, rng)
    seed_fs.close()
    wrapped: list[RecordingHostFS] = []
    ws = Workspace.open(folder, state_dir=str(tmp_path / "state"),
                        wrap_work=lambda fs: wrapped.append(RecordingHostFS(fs)) or wrapped[-1])
    stack.append(ws.close)
    r = Reports()
    detect(folder, wrapped[0].journal, r, stack)
    client = SimClient(ws.fs)
    done = []
    for k in range(40):
        with ws.step(f"program {k}"):
            for _ in range(rng.randint(1, 4)):
                done.append(random_op(client, rng, time.time_ns(), OPS_WITH_HARDLINKS))
        if rng.random() < 0.3:
            try:
                ws.rollback(rng.randint(1, 2) if len(ws.history()) > 1 else 1)
            except ExternalChange:
                pass  # the core's own refusal (its fingerprints), not ours to judge
    assert sum(ok for _, ok in done) > 40, done  # the workload did something
    sentinel = r.sentinel(folder)
    assert r.paths() == {sentinel}, done


def test_classify_looks_again_when_one_of_our_calls_ends_while_it_looks():
    """Deterministic interleaving: our call changes the path and records it between
    classify's look and its comparison — the stale look must not make it "external"."""
    state = {"p": Stat("reg", 0o644, 1, 10, 10, 5, 1)}
    interfere = []

    def lstat(path):
        seen = state.get(path)
        if interfere:
            interfere.pop()()
        return seen

    j = OwnWrites(lstat)
    j.begin(["p"])
    j.end(["p"])

    def our_call():
        j.begin(["p"])
        state["p"] = Stat("reg", 0o644, 2, 11, 11, 5, 1)
        j.end(["p"])

    interfere.append(our_call)
    assert j.classify("p") == OURS
    assert not interfere


def test_concurrent_own_writes_are_never_reported(folder, stack):
    """Several threads writing through one RecordingHostFS (entries, directories renamed
    under each other, handles): still nothing reported."""
    import random

    fs = recording(folder, stack)
    r = Reports()
    detect(folder, fs.journal, r, stack)
    errors = []

    def worker(k):
        rnd = random.Random(k)
        try:
            for _ in range(400):
                name, dn = f"f{rnd.randrange(8)}", f"d{rnd.randrange(3)}"
                op = rnd.randrange(7)
                try:
                    if op == 0:
                        fs.create(rnd.choice((name, f"{dn}/{name}")), 0o644)
                    elif op == 1:
                        fs.write_all(rnd.choice((name, f"{dn}/{name}")), rnd.randrange(100), b"x" * rnd.randrange(1, 3000))
                    elif op == 2:
                        fs.rename(name, f"f{rnd.randrange(8)}")
                    elif op == 3:
                        fs.mkdir(dn, 0o755)
                    elif op == 4:
                        fs.rename(dn, f"d{rnd.randrange(3)}")
                    elif op == 5:
                        for n in fs.listdir(dn):
                            fs.unlink(f"{dn}/{n}")
                        fs.rmdir(dn)
                    else:
                        with fs.open(name, os.O_RDWR) as h:
                            h.pwrite(b"z" * rnd.randrange(1, 100), rnd.randrange(50))
                except OSError:
                    pass
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    assert not errors and not any(t.is_alive() for t in threads)
    sentinel = r.sentinel(folder)
    assert r.paths() == {sentinel}


def test_after_a_read_the_watcher_lets_a_burst_gather_and_the_kernel_merges_its_repeats(folder, stack, monkeypatch):
    """After each read of the inotify queue the thread waits ``EVENT_READ_INTERVAL_S`` before
    reading again (waking only for stop): a burst — git's ``utime`` of one object per
    file it adds, through the mount — is read in a few wake-ups instead of one per change
    (each wake-up takes the interpreter lock from the thread serving requests), and
    identical consecutive events queued meanwhile are merged by the kernel. Nothing is
    lost: what is queued when the watcher stops is still read and delivered. (Here the
    interval is long, so the whole burst is still queued at stop.)"""
    from sandbox.barriers import watch as watch_mod

    monkeypatch.setattr(watch_mod, "EVENT_READ_INTERVAL_S", 60.0)
    r = Reports()
    read: list[int] = []

    class Counting(TreeWatcher):
        def _process(self, events, batch):
            read.append(len(events))
            super()._process(events, batch)

    w = Counting(folder, r.on_paths, r.on_warning)
    w.start()
    write(folder, "blob")
    r.wait_paths({"blob"})  # read once: the next read waits for the interval
    fd = os.open(os.path.join(folder, "blob"), os.O_RDONLY)
    try:
        for k in range(200):
            os.utime(fd, ns=(k, k))
    finally:
        os.close(fd)
    write(folder, "after")
    t = time.monotonic()
    w.stop()  # wakes the thread at once, whatever the interval; reads what is queued
    assert time.monotonic() - t < WAIT_S
    assert {"blob", "after"} <= r.paths()
    assert sum(read[1:]) <= 4  # 200 utimes: one IN_ATTRIB; "after": IN_CREATE, IN_MODIFY
