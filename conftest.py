"""Shared fixtures and markers for sandbox_sim/ (fast tier) and e2e/ (real kernel and host facilities).

* ``world`` — a :class:`sandbox_sim.world.World`, parametrised over the simulated disk and a real
  temp directory, so the same test proves both.
* ``real_workspace`` — a :class:`sandbox.Workspace` on a real temp folder with its store beside it.
* ``ws`` — a :class:`sandbox.Workspace` on the test module's own ``work`` fixture (a real
  folder the module fills as it needs), its store beside it.
* ``snapshot`` — the tree oracle (``sandbox_sim.oracle.snapshot``).
* marker ``slow``: only in the full run (``./dev test --full`` / ``SANDBOX_TEST_FULL=1``).
* marker ``e2e``: needs a real kernel client or host facility; skipped with a reason
  where it is missing (never silently passed).
* ``$SANDBOX_HYPOTHESIS_DB`` (+ ``$SANDBOX_HYPOTHESIS_DB_MODE``): a shared Hypothesis example
  database (``sandbox_sim.budget.example_database``).
* ``SANDBOX_TEST_COMPILED=1``: the tests run on the campaign's compiled build of the hot
  modules (``sandbox_sim/compiled.py``) — for the core's own suites, which must pass on it too
  (``sandbox_sim/test_compiled.py`` runs them so); without a build matching the sources the
  session stops at once with the reason. Tests marked ``interpreted_only`` (they replace,
  deep-copy or subclass a compiled module's internals, which compiled code does not see or
  allow) are skipped there, with that reason.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("SANDBOX_TEST_COMPILED") == "1":  # first: before anything imports the modules
    from sandbox_sim import compiled as _compiled

    if not _compiled.activate()[0]:
        raise pytest.UsageError(f"SANDBOX_TEST_COMPILED=1 but {_compiled.state[1]}")

from sandbox_sim import oracle
from sandbox_sim.budget import FULL, example_database
from sandbox_sim.world import World

_shared_examples = example_database()
if _shared_examples is not None:  # $SANDBOX_HYPOTHESIS_DB: docs/testing.md "Shared Hypothesis examples"
    from hypothesis import settings

    settings.register_profile("sandbox-shared-examples", database=_shared_examples)
    settings.load_profile("sandbox-shared-examples")


def pytest_collection_modifyitems(config, items):
    from sandbox_sim import compiled

    if compiled.state is not None and compiled.state[0]:
        interp = pytest.mark.skip(reason="interpreted_only: it replaces, copies or subclasses a compiled module's internals")
        for item in items:
            if "interpreted_only" in item.keywords:
                item.add_marker(interp)
    if FULL:
        return
    skip = pytest.mark.skip(reason="slow: part of the full run (./dev test --full or SANDBOX_TEST_FULL=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    from sandbox_sim import compiled

    code = compiled.state[1] if compiled.state is not None else "interpreted"
    return f"sandbox test budget: {'FULL' if FULL else 'default (fast tier + smoke)'}; code: {code}"


@pytest.fixture(params=["sim", "real"])
def world(request, tmp_path):
    return World(request.param, str(tmp_path) if request.param == "real" else None)


@pytest.fixture
def real_workspace(tmp_path):
    import sandbox

    work = tmp_path / "work"
    work.mkdir()
    ws = sandbox.Workspace.open(str(work), state_dir=str(tmp_path / "state"))
    yield ws
    ws.close()


@pytest.fixture
def ws(work, tmp_path):
    import sandbox

    w = sandbox.Workspace.open(str(work), state_dir=str(tmp_path / "state"))
    yield w
    w.close()


@pytest.fixture
def snapshot():
    return oracle.snapshot


@pytest.fixture(autouse=True)
def _isolated_state_home(tmp_path, monkeypatch):
    """Default undo stores go under a per-test XDG_STATE_HOME, never the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    yield


@pytest.fixture(scope="session")
def vm_guest():
    """The session guest's image (kernel + initramfs), or a skip with the reason: QEMU is not
    installed, or the image cannot be built here. Every suite that boots a session VM asks for it."""
    import shutil

    from sandbox.vm import image as vm_image

    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (./dev setup installs qemu-system-x86)")
    try:
        return vm_image.guest_image()
    except vm_image.ImageError as e:
        pytest.skip(f"cannot build the guest image here: {e}")


@pytest.fixture
def sample_project(tmp_path):
    """A copy of the packaged sample project (``sandbox/data/sample-project``) at ``tmp_path/project``."""
    import os
    import shutil

    p = tmp_path / "project"
    shutil.copytree(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox", "data", "sample-project"), p,
                    symlinks=True)
    return p
