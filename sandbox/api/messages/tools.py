"""MCP tool inputs and outputs, built from the shared shapes (:mod:`.shapes`) and bounds (:mod:`.bounds`).

Inputs are closed (extra fields refused); outputs are closed at their top level (a client is
promised exactly these fields) while the shared shapes inside them stay open as on STDIO.
``inputSchema``/``outputSchema`` in ``tools/list`` are these models' schemas
(:func:`sandbox.api.schema.tool_input_schema` / :func:`~sandbox.api.schema.tool_output_schema`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from ...files import READ_FILE_BYTES_MAX
from .bounds import COMMAND_CHARS_MAX, COMMAND_TIMEOUT_S_MAX, PATH_CHARS_MAX, UNDO_COUNT_MAX
from .fields import Closed, Encoding, NonNeg, SafeguardAction, StepType
from .shapes import ErrorBody, FolderBase, Listing, PathChange, Rollback, StepDiff

PathArg = Field(max_length=PATH_CHARS_MAX, description="relative to the first working folder (or the client's "
                "root), or an absolute guest path such as /mnt/working/0/src/main.py")
_CLOSED = ConfigDict(extra="forbid")


class ToolInput(Closed):
    pass


# ---------------------------------------------------------------------------- inputs


class ExecuteCommandIn(ToolInput):
    command: str = Field(min_length=1, max_length=COMMAND_CHARS_MAX,
                         description="a shell command line, run by sh -c in the guest (cwd: the first working folder)")
    timeout_s: float | None = Field(default=None, gt=0, le=COMMAND_TIMEOUT_S_MAX,
                                    description="cancel the command after this many seconds (SIGTERM, then SIGKILL)")


class ReadFileIn(ToolInput):
    path: str = PathArg
    offset: int = Field(default=0, ge=0, description="first byte to read")
    length: int | None = Field(default=None, ge=0, le=READ_FILE_BYTES_MAX,
                               description="bytes to read (default: up to 256 KiB)")


class WriteFileIn(ToolInput):
    path: str = PathArg
    content: str = Field(description="the whole new content of the file")
    encoding: Encoding = Field(default="utf-8", description="how content is encoded")


class EditFileIn(ToolInput):
    path: str = PathArg
    old_text: str = Field(min_length=1, description="exact text to replace; must occur exactly once")
    new_text: str = Field(description="the replacement")
    dry_run: bool = Field(default=False, description="only return the unified diff; change nothing")


class ListDirectoryIn(ToolInput):
    path: str = Field(default="", max_length=PATH_CHARS_MAX,
                      description="directory to list (default: the first working folder)")


class UndoIn(ToolInput):
    count: int = Field(default=1, ge=1, le=UNDO_COUNT_MAX, description="how many of the newest steps to undo")
    force: bool = Field(default=False, description="undo even over changes made outside the sandbox since "
                        "(they are lost): only when the user agreed")


class NoArgsIn(ToolInput):
    pass


class DiffStepIn(ToolInput):
    step_id: int | None = Field(default=None, ge=1, description="the step to show (default: the newest); "
                                "ids come from execute_command, write_file, edit_file and get_undo_history")


# ---------------------------------------------------------------------------- outputs


class ToolOutput(Closed):
    pass


class StepChanges(ToolOutput):
    created: int
    modified: int
    deleted: int
    metadata: int
    paths_total: int
    sample: list[PathChange]
    sample_truncated: bool


class SafeguardDecision(ToolOutput):
    safeguard_id: str
    message: str
    action: SafeguardAction
    decided_by: str = Field(description="user (elicitation) | policy (--on-hold) | timeout | elsewhere")


class ExecuteCommandOut(ToolOutput):
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


class ReadFileOut(ToolOutput):
    path: str
    size: int
    offset: int
    length: int = Field(description="bytes returned")
    content: str
    encoding: Encoding
    eof: bool


class WriteFileOut(ToolOutput):
    path: str
    bytes_written: int
    undo_hint: str


class EditFileOut(ToolOutput):
    path: str
    applied: bool = Field(description="false for a dry run")
    diff: str
    diff_truncated: bool
    undo_hint: str


class ListDirectoryOut(Listing):
    model_config = _CLOSED
    entries_total: int
    truncated: bool


class UndoOut(Rollback):
    model_config = _CLOSED
    forced: bool
    reread_hint: str


class DiffStepOut(StepDiff):
    model_config = _CLOSED
    folder: str = Field(description="guest path of the folder the step belongs to")


class HistoryStep(ToolOutput):
    step_id: int
    type: StepType
    command: str
    exit_code: int | None
    outcome: str | None
    paths_total: int
    paths_sample: list[str]
    started_ns: int | None
    ended_ns: int | None
    barriers_after: int = Field(description="external modifications recorded after this step")


class GetUndoHistoryOut(ToolOutput):
    folder: str = Field(description="guest path of the folder whose history this is")
    undo_available: bool
    steps: list[HistoryStep]
    steps_total: int
    truncated: bool


class FolderOut(FolderBase):
    model_config = _CLOSED
    host_path: str
    undo_available: bool


class GetSessionStatusOut(ToolOutput):
    state: Literal["idle", "running"]
    vm: str
    guest: str | None
    network: str
    folders: list[FolderOut]
    view: str
    read_only: bool
    roots: list[str] = Field(description="the client's roots that narrowed the view")
    roots_refused: list[str] = Field(description="roots outside the session's view (ignored: roots only narrow)")
    pending_safeguards: NonNeg
    server_version: str


class ToolErrorOut(ErrorBody):
    pass

