"""The ``sandbox`` console command, run for real as a subprocess.

History is prepared in this process through :class:`sandbox.Workspace` (closed before the
command runs: the store is locked while a Workspace has it open); the command's stdout,
stderr, exit code and the files it leaves on disk are then checked. The autouse fixture in
conftest.py points XDG_STATE_HOME at a per-test directory, and ``run`` passes it on.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

import sandbox
from sandbox.core.workspace import default_state_dir

# --------------------------------------------------------------------------- helpers


def run(*args: str, cwd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)  # carries the test's XDG_STATE_HOME (and TMPDIR when a test sets it)
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def tree(root: str) -> dict:
    """Everything below ``root`` (not root itself): kind, mode, content or target, and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), None, st.st_mtime_ns)
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("lnk", None, os.readlink(p), st.st_mtime_ns)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("reg", stat.S_IMODE(st.st_mode), f.read(), st.st_mtime_ns)
    return out


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def rows(stdout: str) -> list[list[str]]:
    """The step rows of the ``history`` table (a row starts with its id), split on whitespace."""
    lines = stdout.splitlines()
    assert lines and lines[0].split()[:2] == ["id", "type"], stdout
    return [ln.split() for ln in lines[1:] if ln.split() and ln.split()[0].lstrip("-").isdigit()]


class Project:
    """A working folder with a known tree, and where its store lives."""

    def __init__(self, tmp_path, explicit_state: bool):
        self.base = str(tmp_path)
        self.work = str(tmp_path / "work")
        os.makedirs(os.path.join(self.work, "sub"))
        self._write("f", b"original\n", 0o644)
        self._write("keep.txt", b"keep\n", 0o644)
        self._write("sub/g", b"g content\n", 0o600)
        os.symlink("keep.txt", os.path.join(self.work, "link"))
        self.state = str(tmp_path / "explicit-state") if explicit_state else None
        self.ids: list[int] = []

    def _write(self, rel: str, data: bytes, m: int) -> None:
        p = os.path.join(self.work, rel)
        with open(p, "wb") as f:
            f.write(data)
        os.chmod(p, m)

    @property
    def state_dir(self) -> str:
        return self.state or default_state_dir(self.work)

    def args(self) -> list[str]:
        return ["--workdir", self.work] + (["--state-dir", self.state] if self.state else [])

    def open(self, **kw) -> sandbox.Workspace:
        return sandbox.Workspace.open(self.work, state_dir=self.state, **kw)

    def cli(self, cmd: str, *extra: str) -> subprocess.CompletedProcess:
        return run(cmd, *self.args(), *extra, cwd=self.base)

    def path(self, rel: str) -> str:
        return os.path.join(self.work, rel)

    def two_steps(self) -> None:
        """Step 1 rewrites f and makes it executable; step 2 removes sub/ and creates new.txt."""
        with self.open() as ws:
            with ws.step("echo step1 > f && chmod +x f") as s:
                ws.fs.write_file("f", b"step1\n")
                ws.fs.chmod("f", 0o755)
            self.ids.append(s.id)
            with ws.step("rm -rf sub && echo new > new.txt") as s:
                ws.fs.remove_tree("sub")
                ws.fs.write_file("new.txt", b"new\n")
            self.ids.append(s.id)


@pytest.fixture(params=["default-state", "explicit-state"])
def project(request, tmp_path):
    return Project(tmp_path, explicit_state=request.param == "explicit-state")


@pytest.fixture
def proj(tmp_path):
    """A project whose store is in the default place (under the test's XDG_STATE_HOME)."""
    return Project(tmp_path, explicit_state=False)


def test_default_store_is_under_the_tests_state_home(proj, tmp_path):
    assert os.environ["XDG_STATE_HOME"] == str(tmp_path / "xdg-state")
    assert proj.state_dir.startswith(str(tmp_path / "xdg-state") + os.sep)


# --------------------------------------------------------------------------- --help


def test_top_level_help(tmp_path):
    r = run("--help", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for cmd in ("history", "undo", "discard", "demo"):
        assert f"\n    {cmd} " in out, cmd
    for word in ("--workdir", "-n N", "--force", "--state-dir", "exit codes"):
        assert word in out, word
    for code in range(6):
        assert f"\n  {code}  " in out, code
    assert "5  the undo store is in use by another process" in out
    assert "sandbox discard" in out


@pytest.mark.parametrize("cmd, words", [
    ("history", ["--workdir DIR", "--state-dir DIR", "--json", "newest first", "UNPROTECTED"]),
    ("undo", ["--workdir DIR", "--state-dir DIR", "-n N", "--force", "number of steps to undo", "barrier",
              "no redo"]),
    ("discard", ["--workdir DIR", "--state-dir DIR", "--yes", "version mismatch"]),
    ("demo", ["--sample DIR", "--keep", "identical"]),
])
def test_subcommand_help(tmp_path, cmd, words):
    r = run(cmd, "--help", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: sandbox {cmd} ")
    for word in words:
        assert word in r.stdout, word
    codes = r.stdout.split("exit codes:\n", 1)[1]
    assert codes.startswith("  0  ")
    if cmd == "undo":
        for code in range(6):
            assert f"  {code}  " in codes, code
        assert "3  refused" in codes and "--force" in codes


def test_version_and_bad_usage(tmp_path):
    r = run("--version", cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == f"sandbox {sandbox.__version__}"
    r = run(cwd=str(tmp_path))
    assert r.returncode == 2 and "usage: sandbox" in r.stderr
    r = run("history", cwd=str(tmp_path))  # --workdir is required
    assert r.returncode == 2 and "--workdir" in r.stderr
    r = run("undo", "--workdir", str(tmp_path), "-n", "two", cwd=str(tmp_path))
    assert r.returncode == 2 and "invalid int value" in r.stderr


# --------------------------------------------------------------------------- history


def test_history_table(project):
    project.two_steps()
    r = project.cli("history")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    got = rows(r.stdout)
    assert [int(x[0]) for x in got] == project.ids[::-1]  # newest first
    by_id = {int(x[0]): " ".join(x) for x in got}
    assert by_id[project.ids[1]].endswith("rm -rf sub && echo new > new.txt")
    assert by_id[project.ids[0]].endswith("echo step1 > f && chmod +x f")
    assert all(x[1] == "command" for x in got)
    assert "UNPROTECTED" not in r.stdout and "barrier" not in r.stdout


def test_history_json(project):
    project.two_steps()
    r = project.cli("history", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["workdir"] == os.path.realpath(project.work)
    steps = doc["steps"]
    assert [s["id"] for s in steps] == project.ids[::-1]
    for s in steps:
        assert {"id", "type", "command", "paths", "exit_code", "barriers", "unprotected"} <= set(s)
        assert s["type"] == "command" and s["exit_code"] == 0
        assert s["barriers"] == [] and s["unprotected"] is False
    newest, oldest = steps
    assert newest["command"] == "rm -rf sub && echo new > new.txt"
    assert {"sub", "sub/g", "new.txt"} <= set(newest["paths"])
    assert oldest["command"] == "echo step1 > f && chmod +x f"
    assert oldest["paths"] == ["f"]


def test_history_uses_state_dir_flag(tmp_path):
    """A store at --state-dir is found only through the flag; nothing is created in the default place."""
    p = Project(tmp_path, explicit_state=True)
    p.two_steps()
    default = default_state_dir(p.work)
    assert not os.path.exists(default)
    r = run("history", "--workdir", p.work, "--json", cwd=p.base)
    assert r.returncode == 1
    assert "no undo history" in r.stderr and "--state-dir" in r.stderr
    assert not os.path.exists(default)
    r = p.cli("history", "--json")
    assert r.returncode == 0 and len(json.loads(r.stdout)["steps"]) == 2


@pytest.mark.parametrize("cmd", ["history", "undo"])
def test_no_undo_store(project, cmd):
    before = tree(project.work)
    r = project.cli(cmd)
    assert r.returncode == 1
    assert r.stdout == ""
    assert "no undo history" in r.stderr and os.path.realpath(project.work) in r.stderr
    assert not os.path.exists(project.state_dir)  # looking did not create a store
    assert tree(project.work) == before


@pytest.mark.parametrize("cmd", ["history", "undo", "discard"])
@pytest.mark.parametrize("what", ["missing", "a file"])
def test_missing_folder(tmp_path, cmd, what):
    target = tmp_path / "nowhere"
    if what == "a file":
        target.write_bytes(b"x")
    extra = ["--yes"] if cmd == "discard" else []
    r = run(cmd, "--workdir", str(target), *extra, cwd=str(tmp_path))
    assert r.returncode == 2
    assert r.stdout == ""
    assert "does not exist or is not a directory" in r.stderr and str(target) in r.stderr
    assert "Traceback" not in r.stderr


# --------------------------------------------------------------------------- undo


def test_undo_restores_the_tree_step_by_step(project):
    original = tree(project.work)
    project.two_steps()
    assert read(project.path("f")) == b"step1\n" and not os.path.exists(project.path("sub"))

    r = project.cli("undo")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"undone: step(s) {project.ids[1]};")
    assert f"undoing 1 step(s): {project.ids[1]} (rm -rf sub" in r.stderr
    assert read(project.path("sub/g")) == b"g content\n" and mode(project.path("sub/g")) == 0o600
    assert not os.path.exists(project.path("new.txt"))
    assert read(project.path("f")) == b"step1\n" and mode(project.path("f")) == 0o755  # step 1 still applied
    r = project.cli("history", "--json")
    assert [s["id"] for s in json.loads(r.stdout)["steps"]] == [project.ids[0]]

    r = project.cli("undo")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"undone: step(s) {project.ids[0]};")
    assert read(project.path("f")) == b"original\n" and mode(project.path("f")) == 0o644
    assert tree(project.work) == original

    r = project.cli("undo")
    assert r.returncode == 1
    assert r.stdout == ""
    assert "nothing to undo" in r.stderr
    assert tree(project.work) == original


def test_undo_two_steps(project):
    original = tree(project.work)
    project.two_steps()
    r = project.cli("undo", "-n", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"undone: step(s) {project.ids[1]}, {project.ids[0]};")
    assert tree(project.work) == original
    r = project.cli("history")
    assert r.returncode == 0 and r.stdout.strip() == "no steps in history"


def _link_target(proj, where: str) -> str:
    """A symlink target for `ln -s TARGET sub`: a directory inside the folder, one outside
    it (holding the very name `g` the step removed), or nothing at all."""
    if where == "inside":
        os.mkdir(proj.path("other"))
        return "other"
    if where == "outside":
        outside = os.path.join(proj.base, "outside")
        os.makedirs(os.path.join(outside, "g"))
        return outside
    return "nowhere/at/all"


@pytest.mark.parametrize("where", ["inside", "outside", "dangling"])
def test_undo_n_2_across_a_directory_replaced_by_a_symlink(proj, where):
    """Step 1 deletes sub/, step 2 makes sub a symlink: undo -n 2 is not refused as an
    external change (it was, while one at a time worked), and restores exactly."""
    target = _link_target(proj, where)
    original = tree(proj.work)
    with proj.open() as ws:
        with ws.step("rm -rf sub"):
            ws.fs.remove_tree("sub")
        with ws.step(f"ln -s {target} sub"):
            ws.fs.symlink(target, "sub")
    r = proj.cli("undo", "-n", "2")
    assert r.returncode == 0, r.stderr
    assert tree(proj.work) == original


@pytest.mark.parametrize("where", ["inside", "outside", "dangling"])
def test_undo_of_rm_rf_and_ln_s_in_one_step(proj, where):
    target = _link_target(proj, where)
    original = tree(proj.work)
    with proj.open() as ws:
        with ws.step(f"rm -rf sub && ln -s {target} sub"):
            ws.fs.remove_tree("sub")
            ws.fs.symlink(target, "sub")
    r = proj.cli("history", "--json")
    assert r.returncode == 0 and "recovered" not in r.stderr, r.stderr
    assert [s["command"] for s in json.loads(r.stdout)["steps"]] == [f"rm -rf sub && ln -s {target} sub"]
    assert os.readlink(proj.path("sub")) == target
    r = proj.cli("undo")
    assert r.returncode == 0, r.stderr
    assert tree(proj.work) == original


def test_undo_nothing_left(proj):
    with proj.open():
        pass  # a store with no steps
    before = tree(proj.work)
    r = proj.cli("undo")
    assert r.returncode == 1
    assert "nothing to undo" in r.stderr
    assert tree(proj.work) == before


def test_undo_more_than_there_is(proj):
    proj.two_steps()
    before = tree(proj.work)
    r = proj.cli("undo", "-n", "3")
    assert r.returncode == 1
    assert "only 2 step(s) in history, cannot undo 3" in r.stderr
    assert "undoing" not in r.stderr  # it does not claim to be undoing anything
    assert tree(proj.work) == before
    assert len(json.loads(proj.cli("history", "--json").stdout)["steps"]) == 2


@pytest.mark.parametrize("n", ["0", "-1"])
def test_undo_n_below_one(proj, n):
    proj.two_steps()
    before = tree(proj.work)
    r = proj.cli("undo", "-n", n)
    assert r.returncode == 2
    assert "-n must be at least 1" in r.stderr
    assert tree(proj.work) == before
    assert len(json.loads(proj.cli("history", "--json").stdout)["steps"]) == 2


# --------------------------------------------------------------------------- barriers, external changes


def test_barrier_refuses_then_force(proj):
    with proj.open() as ws:
        with ws.step("echo changed > f") as s:
            ws.fs.write_file("f", b"changed\n")
        ws.record_external_modification(["f"])
    step_id = s.id

    r = proj.cli("history")
    assert r.returncode == 0
    assert "barrier#" in " ".join(rows(r.stdout)[0])
    assert "^ barrier #" in r.stdout and "(f)" in r.stdout and "--force" in r.stdout
    r = proj.cli("history", "--json")
    (entry,) = json.loads(r.stdout)["steps"]
    assert [b["paths"] for b in entry["barriers"]] == [["f"]]

    r = proj.cli("undo")
    assert r.returncode == 3
    assert r.stdout == ""
    assert "refused" in r.stderr and "barrier" in r.stderr
    assert "(f)" in r.stderr and "use --force" in r.stderr
    assert read(proj.path("f")) == b"changed\n"  # nothing touched

    r = proj.cli("undo", "--force")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"undone: step(s) {step_id};")
    assert read(proj.path("f")) == b"original\n"


def test_external_change_refuses_then_force(proj):
    proj.two_steps()
    with open(proj.path("new.txt"), "wb") as f:  # behind the sandbox's back
        f.write(b"edited by hand\n")
    r = proj.cli("undo")
    assert r.returncode == 3
    assert r.stdout == ""
    assert "changed outside the sandbox" in r.stderr
    assert "(new.txt)" in r.stderr and "use --force" in r.stderr
    assert read(proj.path("new.txt")) == b"edited by hand\n"
    assert not os.path.exists(proj.path("sub"))  # nothing else touched either
    assert len(json.loads(proj.cli("history", "--json").stdout)["steps"]) == 2

    r = proj.cli("undo", "--force")
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(proj.path("new.txt"))
    assert read(proj.path("sub/g")) == b"g content\n"


@pytest.mark.parametrize("where", ["inside", "outside", "dangling"])
def test_forced_undo_after_the_user_replaced_a_directory_by_a_symlink(proj, where):
    """The user runs `rm -rf sub && ln -s TARGET sub` on the host after a step wrote in sub/:
    undo is refused (exit 3); undo --force restores the step's pre-state (it used to fail
    part-way on ELOOP and leave a rollback every later command retried and failed)."""
    target = _link_target(proj, where)
    with proj.open() as ws:
        with ws.step("edit sub/g, add sub/new"):
            ws.fs.write_file("sub/g", b"edited\n")
            ws.fs.write_file("sub/new", b"new\n")
    before_step = tree(proj.work)
    del before_step["sub/new"]
    before_step["sub/g"] = None
    import shutil

    shutil.rmtree(proj.path("sub"))
    os.symlink(target, proj.path("sub"))
    r = proj.cli("undo")
    assert r.returncode == 3 and "changed outside the sandbox" in r.stderr, r.stderr
    r = proj.cli("undo", "--force")
    assert r.returncode == 0, r.stderr
    after = tree(proj.work)
    assert read(proj.path("sub/g")) == b"g content\n" and mode(proj.path("sub/g")) == 0o600
    assert {k: v for k, v in after.items() if k not in ("sub", "sub/g")} == \
        {k: v for k, v in before_step.items() if k not in ("sub", "sub/g") and not k.startswith("other")} | \
        {k: v for k, v in after.items() if k.startswith("other")}
    for cmd in (("history",), ("undo",)):
        r = proj.cli(*cmd)
        assert r.returncode in (0, 1) and "Too many levels" not in r.stderr, r.stderr
    assert proj.cli("history").stdout.strip() == "no steps in history"


def _immutable(path: str, on: bool) -> None:
    r = subprocess.run(["chattr", "+i" if on else "-i", path], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot make {path} immutable here (chattr: {r.stderr.strip()}); needs root on ext4/xfs/btrfs")


@pytest.fixture
def stuck_undo(proj):
    """An undo that stops part-way and cannot finish: the user made sub/ immutable
    (chattr +i) after a step created sub/new, so removing sub/new fails with EPERM."""
    with proj.open() as ws:
        with ws.step("echo kept > keep.txt"):
            ws.fs.write_file("keep.txt", b"kept\n")
    after_first = tree(proj.work)
    with proj.open() as ws:
        with ws.step("echo new > sub/new; echo x > f"):
            ws.fs.write_file("f", b"x\n")
            ws.fs.write_file("sub/new", b"new\n")
    _immutable(proj.path("sub"), True)
    try:
        r = proj.cli("undo")
        assert r.returncode == 1, r
        assert "stopped part-way" in r.stderr and "Operation not permitted on sub/new" in r.stderr, r.stderr
        yield after_first
    finally:
        _immutable(proj.path("sub"), False)


def test_an_undo_that_cannot_finish_is_reported_and_discard_always_works(proj, stuck_undo):
    r = proj.cli("history")  # used to exit 1, as every command did, until the store was deleted by hand
    assert r.returncode == 0, r.stderr
    assert [row[-4:] for row in rows(r.stdout)] == [["echo", "kept", ">", "keep.txt"]]  # the step being undone has left history
    assert "could not finish" in r.stderr and "'sub/new'" in r.stderr
    r = proj.cli("undo")
    assert r.returncode == 4 and "undo.rollback_incomplete" in r.stderr and "sandbox discard" in r.stderr, r.stderr
    r = proj.cli("undo", "--force")
    assert r.returncode == 4, r.stderr
    half = tree(proj.work)
    r = proj.cli("discard", "--yes")
    assert r.returncode == 0, r.stderr
    assert tree(proj.work) == half  # the folder is left as it is
    r = proj.cli("history")
    assert r.returncode == 0 and r.stdout.strip() == "no steps in history" and r.stderr == "", r
    assert proj.cli("undo").returncode == 1


@pytest.mark.parametrize("cmd", ["history", "undo"])
def test_an_undo_that_could_not_finish_is_finished_by_the_next_open_once_fixed(proj, stuck_undo, cmd):
    _immutable(proj.path("sub"), False)  # the user lifts what was in the way
    r = proj.cli(cmd)
    assert r.returncode == 0, r.stderr
    assert "an interrupted undo of step" in r.stderr and "was finished" in r.stderr, r.stderr
    if cmd == "undo":  # retrying the undo finishes it, and undoes nothing more
        assert "nothing more was undone" in r.stdout
    assert tree(proj.work) == stuck_undo
    assert len(rows(proj.cli("history").stdout)) == 1


def test_discard_needs_no_recovery(proj):
    """A journal nobody can read in the WAL of a crashed step (a directory where the file
    should be: EISDIR): every open reports it, and discard, which never opens the store,
    clears it. (A journal with garbage lines is readable: recovery undoes what it can
    verify and reports the damage — test_a_damaged_in_progress_journal_is_reported.)"""
    with proj.open() as ws:
        with ws.step("x"):
            ws.fs.write_file("f", b"x\n")
    wal = os.path.join(proj.state_dir, "wal", "in_progress")
    os.makedirs(os.path.join(wal, "journal.jsonl"))
    r = proj.cli("history")
    assert r.returncode == 0 and len(rows(r.stdout)) == 1 and "could not finish" in r.stderr, r
    assert proj.cli("undo").returncode == 4
    r = proj.cli("discard", "--yes")
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(wal)
    assert read(proj.path("f")) == b"x\n"


def test_a_damaged_in_progress_journal_is_reported(proj):
    """Garbage lines in the WAL of a crashed step: recovery undoes nothing it cannot verify,
    says so on stderr, and the store stays usable."""
    with proj.open() as ws:
        with ws.step("x"):
            ws.fs.write_file("f", b"x\n")
    wal = os.path.join(proj.state_dir, "wal", "in_progress")
    os.makedirs(wal)
    with open(os.path.join(wal, "journal.jsonl"), "wb") as f:
        f.write(b'{"seq": 7, "id": 7}\ngarbage\n{"op": "created", "path": "f"}\n')
    r = proj.cli("history")
    assert r.returncode == 0 and len(rows(r.stdout)) == 1 and "damaged journal" in r.stderr, r
    assert proj.cli("history").stderr == ""  # reported once; the WAL is gone
    assert read(proj.path("f")) == b"x\n"
    assert proj.cli("undo").returncode == 0


# --------------------------------------------------------------------------- version mismatch


def test_version_mismatch_then_discard(project):
    project.two_steps()
    with open(os.path.join(project.state_dir, "VERSION"), "w") as f:
        f.write("999\n")
    before = tree(project.work)

    for cmd in ("history", "undo"):
        r = project.cli(cmd)
        assert r.returncode == 4, cmd
        assert r.stdout == ""
        assert "version" in r.stderr and "'999'" in r.stderr
        assert f"sandbox discard --workdir {project.work}" in r.stderr
        if project.state:
            assert f"--state-dir {project.state}" in r.stderr
    assert tree(project.work) == before

    r = project.cli("discard")
    assert r.returncode == 2
    assert "--yes" in r.stderr
    assert read(os.path.join(project.state_dir, "VERSION")) == b"999\n"

    r = project.cli("discard", "--yes")
    assert r.returncode == 0, r.stderr
    assert "discarded" in r.stdout
    assert read(os.path.join(project.state_dir, "VERSION")) != b"999\n"
    assert tree(project.work) == before  # the working folder is not touched

    r = project.cli("history")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "no steps in history"
    r = project.cli("history", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["steps"] == []
    r = project.cli("undo")
    assert r.returncode == 1 and "nothing to undo" in r.stderr


# --------------------------------------------------------------------------- store busy


def test_store_busy(proj):
    proj.two_steps()
    before = tree(proj.work)
    ws = proj.open()
    try:
        for cmd in ("undo", "history"):
            r = proj.cli(cmd)
            assert r.returncode == 5, (cmd, r.stderr)
            assert f"in use by pid {os.getpid()}" in r.stderr
            assert r.stdout == ""
        assert tree(proj.work) == before
    finally:
        ws.close()
    r = proj.cli("undo")  # the lock went with the Workspace
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------- unprotected step


def test_unprotected_step(proj):
    with open(proj.path("big"), "wb") as f:
        f.write(os.urandom(5000))  # incompressible: its preimage alone exceeds the limit
    with proj.open(limits=sandbox.Limits(max_single_step_size_bytes=1000)) as ws:
        with ws.step("touch small") as small:
            ws.fs.write_file("small", b"s")
        with ws.step("rm big") as big:
            ws.fs.unlink("big")
    assert not os.path.exists(proj.path("big"))

    r = proj.cli("history")
    assert r.returncode == 0, r.stderr
    by_id = {int(x[0]): x for x in rows(r.stdout)}
    assert "UNPROTECTED" in by_id[big.id]
    assert "UNPROTECTED" not in by_id[small.id]
    steps = {s["id"]: s for s in json.loads(proj.cli("history", "--json").stdout)["steps"]}
    assert steps[big.id]["unprotected"] is True and steps[small.id]["unprotected"] is False

    before = tree(proj.work)
    for n in ("1", "2"):
        r = proj.cli("undo", "-n", n)
        assert r.returncode == 4, r.stderr
        assert f"step {big.id} is unprotected" in r.stderr
    assert tree(proj.work) == before


# --------------------------------------------------------------------------- demo


def test_demo(tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    r = run("demo", "--in-process", cwd=str(tmp_path))  # the VM demo: e2e/test_vm_session.py
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tree IDENTICAL to the original" in r.stdout
    assert "undone: step(s) 1;" in r.stdout
    assert "rm -rf * && echo 'oops' > README.md" in r.stdout
    assert list(scratch.iterdir()) == []  # its temporary copy is cleaned up


def test_virtiofs_direct_io_needs_a_virtiofs_share(tmp_path):
    """``--virtiofs-direct-io all`` with ``--share 9p`` (or ``--local``) is bad usage, said
    before anything boots; an unknown mode is refused by the parser."""
    for extra in (["--share", "9p"], ["--local"]):
        r = run("run", "--workdir", str(tmp_path), *extra, "--virtiofs-direct-io", "all", "--", "true",
                cwd=str(tmp_path))
        assert r.returncode == 2 and "virtiofs_direct_io='all' needs share='virtiofs'" in r.stderr, (extra, r.stderr)
    r = run("run", "--workdir", str(tmp_path), "--virtiofs-direct-io", "reads", "--", "true", cwd=str(tmp_path))
    assert r.returncode == 2 and "--virtiofs-direct-io" in r.stderr, r.stderr
