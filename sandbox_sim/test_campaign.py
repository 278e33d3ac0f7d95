"""The campaign runner (``sandbox_sim/campaign.py``, ``python -m sandbox_sim run``) and its
oracle (issue 19).

* Campaigns with every fault mix run clean, deterministically for a seed.
* The oracle's fast path (the simulated disk's inodes read directly) gives exactly the
  snapshot the HostFS calls give, on the working folder and the store, after every action
  of campaigns with all faults (power loss included) — so the faster check is the same check.
* Planted defects — an undo that forgets one file's mode, its mtime, or its xattrs — are
  caught by a campaign, and the shrunk trace still fails with that difference: the faster
  campaign keeps its teeth.
* The command line: exit 0 on a clean campaign; exit 1, the shrunk trace and a replay
  command that reproduces the violation on a defect.
"""

from __future__ import annotations

import ast
import copy
import os
import re
import shlex
import tempfile
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sandbox.core import preimage
from sandbox.hostfs import memory
from sandbox.hostfs.memory import MemoryHostFS, SimClock

from . import defects, oracle
from .__main__ import main
from .budget import scale
from .campaign import DRIVER_NAMES, FAULT_POSITION, FAULTS, UNREACHED, at_position, execute, fault_positions, plan, shrink, sweep
from .client import SimClient
from .client import _tree as client_tree
from .world import World

MIXES = ["", *FAULTS, ",".join(FAULTS)]
ORIGINAL_APPLY_META = preimage._apply_meta


@pytest.mark.parametrize("faults", MIXES, ids=lambda f: f or "none")
def test_campaigns_run_clean_and_replay_identically(faults):
    wanted = {f for f in faults.split(",") if f}
    config, actions = plan(3, scale(150, 1500), wanted)
    assert plan(3, scale(150, 1500), wanted) == (config, actions)
    d, fail_at, err = execute(config, actions)
    assert err is None, f"action {fail_at}: {err!r}"
    again, _, _ = execute(config, actions)
    assert (again.ops_done, again.faults_injected, again.recoveries) == (d.ops_done, d.faults_injected, d.recoveries)
    assert d.ops_done > 0
    if wanted & {"crash", "power", "torn"}:
        assert d.recoveries > 0, "a fault campaign that never recovered explores nothing"


DESCRIPTOR_PROGRAMS = {"fd_write_after_mv": "mv", "fd_write_after_rm": "rm", "fd_meta": "truncate",
                       "fd_fallocate": "fallocate", "fd_copy_range": "copy_file_range"}


@pytest.mark.parametrize("faults", ["", ",".join(FAULTS)], ids=["none", "all"])
def test_a_campaign_of_descriptor_programs_runs_clean_and_runs_each_of_them(faults, monkeypatch):
    """``programs="handles"``: the undo model's programs plus writes, truncates, chmods,
    fallocates and copies through open descriptors — after the file was renamed or lost a
    name — as the 9P and FUSE servers make them. Each succeeds somewhere in the campaign (a
    program set that only ever failed would check nothing), and the config names the set, so
    a replay runs the same programs."""
    from . import driver
    from .client import OPS_WITH_HANDLES

    assert set(DESCRIPTOR_PROGRAMS) <= set(OPS_WITH_HANDLES)
    done: list[tuple[str, bool]] = []
    real = driver.random_op

    def noting(*args):
        desc, ok = real(*args)
        done.append((desc, ok))
        return desc, ok

    monkeypatch.setattr(driver, "random_op", noting)
    wanted = {f for f in faults.split(",") if f}
    config, actions = plan(11, scale(400, 2000), wanted, "handles")
    assert config["programs"] == "handles"
    d, fail_at, err = execute(config, actions)
    assert err is None, f"action {fail_at}: {err!r}"
    ran = {desc.split(";")[1].split()[0] for desc, ok in done if ok and desc.startswith("exec ")}
    assert ran == set(DESCRIPTOR_PROGRAMS.values()), ran


@pytest.mark.parametrize("driver", ["wire", "fuse", "fuse-noopen"])
def test_a_campaign_runs_its_programs_through_a_real_server_and_cleans_up(driver):
    """``driver``: the same plan's programs over 9P to our server, or as system calls on a
    real FUSE mount of a temporary folder, with store errors; the mount and the folder are
    gone afterwards, and the programs really went through the server."""
    from .fuse_mount import fuse_unavailable
    from .server_drivers import DRIVERS

    assert tuple(DRIVERS) == DRIVER_NAMES
    if driver.startswith("fuse") and fuse_unavailable() is not None:
        pytest.skip(str(fuse_unavailable()))
    config, actions = plan(4, scale(80, 400), {"enospc", "eio"}, driver=driver)
    assert config["driver"] == driver
    before = set(os.listdir(tempfile.gettempdir()))
    d, fail_at, err = execute(config, actions)
    assert err is None, f"action {fail_at}: {err!r}"
    assert d.ops_done > 0 and d.faults_injected > 0
    if driver == "wire":
        from sandbox.ninep.wirefs import WireFS

        assert isinstance(d.client.fs, WireFS)  # the programs' only way to the folder
    else:
        assert d.requests_served > d.ops_done and d.mounted is None
        assert not [n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("sandbox-campaign-")]
    with pytest.raises(ValueError, match="takes only the fault kinds"):
        plan(4, 10, {"crash"}, driver=driver)
    with pytest.raises(ValueError, match="unknown driver"):
        plan(4, 10, set(), driver="nfs")
    with pytest.raises(ValueError, match="simulated disk"):
        plan(4, 10, set(), "handles", driver)


def test_the_default_program_set_leaves_every_earlier_plan_as_it_was():
    config, actions = plan(5, 300, {"crash"})
    assert (config, actions) == plan(5, 300, {"crash"}, "undo") and "programs" not in config
    with pytest.raises(ValueError, match="unknown program set"):
        plan(5, 300, set(), "nope")


def test_the_inode_walk_and_the_hostfs_calls_give_the_same_snapshot_after_every_action():
    """Both disks, every action of an all-faults campaign (power losses, recoveries, hard
    links, special files, xattrs, symlinks): the fast oracle is the slow oracle, and the
    world's kept snapshot is the fast oracle's fresh read."""
    config, actions = plan(11, scale(200, 1500), set(FAULTS))
    seen = {"entries": 0, "links": 0, "xattrs": 0, "other": 0}

    def progress(i, d):
        w = d.world
        with w.paused():
            for fs in (w.work, w.store):
                slow, fast = oracle.snapshot_via_calls(fs), oracle.snapshot_nodes(fs)
                assert slow == fast, oracle.diff(slow, fast)
            tree = oracle.snapshot_nodes(w.work)
        assert w.snapshot() == tree, oracle.diff(tree, w.snapshot())  # the kept snapshot too
        seen["entries"] += len(tree)
        seen["links"] += sum(1 for e in tree.values() if e[8])
        seen["xattrs"] += sum(1 for e in tree.values() if e[4])
        seen["other"] += sum(1 for e in tree.values() if e[0] not in ("reg", "dir", "lnk"))

    _, fail_at, err = execute(config, actions, progress)
    assert err is None, f"action {fail_at}: {err!r}"
    assert all(seen.values()), f"the campaign never made one of these: {seen}"


def test_a_subtree_snapshot_with_skips_is_the_same_both_ways():
    w = World("sim")
    with w.paused():
        for d in ("a", "a/b", "a/b/c", "a/skip", "a/skip/x"):
            w.work.mkdir(d, 0o755)
        w.work.create("a/b/c/f", 0o640)
        w.work.write("a/b/c/f", 0, b"bytes")
        w.work.symlink("../f", "a/b/l")
        w.work.link("a/b/c/f", "a/g")
        w.work.setxattr("a/b", "user.k", b"v")
        w.work.make_special("a/skip/x/fifo")
        for path, skip in [("", frozenset()), ("a", frozenset({"a/skip"})), ("a/b", frozenset({"a/b/c"})), ("a/b/c/f", frozenset())]:
            assert oracle.snapshot_nodes(w.work, path, skip) == oracle.snapshot_via_calls(w.work, path, skip)
        assert "a/skip" not in oracle.snapshot_nodes(w.work, "a", frozenset({"a/skip"}))
        with pytest.raises(FileNotFoundError):
            oracle.snapshot_nodes(w.work, "missing")


# --------------------------------------------------------------------------- planted defects


@pytest.fixture
def planted():
    removals = []
    yield lambda name: removals.append(defects.plant(name))
    for remove in removals:
        remove()


@pytest.mark.interpreted_only
@pytest.mark.parametrize("defect", list(defects.DEFECTS))
def test_a_campaign_catches_an_undo_that_forgets_one_files_metadata_and_shrinks_it(defect, planted):
    field = defects.DEFECTS[defect][0]
    config, actions = plan(5, 400, set())
    _, fail_at, err = execute(config, actions)
    assert err is None, "the campaign must be clean before the defect is planted"
    planted(defect)
    _, fail_at, err = execute(config, actions)
    assert isinstance(err, AssertionError), f"the planted defect ({field}) went unnoticed: {err!r}"
    assert re.search(rf"~ (\S+/)?a: .*{field} ", str(err)), str(err)
    minimal = shrink(config, actions, fail_at, budget_s=120)
    assert len(minimal) < fail_at + 1
    _, _, err2 = execute(config, minimal)
    assert isinstance(err2, AssertionError) and field in str(err2), err2


def test_the_cross_check_catches_a_fast_oracle_that_drifts(monkeypatch):
    """If the inode walk ever missed what the HostFS calls see, the periodic cross-check
    would stop the campaign: here the walk is made to drop xattrs."""
    real = oracle.snapshot_nodes

    def drifting(fs, path="", skip=frozenset()):
        return {p: e[:4] + ((),) + e[5:] for p, e in real(fs, path, skip).items()}

    monkeypatch.setattr(oracle, "snapshot_nodes", drifting)
    config, actions = plan(5, 400, set())
    _, fail_at, err = execute(config, actions)
    assert isinstance(err, AssertionError) and "inode walk vs the HostFS calls" in str(err), err


# --------------------------------------------------------------------------- the command line


def test_run_exits_0_on_a_clean_campaign(capsys):
    assert main(["run", "--seed", "2", "--steps", "60", "--faults", "crash,torn", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ok: 60 actions, \d+ ops executed", out), out
    assert main(["run", "--seed", "2", "--steps", "60", "--programs", "handles", "--quiet"]) == 0
    assert "programs=handles" in capsys.readouterr().out


@pytest.mark.interpreted_only
def test_run_exits_1_with_a_replayable_minimal_trace_on_a_planted_defect(capsys):
    """``--plant`` installs the defect for the run; the printed replay command carries it,
    and the same trace without the defect replays clean."""
    try:
        assert main(["run", "--seed", "5", "--steps", "400", "--quiet", "--plant", "forget_mode"]) == 1
    finally:
        assert preimage._apply_meta is ORIGINAL_APPLY_META, "--plant left its defect installed"
    err = capsys.readouterr().err
    m = re.search(r"^replay: (python -m sandbox_sim replay .*)$", err, re.M)
    assert m, err
    argv = shlex.split(m.group(1))[3:]  # as a shell would split it
    assert argv[:3] == ["replay", "--plant", "forget_mode"], argv
    config, trace = ast.literal_eval(argv[argv.index("--config") + 1]), ast.literal_eval(argv[argv.index("--trace") + 1])
    assert isinstance(config, dict) and len(trace) < 400
    assert main(argv) == 1
    assert "mode" in capsys.readouterr().err
    assert main([a for a in argv if a not in ("--plant", "forget_mode")]) == 0
    assert main(["run", "--plant", "no_such_defect"]) == 2


def test_the_simulated_disks_lstat_or_none_answers_as_lstat_does():
    """MemoryHostFS.lstat_or_none finds "absent" without raising; it must agree with
    ``absent_as_none(lstat)`` everywhere: through files, symlinks, too-long names."""
    from sandbox.hostfs import absent_as_none
    from sandbox.hostfs.memory import MemoryHostFS

    fs = MemoryHostFS()
    fs.mkdir("d", 0o755)
    fs.create("d/f", 0o644)
    fs.symlink("d", "l")
    fs.make_special("d/p")
    long = "n" * 256
    paths = ["", "d", "d/f", "d/f/x", "l", "l/f", "d/p", "d/p/x", "nope", "nope/x", "d/nope", long, f"d/{long}",
             f"{long}/x", f"l/{long}", "é" * 64, "d/" + "é" * 200, "/".join(["d"] * 1100)]
    for p in paths:
        try:
            want = ("ok", absent_as_none(fs.lstat, p))
        except OSError as e:
            want = ("err", e.errno)
        try:
            got = ("ok", fs.lstat_or_none(p))
        except OSError as e:
            got = ("err", e.errno)
        assert got == want, p[:40]


# Violations the first 200-seed fan-out found (``fanout --seeds 0:200 --steps 300 --faults
# crash,enospc,eio,torn,power``), minimal traces as it shrank them. Both also failed on the
# core as it was before issue 19's speed work: bugs of the core, since fixed; each trace
# stays here as a regression test (the focused tests: test_core_ops.py's exchange whose
# both names were remade, test_crash.py's store error while moves fail).
#: violations the fan-out found that are fixed: each trace must now run clean
FIXED_VIOLATIONS = {
    "external-change-refusal-after-power-loss": (
        {"seed": 452311954, "max_step_count": 4, "tight": False, "durable": True},
        [("step", 875197190, 2), ("torn_write_in_step", 3810118396, 3, 6), ("ambient", 3102929090, 5), ("rollback", 1),
         ("step", 3110676550, 5), ("step", 4196939071, 5), ("step", 1005978309, 5),
         ("power_loss_in_step", 3437156982, 6, 141, False), ("ambient", 1272772603, 6), ("step", 820970451, 1),
         ("ambient", 1579907293, 1), ("step", 2403863866, 6), ("rollback", 3), ("ambient", 844452496, 5),
         ("guarded_rm_rf", 12, 8, True), ("rollback", 3), ("store_error_in_step", 236799773, 6, 21, 5),
         ("crash_in_rollback", 3, 79)],
        "changed outside the sandbox"),  # a void the store failed to write: OpenStep.pending_void
    "hard-link-group-after-crash-in-rollback": (
        {"seed": 3396132287, "max_step_count": 2, "tight": False, "durable": True},
        [("step", 1437519957, 2), ("store_error_in_step", 1977212501, 6, 39, 5), ("step", 3939820264, 1),
         ("guarded_rm_rf", 11, 5, False), ("rollback", 3), ("ambient", 139453057, 6), ("step", 4194486992, 3),
         ("crash_in_rollback", 1, 125), ("crash_in_rollback", 2, 55)],
        "links"),  # an exchange undone twice: preimage.ExchangeNote
    "owed-void-shifts-the-next-intent-line": (  # found by bench/campaign_speed.py (seed 3, enospc)
        {"seed": 2337446730, "max_step_count": 4, "tight": True, "durable": False},
        [("step", 1833671387, 6), ("step", 2231049841, 6), ("step", 3508595666, 4),
         ("store_error_in_step", 4015170398, 4, 49, 28), ("ambient", 3279176575, 5),
         ("store_error_in_step", 3049753766, 2, 45, 28), ("rollback", 1),
         ("store_error_in_step", 29088951, 4, 7, 28), ("rollback", 2)],
        "voided but holds no intent"),  # UndoLog.append: the record's line is the one written after an owed void
    # found by a 3,000-seed fan-out (seeds 1000:4000, 400 actions, every fault kind); no fault in it
    "link-index-follows-a-failed-rename": (
        {"seed": 2399061673, "max_step_count": 7, "tight": False, "durable": True},
        [("ambient", 1694206253, 3), ("ambient", 236881468, 4), ("step", 931793234, 6), ("rollback", 1)],
        "links"),  # `mv d2/ d1/e/moved` failing ENOENT moved d2/c.ln in the link index: UndoInterceptor.op_failed
    # the same fan-out: hard links of a fifo, a socket or a symlink were undone as separate inodes
    # (preimage.LinkGroups took regular files only)
    "fifo-linked-then-touched-through-the-link": (
        {"seed": 133481488, "max_step_count": 7, "tight": False, "durable": True},
        [("step", 654562235, 6), ("step", 3912944891, 6), ("ambient", 1257623221, 4), ("guarded_rm_rf", 12, 3, False),
         ("step", 2738433511, 6), ("step", 1694436115, 2), ("crash_in_step", 1793922399, 1, 38),
         ("step", 2765891271, 2), ("rollback", 3)],
        "changed outside the sandbox"),  # `ln a d` of a fifo, then `touch -h d`: a survivor not fingerprinted
    "socket-linked-touched-then-one-name-removed": (
        {"seed": 1467070881, "max_step_count": 7, "tight": False, "durable": True},
        [("ambient", 3936485969, 6), ("step", 4251775082, 4), ("step", 1833496284, 5), ("ambient", 3868544227, 6),
         ("store_error_in_step", 2712130103, 6, 39, 5), ("step", 3375257685, 3), ("step", 50183082, 4),
         ("step", 970048388, 5), ("crash_in_step", 3881864836, 6, 185), ("ambient", 812707902, 2),
         ("ambient", 1317832952, 3), ("step", 3028777482, 5), ("step", 2629496208, 5), ("rollback", 3)],
        "mtime_ns"),  # `ln a c` of a socket, `touch -h c`, `rm -f a`: `a` undone as a new socket
}


@pytest.mark.parametrize("name", list(FIXED_VIOLATIONS))
def test_fixed_violations_found_by_the_fan_out_stay_fixed(name):
    config, trace, _what = FIXED_VIOLATIONS[name]
    _, fail_at, err = execute(config, trace)
    assert err is None, f"action {fail_at}: {err}"


# A fault's position in these traces is a host call (or store mutation) counted from its
# action's start, so a core that makes fewer or more calls in that action moves the call a
# pinned position hits: the trace would still run clean, no longer reaching the scenario it
# guards. So each fault action is also run with its fault at *every* position of its action
# (the others as written): wherever the scenario falls now, it is among them. Checked against
# the fixes these traces guard: with the owed void's line (UndoLog.append), the exchange note
# (preimage.ExchangeNote) or the owed void itself (OpenStep.pending_void) reverted, each entry
# fails in at least two of its sweeps (the owed void's store error at 1 of its 44 positions;
# the exchange's trace as written no longer fails since issue 19's fifth speed pass moved its
# crashes — its two crash-in-rollback sweeps do).
_FAULT_ACTIONS = [(name, i) for name, (_, trace, _w) in FIXED_VIOLATIONS.items()
                  for i, a in enumerate(trace) if a[0] in FAULT_POSITION]


@pytest.mark.parametrize(("name", "i"), _FAULT_ACTIONS, ids=[f"{n}-{i}" for n, i in _FAULT_ACTIONS])
def test_fixed_violations_stay_fixed_with_the_fault_at_every_position_of_its_action(name, i):
    config, trace, _what = FIXED_VIOLATIONS[name]
    assert fault_positions(config, trace, i) > 0, "the fault action no longer arms (an empty history?)"
    failures = sweep(config, trace, i)
    assert not failures, "\n".join(f"{trace[i][0]} at {k}: action {at}: {err}" for k, at, err in failures[:3])


@pytest.mark.interpreted_only
def test_a_sweep_finds_a_violation_the_pinned_position_misses(planted):
    """A fault placed past its action's end hits nothing: an undo that forgets a file's mtime
    goes unseen. Swept over every host call of the step, the crashes and recoveries find it;
    without the defect no position fails."""
    config = {"seed": 1, "max_step_count": 4, "tight": False, "durable": False}
    trace = [("crash_in_step", 1, 6, UNREACHED)]
    n = fault_positions(config, trace, 0)
    assert 0 < n < UNREACHED and at_position(trace[0], 7) == ("crash_in_step", 1, 6, 7)
    assert sweep(config, trace, 0) == []
    planted("forget_mtime")
    assert execute(config, trace)[2] is None
    failures = sweep(config, trace, 0)
    assert failures and all(k < n for k, _, _ in failures) and len(failures) < n
    assert all("mtime_ns" in str(err) for _, _, err in failures)




def test_the_world_reads_the_tree_again_after_any_change_and_cross_checks_what_it_kept():
    """``World.snapshot`` keeps its last read of a simulated disk while no call that may
    change the tree has run (``MemoryHostFS.changes``): a change through a path or a handle
    is seen at once, each caller gets its own dict, and the campaign's cross-check compares
    the kept read with a fresh one (here a change made behind the disk's back)."""
    w = World("sim")
    w.work.create("f", 0o644)
    first = w.snapshot()
    first.pop("f")  # a caller's own dict
    assert "f" in w.snapshot()
    with w.work.open("f", os.O_RDWR) as h:
        h.pwrite(b"new", 0)
    assert w.snapshot()["f"][3] == b"new"
    w.work.setxattr("f", "user.k", b"v")
    assert w.snapshot()["f"][4] == (("user.k", b"v"),)
    w.cross_check()
    for p, node in w.work.tree_nodes():  # behind the disk's back: no call, no count
        if p == "f":
            node.mode = 0o600
    with pytest.raises(AssertionError, match="kept snapshot vs a fresh one"):
        w.cross_check()


# --------------------------------------------------------------------------- the kept snapshot

_NAMES = ("", "a", "b", "d", "d/a", "d/b", "d/e", "d/e/a", "e", "e/a")


def _disk_op(fs, handles: list, op: str, p: str, q: str, n: int) -> None:
    """One call of a random sequence on a simulated disk (errors are outcomes too)."""
    if op == "file":
        fs.create(p, 0o644)
    elif op == "write":
        fs.write(p, n % 7, b"w" * (n % 5 + 1))
    elif op == "handle":  # held across later renames, unlinks and power losses
        handles.append(fs.open(p, os.O_RDWR))
    elif op == "pwrite" and handles:
        handles[n % len(handles)].pwrite(b"h" * (n % 3 + 1), n % 4)
    elif op == "hmeta" and handles:  # metadata through a handle, wherever its file now is
        h = handles[n % len(handles)]
        (h.chmod, lambda m: h.utime(m << 20), lambda m: h.setxattr("user.h", bytes([m])), h.truncate)[n % 4](n % 0o100)
    elif op == "lock":
        fs.lock(p).release()
    elif op == "truncate":
        fs.truncate(p, n % 6)
    elif op == "fallocate":
        fs.fallocate(p, n % 3, n % 4 + 1, 3 if n % 2 else 0)
    elif op == "copy":
        fs.copy_file_range(p, q, 0, n % 3, 4)
    elif op == "chmod":
        fs.chmod(p, 0o600 + n % 0o100)
    elif op == "utime":
        fs.utime(p, 1_600_000_000_000_000_000 + n)
    elif op == "chown":
        fs.lchown(p, 1000 + n % 2, 1000)
    elif op == "setxattr":
        fs.setxattr(p, "user.k", bytes([n % 256]))
    elif op == "removexattr":
        fs.removexattr(p, "user.k")
    elif op == "mkdir":
        fs.mkdir(p, 0o755)
    elif op == "rmdir":
        fs.rmdir(p)
    elif op == "unlink":
        fs.unlink(p)
    elif op == "rename":
        fs.rename(p, q)
    elif op == "exchange":
        fs.exchange(p, q)
    elif op == "link":
        fs.link(p, q)
    elif op == "symlink":
        fs.symlink("t" * (n % 3 + 1), p)
    elif op == "fifo":
        fs.make_special(p)
    elif op == "fsync":
        fs.fsync(p)
    elif op == "sync_all":
        fs.sync_all()
    elif op == "power_loss":
        fs.power_loss()
    elif op == "crash":
        fs.crash()


_DISK_OPS = ("file", "file", "write", "write", "handle", "pwrite", "pwrite", "hmeta", "lock", "truncate", "fallocate", "copy", "chmod",
             "utime", "chown", "setxattr", "removexattr", "mkdir", "mkdir", "rmdir", "unlink", "rename", "rename",
             "exchange", "link", "link", "symlink", "fifo", "fsync", "sync_all", "power_loss", "crash")


@given(st.lists(st.tuples(st.sampled_from(_DISK_OPS), st.sampled_from(_NAMES), st.sampled_from(_NAMES),
                          st.integers(0, 255), st.booleans()), min_size=20, max_size=80))
@settings(max_examples=scale(200, 2000), deadline=None)
# a power loss sets a file's ctime back to the one read before and its bytes to none
@example([("file", "a", "a", 0, False), ("write", "a", "a", 0, False), ("fsync", "", "", 0, True),
          ("power_loss", "a", "a", 0, True)])
def test_the_kept_snapshot_is_a_fresh_one_after_any_calls(calls):
    """``oracle.KeptSnapshot`` reads again only what may have changed (``changes``, ``names``,
    ctimes): read at random moments of a random sequence of calls — writes through paths and
    through handles held across renames, metadata changes, renames, exchanges, hard links,
    removals, fsyncs, power losses and process crashes — it is always the whole tree read
    afresh, and so are the disk's kept walk and the client's kept view of the tree."""
    w = World("sim")
    kept = oracle.KeptSnapshot(w.work)
    client = SimClient(w.open().fs)
    handles: list = []
    for op, p, q, n, look in calls:
        try:
            _disk_op(w.work, handles, op, p, q, n)
        except OSError:
            pass
        if look:
            assert kept.read() == oracle.snapshot_nodes(w.work), oracle.diff(oracle.snapshot_nodes(w.work), kept.read())
            assert w.work.tree_nodes_kept() == tuple(w.work.tree_nodes())
            assert client.tree() == client_tree(client.fs)
    assert kept.read() == oracle.snapshot_nodes(w.work)


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=scale(10, 100), deadline=None)
def test_the_kept_snapshot_is_a_fresh_one_after_every_action_of_a_campaign_with_every_fault(seed):
    """Crash recovery, rollbacks, power losses (the store's WAL replayed, steps undone and
    trashed): after every action the world's kept snapshot is the tree read afresh."""
    config, actions = plan(seed, 40, set(FAULTS))

    def progress(i, d):
        fresh = oracle.snapshot_nodes(d.world.work)
        assert d.world.snapshot() == fresh, oracle.diff(fresh, d.world.snapshot())
        assert d.client.tree() == client_tree(d.client.fs)

    _, fail_at, err = execute(config, actions, progress)
    assert err is None, f"action {fail_at}: {err!r}"


def _state(fs) -> list:
    """Everything a path shows on a simulated disk: its snapshot entry and its whole stat
    (ctime, link count and inode number included)."""
    snap = oracle.snapshot_nodes(fs)
    return [(p, snap[p], node.stat()) for p, node in fs.tree_nodes()]


@pytest.mark.interpreted_only
@given(st.lists(st.tuples(st.sampled_from(_DISK_OPS), st.sampled_from(_NAMES), st.sampled_from(_NAMES),
                          st.integers(0, 255), st.booleans()), min_size=20, max_size=80))
@settings(max_examples=scale(200, 2000), deadline=None)
@example([("file", "a", "a", 0, False), ("fsync", "a", "a", 0, False), ("chmod", "a", "a", 1, False),
          ("fsync", "", "", 0, False), ("utime", "a", "a", 0, False), ("power_loss", "a", "a", 0, True)])
@example([("file", "a", "", 0, False), ("file", "b", "", 0, False), ("exchange", "a", "b", 0, False)])
@example([("power_loss", "", "", 0, False), ("file", "a", "", 0, False), ("chmod", "", "", 0, False)])  # never committed
@example([("file", "a", "", 0, False), ("link", "a", "b", 0, False), ("unlink", "a", "", 0, False)])
# a rename over one name of a hard-linked file: the file loses a link and stays reachable
@example([("file", "a", "", 0, False), ("file", "b", "", 0, False), ("link", "b", "e", 0, False),
          ("rename", "a", "b", 0, False)])
def test_a_commit_of_the_changed_inodes_leaves_what_a_whole_commit_leaves(calls):
    """Power-loss mode's journal commit (``MemoryHostFS._commit_metadata``) copies only the
    inodes noted as changed since the last commit; with ``commit_whole`` a disk copies every
    reachable inode. The same calls on both — fsyncs, power losses, renames, exchanges, hard
    links, removals, every metadata change through paths and handles — leave the same tree,
    before and after each power loss."""
    _lockstep(calls)


_CALLS = st.lists(st.tuples(st.sampled_from(_DISK_OPS), st.sampled_from(_NAMES), st.sampled_from(_NAMES),
                            st.integers(0, 255), st.booleans()), min_size=20, max_size=80)


@pytest.mark.interpreted_only
@given(_CALLS)
@settings(max_examples=scale(50, 500), deadline=None)
def test_a_commit_after_the_notes_of_changed_inodes_overflowed_copies_them_all(calls):
    """Past ``META_CHANGED_KEPT_MAX`` notes (here 2) a disk drops them and its next commit
    copies every reachable inode: the same tree as ever. (No commit after each call here, so
    notes pile up between the calls' own fsyncs.)"""
    with mock.patch.object(memory, "META_CHANGED_KEPT_MAX", 2):
        _lockstep(calls, commit_each=False)


def _lockstep(calls, commit_each: bool = True) -> None:
    """The calls on a disk that commits what it noted and on one that commits everything
    (``commit_whole``): after each, the same tree and the same tree a power loss leaves — and
    (``commit_each``) the same after a commit then."""
    fast = MemoryHostFS("work", clock=SimClock())
    whole = MemoryHostFS("work", clock=SimClock())
    whole.commit_whole = True
    handles: tuple[list, list] = ([], [])
    if not commit_each:  # one commit first: a disk notes changed inodes from its first commit on
        for fs in (fast, whole):
            fs.fsync("")
    for op, p, q, n, _look in calls:
        outcomes = []
        for fs, held in ((fast, handles[0]), (whole, handles[1])):
            try:
                _disk_op(fs, held, op, p, q, n)
                outcomes.append(None)
            except OSError as e:
                outcomes.append(e.errno)
        assert outcomes[0] == outcomes[1], (op, p, q)
        # the tree now, and what a power loss would leave at the last commit and after one now
        # (so the next call's commit holds exactly this call's changes, noted or not)
        assert _state(fast) == _state(whole), (op, p, q)
        assert _after_power_loss(fast, False) == _after_power_loss(whole, False), (op, p, q)
        if commit_each:
            assert _after_power_loss(fast) == _after_power_loss(whole), (op, p, q)
    for fs in (fast, whole):
        fs.power_loss()
    assert _state(fast) == _state(whole)


def _after_power_loss(fs, commit: bool = True) -> list:
    """:func:`_state` of a copy of ``fs`` that loses power — after committing everything so
    far (``commit``), or at the last commit."""
    if commit:
        fs.fsync("")  # the commit is taken by the next call that may change something
    probe = copy.deepcopy(fs)
    probe.power_loss()
    return _state(probe)
