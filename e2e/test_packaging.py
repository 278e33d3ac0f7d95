"""``pip install .`` (non-editable) into a fresh venv gives a working ``sandbox demo``.

The repository's files (tracked and new, as git sees them) are copied to a temporary
source tree — pip builds in place, and the checkout must stay clean — and installed into
a new venv. Then: every file of the package data (the guest's files, the API schema, the
sample project, ``.pyc`` included) is in the installed package byte for byte, and the
installed ``sandbox demo`` runs from a directory outside the checkout with no PYTHONPATH.
Skipped with the reason where the dependencies cannot be fetched or no VM can be booted.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parent.parent
#: package data, as globs under sandbox/ (what pyproject.toml's package-data must cover)
PACKAGE_DATA = ["guest/*", "api/*.json", "data/**/*"]
NO_NETWORK = ("Could not find a version", "No matching distribution", "Failed to establish a new connection",
              "Temporary failure in name resolution", "Network is unreachable", "ProxyError")


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the venv, its installed ``sandbox`` package directory)."""
    tmp = tmp_path_factory.mktemp("pkg")
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, timeout=60)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    src = tmp / "src"
    for rel in filter(None, listed.stdout.split("\0")):
        if (ROOT / rel).is_file() or (ROOT / rel).is_symlink():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel, follow_symlinks=False)
    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    assert made.returncode == 0, made.stderr
    pip = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)],
               timeout=600)
    if pip.returncode != 0 and any(s in pip.stdout + pip.stderr for s in NO_NETWORK):
        pytest.skip(f"pip cannot fetch the dependencies here: {(pip.stdout + pip.stderr).strip()[-300:]}")
    assert pip.returncode == 0, pip.stdout + pip.stderr
    where = _run([str(venv / "bin" / "python"), "-c", "import os, sandbox; print(os.path.dirname(sandbox.__file__))"],
                 cwd=tmp, timeout=60)
    assert where.returncode == 0, where.stderr
    pkg = Path(where.stdout.strip())
    assert pkg.is_relative_to(venv), f"sandbox was imported from {pkg}, not from the venv"
    return venv, pkg


def test_the_package_data_is_installed_byte_for_byte(installed):
    _venv, pkg = installed
    expected = sorted({p for glob in PACKAGE_DATA for p in (ROOT / "sandbox").glob(glob)
                       if p.is_file() and "__pycache__" not in p.parts})
    assert any(p.suffix == ".pyc" for p in expected), "the sample project's .pyc is part of the check"
    missing = [str(p.relative_to(ROOT)) for p in expected
               if not (pkg / p.relative_to(ROOT / "sandbox")).is_file()
               or not filecmp.cmp(p, pkg / p.relative_to(ROOT / "sandbox"), shallow=False)]
    assert missing == []
    # the sample project's modes are part of what the demo restores (the guest's files are
    # put into the initramfs with their own modes, so theirs do not matter)
    sample = [p for p in expected if p.is_relative_to(ROOT / "sandbox" / "data")]
    lost = [p for p in sample if os.access(p, os.X_OK) and not os.access(pkg / p.relative_to(ROOT / "sandbox"), os.X_OK)]
    assert lost == [], "executable bits lost"


def test_the_installed_sandbox_demo_runs(installed, tmp_path, vm_guest):
    venv, _pkg = installed
    r = _run([str(venv / "bin" / "sandbox"), "demo"], cwd=tmp_path, timeout=800)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "guest ready" in r.stdout and "IDENTICAL to the original" in r.stdout, r.stdout
