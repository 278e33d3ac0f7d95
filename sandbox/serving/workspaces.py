"""Opening a working folder's workspace for serving, and watching it for external changes.

Used by the agent's in-process share servers (:mod:`sandbox.session.runtime`, ``"thread"``
mode) and by the confined share-server process (:mod:`sandbox.serving.shareserver`):
one definition of "a watched workspace" — its host filesystem journals the sandbox's own
writes, so the watcher reports only changes made by something else.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, NamedTuple

from ..core.workspace import Workspace

log = logging.getLogger("sandbox.session")


class OpenedWorkspace(NamedTuple):
    """A workspace and, if it is watched, the journal of the sandbox's own writes to its
    folder (:class:`~sandbox.barriers.journal.OwnWrites`): the watcher's, not the workspace's."""

    workspace: Workspace
    own_writes: object | None = None


def open_workspace(path: str, *, watched: bool = False, **kwargs) -> OpenedWorkspace:
    """:meth:`Workspace.open`; ``watched``: its host filesystem also journals the sandbox's own
    writes in the returned ``own_writes`` (what :class:`~sandbox.barriers.watch.ExternalChangeDetector`
    needs to tell them from external ones)."""
    if not watched:
        return OpenedWorkspace(Workspace.open(path, **kwargs))
    from ..barriers.journal import OwnWrites, RecordingHostFS

    inner = {}
    journal = OwnWrites(lambda p: inner["fs"].lstat_or_none(p))

    def wrap(fs):
        inner["fs"] = fs
        return RecordingHostFS(fs, journal)

    return OpenedWorkspace(Workspace.open(path, wrap_work=wrap, **kwargs), journal)


def watch_workspace(own_writes, path: str, on_external: Callable[[list[str]], None] | None = None,
                    on_warning: Callable[[str], None] | None = None, **watcher_kwargs):
    """Start the external-modification watcher on ``path``, the folder of a workspace
    opened with ``open_workspace(watched=True)``, given that call's ``own_writes``; returns
    it (``stop()`` it before closing the workspace). Without callbacks, what it finds is logged.
    ``watcher_kwargs``: :class:`~sandbox.barriers.watch.TreeWatcher`'s (``settle_s``, ``batch_max_s``)."""
    from ..barriers.watch import ExternalChangeDetector

    if own_writes is None:
        raise ValueError("the workspace was not opened with open_workspace(watched=True)")
    d = ExternalChangeDetector(os.path.realpath(path), own_writes,
                               on_external or (lambda paths: log.warning("external modification: %s", paths[:5])),
                               on_warning or (lambda message: log.warning("%s", message)), **watcher_kwargs)
    d.start()
    return d
