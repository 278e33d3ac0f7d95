"""Campaigns on a compiled build of the hot modules: the same source, compiled with mypyc.

A campaign spends its CPU in Python-level operations of the simulated disk, the undo store and
the interceptor (docs/simulation.md, "A ninth pass"); compiling those modules with their type
annotations (mypyc, part of mypy) runs the same code in fewer of them. Nothing else changes:
the compiled modules are built from the very files in this tree, every check runs as before,
and ``sandbox_sim/test_compiled.py`` runs campaigns both ways and requires identical results.

    python -m sandbox_sim compile        # build (./dev setup does it); ~1 min with gcc

Invariants:

* **A build is used only for the exact source it was built from.** It lives outside the source
  tree, in ``.build/compiled/<key>/`` under the checkout, where ``<key>`` digests every
  non-test ``.py`` file of ``sandbox/`` and ``sandbox_sim/`` plus the interpreter and the
  compiler's version (:func:`source_key`). Edit any of them and the build no longer matches:
  campaigns say so and run interpreted until ``compile`` runs again. A stale build is never
  loaded, and no ``.so`` ever sits beside a ``.py`` to shadow it.
* **Only campaigns use it, and only when asked before anything imports the modules.**
  :func:`activate` installs an import finder for the compiled modules, and refuses (with the
  reason) when one of them is already imported interpreted — mixing the two is never done.
  ``python -m sandbox_sim run|replay|fanout`` activate it first thing unless ``--interpreted``
  or ``--plant`` is given (a planted defect patches a module function, which compiled callers
  would not see); pytest never does, so the tests, which monkeypatch these modules, always
  run the interpreted code.
* A build is complete or absent: it is made in a temporary directory and renamed into place.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

#: the compiled modules, as paths from the checkout's root (one mypyc group: calls between them
#: are native); every other module stays interpreted and is imported as usual
MODULES = (
    "sandbox/hostfs/memory.py",
    "sandbox/core/store.py",
    "sandbox/core/preimage.py",
    "sandbox/core/interceptor.py",
    "sandbox/core/intercepted_fs.py",
    "sandbox/core/workspace.py",
    "sandbox/core/steps.py",
    "sandbox_sim/oracle.py",
    "sandbox_sim/client.py",
    "sandbox_sim/faults.py",
)
#: mypy's options for the build: only the compiled modules' own code is type-checked (the rest
#: of the tree is not annotated for mypy, and runs interpreted)
MYPY_OPTIONS = ("--follow-imports=silent", "--ignore-missing-imports", "--no-incremental")
#: where builds live, under the checkout (``.gitignore``: ``/.build/``)
BUILD_DIR = os.path.join(".build", "compiled")
#: the compiler's own time limit; past it ``compile`` fails and campaigns stay interpreted
BUILD_TIMEOUT_S = 900
#: set to ``0`` to make every campaign run interpreted (the same as ``--interpreted``)
ENV_DISABLE = "SANDBOX_SIM_COMPILED"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOURCE_PACKAGES = ("sandbox", "sandbox_sim")
_EXT = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so

#: what :func:`activate` did in this process: None (not asked), or (active, reason)
state: tuple[bool, str] | None = None


def module_names() -> list[str]:
    """The dotted names of :data:`MODULES`."""
    return [p[:-3].replace("/", ".") for p in MODULES]


def _sources(root: str) -> list[str]:
    out = []
    for pkg in _SOURCE_PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            out.extend(os.path.join(dirpath, f) for f in sorted(filenames)
                       if f.endswith(".py") and not f.startswith("test_"))
    return out


def compiler_version() -> str | None:
    """The installed mypy's version (None: not installed, nothing can be built)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - part of 3.8+
        return None
    try:
        return version("mypy")
    except PackageNotFoundError:
        return None


def source_key(root: str = ROOT) -> str:
    """The digest a build is filed under: every non-test source of the two packages (a
    constant or a class of an interpreted module may be compiled into a caller), the module
    list, the interpreter's ABI and version, and mypy's version."""
    h = hashlib.blake2b(digest_size=12)
    h.update(repr((MODULES, sys.version, _EXT, compiler_version())).encode())
    for path in _sources(root):
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.blake2b(f.read(), digest_size=16).digest())
    return h.hexdigest()


def build_path(root: str = ROOT, key: str | None = None) -> str:
    return os.path.join(root, BUILD_DIR, key or source_key(root))


def extensions(path: str) -> dict[str, str]:
    """The extension modules of the build at ``path``: dotted name -> file."""
    out = {}
    for dirpath, _, filenames in os.walk(path):
        for f in filenames:
            if f.endswith(_EXT):
                rel = os.path.relpath(os.path.join(dirpath, f), path)
                out[rel[: -len(_EXT)].replace(os.sep, ".")] = os.path.join(dirpath, f)
    return out


def built(root: str = ROOT) -> dict[str, str] | None:
    """The extension modules (:func:`extensions`) of the build of ``root``'s current sources if
    there is one holding every module of :data:`MODULES`; else None."""
    path = build_path(root)
    table = extensions(path) if os.path.isdir(path) else {}
    return table if all(m in table for m in module_names()) else None


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the build's extension modules (the compiled modules and mypyc's shared runtime
    module of the group) by their dotted names; every other name is left to the usual finders."""

    def __init__(self, table: dict[str, str]):
        self.table = table

    def find_spec(self, fullname, path=None, target=None):
        so = self.table.get(fullname)
        if so is None:
            return None
        return importlib.util.spec_from_file_location(fullname, so,
                                                      loader=importlib.machinery.ExtensionFileLoader(fullname, so))


def activate(root: str = ROOT) -> tuple[bool, str]:
    """Use the compiled build of this tree's sources for the rest of the process, if there is
    one. Returns ``(active, reason)``; never raises. Idempotent."""
    global state
    if state is not None and state[0]:
        return state
    state = _activate(root)
    return state


def _activate(root: str) -> tuple[bool, str]:
    if os.environ.get(ENV_DISABLE, "") == "0":
        return False, f"interpreted: {ENV_DISABLE}=0"
    loaded = [m for m in module_names() if m in sys.modules]
    if loaded:
        return False, f"interpreted: {', '.join(loaded)} already imported before the compiled build could be used"
    table = built(root)
    if table is None:
        parent = os.path.join(root, BUILD_DIR)
        older = os.path.isdir(parent) and any(not name.startswith(".") for name in os.listdir(parent))
        why = "the compiled build is older than the sources" if older else "no compiled build"
        return False, f"interpreted: {why} (python -m sandbox_sim compile)"
    sys.meta_path.insert(0, _Finder(table))
    return True, f"compiled ({len(MODULES)} modules, mypyc)"


#: the commands of ``python -m sandbox_sim`` that run campaigns in their own process
CAMPAIGN_COMMANDS = ("run", "replay")


def wanted(argv: list[str]) -> bool:
    """Whether a command line asks for the compiled build: not with ``--interpreted``, nor with
    ``--plant`` (a planted defect replaces a module function, which compiled callers would not see)."""
    return not any(a == "--interpreted" or a == "--plant" or a.startswith("--plant=") for a in argv)


def activate_for(argv: list[str]) -> None:
    """``python -m sandbox_sim ARGV``'s first step: :func:`activate` for a campaign command that
    :func:`wanted` it (``fanout`` activates in its workers, :func:`worker_setup`)."""
    global state
    if argv and argv[0] in CAMPAIGN_COMMANDS:
        if wanted(argv[1:]):
            activate()
        else:
            state = (False, "interpreted: asked for (--interpreted or --plant)")


def worker_setup() -> None:
    """A fan-out worker's start (Ray's ``worker_process_setup_hook``): :func:`activate` before any
    task imports the campaign's modules."""
    activate()


def build(root: str = ROOT, log=print) -> str:
    """Compile :data:`MODULES` of the tree at ``root`` into its build directory (replacing any
    older build); returns the directory. ``RuntimeError`` with the compiler's output if it fails."""
    version = compiler_version()
    if version is None:
        raise RuntimeError("mypy is not installed: pip install -e '.[compiled]' (./dev setup does)")
    key = source_key(root)
    final = build_path(root, key)
    if built(root) is not None:
        log(f"compiled build {key} is up to date")
        return final
    parent = os.path.join(root, BUILD_DIR)
    os.makedirs(parent, exist_ok=True)
    t0 = time.monotonic()
    log(f"compiling {len(MODULES)} modules with mypyc {version} (about a minute)…")
    with tempfile.TemporaryDirectory(dir=parent, prefix=".tmp-") as tmp:
        out, work = os.path.join(tmp, "out"), os.path.join(tmp, "work")
        script = ("import sys\nfrom setuptools import setup\nfrom mypyc.build import mypycify\n"
                  "setup(name='sandbox-compiled', ext_modules=mypycify(sys.argv[3:], opt_level='3', target_dir=sys.argv[2]),"
                  " script_args=['build_ext', '--build-lib', sys.argv[1], '--build-temp', sys.argv[2]])\n")
        proc = subprocess.run([sys.executable, "-c", script, out, work, *MYPY_OPTIONS, *MODULES], cwd=root, capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S, env={**os.environ, "MYPY_FORCE_COLOR": "0"})
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
            raise RuntimeError(f"mypyc failed (exit {proc.returncode}):\n{tail}")
        missing = [m for m in module_names() if m not in extensions(out)]
        if missing:
            raise RuntimeError(f"mypyc built no extension for {', '.join(missing)}")
        if key != source_key(root):
            raise RuntimeError("the sources changed while they were compiled; run compile again")
        for old in os.listdir(parent):
            if not old.startswith("."):
                shutil.rmtree(os.path.join(parent, old), ignore_errors=True)
        os.rename(out, final)
    log(f"compiled build {key} ready in {time.monotonic() - t0:.0f} s: {final}")
    return final
