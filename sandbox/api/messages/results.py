"""The payload of every STDIO ``ok`` response (open: a later version may add fields), by request type: :data:`RESULTS`."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict

from .events import SafeguardTriggered
from .fields import Encoding, NonNeg, Open, PathKind, Pos
from .requests import SafeguardConfig, UndoLimits
from .shapes import Barrier, Folder, InFolder, Listing, Mount, Rollback, Step, StepDiff


class SafeguardSettings(SafeguardConfig):
    """The safeguard configuration in effect."""

    schema_name = "safeguard_settings"
    model_config = ConfigDict(extra="allow")


class UndoLimitSettings(UndoLimits):
    """The undo limits in effect."""

    schema_name = "undo_limit_settings"
    model_config = ConfigDict(extra="allow")


class HelloResult(Open):
    schema_name = "result.hello"
    protocol_version: Pos
    supported_versions: list[Pos]
    agent_version: str
    operations: list[str] = None
    events: list[str] = None


class SessionStarted(Open):
    schema_name = "result.session.start"
    folders: list[Folder]
    mounts: list[Mount]
    guest: str
    accel: str | None = None
    boot_s: float | None = None
    view: str = None
    read_only: bool = None


class Empty(Open):
    pass


class SessionStopped(Empty):
    schema_name = "result.session.stop"


class SessionResetResult(Empty):
    schema_name = "result.session.reset"


class SessionStatusResult(Open):
    schema_name = "result.session.status"
    state: Literal["not_started", "idle", "running", "stopped", "error"]
    vm: str = None
    guest: str | None = None
    accel: str | None = None
    as_root: bool = None
    guest_root: Literal["host-usr", "image"] = None
    folders: list[Folder] = None
    mounts: list[Mount] = None
    running: dict | None = None
    pending_safeguards: list[SafeguardTriggered] = None
    view: str = None
    read_only: bool = None


class SessionRestricted(Open):
    schema_name = "result.session.restrict"
    view: str
    read_only: bool


class UndoRolledBack(Rollback, InFolder):
    schema_name = "result.undo.rollback"


class UndoDiffed(StepDiff, InFolder):
    schema_name = "result.undo.diff"


class UndoHistoryResult(InFolder):
    schema_name = "result.undo.history"
    steps: list[Step]
    barriers: list[Barrier]
    undo_available: bool


class UndoConfigured(Open):
    schema_name = "result.undo.configure"
    limits: UndoLimitSettings


class UndoDiscarded(InFolder):
    schema_name = "result.undo.discard"


class CommandResult(Open):
    """How a command ended, and its undo step (null: no read-write folder) — one per folder in ``step_ids``."""

    step_id: int | None
    step_ids: list[int | None] = None
    exit_code: int
    signal: int | None = None
    cancelled: bool


class AgentExecuted(CommandResult):
    schema_name = "result.agent.execute"


class AgentPrompted(CommandResult):
    schema_name = "result.agent.prompt"


class AgentCancelled(Open):
    schema_name = "result.agent.cancel"
    cancelled: bool = None


class FsListed(Listing):
    schema_name = "result.fs.list"


class FsReadResult(Open):
    schema_name = "result.fs.read"
    path: str = None
    handle: NonNeg = None
    size: NonNeg = None
    offset: NonNeg = None
    data: str
    encoding: Encoding
    bytes: NonNeg = None
    eof: bool


class StatusWarning(Open):
    schema_name = "status_warning"
    kind: str
    path: str = None
    message: str


class FsStatusResult(Open):
    schema_name = "result.fs.status"
    warnings: list[StatusWarning]
    truncated: bool = None


class FsOpened(Open):
    schema_name = "result.fs.open"
    handle: NonNeg
    path: str
    mode: str = None


class FsWritten(Open):
    schema_name = "result.fs.write"
    handle: NonNeg = None
    path: str = None
    bytes_written: NonNeg


class FsSeeked(Open):
    schema_name = "result.fs.seek"
    handle: NonNeg
    position: NonNeg


class FsStatResult(Open):
    schema_name = "result.fs.stat"
    handle: NonNeg = None
    path: str | None = None
    type: PathKind
    size: NonNeg
    mode: NonNeg
    mtime_ns: int
    atime_ns: int = None
    ctime_ns: int = None
    nlink: NonNeg = None
    temporary: bool = None


class FsClosed(Open):
    schema_name = "result.fs.close"
    handle: NonNeg = None


class FsTempCreated(Open):
    schema_name = "result.fs.create_temp"
    handle: NonNeg


class FsPath(Open):
    path: str


class FsMkdired(FsPath):
    schema_name = "result.fs.mkdir"


class FsRemoved(FsPath):
    schema_name = "result.fs.remove"
    removed: NonNeg


class FsRenamed(FsPath):
    schema_name = "result.fs.rename"


class SafeguardConfigured(Open):
    schema_name = "result.safeguard.configure"
    config: SafeguardSettings


class SafeguardConfirmed(Open):
    schema_name = "result.safeguard.confirm"
    safeguard_id: str = None
    action: str = None


class MountAdded(Open):
    schema_name = "result.mount.add"
    mount: Mount
    mounts: list[Mount]


class MountRemoved(Open):
    schema_name = "result.mount.remove"
    mounts: list[Mount]


#: request type -> the model of its ok response's payload
RESULTS: dict[str, type[Open]] = {m.schema_name.removeprefix("result."): m for m in (
    HelloResult, SessionStarted, SessionStopped, SessionResetResult, SessionStatusResult, SessionRestricted, UndoRolledBack, UndoDiffed,
    UndoHistoryResult, UndoConfigured, UndoDiscarded, AgentExecuted, AgentPrompted, AgentCancelled, FsListed, FsReadResult,
    FsStatusResult, FsOpened, FsWritten, FsSeeked, FsStatResult, FsClosed, FsTempCreated, FsMkdired, FsRemoved, FsRenamed,
    SafeguardConfigured, SafeguardConfirmed, MountAdded, MountRemoved)}
