"""Pydantic models of every MCP tool's input and output: the one source of the schemas.

``inputSchema``/``outputSchema`` in ``tools/list`` are these models' JSON Schemas
(:func:`input_schema`, :func:`output_schema`); a call's arguments are validated by the
input model (extra fields refused) and its ``structuredContent`` is the output model
dumped — so what a client sees always matches what it was promised. Bounds on inputs
come from the named limits (:mod:`.limits`, :mod:`sandbox.files`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ...files import READ_FILE_BYTES_MAX
from .limits import COMMAND_TIMEOUT_S_MAX

#: the longest command line accepted, in characters (the guest's ARG_MAX is larger; a longer one is refused)
COMMAND_CHARS_MAX = 128 << 10
#: the most steps one undo may roll back
UNDO_COUNT_MAX = 1_000
#: the longest path argument, in characters (a longer one is refused before any lookup)
PATH_CHARS_MAX = 4_096
PathArg = Field(max_length=PATH_CHARS_MAX, description="relative to the first working folder (or the client's "
                "root), or an absolute guest path such as /mnt/working/0/src/main.py")


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------- inputs


class ExecuteCommandIn(_In):
    command: str = Field(min_length=1, max_length=COMMAND_CHARS_MAX,
                         description="a shell command line, run by sh -c in the guest (cwd: the first working folder)")
    timeout_s: float | None = Field(default=None, gt=0, le=COMMAND_TIMEOUT_S_MAX,
                                    description="cancel the command after this many seconds (SIGTERM, then SIGKILL)")


class ReadFileIn(_In):
    path: str = PathArg
    offset: int = Field(default=0, ge=0, description="first byte to read")
    length: int | None = Field(default=None, ge=0, le=READ_FILE_BYTES_MAX,
                               description="bytes to read (default: up to 256 KiB)")


class WriteFileIn(_In):
    path: str = PathArg
    content: str = Field(description="the whole new content of the file")
    encoding: Literal["utf-8", "base64"] = Field(default="utf-8", description="how content is encoded")


class EditFileIn(_In):
    path: str = PathArg
    old_text: str = Field(min_length=1, description="exact text to replace; must occur exactly once")
    new_text: str = Field(description="the replacement")
    dry_run: bool = Field(default=False, description="only return the unified diff; change nothing")


class ListDirectoryIn(_In):
    path: str = Field(default="", max_length=PATH_CHARS_MAX,
                      description="directory to list (default: the first working folder)")


class UndoIn(_In):
    count: int = Field(default=1, ge=1, le=UNDO_COUNT_MAX, description="how many of the newest steps to undo")
    force: bool = Field(default=False, description="undo even over changes made outside the sandbox since "
                        "(they are lost): only when the user agreed")


class NoArgsIn(_In):
    pass


# ---------------------------------------------------------------------------- outputs


class PathChange(_Out):
    path: str = Field(description="guest path")
    change: str = Field(description="created | modified | deleted | metadata | changed (kind unknown)")


class StepChanges(_Out):
    created: int
    modified: int
    deleted: int
    metadata: int
    changed: int = Field(description="paths whose kind of change is not known")
    paths_total: int
    sample: list[PathChange]
    sample_truncated: bool


class SafeguardDecision(_Out):
    safeguard_id: str
    message: str
    action: Literal["allow", "deny"]
    decided_by: str = Field(description="user (elicitation) | policy (--on-hold) | timeout | elsewhere")


class ExecuteCommandOut(_Out):
    exit_code: int
    signal: int | None
    cancelled: bool
    timed_out: bool
    step_id: int | None = Field(description="the undo step of this command (None: no read-write folder)")
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    changes: StepChanges | None
    safeguards: list[SafeguardDecision] = Field(description="safeguard holds this command met and how each was decided")
    undo_hint: str


class ReadFileOut(_Out):
    path: str
    size: int
    offset: int
    length: int = Field(description="bytes returned")
    content: str
    encoding: Literal["utf-8", "base64"]
    eof: bool


class WriteFileOut(_Out):
    path: str
    bytes_written: int
    undo_hint: str


class EditFileOut(_Out):
    path: str
    applied: bool = Field(description="false for a dry run")
    diff: str
    diff_truncated: bool
    undo_hint: str


class DirEntry(_Out):
    name: str
    type: str = Field(description="file | dir | symlink | other")
    size: int | None = None
    mode: int | None = None
    mtime_ns: int | None = None
    target: str | None = Field(default=None, description="a symlink's target")


class ListDirectoryOut(_Out):
    path: str
    entries: list[DirEntry]
    entries_total: int
    truncated: bool


class RestoredPath(_Out):
    path: str
    change: str = Field(description="restored | removed | recreated")


class UndoOut(_Out):
    step_ids: list[int]
    paths_restored: int
    paths: list[RestoredPath]
    paths_truncated: bool
    forced: bool
    reread_hint: str


class HistoryStep(_Out):
    step_id: int
    type: str
    command: str
    exit_code: int | None
    outcome: str | None
    paths_total: int
    paths_sample: list[str]
    started_ns: int | None
    ended_ns: int | None
    barriers_after: int = Field(description="external modifications recorded after this step")


class GetUndoHistoryOut(_Out):
    folder: str = Field(description="guest path of the folder whose history this is")
    undo_available: bool
    steps: list[HistoryStep]
    steps_total: int
    truncated: bool


class FolderOut(_Out):
    index: int
    guest_path: str
    host_path: str
    access: Literal["read_write", "read_only"]
    undo_available: bool


class GetSessionStatusOut(_Out):
    state: Literal["idle", "running"]
    vm: str
    guest: str | None
    network: str
    folders: list[FolderOut]
    view: str
    read_only: bool
    roots: list[str] = Field(description="the client's roots that narrowed the view")
    roots_refused: list[str] = Field(description="roots outside the session's view (ignored: roots only narrow)")
    pending_safeguards: int
    server_version: str


class ToolErrorOut(_Out):
    code: str
    message: str
    data: dict


def input_schema(model: type[BaseModel]) -> dict:
    return model.model_json_schema()


def output_schema(model: type[BaseModel]) -> dict:
    return model.model_json_schema(mode="serialization")
