"""Unit tests of the undo core's specific guarantees, on the simulated disk and a real one.

The stateful model (test_models.py) proves the general invariant; these pin down the
named behaviours: bad input, store corruption and versioning, locking, hardlinks, the
step tracker, safeguards, barriers, limits, and that a directory rename costs no copy.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys

import pytest

import sandbox
from sandbox import (BarrierInTheWay, CorruptStep, ExternalChange, HoldRequired, Limits, NothingToUndo, PathError,
                     SafeguardConfig, SafeguardDenied, StepUnprotected, StoreBusy, UndoUnavailable, Workspace)
from sandbox.core.workspace import default_state_dir

from . import oracle


def _open(world, **kw):
    return world.open(**kw)


def _seed(ws, files=("a", "d/b", "d/e/c")):
    with ws.step("seed"):
        for f in files:
            if "/" in f:
                ws.fs.makedirs(f.rsplit("/", 1)[0])
            ws.fs.write_file(f, f"content of {f}".encode())


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../x", "a\0b", "x/" * 16_400])  # > TREE_PATH_BYTES_MAX
def test_bad_paths_are_refused_before_anything_is_touched(world, bad):
    ws = _open(world)
    before = world.snapshot()
    with pytest.raises(PathError):
        ws.fs.write_file(bad, b"x")
    with pytest.raises(PathError):
        ws.fs.rename("a" if False else "x", bad)
    assert world.snapshot() == before
    assert ws.history() == []  # not even an ambient step was journalled


def test_route_through_symlink_out_of_the_root_touches_nothing(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    work = tmp_path / "work"
    work.mkdir()
    os.symlink(str(outside), work / "escape")
    with Workspace.open(str(work), state_dir=str(tmp_path / "state")) as ws:
        for op in (lambda: ws.fs.write_file("escape/secret", b"pwned"), lambda: ws.fs.unlink("escape/secret"),
                   lambda: ws.fs.mkdir("escape/new"), lambda: ws.fs.rename("escape/secret", "stolen"),
                   lambda: ws.fs.remove_tree("escape/secret"), lambda: ws.fs.chmod("escape/secret", 0o777)):
            with pytest.raises(OSError) as e:
                op()
            assert e.value.errno in (errno.ELOOP, errno.ENOTDIR), e.value
        # the symlink itself is an entry of the root: it may be removed, never followed
        ws.fs.unlink("escape")
    assert (outside / "secret").read_bytes() == b"secret"
    assert sorted(os.listdir(outside)) == ["secret"]


def test_symlink_targets_are_data_stored_as_given(world):
    ws = _open(world)
    with ws.step("links"):
        ws.fs.symlink("/etc/passwd", "abs")
        ws.fs.symlink("../../outside", "rel")
    assert world.work.readlink("abs") == "/etc/passwd"
    assert world.work.readlink("rel") == "../../outside"
    with pytest.raises(PathError):
        ws.fs.symlink("a\0b", "nul")
    ws.rollback(1)
    assert not world.work.exists("abs")


def test_state_dir_inside_the_working_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="outside the working folder"):
        Workspace.open(str(tmp_path), state_dir=str(tmp_path / ".undo"))
    with pytest.raises(FileNotFoundError):
        Workspace.open(str(tmp_path / "missing"))


def test_default_state_dir_is_keyed_by_real_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "proj").mkdir()
    os.symlink(tmp_path / "proj", tmp_path / "alias")
    a = default_state_dir(str(tmp_path / "proj"))
    assert a == default_state_dir(str(tmp_path / "alias"))
    assert a.startswith(str(tmp_path / "xdg" / "sandbox" / "undo"))
    (tmp_path / "other").mkdir()
    assert default_state_dir(str(tmp_path / "other")) != a
    with Workspace.open(str(tmp_path / "alias")) as ws:
        ws.fs.write_file("f", b"x")
    assert os.path.isfile(os.path.join(a, "VERSION"))
    assert open(os.path.join(a, "WORKDIR")).read().strip() == str(tmp_path / "proj")


# ---------------------------------------------------------------------------- store: locking, versions, corruption


def test_second_opener_gets_store_busy_with_pid(tmp_path):
    (tmp_path / "w").mkdir()
    state = str(tmp_path / "s")
    ws = Workspace.open(str(tmp_path / "w"), state_dir=state)
    code = ("import sandbox, sys\n"
            "try:\n sandbox.Workspace.open(sys.argv[1], state_dir=sys.argv[2])\n"
            "except sandbox.StoreBusy as e:\n print(e); sys.exit(7)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "w"), state], capture_output=True, text=True, timeout=60)
    assert r.returncode == 7, r.stderr
    assert f"in use by pid {os.getpid()}" in r.stdout
    with pytest.raises(StoreBusy):
        Workspace.open(str(tmp_path / "w"), state_dir=state)  # a second open in the same process too
    ws.close()
    Workspace.open(str(tmp_path / "w"), state_dir=state).close()


def test_version_mismatch_makes_undo_unavailable_until_discard(world):
    ws = _open(world)
    _seed(ws)
    ws.close()
    with world.paused():
        world.store.truncate("VERSION", 0)
        world.store.write_all("VERSION", 0, b"999\n")
    events = []
    ws = _open(world, on_event=events.append)
    assert not ws.undo_available
    assert any(e["type"] == "event.undo_version_mismatch" and "999" in e["message"] for e in events)
    with pytest.raises(UndoUnavailable, match="999"):
        ws.history()
    with pytest.raises(UndoUnavailable):
        ws.rollback(1)
    ws.fs.write_file("still-works", b"the session proceeds")  # writes go through, unprotected
    assert world.work.read_all("still-works") == b"the session proceeds"
    assert world.store.exists("steps")  # nothing deleted silently
    ws.discard()
    assert ws.undo_available and ws.history() == []
    with ws.step("after discard"):
        ws.fs.write_file("new", b"n")
    ws.rollback(1)
    assert not world.work.exists("new")


def test_missing_version_with_history_is_a_mismatch_not_a_reset(world):
    ws = _open(world)
    _seed(ws)
    ws.close()
    with world.paused():
        world.store.unlink("VERSION")
    ws = _open(world)
    assert not ws.undo_available and "VERSION" in ws.undo_unavailable_reason
    assert world.store.listdir("steps")


def test_corrupt_manifest_names_the_step_and_newer_steps_still_undo(world):
    ws = _open(world)
    with ws.step("one"):
        ws.fs.write_file("f1", b"1")
    with ws.step("two"):
        ws.fs.write_file("f2", b"2")
    with ws.step("three"):
        ws.fs.write_file("f3", b"3")
    ws.close()
    two = sorted(world.store.listdir("steps"))[1]
    with world.paused():
        world.store.truncate(f"steps/{two}/manifest.json", 7)
    ws = _open(world)
    hist = ws.history()
    assert [h["command"] for h in hist] == ["three", "two", "one"]  # named by its journal's header
    assert "corrupt" in hist[1] and "manifest.json" in hist[1]["corrupt"]
    ws.rollback(1)  # "three" is fine
    assert not world.work.exists("f3")
    before = world.snapshot()
    with pytest.raises(CorruptStep, match=two):
        ws.rollback(1)
    assert world.snapshot() == before
    assert world.store.exists(f"steps/{two}/journal.jsonl")  # nothing deleted silently


@pytest.mark.parametrize("damage", ["truncate_blob", "garbage_blob", "delete_blob", "garbage_inline", "torn_middle_line"])
def test_corrupt_preimage_refuses_before_touching_the_tree(world, damage):
    ws = _open(world)
    with world.paused():
        world.work.create("big", 0o644)
        world.work.write_all("big", 0, os.urandom(50_000))
        world.work.create("small", 0o644)
        world.work.write_all("small", 0, b"small file")
    with ws.step("rewrite"):
        ws.fs.write_file("big", b"new")
        ws.fs.write_file("small", b"changed")
        ws.fs.write_file("third", b"created")
    ws.close()
    step = "steps/" + world.store.listdir("steps")[0]
    journal = world.store.read_all(f"{step}/journal.jsonl")
    with world.paused():
        if damage == "truncate_blob":
            world.store.truncate(f"{step}/b1", 100)
        elif damage == "garbage_blob":
            world.store.write_all(f"{step}/b1", 0, b"\xff" * 64)
        elif damage == "delete_blob":
            world.store.unlink(f"{step}/b1")
        elif damage == "garbage_inline":
            lines = journal.split(b"\n")
            i = next(k for k, line in enumerate(lines) if b'"path":"small"' in line and b'"data"' in line)
            rec = json.loads(lines[i])
            rec["data"] = "AAAA" + rec["data"][4:]
            lines[i] = json.dumps(rec, separators=(",", ":")).encode()
            world.store.truncate(f"{step}/journal.jsonl", 0)
            world.store.write_all(f"{step}/journal.jsonl", 0, b"\n".join(lines))
        else:
            world.store.write_all(f"{step}/journal.jsonl", 40, b"{{{{")
    ws = _open(world)
    before = world.snapshot()
    with pytest.raises(CorruptStep, match="step 1"):
        ws.rollback(1)
    assert world.snapshot() == before
    assert ws.history()[0]["command"] == "rewrite"


# ---------------------------------------------------------------------------- capture semantics


def test_create_vs_open_trunc_and_exact_metadata_restore(world):
    ws = _open(world)
    with world.paused():
        world.work.create("old", 0o4755)
        world.work.write_all("old", 0, b"original bytes")
        world.work.setxattr("old", "user.tag", b"v1")
        world.work.utime("old", 1_234_567_890_123_456_789)
        world.work.mkdir("dir", 0o2750)
        world.work.utime("dir", 1_111_111_111_111_111_111)
        world.work.utime("", 1_000_000_000_000_000_001)
    before = world.snapshot()
    with ws.step("edit"):
        ws.fs.write_file("old", b"replaced")  # O_TRUNC of an existing file: pre_open_trunc
        ws.fs.write_file("dir/new", b"new")  # a new inode: pre_create/post_create
        ws.fs.chmod("old", 0o600)
        ws.fs.removexattr("old", "user.tag")
        ws.fs.setxattr("dir", "user.x", b"y")
        ws.fs.chmod("dir", 0o700)
        ws.fs.utime("", 5)
    recs = ws.records()
    assert {r["op"] for r in recs if r.get("path") == "old"} == {"pre"}
    assert {r["op"] for r in recs if r.get("path") == "dir/new"} == {"created"}
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


def test_directory_rename_costs_one_record_not_a_copy(world):
    ws = _open(world)
    with world.paused():
        world.work.mkdir("big", 0o755)
        for i in range(300):
            world.work.create(f"big/f{i}", 0o644)
            world.work.write_all(f"big/f{i}", 0, os.urandom(2000))
    before = world.snapshot()
    with ws.step("mv big moved"):
        ws.fs.rename("big", "moved")
        ws.fs.write_file("moved/f7", b"edited after the move")
    info = ws.steps()[-1]
    recs = ws.records(info.id)
    assert len(recs) <= 5, recs
    assert info.size_bytes < 20_000  # one 2 KB preimage (f7) and a few records, not 600 KB
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


def test_hardlinks_path_based(world):
    ws = _open(world)
    with world.paused():
        world.work.create("a", 0o644)
        world.work.write_all("a", 0, b"shared")
        world.work.link("a", "b")
    before = world.snapshot()
    with ws.step("write through a link, make another"):
        ws.fs.write("b", 0, b"SHARED")
        ws.fs.link("a", "c")
        ws.fs.write("c", 0, b"thrice")
    assert world.work.read_all("a") == b"thrice"
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())
    assert world.work.lstat("a").ino == world.work.lstat("b").ino  # links that survive stay links
    with ws.step("delete one link"):  # the other name survives: found, and linked again
        ws.fs.unlink("b")
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())
    assert world.work.lstat("a").ino == world.work.lstat("b").ino


def _linked_tree(world):
    """``a``, ``d/b`` and ``d/e/c``: one inode (nlink 3) with an xattr; ``s``, ``d/t``: another (nlink 2)."""
    with world.paused():
        world.work.mkdir("d", 0o755)
        world.work.mkdir("d/e", 0o755)
        world.work.create("a", 0o640)
        world.work.write_all("a", 0, b"shared bytes " * 50)
        world.work.setxattr("a", "user.k", b"v")
        world.work.link("a", "d/b")
        world.work.link("a", "d/e/c")
        world.work.create("s", 0o600)
        world.work.write_all("s", 0, os.urandom(9000))  # a blob, not inline
        world.work.link("s", "d/t")
        world.work.utime("a", 1_600_000_000_000_000_000)


def _rm_rf(fs, path):
    st = fs.host.lstat(path)
    if st.kind == "dir":
        for name in sorted(fs.host.listdir(path)):
            _rm_rf(fs, path + "/" + name)
        fs.rmdir(path)
    else:
        fs.unlink(path)


def _fails(call, code):
    try:
        call()
    except OSError as e:
        assert e.errno == code, e
    else:
        raise AssertionError("the call did not fail")


LINK_PROGRAMS = {
    "rm-all-names": lambda fs: [fs.unlink(p) for p in ("a", "d/b", "d/e/c", "s", "d/t")],
    "rm-rf-everything": lambda fs: [_rm_rf(fs, p) for p in ("a", "d", "s")],
    "write-then-rm": lambda fs: (fs.write("d/b", 0, b"CHANGED"), fs.chmod("a", 0o600), fs.unlink("a"), _rm_rf(fs, "d")),
    "rm-one-name-others-survive": lambda fs: (fs.unlink("d/b"), fs.unlink("s")),
    "replace-by-rename": lambda fs: (fs.write_file("new", b"other"), fs.rename("new", "d/b"), fs.rename("d/t", "s")),
    "overwrite-by-editor-save": lambda fs: (fs.write_file("d/.b.swp", b"edited"), fs.rename("d/.b.swp", "d/b"),
                                            fs.unlink("a"), fs.write("d/e/c", 0, b"!")),
    "move-dir-then-rm": lambda fs: (fs.rename("d", "moved"), fs.unlink("moved/b"), fs.unlink("a"),
                                    fs.rename("moved/e", "e2"), fs.unlink("e2/c")),
    "link-more-then-rm": lambda fs: (fs.link("a", "z"), fs.unlink("a"), fs.unlink("d/b"), fs.link("s", "d/e/s2"),
                                     fs.unlink("s"), fs.write("z", 0, b"via the new name")),
    "exchange-then-rm": lambda fs: (fs.exchange("d/b", "s"), fs.unlink("s"), fs.unlink("a")),
    "survivors-renamed-first": lambda fs: (fs.write("d/b", 0, b"x"), fs.rename("a", "a2"), fs.rename("d/e", "e2"),
                                           fs.rename("d/t", "t2"), fs.unlink("d/b"), fs.unlink("s")),
    # a rename the host refuses (no such parent) after the step's link index was built: the
    # index must not follow it, or the survivors under the directory are not found as links
    "failed-move-then-rm": lambda fs: (fs.write("s", 0, b"x"), _fails(lambda: fs.rename("d", "gone/d"), errno.ENOENT),
                                       _fails(lambda: fs.rename("d/t", "gone/t"), errno.ENOENT),
                                       fs.unlink("a"), fs.unlink("s")),
}


@pytest.mark.parametrize("program", sorted(LINK_PROGRAMS))
def test_hard_links_deleted_or_replaced_come_back_as_one_inode(world, program):
    ws = _open(world)
    _linked_tree(world)
    before = world.snapshot()
    assert before["a"][-1] == ("a", "d/b", "d/e/c")  # the oracle sees the link structure
    with ws.step(program):
        LINK_PROGRAMS[program](ws.fs)
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())
    assert world.work.lstat("a").nlink == 3 and world.work.lstat("s").nlink == 2


def _linked_specials(world):
    """Hard links of what is not a regular file: a FIFO ``p`` = ``d/p2``, a socket ``k`` =
    ``d/k2``, a symlink ``l`` = ``d/l2`` (link(2) of a symlink links the symlink itself)."""
    with world.paused():
        w = world.work
        w.mkdir("d", 0o755)
        w.mknod("p", 0o640, stat.S_IFIFO)
        w.link("p", "d/p2")
        w.mknod("k", 0o600, stat.S_IFSOCK)
        w.link("k", "d/k2")
        w.symlink("somewhere/else", "l")
        w.link("l", "d/l2")
        for p in ("p", "k", "l"):
            w.utime(p, 1_600_000_000_000_000_000)


SPECIAL_LINK_PROGRAMS = {
    "rm-one-name-touch-the-other": lambda fs: [(fs.unlink(a), fs.utime(b, 1_650_000_000_000_000_000))
                                                for a, b in (("p", "d/p2"), ("d/k2", "k"), ("l", "d/l2"))],
    "rm-all-names": lambda fs: [fs.unlink(p) for p in ("p", "d/p2", "k", "d/k2", "l", "d/l2")],
    "touch-then-rm-rf": lambda fs: (fs.utime("d/p2", 1_650_000_000_000_000_000), fs.chmod("k", 0o644),
                                    fs.utime("l", 1_650_000_000_000_000_000), _rm_rf(fs, "d")),
    "replace-one-name": lambda fs: (fs.unlink("d/p2"), fs.mkdir("d/p2", 0o700), fs.unlink("l"),
                                    fs.symlink("elsewhere", "l"), fs.utime("d/l2", 1_650_000_000_000_000_000)),
    "moved-then-rm": lambda fs: (fs.rename("d", "e"), fs.utime("e/k2", 1_650_000_000_000_000_000), fs.unlink("k")),
}


@pytest.mark.parametrize("program", sorted(SPECIAL_LINK_PROGRAMS))
def test_hard_links_of_fifos_sockets_and_symlinks_come_back_as_one_inode(world, program):
    """A FIFO, a socket or a symlink with two names is one inode: its mode and mtime are
    shared. Undone, a removed name is linked to the inode again, not remade beside it —
    else a change through the other name (a ``touch -h``) would no longer show under it
    (found by a 3,000-seed fan-out: the undone name kept the touched mtime)."""
    ws = _open(world)
    _linked_specials(world)
    before = world.snapshot()
    assert before["p"][-1] == ("d/p2", "p") and before["l"][-1] == ("d/l2", "l")  # the oracle sees them
    with ws.step(program):
        SPECIAL_LINK_PROGRAMS[program](ws.fs)
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())
    for a, b in (("p", "d/p2"), ("k", "d/k2"), ("l", "d/l2")):
        assert world.work.lstat(a).ino == world.work.lstat(b).ino
        world.work.utime(b, 1_700_000_000_000_000_000)
        assert world.work.lstat(a).mtime_ns == 1_700_000_000_000_000_000


def test_a_change_through_a_link_of_a_fifo_made_by_an_older_step_is_not_an_external_change(world):
    """Step 1 links a FIFO under a second name; step 2 changes the FIFO's mtime through it.
    Undoing both is exact, not refused as a change from outside."""
    ws = _open(world)
    _linked_specials(world)
    before = world.snapshot()
    with ws.step("ln"):
        ws.fs.link("p", "q")
    with ws.step("touch -h q"):
        ws.fs.utime("q", 1_650_000_000_000_000_000)
        ws.fs.chmod("q", 0o600)
    ws.rollback(2)
    oracle.assert_same(before, world.snapshot())


def test_a_newer_step_writing_through_a_link_it_then_removed_is_not_an_external_change(world):
    """Step 1 writes ``a``; step 2 writes through ``d/b`` (the same inode) and removes it.
    ``a`` no longer matches step 1's fingerprint, but step 2 named it among the links of
    what it changed: undoing both is exact, not refused."""
    ws = _open(world)
    _linked_tree(world)
    before = world.snapshot()
    with ws.step("write a"):
        ws.fs.write("a", 0, b"one")
    with ws.step("write through d/b, then rm it"):
        ws.fs.truncate("d/b", 900)
        ws.fs.unlink("d/b")
    ws.rollback(2)
    oracle.assert_same(before, world.snapshot())
    with ws.step("write a"):
        ws.fs.write("a", 0, b"one")
    with world.paused():
        world.work.write_all("a", 0, b"someone else")  # still refused when it is not the step
    with pytest.raises(ExternalChange):
        ws.rollback(1)


def test_a_user_edit_of_a_name_the_step_left_alone_refuses_the_undo_through_its_link(world):
    """A step removes one name of a hard-linked file and leaves the others; the user then edits
    the file through one of those. Undoing the step would link the removed name to that inode
    again and write the step's saved bytes into it — over the user's edit, under every name. So
    the names a step left alone are fingerprinted with what it changed, and such an undo is
    refused (``ExternalChange``, the tree untouched); forced, it restores exactly."""
    ws = _open(world)
    _linked_tree(world)
    before = world.snapshot()
    with ws.step("rm one name"):
        ws.fs.unlink("d/e/c")
    with world.paused():
        world.work.write_all("a", 0, b"the user's edit")
    edited = world.snapshot()
    with pytest.raises(ExternalChange) as e:
        ws.rollback(1)
    assert e.value.data["paths"] == ["a", "d/b"]
    oracle.assert_same(edited, world.snapshot())
    ws.rollback(1, force=True)
    oracle.assert_same(before, world.snapshot())


def test_an_untouched_name_of_a_file_the_step_changed_is_not_an_external_change(world):
    """The step wrote through one name and removed another; the third, left alone, still
    shows what the step left: the undo is exact, not refused."""
    ws = _open(world)
    _linked_tree(world)
    before = world.snapshot()
    with ws.step("write, then rm a name"):
        ws.fs.write("d/b", 0, b"through d/b")
        ws.fs.unlink("d/e/c")
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


def test_hard_links_come_back_across_steps(world):
    """The survivor of one step is removed by a later one: undoing both remakes it (a new
    inode), and the older step's undo still links to it — by the name it recorded."""
    ws = _open(world)
    _linked_tree(world)
    before = world.snapshot()
    with ws.step("rm one name"):
        ws.fs.unlink("d/b")
        ws.fs.unlink("d/t")
    with ws.step("rm the others"):
        ws.fs.unlink("a")
        ws.fs.write("s", 0, b"changed")
    with ws.step("and the last"):
        ws.fs.unlink("d/e/c")
        ws.fs.unlink("s")
    ws.rollback(3)
    oracle.assert_same(before, world.snapshot())
    assert world.work.lstat("d/b").nlink == 3 and world.work.lstat("d/t").nlink == 2


# ---------------------------------------------------------------------------- steps


def test_ambient_steps_have_negative_ids_and_close_after_idle(world):
    ws = _open(world)
    ws.fs.write_file("x", b"1")
    assert ws.current_step() == -1
    world.now_s += 4.9
    ws.poll()
    ws.fs.write_file("y", b"2")  # still the same ambient step: idle time restarts
    world.now_s += 4.9
    assert ws.current_step() == -1
    world.now_s += 0.2
    assert ws.current_step() is None
    ws.fs.write_file("z", b"3")
    assert ws.current_step() == -2
    with ws.step("cmd") as s:  # a command step closes the ambient one first
        assert s.id == 1
        ws.fs.write_file("w", b"4")
    hist = ws.history()
    assert [(h["id"], h["type"]) for h in hist] == [(1, "command"), (-2, "ambient"), (-1, "ambient")]
    assert sorted(hist[2]["paths"]) == ["", "x", "y"]


def test_step_ids_are_never_reused_after_rollback_or_reopen(world):
    ws = _open(world)
    for i in range(3):
        with ws.step(f"s{i}"):
            ws.fs.write_file(f"f{i}", b"x")
    ws.rollback(2)
    with ws.step("after") as s:
        ws.fs.write_file("g", b"y")
    assert s.id == 4
    ws.close()
    ws = _open(world)
    with ws.step("reopened") as s:
        ws.fs.write_file("h", b"z")
    assert s.id == 5


def test_quiescence_drains_late_writes_into_the_finished_step(world):
    ws = _open(world)
    step_id = ws.begin_step("make")
    ws.fs.write_file("early", b"1")
    ws.op_started()  # a request still in flight when the command ends
    ws.complete_step(step_id, 0)
    ws.fs.write_file("late", b"2")  # the in-flight write lands after step_completed
    assert ws.current_step() == step_id
    ws.op_finished()
    ws.poll()
    assert ws.current_step() is None
    assert sorted(ws.history()[0]["paths"]) == ["", "early", "late"]
    # without in-flight requests the window is bounded by time alone
    step2 = ws.begin_step("again")
    ws.op_started()
    ws.complete_step(step2, 3)
    world.now_s += 0.2
    ws.poll()
    assert ws.current_step() is None and ws.history()[0]["exit_code"] == 3
    ws.op_finished()


def test_recovery_reports_paths_restored(world):
    from .faults import FaultInjector, SimulatedCrash

    ws = _open(world)
    _seed(ws)
    before = world.snapshot()
    # dies at the promotion (the rename of the step's WAL): every call of the step has run
    world.injector = FaultInjector(crash_if=lambda fs, op, path: (fs, op, path) == ("store", "rename", "wal/in_progress"))
    with pytest.raises(SimulatedCrash):
        with ws.step("rm -rf d"):
            ws.fs.remove_tree("d")
            ws.fs.write_file("a", b"changed" * 100)
            ws.fs.remove_tree("a")
    world.crash(ws)
    events = []
    ws = _open(world, on_event=events.append)
    assert ws.recovery["kind"] == "in_progress_rolled_back" and ws.recovery["paths_restored"] >= 2
    assert any(e["type"] == "event.recovery" for e in events)
    oracle.assert_same(before, world.snapshot())


# ---------------------------------------------------------------------------- safeguards


def _big(world, path="big", size=(1 << 20) + 10):
    with world.paused():
        world.work.create(path, 0o644)
        world.work.write_all(path, 0, b"B" * size)


def test_hold_is_raised_before_the_crossing_delete_without_a_decider(world):
    ws = _open(world, safeguard=SafeguardConfig(delete_threshold=3))
    _seed(ws, files=("f1", "f2", "f3", "f4"))
    sid = ws.begin_step("rm")
    ws.fs.unlink("f1")
    ws.fs.unlink("f2")
    with pytest.raises(HoldRequired) as held:
        ws.fs.unlink("f3")
    hold = held.value.hold
    assert (hold.kind, hold.count, hold.step_id, hold.path) == ("delete", 3, sid, "f3")
    assert world.work.exists("f3")  # held before it ran
    with pytest.raises(HoldRequired):
        ws.fs.write_file("other", b"queued behind the hold")  # every mutation waits
    assert ws.fs.read_file("f4") == b"content of f4"  # reads keep working
    ws.resolve_hold(hold.id, "allow")
    ws.fs.unlink("f3")  # retried: runs
    ws.fs.unlink("f4")  # allowed for the rest of the step
    ws.complete_step(sid, 0)
    ws.poll()
    assert not world.work.exists("f4")


def test_deny_rolls_back_and_fails_further_writes_until_the_step_ends(world):
    ws = _open(world, safeguard=SafeguardConfig(delete_threshold=2))
    _seed(ws, files=("f1", "f2", "f3"))
    before = world.snapshot()
    sid = ws.begin_step("rm")
    ws.fs.write_file("new", b"n")
    ws.fs.unlink("f1")
    with pytest.raises(HoldRequired) as held:
        ws.fs.unlink("f2")
    ws.resolve_hold(held.value.hold.id, "deny")
    oracle.assert_same(before, world.snapshot(), "after deny")
    with pytest.raises(SafeguardDenied) as e:
        ws.fs.write_file("more", b"x")
    assert e.value.errno == errno.EIO
    ws.complete_step(sid, 1)
    ws.poll()
    assert ws.history()[0]["outcome"] == "denied"
    ws.fs.write_file("later", b"ok")  # the next (ambient) step works again


def test_hold_times_out_to_deny(world):
    events = []
    ws = _open(world, safeguard=SafeguardConfig(delete_threshold=1, timeout_s=30), on_event=events.append)
    _seed(ws, files=("f1",))
    before = world.snapshot()
    ws.begin_step("rm")
    with pytest.raises(HoldRequired):
        ws.fs.unlink("f1")
    world.now_s += 29
    ws.poll()
    assert ws.pending_hold is not None
    world.now_s += 1
    ws.poll()
    assert ws.pending_hold is None
    assert any("timed out" in e.get("message", "") for e in events)
    oracle.assert_same(before, world.snapshot())


def test_overwrite_and_truncate_of_large_files_hold(world):
    ws = _open(world, safeguard=SafeguardConfig(overwrite_threshold=1))
    _big(world)
    _big(world, "small", size=1000)
    ws.fs.decide = lambda hold: "deny"
    ws.fs.write_file("small", b"small files never hold")
    with pytest.raises(SafeguardDenied):
        ws.fs.write_file("big", b"clobber")  # O_TRUNC of a > 1 MB file
    assert world.work.lstat("big").size == (1 << 20) + 10
    seen = []
    ws.fs.decide = lambda hold: seen.append(hold.kind) or "allow"
    world.now_s += 10
    ws.poll()
    ws.fs.truncate("big", 10)
    assert seen == ["overwrite"] and world.work.lstat("big").size == 10
    ws.fs.truncate("small", 100)  # growing or small: no hold
    assert seen == ["overwrite"]


def test_rename_over_existing_holds_at_its_threshold(world):
    ws = _open(world, safeguard=SafeguardConfig(rename_over_threshold=2))
    _seed(ws, files=("a", "b", "c", "d"))
    seen = []
    ws.fs.decide = lambda hold: seen.append((hold.kind, hold.count, world.work.exists("c"))) or "allow"
    with ws.step("mv"):
        ws.fs.rename("a", "new-name")  # not over an existing file: never counts
        ws.fs.rename("b", "c")
        ws.fs.rename("c", "d")
    assert seen == [("rename_over", 2, True)]


def test_safeguard_config_is_validated():
    with pytest.raises(ValueError):
        SafeguardConfig(delete_threshold=0)
    with pytest.raises(ValueError):
        SafeguardConfig(timeout_s=0)
    with pytest.raises(ValueError):
        Limits(max_step_count=0)


# ---------------------------------------------------------------------------- barriers


def test_barrier_refuses_without_force_and_force_crosses_it(world):
    ws = _open(world)
    _seed(ws)
    with ws.step("edit"):
        ws.fs.write_file("a", b"sandbox wrote this")
    b = ws.record_external_modification(["notes.txt"])
    assert ws.history()[0]["barriers"][0]["id"] == b["id"]
    before = world.snapshot()
    with pytest.raises(BarrierInTheWay, match="notes.txt"):
        ws.rollback(1)
    assert world.snapshot() == before
    ws.rollback(1, force=True)
    assert world.work.read_all("a") == b"content of a"
    assert ws.barriers() == []  # crossed barriers are gone with the steps they guarded


def test_external_change_is_never_clobbered_even_without_a_barrier(world):
    ws = _open(world)
    _seed(ws)
    with ws.step("edit"):
        ws.fs.write_file("a", b"sandbox wrote this")
        ws.fs.remove_tree("d/e")
    with world.paused():  # the user edits the same file on the host; nobody told us
        world.work.truncate("a", 0)
        world.work.write_all("a", 0, b"the user's edit!!!")
        world.work.utime("a", world.work.lstat("a").mtime_ns)
    with pytest.raises(ExternalChange, match="'?a'?") as e:
        ws.rollback(1)
    assert e.value.data["paths"] == ["a"]
    assert world.work.read_all("a") == b"the user's edit!!!"
    with world.paused():  # a new file where the step deleted one: also refused
        world.work.truncate("a", 0)
        world.work.write_all("a", 0, b"sandbox wrote this")
    ws2 = ws  # content back to what the sandbox left, but the mtime differs: still refused
    with pytest.raises(ExternalChange):
        ws2.rollback(1)
    ws.rollback(1, force=True)
    assert world.work.read_all("a") == b"content of a"


def test_external_change_elsewhere_does_not_block_and_survives(world):
    ws = _open(world)
    _seed(ws)
    with ws.step("edit"):
        ws.fs.write_file("a", b"sandbox")
    with world.paused():
        world.work.create("users-file", 0o644)
        world.work.write_all("users-file", 0, b"mine")
    ws.rollback(1)
    assert world.work.read_all("users-file") == b"mine"


def test_user_file_in_a_directory_the_step_created_blocks_its_removal(world):
    ws = _open(world)
    with ws.step("mkdir"):
        ws.fs.makedirs("gen/out")
    with world.paused():
        world.work.create("gen/out/users", 0o644)
    with pytest.raises(ExternalChange):
        ws.rollback(1)
    assert world.work.exists("gen/out/users")


# ---------------------------------------------------------------------------- limits


def test_step_count_limit_evicts_oldest_with_a_warning(world):
    events = []
    ws = _open(world, limits=Limits(max_step_count=3), on_event=events.append)
    for i in range(5):
        with ws.step(f"s{i}"):
            ws.fs.write_file(f"f{i}", b"x")
    assert [h["command"] for h in ws.history()] == ["s4", "s3", "s2"]
    warnings = [e for e in events if e["type"] == "event.warning"]
    assert len(warnings) == 2 and warnings[0]["evicted_step_ids"] == [1]
    ws.rollback(3)
    with pytest.raises(NothingToUndo):
        ws.rollback(1)
    assert world.work.exists("f1") and not world.work.exists("f2")


def test_log_size_limit_evicts_oldest(world):
    ws = _open(world, limits=Limits(max_log_size_bytes=60_000, max_single_step_size_bytes=50_000))
    for i in range(4):
        with world.paused():
            world.work.create(f"f{i}", 0o644)
            world.work.write_all(f"f{i}", 0, os.urandom(20_000))
        with ws.step(f"s{i}"):
            ws.fs.write_file(f"f{i}", b"small")
    assert ws.store_size_bytes <= 60_000
    assert [h["command"] for h in ws.history()][-1] != "s0"


def test_the_store_size_is_the_sum_of_its_steps_after_every_change(world):
    """The store keeps its finished steps' byte count as steps are recorded, evicted, undone
    and read back on open (every record's accounting reads it): always the sum of the steps'
    own sizes."""

    def check(ws):
        assert ws.store_size_bytes == sum(s.size_bytes for s in ws.steps()) > 0

    ws = _open(world, limits=Limits(max_step_count=3))
    for i in range(5):
        with world.paused():
            world.work.create(f"f{i}", 0o644)
            world.work.write_all(f"f{i}", 0, os.urandom(1_000 * (i + 1)))  # steps of different sizes
        with ws.step(f"s{i}"):
            ws.fs.write_file(f"f{i}", b"small")
        check(ws)  # recorded; from the fourth on, the oldest evicted
    ws.rollback(1)
    check(ws)  # undone: popped
    ws.close()
    ws = _open(world, limits=Limits(max_step_count=3))
    check(ws)  # read back
    with ws.step("s5"):
        ws.fs.write_file("f0", b"again")
    check(ws)
    ws.rollback(2)
    check(ws)
    ws.close()


def test_unprotected_step_cannot_be_undone_but_newer_steps_can(world):
    events = []
    ws = _open(world, limits=Limits(max_single_step_size_bytes=10_000), on_event=events.append)
    with world.paused():
        world.work.create("huge", 0o644)
        world.work.write_all("huge", 0, os.urandom(30_000))
    with ws.step("big rewrite"):
        ws.fs.write_file("huge", b"gone")
        ws.fs.write_file("after-limit", b"not captured")
    with ws.step("small"):
        ws.fs.write_file("tiny", b"t")
    assert [h["unprotected"] for h in ws.history()] == [False, True]
    assert any("unprotected" in e.get("message", "") for e in events)
    ws.rollback(1)
    assert not world.work.exists("tiny")
    before = world.snapshot()
    with pytest.raises(StepUnprotected, match="step 1"):
        ws.rollback(1)
    assert world.snapshot() == before


def test_public_api_names():
    for name in ("Workspace", "Limits", "SafeguardConfig", "BarrierInTheWay", "UndoUnavailable", "StoreBusy"):
        assert hasattr(sandbox, name)
    assert sandbox.ExternalChange.code == "undo.external_change"
    assert issubclass(sandbox.PathError, OSError)


def test_path_under_a_newer_rename_destination_is_not_an_external_change(world):
    """Campaign seed 14: an older step's fingerprint for x/sub (absent) must not be checked
    once a newer step renamed a directory *onto* x — that step's undo moves it away again."""
    ws = _open(world)
    with ws.step("mkdir"):
        ws.fs.makedirs("x/sub")
        ws.fs.makedirs("z/sub")
    before = world.snapshot()
    with ws.step("move sub out"):
        ws.fs.rename("x/sub", "moved")
    with ws.step("replace x"):
        ws.fs.rename("z", "x")  # x is empty now: z replaces it, and x/sub exists again
    ws.rollback(2)
    oracle.assert_same(before, world.snapshot())


# ---------------------------------------------------------------------------- edges the model reaches rarely


def test_deny_interrupted_by_an_io_error_is_finished_when_the_step_closes(world):
    from .faults import FaultInjector

    ws = _open(world, safeguard=SafeguardConfig(delete_threshold=3))
    _seed(ws, files=("f1", "f2", "f3", "f4"))
    before = world.snapshot()
    sid = ws.begin_step("rm")
    ws.fs.write_file("f4", b"rewritten")
    ws.fs.unlink("f1")
    ws.fs.unlink("f2")
    with pytest.raises(HoldRequired) as held:
        ws.fs.unlink("f3")
    world.injector = FaultInjector(error_at=(2, errno.EIO))  # the deny's third store write fails
    with pytest.raises(OSError) as e:
        ws.resolve_hold(held.value.hold.id, "deny")
    assert e.value.errno == errno.EIO
    world.injector = FaultInjector()
    with pytest.raises(SafeguardDenied):
        ws.fs.write_file("more", b"x")  # still denied: nothing may land
    ws.complete_step(sid, 1)
    ws.poll()
    oracle.assert_same(before, world.snapshot(), "deny finished at close")
    assert ws.history()[0]["outcome"] == "denied"


def test_special_files_are_never_opened_and_devices_never_changed():
    """A fifo is removed and undone like any entry (test_special_files.py has the rest);
    a device node on the host is never changed."""
    import stat

    from .world import World

    w = World("sim")
    with w.paused():
        w.work.mkdir("d", 0o755)
        w.work.make_special("d/fifo")
        w.work.make_special("d/null", 0o666, stat.S_IFCHR)
    ws = w.open()
    with pytest.raises(OSError) as e:
        ws.fs.read("d/fifo")
    assert e.value.errno == errno.EPERM
    ws.fs.unlink("d/fifo")
    with pytest.raises(OSError) as e:
        ws.fs.unlink("d/null")
    assert e.value.errno == errno.EPERM
    with pytest.raises(OSError):
        ws.fs.remove_tree("d")
    assert w.work.lstat("d/null").kind == "other"
    ws.rollback()
    assert w.work.lstat("d/fifo").fmt == stat.S_IFIFO


def test_renames_and_links_that_must_fail_record_no_intent(world):
    ws = _open(world)
    _seed(ws, files=("f", "d/x"))
    ws.fs.makedirs("empty")
    with world.paused():
        world.work.link("f", "hard")
    before = world.snapshot()
    with ws.step("failing ops"):
        for op, code in ((lambda: ws.fs.rename("d", "f"), errno.ENOTDIR), (lambda: ws.fs.rename("f", "d"), errno.EISDIR),
                         (lambda: ws.fs.rename("empty", "d"), errno.ENOTEMPTY), (lambda: ws.fs.rename("d", "d/sub"), errno.EINVAL),
                         (lambda: ws.fs.link("f", "d/x"), errno.EEXIST), (lambda: ws.fs.create("f"), errno.EEXIST)):
            with pytest.raises(OSError) as e:
                op()
            assert e.value.errno == code
        ws.fs.rename("f", "hard")  # the same inode: rename(2) does nothing
    recs = ws.records()
    assert not [r for r in recs if r["op"] in ("created", "renamed")], recs
    assert world.snapshot() == before
    ws.rollback(1)
    assert world.snapshot() == before


def test_a_rename_over_a_full_directory_reads_one_of_its_entries():
    """The interceptor's ENOTEMPTY check (a rename over a directory, refused before any intent
    is journalled) asks whether the directory holds an entry: one read answers, however many
    it holds (the in-memory host counts the names it read)."""
    from sandbox.hostfs.memory import MemoryHostFS

    work = MemoryHostFS()
    ws = Workspace.open_on(work, MemoryHostFS("store"))
    try:
        ws.fs.makedirs("empty")
        ws.fs.makedirs("full")
        for i in range(500):
            ws.fs.create(f"full/f{i:03d}")
        before = work.entries_read
        with ws.step("over a full directory"):
            with pytest.raises(OSError) as e:
                ws.fs.rename("empty", "full")
        assert e.value.errno == errno.ENOTEMPTY
        assert work.entries_read - before == 1
    finally:
        ws.close()


def test_unreadable_barrier_file_blocks_every_rollback(world):
    ws = _open(world)
    _seed(ws)
    ws.record_external_modification(["x"])
    ws.close()
    name = world.store.listdir("barriers")[0]
    with world.paused():
        world.store.truncate(f"barriers/{name}", 3)
    events = []
    ws = _open(world, on_event=events.append)
    assert any("unreadable" in e.get("message", "") for e in events)
    with pytest.raises(BarrierInTheWay, match="unreadable|x|1 external"):
        ws.rollback(1)
    ws.rollback(1, force=True)


def test_crash_inside_an_unprotected_step_keeps_it_as_unprotected(world):
    from .faults import FaultInjector, SimulatedCrash

    ws = _open(world, limits=Limits(max_single_step_size_bytes=5000))
    with world.paused():
        world.work.create("big", 0o644)
        world.work.write_all("big", 0, os.urandom(20_000))
    world.injector = FaultInjector(crash_at=10**6)
    with pytest.raises(SimulatedCrash):
        with ws.step("huge"):
            ws.fs.write_file("big", b"small now")
            ws.fs.write_file("other", b"o")
            world.injector.crash_at = world.injector.calls  # die before the step closes
            ws.fs.write_file("third", b"t")
    at_crash = world.snapshot()
    world.crash(ws)
    ws = _open(world)
    assert ws.recovery["kind"] == "unprotected_step_kept"
    assert ws.history()[0]["unprotected"] and ws.history()[0]["outcome"] == "recovered"
    assert world.snapshot() == at_crash
    with pytest.raises(StepUnprotected):
        ws.rollback(1)


def test_rollback_is_refused_while_a_command_runs(world):
    from sandbox import StepError

    ws = _open(world)
    _seed(ws)
    sid = ws.begin_step("long running")
    ws.fs.write_file("a", b"mid-command")
    with pytest.raises(StepError, match="still running"):
        ws.rollback(1)
    with pytest.raises(RuntimeError):
        ws.begin_step("another")  # one command at a time
    ws.complete_step(sid, 0)
    ws.rollback(1)  # draining steps close first; then it is the newest step
    assert world.work.read_all("a") == b"content of a"


def test_change_through_a_hard_link_made_by_the_sandbox_is_not_external(world):
    ws = _open(world)
    _seed(ws, files=("a",))
    before = world.snapshot()
    with ws.step("link"):
        ws.fs.write_file("a", b"step one")
        ws.fs.link("a", "b")
    with ws.step("write through the link"):
        ws.fs.write("b", 0, b"STEP TWO")
    ws.rollback(2)
    oracle.assert_same(before, world.snapshot())


@pytest.mark.parametrize("call, code", [
    (lambda fs: fs.unlink(""), errno.EBUSY), (lambda fs: fs.rename("", "x"), errno.EBUSY),
    (lambda fs: fs.write("a", -1, b"x"), errno.EINVAL), (lambda fs: fs.truncate("a", -1), errno.EINVAL),
    (lambda fs: fs.setxattr("a", "", b"x"), errno.EINVAL), (lambda fs: fs.write_file("d", b"x"), errno.EISDIR),
    (lambda fs: fs.makedirs("a/sub"), errno.ENOTDIR),
])
def test_intercepted_fs_argument_errors(world, call, code):
    ws = _open(world)
    _seed(ws, files=("a", "d/x"))
    before = world.snapshot()
    with pytest.raises(OSError) as e:
        call(ws.fs)
    assert e.value.errno == code
    assert world.snapshot() == before


def test_reads_through_intercepted_fs_never_journal(world):
    ws = _open(world)
    _seed(ws, files=("a",))
    with world.paused():
        world.work.symlink("a", "ln")
    assert ws.fs.read("a", 0, 7) == b"content" and ws.fs.readlink("ln") == "a" and ws.fs.xattrs("a") == {}
    assert ws.fs.listdir() and ws.fs.exists("a") and ws.fs.lstat("a").size == 12
    assert ws.current_step() is None


def test_tracker_and_step_api_validation(world):
    from sandbox.core.steps import StepTracker

    with pytest.raises(ValueError):
        StepTracker(ambient_idle_s=0)
    t = StepTracker(lambda: 0.0)
    with pytest.raises(ValueError):
        t.begin(1, "weird", "")
    t.begin(1, "command", "x")
    with pytest.raises(RuntimeError):
        t.begin(2, "command", "y")
    with pytest.raises(KeyError):
        t.complete(2, 0)
    ws = _open(world)
    with pytest.raises(ValueError):
        with ws.step("x", type="ambient"):
            pass
    with pytest.raises(ValueError):
        ws.rollback(0)


def test_forced_rollback_clears_foreign_objects_in_its_way(world):
    """Found by the barrier model: a user's file where the step moved a directory away, and
    a directory the user deleted under a file the step changed. force completes exactly."""
    ws = _open(world)
    _seed(ws, files=("d1/a", "d2/b"))
    before = world.snapshot()
    with ws.step("mv d1 d3; edit d2/b"):
        ws.fs.rename("d1", "d3")
        ws.fs.write_file("d2/b", b"edited")
    with world.paused():
        world.work.create("d1", 0o644)  # the user's new file at the old name
        world.work.unlink("d2/b")
        world.work.rmdir("d2")  # and the user removed d2
    with pytest.raises(ExternalChange):
        ws.rollback(1)
    ws.rollback(1, force=True)
    assert world.work.read_all("d1/a") == b"content of d1/a"
    assert world.work.read_all("d2/b") == b"content of d2/b"
    assert ws.history()[0]["command"] == "seed" and not world.store.exists("wal/rollback")
    snap = world.snapshot()
    assert {p: v for p, v in snap.items() if p != "d2"} == {p: v for p, v in before.items() if p != "d2"}


def test_directory_moved_away_then_its_name_reused_gets_its_own_metadata_back(world):
    """Campaign seed 125: `mv d1 d2; mkdir d1; chmod 755 d2` — pass 2 must give the
    original d1 (now back at d1) its metadata, not skip it because a new d1 was created."""
    ws = _open(world)
    with ws.step("setup"):
        ws.fs.mkdir("d1", 0o700)
        ws.fs.mkdir("d2", 0o750)
        ws.fs.utime("d1", 1_111_000_000_000_000_000)
    before = world.snapshot()
    with ws.step("shuffle"):
        ws.fs.rename("d1", "d2")
        ws.fs.mkdir("d1", 0o755)
        ws.fs.chmod("d2", 0o755)
        ws.fs.write_file("d2/inside", b"x")
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


# ---------------------------------------------------------------------------- a directory replaced by a symlink
#
# `rm -rf d && ln -s TARGET d` (package managers, release-directory switches). Below the new
# symlink nothing is reachable without following it, so every probe of `d/…` must read
# "absent" — the host filesystem answers ELOOP there, not ENOENT.


def _link_target(world, where: str) -> str:
    if where == "inside":
        return "other"
    if where == "dangling":
        return "nowhere/at/all"
    if world.kind == "real":  # a real directory beside the working folder
        outside = os.path.join(os.path.dirname(world.work.root), "outside")
        os.makedirs(os.path.join(outside, "f"), exist_ok=True)  # holds the very names the step removed
        return outside
    return "/outside/of/the/root"


def _dir_with_files(world) -> None:
    with world.paused():
        world.work.mkdir("d", 0o750)
        world.work.mkdir("d/sub", 0o755)
        for p in ("d/f", "d/sub/g"):
            world.work.create(p, 0o640)
            world.work.write_all(p, 0, f"content of {p}".encode())
        world.work.mkdir("other", 0o755)
        world.work.create("other/f", 0o644)
        world.work.utime("d", 1_500_000_000_000_000_001)


def test_a_path_below_a_symlink_fingerprints_as_absent(world):
    """The cause: fingerprint() of `d/f` once `d` is a symlink raised ELOOP."""
    from sandbox.core import preimage

    with world.paused():
        world.work.mkdir("other", 0o755)
        world.work.create("other/f", 0o644)
        world.work.symlink("other", "d")
        world.work.symlink("nowhere", "dangling")
        for path in ("d/f", "d/missing", "d/f/deeper", "dangling/f"):
            assert preimage.fingerprint(world.work, path) is None, path
            assert preimage.fingerprint(world.work, path, with_dir_mtime=True) is None, path
        assert preimage.fingerprint(world.work, "d") == ["lnk", "other"]


@pytest.mark.parametrize("where", ["inside", "outside", "dangling"])
def test_rm_rf_dir_then_symlink_in_one_step_closes_and_undoes_exactly(world, where):
    _dir_with_files(world)
    target = _link_target(world, where)
    ws = _open(world)
    before = world.snapshot()
    with ws.step(f"rm -rf d && ln -s {target} d") as s:
        ws.fs.remove_tree("d")
        ws.fs.symlink(target, "d")
    (h,) = ws.history()
    assert h["id"] == s.id and {"d", "d/f", "d/sub/g"} <= set(h["paths"])
    after = world.snapshot()
    with ws.step("a later step still works"):
        ws.fs.write_file("later", b"x")
    ws.rollback(1)
    oracle.assert_same(after, world.snapshot(), "undo of the later step")
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot(), "undo of the replacement")
    ws.close()
    ws = _open(world)  # nothing was left for recovery to roll back
    assert ws.recovery is None
    oracle.assert_same(before, world.snapshot(), "reopen")


@pytest.mark.parametrize("where", ["inside", "outside", "dangling"])
def test_dir_deleted_then_symlink_in_the_next_step_undoes_two_at_once(world, where):
    """Step 1 deletes d/, step 2 makes d a symlink: undo -n 2 is not an 'external change'
    (step 1's fingerprints of d/… are 'absent', and absent they are below the link)."""
    _dir_with_files(world)
    target = _link_target(world, where)
    ws = _open(world)
    before = world.snapshot()
    with ws.step("rm -rf d"):
        ws.fs.remove_tree("d")
    with ws.step(f"ln -s {target} d"):
        ws.fs.symlink(target, "d")
    assert ws.rollback(2)["paths_restored"] >= 3
    oracle.assert_same(before, world.snapshot())


def test_symlink_over_a_deleted_dir_then_writes_below_it_are_refused_and_recorded_nowhere(world):
    """Inside the same step, a write below the new symlink fails (ELOOP, never followed) and
    leaves no record: the step still closes and undoes exactly."""
    _dir_with_files(world)
    ws = _open(world)
    before = world.snapshot()
    with ws.step("rm -rf d; ln -s other d; echo x > d/f"):
        ws.fs.remove_tree("d")
        ws.fs.symlink("other", "d")
        with pytest.raises(OSError) as e:
            ws.fs.write_file("d/f", b"through the link")
        assert e.value.errno == errno.ELOOP
        with pytest.raises(OSError) as e:
            ws.fs.mkdir("d/new", 0o755)
        assert e.value.errno == errno.ELOOP
    assert world.work.read_all("other/f") == b""
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())


@pytest.mark.parametrize("where", ["inside", "outside", "dangling"])
def test_forced_undo_after_the_user_replaced_a_dir_by_a_symlink(world, where):
    """Item 2's trigger: the *user* does `rm -rf d && ln -s … d` on the host after a step
    wrote in d/. Undo is refused (external change); --force restores the step's pre-state
    and leaves no pending rollback behind."""
    with world.paused():
        world.work.mkdir("d", 0o750)
        world.work.create("d/f", 0o640)
        world.work.write_all("d/f", 0, b"original")
        world.work.mkdir("other", 0o755)
    target = _link_target(world, where)
    ws = _open(world)
    before = world.snapshot()
    with ws.step("edit d/f, add d/new"):
        ws.fs.write_file("d/f", b"changed")
        ws.fs.write_file("d/new", b"new")
        ws.fs.makedirs("d/made/deeper")
    with world.paused():
        world.work.unlink("d/f")
        world.work.unlink("d/new")
        world.work.rmdir("d/made/deeper")
        world.work.rmdir("d/made")
        world.work.rmdir("d")
        world.work.symlink(target, "d")
    with pytest.raises(ExternalChange) as e:
        ws.rollback(1)
    assert "d" in e.value.data["paths"]
    ws.rollback(1, force=True)
    # the root's mtime is the user's (their rmdir/ln -s): the step never changed the root
    without_root = lambda snap: {p: v for p, v in snap.items() if p}  # noqa: E731
    oracle.assert_same(without_root(before), without_root(world.snapshot()))
    assert not world.store.exists("wal/rollback") and ws.history() == []


def test_step_seqs_are_the_seqs_of_history_through_steps_rollbacks_and_evictions(world):
    ws = _open(world, limits=Limits(max_step_count=3))
    assert ws.step_seqs() == []
    for i in range(5):
        with ws.step(f"s{i}"):
            ws.fs.write_file(f"f{i}", b"x")
        assert ws.step_seqs() == [s.seq for s in ws.steps()]
    assert len(ws.step_seqs()) == 3  # two evicted
    ws.rollback(2)
    assert ws.step_seqs() == [s.seq for s in ws.steps()] and len(ws.step_seqs()) == 1
    ws.close()
