"""An export as served: one provider shared by every connection (of any protocol) attached to it.

What a second protocol server (FUSE, virtio-fs) needs besides its codec, kept out of
``sandbox.ninep``:

* the **handle registry** — every live handle (a 9P fid, a FUSE node or file handle) of
  every connection, by the path it names, so that a rename through any connection moves
  every handle at or below the old name: handles follow their files as a local file
  descriptor would (:meth:`Export.renamed`);
* the **hold gate** (:class:`~sandbox.serving.holds.HoldGate`) for an intercepted
  provider, whose holds the session's :class:`~sandbox.serving.holds.HoldBroker` decides;
* the byte-range **lock table** (:class:`~sandbox.serving.locks.LockTable`).

A handle is any object with a mutable ``path`` attribute (relative to the export's root).
Invariant: a handle is in the registry under exactly its current ``path`` from
:meth:`Export.add` to :meth:`Export.discard`; paths are shared strings (one per path,
however many handles name it — a path is ≤ 4 KiB).
"""

from __future__ import annotations

from typing import Protocol

from ..hostfs import is_within
from ..limits import ServerLimits
from ..mounts import Provider
from .holds import HoldBroker, HoldGate
from .locks import LockTable


class Handle(Protocol):
    path: str


class Export:
    """One provider as served (module docstring). ``name``: its attach name."""

    def __init__(self, provider: Provider, holds: HoldBroker | None = None, limits: ServerLimits = ServerLimits(),
                 name: str = ""):
        self.provider = provider
        self.name = name
        self.gate = (HoldGate(provider.interceptor, holds if holds is not None else HoldBroker(),
                              limits.held_requests_per_export_max, context={"export": name})
                     if provider.interceptor is not None else None)
        self.locks = LockTable(limits.locks_per_export_max)
        self._by_path: dict[str, set[Handle]] = {}  # every live handle of every connection, by path

    @property
    def gated(self) -> bool:
        """Mutations here pass the hold gate and count as in flight for the step tracker."""
        return self.gate is not None

    def add(self, f: Handle) -> None:
        fids = self._by_path.get(f.path)
        if fids is None:
            self._by_path[f.path] = {f}
        else:
            f.path = next(iter(fids)).path  # one string per path, however many handles
            fids.add(f)

    def discard(self, f: Handle) -> None:
        fids = self._by_path.get(f.path)
        if fids is not None:
            fids.discard(f)
            if not fids:
                del self._by_path[f.path]

    def move(self, f: Handle, path: str) -> None:
        self.discard(f)
        f.path = path
        self.add(f)

    def fids_at(self, path: str) -> set:
        """Every live handle (of any connection) whose path is ``path``."""
        return self._by_path.get(path, set())

    handles_at = fids_at

    def exchanged(self, a: str, b: str, a_is_dir: bool, b_is_dir: bool) -> None:
        """RENAME_EXCHANGE: the handles at ``a`` (and below, for a directory) move to ``b`` and
        those at ``b`` to ``a`` — both sets taken before either moves."""
        at_a = [(p, f) for p in ([p for p in self._by_path if is_within(p, a)] if a_is_dir else [a])
                for f in list(self._by_path.get(p, ()))]
        at_b = [(p, f) for p in ([p for p in self._by_path if is_within(p, b)] if b_is_dir else [b])
                for f in list(self._by_path.get(p, ()))]
        for p, f in at_a:
            self.move(f, b + p[len(a):])
        for p, f in at_b:
            self.move(f, a + p[len(b):])

    def renamed(self, src: str, dst: str, is_dir: bool) -> None:
        """Handles follow their files: those at ``src`` (and below it, for a directory) move."""
        paths = [p for p in self._by_path if is_within(p, src)] if is_dir else [src]
        for p in paths:
            for f in list(self._by_path.get(p, ())):
                self.move(f, dst + p[len(src):])
