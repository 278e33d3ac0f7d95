"""Shapes shared by several messages — STDIO results and events, MCP tool outputs — each
defined exactly once here; the messages compose or extend them.

A shape the agent sends is :class:`~.fields.Open` (a later version may add fields); the
MCP tool outputs that extend one close it again (:mod:`.tools`).
"""

from __future__ import annotations

from pydantic import Field

from .fields import Access, Closed, DiffChange, NonNeg, Open, PathKind, RestoreChange, StepType


class InFolder(Open):
    """A result or event about one working folder: ``directory`` is its index."""

    directory: NonNeg = None


class Barrier(Open):
    """An external modification recorded between steps: undoing a step older than it would
    overwrite someone else's edit, so ``undo.rollback`` refuses (``undo.barrier``) unless forced."""

    schema_name = "barrier"
    id: int
    paths: list[str]
    created_ns: int
    reason: str = None
    blocks_rollback_of: list[int] = None


class Step(Open):
    """One undo step of ``undo.history``. A step whose undo data is damaged is still listed:
    ``corrupt`` says why, and if neither its manifest nor its journal header can be read, its
    type is ``unknown`` and ``ended_ns`` null."""

    schema_name = "step"
    id: int
    type: StepType
    command: str = None
    paths: list[str]
    exit_code: int | None = None
    outcome: str
    unprotected: bool = None
    size_bytes: NonNeg = None
    started_ns: int = None
    ended_ns: int | None = None
    corrupt: str = None
    barriers: list[Barrier]


class FolderBase(Open):
    index: NonNeg
    guest_path: str
    access: Access
    undo_available: bool = None


class UndoStore(Open):
    """A read-write folder's undo store now, beside the limits that evict its oldest steps."""

    schema_name = "undo_store"
    size_bytes: NonNeg
    max_log_size_bytes: NonNeg
    max_step_count: NonNeg
    max_single_step_size_bytes: NonNeg


class Folder(FolderBase):
    """A working folder of the session (STDIO): its host path and label too."""

    schema_name = "folder"
    label: str
    path: str
    undo_store: UndoStore = Field(None, description="session.status only, read-write folders with undo")


class Mount(Open):
    """A mount of the session besides the working folders (in-memory or bind)."""

    schema_name = "mount"
    guest_path: str
    label: str = None
    read_only: bool
    files: NonNeg = None
    live: bool = None


class PathChange(Open):
    """What a step did to one path, preimage vs now."""

    schema_name = "path_change"
    path: str
    change: DiffChange


class DiffPath(PathChange):
    """One path of a step's diff (``undo.diff``, MCP ``diff_step``)."""

    schema_name = "diff_path"
    kind: PathKind
    diff: str | None = Field(description="unified diff, before the step vs now (text files)")
    binary: bool
    summary: str = Field(description="one line: sizes, mode, symlink target …")
    diff_truncated: bool


class StepDiff(Open):
    """What one undo step changed, path by path, read from the undo store without changing it."""

    step_id: int
    command: str
    type: str
    paths: list[DiffPath]
    paths_total: NonNeg
    paths_truncated: bool
    approximate: bool = Field(description="something the step left was changed or removed since: paths may be missing")


class RestoredPath(Open):
    """One path an undo changed back."""

    schema_name = "restored_path"
    path: str
    change: RestoreChange


class Rollback(Open):
    """What an undo did: the steps undone, newest first, and the paths restored."""

    step_ids: list[int]
    paths_restored: NonNeg
    paths: list[RestoredPath]
    paths_truncated: bool
    forced: bool = None


class DirEntry(Open):
    """One directory entry (no size/mode/mtime when it could not be read)."""

    schema_name = "entry"
    name: str
    type: PathKind
    size: NonNeg = None
    mode: NonNeg = None
    mtime_ns: int = None
    target: str = Field(None, description="a symlink's target")


class Listing(Open):
    """A directory's entries."""

    path: str
    entries: list[DirEntry]
    truncated: bool = None


class ErrorBody(Closed):
    """A failure: a stable code, a message, and data naming what failed."""

    code: str
    message: str
    data: dict


class StdioError(ErrorBody):
    """A STDIO error response's ``error``: its code is one of the protocol's areas."""

    schema_name = "error"
    code: str = Field(pattern=r"^(protocol|session|agent|undo|fs|safeguard)\.[a-z_]+$")
