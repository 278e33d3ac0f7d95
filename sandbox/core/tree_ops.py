"""TreeOps: ``rm -rf`` and ``mkdir -p`` over the primitive calls of any filesystem object.

A module of its own so that the classes built on it — :class:`~sandbox.core.intercepted_fs.InterceptedFS`,
the 9P client ``sandbox.ninep.wirefs.WireFS``, the simulation's FUSE mount ``MountFS`` — can
each be compiled or interpreted independently: a campaign's build compiles ``intercepted_fs``
with mypyc (``sandbox_sim/compiled.py``), and a class compiled there could not be subclassed
by the interpreted ones.
"""

from __future__ import annotations

import errno

from ..hostfs import DIR, PathError, join, normalize


def entry_path(path: str, what: str) -> str:
    """``path`` normalised; the working root itself is refused (``EBUSY``) as the target of ``what``."""
    p = normalize(path)
    if p == "":
        raise PathError(errno.EBUSY, f"cannot {what} the working root itself")
    return p


class TreeOps:
    """``rm -rf`` and ``mkdir -p`` as a client sends them, over any object with the
    primitives ``lstat``, ``listdir``, ``unlink``, ``rmdir`` and ``mkdir`` (InterceptedFS,
    and the simulation's 9P client ``sandbox.ninep.wirefs.WireFS``)."""

    def remove_tree(self, path: str) -> None:
        """What ``rm -rf`` does: one unlink or rmdir per entry, children first."""
        p = entry_path(path, "remove")
        try:
            st = self.lstat(p)
        except FileNotFoundError:
            return
        if st.kind == DIR:
            for name in sorted(self.listdir(p)):
                self.remove_tree(join(p, name))
            self.rmdir(p)
        else:
            self.unlink(p)

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        """What ``mkdir -p`` does."""
        p = normalize(path)
        parts = p.split("/") if p else []
        for k in range(1, len(parts) + 1):
            sub = "/".join(parts[:k])
            try:
                st = self.lstat(sub)
            except FileNotFoundError:
                self.mkdir(sub, mode)
            else:
                if st.kind != DIR:
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory", sub)
