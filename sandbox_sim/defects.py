"""Planted defects (mutants) for measuring what the campaign oracle catches.

Each defect is a name in :data:`DEFECTS`; :func:`plant` installs it in this process (a
campaign run with ``--plant NAME``, every fan-out worker with ``fanout --plant NAME``) and
returns a function that removes it. They break the undo on purpose, in the way a real bug
would — one file's metadata left as the undo finds it — so a researcher can check that a
campaign (its seeds, length and fault mix) still catches such a bug, and the tests check the
faster oracle did not lose its teeth (``sandbox_sim/test_campaign.py``,
``sandbox_sim/test_fanout.py``). Never used outside the simulation.
"""

from __future__ import annotations

from typing import Callable

from sandbox.core import preimage
from sandbox.hostfs import REG

#: the regular file (by name, in any directory) whose metadata the planted undo forgets
VICTIM_NAME = "a"


def _forget(field: str):
    original = preimage._apply_meta

    def planted(fs, path, rec, handle=None, st=None):
        if rec["kind"] == REG and path.rsplit("/", 1)[-1] == VICTIM_NAME:
            now_st = handle.fstat() if handle is not None else fs.lstat(path)
            if field == "mode":
                rec = dict(rec, mode=now_st.mode)
            elif field == "mtime_ns":
                rec = dict(rec, mtime_ns=now_st.mtime_ns)
            elif field == "xattrs":
                now = handle.xattrs() if handle is not None else fs.xattrs(path)
                rec = dict(rec, xattrs={k: preimage.b64(v) for k, v in now.items()})
        return original(fs, path, rec, handle, st)

    return original, planted


#: name -> (the oracle field it breaks, description)
DEFECTS = {
    "forget_mode": ("mode", f"an undo that leaves the mode of any regular file named {VICTIM_NAME!r} as it finds it"),
    "forget_mtime": ("mtime_ns", f"an undo that leaves the mtime of any regular file named {VICTIM_NAME!r} as it finds it"),
    "forget_xattrs": ("xattrs", f"an undo that leaves the xattrs of any regular file named {VICTIM_NAME!r} as it finds them"),
}


def plant(name: str) -> Callable[[], None]:
    """Install defect ``name`` (``ValueError`` if unknown); returns its removal.
    ``RuntimeError`` in a process running the compiled build (``sandbox_sim/compiled.py``):
    its callers would never see the replaced function, and the defect would go unnoticed."""
    if name not in DEFECTS:
        raise ValueError(f"unknown defect {name!r}; choose from {', '.join(DEFECTS)}")
    from . import compiled

    if compiled.state is not None and compiled.state[0]:
        raise RuntimeError(f"cannot plant {name}: this process runs the compiled build, whose callers would not see "
                           "the planted function (--plant runs a campaign interpreted in a process of its own)")
    original, planted = _forget(DEFECTS[name][0])
    preimage._apply_meta = planted

    def remove() -> None:
        if preimage._apply_meta is planted:
            preimage._apply_meta = original

    return remove
