"""The package's import graph: layered, no upward imports, the library never imports its tests.

The layering (lowest first). A module may import its own unit and any unit of a LOWER
layer, never one of its own layer's other units unless they are listed together below,
never a higher one:

====  ===================================  ==================================================
 0    ``limits``, ``guest``,               leaves: nothing of the package (``guest/`` is what
      ``lifeline``, ``confine``,           runs in the VM: the standard library only; process
      ``frozen``                           lifetime and confinement syscalls; a cheaper
                                           ``__init__`` for frozen dataclasses)
 1    ``hostfs``                           the narrow host-filesystem interface (SPEC §2)
 2    ``core``                             the undo core: no asyncio, no sockets
 3    ``barriers``, ``mounts``             external modifications; providers and mount table
 4    ``serving``                          what every protocol server shares (holds, exports)
 5    ``ninep``, ``fuse``                  the 9P server and client; the FUSE codec and server
 6    ``session.guest``, ``vm``,           the guest seam and its implementations (``local``:
      ``scripted``, ``local``              commands on the host against FUSE mounts, issue 16)
 7    ``session``                          the composition root of a session
 8    ``api.errors``                       the API's error taxonomy (stable codes)
 9    ``files``                            file operations for every API client
10    ``api``                              the STDIO agent and its schemas
11    ``api.mcp``                          the MCP server (issue 14)
12    ``api.ui``                           the web page's server (issue 18; reuses the MCP
                                           server's loopback checks and uvicorn runner)
13    ``cli``, ``sdk``, the package root   entry points (``sdk``: ``sandbox.Sandbox``, the composition root)
14    ``__main__``                         ``python -m sandbox``
====  ===================================  ==================================================

``sandbox/data/`` is package data (the demo's sample project), not part of the graph.

Units are matched by the longest dotted prefix (``sandbox.session.guest`` is its own unit,
below ``sandbox.session``). ``from sandbox import __version__`` is allowed from anywhere
(a constant of the package root). The checks read the source with :mod:`ast`, so imports
inside functions count too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS: list[tuple[str, ...]] = [
    ("limits", "guest", "lifeline", "confine", "frozen"),
    ("hostfs",),
    ("core",),
    ("barriers", "mounts"),
    ("serving",),
    ("ninep", "fuse"),  # -- fuse (issue 16): a peer of ninep
    # -- confined share servers (issue 13): the child process and the agent's proxy of it
    ("serving.shareserver", "serving.remote"),
    ("session.guest", "vm", "scripted", "local"),
    ("session",),
    ("api.errors",),
    ("files",),
    ("api.messages",),  # -- the API's message models (issue 14): STDIO and MCP, one source
    ("api",),
    ("api.mcp",),  # -- MCP server (issue 14): the tools over the shared API machinery
    ("api.ui",),  # -- web page (issue 18)
    ("cli", "sdk", ""),
    ("__main__",),
]
#: package data, not code (the demo's sample project)
NOT_CODE = ("sandbox/data/",)
#: units of one layer that may import each other (none: siblings stay independent)
SIBLINGS_ALLOWED = {frozenset(p) for p in [("scripted", "vm"), ("scripted", "session.guest"), ("vm", "session.guest"),
                                           ("local", "vm")]}  # local: GuestError
FORBIDDEN_TOP = {"sandbox_sim", "sim", "e2e", "bench"}
CORE_FORBIDDEN = {"asyncio", "socket", "selectors", "socketserver"}
ALWAYS_ALLOWED = {"sandbox.__version__"}


def _layer_of() -> dict[str, int]:
    return {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in ``path``; ``from X import y`` gives
    ``X.y`` (y may be a module or a name — both are judged by their unit)."""
    mod = module_name(path, root)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            out += [(node.lineno, f"{prefix}.{a.name}") for a in node.names]
    return out


def unit_of(dotted: str, root: Path) -> str | None:
    """The layering unit of ``sandbox.x.y…`` (longest listed prefix; ``""`` for the package
    root and names defined in it), None outside the package."""
    parts = dotted.split(".")
    if parts[0] != "sandbox":
        return None
    rest = parts[1:]
    known = _layer_of()
    for n in range(len(rest), 0, -1):
        if ".".join(rest[:n]) in known:
            return ".".join(rest[:n])
    if rest and ((root / "sandbox" / rest[0]).is_dir() or (root / "sandbox" / f"{rest[0]}.py").exists()):
        return rest[0]  # a module or package in no layer
    return ""


def violations(root: Path) -> list[str]:
    """Every import under ``root/sandbox`` that breaks the rules (empty: the graph is clean)."""
    layer = _layer_of()
    found: list[str] = []
    for path in sorted((root / "sandbox").rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where.startswith(NOT_CODE):
            continue
        mod = module_name(path, root)
        here = unit_of(mod, root)
        if here not in layer:
            found.append(f"{where}: unit {here!r} is in no layer (add it to LAYERS)")
            continue
        for line, name in imports_of(path, root):
            top = name.split(".")[0]
            if top in FORBIDDEN_TOP:
                found.append(f"{where}:{line}: the library imports the test/bench tree: {name}")
                continue
            if here == "core" and top in CORE_FORBIDDEN:
                found.append(f"{where}:{line}: the core imports {top}")
            if here == "guest" and top != "sandbox" and top not in sys.stdlib_module_names and top != "control":
                found.append(f"{where}:{line}: guest code imports a non-stdlib module {name}")
            if top != "sandbox" or name in ALWAYS_ALLOWED:
                continue
            there = unit_of(name, root)
            if there == here:
                continue
            if there not in layer:
                found.append(f"{where}:{line}: imports {name}, whose unit {there!r} is in no layer")
            elif layer[there] > layer[here]:
                found.append(f"{where}:{line}: upward import of {name} ({here!r}, layer {layer[here]} → "
                             f"{there!r}, layer {layer[there]})")
            elif layer[there] == layer[here] and frozenset((here, there)) not in SIBLINGS_ALLOWED:
                found.append(f"{where}:{line}: sideways import of {name} ({here!r} → {there!r}, layer {layer[here]})")
    return found


def test_the_package_import_graph_is_layered():
    assert violations(ROOT) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


@pytest.mark.parametrize("files,expected", [
    ({"sandbox/core/a.py": "from ..session import runtime\n"}, "upward import of sandbox.session.runtime"),
    ({"sandbox/core/a.py": "import asyncio\n"}, "the core imports asyncio"),
    ({"sandbox/mounts/a.py": "def f():\n    from sandbox_sim import oracle\n"}, "imports the test/bench tree"),
    ({"sandbox/vm/a.py": "from sandbox.api import agent\n"}, "upward import of sandbox.api.agent"),
    ({"sandbox/guest/a.py": "import zstandard\n"}, "non-stdlib module zstandard"),
    ({"sandbox/guest/a.py": "from ..core import undo\n"}, "upward import of sandbox.core.undo"),
    ({"sandbox/barriers/a.py": "from ..mounts import table\n"}, "sideways import"),
    ({"sandbox/newthing/a.py": "x = 1\n"}, "is in no layer"),
])
def test_the_checker_finds_each_kind_of_violation(tmp_path, files, expected):
    found = violations(_tree(tmp_path, files))
    assert len(found) == 1 and expected in found[0], found


def test_the_checker_accepts_downward_and_guest_local_imports(tmp_path):
    root = _tree(tmp_path, {
        "sandbox/session/runtime.py": "from ..core import undo\nfrom ..vm.guest import VmGuest\nimport asyncio\n",
        "sandbox/vm/guest.py": "from ..guest import control\nfrom ..session.guest import Guest\n",
        "sandbox/guest/shim.py": "import json\nimport control as proto\nfrom . import control\n",
        "sandbox/api/agent.py": "from .. import __version__\n",
    })
    assert violations(root) == []
