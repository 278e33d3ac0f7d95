"""``python -m sandbox_sim nightly``: ``pytest -m e2e`` sharded over Ray (issue 19).

* the sharding (no Ray): every test in exactly one shard, a file's tests together and in
  order, deterministic whatever the order of the files, shard sizes within the largest
  file's count, no empty shard — a Hypothesis property;
* a shard's hard timeout kills its whole process tree: a tiny pytest file in tmp whose
  test starts a child and both block reading a pipe nobody writes; after the timeout
  both processes are gone and the shard is reported as ``timeout``; a child a passing test
  leaves behind is killed with the group and reported;
* the whole command on a local Ray (skipped with the reason without the ``sandbox[cluster]``
  extra) over synthetic e2e-marked files in tmp — not the real VM suites: JUnit XML per
  shard, the summary's counts, a non-e2e test left out, ``--env`` reaching the shards, a
  daemon a test left in its own session killed by the worker (its subreaper), exit 1
  because a test fails.
  Here there is no ``kvm`` resource (``SANDBOX_ACCEL=tcg`` decides the probe), so the shards
  run without it, and ``--require-kvm`` refuses to start (exit 2); on a Ray started with a
  ``kvm`` resource (as ``--node-resources`` gives a KVM host) every shard asks for one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .nightly import (_weights, file_of, file_seconds, junit_counts, parse_collected, run_shard, shard_by_file,
                      summary_lines)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------- sharding

_files = st.dictionaries(st.from_regex(r"e2e/test_[a-z]{1,6}\.py", fullmatch=True), st.integers(1, 12), max_size=15)


def _ids(files: dict[str, int]) -> list[str]:
    return [f"{f}::test_{k}" for f, n in files.items() for k in range(n)]


@settings(max_examples=200, deadline=None)
@given(files=_files, shards=st.integers(1, 10), order=st.randoms(use_true_random=False), data=st.data())
def test_shards_hold_every_test_once_files_whole_balanced_and_deterministic(files, shards, order, data):
    ids = _ids(files)
    # weights: none (test counts), or an earlier run's seconds for some of the files (zeros too)
    seconds = data.draw(st.none() | st.dictionaries(st.sampled_from(sorted(files) or ["e2e/test_x.py"]),
                                                    st.floats(0, 1000) | st.just(0.0)))
    out = shard_by_file(ids, shards, seconds)
    flat = [t for s in out for t in s]
    assert sorted(flat) == sorted(ids)  # every test exactly once
    assert len(out) == min(shards, len(files)) and all(out)  # no empty shard
    for s in out:  # a file's tests together, in their collected order
        for f in {file_of(t) for t in s}:
            assert [t for t in s if file_of(t) == f] == [t for t in ids if file_of(t) == f]
    where = {file_of(t): i for i, s in enumerate(out) for t in s}
    assert len(where) == len(files)
    if out:  # balanced: within the heaviest file's weight
        weight = _weights({f: [t for t in ids if file_of(t) == f] for f in files}, seconds or {})
        loads = [sum(weight[f] for f in {file_of(t) for t in s}) for s in out]
        assert max(loads) - min(loads) <= max(weight.values()) + 1e-6
        if not seconds:
            assert loads == [len(s) for s in out]
    # deterministic: the same shards (as sets of files) whatever the order the files come in
    names = list(files)
    order.shuffle(names)
    again = shard_by_file(_ids({f: files[f] for f in names}), shards, seconds)
    assert [sorted(s) for s in again] == [sorted(s) for s in out]
    assert shard_by_file(ids, shards, seconds) == out


def test_equal_files_spread_evenly_and_a_bad_shard_count_is_refused():
    ids = _ids({f"e2e/test_{c}.py": 2 for c in "abcdefg"})
    assert [len(s) for s in shard_by_file(ids, 3)] == [6, 4, 4]
    assert shard_by_file([], 3) == []
    with pytest.raises(ValueError):
        shard_by_file(ids, 0)


# --------------------------------------------------------------------------- the hard timeout

BLOCKING_TEST = '''
import os, subprocess, sys

def test_blocks_forever():
    child = subprocess.Popen([sys.executable, "-c", "import os; r, w = os.pipe(); os.read(r, 1)"])
    with open({pids!r} + ".tmp", "w") as f:
        f.write(f"{{os.getpid()}} {{child.pid}}")
    os.rename({pids!r} + ".tmp", {pids!r})
    r, w = os.pipe()
    os.read(r, 1)  # nobody writes: only the group's SIGKILL ends this
'''


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie is dead
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, deadline_s: float = 10.0) -> bool:
    """Condition wait: the killed child was reparented and is reaped by init."""
    end = time.monotonic() + deadline_s
    while not _gone(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_a_shard_past_its_timeout_has_its_whole_process_tree_killed(tmp_path):
    pids = tmp_path / "pids"
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_block.py").write_text(BLOCKING_TEST.format(pids=str(pids)))
    res = run_shard(0, ["test_block.py::test_blocks_forever"], str(tmp_path), timeout_s=8.0)
    assert res["status"] == "timeout", res
    assert res["counts"] is None and res["junit"] is None
    assert pids.exists(), "the test never reached its blocking read:\n" + res["log"]
    test_pid, child_pid = map(int, pids.read_text().split())
    assert _gone(test_pid)  # pytest itself, waited for by run_shard
    assert _wait_gone(child_pid), f"the test's child {child_pid} outlived the shard"
    lines = summary_lines([["test_block.py::test_blocks_forever"]], [res])
    assert res["reason"].endswith("in or after test_block.py::test_blocks_forever"), res["reason"]
    assert lines[1].split()[:2] == ["00", "timeout"] and "killed (SIGKILL to its process group)" in lines[1]
    assert lines[-1].endswith("1 timed out, 0 error(s)")


LEAKING_TEST = '''
import subprocess, sys

def test_leaves_a_child_behind():
    child = subprocess.Popen([sys.executable, "-c", "import os; r, w = os.pipe(); os.read(r, 1)"])
    with open({pids!r}, "w") as f:
        f.write(str(child.pid))
'''


def test_a_process_left_in_a_passed_shards_group_is_killed_and_reported(tmp_path):
    pids = tmp_path / "pid"
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_leak.py").write_text(LEAKING_TEST.format(pids=str(pids)))
    res = run_shard(3, ["test_leak.py::test_leaves_a_child_behind"], str(tmp_path), timeout_s=120.0)
    assert res["status"] == "passed" and res["counts"]["passed"] == 1, res
    assert res["strays_killed"] and "left in its group" in res["reason"]
    assert _wait_gone(int(pids.read_text())), "the leaked child outlived the shard"
    assert 'name="test_leaves_a_child_behind"' in res["junit"] and set(res["file_seconds"]) == {"test_leak.py"}


def test_only_the_collected_list_is_read_not_the_warnings_after_it():
    out = ("e2e/test_a.py::test_x\ne2e/test_a.py::test_y[p q]\n\n"
           "=============================== warnings summary ===============================\n"
           "e2e/test_b.py::test_z\n  /x/y.py:3: DeprecationWarning: old\n\n2 tests collected in 0.1s\n")
    assert parse_collected(out) == ["e2e/test_a.py::test_x", "e2e/test_a.py::test_y[p q]"]


def test_junit_counts_sum_the_suites():
    xml = (b'<testsuites><testsuite tests="5" failures="1" errors="1" skipped="2"/>'
           b'<testsuite tests="3" failures="0" errors="0" skipped="0"/></testsuites>')
    assert junit_counts(xml) == {"tests": 8, "failed": 1, "errors": 1, "skipped": 2, "passed": 4}


# --------------------------------------------------------------------------- the command on Ray

SYNTHETIC = {
    "pytest.ini": "[pytest]\nmarkers =\n    e2e: synthetic\n",
    "test_alpha.py": '''import pytest
pytestmark = pytest.mark.e2e

def test_ok():
    pass

def test_fails():
    assert 1 == 2

def test_skipped():
    pytest.skip("not here")
''',
    "test_beta.py": '''import pytest

@pytest.mark.e2e
def test_one():
    import os, subprocess, sys
    where = os.environ.get("NIGHTLY_DAEMON_PID")
    if where:  # a daemon of its own session and group, blocked on a pipe nobody writes
        d = subprocess.Popen([sys.executable, "-c", "import os; r, w = os.pipe(); os.read(r, 1)"], start_new_session=True)
        with open(where, "w") as f:
            f.write(str(d.pid))

@pytest.mark.e2e
def test_two():
    import os
    assert os.environ.get("NIGHTLY_SYNTHETIC") == "passed on", "--env reaches the shard"

def test_not_e2e():
    raise AssertionError("the nightly collects only -m e2e")
''',
}


def _nightly(tmp_path, *extra):
    env = dict(os.environ, SANDBOX_ACCEL="tcg")  # the project's probe answers without booting a guest
    return subprocess.run([sys.executable, "-m", "sandbox_sim", "nightly", "--cwd", str(tmp_path / "suite"),
                           "--num-cpus", "2", *extra, "."], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _suite(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, text in SYNTHETIC.items():
        (suite / name).write_text(text)


def test_the_command_shards_e2e_tests_over_a_local_ray_and_collects_junit(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed: the optional extra sandbox[cluster] (./dev setup installs it)")
    _suite(tmp_path)
    out = tmp_path / "results"
    daemon = tmp_path / "daemon.pid"
    proc = _nightly(tmp_path, "--out", str(out), "--shards", "2", "--timeout", "120", "--env", "NIGHTLY_SYNTHETIC=passed on",
                    "--env", f"NIGHTLY_DAEMON_PID={daemon}")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # test_fails fails
    assert "5 test(s) marked 'e2e' in 2 shard(s)" in proc.stdout, proc.stdout
    assert "no 'kvm' resource in the cluster: shards run without it (TCG)" in proc.stdout, proc.stdout
    assert sorted(os.listdir(out)) == ["shard-00.log", "shard-00.xml", "shard-01.log", "shard-01.xml", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False
    by_file = {tuple(sorted({file_of(t) for t in s["test_ids"]})): s for s in summary["shards"]}
    alpha, beta = by_file[("test_alpha.py",)], by_file[("test_beta.py",)]
    assert alpha["status"] == "failed" and beta["status"] == "passed"
    assert alpha["resources"] == beta["resources"] == {"CPU": 1.0}  # no kvm resource asked for
    # the daemon test_one left (its own session: out of killpg's reach) was killed by the worker, its subreaper
    assert _wait_gone(int(daemon.read_text())), "a daemon of the shard outlived it"
    assert beta["orphans_killed"] == 1 and alpha["orphans_killed"] == 0, beta
    assert beta["reason"] == "1 process(es) that left its group were killed"
    assert alpha["counts"] == {"tests": 3, "passed": 1, "failed": 1, "errors": 0, "skipped": 1}
    assert beta["counts"] == {"tests": 2, "passed": 2, "failed": 0, "errors": 0, "skipped": 0}
    assert "test_not_e2e" not in json.dumps(summary)
    junit = (out / f"shard-{alpha['index']:02d}.xml").read_text()
    assert junit_counts(junit.encode())["failed"] == 1 and 'name="test_fails"' in junit
    assert "total: 3 passed, 1 failed, 1 skipped; shards: 1 passed, 1 failed, 0 timed out, 0 error(s)" in proc.stdout
    assert set(alpha["file_seconds"]) == {"test_alpha.py"} and set(beta["file_seconds"]) == {"test_beta.py"}


def test_on_a_cluster_with_a_kvm_resource_every_shard_takes_one(tmp_path, capsys):
    ray = pytest.importorskip("ray", reason="Ray is not installed: the optional extra sandbox[cluster] (./dev setup installs it)")
    from .__main__ import main

    _suite(tmp_path)
    ray.init(num_cpus=2, resources={"kvm": 1}, include_dashboard=False, object_store_memory=128 << 20)
    try:
        code = main(["nightly", "--address", "auto", "--require-kvm", "--cwd", str(tmp_path / "suite"), "--out",
                     str(tmp_path / "out"), "--env", "NIGHTLY_SYNTHETIC=passed on", "--shards", "2", "."])
        assert ray.is_initialized(), "nightly must not stop a Ray it did not start"
    finally:
        ray.shutdown()
    out = capsys.readouterr().out
    assert code == 1, out
    assert "each shard takes one 'kvm' resource (1 in the cluster)" in out, out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [s["resources"] for s in summary["shards"]] == [{"CPU": 1.0, "kvm": 1.0}] * 2
    assert "shards: 1 passed, 1 failed, 0 timed out, 0 error(s)" in out, out


def test_a_shard_no_node_can_take_is_cancelled_at_the_runs_deadline(tmp_path, capsys, monkeypatch):
    ray = pytest.importorskip("ray", reason="Ray is not installed: the optional extra sandbox[cluster] (./dev setup installs it)")
    from . import nightly
    from .__main__ import main

    _suite(tmp_path)
    monkeypatch.setattr(nightly, "NIGHTLY_SCHEDULE_SLACK_S", 0.0)  # deadline: 1 shard x 2 s
    ray.init(num_cpus=0, include_dashboard=False, object_store_memory=128 << 20)  # no CPU: a shard can never start
    try:
        code = main(["nightly", "--address", "auto", "--cwd", str(tmp_path / "suite"), "--out", str(tmp_path / "out"),
                     "--shards", "1", "--timeout", "2", "."])
    finally:
        ray.shutdown()
    out = capsys.readouterr().out
    assert code == 1, out
    [shard] = json.loads((tmp_path / "out" / "summary.json").read_text())["shards"]
    assert shard["status"] == "timeout" and "cancelled" in shard["reason"], shard
    assert "shards: 0 passed, 0 failed, 1 timed out, 0 error(s)" in out, out


def test_require_kvm_refuses_a_cluster_without_it_and_a_used_out_dir_is_refused(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed: the optional extra sandbox[cluster] (./dev setup installs it)")
    _suite(tmp_path)
    proc = _nightly(tmp_path, "--out", str(tmp_path / "results"), "--require-kvm")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--require-kvm, but no node" in proc.stderr and not (tmp_path / "results").exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "old.xml").write_text("")
    proc = _nightly(tmp_path, "--out", str(used))
    assert proc.returncode == 2 and "not empty" in proc.stderr


def test_a_node_advertises_kvm_exactly_when_the_projects_probe_chooses_it(monkeypatch):
    from sandbox.vm import qemu

    from .nightly import node_resources

    def no_image():
        raise AssertionError("a forced accelerator needs no guest image")

    monkeypatch.setenv(qemu.ENV_ACCEL, "kvm")
    assert qemu.probe_accel(no_image).accel == "kvm"
    assert node_resources() == ({"kvm": 1.0}, "SANDBOX_ACCEL=kvm")
    monkeypatch.setenv(qemu.ENV_ACCEL, "tcg")
    assert node_resources() == ({}, "SANDBOX_ACCEL=tcg")


def test_plan_collects_only_the_e2e_tests_and_prints_the_shards_without_ray(tmp_path):
    _suite(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "sandbox_sim", "nightly", "--plan", "--shards", "5", "--cwd",
                           str(tmp_path / "suite"), "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["shard 00: 3 test(s) in 1 file(s): test_alpha.py",
                                        "shard 01: 2 test(s) in 1 file(s): test_beta.py"]


def test_docs_quote_the_nightly_limits():
    """docs/testing.md's limits table names every NIGHTLY_* constant with its real value."""
    import re

    from . import nightly

    text = open(os.path.join(ROOT, "docs", "testing.md"), encoding="utf-8").read()
    rows = dict(re.findall(r"^\| `(NIGHTLY_[A-Z_]+)` \| ([^|]+) \|", text, re.M))
    names = {n for n in dir(nightly) if n.startswith("NIGHTLY_")}
    assert set(rows) == names, set(rows) ^ names
    for name, cell in rows.items():
        number = int(re.match(r"[\d,]+", cell.strip()).group(0).replace(",", ""))
        unit = 1 << 20 if "MiB" in cell else 1 << 10 if "KiB" in cell else 1
        assert number * unit == getattr(nightly, name), (name, cell, getattr(nightly, name))


def test_file_seconds_sum_a_files_cases_by_their_classname():
    ids = ["e2e/test_a.py::test_x", "e2e/test_a.py::TestK::test_y[1]", "e2e/test_ab.py::test_z"]
    xml = (b'<testsuites><testsuite>'
           b'<testcase classname="e2e.test_a" name="test_x" time="1.5"/>'
           b'<testcase classname="e2e.test_a.TestK" name="test_y[1]" time="2.25"/>'
           b'<testcase classname="e2e.test_ab" name="test_z" time="4"/>'
           b'<testcase classname="other.test_q" name="test_w" time="9"/>'
           b'</testsuite></testsuites>')
    assert file_seconds(ids, xml) == {"e2e/test_a.py": 3.75, "e2e/test_ab.py": 4.0}


def test_weights_from_an_earlier_run_balance_the_shards_by_time(tmp_path):
    _suite(tmp_path)
    (tmp_path / "suite" / "test_gamma.py").write_text("import pytest\n\n@pytest.mark.e2e\ndef test_g():\n    pass\n")
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "summary.json").write_text(json.dumps({"ok": True, "shards": [
        {"file_seconds": {"test_alpha.py": 1.0, "test_beta.py": 50.0}}, {"file_seconds": {"test_gamma.py": 2.0}}]}))

    def plan(*extra):
        proc = subprocess.run([sys.executable, "-m", "sandbox_sim", "nightly", "--plan", "--shards", "2", "--cwd",
                               str(tmp_path / "suite"), *extra, "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
        return proc.returncode, proc.stdout.splitlines(), proc.stderr

    assert plan() == (0, ["shard 00: 3 test(s) in 1 file(s): test_alpha.py",
                          "shard 01: 3 test(s) in 2 file(s): test_beta.py test_gamma.py"], "")
    assert plan("--weights-from", str(earlier)) == (0, ["shard 00: 2 test(s) in 1 file(s): test_beta.py",
                                                        "shard 01: 4 test(s) in 2 file(s): test_alpha.py test_gamma.py"], "")
    code, _, err = plan("--weights-from", str(tmp_path / "nowhere"))
    assert code == 2 and "summary.json" in err
