"""The campaign's compiled build (sandbox_sim/compiled.py): used only for the exact sources it was
built from, never mixed with the interpreted modules, never with a planted defect — and a
campaign on it does exactly the work of the interpreted one.

The activation tests run in fresh interpreters (this process has long imported the modules)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from sandbox_sim import compiled

pytestmark = pytest.mark.timeout(900)

ROOT = compiled.ROOT


def _py(code: str, cwd: str = ROOT, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _mini_tree(tmp_path) -> str:
    root = str(tmp_path / "tree")
    for rel, text in {"sandbox/a.py": "A = 1\n", "sandbox/core/b.py": "B = 2\n", "sandbox_sim/c.py": "C = 3\n",
                      "sandbox_sim/test_c.py": "def test_c(): pass\n", "sandbox/notes.md": "x\n"}.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)
    return root


def _edit(root: str, rel: str, text: str) -> None:
    with open(os.path.join(root, rel), "a") as f:
        f.write(text)


def test_the_key_changes_with_every_source_but_not_with_tests_or_other_files(tmp_path):
    root = _mini_tree(tmp_path)
    k0 = compiled.source_key(root)
    assert compiled.source_key(root) == k0
    _edit(root, "sandbox_sim/test_c.py", "# a test changed\n")
    _edit(root, "sandbox/notes.md", "y\n")
    assert compiled.source_key(root) == k0
    _edit(root, "sandbox/core/b.py", "# one comment\n")
    k1 = compiled.source_key(root)
    assert k1 != k0
    _edit(root, "sandbox_sim/c.py", "D = 4\n")
    assert compiled.source_key(root) not in (k0, k1)


def test_no_build_or_an_older_one_is_not_used(tmp_path):
    root = _mini_tree(tmp_path)
    code = f"from sandbox_sim import compiled; print(compiled.activate({root!r}))"
    assert "no compiled build" in _py(code)
    older = os.path.join(root, compiled.BUILD_DIR, "0" * 24, "sandbox", "hostfs")
    os.makedirs(older)
    shutil.copy(sys.executable, os.path.join(older, "memory" + compiled._EXT))  # any file: it must not even be looked at
    out = _py(code)
    assert out.startswith("(False,") and "older than the sources" in out


def test_a_module_already_imported_interpreted_is_never_mixed_with_compiled_ones():
    out = _py("import sandbox.hostfs.memory\nfrom sandbox_sim import compiled\nprint(compiled.activate())")
    assert out.startswith("(False,") and "already imported" in out and "sandbox.hostfs.memory" in out


def test_campaign_commands_choose_interpreted_with_plant_or_interpreted():
    assert compiled.wanted(["--seed", "1"])
    assert not compiled.wanted(["--seed", "1", "--interpreted"])
    assert not compiled.wanted(["--plant", "forget_mode"])
    assert not compiled.wanted(["--plant=forget_mode"])


def test_a_planted_defect_runs_interpreted_and_is_caught_even_with_a_build():
    """A defect patches ``preimage._apply_meta``; compiled callers would not see it, so the
    campaign must not use the build (here or not)."""
    proc = subprocess.run([sys.executable, "-m", "sandbox_sim", "run", "--plant", "forget_mode", "--seed", "3",
                           "--steps", "10", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "code: interpreted" in proc.stdout
    assert "VIOLATION" in proc.stderr


def test_a_defect_is_never_planted_in_a_process_running_the_compiled_build():
    out = _py("from sandbox_sim import compiled, defects\ncompiled.state = (True, 'compiled')\n"
              "try:\n    defects.plant('forget_mode')\nexcept RuntimeError as e:\n    print('refused:', e)")
    assert out.startswith("refused: cannot plant forget_mode: this process runs the compiled build"), out


needs_build = pytest.mark.skipif(compiled.built() is None, reason="no compiled build of this tree (python -m sandbox_sim compile; "
                                 "./dev setup builds it with mypy and gcc): campaigns run interpreted")

_OK = re.compile(r"ok: (\d+) actions, (\d+) ops executed, (\d+) faults injected, (\d+) recoveries verified")


def _campaign(seed: int, steps: int, faults: str, *extra: str) -> tuple[str, tuple]:
    proc = subprocess.run([sys.executable, "-m", "sandbox_sim", "run", "--seed", str(seed), "--steps", str(steps),
                           "--faults", faults, "--quiet", *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = next(line for line in proc.stdout.splitlines() if line.startswith("code: "))
    return code, _OK.search(proc.stdout).groups()


@needs_build
@pytest.mark.parametrize("seed,faults", [(7, ""), (11, "crash,enospc,eio,torn,power"), (12, "crash,torn"), (13, "power")])
def test_a_campaign_on_the_build_does_exactly_the_interpreted_campaigns_work(seed, faults):
    """Same ops, faults injected and recoveries verified (each fault lands at the same host
    call of the same action), with the undo invariant checked after every action on both."""
    code_c, counts_c = _campaign(seed, 400, faults)
    code_i, counts_i = _campaign(seed, 400, faults, "--interpreted")
    assert code_c.startswith("code: compiled"), code_c
    assert code_i.startswith("code: interpreted"), code_i
    assert counts_c == counts_i
    assert int(counts_c[1]) > 0


@needs_build
def test_the_build_is_what_the_campaign_imports():
    out = _py("import sys\nsys.argv = ['x', 'run']\nfrom sandbox_sim import compiled\ncompiled.activate_for(['run'])\n"
              "import sandbox.hostfs.memory as m, sandbox.core.store as s\nprint(m.__file__)\nprint(s.__file__)")
    files = out.splitlines()
    assert all(f.startswith(compiled.build_path()) and f.endswith(compiled._EXT) for f in files), files


#: the core's own suites, which must hold on the compiled build too (tests marked
#: ``interpreted_only`` skip there: they replace, copy or subclass compiled internals)
CORE_SUITES = ("test_core.py", "test_crash.py", "test_core_ops.py", "test_store_integrity.py", "test_models.py",
               "test_barriers.py", "test_power_loss.py", "test_campaign.py", "test_explore.py", "test_hostfs.py")


@needs_build
def test_the_cores_own_suites_pass_on_the_build():
    """A campaign covers what campaigns do; these cover the rest of the compiled modules
    (history, barriers, recovery reports, every fault position, the disk's parity with a real
    one) — a mypyc difference (a wrong annotation is a TypeError there, a dataclass copy that
    needs a ``__dict__``) fails here."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           *(os.path.join("sandbox_sim", f) for f in CORE_SUITES)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "SANDBOX_TEST_COMPILED": "1"})
    tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
    assert proc.returncode == 0, tail
    assert "interpreted_only: it replaces" in proc.stdout, tail  # skipped: so the session ran compiled
    assert re.search(r"\d+ passed", tail), tail
